"""StudyTracker against a live MLflow server (artifacts on local S3) and against SQLite."""
from __future__ import annotations

import time

import pytest

from dashboards.tracking import TAG_BEST_CKPT, TAG_PARENT, TAG_TRIAL_ID, TrackingError, check_tracking_uri, study_runs
from launch.tracking_writer import StudyTracker
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow  # starts an MLflow server
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


@pytest.mark.slow  # starts an MLflow server
def test_good_uris_pass(mlflow_server, tmp_path):  # noqa: F811
    assert check_tracking_uri(str(mlflow_server)) == str(mlflow_server)
    assert check_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")


# -- the Tune callback ---------------------------------------------------------------------------------------
def test_callback_setup_rejects_bad_uri():
    from types import SimpleNamespace

    from launch.mlflow_callback import A2MLflowCallback
    from launch.spec import Tracking

    spec = SimpleNamespace(name="x", tracking=Tracking(mlflow_uri=f"http://127.0.0.1:{closed_port()}"))
    with pytest.raises(TrackingError, match="unreachable"):
        A2MLflowCallback(spec, None).setup()


# -- a2 mlflow serve ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_serve_runs_until_signalled_and_stops_its_server(tmp_path):
    import signal
    import socket
    import subprocess
    import sys

    from tests.mlflowserver import free_port, wait_healthy

    port = free_port()
    code = ("import argparse, sys\nfrom launch.commands.serve import cmd_serve\n"
            f"sys.exit(cmd_serve(argparse.Namespace(backend_store_uri='sqlite:///{tmp_path}/m.db', "
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

    from launch.commands.serve import cmd_serve

    args = argparse.Namespace(backend_store_uri=str(tmp_path / "mlruns"), artifacts_destination=None,
                              s3_endpoint_url=None, host="127.0.0.1", port=closed_port(), workers=1)
    with pytest.raises(TrackingError, match="backend-store-uri"):
        cmd_serve(args)
    args.backend_store_uri = f"sqlite:///{tmp_path}/missing/m.db"
    with pytest.raises(TrackingError, match="does not exist"):
        cmd_serve(args)


def test_serve_prints_the_backend_without_its_password(monkeypatch, capsys):
    """Nothing listens on the backend's port: `serve` lists no studies, says so without the password, and hands the
    full URI to the server. MLflow retries an engine it cannot connect with 9 times with doubling sleeps (101 s in
    all, which this test used to wait out); one attempt reaches the same error."""
    import argparse

    import mlflow.store.db.utils as mlflow_db

    from dashboards import tracking
    from launch import mlflow_server as server_part  # not the `mlflow_server` fixture
    from launch.commands.serve import cmd_serve

    monkeypatch.setattr(mlflow_db, "MAX_RETRY_COUNT", 1)

    assert tracking.redact_uri("postgresql://a2:s3cret@db.example:5432/mlflow") == \
        "postgresql://a2:***@db.example:5432/mlflow"
    assert tracking.redact_uri("postgresql+psycopg://a2@127.0.0.1/mlflow") == "postgresql+psycopg://a2@127.0.0.1/mlflow"
    assert tracking.redact_uri("sqlite:///m.db") == "sqlite:///m.db"
    started = []
    monkeypatch.setattr(server_part.os, "execve", lambda path, cmd, env: started.append(cmd))
    args = argparse.Namespace(backend_store_uri="postgresql://a2:s3cret@127.0.0.1:5432/mlflow",
                              artifacts_destination=None, s3_endpoint_url=None, host="127.0.0.1", port=5000, workers=1)
    cmd_serve(args)
    out = capsys.readouterr().out
    assert "backend postgresql://a2:***@127.0.0.1:5432/mlflow" in out and "s3cret" not in out
    assert "(studies not listed: " in out  # the store's own error, reached and printed
    assert started and "postgresql://a2:s3cret@127.0.0.1:5432/mlflow" in started[0]  # the server itself needs it


def test_a_long_run_name_is_cut_to_what_every_mlflow_database_takes(tmp_path):
    """MLflow's runs.name is VARCHAR(250): PostgreSQL and MySQL refused a longer trial name (searched data paths
    make one) and the trial never got its run; SQLite takes it, so the cut is checked here by its length."""
    from launch.tracking_writer import RUN_NAME_MAX

    tracker = StudyTracker(f"sqlite:///{tmp_path / 'm.db'}", "long-names")
    tracker.start_study({}, {})
    long = "gate lambda=0.035 features=/datasets/" + "x" * 300 + " seed=3"
    run = tracker.trial_run("t0", CONFIG, run_name=long)
    assert tracker.client.get_run(run).info.run_name == long[:RUN_NAME_MAX] and RUN_NAME_MAX == 250
    assert tracker.trial_run("t0", CONFIG, run_name=long) == run  # the same name again: no rename


def test_a_new_chart_section_not_saved_is_saved_by_the_next_export(tmp_path, monkeypatch):
    """One failed write of the views (the server went away) does not count the new section as saved."""
    from dashboards.mlflow_views import saved_sections

    tracker = StudyTracker(f"sqlite:///{tmp_path / 'm.db'}", "views")
    tracker.start_study({}, {})
    tracker.set_views("val/CIDEr", "max")
    run = tracker.trial_run("t0", CONFIG)
    real, calls = tracker.client.set_experiment_tag, []

    def flaky(*args):
        calls.append(args)
        if len(calls) == 1:
            raise ConnectionError("server went away")
        return real(*args)

    monkeypatch.setattr(tracker.client, "set_experiment_tag", flaky)
    with pytest.raises(ConnectionError):
        tracker.log_metrics(run, {"diag/jsd/layer0": 0.1}, 1)
    tracker.log_metrics(run, {"diag/jsd/layer0": 0.1}, 1)
    tags = tracker.client.get_experiment(tracker.experiment_id).tags
    assert "diag/jsd" in saved_sections(tags), saved_sections(tags)


def test_no_password_of_a_tracking_uri_is_shown_in_its_errors():
    with pytest.raises(TrackingError) as err:
        check_tracking_uri(f"postgresql://alice:s3cret@127.0.0.1:{closed_port()}/mlflow")
    assert "s3cret" not in str(err.value) and "alice:***@127.0.0.1" in str(err.value)
    with pytest.raises(TrackingError) as err:
        check_tracking_uri("mysql://alice:s3cret@127.0.0.1:bad/db")
    assert "s3cret" not in str(err.value)


def test_a_database_mlflow_does_not_store_runs_in_is_refused():
    """SQLAlchemy knows oracle://, MLflow's tracking store does not (DATABASE_ENGINES): refused by its scheme at
    once, not after a connection to port 1521 was tried."""
    from mlflow.store.db.db_types import DATABASE_ENGINES
    with pytest.raises(TrackingError, match="unknown scheme oracle://"):
        check_tracking_uri("oracle://127.0.0.1/mlflow")
    assert "oracle" not in DATABASE_ENGINES
