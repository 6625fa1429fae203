"""Orchestration at scale, simulated: what the study driver costs per trial as a study grows.

    python benchmarks/bench_scale.py                       # 64, 128 and 256 trials
    python benchmarks/bench_scale.py --sizes 64 128 --concurrency 8 --epochs 3 --epoch-s 0.3
    python benchmarks/bench_scale.py --sizes 64 128 --side-by-side   # also each trial in a fresh process

Each size is one study run by `launch.driver.run_study` (the real Tuner, MLflow callback, result logs,
checkpoint folders, summary) on a loopback Ray cluster of several nodes (`tests.raycluster.LocalCluster`: a head
and three worker nodes), with its trials' training replaced by a stand-in that sleeps `--epoch-s` per epoch and
reports a tiny checkpoint each epoch: it measures orchestration, not training. One-worker trials, so each trial
is `launch.trainable.a2_local_trial`. Per size it prints:

- driver overhead per trial: (study wall time - the ideal makespan, ceil(trials / concurrency) x a trial's
  sleeping) / trials. The target is flat as trials grow, <= 0.5 s. It includes each trial's process start-up
  and teardown, which here compete for the host's real cores (the cluster's CPUs are logical); so also
- the driver's own CPU seconds per trial (Tune's loop, the searcher, the MLflow callback, syncing): the serial
  cost that a larger cluster does not spread;
- MLflow: metric values logged per second of the study, and the driver's seconds in MLflow calls per trial;
- storage operations per trial, counted in the trials: `launch.storage.Location` lookups, reads, writes,
  listings and downloads, plus checkpoint files written (Tune's own experiment-state syncing is not counted).

`--side-by-side` runs every size twice, first with a fresh process per trial (Tune's `reuse_actors` off, as
before one-worker trials reused their process), then as shipped, and prints the ratio of their overheads.

Run it alone on the machine (it starts Ray): `flock /tmp/a2-ray.lock python benchmarks/bench_scale.py`.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FUSIONS = ("none", "max", "moving_average", "gate")  # x seeds = the study's trials (a grid search)
COUNTED = ("exists", "read_text", "write_text", "listdir", "download")  # Location methods that hit storage


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256], help="trials per study (x4)")
    p.add_argument("--concurrency", type=int, default=8, help="trials at once (the cluster has as many CPUs)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--epoch-s", type=float, default=0.3, help="seconds a stand-in epoch sleeps")
    p.add_argument("--side-by-side", action="store_true", help="each size also with a fresh process per trial")
    return p.parse_args(argv)


# -- in the trials (these functions travel to the Ray workers by value; the stand-in trainer is launch.rehearse's) --
def counted_trial(config, plan, ops_dir: str):
    """`a2_local_trial` with the stand-in trainer (`launch.rehearse.stand_in_train`: an epoch sleeps, then reports a
    small checkpoint) for training, counting the trial's storage operations."""
    import collections
    import functools

    import a2core.train
    import ray.tune

    from launch.rehearse import stand_in_train

    from launch.storage import Location
    from launch import trainable

    counts = collections.Counter()
    originals = {name: getattr(Location, name) for name in COUNTED}
    original_save = trainable.LocalCheckpoints.save

    def counting(name):
        def call(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)
        return call

    def save(self, source, epoch):
        counts["checkpoint files"] += len(list(Path(source).iterdir()))
        return original_save(self, source, epoch)

    a2core.train.train = functools.partial(stand_in_train, epoch_seconds=config["bench"]["epoch_s"])
    for name in COUNTED:
        setattr(Location, name, counting(name))
    trainable.LocalCheckpoints.save = save
    try:
        trainable.a2_local_trial(config, plan)
    finally:
        for name, method in originals.items():
            setattr(Location, name, method)
        trainable.LocalCheckpoints.save = original_save
        trial_id = ray.tune.get_context().get_trial_id()
        (Path(ops_dir) / f"{trial_id}.json").write_text(json.dumps(counts))


def with_bench_keys(resolve, bench: dict, sampled: dict) -> dict:
    """A trial's config with the stand-in's epochs and epoch length."""
    return {**resolve(sampled), "bench": bench}


# -- the driver --------------------------------------------------------------------------------------------------
def run_size(trials: int, args, cluster, data: Path, work: Path, reuse: bool = True) -> dict:
    from ray import tune

    from launch import tracking_writer
    from launch import search
    from launch import trainable
    from launch.driver import run_study
    from launch.spec import load_study
    from tests.raycluster import tiny_study

    name = f"scale-{trials}"
    seeds = tuple(range(math.ceil(trials / len(FUSIONS))))
    path = tiny_study(work, name, data, fusions=FUSIONS, seeds=seeds, epochs=args.epochs, workers=1,
                      cpus_per_worker=1, max_concurrent=args.concurrency,
                      extra={"search.scheduler": {"fifo": {}}})
    spec = load_study(path)
    resolve = spec.trial_config
    bench = {"epochs": args.epochs, "epoch_s": args.epoch_s}
    spec.trial_config = functools.partial(with_bench_keys, resolve, bench)  # picklable: Tune saves it
    ops_dir = work / f"ops-{trials}"
    ops_dir.mkdir()

    def make_trainable(plan, **_):
        bound = tune.with_parameters(counted_trial, plan=plan, ops_dir=str(ops_dir))
        return tune.with_resources(bound, plan.worker_resource_request())

    logged = {"values": 0, "seconds": 0.0}
    log_epochs = tracking_writer.StudyTracker.log_epochs

    def timed_log_epochs(self, run_id, epochs):
        t0 = time.perf_counter()
        try:
            out = log_epochs(self, run_id, epochs)
        finally:
            logged["seconds"] += time.perf_counter() - t0
        logged["values"] += sum(len(values) for values in out)
        return out

    saved_make, saved_kwargs = trainable.make_trainable, search.tune_config_kwargs
    trainable.make_trainable = make_trainable
    if not reuse:
        search.tune_config_kwargs = lambda spec: {**saved_kwargs(spec), "reuse_actors": False}
    tracking_writer.StudyTracker.log_epochs = timed_log_epochs
    try:
        t0, cpu0 = time.monotonic(), time.process_time()
        summary = run_study(spec, address=cluster.address, verbose=False)
        wall, driver_cpu = time.monotonic() - t0, time.process_time() - cpu0
    finally:
        trainable.make_trainable, search.tune_config_kwargs = saved_make, saved_kwargs
        tracking_writer.StudyTracker.log_epochs = log_epochs
    if summary["trials_finished"] != trials:
        raise SystemExit(f"bench_scale: {summary['trials_finished']}/{trials} trials finished")
    ops = [sum(json.loads(p.read_text()).values()) for p in ops_dir.glob("*.json")]
    ideal = math.ceil(trials / args.concurrency) * args.epochs * args.epoch_s
    return {"trials": trials, "wall_s": wall, "ideal_s": ideal, "overhead_per_trial_s": (wall - ideal) / trials,
            "driver_cpu_per_trial_s": driver_cpu / trials,
            "mlflow_values_per_s": logged["values"] / wall, "mlflow_s_per_trial": logged["seconds"] / trials,
            "storage_ops_per_trial": sum(ops) / max(1, len(ops))}


def main(argv=None) -> int:
    args = parse_args(argv)
    # A `timeout` or Ctrl-C still stops the cluster's nodes (each in its own process group) on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    work = Path(tempfile.mkdtemp(prefix="a2-bench-scale-"))
    try:
        return run_sizes(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_row(r: dict, label: str) -> None:
    print(f"{r['trials']:5d} trials ({label}): wall {r['wall_s']:7.1f} s (ideal {r['ideal_s']:.1f} s), overhead "
          f"{r['overhead_per_trial_s']:.2f} s/trial (driver CPU {r['driver_cpu_per_trial_s']:.2f} s/trial), "
          f"MLflow {r['mlflow_values_per_s']:.0f} values/s ({r['mlflow_s_per_trial']:.2f} s/trial), "
          f"storage {r['storage_ops_per_trial']:.0f} ops/trial", flush=True)


def run_sizes(args, work: Path) -> int:
    from a2core.data.synthetic import ensure
    from tests.raycluster import DATA_IMAGES, LocalCluster

    data = work / "data"
    ensure(data, seed=0, images=DATA_IMAGES)
    per_node = math.ceil(args.concurrency / 4)
    rows = []  # as shipped (trial processes reused), one per size
    with LocalCluster(num_cpus=per_node) as cluster:  # the study driver itself holds no CPU of the cluster
        for i in range(3):
            cluster.add_node(num_cpus=per_node, name=f"worker-{i}")
        cluster.wait_for_nodes(4)
        os.environ.update(cluster.env())
        for size in args.sizes:
            fresh = None
            if args.side_by_side:
                (work / f"{size}-fresh").mkdir()
                fresh = run_size(size, args, cluster, data, work / f"{size}-fresh", reuse=False)
                print_row(fresh, "a fresh process per trial")
            (work / str(size)).mkdir()
            rows.append(run_size(size, args, cluster, data, work / str(size)))
            print_row(rows[-1], "trial processes reused")
            if fresh is not None:
                r = rows[-1]
                print(f"{size:5d} trials: overhead per trial reused / fresh "
                      f"x{r['overhead_per_trial_s'] / max(fresh['overhead_per_trial_s'], 1e-9):.2f}, study wall "
                      f"x{r['wall_s'] / fresh['wall_s']:.2f}, driver CPU per trial "
                      f"x{r['driver_cpu_per_trial_s'] / fresh['driver_cpu_per_trial_s']:.2f}", flush=True)
        import ray

        ray.shutdown()
    first, last = rows[0], rows[-1]
    growth = last["overhead_per_trial_s"] / max(first["overhead_per_trial_s"], 1e-9)
    thousand = 1000 * last["overhead_per_trial_s"]
    print(f"SUMMARY bench_scale: overhead per trial {first['overhead_per_trial_s']:.2f}s at {first['trials']} "
          f"trials, {last['overhead_per_trial_s']:.2f}s at {last['trials']} (x{growth:.2f}); driver CPU "
          f"{first['driver_cpu_per_trial_s']:.2f} -> {last['driver_cpu_per_trial_s']:.2f} s/trial; 1,000 trials at "
          f"that rate: {thousand / 60:.1f} min of driver time; storage {last['storage_ops_per_trial']:.0f} ops/trial "
          f"({args.epochs} epochs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
