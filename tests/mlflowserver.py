"""A real MLflow tracking server for tests: `mlflow server` on 127.0.0.1 (free port), SQLite backend in a temp dir,
artifacts proxied to `s3://<bucket>/mlartifacts` on the session's moto S3 endpoint (tests/s3server.py;
`s3_endpoint` comes from tests/conftest.py).

    from tests.mlflowserver import mlflow_server  # noqa: F401  (makes the fixture visible to the module)

    def test_x(mlflow_server):
        tracker = StudyTracker(mlflow_server, "my-study")     # mlflow_server is the URL (a str)
        mlflow_server.bucket, mlflow_server.s3_endpoint, mlflow_server.backend_uri, mlflow_server.proc

One server per test session; clients need no S3 credentials (the server proxies artifacts).
"""
from __future__ import annotations

import socket

import pytest

from tests.s3server import make_bucket


class MlflowServerURL(str):
    """The server URL, with the details of the running server as attributes."""

    proc = None
    bucket = ""
    s3_endpoint = ""
    backend_uri = ""
    artifacts_destination = ""
    log_path = ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_port() -> int:
    """A loopback port with nothing listening on it (bound and released)."""
    return free_port()


_SHARED: dict[str, list] = {}  # s3 endpoint -> [server info, users]


def _start(s3_endpoint: str, root) -> MlflowServerURL:
    from dashboards.tracking import start_server

    bucket = make_bucket(s3_endpoint, "a2-mlflow-test")
    backend = f"sqlite:///{root / 'mlflow.db'}"
    dest = f"s3://{bucket}/mlartifacts"
    last_err = None
    for _ in range(3):  # a free port can be taken between the probe and the bind
        try:
            proc, url = start_server(backend, dest, free_port(), s3_endpoint_url=s3_endpoint,
                                     log_path=str(root / "server.log"), timeout=60)
            break
        except Exception as err:  # noqa: BLE001
            last_err = err
    else:
        raise RuntimeError(f"could not start mlflow server: {last_err}")
    info = MlflowServerURL(url)
    info.proc, info.bucket, info.s3_endpoint = proc, bucket, s3_endpoint
    info.backend_uri, info.artifacts_destination, info.log_path = backend, dest, str(root / "server.log")
    return info


@pytest.fixture(scope="session")
def mlflow_server(s3_endpoint, tmp_path_factory):
    """The server's URL. Test modules that import this fixture share one server per session (pytest makes
    one fixture instance per importing module; they all reuse the first server)."""
    from dashboards.tracking import stop_server

    entry = _SHARED.get(s3_endpoint)
    if entry is None or entry[0].proc.poll() is not None:
        entry = _SHARED[s3_endpoint] = [_start(s3_endpoint, tmp_path_factory.mktemp("mlflow-server")), 0]
    entry[1] += 1
    try:
        yield entry[0]
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            stop_server(entry[0].proc)
            _SHARED.pop(s3_endpoint, None)
