"""The one storage layer: local folders and `s3://` behind one `Location` (pyarrow's filesystems, the ones Ray
takes), and verified uploads of published artifacts through boto3's managed transfer. Credentials come from the AWS
SDK's default chain; the endpoint is `endpoint_url`, else the first one set of ENDPOINT_ENV_VARS, else AWS."""
from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import mimetypes
import os
import posixpath
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

from a2core.atomic import atomic_write
from a2core.checksum import SUFFIX
from a2core.errors import StorageError
from launch.defaults import ENDPOINT_ENV_VARS
from launch.placeholders import refuse_placeholder

MiB = 1024 * 1024
META_SHA256 = "sha256"  # user metadata (x-amz-meta-sha256): hex digest of the whole object
META_TOKEN = "a2tune-upload"  # user metadata: id of the upload_file call that wrote the object
_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]")


class S3TransferError(StorageError):
    """An upload or download failed (after botocore's retries); nothing partial was left behind."""


class S3VerificationError(S3TransferError):
    """The transferred bytes do not match the source (size or SHA-256)."""


class UploadConflict(S3TransferError):
    """A conditional upload (`upload_file`'s `if_absent`, `if_match`) found the object at `uri` not as its caller
    saw it: another writer wrote (or removed) it meanwhile; nothing was written over it."""

    def __init__(self, uri: str, message: str):
        self.uri = uri
        super().__init__(message)


class WriteRefused(StorageError):
    """The storage refused a write (read-only, full, not allowed, a file in the way): `uri` and, in a few words,
    `reason`, for a caller that says what the write was for (`launch.lease`)."""

    def __init__(self, uri: str, reason: str):
        self.uri, self.reason = uri, reason
        super().__init__(f"{uri}: cannot write it ({reason})")


def parse_s3_uri(uri: str, *, require_key: bool = False) -> tuple[str, str]:
    """`"s3://bucket/prefix/key"` -> `("bucket", "prefix/key")`; the key may be empty unless `require_key`."""
    if not isinstance(uri, str):
        raise StorageError(f"S3 URI must be a string, got {type(uri).__name__}")
    if not uri.startswith("s3://"):
        raise StorageError(f"not an S3 URI (expected s3://bucket/key): {uri!r}")
    bucket, _, key = uri[len("s3://"):].partition("/")
    refuse_placeholder(uri)
    if not bucket:
        raise StorageError(f"S3 URI has no bucket name: {uri!r}")
    if not _BUCKET_RE.fullmatch(bucket):
        raise StorageError(f"invalid S3 bucket name {bucket!r} in {uri!r} "
                           "(3-63 characters: letters, digits, '.', '-', '_')")
    if require_key and not key:
        raise StorageError(f"S3 URI has no object key: {uri!r}")
    return bucket, key


def resolve_endpoint_url(endpoint_url: str | None = None) -> str | None:
    """`endpoint_url` if given, else the first one set of ENDPOINT_ENV_VARS; None means AWS itself."""
    return endpoint_url or next((os.environ[v].strip() for v in ENDPOINT_ENV_VARS if os.environ.get(v, "").strip()),
                                None)


@dataclass(frozen=True)
class S3Endpoint:
    """Where S3 requests go, resolved once (`s3_endpoint`) for both clients of this module: pyarrow's filesystem
    (what Ray Train and Tune take as `storage_filesystem`, so studies and checkpoints use it) and boto3 (verified
    managed uploads and object metadata, which pyarrow has not). `url` None is AWS itself; `region` None on AWS means
    the bucket's own. Credentials: both take the AWS SDK's default chain (environment, profile, instance role)."""
    url: str | None
    region: str | None


def s3_endpoint(endpoint_url: str | None = None) -> S3Endpoint:
    """The endpoint (`resolve_endpoint_url`) and region ($AWS_REGION, $AWS_DEFAULT_REGION; an S3-compatible server
    signs with some region, us-east-1 unless set)."""
    url = resolve_endpoint_url(endpoint_url)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    return S3Endpoint(url, region or ("us-east-1" if url else None))


def s3_filesystem(bucket: str, endpoint_url: str | None = None) -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem for `bucket`. Requests are retried by pyarrow's own strategy (the AWS SDK's standard
    one, 3 tries): passing a strategy object from Python deadlocked requests to an in-process S3 server (moto)."""
    options: dict = dict(connect_timeout=5.0, request_timeout=60.0)
    endpoint = s3_endpoint(endpoint_url)
    if endpoint.url is None:
        try:
            options["region"] = endpoint.region or pafs.resolve_s3_region(bucket)
        except OSError as err:
            raise StorageError(f"s3://{bucket}: cannot find the bucket's AWS region: {err}") from err
    else:
        parsed = urlparse(endpoint.url if "://" in endpoint.url else f"http://{endpoint.url}")
        options.update(endpoint_override=parsed.netloc, scheme=parsed.scheme or "http", region=endpoint.region)
    return pafs.S3FileSystem(**options)


def check_storage(uri: str, endpoint_url: str | None = None) -> None:
    """Fail fast, before anything starts, when S3 storage cannot work: no such bucket, endpoint unreachable, no or
    wrong credentials (StorageError naming bucket and endpoint). A local folder needs nothing: it is made."""
    if not str(uri).startswith("s3://"):
        return
    bucket, _ = parse_s3_uri(str(uri))
    where = f"s3://{bucket} at {resolve_endpoint_url(endpoint_url) or 'AWS'}"
    try:  # HeadBucket, tried twice: an endpoint that does not answer fails in seconds, not after the full retries
        info = s3_filesystem(bucket, endpoint_url).get_file_info(bucket)
    except OSError as err:
        raise StorageError(f"storage {where}: cannot reach the bucket ({err}); check the endpoint "
                           f"(storage_endpoint_url / $AWS_ENDPOINT_URL) and the credentials") from err
    if info.type == pafs.FileType.NotFound:
        raise StorageError(f"storage {where}: no such bucket {bucket!r}; create it first or fix the storage URI")


# -- locations ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Location:
    """A file or folder: an absolute local path or `s3://bucket/key`, with the S3 endpoint to reach it."""

    uri: str
    endpoint_url: str | None = None

    @property
    def local(self) -> bool:
        return not self.uri.startswith("s3://")

    def __str__(self) -> str:
        return self.uri

    def join(self, *parts: str) -> "Location":
        parts = [str(p).strip("/") for p in parts if p]
        return Location(posixpath.join(self.uri, *parts) if parts else self.uri, self.endpoint_url)

    @functools.cached_property
    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        """(pyarrow filesystem, path on it): what this module reads and writes through, and what Ray takes where it
        reads storage itself (a `ray.train.Checkpoint`; `ray_storage` for RunConfig). Every other reader and writer
        uses the methods below, so that pyarrow is imported here only."""
        if self.local:
            return pafs.LocalFileSystem(), self.uri
        bucket, key = parse_s3_uri(self.uri)
        return s3_filesystem(bucket, self.endpoint_url), f"{bucket}/{key}".rstrip("/")

    def ray_storage(self) -> tuple[str, pafs.FileSystem | None]:
        """(storage_path, storage_filesystem) for Ray's RunConfig and Tuner.restore/can_restore."""
        if self.local:
            return self.uri, None  # Ray's own local handling (symlinks, driver-side sync) stays in charge
        fs, path = self.filesystem
        return path, fs

    def on_same_storage(self, path: str) -> "Location":
        """The file or folder at `path` as this location's filesystem names it (what Ray records in its state: a
        local path, or `bucket/key` on S3), with the same endpoint."""
        return Location(path if self.local else f"s3://{path.lstrip('/')}", self.endpoint_url)

    @contextlib.contextmanager
    def _errors(self, doing: str):
        """pyarrow's OSError (unreachable endpoint, no such bucket, refused) as a StorageError naming the URI."""
        try:
            yield
        except OSError as err:
            raise StorageError(f"{self.uri}: cannot {doing}: {err}") from err

    def delete(self) -> None:
        """Remove this file; nothing happens when there is none."""
        fs, path = self.filesystem
        with self._errors("delete it"), contextlib.suppress(FileNotFoundError):
            fs.delete_file(path)

    def delete_folder(self) -> None:
        """Remove this folder and everything below it; nothing happens when there is none."""
        fs, path = self.filesystem
        with self._errors("delete it"), contextlib.suppress(FileNotFoundError):
            fs.delete_dir(path)

    def exists(self) -> bool:
        fs, path = self.filesystem
        with self._errors("look it up"):
            return fs.get_file_info(path).type != pafs.FileType.NotFound

    def is_folder(self) -> bool:
        """A folder (on S3: a prefix with objects below it) is here."""
        fs, path = self.filesystem
        with self._errors("look it up"):
            return fs.get_file_info(path).type == pafs.FileType.Directory

    def read_text(self, errors: str = "strict") -> str | None:
        """The file's text, or None when there is no such file. `errors` as `bytes.decode`'s: "replace" for a file
        whose damage a check finds (a checksum file with a flipped bit reads as text that records no digest)."""
        data = self.read_bytes()
        return None if data is None else data.decode("utf-8", errors)

    def recorded_checksum(self) -> str | None:
        """The text of the checksum file stored beside this file (`a2core.checksum`: `x.sha256` of `x`), None when
        there is none; read so that a flipped bit in it is a checksum that does not match, not a crash."""
        return open_location(self.uri + SUFFIX, self.endpoint_url).read_text(errors="replace")

    def read_bytes(self) -> bytes | None:
        """The file's bytes, or None when there is no such file. On S3 two requests whatever its size (its size, then
        one ranged GET): a stream would GET it in parts of a few hundred KB, requests growing with the file. A
        local file is read with Python's own `open` (a fifth of pyarrow's time: a status reads thousands)."""
        with self._errors("read it"), contextlib.suppress(FileNotFoundError):
            if self.local:
                with open(self.uri, "rb") as f:
                    return f.read()
            fs, path = self.filesystem
            with fs.open_input_file(path) as f:
                return f.read()
        return None

    def write_text(self, text: str | bytes) -> None:
        """Replace the file with `text` (or bytes) at once: temp file + rename locally; on S3 the object appears only
        once whole."""
        if self.local:
            atomic_write(self.uri, text)
            return
        fs, path = self.filesystem
        with tempfile.TemporaryDirectory(prefix="a2-upload-") as tmp, self._errors("write it"):
            (Path(tmp) / "object").write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
            pafs.copy_files(str(Path(tmp) / "object"), path, destination_filesystem=fs)

    def write_if_absent(self, text: str) -> bool:
        """Write this file only if there is none: False when one exists. On disk `O_CREAT | O_EXCL`, on S3 a
        conditional PUT (`IfNoneMatch="*"`): of two writers racing, one gets True. A write the storage refuses is
        `WriteRefused`."""
        if self.local:
            try:
                os.makedirs(os.path.dirname(self.uri), exist_ok=True)
                fd = os.open(self.uri, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            except OSError as err:  # read-only, full, a file in the way, not allowed
                raise WriteRefused(self.uri, err.strerror or str(err)) from err
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
            except OSError as err:
                # ours (O_EXCL): a partial file would tell every later writer "one exists" (a disk full mid-write)
                os.unlink(self.uri)
                raise WriteRefused(self.uri, err.strerror or str(err)) from err
            return True
        from botocore.exceptions import BotoCoreError, ClientError  # boto3: as in `download`

        bucket, key = parse_s3_uri(self.uri, require_key=True)
        client, body = make_client(self.endpoint_url), text.encode()
        try:
            client.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise WriteRefused(self.uri, str(err)) from err
        except BotoCoreError as err:
            raise WriteRefused(self.uri, str(err)) from err
        endpoint = resolve_endpoint_url(self.endpoint_url)
        if endpoint not in CONDITIONS_IGNORED:
            CONDITIONS_IGNORED[endpoint] = _ignores_conditions(client, bucket, key, body)
        return True

    def conditions_ignored(self) -> bool:
        """Whether the S3 endpoint of this location wrote over an object where a condition said not to, when this
        process last created a file there (`write_if_absent`'s probe); False on disk and where nothing was probed."""
        return not self.local and CONDITIONS_IGNORED.get(resolve_endpoint_url(self.endpoint_url), False)

    def listdir(self, *, folders_only: bool = False) -> list[str]:
        """Sorted names of the entries of this folder (empty when there is no such folder)."""
        if self.local:  # os.scandir: a status lists every trial's folder
            with self._errors("list it"), contextlib.suppress(FileNotFoundError, NotADirectoryError):
                with os.scandir(self.uri) as entries:
                    return sorted(e.name for e in entries if not folders_only or e.is_dir())
            return []
        fs, path = self.filesystem
        with self._errors("list it"):
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return sorted(i.base_name for i in infos if not folders_only or i.type == pafs.FileType.Directory)

    def file_stamps(self) -> dict[str, tuple[int, int]]:
        """Each file directly in this folder, its subfolders left out: name -> (size, modification time in ns);
        empty when there is no such folder. One listing, what a watcher of a few files polls."""
        if self.local:
            stamps = {}
            with self._errors("list it"), contextlib.suppress(FileNotFoundError, NotADirectoryError):
                with os.scandir(self.uri) as entries:
                    for entry in entries:
                        if entry.is_file():
                            stat = entry.stat()
                            stamps[entry.name] = (stat.st_size, stat.st_mtime_ns)
            return stamps
        fs, path = self.filesystem
        with self._errors("list it"):
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return {i.base_name: (i.size, i.mtime_ns) for i in infos if i.type == pafs.FileType.File}

    def files(self, skip: tuple[str, ...] = ()) -> list[tuple[str, int, int]]:
        """Every file below this folder, sorted: (its path relative to the folder, size, modification time in ns),
        leaving out the top-level files and subfolders named in `skip`; empty when there is no such folder. What a
        reader keys a copy of what it read on (`launch.record`'s digest): a file written, replaced or deleted changes
        it. On S3 one listing of the prefix (mtime to the second), however many files."""
        if self.local:
            found: list[tuple[str, int, int]] = []
            self._local_files(self.uri, "", skip, found)
            return sorted(found)
        fs, path = self.filesystem
        with self._errors("list it"):
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
        found = ((i.path[len(path):].lstrip("/"), i.size, i.mtime_ns) for i in infos if i.type == pafs.FileType.File)
        return sorted(f for f in found if f[0].split("/", 1)[0] not in skip)

    def _local_files(self, folder: str, prefix: str, skip: tuple[str, ...], found: list) -> None:
        with self._errors("list it"), contextlib.suppress(FileNotFoundError, NotADirectoryError):
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name in skip:  # a top-level name (below it, `skip` is ())
                        continue
                    if entry.is_dir():
                        self._local_files(entry.path, f"{prefix}{entry.name}/", (), found)
                    else:
                        stat = entry.stat()
                        found.append((prefix + entry.name, stat.st_size, stat.st_mtime_ns))

    def stamp(self) -> tuple[int, int] | None:
        """This file's (size, modification time in ns), or None when there is no such file."""
        if self.local:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                stat = os.stat(self.uri)
                return stat.st_size, stat.st_mtime_ns
            return None
        fs, path = self.filesystem
        with self._errors("look it up"):
            info = fs.get_file_info(path)
        return None if info.type != pafs.FileType.File else (info.size, info.mtime_ns)

    def stored_digest(self) -> tuple[int, str | None]:
        """This file's size and the SHA-256 that `upload_file` stored with it (None for an object without one, and
        for a local file: it has no metadata); StorageError when there is no such file."""
        if self.local:
            with self._errors("look it up"):
                return os.stat(self.uri).st_size, None
        from botocore.exceptions import BotoCoreError, ClientError  # boto3: as in `download`

        bucket, key = parse_s3_uri(self.uri, require_key=True)
        try:
            head = make_client(self.endpoint_url).head_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as err:
            raise StorageError(f"{self.uri}: cannot look it up: {err}") from err
        return head["ContentLength"], (head.get("Metadata") or {}).get(META_SHA256)

    def copy_folder(self, target: "Location", last: str | None = None) -> None:
        """Copy this folder, everything below it, to the folder `target` (replaced), the file `last` at its top
        copied last: a reader that takes a folder as whole once it has `last` (a checkpoint folder its
        `checkpoint.pt`) never takes a half copy. Locally the copy is made beside `target` and renamed into place."""
        if self.local and target.local:
            staging = Path(target.uri).with_name(f".{Path(target.uri).name}.partial")
            shutil.rmtree(staging, ignore_errors=True)
            staging.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(self.uri, staging)
            shutil.rmtree(target.uri, ignore_errors=True)
            os.replace(staging, target.uri)
            return
        (src_fs, src), (dst_fs, dst) = self.filesystem, target.filesystem
        # Replaced: emptied first, so that no file of an older copy stays and, until `last` lands, a reader takes
        # the folder as incomplete rather than an older `last` with the new files beside it.
        target.delete_folder()
        with self._errors("copy it"):
            infos = src_fs.get_file_info(pafs.FileSelector(src, recursive=True))
            files = sorted((i.path for i in infos if i.type == pafs.FileType.File),
                           key=lambda path: path == f"{src}/{last}")
            for path in files:
                to = f"{dst}/{path[len(src):].lstrip('/')}"
                if target.local:  # S3 has no folders to make; a local copy's parents must exist
                    os.makedirs(os.path.dirname(to), exist_ok=True)
                pafs.copy_files(path, to, source_filesystem=src_fs, destination_filesystem=dst_fs)

    def download(self, target: str | os.PathLike) -> Path:
        """A copy of this file at `target`, written atomically; from S3 its size and the sha256 that `upload_file`
        stores are checked first (S3VerificationError, `target` left as it was)."""
        if self.local:
            if not self.exists():
                raise StorageError(f"{self.uri}: no such file")
            with open(self.uri, "rb") as source:  # streamed: a store's data file or a checkpoint can be large
                return atomic_write(target, lambda f: shutil.copyfileobj(source, f, 8 * MiB))
        from boto3.exceptions import RetriesExceededError  # boto3: only for S3 objects
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, key = parse_s3_uri(self.uri, require_key=True)
        client = make_client(self.endpoint_url)
        path = Path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as tmp:
            part = Path(tmp) / path.name
            try:
                head = client.head_object(Bucket=bucket, Key=key)
                client.download_file(bucket, key, str(part))
            # RetriesExceededError: a transfer whose reads kept failing (a connection that keeps dropping)
            except (ClientError, BotoCoreError, RetriesExceededError) as err:
                cause = getattr(err, "last_exception", None) or err  # "Max Retries Exceeded" names no cause
                raise S3TransferError(f"download of {self.uri} failed: {cause}") from err
            sha_hex, size, _ = _digests(part, 8 * MiB)
            _verify(head, self.uri, sha_hex, size)
            os.replace(part, path)
        return path


# S3 endpoint (None: AWS) -> whether it ignored the conditions of a PUT (`_ignores_conditions`), probed once a process
CONDITIONS_IGNORED: dict[str | None, bool] = {}


def _ignores_conditions(client, bucket: str, key: str, body: bytes) -> bool:
    """Whether the server writes over an object that a PUT's condition said must not be there (`IfNoneMatch="*"`) or
    must have another ETag (`IfMatch`): AWS S3 and moto answer 412, some S3-compatible servers write. The probe is on
    the object this process has just created, with its own bytes: a server that ignores them rewrites it unchanged."""
    from botocore.exceptions import BotoCoreError, ClientError  # boto3: as in `download`

    for condition in ({"IfNoneMatch": "*"}, {"IfMatch": '"a2-condition-probe"'}):
        try:
            client.put_object(Bucket=bucket, Key=key, Body=body, **condition)
        except ClientError:
            continue  # refused: 412, 409, or a server that rejects the header itself; either way nothing written
        except BotoCoreError:
            return False  # unreachable now: not known to ignore them
        return True
    return False


def open_location(uri: str | os.PathLike, endpoint_url: str | None = None) -> Location:
    """A local path (made absolute; `file://` accepted) or an `s3://bucket/prefix` URI as a `Location`."""
    uri = str(uri)
    if uri.startswith("s3a://"):
        uri = "s3://" + uri[len("s3a://"):]
    if uri.startswith("s3://"):
        parse_s3_uri(uri)
        return Location(uri.rstrip("/") if uri.count("/") > 3 else uri, endpoint_url)
    if "://" in uri and not uri.startswith("file://"):
        raise StorageError(f"unsupported storage {uri!r}: a local path or s3://bucket/prefix")
    return Location(os.path.abspath(os.path.expanduser(uri.removeprefix("file://"))), endpoint_url)


# -- verified transfers (boto3) ----------------------------------------------------------------------------------
def make_client(endpoint_url: str | None = None, *, max_attempts: int = 5):
    """An S3 client whose every request botocore retries (standard mode: 5xx, throttling, connection errors)."""
    # boto3: only for S3 (pyarrow's filesystems do local folders; `a2 study plan` reads a local study through here)
    import boto3
    from botocore.config import Config

    endpoint = s3_endpoint(endpoint_url)
    options: dict = {"retries": {"mode": "standard", "total_max_attempts": max_attempts}}  # attempts, not retries
    if endpoint.url is not None:  # S3-compatible servers (MinIO, moto, Ceph) address buckets by path, not host name
        options["s3"] = {"addressing_style": "path"}
    return boto3.session.Session().client("s3", endpoint_url=endpoint.url, region_name=endpoint.region,
                                          config=Config(**options))


def stored_object(uri: str, endpoint_url: str | None = None) -> dict | None:
    """The object at `uri` as a HEAD request sees it: {"size", "sha256" (the digest `upload_file` records with an
    object, None for one written otherwise), "etag"}; None when there is none. A HEAD that S3 answers with anything
    but "not found" (no permission, unreachable) is a StorageError: an object that may be there is never taken for
    none."""
    from botocore.exceptions import BotoCoreError, ClientError  # boto3: as in `make_client`

    bucket, key = parse_s3_uri(uri, require_key=True)
    try:
        head = make_client(endpoint_url).head_object(Bucket=bucket, Key=key)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise StorageError(f"cannot look up {uri}: {err}") from None
    except BotoCoreError as err:
        raise StorageError(f"cannot look up {uri}: {err}") from None
    modified = head.get("LastModified")
    return {"size": head.get("ContentLength"), "sha256": (head.get("Metadata") or {}).get(META_SHA256),
            "etag": head.get("ETag"), "modified": modified and modified.strftime("%Y-%m-%d %H:%M:%S UTC")}


def same_bytes(stored: dict | None, path: str | os.PathLike, sha256: str, size: int) -> bool:
    """Whether the object `stored_object` saw holds the bytes of local file `path` (its `sha256` and `size`): by the
    sha256 `upload_file` records; for an object another tool wrote (no sha256), by its ETag when that is the MD5 of
    its bytes (a single-part upload's, no '-N' of a multipart one). Anything else counts as other bytes."""
    if stored is None or stored["size"] != size:
        return False
    if stored["sha256"]:
        return stored["sha256"] == sha256
    etag = (stored.get("etag") or "").strip('"')
    if not re.fullmatch(r"[0-9a-f]{32}", etag):  # multipart ("<md5 of part md5s>-N"), or not an MD5 at all
        return False
    md5 = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(8 * MiB):
            md5.update(block)
    return md5.hexdigest() == etag


def _digests(path: Path, part_size: int) -> tuple[str, int, str]:
    """(sha256 hex, size, S3's composite checksum: base64 sha256 of the parts' sha256 digests) of a file."""
    whole, parts, size = hashlib.sha256(), [], 0
    with open(path, "rb") as f:
        while block := f.read(part_size):
            whole.update(block)
            parts.append(hashlib.sha256(block).digest())
            size += len(block)
    return whole.hexdigest(), size, base64.b64encode(hashlib.sha256(b"".join(parts)).digest()).decode()


def _verify(head: dict, uri: str, sha_hex: str, size: int, composite: str | None = None) -> None:
    """The object's size, stored sha256 (when it has one) and S3 checksum (when asked for: of the whole object,
    or of its parts' digests after a multipart upload) against the local bytes'."""
    problems = []
    if head.get("ContentLength") != size:
        problems.append(f"size {head.get('ContentLength')} != local {size}")
    stored = (head.get("Metadata") or {}).get(META_SHA256)
    if stored and stored != sha_hex:
        problems.append(f"metadata sha256 {stored} != local {sha_hex}")
    checksum = head.get("ChecksumSHA256")  # "<b64>" of a single PUT, "<b64 of the parts' digests>-N" multipart
    if checksum and checksum.split("-")[0] not in (base64.b64encode(bytes.fromhex(sha_hex)).decode(), composite):
        problems.append(f"ChecksumSHA256 {checksum} does not match the local data")
    if problems:
        raise S3VerificationError(f"{uri}: " + "; ".join(problems))


def _error_code(err: BaseException) -> str | None:
    """The S3 error code of `err` or of the ClientError it was raised from or while handling (boto3's managed
    transfer raises S3UploadFailedError in its `except ClientError`, without `from`)."""
    while err is not None:
        code = getattr(err, "response", {}).get("Error", {}).get("Code")
        if code:
            return code
        err = err.__cause__ or err.__context__
    return None


def upload_file(local_path: str | os.PathLike, s3_uri: str, *, endpoint_url: str | None = None, client=None,
                max_attempts: int = 5, part_size: int = 8 * MiB, if_absent: bool = False,
                if_match: str | None = None) -> dict:
    """Upload `local_path` to `s3_uri` (a URI ending in `/` gets the file name), verified; returns {"bucket", "key",
    "uri", "size", "sha256", "etag"}. Multipart above `part_size`, SHA-256 checksums on every request and in the
    metadata, `max_attempts` per request; a failed or unverified upload leaves nothing of its own behind.

    Conditional (S3's conditional writes, on the single PUT or on a multipart upload's complete): `if_absent` only
    if no object is there (`If-None-Match: *`), `if_match` only over the object with that ETag (`If-Match`); an
    object not as expected is UploadConflict, nothing written over it."""
    from boto3.exceptions import S3UploadFailedError  # boto3: as in `make_client`
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    path = Path(local_path)
    if not path.is_file():
        raise StorageError(f"no such file to upload: {path}")
    bucket, key = parse_s3_uri(s3_uri)
    if not key or key.endswith("/"):
        key += path.name
    uri = f"s3://{bucket}/{key}"
    client = client or make_client(endpoint_url, max_attempts=max_attempts)
    # the parts s3transfer cuts (its ChunksizeAdjuster): `part_size` kept within S3's 5 MiB to 5 GiB, doubled while
    # over 10,000 parts (a file above 78 GiB at 8 MiB); the composite checksum is of those parts' digests
    cut = min(max(part_size, 5 * MiB), 5 * 1024 * MiB)
    while cut * 10_000 < path.stat().st_size:
        cut *= 2
    sha_hex, size, composite = _digests(path, cut)
    token = uuid.uuid4().hex
    extra = {"Metadata": {META_SHA256: sha_hex, META_TOKEN: token}, "ChecksumAlgorithm": "SHA256"}
    # the package's results.zip and leaderboard.json, a report's page: served as what they are (S3's default,
    # binary/octet-stream, makes a browser download the leaderboard instead of showing it)
    if (kind := mimetypes.guess_type(path.name)[0]) is not None:
        extra["ContentType"] = kind
    config = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size, use_threads=False)
    condition = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": if_match} if if_match else {}

    def conditional(params, **_):  # the managed transfer's upload arguments do not take them (s3transfer 0.17)
        params.update(condition)

    def conflict(err: BaseException) -> str | None:
        """The S3 code of a condition that did not hold: 412, 409 (a conditional write to the key in flight), 404
        under If-Match (removed)."""
        code = _error_code(err) if condition else None
        return code if code in ("PreconditionFailed", "ConditionalRequestConflict") or (
            if_match and code == "NoSuchKey") else None

    def ours() -> bool:
        with contextlib.suppress(ClientError, BotoCoreError):  # no object (404), or unreachable: not ours
            return (client.head_object(Bucket=bucket, Key=key).get("Metadata") or {}).get(META_TOKEN) == token
        return False

    hooks = [(f"before-parameter-build.s3.{op}", f"a2-condition-{token}-{op}")
             for op in ("PutObject", "CompleteMultipartUpload") if condition]
    for event, hook_id in hooks:
        client.meta.events.register(event, conditional, unique_id=hook_id)
    try:
        try:
            client.upload_file(str(path), bucket, key, ExtraArgs=extra, Config=config)
        except (ClientError, S3UploadFailedError) as err:
            # a retried write whose first try landed (its answer lost) fails its own condition: the object is ours
            if not (conflict(err) and ours()):
                raise
        head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        _verify(head, uri, sha_hex, size, composite)
    except BaseException as err:  # interrupted too: no partial or unverified object of ours stays
        if ours():
            with contextlib.suppress(ClientError, BotoCoreError):  # unreachable: nothing can be removed
                client.delete_object(Bucket=bucket, Key=key)  # ours only, never someone else's object
        if code := conflict(err):
            what = "an object appeared there" if if_absent else f"it no longer holds the object with ETag {if_match}"
            raise UploadConflict(uri, f"upload of {path} to {uri} refused: {what} (S3 {code}): another writer "
                                      f"wrote it meanwhile; nothing was written over it") from err
        if isinstance(err, (ClientError, BotoCoreError, S3UploadFailedError)):
            raise S3TransferError(f"upload of {path} to {uri} failed: {err}") from err
        raise
    finally:
        for event, hook_id in hooks:  # a caller's client is left as it came
            client.meta.events.unregister(event, unique_id=hook_id)
    return {"bucket": bucket, "key": key, "uri": uri, "size": size, "sha256": sha_hex, "etag": head.get("ETag")}


# -- compare-and-swap (launch.lease: one writer per study) --------------------------------------------------------
# Every change of a study's lease after its creation (a take-over, a heartbeat, a release) is conditional on the
# version its writer read, so that a writer frozen (SIGSTOP, a long GC) between its read and its write cannot, once it
# runs again, replace or remove a lease written meanwhile. S3: conditional requests (`IfMatch`: HTTP 412, or 409 for
# a concurrent one, when the object changed). Disk, a shared POSIX filesystem too: rename and link cannot compare a
# file's content and replace it in one step, so the compare and the write both happen under an exclusive flock(2) on
# a lock file beside it, removed with the file by its holder (a locker then checks that the name still names the file
# it locked, else locks the new one: two processes never hold two different lock files). The kernel drops the lock
# when its process dies; one frozen while holding it holds off the others (they give up after CAS_LOCK_WAIT s),
# never lets them through. flock, not fcntl's locks: two opens in one process exclude each other
# (two leases of one study in one process, as tests have); NFS emulates it with byte-range locks across hosts.
CAS_LOCK_WAIT = 10.0  # seconds a compare-and-swap on disk waits for another process's to end


def _content_version(data: bytes) -> str:
    """A file's version on disk: the digest of its bytes (a lease's text names its holder and heartbeat, so the
    same text is the same lease)."""
    return hashlib.sha256(data).hexdigest()


def _s3_condition_failed(err) -> bool:
    """A conditional S3 request refused because the object changed, is being changed, or is gone."""
    return _error_code(err) in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404")


@functools.lru_cache(maxsize=8)
def _cached_client(url: str | None, region: str | None):
    return make_client(url)


def _cas_client(endpoint_url: str | None):
    """An S3 client kept for the endpoint (as resolved now, with its region): a lease's heartbeat asks every few
    seconds, and making a client takes a third of a second of CPU. boto3's clients are safe to share between
    threads; credentials that expire are refreshed by botocore inside the client."""
    endpoint = s3_endpoint(endpoint_url)
    return _cached_client(endpoint.url, endpoint.region)


@contextlib.contextmanager
def _cas_lock(location: Location):
    """The exclusive lock of the local file `location`'s compare-and-swaps (`.<name>.lock` beside it): yields the
    lock file's path, which the holder may remove (`delete_if_unchanged`, with the file) before it lets go."""
    import fcntl  # POSIX only; a lease on disk is the only user
    import time

    path = os.path.join(os.path.dirname(location.uri), f".{os.path.basename(location.uri)}.lock")
    deadline = time.monotonic() + CAS_LOCK_WAIT
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # read-only, full, not allowed
            raise WriteRefused(path, err.strerror or str(err)) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:  # not removed by its holder before we locked it
                    break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise StorageError(f"{path}: locked by another process for over {CAS_LOCK_WAIT:g} s (one stopped "
                                   f"while changing {location.uri}?); end that process, or try again") from None
            time.sleep(0.05)
        os.close(fd)
    try:
        yield path
    finally:
        os.close(fd)  # releases the lock


def read_versioned(location: Location) -> tuple[str | None, str | None]:
    """(text, version) of the file at `location`, (None, None) when there is none; the text decoded with
    errors="replace" (a damaged lease reads as not JSON, not a traceback). The version is what
    `replace_if_unchanged` and `delete_if_unchanged` compare: on S3 the object's ETag (from the same GET as the
    text), on disk the digest of its bytes."""
    if location.local:
        data = location.read_bytes()
        return (None, None) if data is None else (data.decode("utf-8", "replace"), _content_version(data))
    from botocore.exceptions import BotoCoreError, ClientError  # boto3: as in `download`

    bucket, key = parse_s3_uri(location.uri, require_key=True)
    try:
        got = _cas_client(location.endpoint_url).get_object(Bucket=bucket, Key=key)
        return got["Body"].read().decode("utf-8", "replace"), got["ETag"]
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None, None
        raise StorageError(f"{location.uri}: cannot read it: {err}") from None
    except BotoCoreError as err:
        raise StorageError(f"{location.uri}: cannot read it: {err}") from None


def replace_if_unchanged(location: Location, version: str | None, text: str) -> str | None:
    """Write `text` over the file at `location` only while it is still the `version` read (`read_versioned`), at
    once (a reader never sees half): its new version, or None when it changed since or is gone (nothing written).
    A write the storage refuses is `WriteRefused`."""
    if location.local:
        if location.read_bytes() is None:  # gone (its folder too, where no lock file can be made): not `version`
            return None
        with _cas_lock(location):
            data = location.read_bytes()
            if data is None or _content_version(data) != version:
                return None
            location.write_text(text)
        return _content_version(text.encode("utf-8"))
    from botocore.exceptions import BotoCoreError, ClientError  # boto3: as in `download`

    bucket, key = parse_s3_uri(location.uri, require_key=True)
    try:
        put = _cas_client(location.endpoint_url).put_object(Bucket=bucket, Key=key, Body=text.encode("utf-8"),
                                                            IfMatch=version or '"none"')
    except ClientError as err:
        if _s3_condition_failed(err):
            return None
        raise WriteRefused(location.uri, str(err)) from err
    except BotoCoreError as err:
        raise WriteRefused(location.uri, str(err)) from err
    return put["ETag"]


def delete_if_unchanged(location: Location, version: str | None) -> bool:
    """Remove the file at `location` only while it is still the `version` read (`read_versioned`): False when it
    changed since or is gone (nothing removed)."""
    if location.local:
        if location.read_bytes() is None:  # gone (its folder too, where no lock file can be made): not `version`
            return False
        with _cas_lock(location) as lock:
            data = location.read_bytes()
            if data is None or _content_version(data) != version:
                return False
            location.delete()
            os.unlink(lock)  # still held: no lock file outlives the file (a released study's folder is empty)
        return True
    from botocore.exceptions import BotoCoreError, ClientError  # boto3: as in `download`

    bucket, key = parse_s3_uri(location.uri, require_key=True)
    try:
        _cas_client(location.endpoint_url).delete_object(Bucket=bucket, Key=key, IfMatch=version or '"none"')
    except ClientError as err:
        if _s3_condition_failed(err):
            return False
        raise StorageError(f"{location.uri}: cannot delete it: {err}") from None
    except BotoCoreError as err:
        raise StorageError(f"{location.uri}: cannot delete it: {err}") from None
    return True
