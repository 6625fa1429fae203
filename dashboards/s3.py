"""Verified S3 transfers for study artifacts and submissions (boto3).

Works with AWS S3 and any S3-compatible endpoint (MinIO, Ceph, moto, ...): pass ``endpoint_url`` or set
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` / ``MLFLOW_S3_ENDPOINT_URL`` (first one set wins).

``upload_file`` guarantees that after it returns the object at the key holds exactly the local bytes,
and that after it raises no partial or unverified object it wrote (and no pending multipart upload) is
left behind:

* SHA-256 is computed locally and sent with every request (``ChecksumSHA256``), so the endpoint rejects
  corrupted bodies; it is also stored as object metadata ``sha256`` for endpoints that do not keep
  checksums.
* Files up to ``part_size`` go in one ``put_object``; larger ones through the low-level multipart API,
  aborted on any failure.
* Transient failures (5xx, throttling, connection errors) retry the whole upload with exponential backoff.
* Afterwards ``head_object`` must show the right size and sha256, otherwise the object is deleted and
  ``S3VerificationError`` raised.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import random
import re
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError
from a2core.errors import StorageError

__all__ = [
    "MiB",
    "S3TransferError",
    "S3VerificationError",
    "download_file",
    "is_transient",
    "list_prefix",
    "make_client",
    "parse_s3_uri",
    "resolve_endpoint_url",
    "upload_file",
]

log = logging.getLogger(__name__)

MiB = 1024 * 1024
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB  # also the largest single PUT
MAX_PARTS = 10_000
ENDPOINT_ENV_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL")
META_SHA256 = "sha256"  # user metadata key (x-amz-meta-sha256): hex digest of the whole object
META_TOKEN = "a2tune-upload"  # user metadata key: id of the upload_file call that wrote the object

_TRANSIENT_CODES = {
    "InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException",
    "ThrottledException", "RequestThrottled", "RequestThrottledException", "TooManyRequestsException",
    "RequestLimitExceeded", "ProvisionedThroughputExceededException", "RequestTimeout",
    "RequestTimeoutException", "BandwidthLimitExceeded", "BadDigest", "EC2ThrottledException",
}
_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]")


class S3TransferError(RuntimeError):
    """An upload or download failed (after any retries); nothing partial was left behind."""


class S3VerificationError(S3TransferError):
    """The transferred bytes do not match the source (size or SHA-256)."""


# ------------------------------------------------------------------------------------------ basics


def parse_s3_uri(uri: str, *, require_key: bool = False) -> tuple[str, str]:
    """``"s3://bucket/prefix/key"`` -> ``("bucket", "prefix/key")``. The key may be empty
    (``s3://bucket`` or ``s3://bucket/``) unless ``require_key``."""
    if not isinstance(uri, str):
        raise StorageError(f"S3 URI must be a string, got {type(uri).__name__}")
    if not uri.startswith("s3://"):
        raise StorageError(f"not an S3 URI (expected s3://bucket/key): {uri!r}")
    rest = uri[len("s3://"):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"S3 URI has no bucket name: {uri!r}")
    if not _BUCKET_RE.fullmatch(bucket):
        raise StorageError(f"invalid S3 bucket name {bucket!r} in {uri!r} "
                         "(3-63 characters: letters, digits, '.', '-', '_')")
    if require_key and not key:
        raise StorageError(f"S3 URI has no object key: {uri!r}")
    return bucket, key


def resolve_endpoint_url(endpoint_url: str | None = None) -> str | None:
    """``endpoint_url`` if given, else the first non-empty of AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL,
    MLFLOW_S3_ENDPOINT_URL; ``None`` means AWS itself."""
    if endpoint_url:
        return endpoint_url
    for var in ENDPOINT_ENV_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            return value
    return None


def make_client(endpoint_url: str | None = None, *, region_name: str | None = None, config: Config | None = None):
    """An S3 client for AWS or an S3-compatible endpoint (path-style addressing for custom endpoints)."""
    endpoint_url = resolve_endpoint_url(endpoint_url)
    if config is None:
        options: dict[str, Any] = {"retries": {"mode": "standard", "max_attempts": 3}}
        if endpoint_url:
            options["s3"] = {"addressing_style": "path"}
        config = Config(**options)
    if region_name is None and endpoint_url and not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
        region_name = "us-east-1"  # most S3-compatible servers ignore it, but signing needs one
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region_name, config=config)


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: 5xx or throttling answers, and connection-level failures."""
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {}) or {}
        status = (exc.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode") or 0
        try:
            status = int(status)
        except (TypeError, ValueError):
            status = 0
        return status >= 500 or status == 429 or err.get("Code") in _TRANSIENT_CODES
    # HTTPClientError covers read timeouts and broken response streams; IncompleteReadError short bodies.
    return isinstance(exc, (BotoConnectionError, HTTPClientError, IncompleteReadError, ConnectionError, TimeoutError))


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


def _file_sha256(path: Path, chunk: int = 8 * MiB) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _backoff_sleep(attempt: int, backoff: float, max_backoff: float, sleep: Callable[[float], None]) -> None:
    delay = min(max_backoff, backoff * (2 ** (attempt - 1)))
    sleep(delay * random.uniform(0.5, 1.0))


def _retrying(what: str, attempts: int, backoff: float, max_backoff: float, sleep, fn: Callable[[int], Any]) -> Any:
    """Call ``fn(attempt)`` until it succeeds, a non-transient error occurs, or ``attempts`` run out.
    Failures surface as S3TransferError (verification failures unchanged)."""
    if attempts < 1:
        raise ValueError(f"retries must be >= 1 (it is the number of attempts), got {attempts}")
    for attempt in range(1, attempts + 1):
        try:
            return fn(attempt)
        except S3TransferError:
            raise
        except FileNotFoundError:
            raise
        except (ClientError, BotoCoreError, OSError) as e:
            if not is_transient(e):
                raise S3TransferError(f"{what} failed: {e}") from e
            if attempt == attempts:
                raise S3TransferError(f"{what} failed after {attempts} attempt(s): {e}") from e
            log.warning("%s: attempt %d/%d failed (%s); retrying", what, attempt, attempts, e)
            _backoff_sleep(attempt, backoff, max_backoff, sleep)
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------------ upload


def _abort(client, bucket: str, key: str, upload_id: str, tries: int = 3) -> None:
    for i in range(tries):
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            return
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchUpload", "404"):
                return  # already gone (e.g. completed server-side though the answer was lost)
            if not is_transient(e) or i == tries - 1:
                log.error("could not abort multipart upload %s of s3://%s/%s: %s", upload_id, bucket, key, e)
                return
        except Exception as e:  # noqa: BLE001 - best effort; keep the original error
            if not is_transient(e) or i == tries - 1:
                log.error("could not abort multipart upload %s of s3://%s/%s: %s", upload_id, bucket, key, e)
                return
        time.sleep(0.2 * (2 ** i))


def _delete_if_ours(client, bucket: str, key: str, token: str) -> None:
    """Remove the object at the key if this upload_file call wrote it (never someone else's object)."""
    for i in range(3):
        try:
            head = client.head_object(Bucket=bucket, Key=key)
            if (head.get("Metadata") or {}).get(META_TOKEN) == token:
                client.delete_object(Bucket=bucket, Key=key)
            return
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return
            if not is_transient(e) or i == 2:
                log.error("could not remove unverified object s3://%s/%s: %s", bucket, key, e)
                return
        except Exception as e:  # noqa: BLE001
            if not is_transient(e) or i == 2:
                log.error("could not remove unverified object s3://%s/%s: %s", bucket, key, e)
                return
        time.sleep(0.2 * (2 ** i))


def _put_single(client, path: Path, bucket: str, key: str, sha_hex: str, size: int, extra: dict) -> dict:
    body = path.read_bytes()
    digest = hashlib.sha256(body).digest()
    if len(body) != size or digest.hex() != sha_hex:
        raise S3TransferError(f"{path} changed while it was being uploaded")
    resp = client.put_object(Bucket=bucket, Key=key, Body=body, ChecksumAlgorithm="SHA256",
                             ChecksumSHA256=_b64(digest), **extra)
    return {"etag": resp.get("ETag"), "parts": 1, "composite_sha256": None}


def _put_multipart(client, path: Path, bucket: str, key: str, sha_hex: str, size: int, part_size: int,
                   extra: dict) -> dict:
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256",
                                               **extra)["UploadId"]
    try:
        parts = []
        part_digests = []
        whole = hashlib.sha256()
        total = 0
        with open(path, "rb") as f:
            number = 1
            while block := f.read(part_size):
                digest = hashlib.sha256(block).digest()
                whole.update(block)
                total += len(block)
                resp = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                          Body=block, ChecksumAlgorithm="SHA256", ChecksumSHA256=_b64(digest))
                parts.append({"PartNumber": number, "ETag": resp["ETag"], "ChecksumSHA256": _b64(digest)})
                part_digests.append(digest)
                number += 1
        if total != size or whole.hexdigest() != sha_hex:
            raise S3TransferError(f"{path} changed while it was being uploaded")
        resp = client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                                MultipartUpload={"Parts": parts})
    except BaseException:
        _abort(client, bucket, key, upload_id)
        raise
    composite = _b64(hashlib.sha256(b"".join(part_digests)).digest())
    return {"etag": resp.get("ETag"), "parts": len(parts), "composite_sha256": composite}


def _verify(client, bucket: str, key: str, sha_hex: str, size: int, composite: str | None) -> dict:
    head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    problems = []
    if head.get("ContentLength") != size:
        problems.append(f"size {head.get('ContentLength')} != local {size}")
    stored = (head.get("Metadata") or {}).get(META_SHA256)
    if stored != sha_hex:
        problems.append(f"metadata sha256 {stored!r} != local {sha_hex}")
    checksum = head.get("ChecksumSHA256")
    if checksum:  # "<b64>" for single puts, "<b64 of concatenated part digests>-N" for multipart
        value = checksum.split("-", 1)[0]
        accepted = {_b64(bytes.fromhex(sha_hex))} | ({composite} if composite else set())
        if value not in accepted:
            problems.append(f"ChecksumSHA256 {checksum} does not match the local data")
    if problems:
        raise S3VerificationError(f"s3://{bucket}/{key}: " + "; ".join(problems))
    return head


def upload_file(
    local_path: str | os.PathLike,
    s3_uri: str,
    *,
    endpoint_url: str | None = None,
    retries: int = 5,
    part_size: int = 8 * MiB,
    client=None,
    content_type: str | None = None,
    backoff: float = 0.5,
    max_backoff: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """Upload ``local_path`` to ``s3_uri`` and verify it; return ``{"bucket", "key", "uri", "size",
    "sha256", "etag", "parts", "attempts"}``.

    A URI ending in ``/`` (or naming only a bucket) gets the file name appended. ``retries`` is the total
    number of attempts (1 = no retry). Files larger than ``part_size`` (>= 5 MiB) go multipart. On failure
    raises S3TransferError (S3VerificationError when the stored object did not match), having removed
    any object this call wrote and aborted any multipart upload it started.
    """
    path = Path(local_path)
    if not path.is_file():
        raise StorageError(f"no such file to upload: {path}")
    bucket, key = parse_s3_uri(s3_uri)
    if not key or key.endswith("/"):
        key = key + path.name
    if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
        raise ValueError(f"part_size must be between 5 MiB and 5 GiB, got {part_size}")
    if retries < 1:
        raise ValueError(f"retries must be >= 1 (it is the number of attempts), got {retries}")
    client = client if client is not None else make_client(endpoint_url)

    sha_hex, size = _file_sha256(path)
    multipart = size > part_size
    if multipart and -(-size // part_size) > MAX_PARTS:
        part_size = -(-size // MAX_PARTS)
    token = uuid.uuid4().hex
    extra: dict[str, Any] = {"Metadata": {META_SHA256: sha_hex, META_TOKEN: token}}
    if content_type:
        extra["ContentType"] = content_type
    uri = f"s3://{bucket}/{key}"
    attempts_made = 0

    def attempt(n: int) -> dict:
        nonlocal attempts_made
        attempts_made = n
        if multipart:
            return _put_multipart(client, path, bucket, key, sha_hex, size, part_size, extra)
        return _put_single(client, path, bucket, key, sha_hex, size, extra)

    try:
        result = _retrying(f"upload of {path} to {uri}", retries, backoff, max_backoff, sleep, attempt)
        try:
            head = _retrying(f"verification of {uri}", retries, backoff, max_backoff, sleep,
                             lambda _: _verify(client, bucket, key, sha_hex, size, result["composite_sha256"]))
        except S3VerificationError:
            raise
        except S3TransferError as e:
            raise S3VerificationError(f"{uri}: could not verify the uploaded object: {e}") from e
    except BaseException:
        _delete_if_ours(client, bucket, key, token)
        raise
    log.info("uploaded %s to %s (%d bytes, sha256 %s, %d part(s), %d attempt(s))",
             path, uri, size, sha_hex, result["parts"], attempts_made)
    return {"bucket": bucket, "key": key, "uri": uri, "size": size, "sha256": sha_hex,
            "etag": head.get("ETag") or result["etag"], "parts": result["parts"], "attempts": attempts_made}


# ---------------------------------------------------------------------------------------- download


def download_file(
    s3_uri: str,
    local_path: str | os.PathLike,
    *,
    endpoint_url: str | None = None,
    retries: int = 5,
    client=None,
    backoff: float = 0.5,
    max_backoff: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """Download ``s3_uri`` to ``local_path`` atomically (temp file in the same folder, then rename).

    The size must match the object's and, when the object carries ``sha256`` metadata (everything
    ``upload_file`` writes does), so must the SHA-256; otherwise S3VerificationError and the target is
    left untouched. Returns ``{"bucket", "key", "uri", "path", "size", "sha256", "verified"}``.
    """
    bucket, key = parse_s3_uri(s3_uri, require_key=True)
    client = client if client is not None else make_client(endpoint_url)
    path = Path(local_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    uri = f"s3://{bucket}/{key}"

    def attempt(_: int) -> dict:
        resp = client.get_object(Bucket=bucket, Key=key)
        expected_sha = (resp.get("Metadata") or {}).get(META_SHA256)
        expected_size = resp.get("ContentLength")
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            h = hashlib.sha256()
            size = 0
            with os.fdopen(fd, "wb") as f:
                for chunk in resp["Body"].iter_chunks(chunk_size=1 * MiB):
                    f.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            sha_hex = h.hexdigest()
            if expected_size is not None and size != expected_size:
                raise ConnectionError(f"{uri}: got {size} of {expected_size} bytes")  # truncated: retry
            if expected_sha and sha_hex != expected_sha:
                raise S3VerificationError(f"{uri}: sha256 {sha_hex} != stored {expected_sha}")
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return {"bucket": bucket, "key": key, "uri": uri, "path": str(path), "size": size,
                "sha256": sha_hex, "verified": bool(expected_sha)}

    return _retrying(f"download of {uri}", retries, backoff, max_backoff, sleep, attempt)


# ------------------------------------------------------------------------------------------ listing


def list_prefix(s3_uri: str, *, endpoint_url: str | None = None, client=None, page_size: int = 1000) -> list[str]:
    """Every object under ``s3_uri`` (a plain key-prefix match), as sorted ``s3://bucket/key`` URIs."""
    bucket, prefix = parse_s3_uri(s3_uri)
    client = client if client is not None else make_client(endpoint_url)
    uris = []
    for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix, PaginationConfig={"PageSize": page_size}):
        uris.extend(f"s3://{bucket}/{obj['Key']}" for obj in page.get("Contents", []))
    return sorted(uris)
