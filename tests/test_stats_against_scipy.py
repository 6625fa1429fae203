"""dashboards.stats against independent computations (scipy.stats, a hand-written Holm), and the edge cases a
researcher meets: all seeds equal, unequal seed counts, n = 2, tiny and huge scores, families of arms."""
import numpy as np
import pytest
import scipy.stats as st

from dashboards.stats import (Arm, Noise, compare_arms, difference_intervals, gain_over_members, holm,
                              paired_difference, pooled_differences, power, seed_difference, seed_interval)


@pytest.mark.parametrize("value", [112.3, 0.1, 95.7, 33.33, 120.01, 101.9])
@pytest.mark.parametrize("n", [3, 5, 6, 7, 10])
def test_seed_interval_equal_seeds_are_identical_whatever_the_rounding_of_their_mean(value, n):
    """7 seeds of 112.3 (or 3 of 0.1) have a floating-point mean 1 ulp off 112.3, so their sd was ~1e-14, not 0:
    seed_interval printed "112.3 [112.3, 112.3]", a zero-width interval, instead of the "all equal" warning."""
    iv = seed_interval([value] * n)
    assert (iv.low, iv.high, iv.identical, iv.mean) == (None, None, True, value)
    assert iv.text() == f"{value:.1f} ({n} seeds, all equal: the seed changes nothing)"


def test_seed_interval_of_tiny_distinct_scores_is_not_called_identical():
    """Squares of spreads below ~1e-154 underflow to 0: three different seeds read as "all equal" before."""
    x = np.array([1e-300, 2e-300, 3e-300])
    iv = seed_interval(x)
    low, high = st.t.interval(0.95, 2, loc=2e-300, scale=1e-300 / np.sqrt(3))
    assert not iv.identical and iv.low == pytest.approx(low, rel=1e-12) and iv.high == pytest.approx(high, rel=1e-12)


@pytest.mark.parametrize("x", [[110.0, 111.5], [-3.0, -7.5, -1.0], [1e200, -1e200, 3e200], list(np.arange(9.0))])
def test_seed_interval_matches_scipy_t_interval(x):
    x = np.asarray(x)
    k = np.abs(x).max()  # scipy's sem of 1e200s overflows: the sem of the scaled scores, scaled back
    low, high = st.t.interval(0.95, x.size - 1, loc=x.mean(), scale=k * st.sem(x / k))
    iv = seed_interval(list(x) + [None, float("nan"), float("inf")])  # dropped, not counted as seeds
    assert iv.n == x.size and iv.low == pytest.approx(low, rel=1e-12) and iv.high == pytest.approx(high, rel=1e-12)


@pytest.mark.parametrize("na,nb", [(2, 2), (3, 3), (5, 5), (2, 3), (3, 7), (4, 10)])
def test_seed_difference_is_welch_for_equal_seeds_and_student_for_unequal(na, nb):
    """Welch's t at equal seeds; Student's pooled t at unequal seeds (the documented choice: Welch's d.f. are
    liberal there), both as scipy.stats.ttest_ind computes them."""
    rng = np.random.default_rng(10 * na + nb)
    a, b = rng.normal(110, 2, na), rng.normal(108, 0.5, nb)
    d = seed_difference(a, b)
    ref = st.ttest_ind(a, b, equal_var=na != nb)
    ci = ref.confidence_interval(0.95)
    assert (d.low, d.high) == pytest.approx((ci.low, ci.high), rel=1e-12)
    assert d.p == pytest.approx(ref.pvalue, rel=1e-9) and d.df == pytest.approx(ref.df, rel=1e-12)


def _holm_reference(p, alpha=0.05):
    p = np.asarray(p, dtype=float)
    kept = [i for i in range(len(p)) if not np.isnan(p[i])]
    out, running = np.full(len(p), np.nan), 0.0
    for j, i in enumerate(sorted(kept, key=lambda i: p[i])):
        running = max(running, min(1.0, (len(kept) - j) * p[i]))
        out[i] = running
    return out


def test_holm_matches_a_hand_step_down_with_ties_and_missing_comparisons():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        k = int(rng.integers(1, 7))
        p = rng.uniform(0, 0.1, k) ** rng.uniform(0.5, 3)
        if rng.random() < 0.3:
            p[rng.integers(k)] = np.nan
        if k > 1 and rng.random() < 0.3:
            p[1] = p[0]  # a tie
        adjusted, confidence = holm(p)
        np.testing.assert_allclose(adjusted, _holm_reference(p), rtol=0, atol=1e-15)
        ok = ~np.isnan(p)
        # the interval at the returned confidence misses 0 exactly when Holm resolves the comparison
        assert np.array_equal((p < 1 - confidence)[ok], (adjusted < 0.05)[ok])


def test_family_of_four_arms_against_one_baseline_is_holm_over_welch_p_values():
    rng = np.random.default_rng(1)
    base = rng.normal(100, 1, 4)
    values = {f"x{i}": rng.normal(100 + i, 1, 4) for i in range(4)}
    arms = [Arm("base", [{"m": v} for v in base])] + [Arm(k, [{"m": v} for v in x]) for k, x in values.items()]
    diffs = compare_arms(arms, "base", "m").differences
    raw = {k: st.ttest_ind(x, base, equal_var=False) for k, x in values.items()}
    expected = dict(zip(raw, _holm_reference([r.pvalue for r in raw.values()])))
    for k, d in diffs.items():
        assert d.family == 4 and d.p == pytest.approx(raw[k].pvalue, rel=1e-9)
        assert d.p_adjusted == pytest.approx(expected[k], rel=1e-9)
        # the adjusted interval: Welch's t-interval at the confidence Holm tested the comparison at
        c = holm(np.array([r.pvalue for r in raw.values()]))[1][list(raw).index(k)]
        ci = raw[k].confidence_interval(c)
        assert (d.low_adjusted, d.high_adjusted) == pytest.approx((ci.low, ci.high), rel=1e-9)
        assert d.resolved == (expected[k] < 0.05) == (d.low_adjusted > 0 or d.high_adjusted < 0)
    # this draw has one arm resolved alone but not in the family: the verdict says so
    assert any(d.raw_resolved and not d.resolved for d in diffs.values())


def test_paired_difference_without_an_arm_by_image_term_is_welch_over_seed_means():
    """Scores = seed shift + a common image effect (+ the arm's constant): no per-image term is left, so the
    components interval is Welch's over seed means, and matching by image id is independent of column order."""
    rng = np.random.default_rng(3)
    m = 50
    image = rng.normal(100, 20, m)
    a, b = rng.normal(0, 1, (3, 1)) + image + 2, rng.normal(0, 1, (3, 1)) + image
    d = paired_difference(a, b)
    ci = st.ttest_ind(a.mean(axis=1), b.mean(axis=1), equal_var=False).confidence_interval(0.95)
    assert (d.low, d.high) == pytest.approx((ci.low, ci.high), rel=1e-9)
    perm = rng.permutation(m)
    arm = Arm("a", [{}] * 3, a, [f"img{i}" for i in range(m)])
    base = Arm("b", [{}] * 3, b[:, perm], [f"img{i}" for i in perm])
    matched = compare_arms([arm, base], "b").differences["a"]
    assert (matched.low, matched.high) == pytest.approx((d.low, d.high), rel=1e-9)


def test_paired_difference_with_zero_estimated_variance_gives_no_interval_rather_than_a_zero_width_win():
    """Each arm's seeds have equal means while their per-image scores differ (permuted over the images), and the
    per-image difference is constant: every variance component is 0. It printed "A beats B by 1.0 [1.0, 1.0]"
    with no p-value (so Holm left it out of the family while the verdict still called it a win)."""
    a = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    d = paired_difference(a, a - 1, ("a", "b"))
    assert d.delta == 1.0 and (d.low, d.high, d.p) == (None, None, None)
    assert not d.resolved and "no verdict" in d.verdict()
    arms = [Arm("b", [{}] * 2, a - 1, ["1", "2", "3"]), Arm("a", [{}] * 2, a, ["1", "2", "3"]),
            Arm("c", [{}] * 2, a + np.array([[0.3], [0.1]]) + [[0, 0.2, 0.1]], ["1", "2", "3"])]
    diffs = compare_arms(arms, "b").differences
    assert diffs["a"].low is None and diffs["c"].low is not None and diffs["c"].family == 1


def test_gain_over_members_is_the_one_sample_t_interval():
    rng = np.random.default_rng(5)
    members = rng.normal(100, 1, 4)
    d = gain_over_members(101.0, members)
    ci = st.ttest_1samp(members, 101.0).confidence_interval(0.95)  # of mean(members); the gain is 101 - it
    assert (d.low, d.high) == pytest.approx((101.0 - ci.high, 101.0 - ci.low), rel=1e-12)
    assert d.p == pytest.approx(st.ttest_1samp(members, 101.0).pvalue, rel=1e-9)


def test_pooled_differences_are_student_t_over_every_arms_seeds():
    rng = np.random.default_rng(6)
    values = {k: rng.normal(100 + i, 1.5, n) for i, (k, n) in enumerate([("base", 3), ("x", 4), ("y", 2), ("z", 5)])}
    comparison = compare_arms([Arm(k, [{"m": float(v)} for v in x]) for k, x in values.items()], "base", "m")
    pooled = pooled_differences(comparison)
    dof = sum(len(x) - 1 for x in values.values())
    sp = np.sqrt(sum(((x - x.mean()) ** 2).sum() for x in values.values()) / dof)
    for k in "xyz":
        x, y = values[k], values["base"]
        se, delta = sp * np.sqrt(1 / len(x) + 1 / len(y)), x.mean() - y.mean()
        half = st.t.ppf(0.975, dof) * se
        assert (pooled[k].low, pooled[k].high) == pytest.approx((delta - half, delta + half), rel=1e-12)
        assert pooled[k].df == dof and pooled[k].p == pytest.approx(2 * st.t.sf(abs(delta) / se, dof), rel=1e-9)


@pytest.mark.parametrize("n,n_b,family", [(3, 3, 1), (2, 5, 1), (4, 4, 3)])
def test_power_matches_the_rule_simulated(n, n_b, family):
    """`power` (seed means only) against 40,000 simulated studies through the same rule at alpha / family."""
    rng = np.random.default_rng(n * 10 + n_b)
    out = difference_intervals(rng.normal(2.0, 1, (40_000, n)), rng.normal(0, 1, (40_000, n_b)),
                               confidence=1 - 0.05 / family)
    assert power(n, 2.0, 1.0, family=family, n_b=n_b) == pytest.approx(np.mean(out["low"] > 0), abs=0.012)


def test_power_with_images_matches_the_rule_simulated():
    rng = np.random.default_rng(7)
    noise, n, studies, m = Noise(0.5, 20.0, 3.0, 200), 3, 6000, 200
    image = rng.normal(0, 10, (studies, 1, m))

    def arm(shift):
        return (shift + image + rng.normal(0, noise.arm_image_sd, (studies, 1, m))
                + rng.normal(0, noise.seed_sd, (studies, n, 1)) + rng.normal(0, noise.run_sd, (studies, n, m)))

    out = difference_intervals(arm(1.5), arm(0.0))
    assert power(n, 1.5, noise) == pytest.approx(np.mean(out["low"] > 0), abs=0.015)
