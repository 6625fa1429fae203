"""A2 Transformer cost at the paper's sizes, measured side by side in one run.

1. Training step: A2 (fusion `gate`) against the plain Transformer (fusion `none`), same sizes and batch.
   The A2 step is what `a2core.train.Trainer.xe_epoch` does per batch: the captioner's cross-entropy step under
   the aligned attention, then the mask network's adversarial step (Eq. 4, `Trainer._mask_step` itself).
   The plain step is the captioner step alone (no mask network exists).
2. Beam search (beam 5, max 20 words) with the decoder key/value cache against re-running the whole prefix
   every step (`UncachedStepper`), on the A2 model; the two must return the same captions.

Sizes: d_model 512, 8 heads, 6 layers, d_ff 2048, 50 regions of 2048-d features, captions of 16 tokens,
vocabulary 10,000; a batch of 10 images x 5 captions (CPU-sized; the paper trains with 50 images).
Timings are interleaved (A2, plain, plain, A2, ...) and the median of the repeats is reported.

On a GPU: `--device cuda [--autocast bf16|fp16]`: both steps and both searches run under the same autocast
(no loss scaling: only the arithmetic is timed); CUDA timings synchronise before reading the clock.

Usage: python benchmarks/bench_model.py [--repeats 5] [--images 10] [--beam-images 4] [--threads 1]
                                        [--device cpu|cuda] [--autocast none|bf16|fp16]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from types import SimpleNamespace

import torch

from a2core.config import ModelConfig
from a2core.decode import UncachedStepper, beam_search
from a2core.model.a2 import build_model
from a2core.train import Trainer, _caption_loss, noam

D_MODEL, HEADS, LAYERS, D_FF = 512, 8, 6, 2048
REGIONS, FEATURE_DIM, CAPTION_LEN, VOCAB = 50, 2048, 16, 10000
CAPTIONS_PER_IMAGE = 5
BEAM_SIZE, BEAM_MAX_LEN = 5, 20


def make_batch(images: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.relu(torch.randn(images, REGIONS, FEATURE_DIM, generator=g))
    mask = torch.ones(images, REGIONS, dtype=torch.bool)
    n = torch.randint(10, REGIONS + 1, (images,), generator=g)  # images have 10-50 regions
    mask &= torch.arange(REGIONS)[None, :] < n[:, None]
    feats = feats * mask[..., None]
    tokens = torch.randint(4, VOCAB, (images * CAPTIONS_PER_IMAGE, CAPTION_LEN + 1), generator=g)
    tokens[:, 0] = 1  # <bos>
    return feats, mask, tokens[:, :-1], tokens[:, 1:]


AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Run:
    """Where and how everything runs: the device, the autocast dtype, the clock."""

    def __init__(self, device: str, autocast: str):
        self.device = torch.device(device)
        self.dtype = AUTOCAST[autocast]

    def amp(self):
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None)

    def timed(self, fn) -> float:
        gc.collect()
        self.sync()
        start = time.perf_counter()
        with self.amp():
            fn()
        self.sync()
        return time.perf_counter() - start

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Step:
    """One training step of a model, as the Trainer runs it."""

    def __init__(self, fusion: str, device: torch.device, seed: int = 0):
        torch.manual_seed(seed)
        self.cfg = ModelConfig(d_model=D_MODEL, layers=LAYERS, heads=HEADS, d_ff=D_FF, max_regions=REGIONS,
                               feature_dim=FEATURE_DIM, fusion=fusion)
        self.model = build_model(self.cfg, VOCAB, max(CAPTION_LEN, BEAM_MAX_LEN) + 2).to(device).train()  # positions for both
        self.cap_params = self.model.captioner_parameters()
        self.mask_params = self.model.mask_parameters()
        self.opt = torch.optim.Adam(self.cap_params, lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: noam(s, D_MODEL, 10000))
        self.mask_opt = torch.optim.Adam(self.mask_params, lr=1e-4) if self.mask_params else None
        # What Trainer._mask_step reads from the trainer.
        self.trainer = SimpleNamespace(model=self.model, cfg=SimpleNamespace(model=self.cfg), mask_opt=self.mask_opt,
                                       mask_params=self.mask_params, dist=SimpleNamespace(average_grads=lambda p: None))

    def __call__(self, feats, mask, inp, tgt) -> None:
        # Captioner step (Trainer.xe_epoch): aligned attention, gradient to every parameter but the mask network's.
        logits, _ = self.model(feats, mask, inp, repeat=CAPTIONS_PER_IMAGE)
        loss = _caption_loss(logits, tgt)
        self.opt.zero_grad(set_to_none=True)
        loss.backward(inputs=self.cap_params)
        torch.nn.utils.clip_grad_norm_(self.cap_params, 1.0)
        self.opt.step()
        self.sched.step()
        if self.mask_opt is not None:
            Trainer._mask_step(self.trainer, feats, mask, inp, tgt)


def fmt(seconds: list[float]) -> str:
    return f"median {statistics.median(seconds):7.3f} s  (min {min(seconds):.3f}, max {max(seconds):.3f}, n={len(seconds)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--images", type=int, default=10, help="images per training batch (x5 captions)")
    ap.add_argument("--beam-images", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1 is steadiest on a shared machine)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--autocast", choices=sorted(AUTOCAST), default="none")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run = Run(args.device, args.autocast)

    feats, mask, inp, tgt = (t.to(run.device) for t in make_batch(args.images))
    a2, plain = Step("gate", run.device), Step("none", run.device)
    n_a2 = sum(p.numel() for p in a2.model.parameters())
    n_mask = sum(p.numel() for p in a2.mask_params)
    n_plain = sum(p.numel() for p in plain.model.parameters())
    print(f"training step: d_model {D_MODEL}, {HEADS} heads, {LAYERS} layers, d_ff {D_FF}, {REGIONS} regions x "
          f"{FEATURE_DIM}, captions {CAPTION_LEN} tokens, vocab {VOCAB}, batch {args.images} images x "
          f"{CAPTIONS_PER_IMAGE} captions; torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"device {run.device}, autocast {args.autocast}")
    print(f"  parameters: A2 {n_a2 / 1e6:.1f}M (mask network {n_mask / 1e6:.1f}M), plain {n_plain / 1e6:.1f}M")
    for step in (a2, plain):  # warm-up (allocator, Adam state, CUDA kernels)
        run.timed(lambda: step(feats, mask, inp, tgt))
    t_a2, t_plain = [], []
    for r in range(args.repeats):
        order = [(a2, t_a2), (plain, t_plain)] if r % 2 == 0 else [(plain, t_plain), (a2, t_a2)]
        for step, out in order:
            out.append(run.timed(lambda: step(feats, mask, inp, tgt)))
    m_a2, m_plain = statistics.median(t_a2), statistics.median(t_plain)
    print(f"  A2 (gate) step incl. mask step : {fmt(t_a2)}")
    print(f"  plain Transformer step         : {fmt(t_plain)}")
    print(f"  ratio A2 / plain               : {m_a2 / m_plain:.2f}x")

    # -- beam search ----------------------------------------------------------------------------------------------
    model = a2.model.eval()
    bfeats, bmask = feats[: args.beam_images], mask[: args.beam_images]
    with torch.no_grad(), run.amp():
        seq_c, score_c = beam_search(model, bfeats, bmask, beam_size=BEAM_SIZE, max_len=BEAM_MAX_LEN)
        seq_u, score_u = beam_search(UncachedStepper(model), bfeats, bmask, beam_size=BEAM_SIZE, max_len=BEAM_MAX_LEN)
    same = torch.equal(seq_c, seq_u) and torch.allclose(score_c, score_u, atol=1e-3)
    t_c, t_u = [], []
    for r in range(args.repeats):
        runs = [(model, t_c), (UncachedStepper(model), t_u)]
        for stepper, out in (runs if r % 2 == 0 else runs[::-1]):
            out.append(run.timed(lambda: beam_search(stepper, bfeats, bmask, beam_size=BEAM_SIZE, max_len=BEAM_MAX_LEN)))
    m_c, m_u = statistics.median(t_c), statistics.median(t_u)
    print(f"beam search: beam 5, max 20 words, {args.beam_images} images, A2 model (eval), "
          f"{seq_c.shape[1]} steps decoded; cached == uncached: {same}")
    print(f"  cached   : {fmt(t_c)}")
    print(f"  uncached : {fmt(t_u)}")
    print(f"  ratio uncached / cached: {m_u / m_c:.2f}x")
    print(f"summary: an A2 training step (captioner + mask network) costs {m_a2 / m_plain:.2f}x a plain Transformer "
          f"step ({m_a2:.2f} s vs {m_plain:.2f} s for {args.images}x{CAPTIONS_PER_IMAGE} captions on {run.device}, "
          f"autocast {args.autocast}); "
          f"the key/value cache makes beam search {m_u / m_c:.2f}x faster than re-running the prefix.")


if __name__ == "__main__":
    main()
