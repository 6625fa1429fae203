"""The numbers behind every comparison a2tune prints (x100 scores): seed means with 95% intervals, differences of
two configurations with their interval and a plain-words verdict, the seeds a study needs, and which runs may be
called "best". `compare_arms` is the one entry point of compare, report, status and leaderboard; the README's
"Intervals" says why each method was chosen and the coverage it was measured to hold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from scipy import stats as sps

from dashboards.tables import finite

CONFIDENCE = 0.95
POWER = 0.80
MIN_SEEDS = 3
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
    """"stopped early (rung 2, cutoff 105.3)" from a stopped run's tags or the scheduler's `{"rung", "cutoff"}`."""
    rung = info.get(TAG_STOPPED_RUNG, info.get("rung"))
    cutoff = finite(info.get(TAG_STOPPED_CUTOFF, info.get("cutoff")))
    cutoff_text = "?" if cutoff is None else f"{cutoff:.1f}"
    return f"stopped early (rung {'?' if rung is None else rung}, cutoff {cutoff_text})"


def best_candidates(items: Sequence, tags_of=lambda item: item.tags) -> list:
    """The items (runs, or groups of runs) that may be called "best": those not stopped early, unless every one
    was (then all of them, so a study whose every trial was cut still has a best)."""
    finished = [x for x in items if not is_stopped_early(tags_of(x))]
    return finished or list(items)


@dataclass(frozen=True)
class Interval:
    """Mean of n seeds with its 95% t-interval; `low`/`high` are None below MIN_SEEDS seeds."""
    mean: float
    low: float | None
    high: float | None
    n: int

    def text(self, digits: int = 1) -> str:
        """`112.3 [110.1, 114.5]` or `112.3 (2 seeds: no interval)`."""
        if self.low is None:
            return f"{self.mean:.{digits}f} ({self.n} seed{'s' if self.n != 1 else ''}: no interval)"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def _finite(values) -> np.ndarray:
    x = np.asarray([v for v in values if v is not None], dtype=float)
    return x[np.isfinite(x)]


def seed_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean and t-interval of one metric over the seeds of one configuration (None and NaN dropped)."""
    x = _finite(values)
    if x.size == 0:
        raise ValueError("no finite value to summarise")
    mean = float(x.mean())
    if x.size < MIN_SEEDS:
        return Interval(mean, None, None, x.size)
    sd = float(x.std(ddof=1))
    if sd == 0:  # every seed gave the same value
        return Interval(mean, mean, mean, x.size)
    low, high = sps.t.interval(confidence, df=x.size - 1, loc=mean, scale=sd / math.sqrt(x.size))
    return Interval(mean, float(low), float(high), x.size)


def pooled_sd(groups: Sequence[Sequence[float]]) -> float | None:
    """The within-configuration seed spread pooled over configurations: sqrt(sum (n_i-1) s_i^2 / sum (n_i-1))."""
    groups = [x for x in map(_finite, groups) if x.size > 1]
    dof = sum(x.size - 1 for x in groups)
    return math.sqrt(sum(float(((x - x.mean()) ** 2).sum()) for x in groups) / dof) if dof else None


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
        if self.seeds_a == self.seeds_b:
            seeds = f"{self.seeds_a} seed{'s' if self.seeds_a != 1 else ''}"
        else:
            seeds = f"{self.seeds_a}+{self.seeds_b} seeds"
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
    """mean(a) - mean(b) with a bootstrap interval over each arm's seeds and the (shared) images.

    a: (seeds_a, images) per-image scores of arm A, b: (seeds_b, images), the same images in the same order.
    """
    arms = [np.atleast_2d(np.asarray(x, dtype=float)) for x in (a, b)]
    n_img = arms[0].shape[1]
    if arms[1].shape[1] != n_img:
        raise ValueError(f"arms scored on different image sets: {n_img} vs {arms[1].shape[1]} images")
    if n_img < 2:
        raise ValueError("a paired bootstrap needs at least 2 images")
    # Index samples to resample; an arm with one seed keeps it fixed (scipy needs >= 2 observations).
    samples = [np.arange(len(x)) for x in arms if len(x) > 1] + [np.arange(n_img)]

    def statistic(*idx, axis=-1):  # idx: (..., n) index draws, one per sample
        seed_draws = iter(idx[:-1])
        means = [x[next(seed_draws)].mean(axis=-2) if len(x) > 1 else x[0] for x in arms]  # (..., images) each
        images = idx[-1]
        per_image = np.broadcast_to(means[0] - means[1], images.shape)
        return np.take_along_axis(per_image, images, axis=-1).mean(axis=-1)

    res = sps.bootstrap(samples, statistic, n_resamples=n_resamples, vectorized=True, axis=-1, batch=200,
                        method="percentile", confidence_level=CONFIDENCE, rng=np.random.default_rng(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    # Few seeds: a percentile bootstrap over 3-5 seeds is too narrow (README "Intervals"); the interval is at
    # least Welch's t-interval over the seed means, which holds its 95% for the seed noise.
    seedwise = seed_difference(arms[0].mean(axis=1), arms[1].mean(axis=1))
    if seedwise.low is not None:
        low, high = min(low, seedwise.low), max(high, seedwise.high)
    return Difference(*names, float(arms[0].mean() - arms[1].mean()), low, high,
                      len(arms[0]), len(arms[1]), n_img, metric, better)


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
            low, high = map(float, sps.ttest_ind(x, y, equal_var=False).confidence_interval(CONFIDENCE))
    return Difference(*names, delta, low, high, x.size, y.size, None, metric, better)


@dataclass
class Arm:
    """One configuration: one dict of metrics per seed; optionally per-image scores (seeds, images) of `metric`."""
    label: str
    seeds: list[dict[str, float]]
    per_image: np.ndarray | None = None

    def values(self, metric: str) -> list[float]:
        return [s[metric] for s in self.seeds if s.get(metric) is not None and math.isfinite(s[metric])]


@dataclass
class Comparison:
    rows: list[tuple[Arm, dict[str, Interval]]]  # every arm with an Interval per metric it logged
    differences: dict[str, Difference] = field(default_factory=dict)  # arm label -> difference to the baseline
    baseline: str | None = None

    def verdicts(self) -> list[str]:
        return [d.verdict() for d in self.differences.values()]


def compare_arms(arms: Sequence[Arm], baseline: str | None = None, metric: str = "val/CIDEr", mode: str = "max",
                 metrics: Sequence[str] | None = None, seed: int = 0) -> Comparison:
    """Intervals per arm and metric, and each arm's difference to `baseline` in `metric`: the paired bootstrap
    when both arms carry per-image scores of the same images, else Welch's t over seed means."""
    rows = []
    for arm in arms:
        keys = metrics if metrics is not None else sorted({k for s in arm.seeds for k in s})
        rows.append((arm, {k: seed_interval(arm.values(k)) for k in keys if arm.values(k)}))
    out = Comparison(rows, baseline=baseline)
    base = next((arm for arm in arms if arm.label == baseline), None)
    options = dict(metric=metric.rsplit("/", 1)[-1], better=1 if mode == "max" else -1)
    for arm in arms:
        if base is None or arm is base:
            continue
        names = (arm.label, base.label)
        if (arm.per_image is not None and base.per_image is not None
                and np.shape(arm.per_image)[-1] == np.shape(base.per_image)[-1]):
            out.differences[arm.label] = paired_difference(arm.per_image, base.per_image, names, seed=seed,
                                                           **options)
        elif arm.values(metric) and base.values(metric):
            out.differences[arm.label] = seed_difference(arm.values(metric), base.values(metric), names, **options)
    return out


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
    """The fewest seeds per arm whose two-sided t test resolves `delta` with `target` power (at least 2)."""
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
