"""Adaptive replicates: seeds in rounds, spent only where a verdict is still open (docs/explanation/statistics.md,
"Adaptive replicates"). The statistics and the pricing of the design; `launch.adaptive` runs it through the
driver for a study whose `search.replicates` is a range.

A design is its looks, the cumulative seeds per arm after each round (`rounds`, e.g. (3, 5, 7)), and the share of
each comparison's error spent at each look (`weights`, summing to 1). At look r every open arm and the baseline have
rounds[r] seeds, and each open comparison with the baseline gets the verdict rule's p-value p_r
(`dashboards.stats.difference_intervals`, the rule `compare` prints) with one change: the seed part of its standard
error takes the seed variance pooled over every arm that has run seeds so far (`Design.pool_arms`; settled arms'
seeds included, sum of n_i - 1 d.f.: 10 at a first look of 3 seeds x 5 arms, where the pair alone has 4), Student's t
with those d.f., exact under the design's assumption of one seed variance common to the arms. Its sequential p-value
is

    q = min over the looks r taken of p_r / weights[r]

a valid p-value whatever the looks' correlation (P(q <= a) <= sum_r P(p_r <= a w_r) <= a, the union bound over the
looks, each look's rule holding its level). Holm's step-down over the arms' q (`dashboards.stats.holm`) then holds the
family-wise error at alpha, as on one look. An arm is settled, and gets no more seeds, when Holm resolves it, or when
its interval at the last look's confidence already excludes the plan's gap from above: no gap of the plan's size is
left to find (stopping for that never adds a false verdict; it can only lose power, which the simulation counts).
The baseline runs while any arm is open.

`simulate` runs the design, and the fixed one (one look, all seeds), on simulated studies drawn from a `Noise` through
`components_interval` (the rule's formula) and `holm`: the family-wise false rate, each arm's power, the expected
seed-trials. benchmarks/bench_sequential.py prints them for studies/fusion_ablation.yaml's plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dashboards.stats import CONFIDENCE, Noise, components_interval, holm, two_sided_p


@dataclass(frozen=True)
class Design:
    """Looks after `rounds` (cumulative seeds per arm) spending `weights` of each comparison's error; `futility_gap`:
    the plan's gap (x100 scores) below which an arm is settled when its interval excludes it from above (None:
    never); `pool_arms`: each look's comparisons take the seed variance pooled over every arm that has run seeds so
    far (settled arms' seeds included, sum of n_i - 1 d.f.; the design's one common seed variance), else each pair's
    own (`compare`'s rule, the fixed design's)."""
    rounds: tuple[int, ...]
    weights: tuple[float, ...]
    futility_gap: float | None = None
    pool_arms: bool = True

    def __post_init__(self):
        if len(self.rounds) != len(self.weights) or not self.rounds:
            raise ValueError(f"a design needs one weight per look: rounds {self.rounds}, weights {self.weights}")
        if any(b <= a for a, b in zip(self.rounds, self.rounds[1:])) or self.rounds[0] < 2:
            raise ValueError(f"rounds must grow from at least 2 seeds: {self.rounds}")
        if abs(sum(self.weights) - 1) > 1e-9 or min(self.weights) <= 0:
            raise ValueError(f"weights must be positive and sum to 1: {self.weights}")

    @classmethod
    def fixed(cls, seeds: int, pool_arms: bool = False) -> "Design":
        """Every arm every seed, one look: by default `compare`'s rule (each pair's own seed variance)."""
        return cls((seeds,), (1.0,), pool_arms=pool_arms)


def spending_weights(rounds: Sequence[int], rho: float = 1.0) -> tuple[float, ...]:
    """Each look's share of the error by the power spending function f(t) = t^rho of the seeds' fraction t = n / max
    (rho 1: spend in proportion to the seeds; larger rho keeps more for the last look, O'Brien-Fleming-like)."""
    t = np.asarray(rounds, dtype=float) / rounds[-1]
    return tuple(float(w) for w in np.diff(np.concatenate([[0.0], t ** rho])))


def sequential_p(p: np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """(..., looks) p-values of one comparison, NaN where a look was not taken: min over looks of p_r / w_r (<= 1)."""
    w = np.asarray(weights, dtype=float)
    return np.minimum(1.0, np.nanmin(np.where(np.isnan(p), np.inf, p / w), axis=-1))


def simulate(design: Design, noise: Noise, deltas: Sequence[float], configs: Sequence[int] | None = None,
             studies: int = 4_000, rng_seed: int = 0, tails: bool = False,
             alpha: float = 1 - CONFIDENCE, seed_loss: float = 0.0) -> dict:
    """Studies of a baseline and len(deltas) arms (arm i truly deltas[i] better), run by `design`: seeds (normal, or
    Student's t with 3 d.f. at the same sd with `tails`) as each arm's seed means (`Noise.seed_mean_var`), each arm's
    own per-image strengths as its mean over the images (`Noise.image_var` / 2), the per-image statistics the rule
    reads drawn from their distribution (as tests/test_calibration.py's drawn cells), each look through
    `components_interval` (with `design.pool_arms`, the seed variance pooled over every arm's seeds run so far) and
    the family through `holm` on the sequential p-values.
    `seed_loss`: the chance that a seed is lost (errored or diverged), each seed on its own; as the driver does
    (`launch.adaptive.looks_of`), a look takes each arm on its seeds with a value (the rule for unequal seeds), an arm
    or baseline left with fewer than 2 has no p there and stays open, and a lost seed still counts as run. 0 (the
    default): no seed is lost, the plan's assumption.

    Returns: `family_wise` (share of studies with some arm whose true delta is 0 resolved, or any arm resolved on
    the wrong side), `power` (per arm: resolved on its true side), `seeds` (per arm and the baseline, mean seeds run),
    `seed_trials` (mean of sum over arms of configs x seeds; `configs`: configurations per arm, baseline first,
    default 1 each)."""
    if not 0.0 <= seed_loss <= 1.0:
        raise ValueError(f"simulate: seed_loss {seed_loss} is a chance a seed is lost: give one from 0 to 1")
    rng = np.random.default_rng(rng_seed)
    k = len(deltas)
    configs = np.asarray(configs if configs is not None else [1] * (k + 1), dtype=float)
    n_max, m = design.rounds[-1], noise.images
    seed_sd = math.sqrt(noise.seed_mean_var)
    shape = (studies, k + 1, n_max)  # (studies, arms, seeds): baseline first
    seeds = (rng.standard_t(3, shape) * seed_sd / math.sqrt(3.0) if tails  # t(3): variance 3, the same sd, heavy tails
             else rng.normal(0.0, seed_sd, shape))
    image = rng.normal(0.0, math.sqrt(noise.image_var / 2), (studies, k + 1)) if m else np.zeros((studies, k + 1))
    truth = np.concatenate([[0.0], np.asarray(deltas, dtype=float)])
    kept = rng.uniform(size=shape) >= seed_loss if seed_loss else None  # no draw at 0: the same studies as before
    looks = len(design.rounds)
    p = np.full((studies, k, looks), np.nan)
    open_ = np.ones((studies, k), dtype=bool)
    resolved = np.zeros((studies, k), dtype=bool)
    sign = np.zeros((studies, k))
    ran = np.zeros((studies, k + 1))  # seeds each arm ran
    for r, n in enumerate(design.rounds):
        active = open_.any(axis=1)
        ran[:, 1:] = np.where(open_, n, ran[:, 1:])
        ran[:, 0] = np.where(active, n, ran[:, 0])
        look, delta, half = (_look(design, noise, seeds, ran, n, truth + image, rng) if kept is None
                             else _look_with_losses(design, noise, seeds, kept, ran, truth + image, rng))
        p[:, :, r] = np.where(open_, look, np.nan)
        taken = ~np.all(np.isnan(p[:, :, :r + 1]), axis=2)  # an arm with no p yet is no part of Holm's family
        q = np.where(taken, sequential_p(p[:, :, :r + 1], design.weights[:r + 1]), np.nan)
        adjusted, _ = holm(q, alpha)
        newly = open_ & (adjusted < alpha)
        sign = np.where(newly, np.sign(delta), sign)
        resolved |= newly
        open_ &= ~newly
        if design.futility_gap is not None and r < looks - 1:
            # the gap the plan looks for is already excluded from above: nothing of its size left to find
            open_ &= ~(delta + half < design.futility_gap)
    true_sign = np.sign(truth[1:])
    wrong = resolved & ((true_sign == 0) | (sign != true_sign))
    return {"family_wise": float(wrong.any(axis=1).mean()),
            "power": [float(np.mean(resolved[:, i] & (sign[:, i] == true_sign[i]))) if true_sign[i] else None
                      for i in range(k)],
            "seeds": ran.mean(axis=0).tolist(),
            "seed_trials": float((ran * configs).sum(axis=1).mean())}


def _look(design: Design, noise: Noise, seeds: np.ndarray, ran: np.ndarray, n: int, shift: np.ndarray,
          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p, delta, half-width), each (studies, arms), of one look at n seeds an arm, no seed lost."""
    studies, k, n_max = seeds.shape[0], seeds.shape[1] - 1, seeds.shape[2]
    m, run = noise.images, noise.run_sd ** 2
    means = seeds[:, :, :n].mean(axis=2) + shift  # (studies, arms) seed-averaged means
    var = seeds[:, :, :n].var(axis=2, ddof=1) / n  # squared standard errors over seeds
    pooled = None
    if design.pool_arms:  # every arm's seeds run so far, settled arms' included: sum of (n_i - 1) d.f.
        taken = np.arange(n_max) < ran[:, :, None]  # (studies, arms, seeds)
        centred = np.where(taken, seeds - (seeds * taken).sum(axis=2, keepdims=True) / ran[:, :, None], 0.0)
        pooled_df = ran.sum(axis=1) - ran.shape[1]  # (studies,)
        pooled = (((centred ** 2).sum(axis=(1, 2)) / pooled_df)[:, None], pooled_df[:, None])
    delta = means[:, 1:] - means[:, :1]  # (studies, k)
    extra = {}
    if m:  # the per-image statistics: the differences' variance over the images and the arms' residuals
        chi = rng.chisquare(m - 1, (studies, k)) / (m - 1)
        extra = dict(d2=(2 * noise.arm_image_sd ** 2 + 2 * run / n) * chi,
                     ra=run * rng.chisquare((n - 1) * (m - 1), (studies, k)) / ((n - 1) * (m - 1)),
                     rb=run * rng.chisquare((n - 1) * (m - 1), (studies, 1)) / ((n - 1) * (m - 1)))
    half, df, se = components_interval(var[:, 1:], var[:, :1], n, n, m, pooled_seed=pooled, **extra)
    return two_sided_p(delta, se, df), delta, half


def _look_with_losses(design: Design, noise: Noise, seeds: np.ndarray, kept: np.ndarray, ran: np.ndarray,
                      shift: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_look` where only the seeds `kept` (studies, arms, seeds) have a value: each arm on its own count (NaN p and
    half-width where it or the baseline has fewer than 2), the rule called once per pair of counts (its d.f. and
    its choice for unequal seeds take the counts as numbers)."""
    studies, k, n_max = seeds.shape[0], seeds.shape[1] - 1, seeds.shape[2]
    m, run = noise.images, noise.run_sd ** 2
    taken = (np.arange(n_max) < ran[:, :, None]) & kept  # (studies, arms, seeds): run and with a value
    c = taken.sum(axis=2)  # (studies, arms)
    with np.errstate(divide="ignore", invalid="ignore"):
        centred = np.where(taken, seeds - (seeds * taken).sum(axis=2, keepdims=True) / c[:, :, None], 0.0)
        ss = (centred ** 2).sum(axis=2)
        means = (seeds * taken).sum(axis=2) / c + shift
        var = ss / (c - 1) / c
        dof = np.maximum(c - 1, 0).sum(axis=1)  # arms with no seed or one give the pool nothing
        pool = ((ss.sum(axis=1) / dof)[:, None], dof[:, None])
    delta = means[:, 1:] - means[:, :1]
    c_a, c_b = c[:, 1:], np.broadcast_to(c[:, :1], (studies, k))
    extra = {}
    if m:
        df_a, df_b = np.maximum(c_a - 1, 1) * (m - 1), np.maximum(c[:, :1] - 1, 1) * (m - 1)
        extra = dict(chi=rng.chisquare(m - 1, (studies, k)) / (m - 1), ra=run * rng.chisquare(df_a) / df_a,
                     rb=np.broadcast_to(run * rng.chisquare(df_b) / df_b, (studies, k)))
    p, half = np.full((studies, k), np.nan), np.full((studies, k), np.nan)
    for n_a, n_b in set(zip(c_a[(c_a > 1) & (c_b > 1)].tolist(), c_b[(c_a > 1) & (c_b > 1)].tolist())):
        at = (c_a == n_a) & (c_b == n_b)
        parts = {}
        if m:
            parts = dict(d2=(2 * noise.arm_image_sd ** 2 + run / n_a + run / n_b) * extra["chi"][at],
                         ra=extra["ra"][at], rb=extra["rb"][at])
        pooled = (pool[0].repeat(k, 1)[at], pool[1].repeat(k, 1)[at]) if design.pool_arms else None
        h, df, se = components_interval(var[:, 1:][at], np.broadcast_to(var[:, :1], (studies, k))[at], n_a, n_b, m,
                                        pooled_seed=pooled, **parts)
        p[at], half[at] = two_sided_p(delta[at], se, df), h
    return p, delta, half
