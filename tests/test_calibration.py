"""Calibration of the verdict rule (`dashboards.stats.difference_intervals`, the rule `compare_arms` prints) by
simulated studies, and of `power` (what `a2 study plan` prints) against the rule's simulated power.

A simulated study: two arms scored on the same images, each run
score[arm, seed, image] = difficulty[image] + delta[arm] + image[arm, image] + seed[arm, seed] + run[arm, seed, image]
- `seed`: a run's shift on every image; `run`: its own per-image noise (which wordings its captions hit);
- `image`: each arm's own strengths on these images (the same for every seed): the images are a sample, and the
  true difference is over all images, not these;
- the shared `difficulty` cancels in every paired statistic.
Cells (`dashboards.stats.Noise`: seed sd, run sd, arm x image sd, images):
- at 100 images, per-image scores through `difference_intervals`: seed noise, image noise, both (1-10 seeds);
- "run noise", the project's own regime (`results/synthetic_fusions.json`: seed shift 0.3, run 50, arm x image
  10), and "interaction", the arm x image term as large as the seed means' (seed shift 1, run 50), at 2-10 seeds
  x 500 / 2,000 / 5,000 images: drawn as the statistics the rule reads (each arm's seed means, the per-image
  differences' variance, each arm's residual), whose distribution under this normal model is exact, and put
  through `components_interval`, the rule's formula (a per-image cell checks the two paths agree);
- "heavy tails": the run-noise regime with a seed shift of 1 and every term Student's t with 4 d.f. (the same
  sds, no finite kurtosis), per-image scores through `difference_intervals` at 500 images (2,000 and 5,000: `-m slow`).
The rule is shift-equivariant (its width does not depend on delta), so one simulation per cell gives the false
verdicts at a true 0 (= 1 - coverage) and the power at any delta. Targets in every cell: false verdicts <= 5%
with the one-sided 99% Monte Carlo bound <= 6%; coverage >= 94%; the plan's power within 5 points of the
simulated power at the gap an exact-variance interval resolves 80% of the time. Mean half-width against the oracle
(1.96 x the true sd of the difference): <= 1.15 where >= 3 seeds and the image terms carry at least half the
variance; where the seed means carry more, no interval that measures the seed noise in its seeds reaches 1.15 at
3-4 seeds, and the rule is held to 1.02 x Welch's on seed means alone (`welch_bound`).
docs/explanation/statistics.md quotes the figures (`python -m tests.test_calibration` prints them).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from dashboards.stats import Arm, Noise, compare_arms, components_interval, difference_intervals, holm, power

STUDIES = 20_000  # per drawn cell: the Monte Carlo standard error of a 5% rate is 0.15%
PER_IMAGE_STUDIES = 10_000  # per per-image cell at 100 images
CHUNK = 1_000  # studies simulated at once (memory)
SEEDS_PER_ARM = (2, 3, 4, 5, 10)
IMAGES = (500, 2000, 5000)
SMALL = {  # at 100 images: (seed sd, run sd, arm x image sd)
    "seed noise": Noise(11.0, 15.0, 0.0, 100),
    "image noise": Noise(0.0, 1.0, 15.0, 100),
    "both": Noise(6.0, 15.0, 10.0, 100),
}


def regime(name: str, seeds: int, images: int) -> Noise:
    if name == "run noise":
        return Noise(0.3, 50.0, 10.0, images)
    if name == "interaction":  # 2 arm_image_sd^2 / images == 2 seed_mean_var / seeds
        return Noise(1.0, 50.0, math.sqrt((images + 2500.0) / seeds), images)
    if name == "heavy tails":
        return Noise(1.0, 50.0, 10.0, images)
    raise KeyError(name)


def bound(rate: float, studies: int) -> float:
    """The one-sided 99% Monte Carlo upper bound of a rate measured in `studies` simulated studies."""
    return rate + 2.33 * math.sqrt(max(rate * (1 - rate), 0.05 * 0.95) / studies)


def welch_bound(seeds: int, grid: int = 400) -> float:
    """Mean half-width / oracle of Welch's interval when the seed means carry all the variance: what an interval
    that measures the seed noise in its n seeds per arm, without assuming the arms' seed noise equal, pays (1.56 at
    3 seeds, 1.28 at 4, 1.18 at 5; even Student's pooled t, assuming it equal, pays 1.33, 1.20, 1.14). Integrated
    over a grid of quantiles of the two arms' sample variances."""
    ratio = sps.chi2.ppf((np.arange(grid) + 0.5) / grid, seeds - 1) / (seeds - 1)
    ca, cb = np.meshgrid(ratio, ratio, indexing="ij")
    df = (seeds - 1) * (ca + cb) ** 2 / (ca ** 2 + cb ** 2)
    return float((sps.t.ppf(0.975, df) * np.sqrt((ca + cb) / 2)).mean() / 1.96)


def _noise(rng: np.random.Generator, shape, sd: float, tails: bool) -> np.ndarray:
    if not tails:
        return rng.normal(0.0, sd, shape)
    return rng.standard_t(4, shape) * sd / math.sqrt(2.0)  # t(4): variance 2, no finite kurtosis


def per_image_arms(rng: np.random.Generator, studies: int, seeds: int, noise: Noise, tails: bool = False):
    """Arms A and B with a true difference of 0: (studies, seeds, images) per-image scores each."""
    shape = (studies, seeds, noise.images)
    difficulty = rng.gamma(2.0, 50.0, (studies, 1, noise.images))
    return [difficulty + _noise(rng, (studies, 1, noise.images), noise.arm_image_sd, tails)
            + _noise(rng, (studies, seeds, 1), noise.seed_sd, tails)
            + _noise(rng, shape, noise.run_sd, tails) for _ in range(2)]


def per_image_cell(seeds: int, noise: Noise, studies: int, rng_seed: int, tails: bool = False):
    """(difference, half-width) of each simulated study, through `difference_intervals` on per-image scores."""
    rng = np.random.default_rng(rng_seed)
    delta, half = [], []
    for start in range(0, studies, CHUNK):
        out = difference_intervals(*per_image_arms(rng, min(CHUNK, studies - start), seeds, noise, tails))
        delta.append(out["delta"])
        half.append((out["high"] - out["low"]) / 2)
    return np.concatenate(delta), np.concatenate(half)


def drawn_cell(seeds: int, noise: Noise, studies: int, rng_seed: int):
    """(difference, half-width) of each simulated study from the statistics the rule reads, drawn from the
    model: each arm's seed means (shift + the mean of its run noise), the image part of the difference, the
    per-image differences' variance and each arm's residual."""
    rng = np.random.default_rng(rng_seed)
    n, m, run = seeds, noise.images, noise.run_sd ** 2
    means = [rng.normal(0, noise.seed_sd, (studies, n)) + rng.normal(0, noise.run_sd / math.sqrt(m), (studies, n))
             for _ in range(2)]
    delta = means[0].mean(axis=1) - means[1].mean(axis=1) + rng.normal(0, math.sqrt(noise.image_var), studies)
    d2 = (2 * noise.arm_image_sd ** 2 + 2 * run / n) * rng.chisquare(m - 1, studies) / (m - 1)
    ra, rb = (run * rng.chisquare((n - 1) * (m - 1), studies) / ((n - 1) * (m - 1)) for _ in range(2))
    half, _, _ = components_interval(*(x.var(axis=1, ddof=1) / n for x in means), n, n, m, d2, ra, rb)
    return delta, half


def cell_rates(delta: np.ndarray, half: np.ndarray, seeds: int, noise: Noise) -> dict[str, float]:
    """False verdicts at a true 0, coverage, mean half-width over the oracle's, and the simulated and planned
    power at the gap an exact-variance interval resolves 80% of the time."""
    sd = noise.sd_of_difference(seeds)
    gap = (sps.norm.ppf(0.975) + sps.norm.ppf(0.8)) * sd
    false = float(np.mean(np.abs(delta) > half))
    return {"false": false, "coverage": 1 - false, "width": float(half.mean() / (1.96 * sd)),
            "power": float(np.mean(delta + gap - half > 0)), "planned": power(seeds, gap, noise)}


def check(r: dict, studies: int, seeds: int, noise: Noise) -> None:
    assert bound(r["false"], studies) <= 0.06 and r["coverage"] >= 0.94, r
    assert abs(r["planned"] - r["power"]) <= 0.05, r
    if seeds >= 3:
        images_share = noise.image_var / noise.sd_of_difference(seeds) ** 2
        target = 1.15 if images_share >= 0.5 else max(1.15, 1.02 * welch_bound(seeds))
        assert r["width"] <= target, (r, target)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.parametrize("seeds", (1, *SEEDS_PER_ARM))
def test_per_image_cells_at_100_images(seeds, name):
    noise = SMALL[name]
    delta, half = per_image_cell(seeds, noise, PER_IMAGE_STUDIES, rng_seed=100 + seeds)
    if seeds == 1:  # one seed per arm measures no seed noise: never an interval, never a verdict
        assert np.isnan(half).all()
        return
    assert not np.isnan(half).any()
    check(cell_rates(delta, half, seeds, noise), PER_IMAGE_STUDIES, seeds, noise)


@pytest.mark.parametrize("images", IMAGES)
@pytest.mark.parametrize("seeds", SEEDS_PER_ARM)
@pytest.mark.parametrize("name", ["run noise", "interaction"])
def test_drawn_cells(name, seeds, images):
    noise = regime(name, seeds, images)
    check(cell_rates(*drawn_cell(seeds, noise, STUDIES, rng_seed=seeds * images), seeds, noise), STUDIES, seeds,
          noise)


HEAVY_STUDIES = 4_000


@pytest.mark.parametrize("images", [500, pytest.param(2000, marks=pytest.mark.slow),
                                    pytest.param(5000, marks=pytest.mark.slow)])
@pytest.mark.slow
@pytest.mark.parametrize("seeds", SEEDS_PER_ARM)
def test_heavy_tails(seeds, images):
    noise = regime("heavy tails", seeds, images)
    delta, half = per_image_cell(seeds, noise, HEAVY_STUDIES, rng_seed=300 + seeds, tails=True)
    check(cell_rates(delta, half, seeds, noise), HEAVY_STUDIES, seeds, noise)


def test_drawn_statistics_are_the_per_image_rule():
    """The drawn cells stand for per-image studies: at 3 seeds x 500 images of the run-noise regime, 4,000
    per-image studies through `difference_intervals` and 20,000 drawn ones agree within Monte Carlo error."""
    noise = regime("run noise", 3, 500)
    drawn = cell_rates(*drawn_cell(3, noise, STUDIES, rng_seed=1), 3, noise)
    full = cell_rates(*per_image_cell(3, noise, 4_000, rng_seed=2), 3, noise)
    assert full["false"] == pytest.approx(drawn["false"], abs=0.01)
    assert full["width"] == pytest.approx(drawn["width"], rel=0.02)
    assert full["power"] == pytest.approx(drawn["power"], abs=0.025)


def test_the_projects_regime_no_longer_double_counts_run_noise():
    """The issue's figures at 5 seeds x 2,000 images (seed shift 0.3, run 50, arm x image 10): the oracle
    half-width is 1.56 and the old rule's was 2.35; the rule now averages within 1.15 x the oracle, and power at
    a true gap of 2.5 is 80% (the old rule: 54%)."""
    noise = regime("run noise", 5, 2000)
    assert 1.96 * noise.sd_of_difference(5) == pytest.approx(1.56, abs=0.01)
    r = cell_rates(*drawn_cell(5, noise, STUDIES, rng_seed=5), 5, noise)
    assert 1.96 * noise.sd_of_difference(5) * r["width"] == pytest.approx(1.75, abs=0.03)
    assert power(5, 2.5, noise) == pytest.approx(0.80, abs=0.02)
    assert power(5, 1.6, noise) == pytest.approx(0.44, abs=0.02)


def test_compare_arms_prints_the_calibrated_rule():
    """The rule calibrated above is what `compare_arms` applies, study by study."""
    a, b = per_image_arms(np.random.default_rng(7), 3, 3, Noise(6.0, 15.0, 10.0, 30))
    a = a + 2.0
    batch = difference_intervals(a, b)
    ids = [f"img{i}" for i in range(30)]
    for k in range(3):
        arms = [Arm(name, [{"val/CIDEr": v} for v in x[k].mean(axis=1)], x[k], ids) for name, x in (("a", a), ("b", b))]
        diff = compare_arms(arms, baseline="b").differences["a"]
        assert (diff.delta, diff.low, diff.high) == pytest.approx(
            (batch["delta"][k], batch["low"][k], batch["high"][k]), abs=1e-9)


def monte_carlo_power(n: int, delta: float, sd: float, studies: int = 20_000, rng_seed: int = 0) -> float:
    """The share of simulated studies (seed means only, normal with sd `sd`) in which the rule says A beats B."""
    rng = np.random.default_rng(rng_seed)
    a, b = rng.normal(delta, sd, (studies, n)), rng.normal(0.0, sd, (studies, n))
    out = difference_intervals(a, b)
    return float(np.nan_to_num(out["low"] > 0).mean())


@pytest.mark.parametrize("delta, sd", [(5.0, 1.5), (2.8, 1.5), (1.0, 1.0)])
def test_plan_seeds_match_a_monte_carlo_of_the_rule(delta, sd):
    """Seed means only: `a2 study plan`'s seeds per arm (`seeds_needed`, which launch/plan.py prints) is the
    smallest n whose simulated power reaches 80%, within one seed."""
    import launch.plan
    from dashboards.stats import seeds_needed

    assert launch.plan.seeds_needed is seeds_needed and launch.plan.POWER == 0.8
    n = seeds_needed(delta, sd)
    simulated = {k: monte_carlo_power(k, delta, sd, rng_seed=k) for k in range(max(2, n - 2), n + 3)}
    n_mc = min(k for k, p in simulated.items() if p >= 0.8)
    assert abs(n_mc - n) <= 1, (n, simulated)
    for k, p in simulated.items():  # and the formula is the simulated power (MC standard error <= 0.0035)
        assert power(k, delta, sd) == pytest.approx(p, abs=0.012), (k, p)


# -- unequal seeds per arm ------------------------------------------------------------------------------------------
UNEQUAL = ((2, 3), (2, 6), (3, 10))


def unequal_drawn_cell(n_a: int, n_b: int, noise: Noise, studies: int, rng_seed: int):
    """`drawn_cell` with n_a seeds in arm A and n_b in B: (difference, half-width) of each simulated study."""
    rng = np.random.default_rng(rng_seed)
    m, run = noise.images, noise.run_sd ** 2
    means = [rng.normal(0, noise.seed_sd, (studies, n)) + rng.normal(0, noise.run_sd / math.sqrt(m), (studies, n))
             for n in (n_a, n_b)]
    delta = means[0].mean(axis=1) - means[1].mean(axis=1) + rng.normal(0, math.sqrt(noise.image_var), studies)
    d2 = (2 * noise.arm_image_sd ** 2 + run / n_a + run / n_b) * rng.chisquare(m - 1, studies) / (m - 1)
    ra, rb = (run * rng.chisquare((n - 1) * (m - 1), studies) / ((n - 1) * (m - 1)) for n in (n_a, n_b))
    half, _, _ = components_interval(means[0].var(axis=1, ddof=1) / n_a, means[1].var(axis=1, ddof=1) / n_b,
                                     n_a, n_b, m, d2, ra, rb)
    return delta, half


def seed_means_cell(n_a: int, n_b: int, studies: int, rng_seed: int):
    """(difference, half-width) of studies of seed values only (sd 1 in both arms), through `difference_intervals`."""
    rng = np.random.default_rng(rng_seed)
    out = difference_intervals(rng.normal(0, 1, (studies, n_a)), rng.normal(0, 1, (studies, n_b)))
    return out["delta"], (out["high"] - out["low"]) / 2


@pytest.mark.parametrize("n_a, n_b", UNEQUAL)
@pytest.mark.parametrize("name, images", [("seed means", None), ("run noise", 500), ("run noise", 5000),
                                          ("interaction", 2000)])
def test_unequal_seeds_keep_their_level(name, images, n_a, n_b):
    """An arm that lost trials (2 vs 3, 2 vs 6, 3 vs 10 seeds): false verdicts <= 5.5% per comparison (Welch's d.f.
    gave 7.4%, 10% and 6.5% on seed means; the rule pools the two arms' seed variance where their seeds differ),
    and `power` for the split within 3 points of the simulated power."""
    if images is None:
        delta, half = seed_means_cell(n_a, n_b, STUDIES, rng_seed=7 * n_a + n_b)
        noise = Noise(1.0)
    else:
        noise = regime(name, n_a, images)
        delta, half = unequal_drawn_cell(n_a, n_b, noise, STUDIES, rng_seed=n_a * n_b * images)
    false = float(np.mean(np.abs(delta) > half))
    assert false <= 0.055 and bound(false, STUDIES) <= 0.06, false
    sd = math.sqrt(noise.seed_mean_var * (1 / n_a + 1 / n_b) + noise.image_var)
    gap = (sps.norm.ppf(0.975) + sps.norm.ppf(0.8)) * sd
    assert noise.sd_of_difference(n_a, n_b) == pytest.approx(sd)
    assert power(n_a, gap, noise, n_b=n_b) == pytest.approx(float(np.mean(delta + gap - half > 0)), abs=0.03)


def test_unequal_seeds_on_per_image_scores():
    """The per-image path at 2 vs 6 seeds x 500 images (the issue's 6.4-6.7% under Welch's d.f.)."""
    noise = regime("run noise", 2, 500)
    rng = np.random.default_rng(26)
    difficulty = rng.gamma(2.0, 50.0, (4_000, 1, 500))
    a, b = (difficulty + rng.normal(0, noise.arm_image_sd, (4_000, 1, 500))
            + rng.normal(0, noise.seed_sd, (4_000, n, 1)) + rng.normal(0, noise.run_sd, (4_000, n, 500))
            for n in (2, 6))
    out = difference_intervals(a, b)
    false = float(np.mean(np.nan_to_num(out["p"], nan=1.0) < 0.05))
    assert false == pytest.approx(float(np.mean((out["low"] > 0) | (out["high"] < 0))))  # p and interval agree
    assert false <= 0.055 and bound(false, 4_000) <= 0.06, false


# -- a study's verdicts as one family ------------------------------------------------------------------------------
FAMILY_STUDIES = 4_000


def family_cell(seeds: int, noise: Noise, studies: int, rng_seed: int, deltas=(0.0, 0.0, 0.0, 0.0),
                per_image: bool = True, tails: bool = False) -> dict[str, np.ndarray]:
    """Studies of a baseline and len(deltas) arms (arm i truly deltas[i] better), each arm against the baseline
    through `difference_intervals`, the family through `holm`, as `compare_arms` does: (studies, arms) arrays of
    `raw` and `adjusted` verdicts on the true side or not (+1 right side, -1 wrong side, 0 none)."""
    rng = np.random.default_rng(rng_seed)
    raw, adjusted = [], []
    k = len(deltas)
    for start in range(0, studies, CHUNK // 2):
        size = min(CHUNK // 2, studies - start)
        if per_image:
            difficulty = rng.gamma(2.0, 50.0, (size, 1, noise.images))
            arms = [difficulty + d + _noise(rng, (size, 1, noise.images), noise.arm_image_sd, tails)
                    + _noise(rng, (size, seeds, 1), noise.seed_sd, tails)
                    + _noise(rng, (size, seeds, noise.images), noise.run_sd, tails) for d in (0.0, *deltas)]
        else:
            arms = [d + _noise(rng, (size, seeds), noise.seed_sd, tails) for d in (0.0, *deltas)]
        outs = [difference_intervals(arm, arms[0]) for arm in arms[1:]]
        p = np.stack([o["p"] for o in outs], axis=1)  # (size, k)
        sign = np.stack([np.sign(o["delta"]) * np.where(np.asarray(deltas) >= 0, 1, -1)[i]
                         for i, o in enumerate(outs)], axis=1)
        p_adj, _ = holm(p)
        raw.append(np.where(np.nan_to_num(p, nan=1.0) < 0.05, sign, 0))
        adjusted.append(np.where(np.nan_to_num(p_adj, nan=1.0) < 0.05, sign, 0))
    assert k == len(deltas)
    return {"raw": np.concatenate(raw), "adjusted": np.concatenate(adjusted)}


@pytest.mark.parametrize("seeds", (3, 5))
@pytest.mark.parametrize("per_image", (True, False), ids=("per-image", "seed means"))
def test_a_study_of_five_equal_arms_resolves_nothing_95_percent_of_the_time(seeds, per_image):
    """Five truly equal arms (four against the baseline): some "resolved" in <= 5.5% of studies with Holm's step-down
    (the raw intervals alone: 11-15%)."""
    noise = regime("run noise", seeds, 500)
    out = family_cell(seeds, noise if per_image else Noise(1.0), FAMILY_STUDIES, rng_seed=40 + seeds,
                      per_image=per_image)
    family_wise = float(np.mean((out["adjusted"] != 0).any(axis=1)))
    raw = float(np.mean((out["raw"] != 0).any(axis=1)))
    assert family_wise <= 0.055 and bound(family_wise, FAMILY_STUDIES) <= 0.065, family_wise
    assert raw >= 0.10, raw  # what the family correction removes


def test_the_plans_family_power_is_holms_where_one_arm_differs():
    """One arm truly better at the gap `power(family=4)` gives 80%, three equal: Holm resolves it about that often (its
    first step decides; the plan's figure is a lower bound where more arms differ, measured at all four better)."""
    noise = regime("run noise", 5, 500)
    sd = noise.sd_of_difference(5)
    gap = (sps.norm.ppf(1 - 0.05 / 8) + sps.norm.ppf(0.8)) * sd
    planned = power(5, gap, noise, family=4)
    one = family_cell(5, noise, FAMILY_STUDIES, rng_seed=77, deltas=(gap, 0.0, 0.0, 0.0))
    assert float(np.mean(one["adjusted"][:, 0] == 1)) == pytest.approx(planned, abs=0.03)
    every = family_cell(5, noise, 2_000, rng_seed=78, deltas=(gap,) * 4)
    assert float(np.mean(every["adjusted"] == 1)) >= planned - 0.02


def test_compare_arms_prints_the_family_rule():
    """The family rule calibrated above is what `compare_arms` applies, study by study."""
    rng = np.random.default_rng(9)
    ids = [f"img{i}" for i in range(40)]
    scores = [rng.normal(100 + d, 5, (3, 40)) for d in (0.0, 3.0, 0.5, 0.0)]
    arms = [Arm(name, [{"val/CIDEr": v} for v in x.mean(axis=1)], x, ids)
            for name, x in zip(("none", "gate", "max", "mean"), scores)]
    comparison = compare_arms(arms, baseline="none")
    p = np.asarray([[difference_intervals(x[None], scores[0][None])["p"][0] for x in scores[1:]]])
    p_adj, confidence = holm(p)
    for i, label in enumerate(("gate", "max", "mean")):
        d = comparison.differences[label]
        assert d.family == 3 and d.p == pytest.approx(p[0, i]) and d.p_adjusted == pytest.approx(p_adj[0, i])
        assert d.resolved == (p_adj[0, i] < 0.05) and d.raw_resolved == (p[0, i] < 0.05)
        adjusted = difference_intervals(scores[i + 1][None], scores[0][None], confidence=confidence[0, i])
        assert (d.low_adjusted, d.high_adjusted) == pytest.approx((adjusted["low"][0], adjusted["high"][0]))
        # the interval at Holm's confidence misses 0 exactly when Holm resolves the comparison
        assert d.resolved == (d.low_adjusted > 0 or d.high_adjusted < 0)


# -- adaptive replicates (dashboards.sequential) -------------------------------------------------------------------
FUSION_ABLATION = dict(noise=Noise(1.0, 0.0, 10.0, 5000), gaps=(2.8, 2.3, 4.2, 5.0), configs=(1, 2, 2, 8, 2))


@pytest.mark.parametrize("tails", (False, True), ids=("normal", "t3"))
def test_adaptive_replicates_keep_the_familys_level_and_save_seeds(tails):
    """fusion_ablation's plan (5 arms, configurations 1, 2, 2, 8, 2, the paper's gaps, COCO seed sd 1 over 5,000
    images): seeds in rounds of (3, 5, 7, 9), error spent in proportion to the seeds, each look's seed variance pooled
    over every arm run so far (`Design.pool_arms`, the design's rule), Holm over the arms' sequential p-values. All
    arms equal: some "resolved" <= 5.5% (2.7% normal, 1.9% t(3) measured). At power on every gap >= the fixed 5-seed
    design's, it runs <= 62% of the fixed design's (`compare`'s rule) seed-trials at equal power with normal seeds (56%
    measured) and <= 56% with t(3) seeds (50%); each pair's own seed variance gave 78% and 65%).
    benchmarks/bench_sequential.py prints the whole comparison."""
    from dashboards.sequential import Design, simulate, spending_weights

    noise, gaps, configs = FUSION_ABLATION["noise"], FUSION_ABLATION["gaps"], FUSION_ABLATION["configs"]
    rounds = (3, 5, 7, 9)
    design = Design(rounds, spending_weights(rounds), futility_gap=min(gaps))
    null = simulate(design, noise, (0.0,) * 4, configs, FAMILY_STUDIES, rng_seed=2, tails=tails)
    assert null["family_wise"] <= 0.055 and null["seed_trials"] < 15 * 9 * 0.6, null
    alt = simulate(design, noise, gaps, configs, FAMILY_STUDIES, rng_seed=1, tails=tails)
    fixed = {n: simulate(Design.fixed(n), noise, gaps, configs, FAMILY_STUDIES, rng_seed=1, tails=tails)
             for n in (5, 6, 7)}
    assert fixed[6]["seed_trials"] == 15 * 6 and fixed[6]["seeds"] == [6.0] * 5
    hardest = 1  # moving_average's 2.3
    assert all(a >= f - 0.01 for a, f in zip(alt["power"], fixed[5]["power"]))
    equal = float(np.interp(alt["power"][hardest], [fixed[n]["power"][hardest] for n in fixed],
                            [fixed[n]["seed_trials"] for n in fixed]))
    assert alt["seed_trials"] / equal <= (0.56 if tails else 0.62), (alt, equal)


def test_the_sequential_p_value_is_the_union_bound_over_the_looks():
    from dashboards.sequential import Design, sequential_p, spending_weights

    assert spending_weights((3, 6, 9)) == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    assert sequential_p(np.array([[0.01, 0.5, np.nan]]), (0.25, 0.25, 0.5)) == pytest.approx([0.04])
    assert sequential_p(np.array([[0.9, 0.6, 0.3]]), (0.25, 0.25, 0.5)) == pytest.approx([0.6])
    with pytest.raises(ValueError, match="rounds must grow"):
        Design((3, 3), (0.5, 0.5))


def main() -> None:
    """Print the figures docs/explanation/statistics.md quotes."""
    rows = [(name, 100, noise, PER_IMAGE_STUDIES, lambda n, nz: per_image_cell(n, nz, PER_IMAGE_STUDIES, 100 + n))
            for name, noise in SMALL.items()]
    for name in ("run noise", "interaction"):
        for m in IMAGES:
            rows.append((name, m, None, STUDIES, lambda n, nz, m=m: drawn_cell(n, nz, STUDIES, n * m)))
    for m in IMAGES:
        rows.append(("heavy tails", m, None, HEAVY_STUDIES,
                     lambda n, nz: per_image_cell(n, nz, HEAVY_STUDIES, 300 + n, tails=True)))
    print("cell | images | seeds/arm: false verdicts / coverage / half-width x oracle / power simulated, planned")
    for name, m, fixed, studies, run in rows:
        cells = []
        for n in SEEDS_PER_ARM:
            noise = fixed or regime(name, n, m)
            r = cell_rates(*run(n, noise), n, noise)
            cells.append(f"{n}: {100 * r['false']:.1f}% / {100 * r['coverage']:.1f}% / {r['width']:.2f} / "
                         f"{100 * r['power']:.0f}%, {100 * r['planned']:.0f}%")
        print(f"{name} | {m} | " + " | ".join(cells), flush=True)
    print("unequal seeds | images | 2 vs 3 | 2 vs 6 | 3 vs 10: false verdicts / half-width x oracle / power "
          "simulated, planned")
    for name, m in (("seed means", None), ("run noise", 500), ("run noise", 5000), ("interaction", 2000)):
        cells = []
        for n_a, n_b in UNEQUAL:
            noise = Noise(1.0) if m is None else regime(name, n_a, m)
            delta, half = (seed_means_cell(n_a, n_b, STUDIES, 7 * n_a + n_b) if m is None
                           else unequal_drawn_cell(n_a, n_b, noise, STUDIES, n_a * n_b * m))
            sd = noise.sd_of_difference(n_a, n_b)
            gap = (sps.norm.ppf(0.975) + sps.norm.ppf(0.8)) * sd
            cells.append(f"{100 * np.mean(np.abs(delta) > half):.1f}% / {half.mean() / (1.96 * sd):.2f} / "
                         f"{100 * np.mean(delta + gap - half > 0):.0f}, {100 * power(n_a, gap, noise, n_b=n_b):.0f}")
        print(f"{name} | {m or '-'} | " + " | ".join(cells), flush=True)
    print("five equal arms | seeds | some resolved: raw intervals, Holm")
    for per_image in (True, False):
        for seeds in (3, 5):
            noise = regime("run noise", seeds, 500) if per_image else Noise(1.0)
            out = family_cell(seeds, noise, FAMILY_STUDIES, 40 + seeds, per_image=per_image)
            print(f"{'per-image, 500 images' if per_image else 'seed means'} | {seeds} | "
                  f"{np.mean((out['raw'] != 0).any(axis=1)):.1%}, {np.mean((out['adjusted'] != 0).any(axis=1)):.1%}")


if __name__ == "__main__":
    main()
