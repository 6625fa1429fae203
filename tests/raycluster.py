"""Real Ray clusters and tiny studies for the orchestration tests.

- `LocalCluster` starts `ray start` nodes on this machine (below); the `ray_cluster_factory` fixture gives started
  clusters and stops every node of them afterwards.
- `tiny_study(...)` writes a study file that trains in seconds on 2 cores (synthetic data, 1-layer d_model 32).
- `a2(...)` / `start_a2(...)` run the real `a2` CLI in a subprocess (`python -m launch.cli`).
- `mlflow_history(...)` and `snapshot_epochs(...)` read what a study left in MLflow and in Ray Train's storage.

`LocalCluster` starts real `ray start` nodes on 127.0.0.1, each in its own process group and temp dir, with every
port chosen free (so clusters of different users on one machine do not collide). Tests and benchmarks use it to
kill and replace nodes:

    with LocalCluster(num_cpus=1, dashboard=True) as cluster:
        node = cluster.add_node(num_cpus=2, resources={"node_b": 1})
        subprocess.run(["a2", "study", "run", ...], env=cluster.env())
        cluster.kill_node(node)

Ray 2.60 turns token authentication on for `ray start`. A cluster here writes its own token file and starts every
node, and hands every client (`env()`), `RAY_AUTH_MODE=token` with `RAY_AUTH_TOKEN_PATH` pointing at it, so nodes
and clients always agree. `auth=False` runs the cluster with `RAY_AUTH_MODE=disabled` instead.

The dashboard is on by default: besides the Jobs API, Ray Train 2.60 needs its state API to release the
placement group of a Train controller that died with a node (`PlacementGroupCleaner`); without it, the workers of
a retried trial wait forever for CPUs that the dead run still holds.

Nodes are stopped by signalling their own process groups; `ray stop` is never used because it stops every Ray
process of the machine, including clusters that are not ours.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml


REPO = Path(__file__).resolve().parents[1]
AUTH_ENV_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
DATA_IMAGES = 200


# -- data and study files ----------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The synthetic dataset of the tiny studies, generated once per session."""
    from a2core.data.synthetic import ensure

    root = tmp_path_factory.mktemp("a2data") / f"synthetic-{DATA_IMAGES}"
    ensure(root, seed=0, images=DATA_IMAGES)
    return root


def tiny_study(directory: Path, name: str, data_root: Path, *, fusions=("max",), seeds=(0,), epochs: int = 3,
               workers: int = 2, cpus_per_worker: float = 0.5, max_concurrent: int = 1, max_failures: int = 1,
               storage: Path | None = None, mlflow_uri: str | None = None, extra: dict | None = None,
               new_store: bool = False) -> Path:
    """Write a study that trains a tiny A2 model on 2 CPU cores; returns the file. Its MLflow store (`mlflow_uri`, else
    `directory/mlflow.db`) is a copy of `empty_mlflow_store` unless `new_store`: the driver then makes it itself."""
    raw = {
        "name": name,
        "data": {"kind": "synthetic", "seed": 0, "images": DATA_IMAGES, "root": str(data_root), "val_images": 20},
        "model": {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "max_regions": 8},
        "train": {"xe_epochs": epochs, "scst_epochs": 0, "batch_size": 100 * workers, "warmup": 50,
                  "log_every": 1000,  # 20 images per worker and step
                  "test_meteor": False},  # a Java process of ~4 s per rank and trial (tests/test_train.py scores it)
        "search": {"metric": "val/CIDEr", "mode": "max", "algorithm": "grid", "purpose": "explore",  # claims nothing
                   "space": {"fusion": {"grid": list(fusions)}, "seed": {"grid": list(seeds)}}},
        "resources": {"workers_per_trial": workers, "cpus_per_worker": cpus_per_worker,
                      "max_concurrent_trials": max_concurrent, "max_failures": max_failures},
        "tracking": {"mlflow_uri": mlflow_uri or f"sqlite:///{directory / 'mlflow.db'}"},
        "storage": str(storage or directory / "studies"),
    }
    for key, value in (extra or {}).items():
        node = raw
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    if mlflow_uri is None and not new_store and not (directory / "mlflow.db").exists():
        shutil.copyfile(empty_mlflow_store(), directory / "mlflow.db")
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@functools.lru_cache(maxsize=None)
def empty_mlflow_store() -> Path:
    """An empty SQLite MLflow store with MLflow's tables made, once per session: a tiny study's driver then opens its
    store in a tenth of a second instead of making the tables (4.4 s on a 2-core AMD EPYC). A driver makes a new store
    in the tutorial's study, the first-hour test's and `tiny_study(..., new_store=True)`."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    folder = Path(tempfile.mkdtemp(prefix="a2-mlflow-store-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    store = SqlAlchemyStore(f"sqlite:///{folder / 'mlflow.db'}", str(folder / "mlruns"))
    store.engine.dispose()
    return folder / "mlflow.db"


# -- clusters ------------------------------------------------------------------------------------------------------
@pytest.fixture
def ray_cluster_factory():
    """`make(num_cpus=1, resources=None, dashboard=True) -> LocalCluster` (started); all stopped afterwards."""
    clusters: list[LocalCluster] = []

    def make(num_cpus: float = 1, resources: dict | None = None, dashboard: bool = True) -> LocalCluster:
        cluster = LocalCluster(num_cpus=num_cpus, resources=resources, dashboard=dashboard)
        clusters.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


# -- the a2 command --------------------------------------------------------------------------------------------------
def a2_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *args]


def a2_env(base: dict | None = None, **extra: str) -> dict:
    env = dict(os.environ if base is None else base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([str(REPO)] if str(REPO) not in paths else []))
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def a2(*args: str, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `a2 ARGS` to its end; stdout and stderr together in `.stdout`."""
    return subprocess.run(a2_command(*args), cwd=cwd, env=a2_env(env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def start_a2(*args: str, cwd: Path, log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start `a2 ARGS` in its own process group (so it and the local Ray it starts can be killed together)."""
    with open(log, "wb") as out:
        return subprocess.Popen(a2_command(*args), cwd=cwd, env=a2_env(env), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Kill a process started by `start_a2` and everything left of its session (the local Ray it started)."""
    kill_session(proc.pid, sig)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def wait_for(predicate: Callable[[], object], timeout: float, what: str, *, proc: subprocess.Popen | None = None,
             log: Path | None = None, interval: float = 0.3):
    """Poll `predicate` until it returns something truthy; fail with the log tail on timeout or if `proc` ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"process ended (rc {proc.returncode}) while waiting for {what}\n{tail(log)}")
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{tail(log)}")


def tail(log: Path | None, lines: int = 60) -> str:
    if log is None or not Path(log).exists():
        return ""
    text = Path(log).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


# -- what a study left behind ----------------------------------------------------------------------------------------
def trial_runs(storage: Path, study: str) -> dict[str, Path]:
    """Ray Train run folders of a study: {trial id: folder}."""
    base = Path(storage) / study / "trials"
    if not base.is_dir():
        return {}
    return {p.name[len(study) + 1:]: p for p in sorted(base.iterdir()) if p.is_dir()}


def snapshot_epochs(run_dir: Path) -> list[int]:
    """Epochs of the checkpoints that Ray Train registered for a trial (its resume points)."""
    snap = Path(run_dir) / "checkpoint_manager_snapshot.json"
    try:
        state = json.loads(snap.read_text())
    except (OSError, ValueError):
        return []
    out = []
    for item in state.get("checkpoint_results", []):
        epoch = (item.get("metrics") or {}).get("epoch")
        if isinstance(epoch, (int, float)):
            out.append(int(epoch))
    return sorted(out)


@functools.lru_cache(maxsize=None)
def mlflow_client(uri: str):
    """One client per store: making one opens (and checks) the database, far slower than a query."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def mlflow_trials(uri: str, study: str) -> dict[str, object]:
    """The study's trial runs (children of its parent run): {trial id: run}. Empty before the study has any."""
    from dashboards.tracking import TAG_ROLE, TAG_STUDY, TAG_TRIAL_ID

    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(study)
    if exp is None:
        return {}
    runs = client.search_runs([exp.experiment_id], f"tags.`{TAG_ROLE}` = 'trial' and tags.`{TAG_STUDY}` = '{study}'",
                              max_results=1000)
    return {r.data.tags.get(TAG_TRIAL_ID): r for r in runs}


def mlflow_history(uri: str, run_id: str, metric: str = "val/CIDEr") -> list[tuple[int, float, int]]:
    """[(step, value, timestamp ms)] of one metric, in logging order."""
    hist = mlflow_client(uri).get_metric_history(run_id, metric)
    return [(m.step, m.value, m.timestamp) for m in sorted(hist, key=lambda m: (m.timestamp, m.step))]


# -- S3 storage on the test endpoint -----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def arrow_s3_compatible_moto():
    """Let pyarrow (which Ray uses for storage) write objects to the in-process moto server
    (`patch_moto_for_arrow`) while the test runs."""
    import moto.s3.responses as responses

    original = patch_moto_for_arrow()
    yield
    responses.S3Response.serialized = original


def patch_moto_for_arrow():
    """moto 5.2.1 answers CompleteMultipartUpload with the wrong XML root element (getmoto/moto#10055); the AWS SDK
    for C++ inside pyarrow then reports INTERNAL_FAILURE for every object it writes. Rename the root element to
    what S3 sends (`CompleteMultipartUploadResult`) in this process's moto; a fixed moto is left untouched. Returns
    the unpatched method. (benchmarks/bench_read.py's moto server process runs this first.)"""
    import re

    import moto.s3.responses as responses

    original = responses.S3Response.serialized

    def serialized(self, *args, **kwargs):
        status, headers, body = original(self, *args, **kwargs)
        if getattr(self, "data", {}).get("Action") == "CompleteMultipartUpload" and isinstance(body, (str, bytes)):
            text = body.decode() if isinstance(body, bytes) else body
            match = re.search(r"<([A-Za-z]+)[\s>]", text[text.find("?>") + 2 if "?>" in text else 0:])
            if match and match.group(1) != "CompleteMultipartUploadResult":
                wrong = match.group(1)
                text = text.replace(f"<{wrong}", "<CompleteMultipartUploadResult", 1)
                text = text.replace(f"</{wrong}>", "</CompleteMultipartUploadResult>", 1)
                body = text.encode() if isinstance(body, bytes) else text
        return status, headers, body

    responses.S3Response.serialized = serialized
    return original


# -- local multi-node Ray clusters ------------------------------------------------------------------------------
_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port on 127.0.0.1 not handed out before by this process: the kernel may offer a port again once the
    probing socket is closed, and `ray start` refuses a node whose components were given the same port."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


@dataclass
class RayNode:
    name: str
    num_cpus: float
    resources: dict
    temp_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = None
    head: bool = False
    ports: dict = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class LocalCluster:
    """A Ray cluster of `ray start` processes on 127.0.0.1 (a head plus any number of worker nodes)."""

    def __init__(self, num_cpus: float = 1, resources: dict | None = None, *, dashboard: bool = True,
                 auth: bool = True, root: str | Path | None = None, object_store_mb: int = 150,
                 start_timeout_s: float = 90.0, keep_root: bool = False, fast_failure_detection: bool = True):
        self.head_cpus, self.head_resources = num_cpus, dict(resources or {})
        self.dashboard, self.auth = dashboard, auth
        self.object_store_bytes = int(object_store_mb) * 1024 * 1024
        self.start_timeout_s = start_timeout_s
        self._own_root = root is None
        # Short paths: Ray puts unix sockets below the temp dir, and socket paths are limited to 107 bytes.
        self.root = Path(root or tempfile.mkdtemp(prefix="a2rc-", dir="/tmp"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_root = keep_root
        self.nodes: list[RayNode] = []
        self.port = free_port()
        self.dashboard_port = free_port() if dashboard else None
        # The GCS declares a silent node dead after period * threshold; Ray's defaults take about 30 s.
        self.system_env = ({"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
                            "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
                           if fast_failure_detection else {})
        self.token_path = self.root / "auth_token"
        if auth:
            self.token_path.write_text(secrets.token_hex(32))
            os.chmod(self.token_path, 0o600)

    # -- addresses and client environment ------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard_url(self) -> str:
        if not self.dashboard_port:
            raise RuntimeError("this cluster was started without a dashboard")
        return f"http://127.0.0.1:{self.dashboard_port}"

    def auth_env(self) -> dict:
        if self.auth:
            return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}
        return {"RAY_AUTH_MODE": "disabled"}

    def env(self, base: dict | None = None, *, address: bool = True) -> dict:
        """Environment for a client process of this cluster (a driver, `ray job submit`, `a2 study run`)."""
        env = dict(os.environ if base is None else base)
        for key in AUTH_ENV_VARS:
            env.pop(key, None)
        env.update(self.auth_env())
        if address:
            env["RAY_ADDRESS"] = self.address
        else:
            env.pop("RAY_ADDRESS", None)
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        return env

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> RayNode:
        if self.nodes:
            return self.nodes[0]
        try:
            return self._start_node("head", self.head_cpus, self.head_resources, head=True)
        except BaseException:
            self.stop()
            raise

    def add_node(self, num_cpus: float = 1, resources: dict | None = None, name: str | None = None,
                 wait: bool = True, wrapper: list[str] | None = None) -> RayNode:
        """`wrapper`: a command that runs `ray start ...` (its arguments follow), e.g. one that gives the node a
        file system view of its own (`unshare --mount` with a bind mount: a machine with other files)."""
        if not self.nodes:
            raise RuntimeError("start the head node first")
        return self._start_node(name or f"node{len(self.nodes)}", num_cpus, dict(resources or {}), wait=wait,
                                wrapper=wrapper)

    def kill_node(self, node: RayNode | str, sig: int = signal.SIGKILL, wait_s: float = 10.0) -> None:
        """Kill every process of one node at once (raylet, its workers, agents): a machine that disappears."""
        node = self._node(node)
        if node.proc is None:
            return
        _signal_group(node.pgid, sig)
        try:
            node.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            _signal_group(node.pgid, signal.SIGKILL)
            node.proc.wait(timeout=wait_s)
        _reap_group(node.pgid, wait_s)

    def stop(self) -> None:
        """Stop worker nodes first, then the head; remove the temp dirs we created.

        The head is killed outright: a clean `ray start --block` head shutdown takes about 30 s and buys nothing
        for a throw-away cluster."""
        for node in reversed(self.nodes):
            if node.proc is None:
                continue
            if node.alive and not node.head:  # a worker node shuts down cleanly in about a second
                _signal_group(node.pgid, signal.SIGTERM)
                try:
                    node.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            _signal_group(node.pgid, signal.SIGKILL)
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            _reap_group(node.pgid, 5.0)
        if self._own_root and not self.keep_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def wait_for_nodes(self, count: int, timeout_s: float = 60.0) -> list[dict]:
        """Block until `count` nodes are alive in the cluster (asked through the `ray` CLI's state API)."""
        deadline = time.monotonic() + timeout_s
        alive: list[dict] = []
        while time.monotonic() < deadline:
            alive = [n for n in self.list_nodes() if n.get("state") == "ALIVE"]
            if len(alive) >= count:
                return alive
            time.sleep(0.5)
        raise TimeoutError(f"{len(alive)} of {count} Ray nodes alive after {timeout_s:.0f}s")

    def list_nodes(self) -> list[dict]:
        code = ("import json, ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
                "print('A2NODES=' + json.dumps([{'node_id': n['NodeID'], 'state': 'ALIVE' if n['Alive'] else 'DEAD', "
                "'resources': n['Resources']} for n in ray.nodes()]), flush=True)") % self.address
        out = subprocess.run([sys.executable, "-c", code], env=self.env(address=False), capture_output=True,
                             text=True, timeout=60)
        for line in out.stdout.splitlines():
            if line.startswith("A2NODES="):
                return json.loads(line[len("A2NODES="):])
        return []

    def logs(self, node: RayNode | str, tail: int = 60) -> str:
        node = self._node(node)
        try:
            return "\n".join(node.log_path.read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return ""

    # -- internals -----------------------------------------------------------------------------------------------
    def _node(self, node: RayNode | str) -> RayNode:
        if isinstance(node, RayNode):
            return node
        for n in self.nodes:
            if n.name == node:
                return n
        raise KeyError(node)

    def _start_node(self, name: str, num_cpus: float, resources: dict, *, head: bool = False,
                    wait: bool = True, wrapper: list[str] | None = None) -> RayNode:
        temp_dir = self.root / name
        if temp_dir.exists():  # a replacement node of the same name starts clean
            temp_dir = self.root / f"{name}-{len(self.nodes)}"
        temp_dir.mkdir(parents=True)
        ports = {"--node-manager-port": free_port(), "--object-manager-port": free_port(),
                 "--dashboard-agent-listen-port": free_port(), "--dashboard-agent-grpc-port": free_port(),
                 "--runtime-env-agent-port": free_port(), "--metrics-export-port": free_port()}
        cmd = [shutil.which("ray") or "ray", "start", "--block", "--disable-usage-stats",
               "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus:g}" if isinstance(num_cpus, float)
               else f"--num-cpus={num_cpus}", "--num-gpus=0", f"--temp-dir={temp_dir}",
               f"--object-store-memory={self.object_store_bytes}"]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        cmd += [f"{k}={v}" for k, v in ports.items()]
        if head:
            cmd += ["--head", f"--port={self.port}", f"--ray-client-server-port={free_port()}"]
            if self.dashboard:
                cmd += ["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                        f"--dashboard-port={self.dashboard_port}"]
            else:
                cmd += ["--include-dashboard=false"]
        else:
            cmd += [f"--address={self.address}"]
        cmd = list(wrapper or []) + cmd
        # Every process of the cluster has the head's address as RAY_ADDRESS. Ray's state API, which Ray Train's
        # placement-group cleaner asks whether a trial's controller is alive, finds its cluster by RAY_ADDRESS, else
        # by the address file a `ray start` with the default temp folder writes (/tmp/ray/ray_current_cluster, as on a
        # real head), else by the GCS processes of the machine, and fails where it sees two: this cluster's nodes
        # have temp folders of their own, and the "ray-beside" tests run local Rays beside it (tests/conftest.py).
        env = self.env(address=False)
        env["RAY_ADDRESS"] = self.address
        env.update(self.system_env)
        log_path = self.root / f"{temp_dir.name}.log"
        node = RayNode(name=name, num_cpus=num_cpus, resources=resources, temp_dir=temp_dir, log_path=log_path,
                       head=head, ports=ports)
        with open(log_path, "wb") as log:
            node.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        self.nodes.append(node)
        if wait:
            self._wait_started(node)
        return node

    def _wait_started(self, node: RayNode) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            text = node.log_path.read_text(errors="replace") if node.log_path.exists() else ""
            if "Ray runtime started" in text:
                return
            if not node.alive:
                raise RuntimeError(f"ray start of node {node.name!r} failed:\n{self.logs(node)}")
            time.sleep(0.2)
        raise TimeoutError(f"node {node.name!r} did not start in {self.start_timeout_s:.0f}s:\n{self.logs(node)}")


def session_pids(sid: int) -> list[int]:
    """Processes of a session. Ray gives every worker process its own process group, but they stay in the
    session of the `ray start` that made their node, so a node's session is all of its processes."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] not in ("Z", "X"):  # zombies are dead
            pids.append(int(entry))
    return pids


def kill_session(sid: int | None, sig: int = signal.SIGKILL) -> None:
    """Signal every process of a session we started (a node, or a driver with its local Ray) at once."""
    if not sid:
        return
    _signal_pgid(sid, sig)
    if not os.path.isdir("/proc"):
        return
    for pid in session_pids(sid):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _signal_pgid(pgid: int | None, sig: int) -> None:
    if not pgid:
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int | None, sig: int) -> None:
    """A node's processes: its `ray start` process group and every worker of its session."""
    if sig == signal.SIGKILL:
        kill_session(pgid, sig)
    else:
        _signal_pgid(pgid, sig)


def _reap_group(pgid: int | None, wait_s: float) -> None:
    """Wait until no process of the node's session is left (killing stragglers)."""
    if not pgid:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        alive = session_pids(pgid) if os.path.isdir("/proc") else []
        try:
            os.killpg(pgid, 0)
            alive.append(pgid)
        except (ProcessLookupError, PermissionError):
            pass
        if not alive:
            return
        kill_session(pgid, signal.SIGKILL)
        time.sleep(0.1)
