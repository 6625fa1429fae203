"""`a2 study run|resume` and `a2 mlflow sync NAME`: the commands that drive a study or export its record, on Ray and
MLflow.

Where a study lives is `launch.location`; running and resuming it is `launch.driver`; reading it back is
`launch.record`, and the commands that print or write what people read of it are `launch.commands.show`. MLflow is
an export of the study's record (`launch.mlflow_export`).
"""
from __future__ import annotations

from dashboards.tracking import redact_uri
from launch.conclusions import read_summary
from launch.commands import driver_options, load_study_file
from launch.driver import check_tracking, exit_code, resume_study, run_study
from launch.lease import DEFAULT_STALE_AFTER, StudyLease
from launch.layout import add_outage, outage_line
from launch.location import load_saved_spec, locate, write_summary
from launch.mlflow_export import Export, end_reason
from launch.record import tune_trials


def cmd_run(args) -> int:
    spec = load_study_file(args)  # ConfigError -> exit 2 with the key path (a2's main)
    return exit_code(run_study(spec, **driver_options(args)))


def cmd_resume(args) -> int:
    return exit_code(resume_study(locate(args.name, args.storage), restore_state=args.restore_state,
                                  **driver_options(args)))


def cmd_sync(args) -> int:
    """Export the study's record to its MLflow server (`launch.mlflow_export`); updates `summary.json`'s `tracking`."""
    location = locate(args.name, args.storage)
    spec = load_saved_spec(location)
    check_tracking(spec)
    print(f"study {spec.name}: exporting its record into MLflow at {redact_uri(spec.tracking.mlflow_uri)} (the store "
          f"recorded with the study)", flush=True)
    lease = StudyLease(location.at(), getattr(args, "stale_after", DEFAULT_STALE_AFTER))  # a Namespace of Python callers
    with lease.held(getattr(args, "force", False)):  # a running driver exports itself: never both at once
        export = Export(spec, location)
        export.run(tune_trials(location), end_reason(spec.name))
        outage = add_outage(location, pending=False)
        summary = read_summary(location, placed=False)  # written back as it is (its paths relative)
        if isinstance(summary, dict):
            write_summary(location, {**summary, "tracking": outage})
    superseded = (f"; {len(export.superseded)} run(s) left RUNNING by trials a killed driver lost ended KILLED "
                  f"(superseded)" if export.superseded else "")
    print(f"study {spec.name}: exported to MLflow; " + (outage_line(outage) or "nothing was missing") + superseded)
    return 0
