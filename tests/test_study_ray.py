"""`a2 study run/status` end to end on a real (local) Ray: a one-trial study whose trial is a 2-worker DDP job."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.raycluster import a2, mlflow_history, mlflow_trials, tiny_data, tiny_study, trial_runs  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def local_env() -> dict:
    """The environment of a study that starts its own local Ray (no cluster address inherited)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return env


def test_one_trial_study_trains_with_ddp_and_is_tracked(tmp_path, tiny_data):
    name = "ray-one"
    study = tiny_study(tmp_path, name, tiny_data, fusions=("max",), seeds=(0,), epochs=3, workers=2)
    run = a2("study", "run", str(study), cwd=tmp_path, env=local_env())
    out = run.stdout
    assert run.returncode == 0, out[-6000:]

    # The trial was one Ray Train job with two workers in one gloo process group (a2core.train's own line).
    assert "world_size=2" in out, out[-4000:]

    # summary.json: the best trial, its best checkpoint, every trial's epochs.
    study_dir = tmp_path / "studies" / name
    summary = json.loads((study_dir / "summary.json").read_text())
    assert summary["complete"] and summary["num_trials"] == 1
    (trial,) = summary["trials"]
    assert trial["state"] == "TERMINATED"
    assert trial["epochs_reported"] == [1, 2, 3]
    assert trial["fusion"] == "max" and trial["seed"] == 0
    best = summary["best"]
    assert best["trial_id"] == trial["trial_id"]
    assert Path(best["checkpoint"]).is_file(), best["checkpoint"]
    assert best["config"]["model"]["fusion"] == "max"
    assert summary["baseline"] is None and summary["beats_baseline"] is None
    assert "no baseline (fusion none) trial with seed 0" in out
    assert (study_dir / "study.yaml").is_file()
    assert set(trial_runs(tmp_path / "studies", name)) == {trial["trial_id"]}

    # MLflow: a parent run for the study, a child run for the trial with one value per epoch.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    runs = mlflow_trials(uri, name)
    assert set(runs) == {trial["trial_id"]}
    child = runs[trial["trial_id"]]
    assert child.info.status == "FINISHED"
    assert [step for step, _, _ in mlflow_history(uri, child.info.run_id, "val/CIDEr")] == [1, 2, 3]
    assert [step for step, _, _ in mlflow_history(uri, child.info.run_id, "train/loss")] == [1, 2, 3]

    # `a2 study status NAME` finds the study from its name alone and shows the trial with its epochs.
    status = a2("study", "status", name, cwd=tmp_path, env=local_env(), timeout=120)
    assert status.returncode == 0, status.stdout
    line = next(line for line in status.stdout.splitlines() if line.startswith(trial["trial_id"]))
    assert "TERMINATED" in line and "3/3" in line and "max" in line
    as_json = a2("study", "status", name, "--json", cwd=tmp_path, env=local_env(), timeout=120)
    data = json.loads(as_json.stdout[as_json.stdout.index("{"):])
    assert data["trials"][0]["epochs_done"] == 3

    # Running the same study again is refused: it exists (resume it instead).
    again = a2("study", "run", str(study), cwd=tmp_path, env=local_env(), timeout=120)
    assert again.returncode == 2 and "a2 study resume" in again.stdout


def test_invalid_study_fails_before_ray_starts(tmp_path, tiny_data):
    study = tiny_study(tmp_path, "ray-bad", tiny_data, extra={"search.space.lambda": {"loguniform": [0, 0.2]}})
    run = a2("study", "run", str(study), cwd=tmp_path, env=local_env(), timeout=120)
    assert run.returncode == 2, run.stdout
    assert "search.space.lambda.loguniform" in run.stdout
    assert "Ray" not in run.stdout.replace("a2 study", "")
    assert not (tmp_path / "studies").exists()


def test_trial_larger_than_the_cluster_is_refused(tmp_path, tiny_data):
    study = tiny_study(tmp_path, "ray-big", tiny_data, workers=8, cpus_per_worker=1)
    run = a2("study", "run", str(study), cwd=tmp_path, env=local_env(), timeout=180)
    assert run.returncode == 2, run.stdout[-3000:]
    assert "resources.cpus_per_worker" in run.stdout and "the cluster has" in run.stdout
    assert not (tmp_path / "studies" / "ray-big" / "study.yaml").exists()
