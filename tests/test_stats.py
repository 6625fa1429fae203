"""dashboards.stats: intervals that cover at their nominal rate, the paired bootstrap, verdicts, power, best."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from a2core.metrics import CiderD
from dashboards.stats import (Arm, best_candidates, compare_arms, paired_difference, power, seed_difference,
                              seed_interval, seeds_needed, stopped_early_tags)


@pytest.mark.parametrize("n", [3, 5, 10])
def test_seed_interval_covers_the_true_mean_at_the_nominal_rate(n):
    draws = np.random.default_rng(n).normal(112.0, 1.5, size=(400, n))  # 400 studies of n seeds
    covered = sum(iv.low <= 112.0 <= iv.high for iv in map(seed_interval, draws))
    assert 0.92 * 400 <= covered <= 0.98 * 400


def test_seed_interval_below_three_seeds_says_so():
    two = seed_interval([110.0, 112.0])
    assert (two.mean, two.low, two.high, two.n) == (111.0, None, None, 2)
    assert two.text() == "111.0 (2 seeds: no interval)"
    assert seed_interval([5.0, 5.0, 5.0]).text() == "5.0 [5.0, 5.0]"
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
        diff = paired_difference(a, b, n_resamples=999)
        covered += diff.low <= 0 <= diff.high
    assert 0.92 * 200 <= covered <= 0.995 * 200


def test_seed_difference_and_compare_arms():
    d = seed_difference([110.0, 111.0, 112.0], [104.0, 105.0, 106.0], ("gate", "none"))
    assert d.delta == pytest.approx(6.0) and d.resolved and d.images is None
    assert d.verdict().endswith("3 seeds, seed means only")
    assert seed_difference([1.0, 2.0], [1.0, 2.0, 3.0]).low is None
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


def test_power_and_seeds_needed():
    # textbook two-sample t test values (alpha 0.05, power 0.8): d = 1 -> 17 per arm, d = 0.5 -> 64
    assert seeds_needed(1.0, 1.0) == 17 and seeds_needed(0.5, 1.0) == 64
    assert power(17, 1.0, 1.0) >= 0.8 > power(16, 1.0, 1.0)
    assert seeds_needed(5.0, 0.1) == 2


def test_best_candidates_excludes_stopped_unless_only():
    done, cut = SimpleNamespace(tags={}), SimpleNamespace(tags=stopped_early_tags(2, 1.5))
    assert best_candidates([cut, done]) == [done]
    assert best_candidates([cut]) == [cut]
    assert stopped_early_tags(2, 1.23456789) == {"a2.stopped_early": "true", "a2.stopped_rung": "2",
                                                  "a2.stopped_cutoff": "1.23457"}
