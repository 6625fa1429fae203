"""MLflow tracking for studies: one experiment per study, one parent run per study, one child run per trial.

Everything goes through `MlflowClient` with explicit run ids, never `mlflow.start_run`'s global active-run
state, so a long-lived Tune driver can track many trials at once.

Run layout (tags are what the rest of a2tune searches on):

    experiment  <study name>
      run  <study name>        a2.role=study  a2.study=<name>                      (parent)
        run  <trial id>        a2.role=trial  a2.study=<name>  a2.trial_id=<id>    (child, mlflow.parentRunId)

Both `start_study` and `trial_run` are idempotent: calling them again (a resumed study, a restored or retried
trial) finds the existing run by its tags, sets it RUNNING again and returns it, so a restore never duplicates
a run.

`serve` runs `mlflow server` with a database backend and proxied artifacts (local directory or any S3-compatible
bucket), bound to loopback unless told otherwise.
"""
from __future__ import annotations

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
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from a2core.errors import TrackingError

TAG_STUDY = "a2.study"
TAG_ROLE = "a2.role"
TAG_TRIAL_ID = "a2.trial_id"
TAG_FUSION = "a2.fusion"
TAG_SEED = "a2.seed"
TAG_GIT = "a2.git_commit"
TAG_BEST_CKPT = "a2.best_checkpoint"
TAG_PARENT = "mlflow.parentRunId"
TAG_RUN_NAME = "mlflow.runName"

RUN_STATUSES = ("RUNNING", "FINISHED", "FAILED", "KILLED")

# MLflow's own limits (mlflow.utils.validation).
_MAX_PARAM_VALUE = 6000
_MAX_TAG_VALUE = 8000
_MAX_KEY = 250
_BATCH_PARAMS = 100
_BATCH_METRICS = 1000

_DB_SCHEMES = {"postgresql", "postgres", "mysql", "mssql", "oracle"}
_OTHER_SCHEMES = {"databricks", "databricks-uc", "uc"}
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


def check_tracking_uri(uri: str, timeout: float = 5.0) -> str:
    """Fail fast, with the URI in the message, when `uri` cannot work. Returns the URI.

    - unknown scheme -> error;
    - http(s): one GET of `<uri>/health` (then the experiments-search endpoint) with `timeout` seconds, so an
      unreachable server fails in seconds instead of after MLflow's minutes of retries;
    - sqlite: the database file's directory must exist;
    - file / plain path: the parent directory must exist;
    - postgresql/mysql/...: a TCP connect to host:port within `timeout`.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise TrackingError(f"tracking URI {uri!r} is empty or not a string")
    uri = uri.strip()
    parsed = urllib.parse.urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme in ("http", "https"):
        _check_http(uri, parsed, timeout)
    elif scheme == "sqlite":
        _check_sqlite(uri)
    elif scheme == "file" or (scheme == "" and not uri.startswith("//")) or (len(scheme) == 1 and os.name == "nt"):
        path = Path(urllib.parse.unquote(parsed.path) if scheme == "file" else uri).expanduser()
        parent = path.parent if not path.exists() else path
        if not parent.is_dir():
            raise TrackingError(f"tracking URI {uri!r}: directory {str(parent)!r} does not exist")
    elif scheme.split("+")[0] in _DB_SCHEMES:
        if not parsed.hostname:
            raise TrackingError(f"tracking URI {uri!r}: no database host")
        default_ports = {"postgresql": 5432, "postgres": 5432, "mysql": 3306, "mssql": 1433, "oracle": 1521}
        try:
            port = parsed.port or default_ports[scheme.split("+")[0]]
        except ValueError as err:
            raise TrackingError(f"tracking URI {uri!r}: bad port ({err})") from None
        try:
            with socket.create_connection((parsed.hostname, port), timeout=timeout):
                pass
        except OSError as err:
            raise TrackingError(f"tracking URI {uri!r}: cannot connect to {parsed.hostname}:{port} ({err})") from None
    elif scheme in _OTHER_SCHEMES:
        pass  # hosted stores: their clients authenticate and report errors themselves
    else:
        raise TrackingError(
            f"tracking URI {uri!r}: unknown scheme {scheme + '://' if scheme else '(none)'}; use http(s)://host:port, "
            "sqlite:///path.db, postgresql://..., mysql://... or a local directory"
        )
    return uri


def _check_sqlite(uri: str) -> None:
    # sqlite:///relative.db, sqlite:////abs/path.db, sqlite:///:memory:
    rest = uri[len("sqlite:"):]
    if not rest.startswith("//"):
        raise TrackingError(f"tracking URI {uri!r}: expected sqlite:///path/to/file.db")
    path = rest[3:] if rest.startswith("///") else rest[2:]
    path = path.split("?", 1)[0]
    if path in ("", ":memory:"):
        return
    directory = Path(urllib.parse.unquote(path)).expanduser().parent
    if not directory.is_dir():
        raise TrackingError(f"tracking URI {uri!r}: directory {str(directory)!r} of the database does not exist")


def _auth_headers() -> dict[str, str]:
    headers = {"User-Agent": "a2tune"}
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    elif user and password:
        import base64

        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    return headers


def _check_http(uri: str, parsed, timeout: float) -> None:
    if not parsed.hostname:
        raise TrackingError(f"tracking URI {uri!r}: no host")
    try:
        parsed.port
    except ValueError as err:
        raise TrackingError(f"tracking URI {uri!r}: bad port ({err})") from None
    base = uri.rstrip("/")
    deadline = time.monotonic() + timeout
    last = None
    for path in ("/health", "/api/2.0/mlflow/experiments/search?max_results=1"):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        req = urllib.request.Request(base + path, headers=_auth_headers())
        try:
            with urllib.request.urlopen(req, timeout=left) as resp:
                if 200 <= resp.status < 300:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as err:
            if err.code in (401, 403):
                raise TrackingError(
                    f"tracking URI {uri!r}: server refused access (HTTP {err.code}); set MLFLOW_TRACKING_USERNAME/"
                    "MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN"
                ) from None
            last = f"HTTP {err.code} for {path.split('?')[0]}"
        except (urllib.error.URLError, OSError, TimeoutError) as err:
            reason = getattr(err, "reason", err)
            raise TrackingError(f"tracking URI {uri!r}: MLflow server unreachable ({reason})") from None
    raise TrackingError(f"tracking URI {uri!r}: does not answer like an MLflow server ({last or 'timed out'})")


# -- helpers ---------------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
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


def _flatten(config: dict) -> dict[str, Any]:
    from a2core.config import flatten

    if hasattr(config, "to_dict"):
        config = config.to_dict()
    return flatten(dict(config or {}))


def _param_value(value: Any) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, tuple, dict)):
        text = json.dumps(value, default=str, sort_keys=isinstance(value, dict))
    else:
        text = str(value)
    return text[:_MAX_PARAM_VALUE]


def _clean_key(key: str) -> str:
    key = _BAD_NAME_CHARS.sub("_", str(key))
    return key[:_MAX_KEY]


def _quote(value: str) -> str:
    """A value for an MLflow search filter string (single-quoted)."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _numeric(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        # numpy 0-d arrays / torch scalars expose .item()
        item = getattr(value, "item", None)
        if item is None or isinstance(value, (str, bytes)):
            return None
        try:
            value = item()
        except Exception:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None
    return float(value)


def _chunks(items: list, n: int) -> Iterable[list]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def config_value(config: dict, *keys: str) -> Any:
    """First of `keys` (dotted paths like "model.fusion", or plain names) found in a nested or flat config."""
    flat = _flatten(config)
    for key in keys:
        if key in flat:
            return flat[key]
    return None


# MLflow's REST client retries a refused or slow request for minutes by default (timeout 120 s, 7 retries with
# backoff); a study's tracking thread spools instead, so one short try is enough. Read per request by MLflow.
CLIENT_SETTINGS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}


def client_settings() -> None:
    """Short MLflow HTTP timeouts in this process, unless the environment sets its own."""
    for key, value in CLIENT_SETTINGS.items():
        os.environ.setdefault(key, value)


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


# The experiment page of MLflow 3 opens on its GenAI overview and nests child runs under the (metric-less)
# parent run. A shared view stored as an experiment tag gives a study a useful landing page instead: trials
# flattened and sorted by val/CIDEr, with the key metrics and searched params as columns (see `view_url`).
VIEW_KEY = "a2"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
VIEW_METRICS = ("val/CIDEr", "val/BLEU-4", "val/METEOR", "train/loss", "train/mask_mean")
VIEW_PARAMS = ("model.fusion", "model.lambda", "model.temperature", "train.seed")


def default_view_state(metric: str = "val/CIDEr") -> dict:
    metrics = [metric] + [m for m in VIEW_METRICS if m != metric]
    return {"orderByKey": f"metrics.`{metric}`", "orderByAsc": False,
            "selectedColumns": ["attributes.`Run Name`"] + [f"metrics.`{m}`" for m in metrics]
            + [f"params.`{p}`" for p in VIEW_PARAMS]}


def _get_or_create_experiment(client, name: str, artifact_location: str | None = None) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location,
                                            tags={TAG_STUDY: name, VIEW_TAG: json.dumps(default_view_state())})
        except MlflowException:  # created concurrently by another process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    if VIEW_TAG not in exp.tags:
        client.set_experiment_tag(exp.experiment_id, VIEW_TAG, json.dumps(default_view_state()))
    return exp.experiment_id


def view_url(tracking_uri: str, experiment_id: str) -> str | None:
    """The study's runs in the MLflow UI (the a2 view: trials sorted by val/CIDEr); None without a server."""
    if not tracking_uri.lower().startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={VIEW_KEY}"


def _search_all(client, experiment_ids: list[str], filter_string: str, order_by=None) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string=filter_string, max_results=1000,
                                  order_by=order_by or ["attributes.start_time ASC"], page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


# -- the tracker -----------------------------------------------------------------------------------------------
class StudyTracker:
    """MLflow runs of one study. Safe to use from a long-lived process (no global MLflow state)."""

    def __init__(self, tracking_uri: str, study_name: str, experiment: str | None = None,
                 artifact_location: str | None = None):
        """`artifact_location` applies when the experiment is created: where a database backend without a
        server keeps artifacts (default: MLflow's, ./mlruns under the working directory; a server decides
        itself)."""
        self.tracking_uri = tracking_uri
        self.study_name = study_name
        self.experiment_name = experiment or study_name
        self.artifact_location = artifact_location
        self.client = _client(tracking_uri)
        self._experiment_id: str | None = None
        self.parent_run_id: str | None = None
        self.trial_runs: dict[str, str] = {}

    # pickling (Ray callbacks are pickled with the Tuner): drop the client, rebuild it lazily
    def __getstate__(self):
        state = self.__dict__.copy()
        state["client"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.client = _client(self.tracking_uri)

    def view_url(self) -> str | None:
        """Where to look at the study in the MLflow UI (None for a database URI without a server)."""
        return view_url(self.tracking_uri, self.experiment_id)

    @property
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            self._experiment_id = _get_or_create_experiment(self.client, self.experiment_name,
                                                            self.artifact_location)
        return self._experiment_id

    # -- study (parent) --------------------------------------------------------------------------------------
    def find_parent_run(self):
        runs = _search_all(self.client, [self.experiment_id],
                           f"tags.`{TAG_ROLE}` = 'study' and tags.`{TAG_STUDY}` = {_quote(self.study_name)}")
        return runs[0] if runs else None

    def start_study(self, params: dict | None = None, tags: dict | None = None) -> str:
        """Create the study's parent run, or reuse it (resume) and set it RUNNING again. Returns its id."""
        run = self.find_parent_run()
        all_tags = {TAG_STUDY: self.study_name, TAG_ROLE: "study", TAG_GIT: git_commit()}
        all_tags.update({k: str(v) for k, v in (tags or {}).items()})
        if run is None:
            run = self.client.create_run(self.experiment_id, run_name=self.study_name,
                                         tags={k: str(v)[:_MAX_TAG_VALUE] for k, v in all_tags.items()})
            existing = {}
        else:
            if run.info.status != "RUNNING":
                self.client.update_run(run.info.run_id, status="RUNNING")
            existing = run.data.params
        self.parent_run_id = run.info.run_id
        self._log_params(self.parent_run_id, _flatten(params or {}), existing)
        self._set_tags(self.parent_run_id, all_tags)
        return self.parent_run_id

    def end_study(self, status: str = "FINISHED") -> None:
        if self.parent_run_id is None:
            run = self.find_parent_run()
            if run is None:
                return
            self.parent_run_id = run.info.run_id
        self.client.set_terminated(self.parent_run_id, status=_status(status))

    # -- trials (children) -----------------------------------------------------------------------------------
    def find_trial_run(self, trial_id: str):
        if self.parent_run_id is None:
            return None
        runs = _search_all(self.client, [self.experiment_id],
                           f"tags.`{TAG_PARENT}` = {_quote(self.parent_run_id)} and "
                           f"tags.`{TAG_TRIAL_ID}` = {_quote(trial_id)}")
        return runs[0] if runs else None

    def trial_run(self, trial_id: str, config: dict | None = None, tags: dict | None = None,
                  run_name: str | None = None) -> str:
        """The child run of `trial_id`: the existing one (set RUNNING again) or a new one. Returns its id.

        A new run gets the flattened config as params and the tags study, trial id, fusion, seed, git commit.
        """
        trial_id = str(trial_id)
        if self.parent_run_id is None:
            self.start_study()
        from a2core.config import applicable_config

        # a parameter its fusion does not use is absent from the run, not logged at its default
        config = applicable_config(config.to_dict() if hasattr(config, "to_dict") else dict(config or {}))
        run = None
        known = self.trial_runs.get(trial_id)
        if known is not None:
            try:
                run = self.client.get_run(known)
                if run.info.lifecycle_stage == "deleted":
                    run = None
            except Exception:
                run = None
        if run is None:
            run = self.find_trial_run(trial_id)
        fusion = config_value(config, "model.fusion", "fusion")
        seed = config_value(config, "train.seed", "seed")
        all_tags = {TAG_STUDY: self.study_name, TAG_ROLE: "trial", TAG_TRIAL_ID: trial_id,
                    TAG_PARENT: self.parent_run_id, TAG_GIT: git_commit()}
        if all_tags[TAG_GIT] != "unknown":
            all_tags["mlflow.source.git.commit"] = all_tags[TAG_GIT]
        if fusion is not None:
            all_tags[TAG_FUSION] = str(fusion)
        if seed is not None:
            all_tags[TAG_SEED] = str(seed)
        extra = {k: str(v) for k, v in (tags or {}).items()}
        if run is None:
            all_tags.update(extra)
            run = self.client.create_run(self.experiment_id, run_name=run_name or trial_id,
                                         tags={k: v[:_MAX_TAG_VALUE] for k, v in all_tags.items()})
            self._log_params(run.info.run_id, _flatten(config), {})
        else:
            if run.info.status != "RUNNING":
                self.client.update_run(run.info.run_id, status="RUNNING")
            # like its params, a run keeps the tags it was created with; only the caller's tags are updated
            self._log_params(run.info.run_id, _flatten(config), run.data.params)
            update = {k: v for k, v in all_tags.items() if k not in run.data.tags}
            update.update({k: v for k, v in extra.items() if run.data.tags.get(k) != v})
            if update:
                self._set_tags(run.info.run_id, update)
        self.trial_runs[trial_id] = run.info.run_id
        return run.info.run_id

    def end_trial(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=_status(status))

    # -- logging ---------------------------------------------------------------------------------------------
    def log_metrics(self, run_id: str, metrics: dict, step: int, timestamp_ms: int | None = None) -> dict[str, float]:
        """Log the numeric values of `metrics` at the explicit `step`; strings and the like are skipped.

        `timestamp_ms` (default: now) is the result's own time: logging the same result again is then a no-op
        (MLflow keeps one row per key, step, timestamp and value). Returns what was logged."""
        from mlflow.entities import Metric

        ts = int(timestamp_ms) if timestamp_ms is not None else int(time.time() * 1000)
        logged: dict[str, float] = {}
        for key, value in (metrics or {}).items():
            num = _numeric(value)
            if num is None:
                continue
            logged[_clean_key(key)] = num
        entries = [Metric(k, v, ts, int(step)) for k, v in logged.items()]
        for chunk in _chunks(entries, _BATCH_METRICS):
            self.client.log_batch(run_id, metrics=chunk)
        return logged

    def logged_steps(self, run_id: str, key: str) -> set[int]:
        """The steps at which metric `key` of a run has values."""
        return {int(m.step) for m in self.client.get_metric_history(run_id, _clean_key(key))}

    def set_tags(self, run_id: str, tags: dict) -> None:
        self._set_tags(run_id, tags)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_dict(self, run_id: str, dictionary: dict, artifact_file: str) -> None:
        self.client.log_dict(run_id, dictionary, artifact_file)

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(local_path), artifact_path)

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(run_id, str(local_dir), artifact_path)

    def set_best_checkpoint(self, run_id: str, uri: str) -> None:
        """Record the best checkpoint's location as the tag `a2.best_checkpoint`. A tag, not a param: it
        changes during training, and MLflow params cannot be changed once logged."""
        self.client.set_tag(run_id, TAG_BEST_CKPT, str(uri)[:_MAX_TAG_VALUE])

    # -- internals -------------------------------------------------------------------------------------------
    def _log_params(self, run_id: str, flat: dict, existing: dict) -> None:
        from mlflow.entities import Param

        new = []
        for key, value in flat.items():
            k, v = _clean_key(key), _param_value(value)
            if k in existing:
                continue  # immutable; a resumed run keeps its first values
            new.append(Param(k, v))
        for chunk in _chunks(new, _BATCH_PARAMS):
            self.client.log_batch(run_id, params=chunk)

    def _set_tags(self, run_id: str, tags: dict) -> None:
        from mlflow.entities import RunTag

        entries = [RunTag(str(k)[:_MAX_KEY], str(v)[:_MAX_TAG_VALUE]) for k, v in tags.items()]
        for chunk in _chunks(entries, _BATCH_PARAMS):
            self.client.log_batch(run_id, tags=chunk)


def _status(status: str) -> str:
    status = str(status).upper()
    if status not in RUN_STATUSES:
        raise ValueError(f"run status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
    return status


def study_runs(tracking_uri: str, study_name: str, experiment: str | None = None):
    """(parent_run, [child runs]) of a study, oldest first; parent_run is None when the study has no run.

    Looks in the experiment named `experiment` (default: the study name), else in every experiment."""
    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment or study_name)
    if exp is not None:
        exp_ids = [exp.experiment_id]
    else:
        exp_ids = [e.experiment_id for e in client.search_experiments()]
    if not exp_ids:
        return None, []
    parents = []
    for chunk in _chunks(exp_ids, 100):
        parents += _search_all(client, chunk,
                               f"tags.`{TAG_ROLE}` = 'study' and tags.`{TAG_STUDY}` = {_quote(study_name)}")
    if not parents:
        return None, []
    parent = parents[0]
    children = _search_all(client, [parent.info.experiment_id],
                           f"tags.`{TAG_PARENT}` = {_quote(parent.info.run_id)}")
    return parent, children


# -- the server ------------------------------------------------------------------------------------------------
def server_command(backend_uri: str, artifacts_destination: str | None, port: int, host: str = "127.0.0.1",
                   workers: int = 1) -> list[str]:
    return [sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", backend_uri,
            "--artifacts-destination", artifacts_destination or "./mlartifacts",
            "--serve-artifacts",
            "--host", host, "--port", str(int(port)), "--workers", str(int(workers))]


def server_env(s3_endpoint_url: str | None) -> dict[str, str]:
    env = dict(os.environ)
    # MLflow's GenAI job runner (extra processes, slower start) is not used by a2tune; opt back in via the env.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    if s3_endpoint_url:
        env["MLFLOW_S3_ENDPOINT_URL"] = s3_endpoint_url
    return env


def server_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{int(port)}"


def serve(args) -> int:
    """`a2 mlflow serve`: this process becomes `mlflow server` (its CLI stops its web server on SIGINT/SIGTERM)."""
    backend = args.backend_store_uri
    if not re.match(r"^(sqlite|postgresql|postgres|mysql|mssql)(\+\w+)?://", backend or ""):
        raise TrackingError(f"--backend-store-uri {backend!r}: use sqlite:///path.db or postgresql://user@host/db")
    if backend.startswith("sqlite:"):
        _check_sqlite(backend)
    dest = args.artifacts_destination or "./mlartifacts"
    url = server_url(args.host, args.port)
    print(f"MLflow server: {url}  (backend {redact_uri(backend)}, artifacts {dest}"
          + (f" via {args.s3_endpoint_url}" if args.s3_endpoint_url else "") + ")", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"bound to {args.host}: reachable from other machines; restrict with a firewall or a proxy", flush=True)
    print(f"clients: export MLFLOW_TRACKING_URI={url}", flush=True)
    cmd = server_command(backend, dest, args.port, args.host, args.workers)
    os.execve(cmd[0], cmd, server_env(args.s3_endpoint_url))
