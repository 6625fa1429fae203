"""MLflow refusing a study's export, told apart from a server that is down (audit 77), against a real tracking server
(`tests/mlflowserver.py`): the export thread (`StudyExporter`) says a refusal once in its own words and stops
exporting that study, the study goes on; a trashed experiment of another study's storage stays in the trash; a
rehearsal's runs are marked in the study's experiment renamed since."""
from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

import tests.mlflowserver as servers
from a2core.errors import TrackingError
from launch.location import StudyLocation
from launch.mlflow_callback import A2MLflowCallback
from launch.mlflow_export import Export, StudyExporter, end_reason
from launch.spec import load_study
from launch.tracking_writer import TAG_STORAGE, StudyTracker, mark_runs
from tests.test_mlflow_export import FakeTrial, write_epoch

pytestmark = pytest.mark.outside_ray_group

mlflow_server = servers.mlflow_server  # the real server, a fixture of this module
SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _spec(name: str, uri: str, storage: Path):
    return load_study(SMOKE, [f"name={name}", f"tracking.mlflow_uri={uri}", f"storage={storage}",
                              "train.xe_epochs=3", f"data.root={storage.parent / 'data'}"], check_files=False)


def _renamed_twice(client, name, tmp_path, monkeypatch) -> str:
    ids = []
    for n in range(2):  # each made under the name (as a study's tracker makes it), then renamed
        ids.append(client.create_experiment(name, tags={"a2.study": name}))
        client.rename_experiment(ids[-1], f"{name}-old{n}")
    return (f"MLflow experiment {name!r} is gone, and 2 experiments created under that name were renamed: "
            f"'{name}-old0' (id {ids[0]}), '{name}-old1' (id {ids[1]}); rename the study's own back to {name!r}, or "
            f"set tracking.experiment to its name")


def _another_storage(client, name, tmp_path, monkeypatch) -> str:
    other = _spec(name, client.tracking_uri, tmp_path / "other")
    Export(other, StudyLocation(name, other.storage)).open()
    return (f"MLflow experiment {name!r} at {client.tracking_uri} already holds study {name!r} stored at "
            f"{StudyLocation(name, other.storage).uri()}, not this one's "
            f"{StudyLocation(name, str(tmp_path / 'st')).uri()}; run this study with "
            f"tracking.experiment=<an experiment of its own> or under another name")


def _in_hidden_trash(client, name, tmp_path, monkeypatch) -> str:
    exp_id = client.create_experiment(name)
    client.delete_experiment(exp_id)
    real = MlflowClient.get_experiment_by_name

    def active_only(self, experiment_name):  # a store whose lookup by name leaves the trash out
        exp = real(self, experiment_name)
        return None if exp is not None and exp.lifecycle_stage == "deleted" else exp

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", active_only)
    return (f"MLflow experiment {name!r} (id {exp_id}) at {client.tracking_uri} is in MLflow's trash, and MLflow "
            f"makes no new one of its name: restore it (`mlflow experiments restore --experiment-id {exp_id}`) or "
            f"purge it (`mlflow gc --backend-store-uri <the server's store> --experiment-ids {exp_id}`), or set "
            f"tracking.experiment to another name")


@pytest.mark.parametrize("refusal", [_renamed_twice, _another_storage, _in_hidden_trash])
def test_a_refusal_is_said_once_in_its_own_words_and_stops_the_export_not_an_outage(mlflow_server, tmp_path,
                                                                                    monkeypatch, caplog, refusal):
    """A server that answers and refuses the study's experiment (several renamed ones of its name, another study's
    storage, a name held by a hidden trash) was taken for an outage: "MLflow server ... not answering (...)", the
    outage clock running and the export tried again every 2 s for the rest of the study. Now: one warning with the
    refusal's words, the export of the study stopped, no outage; the end's tracking line says it was refused, why,
    and that `a2 mlflow sync` writes the record later."""
    monkeypatch.chdir(tmp_path)
    name = _name("refused")
    client = MlflowClient(str(mlflow_server))
    why = refusal(client, name, tmp_path, monkeypatch)
    spec = _spec(name, str(mlflow_server), tmp_path / "st")
    location = StudyLocation(name, spec.storage)
    trial = FakeTrial("t0", {"fusion": "none", "seed": 0}, "RUNNING")
    write_epoch(location, trial, 1, 10.0)
    # the state of the export thread after its tracker was dropped (the study's experiment purged meanwhile)
    exporter = StudyExporter(Export(spec, location), lambda: [trial], every=3600)
    with caplog.at_level(logging.WARNING, logger="launch.mlflow_export"):
        assert exporter.once() is False
        assert exporter.once() is False  # not tried again: nothing more is said
        exporter.thread.join(5)
        assert not exporter.thread.is_alive()  # the thread of the study's export ended
        callback = A2MLflowCallback(spec, location)
        callback.exporter = exporter
        live = callback.outage_text()
        callback.outage, callback.exporter = exporter.close(end_reason(name)), None
    said = [r.getMessage() for r in caplog.records if r.name == "launch.mlflow_export"]
    assert said == [f"MLflow refused the export of study {name!r}: {why}; the study goes on and its record is whole "
                    f"(`a2 mlflow sync {name}` exports it once that is settled)"]
    assert not any("not answering" in text for text in said)
    assert exporter.status() == {"down_seconds": 0.0, "exported_late": 0, "pending": False, "refused": why}
    line = (f"tracking: refused by MLflow, nothing exported since: {why}; the study goes on and its record is whole "
            f"(`a2 mlflow sync {name}` exports it once that is settled)")
    assert live == line and callback.outage_text() == line
    assert callback.outage == {"down_seconds": 0.0, "exported_late": 0, "pending": True, "refused": why}
    saved = json.loads(location.at("tracking", "outage.json").read_text())
    # summary.json: not all exported, and why (the first refusal, where it happened), kept until `a2 mlflow sync`
    assert saved == {"down_seconds": 0.0, "exported_late": 0, "pending": True,
                     "refused": f"{why} (opening the study's experiment and parent run)"}


def test_the_server_down_is_still_an_outage(tmp_path, monkeypatch, caplog):
    """The refusal's distinction leaves an outage as it was: the server not answering is waited out."""
    monkeypatch.chdir(tmp_path)
    uri = f"http://127.0.0.1:{servers.closed_port()}"
    spec = _spec(_name("down"), uri, tmp_path / "st")
    exporter = StudyExporter(Export(spec, StudyLocation(spec.name, spec.storage)), lambda: [], every=3600)
    with caplog.at_level(logging.WARNING, logger="launch.mlflow_export"):
        assert exporter.once() is False and exporter.once() is False
    assert [r.getMessage() for r in caplog.records if r.name == "launch.mlflow_export"] == [
        f"MLflow server {uri} not answering (MLflow server {uri} does not answer); the study's record is exported "
        f"when it is back"]
    status = exporter.status()
    assert status["pending"] is True and "refused" not in status and exporter.thread.is_alive()
    exporter.stop.set()
    exporter.wake.set()
    exporter.thread.join(5)


def test_a_trashed_experiment_of_another_studys_storage_is_refused_and_left_in_the_trash(mlflow_server, tmp_path):
    """The experiment of the study's name in MLflow's trash holds another study (another storage): it was restored,
    then refused by the storage check, so left restored; now refused first, left in the trash."""
    name = _name("theirs")
    client = MlflowClient(str(mlflow_server))
    theirs = StudyTracker(str(mlflow_server), name)
    theirs.start_study(tags={TAG_STORAGE: str(tmp_path / "theirs")})
    client.delete_experiment(theirs.experiment_id)
    with pytest.raises(TrackingError) as err:
        StudyTracker(str(mlflow_server), name).start_study(tags={TAG_STORAGE: str(tmp_path / "ours")})
    assert str(err.value) == (
        f"MLflow experiment {name!r} (in MLflow's trash, left there) at {mlflow_server} already holds study {name!r} "
        f"stored at {tmp_path / 'theirs'}, not this one's {tmp_path / 'ours'}; run this study with "
        f"tracking.experiment=<an experiment of its own> or under another name")
    assert client.get_experiment(theirs.experiment_id).lifecycle_stage == "deleted"
    assert client.get_run(theirs.parent_run_id).info.lifecycle_stage == "deleted"


def test_a_trashed_parent_run_of_another_studys_storage_is_refused_and_left_in_the_trash(mlflow_server, tmp_path):
    """The same for the parent run alone in the trash (its experiment active): not restored for another storage."""
    name = _name("theirrun")
    client = MlflowClient(str(mlflow_server))
    theirs = StudyTracker(str(mlflow_server), name)
    parent = theirs.start_study(tags={TAG_STORAGE: str(tmp_path / "theirs")})
    client.delete_run(parent)
    with pytest.raises(TrackingError) as err:
        StudyTracker(str(mlflow_server), name).start_study(tags={TAG_STORAGE: str(tmp_path / "ours")})
    assert str(err.value).startswith(f"MLflow experiment {name!r} (its parent run in MLflow's trash, left there) at ")
    assert client.get_run(parent).info.lifecycle_stage == "deleted"
    assert client.search_runs([theirs.experiment_id], run_view_type=ViewType.ALL)[0].info.run_id == parent


def test_mark_runs_marks_the_runs_of_the_studys_experiment_renamed_since(mlflow_server):
    """A rehearsal's runs marked by the experiment's name only: renamed in the MLflow UI, none were marked."""
    name = _name("rehe")
    client = MlflowClient(str(mlflow_server))
    tracker = StudyTracker(str(mlflow_server), name)
    parent = tracker.start_study()
    child = tracker.trial_run("t0", {"lr": 0.1}, run_name="lr=0.1")
    client.rename_experiment(tracker.experiment_id, f"{name} (kept)")
    assert mark_runs(str(mlflow_server), name, {"a2.rehearsal": "true"}, "rehearsal-") == 2
    runs = {run_id: client.get_run(run_id) for run_id in (parent, child)}
    assert {r.info.run_name for r in runs.values()} == {f"rehearsal-{name}", "rehearsal-lr=0.1"}
    assert {r.data.tags["a2.rehearsal"] for r in runs.values()} == {"true"}
    assert mark_runs(str(mlflow_server), _name("none"), {"a2.rehearsal": "true"}) == 0
