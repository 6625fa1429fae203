"""Audit of a study's data fingerprint (`launch.fingerprint`), the nodes' copies of the features and `a2 data push`
(`launch.datastore`) with real data's failure modes: copies that keep modification times, features edited in part,
feature folders, symlinked data roots, a node holding other features of the same size, a store file changed
between its checksum and its upload."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from a2core.data import features, prepared
from a2core.errors import DataError, StudyError
from launch import datastore
from launch import fingerprint as fp
from launch.cli import main
from tests.s3server import s3_client, unique_bucket
from tests.studyfolder import fabricated_study

pytestmark = pytest.mark.outside_ray_group

TINY = ("model.d_model=16", "model.layers=1", "model.heads=2", "model.d_ff=32")


def coco_study(tmp_path: Path, name: str, data: Path):
    from a2core.data.synthetic import ensure

    ensure(data, seed=0, images=60)
    return fabricated_study(tmp_path, name, epochs=1, overrides=(
        "data={kind: coco}", f"data.captions={data / 'dataset_coco.json'}", f"data.features={data / 'features.h5'}",
        *TINY))


def same_mtime_rewrite(path: Path, data: bytes) -> None:
    """`rsync -a` / `cp -p` of other bytes of the same size over `path`: its modification time kept."""
    stat = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_size == stat.st_size


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


# -- 1: what the fingerprint catches ------------------------------------------------------------------------------
def test_features_rewritten_with_their_mtime_kept_are_refused_and_a_same_bytes_copy_elsewhere_is_not(tmp_path,
                                                                                                  monkeypatch):
    """Big features (sampled) rewritten by a copy that keeps size and mtime: refused, naming data.features and what
    to do; the same bytes under another path (another machine's copy, a moved symlinked root): accepted."""
    real = tmp_path / "disk-a"
    fab = coco_study(tmp_path, "mt", real / "coco")
    h5 = real / "coco" / "features.h5"
    (tmp_path / "data").symlink_to(real)  # the study reads through a symlinked data root
    fab.spec.base["data"]["features"] = str(tmp_path / "data" / "coco" / "features.h5")
    fab.spec.base["data"]["captions"] = str(tmp_path / "data" / "coco" / "dataset_coco.json")
    monkeypatch.setattr(fp, "FULL_HASH_MAX", 1 << 10)  # the synthetic features as a big file: sampled
    monkeypatch.setattr(fp, "BLOCK", 256)
    fp.save_data_fingerprint(fab.spec, fab.location)
    saved = json.loads(Path(fab.location.uri(fp.FINGERPRINT_FILE)).read_text())
    assert saved["data.features"]["how"].startswith("size and sha256 of")
    # the root moved to another disk (the cluster's copy: same bytes, other paths and times), the link followed
    shutil.copytree(real, tmp_path / "disk-b", copy_function=shutil.copyfile)
    (tmp_path / "data").unlink()
    (tmp_path / "data").symlink_to(tmp_path / "disk-b")
    fp.refuse_changed_data(fab.spec, fab.location)
    # other features of the same size over it, mtime kept
    moved = tmp_path / "disk-b" / "coco" / "features.h5"
    other = bytes(b ^ 0x5A for b in moved.read_bytes())
    same_mtime_rewrite(moved, other)
    with pytest.raises(StudyError) as refused:
        fp.refuse_changed_data(fab.spec, fab.location)
    text = str(refused.value)
    assert f"data.features ({tmp_path / 'data' / 'coco' / 'features.h5'}) changed since the study started" in text
    assert "put the data the study started with back" in text
    assert h5.exists()


def test_features_edited_in_part_between_the_old_samples_are_refused(tmp_path, monkeypatch):
    """Features of some images written again in place (h5py `f[key][...] = new`): a contiguous 1.5% of a big file.
    16 blocks 1/15th of the file apart missed it; the pieces read between them now catch it, with 4 MiB more read."""
    monkeypatch.setattr(fp, "FULL_HASH_MAX", 1 << 20)
    big = tmp_path / "features.h5"
    size = 64 << 20
    big.write_bytes(np.random.default_rng(0).bytes(size))
    before = fp.file_fingerprint(big)
    start, length = (size * 3) // 10, size * 15 // 1000  # 30% in, 1.5% of the file
    data = bytearray(big.read_bytes())
    data[start:start + length] = bytes(length)
    same_mtime_rewrite(big, bytes(data))
    after = fp.file_fingerprint(big)
    assert after["size"] == before["size"] and after["mtime_ns"] == before["mtime_ns"]
    assert after["id"] != before["id"]
    assert before["how"] == "size and sha256 of 16 blocks of 1048576 bytes and 512 pieces of 8192 bytes"
    assert fp.SAMPLES * fp.BLOCK + fp.PIECES * fp.PIECE == 20 << 20  # the bytes read at a resume


def test_a_fingerprint_taken_with_the_old_samples_is_checked_with_them(tmp_path, monkeypatch):
    """A study started before the samples changed (16 blocks of 1 MiB) resumes on its unchanged data, and is refused
    on changed data: its entry is checked the way it was taken."""
    monkeypatch.setattr(fp, "FULL_HASH_MAX", 1 << 20)
    fab = coco_study(tmp_path, "old", tmp_path / "coco")
    big = tmp_path / "big.h5"
    big.write_bytes(np.random.default_rng(1).bytes(20 << 20))
    fab.spec.base["data"]["features"] = str(big)
    fp.save_data_fingerprint(fab.spec, fab.location)
    saved_path = Path(fab.location.uri(fp.FINGERPRINT_FILE))
    saved = json.loads(saved_path.read_text())
    digest = hashlib.sha256()
    with open(big, "rb") as f:  # the old way: 16 blocks of 1 MiB evenly spaced, first and last included
        for i in range(16):
            f.seek((big.stat().st_size - (1 << 20)) * i // 15)
            digest.update(f.read(1 << 20))
    saved["data.features"].update(how=f"size and sha256 of 16 blocks of {1 << 20} bytes",
                                  id=f"{big.stat().st_size}:{digest.hexdigest()}")
    saved_path.write_text(json.dumps(saved))
    fp.refuse_changed_data(fab.spec, fab.location)  # unchanged: accepted
    with open(big, "r+b") as f:  # in the first sampled block
        f.write(b"\0" * 64)
    with pytest.raises(StudyError, match=r"data\.features .* changed since the study started"):
        fp.refuse_changed_data(fab.spec, fab.location)


def test_a_features_folder_with_one_file_added_is_refused_naming_the_counts(tmp_path):
    """A folder of `.npz` features with one image's file added: refused, and the message says how many files it
    held then and holds now."""
    folder = tmp_path / "npz"
    folder.mkdir()
    for i in range(20):
        np.savez(folder / f"{i}.npz", x=np.full((3, 4), i, dtype=np.float32))
    fab = coco_study(tmp_path, "npz", tmp_path / "coco")
    fab.spec.base["data"]["features"] = str(folder)
    fp.save_data_fingerprint(fab.spec, fab.location)
    fp.refuse_changed_data(fab.spec, fab.location)
    np.savez(folder / "99.npz", x=np.zeros((3, 4), dtype=np.float32))
    with pytest.raises(StudyError) as refused:
        fp.refuse_changed_data(fab.spec, fab.location)
    assert f"data.features ({folder}) changed since the study started" in str(refused.value)
    assert "20 files then, 21 now" in str(refused.value)


# -- 2: a resume on changed data writes nothing -------------------------------------------------------------------
def test_a_resume_on_changed_data_writes_nothing_of_the_study(tmp_path, monkeypatch, capsys):
    import launch.driver
    from launch.location import STUDY_FILE, saved_form
    import yaml

    fab = coco_study(tmp_path, "nw", tmp_path / "coco")
    fp.save_data_fingerprint(fab.spec, fab.location)
    Path(fab.location.uri(STUDY_FILE)).write_text(yaml.safe_dump(saved_form(fab.spec), sort_keys=False))
    monkeypatch.setattr(launch.driver, "_drive", lambda *a, **k: pytest.fail("resumed on changed data"))
    caps = tmp_path / "coco" / "dataset_coco.json"
    caps.write_text(caps.read_text().replace('"raw": "', '"raw": "x', 1))
    study = Path(fab.location.uri())
    before = snapshot(tmp_path / "st") if (tmp_path / "st").exists() else snapshot(study.parent)
    code = main(["study", "resume", "nw", "--storage", str(fab.spec.storage)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2, line
    assert f"data.captions ({caps}) changed since the study started" in line
    after = snapshot(tmp_path / "st") if (tmp_path / "st").exists() else snapshot(study.parent)
    assert after == before


# -- the nodes' copies: a node with other features of the same size ----------------------------------------------
def test_a_node_copy_of_other_features_of_the_same_size_differs_from_the_drivers(tmp_path):
    """`check_feature_copies` compares `describe_copy` on every node with the driver's: an HDF5 file of other
    features and the same size, or a `.npz` folder with files missing, is not the driver's copy."""
    driver, node = tmp_path / "driver.h5", tmp_path / "node.h5"
    rng = np.random.default_rng(0)
    for path in (driver, node):
        with h5py.File(path, "w") as f:
            for i in range(10):
                f[f"{i}_features"] = rng.random((5, 8), dtype=np.float32)
    assert driver.stat().st_size == node.stat().st_size
    assert datastore.describe_copy(str(driver))["what"] != datastore.describe_copy(str(node))["what"]
    shutil.copyfile(driver, node)
    assert datastore.describe_copy(str(driver))["what"] == datastore.describe_copy(str(node))["what"]
    assert datastore.describe_copy(str(node))["what"].startswith(f"file of {node.stat().st_size} bytes")

    full, part = tmp_path / "full", tmp_path / "part"
    for folder, count in ((full, 12), (part, 3)):
        folder.mkdir()
        for i in range(count):
            np.savez(folder / f"{i}.npz", x=np.full((3, 4), i, dtype=np.float32))
    got_full, got_part = datastore.describe_copy(str(full)), datastore.describe_copy(str(part))
    assert got_full["ok"] and got_part["ok"]
    assert got_full["what"].startswith("folder of 12 files") and got_part["what"].startswith("folder of 3 files")


# -- 3: `a2 data push` -------------------------------------------------------------------------------------------
def make_store(path: Path, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path.with_suffix(".h5"), "w") as f:
        for i in range(20):
            f[f"{i + 1}_features"] = rng.random((4, 16), dtype=np.float32)
    return features.prepare(path.with_suffix(".h5"), path, feature_dim=16)


def keys(endpoint: str, bucket: str) -> list[str]:
    listed = s3_client(endpoint).list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(o["Key"] for o in listed if not o["Key"].endswith("/"))


def test_push_refuses_a_store_file_changed_after_its_checksum(s3_endpoint, tmp_path, monkeypatch):
    """A data file rewritten (same size) after push hashed the store and before its upload: the upload is not the
    file the manifest names, so no manifest is written (no reader sees a store whose files fail its checksums),
    the object is removed and the error names the file."""
    store = tmp_path / "f.a2feat"
    manifest = make_store(store, seed=3)
    bucket = unique_bucket(s3_endpoint, "aud")
    uri = f"s3://{bucket}/coco/f.a2feat"
    real = datastore.upload_file
    changed = store / prepared.ROWS

    def racing_upload(path, *args, **kwargs):
        if Path(path) == changed:  # a writer rewrites it just before it goes up
            data = bytearray(changed.read_bytes())
            data[5] ^= 0xFF
            changed.write_bytes(bytes(data))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(datastore, "upload_file", racing_upload)
    with pytest.raises(DataError) as refused:
        datastore.push(store, uri, endpoint_url=s3_endpoint, quiet=True)
    assert f"{changed}: changed since the store was checked" in str(refused.value)
    assert "left without a manifest" in str(refused.value) and "`a2 data prepare`" in str(refused.value)
    left = keys(s3_endpoint, bucket)
    assert "coco/f.a2feat/manifest.json" not in left and f"coco/f.a2feat/{prepared.ROWS}" not in left, left
    assert manifest["files"][prepared.ROWS]["sha256"] != prepared.file_sha256(changed)
    assert not (store / datastore.STAMP).exists()  # push's stamp of the full check it made before the change: gone
