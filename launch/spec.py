"""Study files (docs/reference/study-file.md): an a2core config's data / model / train sections plus the study's own, whose
schema is below. `load_study` checks everything before Ray starts (this module never imports ray), including what no
schema field can say alone (`StudySpec._check`), and raises `ConfigError`s naming the dotted key and the file.
"""
from __future__ import annotations

import copy
import itertools
import math
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

from pydantic import (AfterValidator, BeforeValidator, Field, PrivateAttr, ValidationError, ValidationInfo,
                      model_validator)

from a2core.config import (SEED_LIMIT, SELECTABLE, Config, ConfigError, Flag, Integer, Number, Real, Section, Text,
                           applicable_config, apply_overrides, check_batch_split, check_data_kind, config_error,
                           format_value, get_dotted, inapplicable_model_keys, integer, load_yaml, number, set_dotted,
                           set_override, steps_per_epoch)
from a2core.data.captions import read_karpathy, require_splits
from a2core.data.prepared import check_copy, is_prepared
from a2core.data.synthetic import split_sizes
from a2core.errors import DataError, StorageError, folder_instead
from dashboards.tracking import default_tracking_uri, redact_uri
from launch.layout import FUSED_SEEDS_KEY
from launch.placeholders import refuse_placeholder

ALIASES = {"fusion": "model.fusion", "lambda": "model.lambda", "eta": "model.eta", "temperature": "model.temperature",
           "seed": "train.seed"}
DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform", "randint")
SECTIONS = ("data", "model", "train")
SEED_PATH = "train.seed"  # set by the replicate index when search.replicates is given
SEED_KEYS = ("seed", SEED_PATH)  # the seed's space key (alias or path): not part of a configuration
# Keys the space may not control: the scheduler's time budget and the pruning rule depend on the planned epochs.
FIXED_PATHS = ("train.xe_epochs", "train.scst_epochs")
SELECT_PATHS = ("train.select_metric", "train.select_mode")  # search.metric and search.mode set them
# Data keys the space may not control: they decide which images the splits hold, and a study ranks its trials on one
# val split and pairs their per-image test scores (data.vocab_min_count and data.max_caption_len may be searched).
DATA_SET_PATHS = ("data.kind", "data.captions", "data.features", "data.test_images", "data.root", "data.seed",
                  "data.images", "data.test_split_images", "data.val_images")

# What a2core.train reports after every epoch (see the contract of `a2core.train.train`).
METRICS = ("val/CIDEr", "val/BLEU-1", "val/BLEU-2", "val/BLEU-3", "val/BLEU-4", "val/METEOR", "val/ROUGE-L",
           "best/val/CIDEr", "train/loss", "train/mask_loss", "train/mask_mean", "time/epoch_s", "epoch", "step")
_JSD_METRIC = re.compile(r"^diag/jsd/layer(\d+)$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
NAME_MAX = 64

DEFAULT_STORAGE = "a2-studies"
_MLFLOW_SCHEMES = ("sqlite", "http", "https", "file", "postgresql", "postgres", "mysql", "mssql", "databricks")
_S3 = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(/.*)?$")
_SCHEME = r"^([A-Za-z][A-Za-z0-9+.\-]*):"  # of a URI; + "//" of a URL

# Sizes past which a value is a typo, not a plan: `a2 study validate` (and `a2 train`, `check_runnable`) refuses them
# before anything starts, naming the key and the cap; each is far above what this project runs, with its reason
# (docs/reference/study-file.md, "Sizes it refuses", lists them and is checked against this table).
SIZE_CAPS = {
    # the synthetic COCO stands in for COCO's 123,287 Karpathy images; a larger stand-in measures nothing more, and
    # its features (4-7 regions of 2048 float32 an image, ~45 KB) would take ~9 GB at the cap
    "data.images": (200_000, "COCO's Karpathy split has 123,287 images; the synthetic set stands in for it"),
    # the paper trains tens of epochs per stage (M2: XE to its plateau, then SCST); 1000 is 30x that
    "train.xe_epochs": (1_000, "30x the paper's cross-entropy epochs"),
    "train.scst_epochs": (1_000, "30x the paper's SCST epochs"),
    # the paper's model: d_model 512, 6 layers, 8 heads, d_ff 2048, up to 50 regions, batch 50
    "model.d_model": (4_096, "8x the paper's 512; its weights and Adam's state alone reach GPU memory beyond it"),
    "model.layers": (48, "8x the paper's 6 (encoder and decoder each)"),
    "model.heads": (128, "16x the paper's 8"),
    "model.d_ff": (32_768, "16x the paper's 2048"),
    "model.max_regions": (1_000, "20x the paper's 50 regions an image (bottom-up features have 10 to 100)"),
    "train.batch_size": (10_000, "200x the paper's 50 image-caption pairs"),
}
MAX_TRIALS = 10_000  # configurations x replicates: a study of more is a typo (the largest shipped one, fusion_ablation, runs 75)
# A seed count refused as it is read, before its seeds are listed (10^11 would fill memory); a smaller one past the
# cap is refused by the trial count, which names the configurations too.
MAX_SEEDS = 100 * MAX_TRIALS

_MISSING = object()
STUDY_FORMAT = 2  # see StudySpec.format
# Config checks that involve two keys: an error at one may come from the other being in the space.
_COUPLED = ({"model.temperature", "model.fusion"}, {"model.heads", "model.d_model"},
            {"train.scst_samples", "train.scst_baseline"}, {"train.batch_size", "train.batch_layout"},
            # what an epoch reports (a2core.config.reported_metrics) depends on these
            *({"train.select_metric", key} for key in ("model.layers", "model.fusion", "train.val_meteor",
                                                       "train.diag_every", "train.diag_epochs", "train.scst_from")))


# -- the schema of the study's own sections ------------------------------------------------------------------------
# data / model / train are a2core's Config: checked as a whole once the space's keys are set (`_check_trials`).
def _listed_once(values: list, what: str = "") -> list:
    """`values` when none is listed twice; 4 and 4.0 are one value (as `Param.contains` has them), True and 1 two."""
    seen: dict = {}  # one pass (a 100,000-seed list is refused by its size at once, not after minutes)
    for i, v in enumerate(values):
        key = ("number", v) if _is_number(v) else (type(v).__name__, v)  # hash(4) == hash(4.0), and 4 == 4.0
        try:
            listed = key in seen
        except TypeError:  # unhashable (a list where a value should be): compared one by one
            listed = any(v == w and (type(v) is type(w) or _is_number(v) and _is_number(w)) for w in values[:i])
        else:
            seen[key] = i
        if listed:
            raise ConfigError(f"[{i}]", f"{what}{v!r} is listed twice")
    return values


def _values(value: Any) -> tuple:
    """The values of a grid or choice: a non-empty list of distinct numbers, strings or booleans."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a non-empty list of values, got {value!r}")
    for i, v in enumerate(value):
        if not isinstance(v, (str, int, float, bool)):
            raise ConfigError(f"[{i}]", f"must be a number, string or boolean, got {v!r}")
    return tuple(_listed_once(value))


def _pair(value: Any) -> Any:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"must be [low, high], got {value!r}")
    return value


class Param(Section):
    """One key of `search.space`: exactly one distribution, and optionally `when`. The loader gives it its `key`
    and resolves `when` to {space key: [allowed values]}."""

    grid: Annotated[tuple, BeforeValidator(_values)] | None = Field(None, description=(
        "Values that are all run: grid keys are crossed into grid cells."))
    choice: Annotated[tuple, BeforeValidator(_values)] | None = Field(None, description=(
        "Values sampled from, `num_samples` times per grid cell."))
    uniform: Annotated[tuple[Real, Real], BeforeValidator(_pair)] | None = Field(None, description=(
        "[low, high]: a number sampled uniformly."))
    loguniform: Annotated[tuple[Real, Real], BeforeValidator(_pair)] | None = Field(None, description=(
        "[low, high], low > 0: a number sampled uniformly in log space."))
    randint: Annotated[tuple[Integer, Integer], BeforeValidator(_pair)] | None = Field(None, description=(
        "[low, high]: an integer, both ends included."))
    when: dict[str, Any] | None = Field(None, description=(
        "{space key: value or [values]}: the key exists only in trials where that (unconditional grid or choice) "
        "key has one of those values."))
    # As written in the study (alias or dotted path); also its name in suggestions and Optuna.
    _key: str = PrivateAttr("")

    @model_validator(mode="after")
    def _one_distribution(self) -> Param:
        kinds = [kind for kind in DISTRIBUTIONS if getattr(self, kind) is not None]
        if len(kinds) != 1:
            raise ConfigError("", f"needs exactly one distribution of {', '.join(DISTRIBUTIONS)}, got "
                                  f"{', '.join(kinds) or 'none'}")
        if not self.categorical:
            low, high = self.values
            if low >= high:
                raise ConfigError(self.kind, f"low must be < high, got [{format_value(low)}, {format_value(high)}]")
            if self.kind == "loguniform" and low <= 0:
                raise ConfigError(self.kind, f"loguniform needs low > 0, got {format_value(low)}")
        return self

    key = property(lambda self: self._key)
    path = property(lambda self: resolve_key(self._key))
    kind = property(lambda self: next(kind for kind in DISTRIBUTIONS if getattr(self, kind) is not None))
    values = property(lambda self: getattr(self, self.kind))  # a grid's or choice's values, a range's (low, high)
    sampled = property(lambda self: self.kind != "grid")
    categorical = property(lambda self: self.kind in ("grid", "choice"))

    def active(self, assignment: dict) -> bool:
        """Whether this key exists in a trial whose other keys are `assignment`."""
        return all(assignment.get(k, _MISSING) in allowed for k, allowed in (self.when or {}).items())

    def contains(self, value: Any) -> bool:
        if self.categorical:  # 1 is 1.0, but True is not 1
            return any(value == v and (type(value) is type(v) or _is_number(value) and _is_number(v))
                       for v in self.values)
        return (_is_number(value) and (self.kind != "randint" or float(value).is_integer())
                and self.values[0] <= value <= self.values[1])

    def default(self) -> Any:
        """The paper's value (a2core's schema default) when the distribution contains it, else the middle: the
        first value, the geometric middle of a loguniform range, the middle of the others."""
        value = get_dotted(_schema_defaults(), self.path)
        if value is not None and self.contains(value):
            return int(value) if self.kind == "randint" else value
        if self.categorical:
            return self.values[0]
        low, high = self.values
        if self.kind == "randint":
            return (low + high) // 2
        middle = math.sqrt(low * high) if self.kind == "loguniform" else (low + high) / 2
        return float(f"{middle:.6g}")


class Asha(Section):
    """The replicate-group ASHA of launch.search; min_gap_se = k in its stopping rule gap > k * s_pooled * sqrt(2/n)."""

    grace_period: Integer = Field(1, ge=1, description="Epochs before the first rung.")
    reduction_factor: Number = Field(2, gt=1, description=(
        "r: rungs at epochs g, g*r, ...; a group below the (1 - 1/r) quantile of a rung's means may stop."))
    min_gap_se: Real = Field(2.0, ge=0, description=(
        "k: a group stops only if cutoff - its mean > k * s_pooled * sqrt(2/n) (its seed spread cannot explain "
        "the gap)."))
    # fewer CPU-seconds, more wall time when slots stay free: benchmarks/RESULTS.md, "Early stopping's worth"
    hold_at_rungs: Flag = Field(False, description=(
        "One-worker trials only: a replicate waits at a rung, paused, until its group is judged."))


class Scheduler(Section):
    """Exactly one of these, by name: `{asha: {grace_period: 2}}`, `{fifo: {}}`; `asha: null` takes its defaults."""

    asha: Asha = Field(None, description="Replicate-group ASHA: early stopping that judges groups of seeds.",
                       json_schema_extra={"a2_default": "one of `asha`, `fifo`"})
    fifo: Section = Field(None, description="No early stopping (no options: `{fifo: {}}`).",
                          json_schema_extra={"a2_default": "one of `asha`, `fifo`"})

    @model_validator(mode="after")
    def _exactly_one(self) -> Scheduler:
        if len(self.model_fields_set) != 1:
            raise ConfigError("", f"must name exactly one scheduler of {', '.join(type(self).model_fields)}, got "
                                  f"{', '.join(sorted(self.model_fields_set)) or 'none'}")
        return self


class ReplicateRange(Section):
    """`search.replicates: {min: 3, max: 9}`: adaptive replicates (docs/explanation/statistics.md, "Adaptive
    replicates"): seeds 0 .. rounds[r] - 1 of every arm still open after each round; `_range` checks it."""

    min: Integer = Field(description="Seeds of every configuration in the first round (>= 2).")
    max: Integer = Field(description="Seeds of a configuration whose verdict stays open to the last round.")
    rounds: list[Integer] | None = Field(None, description=(
        "Cumulative seeds after each round, increasing from `min` to `max` (default: min, min + 2, ..., max)."))


def _range(value: dict) -> ReplicateRange:
    """A replicate range with one-line errors naming its key; `rounds` filled in (from min in steps of 2 to max)."""
    spread = ReplicateRange.model_validate(value)
    if spread.min < 2:
        raise ConfigError("min", f"must be >= 2 (one seed measures no seed noise, and the first round's verdicts "
                                 f"need it), got {spread.min}")
    if spread.max <= spread.min:
        raise ConfigError("max", f"must be more than min ({spread.min}), got {spread.max}: for one round, give "
                                 f"search.replicates: {spread.min}")
    if spread.max > MAX_SEEDS:
        raise ConfigError("max", _past_the_cap(spread.max))
    rounds = spread.rounds if spread.rounds is not None else [*range(spread.min, spread.max, 2), spread.max]
    if (not rounds or rounds[0] != spread.min or rounds[-1] != spread.max
            or any(b <= a for a, b in zip(rounds, rounds[1:]))):
        raise ConfigError("rounds", f"must increase from min ({spread.min}) to max ({spread.max}), got {rounds}")
    return spread.model_copy(update={"rounds": rounds})


def _seeds(value: Any) -> Any:
    """`replicates: N` means seeds 0 .. N-1; a list names them; a mapping is a range (`ReplicateRange`)."""
    if isinstance(value, (dict, ReplicateRange)):
        return _range(value if isinstance(value, dict) else value.model_dump())
    if isinstance(value, list):
        if not value:
            raise ValueError("a list of seeds must not be empty")
        return value
    count = integer(value)
    if count < 1:
        raise ValueError(f"must be >= 1, got {count}")
    if count > MAX_SEEDS:
        raise ValueError(_past_the_cap(count))
    return list(range(count))


def _past_the_cap(seeds: int) -> str:
    """Why a count of seeds is refused: every configuration runs each seed, so the study is past `MAX_TRIALS`."""
    return (f"{seeds:,} seeds give at least as many trials, past the cap of {MAX_TRIALS:,} (configurations x "
            f"replicates)")


class Search(Section):
    metric: Text = Field("val/CIDEr", min_length=1, description=(
        "The metric searched on, one that a2core.train reports after every epoch."))
    mode: Literal["max", "min"] = Field("max", description="Whether `metric` is maximised or minimised.")
    algorithm: Literal["optuna", "random", "grid"] = Field("optuna", description=(
        "How sampled keys are drawn: Optuna TPE, random, or `grid` (only the points run)."))
    num_samples: Integer = Field(1, ge=1, description="Samples of the sampled keys per grid cell.")
    seed: Integer = Field(0, ge=0, description="Searcher seed (grid cell i uses seed + i).")
    space: dict[str, Param] | None = Field(None, description=(
        "Searched keys: aliases (`fusion`, `lambda`, `eta`, `temperature`, `seed`) or dotted `data.` / `model.` / "
        "`train.` paths, each with exactly one distribution."))
    points_to_evaluate: list[dict[str, Any]] | None = Field(None, description=(
        "First suggestions of every grid cell, e.g. `[{lambda: 0.035}]` (default: the paper's values)."))
    replicates: Annotated[list[Annotated[Integer, Field(ge=0)]] | ReplicateRange, BeforeValidator(_seeds),
                          AfterValidator(lambda seeds: seeds if isinstance(seeds, ReplicateRange)
                                         else _listed_once(seeds, "seed "))] | None = Field(
        None, description=(
            "N (seeds 0 .. N-1) or a list of seeds (each >= 0): every configuration runs once per seed. Or a "
            "range `{min: 3, max: 9}` (optional `rounds: [3, 5, 7, 9]`, default min to max in steps of 2): adaptive replicates, "
            "seeds in rounds, and after each round an arm whose verdict is settled gets no more (docs/explanation/"
            "statistics.md, \"Adaptive replicates\"); the study's trial count is the maximum's."),
        json_schema_extra={"a2_type": "integer, or list of integer, or {min, max, rounds}, or null"})
    confirm: Integer | None = Field(None, ge=2, le=MAX_TRIALS, description=(
        "Confirmation seeds: once every configuration has run its `replicates`, each fusion's best configuration "
        "(selected on val over those seeds) runs this many fresh seeds, and the study's verdicts rest on them alone, "
        "so that the selection among an arm's configurations cannot lean the verdict (docs/explanation/"
        "statistics.md, \"Confirmation seeds\"). Needs a fixed `replicates`."))
    scheduler: Scheduler = Field(default_factory=lambda: Scheduler(fifo={}), description=(
        "Early stopping: exactly one of `asha` or `fifo` (default: fifo, none)."))
    purpose: Literal["compare", "explore"] = Field(
        "compare", description="compare: the study's configurations are arms whose differences it reports (mean and "
        "95% interval over seeds), so every arm needs at least 2 seeds (`a2 study validate` refuses one). explore: "
        "it only looks for promising regions (a first pass of a search, a smoke run) and claims no difference: one "
        "seed per configuration is allowed.")


class Resources(Section):
    workers_per_trial: Integer = Field(1, ge=1, description=(
        "Data-parallel workers of one trial (1: runs in the Tune trial; more: a Ray Train job)."))
    cpus_per_worker: Number = Field(1, gt=0, description="CPUs reserved per worker.")
    gpus_per_worker: Number = Field(0, ge=0, description="GPUs per worker (a fraction, or a whole number above 1).")
    max_concurrent_trials: Integer = Field(1, ge=1, description="Trials running side by side.")
    fuse_replicates: Flag = Field(False, description=(
        "Each configuration's seeds trained in one trial as one fused model, one step for all (a2core.fused); "
        "each seed is still a trial of the record. A round of seeds (search.confirm's, adaptive replicates') is "
        "one more trial of the configuration. Needs 2 or more replicate seeds and one worker a trial; "
        "`a2 study plan` prices it from the newest GPU record (benchmarks/records/gpu/)."))
    capture_step: Flag = Field(False, description=(
        "The fused cross-entropy step compiled once into CUDA graphs (torch.compile \"reduce-overhead\", one whole "
        "graph for each of its three passes: a2core.fused's `capture`), so that a step costs a few launches instead "
        "of one per kernel. Needs resources.fuse_replicates and GPUs; the first steps of a trial compile (minutes). "
        "`a2 study plan` prices it from the GPU record's `captured` arm."))
    max_failures: Integer = Field(1, ge=-1, description=(
        "Tune retries of a failed trial (Ray Train retries its worker group as often); -1 = forever."))
    # Ray refuses a bare {"CPU": 0}.
    driver_cpus: Number = Field(0.01, gt=0, description="CPUs of a multi-worker trial's small Tune driver function.")
    price_per_hour: Real | None = Field(None, gt=0, description=(
        "What one trial holds per hour (a node's price over the trials it runs side by side): the study's cost in "
        "status and summary; absent if not given."))

    @model_validator(mode="after")
    def _whole_gpus(self) -> Resources:
        if self.gpus_per_worker > 1 and not float(self.gpus_per_worker).is_integer():
            raise ConfigError("gpus_per_worker", f"more than one GPU must be a whole number, got "
                                                 f"{format_value(self.gpus_per_worker)}")
        return self


class Tracking(Section):
    mlflow_uri: Text | None = Field(None, min_length=1, description=(
        "MLflow tracking URI, without a password (null: $MLFLOW_TRACKING_URI at load time, else "
        "sqlite:///mlflow.db; saved with the study)."))
    experiment: Text | None = Field(None, min_length=1, description="MLflow experiment (null: the study's name).")

    @model_validator(mode="after")
    def _resolve_uri(self) -> Tracking:
        """The URI at load time (saved with the study, so a resumed one tracks to the same place), a file store
        or a relative sqlite database made absolute."""
        uri = self.mlflow_uri or default_tracking_uri()
        if re.match(_SCHEME + r"//[^/@]*:[^/@]*@", uri):  # user:password@host
            raise ConfigError("mlflow_uri", f"{redact_uri(uri)}: no password in the URI (it would be saved with the "
                                            "study and shown); give it by reference: ~/.pgpass or $PGPASSFILE for "
                                            "a database, $MLFLOW_TRACKING_PASSWORD or ~/.mlflow/credentials for an "
                                            "MLflow server")
        scheme = re.match(_SCHEME, uri)
        scheme = scheme.group(1).lower().split("+", 1)[0] if scheme else ""  # postgresql+psycopg2 -> postgresql
        if scheme == "postgres":  # the short alias (Heroku's URLs), which SQLAlchemy and so MLflow refuse
            uri, scheme = "postgresql" + uri[len("postgres"):], "postgresql"
        if len(scheme) <= 1:  # a plain path (or a Windows drive letter): a file store
            uri = os.path.abspath(os.path.expanduser(uri))
        elif scheme not in _MLFLOW_SCHEMES:
            raise ConfigError("mlflow_uri", f"unknown scheme {scheme!r} in {uri!r}; use sqlite:///, http(s)://, "
                                            f"file:, a database URI or a directory")
        elif scheme == "sqlite":
            if not uri.startswith("sqlite:///"):
                raise ConfigError("mlflow_uri", f"a sqlite URI is sqlite:///relative.db or sqlite:////abs.db, got "
                                                f"{uri!r}")
            db = uri[len("sqlite:///"):]
            if db and db != ":memory:" and not db.startswith("/"):
                uri = "sqlite:///" + os.path.abspath(os.path.expanduser(db))
        self.mlflow_uri = uri
        return self


def validate_study_name(name: Any) -> str:
    """`name` if it is a study's name, else ValueError saying why (the spec's validator, and `launch.location`'s)."""
    if name is None:
        raise ValueError("required: the study's name ([a-z0-9-])")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"must be lowercase letters, digits and '-' (starting with a letter or digit), got {name!r}")
    if len(name) > NAME_MAX:
        raise ValueError(f"at most {NAME_MAX} characters, got {len(name)}")
    return name


def group_key(config: dict, resolve=None) -> str:
    """The replicate group of a suggestion: `dashboards.stats.config_hash` of its resolved config (`resolve`: the
    spec's `trial_config`); without `resolve`, of the suggestion without its seed key."""
    # scipy (dashboards.stats): `a2 study validate` imports this module and loads no scipy
    from dashboards.stats import config_hash

    config = {k: v for k, v in config.items() if k != FUSED_SEEDS_KEY}  # a fused trial: its seeds' group
    return config_hash(resolve(config) if resolve is not None else
                       {k: v for k, v in config.items() if k not in SEED_KEYS})


# data / model / train as written (`null` reads as {}): a Config once probed
RawSection = Annotated[dict, BeforeValidator(lambda value: {} if value is None else value)]


# -- the schema of data/model/train, read from a2core's models ---------------------------------------------------
@lru_cache(maxsize=1)
def config_schema() -> dict[str, Any]:
    """`{"model.lambda": float, "train.seed": int, "model.fusion": Literal["none", "max", ...], ...}`: the type of
    every data/model/train key, with Annotated[...] and `| None` taken off."""
    out = {}
    for section in SECTIONS:
        for name, f in Config.model_fields[section].annotation.model_fields.items():
            annotation = f.annotation
            while get_origin(annotation) not in (None, Literal):  # Annotated[X, ...] or X | None -> X
                annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
            out[f"{section}.{f.alias or name}"] = annotation
    return out


@lru_cache(maxsize=1)
def _schema_defaults() -> dict:
    return Config().to_dict()


def schema_default(path: str, otherwise: Any = None) -> Any:
    """The default of a data/model/train path ("train.select_metric" -> "val/CIDEr"); `otherwise` for another."""
    return get_dotted(_schema_defaults(), path) if path in config_schema() else otherwise


def resolve_key(key: str) -> str | None:
    """The dotted config path of a space key (alias or path), or None when it names nothing in the schema."""
    path = ALIASES.get(key, key)
    return path if path in config_schema() else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_number(value: Any) -> Any:
    """A number string as the float it means, as a2core's `number` reads it (YAML 1.1 reads 5e-3, without a dot, as
    a string): for a value of a float key in the space, its points and its `when`. Anything else as it is."""
    if isinstance(value, str):
        try:
            return number(value)
        except ValueError:  # not a number, or '.nan' and 'inf': refused as written
            return value
    return value


def _distinct_dicts(dicts) -> list[dict]:
    dicts = list(dicts)
    return [d for i, d in enumerate(dicts) if d not in dicts[:i]]


# -- the spec ---------------------------------------------------------------------------------------------------------
class StudySpec(Section):
    """A study file, validated: its fields as written, resolved (paths absolute, the space's `when` and points
    filled in, data/model/train with a2core's defaults but without the keys the space sets), plus what checking it
    found (`base`, `images`, `warnings`). `from_dict` and `load_study` make one; `model_validate` alone takes the
    file's path and `check_files` from the validation context."""

    # the search aliases written as top-level keys: what a study file says instead
    elsewhere: ClassVar[dict[str, str]] = {
        alias: (f"{alias} is a searched key: to give every trial one value write search.space.{alias}.grid=[VALUE] "
                f"when the study searches it, else {path}=VALUE") for alias, path in ALIASES.items()}

    name: Annotated[str, BeforeValidator(validate_study_name)] = Field(None, validate_default=True, description=(
        f"The study's name, `[a-z0-9-]` starting with a letter or digit, at most {NAME_MAX} characters: it names "
        "paths and MLflow objects."))
    data: RawSection = Field({}, description="The `data` section of a config, for every trial.")
    model: RawSection = Field({}, description="The `model` section of a config (searched keys left out).")
    train: RawSection = Field({}, description="The `train` section of a config (searched keys left out).")
    search: Search = Field(default_factory=Search, description="What is searched, how, and early stopping.")
    resources: Resources = Field(default_factory=Resources, description="Workers, CPUs and GPUs of each trial.")
    # Validated even when absent: it resolves the URI.
    tracking: Tracking = Field({}, validate_default=True, description="Where the study is tracked in MLflow.")
    storage: Text = Field(DEFAULT_STORAGE, min_length=1, description=(
        "Where the study's record and checkpoints go: a local directory or `s3://bucket/prefix`."))
    storage_endpoint_url: Text | None = Field(None, pattern=r"^https?://[^/\s]+", description=(
        "An S3-compatible server for `storage` (default: AWS)."))
    format: Literal[2] = Field(STUDY_FORMAT, description=(
        "The units of the file: 2, train.batch_size is the global batch in image-caption pairs. `a2 study run` "
        "writes it into the study's study.yaml; a file without it is read as 2."))

    _source: str | None = PrivateAttr(None)  # the study file
    # a2core config as a plain dict: defaults filled in, the keys the space controls at their schema defaults
    _base: dict = PrivateAttr(default_factory=dict)
    # Images of the train (restval included), val and test splits, and where the counts come from (`_split_counts`).
    _images: dict = PrivateAttr(default_factory=dict)
    _images_source: str = PrivateAttr("")
    _warnings: list = PrivateAttr(default_factory=list)  # what makes it doubtful but not meaningless (stderr)
    # search.space / points_to_evaluate when the file had none: they come last in `to_dict` (study.yaml's order)
    _filled_in: tuple = PrivateAttr(())

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> StudySpec:
        """What no field can say alone: the space's keys and conditions, every trial it can produce (probed at the
        ends of ranges, defaults, points and choices), the data files, the metric and the scheduler."""
        context = info.context or {}
        self._source = context.get("source")
        _resolve_storage(self, context.get("check_files", True))
        sections = {s: copy.deepcopy(getattr(self, s)) for s in SECTIONS}
        # Relative data paths become absolute, against the study's root (`study_root`), never the working
        # directory: trials run in other working directories and on other machines, and `ray submit` runs its
        # script from the head's home while the data sits in the repository's copy there.
        root = context.get("root") or (study_root(self._source) if self._source and os.path.isfile(self._source)
                                       else os.getcwd())
        for path in DATA_PATHS:
            value = get_dotted(sections, path)
            if isinstance(value, str) and value and "://" not in value:
                set_dotted(sections, path, os.path.normpath(os.path.join(root, os.path.expanduser(value))))
        if not context.get("saved", False):  # a study saved before the check keeps loading
            check_data_kind(sections.get("data"))
        search = self.search
        _select_by_the_study_metric(search, sections)
        self._filled_in = tuple(key for key in ("space", "points_to_evaluate") if getattr(search, key) is None)
        search.space = _check_space(search, sections, saved=context.get("saved", False))
        search.points_to_evaluate = _check_points(search, [p for p in search.space.values() if p.sampled])
        self.tracking.experiment = self.tracking.experiment or self.name
        _check_metric(self, sections)  # before the trials: a2core's train.select_metric check would name that key
        if self.num_trials > MAX_TRIALS:  # before every trial's config is built: that costs time of its count
            _fail("search", f"{self.num_trials:,} trials (configurations x replicates) is past the cap of "
                            f"{MAX_TRIALS:,}: check search.num_samples, the grids and search.replicates")
        if (last := search.seed + len(self.grid_cells()) - 1) >= SEED_LIMIT:  # numpy's range, as train.seed's
            _fail("search.seed", f"{search.seed}: grid cell i's searcher is seeded search.seed + i, up to {last}, "
                                 f"beyond the seed range 0 .. {SEED_LIMIT - 1}")
        self._base = _check_trials(self, sections)
        # after the trials, so that a value a2core refuses (eta < 0) is named for that first; a study saved before
        # this check keeps loading
        if not context.get("saved", False):
            _check_fixed_applicable(search.space, sections)
        for section in SECTIONS:  # as saved: without the keys the space controls
            setattr(self, section, {k: v for k, v in self._base[section].items()
                                    if f"{section}.{k}" not in {p.path for p in self.params.values()}})
        splits = _check_data(self._base, context.get("check_files", True))
        self._images, self._images_source = _split_counts(self._base["data"], splits)
        _check_batch(self)
        asha = search.scheduler.asha
        if asha and asha.grace_period > self.total_epochs:
            _fail("search.scheduler.asha.grace_period", f"{asha.grace_period} is more than the {self.total_epochs} "
                                                        f"planned epochs (train.xe_epochs + train.scst_epochs)")
        if asha and asha.hold_at_rungs and self.resources.workers_per_trial > 1:
            _fail("search.scheduler.asha.hold_at_rungs", "only for one-worker trials (resources.workers_per_trial: "
                                                         "1): a Ray Train trial would restart its worker group at "
                                                         "every rung")
        if asha and len(self.replicate_seeds) < 2:
            _fail("search.scheduler.asha", f"ASHA here stops a replicate group only on a gap its seed spread "
                                           f"cannot explain; with {len(self.replicate_seeds) or 1} seed per "
                                           f"configuration it can never stop anything: set search.replicates >= 2, "
                                           f"or use scheduler {{fifo: {{}}}}")
        if search.confirm is not None and isinstance(search.replicates, ReplicateRange):
            _fail("search.confirm", "confirmation seeds follow a fixed search.replicates (N or a list); adaptive "
                                    "replicates ({min, max}) already add seeds in rounds: use one or the other")
        if search.confirm is not None and not self.replicate_seeds:
            _fail("search.confirm", "confirmation seeds follow the search's own seeds: set search.replicates")
        if search.confirm is not None and search.purpose != "compare":
            _fail("search.confirm", "confirmation seeds settle verdicts, and an `explore` study claims none: "
                                    "set search.purpose: compare, or drop search.confirm")
        if search.confirm is not None and self.confirm_arms < 2:
            _fail("search.confirm", "confirmation seeds go to each fusion's chosen configuration, and the verdicts "
                                    "compare fusions: this study does not search model.fusion over two or more "
                                    "values (grid or choice), so no verdict would ever use them; drop search.confirm")
        seeds = self.replicate_seeds + self.confirm_seeds
        if seeds and max(seeds) >= SEED_LIMIT:
            key = "search.replicates" if max(self.replicate_seeds) >= SEED_LIMIT else "search.confirm"
            _fail(key, f"seed {max(seeds)} is beyond train.seed's range 0 .. {SEED_LIMIT - 1}"
                       + (" (confirmation seeds follow the largest replicate seed)" if key == "search.confirm" else ""))
        if search.num_samples > 1 and search.algorithm == "grid" and self.sampled_params:
            _fail("search.num_samples", "algorithm 'grid' runs search.points_to_evaluate, not samples: drop "
                                        "search.num_samples, or use algorithm optuna or random")
        if self.resources.fuse_replicates:
            check_fused(self)
        if self.resources.capture_step and not self.resources.fuse_replicates:
            _fail("resources.capture_step", "captures the fused step of resources.fuse_replicates: set it to true "
                                            "too, or drop resources.capture_step")
        if self.resources.capture_step and not self.resources.gpus_per_worker:
            _fail("resources.capture_step", "compiles the step into CUDA graphs, which need a GPU: set "
                                            "resources.gpus_per_worker, or drop resources.capture_step")
        if search.purpose == "compare" and self.num_arms > 1 and len(self.seed_values) < 2:
            _fail("search.replicates", f"this study compares {self.num_arms} configurations with one seed each, "
                                       f"and one seed against one seed has no interval: set search.replicates (`a2 "
                                       f"study plan` says how many resolve the gaps you expect), or `search.purpose: "
                                       f"explore` if it only explores")
        _check_schedule(self)
        return self

    @classmethod
    def from_dict(cls, raw: Any, source: str | None = None, cluster_resources: dict | None = None,
                  check_files: bool = True, root: str | Path | None = None, saved: bool = False) -> StudySpec:
        """The validated study of a parsed study file. check_files False (`a2 study plan` before the data is
        there): COCO data files may be absent; the split sizes then are the standard Karpathy counts. With
        `cluster_resources`, also `check_cluster`. `root`: the folder relative data paths resolve against (default:
        `study_root(source)` when `source` is a file, else the working directory). `saved`: the study.yaml of a
        study that ran (`launch.location.load_saved_spec`), which checks added since may not make unreadable."""
        context = {"source": source, "check_files": check_files, "saved": saved,
                   "root": os.path.abspath(os.path.expanduser(str(root))) if root is not None else None}
        try:
            spec = cls.model_validate(raw, context=context)
        except ValidationError as err:
            raise config_error(err, source) from None
        if cluster_resources is not None:
            check_cluster(spec, cluster_resources)
        return spec

    # what checking it found, read-only
    source = property(lambda self: self._source)
    base = property(lambda self: self._base)
    images = property(lambda self: self._images)
    images_source = property(lambda self: self._images_source)
    warnings = property(lambda self: self._warnings)
    params = property(lambda self: self.search.space)  # the keys of search.space, by their names in the file
    metric = property(lambda self: self.search.metric)
    mode = property(lambda self: self.search.mode)
    algorithm = property(lambda self: self.search.algorithm)

    @property
    def sampled_params(self) -> list[Param]:
        """The sampled keys in the order a define-by-run space asks them: unconditional ones first."""
        sampled = [p for p in self.params.values() if p.sampled]
        return [p for p in sampled if not p.when] + [p for p in sampled if p.when]

    sampled_keys = property(lambda self: [p.key for p in self.sampled_params])

    def grid_cells(self) -> list[dict]:
        """Every combination of the grid keys (a conditional grid key only where its condition holds); `[{}]`
        when the space has no grid keys: the whole study is one cell."""
        grid = [p for p in self.params.values() if not p.sampled]
        uncond = [p for p in grid if not p.when]
        cells = [dict(zip([p.key for p in uncond], combo)) for combo in itertools.product(*(p.values for p in uncond))]
        for p in grid:
            if p.when:
                cells = [new for c in cells for new in ([{**c, p.key: v} for v in p.values] if p.active(c) else [c])]
        return cells

    def has_sampled(self, cell: dict) -> bool:
        """Whether a sampled key can exist in `cell` (conditions on sampled keys are undecided there)."""
        return any(all(k not in cell or cell[k] in allowed for k, allowed in (p.when or {}).items())
                   for p in self.sampled_params)

    def fill(self, cell: dict, value_of) -> dict:
        """The sampled part of a trial in `cell`, asking `value_of(param)` for every key that is active."""
        assignment = dict(cell)
        out = {}
        for p in self.sampled_params:
            if p.active(assignment):
                assignment[p.key] = out[p.key] = value_of(p)
        return out

    def points_for_cell(self, cell: dict) -> list[dict]:
        """The points to evaluate first in `cell`, reduced to the keys active there (duplicates removed)."""
        if not self.has_sampled(cell):
            return []
        return _distinct_dicts(self.fill(cell, lambda p: point[p.key]) for point in self.search.points_to_evaluate)

    def samples_per_cell(self, cell: dict) -> int:
        if not self.has_sampled(cell):
            return 1
        if self.algorithm == "grid":
            return max(1, len(self.points_for_cell(cell)))
        return self.search.num_samples

    @property
    def replicate_seeds(self) -> list[int]:
        """The seeds every configuration runs with (`search.replicates`); [] when the study has no replicates."""
        replicates = self.search.replicates
        return list(range(replicates.max)) if isinstance(replicates, ReplicateRange) else list(replicates or [])

    @property
    def replicate_rounds(self) -> tuple[int, ...] | None:
        """The cumulative seeds per arm after each round of adaptive replicates (`search.replicates: {min, max}`);
        None for a fixed number of seeds."""
        replicates = self.search.replicates
        return tuple(replicates.rounds) if isinstance(replicates, ReplicateRange) else None

    @property
    def confirm_seeds(self) -> list[int]:
        """The confirmation seeds of each fusion's chosen configuration (`search.confirm`): the next ones after the
        search's own seeds; [] without confirmation."""
        if self.search.confirm is None or not self.replicate_seeds:  # the latter refused by `_check`
            return []
        first = max(self.replicate_seeds) + 1
        return list(range(first, first + self.search.confirm))

    @property
    def confirm_from(self) -> int | None:
        """The first confirmation seed: a configuration is selected on its seeds below it, and a verdict rests on its
        seeds from it on (`dashboards.compare.study_comparison`); None without confirmation."""
        return self.confirm_seeds[0] if self.confirm_seeds else None

    @property
    def seed_rounds(self) -> tuple[int, ...] | None:
        """The searcher's rounds, cumulative seeds of a group after each: adaptive replicates' (`replicate_rounds`),
        or the search's seeds then the confirmation seeds (`search.confirm`); None: one round."""
        if self.confirm_seeds:
            return (len(self.replicate_seeds), len(self.replicate_seeds) + len(self.confirm_seeds))
        return self.replicate_rounds

    @property
    def confirm_arms(self) -> int:
        """The configurations that get confirmation seeds, one per value of `fusion` the study runs (its grid's or
        choice's values, else the one fusion); 0 without confirmation."""
        if not self.confirm_seeds:
            return 0
        fusion = next((p for p in self.params.values() if p.path == "model.fusion"), None)
        return len(set(fusion.values)) if fusion is not None and fusion.kind in ("grid", "choice") else 1

    num_configs = property(lambda self: sum(self.samples_per_cell(c) for c in self.grid_cells()))

    # trials of the search itself: every configuration once per replicate seed
    search_trials = property(lambda self: self.num_configs * max(1, len(self.replicate_seeds)))
    # the search's trials and, with `search.confirm`, each fusion's chosen configuration's confirmation seeds
    num_trials = property(lambda self: self.search_trials + self.confirm_arms * len(self.confirm_seeds))

    @property
    def seed_rounds_trials(self) -> list[tuple[int, int]]:
        """(configurations, seeds each adds) of each round of seeds (`seed_rounds`): every configuration's seeds in
        one round; with confirmation seeds, then the chosen configurations' (`confirm_arms`); with adaptive
        replicates, every configuration in every round (at most: the design settles arms on the way). A fused study
        trains a configuration's seeds of a round as one trial (`resources.fuse_replicates`)."""
        rounds = self.seed_rounds or (max(1, len(self.replicate_seeds)),)
        later = self.confirm_arms if self.confirm_seeds else self.num_configs
        configs = [self.num_configs] + [later] * (len(rounds) - 1)
        return [(n, b - a) for n, a, b in zip(configs, (0, *rounds), rounds)]

    @property
    def tune_samples(self) -> int:
        """Tune's trials: `num_trials`, or with `resources.fuse_replicates` one per configuration and round of seeds
        (each seed is still a trial of the record: `launch.layout.seed_trials`)."""
        if not self.resources.fuse_replicates:
            return self.num_trials
        return sum(n for n, _ in self.seed_rounds_trials)

    # seeds per arm that a verdict rests on: the confirmation seeds, else an arm's seeds
    verdict_seeds = property(lambda self: len(self.confirm_seeds) or len(self.seed_values))

    @property
    def seed_values(self) -> list:
        """The seeds of one arm: search.replicates', else a seed grid's values, else the one fixed seed."""
        if self.replicate_seeds:
            return self.replicate_seeds
        grid = next((p for p in self.params.values() if p.path == SEED_PATH and p.kind == "grid"), None)
        return list(grid.values) if grid is not None else [self.base["train"]["seed"]]

    # configurations apart from their seed: what a comparison compares
    num_arms = property(lambda self: self.search_trials // len(self.seed_values))

    @property
    def steps_per_epoch(self) -> int:
        """Global optimizer steps of one epoch (XE and SCST alike: an XE step takes batch_size pairs, as
        batch_size / 5 images x 5 captions or as random pairs (train.batch_layout), an SCST step batch_size / 5
        images; with SCST batch_size is a multiple of 5, so the counts agree)."""
        t = self.base["train"]
        return steps_per_epoch(self.images["train"], t["batch_size"], t.get("batch_layout", "images"))

    @property
    def trial_batches(self) -> list[tuple[int, str]]:
        """The (train.batch_size, train.batch_layout) pairs trials can take. The base holds a searched key at its
        schema default, so `steps_per_epoch` is at that batch; a grid or choice of either lists its values here."""
        return [(int(size), layout) for size in self.values_of("train.batch_size")
                for layout in self.values_of("train.batch_layout")]

    def values_of(self, path: str) -> list:
        """The values trials take at a config path: a grid's or choice's, else the base's one value (a sampled range
        too: its values are not a list)."""
        param = next((p for p in self.params.values() if p.path == path), None)
        if param is not None and param.categorical:
            return list(dict.fromkeys(param.values))
        return [get_dotted(self.base, path, schema_default(path))]

    @property
    def fewest_steps_per_epoch(self) -> int:
        """The steps of one epoch of the trial with the largest batch (`trial_batches`): a schedule's warnings
        (warmup, T_P) hold for every trial when they hold for it."""
        return min(steps_per_epoch(self.images["train"], size, layout) for size, layout in self.trial_batches)

    total_steps = property(lambda self: self.steps_per_epoch * self.total_epochs)

    def temperature_range(self) -> tuple[float, float] | None:
        """The lowest and highest T_P (model.temperature) a trial can have; None when no trial uses exp_decay."""
        if (param := next((p for p in self.params.values() if p.path == "model.temperature"), None)) is not None:
            return float(min(param.values)), float(max(param.values))
        value = self.base["model"].get("temperature")
        return (float(value), float(value)) if value is not None else None

    # the planned epochs of every trial (XE + SCST): ASHA's max_t; fewer means the trial was stopped
    total_epochs = property(lambda self: int(self.base["train"]["xe_epochs"]) + int(self.base["train"]["scst_epochs"]))
    rungs = property(lambda self: scheduler_rungs(self))  # the epochs where ASHA may stop a trial

    def cell_label(self, cell: dict) -> str:
        return ",".join(f"{k}={format_value(v)}" for k, v in cell.items()) or "all"

    def trial_config(self, sampled: dict[str, Any]) -> dict:
        """The validated a2core config (plain dict) of one suggestion, e.g. `{"fusion": "gate", "lambda": 0.03}`,
        without the model keys its fusion does not use (`a2core.config.applicable_config`)."""
        raw = copy.deepcopy(self.base)
        for key, value in sampled.items():
            path = resolve_key(key)
            if path is None:
                raise ConfigError(key, "not a key of the search space, an alias or a data/model/train path",
                                  self.source)
            set_dotted(raw, path, value)
        return applicable_config(Config.from_dict(raw, source=self.source).to_dict())

    @property
    def has_train_driver(self) -> bool:
        """Whether a trial is a Ray Train job whose small Tune driver function holds `resources.driver_cpus` beside
        its workers (`launch.trainable.make_trainable`); a one-worker or fused trial trains in the Tune trial."""
        return self.resources.workers_per_trial > 1 and not self.resources.fuse_replicates

    def trial_resources(self) -> dict:
        """Total resources of one trial: its workers plus, on Ray Train, its Tune driver function."""
        r = self.resources
        return {"CPU": r.workers_per_trial * r.cpus_per_worker + (r.driver_cpus if self.has_train_driver else 0),
                "GPU": r.workers_per_trial * r.gpus_per_worker}

    def summary(self) -> str:
        cells = len(self.grid_cells())
        seeds = self.replicate_seeds
        configs = f"{self.num_configs} configuration{'s' if self.num_configs != 1 else ''}"
        replicas = f" = {configs} x {len(seeds)} seed{'s' if len(seeds) != 1 else ''}" if seeds else ""
        return (f"OK {self.name}: {self.num_trials} trials{replicas} in {cells} grid cell{'s' if cells != 1 else ''}"
                f" ({self.algorithm}; sampled: {', '.join(self.sampled_keys) or 'none'}; {self.mode} {self.metric}; "
                f"storage {self.storage})")

    def to_dict(self) -> dict:
        """The resolved study as plain data (study.yaml, the MLflow parent run's params)."""
        search = self.search.model_dump(mode="json", exclude_none=True)
        for key in self._filled_in:
            search[key] = search.pop(key)
        return copy.deepcopy({"name": self.name, **{s: getattr(self, s) for s in SECTIONS}, "search": search,
                              "resources": self.resources.model_dump(exclude_none=True),  # a price only when given
                              "tracking": self.tracking.model_dump(), "storage": self.storage,
                              "storage_endpoint_url": self.storage_endpoint_url})


TOP_KEYS = tuple(StudySpec.model_fields)


# -- loading -----------------------------------------------------------------------------------------------------------
def load_study(path: str | Path, overrides: list[str] | tuple = (), cluster_resources: dict | None = None,
               check_files: bool = True, root: str | Path | None = None) -> StudySpec:
    """Read, override (`key=value`, applied to the YAML before validation) and validate a study file. Its relative
    data paths, in the file and in the overrides alike, resolve against `root` (default: `study_root(path)`)."""
    source = str(path)
    raw = load_yaml(path)
    try:
        raw = apply_study_overrides(raw, list(overrides), source=source)
    except ConfigError as err:
        raise ConfigError(err.path, f"{err.reason} (in an override)", err.source or source) from None
    return StudySpec.from_dict(raw, source=source, cluster_resources=cluster_resources, check_files=check_files,
                               root=root if root is not None else study_root(path))


def apply_study_overrides(raw: dict, overrides: list[str], source: str | None = None) -> dict:
    """`a2core.config.apply_overrides` for a study file, whose space keys may themselves be dotted paths: an override
    `search.space.REST=VALUE` whose REST is a space key of the file (`model.mask_net`), or starts with one and a dot
    (`model.mask_net.grid`, `model.renormalize.when`), sets that key (or that field of it) instead of nesting a
    mapping per dot; one whose REST starts with a config path the space does not have yet (`model.eta.grid=[0.1]`)
    adds that key. Any other override is `apply_overrides`'s, in the order given."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        scratch = apply_overrides({}, [item], source=source)  # the form checked and the value parsed, as always
        key = item.split("=", 1)[0]
        value = get_dotted(scratch, key)
        rest = key[len("search.space."):] if key.startswith("search.space.") else None
        search = raw.get("search")
        space = search.get("space") if isinstance(search, dict) else None
        target = _space_target(rest, space if isinstance(space, dict) else {}) if rest else None
        if target is None:
            set_override(raw, key, value)
            continue
        name, field = target
        if not isinstance(search, dict):
            search = raw["search"] = {}
        if not isinstance(search.get("space"), dict):
            search["space"] = {}
        if field is None:
            search["space"][name] = value
            continue
        param = search["space"].get(name)
        if param is None:
            param = search["space"][name] = {}
        if not isinstance(param, dict):
            raise ConfigError(f"search.space.{name}", "is not a mapping; cannot set a key below it", source)
        set_dotted(param, field, value)
    return raw


def _space_target(rest: str, space: dict) -> tuple[str, str | None] | None:
    """(space key, its field or None) that `search.space.<rest>` names when the key has a dot in it: the longest
    key of `space` that `rest` is or starts with, else the longest config path it starts with (a new key); None
    when no dotted key is involved (plain set_dotted does the right thing then)."""
    parts = rest.split(".")
    for known in (lambda name: name in space, lambda name: resolve_key(name) == name):
        for n in range(len(parts), 1, -1):  # only dotted names: an undotted one needs no help
            name = ".".join(parts[:n])
            if known(name):
                return name, ".".join(parts[n:]) or None
    return None


# The study's input paths: relative ones resolve against the study's root. `storage` and a sqlite
# `tracking.mlflow_uri` are outputs of the command that runs the study and stay relative to its working directory,
# like every command's --storage.
DATA_PATHS = ("data.captions", "data.features", "data.test_images", "data.root", "train.scst_from")


def is_checkout(folder: str | Path) -> bool:
    """Whether `folder` is a copy of this repository: its pyproject.toml names the project a2tune (a clone, or the
    copy `ray up` syncs to ~/a2tune on every node)."""
    try:
        text = (Path(folder) / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return re.search(r'(?m)^name\s*=\s*["\']a2tune["\']\s*$', text) is not None


def study_root(path: str | Path) -> str:
    """The folder a study file's relative data paths mean: the nearest folder at or above the file that is a copy
    of this repository (`is_checkout`), else the file's own folder. So `data/coco/x.json` in studies/x.yaml is
    <checkout>/data/coco/x.json whoever loads it, from whichever directory, on the laptop as on a node (where the
    copy is ~/a2tune). The path is made absolute as written, symbolic links kept."""
    folder = Path(os.path.abspath(os.path.expanduser(str(path)))).parent
    for candidate in (folder, *folder.parents):
        if is_checkout(candidate):
            return str(candidate)
    return str(folder)


# The Karpathy split of COCO 2014 (Karpathy & Fei-Fei 2015; the paper's "5,000 images for validation and 5,000 for
# testing", the rest, restval included, for training), each image with about 5 captions: the split sizes a study
# plans with before its captions file is there.
KARPATHY_IMAGES = {"train": 113_287, "val": 5_000, "test": 5_000}


# -- the batch and the schedule ----------------------------------------------------------------------------------------
def _split_counts(data: dict, splits: dict | None) -> tuple[dict[str, int], str]:
    """Train, val and test images: from the captions file when it is there (its `splits`, read by `_check_data`),
    else the synthetic generator's split or the standard Karpathy counts."""
    if data["kind"] == "synthetic":
        sizes = split_sizes(data["images"], data.get("test_split_images"))
        return sizes, f"synthetic data of {data['images']} images"
    if splits is not None:
        return {k: len(splits.get(k, [])) for k in ("train", "val", "test")}, f"counted in {data['captions']}"
    return (dict(KARPATHY_IMAGES),
            "the standard Karpathy split, restval in train, about 5 captions an image; no captions file here")


def _check_batch(spec: StudySpec) -> None:
    """The global batch splits evenly over a trial's workers, for every batch size and layout a trial can have."""
    workers, t = spec.resources.workers_per_trial, spec.base["train"]
    param = next((p for p in spec.params.values() if p.path == "train.batch_size"), None)
    for size, layout in spec.trial_batches:
        try:
            check_batch_split(size, workers, layout, scst=t["scst_epochs"] > 0)
        except ConfigError as err:
            where = f"search.space.{param.key}" if param is not None else err.path
            _fail(where, f"{err.reason} (resources.workers_per_trial: {workers})")


def _check_schedule(spec: StudySpec) -> None:
    """Warnings: a warmup that takes most of training, a T_P range past the trial's last step, an ASHA whose first
    rung is the last epoch (it stops nothing)."""
    t, steps = spec.base["train"], spec.fewest_steps_per_epoch
    asha = spec.search.scheduler.asha
    if asha and asha.grace_period == spec.total_epochs:  # rungs are epochs before the last (asha_rungs)
        spec.warnings.append(
            f"search.scheduler.asha.grace_period: {asha.grace_period} is the last of the {spec.total_epochs} planned "
            f"epochs, so ASHA has no rung and stops nothing; give a grace period below {spec.total_epochs}, or "
            f"fifo: {{}} ({spec.source or 'study'})")
    xe_steps, total_steps = steps * t["xe_epochs"], steps * spec.total_epochs
    # a searched warmup: its largest value (as T_P's below), not the base's default, which no trial uses
    param = next((p for p in spec.params.values() if p.path == "train.warmup"), None)
    warmup, where = ((max(param.values), f"search.space.{param.key}: up to") if param is not None else
                     (t["warmup"], "train.warmup:"))
    if t["xe_epochs"] and warmup > xe_steps / 2:
        spec.warnings.append(
            f"{where} {warmup} steps is {warmup / xe_steps:.0%} of the {xe_steps} cross-entropy "
            f"steps a trial takes ({steps} a epoch x {t['xe_epochs']}): the learning rate peaks "
            f"{'after training ends' if warmup > xe_steps else 'late in training'} ({spec.source or 'study'})")
    if (tp := spec.temperature_range()) is not None and tp[1] > total_steps:
        param = next((p for p in spec.params.values() if p.path == "model.temperature"), None)
        where = f"search.space.{param.key}" if param is not None else "model.temperature"
        spec.warnings.append(
            f"{where}: T_P up to {tp[1]:g} steps reaches past the {total_steps} steps a trial takes: "
            f"exp_decay still keeps {math.exp(-total_steps / tp[1]):.0%} of the original attention when "
            f"training ends ({spec.source or 'study'})")


def check_fused(spec: StudySpec) -> None:
    """`resources.fuse_replicates` trains a configuration's seeds of a round in one trial, all at once (a later
    round's, `search.confirm`'s or adaptive replicates', in one more): it needs two or more seeds in the first round,
    and one worker a trial (`a2core.fused`)."""
    key = "resources.fuse_replicates"
    if spec.seed_rounds_trials[0][1] < 2:  # the first round's seeds (a later round's single seed trains alone)
        _fail(key, "fuses a configuration's replicate seeds: set search.replicates to 2 or more")
    if spec.resources.workers_per_trial > 1:
        _fail(key, "a fused trial trains on one worker: set resources.workers_per_trial: 1")
    searched = [v for p in spec.params.values() if p.path == "train.precision" for v in p.values]
    if "fp16" in (spec.base["train"].get("precision"), *searched):  # set in train, or a value of the space's
        _fail(key, "fp16's loss scaler skips a step for every seed when one overflows: use fp32 or bf16")


# -- search ------------------------------------------------------------------------------------------------------------
def _check_space(search: Search, sections: dict, saved: bool = False) -> dict[str, Param]:
    """The space's params, keyed and their `when` resolved; a config path has one setter: a key or replicates."""
    space, schema = search.space or {}, config_schema()
    setters = {SEED_PATH: "search.replicates"} if search.replicates is not None else {}  # config path -> setter
    for key, p in space.items():
        where = f"search.space.{key}"
        path = resolve_key(key)
        if path is None:
            _fail(where, f"unknown search key: neither an alias ({', '.join(ALIASES)}) nor a "
                             f"data./model./train. key of the config")
        if path in setters:
            _fail(where, f"names {path} like {setters[path]} already does")
        if path in SELECT_PATHS:
            _fail(where, f"a trial's best epoch is picked by search.metric and search.mode, which set {path}")
        if path in FIXED_PATHS:
            _fail(where, "the planned epochs must be the same for every trial (ASHA's budget and the "
                             "pruning rule depend on them); set it in train")
        if path in DATA_SET_PATHS:  # the plan priced a searched data.images at its schema default, too
            _fail(where, f"{path} decides which images the splits hold, and every trial of a study is ranked on the "
                         f"same val images and compared on the same test images; set it in data (another data set "
                         f"is another study)")
        allowed = get_args(schema[path]) if get_origin(schema[path]) is Literal else ()  # a fixed set of values
        kind = str if allowed else schema[path]
        # numbers from here on: '5e-3' and 0.005 are one value, listed twice (a saved study keeps its values: its
        # record's suggestions hold them)
        if p.categorical and kind is float and not saved:
            values = [_as_number(v) for v in p.values]
            try:
                _listed_once(values)
            except ConfigError as err:
                _fail(f"{where}.{p.kind}{err.path}", err.reason)
            setattr(p, p.kind, tuple(values))
        if not p.categorical and kind is int and p.kind != "randint":
            _fail(f"{where}.{p.kind}", f"{path} is an integer: use randint, grid or choice")
        if not p.categorical and kind in (str, bool):
            _fail(f"{where}.{p.kind}", f"{path} is a {'string' if kind is str else 'boolean'}: use grid or choice")
        if p.categorical and allowed and (wrong := [v for v in p.values if v not in allowed]):  # before any `when`
            listed = ", ".join(f"{v!r}" for v in allowed[:-1]) + f" or {allowed[-1]!r}"  # as a2core.config says it
            _fail(f"{where}.{p.kind}", f"{wrong[0]!r} gives an invalid {path}: unknown {path.split('.')[-1]} "
                                       f"{wrong[0]!r}: must be {listed}")
        setters[path] = where
        p._key = key
    for path, setter in setters.items():
        if (value := get_dotted(sections, path, _MISSING)) is not _MISSING:  # what to write instead, said too
            if not setter.startswith("search.space."):  # the seed, set by search.replicates: nothing to write
                _fail(path, f"is set by {setter}; remove it from {path.split('.')[0]}")
            one = (f"{setter}.grid=[{format_value(value)}]" if space[setter[len("search.space."):]].kind == "grid"
                   else f"'{setter}={{grid: [{format_value(value)}]}}'")
            _fail(path, f"is set by {setter}; remove it from {path.split('.')[0]} (to give every trial this "
                        f"value, write {one})")
    for p in space.values():
        if p.when is not None:
            p.when = _check_when(p, space)
    if not saved:  # a study saved before this check keeps its space: its status, record and resume read it
        _check_applicable(space, sections)
    return space


def _check_when(param: Param, space: dict[str, Param]) -> dict:
    """`when: {fusion: exp_decay}` -> {"fusion": ["exp_decay"]}, once every key of the space is known."""
    where = f"search.space.{param.key}.when"
    if not param.when:
        _fail(where, "must name at least one key")
    by_path = {p.path: p for p in space.values()}
    conditions = {}
    for other, allowed in param.when.items():
        if (target := by_path.get(resolve_key(other))) is None:
            _fail(f"{where}.{other}", f"not a key of the search space (keys: {', '.join(space)})")
        if target is param:
            _fail(f"{where}.{other}", "a key cannot depend on itself")
        if not target.categorical or target.when is not None:
            _fail(f"{where}.{other}", f"conditions may only name a grid or choice key without its own "
                                          f"`when`; search.space.{target.key} is not one")
        if param.kind == "grid" and target.kind != "grid":
            _fail(f"{where}.{other}", "a grid key may only depend on grid keys")
        allowed = allowed if isinstance(allowed, list) else [allowed]
        if config_schema()[target.path] is float:  # as the target's values (`_check_space`)
            allowed = [v if target.contains(v) else _as_number(v) for v in allowed]
        if not allowed:
            _fail(f"{where}.{other}", "must list at least one value")
        for v in allowed:
            if not target.contains(v):
                _fail(f"{where}.{other}", f"{v!r} is not one of search.space.{target.key}'s values "
                                              f"{list(target.values)}")
        conditions[target.key] = allowed
    return conditions


def _check_applicable(space: dict[str, Param], sections: dict) -> None:
    """A searched model key that some fusions do not use (`a2core.config.inapplicable_model_keys`: the mask
    network's keys for `none`, eta but for moving_average, T_P but for exp_decay) must not reach a trial of such a
    fusion: there it changes nothing (`applicable_config` leaves it out), so its values give one configuration that
    the plan would count, and the searcher run, once per value. The fusions a trial reaching the key can use: the
    fusion key's values, narrowed by the key's own `when` on it, or the one fixed fusion (model.fusion, else the
    schema default). A temperature whose `when` names the fusion key is left to the trial probes: a2core refuses
    T_P outside exp_decay itself, and the probe names the grid cell."""
    fusions = get_args(config_schema()["model.fusion"])
    fusion = next((p for p in space.values() if p.path == "model.fusion"), None)
    fixed = get_dotted(sections, "model.fusion", get_dotted(_schema_defaults(), "model.fusion"))
    for p in space.values():
        name = p.path.split(".", 1)[1] if p.path.startswith("model.") else None
        if name is None or not any(name in inapplicable_model_keys(f) for f in fusions):
            continue
        users = [f for f in fusions if name not in inapplicable_model_keys(f)]
        conditioned = fusion is not None and fusion.key in (p.when or {})
        if conditioned and name == "temperature":
            continue
        if fusion is None:
            if fixed not in fusions:  # an unknown fusion: the config check names it
                continue
            reach = [fixed]
        else:
            reach = list(p.when[fusion.key]) if conditioned else list(fusion.values)
            if fusion.when is not None and not conditioned and fixed in fusions:  # trials without the fusion key
                reach.append(fixed)
        if not (others := list(dict.fromkeys(f for f in reach if name in inapplicable_model_keys(f)))):
            continue
        listed = ", ".join(map(repr, users[:-1])) + (f" or {users[-1]!r}" if len(users) > 1 else repr(users[0]))
        what = "the temperature T_P" if name == "temperature" else f"model.{name}"
        if fusion is None:
            hint = (f"set model.fusion: {users[0]}" if len(users) == 1
                    else f"set model.fusion to one that uses it ({listed})") + f", or drop search.space.{p.key}"
        else:
            searched = [f for f in fusion.values if f in users and (not conditioned or f in reach)]
            if not searched and conditioned:
                searched = [f for f in fusion.values if f in users]
            if not searched:
                one = users[0] if len(users) == 1 else f"[{', '.join(users)}]"
                hint = (f"no value of search.space.{fusion.key} uses it: drop search.space.{p.key}, or add "
                        f"{listed} to search.space.{fusion.key} and `when: {{{fusion.key}: {one}}}` here")
            else:
                values = searched[0] if len(searched) == 1 else f"[{', '.join(searched)}]"
                hint = (f"narrow its `when` to `{{{fusion.key}: {values}}}`" if conditioned
                        else f"add `when: {{{fusion.key}: {values}}}`")
                if p.kind == "grid" and fusion.kind != "grid":  # `_check_when`: a grid key depends on grid keys
                    hint += f" (a grid key's `when` needs search.space.{fusion.key} to be a grid)"
        unused = ", ".join(map(repr, others[:-1])) + (f" and {others[-1]!r}" if len(others) > 1 else repr(others[0]))
        _fail(f"search.space.{p.key}", f"{what} is only used by fusion {listed}, but trials can use {unused}, where "
                                       f"it changes nothing (each of its values gives the same configuration there, "
                                       f"which the plan would count, and the search run, once per value): {hint}")


def _check_fixed_applicable(space: dict[str, Param], sections: dict) -> None:
    """A model key written in the model section, at a value other than its default, that no fusion a trial can use
    reads (`model: {fusion: max, eta: 0.3}`): every trial leaves it out (`applicable_config`), so it would be silently
    unused. At its default it passes, as `check_data_kind`'s keys do (a saved config holds every key)."""
    fusions = get_args(config_schema()["model.fusion"])
    model = sections.get("model") if isinstance(sections.get("model"), dict) else {}
    fixed = model.get("fusion", get_dotted(_schema_defaults(), "model.fusion"))
    fusion = next((p for p in space.values() if p.path == "model.fusion"), None)
    reach = list(fusion.values) + ([fixed] if fusion.when is not None else []) if fusion is not None else [fixed]
    if any(f not in fusions for f in reach):  # an unknown fusion: the config check names it
        return
    for name, value in model.items():
        if name == "temperature" or value == get_dotted(_schema_defaults(), f"model.{name}", value):
            continue  # a2core refuses a temperature outside exp_decay itself
        if all(name in inapplicable_model_keys(f) for f in reach):
            users = [f for f in fusions if name not in inapplicable_model_keys(f)]
            listed = ", ".join(map(repr, users[:-1])) + (f" or {users[-1]!r}" if len(users) > 1 else repr(users[0]))
            _fail(f"model.{name}", f"{format_value(value)} is only used by fusion {listed}, but every trial uses "
                                   f"{' or '.join(map(repr, dict.fromkeys(reach)))}, which leaves it out: it would "
                                   f"change nothing; drop model.{name}, or set a fusion that uses it")


def _check_points(search: Search, sampled: list[Param]) -> list[dict]:
    """Every point with every sampled key (missing ones at their default); without points, the defaults."""
    if search.points_to_evaluate is None:
        return [{p.key: p.default() for p in sampled}] if sampled else []
    points = []
    for i, point in enumerate(search.points_to_evaluate):
        full = {}
        for key, value in point.items():
            where = f"search.points_to_evaluate[{i}].{key}"
            if (p := next((q for q in sampled if q.path == resolve_key(key)), None)) is None:
                _fail(where, f"points may only set sampled keys of the space "
                                 f"({', '.join(q.key for q in sampled) or 'there are none'})")
            value = _as_number(value) if config_schema()[p.path] is float and not p.contains(value) else value
            if not p.contains(value):
                _fail(where, f"{value!r} is outside search.space.{p.key} ({p.kind} {list(p.values)})")
            full[p.key] = int(value) if p.kind == "randint" else value
        points.append({p.key: full.get(p.key, p.default()) for p in sampled})
    if sampled and search.algorithm != "grid" and len(points) > search.num_samples:
        _fail("search.points_to_evaluate", f"{len(points)} points but only {search.num_samples} samples per "
                                               f"cell (search.num_samples)")
    if sampled and search.algorithm == "grid" and not points:
        _fail("search.points_to_evaluate", "algorithm 'grid' runs the points: give at least one")
    return points


def _check_metric(spec: StudySpec, sections: dict) -> None:
    """search.metric is one that training reports; a diag/jsd/layer<i> a layer of every trial's model."""
    match = _JSD_METRIC.match(spec.metric)
    # searched, the layers are the space's: the fewest any trial has
    # (a value that is no number, [1, '2'], is left to the trial probes, which name it)
    searched = [min(v for v in p.values if _is_number(v)) for p in spec.params.values()
                if p.path == "model.layers" and any(_is_number(v) for v in p.values)]
    layers = searched[0] if searched else get_dotted(sections, "model.layers", get_dotted(_schema_defaults(),
                                                                                         "model.layers"))
    if match and isinstance(layers, int) and int(match.group(1)) >= layers:
        _fail("search.metric", f"{spec.metric}: the model has {layers} layers"
                               + (" in some trials (model.layers is searched)" if searched else ""))
    if not match and spec.metric not in METRICS:
        _fail("search.metric", f"{spec.metric!r} is not reported by training; one of {', '.join(METRICS)}, "
                               f"diag/jsd/layer<i>")


def _select_by_the_study_metric(search: Search, sections: dict) -> None:
    """A trial's best epoch (its best.pt, SCST's start, its test scores: a2core's train.select_metric) is the one
    the study ranks it by (search.metric and mode), so the record's best epoch is the one its test scores are of.
    A metric no epoch report carries (best/val/CIDEr, time/epoch_s, epoch, step) leaves a2core's val CIDEr."""
    if not search.metric.startswith(SELECTABLE):
        return
    train = sections.setdefault("train", {})
    for key, value in (("select_metric", search.metric), ("select_mode", search.mode)):
        if train.get(key, value) != value:
            _fail(f"train.{key}", f"{train[key]!r}, but search.{key[len('select_'):]} is {value!r}: a trial's best "
                                  f"epoch is the one the study ranks it by; drop train.{key}")
        train[key] = value


def asha_rungs(max_t: int, grace_period: int, reduction_factor: float) -> list[int]:
    """The epochs at which ASHA judges a trial: grace_period * reduction_factor**i below max_t, rounded up to whole
    epochs, each once (a factor below 2 can round two rungs to one epoch, or one up to max_t, where nothing is left to
    save: a group behind at its last epoch is not stopped early)."""
    rungs, t = [], float(grace_period)
    while (rung := math.ceil(t)) < max_t:
        if not rungs or rung > rungs[-1]:
            rungs.append(rung)
        t *= reduction_factor
    return rungs


def scheduler_rungs(spec: StudySpec) -> list[int]:
    """The epochs at which the study's scheduler may stop a trial ([] without early stopping); every trial has its
    diagnostics there (`launch.trainable.TrialPlan.config`)."""
    asha = spec.search.scheduler.asha
    return asha_rungs(spec.total_epochs, asha.grace_period, asha.reduction_factor) if asha else []


# -- every trial the space can produce ---------------------------------------------------------------------------------
def _check_trials(spec: StudySpec, sections: dict) -> dict:
    """Build a Config for every grid cell with the sampled keys at their ends, defaults, points and choices.
    Returns the base: the sections with defaults filled in and the space's keys at their schema defaults."""
    try:  # the sections alone (space keys at their defaults): errors that no grid cell causes
        check_runnable(_trial_config(spec, sections).to_dict())
    except ConfigError as err:
        space_paths = {p.path for p in spec.params.values()}
        if err.path not in space_paths and not any(err.path in pair and pair & space_paths for pair in _COUPLED):
            raise
    first: Config | None = None
    for cell in spec.grid_cells():
        for assignment in _probes(spec, cell):
            raw = copy.deepcopy(sections)
            for key, value in assignment.items():
                set_dotted(raw, spec.params[key].path, value)
            try:
                cfg = _trial_config(spec, raw)
                check_runnable(cfg.to_dict())
            except ConfigError as err:
                _explain(err, spec, cell, assignment)
            first = first or cfg
    base = first.to_dict()
    for p in spec.params.values():
        set_dotted(base, p.path, get_dotted(_schema_defaults(), p.path))
    return base


def _trial_config(spec: StudySpec, raw: dict) -> Config:
    """The Config of one trial's sections. With ASHA, every trial has its diagnostics at the rungs
    (`launch.trainable.TrialPlan.config`), so a diag/ select metric that no other XE epoch reports still gives SCST a
    best XE checkpoint to start from: a2core's check (`check_select_metric`) is asked again with them counted."""
    try:
        return Config.from_dict(raw, source=spec.source)
    except ConfigError as err:
        asha = spec.search.scheduler.asha
        if err.path != "train.select_metric" or asha is None:
            raise
        # the fields validated (a2core checks the metric after them): the epoch counts are ints
        total = sum(get_dotted(raw, key, get_dotted(_schema_defaults(), key))
                    for key in ("train.xe_epochs", "train.scst_epochs"))
        with_rungs = copy.deepcopy(raw)
        train = with_rungs.setdefault("train", {})
        train["diag_epochs"] = sorted(set(train.get("diag_epochs") or [])
                                      | set(asha_rungs(total, asha.grace_period, asha.reduction_factor)))
        try:
            return Config.from_dict(with_rungs, source=spec.source)
        except ConfigError:
            raise err from None


def check_runnable(config: dict, source: str | None = None) -> None:
    """Refuse a config (a2core's, as a dict) that validates but cannot run: a size past its `SIZE_CAPS` cap, or SCST
    with no XE checkpoint to start from. A ConfigError naming the key, before any data is made or trial placed."""
    train = config["train"]
    if train["xe_epochs"] == 0 and train["scst_epochs"] and not train.get("scst_from"):
        # a2core's Trainer would fail at the switch with "no checkpoint" (tests build such configs and set it later)
        raise ConfigError("train.scst_from", f"xe_epochs is 0, so SCST (scst_epochs {train['scst_epochs']}) has "
                                             f"no XE checkpoint of this run to start from: name one here, or "
                                             f"train xe_epochs >= 1 first", source)
    for path, (cap, why) in SIZE_CAPS.items():
        if path == "data.images" and get_dotted(config, "data.kind") != "synthetic":
            continue  # a COCO study's images are its captions file's
        value = get_dotted(config, path)
        if isinstance(value, (int, float)) and value > cap:
            raise ConfigError(path, f"{format_value(value)} is past the cap of {cap:,} ({why}); the caps: "
                                    f"docs/reference/study-file.md, \"Sizes it refuses\"", source)


def _probes(spec: StudySpec, cell: dict) -> list[dict]:
    picks = [lambda p: p.default(), lambda p: p.values[0], lambda p: p.values[-1]]
    picks += [lambda p, point=point: point[p.key] for point in spec.search.points_to_evaluate]
    # every value of every choice key, in a trial where that key exists (the keys its `when` names set so)
    picks += [lambda p, c=c, v=v: v if p is c else (c.when or {}).get(p.key, p.values)[0]
              for c in spec.sampled_params if c.kind == "choice" for v in c.values]
    return _distinct_dicts({**cell, **spec.fill(cell, pick)} for pick in picks)


def _explain(err: ConfigError, spec: StudySpec, cell: dict, assignment: dict):
    """Re-raise a probe's error at the space key that caused it, else at the config key with its cell."""
    for key, value in assignment.items():
        p = spec.params[key]
        if p.path == err.path:
            _fail(f"search.space.{key}.{p.kind}", f"{value!r} gives an invalid {p.path}: {err.reason}"
                      + (f" (grid cell {spec.cell_label(cell)})" if cell and key not in cell else ""))
    context = f" (grid cell {spec.cell_label(cell)})" if cell else ""
    if sampled := {k: v for k, v in assignment.items() if k not in cell}:
        context += f" (with {', '.join(f'{k}={format_value(v)}' for k, v in sampled.items())})"
    # train.select_metric is set from search.metric (`_select_by_the_study_metric`): the key the file holds
    path = "search.metric" if err.path == "train.select_metric" and spec.metric.startswith(SELECTABLE) else err.path
    raise ConfigError(path, f"{err.reason}{context}", err.source or spec.source) from None


def _check_data(base: dict, check_files: bool) -> dict | None:
    """The data files of a COCO study; its captions' splits, read once (None when there are none to read)."""
    data = base["data"]
    if data["kind"] != "coco":
        return None
    for key in ("captions", "features", "test_images"):
        path = data.get(key)
        found = path is None or Path(path).is_file() or (key == "features" and Path(path).is_dir())
        if check_files and not found:
            what = "HDF5 file, .npz directory or prepared store" if key == "features" else "file"
            _fail(f"data.{key}", folder_instead(path, what) or f"{path}: no such {what}")
    if not Path(data["captions"]).is_file():
        return None
    if is_prepared(data["features"]):
        try:  # an incomplete or damaged copy fails here, naming its file (the full checksum: `a2 data fetch`)
            check_copy(data["features"])
        except DataError as err:
            _fail("data.features", str(err))
    try:  # the captions themselves: malformed entries and empty train or val splits fail here, not in a trial
        splits = read_karpathy(data["captions"])
        require_splits(splits, data["captions"])
    except DataError as err:
        _fail("data.captions", str(err))
    scst_from = base["train"].get("scst_from")
    if scst_from and check_files and not Path(scst_from).exists():
        _fail("train.scst_from", f"{scst_from}: no such checkpoint")
    return splits


def _fail(path: str, message: str):
    raise ConfigError(path, message)  # `from_dict` adds the file


def _resolve_storage(spec: StudySpec, check_files: bool) -> None:
    """`storage` as an absolute local path or s3://bucket/prefix without a trailing slash. The shipped files'
    placeholder bucket is refused unless the files are not checked (`a2 study plan` prices a study before any of it
    exists)."""
    if re.match(_SCHEME + "//", spec.storage):
        try:
            refuse_placeholder(spec.storage)
            if not _S3.match(spec.storage):
                _fail("storage", f"must be a local path or s3://bucket/prefix, got {spec.storage!r}")
        except StorageError as err:
            if check_files:
                _fail("storage", f"{err} (in the file, or `storage=s3://your-bucket/a2-studies`)")
        spec.storage = spec.storage.rstrip("/")
    else:
        # a local root that can hold a study: no file where it or a folder above it should be, and reachable (a
        # folder this user may not enter fails here, not as a traceback of the first write)
        storage = spec.storage = os.path.abspath(os.path.expanduser(spec.storage))
        path = Path(storage)
        try:
            folder = next(f for f in [path, *path.parents] if f.exists())  # the root, at the latest
            if not folder.is_dir():
                _fail("storage", f"{storage}: {folder} is a file, not a directory" if folder != path
                      else f"{storage} exists and is not a directory")
        except PermissionError as err:
            _fail("storage", f"{storage}: cannot be reached ({err.strerror})")
    if spec.storage_endpoint_url is not None and not spec.storage.startswith("s3://"):
        _fail("storage_endpoint_url", "only used with s3:// storage")


def machine_resources() -> dict:
    """What a local Ray on this machine has (`launch.raycluster.connect` starts it with every CPU): CPUs, and the GPUs
    CUDA_VISIBLE_DEVICES lets through, else those the NVIDIA driver lists (none without one). No Ray needed."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    installed = len(list(Path("/proc/driver/nvidia/gpus").glob("*")))
    if visible is not None:
        listed = [d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")]
        installed = min(len(listed), installed) if installed else len(listed)
    return {"CPU": float(os.cpu_count() or 1), "GPU": float(installed)}


def runs_locally(spec: StudySpec, address: str | None = None) -> bool:
    """Whether `a2 study run` would run the study on a new local Ray on this machine: no cluster address (nor
    $RAY_ADDRESS) and a local storage folder (a cluster's nodes share storage through s3://)."""
    return not (address or os.environ.get("RAY_ADDRESS")) and "://" not in str(spec.storage)


def check_machine(spec: StudySpec) -> None:
    """A local study's trial against this machine (`machine_resources`), before Ray starts and before the study's
    folder exists: a trial asking more CPUs or GPUs than the machine has would wait forever."""
    check_cluster(spec, machine_resources(), "this machine")


def check_cluster(spec: StudySpec, cluster: dict, where: str = "the cluster", can_add: dict | None = None) -> list[str]:
    """A validated study against the resources of the cluster it will run on (`ray.cluster_resources()`): a trial
    that asks more than the whole cluster has, or can have, would wait forever (ConfigError naming the key and the
    file). `can_add`: what the cluster's autoscaler may still add, by resource (`launch.raycluster.autoscaler_limits`;
    math.inf where a node type leaves Ray to detect it): a GPU study submitted to an autoscaling cluster whose head
    has no GPU waits for the workers instead of being refused. Returns a line for each resource the trials wait for."""
    r, need = spec.resources, spec.trial_resources()
    waits = []
    for kind, key in (("CPU", "cpus_per_worker"), ("GPU", "gpus_per_worker")):
        have = float(cluster.get(kind, 0))
        if need[kind] <= have + 1e-9:
            continue
        more = float((can_add or {}).get(kind, 0))
        asked = (f"a trial needs {r.workers_per_trial} workers x {format_value(getattr(r, key))} {kind}"
                 + (f" + {format_value(r.driver_cpus)} (driver)" if kind == "CPU" and spec.has_train_driver else "")
                 + f" = {format_value(need[kind])} {kind}s")
        if need[kind] > have + more + 1e-9:
            added = f" (and its autoscaler can add {format_value(more)})" if can_add is not None else ""
            raise ConfigError(f"resources.{key}", f"{asked} but {where} has {format_value(have)}{added}", spec.source)
        added = "nodes whose resources Ray detects when they join" if math.isinf(more) else format_value(more)
        waits.append(f"{asked}; {where} has {format_value(have)} now and its autoscaler can add {added}: trials "
                     f"wait for the worker nodes it starts")
    return waits
