"""The MLflow writer: a study's runs created, updated and ended, all through `MlflowClient` with explicit run ids (no
global active run, so one Tune driver tracks many trials at once), and files logged to them. Per study one
experiment and these runs (the tags, named in `dashboards.tracking`, are what the rest of a2tune searches):

    run <study name>   a2.role=study  a2.study=<name>                                                (parent)
      run <trial id>   a2.role=trial  a2.study=<name>  a2.trial_id=<id>  mlflow.parentRunId=<parent>  (child)

The read side (`dashboards/`) only searches and reads these runs (`dashboards.tracking`); what writes them lives here.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import numbers
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable

from a2core.config import applicable_config, flatten
from a2core.errors import TrackingError
from dashboards.mlflow_views import (MODEL_TRAINING, TAG_EXPERIMENT_KIND, VIEW_TRIALS, chart_section,
                                     saved_sections, ui_url, view_states, view_tags)
from dashboards.tracking import (TAG_END_REASON, TAG_FUSION, TAG_GIT, TAG_PARENT, TAG_ROLE, TAG_SEED, TAG_STUDY,
                                 TAG_TRIAL_ID, filter_value, git_commit, mlflow_client, param_value, redact_uri,
                                 search_all_runs, study_experiment, study_filter, study_runs)

logger = logging.getLogger(__name__)

RUN_STATUSES = ("RUNNING", "FINISHED", "FAILED", "KILLED")
TAG_STORAGE = "a2.storage"  # the parent run's: where the study's record is, which tells two studies of one name apart

# MLflow's own limits (mlflow.utils.validation) on tag values and key lengths.
_MAX_TAG_VALUE = 8000
_MAX_KEY = 250
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")


RUN_NAME_MAX = 250  # MLflow's runs.name column, VARCHAR(250): PostgreSQL and MySQL refuse more (SQLite does not)

def _clean_key(key: str) -> str:
    """A metric or param key MLflow takes: its characters, its length, and no empty, `.` or `..` part between `/`s
    (MLflow refuses a name that a path would resolve to another: `val/`, `diag//mask`, `./x`, and one refused fails
    the whole batch, so every later export of the study, too). Cut before the parts are mended: a cut may end on `/`."""
    cut = _BAD_NAME_CHARS.sub("_", str(key))[:_MAX_KEY]
    mended = "/".join(part if part not in ("", ".", "..") else "_" for part in cut.split("/"))
    return mended[:_MAX_KEY - 1] + "_" if len(mended) > _MAX_KEY else mended


def _tag_values(tags: dict) -> dict[str, str]:
    return {str(k)[:_MAX_KEY]: str(v)[:_MAX_TAG_VALUE] for k, v in tags.items()}


def _numeric(value: Any) -> float | None:
    """A metric value as a float (numpy and torch scalars too); None for anything else (strings, bools, arrays)."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):  # an array of more than one value
            return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def client_settings() -> None:
    """Short MLflow HTTP timeouts in this process, unless the environment sets its own: MLflow's REST client retries
    a refused or slow request for minutes (timeout 120 s, 7 retries); a study's export thread tries again later."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")  # read per request by MLflow
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


def mark_runs(tracking_uri: str, experiment: str, tags: dict[str, str], name_prefix: str = "") -> int:
    """Set `tags` on every run of `experiment` and start each run's name with `name_prefix` (a rehearsal's runs,
    `launch.rehearse`); returns the number of runs, 0 when there is no such experiment."""
    client = mlflow_client(tracking_uri)
    found = study_experiment(client, experiment)  # renamed since, too (a deleted one's runs are not searched)
    if found is None or found.lifecycle_stage == "deleted":
        return 0
    runs = search_all_runs(client, [found.experiment_id], "")
    for run in runs:
        for key, value in tags.items():
            client.set_tag(run.info.run_id, key, value)
        name = run.info.run_name or run.info.run_id
        if not name.startswith(name_prefix):
            client.update_run(run.info.run_id, name=f"{name_prefix}{name}")
    return len(runs)


# -- the tracker: mlflow (seconds to import) is imported on first use, not with this module, which Ray workers import
# too (launch.rehearse's stand-in trainer, through launch.driver) ---------------------------------------------------
@dataclass
class _KnownRun:
    """A trial's run as this process last wrote or read it (`StudyTracker.trial_run`)."""
    run_id: str
    name: str
    status: str
    tags: dict[str, str]
    params: set[str]


class StudyTracker:
    """MLflow runs of one study (no global MLflow state: safe in a long-lived process). `artifact_location`: where a
    new experiment keeps artifacts without a server (default: MLflow's ./mlruns; a server decides itself)."""

    def __init__(self, tracking_uri: str, study_name: str, experiment: str | None = None,
                 artifact_location: str | None = None):
        self.tracking_uri = tracking_uri
        self.study_name = study_name
        self.experiment_name = experiment or study_name
        self.artifact_location = artifact_location
        self.client = mlflow_client(tracking_uri)
        self.parent_run_id: str | None = None
        self.storage: str | None = None  # the study's storage (`start_study`'s TAG_STORAGE): checked before restoring
        self.trial_runs: dict[str, str] = {}
        # run id -> what this process wrote to or read of a trial's run (name, status, tags, param keys): while the
        # export runs, it is the run's only writer, so a trial exported again is not searched for, and only tags
        # that change are written (a search and two writes fewer an export of it: `trial_run`, `set_tags`)
        self._known: dict[str, _KnownRun] = {}
        self._view: tuple | None = None  # (metric, mode, searched params) once `set_views` was called
        self._view_sections: set[str] = set()  # the chart sections the views list
        # run id -> metric key -> the steps MLflow holds: read once per run and process, then kept up to date, so
        # that a replayed or re-reported epoch (a resume, a retry, an export made again) is written once
        self._steps: dict[str, dict[str, set[int]]] = {}

    def view_url(self, view: str = VIEW_TRIALS, charts: bool = False) -> str | None:
        """The study's runs in the MLflow UI, opened on `view` (`dashboards.mlflow_views`: the trials by the study
        metric, or `a2-configs`, grouped by replicate group), as a table or (`charts`) the chart view; None when the
        tracking URI is not a server (see `ui_pointer`)."""
        if not self.tracking_uri.lower().startswith(("http://", "https://")):
            return None
        return ui_url(self.tracking_uri, self.experiment_id, view, charts)

    @functools.cached_property
    def experiment_id(self) -> str:
        """The experiment's id (`dashboards.tracking.study_experiment`): the one of its name; one created under its
        name and renamed since (the MLflow UI's Rename) is followed, said in one warning, not made again beside it
        (which split a study's runs in two experiments); one of its name in MLflow's trash is restored, said in one
        warning with how to drop it for good instead; else one is created (model training, with the a2 views). An
        existing one is marked model training again (a resumed study) and gets the views it lacks."""
        from mlflow.entities import ViewType
        from mlflow.exceptions import MlflowException  # mlflow: on first use, as in `mlflow_client`

        exp = study_experiment(self.client, self.experiment_name)
        if exp is None:
            tags = {TAG_STUDY: self.experiment_name, TAG_EXPERIMENT_KIND: MODEL_TRAINING,
                    **view_tags(self._view_states())}
            try:
                return self.client.create_experiment(self.experiment_name, artifact_location=self.artifact_location,
                                                     tags=tags)
            except MlflowException as err:  # created concurrently by another process, or in a hidden trash
                exp = self.client.get_experiment_by_name(self.experiment_name)
                if exp is None:
                    if err.error_code == "RESOURCE_ALREADY_EXISTS":
                        raise TrackingError(self._in_trash_text()) from None
                    raise
        if exp.name != self.experiment_name:
            logger.warning("MLflow experiment %r (id %s) was renamed %r; the study's runs are exported there (to "
                           "start a new experiment instead, set tracking.experiment)", self.experiment_name,
                           exp.experiment_id, exp.name)
        if exp.lifecycle_stage == "deleted":
            # another study's (another storage): refused before it is restored, left in the trash
            parent = self.client.search_runs([exp.experiment_id], study_filter(self.study_name),
                                             run_view_type=ViewType.ALL, max_results=1,
                                             order_by=["attributes.start_time ASC"])
            self._check_storage(parent[0] if parent else None, " (in MLflow's trash, left there)")
            self.client.restore_experiment(exp.experiment_id)
            logger.warning("MLflow experiment %r (id %s) was in MLflow's trash; restored with its runs (to drop it for "
                           "good instead: delete it again, purge it with `mlflow gc --backend-store-uri <the server's "
                           "store> --experiment-ids %s`, and export again)", exp.name, exp.experiment_id,
                           exp.experiment_id)
        missing = {TAG_EXPERIMENT_KIND: MODEL_TRAINING} if exp.tags.get(TAG_EXPERIMENT_KIND) != MODEL_TRAINING else {}
        if not saved_sections(exp.tags):
            missing.update(view_tags(self._view_states(), exp.tags))
        for key, value in missing.items():
            self.client.set_experiment_tag(exp.experiment_id, key, value)
        return exp.experiment_id

    def _in_trash_text(self) -> str:
        """Why no experiment of the study's name can be made: MLflow keeps the name of one in its trash (a store whose
        lookup by name does not return deleted experiments), in one line, with how to restore or purge it."""
        from mlflow.entities import ViewType  # mlflow: on first use, as in `mlflow_client`

        ids = []
        with contextlib.suppress(Exception):  # the line stands without the id
            ids = [e.experiment_id for e in self.client.search_experiments(
                view_type=ViewType.DELETED_ONLY, filter_string=f"name = {filter_value(self.experiment_name)}")]
        which = f" (id {ids[0]})" if ids else ""
        ident = ids[0] if ids else "<its id>"
        return (f"MLflow experiment {self.experiment_name!r}{which} at {redact_uri(self.tracking_uri)} is in MLflow's "
                f"trash, and MLflow makes no new one of its name: restore it (`mlflow experiments restore "
                f"--experiment-id {ident}`) or purge it (`mlflow gc --backend-store-uri <the server's store> "
                f"--experiment-ids {ident}`), or set tracking.experiment to another name")

    def restore_deleted(self) -> tuple[list[str], bool]:
        """After a write failed, and at a study's end: restore what of this tracker's experiment and runs was deleted
        on the server since their ids were cached (someone cleaning up in the MLflow UI; a deleted experiment's runs
        are deleted, and restored, with it), as `experiment_id` restores a deleted experiment, and forget what it knew
        of the runs restored (read again on their next use). Returns (what was restored or is gone, in words; whether
        the tracker still holds: False when the experiment or a run is gone for good (`mlflow gc`), and a new
        tracker must make them again). ([], True): nothing was deleted; the failure was another."""
        from mlflow.entities import ViewType
        from mlflow.exceptions import MlflowException  # mlflow: on first use, as in `mlflow_client`

        if "experiment_id" not in self.__dict__:  # never resolved: nothing cached
            return [], True
        exp_id = self.experiment_id
        try:
            exp = self.client.get_experiment(exp_id)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            return [f"experiment {self.experiment_name!r} ({exp_id}) is gone from the server"], False
        said = []
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp_id)
            said.append(f"experiment {self.experiment_name!r} ({exp_id}) was deleted; restored with its runs")
        cached = {self.parent_run_id, *self.trial_runs.values(), *self._known, *self._steps} - {None}
        found, token = {}, None
        while cached:
            page = self.client.search_runs([exp_id], "", run_view_type=ViewType.ALL, max_results=1000,
                                           page_token=token)
            found.update((run.info.run_id, run) for run in page)
            if not (token := page.token):
                break
        gone = cached - set(found)
        deleted = sorted(run_id for run_id in cached & set(found) if found[run_id].info.lifecycle_stage == "deleted")
        for run_id in deleted:
            self.client.restore_run(run_id)
            self._known.pop(run_id, None)
            self._steps.pop(run_id, None)
            self.trial_runs = {tid: rid for tid, rid in self.trial_runs.items() if rid != run_id}
        if deleted:
            said.append(f"run{'s' if len(deleted) > 1 else ''} {', '.join(deleted)} of experiment "
                        f"{self.experiment_name!r} {'were' if len(deleted) > 1 else 'was'} deleted; restored")
        if gone:
            said.append(f"run{'s' if len(gone) > 1 else ''} {', '.join(sorted(gone))} of experiment "
                        f"{self.experiment_name!r} {'are' if len(gone) > 1 else 'is'} gone from the server")
        return said, not gone

    # -- the study's views in the MLflow UI ------------------------------------------------------------------
    def set_views(self, metric: str = "val/CIDEr", mode: str = "max", searched_params: list[str] | tuple = ()) -> None:
        """Save the study's views (`dashboards.mlflow_views`) for its `metric`, `mode` and searched params; from now
        on, metrics of a new chart section update them, so that the views list every section in reading order."""
        self._view = (metric, mode, tuple(searched_params))
        exp = self.client.get_experiment(self.experiment_id)
        self._view_sections = saved_sections(exp.tags) | {chart_section(metric)}
        self._write_views(exp.tags)

    def _view_states(self) -> dict:
        metric, mode, searched = self._view or ("val/CIDEr", "max", ())
        # one metric name per known section: that is all `section_order` needs
        return view_states(metric, mode, searched, [f"{section}/x" for section in self._view_sections])

    def _write_views(self, existing: dict | None = None) -> None:
        for key, value in view_tags(self._view_states(), existing).items():
            self.client.set_experiment_tag(self.experiment_id, key, value)

    def _note_sections(self, metric_names) -> None:
        if self._view is None:
            return
        new = {chart_section(m) for m in metric_names} - self._view_sections
        if new:
            saved, self._view_sections = self._view_sections, self._view_sections | new
            try:
                self._write_views(self.client.get_experiment(self.experiment_id).tags)
            except Exception:
                self._view_sections = saved  # not written: the next export's metrics write it again
                raise

    def _first_run(self, filter_string: str):
        return next(iter(search_all_runs(self.client, [self.experiment_id], filter_string)), None)

    # -- study (parent) --------------------------------------------------------------------------------------
    def find_parent_run(self):
        return self._first_run(study_filter(self.study_name))

    def _restore_deleted_parent(self):
        """The study's parent run deleted by hand (the MLflow UI), restored, as `restore_deleted` restores it during a
        study; None when there is none. A new parent would leave the old one's trial runs beside its own: every trial
        twice in the study's views."""
        from mlflow.entities import ViewType  # mlflow: on first use, as in `mlflow_client`

        deleted = self.client.search_runs([self.experiment_id], study_filter(self.study_name),
                                          run_view_type=ViewType.DELETED_ONLY, max_results=1,
                                          order_by=["attributes.start_time ASC"])
        if not deleted:
            return None
        self._check_storage(deleted[0], " (its parent run in MLflow's trash, left there)")  # before restoring it
        self.client.restore_run(deleted[0].info.run_id)
        return self.client.get_run(deleted[0].info.run_id)

    def start_study(self, params: dict | None = None, tags: dict | None = None) -> str:
        """Create the study's parent run, or reuse it (resume) and set it RUNNING again. Returns its id."""
        all_tags = _tag_values({TAG_STUDY: self.study_name, TAG_ROLE: "study", TAG_GIT: git_commit(), **(tags or {})})
        self.storage = all_tags.get(TAG_STORAGE) or self.storage
        run = self.find_parent_run() or self._restore_deleted_parent()
        self._check_storage(run)
        if run is None:
            run = self.client.create_run(self.experiment_id, run_name=self.study_name, tags=all_tags)
        else:
            if run.info.status != "RUNNING":
                self.client.update_run(run.info.run_id, status="RUNNING")
            self.set_tags(run.info.run_id, all_tags)
        self.parent_run_id = run.info.run_id
        self._log_params(self.parent_run_id, flatten(params or {}), run.data.params)
        return self.parent_run_id

    def _check_storage(self, run, where: str = "") -> None:
        """TrackingError when the parent run `run` (None: none) is another study's of the same name (another storage,
        one shared server): taking it would mix both studies' trials in one study, and overwrite its storage tag,
        params and end status. `where`: what is said of the experiment (in the trash, left there)."""
        theirs = run.data.tags.get(TAG_STORAGE) if run is not None else None
        if self.storage and theirs and not _same_storage(self.storage, theirs):
            raise TrackingError(
                f"MLflow experiment {self.experiment_name!r}{where} at {redact_uri(self.tracking_uri)} already holds "
                f"study {self.study_name!r} stored at {theirs}, not this one's {self.storage}; run this study with "
                f"tracking.experiment=<an experiment of its own> or under another name")

    def end_study(self, status: str = "FINISHED", reason: str | None = None) -> None:
        self._end(self.parent_run_id, status, reason)

    def _end(self, run_id: str, status: str, reason: str | None) -> None:
        """End a run with `status`; its `a2.end_reason` tag says why (a KILLED or FAILED run), or goes."""
        from mlflow.exceptions import MlflowException  # mlflow: on first use, as in `mlflow_client`

        known = self._known.get(run_id)
        if reason:
            self.set_tags(run_id, {TAG_END_REASON: reason})
        elif known is None or TAG_END_REASON in known.tags:
            with contextlib.suppress(MlflowException):  # it had none
                self.client.delete_tag(run_id, TAG_END_REASON)
            if known is not None:
                del known.tags[TAG_END_REASON]
        if known is None or known.status != _status(status):
            self.client.set_terminated(run_id, status=_status(status))
        if known is not None:
            known.status = _status(status)

    # -- trials (children) -----------------------------------------------------------------------------------
    def trial_run(self, trial_id: str, config: dict | None = None, tags: dict | None = None,
                  run_name: str | None = None, running: bool = True) -> str:
        """The id of the child run of `trial_id`: the existing one (set RUNNING again unless not `running`, only
        `tags` change) or a new one with the config (less what its fusion does not use) as params, and tags trial id,
        fusion, seed, git commit."""
        trial_id = str(trial_id)
        run_name = run_name[:RUN_NAME_MAX] if run_name else run_name  # a database refuses a longer one
        if self.parent_run_id is None:
            self.start_study()
        flat = flatten(applicable_config(config or {}))
        own = {TAG_STUDY: self.study_name, TAG_ROLE: "trial", TAG_TRIAL_ID: trial_id,
               TAG_PARENT: self.parent_run_id, TAG_GIT: git_commit()}
        if own[TAG_GIT] != "unknown":
            own["mlflow.source.git.commit"] = own[TAG_GIT]
        for tag, keys in ((TAG_FUSION, ("model.fusion", "fusion")), (TAG_SEED, ("train.seed", "seed"))):
            value = next((flat[k] for k in keys if flat.get(k) is not None), None)
            if value is not None:
                own[tag] = str(value)
        extra = _tag_values(tags or {})
        known = self._known.get(self.trial_runs.get(trial_id, ""))
        if known is None:
            run = self._first_run(f"tags.`{TAG_PARENT}` = {filter_value(self.parent_run_id)} and "
                                  f"tags.`{TAG_TRIAL_ID}` = {filter_value(trial_id)}")
            if run is None:
                run = self.client.create_run(self.experiment_id, run_name=run_name or trial_id,
                                             tags=_tag_values({**own, **extra}))
                self._steps[run.info.run_id] = {}  # a new run has no metrics yet
            known = _KnownRun(run.info.run_id, run.info.run_name, run.info.status, dict(run.data.tags),
                              set(run.data.params))
            self._known[known.run_id] = known
            self.trial_runs[trial_id] = known.run_id
        if run_name and known.name != run_name:  # e.g. a run exported before runs had readable names
            self.client.update_run(known.run_id, name=run_name)
            known.name = run_name
        if running and known.status != "RUNNING":
            self.client.update_run(known.run_id, status="RUNNING")
            known.status = "RUNNING"
        self.set_tags(known.run_id, {**{k: v for k, v in own.items() if k not in known.tags}, **extra})
        self._log_params(known.run_id, flat, known.params)
        return known.run_id

    def end_trial(self, run_id: str, status: str = "FINISHED", reason: str | None = None) -> None:
        self._end(run_id, status, reason)

    # -- logging ---------------------------------------------------------------------------------------------
    def log_metrics(self, run_id: str, metrics: dict, step: int, timestamp_ms: int | None = None) -> dict[str, float]:
        """Log the numeric values of `metrics` at `step` (`log_epochs` of one epoch); returns the numeric values."""
        return self.log_epochs(run_id, [(step, metrics, timestamp_ms)])[0]

    def log_epochs(self, run_id: str, epochs: list[tuple[int, dict, int | None]]) -> list[dict[str, float]]:
        """Log, in one batch, the numeric values of each (step, metrics, timestamp_ms) that the run does not hold yet
        (every (key, step) is written once, whatever its value or time: the first report of an epoch stays);
        returns each epoch's numeric values. `timestamp_ms` (None: now) is the result's own time. (One batch for
        the epochs an export finds: an epoch a request was what bounded the export's throughput.)"""
        steps = self.metric_steps(run_id)
        rows, values, written = [], [], set()
        for step, metrics, timestamp_ms in epochs:
            ts = int(timestamp_ms) if timestamp_ms is not None else int(time.time() * 1000)
            numbers = {_clean_key(key): _numeric(value) for key, value in (metrics or {}).items()}
            logged = {key: number for key, number in numbers.items() if number is not None}
            for key, number in logged.items():
                if int(step) not in steps.get(key, ()) and (key, int(step)) not in written:
                    rows.append((key, number, ts, int(step)))
                    written.add((key, int(step)))
            values.append(logged)
        self._log_batch(run_id, "metrics", rows)
        for key, step in written:
            steps.setdefault(key, set()).add(step)
        if run_id != self.parent_run_id:  # the parent's totals are not in the views (they show trials)
            self._note_sections({key for logged in values for key in logged})
        return values

    def metric_steps(self, run_id: str) -> dict[str, set[int]]:
        """{metric key: the steps at which the run has values}, read from MLflow once per run and process."""
        if run_id not in self._steps:
            keys = self.client.get_run(run_id).data.metrics
            self._steps[run_id] = {key: {int(m.step) for m in self.client.get_metric_history(run_id, key)}
                                   for key in keys}
        return self._steps[run_id]

    def logged_steps(self, run_id: str, key: str) -> set[int]:
        """The steps at which metric `key` of a run has values."""
        return set(self.metric_steps(run_id).get(_clean_key(key), ()))

    def set_tags(self, run_id: str, tags: dict) -> None:
        """Set `tags` on the run (on a trial run this process knows, only those whose value changes)."""
        known = self._known.get(run_id)
        items = [(k, v) for k, v in _tag_values(tags).items() if known is None or known.tags.get(k) != v]
        self._log_batch(run_id, "tags", items)
        if known is not None:
            known.tags.update(items)

    def _log_params(self, run_id: str, flat: dict, existing: dict) -> None:
        """The params of `flat` that the run does not have yet (a resumed run keeps its first values). Two keys that
        are one once cleaned (`a@b`, `a#b`; two long ones cut alike) are logged once, the first's value: MLflow
        refuses a batch that names a param twice, and so every later export of the study."""
        cleaned: dict[str, str] = {}
        for key, value in flat.items():
            cleaned.setdefault(_clean_key(key), value)
        new = [(key, param_value(value)) for key, value in cleaned.items() if key not in existing]
        self._log_batch(run_id, "params", new)
        if run_id in self._known:
            self._known[run_id].params.update(key for key, _ in new)

    def _log_batch(self, run_id: str, kind: str, items: list[tuple]) -> None:
        """`items` as MLflow entities of `kind` (metrics, params, tags); the client splits them into requests."""
        from mlflow.entities import Metric, Param, RunTag  # mlflow: on first use, as in `mlflow_client`

        entity = {"metrics": Metric, "params": Param, "tags": RunTag}[kind]
        if items:
            self.client.log_batch(run_id, **{kind: [entity(*item) for item in items]})


def _same_storage(a: str, b: str) -> bool:
    """Whether two storage URIs or paths are one place (a trailing `/`, a symlinked or relative path aside)."""
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _status(status: str) -> str:
    status = str(status).upper()
    if status not in RUN_STATUSES:
        raise ValueError(f"run status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
    return status


def log_artifacts(tracking_uri: str, run_id: str, paths: Iterable[str | os.PathLike],
                  artifact_path: str = "package") -> str:
    """Log files as artifacts of a run; returns the artifact folder's URI."""
    client = mlflow_client(tracking_uri)
    for p in paths:
        client.log_artifact(run_id, str(p), artifact_path)
    return f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"


def log_report(tracking_uri: str, study_name: str, paths: dict[str, str]) -> str | None:
    """Log a report's files (`dashboards.report.build_report`) as artifacts of the study's MLflow parent run under
    `report/`; returns their URI, or None when the store has no such run (the study was not exported there:
    `a2 mlflow sync NAME`)."""
    parent, _ = study_runs(tracking_uri, study_name)
    return None if parent is None else log_artifacts(tracking_uri, parent.info.run_id, paths.values(), "report")


def study_parent_run(tracking_uri: str, study: str) -> str:
    """The study's parent run id; created (and left FINISHED) when the study has none yet (a package of a study that
    was never exported)."""
    parent, _ = study_runs(tracking_uri, study)
    if parent is not None:
        return parent.info.run_id
    tracker = StudyTracker(tracking_uri, study)
    run_id = tracker.start_study(tags={"a2.created_by": "package"})
    tracker.end_study("FINISHED")
    return run_id
