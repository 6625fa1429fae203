"""`a2 pipeline`: the main job on one machine or cluster: the study (reused when it finished before with the same
spec, resumed when interrupted), its report, packaging, and the study's conclusions (docs/tutorial.md, "The main job")."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import ray

from a2core.atomic import fresh_folder
from a2core.errors import A2Error, StudyError
from dashboards.compare import study_comparison
from dashboards.report import build_report
from dashboards.tracking import redact_uri, study_pointer
from launch.package import WORKER_START_TIMEOUT_ENV, WORKER_START_TIMEOUT_S, check_replace, check_upload, package
from launch.record import StudyRecord
from launch.spec import load_study
from launch.tracking_writer import log_report
from launch.commands import study_overrides
from launch.conclusions import verdict
from launch.defaults import PIPELINE_OUT
from launch.driver import exit_code, resume_study, run_study
from launch import runlog
from launch.raycluster import shutdown as stop_ray
from launch.location import STUDY_FILE, StudyLocation, load_saved_spec, saved_form, study_path


def run_or_reuse(spec, *, address: str | None, verbose: bool) -> dict:
    """Run the study; reuse it when it finished before with the same spec; resume it when it was interrupted."""
    location = StudyLocation(spec.name, spec.storage, spec.storage_endpoint_url)
    if not location.exists(STUDY_FILE):
        return run_study(spec, address=address, verbose=verbose)
    saved, wanted = (json.dumps(saved_form(s), sort_keys=True, default=str) for s in (load_saved_spec(location), spec))
    if saved != wanted:
        raise StudyError(f"study {spec.name!r} exists at {location.uri()} with another spec; give this one another "
                         f"name (override name=...) or another --storage")
    summary = StudyRecord.load(location, spec).summary()  # the record, not summary.json (a cache of it)
    if summary["complete"]:
        print(f"pipeline: study {spec.name} finished before at {location.uri()}: reusing it", flush=True)
        return summary
    print(f"pipeline: study {spec.name} at {location.uri()} is unfinished: resuming it", flush=True)
    return resume_study(location, address=address, verbose=verbose)


def conclusion(study, manifest: dict) -> list[str]:
    """The study's verdicts, fusion by fusion against the baseline (test CIDEr of the configurations selected on val
    CIDEr, or val throughout when a run has no test scores, as the verdict line says; the interval from the
    variance components over seeds and images: `dashboards.compare.study_comparison`), and the ensemble's gain (test CIDEr) over its members' mean and
    over the member chosen on validation. `study`: the study's record (`launch.record.StudyRecord.study`)."""
    try:
        comparison, _, _ = study_comparison(study, by="fusion")
    except A2Error as err:
        lines = [f"no comparison: {err}"]
    else:
        lines = comparison.verdicts() or [f"no baseline (fusion none) to compare with in study {study.name}"]
    gains = [(manifest.get(key) or {}).get("verdict") for key in ("ensemble_gain", "ensemble_gain_over_chosen")]
    return lines + [gain for gain in gains if gain]


def main(args) -> int:
    t0 = time.perf_counter()
    overrides = study_overrides(args) + ([f"tracking.mlflow_uri={args.tracking_uri}"] if args.tracking_uri else [])
    spec = load_study(study_path(args.study, Path(__file__).resolve().parents[2]), overrides)
    name = spec.name
    check_upload(args.upload)  # a bad --upload is found now, not after the study and the report
    # --replace with nothing to upload too (a study on S3 uploads to its own package/ prefix without --upload)
    check_replace(args.replace, args.upload or (spec.storage if spec.storage.startswith("s3://") else None))
    # A folder holding an earlier run's report or package is kept: this run writes to a new numbered one.
    out = fresh_folder(Path(args.out or Path(PIPELINE_OUT) / name).resolve(),
                       ("report/report.html", "package/package.json"), "pipeline output")
    uri = spec.tracking.mlflow_uri
    verbose = not args.quiet
    os.environ.setdefault(WORKER_START_TIMEOUT_ENV, WORKER_START_TIMEOUT_S)  # for a Ray this process starts
    ray_was_up = ray.is_initialized()
    times = {}
    problems = []
    # Ray's, Tune's and MLflow's INFO lines (the packaging's Ray start, model registration, ...) into a log file
    with runlog.diverted(out / "pipeline.log") as log:
        try:
            print(f"pipeline: 1/3 study {name} ({spec.num_trials} trials)", flush=True)
            t = time.perf_counter()
            summary = run_or_reuse(spec, address=args.address, verbose=verbose)
            times["study"] = time.perf_counter() - t
            if exit_code(summary) != 0:  # interrupted or failed trials: no packaging from a half study
                states = ", ".join(f"{t['trial_id']} {t['state']}" for t in summary.get("trials", []))
                print(f"a2 pipeline: study {name} did not finish ({states or 'no trials'}); {verdict(summary)}\n"
                      f"continue it with `a2 study resume {name}` or run `a2 pipeline` again", file=sys.stderr)
                return 1

            print(f"pipeline: 2/3 report of {name}", flush=True)
            t = time.perf_counter()
            report = {}

            study = StudyRecord.load(StudyLocation(name, spec.storage, spec.storage_endpoint_url), spec).study()
            try:
                report = build_report(study, out / "report")
                report["artifact_uri"] = log_report(uri, name, report)
            except A2Error as err:  # the package is still worth making; the exit code says it
                problems.append(f"report: {type(err).__name__}: {err}")
                print(f"pipeline: the report failed: {err}", file=sys.stderr, flush=True)
            times["report"] = time.perf_counter() - t

            print(f"pipeline: 3/3 package {name}"
                  + (f" (seeds {' '.join(map(str, args.seeds))})" if args.seeds else ""), flush=True)
            t = time.perf_counter()
            manifest = package(name, storage=spec.storage, seeds=args.seeds, alg=args.alg, out=out / "package",
                               upload=args.upload, replace=args.replace, tracking_uri=uri, beam_size=args.beam_size,
                               workers=args.workers, address=args.address, verbose=verbose)
            times["package"] = time.perf_counter() - t
        finally:
            if not ray_was_up and ray.is_initialized():
                stop_ray()  # a local Ray it started stops at once (`launch.raycluster.shutdown`)

    total = time.perf_counter() - t0
    experiment = spec.tracking.experiment
    try:
        trials = study_pointer(uri, experiment)
    except Exception as err:  # noqa: BLE001 - a server down now: the study and its package are done all the same
        trials = f"(MLflow does not answer: {type(err).__name__})"
    lines = [
        f"pipeline: done in {total / 60:.1f} min (study {times['study']:.0f} s, report {times['report']:.0f} s, "
        f"package {times['package']:.0f} s)",
        f"  study:        {summary.get('path')}  (summary.json; `a2 study status {name}`)",
        "  result:       " + verdict(summary).replace("\n", "\n                "),
        f"  MLflow:       {redact_uri(uri)}  (experiment {experiment})",
        f"  trials:       {trials}",
        f"  report:       {report.get('html', '(failed)')}",
        f"  submission:   {manifest['results_zip']}",
        f"  leaderboard:  {manifest['leaderboard']}  (test CIDEr x100: ensemble {manifest['ensemble_CIDEr']:.1f}; "
        f"seeds " + ", ".join(f"{s}: {c:.1f}" for s, c in manifest["seed_CIDEr"].items()) + ")",
        f"  model:        {manifest['mlflow']['model_uri']}"
        + ("  (reused: it already serves these checkpoints)" if manifest["mlflow"]["reused"] else ""),
        f"  manifest:     {Path(manifest['out']) / 'package.json'}",
        f"  log:          {log}  (Ray, Tune and MLflow)",
    ]
    lines += [f"  {'uploaded:' if u.get('uploaded', True) else 'was there:':<14}{u['uri']}" for u in manifest["uploads"]]
    lines += [f"  problem:      {p}" for p in problems]
    lines += [f"conclusion:   {line}" for line in conclusion(study, manifest)]
    print("\n".join(lines), flush=True)
    return 1 if problems else 0
