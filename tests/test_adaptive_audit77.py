"""Audit of adaptive replicates (launch/adaptive.py, dashboards/sequential.py): an arm whose seed errored or
diverged is judged on its seeds with a value at every later look, the looks' p-values with unequal seeds are the
pooled Student's t (scipy), the error spent over the looks adds up to alpha, and `simulate` models the rule the
driver applies (a brute-force run of `decide` on drawn studies, fixed seeds)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from dashboards.runs import CIDER, Study, Trial
from dashboards.sequential import Design, sequential_p, simulate, spending_weights
from dashboards.stats import Arm, Noise, compare_arms, pooled_differences, seed_difference
from launch.adaptive import decide, looks_of, next_round_groups, study_rounds
from launch.spec import load_study

pytestmark = pytest.mark.outside_ray_group

SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"
ROUNDS = (2, 4, 6)
VALUES = {"none": [100.0, 101.0, 99.4, 100.3, 99.8, 100.6],
          "gate": [101.2, 102.5, 101.0, 130.0, 102.1, 101.6],  # seed 3 errors (its 130 never reported)
          "max": [100.4, 99.1, 100.9, 100.2, 99.5, 80.0]}  # seed 5 diverges: ended without a value


def trial(fusion: str, seed: int, value: float | None, state: str = "TERMINATED") -> Trial:
    ok = value is not None
    return Trial(f"{fusion}{seed}", state=state, status="FINISHED" if ok else "FAILED",
                 sampled={"fusion": fusion, "seed": seed},
                 config={"model": {"fusion": fusion}, "train": {"seed": seed}},
                 config_hash=fusion, final={CIDER: value} if ok else {}, best_value=value, best_step=1 if ok else None,
                 history={CIDER: [(1, value)]} if ok else {})


def study(lost: dict[str, tuple[int, str]], seeds: int = 6) -> Study:
    """Every arm's seeds below `seeds`; lost: arm -> (its seed, "ERROR" or "DIVERGED" (ended, no value) or a state
    of a trial still under way)."""
    runs = []
    for fusion, values in VALUES.items():
        for s in range(seeds):
            seed, how = lost.get(fusion, (None, None))
            if s != seed:
                runs.append(trial(fusion, s, values[s]))
            elif how == "DIVERGED":
                runs.append(trial(fusion, s, None))
            else:
                runs.append(trial(fusion, s, None if how == "ERROR" else values[s], how))
    return Study("s", runs)


def pooled_p(arm: str, n: int, kept: dict[str, list[int]]) -> tuple[float, float, float]:
    """(delta, p, d.f.) of `arm` against none on seeds below n with a value (kept: arm -> its seeds with one), the
    seed variance pooled over every arm (scipy's t)."""
    x = {a: np.asarray([VALUES[a][s] for s in kept[a] if s < n]) for a in VALUES}
    dof = sum(len(v) - 1 for v in x.values())
    s2 = sum(((v - v.mean()) ** 2).sum() for v in x.values()) / dof
    delta = x[arm].mean() - x["none"].mean()
    se = np.sqrt(s2 * (1 / len(x[arm]) + 1 / len(x["none"])))
    return delta, 2 * sps.t.sf(abs(delta) / se, dof), dof


def test_an_arm_with_an_errored_or_diverged_seed_takes_every_later_look_on_its_seeds_with_a_value():
    record = study({"gate": (3, "ERROR"), "max": (5, "DIVERGED")})
    looks, baseline = looks_of(record, ROUNDS)
    assert baseline == "none" and [sorted(look) for look in looks] == [["gate", "max"]] * 3
    kept = {"none": list(range(6)), "gate": [0, 1, 2, 4, 5], "max": [0, 1, 2, 3, 4]}
    for r, n in enumerate(ROUNDS):
        for arm in ("gate", "max"):
            d = looks[r][arm]
            delta, p, dof = pooled_p(arm, n, kept)
            assert (d.seeds_a, d.seeds_b) == (sum(s < n for s in kept[arm]), n)
            assert (d.delta, d.p, d.df) == pytest.approx((delta, p, dof))
    assert (looks[1]["gate"].seeds_a, looks[1]["gate"].df) == (3, 8)  # 3 + 2 + 3 d.f.
    # the design's decision over those looks, by hand: q = min_r p_r / w_r, Holm over the two arms
    design = Design(ROUNDS, spending_weights(ROUNDS))
    assert design.weights == pytest.approx((2 / 6, 2 / 6, 2 / 6))
    states = decide(looks, design)
    q = {arm: min(1.0, min(pooled_p(arm, n, kept)[1] / w for n, w in zip(ROUNDS, design.weights)))
         for arm in ("gate", "max")}
    lo, hi = sorted(q, key=q.get)
    holm = {lo: min(1.0, 2 * q[lo]), hi: max(min(1.0, 2 * q[lo]), q[hi])}
    first = {arm: next((r for r, n in enumerate(ROUNDS)
                        if holm_at(arm, r, kept, design) < 0.05), None) for arm in ("gate", "max")}
    for arm in ("gate", "max"):
        s = states[arm]
        if first[arm] is None:
            assert s.state == "open" and s.q == pytest.approx(q[arm]) and s.q_adjusted == pytest.approx(holm[arm])
            assert "no difference resolved at the maximum, 6 seeds" in s.reason
        else:
            assert s.state == "resolved" and s.look == first[arm]
    assert first["gate"] == 2  # resolved at the last look, on 5 of its 6 seeds
    assert "settled at round 3 (6 seeds): resolved, beats none" in states["gate"].reason
    assert "with a value: 5 of gate's and 6 of none's 6 seeds, the rest errored or diverged" in states["gate"].reason
    assert states["max"].look is None and states["max"].seeds == 6
    assert "with a value: 5 of max's and 6 of none's 6 seeds" in states["max"].reason


def holm_at(arm: str, r: int, kept: dict[str, list[int]], design: Design) -> float:
    """`arm`'s Holm-adjusted sequential p after look r, both arms open throughout (by hand)."""
    q = {a: min(1.0, min(pooled_p(a, n, kept)[1] / w for n, w in zip(ROUNDS[:r + 1], design.weights)))
         for a in ("gate", "max")}
    other = next(a for a in q if a != arm)
    return min(1.0, 2 * q[arm]) if q[arm] <= q[other] else max(min(1.0, 2 * q[other]), q[arm])


def smoke(*overrides: str):
    return load_study(SMOKE, ["search.space.fusion.grid=[none,gate,max]", "search.scheduler={fifo: {}}",
                              *overrides], check_files=False)


def test_a_baseline_seed_that_errored_does_not_keep_the_design_open_past_its_maximum():
    spec = smoke("search.replicates={min: 2, max: 6}")
    assert spec.replicate_rounds == ROUNDS
    rounds = study_rounds(spec, study({"none": (4, "ERROR")}))
    assert rounds.done and rounds.round == 3  # every look taken: the design has ended at its maximum
    for arm in rounds.arms.values():
        assert arm.state != "open" or "no difference resolved at the maximum" in arm.reason


def test_an_arm_left_with_one_seed_at_the_first_look_is_open_and_gets_the_next_round():
    spec = smoke("search.replicates={min: 2, max: 6}")
    rounds = study_rounds(spec, study({"gate": (1, "ERROR")}, seeds=2))
    gate = rounds.arms["gate"]
    assert gate.state == "open" and gate.p is None and not rounds.done and rounds.round == 2
    assert "1 seed of gate measures no seed noise" in gate.reason
    configs = {"n0": {"fusion": "none"}, "g0": {"fusion": "gate"}, "m0": {"fusion": "max"}}
    chosen = next_round_groups(spec, rounds, configs)
    assert "g0" in chosen and "n0" in chosen


@pytest.mark.parametrize("state", ["RUNNING", "PENDING"])
def test_a_seed_still_under_way_holds_its_arms_look_back(state):
    looks, _ = looks_of(study({"gate": (3, state)}), ROUNDS)
    assert [sorted(look) for look in looks] == [["gate", "max"], ["max"], ["max"]]
    runs = [t for t in study({}).runs if not (t.sampled["fusion"] == "gate" and t.sampled["seed"] == 3)]
    looks, _ = looks_of(Study("s", runs), ROUNDS)  # not started: absent from the record, still missing
    assert [sorted(look) for look in looks] == [["gate", "max"], ["max"], ["max"]]
    looks, _ = looks_of(study({"none": (2, state)}), ROUNDS)  # the baseline's: no arm takes the look
    assert [sorted(look) for look in looks] == [["gate", "max"]]


def test_the_error_spent_over_the_looks_adds_up_to_alpha_when_max_is_no_multiple_and_a_look_is_skipped():
    w = spending_weights((3, 5, 7, 8))
    assert w == pytest.approx((3 / 8, 2 / 8, 2 / 8, 1 / 8)) and sum(w) == pytest.approx(1.0)
    design = Design((3, 5, 7, 8), w)
    a = [seed_difference([1.0, 2.0, 3.5], [0.0, 0.4, 0.2], ("a", "none")),
         None, seed_difference([1.0, 2.0, 3.5, 2.2, 1.9, 2.4, 2.8], [0.0, 0.4, 0.2, 0.1, 0.5, 0.3, 0.3], ("a", "none"))]
    b = seed_difference([0.1, 0.6, 0.3], [0.0, 0.4, 0.2], ("b", "none"))
    looks = [{"a": a[0], "b": b}, {}, {"a": a[2]}]  # a skips look 2; b takes only the first
    states = decide(looks, design)
    qa = min(1.0, a[0].p / w[0], a[2].p / w[2])
    qb = min(1.0, b.p / w[0])
    assert states["a"].q == pytest.approx(qa) and states["b"].q == pytest.approx(qb)
    assert float(sequential_p(np.array([a[0].p, np.nan, a[2].p, np.nan]), w)) == pytest.approx(qa)
    # the union bound: P(q <= x) <= sum_r P(p_r <= x w_r) = x for independent uniform p's at every look
    rng = np.random.default_rng(3)
    p = rng.uniform(size=(200_000, 4))
    assert np.mean(sequential_p(p, w) <= 0.05) == pytest.approx(sum(0.05 * x for x in w), abs=0.002)


def driver_run(design: Design, sd: float, deltas: list[float], studies: int, seed: int) -> dict:
    """Studies run as the driver runs them: each look through `compare_arms`, `pooled_differences` and `decide`
    (the arms open after the last look get the next round's seeds, the baseline while any is open)."""
    rng = np.random.default_rng(seed)
    names = ["none", *(f"a{i}" for i in range(len(deltas)))]
    truth = np.r_[0.0, deltas]
    power, wrong, cost = np.zeros(len(deltas)), 0, np.zeros(len(names))
    for _ in range(studies):
        x = rng.normal(0, sd, (len(names), design.rounds[-1])) + truth[:, None] + 100
        ran, looks, states = np.zeros(len(names), int), [], {}
        for n in design.rounds:
            open_ = [a for a in names[1:] if a not in states or states[a].state == "open"]
            if not open_:
                break
            ran = np.where([a == "none" or a in open_ for a in names], n, ran)
            arms = [Arm(a, [{"v": float(v)} for v in x[i, :ran[i]]]) for i, a in enumerate(names)]
            differences = pooled_differences(compare_arms(arms, baseline="none", metric="v"))
            looks.append({a: d for a, d in differences.items() if d.seeds_a == n})
            states = decide(looks, design)
        cost += ran
        for i, a in enumerate(names[1:]):
            if states[a].state == "resolved":
                right = np.sign(looks[states[a].look][a].delta) == np.sign(deltas[i]) != 0
                power[i] += right
                wrong += not right
    return {"power": power / studies, "seeds": cost / studies}


def test_simulate_models_the_rule_the_driver_applies():
    design = Design((2, 4, 5), spending_weights((2, 4, 5)), futility_gap=1.5)
    deltas = [0.0, 1.5, 3.0]
    driver = driver_run(design, 1.0, deltas, 1_000, 1)
    sim = simulate(design, Noise(1.0), deltas, studies=40_000, rng_seed=2)
    # measured once at 18,000 driver studies: power 0.308 / 0.897, seeds 4.76 / 4.01 / 4.54 / 3.81
    assert sim["power"][1:] == pytest.approx([0.303, 0.894], abs=0.01)
    assert driver["power"][1:] == pytest.approx(sim["power"][1:], abs=0.045)  # 3 sd of 1,000 studies
    assert driver["seeds"] == pytest.approx(sim["seeds"], abs=0.12)


def test_the_drivers_round_decision_reads_an_errored_seed_as_missing_not_its_partial_curve(tmp_path, capsys):
    """The searcher hands `RoundDecider.next_round` the trials of the round that ended; it read every one as
    TERMINATED, so an errored seed's partial curve (its best epoch before the error) was a seed of the driver's
    decision while `a2 study status` read the trial as ERROR and left it out. The searcher now names the failed."""
    from launch.adaptive import RoundDecider
    from tests.studyfolder import fabricated_study

    fab = fabricated_study(tmp_path, "rounds", epochs=2,
                           overrides=("search.replicates={min: 2, max: 4}", "search.space.lambda={grid: [0.035], when: {fusion: gate}}"))
    configs, trials = {}, {}
    for fusion, values in (("none", (100.0, 101.0)), ("gate", (101.5, 160.0))):  # gate seed 1 errors at epoch 1
        for seed, value in enumerate(values):
            sampled = {"fusion": fusion, "seed": seed, **({"lambda": 0.035} if fusion == "gate" else {})}
            results = [{"epoch": 1, "val/CIDEr": value}] + ([{"epoch": 2, "val/CIDEr": value}] if value < 150 else [])
            tid = f"{fusion}{seed}"
            fab.add(tid, sampled, results)
            trials[tid] = sampled
            configs.setdefault(f"{fusion}0", sampled)
    decider = RoundDecider(fab.spec, fab.location)
    decider.next_round(0, configs, trials, failed={"gate1"})
    text = capsys.readouterr().out
    assert "with a value: 1 of gate's and 2 of none's 2 seeds, the rest errored or diverged" in text, text
