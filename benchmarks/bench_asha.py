"""Early stopping's worth, measured: one search run to the end and again under `ReplicateASHA`, side by side.

    python benchmarks/bench_asha.py                  # the full benchmark (8-10 minutes on 2 cores)
    python benchmarks/bench_asha.py --min-gap-se 2 0 # ... with one early-stopping arm per rule (12-15 minutes)
    python benchmarks/bench_asha.py --min-gap-se 2 0 --hold   # ... those arms holding replicates at rungs
    python benchmarks/bench_asha.py --size smoke --min-gap-se 2 0 0-hold --keep   # benchmarks/records/asha-smoke-v5
    python benchmarks/bench_asha.py --size smoke     # the smoke study's data, model and schedule (about half an hour)
    python benchmarks/bench_asha.py --quick          # a smoke run of the same code path (a minute or two)
    python benchmarks/bench_asha.py --keep           # ... keeping the scratch folder, to look again later:
    python benchmarks/bench_asha.py --from-dir /tmp/a2-bench-asha-XXXX   # no new run

The search (`search_study`) is one fusion/lambda search on the synthetic set that also samples the learning rate:
fusion grid [none, gate], `train.lr_factor` loguniform [0.02, 2] in both cells and lambda loguniform
[0.005, 0.2] in the gate cell, 6 configurations per cell (the first one the known-good point lr_factor 0.25,
lambda 0.035), each replicated over seeds 0-2 (12 groups, 36 trials of 16 epochs), three trials side by side.
On this data lambda alone moves little (in a 5-epoch pilot of a d_model-32 model, gate at lambda 0.001 and at 2
gave identical val scores at every epoch from 2 on), so a lambda-only search has nothing to stop; the learning
rate separates configurations, as in any real search.

Both arms run the same study through `a2 study run` (a local Ray) in a scratch folder, with the same searcher
seed and `algorithm: random`, so they get the same configurations with the same replicate seeds (TPE would not:
its later samples depend on whether earlier groups were told PRUNED or COMPLETE). The only difference is
`search.scheduler`: `fifo` (every trial to its planned epochs) or `asha` (`ReplicateASHA`, grace period 2,
reduction factor 2, rungs at epochs 2, 4 and 8, the default `min_gap_se` 2, or each value of `--min-gap-se`: 0 is
plain ASHA on group means, a group below the cutoff stops; `--hold`: `hold_at_rungs`). It prints, per
early-stopping arm against the full search:

- per replicate group: its configuration, its mean best val CIDEr over seeds with the 95% interval in each arm,
  and what the scheduler did with it;
- compute: CPU seconds of the trials' training processes (`compute/cpu_s`, summed in `summary.json`'s
  `compute.total_cpu_s`), trial-epochs and study wall time of each arm, and their ratio. The arms run one after
  the other on a shared machine, and a trial's CPU seconds grow with the load, so the CPU ratio is also given
  at equal load: divided by the drift that the trials run in full in both arms (the same work, training is
  deterministic) show between the arms;
- the gap between the two searches' results: the best group's mean (`summary.json`'s `best_group`, never an
  early-stopped one) of the ASHA arm minus the full search's, with its 95% interval from
  `dashboards.stats.compare_arms` (paired bootstrap over seeds and val images when both groups logged
  per-image CIDEr-D in their run folders, else Welch's t over seed means), and whether the gap is within the seed noise
  (the interval holds 0);
- the target: within the seed noise of the full search, with a gap whose 95% interval is at most 5 CIDEr wide on
  each side, at <= 50% of its compute (at equal load).

A group is judged at a rung once all its replicates got there; replicates that started earlier train on
meanwhile (unless held), so a stopped group's replicates may show more epochs than its rung (the table lists
them).

Run it alone on the machine (it starts Ray): `flock /tmp/a2-ray.lock python benchmarks/bench_asha.py`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

METRIC = "val/CIDEr"
ARMS = ("fifo", "asha")  # the full search, then the same search under early stopping (one arm per --min-gap-se)
COMPUTE_TARGET = 0.50  # the early-stopping arm's share of the full search's CPU seconds
HALF_WIDTH_TARGET = 5.0  # the best-group gap's 95% interval, CIDEr on each side (the paper's gate gain on COCO is 5)

# The full benchmark: 12 groups x 3 seeds of a d_model-64 model on 400 synthetic images (320 train, 40 val), 16
# epochs of 32 steps.
FULL = {
    "images": 400, "val_images": 50,
    "model": {"d_model": 64, "layers": 1, "heads": 4, "d_ff": 128, "dropout": 0.1, "max_regions": 10},
    "epochs": 16, "warmup": 64, "fusions": ["none", "gate"], "samples": 6, "replicates": 3,
    "asha": {"grace_period": 2, "reduction_factor": 2, "min_gap_se": 2},
}
# --size smoke: the smoke study's data, model and schedule (studies/smoke.yaml: 2000 synthetic images, 1000 train and
# 500 val, d_model 64, 2 layers, no dropout, batches of 25 pairs, 8 epochs of 200 steps ramped down to 0), where
# the seed sd of best val CIDEr is under 2 points (benchmarks/bench_noise.py), so a gap between two searches can
# resolve to a few points. 12 groups x 3 seeds; rungs at epochs 2 and 4.
SMOKE = {
    "images": 2000,
    "model": {"d_model": 64, "layers": 2, "heads": 4, "d_ff": 128, "dropout": 0.0, "max_regions": 10},
    "epochs": 8, "warmup": 300, "fusions": ["none", "gate"], "samples": 6, "replicates": 3,
    "train": {"batch_size": 25, "lr_schedule": "noam_to_zero"},
    "asha": {"grace_period": 2, "reduction_factor": 2, "min_gap_se": 2},
}
# --quick: 2 groups x 3 seeds of a tiny model on 200 images, 3 epochs (rungs at 1 and 2).
QUICK = {
    "images": 200, "val_images": 20,
    "model": {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "dropout": 0.1, "max_regions": 8},
    "epochs": 3, "warmup": 30, "fusions": ["gate"], "samples": 2, "replicates": 3,
    "asha": {"grace_period": 1, "reduction_factor": 2, "min_gap_se": 2},
}
SIZES = {"full": FULL, "smoke": SMOKE, "quick": QUICK}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke-sized search (a minute or two)")
    p.add_argument("--size", choices=sorted(SIZES), default="full",
                   help="full: a wide, noisy search on 400 images (default); smoke: the smoke study's data, model "
                        "and schedule (about half an hour); quick: the same as --quick")
    p.add_argument("--search-seed", type=int, default=0, help="the searcher's seed, the same in both arms")
    p.add_argument("--samples", type=int, default=None, help="configurations per fusion (default 6; --quick 2)")
    p.add_argument("--epochs", type=int, default=None, help="planned epochs per trial (default 16; --quick 3)")
    p.add_argument("--min-gap-se", type=_gap, nargs="+", default=None, metavar="K[-hold]",
                   help="ReplicateASHA's min_gap_se (default 2); several values run one early-stopping arm each "
                        "against the same full search, e.g. `--min-gap-se 2 0 0-hold` (0: plain ASHA on group "
                        "means; -hold: that arm holds replicates at rungs)")
    p.add_argument("--hold", action="store_true",
                   help="the early-stopping arms hold replicates at rungs (search.scheduler.asha.hold_at_rungs)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--from-dir", default=None, help="measure a kept scratch folder again (no new run)")
    args = p.parse_args(argv)
    if args.quick:
        args.size = "quick"
    return args


# -- the studies -------------------------------------------------------------------------------------------------
def _gap(text: str) -> tuple[float, bool]:
    """A `--min-gap-se` value: K, or K-hold for an arm that holds replicates at rungs."""
    number, hold = (text[:-len("-hold")], True) if text.endswith("-hold") else (text, False)
    try:
        return float(number), hold
    except ValueError:
        raise argparse.ArgumentTypeError(f"not K or K-hold: {text!r}") from None


def early_arms(gaps: list[float | tuple[float, bool]] | None) -> dict[str, tuple[float | None, bool]]:
    """{arm name: (its min_gap_se, whether it holds replicates at rungs)} of the early-stopping arms: `asha` for
    one value (None: the size's own), `asha-k<K>` (`asha-k<K>-hold`) each for several."""
    gaps = [g if isinstance(g, tuple) else (g, False) for g in gaps or []]
    if len(gaps) <= 1:
        return {"asha": gaps[0] if gaps else (None, False)}
    return {f"asha-k{k:g}".replace(".", "p") + ("-hold" if hold else ""): (k, hold) for k, hold in gaps}


def search_study(arm: str, work: Path, data: Path, size: dict, search_seed: int = 0,
                 min_gap_se: float | None = None, hold: bool = False) -> dict:
    """The study file (as a dict) of one arm: `fifo` or an early-stopping arm (`asha...`, with `min_gap_se` if
    given, holding replicates at rungs with `hold`); everything else is the same in all arms."""
    asha = dict(size["asha"]) | ({} if min_gap_se is None else {"min_gap_se": min_gap_se})
    if hold:
        asha["hold_at_rungs"] = True
    scheduler = {"asha": asha} if arm.startswith("asha") else {"fifo": {}}
    space = {"fusion": {"grid": list(size["fusions"])},
             "train.lr_factor": {"loguniform": [0.02, 2.0]}}
    if any(f != "none" for f in size["fusions"]):
        space["lambda"] = {"loguniform": [0.005, 0.2], "when": {"fusion": [f for f in size["fusions"] if f != "none"]}}
    return {
        "name": f"bench-asha-{arm}",
        # val_images absent: the generator's own split (a quarter of the images)
        "data": {"kind": "synthetic", "seed": 0, "images": size["images"], "root": str(data),
                 **({"val_images": size["val_images"]} if "val_images" in size else {})},
        "model": dict(size["model"]),
        "train": {"xe_epochs": size["epochs"], "scst_epochs": 0, "batch_size": 50, "warmup": size["warmup"],
                  "val_decode": "greedy", "log_every": 1000, "diag_every": 0, "diag_images": 10,
                  "diag_kendall_images": 1, **size.get("train", {})},
        "search": {"metric": METRIC, "mode": "max", "algorithm": "random", "num_samples": size["samples"],
                   "seed": search_seed, "replicates": size["replicates"], "space": space,
                   "points_to_evaluate": [{"train.lr_factor": 0.25, "lambda": 0.035}],
                   "scheduler": scheduler},
        # a group's replicates side by side, so that a stopped group stops all of them at the rung
        "resources": {"workers_per_trial": 1, "cpus_per_worker": round(1.8 / size["replicates"], 2),
                      "gpus_per_worker": 0, "max_concurrent_trials": size["replicates"], "max_failures": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{work / 'mlflow.db'}"},
        "storage": str(work / "studies"),
    }


def run_arm(study: dict, work: Path) -> tuple[float, int]:
    """`a2 study run` of `study` in `work`; returns (wall seconds, exit code). The log goes to work/run.log."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{study['name']}.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in [env.get("PYTHONPATH"), str(ROOT)] if p])
    cmd = [sys.executable, "-m", "launch.cli", "study", "run", str(path), "--quiet"]
    t0 = time.monotonic()
    with open(work / "run.log", "wb") as log:
        child = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = child.wait()
        finally:  # a timeout or Ctrl-C of the benchmark ends the study (and its local Ray) too
            if child.poll() is None:
                child.terminate()
                try:
                    child.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    child.kill()
    return time.monotonic() - t0, rc


def load_arm(work: Path, name: str) -> dict:
    """An arm's `summary.json`, with `per_image`: {trial id: {image id: CIDEr-D x100}} of the trials that saved
    their best epoch's per-image scores, read from the study's record (`launch.record`)."""
    from launch.location import locate
    from launch.record import StudyRecord

    summary = json.loads((work / "studies" / name / "summary.json").read_text())
    record = StudyRecord.load(locate(name, str(work / "studies")))
    summary["per_image"] = {}
    for trial in record.trials:
        scores = record.per_image(trial["trial_id"])
        if scores is not None:
            summary["per_image"][trial["trial_id"]] = {str(k): float(v) for k, v in scores.items()}
    return summary


# -- the comparison ----------------------------------------------------------------------------------------------
def configuration(summary: dict, group: dict) -> dict:
    """The sampled configuration of a replicate group, without its seed."""
    trials = {t["trial_id"]: t for t in summary["trials"]}
    sampled = dict(trials[group["trials"][0]].get("sampled") or {})
    sampled.pop("seed", None)
    return sampled


def config_text(config: dict) -> str:
    parts = []
    for key in sorted(config, key=lambda k: (k != "fusion", k)):
        value = config[key]
        parts.append(f"{key.rsplit('.', 1)[-1]}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


def arm_compute(summary: dict) -> dict:
    """CPU seconds and trial wall seconds (the study's `compute` totals) and trial-epochs done / planned."""
    totals = summary.get("compute") or {}
    trials = summary["trials"]
    return {"cpu_s": float(totals.get("total_cpu_s", math.nan)),
            "wall_s": float(totals.get("total_wall_s", math.nan)),
            "saved_cpu_s": float(totals.get("saved_cpu_s", 0.0)),
            "epochs": sum(int(t["epochs_done"]) for t in trials),
            "epochs_planned": sum(int(t["epochs_planned"]) for t in trials)}


def load_drift(fifo: dict, asha: dict) -> tuple[float, int] | None:
    """(ASHA / full CPU seconds, trials) over the trials that did the same work in both arms: the same
    configuration and seed run to the planned epochs in both. The arms run one after the other on a shared
    machine, and CPU seconds grow with the load (caches, memory bandwidth); this ratio is that drift, 1.0 at
    equal load. None when no trial finished in both arms."""
    def finished(summary: dict) -> dict[str, float]:
        out = {}
        for t in summary["trials"]:
            cpu = (t.get("compute") or {}).get("cpu_s")
            if t["epochs_done"] == t["epochs_planned"] and cpu:
                out[json.dumps(t.get("sampled") or {}, sort_keys=True)] = float(cpu)
        return out

    full, early = finished(fifo), finished(asha)
    both = sorted(set(full) & set(early))
    if not both:
        return None
    return sum(early[k] for k in both) / sum(full[k] for k in both), len(both)


def best_arm(summary: dict, label: str):
    """The best group of a search (`summary.json`'s `best_group`) as a `dashboards.stats.Arm`: its seeds' best val
    CIDEr and, when every replicate logged them for the same images, their per-image scores (seeds, images)."""
    import numpy as np

    from dashboards.stats import Arm

    group = summary["best_group"]
    trials = {t["trial_id"]: t for t in summary["trials"]}
    seeds = [{METRIC: trials[tid]["best"]} for tid in group["trials"] if trials[tid]["best"] is not None]
    per_image = [summary["per_image"].get(tid) for tid in group["trials"]]
    matrix, ids = None, None
    if per_image and all(p is not None for p in per_image):
        ids = sorted(per_image[0])
        if all(sorted(p) == ids for p in per_image):
            matrix = np.asarray([[p[i] for i in ids] for p in per_image])  # (seeds, images)
    return Arm(label, seeds, matrix, ids if matrix is not None else None)


def groups_by_configuration(summary: dict) -> dict[str, dict]:
    """{configuration as JSON: its group}, each group with `epochs_done`: its replicates' epochs, in seed order."""
    epochs = {t["trial_id"]: int(t["epochs_done"]) for t in summary["trials"]}
    out = {}
    for g in summary["groups"]:
        key = json.dumps(configuration(summary, g), sort_keys=True)
        out[key] = {**g, "epochs_done": [epochs[t] for t in g["trials"]]}
    return out


def compare_searches(fifo: dict, asha: dict) -> dict:
    """Everything the benchmark reports, from the two arms' summaries (each with `per_image`, possibly empty)."""
    from dashboards.stats import compare_arms, pooled_sd

    fifo_groups, asha_groups = groups_by_configuration(fifo), groups_by_configuration(asha)
    full, early = arm_compute(fifo), arm_compute(asha)
    arms = [best_arm(asha, "early stopping"), best_arm(fifo, "full search")]
    comparison = compare_arms(arms, baseline="full search", metric=METRIC, metrics=[METRIC])
    gap = comparison.differences["early stopping"]
    raw_ratio = early["cpu_s"] / full["cpu_s"] if full["cpu_s"] > 0 else math.nan
    drift = load_drift(fifo, asha)
    ratio = raw_ratio / drift[0] if drift else raw_ratio  # the CPU ratio at equal load
    within_noise = gap.low is not None and gap.low <= 0 <= gap.high
    half_width = None if gap.low is None else (gap.high - gap.low) / 2
    not_worse = within_noise or (gap.low is not None and gap.low > 0)
    finished = [g["values"] for g in fifo["groups"] if len(g["values"]) > 1]
    return {
        "same_samples": sorted(fifo_groups) == sorted(asha_groups),
        "configurations": sorted(set(fifo_groups) | set(asha_groups)),
        "fifo_groups": fifo_groups, "asha_groups": asha_groups,
        "full": full, "early": early, "raw_cpu_ratio": raw_ratio, "drift": drift, "cpu_ratio": ratio,
        "epoch_ratio": early["epochs"] / full["epochs"] if full["epochs"] else math.nan,
        "wall_s": {"fifo": fifo.get("bench_wall_s"), "asha": asha.get("bench_wall_s")},
        "best": {"fifo": configuration(fifo, fifo["best_group"]), "asha": configuration(asha, asha["best_group"])},
        "intervals": {arm.label: iv[METRIC] for arm, iv in comparison.rows},
        "gap": gap, "within_noise": within_noise,
        "seed_sd": pooled_sd(finished),
        "half_width": half_width,
        "target_met": bool(not_worse and ratio <= COMPUTE_TARGET and half_width is not None
                           and half_width <= HALF_WIDTH_TARGET),
    }


def group_cell(group: dict | None, planned: int) -> str:
    from dashboards.stats import seed_interval, stopped_early_text

    if group is None:
        return "-"
    if not group["values"]:
        return "no result"
    text = seed_interval(group["values"]).text()
    if group.get("stopped_early"):
        epochs = "/".join(str(e) for e in group["epochs_done"])
        return f"{text}, {stopped_early_text(group['stopped_early'])}, epochs {epochs}"
    return f"{text}, {planned} epochs"


def report(result: dict, planned_epochs: int) -> None:
    print(f"{'configuration':<44} {'full search: mean [95% CI]':<38} early stopping (ASHA): mean [95% CI]")
    for key in result["configurations"]:
        fifo, asha = result["fifo_groups"].get(key), result["asha_groups"].get(key)
        config = config_text(json.loads(key))
        print(f"{config:<44} {group_cell(fifo, planned_epochs):<38} {group_cell(asha, planned_epochs)}")
    print()
    full, early = result["full"], result["early"]
    print(f"same configurations and seeds in both arms: {'yes' if result['same_samples'] else 'NO'} "
          f"({len(result['fifo_groups'])} groups)")
    print(f"{'':<26} {'full search':>12} {'ASHA':>12} {'ratio':>8}")
    print(f"{'trial CPU seconds':<26} {full['cpu_s']:12.0f} {early['cpu_s']:12.0f} {result['raw_cpu_ratio']:8.2f}")
    if result["drift"]:
        drift, n = result["drift"]
        print(f"{'  ... at equal load':<26} {'':>12} {early['cpu_s'] / drift:12.0f} {result['cpu_ratio']:8.2f}"
              f"   (load drift: the {n} trials run in full in both arms cost {drift:.2f}x in the ASHA arm)")
    print(f"{'trial wall seconds':<26} {full['wall_s']:12.0f} {early['wall_s']:12.0f} "
          f"{early['wall_s'] / full['wall_s']:8.2f}")
    print(f"{'trial-epochs':<26} {full['epochs']:12d} {early['epochs']:12d} {result['epoch_ratio']:8.2f}")
    wall = result["wall_s"]
    if wall["fifo"] and wall["asha"]:
        print(f"{'study wall seconds':<26} {wall['fifo']:12.0f} {wall['asha']:12.0f} "
              f"{wall['asha'] / wall['fifo']:8.2f}")
    print(f"the ASHA arm's own estimate of what stopping saved: {early['saved_cpu_s']:.0f} CPU-s")
    print()
    gap, sd = result["gap"], result["seed_sd"]
    print(f"best group, full search:    {config_text(result['best']['fifo'])}: "
          f"{result['intervals']['full search'].text()}")
    print(f"best group, early stopping: {config_text(result['best']['asha'])}: "
          f"{result['intervals']['early stopping'].text()}")
    print(f"gap (early stopping - full): {gap.interval_text()}, {gap.size_text()}; "
          f"seed sd {'-' if sd is None else f'{sd:.1f}'} CIDEr")
    noise = "within the seed noise" if result["within_noise"] else "NOT within the seed noise"
    if gap.low is None:
        noise = f"no verdict ({gap.no_verdict_reason()})"
    width = "" if result["half_width"] is None else f" (half-width {result['half_width']:.1f})"
    print(f"SUMMARY bench_asha: ASHA used {100 * result['cpu_ratio']:.0f}% of the full search's CPU seconds at "
          f"equal load ({100 * result['raw_cpu_ratio']:.0f}% as measured; {100 * result['epoch_ratio']:.0f}% of its "
          f"trial-epochs); "
          f"best result {gap.interval_text()} vs the full search, {noise}{width}; target (within "
          f"noise, half-width <= {HALF_WIDTH_TARGET:g}, at <= {100 * COMPUTE_TARGET:.0f}% compute) "
          f"{'met' if result['target_met'] else 'NOT met'}")


def measure(work: Path) -> int:
    """Report every early-stopping arm of a scratch folder against its full search."""
    summaries = {}
    arms = ["fifo"] + sorted(p.name for p in work.iterdir() if p.name.startswith("asha") and p.is_dir())
    for arm in arms:
        summaries[arm] = load_arm(work / arm, f"bench-asha-{arm}")
        wall_file = work / arm / "wall_s"
        summaries[arm]["bench_wall_s"] = float(wall_file.read_text()) if wall_file.exists() else None
    planned = int(summaries["fifo"]["trials"][0]["epochs_planned"])
    for arm in arms[1:]:
        if len(arms) > 2:
            study = yaml.safe_load((work / arm / f"bench-asha-{arm}.yaml").read_text())
            print(f"== early-stopping arm {arm}: {json.dumps(study['search']['scheduler'])}")
        report(compare_searches(summaries["fifo"], summaries[arm]), planned)
        print()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_dir:
        return measure(Path(args.from_dir))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` still ends the running study
    from a2core.data.synthetic import ensure

    size = dict(SIZES[args.size])
    if args.samples is not None:
        size["samples"] = args.samples
    if args.epochs is not None:
        size["epochs"] = args.epochs
    work = Path(tempfile.mkdtemp(prefix="a2-bench-asha-"))
    try:
        data = work / "data"
        ensure(data, seed=0, images=size["images"])  # generated once, outside both arms' compute
        arms = {"fifo": (None, False), **early_arms(args.min_gap_se)}
        for arm, (min_gap_se, hold) in arms.items():
            study = search_study(arm, work / arm, data, size, args.search_seed, min_gap_se, hold or args.hold)
            wall, rc = run_arm(study, work / arm)
            summary_path = work / arm / "studies" / study["name"] / "summary.json"
            if rc != 0 or not summary_path.exists():
                print((work / arm / "run.log").read_text(errors="replace")[-4000:], file=sys.stderr)
                print(f"bench_asha: the {arm} study failed (exit {rc})", file=sys.stderr)
                return 1
            (work / arm / "wall_s").write_text(f"{wall:.1f}")
            print(f"{arm} arm: {study['name']} done in {wall:.0f} s", flush=True)
        print()
        return measure(work)
    finally:
        if args.keep:
            print(f"scratch folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
