"""MLflow as an export of a study's record: `Export` brings MLflow to match what the study's storage holds.

The record (`<study>/`): the spec (`study.yaml`), each trial's run folder (`launch.trainable`: `results.json`, every
epoch's result; `artifacts/`, its per-image scores and samples; `stopped_early.json`, the scheduler's decision) and
the trials' states in Tune's experiment state. Each trial is exported as the record holds it
(`launch.record.record_trial`: run status, config and replicate group, stop and end records, best checkpoint); the
export re-derives none of them. Its `a2.best_checkpoint` tag is the record's best checkpoint, the best epoch that
still has a stored checkpoint (what `a2 package` takes), not the best epoch's result's checkpoint path, which may
name one retention already pruned; `a2.checkpoint` is the newest checkpoint the result log names.

Exporting twice changes nothing: runs are found again by their tags, params are set once, a metric's (key, step) is
written only when the run lacks it (`StudyTracker.log_metrics`), tags and artifacts are set to what the record says.
So an export cut short, or one made while the server was down, is finished by the next one; nothing is kept anywhere
else in the meantime. An export reads only the trials that can have changed since the last one of the same `Export`
(`Export._settled`): with 1,000 trials on S3, reading every trial's folder every few seconds is thousands of requests.

During a study the driver's `StudyExporter` thread exports every few seconds (never from a Tune hook: training never
waits on MLflow) and once more at the end; `a2 mlflow sync NAME` exports a study after it. The totals of the time the
server was down (`<study>/tracking/outage.json`) go into the live table and `summary.json`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass

from a2core.config import get_dotted
from a2core.errors import A2Error, StorageError, TrackingError
from dashboards.mlflow_views import TAG_CONFIG_LABEL
from dashboards.runs import Trial
from dashboards.tracking import (TAG_BEST_CKPT, TAG_CONFIG_HASH, TAG_END_REASON, TAG_PARENT, TAG_ROLE, TAG_TRIAL_ID,
                                 disk_problem, redact_uri, search_all_runs, server_answers, unavailable_text)
from launch.conclusions import tune_trial, value_text
from launch.killpoints import kill_point
from launch.lease import held_lease
from launch.layout import (ARTIFACTS_DIR, CHECKPOINT_FILE, SUPERSEDED_FILE, TRIALS_DIR, add_outage, seed_trials,
                           train_run_name)
from launch.record import epoch_metrics, record_trials
from launch.spec import SEED_PATH, resolve_key
from launch.tracking_writer import TAG_STORAGE, StudyTracker

logger = logging.getLogger(__name__)

def end_reason(study: str, signal_name: str | None = None) -> str:
    """Why the runs of a study that ended part way are KILLED, and how to go on."""
    how = f"interrupted by {signal_name}" if signal_name else "the study stopped"
    return f"{how}; continue with `a2 study resume {study}`"


SUPERSEDED = ("superseded: the driver was killed before Tune saved this trial, and its configuration ran again "
              "under another trial id; its epochs are not in the study's record")


ENDED_STATUSES = ("FINISHED", "KILLED", "FAILED")


@dataclass(frozen=True)
class Exported:
    """What `Export` remembers of a trial it exported: Tune's word on it then (`tune`: state, retries, whether the
    study had ended), what it read (`seen`), the status its run was left in, and whether its run folder can still
    change while Tune's word stays the same (`settled` false)."""
    tune: tuple
    seen: tuple
    status: str | None
    settled: bool


class Export:
    """One study's export into one tracker; `run(trials, ended)` is the idempotent export. Each trial it exports is
    the record's (`launch.record.record_trial`: its status, config and replicate group, best checkpoint, stop and end
    records), with the result log of the same read; nothing is re-derived here. It remembers what it exported, so that
    exporting every few seconds reads and writes little: a trial whose run it left ended (FINISHED, KILLED, FAILED),
    or that had not started, is not read again while Tune's state, retries and the study's end stay as they were
    (its folder cannot change meanwhile); a trial read again whose record did not change is passed over."""

    def __init__(self, spec, location, tracker: StudyTracker | None = None):
        self.spec, self.location = spec, location
        self.tracker = tracker
        self.exported: dict[str, Exported] = {}  # trial id -> its last export
        self.uploaded: dict[tuple[str, str], str] = {}  # (run id, artifact path) -> text uploaded
        self.late = 0  # epochs written after the server had been down
        self.superseded: list[str] = []  # trial ids whose runs this export ended as superseded (`_end_superseded`)
        self.reread = False  # read every trial at every export (`benchmarks/bench_export.py`'s "before")
        self.writing = ""  # what the export was writing last, in words: where a refusal came (`StudyExporter`)

    def open(self) -> StudyTracker:
        """The study's tracker, its parent run made or found (and RUNNING) and the study's views saved."""
        if self.tracker is None:
            self.writing = "opening the study's experiment and parent run"
            spec = self.spec
            tracker = StudyTracker(spec.tracking.mlflow_uri, spec.name, experiment=spec.tracking.experiment)
            raw = spec.to_dict()
            params = {"search": raw.get("search", {}), "resources": raw.get("resources", {}),
                      "storage": raw.get("storage"), "base": {k: raw.get(k) for k in ("data", "model", "train")}}
            tracker.start_study(params, {TAG_STORAGE: self.location.uri()})
            tracker.set_views(spec.metric, spec.mode, [p.path for p in spec.params.values()])
            self.tracker = tracker
        return self.tracker

    def run(self, trials: list[Trial], ended: str | None = None, late: bool = False) -> None:
        """Bring MLflow to match the record. `ended`: None while the study runs, else the reason its unfinished runs
        end KILLED (`end_reason`); `late`: the server was down since the last export (its epochs are counted).
        The study's experiment or a run of it deleted on the server meanwhile (someone cleaning up in the MLflow
        UI) is restored (`StudyTracker.restore_deleted`), said in one warning, and the export made again; one gone
        for good is made again by a new tracker, every trial exported anew. A write to a deleted run fails, which
        tells; the study's last export also looks (a settled trial's run is not written to again)."""
        from mlflow.exceptions import MlflowException  # mlflow: on first use, as in `launch.tracking_writer`

        if ended is not None:
            with contextlib.suppress(MlflowException):  # a server that fails here fails the export below, which says
                self._restore_deleted()
        late_before = self.late
        try:
            self._run(trials, ended, late)
        except MlflowException as err:
            # what a write to a deleted run or experiment answers; a server that does not answer (INTERNAL_ERROR,
            # after MLflow's retries) is not asked again here: the caller's outage handling takes it
            if err.error_code not in _DELETED_CODES:
                raise
            try:
                restored = self._restore_deleted()
            except MlflowException:
                restored = False
            if not restored:
                raise err from None
            self.late = late_before  # the epochs the failed try counted are counted again
            self._run(trials, ended, late)

    def _restore_deleted(self) -> bool:
        """Restore what of the study was deleted on the server (`StudyTracker.restore_deleted`), said in one warning;
        the next export reads and exports every trial again. False: nothing was deleted."""
        said, intact = self.tracker.restore_deleted() if self.tracker is not None else ([], True)
        if not said:
            return False
        logger.warning("MLflow export: %s; exporting again", "; ".join(said))
        if not intact:  # gone for good: a new tracker finds or makes the study's runs again
            self.tracker = None
            self.uploaded.clear()
        self.exported.clear()  # every trial read and exported again: what its run lacks is written
        return True

    def _run(self, trials: list[Trial], ended: str | None, late: bool) -> None:
        tracker = self.open()
        changing = [t for t in trials if self.reread or not self._settled(t, ended is not None)]
        read = dict(zip((t.trial_id for t in changing),
                        record_trials(self.spec, self.location, changing, ended=ended is not None)))
        failed = unfinished = False
        for trial in trials:
            status = (self._trial(tracker, trial, *read[trial.trial_id], ended, late) if trial.trial_id in read
                      else self.exported[trial.trial_id].status)
            if ended is not None:
                kill_point("export-final")  # the kill-anywhere test's hook (`launch.killpoints`)
            # a trial that ended itself (diverged) is FAILED with its reason, but done: the study is not failed
            done_for_a_reason = status == "FAILED" and trial.state != "ERROR"
            failed |= status == "FAILED" and not done_for_a_reason
            unfinished |= status != "FINISHED" and not done_for_a_reason
        if ended is not None:
            self.writing = "ending the study's runs"
            self._end_superseded(tracker, {t.trial_id for t in trials})
            unfinished |= len(trials) < self.spec.num_trials
            status = "FAILED" if failed else "KILLED" if unfinished else "FINISHED"
            tracker.end_study(status, None if status == "FINISHED" else "a trial failed" if failed else ended)

    def _settled(self, trial: Trial, study_ended: bool) -> bool:
        """Whether the trial's last export still holds without reading its folder: Tune's word on it is unchanged
        and its run was left ended or it had not started (nothing writes to the folder of such a trial)."""
        last = self.exported.get(trial.trial_id)
        return last is not None and last.settled and last.tune == (trial.state, trial.retries, study_ended)

    def _end_superseded(self, tracker: StudyTracker, known: set[str]) -> None:
        """End KILLED, tagged `a2.end_reason=superseded: ...`, the study's trial runs still RUNNING whose trial Tune
        no longer knows: a driver killed before Tune saved its experiment state ran their configurations again under
        new trial ids, and nothing will ever end the old runs (the study's end and `a2 mlflow sync` call this)."""
        for run in search_all_runs(tracker.client, [tracker.experiment_id],
                               f"tags.`{TAG_PARENT}` = '{tracker.parent_run_id}' and tags.`{TAG_ROLE}` = 'trial'"):
            tid = run.data.tags.get(TAG_TRIAL_ID)
            if tid not in known and run.info.status in ("RUNNING", "SCHEDULED"):
                tracker.end_trial(run.info.run_id, "KILLED", self._superseded_reason(tid))
                self.superseded.append(tid)

    def _superseded_reason(self, trial_id: str | None) -> str:
        """`SUPERSEDED`, or, when a later trial continued this one's checkpoints (`launch.trainable.adopt` marked
        its folder), which trial and from which epoch."""
        folder = self.location.at(TRIALS_DIR, train_run_name(self.spec.name, str(trial_id)))
        try:
            mark = json.loads(folder.join(SUPERSEDED_FILE).read_text() or "null")
        except (ValueError, StorageError):
            mark = None
        if not isinstance(mark, dict) or not mark.get("by"):
            return SUPERSEDED
        return (f"superseded: the driver was killed before Tune saved this trial; trial {mark['by']} (same "
                f"configuration) continued it from its checkpoint of epoch {mark.get('epoch')}, and holds its epochs "
                f"in the study's record")

    def _trial(self, tracker: StudyTracker, tune: Trial, trial: Trial, results: list[dict], ended: str | None,
               late: bool) -> str | None:
        """Export one trial, `trial` the record's (`record_trial`) of Tune's `tune`, `results` its result log; returns
        the status its run has now (None: not started, no run)."""
        tid = trial.trial_id
        seen = (trial.state, trial.retries, trial.name, json.dumps(results, sort_keys=True, default=str), trial.status,
                trial.best_checkpoint,
                json.dumps(trial.stopped_early, default=str), json.dumps(trial.ended, default=str), trial.error,
                ended, late)
        last = self.exported.get(tid)
        if last is not None and last.seen == seen:
            return self._remember(tune, trial, seen, last.status, ended)
        if not results and trial.state == "PENDING":
            return self._remember(tune, trial, seen, None, ended)
        status = trial.status
        name, label = trial_names(self.spec, dict(trial.sampled), trial.config_hash)
        self.writing = f"trial {tid}, run {name!r}"
        run_id = tracker.trial_run(tid, trial.config, running=status == "RUNNING",
                                   tags={"a2.ray_trial_name": trial.name, TAG_CONFIG_HASH: trial.config_hash,
                                         TAG_CONFIG_LABEL: label},
                                   run_name=name)
        logged = tracker.logged_steps(run_id, self.spec.metric)
        epochs = [int(result["epoch"]) for result in results]
        if epochs:  # the first epoch MLflow lacks (the newest when it has all): where a refused write began
            self.writing += f", epoch {min(set(epochs) - logged, default=epochs[-1])}"
        self.late += sum(late and int(result["epoch"]) not in logged for result in results)
        tracker.log_epochs(run_id, [(int(result["epoch"]), epoch_metrics(result), _timestamp_ms(result))
                                    for result in results])
        tracker.set_tags(run_id, self._tags(trial, results))
        self._artifacts(tracker, run_id, self.location.at(TRIALS_DIR, train_run_name(self.spec.name, tid),
                                                          ARTIFACTS_DIR))
        if status != "RUNNING":
            # `a2.end_reason`: `diverged` (its end record), the error, or why the study stopped
            reason = (trial.ended["reason"] if status == "FAILED" and trial.ended is not None
                      and trial.state != "ERROR" else
                      f"{trial.error or 'the trial failed'} (`a2 study status NAME` shows the trial)"
                      if status == "FAILED" else ended if status == "KILLED" else None)
            tracker.end_trial(run_id, status, reason)
        return self._remember(tune, trial, seen, status, ended)

    def _remember(self, tune: Trial, trial: Trial, seen: tuple, status: str | None, ended: str | None) -> str | None:
        # A run ended is settled, but for one the scheduler stopped whose stop record the driver has yet to write
        # (Tune ends the trial, then the callback writes the record): read again until it is there or the study ends.
        awaiting_stop_record = ended is None and (trial.stopped_early or {}).get("rung", 0) is None
        settled = status is None or (status in ENDED_STATUSES and not awaiting_stop_record)
        self.exported[trial.trial_id] = Exported((tune.state, tune.retries, ended is not None), seen, status, settled)
        return status

    def _tags(self, trial: Trial, results: list[dict]) -> dict:
        """The checkpoint tags (the newest one from the result log; the record's best checkpoint, the best epoch that
        still has one), retries, the stop record (the record's trial's own tags, its end reason left to `end_trial`)."""
        tags = {}
        for result in results:  # epoch order: the newest checkpoint is the last one named
            if result.get("checkpoint_path"):
                tags["a2.checkpoint"] = self._checkpoint_uri(result["checkpoint_path"])
        if trial.best_checkpoint:
            tags[TAG_BEST_CKPT] = trial.best_checkpoint
        if trial.retries:
            tags["a2.retries"] = str(trial.retries)
        tags.update({key: value for key, value in trial.tags.items() if key != TAG_END_REASON})
        return tags

    def _checkpoint_uri(self, folder: str) -> str:
        """The weights file of a result's checkpoint folder (a Ray Train trial's is a path on the storage's
        filesystem: on S3 without its scheme)."""
        path = f"{str(folder).rstrip('/')}/{CHECKPOINT_FILE}"
        return f"s3://{path}" if "://" not in path and self.location.storage.startswith("s3://") else path

    def _artifacts(self, tracker: StudyTracker, run_id: str, folder, prefix: str = "") -> None:
        """Upload the files below the trial's `artifacts/` that the run lacks or holds in another version."""
        folders = set(folder.listdir(folders_only=True))
        for name in folder.listdir():
            if name.startswith("."):  # a file being written (`a2core.atomic.atomic_write`'s temp file)
                continue
            path = f"{prefix}{name}"
            if name in folders:
                self._artifacts(tracker, run_id, folder.join(name), f"{path}/")
                continue
            text = folder.join(name).read_text()
            if text is not None and self.uploaded.get((run_id, path)) != text:
                tracker.client.log_text(run_id, text, path)
                self.uploaded[(run_id, path)] = text


# MLflow's error codes for a write to a deleted run (not 'active') or to a run or experiment no longer there
_DELETED_CODES = frozenset({"INVALID_PARAMETER_VALUE", "INVALID_STATE", "RESOURCE_DOES_NOT_EXIST"})


def _timestamp_ms(result: dict) -> int | None:
    """A result's `timestamp` (s) in ms as MLflow takes it (a non-negative 64-bit integer); None (MLflow: now) when
    it has none MLflow can hold: absent, not a number (a bool), NaN, infinite, negative or past int64."""
    value = result.get("timestamp")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    ms = int(value * 1000)
    return ms if 0 <= ms < 2 ** 63 else None


class StudyExporter:
    """The driver's export thread: `Export.run` from `trials()` (the live Tune trials) when `poke`d (a trial
    reported, started or ended: the hook only sets a flag) and every `every` s, while the server answers (probed
    first, 2 s); `close(ended)` stops it, exports once more and saves the outage."""

    def __init__(self, export: Export, trials, every: float = 2.0):
        self.export, self.trials, self.every = export, trials, every
        self.uri = export.spec.tracking.mlflow_uri
        self.down_since: float | None = None
        self.down_seconds = 0.0
        self.done = False  # the last export went through
        self.refused: str | None = None  # why MLflow refused the study's export (no outage): it stopped
        self.refusal: str | None = None  # the first refusal (`refusal`) and where it came: for `tracking/outage.json`
        self.said: str | None = None  # the last refusal of one request said in the log (said again only when it changes)
        self.stop, self.wake = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._work, name="a2-mlflow-export", daemon=True)
        self.thread.start()

    def poke(self) -> None:
        """Export soon (the thread wakes up); returns at once."""
        self.wake.set()

    def _work(self) -> None:
        while True:
            self.wake.wait(self.every)
            self.wake.clear()
            if self.stop.is_set():
                return
            self.once()

    def once(self, ended: str | None = None) -> bool:
        """One export; False (and the outage clock running) when the server does not answer; False, and the study's
        export stopped (`refused`, said once), when it answers with a refusal (`TrackingError`: no outage)."""
        if self.refused is not None:  # refused: nothing changes that but a person (`a2 mlflow sync` later)
            return False
        late = self.down_since is not None
        lease = held_lease(self.export.location.uri())
        if lease is not None and not lease.holds("exporting to MLflow"):  # superseded: the study's MLflow runs are its new writer's
            return False
        try:
            if not server_answers(self.uri):
                raise ConnectionError(f"MLflow server {redact_uri(self.uri)} does not answer")
            self.export.run([s for t in list(self.trials()) for s in seed_trials(tune_trial(t))], ended, late=late)
        except StorageError as err:  # the study's storage, not the server: the study itself stops on it
            logger.warning("MLflow export could not read the study's record: %s", err)
        except OSError as err:
            self._down(err)
        except TrackingError as err:  # the server answered, and refused the study's experiment: not an outage
            self.refuse(err)
        except Exception as err:  # noqa: BLE001 - the server's or the connection's: an outage, if it is gone
            if server_answers(self.uri) and disk_problem(err) is None:
                why = refusal(self.uri, err)
                self._note(why)
                if why is None:  # neither an outage nor a refusal: a bug, with its traceback
                    logger.warning("MLflow export failed: %s", err, exc_info=True)
                elif why != self.said:  # the server's own words, once (the export tries again every few seconds)
                    self.said = why
                    logger.warning("MLflow refused part of study %r's export (%s): %s; a2 tries again at each export",
                                   self.export.spec.name, self.export.writing or "exporting", why)
            else:
                self._down(err)
        else:
            if late:
                self.down_seconds += time.monotonic() - self.down_since
                self.down_since = None
                logger.warning("MLflow server back; %d epochs exported", self.export.late)
            self.done = True
            return True
        self.done = False
        return False

    def refuse(self, err: Exception) -> None:
        """MLflow refused the study's export (`err`: a `TrackingError`, or a refusal, see `refusal`): said once, the
        thread ends, nothing is tried again; the study goes on."""
        self.refused = refusal(self.uri, err) or str(err)
        self._note(self.refused)
        self.stop.set()
        self.wake.set()
        logger.warning("MLflow refused the export of study %r: %s", self.export.spec.name,
                       refused_text(self.export.spec.name, self.refused))

    def _note(self, why: str | None) -> None:
        if why is not None and self.refusal is None:  # the first: later ones are often its consequences
            self.refusal = f"{why} ({self.export.writing or 'exporting'})"

    def _down(self, err) -> None:
        if self.down_since is None:
            logger.warning("%s", unavailable_text(self.uri, err))  # a full artifact disk named as such
            self.down_since = time.monotonic()

    def status(self) -> dict:
        down = self.down_seconds + (time.monotonic() - self.down_since if self.down_since is not None else 0.0)
        refused = {"refused": self.refused} if self.refused is not None else {}
        return {"down_seconds": round(down, 3), "exported_late": self.export.late,
                "pending": self.down_since is not None, **refused}

    def close(self, ended: str | None) -> dict:
        """Stop the thread, export once more (`ended`: see `Export.run`) and add this driver's outage to the
        study's totals, which it returns."""
        self.stop.set()
        self.wake.set()
        self.thread.join(120)
        self.once(ended)
        if self.down_since is not None:
            self.down_seconds += time.monotonic() - self.down_since
        totals = add_outage(self.export.location, down_seconds=self.down_seconds, exported_late=self.export.late,
                            pending=not self.done, refused=None if self.done else self.refusal)
        return {**totals, "refused": self.refused} if self.refused is not None else totals


REFUSAL_CHARS = 300  # of MLflow's words in a refusal: a refused batch's message can quote the whole batch
_REFUSED_STATUSES = frozenset({400, 401, 403, 404, 409})  # 429 (too many requests) is waited out, not a refusal


def refusal(uri: str, err: Exception) -> str | None:
    """Why the server at `uri` refused a request, in one line (MLflow's error code and its words cut short; a2's own
    `TrackingError`, which says what to do, whole), when `err` is a refusal: the server answered that it will not;
    None for anything else (the server down, a bug)."""
    from mlflow.exceptions import MlflowException  # mlflow: on first use, as in `launch.tracking_writer`

    if isinstance(err, TrackingError):
        return str(err)
    if not isinstance(err, MlflowException) or err.get_http_status_code() not in _REFUSED_STATUSES:
        return None
    words = " ".join(str(err.message).split())
    if not words.startswith(f"{err.error_code}:"):
        words = f"{err.error_code}: {words}"
    if len(words) > REFUSAL_CHARS:
        words = words[:REFUSAL_CHARS - 1] + "…"
    return f"MLflow server {redact_uri(uri)} answered {words}"


def refused_text(study: str, why: str) -> str:
    """Why MLflow refused a study's export (`why`, its own words), and that the study goes on without it."""
    return (f"{why}; the study goes on and its record is whole (`a2 mlflow sync {study}` exports it once that is "
            f"settled)")


# -- names a person reads in the MLflow UI -------------------------------------------------------------------------
def trial_names(spec, sampled: dict, digest: str) -> tuple[str, str]:
    """(run name, configuration label) of a trial from the keys its study searches, as they apply to it:
    ("gate lambda=0.035 seed=2", "gate lambda=0.035 (cca42317e0f5)"). The fusion is shown by its value alone, any
    other key as `name=value` (the last part of its path, numbers to 4 significant digits); a key whose value does
    not apply to the trial (lambda of fusion none) is absent; the seed (a seed key or `search.replicates`) ends the
    run name and is not in the label, which names the replicate group and has its `a2.config_hash` beside it."""
    try:
        config = spec.trial_config(sampled)
    except A2Error:  # a trial of keys the saved spec no longer has (the record reads it): named by its digest
        config = {}
    parts, seed = [], None
    for key in dict.fromkeys([*spec.params, *sampled]):  # the space's order; then a replicate's seed
        path = resolve_key(key)
        if path is None:
            continue
        value = get_dotted(config, path)
        if value is None:  # not applicable to this trial
            continue
        if path == SEED_PATH:
            seed = value
        elif path == "model.fusion":
            parts.append(str(value))
        else:
            parts.append(f"{path.rsplit('.', 1)[-1]}={value_text(value)}")
    label = " ".join(parts)
    name = " ".join(parts + ([f"seed={seed}"] if seed is not None else [])) or f"config {digest[:12]}"
    return name, f"{label} ({digest[:12]})" if label else f"config {digest[:12]}"
