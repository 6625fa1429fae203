"""Training: cross-entropy with Noam warmup and the alternating mask-network updates (stage 1), then self-critical
sequence training with a CIDEr-D reward (stage 2), its candidates sampled or the beams of a beam search
(`train.scst_candidates`, `Trainer.beam_candidates`). Plain PyTorch: `train(config, report)` runs the same under
`a2 train`, a test, or a Ray Train worker (which initialises torch.distributed before calling it).

Every step of stage 1 (`Updates.xe`) first computes, once, what neither step's mask network can change: the
batch's region encoding, every decoder layer's region keys/values and the decoder below its first cross-attention
(word embeddings and the first self-attention sublayer, `A2Transformer.decode_start`); in `train.batch_layout`
pairs, each distinct image of the step is encoded once and its encoding and keys/values are gathered per pair
(`Updates.xe`). Then:

  1. mask step (every `mask_every` steps, not for fusion `none`): L(theta_m) = -L_IC(a_p) + lambda P (Eq. 4,
     P and its reduction in `a2core.model.a2`) with the *perturbed* attention a_p, on those tensors detached (no
     second pass through them) and `mask_captions` captions per image (default all, the paper's schedule); the
     gradient goes to the mask network only: the backward runs with `inputs=` the mask parameters, so autograd
     computes no weight gradient of the frozen captioner (the 10,000-word output layer's included) and stops below
     the lowest cross-attention.
  2. captioner step: L_IC = cross-entropy of the captions under the *aligned* attention (Eq. 11) with the mask
     network just updated, continuing from the same shared tensors; the gradient goes to every parameter except
     the mask network's (m is detached).

Both steps see the same captioner weights, so the sharing changes nothing in the math (with dropout, the shared
part's dropout draws are shared too, as one pass would have them); only the mask network's own region keys are
computed after its update. Its statistics are read from the device once per mask step.

Precision (`train.precision`): every forward pass of training and decoding runs under `a2core.precision.autocast`;
fp16 adds a GradScaler shared by the optimizers of one step (one `update()` per step).

Data parallel: instead of DDP's wrapper (which expects one forward per step over one parameter set), the two
objectives' gradients are averaged across ranks with one flattened all-reduce each, which is what DDP does.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import checkpoint as ckpt
from . import precision
from .config import CAPTIONS_PER_IMAGE, Config, check_batch_split, steps_per_epoch
from .data.captions import Vocab
from .data.dataset import CaptionData
from .decode import ModelStepper, beam_search, captions_for, greedy, sample, score_split
from .diagnostics import trial_diagnostics
from .metrics import CiderD, caption_scores
from .model.a2 import build_model, next_word_logp
from .selection import improves
from .errors import CheckpointError, ConfigError, TrainingDiverged

# The data keys that decide a run's images and vocabulary (not where its files are): a resume must keep them.
DATA_CONTENT_KEYS = ("kind", "seed", "images", "test_split_images", "vocab_min_count", "max_caption_len", "val_images")
PER_IMAGE_KEY = "val/per_image_cider"  # every validation result: {"ids": [...], "scores": [CIDEr-D x100, ...]}
TEST_PER_IMAGE_KEY = "test/per_image_cider"  # the last result (train.test_at_end): the same on the test split
# Divergence: a run stops at the first step whose loss is not finite (TrainingDiverged). Without a loss scaler that
# step's NaN/inf gradient has already gone through Adam (and clipping, whose norm is NaN too) into every weight it
# touches, so every later step is NaN as well: training on only wastes the trial's epochs and ends with CIDEr 0.
# Under fp16 the GradScaler skips a step whose gradients are not finite and leaves the weights as they were, so a
# single overflow is not divergence: there the run stops after this many consecutive non-finite steps.
DIVERGED_STEPS_SCALED = 20
# The losses a divergence names, first the one it names when no loss of this rank was the non-finite one.
DIVERGENCE_KEYS = ("train/loss", "train/mask_loss")

log = logging.getLogger("a2core.train")
Report = Callable[[dict, "str | None"], None]


class StepProgress(NamedTuple):
    """Where a run is within an epoch, after each optimizer step (rank 0): `train`'s `progress` callback gets one.
    `metrics`: the epoch's running means so far (`train/loss`, ..., and `train/lr`), read from the device only at the
    `train.log_every` steps and at an epoch's last step, None at the others (no host sync in between)."""
    stage: str                      # "xe" or "scst"
    epoch: int                      # 1-based, the epoch being trained
    done: int                       # optimizer steps of this epoch done
    total: int                      # optimizer steps of this epoch
    step: int                       # global optimizer steps done
    metrics: dict | None = None


Progress = Callable[[StepProgress], None]


def noam(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """Learning rate at optimizer step `step` (0-based) of the Transformer schedule."""
    s = step + 1
    return factor * d_model ** -0.5 * min(s ** -0.5, s * warmup ** -1.5)


def learning_rate(step: int, d_model: int, warmup: int, factor: float = 1.0, schedule: str = "noam",
                  total_steps: int | None = None) -> float:
    """Learning rate of stage 1 at optimizer step `step` (0-based) under `train.lr_schedule`: `noam` (the paper's),
    or `noam_to_zero`, Noam times a linear ramp 1 - step / total_steps, from 1 at step 0 to 0 just after the last of
    `total_steps` (the last step, total_steps - 1, takes 1 / total_steps of the Noam rate; 0 from step total_steps
    on): the run ends annealed, so its last epochs settle instead of moving with a learning rate still near its
    peak."""
    lr = noam(step, d_model, warmup, factor)
    if schedule == "noam_to_zero":
        lr *= max(0.0, 1.0 - step / max(total_steps, 1))
    return lr


def lr_taken(sched: torch.optim.lr_scheduler.LambdaLR) -> float:
    """The learning rate the latest optimizer step took under `sched` (first parameter group): what `train/lr`
    reports. The schedule steps after the optimizer (`Updates.xe`), so after k steps its `get_last_lr()` is step k's
    rate, the NEXT step's (0 after the last step of a `noam_to_zero` run, whose last step took 1/N of Noam); the
    step taken, k - 1, is read from its lambda instead. Before any step: the rate the first step will take."""
    if sched.last_epoch < 1:
        return sched.get_last_lr()[0]
    return sched.base_lrs[0] * sched.lr_lambdas[0](sched.last_epoch - 1)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _Dist:
    """Rank, world size and the collective ops this loop needs (no-ops when not distributed)."""

    def __init__(self):
        self.on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1

    def average_grads(self, params, flag: torch.Tensor | None = None) -> torch.Tensor | None:
        """Average the gradients of `params` across ranks. `flag`: a one-element tensor (this rank's loss is not
        finite: 1) reduced in the same all-reduce, so that every rank takes the same decision at no extra collective;
        returned positive when any rank's is."""
        grads = [p.grad for p in params if p.grad is not None]
        if not self.on or (not grads and flag is None):
            return flag
        parts = [g.reshape(-1) for g in grads]
        if flag is not None:
            parts.append(flag.reshape(1).to(grads[0].dtype if grads else torch.float32))
        flat = torch.cat(parts)
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return None if flag is None else flat[-1:]

    def broadcast_params(self, module) -> None:
        if self.on:
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, 0)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        if not self.on or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
        return {k: float(v) / self.world for k, v in zip(keys, t.tolist())}

    def gather_dict(self, part: dict) -> dict:
        if not self.on:
            return part
        parts = [None] * self.world
        dist.all_gather_object(parts, part)
        out = {}
        for p in parts:
            out.update(p)
        return out


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def caption_loss(logits, targets, smoothing: float = 0.0):
    """Mean cross-entropy over real (non-pad) target words. logits (N, T, V), targets (N, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=0,
                           label_smoothing=smoothing)


def _on_device(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A step's value as a float64 0-dim tensor on `device`; a number is made there (no copy from the host)."""
    if isinstance(value, torch.Tensor):
        return value.detach().double().reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


class _Means:
    """Running means of named per-step values (a key counts only the steps that report it). A value may be a 0-dim
    tensor on the device (`Updates.xe`'s): it is summed there, and read (a host sync) only by `result`."""

    def __init__(self):
        self.sums: dict[str, float | torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, values: dict[str, float | torch.Tensor]) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
            self.counts[k] = self.counts.get(k, 0) + 1

    def result(self) -> dict[str, float]:
        return {k: float(self.sums[k] / self.counts[k]) for k in self.sums}


class Updates:
    """The parameter updates of one batch with their optimizers, loss scaler and autocast; data-free (the Trainer
    feeds it batches, benchmarks and tests call it on tensors). `step` arguments count the updates before."""

    def __init__(self, model, cfg: Config, device: torch.device, dist: _Dist | None = None,
                 xe_steps: int | None = None):
        """xe_steps: the optimizer steps of stage 1 (its epochs x steps per epoch), which `noam_to_zero` ends at."""
        t = cfg.train
        if t.lr_schedule == "noam_to_zero" and xe_steps is None:
            raise ValueError("train.lr_schedule noam_to_zero needs the run's stage-1 steps (xe_steps)")
        self.model, self.cfg, self.device, self.dist = model, cfg, device, dist or _Dist()
        self.cap_params = model.captioner_parameters()
        self.mask_params = model.mask_parameters()
        self.opt = torch.optim.Adam(self.cap_params, lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: learning_rate(s, cfg.model.d_model, t.warmup, t.lr_factor, t.lr_schedule, xe_steps))
        self.mask_opt = torch.optim.Adam(self.mask_params, lr=t.mask_lr) if self.mask_params else None
        self.scst_opt = torch.optim.Adam(self.cap_params, lr=t.scst_lr)
        precision.check(t.precision, device)
        self.scaler = precision.grad_scaler(t.precision, device)
        self._nonfinite: torch.Tensor | None = None  # this step's losses not finite, on any rank (`apply`)

    def amp(self):
        return precision.autocast(self.cfg.train.precision, self.device)

    def apply(self, loss: torch.Tensor, params, opt, clip: float = 0.0) -> None:
        """Backward of `loss` into `params` only, averaged across ranks, clipped (clip > 0), one optimizer step."""
        opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward(inputs=params)
        bad = self.dist.average_grads(params, (~torch.isfinite(loss.detach())).float().reshape(1))
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite + bad  # (1,), on the device
        if clip > 0:
            self.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, clip)
        self.scaler.step(opt)

    def take_nonfinite(self) -> torch.Tensor | None:
        """(1,) on the device, positive when a loss of the updates since the last call was not finite on any rank
        (then forgotten); None when there was no update. Not read here: reading it is a host sync."""
        bad, self._nonfinite = self._nonfinite, None
        return bad

    def mask_due(self, step: int) -> bool:
        return self.mask_opt is not None and (step + 1) % self.cfg.train.mask_every == 0

    def xe(self, feats, mask, caps, step: int, caption_image: torch.Tensor | None = None) -> dict[str, float]:
        """Stage 1 on one batch (module docstring): feats (B, R, D), mask (B, R) and either caps (B, C, L), an
        image's C captions (batch_layout images), or caps (P, L) of P pairs with caption_image (P,), the row of
        each pair's image in feats (batch_layout pairs). Returns the step's losses (and the mask step's mean mask)
        as 0-dim tensors on the device: the step reads nothing back to the host (`float()` one to read it)."""
        t = self.cfg.train
        with self.amp():
            enc = self.model.encode(feats, mask)  # (B, R, d)
            kv = self.model.memory(enc, mask_keys=False)  # region keys/values, per decoder layer
        if caption_image is not None:
            # Pairs of one image share its encoder pass and its keys/values: the B distinct images are encoded
            # once, and their rows are gathered per pair (index_select; its backward sums a shared image's pair
            # gradients). Each pair is then one image with C = 1 caption: enc (P, R, d), mask (P, R), caps (P, 1, L).
            enc, mask = enc.index_select(0, caption_image), mask.index_select(0, caption_image)
            kv = [{n: v.index_select(0, caption_image) for n, v in m.items()} for m in kv]
            caps = caps[:, None]
        tokens = caps.reshape(-1, caps.shape[-1])  # (B * C, L), an image's captions adjacent
        with self.amp():
            first = self.model.decode_start(tokens[:, :-1])  # (B * C, L - 1, d), below the first cross-attention
        out = {}
        if self.mask_due(step):
            out = self.mask_step(enc.detach(), mask, caps, step, [{n: v.detach() for n, v in m.items()} for m in kv],
                                 first.detach())
        with self.amp():
            mem = self.model.memory(enc.detach(), kv=kv)  # mask keys of the mask network as it is now (no gradient
            # flows into them: the captioner's pass uses the mask without one)
            logits, _ = self.model.decode(tokens[:, :-1], mem, mask, first=first)
            loss = caption_loss(logits, tokens[:, 1:], t.label_smoothing)
        self.apply(loss, self.cap_params, self.opt, t.grad_clip)
        self.sched.step()
        self.scaler.update()
        return {"train/loss": loss.detach(), **out}

    def mask_step(self, enc, mask, caps, step: int, kv: list[dict] | None = None,
                  first: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Eq. 4 on one batch: the mask network maximises the caption loss under perturbed attention.
        Its L_IC is the plain per-word cross-entropy (Eq. 11, no `label_smoothing`, which only the captioner's loss
        takes), its weight lambda `model.lambda` (the paper's 0.035 by default) on the penalty P of `a2core.model.a2`.
        enc (B, R, d): the batch's encoding, detached; caps (B, C, L), of which `mask_captions` per image are used,
        rotating with `step`. If already computed by the captioner's pass (detached): kv, the region keys/values
        of enc, and first (B * C, L - 1, d), `decode_start` of all C captions. Returns 0-dim tensors on the device."""
        b, c = caps.shape[:2]
        k = self.cfg.train.mask_captions
        if k is not None and k < c:
            chosen = (step * k + torch.arange(k, device=caps.device)) % c
            caps = caps[:, chosen]  # (B, k, L)
            if first is not None:
                first = first.view(b, c, *first.shape[1:])[:, chosen].flatten(0, 1)  # (B * k, L - 1, d)
        tokens = caps.reshape(-1, caps.shape[-1])
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        with self.amp():
            logits, penalty = self.model.decode(inp, self.model.memory(enc, kv), mask, mode="perturbed",
                                                word_mask=tgt != 0, first=first)
            loss = -caption_loss(logits, tgt) + self.cfg.model.mask_lambda * penalty
        self.apply(loss, self.mask_params, self.mask_opt)
        mask_mean = torch.stack([layer.cross.last_mask_mean for layer in self.model.decoder]).mean()
        return {"train/mask_loss": loss.detach(), "train/mask_mean": mask_mean.detach()}

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                "mask_optimizer": self.mask_opt.state_dict() if self.mask_opt else None,
                "scst_optimizer": self.scst_opt.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        if self.mask_opt and state.get("mask_optimizer"):
            self.mask_opt.load_state_dict(state["mask_optimizer"])
        if state.get("scst_optimizer"):
            self.scst_opt.load_state_dict(state["scst_optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


class Trainer:
    progress: Progress | None = None  # called after every optimizer step on rank 0 (`train`'s `progress`)

    def __init__(self, cfg: Config, output_dir: str | Path, resume_from: str | Path | None = None,
                 best_from: str | Path | None = None, data: CaptionData | None = None):
        """data: the data set of `cfg.data`, already loaded (replicate seeds trained together share one:
        `a2core.fused`); None: loaded here."""
        self.cfg = cfg
        # A resumed run whose best epoch came before the resume has no best.pt in its (new) output folder: the
        # caller hands in a copy of that epoch's checkpoint, for the test evaluation and the switch to SCST.
        self.best_from = Path(best_from) if best_from else None
        self.dist = _Dist()
        self.device = _device()
        self.output_dir = Path(output_dir)
        state = ckpt.load(resume_from) if resume_from else None
        self._resumed = ckpt.resolve(resume_from) if resume_from else None
        if state is not None:
            saved = Config.from_dict(state["config"], saved=True)
            if saved.model != cfg.model:
                keys = [f"model.{k} {getattr(saved.model, k)!r} in it, {getattr(cfg.model, k)!r} here"
                        for k in type(cfg.model).model_fields if getattr(saved.model, k) != getattr(cfg.model, k)]
                raise CheckpointError(f"{resume_from}: its model config differs from this run's ({'; '.join(keys)}); "
                                      f"cannot resume")
            # the data the run trained and selected on (paths aside: a node's copy of a store sits elsewhere): other
            # images or another vocabulary went on silently, the checkpoint's word ids read as the new data's
            if moved := [f"data.{k} {getattr(saved.data, k)!r} in it, {getattr(cfg.data, k)!r} here"
                         for k in DATA_CONTENT_KEYS if getattr(saved.data, k) != getattr(cfg.data, k)]:
                raise CheckpointError(f"{resume_from}: it was trained on other data ({'; '.join(moved)}); cannot "
                                      f"resume")
            # the stored best epoch was chosen by the checkpoint's selection rule: its value would be compared with
            # another metric's (a loss against a CIDEr), or in the other direction
            for key in ("select_metric", "select_mode"):
                was, now = getattr(saved.train, key), getattr(cfg.train, key)
                if was != now:
                    raise CheckpointError(f"{resume_from}: its train.{key} is {was!r}, this run's {now!r}; its best "
                                          f"epoch was chosen by the other; cannot resume")
        seed_everything(cfg.train.seed)
        vocab = Vocab(state["vocab"]) if state else None
        if data is None:
            data = CaptionData(cfg.data, cfg.model.max_regions, cfg.model.feature_dim, vocab)
            data.check(("train", "val"))
        elif vocab is not None and vocab != data.vocab:
            raise CheckpointError(f"{resume_from}: its vocabulary differs from the data set's; cannot resume")
        self.data = data
        if cfg.train.test_at_end:  # the test evaluation ends the run: a test image it cannot score fails here, not then
            data.check((), scored=("test",))
        self.vocab = self.data.vocab
        self.model = build_model(cfg.model, len(self.vocab), cfg.longest_caption).to(self.device)
        self.dist.broadcast_params(self.model)
        t = cfg.train
        xe_steps = steps_per_epoch(len(self.data.images("train")), t.batch_size, t.batch_layout) * t.xe_epochs
        self.updates = Updates(self.model, cfg, self.device, self.dist, xe_steps=xe_steps)
        # the trial's global batch split over its workers; refused here too when it does not split evenly
        check_batch_split(t.batch_size, self.dist.world, t.batch_layout, scst=t.scst_epochs > 0)
        # images a worker decodes at once in validation and diagnostics: its share of the batch's images
        self.images_per_worker = max(1, t.batch_size // CAPTIONS_PER_IMAGE // self.dist.world)
        self.epoch, self.step = 0, 0
        # the best epoch by train.select_metric ("value") and its val CIDEr (reported as best/val/CIDEr)
        self.best: dict = {"val/CIDEr": float("-inf"), "value": None, "epoch": 0}
        self.history: list[dict] = []
        self._cider = None
        self._divergence: torch.Tensor | None = None  # (4,) on the device (`_check_finite`)
        if state is not None:
            self._restore(state)
        if t.scst_epochs and t.scst_from and self.epoch <= t.xe_epochs:  # SCST still to enter (a resume may be past it)
            self._check_scst_from()

    def _check_scst_from(self) -> None:
        """Refuse a train.scst_from that `_enter_scst` could not start from (missing, no checkpoint, another
        vocabulary, weights of another shape) now, before the first epoch, rather than after every XE epoch. Only
        rank 0 reads it (as `_enter_scst` does); its verdict goes to every rank, so all of them stop alike."""
        problem = [scst_from_problem(self.cfg.train.scst_from, self.vocab, self.model.state_dict(), self.cfg)
                   if self.dist.rank == 0 else None]
        if self.dist.on:
            dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise CheckpointError(problem[0])

    # -- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(), **self.updates.state_dict(), "config": self.cfg.to_dict(),
            "vocab": self.vocab.words,
            "epoch": self.epoch, "step": self.step, "best": dict(self.best), "history": list(self.history),
            "rng": ckpt.rng_state(), "format": ckpt.FORMAT,
            # Which copy of the code trained it: on a cluster, the copy `ray up` synced to the node, not the laptop's.
            "code": {"a2core": str(Path(__file__).resolve().parent)},
        }

    def _restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.updates.load_state_dict(state)
        self.epoch, self.step = state["epoch"], state["step"]
        self.best, self.history = dict(state["best"]), list(state.get("history", []))
        if "value" not in self.best:  # a checkpoint from before train.select_metric: its value from the history
            self.best["value"] = next((h.get(self.cfg.train.select_metric) for h in self.history
                                       if h.get("epoch") == self.best["epoch"]), None)
        ckpt.set_rng_state(state["rng"])

    # -- one epoch of each stage ----------------------------------------------------------------------------------
    def _batches(self, stage: str = "xe"):
        """This rank's batches of one epoch: in stage xe, of `train.batch_layout`; in SCST, whole images
        (batch_size / 5 a step, M2's batch_size // 5) in either layout, since the candidates are drawn per image."""
        t = self.cfg.train
        if stage == "xe" and t.batch_layout == "pairs":
            loader = self.data.pair_loader(t.batch_size, seed=t.seed, epoch=self.epoch, rank=self.dist.rank,
                                           world=self.dist.world, num_workers=t.num_workers)
        else:
            loader = self.data.train_loader(t.images_per_step, seed=t.seed, epoch=self.epoch, rank=self.dist.rank,
                                            world=self.dist.world, num_workers=t.num_workers)
        self._epoch_steps = (self.step, len(loader))  # where the epoch starts and its steps, for `_step_done`
        return loader

    def _batch(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["feats"].to(self.device), batch["region_mask"].to(self.device)

    def _advance(self) -> None:
        self.step += 1
        self.model.train_step.fill_(self.step)

    def _check_finite(self, step_out: dict, read: bool = True) -> None:
        """Stop the run (TrainingDiverged) naming the step whose loss was not finite, or under fp16 the last of
        DIVERGED_STEPS_SCALED such steps in a row (see there). Kept on the device after every step, from the flag
        the gradient all-reduce carried (`Updates.apply`: every rank decides alike); read (a host sync) only when
        `read`: the cross-entropy stage reads it where it reads its running means anyway (`_read_due`), so a run
        that diverged trains on at most to there, and the error still names the step it diverged at."""
        bad = self.updates.take_nonfinite()
        if bad is not None:
            if self._divergence is None:  # consecutive non-finite steps; then that step, loss key and value
                self._divergence = torch.tensor([0.0, -1.0, 0.0, math.nan], dtype=torch.float64, device=bad.device)
            losses = torch.stack([_on_device(step_out.get(k, 0.0), bad.device) for k in DIVERGENCE_KEYS])  # (2,)
            nonfinite = ~torch.isfinite(losses)
            key = nonfinite.to(torch.int64).argmax()  # the first non-finite one, else 0 (another rank's was)
            value = torch.where(nonfinite.any(), losses.gather(0, key.reshape(1))[0], math.nan)
            run, at, was_key, was_value = self._divergence.unbind()
            run = torch.where(bad.reshape(()) > 0, run + 1, 0.0)
            limit = DIVERGED_STEPS_SCALED if self.updates.scaler.is_enabled() else 1
            hit = (run >= limit) & (at < 0)  # the first time only
            self._divergence = torch.stack([run, torch.where(hit, float(self.step), at),
                                            torch.where(hit, key.double(), was_key),
                                            torch.where(hit, value, was_value)])
        if read and self._divergence is not None:
            _, at, key, value = self._divergence.tolist()
            if at >= 0:
                raise TrainingDiverged(self.epoch + 1, int(at), DIVERGENCE_KEYS[int(key)], value)

    def _read_due(self) -> bool:
        """Whether this step's results are read on the host: every `train.log_every` steps and the epoch's last."""
        first, total = self._epoch_steps
        return self.step % self.cfg.train.log_every == 0 or self.step - first == total

    def _step_done(self, stage: str, means: _Means) -> None:
        """After each optimizer step, on rank 0: the `train.log_every` line (`log`, INFO; `a2 train` shows it) and
        the `progress` callback. The running means are read (a host sync) only at those steps and at the epoch's
        last, never in between."""
        if self.dist.rank != 0:
            return
        first, total = self._epoch_steps
        done = self.step - first
        metrics = None
        if self._read_due():
            lr = lr_taken(self.updates.sched) if stage == "xe" else self.cfg.train.scst_lr
            metrics = {**{k: float(v) for k, v in means.result().items()}, "train/lr": lr}
        if self.step % self.cfg.train.log_every == 0:
            log.info("epoch %d step %d (%d/%d of the epoch) loss %.4f lr %.2e", self.epoch + 1, self.step, done,
                     total, metrics["train/loss"], metrics["train/lr"])
        if self.progress is not None:
            self.progress(StepProgress(stage, self.epoch + 1, done, total, self.step, metrics))

    def xe_epoch(self) -> dict:
        self.model.train()
        means = _Means()
        for batch in self._batches():
            feats, mask = self._batch(batch)
            pairs = batch.get("caption_image")  # batch_layout pairs: (P,) the image row of each caption
            step_out = self.updates.xe(feats, mask, batch["captions"].to(self.device), self.step,
                                       None if pairs is None else pairs.to(self.device))
            means.add(step_out)
            self._advance()
            self._check_finite(step_out, read=self._read_due())
            self._step_done("xe", means)
        return {**means.result(), "train/lr": lr_taken(self.updates.sched)}  # the epoch's last step's rate

    def cider(self):
        """CIDEr-D reward with document frequencies precomputed once from the training captions."""
        if self._cider is None:
            refs = list(self.data.references("train").values())  # one list of captions per image
            if self.cfg.train.scst_reward_df == "captions":  # M2: each training caption a document
                refs = [[caption] for group in refs for caption in group]
            self._cider = CiderD.from_corpus(refs)
        return self._cider

    def scst_epoch(self) -> dict:
        t, u = self.cfg.train, self.updates
        cider = self.cider()
        refs_by_id = self.data.references("train")
        means = _Means()
        for batch in self._batches("scst"):
            feats, mask = self._batch(batch)
            ids = batch["image_ids"].tolist()
            k = t.scst_samples
            self.model.train()
            if t.scst_candidates == "beam":
                tokens, logps, valid = self.beam_candidates(feats, mask)
            else:
                with u.amp():
                    tokens, logps, valid = sample(self.model, feats, mask, k, t.max_len, self.vocab.bos,
                                                  self.vocab.eos)
            cands = [self.vocab.decode(seq) for seq in tokens.tolist()]
            refs = [refs_by_id[i] for i in ids for _ in range(k)]
            reward = torch.tensor(cider.scores(cands, refs), dtype=torch.float32, device=self.device).view(-1, k)
            if t.scst_candidates == "beam":
                baseline = reward.mean(1, keepdim=True)  # M2: the mean reward of the image's k beams, itself included
            elif t.scst_baseline == "mean":
                baseline = (reward.sum(1, keepdim=True) - reward) / (k - 1)  # mean of the *other* samples
            else:
                self.model.eval()
                with u.amp():
                    g = greedy(self.model, feats, mask, t.max_len, self.vocab.bos, self.vocab.eos)
                self.model.train()
                g_caps = [self.vocab.decode(seq) for seq in g.tolist()]
                baseline = torch.tensor(cider.scores(g_caps, [refs_by_id[i] for i in ids]),
                                        dtype=torch.float32, device=self.device)[:, None]
            advantage = (reward - baseline).view(-1, 1)
            loss = -(advantage * logps.float() * valid).sum() / valid.shape[0]
            u.apply(loss, u.cap_params, u.scst_opt, t.grad_clip)
            step_out = {"train/loss": loss.item(), "train/reward": float(reward.mean())}
            if u.mask_due(self.step):
                # The mask network keeps training against the captioner: Eq. 4 on the reference captions.
                with torch.no_grad(), u.amp():
                    enc = self.model.encode(feats, mask)
                step_out.update(u.mask_step(enc, mask, batch["captions"].to(self.device), self.step))
            u.scaler.update()
            means.add(step_out)
            self._advance()
            self._check_finite(step_out)
            self._step_done("scst", means)
        return means.result()

    def beam_candidates(self, feats, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SCST candidates of scst_candidates `beam` (M2's train_scst): the `scst_samples` beams of a beam search of
        that width, searched with the model in training mode as M2 does (dropout on), without a graph; then one
        teacher-forced pass over the k candidates gives their word log-probabilities with a graph (fresh dropout
        draws). M2 backpropagates through the search itself, which keeps max_len steps of k beams' activations;
        the pass costs one decoder forward and backward of the candidates, as a sample's does.

        feats (B, R, D), mask (B, R) -> tokens (B*k, L) (an image's k beams adjacent, best first, pad 0 after
        <eos>), log-probabilities (B*k, L) with grad and the mask (B*k, L) of the words that count (up to and
        including <eos>), as `a2core.decode.sample` returns them."""
        t, k = self.cfg.train, self.cfg.train.scst_samples
        with torch.no_grad(), self.updates.amp():
            beams, _ = beam_search(ModelStepper(self.model), feats, mask, k, t.max_len, self.vocab.bos,
                                   self.vocab.eos, all_beams=True)  # (B, k, L)
        tokens = beams.flatten(0, 1)  # (B*k, L)
        inp = torch.cat([torch.full_like(tokens[:, :1], self.vocab.bos), tokens[:, :-1]], dim=1)  # (B*k, L)
        with self.updates.amp():
            logits, _ = self.model.decode(inp, self.model.memory(self.model.encode(feats, mask)), mask)
            logps = next_word_logp(logits.float()).gather(-1, tokens[..., None]).squeeze(-1)  # (B*k, L), as searched
        eos = (tokens == self.vocab.eos).long()
        valid = eos.cumsum(1) - eos == 0  # the words before the first <eos>, and that <eos>
        return tokens, logps.masked_fill(~valid, 0.0), valid  # the pad after <eos> is no word: -inf, zeroed

    # -- validation -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict:
        t = self.cfg.train
        self.model.eval()
        beam = t.beam_size if t.val_decode == "beam" else 1
        with self.updates.amp():
            part = captions_for(self.data, ModelStepper(self.model), "val", beam_size=beam, max_len=t.max_len,
                                batch_size=self.images_per_worker, limit=self.cfg.data.val_images, device=self.device,
                                rank=self.dist.rank, world=self.dist.world)
        caps = self.dist.gather_dict(part)
        refs = self.data.references("val")
        refs = {i: refs[i] for i in caps}

        scores = caption_scores(refs, caps, meteor=t.val_meteor, per_image=True)  # x100
        per_image = scores.pop("per_image")
        out = {f"val/{k}": v for k, v in scores.items()}
        # per-image CIDEr-D (x100) for the paired bootstrap of comparisons; a dict, so no scalar log carries it
        out[PER_IMAGE_KEY] = {"ids": sorted(per_image), "scores": [per_image[i]["CIDEr"] for i in sorted(per_image)]}
        out["samples"] = [f"{i}: {caps[i]}" for i in sorted(caps)[:5]]
        return out

    def diagnostics(self) -> dict:
        """`diag/...` scalars (a2core.diagnostics.trial_diagnostics) on the first `train.diag_images` val images,
        on the epochs `train.diag_every` and `train.diag_epochs` name and after the last one; {} on other epochs."""
        t = self.cfg.train
        last = self.epoch == t.xe_epochs + t.scst_epochs
        if not (last or self.epoch in t.diag_epochs or (t.diag_every and self.epoch % t.diag_every == 0)):
            return {}

        start = time.perf_counter()
        images = min(t.diag_images, self.cfg.data.val_images or t.diag_images)
        rng = ckpt.rng_state()  # their data loaders draw from the global generators: training must not see it
        try:
            out = trial_diagnostics(self.model, self.data, "val", images, min(t.diag_kendall_images, images),
                                    batch_size=self.images_per_worker, device=self.device)
        finally:
            ckpt.set_rng_state(rng)
        return {**out, "time/diag_s": time.perf_counter() - start}

    @torch.no_grad()
    def test_evaluation(self) -> dict:
        """`test/...` scores (x100) and per-image CIDEr-D of the best checkpoint (the epoch of the best val CIDEr)
        on the test split, beam search; the model's own weights are put back afterwards. {} without test images."""
        t = self.cfg.train
        if not self.data.images("test"):
            return {}
        start = time.perf_counter()
        # only rank 0 writes best.pt (into its own output folder): it sends the weights to the other ranks
        path = self.best_checkpoint() if self.dist.rank == 0 else None
        best = [ckpt.load(path, map_location="cpu")["model"] if path is not None else None]
        if self.dist.on:
            dist.broadcast_object_list(best, src=0)
        if best[0] is None:  # the same answer on every rank (broadcast)
            log.warning("no copy of the best checkpoint (epoch %d) here: the test split is not scored",
                        self.best["epoch"])
            return {}
        current = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(best[0])
        self.model.eval()
        try:
            with self.updates.amp():
                scores, per_image = score_split(self.data, ModelStepper(self.model), "test", meteor=self.test_meteor(),
                                                gather=self.dist.gather_dict, beam_size=t.beam_size,
                                                max_len=t.max_len, batch_size=t.batch_size,
                                                limit=t.test_images, device=self.device, rank=self.dist.rank,
                                                world=self.dist.world)
        finally:
            self.model.load_state_dict(current)
        out = {f"test/{k}": v for k, v in scores.items()}
        out[TEST_PER_IMAGE_KEY] = {"ids": list(per_image), "scores": list(per_image.values())}
        return {**out, "test/epoch": self.best["epoch"], "time/test_s": time.perf_counter() - start}

    def test_meteor(self) -> bool:
        """Whether the test evaluation scores METEOR: `train.test_meteor` and Java present (a warning when not)."""
        if not self.cfg.train.test_meteor:
            return False
        if shutil.which("java") is None:
            log.warning("no Java here: the test split is scored without METEOR (test/METEOR not reported)")
            return False
        return True

    def best_checkpoint(self) -> Path | None:
        """This run's best checkpoint: best.pt in the output folder, else the copy handed in as `best_from`."""
        for path in (self.output_dir / "best.pt", self.best_from):
            if path is not None and path.is_file():
                return path
        return None

    # -- the loop ---------------------------------------------------------------------------------------------------
    def _save_epoch(self, metrics: dict, improved: bool) -> Path | None:
        if self.dist.rank != 0:
            return None
        state = self.state_dict()
        last = ckpt.save(state, self.output_dir / "last.pt")
        if improved:
            # a kill between the two leaves last.pt the best epoch and best.pt an older one: `_repair_best` on resume
            self._keep_as_best(last, state)
        return last

    def _keep_as_best(self, src: Path, state: dict | None = None) -> None:
        """Make best.pt the checkpoint `src` (atomically): a hard link (last.pt is replaced, by a new inode, next
        epoch, so the link keeps this one), else, on a file system without hard links, a copy written anew."""
        tmp = self.output_dir / ".best.pt.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError:  # exFAT, some network and FUSE mounts: no hard links
            ckpt.save(state if state is not None else ckpt.load(src), self.output_dir / "best.pt")
            return
        os.replace(tmp, self.output_dir / "best.pt")

    def _repair_best(self, resumed: Path) -> None:
        """A run resumed in its own folder (`a2 train --resume RUN/last.pt`, no `best_from`) from a checkpoint that is
        its best epoch so far: make best.pt that checkpoint unless it already is. A run killed after writing last.pt
        but before linking best.pt to it left best.pt an older epoch (SCST would start from it and the test split be
        scored on it) or none at all."""
        if self.dist.rank != 0 or self.best_from is not None or not 0 < self.best["epoch"] == self.epoch:
            return
        if not (self.output_dir.is_dir() and os.path.samefile(resumed.parent, self.output_dir)):
            return  # another folder: its best so far is the caller's to hand in (`best_from`)
        best = self.output_dir / "best.pt"
        if best.is_file() and os.path.samefile(best, resumed):
            return
        self._keep_as_best(resumed)

    def _enter_scst(self) -> None:
        """Switch point: stage 2 starts from the configured XE checkpoint (default: this run's best)."""
        src = self.cfg.train.scst_from or self.best_checkpoint() or (self.output_dir / "best.pt")
        if self.dist.on:
            dist.barrier()
        # only rank 0 writes best.pt (into its own output folder): it sends the weights to the other ranks, as
        # `test_evaluation` does
        loaded = [None]
        if self.dist.rank == 0:
            state = ckpt.load(src, map_location="cpu")
            loaded = [{"model": state["model"], "vocab": state["vocab"], "epoch": state.get("epoch")}]
        if self.dist.on:
            dist.broadcast_object_list(loaded, src=0)
        state = loaded[0]
        if Vocab(state["vocab"]) != self.vocab:
            raise CheckpointError(f"{src}: its vocabulary differs from this run's; cannot start SCST from it")
        step = self.model.train_step.clone()
        self.model.load_state_dict(state["model"])
        self.model.train_step.copy_(step)
        log.info("SCST starts from %s (epoch %s)", src, state.get("epoch"))

    def run(self, report: Report | None) -> dict:
        t = self.cfg.train
        total = t.xe_epochs + t.scst_epochs
        test: dict = {}
        if self._resumed is not None:
            self._repair_best(self._resumed)
        if 0 < total <= self.epoch and t.test_at_end:
            # Resumed from the last epoch's checkpoint: a run stopped after saving it but before its result (and the
            # test scores that come with it) was kept scores the test split now, and reports the last epoch again
            # with them (no checkpoint: there is no new one).
            test = self.test_evaluation()
            if report is not None and test and self.history:
                report({**self.history[-1], **test, "samples": []}, None)
        while self.epoch < total:
            stage = "xe" if self.epoch < t.xe_epochs else "scst"
            if stage == "scst" and self.epoch == t.xe_epochs:
                self._enter_scst()
            start = time.perf_counter()
            train_metrics = self.xe_epoch() if stage == "xe" else self.scst_epoch()
            test = self.end_epoch(stage, train_metrics, start, report) or test
        return self.result(test)

    def end_epoch(self, stage: str, train_metrics: dict, start: float, report: Report | None) -> dict:
        """What follows an epoch's training (`train_metrics`, begun at `start`, perf_counter): validation,
        diagnostics, the best epoch, the checkpoints, after the last epoch the test evaluation, and the report.
        Returns the test evaluation ({} before the last epoch). `a2core.fused` calls it per seed."""
        t = self.cfg.train
        test: dict = {}
        train_metrics = self.dist.mean(train_metrics)
        self.epoch += 1
        val = self.validate()
        val.update(self.diagnostics())
        samples = val.pop("samples")
        # None on an epoch that did not report it (a diag/ metric off its epochs)
        value = val.get(t.select_metric, train_metrics.get(t.select_metric))
        improved = improves(value, self.best["value"], t.select_mode)  # the latest of equals (a2core.selection)
        if improved:
            self.best = {"val/CIDEr": val["val/CIDEr"], "value": value, "epoch": self.epoch, "stage": stage}
        metrics = {"epoch": self.epoch, "step": self.step, "stage": stage, **train_metrics, **val,
                   "best/val/CIDEr": self.best["val/CIDEr"], "best/epoch": self.best["epoch"],
                   "time/epoch_s": time.perf_counter() - start}
        self.history.append({k: v for k, v in metrics.items() if isinstance(v, (int, float, str))})
        last = self._save_epoch(metrics, improved)
        if self.epoch == t.xe_epochs + t.scst_epochs and t.test_at_end:
            test = self.test_evaluation()
            metrics.update(test)
        metrics["samples"] = samples
        if report is not None:
            self._report(report, metrics, last)
        return test

    def result(self, test: dict) -> dict:
        """`train`'s return value (see there) once the run has ended; test: its test evaluation ({}: none)."""
        return {"best/val/CIDEr": self.best["val/CIDEr"], "best_epoch": self.best["epoch"], "epochs": self.epoch,
                "steps": self.step, "best_checkpoint": str(best) if (best := self.best_checkpoint()) else None,
                "last_checkpoint": str(self.output_dir / "last.pt"), "history": self.history,
                # the caller of `train` keeps these (`a2 train` writes test_scores.json); the per-image list too
                "test": {k: v for k, v in test.items() if isinstance(v, (int, float))},
                "test_per_image_cider": test.get(TEST_PER_IMAGE_KEY)}

    def _report(self, report: Report, metrics: dict, last: Path | None) -> None:
        if last is None:
            report(metrics, None)
            return
        tmp = Path(tempfile.mkdtemp(prefix="a2ckpt-"))
        try:
            try:
                os.link(last, tmp / ckpt.CHECKPOINT_FILE)
            except OSError:  # another filesystem: copy instead
                shutil.copy2(last, tmp / ckpt.CHECKPOINT_FILE)
            (tmp / ckpt.HISTORY_FILE).write_text(json.dumps(self.history))
            report(metrics, str(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


# The model keys that shape its weights: named when a train.scst_from checkpoint's weights do not fit this run's.
SHAPE_KEYS = ("d_model", "layers", "d_ff", "feature_dim", "max_regions", "fusion", "mask_net")


def scst_from_problem(path: str | Path, vocab: Vocab, model_state: dict, cfg: Config) -> str | None:
    """Why SCST could not start from the checkpoint at `path` (train.scst_from) in a run of `cfg` with `vocab` and
    a model whose `model_state` (its state_dict) the weights must fit, or None when it can. Reads the file; loads
    no weights into any model."""
    try:
        state = ckpt.load(path, map_location="cpu")
    except CheckpointError as err:
        return f"train.scst_from: {err}"
    if Vocab(state["vocab"]) != vocab:
        return (f"train.scst_from: {path}: its vocabulary differs from this run's ({len(state['vocab'])} words, "
                f"{len(vocab)} here); cannot start SCST from it")
    theirs = state["model"]
    if not isinstance(theirs, dict):
        return f"train.scst_from: {path}: its 'model' is not a state dict; cannot start SCST from it"
    mismatch = next((f"{k} {tuple(theirs[k].shape)} in the checkpoint, {tuple(v.shape)} here"
                     for k, v in model_state.items() if k in theirs and tuple(theirs[k].shape) != tuple(v.shape)),
                    None)
    missing = [k for k in model_state if k not in theirs]
    extra = [k for k in theirs if k not in model_state]
    if mismatch is None and not missing and not extra:
        return None
    what = [f"first mismatch: {mismatch}"] if mismatch else []
    for label, names in (("missing from it", missing), ("not in this model", extra)):
        if names:
            what.append(f"{label}: {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else ""))
    try:  # the config it was trained with, when it holds a readable one, says which key made the difference
        saved = Config.from_dict(state["config"], saved=True).model
        keys = [f"model.{k} {getattr(saved, k)} in the checkpoint, {getattr(cfg.model, k)} here" for k in SHAPE_KEYS
                if getattr(saved, k) != getattr(cfg.model, k)]
    except ConfigError:  # a config this a2core no longer accepts: the parameters alone say what differs
        keys = []
    return (f"train.scst_from: {path}: its model does not fit this run's ({'; '.join(keys + what)}); cannot start "
            f"SCST from it")


def train(config: Config | dict, report: Report | None = None, *, output_dir: str | Path | None = None,
          resume_from: str | Path | None = None, best_from: str | Path | None = None,
          progress: Progress | None = None, started: Callable[[], None] | None = None) -> dict:
    """Train one configuration: cross-entropy epochs, then SCST epochs (see the module docstring).

    Args:
        config: A `Config`, or a plain dict that `Config.from_dict` accepts.
        report: Called after every epoch with the epoch's metrics (`train/...`, `val/...` on the x100 scale,
            `diag/...`) and the folder of that epoch's checkpoint (None on ranks other than 0).
        output_dir: Where `best.pt` and `last.pt` go (default: `config.output_dir`).
        resume_from: A checkpoint to continue from, bit-identically (model, optimizers, step, RNG states).
        best_from: With `resume_from`: the checkpoint of the run's best epoch so far, when that epoch came before
            the resumed one (the test evaluation and SCST start from the best epoch, and the new output folder
            has no best.pt until an epoch beats it).
        progress: Called after every optimizer step (rank 0) with a `StepProgress`: the epoch, its steps done and
            planned, and at the `train.log_every` steps and each epoch's last the running means of its losses
            (`a2 train` draws a bar on a terminal from it).
        started: Called once the run is set up (its config, checkpoint and data checked), before its first epoch:
            `a2 train` says there which folder it writes to, so that a run refused before never names one.

    Raises:
        TrainingDiverged: a loss was not finite (`DIVERGED_STEPS_SCALED` says when); the epoch it happened in is
            not reported, the earlier ones and their checkpoints stay.

    Returns:
        `best/val/CIDEr`, `best_epoch`, `epochs`, `steps`, `best_checkpoint` (the best epoch's checkpoint the test
        evaluation used: best.pt in the output folder, else `best_from`; None when there is neither),
        `last_checkpoint`, `history` (one dict of scalars per epoch), `test` (the end-of-run test evaluation of
        the best epoch: `test/CIDEr`, ... x100, `test/epoch`, `time/test_s`; {} when it did not run:
        `train.test_at_end` false, no test images)
        and `test_per_image_cider` (`{"ids", "scores"}` or None). A run resumed from its last epoch's checkpoint
        trains nothing: it scores the test split from its best checkpoint (`best_from` when that epoch came before)
        and reports the last epoch again with those scores.
    """
    cfg = config if isinstance(config, Config) else Config.from_dict(config)
    trainer = Trainer(cfg, output_dir or cfg.output_dir, resume_from, best_from)
    trainer.progress = progress
    if started is not None:
        started()
    return trainer.run(report)
