"""MLflow tracking of studies, all through `MlflowClient` with explicit run ids (no global active run, so one Tune
driver tracks many trials at once), and `a2 mlflow serve`. Per study one experiment and these runs (the tags are
what the rest of a2tune searches):

    run <study name>   a2.role=study  a2.study=<name>                                                (parent)
      run <trial id>   a2.role=trial  a2.study=<name>  a2.trial_id=<id>  mlflow.parentRunId=<parent>  (child)
"""
from __future__ import annotations

import base64
import contextlib
import errno
import functools
import json
import numbers
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from a2core.config import applicable_config, flatten
from a2core.errors import TrackingError
from dashboards.mlflow_views import (MODEL_TRAINING, TAG_EXPERIMENT_KIND, VIEW_TRIALS, chart_section,
                                     saved_sections, ui_url, view_states, view_tags)

TAG_STUDY = "a2.study"
TAG_ROLE = "a2.role"
TAG_TRIAL_ID = "a2.trial_id"
TAG_FUSION = "a2.fusion"
TAG_SEED = "a2.seed"
TAG_GIT = "a2.git_commit"
TAG_BEST_CKPT = "a2.best_checkpoint"  # a tag, not a param: it changes during training, params cannot
TAG_PARENT = "mlflow.parentRunId"
TAG_END_REASON = "a2.end_reason"  # why a run is KILLED or FAILED (removed when it ends FINISHED)
TAG_CONFIG_HASH = "a2.config_hash"  # the replicate group: `dashboards.stats.config_hash` of the resolved config
TAG_STOPPED_EARLY = "a2.stopped_early"  # the scheduler stopped the trial (its record: rung and cutoff)
TAG_STOPPED_RUNG = "a2.stopped_rung"
TAG_STOPPED_CUTOFF = "a2.stopped_cutoff"

RUN_STATUSES = ("RUNNING", "FINISHED", "FAILED", "KILLED")

# MLflow's own limits (mlflow.utils.validation) on value and key lengths.
_MAX_PARAM_VALUE = 6000
_MAX_TAG_VALUE = 8000
_MAX_KEY = 250

DEFAULT_PORT = 5000  # of `a2 mlflow serve`
_DB_PORTS = {"postgresql": 5432, "postgres": 5432, "mysql": 3306, "mssql": 1433, "oracle": 1521}
_DB_URI = re.compile(r"^(sqlite|postgresql|postgres|mysql|mssql)(\+\w+)?://")  # what `a2 mlflow serve` takes
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")


# -- URI checks ----------------------------------------------------------------------------------------------
def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"


def redact_uri(uri: str) -> str:
    """`uri` with any password replaced by `***` (`postgresql://user:***@host/db`), for showing or saving."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.password is None:
        return uri
    user = parsed.username or ""
    return urllib.parse.urlunsplit(parsed._replace(netloc=f"{user}:***@{parsed.netloc.rpartition('@')[2]}"))


# errnos of a local disk that cannot take more: no space, over quota, read-only
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def disk_problem(err: BaseException | None) -> str | None:
    """"PATH: [Errno 28] No space left on device" when `err`, or an error it came from, is a local disk that cannot
    take more (an MLflow artifact store or SQLite file on a full disk); None otherwise."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in _FULL_ERRNOS:
            return f"{err.filename or '?'}: [Errno {err.errno}] {err.strerror}"
        err = err.__cause__ or err.__context__
    return None


def unavailable_text(uri: str, err: BaseException) -> str:
    """Why an export to the tracking store `uri` did not go through, as one line: a full (or read-only) local disk
    named as such, with its path, else a server that does not answer."""
    full = disk_problem(err)
    if full is not None:
        return (f"MLflow at {redact_uri(uri)} cannot store what is logged: its local disk is full or read-only "
                f"({full}); the study's record is exported once there is room (`a2 mlflow sync`)")
    return f"MLflow server {redact_uri(uri)} not answering ({err}); the study's record is exported when it is back"


def check_tracking_uri(uri: str, timeout: float = 5.0) -> str:
    """`uri`, once it is known to work (else TrackingError naming it, within `timeout` s instead of after MLflow's
    minutes of retries): http(s) answers the REST API, a database's host:port connects, a file's folder exists."""
    if not isinstance(uri, str) or not uri.strip():
        raise TrackingError(f"tracking URI {uri!r} is empty or not a string")
    uri = uri.strip()
    parsed = urllib.parse.urlparse(uri)
    scheme = parsed.scheme.lower()
    database = scheme.split("+")[0]
    if scheme in ("http", "https") or database in _DB_PORTS:
        if not parsed.hostname:
            raise TrackingError(f"tracking URI {uri!r}: no host")
        try:
            host, port = parsed.hostname, parsed.port or _DB_PORTS.get(database)
        except ValueError as err:
            raise TrackingError(f"tracking URI {uri!r}: bad port ({err})") from None
        if database not in _DB_PORTS:
            _check_http(uri, timeout)
        else:
            try:
                socket.create_connection((host, port), timeout=timeout).close()
            except OSError as err:
                raise TrackingError(f"tracking URI {uri!r}: cannot connect to {host}:{port} ({err})") from None
    elif scheme == "sqlite":
        _check_sqlite(uri)
    elif scheme == "file" or (scheme == "" and not uri.startswith("//")) or (len(scheme) == 1 and os.name == "nt"):
        path = Path(urllib.parse.unquote(parsed.path) if scheme == "file" else uri).expanduser()
        folder = path if path.exists() else path.parent
        if not folder.is_dir():
            raise TrackingError(f"tracking URI {uri!r}: directory {str(folder)!r} does not exist")
    elif scheme not in ("databricks", "databricks-uc", "uc"):  # hosted stores: their clients check themselves
        raise TrackingError(
            f"tracking URI {uri!r}: unknown scheme {scheme + '://' if scheme else '(none)'}; use http(s)://host:port, "
            "sqlite:///path.db, postgresql://..., mysql://... or a local directory")
    return uri


def server_answers(uri: str, timeout: float = 2.0) -> bool:
    """Whether the tracking store at `uri` answers within `timeout` s (`check_tracking_uri` without its error)."""
    try:
        check_tracking_uri(uri, timeout=timeout)
        return True
    except TrackingError:
        return False


def _check_sqlite(uri: str) -> None:
    """sqlite:///relative.db, sqlite:////abs/path.db, sqlite:///:memory:: the database's folder must exist."""
    rest = uri[len("sqlite:"):]
    if not rest.startswith("//"):
        raise TrackingError(f"tracking URI {uri!r}: expected sqlite:///path/to/file.db")
    path = (rest[3:] if rest.startswith("///") else rest[2:]).split("?", 1)[0]
    if path in ("", ":memory:"):
        return
    folder = Path(urllib.parse.unquote(path)).expanduser().parent
    if not folder.is_dir():
        raise TrackingError(f"tracking URI {uri!r}: directory {str(folder)!r} of the database does not exist")


def _check_http(uri: str, timeout: float) -> None:
    """One request of MLflow's REST API (the experiments search), with the credentials MLflow's client sends."""
    headers = {"User-Agent": "a2tune"}
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    elif user and password:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1",
                                     headers=headers)
    try:
        urllib.request.urlopen(request, timeout=timeout).close()
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise TrackingError(
                f"tracking URI {uri!r}: server refused access (HTTP {err.code}); set MLFLOW_TRACKING_USERNAME/"
                "MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN") from None
        raise TrackingError(f"tracking URI {uri!r}: does not answer like an MLflow server (HTTP {err.code})") from None
    except OSError as err:  # URLError, refused connections, timeouts
        reason = getattr(err, "reason", err)
        raise TrackingError(f"tracking URI {uri!r}: MLflow server unreachable ({reason})") from None


# -- helpers ---------------------------------------------------------------------------------------------------
@functools.cache
def git_commit() -> str:
    """`git rev-parse HEAD` of the checkout this package runs from (else of the cwd), or "unknown"."""
    for cwd in (Path(__file__).resolve().parent, Path.cwd()):
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return "unknown"


def param_value(value: Any) -> str:
    if isinstance(value, (list, tuple, dict)):
        value = json.dumps(value, default=str, sort_keys=isinstance(value, dict))
    return str(value)[:_MAX_PARAM_VALUE]


def _clean_key(key: str) -> str:
    return _BAD_NAME_CHARS.sub("_", str(key))[:_MAX_KEY]


def _tag_values(tags: dict) -> dict[str, str]:
    return {str(k)[:_MAX_KEY]: str(v)[:_MAX_TAG_VALUE] for k, v in tags.items()}


def _quote(value: str) -> str:
    """A value for an MLflow search filter string (single-quoted)."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


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


def _client(tracking_uri: str):
    # mlflow (seconds to import): not for the modules that import this one for its URI helpers only (launch.spec:
    # `a2 study validate`)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def mark_runs(tracking_uri: str, experiment: str, tags: dict[str, str], name_prefix: str = "") -> int:
    """Set `tags` on every run of `experiment` and start each run's name with `name_prefix` (a rehearsal's runs,
    `launch.rehearse`); returns the number of runs, 0 when there is no such experiment."""
    client = _client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return 0
    runs = search_all_runs(client, [found.experiment_id], "")
    for run in runs:
        for key, value in tags.items():
            client.set_tag(run.info.run_id, key, value)
        name = run.info.run_name or run.info.run_id
        if not name.startswith(name_prefix):
            client.update_run(run.info.run_id, name=f"{name_prefix}{name}")
    return len(runs)


def search_all_runs(client, experiment_ids: list[str], filter_string: str) -> list:
    """Every run that matches, oldest first (all pages)."""
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string=filter_string, max_results=1000,
                                  order_by=["attributes.start_time ASC"], page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _study_filter(study_name: str) -> str:
    return f"tags.`{TAG_ROLE}` = 'study' and tags.`{TAG_STUDY}` = {_quote(study_name)}"


# -- the tracker -----------------------------------------------------------------------------------------------
def import_mlflow() -> None:
    """Import MLflow now: its import gives the "mlflow" logger its terminal handler, which `launch.runlog` turns
    down to warnings while a study runs (it must exist before, not appear with the study's first MLflow call)."""
    import mlflow  # noqa: F401


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
        self.client = _client(tracking_uri)
        self.parent_run_id: str | None = None
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
        """The experiment's id; created (model training, with the a2 views) when there is none, restored when it was
        deleted; an existing one is marked model training again (a resumed study) and gets the views it lacks."""
        from mlflow.exceptions import MlflowException  # mlflow: as in `_client`

        exp = self.client.get_experiment_by_name(self.experiment_name)
        if exp is None:
            tags = {TAG_STUDY: self.experiment_name, TAG_EXPERIMENT_KIND: MODEL_TRAINING,
                    **view_tags(self._view_states())}
            try:
                return self.client.create_experiment(self.experiment_name, artifact_location=self.artifact_location,
                                                     tags=tags)
            except MlflowException:  # created concurrently by another process
                exp = self.client.get_experiment_by_name(self.experiment_name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        missing = {TAG_EXPERIMENT_KIND: MODEL_TRAINING} if exp.tags.get(TAG_EXPERIMENT_KIND) != MODEL_TRAINING else {}
        if not saved_sections(exp.tags):
            missing.update(view_tags(self._view_states(), exp.tags))
        for key, value in missing.items():
            self.client.set_experiment_tag(exp.experiment_id, key, value)
        return exp.experiment_id

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
            self._view_sections = self._view_sections | new
            self._write_views(self.client.get_experiment(self.experiment_id).tags)

    def _first_run(self, filter_string: str):
        return next(iter(search_all_runs(self.client, [self.experiment_id], filter_string)), None)

    # -- study (parent) --------------------------------------------------------------------------------------
    def find_parent_run(self):
        return self._first_run(_study_filter(self.study_name))

    def start_study(self, params: dict | None = None, tags: dict | None = None) -> str:
        """Create the study's parent run, or reuse it (resume) and set it RUNNING again. Returns its id."""
        run = self.find_parent_run()
        all_tags = _tag_values({TAG_STUDY: self.study_name, TAG_ROLE: "study", TAG_GIT: git_commit(), **(tags or {})})
        if run is None:
            run = self.client.create_run(self.experiment_id, run_name=self.study_name, tags=all_tags)
        else:
            if run.info.status != "RUNNING":
                self.client.update_run(run.info.run_id, status="RUNNING")
            self.set_tags(run.info.run_id, all_tags)
        self.parent_run_id = run.info.run_id
        self._log_params(self.parent_run_id, flatten(params or {}), run.data.params)
        return self.parent_run_id

    def end_study(self, status: str = "FINISHED", reason: str | None = None) -> None:
        self._end(self.parent_run_id, status, reason)

    def _end(self, run_id: str, status: str, reason: str | None) -> None:
        """End a run with `status`; its `a2.end_reason` tag says why (a KILLED or FAILED run), or goes."""
        from mlflow.exceptions import MlflowException  # mlflow: as in `_client`

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
            run = self._first_run(f"tags.`{TAG_PARENT}` = {_quote(self.parent_run_id)} and "
                                  f"tags.`{TAG_TRIAL_ID}` = {_quote(trial_id)}")
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
        """The params of `flat` that the run does not have yet (a resumed run keeps its first values)."""
        new = [(_clean_key(k), param_value(v)) for k, v in flat.items() if _clean_key(k) not in existing]
        self._log_batch(run_id, "params", new)
        if run_id in self._known:
            self._known[run_id].params.update(key for key, _ in new)

    def _log_batch(self, run_id: str, kind: str, items: list[tuple]) -> None:
        """`items` as MLflow entities of `kind` (metrics, params, tags); the client splits them into requests."""
        from mlflow.entities import Metric, Param, RunTag  # mlflow: as in `_client`

        entity = {"metrics": Metric, "params": Param, "tags": RunTag}[kind]
        if items:
            self.client.log_batch(run_id, **{kind: [entity(*item) for item in items]})


def _status(status: str) -> str:
    status = str(status).upper()
    if status not in RUN_STATUSES:
        raise ValueError(f"run status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
    return status


def study_runs(tracking_uri: str, study_name: str, experiment: str | None = None):
    """(parent_run or None, [child runs]) of a study, oldest first, from the experiment named `experiment` (default:
    the study name), else from any experiment."""
    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment or study_name)
    exp_ids = [exp.experiment_id] if exp is not None else [e.experiment_id for e in client.search_experiments()]
    parents = [run for i in range(0, len(exp_ids), 100)  # search_runs takes at most 100 experiments
               for run in search_all_runs(client, exp_ids[i:i + 100], _study_filter(study_name))]
    if not parents:
        return None, []
    parent = parents[0]
    children = search_all_runs(client, [parent.info.experiment_id], f"tags.`{TAG_PARENT}` = {_quote(parent.info.run_id)}")
    return parent, children


def ui_pointer(tracking_uri: str, experiment_id: str | None) -> str:
    """Where to see a study's trials: the MLflow UI URL of its runs (`dashboards.mlflow_views.ui_url`) when the
    tracking URI is a server, else how to serve the database, then that URL on the default port."""
    if experiment_id is None:
        return f"(no experiment yet in {redact_uri(tracking_uri)})"
    if tracking_uri.lower().startswith(("http://", "https://")):
        return ui_url(tracking_uri, experiment_id)
    serve_url = ui_url(f"http://127.0.0.1:{DEFAULT_PORT}", experiment_id)
    if _DB_URI.match(tracking_uri):
        return f"`a2 mlflow serve --backend-store-uri {redact_uri(tracking_uri)}`, then {serve_url}"
    return f"`mlflow ui --backend-store-uri {tracking_uri}`, then {serve_url}"


def study_pointer(tracking_uri: str, experiment: str) -> str:
    """`ui_pointer` of the experiment named `experiment`, looked up (never created)."""
    exp = _client(tracking_uri).get_experiment_by_name(experiment)
    return ui_pointer(tracking_uri, exp.experiment_id if exp is not None else None)


def log_artifacts(tracking_uri: str, run_id: str, paths: Iterable[str | os.PathLike],
                  artifact_path: str = "package") -> str:
    """Log files as artifacts of a run; returns the artifact folder's URI."""
    client = _client(tracking_uri)
    for p in paths:
        client.log_artifact(run_id, str(p), artifact_path)
    return f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"


def _study_urls(backend: str, server: str, limit: int = 10) -> list[str]:
    """"study NAME: URL" of the (at most `limit` most recently updated) study experiments of a backend store."""
    experiments = _client(backend).search_experiments(filter_string=f"tags.`{TAG_STUDY}` LIKE '%'",
                                                      max_results=limit, order_by=["last_update_time DESC"])
    return [f"  study {exp.tags.get(TAG_STUDY, exp.name)}: {ui_url(server, exp.experiment_id)}" for exp in experiments]


# -- the server ------------------------------------------------------------------------------------------------
def serve(args) -> int:
    """`a2 mlflow serve`: this process becomes `mlflow server` (its CLI stops its web server on SIGINT/SIGTERM)."""
    backend = args.backend_store_uri
    if not _DB_URI.match(backend or ""):
        raise TrackingError(f"--backend-store-uri {backend!r}: use sqlite:///path.db or postgresql://user@host/db")
    if backend.startswith("sqlite:"):
        _check_sqlite(backend)
    dest = args.artifacts_destination or "./mlartifacts"
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "", "::") else args.host
    if ":" in shown and not shown.startswith("["):  # an IPv6 address
        shown = f"[{shown}]"
    url = f"http://{shown}:{int(args.port)}"
    print(f"MLflow server: {url}  (backend {redact_uri(backend)}, artifacts {dest}"
          + (f" via {args.s3_endpoint_url}" if args.s3_endpoint_url else "") + ")", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"bound to {args.host}: reachable from other machines; restrict with a firewall or a proxy", flush=True)
    print(f"clients: export MLFLOW_TRACKING_URI={url}", flush=True)
    try:  # where each study's trials open once the server is up
        studies = _study_urls(backend, url)
    except Exception as err:  # noqa: BLE001 - the server reports a store it cannot open itself
        studies = [f"  (studies not listed: {type(err).__name__}: {err})"]
    if studies:
        print("trials of each study (the Views menu has its other views):\n" + "\n".join(studies), flush=True)
    env = dict(os.environ)
    # MLflow's GenAI job runner (extra processes, slower start) is not used by a2tune; opt back in via the env.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    if args.s3_endpoint_url:
        env["MLFLOW_S3_ENDPOINT_URL"] = args.s3_endpoint_url
    os.execve(sys.executable, [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend,
                               "--artifacts-destination", dest, "--serve-artifacts", "--host", args.host,
                               "--port", str(int(args.port)), "--workers", str(int(args.workers))], env)
