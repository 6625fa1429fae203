"""`a2 study run/status` end to end on a real (local) Ray: a one-trial study whose trial is a 2-worker DDP job, and
a study of one-worker trials that train in the Tune trial itself; both account for their compute."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from tests.raycluster import (  # noqa: F401 - tiny_data is a fixture
    a2, kill_group, mlflow_history, mlflow_trials, start_a2, tiny_data, tiny_study, trial_runs, wait_for)
from dashboards.tracking import study_runs
from launch.layout import RESULTS_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def local_env() -> dict:
    """The environment of a study that starts its own local Ray (no cluster address inherited)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return env


def _ray_start_line(out: str, study_dir: Path) -> str:
    """Ray's "Started a local Ray instance" line, from the run's output or its driver.log."""
    text = out + (study_dir / "driver.log").read_text(errors="replace")
    return next(line for line in text.splitlines() if "Started a local Ray instance" in line)


def test_one_trial_study_trains_with_ddp_and_is_tracked(tmp_path, tiny_data):
    name = "ray-one"
    study = tiny_study(tmp_path, name, tiny_data, fusions=("max",), seeds=(0,), epochs=3, workers=2)
    run = a2("study", "run", str(study), cwd=tmp_path, env=local_env())
    out = run.stdout
    assert run.returncode == 0, out[-6000:]

    # The trial was one Ray Train job with two workers in one gloo process group (a2core.train's own line).
    assert "world_size=2" in out, out[-4000:]
    # its local Ray with the dashboard, whose state API Ray Train's placement-group cleaner asks
    assert "View the dashboard at" in _ray_start_line(out, tmp_path / "studies" / name), out[-4000:]

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
    assert not Path(best["checkpoint"]).is_absolute()  # relative to the study's folder: a copy reads its own
    assert (study_dir / best["checkpoint"]).is_file(), best["checkpoint"]
    assert best["config"]["model"]["fusion"] == "max"
    assert summary["baseline"] is None and summary["beats_baseline"] is None
    assert "no baseline (fusion none) trial with seed 0" in out
    assert (study_dir / "study.yaml").is_file()
    assert set(trial_runs(tmp_path / "studies", name)) == {trial["trial_id"]}
    # rank 0 wrote where it was within its epoch into the trial's run folder (`launch.trainable.EpochProgress`)
    _assert_progress_written(trial_runs(tmp_path / "studies", name)[trial["trial_id"]], epochs=3)

    # MLflow: a parent run for the study, a child run for the trial with one value per epoch.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    runs = mlflow_trials(uri, name)
    assert set(runs) == {trial["trial_id"]}
    child = runs[trial["trial_id"]]
    assert child.info.status == "FINISHED"
    assert [step for step, _, _ in mlflow_history(uri, child.info.run_id, "val/CIDEr")] == [1, 2, 3]
    assert [step for step, _, _ in mlflow_history(uri, child.info.run_id, "train/loss")] == [1, 2, 3]
    _assert_compute_logged(uri, name, summary, device="cpu_s")

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


def _assert_compute_logged(uri: str, name: str, summary: dict, device: str) -> None:
    """Every trial's run has cumulative `compute/wall_s` and `compute/<device>` per epoch whose last value is the
    trial's total in summary.json; the parent run has the study's totals, their sums."""
    runs = mlflow_trials(uri, name)
    for trial in summary["trials"]:
        run_id = runs[trial["trial_id"]].info.run_id
        for unit in ("wall_s", device):
            history = mlflow_history(uri, run_id, f"compute/{unit}")
            steps, values = [h[0] for h in history], [h[1] for h in history]
            assert steps == trial["epochs_reported"], (unit, steps)
            assert values == sorted(values) and values[0] > 0, (unit, values)  # cumulative
            assert values[-1] == pytest.approx(trial["compute"][unit])
    totals = summary["compute"]
    for unit in ("wall_s", device):
        assert totals[f"total_{unit}"] == pytest.approx(sum(t["compute"][unit] for t in summary["trials"]))
    parent, _ = study_runs(uri, name)
    logged = parent.data.metrics
    assert {k: logged[f"compute/{k}"] for k in totals} == pytest.approx(totals)


def test_one_worker_trials_train_in_the_tune_trial(tmp_path, tiny_data, monkeypatch):
    """Two one-worker trials: no Ray Train run, the checkpoints in the study's trials folder (best and latest
    kept), the compute in MLflow, summary.json and `status`, with the cost from `resources.price_per_hour`."""
    name = "ray-local"
    study = tiny_study(tmp_path, name, tiny_data, fusions=("none", "max"), seeds=(0,), epochs=4, workers=1,
                       cpus_per_worker=1, extra={"resources.price_per_hour": 3.6, "search.scheduler": {"fifo": {}}})
    run = a2("study", "run", str(study), cwd=tmp_path, env=local_env())
    out = run.stdout
    assert run.returncode == 0, out[-6000:]
    assert "world_size=2" not in out
    # nothing needs the dashboard of a local Ray without Ray Train: it starts without (1-2 s sooner)
    assert "View the dashboard at" not in _ray_start_line(out, tmp_path / "studies" / name), out[-4000:]

    summary = json.loads((tmp_path / "studies" / name / "summary.json").read_text())
    assert summary["complete"] and len(summary["trials"]) == 2
    folders = trial_runs(tmp_path / "studies", name)
    assert set(folders) == {t["trial_id"] for t in summary["trials"]}
    for trial in summary["trials"]:
        files = {p.name for p in folders[trial["trial_id"]].iterdir()}
        assert "checkpoint_manager_snapshot.json" not in files  # no Ray Train run
        _assert_progress_written(folders[trial["trial_id"]], epochs=4)
        assert trial["state"] == "TERMINATED" and trial["epochs_reported"] == [1, 2, 3, 4]
        # The latest checkpoint and the best two by val/CIDEr (num_to_keep) are kept, each complete.
        kept = sorted(int(f[len("checkpoint_epoch"):]) for f in files if f.startswith("checkpoint_epoch"))
        assert 4 in kept and trial["best_checkpoint_epoch"] in kept and 2 <= len(kept) <= 3, kept
        for epoch in kept:
            assert (folders[trial["trial_id"]] / f"checkpoint_epoch{epoch:04d}" / "checkpoint.pt").is_file()
    assert (tmp_path / "studies" / name / summary["best"]["checkpoint"]).is_file()  # relative to the study
    # One trial at a time: the second trained in the first one's process (Tune's reuse_actors), no new start-up.
    results = sorted((tmp_path / "studies" / name).glob("*/result.json"))
    assert len(results) == 2, results
    pids = {json.loads(line)["pid"] for path in results for line in path.read_text().splitlines() if line.strip()}
    assert len(pids) == 1, pids

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for trial_id, child in mlflow_trials(uri, name).items():
        assert child.info.status == "FINISHED"
        assert [step for step, _, _ in mlflow_history(uri, child.info.run_id, "val/CIDEr")] == [1, 2, 3, 4]
        # the selected checkpoint on the test split, when the run ended: metrics and per-image scores
        assert [step for step, _, _ in mlflow_history(uri, child.info.run_id, "test/CIDEr")] == [4]
        from mlflow.tracking import MlflowClient

        from launch.record import PER_IMAGE

        scores = json.loads(Path(MlflowClient(uri).download_artifacts(child.info.run_id, PER_IMAGE["test"],
                                                                      str(tmp_path / trial_id))).read_text())
        assert scores and all(isinstance(v, float) for v in scores.values())
    assert all(t["test"] is not None for t in summary["trials"])
    _assert_compute_logged(uri, name, summary, device="cpu_s")
    totals = summary["compute"]
    assert totals["stopped_wall_s"] == 0 and totals["saved_cpu_s"] == 0  # nothing was stopped early (FIFO)
    assert totals["total_cost"] == pytest.approx(3.6 * totals["total_wall_s"] / 3600)

    status = a2("study", "status", name, cwd=tmp_path, env=local_env(), timeout=120)
    assert status.returncode == 0, status.stdout
    assert f"compute: {totals['total_wall_s']:.0f} s wall, {totals['total_cpu_s']:.0f} CPU-s" in status.stdout

    # what status read of Tune's real experiment state, without Ray, is what Ray's ExperimentAnalysis reads of it
    from ray.tune import ExperimentAnalysis

    from launch.conclusions import tune_trial
    from launch.storage import Location
    from launch.verify import experiment_trials

    folder = tmp_path / "studies" / name
    read = experiment_trials(Location(str(folder)))
    assert read == [tune_trial(t) for t in ExperimentAnalysis(str(folder)).trials]
    assert {t.trial_id for t in read} == {t["trial_id"] for t in summary["trials"]}

    # The driver's digest, made after Tune's last save: a later read takes Tune's word and every trial from it,
    # parsing no result log and no experiment state, and gives the summary the files give.
    import launch.record
    from launch.location import DIGEST_FILE, StudyLocation

    location = StudyLocation(name, str(tmp_path / "studies"))
    with monkeypatch.context() as patched:
        patched.setattr(launch.record, "record_trial", lambda *a, **k: pytest.fail("a trial read from its files"))
        patched.setattr(launch.record, "tune_trials", lambda *a: pytest.fail("Tune's experiment state parsed"))
        kept = launch.record.StudyRecord.load(location).summary()
    location.at(DIGEST_FILE).delete()
    fresh = launch.record.StudyRecord.load(location).summary()
    assert {**kept, "updated": None} == {**fresh, "updated": None}


@pytest.mark.outside_ray_group  # starts no Ray: runs beside the group
def _assert_progress_written(run: Path, epochs: int) -> None:
    """The trial process wrote `progress.json` at its first step at least (then every 30 s: these epochs are short),
    a record `launch.layout.progress_record` reads."""
    written = json.loads((run / "progress.json").read_text())
    assert written["stage"] == "xe" and 1 <= written["epoch"] <= epochs, written
    assert 1 <= written["done"] <= written["total"], written


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
    # a local study: checked against this machine before Ray starts and before the study's folder exists
    assert "resources.cpus_per_worker" in run.stdout and "but this machine has" in run.stdout
    assert not (tmp_path / "studies" / "ray-big").exists()


def two_learning_rates(tmp_path, name: str, tiny_data) -> Path:
    """A study of two groups of 3 seeds, lr_factor 1 and 1e-4 (BLEU-1 after one epoch of this tiny model: 14.0 for
    every seed at 1, 0-2.5 at 1e-4), 3 epochs, ASHA holding replicates at its rungs (1, 2) and stopping a group
    below the cutoff at all (min_gap_se 0); one trial runs at a time (1.5 of the 2 CPUs each), in the grid's order."""
    return tiny_study(tmp_path, name, tiny_data, fusions=("none",), epochs=3, workers=1, cpus_per_worker=1.5,
                      max_concurrent=6, extra={
                          "train.warmup": 1,
                          "search.metric": "val/BLEU-1",
                          "search.space": {"fusion": {"grid": ["none"]}, "train.lr_factor": {"grid": [1.0, 0.0001]}},
                          "search.replicates": 3,
                          "search.scheduler": {"asha": {"grace_period": 1, "reduction_factor": 2, "min_gap_se": 0,
                                                        "hold_at_rungs": True}}})


def test_replicates_held_at_a_rung_resume_or_stop_with_their_group(tmp_path, tiny_data):
    """`hold_at_rungs`: a replicate that reaches a rung before its group is paused there; when the group is judged
    it resumes (reporting its rung result again first) and goes on, or stops at that result without training
    another epoch. Every trial ends TERMINATED in the saved experiment (a resume would not train it again).
    One trial runs at a time (1.5 of the 2 CPUs each), in the grid's order: the lr 1 group reaches rung 1 first
    whatever the machine's load, so the lr 1e-4 group is judged against it (with trials side by side, which group
    completed the rung first depended on timing, and a group judged first is compared with nothing)."""
    name = "ray-hold"
    study = two_learning_rates(tmp_path, name, tiny_data)
    run = a2("study", "run", str(study), cwd=tmp_path, env=local_env())
    assert run.returncode == 0, run.stdout[-6000:]

    summary = json.loads((tmp_path / "studies" / name / "summary.json").read_text())
    trials = summary["trials"]
    assert len(trials) == 6 and all(t["state"] == "TERMINATED" for t in trials), [t["state"] for t in trials]
    by_lr = {}
    for t in trials:
        by_lr.setdefault(t["sampled"]["train.lr_factor"], []).append(t)
    assert [t["epochs_done"] for t in by_lr[1.0]] == [3, 3, 3]
    for t in by_lr[0.0001]:  # stopped at rung 1, each after exactly one epoch (held ones did not train on)
        assert t["epochs_done"] == 1 and t["stopped_early"]["rung"] == 1, t

    # At least one trial was paused and resumed: its rung result reported twice to Tune.
    repeated = 0
    for path in (tmp_path / "studies" / name).glob("*/result.json"):
        epochs = [json.loads(line)["epoch"] for line in path.read_text().splitlines() if line.strip()]
        repeated += len(epochs) - len(set(epochs))
    assert repeated >= 1


def test_a_study_killed_and_resumed_stops_a_group_against_groups_judged_before_the_kill(tmp_path, tiny_data):
    """Tune 2.60 saves no scheduler and `Tuner.restore` unpickles the one `tuner.pkl` holds, as it was before the
    first trial; the searcher's saves carry ReplicateASHA's state (`GridCrossedSearcher.carry_state_of`). One trial
    at a time in the grid's order (as in the test above): the lr 1 group trains all its epochs, judged at the rungs;
    the driver is killed once Tune's saved state holds that judgement, and after `a2 study resume` the lr 1e-4 group
    is judged against it and stopped at rung 1 (forgotten, it would be judged against nothing and train in full)."""
    name = "ray-asha-resume"
    study = two_learning_rates(tmp_path, name, tiny_data)
    storage, log = tmp_path / "studies", tmp_path / "run.log"

    def first_group_done_and_saved():
        done = [run for run in trial_runs(storage, name).values()
                if (run / RESULTS_FILE).is_file() and '"epoch": 3' in (run / RESULTS_FILE).read_text()]
        saved = sorted((storage / name).glob("searcher-state-*.pkl"))
        if len(done) < 3 or not saved:
            return False
        try:
            state = pickle.loads(saved[-1].read_bytes())["scheduler_state"]
        except (EOFError, pickle.UnpicklingError, KeyError):  # being replaced, or not carried
            return False
        return len(state["means"][1]) == 1

    # Tune saves its experiment (and the searcher) at most every 10 s by default: this study takes about that long,
    # so every second here (a COCO study's judgements are saved hours before the next rung)
    env = {**local_env(), "TUNE_GLOBAL_CHECKPOINT_S": "1"}
    proc = start_a2("study", "run", str(study), cwd=tmp_path, log=log, env=env)
    try:
        wait_for(first_group_done_and_saved, 600, "the lr 1 group's epochs and judgement in Tune's saved state",
                 proc=proc, log=log, interval=0.1)
    finally:
        kill_group(proc)  # the driver and its local Ray, as a lost head node would
    resume = a2("study", "resume", name, cwd=tmp_path, env=local_env())
    assert resume.returncode == 0, resume.stdout[-6000:]

    summary = json.loads((storage / name / "summary.json").read_text())
    by_lr: dict[float, list[dict]] = {}
    for t in summary["trials"]:
        by_lr.setdefault(t["sampled"]["train.lr_factor"], []).append(t)
    assert [t["epochs_done"] for t in by_lr[1.0]] == [3, 3, 3] and not any(t["stopped_early"] for t in by_lr[1.0])
    assert len(by_lr[0.0001]) == 3
    for t in by_lr[0.0001]:
        assert t["stopped_early"] and t["stopped_early"]["rung"] == 1, t
        assert t["epochs_done"] == 1, t
