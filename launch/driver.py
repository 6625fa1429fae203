"""The study driver: run or resume a study on Ray Tune as its one writer (`launch.lease`), show the live trial table,
stop cleanly on a storage problem or a signal, and read the study back from its storage into trial rows, compute
totals, replicate groups and `summary.json`. MLflow is an export of this record (`launch.mlflow_export`); nothing here
reads MLflow to learn what happened."""
from __future__ import annotations

import errno
import logging
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import yaml

from a2core.errors import A2Error, StorageError, StudyError, TrackingError
from dashboards.tables import finite
from dashboards.tracking import StudyTracker, check_tracking_uri
from launch import stop
from launch.conclusions import format_table, pick_best, print_conclusions
from launch.datastore import check_feature_copies
from launch.lease import DEFAULT_STALE_AFTER, StudyLease
from launch.location import (STUDY_FILE, SUMMARY_FILE, StudyLocation, load_saved_spec, remember, saved_form,
                             write_summary)
from launch.mlflow_export import TrialState, add_outage, stop_record
from launch.raycluster import connect
from launch.spec import check_cluster
from launch.trainable import (CHECKPOINT_FILE, TRIALS_DIR, checkpoint_epochs, checkpoint_name,
                              plan_from_spec, propagated_env, read_results, remove_temp_root, train_run_name)
from launch.verify import quick_checkpoint_problem, refuse_corrupt

COMPUTE_UNITS = ("wall_s", "cpu_s", "gpu_s")  # launch.trainable logs each as `compute/<unit>`, cumulative


# -- run / resume ------------------------------------------------------------------------------------------------
def check_tracking(spec) -> None:
    try:
        check_tracking_uri(spec.tracking.mlflow_uri)
    except TrackingError as err:
        raise StudyError(f"tracking.mlflow_uri: {err}") from None


def run_study(spec, **options) -> dict:
    """Run a validated study to its end on Ray (`_drive`'s options); returns the summary (also in summary.json)."""
    from launch.storage import check_storage  # pyarrow: only when a study is opened

    location = StudyLocation(spec.name, spec.storage, spec.storage_endpoint_url)
    check_storage(location.storage, location.endpoint_url)
    return _drive(spec, location, new=True, **options)


def resume_study(location: StudyLocation, **options) -> dict:
    """Continue a study: finished trials stay, unfinished and errored ones resume. A corrupt state file is refused
    first (`launch.verify`): Tune would restart the experiment over it."""
    refuse_corrupt(location.at(), "resume")
    spec = load_saved_spec(location)
    refuse_relocated(spec, location)
    return _drive(spec, location, new=False, **options)


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


def _drive(spec, location: StudyLocation, *, new: bool, address: str | None = None, verbose: bool = True,
           force: bool = False, stale_after: float = DEFAULT_STALE_AFTER) -> dict:
    """Run a new study or resume one as the study's one writer, on the cluster at `address` (else $RAY_ADDRESS,
    else a local Ray), and summarize it."""
    from ray.tune import Tuner  # ray: only when a study runs

    check_tracking(spec)
    with StudyLease(location.at(), stale_after).held(force):  # one writer per study
        path, fs = location.at().ray_storage()
        started = Tuner.can_restore(path, storage_filesystem=fs)
        if new and (started or location.exists(STUDY_FILE)):
            raise StudyError(f"study {spec.name!r} exists already at {location.uri()}: continue it with "
                             f"`a2 study resume {spec.name}`, or give the new study another name")
        if not new and not started:
            raise StudyError(f"study {location.name!r} at {location.uri()} has no Tune experiment state to resume "
                             f"(it was stopped before its first trial started); run it again")
        cluster = connect(address, runtime_env_vars=propagated_env())
        check_cluster(spec, cluster)  # a trial asking more than the whole cluster has: refused (ConfigError, exit 2)
        if spec.base["data"]["kind"] == "coco":  # every node's copy of the features is the driver's, or no start
            check_feature_copies(spec.base["data"]["features"])
        if new:
            location.write_text(yaml.safe_dump(saved_form(spec), sort_keys=False), STUDY_FILE)
        remember(location)
        temp = plan_from_spec(spec)
        remove_temp_root(temp)  # what trials of a killed driver left on this node
        try:
            with stop.stop_on_signals():  # SIGINT and SIGTERM: a clean stop, `a2 study resume NAME` continues
                tuner = build_tuner(spec, location, verbose=verbose, restore=not new)
                doing = f"{spec.num_trials} trials, results in" if new else "resuming from"
                say(f"study {spec.name}: {doing} {location.uri()}", verbose)
                return fit_and_finish(spec, location, tuner, verbose=verbose)
        finally:
            remove_temp_root(temp)


def tune_trials(location: StudyLocation) -> list[TrialState]:
    """The trials of the study's Tune experiment state in storage (no Ray needed)."""
    # ray.tune is heavy: only the paths that read Tune's state import it
    from ray.tune import ExperimentAnalysis

    path, fs = location.at().ray_storage()
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    return [TrialState.of(trial) for trial in ExperimentAnalysis(path, storage_filesystem=fs).trials]


def fit_and_finish(spec, location: StudyLocation, tuner, *, verbose: bool = True) -> dict:
    """Run the trials, then write and print the summary. Storage that cannot be written (full, read-only, over
    quota) or reached (S3 past its retries) stops the study cleanly: one line naming the path and the error, the
    trials as this driver last saw them, and how to continue."""
    grid = []  # Tune's results, when fit() got that far
    try:
        grid = tuner.fit()
        summary = finish(spec, location, verbose=verbose)
    except Exception as err:  # noqa: BLE001 - a storage problem stops the study cleanly; anything else is a bug
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
    rows = [_grid_row(spec, result) for result in grid] if summary is None else []
    if rows:
        print(format_table(rows, spec.metric))
    print(f"study {spec.name} stopped: its storage cannot be written or reached ({problem}); what was saved before "
          f"stays; once the storage is fixed, continue with `a2 study resume {spec.name}`", flush=True)
    return {**(summary or {}), "study": spec.name, "path": location.uri(), "storage_error": problem,
            "best": None if summary is None else summary.get("best"),
            "trials": (summary or {}).get("trials") or [{k: v for k, v in r.items() if k != "config"} for r in rows]}


def say(text: str, verbose: bool = True) -> None:
    """A progress line, unless quiet."""
    if verbose:
        print(text, flush=True)


def build_tuner(spec, location: StudyLocation, *, verbose: bool = True, restore: bool = False):
    """The study's Tuner, new or restored from storage (searcher, scheduler, callbacks) to resume unfinished and
    errored trials."""
    # ray (and optuna, through launch.search): only when a study runs
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    from launch.storage import open_location
    from launch.mlflow_callback import A2MLflowCallback
    from launch.search import tune_config_kwargs
    from launch.trainable import make_trainable  # looked up when called (benchmarks/bench_study.py replaces it)

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the older reporter prints our own table (_reporter)
    # The JSON and CSV result loggers are added below; TensorBoard's would only complain about the caption samples.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    # The experiment state is saved with every trial checkpoint on purpose (below): no warning each epoch.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    trainable = make_trainable(plan_from_spec(spec))
    if restore:
        path, fs = location.at().ray_storage()
        return tune.Tuner.restore(path, trainable=trainable, resume_unfinished=True, resume_errored=True,
                                  storage_filesystem=fs)
    tune_kwargs = tune_config_kwargs(spec)
    stopped_early_of = getattr(tune_kwargs["scheduler"], "stopped_early", None)  # ReplicateASHA's record (FIFO: none)
    tracking = A2MLflowCallback(spec, location, stopped_early_of=stopped_early_of)
    storage_path, fs = open_location(location.storage, location.endpoint_url).ray_storage()  # the study's parent
    run_config = tune.RunConfig(
        name=spec.name,
        storage_path=storage_path,
        storage_filesystem=fs,
        failure_config=tune.FailureConfig(max_failures=int(spec.resources.max_failures)),
        # Trials' Tune checkpoints point at their Train checkpoints (launch.trainable); keeping one also makes Tune
        # save the experiment state with every checkpoint, so `resume` loses as little as possible.
        checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
        # result.json is what `status` and `summary` read
        callbacks=[JsonLoggerCallback(), CSVLoggerCallback(), tracking],
        progress_reporter=_reporter(spec, stopped_early_of, tracking.outage_text),
        verbose=2 if verbose else 0,
    )
    return tune.Tuner(trainable, param_space={}, tune_config=tune.TuneConfig(**tune_kwargs), run_config=run_config)


def _reporter(spec, stopped_early_of=None, tracking_line=lambda: None):
    from ray.tune import ProgressReporter  # ray: only when a study runs

    class StudyTable(ProgressReporter):
        """The live trial table (`a2 study status`'s, from the running trials) every 30 s and at the end. (Tune's
        CLIReporter looks every parameter column up in the best trial's config, so a best trial without a
        conditional key, lambda of fusion none, would stop the study with a KeyError.)"""

        last = 0.0

        def should_report(self, trials, done: bool = False) -> bool:
            return done or time.monotonic() - self.last >= 30

        def report(self, trials, done: bool, *sys_info) -> None:
            self.last = time.monotonic()
            print(format_table([live_row(spec, t, stopped_early_of) for t in trials], spec.metric), flush=True)
            line = tracking_line()  # e.g. "tracking: server down 31 s, 14 epochs exported once it was back"
            if line:
                print(line, flush=True)

    return StudyTable()


# -- table rows --------------------------------------------------------------------------------------------------
def _table_row(spec, trial_id: str, state: str, sampled: dict, last: dict, best, stopped_early=None) -> dict:
    """The columns every table shows, with the trial's resolved config."""
    try:
        config = spec.trial_config(sampled)
    except A2Error:  # an old study whose keys moved on: show what is known
        config = {}
    model, train = config.get("model", {}), config.get("train", {})
    return {"trial_id": trial_id, "state": state, "stopped_early": stopped_early, "config": config,
            "fusion": model.get("fusion", sampled.get("fusion")),
            # lambda weighs the mask loss, which fusion none does not have
            "lambda": None if model.get("fusion") == "none" else model.get("lambda", sampled.get("lambda")),
            "seed": train.get("seed", sampled.get("seed")),
            "epochs_done": int(finite(last.get("epoch")) or 0), "epochs_planned": spec.total_epochs,
            "last": finite(last.get(spec.metric)), "best": finite(best),
            # the selected checkpoint on the test split, reported when the trial ended (a2core train.test_at_end)
            "test": finite(last.get(test_metric(spec.metric)))}


def test_metric(metric: str) -> str:
    """The test-split counterpart of a val metric ("val/CIDEr" -> "test/CIDEr")."""
    return "test/" + metric.split("/", 1)[-1]


def live_row(spec, trial, stopped_early_of=None) -> dict:
    """A table row of a running Tune trial: its last result, the best so far from Tune's metric analysis, and the
    scheduler's record when it stopped the trial."""
    best = (trial.metric_analysis.get(spec.metric) or {}).get(spec.mode)
    stopped = stopped_early_of(trial.trial_id) if stopped_early_of else None
    return _table_row(spec, trial.trial_id, trial.status, dict(trial.config or {}), trial.last_result or {}, best,
                      stopped)


def _grid_row(spec, result) -> dict:
    """A table row of a trial from Tune's result grid (what this driver last saw of it)."""
    history = result.metrics_dataframe
    values = history[spec.metric] if history is not None and spec.metric in history else []
    metrics = result.metrics or {}
    return _table_row(spec, metrics.get("trial_id") or "?", "ERROR" if result.error else "TERMINATED",
                      dict(result.config or {}), metrics, _best_value(values, spec.mode))


def _best_value(values, mode: str) -> float | None:
    """The best of the finite values, or None."""
    return (max if mode == "max" else min)((v for v in map(finite, values) if v is not None), default=None)


# -- reading a study back: status, summary -----------------------------------------------------------------------
def collect(spec, location: StudyLocation) -> list[dict]:
    """One row per trial: its state from the Tune experiment in storage (no Ray needed), its results from its own
    result log (every epoch it reported, across restarts; Tune's result files lose what was not yet synced when a
    driver died)."""
    # ray.tune is heavy: only the paths that read Tune's state import it
    from ray.tune import ExperimentAnalysis

    path, fs = location.at().ray_storage()
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    stopped = stopped_early_trials(location)
    rows = []
    for trial in ExperimentAnalysis(path, storage_filesystem=fs).trials:
        error = (trial.get_error() or "").strip().splitlines()
        row = trial_row(spec, location, trial.trial_id, dict(trial.config or {}), str(trial.status),
                        _result_log(spec, location, trial.trial_id), trial.last_result or {},
                        error[-1][:500] if error else None)
        cut_short = row["state"] == "TERMINATED" and 0 < row["epochs_done"] < row["epochs_planned"]
        # Only the scheduler ends a trial short: one without the scheduler's record (a driver killed) is stopped too.
        row["stopped_early"] = stopped.get(trial.trial_id) or ({"rung": None, "cutoff": None} if cut_short else None)
        rows.append(row)
    return rows


def stopped_early_trials(location: StudyLocation) -> dict[str, dict]:
    """{trial id: {"rung", "cutoff"}} of the trials the scheduler stopped, from their run folders' record
    (`launch.trainable.STOPPED_FILE`, written by the driver's `launch.mlflow_callback`)."""
    out = {}
    prefix = f"{location.name}-"
    for name in location.at(TRIALS_DIR).listdir(folders_only=True):
        record = stop_record(location.at(TRIALS_DIR, name)) if name.startswith(prefix) else None
        if record is not None:
            out[name[len(prefix):]] = {"rung": record["rung"], "cutoff": finite(record["cutoff"])}
    return out


def _result_log(spec, location: StudyLocation, trial_id: str) -> list[dict]:
    try:
        return read_results(location.at(TRIALS_DIR), spec.name, trial_id)
    except ValueError:  # a log cut short (not JSON): Tune's last result alone
        return []


def trial_row(spec, location: StudyLocation, trial_id: str, sampled: dict, state: str, history: list[dict],
              last_result: dict, error: str | None = None) -> dict:
    """A trial's row of the summary: the table's columns, the epochs it reported and its best stored checkpoint
    (Ray Train keeps the best by the study metric plus the latest; ties go to the later epoch)."""
    values = {int(r["epoch"]): finite(r[spec.metric]) for r in history  # the latest report of an epoch wins
              if finite(r.get("epoch")) is not None and finite(r.get(spec.metric)) is not None}
    best_value = _best_value(values.values(), spec.mode)
    run = location.at(TRIALS_DIR, train_run_name(spec.name, trial_id))
    sign = 1 if spec.mode == "max" else -1
    ckpt_epoch = max((e for e in checkpoint_epochs(run) if e in values), key=lambda e: (sign * values[e], e),
                     default=None)
    if ckpt_epoch is not None and values[ckpt_epoch] == best_value:
        best_epoch = ckpt_epoch
    else:
        best_epoch = next((e for e in sorted(values) if values[e] == best_value), None)
    last = history[-1] if history else last_result  # the result log is in epoch order
    return {
        **_table_row(spec, trial_id, state, sampled, last, best_value),
        "sampled": sampled,
        "epochs_reported": [int(r["epoch"]) for r in history or [last_result] if finite(r.get("epoch")) is not None],
        "best_epoch": best_epoch,
        "best_checkpoint": None if ckpt_epoch is None else run.join(checkpoint_name(ckpt_epoch), CHECKPOINT_FILE).uri,
        "best_checkpoint_problem": None if ckpt_epoch is None else quick_checkpoint_problem(
            run.join(checkpoint_name(ckpt_epoch), CHECKPOINT_FILE)),
        "best_checkpoint_epoch": ckpt_epoch,
        "train_run": run.uri,
        "compute": trial_compute(history),
        "error": error,
    }


def trial_compute(history: list[dict]) -> dict:
    """What a trial cost, {unit: seconds}: the largest of its cumulative `compute/*` results."""
    most = {unit: _best_value([r.get(f"compute/{unit}") for r in history], "max") for unit in COMPUTE_UNITS}
    return {unit: seconds for unit, seconds in most.items() if seconds is not None}


def compute_totals(spec, rows: list[dict]) -> dict:
    """The study's compute: `total_<unit>` over all trials, `stopped_<unit>` spent on trials the scheduler stopped
    early, `saved_<unit>` what stopping them saved against running them to their planned epochs (their cost per
    epoch so far x the epochs they did not run). With `resources.price_per_hour` (a worker node's, one trial per
    node) also `<kind>_cost` = price x the kind's wall hours."""
    totals: dict[str, float] = defaultdict(float)
    for row in rows:
        done, planned = row["epochs_done"], row["epochs_planned"]
        stopped = row["state"] == "TERMINATED" and 0 < done < planned
        for unit, value in (row.get("compute") or {}).items():
            totals[f"total_{unit}"] += value
            totals[f"stopped_{unit}"] += value if stopped else 0.0
            totals[f"saved_{unit}"] += value / done * (planned - done) if stopped else 0.0
    price = spec.resources.price_per_hour
    if price is not None and "total_wall_s" in totals:
        for kind in ("total", "stopped", "saved"):
            totals[f"{kind}_cost"] = price * totals[f"{kind}_wall_s"] / 3600
    return dict(totals)


def _stopped_tags(row: dict) -> dict:
    """A row's or group's stopped-early record as the run tags that `dashboards.stats.best_candidates` reads."""
    from dashboards.stats import stopped_early_tags  # scipy (dashboards.stats): not for `a2 study validate`

    return stopped_early_tags(0, float("nan")) if row.get("stopped_early") else {}


def replicate_groups(spec, rows: list[dict]) -> list[dict]:
    """One entry per replicate group (trials whose resolved configs differ only in the seed,
    `dashboards.stats.config_hash`): its trials and seeds, the mean of their best metric with its 95% interval over
    seeds (`dashboards.stats.seed_interval`, as every comparison), and the record of one of its trials the scheduler
    stopped early, if any."""
    from dashboards.stats import config_hash, seed_interval  # scipy: not for `a2 study validate`
    from launch.search import SEED_KEYS, group_key  # ray and optuna: likewise

    groups: dict[str, list[dict]] = {}
    for r in rows:
        digest = config_hash(r["config"]) if r.get("config") else group_key(dict(r["sampled"] or {}))
        groups.setdefault(digest, []).append(r)
    out = []
    for h, g in groups.items():
        values = [r["best"] for r in g if r["best"] is not None]
        interval = asdict(seed_interval(values)) if values else {"mean": None, "low": None, "high": None, "n": 0}
        sampled = {k: v for k, v in (g[0]["sampled"] or {}).items() if k not in SEED_KEYS}
        out.append({"config_hash": h, "fusion": g[0]["fusion"], "lambda": g[0]["lambda"], "sampled": sampled,
                    "trials": [r["trial_id"] for r in g], "seeds": [r["seed"] for r in g],
                    "values": values, "test_values": [r["test"] for r in g if r.get("test") is not None],
                    **interval,
                    "stopped_early": next((r["stopped_early"] for r in g if r.get("stopped_early")), None)})
    return out


def summarize(spec, location: StudyLocation, rows: list[dict]) -> dict:
    """Best trial and best replicate group (both among those not stopped early, unless every one was:
    `dashboards.stats.best_candidates`), the baseline (fusion none, same seed) comparison, every replicate
    group's mean and interval, and every trial's results."""
    from dashboards.stats import best_candidates, best_group as pick_best_group  # scipy: not for validate

    best = pick_best(best_candidates([r for r in rows if r["best"] is not None], tags_of=_stopped_tags), "best", spec.mode)
    groups = replicate_groups(spec, rows)
    best_group = pick_best_group(groups, lambda g: g["values"], spec.mode, lambda g: bool(g.get("stopped_early")))
    baseline, beats = None, None
    if best is not None:
        baseline = pick_best([r for r in rows if r["fusion"] == "none" and r["seed"] == best["seed"]
                          and r["best"] is not None], "best", spec.mode)
        if baseline is not None and baseline is not best:
            beats = best["best"] > baseline["best"] if spec.mode == "max" else best["best"] < baseline["best"]
    done = sum(1 for r in rows if r["state"] == "TERMINATED")
    return {
        "study": spec.name,
        "path": location.uri(),
        "metric": spec.metric,
        "mode": spec.mode,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "num_trials": spec.num_trials,
        "trials_finished": done,
        "complete": done == spec.num_trials and len(rows) == spec.num_trials,
        "best": None if best is None else {
            "trial_id": best["trial_id"], "value": best["best"], "epoch": best["best_epoch"],
            "checkpoint": best["best_checkpoint"], "checkpoint_epoch": best["best_checkpoint_epoch"],
            "checkpoint_problem": best.get("best_checkpoint_problem"),
            "sampled": best["sampled"], "config": best["config"], "fusion": best["fusion"], "seed": best["seed"],
            "lambda": best["lambda"], "stopped_early": best.get("stopped_early")},
        "best_group": best_group,
        "groups": groups,
        "baseline": None if baseline is None else {
            "trial_id": baseline["trial_id"], "value": baseline["best"], "seed": baseline["seed"],
            "checkpoint": baseline["best_checkpoint"]},
        "beats_baseline": beats,
        "compute": compute_totals(spec, rows),
        "trials": [{k: v for k, v in r.items() if k != "config"} for r in rows],
    }


def finish(spec, location: StudyLocation, *, verbose: bool = True) -> dict:
    """Write `summary.json`, log the compute totals to the study's MLflow parent run and print the verdict."""
    rows = collect(spec, location)
    summary = summarize(spec, location, rows)
    summary["tracking"] = add_outage(location)  # the MLflow outages of the study, if any
    write_summary(location, summary)
    _log_compute_totals(spec, summary["compute"])
    print_conclusions(spec, summary, rows if verbose else [])
    print(f"summary: {location.uri(SUMMARY_FILE)}", flush=True)
    return summary


def _log_compute_totals(spec, totals: dict) -> None:
    """The compute totals as `compute/<key>` metrics of the study's MLflow parent run, when MLflow answers (a
    server still down at the end does not fail the study: `resume` or `a2 mlflow sync` exports it later)."""
    try:
        check_tracking_uri(spec.tracking.mlflow_uri, timeout=2.0)
    except TrackingError:
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
