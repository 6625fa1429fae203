"""Fused replicate seeds through a real (local) Ray: `resources.fuse_replicates` trains a configuration's seeds in one
Tune trial, one fused step for all (`a2core.fused`), and each seed is still a trial of the record: its own run
folder, result log, checkpoints, test scores and MLflow run, in the replicate group and the summary as the seeds of
an unfused study are. A driver killed between two seeds' checkpoints of one epoch resumes both from the epoch they
share. A rehearsal stops a fused group whole, as the rehearsal without Ray does."""
from __future__ import annotations

import json
import signal
import subprocess

import pytest

from tests.raycluster import (a2, kill_group, mlflow_history, mlflow_trials, start_a2, tiny_data,  # noqa: F401
                              tiny_study, trial_runs)
from tests.test_study_ray import local_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EPOCHS = 3
SEEDS = (0, 1)


def fused_study(tmp_path, name: str, data, fused: bool):
    """One configuration (fusion max, lambda 0.035) over seeds 0 and 1, dropout 0 (so that a fused seed's numbers are
    its run's alone, to rounding), 3 epochs, FIFO."""
    extra = {"search.space": {"fusion": {"grid": ["max"]}}, "search.replicates": list(SEEDS),
             "search.scheduler": {"fifo": {}}, "model.dropout": 0.0}
    if fused:
        extra["resources.fuse_replicates"] = True
    return tiny_study(tmp_path, name, data, epochs=EPOCHS, workers=1, cpus_per_worker=1, extra=extra)


def losses(folder) -> list[float]:
    """A trial's train/loss by epoch, from its result log."""
    return [r["train/loss"] for r in json.loads((folder / "results.json").read_text())]


def test_fused_seeds_train_as_they_do_alone_resume_together_and_are_trials_of_the_record(tmp_path, tiny_data):
    """The same study unfused and fused. The fused driver is SIGKILLed after seed 0's epoch-2 checkpoint, before seed
    1's; the resumed trial starts both seeds from epoch 1's checkpoints (fused seeds step together). Each seed then
    has its run alone's numbers (dropout 0: to rounding, the fused step sums in another order, tests/test_fused.py)
    and is a trial of the record, of its replicate group, of MLflow and of `status`."""
    alone_dir, fused_dir = tmp_path / "alone", tmp_path / "fused"
    alone_dir.mkdir(), fused_dir.mkdir()
    run = a2("study", "run", str(fused_study(alone_dir, "fz", tiny_data, False)), cwd=alone_dir, env=local_env())
    assert run.returncode == 0, run.stdout[-6000:]

    log = tmp_path / "killed.log"
    proc = start_a2("study", "run", str(fused_study(fused_dir, "fz", tiny_data, True)), cwd=fused_dir, log=log,
                    env={**local_env(), "A2_KILL_AT": "checkpoint-saved@2"})
    try:
        rc = proc.wait(timeout=400)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        kill_group(proc)
    assert rc == -signal.SIGKILL, log.read_text(errors="replace")[-4000:]
    folders = trial_runs(fused_dir / "studies", "fz")
    epochs = sorted(sorted(int(p.name[-4:]) for p in f.glob("checkpoint_epoch*")) for f in folders.values())
    assert epochs == [[1], [1, 2]], epochs  # killed between the two seeds' checkpoints of epoch 2
    resumed = a2("study", "resume", "fz", "--storage", str(fused_dir / "studies"), cwd=fused_dir, env=local_env())
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "Traceback" not in run.stdout + resumed.stdout

    summaries = {d: json.loads((d / "studies" / "fz" / "summary.json").read_text()) for d in (alone_dir, fused_dir)}
    fused = summaries[fused_dir]
    assert fused["complete"] and len(fused["trials"]) == 2
    # one Tune trial trained both seeds: one Tune trial folder; the record's ids are its id and the seed
    tune_folders = sorted((fused_dir / "studies" / "fz").glob("*/result.json"))
    assert len(tune_folders) == 1, tune_folders
    tune_id = json.loads(tune_folders[0].read_text().splitlines()[0])["trial_id"]
    assert sorted(t["trial_id"] for t in fused["trials"]) == [f"{tune_id}-s{s}" for s in SEEDS]
    folders = trial_runs(fused_dir / "studies", "fz")
    assert set(folders) == {t["trial_id"] for t in fused["trials"]}
    by_seed = {}
    for trial in fused["trials"]:
        folder = folders[trial["trial_id"]]
        assert trial["state"] == "TERMINATED" and trial["epochs_reported"] == [1, 2, 3]
        assert json.loads((folder / "trial.json").read_text())["config"]["seed"] == trial["sampled"]["seed"]
        assert (folder / f"checkpoint_epoch{EPOCHS:04d}" / "checkpoint.pt").is_file()
        assert trial["test"] is not None and trial["compute"]["wall_s"] > 0
        by_seed[trial["sampled"]["seed"]] = folder
    alone = {t["sampled"]["seed"]: trial_runs(alone_dir / "studies", "fz")[t["trial_id"]]
             for t in summaries[alone_dir]["trials"]}
    for seed in SEEDS:  # epoch 2 of seed 0 trained twice (before the kill and after it), the same both times
        assert losses(by_seed[seed]) == pytest.approx(losses(alone[seed]), rel=1e-3), seed
    assert losses(by_seed[0]) != pytest.approx(losses(by_seed[1]), rel=1e-6)  # two seeds, not one twice
    # one replicate group of both seeds, as the unfused study's
    assert [sorted(g["seeds"]) for g in fused["groups"]] == [list(SEEDS)]
    assert fused["groups"][0]["config_hash"] == summaries[alone_dir]["groups"][0]["config_hash"]

    uri = f"sqlite:///{fused_dir / 'mlflow.db'}"
    children = mlflow_trials(uri, "fz")
    assert set(children) == {t["trial_id"] for t in fused["trials"]}
    for child in children.values():
        assert child.info.status == "FINISHED"
        assert [step for step, _, _ in mlflow_history(uri, child.info.run_id, "val/CIDEr")] == [1, 2, 3]

    status = a2("study", "status", "fz", cwd=fused_dir, env=local_env(), timeout=120)
    assert status.returncode == 0, status.stdout
    for trial in fused["trials"]:
        assert trial["trial_id"] in status.stdout


def test_a_fused_rehearsal_stops_whole_groups_as_the_rehearsal_without_ray_does(tmp_path):
    """`a2 study rehearse` of the smoke study with fused seeds: 2 Tune trials for 8 trials of the record, every epoch
    a seed reported is the stand-in's draw for it, and the scheduler stops the baseline's whole group at rung 2
    (a fused trial is its group), as the rehearsal without Ray does (which holds the group's seeds at the rung). One
    trial at a time: gate's group is judged at the rung first (the searcher's order), so the baseline has a cutoff."""
    import re

    from launch import rehearse
    from launch.spec import load_study
    from tests.test_rehearse import SMOKE

    storage = tmp_path / "rehearsals"
    run = a2("study", "rehearse", str(SMOKE), "search.space.fusion.grid=[gate,none]", "resources.fuse_replicates=true",
             "resources.max_concurrent_trials=1", "--mean", "none=100", "--storage", str(storage), "--repeat", "1", "--quiet", cwd=tmp_path,
             env=local_env(), timeout=400)
    assert run.returncode == 0, run.stdout[-5000:]
    name = "a2-smoke-rehearsal"
    folder = storage / name
    summary = json.loads((folder / "summary.json").read_text())
    assert len(summary["trials"]) == 8 and len(list(folder.glob("*/result.json"))) == 2
    stopped = [t for t in summary["trials"] if t.get("stopped_early")]
    assert {t["fusion"] for t in stopped} == {"none"} and len(stopped) == 4  # the whole group
    assert all(t["stopped_early"]["rung"] == 2 and t["epochs_reported"] == [1, 2] for t in stopped)
    assert re.search(r"\b40 of 64 planned trial-epochs", run.stdout), run.stdout[-3000:]  # gate 4 x 8, none 4 x 2

    spec = load_study(folder / "study.yaml")
    m = rehearse.ScoreModel(**{**summary["rehearsal"]["model"],
                               "means": tuple(summary["rehearsal"]["model"]["means"].items())})
    sim = {(r.fusion, r.seed): r for r in rehearse.simulate(spec, m, 0).runs}
    assert {(t["fusion"], int(t["seed"])) for t in summary["trials"]} == set(sim)
    for t in summary["trials"]:
        drawn = dict(sim[(t["fusion"], int(t["seed"]))].history["val/CIDEr"])
        logged = json.loads((folder / "trials" / f"{name}-{t['trial_id']}" / "results.json").read_text())
        assert [r["epoch"] for r in logged] == t["epochs_reported"]
        for result in logged:
            assert result["val/CIDEr"] == pytest.approx(drawn[result["epoch"]]), (t["trial_id"], result["epoch"])
    assert sum("a2.stopped_rung" in r.tags for r in sim.values() if r.fusion == "none") == 4
    assert not any("a2.stopped_rung" in r.tags for r in sim.values() if r.fusion == "gate")
