"""`a2 study status|compare`, `a2 report` and `a2 results export|show`: the commands that read a study's record (or a
results record) back and print or write what people read of it. Nothing here starts Ray; `a2 report` logs to the
study's MLflow run when its store answers."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from a2core.atomic import check_output_path, fresh_folder
from a2core.errors import StudyError
from dashboards.compare import compare_table
from dashboards.records import export_record, load_record, render_table
from dashboards.tracking import server_answers
from launch.adaptive import amend_summary
from launch.conclusions import print_conclusions, state_text
from launch.lease import live_writer
from launch.location import json_default, locate, rehearsal_banner
from launch.progress import Progress, progress_line, study_progress
from launch.record import StudyRecord
from launch.tracking_writer import log_report
from launch.verify import RECHECK_S, refuse_corrupt


INTERRUPTED = 128 + 2  # the exit status after SIGINT (Ctrl-C), 130, as a shell gives it
REPORT_PAGE = "report.html"  # what an earlier report's folder holds (`dashboards.report.build_report`)


def cmd_status(args) -> int:
    """`a2 study status NAME [--json] [--watch [SECONDS]]`: the trial table, groups, verdict, compute and progress;
    with --watch, again every SECONDS until every trial has ended (one past its last epoch, still testing its
    selected checkpoint, has not: `Progress.ended`), no driver runs the study, or Ctrl-C."""
    if getattr(args, "watch", None) is None:  # a Namespace of Python callers may not carry it
        _status_of_running(args)
        return 0
    try:
        while True:
            if sys.stdout.isatty():
                print("\033[H\033[2J", end="")  # the terminal cleared: the table stays where it was
            print(f"a2 study status {args.name} (every {args.watch:g} s; Ctrl-C stops)  {time.strftime('%H:%M:%S')}")
            progress = _status_of_running(args)
            if progress.ended or not progress.driven:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:  # how a watch is meant to end: no traceback, the last table left on the screen
        return INTERRUPTED  # as every command stopped by SIGINT (`launch.cli`): a wrapping script tells it apart


def _status_of_running(args) -> Progress:
    """`status`, read once more `RECHECK_S` later when a file was found unreadable while a driver holds the study's
    lease: Tune copies its state files over themselves, and a read mid-copy ended a --watch of a running study with
    "status refused ... restore the file from a copy"."""
    try:
        return status(args)
    except StudyError:
        if live_writer(locate(args.name, args.storage).at()) is None:
            raise
    time.sleep(RECHECK_S)
    return status(args)


def status(args) -> Progress:
    """Print the study's status once (as JSON with --json); its progress."""
    location = locate(args.name, args.storage)
    refuse_corrupt(location.at(), "status")
    record = StudyRecord.load(location, refuse="status").shown()
    spec = record.spec
    summary = amend_summary(spec, record.study(), record.summary())  # adaptive replicates: the design's word
    progress = study_progress(spec, record.trials, record.running,
                              design_ended=bool((summary.get("adaptive") or {}).get("done")))
    if args.json:
        print(json.dumps({**summary, "progress": {**asdict(progress), "seconds_left": progress.seconds_left}},
                         indent=2, default=json_default))
        return progress
    if not record.trials:
        print(f"study {spec.name}: no trial has started yet")
    _print_banner(location)
    print(f"study {spec.name} at {location.uri()}: {summary['trials_finished']}/{spec.num_trials} trials finished")
    print_conclusions(spec, summary, record.trials)
    if summary.get("adaptive"):  # the round it is in and each arm's state, one line each
        print("\n".join(summary["adaptive"]["lines"]))
    print(progress_line(progress), flush=True)
    return progress


def cmd_compare(args) -> int:
    """`a2 study compare NAME [--storage ROOT] [--by KEY] [--baseline VALUE]`: prints the table from the record."""
    location = locate(args.name, args.storage)
    record = StudyRecord.load(location)
    study = record.study()
    _print_banner(location)
    print(compare_table(study, args.by, args.baseline))
    for row in record.trials:  # trials that ended themselves: their epochs before it count, say why they stopped
        if row.get("ended"):
            print(f"note: trial {row['trial_id']} {state_text(row)}")
    if note := study.still_running_note("comparison"):
        print(note)
    return 0


def _print_banner(location) -> None:
    """A rehearsal's tables start with the line saying so (`launch.rehearse`)."""
    if line := rehearsal_banner(location):
        print(line)


def cmd_report(args) -> int:
    """`a2 report NAME [--storage ROOT] [--out DIR] [--tracking-uri URI]`: the report from the record, into DIR
    (default `./a2-reports/NAME`, or a new numbered folder next to it when it holds an earlier report), logged to
    the study's MLflow parent run (in its own store unless --tracking-uri) when that run exists."""
    from dashboards.report import build_report  # matplotlib: not for the status and compare here

    out_given = getattr(args, "out", None)
    # before the record is read: a file, or a folder this user cannot write, named as `a2 train|decode` name theirs
    check_output_path(out_given if out_given is not None else Path("a2-reports") / args.name, "--out", folder=True)
    record = StudyRecord.load(locate(args.name, getattr(args, "storage", None)))
    study = record.study()
    out = report_folder(out_given or Path("a2-reports") / args.name)
    try:
        paths = build_report(study, out)
    except BaseException:
        _unclaim(out)
        raise
    uri = getattr(args, "tracking_uri", None) or record.spec.tracking.mlflow_uri
    artifacts = log_report(uri, args.name, paths) if _store_answers(uri) else None
    print(f"report of study {args.name}:")
    for key, value in {**paths, **({"artifact_uri": artifacts} if artifacts else {})}.items():
        print(f"  {key}: {value}")
    if artifacts is None:
        print(f"note: not logged to MLflow: {uri} has no run of study {args.name} (`a2 mlflow sync {args.name}` "
              f"exports it)")
    if note := study.still_running_note("report"):
        print(note)
    return 0


def report_folder(path, say=print) -> Path:
    """The folder a report is written into: `path` unless it holds an earlier report, else `path-2`, ... (said to
    `say`), claimed at once (`fresh_folder`): two reports started at once never pick the same folder."""
    return fresh_folder(path, (REPORT_PAGE,), "report", say, claim=True)


def _unclaim(out: Path) -> None:
    """A report that failed leaves no claim behind (an empty `report.html` the next one would number past)."""
    page = out / REPORT_PAGE
    try:
        if page.stat().st_size == 0:
            page.unlink()
    except OSError:
        pass


def _store_answers(uri: str) -> bool:
    """The MLflow store at `uri` is there (a SQLite file is never created just to find it empty) and answers."""
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        return False
    return server_answers(uri, timeout=5.0)


def cmd_results_export(args) -> int:
    study_view = StudyRecord.load(locate(args.name, args.storage)).study()
    export_record(study_view, args.by, args.out, spec=args.spec, baseline=args.baseline, measured=args.measured,
                  note=args.note)
    print(f"record: {args.out}")
    return 0


def cmd_results_show(args) -> int:
    """`a2 results show RECORD`."""
    print(render_table(load_record(args.record)))
    return 0
