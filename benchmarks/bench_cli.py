"""Start-up of the `a2` command: what `a2 --help` and `a2 study validate` cost, against the same command with the
heavy packages it no longer imports (torch, scipy.stats) loaded first, as it loaded them before.

Both are run as fresh `python` processes from this checkout, interleaved (these machines are noisy: only the
ratio measured in the same run means anything). Printed: the median wall seconds of each over --repeat runs and
their ratio, and which heavy packages each leaves in `sys.modules`.

Usage: python benchmarks/bench_cli.py [--repeat 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "scipy", "ray", "mlflow", "matplotlib", "pyarrow", "boto3", "pandas")
COMMANDS = {"a2 --help": ["--help"], "a2 study validate studies/smoke.yaml": ["study", "validate", "studies/smoke.yaml"]}


def program(argv: list[str], preload: str) -> str:
    """Python source that runs `a2 ARGV` after `preload` and prints the heavy packages left loaded."""
    return (f"{preload}\nimport sys, contextlib, io\nfrom launch.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    try:\n        rc = main({argv!r})\n    except SystemExit as e:\n        rc = e.code\n"
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))\nsys.exit(rc or 0)\n")


def timed(source: str) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - started, done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    arms = {"now": "", "with torch and scipy loaded first (before)": "import torch, scipy.stats"}
    for title, argv in COMMANDS.items():
        seconds: dict[str, list[float]] = {arm: [] for arm in arms}
        loaded: dict[str, str] = {}
        for _ in range(args.repeat):
            for arm, preload in arms.items():  # interleaved: both see the same load
                wall, loaded[arm] = timed(program(argv, preload))
                seconds[arm].append(wall)
        print(f"{title}:")
        for arm in arms:
            print(f"  {arm:45s} median {statistics.median(seconds[arm]):.2f} s  heavy modules: {loaded[arm] or '-'}")
        now, before = (statistics.median(seconds[a]) for a in arms)
        print(f"  ratio before / now: {before / now:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
