"""Study files: their schema, their complete validation, and the search space they describe.

A study file holds the `data` / `model` / `train` sections of an `a2core` config (the *base* of every trial),
plus `search`, `resources`, `tracking` and `storage`:

    name: a2-lambda-sweep                 # [a-z0-9-], at most 64 characters: it names paths and MLflow objects
    data: {...}  model: {...}  train: {...}
    search:
      metric: val/CIDEr                   # a metric that a2core.train reports after every epoch
      mode: max                           # max | min
      algorithm: optuna                   # optuna (TPE) | random | grid
      num_samples: 4                      # samples of the sampled keys per grid cell
      seed: 0                             # searcher seed (cell i uses seed + i)
      space:
        fusion: {grid: [max, gate]}
        lambda: {loguniform: [0.005, 0.2]}
        temperature: {loguniform: [1000, 50000], when: {fusion: exp_decay}}
        seed: {grid: [0, 1]}
      points_to_evaluate: [{lambda: 0.035}]    # optional, per cell, before anything is sampled
      replicates: 3                       # optional: every configuration runs with seeds 0, 1, 2 (or a list)
      scheduler: {asha: {grace_period: 2, reduction_factor: 2, min_gap_se: 2}}   # or {fifo: {}}
    resources: {workers_per_trial: 4, cpus_per_worker: 1, gpus_per_worker: 1, max_concurrent_trials: 8,
                max_failures: 1, driver_cpus: 0.01}   # driver_cpus: the trial's Tune driver function
    # optional: price_per_hour (of a worker node, one trial per node) -> a cost estimate in status and summary
    tracking: {mlflow_uri: sqlite:///mlflow.db, experiment: null}
    storage: s3://bucket/prefix           # or a local directory
    storage_endpoint_url: null            # S3-compatible endpoint (MinIO, moto, ...)

The search space
----------------
A key of `search.space` is an alias (`fusion`, `lambda`, `eta`, `temperature`, `seed`) or a dotted path into
`data` / `model` / `train` that exists in the schema (`model.dropout`). Its value has exactly one distribution:

- `grid: [..]`  crossed with the other grid keys: the *grid cells*, every one of which runs;
- `choice: [..]`, `uniform: [lo, hi]`, `loguniform: [lo, hi]` (lo > 0), `randint: [lo, hi]` (both ends
  included, as in Optuna): the *sampled* keys, `num_samples` times per cell;

and optionally `when: {key: value | [values]}`: the key only exists in trials where that (unconditional grid
or choice) key has one of those values, e.g. the exp_decay temperature T_P. A key that the space controls may
not also be set in `data` / `model` / `train` (the file would say two things about it).

`points_to_evaluate` are the first suggestions of every cell (keys: sampled keys; missing ones take their
default). Without it, one point: the defaults, i.e. the paper's values from the a2core schema (lambda 0.035,
eta 0.1, ...) where the range contains them, else the middle of the range (geometric middle for loguniform).
With `algorithm: grid` the points are all that runs: one trial per cell and point.

`replicates: N` (or a list of distinct seeds) runs every configuration, i.e. every suggestion of the searcher,
once per seed (0..N-1, or the list): the replicates of a configuration form a group that the searcher and the
scheduler judge by its mean (see `launch.search`). The seed then comes from the replicate, so the space may not
also hold `seed` (`train.seed`).

Cells where no sampled key is active (e.g. `fusion: none` when lambda is conditioned on the other fusions) run
once. `num_trials` counts it all (configurations x replicates); the Tune `num_samples` is that number.

Validation
----------
`load_study` validates everything before anything starts Ray (this module never imports ray): unknown keys at
every level, types, ranges, that every trial the space can produce is a valid `a2core.config.Config` (every
grid cell with its sampled keys at the ends of their ranges, at their defaults, at every point and every
choice), data files of `kind: coco`, resources (also against a known cluster size), tracking and storage. Errors
are `ConfigError`s naming the dotted key (`search.space.lambda.loguniform`) and the file.

The planned epochs (`train.xe_epochs`, `train.scst_epochs`) cannot be searched: ASHA's `max_t` and the rule
that tells Optuna a stopped trial was pruned both need one number for the whole study (`total_epochs`).

Relative paths (storage, data files, a sqlite tracking database) are made absolute against the current
directory, because trials run in other working directories and on other machines. `tracking.mlflow_uri: null`
takes `$MLFLOW_TRACKING_URI` at load time (else `sqlite:///mlflow.db`); the resolved study (`to_dict()`) holds
the result, so a resumed study tracks to the same place.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import os
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from a2core.config import Config, ConfigError, applicable_config, apply_overrides, get_dotted, load_yaml, set_dotted
from a2core.data.captions import read_karpathy, require_splits
from a2core.errors import DataError

ALIASES = {
    "fusion": "model.fusion",
    "lambda": "model.lambda",
    "eta": "model.eta",
    "temperature": "model.temperature",
    "seed": "train.seed",
}
DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform", "randint")
SAMPLED_DISTRIBUTIONS = ("choice", "uniform", "loguniform", "randint")
ALGORITHMS = ("optuna", "random", "grid")
MODES = ("max", "min")
SCHEDULERS = ("asha", "fifo")
SECTIONS = ("data", "model", "train")
TOP_KEYS = ("name", *SECTIONS, "search", "resources", "tracking", "storage", "storage_endpoint_url")
SEARCH_KEYS = ("metric", "mode", "algorithm", "num_samples", "seed", "space", "points_to_evaluate", "replicates",
               "scheduler")
SEED_PATH = "train.seed"  # set by the replicate index when search.replicates is given
# Keys the space may not control: the scheduler's time budget and the pruning rule depend on the planned epochs.
FIXED_PATHS = ("train.xe_epochs", "train.scst_epochs")

# What a2core.train reports after every epoch (see the contract of `a2core.train.train`).
METRICS = (
    "val/CIDEr", "val/BLEU-1", "val/BLEU-2", "val/BLEU-3", "val/BLEU-4", "val/METEOR", "val/ROUGE-L",
    "best/val/CIDEr", "train/loss", "train/mask_loss", "train/mask_mean", "time/epoch_s", "epoch", "step",
)
_JSD_METRIC = re.compile(r"^diag/jsd/layer(\d+)$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
NAME_MAX = 64

RESOURCE_DEFAULTS = {
    "workers_per_trial": 1,
    "cpus_per_worker": 1,
    "gpus_per_worker": 0,
    "max_concurrent_trials": 1,
    "max_failures": 1,  # Tune retries of a failed trial (Ray Train retries its worker group as often); -1 = forever
    "driver_cpus": 0.01,  # the trial's small Tune driver function (a bare {"CPU": 0} is refused by Ray)
    "price_per_hour": None,  # of a worker node (one trial per node): the study's cost estimate; absent if not given
}
# asha: the replicate-group ASHA of launch.search; min_gap_se = k in its stopping rule gap > k * s_pooled * sqrt(2/n).
SCHEDULER_DEFAULTS = {"asha": {"grace_period": 1, "reduction_factor": 2, "min_gap_se": 2.0},
                      "fifo": {}}
DEFAULT_STORAGE = "a2-studies"
DEFAULT_MLFLOW_URI = "sqlite:///mlflow.db"
_MLFLOW_SCHEMES = ("sqlite", "http", "https", "file", "postgresql", "postgres", "mysql", "mssql", "databricks")
_S3 = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(/.*)?$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")

_MISSING = object()
# Config checks that involve two keys: an error at the first may come from the second being in the space.
_COUPLED = {
    "model.temperature": ("model.fusion",),
    "model.fusion": ("model.temperature",),
    "model.heads": ("model.d_model",),
    "model.d_model": ("model.heads",),
    "train.scst_samples": ("train.scst_baseline",),
}


# -- the schema of data/model/train, read from a2core's dataclasses ------------------------------------------------
@lru_cache(maxsize=1)
def config_schema() -> dict[str, type]:
    """`{"model.lambda": float, "train.seed": int, "data.root": str, ...}` (Optional[X] -> X)."""
    out: dict[str, type] = {}
    hints = get_type_hints(Config)
    for section in SECTIONS:
        cls = hints[section]
        section_hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = section_hints[f.name]
            args = get_args(tp)
            if get_origin(tp) is not None and type(None) in args:
                (tp,) = [a for a in args if a is not type(None)]
            out[f"{section}.{f.metadata.get('key', f.name)}"] = tp
    return out


@lru_cache(maxsize=1)
def _schema_defaults() -> dict:
    return Config().to_dict()


def resolve_key(key: str) -> str | None:
    """The dotted config path of a space key (alias or path), or None when it names nothing in the schema."""
    path = ALIASES.get(key, key)
    return path if path in config_schema() else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool))


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# -- one key of the search space ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    key: str  # as written in the study (alias or dotted path); also the key in suggestions and Optuna
    path: str  # dotted config path
    kind: str  # grid | choice | uniform | loguniform | randint
    values: tuple = ()  # grid / choice
    low: float | int | None = None  # uniform / loguniform / randint
    high: float | int | None = None
    when: tuple = ()  # ((space key, (allowed values...)), ...)

    @property
    def sampled(self) -> bool:
        return self.kind != "grid"

    @property
    def categorical(self) -> bool:
        return self.kind in ("grid", "choice")

    @property
    def conditions(self) -> dict[str, tuple]:
        return dict(self.when)

    def active(self, assignment: dict) -> bool:
        """Whether this key exists in a trial whose other keys are `assignment`."""
        return all(assignment.get(k, _MISSING) in allowed for k, allowed in self.when)

    def possibly_active(self, cell: dict) -> bool:
        """Whether this key can exist in a grid cell (conditions on sampled keys are undecided there)."""
        return all(k not in cell or cell[k] in allowed for k, allowed in self.when)

    def contains(self, value: Any) -> bool:
        if self.categorical:
            return any(value == v and type(value) is type(v) for v in self.values) or (
                _is_number(value) and any(_is_number(v) and value == v for v in self.values))
        if not _is_number(value):
            return False
        if self.kind == "randint" and not float(value).is_integer():
            return False
        return self.low <= value <= self.high

    def center(self) -> Any:
        if self.categorical:
            return self.values[0]
        if self.kind == "randint":
            return (self.low + self.high) // 2
        if self.kind == "loguniform":
            return float(f"{math.sqrt(self.low * self.high):.6g}")
        return float(f"{(self.low + self.high) / 2:.6g}")

    def default(self) -> Any:
        """The paper's value (a2core's schema default) when the distribution contains it, else `center()`."""
        value = get_dotted(_schema_defaults(), self.path)
        if value is not None and self.contains(value):
            return int(value) if self.kind == "randint" else value
        return self.center()

    def ends(self) -> tuple[Any, Any]:
        if self.categorical:
            return self.values[0], self.values[-1]
        return self.low, self.high

    def to_dict(self) -> dict:
        out: dict[str, Any] = {self.kind: list(self.values) if self.categorical else [self.low, self.high]}
        if self.when:
            out["when"] = {k: list(v) for k, v in self.when}
        return out


# -- the spec ---------------------------------------------------------------------------------------------------------
@dataclass
class StudySpec:
    name: str
    base: dict  # a2core config as a plain dict: defaults filled in; keys the space controls at schema defaults
    search: dict  # normalised: metric, mode, algorithm, num_samples, seed, space, points_to_evaluate, scheduler
    resources: dict
    tracking: dict  # mlflow_uri (resolved), experiment (default: the study name)
    storage: str  # absolute local path or s3://bucket/prefix
    storage_endpoint_url: str | None
    source: str | None  # the study file
    raw: dict  # the resolved study, as `to_dict()` returns it
    params: dict[str, Param] = field(default_factory=dict, repr=False)

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, source: str | None = None, cluster_resources: dict | None = None) -> "StudySpec":
        return _Loader(source).load(raw, cluster_resources)

    # -- the space ----------------------------------------------------------------------------------------------
    @property
    def metric(self) -> str:
        return self.search["metric"]

    @property
    def mode(self) -> str:
        return self.search["mode"]

    @property
    def algorithm(self) -> str:
        return self.search["algorithm"]

    @property
    def grid_params(self) -> list[Param]:
        """Grid keys: unconditional ones first, in file order."""
        ps = [p for p in self.params.values() if not p.sampled]
        return [p for p in ps if not p.when] + [p for p in ps if p.when]

    @property
    def sampled_params(self) -> list[Param]:
        """Sampled keys in the order a define-by-run space asks them: unconditional ones first."""
        ps = [p for p in self.params.values() if p.sampled]
        return [p for p in ps if not p.when] + [p for p in ps if p.when]

    @property
    def grid_keys(self) -> list[str]:
        return [p.key for p in self.grid_params]

    @property
    def sampled_keys(self) -> list[str]:
        return [p.key for p in self.sampled_params]

    def grid_cells(self) -> list[dict]:
        """Every combination of the grid keys (a conditional grid key only where its condition holds).

        `[{}]` when the space has no grid keys: the whole study is one cell.
        """
        uncond = [p for p in self.grid_params if not p.when]
        cells = [dict(zip([p.key for p in uncond], combo)) for combo in itertools.product(*(p.values for p in uncond))]
        for p in self.grid_params:
            if p.when:
                cells = [new for c in cells for new in ([{**c, p.key: v} for v in p.values] if p.active(c) else [c])]
        return cells

    def has_sampled(self, cell: dict) -> bool:
        return any(p.possibly_active(cell) for p in self.sampled_params)

    def active_sampled(self, assignment: dict) -> list[Param]:
        return [p for p in self.sampled_params if p.active(assignment)]

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
        out: list[dict] = []
        for point in self.search["points_to_evaluate"]:
            reduced = self.fill(cell, lambda p: point[p.key])
            if reduced not in out:
                out.append(reduced)
        return out

    def samples_per_cell(self, cell: dict) -> int:
        if not self.has_sampled(cell):
            return 1
        if self.algorithm == "grid":
            return max(1, len(self.points_for_cell(cell)))
        return self.search["num_samples"]

    @property
    def replicate_seeds(self) -> list[int]:
        """The seeds every configuration runs with (`search.replicates`); [] when the study has no replicates."""
        return list(self.search.get("replicates", []))

    @property
    def num_configs(self) -> int:
        return sum(self.samples_per_cell(c) for c in self.grid_cells())

    @property
    def num_trials(self) -> int:
        return self.num_configs * max(1, len(self.replicate_seeds))

    @property
    def total_epochs(self) -> int:
        """The planned epochs of every trial (XE + SCST): ASHA's max_t; fewer means the trial was stopped."""
        return int(self.base["train"]["xe_epochs"]) + int(self.base["train"]["scst_epochs"])

    @property
    def is_s3(self) -> bool:
        return self.storage.startswith("s3://")

    def cell_label(self, cell: dict) -> str:
        return ",".join(f"{k}={_fmt(v)}" for k, v in cell.items()) or "all"

    def path_of(self, key: str) -> str:
        if key in self.params:
            return self.params[key].path
        path = resolve_key(key)
        if path is None:
            raise ConfigError(key, "not a key of the search space, an alias or a data/model/train path", self.source)
        return path

    def trial_config(self, sampled: dict[str, Any]) -> dict:
        """The validated a2core config (plain dict) of one suggestion, e.g. `{"fusion": "gate", "lambda": 0.03}`,
        without the model keys its fusion does not use (`a2core.config.applicable_config`: a fusion-none trial
        has no lambda, only exp_decay has a temperature, only moving_average an eta)."""
        raw = copy.deepcopy(self.base)
        for key, value in sampled.items():
            set_dotted(raw, self.path_of(key), value)
        return applicable_config(Config.from_dict(raw, source=self.source).to_dict())

    def trial_resources(self) -> dict:
        """Total resources of one trial: its workers plus its Tune driver function."""
        r = self.resources
        return {
            "CPU": r["workers_per_trial"] * r["cpus_per_worker"] + r["driver_cpus"],
            "GPU": r["workers_per_trial"] * r["gpus_per_worker"],
        }

    def summary(self) -> str:
        cells = self.grid_cells()
        sampled = ", ".join(self.sampled_keys) or "none"
        seeds = self.replicate_seeds
        replicas = f" = {self.num_configs} configurations x {len(seeds)} seeds" if seeds else ""
        return (f"OK {self.name}: {self.num_trials} trials{replicas} in {len(cells)} grid "
                f"cell{'s' if len(cells) != 1 else ''}"
                f" ({self.algorithm}; sampled: {sampled}; {self.mode} {self.metric}; storage {self.storage})")

    def to_dict(self) -> dict:
        return copy.deepcopy(self.raw)


# -- loading -----------------------------------------------------------------------------------------------------------
def load_study(path: str | Path, overrides: list[str] | tuple = (), cluster_resources: dict | None = None) -> StudySpec:
    """Read, override (`key=value`, applied to the YAML before validation) and validate a study file."""
    source = str(path)
    raw = load_yaml(path)
    try:
        raw = apply_overrides(raw, list(overrides), source=source)
    except ConfigError as err:
        raise ConfigError(err.path, f"{err.reason} (in an override)", err.source or source) from None
    return StudySpec.from_dict(raw, source=source, cluster_resources=cluster_resources)


def validate_main(path: str | Path, overrides: list[str] | tuple = (), cluster_resources: dict | None = None,
                  out=None, err=None) -> int:
    """Print a one-line summary of a valid study (exit 0), or its first error (exit 2)."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        spec = load_study(path, overrides, cluster_resources=cluster_resources)
    except ConfigError as error:
        print(f"error: {error}", file=err)
        return 2
    print(spec.summary(), file=out)
    return 0


class _Loader:
    def __init__(self, source: str | None):
        self.source = source

    def fail(self, path: str, message: str):
        raise ConfigError(path, message, self.source)

    # -- small checks ---------------------------------------------------------------------------------------------
    def mapping(self, value: Any, path: str, allow_none: bool = True) -> dict:
        if value is None and allow_none:
            return {}
        if not isinstance(value, dict):
            self.fail(path, f"must be a mapping, got {type(value).__name__}")
        for key in value:
            if not isinstance(key, str):
                self.fail(f"{path}.{key}", "keys must be strings")
        return value

    def known(self, value: dict, path: str, keys) -> None:
        unknown = [k for k in value if k not in keys]
        if unknown:
            self.fail(f"{path}.{unknown[0]}" if path else unknown[0], f"unknown key; known keys here: {', '.join(keys)}")

    def integer(self, value: Any, path: str, minimum: int | None = None) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(path, f"must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            self.fail(path, f"must be >= {minimum}, got {value}")
        return value

    def number(self, value: Any, path: str) -> float | int:
        if isinstance(value, str):  # YAML 1.1 reads "5e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if not _is_number(value) or not math.isfinite(value):
            self.fail(path, f"must be a number, got {value!r}")
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            self.fail(path, f"must be a non-empty string, got {value!r}")
        return value

    # -- the whole file --------------------------------------------------------------------------------------------
    def load(self, raw: Any, cluster_resources: dict | None) -> StudySpec:
        if not isinstance(raw, dict):
            self.fail("", f"a study must be a mapping, got {type(raw).__name__}")
        raw = self.mapping(raw, "", allow_none=False)
        self.known(raw, "", TOP_KEYS)
        name = self.check_name(raw.get("name"))
        sections = {s: copy.deepcopy(self.mapping(raw.get(s), s)) for s in SECTIONS}
        self.resolve_paths(sections)
        search_raw = self.mapping(raw.get("search"), "search")
        self.known(search_raw, "search", SEARCH_KEYS)
        params = self.check_space(search_raw.get("space"), sections)
        search = self.check_search(search_raw, params, sections)
        spec = StudySpec(name=name, base={}, search=search, resources={}, tracking={}, storage="",
                         storage_endpoint_url=None, source=self.source, raw={}, params=params)
        spec.base = self.check_trials(spec, sections)
        self.check_data(spec.base)
        self.check_metric(search["metric"], spec.base)
        self.check_scheduler_budget(search["scheduler"], spec.total_epochs)
        spec.resources = self.check_resources(raw.get("resources"), cluster_resources)
        spec.tracking = self.check_tracking(raw.get("tracking"), name)
        spec.storage, spec.storage_endpoint_url = self.check_storage(raw.get("storage", DEFAULT_STORAGE),
                                                                     raw.get("storage_endpoint_url"))
        spec.raw = {
            "name": name,
            **_sections_without(spec.base, [p.path for p in params.values()]),
            "search": copy.deepcopy(search),
            "resources": dict(spec.resources),
            "tracking": dict(spec.tracking),
            "storage": spec.storage,
            "storage_endpoint_url": spec.storage_endpoint_url,
        }
        return spec

    def check_name(self, name: Any) -> str:
        if name is None:
            self.fail("name", "required: the study's name ([a-z0-9-])")
        if not isinstance(name, str) or not _NAME.match(name):
            self.fail("name", f"must be lowercase letters, digits and '-' (starting with a letter or digit), got {name!r}")
        if len(name) > NAME_MAX:
            self.fail("name", f"at most {NAME_MAX} characters, got {len(name)}")
        return name

    def resolve_paths(self, sections: dict) -> None:
        """Relative data paths become absolute (trials run in other working directories)."""
        keys = [("data", k) for k in ("captions", "features", "test_images", "root")] + [("train", "scst_from")]
        for section, key in keys:
            value = sections[section].get(key)
            if isinstance(value, str) and value and "://" not in value:
                sections[section][key] = os.path.abspath(os.path.expanduser(value))

    # -- search ---------------------------------------------------------------------------------------------------
    def check_space(self, space: Any, sections: dict) -> dict[str, Param]:
        space = self.mapping(space, "search.space")
        schema = config_schema()
        paths: dict[str, str] = {}  # path -> key
        entries: dict[str, tuple[str, dict]] = {}
        for key, entry in space.items():
            where = f"search.space.{key}"
            path = resolve_key(key)
            if path is None:
                self.fail(where, f"unknown search key: neither an alias ({', '.join(ALIASES)}) nor a "
                                 f"data./model./train. key of the config")
            if path in paths:
                self.fail(where, f"names {path} like search.space.{paths[path]} already does")
            if path in FIXED_PATHS:
                self.fail(where, "the planned epochs must be the same for every trial (ASHA's budget and the "
                                 "pruning rule depend on them); set it in train")
            if get_dotted(sections, path, _MISSING) is not _MISSING:
                self.fail(path, f"is set by search.space.{key}; remove it from {path.split('.')[0]}")
            paths[path] = key
            entry = self.mapping(entry, where, allow_none=False)
            self.known(entry, where, (*DISTRIBUTIONS, "when"))
            kinds = [k for k in DISTRIBUTIONS if k in entry]
            if len(kinds) != 1:
                self.fail(where, f"needs exactly one distribution of {', '.join(DISTRIBUTIONS)}, got "
                                 f"{', '.join(kinds) or 'none'}")
            entries[key] = (path, entry)

        params: dict[str, Param] = {}
        for key, (path, entry) in entries.items():
            (kind,) = [k for k in DISTRIBUTIONS if k in entry]
            where = f"search.space.{key}.{kind}"
            value = entry[kind]
            tp = schema[path]
            if kind in ("grid", "choice"):
                if not isinstance(value, list) or not value:
                    self.fail(where, f"must be a non-empty list of values, got {value!r}")
                for i, v in enumerate(value):
                    if not _is_scalar(v):
                        self.fail(f"{where}[{i}]", f"must be a number, string or boolean, got {v!r}")
                    if any(v == w and type(v) is type(w) for w in value[:i]):
                        self.fail(f"{where}[{i}]", f"{v!r} is listed twice")
                params[key] = Param(key, path, kind, values=tuple(value))
            else:
                if not isinstance(value, list) or len(value) != 2:
                    self.fail(where, f"must be [low, high], got {value!r}")
                lo, hi = self.number(value[0], f"{where}[0]"), self.number(value[1], f"{where}[1]")
                if kind == "randint":
                    lo, hi = self.integer(lo, f"{where}[0]"), self.integer(hi, f"{where}[1]")
                else:
                    lo, hi = float(lo), float(hi)
                if lo >= hi:
                    self.fail(where, f"low must be < high, got [{_fmt(lo)}, {_fmt(hi)}]")
                if kind == "loguniform" and lo <= 0:
                    self.fail(where, f"loguniform needs low > 0, got {_fmt(lo)}")
                if tp is int and kind != "randint":
                    self.fail(where, f"{path} is an integer: use randint, grid or choice")
                if tp in (str, bool):
                    self.fail(where, f"{path} is a {'string' if tp is str else 'boolean'}: use grid or choice")
                params[key] = Param(key, path, kind, low=lo, high=hi)

        # `when` conditions, once every key is known.
        by_path = {p.path: p for p in params.values()}
        for key, (path, entry) in entries.items():
            if "when" not in entry:
                continue
            where = f"search.space.{key}.when"
            when = self.mapping(entry["when"], where, allow_none=False)
            if not when:
                self.fail(where, "must name at least one key")
            conditions = []
            for other, allowed in when.items():
                other_path = resolve_key(other)
                target = by_path.get(other_path) if other_path else None
                if target is None:
                    self.fail(f"{where}.{other}", f"not a key of the search space (keys: {', '.join(entries)})")
                if target.key == key:
                    self.fail(f"{where}.{other}", "a key cannot depend on itself")
                if not target.categorical or entries[target.key][1].get("when") is not None:
                    self.fail(f"{where}.{other}", f"conditions may only name a grid or choice key without its own "
                                                  f"`when`; search.space.{target.key} is not one")
                if params[key].kind == "grid" and target.kind != "grid":
                    self.fail(f"{where}.{other}", "a grid key may only depend on grid keys")
                allowed = allowed if isinstance(allowed, list) else [allowed]
                if not allowed:
                    self.fail(f"{where}.{other}", "must list at least one value")
                for v in allowed:
                    if not target.contains(v):
                        self.fail(f"{where}.{other}", f"{v!r} is not one of search.space.{target.key}'s values "
                                                      f"{list(target.values)}")
                conditions.append((target.key, tuple(allowed)))
            p = params[key]
            params[key] = Param(p.key, p.path, p.kind, p.values, p.low, p.high, tuple(conditions))

        self.check_temperature(params, sections)
        return params

    def check_temperature(self, params: dict[str, Param], sections: dict) -> None:
        """T_P only exists for exp_decay: a sampled temperature needs `when: {fusion: exp_decay}` unless every
        trial uses exp_decay."""
        temp = next((p for p in params.values() if p.path == "model.temperature"), None)
        if temp is None:
            return
        fusion = next((p for p in params.values() if p.path == "model.fusion"), None)
        if fusion is not None and fusion.key in temp.conditions:
            return
        if fusion is not None:
            fusions = list(fusion.values)
        else:
            fusions = [get_dotted(sections, "model.fusion", get_dotted(_schema_defaults(), "model.fusion"))]
        others = [f for f in fusions if f != "exp_decay"]
        if others:
            hint = f"add `when: {{{fusion.key}: exp_decay}}`" if fusion else "set model.fusion: exp_decay"
            self.fail(f"search.space.{temp.key}", f"the temperature T_P is only used by fusion 'exp_decay', but "
                                                  f"trials can use {', '.join(map(repr, others))}: {hint}")

    def check_search(self, raw: dict, params: dict[str, Param], sections: dict) -> dict:
        metric = raw.get("metric", "val/CIDEr")
        metric = self.string(metric, "search.metric")
        mode = raw.get("mode", "max")
        if mode not in MODES:
            self.fail("search.mode", f"must be 'max' or 'min', got {mode!r}")
        algorithm = raw.get("algorithm", "optuna")
        if algorithm not in ALGORITHMS:
            self.fail("search.algorithm", f"must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
        num_samples = self.integer(raw.get("num_samples", 1), "search.num_samples", minimum=1)
        seed = self.integer(raw.get("seed", 0), "search.seed", minimum=0)
        sampled = [p for p in params.values() if p.sampled]

        points_raw = raw.get("points_to_evaluate")
        if points_raw is None:
            points = [{p.key: p.default() for p in sampled}] if sampled else []
        else:
            if not isinstance(points_raw, list):
                self.fail("search.points_to_evaluate", f"must be a list of mappings, got {type(points_raw).__name__}")
            points = []
            for i, point in enumerate(points_raw):
                where = f"search.points_to_evaluate[{i}]"
                point = self.mapping(point, where, allow_none=False)
                full = {}
                for key, value in point.items():
                    path = resolve_key(key)
                    p = next((q for q in params.values() if q.path == path), None) if path else None
                    if p is None or not p.sampled:
                        self.fail(f"{where}.{key}", f"points may only set sampled keys of the space "
                                                    f"({', '.join(q.key for q in sampled) or 'there are none'})")
                    if not p.contains(value):
                        self.fail(f"{where}.{key}", f"{value!r} is outside search.space.{p.key} ({p.to_dict()})")
                    full[p.key] = int(value) if p.kind == "randint" else value
                points.append({p.key: full.get(p.key, p.default()) for p in sampled})
            if sampled and algorithm != "grid" and len(points) > num_samples:
                self.fail("search.points_to_evaluate", f"{len(points)} points but only {num_samples} samples per "
                                                       f"cell (search.num_samples)")
            if sampled and algorithm == "grid" and not points:
                self.fail("search.points_to_evaluate", "algorithm 'grid' runs the points: give at least one")

        scheduler_raw = self.mapping(raw.get("scheduler", {"fifo": {}}), "search.scheduler", allow_none=False)
        if len(scheduler_raw) != 1:
            self.fail("search.scheduler", f"must name exactly one scheduler of {', '.join(SCHEDULERS)}, "
                                          f"got {', '.join(scheduler_raw) or 'none'}")
        ((kind, options),) = scheduler_raw.items()
        if kind not in SCHEDULERS:
            self.fail(f"search.scheduler.{kind}", f"unknown scheduler; one of {', '.join(SCHEDULERS)}")
        options = self.mapping(options, f"search.scheduler.{kind}")
        self.known(options, f"search.scheduler.{kind}", tuple(SCHEDULER_DEFAULTS[kind]))
        options = {**SCHEDULER_DEFAULTS[kind], **options}
        if kind == "asha":
            options["grace_period"] = self.integer(options["grace_period"], "search.scheduler.asha.grace_period", 1)
            rf = self.number(options["reduction_factor"], "search.scheduler.asha.reduction_factor")
            if rf <= 1:
                self.fail("search.scheduler.asha.reduction_factor", f"must be > 1, got {_fmt(rf)}")
            options["reduction_factor"] = rf
            gap = self.number(options["min_gap_se"], "search.scheduler.asha.min_gap_se")
            if gap < 0:
                self.fail("search.scheduler.asha.min_gap_se", f"must be >= 0, got {_fmt(gap)}")
            options["min_gap_se"] = float(gap)
        out = {"metric": metric, "mode": mode, "algorithm": algorithm, "num_samples": num_samples, "seed": seed,
               "space": {key: p.to_dict() for key, p in params.items()}, "points_to_evaluate": points,
               "scheduler": {kind: options}}
        if "replicates" in raw:
            out["replicates"] = self.check_replicates(raw["replicates"], params, sections)
        return out

    def check_replicates(self, raw: Any, params: dict[str, Param], sections: dict) -> list[int]:
        """`replicates: N` -> seeds [0..N-1]; a list -> those seeds (distinct integers >= 0)."""
        where = "search.replicates"
        if get_dotted(sections, SEED_PATH, _MISSING) is not _MISSING:
            self.fail(SEED_PATH, f"is set by {where} (the seed comes from the replicate index); remove it from train")
        seeded = [p.key for p in params.values() if p.path == SEED_PATH]
        if seeded:
            self.fail(where, f"the seed comes from the replicate index, but search.space.{seeded[0]} also sets "
                             f"{SEED_PATH}; remove one of search.replicates and search.space.{seeded[0]}")
        if isinstance(raw, list):
            if not raw:
                self.fail(where, "a list of seeds must not be empty")
            seeds = [self.integer(v, f"{where}[{i}]", minimum=0) for i, v in enumerate(raw)]
            for i, v in enumerate(seeds):
                if v in seeds[:i]:
                    self.fail(f"{where}[{i}]", f"seed {v} is listed twice")
            return seeds
        return list(range(self.integer(raw, where, minimum=1)))

    def check_scheduler_budget(self, scheduler: dict, total_epochs: int) -> None:
        asha = scheduler.get("asha")
        if asha and asha["grace_period"] > total_epochs:
            self.fail("search.scheduler.asha.grace_period", f"{asha['grace_period']} is more than the "
                                                             f"{total_epochs} planned epochs (train.xe_epochs + "
                                                             f"train.scst_epochs)")

    def check_metric(self, metric: str, base: dict) -> None:
        match = _JSD_METRIC.match(metric)
        if match:
            if int(match.group(1)) >= base["model"]["layers"]:
                self.fail("search.metric", f"{metric}: the model has {base['model']['layers']} layers")
            return
        if metric not in METRICS:
            self.fail("search.metric", f"{metric!r} is not reported by training; one of {', '.join(METRICS)}, "
                                       f"diag/jsd/layer<i>")

    # -- every trial the space can produce ---------------------------------------------------------------------
    def check_trials(self, spec: StudySpec, sections: dict) -> dict:
        """Build a Config for every grid cell with the sampled keys at their ends, defaults, points and choices.

        Returns the base: the sections with defaults filled in and the space's keys at their schema defaults.
        """
        schema_defaults = _schema_defaults()
        try:  # the sections alone (space keys at their defaults): errors that no grid cell causes
            Config.from_dict(sections, source=self.source)
        except ConfigError as err:
            space_paths = {p.path for p in spec.params.values()}
            if err.path not in space_paths and not space_paths & set(_COUPLED.get(err.path, ())):
                raise
        first: Config | None = None
        for cell in spec.grid_cells():
            for assignment in self.probes(spec, cell):
                raw = copy.deepcopy(sections)
                for key, value in assignment.items():
                    set_dotted(raw, spec.params[key].path, value)
                try:
                    cfg = Config.from_dict(raw, source=self.source)
                except ConfigError as err:
                    self.explain(err, spec, cell, assignment)
                first = first or cfg
        assert first is not None
        base = first.to_dict()
        for p in spec.params.values():
            set_dotted(base, p.path, get_dotted(schema_defaults, p.path))
        return base

    @staticmethod
    def probes(spec: StudySpec, cell: dict) -> list[dict]:
        def at(pick):
            return {**cell, **spec.fill(cell, pick)}

        found = [at(lambda p: p.default()), at(lambda p: p.ends()[0]), at(lambda p: p.ends()[1])]
        for point in spec.search["points_to_evaluate"]:
            found.append(at(lambda p, point=point: point[p.key]))
        for c in spec.sampled_params:
            if c.kind == "choice":
                for v in c.values:
                    found.append(at(lambda p, c=c, v=v: v if p is c else p.ends()[0]))
        out = []
        for a in found:
            if a not in out:
                out.append(a)
        return out

    def explain(self, err: ConfigError, spec: StudySpec, cell: dict, assignment: dict):
        """Re-raise a probe's error at the space key that caused it, else at the config key with its cell."""
        for key, value in assignment.items():
            p = spec.params[key]
            if p.path == err.path:
                self.fail(f"search.space.{key}.{p.kind}", f"{value!r} gives an invalid {p.path}: {err.reason}"
                          + (f" (grid cell {spec.cell_label(cell)})" if cell and key not in cell else ""))
        context = f" (grid cell {spec.cell_label(cell)})" if cell else ""
        sampled = {k: v for k, v in assignment.items() if k not in cell}
        if sampled:
            context += f" (with {', '.join(f'{k}={_fmt(v)}' for k, v in sampled.items())})"
        raise ConfigError(err.path, f"{err.reason}{context}", err.source or self.source) from None

    def check_data(self, base: dict) -> None:
        data = base["data"]
        if data["kind"] != "coco":
            return
        for key in ("captions", "features", "test_images"):
            value = data.get(key)
            if value is None:
                continue
            p = Path(value)
            if key == "features":
                if not (p.is_file() or p.is_dir()):
                    self.fail(f"data.{key}", f"{value}: no such HDF5 file or .npz directory")
            elif not p.is_file():
                self.fail(f"data.{key}", f"{value}: no such file")
        try:  # the captions themselves: malformed entries and empty train or val splits fail here, not in a trial
            require_splits(read_karpathy(data["captions"]), data["captions"])
        except DataError as err:
            self.fail("data.captions", str(err))
        scst_from = base["train"].get("scst_from")
        if scst_from and not Path(scst_from).exists():
            self.fail("train.scst_from", f"{scst_from}: no such checkpoint")

    # -- resources, tracking, storage ----------------------------------------------------------------------------
    def check_resources(self, raw: Any, cluster: dict | None) -> dict:
        raw = self.mapping(raw, "resources")
        self.known(raw, "resources", tuple(RESOURCE_DEFAULTS))
        r = {**RESOURCE_DEFAULTS, **raw}
        r["workers_per_trial"] = self.integer(r["workers_per_trial"], "resources.workers_per_trial", 1)
        r["max_concurrent_trials"] = self.integer(r["max_concurrent_trials"], "resources.max_concurrent_trials", 1)
        r["max_failures"] = self.integer(r["max_failures"], "resources.max_failures", -1)
        for key in ("cpus_per_worker", "driver_cpus"):
            r[key] = self.number(r[key], f"resources.{key}")
            if r[key] <= 0:
                self.fail(f"resources.{key}", f"must be > 0, got {_fmt(r[key])}")
        gpus = r["gpus_per_worker"] = self.number(r["gpus_per_worker"], "resources.gpus_per_worker")
        if gpus < 0:
            self.fail("resources.gpus_per_worker", f"must be >= 0, got {_fmt(gpus)}")
        if gpus > 1 and not float(gpus).is_integer():
            self.fail("resources.gpus_per_worker", f"more than one GPU must be a whole number, got {_fmt(gpus)}")
        if r["price_per_hour"] is None:
            del r["price_per_hour"]
        elif self.number(r["price_per_hour"], "resources.price_per_hour") <= 0:
            self.fail("resources.price_per_hour", f"must be > 0, got {_fmt(r['price_per_hour'])}")
        else:
            r["price_per_hour"] = float(r["price_per_hour"])
        if cluster is not None:
            n, cpus = r["workers_per_trial"], r["cpus_per_worker"]
            need_cpu = n * cpus + r["driver_cpus"]
            have_cpu = float(cluster.get("CPU", 0))
            if need_cpu > have_cpu + 1e-9:
                self.fail("resources.cpus_per_worker", f"a trial needs {n} workers x {_fmt(cpus)} CPU + "
                                                       f"{_fmt(r['driver_cpus'])} (driver) = {_fmt(need_cpu)} CPUs "
                                                       f"but the cluster has {_fmt(have_cpu)}")
            need_gpu, have_gpu = n * gpus, float(cluster.get("GPU", 0))
            if need_gpu > have_gpu + 1e-9:
                self.fail("resources.gpus_per_worker", f"a trial needs {n} workers x {_fmt(gpus)} GPU = "
                                                       f"{_fmt(need_gpu)} GPUs but the cluster has {_fmt(have_gpu)}")
        return r

    def check_tracking(self, raw: Any, name: str) -> dict:
        raw = self.mapping(raw, "tracking")
        self.known(raw, "tracking", ("mlflow_uri", "experiment"))
        uri = raw.get("mlflow_uri")
        if uri is None:
            uri = os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_MLFLOW_URI
        uri = self.string(uri, "tracking.mlflow_uri")
        if re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*://[^/@]*:[^/@]*@", uri):  # user:password@host
            from dashboards.tracking import redact_uri

            self.fail("tracking.mlflow_uri", f"{redact_uri(uri)}: no password in the URI (it would be saved with the "
                                             "study and shown); give it by reference: ~/.pgpass or $PGPASSFILE for "
                                             "a database, $MLFLOW_TRACKING_PASSWORD or ~/.mlflow/credentials for "
                                             "an MLflow server")
        scheme = uri.split(":", 1)[0].lower() if re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*:", uri) else None
        if scheme and "+" in scheme:  # e.g. postgresql+psycopg2
            scheme = scheme.split("+", 1)[0]
        if scheme is None or len(scheme) == 1:  # a plain path (or a Windows drive letter): a file store
            uri = os.path.abspath(os.path.expanduser(uri))
        elif scheme not in _MLFLOW_SCHEMES:
            self.fail("tracking.mlflow_uri", f"unknown scheme {scheme!r} in {uri!r}; use sqlite:///, http(s)://, "
                                             f"file:, a database URI or a directory")
        elif scheme == "sqlite":
            if not uri.startswith("sqlite:///"):
                self.fail("tracking.mlflow_uri", f"a sqlite URI is sqlite:///relative.db or sqlite:////abs.db, "
                                                 f"got {uri!r}")
            db = uri[len("sqlite:///"):]
            if db and db != ":memory:" and not db.startswith("/"):
                uri = "sqlite:///" + os.path.abspath(os.path.expanduser(db))
        experiment = raw.get("experiment")
        experiment = name if experiment is None else self.string(experiment, "tracking.experiment")
        return {"mlflow_uri": uri, "experiment": experiment}

    def check_storage(self, storage: Any, endpoint: Any) -> tuple[str, str | None]:
        storage = self.string(storage, "storage")
        scheme = _SCHEME.match(storage)
        if scheme:
            if scheme.group(1).lower() != "s3":
                self.fail("storage", f"must be a local path or s3://bucket/prefix, got {storage!r}")
            if not _S3.match(storage):
                self.fail("storage", f"not a valid s3://bucket/prefix: {storage!r}")
            storage = storage.rstrip("/")
        else:
            storage = os.path.abspath(os.path.expanduser(storage))
            if Path(storage).exists() and not Path(storage).is_dir():
                self.fail("storage", f"{storage} exists and is not a directory")
        if endpoint is not None:
            endpoint = self.string(endpoint, "storage_endpoint_url")
            if not re.match(r"^https?://[^/\s]+", endpoint):
                self.fail("storage_endpoint_url", f"must be an http(s):// URL, got {endpoint!r}")
            if not storage.startswith("s3://"):
                self.fail("storage_endpoint_url", "only used with s3:// storage")
        return storage, endpoint


def _sections_without(base: dict, paths: list[str]) -> dict:
    """The data/model/train sections of `base` without the keys the space controls (what a study file holds)."""
    out = {s: copy.deepcopy(base[s]) for s in SECTIONS}
    for path in paths:
        section, key = path.split(".", 1)
        out[section].pop(key, None)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m launch.spec STUDY.yaml [key=value ...]`"""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m launch.spec STUDY.yaml [key=value ...]", file=sys.stderr)
        return 2
    return validate_main(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
