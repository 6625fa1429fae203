"""The numbers behind every comparison a2tune prints (x100 scores): seed means with 95% intervals, differences of
two configurations with their interval and a plain-words verdict, the seeds a study needs, and which runs may be
called "best". `compare_arms` is the one entry point of compare, report, status and leaderboard;
docs/explanation/statistics.md says why each method was chosen and the coverage it was measured to hold.

The verdict rule (`difference_intervals`, vectorised over simulated studies; `components_interval` is its
formula, which the calibration tests and `power` run too, so the plan's power is the power of what `compare_arms`
prints):
- fewer than MIN_SEEDS seeds in an arm: the difference, no interval, no verdict (one seed measures no seed noise);
- an arm whose seeds all scored the same: no interval, no verdict, and a warning that the seed changes nothing;
- else a t-interval whose variance is the sum of the difference's components, each counted once: each arm's seed
  means over its seeds, and the arms' own per-image strengths on the shared images (matched by image id) net of
  the runs' per-image noise, with Satterthwaite's degrees of freedom (seed means only: Welch's t); where the arms'
  seeds differ in number, the seed variance pooled over the two arms (Student's t: Welch's d.f. are liberal there);
- the comparisons a study reports with its baseline are one family (`adjust_family`): each verdict is Holm's
  step-down over their p-values, so that some truly equal arm is called different at most 5% of the time; the raw
  interval and p are printed beside the adjusted ones.
It generalises over new seeds and new images from the same distribution. MIN_SEEDS = 2 is where it keeps its 95%:
tests/test_calibration.py measures it from 1 to 10 seeds and 100 to 5,000 images, at unequal seeds (2 vs 3, 2 vs 6,
3 vs 10) and for a family of five equal arms. `dashboards.sequential` runs it in rounds of seeds (adaptive replicates).
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import numpy as np
from scipy import special

from a2core.errors import DataError
from a2core.selection import finite

CONFIDENCE = 0.95
POWER = 0.80
MIN_SEEDS = 2  # seeds per arm from which an interval holds its 95% (tests/test_calibration.py)
N_RESAMPLES = 4999


# The four distribution functions used here, as scipy.stats computes them (`t_gen._ppf`, `_norm_cdf`, `_norm_ppf`,
# `chi2_gen._ppf`, with its argument check: NaN where the degrees of freedom are not positive), from scipy.special:
# importing scipy.stats costs about a second of every `a2 study status`, `compare` and `report`.
# tests/test_stats.py holds them equal to scipy.stats, value for value.
def _t_ppf(q, df):
    df = np.asarray(df, dtype=float)
    return np.where(df > 0, special.stdtrit(np.where(df > 0, df, 1.0), q), np.nan)[()]  # [()]: a scalar as one


def _chi2_ppf(q, df):
    df = np.asarray(df, dtype=float)
    return np.where(df > 0, 2 * special.gammaincinv(np.where(df > 0, df, 2.0) / 2, q), np.nan)[()]


_norm_cdf, _norm_ppf = special.ndtr, special.ndtri


def stopped_early_text(info: dict) -> str:
    """"stopped early (rung 2, cutoff 105.3)" from the scheduler's record `{"rung", "cutoff"}` (`Trial.stopped_early`)."""
    rung, cutoff = info.get("rung"), finite(info.get("cutoff"))
    return f"stopped early (rung {'?' if rung is None else rung}, cutoff {'?' if cutoff is None else f'{cutoff:.1f}'})"


def canonical_config(config: Mapping) -> dict:
    """What the replicates of one configuration share: the resolved a2core config (`StudySpec.trial_config`, only
    the keys that apply to it) without `train.seed` (the replicate), `output_dir` (where a plain run writes), the
    diagnostics settings `train.diag_*` and the end-of-run test settings `train.test_*` (they read the model and
    leave training alone)."""
    return copy.deepcopy(_canonical_view(config))


def _canonical_view(config: Mapping) -> dict:
    """`canonical_config` sharing the values of `config` (for reading only: `config_hash` runs twice a trial on every
    read of a study, where copying the whole config each time was a tenth of `a2 study status` at 1,000 trials)."""
    out = dict(config)
    out.pop("output_dir", None)
    if isinstance(out.get("train"), dict):
        out["train"] = {k: v for k, v in out["train"].items()
                        if k != "seed" and not k.startswith(("diag_", "test_")) and LATER_KEYS.get(k, out) != v}
    return out


# train keys added after studies had run, with the value every earlier run had (the key's default): left out at
# that value, so a configuration saved before them keeps its hash (its replicate group, its leaderboard entry)
LATER_KEYS = {"batch_layout": "images", "scst_candidates": "sample", "select_metric": "val/CIDEr", "select_mode": "max",
              "scst_reward_df": "images"}


def config_hash(config: Mapping) -> str:
    """The id of a replicate group, the one value of the `a2.config_hash` tag, of `replicate_groups` in a study's
    summary, of the scheduler's groups and of the leaderboard: sha256 hex of the canonical JSON of
    `canonical_config(resolved config)`. Two suggestions whose resolved configs agree are one configuration (a
    sampled key that does not apply to it changes nothing); the searcher never hands out one twice."""
    text = json.dumps(_canonical_view(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def short_hash(digest: str) -> str:
    """The first 12 hex digits of a config hash, as tables show it."""
    return str(digest)[:12]


def best_group(groups: Sequence, values_of: Callable, mode: str = "max",
               stopped_of: Callable | None = None):
    """The one rule for "the best configuration" (status, summary.json, compare, report, package, pipeline): the
    group with the best mean of `values_of(group)` among the groups not stopped early (`stopped_of(group)`: any
    of its replicates was), unless every one was; the first of equal means. None when no group has a value."""
    scored = [(g, float(_mean(v))) for g in groups if (v := _finite(values_of(g))).size]
    kept = best_candidates(scored, lambda item: stopped_of is not None and stopped_of(item[0]))
    sign = 1 if mode == "max" else -1
    return max(kept, key=lambda item: sign * item[1], default=(None,))[0]


def best_trial(trials: Sequence, mode: str = "max"):
    """The one rule for "the best trial" (status, summary.json's best, each replicate group's best trial and the
    baseline, package's choice within the best configuration): among the trials (`dashboards.runs.Trial`) with a
    `best_value`, those not stopped early unless every one was (`best_candidates`), the best value in `mode`; of
    equal values the lower (study, trial id) (`trial_rank`), whatever order the trials come in. None when no trial
    has a value."""
    scored = [t for t in trials if t.best_value is not None]
    return min(best_candidates(scored), key=trial_rank(mode), default=None)


def trial_rank(mode: str) -> Callable[..., tuple]:
    """The sort key of `best_trial`'s order, best first: the better `best_value` in `mode`, then the lower (study,
    trial id): Tune's trial ids number a study's trials in the order they were made, and a rule that does not
    depend on the order a caller lists them in names the same trial in the summary and in the package."""
    sign = -1 if mode == "max" else 1
    return lambda t: (sign * t.best_value, t.study, t.trial_id)


def best_candidates(items: Sequence, stopped_of: Callable = lambda trial: bool(trial.stopped_early)) -> list:
    """The items (trials, or groups of trials) that may be called "best": those not stopped early (`stopped_of`; a
    trial's `stopped_early` field by default), unless every one was (then all of them, so a study whose every trial
    was cut still has a best)."""
    finished = [x for x in items if not stopped_of(x)]
    return finished or list(items)


@dataclass(frozen=True)
class Interval:
    """Mean of n seeds with its 95% t-interval; `low`/`high` are None below MIN_SEEDS seeds, and when every seed
    gave the same value (`identical`: the seed changes nothing, so no seed noise was measured)."""
    mean: float
    low: float | None
    high: float | None
    n: int
    identical: bool = False

    def text(self, digits: int = 1) -> str:
        """`112.3 [110.1, 114.5]`, `112.3 (1 seed: no interval)` or `112.3 (3 seeds, all equal: the seed changes
        nothing)`."""
        if self.identical:
            return f"{self.mean:.{digits}f} ({self.n} seeds, all equal: the seed changes nothing)"
        if self.low is None and self.n >= MIN_SEEDS:  # seeds that differ, and yet no interval: its bounds overflow
            return f"{self.mean:.{digits}f} ({_seeds_text(self.n)}: no interval, its bounds are beyond a float's range)"
        if self.low is None:
            return f"{self.mean:.{digits}f} ({_seeds_text(self.n)}: no interval)"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def _finite(values) -> np.ndarray:
    x = np.asarray([v for v in values if v is not None], dtype=float)
    return x[np.isfinite(x)]


def _mean(x: np.ndarray, axis: int | None = None):
    """`x.mean(axis)`, finite wherever the true mean of finite scores is: a sum of scores near the float's limit
    (|score| > ~9e307) overflows to inf (and inf - inf to NaN in a difference), so there the mean of the scores
    scaled by their largest magnitude, scaled back. Everywhere else numpy's own mean, bit for bit."""
    x = np.asarray(x, dtype=float)
    with np.errstate(over="ignore", invalid="ignore"):
        mean = x.mean(axis=axis)
    if x.size == 0 or np.isfinite(mean).all():  # the usual case, checked on the means alone (simulations are large)
        return mean
    bad = ~np.isfinite(mean) & np.isfinite(x).all(axis=axis)
    if not np.any(bad):
        return mean
    scale = np.abs(x).max(axis=axis, keepdims=True)
    scale = np.where(scale > 0, scale, 1.0)
    scaled = (x / scale).mean(axis=axis) * (scale.reshape(np.shape(mean)) if axis is not None else scale.item())
    return np.where(bad, scaled, mean)[()]  # [()]: a scalar as one


def seed_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean and t-interval of one metric over the seeds of one configuration (None, NaN and +-inf dropped: `n`
    counts the finite values, and the tables say "n of N seeds"). The mean is finite for any finite scores; bounds
    beyond a float's range (a spread near 1e308) are no interval (None), never "[-inf, inf]"."""
    x = _finite(values)
    if x.size == 0:
        raise ValueError("no finite value to summarise")
    mean = float(_mean(x))
    if x.size < MIN_SEEDS:
        return Interval(mean, None, None, x.size)
    if x.min() == x.max():  # every seed gave the same value: the seed changes nothing, no spread to build an
        # interval on (not np.ptp: max - min overflows for scores of opposite signs near 1e308)
        # (tested on the values themselves: their sd is not always 0, the mean of equal values being rounded, as
        # 7 x 112.3 or 3 x 0.1 give a mean 1 ulp off and a zero-width "interval"), and its mean is that value
        return Interval(float(x[0]), None, None, x.size, identical=True)
    with np.errstate(over="ignore", under="ignore"):
        sd = float(x.std(ddof=1))
    if not math.isfinite(sd) or sd == 0:
        # squares that overflow (|scores| from about 1e154) or underflow (spreads below about 1e-154, 0 for
        # seeds that differ): the spread of the scaled scores
        scale = float(np.abs(x).max())
        sd = scale * float((x / scale).std(ddof=1))
    scale = sd / math.sqrt(x.size)  # scipy.stats.t.interval(confidence, x.size - 1, loc=mean, scale=scale)
    with np.errstate(over="ignore"):
        low, high = (float(_t_ppf(q, x.size - 1) * scale + mean)
                     for q in ((1.0 - confidence) / 2, (1.0 + confidence) / 2))
    if not (math.isfinite(low) and math.isfinite(high)):  # a bound beyond +-1.8e308: the interval has no value
        return Interval(mean, None, None, x.size)
    return Interval(mean, low, high, x.size)


def pooled_sd(groups: Sequence[Sequence[float]]) -> float | None:
    """The within-configuration seed spread pooled over configurations: sqrt(sum (n_i-1) s_i^2 / sum (n_i-1))."""
    groups = [x for x in map(_finite, groups) if x.size > 1]
    dof = sum(x.size - 1 for x in groups)
    if not dof:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        sd = math.sqrt(sum(float(((x - _mean(x)) ** 2).sum()) for x in groups) / dof)
    if not math.isfinite(sd):  # squares that overflow (scores from about 1e154): the spread of the scaled scores
        scale = max(float(np.abs(x).max()) for x in groups)
        sd = scale * math.sqrt(sum(float(((x / scale - _mean(x / scale)) ** 2).sum()) for x in groups) / dof)
    return sd


def _seeds_text(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}"


@dataclass(frozen=True)
class Difference:
    """mean(A) - mean(B) with its 95% interval; `better` is +1 when higher scores are better, -1 otherwise.
    `low`/`high` are None when the rule gives no interval (`no_verdict_reason` says why); `identical` names the
    arms whose seeds all scored the same."""
    a: str
    b: str
    delta: float
    low: float | None
    high: float | None
    seeds_a: int
    seeds_b: int
    images: int | None  # None: seed means only (no per-image scores)
    metric: str = "CIDEr"
    better: int = 1
    identical: tuple[str, ...] = ()
    members: bool = False  # A is one system built from B's seeds (an ensemble of them): sizes say so
    se: float | None = None  # the estimated sd of the difference, and its Satterthwaite d.f.
    df: float | None = None
    p: float | None = None  # two-sided p of the comparison alone (the raw interval misses 0 when p < 0.05)
    # a study's verdicts are one family (`adjust_family`: Holm over the comparisons with the baseline): their size,
    # this comparison's Holm-adjusted p and its interval at the confidence Holm tested it at (`holm`); family 1 and
    # None: the comparison stands alone
    family: int = 1
    p_adjusted: float | None = None
    low_adjusted: float | None = None
    high_adjusted: float | None = None

    @property
    def raw_resolved(self) -> bool:
        """The comparison's own 95% interval misses 0 (the verdict when it stands alone)."""
        return self.low is not None and (self.low > 0 or self.high < 0)

    @property
    def adjusted(self) -> bool:
        """The verdict is one of a family of several comparisons (Holm-adjusted)."""
        return self.family > 1 and self.p_adjusted is not None

    @property
    def resolved(self) -> bool:
        """The verdict: Holm-adjusted within a study's family of comparisons, else the comparison's own."""
        return self.p_adjusted < 1 - CONFIDENCE if self.adjusted else self.raw_resolved

    def size_text(self) -> str:
        if self.members:
            seeds = f"{self.seeds_b} member seed{'s' if self.seeds_b != 1 else ''}"
        elif self.seeds_a == self.seeds_b:
            seeds = _seeds_text(self.seeds_a)
        else:
            seeds = f"{self.seeds_a}+{self.seeds_b} seeds"
        return f"{seeds} x {self.images} images" if self.images else f"{seeds}, seed means only"

    def interval_text(self, digits: int = 1) -> str:
        if self.low is None:
            return f"{self.delta:+.{digits}f} {self.metric} (no interval)"
        return f"{self.delta:+.{digits}f} {self.metric} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"

    def no_verdict_reason(self) -> str | None:
        """Why the rule gives no interval: "1 seed per arm measures no seed noise", "warning: the seed changes
        nothing in gate (3 seeds, all equal)"; None when there is an interval."""
        if self.low is not None:
            return None
        if self.identical:
            named = " and ".join(self.identical)
            return f"warning: the seed changes nothing in {named} (every seed scored the same)"
        # the seed count is the reason only where it is below MIN_SEEDS (A of `members`, a fixed system, needs none)
        if (self.seeds_b if self.members else min(self.seeds_a, self.seeds_b)) >= MIN_SEEDS:
            return "the scores give no interval (a score that is not a finite number, or no spread at all?)"
        if self.seeds_a == self.seeds_b:
            n = self.seeds_a
            return f"{_seeds_text(n)} per arm measure{'s' if n == 1 else ''} no seed noise"
        few, n = (self.a, self.seeds_a) if self.seeds_a < self.seeds_b else (self.b, self.seeds_b)
        return f"{_seeds_text(n)} of {few} measure{'s' if n == 1 else ''} no seed noise"

    def verdict(self, digits: int = 1) -> str:
        """"gate beats none by 3.1 CIDEr [1.2, 5.0], 3 seeds x 500 images", "... no difference resolved ..." or
        "gate vs none: no verdict: 1 seed per arm measures no seed noise (+12.3 CIDEr, 1 seed x 100 images)"."""
        if self.low is None:
            return (f"{self.a} vs {self.b}: no verdict: {self.no_verdict_reason()} "
                    f"({self.delta:+.{digits}f} {self.metric}, {self.size_text()})")
        # "; raw p 0.001, Holm over 4 comparisons: [+0.8, +5.4], adjusted p 0.004" (or "")
        family = (f"; raw p {p_text(self.p)}, Holm over {self.family} comparisons: [{self.low_adjusted:+.1f}, "
                  f"{self.high_adjusted:+.1f}], adjusted p {p_text(self.p_adjusted)}" if self.adjusted else "")
        if not self.resolved:
            what = ("not resolved once the family's comparisons are counted (alone its interval misses 0)"
                    if self.raw_resolved else "no difference resolved at this size")
            return (f"{self.a} vs {self.b}: {what} "
                    f"({self.interval_text(digits)}, {self.size_text()}{family})")
        wins = (self.delta > 0) == (self.better > 0)
        d, lo, hi = (abs(self.delta), *sorted((abs(self.low), abs(self.high))))
        return (f"{self.a} {'beats' if wins else 'trails'} {self.b} by {d:.{digits}f} {self.metric} "
                f"[{lo:.{digits}f}, {hi:.{digits}f}], {self.size_text()}" + (f" ({family[2:]})" if family else ""))


def p_text(p: float | None) -> str:
    """A p-value as the tables print it ("0.022", "<0.001", "-")."""
    return "-" if p is None else ("<0.001" if p < 0.001 else f"{p:.3f}")


def adjust_family(differences: Mapping[str, "Difference"], alpha: float = 1 - CONFIDENCE) -> dict[str, "Difference"]:
    """A study's comparisons as one family: each `Difference` with its Holm-adjusted p and the interval at the
    confidence Holm tested it at (`holm`), so that the study's verdicts together are wrong (some truly equal arm
    called different) at most `alpha` of the time. Comparisons without an interval (no verdict) are no part of it;
    a family of one is left as it is."""
    tested = [key for key, d in differences.items() if d.p is not None]
    if len(tested) < 2:
        return dict(differences)
    adjusted, confidence = holm(np.asarray([differences[key].p for key in tested]), alpha)
    out = dict(differences)
    for key, p_adj, c in zip(tested, adjusted, confidence):
        d = differences[key]
        half = float(_t_ppf(0.5 + c / 2, d.df)) * d.se
        out[key] = replace(d, family=len(tested), p_adjusted=float(p_adj), low_adjusted=d.delta - half,
                           high_adjusted=d.delta + half)
    return out


def _constant_over_seeds(x: np.ndarray) -> np.ndarray:
    """(studies,) True where every seed of an arm (studies, seeds[, images]) scored the same (needs >= 2 seeds)."""
    if x.shape[1] < 2:
        return np.zeros(x.shape[0], dtype=bool)
    spread = np.ptp(x, axis=1)
    return spread.reshape(x.shape[0], -1).max(axis=1) == 0


def _residual_ms(x: np.ndarray) -> np.ndarray:
    """(studies,) the seed x image residual mean square of an arm (studies, seeds, images): a run's own per-image
    noise (its score on an image less its seed's mean and the arm's mean there), (seeds-1)(images-1) degrees of
    freedom; 0 for one seed (nothing to measure it with)."""
    n, m = x.shape[1:]
    if n < 2:
        return np.zeros(x.shape[0])
    r = x - x.mean(axis=1, keepdims=True) - x.mean(axis=2, keepdims=True) + x.mean(axis=(1, 2), keepdims=True)
    return np.einsum("ksi,ksi->k", r, r) / ((n - 1) * (m - 1))


def components_interval(va: np.ndarray, vb: np.ndarray, n_a: int, n_b: int, images: int | None = None,
                        d2: np.ndarray | float = 0.0, ra: np.ndarray | float = 0.0, rb: np.ndarray | float = 0.0,
                        confidence: float = CONFIDENCE, pooled_seed: tuple | None = None
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(half-width, degrees of freedom, estimated sd of the difference) of the verdict interval, from the
    difference's variance components:

    va, vb: each arm's squared standard error over seeds, s^2(seed means) / n (n - 1 degrees of freedom; a fixed
        arm, `n_a` = 1, has va = 0): a run's shift and the mean of its own per-image noise, as seeds vary;
    d2: the variance over the images of the per-image difference of the seed-averaged arms (images - 1 d.f.);
    ra, rb: each arm's residual mean square (`_residual_ms`), a run's own per-image noise; it is inside d2 as
        ra / n_a + rb / n_b and already counted in va, vb, so it is taken out of d2 once:
    var(A - B) = va + vb + max(0, d2 - ra / n_a - rb / n_b) / images (the last term: the arms' own per-image
    strengths, the images being a sample), with Satterthwaite's degrees of freedom. Seed means only: images None.
    pooled_seed: (s^2 of one seed mean, its d.f.), the seed variance pooled over more arms than the two (an adaptive
        design's look: every arm of the study that has run seeds, sum of n_i - 1 d.f.); it replaces va and vb as
        s^2 / n_a and s^2 / n_b, with its own d.f. for the seed part. None (the default): the two arms' own.
    Vectorised over studies; `power` draws these components and calls this too."""
    va, vb = np.asarray(va, dtype=float), np.asarray(vb, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        s2 = None  # s^2 of one seed mean, where the seed variance is pooled over more than each arm's own seeds
        if pooled_seed is not None:
            # one common seed variance measured over the whole study (Student's t with the pool's d.f., exact
            # for it): the pair's own 2-4 d.f. at a first look of 3 seeds become sum(n_i - 1) over the arms
            s2, seed_dof = (np.asarray(x, dtype=float) for x in pooled_seed)
        elif n_a > 1 and n_b > 1 and n_a != n_b:
            # unequal seeds: Welch's d.f. trust the smaller arm's 1-2 d.f. variance as if the larger arm's seeds
            # measured it too (7.4% false verdicts at 2 vs 6 seeds, 10% at 2 vs 10, 6.5% at 3 vs 10), and no
            # d.f. for the two separate variances holds there (the smaller arm's n - 1, Hsu's, gives 0.01% at
            # 2 vs 6: no power). The seed variance is pooled over the two arms instead (the design's common seed
            # variance, as the plan and the scheduler assume): Student's t, n_a + n_b - 2 d.f., exact for it
            seed_dof = n_a + n_b - 2
            s2 = ((n_a - 1) * n_a * va + (n_b - 1) * n_b * vb) / seed_dof
        if s2 is not None:
            va, vb = s2 / n_a, s2 / n_b
        seed_part = va + vb  # everything that changes with the seed, runs' own per-image noise included
        seed_denom = (seed_part ** 2 / seed_dof if s2 is not None
                      else sum(v ** 2 / (n - 1) for v, n in ((va, n_a), (vb, n_b)) if n > 1))
        seed_df = seed_part ** 2 / seed_denom  # Welch's (Student's for unequal seeds)
        var, denom = seed_part, seed_denom
        if images is not None:
            m = images
            arm_image = np.maximum(d2 - ra / n_a - rb / n_b, 0.0) / m
            var = var + arm_image
            # the arm x image term's own Satterthwaite share (a difference of mean squares; none when it is 0)
            parts = (d2 / m) ** 2 / (m - 1) + sum((r / (n * m)) ** 2 / ((n - 1) * (m - 1))
                                                  for r, n in ((ra, n_a), (rb, n_b)) if n > 1)
            denom = denom + np.where(arm_image > 0, parts, 0.0)
        # never fewer degrees of freedom than the seeds alone give: an image term estimated as a difference of
        # mean squares must not make the seeds count for less
        df = np.fmax(var ** 2 / denom, seed_df)
        if min(n for n in (n_a, n_b) if n > 1) == 2:
            # a seed part of 1 d.f. an arm is often tiny by chance (chi2(1)), and then Satterthwaite's d.f. jump
            # with the image term: 5.9% false verdicts at 2 seeds x 5,000 images. The d.f. grow no faster than
            # the seeds' share of the variance shrinks (3.0-3.8% in tests/test_calibration.py)
            df = np.fmin(df, seed_df * var / seed_part)
        half = _t_ppf(0.5 + confidence / 2, np.where(df > 0, df, 1.0)) * np.sqrt(var)
    return half, df, np.sqrt(var)


def difference_intervals(a: np.ndarray, b: np.ndarray, *, confidence: float = CONFIDENCE,
                         fixed_a: bool = False, pooled_seed: tuple | None = None) -> dict[str, np.ndarray]:
    """The verdict rule, for many studies at once: mean(A) - mean(B) of each study with its 95% interval.

    a: (studies, seeds_a, images) per-image scores of arm A and b: (studies, seeds_b, images) of arm B, the same
    images in the same order; or (studies, seeds) seed values (seed means only). Returns `delta`, `low`, `high`
    (NaN where the rule gives no interval), `se` (the estimated sd of the difference), `df` and `identical_a`,
    `identical_b` (an arm whose seeds all scored the same), each of shape (studies,).
    The interval is `components_interval`'s: each source of variation counted once (the seeds through each arm's
    seed means, the images through the per-image differences net of the runs' own per-image noise), so it
    generalises over new seeds and new images from the same distribution.
    `fixed_a`: A is one fixed system built from B's seeds (an ensemble of them), not a seed replicate: only B needs
    MIN_SEEDS seeds, and A contributes no seed variance (the seed part is B's: the one-sample t-interval).
    `pooled_seed`: (s^2 of one seed mean, its d.f.) pooled over the study's arms, for `components_interval`.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.ndim != b.ndim or a.ndim not in (2, 3) or a.shape[0] != b.shape[0]:
        raise ValueError(f"arms of shapes {a.shape} and {b.shape}: need (studies, seeds[, images]) each")
    per_image = a.ndim == 3
    if per_image and a.shape[2] != b.shape[2]:
        raise ValueError(f"arms scored on different image sets: {a.shape[2]} vs {b.shape[2]} images")
    if per_image and a.shape[2] < 2:
        raise ValueError("per-image scores need at least 2 images")
    seeds_a, seeds_b = a.shape[1], b.shape[1]
    means_a, means_b = (_mean(x, axis=2) if per_image else x for x in (a, b))  # (studies, seeds) seed means
    delta = _mean(means_a, axis=1) - _mean(means_b, axis=1)
    identical_a, identical_b = _constant_over_seeds(a), _constant_over_seeds(b)
    if fixed_a and seeds_a != 1:
        raise ValueError(f"a fixed system is one row, got {seeds_a}")
    nan = np.full(delta.shape, np.nan)
    out = dict(delta=delta, low=nan, high=nan, se=nan, df=nan, p=nan, identical_a=identical_a,
               identical_b=identical_b)
    ok = ~(identical_a | identical_b)
    if min(MIN_SEEDS if fixed_a else seeds_a, seeds_b) < MIN_SEEDS or not ok.any():
        return out
    va, vb = (x.var(axis=1, ddof=1) / x.shape[1] if x.shape[1] > 1 else np.zeros(len(x))
              for x in (means_a, means_b))  # squared standard errors over seeds
    images = a.shape[2] if per_image else None
    extra = {}
    if per_image:
        d = a.mean(axis=1) - b.mean(axis=1)  # (studies, images) the seed-averaged per-image difference
        extra = dict(d2=d.var(axis=1, ddof=1), ra=_residual_ms(a), rb=_residual_ms(b))
    half, df, se = components_interval(va, vb, seeds_a, seeds_b, images, confidence=confidence,
                                       pooled_seed=pooled_seed, **extra)
    out.update(low=np.where(ok, delta - half, np.nan), high=np.where(ok, delta + half, np.nan),
               se=np.where(ok, se, np.nan), df=np.where(ok, df, np.nan),
               p=np.where(ok, two_sided_p(delta, se, df), np.nan))
    return out


def two_sided_p(delta, se, df):
    """The two-sided p-value of a difference `delta` with estimated sd `se` and `df` Satterthwaite d.f.: the interval
    of confidence c misses 0 exactly when p < 1 - c (scipy.stats.t.sf(|delta| / se, df) * 2)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        df = np.asarray(df, dtype=float)
        t = np.abs(np.asarray(delta, dtype=float)) / np.asarray(se, dtype=float)
        return np.where(df > 0, 2 * special.stdtr(np.where(df > 0, df, 1.0), -t), np.nan)[()]


def holm(p: np.ndarray, alpha: float = 1 - CONFIDENCE) -> tuple[np.ndarray, np.ndarray]:
    """Holm's step-down over the last axis of `p` (studies..., comparisons): (the adjusted p-values, the confidence
    each comparison was tested at). NaN entries (no interval, no verdict) are no part of the family.

    With the k p-values in ascending order p_(1) <= ... <= p_(k), the adjusted p_(j) is max_{i<=j} min(1, (k - i + 1)
    p_(i)), and a comparison is resolved when its adjusted p < alpha: every comparison before it in the order was
    resolved at alpha / (k - i + 1) and it at alpha / (k - j + 1). The family-wise error (some comparison of truly
    equal arms resolved) is then <= alpha under any dependence between the comparisons (they share a baseline).
    The confidence returned is 1 - alpha / (k - j + 1) for a resolved comparison and 1 - alpha / (k - s + 1) for the
    others (s: the first one not resolved): the interval at that confidence misses 0 exactly when Holm resolves it."""
    p = np.asarray(p, dtype=float)
    order = np.argsort(np.where(np.isnan(p), np.inf, p), axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=-1)  # NaN last
    k = np.sum(~np.isnan(p), axis=-1, keepdims=True)  # family size per study
    j = np.arange(p.shape[-1])  # 0-based rank
    left = np.maximum(k - j, 1)  # comparisons still in the family at step j
    adjusted = np.fmax.accumulate(np.minimum(1.0, left * ranked), axis=-1)
    adjusted = np.where(np.isnan(ranked), np.nan, adjusted)
    resolved = adjusted < alpha
    first_open = np.argmin(np.where(np.isnan(ranked), False, resolved), axis=-1)[..., None]  # s (0-based)
    first_open = np.where(np.all(resolved | np.isnan(ranked), axis=-1, keepdims=True), k, first_open)
    level = np.where(resolved, alpha / left, alpha / np.maximum(k - first_open, 1))
    confidence = np.where(np.isnan(ranked), np.nan, 1 - level)
    out_p, out_c = np.empty_like(adjusted), np.empty_like(confidence)
    np.put_along_axis(out_p, order, adjusted, axis=-1)
    np.put_along_axis(out_c, order, confidence, axis=-1)
    return out_p, out_c


def _difference(a: np.ndarray, b: np.ndarray, names: tuple[str, str], images: int | None, metric: str,
                better: int, **options) -> Difference:
    """One study through `difference_intervals` as a `Difference`."""
    with np.errstate(over="ignore"):  # an overflowing variance is no interval (below)
        out = {key: float(value[0]) for key, value in difference_intervals(a[None], b[None], **options).items()}
    if not all(math.isfinite(out[key]) for key in ("low", "high", "se")) or out["se"] == 0:
        # NaN where the rule gives none; infinite where the scores' variance overflowed (|scores| from about 1e154):
        # an interval of [-inf, +inf] is no interval, and never a verdict ("not resolved"). A variance of 0 (the
        # seed means of each arm all equal, their per-image scores not, and no arm x image term) measured no noise:
        # its [delta, delta] had no p and no d.f., and was called a win outside the study's family
        out.update(low=math.nan, high=math.nan, se=math.nan, df=math.nan, p=math.nan)
    low, high, se, df, p = (None if math.isnan(out[key]) else out[key] for key in ("low", "high", "se", "df", "p"))
    identical = tuple(name for name, key in zip(names, ("identical_a", "identical_b")) if out[key])
    return Difference(*names, out["delta"], low, high, a.shape[0], b.shape[0], images, metric, better, identical,
                      se=se, df=df, p=p)


def paired_difference(a: np.ndarray, b: np.ndarray, names: tuple[str, str] = ("A", "B"), *, metric: str = "CIDEr",
                      better: int = 1, pooled_seed: tuple[float, float] | None = None) -> Difference:
    """mean(a) - mean(b) with the interval from the difference's variance components over seeds and the (shared)
    images (`difference_intervals`).

    a: (seeds_a, images) per-image scores of arm A, b: (seeds_b, images), the same images in the same order.
    `pooled_seed`: (s^2 of a seed mean, d.f.) pooled over the study's arms (adaptive replicates' looks); None: the
    two arms' own.
    """
    arms = [np.atleast_2d(np.asarray(x, dtype=float)) for x in (a, b)]
    return _difference(*arms, names, arms[0].shape[1], metric, better, pooled_seed=pooled_seed)


def seed_difference(a: Sequence[float], b: Sequence[float], names: tuple[str, str] = ("A", "B"), *,
                    metric: str = "CIDEr", better: int = 1, pooled_seed: tuple[float, float] | None = None
                    ) -> Difference:
    """mean(a) - mean(b) over seeds with Welch's t-interval (no interval below MIN_SEEDS seeds in an arm);
    `pooled_seed` as `paired_difference`'s (Student's t with the pool's d.f.)."""
    x, y = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    return _difference(x, y, names, None, metric, better, pooled_seed=pooled_seed)


def gain_over_members(system: np.ndarray, members: np.ndarray, names: tuple[str, str] = ("ensemble", "members"),
                      *, metric: str = "CIDEr") -> Difference:
    """A system built from seed runs (an ensemble) against the mean of those runs, with the runs' seed spread in
    the interval (`difference_intervals(fixed_a=True)`: the members' seed means, and the images net of the
    members' own per-image noise; seed means only: the one-sample t-interval).

    system: (images,) per-image scores and members: (seeds, images), the same images in the same order; or the
    system's score and the members' (seeds,) scores (seed means only: the one-sample t-interval)."""
    if np.ndim(system) == 0:
        a, b = np.asarray([system], dtype=float), np.asarray(members, dtype=float).ravel()
        images = None
    else:
        a = np.asarray(system, dtype=float).reshape(1, -1)
        b = np.atleast_2d(np.asarray(members, dtype=float))
        images = b.shape[1]
    return replace(_difference(a, b, names, images, metric, 1, fixed_a=True), members=True)


def gain_over_one(system: np.ndarray, members: np.ndarray, index: int, names: tuple[str, str] = ("ensemble", "member"),
                  *, metric: str = "CIDEr", n_resamples: int = N_RESAMPLES, seed: int = 0,
                  confidence: float = CONFIDENCE) -> Difference:
    """A system against ONE of its member runs (`members[index]`, e.g. the one chosen on validation): that member
    is one draw of a seed, so the interval holds the members' seed spread for one run (t(n-1) x their sd), widened
    to the expanded percentile bootstrap over the images of system - member; no interval below MIN_SEEDS members
    or when every member scored the same.

    system: (images,) and members: (seeds, images), the same images in the same order; or the system's score and
    the members' (seeds,) scores (no image part)."""
    a = np.asarray(system, dtype=float).ravel()
    b = np.asarray(members, dtype=float).reshape(len(members), -1)  # (seeds, images or 1)
    n, m = b.shape
    per_image = a - b[index]  # (images,)
    delta = float(per_image.mean())
    identical = bool(_constant_over_seeds(b[None])[0])
    low = high = None
    if n >= MIN_SEEDS and not identical:
        half = float(_t_ppf(0.5 + confidence / 2, n - 1) * b.mean(axis=1).std(ddof=1))
        low, high = delta - half, delta + half
        if m > 1:
            # (R, images) bootstrap weights: how often each image is drawn, over m (rows sum to 1)
            v = np.random.default_rng(seed).multinomial(m, np.full(m, 1.0 / m), size=n_resamples) / m
            tail = _norm_cdf(-math.sqrt(m / (m - 1)) * _t_ppf(0.5 + confidence / 2, m - 1))
            boot_low, boot_high = np.quantile(v @ per_image, [tail, 1 - tail])
            low, high = min(low, float(boot_low)), max(high, float(boot_high))
    return Difference(*names, delta, low, high, 1, n, m if m > 1 else None, metric, 1,
                      (names[1],) if identical else (), members=True)


@dataclass
class Arm:
    """One configuration: one dict of metrics per seed; optionally per-image scores (seeds, images) of `metric`
    with the ids of those images (`image_ids`, one per column: arms are matched by image id, never by position)."""
    label: str
    seeds: list[dict[str, float]]
    per_image: np.ndarray | None = None
    image_ids: Sequence | None = None
    seed_ids: Sequence | None = None  # each entry of `seeds`' seed number, where known (study records keep them)
    trial_ids: Sequence | None = None  # each entry of `seeds`' trial, where known (errors about a seed name it)

    def __post_init__(self):
        if self.per_image is not None:
            self.per_image = np.atleast_2d(np.asarray(self.per_image, dtype=float))
            if self.image_ids is None or len(self.image_ids) != self.per_image.shape[1]:
                raise ValueError(f"arm {self.label}: per-image scores of {self.per_image.shape[1]} images need one "
                                 f"image id per column (got {None if self.image_ids is None else len(self.image_ids)})")
            self.image_ids = [str(i) for i in self.image_ids]
            if len(set(self.image_ids)) != len(self.image_ids):
                raise ValueError(f"arm {self.label}: an image id appears twice among its per-image scores")

    def values(self, metric: str) -> list[float]:
        return [s[metric] for s in self.seeds if s.get(metric) is not None and math.isfinite(s[metric])]


def matched_scores(arm: Arm, base: Arm) -> tuple[np.ndarray, np.ndarray]:
    """Both arms' per-image scores (seeds, images) on the same images in the same order (`arm`'s order); arms
    scored on different images are an error naming both arms and images found in one only."""
    ids, base_ids = arm.image_ids, base.image_ids
    if set(ids) != set(base_ids):
        only_a = sorted(set(ids) - set(base_ids))
        only_b = sorted(set(base_ids) - set(ids))
        raise DataError(f"arms {arm.label} and {base.label} were scored on different images ({len(ids)} and "
                        f"{len(base_ids)} images; only in {arm.label}: {only_a[:5]}, only in {base.label}: "
                        f"{only_b[:5]}): a paired comparison needs the same images")
    position = {image: j for j, image in enumerate(base_ids)}
    return arm.per_image, base.per_image[:, [position[i] for i in ids]]


@dataclass
class Comparison:
    rows: list[tuple[Arm, dict[str, Interval]]]  # every arm with an Interval per metric it logged
    differences: dict[str, Difference] = field(default_factory=dict)  # arm label -> difference to the baseline
    baseline: str | None = None
    metric: str | None = None  # the metric of the differences ("test/CIDEr")
    note: str | None = None  # why it has no differences yet, where that is not plain (confirmation seeds to come)
    pending: tuple[str, ...] = ()  # rows without a verdict until their confirmation seeds have run (the note's)
    selected_by: str = "val/CIDEr"  # the study metric the rows' configurations and checkpoints were chosen by

    def verdicts(self) -> list[str]:
        return [d.verdict() for d in self.differences.values()]


def compare_arms(arms: Sequence[Arm], baseline: str | None = None, metric: str = "val/CIDEr", mode: str = "max",
                 metrics: Sequence[str] | None = None, label: str | None = None) -> Comparison:
    """Intervals per arm and metric, and each arm's difference to `baseline` in `metric`: the interval from its
    variance components over seeds and images (`difference_intervals`) when both arms carry per-image scores,
    matched by image id, else Welch's t over seed means; no interval, and no verdict, below MIN_SEEDS seeds per arm or
    when an arm's seeds all scored the same. The differences are one family: their verdicts are Holm's
    (`adjust_family`).
    `label`: the metric's name in verdicts (default: its last part, "CIDEr")."""
    rows = []
    for arm in arms:
        keys = metrics if metrics is not None else sorted({k for s in arm.seeds for k in s})
        rows.append((arm, {k: seed_interval(arm.values(k)) for k in keys if arm.values(k)}))
    out = Comparison(rows, baseline=baseline, metric=metric)
    base = next((arm for arm in arms if arm.label == baseline), None)
    options = dict(metric=label or metric.rsplit("/", 1)[-1], better=1 if mode == "max" else -1)
    differences = ((arm.label, _arm_difference(arm, base, metric, **options))
                   for arm in arms if base is not None and arm is not base)
    out.differences = adjust_family({k: d for k, d in differences if d is not None})  # the verdicts are one family
    return out


def _arm_difference(arm: Arm, base: Arm, logged: str, **options) -> Difference | None:
    """`compare_arms`' rule for one arm: paired by image id when both arms carry per-image scores, else seed means
    of the metric `logged` (None when either has no value of it)."""
    names = (arm.label, base.label)
    if arm.per_image is not None and base.per_image is not None:
        return paired_difference(*matched_scores(arm, base), names, **options)
    if arm.values(logged) and base.values(logged):
        return seed_difference(arm.values(logged), base.values(logged), names, **options)
    return None


def pooled_differences(comparison: Comparison) -> dict[str, Difference]:
    """Each arm's difference with the baseline as `comparison` has it, its seed part from the seed variance pooled
    over every arm of the comparison (each arm's seed means, the arms' own seeds however many: sum of n_i - 1 d.f.;
    an arm whose seeds all scored the same measures no seed noise and is left out of the pool). The design assumes
    one seed variance common to the arms (as the plan and the scheduler do); under it the pool is the same
    variance measured with more d.f. (Student's t, exact). Unchanged where no pool of more than one arm exists.
    Used by the adaptive design's looks and by confirmation seeds' verdicts (every row the same fresh seeds)."""
    base = next((arm for arm, _ in comparison.rows if arm.label == comparison.baseline), None)
    if base is None:
        return dict(comparison.differences)
    per_image = all(arm.per_image is not None for arm, _ in comparison.rows)  # else every arm's seed values
    seed_means = (arm.per_image.mean(axis=1) if per_image else arm.values(comparison.metric)
                  for arm, _ in comparison.rows)
    groups = [x for x in map(_finite, seed_means) if x.size > 1 and np.ptp(x) > 0]
    sd, dof = pooled_sd(groups), sum(len(g) - 1 for g in groups)
    if sd is None or len(groups) < 2:
        return dict(comparison.differences)
    pooled = (sd ** 2, float(dof))
    return {arm.label: _arm_difference(arm, base, comparison.metric, metric=d.metric, better=d.better,
                                       pooled_seed=pooled)
            for arm, _ in comparison.rows if (d := comparison.differences.get(arm.label)) is not None}


# -- power of the verdict rule -------------------------------------------------------------------------------------
POWER_DRAWS = 40_000  # Latin-hypercube draws of the estimated variance components in `power`'s integral


@dataclass(frozen=True)
class Noise:
    """What the difference of two arms varies with, per arm, x100 scores (`noise_of` measures it in a study):
    seed_sd: a run's shift on every image as the seed changes;
    run_sd: a run's own per-image noise around that shift (which of the references' wordings its captions hit,
        image by image), independent between runs;
    arm_image_sd: an arm's own strength on each image, the same for every seed (the images are a sample of many);
    images: the test images a difference is over; None: seed means only (seed_sd is then a seed mean's sd)."""
    seed_sd: float
    run_sd: float = 0.0
    arm_image_sd: float = 0.0
    images: int | None = None

    @property
    def seed_mean_var(self) -> float:
        """The variance of one run's mean over the images as the seed changes (its shift, and its own noise)."""
        return self.seed_sd ** 2 + (self.run_sd ** 2 / self.images if self.images else 0.0)

    @property
    def image_var(self) -> float:
        """The variance the images add to a difference whatever the seeds: 2 arm_image_sd^2 / images."""
        return 2 * self.arm_image_sd ** 2 / self.images if self.images else 0.0

    def sd_of_difference(self, n: int, n_b: int | None = None) -> float:
        """The true sd of the difference of two arms' means with n seeds each (or n and n_b; 1.96 x it: the oracle
        half-width)."""
        return math.sqrt(self.seed_mean_var * (1 / n + 1 / (n_b or n)) + self.image_var)

    def text(self) -> str:
        """"seed spread sd 1.00", or with images the components ("seed shift sd 0.30, run x image sd 50.0, ...")."""
        image = f"arm x image sd {self.arm_image_sd:.1f} over {self.images:,} images" if self.images else ""
        if not self.run_sd:  # a run's per-image noise is inside the seed spread (not measured apart)
            return f"seed spread sd {self.seed_sd:.2f}" + (f", {image}" if image else "")
        return (f"seed shift sd {self.seed_sd:.2f}, run x image sd {self.run_sd:.1f}, {image} (a seed mean's sd "
                f"{math.sqrt(self.seed_mean_var):.2f})")


def noise_of(groups: Sequence[np.ndarray]) -> Noise:
    """The components measured in a study's configurations scored on the same images: `groups` holds each one's
    (seeds, images) per-image scores, columns in one image order. Run noise: the pooled seed x image residual;
    seed shift: the pooled variance of seed means less the run noise's share (at least 0); arm x image: the
    configuration x image interaction of the seed-averaged scores less the run noise's share (at least 0; needs
    2 configurations). A configuration of one seed measures nothing here."""
    groups = [np.asarray(g, dtype=float) for g in groups if len(g) >= MIN_SEEDS]
    if not groups:
        raise ValueError("no configuration with two seeds: no seed noise to measure")
    m = groups[0].shape[1]
    if any(g.shape[1] != m for g in groups) or m < 2:
        raise ValueError("the configurations' per-image scores are not on one set of 2 or more images")
    dof = [len(g) - 1 for g in groups]
    run = float(sum(d * _residual_ms(g[None])[0] for d, g in zip(dof, groups)) / sum(dof))
    seed_means = sum(d * g.mean(axis=1).var(ddof=1) for d, g in zip(dof, groups)) / sum(dof)
    arm_image = 0.0
    if len(groups) > 1:
        cells = np.stack([g.mean(axis=0) for g in groups])  # (configurations, images)
        interaction = _residual_ms(cells[None])[0]  # configuration x image of the seed-averaged scores
        arm_image = max(0.0, float(interaction - np.mean([run / len(g) for g in groups])))
    return Noise(math.sqrt(max(0.0, float(seed_means) - run / m)), math.sqrt(run), math.sqrt(arm_image), m)


def _noise(noise: float | Noise) -> Noise:
    """A bare number is the seed spread of seed means (no per-image scores: Welch's t)."""
    return noise if isinstance(noise, Noise) else Noise(float(noise))


def power(n: int, delta: float, noise: float | Noise, alpha: float = 1 - CONFIDENCE, family: int = 1,
          n_b: int | None = None) -> float:
    """The probability that `compare_arms`' rule, with n seeds per arm (n and `n_b` where they differ), says the arm
    that is truly `delta` better beats the other: its interval lies entirely on the side of `delta`. `noise`: the
    components (`Noise`, with the number of test images), or a seed means' sd alone (the rule on seed means: Welch's
    t, Student's pooled t for unequal seeds). `family`: the comparisons the study's verdicts are one family of
    (`adjust_family`): the comparison is then tested at alpha / family, Holm's first step, so this is the power of the
    adjusted verdict where no other comparison is resolved, and a lower bound of it otherwise (each resolved one lets
    the rest be tested at a larger level; tests/test_calibration.py measures the gap).

    Under the normal model the difference is N(delta, sd^2) (`Noise.sd_of_difference`) and independent of the
    components the rule estimates, each a scaled chi-square (each arm's seed-mean variance, n - 1 d.f.; the
    per-image differences' variance, images - 1; each arm's residual, (n - 1)(images - 1)); given those, the rule
    resolves delta's side with probability Phi((|delta| - half) / sd), `half` from `components_interval`, the
    formula the rule applies. That is averaged over POWER_DRAWS Latin-hypercube draws of the components (one
    fixed seed: the same answer every time; tests/test_calibration.py checks it against simulated studies)."""
    noise = _noise(noise)
    n_b = n if n_b is None else n_b
    if min(n, n_b) < MIN_SEEDS or delta == 0:
        return 0.0
    sd = noise.sd_of_difference(n, n_b)
    if sd <= 0:
        return 1.0
    rng = np.random.default_rng(0)

    def chi2(df: float) -> np.ndarray:  # POWER_DRAWS stratified draws of chi2(df) / df
        return _chi2_ppf((rng.permutation(POWER_DRAWS) + 0.5) / POWER_DRAWS, df) / df

    m, run = noise.images, noise.run_sd ** 2
    extra = {}
    if m:
        extra = dict(d2=(2 * noise.arm_image_sd ** 2 + run / n + run / n_b) * chi2(m - 1),
                     ra=run * chi2((n - 1) * (m - 1)), rb=run * chi2((n_b - 1) * (m - 1)))
    va, vb = (noise.seed_mean_var / k * chi2(k - 1) for k in (n, n_b))
    half, _, _ = components_interval(va, vb, n, n_b, m, confidence=1 - alpha / family, **extra)
    return float(_norm_cdf((abs(delta) - half) / sd).mean())


def seeds_needed(delta: float, noise: float | Noise, target: float = POWER, alpha: float = 1 - CONFIDENCE,
                 limit: int = 100_000, family: int = 1) -> int | None:
    """The fewest seeds per arm with which the verdict rule resolves `delta` with `target` power (`power`; at
    least MIN_SEEDS); None when no number of seeds does at these images (the images' own variance,
    `Noise.image_var`, stays however many seeds run: more test images are needed) or more than `limit` would."""
    noise = _noise(noise)
    if noise.sd_of_difference(MIN_SEEDS) <= 0:
        return MIN_SEEDS
    if delta == 0:
        raise ValueError("a difference of 0 cannot be resolved")
    # an interval that knew the true sd needs sd <= delta / z; the rule's is wider: start there and walk up
    z = _norm_ppf(1 - alpha / family / 2) + _norm_ppf(target)
    room = (delta / z) ** 2 - noise.image_var
    if room <= 0:
        return None
    n = max(MIN_SEEDS, math.floor(2 * noise.seed_mean_var / room))
    while power(n, delta, noise, alpha, family) < target:
        n += 1
        if n > limit:
            return None
    return n
