"""A2 Transformer cost at the paper's sizes, measured side by side in one run.

1. Training step: A2 (fusion `gate`) against the plain Transformer (fusion `none`), same sizes and batch, each
   step being exactly what `a2core.train.Trainer.xe_epoch` runs per batch (`Updates.xe`): for A2 the mask
   network's adversarial step (Eq. 4) then the captioner's cross-entropy step under the aligned attention; for the
   plain Transformer the captioner step alone (no mask network exists). A2 runs twice: with the paper's schedule
   (a mask step every step on all 5 captions per image) and with the cheaper one (`--cheap-captions` captions
   per image in the mask step, every `--cheap-every` steps).
2. Beam search (beam 5, max 20 words) with the decoder key/value cache against re-running the whole prefix
   every step (`UncachedStepper`), on the A2 model; the two must return the same captions.

Sizes: d_model 512, 8 heads, 6 layers, d_ff 2048, 50 regions of 2048-d features, captions of 16 tokens,
vocabulary 10,000; a batch of 10 images x 5 captions (the images layout; the paper, as M2, draws 50 random pairs).
Measuring on a shared, loaded machine: every repeat times the A2 arms once and the plain step twice, in an order
that rotates every repeat, so the samples of one repeat ran under about the same load; plain_i is the mean of the
repeat's two plain samples. Reported per A2 arm: the ratio of the medians over repeats, the median (min-max) of
the per-repeat pairs A2_i / plain_i, which cancels load that changes between repeats, and the ratio of the fastest
samples (load only ever adds time); as a yardstick of the noise, the same for the plain step's second sample
against its first, whose true ratio is 1. Both for wall-clock time and, on CPU, for the process's CPU time
(`time.process_time`: time spent waiting for a core is not counted, so with one thread it is the steadiest
measure of work; it is the clock of the summary). With --cheap-every N > 1 each cheaper-schedule sample is N
consecutive steps divided by N. The load-free yardstick: each arm's matrix-multiply FLOPs per step, forward and
backward (`torch.utils.flop_counter`), and their ratio, which is what the time ratio tends to where matrix
multiplies dominate.

On a GPU: `--device cuda [--precision bf16|fp16]`: every arm and both searches run under that
`train.precision` (autocast, plus loss scaling for fp16); CUDA timings synchronise before reading the clock.

Usage: python benchmarks/bench_model.py [--repeats 9] [--images 10] [--beam-images 4] [--beam-only] [--threads 1]
                                        [--cheap-captions 1] [--cheap-every 1]
                                        [--device cpu|cuda] [--precision fp32|bf16|fp16]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from a2core import precision
from a2core.config import Config
from a2core.decode import UncachedStepper, beam_search
from a2core.model.a2 import build_model
from a2core.train import Updates

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


class Run:
    """Where and how everything runs: the device, train.precision, the clock."""

    def __init__(self, device: str, prec: str):
        self.device, self.precision = torch.device(device), prec

    def amp(self):
        return precision.autocast(self.precision, self.device)

    def timed(self, fn) -> float:
        """Wall-clock seconds of fn()."""
        return self.timed_both(fn)[0]

    def timed_both(self, fn) -> tuple[float, float]:
        """(wall-clock seconds, this process's CPU seconds) of fn()."""
        gc.collect()
        self.sync()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        self.sync()
        return time.perf_counter() - wall, time.process_time() - cpu

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Arm:
    """One model trained as the Trainer trains it (`Updates.xe`), `every` consecutive steps per call."""

    def __init__(self, run: Run, fusion: str, mask_captions: int | None = None, every: int = 1, seed: int = 0):
        torch.manual_seed(seed)
        self.cfg = Config.from_dict({
            "model": {"d_model": D_MODEL, "layers": LAYERS, "heads": HEADS, "d_ff": D_FF, "max_regions": REGIONS,
                      "feature_dim": FEATURE_DIM, "fusion": fusion},
            "train": {"warmup": 10000, "mask_captions": mask_captions, "mask_every": every,
                      "precision": run.precision}})
        self.model = build_model(self.cfg.model, VOCAB, max(CAPTION_LEN, BEAM_MAX_LEN) + 2).to(run.device).train()
        self.updates = Updates(self.model, self.cfg, run.device)
        self.every, self.step = every, 0

    def __call__(self, feats, mask, caps) -> None:
        for _ in range(self.every):
            self.updates.xe(feats, mask, caps, self.step)
            self.step += 1


def fmt(seconds: list[float]) -> str:
    return (f"median {statistics.median(seconds):7.3f} s  (min {min(seconds):.3f}, max {max(seconds):.3f}, "
            f"n={len(seconds)})")


def ratios(arm: list[float], plain: list[float]) -> dict[str, float]:
    """arm and plain: per-repeat seconds, index i from the same repeat. The ratio of the medians, the median, min
    and max of the per-repeat pairs arm_i / plain_i, and the ratio of the minima."""
    pairs = [a / p for a, p in zip(arm, plain, strict=True)]
    return {"of_medians": statistics.median(arm) / statistics.median(plain), "pairs": statistics.median(pairs),
            "min": min(pairs), "max": max(pairs), "of_minima": min(arm) / min(plain)}


def fmt_ratio(r: dict[str, float]) -> str:
    return (f"pairs {r['pairs']:.3f}x ({r['min']:.3f}-{r['max']:.3f}), of medians {r['of_medians']:.3f}x, "
            f"of minima {r['of_minima']:.3f}x")


def beam_search_speedup(run: Run, a2_model, feats, mask, images: int, repeats: int) -> float:
    """Beam search with the key/value cache against re-running the prefix, on the A2 model: the speed-up."""
    model = a2_model.eval()
    bfeats, bmask = feats[: images], mask[: images]
    with torch.no_grad(), run.amp():
        seq_c, score_c = beam_search(model, bfeats, bmask, beam_size=BEAM_SIZE, max_len=BEAM_MAX_LEN)
        seq_u, score_u = beam_search(UncachedStepper(model), bfeats, bmask, beam_size=BEAM_SIZE, max_len=BEAM_MAX_LEN)
    same = torch.equal(seq_c, seq_u) and torch.allclose(score_c, score_u, atol=1e-3)
    flops = {}
    for name, stepper in (("cached", model), ("uncached", UncachedStepper(model))):
        with torch.no_grad(), run.amp(), FlopCounterMode(display=False) as counter:
            beam_search(stepper, bfeats, bmask, beam_size=BEAM_SIZE, max_len=BEAM_MAX_LEN)
        flops[name] = counter.get_total_flops()
    clocks = {"wall": ([], []), "cpu": ([], [])}  # (cached, uncached) seconds per repeat
    for r in range(repeats):
        runs = [(model, 0), (UncachedStepper(model), 1)]
        for stepper, side in (runs if r % 2 == 0 else runs[::-1]):
            def search():
                with torch.no_grad(), run.amp():
                    beam_search(stepper, bfeats, bmask, beam_size=BEAM_SIZE, max_len=BEAM_MAX_LEN)
            for clock, seconds in zip(("wall", "cpu"), run.timed_both(search)):
                clocks[clock][side].append(seconds)
    # on CPU the headline is CPU time (waiting for a core under a shared machine's load is not counted)
    headline = "cpu" if run.device.type == "cpu" else "wall"
    t_c, t_u = clocks[headline]
    m_c, m_u = statistics.median(t_c), statistics.median(t_u)
    print(f"beam search: beam 5, max 20 words, {images} images, A2 model (eval), "
          f"{seq_c.shape[1]} steps decoded; cached == uncached: {same}")
    for clock, (c, u) in clocks.items():
        if run.device.type != "cpu" and clock == "cpu":
            continue
        print(f"  {clock} time, cached   : {fmt(c)}")
        print(f"  {clock} time, uncached : {fmt(u)}")
        print(f"  {clock} time, ratio uncached / cached: {statistics.median(u) / statistics.median(c):.2f}x "
              f"(per repeat: {' '.join(f'{b / a:.2f}' for a, b in zip(c, u))})")
    print(f"  ratio uncached / cached ({headline} time): {m_u / m_c:.2f}x (the FLOP ratio, the bound with both at "
          f"full arithmetic efficiency: {flops['uncached'] / flops['cached']:.2f}x; {flops['cached'] / 1e9:.1f} vs "
          f"{flops['uncached'] / 1e9:.1f} GFLOP)")
    return m_u / m_c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--images", type=int, default=10, help="images per training batch (x5 captions)")
    ap.add_argument("--beam-images", type=int, default=4, help="0: no beam search measurement")
    ap.add_argument("--beam-only", action="store_true",
                    help="only the beam search measurement (on the untrained A2 model: every hypothesis runs all "
                         "max_len + 1 steps)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1 is steadiest on a shared machine)")
    ap.add_argument("--cheap-captions", type=int, default=1, help="train.mask_captions of the cheaper schedule")
    ap.add_argument("--cheap-every", type=int, default=1, help="train.mask_every of the cheaper schedule")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--precision", choices=sorted(precision.DTYPES), default="fp32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run = Run(args.device, args.precision)

    feats, mask, inp, tgt = (t.to(run.device) for t in make_batch(args.images))
    caps = torch.cat([inp, tgt[:, -1:]], 1).view(args.images, CAPTIONS_PER_IMAGE, -1)  # (B, 5, L)
    cheap_name = f"A2, mask step on {args.cheap_captions} caption(s)/image every {args.cheap_every} step(s)"
    arms = {"A2 (gate), paper schedule": Arm(run, "gate"),
            cheap_name: Arm(run, "gate", args.cheap_captions, args.cheap_every),
            "plain Transformer": Arm(run, "none")}
    a2 = arms["A2 (gate), paper schedule"]
    if args.beam_only:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), device {run.device}, precision "
              f"{args.precision}")
        beam_search_speedup(run, a2.model, feats, mask, args.beam_images, args.repeats)
        return
    n_a2 = sum(p.numel() for p in a2.model.parameters())
    n_mask = sum(p.numel() for p in a2.updates.mask_params)
    n_plain = sum(p.numel() for p in arms["plain Transformer"].model.parameters())
    print(f"training step: d_model {D_MODEL}, {HEADS} heads, {LAYERS} layers, d_ff {D_FF}, {REGIONS} regions x "
          f"{FEATURE_DIM}, captions {CAPTION_LEN} tokens, vocab {VOCAB}, batch {args.images} images x "
          f"{CAPTIONS_PER_IMAGE} captions; torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"device {run.device}, precision {args.precision}")
    print(f"  parameters: A2 {n_a2 / 1e6:.1f}M (mask network {n_mask / 1e6:.2f}M), plain {n_plain / 1e6:.1f}M")
    for arm in arms.values():  # warm-up (allocator, Adam state, CUDA kernels)
        run.timed(lambda: arm(feats, mask, caps))
    flops = {}
    for name, arm in arms.items():
        with FlopCounterMode(display=False) as counter:
            arm(feats, mask, caps)
        flops[name] = counter.get_total_flops() / arm.every
    print("  matrix-multiply FLOPs per step (forward and backward): "
          + ", ".join(f"{name} {f / 1e9:.1f} G ({f / flops['plain Transformer']:.3f}x)" for name, f in flops.items()))
    plain, again = "plain Transformer", "plain Transformer, again"
    samples = [*arms, again]  # what one repeat times: each A2 arm once, the plain step twice
    wall: dict[str, list[float]] = {name: [] for name in samples}
    cpu: dict[str, list[float]] = {name: [] for name in samples}
    for r in range(args.repeats):
        for name in samples[r % len(samples):] + samples[:r % len(samples)]:
            arm = arms[plain if name == again else name]
            w, c = run.timed_both(lambda: arm(feats, mask, caps))
            wall[name].append(w / arm.every)
            cpu[name].append(c / arm.every)
    clocks = {"wall": wall, "cpu": cpu} if run.device.type == "cpu" else {"wall": wall}  # host CPU time: not GPU work
    reference = {clock: [(a + b) / 2 for a, b in zip(times[plain], times[again])] for clock, times in clocks.items()}
    for clock, times in clocks.items():
        print(f"  {clock} time per step:")
        for name in samples:
            print(f"    {name:<58}: {fmt(times[name])}")
    found = {}
    for name in (*list(arms)[:2], again):
        print(f"  {name} / plain:")
        for clock, times in clocks.items():
            first = times[plain] if name == again else reference[clock]
            found[name, clock] = ratios(times[name], first)
            print(f"    {clock:<4}: {fmt_ratio(found[name, clock])}")
            print("          per repeat: " + " ".join(f"{a / b:.3f}" for a, b in zip(times[name], first)))

    speedup = None
    if args.beam_images:
        speedup = beam_search_speedup(run, a2.model, feats, mask, args.beam_images, args.repeats)
    clock = "cpu" if "cpu" in clocks else "wall"  # the summary's clock: CPU time on CPU
    paper, cheap = found["A2 (gate), paper schedule", clock]["pairs"], found[cheap_name, clock]["pairs"]
    noise = found[again, clock]
    print(f"summary ({clock} time, median of per-repeat pairs): an A2 training step costs {paper:.2f}x a plain "
          f"Transformer step with the paper's schedule (target <= 1.45x: {'met' if paper <= 1.45 else 'NOT met'}) "
          f"and {cheap:.2f}x with the cheaper one ({cheap_name}; target <= 1.10x: "
          f"{'met' if cheap <= 1.10 else 'NOT met'}); plain against plain {noise['pairs']:.2f}x "
          f"({noise['min']:.2f}-{noise['max']:.2f}); {args.images}x{CAPTIONS_PER_IMAGE} captions on {run.device}, "
          f"precision {args.precision}"
          + ("." if speedup is None else f"; the key/value cache makes beam search {speedup:.2f}x faster than "
             "re-running the prefix."))


if __name__ == "__main__":
    main()
