"""A study trial as Ray runs it: the one file that knows training happens inside Ray.

A one-worker trial (`a2_local_trial`) trains in the Tune trial process itself; a trial of several workers
(`a2_trial`) is a small Tune function driving a Ray Train `TorchTrainer` of `worker_fn` (Ray Train V2 does not run
as a Tune trainable); a fused trial (`a2_fused_trial`, `resources.fuse_replicates`) trains a configuration's seeds
in its process as one model, each seed a trial of the record with a run folder of its own (`FusedSeeds`). Either
way each epoch's checkpoint lands in the trial's run folder `<study>/trials/<study>-<trial id>/checkpoint_epochNNNN`, named after the Tune trial id so that a restarted,
retried or restored trial continues from its own newest checkpoint, and each result is logged there
(`ResultLog`) before Tune hears of it, stamped with the trial's cumulative compute (`ComputeMeter`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ray
from ray import tune
import ray.train
from ray.train import Checkpoint, UserCallback
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from a2core.checksum import checksum_problem, write_checksum
from a2core.config import Config
from a2core.errors import CheckpointError, StorageError, TrainingDiverged
from a2core.selection import best_epoch, finite, rank
from launch.killpoints import DRIVER_PID_ENV, KILL_AT_ENV, kill_point
from launch.raycluster import stash_credentials
from launch.layout import (ARTIFACTS_DIR, CHECKPOINT_FILE, CHECKPOINT_PREFIX, ENDED_FILE, PROGRESS_FILE,
                           RESULTS_FILE, SUPERSEDED_FILE, TRAIN_SNAPSHOT, TRIAL_FILE, TRIALS_DIR, TUNE_POINTER_FILE, ResultLog,
                           checkpoint_epochs, checkpoint_name, end_record, end_text, fused_seeds,
                           latest_checkpoint_history, plain_values, results_by_epoch, seed_result_key, seed_sampled,
                           seed_trial_id, train_run_name)
from launch.storage import open_location

ATTEMPT_CPU_KEY = "compute/attempt_cpu_s"  # worker -> trial driver: CPU seconds of this worker group, all ranks
ATTEMPT_GROUP_KEY = "compute/worker_group"  # worker -> trial driver: which group counted them (host:pid of rank 0)
DIVERGED_KEY = "a2/diverged"  # worker -> trial driver: the run diverged (`diverged_record`), instead of an epoch
# Environment that Ray workers need to reach storage from any node of the cluster: settings and references
# (the credentials file, its profile), never a secret's value (launch.raycluster.stash_credentials).
PROPAGATED_ENV = ("AWS_SHARED_CREDENTIALS_FILE", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION",
                  "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MLFLOW_S3_ENDPOINT_URL", "A2_DATA_CACHE",
                  KILL_AT_ENV, DRIVER_PID_ENV)  # the last two: the kill-anywhere test's (`launch.killpoints`)


@dataclass
class TrialPlan:
    """Everything a trial needs besides its sampled config: plain values, cheap to ship with every trial."""

    study: str
    storage: str  # the study root (local folder or URI) holding `<study>/`
    storage_endpoint_url: str | None
    resolve: Callable[[dict], dict]  # sampled Tune config -> full a2core config dict
    resources: dict  # the spec's `resources` section, defaults filled in
    metric: str = "val/CIDEr"
    mode: str = "max"
    num_to_keep: int = 2
    diag_epochs: tuple[int, ...] = ()  # the scheduler's rungs: a trial stopped there ends with its diagnostics
    # the training function of a one-worker trial, `a2core.train.train`'s contract; None: that one. A rehearsal's
    # stand-in (`launch.rehearse`) comes in through `swapped_trainer`
    train: Callable | None = None
    # run folders (names below `trials/`) of trials the resumed study's Tune state does not know (a driver killed
    # before Tune saved them, or before Tune saved anything): a trial of the same configuration continues the
    # newest of them instead of starting at epoch 1 (`adopt`)
    adoptable: tuple[str, ...] = ()

    def config(self, sampled: dict) -> dict:
        """The a2core config of a trial: the resolved suggestion, with diagnostics at the epochs it may be stopped."""
        config = self.resolve(dict(sampled))
        if self.diag_epochs:
            train = config.setdefault("train", {})
            train["diag_epochs"] = sorted(set(train.get("diag_epochs") or []) | set(self.diag_epochs))
        return config

    def trials(self):
        """The study's `trials/` folder (a `launch.storage.Location`)."""
        return open_location(self.storage, self.storage_endpoint_url).join(self.study, TRIALS_DIR)

    def temp_root(self) -> Path:
        """This node's temp folder of the study's trials, `<tmp>/a2-study-<name>-<storage hash>`: a trial process
        makes its temp folders (`a2-trial-*`, `a2-tune-ckpt-*`, a2core's `a2ckpt-*`) in it (`use_temp_root`), so that
        the driver, the study's one writer, removes what killed trials left, at its start and end."""
        digest = hashlib.sha1(str(self.storage).encode()).hexdigest()[:8]
        return Path(_SYSTEM_TEMP or tempfile.gettempdir()) / f"a2-study-{self.study}-{digest}"

    def worker_resource_request(self) -> dict:
        res = {"CPU": float(self.resources["cpus_per_worker"])}
        if self.resources["gpus_per_worker"]:
            res["GPU"] = float(self.resources["gpus_per_worker"])
        return res


_SWAPPED_TRAIN: Callable | None = None  # set in the driver's process by `swapped_trainer` only


@contextlib.contextmanager
def swapped_trainer(train: Callable):
    """Within it, the trials this process plans (`plan_from_spec`) train with `train` (a picklable function of
    `a2core.train.train`'s contract) instead of a2core's: the hook of a rehearsal (`launch.rehearse`)."""
    global _SWAPPED_TRAIN
    before, _SWAPPED_TRAIN = _SWAPPED_TRAIN, train
    try:
        yield
    finally:
        _SWAPPED_TRAIN = before


def plan_from_spec(spec) -> TrialPlan:
    return TrialPlan(study=spec.name, storage=str(spec.storage), storage_endpoint_url=spec.storage_endpoint_url,
                     resolve=spec.trial_config, resources=spec.resources.model_dump(exclude_none=True),
                     metric=spec.metric, mode=spec.mode, diag_epochs=tuple(spec.rungs),
                     train=_SWAPPED_TRAIN)


# The node's temp folder as it was before `use_temp_root` changed this process's: Tune runs one trial after another
# in the same process (`reuse_actors`), and each trial's root must be the study's, not one nested in the last trial's
# (a process that had run ~90 trials failed with "File name too long" in a 2,005-trial rehearsal).
_SYSTEM_TEMP: str | None = None


def use_temp_root(root: str | Path) -> None:
    """Make this process's temp folders in `root` (`TrialPlan.temp_root`)."""
    global _SYSTEM_TEMP
    if _SYSTEM_TEMP is None:
        _SYSTEM_TEMP = tempfile.gettempdir()
    Path(root).mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(root)


def remove_temp_root(plan: TrialPlan) -> None:
    """Remove the temp folders that trials of the study left on this node (the driver, before and after Tune)."""
    shutil.rmtree(plan.temp_root(), ignore_errors=True)


def _quiet_per_epoch_logs() -> None:
    """Ray Train and Tune log every report and checkpoint at INFO from every worker: only our epoch line
    (`a2core.train`) and warnings stay. The root logger too: Ray Train V2 logs reports through a logger named after
    its source file (tests/test_study_output.py)."""
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    logging.getLogger("a2core").setLevel(logging.INFO)


# -- a trial's bookkeeping, both kinds ---------------------------------------------------------------------------
class ComputeMeter:
    """Stamps each result of a trial attempt with the trial's cumulative `compute/wall_s` and `compute/gpu_s`
    (wall x GPUs) or `compute/cpu_s`. `previous` is the trial's result log (earlier attempts' totals); `stamp` takes
    this attempt's CPU seconds, which restart at 0 with a new Ray Train worker group."""

    def __init__(self, previous: list[dict], gpus: float):
        self.gpus = float(gpus)
        self.device_key = "compute/gpu_s" if self.gpus else "compute/cpu_s"
        self.base_wall = max((float(r.get("compute/wall_s") or 0.0) for r in previous), default=0.0)
        self.base_device = max((float(r.get(self.device_key) or 0.0) for r in previous), default=0.0)
        self.start = time.monotonic()
        self.cpu_done = 0.0  # CPU seconds of earlier worker groups of this attempt
        self.cpu_last, self.group = 0.0, None

    def stamp(self, item: dict, attempt_cpu_s: float, group: str | None = None, wall_s: float | None = None) -> None:
        """`group`: the Ray Train worker group that counted `attempt_cpu_s` (ATTEMPT_GROUP_KEY); without it a new
        group is told by its count starting below the last. `wall_s`: this attempt's wall seconds that are the
        trial's, where not all of them are (a fused trial's seed: `FusedClock`); CPU seconds are then its share too."""
        if (group != self.group) if group is not None else attempt_cpu_s < self.cpu_last:  # counts from 0 again
            self.cpu_done += self.cpu_last
        self.cpu_last, self.group = attempt_cpu_s, group
        wall = time.monotonic() - self.start if wall_s is None else wall_s
        item["compute/wall_s"] = self.base_wall + wall
        item[self.device_key] = self.base_device + (wall * self.gpus if self.gpus else self.cpu_done + attempt_cpu_s)


class FusedClock:
    """A fused trial's wall and CPU seconds, charged to its k seeds as they report: the time since the last report
    of any seed goes in equal parts to the seeds that trained together in it (a fused cross-entropy epoch: every live
    seed), or whole to the one seed that trained alone (SCST runs seed after seed: `a2core.fused`). The seeds' totals
    sum to the trial's."""

    def __init__(self, k: int):
        self.wall, self.cpu = time.monotonic(), time.process_time()
        self.charged = [[0.0, 0.0] for _ in range(k)]  # per seed: wall, CPU seconds of this attempt

    def charge(self, seed: int, together: list[int]) -> tuple[float, float]:
        """(wall, CPU) seconds of this attempt charged to `seed` so far, once the time since the last report is
        shared among `together` (the seeds that trained in it, `seed` among them)."""
        wall, cpu = time.monotonic(), time.process_time()
        for i in together:
            self.charged[i][0] += (wall - self.wall) / len(together)
            self.charged[i][1] += (cpu - self.cpu) / len(together)
        self.wall, self.cpu = wall, cpu
        return self.charged[seed][0], self.charged[seed][1]


class TrialRecorder:
    """What a trial does with each epoch's result: stamp its cost, log it, report it to Tune."""

    def __init__(self, plan: TrialPlan, gpus: float, sampled: dict, trial_id: str | None = None):
        """trial_id: a fused trial's seed's id in the record (`a2_fused_trial`); else this Tune trial's."""
        self.trial_id = trial_id or tune.get_context().get_trial_id()
        self.metric, self.mode = plan.metric, plan.mode
        self.run = plan.trials().join(train_run_name(plan.study, self.trial_id))
        if not self.run.join(TRIAL_FILE).exists():
            self.run.join(TRIAL_FILE).write_text(json.dumps({"trial_id": self.trial_id, "config": sampled},
                                                            sort_keys=True, default=str))
        if plan.adoptable:
            adopt(plan, self.run, self.trial_id, sampled)
        self.log = ResultLog(self.run.join(RESULTS_FILE))
        self.log.add_missing(latest_checkpoint_history(self.run))
        self.meter = ComputeMeter(list(self.log.by_epoch.values()), gpus)

    def record(self, item: dict, attempt_cpu_s: float, group: str | None = None) -> None:
        """Log the result (`log`) and report it to Tune (`report_to_tune`)."""
        self.log_result(item, attempt_cpu_s, group)
        report_to_tune(plain_values(item), item.get("checkpoint_path"), item.get("epoch"))

    def log_result(self, item: dict, attempt_cpu_s: float, group: str | None = None,
                   wall_s: float | None = None) -> None:
        """Stamp the result's cost (`ComputeMeter.stamp`), keep its artifacts and add it to the trial's result log."""
        # The result's own time (Tune keeps it) goes into the log too: an epoch that MLflow gets back from the log
        # after a driver died is logged at the time it was reported, in its place among the others.
        item.setdefault("timestamp", time.time())
        self.meter.stamp(item, attempt_cpu_s, group, wall_s)
        self.keep_artifacts(item)
        self.log.add(item)

    def keep_artifacts(self, item: dict) -> None:
        """A result's per-image scores and caption samples, as files below the run folder's `artifacts/` (the
        result log keeps plain values only): the best val epoch's per-image CIDEr-D (`eval/per_image_cider.json`,
        what the paired comparisons read; written when an epoch is the best so far, the latest of equals), the test split's of the
        selected checkpoint (`eval/test_per_image_cider.json`) and each epoch's samples (`samples/epoch_NNN.txt`)."""
        from a2core.train import PER_IMAGE_KEY, TEST_PER_IMAGE_KEY  # torch: as in `a2_local_trial`

        artifacts, epoch = self.run.join(ARTIFACTS_DIR), item.get("epoch")
        best = isinstance(epoch, int) and best_epoch(  # the best so far, by the one rule (a2core.selection)
            {**{e: r.get(self.metric) for e, r in self.log.by_epoch.items() if e < epoch},
             epoch: item.get(self.metric)}, self.mode) == epoch
        for key, name, wanted in ((PER_IMAGE_KEY, "eval/per_image_cider.json", best),
                                  (TEST_PER_IMAGE_KEY, "eval/test_per_image_cider.json", True)):
            scores = item.get(key) or {}
            ids, values = scores.get("ids"), scores.get("scores")
            if wanted and ids and values and len(ids) == len(values):
                artifacts.join(name).write_text(
                    json.dumps({str(i): float(v) for i, v in zip(ids, values)}, sort_keys=True))
        samples = item.get("samples")
        if isinstance(epoch, int) and isinstance(samples, (list, tuple)) and samples and all(
                isinstance(s, str) for s in samples):
            artifacts.join(f"samples/epoch_{epoch:03d}.txt").write_text("\n".join(samples) + "\n")

    def ended(self) -> dict | None:
        """The trial's end record (`launch.layout.end_record`): it ended itself before (a restarted trial that had
        diverged ends again at once, without training)."""
        return end_record(self.run)

    def end(self, record: dict | None = None, tell_tune: bool = True) -> None:
        """Write the trial's end record (it diverged: `diverged_record`; None: the one already there, a restarted
        trial's) and tell Tune, so that it ends the trial TERMINATED when the trial then returns and the study goes
        on with the others. Tune refuses a trial's last result without the study metric (its strict metric check
        fails the whole study), so the trial reports the metric as NaN, which the searcher and the schedulers take
        as no value (`launch.search`); the result log and MLflow never see it. The line reaches the driver's
        output."""
        if record is not None:
            self.run.join(ENDED_FILE).write_text(json.dumps(record, indent=1) + "\n")
            print(f"WARNING: trial {self.trial_id} {end_text(record)}: it ends here, the study goes on", flush=True)
        record = record or self.ended() or {}
        if tell_tune:  # a fused trial's seed: the trial goes on with the others (`a2_fused_trial`)
            tune.report({self.metric: float("nan"), "a2/end_reason": str(record.get("reason"))})

    def report_again(self, epoch: int) -> None:
        """Report the logged result of `epoch` (where a resumed trial starts) to Tune once more, before training:
        the scheduler judges the trial there, so a replicate paused at a rung whose group was then stopped stops
        without training another epoch (`launch.search.ReplicateASHA`). The searcher, the scheduler and MLflow
        (same step and timestamp) take an epoch reported twice as one."""
        if epoch in self.log.by_epoch:
            tune.report(dict(self.log.by_epoch[epoch]))


def report_to_tune(reported: dict, checkpoint: str | list | None, epoch) -> None:
    """Tell Tune of a result (JSON-plain values: the per-image scores and samples stay in `artifacts/`, out of
    Tune's state). A result with a checkpoint (its stored path, or a fused trial's seeds' paths) also gets a tiny Tune
    checkpoint pointing at the real one: without one, `Tuner.restore` would restart the trial's result history from
    nothing."""
    if not checkpoint:
        tune.report(reported)
        return
    with tempfile.TemporaryDirectory(prefix="a2-tune-ckpt-") as folder:
        pointer = {"train_checkpoint": checkpoint, "epoch": epoch}
        (Path(folder) / TUNE_POINTER_FILE).write_text(json.dumps(pointer))
        tune.report(reported, checkpoint=tune.Checkpoint.from_directory(folder))


def _same_config(a, b) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def adopt(plan: TrialPlan, run, trial_id: str, sampled: dict) -> dict | None:
    """Continue a lost trial: when the run folder `run` of a starting trial has no checkpoint yet, the newest of the
    run folders in `plan.adoptable` (trials the resumed study's Tune state does not know) whose trial had the same
    sampled configuration, seed included (`TRIAL_FILE`), and a complete checkpoint, not continued already, is copied
    into `run`: its checkpoint folders, its results up to its newest checkpoint, its artifacts and end record. The
    trial then resumes from there as from its own checkpoints. The old folder is marked superseded last
    (`SUPERSEDED_FILE`, read by the MLflow export, which ends its run so). Returns the mark, None when nothing was
    continued."""
    if checkpoint_epochs(run):
        return None
    trials = plan.trials()
    found = None  # (newest epoch, folder, complete epochs)
    for name in plan.adoptable:
        old = trials.join(name)
        if old.uri == run.uri or old.join(SUPERSEDED_FILE).exists():
            continue
        try:
            record = json.loads(old.join(TRIAL_FILE).read_text() or "null")
        except ValueError:
            continue
        if not isinstance(record, dict) or not _same_config(record.get("config"), sampled):
            continue
        epochs = [e for e in checkpoint_epochs(old) if old.join(checkpoint_name(e), CHECKPOINT_FILE).exists()]
        if epochs and (found is None or epochs[-1] > found[0]):
            found = (epochs[-1], old, epochs)
    if found is None:
        return None
    newest, old, epochs = found
    for epoch in epochs:
        old.join(checkpoint_name(epoch)).copy_folder(run.join(checkpoint_name(epoch)), last=CHECKPOINT_FILE)
    if old.join(ARTIFACTS_DIR).listdir():
        old.join(ARTIFACTS_DIR).copy_folder(run.join(ARTIFACTS_DIR))
    try:
        results = results_by_epoch(old.join(RESULTS_FILE).read_text())
    except ValueError:  # cut short: the checkpoint's own history has the epochs (`TrialRecorder`)
        results = {}
    ResultLog(run.join(RESULTS_FILE)).add_missing([r for epoch, r in results.items() if epoch <= newest])
    ended = old.join(ENDED_FILE).read_text()
    if ended is not None:
        run.join(ENDED_FILE).write_text(ended)
    mark = {"by": trial_id, "run": run.uri, "epoch": newest}
    old.join(SUPERSEDED_FILE).write_text(json.dumps(mark, indent=1) + "\n")
    print(f"trial {trial_id} continues {old.uri}, a trial of the same configuration that the study's Tune state "
          f"does not know (its driver was killed before Tune saved it), from its checkpoint of epoch {newest}",
          flush=True)
    return mark


def finished_before(config: dict, epoch: int | None, result: dict | None) -> bool:
    """Whether a trial resumed at `epoch` (its newest checkpoint; `result`, that epoch's logged result) had done
    everything: its last epoch, and the test split scored when the run scores it. A trial stopped after its last
    epoch's checkpoint but before that result was kept resumes to score the test split (`a2core.train`)."""
    t = Config.from_dict(config).train
    if epoch is None or epoch < t.xe_epochs + t.scst_epochs:
        return False
    return not t.test_at_end or any(str(k).startswith("test/") for k in (result or {}))


# -- one-worker trials: training in the Tune trial itself --------------------------------------------------------
class LocalCheckpoints:
    """A one-worker trial's checkpoint folders, kept as Ray Train keeps them: the best `num_to_keep` by the study
    metric plus the latest. A folder is complete once it has its `checkpoint.pt` (written last on S3; a local
    folder is renamed into place whole)."""

    def __init__(self, run, metric: str, mode: str, num_to_keep: int):
        self.run, self.metric, self.mode, self.num_to_keep = run, metric, mode, num_to_keep

    def complete_epochs(self) -> list[int]:
        return [e for e in checkpoint_epochs(self.run) if self.run.join(checkpoint_name(e), CHECKPOINT_FILE).exists()]

    def save(self, source: str, epoch: int) -> str:
        """Store the checkpoint folder `source` as epoch `epoch`'s; returns where it now is (path or URI)."""
        target = self.run.join(checkpoint_name(epoch))  # replaced: an epoch trained again after a restart
        write_checksum(Path(source) / CHECKPOINT_FILE)  # beside it, copied before it: checked whenever it is read
        open_location(source).copy_folder(target, last=CHECKPOINT_FILE)
        return target.uri

    def keep_epoch(self, trial: "TrialRecorder", metrics: dict, checkpoint_dir: str | None, attempt_cpu_s: float,
                   fused_wall_s: float | None = None) -> None:
        """An epoch's result (`a2core.train.train`'s report): its checkpoint folder stored, the result recorded by
        `trial` (logged, and reported to Tune unless it is a fused trial's seed, charged `fused_wall_s`), the
        checkpoints no longer kept deleted."""
        item = dict(metrics)
        if checkpoint_dir is not None:
            item["checkpoint_path"] = self.save(checkpoint_dir, int(item["epoch"]))
            kill_point("checkpoint-saved", item["epoch"])
        if fused_wall_s is None:
            trial.record(item, attempt_cpu_s)
        else:
            trial.log_result(item, attempt_cpu_s, wall_s=fused_wall_s)
        own_best = item.get("best/epoch")
        self.prune({e: r[self.metric] for e, r in trial.log.by_epoch.items()
                    if isinstance(r.get(self.metric), (int, float))},
                   also=int(own_best) if isinstance(own_best, (int, float)) else None)

    def prune(self, values: dict[int, float], also: int | None = None) -> None:
        """Delete the folders neither latest nor among the best (`values`: epoch -> the study metric) nor `also`:
        a2core's own best epoch (`best/epoch`, by train.select_metric, which the study sets to its metric), which
        SCST and the test split start from when the trial resumes: kept even when a later epoch ties it."""
        epochs = self.complete_epochs()
        if len(epochs) <= self.num_to_keep:
            return
        scored = sorted((e for e in epochs if e in values), key=lambda e: rank(values[e], e, self.mode), reverse=True)
        keep = {epochs[-1], *scored[:self.num_to_keep], also}
        for epoch in epochs:
            if epoch not in keep:
                self.run.join(checkpoint_name(epoch)).delete_folder()


def diverged_record(err) -> dict:
    """The end record of a trial whose training diverged (`a2core.errors.TrainingDiverged`)."""
    return {"reason": "diverged", "epoch": err.epoch, "step": err.step, "key": err.key, "value": str(err.value)}


class EpochProgress:
    """`a2core.train.train`'s `progress` callback in a trial (rank 0): where the trial is within its epoch, written
    to its run folder (`launch.layout.PROGRESS_FILE`, read by `launch.layout.progress_record`) at its first step and
    then at most every `every_s` seconds, so that `a2 study status` shows a COCO epoch of two hours under way, and
    times it before its first epoch ends. On S3 that is one small object written every `every_s`; a write that fails
    is skipped (the next may land): the file is advisory, the training is not."""

    def __init__(self, run, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.target, self.every_s, self.clock = run.join(PROGRESS_FILE), every_s, clock
        self.epoch_start: tuple | None = None  # (stage, epoch, steps done, clock) at the epoch's first step seen
        self.last_write: float | None = None

    def __call__(self, progress) -> None:  # progress: a2core.train.StepProgress
        now = self.clock()
        where = (progress.stage, progress.epoch)
        if self.epoch_start is None or self.epoch_start[:2] != where:
            self.epoch_start = (*where, progress.done, now)
        if self.last_write is not None and now - self.last_write < self.every_s:
            return
        steps, seconds = progress.done - self.epoch_start[2], now - self.epoch_start[3]
        record = {"stage": progress.stage, "epoch": progress.epoch, "done": progress.done, "total": progress.total,
                  # the steps timed in this epoch: its first is the clock's start, so one step times none
                  "seconds_per_step": seconds / steps if steps > 0 else None, "time": time.time()}
        try:
            self.target.write_text(json.dumps(record) + "\n")
        except (StorageError, OSError):
            return
        self.last_write = now


def watch_stage_two(trainers, runs) -> None:
    """A fused trial's seeds (`a2core.fused.FusedReplicates.trainers`, one `a2core.train.Trainer` each) write where
    they are within each stage-2 epoch to their own run folder (`runs`), as a seed trained alone does: `run` trains
    stage 2 one seed after the other through each seed's trainer, which `train`'s `progress` never reached (a fused
    trial wrote none unless resumed past stage 1); the fused stage-1 epochs step no seed's trainer and write none."""
    for trainer, run in zip(trainers, runs, strict=True):
        trainer.progress = EpochProgress(run)


def a2_local_trial(config: dict, plan: TrialPlan) -> None:
    """A one-worker trial: `a2core.train.train` in this Tune trial process, resuming from the newest checkpoint."""
    # torch (a2core's training and checkpoints, Ray's TorchTrainer): in a trial's process only; the driver imports
    # this module for the trial's plan and loads no torch
    from a2core.train import train

    train = plan.train or train
    cpu_start = time.process_time()
    _quiet_per_epoch_logs()
    use_temp_root(plan.temp_root())
    trial = TrialRecorder(plan, plan.resources["gpus_per_worker"], config)
    if trial.ended() is not None:  # it diverged before a driver was killed: it ends again, untrained
        trial.end()
        return
    checkpoints = LocalCheckpoints(trial.run, plan.metric, plan.mode, plan.num_to_keep)

    def report(metrics: dict, checkpoint_dir: str | None) -> None:
        checkpoints.keep_epoch(trial, metrics, checkpoint_dir, time.process_time() - cpu_start)

    with tempfile.TemporaryDirectory(prefix="a2-trial-") as folder:
        work = Path(folder)
        epoch, resume_from = newest_readable_checkpoint(trial.run, checkpoints.complete_epochs(), work)
        best_from = None
        if epoch is not None:
            trial.report_again(epoch)
            if finished_before(plan.config(config), epoch, trial.log.by_epoch.get(epoch)):
                return  # a driver killed after the trial's last result, before Tune ended it: nothing left to do
            best_from = best_copy(trial.run, resume_from, epoch, work)
        try:
            train(plan.config(config), report, output_dir=str(work / "out"), resume_from=resume_from,
                  best_from=best_from, progress=EpochProgress(trial.run))
        except TrainingDiverged as err:
            trial.end(diverged_record(err))


class FusedSeeds:
    """The seeds of a fused trial (`a2_fused_trial`): each a trial of the record (`TrialRecorder` with its own id and
    run folder, `LocalCheckpoints`), and the one result a epoch Tune hears of them all (`report_epoch`)."""

    def __init__(self, plan: TrialPlan, sampled: dict):
        self.plan = plan
        self.tune_id = tune.get_context().get_trial_id()
        self.seeds = fused_seeds(sampled)
        self.clock = FusedClock(len(self.seeds))  # the trial's compute, charged to the seeds that used it
        self.trials = [TrialRecorder(plan, plan.resources["gpus_per_worker"], seed_sampled(sampled, s),
                                     trial_id=seed_trial_id(self.tune_id, s)) for s in self.seeds]
        self.configs = [plan.config(seed_sampled(sampled, s)) for s in self.seeds]
        self.checkpoints = [LocalCheckpoints(t.run, plan.metric, plan.mode, plan.num_to_keep) for t in self.trials]
        self.live = {i for i, t in enumerate(self.trials) if t.ended() is None}  # a seed that diverged stays ended
        self.reported: set[int] = set()  # epochs Tune heard of

    def report(self, i: int, metrics: dict, checkpoint_dir: str | None) -> None:
        """Seed i's epoch (`a2core.train.train`'s report): its checkpoint stored, its result logged; Tune hears of
        the epoch once every live seed has it."""
        # a cross-entropy epoch trains every live seed at once; SCST trains one seed after the other
        wall, cpu = self.clock.charge(i, sorted(self.live) if metrics.get("stage") == "xe" else [i])
        self.checkpoints[i].keep_epoch(self.trials[i], metrics, checkpoint_dir, cpu, fused_wall_s=wall)
        self.report_epoch(int(metrics["epoch"]))

    def end(self, i: int, err: TrainingDiverged) -> None:
        """Seed i diverged: its end record; the others go on (an epoch Tune waited for on it may be complete now)."""
        self.trials[i].end(diverged_record(err), tell_tune=False)
        self.live.discard(i)
        for epoch in sorted({e for t in self.trials for e in t.log.by_epoch} - self.reported):
            self.report_epoch(epoch)
        if not self.live:  # the last one: Tune's last result must hold the metric (`TrialRecorder.end`)
            tune.report({self.plan.metric: float("nan"), "a2/end_reason": "diverged"})

    def report_epoch(self, epoch: int, again: bool = False) -> None:
        """Tell Tune of `epoch` once every live seed has logged it: the mean of their study metric (what the searcher
        asks for; NaN, no value, when none has one) and each seed's values (`seed_result_key`: what the scheduler
        judges and the live table shows). `again`: a resumed trial's starting epoch, told once more."""
        if (epoch in self.reported and not again) or not self.live or any(
                epoch not in self.trials[i].log.by_epoch for i in self.live):
            return
        self.reported.add(epoch)
        results = {i: self.trials[i].log.by_epoch[epoch] for i in sorted(self.live)}
        values = [v for r in results.values() if (v := finite(r.get(self.plan.metric))) is not None]
        reported = {"epoch": epoch, self.plan.metric: float(sum(values) / len(values)) if values else float("nan")}
        for i, result in results.items():
            reported.update({seed_result_key(self.seeds[i], k): v for k, v in plain_values(result).items()
                             if k not in ("trial_id", "config")})
        paths = [r.get("checkpoint_path") for r in results.values()]
        report_to_tune(reported, paths if all(paths) else None, epoch)

    def start(self, work: Path) -> tuple[dict, dict, dict] | None:
        """Where the live seeds with work left resume: ({seed index: epoch}, {...: resume_from}, {...: best_from}), or
        None when every one had done everything. Fused seeds step together, so in stage 1 they resume from one epoch, the newest that each has a
        readable checkpoint of (a seed ahead trains its later epochs again); once all are past stage 1 (each trains
        stage 2 alone) each resumes from its own newest."""
        live = sorted(self.live)
        for i in live:
            (work / str(i)).mkdir(parents=True, exist_ok=True)

        def newest(i: int, below: int | None = None) -> tuple[int | None, Path | None]:
            epochs = [e for e in self.checkpoints[i].complete_epochs() if below is None or e <= below]
            return newest_readable_checkpoint(self.trials[i].run, epochs, work / str(i))
        found = fused_resume_points(live, newest, lambda i: self.checkpoints[i].complete_epochs(),
                                    self.configs[0]["train"]["xe_epochs"])
        starts = {i: found[i][0] for i in live}
        for epoch in sorted({e for e in starts.values() if e is not None}):
            self.report_epoch(epoch, again=True)
        left = [i for i in live if not finished_before(self.configs[i], starts[i],
                                                       self.trials[i].log.by_epoch.get(starts[i]))]
        if not left:
            return None
        best = {i: best_copy(self.trials[i].run, found[i][1], starts[i], work / str(i))
                if starts[i] is not None else None for i in left}
        return {i: starts[i] for i in left}, {i: found[i][1] for i in left}, best


def fused_resume_points(live: list[int], newest: Callable, kept: Callable, xe_epochs: int) -> dict:
    """{seed index: (epoch, checkpoint path)} where each live seed of a fused trial resumes ((None, None): from the
    start). `newest(i, below=None)`: seed i's newest readable checkpoint (at most `below`); `kept(i)`: the epochs it
    has complete checkpoints of. Once every seed is past stage 1 (each trains stage 2 alone) each resumes from its
    own newest; before, they step together, so from the newest epoch that every seed has a readable checkpoint of
    (a seed ahead trains its later epochs again). That epoch is looked for among all the seeds keep, not only at the
    oldest of their newest: retention by each seed's own scores can have pruned that one in one seed."""
    found = {i: newest(i) for i in live}
    epochs = [found[i][0] for i in live]
    if all(e is not None and e >= xe_epochs for e in epochs) or len(set(epochs)) == 1:
        return found
    for epoch in sorted(set.intersection(*(set(kept(i)) for i in live)), reverse=True):
        at = {i: newest(i, epoch) for i in live}
        if all(at[i][0] == epoch for i in live):
            return at
    return {i: (None, None) for i in live}


def a2_fused_trial(sampled: dict, plan: TrialPlan) -> None:
    """A fused trial (`resources.fuse_replicates`): the seeds of one configuration (`launch.layout.fused_seeds`)
    in this Tune trial process, trained as one model in stage 1 (`a2core.fused`), each a trial of the record with
    its own run folder, result log, checkpoints and end record (`FusedSeeds`); stage 2 per seed, one after the other
    (as `a2core.fused` runs it). A rehearsal's stand-in trainer (`plan.train`) trains the seeds one epoch each in
    turn (`_stand_in_lockstep`)."""
    from a2core.fused import FusedReplicates
    from a2core.train import train

    if fused_seeds(sampled) is None:  # a trial of one seed: a study started before fused trials, resumed
        a2_local_trial(sampled, plan)
        return
    _quiet_per_epoch_logs()
    use_temp_root(plan.temp_root())
    seeds = FusedSeeds(plan, sampled)
    if not seeds.live:  # every seed diverged before a driver was killed: it ends again, untrained
        tune.report({plan.metric: float("nan"), "a2/end_reason": "diverged"})
        return
    with tempfile.TemporaryDirectory(prefix="a2-trial-") as folder:
        work = Path(folder)
        start = seeds.start(work)
        if start is None:
            return  # as in `a2_local_trial`: every seed had done everything
        starts, resume_from, best_from = start
        live = sorted(starts)
        if plan.train is not None:
            _stand_in_lockstep(seeds, plan.train, work, resume_from)
            return
        xe = seeds.configs[0]["train"]["xe_epochs"]
        if all(starts[i] is not None and starts[i] >= xe for i in live):  # stage 2: each seed on its own
            for i in live:
                try:
                    train(seeds.configs[i], functools.partial(seeds.report, i), output_dir=str(work / str(i) / "out"),
                          resume_from=resume_from[i], best_from=best_from[i],
                          progress=EpochProgress(seeds.trials[i].run))
                except TrainingDiverged as err:
                    seeds.end(i, err)
            return
        fused = FusedReplicates([seeds.configs[i] for i in live], [str(work / str(i) / "out") for i in live],
                                resume_from=[resume_from[i] for i in live], best_from=[best_from[i] for i in live])
        watch_stage_two(fused.trainers, [seeds.trials[i].run for i in live])
        if plan.resources.get("capture_step"):
            fused.capture()
        results = fused.run([functools.partial(seeds.report, i) for i in live])
        for i, result in zip(live, results):
            if isinstance(result, TrainingDiverged):
                seeds.end(i, result)


class _EpochReported(Exception):
    """A stand-in seed's epoch is in (`_stand_in_lockstep`): the next seed's turn."""


def _stand_in_lockstep(seeds: FusedSeeds, train: Callable, work: Path, resume_from: dict) -> None:
    """A rehearsal's fused trial: its stand-in trainer (`a2core.train.train`'s contract, `launch.rehearse`) trains
    each seed one epoch in turn, resuming from the seed's last checkpoint, so that Tune hears each epoch of the group
    when a fused trial would, and the scheduler stops the whole group at a rung as it stops a fused one."""
    pending = dict(resume_from)  # seed index -> the checkpoint its next epoch resumes from
    while pending:
        for i in sorted(pending):
            local = work / str(i) / "lockstep.pt"

            def report(metrics: dict, checkpoint_dir: str | None, i=i, local=local) -> None:
                seeds.report(i, metrics, checkpoint_dir)
                shutil.copyfile(Path(checkpoint_dir) / CHECKPOINT_FILE, local)
                raise _EpochReported
            try:
                train(seeds.configs[i], report, output_dir=str(work / str(i) / "out"), resume_from=pending[i],
                      best_from=None)
            except _EpochReported:
                pending[i] = local
                continue
            except TrainingDiverged as err:
                seeds.end(i, err)
            del pending[i]  # its run is over


def best_copy(run, resume_from: Path, epoch: int, work: Path) -> Path | None:
    """The checkpoint a trial resumed at `epoch` from `resume_from` scores the test split from (a2core's
    `best_from`): `resume_from` itself when that epoch is the best so far (its new output folder has no best.pt
    until a later epoch beats it), else a copy of the best epoch's from the run folder `run` (None: not kept, the run
    says so when it scores the test split)."""
    best = best_epoch_of(resume_from)
    if best is None:
        return None
    if best == epoch:
        return resume_from
    target = work / "best_epoch" / CHECKPOINT_FILE
    target.parent.mkdir(exist_ok=True)
    stored = run.join(checkpoint_name(best), CHECKPOINT_FILE)
    try:
        stored.download(target)
        damaged = checksum_problem(target, stored.recorded_checksum(), stored.uri)
    except (OSError, StorageError):
        return None
    if damaged:  # as `newest_readable_checkpoint` passes one over: the test split is not scored from it
        print(f"WARNING: {damaged}", flush=True)
        return None
    return target


def best_epoch_of(checkpoint_file) -> int | None:
    """The epoch of the best val score so far recorded in a checkpoint (None before any)."""
    from a2core import checkpoint  # torch: as in `a2_local_trial`

    epoch = (checkpoint.load(checkpoint_file, map_location="cpu").get("best") or {}).get("epoch")
    return int(epoch) if epoch else None


def newest_readable_checkpoint(run, epochs: list[int], work: Path, first: int | None = None
                               ) -> tuple[int | None, Path | None]:
    """(epoch, local copy) of the newest checkpoint of the run folder `run` among `epochs` that loads, trying epoch
    `first` before the others when it is among them (Ray Train's resume point); an unreadable one (truncated,
    garbage) is passed over, saying so with its storage path. (None, None) when none loads."""
    from a2core import checkpoint  # torch: as in `a2_local_trial`

    def say(text: str) -> None:  # a trial's printed lines reach the driver's output (Ray forwards them)
        print(f"WARNING: {text}", flush=True)
    skipped = []
    for epoch in sorted(epochs, key=lambda e: (e == first, e), reverse=True):
        stored = run.join(checkpoint_name(epoch), CHECKPOINT_FILE)
        local = work / CHECKPOINT_FILE
        try:
            stored.download(local)
            # a flipped byte: passed over like a file that does not load
            damaged = checksum_problem(local, stored.recorded_checksum(), str(local))
            if damaged:
                raise CheckpointError(damaged)
            checkpoint.load(local)
        except (CheckpointError, OSError) as err:
            reason = str(err).replace(f"{local}: ", "").splitlines()[0][:200]
            say(f"checkpoint {stored.uri} is unreadable ({reason})")
            skipped.append(stored.uri)
            continue
        if skipped:
            say(f"resuming from {stored.uri} (epoch {epoch}), the newest readable checkpoint, instead of {skipped[0]}")
        return epoch, local
    if skipped:
        say(f"no readable checkpoint in {run.uri}: the trial starts again from epoch 1")
    return None, None


# -- trials on Ray Train -----------------------------------------------------------------------------------------
def ray_train_start(run, work: Path, epochs: list[int]) -> tuple | None:
    """Where a Ray Train trial resumes when the checkpoint Ray Train would resume from does not load: (filesystem,
    path) of the newest checkpoint folder of the run folder `run` that does, among `epochs` (its complete ones).
    None: Ray Train's own resume point loads (or there is no checkpoint), it resumes or starts as usual.

    Ray Train resumes, unread, from the latest checkpoint its record (`checkpoint_manager_snapshot.json`) names. When
    that one is unreadable (or missing), the record is removed, so that Ray Train starts a new one, and so are the
    unreadable folders past the fallback, whose epochs are trained and stored again under the same names (as a
    one-worker trial's are). Folders up to the fallback stay, outside the new record (never pruned by Ray Train)."""
    if not epochs:
        return None
    recorded = recorded_latest_epoch(run.join(TRAIN_SNAPSHOT))
    epoch, _ = newest_readable_checkpoint(run, epochs, work, first=recorded)
    if epoch is not None and epoch == recorded:
        return None
    run.join(TRAIN_SNAPSHOT).delete()
    for unreadable in (e for e in epochs if epoch is None or e > epoch):
        run.join(checkpoint_name(unreadable)).delete_folder()
    return None if epoch is None else run.join(checkpoint_name(epoch)).filesystem  # for Ray's Checkpoint


def recorded_latest_epoch(snapshot) -> int | None:
    """The epoch of the latest checkpoint in Ray Train's record of a run's checkpoints (the `Location` `snapshot`):
    where Ray Train resumes. None without a readable record."""
    try:
        state = json.loads(snapshot.read_text() or "null")
        name = state["latest_checkpoint_result"]["checkpoint_dir_name"]
    except (ValueError, TypeError, KeyError):
        return None
    digits = name[len(CHECKPOINT_PREFIX):] if isinstance(name, str) and name.startswith(CHECKPOINT_PREFIX) else ""
    return int(digits) if digits.isdigit() else None


def _cpu_seconds_all_ranks(since: float) -> float:
    """CPU seconds spent since `since`, summed over the ranks (a collective: every rank calls it each report)."""
    import torch  # torch: as in `a2_local_trial`
    import torch.distributed as dist

    spent = time.process_time() - since
    if not (dist.is_available() and dist.is_initialized()):
        return spent
    total = torch.tensor([spent], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(total)
    return float(total.item())


def worker_fn(config: dict, temp_root: str, start_from: tuple | None = None, run=None) -> None:
    """The Ray Train loop of one worker: a2core's training with Ray's report, checkpoint and resume. `start_from`:
    (filesystem, path) of the checkpoint folder to resume from while Ray Train has none of its own
    (`ray_train_start`: its latest was unreadable). `run`: the trial's run folder (a Location), where rank 0 writes
    where it is within its epoch (`EpochProgress`; `train` calls it on rank 0 only)."""
    from a2core.train import train  # torch: as in `a2_local_trial`

    cpu_start = time.process_time()
    worker_group = f"{socket.gethostname()}:{os.getpid()}"  # rank 0's process: a restarted group has a new one
    _quiet_per_epoch_logs()
    use_temp_root(temp_root)

    def report(metrics: dict, checkpoint_dir: str | None) -> None:
        metrics = {**metrics, ATTEMPT_CPU_KEY: _cpu_seconds_all_ranks(cpu_start), ATTEMPT_GROUP_KEY: worker_group}
        if checkpoint_dir:  # rank 0's: its SHA-256 beside it, uploaded with it (as a one-worker trial's)
            write_checksum(Path(checkpoint_dir) / CHECKPOINT_FILE)
        checkpoint = Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        # Every rank reports (a barrier); rank 0 alone brings the checkpoint, stored under a readable name.
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_name(metrics["epoch"]))

    rank = ray.train.get_context().get_world_rank()
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"a2-trial-r{rank}-"))
        resume_from = best_from = None
        checkpoint = ray.train.get_checkpoint()  # the run's latest, after any restart
        if checkpoint is None and start_from is not None:
            checkpoint = Checkpoint(start_from[1], filesystem=start_from[0])
        if checkpoint is not None:
            local = Path(stack.enter_context(checkpoint.as_directory()))
            if (local / CHECKPOINT_FILE).is_file():
                resume_from = str(local / CHECKPOINT_FILE)
                best_epoch = best_epoch_of(resume_from)
                if best_epoch is not None and checkpoint_name(best_epoch) == Path(checkpoint.path).name:
                    best_from = resume_from  # resumed at its best epoch: scored on the test split from it
                elif best_epoch is not None:
                    # the selected checkpoint is an earlier sibling in the run folder (kept: the best two are)
                    best = Checkpoint(str(Path(checkpoint.path).parent / checkpoint_name(best_epoch)),
                                      filesystem=checkpoint.filesystem)
                    try:
                        best_from = str(Path(stack.enter_context(best.as_directory())) / CHECKPOINT_FILE)
                    except OSError:
                        best_from = None  # not kept: the run says so when it scores the test split
        try:
            train(config, report, output_dir=str(Path(work) / "out"), resume_from=resume_from, best_from=best_from,
                  progress=None if run is None else EpochProgress(run))
        except TrainingDiverged as err:
            # Every rank stops at the same step (a2core.train decides in the gradients' all-reduce) and reports this
            # (a barrier); the trial writes the end record and the Train run ends normally, not retried.
            ray.train.report({DIVERGED_KEY: diverged_record(err)})


def _forwarder(queue):
    """A Train callback (in the Train controller) handing rank 0's metrics and checkpoint path to the trial through
    `queue`: Ray's `TuneReportCallback`, but the trial reports them itself (`TrialRecorder`)."""
    class ForwardToTrial(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            item = dict(metrics[0])
            if checkpoint is not None:
                item["checkpoint_path"] = checkpoint.path
            queue.put(item)  # the queue holds one item: Train waits until the driver has taken the last one

    return ForwardToTrial()


def a2_trial(config: dict, plan: TrialPlan) -> None:
    """A trial on Ray Train: its `TorchTrainer` runs (or resumes) in a thread while this reports what the
    controller forwards; a failure of `fit()` is raised here, so that Tune retries the trial."""
    from ray.train.torch import TorchTrainer  # torch: as in `a2_local_trial`

    _quiet_per_epoch_logs()
    use_temp_root(plan.temp_root())
    res = plan.resources
    trial = TrialRecorder(plan, res["workers_per_trial"] * res["gpus_per_worker"], config)
    if trial.ended() is not None:  # as in `a2_local_trial`
        trial.end()
        return
    done = [e for e in checkpoint_epochs(trial.run) if trial.run.join(checkpoint_name(e), CHECKPOINT_FILE).exists()]
    if done and finished_before(plan.config(config), done[-1], trial.log.by_epoch.get(done[-1])):
        trial.report_again(done[-1])  # as in `a2_local_trial`: nothing left to train or score
        return
    with tempfile.TemporaryDirectory(prefix="a2-trial-") as folder:
        start_from = ray_train_start(trial.run, Path(folder), done)
    path, fs = plan.trials().ray_storage()
    # The queue lives and dies with this driver (same node), as the Train controller does.
    results = Queue(maxsize=1, actor_options={"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
        node_id=ray.get_runtime_context().get_node_id(), soft=False)})
    trainer = TorchTrainer(
        functools.partial(worker_fn, temp_root=str(plan.temp_root()), start_from=start_from,
                          run=trial.run.join()),  # a fresh Location: no pyarrow filesystem cached in it
        train_loop_config=plan.config(config),
        scaling_config=ray.train.ScalingConfig(num_workers=res["workers_per_trial"],
                                               use_gpu=res["gpus_per_worker"] > 0,  # so Ray picks nccl (else gloo)
                                               resources_per_worker=plan.worker_resource_request()),
        run_config=ray.train.RunConfig(
            name=train_run_name(plan.study, trial.trial_id),
            storage_path=path,
            storage_filesystem=fs,
            failure_config=ray.train.FailureConfig(max_failures=res["max_failures"]),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=plan.num_to_keep,
                                                         checkpoint_score_attribute=plan.metric,
                                                         checkpoint_score_order=plan.mode),
            callbacks=[_forwarder(results)],
        ),
    )
    failure: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as err:  # noqa: BLE001 - raised again in the trial's thread below
            failure.append(err)

    # A daemon thread: a trial that Tune stops must not wait for its Train run at exit.
    runner = threading.Thread(target=fit, name=f"a2-train-{trial.trial_id}", daemon=True)
    runner.start()
    while runner.is_alive() or not results.empty():  # once fit() returned, its last result may still be queued
        try:
            item = results.get(timeout=1.0)
        except Empty:
            continue
        if DIVERGED_KEY in item:
            trial.end(item[DIVERGED_KEY])
            continue
        trial.record(item, float(item.pop(ATTEMPT_CPU_KEY, 0.0)), item.pop(ATTEMPT_GROUP_KEY, None))
    runner.join()
    ray.kill(results.actor)
    if failure:
        raise failure[0]


def make_trainable(plan: TrialPlan, *, ray_train: bool = False):
    """The trial function bound to its plan and resources: `a2_local_trial` holding one worker's, else `a2_trial`
    holding `driver_cpus` (its Train workers ask for their own). `ray_train`: a one-worker trial on Ray Train too
    (benchmarks/bench_study.py)."""
    if plan.resources.get("fuse_replicates"):
        return tune.with_resources(tune.with_parameters(a2_fused_trial, plan=plan), plan.worker_resource_request())
    if plan.resources["workers_per_trial"] == 1 and not ray_train:
        return tune.with_resources(tune.with_parameters(a2_local_trial, plan=plan), plan.worker_resource_request())
    return tune.with_resources(tune.with_parameters(a2_trial, plan=plan), {"CPU": plan.resources["driver_cpus"]})


def propagated_env() -> dict:
    """Storage settings of this shell for the Ray job's workers (AWS keys moved into a credentials file first)."""
    stash_credentials()
    return {k: os.environ[k] for k in PROPAGATED_ENV if os.environ.get(k)}
