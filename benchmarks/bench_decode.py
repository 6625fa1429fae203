"""Beam search against greedy decoding of an image, measured side by side in one run: `launch.plan.BEAM5_OVER_GREEDY`.

`a2 study plan` prices a validation image and a test image from VAL_IMAGE_COST, a GREEDY image measured on an H200
(benchmarks/bench_gpu.py (b) validates with `val_decode` greedy), times beam / greedy for the beam the study decodes
with (`launch.plan.decode_image_cost`: the studies validate with beam 5, every test evaluation decodes with beam
search). No GPU record times beam against greedy; this script measures the ratio on the CPU:

- the arms: `a2core.decode.greedy` and `a2core.decode.beam_search` of each width (`--widths`, default 3 and 5; the
  decoder key/value cache, finished images leaving the batch, as validation runs them), max 20 words, on the A2
  gate model at the paper's sizes (d_model 512, 6 layers, 8 heads, d_ff 2048, a 10,000-word vocabulary), untrained
  (no caption ends early: every arm decodes all 20 words, the most work a caption can cost), in eval mode without
  gradients, on a batch of `--images` images (10: a validation batch of 50 pairs) of 10-50 regions of 2048 features
  (benchmarks/bench_model.py's `make_batch`);
- the clock: the process's CPU time (`time.process_time`, one thread: time spent waiting for a core is not counted,
  the steadiest measure of work on a shared machine); every repeat times each arm once, in an order that reverses
  every repeat, so the samples of one repeat ran under about the same load. Reported per arm: the ratio of the
  medians over repeats to greedy's, the median (min-max) of the per-repeat ratios arm_i / greedy_i (load that changes
  between repeats cancels), and the ratio of the fastest samples (load only ever adds time);
- the bounds the time ratio lies between, counted once per arm (load-free): the matrix-multiply FLOPs
  (`torch.utils.flop_counter`), what the ratio tends to where arithmetic dominates, and the ATen operator calls
  (about one kernel launch each on a GPU), what it tends to where launches dominate (as an H200's greedy decoding
  of 10 images was: benchmarks/bench_gpu.py).

The CPU's ratio stands for the GPU's in the plan until a GPU record times it; RESULTS.md says where it ran.

Usage: python benchmarks/bench_decode.py [--repeats 7] [--images 10] [--widths 3 5] [--threads 1]
       python benchmarks/bench_decode.py --tiny     # small model, 2 images, 2 repeats: the script's own check (seconds)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from a2core.config import Config  # noqa: E402 - after the path line, as every benchmark
from a2core.decode import beam_search, greedy  # noqa: E402
from a2core.model.a2 import build_model  # noqa: E402
from benchmarks.bench_gpu import PAPER_MODEL, TINY_MODEL  # noqa: E402 - the models its greedy figure timed
from benchmarks.bench_model import VOCAB, make_batch  # noqa: E402
from launch import plan  # noqa: E402 - the constant its figure is set against
MAX_LEN = 20


class _OpCount(TorchDispatchMode):
    """Counts the ATen operator calls run under it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def arms(model, feats, mask, widths: list[int]) -> dict:
    """name -> a function decoding the batch: greedy, then a beam search of each width."""
    out = {"greedy": lambda: greedy(model, feats, mask, MAX_LEN)}
    for k in widths:
        out[f"beam {k}"] = lambda k=k: beam_search(model, feats, mask, k, MAX_LEN)[0]
    return out


def counts(fns: dict) -> dict:
    """name -> (decoded words of the longest caption, GFLOP of matrix multiplies, ATen operator calls)."""
    result = {}
    for name, fn in fns.items():
        words = fn().shape[1]  # warm-up, and the steps it ran
        with FlopCounterMode(display=False) as flops:
            fn()
        with _OpCount() as ops:
            fn()
        result[name] = (words, flops.get_total_flops() / 1e9, ops.calls)
    return result


def cpu_times(fns: dict, repeats: int) -> dict:
    """name -> process CPU seconds of each repeat, the arms' order reversed every other repeat."""
    times = {name: [] for name in fns}
    for r in range(repeats):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.process_time()
            fns[name]()
            times[name].append(time.process_time() - t0)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small model, 2 images, 2 repeats: the script's own check")
    parser.add_argument("--repeats", type=int, default=7, help="timed decodes per arm")
    parser.add_argument("--images", type=int, default=10, help="images a batch (10: a validation batch of 50 pairs)")
    parser.add_argument("--widths", type=int, nargs="+", default=[3, 5], help="beam widths against greedy")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    images, repeats = (2, 2) if args.tiny else (args.images, args.repeats)
    cfg = Config.from_dict({"model": TINY_MODEL if args.tiny else PAPER_MODEL,
                            "train": {"batch_size": 5 * images, "warmup": 10000}})
    torch.manual_seed(0)
    model = build_model(cfg.model, VOCAB, 24).eval()
    feats, mask, _, _ = make_batch(images)
    print(f"bench_decode: {'tiny' if args.tiny else 'paper'} sizes, {images} images of 10-50 regions, max {MAX_LEN} "
          f"words, {repeats} repeats, torch {torch.__version__}, {args.threads} thread(s), process CPU time",
          flush=True)
    with torch.no_grad():
        fns = arms(model, feats, mask, args.widths)
        count = counts(fns)
        times = cpu_times(fns, repeats)
    g_words, g_flops, g_ops = count["greedy"]
    g = times["greedy"]
    print(f"{'arm':<8}{'words':>6}{'GFLOP':>9}{'/ greedy':>10}{'ATen ops':>10}{'/ greedy':>10}"
          f"{'median s':>10}{'/ greedy':>10}  {'per repeat, median (min-max)':<30}{'fastest':>8}")
    for name, (words, flops, ops) in count.items():
        ts = times[name]
        pairs = [t / base for t, base in zip(ts, g)]
        print(f"{name:<8}{words:>6}{flops:>9.2f}{flops / g_flops:>10.2f}{ops:>10,}{ops / g_ops:>10.2f}"
              f"{statistics.median(ts):>10.3f}{statistics.median(ts) / statistics.median(g):>10.2f}  "
              f"{f'{statistics.median(pairs):.2f} ({min(pairs):.2f}-{max(pairs):.2f})':<30}"
              f"{min(ts) / min(g):>8.2f}")
    print(f"launch.plan: BEAM5_OVER_GREEDY {plan.BEAM5_OVER_GREEDY:g}; a decoded image, in greedy images, "
          + ", ".join(f"beam {k} {plan.decode_image_cost(k) / plan.VAL_IMAGE_COST:.2f}" for k in args.widths)
          + " (linear in the width)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
