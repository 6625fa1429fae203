"""Early stopping after `a2 study resume`: Tune 2.60 saves the searcher with every experiment snapshot and never the
scheduler, and `Tuner.restore` unpickles `tuner.pkl`, written before the first trial. The searcher carries
`ReplicateASHA`'s state (`GridCrossedSearcher.carry_state_of`). Checked with Tune's own Tuner, `tuner.pkl`, restore
and Trial objects (no Ray cluster: the controller's hooks are called as `TuneController.resume` calls them)."""
from __future__ import annotations

import pytest
from ray import tune
from ray.tune.experiment import Trial
from ray.tune.schedulers import TrialScheduler

from launch.search import ReplicateASHA, tune_config_kwargs
from launch.spec import load_study

pytestmark = pytest.mark.outside_ray_group

SMOKE = "studies/smoke.yaml"  # two configurations x 4 seeds, one ASHA rung at epoch 2


def trainable(config):  # never run: the Tuner is built and restored only
    return None


class Controller:
    def __init__(self):
        self.trials: list[Trial] = []

    def get_trials(self):
        return list(self.trials)


def suggested(searcher, n: int) -> list[Trial]:
    trials = []
    for i in range(n):
        config = searcher.suggest(f"t{i}")
        trial = Trial("a2", config=config, trial_id=f"t{i}", stub=True)
        trial.set_status(Trial.RUNNING)
        trials.append(trial)
    return trials


def report(sched, controller, trial, value, epoch=2):
    return sched.on_trial_result(controller, trial, {"val/CIDEr": value, "epoch": epoch})


def groups_of(sched: ReplicateASHA, trials) -> dict[str, list[Trial]]:
    out: dict[str, list[Trial]] = {}
    for t in trials:
        out.setdefault(sched._groups[t.trial_id], []).append(t)
    return out


def test_a_resumed_study_judges_a_group_against_the_groups_judged_before_the_resume(tmp_path):
    spec = load_study(SMOKE)
    kwargs = tune_config_kwargs(spec)
    searcher, sched = kwargs["search_alg"], kwargs["scheduler"]
    assert sched.set_search_properties(spec.metric, spec.mode)  # as `tune.run` does
    tune.Tuner(trainable, param_space={}, tune_config=tune.TuneConfig(**kwargs),
               run_config=tune.RunConfig(name="s", storage_path=str(tmp_path)))  # writes tuner.pkl
    controller = Controller()
    controller.trials = suggested(searcher, 8)
    for t in controller.trials:
        sched.on_trial_add(controller, t)
    first, second = groups_of(sched, controller.trials).values()
    assert len(first) == len(second) == 4
    for t, v in zip(first, (50.0, 51.0, 52.0, 53.0)):  # judged at rung 2: mean 51.5, seed spread 1.3
        assert report(sched, controller, t, v) == TrialScheduler.CONTINUE
    for t, v in zip(second[:2], (40.0, 41.0)):  # half the second group, then the driver is killed
        report(sched, controller, t, v)
    searcher.save(str(tmp_path / "searcher-state.pkl"))  # Tune's snapshot of the searcher

    restored = tune.Tuner.restore(str(tmp_path / "s"), trainable=trainable)._local_tuner._tune_config
    r_searcher, r_sched = restored.search_alg, restored.scheduler
    assert r_sched is not sched and r_sched.group_means(2) == {}  # tuner.pkl's scheduler: as before any trial
    assert r_searcher._scheduler is r_sched  # one pickle: the searcher still holds the scheduler Tune drives
    assert r_sched.set_search_properties(spec.metric, spec.mode)
    r_searcher.restore(str(tmp_path / "searcher-state.pkl"))  # TuneController.resume: searcher, then trials
    r_controller = Controller()
    for t in controller.trials:
        t.set_status(Trial.PENDING)
        r_controller.trials.append(t)
        r_sched.on_trial_add(r_controller, t)
        t.set_status(Trial.RUNNING)
    assert r_sched.group_means(2) == sched.group_means(2) and len(r_sched.group_means(2)) == 1
    # the second group's last two seeds: judged on its 4 seeds against the first group's mean, and stopped
    assert report(r_sched, r_controller, second[2], 40.5) == TrialScheduler.CONTINUE
    assert report(r_sched, r_controller, second[3], 41.5) == TrialScheduler.STOP
    decision = r_sched.stopped_early(second[3].trial_id)
    assert decision["rung"] == 2 and decision["group_mean"] == pytest.approx(40.75)
    assert decision["cutoff"] == pytest.approx(51.5)
    # the uninterrupted scheduler decides the same
    assert report(sched, controller, second[2], 40.5) == TrialScheduler.CONTINUE
    assert report(sched, controller, second[3], 41.5) == TrialScheduler.STOP
    assert sched.stopped_early(second[3].trial_id) == decision


def test_a_state_saved_before_the_scheduler_was_carried_restores_as_before(tmp_path):
    spec = load_study(SMOKE)
    kwargs = tune_config_kwargs(spec)
    searcher, sched = kwargs["search_alg"], kwargs["scheduler"]
    state = searcher.get_state()
    assert "scheduler" not in state and "scheduler_state" in state
    del state["scheduler_state"]  # an older study's snapshot
    searcher.set_state(state)
    assert searcher._scheduler is sched and sched.group_means(2) == {}


def test_a_saved_state_of_other_rungs_is_refused():
    sched = ReplicateASHA(max_t=8, grace_period=1, reduction_factor=2, replicates=2)
    other = ReplicateASHA(max_t=8, grace_period=2, reduction_factor=2, replicates=2)
    with pytest.raises(ValueError, match="rungs"):
        other.set_state(sched.get_state())


def test_an_errored_trial_resumed_counts_in_its_group_again():
    """An errored trial ended for good counts as gone below its rungs; `a2 study resume` (Tune's resume_errored)
    trains it again, and with the state carried across the resume it must count in its group again: counted gone,
    its group was judged on its other seeds while it still trained."""
    sched = ReplicateASHA(max_t=4, grace_period=1, reduction_factor=2, replicates=3)
    assert sched.set_search_properties("val/CIDEr", "max")
    controller = Controller()
    trials = [Trial("a2", config={"fusion": "none", "seed": i}, trial_id=f"a{i}", stub=True) for i in range(3)]
    for t in trials:
        t.set_status(Trial.RUNNING)
        controller.trials.append(t)
        sched.on_trial_add(controller, t)
    trials[2].set_status(Trial.ERROR)
    sched.on_trial_complete(controller, trials[2])  # errored for good before its first epoch
    state = sched.get_state()
    assert list(state["gone"].values()) == [{1: 1, 2: 1}] and state["ended"] == {"a2"}

    resumed = ReplicateASHA(max_t=4, grace_period=1, reduction_factor=2, replicates=3)
    assert resumed.set_search_properties("val/CIDEr", "max")
    resumed.set_state(state)
    for t in trials:
        t.set_status(Trial.PENDING)  # Tune's resume: unfinished and errored trials pending again
        resumed.on_trial_add(controller, t)
        t.set_status(Trial.RUNNING)
    report(resumed, controller, trials[0], 10.0, epoch=1)
    report(resumed, controller, trials[1], 11.0, epoch=1)
    assert resumed.group_means(1) == {}  # the resumed third seed is still awaited
    report(resumed, controller, trials[2], 12.0, epoch=1)
    assert list(resumed.group_means(1).values()) == [pytest.approx(11.0)]
