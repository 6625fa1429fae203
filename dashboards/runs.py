"""A study's runs as the read side takes them: one `RunSummary` per trial of the record (`launch.record` makes
them), the `Study` that holds them, the metric names and table columns every view uses, and how runs group by a
searched key. Reports (`report.py`), comparisons (`compare.py`) and the leaderboard all read these."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from a2core.config import inapplicable_model_keys
from a2core.selection import finite

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
SELECTION_COLUMN = ("val CIDEr (selection)", CIDER)  # the number each row was chosen by, on the val images
SEED_KEY = "train.seed"

@dataclass
class RunSummary:
    """One trial of a study's record, as the dashboards read it: `params` its resolved config as MLflow shows it
    (dotted keys, text values), `tags` its fusion, seed, replicate group and stop record (`dashboards.stats` tags),
    `status` the status its MLflow run has (FINISHED, RUNNING, KILLED, FAILED). `best_value` and `best_step` are the
    record's: the study metric at the trial's best epoch, by the one rule of `a2core.selection` (never re-derived
    here)."""
    trial_id: str
    name: str
    status: str
    params: dict[str, str]
    tags: dict[str, str]
    final: dict[str, float]                       # latest value of every metric
    best_value: float | None = None
    best_step: int | None = None
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # TABLE_METRICS and train/loss
    per_image: Callable[[str], dict | None] = lambda split: None  # split -> {image id: CIDEr-D}, or None

    @property
    def fusion(self) -> str:
        return self.params.get("model.fusion", "unknown")

    @property
    def seed(self) -> str | None:
        return self.params.get(SEED_KEY)

    @property
    def lam(self) -> float | None:
        """lambda, None for fusion none (no mask network)."""
        return None if self.fusion == "none" else finite(self.params.get("model.lambda"))

    def score(self, metric: str) -> float | None:
        """A metric at the best epoch (the step of the highest val/CIDEr) when logged there, else its final value."""
        at_best = dict(self.history.get(metric, [])).get(self.best_step)
        return finite(self.final.get(metric) if at_best is None else at_best)

    def scores(self, metrics: list[str]) -> dict[str, float]:
        return {m: score for m in metrics if (score := self.score(m)) is not None}


@dataclass
class Study:
    """A study's record handed to the dashboards: its trials that have started, where the record is, whether a writer
    is still running it, the metric and mode it selects by, and what its record names best: `best_trial` (a trial id)
    and `best_group` (a config hash), by the one rule of `launch.record.summarize`."""
    name: str
    runs: list[RunSummary]
    source: str = ""
    running: bool = False
    metric: str = CIDER
    mode: str = "max"
    best_trial: str | None = None
    best_group: str | None = None

    def best_run(self) -> RunSummary | None:
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
def searched_keys(runs: list[RunSummary]) -> list[str]:
    """Params that vary across the runs (the searched ones), seed keys and per-run strings (paths) excluded."""
    out = []
    for k in sorted({k for r in runs for k in r.params} - {SEED_KEY}):
        values = [r.params.get(k) for r in runs]
        distinct = set(values)
        numeric = all(v is None or finite(v) is not None for v in values)
        path_like = not numeric and len(runs) > 2 and len(distinct) == len(runs)  # a path or a name in every run
        if len(distinct) > 1 and not path_like:
            out.append(k)
    return out


def group_value(run: RunSummary, by: str) -> str | None:
    """The value of `by` for a run: a param (exact or dotted suffix), an a2.<by> tag or a tag; None when `by` is a
    model key the run's fusion does not use (lambda of fusion none), whatever an older run logged."""
    if by.rsplit(".", 1)[-1] in inapplicable_model_keys(run.fusion):
        return None
    if by in run.params:
        return run.params[by]
    for k, v in sorted(run.params.items()):
        if k.endswith("." + by):
            return v
    return run.tags.get(f"a2.{by}") or run.tags.get(by)


def sort_key(value: str) -> tuple:
    """Numbers by value, then fusions in the paper's order, then other strings."""
    if finite(value) is not None:
        return (0, float(value))
    return (1, list(FUSION_LABEL).index(value)) if value in FUSION_LABEL else (2, str(value))
