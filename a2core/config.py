"""One schema for the `data`, `model` and `train` sections shared by `a2 train` and study files.

A config is a tree of dataclasses built from plain dicts (YAML) by `Config.from_dict`, which rejects unknown
keys, wrong types and out-of-range values with a `ConfigError` naming the key path. `to_dict` gives back a plain
dict (what checkpoints and MLflow store). `apply_overrides` takes `key=value` strings (`model.lambda=0.05`).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from .errors import ConfigError

FUSIONS = ("none", "max", "moving_average", "exp_decay", "gate")
SEED_LIMIT = 2**32  # numpy's seed range: seeds are 0 .. 2^32 - 1
MASK_NETS = ("content", "linear")
PRECISIONS = ("fp32", "bf16", "fp16")


def _alias(name: str) -> dict:
    """Field metadata: the key used in YAML when it differs from the Python name (e.g. `lambda`)."""
    return {"key": name}


def check_seed(seed: int, path: str) -> None:
    if not 0 <= seed < SEED_LIMIT:
        raise ConfigError(path, f"must be in 0 .. {SEED_LIMIT - 1}, got {seed}")


@dataclass
class DataConfig:
    kind: str = "synthetic"  # synthetic | coco
    # kind=coco: Karpathy captions, region features (HDF5 file or .npz directory), test-server image list.
    captions: str | None = None
    features: str | None = None
    test_images: str | None = None
    # kind=synthetic: generated into `root` (default: a per-user cache) from `seed` when absent.
    root: str | None = None
    seed: int = 0
    images: int = 1500
    vocab_min_count: int = 5
    max_caption_len: int = 20
    val_images: int | None = None  # cap on val images used for per-epoch validation (None = all)

    def validate(self, path: str = "data") -> None:
        if self.kind not in ("synthetic", "coco"):
            raise ConfigError(f"{path}.kind", f"must be 'synthetic' or 'coco', got {self.kind!r}")
        if self.kind == "coco":
            for key in ("captions", "features"):
                if not getattr(self, key):
                    raise ConfigError(f"{path}.{key}", "required when kind is 'coco'")
        if self.images < 20:
            raise ConfigError(f"{path}.images", f"must be >= 20, got {self.images}")
        check_seed(self.seed, f"{path}.seed")
        if self.vocab_min_count < 1:
            raise ConfigError(f"{path}.vocab_min_count", "must be >= 1")
        if self.max_caption_len < 2:
            raise ConfigError(f"{path}.max_caption_len", "must be >= 2")
        if self.val_images is not None and self.val_images < 1:
            raise ConfigError(f"{path}.val_images", "must be >= 1 when given")


@dataclass
class ModelConfig:
    d_model: int = 512
    layers: int = 6
    heads: int = 8
    d_ff: int = 2048
    dropout: float = 0.1
    max_regions: int = 50
    feature_dim: int = 2048
    # A2 alignment (paper Eq. 2-10).
    fusion: str = "gate"
    mask_lambda: float = field(default=0.035, metadata=_alias("lambda"))
    eta: float = 0.1
    temperature: float | None = None  # T_P of exp_decay, in training steps
    # Divide fused weights by their sum so each row is a distribution again (not in Eq. 6-9: a variant).
    renormalize: bool = False
    mask_net: str = "content"  # content (decoder state vs per-region mask keys) | linear (Eq. 2: one logit per slot)
    mask_bias_init: float = 2.0  # sigmoid(2) = 0.88: the mask starts close to "keep everything"

    def validate(self, path: str = "model") -> None:
        for key in ("d_model", "layers", "heads", "d_ff", "max_regions", "feature_dim"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{path}.{key}", f"must be >= 1, got {getattr(self, key)}")
        if self.d_model % self.heads:
            raise ConfigError(f"{path}.heads", f"d_model={self.d_model} is not divisible by heads={self.heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{path}.dropout", f"must be in [0, 1), got {self.dropout}")
        if self.fusion not in FUSIONS:
            raise ConfigError(f"{path}.fusion", f"unknown fusion {self.fusion!r}; one of {', '.join(FUSIONS)}")
        if self.mask_net not in MASK_NETS:
            raise ConfigError(f"{path}.mask_net", f"must be one of {', '.join(MASK_NETS)}, got {self.mask_net!r}")
        if not self.mask_lambda > 0:
            raise ConfigError(f"{path}.lambda", f"must be > 0, got {self.mask_lambda}")
        if self.eta < 0:
            raise ConfigError(f"{path}.eta", f"must be >= 0, got {self.eta}")
        if self.fusion == "exp_decay":
            if self.temperature is None:
                raise ConfigError(f"{path}.temperature", "required when fusion is 'exp_decay'")
            if not self.temperature > 0:
                raise ConfigError(f"{path}.temperature", f"must be > 0, got {self.temperature}")
        elif self.temperature is not None:
            raise ConfigError(f"{path}.temperature", f"only used by fusion 'exp_decay', not {self.fusion!r}")


# Model keys (YAML names) that only some fusions use. ModelConfig keeps defaults for them, so plain-python users
# need not care; what a study logs, tabulates and hashes leaves out those its fusion does not use.
MASK_NETWORK_KEYS = ("lambda", "mask_net", "renormalize", "mask_bias_init")  # every fusion but none
FUSION_ONLY_KEYS = {"eta": "moving_average", "temperature": "exp_decay"}  # eta of Eq. 7, T_P of Eq. 8


def inapplicable_model_keys(fusion: str) -> set[str]:
    """The `model.*` keys a configuration with `fusion` does not use: the mask network's (lambda, mask_net,
    renormalize, mask_bias_init) for fusion none, eta except for moving_average, temperature (T_P) except for
    exp_decay."""
    out = {k for k, only in FUSION_ONLY_KEYS.items() if only != fusion}
    return out | set(MASK_NETWORK_KEYS) if fusion == "none" else out


def applicable_config(config: dict) -> dict:
    """A copy of a config dict (`Config.to_dict()` form) without the model keys its fusion does not use."""
    out = dict(config)
    model = out.get("model")
    if isinstance(model, dict):
        drop = inapplicable_model_keys(model.get("fusion", ModelConfig.fusion))
        out["model"] = {k: v for k, v in model.items() if k not in drop}
    return out


@dataclass
class TrainConfig:
    seed: int = 0
    xe_epochs: int = 20
    scst_epochs: int = 0
    batch_size: int = 50  # images per step; each image brings its (up to) 5 captions
    lr_factor: float = 1.0  # Noam: factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    warmup: int = 10000
    mask_lr: float = 1e-4  # Adam lr of the mask perturbation network (its own optimizer)
    mask_every: int = 1  # a mask-network step after every N captioner steps
    # Captions per image the mask step uses (None = all, the paper's schedule); fewer make it cheaper. Which ones
    # rotates with the step, so every caption is used in turn.
    mask_captions: int | None = None
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast for training and decoding; fp16 adds loss scaling
    grad_clip: float = 1.0
    label_smoothing: float = 0.0
    # Validation after every epoch.
    val_decode: str = "greedy"  # greedy | beam
    val_meteor: bool = False  # METEOR needs a Java process per validation (~4 s); the final evaluation has it
    beam_size: int = 5
    max_len: int = 20
    # SCST (stage 2).
    scst_lr: float = 5e-6
    scst_samples: int = 5
    scst_baseline: str = "mean"  # mean (of the other samples) | greedy
    scst_from: str | None = None  # an XE checkpoint to start stage 2 from (default: this run's best XE)
    num_workers: int = 0  # DataLoader worker processes
    log_every: int = 50
    # Diagnostics (a2core.diagnostics: JSD, mask mean, Kendall tau, grounding) on a fixed val subset, reported
    # under diag/. On every `diag_every`-th epoch and always after the last; 0 = after the last epoch only.
    # Every epoch by default: a trial early stopping ends has them too, and they are cheap (smoke study, 1 thread:
    # 2.6 s against 77 s for a gate epoch with its validation, measured side by side; about 10% of a baseline one).
    diag_every: int = 1
    diag_images: int = 100  # the first N val images
    diag_kendall_images: int = 10  # the first N of those for Kendall tau (one backward pass per caption word)

    def validate(self, path: str = "train") -> None:
        check_seed(self.seed, f"{path}.seed")
        for key in ("batch_size", "warmup", "beam_size", "max_len", "scst_samples", "mask_every", "log_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{path}.{key}", f"must be >= 1, got {getattr(self, key)}")
        for key in ("diag_images", "diag_kendall_images"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{path}.{key}", f"must be >= 1, got {getattr(self, key)}")
        for key in ("xe_epochs", "scst_epochs", "num_workers", "diag_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{path}.{key}", f"must be >= 0, got {getattr(self, key)}")
        if self.xe_epochs + self.scst_epochs < 1:
            raise ConfigError(f"{path}.xe_epochs", "xe_epochs + scst_epochs must be >= 1")
        for key in ("lr_factor", "mask_lr", "scst_lr"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{path}.{key}", f"must be > 0, got {getattr(self, key)}")
        if self.mask_captions is not None and self.mask_captions < 1:
            raise ConfigError(f"{path}.mask_captions", f"must be >= 1 when given, got {self.mask_captions}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"{path}.precision", f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.val_decode not in ("greedy", "beam"):
            raise ConfigError(f"{path}.val_decode", f"must be 'greedy' or 'beam', got {self.val_decode!r}")
        if self.scst_baseline not in ("mean", "greedy"):
            raise ConfigError(f"{path}.scst_baseline", f"must be 'mean' or 'greedy', got {self.scst_baseline!r}")
        if self.scst_baseline == "mean" and self.scst_samples < 2:
            raise ConfigError(f"{path}.scst_samples", "the 'mean' baseline needs at least 2 samples")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"{path}.label_smoothing", "must be in [0, 1)")
        if self.grad_clip < 0:
            raise ConfigError(f"{path}.grad_clip", "must be >= 0 (0 = off)")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output_dir: str = "runs/a2"  # checkpoints and logs of a plain `a2 train`

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict | None, source: str | None = None) -> "Config":
        try:
            cfg = _build(cls, raw or {}, "")
            cfg.validate()
        except ConfigError as err:
            if source and not err.source:
                raise ConfigError(err.path, err.reason, source) from None
            raise
        return cfg

    def validate(self) -> None:
        self.data.validate("data")
        self.model.validate("model")
        self.train.validate("train")

    def to_dict(self) -> dict:
        return _unbuild(self)

    def replace(self, overrides: dict[str, Any]) -> "Config":
        """A copy with dotted keys replaced (`{"model.fusion": "max"}`), validated."""
        raw = self.to_dict()
        for key, value in overrides.items():
            set_dotted(raw, key, value)
        return Config.from_dict(raw)


# -- YAML ------------------------------------------------------------------------------------------------------
# Config files, study specs and saved study.yaml files are a few KB; these caps bound time and memory on hostile
# ones: the size of the file, and the number of nodes once aliases are expanded (1 KB of nested aliases, the
# "billion laughs", would otherwise expand to 10^9 nodes in whatever walks the result). The pure-Python parser,
# not libyaml's: libyaml crashes the process on deeply nested input, where Python's raises RecursionError. It
# parses about 50 KB/s on a busy core, hence the small size cap.
MAX_YAML_BYTES = 128 << 10
MAX_YAML_NODES = 100_000


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses duplicate keys and integers too long for `int()`."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: later keys override on purpose
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first on line {seen[key]})",
                        key_node.start_mark)
                seen[key] = line
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # Python refuses int() of more than 4300 digits
            raise yaml.constructor.ConstructorError(
                None, None, f"integer of {len(node.value)} characters is too long", node.start_mark) from None


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:map", _StrictLoader.construct_yaml_map)


def parse_yaml(text: str, source: str | None = None) -> Any:
    """YAML text to Python data, refusing duplicate keys, over-long integers and alias bombs (ConfigError)."""
    try:
        return _parse(text, source)
    except yaml.YAMLError as err:
        raise ConfigError("", f"not valid YAML: {_yaml_message(err)}", source) from None


def _parse(text: str, source: str | None) -> Any:
    """`parse_yaml` raising PyYAML's own errors (a ConfigError for what is too big or too deep)."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node, source)
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError("", "YAML nested too deeply; refused", source) from None
    finally:
        loader.dispose()


def _yaml_message(err: yaml.YAMLError) -> str:
    """PyYAML's error on one line: where, then what."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return f"{where}{context + ': ' if context else ''}{problem}"


def _check_expanded_size(node, source: str | None) -> None:
    """Count nodes as if every alias were copied out, stopping at the cap (so this costs at most the cap)."""
    count, stack = 0, [node]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_YAML_NODES:
            raise ConfigError("", f"YAML holds more than {MAX_YAML_NODES} values once aliases are expanded; refused",
                              source)
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend(n for pair in node.value for n in pair)


def load_yaml(path: str | Path) -> dict:
    """A YAML file whose top level is a mapping, read with `parse_yaml`'s checks and at most MAX_YAML_BYTES."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("", "file not found", str(path))
    with open(path, "rb") as f:
        data = f.read(MAX_YAML_BYTES + 1)
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError("", f"larger than {MAX_YAML_BYTES} bytes; refused", str(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("", f"not UTF-8 text ({err})", str(path)) from None
    raw = parse_yaml(text, str(path))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("", f"top level must be a mapping, got {type(raw).__name__}", str(path))
    return raw


_OVERRIDE = re.compile(r"^([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*)=(.*)$", re.S)


def apply_overrides(raw: dict, overrides: list[str], source: str | None = None) -> dict:
    """`["model.lambda=0.05", "train.xe_epochs=3"]` applied to a copy of `raw`; values are parsed as YAML."""
    raw = _deepcopy(raw)
    for item in overrides:
        match = _OVERRIDE.match(item)
        if not match:
            raise ConfigError("", f"override {item!r} is not of the form key.path=value", source)
        key, text = match.groups()
        value = _override_value(text, item, source)
        set_dotted(raw, key, value)
    return raw


def _override_value(text: str, item: str, source: str | None) -> Any:
    """An override's value parsed as YAML with `parse_yaml`'s checks; text that is no YAML at all stays a string."""
    if text == "":
        return ""
    try:
        return _parse(text, source)
    except yaml.constructor.ConstructorError as err:  # YAML, but refused (a duplicate key, a too-long integer)
        raise ConfigError("", f"override {item[:80]!r}: {_yaml_message(err)}", source) from None
    except yaml.YAMLError:
        return text


def set_dotted(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), "is not a mapping; cannot set a key below it")
        node = child
    node[parts[-1]] = value


def get_dotted(raw: dict, key: str, default: Any = None) -> Any:
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def flatten(raw: dict, prefix: str = "") -> dict[str, Any]:
    """`{"model": {"fusion": "gate"}}` -> `{"model.fusion": "gate"}` (MLflow params, tables)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


# -- dataclass <-> dict ----------------------------------------------------------------------------------------
def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _build(cls, raw: Any, path: str):
    if not isinstance(raw, dict):
        raise ConfigError(path or "(root)", f"must be a mapping, got {type(raw).__name__}")
    hints = get_type_hints(cls)
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise ConfigError(where, f"unknown key; known keys here: {', '.join(sorted(fields))}")
    kwargs = {}
    for key, f in fields.items():
        if key not in raw:
            continue
        sub = f"{path}.{key}" if path else key
        kwargs[f.name] = _coerce(hints[f.name], raw[key], sub)
    return cls(**kwargs)


def _coerce(tp, value, path: str):
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    args = get_args(tp)
    if get_origin(tp) is not None and type(None) in args:  # Optional[X]
        if value is None:
            return None
        (tp,) = [a for a in args if a is not type(None)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(path, f"must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ConfigError(path, f"must be finite, got {value!r}")
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "5e-6" as a string
            try:
                return _coerce(float, float(value), path)
            except ValueError:
                pass
        raise ConfigError(path, f"must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(path, f"must be a string, got {value!r}")
    return value


def _unbuild(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out[_key(f)] = _unbuild(value) if dataclasses.is_dataclass(value) else value
    return out


def _deepcopy(raw):
    if isinstance(raw, dict):
        return {k: _deepcopy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_deepcopy(v) for v in raw]
    return raw
