"""`a2 study rehearse FILE` and `a2 study plan FILE --rehearse N`: a study's every trial through the real orchestration,
with training replaced by a stand-in whose scores are drawn from a stated model, before GPUs are paid for.

The first rehearsal runs the study as `a2 study run` does (`launch.driver.run_study`: the searcher, the replicate
ASHA, the trials' storage, the record, the MLflow export, `summary.json`) on Ray, the cluster's GPUs stood in for by
Ray's declared (logical) resources, each trial's `a2core.train.train` swapped for `stand_in_train`
(`launch.trainable.swapped_trainer`), which sleeps `epoch_seconds x time_scale` an epoch and reports what the score
model draws. Further rehearsals (`--repeat N`, `plan --rehearse N`) redraw the noise and run the statistical part
without Ray (`simulate`): the same searcher's configurations (`GridCrossedSearcher`, asked in Tune's order), the
same scheduler object deciding on the same results (`launch.search.build_scheduler`: `ReplicateASHA`'s hooks, fed
epoch by epoch in the order `max_concurrent_trials` slots run them), the same record-to-verdict code
(`dashboards.compare.study_comparison`, `dashboards.stats.best_group`). A study with adaptive replicates runs its
rounds there as the driver does: its searcher hands each round out, `RehearsalDecider`
(`launch.adaptive.study_rounds` on the simulated record, `RoundDecider`'s choice) picks the configurations of the
next, and `analyse` reads the design's verdicts (`launch.adaptive.amend_summary`). Both paths end in a
`dashboards.runs.Study`, read by `analyse`.

The score model (`ScoreModel`): a configuration's true final mean by one config key (`by`, default the fusion: the
paper's Table 3, `dashboards.paper_results`; or the arms of a results record, `--from-record`), plus the noise the
plan assumes (`dashboards.stats.Noise`): a seed's shift (seed_sd; normal, or Student's t with `seed_df` d.f.), a
run's own per-image noise (run_sd), an arm's own per-image strengths (arm_image_sd, drawn once per configuration and
image), over the val and test images the study scores. A learning curve scales the run's mean over epochs: curve(e)
= 1 - drop (1 - e / E)^2 (the last epoch at the full mean; `drop` 0.3: a first epoch at ~half the final CIDEr for E
= 20, as cross-entropy training of the paper's model). The val score of an epoch is curve(e) (mean + shift) + the
arm's val-image mean + the mean of the run's per-image noise that epoch; the test scores are at the selected (best
val) epoch.

A rehearsal is labelled wherever it is read: its name ends in `-rehearsal` (storage folder, MLflow experiment, every
table header), `rehearsal.json` sits next to `study.yaml`, `summary.json` carries `"rehearsal"`, `status` and `compare`
print `launch.location.REHEARSAL_BANNER` first, its MLflow runs carry the tag `a2.rehearsal` and names starting
`rehearsal-`, and `a2 package` refuses it (`refuse_rehearsal`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from a2core.config import get_dotted, load_yaml
from a2core.errors import StudyError
from a2core.selection import best_epoch
from dashboards.compare import best_configuration, configurations, study_comparison, verdict_family
from dashboards.paper_results import TABLE3, TABLE3_ROW
from dashboards.records import arms_of, load_record
from dashboards.runs import CIDER, TEST_CIDER, Study
from dashboards.runs import Trial as RecordTrial  # Tune's `Trial` is the scheduler's in `simulate`
from dashboards.stats import Noise, config_hash, noise_of, power
from launch import plan
from launch.defaults import LEARNING_DROP
from launch.location import REHEARSAL_BANNER, REHEARSAL_FILE, StudyLocation, write_summary
from launch.spec import apply_study_overrides
from launch.tracking_writer import mark_runs

NAME_SUFFIX = "-rehearsal"
TAG_REHEARSAL = "a2.rehearsal"


# -- the score model -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScoreModel:
    """What the stand-in trainer draws (module docstring); plain values, shipped with every trial."""
    by: str  # the config path whose value picks a configuration's mean ("model.fusion")
    means: tuple[tuple[str, float], ...]  # (value of `by` as text, true final mean x100)
    seed_sd: float
    run_sd: float
    arm_image_sd: float
    val_images: int
    test_images: int  # 0: no end-of-run test (train.test_at_end false)
    drop: float = LEARNING_DROP
    seed: int = 0
    source: str = ""
    seed_df: float = 0.0  # > 2: a seed's shift is Student's t with these d.f., scaled to seed_sd; else normal
    baseline: str | None = None  # the row the others are compared with (a record's); None: the fusion none row

    def mean_of(self, config: dict) -> float:
        value = str(get_dotted(config, self.by))
        table = dict(self.means)
        if value not in table:
            raise StudyError(f"rehearsal score model: no mean for {self.by}={value} (it has "
                             f"{', '.join(table) or 'none'}); give one with --mean {value}=CIDEr")
        return table[value]

    def to_dict(self) -> dict:
        return {**asdict(self), "means": dict(self.means)}


def curve(epoch: int, total: int, drop: float) -> float:
    """The learning curve's share of the final mean at `epoch` of `total`."""
    return 1.0 - drop * (1.0 - epoch / total) ** 2


def _rng(model: ScoreModel, repeat: int, *key) -> np.random.Generator:
    """A generator keyed by the model's seed, the rehearsal's number and `key`: the same draws in a Ray trial and in
    `simulate`, whatever order the trials run in."""
    digest = hashlib.sha256(json.dumps([model.seed, repeat, *key], default=str).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


@dataclass
class Draws:
    """One run's drawn scores: `val[e - 1]` its val CIDEr at epoch e, and what its per-image scores are made of."""
    model: ScoreModel
    repeat: int
    group: str
    seed: int
    mean: float
    shift: float
    val: np.ndarray
    epoch_noise: np.ndarray
    total: int

    def arm_images(self, split: str) -> np.ndarray:
        m = self.model.val_images if split == "val" else self.model.test_images
        return _rng(self.model, self.repeat, "arm", self.group, split).normal(0.0, self.model.arm_image_sd, m)

    def per_image(self, split: str, best_epoch: int) -> np.ndarray:
        """The run's per-image CIDEr-D on `split` at its selected epoch (val: whose mean is `val[best_epoch - 1]`)."""
        arm = self.arm_images(split)
        own = _rng(self.model, self.repeat, "images", self.group, self.seed, split).normal(0.0, self.model.run_sd,
                                                                                            len(arm))
        if split == "val":  # the same mean as the epoch's val score: the epoch's share of the run's noise
            own = own - own.mean() + self.epoch_noise[best_epoch - 1]
        return curve(best_epoch, self.total, self.model.drop) * (self.mean + self.shift) + arm + own


def draw(model: ScoreModel, config: dict, repeat: int = 0) -> Draws:
    """The draws of the run of `config` (a resolved trial config: its group is its config hash, its seed
    `train.seed`) in rehearsal number `repeat`."""
    group, seed = config_hash(config), int(config["train"]["seed"])
    total = int(config["train"]["xe_epochs"]) + int(config["train"]["scst_epochs"])
    mean = model.mean_of(config)
    rng = _rng(model, repeat, "run", group, seed)
    shift = float(rng.standard_t(model.seed_df) * model.seed_sd / math.sqrt(model.seed_df / (model.seed_df - 2))
                  if model.seed_df > 2 else rng.normal(0.0, model.seed_sd))
    epoch_noise = rng.normal(0.0, model.run_sd / math.sqrt(max(model.val_images, 1)), total)
    arm_val = float(_rng(model, repeat, "arm", group, "val").normal(0.0, model.arm_image_sd, model.val_images).mean())
    val = np.array([curve(e, total, model.drop) * (mean + shift) for e in range(1, total + 1)]) + arm_val + epoch_noise
    return Draws(model, repeat, group, seed, mean, shift, val, epoch_noise, total)


# -- the stand-in trainer (runs in the Ray trials; benchmarks/bench_scale.py uses it too) ---------------------------
def stand_in_train(config, report, *, output_dir=None, resume_from=None, best_from=None, progress=None,
                   model: dict | None = None, epoch_seconds: float = 0.0, repeat: int = 0):
    """`a2core.train.train`'s contract at no cost: each epoch sleeps `epoch_seconds`, then reports the drawn val
    score (`model`: a `ScoreModel` as a dict; None: a rising score, `bench_scale`'s) with a small checkpoint
    (`a2core.checkpoint` format, no weights) and the epoch's per-image val scores; the last epoch also the test
    split's (train.test_at_end). Resumes after its checkpoint's epoch. `progress`, the steps within an epoch, is
    taken and not called: the stand-in has no steps."""
    # torch: in the trials only (`a2 study plan --rehearse` imports this module and trains nothing)
    from a2core import checkpoint
    from a2core.train import PER_IMAGE_KEY, TEST_PER_IMAGE_KEY

    train = config["train"]
    total = int(train["xe_epochs"]) + int(train["scst_epochs"])
    draws = None
    if model is not None:
        model = ScoreModel(**{**model, "means": tuple(model["means"].items())})
        draws = draw(model, config, repeat)
    history, start = [], 1
    if resume_from is not None:
        state = checkpoint.load(resume_from)
        history, start = list(state.get("history") or []), int(state["epoch"]) + 1
    for epoch in range(start, total + 1):
        time.sleep(epoch_seconds)
        value = float(draws.val[epoch - 1]) if draws is not None else 50.0 + 10 * epoch + (seed_noise(train) / 10)
        metrics = {"epoch": epoch, "step": epoch * 10, "stage": "xe" if epoch <= int(train["xe_epochs"]) else "scst",
                   "train/loss": 5.0 / epoch, "val/CIDEr": value, "time/epoch_s": epoch_seconds}
        values = {int(h["epoch"]): h["val/CIDEr"] for h in history} | {epoch: value}
        best = best_epoch(values)
        if draws is not None and model.val_images and best == epoch:
            scores = draws.per_image("val", epoch)
            metrics[PER_IMAGE_KEY] = {"ids": [str(i) for i in range(len(scores))], "scores": scores.tolist()}
        if draws is not None and epoch == total and train.get("test_at_end") and model.test_images:
            scores = draws.per_image("test", best)
            metrics.update({"test/CIDEr": float(scores.mean()), "test/epoch": best,
                            TEST_PER_IMAGE_KEY: {"ids": [str(i) for i in range(len(scores))],
                                                 "scores": scores.tolist()}})
        history.append({k: v for k, v in metrics.items() if not isinstance(v, dict)})
        folder = Path(tempfile.mkdtemp(prefix="a2-rehearse-ckpt-"))
        checkpoint.save({"format": checkpoint.FORMAT, "model": {}, "config": config, "vocab": [], "epoch": epoch,
                         "best": {"epoch": best, "value": values[best]}, "history": history},
                        folder / "checkpoint.pt")
        (folder / checkpoint.HISTORY_FILE).write_text(json.dumps(history))
        report(metrics, str(folder))
        shutil.rmtree(folder, ignore_errors=True)
    return {}


def seed_noise(train: dict) -> float:
    """bench_scale's stand-in: a value in [0, 10) fixed by the seed."""
    return random.Random(train.get("seed")).random() * 10


# -- the statistical part, without Ray -------------------------------------------------------------------------------
class _Trial:
    """What the scheduler reads of a Tune trial."""

    def __init__(self, trial_id: str, config: dict):
        from ray.tune.experiment import Trial  # as in `simulate`

        self.trial_id, self.config, self.status = trial_id, config, Trial.PENDING


class _Controller:
    def __init__(self):
        self.trials: list[_Trial] = []

    def get_trials(self):
        return self.trials


def suggestions(spec) -> list[dict]:
    """The study's trials as its searcher hands them out (`GridCrossedSearcher`, Tune's order): sampled configs.
    TPE adapts to results in a real study; here every sampled value comes from its prior, the same in every
    rehearsal (the scores do not depend on sampled keys other than `by`)."""
    from ray.tune.search import Searcher  # as in `simulate`

    searcher = _searcher(spec)
    out = []
    for i in range(spec.num_trials):
        config = searcher.suggest(f"rehearsal{i:05d}")
        if config is None or config == Searcher.FINISHED:
            break
        out.append(config)
    return out


def _searcher(spec):
    """The study's `GridCrossedSearcher`, a fused study's as unfused: a fused trial's seeds are trials of the record,
    and of the rehearsal without Ray, apart (the same configurations, in the same order, one seed a trial)."""
    from launch.search import GridCrossedSearcher  # as in `simulate`

    unfused = spec.resources.model_copy(update={"fuse_replicates": False, "capture_step": False})
    return GridCrossedSearcher(spec.model_copy(update={"resources": unfused}))


def round_searcher(spec, configs: list[dict]):
    """A fresh `GridCrossedSearcher` of the study that has handed out `configs` (the first round of adaptive
    replicates, `suggestions`) as the trials `sim00000`, `sim00001`, ... that `simulate` runs: the searcher a driver
    holds after round 1, whose `_end_of_round` and `_next_seed` then hand out the later rounds (`_searcher`)."""
    searcher = _searcher(spec)
    for i, config in enumerate(configs):
        if searcher.suggest(f"sim{i:05d}") != config:  # the searcher is seeded: it repeats `suggestions`' answers
            raise StudyError("rehearsal: the study's searcher handed out other configurations than `suggestions`")
    return searcher


class RehearsalDecider:
    """`launch.adaptive.RoundDecider` on a rehearsal's simulated record instead of the trials' files: at the end of a
    round, `launch.adaptive.study_rounds` of the trials run so far (`study_now()`) decides, and the groups chosen are
    RoundDecider's (the open arms' configurations, the baseline's while any arm is open; every configuration when
    no arm has taken a look). Writes nothing."""

    def __init__(self, spec, study_now):
        self.spec, self.study_now = spec, study_now

    def next_round(self, finished: int, configs: dict[str, dict], trials: dict[str, dict],
                   failed: set[str] | frozenset = frozenset()) -> list[str]:
        """As RoundDecider's; `failed` is unused: the simulated record holds every trial's own state."""
        from launch.adaptive import next_round_groups, study_rounds  # as in `simulate`

        study = self.study_now()
        return next_round_groups(self.spec, study_rounds(self.spec, study), configs, study)


def simulate(spec, model: ScoreModel, repeat: int, configs: list[dict] | None = None):
    """One rehearsal without Ray, as a `dashboards.runs.Study`: every trial's draws, fed epoch by epoch to the
    study's own scheduler (`build_scheduler`: `ReplicateASHA`'s `on_trial_add`, `on_trial_result`,
    `on_trial_complete`, `choose_trial_to_run`, PAUSE and STOP included) with `max_concurrent_trials` trials
    running at once and the searcher adding a trial whenever fewer are unfinished (Tune's ConcurrencyLimiter).

    With adaptive replicates (`spec.replicate_rounds`) `configs` is the first round (`suggestions`) and the study's
    own searcher (`round_searcher`) hands out the later rounds as in the driver: told of every trial's end, asked
    for more whenever a slot is free (None until the round's every trial has ended), with `RehearsalDecider`
    deciding at each round's end which configurations get the next round's seeds."""
    # Tune's classes and optuna: not in the Ray Train workers that run `stand_in_train` (they import this module)
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import TrialScheduler
    from ray.tune.search import Searcher

    from launch.search import ReplicateASHA, build_scheduler

    configs = configs if configs is not None else suggestions(spec)
    scheduler = build_scheduler(spec)
    scheduler.set_search_properties(spec.metric, spec.mode)  # as Tune does with the TuneConfig's
    asha = isinstance(scheduler, ReplicateASHA)
    resolved, draws, trials, index, epochs = [], [], [], {}, {}
    resumed: set[str] = set()
    ctl, slots, total = _Controller(), spec.resources.max_concurrent_trials, spec.total_epochs
    if spec.resources.fuse_replicates:  # a fused trial's seeds run at once, in one slot: held at a rung for each other
        slots *= spec.seed_rounds_trials[0][1]

    def add(config: dict) -> _Trial:
        i = len(trials)
        resolved.append(spec.trial_config(dict(config)))
        draws.append(draw(model, resolved[-1], repeat))
        trials.append(_Trial(f"sim{i:05d}", dict(config)))
        index[trials[-1].trial_id], epochs[trials[-1].trial_id] = i, 0
        return trials[-1]

    queue = iter([add(config) for config in configs])
    searcher = round_searcher(spec, configs) if spec.seed_rounds else None
    finished = False  # the searcher said FINISHED

    scored: dict[tuple[int, str], dict] = {}  # (trial, split) -> its per-image scores, once it has ended

    def record(i: int) -> RecordTrial:
        t, config, d = trials[i], resolved[i], draws[i]
        done = epochs[t.trial_id]
        values = {e: float(d.val[e - 1]) for e in range(1, done + 1)}
        best = best_epoch(values)
        final = {CIDER: values[done]}
        test = done == total and config["train"].get("test_at_end") and model.test_images
        if test:
            final[TEST_CIDER] = float(d.per_image("test", best).mean())

        def per_image(split, d=d, best=best, test=test, key=i):
            if (split == "test" and not test) or (split == "val" and not model.val_images):
                return None
            if (key, split) not in scored:  # an ended trial's scores, read again at each round's end
                scored[key, split] = {str(i): float(v) for i, v in enumerate(d.per_image(split, best))}
            return scored[key, split]

        return RecordTrial(t.trial_id, name=f"rehearsal-{t.trial_id}", state="TERMINATED", status="FINISHED",
                           sampled=dict(t.config), config=config, config_hash=d.group, final=final,
                           best_value=values[best], best_step=best, history={CIDER: sorted(values.items())},
                           stopped_early=scheduler.stopped_early(t.trial_id) if asha else None,
                           per_image=per_image)

    def study_now(ended: bool = True) -> Study:  # the trials that have run an epoch (and ended)
        runs = [record(i) for i, t in enumerate(trials) if epochs[t.trial_id] and (t.status == Trial.TERMINATED
                                                                                    or not ended)]
        return Study(f"{spec.name}{'' if spec.name.endswith(NAME_SUFFIX) else NAME_SUFFIX}", runs,
                     metric=spec.metric, mode=spec.mode, confirm_from=spec.confirm_from)

    if searcher is not None:
        searcher.set_round_decider(RehearsalDecider(spec, study_now))

    def next_trial() -> _Trial | None:
        nonlocal finished
        t = next(queue, None)
        if t is not None or searcher is None or finished:
            return t
        config = searcher.suggest(f"sim{len(trials):05d}")
        if config == Searcher.FINISHED:
            finished = True
        return add(config) if isinstance(config, dict) else None  # None: Tune asks again later

    def result(t):
        e = epochs[t.trial_id]
        return {"epoch": e, spec.metric: float(draws[index[t.trial_id]].val[e - 1])}

    def end(t, res):
        t.status = Trial.TERMINATED
        if asha:
            scheduler.on_trial_complete(ctl, t, res)
        if searcher is not None:  # Tune tells the searcher of every trial's end (its round ends on them)
            searcher.on_trial_complete(t.trial_id, res)

    while True:
        unfinished = sum(t.status != Trial.TERMINATED for t in ctl.trials)
        while unfinished < slots and (t := next_trial()) is not None:
            ctl.trials.append(t)
            if asha:
                scheduler.on_trial_add(ctl, t)
            unfinished += 1
        running = [t for t in ctl.trials if t.status == Trial.RUNNING]
        while len(running) < slots:
            chosen = (scheduler.choose_trial_to_run(ctl) if asha
                      else next((t for t in ctl.trials if t.status == Trial.PENDING), None))
            if chosen is None:
                break
            if chosen.status == Trial.PAUSED:
                resumed.add(chosen.trial_id)
            chosen.status = Trial.RUNNING
            running.append(chosen)
        if not running:
            break
        for t in running:
            if t.trial_id in resumed:  # a resumed trial reports its last result again first (launch.trainable)
                resumed.discard(t.trial_id)
                if scheduler.on_trial_result(ctl, t, result(t)) == TrialScheduler.STOP:
                    end(t, result(t))
                    continue
            epochs[t.trial_id] += 1
            res = result(t)
            decision = scheduler.on_trial_result(ctl, t, res) if asha else TrialScheduler.CONTINUE
            if decision == TrialScheduler.STOP or epochs[t.trial_id] == total:
                end(t, res)
            elif decision == TrialScheduler.PAUSE:
                t.status = Trial.PAUSED

    return study_now(ended=False)


# -- what happened ---------------------------------------------------------------------------------------------------
def analyse(study, spec, model: ScoreModel) -> dict:
    """One rehearsal's outcome, read from its `dashboards.runs.Study` (a Ray rehearsal's record or `simulate`'s):
    trials run and stopped (by rung), trial-epochs run against planned, the best group (`dashboards.stats.
    best_group`, the summary's and compare's rule) and whether it is a true best, whether a true best group survived
    early stopping, and each row of `a2 study compare`'s comparison (`study_comparison`) against its baseline: the
    verdict, its interval's width and the true gap. With adaptive replicates (`spec.replicate_rounds`) a row's
    verdict is the design's, as the study's summary gives it (`launch.adaptive.amend_summary` over `study_rounds`:
    resolved only where Holm over the sequential p-values resolved it; `seeds` the arm's at its last look, `state`
    open, resolved or futile), and `seed_trials` counts the trials the design ran against `planned_trials`, the
    fixed design's (every configuration every seed to the maximum)."""
    runs = [r for r in study.runs if r.best_value is not None]
    groups = configurations(runs)
    true = {g[0].config_hash: model.mean_of(g[0].config) for g in groups}
    top = max(true.values()) if true else None
    stopped = [r for r in runs if r.stopped_early]
    rungs = Counter(int(r.stopped_early["rung"]) for r in stopped if r.stopped_early.get("rung") is not None)
    done = sum(len(r.history.get(CIDER, [])) for r in runs)
    chosen = best_configuration(groups, spec.mode)  # compare's best configuration (`dashboards.stats.best_group`)
    survived = any(true[g[0].config_hash] == top and not any(r.stopped_early for r in g) for g in groups)
    by = model.by.rsplit(".", 1)[-1]  # the rows differ in what the score model's means are keyed by
    comparison, _, _ = study_comparison(study, by, baseline=model.baseline)
    design = _design_verdicts(spec, study, comparison, by)
    table = dict(model.means)  # a row's label is its value of `by` ("fusion=none" for a reference row)
    label_mean = {arm.label: table.get(arm.label.split("=")[-1]) for arm, _ in comparison.rows}
    rows = {}
    for label, diff in comparison.differences.items():
        if label_mean.get(label) is None or label_mean.get(comparison.baseline) is None:
            continue  # rows by another key than the model's: no true gap known
        gap = label_mean[label] - label_mean[comparison.baseline]
        entry = design.get(label)  # the adaptive design's verdict, None for a fixed number of seeds
        resolved = bool(entry["resolved"]) if entry else diff.resolved
        rows[label] = {"delta": diff.delta, "low": diff.low, "high": diff.high, "resolved": resolved,
                       "right": resolved and (diff.delta > 0) == (gap > 0) and gap != 0,
                       "wrong": resolved and ((diff.delta > 0) != (gap > 0) or gap == 0),
                       "width": None if diff.low is None else diff.high - diff.low, "true_gap": gap,
                       "seeds": entry["design"]["seeds"] if entry else diff.seeds_a, "images": diff.images,
                       "verdict": entry["verdict"] if entry else diff.verdict(),
                       "family": len(design) if entry else diff.family,
                       "state": entry["design"]["state"] if entry else None}
    planned = spec.num_trials * spec.total_epochs
    return {"trials": len(runs), "planned_trials": spec.num_trials, "stopped": len(stopped), "rungs": dict(rungs),
            "epochs_run": done, "epochs_planned": planned,
            "best_group_true_best": chosen is not None and true[chosen[0].config_hash] == top,
            "true_best_survived": survived, "split": "test" if comparison.metric == "test/CIDEr" else "val",
            "baseline": comparison.baseline, "rows": rows, "adaptive": bool(spec.replicate_rounds),
            "seed_trials": len(runs)}


def _design_verdicts(spec, study, comparison, by: str) -> dict[str, dict]:
    """arm -> its entry of the adaptive study's summary (`verdict_family`, amended by `amend_summary`: "resolved",
    "design" the arm's `ArmState` as a dict, "verdict"); {} for a fixed number of seeds, and for an arm without a
    look (its verdict stays `compare`'s, as in the summary)."""
    if not spec.replicate_rounds:
        return {}
    from launch.adaptive import amend_summary  # its record reader: not in the Ray Train workers (`simulate`)

    amended = amend_summary(spec, study, {"verdicts": verdict_family(comparison, by)})
    return {e["arm"]: e for e in amended["verdicts"]["comparisons"] if "design" in e}


def aggregate(outcomes: list[dict], spec, model: ScoreModel) -> dict:
    """Rates over rehearsals: the best group a true best, a true best kept, each row's verdicts (right, wrong, none)
    and mean width, trials stopped and trial-epochs run; the family's (`family_wrong`: the rehearsals with some
    verdict wrong, the family-wise false rate when `all_equal`; `family`: the comparisons Holm adjusted over). With
    adaptive replicates (`adaptive`) a row's `seeds` is the fixed design's (the maximum), `seeds_mean` the arm's mean
    seeds at its last look, and `seed_trials_mean` the trials the design ran against `seed_trials_fixed`."""
    n = len(outcomes)
    adaptive = bool(outcomes) and all(o.get("adaptive") for o in outcomes)
    rows = {}
    for label in outcomes[0]["rows"] if outcomes else []:
        xs = [o["rows"][label] for o in outcomes if label in o["rows"]]
        widths = [x["width"] for x in xs if x["width"] is not None]
        rows[label] = {"true_gap": xs[0]["true_gap"], "right": sum(x["right"] for x in xs) / len(xs),
                       "wrong": sum(x["wrong"] for x in xs) / len(xs),
                       "none": sum(x["low"] is None for x in xs) / len(xs),
                       "width": float(np.mean(widths)) if widths else None,
                       "seeds": len(spec.seed_values) if adaptive else xs[0]["seeds"],
                       "seeds_mean": float(np.mean([x["seeds"] for x in xs])),
                       "images": xs[0]["images"], "n": len(xs)}
    families = Counter(int(row.get("family", 1)) for o in outcomes for row in o["rows"].values())
    # the family's error: some verdict of the rehearsal wrong (a truly equal arm resolved, or one resolved on the
    # wrong side); with every arm of the score model equal, the family-wise false "resolved" rate Holm holds at 5%
    gaps = [row["true_gap"] for row in rows.values()]
    wrong = sum(any(r["wrong"] for r in o["rows"].values()) for o in outcomes)
    return {"rehearsals": n, "family_wrong": wrong / n,
            "all_equal": bool(gaps) and all(g == 0 for g in gaps),
            "family": families.most_common(1)[0][0] if families else 1,
            "best_group_true_best": sum(o["best_group_true_best"] for o in outcomes) / n,
            "true_best_survived": sum(o["true_best_survived"] for o in outcomes) / n,
            "stopped_mean": float(np.mean([o["stopped"] for o in outcomes])),
            "epoch_share": float(np.mean([o["epochs_run"] / o["epochs_planned"] for o in outcomes])),
            "split": Counter(o["split"] for o in outcomes).most_common(1)[0][0], "rows": rows,
            "adaptive": adaptive, "seed_trials_mean": float(np.mean([o.get("seed_trials", o["trials"])
                                                                     for o in outcomes])),
            "seed_trials_fixed": spec.num_trials}


def mc_error(rate: float, n: int) -> float:
    """The Monte Carlo standard error of a rate over n rehearsals."""
    return math.sqrt(max(rate * (1 - rate), 1e-12) / n)


# -- text ------------------------------------------------------------------------------------------------------------
def outcome_text(outcome: dict, title: str) -> str:
    rungs = ", ".join(f"{n} at rung {r}" for r, n in sorted(outcome["rungs"].items())) or "none"
    lines = [title,
             f"  trials    {outcome['trials']}/{outcome['planned_trials']} ran; {outcome['stopped']} stopped early "
             f"({rungs})",
             f"  compute   {outcome['epochs_run']:,} of {outcome['epochs_planned']:,} planned trial-epochs "
             f"({outcome['epochs_run'] / outcome['epochs_planned']:.0%})",
             f"  best      the best group {'IS' if outcome['best_group_true_best'] else 'is NOT'} a true best "
             f"configuration; a true best {'survived' if outcome['true_best_survived'] else 'was STOPPED by'} "
             f"early stopping",
             f"  verdicts  (`a2 study compare`'s, on {outcome['split']}; true gap in brackets)"]
    for label, row in outcome["rows"].items():
        width = "no interval" if row["width"] is None else f"width {row['width']:.2f}"
        lines.append(f"    {row['verdict']} [{width}; true gap {row['true_gap']:+.1f}]")
    return "\n".join(lines)


def aggregate_text(agg: dict, spec, model: ScoreModel, title: str) -> str:
    n = agg["rehearsals"]
    noise = Noise(model.seed_sd, model.run_sd, model.arm_image_sd, model.test_images if agg["split"] == "test"
                  else model.val_images)
    asha = spec.search.scheduler.asha is not None
    adaptive = agg.get("adaptive", False)
    family = agg.get("family", 1)  # the comparisons Holm counted in the rehearsals' verdicts (`adjust_family`)
    wrong = agg.get("family_wrong", 0.0)
    rule = (f"the adaptive design's, Holm over {family} arms' sequential p-values" if adaptive
            else f"Holm over {family} comparisons" if family > 1 else "one comparison")
    if agg.get("all_equal"):
        family_line = (f"  family    every arm equal in the score model: some arm called different in {wrong:.1%} "
                       f"of {n} rehearsals (MC error +-{mc_error(wrong, n):.1%}): the family-wise false \"resolved\" "
                       f"rate, {rule}, held at 5%")
    else:
        family_line = (f"  family    some verdict wrong (an equal arm resolved, or one on the wrong side) in "
                       f"{wrong:.1%} of {n} rehearsals (MC error +-{mc_error(wrong, n):.1%}); with every arm "
                       f"equal (--mean) it is the family-wise false rate")
    lines = [title,
             f"  kept      a true best configuration survived early stopping in {agg['true_best_survived']:.0%}, "
             f"was the best group in {agg['best_group_true_best']:.0%} of {n} rehearsals "
             f"(MC error +-{mc_error(agg['best_group_true_best'], n):.0%})",
             f"  compute   {agg['epoch_share']:.0%} of the planned trial-epochs on average; "
             f"{agg['stopped_mean']:.1f} trials stopped early per rehearsal",
             family_line]
    if adaptive:
        fixed, ran = agg["seed_trials_fixed"], agg["seed_trials_mean"]
        lines.append(f"  seeds     adaptive replicates, rounds to {', '.join(map(str, spec.replicate_rounds))} seeds: "
                     f"{ran:.1f} seed-trials a rehearsal on average against the fixed design's {fixed} (every "
                     f"configuration {len(spec.seed_values)} seeds): {ran / fixed:.0%}")
    if spec.confirm_seeds:
        lines.append(f"  seeds     {len(spec.seed_values)} search seeds a configuration, then {spec.verdict_seeds} "
                     f"confirmation seeds of each fusion's chosen one, which the verdicts rest on: "
                     f"{spec.num_trials} trials (docs/explanation/statistics.md, \"Confirmation seeds\")")
    lines.append(f"  {'difference':<28}{'true gap':>9}{'verdict rate':>14}{'wrong':>7}{'none':>6}{'mean width':>12}"
                 + (f"{'mean seeds':>12}" if adaptive else "") + f"{'closed-form power':>19}")
    for label, row in agg["rows"].items():
        # the power `a2 study plan` prints: the adjusted verdict's when the family has several
        p = power(row["seeds"], row["true_gap"], noise, family=family) if row["true_gap"] else float("nan")
        cf = f"{'-' if math.isnan(p) else f'{p:.0%}':>19}"
        width = "-" if row["width"] is None else f"{row['width']:.2f}"
        seeds = f"{row['seeds_mean']:>12.1f}" if adaptive else ""
        lines.append(f"    {label + ' vs baseline':<26}{row['true_gap']:>+9.1f}{row['right']:>13.0%} "
                     f"{row['wrong']:>6.0%}{row['none']:>6.0%}{width:>12}{seeds}{cf}")
    power_note = (f" and is the adjusted verdict's at Holm's first step (5% / {family}: a lower bound of Holm's power)"
                  if family > 1 else "")
    seeds_note = ""
    if adaptive:
        adjusted = (f"the adaptive design's, as the study's summary gives it: resolved where Holm over the {family} "
                    f"arms' sequential p-values resolved it (launch.adaptive.amend_summary)")
        power_note += f", of the fixed design at the maximum, {len(spec.seed_values)} seeds"
        seeds_note = "; mean seeds: an arm's at its last look, fewer where it settled early"
    else:
        adjusted = (f"Holm-adjusted over the family's {family} comparisons, as `compare` prints it" if family > 1
                    else "the comparison's own 95% interval")
    lines.append(f"  (verdict rate: the verdict, {adjusted}, resolves on the true side; +-{mc_error(0.5, n):.0%} at "
                 f"most over {n} rehearsals{seeds_note}. The closed-form power (`a2 study plan`) ignores early stopping"
                 + power_note + ("; this study stops groups at its rungs, so their rows may differ)" if asha else ")"))
    return "\n".join(lines)


def model_text(model: ScoreModel) -> str:
    means = ", ".join(f"{k} {v:.1f}" for k, v in model.means)
    return (f"score model ({model.source}): final mean by {model.by}: {means}; seed sd {model.seed_sd:.2f}, run x "
            f"image sd {model.run_sd:.1f}, arm x image sd {model.arm_image_sd:.1f}, over {model.val_images:,} val "
            f"and {model.test_images:,} test images; learning curve 1 - {model.drop:g} (1 - e/E)^2; seed {model.seed}"
            + (f"; seed shifts t({model.seed_df:g})" if model.seed_df > 2 else ""))


# -- building the model and the rehearsal's study --------------------------------------------------------------------
def score_model(spec, *, record: str | None = None, means: list[str] | None = None, sd: float | None = None,
                storage: str | None = None, seed: int = 0, drop: float = LEARNING_DROP) -> ScoreModel:
    """The model a rehearsal draws from: means from `record` (a results record, `a2 results export`: its arms'
    means of its metric, and its measured noise) or the paper's Table 3 by fusion, each overridden by `means`
    ("gate=125.0"); noise as `a2 study plan` takes it (measured in the study's record, else `--sd` and the plan's
    assumptions, launch.plan)."""
    val_images = plan.validated_images(spec)
    test_images = plan.test_images(spec)
    by, noise, baseline = "model.fusion", None, None
    if record is not None:
        try:
            rec = load_record(record)
        except (OSError, ValueError, KeyError) as err:
            raise StudyError(f"--from-record {record}: {err}") from None
        by = rec["by"] if "." in rec["by"] else f"model.{rec['by']}"
        baseline = rec.get("baseline") if by != "model.fusion" else None  # by fusion: compare's own, fusion none
        arms = arms_of(rec)
        table = {arm.label: float(np.mean(arm.values(rec["metric"]))) for arm in arms}
        scored = [arm.per_image for arm in arms if arm.per_image is not None and len(arm.per_image) >= 2]
        if scored and len({s.shape[1] for s in scored}) == 1:
            noise = noise_of(scored)
        source = f"means and noise measured in {record} ({rec['study']}, {rec['metric']})"
    else:
        table = {fusion: float(TABLE3["rows"][row]["CIDEr"]) for fusion, row in TABLE3_ROW.items()}
        source = "means: the paper's Table 3 CIDEr by fusion (dashboards.paper_results)"
    # the values of `by` the study's configurations take: a --mean for none of them (a typo) would be dropped
    values = {str(v) for v in spec.values_of(by)}
    for item in means or []:
        key, _, value = item.partition("=")
        try:
            table[key] = float(value)
        except ValueError:
            raise StudyError(f"--mean {item}: give VALUE=CIDEr, e.g. gate=125.0") from None
        if not math.isfinite(table[key]):  # a nan mean drew nan scores and failed in the power's arithmetic
            raise StudyError(f"--mean {item}: the CIDEr must be a finite number, e.g. {key}=125.0")
        if key not in values:
            raise StudyError(f"--mean {item}: no configuration of the study has {by.rsplit('.', 1)[-1]}={key} "
                             f"(its values: {', '.join(sorted(values))})")
        source += f"; {key} set to {value}"
    if sd is not None or noise is None:
        noise, how = plan.study_noise(spec, sd, storage)
        if noise is None:  # a synthetic study with nothing measured: the COCO assumption, said so
            noise = Noise(plan.COCO_SEED_SD, 0.0, plan.ARM_IMAGE_SD, plan.verdict_images(spec))
            how = "nothing measured; seed sd and arm x image sd as `a2 study plan` assumes for COCO"
        source += f"; noise: {how}"
    return ScoreModel(by, tuple(table.items()), noise.seed_sd, noise.run_sd, noise.arm_image_sd, int(val_images),
                      int(test_images), drop, seed, source, baseline=baseline)


def rehearsal_raw(path: str, overrides: list[str], storage: str, tracking_uri: str | None) -> tuple[dict, dict]:
    """(the study file with its overrides, the rehearsal's own file): named `<name>-rehearsal`, stored under
    `storage`, tracked at `tracking_uri` (default: an SQLite store in `storage`), COCO data replaced by a small
    synthetic set (the stand-in reads no data; the score model keeps the study's own split sizes), one worker per
    trial holding the trial's CPUs and GPUs (the stand-in trains in the trial process)."""
    raw = apply_study_overrides(load_yaml(path), list(overrides), source=path)  # as `load_study` takes them
    own = json.loads(json.dumps(raw))
    own["name"] = f"{raw.get('name', 'study')}{NAME_SUFFIX}"
    own["storage"] = storage
    own.pop("storage_endpoint_url", None)
    uri = tracking_uri or f"sqlite:///{os.path.abspath(os.path.join(storage, 'mlflow.db'))}"
    own["tracking"] = {**(raw.get("tracking") or {}), "mlflow_uri": uri}
    own["tracking"].pop("experiment", None)
    data = raw.get("data") or {}
    if data.get("kind") == "coco":
        own["data"] = {"kind": "synthetic", "seed": 0, "images": 400}
    res = dict(raw.get("resources") or {})
    workers = int(res.get("workers_per_trial", 1))
    if workers > 1:
        res["cpus_per_worker"] = workers * float(res.get("cpus_per_worker", 1))
        gpus = workers * float(res.get("gpus_per_worker", 0))  # 2 workers of 0.25 GPU: one of 0.5
        # one actor holds a fraction of a GPU or whole GPUs (Ray's rule, and the spec's): 3 x 0.5 becomes 2
        res["gpus_per_worker"] = gpus if gpus <= 1 or gpus.is_integer() else float(math.ceil(gpus))
        res["workers_per_trial"] = 1
        own["resources"] = res
    return raw, own


def logical_gpus(per_trial: float, concurrent: int) -> int:
    """The whole GPUs that hold `concurrent` trials of `per_trial` GPUs each: a card holds floor(1 / per_trial) of
    those asking a fraction (Ray does not split one trial's request over cards), the others whole ones each."""
    if 0 < per_trial < 1:
        return math.ceil(concurrent / math.floor(1 / per_trial + 1e-9))
    return math.ceil(per_trial * concurrent - 1e-9)


def _logical_ray(spec) -> None:
    """A local Ray whose declared CPUs and GPUs are what the study's concurrent trials ask (the cluster's, logical)."""
    # the driver's modules: not in the Ray Train workers that run `stand_in_train` (they import this module)
    import ray

    from launch.raycluster import connect

    if ray.is_initialized():
        return
    per = spec.trial_resources()
    c = spec.resources.max_concurrent_trials
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    ray.init(address="local", num_cpus=max(1, math.ceil(per["CPU"] * c)), num_gpus=logical_gpus(per["GPU"], c),
             include_dashboard=False, log_to_driver=False)
    connect()  # the connected Ray (connect's settings of the job apply only to a Ray it starts itself)


def run_rehearsal(spec, model: ScoreModel, *, epoch_seconds: float, time_scale: float, address: str | None = None,
                  verbose: bool = False) -> dict:
    """The first rehearsal: `run_study` with the stand-in trainer; marks the study as a rehearsal (its file, the
    summary, MLflow's tags). Returns {"summary", "seconds", "location"}."""
    # the driver's and the trial's modules: as in `_logical_ray`
    from launch.driver import check_tracking, run_study
    from launch.trainable import swapped_trainer

    location = StudyLocation(spec.name, spec.storage, spec.storage_endpoint_url)
    marker = {"rehearsal": True, "model": model.to_dict(), "epoch_seconds": epoch_seconds, "time_scale": time_scale,
              "note": REHEARSAL_BANNER}
    if "://" not in spec.storage:
        Path(spec.storage).mkdir(parents=True, exist_ok=True)  # also the default SQLite store's folder
    check_tracking(spec)  # before Ray starts
    if address is None:
        _logical_ray(spec)
    train = functools.partial(stand_in_train, model=model.to_dict(), epoch_seconds=epoch_seconds * time_scale)
    started = time.monotonic()
    with swapped_trainer(train):
        summary = run_study(spec, address=address, verbose=verbose)
    seconds = time.monotonic() - started
    location.write_text(json.dumps(marker, indent=1) + "\n", REHEARSAL_FILE)
    summary["rehearsal"] = marker
    write_summary(location, summary)
    # its MLflow runs (experiment `<name>-rehearsal`) tagged `a2.rehearsal=true`, names starting `rehearsal-` (`a2
    # mlflow sync` of it sets Tune's trial names again; the experiment's name and the tags stay)
    mark_runs(spec.tracking.mlflow_uri, spec.tracking.experiment, {TAG_REHEARSAL: "true"}, "rehearsal-")
    return {"summary": summary, "seconds": seconds, "location": location}


def check_options(drop: float, repeat: int = 1, time_scale: float = 0.0, epoch_seconds: float | None = None) -> None:
    """StudyError naming the option (`--drop`, `--repeat`, `--time-scale`, `--epoch-seconds`) when a rehearsal's setting
    is out of range (NaN included: it passes every comparison's `<`, and a trial slept nan or a negative time)."""
    if repeat < 1:
        raise StudyError(f"--repeat must be >= 1, got {repeat}")
    if not 0 <= time_scale < math.inf:
        raise StudyError(f"--time-scale must be a finite number >= 0, got {time_scale}")
    if epoch_seconds is not None and not 0 <= epoch_seconds < math.inf:
        raise StudyError(f"--epoch-seconds must be a finite number >= 0, got {epoch_seconds}")
    if not 0 <= drop < 1:
        raise StudyError(f"--drop must be in [0, 1), got {drop}")


def epoch_time(spec) -> float:
    """An epoch's wall time on the cluster by the plan's estimate (0 for a study with no GPUs: not estimated)."""
    if spec.resources.gpus_per_worker == 0:
        return 0.0
    est = plan.estimate(spec, plan.IMAGES_PER_SECOND, None)
    return est.gpu_hours * 3600 / spec.num_trials / spec.total_epochs / spec.trial_resources()["GPU"]


def model_gaps(spec, model: ScoreModel) -> list[tuple[str, float]]:
    """(label, true gap) of each value of the model's key in the study against the lowest one: the differences the
    plan's power table shows for a rehearsal."""
    table = dict(model.means)
    values = sorted({str(get_dotted(spec.trial_config(dict(c)), model.by)) for c in suggestions(spec)},
                    key=lambda v: table.get(v, 0.0))
    base = values[0]
    return [(f"{v} vs {base}", round(table[v] - table[base], 2)) for v in values[1:]
            if v in table and base in table and table[v] != table[base]]


def repeated(spec, model: ScoreModel, n: int, start: int = 0) -> list[dict]:
    """`analyse` of rehearsals number start .. start + n - 1, without Ray."""
    configs = suggestions(spec)
    return [analyse(simulate(spec, model, r, configs), spec, model) for r in range(start, start + n)]


def plan_lines(spec, n: int, model: ScoreModel) -> str:
    """`a2 study plan --rehearse N`: power and the chance of keeping the best group with the study's early stopping,
    from N rehearsals without Ray drawn from `model` (`score_model`), next to the closed-form power."""
    agg = aggregate(repeated(spec, model, n), spec, model)
    return aggregate_text(agg, spec, model, f"rehearsed: {n} rehearsals with the study's "
                                            f"{'early stopping' if spec.search.scheduler.asha else 'scheduler (FIFO)'}"
                                            f" (no Ray; {model_text(model)})")
