"""COCO caption test-server submission files: zip and validate. The server expects one `results.zip` whose
root holds exactly `captions_{val,test}2014_<alg>_results.json`, each a JSON list `[{"image_id": int, "caption":
str}, ...]` covering every image of its split exactly once (val2014: 40,504 images; test2014: 40,775)."""
from __future__ import annotations

import json
import os
import re
import sys
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from a2core.atomic import atomic_write
from a2core.data.captions import is_image_id
from a2core.errors import SubmissionError

SPLITS = ("val", "test")
_ALG_RE = re.compile(r"[A-Za-z0-9-]+")
_NAME_RE = re.compile(r"captions_(?P<split>val|test)2014_(?P<alg>[A-Za-z0-9-]+)_results\.json")
MAX_IDS_SHOWN = 10  # image ids / entry indices a message shows before "... (N more)"
# The server's zip holds 2 files of a few MB each (40,775 captions are ~3.5 MB of JSON); these caps leave room
# and bound what a hostile zip costs.
MAX_MEMBERS = 16
MAX_MEMBER_BYTES = 32 << 20
_UNREADABLE = object()  # what _read_json returns after reporting a problem
# The server scores with pycocoevalcap, whose PTBTokenizer writes the captions one a line (replacing only "\n") as
# UTF-8 for Java's PTB lexer: a line break Java reads as one splits the caption in two and shifts every later
# caption's tokens onto the wrong image, and a lone surrogate cannot be encoded at all. These five are the characters
# that do (tests/test_submission_tokenizer.py runs the real tokenizer on every character Python splits lines at);
# the others Python splits at (U+001C-U+001E, U+0085) the lexer reads inside the line, so they are not refused.
_LINE_BREAK = re.compile("[\r\x0b\x0c\u2028\u2029]")
_SURROGATE = re.compile("[\ud800-\udfff]")
try:
    from lzma import LZMAError
except ImportError:  # a Python built without lzma: zipfile then refuses LZMA members with NotImplementedError
    LZMAError = zlib.error
# What a damaged archive raises besides BadZipFile (a zip cut short or with flipped bytes, as a broken download or
# copy leaves it): a corrupt compressed stream (zlib, lzma), a header's "version needed" beyond this reader
# (NotImplementedError), a member name flagged UTF-8 that is not (UnicodeDecodeError, a ValueError). Each is a
# problem to report, not a traceback from the very command that checks the file.
_DAMAGED = (zipfile.BadZipFile, OSError, EOFError, RuntimeError, NotImplementedError, ValueError, zlib.error,
            LZMAError)


def results_filename(split: str, alg: str) -> str:
    """``captions_{split}2014_{alg}_results.json``; ``split`` is ``val`` or ``test``."""
    if split not in SPLITS:
        raise SubmissionError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(alg, str) or not _ALG_RE.fullmatch(alg):
        raise SubmissionError(f"alg must match [A-Za-z0-9-]+ (it becomes part of the file name), got {alg!r}")
    return f"captions_{split}2014_{alg}_results.json"


def make_zip(zip_path: str | os.PathLike, val_results: str | os.PathLike, test_results: str | os.PathLike) -> Path:
    """Write `zip_path` (the server's `results.zip`) holding the two results files at its root, atomically; its
    bytes depend on the files' names and contents only."""
    paths = [Path(val_results), Path(test_results)]
    for p in paths:
        if not p.is_file():
            raise SubmissionError(f"results file not found: {p}")
    if paths[0].name == paths[1].name:
        raise SubmissionError(f"val and test results have the same file name {paths[0].name!r}")
    # the server finds the files by name: refuse names it would not read rather than zip them
    matches = [_NAME_RE.fullmatch(p.name) for p in paths]
    for p, m, split in zip(paths, matches, SPLITS):
        if not m or m["split"] != split:
            raise SubmissionError(f"{split} results file {p}: its name must be 'captions_{split}2014_<alg>_results.json' "
                                  "with <alg> of [A-Za-z0-9-]+ (the server finds the file by its name)")
    if matches[0]["alg"] != matches[1]["alg"]:
        raise SubmissionError(f"val and test results name different algorithms: {paths[0].name!r}, {paths[1].name!r}")

    def write(f):
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for p in paths:  # a fixed date and mode: the same captions always give the same zip, byte for byte
                info = zipfile.ZipInfo(p.name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type, info.external_attr = zipfile.ZIP_DEFLATED, 0o644 << 16
                zf.writestr(info, p.read_bytes())

    return atomic_write(zip_path, write)


def _preview(values: Iterable[Any], limit: int = MAX_IDS_SHOWN) -> str:
    values = list(values)
    return ", ".join(map(str, values[:limit])) + (f", ... ({len(values) - limit} more)" if len(values) > limit else "")


@dataclass(frozen=True)
class Problem:
    """One thing wrong: `file` is the zip member it concerns (the zip itself for archive-level problems), `kind` a
    stable tag, `message` what a person reads, `image_ids` every image id involved (the message shows a few)."""

    file: str
    kind: str
    message: str
    image_ids: tuple[int, ...] = ()


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

    def kinds(self) -> list[str]:
        return [p.kind for p in self.problems]

    def add(self, file: str, kind: str, message: str, image_ids: Iterable[int] = ()) -> None:
        self.problems.append(Problem(file, kind, message, tuple(image_ids)))

    def __str__(self) -> str:
        if self.ok:
            return f"{self.zip_path}: OK - " + ", ".join(f"{f} ({n} captions)" for f, n in sorted(self.files.items()))
        return "\n".join([f"{self.zip_path}: {len(self.problems)} problem(s)",
                          *(f"  - [{p.kind}] {p.file}: {p.message}" for p in self.problems)])


# What `_check_entries` reports, in this order: key -> (kind, message; {n}: how many, {shown}: the first few).
_ENTRY_PROBLEMS = {
    "not_object": ("not_object", "{n} entries are not JSON objects (entry indices: {shown})"),
    "no_image_id": ("missing_key", "{n} entries have no 'image_id' key (entry indices: {shown})"),
    "no_caption": ("missing_key", "{n} entries have no 'caption' key (entry indices: {shown})"),
    "bad_image_id": ("bad_image_id", "{n} entries have an image_id that is not a non-negative 64-bit int: {shown}"),
    "bad_caption": ("bad_caption", "{n} captions are not strings: {shown}"),
    "empty_caption": ("empty_caption", "{n} empty captions, image ids: {shown}"),
    "line_break": ("caption_line_break", "{n} captions hold a line break other than \\n, which splits the server "
                                         "tokenizer's one-caption-a-line input and shifts later captions onto the "
                                         "wrong images: {shown}"),
    "surrogate": ("caption_not_unicode", "{n} captions hold a lone surrogate (\\ud800-\\udfff), which cannot be "
                                         "encoded as UTF-8 for the server's tokenizer: {shown}"),
    "duplicate_ids": ("duplicate_ids", "{n} image ids appear more than once: {shown}"),
    "missing_ids": ("missing_ids", "missing {n} image ids: {shown}"),
    "extra_ids": ("extra_ids", "{n} image ids are not in the split: {shown}"),
}


def _check_entries(report: ValidationReport, name: str, data: Any, expected: set[int]) -> None:
    """Schema and coverage checks of one decoded results file."""
    if not isinstance(data, list):
        report.add(name, "not_list", f"top-level JSON is {type(data).__name__}, expected a list of "
                                     '{"image_id": int, "caption": str} objects')
        return
    found = {key: [] for key in _ENTRY_PROBLEMS}  # key -> [(what the message shows, image id or None)]
    seen: Counter[int] = Counter()
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            found["not_object"].append((i, None))
            continue
        for key in ("image_id", "caption"):
            if key not in entry:
                found[f"no_{key}"].append((i, None))
        image_id, caption = entry.get("image_id"), entry.get("caption")
        if is_image_id(image_id):
            seen[image_id] += 1
            label = image_id
        else:
            label, image_id = f"entry #{i}", None  # the entry's index names it in messages
            if "image_id" in entry:
                found["bad_image_id"].append((f"{label}: {entry['image_id']!r:.40}", None))
        if "caption" in entry and not isinstance(caption, str):
            found["bad_caption"].append((f"{label}: {caption!r:.40}", image_id))
        elif isinstance(caption, str) and not caption.strip():
            found["empty_caption"].append((label, image_id))
        elif isinstance(caption, str):
            if _LINE_BREAK.search(caption):
                found["line_break"].append((f"{label}: {caption!r:.40}", image_id))
            if not caption.isascii() and _SURROGATE.search(caption):
                found["surrogate"].append((f"{label}: {caption!r:.40}", image_id))
    found["duplicate_ids"] = [(f"{i} (x{seen[i]})", i) for i in sorted(seen) if seen[i] > 1]
    found["missing_ids"] = [(i, i) for i in sorted(expected - seen.keys())]
    found["extra_ids"] = [(i, i) for i in sorted(seen.keys() - expected)]
    for key, (kind, message) in _ENTRY_PROBLEMS.items():
        if found[key]:
            report.add(name, kind, message.format(n=len(found[key]), shown=_preview(text for text, _ in found[key])),
                       [i for _, i in found[key] if i is not None])


def validate_zip(zip_path: str | os.PathLike, val_image_ids: Iterable[int], test_image_ids: Iterable[int],
                 alg: str | None = None) -> ValidationReport:
    """Every problem of a COCO caption server `results.zip`, as a report: at most `MAX_MEMBERS` entries with safe
    names, exactly the two results files at its root with one `alg` (`alg` when given), each UTF-8 JSON of at most
    `MAX_MEMBER_BYTES` (read as a bounded stream: a zip bomb costs no more), with an int64 `image_id` and a
    non-blank `caption` per entry (other keys allowed; no line break but "\\n" and no lone surrogate in a caption:
    the server's tokenizer reads one caption a line, in UTF-8), covering its split's image ids exactly once."""
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
    except _DAMAGED as e:
        report.add(zip_path, "not_zip", f"not a zip archive, or a damaged one ({e})")
        return report
    with zf:
        if (members := _check_members(report, zf)) is None:
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
        if not (m := _NAME_RE.fullmatch(base)):
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
    except _DAMAGED as e:
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
    except RecursionError:  # json recurses per nesting level: a hostile member nests beyond the interpreter's limit
        report.add(name, "not_json", "is JSON nested too deep to read")
    return _UNREADABLE
