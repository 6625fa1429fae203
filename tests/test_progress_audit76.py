"""Progress within an epoch at its edges: a running trial as `a2 study status` reads it from Tune's saved experiment
state (PENDING), a fused trial's stage-2 epochs, and a progress file whose step count is huge."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from a2core.config import Config
from a2core.data import synthetic
from a2core.fused import FusedReplicates
from launch.conclusions import epochs_text
from launch.layout import PROGRESS_FILE, TRIALS_DIR, progress_record, train_run_name
from launch.lease import StudyLease
from launch.progress import progress_line, study_progress
from launch.record import with_under_way
from launch.storage import open_location
from launch.trainable import watch_stage_two
from tests.studyfolder import fabricated_study

pytestmark = pytest.mark.outside_ray_group  # starts no Ray


def write_progress(fab, trial_id: str, record: dict) -> None:
    fab.location.at(TRIALS_DIR, train_run_name(fab.spec.name, trial_id), PROGRESS_FILE).write_text(json.dumps(record))


def test_status_reads_the_epoch_under_way_of_a_trial_tunes_saved_state_calls_pending(tmp_path):
    """`launch.verify.experiment_trials` restores a trial Tune saved RUNNING as PENDING, so every trial status reads
    from storage is PENDING or ended: t0 in its first epoch (40% of 1,000 steps at 2 s) and t1 in its third (half
    done) were never read, and the line said the time left is unknown."""
    fab = fabricated_study(tmp_path, "saved-pending", epochs=4)
    fab.add("t0", {"fusion": "none", "seed": 0}, [], status="PENDING")
    fab.add("t1", {"fusion": "max", "seed": 0},
            [{"epoch": e, "val/CIDEr": 40.0 + e, "compute/wall_s": 1000.0 * e} for e in (1, 2)], status="PENDING")
    write_progress(fab, "t0", {"stage": "xe", "epoch": 1, "done": 400, "total": 1000, "seconds_per_step": 2.0})
    write_progress(fab, "t1", {"stage": "xe", "epoch": 3, "done": 50, "total": 100, "seconds_per_step": 10.0})
    assert [t.under_way for t in fab.record().trials] == [None, None]  # no driver: nothing is under way
    with StudyLease(fab.location.at()).held():
        record = fab.record().shown()
    assert [t.under_way["done"] if t.under_way else None for t in record.trials] == [400, 50]
    # shown(): one that has reported epochs, or one in its first epoch that wrote where it is in it, is RUNNING
    assert [t.state for t in record.trials] == ["RUNNING", "RUNNING"]
    assert [epochs_text(t) for t in record.trials] == ["0/4 +40%", "2/4 +50%"]
    progress = study_progress(fab.spec, record.trials, driven=True)
    assert progress.epochs_under_way == pytest.approx(0.9) and progress.seconds_per_epoch == pytest.approx(1000.0)
    assert progress_line(progress).startswith("progress: 2/32 trial-epochs, 0.9 more under way (9%)")


def test_the_live_tables_pending_trial_is_not_read(tmp_path):
    """In the driver's live table Tune's PENDING is its live word (no run status): a trial waiting for a slot, whose
    file is from an earlier attempt, has no epoch under way."""
    fab = fabricated_study(tmp_path, "live-pending", epochs=4)
    fab.add("t0", {"fusion": "none", "seed": 0}, [], status="PENDING")
    write_progress(fab, "t0", {"stage": "xe", "epoch": 1, "done": 400, "total": 1000, "seconds_per_step": 2.0})
    live = fab.trials[0]  # a Tune trial as the live table has it: state PENDING, status ""
    assert with_under_way(fab.spec, fab.location, live).under_way is None
    running = with_under_way(fab.spec, fab.location, replace(live, state="RUNNING"))
    assert running.under_way["done"] == 400


@pytest.mark.parametrize("total", [10 ** 400, 10 ** 9], ids=["400-digits", "1e9"])
def test_a_huge_step_count_is_no_progress_record_and_no_crash(tmp_path, total):
    """A step count of hundreds of digits times a step's seconds overflowed a float: status raised OverflowError."""
    fab = fabricated_study(tmp_path, "huge", epochs=4)
    fab.add("t0", {"fusion": "none", "seed": 0}, [], status="RUNNING")
    write_progress(fab, "t0", {"stage": "xe", "epoch": 1, "done": 1, "total": total, "seconds_per_step": 2.0})
    assert progress_record(fab.location.at(TRIALS_DIR, train_run_name(fab.spec.name, "t0")), 1) is None
    with StudyLease(fab.location.at()).held():
        trials = fab.record().trials
    line = progress_line(study_progress(fab.spec, trials, driven=True))
    assert line.endswith("time left: known once a trial-epoch has ended")


def test_a_fused_trials_seeds_write_their_stage_two_epochs(tmp_path):
    """`a2_fused_trial` hands its seeds' run folders to their trainers: `FusedReplicates.run` trains stage 2 (SCST)
    one seed after another through them, and only a trial resumed past stage 1 wrote any progress before. Stage 1
    (fused cross-entropy) writes none."""
    root = tmp_path / "syn"
    synthetic.generate(root, seed=5, images=20, test_images=4)
    cfgs = [Config.from_dict({
        "data": {"root": str(root), "images": 20, "seed": 5, "val_images": 2},
        "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10, "fusion": "gate",
                  "dropout": 0.0},
        "train": {"xe_epochs": 1, "scst_epochs": 1, "batch_size": 10, "warmup": 3, "lr_factor": 0.5, "seed": s,
                  "diag_every": 0, "diag_images": 1, "test_at_end": False, "max_len": 4, "scst_samples": 2,
                  "test_meteor": False}}) for s in (0, 1)]
    runs = [open_location(str(tmp_path / f"run{s}")) for s in (0, 1)]
    fused = FusedReplicates(cfgs, [str(tmp_path / f"out{s}") for s in (0, 1)])
    watch_stage_two(fused.trainers, runs)
    seen = []

    def report(i):
        return lambda metrics, _: seen.append((i, metrics["epoch"], progress_record(runs[i], metrics["epoch"])))

    fused.run([report(0), report(1)])
    assert [(i, epoch) for i, epoch, _ in seen] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert [r for _, epoch, r in seen if epoch == 1] == [None, None]  # stage 1 fused: none
    for _, _, r in (s for s in seen if s[1] == 2):
        assert (r["stage"], r["epoch"]) == ("scst", 2) and 0 < r["done"] <= r["total"]


def test_a_progress_file_of_the_attempt_before_the_driver_now_running_is_not_under_way(tmp_path):
    """A resumed study: t0's progress file was written by the killed attempt (before the lease of the driver now
    running it was taken), t1's by the new one. t0 waits for its slot (or restores its checkpoint): it read as 40%
    under way until its first new step; t1's counts. A file without a time (none is written so) is not judged."""
    import time

    fab = fabricated_study(tmp_path, "resumed", epochs=4)
    for trial in ("t0", "t1", "t2"):
        fab.add(trial, {"fusion": "none", "seed": int(trial[1])}, [], status="RUNNING")
    lease = StudyLease(fab.location.at())
    started = time.time() - 5  # the lease's start, whole seconds
    lease.mine["started"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    write_progress(fab, "t0", {"stage": "xe", "epoch": 1, "done": 400, "total": 1000, "time": started - 600})
    write_progress(fab, "t1", {"stage": "xe", "epoch": 1, "done": 10, "total": 1000, "time": started + 2})
    write_progress(fab, "t2", {"stage": "xe", "epoch": 1, "done": 20, "total": 1000})
    with lease.held():
        record = fab.record()
    assert [t.under_way["done"] if t.under_way else None for t in record.trials] == [None, 10, 20]
    run = fab.location.at(TRIALS_DIR, train_run_name(fab.spec.name, "t0"))
    assert progress_record(run, 1)["done"] == 400  # no driver start given: as written
    assert progress_record(run, 1, since=started - 601)["done"] == 400
    assert progress_record(run, 1, since=started) is None
