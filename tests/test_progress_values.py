"""The figures of `launch.progress` and `launch.conclusions` checked by hand on fixed inputs: trials stopped early by
ASHA, errored trials, a trial past its last epoch but still running, no epoch ended yet, one trial, the percent near
the end, the compute line, the verdict and the trial table. No Ray, no MLflow."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from launch.conclusions import compute_line, format_groups, format_table, print_conclusions, verdict
from launch.progress import Progress, duration_text, progress_line, study_progress
from launch.spec import load_study

SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"
pytestmark = pytest.mark.outside_ray_group  # starts no Ray: runs beside the group


def smoke(*overrides: str):
    """The smoke study (2 configurations x 4 seeds = 8 trials, ASHA, 2 side by side) with 4 epochs a trial."""
    return load_study(SMOKE, ["train.xe_epochs=4", "storage=/tmp/unused", *overrides], check_files=False)


def row(trial_id: str, state: str, done: int, wall: float | None, planned: int = 4) -> dict:
    """A trial of the record as `study_progress` reads it: its epochs and its cumulative wall seconds."""
    return {"trial_id": trial_id, "state": state, "epochs_done": done, "epochs_planned": planned,
            "compute": {} if wall is None else {"wall_s": wall}}


# -- progress ------------------------------------------------------------------------------------------------------
def test_a_study_whose_trials_asha_stopped_reads_complete_when_every_trial_has_ended():
    """8 trials of 4 epochs, 30 s an epoch: 4 ran their 4 epochs, ASHA stopped 4 at epoch 1. 20 trial-epochs ran and
    none is left: the study is 20/20 (100%), not 20/32 (62%) next to "every trial has ended"."""
    spec = smoke()
    trials = ([row(f"t{i}", "TERMINATED", 4, 120.0) for i in range(4)]
              + [row(f"t{i}", "TERMINATED", 1, 30.0) for i in range(4, 8)])
    p = study_progress(spec, trials, driven=False)
    assert (p.epochs_done, p.epochs_planned, p.epochs_left) == (20, 20, 0)
    assert progress_line(p) == "progress: 20/20 trial-epochs (100%); every trial has ended"


def test_a_stopped_or_errored_trials_unrun_epochs_are_no_longer_planned_mid_study():
    """t0 ran 4/4, ASHA stopped t1 at 1/4, t2 errored at 2/4, t3 runs at 2/4, 4 not started (4 epochs each).
    done 4 + 1 + 2 + 2 = 9; left: t3's 2 + 4 x 4 = 18; planned = what will have run = 9 + 18 = 27 (33%), not the
    32 that counts t1's and t2's epochs that never run (28%). 30 s an epoch: 270 s / 9 epochs; t3 and the 4 to
    start run 2 at a time: 18 x 30 / 2 = 270 s."""
    spec = smoke()
    trials = [row("t0", "TERMINATED", 4, 120.0), row("t1", "TERMINATED", 1, 30.0), row("t2", "ERROR", 2, 60.0),
              row("t3", "RUNNING", 2, 60.0)]
    p = study_progress(spec, trials, driven=True)
    assert (p.epochs_done, p.epochs_planned, p.epochs_left) == (9, 27, 18)
    assert p.seconds_per_epoch == pytest.approx(30.0) and p.concurrency == 2
    assert p.seconds_left == pytest.approx(270.0)
    assert progress_line(p) == ("progress: 9/27 trial-epochs (33%); 30 s a trial-epoch; about 4 min left at 2 trials "
                                "at a time (at most: early stopping may end trials sooner)")


def test_epochs_done_never_exceed_the_planned_ones():
    """A running trial that reported more epochs than the study plans (its log from a longer spec, resumed): the
    line never reads more than 100%."""
    spec = smoke("search.scheduler={fifo: {}}")
    trials = [row(f"t{i}", "TERMINATED", 4, 40.0) for i in range(7)] + [row("t7", "RUNNING", 5, 50.0)]
    p = study_progress(spec, trials, driven=True)
    assert p.epochs_done == 33 and p.epochs_left == 0 and p.epochs_planned == 33


def test_the_percent_reads_100_only_when_nothing_is_left():
    """399 of 400 trial-epochs is 99.75%: `:.0%` rounds it to "100%" next to a time left."""
    line = progress_line(Progress(399, 400, 1, 60.0, True, 1, False))
    assert line.startswith("progress: 399/400 trial-epochs (99%); 1 min a trial-epoch; about 1 min left at 1 trial ")
    assert progress_line(Progress(400, 400, 0, 60.0, True, 1, False)).startswith("progress: 400/400 trial-epochs "
                                                                                 "(100%)")
    assert "(0%)" in progress_line(Progress(1, 400, 399, 60.0, True, 2, False))  # 0.25%: just begun
    assert "(50%)" in progress_line(Progress(1, 2, 1, 60.0, True, 2, False))


def test_a_trial_past_its_last_epoch_is_no_slot_for_the_epochs_left():
    """7 trials ended; t6 reported its 4th and last epoch and is still RUNNING (testing its selected checkpoint), t7
    runs at 2/4. The 2 epochs left are t7's alone: 2 x 100 s at 1 trial at a time = 200 s, not 100 s at 2."""
    spec = smoke("search.scheduler={fifo: {}}")
    trials = ([row(f"t{i}", "TERMINATED", 4, 400.0) for i in range(6)]
              + [row("t6", "RUNNING", 4, 400.0), row("t7", "RUNNING", 2, 200.0)])
    p = study_progress(spec, trials, driven=True)
    assert (p.epochs_left, p.concurrency) == (2, 1)
    assert p.seconds_left == pytest.approx(200.0)
    assert progress_line(p).endswith("about 3 min left at 1 trial at a time")


def test_no_epoch_ended_yet_has_no_time_per_epoch():
    """Two trials started, neither has reported an epoch (one has a wall time from an old log but no epoch): the
    time is unknown, planned is every trial's epochs, nothing done."""
    spec = smoke()
    trials = [row("t0", "RUNNING", 0, None), row("t1", "RUNNING", 0, 50.0)]
    p = study_progress(spec, trials, driven=True)
    assert (p.epochs_done, p.epochs_planned, p.epochs_left, p.seconds_per_epoch) == (0, 32, 32, None)
    assert p.seconds_left is None
    assert progress_line(p) == "progress: 0/32 trial-epochs (0%); time left: known once a trial-epoch has ended"
    # a trial's wall time counts with its epochs only: 50 s without an epoch is not spread over another's
    p = study_progress(spec, trials + [row("t2", "RUNNING", 2, 60.0)], driven=True)
    assert p.seconds_per_epoch == pytest.approx(30.0)


def test_one_trial_study():
    """One trial of 4 epochs, 2 allowed side by side: it runs alone. Before it starts 0/4; at 3/4 (90 s) 1 epoch
    of 30 s left at 1 at a time."""
    spec = smoke("search.replicates=1", "search.space={fusion: {grid: [none]}}", "search.scheduler={fifo: {}}")
    assert spec.num_trials == 1
    p = study_progress(spec, [], driven=True)
    assert (p.epochs_done, p.epochs_planned, p.epochs_left, p.concurrency) == (0, 4, 4, 1)
    p = study_progress(spec, [row("t0", "RUNNING", 3, 90.0)], driven=True)
    assert (p.epochs_done, p.epochs_planned, p.epochs_left, p.concurrency) == (3, 4, 1, 1)
    assert progress_line(p) == ("progress: 3/4 trial-epochs (75%); 30 s a trial-epoch; about 30 s left at 1 trial "
                                "at a time")
    p = study_progress(spec, [row("t0", "TERMINATED", 4, 120.0)], driven=False)
    assert progress_line(p) == "progress: 4/4 trial-epochs (100%); every trial has ended"


def test_concurrency_larger_than_the_trials_left():
    """4 allowed side by side; 6 trials ended, 1 runs at 1/4, 1 not started: 2 trials can run, so 3 + 4 = 7 epochs
    of 30 s at 2 at a time = 105 s."""
    spec = smoke("resources.max_concurrent_trials=4", "search.scheduler={fifo: {}}")
    trials = [row(f"t{i}", "TERMINATED", 4, 120.0) for i in range(6)] + [row("t6", "RUNNING", 1, 30.0)]
    p = study_progress(spec, trials, driven=True)
    assert (p.epochs_left, p.concurrency) == (7, 2)
    assert p.seconds_left == pytest.approx(105.0)


def test_a_resumed_trials_cumulative_wall_time_prices_its_epochs():
    """A resumed trial's `wall_s` is cumulative over its attempts (`ComputeMeter`): 3 epochs at 200 s in all, with a
    trial of 1 epoch at 40 s: 240 s / 4 epochs = 60 s."""
    spec = smoke("search.scheduler={fifo: {}}")
    p = study_progress(spec, [row("t0", "RUNNING", 3, 200.0), row("t1", "RUNNING", 1, 40.0)], driven=False)
    assert p.seconds_per_epoch == pytest.approx(60.0)
    assert progress_line(p).endswith("; no driver runs the study now (`a2 study resume` continues it)")


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (-5, "0 s"), (0.4, "0 s"), (59.4, "59 s"), (59.6, "1 min"),
                                           (3599.6, "1 h 00 min"), (86_399.6, "1 d 0 h"), (90_061, "1 d 1 h")])
def test_duration_text_at_its_unit_boundaries(seconds, text):
    assert duration_text(seconds) == text


# -- conclusions ---------------------------------------------------------------------------------------------------
@pytest.fixture
def concluded(tmp_path):
    """(spec, rows, summary): none 100/101/102 and gate (lambda 0.035) 104/105/106 over seeds 0-2, 4 epochs of 30 s
    (60 GPU-s) each; gate lambda 0.2 seed 0 at 111 stopped by ASHA after its first epoch (30 s)."""
    from launch.location import StudyLocation
    from launch.record import summarize, trial_row

    spec = load_study(SMOKE, [f"storage={tmp_path / 'st'}", "name=values", "train.xe_epochs=4"], check_files=False)
    location = StudyLocation(spec.name, spec.storage)
    rows = []
    for (fusion, lam), values in {("none", None): [100.0, 101.0, 102.0], ("gate", 0.035): [104.0, 105.0, 106.0],
                                  ("gate", 0.2): [111.0]}.items():
        for seed, value in enumerate(values):
            epochs = 1 if lam == 0.2 else 4
            history = [{"epoch": e, spec.metric: value - (epochs - e), "compute/wall_s": 30.0 * e,
                        "compute/gpu_s": 60.0 * e} for e in range(1, epochs + 1)]
            row_ = trial_row(spec, location, f"{fusion}-{lam}-{seed}", {"fusion": fusion, "seed": seed,
                                                                       **({} if lam is None else {"lambda": lam})},
                             "TERMINATED", history, history[-1])
            rows.append(replace(row_, stopped_early={"rung": 2, "cutoff": 108.0} if lam == 0.2 else None,
                                final={spec.metric: value}))
    return spec, rows, summarize(spec, location, rows)


def test_the_compute_line_adds_up_the_trials(concluded):
    """Wall: 6 x 120 + 30 = 750 s; GPU: 6 x 240 + 60 = 1500 GPU-s; the stopped trial's 30 s / 1 epoch x the 3 it did
    not run = 90 s saved (180 GPU-s)."""
    _, _, summary = concluded
    assert compute_line(summary["compute"]) == ("compute: 750 s wall, 1500 GPU-s; on early-stopped trials 30 s wall, "
                                                "60 GPU-s; early stopping saved 90 s wall, 180 GPU-s")
    assert compute_line({}) == "compute: not recorded"


def test_the_verdict_lines_agree_with_the_intervals_they_print(concluded):
    """Best trial: the stopped 111 is kept out, gate seed 2 at 106 against none seed 2 at 102: +4.00. Best group gate
    0.035: mean 105, sd 1, t(0.975, 2) = 4.303 x 1/sqrt(3) = 2.48: [102.5, 107.5]; against none's 101 (Welch,
    se sqrt(2/3), df 4, t 2.776): 4.0 [1.7, 6.3], a resolved gap that the line calls a win."""
    spec, _, summary = concluded
    first, group = verdict(summary).splitlines()
    assert first == ("best trial gate-0.035-2: val/CIDEr 106.00 at epoch 4 (fusion gate, lambda 0.035, seed 2); the "
                     "baseline's run with that seed (fusion none, trial none-None-2): 102.00, +4.00 (one seed each: "
                     "no verdict)")
    assert group.startswith("best configuration (fusion gate, lambda 0.035): val/CIDEr 105.0 [102.5, 107.5] over 3 "
                            "seeds; gate beats none by 4.0 val CIDEr [1.7, 6.3]")
    groups = format_groups(summary["groups"], spec.metric).splitlines()
    assert groups[2].split()[1:6] == ["none", "-", "3", "101.0", "[98.5,"]
    assert "111.0 (1 seed: no interval)" in groups[4] and groups[4].endswith("stopped early (rung 2, cutoff 108.0)")


def test_a_verdict_that_could_not_be_made_says_why(concluded):
    """The family of verdicts is an error (arms' per-image scores on different images): the group line says so
    rather than ending without a verdict and without a reason."""
    _, _, summary = concluded
    broken = {**summary, "verdicts": {"by": "fusion", "error": "trials a and b of one configuration have per-image "
                                      "val CIDEr of different images", "comparisons": []}}
    group = verdict(broken).splitlines()[1]
    assert group.endswith("over 3 seeds; no verdict: trials a and b of one configuration have per-image val CIDEr of "
                          "different images")


def test_a_baseline_best_trial_and_a_missing_baseline(concluded):
    _, _, summary = concluded
    best = {**summary["best"], "fusion": "none", "lambda": None}
    assert verdict({**summary, "best": best, "best_group": None}) == (
        "best trial gate-0.035-2: val/CIDEr 106.00 at epoch 4 (fusion none, lambda -, seed 2); it is itself the "
        "baseline (fusion none)")
    assert verdict({**summary, "baseline": None, "best_group": None}).endswith(
        "; no baseline (fusion none) trial with seed 2 in the study")
    assert verdict({**summary, "best": None}) == "study values: no trial reported val/CIDEr"


def test_each_table_row_is_its_own_trials(concluded, capsys):
    spec, rows, summary = concluded
    body = {line.split()[0]: line.split() for line in format_table(rows, spec).splitlines()[2:]}
    assert body["none-None-1"][1:] == ["none", "-", "1", "TERMINATED", "4/4", "101", "101"]
    assert body["gate-0.035-2"][1:] == ["gate", "0.035", "2", "TERMINATED", "4/4", "106", "106"]
    assert body["gate-0.2-0"][1:4] == ["gate", "0.2", "0"] and body["gate-0.2-0"][-3:] == ["1/4", "111", "111"]
    errored = replace(rows[0], state="ERROR", epochs_done=2, last=99.0)
    assert format_table([errored], spec).splitlines()[2].split()[1:] == ["none", "-", "0", "ERROR", "2/4", "99", "100"]
    print_conclusions(spec, summary, rows)
    out = capsys.readouterr().out
    assert out.count("replicate groups (mean over seeds") == 1 and out.rstrip().endswith("early stopping saved 90 s "
                                                                                         "wall, 180 GPU-s")


def test_a_clock_that_went_back_between_records_prices_by_the_trials_most_wall_time(tmp_path):
    """A trial's result log whose `compute/wall_s` went back (60 s at epoch 2, 50 s at epoch 3): the record keeps
    its largest cumulative wall time, 60 s over 3 epochs = 20 s an epoch, never a negative or shrunken figure."""
    from launch.location import StudyLocation
    from launch.record import trial_row

    spec = load_study(SMOKE, [f"storage={tmp_path / 'st'}", "name=clock", "train.xe_epochs=4",
                              "search.scheduler={fifo: {}}"], check_files=False)
    history = [{"epoch": e, spec.metric: 50.0, "compute/wall_s": wall} for e, wall in ((1, 30.0), (2, 60.0),
                                                                                       (3, 50.0))]
    trial = trial_row(spec, StudyLocation(spec.name, spec.storage), "t0", {"fusion": "none", "seed": 0}, "RUNNING",
                      history, history[-1])
    assert trial.compute == {"wall_s": 60.0} and trial.epochs_done == 3
    p = study_progress(spec, [trial], driven=True)
    assert p.seconds_per_epoch == pytest.approx(20.0) and (p.epochs_done, p.epochs_left) == (3, 1 + 7 * 4)
