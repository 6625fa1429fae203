"""`launch.progress` at its edges, checked by hand on fixed rows: a trial past its last epoch that is still testing
its selected checkpoint (the line and `a2 study status --watch`), and rounds of seeds (adaptive replicates, the
confirmation seeds, fused trials), whose rounds run one after another. No Ray, no MLflow."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from launch.layout import seed_trial_id
from launch.progress import study_progress, progress_line
from launch.spec import load_study

SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"
pytestmark = pytest.mark.outside_ray_group  # starts no Ray: runs beside the group


def smoke(*overrides: str):
    """The smoke study (2 configurations, none and gate, x 4 seeds; 2 side by side) with 4 epochs a trial, FIFO."""
    return load_study(SMOKE, ["train.xe_epochs=4", "storage=/tmp/unused", "search.scheduler={fifo: {}}", *overrides],
                      check_files=False)


def row(trial_id: str, state: str, done: int, wall: float | None, seed: int = 0, fusion: str = "none") -> dict:
    """A trial of the record as `study_progress` reads it: its epochs, cumulative wall seconds and sampled seed."""
    return {"trial_id": trial_id, "state": state, "epochs_done": done, "epochs_planned": 4,
            "compute": {} if wall is None else {"wall_s": wall}, "sampled": {"fusion": fusion, "seed": seed}}


# -- a trial past its last epoch, not ended -------------------------------------------------------------------------
def test_a_trial_testing_its_selected_checkpoint_has_not_ended():
    """7 trials ended; t7 reported its 4th and last epoch and is still RUNNING (testing its selected checkpoint).
    No epoch is left, but not every trial has ended: the line says t7 is finishing, and once it is TERMINATED, that
    every trial has ended."""
    spec = smoke()
    ended = [row(f"t{i}", "TERMINATED", 4, 400.0, seed=i % 4, fusion=("none", "gate")[i // 4]) for i in range(7)]
    p = study_progress(spec, ended + [row("t7", "RUNNING", 4, 400.0, seed=3, fusion="gate")], driven=True)
    assert (p.epochs_done, p.epochs_planned, p.epochs_left, p.finishing, p.ended) == (32, 32, 0, 1, False)
    assert progress_line(p) == ("progress: 32/32 trial-epochs (100%); 1 trial past its last epoch, not ended yet "
                                "(testing the selected checkpoint)")
    p = study_progress(spec, ended + [row("t7", "RUNNING", 4, 400.0, 3, "gate"), row("t8", "RUNNING", 5, 500.0)],
                       driven=False)  # one past the spec's epochs too (its log from a longer spec, resumed)
    assert p.finishing == 2 and progress_line(p).endswith(
        "; 2 trials past their last epoch, not ended yet (testing the selected checkpoint); no driver runs the study "
        "now (`a2 study resume` continues it)")
    p = study_progress(spec, ended + [row("t7", "TERMINATED", 4, 400.0, seed=3, fusion="gate")], driven=True)
    assert p.ended and progress_line(p) == "progress: 32/32 trial-epochs (100%); every trial has ended"


def test_watch_goes_on_while_a_trial_tests_its_selected_checkpoint(monkeypatch, capsys):
    """`a2 study status --watch`: the study's last trial is past its last epoch and RUNNING at the first look, then
    TERMINATED: the watch looks twice (sleeping once in between), not stopping at the first look."""
    import launch.commands.show as show

    spec = smoke()
    ended = [row(f"t{i}", "TERMINATED", 4, 400.0, seed=i % 4, fusion=("none", "gate")[i // 4]) for i in range(7)]
    looks = iter([study_progress(spec, ended + [row("t7", state, 4, 400.0, 3, "gate")], driven=True)
                  for state in ("RUNNING", "TERMINATED")])
    monkeypatch.setattr(show, "status", lambda args: next(looks))
    slept = []
    monkeypatch.setattr(show.time, "sleep", slept.append)
    assert show.cmd_status(argparse.Namespace(name="s", storage=None, json=False, watch=5.0)) == 0
    assert slept == [5.0] and next(looks, None) is None
    assert capsys.readouterr().out.count("a2 study status s (every 5 s") == 2


# -- rounds of seeds, one after another -----------------------------------------------------------------------------
def test_adaptive_rounds_run_one_after_another():
    """Seeds 2, 4, 6 (3 rounds of 2 seeds x 2 configurations = 4 trials each), 8 allowed side by side, 4 epochs of
    100 s. Round 1's 4 trials are at 2/4: its 8 epochs left at 4 at a time = 200 s; rounds 2 and 3 start only once
    the round before has ended, 16 epochs at 4 at a time = 400 s each: 1000 s in all (at most: settled arms get no
    more seeds), not the 40 epochs left at 8 at a time (500 s) that ran the rounds side by side."""
    spec = smoke("search.replicates={min: 2, max: 6}", "resources.max_concurrent_trials=8")
    assert spec.replicate_rounds == (2, 4, 6) and spec.num_trials == 12
    p = study_progress(spec, [], driven=True)  # none started: every round planned, nothing priced yet
    assert (p.epochs_left, p.rounds, p.concurrency) == (48, ((16, 4), (16, 4), (16, 4)), 4)
    trials = [row(f"{f}{s}", "RUNNING", 2, 200.0, seed=s, fusion=f) for f in ("none", "gate") for s in (0, 1)]
    p = study_progress(spec, trials, driven=True)
    assert (p.epochs_done, p.epochs_left, p.concurrency) == (8, 40, 4)
    assert p.rounds == ((8, 4), (16, 4), (16, 4))
    assert p.seconds_left == pytest.approx(1000.0)
    assert progress_line(p) == ("progress: 8/48 trial-epochs (17%); 2 min a trial-epoch; about 17 min left in 3 "
                                "rounds of seeds, one after another (this one at 4 trials at a time) (at most: arms "
                                "settled after a round get no more seeds)")
    # round 2 under way, 1 of its trials at 3/4 and 3 ended: its 1 epoch alone, then round 3's 16 at 4 at a time
    trials = ([row(f"{f}{s}", "TERMINATED", 4, 400.0, seed=s, fusion=f) for f in ("none", "gate") for s in range(4)]
              [:-1] + [row("gate3", "RUNNING", 3, 300.0, seed=3, fusion="gate")])
    p = study_progress(spec, trials, driven=True)
    assert (p.rounds, p.concurrency) == (((1, 1), (16, 4)), 1)
    assert p.seconds_left == pytest.approx(100.0 + 400.0)


def test_confirmation_seeds_are_a_round_after_the_search():
    """search.confirm=2: 8 search trials (seeds 0-3), then seeds 4 and 5 of each fusion's chosen configuration (4
    trials), only once every search trial has ended; 8 allowed side by side. The last search trial at 2/4 runs alone
    (2 x 100 s), then the 4 confirmation trials 4 at a time (16 x 100 / 4 = 400 s): 600 s, not 18 epochs at 5 at a
    time (360 s)."""
    spec = smoke("search.confirm=2", "resources.max_concurrent_trials=8")
    assert spec.seed_rounds == (4, 6) and spec.num_trials == 12
    trials = ([row(f"{f}{s}", "TERMINATED", 4, 400.0, seed=s, fusion=f) for f in ("none", "gate") for s in range(4)]
              [:-1] + [row("gate3", "RUNNING", 2, 200.0, seed=3, fusion="gate")])
    p = study_progress(spec, trials, driven=True)
    assert (p.epochs_left, p.rounds, p.concurrency) == (18, ((2, 1), (16, 4)), 1)
    assert p.seconds_left == pytest.approx(600.0)
    assert "at most" not in progress_line(p)  # the confirmation round's trials are known: every fusion's one


def test_fused_rounds_run_their_tune_trials_side_by_side():
    """Adaptive seeds 2, 4, 6 fused (resources.fuse_replicates): each round is 2 Tune trials (one per configuration,
    its 2 seeds at once, each seed's row charged half the wall time); 4 allowed side by side, so each round runs 2 at a
    time. Round 1 at 2/4 (200 s of wall each fused trial: 50 s a seed-epoch): 8 seed-epochs x 50 / 2 = 200 s, then 2
    rounds of 16 x 50 / 2 = 400 s: 1000 s, not 40 x 50 / 4 = 500 s."""
    spec = smoke("search.replicates={min: 2, max: 6}", "resources.fuse_replicates=true",
                 "resources.max_concurrent_trials=4")
    assert spec.tune_samples == 6
    trials = [{**row(seed_trial_id(f"{f}_0000", s), "RUNNING", 2, 100.0, seed=s, fusion=f)}
              for f in ("none", "gate") for s in (0, 1)]
    p = study_progress(spec, trials, driven=True)
    assert p.seconds_per_epoch == pytest.approx(50.0)
    assert (p.epochs_left, p.rounds, p.concurrency) == (40, ((8, 2), (16, 2), (16, 2)), 2)
    assert p.seconds_left == pytest.approx(1000.0)


# -- the driver's live table under an adaptive design ---------------------------------------------------------------
def test_the_live_table_plans_no_more_trials_once_the_adaptive_design_has_ended(tmp_path, capsys):
    """The searcher writes `rounds.json` at each round's end; once it says the design is done, the driver's table
    plans none of the trials not started (as `status` does): 4 trials of round 1 ran their 4 epochs, the design
    settled every arm, so 16/16 and every trial has ended, not 16/48 with 32 epochs left 'at most'."""
    from launch.adaptive import ROUNDS_FILE, design_ended
    from launch.driver import _reporter
    from launch.location import StudyLocation

    spec = smoke("search.replicates={min: 2, max: 6}", "resources.max_concurrent_trials=8")
    location = StudyLocation("adaptive", str(tmp_path))

    class TuneTrial:  # what the live table reads of Tune's trials
        def __init__(self, trial_id, fusion, seed):
            self.trial_id, self.status, self.config = trial_id, "TERMINATED", {"fusion": fusion, "seed": seed}
            if fusion == "gate":
                self.config["lambda"] = 0.035
            self.last_result = {"epoch": 4, "val/CIDEr": 0.5, "compute/wall_s": 400.0}
            self.metric_analysis = {"val/CIDEr": {"max": 0.5, "last": 0.5}}

    trials = [TuneTrial(f"{f}{s}", f, s) for f in ("none", "gate") for s in (0, 1)]
    for written, line in ((None, "progress: 16/48 trial-epochs (33%)"),
                          ('{"round": 1, "done": false}', "progress: 16/48 trial-epochs (33%)"),
                          ("{not json", "progress: 16/48 trial-epochs (33%)"),
                          ('{"round": 1, "done": true}', "progress: 16/16 trial-epochs (100%); every trial has ended")):
        if written is not None:
            location.write_text(written, ROUNDS_FILE)
        reporter = _reporter(spec, design_ended_of=lambda: design_ended(location))
        reporter.report(trials, True)
        assert capsys.readouterr().out.splitlines()[-1].startswith(line), written


def test_a_duration_is_rounded_to_its_smallest_unit_shown():
    """Truncated, 100 s read "1 min" (a 40% error in a trial-epoch's time) and 7,190 s "1 h 59 min"."""
    from launch.progress import duration_text

    cases = {0: "0 s", 59.4: "59 s", 59.6: "1 min", 100: "2 min", 3569: "59 min", 3599: "1 h 00 min",
             7190: "2 h 00 min", 7_500: "2 h 05 min", 86_399: "1 d 0 h", 3 * 86_400 + 4 * 3600 + 1799: "3 d 4 h"}
    assert {s: duration_text(s) for s in cases} == cases
