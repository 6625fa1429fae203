"""`a2 study validate|run|resume|status|check|compare|plan`, `a2 report` and `a2 mlflow sync NAME`: the command line.

Where a study lives is `launch.location`; running and resuming it is `launch.driver`; reading it back is
`launch.record`; what people read of it is `launch.conclusions` and `dashboards/`. MLflow is an export of the study's
record (`launch.mlflow_export`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from a2core.atomic import fresh_folder
from a2core.errors import A2Error
from dashboards.tracking import check_tracking_uri
from launch import stop
from launch.conclusions import print_conclusions, state_text
from launch.driver import check_tracking, resume_study, run_study
from launch.lease import DEFAULT_STALE_AFTER, StudyLease
from launch.location import SUMMARY_FILE, json_default, load_saved_spec, locate, write_summary
from launch.layout import add_outage, outage_line
from launch.mlflow_export import Export, end_reason
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
    resume.add_argument("--restore-state", action="store_true",
                        help="first put back the whole copy (state-copies/) of each of Tune's files that is unreadable, "
                             "e.g. cut short by a full disk; each one put back is named")

    status = sub.add_parser("status", help="the trial table of a study, read from its storage")
    add_name(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")

    check = sub.add_parser("check", help="verify a study's saved state and every checkpoint (exit 2 if unreadable)")
    add_name(check)

    compare = sub.add_parser("compare", help="configurations of a study side by side, read from its storage")
    add_name(compare)
    compare.add_argument("--by", default="fusion", help="group trials by this config key (default: fusion)")
    compare.add_argument("--baseline", default=None, help="the value of --by to compare with (default: fusion none)")
    compare.add_argument("--tracking-uri", default=None, help=argparse.SUPPRESS)  # before the record: not read

    plan = sub.add_parser("plan", help="a study's steps, schedule, seeds and power, GPU-hours and cost, before it runs")
    _add_study_file(plan)
    plan.add_argument("--sd", type=float, default=None,
                      help="seed standard deviation of a seed's mean CIDEr (x100); default: measured in the study's "
                           "runs (their per-image scores where they have them)")
    plan.add_argument("--delta", type=float, nargs="+", default=None,
                      help="CIDEr differences to resolve (x100); default: the paper's Table 3 gaps")
    plan.add_argument("--storage", default=None,
                      help="storage root of the finished study whose seeds give the spread (default: the spec's)")
    plan.add_argument("--tracking-uri", default=None, help=argparse.SUPPRESS)  # before the record: not read
    plan.add_argument("--images-per-second", type=float, default=None,
                      help="training images per second per GPU (default: the estimate in benchmarks/RESULTS.md)")
    plan.add_argument("--price-per-hour", type=float, default=None,
                      help="price of a worker node per hour (default: the on-demand list price of its type)")
    plan.add_argument("--cluster", default=str(Path(__file__).resolve().parents[1] / "ray-cluster.yaml"),
                      help="cluster-launcher file whose GPU worker type prices the study (default: ray-cluster.yaml)")
    plan.add_argument("--rehearse", type=int, default=None, metavar="N",
                      help="also N rehearsals without Ray (launch.rehearse): power and the chance of keeping the best "
                           "configuration with the study's early stopping, next to the closed-form power")
    rehearse = importlib.import_module("launch.rehearse")
    rehearse.add_model_arguments(plan)

    rehearse.add_arguments(sub.add_parser(
        "rehearse", help="every trial of a study through the real driver, scheduler, record and MLflow export, with "
                         "a stand-in trainer drawing scores from a stated model (nothing trains; never packageable)"))


def _add_study_file(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the study file")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. search.num_samples=2 model.d_model=64")


def add_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the study's name (its `name:` key)")
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
    if command == "plan" and args.rehearse is not None:  # ray and optuna too: only when rehearsals are asked for
        return importlib.import_module("launch.rehearse").plan_main(args)
    if command == "plan":  # scipy: imported only when asked for
        return importlib.import_module("launch.plan").main(args)
    if command == "rehearse":
        return importlib.import_module("launch.rehearse").main(args)
    if command == "check":
        return cmd_check(args)
    return {"run": cmd_run, "resume": cmd_resume, "status": cmd_status, "compare": cmd_compare}[command](args)


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
    return exit_code(resume_study(locate(args.name, args.storage), restore_state=args.restore_state,
                                  **driver_options(args)))


def exit_code(summary: dict) -> int:
    """0 when every trial finished (or was stopped early by the scheduler) and one reported the metric; 128 + the
    signal's number when a signal stopped the study."""
    if summary.get("interrupted"):
        return stop.exit_status(summary["interrupted"])  # 130 (SIGINT), 143 (SIGTERM)
    states = [t["state"] for t in summary.get("trials", [])]
    planned = summary.get("complete", True)  # every planned trial finished (`launch.driver.finish` says so if not)
    return 0 if states and planned and summary.get("best") is not None and all(s == "TERMINATED" for s in states) else 1


def cmd_sync(args) -> int:
    """Export the study's record to its MLflow server (`launch.mlflow_export`); updates `summary.json`'s `tracking`."""
    from launch.record import tune_trials  # ray.tune: only when a study's Tune state is read

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
    superseded = (f"; {len(export.superseded)} run(s) left RUNNING by trials a killed driver lost ended KILLED "
                  f"(superseded)" if export.superseded else "")
    print(f"study {spec.name}: exported to MLflow; " + (outage_line(outage) or "nothing was missing") + superseded)
    return 0


def cmd_status(args) -> int:
    from launch.record import StudyRecord, shown_state  # ray.tune and scipy: not for `a2 study validate`

    location = locate(args.name, args.storage)
    refuse_corrupt(location.at(), "status")
    record = StudyRecord.load(location)
    for row in record.trials:
        row["state"] = shown_state(row, record.running)
    if not record.trials and not args.json:
        print(f"study {record.spec.name}: no trial has started yet")
    summary = record.summary()
    if args.json:
        print(json.dumps(summary, indent=2, default=json_default))
        return 0
    spec = record.spec
    _print_banner(location)
    print(f"study {spec.name} at {location.uri()}: {summary['trials_finished']}/{spec.num_trials} trials finished")
    print_conclusions(spec, summary, record.trials)
    return 0


def cmd_compare(args) -> int:
    """`a2 study compare NAME [--storage ROOT] [--by KEY] [--baseline VALUE]`: prints the table from the record."""
    from dashboards.compare import compare_table  # scipy, like launch.record: only when asked for
    from launch.record import StudyRecord

    location = locate(args.name, args.storage)
    record = StudyRecord.load(location)
    study = record.study()
    _print_banner(location)
    print(compare_table(study, args.by, args.baseline))
    for row in record.trials:  # trials that ended themselves: their epochs before it count, say why they stopped
        if row.get("ended"):
            print(f"note: trial {row['trial_id']} {state_text(row)}")
    note = study.still_running_note("comparison")
    if note:
        print(note)
    return 0


def _print_banner(location) -> None:
    """A rehearsal's tables start with the line saying so (`launch.rehearse`)."""
    line = importlib.import_module("launch.rehearse").banner(location)
    if line:
        print(line)


def cmd_report(args) -> int:
    """`a2 report NAME [--storage ROOT] [--out DIR] [--tracking-uri URI]`: the report from the record, into DIR
    (default `./a2-reports/NAME`, or a new numbered folder next to it when it holds an earlier report), logged to
    the study's MLflow parent run (in its own store unless --tracking-uri) when that run exists."""
    from dashboards.report import build_report, log_report  # matplotlib and scipy: only when asked for
    from launch.record import StudyRecord

    record = StudyRecord.load(locate(args.name, getattr(args, "storage", None)))
    study = record.study()
    out = fresh_folder(Path(getattr(args, "out", None) or Path("a2-reports") / args.name), ("report.html",), "report")
    paths = build_report(study, out)
    uri = getattr(args, "tracking_uri", None) or record.spec.tracking.mlflow_uri
    artifacts = log_report(uri, args.name, paths) if _store_answers(uri) else None
    print(f"report of study {args.name}:")
    for key, value in {**paths, **({"artifact_uri": artifacts} if artifacts else {})}.items():
        print(f"  {key}: {value}")
    if artifacts is None:
        print(f"note: not logged to MLflow: {uri} has no run of study {args.name} (`a2 mlflow sync {args.name}` "
              f"exports it)")
    note = study.still_running_note("report")
    if note:
        print(note)
    return 0


def _store_answers(uri: str) -> bool:
    """The MLflow store at `uri` is there (a SQLite file is never created just to find it empty) and answers."""
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        return False
    try:
        check_tracking_uri(uri, timeout=5.0)
    except A2Error:
        return False
    return True
