"""One schema for the `data`, `model` and `train` sections shared by `a2 train` and study files.

A config is a tree of pydantic models built from plain dicts (YAML) by `Config.from_dict`, which rejects unknown
keys, wrong types and out-of-range values with a `ConfigError` naming the key path (`config_error` turns pydantic's
errors into these). `to_dict` gives back a plain dict (what checkpoints and MLflow store). `apply_overrides` takes
`key=value` strings (`model.lambda=0.05`).
"""
from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo,
                      model_validator)

from .data.synthetic import split_sizes
from .errors import ConfigError

SEED_LIMIT = 2**32  # numpy's seed range: seeds are 0 .. 2^32 - 1
CAPTIONS_PER_IMAGE = 5  # every training image brings 5 captions (cycled when it has fewer, the first 5 of more)


# -- what YAML may give for each kind of key -------------------------------------------------------------------
# Stricter than pydantic's own coercion: no "3" for an integer, no true for a number. An integral float is an
# integer, and a number string is a float (YAML 1.1 reads "5e-6" as a string).
def integer(value: Any) -> int:
    """An int; an integral float (3.0) becomes one."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"must be an integer, got {value!r}")


def number(value: Any) -> int | float:
    """A finite int or float, kept as given; a number string becomes a float."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _fits_a_float(value):
        raise ValueError(f"must be a number, got {value!r}")
    return value


def _fits_a_float(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the largest float
        return False


def _real(value: Any) -> float:
    return float(number(value))


def _text(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {value!r}")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


def check_seed(seed: int, path: str = "") -> int:
    """`seed` if it is in 0 .. 2^32-1 (numpy's range), else a ConfigError naming `path`."""
    if not 0 <= seed < SEED_LIMIT:
        raise ConfigError(path, f"must be in 0 .. {SEED_LIMIT - 1}, got {seed}")
    return seed


Integer = Annotated[int, BeforeValidator(integer)]
Real = Annotated[float, BeforeValidator(_real)]
Number = Annotated[int | float, BeforeValidator(number)]  # an int stays an int
Text = Annotated[str, BeforeValidator(_text)]
Flag = Annotated[bool, BeforeValidator(_flag)]
Seed = Annotated[int, BeforeValidator(integer), AfterValidator(check_seed)]


class Section(BaseModel):
    """A mapping of known keys. `key: null` for a whole section reads as `{}`. Validators raise a `ConfigError`
    whose path is relative to the section (`heads`); `config_error` puts the section's path in front."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    # key -> what to write instead: a key people put in this section that lives elsewhere (said with the refusal)
    elsewhere: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, raw: Any) -> Any:
        """Refuse a non-mapping or an unknown key naming the known ones (pydantic's message names neither)."""
        if raw is None:
            return {}
        if isinstance(raw, BaseModel):
            return raw
        if not isinstance(raw, dict):
            raise ConfigError("", f"must be a mapping, got {type(raw).__name__}")
        keys = [field.alias or name for name, field in cls.model_fields.items()]
        unknown = [key for key in raw if key not in keys and key not in cls.model_fields]
        if unknown:
            if hint := cls.elsewhere.get(str(unknown[0])):
                raise ConfigError(str(unknown[0]), f"unknown key here; {hint}")
            raise ConfigError(str(unknown[0]), f"unknown key; known keys here: {', '.join(keys) or 'none'}")
        return raw


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _at_least(ctx: dict, value, unit: str) -> str:
    least = ctx.get("min_length", 1)
    return "must not be empty" if least == 1 else f"must have at least {least} {unit}, got {len(value)}"


# pydantic error types -> (ctx, input) -> the reason, in the words every other refusal uses
_HOUSE_STYLE = {
    "string_too_short": lambda ctx, value: _at_least(ctx, value, "characters"),
    "too_short": lambda ctx, value: _at_least(ctx, value, "items"),
    "string_too_long": lambda ctx, value: f"must have at most {ctx.get('max_length')} characters, got {len(value)}",
    "too_long": lambda ctx, value: f"must have at most {ctx.get('max_length')} items",
    "missing": lambda ctx, value: "is required",
    "string_type": lambda ctx, value: f"must be a string, got {type(value).__name__} {value!r}",
    "int_type": lambda ctx, value: f"must be an integer, got {value!r}",
    "int_parsing": lambda ctx, value: f"must be an integer, got {value!r}",
    "int_from_float": lambda ctx, value: f"must be a whole number, got {value!r}",
    "float_type": lambda ctx, value: f"must be a number, got {value!r}",
    "float_parsing": lambda ctx, value: f"must be a number, got {value!r}",
    "bool_type": lambda ctx, value: f"must be true or false, got {value!r}",
    "bool_parsing": lambda ctx, value: f"must be true or false, got {value!r}",
}


def config_error(err: ValidationError, source: str | None = None) -> ConfigError:
    """Pydantic's first error as a ConfigError naming the dotted key (`search.space.lambda.grid[1]`) and the file."""
    first = err.errors()[0]
    path = _dotted(first["loc"])
    kind, ctx, value = first["type"], first.get("ctx", {}), first.get("input")
    cause = ctx.get("error")
    if isinstance(cause, ConfigError):
        return ConfigError(_join(path, cause.path), cause.reason, source)
    if isinstance(cause, Exception):
        reason = str(cause)
    elif kind in _BOUNDS:
        reason = f"must be {_BOUNDS[kind]} {format_value(next(iter(ctx.values())))}, got {format_value(value)}"
    elif kind == "literal_error":
        name = first["loc"][-1] if first["loc"] and isinstance(first["loc"][-1], str) else "value"
        reason = f"unknown {name} {value!r}: must be {ctx['expected']}"
    elif kind == "extra_forbidden":
        reason = "unknown key"
    elif kind in ("dict_type", "list_type"):
        reason = f"must be a {'mapping' if kind == 'dict_type' else 'list'}, got {type(value).__name__}"
    elif kind in _HOUSE_STYLE:  # pydantic's own wording ("String should have at least 1 character") in ours
        reason = _HOUSE_STYLE[kind](ctx, value)
    else:
        reason = first["msg"]
    return ConfigError(path, reason, source)


def _dotted(loc: tuple) -> str:
    path = ""
    for part in loc:
        if part == "[key]":  # pydantic's marker for an error in a mapping's key, not its value
            continue
        if isinstance(part, str) and "[" in part and part.endswith("]"):
            continue  # the union member that failed, as pydantic names it ("list[function-after[...]]"): no key
        path = _join(path, f"[{part}]" if isinstance(part, int) else str(part))
    return path


def _join(path: str, key: str) -> str:
    if not path or not key:
        return path or key
    return path + key if key.startswith("[") else f"{path}.{key}"


def format_value(value: Any) -> str:
    """A value as messages show it: a float by `:g` (0.035, 1e-05), anything else by `str`."""
    return f"{value:g}" if isinstance(value, float) else str(value)


# -- the sections ------------------------------------------------------------------------------------------------
class DataConfig(Section):
    kind: Literal["synthetic", "coco"] = Field("synthetic", description=(
        "`synthetic`: the seeded COCO look-alike, generated on first use; `coco`: real files (`captions`, "
        "`features`, `test_images`). A key only the other kind reads is refused when set to anything but its "
        "default; an override that switches the kind (`data.kind=synthetic` on a COCO study) leaves them out."))
    captions: Text | None = Field(None, description="kind coco: the Karpathy `dataset_coco.json` (required).")
    features: Text | None = Field(None, description=(
        "kind coco: region features, one HDF5 file with `{image_id}_features` datasets or a directory of "
        "`{image_id}.npz` (required)."))
    test_images: Text | None = Field(None, description=(
        "kind coco: the test server's image list, `image_info_test2014.json` (for packaging)."))
    root: Text | None = Field(None, description=(
        "kind synthetic: the folder of the generated set (default: a per-user cache); generated there when it holds "
        "no set yet, used as it is when it holds the set of this seed and size, and refused (naming both) "
        "when it holds another set."))
    seed: Seed = Field(0, description="kind synthetic: the seed the set is generated from (0 .. 2^32-1).")
    images: Integer = Field(1500, ge=20, description="kind synthetic: Karpathy-split images (train/val/test).")
    test_split_images: Integer | None = Field(None, ge=1, description=(
        "kind synthetic: images of the Karpathy test split, at least the quarter of `images` it has by default "
        "(null: that quarter, as many as val). The extra images are generated after all the others, so training and "
        "selection see the same data; more of them narrow the verdicts, which rest on this split."))
    vocab_min_count: Integer = Field(5, ge=1, description="Words seen fewer times in train become `<unk>`.")
    max_caption_len: Integer = Field(20, ge=2, description="Caption tokens kept for training (longer ones are cut).")
    val_images: Integer | None = Field(None, ge=1, description=(
        "Cap on the val images of the per-epoch validation (null: all)."))

    @model_validator(mode="after")
    def _coco_files(self) -> DataConfig:
        if self.kind == "coco":
            for key in ("captions", "features"):
                if not getattr(self, key):
                    raise ConfigError(key, "required when kind is 'coco'")
            if self.test_split_images is not None:
                raise ConfigError("test_split_images", "kind synthetic only: a coco test split is the captions "
                                                       "file's (train.test_images scores fewer of its images)")
        else:
            quarter = split_sizes(self.images)["test"]
            if self.test_split_images is not None and self.test_split_images < quarter:
                raise ConfigError("test_split_images", f"at least {quarter}, the quarter of images "
                                                       f"({self.images}) the test split always has")
        return self


# the data keys only one data.kind reads (the others read both): `check_data_kind`, `set_override`
DATA_KIND_ONLY = {"captions": "coco", "features": "coco", "test_images": "coco",
                  "root": "synthetic", "seed": "synthetic", "images": "synthetic", "test_split_images": "synthetic"}


Fusion = Literal["none", "max", "moving_average", "exp_decay", "gate"]
FUSIONS = get_args(Fusion)
MaskNet = Literal["content", "linear"]
MASK_NETS = get_args(MaskNet)
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS = get_args(Precision)


class ModelConfig(Section):
    d_model: Integer = Field(512, ge=1, description="Width of the encoder and decoder; a multiple of `heads`.")
    layers: Integer = Field(6, ge=1, description="Encoder layers, and as many decoder layers.")
    heads: Integer = Field(8, ge=1, description="Attention heads per layer.")
    d_ff: Integer = Field(2048, ge=1, description="Hidden width of each feed-forward sublayer.")
    dropout: Real = Field(0.1, ge=0, lt=1, description="Dropout probability.")
    max_regions: Integer = Field(50, ge=1, description="Region features per image kept (padded, with a mask).")
    feature_dim: Integer = Field(2048, ge=1, description="Size of one region feature.")
    # A2 alignment (paper Eq. 2-10).
    fusion: Fusion = Field("gate", description=(
        "How the aligned weights `a_m` are fused into the attention (Eq. 6-10); `none` is the plain Transformer."))
    mask_lambda: Real = Field(0.035, gt=0, alias="lambda", description=(
        "Weight of the mask penalty `||1-m||^2` in the mask loss (Eq. 4)."))
    eta: Real = Field(0.1, ge=0, description="fusion moving_average: the weight eta of Eq. 7.")
    # No default: the paper gives no value of T_P (Sec. 5.3 calls it "temperature factor S" and says it needs
    # heuristics); a study must choose or search it.
    temperature: Real | None = Field(None, gt=0, description=(
        "fusion exp_decay: T_P of Eq. 8, in global training steps (required there, refused elsewhere)."))
    renormalize: Flag = Field(False, description=(
        "Divide fused weights by their sum over regions, so each row is a distribution again (a variant, not in "
        "Eq. 6-9)."))
    mask_net: MaskNet = Field("content", description=(
        "The mask network: `content` scores the decoder state against per-region mask keys; `linear` is Eq. 2 "
        "literally, one logit per region slot."))
    # Not in the paper (it gives no initialisation of W_m, b_m): a2tune's own choice.
    mask_bias_init: Real = Field(2.0, description=(
        "Initial bias of the mask logits: sigmoid(2) = 0.88, a mask that starts close to keeping everything."))

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.d_model % self.heads:
            raise ConfigError("heads", f"d_model={self.d_model} is not divisible by heads={self.heads}")
        if self.fusion == "exp_decay" and self.temperature is None:
            raise ConfigError("temperature", "required when fusion is 'exp_decay'")
        if self.fusion != "exp_decay" and self.temperature is not None:
            raise ConfigError("temperature", f"only used by fusion 'exp_decay', not {self.fusion!r}")
        return self


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
        drop = inapplicable_model_keys(model.get("fusion", ModelConfig.model_fields["fusion"].default))
        out["model"] = {k: v for k, v in model.items() if k not in drop}
    return out


SELECTABLE = ("val/", "diag/", "train/")  # the metrics of an epoch's report that can pick the best epoch


class TrainConfig(Section):
    elsewhere: ClassVar[dict[str, str]] = {
        "output_dir": "output_dir is a top-level key of a training config (`a2 train --output-dir PATH`, or "
                      "output_dir=PATH); a study's trials write under its storage"}
    seed: Seed = Field(0, description="Seed of initialisation, data order and dropout (0 .. 2^32-1).")
    xe_epochs: Integer = Field(20, ge=0, description="Epochs of cross-entropy training (stage 1).")
    scst_epochs: Integer = Field(0, ge=0, description="Epochs of SCST with a CIDEr-D reward (stage 2).")
    # The paper trains "with a batch size of 50" as M2 does; M2's train.py builds `DataLoader(train_dataset,
    # batch_size=50, shuffle=True, drop_last=True)` over the dataset of (image, caption) *pairs*, so a step holds
    # 50 pairs drawn at random over the split (about 50 distinct images). That is batch_layout `pairs`; `images`
    # (batch_size / 5 images with all 5 of their captions) is a2tune's older layout, not M2's. Either way the batch
    # is global, split over the trial's workers; every step count (warmup, T_P, mask_every, log_every) counts these
    # global optimizer steps.
    batch_size: Integer = Field(50, ge=CAPTIONS_PER_IMAGE, description=(
        "Global batch of one optimizer step in image-caption pairs, whatever the number of workers, split evenly "
        "over the trial's workers (see `batch_layout`). An SCST step takes batch_size / 5 images x `scst_samples` "
        "candidates (M2: batch_size // 5 images x 5 beams)."))
    batch_layout: Literal["images", "pairs"] = Field("images", description=(
        "How a cross-entropy batch is drawn: `pairs`, batch_size (image, caption) pairs at random over all pairs "
        "of the split (M2's DataLoader(shuffle=True) over pairs, the paper's recipe); `images`, batch_size / 5 "
        "images with their 5 captions each (a2tune's earlier layout, the default so that older configs train as "
        "before). Both take 5 captions per image, so an epoch has the same pairs and steps in either layout."))
    lr_factor: Real = Field(1.0, gt=0, description=(
        "Noam schedule: lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)."))
    # The paper prints "a warmup equal to 10,00" (a typo: 1,000 or 10,000); 10,000 is M2's warmup (Cornia et al. 2020,
    # whose recipe and batch of 50 the paper follows), kept as the default.
    warmup: Integer = Field(10000, ge=1, description="Warmup of the Noam schedule, in global optimizer steps.")
    # noam_to_zero: short runs (the synthetic studies) end with the learning rate still near its peak under Noam,
    # so their last epochs move and seeds stop at different points; annealed to 0 they settle (benchmarks/RESULTS.md).
    lr_schedule: Literal["noam", "noam_to_zero"] = Field("noam", description=(
        "Stage-1 learning rate: `noam` (the paper's), or `noam_to_zero`, Noam times a linear ramp 1 - s/N over the N "
        "optimizer steps of the xe_epochs (s = 0 the first), from 1 at the first step to 0 just after the last: the "
        "last step takes 1/N of the Noam rate, so the run ends annealed."))
    # Not in the paper (it gives no optimiser settings for theta_m): a2tune's own choice.
    mask_lr: Real = Field(1e-4, gt=0, description="Adam learning rate of the mask network (its own optimizer).")
    mask_every: Integer = Field(1, ge=1, description="A mask-network step after every N captioner steps.")
    # Which captions rotates with the step, so every caption is used in turn.
    mask_captions: Integer | None = Field(None, ge=1, description=(
        "Captions per image the mask step uses (null: all, the paper's schedule); fewer make it cheaper."))
    precision: Precision = Field("fp32", description=(
        "Autocast dtype for training and validation decoding; fp16 adds loss scaling (a GradScaler)."))
    grad_clip: Real = Field(1.0, ge=0, description="Gradient-norm clipping of the captioner (0 = off).")
    label_smoothing: Real = Field(0.0, ge=0, lt=1, description="Label smoothing of the cross-entropy.")
    # Validation after every epoch.
    val_decode: Literal["greedy", "beam"] = Field("greedy", description="Decoding of the per-epoch validation.")
    val_meteor: Flag = Field(False, description=(
        "METEOR in the per-epoch validation (a Java process, ~4 s each); the final evaluation always has it."))
    beam_size: Integer = Field(5, ge=1, description="Beam width of beam-search decoding.")
    max_len: Integer = Field(20, ge=1, description="Longest decoded caption, in words.")
    # The best epoch: best.pt, what SCST starts from and what the test split scores. A study sets its search.metric
    # and search.mode here, so a trial's best epoch in the study's record is the one its checkpoint and test scores
    # come from.
    select_metric: Text = Field("val/CIDEr", description=(
        "The per-epoch metric that picks the run's best epoch (best.pt, the start of SCST, the test evaluation): one "
        "an epoch of this configuration reports (val/CIDEr, val/BLEU-1..4, val/ROUGE-L, val/METEOR with val_meteor; "
        "train/loss, train/lr, train/reward in SCST, train/mask_loss and train/mask_mean with a mask network; "
        "diag/...), else refused; with SCST from this run's best XE checkpoint, one a cross-entropy epoch reports. "
        "An epoch that did not report it is never the best."))
    select_mode: Literal["max", "min"] = Field("max", description="Whether `select_metric` is maximised or minimised.")
    # The selected checkpoint (the best epoch) decodes the held-out test split when the run ends; verdicts rest on
    # these scores, not on the val images the checkpoint and the configuration were selected on.
    test_at_end: Flag = Field(True, description=(
        "When the run ends, its selected checkpoint decodes the test split with beam search (beam_size, max_len), "
        "reported as test/... with per-image CIDEr-D (the scores verdicts rest on)."))
    test_images: Integer | None = Field(None, ge=1, description=(
        "The end-of-run test evaluation uses the first N test images (null: all)."))
    test_meteor: Flag = Field(True, description=(
        "METEOR in the end-of-run test evaluation (one Java process, about 4 s); without Java it is left out "
        "with a warning. BLEU-1..4, ROUGE-L and CIDEr are always reported."))
    # SCST (stage 2).
    scst_lr: Real = Field(5e-6, gt=0, description="Learning rate of SCST.")
    scst_samples: Integer = Field(5, ge=1, description=(
        "SCST candidates per image: sampled captions (`scst_candidates: sample`) or the beams of a beam search of "
        "this width (`beam`)."))
    # M2's train_scst decodes each image with beam search (beam 5, out_size 5), takes the 5 beams as candidates and
    # their mean reward as the baseline; `sample` (random samples, leave-one-out or greedy baseline) is a2tune's
    # earlier variant, the default so that older configs train as before.
    scst_candidates: Literal["sample", "beam"] = Field("sample", description=(
        "SCST candidates: `sample`, `scst_samples` captions sampled per image (baseline `scst_baseline`); `beam`, "
        "the `scst_samples` beams of a beam search of that width with the mean of their rewards as the baseline "
        "(M2's train_scst, the paper's recipe)."))
    scst_baseline: Literal["mean", "greedy"] = Field("mean", description=(
        "SCST reward baseline: the mean of the other samples, or the greedy caption (scst_candidates sample; beam "
        "candidates always take the mean of the beams' rewards)."))
    # M2's train.py builds its reward as Cider(PTBTokenizer.tokenize(train_dataset.text)) over the (image, caption)
    # pairs: every training caption is a document of the df (ref_len = log of the captions). coco-caption's CIDEr-D
    # and self-critical.pytorch take one document per image's references, a2tune's earlier reward, the default so
    # that older configs train as before. On the synthetic set the per-caption reward is 11% lower on average,
    # correlation 0.991 per image (tests/test_cider_reference.py).
    scst_reward_df: Literal["images", "captions"] = Field("images", description=(
        "Document frequencies of the SCST CIDEr-D reward over the training references: `images`, one document per "
        "image's captions (coco-caption's CIDEr-D); `captions`, each training caption a document (M2's train.py, "
        "the paper's recipe)."))
    scst_from: Text | None = Field(None, description=(
        "An XE checkpoint to start stage 2 from (null: this run's best XE checkpoint; with xe_epochs 0 it must be "
        "set). Checked when the run starts: it must load, with this run's vocabulary and model shape."))
    num_workers: Integer = Field(0, ge=0, description="DataLoader worker processes.")
    log_every: Integer = Field(50, ge=1, description=(
        "Steps between training-loss log lines: the cross-entropy steps (and each epoch's last) whose losses and "
        "divergence flag are read back to the host; the steps between read nothing back."))
    # Diagnostics (a2core.diagnostics: JSD, mask mean, Kendall tau, grounding) on a fixed val subset, reported
    # under diag/. On every `diag_every`-th epoch and always after the last; 0 = after the last epoch only.
    # Every epoch by default: a trial early stopping ends has them too, and they are cheap (smoke study, 1 thread:
    # 2.6 s against 77 s for a gate epoch with its validation, measured side by side; about 10% of a baseline one).
    diag_every: Integer = Field(1, ge=0, description=(
        "A2 diagnostics after every N-th epoch and always after the last (0: after the last only)."))
    diag_images: Integer = Field(100, ge=1, description="The diagnostics run on the first N val images.")
    diag_kendall_images: Integer = Field(10, ge=1, description=(
        "Kendall tau on the first N of those (one backward pass per word)."))
    diag_epochs: list[Integer] = Field(default_factory=list, description=(
        "Further epochs with diagnostics, whatever diag_every says: a study sets its scheduler's rungs here, so a "
        "trial stopped early ends with its diagnostics too."))

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        # select_metric is checked by Config (`check_select_metric`): what an epoch reports depends on the model too
        if self.xe_epochs + self.scst_epochs < 1:
            raise ConfigError("xe_epochs", "xe_epochs + scst_epochs must be >= 1")
        if self.scst_baseline == "mean" and self.scst_samples < 2:
            raise ConfigError("scst_samples", "the 'mean' baseline needs at least 2 samples")
        if self.scst_candidates == "beam" and self.scst_baseline != "mean":
            raise ConfigError("scst_baseline", "beam candidates take the mean reward of the beams as the baseline "
                                               "(M2); 'greedy' is for scst_candidates 'sample'")
        if self.batch_layout == "pairs" and self.mask_captions is not None:
            raise ConfigError("mask_captions", "batch_layout 'images' only: a 'pairs' batch holds one caption per "
                                               "row, and the mask step takes them all")
        if self.batch_size % CAPTIONS_PER_IMAGE and self.batch_layout == "pairs" and self.scst_epochs:
            raise ConfigError("batch_size", f"{self.batch_size} pairs: with SCST a step takes batch_size / "
                                            f"{CAPTIONS_PER_IMAGE} images (M2's batch_size // 5), so use a multiple "
                                            f"of {CAPTIONS_PER_IMAGE}")
        if self.batch_size % CAPTIONS_PER_IMAGE and self.batch_layout == "images":
            raise ConfigError("batch_size", f"{self.batch_size} image-caption pairs is not a whole number of images "
                                            f"with {CAPTIONS_PER_IMAGE} captions each: use a multiple of "
                                            f"{CAPTIONS_PER_IMAGE}")
        return self

    @property
    def images_per_step(self) -> int:
        """Images of one optimizer step over all workers (each with its 5 captions)."""
        return self.batch_size // CAPTIONS_PER_IMAGE


# -- which metric can pick the best epoch -------------------------------------------------------------------------
# What an epoch's report holds (a2core.train: `xe_epoch`, `scst_epoch`, `validate`, `diagnostics`; the diag/ keys
# are a2core.diagnostics.trial_diagnostics'). A select_metric no epoch reports picks no best epoch: no best.pt, no
# checkpoint for SCST to start from, nothing for the test evaluation to score, found out only when the run ends.
VAL_METRICS = ("val/BLEU-1", "val/BLEU-2", "val/BLEU-3", "val/BLEU-4", "val/ROUGE-L", "val/CIDEr")
GROUNDING_METRICS = tuple(f"diag/grounding/{k}" for k in ("accuracy", "control", "lift", "chance", "subject_object"))


def reported_metrics(model: ModelConfig, train: TrainConfig, data_kind: str = "synthetic") -> dict[str, str]:
    """Every selectable metric (val/, train/, diag/) some epoch of this configuration reports -> which epochs:
    "every" (every epoch), "xe" (the cross-entropy epochs only), "scst" (the SCST epochs only) or "diag" (the
    epochs with diagnostics: `diag_epochs`, every `diag_every`-th and the last). Names, not promises: a diag/
    value that does not apply on the data (a constant Kendall ranking, a val subset without grounded words) is
    left out of that epoch's report, and the mask statistics of train/ come from the epochs with a mask step."""
    out = dict.fromkeys(VAL_METRICS, "every")
    if train.val_meteor:
        out["val/METEOR"] = "every"
    mask = model.fusion != "none"  # the mask network (`A2Transformer.has_mask_network`)
    out["train/loss"] = "every"
    if train.xe_epochs:
        out["train/lr"] = "xe"  # the Noam rate of stage 1; an SCST epoch reports none
    if mask:
        out["train/mask_loss"] = out["train/mask_mean"] = "every"  # mask steps go on in SCST too
    if train.scst_epochs:
        out["train/reward"] = "scst"
    for i in range(model.layers):
        out[f"diag/jsd/layer{i}"] = "diag"
    if mask:
        out["diag/mask_mean"] = "diag"
    for kind in ("attention", "mask") if mask else ("attention",):
        out[f"diag/kendall/{kind}"] = "diag"
        for i in range(model.layers):
            out[f"diag/kendall/layer{i}/{kind}"] = "diag"
    if data_kind == "synthetic":  # only the synthetic set has ground-truth regions (grounding.json)
        out.update(dict.fromkeys(GROUNDING_METRICS, "diag"))
    return out


def _metric_list(names: list[str], layers: int) -> str:
    """The names for a message, each per-layer family once (diag/jsd/layer<i>, i < layers)."""
    shown: list[str] = []
    for name in names:
        short = re.sub(r"layer\d+", "layer<i>", name)
        if short not in shown:
            shown.append(short)
    return ", ".join(shown) + (f" (layer<i>: i < model.layers, {layers})" if any("<i>" in s for s in shown) else "")


def _not_reported_because(metric: str, model: ModelConfig, train: TrainConfig, data_kind: str) -> str:
    """Why a known metric is missing from this configuration's reports ("" for a name a2core never reports)."""
    if metric == "val/METEOR":
        return "; it needs train.val_meteor: true"
    if metric in ("train/mask_loss", "train/mask_mean", "diag/mask_mean", "diag/kendall/mask") or (
            metric.startswith("diag/kendall/layer") and metric.endswith("/mask")):
        return "; model.fusion 'none' has no mask network"
    if metric == "train/reward":
        return "; only SCST epochs report it (train.scst_epochs is 0)"
    if metric == "train/lr":
        return "; only cross-entropy epochs report it (train.xe_epochs is 0)"
    if re.fullmatch(r"diag/(jsd/layer\d+|kendall/layer\d+/(attention|mask))", metric):
        return f"; the model has {model.layers} layers (model.layers)"
    if metric in GROUNDING_METRICS and data_kind != "synthetic":
        return f"; data.kind {data_kind!r} has no ground-truth regions (synthetic data only)"
    return ""


def diagnosed_xe_epoch(train: TrainConfig) -> int | None:
    """The first cross-entropy epoch (1-based) whose report has the diagnostics (`Trainer.diagnostics`: an epoch of
    `diag_epochs`, every `diag_every`-th, and the run's last), or None when no XE epoch has them."""
    total = train.xe_epochs + train.scst_epochs
    for epoch in range(1, train.xe_epochs + 1):
        if epoch == total or epoch in train.diag_epochs or (train.diag_every and epoch % train.diag_every == 0):
            return epoch
    return None


def check_select_metric(model: ModelConfig, train: TrainConfig, data_kind: str = "synthetic") -> None:
    """ConfigError at train.select_metric unless an epoch of this configuration reports it (`reported_metrics`)
    and, when SCST starts from this run's best XE checkpoint (scst_from null), a cross-entropy epoch does."""
    metric = train.select_metric
    reported = reported_metrics(model, train, data_kind)
    if metric not in reported:
        raise ConfigError("train.select_metric", f"{metric!r} is not reported by any epoch of this configuration"
                                                 f"{_not_reported_because(metric, model, train, data_kind)}; one of "
                                                 f"{_metric_list(list(reported), model.layers)}")
    if not (train.scst_epochs and train.xe_epochs and train.scst_from is None):
        return
    # SCST starts from the best XE epoch by this metric (`Trainer._enter_scst`): with no XE epoch reporting it there
    # is none, and the run would fail at the switch, after all of its XE epochs.
    when = reported[metric]
    if when == "scst":
        why = f"only SCST epochs report {metric}"
        fix = "select on a metric the cross-entropy epochs report, or set train.scst_from"
    elif when == "diag" and diagnosed_xe_epoch(train) is None:
        why = (f"no cross-entropy epoch reports {metric} (diag_every {train.diag_every}, diag_epochs "
               f"{train.diag_epochs or '[]'}, xe_epochs {train.xe_epochs})")
        fix = (f"set train.diag_every <= xe_epochs ({train.xe_epochs}), add an XE epoch to train.diag_epochs, or "
               f"set train.scst_from")
    else:
        return
    raise ConfigError("train.select_metric", f"{why}: SCST (scst_epochs {train.scst_epochs}) starts from this run's "
                                             f"best XE checkpoint by it and would have none to start from; {fix}")


def images_per_worker(batch_size: int, workers: int) -> int:
    """Each worker's share of a global batch of `batch_size` image-caption pairs (train.batch_size); a
    ConfigError at train.batch_size naming both numbers when whole images do not split evenly over the workers."""
    images = batch_size // CAPTIONS_PER_IMAGE
    if images % workers:
        fits = [w for w in range(1, images + 1) if images % w == 0]
        raise ConfigError("train.batch_size", f"{batch_size} image-caption pairs ({images} images x "
                                              f"{CAPTIONS_PER_IMAGE} captions) do not split evenly over {workers} "
                                              f"workers; use a multiple of {CAPTIONS_PER_IMAGE * workers} pairs, "
                                              f"or {', '.join(map(str, fits))} workers")
    return images // workers


def pairs_per_worker(batch_size: int, workers: int) -> int:
    """Each worker's share of a global batch of `batch_size` pairs in batch_layout `pairs` (the global batch's
    r-th contiguous slice goes to rank r); a ConfigError at train.batch_size when it does not split evenly: no
    remainder rule, since a remainder would make the ranks' shares, and so the step, depend on the worker count."""
    if batch_size % workers:
        fits = [w for w in range(1, batch_size + 1) if batch_size % w == 0]
        raise ConfigError("train.batch_size", f"{batch_size} image-caption pairs (batch_layout pairs) do not split "
                                              f"evenly over {workers} workers; use a multiple of {workers} pairs, "
                                              f"or {', '.join(map(str, fits))} workers")
    return batch_size // workers


def check_batch_split(batch_size: int, workers: int, layout: str = "images", scst: bool = False) -> None:
    """ConfigError at train.batch_size unless the global batch splits evenly over `workers` in `layout`; with SCST
    (`scst`) its batch_size / 5 images must split too (an SCST step takes whole images in either layout)."""
    if layout == "pairs":
        pairs_per_worker(batch_size, workers)
    if layout == "images" or scst:
        images_per_worker(batch_size, workers)


def steps_per_epoch(train_images: int, batch_size: int, layout: str = "images") -> int:
    """Optimizer steps of one epoch over `train_images` at a global batch of `batch_size` pairs: the last batch
    is filled up from the start of the epoch's order, so every step has the full batch. In layout `pairs` an epoch
    is the train_images x 5 pairs (the captions `encoded_captions` gives every image) over batch_size; in
    `images`, the images over batch_size / 5: the same count whenever batch_size is a multiple of 5 (M2 drops
    the last partial batch instead: at most one step an epoch fewer)."""
    if layout == "pairs":
        return -(-(train_images * CAPTIONS_PER_IMAGE) // batch_size)
    return -(-train_images // (batch_size // CAPTIONS_PER_IMAGE))


class Config(Section):
    data: DataConfig = Field(default_factory=DataConfig, description="Which captions and region features.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The A2 Transformer and its alignment.")
    train: TrainConfig = Field(default_factory=TrainConfig, description=(
        "Optimisation, validation, SCST and the A2 diagnostics."))
    output_dir: Text = Field("runs/a2", description=(
        "Checkpoints and logs of a plain `a2 train` (a folder in use gets a numbered sibling)."))

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> Config:
        """Checks across sections: the select metric must be one this model and schedule report. Not for a saved
        config (`from_dict(saved=True)`): it describes a run already trained, which a later, stricter rule must not
        keep from being decoded, packaged or checked."""
        if not (info.context or {}).get("saved"):
            check_select_metric(self.model, self.train, self.data.kind)
        return self

    @classmethod
    def from_dict(cls, raw: dict | None, source: str | None = None, saved: bool = False) -> Config:
        """The validated config of a plain dict (YAML), every missing key at its default.

        Args:
            raw: `{"data": {...}, "model": {...}, "train": {...}}`; None or `{}` gives the defaults.
            source: The file `raw` came from, named in errors.
            saved: `raw` is a checkpoint's config (a run already trained): each key is checked, the rules across
                sections that decide how a run trains (`check_select_metric`) are not.

        Raises:
            ConfigError: Naming the dotted key (`model.heads`) and the file, for an unknown key, a wrong type or a
                value out of range.
        """
        try:
            return cls.model_validate(raw or {}, context={"saved": saved})
        except ValidationError as err:
            raise config_error(err, source) from None

    @property
    def longest_caption(self) -> int:
        """The longest caption in tokens the model is built for (`build_model`'s max_len): a training caption
        (data.max_caption_len) or a decoded one (train.max_len; beam search feeds max_len + 1 positions), whichever
        is longer. Positions are sinusoids, not weights: the table's length changes no checkpoint."""
        return max(self.data.max_caption_len, self.train.max_len) + 2

    def to_dict(self) -> dict:
        """A plain dict with the YAML key names (`lambda`), as checkpoints and MLflow store it."""
        return self.model_dump(by_alias=True)

    def replace(self, overrides: dict[str, Any]) -> Config:
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
        raise ConfigError("", "is a folder, not a YAML file" if path.is_dir() else "file not found", str(path))
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
    """`["model.lambda=0.05", "train.xe_epochs=3"]` applied to a copy of `raw`; values are parsed as YAML. Applied in
    order, so a key given twice takes the last value (as argparse does): a wrapper's defaults, then a run's own."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        match = _OVERRIDE.match(item)
        if not match:
            raise ConfigError("", f"override {item!r} is not of the form key.path=value", source)
        key, text = match.groups()
        value = _override_value(text, item, source)
        set_override(raw, key, value)
    return raw


def set_override(raw: dict, key: str, value: Any) -> None:
    """`set_dotted` for an override. One that switches data.kind (`data.kind=coco` on a synthetic study) leaves out
    the data keys, as written so far, that only the kind it replaces reads: they would not apply, and
    `check_data_kind` refuses such keys."""
    before = get_dotted(raw, "data.kind", DataConfig.model_fields["kind"].default)
    set_dotted(raw, key, value)
    if key == "data.kind" and value != before and isinstance(raw.get("data"), dict):
        raw["data"] = {k: v for k, v in raw["data"].items() if DATA_KIND_ONLY.get(k, value) == value}


def check_data_kind(data: Any, source: str | None = None) -> None:
    """ConfigError at the first data key, as written, that only another data.kind reads and that has a value other
    than its default (`DATA_KIND_ONLY`): it would be silently unused (a `captions` file given without `kind: coco`
    trains on the synthetic set; `images: 5000` does not limit COCO). A key at its default passes: the saved form of
    a config (`Config.to_dict`) holds every key. Not a check of `Config` itself, so that checkpoints and studies saved
    before it still load."""
    if not isinstance(data, dict):
        return
    kind = data.get("kind", DataConfig.model_fields["kind"].default)
    if kind not in get_args(DataConfig.model_fields["kind"].annotation):
        return  # the Config check names it
    for key, only in DATA_KIND_ONLY.items():
        if only != kind and key in data and data[key] != DataConfig.model_fields[key].default:
            default = "" if "kind" in data else " (the default)"
            raise ConfigError(f"data.{key}", f"only data.kind {only} reads it, and data.kind is {kind!r}{default}: "
                                             f"set data.kind: {only}, or drop data.{key}", source)


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
    """Set `raw["a"]["b"] = value` for key `a.b`, creating missing mappings on the way."""
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
    """`raw["a"]["b"]` for key `a.b`, or `default` where a part is missing."""
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
