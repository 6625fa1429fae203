"""The numbers behind every comparison a2tune prints: seed means with 95% intervals, differences between two
configurations with a paired bootstrap interval, a plain-words verdict, and the seeds a study needs (power).

`compare_arms` is the one function that compare, report and leaderboard call: give it the arms (a configuration
with one entry of metrics per seed, and optionally its per-image CIDEr-D per seed) and it returns every row's
intervals and every arm's difference to the baseline. All scores are on the x100 scale.

Why these intervals
-------------------
- One configuration over seeds (`seed_interval`): a Student t-interval, mean +- t(0.975, n-1) * sd / sqrt(n).
  Studies run 3-10 seeds; at such n a bootstrap percentile interval is too narrow (with 3 seeds it has 10
  distinct resamples; over 400 simulated normal studies `scipy.stats.bootstrap` covered the mean 76% of the time
  at 3 seeds, 82% at 5 and 92% at 10), while the t-interval is exact for normal seed noise
  (tests/test_stats.py checks 92-98% at 3, 5 and 10 seeds). Below 3 seeds there is no interval: two
  seeds give a t-interval 12.7 standard errors wide that says nothing, and one seed gives no spread at all.
- Two configurations (`paired_difference`): every seed of both arms is scored on the same test images, so the
  images are a crossed factor that the difference must be paired over. `scipy.stats.bootstrap` resamples three
  index samples at once: the seeds of arm A, the seeds of arm B (independently: seed k of A and seed k of B are
  different models) and the images (one draw shared by both arms and every seed, which keeps the pairing and
  the correlation of one image across seeds). The statistic is mean(A[seeds_a][:, images]) - mean(B[...]);
  the interval is the bootstrap percentile interval. An arm with one seed keeps it fixed (nothing to resample).
- Without per-image scores (`seed_difference`): Welch's t-interval of the difference of the two seed means.

Early-stopped runs: `stopped_early_tags` is what the MLflow callback tags a scheduler-stopped trial with, and
`best_candidates` is the one rule for "best": runs that were stopped early are left out unless nothing else is left.

`seeds_needed` answers "how many seeds per arm resolve a difference delta" for a two-sided Welch/t test at
alpha = 0.05 with 80% power, from the noncentral t distribution (exact for normal seed noise).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from scipy import stats as sps

CONFIDENCE = 0.95
POWER = 0.80
MIN_SEEDS = 3  # fewer seeds: no interval (see the module docstring)
N_RESAMPLES = 4999

# MLflow tags of trial runs (set by launch.mlflow_callback)
TAG_CONFIG_HASH = "a2.config_hash"  # the replicate group: the trial's config without its seed
TAG_STOPPED_EARLY = "a2.stopped_early"
TAG_STOPPED_RUNG = "a2.stopped_rung"
TAG_STOPPED_CUTOFF = "a2.stopped_cutoff"


def stopped_early_tags(rung: int, cutoff: float) -> dict[str, str]:
    return {TAG_STOPPED_EARLY: "true", TAG_STOPPED_RUNG: str(int(rung)), TAG_STOPPED_CUTOFF: f"{cutoff:.6g}"}


def is_stopped_early(tags: dict) -> bool:
    return str(tags.get(TAG_STOPPED_EARLY, "")).lower() == "true"


def stopped_early_text(info: dict) -> str:
    """"stopped early (rung 2, cutoff 105.3)" from the tags of a stopped run, or the scheduler's record
    (`{"rung", "cutoff"}`)."""
    rung, cutoff = info.get(TAG_STOPPED_RUNG, info.get("rung")), info.get(TAG_STOPPED_CUTOFF, info.get("cutoff"))
    try:
        cutoff = f"{float(cutoff):.1f}"
    except (TypeError, ValueError):
        cutoff = "?"
    return f"stopped early (rung {rung if rung is not None else '?'}, cutoff {cutoff})"


def best_candidates(items: Sequence, tags_of=lambda item: item.tags) -> list:
    """The items (runs, or groups of runs) that may be called "best": those not stopped early, unless every one
    was (then all of them, so a study whose every trial was cut still has a best)."""
    finished = [x for x in items if not is_stopped_early(tags_of(x))]
    return finished or list(items)


# -- one configuration ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Interval:
    """Mean of n seeds with its 95% t-interval; `low`/`high` are None below MIN_SEEDS seeds."""
    mean: float
    low: float | None
    high: float | None
    n: int
    sd: float | None  # sample standard deviation over seeds (None for one seed)

    @property
    def half_width(self) -> float | None:
        return None if self.low is None else (self.high - self.low) / 2

    def text(self, digits: int = 1) -> str:
        """`112.3 [110.1, 114.5]` or `112.3 (2 seeds: no interval)`."""
        if self.low is None:
            return f"{self.mean:.{digits}f} ({self.n} seed{'s' if self.n != 1 else ''}: no interval)"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def seed_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean and t-interval of one metric over the seeds of one configuration (NaNs dropped)."""
    x = np.asarray([v for v in values if v is not None], dtype=float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        raise ValueError("no finite value to summarise")
    mean = float(x.mean())
    sd = float(x.std(ddof=1)) if x.size > 1 else None
    if x.size < MIN_SEEDS:
        return Interval(mean, None, None, int(x.size), sd)
    if sd == 0:  # every seed gave the same value
        return Interval(mean, mean, mean, int(x.size), sd)
    low, high = sps.t.interval(confidence, df=x.size - 1, loc=mean, scale=sd / math.sqrt(x.size))
    return Interval(mean, float(low), float(high), int(x.size), sd)


def pooled_sd(groups: Sequence[Sequence[float]]) -> float | None:
    """The within-configuration seed spread pooled over configurations: sqrt(sum (n_i-1) s_i^2 / sum (n_i-1))."""
    num = den = 0.0
    for g in groups:
        x = np.asarray(g, dtype=float)
        x = x[np.isfinite(x)]
        if x.size > 1:
            num += float(((x - x.mean()) ** 2).sum())
            den += x.size - 1
    return math.sqrt(num / den) if den > 0 else None


# -- two configurations --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Difference:
    """mean(A) - mean(B) with its 95% interval; `better` is +1 when higher scores are better, -1 otherwise."""
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

    @property
    def resolved(self) -> bool:
        return self.low is not None and (self.low > 0 or self.high < 0)

    def size_text(self) -> str:
        seeds = f"{self.seeds_a} seeds" if self.seeds_a == self.seeds_b else f"{self.seeds_a}+{self.seeds_b} seeds"
        return f"{seeds} x {self.images} images" if self.images else f"{seeds}, seed means only"

    def interval_text(self, digits: int = 1) -> str:
        if self.low is None:
            return f"{self.delta:+.{digits}f} {self.metric} (no interval)"
        return f"{self.delta:+.{digits}f} {self.metric} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"

    def verdict(self, digits: int = 1) -> str:
        """"gate beats none by 3.1 CIDEr [1.2, 5.0], 3 seeds x 500 images" or "... no difference resolved ..."."""
        if not self.resolved:
            why = "no interval below 3 seeds per arm" if self.low is None else "no difference resolved at this size"
            return f"{self.a} vs {self.b}: {why} ({self.interval_text(digits)}, {self.size_text()})"
        wins = (self.delta > 0) == (self.better > 0)
        d, lo, hi = (abs(self.delta), *sorted((abs(self.low), abs(self.high))))
        return (f"{self.a} {'beats' if wins else 'trails'} {self.b} by {d:.{digits}f} {self.metric} "
                f"[{lo:.{digits}f}, {hi:.{digits}f}], {self.size_text()}")


def paired_difference(a: np.ndarray, b: np.ndarray, names: tuple[str, str] = ("A", "B"), *, metric: str = "CIDEr",
                      better: int = 1, n_resamples: int = N_RESAMPLES, seed: int = 0) -> Difference:
    """mean(a) - mean(b) with a bootstrap interval over seeds and (paired) images; see the module docstring.

    a: (seeds_a, images) per-image scores of arm A, b: (seeds_b, images), the same images in the same order.
    """
    a, b = np.atleast_2d(np.asarray(a, dtype=float)), np.atleast_2d(np.asarray(b, dtype=float))
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"arms scored on different image sets: {a.shape[1]} vs {b.shape[1]} images")
    n_img = a.shape[1]
    if n_img < 2:
        raise ValueError("a paired bootstrap needs at least 2 images")
    delta = float(a.mean() - b.mean())
    # Index samples for scipy to resample: an arm with one seed keeps it fixed (scipy needs >= 2 observations).
    samples = [np.arange(n) for n in (a.shape[0], b.shape[0]) if n > 1] + [np.arange(n_img)]
    resampled = [a.shape[0] > 1, b.shape[0] > 1]

    def statistic(*idx, axis=-1):
        idx = list(idx)
        ia = idx.pop(0) if resampled[0] else np.zeros(idx[-1].shape[:-1] + (1,), dtype=int)
        ib = idx.pop(0) if resampled[1] else np.zeros(idx[-1].shape[:-1] + (1,), dtype=int)
        (ii,) = idx
        per_image = a[ia].mean(axis=-2) - b[ib].mean(axis=-2)  # (..., images): seed-mean difference per image
        return np.take_along_axis(per_image, ii, axis=-1).mean(axis=-1)  # (...,)

    res = sps.bootstrap(samples, statistic, n_resamples=n_resamples, vectorized=True, axis=-1, batch=200,
                        method="percentile", confidence_level=CONFIDENCE, rng=np.random.default_rng(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return Difference(names[0], names[1], delta, low, high, a.shape[0], b.shape[0], n_img, metric, better)


def seed_difference(a: Sequence[float], b: Sequence[float], names: tuple[str, str] = ("A", "B"), *,
                    metric: str = "CIDEr", better: int = 1) -> Difference:
    """mean(a) - mean(b) over seeds with Welch's t-interval (no interval below MIN_SEEDS seeds in an arm)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    delta = float(x.mean() - y.mean())
    low = high = None
    if min(x.size, y.size) >= MIN_SEEDS:
        if x.std() == 0 and y.std() == 0:
            low = high = delta
        else:
            ci = sps.ttest_ind(x, y, equal_var=False).confidence_interval(CONFIDENCE)
            low, high = float(ci.low), float(ci.high)
    return Difference(names[0], names[1], delta, low, high, int(x.size), int(y.size), None, metric, better)


# -- the one summary that tables use ------------------------------------------------------------------------------
@dataclass
class Arm:
    """One configuration: one dict of metrics per seed; optionally per-image scores (seeds, images) of `metric`."""
    label: str
    seeds: list[dict[str, float]]
    per_image: np.ndarray | None = None


@dataclass
class Comparison:
    rows: list[tuple[Arm, dict[str, Interval]]]  # every arm with an Interval per metric it logged
    differences: dict[str, Difference] = field(default_factory=dict)  # arm label -> difference to the baseline
    baseline: str | None = None

    def verdicts(self) -> list[str]:
        return [d.verdict() for d in self.differences.values()]


def compare_arms(arms: Sequence[Arm], baseline: str | None = None, metric: str = "val/CIDEr", mode: str = "max",
                 metrics: Sequence[str] | None = None, seed: int = 0) -> Comparison:
    """Intervals per arm and metric, and each arm's difference to `baseline` in `metric`.

    The difference is the paired bootstrap over seeds and images when both arms carry per-image scores of the
    same images, else Welch's t over seed means.
    """
    rows = []
    for arm in arms:
        keys = metrics if metrics is not None else sorted({k for s in arm.seeds for k in s})
        intervals = {}
        for k in keys:
            values = [s[k] for s in arm.seeds if s.get(k) is not None and math.isfinite(s[k])]
            if values:
                intervals[k] = seed_interval(values)
        rows.append((arm, intervals))
    out = Comparison(rows, baseline=baseline)
    base = next((arm for arm in arms if arm.label == baseline), None)
    if base is None:
        return out
    short = metric.rsplit("/", 1)[-1]
    better = 1 if mode == "max" else -1
    for arm in arms:
        if arm is base:
            continue
        names = (arm.label, base.label)
        if (arm.per_image is not None and base.per_image is not None
                and np.shape(arm.per_image)[-1] == np.shape(base.per_image)[-1]):
            out.differences[arm.label] = paired_difference(arm.per_image, base.per_image, names, metric=short,
                                                           better=better, seed=seed)
        else:
            x = [s[metric] for s in arm.seeds if s.get(metric) is not None]
            y = [s[metric] for s in base.seeds if s.get(metric) is not None]
            if x and y:
                out.differences[arm.label] = seed_difference(x, y, names, metric=short, better=better)
    return out


# -- power ---------------------------------------------------------------------------------------------------------
def power(n: int, delta: float, sd: float, alpha: float = 1 - CONFIDENCE) -> float:
    """Power of a two-sided two-sample t test with n seeds per arm to detect a true difference `delta`."""
    if n < 2:
        return 0.0
    df = 2 * n - 2
    nc = abs(delta) / (sd * math.sqrt(2.0 / n))
    t = sps.t.ppf(1 - alpha / 2, df)
    return float(sps.nct.sf(t, df, nc) + sps.nct.cdf(-t, df, nc))


def seeds_needed(delta: float, sd: float, target: float = POWER, alpha: float = 1 - CONFIDENCE,
                 limit: int = 100_000) -> int:
    """The fewest seeds per arm whose t test resolves `delta` with `target` power (at least 2)."""
    if sd <= 0:
        return 2
    if delta == 0:
        raise ValueError("a difference of 0 cannot be resolved")
    # the normal-approximation answer is a lower bound of the t answer: start there and walk up
    z = sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(target)
    n = max(2, math.floor(2 * (z * sd / delta) ** 2))
    while power(n, delta, sd, alpha) < target:
        n += 1
        if n > limit:
            raise ValueError(f"more than {limit} seeds per arm")
    return n
