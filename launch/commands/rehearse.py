"""`a2 study rehearse FILE`: the study's plan, then every trial through the real driver, scheduler, record and MLflow
export with a stand-in trainer drawing scores from a stated model (`launch.rehearse`), and what happened; and
`a2 study plan FILE --rehearse N`: the plan, then N rehearsals without Ray."""
from __future__ import annotations

from a2core.errors import StudyError
from launch import plan, rehearse
from launch.commands import load_study_file
from launch.location import REHEARSAL_BANNER
from launch.spec import StudySpec


def main(args) -> int:
    """`a2 study rehearse FILE`."""
    from launch.record import StudyRecord  # Ray's Tune reads its trials: as in `_logical_ray`

    rehearse.check_options(args.drop, args.repeat, args.time_scale, args.epoch_seconds)
    raw, own = rehearse.rehearsal_raw(args.file, args.overrides, args.storage, args.tracking_uri)
    original = StudySpec.from_dict(raw, source=args.file, check_files=False)
    spec = StudySpec.from_dict(own, source=args.file)
    model = rehearse.score_model(original, record=args.from_record, means=args.mean, seed=args.seed, drop=args.drop)
    seconds = args.epoch_seconds if args.epoch_seconds is not None else rehearse.epoch_time(original)
    if own.get("resources") != raw.get("resources"):
        print(f"resources: one worker per trial holding its {spec.trial_resources()} (the stand-in trains in the "
              f"trial process)")
    noise = plan.Noise(model.seed_sd, model.run_sd, model.arm_image_sd, plan.verdict_images(original))
    print(plan.plan_text(original, noise, "the rehearsal's score model", rehearse.model_gaps(spec, model),
                         plan.IMAGES_PER_SECOND,
                         "an estimate for an A10G: benchmarks/RESULTS.md", plan.cluster_workers(), None))
    per_trial = (plan.estimate(original, plan.IMAGES_PER_SECOND, plan.cluster_workers()).gpu_hours
                 / original.num_trials if original.resources.gpus_per_worker else None)
    adaptive = plan.adaptive_text(original, noise, per_trial)  # priced: the study's rounds, if a range
    if adaptive:
        print(adaptive)
    print(f"\n{REHEARSAL_BANNER}\n{rehearse.model_text(model)}\nstand-in epoch: {seconds:.0f} s on the cluster x time scale "
          f"{args.time_scale:g} = {seconds * args.time_scale:.2f} s here")
    if own.get("data") != raw.get("data"):
        print("data: not read by the stand-in; the study's COCO files are replaced by a small synthetic set")
    first = rehearse.run_rehearsal(spec, model, epoch_seconds=seconds, time_scale=args.time_scale, address=args.address,
                          verbose=not args.quiet)
    record = StudyRecord.load(first["location"])
    outcome = rehearse.analyse(record.study(), spec, model)
    print(f"\nrehearsal 1 on Ray: {first['seconds']:.1f} s for {spec.num_trials} trials; record at "
          f"{first['location'].uri()}\n" + rehearse.outcome_text(outcome, "what happened (REHEARSAL)"))
    if args.repeat > 1:
        outcomes = [outcome, *rehearse.repeated(spec, model, args.repeat - 1, start=1)]
        print("\n" + rehearse.aggregate_text(rehearse.aggregate(outcomes, spec, model), spec, model,
                                    f"over {args.repeat} rehearsals (REHEARSAL; the first on Ray, the others "
                                    f"without it: same searcher, scheduler and comparison code)"))
    print(f"\nread it: a2 study status {spec.name} --storage {spec.storage}; a2 study compare {spec.name} --storage "
          f"{spec.storage} (`a2 package` refuses a rehearsal)")
    return 0


def plan_main(args) -> int:
    """`a2 study plan FILE --rehearse N`: the plan, then `rehearse.plan_lines` (arguments checked before anything
    prints)."""
    if args.rehearse < 1:
        raise StudyError(f"--rehearse must be >= 1, got {args.rehearse}")
    rehearse.check_options(args.drop)
    spec = load_study_file(args, check_files=False)
    model = rehearse.score_model(spec, record=args.from_record, means=args.mean, sd=args.sd, seed=args.seed,
                                 drop=args.drop)
    print(plan.study_plan(spec, deltas=args.delta, images_per_second=args.images_per_second,
                          price_per_hour=args.price_per_hour, cluster=args.cluster, sd=args.sd))
    print(rehearse.plan_lines(spec, args.rehearse, model))
    return 0
