"""Fault tolerance on real Ray clusters on loopback.

(a) A trial's Train workers lose their node mid-trial; a replacement node joins; the trial finishes from its
    last checkpoint (Ray Train's FailureConfig), without re-running an epoch it had checkpointed.
(b) The study driver (`a2 study run`) is killed with SIGKILL mid-study; `a2 study resume NAME` finishes it:
    the finished trial is not run again, the interrupted one continues at its last checkpoint epoch + 1. Both
    kinds of trial: one worker (training in the Tune trial itself) and two (a Ray Train run).
    It is tracked by a real `mlflow server` (SQLite backend, artifacts on the moto S3 endpoint): one child run
    per trial, all FINISHED, and `a2 report` puts its PNGs and HTML on the parent run, in S3.

"Not re-run" is read from MLflow: every result a trial reports is logged with its epoch as the step, so a
repeated epoch would show up as a repeated step. The tests kill only after the latest checkpointed epoch has
been logged.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.mlflowserver import mlflow_server  # noqa: F401 - a fixture
from launch.conclusions import verdict
from launch.layout import RESULTS_FILE
from tests.raycluster import (  # noqa: F401 - tiny_data and ray_cluster_factory are fixtures
    a2, kill_group, mlflow_client, mlflow_history, mlflow_trials, ray_cluster_factory, snapshot_epochs, start_a2, tail, tiny_data,
    tiny_study, trial_runs, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EPOCHS = 5


def slow(workers: int) -> dict:
    """Small batches, 4 images per worker and step (train.batch_size is the global batch in image-caption pairs):
    epochs of a few seconds, long enough to kill something in the middle of a trial."""
    return {"train.batch_size": 20 * workers}


def _logged_steps(uri: str, study: str, trial_id: str) -> list[int]:
    try:
        runs = mlflow_trials(uri, study)
    except Exception:  # noqa: BLE001 - the database may not exist yet
        return []
    run = runs.get(trial_id)
    if run is None:
        return []
    return [step for step, _, _ in mlflow_history(uri, run.info.run_id, "val/CIDEr")]


def resume_epochs(run_dir) -> list[int]:
    """Epochs a trial can resume from: Ray Train's registered checkpoints, or for a one-worker trial (no Train
    run) its complete checkpoint folders."""
    if (run_dir / "checkpoint_manager_snapshot.json").exists():
        return snapshot_epochs(run_dir)
    return sorted(int(p.name[len("checkpoint_epoch"):]) for p in run_dir.glob("checkpoint_epoch*")
                  if (p / "checkpoint.pt").is_file())


def _checkpointed_and_logged(uri: str, storage, study: str, trial_id: str | None = None):
    """(trial id, run dir, epoch) of a running trial whose latest registered checkpoint is logged in MLflow."""
    for tid, run_dir in trial_runs(storage, study).items():
        if trial_id is not None and tid != trial_id:
            continue
        epochs = resume_epochs(run_dir)
        if not epochs or max(epochs) >= EPOCHS:
            continue
        if max(epochs) in _logged_steps(uri, study, tid):
            return tid, run_dir, max(epochs)
    return None


def _assert_epochs_once(uri: str, study: str, trial_id: str, after_ms: int, resumed_from: int) -> None:
    history = mlflow_history(uri, mlflow_trials(uri, study)[trial_id].info.run_id, "val/CIDEr")
    steps = sorted(step for step, _, _ in history)  # a back-filled epoch keeps its place by step, not time
    assert steps == list(range(1, EPOCHS + 1)), f"epochs logged {steps}: an epoch was trained twice or lost"
    # What was trained after the failure: exactly the epochs after the last registered checkpoint (results of
    # epochs up to it may still have been on their way to MLflow when the kill happened).
    later = sorted(step for step, _, ts in history if ts > after_ms)
    assert [step for step in later if step > resumed_from] == list(range(resumed_from + 1, EPOCHS + 1)), (
        later, resumed_from)


def test_trial_finishes_after_losing_its_worker_node(tmp_path, tiny_data, ray_cluster_factory):
    name = "ft-node"
    # The head holds 1 CPU: the study driver and the trial's driver function (0.01 CPU) run there, its Train
    # workers (1 CPU each) cannot: they land on the worker node.
    cluster = ray_cluster_factory(num_cpus=1)
    node = cluster.add_node(num_cpus=2, resources={"node_b": 2}, name="worker-a")
    storage = tmp_path / "studies"
    study = tiny_study(tmp_path, name, tiny_data, epochs=EPOCHS, workers=2, cpus_per_worker=1, max_failures=2,
                       extra=slow(2))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow_client(uri)  # opening the store takes seconds: do it before the epochs start to fly by
    log = tmp_path / "run.log"
    proc = start_a2("study", "run", str(study), cwd=tmp_path, log=log, env=cluster.env())
    try:
        trial_id, run_dir, _ = wait_for(lambda: _checkpointed_and_logged(uri, storage, name), 420,
                                        "the trial's first checkpoint", proc=proc, log=log)
        killed_ms = int(time.time() * 1000)
        cluster.kill_node(node)
        resumed_from = max(snapshot_epochs(run_dir))
        assert resumed_from < EPOCHS, "the trial finished before its node could be killed: make epochs longer"
        wait_for(lambda: any(n["state"] == "DEAD" for n in cluster.list_nodes()), 60, "the node to be seen dead")
        cluster.add_node(num_cpus=2, resources={"node_b": 2}, name="worker-b")
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    assert rc == 0, tail(log, 120)
    # Ray Train restarted its worker group, or (when the trial's driver function was on the lost node too) Tune
    # restarted the trial, whose Train run then resumed from its own folder: either way the epochs after the last
    # checkpoint were trained after the kill, each once (_assert_epochs_once below).

    summary = json.loads((storage / name / "summary.json").read_text())
    (trial,) = summary["trials"]
    assert trial["trial_id"] == trial_id and trial["state"] == "TERMINATED"
    assert trial["epochs_done"] == EPOCHS
    _assert_epochs_once(uri, name, trial_id, killed_ms, resumed_from)
    assert mlflow_trials(uri, name)[trial_id].info.status == "FINISHED"


# a one-worker study's driver killed: tests/test_kill_anywhere.py's sweep, at every window of its writes (the same
# checks: every trial once, its epochs resumed, MLflow's points once, the lost runs ended KILLED)
@pytest.mark.parametrize("workers", [2], ids=["train"])
def test_study_resumes_after_the_driver_is_killed(tmp_path, tiny_data, mlflow_server, workers):  # noqa: F811
    name = f"ft-driver-{workers}w-{os.getpid()}"  # the server lives for the whole session
    storage = tmp_path / "studies"
    uri = str(mlflow_server)
    study = tiny_study(tmp_path, name, tiny_data, fusions=("none", "max"), epochs=EPOCHS, workers=workers,
                       cpus_per_worker=1 / workers, max_concurrent=1, extra=slow(workers), mlflow_uri=uri)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # the driver starts its own local Ray, which dies with it
    log = tmp_path / "run.log"
    proc = start_a2("study", "run", str(study), cwd=tmp_path, log=log, env=env)

    def second_trial_checkpointed():
        try:
            runs = mlflow_trials(uri, name)
        except Exception:  # noqa: BLE001
            return None
        finished = [tid for tid, r in runs.items() if r.info.status == "FINISHED"]
        if len(finished) != 1:
            return None
        found = _checkpointed_and_logged(uri, storage, name)
        if found and found[0] not in finished:
            return finished[0], found
        return None

    try:
        first_id, (second_id, second_dir, _) = wait_for(second_trial_checkpointed, 600,
                                                       "a finished trial and a checkpoint of the next one",
                                                       proc=proc, log=log)
        first_history = mlflow_history(uri, mlflow_trials(uri, name)[first_id].info.run_id, "val/CIDEr")
        first_checkpoints = sorted(p.name for p in trial_runs(storage, name)[first_id].iterdir())
        killed_ms = int(time.time() * 1000)
        os.kill(proc.pid, signal.SIGKILL)  # the driver only; its local Ray goes down with it
        proc.wait(timeout=30)
    finally:  # at once: a worker left running under load finished the trial's last epochs (seen at 2 s)
        kill_group(proc)  # whatever is left of the killed driver's local Ray
    # Read only now: the trial's worker outlives the driver until its Ray is gone, and may checkpoint one more
    # epoch in that time (seen on CI: the lost trial's folder ended at epoch 2, read as 1 right after the kill).
    resumed_from = max(resume_epochs(second_dir))
    assert resumed_from < EPOCHS

    resume = a2("study", "resume", name, cwd=tmp_path, env=env, timeout=600)
    assert resume.returncode == 0, resume.stdout[-6000:]

    summary = json.loads((storage / name / "summary.json").read_text())
    assert summary["complete"]
    by_id = {t["trial_id"]: t for t in summary["trials"]}
    superseded = None
    if second_id not in by_id:
        # The driver was killed before Tune's periodic snapshot of its experiment named the second trial (Tune saves
        # every 10 s or more, not at each checkpoint: `launch.driver`): resume ran that configuration again under a
        # new trial id, which continued the lost trial's checkpoints (`launch.trainable.adopt`) and marked its folder.
        mark = json.loads((trial_runs(storage, name)[second_id] / "superseded.json").read_text())
        superseded, second_id = second_id, mark["by"]
        assert mark["epoch"] <= resumed_from, mark
    assert set(by_id) == {first_id, second_id}
    for trial in by_id.values():
        assert trial["state"] == "TERMINATED" and trial["epochs_done"] == EPOCHS
        assert trial["epochs_reported"] == list(range(1, EPOCHS + 1))
    # The finished trial was not run again: nothing new in MLflow or in its Train run folder.
    runs = mlflow_trials(uri, name)
    if superseded is not None:  # its MLflow run ended KILLED, naming the trial that continued it
        old_run = runs.pop(superseded)
        assert old_run.info.status == "KILLED" and second_id in old_run.data.tags["a2.end_reason"]
    assert len(runs) == 2
    assert mlflow_history(uri, runs[first_id].info.run_id, "val/CIDEr") == first_history
    assert sorted(p.name for p in trial_runs(storage, name)[first_id].iterdir()) == first_checkpoints
    # The interrupted one continued after its last checkpoint, in its own MLflow run.
    _assert_epochs_once(uri, name, second_id, killed_ms, resumed_from)
    assert runs[second_id].info.status == "FINISHED"
    # Its compute went on from what the killed attempt had logged: cumulative, one value per measured epoch.
    # By step: an epoch back-filled from its checkpoint is logged after later ones. An epoch that reached the
    # Train checkpoint but not the trial before the kill comes back from the checkpoint's history, which has no
    # compute measurement: the trial's result log says which epochs have one.
    log = json.loads((trial_runs(storage, name)[second_id] / RESULTS_FILE).read_text())
    measured = [r["epoch"] for r in log if "compute/wall_s" in r]
    assert len(measured) >= EPOCHS - 1, measured
    history = sorted(mlflow_history(uri, runs[second_id].info.run_id, "compute/wall_s"))
    assert [step for step, _, _ in history] == measured
    wall = [value for _, value, _ in history]
    assert wall == sorted(wall)
    # The baseline comparison: the study has the fusion none trial of the same seed.
    best, baseline = summary["best"], summary["baseline"]
    assert baseline is not None and baseline["seed"] == best["seed"]
    if best["fusion"] == "none":
        assert baseline["trial_id"] == best["trial_id"] and summary["beats_baseline"] is None
    else:
        assert summary["beats_baseline"] == ((best["value"] > baseline["value"]) if summary["mode"] == "max"
                                             else (best["value"] < baseline["value"]))
    assert verdict(summary) in resume.stdout  # the one line that says which of the three it is

    # The parent run ended with the study; the report lands on it, and through the server in the S3 bucket.
    from mlflow.tracking import MlflowClient

    from dashboards.tracking import study_runs
    from tests.s3server import s3_client

    parent, children = study_runs(uri, name)
    assert parent.info.status == "FINISHED" and len(children) == 2 + (superseded is not None)
    report = a2("report", name, "--tracking-uri", uri, "--out", str(tmp_path / "report"), cwd=tmp_path, env=env,
                timeout=300)
    assert report.returncode == 0, report.stdout[-4000:]
    logged = {a.path for a in MlflowClient(uri).list_artifacts(parent.info.run_id, "report")}
    assert {"report/report.html", "report/learning_curves.png", "report/jsd_per_layer.png"} <= logged
    keys = [o["Key"] for o in s3_client(mlflow_server.s3_endpoint).list_objects_v2(
        Bucket=mlflow_server.bucket, Prefix="mlartifacts/").get("Contents", [])]
    assert any(k.endswith(f"{parent.info.run_id}/artifacts/report/report.html") for k in keys)
