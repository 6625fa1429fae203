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

import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from a2core.errors import TrackingError
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


# -- starting and stopping `mlflow server` -------------------------------------------------------------------------
def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM the server when the process that started it dies, even by SIGKILL (mlflow's CLI
    forwards SIGTERM to its web server)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _popen_kwargs() -> dict:
    kwargs: dict[str, Any] = {"start_new_session": True}
    if sys.platform.startswith("linux"):
        kwargs["preexec_fn"] = _die_with_parent
    return kwargs


def wait_healthy(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise TrackingError(f"MLflow server at {url} exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            # HTTPException: something else answers on the port (another process took it between `free_port` and
            # the server's bind; seen: a gRPC port of a Ray node shutting down): the server exits, said above
            pass
        if time.monotonic() > deadline:
            raise TrackingError(f"MLflow server at {url} not healthy after {timeout:.0f} s")
        time.sleep(0.25)


def start_server(backend_uri: str, artifacts_destination: str | None, port: int, s3_endpoint_url: str | None = None,
                 host: str = "127.0.0.1", workers: int = 1, log_path: str | None = None,
                 timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start `a2 mlflow serve` in its own process group and wait until `/health` answers (up to `timeout` s).

    Returns (process, url). Stop it with `stop_server(process)` (kills the whole group: mlflow's CLI starts the
    web server as a child). Output goes to `log_path` (default: a temporary file, path in `process.log_path`).
    """
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="mlflow-server-", suffix=".log")
        os.close(fd)
    log = open(log_path, "ab")
    try:
        options = {"--artifacts-destination": artifacts_destination, "--s3-endpoint-url": s3_endpoint_url,
                   "--backend-store-uri": backend_uri, "--host": host, "--port": port, "--workers": workers}
        command = [sys.executable, "-m", "launch.cli", "mlflow", "serve"]
        command += [str(part) for option, value in options.items() if value is not None for part in (option, value)]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                **_popen_kwargs())
    finally:
        log.close()
    proc.log_path = log_path  # type: ignore[attr-defined]
    url = f"http://{host}:{port}"
    try:
        wait_healthy(url, timeout=timeout, proc=proc)
    except TrackingError as err:
        stop_server(proc)
        tail = Path(log_path).read_text(errors="replace")[-3000:]
        raise TrackingError(f"{err}\n--- server log ({log_path}) ---\n{tail}") from None
    return proc, url


def stop_server(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """SIGTERM the server's process group, SIGKILL it after `timeout` s."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        if pgid is not None:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        elif proc.poll() is None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=wait)
            if pgid is not None:
                try:  # the group may outlive its leader for a moment
                    os.killpg(pgid, 0)
                    time.sleep(0.2)
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return proc.returncode
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


class RestartableServer:
    """`mlflow server` on a SQLite backend and local artifacts, which a test can stop and start again on the same
    port and backend (a tracking server going down and coming back).

        server = RestartableServer(tmp_path); server.start(); ...; server.stop(); server.start(); server.stop()
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.backend_uri = f"sqlite:///{self.root / 'mlflow.db'}"
        self.artifacts = str(self.root / "mlartifacts")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.started = False

    def start(self, timeout: float = 90.0) -> str:
        for attempt in range(3 if self.proc is None and not self.started else 1):
            try:
                self.proc, _ = start_server(self.backend_uri, self.artifacts, self.port,
                                            log_path=str(self.root / "server.log"), timeout=timeout)
                break
            except TrackingError:
                if attempt == 2 or self.started:
                    raise
                # its first start only (a restart must keep the port): the port was taken since `free_port`
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        self.started = True
        return self.url

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)
            self.proc = None
