"""MLflow as a researcher reads it back (audit 76): what one study's export must not do to another's runs."""
from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from a2core.errors import TrackingError
from dashboards.tracking import study_runs
from launch.conclusions import tune_trial
from launch.location import StudyLocation
from launch.mlflow_export import Export, end_reason
from launch.spec import load_study
from launch.tracking_writer import TAG_STORAGE, StudyTracker
from tests.test_mlflow_export import FakeTrial, write_epoch

pytestmark = pytest.mark.outside_ray_group

SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"


def _spec(tmp_path, uri: str, storage: str, *more: str):
    return load_study(SMOKE, [f"tracking.mlflow_uri={uri}", f"storage={tmp_path / storage}", "train.xe_epochs=3",
                              f"data.root={tmp_path / 'data'}", *more], check_files=False)


def _export(spec, trial_id: str) -> None:
    location = StudyLocation(spec.name, spec.storage)
    trial = FakeTrial(trial_id, {"fusion": "none", "seed": 0}, "TERMINATED")
    write_epoch(location, trial, 1, 10.0)
    Export(spec, location).run([tune_trial(trial)], end_reason(spec.name))


def test_a_study_of_the_same_name_in_another_storage_does_not_take_over_the_first_ones_runs(tmp_path, monkeypatch):
    """Two researchers run `a2-smoke` (each their own storage) against one team server: the second export took the
    first study's parent run (found by the study's name alone), set its `a2.storage` to its own and hung its trials
    under it, so both studies' trials showed as one study. Now it is refused, naming both storages."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    first, second = _spec(tmp_path, uri, "stA"), _spec(tmp_path, uri, "stB")
    assert first.name == second.name
    _export(first, "aaa_00000")
    _export(first, "aaa_00000")  # the same study exported again: its own runs, as before
    with pytest.raises(TrackingError, match="stA.*stB|tracking.experiment"):
        _export(second, "bbb_00000")
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parents = [r for r in runs if r.data.tags.get("a2.role") == "study"]
    assert len(parents) == 1 and parents[0].data.tags[TAG_STORAGE] == StudyLocation(first.name, first.storage).uri()
    assert sorted(r.data.tags.get("a2.trial_id") for r in runs if r.data.tags.get("a2.role") == "trial") == [
        "aaa_00000"]
    # with an experiment of its own, the second study is exported beside the first
    _export(_spec(tmp_path, uri, "stB", "tracking.experiment=smoke-b"), "bbb_00000")
    parent_b, _ = study_runs(uri, second.name, "smoke-b")
    assert parent_b.data.tags[TAG_STORAGE] == StudyLocation(second.name, second.storage).uri()


def test_a_parent_run_without_a_storage_tag_or_of_the_same_storage_is_taken(tmp_path):
    """A parent made before runs carried `a2.storage` (or by `a2 package`), and the same storage written another way
    (a trailing `/`), are the study's own: reused, not refused."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    old = StudyTracker(uri, "s1", artifact_location=str(tmp_path / "art")).start_study()
    assert StudyTracker(uri, "s1").start_study(tags={TAG_STORAGE: "s3://b/x/s1"}) == old
    assert StudyTracker(uri, "s1").start_study(tags={TAG_STORAGE: "s3://b/x/s1/"}) == old
    with pytest.raises(TrackingError, match="s3://b/y/s1"):
        StudyTracker(uri, "s1").start_study(tags={TAG_STORAGE: "s3://b/y/s1"})


def test_a_study_in_an_experiment_past_the_first_page_of_experiments_is_found(tmp_path, monkeypatch):
    """A study tracked under another experiment name is searched in every experiment; only MLflow's first page of
    them (1,000) was searched, so on a busy server its runs (`a2 report`'s, the leaderboard's) were not found. Pages
    of 2 stand in for pages of 1,000."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    tracker = StudyTracker(uri, "s1", experiment="team exp", artifact_location=str(tmp_path / "art"))
    parent = tracker.start_study()
    child = tracker.trial_run("t0", {"fusion": "none"})
    for n in range(4):  # newer: listed first
        client.create_experiment(f"other-{n}")
    real = MlflowClient.search_experiments
    monkeypatch.setattr(MlflowClient, "search_experiments",
                        lambda self, *a, **kw: real(self, *a, **{**kw, "max_results": 2}))
    found, children = study_runs(uri, "s1")
    assert found is not None and found.info.run_id == parent
    assert [r.info.run_id for r in children] == [child]
