"""`a2 study validate|run|resume|status|check|compare|plan` and `a2 mlflow sync NAME`: the command line.

Where a study lives is `launch.location`; running, resuming and reading it back is `launch.driver`; what people read
of it is `launch.conclusions`. MLflow is an export of the study's record (`launch.mlflow_export`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from launch import stop
# Tune's saved experiment (tuner.pkl) pickles the driver's callback, which holds a StudyLocation, and the live table's
# reporter, which refers to format_table and live_row (and, in studies run before MLflow became an export,
# _result_log) by the module they were defined in: launch.study. `a2 study resume` of such a study unpickles them from
# here, so these names stay importable from launch.study.
from launch.conclusions import format_table, print_conclusions  # noqa: F401 (format_table: old tuner.pkl)
from launch.driver import (_result_log, check_tracking, collect, live_row, resume_study,  # noqa: F401 (old tuner.pkl)
                           run_study, summarize, tune_trials)
from launch.lease import DEFAULT_STALE_AFTER, StudyLease
from launch.location import (SUMMARY_FILE, StudyLocation, json_default, load_saved_spec,  # noqa: F401 (old tuner.pkl)
                             locate, write_summary)
from launch.mlflow_export import Export, add_outage, end_reason, outage_line
from launch.spec import load_study, validate_main
from launch.verify import cmd_check, refuse_corrupt


# -- arguments ---------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="study_command", required=True)
    _add_study_file(sub.add_parser("validate", help="validate a study file completely (nothing starts)"))

    run = sub.add_parser("run", help="run a study on Ray Tune (a local Ray unless --address / RAY_ADDRESS)")
    _add_study_file(run)
    _add_driver_arguments(run)

    resume = sub.add_parser("resume", help="continue an interrupted study: finished trials stay, others resume")
    add_name(resume)
    _add_driver_arguments(resume)

    status = sub.add_parser("status", help="the trial table of a study, read from its storage")
    add_name(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")

    check = sub.add_parser("check", help="verify a study's saved state and every checkpoint (exit 2 if unreadable)")
    add_name(check)

    compare = sub.add_parser("compare", help="configurations of a study side by side, from MLflow")
    compare.add_argument("name")
    compare.add_argument("--by", default="fusion", help="group trials by this config key (default: fusion)")
    compare.add_argument("--baseline", default=None, help="the value of --by to compare with (default: fusion none)")
    compare.add_argument("--tracking-uri", default=None)

    plan = sub.add_parser("plan", help="a study's steps, schedule, seeds and power, GPU-hours and cost, before it runs")
    _add_study_file(plan)
    plan.add_argument("--sd", type=float, default=None,
                      help="seed standard deviation of val CIDEr (x100); default: measured in the study's runs")
    plan.add_argument("--delta", type=float, nargs="+", default=None,
                      help="CIDEr differences to resolve (x100); default: the paper's Table 3 gaps")
    plan.add_argument("--tracking-uri", default=None, help="where the finished study's runs are (default: spec)")
    plan.add_argument("--images-per-second", type=float, default=None,
                      help="training images per second per GPU (default: the estimate in benchmarks/RESULTS.md)")
    plan.add_argument("--price-per-hour", type=float, default=None,
                      help="price of a worker node per hour (default: the on-demand list price of its type)")
    plan.add_argument("--cluster", default=str(Path(__file__).resolve().parents[1] / "ray-cluster.yaml"),
                      help="cluster-launcher file whose GPU worker type prices the study (default: ray-cluster.yaml)")


def _add_study_file(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the study file")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. search.num_samples=2 model.d_model=64")


def add_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name")
    parser.add_argument("--storage", default=None, help="the study's storage root (default: where `run` put it)")


def _add_driver_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else local)")
    parser.add_argument("--quiet", action="store_true", help="no live trial table")
    add_lease_arguments(parser)


def add_lease_arguments(parser: argparse.ArgumentParser) -> None:
    """--force and --stale-after: taking over the lease of a study whose writer is gone (`launch.lease`)."""
    parser.add_argument("--force", action="store_true",
                        help="take over the study's lease if it is stale (its writer gone)")
    parser.add_argument("--stale-after", type=float, default=DEFAULT_STALE_AFTER, metavar="SECONDS",
                        help=f"a lease with no heartbeat for this long is stale (default {DEFAULT_STALE_AFTER:.0f})")


def main(args: argparse.Namespace) -> int:
    command = args.study_command
    if command == "validate":
        return validate_main(args.file, args.overrides)
    if command in ("compare", "plan"):  # MLflow and scipy: imported only when asked for
        return importlib.import_module({"compare": "dashboards.compare", "plan": "launch.plan"}[command]).main(args)
    if command == "check":
        return cmd_check(args)
    return {"run": cmd_run, "resume": cmd_resume, "status": cmd_status}[command](args)


# -- run / resume / sync -----------------------------------------------------------------------------------------
def driver_options(args) -> dict:
    """`run_study` / `resume_study` options of the driver arguments (`_add_driver_arguments`)."""
    return {"address": args.address, "verbose": not args.quiet, "force": args.force, "stale_after": args.stale_after}


def cmd_run(args) -> int:
    spec = load_study(args.file, args.overrides)  # ConfigError -> exit 2 with the key path (a2's main)
    for warning in spec.warnings:  # what `a2 study validate` warns about (a long warmup, T_P past the last step)
        print(f"a2 study: warning: {warning}", file=sys.stderr)
    return exit_code(run_study(spec, **driver_options(args)))


def cmd_resume(args) -> int:
    return exit_code(resume_study(locate(args.name, args.storage), **driver_options(args)))


def exit_code(summary: dict) -> int:
    """0 when every trial finished (or was stopped early by the scheduler) and one reported the metric; 128 + the
    signal's number when a signal stopped the study."""
    if summary.get("interrupted"):
        return stop.exit_status(summary["interrupted"])  # 130 (SIGINT), 143 (SIGTERM)
    states = [t["state"] for t in summary.get("trials", [])]
    return 0 if states and summary.get("best") is not None and all(s == "TERMINATED" for s in states) else 1


def cmd_sync(args) -> int:
    """Export the study's record to its MLflow server (`launch.mlflow_export`); updates `summary.json`'s `tracking`."""
    location = locate(args.name, args.storage)
    spec = load_saved_spec(location)
    check_tracking(spec)
    print(f"study {spec.name}: exporting its record into MLflow at {spec.tracking.mlflow_uri} (the store "
          f"recorded with the study)", flush=True)
    with StudyLease(location.at()).held():  # a running driver exports itself: never both at once
        export = Export(spec, location)
        export.run(tune_trials(location), end_reason(spec.name))
        outage = add_outage(location, pending=False)
        summary = json.loads(location.read_text(SUMMARY_FILE) or "null")
        if isinstance(summary, dict):
            write_summary(location, {**summary, "tracking": outage})
    print(f"study {spec.name}: exported to MLflow; " + (outage_line(outage) or "nothing was missing"))
    return 0


def cmd_status(args) -> int:
    location = locate(args.name, args.storage)
    refuse_corrupt(location.at(), "status")
    spec = load_saved_spec(location)
    try:
        rows = collect(spec, location)
    except ValueError as err:  # no experiment snapshot yet
        rows = []
        if not args.json:
            print(f"study {spec.name}: no trial has started yet ({err.__class__.__name__})")
    summary = summarize(spec, location, rows)
    if args.json:
        print(json.dumps(summary, indent=2, default=json_default))
        return 0
    print(f"study {spec.name} at {location.uri()}: {summary['trials_finished']}/{spec.num_trials} trials finished")
    print_conclusions(spec, summary, rows)
    return 0
