"""The numbers behind every comparison a2tune prints (x100 scores): seed means with 95% intervals, differences of
two configurations with their interval and a plain-words verdict, the seeds a study needs, and which runs may be
called "best". `compare_arms` is the one entry point of compare, report, status and leaderboard; the README's
"Intervals" says why each method was chosen and the coverage it was measured to hold.

The verdict rule (`difference_intervals`, vectorised over simulated studies so that the calibration tests and
`power` run the very rule that `compare_arms` prints):
- fewer than MIN_SEEDS seeds in an arm: the difference, no interval, no verdict (one seed measures no seed noise);
- an arm whose seeds all scored the same: no interval, no verdict, and a warning that the seed changes nothing;
- else the expanded percentile bootstrap over each arm's seeds and the shared images (matched by image id),
  widened to Welch's t-interval over the seed means where that is wider (seed means only: Welch's t alone).
MIN_SEEDS = 2 is where this keeps its 95%: tests/test_calibration.py measures it at 1, 2, 3, 5 and 10 seeds.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
from scipy import stats as sps

from a2core.errors import DataError
from dashboards.tables import finite

CONFIDENCE = 0.95
POWER = 0.80
MIN_SEEDS = 2  # seeds per arm from which an interval holds its 95% (tests/test_calibration.py)
N_RESAMPLES = 4999

# MLflow tags of trial runs (set by launch.mlflow_export)
TAG_CONFIG_HASH = "a2.config_hash"  # the replicate group: `config_hash` of the trial's resolved config
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


def canonical_config(config: Mapping) -> dict:
    """What the replicates of one configuration share: the resolved a2core config (`StudySpec.trial_config`, only
    the keys that apply to it) without `train.seed` (the replicate), `output_dir` (where a plain run writes), the
    diagnostics settings `train.diag_*` and the end-of-run test settings `train.test_*` (they read the model and
    leave training alone)."""
    out = copy.deepcopy(dict(config))
    out.pop("output_dir", None)
    if isinstance(out.get("train"), dict):
        out["train"] = {k: v for k, v in out["train"].items()
                        if k != "seed" and not k.startswith(("diag_", "test_")) and LATER_KEYS.get(k, out) != v}
    return out


# train keys added after studies had run, with the value every earlier run had (the key's default): left out at
# that value, so a configuration saved before them keeps its hash (its replicate group, its leaderboard entry)
LATER_KEYS = {"batch_layout": "images", "scst_candidates": "sample"}


def config_hash(config: Mapping) -> str:
    """The id of a replicate group, the one value of the `a2.config_hash` tag, of `replicate_groups` in a study's
    summary, of the scheduler's groups and of the leaderboard: sha256 hex of the canonical JSON of
    `canonical_config(resolved config)`. Two suggestions whose resolved configs agree are one configuration (a
    sampled key that does not apply to it changes nothing); the searcher never hands out one twice."""
    text = json.dumps(canonical_config(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def short_hash(digest: str) -> str:
    """The first 12 hex digits of a config hash, as tables show it."""
    return str(digest)[:12]


def best_group(groups: Sequence, values_of: Callable, mode: str = "max",
               stopped_of: Callable | None = None):
    """The one rule for "the best configuration" (status, summary.json, compare, report, package, pipeline): the
    group with the best mean of `values_of(group)` among the groups not stopped early (`stopped_of(group)`: any
    of its replicates was), unless every one was; the first of equal means. None when no group has a value."""
    def stopped_tags(group) -> dict:
        return stopped_early_tags(0, math.nan) if stopped_of is not None and stopped_of(group) else {}

    scored = [(g, _finite(values_of(g))) for g in groups]
    scored = [(g, float(v.mean())) for g, v in scored if v.size]
    if not scored:
        return None
    kept = best_candidates(scored, tags_of=lambda item: stopped_tags(item[0]))
    sign = 1 if mode == "max" else -1
    return max(kept, key=lambda item: sign * item[1])[0]


def best_candidates(items: Sequence, tags_of=lambda item: item.tags) -> list:
    """The items (runs, or groups of runs) that may be called "best": those not stopped early, unless every one
    was (then all of them, so a study whose every trial was cut still has a best)."""
    finished = [x for x in items if not is_stopped_early(tags_of(x))]
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
    if sd == 0:  # every seed gave the same value: the seed changes nothing, no spread to build an interval on
        return Interval(mean, None, None, x.size, identical=True)
    low, high = sps.t.interval(confidence, df=x.size - 1, loc=mean, scale=sd / math.sqrt(x.size))
    return Interval(mean, float(low), float(high), x.size)


def pooled_sd(groups: Sequence[Sequence[float]]) -> float | None:
    """The within-configuration seed spread pooled over configurations: sqrt(sum (n_i-1) s_i^2 / sum (n_i-1))."""
    groups = [x for x in map(_finite, groups) if x.size > 1]
    dof = sum(x.size - 1 for x in groups)
    return math.sqrt(sum(float(((x - x.mean()) ** 2).sum()) for x in groups) / dof) if dof else None


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

    @property
    def resolved(self) -> bool:
        return self.low is not None and (self.low > 0 or self.high < 0)

    def size_text(self) -> str:
        if self.members:
            seeds = f"{self.seeds_b} member seed{'s' if self.seeds_b != 1 else ''}"
            return f"{seeds} x {self.images} images" if self.images else f"{seeds}, seed means only"
        if self.seeds_a == self.seeds_b:
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
        if not self.resolved:
            return (f"{self.a} vs {self.b}: no difference resolved at this size "
                    f"({self.interval_text(digits)}, {self.size_text()})")
        wins = (self.delta > 0) == (self.better > 0)
        d, lo, hi = (abs(self.delta), *sorted((abs(self.low), abs(self.high))))
        return (f"{self.a} {'beats' if wins else 'trails'} {self.b} by {d:.{digits}f} {self.metric} "
                f"[{lo:.{digits}f}, {hi:.{digits}f}], {self.size_text()}")


def _resampling_weights(rng: np.random.Generator, n: int, n_resamples: int) -> np.ndarray:
    """(n_resamples, n) bootstrap weights: how often each of n items is drawn, over n (rows sum to 1)."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=n_resamples) / n


def _constant_over_seeds(x: np.ndarray) -> np.ndarray:
    """(studies,) True where every seed of an arm (studies, seeds[, images]) scored the same (needs >= 2 seeds)."""
    if x.shape[1] < 2:
        return np.zeros(x.shape[0], dtype=bool)
    spread = np.ptp(x, axis=1)
    return spread.reshape(x.shape[0], -1).max(axis=1) == 0


def difference_intervals(a: np.ndarray, b: np.ndarray, *, n_resamples: int = N_RESAMPLES, seed: int = 0,
                         confidence: float = CONFIDENCE, fixed_a: bool = False) -> dict[str, np.ndarray]:
    """The verdict rule, for many studies at once: mean(A) - mean(B) of each study with its 95% interval.

    a: (studies, seeds_a, images) per-image scores of arm A and b: (studies, seeds_b, images) of arm B, the same
    images in the same order; or (studies, seeds) seed values (seed means only). Returns `delta`, `low`, `high`
    (NaN where the rule gives no interval) and `identical_a`, `identical_b` (an arm whose seeds all scored the
    same), each of shape (studies,).
    The bootstrap resamples each arm's seeds and the shared images with one set of weights for all studies (each
    study on its own sees an ordinary bootstrap); an arm of one seed keeps it.
    `fixed_a`: A is one fixed system built from B's seeds (an ensemble of them), not a seed replicate: only B needs
    MIN_SEEDS seeds, and the seed part of the interval is B's seed spread (Welch with A's variance 0 is the
    one-sample t-interval, n_B - 1 degrees of freedom).
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.ndim != b.ndim or a.ndim not in (2, 3) or a.shape[0] != b.shape[0]:
        raise ValueError(f"arms of shapes {a.shape} and {b.shape}: need (studies, seeds[, images]) each")
    per_image = a.ndim == 3
    if per_image and a.shape[2] != b.shape[2]:
        raise ValueError(f"arms scored on different image sets: {a.shape[2]} vs {b.shape[2]} images")
    if per_image and a.shape[2] < 2:
        raise ValueError("a paired bootstrap needs at least 2 images")
    seeds_a, seeds_b = a.shape[1], b.shape[1]
    means_a, means_b = (x.mean(axis=2) if per_image else x for x in (a, b))  # (studies, seeds) seed means
    delta = means_a.mean(axis=1) - means_b.mean(axis=1)
    identical_a, identical_b = _constant_over_seeds(a), _constant_over_seeds(b)
    if fixed_a:
        if seeds_a != 1:
            raise ValueError(f"a fixed system is one row, got {seeds_a}")
        seeds_a = MIN_SEEDS  # no seed requirement on A; its variance is taken as 0 below
    low = np.full(delta.shape, np.nan)
    high = np.full(delta.shape, np.nan)
    ok = ~(identical_a | identical_b)
    if min(seeds_a, seeds_b) < MIN_SEEDS or not ok.any():
        return dict(delta=delta, low=low, high=high, identical_a=identical_a, identical_b=identical_b)
    # Welch's t-interval over the seed means: it holds its 95% for the seed noise from 2 seeds per arm
    va, vb = (x.var(axis=1, ddof=1) / x.shape[1] if x.shape[1] > 1 else np.zeros(len(x))
              for x in (means_a, means_b))  # squared standard errors
    se2 = va + vb
    with np.errstate(divide="ignore", invalid="ignore"):
        df = se2 ** 2 / (va ** 2 / (seeds_a - 1) + vb ** 2 / (seeds_b - 1))
        half = sps.t.ppf(0.5 + confidence / 2, np.where(ok, df, 1.0)) * np.sqrt(se2)
    low, high = delta - half, delta + half
    if per_image:
        # percentile bootstrap over seeds and images: statistic[k, r] = wa[r] @ a[k] @ v[r] - wb[r] @ b[k] @ v[r]
        rng = np.random.default_rng(seed)
        v = _resampling_weights(rng, a.shape[2], n_resamples)  # (R, images)
        wa, wb = (_resampling_weights(rng, x.shape[1], n_resamples) for x in (a, b))  # (R, seeds)
        stat = (np.einsum("ksr,rs->kr", np.einsum("ksi,ri->ksr", a, v), wa)
                - np.einsum("ksr,rs->kr", np.einsum("ksi,ri->ksr", b, v), wb))  # (studies, R)
        # the expanded percentile interval (Hesterberg): a plain percentile interval over m images is too narrow
        # by about sqrt((m-1)/m) and z for t; the tails are moved so that it is as wide as the t-interval
        m = a.shape[2]
        tail = sps.norm.cdf(-math.sqrt(m / (m - 1)) * sps.t.ppf(0.5 + confidence / 2, m - 1))
        boot_low, boot_high = np.quantile(stat, [tail, 1 - tail], axis=1)
        low, high = np.minimum(low, boot_low), np.maximum(high, boot_high)
    low, high = np.where(ok, low, np.nan), np.where(ok, high, np.nan)
    return dict(delta=delta, low=low, high=high, identical_a=identical_a, identical_b=identical_b)


def _difference(a: np.ndarray, b: np.ndarray, names: tuple[str, str], images: int | None, metric: str,
                better: int, **options) -> Difference:
    """One study through `difference_intervals` as a `Difference`."""
    out = difference_intervals(a[None], b[None], **options)
    low, high = float(out["low"][0]), float(out["high"][0])
    identical = tuple(name for name, flag in zip(names, (out["identical_a"][0], out["identical_b"][0])) if flag)
    return Difference(*names, float(out["delta"][0]), None if math.isnan(low) else low,
                      None if math.isnan(high) else high, a.shape[0], b.shape[0], images, metric, better, identical)


def paired_difference(a: np.ndarray, b: np.ndarray, names: tuple[str, str] = ("A", "B"), *, metric: str = "CIDEr",
                      better: int = 1, n_resamples: int = N_RESAMPLES, seed: int = 0) -> Difference:
    """mean(a) - mean(b) with a bootstrap interval over each arm's seeds and the (shared) images, widened to
    Welch's t over the seed means (`difference_intervals`).

    a: (seeds_a, images) per-image scores of arm A, b: (seeds_b, images), the same images in the same order.
    """
    arms = [np.atleast_2d(np.asarray(x, dtype=float)) for x in (a, b)]
    return _difference(*arms, names, arms[0].shape[1], metric, better, n_resamples=n_resamples, seed=seed)


def seed_difference(a: Sequence[float], b: Sequence[float], names: tuple[str, str] = ("A", "B"), *,
                    metric: str = "CIDEr", better: int = 1) -> Difference:
    """mean(a) - mean(b) over seeds with Welch's t-interval (no interval below MIN_SEEDS seeds in an arm)."""
    x, y = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    return _difference(x, y, names, None, metric, better)


def gain_over_members(system: np.ndarray, members: np.ndarray, names: tuple[str, str] = ("ensemble", "members"),
                      *, metric: str = "CIDEr", n_resamples: int = N_RESAMPLES, seed: int = 0) -> Difference:
    """A system built from seed runs (an ensemble) against the mean of those runs, with the runs' seed spread in
    the interval (`difference_intervals(fixed_a=True)`: the bootstrap over member seeds and images, widened to the
    one-sample t-interval over the members' seed means).

    system: (images,) per-image scores and members: (seeds, images), the same images in the same order; or the
    system's score and the members' (seeds,) scores (seed means only: the one-sample t-interval)."""
    if np.ndim(system) == 0:
        a, b = np.asarray([[system]], dtype=float), np.asarray(members, dtype=float).reshape(1, -1)
        images = None
    else:
        a = np.asarray(system, dtype=float).reshape(1, 1, -1)
        b = np.atleast_2d(np.asarray(members, dtype=float))[None]
        images = b.shape[2]
    out = difference_intervals(a, b, n_resamples=n_resamples, seed=seed, fixed_a=True)
    low, high = float(out["low"][0]), float(out["high"][0])
    return Difference(*names, float(out["delta"][0]), None if math.isnan(low) else low,
                      None if math.isnan(high) else high, 1, b.shape[1], images, metric, 1,
                      (names[1],) if out["identical_b"][0] else (), members=True)


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
        half = float(sps.t.ppf(0.5 + confidence / 2, n - 1) * b.mean(axis=1).std(ddof=1))
        low, high = delta - half, delta + half
        if m > 1:
            v = _resampling_weights(np.random.default_rng(seed), m, n_resamples)  # (R, images)
            tail = sps.norm.cdf(-math.sqrt(m / (m - 1)) * sps.t.ppf(0.5 + confidence / 2, m - 1))
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

    def verdicts(self) -> list[str]:
        return [d.verdict() for d in self.differences.values()]


def compare_arms(arms: Sequence[Arm], baseline: str | None = None, metric: str = "val/CIDEr", mode: str = "max",
                 metrics: Sequence[str] | None = None, seed: int = 0, label: str | None = None) -> Comparison:
    """Intervals per arm and metric, and each arm's difference to `baseline` in `metric`: the paired bootstrap
    (widened to Welch's t) when both arms carry per-image scores, matched by image id, else Welch's t over seed
    means; no interval, and no verdict, below MIN_SEEDS seeds per arm or when an arm's seeds all scored the same.
    `label`: the metric's name in verdicts (default: its last part, "CIDEr")."""
    rows = []
    for arm in arms:
        keys = metrics if metrics is not None else sorted({k for s in arm.seeds for k in s})
        rows.append((arm, {k: seed_interval(arm.values(k)) for k in keys if arm.values(k)}))
    out = Comparison(rows, baseline=baseline, metric=metric)
    base = next((arm for arm in arms if arm.label == baseline), None)
    options = dict(metric=label or metric.rsplit("/", 1)[-1], better=1 if mode == "max" else -1)
    for arm in arms:
        if base is None or arm is base:
            continue
        names = (arm.label, base.label)
        if arm.per_image is not None and base.per_image is not None:
            out.differences[arm.label] = paired_difference(*matched_scores(arm, base), names, seed=seed, **options)
        elif arm.values(metric) and base.values(metric):
            out.differences[arm.label] = seed_difference(arm.values(metric), base.values(metric), names, **options)
    return out


# -- power of the verdict rule -------------------------------------------------------------------------------------
POWER_GRID = 400  # quantiles per sample variance in `power`'s integral


def power(n: int, delta: float, sd: float, alpha: float = 1 - CONFIDENCE) -> float:
    """The probability that `compare_arms`' rule, with n seeds per arm whose seed means spread with sd `sd`, says
    the arm that is truly `delta` better beats the other: its Welch interval (the rule on seed means; per-image
    scores can only widen it) lies entirely on the side of `delta`.

    Exact for normal seed means: the mean difference is N(delta, 2 sd^2 / n) and independent of the two sample
    variances, each sd^2 chi2(n-1)/(n-1); given those, Welch's interval misses 0 on delta's side with probability
    Phi((|delta| - t(df) se) / (sd sqrt(2/n))). That is averaged over a grid of POWER_GRID x POWER_GRID quantiles
    of the two variances (tests/test_calibration.py checks it against a Monte Carlo of `compare_arms`)."""
    if n < MIN_SEEDS or delta == 0:
        return 0.0
    if sd <= 0:
        return 1.0
    q = (np.arange(POWER_GRID) + 0.5) / POWER_GRID
    ratio = sps.chi2.ppf(q, n - 1) / (n - 1)  # s^2 / sd^2 at each quantile
    ca, cb = np.meshgrid(ratio, ratio, indexing="ij")
    se = sd * np.sqrt((ca + cb) / n)  # Welch's standard error of the difference
    df = (n - 1) * (ca + cb) ** 2 / (ca ** 2 + cb ** 2)
    half = sps.t.ppf(1 - alpha / 2, df) * se
    return float(sps.norm.cdf((abs(delta) - half) / (sd * math.sqrt(2.0 / n))).mean())


def seeds_needed(delta: float, sd: float, target: float = POWER, alpha: float = 1 - CONFIDENCE,
                 limit: int = 100_000) -> int:
    """The fewest seeds per arm with which the verdict rule resolves `delta` with `target` power (`power`; at
    least MIN_SEEDS)."""
    if sd <= 0:
        return MIN_SEEDS
    if delta == 0:
        raise ValueError("a difference of 0 cannot be resolved")
    # the normal-approximation answer is a lower bound of the rule's: start there and walk up
    z = sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(target)
    n = max(MIN_SEEDS, math.floor(2 * (z * sd / delta) ** 2))
    while power(n, delta, sd, alpha) < target:
        n += 1
        if n > limit:
            raise ValueError(f"more than {limit} seeds per arm")
    return n
