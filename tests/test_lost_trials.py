"""Trials a killed driver's Tune never saved continue from a2's own record. A study whose driver was killed before
Tune saved any experiment state is resumed in place from its saved spec (not "run it again"); a trial Tune lost (its
configuration runs again under a new trial id) is continued by the new trial from the lost one's newest checkpoint,
whose folder is then marked superseded, and whose MLflow run the export ends KILLED saying by which trial. A trial
killed after its last epoch's checkpoint but before its result was kept scores the test split on resume.
(tests/test_kill_anywhere.py runs all of it on a real study.)"""
from __future__ import annotations

import json
from pathlib import Path

from launch.driver import lost_trial_runs
from launch.layout import (ARTIFACTS_DIR, CHECKPOINT_FILE, FUSED_SEEDS_KEY, RESULTS_FILE, SUPERSEDED_FILE, TRIAL_FILE,
                           TRIALS_DIR, checkpoint_name, seed_sampled, seed_trial_id, train_run_name)
from launch.location import StudyLocation
from launch.mlflow_export import SUPERSEDED, Export
from launch.storage import open_location
from launch.tracking_writer import StudyTracker
from launch.trainable import TrialPlan, adopt, finished_before
from tests.raycluster import arrow_s3_compatible_moto  # noqa: F401 - a fixture
from tests.s3server import unique_bucket
from tests.studyfolder import fabricated_study

SAMPLED = {"fusion": "max", "seed": 0}


def _plan(storage: Path, adoptable: tuple[str, ...]) -> TrialPlan:
    return TrialPlan(study="s", storage=str(storage), storage_endpoint_url=None, resolve=dict,
                     resources={"workers_per_trial": 1, "gpus_per_worker": 0}, adoptable=adoptable)


def _old_trial(storage: Path, trial_id: str, sampled: dict, epochs: list[int], *, logged: list[int] | None = None,
               complete: bool = True) -> Path:
    """A run folder as a trial leaves it: its configuration record, checkpoint folders, result log, artifacts."""
    run = storage / "s" / TRIALS_DIR / train_run_name("s", trial_id)
    for epoch in epochs:
        folder = run / checkpoint_name(epoch)
        folder.mkdir(parents=True)
        (folder / "history.json").write_text(json.dumps([{"epoch": e} for e in range(1, epoch + 1)]))
        if complete or epoch != epochs[-1]:  # a folder is whole once it has its checkpoint.pt
            (folder / CHECKPOINT_FILE).write_bytes(f"{trial_id} epoch {epoch}".encode())
    run.mkdir(parents=True, exist_ok=True)
    (run / TRIAL_FILE).write_text(json.dumps({"trial_id": trial_id, "config": sampled}))
    results = [{"epoch": e, "val/CIDEr": 10.0 + e, "compute/wall_s": 5.0 * e} for e in (logged or epochs)]
    (run / RESULTS_FILE).write_text(json.dumps(results))
    (run / ARTIFACTS_DIR / "samples").mkdir(parents=True)
    (run / ARTIFACTS_DIR / "samples" / "epoch_001.txt").write_text("a caption\n")
    return run


def test_a_new_trial_continues_the_newest_lost_trial_of_its_configuration(tmp_path, capsys):
    storage = tmp_path / "st"
    older = _old_trial(storage, "aaa_00000", SAMPLED, [1])
    newer = _old_trial(storage, "bbb_00000", SAMPLED, [1, 2, 3], logged=[1, 2, 3, 4], complete=False)
    other = _old_trial(storage, "bbb_00001", {"fusion": "max", "seed": 1}, [1, 2, 3, 4])  # another seed
    claimed = _old_trial(storage, "ccc_00000", SAMPLED, [1, 2, 3, 4])
    (claimed / SUPERSEDED_FILE).write_text(json.dumps({"by": "ddd_00000", "epoch": 4}))  # continued already
    names = tuple(p.name for p in (older, newer, other, claimed))
    plan = _plan(storage, names)
    run = plan.trials().join(train_run_name("s", "new_00000"))

    mark = adopt(plan, run, "new_00000", dict(SAMPLED))
    # newer's epoch 3 folder has no checkpoint.pt (cut short): its newest complete checkpoint is epoch 2
    assert mark == {"by": "new_00000", "run": run.uri, "epoch": 2}
    here = Path(run.uri)
    assert sorted(p.name for p in here.glob("checkpoint_epoch*")) == [checkpoint_name(1), checkpoint_name(2)]
    assert (here / checkpoint_name(2) / CHECKPOINT_FILE).read_bytes() == b"bbb_00000 epoch 2"
    # its results up to that checkpoint (with their compute, so the trial's totals go on), its artifacts
    assert [r["epoch"] for r in json.loads((here / RESULTS_FILE).read_text())] == [1, 2]
    assert json.loads((here / RESULTS_FILE).read_text())[1]["compute/wall_s"] == 10.0
    assert (here / ARTIFACTS_DIR / "samples" / "epoch_001.txt").read_text() == "a caption\n"
    assert json.loads((newer / SUPERSEDED_FILE).read_text()) == mark
    assert not (older / SUPERSEDED_FILE).exists() and not (other / SUPERSEDED_FILE).exists()
    assert f"trial new_00000 continues {newer}" in capsys.readouterr().out
    # a trial with checkpoints of its own (restarted) continues nothing; nor does one of another configuration
    assert adopt(plan, run, "new_00000", dict(SAMPLED)) is None
    lone = plan.trials().join(train_run_name("s", "new_00001"))
    assert adopt(plan, lone, "new_00001", {"fusion": "none", "seed": 0}) is None
    assert not Path(lone.uri).exists()


def test_each_seed_of_a_new_fused_trial_continues_its_own_seed_of_the_lost_one(tmp_path):
    """A fused trial (`resources.fuse_replicates`) lost by a killed driver: its seeds' folders are lost trials of
    their own, and the new Tune trial of the configuration continues each from its own seed's folder."""
    storage = tmp_path / "st"
    fused = {"fusion": "max", FUSED_SEEDS_KEY: [0, 1]}  # what the searcher hands the fused trial
    lost = {s: _old_trial(storage, seed_trial_id("aaa_00000", s), seed_sampled(fused, s), [1, 2 + s]) for s in (0, 1)}
    location = StudyLocation("s", str(storage))
    names = lost_trial_runs(location, started=False)
    assert sorted(names) == sorted(p.name for p in lost.values())
    plan = _plan(storage, names)
    for s in (1, 0):  # in either order: a seed never takes the other seed's folder
        run = plan.trials().join(train_run_name("s", seed_trial_id("new_00000", s)))
        mark = adopt(plan, run, seed_trial_id("new_00000", s), seed_sampled(fused, s))
        assert mark == {"by": f"new_00000-s{s}", "run": run.uri, "epoch": 2 + s}
        assert (Path(run.uri) / checkpoint_name(2 + s) / CHECKPOINT_FILE).read_bytes() == \
            f"aaa_00000-s{s} epoch {2 + s}".encode()
        assert json.loads((lost[s] / SUPERSEDED_FILE).read_text()) == mark
    assert lost_trial_runs(location, started=False) == ()  # both continued: nothing left to adopt


def test_lost_trial_runs_are_the_folders_tune_does_not_know(tmp_path):
    storage = tmp_path / "st"
    _old_trial(storage, "aaa_00000", SAMPLED, [1])
    done = _old_trial(storage, "aaa_00001", SAMPLED, [1])
    (done / SUPERSEDED_FILE).write_text("{}")
    (storage / "s" / TRIALS_DIR / "s-unrecorded").mkdir()  # an older version's folder: no configuration record
    location = StudyLocation("s", str(storage))
    assert lost_trial_runs(location, started=False) == ("s-aaa_00000",)


def test_a_trial_resumed_after_its_last_epoch_is_finished_only_with_its_test_scores():
    config = {"train": {"xe_epochs": 2, "scst_epochs": 1}}
    assert not finished_before(config, 2, {"epoch": 2})
    assert not finished_before(config, 3, {"epoch": 3, "val/CIDEr": 1.0})  # killed before its result was kept
    assert finished_before(config, 3, {"epoch": 3, "test/CIDEr": 1.0, "test/epoch": 2})
    assert finished_before({"train": {**config["train"], "test_at_end": False}}, 3, {"epoch": 3})
    assert not finished_before(config, None, None)


def test_the_export_names_the_trial_that_continued_a_superseded_run(tmp_path):
    fab = fabricated_study(tmp_path, "lost", epochs=2, overrides=("search.replicates=2",))
    fab.add("old0", {"fusion": "none", "seed": 0}, [{"epoch": 1, "val/CIDEr": 10.0}], status="RUNNING")
    fab.add("old1", {"fusion": "none", "seed": 1}, [{"epoch": 1, "val/CIDEr": 10.0}], status="RUNNING")
    Export(fab.spec, fab.location).run(list(fab.trials))  # the live export of the driver that was then killed
    folder = fab.location.at(TRIALS_DIR, train_run_name("lost", "old0"))
    folder.join(SUPERSEDED_FILE).write_text(json.dumps({"by": "new0", "epoch": 1}))
    fab.trials.clear()
    fab.add("new0", {"fusion": "none", "seed": 0}, [{"epoch": e, "val/CIDEr": 10.0 + e} for e in (1, 2)])
    export = Export(fab.spec, fab.location)
    export.run(list(fab.trials), "the study stopped")
    tracker = StudyTracker(fab.spec.tracking.mlflow_uri, fab.spec.name)
    runs = {r.data.tags.get("a2.trial_id"): r for r in tracker.client.search_runs([tracker.experiment_id])}
    assert sorted(export.superseded) == ["old0", "old1"]
    assert runs["old0"].info.status == "KILLED" and runs["old0"].data.tags["a2.end_reason"] == (
        "superseded: the driver was killed before Tune saved this trial; trial new0 (same configuration) continued "
        "it from its checkpoint of epoch 1, and holds its epochs in the study's record")
    assert runs["old1"].data.tags["a2.end_reason"] == SUPERSEDED  # not continued (its trial is still to run)


def test_copy_folder_copies_everything_below_it_locally_and_on_s3(tmp_path, s3_endpoint, arrow_s3_compatible_moto):
    source = tmp_path / "a"
    (source / "sub").mkdir(parents=True)
    (source / CHECKPOINT_FILE).write_text("weights")
    (source / "sub" / "x.txt").write_text("x")
    target = open_location(str(tmp_path / "b" / "c"))
    open_location(str(source)).copy_folder(target, last=CHECKPOINT_FILE)
    assert (tmp_path / "b" / "c" / "sub" / "x.txt").read_text() == "x"
    assert (tmp_path / "b" / "c" / CHECKPOINT_FILE).read_text() == "weights"
    assert not list((tmp_path / "b").glob(".*partial"))

    bucket = unique_bucket(s3_endpoint, "copy")
    remote = open_location(f"s3://{bucket}/st/a", s3_endpoint)
    remote.join(CHECKPOINT_FILE).write_text("weights")
    remote.join("sub", "x.txt").write_text("x")
    there = open_location(f"s3://{bucket}/st/b", s3_endpoint)
    remote.copy_folder(there, last=CHECKPOINT_FILE)
    assert there.join("sub", "x.txt").read_text() == "x" and there.join(CHECKPOINT_FILE).read_text() == "weights"
    # copied again from a folder without sub/x.txt (an epoch trained again): replaced, as locally, nothing stale left
    newer = open_location(f"s3://{bucket}/st/newer", s3_endpoint)
    newer.join(CHECKPOINT_FILE).write_text("weights 2")
    newer.copy_folder(there, last=CHECKPOINT_FILE)
    assert there.join(CHECKPOINT_FILE).read_text() == "weights 2" and not there.join("sub", "x.txt").exists()
    open_location(str(source)).copy_folder(there, last=CHECKPOINT_FILE)  # local to S3 likewise
    newer.copy_folder(target, last=CHECKPOINT_FILE)  # and S3 to local
    assert there.join("sub", "x.txt").exists() and not (tmp_path / "b" / "c" / "sub").exists()
    assert (tmp_path / "b" / "c" / CHECKPOINT_FILE).read_text() == "weights 2"


def test_a_kill_point_kills_only_where_a2_kill_at_names_it():
    """`launch.killpoints`: the process named by A2_KILL_DRIVER_PID (else itself) is SIGKILLed at the point named,
    with the value named if any; any other point, or no A2_KILL_AT, does nothing."""
    import os
    import signal
    import subprocess
    import sys

    code = "from launch.killpoints import kill_point; kill_point('checkpoint-saved', 1); print('alive', flush=True)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("A2_KILL_AT", None)

    def run(**extra):
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              timeout=60)

    assert run().stdout == "alive\n"
    assert run(A2_KILL_AT="checkpoint-saved@2").stdout == "alive\n"
    assert run(A2_KILL_AT="trial-result").stdout == "alive\n"
    for point in ("checkpoint-saved", "checkpoint-saved@1"):
        killed = run(A2_KILL_AT=point)
        assert killed.returncode == -signal.SIGKILL and "alive" not in killed.stdout, killed
        assert f"a2 kill point {point}: SIGKILL to the driver" in killed.stdout


def test_a_trial_sends_tune_only_plain_values_and_keeps_per_image_scores_in_its_artifacts(tmp_path, monkeypatch):
    """Tune keeps every reported result in its experiment state and its per-trial result log: the per-image scores
    and samples of an epoch go to the trial's `artifacts/` only (`launch.layout.plain_values`)."""
    import ray

    from a2core.train import PER_IMAGE_KEY
    from launch.trainable import TrialRecorder

    sent = []
    monkeypatch.setattr(ray.tune, "get_context", lambda: type("C", (), {"get_trial_id": lambda self: "t1"})())
    monkeypatch.setattr(ray.tune, "report", lambda item, checkpoint=None: sent.append(item))
    recorder = TrialRecorder(_plan(tmp_path, ()), 0, dict(SAMPLED))
    recorder.record({"epoch": 1, "val/CIDEr": 12.5, "samples": ["0: a dog"],
                     PER_IMAGE_KEY: {"ids": ["7", "9"], "scores": [10.0, 15.0]}}, 0.1)
    (item,) = sent
    assert item["val/CIDEr"] == 12.5 and item["epoch"] == 1
    assert "samples" not in item and PER_IMAGE_KEY not in item
    artifacts = tmp_path / "s" / TRIALS_DIR / train_run_name("s", "t1") / ARTIFACTS_DIR
    assert json.loads((artifacts / "eval" / "per_image_cider.json").read_text()) == {"7": 10.0, "9": 15.0}
    assert (artifacts / "samples" / "epoch_001.txt").read_text() == "0: a dog\n"


def test_trials_run_one_after_another_in_one_process_keep_the_studys_temp_root(tmp_path, monkeypatch):
    """Tune runs one trial after another in the same process (`reuse_actors`): each trial's temp folders are in the
    study's root, not in a folder nested in the last trial's (nested once a trial, a process that had run ~90 trials
    failed with "File name too long" in a 2,005-trial rehearsal)."""
    import tempfile

    import launch.trainable as trainable

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(trainable, "_SYSTEM_TEMP", None)
    plan = _plan(tmp_path / "studies", ())
    root = plan.temp_root()
    assert root.parent == tmp_path
    for _ in range(3):  # three trials in one process
        trainable.use_temp_root(plan.temp_root())
        assert plan.temp_root() == root and Path(tempfile.mkdtemp(prefix="a2-trial-")).parent == root
    trainable.remove_temp_root(plan)
    assert not root.exists()


def test_fused_seeds_resume_from_the_newest_epoch_they_all_keep():
    """Fused seeds step together in stage 1, so they resume from one epoch. Seed 0 (newest 5) kept 1, 3, 5 and seed
    1 (newest 4, killed before its epoch-5 checkpoint) kept 1, 2, 4: each seed's retention by its own scores pruned
    the other's newest. Epoch 1 is the newest both keep: they resume there, where looking only at the oldest newest
    (4, pruned in seed 0) restarted both from scratch. An unreadable epoch is passed over; none in common: scratch."""
    from launch.trainable import fused_resume_points

    def seeds(kept: dict[int, list[int]], unreadable: set = frozenset()):
        def newest(i, below=None):
            ok = [e for e in kept[i] if (below is None or e <= below) and (i, e) not in unreadable]
            return (max(ok), f"seed{i}/epoch{max(ok)}") if ok else (None, None)
        return newest, kept.__getitem__

    newest, kept = seeds({0: [1, 3, 5], 1: [1, 2, 4]})
    assert fused_resume_points([0, 1], newest, kept, xe_epochs=8) == {0: (1, "seed0/epoch1"), 1: (1, "seed1/epoch1")}
    newest, kept = seeds({0: [1, 3, 4, 5], 1: [1, 2, 4]}, unreadable={(1, 4)})  # 4 common but damaged in seed 1
    assert fused_resume_points([0, 1], newest, kept, xe_epochs=8) == {0: (1, "seed0/epoch1"), 1: (1, "seed1/epoch1")}
    newest, kept = seeds({0: [3, 5], 1: [2, 4]})
    assert fused_resume_points([0, 1], newest, kept, xe_epochs=8) == {0: (None, None), 1: (None, None)}
    # past stage 1 (xe_epochs 3) each seed trains alone: each from its own newest
    assert fused_resume_points([0, 1], newest, kept, xe_epochs=3) == {0: (5, "seed0/epoch5"), 1: (4, "seed1/epoch4")}
