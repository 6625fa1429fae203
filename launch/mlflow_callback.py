"""Ray Tune driver callback that tracks a study in MLflow through `dashboards.tracking.StudyTracker`.

One parent run per study, one child run per Tune trial id (found again by its `a2.trial_id` tag after a restore),
metrics at the result's `epoch` as step and with its own timestamp, so that logging a result twice leaves one
point. The hooks never wait on MLflow: each queues a record on a `dashboards.spool.TrackingQueue`, which spools
what a server that is down misses and replays it later.
"""
from __future__ import annotations

import functools
import json
import logging
import math
from typing import Callable

from ray.tune import Callback
from ray.tune.result import AUTO_RESULT_KEYS

from dashboards.spool import Spool, TrackingQueue, apply, outage_line
from dashboards.stats import TAG_CONFIG_HASH, stopped_early_tags
from dashboards.tracking import TAG_BEST_CKPT, StudyTracker, check_tracking_uri, client_settings, ui_pointer
from launch.search import group_key
from launch.trainable import CHECKPOINT_FILE

logger = logging.getLogger(__name__)

# Ray bookkeeping in every result: not metrics of the model.
_SKIP_KEYS = set(AUTO_RESULT_KEYS) | {
    "done", "trial_id", "experiment_id", "experiment_tag", "should_checkpoint", "timesteps_this_iter",
    "episodes_this_iter", "epoch", "samples", "checkpoint_path", "best_checkpoint", "best_checkpoint_path",
    "__duplicate__", "__trial_info__",
}


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


def _timestamp_ms(result: dict) -> int | None:
    """The result's own time (Tune's `timestamp`, seconds), so that the same result logged twice is one point."""
    ts = result.get("timestamp")
    return int(ts * 1000) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else None


def _error_line(trial) -> str:
    """The last line of a trial's error (its exception), for the run's `a2.end_reason` tag."""
    try:
        lines = str(trial.get_error() or "").strip().splitlines()
    except Exception:  # noqa: BLE001 - the error file may be gone with its node
        lines = []
    return (lines[-1][:500] if lines else "the trial failed") + " (`a2 study status NAME` shows the trial)"


class A2MLflowCallback(Callback):
    """Track a Tune study in MLflow. `resolve_config`: a trial's config -> the training config logged as params;
    `metric`/`mode` pick the best checkpoint (tag `a2.best_checkpoint`); `history_of(trial_id)`: the trial's result
    log, whose epochs MLflow lacks are logged once per trial and driver; `stopped_early_of(trial_id)`: the
    scheduler's record of stopping a trial; `spool_at`: the study's Location holding the spool (without one, the
    hooks apply their records themselves); `strict`: tracking trouble in a hook is raised, not logged;
    `searched_params`: the config keys the study searches (the axes of its parallel-coordinates chart in MLflow)."""

    def __init__(self, tracking_uri: str, study_name: str, *, experiment: str | None = None,
                 study_params: dict | None = None, study_tags: dict | None = None,
                 resolve_config: Callable[[dict], dict] | None = None, metric: str = "val/CIDEr",
                 mode: str = "max", strict: bool = False, history_of: Callable[[str], list[dict]] | None = None,
                 stopped_early_of: Callable[[str], dict | None] | None = None, spool_at=None,
                 searched_params: list[str] | tuple = ()):
        self.tracking_uri, self.study_name, self.experiment = tracking_uri, study_name, experiment
        self.study_params, self.study_tags = study_params or {}, study_tags or {}
        self.resolve_config, self.metric, self.mode, self.strict = resolve_config, metric, mode, strict
        self.history_of, self.stopped_early_of, self.spool_at = history_of, stopped_early_of, spool_at
        self.searched_params = tuple(searched_params)
        self.tracker: StudyTracker | None = None
        self.queue: TrackingQueue | None = None
        self.outage: dict | None = None  # the study's outage totals, once the experiment ended
        self.parent_run_id: str | None = None
        self.trial_runs: dict[str, str] = {}  # trial id -> run id, filled in by the tracker as it opens runs
        self.errored: set[str] = set()
        self.best: dict[str, tuple[float, int | None]] = {}  # trial id -> (best metric, its training_iteration)
        self.last_step: dict[str, int] = {}
        self.opened: set[str] = set()  # trials whose run this driver opened (or queued to open)
        self.backfilled: set[str] = set()  # trials whose missing epochs this driver has looked for
        self.completed: set[str] = set()  # trials that this driver saw complete

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

    def __getstate__(self):  # the Tuner pickles its callbacks
        return {**self.__dict__, "tracker": None, "queue": None, "trial_runs": dict(self.trial_runs),
                "backfilled": set(), "opened": set(), "completed": set()}  # a restored driver looks again

    # -- hooks -------------------------------------------------------------------------------------------------
    def setup(self, stop=None, num_samples=None, total_num_samples=None, **info):
        # Not guarded: a bad tracking URI must stop the study before any trial starts.
        check_tracking_uri(self.tracking_uri)
        client_settings()
        tracker = self._ensure_tracker()
        if self.spool_at is not None:
            self.queue = TrackingQueue(tracker, Spool(self.spool_at))
        print(f"MLflow: study {self.study_name!r} -> parent run {self.parent_run_id}; trials: "
              + ui_pointer(self.tracking_uri, tracker.experiment_id), flush=True)

    def _ensure_tracker(self) -> StudyTracker:
        if self.tracker is None:
            tracker = StudyTracker(self.tracking_uri, self.study_name, experiment=self.experiment)
            tracker.trial_runs = self.trial_runs  # one map: the saved state's runs, and those the tracker opens
            self.parent_run_id = tracker.start_study(self.study_params, self.study_tags)
            tracker.set_views(self.metric, self.mode, getattr(self, "searched_params", ()))  # older pickles lack it
            self.tracker = tracker
        return self.tracker

    def _emit(self, op: str, trial=None, **fields) -> None:
        """One tracking call: queued for the tracking thread (never waits on MLflow), else applied now."""
        record = {"op": op, **fields}
        if trial is not None:
            record["trial"] = str(trial.trial_id)
        if self.queue is not None:
            self.queue.put(record)
        else:
            apply(self._ensure_tracker(), record)

    @_guarded
    def on_trial_start(self, iteration, trials, trial, **info):
        config = dict(getattr(trial, "config", None) or {})
        self.opened.add(str(trial.trial_id))
        self._emit("trial", trial, config=self.resolve_config(config) if self.resolve_config else config,
                   tags={"a2.ray_trial_name": str(trial), TAG_CONFIG_HASH: group_key(config, self.resolve_config)},
                   run_name=str(trial))

    on_trial_restore = on_trial_start  # a restored trial continues its own run

    @_guarded
    def on_trial_result(self, iteration, trials, trial, result, **info):
        tid = str(trial.trial_id)
        step = self._step(tid, result)
        self._backfill(trial, before=step)
        self._emit("metrics", trial, step=step, ts=_timestamp_ms(result), metrics=self._metrics(result))

        value = result.get(self.metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
            old = self.best.get(tid)
            if old is None or (value > old[0] if self.mode == "max" else value < old[0]):
                self.best[tid] = (float(value), result.get("training_iteration"))
                self._log_per_image(trial, result)
        self._log_test_per_image(trial, result)

        samples = result.get("samples")
        if isinstance(samples, (list, tuple)) and samples and all(isinstance(s, str) for s in samples):
            self._emit("text", trial, text="\n".join(samples) + "\n", file=f"samples/epoch_{step:03d}.txt")

    def _log_per_image(self, trial, result: dict) -> None:
        """The best epoch's per-image CIDEr-D (`{image_id: score}`, x100), the artifact that the paired bootstrap
        of `a2 study compare` and the report read (`dashboards.compare.PER_IMAGE_ARTIFACT`)."""
        from a2core.train import PER_IMAGE_KEY
        from dashboards.compare import PER_IMAGE_ARTIFACT

        per_image = result.get(PER_IMAGE_KEY) or {}
        ids, scores = per_image.get("ids"), per_image.get("scores")
        if ids and scores and len(ids) == len(scores):
            text = json.dumps({str(i): float(v) for i, v in zip(ids, scores)}, sort_keys=True)
            self._emit("text", trial, text=text, file=PER_IMAGE_ARTIFACT)

    def _log_test_per_image(self, trial, result: dict) -> None:
        """The run's test-split per-image CIDEr-D of its selected checkpoint (its last result,
        `a2core.train.TEST_PER_IMAGE_KEY`), which verdicts rest on (`dashboards.compare.TEST_PER_IMAGE_ARTIFACT`)."""
        from a2core.train import TEST_PER_IMAGE_KEY
        from dashboards.compare import TEST_PER_IMAGE_ARTIFACT

        per_image = result.get(TEST_PER_IMAGE_KEY) or {}
        ids, scores = per_image.get("ids"), per_image.get("scores")
        if ids and scores and len(ids) == len(scores):
            text = json.dumps({str(i): float(v) for i, v in zip(ids, scores)}, sort_keys=True)
            self._emit("text", trial, text=text, file=TEST_PER_IMAGE_ARTIFACT)

    @staticmethod
    def _metrics(result: dict) -> dict:
        return {k: v for k, v in result.items() if k not in _SKIP_KEYS and not isinstance(v, dict)}

    def _backfill(self, trial, before: int | None = None) -> None:
        """Log the epochs (< `before`) of the trial's result log that its run lacks; once per trial and driver."""
        tid = str(trial.trial_id)
        if self.history_of is None or tid in self.backfilled:
            return
        self.backfilled.add(tid)
        entries = [{"step": int(r["epoch"]), "ts": _timestamp_ms(r), "metrics": self._metrics(r)}
                   for r in self.history_of(tid) or []
                   if isinstance(r.get("epoch"), (int, float)) and (before is None or int(r["epoch"]) < before)]
        if entries:
            self.last_step[tid] = max([e["step"] for e in entries] + [self.last_step.get(tid, 0)])
            self._emit("backfill", trial, metric=self.metric, entries=entries)

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
        last = getattr(trial, "last_result", None) or {}
        path = str(checkpoint.path)
        if last.get("checkpoint_path"):  # Tune's checkpoint points at the real one (launch.trainable): the weights
            path = f"{str(last['checkpoint_path']).rstrip('/')}/{CHECKPOINT_FILE}"
        kind = checkpoint.filesystem.type_name
        uri = path if kind == "local" or "://" in path else f"{kind}://{path}"
        tags = {"a2.checkpoint": uri}
        best = self.best.get(str(trial.trial_id))
        if best is not None and best[1] is not None and best[1] == last.get("training_iteration"):
            tags[TAG_BEST_CKPT] = uri
        self._emit("tags", trial, tags=tags)

    @_guarded
    def on_trial_recover(self, iteration, trials, trial, **info):
        # The trial will be retried: its run stays open and continues when it restarts.
        self._emit("tags", trial, tags={"a2.retries": str(getattr(trial, "num_failures", ""))})

    @_guarded
    def on_trial_complete(self, iteration, trials, trial, **info):
        self._backfill(trial)  # a trial restored after its last epoch reports nothing more
        self.completed.add(str(trial.trial_id))
        stop = self.stopped_early_of(str(trial.trial_id)) if self.stopped_early_of else None
        if stop:
            self._emit("tags", trial, tags=stopped_early_tags(stop["rung"], stop["cutoff"]))
        self._emit("end_trial", trial, status="FINISHED")

    @_guarded
    def on_trial_error(self, iteration, trials, trial, **info):
        # Called only when Tune gives up on the trial (retries go through on_trial_recover).
        self.errored.add(str(trial.trial_id))
        self._emit("end_trial", trial, status="FAILED", reason=_error_line(trial))

    @_guarded
    def on_experiment_end(self, trials, **info):
        # The runs' statuses follow the trials' as they are now (an earlier driver's errors resumed since count
        # no more): FINISHED only when every trial is, KILLED while some can still resume, FAILED if one failed.
        from launch import stop

        signal_number = stop.received()
        how = f"interrupted by {stop.signal_name(signal_number)}" if signal_number else "the study stopped"
        reason = f"{how}; continue with `a2 study resume {self.study_name}`"
        failed = unfinished = False
        for trial in trials or []:
            tid, status = str(trial.trial_id), getattr(trial, "status", None)
            if status == "ERROR":
                failed = True
            elif status != "TERMINATED" or (signal_number and tid in self.opened and tid not in self.completed):
                # (Tune's clean-up after a stop signal sets its running trials TERMINATED too)
                unfinished = True  # interrupted study: resumable, its open runs are marked KILLED for now
                if tid in self.trial_runs or tid in self.opened:
                    self._emit("end_trial", trial, status="KILLED", reason=reason)
        status = "FAILED" if failed else "KILLED" if unfinished else "FINISHED"
        self._emit("end_study", status=status,
                   reason=None if status == "FINISHED" else "a trial failed" if failed else reason)
        if self.queue is not None:
            self.outage = self.queue.close()  # shown by the live table's last report and in the summary
            self.queue = None

    def outage_text(self) -> str | None:
        """The live table's tracking line while the server is (or was) down, else None."""
        return outage_line(self.queue.status() if self.queue is not None else self.outage)
