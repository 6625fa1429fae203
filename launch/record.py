"""A study's record, read back from its storage: what `status`, the summary, `compare`, `report` and `plan` read.

The study's folder is the only record of what happened (`launch.location`): the saved spec, the trials' states in
Tune's experiment state, and each trial's run folder (`launch.trainable`: `results.json`, every epoch's result;
`artifacts/`, per-image scores; `stopped_early.json`, the scheduler's decision). `StudyRecord.load` reads it once
into one object, each trial by `record_trial` from its own run folder alone: `trials` (each a `dashboards.runs.Trial`,
the one shape of a trial every view reads; its row is the summary's), `groups()` (replicate groups), `best()`,
`summary()` (`summary.json`) and `per_image()`. `study()` hands the dashboards the same trials (dashboards never
import launch). MLflow is an export of this record (`launch.mlflow_export`); nothing here reads MLflow.

One reader of a study's state. `StudyRecord.load` is the only code that reads a study's trials: every view that
needs them (status, compare, report, export, plan, packaging and its seed studies, the pipeline) loads the record.
The study's other files with trials in them are caches of it, each with its rule:
- the digest (`record-digest.json`, `Digest`): written by the driver at the end of every run and resume
  (`save_digest`), read only here. A read takes a trial from it when the study file's stamp (size, mtime in ns),
  the study's place, the digest's format and fields, Tune's newest experiment state (its name, size and mtime) and
  the trial's run folder listing (every file's path, size and mtime but `artifacts/`) are as the digest recorded
  them; any difference re-reads that trial from its files (Tune's state: every trial's Tune fields), and a digest
  that does not read is not used at all. What a record is made of stays its files.
- `summary.json` (`summarize`): written by the driver at the end of every run (`launch.driver.finish`, paths
  relative to the study's folder: `launch.conclusions.portable_summary`), by a rehearsal, and rewritten by
  `a2 mlflow sync` with its `tracking` outage. Nothing reads trials from it: it is the study's result for people and
  scripts, read back (`launch.conclusions.read_summary`) only for what no other file holds, its MLflow `tracking`
  state (`a2 mlflow sync`, and `launch.driver.finished_already`, which takes `complete` as a hint only and reads
  the record before it says so). It is stale from the moment a writer starts the study again, until it ends.
`tests/test_import_graph.py` holds that only these modules name the two files and `read_summary`.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial

from a2core.errors import A2Error
from a2core.selection import best_epoch as pick_best_epoch, finite
from dashboards.compare import study_verdicts
from dashboards.runs import TABLE_METRICS, ReplicateGroup, Study, Trial, seed_number
from dashboards.stats import config_hash, seed_interval
from dashboards.stats import best_group as pick_best_group, best_trial as pick_best_trial
from launch.conclusions import best_value, test_metric
from launch.lease import holder_started, live_writer
from launch.location import DIGEST_FILE, STUDY_FILE, StudyLocation, json_default, load_saved_spec
from launch.spec import SEED_KEYS, group_key
from launch.layout import (ARTIFACTS_DIR, CHECKPOINT_FILE, PROGRESS_FILE, RESULTS_FILE, SKIP_KEYS, TRIALS_DIR,
                           checkpoint_epochs, checkpoint_name, end_record, progress_record, read_results, run_status,
                           stop_record, train_run_name)
from launch.verify import experiment_trials, newest_experiment_state, quick_checkpoint_problem, refuse_unreadable

COMPUTE_UNITS = ("wall_s", "cpu_s", "gpu_s")  # launch.trainable logs each as `compute/<unit>`, cumulative
# a trial's per-image CIDEr-D below its `artifacts/` (`a2core.train` writes them; the export uploads them as they are)
PER_IMAGE = {"val": "eval/per_image_cider.json",  # the best val epoch's
             "test": "eval/test_per_image_cider.json"}  # the selected checkpoint's, on the test split
READERS = 16  # threads reading trials' run folders on S3 (`record_trials`)
HISTORY_KEYS = ("train/loss", *(metric for _, metric in TABLE_METRICS))  # the dashboards' per-epoch curves and tables


@dataclass
class StudyRecord:
    """One study as its storage holds it. `trials`: each trial as the record's `dashboards.runs.Trial` (`trial_row`;
    `Trial.row()` is its row of the summary), in Tune's order; `logged`: the epochs of each trial's result log;
    `running`: a live writer holds the study's lease; `files` and `stamps`: what the read found of each trial's run
    folder and of the study's own files, what its digest is keyed on (`save_digest`)."""

    spec: object
    location: StudyLocation
    trials: list[Trial]
    logged: dict[str, int] = field(default_factory=dict)
    running: bool = False
    files: dict[str, list] = field(default_factory=dict)
    stamps: dict = field(default_factory=dict)

    @classmethod
    def load(cls, location: StudyLocation, spec=None, trials: list[Trial] | None = None,
             refuse: str | None = None, for_digest: bool = False) -> "StudyRecord":
        """Read the study at `location`: its saved spec unless `spec` is given, its trials as Tune knows them from
        Tune's experiment state unless `trials` are given (none before its first trial started), each trial's run
        folder, or its entry of the study's digest where the trial's files are unchanged (`Digest`). `refuse` (what
        the reader is doing, e.g. "status"): a trial's unreadable result log is refused
        (`launch.verify.refuse_unreadable`) instead of read as empty, so that a caller checks each log as it reads
        it, not in a second pass over every trial's folder. `for_digest`: list every trial's files for
        `save_digest` (else only where the study has a digest to check them against)."""
        # each stamp is taken before its file is read: a file changed after it is read again next time
        study_file = location.at(STUDY_FILE).stamp()
        stamps = {"study_file": None if study_file is None else list(study_file)}  # a list, as the digest's JSON
        spec = spec if spec is not None else load_saved_spec(location)
        digest = Digest.read(location, stamps["study_file"])
        if trials is None:
            state = newest_experiment_state(location.at())
            stamp = None if state is None else state.stamp()
            stamps["tune_state"] = None if stamp is None else [state.uri.rsplit("/", 1)[-1], *stamp]
            trials = digest.tune_trials(stamps["tune_state"]) if digest is not None else None
            if trials is None:
                trials = tune_trials(location)  # none before Tune's first experiment state
        writer = live_writer(location.at())
        running = writer is not None
        read = _map(location, partial(_load_trial, spec, location, digest, for_digest, not running, refuse), trials)
        rows = [row for row, _, _ in read]
        if running:  # where each running trial is within its next epoch (on S3 one request each, for these alone)
            rows = _map(location, partial(with_under_way, spec, location, since=holder_started(writer)), rows)
        return cls(spec, location, rows, {row.trial_id: n for row, n, _ in read}, running,
                   {row.trial_id: files for row, _, files in read}, stamps)

    def save_digest(self) -> None:
        """Write the study's digest (`Digest`) of this record (loaded `for_digest`)."""
        if any(files is None for files in self.files.values()):
            raise ValueError("a digest is made of a record loaded for it (StudyRecord.load(for_digest=True))")
        doc = {"format": DIGEST_FORMAT, "fields": list(DIGEST_FIELDS), "study": self.location.uri(), **self.stamps,
               "trials": [{"files": self.files[t.trial_id], "logged": self.logged[t.trial_id],
                           "row": {name: getattr(t, name) for name in DIGEST_FIELDS if name != "history"},
                           # by columns: [epochs, values] a metric (zip makes its (epoch, value) pairs again)
                           "history": {key: list(zip(*points)) for key, points in t.history.items()}}
                          for t in self.trials]}
        self.location.write_text(json.dumps(doc, default=json_default), DIGEST_FILE)

    def shown(self) -> "StudyRecord":
        """This record as `a2 study status` shows it. Tune saves a running trial as PENDING, so that a resume starts
        it again (`ray.tune.experiment.Trial.__getstate__`): one that has reported epochs while a live writer holds
        the study is RUNNING, as is one in its first epoch that wrote where it is in it (`under_way`). The record
        itself keeps Tune's word (the driver's summary reads it when it ends)."""
        return replace(self, trials=[replace(t, state="RUNNING" if self.running and t.state == "PENDING"
                                             and (t.epochs_done > 0 or t.under_way is not None) else t.state)
                                     for t in self.trials])

    def groups(self) -> list[ReplicateGroup]:
        return replicate_groups(self.spec, self.trials)

    def best(self) -> dict | None:
        return best_trial(self.spec, self.trials)

    def summary(self) -> dict:
        """What `summary.json` holds."""
        return summarize(self.spec, self.location, self.trials)

    def per_image(self, trial_id: str, split: str = "val") -> dict[str, float] | None:
        return per_image(self.location, self.spec.name, trial_id, split)

    def study(self) -> Study:
        """The record as the dashboards take it (`dashboards.runs.Study`): every trial that has started, and the
        best trial and group the record names."""
        runs = [t for t in self.trials if self.logged.get(t.trial_id) or t.state != "PENDING"]
        best, group = self.best(), best_group(self.spec, self.groups())
        return Study(self.spec.name, runs, self.location.uri(), self.running, self.spec.metric, self.spec.mode,
                     best_trial=None if best is None else best.trial_id,
                     best_group=None if group is None else group.config_hash, confirm_from=self.spec.confirm_from)


DIGEST_FORMAT = 1
# a trial's fields a digest keeps: all but its MLflow status (whether a writer holds the study is the reader's, so it is
# made again) and its per-image reader (a function); Tune's word on a trial is the first seven
DIGEST_FIELDS = tuple(f.name for f in fields(Trial) if f.name not in ("status", "per_image", "under_way"))
TUNE_FIELDS = ("trial_id", "name", "state", "sampled", "retries", "error", "last_result")


@dataclass
class Digest:
    """What the driver's last read of a study's record made of each trial (`StudyRecord.save_digest`), keyed on the
    files it read, as the module docstring says (`artifacts/` left out: per-image scores are read when asked for). A
    file deleted, restored or rewritten changes its folder's listing, so the trial is read again. What it saves: a
    status of a finished 1,000-trial study lists each run folder instead of parsing its 20-epoch result log and
    resolving its config (benchmarks/RESULTS.md)."""

    tune_state: list | None  # [name, size, mtime_ns] of the experiment state its trials' Tune fields came from
    entries: dict[str, dict]  # trial id -> {"files", "logged", "row"}, in Tune's order

    @classmethod
    def read(cls, location: StudyLocation, study_file: list | None) -> "Digest | None":
        """The study's digest, when it was made of this study at this place and of the study file whose stamp is
        `study_file`; else None."""
        try:
            doc = json.loads(location.read_text(DIGEST_FILE) or "null")
            # a copy of the study elsewhere (its files' times kept) is another study: its trials' paths differ
            if not (isinstance(doc, dict) and doc.get("format") == DIGEST_FORMAT and study_file is not None
                    and doc.get("fields") == list(DIGEST_FIELDS) and doc.get("study") == location.uri()
                    and doc.get("study_file") == study_file):
                return None
            return cls(doc.get("tune_state"), {entry["row"]["trial_id"]: entry for entry in doc["trials"]})
        except (ValueError, TypeError, KeyError):  # not a digest: the record is read from its files
            return None

    def tune_trials(self, tune_state: list | None) -> list[Trial] | None:
        """Tune's trials as the digest has them, when `tune_state` is the experiment state it took them from."""
        if tune_state is None or tune_state != self.tune_state:
            return None
        try:
            return [Trial(**{name: entry["row"][name] for name in TUNE_FIELDS}) for entry in self.entries.values()]
        except (KeyError, TypeError):  # not what a digest holds: Tune's state is read
            return None

    def trial(self, tune: Trial, files: list) -> tuple[Trial, int] | None:
        """The digest's trial and its logged epochs, when Tune's word on it (`tune`) and its run folder's `files`
        are as they were; else None."""
        entry = self.entries.get(tune.trial_id)
        try:
            if (entry is None or entry["files"] != [list(f) for f in files]
                    or any(entry["row"][name] != getattr(tune, name) for name in TUNE_FIELDS)):
                return None
            history = {key: list(zip(*columns)) for key, columns in entry["history"].items()}
            return Trial(**entry["row"], history=history), int(entry["logged"])
        except (KeyError, TypeError, AttributeError, ValueError):  # not what a digest holds: read from its files
            return None


def _load_trial(spec, location: StudyLocation, digest: Digest | None, for_digest: bool, ended: bool,
                refuse: str | None, tune: Trial) -> tuple[Trial, int, list | None]:
    """A trial of `StudyRecord.load`: (its record, its result log's epochs, its run folder's files as listed before
    it was read, or None when neither a digest nor `for_digest` asks for them: a listing is ~0.1 ms a trial), from
    the digest when it has the trial as it is, else by `record_trial`."""
    # `progress.json` left out: it changes every 30 s while the trial runs, and no field of the row is read from it
    run = location.at(TRIALS_DIR, train_run_name(spec.name, tune.trial_id))
    files = (run.files(skip=(ARTIFACTS_DIR, PROGRESS_FILE))
             if digest is not None or for_digest else None)
    kept = digest.trial(tune, files) if digest is not None else None
    if kept is not None and refuse and kept[1] == 0 and any(f[0] == RESULTS_FILE for f in files):
        kept = None  # a result log the digest read as no epochs: read again, so that one cut short is refused
    if kept is None:
        row, log = record_trial(spec, location, tune, ended, refuse)
        return row, len(log), files
    row, logged = kept
    return replace(row, status=run_status(row.state, logged, row.stopped_early, spec.total_epochs, ended=ended,
                                          end=row.ended),
                   per_image=partial(per_image, location, spec.name, tune.trial_id)), logged, files


def with_under_way(spec, location: StudyLocation, row: Trial, since: float | None = None) -> Trial:
    """`row` with the epoch it has under way (`launch.layout.progress_record`) when it runs (a live writer holds the
    study, Tune's state says RUNNING, neither its end record nor a stop record ended it). Read by `StudyRecord.load`
    for its readers (`status`), and by the driver's live table, not by `record_trial`, which the MLflow export calls
    every 2 s and which needs none. Tune's saved experiment state restores a running trial as PENDING
    (`launch.verify.experiment_trials`), so the record's row of one, whose run is RUNNING while the study is driven
    (`run_status`), is read as well: else `status` never showed an epoch under way. The live table's PENDING rows
    (Tune's live word: not running; no run status) are not. `since`: when the driver now running it started (its
    lease's `started`): a progress file older than that is a killed attempt's (`progress_record`)."""
    running = row.state == "RUNNING" or (row.state == "PENDING" and row.status == "RUNNING")
    if not running or row.ended is not None or row.stopped_early is not None:
        return row
    run = location.at(TRIALS_DIR, train_run_name(spec.name, row.trial_id))
    return replace(row, under_way=progress_record(run, row.epochs_done + 1, since))


def per_image(location: StudyLocation, study: str, trial_id: str, split: str = "val") -> dict[str, float] | None:
    """{image id: CIDEr-D} of a trial on `split` ("val": its best epoch's; "test": its selected checkpoint's), None
    when it has none."""
    folder = location.at(TRIALS_DIR, train_run_name(study, trial_id), ARTIFACTS_DIR)
    text = folder.join(PER_IMAGE[split]).read_text()
    return None if text is None else json.loads(text)


def epoch_metrics(result: dict) -> dict[str, float]:
    """The numbers of an epoch's result that are metrics (`launch.layout.SKIP_KEYS` left out), as MLflow logs them."""
    return {k: float(v) for k, v in result.items() if type(v) in _NUMBERS and k not in SKIP_KEYS}


_NUMBERS = {int, float}  # JSON's numbers, not bool (an int subclass): a set lookup, a status makes 300,000 of them


def tune_trials(location: StudyLocation) -> list[Trial]:
    """The trials of the study's Tune experiment state in storage, as `tune_trial` makes them of Ray's (read without
    Ray: `launch.verify.experiment_trials`); none when Tune has saved no experiment state yet (a driver killed before
    its first save, `tuner.pkl` there or not): no trial of the study is Tune's then."""
    return experiment_trials(location.at()) or []


def group_hash(trial: Trial) -> str:
    """The replicate group of a trial: `dashboards.stats.config_hash` of its resolved config (else of its sampled
    keys without the seed, for an old study whose saved spec no longer resolves them)."""
    return config_hash(trial.config) if trial.config else group_key(dict(trial.sampled or {}))


def best_trial(spec, rows: list[Trial]) -> Trial | None:
    """The trial of the best value of the study metric, by the one rule (`dashboards.stats.best_trial`: among those
    not stopped early unless every one was; of equals the lower trial id)."""
    return pick_best_trial(rows, spec.mode)


def best_group(spec, groups: list[ReplicateGroup]) -> ReplicateGroup | None:
    """The best of `replicate_groups` (`dashboards.stats.best_group`: the best mean in the study's mode among groups
    none of whose trials was stopped early, unless all were; of equal means, the group listed first, i.e. whose first
    trial came first). Every view's "best configuration" is this one. With confirmation seeds (`search.confirm`) it is
    one of the configurations chosen for them once any has run them: a runner-up with the search's seeds alone could
    otherwise beat the chosen one, whose fresh seeds regress to its true mean, and packaging would take its few
    seeds."""
    first = spec.confirm_from
    confirmed = [g for g in groups if first is not None
                 and any((n := seed_number(s)) is not None and n >= first for s in g.seeds)]
    return pick_best_group(confirmed or groups, lambda g: g.values, spec.mode, lambda g: bool(g.stopped_early))



# -- trial rows, groups and the summary ----------------------------------------------------------------------------
def record_trial(spec, location: StudyLocation, tune: Trial, ended: bool,
                 refuse: str | None = None) -> tuple[Trial, list[dict]]:
    """One trial of the record, and its result log (epoch order), from Tune's view of it (`tune_trial`) and its own
    run folder alone: its result log, stop record, end record and checkpoint epochs (on S3 four requests). `ended`: no
    writer goes on with the study (`run_status`: an unfinished trial's run is KILLED, not RUNNING). `refuse`: as
    `StudyRecord.load`'s."""
    run = location.at(TRIALS_DIR, train_run_name(spec.name, tune.trial_id))
    log = _result_log(spec, location, tune.trial_id, refuse)
    stopped, end = stop_record(run), end_record(run)  # `end`: it ended itself (diverged), not a scheduler's stop
    row = trial_row(spec, location, tune.trial_id, dict(tune.sampled), tune.state, log, tune.last_result, tune.error)
    cut_short = row.state == "TERMINATED" and 0 < row.epochs_done < row.epochs_planned and end is None
    # Else only the scheduler ends a trial short: one without its record (a driver killed) is stopped too.
    stopped_early = ({"rung": stopped["rung"], "cutoff": finite(stopped["cutoff"])} if stopped is not None
                     else {"rung": None, "cutoff": None} if cut_short else None)
    final, history = {}, {}
    for result in log:  # epoch order: a metric's final value is its latest
        for key, value in epoch_metrics(result).items():
            final[key] = value
            if key in HISTORY_KEYS or key == spec.metric:  # the study metric's: its value at the best epoch
                history.setdefault(key, []).append((int(result["epoch"]), value))
    return replace(row, name=tune.name, retries=tune.retries, ended=end, stopped_early=stopped_early,
                   # as its MLflow run shows it (`launch.mlflow_export` exports this status)
                   status=run_status(row.state, len(log), stopped_early, spec.total_epochs, ended=ended, end=end),
                   final=final, history=history,
                   per_image=partial(per_image, location, spec.name, tune.trial_id)), log


def record_trials(spec, location: StudyLocation, trials: list[Trial], ended: bool,
                  refuse: str | None = None) -> list[tuple[Trial, list[dict]]]:
    """`record_trial` of each of `trials`, in their order. On S3 by `READERS` threads: each trial's requests are
    independent and S3's cost is its latency per request, so 1,000 trials read one after another take minutes."""
    return _map(location, partial(record_trial, spec, location, ended=ended, refuse=refuse), trials)


def _map(location: StudyLocation, read, trials: list[Trial]) -> list:
    """`read` of each of `trials`, in their order; on S3 by `READERS` threads."""
    if location.at().local or len(trials) < 2:
        return [read(trial) for trial in trials]
    with ThreadPoolExecutor(min(READERS, len(trials))) as pool:
        return list(pool.map(read, trials))


def _result_log(spec, location: StudyLocation, trial_id: str, refuse: str | None) -> list[dict]:
    try:
        return read_results(location.at(TRIALS_DIR), spec.name, trial_id)
    except ValueError as err:  # a log cut short (not JSON): refused, or Tune's last result alone
        if refuse:
            log = location.at(TRIALS_DIR, train_run_name(spec.name, trial_id), RESULTS_FILE)
            refuse_unreadable(location.at(), log, "results", err, refuse)
        return []


def trial_row(spec, location: StudyLocation, trial_id: str, sampled: dict, state: str, history: list[dict],
              last_result: dict, error: str | None = None) -> Trial:
    """A trial as the record holds it: the table's columns, the epochs it reported, its best epoch and its best
    stored checkpoint, both by the one rule of `a2core.selection` (the latest of equal values), its replicate group."""
    values = {int(r["epoch"]): finite(r[spec.metric]) for r in history  # the latest report of an epoch wins
              if finite(r.get("epoch")) is not None and finite(r.get(spec.metric)) is not None}
    run = location.at(TRIALS_DIR, train_run_name(spec.name, trial_id))
    best_epoch = pick_best_epoch(values, spec.mode)
    ckpt_epoch = pick_best_epoch({e: values[e] for e in checkpoint_epochs(run) if e in values}, spec.mode)
    last = history[-1] if history else last_result  # the result log is in epoch order
    columns = table_columns(spec, sampled, last, None if best_epoch is None else values[best_epoch])
    checkpoint = None if ckpt_epoch is None else run.join(checkpoint_name(ckpt_epoch), CHECKPOINT_FILE)
    return Trial(trial_id, state=state, sampled=sampled, error=error, last_result=last_result, study=spec.name,
                 **columns, config_hash=group_hash(Trial(trial_id, sampled=sampled, config=columns["config"])),
                 epochs_reported=[int(r["epoch"]) for r in history or [last_result]
                                  if finite(r.get("epoch")) is not None],
                 best_step=best_epoch, best_checkpoint_epoch=ckpt_epoch,
                 best_checkpoint=None if checkpoint is None else checkpoint.uri,
                 best_checkpoint_problem=None if checkpoint is None else quick_checkpoint_problem(checkpoint),
                 train_run=run.uri, compute=trial_compute(history))


def table_row(spec, tune: Trial, last: dict, best, stopped_early=None) -> Trial:
    """Tune's trial `tune` (`launch.conclusions.tune_trial`) with the columns every table shows (`table_columns`):
    the live table's row (`launch.driver.live_row`), the record's before its run folder is read."""
    return replace(tune, **table_columns(spec, tune.sampled, last, best, stopped_early))


def table_columns(spec, sampled: dict, last: dict, best, stopped_early=None) -> dict:
    """A trial's fields every table shows and its resolved config: its epochs from `last` (its latest result),
    `best` the best value of the study metric, the scheduler's record `stopped_early`."""
    try:
        config = spec.trial_config(sampled)
    except A2Error:  # an old study whose keys moved on: show what is known
        config = {}
    return {"config": config, "stopped_early": stopped_early, "epochs_done": int(finite(last.get("epoch")) or 0),
            "epochs_planned": spec.total_epochs, "last": finite(last.get(spec.metric)), "best_value": finite(best),
            # the selected checkpoint on the test split, reported when the trial ended (a2core train.test_at_end)
            "test": finite(last.get(test_metric(spec.metric)))}


def trial_compute(history: list[dict]) -> dict:
    """What a trial cost, {unit: seconds}: the largest of its cumulative `compute/*` results."""
    most = {unit: best_value([r.get(f"compute/{unit}") for r in history], "max") for unit in COMPUTE_UNITS}
    return {unit: seconds for unit, seconds in most.items() if seconds is not None}


def compute_totals(spec, rows: list[Trial]) -> dict:
    """The study's compute: `total_<unit>` over all trials, `stopped_<unit>` spent on trials the scheduler stopped
    early, `saved_<unit>` what stopping them saved against running them to their planned epochs (their cost per
    epoch so far x the epochs they did not run). With `resources.price_per_hour` (a worker node's, one trial per
    node) also `<kind>_cost` = price x the kind's wall hours."""
    totals: dict[str, float] = defaultdict(float)
    for row in rows:
        done, planned = row["epochs_done"], row["epochs_planned"]
        stopped = row["state"] == "TERMINATED" and 0 < done < planned and not row.get("ended")
        for unit, value in (row.get("compute") or {}).items():
            totals[f"total_{unit}"] += value
            totals[f"stopped_{unit}"] += value if stopped else 0.0
            totals[f"saved_{unit}"] += value / done * (planned - done) if stopped else 0.0
    price = spec.resources.price_per_hour
    if price is not None and "total_wall_s" in totals:
        for kind in ("total", "stopped", "saved"):
            totals[f"{kind}_cost"] = price * totals[f"{kind}_wall_s"] / 3600
    return dict(totals)


def replicate_groups(spec, rows: list[Trial]) -> list[ReplicateGroup]:
    """One `dashboards.runs.ReplicateGroup` per replicate group (trials whose resolved configs differ only in the
    seed, `dashboards.stats.config_hash`): its trials and seeds, the mean of their best metric with its 95% interval
    over seeds (`dashboards.stats.seed_interval`, as every comparison), and the record of one of its trials the
    scheduler stopped early, if any. The one place a group is made."""
    groups: dict[str, list[Trial]] = {}
    for r in rows:  # rows are in Tune's order (trial ids): a group's place is its first trial's, the tie rule's order
        groups.setdefault(r.config_hash or group_hash(r), []).append(r)  # the hash `trial_row` gave it
    out = []
    for h, g in groups.items():
        values, best = [r.best_value for r in g if r.best_value is not None], pick_best_trial(g, spec.mode)
        interval = asdict(seed_interval(values)) if values else {"n": 0}
        out.append(ReplicateGroup(
            h, fusion=g[0].fusion, lam=g[0].lam, sampled={k: v for k, v in (g[0].sampled or {}).items()
                                                          if k not in SEED_KEYS},
            trials=[r.trial_id for r in g], seeds=[r.seed for r in g],
            best_trial=None if best is None else best.trial_id, values=values,
            test_values=[r.test for r in g if r.test is not None], **interval,
            stopped_early=next((r.stopped_early for r in g if r.stopped_early), None)))
    return out


def summarize(spec, location: StudyLocation, rows: list[Trial]) -> dict:
    """Best trial and best replicate group (both among those not stopped early, unless every one was:
    `dashboards.stats.best_candidates`; `best_group` is the one definition every view reads, with its own best
    trial), the best baseline group (fusion none) a verdict compares with, the baseline trial (fusion none, same
    seed), every replicate group's mean and interval, and every trial's results."""
    best, groups = best_trial(spec, rows), replicate_groups(spec, rows)
    baseline, beats = None, None
    if best is not None:
        baseline = pick_best_trial([r for r in rows if r["fusion"] == "none" and r["seed"] == best["seed"]],
                                   spec.mode)
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
        "best_group": _row(best_group(spec, groups)),
        # the configuration a verdict compares with: the best of the baseline's (fusion none), by the same rule
        "baseline_group": _row(best_group(spec, [g for g in groups if g.fusion == "none"])),
        "groups": [g.row() for g in groups],
        "baseline": None if baseline is None else {
            "trial_id": baseline["trial_id"], "value": baseline["best"], "seed": baseline["seed"],
            "checkpoint": baseline["best_checkpoint"]},
        "beats_baseline": beats,
        # the study's verdicts by `compare --by fusion`'s rule (Holm over its family), which `status` prints
        "verdicts": study_verdicts(Study(spec.name, rows, location.uri(), metric=spec.metric, mode=spec.mode,
                                             confirm_from=spec.confirm_from)),
        "compute": compute_totals(spec, rows),
        "trials": [r.row(config=False) for r in rows],
    }


def _row(group: ReplicateGroup | None) -> dict | None:
    return None if group is None else group.row()
