"""The study driver: run or resume a study on Ray Tune as its one writer (`launch.lease`), show the live trial table,
stop cleanly on a storage problem or a signal, and at the end write `summary.json` from the study's record
(`launch.record`). MLflow is an export of this record (`launch.mlflow_export`); nothing here reads MLflow to learn
what happened."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import ray
from ray import tune
from ray.tune import Callback, ProgressReporter
from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback
from tqdm import tqdm
import yaml

from a2core.config import flatten
from a2core.errors import StorageError, StudyError, TrackingError
from launch.adaptive import RoundDecider, amend_summary, design_ended, study_rounds, write_rounds
from dashboards.tracking import check_tracking_uri, server_answers
from launch import runlog, stop
from dashboards.runs import Trial
from launch.conclusions import best_value, format_table, portable_summary, print_conclusions, tune_trial
from launch.datastore import check_feature_copies, java_warnings
from launch.fingerprint import recorded_fingerprint, refuse_changed_data, save_data_fingerprint
from launch.killpoints import arm_driver, kill_point
from launch.lease import DEFAULT_STALE_AFTER, StudyLease, held_lease, holder_started
from launch.location import (STUDY_FILE, SUMMARY_FILE, StudyLocation, load_saved_spec, remember, saved_form,
                             write_summary)
from launch.layout import (SUPERSEDED_FILE, TRIAL_FILE, TRIALS_DIR, add_outage, fused_seeds, seed_result_key,
                           seed_trials)
from launch.mlflow_callback import A2MLflowCallback
from launch.raycluster import autoscaler_limits, connect
from launch.progress import progress_line, study_progress
from launch.record import StudyRecord, table_row, tune_trials, with_under_way
from launch.spec import check_cluster, check_machine, runs_locally, schema_default
from launch.storage import check_storage, open_location
from launch.tracking_writer import StudyTracker
from launch.trainable import plan_from_spec, propagated_env, remove_temp_root
from launch.verify import (COPIES_DIR, WholeCopies, newest_experiment_state, problem, put_back_tune_pointers,
                           refuse_corrupt, refuse_unmendable, restore_whole_copies, root_files)

# The study file as `run` first wrote it, beside `study.yaml`: `resume` refuses a study.yaml edited since
# (`refuse_changed_spec`), because Tune resumes the experiment it started and would never apply the edit.
STARTED_SPEC_FILE = "study.started.yaml"


# -- run / resume ------------------------------------------------------------------------------------------------
def check_tracking(spec) -> None:
    """The study's MLflow store answers, and a SQLite one opens and can be written (`check_sqlite_store`): run,
    resume and sync check it before Ray starts, so a damaged or locked store is one line, not MLflow's traceback."""
    uri = spec.tracking.mlflow_uri
    try:
        check_tracking_uri(uri)
    except TrackingError as err:
        raise StudyError(f"tracking.mlflow_uri: {err}") from None
    check_sqlite_store(uri, spec.name)


def sqlite_path(uri: str) -> Path | None:
    """The file of a `sqlite:///relative.db` / `sqlite:////abs.db` tracking URI (None: not SQLite, or in memory)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def check_sqlite_store(uri: str, study: str, timeout: float = 5.0) -> None:
    """A SQLite MLflow store that exists must be a database (its schema reads) that this process may write (a write
    lock is taken and given back within `timeout` s): TrackingError naming the file and the cause otherwise. A store
    not there yet is fine (MLflow creates it)."""
    path = sqlite_path(uri)
    if path is None or not path.exists():
        return
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=rw", uri=True,
                                                timeout=timeout)) as db:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()  # a file that is no database fails here
            db.execute("BEGIN IMMEDIATE")  # the write lock MLflow needs; waits `timeout` s for another writer
            db.rollback()
    except sqlite3.Error as err:
        cause = str(err)
        if "locked" in cause or "busy" in cause:
            advice = (f"another process holds it (`fuser {path}` names it); wait for it to end, or point "
                      f"tracking.mlflow_uri elsewhere")
        elif "readonly" in cause or "read-only" in cause or "unable to open" in cause:
            advice = "the file or its folder cannot be written"
        else:
            advice = (f"the MLflow store is damaged: move it aside, and `a2 mlflow sync {study}` writes the study's "
                      f"runs again from its record")
        waited = f" after {timeout:.0f} s" if "locked" in cause else ""
        raise TrackingError(f"tracking.mlflow_uri: {path}: {cause}{waited}; {advice}") from None


def run_study(spec, **options) -> dict:
    """Run a validated study to its end on Ray (`_drive`'s options); returns the summary (also in summary.json)."""
    location = StudyLocation(spec.name, spec.storage, spec.storage_endpoint_url)
    check_storage(location.storage, location.endpoint_url)
    return _drive(spec, location, new=True, **options)


def resume_study(location: StudyLocation, *, restore_state: bool = False, **options) -> dict:
    """Continue a study: finished trials stay, unfinished and errored ones resume. Refused before anything is written:
    a corrupt state file (`launch.verify`: Tune would restart the experiment over it), a copy of the study, a changed
    spec, changed or unreadable data, and with `restore_state` a damaged file without a whole copy; after a torn
    first save is set aside, a corrupt file left is refused. `restore_state`: first put the whole copy back over each
    of Tune's files that is unreadable (a disk that filled during Tune's own copy of it)."""
    # Every refusal of the spec and the data comes before the first write (the copies --restore-state puts back, a
    # torn first save set aside): a refused resume leaves the study as it was.
    spec = load_saved_spec(location)
    torn = torn_first_save(location)
    if not (restore_state or torn):  # nothing to repair: a corrupt state file is named first, as status and check do
        refuse_corrupt(location.at(), "resume")
    refuse_relocated(spec, location)
    # the data moved (study.yaml edited to its new path) is left to the data check: the same data resumes
    started = recorded_fingerprint(location)
    refuse_changed_spec(spec, location, movable=tuple(started or ()))
    for line in refuse_changed_data(spec, location, started):  # the data it started with, or exit 2 naming the file
        print(f"study {spec.name}: {line}", flush=True)
    if restore_state and not torn:  # a damaged file without a whole copy: refused before any copy is put back
        refuse_unmendable(location.at(), "resume")
    if restore_state:
        for line in restore_whole_copies(location.at()):
            print(f"a2 study: {line}", flush=True)
    if torn:  # Tune's first save cut short by a kill: nothing of Tune's to continue, and no copy to put back
        set_aside(location, torn, options.get("stale_after", DEFAULT_STALE_AFTER), options.get("force", False))
        refuse_corrupt(location.at(), "resume")  # what setting aside could not mend
    done = finished_already(spec, location)
    if done is not None:  # nothing to run: no lease, no summary, no compute totals logged again
        return done
    return _drive(spec, location, new=False, **options)


def torn_first_save(location: StudyLocation) -> list:
    """Tune's files (`tuner.pkl`, its experiment, search generator and searcher states) that do not read, in a study
    none of whose experiment states was ever whole (none in `state-copies/`, which the driver fills every 2 s with
    whole copies): Tune's first save, cut short by a kill. Tune writes `tuner.pkl` in place and copies a save's files
    into the storage in place, several at once, so a kill during the first save can leave any of them empty. Nothing
    of Tune's can be continued then, and no copy put back; the trials' own folders can (`lost_trial_runs`)."""
    study = location.at()
    if newest_experiment_state(study.join(COPIES_DIR)) is not None:
        return []  # Tune's state was whole once: a damaged file is refused, its copy put back with --restore-state
    return [file for file, kind in root_files(study) if kind != "yaml" and problem(file, kind)]


def set_aside(location: StudyLocation, torn: list, stale_after: float, force: bool) -> None:
    """Move each of `torn` (`torn_first_save`) aside to `NAME.torn`, as the study's one writer, and say so in one
    line: the study then starts in place (`_drive`), as one whose driver was killed before Tune saved anything."""
    with StudyLease(location.at(), stale_after).held(force):
        for file in torn:
            location.at(file.uri.rsplit("/", 1)[-1] + ".torn").write_text(file.read_bytes())
            file.delete()
    names = ", ".join(file.uri.rsplit("/", 1)[-1] for file in torn)
    print(f"study {location.name}: Tune's first save was cut short when its driver stopped ({names} did not read; "
          f"moved aside to *.torn): its trials start in place", flush=True)


def refuse_changed_spec(spec, location: StudyLocation, movable: tuple[str, ...] = ()) -> None:
    """StudyError (before Ray, nothing written) when the study's `study.yaml` differs from the spec the study was
    started with (`STARTED_SPEC_FILE`), naming the first key that differs, in the file's order. Both are compared in
    their resolved form (`saved_form`), so only a change of what the study runs counts. A study started before the
    copy was kept has none: not checked. `movable`: keys left to another check (the data paths the study's data
    fingerprint holds: `refuse_changed_data` compares what is at the new path with what the study started with)."""
    text = location.read_text(STARTED_SPEC_FILE)
    if text is None:
        return
    try:
        started = flatten(yaml.safe_load(text) or {})
    except yaml.YAMLError as err:
        raise StudyError(f"{location.uri(STARTED_SPEC_FILE)}: not YAML ({str(err).splitlines()[0]}); restore it from "
                         f"a copy") from None
    now = flatten(yaml.safe_load(yaml.safe_dump(saved_form(spec), sort_keys=False)))
    missing = object()
    for key in [*started, *(k for k in now if k not in started)]:
        if key in movable and isinstance(started[key], str) and isinstance(now.get(key), str):
            continue  # a data path set then and now (one dropped or added is a change of what the study runs)
        before, after = started.get(key, missing), now.get(key, missing)
        if before is missing and after == schema_default(key, missing):  # a key added to a2core's schema since
            continue
        if before != after:
            shown = lambda v: "absent" if v is missing else json.dumps(v)  # noqa: E731
            raise StudyError(
                f"study {spec.name}: {location.uri(STUDY_FILE)} differs from the spec it was started with at "
                f"`{key}` ({shown(after)} now, {shown(before)} at the start): Tune resumes the trials it started "
                f"with, so the change would never apply; put {STUDY_FILE} back as it was "
                f"({location.uri(STARTED_SPEC_FILE)} holds it), or run the changed study under another name")


def finished_already(spec, location: StudyLocation) -> dict | None:
    """The summary of a study all of whose planned trials have finished and whose end was recorded (`summary.json`
    complete, nothing pending for MLflow): `resume` then says so in one line and writes nothing. None otherwise,
    also when the trials finished but a driver killed at the end did not write the summary or the export: the
    resume does that."""
    try:
        saved = json.loads(location.read_text(SUMMARY_FILE) or "null")
    except ValueError:
        return None
    if not (isinstance(saved, dict) and saved.get("complete") and not (saved.get("tracking") or {}).get("pending")):
        return None
    record = StudyRecord.load(location, spec)
    summary = amend_summary(spec, record.study(), record.summary())  # an adaptive study's design says when it ends
    if not summary["complete"]:
        return None
    print(f"study {spec.name}: all {summary['num_trials']} planned trials finished already; nothing to resume "
          f"(`a2 study status {spec.name}` shows them)", flush=True)
    return {**summary, "already_finished": True}


def refuse_relocated(spec, location: StudyLocation) -> None:
    """StudyError (exit 2, before Ray) when the study's storage is no longer where it was run (a copy, or moved).
    A resume restores Tune's saved experiment, which keeps the storage the study was run at (its trials' folders,
    checkpoints and result logs); its trials would write there, and the export into that study's MLflow runs. So a resumed copy
    would write into the original's storage and MLflow runs (or recreate a moved study's old folder): refused,
    naming both places and the MLflow store. Reading a copy (`status`, `check`, `compare`, `package`) is fine."""
    recorded = StudyLocation(spec.name, spec.storage, spec.storage_endpoint_url)
    if _same_storage(recorded.storage, location.storage):
        return
    try:
        there = "the original is still there" if recorded.exists(STUDY_FILE) else "nothing is there now"
    except Exception:  # noqa: BLE001 - another machine's path or a bucket out of reach: unknown
        there = "out of reach from here"
    raise StudyError(
        f"study {spec.name} at {location.uri()} was run at {recorded.uri()} ({there}) and logs to MLflow at "
        f"{spec.tracking.mlflow_uri}: its saved experiment would write its trials and result logs at "
        f"{recorded.uri()} and its epochs into the original's MLflow runs, so it resumes only there (move it back, "
        f"then `a2 study resume {spec.name} --storage {recorded.storage}`); to go on here, run the study again under "
        f"another name; status, check, compare and package read this copy as it is")


def _same_storage(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def check_local_machine(spec, address: str | None = None) -> None:
    """A study about to start a local Ray: its trial against this machine's CPUs and GPUs (`check_machine`). A process
    already connected to a Ray (a rehearsal's, whose logical CPUs and GPUs are the cluster's) is checked against that
    one instead, once connected (`check_cluster` in `_drive`)."""
    if runs_locally(spec, address) and not ray.is_initialized():
        check_machine(spec)


def _drive(spec, location: StudyLocation, *, new: bool, address: str | None = None, verbose: bool = True,
           force: bool = False, stale_after: float = DEFAULT_STALE_AFTER) -> dict:
    """Run a new study or resume one as the study's one writer, on the cluster at `address` (else $RAY_ADDRESS,
    else a local Ray), and summarize it."""
    check_local_machine(spec, address)  # before Ray starts and before the study's folder (its lease) exists
    check_tracking(spec)
    arm_driver()  # the kill-anywhere test's hook (`launch.killpoints`); nothing without A2_KILL_AT
    # files of a `run` whose driver was killed before it wrote study.yaml (its lease, data fingerprint, started spec)
    leftover = new and not location.exists(STUDY_FILE) and bool(location.at().listdir())
    # one writer per study; Ray's, Tune's and MLflow's INFO lines into the study's log file, not the terminal
    with StudyLease(location.at(), stale_after).held(force), \
            runlog.diverted(runlog.log_path(location.uri(), spec.name)) as log:
        started = restorable_tune_state(location)  # else the study starts in place (a killed driver's first save)
        if new and (started or location.exists(STUDY_FILE)):
            raise StudyError(f"study {spec.name!r} exists already at {location.uri()}: continue it with "
                             f"`a2 study resume {spec.name}`, or give the new study another name")
        if leftover:  # nothing of it to continue (`resume` says so): this run starts the study again in its folder
            print(f"study {spec.name}: starting again in place at {location.uri()}: an earlier driver stopped "
                  f"before writing {STUDY_FILE}, so nothing of it can be continued", flush=True)
        if not new and not started:  # killed before Tune saved anything: the study starts in place, from a2's record
            print(f"study {spec.name}: Tune saved no experiment state it restores before the study's driver stopped: "
                  f"its {spec.num_trials} trials start in place from the saved spec (same searcher seed, so the same "
                  f"configurations), each from the checkpoints an earlier trial of its configuration left, if any",
                  flush=True)
        if started and not new:  # the study's one writer now: Tune's pointers a killed driver deleted too early, put back
            for line in put_back_tune_pointers(location.at()):
                print(f"a2 study: {line}", flush=True)
        adoptable = () if new else lost_trial_runs(location, started)
        # a local Ray's dashboard only for Ray Train trials, which need its state API (`launch.raycluster.connect`)
        cluster = connect(address, runtime_env_vars=propagated_env(), dashboard=spec.has_train_driver)
        # a trial asking more than the whole cluster has, or its autoscaler can add: refused (ConfigError, exit 2);
        # a cluster joined, not a local Ray started here, may have an autoscaler (`ray up` left its config here)
        joined = bool(address or os.environ.get("RAY_ADDRESS"))
        for line in check_cluster(spec, cluster, can_add=autoscaler_limits() if joined else None):
            print(f"a2 study: {line}", flush=True)
        if spec.base["data"]["kind"] == "coco":  # every node's copy of the features is the driver's, or no start
            check_feature_copies(spec.base["data"]["features"])
        for line in java_warnings(spec.base["train"]):  # METEOR the study reports but a node cannot compute: said
            print(f"a2: warning: {line}", file=sys.stderr, flush=True)
        if new:
            text = yaml.safe_dump(saved_form(spec), sort_keys=False)
            save_data_fingerprint(spec, location)  # what `resume` checks its data against (`launch.fingerprint`)
            location.write_text(text, STARTED_SPEC_FILE)  # first: a study.yaml is never there without it
            location.write_text(text, STUDY_FILE)
        remember(location)  # `a2 study resume NAME` finds it by its name from now on, a driver killed next included
        if new:
            kill_point("study-file-written")
        temp = plan_from_spec(spec)
        remove_temp_root(temp)  # what trials of a killed driver left on this node
        try:
            # SIGINT and SIGTERM: a clean stop, `a2 study resume NAME` continues; whole copies of Tune's own files
            with stop.stop_on_signals(), WholeCopies(location.at()):
                tuner = build_tuner(spec, location, verbose=verbose, restore=started and not new,
                                    adoptable=adoptable)
                rounds = spec.replicate_rounds
                count = (f"up to {spec.num_trials} trials, seeds in rounds to {', '.join(map(str, rounds))}"
                         if rounds else f"{spec.num_trials} trials")
                if spec.confirm_seeds:
                    count += (f" ({spec.search_trials} of the search, then {len(spec.confirm_seeds)} confirmation "
                              f"seeds of each fusion's best configuration)")
                doing = "resuming from" if started and not new else f"{count}, results in"
                say(f"study {spec.name}: {doing} {location.uri()} (Ray and Tune log: {log})", verbose)
                summary = fit_and_finish(spec, location, tuner, verbose=verbose)
                kill_point("study-end")
                return summary
        finally:
            remove_temp_root(temp)


def restorable_tune_state(location: StudyLocation) -> bool:
    """Whether Tune saved a state that `Tuner.restore` continues: its newest experiment state and, of the same run
    (their names share its time stamp), the search generator's and the searcher's files, which Ray 2.60's
    `TuneController.resume` restores next. Not `Tuner.can_restore`: that is true once `tuner.pkl` exists, which Tune
    writes before any of them, and a restore without an experiment state fails ("no experiment state file ... was
    found"). Tune copies a save's files into the storage one by one, in no fixed order, so a driver killed during
    its first save can leave an experiment state without the searcher's files: Tune's restore then logs "Searcher
    unable to find checkpoint" with a traceback and starts its experiment afresh (or, without the generator's file,
    its searcher afresh). Such a study starts in place as one with no state does, its trials' folders adoptable."""
    state = newest_experiment_state(location.at())
    if state is None:
        return False
    stamp = state.uri.rsplit("/", 1)[-1][len("experiment_state-"):-len(".json")]
    return location.exists(f"search_gen_state-{stamp}.json") and location.exists(f"searcher-state-{stamp}.pkl")


def lost_trial_runs(location: StudyLocation, started: bool) -> tuple[str, ...]:
    """The run folders below `trials/` of trials that the study's saved Tune state does not know (all of them when
    Tune saved none it restores: `restorable_tune_state`), that recorded their configuration and were not continued
    already: a driver killed before Tune saved them. A resumed trial of the same configuration continues the newest
    of them (`launch.trainable.adopt`)."""
    known = {t.trial_id for t in tune_trials(location)} if started else set()
    prefix, trials = f"{location.name}-", location.at(TRIALS_DIR)
    return tuple(name for name in trials.listdir(folders_only=True)
                 if name.startswith(prefix) and name[len(prefix):] not in known
                 and trials.join(name, TRIAL_FILE).exists() and not trials.join(name, SUPERSEDED_FILE).exists())


def fit_and_finish(spec, location: StudyLocation, tuner, *, verbose: bool = True) -> dict:
    """Run the trials, then write and print the summary. Storage that cannot be written (full, read-only, over
    quota) or reached (S3 past its retries) stops the study cleanly: one line naming the path and the error, the
    trials as this driver last saw them, and how to continue."""
    grid = []  # Tune's results, when fit() got that far
    try:
        grid = tuner.fit()
        summary = finish(spec, location, verbose=verbose)
    except Exception as err:  # noqa: BLE001 - a storage problem stops the study cleanly; anything else is a bug
        lost = held_lease(location.uri())
        if lost is not None and lost.lost_error is not None:  # superseded (Tune wraps the guard's LeaseLost): not
            raise lost.lost_error from None  # one more write, not even a probe; one line, exit 2
        problem = storage_problem(location, err)
        if problem is None and not isinstance(err, (StorageError, OSError)):
            raise
        return _stopped_by_storage(spec, location, grid, problem or str(err).splitlines()[0][:300])
    problem = storage_problem(location) if any(t["state"] == "ERROR" for t in summary["trials"]) else None
    if problem is not None:  # trials failed writing their checkpoints or results
        return _stopped_by_storage(spec, location, grid, problem, summary)
    stopped_by = stop.received()
    if stopped_by is not None:
        print(f"study {spec.name} stopped by {stop.signal_name(stopped_by)}: finished trials stay, the others "
              f"resume from their last checkpoint; continue with `a2 study resume {spec.name}`", flush=True)
        summary["interrupted"] = stopped_by
    return summary


# errnos of storage that cannot take more: no space, over quota, read-only, not allowed
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
_STORAGE_TEXTS = ("No space left on device", "Disk quota exceeded", "Read-only file system", "Permission denied")


def storage_problem(location: StudyLocation, err: BaseException | None = None) -> str | None:
    """"PATH: [Errno 28] No space left on device" when the study's storage cannot be written, else None: from the
    error `err` (and its causes), a probe write into the study's folder (local storage), or the trials' errors."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in _STORAGE_ERRNOS:
            return f"{err.filename or location.uri()}: [Errno {err.errno}] {err.strerror}"
        err = err.__cause__ or err.__context__
    if "://" in location.storage:
        return None
    folder = Path(location.uri())
    try:  # as much as an epoch's result log or a small checkpoint part needs
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".a2-probe-") as probe:
            probe.write(b"\0" * (256 * 1024))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as probe_err:
        if probe_err.errno in _STORAGE_ERRNOS:
            return f"{folder}: [Errno {probe_err.errno}] {probe_err.strerror}"
    for error_file in folder.glob("*/error.txt"):  # Tune's record of a trial's last error
        try:
            text = error_file.read_text(errors="replace")
        except OSError:
            continue
        line = next((ln.strip() for ln in reversed(text.splitlines()) if any(t in ln for t in _STORAGE_TEXTS)), None)
        if line:
            return f"{folder}: {line[:300]}"
    return None


def _stopped_by_storage(spec, location: StudyLocation, grid, problem: str, summary: dict | None = None) -> dict:
    summary = summary or {}  # none: `finish` did not get that far, the rows come from Tune's result grid
    rows = [] if summary else [row for result in grid for row in _grid_rows(spec, result)]
    if rows:
        print(format_table(rows, spec))
    print(f"study {spec.name} stopped: its storage cannot be written or reached ({problem}); what was saved before "
          f"stays; once the storage is fixed, continue with `a2 study resume {spec.name}`", flush=True)
    return {**summary, "study": spec.name, "path": location.uri(), "storage_error": problem,
            "best": summary.get("best"), "trials": summary.get("trials") or [r.row(config=False) for r in rows]}


def say(text: str, verbose: bool = True) -> None:
    """A progress line, unless quiet; printed above a progress bar being drawn (packaging's decode bar), not into it."""
    if verbose:
        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()


def build_tuner(spec, location: StudyLocation, *, verbose: bool = True, restore: bool = False,
                adoptable: tuple[str, ...] = ()):
    """The study's Tuner, new or restored from storage (searcher, scheduler, callbacks) to resume unfinished and
    errored trials. `adoptable`: run folders of trials Tune lost, which trials of their configuration continue
    (`lost_trial_runs`)."""
    # Both looked up when called: benchmarks/bench_study.py and bench_scale.py replace them
    from launch.search import tune_config_kwargs
    from launch.trainable import make_trainable

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the older reporter prints our own table (_reporter)
    # The JSON and CSV result loggers are added below; TensorBoard's would only complain about the caption samples.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    # The experiment state is saved with every trial checkpoint on purpose (below): no warning each epoch.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    trainable = make_trainable(dataclasses.replace(plan_from_spec(spec), adoptable=tuple(adoptable)))
    if restore:
        path, fs = location.at().ray_storage()
        return tune.Tuner.restore(path, trainable=trainable, resume_unfinished=True, resume_errored=True,
                                  storage_filesystem=fs)
    tune_kwargs = tune_config_kwargs(spec)
    if spec.seed_rounds and hasattr(tune_kwargs["search_alg"], "set_round_decider"):
        # adaptive replicates or confirmation seeds: at each round's end the record decides which configurations get
        # more seeds (launch.adaptive)
        tune_kwargs["search_alg"].set_round_decider(RoundDecider(spec, location))
    stopped_early_of = getattr(tune_kwargs["scheduler"], "stopped_early", None)  # ReplicateASHA's record (FIFO: none)
    tracking = A2MLflowCallback(spec, location, stopped_early_of=stopped_early_of)
    storage_path, fs = open_location(location.storage, location.endpoint_url).ray_storage()  # the study's parent
    run_config = tune.RunConfig(
        name=spec.name,
        storage_path=storage_path,
        storage_filesystem=fs,
        failure_config=tune.FailureConfig(max_failures=int(spec.resources.max_failures)),
        # Trials' Tune checkpoints point at their Train checkpoints (launch.trainable): one small file an epoch,
        # all kept. Keeping only the newest, Tune deletes the one before right after saving it, and a driver killed
        # before Tune's next snapshot of the experiment leaves a state naming a deleted checkpoint, which no resume
        # restores (`launch.verify.put_back_tune_pointers` repairs such a study). Trials resume from their own
        # newest checkpoint and schedulers count epochs, so a snapshot older than the newest pointer loses nothing.
        checkpoint_config=tune.CheckpointConfig(num_to_keep=None),
        # result.json is what `status` and `summary` read
        callbacks=[LeaseGuard(location.uri()), JsonLoggerCallback(), CSVLoggerCallback(), tracking],
        progress_reporter=_reporter(spec, stopped_early_of, tracking.outage_text,
                                    under_way_of=functools.partial(with_under_way, spec, location,
                                                                   since=_lease_started(location)),
                                    design_ended_of=functools.partial(design_ended, location)),
        # 1, not 2: our table only; 2 adds Tune's "Trial ... reported ..." and "... completed. Last result: ..."
        # lines for every epoch of every trial (ray.tune.progress_reporter.TrialProgressCallback)
        verbose=1 if verbose else 0,
    )
    return tune.Tuner(trainable, param_space={}, tune_config=tune.TuneConfig(**tune_kwargs), run_config=run_config)


class LeaseGuard(Callback):
    """The study's first Tune callback: before Tune hands a result, a checkpoint or a trial's end to the result
    loggers and the MLflow export (the callbacks after it), and every few seconds between, the driver checks that it
    still holds the study's lease (`launch.lease.StudyLease.check`). One whose lease was taken over stops there:
    `LeaseLost` ends Tune's loop (its trials are stopped, the experiment state is not saved again) and the driver
    with one line. Only the study folder's URI is kept (the Tuner pickles its callbacks): the lease is the one this
    process holds for it, looked up when called."""

    CHECK_EVERY = 5.0  # seconds between looks while no result comes

    def __init__(self, study_uri: str):
        self.study_uri, self.last = study_uri, 0.0

    def _check(self, before: str, always: bool = True) -> None:
        lease = held_lease(self.study_uri)
        if lease is None or not (always or lease.lost.is_set() or time.monotonic() - self.last >= self.CHECK_EVERY):
            return
        self.last = time.monotonic()
        lease.check(before)

    def on_step_begin(self, iteration, trials, **info):
        self._check("Tune's next step", always=False)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._check(f"logging trial {trial.trial_id}'s result")

    def on_checkpoint(self, iteration, trials, trial, checkpoint, **info):
        self._check(f"recording trial {trial.trial_id}'s checkpoint")

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._check(f"recording the end of trial {trial.trial_id}")


def _lease_started(location) -> float | None:
    """When this driver took the study's lease: a trial's progress file older than that is a killed attempt's."""
    lease = held_lease(location.uri())
    return holder_started(lease.mine) if lease is not None else None


def _reporter(spec, stopped_early_of=None, tracking_line=lambda: None, under_way_of=lambda row: row,
              design_ended_of=lambda: False):
    class StudyTable(ProgressReporter):
        """The live trial table (`a2 study status`'s, from the running trials) every 30 s and at the end. (Tune's
        CLIReporter looks every parameter column up in the best trial's config, so a best trial without a
        conditional key, lambda of fusion none, would stop the study with a KeyError.)"""

        last = 0.0
        shown = ""

        def should_report(self, trials, done: bool = False) -> bool:
            return done or time.monotonic() - self.last >= 30

        def report(self, trials, done: bool, *sys_info) -> None:
            self.last = time.monotonic()
            rows = [under_way_of(row) for t in trials for row in live_rows(spec, t, stopped_early_of)]
            table = format_table(rows, spec)
            # how far along and when it ends, from the trials' cumulative wall time as their last results report it
            timed = [dataclasses.replace(row, compute={"wall_s": row.last_result.get("compute/wall_s") or 0.0})
                     for row in rows]
            # an adaptive design that has ended starts no more trials: they are no longer planned (as `status` says)
            ended = spec.replicate_rounds is not None and design_ended_of()
            table += "\n" + progress_line(study_progress(spec, timed, driven=True, design_ended=ended))
            line = tracking_line()  # e.g. "tracking: server down 31 s, 14 epochs exported once it was back"
            if line:
                table += "\n" + line
            # Tune reports the last state twice at the end (in another order): once is enough
            if sorted(table.splitlines()) == sorted(self.shown.splitlines()):
                return
            self.shown = table
            print(table, flush=True)

    return StudyTable()


# -- table rows: the record's trial, as far as Tune knows it ------------------------------------------------------
def live_rows(spec, trial, stopped_early_of=None) -> list[Trial]:
    """A running Tune trial's rows: its last result, the best so far from Tune's metric analysis, and the scheduler's
    record when it stopped the trial."""
    stopped = stopped_early_of(trial.trial_id) if stopped_early_of else None
    return _rows(spec, tune_trial(trial), lambda key: (trial.metric_analysis.get(key) or {}).get(spec.mode), stopped)


def _grid_rows(spec, result) -> list[Trial]:
    """A trial from Tune's result grid (what this driver last saw of it)."""
    history = result.metrics_dataframe
    metrics = result.metrics or {}
    trial = Trial(metrics.get("trial_id") or "?", state="ERROR" if result.error else "TERMINATED",
                  sampled=dict(result.config or {}), last_result=dict(metrics))
    return _rows(spec, trial, lambda key: best_value(history[key] if history is not None and key in history else [],
                                                     spec.mode))


def _rows(spec, trial: Trial, best_of, stopped=None) -> list[Trial]:
    """A Tune trial's table rows, one per seed of a fused trial (`seed_trials`); `best_of(key)`: the best value of a
    result key so far (a fused trial's seed's study metric is its `seed_result_key`)."""
    fused = fused_seeds(trial.sampled) is not None
    return [table_row(spec, row, row.last_result,
                      best_of(seed_result_key(row.sampled["seed"], spec.metric) if fused else spec.metric), stopped)
            for row in seed_trials(trial)]


# -- the end of a run -------------------------------------------------------------------------------------------
def finish(spec, location: StudyLocation, *, verbose: bool = True) -> dict:
    """Write `summary.json`, log the compute totals to the study's MLflow parent run and print the verdict."""
    record = StudyRecord.load(location, spec, for_digest=True)
    study = record.study()
    rounds = study_rounds(spec, study)  # adaptive replicates: the design's state (None for a fixed number of seeds)
    summary = amend_summary(spec, study, record.summary(), rounds)  # ... and its verdicts
    lease = held_lease(location.uri())
    if lease is not None:  # a driver whose lease was taken over writes no summary over its successor's
        lease.check("writing the study's summary")
    summary["tracking"] = add_outage(location)  # the MLflow outages of the study, if any
    write_summary(location, portable_summary(summary, location.uri()))  # its own files relative: a copy reads its own
    record.save_digest()  # what later reads take of each trial whose files stay as they are now
    _log_compute_totals(spec, summary["compute"])
    print_conclusions(spec, summary, record.trials if verbose else [])
    if rounds is not None:  # the round it ended with and each arm's state, for `status` and a resume
        write_rounds(location, rounds)
        print("\n".join(summary["adaptive"]["lines"]), flush=True)
    print(f"summary: {location.uri(SUMMARY_FILE)}", flush=True)
    if not summary["complete"] and stop.received() is None:  # a signal's stop says so itself (`fit_and_finish`)
        done, planned = summary["trials_finished"], summary["num_trials"]
        print(f"study {spec.name}: {done} of {planned} planned trials finished, {planned - done} missing; "
              f"`a2 study resume {spec.name}` runs them", flush=True)
    return summary


def _log_compute_totals(spec, totals: dict) -> None:
    """The compute totals as `compute/<key>` metrics of the study's MLflow parent run, when MLflow answers (a
    server still down at the end does not fail the study: `resume` or `a2 mlflow sync` exports it later)."""
    if not server_answers(spec.tracking.mlflow_uri):
        print("note: MLflow does not answer: the study's compute totals are in summary.json only", file=sys.stderr)
        return
    tracker = StudyTracker(spec.tracking.mlflow_uri, spec.name, spec.tracking.experiment)
    parent = tracker.find_parent_run()
    if parent is not None and totals:
        # every run/resume that ends the study logs its totals at the next step (a (key, step) is written once)
        logged = [s for key, steps in tracker.metric_steps(parent.info.run_id).items() if key.startswith("compute/")
                  for s in steps]
        tracker.log_metrics(parent.info.run_id, {f"compute/{k}": v for k, v in totals.items()},
                            step=max(logged, default=-1) + 1)


def exit_code(summary: dict) -> int:
    """0 when every trial finished (or was stopped early by the scheduler) and one reported the metric; 128 + the
    signal's number when a signal stopped the study."""
    if summary.get("interrupted"):
        return stop.exit_status(summary["interrupted"])  # 130 (SIGINT), 143 (SIGTERM)
    states = [t["state"] for t in summary.get("trials", [])]
    planned = summary.get("complete", True)  # every planned trial finished (`launch.driver.finish` says so if not)
    return 0 if states and planned and summary.get("best") is not None and all(s == "TERMINATED" for s in states) else 1
