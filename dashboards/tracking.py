"""MLflow tracking as the read side sees it: the tags of a study's runs, tracking URIs and whether their store answers,
a study's runs searched and read, and where the MLflow UI shows them. Per study one experiment and these runs,
written by `launch.tracking_writer` (the tags are what the rest of a2tune searches):

    run <study name>   a2.role=study  a2.study=<name>                                                (parent)
      run <trial id>   a2.role=trial  a2.study=<name>  a2.trial_id=<id>  mlflow.parentRunId=<parent>  (child)

Nothing here creates or changes a run or an experiment (tests/test_import_graph.py holds every `dashboards/` module to
that); the server, `a2 mlflow serve`, is `launch.mlflow_server`.
"""
from __future__ import annotations

import base64
import errno
import functools
import json
import os
import re
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from a2core.errors import TrackingError
from dashboards.mlflow_views import ui_url

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

# MLflow's own limit (mlflow.utils.validation) on a param's value.
_MAX_PARAM_VALUE = 6000

DEFAULT_PORT = 5000  # of `a2 mlflow serve`
# the databases MLflow stores runs in (mlflow.store.db.db_types.DATABASE_ENGINES, + the postgres alias): SQLAlchemy
# knows more (oracle://), but MLflow refuses them
_DB_PORTS = {"postgresql": 5432, "postgres": 5432, "mysql": 3306, "mssql": 1433}
SERVABLE_DB_URI = re.compile(r"^(sqlite|postgresql|postgres|mysql|mssql)(\+\w+)?://")  # what `a2 mlflow serve` takes


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
    shown = redact_uri(uri)  # in errors: never its password
    if scheme in ("http", "https") or database in _DB_PORTS:
        if not parsed.hostname:
            raise TrackingError(f"tracking URI {shown!r}: no host")
        try:
            host, port = parsed.hostname, parsed.port or _DB_PORTS.get(database)
        except ValueError as err:
            raise TrackingError(f"tracking URI {shown!r}: bad port ({err})") from None
        if database not in _DB_PORTS:
            _check_http(uri, timeout)
        else:
            try:
                socket.create_connection((host, port), timeout=timeout).close()
            except OSError as err:
                raise TrackingError(f"tracking URI {shown!r}: cannot connect to {host}:{port} ({err})") from None
    elif scheme == "sqlite":
        check_sqlite_uri(uri)
    elif scheme == "file" or (scheme == "" and not uri.startswith("//")) or (len(scheme) == 1 and os.name == "nt"):
        path = Path(urllib.parse.unquote(parsed.path) if scheme == "file" else uri).expanduser()
        folder = path if path.exists() else path.parent
        if not folder.is_dir():
            raise TrackingError(f"tracking URI {shown!r}: directory {str(folder)!r} does not exist")
    elif scheme not in ("databricks", "databricks-uc", "uc"):  # hosted stores: their clients check themselves
        raise TrackingError(
            f"tracking URI {shown!r}: unknown scheme {scheme + '://' if scheme else '(none)'}; use "
            "http(s)://host:port, sqlite:///path.db, postgresql://..., mysql://... or a local directory")
    return uri


def server_answers(uri: str, timeout: float = 2.0) -> bool:
    """Whether the tracking store at `uri` answers within `timeout` s (`check_tracking_uri` without its error)."""
    try:
        check_tracking_uri(uri, timeout=timeout)
        return True
    except TrackingError:
        return False


def check_sqlite_uri(uri: str) -> None:
    """sqlite:///relative.db, sqlite:////abs/path.db, sqlite:///:memory:: the database's folder must exist."""
    rest, shown = uri[len("sqlite:"):], redact_uri(uri)
    if not rest.startswith("//"):
        raise TrackingError(f"tracking URI {shown!r}: expected sqlite:///path/to/file.db")
    path = (rest[3:] if rest.startswith("///") else rest[2:]).split("?", 1)[0]
    if path in ("", ":memory:"):
        return
    folder = Path(urllib.parse.unquote(path)).expanduser().parent
    if not folder.is_dir():
        raise TrackingError(f"tracking URI {shown!r}: directory {str(folder)!r} of the database does not exist")


def _check_http(uri: str, timeout: float) -> None:
    """One request of MLflow's REST API (the experiments search), with the credentials MLflow's client sends."""
    headers, shown = {"User-Agent": "a2tune"}, redact_uri(uri)
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
                f"tracking URI {shown!r}: server refused access (HTTP {err.code}); set MLFLOW_TRACKING_USERNAME/"
                "MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN") from None
        raise TrackingError(f"tracking URI {shown!r}: does not answer like an MLflow server "
                            f"(HTTP {err.code})") from None
    except OSError as err:  # URLError, refused connections, timeouts
        reason = getattr(err, "reason", err)
        raise TrackingError(f"tracking URI {shown!r}: MLflow server unreachable ({reason})") from None


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
    """A config value as MLflow holds it as a param (lists and dicts as JSON), cut to MLflow's limit."""
    if isinstance(value, (list, tuple, dict)):
        value = json.dumps(value, default=str, sort_keys=isinstance(value, dict))
    return str(value)[:_MAX_PARAM_VALUE]


def filter_value(value: str) -> str:
    """A value for an MLflow search filter string (single-quoted)."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def mlflow_client(tracking_uri: str):
    """An `MlflowClient` of `tracking_uri` (no global MLflow state)."""
    # mlflow (seconds to import): not for the modules that import this one for its URI helpers only (launch.spec:
    # `a2 study validate`)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def search_all_runs(client, experiment_ids: list[str], filter_string: str) -> list:
    """Every run that matches, oldest first (all pages)."""
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string=filter_string, max_results=1000,
                                  order_by=["attributes.start_time ASC"], page_token=token)
        runs.extend(page)
        if not (token := page.token):
            return runs


def study_filter(study_name: str) -> str:
    """The search filter of a study's parent run."""
    return f"tags.`{TAG_ROLE}` = 'study' and tags.`{TAG_STUDY}` = {filter_value(study_name)}"


def import_mlflow() -> None:
    """Import MLflow now: its import gives the "mlflow" logger its terminal handler, which `launch.runlog` turns
    down to warnings while a study runs (it must exist before, not appear with the study's first MLflow call)."""
    import mlflow  # noqa: F401


# -- a study's runs, searched and read -------------------------------------------------------------------------
def renamed_experiments(client, name: str) -> list:
    """The active experiments created as `name` (their `a2.study` tag, set at creation: `launch.tracking_writer`)
    that are named otherwise now: renamed in the MLflow UI or by `MlflowClient.rename_experiment`. All pages."""
    found, token = [], None
    while True:
        page = client.search_experiments(filter_string=f"tags.`{TAG_STUDY}` = {filter_value(name)}",
                                         max_results=1000, page_token=token)
        found.extend(e for e in page if e.name != name)
        if not (token := page.token):
            return found


def study_experiment(client, name: str):
    """The experiment a study tracked as `name` is in: the active one of that name, else the one created as `name`
    and renamed since (its runs are there: a new one of the old name would split the study in two), else the one of
    that name in MLflow's trash (deleted), else None. TrackingError when several renamed ones were created as
    `name`: which one holds the study is for a person to say."""
    exp = client.get_experiment_by_name(name)  # MLflow's answer includes a deleted one
    if exp is not None and exp.lifecycle_stage != "deleted":
        return exp
    renamed = renamed_experiments(client, name)
    if len(renamed) > 1:
        listed = ", ".join(f"{e.name!r} (id {e.experiment_id})"
                           for e in sorted(renamed, key=lambda e: (len(e.experiment_id), e.experiment_id)))
        raise TrackingError(f"MLflow experiment {name!r} is gone, and {len(renamed)} experiments created under that "
                            f"name were renamed: {listed}; rename the study's own back to {name!r}, or set "
                            f"tracking.experiment to its name")
    return renamed[0] if renamed else exp


def study_runs(tracking_uri: str, study_name: str, experiment: str | None = None):
    """(parent_run or None, [child runs]) of a study, oldest first, from its experiment (`study_experiment` of
    `experiment`, default the study name: the one of that name, or the one created so and renamed since), else from
    any experiment."""
    client = mlflow_client(tracking_uri)
    try:
        exp = study_experiment(client, experiment or study_name)
    except TrackingError:  # several renamed: the study is searched for in every experiment
        exp = None
    exp_ids = [exp.experiment_id] if exp is not None else _all_experiment_ids(client)
    parents = [run for i in range(0, len(exp_ids), 100)  # search_runs takes at most 100 experiments
               for run in search_all_runs(client, exp_ids[i:i + 100], study_filter(study_name))]
    if not parents:
        return None, []
    parent = parents[0]
    children = search_all_runs(client, [parent.info.experiment_id],
                               f"tags.`{TAG_PARENT}` = {filter_value(parent.info.run_id)}")
    return parent, children


def _all_experiment_ids(client) -> list[str]:
    """Every active experiment's id, all pages: MLflow answers 1,000 a page, and a team's server holds more, so the
    experiment of a study tracked under another name was not found past the first page."""
    ids, token = [], None
    while True:
        page = client.search_experiments(page_token=token)
        ids.extend(e.experiment_id for e in page)
        if not (token := page.token):
            return ids


def ui_pointer(tracking_uri: str, experiment_id: str | None) -> str:
    """Where to see a study's trials: the MLflow UI URL of its runs (`dashboards.mlflow_views.ui_url`) when the
    tracking URI is a server, else how to serve the database, then that URL on the default port."""
    if experiment_id is None:
        return f"(no experiment yet in {redact_uri(tracking_uri)})"
    if tracking_uri.lower().startswith(("http://", "https://")):
        return ui_url(redact_uri(tracking_uri), experiment_id)
    serve_url = ui_url(f"http://127.0.0.1:{DEFAULT_PORT}", experiment_id)
    if SERVABLE_DB_URI.match(tracking_uri):
        return f"`a2 mlflow serve --backend-store-uri {redact_uri(tracking_uri)}`, then {serve_url}"
    return f"`mlflow ui --backend-store-uri {tracking_uri}`, then {serve_url}"


def study_pointer(tracking_uri: str, experiment: str) -> str:
    """`ui_pointer` of the study's experiment `experiment` (`study_experiment`: renamed since, too), looked up (never
    created)."""
    try:
        exp = study_experiment(mlflow_client(tracking_uri), experiment)
    except TrackingError:
        exp = None
    return ui_pointer(tracking_uri, exp.experiment_id if exp is not None else None)

