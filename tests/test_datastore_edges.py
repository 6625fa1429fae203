"""`a2 data push` / `a2 data fetch` at their edges, against moto's S3 server (tests/s3server.py): a fetch killed at
each point of its work (a real SIGKILL of a process), fetches that meet on one node, a push interrupted before its
manifest, a manifest whose objects are not the ones it lists, URIs with a trailing slash, spaces and non-ASCII
names, a disk that is full or read-only. Needs no Ray."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

from a2core import atomic
from a2core.data import features, prepared
from a2core.errors import A2Error, DataError
from launch import datacopies, datastore
from launch.cli import main
from tests.s3server import s3_client, unique_bucket

ROOT = Path(__file__).resolve().parents[1]
LOCK = ".features.a2feat.lock"


def _store(path: Path, seed: int, images: int = 20, dim: int = 16) -> dict:
    """A small prepared store at `path` (its HDF5 source beside it); its manifest."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path.with_suffix(".h5"), "w") as f:
        for i in range(images):
            f[f"{i + 1}_features"] = rng.random((int(rng.integers(2, 6)), dim), dtype=np.float32)
    return features.prepare(path.with_suffix(".h5"), path, feature_dim=dim)


def _keys(endpoint: str, bucket: str) -> list[str]:
    """The bucket's objects, without folder markers (`prefix/`: pyarrow makes one where it deletes a file)."""
    listed = s3_client(endpoint).list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(o["Key"] for o in listed if not o["Key"].endswith("/"))


# A fetch in a process of its own that stops at one point of its work (prints PAUSED) until it is SIGKILLed.
KILLED_FETCH = r"""
import os, sys, time
from pathlib import Path
from a2core.data import prepared
from launch import datastore, storage

uri, target, endpoint, point = sys.argv[1:5]
target = Path(target)

def pause(*_):
    print("PAUSED", flush=True)
    time.sleep(60)

if point == "download":  # a store's first file downloaded beside the target, not yet hashed
    real_sha = prepared.file_sha256
    prepared.file_sha256 = lambda p, *a, **k: pause() if ".fetch" in str(p) else real_sha(p, *a, **k)
elif point == "swap":  # where the swap takes two renames (NFS, macOS): the old copy moved aside, the new one not
    from a2core import atomic  # yet renamed into its place
    atomic._exchange = lambda a, b: False
    real_rename = os.rename
    def rename(a, b):
        real_rename(a, b)
        if Path(a) == target:
            pause()
    os.rename = rename
elif point == "cleanup":  # the new copy in place, the old one (swapped out under the `.fetch` name) half removed
    real_rmtree = datastore.shutil.rmtree
    def rmtree(p, *a, **k):
        if str(p).endswith((".old", ".fetch")):
            os.remove(sorted(Path(p).iterdir())[0])
            pause()
        return real_rmtree(p, *a, **k)
    datastore.shutil.rmtree = rmtree
elif point == "file":  # a plain file half downloaded (S3) or half copied (a local source)
    storage._digests = pause
    real_write = storage.atomic_write
    storage.atomic_write = lambda path, data: real_write(path, lambda f: (data(f), f.flush(), pause()))
datastore.fetch(uri, target, endpoint_url=endpoint or None, quiet=True)
print("FINISHED", flush=True)
"""


def _kill_fetch_at(point: str, uri: str, target: Path, endpoint: str = "") -> None:
    """Run a fetch in a process of its own and SIGKILL it at `point`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_FETCH, uri, str(target), endpoint, point], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "PAUSED", (line, proc.stderr.read() if proc.poll() is not None else "")
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def pushed_twice(s3_endpoint, tmp_path):
    """A node holding store v1 (verified), and v2 pushed since to the same URI: (uri, target, v1, v2)."""
    bucket = unique_bucket(s3_endpoint, "edges")
    uri = f"s3://{bucket}/coco/features.a2feat"
    v1, v2 = _store(tmp_path / "v1.a2feat", seed=1), _store(tmp_path / "v2.a2feat", seed=2)
    target = tmp_path / "node" / "features.a2feat"
    datastore.push(tmp_path / "v1.a2feat", uri, endpoint_url=s3_endpoint, quiet=True)
    datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)
    datastore.push(tmp_path / "v2.a2feat", uri, endpoint_url=s3_endpoint, quiet=True)
    return uri, target, v1, v2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", ["download", "swap", "cleanup"])
def test_a_fetch_killed_anywhere_leaves_no_copy_taken_as_whole_and_nothing_behind(s3_endpoint, pushed_twice, point):
    """Killed while downloading, between moving the old copy aside and renaming the new one in (where the swap takes
    two renames), or while removing the old one: the next fetch ends with the new version verified and nothing of the killed one beside it (a kill
    at the swap or the cleanup used to leave a whole hidden copy of the store there for good)."""
    uri, target, v1, v2 = pushed_twice
    _kill_fetch_at(point, uri, target, s3_endpoint)
    left = sorted(os.listdir(target.parent))
    assert len(left) == 3 and LOCK in left, left  # the killed fetch's folder (and the copy, or the old one)
    if point == "download":  # the node's copy untouched
        assert prepared.check_copy(target, full=True, expected=v1["checksum"])
    if point == "swap":  # no copy at all: nothing half-made stands at the target
        assert not target.exists()
    got = datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)
    assert got["checksum"] == v2["checksum"] and got["fetched"] is (point != "cleanup")
    assert prepared.check_copy(target, full=True, expected=v2["checksum"])
    assert sorted(os.listdir(target.parent)) == [LOCK, "features.a2feat"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("local", [False, True], ids=["s3", "local"])
def test_a_plain_file_fetch_killed_mid_copy_leaves_nothing_behind(s3_endpoint, tmp_path, local):
    """The half-downloaded captions of a killed fetch were left as a hidden file (or folder) beside the target that
    no later fetch removed."""
    captions = tmp_path / "dataset_coco.json"
    captions.write_text(json.dumps({"images": list(range(2000))}))
    if local:
        uri = str(captions)
    else:
        uri = f"s3://{unique_bucket(s3_endpoint, 'edges')}/coco/dataset_coco.json"
        datastore.push(captions, uri, endpoint_url=s3_endpoint, quiet=True)
    target = tmp_path / "node" / "dataset_coco.json"
    _kill_fetch_at("file", uri, target, "" if local else s3_endpoint)
    assert not target.exists() and len(os.listdir(target.parent)) == 2  # the lock, the killed fetch's leftover
    assert datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)["fetched"] is True
    assert target.read_bytes() == captions.read_bytes()
    assert sorted(os.listdir(target.parent)) == [".dataset_coco.json.lock", "dataset_coco.json"]


@pytest.mark.parametrize("swap", ["one-call", "two-renames"])
def test_a_fetch_that_fails_at_the_swap_keeps_the_old_copy(s3_endpoint, pushed_twice, monkeypatch, swap):
    """An error (or Ctrl-C) after the old copy was moved aside put the new copy away and left the node with none
    (the two renames of a file system without renameat2's exchange); at the one-call swap, the old copy stays."""
    uri, target, v1, _ = pushed_twice
    real_rename = os.rename

    def rename(a, b):
        if str(a).endswith(".fetch"):
            raise KeyboardInterrupt
        return real_rename(a, b)

    def exchange(a, b):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "_exchange", exchange if swap == "one-call" else lambda a, b: False)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)
    monkeypatch.undo()
    assert prepared.check_copy(target, full=True, expected=v1["checksum"])
    assert sorted(os.listdir(target.parent)) == [LOCK, "features.a2feat"]


def test_fetches_that_meet_on_one_node_download_once(s3_endpoint, tmp_path):
    """Three trials' fetches of one store (and of one file) at once: one downloads, the others wait for it and find
    the verified copy; nothing else is left beside it. (Held before: this guards it.)"""
    bucket = unique_bucket(s3_endpoint, "edges")
    v1 = _store(tmp_path / "v1.a2feat", seed=1)
    captions = tmp_path / "dataset_coco.json"
    captions.write_text('{"images": []}')
    store_uri = f"s3://{bucket}/features.a2feat"
    datastore.push(tmp_path / "v1.a2feat", store_uri, endpoint_url=s3_endpoint, quiet=True)
    file_uri = f"s3://{bucket}/dataset_coco.json"
    datastore.push(captions, file_uri, endpoint_url=s3_endpoint, quiet=True)
    node = tmp_path / "node"
    for uri, target in ((store_uri, node / "features.a2feat"), (file_uri, node / "dataset_coco.json")):
        fetched = []
        threads = [threading.Thread(target=lambda: fetched.append(
            datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)["fetched"])) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert sorted(fetched) == [False, False, True]
    assert prepared.check_copy(node / "features.a2feat", full=True, expected=v1["checksum"])
    assert (node / "dataset_coco.json").read_bytes() == captions.read_bytes()
    assert sorted(os.listdir(node)) == [".dataset_coco.json.lock", LOCK, "dataset_coco.json", "features.a2feat"]


def test_a_push_interrupted_before_its_manifest_leaves_no_store_that_passes(s3_endpoint, tmp_path, monkeypatch):
    """v2 pushed over v1 and stopped before the manifest: v1's manifest stayed, naming v2's files, and `a2 study
    validate --cluster` took the S3 copy for v1 (the nodes' fetches then failed). Now the old manifest goes first:
    fetch says the store is incomplete and validate asks for the push; the push once finished serves v2."""
    bucket = unique_bucket(s3_endpoint, "edges")
    uri = f"s3://{bucket}/coco/features.a2feat"
    v1, v2 = _store(tmp_path / "v1.a2feat", seed=1), _store(tmp_path / "v2.a2feat", seed=2)
    datastore.push(tmp_path / "v1.a2feat", uri, endpoint_url=s3_endpoint, quiet=True)
    real_upload = datastore.upload_file

    def killed_before_the_manifest(path, *args, **kwargs):
        if Path(path).name == prepared.MANIFEST:
            raise KeyboardInterrupt
        return real_upload(path, *args, **kwargs)

    monkeypatch.setattr(datastore, "upload_file", killed_before_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        datastore.push(tmp_path / "v2.a2feat", uri, endpoint_url=s3_endpoint, quiet=True)
    assert _keys(s3_endpoint, bucket) == [f"coco/features.a2feat/{prepared.INDEX}", f"coco/features.a2feat/{prepared.ROWS}"]
    with pytest.raises(DataError, match=r"features\.a2feat/manifest\.json: no such file \(not a prepared feature "
                                        r"store, or one whose `a2 data push` did not finish"):
        datastore.fetch(uri, tmp_path / "node" / "features.a2feat", endpoint_url=s3_endpoint, quiet=True)
    assert not (tmp_path / "node" / "features.a2feat").exists()
    copy = datacopies.ClusterCopy("data.features", uri, str(tmp_path / "v1.a2feat"), s3_endpoint)
    assert "no such store or file" in datacopies.copy_problem(copy)
    # interrupted again, pushing the version that is there: its manifest stays, the nodes keep fetching it
    monkeypatch.undo()
    datastore.push(tmp_path / "v1.a2feat", uri, endpoint_url=s3_endpoint, quiet=True)
    monkeypatch.setattr(datastore, "upload_file", killed_before_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        datastore.push(tmp_path / "v1.a2feat", uri, endpoint_url=s3_endpoint, quiet=True)
    assert datastore.fetch(uri, tmp_path / "n1", endpoint_url=s3_endpoint, quiet=True)["checksum"] == v1["checksum"]
    monkeypatch.undo()
    datastore.push(tmp_path / "v2.a2feat", uri, endpoint_url=s3_endpoint, quiet=True)
    assert datastore.fetch(uri, tmp_path / "n1", endpoint_url=s3_endpoint, quiet=True)["checksum"] == v2["checksum"]
    assert prepared.check_copy(tmp_path / "n1", full=True, expected=v2["checksum"])


def test_a_manifest_whose_objects_differ_is_named_by_validate_and_refused_by_fetch(s3_endpoint, tmp_path):
    """The manifest is v1's, rows.f16 is another store's (uploaded by hand), then index.npy is gone: `a2 study
    validate --cluster` said the copy was fine; fetch refuses both, naming the object, the node's copy untouched."""
    bucket = unique_bucket(s3_endpoint, "edges")
    uri = f"s3://{bucket}/features.a2feat"
    v1, _ = _store(tmp_path / "v1.a2feat", seed=1), _store(tmp_path / "v2.a2feat", seed=2, images=30)
    datastore.push(tmp_path / "v1.a2feat", uri, endpoint_url=s3_endpoint, quiet=True)
    target = tmp_path / "node" / "features.a2feat"
    datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)
    (target / datastore.STAMP).unlink()  # the node fetches again
    datastore.upload_file(tmp_path / "v2.a2feat" / prepared.ROWS, f"{uri}/{prepared.ROWS}", endpoint_url=s3_endpoint)
    copy = datacopies.ClusterCopy("data.features", uri, str(tmp_path / "v1.a2feat"), s3_endpoint)
    size = (tmp_path / "v2.a2feat" / prepared.ROWS).stat().st_size
    assert datacopies.copy_problem(copy) == (
        f"data.features: {uri} (the cluster's copy): {prepared.ROWS} is {size} bytes with SHA-256 "
        f"{prepared.file_sha256(tmp_path / 'v2.a2feat' / prepared.ROWS)}, its manifest says "
        f"{v1['files'][prepared.ROWS]['size']} bytes with SHA-256 {v1['files'][prepared.ROWS]['sha256']} (an "
        f"unfinished or mixed upload: every node's fetch would refuse it); upload it: a2 data push "
        f"{tmp_path / 'v1.a2feat'} {uri}")
    with pytest.raises(DataError, match=rf"^{uri}/rows\.f16: SHA-256 differs from its manifest's"):
        datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)
    s3_client(s3_endpoint).delete_object(Bucket=bucket, Key=f"features.a2feat/{prepared.INDEX}")
    assert f"its manifest lists {prepared.INDEX}, which cannot be read there" in datacopies.copy_problem(copy)
    with pytest.raises(A2Error, match=rf"{uri}/index\.npy"):
        datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)
    assert prepared.check_copy(target, full=True, expected=v1["checksum"])
    assert sorted(os.listdir(target.parent)) == [LOCK, "features.a2feat"]


def test_a_trailing_slash_spaces_and_unicode_in_uris_and_paths(s3_endpoint, tmp_path, capsys):
    """A file pushed to a prefix ending in `/` lands under it with its own name, as `upload_file` and `aws s3 cp` do
    (it was written as the object `coco`, the prefix itself, and the printed URI named nothing there). A store's URI
    means the same with and without the slash; spaces and non-ASCII in keys and local paths go through."""
    bucket = unique_bucket(s3_endpoint, "edges")
    captions = tmp_path / "my data ü" / "dataset_coco.json"
    captions.parent.mkdir()
    captions.write_text('{"images": [1]}')
    assert main(["data", "push", str(captions), f"s3://{bucket}/coco/", "--endpoint-url", s3_endpoint]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["uri"] == f"s3://{bucket}/coco/dataset_coco.json"
    assert _keys(s3_endpoint, bucket) == ["coco/dataset_coco.json"]
    node = tmp_path / "nöde with space"
    assert datastore.fetch(printed["uri"], node / "c.json", endpoint_url=s3_endpoint, quiet=True)["fetched"]
    assert (node / "c.json").read_bytes() == captions.read_bytes()
    v1 = _store(tmp_path / "my data ü" / "f ü.a2feat", seed=1)
    uri = f"s3://{bucket}/präfix with space/features.a2feat"
    datastore.push(tmp_path / "my data ü" / "f ü.a2feat", uri + "/", endpoint_url=s3_endpoint, quiet=True)
    assert f"präfix with space/features.a2feat/{prepared.MANIFEST}" in _keys(s3_endpoint, bucket)
    first = datastore.fetch(uri, node / "f ü.a2feat", endpoint_url=s3_endpoint, quiet=True)
    again = datastore.fetch(uri + "/", node / "f ü.a2feat", endpoint_url=s3_endpoint, quiet=True)
    assert (first["fetched"], again["fetched"]) == (True, False)
    assert prepared.check_copy(node / "f ü.a2feat", full=True, expected=v1["checksum"])


def test_a_stale_plain_file_of_the_same_size_is_replaced(s3_endpoint, tmp_path):
    """The node's captions are as long as the new ones but older: fetched again (held before: this guards it)."""
    bucket = unique_bucket(s3_endpoint, "edges")
    captions = tmp_path / "dataset_coco.json"
    captions.write_text('{"images": [1]}')
    uri = f"s3://{bucket}/dataset_coco.json"
    datastore.push(captions, uri, endpoint_url=s3_endpoint, quiet=True)
    target = tmp_path / "node" / "dataset_coco.json"
    datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)
    captions.write_text('{"images": [2]}')
    datastore.push(captions, uri, endpoint_url=s3_endpoint, quiet=True)
    assert datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)["fetched"] is True
    assert target.read_text() == '{"images": [2]}'


def test_a_target_that_is_a_link_is_replaced_where_it_points(tmp_path):
    """data/coco/features.a2feat a link to a bigger disk: a new version failed ("Is a directory", renaming the link
    aside onto an empty folder); now the copy is replaced where the link points and the link stays (a file too)."""
    v1, v2 = _store(tmp_path / "v1.a2feat", seed=1), _store(tmp_path / "v2.a2feat", seed=2)
    big, repo = tmp_path / "big", tmp_path / "repo"
    datastore.fetch(str(tmp_path / "v1.a2feat"), big / "features.a2feat", quiet=True)
    repo.mkdir()
    (repo / "features.a2feat").symlink_to(big / "features.a2feat")
    got = datastore.fetch(str(tmp_path / "v2.a2feat"), repo / "features.a2feat", quiet=True)
    assert got == {"checksum": v2["checksum"], "target": str(repo / "features.a2feat"), "fetched": True}
    assert (repo / "features.a2feat").is_symlink() and os.listdir(repo) == ["features.a2feat"]
    assert prepared.check_copy(big / "features.a2feat", full=True, expected=v2["checksum"])
    assert sorted(os.listdir(big)) == [LOCK, "features.a2feat"] and v1["checksum"] != v2["checksum"]
    captions = tmp_path / "dataset_coco.json"
    captions.write_text('{"images": [2]}')
    (big / "dataset_coco.json").write_text('{"images": [1]}')
    (repo / "dataset_coco.json").symlink_to(big / "dataset_coco.json")
    assert datastore.fetch(str(captions), repo / "dataset_coco.json", quiet=True)["fetched"] is True
    assert (repo / "dataset_coco.json").is_symlink() and (big / "dataset_coco.json").read_text() == '{"images": [2]}'


def test_push_of_a_path_that_is_not_there_names_it(tmp_path, capsys):
    missing = tmp_path / "featres.a2feat"
    assert main(["data", "push", str(missing), "s3://a2-bucket/features.a2feat"]) == 2
    assert capsys.readouterr().err == f"a2: error: {missing}: no such file or feature store\n"


# -- a disk that cannot take the copy ----------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (root only, else the test is skipped); unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.decode()[:200]}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_or_read_only_disk_is_one_line_naming_the_target(s3_endpoint, tmp_path, small_disk, capsys):
    """A store or a file fetched onto a full disk raised a bare OSError (a traceback: a write error names no file),
    or, from a local store, named the *source* as the file without space; read-only named the hidden lock file. Now
    one line naming the target, and nothing left on the disk but the lock."""
    bucket = unique_bucket(s3_endpoint, "edges")
    _store(tmp_path / "big.a2feat", seed=1, images=300, dim=64)  # 130 KB of rows: more than the disk holds
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 100_000)
    store_uri = f"s3://{bucket}/big.a2feat"
    datastore.push(tmp_path / "big.a2feat", store_uri, endpoint_url=s3_endpoint, quiet=True)
    file_uri = f"s3://{bucket}/big.json"
    datastore.push(big, file_uri, endpoint_url=s3_endpoint, quiet=True)
    capsys.readouterr()
    cases = {"s3.a2feat": store_uri, "local.a2feat": str(tmp_path / "big.a2feat"), "s3.json": file_uri,
             "local.json": str(big)}
    for name, source in cases.items():
        assert main(["data", "fetch", source, str(small_disk / name), "--endpoint-url", s3_endpoint]) == 2, name
        err = capsys.readouterr().err  # the lines before it: what is fetched
        assert err.endswith(f"\na2: error: {small_disk / name}: cannot write the copy there (No space left on "
                            f"device); nothing was replaced\n") and "Traceback" not in err, err
    assert sorted(os.listdir(small_disk)) == sorted(f".{name}.lock" for name in cases)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    assert main(["data", "fetch", store_uri, str(small_disk / "new" / "f.a2feat"), "--endpoint-url", s3_endpoint]) == 2
    assert capsys.readouterr().err == (f"a2: error: {small_disk / 'new' / 'f.a2feat'}: cannot write the copy there "
                                       f"(Read-only file system); nothing was replaced\n")


def test_a_store_on_a_read_only_disk_is_pushed(s3_endpoint, tmp_path, small_disk):
    """push stamped the store it uploads as verified and refused one on a read-only disk (`.verified`: Read-only
    file system); the stamp is a cache, the push goes on without it."""
    v1 = _store(small_disk / "f.a2feat", seed=1, images=10)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(OSError) as raised:
        (small_disk / "probe").write_text("x")
    assert raised.value.errno == errno.EROFS
    uri = f"s3://{unique_bucket(s3_endpoint, 'edges')}/f.a2feat"
    assert datastore.push(small_disk / "f.a2feat", uri, endpoint_url=s3_endpoint, quiet=True)["checksum"] == v1["checksum"]
    got = datastore.fetch(uri, tmp_path / "node" / "f.a2feat", endpoint_url=s3_endpoint, quiet=True)
    assert got["checksum"] == v1["checksum"] and got["fetched"] is True
