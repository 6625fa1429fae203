"""What Ray costs a study: orchestration overhead and per-trial start-up, measured on a real run.

    python benchmarks/bench_study.py                       # studies/smoke.yaml, shrunk to run in minutes
    python benchmarks/bench_study.py studies/smoke.yaml search.num_samples=1 --full
    python benchmarks/bench_study.py --from-summary a2-studies/a2-smoke/summary.json   # no new run
    python benchmarks/bench_study.py --side-by-side        # one-worker trials: in the Tune trial vs on Ray Train

It runs the study through `a2 study run` (a local Ray unless RAY_ADDRESS is set) in a scratch folder, then
reads the trials' results back and prints:

- study wall time vs. (sum of trial times / concurrency): the orchestration overhead (Ray and Tune start-up,
  scheduling, syncing, MLflow) as a ratio; 1.00 would be free orchestration;
- per-trial start-up: time from a trial's start to its first result, minus one epoch's own time (placement
  group, Train worker processes, torch.distributed, data loading), also as a share of the trial's time;
- one summary line.

`--side-by-side` runs the (one-worker) study twice in one go, its trials training in the Tune trial itself and
then as one-worker Ray Train runs (`make_trainable(..., ray_train=True)`), and prints the start-up ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Shrinks the smoke study to a few minutes on 2 cores: 2 trials of 3 short epochs, one after the other.
SMALL = ["search.num_samples=1", "train.xe_epochs=3", "train.scst_epochs=0", "data.val_images=20",
         "search.scheduler={fifo: {}}"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", nargs="?", default=str(ROOT / "studies" / "smoke.yaml"))
    p.add_argument("overrides", nargs="*", help="key=value overrides of the study")
    p.add_argument("--full", action="store_true", help="run the study as it is (no shrinking overrides)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--from-summary", default=None, help="measure a finished study from its summary.json")
    p.add_argument("--side-by-side", action="store_true",
                   help="one-worker trials in the Tune trial vs on Ray Train, one after the other")
    return p.parse_args(argv)


# `a2 study run` with every trial on Ray Train, one worker or not, each in a fresh trial process.
ON_RAY_TRAIN = ("import functools, sys; import launch.trainable as t; import launch.search as s; "
                "t.make_trainable = functools.partial(t.make_trainable, ray_train=True); "
                "kwargs = s.tune_config_kwargs; "
                "s.tune_config_kwargs = lambda spec: {**kwargs(spec), 'reuse_actors': False}; "
                "from launch.cli import main; sys.exit(main(sys.argv[1:]))")


def run_study(study: str, overrides: list[str], work: Path, ray_train: bool = False) -> tuple[Path, float, int]:
    """Run the study in `work`; returns (summary.json path, wall seconds, exit code)."""
    from launch.spec import load_study

    name = load_study(study, overrides).name
    overrides = overrides + [f"storage={work / 'studies'}", f"tracking.mlflow_uri=sqlite:///{work / 'mlflow.db'}"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in [env.get("PYTHONPATH"), str(ROOT)] if p])
    entry = ["-c", ON_RAY_TRAIN] if ray_train else ["-m", "launch.cli"]
    cmd = [sys.executable, *entry, "study", "run", str(Path(study).resolve()), *overrides, "--quiet"]
    t0 = time.monotonic()
    with open(work / "run.log", "wb") as log:
        rc = subprocess.call(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    return work / "studies" / name / "summary.json", wall, rc


def trial_timings(summary: dict) -> list[dict]:
    """Per trial: start (the trial's first result minus that result's time since the trial started), end,
    start-up cost (first result's time since start minus that epoch's own duration), epochs."""
    from launch.location import StudyLocation
    from launch.layout import read_results
    from launch.layout import TRIALS_DIR

    location_root = summary["path"].rsplit("/", 1)[0]
    location = StudyLocation(summary["study"], location_root)
    out = []
    for trial in summary["trials"]:
        rows = read_results(location.at(TRIALS_DIR), summary["study"], trial["trial_id"])
        rows = [r for r in rows if isinstance(r.get("epoch"), (int, float))]
        if not rows:
            continue
        first, last = rows[0], rows[-1]
        epoch_s = [float(r["time/epoch_s"]) for r in rows if isinstance(r.get("time/epoch_s"), (int, float))]
        tune_rows = _tune_rows(location, trial["trial_id"])
        first_tune = next((r for r in tune_rows if r.get("epoch") == first["epoch"]), None)
        last_tune = next((r for r in reversed(tune_rows) if r.get("epoch") == last["epoch"]), None)
        if first_tune is None or last_tune is None:
            continue
        since_start = float(first_tune.get("time_total_s", 0.0))
        end = float(last_tune["timestamp"])
        start = float(first_tune["timestamp"]) - since_start
        out.append({"trial_id": trial["trial_id"], "start": start, "end": end, "seconds": end - start,
                    "first_result_s": since_start, "first_epoch_s": epoch_s[0] if epoch_s else 0.0,
                    "startup_s": max(0.0, since_start - (epoch_s[0] if epoch_s else 0.0)),
                    "train_s": sum(epoch_s), "epochs": len(rows)})
    return out


def _tune_rows(location, trial_id: str) -> list[dict]:
    from ray.tune import ExperimentAnalysis

    path, fs = location.at().ray_storage()
    analysis = ExperimentAnalysis(path, storage_filesystem=fs)
    df = analysis.trial_dataframes.get(trial_id)
    return [] if df is None or df.empty else df.to_dict("records")


def report(summary: dict, wall: float | None, concurrency: int) -> dict:
    timings = trial_timings(summary)
    if not timings:
        raise SystemExit("no trial results to measure")
    trial_sum = sum(t["seconds"] for t in timings)
    tune_span = max(t["end"] for t in timings) - min(t["start"] for t in timings)
    wall = wall if wall is not None else tune_span
    ideal = trial_sum / max(1, concurrency)
    startup = [t["startup_s"] for t in timings]
    share = [t["startup_s"] / t["seconds"] for t in timings if t["seconds"] > 0]
    train_share = sum(t["train_s"] for t in timings) / trial_sum if trial_sum else 0.0

    print(f"study {summary['study']}: {len(timings)} trials, concurrency {concurrency}")
    print(f"{'trial':<10} {'seconds':>8} {'epochs':>6} {'train s':>8} {'first result s':>15} {'start-up s':>11}")
    for t in timings:
        print(f"{t['trial_id']:<10} {t['seconds']:8.1f} {t['epochs']:6d} {t['train_s']:8.1f} "
              f"{t['first_result_s']:15.1f} {t['startup_s']:11.1f}")
    print()
    print(f"study wall time                      {wall:8.1f} s   (Tune loop {tune_span:.1f} s)")
    print(f"sum of trial times / concurrency     {ideal:8.1f} s")
    print(f"orchestration overhead (wall/ideal)  {wall / ideal:8.2f} x   (Tune loop/ideal {tune_span / ideal:.2f} x)")
    print(f"per-trial start-up                   {statistics.mean(startup):8.1f} s mean, "
          f"{max(startup):.1f} s max ({100 * statistics.mean(share):.0f}% of a trial)")
    print(f"epochs' own time / trial time        {train_share:8.2f}")
    line = (f"SUMMARY bench_study: wall {wall:.0f}s vs ideal {ideal:.0f}s -> overhead x{wall / ideal:.2f}; "
            f"trial start-up {statistics.mean(startup):.1f}s mean ({100 * statistics.mean(share):.0f}% of a trial); "
            f"training is {100 * train_share:.0f}% of trial time")
    print(line)
    return {"wall_s": wall, "tune_loop_s": tune_span, "ideal_s": ideal, "overhead_ratio": wall / ideal,
            "startup_mean_s": statistics.mean(startup), "startup_max_s": max(startup), "trials": timings}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_summary:
        summary = json.loads(Path(args.from_summary).read_text())
        from launch.location import load_saved_spec, StudyLocation

        root = summary["path"].rsplit("/", 1)[0]
        spec = load_saved_spec(StudyLocation(summary["study"], root))
        report(summary, None, int(spec.resources.max_concurrent_trials))
        return 0
    from launch.spec import load_study

    overrides = list(args.overrides) if args.full else SMALL + list(args.overrides)
    if args.side_by_side:
        overrides.append("resources.workers_per_trial=1")
    spec = load_study(args.study, overrides)
    results = {}
    for kind in (["in the Tune trial", "on Ray Train"] if args.side_by_side else ["as configured"]):
        work = Path(tempfile.mkdtemp(prefix="a2-bench-study-"))
        try:
            summary_path, wall, rc = run_study(args.study, overrides, work, ray_train=kind == "on Ray Train")
            if rc != 0 or not summary_path.exists():
                print((work / "run.log").read_text(errors="replace")[-4000:], file=sys.stderr)
                print(f"bench_study: the study failed (exit {rc})", file=sys.stderr)
                return 1
            print(f"-- trials {kind}")
            summary = json.loads(summary_path.read_text())
            results[kind] = report(summary, wall, int(spec.resources.max_concurrent_trials))
            print()
        finally:
            if args.keep:
                print(f"scratch folder kept: {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
    if args.side_by_side:
        local, train = results["in the Tune trial"], results["on Ray Train"]
        print(f"SUMMARY bench_study side by side: one-worker trial start-up {local['startup_mean_s']:.1f}s in the "
              f"Tune trial vs {train['startup_mean_s']:.1f}s on Ray Train -> "
              f"x{train['startup_mean_s'] / max(local['startup_mean_s'], 1e-9):.1f} faster; study wall "
              f"{local['wall_s']:.0f}s vs {train['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
