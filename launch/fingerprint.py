"""A study's data, fingerprinted when it starts and checked when it resumes: a captions file, feature store or test
image list changed in between (regenerated at the same path, replaced by another version) would train a trial's
remaining epochs on other data than its first, and its best epoch would be chosen across both. `resume` refuses
that in one line naming the file (exit 2), before Ray starts, writing nothing.

`data-fingerprint.json` in the study's folder, written by `run` before `study.yaml`, holds one entry per data file
of a COCO study (`data.captions`, `data.features`, `data.test_images`; a synthetic study's data is made from its
seed and has none). An entry's `id` is what is compared:

- a file up to `FULL_HASH_MAX` bytes (captions, image lists, small feature files): its SHA-256;
- a prepared feature store (`a2core.data.prepared`): its manifest's `checksum`, the SHA-256 of its data files that
  `prepare` computed (hashing tens of GB again at every resume would take minutes), and under `files` each data
  file's own entry, taken as below, so that a file replaced under a manifest kept as it was is caught (an entry
  taken before those were kept is checked by its checksum alone);
- a larger file (an HDF5 of bottom-up features, tens of GB): its size and the SHA-256 of `SAMPLES` (16) blocks of
  `BLOCK` (1 MiB) bytes spread evenly over it, first and last included, then of `PIECES` (512) pieces of `PIECE`
  (8 KiB) bytes spread evenly between them: 20 MiB read, in well under a second from a local disk (a few seconds of
  seeks on a spinning one). Regenerated features differ in nearly every block; features of some images written
  again in place are caught when the rewritten bytes span the gap between two pieces (1/511th of the file: about
  100 MB of a 50 GB file). The modification time is kept for the message but not compared, so a copy (`cp`,
  `rsync`, another machine's) of the same bytes is not refused, and other bytes copied over with their time kept
  (`rsync -a`, `cp -p`) are. An entry taken before the pieces were read (blocks only) is checked the way it was;
- a folder of `.npz` files: its file count, the SHA-256 of its (name, size) list and that of `SAMPLES` of its files
  read whole, spread evenly over the sorted names.
A change in a file that sampling misses (one value of one image of a 40 GB file) is not caught (`launch.datastore.
verify` hashes a prepared store's every byte).

The entry's `path` is where the data was when the study started: the same data at another path (`study.yaml` edited
to point there) resumes and says so; other data there is refused naming both paths. A file that cannot be read is one
line naming it, as a refusal is.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from a2core.data.prepared import MANIFEST, is_prepared
from a2core.errors import StudyError

FINGERPRINT_FILE = "data-fingerprint.json"
DATA_KEYS = ("captions", "features", "test_images")
FULL_HASH_MAX = 256 << 20  # bytes: hashed whole below this (about half a second)
SAMPLES, BLOCK = 16, 1 << 20  # a big file's blocks: 16 MiB read
PIECES, PIECE = 512, 8 << 10  # and its pieces between them (4 MiB): no two more than 1/511th of the file apart
_SAMPLED = re.compile(r"size and sha256 of (\d+) blocks of (\d+) bytes(?: and (\d+) pieces of (\d+) bytes)?")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _sampled_sha256(path: Path, size: int, sampling: tuple[int, int, int, int]) -> str:
    """SHA-256 of `samples` blocks of `block` bytes at evenly spaced offsets of the file (first and last included),
    then of `pieces` pieces of `piece` bytes spread the same way (`sampling`: those four numbers)."""
    digest = hashlib.sha256()
    samples, block, pieces, piece = sampling
    with open(path, "rb") as f:
        for count, length in ((samples, block), (pieces, piece)):
            length = min(length, size)
            for i in range(count):
                f.seek((size - length) * i // max(count - 1, 1))
                digest.update(f.read(length))
    return digest.hexdigest()


def file_fingerprint(path: str | os.PathLike, *, sampling: tuple[int, int, int, int] | None = None) -> dict:
    """The fingerprint of one data file or feature folder (see the module docstring): {"path", "how", "id", ...}.
    `sampling`: a big file's (samples, block, pieces, piece), `SAMPLES, BLOCK, PIECES, PIECE` unless given (what a
    fingerprint taken another way read: `sampling_of`)."""
    sampling = sampling or (SAMPLES, BLOCK, PIECES, PIECE)
    path = Path(path)
    if path.is_dir() and is_prepared(path):
        manifest = json.loads((path / MANIFEST).read_text())
        # The checksum is what `prepare` hashed, not the files there now: a data file replaced under the manifest is
        # caught by its own fingerprint, taken as any data file's (sampled past FULL_HASH_MAX: about 20 MiB read a
        # file). Not `launch.datastore.verify`, which hashes every byte: minutes for tens of GB at every resume.
        files = {name: {k: v for k, v in file_fingerprint(path / name, sampling=sampling).items() if k in ("how", "id")}
                 for name in sorted(manifest.get("files") or {})}
        return {"path": str(path), "how": "prepared store's manifest checksum", "id": str(manifest.get("checksum")),
                "files": files}
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
    how = f"size and sha256 of {sampling[0]} blocks of {sampling[1]} bytes"
    if sampling[2]:
        how += f" and {sampling[2]} pieces of {sampling[3]} bytes"
    return {"path": str(path), "how": how,
            "id": f"{stat.st_size}:{_sampled_sha256(path, stat.st_size, sampling)}", "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns}


def sampling_of(entry: dict) -> tuple[int, int, int, int] | None:
    """The (samples, block, pieces, piece) a big file's fingerprint entry was taken with (its "how"); None for
    another kind of entry."""
    found = _SAMPLED.fullmatch(str(entry.get("how", "")))
    if found is None:
        return None
    samples, block, pieces, piece = found.groups()
    return int(samples), int(block), int(pieces or 0), int(piece or 0)


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


def _kind(entry: dict) -> str:
    how = str(entry.get("how", ""))
    return "prepared store" if how.startswith("prepared") else "folder" if "files:" in how else "file"


def _difference(then: dict, now: dict) -> str:
    """What differs that a person can read: a file now a folder (or the other way), a folder's file count, a file's
    size; else "" (only the digests)."""
    if _kind(then) != _kind(now):
        return f"; a {_kind(now)} now, a {_kind(then)} then"
    before, after = str(then.get("id", "")).split(":"), str(now["id"]).split(":")
    if now["how"].endswith("read whole") and len(before) == 3 and before[0] != after[0]:
        return f"; {before[0]} files then, {after[0]} now"
    if "size" in now and then.get("size") not in (None, now["size"]):
        return f"; {then['size']} bytes then, {now['size']} now"
    return ""


def recorded_fingerprint(location) -> dict | None:
    """The study's data fingerprint as `run` saved it ({"data.<key>": entry}); None for a study started before
    fingerprints were kept. StudyError when the file does not read."""
    text = location.read_text(FINGERPRINT_FILE)
    if text is None:
        return None
    try:
        started = json.loads(text)
    except ValueError:
        started = None
    if not isinstance(started, dict):
        raise StudyError(f"{location.uri(FINGERPRINT_FILE)}: the study's data fingerprint is not readable JSON (cut "
                         f"short or damaged); restore it from a copy, or remove it to resume unchecked")
    return started


def _first_change(then: dict, path: str) -> tuple[str, dict, dict] | None:
    """(what, then, now) of the first part of the data at `path` that differs from its entry `then`: the file or
    folder itself, else a prepared store's data file (an entry taken before those were kept: its checksum only)."""
    now = file_fingerprint(path, sampling=sampling_of(then))  # a big file: read the way it was at the start
    if now["id"] != then.get("id"):
        return path, then, now
    for name, file_then in (then.get("files") or {}).items():
        file_now = (now.get("files") or {}).get(name)
        if file_now is None or sampling_of(file_then) not in (None, sampling_of(file_now)):
            file_now = file_fingerprint(Path(path) / name, sampling=sampling_of(file_then))
        if file_now["id"] != file_then.get("id"):
            return str(Path(path) / name), file_then, file_now
    return None


def refuse_changed_data(spec, location, started: dict | None = None) -> list[str]:
    """StudyError (exit 2, before Ray) naming the first data file that differs from the study's fingerprint of it: a
    different file (its `id`), one no longer there, or one that cannot be read. A study started before fingerprints
    were kept: not checked. Returns a line for each data path that differs from the one the study started with
    (the data moved, `study.yaml` edited to its new path) where the data is the same. `started`: the fingerprint
    (`recorded_fingerprint`) where the caller has read it already, else read here."""
    if started is None:
        started = recorded_fingerprint(location)
    moved = []
    for key, then in (started or {}).items():
        path = spec.base["data"].get(key.split(".", 1)[-1]) or then.get("path")
        was = then.get("path") if then.get("path") not in (None, path) else None  # where the study started with it
        at = f" (at {was} when the study started)" if was else ""
        if not path or not Path(path).exists():
            raise StudyError(f"study {spec.name}: {key} ({path}) is gone{at}; the study was started with it: put it "
                             f"back to resume (a study's trials train all their epochs on one set of data)")
        try:
            change = _first_change(then, path)
        except OSError as err:  # no traceback, and an error that names no file (EIO) named here
            raise StudyError(f"study {spec.name}: {key} ({err.filename or path}) cannot be read ({err.strerror or err}"
                             f"); its fingerprint is checked before the study resumes: make it readable (its "
                             f"permissions, the disk it is on) and resume again") from None
        if change is None:
            if was:
                moved.append(f"{key} is read at {path} now ({was} when the study started): the same data (its "
                             f"fingerprint matches)")
            continue
        what, before, now = change
        part = f": its file {what}" if what != path else ""
        differs = f"is not the data the study started with at {was}{part}" if was else \
            f"changed since the study started{part}"
        raise StudyError(
            f"study {spec.name}: {key} ({path}) {differs} ({now['how']}: {_short(before)} then, {_short(now)} now"
            f"{_difference(before, now)}); its trials would train their remaining epochs on other data than their "
            f"first: put the data the study started with back, or run the study again under another name")
    return moved
