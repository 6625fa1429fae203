"""Edges of the MLflow export (`launch.mlflow_export`) against a real tracking server (`tests/mlflowserver.py`):
values MLflow refuses or alters, limits of a request, an experiment the study shares or that was deleted, a run
killed part way, a server that is down."""
from __future__ import annotations

import json
import math
import uuid
from collections import Counter
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from launch.conclusions import tune_trial
from launch.location import StudyLocation
from launch.mlflow_export import Export, end_reason
from launch.spec import load_study
import tests.mlflowserver as servers
from tests.test_mlflow_export import FakeTrial, points, runs_by_trial

mlflow_server = servers.mlflow_server  # the real server, a fixture of this module
SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"


@pytest.fixture
def spec(tmp_path, monkeypatch, mlflow_server):
    monkeypatch.chdir(tmp_path)
    name = f"edge-{uuid.uuid4().hex[:8]}"
    return load_study(SMOKE, [f"name={name}", f"tracking.mlflow_uri={mlflow_server}", f"storage={tmp_path / 'st'}",
                              "train.xe_epochs=3", f"data.root={tmp_path / 'data'}"], check_files=False)


def write_results(location, trial_id: str, results: list[dict]) -> None:
    location.at("trials", f"{location.name}-{trial_id}").join("results.json").write_text(json.dumps(results))


def test_nan_and_inf_metrics_are_exported(spec):
    location = StudyLocation(spec.name, spec.storage)
    write_results(location, "t0", [{"epoch": 1, "val/CIDEr": 10.0, "train/loss": float("nan"), "timestamp": 1001.0},
                                   {"epoch": 2, "val/CIDEr": 12.0, "train/loss": float("inf"), "timestamp": 1002.0},
                                   {"epoch": 3, "val/CIDEr": 11.0, "train/loss": float("-inf"), "timestamp": 1003.0}])
    trials = [FakeTrial("t0", {"fusion": "none", "seed": 0}, "TERMINATED")]
    Export(spec, location).run([tune_trial(t) for t in trials], end_reason(spec.name))
    Export(spec, location).run([tune_trial(t) for t in trials], end_reason(spec.name))
    run = runs_by_trial(spec.tracking.mlflow_uri, spec.name)[1]["t0"]
    history = sorted((m.step, m.value) for m in MlflowClient(spec.tracking.mlflow_uri).get_metric_history(
        run.info.run_id, "train/loss"))
    assert [s for s, _ in history] == [1, 2, 3]
    assert math.isnan(history[0][1]) and history[1][1] > 1e300 and history[2][1] < -1e300
    assert run.info.status == "FINISHED"


def test_bad_timestamps_do_not_stop_the_export(spec):
    """A result's timestamp MLflow cannot hold (NaN, infinite, negative, a bool) is logged at the export's time;
    before, int(nan * 1000) raised and no later trial was ever exported."""
    location = StudyLocation(spec.name, spec.storage)
    write_results(location, "t0", [{"epoch": 1, "val/CIDEr": 10.0, "timestamp": float("nan")},
                                   {"epoch": 2, "val/CIDEr": 12.0, "timestamp": -5.0},
                                   {"epoch": 3, "val/CIDEr": 11.0, "timestamp": float("inf")},
                                   {"epoch": 4, "val/CIDEr": 13.0, "timestamp": True}])
    trials = [FakeTrial("t0", {"fusion": "none", "seed": 0}, "TERMINATED")]
    Export(spec, location).run([tune_trial(t) for t in trials], end_reason(spec.name))
    assert points(spec.tracking.mlflow_uri, spec.name)["t0"]["val/CIDEr"] == Counter({1: 1, 2: 1, 3: 1, 4: 1})


def test_many_metrics_long_values_and_odd_keys(spec):
    """Over 1,000 metric points in one export (MLflow takes 1,000 a request), a param value over its 6,000
    characters and a metric key of characters it refuses: exported, and again without duplicates."""
    location = StudyLocation(spec.name, spec.storage)
    results = [{"epoch": e, "val/CIDEr": 10.0 + e, "timestamp": 1000.0 + e,
                **{f"detail/m{i:04d}": float(i) for i in range(350)}, "odd key (ä)!": 1.0} for e in (1, 2, 3)]
    write_results(location, "t0", results)
    trials = [FakeTrial("t0", {"fusion": "none", "seed": 0, "note": "x" * 7000}, "TERMINATED")]
    Export(spec, location).run([tune_trial(t) for t in trials], end_reason(spec.name))
    Export(spec, location).run([tune_trial(t) for t in trials], end_reason(spec.name))
    run = runs_by_trial(spec.tracking.mlflow_uri, spec.name)[1]["t0"]
    assert len([k for k in run.data.metrics if k.startswith("detail/")]) == 350
    assert points(spec.tracking.mlflow_uri, spec.name)["t0"]["detail/m0349"] == Counter({1: 1, 2: 1, 3: 1})


def test_an_experiment_the_study_shares_and_one_deleted(spec):
    uri = spec.tracking.mlflow_uri
    client = MlflowClient(uri)
    exp = client.create_experiment(spec.name)
    other = client.create_run(exp, run_name="someone else's", tags={"a2.role": "trial", "a2.trial_id": "t0"}).info.run_id
    location = StudyLocation(spec.name, spec.storage)
    write_results(location, "t0", [{"epoch": 1, "val/CIDEr": 10.0, "timestamp": 1001.0}])
    trials = [FakeTrial("t0", {"fusion": "none", "seed": 0}, "TERMINATED")]
    Export(spec, location).run([tune_trial(t) for t in trials], end_reason(spec.name))
    parent, runs = runs_by_trial(uri, spec.name)
    assert runs["t0"].info.run_id != other and client.get_run(other).info.status == "RUNNING"
    assert not client.get_run(other).data.metrics
    client.delete_experiment(exp)
    Export(spec, location).run([tune_trial(t) for t in trials], end_reason(spec.name))
    assert client.get_experiment(exp).lifecycle_stage == "active"
    parent2, runs2 = runs_by_trial(uri, spec.name)
    assert parent2.info.run_id == parent.info.run_id and runs2["t0"].info.run_id == runs["t0"].info.run_id
    assert points(uri, spec.name)["t0"]["val/CIDEr"] == Counter({1: 1})


def test_a_model_name_with_a_quote_reuses_its_version_and_drops_unfinished_ones(mlflow_server, tmp_path):
    """MLflow allows ' in a model name; its search filters were built with the name in '...', which MLflow refused
    (INVALID_PARAMETER_VALUE), so such a model could never be registered or reused."""
    from launch.model_registry import TAG_CONTENT_HASH, content_hash, drop_unfinished_versions, register_ensemble

    client = MlflowClient(str(mlflow_server))
    name = f"o'brien's ensemble {uuid.uuid4().hex[:6]}"
    run = client.create_run(client.create_experiment(f"reg-{uuid.uuid4().hex[:8]}")).info.run_id
    checkpoint = tmp_path / "a.pt"
    checkpoint.write_bytes(b"weights")
    client.create_registered_model(name)
    done = client.create_model_version(name, "s3://somewhere/model", run_id=run)
    client.set_model_version_tag(name, done.version, TAG_CONTENT_HASH, content_hash([checkpoint], 5, 20))
    killed = client.create_model_version(name, "s3://somewhere/model2", run_id=run)  # registered, never tagged
    assert drop_unfinished_versions(client, name, run) == [int(killed.version)]
    model = register_ensemble(str(mlflow_server), run, [checkpoint], name)
    assert model["reused"] and model["version"] == int(done.version)


def test_a_request_the_server_refuses_mid_study_is_said_once_in_its_words_and_tried_again(monkeypatch, caplog):
    """A refusal of one request (HTTP 400, not a `TrackingError`) while the driver runs: the log said only "MLflow
    export failed" with a traceback, at every export (every 2 s). Now the server's own words, once, with what was
    being written, as long as the refusal stays the same; the export is tried again (nothing stops), and
    `tracking/outage.json` will name it (`refusal`). An error that is no refusal keeps its traceback."""
    import logging
    import types

    from mlflow.exceptions import RestException

    import launch.mlflow_export as mx

    errors = [RestException({"error_code": "INVALID_PARAMETER_VALUE",  # as MLflow's REST client raises it
                             "message": "Param value 'x' had length 7000, which exceeded length limit of 6000"})] * 2
    errors.append(ValueError("a bug"))

    def run(*_args, **_kwargs):
        raise errors.pop(0)

    export = types.SimpleNamespace(
        spec=types.SimpleNamespace(name="refused", tracking=types.SimpleNamespace(mlflow_uri="http://127.0.0.1:9")),
        location=types.SimpleNamespace(uri=lambda: "/nowhere"), writing="trial t1, run 'none seed=0'", late=0, run=run)
    monkeypatch.setattr(mx, "server_answers", lambda uri: True)
    monkeypatch.setattr(mx, "held_lease", lambda uri: None)
    exporter = mx.StudyExporter(export, lambda: [], every=3600)
    try:
        with caplog.at_level(logging.WARNING, logger=mx.logger.name):
            assert [exporter.once(), exporter.once(), exporter.once()] == [False, False, False]
    finally:
        exporter.stop.set()
        exporter.wake.set()
        exporter.thread.join(10)
    said = [r for r in caplog.records if r.name == mx.logger.name]
    assert [r.getMessage() for r in said[:1]] == [
        "MLflow refused part of study 'refused''s export (trial t1, run 'none seed=0'): MLflow server "
        "http://127.0.0.1:9 answered INVALID_PARAMETER_VALUE: Param value 'x' had length 7000, which exceeded length "
        "limit of 6000; a2 tries again at each export"]
    assert said[0].exc_info is None  # no traceback for the server's answer
    assert [r.getMessage() for r in said[1:]] == ["MLflow export failed: a bug"] and said[1].exc_info is not None
    assert exporter.refused is None and exporter.refusal.startswith("MLflow server http://127.0.0.1:9 answered "
                                                                     "INVALID_PARAMETER_VALUE")
