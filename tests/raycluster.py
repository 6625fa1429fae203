"""Real Ray clusters and tiny studies for the orchestration tests.

- `LocalCluster` (launch.raycluster) starts `ray start` nodes on this machine; the `ray_cluster` fixture gives a
  started head and stops every node of it afterwards (by process group, never `ray stop`, which would also stop
  other people's clusters on the machine).
- `tiny_study(...)` writes a study file that trains in seconds on 2 cores (synthetic data, 1-layer d_model 32).
- `a2(...)` / `start_a2(...)` run the real `a2` CLI in a subprocess (`python -m launch.cli`).
- `mlflow_history(...)` and `snapshot_epochs(...)` read what a study left in MLflow and in Ray Train's storage.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from launch.raycluster import LocalCluster, kill_session

REPO = Path(__file__).resolve().parents[1]
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
               storage: Path | None = None, mlflow_uri: str | None = None, extra: dict | None = None) -> Path:
    """Write a study that trains a tiny A2 model on 2 CPU cores; returns the file."""
    raw = {
        "name": name,
        "data": {"kind": "synthetic", "seed": 0, "images": DATA_IMAGES, "root": str(data_root), "val_images": 20},
        "model": {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "max_regions": 8},
        "train": {"xe_epochs": epochs, "scst_epochs": 0, "batch_size": 20, "warmup": 50, "log_every": 1000},
        "search": {"metric": "val/CIDEr", "mode": "max", "algorithm": "grid",
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
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


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
    """Let pyarrow (which Ray uses for storage) write objects to the in-process moto server.

    moto 5.2.1 answers CompleteMultipartUpload with the wrong XML root element (getmoto/moto#10055); the AWS SDK
    for C++ inside pyarrow then reports INTERNAL_FAILURE for every object it writes. Rename the root element to
    what S3 sends (`CompleteMultipartUploadResult`) while the tests run; a fixed moto is left untouched."""
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
    yield
    responses.S3Response.serialized = original
