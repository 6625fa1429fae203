"""MLflow as a team's server holds it (audit 77), against a real tracking server (`tests/mlflowserver.py`): a study's
experiment renamed or in MLflow's trash, a param key twice once cleaned, a model version reused or tagged long."""
from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import tests.mlflowserver as servers
from a2core.errors import TrackingError
from dashboards.tracking import study_pointer, study_runs
from launch.conclusions import tune_trial
from launch.location import StudyLocation
from launch.mlflow_export import Export, end_reason
from launch.model_registry import TAG_CONTENT_HASH, content_hash, register_ensemble
from launch.spec import load_study
from launch.tracking_writer import StudyTracker
from tests.test_mlflow_export import FakeTrial, write_epoch

pytestmark = pytest.mark.outside_ray_group

mlflow_server = servers.mlflow_server  # the real server, a fixture of this module
SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_a_renamed_experiment_keeps_the_studys_runs_not_a_new_one_of_the_old_name(mlflow_server, tmp_path,
                                                                                   monkeypatch, caplog):
    """The study's experiment renamed in the MLflow UI: the next export made a new experiment of the old name, with
    a new parent run, so the study's trials were split in two experiments. It follows the renamed one (found by the
    `a2.study` tag it was created with), said in one warning; the read side finds it too."""
    monkeypatch.chdir(tmp_path)
    name = _name("ren")
    spec = load_study(SMOKE, [f"name={name}", f"tracking.mlflow_uri={mlflow_server}", f"storage={tmp_path / 'st'}",
                              "train.xe_epochs=3", f"data.root={tmp_path / 'data'}"], check_files=False)
    location = StudyLocation(spec.name, spec.storage)
    client = MlflowClient(str(mlflow_server))
    first = FakeTrial("t0", {"fusion": "none", "seed": 0}, "TERMINATED")
    write_epoch(location, first, 1, 10.0)
    Export(spec, location).run([tune_trial(first)], end_reason(name))
    exp_id = client.get_experiment_by_name(name).experiment_id
    client.rename_experiment(exp_id, f"{name} (archived)")
    second = FakeTrial("t1", {"fusion": "none", "seed": 1}, "TERMINATED")
    write_epoch(location, second, 1, 12.0)
    with caplog.at_level(logging.WARNING, logger="launch.tracking_writer"):
        Export(spec, location).run([tune_trial(first), tune_trial(second)], end_reason(name))
    assert client.get_experiment_by_name(name) is None  # no second experiment of the old name
    runs = client.search_runs([exp_id])
    assert sorted(r.data.tags.get("a2.trial_id", "parent") for r in runs) == ["parent", "t0", "t1"]
    parent = next(r for r in runs if r.data.tags.get("a2.role") == "study")
    assert {r.data.tags.get("mlflow.parentRunId") for r in runs if r is not parent} == {parent.info.run_id}
    assert [r.getMessage() for r in caplog.records if "renamed" in r.getMessage()] == [
        f"MLflow experiment {name!r} (id {exp_id}) was renamed '{name} (archived)'; the study's runs are exported "
        f"there (to start a new experiment instead, set tracking.experiment)"]
    found, children = study_runs(str(mlflow_server), name)
    assert found.info.run_id == parent.info.run_id and len(children) == 2
    assert f"/#/experiments/{exp_id}/runs?" in study_pointer(str(mlflow_server), name)


def test_two_renamed_experiments_of_the_name_are_refused_in_one_line(mlflow_server):
    """Which of two experiments created as the study's name and both renamed holds it, a person says: one line."""
    client = MlflowClient(str(mlflow_server))
    name = _name("two")
    ids = []
    for n in range(2):  # each made under the name (as a study's tracker makes it), then renamed
        ids.append(client.create_experiment(name, tags={"a2.study": name}))
        client.rename_experiment(ids[-1], f"{name}-old{n}")
    StudyTracker(str(mlflow_server), name, experiment=f"{name}-old0").start_study()
    with pytest.raises(TrackingError) as err:
        StudyTracker(str(mlflow_server), name).start_study()
    assert str(err.value) == (
        f"MLflow experiment {name!r} is gone, and 2 experiments created under that name were renamed: "
        f"'{name}-old0' (id {ids[0]}), '{name}-old1' (id {ids[1]}); rename the study's own back to {name!r}, or set "
        f"tracking.experiment to its name")
    assert client.get_experiment_by_name(name) is None
    assert study_runs(str(mlflow_server), name)[0] is not None  # the read side searches every experiment


def test_an_experiment_in_the_trash_is_restored_with_one_warning_saying_how_to_drop_it(mlflow_server, caplog):
    name = _name("trash")
    client = MlflowClient(str(mlflow_server))
    tracker = StudyTracker(str(mlflow_server), name)
    parent = tracker.start_study()
    client.delete_experiment(tracker.experiment_id)
    with caplog.at_level(logging.WARNING, logger="launch.tracking_writer"):
        again = StudyTracker(str(mlflow_server), name)
        assert again.start_study() == parent
    exp_id = tracker.experiment_id
    assert again.experiment_id == exp_id and client.get_experiment(exp_id).lifecycle_stage == "active"
    assert [r.getMessage() for r in caplog.records if "trash" in r.getMessage()] == [
        f"MLflow experiment {name!r} (id {exp_id}) was in MLflow's trash; restored with its runs (to drop it for good "
        f"instead: delete it again, purge it with `mlflow gc --backend-store-uri <the server's store> "
        f"--experiment-ids {exp_id}`, and export again)"]


def test_a_name_in_a_trash_the_lookup_hides_is_one_line_with_how_to_restore_or_purge(mlflow_server, monkeypatch):
    """A store whose lookup by name leaves deleted experiments out: MLflow refuses to make one of a name in its trash
    (RESOURCE_ALREADY_EXISTS), which came out as MLflow's exception with its SQL; now one line, naming the id."""
    name = _name("hidden")
    client = MlflowClient(str(mlflow_server))
    exp_id = client.create_experiment(name)
    client.delete_experiment(exp_id)
    real = MlflowClient.get_experiment_by_name

    def active_only(self, experiment_name):
        exp = real(self, experiment_name)
        return None if exp is not None and exp.lifecycle_stage == "deleted" else exp

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", active_only)
    with pytest.raises(TrackingError) as err:
        StudyTracker(str(mlflow_server), name).start_study()
    assert str(err.value) == (
        f"MLflow experiment {name!r} (id {exp_id}) at {mlflow_server} is in MLflow's trash, and MLflow makes no new "
        f"one of its name: restore it (`mlflow experiments restore --experiment-id {exp_id}`) or purge it (`mlflow gc "
        f"--backend-store-uri <the server's store> --experiment-ids {exp_id}`), or set tracking.experiment to another "
        f"name")
    assert client.get_experiment(exp_id).lifecycle_stage == "deleted"  # left as it was


def test_config_keys_that_clean_to_one_param_are_logged_once(mlflow_server):
    """`a@b` and `a#b` are both `a_b` to MLflow: the batch named the param twice, which MLflow refuses, so the
    trial's run never got its params (and every later export failed on it)."""
    tracker = StudyTracker(str(mlflow_server), _name("keys"))
    run_id = tracker.trial_run("t0", {"extra": {"a@b": 1, "a#b": 2}, "lr": 0.5})
    assert MlflowClient(str(mlflow_server)).get_run(run_id).data.params == {"extra.a_b": "1", "lr": "0.5"}
    assert tracker.trial_run("t0", {"extra": {"a@b": 1, "a#b": 2}, "lr": 0.5}) == run_id  # again: nothing new


def test_a_reused_model_version_names_its_own_run(mlflow_server, tmp_path):
    """`a2 package` again after the study's parent run was made anew: the version that serves the same checkpoints
    is reused, and its run is the one it links to in MLflow, not the caller's new run."""
    client = MlflowClient(str(mlflow_server))
    name = _name("model")
    exp = client.create_experiment(_name("reg"))
    first, later = client.create_run(exp).info.run_id, client.create_run(exp).info.run_id
    checkpoint = tmp_path / "a.pt"
    checkpoint.write_bytes(b"weights")
    client.create_registered_model(name)
    version = client.create_model_version(name, "s3://somewhere/model", run_id=first)
    client.set_model_version_tag(name, version.version, TAG_CONTENT_HASH, content_hash([checkpoint], 5, 20))
    model = register_ensemble(str(mlflow_server), later, [checkpoint], name)
    assert model == {"name": name, "version": int(version.version), "model_uri": f"models:/{name}/{version.version}",
                     "logged_model_uri": "s3://somewhere/model", "run_id": first, "reused": True}


def test_tags_past_the_registrys_limit_are_cut_and_the_version_keeps_its_content_hash(mlflow_server, tmp_path,
                                                                                      one_torch_thread):
    """A tag over MLflow's 100,000 characters (`a2.trial_ids` of a large ensemble) was refused after the version was
    registered, before its content hash was set: every rerun registered the ensemble again."""
    from tests.test_first_hour import _checkpoints

    client = MlflowClient(str(mlflow_server))
    name = _name("long")
    run = client.create_run(client.create_experiment(_name("reg"))).info.run_id
    paths = _checkpoints(tmp_path, seeds=(0,))
    model = register_ensemble(str(mlflow_server), run, paths, name, beam_size=2, max_len=5,
                              tags={"a2.trial_ids": "t" * 100_001}, description="d" * 6000)
    version = client.get_model_version(name, str(model["version"]))
    assert (model["version"], model["reused"], version.run_id) == (1, False, run)
    assert len(version.tags["a2.trial_ids"]) == 100_000 and len(version.description) == 5000
    assert version.tags[TAG_CONTENT_HASH] == content_hash(paths, 2, 5)
    again = register_ensemble(str(mlflow_server), run, paths, name, beam_size=2, max_len=5)
    assert (again["version"], again["reused"]) == (1, True)
