"""The team's MLflow tracking server (`a2 mlflow serve`, `launch.commands.serve`): this process becomes `mlflow server`
over a database, artifacts served through it, after printing where each study's trials open."""
from __future__ import annotations

import os
import sys

from a2core.errors import TrackingError
from dashboards.mlflow_views import ui_url
from dashboards.tracking import DEFAULT_PORT, SERVABLE_DB_URI, TAG_STUDY, check_sqlite_uri, mlflow_client, redact_uri


def _study_urls(backend: str, server: str, limit: int = 10) -> list[str]:
    """"study NAME: URL" of the (at most `limit` most recently updated) study experiments of a backend store."""
    experiments = mlflow_client(backend).search_experiments(filter_string=f"tags.`{TAG_STUDY}` LIKE '%'",
                                                            max_results=limit, order_by=["last_update_time DESC"])
    return [f"  study {exp.tags.get(TAG_STUDY, exp.name)}: {ui_url(server, exp.experiment_id)}" for exp in experiments]


def serve(backend: str, artifacts_destination: str | None = None, s3_endpoint_url: str | None = None,
          host: str = "127.0.0.1", port: int = DEFAULT_PORT, workers: int = 1) -> int:
    """This process becomes `mlflow server` on the database `backend` (its CLI stops its web server on SIGINT and
    SIGTERM); artifacts go to `artifacts_destination` (default ./mlartifacts), on S3 through `s3_endpoint_url`."""
    if not SERVABLE_DB_URI.match(backend or ""):
        raise TrackingError(f"--backend-store-uri {backend!r}: use sqlite:///path.db or postgresql://user@host/db")
    if backend.startswith("sqlite:"):
        check_sqlite_uri(backend)
    dest = artifacts_destination or "./mlartifacts"
    shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    if ":" in shown and not shown.startswith("["):  # an IPv6 address
        shown = f"[{shown}]"
    url = f"http://{shown}:{int(port)}"
    print(f"MLflow server: {url}  (backend {redact_uri(backend)}, artifacts {dest}"
          + (f" via {s3_endpoint_url}" if s3_endpoint_url else "") + ")", flush=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"bound to {host}: reachable from other machines; restrict with a firewall or a proxy", flush=True)
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
    if s3_endpoint_url:
        env["MLFLOW_S3_ENDPOINT_URL"] = s3_endpoint_url
    if backend.startswith("postgresql"):
        # SQLAlchemy's default pool (5 + 10 overflow a worker, 30 s to wait for one) is fewer connections than a
        # worker's request threads: 32 trials logging at once on a busy host waited past 30 s and got "QueuePool
        # limit ... reached" as BAD_REQUEST. Up to 40 a worker, the workers together within 90 of PostgreSQL's
        # default max_connections of 100 (never fewer than SQLAlchemy's 15); the environment's own values win.
        connections = min(40, max(15, 90 // max(1, int(workers))))
        env.setdefault("MLFLOW_SQLALCHEMYSTORE_POOL_SIZE", "10")
        env.setdefault("MLFLOW_SQLALCHEMYSTORE_MAX_OVERFLOW", str(connections - 10))
    os.execve(sys.executable, [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend,
                               "--artifacts-destination", dest, "--serve-artifacts", "--host", host,
                               "--port", str(int(port)), "--workers", str(int(workers))], env)
