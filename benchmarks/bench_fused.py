"""Fused replicate seeds on one device: training images/s per card and TFLOP/s, single vs fused vs packed processes.

    python benchmarks/bench_fused.py                  # a CUDA GPU: paper sizes, <= ~8 minutes on an H200
    python benchmarks/bench_fused.py --cpu            # CPU, small sizes: the CPU ratios (a few minutes)

Arms, each a cross-entropy step (mask step + captioner step, A2 gate, images layout: 10 images x 5 captions,
50 regions of 2048 features, 16 caption tokens, 10,000 words at paper sizes), random batches:
  single       one seed, `a2core.train.Updates.xe` (today's trial), in fp32 (TF32 off), tf32 and bf16 autocast;
  fused k      k in {2, 4, 5, 8} seeds, `a2core.fused.FusedReplicates.xe_step`, eager, in each precision;
  batch k      one seed at k x the batch (k x 10 images): the bound of fusing k seeds when the step is bound by
               its arithmetic rather than by its launches (its per-seed time is step / k);
  captured k   the same with `FusedReplicates.capture()` (torch.compile "reduce-overhead": CUDA graphs; each pass
               one whole graph), tf32, while the time budget lasts (compilation takes a while per shape); on a
               CPU inductor's kernels without CUDA graphs, fp32, stepped in turn with the eager arms;
  packed k     k in {2, 4} processes on the card, each a single seed, started together: aggregate images/s.
Images/s per card = seeds x 10 images / step time (median of timed steps after warm-up, synchronised). The eager
arms of a precision (single, fused, batch) are built together and stepped in turn, round after round (the order
reversed every other round), so that a machine's changing load falls on every arm alike. On a CPU each arm also
has its median process CPU time a step (`cpu_step_s`, `per_seed_cpu_over_single`): on a CPU shared with other
jobs the wall time moves with their load, the CPU time much less.
FLOPs: `torch.utils.flop_counter.FlopCounterMode` over one single-seed step (forward and backward; matrix
products and attention, the FLOPs that count); a fused step of k seeds does k times that. TFLOP/s = FLOPs per
second of the arm. The record (JSON) goes to benchmarks/records/gpu/<machine>-<date>.json (`--out` to change),
naming the machine; `launch/plan.py` (`measured_throughput`) reads the newest GPU record.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from a2core.atomic import atomic_write  # noqa: E402
from a2core.config import Config  # noqa: E402
from a2core.fused import FusedReplicates  # noqa: E402
from a2core.model.a2 import build_model  # noqa: E402
from a2core.train import Updates  # noqa: E402
from benchmarks.bench_gpu import PAPER_MODEL as PAPER  # noqa: E402 - the paper-size model, one definition

SMALL = {"d_model": 64, "layers": 2, "heads": 4, "d_ff": 128, "dropout": 0.1, "max_regions": 50,
         "fusion": "gate", "lambda": 0.035}
IMAGES, CAPTIONS, LENGTH = 10, 5, 16


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except Exception:  # noqa: BLE001 - only a label
        return platform.processor() or platform.machine()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cfg(sizes: dict, prec: str) -> Config:
    return Config.from_dict({"model": sizes, "train": {"batch_size": 50, "warmup": 10000,
                                                        "precision": "fp32" if prec == "tf32" else prec}})


def _batch(device, k: int | None, vocab: int, dim: int = 2048, images: int = IMAGES):
    """feats (B, R, D), mask (B, R), caps (B, C, L), B = images; with k, each with a leading seed dimension."""
    g = torch.Generator().manual_seed(0)
    shape = () if k is None else (k,)
    feats = torch.randn(*shape, images, 50, dim, generator=g)
    mask = torch.ones(*shape, images, 50, dtype=torch.bool)
    mask[..., 36:] = False
    caps = torch.randint(4, vocab, (*shape, images, CAPTIONS, LENGTH), generator=g)
    caps[..., 0] = 2
    caps[..., -3:] = 0
    return feats.to(device), mask.to(device), caps.to(device)


def _set_tf32(device, on: bool):
    if device.type == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32" if on else "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32" if on else "ieee"


def single_step(device, sizes, prec, vocab, times: int = 1):
    """One seed's step (`Updates.xe`) on a batch of `times` x IMAGES images."""
    cfg = _cfg(sizes, prec)
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab, 24).to(device).train()
    updates = Updates(model, cfg, device, xe_steps=10 ** 6)
    feats, mask, caps = _batch(device, None, vocab, images=times * IMAGES)
    state = {"step": 0}

    def step():
        updates.xe(feats, mask, caps, state["step"])
        state["step"] += 1
    return step


def fused_step(device, sizes, prec, vocab, k, capture=False):
    cfg = _cfg(sizes, prec)
    models = []
    for s in range(k):
        torch.manual_seed(s)
        models.append(build_model(cfg.model, vocab, 24).to(device).train())
    fused = FusedReplicates.for_models(models, cfg, device, bucket=True, tf32=prec == "tf32")
    fused.template.train()
    if capture:
        fused.capture()
    batch = _batch(device, k, vocab)
    return lambda: fused.xe_step(*batch)


def timed(device, step, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(device, steps: dict, warmup: int, repeats: int) -> dict:
    """(median wall seconds, median process CPU seconds) of each step in `steps` (name -> callable), the steps
    taken in turn, round after round, the order reversed every other round: a changing load on a shared machine
    falls on every arm alike. The CPU seconds are this process's (all its threads): on a CPU shared with other
    jobs they are the step's own cost, which the wall time is not."""
    names = list(steps)
    times = {n: [] for n in names}
    for r in range(warmup + repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            _sync(device)
            start, cpu = time.perf_counter(), time.process_time()
            steps[n]()
            _sync(device)
            if r >= warmup:
                times[n].append((time.perf_counter() - start, time.process_time() - cpu))
    return {n: tuple(statistics.median(t[i] for t in ts) for i in (0, 1)) for n, ts in times.items()}


def step_flops(device, sizes, vocab) -> float:
    from torch.utils.flop_counter import FlopCounterMode
    step = single_step(device, sizes, "fp32", vocab)
    step()
    with FlopCounterMode(display=False) as counter:
        step()
    return float(counter.get_total_flops())


def _packed_worker(args):
    device_name, sizes, prec, vocab, warmup, repeats, barrier, out = args
    device = torch.device(device_name)
    _set_tf32(device, prec == "tf32")
    step = single_step(device, sizes, prec, vocab)
    for _ in range(warmup):
        step()
    _sync(device)
    barrier.wait()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    _sync(device)
    out.put((start, time.perf_counter()))


def packed(device, sizes, prec, vocab, k, warmup, repeats) -> float:
    """Seconds per step of each of k processes stepping together (their common span / steps)."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(k), ctx.Queue()
    procs = [ctx.Process(target=_packed_worker, args=((str(device), sizes, prec, vocab, warmup, repeats, barrier,
                                                       out),)) for _ in range(k)]
    for p in procs:
        p.start()
    spans = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return (max(e for _, e in spans) - min(s for s, _ in spans)) / repeats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU at small sizes")
    ap.add_argument("--ks", type=int, nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new arms after this")
    ap.add_argument("--dropout", type=float, default=None, help="the model's dropout (default 0.1, the paper's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print("bench_fused: no CUDA GPU here; --cpu measures the CPU at small sizes", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sizes, vocab = (PAPER, 10_000) if cuda else (SMALL, 1_000)
    if args.dropout is not None:
        sizes = {**sizes, "dropout": args.dropout}
    ks = args.ks or ([2, 4, 5, 8] if cuda else [2, 4])
    precs = ["fp32", "tf32", "bf16"] if cuda else ["fp32"]
    repeats = args.repeats or (20 if cuda else 12)
    warmup = 3
    began = time.perf_counter()
    flops = step_flops(device, sizes, vocab)
    rec = {"date": time.strftime("%Y-%m-%d"), "machine": machine(device), "device": device.type,
           "torch": torch.__version__, "threads": torch.get_num_threads(), "sizes": sizes, "vocab": vocab,
           "images_per_step_per_seed": IMAGES, "warmup": warmup, "repeats": repeats,
           "flops_per_seed_step": flops, "flops_counted": "FlopCounterMode, one single-seed step, forward+backward",
           "arms": []}
    if cuda:
        rec["cpu"] = machine(torch.device("cpu"))
        rec["dense_tf32_peak_tflops"] = None  # fill from the card's datasheet (not measurable here)

    def add(kind, prec, k, seconds, note=None, cpu_seconds=None):
        row = {"kind": kind, "precision": prec, "k": k, "step_s": seconds}
        if seconds is not None:
            row["images_per_s"] = k * IMAGES / seconds
            row["tflops"] = k * flops / seconds / 1e12
            row["per_seed_step_s"] = seconds / k
        if cpu_seconds is not None and not cuda:
            row["cpu_step_s"] = cpu_seconds
            row["per_seed_cpu_s"] = cpu_seconds / k
        if note:
            row["note"] = note
        rec["arms"].append(row)
        print(json.dumps(row), flush=True)

    for prec in precs:
        _set_tf32(device, prec == "tf32")
        steps = {("single", 1): single_step(device, sizes, prec, vocab)}
        for k in ks:
            arms = [("fused", lambda: fused_step(device, sizes, prec, vocab, k)),
                    ("batch", lambda: single_step(device, sizes, prec, vocab, times=k))]
            if not cuda:  # compiled whole (inductor's C++ kernels, no CUDA graphs), stepped in turn with the
                # others; it compiles in the first warm-up round, outside the timed ones
                arms.append(("captured", lambda: fused_step(device, sizes, prec, vocab, k, capture=True)))
            for kind, build in arms:
                try:
                    steps[(kind, k)] = build()
                except Exception as err:  # noqa: BLE001 - recorded: the record says what did not run
                    add(kind, prec, k, None, f"{type(err).__name__}: {err}"[:300])
        for (kind, k), (seconds, cpu_seconds) in interleaved(device, steps, warmup, repeats).items():
            add(kind, prec, k, seconds, cpu_seconds=cpu_seconds)
        del steps
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        _set_tf32(device, True)
        for k in [1] + ks:
            if time.perf_counter() - began > args.budget_s:
                add("captured", "tf32", k, None, "skipped: time budget")
                continue
            try:
                add("captured", "tf32", k, timed(device, fused_step(device, sizes, "tf32", vocab, k, capture=True),
                                                 5, repeats))
            except Exception as err:  # noqa: BLE001
                add("captured", "tf32", k, None, f"{type(err).__name__}: {err}"[:300])
        for k in (2, 4):
            if time.perf_counter() - began > args.budget_s + 60:
                add("packed", "tf32", k, None, "skipped: time budget")
                continue
            try:
                add("packed", "tf32", k, packed(device, sizes, "tf32", vocab, k, warmup, repeats))
            except Exception as err:  # noqa: BLE001
                add("packed", "tf32", k, None, f"{type(err).__name__}: {err}"[:300])
    single = {r["precision"]: r for r in rec["arms"] if r["kind"] == "single"}
    for r in rec["arms"]:
        if r.get("step_s") and r["kind"] != "single":
            # < 1: a fused (or packed) seed costs less than a seed trained alone in the same precision; on a CPU
            # also in process CPU time, the ratio a shared machine's load does not move
            alone = single[r["precision"] if r["precision"] in single else "fp32"]
            r["per_seed_over_single"] = r["per_seed_step_s"] / alone["step_s"]
            if "cpu_step_s" in r:
                r["per_seed_cpu_over_single"] = r["per_seed_cpu_s"] / alone["cpu_step_s"]
    # the best mode a study can train in (`batch` changes the batch, so it is a bound, not a mode)
    best = max((r for r in rec["arms"] if r.get("images_per_s") and r["kind"] != "batch"),
               key=lambda r: r["images_per_s"])
    rec["best"] = {k: best[k] for k in ("kind", "precision", "k", "images_per_s", "tflops")}
    rec["wall_s"] = time.perf_counter() - began
    name = re.sub(r"[^a-z0-9]+", "-", rec["machine"].lower()).strip("-")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "records" / "gpu" / f"fused-{name}-{rec['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(rec, indent=1))
    print(f"best: {rec['best']}; record {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
