"""The start of a local study's Ray, side by side: with Ray's dashboard and without it.

A study's driver starts a local Ray with `launch.raycluster.connect`; its dashboard is needed only where trials run on
Ray Train (its placement-group cleaner asks the dashboard's state API whether a trial's Train controller is alive),
so a study of one-worker or fused trials starts its local Ray without it (`launch.driver`). Each repeat starts a fresh
process that calls `connect(dashboard=...)` and reports how long it took until Ray answered a task; the two ways
alternate, so the machine's load falls on both alike.

    python benchmarks/bench_ray_start.py              # 5 repeats of each
    python benchmarks/bench_ray_start.py --repeats 8

Run it alone on the machine (it starts local Rays one after another; never beside another local Ray).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_ray_stop import cpu_line, in_fresh_process  # noqa: E402 - the same fresh process and CPU line

ONE_START = """
import json, sys, time
import ray
from launch.raycluster import connect
started = time.perf_counter()
connect(dashboard=sys.argv[1] == "dashboard")
ray.get(ray.remote(lambda: 1).remote())
print(json.dumps({"took": time.perf_counter() - started}))
"""
WAYS = ("dashboard", "no dashboard")


def one(way: str) -> float:
    return in_fresh_process(ONE_START, way)["took"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(cpu_line())
    runs: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            runs[way].append(one(way))
    for way in WAYS:
        print(f"{way:14s} start to first task: median {statistics.median(runs[way]):5.2f} s "
              f"(each: {', '.join(f'{t:.2f}' for t in runs[way])})")
    with_, without = (statistics.median(runs[way]) for way in WAYS)
    print(f"saved a start: {with_ - without:.2f} s; ratio dashboard / no dashboard: {with_ / without:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
