"""`a2 study plan FILE`: what a study will do and cost, read from the file alone, before anything runs
(`launch.plan`). Loads no torch, Ray, MLflow or matplotlib; `--rehearse N` is handled by `launch.commands.rehearse`."""
from __future__ import annotations

from launch import plan
from launch.commands import load_study_file


def main(args) -> int:
    spec = load_study_file(args, check_files=False)
    print(plan.study_plan(spec, deltas=args.delta, images_per_second=args.images_per_second,
                          price_per_hour=args.price_per_hour, cluster=args.cluster, sd=args.sd))
    return 0
