"""The end of a local study's Ray, side by side: `ray.shutdown()` against `launch.raycluster.shutdown()`.

Each repeat starts a fresh process that starts a local Ray the way a study's driver does (`launch.raycluster.connect`:
SIGTERM blocked while Ray's processes start, so that a SIGTERM to the driver's process group stops the study through
the driver), runs one task, then stops Ray one way or the other and reports how long the stop took and whether any
process of that Ray (or below it) is left. The two ways alternate, so the machine's load falls on both alike.

    python benchmarks/bench_ray_stop.py              # 3 repeats of each
    python benchmarks/bench_ray_stop.py --repeats 5

Run it alone on the machine (it starts local Rays one after another; never beside another local Ray).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ONE_STOP = """
import json, os, sys, time
import ray
from ray._private import worker
from launch.raycluster import alive, connect, descendants, shutdown
connect()
ray.get(ray.remote(lambda: 1).remote())
node = worker._global_node
pids = [info.process.pid for infos in node.all_processes.values() for info in infos]
pids += [d for p in list(pids) for d in descendants(p)]
started = time.perf_counter()
if sys.argv[1] == "ray.shutdown":
    ray.shutdown()
else:
    shutdown()
took = time.perf_counter() - started
time.sleep(1)
print(json.dumps({"took": took, "left": [p for p in pids if alive(p)]}))
"""
WAYS = ("ray.shutdown", "launch.raycluster.shutdown")


def in_fresh_process(script: str, way: str) -> dict:
    """`script` run with `way` as its argument in a new Python process with a local Ray of its own (no RAY_ADDRESS):
    the JSON object of its last line."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run([sys.executable, "-c", script, way], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_line() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"CPU: {cpu}, {os.cpu_count()} cores"


def one(way: str) -> dict:
    return in_fresh_process(ONE_STOP, way)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(cpu_line())
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            runs[way].append(one(way))
    for way in WAYS:
        times = [r["took"] for r in runs[way]]
        left = sum(len(r["left"]) for r in runs[way])
        print(f"{way:28s} stop median {statistics.median(times):5.2f} s (each: "
              f"{', '.join(f'{t:.2f}' for t in times)}); processes left after 1 s: {left}")
    before, after = (statistics.median(r["took"] for r in runs[way]) for way in WAYS)
    print(f"ratio ray.shutdown / launch.raycluster.shutdown: {before / after:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
