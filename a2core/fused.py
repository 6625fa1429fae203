"""Replicate seeds of one configuration trained as one fused model: k seeds, one process, one step for all.

A study's replicates differ only in `train.seed`; at the paper's sizes one seed's cross-entropy step leaves a GPU
mostly idle (benchmarks/RESULTS.md, "On a GPU": launch-bound, a few % of the card's FLOPs), so the k seeds run as
one batched model (HFTA's horizontal fusion) with `torch.func`:

  * every parameter of the k models is stacked into one tensor (k, ...) (`torch.func.stack_module_state`), and
    each seed's own `A2Transformer` has its parameters replaced by *views* of its slice, so that the seed's model
    is always the fused weights' seed i: validation, diagnostics, checkpoints, the test evaluation and SCST run on
    it unchanged (`a2core.train.Trainer`, one per seed);
  * a step is `torch.func.vmap(functional_call(template, params_i, batch_i), randomness="different")` over the
    seeds: each seed its own batch (its own data order, `train.seed`), its own dropout draws, one kernel launch
    for the k (self-attention written out on the mapped model, `SelfAttention.sdpa = False`: vmap has no batching
    rule for the CPU SDPA kernel and would run it once per seed);
  * the update is elementwise per seed: Adam on the stacked tensors is k Adams (its state is per element);
    gradient clipping takes each seed's own norm (`_clip_per_seed`); the learning rate is the same schedule for
    all (the configuration is the same).

Each seed keeps its initialisation (its `Trainer` seeds the generators and builds the model exactly as a run of
its own), its data order, Adam state, clipping norm, best epoch, checkpoints (normal single-model checkpoints:
the seed's model and an Adam state of its own slices) and test scores, and reports through its own callback.

What differs from k separate runs: dropout draws (vmap's "different" randomness draws the k seeds' masks from one
generator, so a seed's draws are not those of its run alone: the same distribution, not the same numbers) and
floating-point rounding (batched kernels block their sums differently). With dropout 0 the losses and weights
match the separate runs to rounding (tests/test_fused.py states the tolerance).

Stage 1 (cross-entropy, with the mask network's steps) is fused. SCST (stage 2), validation, diagnostics and the
test evaluation run per seed after it, one seed after the other, on the seed's own model (not fused). fp16 is
refused: its loss scaler skips a step for every parameter when one gradient overflows, which would couple the seeds.

A step reads nothing back from the device: losses, mask statistics and the non-finite flags accumulate in device
tensors, read at log points and at the end of an epoch (`FusedReplicates.metrics`). Caption lengths (and, in the
`pairs` layout, the distinct images of a step) are padded to a fixed bucket when `bucket` (default on CUDA): a
pad word is ignored by the loss and seen by no real word (causal self-attention), a pad image is encoded but no
caption reads it, so the values are unchanged and every step has one shape (what a CUDA graph needs).
"""
from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.func import functional_call, stack_module_state, vmap

from . import precision
from .config import Config
from .errors import ConfigError, TrainingDiverged
from .model.a2 import SelfAttention
from .train import Report, Trainer, caption_loss, lr_taken

log = logging.getLogger("a2core.fused")


def check_replicates(configs: Sequence[Config]) -> None:
    """ConfigError unless the configs are one configuration with different seeds (everything equal but
    `train.seed` and `output_dir`), at least one, with no fp16 (see the module docstring)."""
    if not configs:
        raise ConfigError("train.seed", "no replicate to train")

    def key(c: Config) -> dict:
        d = c.to_dict()
        d["train"] = {k: v for k, v in d["train"].items() if k != "seed"}
        d.pop("output_dir", None)
        return d

    first = key(configs[0])
    for c in configs[1:]:
        if key(c) != first:
            diff = sorted(s for s in first if first[s] != key(c).get(s))
            raise ConfigError(".".join(diff[:1]) or "config", "fused replicates must differ only in train.seed")
    seeds = [c.train.seed for c in configs]
    if len(set(seeds)) != len(seeds):
        raise ConfigError("train.seed", f"fused replicates need distinct seeds, got {seeds}")
    if configs[0].train.precision == "fp16":
        raise ConfigError("train.precision", "fused replicates train in fp32 or bf16: fp16's loss scaler would skip "
                                             "every seed's step when one seed's gradient overflows")


def _clip_per_seed(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for each seed of stacked gradients, each (k, ...): seed i's gradients are
    scaled by min(1, max_norm / (||g_i|| + 1e-6)), ||g_i|| the 2-norm over all its parameters. In place; returns
    the k norms (k,), on the device."""
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], dim=1)  # (k, params)
    total = torch.linalg.vector_norm(norms, dim=1)  # (k,)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, [coef.view(-1, *([1] * (g.dim() - 1))) for g in grads])
    return total


class FusedReplicates:
    """k replicate seeds of one configuration, trained together (module docstring). `trainers[i]` is seed i's
    `a2core.train.Trainer`, whose model's parameters are views of the stacked parameters' slice i."""

    def __init__(self, configs: Sequence[Config | dict], output_dirs: Sequence[str | Path] | None = None, *,
                 resume_from: Sequence[str | Path | None] | None = None,
                 best_from: Sequence[str | Path | None] | None = None,
                 bucket: bool | None = None, tf32: bool = True):
        """configs: one per seed (`check_replicates`). output_dirs: each seed's folder (default: its
        `output_dir`). resume_from / best_from: per seed, as `a2core.train.train`'s (all seeds at the same epoch).
        bucket: pad every step to one shape (default: on CUDA). tf32: fp32 matrix products in TF32 where the card
        has it (`a2core.precision.fp32_matmul`)."""
        configs = [c if isinstance(c, Config) else Config.from_dict(c) for c in configs]
        check_replicates(configs)
        k = len(configs)
        dirs = list(output_dirs) if output_dirs is not None else [c.output_dir for c in configs]
        resume_from = list(resume_from) if resume_from is not None else [None] * k
        best_from = list(best_from) if best_from is not None else [None] * k
        self.cfg = configs[0]
        self.trainers: list[Trainer] = []
        for i, cfg in enumerate(configs):
            # one data set for all (the same `data` section); each Trainer seeds the generators and builds its
            # model as a run of its own would
            data = self.trainers[0].data if self.trainers else None
            self.trainers.append(Trainer(cfg, dirs[i], resume_from[i], best_from[i], data=data))
        epochs = {(tr.epoch, tr.step) for tr in self.trainers}
        if len(epochs) > 1:
            raise ConfigError("train.seed", f"fused replicates resume from one epoch and step, got {sorted(epochs)}")
        if self.trainers[0].dist.on:
            raise ConfigError("resources.workers_per_trial", "fused replicates train on one worker")
        self._setup([tr.model for tr in self.trainers], self.trainers[0].device, self.trainers[0].step,
                    self.trainers[0].updates.sched.lr_lambdas[0], bucket, tf32)
        if self.step:
            self._gather_optimizer_state()

    @classmethod
    def for_models(cls, models: Sequence[torch.nn.Module], cfg: Config, device: torch.device, *,
                   bucket: bool | None = None, tf32: bool = True) -> "FusedReplicates":
        """The fused step alone over k models already built (a benchmark's): `xe_step` and `metrics`, no data,
        no epochs, no checkpoints. The learning rate is Noam without the ramp to zero."""
        from .train import learning_rate
        self = cls.__new__(cls)
        self.cfg, self.trainers = cfg, []
        t = cfg.train
        self._setup(list(models), device, 0,
                    lambda s: learning_rate(s, cfg.model.d_model, t.warmup, t.lr_factor, "noam"), bucket, tf32)
        return self

    def _setup(self, models, device, step: int, lr_lambda, bucket, tf32) -> None:
        """Stack the k models' parameters (each model's become views of its slice), the fused optimizers, and the
        step's three batched passes."""
        t = self.cfg.train
        self.k, self.device = len(models), device
        self.matmul = precision.fp32_matmul(self.device, tf32)
        self.bucket = self.device.type == "cuda" if bucket is None else bucket
        # the module functional_call runs: its own parameters are never used (each call passes the seeds'), its
        # buffers are (the word positions and the global step, the same for every seed)
        self.template = copy.deepcopy(models[0])
        for module in self.template.modules():  # self-attention written out, which vmap batches (SelfAttention)
            if isinstance(module, SelfAttention):
                module.sdpa = False
        params, _ = stack_module_state(models)  # name -> (k, ...) leaf tensors, tied weights once
        self.params = params
        for i, model in enumerate(models):
            for name, p in model.named_parameters():  # seed i's parameters become views of slice i
                p.data = params[name].detach()[i]
        mask_ids = {id(p) for p in self.template.mask_parameters()}
        by_name = dict(self.template.named_parameters())
        self.mask_names = [n for n in by_name if id(by_name[n]) in mask_ids]
        self.cap_names = [n for n in by_name if id(by_name[n]) not in mask_ids]
        # fused Adam: one kernel over all tensors, no host read of its step count (CPU and CUDA)
        self.opt = torch.optim.Adam([params[n] for n in self.cap_names], lr=1.0, betas=(0.9, 0.98), eps=1e-9,
                                    fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)
        self.mask_opt = (torch.optim.Adam([params[n] for n in self.mask_names], lr=t.mask_lr, fused=True)
                         if self.mask_names else None)
        self.step = step
        self.dead: dict[int, TrainingDiverged] = {}  # seed index -> how it diverged
        self._reset_metrics()
        self._passes(t.batch_layout == "pairs")
        self.captured = False

    # -- optimizer state between the fused tensors and each seed's own Adam ------------------------------------------
    def _pairs(self, i: int):
        """(seed i's optimizer, fused optimizer, [(seed i's parameter, stacked name)]) for both parameter groups."""
        tr = self.trainers[i]
        named = {id(p): n for n, p in tr.model.named_parameters()}
        out = [(tr.updates.opt, self.opt, [(p, named[id(p)]) for p in tr.updates.cap_params])]
        if self.mask_opt is not None:
            out.append((tr.updates.mask_opt, self.mask_opt, [(p, named[id(p)]) for p in tr.updates.mask_params]))
        return out

    def _scatter_optimizer_state(self) -> None:
        """Each seed's Adam (and schedule) becomes its slice of the fused ones, so that its checkpoint holds an
        optimizer state of its own, loadable by a single-model run (`Trainer.state_dict`)."""
        for i in range(self.k):
            for seed_opt, fused_opt, pairs in self._pairs(i):
                for p, name in pairs:
                    fused = fused_opt.state.get(self.params[name])
                    if fused:
                        seed_opt.state[p] = {"step": fused["step"].detach().clone().cpu().float(),
                                             "exp_avg": fused["exp_avg"][i], "exp_avg_sq": fused["exp_avg_sq"][i]}
                seed_opt.param_groups[0]["lr"] = fused_opt.param_groups[0]["lr"]
            sched = self.trainers[i].updates.sched
            sched.last_epoch, sched._last_lr = self.sched.last_epoch, list(self.sched.get_last_lr())

    def _gather_optimizer_state(self) -> None:
        """The fused Adams from the seeds' own (resumed from their checkpoints): seed i's moments become slice i."""
        seeds = [self._pairs(i) for i in range(self.k)]
        for g, (_, fused_opt, pairs) in enumerate(seeds[0]):
            for j, (_, name) in enumerate(pairs):
                states = [seed[g][0].state.get(seed[g][2][j][0]) for seed in seeds]
                if not all(states):
                    continue
                fused_opt.state[self.params[name]] = {
                    "step": states[0]["step"].to(self.device, torch.float32).reshape(()),
                    "exp_avg": torch.stack([st["exp_avg"] for st in states]).to(self.device),
                    "exp_avg_sq": torch.stack([st["exp_avg_sq"] for st in states]).to(self.device)}
            fused_opt.param_groups[0]["lr"] = seeds[0][g][0].param_groups[0]["lr"]
        self.sched.last_epoch = self.trainers[0].updates.sched.last_epoch
        self.sched._last_lr = list(self.trainers[0].updates.sched.get_last_lr())

    # -- one step ---------------------------------------------------------------------------------------------------
    def _reset_metrics(self) -> None:
        """Device accumulators of one epoch, each (k,): sums of the per-step values and (for the mask step) their
        counts; the first non-finite step of each seed (-1: none)."""
        z = lambda: torch.zeros(self.k, dtype=torch.float64, device=self.device)  # noqa: E731
        self.sums = {"train/loss": z(), "train/mask_loss": z(), "train/mask_mean": z()}
        self.counts = {"train/loss": 0, "train/mask_loss": 0, "train/mask_mean": 0}
        self.first_bad = torch.full((self.k,), -1, dtype=torch.int64, device=self.device)

    def _amp(self):
        return precision.autocast(self.cfg.train.precision, self.device)

    def mask_due(self, step: int) -> bool:
        return self.mask_opt is not None and (step + 1) % self.cfg.train.mask_every == 0

    def _passes(self, pairs: bool) -> None:
        """The step's three batched passes over the seeds, built once (so that `capture` can compile each):
        `_shared`, what neither step's mask network changes (Updates.xe): enc (k, B, R, d), the region mask, keys
        and values, and decode_start (k, B * C, L - 1, d), gathered per pair in the pairs layout; `_perturbed`, Eq. 4
        and the mean mask value (k,) each; `_captioner`, the cross-entropy (k,)."""
        t, tmpl = self.cfg.train, self.template
        unset = torch.tensor(float("nan"))  # CrossAttention.last_mask_mean between passes

        def shared(feats, mask, caps, caption_image=None):
            enc = tmpl.encode(feats, mask)  # (B, R, d)
            kv = tmpl.memory(enc, mask_keys=False)
            if caption_image is not None:  # pairs: each pair one image with one caption, rows gathered
                enc, mask = enc.index_select(0, caption_image), mask.index_select(0, caption_image)
                kv = [{n: v.index_select(0, caption_image) for n, v in m.items()} for m in kv]
                caps = caps[:, None]
            tokens = caps.reshape(-1, caps.shape[-1])  # (B * C, L)
            return enc, mask, kv, tmpl.decode_start(tokens[:, :-1])

        def perturbed(enc, mask, caps, kv, first):
            tokens = caps.reshape(-1, caps.shape[-1])
            inp, tgt = tokens[:, :-1], tokens[:, 1:]
            logits, penalty = tmpl.decode(inp, tmpl.memory(enc, kv), mask, mode="perturbed",
                                          word_mask=tgt != 0, first=first)
            loss = -caption_loss(logits, tgt) + self.cfg.model.mask_lambda * penalty
            mask_mean = torch.stack([layer.cross.last_mask_mean for layer in tmpl.decoder]).mean()
            for layer in tmpl.decoder:  # a per-seed value of vmap must not outlive the pass on the module (nor, in
                layer.cross.last_mask_mean = unset  # a compiled pass, be left to it as a side effect to replay)
            return loss, mask_mean

        def captioner(enc, mask, caps, kv, first):
            tokens = caps.reshape(-1, caps.shape[-1])
            mem = tmpl.memory(enc.detach(), kv=kv)  # the mask network as it is now, without a gradient
            logits, _ = tmpl.decode(tokens[:, :-1], mem, mask, first=first)
            return caption_loss(logits, tokens[:, 1:], t.label_smoothing)

        def over_seeds(fn: Callable) -> Callable:
            """fn mapped over the seeds, fn(*args) run with the template's parameters replaced by seed i's
            (`functional_call` of a function rather than of forward, as a pass calls several methods of one model).
            The module that binds fn is built here once, not in the pass: a module built while `torch.compile`
            traces is a pending mutation it cannot capture in one graph."""
            bound = _Bound(tmpl, fn)

            def call(p, *args):
                return functional_call(bound, {f"m.{n}": v for n, v in p.items()}, args, tie_weights=True,
                                       strict=False)
            return vmap(call, randomness="different")

        self._shared, self._perturbed, self._captioner = (over_seeds(f) for f in (shared, perturbed, captioner))

    def capture(self, mode: str | None = "reduce-overhead", backend: str | Callable = "inductor") -> None:
        """Compile each of the step's three passes into one graph (`torch.compile`, `fullgraph`: a pass that would
        break into pieces is an error, not a slower step). Default mode "reduce-overhead": CUDA graphs, each pass's
        kernels replayed with one launch; every step must then have one shape (`bucket`): each pass is compiled once
        per shape it meets, the full batch and an epoch's shorter last one. On a CPU there are no CUDA graphs: inductor
        compiles C++ kernels (benchmarks/RESULTS.md); tests there compile with `backend="aot_eager"`, which traces
        forward and backward as inductor does, without generating code."""
        if not self.bucket:
            raise ValueError("capture: every step needs one shape (bucket=True)")
        self._shared, self._perturbed, self._captioner = (
            torch.compile(f, mode=mode, backend=backend, fullgraph=True, dynamic=False)
            for f in (self._shared, self._perturbed, self._captioner))
        self.captured = True

    def xe_step(self, feats: torch.Tensor, mask: torch.Tensor, caps: torch.Tensor,
                caption_image: torch.Tensor | None = None) -> None:
        """One stage-1 step of every seed (`a2core.train.Updates.xe`, per seed): feats (k, B, R, D), mask (k, B, R),
        caps (k, B, C, L) (images layout) or caps (k, P, L) with caption_image (k, P) (pairs layout): seed i's
        batch is row i. Reads nothing back from the device."""
        t, params, step = self.cfg.train, self.params, self.step
        if self.captured and self.device.type == "cuda":  # a new iteration: its CUDA graphs may reuse the memory
            # of the last step's pass outputs (all consumed by now)
            torch.compiler.cudagraph_mark_step_begin()
        args = (params, feats, mask, caps) + (() if caption_image is None else (caption_image,))
        with self._amp():
            enc, mask_p, kv, first = self._shared(*args)
        caps_p = caps if caption_image is None else caps[:, :, None]  # (k, B, C, L)
        if self.mask_due(step):
            self._mask_step(enc.detach(), mask_p, caps_p, step, [{n: v.detach() for n, v in m.items()} for m in kv],
                            first.detach())
        with self._amp():
            loss = self._captioner(params, enc, mask_p, caps_p, kv, first)  # (k,)
        cap = [params[n] for n in self.cap_names]
        self.opt.zero_grad(set_to_none=True)
        loss.sum().backward(inputs=cap)  # seed i's loss reaches only seed i's slice: k separate gradients
        if t.grad_clip > 0:
            _clip_per_seed([p.grad for p in cap], t.grad_clip)
        self.opt.step()
        self.sched.step()
        self._accumulate("train/loss", loss, step)
        self.step += 1
        self.template.train_step.fill_(self.step)  # the global step of Eq. 8, on the device (no host read)

    def _mask_step(self, enc, mask, caps, step: int, kv, first) -> None:
        """Eq. 4 for every seed (`a2core.train.Updates.mask_step`): enc (k, B, R, d), caps (k, B, C, L), kv and
        first (k, B * C, L - 1, d) detached."""
        b, c = caps.shape[1:3]
        n = self.cfg.train.mask_captions
        if n is not None and n < c:
            chosen = (step * n + torch.arange(n, device=caps.device)) % c
            caps = caps[:, :, chosen]  # (k, B, n, L)
            first = first.view(self.k, b, c, *first.shape[2:])[:, :, chosen].flatten(1, 2)  # (k, B * n, L - 1, d)
        with self._amp():
            loss, mask_mean = self._perturbed(self.params, enc, mask, caps, kv, first)  # (k,) each
        params = [self.params[n] for n in self.mask_names]
        self.mask_opt.zero_grad(set_to_none=True)
        loss.sum().backward(inputs=params)
        self.mask_opt.step()
        self._accumulate("train/mask_loss", loss, step)
        self._accumulate("train/mask_mean", mask_mean, None)

    def _accumulate(self, key: str, value: torch.Tensor, step: int | None) -> None:
        """Add the k values (k,) of this step to the epoch's sums; a loss (`step` given) that is not finite marks
        the seed's first such step. Device ops only."""
        value = value.detach().double()
        self.sums[key] += value
        self.counts[key] += 1
        if step is not None:
            bad = ~torch.isfinite(value)
            self.first_bad = torch.where(bad & (self.first_bad < 0), torch.full_like(self.first_bad, step),
                                         self.first_bad)

    # -- batches ----------------------------------------------------------------------------------------------------
    def stack(self, batches: list[dict]) -> tuple:
        """The k seeds' batches of one step as the fused step takes them (`xe_step`), on the device. Captions are
        padded to one length (the bucket of `data.max_caption_len` when `bucket`, else the longest of the step);
        in the pairs layout the distinct images to one count (the pairs per step when `bucket`), pad images being
        copies of the seed's first (no caption reads them: no gradient, no change in value)."""
        pairs = "caption_image" in batches[0]
        length = (self.cfg.data.max_caption_len + 2 if self.bucket
                  else max(b["captions"].shape[-1] for b in batches))
        caps = [torch.nn.functional.pad(b["captions"], (0, length - b["captions"].shape[-1])) for b in batches]
        feats = [b["feats"] for b in batches]
        masks = [b["region_mask"] for b in batches]
        index = None
        if pairs:
            rows = (caps[0].shape[0] if self.bucket else max(f.shape[0] for f in feats))
            fill = lambda x: torch.cat([x, x[:1].expand(rows - x.shape[0], *x.shape[1:])])  # noqa: E731
            feats, masks = [fill(f) for f in feats], [fill(m) for m in masks]
            index = torch.stack([b["caption_image"] for b in batches]).to(self.device, non_blocking=True)
        to = lambda xs: torch.stack(xs).to(self.device, non_blocking=True)  # noqa: E731
        return to(feats), to(masks), to(caps), index

    def _loaders(self):
        return [tr._batches() for tr in self.trainers]

    # -- epochs -----------------------------------------------------------------------------------------------------
    def metrics(self) -> list[dict]:
        """Each seed's epoch means so far, `Trainer.xe_epoch`'s keys, and the learning rate: one read from the
        device for all."""
        keys = [k for k in self.sums if self.counts[k]]
        table = torch.stack([self.sums[k] / self.counts[k] for k in keys]).tolist() if keys else []  # (keys, k)
        lr = lr_taken(self.sched)  # the latest step's rate, as `Trainer.xe_epoch` reports it
        return [{**{k: row[i] for k, row in zip(keys, table)}, "train/lr": lr} for i in range(self.k)]

    def xe_epoch(self) -> list[dict]:
        """One stage-1 epoch of every seed, each on its own data order; its metrics per seed."""
        for tr in self.trainers:
            tr.model.train()
        self.template.train()
        self._reset_metrics()
        every = self.cfg.train.log_every
        for batches in zip(*self._loaders()):
            self.xe_step(*self.stack(list(batches)))
            if self.step % every == 0:  # a log point: the one read of the device in `every` steps
                losses = [m["train/loss"] for m in self.metrics()]
                log.info("epoch %d step %d loss %s lr %.2e", self.trainers[0].epoch + 1, self.step,
                         " ".join(f"{x:.4f}" for x in losses), lr_taken(self.sched))
        for tr in self.trainers:
            tr.step = self.step
            tr.model.train_step.fill_(self.step)
        self._scatter_optimizer_state()
        return self.metrics()

    def _check_finite(self, out: list[dict]) -> None:
        """Seeds whose loss went non-finite this epoch are dead from now on (`TrainingDiverged`, kept in
        `self.dead`): they are neither validated nor reported again; the others train on (a seed's NaN never
        reaches another's weights: every update is per seed)."""
        first = self.first_bad.tolist()
        for i, s in enumerate(first):
            if s >= 0 and i not in self.dead:
                key = next((k for k in ("train/loss", "train/mask_loss") if k in out[i]
                            and out[i][k] != out[i][k]), "train/loss")
                self.dead[i] = TrainingDiverged(self.trainers[i].epoch + 1, s + 1, key, float("nan"))
                log.warning("seed %d diverged at step %d (%s not finite): it stops", self.trainers[i].cfg.train.seed,
                            s + 1, key)

    def _live_epoch(self) -> int | None:
        """The epochs the live seeds have run (they agree); None once every seed has diverged. A dead seed's count
        stops where it diverged, so it cannot say when stage 1 ends."""
        return next((tr.epoch for i, tr in enumerate(self.trainers) if i not in self.dead), None)

    def run(self, reports: Sequence[Report | None]) -> list[dict | TrainingDiverged]:
        """Every seed's run (`a2core.train.train`'s epochs): the stage-1 epochs fused, each followed by each live
        seed's validation, checkpoints and report (`reports[i]`); then SCST per seed. Returns per seed
        `a2core.train.train`'s result, or the `TrainingDiverged` that ended it."""
        t = self.cfg.train
        total = t.xe_epochs + t.scst_epochs
        tests: list[dict] = [{} for _ in range(self.k)]
        while (epoch := self._live_epoch()) is not None and epoch < min(t.xe_epochs, total):
            start = time.perf_counter()
            out = self.xe_epoch()
            self._check_finite(out)
            for i, tr in enumerate(self.trainers):
                if i not in self.dead:
                    tests[i] = tr.end_epoch("xe", out[i], start, reports[i]) or tests[i]
        results: list[dict | TrainingDiverged] = []
        for i, tr in enumerate(self.trainers):
            if i in self.dead:
                results.append(self.dead[i])
                continue
            if tr.epoch < total:  # stage 2, this seed alone
                try:
                    results.append(tr.run(reports[i]))
                except TrainingDiverged as err:
                    results.append(err)
            else:
                results.append(tr.result(tests[i]))
        return results


class _Bound(torch.nn.Module):
    """A module whose forward is `fn` over `m`'s parameters (`FusedReplicates._passes`)."""

    def __init__(self, m: torch.nn.Module, fn: Callable):
        super().__init__()
        self.m, self.fn = m, fn

    def forward(self, *args):
        return self.fn(*args)


def train_replicates(configs: Sequence[Config | dict], reports: Sequence[Report | None] | None = None, *,
                     output_dirs: Sequence[str | Path] | None = None,
                     resume_from: Sequence[str | Path | None] | None = None,
                     best_from: Sequence[str | Path | None] | None = None,
                     bucket: bool | None = None, tf32: bool = True) -> list[dict | TrainingDiverged]:
    """Train k replicate seeds of one configuration as one fused model (module docstring).

    Args:
        configs: One config per seed, equal but for `train.seed` (and `output_dir`); fp32 or bf16.
        reports: One `report(metrics, checkpoint_dir)` per seed, called as `a2core.train.train` calls its own:
            after each of the seed's epochs, with a normal single-model checkpoint.
        output_dirs, resume_from, best_from: per seed, as `a2core.train.train`'s.
        bucket, tf32: see `FusedReplicates`.

    Returns:
        Per seed, `a2core.train.train`'s result dict, or the `TrainingDiverged` that stopped that seed (the others
        go on: no seed's values reach another's).
    """
    fused = FusedReplicates(configs, output_dirs, resume_from=resume_from, best_from=best_from, bucket=bucket,
                            tf32=tf32)
    return fused.run(list(reports) if reports is not None else [None] * fused.k)
