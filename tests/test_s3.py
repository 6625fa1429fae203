"""Verified S3 transfers against a real S3 endpoint (moto's server on 127.0.0.1)."""

from __future__ import annotations

import hashlib
import os

import pytest

from a2core.errors import StorageError
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from dashboards import s3
from dashboards.s3 import (
    MiB,
    S3TransferError,
    S3VerificationError,
    download_file,
    list_prefix,
    make_client,
    parse_s3_uri,
    upload_file,
)
from tests.s3server import unique_bucket

PART = 5 * MiB  # S3's minimum part size


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """11 MiB of random bytes: three parts of 5 + 5 + 1 MiB."""
    path = tmp_path_factory.mktemp("s3data") / "big.bin"
    path.write_bytes(os.urandom(11 * MiB))
    return path


@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "results.zip"
    path.write_bytes(os.urandom(4321))
    return path


@pytest.fixture
def bucket(s3_endpoint):
    return unique_bucket(s3_endpoint)


@pytest.fixture
def client(s3_endpoint):
    return make_client(s3_endpoint)


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def stored(client, bucket, key) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def assert_nothing_left(client, bucket):
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


class FlakyClient:
    """Wraps a real S3 client; ``fail(method, call_number)`` decides whether that call raises a
    connection error instead of reaching the server (``after=True``: the call reaches the server and
    then its answer is 'lost')."""

    def __init__(self, real, fail, after=False, error=None):
        self._real = real
        self._fail = fail
        self._after = after
        self._error = error or (lambda: EndpointConnectionError(endpoint_url="http://127.0.0.1:1/flaky"))
        self.calls: dict[str, int] = {}
        self.pending_at_create: list[list] = []  # multipart uploads pending when each attempt began

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            n = self.calls[name] = self.calls.get(name, 0) + 1
            if name == "create_multipart_upload":
                pending = self._real.list_multipart_uploads(Bucket=kwargs["Bucket"]).get("Uploads", [])
                self.pending_at_create.append(pending)
            if self._fail(name, n) and not self._after:
                raise self._error()
            result = attr(*args, **kwargs)
            if self._fail(name, n):
                raise self._error()
            return result

        return call


# ------------------------------------------------------------------------------------------ URIs


def test_parse_s3_uri():
    assert parse_s3_uri("s3://bucket/prefix/key") == ("bucket", "prefix/key")
    assert parse_s3_uri("s3://my.bucket-1/a/b/c.json") == ("my.bucket-1", "a/b/c.json")
    assert parse_s3_uri("s3://bucket") == ("bucket", "")
    assert parse_s3_uri("s3://bucket/") == ("bucket", "")
    assert parse_s3_uri("s3://bucket/dir/") == ("bucket", "dir/")


@pytest.mark.parametrize("uri, words", [
    ("http://bucket/key", "not an S3 URI"),
    ("bucket/key", "not an S3 URI"),
    ("s3:/bucket/key", "not an S3 URI"),
    ("s3:///key", "no bucket"),
    ("s3://b/key", "invalid S3 bucket name 'b'"),
    ("s3://bad bucket/key", "invalid S3 bucket name"),
])
def test_parse_s3_uri_errors(uri, words):
    with pytest.raises(StorageError, match=words):
        parse_s3_uri(uri)


def test_parse_s3_uri_require_key():
    with pytest.raises(StorageError, match="no object key"):
        parse_s3_uri("s3://bucket/", require_key=True)
    with pytest.raises(StorageError, match="must be a string"):
        parse_s3_uri(None)


def test_endpoint_from_environment(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", "http://minio:9000")
    assert s3.resolve_endpoint_url() == "http://minio:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://other:9000")
    assert s3.resolve_endpoint_url() == "http://other:9000"
    assert s3.resolve_endpoint_url("http://explicit:1") == "http://explicit:1"
    assert make_client().meta.endpoint_url == "http://other:9000"


def test_is_transient():
    def client_error(code, status):
        return ClientError({"Error": {"Code": code, "Message": "m"},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert s3.is_transient(client_error("InternalError", 500))
    assert s3.is_transient(client_error("ServiceUnavailable", 503))
    assert s3.is_transient(client_error("SlowDown", 503))
    assert s3.is_transient(client_error("Throttling", 400))
    assert s3.is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert s3.is_transient(ConnectionResetError())
    assert s3.is_transient(ReadTimeoutError(endpoint_url="http://x"))
    assert not s3.is_transient(client_error("AccessDenied", 403))
    assert not s3.is_transient(client_error("NoSuchBucket", 404))
    assert not s3.is_transient(ValueError("x"))


# ---------------------------------------------------------------------------------------- upload


def test_upload_small_file(s3_endpoint, bucket, client, small_file):
    info = upload_file(small_file, f"s3://{bucket}/subs/results.zip", endpoint_url=s3_endpoint)
    assert info["bucket"] == bucket and info["key"] == "subs/results.zip"
    assert info["size"] == 4321
    assert info["sha256"] == sha256(small_file)
    assert info["parts"] == 1 and info["attempts"] == 1
    head = client.head_object(Bucket=bucket, Key="subs/results.zip", ChecksumMode="ENABLED")
    assert head["ContentLength"] == 4321
    assert head["Metadata"]["sha256"] == sha256(small_file)
    assert hashlib.sha256(stored(client, bucket, "subs/results.zip")).hexdigest() == sha256(small_file)


def test_upload_to_prefix_appends_file_name(s3_endpoint, bucket, client, small_file):
    info = upload_file(small_file, f"s3://{bucket}/subs/", endpoint_url=s3_endpoint)
    assert info["key"] == "subs/results.zip"
    assert list_prefix(f"s3://{bucket}/subs/", endpoint_url=s3_endpoint) == [f"s3://{bucket}/subs/results.zip"]


def test_upload_multipart(bucket, client, big_file):
    info = upload_file(big_file, f"s3://{bucket}/ckpt/big.bin", client=client, part_size=PART)
    assert info["parts"] == 3
    assert info["size"] == 11 * MiB
    assert info["sha256"] == sha256(big_file)
    assert info["etag"].strip('"').endswith("-3")
    head = client.head_object(Bucket=bucket, Key="ckpt/big.bin")
    assert head["ContentLength"] == 11 * MiB
    assert head["Metadata"]["sha256"] == sha256(big_file)
    assert stored(client, bucket, "ckpt/big.bin") == big_file.read_bytes()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_interrupted_multipart_is_aborted_and_retried(bucket, client, big_file):
    flaky = FlakyClient(client, lambda method, n: method == "upload_part" and n == 2)
    info = upload_file(big_file, f"s3://{bucket}/big.bin", client=flaky, part_size=PART, retries=3, backoff=0)
    assert info["attempts"] == 2
    assert flaky.calls["create_multipart_upload"] == 2
    assert flaky.calls["abort_multipart_upload"] == 1
    assert flaky.calls["upload_part"] == 2 + 3  # failed on part 2, then all three
    # When the second attempt began, the first one's multipart upload was already gone.
    assert flaky.pending_at_create == [[], []]
    assert stored(client, bucket, "big.bin") == big_file.read_bytes()
    assert client.head_object(Bucket=bucket, Key="big.bin")["Metadata"]["sha256"] == sha256(big_file)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_interrupted_multipart_without_retry_leaves_nothing(bucket, client, big_file):
    flaky = FlakyClient(client, lambda method, n: method == "upload_part" and n >= 2)
    with pytest.raises(S3TransferError, match="after 1 attempt") as e:
        upload_file(big_file, f"s3://{bucket}/big.bin", client=flaky, part_size=PART, retries=1)
    assert isinstance(e.value.__cause__, EndpointConnectionError)
    assert flaky.calls["abort_multipart_upload"] == 1
    assert_nothing_left(client, bucket)


def test_persistent_failure_exhausts_retries_and_leaves_nothing(bucket, client, big_file):
    flaky = FlakyClient(client, lambda method, n: method == "upload_part" and n % 2 == 0)  # every 2nd part
    sleeps = []
    with pytest.raises(S3TransferError, match="after 3 attempt"):
        upload_file(big_file, f"s3://{bucket}/big.bin", client=flaky, part_size=PART, retries=3,
                    backoff=1.0, sleep=sleeps.append)
    assert flaky.calls["create_multipart_upload"] == 3
    assert flaky.calls["abort_multipart_upload"] == 3
    assert len(sleeps) == 2 and 0.5 <= sleeps[0] <= 1.0 and 1.0 <= sleeps[1] <= 2.0  # exponential
    assert_nothing_left(client, bucket)


def test_lost_answer_to_complete_leaves_nothing(bucket, client, big_file):
    """complete_multipart_upload reaches the server but its answer is lost: the object exists,
    unverified; it must be removed when the upload gives up."""
    flaky = FlakyClient(client, lambda method, n: method == "complete_multipart_upload", after=True)
    with pytest.raises(S3TransferError):
        upload_file(big_file, f"s3://{bucket}/big.bin", client=flaky, part_size=PART, retries=1)
    assert_nothing_left(client, bucket)


def test_single_put_retried_on_server_error(bucket, client, small_file):
    def error():
        return ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "busy"},
                            "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")

    flaky = FlakyClient(client, lambda method, n: method == "put_object" and n <= 2, error=error)
    info = upload_file(small_file, f"s3://{bucket}/r.zip", client=flaky, retries=3, backoff=0)
    assert info["attempts"] == 3
    assert stored(client, bucket, "r.zip") == small_file.read_bytes()


def test_single_put_persistent_failure(bucket, client, small_file):
    flaky = FlakyClient(client, lambda method, n: method == "put_object", after=True)
    with pytest.raises(S3TransferError, match="after 2 attempt"):
        upload_file(small_file, f"s3://{bucket}/r.zip", client=flaky, retries=2, backoff=0)
    assert_nothing_left(client, bucket)


def test_failed_upload_keeps_someone_elses_object(bucket, client, small_file):
    client.put_object(Bucket=bucket, Key="r.zip", Body=b"previous submission")
    flaky = FlakyClient(client, lambda method, n: method == "put_object")
    with pytest.raises(S3TransferError):
        upload_file(small_file, f"s3://{bucket}/r.zip", client=flaky, retries=1)
    assert stored(client, bucket, "r.zip") == b"previous submission"


def test_non_transient_error_is_not_retried(s3_endpoint, client, small_file):
    flaky = FlakyClient(client, lambda method, n: False)
    with pytest.raises(S3TransferError, match="NoSuchBucket"):
        upload_file(small_file, "s3://no-such-bucket-a2tune/r.zip", client=flaky, retries=5, backoff=0)
    assert flaky.calls["put_object"] == 1


def test_corrupted_upload_is_deleted(bucket, client, small_file):
    """The endpoint stores different bytes than were sent: verification fails, the object goes."""

    class Corrupting(FlakyClient):
        def put_object(self, **kwargs):
            kwargs["Body"] = kwargs["Body"][:-10]
            return self._real.put_object(**kwargs)

    with pytest.raises(S3VerificationError, match="size 4311 != local 4321"):
        upload_file(small_file, f"s3://{bucket}/r.zip", client=Corrupting(client, lambda m, n: False), retries=3)
    assert_nothing_left(client, bucket)


def test_upload_argument_errors(bucket, client, small_file, tmp_path):
    with pytest.raises(StorageError, match="missing.bin"):
        upload_file(tmp_path / "missing.bin", f"s3://{bucket}/x", client=client)
    with pytest.raises(ValueError, match="part_size"):
        upload_file(small_file, f"s3://{bucket}/x", client=client, part_size=MiB)
    with pytest.raises(ValueError, match="retries"):
        upload_file(small_file, f"s3://{bucket}/x", client=client, retries=0)


# -------------------------------------------------------------------------------- download, list


def test_download_round_trip(s3_endpoint, bucket, big_file, tmp_path):
    upload_file(big_file, f"s3://{bucket}/a/big.bin", endpoint_url=s3_endpoint, part_size=PART)
    target = tmp_path / "dl" / "big.bin"
    info = download_file(f"s3://{bucket}/a/big.bin", target, endpoint_url=s3_endpoint)
    assert info["verified"] is True
    assert info["size"] == 11 * MiB and info["sha256"] == sha256(big_file)
    assert target.read_bytes() == big_file.read_bytes()
    assert [p.name for p in target.parent.iterdir()] == ["big.bin"]


def test_download_rejects_sha256_mismatch(bucket, client, tmp_path):
    client.put_object(Bucket=bucket, Key="x.bin", Body=b"abc", Metadata={"sha256": "0" * 64})
    target = tmp_path / "x.bin"
    target.write_bytes(b"old")
    with pytest.raises(S3VerificationError, match="sha256"):
        download_file(f"s3://{bucket}/x.bin", target, client=client)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]


def test_download_without_metadata(bucket, client, tmp_path):
    client.put_object(Bucket=bucket, Key="plain.txt", Body=b"hello")
    info = download_file(f"s3://{bucket}/plain.txt", tmp_path / "plain.txt", client=client)
    assert info["verified"] is False and info["size"] == 5
    assert (tmp_path / "plain.txt").read_bytes() == b"hello"


def test_download_missing_object(bucket, client, tmp_path):
    with pytest.raises(S3TransferError, match="404|NoSuchKey|Not Found"):
        download_file(f"s3://{bucket}/nope", tmp_path / "nope", client=client)
    assert list(tmp_path.iterdir()) == []


def test_list_prefix(s3_endpoint, bucket, client):
    for key in ["study/a/1.json", "study/a/2.json", "study/b.json", "studies/c.json", "other.json"]:
        client.put_object(Bucket=bucket, Key=key, Body=b"{}")
    assert list_prefix(f"s3://{bucket}/study/", endpoint_url=s3_endpoint) == [
        f"s3://{bucket}/study/a/1.json", f"s3://{bucket}/study/a/2.json", f"s3://{bucket}/study/b.json"]
    assert len(list_prefix(f"s3://{bucket}", client=client)) == 5
    assert list_prefix(f"s3://{bucket}/nothing/", client=client) == []


def test_list_prefix_paginates(bucket, client):
    for i in range(25):
        client.put_object(Bucket=bucket, Key=f"many/{i:04d}", Body=b"")
    requests = []
    client.meta.events.register("before-call.s3.ListObjectsV2", lambda **kw: requests.append(1))
    uris = list_prefix(f"s3://{bucket}/many/", client=client, page_size=10)
    assert uris == [f"s3://{bucket}/many/{i:04d}" for i in range(25)]
    assert len(requests) == 3
