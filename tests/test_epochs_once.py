"""Every (run, key, step) reaches MLflow once: an epoch reported again (a resumed trial's first report, a retry, the
study's record exported again after the driver that exported it died) with another time or value is not written
again, by this tracker or by a new one (a new driver process)."""
from __future__ import annotations

from collections import Counter

import pytest

from launch.tracking_writer import StudyTracker


def _points(tracker: StudyTracker, run_id: str, key: str) -> Counter:
    return Counter(m.step for m in tracker.client.get_metric_history(run_id, key))


@pytest.mark.slow
def test_an_epoch_reported_again_is_written_once(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = StudyTracker(uri, "once")
    tracker.start_study()
    run = tracker.trial_run("t1", {"model": {"fusion": "none"}})
    for epoch in (1, 2):
        tracker.log_metrics(run, {"val/CIDEr": 10.0 * epoch, "train/loss": 3.0}, step=epoch, timestamp_ms=1000 * epoch)
    tracker.log_metrics(run, {"val/CIDEr": 99.0, "train/loss": 2.0}, step=2, timestamp_ms=5000)  # same process

    again = StudyTracker(uri, "once")  # a resumed driver: reads what the run holds once, then skips it
    again.start_study()
    assert again.trial_run("t1") == run
    again.log_metrics(run, {"val/CIDEr": 98.0, "best/val/CIDEr": 20.0}, step=2, timestamp_ms=6000)
    again.log_metrics(run, {"val/CIDEr": 11.0}, step=1, timestamp_ms=7000)  # epoch 1 exported again, then epoch 3
    again.log_metrics(run, {"val/CIDEr": 30.0}, step=3, timestamp_ms=8000)

    assert _points(again, run, "val/CIDEr") == {1: 1, 2: 1, 3: 1}
    assert _points(again, run, "train/loss") == {1: 1, 2: 1}
    assert _points(again, run, "best/val/CIDEr") == {2: 1}  # a key new at that step is written
    values = {m.step: m.value for m in again.client.get_metric_history(run, "val/CIDEr")}
    assert values == {1: 10.0, 2: 20.0, 3: 30.0}  # the first report of an epoch stays


def test_compare_of_a_running_study_says_so(tmp_path, capsys, monkeypatch):
    """While a live writer holds the study's lease, `compare` (and `report`) say the study is still running."""
    import argparse

    from launch.lease import StudyLease
    from launch.commands.show import cmd_compare
    from tests.studyfolder import fabricated_study

    fab = fabricated_study(tmp_path, "live", epochs=1)
    for seed, fusion in enumerate(("none", "gate")):
        fab.add(f"t{seed}", {"fusion": fusion, "seed": seed}, [{"epoch": 1, "val/CIDEr": 40.0 + seed}],
                status="TERMINATED" if seed == 0 else "RUNNING")
    fab.patch_tune(monkeypatch)
    args = argparse.Namespace(name="live", storage=fab.spec.storage, by="fusion", baseline=None, tracking_uri=None)
    with StudyLease(fab.location.at()).held():
        assert cmd_compare(args) == 0
        assert "note: study live is still running (1 of 2 trial runs finished so far)" in capsys.readouterr().out
    assert cmd_compare(args) == 0
    assert "still running" not in capsys.readouterr().out