"""Training-loader throughput at COCO's shapes: the HDF5 layout against the prepared layout (`a2 data prepare`).

Builds a synthetic set at COCO's shapes (default 20,000 images of 36-100 regions x 2048 float32 features, about
11 GB as HDF5) under a temporary folder, converts it with `a2core.data.features.prepare`, and times shuffled
epochs of the training loader (`CaptionData.loader`, the one `a2 train` and every trial use: features, padding,
five encoded captions per image) at 0, 2 and 4 DataLoader workers, the two layouts interleaved. Before each
layout's first epoch its files are dropped from the OS page cache (posix_fadvise DONTNEED), so epoch 1 reads from
disk as a node does when the set exceeds its memory; epoch 2 runs on what the page cache kept. Everything is
deleted afterwards.

Printed: images/s per layout, workers and epoch; the prepared/HDF5 ratio; and each against the images/s that one
GPU trial worker consumes (--gpu-images-per-s, an ESTIMATE: batch 50 images x 5 captions at 8 optimizer steps/s
for the paper-size model on an A100-class GPU = 400 images/s; pass a measured figure when there is one).

Usage: python benchmarks/bench_data.py [--images 20000] [--workers 0 2 4] [--epochs 2] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from a2core.config import Config
from a2core.data.dataset import CaptionData
from a2core.data.features import prepare

GPU_IMAGES_PER_S = 400.0  # estimate: 50 images per step x 8 steps/s (paper-size A2, A100-class GPU)
WORDS = [f"w{i}" for i in range(400)]


def build(root: Path, images: int, regions: tuple[int, int], dim: int, seed: int = 0) -> dict[str, Path]:
    """Karpathy captions (all train) and an HDF5 file of `{id}_features` (n, dim) float32, n in `regions`."""
    import h5py

    rng = np.random.default_rng(seed)
    # windows of one random pool: every image distinct bytes, without generating 11 GB of random numbers
    pool = rng.gamma(1.0, 1.0, (4096 + regions[1], dim)).astype(np.float32)  # ReLU-like, non-negative
    entries = []
    with h5py.File(root / "features.h5", "w") as h5:
        for i in range(images):
            image_id = 1 + i
            n, at = int(rng.integers(regions[0], regions[1] + 1)), int(rng.integers(0, 4096))
            h5.create_dataset(f"{image_id}_features", data=pool[at:at + n] * (1 + i / images))
            sentences = [{"tokens": list(rng.choice(WORDS, int(rng.integers(8, 16))))} for _ in range(5)]
            entries.append({"cocoid": image_id, "split": "train", "filepath": "train2014",
                            "filename": f"{image_id}.jpg", "sentences": sentences})
    (root / "dataset_coco.json").write_text(json.dumps({"images": entries}))
    return {"captions": root / "dataset_coco.json", "features": root / "features.h5"}


def drop_from_page_cache(path: Path) -> None:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def epoch_rate(data: CaptionData, batch: int, workers: int, epoch: int) -> float:
    """Images per second of one shuffled epoch of the training loader (every batch taken, as a trainer would)."""
    start, seen = time.perf_counter(), 0
    for b in data.loader("train", batch, shuffle=True, seed=0, epoch=epoch, num_workers=workers):
        seen += len(b["image_ids"])
    return seen / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--min-regions", type=int, default=36)
    ap.add_argument("--max-regions", type=int, default=100)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=50, help="images per batch (each with its 5 captions)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    ap.add_argument("--epochs", type=int, default=2, help="epochs per layout and worker count (the 1st from disk)")
    ap.add_argument("--gpu-images-per-s", type=float, default=GPU_IMAGES_PER_S,
                    help="images/s one GPU trial worker consumes (default: an estimate, see the docstring)")
    ap.add_argument("--dir", default=None, help="where the temporary set goes (default: the system's temp dir)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    results: dict = {"images": args.images, "rates": {}}
    with tempfile.TemporaryDirectory(prefix="bench-data-", dir=args.dir) as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        paths = build(root, args.images, (args.min_regions, args.max_regions), args.dim)
        built = time.perf_counter() - start
        start = time.perf_counter()
        manifest = prepare(paths["features"], root / "features.a2feat", feature_dim=args.dim)
        prepared_s = time.perf_counter() - start
        sizes = {"hdf5": paths["features"].stat().st_size,
                 "prepared": sum(p.stat().st_size for p in (root / "features.a2feat").iterdir())}
        print(f"{args.images} images, {manifest['rows']} regions x {args.dim} (mean {manifest['rows'] / args.images:.1f}"
              f" per image); HDF5 {sizes['hdf5'] / 2**30:.2f} GiB written in {built:.0f}s; prepared "
              f"{sizes['prepared'] / 2**30:.2f} GiB in {prepared_s:.0f}s ({args.images / prepared_s:.0f} images/s)",
              flush=True)
        layouts = {"hdf5": paths["features"], "prepared": root / "features.a2feat"}
        datasets = {}
        for name, features in layouts.items():
            cfg = Config.from_dict({"data": {"kind": "coco", "captions": str(paths["captions"]),
                                             "features": str(features)},
                                    "model": {"max_regions": args.max_regions, "feature_dim": args.dim}})
            datasets[name] = CaptionData(cfg.data, args.max_regions, args.dim)
        for workers in args.workers:
            for name in ("hdf5", "prepared"):  # interleaved per worker count: the machine's load hits both alike
                drop_from_page_cache(layouts[name])
                rates = [epoch_rate(datasets[name], args.batch, workers, e) for e in range(args.epochs)]
                results["rates"][f"{name}/{workers}"] = rates
                print(f"  {name:<9} {workers} workers: " + "  ".join(f"epoch {e + 1} {r:8.0f} images/s"
                                                                     for e, r in enumerate(rates)), flush=True)
    gpu = args.gpu_images_per_s
    print(f"\nimages/s per layout (epoch 1 from disk | later epochs), ratio prepared/HDF5, and each against one GPU "
          f"trial worker's {gpu:.0f} images/s (estimate)")
    print(f"{'workers':>7} {'HDF5':>16} {'prepared':>18} {'ratio':>14} {'HDF5/GPU':>10} {'prepared/GPU':>13}")
    for workers in args.workers:
        h, p = results["rates"][f"hdf5/{workers}"], results["rates"][f"prepared/{workers}"]
        later_h = statistics.median(h[1:]) if len(h) > 1 else h[0]
        later_p = statistics.median(p[1:]) if len(p) > 1 else p[0]
        ratio = (p[0] / h[0], later_p / later_h)
        results.setdefault("ratios", {})[workers] = ratio
        print(f"{workers:>7} {h[0]:>7.0f} | {later_h:>6.0f} {p[0]:>8.0f} | {later_p:>7.0f} "
              f"{ratio[0]:>5.1f}x | {ratio[1]:>4.1f}x {min(h) / gpu:>9.2f}x {min(p) / gpu:>12.2f}x")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    return results


if __name__ == "__main__":
    main()
