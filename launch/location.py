"""Where a study lives: `<storage>/<name>/`, a folder or `s3://bucket/prefix/<name>/`.

In it: the Tune experiment, `study.yaml` (the resolved spec, all `resume`/`status` need), `trials/`
(`launch.trainable`), `lease.json` (`launch.lease`), `tracking/outage.json` (`launch.mlflow_export`) and
`summary.json` (best trial and configuration, compute, every trial's results; written at the end of `run`/`resume` by
`launch.driver`, with `record-digest.json`, what later reads of the record take of each unchanged trial).
`./.a2/studies/<name>.json` points `resume`/`status` at the study.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from a2core.atomic import atomic_write
from a2core.config import parse_yaml
from a2core.errors import PackageError, StudyError
from launch.spec import DEFAULT_STORAGE, STUDY_FORMAT, StudySpec, validate_study_name
from launch.lease import describe, live_writer
from launch.storage import check_storage, open_location

STUDY_FILE = "study.yaml"
SUMMARY_FILE = "summary.json"
# what the last full read of the record made of each trial, keyed on the files it read (`launch.record.Digest`)
DIGEST_FILE = "record-digest.json"
POINTER_DIR = Path(".a2") / "studies"
REHEARSAL_FILE = "rehearsal.json"  # next to study.yaml in a rehearsal (`launch.rehearse`): the model scores came from
REHEARSAL_BANNER = "REHEARSAL: stand-in trainer, scores drawn from a model (launch.rehearse); not a study result"


@dataclass(frozen=True)
class StudyLocation:
    """`<storage>/<name>`, a local folder or on S3: `at(...)` is the `launch.storage.Location` of a path below."""

    name: str
    storage: str
    endpoint_url: str | None = None

    def at(self, *parts: str):
        return open_location(self.storage, self.endpoint_url).join(self.name, *parts)

    def exists(self, *parts: str) -> bool:
        return self.at(*parts).exists()

    def read_text(self, *parts: str) -> str | None:
        return self.at(*parts).read_text()

    def write_text(self, text: str, *parts: str) -> None:
        self.at(*parts).write_text(text)

    def uri(self, *parts: str) -> str:
        """A path or URI to show people: `s3://bucket/...` for S3 storage."""
        return self.at(*parts).uri


def remember(location: StudyLocation) -> None:
    """Leave `./.a2/studies/<name>.json` so that `resume NAME` / `status NAME` find the study from here."""
    pointer = POINTER_DIR / f"{location.name}.json"
    try:
        atomic_write(pointer, json.dumps(
            {"name": location.name, "storage": location.storage, "storage_endpoint_url": location.endpoint_url,
             "path": location.uri(), "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")
    except OSError as err:  # a read-only working directory must not fail the study
        print(f"a2 study: note: could not write {pointer}: {err}", file=sys.stderr)


def _pointed(pointer: Path) -> tuple[str | None, str | None]:
    """(storage root, endpoint URL) of a pointer file; one that is cut short or damaged is a StudyError naming it."""
    try:
        info = json.loads(pointer.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:
        info = err
    fields = (info.get("storage"), info.get("storage_endpoint_url")) if isinstance(info, dict) else None
    if fields is None or not all(v is None or isinstance(v, str) for v in fields):
        why = f" ({info})" if isinstance(info, Exception) else ""
        raise StudyError(f"{pointer}: the pointer to study {pointer.stem!r} is damaged{why}; delete it (it only "
                         f"says where the study is) or pass --storage ROOT")
    return fields


def locate(name: str, storage: str | None = None) -> StudyLocation:
    """Find study `name`: under `storage` when given, else where the pointer file says, else the default root."""
    check_name(name)
    endpoint = None
    pointer = POINTER_DIR / f"{name}.json"
    if storage is None and pointer.is_file():
        storage, endpoint = _pointed(pointer)
    if storage is None:
        storage = os.environ.get("A2_STUDY_STORAGE") or DEFAULT_STORAGE
    if "://" not in storage:
        storage = os.path.abspath(os.path.expanduser(storage))
    location = StudyLocation(name, storage, endpoint or os.environ.get("A2_STORAGE_ENDPOINT_URL") or None)
    check_storage(location.storage, location.endpoint_url)
    if not location.exists(STUDY_FILE):
        starting = live_writer(location.at())  # a driver holds the lease and has not written study.yaml yet
        if starting is not None:
            raise StudyError(f"study {name!r} at {location.uri()} is starting: its driver ({describe(starting)}) "
                             f"holds its lease and has not written {STUDY_FILE} yet; try again in a few seconds")
        if location.at().listdir():  # a `run` killed before it wrote study.yaml: nothing of it to continue
            raise StudyError(f"study {name!r} at {location.uri()} has no {STUDY_FILE}: its driver stopped before "
                             f"writing it, so it holds nothing to read or resume; `a2 study run STUDY_FILE` starts "
                             f"it again in place")
        raise StudyError(f"no study {name!r} at {location.uri()} (no {STUDY_FILE} there); "
                         f"pass --storage ROOT, the storage root the study was run with")
    return location


def check_name(name: str) -> str:
    """`name` if it is a study's name (the spec's rule: lowercase letters, digits, '-'), which keeps every path made
    from it inside the storage root; else StudyError (exit 2)."""
    try:
        return validate_study_name(name)
    except ValueError as err:
        raise StudyError(f"study name {name!r}: {err}") from None


def study_path(path: str, root: str | Path) -> str:
    """`path` if it exists (or is absolute), else the same relative path below `root` when that exists."""
    if Path(path).is_absolute() or Path(path).exists():
        return path
    below = Path(root).expanduser() / path
    return str(below) if below.exists() else path


def load_saved_spec(location: StudyLocation) -> StudySpec:
    """The StudySpec saved with the study (validated again, so moved data fails here, not in a trial)."""
    source = location.uri(STUDY_FILE)
    try:
        text = location.read_text(STUDY_FILE)
    except UnicodeDecodeError as err:
        raise StudyError(f"{source}: not a study file (not UTF-8 text: {err.reason} at byte {err.start}); restore it "
                         f"from a copy (`a2 study check {location.name}` lists every problem)") from None
    return StudySpec.from_dict(parse_yaml(text, source), source=source, saved=True)


def saved_form(spec) -> dict:
    """The resolved study as a file `load_study` reads back to the same spec: `to_dict()` (its data/model/train
    without the keys the space sets) without train.seed when search.replicates sets it, which the loader would refuse
    as set twice."""
    raw = {**spec.to_dict(), "format": STUDY_FORMAT}
    if spec.replicate_seeds:
        raw["train"].pop("seed", None)
    return raw


def write_summary(location: StudyLocation, summary: dict) -> None:
    location.write_text(json.dumps(summary, indent=2, default=json_default) + "\n", SUMMARY_FILE)


def rehearsal_banner(location: StudyLocation) -> str | None:
    """The line every table of a rehearsal starts with, else None."""
    return REHEARSAL_BANNER if location.exists(REHEARSAL_FILE) else None


def json_default(value):
    return value.item() if hasattr(value, "item") else str(value)  # numpy scalars, else their text


def refuse_rehearsal(location, summary: dict | None = None) -> None:
    """PackageError when the study is a rehearsal: its scores are drawn, its checkpoints hold no weights."""
    if (summary or {}).get("rehearsal") or location.exists(REHEARSAL_FILE):
        raise PackageError(f"study {location.name} at {location.uri()} is a rehearsal (stand-in trainer, drawn "
                           f"scores, no weights): nothing to package; run the study itself with `a2 study run`")
