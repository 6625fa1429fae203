"""The paper's recipe as M2's train.py runs it, against a2tune's earlier one, side by side in one run (issue 37).

    python benchmarks/bench_recipe.py                       # all three parts, 5 seeds, 2 processes for (b), (c)
    python benchmarks/bench_recipe.py --parts speed --repeats 5
    python benchmarks/bench_recipe.py --parts layout & python benchmarks/bench_recipe.py --parts scst --follow
                                                            # (c) starts on each seed as soon as (b) has it
    python benchmarks/bench_recipe.py --summary             # no training: the tables from the stored records

(a) speed: one cross-entropy step (A2 gate, `Updates.xe`: the mask step and the captioner step) at the paper's
    model sizes (d_model 512, 6 layers, 8 heads, d_ff 2048, 50 regions of 2048, a 10,000-word vocabulary, 16 caption
    tokens) with the paper's batch of 50 pairs in each layout: `images`, 10 images x 5 captions (10 encoder
    passes), and `pairs`, 50 pairs drawn at random over the 566,435 pairs of Karpathy train (113,287 images x 5;
    ~50 distinct images, one encoder pass each). Random features and tokens: the step's work does not depend on
    their values. Steps alternate between the layouts (ABAB..), each timed alone after one warm-up step each.
    The ratio of the medians is the cost of the layout per step, and so per epoch (an epoch has as many steps in
    either layout); "images/s" is the epoch's images (batch_size / 5 a step) over time, the unit of
    `a2 study plan`'s throughput, and pairs/s is 50 a step over time.
(b) layout: `a2core.train.train` (no Ray) of studies/smoke.yaml's data/model/train sections, fusion gate at the
    paper's lambda 0.035 (the smoke study's gate arm; its seeds in benchmarks/records/noise), train.seed 0..N-1,
    batch_layout images and pairs; the same seed in both arms starts from the same weights. Best val CIDEr (greedy,
    the smoke study's selection) and the test CIDEr (beam 5, the selected checkpoint, 500 test images), pairs -
    images: a paired t-interval over the seeds' differences, and the project's verdict rule (`dashboards.stats`:
    Welch over seeds; for test, with the bootstrap over the shared test images).
(c) SCST: from each seed's `pairs` checkpoint of (b), `--scst-epochs` epochs of SCST (5 images x 5 candidates a
    step) with scst_candidates beam and sample (leave-one-out mean baseline), scst_lr 3e-5 (the paper's 5e-6 moves
    nothing in a few hundred steps: tests/test_scst.py), the same seed in both arms. Val and test CIDEr after
    SCST, beam - sample, with the same intervals; the cost is the wall time of the SCST epochs alone (validation
    excluded), beam / sample per seed, run side by side in the same process.

Records: benchmarks/records/recipe/{layout-<arm>,scst-<arm>}-seed<N>.json and speed.json, written as each run ends.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECORDS = ROOT / "benchmarks" / "records" / "recipe"
SMOKE = ROOT / "studies" / "smoke.yaml"
SCST_LR = 3e-5


def _threads() -> None:
    import torch

    torch.set_num_threads(1)


def smoke_config(**train) -> dict:
    """The smoke study's data/model/train sections, fusion gate at lambda 0.035, with `train` keys set."""
    from a2core.config import load_yaml

    raw = load_yaml(SMOKE)
    out = {"data": dict(raw["data"]), "model": {**raw["model"], "fusion": "gate", "lambda": 0.035},
           "train": {**raw["train"], "log_every": 10 ** 6, **train}}
    return out


def _write(path: Path, record: dict) -> None:
    from a2core.atomic import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(record, indent=1).encode())


def paper_step_batches(vocab: int = 10_000, tokens: int = 16, regions: int = 50) -> dict:
    """One cross-entropy step's inputs at the paper's batch, random (the work does not depend on their values), in
    each layout: {"images" | "pairs": (feats (B, R, 2048), region mask (B, R), captions, caption_image or None)}.
    images: 10 images x 5 captions (captions (10, 5, L)); pairs: 50 of the 566,435 Karpathy train pairs at random
    (pair p = image p // 5), as one pairs step draws them: ~50 distinct images, captions (50, L), caption_image (50,)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    caps = torch.randint(4, vocab, (50, tokens), generator=gen)
    caps[:, 0], caps[:, -1] = 1, 2  # <bos> .. <eos>
    drawn = np.random.default_rng(0).permutation(113_287 * 5)[:50] // 5
    distinct, index = np.unique(drawn, return_inverse=True)
    return {
        "images": (torch.randn(10, regions, 2048, generator=gen), torch.ones(10, regions, dtype=torch.bool),
                   caps.view(10, 5, tokens), None),
        "pairs": (torch.randn(len(distinct), regions, 2048, generator=gen),
                  torch.ones(len(distinct), regions, dtype=torch.bool), caps, torch.from_numpy(index)),
    }


# -- (a) step time at the paper's sizes ----------------------------------------------------------------------------
def speed(repeats: int) -> dict:
    import torch

    from a2core.config import Config
    from a2core.model.a2 import build_model
    from a2core.train import Updates

    _threads()
    cfg = Config.from_dict({"model": {"d_model": 512, "layers": 6, "heads": 8, "d_ff": 2048, "dropout": 0.1,
                                      "max_regions": 50, "fusion": "gate", "lambda": 0.035},
                            "train": {"batch_size": 50, "warmup": 10000}})
    vocab, tokens, regions = 10_000, 16, 50
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab, 24)
    updates = Updates(model, cfg, torch.device("cpu"), xe_steps=10 ** 6)
    model.train()
    batches = paper_step_batches(vocab, tokens, regions)
    distinct = batches["pairs"][0].shape[0]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # FLOPs of one step (matrix multiplies and attention, forward and backward: torch's FlopCounterMode), the
    # machine-independent side of the ratio; step 0 runs the mask step too (mask_every 1), as every step does
    from torch.utils.flop_counter import FlopCounterMode

    flops = {}
    for name, (feats, mask, c, idx) in batches.items():
        model.load_state_dict(state)
        with FlopCounterMode(display=False) as counter:
            updates.xe(feats, mask, c, 0, idx)
        flops[name] = counter.get_total_flops()
    times: dict[str, list[float]] = {k: [] for k in batches}
    step = 0
    for r in range(repeats + 1):  # the first round warms up
        for name in (list(batches) if r % 2 == 0 else list(batches)[::-1]):
            feats, mask, c, idx = batches[name]
            model.load_state_dict(state)
            start = time.perf_counter()
            updates.xe(feats, mask, c, step, idx)
            if r:
                times[name].append(time.perf_counter() - start)
            step += 1
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"repeats": repeats, "gflop": {k: v / 1e9 for k, v in flops.items()},
            "round_ratios": [p / i for p, i in zip(times["pairs"], times["images"])], "encoder_passes": {"images": 10, "pairs": int(distinct)}, "times_s": times,
            "median_s": med, "ratio_pairs_over_images": med["pairs"] / med["images"],
            "images_per_s": {k: 10 / v for k, v in med.items()}, "pairs_per_s": {k: 50 / v for k, v in med.items()}}


# -- (b) layout and (c) SCST candidates, at the smoke study's sizes ----------------------------------------------
def _train(raw: dict, out: Path, time_scst: bool = False) -> dict:
    """One in-process run; the last epoch's metrics (test/... included) and the SCST epochs' wall seconds."""
    from a2core.config import Config
    from a2core.train import TEST_PER_IMAGE_KEY, Trainer

    trainer = Trainer(Config.from_dict(raw), out)
    scst_s = []
    if time_scst:
        inner = trainer.scst_epoch

        def timed():
            start = time.perf_counter()
            result = inner()
            scst_s.append(time.perf_counter() - start)
            return result

        trainer.scst_epoch = timed
    last: dict = {}
    start = time.perf_counter()
    result = trainer.run(lambda metrics, _: last.update(metrics))
    return {"val_cider": [h["val/CIDEr"] for h in result["history"]], "best_val_cider": result["best/val/CIDEr"],
            "best_epoch": result["best_epoch"], "test_cider": last.get("test/CIDEr"),
            "test_per_image": last.get(TEST_PER_IMAGE_KEY), "scst_epoch_s": scst_s,
            "epoch_s": [h["time/epoch_s"] for h in result["history"]], "wall_s": time.perf_counter() - start}


def layout_job(args: tuple) -> str:
    arm, seed, work = args
    _threads()
    raw = smoke_config(seed=seed, batch_layout=arm)
    out = Path(work) / f"layout-{arm}-seed{seed}"
    record = {"arm": arm, "seed": seed, "config": raw, **_train(raw, out), "checkpoint": str(out / "best.pt")}
    _write(RECORDS / f"layout-{arm}-seed{seed}.json", record)
    return f"layout {arm} seed {seed}: best val {record['best_val_cider']:.1f}, test {record['test_cider']:.1f}"


def scst_job(args: tuple) -> str:
    seed, work, epochs = args[:3]
    follow = len(args) > 3 and args[3]
    _threads()
    while follow and not (RECORDS / f"layout-pairs-seed{seed}.json").is_file():
        time.sleep(20)  # --follow: part (b), in another process, has not written this seed's checkpoint yet
    start_from = json.loads((RECORDS / f"layout-pairs-seed{seed}.json").read_text())
    lines = []
    for arm in (("beam", "sample") if seed % 2 == 0 else ("sample", "beam")):  # alternate which runs first
        raw = smoke_config(seed=seed, batch_layout="pairs", xe_epochs=0, scst_epochs=epochs, scst_lr=SCST_LR,
                           scst_candidates=arm, scst_samples=5, scst_from=start_from["checkpoint"])
        record = {"arm": arm, "seed": seed, "config": raw, "xe_best_val_cider": start_from["best_val_cider"],
                  "xe_test_cider": start_from["test_cider"],
                  **_train(raw, Path(work) / f"scst-{arm}-seed{seed}", time_scst=True)}
        _write(RECORDS / f"scst-{arm}-seed{seed}.json", record)
        lines.append(f"scst {arm} seed {seed}: val {record['val_cider'][-1]:.1f}, test {record['test_cider']:.1f}, "
                     f"{sum(record['scst_epoch_s']):.0f} s")
    return "; ".join(lines)


def _pool(jobs: int, fn, items: list) -> None:
    if jobs == 1:
        for item in items:
            print(fn(item), flush=True)
        return
    with mp.get_context("spawn").Pool(jobs) as pool:
        for line in pool.imap_unordered(fn, items):
            print(line, flush=True)


# -- summary ---------------------------------------------------------------------------------------------------------
def paired_t(diffs: list[float]) -> str:
    from scipy import stats as sps

    d = np.asarray(diffs, dtype=float)
    if d.size < 2:
        return f"{d.mean():+.1f} (1 seed: no interval)"
    half = sps.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
    return f"{d.mean():+.1f} [{d.mean() - half:+.1f}, {d.mean() + half:+.1f}]"


def _load(prefix: str, arm: str, seeds: list[int]) -> list[dict]:
    return [json.loads((RECORDS / f"{prefix}-{arm}-seed{s}.json").read_text()) for s in seeds
            if (RECORDS / f"{prefix}-{arm}-seed{s}.json").is_file()]


def _compare(a: list[dict], b: list[dict], names: tuple[str, str], lines: list[str], val_key: str) -> None:
    from dashboards.stats import paired_difference, seed_difference

    seeds = sorted({r["seed"] for r in a} & {r["seed"] for r in b})
    a = sorted((r for r in a if r["seed"] in seeds), key=lambda r: r["seed"])
    b = sorted((r for r in b if r["seed"] in seeds), key=lambda r: r["seed"])
    if not seeds:
        lines.append("  no paired seeds yet")
        return
    val_of = (lambda r: r["val_cider"][-1]) if val_key == "last" else (lambda r: r["best_val_cider"])
    label = "val CIDEr after SCST" if val_key == "last" else "best val CIDEr"
    for name, recs in zip(names, (a, b)):
        vals, tests = [val_of(r) for r in recs], [r["test_cider"] for r in recs]
        lines.append(f"  {name:7s} {label} {statistics.mean(vals):7.1f} (sd {statistics.stdev(vals) if len(vals) > 1 else 0:.1f}), "
                     f"test CIDEr {statistics.mean(tests):7.1f} (sd {statistics.stdev(tests) if len(tests) > 1 else 0:.1f})"
                     f"  seeds {seeds}")
    dv = [val_of(x) - val_of(y) for x, y in zip(a, b)]
    dt = [x["test_cider"] - y["test_cider"] for x, y in zip(a, b)]
    lines.append(f"  {names[0]} - {names[1]}, {label}: paired t {paired_t(dv)}; "
                 f"verdict rule: {seed_difference([val_of(r) for r in a], [val_of(r) for r in b], names).verdict()}")
    ids = a[0]["test_per_image"]["ids"]
    if all(r["test_per_image"]["ids"] == ids for r in a + b):
        pa = np.array([r["test_per_image"]["scores"] for r in a])
        pb = np.array([r["test_per_image"]["scores"] for r in b])
        lines.append(f"  {names[0]} - {names[1]}, test CIDEr: paired t {paired_t(dt)}; "
                     f"verdict rule: {paired_difference(pa, pb, names).verdict()}")


def summary(seeds: list[int]) -> str:
    lines = []
    speed_file = RECORDS / "speed.json"
    if speed_file.is_file():
        s = json.loads(speed_file.read_text())
        lines.append(f"(a) XE step at the paper's sizes, batch 50 pairs, A2 gate, 1 thread, {s['repeats']} "
                     f"alternating repeats")
        for arm in ("images", "pairs"):
            lines.append(f"  {arm:7s} {s['encoder_passes'][arm]:3d} encoder passes: median "
                         f"{s['median_s'][arm]:6.2f} s/step (min {min(s['times_s'][arm]):.2f}, max "
                         f"{max(s['times_s'][arm]):.2f}); {s['images_per_s'][arm]:.2f} images/s, "
                         f"{s['pairs_per_s'][arm]:.2f} pairs/s")
        rounds = s.get("round_ratios") or []
        lines.append(f"  ratio pairs / images: {s['ratio_pairs_over_images']:.2f}x the time a step (and an epoch), "
                     f"medians; per round (the two steps timed next to each other) "
                     f"{', '.join(f'{r:.2f}' for r in rounds)}")
        if "gflop" in s:
            g = s["gflop"]
            lines.append(f"  FLOPs a step (FlopCounterMode, forward and backward): images {g['images']:.0f} GFLOP, "
                         f"pairs {g['pairs']:.0f} GFLOP, ratio {g['pairs'] / g['images']:.2f}x")
    a, b = _load("layout", "pairs", seeds), _load("layout", "images", seeds)
    lines.append("(b) batch layout at the smoke study's sizes (gate, lambda 0.035, 8 epochs), pairs vs images")
    _compare(a, b, ("pairs", "images"), lines, "best")
    if a and b:
        ea = [statistics.median(r["epoch_s"]) for r in a]
        eb = [statistics.median(r["epoch_s"]) for r in b]
        lines.append(f"  epoch with its validation, median over seeds: pairs {statistics.median(ea):.1f} s, images "
                     f"{statistics.median(eb):.1f} s (2 runs at a time on a shared machine: indicative only)")
    a, b = _load("scst", "beam", seeds), _load("scst", "sample", seeds)
    lines.append("(c) SCST candidates, from each seed's pairs checkpoint, beam vs sample")
    if a:
        lines.append(f"  XE checkpoint: best val {statistics.mean(r['xe_best_val_cider'] for r in a):.1f}, test "
                     f"{statistics.mean(r['xe_test_cider'] for r in a):.1f} (mean over seeds)")
    _compare(a, b, ("beam", "sample"), lines, "last")
    pairs = {r["seed"]: r for r in b}
    ratios = [sum(r["scst_epoch_s"]) / sum(pairs[r["seed"]]["scst_epoch_s"]) for r in a if r["seed"] in pairs]
    if ratios:
        logs = np.log(ratios)
        if len(ratios) > 1:
            from scipy import stats as sps

            half = sps.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / math.sqrt(len(logs))
            interval = f" [{math.exp(logs.mean() - half):.2f}, {math.exp(logs.mean() + half):.2f}]"
        else:
            interval = ""
        lines.append(f"  cost: SCST epoch time beam / sample, geometric mean over seeds {math.exp(logs.mean()):.2f}x"
                     f"{interval} (each seed's two arms in one process, one after the other)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["speed", "layout", "scst"], choices=["speed", "layout", "scst"])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="(a): timed steps per layout")
    ap.add_argument("--scst-epochs", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=2, help="(b), (c): runs at a time, one thread each")
    ap.add_argument("--work", default="/tmp/bench-recipe", help="checkpoints of (b), read by (c)")
    ap.add_argument("--follow", action="store_true",
                    help="(c): wait for each seed's (b) record, written by a run of --parts layout in another process")
    ap.add_argument("--summary", action="store_true", help="only the summary of the stored records")
    args = ap.parse_args()
    seeds = list(range(args.seeds))
    if not args.summary:
        _threads()
        cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu or platform.processor()}; "
              f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f}", flush=True)
        from a2core.data import synthetic

        data = smoke_config()["data"]
        synthetic.ensure(data.get("root"), data["seed"], data["images"])  # generated once, before the jobs
        if "speed" in args.parts:
            _write(RECORDS / "speed.json", speed(args.repeats))
        if "layout" in args.parts:
            _pool(args.jobs, layout_job, [(arm, s, args.work) for s in seeds for arm in ("images", "pairs")])
        if "scst" in args.parts:
            _pool(args.jobs, scst_job, [(s, args.work, args.scst_epochs, args.follow) for s in seeds])
    print(summary(seeds))


if __name__ == "__main__":
    main()
