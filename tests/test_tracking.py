"""StudyTracker and A2MLflowCallback against a live MLflow server (artifacts on local S3) and against SQLite."""
from __future__ import annotations

import time

import pytest

from dashboards.tracking import (TAG_BEST_CKPT, TAG_PARENT, TAG_TRIAL_ID, StudyTracker, TrackingError,
                                 check_tracking_uri, study_runs)
from tests.mlflowserver import closed_port, mlflow_server  # noqa: F401
from tests.s3server import s3_client


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """SQLite stores without a server keep artifacts under ./mlruns: keep them out of the checkout."""
    monkeypatch.chdir(tmp_path)


CONFIG = {"model": {"fusion": "gate", "lambda": 0.02, "layers": 2}, "train": {"seed": 1, "xe_epochs": 3}}


@pytest.fixture(params=["server", "sqlite"])
def tracking_uri(request, tmp_path):
    if request.param == "server":
        return str(request.getfixturevalue("mlflow_server"))
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _study_name(request) -> str:
    return "t-" + request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:40] + f"-{time.time_ns()}"


def test_one_parent_one_child_per_trial_and_restore(tracking_uri, request):
    name = _study_name(request)
    tracker = StudyTracker(tracking_uri, name)
    parent = tracker.start_study({"search": {"num_samples": 2}}, {"owner": "tests"})
    runs = {}
    for i, tid in enumerate(["trial_0", "trial_1"]):
        cfg = {**CONFIG, "train": {"seed": i, "xe_epochs": 3}}
        runs[tid] = tracker.trial_run(tid, cfg)
        for epoch in (1, 2, 3):
            logged = tracker.log_metrics(runs[tid], {"val/CIDEr": 0.1 * epoch + i, "train/loss": 3.0 / epoch,
                                                     "stage": "xe", "epoch": epoch}, step=epoch)
            assert "stage" not in logged and logged["val/CIDEr"] == pytest.approx(0.1 * epoch + i)

    # a restore: a fresh tracker (new driver process) finds the same parent and child runs
    again = StudyTracker(tracking_uri, name)
    assert again.start_study({"search": {"num_samples": 2}}, {}) == parent
    assert again.trial_run("trial_0", CONFIG) == runs["trial_0"]
    assert tracker.trial_run("trial_1", CONFIG) == runs["trial_1"]
    again.log_metrics(runs["trial_0"], {"val/CIDEr": 9.0}, step=4)
    again.set_tags(runs["trial_0"], {TAG_BEST_CKPT: "s3://bucket/ckpt/best.pt"})
    again.client.log_text(runs["trial_0"], "a dog on a bench\n", "samples/epoch_004.txt")
    for run_id in runs.values():
        again.end_trial(run_id, "FINISHED")
    again.end_study("FINISHED")

    parent_run, children = study_runs(tracking_uri, name)
    assert parent_run.info.run_id == parent
    assert parent_run.data.tags["a2.role"] == "study" and parent_run.data.params["search.num_samples"] == "2"
    assert parent_run.info.status == "FINISHED"
    assert sorted(c.data.tags[TAG_TRIAL_ID] for c in children) == ["trial_0", "trial_1"]
    assert {c.info.run_id for c in children} == set(runs.values())
    client = tracker.client
    exp = client.get_experiment_by_name(name)
    assert len(client.search_runs([exp.experiment_id])) == 3  # no duplicates anywhere in the experiment
    for c in children:
        assert c.info.status == "FINISHED"
        assert c.data.tags[TAG_PARENT] == parent
        assert c.data.tags["a2.fusion"] == "gate"
        assert c.data.tags["a2.git_commit"]
        assert c.data.params["model.lambda"] == "0.02" and c.data.params["model.fusion"] == "gate"
    seeds = {c.data.tags[TAG_TRIAL_ID]: c.data.tags["a2.seed"] for c in children}
    assert seeds == {"trial_0": "0", "trial_1": "1"}
    hist = client.get_metric_history(runs["trial_0"], "val/CIDEr")
    assert [(m.step, round(m.value, 6)) for m in sorted(hist, key=lambda m: m.step)] == [
        (1, 0.1), (2, 0.2), (3, 0.3), (4, 9.0)]
    assert [m.step for m in client.get_metric_history(runs["trial_1"], "train/loss")] == [1, 2, 3]
    assert "stage" not in client.get_run(runs["trial_0"]).data.metrics
    assert client.get_run(runs["trial_0"]).data.tags[TAG_BEST_CKPT] == "s3://bucket/ckpt/best.pt"
    arts = [a.path for a in client.list_artifacts(runs["trial_0"], "samples")]
    assert arts == ["samples/epoch_004.txt"]


def test_resume_sets_runs_running_again(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tracker = StudyTracker(uri, "resume-study")
    parent = tracker.start_study({}, {})
    run = tracker.trial_run("t0", CONFIG)
    tracker.end_trial(run, "KILLED")
    tracker.end_study("KILLED")
    again = StudyTracker(uri, "resume-study")
    assert again.start_study({}, {}) == parent
    assert again.client.get_run(parent).info.status == "RUNNING"
    assert again.trial_run("t0", CONFIG) == run
    assert again.client.get_run(run).info.status == "RUNNING"
    again.end_trial(run, "FAILED")
    assert again.client.get_run(run).info.status == "FAILED"
    with pytest.raises(ValueError):
        again.end_trial(run, "DONE")


def test_artifacts_reach_s3_through_the_server(mlflow_server):  # noqa: F811
    tracker = StudyTracker(str(mlflow_server), "artifact-study")
    tracker.start_study({}, {})
    run = tracker.trial_run("t0", CONFIG)
    tracker.client.log_dict(run, {"a": 1}, "config/resolved.json")
    keys = [o["Key"] for o in s3_client(mlflow_server.s3_endpoint).list_objects_v2(
        Bucket=mlflow_server.bucket).get("Contents", [])]
    assert any(k.startswith("mlartifacts/") and k.endswith(f"{run}/artifacts/config/resolved.json") for k in keys), keys


@pytest.mark.parametrize("uri_fn", [
    lambda tmp: "foo://x",
    lambda tmp: f"http://127.0.0.1:{closed_port()}",
    lambda tmp: f"sqlite:///{tmp}/missing/dir/mlflow.db",
    lambda tmp: "",
], ids=["unknown-scheme", "closed-port", "sqlite-missing-dir", "empty"])
def test_bad_uris_fail_fast(uri_fn, tmp_path):
    uri = uri_fn(tmp_path)
    with pytest.raises(TrackingError) as err:
        check_tracking_uri(uri)
    if uri:
        assert uri in str(err.value)
    assert isinstance(err.value, ValueError)


def test_good_uris_pass(mlflow_server, tmp_path):  # noqa: F811
    assert check_tracking_uri(str(mlflow_server)) == str(mlflow_server)
    assert check_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")


# -- the Tune callback ---------------------------------------------------------------------------------------
def _trainable(config):
    import os
    import tempfile

    from ray import tune

    for epoch in range(1, 4):
        metrics = {"epoch": epoch, "stage": "xe", "val/CIDEr": 0.5 * epoch + config["lambda"],
                   "train/loss": 2.0 / epoch, "samples": [f"a caption at epoch {epoch}"]}
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "checkpoint.pt"), "w") as f:
                f.write(str(epoch))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))


@pytest.fixture(scope="module")
def ray_local():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.slow
def test_callback_with_a_real_tune_run(ray_local, tmp_path):
    from ray import tune

    from launch.mlflow_callback import A2MLflowCallback

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cb = A2MLflowCallback(uri, "cb-study", study_params={"search": {"metric": "val/CIDEr"}}, strict=True)
    tuner = tune.Tuner(
        tune.with_resources(_trainable, {"CPU": 0.5}),
        param_space={"fusion": tune.grid_search(["max", "gate"]), "lambda": 0.01, "seed": 0},
        run_config=tune.RunConfig(name="cb", storage_path=str(tmp_path / "ray"), callbacks=[cb], verbose=0),
    )
    results = tuner.fit()
    assert not results.errors

    parent, children = study_runs(uri, "cb-study")
    assert parent.info.status == "FINISHED"
    assert parent.info.run_id == cb.parent_run_id
    assert parent.data.params["search.metric"] == "val/CIDEr"
    assert len(children) == 2
    assert sorted(c.data.tags["a2.fusion"] for c in children) == ["gate", "max"]
    assert {c.data.tags[TAG_TRIAL_ID] for c in children} == {r.metrics["trial_id"] for r in results}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    for c in children:
        assert c.info.status == "FINISHED"
        hist = sorted(client.get_metric_history(c.info.run_id, "val/CIDEr"), key=lambda m: m.step)
        assert [m.step for m in hist] == [1, 2, 3]
        assert [m.value for m in hist] == pytest.approx([0.51, 1.01, 1.51])
        assert "training_iteration" not in c.data.metrics and "stage" not in c.data.metrics
        assert c.data.params["lambda"] == "0.01"
        assert c.data.tags[TAG_BEST_CKPT].endswith("checkpoint_000002")  # the best epoch's checkpoint
        assert [a.path for a in client.list_artifacts(c.info.run_id, "samples")] == [
            "samples/epoch_001.txt", "samples/epoch_002.txt", "samples/epoch_003.txt"]

    # Tuner.restore: Tune gives the saved state back to the callback -> the same runs, never new ones
    state = cb.get_state()
    assert set(state["trial_runs"].values()) == {c.info.run_id for c in children}


class _FakeTrial:
    def __init__(self, trial_id, config, status="RUNNING"):
        self.trial_id, self.config, self.status = trial_id, config, status
        self.last_result = {}
        self.num_failures = 0

    def __str__(self):
        return f"fn_{self.trial_id}"


def test_callback_restore_continues_runs(tmp_path):
    from launch.mlflow_callback import A2MLflowCallback

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t0, t1 = _FakeTrial("abc_00000", {"fusion": "max", "seed": 0}), _FakeTrial("abc_00001", {"fusion": "gate"})
    cb = A2MLflowCallback(uri, "restore-study", strict=True)
    cb.setup()
    for t in (t0, t1):
        cb.on_trial_start(0, [t0, t1], t)
        cb.on_trial_result(0, [t0, t1], t, {"epoch": 1, "val/CIDEr": 1.0, "training_iteration": 1})
    cb.on_trial_complete(0, [t0, t1], t1)
    state = cb.get_state()
    # driver killed here; the restored driver gets the state back (set_state comes before setup in Tune) ...
    cb2 = A2MLflowCallback(uri, "restore-study", strict=True)
    cb2.set_state(state)
    cb2.setup()
    cb2.on_trial_start(0, [t0, t1], t0)
    # ... training_iteration restarts at 1 after a restore; the step is the epoch
    cb2.on_trial_result(0, [t0, t1], t0, {"epoch": 2, "val/CIDEr": 2.0, "training_iteration": 1})
    # ... and a driver without the saved state finds the runs by their tags
    cb3 = A2MLflowCallback(uri, "restore-study", strict=True)
    cb3.setup()
    cb3.on_trial_start(0, [t0, t1], t0)
    cb3.on_trial_result(0, [t0, t1], t0, {"epoch": 3, "val/CIDEr": 3.0, "training_iteration": 1})
    assert cb3.trial_runs[t0.trial_id] == state["trial_runs"][t0.trial_id]
    t0.status, t1.status = "ERROR", "TERMINATED"
    cb3.on_trial_error(0, [t0, t1], t0)
    cb3.on_experiment_end([t0, t1])

    parent, children = study_runs(uri, "restore-study")
    assert len(children) == 2 and parent.info.run_id == state["parent_run_id"]
    assert parent.info.status == "FAILED"
    status = {c.data.tags[TAG_TRIAL_ID]: c.info.status for c in children}
    assert status == {"abc_00000": "FAILED", "abc_00001": "FINISHED"}
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(uri).get_metric_history(state["trial_runs"][t0.trial_id], "val/CIDEr")
    assert sorted((m.step, m.value) for m in hist) == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_callback_setup_rejects_bad_uri():
    from launch.mlflow_callback import A2MLflowCallback

    with pytest.raises(TrackingError, match="unreachable"):
        A2MLflowCallback(f"http://127.0.0.1:{closed_port()}", "x").setup()


# -- a2 mlflow serve ---------------------------------------------------------------------------------------------
def test_serve_runs_until_signalled_and_stops_its_server(tmp_path):
    import signal
    import socket
    import subprocess
    import sys

    from tests.mlflowserver import free_port, wait_healthy

    port = free_port()
    code = ("import argparse, sys\nfrom dashboards.tracking import serve\n"
            f"sys.exit(serve(argparse.Namespace(backend_store_uri='sqlite:///{tmp_path}/m.db', "
            f"artifacts_destination='{tmp_path}/art', s3_endpoint_url=None, host='127.0.0.1', port={port}, "
            "workers=1)))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=90, proc=proc)
        check_tracking_uri(f"http://127.0.0.1:{port}")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"MLflow server: http://127.0.0.1:{port}" in out
    with pytest.raises(OSError):  # the web server went down with it
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_serve_rejects_a_file_backend(tmp_path):
    import argparse

    from dashboards.tracking import serve

    args = argparse.Namespace(backend_store_uri=str(tmp_path / "mlruns"), artifacts_destination=None,
                              s3_endpoint_url=None, host="127.0.0.1", port=closed_port(), workers=1)
    with pytest.raises(TrackingError, match="backend-store-uri"):
        serve(args)
    args.backend_store_uri = f"sqlite:///{tmp_path}/missing/m.db"
    with pytest.raises(TrackingError, match="does not exist"):
        serve(args)


def test_callback_fills_in_epochs_a_killed_driver_never_logged(tmp_path):
    """Epoch 2 was checkpointed (its result is in the trial's result log) but the driver died before logging it;
    the restored driver's first result of the trial (epoch 3) brings epoch 2 along, once; the end of a trial
    restored after its last epoch brings the rest."""
    from mlflow.tracking import MlflowClient

    from launch.mlflow_callback import A2MLflowCallback

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log = {"abc_00000": [{"epoch": e, "val/CIDEr": float(e), "stage": "xe"} for e in (1, 2)],
           "abc_00001": [{"epoch": e, "val/CIDEr": 10.0 + e} for e in (1, 2, 3)]}
    t0, t1 = _FakeTrial("abc_00000", {"fusion": "max"}), _FakeTrial("abc_00001", {"fusion": "gate"})
    cb = A2MLflowCallback(uri, "backfill-study", strict=True, history_of=lambda tid: log[tid])
    cb.setup()
    for t in (t0, t1):
        cb.on_trial_start(0, [t0, t1], t)
        cb.on_trial_result(0, [t0, t1], t, {"epoch": 1, "val/CIDEr": log[t.trial_id][0]["val/CIDEr"]})
    state = cb.get_state()

    cb2 = A2MLflowCallback(uri, "backfill-study", strict=True, history_of=lambda tid: log[tid])
    cb2.set_state(state)
    cb2.setup()
    cb2.on_trial_start(0, [t0, t1], t0)
    cb2.on_trial_result(0, [t0, t1], t0, {"epoch": 3, "val/CIDEr": 3.0})
    log["abc_00000"].append({"epoch": 3, "val/CIDEr": 3.0})
    cb2.on_trial_result(0, [t0, t1], t0, {"epoch": 4, "val/CIDEr": 4.0})
    cb2.on_trial_complete(0, [t0, t1], t0)
    cb2.on_trial_start(0, [t0, t1], t1)
    cb2.on_trial_complete(0, [t0, t1], t1)  # restored after its last epoch: no result at all

    client = MlflowClient(uri)
    steps = {tid: [(m.step, m.value) for m in sorted(client.get_metric_history(run, "val/CIDEr"),
                                                    key=lambda m: m.step)]
             for tid, run in cb2.trial_runs.items()}
    assert steps == {"abc_00000": [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)],
                     "abc_00001": [(1, 11.0), (2, 12.0), (3, 13.0)]}


def test_scheduler_stopped_trial_is_tagged_and_not_best(tmp_path):
    """A trial the scheduler stopped ends FINISHED but tagged a2.stopped_early (rung, cutoff); replicates share
    a2.config_hash; best_candidates leaves the stopped run out while another finished."""
    from dashboards.stats import TAG_CONFIG_HASH, best_candidates
    from launch.mlflow_callback import A2MLflowCallback

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    stopped = {"t1": {"rung": 2, "cutoff": 1.5, "group_mean": 0.9, "threshold": 0.2}}
    trials = [_FakeTrial("t0", {"fusion": "gate", "lambda": 0.03, "seed": 0}),
              _FakeTrial("t1", {"fusion": "gate", "lambda": 0.05, "seed": 0}),
              _FakeTrial("t2", {"fusion": "gate", "lambda": 0.05, "seed": 1})]
    cb = A2MLflowCallback(uri, "stop-study", strict=True, stopped_early_of=stopped.get)
    cb.setup()
    for t, value in zip(trials, (1.0, 2.0, 1.9)):
        cb.on_trial_start(0, trials, t)
        cb.on_trial_result(0, trials, t, {"epoch": 2, "val/CIDEr": value})
        cb.on_trial_complete(0, trials, t)
    _, children = study_runs(uri, "stop-study")
    runs = {c.data.tags[TAG_TRIAL_ID]: c for c in children}
    assert {k: r.info.status for k, r in runs.items()} == {"t0": "FINISHED", "t1": "FINISHED", "t2": "FINISHED"}
    tags = runs["t1"].data.tags
    assert (tags["a2.stopped_early"], tags["a2.stopped_rung"], tags["a2.stopped_cutoff"]) == ("true", "2", "1.5")
    assert "a2.stopped_early" not in runs["t0"].data.tags
    assert runs["t1"].data.tags[TAG_CONFIG_HASH] == runs["t2"].data.tags[TAG_CONFIG_HASH]
    assert runs["t0"].data.tags[TAG_CONFIG_HASH] != runs["t1"].data.tags[TAG_CONFIG_HASH]
    best = max(best_candidates([r.data for r in runs.values()]), key=lambda d: d.metrics["val/CIDEr"])
    assert best.tags[TAG_TRIAL_ID] == "t2"  # t1 scored higher but was stopped early


def test_serve_prints_the_backend_without_its_password(monkeypatch, capsys):
    import argparse

    from dashboards import tracking

    assert tracking.redact_uri("postgresql://a2:s3cret@db.example:5432/mlflow") == \
        "postgresql://a2:***@db.example:5432/mlflow"
    assert tracking.redact_uri("postgresql+psycopg://a2@127.0.0.1/mlflow") == "postgresql+psycopg://a2@127.0.0.1/mlflow"
    assert tracking.redact_uri("sqlite:///m.db") == "sqlite:///m.db"
    started = []
    monkeypatch.setattr(tracking.os, "execve", lambda path, cmd, env: started.append(cmd))
    args = argparse.Namespace(backend_store_uri="postgresql://a2:s3cret@127.0.0.1:5432/mlflow",
                              artifacts_destination=None, s3_endpoint_url=None, host="127.0.0.1", port=5000, workers=1)
    tracking.serve(args)
    out = capsys.readouterr().out
    assert "backend postgresql://a2:***@127.0.0.1:5432/mlflow" in out and "s3cret" not in out
    assert started and "postgresql://a2:s3cret@127.0.0.1:5432/mlflow" in started[0]  # the server itself needs it
