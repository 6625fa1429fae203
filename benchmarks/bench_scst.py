"""SCST step cost against the cross-entropy step, measured side by side with the Trainer's own epochs.

A small A2 model (fusion `gate`) on the synthetic set; each repeat runs one XE epoch and one SCST epoch of the
same batches (interleaved, the order alternating), and a step's time is the epoch's time over its steps.
Both include the mask network's step after every captioner step (mask_every 1), as in training.
An SCST step samples `scst_samples` captions per image with the decoder cache (keeping the graph), scores them
with CIDEr-D (document frequencies precomputed from the training captions), and backpropagates the
self-critical loss; the greedy-baseline variant also decodes one greedy caption per image.

Usage: python benchmarks/bench_scst.py [--repeats 3] [--images 300] [--batch 25] [--threads 1]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

from a2core.config import Config
from a2core.data import synthetic
from a2core.train import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--images", type=int, default=300, help="synthetic images (80%% train)")
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1 is steadiest on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench-scst-") as tmp:
        root = Path(tmp) / "synth"
        synthetic.generate(root, seed=0, images=args.images)

        def trainer(baseline: str) -> Trainer:
            cfg = Config.from_dict({
                "data": {"root": str(root), "images": args.images, "seed": 0},
                "model": {"d_model": 128, "layers": 3, "heads": 8, "d_ff": 512, "max_regions": 10, "fusion": "gate"},
                "train": {"batch_size": args.batch * 5,  # pairs: --batch images x 5 captions
                          "warmup": 100, "scst_samples": args.samples,
                          "scst_baseline": baseline, "scst_lr": 1e-4, "max_len": 20, "log_every": 10 ** 6},
            })
            return Trainer(cfg, Path(tmp) / f"out-{baseline}")

        tr, tr_greedy = trainer("mean"), trainer("greedy")
        steps = len(tr.data.loader("train", args.batch).batch_sampler)
        tr.cider(), tr_greedy.cider()  # the df table is built once per run, not per step
        for run in (tr.xe_epoch, tr.scst_epoch, tr_greedy.scst_epoch):  # warm-up (feature cache, Adam state)
            run()

        def per_step(run) -> float:
            gc.collect()
            start = time.perf_counter()
            run()
            return (time.perf_counter() - start) / steps

        runs = {"xe": tr.xe_epoch, "scst (mean baseline)": tr.scst_epoch,
                "scst (greedy baseline)": tr_greedy.scst_epoch}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.repeats):
            names = list(runs) if r % 2 == 0 else list(runs)[::-1]
            for name in names:
                times[name].append(per_step(runs[name]))

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"SCST vs XE step: A2 (gate) d_model 128, 3 layers, 8 heads, d_ff 512, synthetic {args.images} images, "
          f"batch {args.batch} images x 5 captions, {args.samples} samples per image, max 20 words, "
          f"{steps} steps per epoch, {args.repeats} interleaved repeats; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")
    for name, v in times.items():
        print(f"  {name:24s}: median {med[name] * 1000:8.1f} ms/step  (min {min(v) * 1000:.1f}, max {max(v) * 1000:.1f})")
    print(f"  ratio scst (mean) / xe  : {med['scst (mean baseline)'] / med['xe']:.2f}x")
    print(f"  ratio scst (greedy) / xe: {med['scst (greedy baseline)'] / med['xe']:.2f}x")
    print(f"summary: an SCST step costs {med['scst (mean baseline)'] / med['xe']:.2f}x an XE step "
          f"({med['scst (greedy baseline)'] / med['xe']:.2f}x with the greedy baseline) on this config.")


if __name__ == "__main__":
    main()
