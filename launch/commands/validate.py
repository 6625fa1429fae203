"""`a2 study validate FILE` and `a2 submission validate ZIP`: the checks that read files only, loading no torch, Ray,
MLflow, scipy, matplotlib, pyarrow or boto3 (unless the study's storage is a bucket to ask)."""
from __future__ import annotations

import sys
from pathlib import Path

from a2core.config import ConfigError
from a2core.data.captions import read_image_info
from a2core.errors import StorageError
from dashboards.submission import validate_zip
from launch.commands import study_overrides
from launch.spec import check_machine, load_study, runs_locally


def validate_main(path: str | Path, overrides: list[str] | tuple = ()) -> int:
    """`a2 study validate`: a one-line summary of a valid study (exit 0), or its first error (exit 2)."""
    try:
        spec = load_study(path, overrides)
        if runs_locally(spec):
            check_machine(spec)
    except ConfigError as error:
        print(f"a2: error: {error}", file=sys.stderr)
        return 2
    if spec.storage.startswith("s3://"):  # one real request (HeadBucket): reachable, allowed, the bucket exists
        from launch.storage import check_storage  # pyarrow's S3: only when there is a bucket to ask

        try:
            check_storage(spec.storage, spec.storage_endpoint_url)
        except StorageError as error:
            print(f"a2: error: {spec.source}: storage: {error}", file=sys.stderr)
            return 2
    for warning in spec.warnings:
        print(f"a2: warning: {warning}", file=sys.stderr)
    print(spec.summary())
    return 0


def cmd_validate(args) -> int:
    """`a2 study validate FILE [key=value ...]`."""
    return validate_main(args.file, study_overrides(args))


def cmd_submission_validate(args) -> int:
    """`a2 submission validate ZIP`: the report; exit 1 when the zip would be refused."""
    report = validate_zip(args.zip, read_image_info(args.val_images), read_image_info(args.test_images), alg=args.alg)
    print(report)
    return 0 if report.ok else 1
