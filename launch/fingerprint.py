"""A study's data, fingerprinted when it starts and checked when it resumes: a captions file, feature store or test
image list changed in between (regenerated at the same path, replaced by another version) would train a trial's
remaining epochs on other data than its first, and its best epoch would be chosen across both. `resume` refuses
that in one line naming the file (exit 2), before Ray starts.

`data-fingerprint.json` in the study's folder, written by `run` before `study.yaml`, holds one entry per data file
of a COCO study (`data.captions`, `data.features`, `data.test_images`; a synthetic study's data is made from its
seed and has none). An entry's `id` is what is compared:

- a file up to `FULL_HASH_MAX` bytes (captions, image lists, small feature files): its SHA-256;
- a prepared feature store (`a2core.data.prepared`): its manifest's `checksum`, the SHA-256 of its data files that
  `prepare` computed (hashing tens of GB again at every resume would take minutes);
- a larger file (an HDF5 of bottom-up features, tens of GB): its size and the SHA-256 of `SAMPLES` blocks of
  `BLOCK` bytes spread evenly over it, first and last included. Regenerated features differ in nearly every block,
  so a few MB read tell them apart in well under a second; the modification time is kept for the message but not
  compared, so a copy (`cp`, `rsync` without times) of the same bytes is not refused;
- a folder of `.npz` files: its file count, the SHA-256 of its (name, size) list and that of `SAMPLES` of its files
  read whole, spread evenly over the sorted names.
A change in a file that sampling misses (one value of one image of a 40 GB store) is not caught; a prepared store's
`a2 data verify` checks every byte.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from a2core.data.prepared import MANIFEST, is_prepared
from a2core.errors import StudyError

FINGERPRINT_FILE = "data-fingerprint.json"
DATA_KEYS = ("captions", "features", "test_images")
FULL_HASH_MAX = 256 << 20  # bytes: hashed whole below this (about half a second)
SAMPLES, BLOCK = 16, 1 << 20


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _sampled_sha256(path: Path, size: int) -> str:
    """SHA-256 of `SAMPLES` blocks of `BLOCK` bytes at evenly spaced offsets of the file (first and last included)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for i in range(SAMPLES):
            f.seek((size - BLOCK) * i // (SAMPLES - 1))
            digest.update(f.read(BLOCK))
    return digest.hexdigest()


def file_fingerprint(path: str | os.PathLike) -> dict:
    """The fingerprint of one data file or feature folder (see the module docstring): {"path", "how", "id", ...}."""
    path = Path(path)
    if path.is_dir() and is_prepared(path):
        manifest = json.loads((path / MANIFEST).read_text())
        return {"path": str(path), "how": "prepared store's manifest checksum", "id": str(manifest.get("checksum"))}
    if path.is_dir():
        files = sorted((f for f in os.scandir(path) if f.is_file()), key=lambda f: f.name)
        listing = hashlib.sha256(json.dumps([[f.name, f.stat().st_size] for f in files]).encode()).hexdigest()
        picked = files if len(files) <= SAMPLES else [files[i * (len(files) - 1) // (SAMPLES - 1)]
                                                     for i in range(SAMPLES)]
        content = hashlib.sha256("".join(_sha256_file(Path(f.path)) for f in picked).encode()).hexdigest()
        return {"path": str(path), "how": f"{len(files)} files: names and sizes, {len(picked)} read whole",
                "id": f"{len(files)}:{listing}:{content}"}
    stat = path.stat()
    if stat.st_size <= FULL_HASH_MAX:
        return {"path": str(path), "how": "sha256", "id": _sha256_file(path), "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns}
    return {"path": str(path), "how": f"size and sha256 of {SAMPLES} blocks of {BLOCK} bytes",
            "id": f"{stat.st_size}:{_sampled_sha256(path, stat.st_size)}", "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns}


def data_fingerprint(spec) -> dict:
    """{"data.<key>": fingerprint} of the study's data files (empty for synthetic data)."""
    data = spec.base["data"]
    if data.get("kind") != "coco":
        return {}
    return {f"data.{key}": file_fingerprint(data[key]) for key in DATA_KEYS if data.get(key)}


def save_data_fingerprint(spec, location) -> None:
    """Write the study's data fingerprint into its folder (`location`: a `launch.location.StudyLocation`)."""
    location.write_text(json.dumps(data_fingerprint(spec), indent=1) + "\n", FINGERPRINT_FILE)


def _short(entry: dict) -> str:
    value = str(entry.get("id", "?")).rsplit(":", 1)[-1]
    return f"{value[:8]}..." if len(value) > 8 else value


def refuse_changed_data(spec, location) -> None:
    """StudyError (exit 2, before Ray) naming the first data file that differs from the study's fingerprint of it: a
    different file (its `id`), or one no longer there. A study started before fingerprints were kept: not checked."""
    text = location.read_text(FINGERPRINT_FILE)
    if text is None:
        return
    try:
        started = json.loads(text)
    except ValueError:
        started = None
    if not isinstance(started, dict):
        raise StudyError(f"{location.uri(FINGERPRINT_FILE)}: the study's data fingerprint is not readable JSON (cut "
                         f"short or damaged); restore it from a copy, or remove it to resume unchecked")
    for key, then in started.items():
        path = spec.base["data"].get(key.split(".", 1)[-1]) or then.get("path")
        if not path or not Path(path).exists():
            raise StudyError(f"study {spec.name}: {key} ({path}) is gone; the study was started with it: put it back "
                             f"to resume (a study's trials train all their epochs on one set of data)")
        now = file_fingerprint(path)
        if now["id"] != then.get("id"):
            raise StudyError(
                f"study {spec.name}: {key} ({path}) changed since the study started ({now['how']}: {_short(then)} "
                f"then, {_short(now)} now); its trials would train their remaining epochs on other data than their "
                f"first: put the data the study started with back, or run the study again under another name")
