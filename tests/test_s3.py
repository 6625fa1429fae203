"""The storage layer against a real S3 endpoint (moto's server on 127.0.0.1): verified transfers through boto3's
managed transfer, faults injected into single HTTP attempts so that botocore's own retries are what is tested."""

from __future__ import annotations

import base64
import hashlib
import os
from collections import Counter
from pathlib import Path

import pytest

from a2core.errors import StorageError
from botocore.awsrequest import AWSResponse
from botocore.exceptions import EndpointConnectionError

from launch import storage
from launch.storage import (
    MiB,
    S3TransferError,
    S3VerificationError,
    make_client,
    open_location,
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


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_):
        yield self.data


def connection_error(request):
    raise EndpointConnectionError(endpoint_url=request.url)


def server_busy(request):
    body = b"<Error><Code>ServiceUnavailable</Code><Message>busy</Message></Error>"
    return AWSResponse(request.url, 503, {}, _Body(body))


def fail_requests(client, operation, when, effect=connection_error) -> Counter:
    """Every HTTP attempt of `operation` (retries included) is counted; the n-th one gets `effect` instead of
    reaching the server when `when(n)`. Returns the counter."""
    calls = Counter()

    def before_send(request, **_):
        calls[operation] += 1
        return effect(request) if when(calls[operation]) else None

    client.meta.events.register(f"before-send.s3.{operation}", before_send)
    return calls


def lose_answer(client, operation):
    """The call reaches the server, then its answer is 'lost' (the object may exist, the caller sees an error)."""
    def after_call(**_):
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1/lost")

    client.meta.events.register(f"after-call.s3.{operation}", after_call)


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
    assert storage.resolve_endpoint_url() == "http://minio:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://other:9000")
    assert storage.resolve_endpoint_url() == "http://other:9000"
    assert storage.resolve_endpoint_url("http://explicit:1") == "http://explicit:1"
    assert make_client().meta.endpoint_url == "http://other:9000"


def test_both_s3_clients_take_one_resolved_endpoint_and_region(monkeypatch):
    """pyarrow's filesystem (Ray's storage) and boto3 (verified uploads) reach the same endpoint with the same region:
    `storage.s3_endpoint` resolves them once."""
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    assert storage.s3_endpoint() == storage.S3Endpoint(None, None)  # AWS, the bucket's own region
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert storage.s3_endpoint() == storage.S3Endpoint("http://127.0.0.1:9", "us-east-1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    endpoint = storage.s3_endpoint()
    client, fs = make_client(), storage.s3_filesystem("bucket")
    assert (client.meta.endpoint_url, client.meta.region_name) == (endpoint.url, endpoint.region) == (
        "http://127.0.0.1:9", "eu-west-3")
    assert fs.region == "eu-west-3" and client.meta.config.s3["addressing_style"] == "path"


# ---------------------------------------------------------------------------------------- upload


def test_upload_small_file(s3_endpoint, bucket, client, small_file):
    info = upload_file(small_file, f"s3://{bucket}/subs/results.zip", endpoint_url=s3_endpoint)
    assert info["bucket"] == bucket and info["key"] == "subs/results.zip"
    assert info["size"] == 4321
    assert info["sha256"] == sha256(small_file)
    head = client.head_object(Bucket=bucket, Key="subs/results.zip", ChecksumMode="ENABLED")
    assert head["ContentLength"] == 4321
    assert head["Metadata"]["sha256"] == sha256(small_file)
    assert head["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(small_file.read_bytes()).digest()).decode()
    assert hashlib.sha256(stored(client, bucket, "subs/results.zip")).hexdigest() == sha256(small_file)


def test_upload_to_prefix_appends_file_name(s3_endpoint, bucket, client, small_file):
    info = upload_file(small_file, f"s3://{bucket}/subs/", endpoint_url=s3_endpoint)
    assert info["key"] == "subs/results.zip"
    assert open_location(f"s3://{bucket}/subs/", s3_endpoint).listdir() == ["results.zip"]


def test_upload_multipart(bucket, client, big_file):
    calls = fail_requests(client, "UploadPart", lambda n: False)
    info = upload_file(big_file, f"s3://{bucket}/ckpt/big.bin", client=client, part_size=PART)
    assert calls["UploadPart"] == 3
    assert info["size"] == 11 * MiB
    assert info["sha256"] == sha256(big_file)
    assert info["etag"].strip('"').endswith("-3")
    head = client.head_object(Bucket=bucket, Key="ckpt/big.bin")
    assert head["ContentLength"] == 11 * MiB
    assert head["Metadata"]["sha256"] == sha256(big_file)
    assert stored(client, bucket, "ckpt/big.bin") == big_file.read_bytes()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_interrupted_part_is_retried_by_botocore(bucket, client, big_file):
    calls = fail_requests(client, "UploadPart", lambda n: n == 2)
    created = fail_requests(client, "CreateMultipartUpload", lambda n: False)
    upload_file(big_file, f"s3://{bucket}/big.bin", client=client, part_size=PART)
    assert calls["UploadPart"] == 3 + 1  # part 2 sent twice, within one multipart upload
    assert created["CreateMultipartUpload"] == 1
    assert stored(client, bucket, "big.bin") == big_file.read_bytes()
    assert client.head_object(Bucket=bucket, Key="big.bin")["Metadata"]["sha256"] == sha256(big_file)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_interrupted_multipart_without_retry_leaves_nothing(s3_endpoint, bucket, big_file):
    client = make_client(s3_endpoint, max_attempts=1)
    fail_requests(client, "UploadPart", lambda n: n >= 2)
    aborted = fail_requests(client, "AbortMultipartUpload", lambda n: False)
    with pytest.raises(S3TransferError, match="big.bin"):
        upload_file(big_file, f"s3://{bucket}/big.bin", client=client, part_size=PART)
    assert aborted["AbortMultipartUpload"] == 1
    assert_nothing_left(client, bucket)


def test_persistent_failure_exhausts_retries_and_leaves_nothing(s3_endpoint, bucket, big_file):
    client = make_client(s3_endpoint, max_attempts=3)
    calls = fail_requests(client, "UploadPart", lambda n: n >= 2)  # part 1 goes through, then nothing does
    with pytest.raises(S3TransferError):
        upload_file(big_file, f"s3://{bucket}/big.bin", client=client, part_size=PART)
    assert calls["UploadPart"] == 1 + 3  # botocore's three attempts at part 2
    assert_nothing_left(client, bucket)


def test_lost_answer_to_complete_leaves_nothing(s3_endpoint, bucket, big_file):
    """complete_multipart_upload reaches the server but its answer is lost: the object exists, unverified;
    it must be removed when the upload gives up."""
    client = make_client(s3_endpoint, max_attempts=1)
    lose_answer(client, "CompleteMultipartUpload")
    with pytest.raises(S3TransferError):
        upload_file(big_file, f"s3://{bucket}/big.bin", client=client, part_size=PART)
    assert_nothing_left(client, bucket)


def test_single_put_retried_on_server_error(bucket, client, small_file):
    calls = fail_requests(client, "PutObject", lambda n: n <= 2, effect=server_busy)
    upload_file(small_file, f"s3://{bucket}/r.zip", client=client)
    assert calls["PutObject"] == 3
    assert stored(client, bucket, "r.zip") == small_file.read_bytes()


def test_single_put_persistent_failure(s3_endpoint, bucket, small_file):
    client = make_client(s3_endpoint, max_attempts=2)
    lose_answer(client, "PutObject")
    with pytest.raises(S3TransferError, match="r.zip"):
        upload_file(small_file, f"s3://{bucket}/r.zip", client=client)
    assert_nothing_left(client, bucket)


def test_failed_upload_keeps_someone_elses_object(s3_endpoint, bucket, small_file):
    client = make_client(s3_endpoint, max_attempts=1)
    client.put_object(Bucket=bucket, Key="r.zip", Body=b"previous submission")
    fail_requests(client, "PutObject", lambda n: True)
    with pytest.raises(S3TransferError):
        upload_file(small_file, f"s3://{bucket}/r.zip", client=client)
    assert stored(make_client(s3_endpoint), bucket, "r.zip") == b"previous submission"


def test_non_transient_error_is_not_retried(client, small_file):
    calls = fail_requests(client, "PutObject", lambda n: False)
    with pytest.raises(S3TransferError, match="NoSuchBucket"):
        upload_file(small_file, "s3://no-such-bucket-a2tune/r.zip", client=client)
    assert calls["PutObject"] == 1


def test_corrupted_upload_is_deleted(bucket, client, small_file):
    """The endpoint stores other bytes than the file's (checksummed as sent): verification fails, the object goes."""
    def truncate(params, **_):
        params["body"] = small_file.read_bytes()[:-10]

    client.meta.events.register("before-call.s3.PutObject", truncate)
    with pytest.raises(S3VerificationError, match="size 4311 != local 4321"):
        upload_file(small_file, f"s3://{bucket}/r.zip", client=client)
    assert_nothing_left(client, bucket)


def test_upload_argument_errors(bucket, client, tmp_path):
    with pytest.raises(StorageError, match="missing.bin"):
        upload_file(tmp_path / "missing.bin", f"s3://{bucket}/x", client=client)


# -------------------------------------------------------------------------------- download, locations


def test_download_round_trip(s3_endpoint, bucket, big_file, tmp_path):
    upload_file(big_file, f"s3://{bucket}/a/big.bin", endpoint_url=s3_endpoint, part_size=PART)
    target = tmp_path / "dl" / "big.bin"
    assert open_location(f"s3://{bucket}/a/big.bin", s3_endpoint).download(target) == target
    assert target.stat().st_size == 11 * MiB and sha256(target) == sha256(big_file)
    assert target.read_bytes() == big_file.read_bytes()
    assert [p.name for p in target.parent.iterdir()] == ["big.bin"]


def test_download_rejects_sha256_mismatch(s3_endpoint, bucket, client, tmp_path):
    client.put_object(Bucket=bucket, Key="x.bin", Body=b"abc", Metadata={"sha256": "0" * 64})
    target = tmp_path / "x.bin"
    target.write_bytes(b"old")
    with pytest.raises(S3VerificationError, match="sha256"):
        open_location(f"s3://{bucket}/x.bin", s3_endpoint).download(target)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]


def test_download_without_metadata(s3_endpoint, bucket, client, tmp_path):
    client.put_object(Bucket=bucket, Key="plain.txt", Body=b"hello")  # no sha256 to check: the size is
    open_location(f"s3://{bucket}/plain.txt", s3_endpoint).download(tmp_path / "plain.txt")
    assert (tmp_path / "plain.txt").read_bytes() == b"hello"


def test_download_missing_object(s3_endpoint, bucket, tmp_path):
    with pytest.raises(S3TransferError, match="404|NoSuchKey|Not Found"):
        open_location(f"s3://{bucket}/nope", s3_endpoint).download(tmp_path / "nope")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """The same storage root, once as a local folder and once on the S3 endpoint."""
    if request.param == "local":
        return open_location(tmp_path / "root")
    endpoint = request.getfixturevalue("s3_endpoint")
    return open_location(f"s3://{unique_bucket(endpoint)}/root/", endpoint)


@pytest.mark.slow
def test_location_read_write_list(root, tmp_path):
    study = root.join("a2-x")
    assert not study.exists() and study.listdir() == [] and study.join("study.yaml").read_text() is None
    study.join("study.yaml").write_text("name: a2-x\n")
    study.join("trials", "t1", "results.json").write_text("[]")
    study.join("study.yaml").write_text("name: a2-x\nagain: true\n")  # replaced whole
    assert study.join("study.yaml").read_text() == "name: a2-x\nagain: true\n"
    assert study.listdir() == ["study.yaml", "trials"]
    assert study.listdir(folders_only=True) == ["trials"]
    assert study.join("trials").listdir() == ["t1"]
    copy = study.join("trials", "t1", "results.json").download(tmp_path / "copy" / "results.json")
    assert Path(copy).read_text() == "[]"
    if root.local:
        assert sorted(p.name for p in Path(study.uri).iterdir()) == ["study.yaml", "trials"]  # no temp files
    else:
        path, fs = study.ray_storage()
        assert path == study.uri[len("s3://"):] and fs is not None


def test_open_location_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert open_location("rel/dir").uri == str(tmp_path / "rel" / "dir")
    assert open_location(f"file://{tmp_path}/x").uri == str(tmp_path / "x")
    assert open_location("s3://bucket/prefix/").uri == "s3://bucket/prefix"
    assert open_location("s3a://bucket/p").uri == "s3://bucket/p"
    assert open_location("s3://bucket/p", "http://minio:9000").join("a", "b.json").uri == "s3://bucket/p/a/b.json"
    assert open_location("rel").ray_storage() == (str(tmp_path / "rel"), None)
    with pytest.raises(StorageError, match="unsupported storage 'gs://b/x'"):
        open_location("gs://b/x")


@pytest.mark.slow
def test_location_folders_stamps_conditional_create_and_stored_digest(root, tmp_path):
    """What verify, trainable, datastore and the lease ask of storage, through `Location` only."""
    study = root.join("a2-y")
    lease = study.join("lease.json")
    assert lease.write_if_absent("one") is True and lease.write_if_absent("two") is False
    assert lease.read_text() == "one"
    study.join("trials", "t1", "checkpoint_000001", "checkpoint.pt").write_text("ckpt")
    assert sorted(study.file_stamps()) == ["lease.json"] and study.file_stamps()["lease.json"][0] == 3
    assert root.join("none").file_stamps() == {}
    folder = study.join("trials", "t1", "checkpoint_000001")
    assert folder.is_folder() and not lease.is_folder() and not study.join("none").is_folder()
    path = folder.uri if root.local else folder.uri[len("s3://"):]  # as Ray's state names it
    assert study.on_same_storage(path) == folder
    folder.delete_folder()
    folder.delete_folder()  # none left: nothing happens
    assert not folder.exists() and study.join("trials", "t1").listdir() == []
    assert lease.stored_digest() == (3, None)  # written without upload_file: no stored SHA-256
    with pytest.raises(StorageError, match="cannot look it up"):
        study.join("none.json").stored_digest()
    if not root.local:
        source = tmp_path / "up.txt"
        source.write_text("hello")
        uploaded = upload_file(source, study.join("up.txt").uri, endpoint_url=root.endpoint_url)
        assert study.join("up.txt").stored_digest() == (5, uploaded["sha256"])
