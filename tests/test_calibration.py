"""Calibration of the verdict rule (`dashboards.stats.difference_intervals`, the rule `compare_arms` prints) by
simulated studies: at 1, 2, 3, 5 and 10 seeds per arm, with seed noise, image noise and both, a true difference of
0 is called resolved at most 5% of the time (within Monte Carlo error), and a true difference is covered at least
94% of the time; `power` / `seeds_needed` (what `a2 study plan` prints) match a Monte Carlo of the rule.

A simulated study: two arms scored on the same IMAGES images (a shared difficulty, which pairing removes), each run
score[arm, seed, image] = difficulty[image] + delta[arm] + image[arm, image] + seed[arm, seed] + run[arm, seed, image]
- seed noise: `seed` (a run's shift on every image) and `run` (its own per-image noise), as seeds on the synthetic
  set spread (sd 11 CIDEr in the issue that asked for this);
- image noise: `image`, each arm's own strengths on these images (the same for every seed), so that the images in
  hand are a sample and the true difference is the mean over all images, not over these;
- both.
The README's "Intervals" quotes the figures measured here (`python -m tests.test_calibration` prints them).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from dashboards.stats import Arm, compare_arms, difference_intervals, power, seeds_needed

IMAGES = 100
STUDIES = 2000  # per cell: the Monte Carlo standard error of a 5% rate is 0.5%
RESAMPLES = 499  # bootstrap resamples per simulated study (the rule's default is 4999)
SEEDS_PER_ARM = (1, 2, 3, 5, 10)
NOISE = {  # (seed sd, image sd, run sd) in CIDEr
    "seed noise": (11.0, 0.0, 15.0),
    "image noise": (0.0, 15.0, 1.0),
    "both": (6.0, 10.0, 15.0),
}
TRUE_DIFFERENCE = 5.0
# a rate is "at most 5% within Monte Carlo error": below 5% + 2.33 standard errors (one-sided, 99%)
FALSE_VERDICT_BOUND = 0.05 + 2.33 * math.sqrt(0.05 * 0.95 / STUDIES)


def simulate(rng: np.random.Generator, studies: int, seeds: int, delta: float, noise: tuple[float, float, float],
             images: int = IMAGES) -> tuple[np.ndarray, np.ndarray]:
    """Arms A (truly `delta` better) and B: (studies, seeds, images) per-image scores each."""
    seed_sd, image_sd, run_sd = noise
    difficulty = rng.gamma(2.0, 50.0, (studies, 1, images))
    arms = [difficulty + shift
            + rng.normal(0, image_sd, (studies, 1, images))
            + rng.normal(0, seed_sd, (studies, seeds, 1))
            + rng.normal(0, run_sd, (studies, seeds, images)) for shift in (delta, 0.0)]
    return arms[0], arms[1]


def rates(seeds: int, noise: str, delta: float, rng_seed: int) -> dict[str, float]:
    """Of STUDIES simulated studies: the share with an interval, resolved, and covering the true difference."""
    a, b = simulate(np.random.default_rng(rng_seed), STUDIES, seeds, delta, NOISE[noise])
    out = difference_intervals(a, b, n_resamples=RESAMPLES, seed=rng_seed)
    has = ~np.isnan(out["low"])
    resolved = has & ((out["low"] > 0) | (out["high"] < 0))
    covered = has & (out["low"] <= delta) & (delta <= out["high"])
    return {"interval": float(has.mean()), "resolved": float(resolved.mean()),
            "coverage": float(covered.sum() / has.sum()) if has.any() else math.nan}


@pytest.mark.parametrize("noise", list(NOISE))
@pytest.mark.parametrize("seeds", SEEDS_PER_ARM)
def test_a_true_difference_of_zero_is_rarely_resolved(seeds, noise):
    r = rates(seeds, noise, 0.0, rng_seed=100 + seeds)
    if seeds == 1:  # one seed per arm measures no seed noise: never an interval, never a verdict
        assert r["interval"] == 0.0 and r["resolved"] == 0.0
    else:
        assert r["interval"] == 1.0
        assert r["resolved"] <= FALSE_VERDICT_BOUND, r


@pytest.mark.parametrize("noise", list(NOISE))
@pytest.mark.parametrize("seeds", SEEDS_PER_ARM[1:])
def test_a_true_difference_is_covered(seeds, noise):
    r = rates(seeds, noise, TRUE_DIFFERENCE, rng_seed=200 + seeds)
    assert r["coverage"] >= 0.94, r


def test_compare_arms_prints_the_calibrated_rule():
    """The rule calibrated above is what `compare_arms` applies, study by study (same bootstrap draws)."""
    a, b = simulate(np.random.default_rng(7), 3, 3, 2.0, NOISE["both"], images=30)
    batch = difference_intervals(a, b, n_resamples=RESAMPLES, seed=0)
    ids = [f"img{i}" for i in range(30)]
    for k in range(3):
        arms = [Arm(name, [{"val/CIDEr": v} for v in x[k].mean(axis=1)], x[k], ids) for name, x in (("a", a), ("b", b))]
        diff = compare_arms(arms, baseline="b").differences["a"]
        single = difference_intervals(a[k:k + 1], b[k:k + 1], n_resamples=4999, seed=0)
        assert (diff.delta, diff.low, diff.high) == pytest.approx(
            (single["delta"][0], single["low"][0], single["high"][0]), abs=1e-9)
        assert batch["delta"][k] == pytest.approx(diff.delta)


def monte_carlo_power(n: int, delta: float, sd: float, studies: int = 20_000, rng_seed: int = 0) -> float:
    """The share of simulated studies (seed means only, normal with sd `sd`) in which the rule says A beats B."""
    rng = np.random.default_rng(rng_seed)
    a, b = rng.normal(delta, sd, (studies, n)), rng.normal(0.0, sd, (studies, n))
    out = difference_intervals(a, b)
    return float(np.nan_to_num(out["low"] > 0).mean())


@pytest.mark.parametrize("delta, sd", [(5.0, 1.5), (2.8, 1.5), (1.0, 1.0)])
def test_plan_seeds_match_a_monte_carlo_of_the_rule(delta, sd):
    """`a2 study plan`'s seeds per arm (`seeds_needed`, which launch/plan.py prints) is the smallest n whose
    simulated power reaches 80%, within one seed."""
    import launch.plan

    assert launch.plan.seeds_needed is seeds_needed and launch.plan.POWER == 0.8
    n = seeds_needed(delta, sd)
    simulated = {k: monte_carlo_power(k, delta, sd, rng_seed=k) for k in range(max(2, n - 2), n + 3)}
    n_mc = min(k for k, p in simulated.items() if p >= 0.8)
    assert abs(n_mc - n) <= 1, (n, simulated)
    for k, p in simulated.items():  # and the formula is the simulated power (MC standard error <= 0.0035)
        assert power(k, delta, sd) == pytest.approx(p, abs=0.012), (k, p)


def main() -> None:
    """Print the figures the README's "Intervals" quotes."""
    print(f"{STUDIES} simulated studies per cell, {IMAGES} images, {RESAMPLES} bootstrap resamples")
    for noise in NOISE:
        for seeds in SEEDS_PER_ARM:
            null, alt = rates(seeds, noise, 0.0, 100 + seeds), rates(seeds, noise, TRUE_DIFFERENCE, 200 + seeds)
            print(f"{noise:12s} {seeds:2d} seeds/arm: resolved at a true 0: {100 * null['resolved']:.1f}%, "
                  f"coverage of a true {TRUE_DIFFERENCE:g}: "
                  + ("no interval" if math.isnan(alt["coverage"]) else f"{100 * alt['coverage']:.1f}%"))


if __name__ == "__main__":
    main()
