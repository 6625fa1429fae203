"""`a2 study validate ... storage=s3://...` makes one real request to the bucket: a bucket that is not there, or an
endpoint that does not answer, fails validation in one line naming the study file, before anything starts."""
from __future__ import annotations

import socket
from pathlib import Path

from launch.commands.validate import validate_main
from tests.s3server import unique_bucket

SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"


def test_a_reachable_bucket_validates(s3_endpoint, capsys):
    bucket = unique_bucket(s3_endpoint, "a2-validate")
    assert validate_main(SMOKE, [f"storage=s3://{bucket}/a2-studies", f"storage_endpoint_url={s3_endpoint}"]) == 0


def test_a_missing_bucket_fails_in_one_line(s3_endpoint, capsys):
    assert validate_main(SMOKE, ["storage=s3://a2-no-such-bucket/a2-studies",
                                 f"storage_endpoint_url={s3_endpoint}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(SMOKE) in err and "no such bucket 'a2-no-such-bucket'" in err, err


def test_an_endpoint_that_does_not_answer_fails_in_one_line(s3_endpoint, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert validate_main(SMOKE, ["storage=s3://a2-bucket/a2-studies",
                                 f"storage_endpoint_url=http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot reach the bucket" in err, err
