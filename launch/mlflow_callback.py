"""Ray Tune driver callback that tracks a study in MLflow through `dashboards.tracking.StudyTracker`.

One parent run per study, one child run per Tune trial id. Restores never duplicate runs: the
trial-id-to-run-id map is part of the callback state that Tune saves with the experiment (`get_state` /
`set_state`), and when that state is missing the run is found again by its `a2.trial_id` tag.

Every trial run carries its replicate group's `a2.config_hash` (the config without its seed, see
`launch.search.config_hash`), so MLflow and the tables group replicates by it. A trial that the scheduler stopped
(`stopped_early_of(trial_id)` returns the scheduler's record, e.g. `ReplicateASHA.stopped_early`) ends FINISHED
with `a2.stopped_early=true`, `a2.stopped_rung` and `a2.stopped_cutoff`: early-stopped is a state of the run,
which `dashboards.stats.best_candidates` keeps out of "best" unless nothing else finished.

Metrics are logged with an explicit step, the result's "epoch" (monotonic across restores and retries), never
Tune's `training_iteration`, which restarts at 1 when a Train run is restored.
"""
from __future__ import annotations

import functools
import json
import logging
import math
from typing import Callable

from ray.tune import Callback
from ray.tune.result import AUTO_RESULT_KEYS

from dashboards.stats import TAG_CONFIG_HASH, stopped_early_tags
from dashboards.tracking import TAG_BEST_CKPT, StudyTracker, check_tracking_uri
from launch.search import config_hash
from launch.trainable import CHECKPOINT_FILE

logger = logging.getLogger(__name__)

# Ray bookkeeping in every result: not metrics of the model.
_SKIP_KEYS = set(AUTO_RESULT_KEYS) | {
    "done", "trial_id", "experiment_id", "experiment_tag", "should_checkpoint", "timesteps_this_iter",
    "episodes_this_iter", "epoch", "samples", "checkpoint_path", "best_checkpoint", "best_checkpoint_path",
    "__duplicate__", "__trial_info__",
}
TAG_CHECKPOINT = "a2.checkpoint"
TAG_RAY_TRIAL = "a2.ray_trial_name"


def _guarded(method):
    """Tracking trouble in a hook is logged, not raised: a flaky MLflow server must not kill a study."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as err:  # noqa: BLE001
            if self.strict:
                raise
            logger.warning("MLflow tracking failed in %s: %s", method.__name__, err, exc_info=True)
            return None

    return wrapper


def _checkpoint_uri(checkpoint, path: str | None = None) -> str:
    """A URI of `path` (default: the checkpoint's folder) on the checkpoint's filesystem."""
    path = str(path or checkpoint.path)
    fs = getattr(checkpoint, "filesystem", None)
    kind = getattr(fs, "type_name", "local") if fs is not None else "local"
    if kind == "local" or "://" in path:
        return path
    return f"{kind}://{path}"


class A2MLflowCallback(Callback):
    """Track a Tune study in MLflow.

    Args:
        tracking_uri: MLflow tracking URI; checked (fast) in `setup`, before any trial starts.
        study_name: the study; also the experiment name unless `experiment` is given.
        study_params: logged as params of the parent run (flattened), e.g. the study spec.
        study_tags: extra tags of the parent run.
        resolve_config: maps a Tune trial's config to the full resolved training config that is logged as
            the child run's params (default: the trial config itself).
        metric, mode: the metric that decides a trial's best checkpoint (tag `a2.best_checkpoint`).
        strict: raise tracking errors from hooks instead of logging them (tests).
        artifact_location: artifact root of a newly created experiment (database backends without a server).
        history_of: maps a trial id to its result log (one result per epoch, see `launch.trainable.ResultLog`).
            With it, the first result of a trial in this driver, and its end, fill in the epochs that MLflow is
            missing: results a killed driver never logged, although their checkpoint was saved.
        stopped_early_of: maps a trial id to the scheduler's record of stopping it (`{"rung", "cutoff", ...}`)
            or None; with it, a stopped trial's run is tagged `a2.stopped_early` when the trial ends.
    """

    def __init__(self, tracking_uri: str, study_name: str, *, experiment: str | None = None,
                 study_params: dict | None = None, study_tags: dict | None = None,
                 resolve_config: Callable[[dict], dict] | None = None, metric: str = "val/CIDEr",
                 mode: str = "max", check_timeout: float = 5.0, strict: bool = False,
                 artifact_location: str | None = None, history_of: Callable[[str], list[dict]] | None = None,
                 stopped_early_of: Callable[[str], dict | None] | None = None):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        self.tracking_uri = tracking_uri
        self.study_name = study_name
        self.experiment = experiment
        self.artifact_location = artifact_location
        self.study_params = study_params or {}
        self.study_tags = study_tags or {}
        self.resolve_config = resolve_config
        self.metric, self.mode = metric, mode
        self.check_timeout = check_timeout
        self.strict = strict
        self.tracker: StudyTracker | None = None
        self.parent_run_id: str | None = None
        self.trial_runs: dict[str, str] = {}
        self.errored: set[str] = set()
        self.best: dict[str, tuple[float, int | None]] = {}   # trial id -> (best metric, training_iteration)
        self.last_step: dict[str, int] = {}
        self.history_of = history_of
        self.stopped_early_of = stopped_early_of
        self.backfilled: set[str] = set()  # trials whose missing epochs this driver has looked for

    # -- state saved by Tune with the experiment ---------------------------------------------------------------
    def get_state(self) -> dict:
        return {"parent_run_id": self.parent_run_id, "trial_runs": dict(self.trial_runs),
                "errored": sorted(self.errored), "best": dict(self.best), "last_step": dict(self.last_step)}

    def set_state(self, state: dict) -> None:
        self.parent_run_id = state.get("parent_run_id") or self.parent_run_id
        self.trial_runs.update(state.get("trial_runs") or {})
        self.errored.update(state.get("errored") or [])
        self.best.update({k: tuple(v) for k, v in (state.get("best") or {}).items()})
        self.last_step.update(state.get("last_step") or {})
        if self.tracker is not None:
            self.tracker.trial_runs.update(self.trial_runs)

    def __getstate__(self):  # the Tuner pickles its callbacks
        state = self.__dict__.copy()
        state["tracker"] = None
        state["backfilled"] = set()  # a restored driver looks again
        return state

    # -- hooks -------------------------------------------------------------------------------------------------
    def setup(self, stop=None, num_samples=None, total_num_samples=None, **info):
        # Not guarded: a bad tracking URI must stop the study before any trial starts.
        check_tracking_uri(self.tracking_uri, timeout=self.check_timeout)
        tracker = self._ensure_tracker()
        url = tracker.view_url()
        print(f"MLflow: study {self.study_name!r} -> parent run {self.parent_run_id}"
              + (f"; trials at {url}" if url else f" in {self.tracking_uri}"), flush=True)

    def _ensure_tracker(self) -> StudyTracker:
        if self.tracker is None:
            tracker = StudyTracker(self.tracking_uri, self.study_name, experiment=self.experiment,
                                   artifact_location=self.artifact_location)
            tracker.trial_runs.update(self.trial_runs)
            self.parent_run_id = tracker.start_study(self.study_params, self.study_tags)
            self.tracker = tracker
        return self.tracker

    def _config(self, trial) -> dict:
        config = dict(getattr(trial, "config", None) or {})
        return self.resolve_config(config) if self.resolve_config else config

    def _run_id(self, trial) -> str:
        tid = str(trial.trial_id)
        run_id = self.trial_runs.get(tid)
        if run_id is None:
            run_id = self._open(trial)
        return run_id

    def _open(self, trial) -> str:
        tracker = self._ensure_tracker()
        tid = str(trial.trial_id)
        tags = {TAG_RAY_TRIAL: str(trial), TAG_CONFIG_HASH: config_hash(dict(getattr(trial, "config", None) or {}))}
        run_id = tracker.trial_run(tid, self._config(trial), tags=tags, run_name=str(trial))
        self.trial_runs[tid] = run_id
        return run_id

    @_guarded
    def on_trial_start(self, iteration, trials, trial, **info):
        self._open(trial)

    @_guarded
    def on_trial_restore(self, iteration, trials, trial, **info):
        self._open(trial)

    @_guarded
    def on_trial_result(self, iteration, trials, trial, result, **info):
        tracker = self._ensure_tracker()
        run_id = self._run_id(trial)
        tid = str(trial.trial_id)
        step = self._step(tid, result)
        self._backfill(tid, run_id, before=step)
        tracker.log_metrics(run_id, self._metrics(result), step=step)

        value = result.get(self.metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
            old = self.best.get(tid)
            if old is None or (value > old[0] if self.mode == "max" else value < old[0]):
                self.best[tid] = (float(value), result.get("training_iteration"))
                self._log_per_image(run_id, result)

        ckpt = result.get("checkpoint_path")
        if isinstance(ckpt, str) and ckpt:
            tracker.set_tags(run_id, {TAG_CHECKPOINT: ckpt})

        samples = result.get("samples")
        if isinstance(samples, (list, tuple)) and samples and all(isinstance(s, str) for s in samples):
            tracker.log_text(run_id, "\n".join(samples) + "\n", f"samples/epoch_{step:03d}.txt")

    def _log_per_image(self, run_id: str, result: dict) -> None:
        """The best epoch's per-image CIDEr-D (`{image_id: score}`, x100) as the artifact that the paired
        bootstrap of `a2 study compare` and the report read (`dashboards.compare.PER_IMAGE_ARTIFACT`)."""
        from a2core.train import PER_IMAGE_KEY
        from dashboards.compare import PER_IMAGE_ARTIFACT

        per_image = result.get(PER_IMAGE_KEY) or {}
        ids, scores = per_image.get("ids"), per_image.get("scores")
        if ids and scores and len(ids) == len(scores):
            text = json.dumps({str(i): float(v) for i, v in zip(ids, scores)}, sort_keys=True)
            self._ensure_tracker().log_text(run_id, text, PER_IMAGE_ARTIFACT)

    def _metrics(self, result: dict) -> dict:
        return {k: v for k, v in result.items() if k not in _SKIP_KEYS and not isinstance(v, dict)}

    def _backfill(self, tid: str, run_id: str, before: int | None = None) -> None:
        """Log the epochs (< `before`) of the trial's result log that its run lacks; once per trial and driver."""
        if self.history_of is None or tid in self.backfilled:
            return
        self.backfilled.add(tid)
        history = [r for r in self.history_of(tid) or []
                   if isinstance(r.get("epoch"), (int, float)) and (before is None or int(r["epoch"]) < before)]
        if not history:
            return
        tracker = self._ensure_tracker()
        logged = tracker.logged_steps(run_id, self.metric)
        for result in history:
            epoch = int(result["epoch"])
            if epoch not in logged:
                tracker.log_metrics(run_id, self._metrics(result), step=epoch)
                self.last_step[tid] = max(epoch, self.last_step.get(tid, 0))
                logger.info("MLflow: trial %s epoch %d logged from its result log", tid, epoch)

    def _step(self, tid: str, result: dict) -> int:
        epoch = result.get("epoch")
        if isinstance(epoch, (int, float)) and not isinstance(epoch, bool):
            step = int(epoch)
        else:  # no epoch in the result: keep a monotonic count of our own
            step = self.last_step.get(tid, 0) + 1
        self.last_step[tid] = max(step, self.last_step.get(tid, 0))
        return step

    @_guarded
    def on_checkpoint(self, iteration, trials, trial, checkpoint, **info):
        # Tune processes a result before the checkpoint reported with it (trial.last_result is that result).
        tracker = self._ensure_tracker()
        run_id = self._run_id(trial)
        uri = _checkpoint_uri(checkpoint)
        train_ckpt = (getattr(trial, "last_result", None) or {}).get("checkpoint_path")
        if train_ckpt:  # Tune's checkpoint only points at the Train checkpoint (launch.trainable): name the weights
            uri = _checkpoint_uri(checkpoint, f"{str(train_ckpt).rstrip('/')}/{CHECKPOINT_FILE}")
        tags = {TAG_CHECKPOINT: uri}
        best = self.best.get(str(trial.trial_id))
        last_it = (getattr(trial, "last_result", None) or {}).get("training_iteration")
        if best is not None and best[1] is not None and best[1] == last_it:
            tags[TAG_BEST_CKPT] = uri
        tracker.set_tags(run_id, tags)

    @_guarded
    def on_trial_recover(self, iteration, trials, trial, **info):
        # The trial will be retried: its run stays open and continues when it restarts.
        tracker = self._ensure_tracker()
        tracker.set_tags(self._run_id(trial), {"a2.retries": str(getattr(trial, "num_failures", ""))})

    @_guarded
    def on_trial_complete(self, iteration, trials, trial, **info):
        run_id = self._run_id(trial)
        self._backfill(str(trial.trial_id), run_id)  # a trial restored after its last epoch reports nothing more
        stop = self.stopped_early_of(str(trial.trial_id)) if self.stopped_early_of else None
        if stop:
            self._ensure_tracker().set_tags(run_id, stopped_early_tags(stop["rung"], stop["cutoff"]))
        self._ensure_tracker().end_trial(run_id, "FINISHED")

    @_guarded
    def on_trial_error(self, iteration, trials, trial, **info):
        # Called only when Tune gives up on the trial (retries go through on_trial_recover).
        self.errored.add(str(trial.trial_id))
        self._ensure_tracker().end_trial(self._run_id(trial), "FAILED")

    @_guarded
    def on_experiment_end(self, trials, **info):
        tracker = self._ensure_tracker()
        unfinished = False
        for trial in trials or []:
            status = getattr(trial, "status", None)
            run_id = self.trial_runs.get(str(trial.trial_id))
            if status == "ERROR":
                self.errored.add(str(trial.trial_id))
            elif status != "TERMINATED":
                unfinished = True  # interrupted study: resumable, its open runs are marked KILLED for now
                if run_id is not None:
                    tracker.end_trial(run_id, "KILLED")
        if self.errored:
            status = "FAILED"
        elif unfinished:
            status = "KILLED"
        else:
            status = "FINISHED"
        tracker.end_study(status)

    # convenience for reports and tests
    def run_id_of(self, trial_id: str) -> str | None:
        return self.trial_runs.get(str(trial_id))
