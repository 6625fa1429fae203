"""`a2 study plan FILE`: what a study will do and cost, read from the file alone, before anything runs
(`launch.plan`). Loads no torch, Ray, MLflow or matplotlib; `--rehearse N` is handled by `launch.commands.rehearse`."""
from __future__ import annotations

from a2core.errors import StudyError
from launch import plan
from launch.commands import load_study_file
from launch.defaults import LEARNING_DROP


def main(args) -> int:
    given = [option for option, value, default in (("--seed", args.seed, 0), ("--drop", args.drop, LEARNING_DROP),
                                                    ("--mean", args.mean, None), ("--from-record", args.from_record,
                                                                                  None)) if value != default]
    if given:  # they shape the rehearsals' scores, and the plan alone draws none
        raise StudyError(f"{', '.join(given)}: the score model of --rehearse N; give --rehearse too")
    spec = load_study_file(args, check_files=False)
    print(plan.study_plan(spec, deltas=args.delta, images_per_second=args.images_per_second,
                          price_per_hour=args.price_per_hour, cluster=args.cluster, sd=args.sd))
    return 0
