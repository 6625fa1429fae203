"""How far along a study is and when it will end: trial-epochs done of planned, a trial-epoch's wall time so far,
the time left at the study's concurrency (at most, under early stopping), in `a2 study status` (text, JSON and
`--watch`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.cli import main
from launch.progress import Progress, duration_text, progress_line, study_progress
from tests.studyfolder import fabricated_study


def results(epochs: int, seconds_each: float) -> list[dict]:
    """A trial's result log: `epochs` epochs, each `seconds_each` of wall time (`compute/wall_s` is cumulative)."""
    return [{"epoch": e, "val/CIDEr": 40.0 + e, "compute/wall_s": e * seconds_each} for e in range(1, epochs + 1)]


@pytest.fixture
def study(tmp_path):
    """The smoke study (8 trials of 4 epochs, 2 side by side, FIFO): one trial ended (4 epochs of 30 s), one running
    (2 epochs of 60 s), 6 not started."""
    fab = fabricated_study(tmp_path, "progress", epochs=4)
    fab.add("t0", {"fusion": "none", "seed": 0}, results(4, 30.0))
    fab.add("t1", {"fusion": "max", "seed": 0}, results(2, 60.0), status="RUNNING")
    return fab


def test_progress_counts_trial_epochs_and_prices_the_rest_at_the_studys_concurrency(study):
    progress = study_progress(study.spec, study.record().trials, driven=True)
    # done 4 + 2; planned 8 trials x 4; left: t1's 2 + 6 x 4 not started = 26; 240 s over 6 epochs = 40 s each
    assert (progress.epochs_done, progress.epochs_planned, progress.epochs_left) == (6, 32, 26)
    assert progress.seconds_per_epoch == pytest.approx(40.0)
    assert progress.concurrency == 2 and not progress.early_stopping
    assert progress.seconds_left == pytest.approx(26 * 40.0 / 2)
    assert progress_line(progress) == ("progress: 6/32 trial-epochs (19%); 40 s a trial-epoch; about 9 min left at "
                                       "2 trials at a time")



def test_the_last_trial_running_alone_is_priced_alone(tmp_path):
    """7 of the smoke study's 8 trials ended, the last running: its epochs left take their own time, not half of it
    (two trials at a time is what the study allows, not what one trial left can use)."""
    fab = fabricated_study(tmp_path, "tail", epochs=4)
    for i in range(7):
        fab.add(f"t{i}", {"fusion": "none" if i % 2 else "max", "seed": i // 2}, results(4, 100.0))
    fab.add("t7", {"fusion": "max", "seed": 3}, results(2, 100.0), status="RUNNING")
    progress = study_progress(fab.spec, fab.record().trials, driven=True)
    assert (progress.epochs_left, progress.concurrency) == (2, 1)
    assert progress.seconds_left == pytest.approx(2 * 100.0)


def test_the_time_left_is_an_upper_bound_under_early_stopping_and_unknown_before_an_epoch():
    bound = Progress(10, 40, 30, 120.0, True, 4, True)
    assert progress_line(bound) == ("progress: 10/40 trial-epochs (25%); 2 min a trial-epoch; about 15 min left at "
                                    "4 trials at a time (at most: early stopping may end trials sooner)")
    assert progress_line(Progress(0, 40, 40, None, True, 4, True)).endswith(
        "time left: known once a trial-epoch has ended")
    assert progress_line(Progress(40, 40, 0, 60.0, False, 4, True)) == ("progress: 40/40 trial-epochs (100%); every "
                                                                        "trial has ended")
    assert progress_line(Progress(5, 40, 35, 60.0, False, 1, False)).endswith(
        "; no driver runs the study now (`a2 study resume` continues it)")
    assert [duration_text(s) for s in (40, 420, 7_500, 3 * 86_400 + 4 * 3600)] == ["40 s", "7 min", "2 h 05 min",
                                                                                   "3 d 4 h"]


def test_status_prints_the_progress_and_its_json_carries_it(study, monkeypatch, capsys):
    study.patch_tune(monkeypatch)
    storage = study.spec.storage
    assert main(["study", "status", "progress", "--storage", storage]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("progress: 6/32 trial-epochs (19%); 40 s a trial-epoch; about 9 min left at 2 trials")
    assert out[-1].endswith("no driver runs the study now (`a2 study resume` continues it)")
    assert main(["study", "status", "progress", "--storage", storage, "--json"]) == 0
    progress = json.loads(capsys.readouterr().out)["progress"]
    assert progress["epochs_done"] == 6 and progress["epochs_left"] == 26 and progress["seconds_left"] == 520.0


def test_watch_stops_by_itself_when_no_driver_runs_the_study(study, monkeypatch, capsys):
    """With no live driver (nothing will change) `--watch` prints once and returns, instead of polling forever."""
    study.patch_tune(monkeypatch)
    slept = []
    monkeypatch.setattr("time.sleep", slept.append)
    assert main(["study", "status", "progress", "--storage", study.spec.storage, "--watch", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("a2 study status progress (every 5 s; Ctrl-C stops)") and out.count("progress: 6/32") == 1
    assert slept == []


def test_adaptive_replicates_make_the_time_left_an_upper_bound_until_the_design_ends(tmp_path):
    """Seeds in rounds: the study's trials are planned up to the maximum's seeds, an arm settled after a round
    getting no more, so the time left is at most the figure; once the design has settled every arm
    (`Rounds.done`), the trials not started yet never run and are not counted."""
    fab = fabricated_study(tmp_path, "adaptive", epochs=4, overrides=("search.replicates={min: 2, max: 4}",))
    fab.add("t0", {"fusion": "none", "seed": 0}, results(4, 30.0))
    fab.add("t1", {"fusion": "max", "seed": 0}, results(2, 30.0), status="RUNNING")
    spec, trials = fab.spec, fab.record().trials
    open_design = study_progress(spec, trials, driven=True)
    unstarted = spec.num_trials - 2
    assert open_design.adaptive and open_design.epochs_left == 2 + unstarted * 4
    assert progress_line(open_design).endswith("(at most: arms settled after a round get no more seeds)")
    ended = study_progress(spec, trials, driven=True, design_ended=True)
    assert not ended.adaptive and (ended.epochs_planned, ended.epochs_left) == (8, 2)
    assert "at most" not in progress_line(ended)
    both = Progress(10, 40, 30, 120.0, True, 4, True, True)
    assert progress_line(both).endswith("(at most: early stopping may end trials sooner; arms settled after a round "
                                        "get no more seeds)")


def test_a_fused_trial_is_one_of_the_trials_run_side_by_side():
    """resources.fuse_replicates: a Tune trial trains its 4 seeds at once, 4 rows of the record each charged a
    quarter of its wall time. max_concurrent_trials bounds Tune's trials, so the last fused trial runs alone: its 4
    epochs left at 80 s each (4 seed-rows x 4 epochs x 20 s) take 320 s, not half of it. The rows used to count as 4
    trials running, so 2 at a time."""
    from launch.layout import seed_trial_id
    from launch.spec import load_study

    smoke = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"
    spec = load_study(smoke, ["resources.fuse_replicates=true", "resources.max_concurrent_trials=2"],
                      check_files=False)
    assert spec.tune_samples == 2 and spec.num_trials == 8 and spec.total_epochs == 8

    def rows(tune_id, epochs, seconds_each, state):
        return [{"trial_id": seed_trial_id(tune_id, seed), "state": state, "epochs_done": epochs,
                 "epochs_planned": 8, "compute": {"wall_s": epochs * seconds_each}} for seed in range(4)]

    last = study_progress(spec, rows("a_00000", 8, 10.0, "TERMINATED") + rows("a_00001", 4, 20.0, "RUNNING"), True)
    assert (last.epochs_left, last.concurrency) == (16, 1)
    both = study_progress(spec, rows("a_00000", 4, 20.0, "RUNNING") + rows("a_00001", 4, 20.0, "RUNNING"), True)
    assert both.concurrency == 2
    first = study_progress(spec, rows("a_00000", 4, 20.0, "RUNNING"), True)  # the other fused trial not started
    assert (first.epochs_left, first.concurrency) == (16 + 32, 2)
    seconds_per_seed_epoch = (8 * 4 * 10.0 + 4 * 4 * 20.0) / (8 * 4 + 4 * 4)
    assert last.seconds_left == pytest.approx(16 * seconds_per_seed_epoch)
