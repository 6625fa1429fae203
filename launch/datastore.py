"""Region features on every node of a cluster: `a2 data push` / `a2 data fetch` move a prepared store (see
`a2core.data.prepared`) through the storage layer, and `check_feature_copies` refuses to start a study when an
alive node's copy is missing or differs from the driver's. `a2 data synth` (the synthetic COCO) is handled here too.

`fetch` is what ray-cluster.yaml's setup commands run on every node as it starts, spot workers that join mid-study
included: it reads the store's manifest, skips when the node holds that version already (a `.verified` stamp that
only a full SHA-256 check writes), else downloads the data files beside the target, checks every SHA-256 against the
manifest, and swaps the verified folder in whole. A trial that still reads the old copy keeps its open files.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from a2core.atomic import atomic_write, building_folder, check_replaceable, clear_dead_building_folders, replace_folder
from a2core.data import prepared
from a2core.errors import DataError, StudyError
from launch.fingerprint import file_fingerprint
from launch.storage import open_location, upload_file

STAMP = ".verified"  # in a store folder: the checksum whose data files `fetch` (or `verify`) hashed in full
PROBE_TIMEOUT_S = 120.0


def _say(text: str, quiet: bool) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)


def _is_verified(folder: Path, checksum: str) -> bool:
    """`folder` holds the store `checksum`, hashed in full once (stamp) and with its files' sizes still right."""
    try:
        if (folder / STAMP).read_text().strip() != checksum:
            return False
        prepared.check_copy(folder, expected=checksum)
        return True
    except (OSError, DataError):
        return False


def verify(folder: str | os.PathLike) -> dict:
    """Hash a local store in full against its manifest and stamp it as verified; returns the manifest."""
    folder = Path(folder)
    manifest = prepared.check_copy(folder, full=True)
    atomic_write(folder / STAMP, manifest["checksum"] + "\n")
    return manifest


def push(folder: str | os.PathLike, uri: str, *, endpoint_url: str | None = None, quiet: bool = False) -> dict:
    """Upload a local store to `uri` (s3://bucket/prefix/NAME.a2feat), data files first (each verified by the
    storage layer), the manifest last: a reader that sees the manifest finds the files it names, each with the SHA-256
    the manifest gives it (a file written to after push checked the store: DataError, no manifest). A manifest of
    another version already there is deleted before the first upload, so that a push interrupted half-way leaves no
    manifest naming files that are no longer its own. Returns the store's manifest with the "uri" written; a plain
    file (captions, an image list) is uploaded as one ({"sha256", "uri"}; a URI ending in `/` gets its name)."""
    folder = Path(folder)
    target = open_location(uri, endpoint_url)
    if target.local:
        raise DataError(f"{uri}: push uploads to s3://; copy a local store with `a2 data fetch`")
    if folder.is_file():
        into = str(uri).endswith("/") and not target.uri.endswith("/")  # open_location drops the slash
        sent = upload_file(folder, target.uri + "/" if into else target.uri, endpoint_url=endpoint_url)
        return {"sha256": sent["sha256"], "uri": sent["uri"]}
    if not folder.exists():
        raise DataError(f"{folder}: no such file or feature store")
    manifest = prepared.check_copy(folder, full=True)
    with contextlib.suppress(OSError):  # a store on a read-only disk is pushed all the same, unstamped
        atomic_write(folder / STAMP, manifest["checksum"] + "\n")
    remote = target.join(prepared.MANIFEST)
    text = remote.read_text(errors="replace")
    if text is not None and _checksum_of(text) != manifest["checksum"]:
        _say(f"delete {remote} (another version's manifest: until the upload is done, {target} is no store)", quiet)
        remote.delete()
    for name in (*sorted(manifest["files"]), prepared.MANIFEST):
        _say(f"upload {folder / name} -> {target.join(name)}", quiet)
        sent = upload_file(folder / name, target.join(name).uri, endpoint_url=endpoint_url)
        if name in manifest["files"] and sent["sha256"] != manifest["files"][name]["sha256"]:
            # written to after the check above: a manifest naming it would send every fetch to a SHA-256 mismatch
            target.join(name).delete()
            remote.delete()  # a re-push of this version found its manifest there: it would name the file just removed
            with contextlib.suppress(OSError):  # nor is the local store a verified copy any longer
                (folder / STAMP).unlink(missing_ok=True)
            raise DataError(f"{folder / name}: changed since the store was checked (its SHA-256 is no longer the "
                            f"manifest's), so {target} was left without a manifest (no store) and that file not "
                            f"uploaded; write nothing into a store while it is pushed: make it again with "
                            f"`a2 data prepare` and push it again")
    return {**manifest, "uri": target.uri}


def _checksum_of(manifest_text: str) -> str | None:
    """The checksum a stored manifest names, None when it is not a readable manifest."""
    try:
        return prepared.parse_manifest(manifest_text, prepared.MANIFEST)["checksum"]
    except DataError:
        return None


# What a machine that cannot take the copy says: full, over quota, a file too large, read-only, not allowed.
_CANNOT_WRITE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})


@contextlib.contextmanager
def _writing(target: Path, source):
    """A copy this machine cannot write as one DataError naming `target`: not a traceback (a write error names no
    file), nor a temp file's name, nor the source's (shutil's copy names the file it read for a full disk). A local
    source that cannot be read keeps its own error, which names it."""
    try:
        yield
    except OSError as err:
        if err.errno not in _CANNOT_WRITE:
            raise
        if (err.errno in (errno.EACCES, errno.EPERM) and source.local and err.filename is not None
                and Path(os.fsdecode(err.filename)).is_relative_to(source.uri)):
            raise
        raise DataError(f"{target}: cannot write the copy there ({err.strerror or err}); nothing was "
                        f"replaced") from err


def _clear_leftovers(target: Path) -> None:
    """Remove what a fetch of `target` killed on this host left beside it: a half-made copy (`.fetch`), or the copy
    it replaced, swapped out under the `.fetch` name (or, where the swap takes two renames, moved aside as `.old`).
    Either may be a verified copy: no later fetch that downloads nothing would otherwise look."""
    for suffix in (".fetch", ".old"):
        clear_dead_building_folders(target, suffix)


@contextlib.contextmanager
def _locked(target: Path):
    """One fetch per target at a time on a machine (a setup command and a hand-run one may meet)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def fetch(uri: str, target: str | os.PathLike, *, endpoint_url: str | None = None, quiet: bool = False) -> dict:
    """Make `target` a verified copy of the store at `uri` (s3://... or a local folder); returns
    {"checksum", "target", "fetched": bool}. Nothing is downloaded when `target` holds that version already.
    A `uri` that is a plain file (captions, an image list) is fetched as one (`_fetch_file`)."""
    source = open_location(uri, endpoint_url)
    given = Path(os.path.expanduser(str(target))).absolute()
    # a target that is a link (data kept on a bigger disk) is replaced where it points, the link kept: renamed aside
    # onto an empty folder, a link is "Is a directory", and the copy would land beside the link
    target = Path(os.path.realpath(given)) if given.is_symlink() else given
    where = source.join(prepared.MANIFEST)
    if not where.exists() and source.exists() and not source.is_folder():
        return _fetch_file(source, target, given, quiet)
    text = where.read_text()
    if text is None and not source.is_folder():  # neither a file nor a store: a typo'd URI, named as given
        raise DataError(f"{source}: no such file or feature store")
    if text is None:
        raise DataError(f"{where}: no such file (not a prepared feature store, or one whose `a2 data push` did not "
                        f"finish; make one with `a2 data prepare` and upload it with `a2 data push`)")
    manifest = prepared.parse_manifest(text, where)
    checksum = manifest["checksum"]
    with _writing(target, source), _locked(target):
        _clear_leftovers(target)
        if _is_verified(target, checksum):
            _say(f"{target}: holds store {checksum[:12]} already (verified); nothing to fetch", quiet)
            return {"checksum": checksum, "target": str(given), "fetched": False}
        check_replaceable(target, (prepared.MANIFEST,), "feature store")  # an older store is replaced whole below
        tmp = building_folder(target, ".fetch")
        try:
            for name, entry in sorted(manifest["files"].items()):
                started = time.monotonic()
                _say(f"fetch {source.join(name)} ({entry['size'] / 2**30:.2f} GiB) -> {target}", quiet)
                if source.local:
                    shutil.copyfile(Path(source.uri) / name, tmp / name)
                else:
                    source.join(name).download(tmp / name)
                if prepared.file_sha256(tmp / name) != entry["sha256"]:
                    raise DataError(f"{source.join(name)}: SHA-256 differs from its manifest's (a damaged or "
                                    f"replaced upload); {target} is left as it was")
                _say(f"  verified in {time.monotonic() - started:.0f}s", quiet)
            (tmp / prepared.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            prepared.check_copy(tmp, expected=checksum)
            (tmp / STAMP).write_text(checksum + "\n")
            os.chmod(tmp, 0o755)
            replace_folder(tmp, target)  # an older store replaced whole
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    _say(f"{target}: store {checksum[:12]} fetched and verified", quiet)
    return {"checksum": checksum, "target": str(given), "fetched": True}


def _fetch_file(source, target: Path, given: Path, quiet: bool) -> dict:
    """One plain file (the captions, an image list): downloaded into a folder beside `target` and renamed onto it
    (what a killed fetch leaves there, the next one removes) unless `target` has the same size and SHA-256 (the
    digest `a2 data push` / `upload_file` stores with an object; without one, it is downloaded)."""
    with _writing(target, source), _locked(target):
        _clear_leftovers(target)
        if target.is_dir():
            raise DataError(f"{target}: a folder, not a file to write {source} into; name another path")
        size, digest = source.stored_digest()
        if source.local and target.is_file() and target.stat().st_size == size:
            digest = prepared.file_sha256(Path(source.uri))
        if digest and target.is_file() and target.stat().st_size == size and prepared.file_sha256(target) == digest:
            _say(f"{target}: the same as {source.uri} already; nothing to fetch", quiet)
            return {"sha256": digest, "target": str(given), "fetched": False}
        _say(f"fetch {source.uri} -> {target}", quiet)
        tmp = building_folder(target, ".fetch")
        try:  # from S3 its size and stored SHA-256 are checked before it replaces `target`
            got = source.download(tmp / target.name)
            sha256 = prepared.file_sha256(got)
            os.replace(got, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return {"sha256": sha256, "target": str(given), "fetched": True}


# -- every node's copy ------------------------------------------------------------------------------------------
def describe_copy(path: str) -> dict:
    """What this machine holds at a features path: {"host", "ok", "what"}, `what` being the store's checksum, or an
    HDF5 file's size and content digest, or a `.npz` folder's file count and digest (both as `launch.fingerprint`
    takes them: sampled past a size), or the error (naming the file) that makes it unusable. Compared node by node:
    another extraction of the same size, or a folder missing files, is not the driver's copy."""
    host = socket.gethostname()
    p = Path(path)
    try:
        if prepared.is_prepared(p):
            return {"host": host, "ok": True, "what": f"store {prepared.check_copy(p)['checksum']}"}
        if p.is_file():
            got = file_fingerprint(p)
            return {"host": host, "ok": True, "what": f"file of {got['size']} bytes, {got['how']} "
                                                      f"{got['id'].rsplit(':', 1)[-1][:16]}"}
        if p.is_dir():
            got = file_fingerprint(p)
            count, digest = got["id"].split(":", 1)
            return {"host": host, "ok": True, "what": f"folder of {count} files, {got['how'].split(': ', 1)[-1]} "
                                                      f"{hashlib.sha256(digest.encode()).hexdigest()[:16]}"}
        return {"host": host, "ok": False, "what": f"{p}: missing"}
    except (OSError, DataError) as err:
        return {"host": host, "ok": False, "what": str(err)}


def _probe_nodes(function, args: tuple, timeout_s: float) -> list[tuple[dict, object]]:
    """(node, ref) for every alive node of the connected Ray cluster, `function(*args)` run there as a zero-CPU task
    pinned to it (so busy nodes answer too); ref None when it did not answer within `timeout_s` (cancelled)."""
    # ray: only the driver's probes of its nodes, not `a2 data fetch|push` (a node's setup runs fetch)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0, max_retries=0)(function)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = {n["NodeID"]: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(*args) for n in nodes}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for ref in set(refs.values()) - set(ready):
        ray.cancel(ref, force=True)
    return [(node, refs[node["NodeID"]] if refs[node["NodeID"]] in ready else None) for node in nodes]


def check_feature_copies(path: str, timeout_s: float = PROBE_TIMEOUT_S) -> list[dict]:
    """On every alive node of the connected Ray cluster, the copy at `path` against the driver's: StudyError
    naming each node (address, host, node id) whose copy is missing, damaged or another version, and the file.
    Returns one row per node."""
    import ray

    expected = describe_copy(path)
    if not expected["ok"]:
        raise StudyError(f"data.features on the driver ({expected['host']}): {expected['what']}")
    rows, problems = [], []
    for node, ref in _probe_nodes(describe_copy, (path,), timeout_s):
        name = f"node {node.get('NodeManagerAddress')} ({node.get('NodeManagerHostname')}, id {node['NodeID'][:12]})"
        if ref is None:
            problems.append(f"{name}: did not answer within {timeout_s:.0f}s")
            continue
        try:
            got = ray.get(ref)
        except ray.exceptions.RayError as err:
            problems.append(f"{name}: the check failed ({type(err).__name__}: {err})")
            continue
        rows.append({"node": name, **got})
        if not got["ok"]:
            problems.append(f"{name}: {got['what']}")
        elif got["what"] != expected["what"]:
            problems.append(f"{name}: {path} holds {got['what']}, the driver's copy is {expected['what']}")
    if problems:
        raise StudyError(f"data.features: the region features are not the same on every node, so the study does "
                         f"not start (fetch them there: `a2 data fetch SOURCE {path}`):\n  " + "\n  ".join(problems))
    return rows


def _has_java() -> dict:
    return {"host": socket.gethostname(), "java": shutil.which("java") is not None}


def java_warnings(train: dict, timeout_s: float = 30.0) -> list[str]:
    """One line per node of the connected cluster that cannot compute a METEOR score the study reports
    (`train.test_meteor`, `train.val_meteor`): METEOR runs in Java, and a trial placed on a node without it reports
    no METEOR. Asked with a zero-CPU task pinned to each alive node, before the first trial; [] when all have Java
    or the study reports no METEOR. A node that does not answer in time is not named (the features check waits)."""
    metrics = [m for m, key in (("test/METEOR", "test_meteor"), ("val/METEOR", "val_meteor")) if train.get(key)]
    if not metrics:
        return []
    import ray

    answers = [(node, ray.get(ref)) for node, ref in _probe_nodes(_has_java, (), timeout_s) if ref is not None]
    return [f"node {node.get('NodeManagerAddress')} ({got['host']}) has no Java: {' and '.join(metrics)} cannot be "
            f"computed there, and a trial placed there reports none (install a Java runtime on it: ray-cluster.yaml's "
            f"setup commands do)" for node, got in answers if not got["java"]]
