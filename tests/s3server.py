"""A real S3 endpoint for tests: moto's server on 127.0.0.1, one per test session.

Use the ``s3_endpoint`` fixture (re-exported by tests/conftest.py); it yields the endpoint URL and sets
fake credentials for the session, so any boto3 client pointed at the URL works::

    def test_upload(s3_endpoint, tmp_path):
        bucket = make_bucket(s3_endpoint, "my-test-bucket")
        ...

The server keeps its state for the whole session: give each test its own bucket (``unique_bucket``).
"""

from __future__ import annotations

import logging
import os
import uuid

import pytest

FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}
# Never read a developer's real AWS profile or point at real AWS by accident.
UNSET_ENV = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
             "MLFLOW_S3_ENDPOINT_URL")
# What the live `s3_endpoint` set ({name: value, or None: unset}). tests/conftest.py restores every test's
# environment afterwards; a session started inside a test (`request.getfixturevalue`) must outlive that test's
# restore, so conftest applies this again (`keep_session_environment`).
SESSION_ENV: dict[str, str | None] = {}


def keep_session_environment() -> None:
    for name, value in SESSION_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """Start moto's ThreadedMotoServer on 127.0.0.1 (free port); yield ``http://127.0.0.1:<port>``."""

    mp = pytest.MonkeyPatch()
    try:
        empty = str(tmp_path_factory.mktemp("aws-config") / "none")
        SESSION_ENV.update(FAKE_ENV, **dict.fromkeys(UNSET_ENV))
        SESSION_ENV.update(AWS_CONFIG_FILE=empty, AWS_SHARED_CREDENTIALS_FILE=empty)
        for k, v in SESSION_ENV.items():
            if v is None:
                mp.delenv(k, raising=False)
            else:
                mp.setenv(k, v)
        server = start_moto()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()
    finally:
        SESSION_ENV.clear()
        mp.undo()


def start_moto(port: int = 0):
    """A ThreadedMotoServer on 127.0.0.1:`port` (0: a free one). moto keeps buckets and objects in this process,
    not in the server: stop it and start another on the same port, and the data is still there (an S3 outage)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def s3_client(endpoint: str):
    """A plain boto3 S3 client for the endpoint (path-style addressing)."""
    import boto3
    from botocore.config import Config

    # A session of its own: boto3's default session caches the profiles it read first, and a command run in-process
    # may since have pointed AWS_PROFILE at its credentials file (launch.raycluster.stash_credentials).
    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                          aws_access_key_id="testing", aws_secret_access_key="testing",
                                          config=Config(s3={"addressing_style": "path"}))


def make_bucket(endpoint: str, name: str) -> str:
    """Create bucket ``name`` on the endpoint (fine if it exists already); return the name."""
    client = s3_client(endpoint)
    try:
        client.create_bucket(Bucket=name)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return name


def unique_bucket(endpoint: str, prefix: str = "test") -> str:
    """Create and return a fresh bucket named ``<prefix>-<random>``."""
    return make_bucket(endpoint, f"{prefix}-{uuid.uuid4().hex[:12]}")
