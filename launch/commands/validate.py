"""`a2 study validate FILE [--cluster CLUSTER_YAML]` and `a2 submission validate ZIP`: the checks that read files
only, loading no torch, Ray, MLflow, scipy, matplotlib, pyarrow or boto3 (unless the study's storage, or an S3 copy
of its data that the cluster file fetches, is a bucket to ask)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from a2core.config import ConfigError
from a2core.data.captions import read_image_info
from a2core.errors import StorageError, SubmissionError, folder_instead
from dashboards.submission import validate_zip
from launch.commands import study_overrides
from launch.datacopies import cluster_copies, copy_problem
from launch.spec import check_machine, load_study, runs_locally, study_root


def validate_main(path: str | Path, overrides: list[str] | tuple = (), cluster: str | Path | None = None) -> int:
    """`a2 study validate`: a one-line summary of a valid study (exit 0), or its first error (exit 2). With `cluster`
    (a cluster-launcher file), also each S3 copy of the study's data that its setup commands fetch: there, and the
    same version as the local copy (one line per copy that is not, exit 2)."""
    try:
        spec = load_study(path, overrides)
        if cluster is None and runs_locally(spec):  # with a cluster file, the study is for that cluster's nodes
            check_machine(spec)
        copies = cluster_copies(cluster, spec, study_root(path)) if cluster is not None else []
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
    problems = [problem for copy in copies if (problem := copy_problem(copy))]
    for problem in problems:
        print(f"a2: error: {spec.source}: {problem}", file=sys.stderr)
    if problems:
        return 2
    for warning in spec.warnings:
        print(f"a2: warning: {warning}", file=sys.stderr)
    print(spec.summary())
    if copies:
        print(f"{cluster}: the S3 copies it fetches of {', '.join(c.key for c in copies)} are this checkout's")
    return 0


def cmd_validate(args) -> int:
    """`a2 study validate FILE [key=value ...] [--cluster CLUSTER_YAML]`."""
    return validate_main(args.file, study_overrides(args), args.cluster)


def cmd_submission_validate(args) -> int:
    """`a2 submission validate ZIP`: the report; exit 1 when the zip would be refused (2, as for every user error,
    when there is no file to check)."""
    if not os.path.isfile(args.zip):
        raise SubmissionError(folder_instead(args.zip, "zip (give the results.zip to check)")
                              or f"{args.zip}: no such file (give the results.zip to check)")
    images = {option: read_image_info(path) for option, path in (("--val-images", args.val_images),
                                                                  ("--test-images", args.test_images))}
    for option, ids in images.items():  # a zip covering no image would pass: the server's lists are never empty
        if not ids:
            raise SubmissionError(f"{getattr(args, option[2:].replace('-', '_'))}: holds no image ({option}): give "
                                  f"the server's image list of that split")
    report = validate_zip(args.zip, images["--val-images"], images["--test-images"], alg=args.alg)
    print(report)
    return 0 if report.ok else 1
