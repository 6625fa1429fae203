"""A study's trials as every view takes them: `Trial`, the one shape of a trial of the record (`launch.record`
makes them), the `Study` that holds them, the metric names and table columns every view uses, and how runs group by a
searched key. Reports (`report.py`), comparisons (`compare.py`) and the leaderboard all read these."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from a2core.config import flatten, inapplicable_model_keys
from a2core.selection import finite
from dashboards.tracking import (TAG_CONFIG_HASH, TAG_END_REASON, TAG_STOPPED_CUTOFF, TAG_STOPPED_EARLY,
                                 TAG_STOPPED_RUNG, TAG_TRIAL_ID, param_value)

CIDER = "val/CIDEr"
FUSION_LABEL = {"none": "none (baseline)", "max": "max", "moving_average": "moving average",
                "exp_decay": "exp. decay", "gate": "gate"}  # in the paper's order
# Table 3's metrics on the selection split (val, logged every epoch: a run's numbers at its best epoch) ...
TABLE_METRICS = [("B-1", "val/BLEU-1"), ("B-4", "val/BLEU-4"), ("METEOR", "val/METEOR"),
                 ("ROUGE-L", "val/ROUGE-L"), ("CIDEr", "val/CIDEr"), ("SPICE", "val/SPICE")]
# ... and on the held-out split: the selected checkpoint decoded with beam search when the run ended (no SPICE)
TEST_CIDER = "test/CIDEr"
TEST_TABLE_METRICS = [("B-1", "test/BLEU-1"), ("B-4", "test/BLEU-4"), ("METEOR", "test/METEOR"),
                      ("ROUGE-L", "test/ROUGE-L"), ("CIDEr", TEST_CIDER)]


def metric_label(metric: str) -> str:
    """A metric as a heading: "val/CIDEr" -> "val CIDEr", "val/BLEU-4" -> "val BLEU-4"; others as they are."""
    return metric.replace("/", " ", 1) if metric.startswith(("val/", "test/")) else metric


def selection_column(metric: str = CIDER) -> tuple[str, str]:
    """(heading, metric) of the number each row and each run's checkpoint were chosen by: the study's metric (on
    the val images), "val CIDEr (selection)" by default."""
    return f"{metric_label(metric)} (selection)", metric
SEED_KEY = "train.seed"

# the summary's name of a trial's field where it differs from the attribute's (`lambda` is a Python keyword)
_ATTRIBUTE = {"lambda": "lam", "best": "best_value", "best_epoch": "best_step"}
# a trial's row of `summary.json` ("trials"), in its order; `config` is in the record's rows, not in the file
ROW_KEYS = ("trial_id", "state", "stopped_early", "config", "fusion", "lambda", "seed", "epochs_done",
            "epochs_planned", "last", "best", "test", "sampled", "epochs_reported", "best_epoch", "best_checkpoint",
            "best_checkpoint_problem", "best_checkpoint_epoch", "train_run", "compute", "error", "ended")


@dataclass(frozen=True)
class Trial:
    """One trial of a study: the one shape every view reads (the live table, `status`, `summary.json`, `compare`,
    `report`, `package` and the MLflow export). Tune's part (id, name, state, sampled keys, retries, last error
    line, last result) is all a trial of Tune's experiment state has (`launch.conclusions.tune_trial`); the record
    (`launch.record.trial_row`, `StudyRecord.load`) adds the rest from the trial's run folder. `best_value` and
    `best_step` (its epoch) are the record's, by the one rule of `a2core.selection`, never re-derived here.

    Immutable: the record builds each trial whole (`launch.record.trial_row`, `table_row`); a changed copy is
    `dataclasses.replace`. A trial reads as its row of `summary.json` too: `trial["best_epoch"]`, `trial.row()`; so
    tables take trials and replicate groups (dicts) alike."""
    trial_id: str
    name: str = ""                                # Tune's trial name, its MLflow run's name
    state: str = "PENDING"                        # Tune's: PENDING, RUNNING, PAUSED, TERMINATED, ERROR
    sampled: dict = field(default_factory=dict)   # the searched keys as Tune sampled them
    retries: int = 0
    error: str | None = None                      # the last line of its last error
    last_result: dict = field(default_factory=dict)
    study: str = ""
    config: dict = field(default_factory=dict)    # resolved (`StudySpec.trial_config`); {} when it no longer resolves
    config_hash: str | None = None                # its replicate group (`dashboards.stats.config_hash`)
    epochs_done: int = 0
    epochs_planned: int = 0
    last: float | None = None                     # the study metric's latest value
    best_value: float | None = None               # ... at the best epoch
    test: float | None = None                     # the selected checkpoint on the test split, when it ended
    epochs_reported: list[int] = field(default_factory=list)
    best_step: int | None = None                  # the best epoch (its MLflow step)
    best_checkpoint: str | None = None            # the stored checkpoint of the best epoch that has one
    best_checkpoint_problem: str | None = None
    best_checkpoint_epoch: int | None = None
    train_run: str | None = None                  # its run folder
    compute: dict = field(default_factory=dict)   # {unit: seconds}
    stopped_early: dict | None = None             # the scheduler's record {"rung", "cutoff"}
    ended: dict | None = None                     # its end record (it diverged)
    under_way: dict | None = None                 # a running trial's epoch under way: {"stage", "epoch", "done",
    #                                               "total", "seconds_per_step"} (`launch.layout.progress_record`)
    status: str = ""                              # its MLflow run's: FINISHED, RUNNING, KILLED, FAILED
    final: dict[str, float] = field(default_factory=dict)  # latest value of every metric
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # TABLE_METRICS and train/loss
    per_image: Callable[[str], dict | None] = lambda split: None  # split -> {image id: CIDEr-D}, or None

    @property
    def fusion(self) -> str | None:
        return self.config.get("model", {}).get("fusion", self.sampled.get("fusion"))

    @property
    def lam(self) -> float | None:
        """lambda, None for fusion none (no mask network: it weighs the mask loss)."""
        model = self.config.get("model", {})
        return None if model.get("fusion") == "none" else model.get("lambda", self.sampled.get("lambda"))

    @property
    def seed(self):
        return self.config.get("train", {}).get("seed", self.sampled.get("seed"))

    @property
    def params(self) -> dict[str, str]:
        """Its resolved config as MLflow shows it: dotted keys, text values."""
        return {k: param_value(v) for k, v in flatten(self.config).items()}

    @property
    def tags(self) -> dict[str, str]:
        """Its trial id, replicate group, stop record and end reason as its MLflow run's tags."""
        tags = {TAG_TRIAL_ID: self.trial_id, **({TAG_CONFIG_HASH: self.config_hash} if self.config_hash else {})}
        if self.stopped_early:
            tags[TAG_STOPPED_EARLY] = "true"
            if self.stopped_early.get("rung") is not None:
                tags[TAG_STOPPED_RUNG] = str(int(self.stopped_early["rung"]))
            if finite(self.stopped_early.get("cutoff")) is not None:
                tags[TAG_STOPPED_CUTOFF] = f"{self.stopped_early['cutoff']:.6g}"
        if self.ended:
            tags[TAG_END_REASON] = self.ended["reason"]
        return tags

    def __getitem__(self, key: str):
        return getattr(self, _ATTRIBUTE.get(key, key))

    def get(self, key: str, default=None):
        return getattr(self, _ATTRIBUTE.get(key, key), default)

    def row(self, config: bool = True) -> dict:
        """Its row of `summary.json` (`config`: with its resolved config, which the file leaves out)."""
        return {key: self[key] for key in ROW_KEYS if config or key != "config"}

    def score(self, metric: str) -> float | None:
        """A metric at the best epoch when logged there, else its final value."""
        at_best = dict(self.history.get(metric, [])).get(self.best_step)
        return finite(self.final.get(metric) if at_best is None else at_best)

    def scores(self, metrics: list[str]) -> dict[str, float]:
        return {m: score for m in metrics if (score := self.score(m)) is not None}


# a replicate group's entry of `summary.json` ("groups", "best_group", "baseline_group"), in its order
GROUP_KEYS = ("config_hash", "fusion", "lambda", "sampled", "trials", "seeds", "best_trial", "values", "test_values",
              "mean", "low", "high", "n", "identical", "stopped_early")


@dataclass(frozen=True)
class ReplicateGroup:
    """The trials of one configuration that differ only in the seed (`dashboards.stats.config_hash`): their ids and
    seeds in Tune's order, their best values of the study metric (of those that reported it) with the mean and 95%
    interval over seeds (`dashboards.stats.seed_interval`), their test values, the group's best trial
    (`dashboards.stats.best_trial`) and the stop record of one of them the scheduler stopped early. Built in one
    place, `launch.record.replicate_groups`; `row()` is its entry of `summary.json`. Reads as that entry too
    (`group["n"]`), so that tables take groups and trials alike."""
    config_hash: str
    fusion: str | None = None
    lam: float | None = None                      # lambda (None for fusion none)
    sampled: dict = field(default_factory=dict)   # the searched keys of its first trial, seed keys left out
    trials: list[str] = field(default_factory=list)
    seeds: list = field(default_factory=list)
    best_trial: str | None = None
    values: list[float] = field(default_factory=list)
    test_values: list[float] = field(default_factory=list)
    mean: float | None = None
    low: float | None = None
    high: float | None = None
    n: int = 0
    identical: bool | None = None                 # every seed scored the same; None (not in its row) when none scored
    stopped_early: dict | None = None

    __getitem__, get = Trial.__getitem__, Trial.get  # its entry's names: `lambda` is `lam`

    def row(self) -> dict:
        """Its entry of `summary.json`."""
        return {key: self[key] for key in GROUP_KEYS if key != "identical" or self.identical is not None}


@dataclass
class Study:
    """A study's record handed to the dashboards: its trials that have started, where the record is, whether a writer
    is still running it, the metric and mode it selects by, and what its record names best: `best_trial` (a trial id)
    and `best_group` (a config hash), by the one rule of `launch.record.summarize`."""
    name: str
    runs: list[Trial]
    source: str = ""
    running: bool = False
    metric: str = CIDER
    mode: str = "max"
    best_trial: str | None = None
    best_group: str | None = None
    confirm_from: int | None = None  # `search.confirm`'s first seed: rows selected below it, verdicts from it on

    def best_run(self) -> Trial | None:
        """The run of the record's best trial (None before any trial reported the metric)."""
        return next((r for r in self.runs if r.trial_id == self.best_trial), None)

    def still_running_note(self, what: str) -> str | None:
        """"note: study NAME is still running (...)" while a writer runs it, so that a comparison or a report of a
        study part way through says so; None otherwise."""
        if not self.running:
            return None
        done = sum(1 for run in self.runs if run.status == "FINISHED")
        return (f"note: study {self.name} is still running ({done} of {len(self.runs)} trial runs finished so far): "
                f"this {what} covers only what is logged up to now")


# -- grouping --------------------------------------------------------------------------
def searched_keys(runs: list[Trial]) -> list[str]:
    """Params that vary across the runs (the searched ones), seed keys and per-run strings (paths) excluded."""
    out = []
    # each run's params once: `Trial.params` flattens its config, keys x runs times was most of a report at 1,000 trials
    params = [r.params for r in runs]
    for k in sorted({k for p in params for k in p} - {SEED_KEY}):
        values = [p.get(k) for p in params]
        numeric = all(v is None or finite(v) is not None for v in values)
        # a path of its own in every run (an output folder): not a searched key. Only paths: a categorical key
        # with another value in every run (fusions none, max, gate at one seed each) is the one the study varies
        path_like = (not numeric and len(runs) > 2 and len(set(values)) == len(runs)
                     and all(isinstance(v, str) and ("/" in v or "\\" in v) for v in values if v is not None))
        if len(set(values)) > 1 and not path_like:
            out.append(k)
    return out


def seed_number(seed) -> int | None:
    """A seed as a number (a trial's `seed`, a group's entry of `seeds`); None where it is not one."""
    # a whole number only: int(2.5) is 2, which counted seeds 2 and 2.5 as one (while the text "2.5" was none)
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed  # exactly, however large (a float holds integers exactly to 2**53 only)
    number = None if isinstance(seed, bool) else finite(seed)
    return int(number) if number is not None and number.is_integer() else None


def group_value(run: Trial, by: str) -> str | None:
    """The value of `by` for a run: a param (exact or dotted suffix), else a key its search sampled (exact or
    dotted suffix), an a2.<by> tag or a tag; None when `by` is a model key the run's fusion does not use (lambda of
    fusion none), whatever an older run logged."""
    if by.rsplit(".", 1)[-1] in inapplicable_model_keys(run.fusion):
        return None
    params = run.params
    if by in params:
        return params[by]
    for k, v in sorted(params.items()):
        if k.endswith("." + by):
            return v
    # a run whose config no longer resolves (an older study whose keys moved on) has no params: the keys its search
    # sampled for it, by their space key (alias or dotted path), as `Trial.fusion` reads them
    sampled = run.sampled or {}
    for k in [by, *sorted(k for k in sampled if k.endswith("." + by))]:
        if sampled.get(k) is not None:
            return param_value(sampled[k])
    return run.tags.get(f"a2.{by}") or run.tags.get(by)


def sort_key(value: str) -> tuple:
    """Numbers by value, then fusions in the paper's order, then other strings."""
    if finite(value) is not None:
        return (0, float(value))
    return (1, list(FUSION_LABEL).index(value)) if value in FUSION_LABEL else (2, str(value))
