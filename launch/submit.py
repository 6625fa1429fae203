"""Run a study on the Ray cluster this script runs in: the entry point for cluster jobs.

    ray submit ray-cluster.yaml launch/submit.py -- studies/x.yaml [key=value ...]
    ray job submit --address http://HEAD:8265 --working-dir . -- python launch/submit.py studies/x.yaml [key=value ...]
    python launch/submit.py studies/x.yaml --resume      # continue the study if it exists, else start it

The spec is validated before Ray is touched (exit 2 with the key path). Then the script joins the cluster it
runs in (`$RAY_ADDRESS`, which `ray job submit` sets, else the `ray start` cluster of this machine, else a new
local Ray), checks the spec's resources against the cluster (exit 2), runs the study and exits 0 when every trial
finished, 1 otherwise. Use absolute or s3:// `storage` and tracking URIs in studies submitted as jobs: a job runs
in a copy of the working directory, and relative paths would land there.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a plain script: import the package next to this file
    _root = Path(__file__).resolve().parents[1]
    if (_root / "launch" / "__init__.py").is_file() and str(_root) not in sys.path:
        sys.path.insert(0, str(_root))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/submit.py", description="run an a2 study on this Ray cluster")
    p.add_argument("study", help="study YAML file")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. search.num_samples=4")
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS, else this machine's cluster)")
    p.add_argument("--resume", action="store_true", help="resume the study if it exists already, else run it")
    p.add_argument("--quiet", action="store_true", help="no live trial table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from a2core.errors import A2Error
    from launch import study as study_mod
    from launch.spec import load_study

    try:
        spec = load_study(args.study, args.overrides)
        print(spec.summary(), flush=True)
        address = args.address or os.environ.get("RAY_ADDRESS") or "auto"  # on a cluster's head: that cluster
        location = study_mod.StudyLocation(spec.name, spec.storage, spec.storage_endpoint_url)
        if args.resume and location.exists(study_mod.STUDY_FILE):
            summary = study_mod.resume_study(location, address=address, verbose=not args.quiet)
        else:
            summary = study_mod.run_study(spec, address=address, verbose=not args.quiet)
    except A2Error as err:  # the same policy as the `a2` command: one line, exit 2; anything else is a bug
        print(f"submit: error: {err}", file=sys.stderr)
        return 2
    code = study_mod.exit_code(summary)
    if code:
        failed = [t["trial_id"] for t in summary.get("trials", []) if t["state"] != "TERMINATED"]
        print(f"submit: study {spec.name} did not finish cleanly; trials not finished: {', '.join(failed) or '-'}",
              file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
