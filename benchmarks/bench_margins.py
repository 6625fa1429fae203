"""Margins of the tests that assert a training outcome, over training seeds x CPU kernel sets x torch threads.

    python benchmarks/bench_margins.py --cases small scst --seeds 0 1 2 3 4 --kinds default avx2 --threads 1 2
    python benchmarks/bench_margins.py --cases scst --set train.scst_lr=2e-4 --tag lr2e-4   # a variant, its own file
    python benchmarks/bench_margins.py --summary                  # no training: the table from the stored records

The same seeds train differently on different CPUs: PyTorch picks its vector kernels by the CPU it runs on, and
other kernels round differently. `ATEN_CPU_CAPABILITY` (default, avx2, avx512 where the CPU has it) makes one CPU
run another's kernel set, so a margin measured over seeds x kernel sets x thread counts on one machine bounds what
a test's assertion meets on another. Each (case, seed, kind, threads) runs in a fresh process (the variable is
read when torch loads) and appends one JSON line to `benchmarks/records/margins/<case>[-<tag>].jsonl` before the
next starts, so a long measurement can be split over several calls; `--summary` reads those files alone.

Cases (each replays the test's own configuration with `train.seed` = the seed; the asserted quantity and its bar
are in `CASES`):
- `small`: tests/test_train.py::test_small_config_beats_twice_the_best_constant_caption (best val CIDEr and the
  end-of-run test CIDEr against twice the best constant caption);
- `scst`: tests/test_scst.py::test_scst_fine_tunes_from_the_xe_checkpoint_it_starts_from (XE best val CIDEr, the
  SCST epochs' val CIDEr against the XE best, and the sampled CIDEr-D reward on the training images before and
  after SCST: what SCST maximises);
- `workers`: tests/test_global_batch.py and tests/test_recipe.py, one vs two gloo workers (largest relative loss
  difference over the steps, relative weight difference at the end);
- `precision`: tests/test_a2_objective.py::test_bf16_and_fp16_steps_on_cpu_track_fp32 (relative loss difference of
  a bf16 / fp16 step against fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECORDS = ROOT / "benchmarks" / "records" / "margins"
CACHE = Path(tempfile.gettempdir()) / "a2-bench-margins-cache"  # the default synthetic set, generated once


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# -- the cases, each run in a child process ------------------------------------------------------------------------
def _overrides(cfg, sets: list[str]):
    from a2core.config import apply_overrides

    return cfg if not sets else type(cfg).from_dict(apply_overrides(cfg.to_dict(), sets))


def case_small(seed: int, tmp: Path, sets: list[str]) -> dict:
    from tests.test_train import SMALL

    from a2core.config import Config
    from a2core.data.dataset import CaptionData
    from a2core.metrics import best_constant_caption
    from a2core.train import train

    os.environ["A2_DATA_CACHE"] = str(CACHE)
    cfg = Config.from_dict({"data": {"val_images": 100}, **json.loads(json.dumps(SMALL))}).replace({"train.seed": seed})
    cfg = _overrides(cfg, sets)
    result = train(cfg, output_dir=tmp / "run")
    data = CaptionData(cfg.data, cfg.model.max_regions)
    val = {i: r for i, r in list(data.references("val").items())[:100]}
    train_caps = [" ".join(c) for img in data.images("train") for c in img.captions]
    _, constant = best_constant_caption(train_caps, val)
    return {"val_cider": [h["val/CIDEr"] for h in result["history"]], "best_val_cider": result["best/val/CIDEr"],
            "test_cider": result["test"].get("test/CIDEr"), "constant_cider": constant}


def case_scst(seed: int, tmp: Path, sets: list[str]) -> dict:
    from tests import test_scst as T

    from a2core import checkpoint as ckpt
    from a2core.data import synthetic
    from a2core.train import Trainer, train

    root = tmp / "synth"
    synthetic.generate(root, seed=T.SCST_DATA_SEED, images=T.SCST_IMAGES)
    cfg = _overrides(T.scst_config(root, seed), sets)
    saved = {}

    def report(metrics, checkpoint_dir):
        if metrics["epoch"] == cfg.train.xe_epochs:
            saved["xe"] = ckpt.save(ckpt.load(tmp / "run" / "best.pt"), tmp / "xe_best.pt")

    result = train(cfg, report, output_dir=tmp / "run")
    history = result["history"]
    rewards = {}
    for name, path in (("xe", saved["xe"]), ("scst", tmp / "run" / "last.pt")):
        trainer = Trainer(cfg.replace({"train.scst_from": str(path)}), tmp / f"check-{name}")
        trainer._enter_scst()
        sampled, greedy = T.sampled_reward(trainer, greedy_too=True)
        rewards[name] = {"sampled": sampled, "greedy": greedy}
    return {"xe_val": [h["val/CIDEr"] for h in history if h["stage"] == "xe"],
            "scst_val": [h["val/CIDEr"] for h in history if h["stage"] == "scst"],
            "scst_train_reward": [h["train/reward"] for h in history if h["stage"] == "scst"],
            "reward_xe": rewards["xe"], "reward_scst": rewards["scst"]}


def case_workers(seed: int, tmp: Path, sets: list[str]) -> dict:
    import torch.multiprocessing as mp

    from tests import test_global_batch as G
    from tests import test_recipe as R

    from a2core.data import synthetic

    out = {}
    for name, module, raw_of, data_seed in (("global_batch", G, G._config, 3), ("recipe", R, None, R.SEED)):
        root = tmp / f"data-{name}"
        synthetic.ensure(str(root), data_seed, 80)
        raw = raw_of(str(root)) if raw_of else R._raw(root, batch_layout="pairs")
        raw["train"]["seed"] = seed
        runs = {}
        for world in (1, 2):
            path = tmp / f"{name}-world{world}.json"
            mp.spawn(module._run, args=(world, raw, f"file://{tmp / f'{name}-init{world}'}", str(path)),
                     nprocs=world, join=True)
            runs[world] = json.loads(path.read_text())
        one, two = runs[1], runs[2]
        out[name] = {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(one["loss"], two["loss"])),
                     "weights_rel": abs(one["weights"] - two["weights"]) / abs(two["weights"])}
    return out


def case_precision(seed: int, tmp: Path, sets: list[str]) -> dict:
    import torch

    from tests.test_a2_objective import V, batch, config

    from a2core.model.a2 import build_model
    from a2core.train import Updates

    feats, mask, caps = batch(seed=seed)
    out = {}
    for prec in ("fp32", "bf16", "fp16"):
        torch.manual_seed(seed)
        cfg = config(train={"precision": prec})
        updates = Updates(build_model(cfg.model, V), cfg, torch.device("cpu"))
        out[prec] = updates.xe(feats, mask, caps, step=0)
    return {prec: {k: float(abs(out[prec][k] - out["fp32"][k]) / abs(out["fp32"][k]))  # 0-dim tensors
                   for k in ("train/loss", "train/mask_loss")} for prec in ("bf16", "fp16")}


CASES = {"small": case_small, "scst": case_scst, "workers": case_workers, "precision": case_precision}


def child(case: str, seeds: list[int], sets: list[str]) -> None:
    """Runs `case` for each seed in this process (one torch import for all) and prints one JSON line a seed."""
    import torch

    threads = int(os.environ.get("A2_BENCH_THREADS", "1"))
    torch.set_num_threads(threads)
    for seed in seeds:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="a2-margins-") as tmp:
            values = CASES[case](seed, Path(tmp), sets)
        print(json.dumps({
            "case": case, "seed": seed, "kind": os.environ.get("ATEN_CPU_CAPABILITY", "default-unset"),
            "capability": torch.backends.cpu.get_cpu_capability(), "threads": threads, "set": sets,
            "values": values, "wall_s": round(time.perf_counter() - start, 1), "cpu": cpu_model(),
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}), flush=True)


# -- the parent: runs, records, summary ----------------------------------------------------------------------------
def record_path(case: str, tag: str | None) -> Path:
    return RECORDS / f"{case}{'-' + tag if tag else ''}.jsonl"


def run_all(args) -> None:
    """One child process per (case, kind, threads, seed group): `--seeds-per-process` seeds share a process, whose
    lines are appended to the case's record file as they come."""
    RECORDS.mkdir(parents=True, exist_ok=True)
    per = max(1, args.seeds_per_process)
    groups = [args.seeds[i:i + per] for i in range(0, len(args.seeds), per)]
    jobs = [(case, tuple(group), kind, threads) for case in args.cases for group in groups for kind in args.kinds
            for threads in args.threads]
    running: list[tuple[subprocess.Popen, tuple]] = []

    def collect(proc, job) -> None:
        for line in proc.stdout:
            if line.startswith("{"):
                with open(record_path(job[0], args.tag), "a") as f:
                    f.write(line)
                rec = json.loads(line)
                print(f"{job[0]} seed {rec['seed']} {rec['kind']} x{rec['threads']}: {rec['wall_s']} s "
                      f"{json.dumps(rec['values'])[:300]}", flush=True)
        if proc.wait() != 0:
            print(f"FAILED {job}: exit {proc.returncode}", flush=True)

    import threading

    threads = []
    for job in jobs:
        while sum(p.poll() is None for p, _ in running) >= args.jobs:
            time.sleep(0.5)
        case, seeds, kind, n = job
        env = {**os.environ, "ATEN_CPU_CAPABILITY": kind, "A2_BENCH_THREADS": str(n), "OMP_NUM_THREADS": str(n),
               "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, __file__, "--child", case, *map(str, seeds), *(["--set", *args.set] if args.set else [])]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        running.append((proc, job))
        reader = threading.Thread(target=collect, args=(proc, job))
        reader.start()
        threads.append(reader)
    for reader in threads:
        reader.join()


def _spread(values: list[float]) -> str:
    return f"{min(values):.4g} .. {max(values):.4g}" if values else "-"


def summary() -> None:
    """One row per asserted quantity: its range over every stored run of the case and the smallest margin."""
    for path in sorted(RECORDS.glob("*.jsonl")):
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        seeds = sorted({r["seed"] for r in recs})
        kinds = sorted({r["kind"] for r in recs})
        threads = sorted({r["threads"] for r in recs})
        print(f"\n{path.name}: {len(recs)} runs, seeds {seeds}, kinds {kinds}, threads {threads}, "
              f"{recs[0]['cpu']}, {sorted({r['date'] for r in recs})}, set {recs[0]['set']}")
        case = recs[0]["case"]
        rows = []
        if case == "small":
            for r in recs:
                v = r["values"]
                row = {"best val / constant": v["best_val_cider"] / v["constant_cider"],
                       "best val": v["best_val_cider"], "constant": v["constant_cider"]}
                if v["test_cider"] is not None:  # (the first runs' records lack it: a key name fixed since)
                    row.update({"test / constant": v["test_cider"] / v["constant_cider"], "test": v["test_cider"]})
                rows.append(row)
        elif case == "scst":
            for r in recs:
                v = r["values"]
                xe = max(v["xe_val"])
                rows.append({"XE best val": xe, "best SCST val - XE best": max(v["scst_val"]) - xe,
                             "sampled reward after - before": v["reward_scst"]["sampled"] - v["reward_xe"]["sampled"],
                             "sampled reward before": v["reward_xe"]["sampled"],
                             "greedy train CIDEr after - before (x100)":
                                 100 * (v["reward_scst"]["greedy"] - v["reward_xe"]["greedy"]),
                             "train/reward epoch 2 - epoch 1": v["scst_train_reward"][-1] - v["scst_train_reward"][0]})
        elif case == "workers":
            for r in recs:
                rows.append({f"{k} {q}": x for k, d in r["values"].items() for q, x in d.items()})
        elif case == "precision":
            for r in recs:
                rows.append({f"{p} {k}": x for p, d in r["values"].items() for k, x in d.items()})
        for key in dict.fromkeys(k for row in rows for k in row):
            vals = [row[key] for row in rows if key in row]
            by_kind = {k: _spread([row[key] for row, r in zip(rows, recs) if r["kind"] == k and key in row])
                       for k in kinds}
            print(f"  {key:45s} {_spread(vals):24s} " + "  ".join(f"{k}: {s}" for k, s in by_kind.items()))
        print(f"  wall s: {_spread([r['wall_s'] for r in recs])}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--kinds", nargs="+", default=["default", "avx2"])
    p.add_argument("--threads", nargs="+", type=int, default=[1])
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (each with its own threads)")
    p.add_argument("--set", nargs="*", default=[], help="key.path=value overrides of the case's config")
    p.add_argument("--tag", default=None, help="record file suffix for a variant (with --set)")
    p.add_argument("--summary", action="store_true")
    p.add_argument("--seeds-per-process", type=int, default=5)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], [int(x) for x in args.child[1:]], args.set)
    elif args.summary:
        summary()
    else:
        run_all(args)
        summary()


if __name__ == "__main__":
    main()
