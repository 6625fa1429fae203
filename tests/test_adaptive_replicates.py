"""Adaptive replicates run by the driver (launch/adaptive.py, `search.replicates: {min, max, rounds}`): the range in
the study file, the round decision from per-seed scores, the searcher handing out a later round's seeds to open arms
only, and (slow) a rehearsal through Ray whose second round Tune runs for the open arms only."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from a2core.errors import ConfigError
from dashboards.sequential import Design, spending_weights
from dashboards.stats import seed_difference
from launch import plan
from launch.adaptive import decide
from launch.search import GridCrossedSearcher, Searcher
from launch.spec import load_study

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "studies" / "smoke.yaml"
THREE_ARMS = ("search.space.fusion.grid=[none,gate,max]", "search.scheduler={fifo: {}}")


def smoke(*overrides: str):
    return load_study(SMOKE, list(overrides), check_files=False)


def test_a_replicate_range_counts_its_maximum_and_fills_in_its_rounds():
    spec = smoke("search.replicates={min: 3, max: 9}")
    assert spec.replicate_rounds == (3, 5, 7, 9) and spec.replicate_seeds == list(range(9))
    assert spec.num_trials == 2 * 9  # the fixed parts (caps, the plan) count the maximum
    assert spec.to_dict()["search"]["replicates"] == {"min": 3, "max": 9, "rounds": [3, 5, 7, 9]}
    assert smoke("search.replicates={min: 2, max: 5}").replicate_rounds == (2, 4, 5)
    given = smoke("search.replicates={min: 2, max: 6, rounds: [2, 3, 6]}")
    assert given.replicate_rounds == (2, 3, 6)
    assert smoke("search.replicates=4").replicate_rounds is None
    design = plan.study_design(smoke(*THREE_ARMS, "search.replicates={min: 2, max: 4}"))
    assert design.rounds == (2, 4) and design.weights == pytest.approx((0.5, 0.5))
    assert design.futility_gap == 2.8  # the smallest Table 3 gap of the study's fusions (max 2.8, gate 5.0)


@pytest.mark.parametrize("value, message", [
    ("{min: 1, max: 4}", "search.replicates.min: must be >= 2"),
    ("{min: 3, max: 3}", "search.replicates.max: must be more than min (3), got 3"),
    ("{min: 2, max: 6, rounds: [2, 5, 4, 6]}", "search.replicates.rounds: must increase from min (2) to max (6)"),
    ("{min: 2, max: 6, rounds: [3, 6]}", "search.replicates.rounds: must increase from min (2) to max (6)"),
    ("{min: 2}", "search.replicates.max: is required"),
    ("{min: 2, max: 4, step: 1}", "search.replicates.step: unknown key"),
    ("{min: 3, max: 9, rounds: []}", "search.replicates.rounds: must increase from min (3) to max (9), got []"),
    ("{min: 2, max: 6, rounds: [2, x, 6]}", "search.replicates.rounds[1]: must be an integer, got 'x'"),
    # a list of seeds: the key is the list's index, not pydantic's name of the union member that failed
    ("[0, 1.5]", "search.replicates[1]: must be an integer, got 1.5"),
    ("[0, -1]", "search.replicates[1]: must be >= 0, got -1"),
])
def test_a_wrong_replicate_range_is_one_line_naming_its_key(value, message):
    with pytest.raises(ConfigError) as err:
        smoke(f"search.replicates={value}")
    assert message in str(err.value) and "\n" not in str(err.value)


BASELINE = [100.0, 100.5, 99.5, 100.2]
SCORES = {"gate": [130.0, 130.4, 129.8, 130.1],  # clearly better: resolved at the first look
          "max": [101.0, 99.0, 100.8, 99.4],  # as good as the baseline, too noisy to say: stays open
          "exp_decay": [100.1, 100.3, 100.2, 100.2]}  # no gap of the plan's size left: futile


def looks(rounds, arms=SCORES):
    return [{arm: seed_difference(values[:n], BASELINE[:n], (arm, "none")) for arm, values in arms.items()}
            for n in rounds]


def test_the_round_decision_settles_a_clear_arm_and_a_hopeless_one_and_keeps_a_null_one_open():
    design = Design((2, 4), spending_weights((2, 4)), futility_gap=2.8)
    first = decide(looks((2,)), design)
    assert {arm: s.state for arm, s in first.items()} == {"gate": "resolved", "max": "open", "exp_decay": "futile"}
    gate = first["gate"]
    assert gate.look == 0 and gate.seeds == 2
    assert gate.q == pytest.approx(min(1.0, gate.p / 0.5))  # the sequential p: p over the look's share of the error
    assert gate.q_adjusted == pytest.approx(3 * gate.q)  # Holm's first step over the three arms
    assert "settled at round 1 (2 seeds): resolved, beats none by 29.9" in gate.reason
    assert "futile" in first["exp_decay"].reason and "below the plan's gap 2.8" in first["exp_decay"].reason
    assert "open after round 1 (2 seeds" in first["max"].reason
    # the second look: only the open arm takes it (settled arms get no more seeds); its verdict stays open at the max
    second = [looks((2,))[0], {"max": looks((4,))[0]["max"]}]
    final = decide(second, design)
    assert final["gate"].state == "resolved" and final["exp_decay"].state == "futile"
    assert final["max"].state == "open" and final["max"].seeds == 4
    assert "no difference resolved at the maximum, 4 seeds" in final["max"].reason
    # without futility the hopeless arm stays open
    assert decide(looks((2,)), Design((2, 4), (0.5, 0.5)))["exp_decay"].state == "open"


def test_a_looks_comparisons_take_the_seed_variance_pooled_over_every_arm():
    """`pooled_differences` (the design's rule at a look, `Design.pool_arms`): each arm against the baseline with the
    seed variance pooled over all the arms' seeds, settled arms' fewer seeds included (sum of n_i - 1 d.f.),
    Student's t with those d.f.; an arm whose seeds all scored the same is no part of the pool. `compare`'s own
    differences (each pair's variance) are left as they were."""
    import numpy as np
    from scipy import stats as sps

    from dashboards.stats import Arm, compare_arms
    from launch.adaptive import pooled_differences

    values = {"none": BASELINE[:3], "gate": SCORES["gate"][:2], "max": SCORES["max"][:3],
              "exp_decay": [100.2] * 3}  # gate settled after 2 seeds; exp_decay's seed changes nothing
    arms = [Arm(label, [{"val/CIDEr": v} for v in vs]) for label, vs in values.items()]
    comparison = compare_arms(arms, baseline="none")
    pooled = pooled_differences(comparison)
    pool = [np.asarray(values[a]) for a in ("none", "gate", "max")]
    dof = sum(len(x) - 1 for x in pool)
    assert dof == 5
    s2 = sum(((x - x.mean()) ** 2).sum() for x in pool) / dof
    d = pooled["max"]
    se = np.sqrt(s2 * (1 / 3 + 1 / 3))
    assert (d.df, d.se) == pytest.approx((dof, se))
    assert d.p == pytest.approx(2 * sps.t.sf(abs(d.delta) / se, dof))
    assert d.high - d.delta == pytest.approx(sps.t.ppf(0.975, dof) * se)
    assert pooled["gate"].df == pytest.approx(dof) and pooled["gate"].seeds_a == 2
    assert pooled["exp_decay"].low is None  # no seed noise in the arm: still no verdict
    # compare's verdicts keep each pair's own variance (the fixed design's rule)
    alone = seed_difference(values["max"], values["none"], ("max", "none"))
    assert comparison.differences["max"].p == pytest.approx(alone.p) and alone.df != pytest.approx(dof)


class OpenArms:
    """A stand-in for `launch.adaptive.RoundDecider`: the groups of the named fusions get the next round."""

    def __init__(self, spec, arms):
        self.spec, self.arms, self.calls = spec, arms, []

    def next_round(self, finished, configs, trials, failed=frozenset()):
        self.calls.append((finished, len(configs), len(trials)))
        return [g for g, c in configs.items() if c["fusion"] in self.arms]


def test_the_searcher_hands_a_later_rounds_seeds_to_open_arms_only_after_the_round_ended():
    spec = smoke(*THREE_ARMS, "search.replicates={min: 2, max: 4}")
    searcher = GridCrossedSearcher(spec)
    decider = OpenArms(spec, {"none", "max"})
    searcher.set_round_decider(decider)
    first = {f"t{i}": searcher.suggest(f"t{i}") for i in range(6)}
    assert sorted((c["fusion"], c["seed"]) for c in first.values()) == sorted(
        (f, s) for f in ("none", "gate", "max") for s in (0, 1))
    assert searcher.suggest("t6") is None  # the round's trials still run: the next round waits
    for i, tid in enumerate(first):
        searcher.on_trial_complete(tid, {"val/CIDEr": 50.0 + i, "epoch": spec.total_epochs})
    second = {f"u{i}": searcher.suggest(f"u{i}") for i in range(4)}
    assert decider.calls == [(0, 3, 6)]
    assert sorted((c["fusion"], c["seed"]) for c in second.values()) == [("max", 2), ("max", 3), ("none", 2),
                                                                          ("none", 3)]
    assert searcher.suggest("u4") is None
    for tid in second:
        searcher.on_trial_complete(tid, {"val/CIDEr": 60.0, "epoch": spec.total_epochs})
    assert searcher.suggest("u5") == Searcher.FINISHED  # the last round ended
    assert len(decider.calls) == 1
    # its state round-trips (a resumed study continues in the round it was in)
    again = GridCrossedSearcher(spec)
    again.set_state(searcher.get_state())
    assert again._round == 1 and again.group_of("u0") == searcher.group_of("u0")


def test_fused_seeds_train_each_round_for_the_open_arms_as_one_trial():
    """`resources.fuse_replicates` with adaptive replicates (rounds to 2, 4, 5): a configuration's seeds of a round are
    one trial; the open arms get the next round's seeds as one more trial each; a round of one seed is a trial of
    that seed alone (`launch.trainable.a2_fused_trial` trains it unfused)."""
    spec = smoke(*THREE_ARMS, "search.replicates={min: 2, max: 5, rounds: [2, 4, 5]}", "resources.fuse_replicates=true")
    searcher = GridCrossedSearcher(spec)
    decider = OpenArms(spec, {"none", "max"})
    searcher.set_round_decider(decider)
    first = {f"t{i}": searcher.suggest(f"t{i}") for i in range(3)}
    assert sorted((c["fusion"], tuple(c["seeds"])) for c in first.values()) == [
        ("gate", (0, 1)), ("max", (0, 1)), ("none", (0, 1))]
    assert searcher.suggest("t3") is None
    rounds = [first]
    for later in ("u", "v"):
        for tid in rounds[-1]:
            searcher.on_trial_complete(tid, {"val/CIDEr": 50.0, "epoch": spec.total_epochs})
        rounds.append({f"{later}{i}": searcher.suggest(f"{later}{i}") for i in range(2)})
        assert searcher.suggest(f"{later}2") is None
    assert sorted((c["fusion"], tuple(c["seeds"])) for c in rounds[1].values()) == [("max", (2, 3)), ("none", (2, 3))]
    assert sorted((c["fusion"], c["seed"]) for c in rounds[2].values()) == [("max", 4), ("none", 4)]
    assert not any("seeds" in c for c in rounds[2].values())
    assert decider.calls == [(0, 3, 3), (1, 3, 5)]
    none = next(t for t, c in first.items() if c["fusion"] == "none")
    assert [t[0] for t in searcher.group_of(none)] == ["t", "u", "v"]
    assert spec.tune_samples == 3 * 3  # every configuration in every round, at most


def test_the_searcher_finishes_when_the_decider_leaves_no_arm_open():
    spec = smoke(*THREE_ARMS, "search.replicates={min: 2, max: 6}")
    searcher = GridCrossedSearcher(spec)
    searcher.set_round_decider(OpenArms(spec, set()))
    trials = [f"t{i}" for i in range(6)]
    for tid in trials:
        assert searcher.suggest(tid)["seed"] in (0, 1)
    for tid in trials:
        searcher.on_trial_complete(tid, {"val/CIDEr": 50.0, "epoch": spec.total_epochs})
    assert searcher.suggest("t6") == Searcher.FINISHED


def test_a_searcher_pickled_before_rounds_existed_still_runs_its_study():
    """Tune unpickles the searcher object itself when a study resumes: one saved by the release before adaptive
    replicates has none of their attributes, and reads as a study without rounds (every seed, then FINISHED)."""
    import pickle

    spec = smoke(*THREE_ARMS, "search.replicates=2")
    old = GridCrossedSearcher(spec)
    for name in ("_rounds", "_round", "_queue", "_decider"):
        del old.__dict__[name]  # what an earlier release pickled
    searcher = pickle.loads(pickle.dumps(old))
    trials = [f"t{i}" for i in range(6)]
    configs = [searcher.suggest(t) for t in trials]
    assert sorted((c["fusion"], c["seed"]) for c in configs) == sorted(
        (f, seed) for f in ("none", "gate", "max") for seed in (0, 1))
    for tid in trials:
        searcher.on_trial_complete(tid, {"val/CIDEr": 50.0, "epoch": spec.total_epochs})
    assert searcher.suggest("t6") == Searcher.FINISHED


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rehearsal_runs_the_second_round_for_the_open_arms_only(tmp_path):
    """Three arms, seeds in rounds 2 then 4 (the stand-in trainer, the real driver): gate far above the baseline is
    resolved at round 1; max as good as it stays open, and Tune adds seeds 2 and 3 of max and of the baseline only."""
    from tests.raycluster import a2

    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    storage = tmp_path / "rehearsals"
    run = a2("study", "rehearse", str(SMOKE), *THREE_ARMS, "search.replicates={min: 2, max: 4, rounds: [2, 4]}",
             "train.xe_epochs=2", "--mean", "none=100", "--mean", "gate=160", "--mean", "max=101",
             "--storage", str(storage), "--quiet", cwd=tmp_path, env=env, timeout=400)
    out = run.stdout
    assert run.returncode == 0, out[-5000:]
    name = "a2-smoke-rehearsal"
    folder = storage / name
    summary = json.loads((folder / "summary.json").read_text())
    seeds = sorted((t["fusion"], int(t["seed"])) for t in summary["trials"])
    assert seeds == sorted([("gate", 0), ("gate", 1), *((f, s) for f in ("none", "max") for s in range(4))]), seeds
    assert summary["complete"] is True and summary["num_trials"] == 10
    adaptive = summary["adaptive"]
    assert adaptive["done"] is True and adaptive["round"] == 2
    assert adaptive["arms"]["gate"]["state"] == "resolved" and adaptive["arms"]["gate"]["seeds"] == 2
    assert adaptive["arms"]["max"]["seeds"] == 4
    rounds = json.loads((folder / "rounds.json").read_text())
    assert rounds["round"] == 2 and rounds["arms"]["gate"]["state"] == "resolved"
    gate = next(c for c in summary["verdicts"]["comparisons"] if c["arm"] == "gate")
    assert gate["resolved"] is True and gate["verdict"].startswith("adaptive design: gate: settled at round 1")
    assert "adaptive replicates: ended after round 2 of 2" in out
    status = a2("study", "status", name, "--storage", str(storage), cwd=tmp_path, env=env, timeout=120)
    assert status.returncode == 0, status.stdout[-3000:]
    assert "adaptive replicates: ended after round 2 of 2" in status.stdout
    assert "  gate: settled at round 1 (2 seeds): resolved" in status.stdout
