"""The model on a GPU: the CUDA and NCCL path proven, and the throughputs `a2 study plan` assumes, measured.

    python benchmarks/bench_gpu.py                      # a machine with a CUDA GPU (a few minutes)
    python benchmarks/bench_gpu.py --tiny               # CPU, small sizes: the script's own check (seconds)

`launch/plan.py` prices a study from figures it could not measure without a GPU: IMAGES_PER_SECOND (cross-entropy
training images per second per GPU, a FLOP estimate), ENCODER_SHARE (what the `pairs` layout costs over `images`),
SCST_IMAGE_COST, BEAM_SCST_COST and VAL_IMAGE_COST (the other stages' images in units of a cross-entropy image).
This script measures each, side by side in one run on one GPU:

(a) step: one cross-entropy step (A2 gate, `a2core.train.Updates.xe`: the mask step and the captioner step) at the
    paper's sizes (d_model 512, 6 layers, 8 heads, d_ff 2048, 50 regions of 2048 features, a 10,000-word vocabulary,
    16 caption tokens, a batch of 50 pairs), in both layouts (`images`: 10 images x 5 captions; `pairs`: 50 random
    pairs of the Karpathy train split, ~50 images) and in each precision (fp32, bf16, fp16 autocast). Random
    features and tokens (the work does not depend on their values). Layouts and precisions alternate, each step
    timed alone (synchronised) after warm-up; medians.
(b) run: `a2core.train.Trainer` on the synthetic set (2,000 images, 4-7 regions each) with the paper-size model,
    inside a torch.distributed process group (NCCL on a GPU, world size 1: the same gradient all-reduce and
    metric reduction as a Ray Train worker's), one epoch of each stage, each timed alone: cross-entropy (images
    layout; the last of `--xe-epochs`, kernels warm), validation (greedy), then SCST from that checkpoint with
    sampled candidates and, in a second Trainer from the same checkpoint, beam-5 candidates (CIDEr-D reward on
    the CPU, as in training). The ratios per image are what the plan's cost constants state. The synthetic set
    has fewer regions than COCO's bottom-up features (4-7 against 10-100): (a) is the throughput at COCO's size.

Prints a table and writes JSON (`--out`). The figures belong to the GPU it ran on: RESULTS.md names it.

The GPU's throughput per card in each mode a study can train in (one trial, k seeds fused, k trials packed; fp32,
TF32, bf16), whose record `a2 study plan` reads, is benchmarks/bench_fused.py's: run that one first; this script
measures what the plan's per-stage costs and the layouts' share are.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from a2core import precision  # noqa: E402 - after the path line, as every benchmark
from a2core.config import Config  # noqa: E402
from a2core.data.synthetic import generate  # noqa: E402
from a2core.model.a2 import build_model  # noqa: E402
from a2core.train import Trainer, Updates  # noqa: E402
from benchmarks.bench_recipe import paper_step_batches  # noqa: E402
from launch import plan  # noqa: E402 - the constants its figures are set against

PAPER_MODEL = {"d_model": 512, "layers": 6, "heads": 8, "d_ff": 2048, "dropout": 0.1, "max_regions": 50,
               "fusion": "gate", "lambda": 0.035}
TINY_MODEL = {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "dropout": 0.1, "max_regions": 50,
              "fusion": "gate", "lambda": 0.035}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


# -- (a) one cross-entropy step at the paper's sizes ------------------------------------------------------------------
def step_speed(device: torch.device, model_sizes: dict, repeats: int, precisions: list[str]) -> dict:
    vocab = 10_000
    layouts = paper_step_batches(vocab)  # bench_recipe's (a): 10 images x 5 captions, or 50 random pairs
    distinct = layouts["pairs"][0].shape[0]
    layouts = {k: tuple(None if t is None else t.to(device) for t in v) for k, v in layouts.items()}
    arms = [(p, layout) for p in precisions for layout in layouts]
    runs = {}
    for precision in precisions:
        cfg = Config.from_dict({"model": model_sizes, "train": {"batch_size": 50, "warmup": 10000,
                                                                "precision": precision}})
        torch.manual_seed(0)
        model = build_model(cfg.model, vocab, 24).to(device).train()
        runs[precision] = (model, Updates(model, cfg, device, xe_steps=10 ** 6))
    times: dict[tuple[str, str], list[float]] = {arm: [] for arm in arms}
    step = 0
    for r in range(repeats + 2):  # two rounds warm up (kernels chosen, caches allocated)
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            precision, layout = arm
            _, updates = runs[precision]
            feats, mask, c, idx = layouts[layout]
            _sync(device)
            start = time.perf_counter()
            updates.xe(feats, mask, c, step, idx)
            _sync(device)
            if r >= 2:
                times[arm].append(time.perf_counter() - start)
            step += 1
    out = {}
    for (precision, layout), ts in times.items():
        med = statistics.median(ts)
        out[f"{precision}/{layout}"] = {"median_s": med, "images_per_s": 10 / med, "pairs_per_s": 50 / med,
                                        "steps": len(ts)}
    for precision in precisions:
        ratio = out[f"{precision}/pairs"]["median_s"] / out[f"{precision}/images"]["median_s"]
        passes = distinct / 10  # encoder passes of a pairs step over an images step
        out[f"{precision}/pairs_over_images"] = ratio
        # the plan's ENCODER_SHARE: cost = 1 + share x (passes - 1), solved for share
        out[f"{precision}/encoder_share"] = (ratio - 1) / (passes - 1)
    out["encoder_passes"] = {"images": 10, "pairs": int(distinct)}
    return out


# -- (b) a Trainer's epochs under a process group ---------------------------------------------------------------------
def trainer_epochs(device: torch.device, model_sizes: dict, images: int, precision: str, root: Path,
                   xe_epochs: int) -> dict:
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        generate(root / "data", seed=0, images=images)
        out: dict = {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "xe_epochs": xe_epochs}
        best = None  # the sample run's XE checkpoint, where the beam run's SCST starts too
        for candidates in ("sample", "beam"):
            raw = {"data": {"kind": "synthetic", "seed": 0, "images": images, "root": str(root / "data")},
                   "model": model_sizes,
                   "train": {"xe_epochs": xe_epochs, "scst_epochs": 1, "batch_size": 50, "batch_layout": "images",
                             "warmup": 300, "precision": precision, "val_decode": "greedy", "log_every": 10 ** 6,
                             "diag_every": 0, "test_at_end": False, "scst_candidates": candidates,
                             "scst_samples": 5, "scst_lr": 5e-6, "seed": 0, "scst_from": best}}
            if candidates == "sample":
                raw["train"]["scst_baseline"] = "mean"
            trainer = Trainer(Config.from_dict(raw), root / f"run-{candidates}")
            assert trainer.device.type == device.type, (trainer.device, device)
            if best is None:  # cross-entropy epochs (the last one timed: kernels warm), validation, the checkpoint
                for _ in range(xe_epochs):
                    out["xe_epoch_s"] = _timed(device, trainer.xe_epoch)
                    trainer.epoch += 1
                out["val_s"] = _timed(device, trainer.validate)
                best = str(trainer._save_epoch({}, improved=True))
            trainer.epoch = xe_epochs
            trainer._enter_scst()  # both runs' SCST starts from the same weights (the sample run's last XE epoch)
            out[f"scst_{candidates}_epoch_s"] = _timed(device, trainer.scst_epoch)
            out["train_images"] = len(trainer.data.images("train"))
            out["val_images"] = len(trainer.data.images("val"))
            out["all_reduce_ran"] = trainer.dist.on
        xe_image = out["xe_epoch_s"] / out["train_images"]
        out["xe_images_per_s"] = 1 / xe_image
        out["val_image_cost"] = out["val_s"] / out["val_images"] / xe_image
        out["scst_image_cost"] = out["scst_sample_epoch_s"] / out["train_images"] / xe_image
        out["beam_scst_cost"] = out["scst_beam_epoch_s"] / out["scst_sample_epoch_s"]
        return out
    finally:
        dist.destroy_process_group()


def _timed(device: torch.device, fn) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def report(result: dict) -> str:
    a, b = result["step"], result["run"]
    lines = [f"bench_gpu {result['date']} on {result['device']} (torch {result['torch']}, "
             f"{'tiny sizes' if result['tiny'] else 'paper sizes'})",
             "(a) one cross-entropy step, batch of 50 pairs, 50 regions:",
             f"  {'precision':9} {'layout':7} {'median ms':>10} {'images/s':>9} {'pairs/s':>8}"]
    for key, row in a.items():
        if isinstance(row, dict) and "median_s" in row:
            precision, layout = key.split("/")
            lines.append(f"  {precision:9} {layout:7} {row['median_s'] * 1e3:10.1f} {row['images_per_s']:9.0f} "
                         f"{row['pairs_per_s']:8.0f}")
    for precision in result["precisions"]:
        lines.append(f"  {precision}: pairs / images step time {a[precision + '/pairs_over_images']:.2f} "
                     f"({a['encoder_passes']['pairs']} vs 10 encoder passes) -> encoder share "
                     f"{a[precision + '/encoder_share']:.2f} (plan: ENCODER_SHARE {plan.ENCODER_SHARE:g})")
    lines += [f"(b) Trainer epochs on the synthetic set ({b['train_images']} train, {b['val_images']} val images), "
              f"process group {b['backend']} world {b['world_size']}, all-reduce on: {b['all_reduce_ran']}:",
              f"  cross-entropy {b['xe_epoch_s']:.1f} s ({b['xe_images_per_s']:.0f} images/s), validation "
              f"{b['val_s']:.1f} s, SCST sample {b['scst_sample_epoch_s']:.1f} s, SCST beam "
              f"{b['scst_beam_epoch_s']:.1f} s",
              f"  per image, in cross-entropy images: validation {b['val_image_cost']:.2f} (plan: VAL_IMAGE_COST "
              f"{plan.VAL_IMAGE_COST:g}), SCST sample {b['scst_image_cost']:.2f} (plan: SCST_IMAGE_COST "
              f"{plan.SCST_IMAGE_COST:g}); SCST beam / sample {b['beam_scst_cost']:.2f} (plan: BEAM_SCST_COST "
              f"{plan.BEAM_SCST_COST:g})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes on the CPU: the script's own check")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per layout and precision in (a)")
    parser.add_argument("--images", type=int, default=2000, help="synthetic images for (b)")
    parser.add_argument("--xe-epochs", type=int, default=3, help="cross-entropy epochs before SCST in (b)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("bench_gpu: no CUDA GPU here; --tiny runs the script's own check on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sizes = TINY_MODEL if args.tiny else PAPER_MODEL
    precisions = ["fp32", "bf16", "fp16"] if cuda else ["fp32"]
    # fp32 matrix products stay fp32 (torch's default; what a2core.train's trials run): the plan's stage costs are
    # for fp32 training. Set through a2core.precision (torch >= 2.9's fp32_precision settings): the legacy
    # allow_tf32 flag mixed with them in one process is refused by torch.
    precision.fp32_matmul(device, tf32=False)
    result = {"date": time.strftime("%Y-%m-%d"), "device": gpu_name(device), "torch": torch.__version__,
              "tiny": args.tiny, "precisions": precisions}
    result["step"] = step_speed(device, sizes, 3 if args.tiny else args.repeats, precisions)
    print(json.dumps(result["step"], indent=1), flush=True)  # (a) is kept if (b) fails
    with tempfile.TemporaryDirectory(prefix="a2-bench-gpu-") as tmp:
        result["run"] = trainer_epochs(device, sizes, 100 if args.tiny else args.images, "fp32", Path(tmp),
                                       1 if args.tiny else args.xe_epochs)
    print(report(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
