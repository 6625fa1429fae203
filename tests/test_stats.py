"""dashboards.stats: intervals that cover at their nominal rate, the paired bootstrap, verdicts, power, best."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from a2core.errors import DataError
from a2core.metrics import CiderD
from dashboards.stats import (Arm, best_candidates, compare_arms, paired_difference, power, seed_difference,
                              seed_interval, seeds_needed, stopped_early_text)


@pytest.mark.parametrize("n", [3, 5, 10])
def test_seed_interval_covers_the_true_mean_at_the_nominal_rate(n):
    draws = np.random.default_rng(n).normal(112.0, 1.5, size=(400, n))  # 400 studies of n seeds
    covered = sum(iv.low <= 112.0 <= iv.high for iv in map(seed_interval, draws))
    assert 0.92 * 400 <= covered <= 0.98 * 400


def test_seed_interval_below_min_seeds_and_identical_seeds_say_so():
    one = seed_interval([110.0])
    assert (one.mean, one.low, one.high, one.n) == (110.0, None, None, 1)
    assert one.text() == "110.0 (1 seed: no interval)"
    two = seed_interval([110.0, 112.0])  # t(0.975, 1) = 12.706: wide, and it holds its 95%
    assert two.low == pytest.approx(111 - 12.7062 * 2 ** 0.5 / 2 ** 0.5, abs=1e-3)
    same = seed_interval([5.0, 5.0, 5.0])  # no zero-width interval: the seed changes nothing
    assert (same.low, same.high, same.identical) == (None, None, True)
    assert same.text() == "5.0 (3 seeds, all equal: the seed changes nothing)"
    iv = seed_interval([110.0, 112.0, 114.0])  # mean 112, sd 2, t(0.975, 2) = 4.303
    assert iv.low == pytest.approx(112 - 4.3027 * 2 / 3 ** 0.5, abs=1e-3)


def per_image_cider(candidates: list[str], refs: list[list[str]]) -> np.ndarray:
    return 100 * CiderD.from_corpus(refs).scores(candidates, refs)  # x100, per image


def test_paired_bootstrap_identical_systems_contain_zero():
    rng = np.random.default_rng(0)
    words = ["a dog runs on grass", "a cat sits on a mat", "two men ride horses", "a red bus on a street"]
    refs = [[words[i % 4], words[(i + 1) % 4]] for i in range(40)]
    cands = [words[int(rng.integers(4))] for _ in range(40)]
    scores = per_image_cider(cands, refs)  # (40,) the project's own per-image CIDEr-D
    system = np.stack([scores + s for s in (-0.5, 0.0, 0.5)])  # 3 seeds x 40 images
    diff = paired_difference(system, system.copy(), ("gate", "none"))
    assert diff.low <= 0 <= diff.high and not diff.resolved
    assert diff.verdict().startswith("gate vs none: no difference resolved at this size (+0.0 CIDEr [")
    assert diff.verdict().endswith("3 seeds x 40 images)")


def test_paired_bootstrap_resolves_a_five_cider_system():
    rng = np.random.default_rng(1)
    difficulty = rng.gamma(2.0, 50.0, 500)  # what the images share; the pairing removes it
    none = difficulty + rng.normal(0, 15, (3, 500)) + rng.normal(0, 1.0, (3, 1))
    gate = difficulty + 5 + rng.normal(0, 15, (3, 500)) + rng.normal(0, 1.0, (3, 1))
    diff = paired_difference(gate, none, ("gate", "none"))
    assert diff.low > 0 and diff.resolved and diff.low < diff.delta < diff.high
    assert diff.verdict() == (f"gate beats none by {diff.delta:.1f} CIDEr [{diff.low:.1f}, {diff.high:.1f}], "
                              f"3 seeds x 500 images")
    assert paired_difference(none, gate, ("none", "gate")).verdict().startswith("none trails gate by")


def test_paired_difference_covers_a_true_zero_at_three_seeds():
    """Seed noise larger than the image noise: the interval must still hold its 95% with 3 seeds per arm (a
    percentile bootstrap over 3 seeds alone covers about 82% here)."""
    rng = np.random.default_rng(3)
    covered = 0
    for _ in range(200):
        difficulty = rng.gamma(2.0, 50.0, 100)
        a, b = (difficulty + rng.normal(0, 15, (3, 100)) + rng.normal(0, 10, (3, 1)) for _ in range(2))
        diff = paired_difference(a, b)
        covered += diff.low <= 0 <= diff.high
    assert 0.92 * 200 <= covered <= 0.995 * 200


def test_seed_difference_and_compare_arms():
    d = seed_difference([110.0, 111.0, 112.0], [104.0, 105.0, 106.0], ("gate", "none"))
    assert d.delta == pytest.approx(6.0) and d.resolved and d.images is None
    assert d.verdict().endswith("3 seeds, seed means only")
    assert seed_difference([1.0], [1.0, 2.0, 3.0]).low is None
    arms = [Arm("none", [{"val/CIDEr": v, "val/BLEU-4": 30.0} for v in (104.0, 105.0, 106.0)]),
            Arm("gate", [{"val/CIDEr": v} for v in (110.0, 111.0, 112.0)])]
    comparison = compare_arms(arms, baseline="none")
    assert list(comparison.differences) == ["gate"] and comparison.differences["gate"] == d
    (_, none), (_, gate) = comparison.rows
    assert set(none) == {"val/CIDEr", "val/BLEU-4"} and gate["val/CIDEr"].mean == pytest.approx(111.0)
    # lower-is-better metrics: a lower mean beats
    loss = compare_arms([Arm("a", [{"loss": v} for v in (1, 2, 3)]), Arm("b", [{"loss": v} for v in (7, 8, 9)])],
                        baseline="b", metric="loss", mode="min")
    assert loss.verdicts() == ["a beats b by 6.0 loss [3.7, 8.3], 3 seeds, seed means only"]  # Welch: df 4


def test_one_seed_per_arm_gives_no_verdict():
    rng = np.random.default_rng(5)
    a, b = rng.normal(100, 15, (1, 100)), rng.normal(88, 15, (1, 100))  # a large image-level gap, one seed
    diff = paired_difference(a, b, ("gate", "none"))
    assert diff.low is None and not diff.resolved
    assert diff.verdict() == (f"gate vs none: no verdict: 1 seed per arm measures no seed noise "
                              f"({diff.delta:+.1f} CIDEr, 1 seed x 100 images)")
    mixed = seed_difference([1.0], [1.0, 2.0, 3.0], ("a", "b"))
    assert mixed.verdict() == "a vs b: no verdict: 1 seed of a measures no seed noise (-1.0 CIDEr, 1+3 seeds, seed means only)"
    assert seed_difference([1.0, 2.0], [3.0, 5.0]).low is not None  # 2 seeds per arm: Welch's interval


def test_identical_seeds_give_no_verdict_and_a_warning():
    a = np.tile(np.linspace(50, 150, 40), (3, 1))  # 3 seeds, every one scoring the same on every image
    diff = paired_difference(a + 10, a, ("a", "b"))
    assert diff.low is None and diff.identical == ("a", "b")
    assert diff.verdict() == ("a vs b: no verdict: warning: the seed changes nothing in a and b (every seed scored "
                              "the same) (+10.0 CIDEr, 3 seeds x 40 images)")
    one = seed_difference([110.0, 110.0, 110.0], [100.0, 101.0, 99.0], ("a", "b"))
    assert one.identical == ("a",) and "the seed changes nothing in a " in one.verdict()


def test_arms_are_matched_by_image_id():
    rng = np.random.default_rng(2)
    scores = rng.normal(100, 20, (3, 5))
    ids = ["1", "2", "3", "4", "5"]
    a = Arm("a", [{"val/CIDEr": v} for v in scores.mean(axis=1) + 3], scores + 3, ids)
    shuffled = [4, 0, 3, 1, 2]
    b = Arm("b", [{"val/CIDEr": v} for v in scores.mean(axis=1)], scores[:, shuffled], [ids[j] for j in shuffled])
    diff = compare_arms([a, b], baseline="b").differences["a"]
    same = paired_difference(scores + 3, scores, ("a", "b"))  # the same images matched, whatever the order
    assert (diff.delta, diff.low, diff.high) == pytest.approx((same.delta, same.low, same.high), abs=1e-9)
    other = Arm("c", b.seeds, scores, ["1", "2", "3", "4", "99"])
    with pytest.raises(DataError, match=r"arms c and b were scored on different images .*only in c: \['99'\], "
                                        r"only in b: \['5'\]"):
        compare_arms([other, b], baseline="b")
    with pytest.raises(ValueError, match="arm d: per-image scores of 5 images need one image id per column"):
        Arm("d", [], scores)


def test_power_is_the_rules_power():
    # the example: sd 1.5, delta 5, 3 seeds per arm: about 0.77 in 20,000 simulated studies, not 0.8
    assert power(3, 5.0, 1.5) == pytest.approx(0.762, abs=0.005)
    assert seeds_needed(5.0, 1.5) == 4
    assert power(1, 5.0, 1.5) == 0.0 and seeds_needed(5.0, 0.0) == 2
    assert seeds_needed(1.0, 1.0) == 17 and power(17, 1.0, 1.0) >= 0.8 > power(16, 1.0, 1.0)


def test_best_candidates_excludes_stopped_unless_only():
    # a trial's `stopped_early` field (the scheduler's record), no MLflow tag
    done, cut = SimpleNamespace(stopped_early=None), SimpleNamespace(stopped_early={"rung": 2, "cutoff": 1.5})
    assert best_candidates([cut, done]) == [done]
    assert best_candidates([cut]) == [cut]
    assert best_candidates([("g1", True), ("g2", False)], stopped_of=lambda group: group[1]) == [("g2", False)]
    assert stopped_early_text(cut.stopped_early) == "stopped early (rung 2, cutoff 1.5)"
    assert stopped_early_text({"rung": None, "cutoff": None}) == "stopped early (rung ?, cutoff ?)"


@pytest.mark.parametrize("study", ["fusion_ablation", "lambda_sweep"])
def test_shipped_studies_never_print_a_one_seed_verdict(study):
    """Whatever seeds a shipped study runs per configuration, its comparisons (report's Table 3, compare) give a
    verdict only when each arm has MIN_SEEDS seeds: with one seed, the difference and "no verdict"."""
    from pathlib import Path

    import yaml

    from dashboards.stats import MIN_SEEDS

    search = yaml.safe_load((Path(__file__).resolve().parents[1] / "studies" / f"{study}.yaml").read_text())["search"]
    replicates = search.get("replicates")  # a count or a list of seeds; else the seed grid of the space
    n = (replicates if isinstance(replicates, int) else len(replicates)) if replicates else \
        len(search["space"].get("seed", {}).get("grid", [0]))
    rng = np.random.default_rng(0)
    ids = [str(i) for i in range(50)]
    arms = [Arm(name, [{"val/CIDEr": 0.0}] * n, rng.normal(mean, 5, (n, 50)), ids)
            for name, mean in (("gate", 120.0), ("none", 100.0))]
    (text,) = compare_arms(arms, baseline="none").verdicts()
    if n < MIN_SEEDS:
        assert text.startswith("gate vs none: no verdict: 1 seed per arm measures no seed noise (+"), text
    else:
        assert "no verdict" not in text and text.startswith("gate beats none by"), text


def test_the_interval_counts_each_component_once():
    """Seed means per arm / n, plus the arm x image term net of the runs' per-image noise (computed by hand)."""
    rng = np.random.default_rng(11)
    a = rng.normal(100, 30, (3, 200)) + rng.normal(0, 1, (3, 1))
    b = rng.normal(98, 30, (4, 200)) + rng.normal(0, 1, (4, 1))
    d = paired_difference(a, b)

    def residual(x):
        r = x - x.mean(axis=1, keepdims=True) - x.mean(axis=0) + x.mean()
        return (r ** 2).sum() / ((len(x) - 1) * (x.shape[1] - 1))

    va, vb = a.mean(axis=1).var(ddof=1) / 3, b.mean(axis=1).var(ddof=1) / 4
    image = max(0.0, (a.mean(axis=0) - b.mean(axis=0)).var(ddof=1) - residual(a) / 3 - residual(b) / 4) / 200
    half = (d.high - d.low) / 2
    t = half / np.sqrt(va + vb + image)
    assert d.delta == pytest.approx(a.mean() - b.mean())
    assert 1.96 < t < 4.31  # between z and t(2): Satterthwaite's d.f. lie between the seeds' and the images'


def test_noise_of_measures_the_components():
    """`noise_of` recovers seed shift, run noise and arm x image sd from a simulated study of 6 configurations x 5
    seeds x 2,000 images (and the seed means alone say the sd of a seed mean)."""
    from dashboards.stats import Noise, noise_of

    rng = np.random.default_rng(12)
    difficulty = rng.gamma(2.0, 50.0, 2000)
    groups = [difficulty + rng.normal(0, 10, 2000) + rng.normal(0, 2.0, (5, 1)) + rng.normal(0, 50, (5, 2000))
              for _ in range(6)]
    noise = noise_of(groups)
    assert noise.images == 2000
    assert noise.run_sd == pytest.approx(50, rel=0.01)
    assert noise.arm_image_sd == pytest.approx(10, rel=0.1)
    assert noise.seed_sd == pytest.approx(2.0, rel=0.35)  # 24 d.f. of seed means
    assert Noise(0.3, 50, 10, 2000).sd_of_difference(5) == pytest.approx(0.797, abs=0.001)
    with pytest.raises(ValueError, match="no configuration with two seeds"):
        noise_of([groups[0][:1]])


def test_power_counts_the_test_images():
    """The rule's power with per-image components: more test images shrink the arm x image term, and with too
    few no number of seeds reaches 80%."""
    from dashboards.stats import Noise

    few, many = Noise(0.5, 50, 30, 500), Noise(0.5, 50, 30, 5000)
    assert power(5, 4.0, few) < power(5, 4.0, many)
    assert seeds_needed(3.0, few) is None  # 2 x 30^2 / 500 = 3.6: the images alone leave sd 1.9 > 3 / 2.8
    assert seeds_needed(3.0, many) == 3 and power(3, 3.0, many) >= 0.8 > power(2, 3.0, many)
    assert seeds_needed(2.0, many) == 11


def test_the_distribution_functions_are_scipy_stats_value_for_value():
    """dashboards.stats computes t, normal and chi2 quantiles with scipy.special (scipy.stats costs about a second of
    every status, compare and report's start-up): the same numbers as scipy.stats, bit for bit, NaN where its
    argument check gives NaN."""
    from scipy import stats as sps

    from dashboards import stats

    q = np.array([1e-9, 0.0125, 0.025, 0.5, 0.8, 0.975, 0.995, 1 - 1e-9])
    df = np.array([-1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 7.5, 29.0, 4999.0, 1e6, np.inf])
    qq, dd = np.meshgrid(q, df)
    np.testing.assert_array_equal(stats._t_ppf(qq, dd), sps.t.ppf(qq, dd))
    np.testing.assert_array_equal(stats._chi2_ppf(qq, dd), sps.chi2.ppf(qq, dd))
    x = np.linspace(-8, 8, 161)
    np.testing.assert_array_equal(stats._norm_cdf(x), sps.norm.cdf(x))
    np.testing.assert_array_equal(stats._norm_ppf(q), sps.norm.ppf(q))
    assert stats._t_ppf(0.975, 4) == sps.t.ppf(0.975, 4) and np.ndim(stats._t_ppf(0.975, 4)) == 0
    for values in ([90.0, 91.5], [90.0, 91.5, 89.2, 93.1, 90.7], list(np.random.default_rng(0).normal(110, 1, 10))):
        interval = seed_interval(values)
        x = np.asarray(values)
        low, high = sps.t.interval(0.95, df=x.size - 1, loc=x.mean(), scale=x.std(ddof=1) / np.sqrt(x.size))
        assert (interval.low, interval.high) == (float(low), float(high))


def test_holm_step_down_adjusted_p_and_the_confidence_each_was_tested_at():
    from dashboards.stats import holm

    p = np.array([[0.01, 0.04, 0.03, 0.005], [0.2, np.nan, 0.001, 0.013]])
    adjusted, confidence = holm(p)
    # sorted 0.005, 0.01, 0.03, 0.04 -> 4 x 0.005, 3 x 0.01, 2 x 0.03, then the running max
    assert adjusted[0] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # resolved at 0.05/4 and 0.05/3; the rest at the first open step's 0.05/2
    assert confidence[0] == pytest.approx([1 - 0.05 / 3, 0.975, 0.975, 1 - 0.05 / 4])
    # a comparison without an interval (NaN) is no part of the family: three here
    assert adjusted[1] == pytest.approx([0.2, np.nan, 0.003, 0.026], nan_ok=True)
    assert confidence[1] == pytest.approx([0.95, np.nan, 1 - 0.05 / 3, 0.975], nan_ok=True)


def test_a_studys_verdicts_are_one_family_with_raw_and_adjusted_figures():
    """Four arms against one baseline: Holm's verdicts, the raw interval and p beside them; an interval that misses 0
    alone but not once the family is counted says so."""
    from dashboards.stats import adjust_family

    base = [100.0, 101.0, 102.0, 101.5, 100.5]
    arms = [Arm("none", [{"val/CIDEr": v} for v in base])]
    for label, shift in (("gate", 1.2), ("max", 0.2), ("mean", -0.1), ("decay", 0.0)):
        arms.append(Arm(label, [{"val/CIDEr": v + shift + 0.1 * i} for i, v in enumerate(base)]))
    comparison = compare_arms(arms, baseline="none")
    gate = comparison.differences["gate"]
    alone = seed_difference([a["val/CIDEr"] for a in arms[1].seeds], base, ("gate", "none"))
    assert (gate.delta, gate.low, gate.high, gate.p) == pytest.approx((alone.delta, alone.low, alone.high, alone.p))
    assert alone.raw_resolved and alone.resolved and gate.raw_resolved and gate.family == 4
    assert gate.p < 0.05 <= gate.p_adjusted and not gate.resolved
    assert gate.low_adjusted < 0 < gate.high_adjusted  # the interval at the confidence Holm tested it at
    assert gate.verdict().startswith("gate vs none: not resolved once the family's comparisons are counted "
                                     f"(alone its interval misses 0) (+{gate.delta:.1f} CIDEr [")
    assert f"raw p {gate.p:.3f}, Holm over 4 comparisons: [{gate.low_adjusted:+.1f}, " in gate.verdict()
    # a family of one is left as it stands
    assert adjust_family({"gate": alone}) == {"gate": alone}


def test_unequal_seeds_pool_the_two_arms_seed_variance():
    """2 vs 6 seeds: Student's pooled t (n_a + n_b - 2 d.f.), not Welch's."""
    from scipy import stats as sps

    a, b = [10.0, 12.0], [9.0, 10.0, 11.0, 10.5, 9.5, 10.0]
    d = seed_difference(a, b)
    res = sps.ttest_ind(a, b, equal_var=True)
    assert d.df == pytest.approx(6) and d.p == pytest.approx(res.pvalue)
    half = sps.t.ppf(0.975, 6) * math.sqrt(((1 * np.var(a, ddof=1) + 5 * np.var(b, ddof=1)) / 6) * (1 / 2 + 1 / 6))
    assert (d.low, d.high) == pytest.approx((d.delta - half, d.delta + half))
