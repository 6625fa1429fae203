"""Why MLflow refused a study's export, kept where people look (`tracking/outage.json`, the summary's and `a2 mlflow
sync`'s tracking line), a refusal at the study's start that no longer stops the study, and a registered ensemble that
leaves MLflow's "View run" lines out of the packaging log; against a real tracking server (`tests/mlflowserver.py`)."""
from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

import pytest
from mlflow.exceptions import RestException
from mlflow.tracking import MlflowClient

import tests.mlflowserver as servers
from a2core.errors import TrackingError
from launch.layout import add_outage, outage_line
from launch.location import StudyLocation
from launch.mlflow_callback import A2MLflowCallback
from launch.mlflow_export import Export, StudyExporter, end_reason
from launch.model_registry import register_ensemble
from launch.spec import load_study
from launch.tracking_writer import StudyTracker
from tests.test_mlflow_export import FakeTrial, write_epoch

pytestmark = pytest.mark.outside_ray_group

mlflow_server = servers.mlflow_server  # the real server, a fixture of this module
SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _spec(name: str, uri: str, storage: Path, *overrides: str):
    return load_study(SMOKE, [f"name={name}", f"tracking.mlflow_uri={uri}", f"storage={storage}",
                              "train.xe_epochs=3", f"data.root={storage.parent / 'data'}", *overrides],
                      check_files=False)


def _saved(location) -> dict:
    return json.loads(location.at("tracking", "outage.json").read_text())


def test_the_first_refusal_is_kept_across_drivers_shown_and_cleared_once_all_is_exported(tmp_path, capsys):
    location = StudyLocation("st", str(tmp_path / "st"))
    first = add_outage(location, down_seconds=3.2, pending=True, refused="INVALID_PARAMETER_VALUE: bad (trial t0)")
    assert first == {"down_seconds": 3.2, "exported_late": 0, "pending": True,
                     "refused": "INVALID_PARAMETER_VALUE: bad (trial t0)"}
    # a later driver refused again: the first refusal stays, its figures are added
    later = add_outage(location, exported_late=2, pending=True, refused="PERMISSION_DENIED: no (trial t1)")
    assert later == {**first, "exported_late": 2}
    assert _saved(location) == later
    assert add_outage(location) == later  # the summary's read: nothing changes
    assert outage_line(later) == ("tracking: server down 3 s, refused by MLflow: INVALID_PARAMETER_VALUE: bad "
                                  "(trial t0); not all exported yet (once that is settled, `a2 mlflow sync NAME` "
                                  "exports the rest)")
    assert outage_line({"down_seconds": 0, "pending": True, "refused": "X: y"}) == (
        "tracking: refused by MLflow: X: y; not all exported yet (once that is settled, `a2 mlflow sync NAME` "
        "exports the rest)")
    # `a2 mlflow sync` exported everything: the refusal goes with `pending`
    synced = add_outage(location, pending=False)
    assert synced == {"down_seconds": 3.2, "exported_late": 2, "pending": False}
    assert _saved(location) == synced
    assert outage_line(synced) == "tracking: server down 3 s, 2 epochs exported once it was back"
    # a damaged refusal is a damaged file: said, not fatal
    location.at("tracking", "outage.json").write_text(json.dumps({"pending": True, "refused": ["x"]}))
    assert add_outage(location, pending=True) == {"down_seconds": 0.0, "exported_late": 0, "pending": True}
    assert "outage.json is damaged" in capsys.readouterr().err


def test_a_refusal_mid_study_is_recorded_with_its_trial_and_epoch(mlflow_server, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    name = _name("midref")
    spec = _spec(name, str(mlflow_server), tmp_path / "st")
    location = StudyLocation(name, spec.storage)
    trial = FakeTrial("t0", {"fusion": "none", "seed": 0}, "RUNNING")
    write_epoch(location, trial, 1, 10.0)
    write_epoch(location, trial, 2, 11.0)
    export = Export(spec, location)
    export.open()
    real = StudyTracker.log_epochs

    def refused(self, run_id, epochs):  # what the server answers a metric it refuses (the server's words)
        raise RestException({"error_code": "INVALID_PARAMETER_VALUE",
                             "message": "Invalid value for metric 'val/CIDEr'" + " x" * 200})

    monkeypatch.setattr(StudyTracker, "log_epochs", refused)
    exporter = StudyExporter(export, lambda: [trial], every=3600)
    with caplog.at_level(logging.WARNING, logger="launch.mlflow_export"):
        assert exporter.once() is False
    monkeypatch.setattr(StudyTracker, "log_epochs", real)
    totals = exporter.close(None)  # the last export wrote the refused epochs: nothing is left to say
    assert totals["pending"] is False and "refused" not in totals
    assert "refused" not in json.loads(location.at("tracking", "outage.json").read_text() or "{}")

    # refused to the end: recorded with the server's code, its words cut short, and where (the first epoch MLflow
    # lacks: epochs 1 and 2 were exported above)
    write_epoch(location, trial, 3, 12.0)
    write_epoch(location, trial, 4, 12.5)
    monkeypatch.setattr(StudyTracker, "log_epochs", refused)
    exporter = StudyExporter(Export(spec, location), lambda: [trial], every=3600)
    exporter.once()
    totals = exporter.close(end_reason(name))
    why = totals["refused"]
    assert why.startswith(f"MLflow server {mlflow_server} answered INVALID_PARAMETER_VALUE: Invalid value for "
                          f"metric 'val/CIDEr' x x")
    assert why.endswith(" (trial t0, run 'none seed=0', epoch 3)") and len(why) < 450
    assert _saved(location) == {"down_seconds": 0.0, "exported_late": 0, "pending": True, "refused": why}
    assert f"refused by MLflow: {why}" in outage_line(_saved(location))


def test_a_refusal_at_the_studys_start_lets_the_study_go_on(mlflow_server, tmp_path, monkeypatch, caplog):
    """An experiment name MLflow refuses (past its length): the callback's setup raised out of Tune's callback setup,
    so the study stopped before training; now training goes on, the refusal said once and recorded."""
    monkeypatch.chdir(tmp_path)
    name = _name("startref")
    spec = _spec(name, str(mlflow_server), tmp_path / "st", f"tracking.experiment={'e' * 600}")
    location = StudyLocation(name, spec.storage)
    callback = A2MLflowCallback(spec, location, every=3600)
    with caplog.at_level(logging.WARNING, logger="launch.mlflow_export"):
        callback.setup()
    said = [r.getMessage() for r in caplog.records if r.name == "launch.mlflow_export"]
    assert len(said) == 1 and said[0].startswith(
        f"MLflow refused the export of study {name!r}: MLflow server {mlflow_server} answered INVALID_PARAMETER_VALUE")
    assert said[0].endswith(f"(`a2 mlflow sync {name}` exports it once that is settled)")
    assert callback.exporter is not None and callback.exporter.refused is not None
    callback.exporter.thread.join(5)
    assert not callback.exporter.thread.is_alive()  # nothing is tried again
    callback.on_experiment_end([])
    saved = _saved(location)
    assert saved["pending"] is True and saved["refused"].endswith("(opening the study's experiment and parent run)")
    assert saved["refused"].startswith(f"MLflow server {mlflow_server} answered INVALID_PARAMETER_VALUE")
    assert callback.outage_text().startswith("tracking: refused by MLflow, nothing exported since: MLflow server")
    assert not MlflowClient(str(mlflow_server)).search_experiments(filter_string=f"name LIKE '{name}%'")


def test_the_tracking_pre_flight_still_stops_a_study_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"http://127.0.0.1:{servers.closed_port()}"
    spec = _spec(_name("pre"), uri, tmp_path / "st")
    callback = A2MLflowCallback(spec, StudyLocation(spec.name, spec.storage), every=3600)
    with pytest.raises(TrackingError, match="127.0.0.1"):
        callback.setup()
    assert callback.exporter is None


def test_register_ensemble_leaves_mlflows_view_run_lines_out(mlflow_server, tmp_path, capsys, caplog,
                                                             one_torch_thread):
    from tests.test_first_hour import _checkpoints

    monkeypatch_env = os.environ.get("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")
    client = MlflowClient(str(mlflow_server))
    run = client.create_run(client.create_experiment(_name("quiet"))).info.run_id
    paths = _checkpoints(tmp_path, seeds=(0,))
    capsys.readouterr()
    model = register_ensemble(str(mlflow_server), run, paths, _name("quiet"), beam_size=2, max_len=5)
    out = capsys.readouterr().out
    assert model["version"] == 1 and model["reused"] is False
    assert "View run" not in out and "View experiment" not in out
    assert os.environ.get("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT") == monkeypatch_env  # nothing leaks
    # the silence is MLflow's URL lines only: the same run ended by MLflow outside it still prints them
    import mlflow

    mlflow.set_tracking_uri(str(mlflow_server))
    try:
        with mlflow.start_run(run_id=run):
            pass
    finally:
        mlflow.set_tracking_uri(None)
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    assert "View run" in capsys.readouterr().out
