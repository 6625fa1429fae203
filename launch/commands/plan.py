"""`a2 study plan FILE`: what a study will do and cost, read from the file alone, before anything runs
(`launch.plan`). Loads no torch, Ray, MLflow or matplotlib; `--rehearse N` is handled by `launch.commands.rehearse`."""
from __future__ import annotations

import sys

from launch import plan
from launch.commands import study_overrides
from launch.spec import load_study


def main(args) -> int:
    spec = load_study(args.file, study_overrides(args), check_files=False)
    for warning in spec.warnings:
        print(f"a2: warning: {warning}", file=sys.stderr)
    print(plan.study_plan(spec, deltas=args.delta, images_per_second=args.images_per_second,
                          price_per_hour=args.price_per_hour, cluster=args.cluster, sd=args.sd))
    return 0
