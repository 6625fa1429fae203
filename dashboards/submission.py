"""COCO caption test-server submission files: write, zip and validate.

The server expects one `results.zip` whose root holds exactly `captions_val2014_<alg>_results.json` and
`captions_test2014_<alg>_results.json`, each a JSON list `[{"image_id": int, "caption": str}, ...]` covering every
image of its split exactly once (val2014: 40,504 images; test2014: 40,775, from `image_info_test2014.json`).
`validate_zip` reports every problem it finds, so one run tells the whole story:

    report = validate_zip("results.zip", read_image_ids("captions_val2014.json"),
                          read_image_ids("image_info_test2014.json"), alg="a2")
    print(report)               # report.ok is False when anything is wrong
    report.raise_if_invalid()   # SubmissionError carrying the same text
"""
from __future__ import annotations

import json
import os
import re
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from a2core.atomic import atomic_write
from a2core.data.captions import is_image_id, read_image_info
from a2core.errors import DataError, SubmissionError

SPLITS = ("val", "test")
_ALG_RE = re.compile(r"[A-Za-z0-9-]+")
_NAME_RE = re.compile(r"captions_(?P<split>val|test)2014_(?P<alg>[A-Za-z0-9-]+)_results\.json")
MAX_IDS_SHOWN = 10  # image ids / entry indices a message shows before "... (N more)"
# The server's zip holds 2 files of a few MB each (40,775 captions are ~3.5 MB of JSON); these caps leave room
# and bound what a hostile zip costs.
MAX_MEMBERS = 16
MAX_MEMBER_BYTES = 32 << 20
_UNREADABLE = object()  # what _read_json returns after reporting a problem


def results_filename(split: str, alg: str) -> str:
    """``captions_{split}2014_{alg}_results.json``; ``split`` is ``val`` or ``test``."""
    if split not in SPLITS:
        raise SubmissionError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(alg, str) or not _ALG_RE.fullmatch(alg):
        raise SubmissionError(f"alg must match [A-Za-z0-9-]+ (it becomes part of the file name), got {alg!r}")
    return f"captions_{split}2014_{alg}_results.json"


def write_results(path: str | os.PathLike, captions: Mapping[int, str]) -> Path:
    """Write a COCO results file `[{"image_id": int, "caption": str}]` sorted by image id, atomically. Ids must be
    ints and captions strings (SubmissionError naming the id); empty captions are written (`validate_zip` flags
    them)."""
    for image_id, caption in captions.items():
        if isinstance(image_id, bool) or not isinstance(image_id, int):
            raise SubmissionError(f"{path}: image id {image_id!r} is not an int")
        if not isinstance(caption, str):
            raise SubmissionError(f"{path}: caption of image {image_id} is {type(caption).__name__}, not str")
    entries = [{"image_id": image_id, "caption": captions[image_id]} for image_id in sorted(captions)]
    return atomic_write(path, json.dumps(entries, ensure_ascii=False) + "\n")


def make_zip(zip_path: str | os.PathLike, val_results: str | os.PathLike, test_results: str | os.PathLike) -> Path:
    """Write `zip_path` (the server's `results.zip`) holding exactly the two results files at its root,
    atomically."""
    val_results, test_results = Path(val_results), Path(test_results)
    for p in (val_results, test_results):
        if not p.is_file():
            raise SubmissionError(f"results file not found: {p}")
    if val_results.name == test_results.name:
        raise SubmissionError(f"val and test results have the same file name {val_results.name!r}")

    def write(f):
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.write(val_results, arcname=val_results.name)
            zf.write(test_results, arcname=test_results.name)

    return atomic_write(zip_path, write)


def read_image_ids(path: str | os.PathLike) -> list[int]:
    """Image ids of a COCO image-info JSON (`image_info_test2014.json`, `captions_val2014.json`: `{"images":
    [{"id": int, ...}, ...]}`), in file order; every error names the file."""
    try:
        return read_image_info(path)
    except DataError as err:
        raise SubmissionError(str(err)) from None


def _preview(values: Iterable[Any], limit: int = MAX_IDS_SHOWN) -> str:
    values = list(values)
    shown = ", ".join(str(v) for v in values[:limit])
    if len(values) > limit:
        shown += f", ... ({len(values) - limit} more)"
    return shown


@dataclass(frozen=True)
class Problem:
    """One thing wrong: `file` is the zip member it concerns (the zip itself for archive-level problems), `kind` a
    stable tag, `message` what a person reads, `image_ids` every image id involved (the message shows a few)."""

    file: str
    kind: str
    message: str
    image_ids: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.file}: {self.message}"


@dataclass
class ValidationReport:
    """Everything `validate_zip` found; no problems: a submission the server will accept."""

    zip_path: str
    problems: list[Problem] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)  # member name -> number of results entries read
    alg: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def kinds(self) -> list[str]:
        return [p.kind for p in self.problems]

    def by_kind(self, kind: str) -> list[Problem]:
        return [p for p in self.problems if p.kind == kind]

    def add(self, file: str, kind: str, message: str, image_ids: Iterable[int] = ()) -> None:
        self.problems.append(Problem(file, kind, message, tuple(image_ids)))

    def __str__(self) -> str:
        if self.ok:
            files = ", ".join(f"{name} ({n} captions)" for name, n in sorted(self.files.items()))
            return f"{self.zip_path}: OK - {files}"
        lines = [f"{self.zip_path}: {len(self.problems)} problem(s)"]
        lines += [f"  - [{p.kind}] {p}" for p in self.problems]
        return "\n".join(lines)

    def raise_if_invalid(self) -> None:
        if not self.ok:
            raise SubmissionError(str(self))


def _check_entries(report: ValidationReport, name: str, data: Any, expected: set[int]) -> None:
    """Schema and coverage checks of one decoded results file."""
    if not isinstance(data, list):
        report.add(name, "not_list", f"top-level JSON is {type(data).__name__}, expected a list of "
                                     '{"image_id": int, "caption": str} objects')
        return
    not_object: list[int] = []  # entry indices
    missing_key: dict[str, list[int]] = {"image_id": [], "caption": []}
    bad_id: list[tuple[int, Any]] = []  # (index, value)
    bad_caption: list[tuple[Any, Any]] = []  # (image id, or "entry #index" when the id itself is bad; value)
    empty_caption: list[Any] = []  # image ids, or "entry #index"
    seen: Counter[int] = Counter()
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            not_object.append(i)
            continue
        for key in missing_key:
            if key not in entry:
                missing_key[key].append(i)
        image_id = entry.get("image_id")
        if is_image_id(image_id):
            seen[image_id] += 1
        elif "image_id" in entry:
            bad_id.append((i, image_id))
        label = image_id if is_image_id(image_id) else f"entry #{i}"
        caption = entry.get("caption")
        if "caption" in entry and not isinstance(caption, str):
            bad_caption.append((label, caption))
        elif isinstance(caption, str) and not caption.strip():
            empty_caption.append(label)

    if not_object:
        report.add(name, "not_object", f"{len(not_object)} entries are not JSON objects "
                                       f"(entry indices: {_preview(not_object)})")
    for key, indices in missing_key.items():
        if indices:
            report.add(name, "missing_key", f"{len(indices)} entries have no {key!r} key "
                                            f"(entry indices: {_preview(indices)})")
    if bad_id:
        report.add(name, "bad_image_id", f"{len(bad_id)} entries have an image_id that is not a non-negative 64-bit "
                                         f"int: {_preview(f'entry #{i}: {v!r:.40}' for i, v in bad_id)}")
    if bad_caption:
        report.add(name, "bad_caption", f"{len(bad_caption)} captions are not strings: "
                                        f"{_preview(f'{label}: {v!r:.40}' for label, v in bad_caption)}",
                   [label for label, _ in bad_caption if isinstance(label, int)])
    if empty_caption:
        report.add(name, "empty_caption", f"{len(empty_caption)} empty captions, image ids: {_preview(empty_caption)}",
                   [label for label in empty_caption if isinstance(label, int)])
    duplicates = sorted(i for i, n in seen.items() if n > 1)
    if duplicates:
        report.add(name, "duplicate_ids", f"{len(duplicates)} image ids appear more than once: "
                                          f"{_preview(f'{i} (x{seen[i]})' for i in duplicates)}", duplicates)
    missing = sorted(expected - seen.keys())
    if missing:
        report.add(name, "missing_ids", f"missing {len(missing)} image ids: {_preview(missing)}", missing)
    extra = sorted(seen.keys() - expected)
    if extra:
        report.add(name, "extra_ids", f"{len(extra)} image ids are not in the split: {_preview(extra)}", extra)


def validate_zip(zip_path: str | os.PathLike, val_image_ids: Iterable[int], test_image_ids: Iterable[int],
                 alg: str | None = None) -> ValidationReport:
    """Check a COCO caption server `results.zip`; return a report listing every problem found.

    The file is a zip of at most `MAX_MEMBERS` entries with safe names; it holds exactly two files, at its root,
    named `captions_{val,test}2014_<alg>_results.json` with one `alg` (`alg` itself when given); each is at most
    `MAX_MEMBER_BYTES` (declared and actually read), UTF-8 JSON, a list of objects with an int `image_id` (bools,
    strings and ids outside int64 rejected) and a non-blank string `caption` (other keys are allowed: the server
    reads only these); each split's image ids are covered exactly once with no extras. Members are read as
    bounded streams: a zip bomb costs at most `MAX_MEMBER_BYTES` of memory.
    """
    zip_path = str(zip_path)
    report = ValidationReport(zip_path=zip_path, alg=alg)
    expected = {"val": set(val_image_ids), "test": set(test_image_ids)}
    if alg is not None and (not isinstance(alg, str) or not _ALG_RE.fullmatch(alg)):
        report.add(zip_path, "bad_alg", f"alg {alg!r} does not match [A-Za-z0-9-]+")
    if not os.path.isfile(zip_path):
        report.add(zip_path, "not_found", "file not found")
        return report
    try:
        zf = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError) as e:
        report.add(zip_path, "not_zip", f"not a zip archive ({e})")
        return report
    with zf:
        members = _check_members(report, zf)
        if members is None:
            return report
        by_split = _members_by_split(report, members)
        for split in SPLITS:
            for info, _ in by_split[split]:
                data = _read_json(report, zf, info)
                if data is not _UNREADABLE:
                    report.files[info.filename] = len(data) if isinstance(data, list) else 0
                    _check_entries(report, info.filename, data, expected[split])
    return report


def _check_members(report: ValidationReport, zf: zipfile.ZipFile) -> list[zipfile.ZipInfo] | None:
    """The archive's files, after its archive-level checks; None when there are too many to look at."""
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        report.add(report.zip_path, "too_many_members", f"holds {len(infos)} entries; at most {MAX_MEMBERS} are read")
        return None
    for info in infos:
        parts = info.filename.replace("\\", "/").split("/")
        if info.filename.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
            report.add(info.filename, "unsafe_name", "is an absolute path or climbs out of the archive (..)")
        if info.file_size > MAX_MEMBER_BYTES:
            report.add(info.filename, "too_large", f"declares {info.file_size} bytes uncompressed; "
                                                   f"at most {MAX_MEMBER_BYTES} are read")
    members = [info for info in infos if not info.is_dir()]
    names = [info.filename for info in members]
    for name, n in Counter(names).items():
        if n > 1:
            report.add(name, "duplicate_member", f"appears {n} times in the archive")
    if len(members) != 2:
        report.add(report.zip_path, "file_count",
                   f"holds {len(members)} files ({_preview(names) or 'none'}); expected exactly 2: "
                   "captions_val2014_<alg>_results.json and captions_test2014_<alg>_results.json")
    return members


def _members_by_split(report: ValidationReport, members) -> dict[str, list[tuple[zipfile.ZipInfo, str]]]:
    """Results files by split, with the alg of each name; reports misplaced, misnamed and missing files, and
    algorithm names that differ."""
    by_split: dict[str, list[tuple[zipfile.ZipInfo, str]]] = {"val": [], "test": []}
    for info in members:
        name = info.filename
        base = name.replace("\\", "/").rsplit("/", 1)[-1]
        if base != name:
            report.add(name, "not_at_root", f"is inside a folder; the server needs it at the zip root as {base!r}")
        m = _NAME_RE.fullmatch(base)
        if not m:
            report.add(name, "bad_name", f"unexpected file name {base!r}; expected "
                                         "captions_val2014_<alg>_results.json or captions_test2014_<alg>_results.json")
            continue
        by_split[m["split"]].append((info, m["alg"]))
    alg = report.alg if isinstance(report.alg, str) and _ALG_RE.fullmatch(report.alg) else "<alg>"
    for split, entries in by_split.items():
        if not entries:
            report.add(report.zip_path, "missing_file", f"no {split}2014 results file "
                                                        f"(captions_{split}2014_{alg}_results.json)")
        elif len(entries) > 1:
            report.add(report.zip_path, "duplicate_split",
                       f"{len(entries)} {split}2014 results files: {', '.join(i.filename for i, _ in entries)}")
    named = [(info, a) for entries in by_split.values() for info, a in entries]
    if report.alg is not None:  # the algorithm asked for, else one across the files
        for info, a in named:
            if a != report.alg:
                report.add(info.filename, "alg_mismatch", f"algorithm name {a!r} in the file name, "
                                                          f"expected {report.alg!r}")
    elif len({a for _, a in named}) > 1:
        report.add(report.zip_path, "alg_mismatch",
                   f"the files use different algorithm names: {', '.join(sorted({a for _, a in named}))}")
    return by_split


def _read_json(report: ValidationReport, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> Any:
    """A member's JSON, read through a bounded stream (declared sizes can lie); _UNREADABLE after a problem."""
    name = info.filename
    if info.file_size > MAX_MEMBER_BYTES:
        return _UNREADABLE  # reported by _check_members
    try:
        with zf.open(info) as f:
            raw = f.read(MAX_MEMBER_BYTES + 1)
    except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError, EOFError) as e:
        report.add(name, "unreadable", f"cannot be extracted ({e})")
        return _UNREADABLE
    if len(raw) > MAX_MEMBER_BYTES:
        report.add(name, "too_large", f"holds more than {MAX_MEMBER_BYTES} bytes uncompressed "
                                      f"(declares {info.file_size})")
        return _UNREADABLE
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        report.add(name, "not_utf8", f"is not valid UTF-8 ({e})")
        return _UNREADABLE
    if text.startswith("\ufeff"):
        report.add(name, "bom", "starts with a UTF-8 byte-order mark, which JSON parsers reject")
        text = text[1:]
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        report.add(name, "not_json", f"is not valid JSON ({e})")
    except ValueError:  # Python's int() refuses more than 4300 digits, deep inside json
        report.add(name, "not_json", f"holds an integer of more than {sys.get_int_max_str_digits()} digits")
    return _UNREADABLE
