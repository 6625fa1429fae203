"""Adaptive replicates when every seed of an arm, or of the baseline, is lost (errored or diverged): the arm has no
comparison, so it is named with that reason and stays open, as an arm left with one seed is (it gets the next
round's seeds, the baseline with it), and at the maximum it ends undecided with the reason; the baseline's loss is
every arm's reason. Before, such an arm vanished from the design (no state, no seeds, no word) and a lost baseline
left the design at "round 1, no look taken" for ever."""
from __future__ import annotations

import math

import numpy as np
import pytest

from dashboards.runs import Study
from dashboards.sequential import Design, simulate, spending_weights
from dashboards.stats import Arm, Difference, Noise, compare_arms, pooled_differences
from launch.adaptive import amend_summary, decide, looks_of, next_round_groups, study_rounds
from tests.test_adaptive_audit77 import ROUNDS, VALUES, smoke, trial

pytestmark = pytest.mark.outside_ray_group

CONFIGS = {"n0": {"fusion": "none"}, "g0": {"fusion": "gate"}, "m0": {"fusion": "max"}}


def record(lost: dict[str, range], how: str = "ERROR", seeds: dict[str, int] | None = None) -> Study:
    """Each arm's seeds below seeds[arm] (default 6); lost: arm -> its seeds that errored ("ERROR") or ended
    without a value ("DIVERGED")."""
    runs = []
    for fusion, values in VALUES.items():
        for s in range((seeds or {}).get(fusion, 6)):
            if s not in lost.get(fusion, ()):
                runs.append(trial(fusion, s, values[s]))
            else:
                runs.append(trial(fusion, s, None, "ERROR") if how == "ERROR" else trial(fusion, s, None))
    return Study("s", runs)


@pytest.mark.parametrize("how", ["ERROR", "DIVERGED"])
def test_an_arm_whose_every_seed_failed_is_named_open_and_gets_the_next_round(how):
    spec = smoke("search.replicates={min: 2, max: 6}")
    rounds = study_rounds(spec, record({"gate": range(2)}, how, seeds={f: 2 for f in VALUES}))
    gate = rounds.arms["gate"]
    assert (gate.state, gate.p, gate.q, gate.seeds) == ("open", None, None, 2)
    assert "all 2 seeds of gate failed (errored or diverged): no comparison" in gate.reason
    assert "gets the next round's seeds" in gate.reason
    assert not rounds.done and rounds.round == 2
    assert any("all 2 seeds of gate failed" in line for line in rounds.lines())
    assert sorted(next_round_groups(spec, rounds, CONFIGS)) == ["g0", "n0"]  # max settled futile at round 1


def test_a_retried_arm_takes_the_next_look_on_its_new_seeds():
    spec = smoke("search.replicates={min: 2, max: 6}")
    study = record({"gate": range(2)}, seeds={"none": 4, "gate": 4, "max": 2})
    looks, baseline = looks_of(study, ROUNDS)
    assert baseline == "none" and [sorted(look) for look in looks] == [["gate", "max"], ["gate"]]
    assert (looks[1]["gate"].seeds_a, looks[1]["gate"].seeds_b) == (2, 4) and looks[1]["gate"].p is not None
    gate = study_rounds(spec, study).arms["gate"]
    assert "with a value: 2 of gate's and 4 of none's 4 seeds, the rest errored or diverged" in gate.reason


def test_an_arm_lost_at_the_maximum_ends_undecided_with_its_reason():
    spec = smoke("search.replicates={min: 2, max: 6}")
    rounds = study_rounds(spec, record({"gate": range(6)}))
    gate = rounds.arms["gate"]
    assert rounds.done and rounds.round == 3 and gate.state == "open" and gate.seeds == 6
    assert gate.reason == "gate: undecided at the maximum, 6 seeds: all 6 seeds of gate failed (errored or " \
                          "diverged): no comparison"
    summary = amend_summary(spec, Study("s", []), {"trials": [], "trials_finished": 0}, rounds)
    assert summary["adaptive"]["arms"]["gate"]["reason"] == gate.reason
    assert f"  {gate.reason}" in summary["adaptive"]["lines"]


@pytest.mark.parametrize("seeds, done", [(2, False), (6, True)])
def test_a_baseline_whose_every_seed_failed_is_every_arms_reason(seeds, done):
    spec = smoke("search.replicates={min: 2, max: 6}")
    rounds = study_rounds(spec, record({"none": range(seeds)}, seeds={f: seeds for f in VALUES}))
    assert rounds.baseline == "none" and sorted(rounds.arms) == ["gate", "max"] and rounds.done is done
    for arm in rounds.arms.values():
        assert arm.state == "open" and arm.p is None
        assert f"all {seeds} seeds of the baseline none failed (errored or diverged): no comparison" in arm.reason
    if not done:
        assert rounds.round == 2 and sorted(next_round_groups(spec, rounds, CONFIGS)) == ["g0", "m0", "n0"]
    else:
        assert rounds.round == 3 and all("undecided at the maximum" in a.reason for a in rounds.arms.values())


def driver_run_with_losses(design: Design, deltas: list[float], loss: float, studies: int, seed: int) -> dict:
    """tests/test_adaptive_audit77.py's `driver_run` with each seed lost at chance `loss`: each look through
    `compare_arms`, `pooled_differences` and `decide` on the seeds with a value of the arms handed the round."""
    rng = np.random.default_rng(seed)
    names = ["none", *(f"a{i}" for i in range(len(deltas)))]
    truth = np.r_[0.0, deltas]
    power, cost = np.zeros(len(deltas)), np.zeros(len(names))
    for _ in range(studies):
        x = rng.normal(0, 1.0, (len(names), design.rounds[-1])) + truth[:, None] + 100
        kept = rng.uniform(size=x.shape) >= loss
        ran, looks, states = np.zeros(len(names), int), [], {}
        for n in design.rounds:
            open_ = [a for a in names[1:] if a not in states or states[a].state == "open"]
            if not open_:
                break
            ran = np.where([a == "none" or a in open_ for a in names], n, ran)
            arms = [Arm(a, [{"v": float(v)} for v, k in zip(x[i, :ran[i]], kept[i, :ran[i]]) if k])
                    for i, a in enumerate(names)]
            differences = pooled_differences(compare_arms(arms, baseline="none", metric="v"))
            # an open arm with no comparison (its or the baseline's seeds all lost) takes the look without one
            looks.append({a: differences.get(a) or Difference(a, "none", math.nan, None, None, 0, 0, None)
                          for a in open_})
            states = decide(looks, design)
        cost += ran
        for i, a in enumerate(names[1:]):
            if a in states and states[a].state == "resolved":
                power[i] += np.sign(looks[states[a].look][a].delta) == np.sign(deltas[i]) != 0
    return {"power": power / studies, "seeds": cost / studies}


def test_simulate_prices_an_expected_seed_loss():
    design = Design((2, 4, 5), spending_weights((2, 4, 5)), futility_gap=1.5)
    deltas = [0.0, 3.0]
    base = simulate(design, Noise(1.0), deltas, studies=4_000, rng_seed=2)
    assert simulate(design, Noise(1.0), deltas, studies=4_000, rng_seed=2, seed_loss=0.0) == base  # the default
    lossy = simulate(design, Noise(1.0), deltas, studies=4_000, rng_seed=2, seed_loss=0.3)
    assert lossy["power"][1] < base["power"][1] - 0.05  # fewer seeds with a value: less power
    assert lossy["family_wise"] <= 0.05 + 0.01
    everything = simulate(design, Noise(1.0), deltas, studies=500, rng_seed=2, seed_loss=1.0)
    assert everything["power"][1] == 0.0 and everything["family_wise"] == 0.0
    assert everything["seeds"] == [5.0, 5.0, 5.0]  # nothing ever resolves: every round is run
    with pytest.raises(ValueError, match="seed_loss"):
        simulate(design, Noise(1.0), deltas, studies=10, seed_loss=1.5)


def test_simulate_with_seed_loss_models_the_driver_losing_seeds():
    design = Design((2, 4, 5), spending_weights((2, 4, 5)), futility_gap=1.5)
    deltas = [0.0, 1.5, 3.0]
    driver = driver_run_with_losses(design, deltas, 0.25, 600, 1)
    sim = simulate(design, Noise(1.0), deltas, studies=20_000, rng_seed=2, seed_loss=0.25)
    assert driver["power"][1:] == pytest.approx(sim["power"][1:], abs=0.06)  # 3 sd of 600 studies
    assert driver["seeds"] == pytest.approx(sim["seeds"], abs=0.15)
