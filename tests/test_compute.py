"""Compute accounting without Ray: a trial's cumulative compute across restarts, the study's totals (stopped,
saved, cost), the one-worker trial's checkpoint folders, and the `resources.price_per_hour` key."""
from __future__ import annotations

import pytest

from a2core.errors import ConfigError
from launch.storage import open_location
from launch.conclusions import compute_line
from launch.record import compute_totals, trial_compute
from launch.spec import Resources, StudySpec
from launch.trainable import ComputeMeter, LocalCheckpoints


class _Spec:
    def __init__(self, price=None):
        self.resources = Resources(price_per_hour=price)


def _row(state, done, planned, wall, cpu):
    return {"state": state, "epochs_done": done, "epochs_planned": planned,
            "compute": {"wall_s": wall, "cpu_s": cpu}}


def test_totals_count_stopped_trials_and_what_stopping_saved():
    rows = [_row("TERMINATED", 8, 8, 80.0, 160.0),  # ran to the end
            _row("TERMINATED", 2, 8, 30.0, 40.0),  # stopped at 2 of 8: 6 epochs of 15 s / 20 CPU-s saved
            _row("ERROR", 1, 8, 12.0, 10.0)]  # failed: spent, but not stopped by the scheduler
    totals = compute_totals(_Spec(price=3.6), rows)
    assert totals["total_wall_s"] == pytest.approx(122.0) and totals["total_cpu_s"] == pytest.approx(210.0)
    assert totals["stopped_wall_s"] == pytest.approx(30.0) and totals["stopped_cpu_s"] == pytest.approx(40.0)
    assert totals["saved_wall_s"] == pytest.approx(90.0) and totals["saved_cpu_s"] == pytest.approx(120.0)
    assert totals["total_cost"] == pytest.approx(3.6 * 122 / 3600)
    assert totals["saved_cost"] == pytest.approx(3.6 * 90 / 3600)
    assert compute_line(totals).startswith("compute: 122 s wall, 210 CPU-s, cost 0.12; on early-stopped trials 30 s")
    assert not any(k.endswith("_cost") for k in compute_totals(_Spec(), rows))  # no price: no cost at all
    assert compute_line({}) == "compute: not recorded"


def test_trial_compute_is_the_largest_cumulative_value():
    history = [{"epoch": 1, "compute/wall_s": 5.0, "compute/gpu_s": 20.0},
               {"epoch": 2, "compute/wall_s": 9.0, "compute/gpu_s": 36.0}, {"epoch": 3}]
    assert trial_compute(history) == {"wall_s": 9.0, "gpu_s": 36.0}


def test_meter_continues_from_earlier_attempts_and_worker_group_restarts():
    meter = ComputeMeter([{"epoch": 1, "compute/wall_s": 10.0, "compute/cpu_s": 30.0}], gpus=0)
    a, b, c = {}, {}, {}
    meter.stamp(a, 4.0)
    meter.stamp(b, 9.0)
    meter.stamp(c, 2.0)  # a new worker group counts from 0 again: its 2 s come on top of the 9 s before
    assert [x["compute/cpu_s"] for x in (a, b, c)] == pytest.approx([34.0, 39.0, 41.0])
    assert 10.0 <= a["compute/wall_s"] <= b["compute/wall_s"] <= c["compute/wall_s"]
    on_gpu = ComputeMeter([], gpus=4)
    item = {}
    on_gpu.stamp(item, 123.0)  # CPU seconds do not count on GPU
    assert set(item) == {"compute/wall_s", "compute/gpu_s"}
    assert item["compute/gpu_s"] == pytest.approx(4 * item["compute/wall_s"])


def test_a_restarted_worker_group_is_told_by_its_id_not_by_its_count(monkeypatch):
    """A Ray Train worker group restarted after 9 CPU-s whose first report already counts 12 (a longer epoch): by its
    count alone the 9 s were lost (12 < 9 is false); by the group's id they are kept, 9 + 12."""
    meter = ComputeMeter([], gpus=0)
    a, b, c, d = {}, {}, {}, {}
    meter.stamp(a, 4.0, "node1:100")
    meter.stamp(b, 9.0, "node1:100")
    meter.stamp(c, 12.0, "node2:200")  # the new group's first report
    meter.stamp(d, 15.0, "node2:200")
    assert [x["compute/cpu_s"] for x in (a, b, c, d)] == pytest.approx([4.0, 9.0, 21.0, 24.0])


def test_a_fused_trials_seeds_are_charged_what_they_used(monkeypatch):
    """A fused trial of 2 seeds: a fused cross-entropy epoch (40 s wall, 80 CPU-s) is charged in halves; then SCST
    trains seed 0 alone (30 s, 30 CPU-s), then seed 1 (50 s, 50 CPU-s), each charged whole. The seeds' totals sum
    to the trial's 120 s, where 1/k of each seed's elapsed time summed to (70 + 120) / 2 = 95."""
    import launch.trainable
    from launch.trainable import FusedClock

    walls, cpus = iter([0.0, 40.0, 40.0, 70.0, 120.0]), iter([0.0, 80.0, 80.0, 110.0, 160.0])
    monkeypatch.setattr(launch.trainable.time, "monotonic", lambda: next(walls))
    monkeypatch.setattr(launch.trainable.time, "process_time", lambda: next(cpus))
    clock = FusedClock(2)
    assert clock.charge(0, [0, 1]) == pytest.approx((20.0, 40.0))  # epoch 1 (XE), seed 0's report
    assert clock.charge(1, [0, 1]) == pytest.approx((20.0, 40.0))  # seed 1's, at once
    assert clock.charge(0, [0]) == pytest.approx((50.0, 70.0))  # seed 0's SCST epoch
    assert clock.charge(1, [1]) == pytest.approx((70.0, 90.0))  # seed 1's, after it
    assert sum(w for w, _ in clock.charged) == pytest.approx(120.0)
    assert sum(c for _, c in clock.charged) == pytest.approx(160.0)

    monkeypatch.setattr(launch.trainable.time, "monotonic", lambda: 0.0)
    seed = ComputeMeter([{"epoch": 1, "compute/wall_s": 2.0, "compute/gpu_s": 2.0}], gpus=1)
    item = {}
    seed.stamp(item, 90.0, wall_s=70.0)  # the seed's charged wall, not the attempt's elapsed time
    assert (item["compute/wall_s"], item["compute/gpu_s"]) == pytest.approx((72.0, 72.0))


def test_local_checkpoints_keep_the_best_and_the_latest(tmp_path):
    run = open_location(tmp_path / "run")
    store = LocalCheckpoints(run, "val/CIDEr", "max", num_to_keep=2)
    source = tmp_path / "src"
    source.mkdir()
    (source / "checkpoint.pt").write_bytes(b"weights")
    (source / "history.json").write_text("[]")
    values = {1: 5.0, 2: 9.0, 3: 7.0, 4: 1.0}
    for epoch in values:
        assert store.save(str(source), epoch) == str(tmp_path / "run" / f"checkpoint_epoch{epoch:04d}")
        store.prune({e: v for e, v in values.items() if e <= epoch})
    assert store.complete_epochs() == [2, 3, 4]  # best two (9, 7) and the latest
    (tmp_path / "run" / "checkpoint_epoch0005").mkdir()  # a folder without its checkpoint.pt is not complete
    assert store.complete_epochs() == [2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "checkpoint_epoch0002", "checkpoint_epoch0003", "checkpoint_epoch0004", "checkpoint_epoch0005"]



def test_retention_keeps_the_epoch_scst_and_the_test_split_start_from_when_the_study_metric_is_another(tmp_path):
    """A study searching on val/BLEU-4 keeps its best BLEU epochs and the latest; a2core's own best epoch
    (`best/epoch` of every result), which a resumed trial's SCST and test evaluation start from, is kept too
    (pruned, the resumed trial failed at its SCST stage on a best.pt it no longer had). A study's trials pick it by
    the study's metric (train.select_metric); a trial configured before that key picked it by val CIDEr, as here."""
    from types import SimpleNamespace

    run = open_location(tmp_path / "run")
    store = LocalCheckpoints(run, "val/BLEU-4", "max", num_to_keep=1)
    source = tmp_path / "src"
    source.mkdir()
    (source / "checkpoint.pt").write_bytes(b"weights")
    log = SimpleNamespace(by_epoch={})
    trial = SimpleNamespace(log=log, log_result=lambda item, cpu, wall_s: log.by_epoch.__setitem__(item["epoch"], item))
    bleu, cider_best = {1: 30.0, 2: 20.0, 3: 35.0, 4: 25.0}, {1: 1, 2: 2, 3: 2, 4: 2}  # CIDEr peaked at epoch 2
    for epoch in bleu:
        store.keep_epoch(trial, {"epoch": epoch, "val/BLEU-4": bleu[epoch], "best/epoch": cider_best[epoch]},
                         str(source), 0.0, fused_wall_s=0.0)
    assert store.complete_epochs() == [2, 3, 4]  # a2core's best (2), the best BLEU (3), the latest (4)


def test_price_per_hour_is_absent_unless_given(tmp_path):
    base = {"name": "p", "data": {"kind": "synthetic", "root": str(tmp_path / "d"), "images": 40},
            "search": {"space": {"fusion": {"grid": ["max"]}}}}
    unpriced = StudySpec.from_dict(base)
    assert unpriced.resources.price_per_hour is None and "price_per_hour" not in unpriced.to_dict()["resources"]
    priced = StudySpec.from_dict({**base, "resources": {"price_per_hour": 2}})
    assert priced.resources.price_per_hour == 2.0
    assert "price_per_hour" in priced.to_dict()["resources"]
    with pytest.raises(ConfigError, match="resources.price_per_hour"):
        StudySpec.from_dict({**base, "resources": {"price_per_hour": -1}})
