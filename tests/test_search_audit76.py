"""Audit of launch/search.py's `ReplicateASHA`: the scheduler's hooks called directly, as Tune's controller calls them,
with Tune's own `Trial` objects (no Ray cluster)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from ray.tune.experiment import Trial
from ray.tune.schedulers import TrialScheduler

from launch.search import ReplicateASHA

pytestmark = pytest.mark.outside_ray_group

METRIC = "val/CIDEr"


def make_trial(tid: str, config: dict, max_failures: int = 1) -> Trial:
    trial = Trial("a2", config=config, trial_id=tid, stub=True, max_failures=max_failures)
    trial.set_status(Trial.RUNNING)
    return trial


def fail(sched: ReplicateASHA, controller, trial: Trial) -> None:
    """What Tune's controller does when a running trial errors (`TuneController._process_trial_failure`): count the
    failure; one it retries is set ERROR, told to the scheduler, set PENDING and added again; one it does not retry is
    told to the scheduler while still RUNNING, then set ERROR."""
    trial.run_metadata.num_failures += 1
    if trial.should_recover():
        trial.set_status(Trial.ERROR)
        sched.on_trial_error(controller, trial)
        trial.set_status(Trial.PENDING)
        sched.on_trial_add(controller, trial)
    else:
        sched.on_trial_error(controller, trial)
        trial.set_status(Trial.ERROR)


class Controller:
    def __init__(self, trials):
        self.trials = trials

    def get_trials(self):
        return list(self.trials)


def setup(hold: bool = False):
    sched = ReplicateASHA(max_t=8, grace_period=1, reduction_factor=2, replicates=3, min_gap_se=2.0,
                          hold_at_rungs=hold)
    assert sched.set_search_properties(METRIC, "max")
    a = [make_trial(f"a-{i}", {"fusion": "a", "seed": i}) for i in range(3)]
    b = [make_trial(f"b-{i}", {"fusion": "b", "seed": i}) for i in range(3)]
    controller = Controller(a + b)
    for t in a + b:
        sched.on_trial_add(controller, t)
    for t, v in zip(a, (9.0, 10.0, 11.0)):  # the cutoff at rung 1: 10, seed spread 1
        sched.on_trial_result(controller, t, {METRIC: v, "epoch": 1})
    return sched, controller, b


def test_a_replicate_tune_retries_is_waited_for_and_its_group_judged_on_all_its_seeds():
    sched, controller, b = setup()
    for t, v in zip(b[:2], (5.0, 6.0)):
        assert sched.on_trial_result(controller, t, {METRIC: v, "epoch": 1}) == TrialScheduler.CONTINUE
    fail(sched, controller, b[2])  # a lost node: Tune retries it from its checkpoint (max_failures 1)
    assert len(sched.group_means(1)) == 1  # group b is not judged on its two seeds
    assert sched.on_trial_result(controller, b[2], {METRIC: 7.0, "epoch": 1}) == TrialScheduler.STOP
    info = sched.stopped_early("b-2")
    assert info["group_mean"] == pytest.approx(6.0)  # all three seeds
    assert info["threshold"] == pytest.approx(2 * 1.0 * math.sqrt(2 / 3))


def test_a_replicate_that_errors_for_good_is_gone_and_its_group_judged_without_it():
    sched, controller, b = setup()
    for t, v in zip(b[:2], (5.0, 6.0)):
        sched.on_trial_result(controller, t, {METRIC: v, "epoch": 1})
    fail(sched, controller, b[2])  # retried ...
    fail(sched, controller, b[2])  # ... and failed again: max_failures spent
    assert b[2].status == Trial.ERROR
    assert sched.on_trial_result(controller, b[0], {METRIC: 5.0, "epoch": 2}) == TrialScheduler.STOP
    assert sched.stopped_early("b-0")["group_mean"] == pytest.approx(5.5)  # judged on the two seeds left


def test_replicates_held_at_a_rung_wait_for_one_tune_retries():
    sched, controller, b = setup(hold=True)
    assert sched.on_trial_result(controller, b[0], {METRIC: 5.0, "epoch": 1}) == TrialScheduler.PAUSE
    b[0].set_status(Trial.PAUSED)
    fail(sched, controller, b[2])  # pending again: on its way to the rung
    assert sched.on_trial_result(controller, b[1], {METRIC: 6.0, "epoch": 1}) == TrialScheduler.PAUSE
    assert sched.on_trial_result(controller, b[2], {METRIC: 7.0, "epoch": 1}) == TrialScheduler.STOP
    assert sched.stopped_early("b-2")["group_mean"] == pytest.approx(6.0)


def test_a_stand_in_trial_without_tunes_fields_ends_on_error():
    """The rehearsal's and the tests' stand-ins carry no status or retry count: an error ends them."""
    sched, controller, _ = setup()
    c = [SimpleNamespace(trial_id=f"c-{i}", config={"fusion": "c", "seed": i}) for i in range(3)]
    for t in c:
        sched.on_trial_add(None, t)
    for t, v in zip(c[:2], (5.0, 6.0)):
        sched.on_trial_result(None, t, {METRIC: v, "epoch": 1})
    sched.on_trial_error(None, c[2])
    assert sched.on_trial_result(None, c[0], {METRIC: 5.0, "epoch": 2}) == TrialScheduler.STOP
    assert sched.stopped_early("c-0")["group_mean"] == pytest.approx(5.5)
