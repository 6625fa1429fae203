"""Progress within an epoch (a COCO epoch is about two hours): a running trial writes the steps of its epoch done and
a step's wall time to its run folder (`launch.trainable.EpochProgress`), the record reads it
(`launch.layout.progress_record`, `Trial.under_way`), and `a2 study status` and the driver's live table count the
share done and time an epoch from its steps before any epoch has ended."""
from __future__ import annotations

import json

import pytest

from a2core.errors import StorageError
from a2core.train import StepProgress, train
from launch.conclusions import epochs_text, format_table
from launch.driver import _reporter
from launch.lease import StudyLease
from launch.layout import PROGRESS_FILE, TRIALS_DIR, progress_record, train_run_name
from launch.progress import progress_line, study_progress
from launch.record import with_under_way
from launch.storage import open_location
from launch.trainable import EpochProgress
from tests.studyfolder import fabricated_study
from tests.test_decode_empty_and_lr import tiny_config


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(done: int, total: int = 100, epoch: int = 1, stage: str = "xe") -> StepProgress:
    return StepProgress(stage, epoch, done, total, step=done)


def test_the_progress_file_is_written_at_the_first_step_then_at_most_every_interval(tmp_path):
    run, clock = open_location(str(tmp_path / "run")), Clock()
    progress = EpochProgress(run, every_s=30.0, clock=clock)
    progress(step(1))
    first = json.loads(run.join(PROGRESS_FILE).read_text())
    assert {k: first[k] for k in ("stage", "epoch", "done", "total", "seconds_per_step")} == {
        "stage": "xe", "epoch": 1, "done": 1, "total": 100, "seconds_per_step": None}  # one step times none
    clock.now += 29.0
    progress(step(30))
    assert json.loads(run.join(PROGRESS_FILE).read_text())["done"] == 1  # within the interval: not written
    clock.now += 1.0
    progress(step(31))
    record = json.loads(run.join(PROGRESS_FILE).read_text())
    assert (record["done"], record["seconds_per_step"]) == (31, pytest.approx(30.0 / 30))  # 30 s over steps 1-31
    # the next epoch is timed from its own first step, not the last one's
    clock.now += 500.0
    progress(step(2, epoch=2))
    clock.now += 40.0
    progress(step(12, epoch=2))
    record = json.loads(run.join(PROGRESS_FILE).read_text())
    assert (record["epoch"], record["done"], record["seconds_per_step"]) == (2, 12, pytest.approx(4.0))
    assert progress_record(run, 2) == {"stage": "xe", "epoch": 2, "done": 12, "total": 100,
                                       "seconds_per_step": pytest.approx(4.0)}
    assert progress_record(run, 3) is None  # an epoch reported already is the result log's


def test_a_write_that_fails_is_skipped_and_the_next_one_lands(tmp_path, monkeypatch):
    run, clock = open_location(str(tmp_path / "run")), Clock()
    progress = EpochProgress(run, every_s=30.0, clock=clock)
    target = type(run.join(PROGRESS_FILE))
    real = target.write_text
    monkeypatch.setattr(target, "write_text", lambda self, text: (_ for _ in ()).throw(StorageError("S3 down")))
    progress(step(1))  # no exception: the training goes on
    assert run.join(PROGRESS_FILE).read_text() is None
    monkeypatch.setattr(target, "write_text", real)
    clock.now += 1.0
    progress(step(2))  # the failed write set no interval: this one lands
    assert progress_record(run, 1)["done"] == 2


@pytest.mark.parametrize("text", ["{", "null", "[]", '{"epoch": 1}', '{"epoch": 1, "done": 5, "total": 0}',
                                  '{"epoch": 1, "done": 7, "total": 5}', '{"epoch": 1, "done": "5", "total": 9}',
                                  '{"epoch": 1, "done": 5, "total": 9, "seconds_per_step": NaN}',
                                  '{"epoch": 1, "done": 5, "total": 9, "seconds_per_step": -1}'])
def test_a_progress_file_that_is_not_one_costs_the_estimate_not_the_record(tmp_path, text):
    run = open_location(str(tmp_path / "run"))
    run.join(PROGRESS_FILE).write_text(text)
    assert progress_record(run, 1) is None


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return tiny_config(tmp_path_factory)


def test_a_real_run_writes_its_epochs_steps(tiny_run, tmp_path):
    """a2core's trainer calls the trial's callback after every step: with no interval each step is written, and the
    file ends at the last epoch's last step (2 epochs x 4 steps of 5 images)."""
    run = open_location(str(tmp_path / "trial"))
    seen = []
    progress = EpochProgress(run, every_s=0.0)
    train(tiny_run, report=lambda m, d: seen.append((m["epoch"], progress_record(run, m["epoch"]))),
          output_dir=tmp_path / "out", progress=progress)
    # at each epoch's report, the file holds that epoch's last step
    assert [(epoch, r["done"], r["total"], r["stage"]) for epoch, r in seen] == [(1, 4, 4, "xe"), (2, 4, 4, "xe")]
    assert all(r["seconds_per_step"] > 0 for _, r in seen)


def results(epochs: int, seconds_each: float) -> list[dict]:
    return [{"epoch": e, "val/CIDEr": 40.0 + e, "compute/wall_s": e * seconds_each} for e in range(1, epochs + 1)]


def write_progress(fab, trial_id: str, record: dict) -> None:
    fab.location.at(TRIALS_DIR, train_run_name(fab.spec.name, trial_id), PROGRESS_FILE).write_text(json.dumps(record))


def driven_trials(fab) -> list:
    """The record's trials while a driver holds the study (its lease): a running trial is running."""
    with StudyLease(fab.location.at()).held():
        return fab.record().trials


def test_status_counts_the_share_done_and_times_an_epoch_from_its_steps_before_any_epoch_ends(tmp_path):
    """The smoke study (8 trials of 4 epochs, 2 side by side) an hour into its first epochs: no epoch has ended, so
    before, the line said only that the time left is unknown. Trial t0 is 40% through its first epoch at 2 s a step
    of 1,000 (2,000 s an epoch), t1 10% at 3 s (3,000 s)."""
    fab = fabricated_study(tmp_path, "under-way", epochs=4)
    fab.add("t0", {"fusion": "none", "seed": 0}, [], status="RUNNING")
    fab.add("t1", {"fusion": "max", "seed": 0}, [], status="RUNNING")
    write_progress(fab, "t0", {"stage": "xe", "epoch": 1, "done": 400, "total": 1000, "seconds_per_step": 2.0})
    write_progress(fab, "t1", {"stage": "xe", "epoch": 1, "done": 100, "total": 1000, "seconds_per_step": 3.0})
    assert [t.under_way for t in fab.record().trials] == [None, None]  # no driver: nothing is under way
    trials = driven_trials(fab)
    assert [t.under_way["done"] for t in trials] == [400, 100]
    progress = study_progress(fab.spec, trials, driven=True)
    assert (progress.epochs_done, progress.epochs_left, progress.epochs_planned) == (0, 32, 32)
    assert progress.epochs_under_way == pytest.approx(0.5) and progress.from_steps
    assert progress.seconds_per_epoch == pytest.approx(2500.0)  # the two trials' epochs from their steps
    assert progress.seconds_left == pytest.approx((32 - 0.5) * 2500.0 / 2)
    assert progress_line(progress) == (
        "progress: 0/32 trial-epochs, 0.5 more under way (2%); 42 min a trial-epoch (from its training steps so far, "
        "validation not counted: no epoch has ended); about 10 h 56 min left at 2 trials at a time")
    assert [epochs_text(t) for t in trials] == ["0/4 +40%", "0/4 +10%"]
    assert "0/4 +40%" in format_table([t.row() | {"under_way": t.under_way} for t in trials], fab.spec)


def test_once_an_epoch_has_ended_its_wall_time_prices_the_rest_and_the_share_still_counts(tmp_path):
    fab = fabricated_study(tmp_path, "measured", epochs=4)
    fab.add("t0", {"fusion": "none", "seed": 0}, results(2, 100.0), status="RUNNING")
    fab.add("t1", {"fusion": "max", "seed": 0}, results(4, 100.0))
    write_progress(fab, "t0", {"stage": "xe", "epoch": 3, "done": 50, "total": 100, "seconds_per_step": 0.5})
    write_progress(fab, "t1", {"stage": "xe", "epoch": 5, "done": 50, "total": 100, "seconds_per_step": 0.5})
    progress = study_progress(fab.spec, driven_trials(fab), driven=True)
    # t0: 2 epochs left, half of its third done; t1 ended (its file is an old one: not read); 6 trials x 4 to start
    assert (progress.epochs_done, progress.epochs_left, progress.epochs_under_way) == (6, 26, 0.5)
    assert progress.seconds_per_epoch == pytest.approx(100.0) and not progress.from_steps
    assert progress.seconds_left == pytest.approx(25.5 * 100.0 / 2)
    assert progress_line(progress) == ("progress: 6/32 trial-epochs, 0.5 more under way (20%); 2 min a trial-epoch; "
                                       "about 21 min left at 2 trials at a time")


def test_the_mlflow_export_reads_no_progress_file_and_the_digest_keys_on_none(tmp_path, monkeypatch):
    """The export ticks every 2 s and needs no progress: it reads no progress file (on S3 a request per running
    trial per tick). The digest's listing leaves the file out: it changes every 30 s and no field of the row comes
    from it, so a running trial between epochs is taken from the digest, its progress read fresh."""
    from launch.mlflow_export import Export
    from launch.storage import Location

    fab = fabricated_study(tmp_path, "quiet", epochs=4)
    fab.add("t0", {"fusion": "none", "seed": 0}, results(1, 100.0), status="RUNNING")
    write_progress(fab, "t0", {"stage": "xe", "epoch": 2, "done": 10, "total": 100, "seconds_per_step": 1.0})
    read = []
    real = Location.read_text
    monkeypatch.setattr(Location, "read_text", lambda self, *a, **k: read.append(self.uri) or real(self, *a, **k))
    Export(fab.spec, fab.location).run(list(fab.trials))
    assert read and not [uri for uri in read if uri.endswith(PROGRESS_FILE)]
    with StudyLease(fab.location.at()).held():
        first = fab.record(for_digest=True)
        first.save_digest()
        assert PROGRESS_FILE not in [name for name, _, _ in first.files["t0"]]
        write_progress(fab, "t0", {"stage": "xe", "epoch": 2, "done": 60, "total": 100, "seconds_per_step": 1.0})
        read.clear()
        again = fab.record()
    assert again.trials[0].under_way["done"] == 60  # read fresh ...
    assert not [uri for uri in read if uri.endswith("results.json")]  # ... the row itself from the digest


def test_a_file_of_an_epoch_already_reported_or_of_a_trial_not_running_is_not_under_way(tmp_path):
    fab = fabricated_study(tmp_path, "stale", epochs=4)
    fab.add("t0", {"fusion": "none", "seed": 0}, results(2, 100.0), status="RUNNING")
    fab.add("t1", {"fusion": "max", "seed": 0}, results(2, 100.0), status="PAUSED")
    write_progress(fab, "t0", {"stage": "xe", "epoch": 2, "done": 100, "total": 100, "seconds_per_step": 1.0})
    write_progress(fab, "t1", {"stage": "xe", "epoch": 3, "done": 50, "total": 100, "seconds_per_step": 1.0})
    trials = driven_trials(fab)
    assert [t.under_way for t in trials] == [None, None]
    progress = study_progress(fab.spec, trials, driven=True)
    assert progress.epochs_under_way == 0 and "under way" not in progress_line(progress)


def test_the_drivers_live_table_reads_the_running_trials_files(tmp_path, capsys):
    fab = fabricated_study(tmp_path, "live", epochs=4)
    write_progress(fab, "t0", {"stage": "xe", "epoch": 2, "done": 25, "total": 100, "seconds_per_step": 1.0})

    class TuneTrial:  # what the live table reads of Tune's trials
        trial_id, status, config = "t0", "RUNNING", {"fusion": "none", "seed": 0}
        last_result = {"epoch": 1, "val/CIDEr": 0.5, "compute/wall_s": 100.0}
        metric_analysis = {"val/CIDEr": {"max": 0.5, "last": 0.5}}

    reporter = _reporter(fab.spec, under_way_of=lambda row: with_under_way(fab.spec, fab.location, row))
    reporter.report([TuneTrial()], False)
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[5:7] == ["1/4", "+25%"]
    # 31 epochs left less a quarter, 100 s each, 2 side by side
    assert out[-1] == ("progress: 1/32 trial-epochs, 0.2 more under way (4%); 2 min a trial-epoch; about 26 min left "
                       "at 2 trials at a time")
