"""A study's saved state checked on read: every file that `resume`, `status` and `summary` read back is parsed
before anything uses it (Tune's experiment state as JSON; its pickles read to their end with a stand-in for every
class they name, so that nothing in them runs; the study file as YAML; every trial's result log), so that a corrupt
file is refused naming its storage path, instead of Tune silently restarting the experiment over it. `a2 study check
NAME` also loads every checkpoint.

`experiment_trials` reads Tune's trials from its experiment state without Ray (what `status`, `compare` and `report`
read of it), with plain JSON: the pickles Tune embeds in that file are never loaded.

Tune copies its own files into the storage with a plain copy, not an atomic one, so a disk filling during that copy
leaves one cut short. `WholeCopies` keeps a whole copy of each of them while a study runs (`state-copies/`), and
`a2 study resume NAME --restore-state` puts such a copy back over the file cut short, saying which.
"""
from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
import pickle
import pickletools
import re
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

import yaml

from a2core.checksum import checksum_problem
from a2core.config import Config
from a2core.errors import A2Error, CheckpointError, StorageError, StudyError
from dashboards.runs import Trial
from launch.layout import (CHECKPOINT_FILE, RESULTS_FILE, TRAIN_SNAPSHOT, TRIALS_DIR, TUNE_POINTER_FILE,
                           checkpoint_epochs, checkpoint_name, results_by_epoch, seed_trials)
from launch.lease import held_lease
from launch.location import STUDY_FILE, load_saved_spec

# The one place that knows Ray's private state layout (the Ray adapter): Tune's files at the study's root (experiment
# state, searcher, callbacks, the Tuner) as Ray 2.60 names them (`TuneController`, `SearchGenerator`, `Searcher`,
# `CallbackList` CKPT_FILE_TMPL and `tuner_internal._TUNER_PKL`), and how each is read (search_gen_state-*.json is a
# pickle, despite its name), and where the experiment state keeps each trial's checkpoint record (a cloudpickle in hex
# inside its JSON: `tune_checkpoint_paths`). tests/test_adapters.py and tests/test_checkpoint_windows.py hold them
# against the installed Ray, and pyproject.toml allows only the Ray release they were read from.
TESTED_RAY = "2.60"
CALLBACK_STATES = "callback-states-"  # Tune's CallbackList CKPT_FILE_TMPL: read from staging after the searcher
_ROOT_FILES = (("experiment_state-", ".json", "json"), ("search_gen_state-", ".json", "pickle"),
               ("searcher-state-", ".pkl", "pickle"), (CALLBACK_STATES, ".pkl", "pickle"),
               ("tuner", ".pkl", "pickle"))
# A study that is running is read while its driver writes it: Tune copies its state files over themselves (truncate,
# then write), so one read mid-copy is cut short for a moment. A reader (`a2 study check`, `status`) that finds a file
# unreadable while a driver holds the lease reads it again this much later, and names it only when it still is.
RECHECK_S = 2.0
COPIES_DIR = "state-copies"  # below the study: the last whole copy of each of Tune's root files


def _read_bytes(location) -> bytes:
    """The file's bytes (`Location.read_bytes`); a missing file is a StorageError naming it."""
    data = location.read_bytes()
    if data is None:
        raise StorageError(f"{location.uri}: cannot read it: no such file")
    return data


def _parse(kind: str, data: bytes) -> None:
    """Raise ValueError when `data` is not a whole file of `kind`."""
    if not data:
        raise ValueError("empty file")
    if kind == "json":
        json.loads(data.decode("utf-8"))
    elif kind == "jsonl":
        for line in data.decode("utf-8").splitlines():
            if line.strip():
                json.loads(line)
    elif kind == "yaml":
        if not isinstance(yaml.safe_load(data.decode("utf-8")), dict):
            raise ValueError("not a YAML mapping")
    elif kind == "results":
        results_by_epoch(data.decode("utf-8"))  # the result log's reader: ValueError unless a JSON list
    else:  # a pickle, read to its STOP by C's unpickler with every class it names a stand-in: nothing in it runs
        try:
            _StandInUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError) as err:
            raise ValueError(f"not a whole pickle ({err})") from None


class _StandInType(type):
    """The type of `_StandIn`: calling it, building it, setting items on it or taking any attribute of it gives
    `_StandIn` itself, so that it serves wherever a pickle puts a class, a function or an object."""

    def __call__(cls, *args, **kwargs):
        return cls

    def __getattr__(cls, name):  # __setstate__, extend, append, add, a method the pickle calls
        return cls

    def __setitem__(cls, key, value):
        pass


class _StandIn(metaclass=_StandInType):
    """What every class or function a checked pickle names becomes: it keeps nothing and runs nothing."""

    def __new__(cls, *args, **kwargs):  # NEWOBJ calls this directly
        return cls


class _StandInUnpickler(pickle.Unpickler):
    """C's unpickler with no import: `find_class` gives `_StandIn` for every name. (About ten times faster than
    walking the opcodes with `pickletools`, which took 0.35 s of every `status` on Tune's 1.2 MB searcher state at
    2,000 trials: benchmarks/RESULTS.md.)"""

    def find_class(self, module, name):
        return _StandIn


def problem(location, kind: str) -> str | None:
    """What is wrong with the file at `location` read as `kind` (json, jsonl, yaml, results, pickle), or None."""
    try:
        _parse(kind, _read_bytes(location))
    except Exception as err:  # noqa: BLE001 - every way a file can be unreadable is reported the same way
        return _unreadable(location, err)
    return None


def _unreadable(location, err: Exception) -> str:
    text = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
    return f"{location.uri}: unreadable ({type(err).__name__}: {text})"


def state_files(study) -> list[tuple[object, str]]:
    """(Location, kind) of the files a resume or a status reads back, below the study folder `study`: its root files,
    the trials' result logs and Ray Train's checkpoint records of multi-worker trials (read by their resume only)."""
    files = root_files(study)
    trials = study.join(TRIALS_DIR)
    for run in trials.listdir(folders_only=True):
        inside = trials.join(run).listdir()
        files += [(trials.join(run, n), kind) for n, kind in ((RESULTS_FILE, "results"), (TRAIN_SNAPSHOT, "json"))
                  if n in inside]
    return files


def root_files(study) -> list[tuple[object, str]]:
    """(Location, kind) of the state files at the top of the study folder `study`: its saved spec, Tune's files."""
    names = study.listdir()
    files = [(study.join(STUDY_FILE), "yaml")] if STUDY_FILE in names else []
    return files + [(study.join(n), _root_kind(n)) for n in names if _root_kind(n)]


def refuse_corrupt(study, doing: str) -> None:
    """StudyError (exit 2) naming the first unreadable state file of the study: nothing is run or overwritten.
    `doing`: "resume" or "status". A status checks only the study's root files here: it leaves out Ray Train's
    records (rewritten by running trials), Tune's experiment states (it reads the newest one with
    `experiment_trials`, which refuses it the same way) and the trials' result logs (its read of the record refuses
    each as it reads it: `launch.record.StudyRecord.load(refuse=...)`). Parsing each twice cost about 1 s at 1,000
    trials. A file with a whole copy in `state-copies/` says how to put it back."""
    for location, kind in (root_files(study) if doing == "status" else state_files(study)):
        if doing == "status" and fnmatch.fnmatch(location.uri.rsplit("/", 1)[-1], EXPERIMENT_STATE):
            continue
        found = problem(location, kind)
        if found:
            raise StudyError(_refusal(study, location, kind, found, doing))


def refuse_unreadable(study, location, kind: str, err: Exception, doing: str) -> None:
    """The StudyError of `refuse_corrupt` for the file at `location`, found unreadable (`err`) by its reader."""
    raise StudyError(_refusal(study, location, kind, _unreadable(location, err), doing))


def _refusal(study, location, kind: str, found: str, doing: str) -> str:
    """The line refusing the unreadable state file at `location` (`found`: what is wrong with it)."""
    copy = _whole_copy(study, location, kind)
    fix = (f"a whole copy of it is at {copy.uri}: `a2 study resume {study.uri.rstrip('/').rsplit('/', 1)[-1]} "
           f"--restore-state` puts it back" if copy else "restore the file from a copy")
    return (f"{found}; {doing} refused, nothing was run or changed: {fix}, or run the study again under a new name "
            f"(`a2 study check NAME` lists every problem)")


def _root_kind(name: str) -> str | None:
    """How Tune's root file `name` is read (json, pickle), or None for another file."""
    return next((kind for prefix, suffix, kind in _ROOT_FILES if name.startswith(prefix) and name.endswith(suffix)),
                None)


def keep_out_of_tunes_uploads(staging: str) -> list[str]:
    """Remove from Tune's local staging folder of a resumed study (`staging`, its driver_artifacts) every top-level
    .json or .pkl file but the callback states (which Tune reads from there next). Tune 2.60's restore copies every
    .json and .pkl at the experiment's root there (`_ExperimentCheckpointManager.sync_down_experiment_state`), and
    each later experiment checkpoint copies the folder back over the study, plainly (truncate, then write):
    - a2's root files (lease.json, summary.json, rounds.json, record-digest.json, data-fingerprint.json) went back to
      their restore-time copies: a heartbeat read mid-copy found the lease empty, the adaptive round went back;
    - Tune's own files of the session it restored (experiment state, searcher states, `tuner.pkl`, all read by then)
      were copied over themselves, a kill in the middle leaving one cut short.
    The names removed; nothing when `staging` holds the study's own `study.yaml` (the study's folder itself)."""
    folder = Path(staging)
    if not folder.is_dir() or (folder / STUDY_FILE).exists():
        return []
    removed = []
    for entry in sorted(folder.iterdir()):
        if entry.is_file() and entry.suffix in (".json", ".pkl") and not entry.name.startswith(CALLBACK_STATES):
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


def _whole_copy(study, location, kind: str):
    """The whole copy of the root file at `location` in `state-copies/`, or None (none, or not whole either)."""
    name = location.uri.rsplit("/", 1)[-1]
    if _root_kind(name) is None:
        return None
    copy = study.join(COPIES_DIR, name)
    return copy if copy.exists() and problem(copy, kind) is None else None


def refuse_unmendable(study, doing: str) -> None:
    """`refuse_corrupt` for what `restore_whole_copies` cannot mend: the first unreadable state file without a whole
    copy, refused before any copy is put back (a refused resume leaves the study as it was)."""
    for location, kind in state_files(study):
        found = problem(location, kind)
        if found and _whole_copy(study, location, kind) is None:
            raise StudyError(_refusal(study, location, kind, found, doing))


def restore_whole_copies(study) -> list[str]:
    """Put the whole copy back over each of Tune's root files that is unreadable; one line per file put back. Only
    root files have copies: the trials' files are not read here."""
    restored = []
    for location, kind in root_files(study):
        copy = _whole_copy(study, location, kind) if problem(location, kind) else None
        if copy is not None:
            location.write_text(_read_bytes(copy))
            restored.append(f"restored {location.uri} from its whole copy {copy.uri}")
    return restored


class WholeCopies:
    """While a study runs, every `period` s and at its end: a copy of each of Tune's root files that changed (its
    size or time), reads whole and differs from its copy, written atomically into `state-copies/`. A copy that cannot
    be written (the disk full) is left as it was: the last whole one stays."""

    def __init__(self, study, period: float = 2.0):
        self.study, self.period = study, period
        self.seen: dict[str, tuple] = {}  # name -> (size, mtime) last read
        self.saved: dict[str, str] = {}  # name -> sha256 of its copy (an experiment state can be megabytes)
        self.failed = False  # said once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="a2-state-copies", daemon=True)

    def save(self) -> list[str]:
        """Copy the root files that changed, read whole and differ from their copies; their names."""
        copied = []
        for name, stamp in self.study.file_stamps().items():
            kind = _root_kind(name)
            if kind is None or self.seen.get(name) == stamp:
                continue
            data = _read_bytes(self.study.join(name))
            try:
                _parse(kind, data)
            except Exception:  # noqa: BLE001 - cut short or being written: the last whole copy stays
                continue
            digest = hashlib.sha256(data).hexdigest()
            if self.saved.get(name) != digest:
                self.study.join(COPIES_DIR, name).write_text(data)
                self.saved[name] = digest
                copied.append(name)
            self.seen[name] = stamp
        return sorted(copied)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._save_quietly()

    def _save_quietly(self) -> None:
        lease = held_lease(self.study.uri)
        if lease is not None and lease.lost.is_set():  # superseded: the study's files are its new writer's
            return
        try:
            self.save()
        except Exception as err:  # noqa: BLE001 - a storage problem stops the study elsewhere, with its own line
            if not self.failed:
                print(f"a2 study: note: whole copies of Tune's state not updated (the last ones stay): "
                      f"{str(err).splitlines()[0][:200]}", file=sys.stderr, flush=True)
            self.failed = True

    def __enter__(self) -> "WholeCopies":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._save_quietly()


# -- Tune's trials, read from its experiment state without Ray --------------------------------------------------------
EXPERIMENT_STATE = "experiment_state-*.json"  # TuneController.CKPT_FILE_TMPL.format("*"), as Ray looks for it
_PICKLED = "CLOUDPICKLE_FALLBACK"  # a value Tune could only cloudpickle (`ray.tune.utils.serialization`), in hex
_STATES = ("PENDING", "RUNNING", "PAUSED", "TERMINATED", "ERROR")  # ray.tune.experiment.Trial's


def newest_experiment_state(study):
    """The experiment state Ray reads of the study folder `study` (a Location): of its `experiment_state-<time>.json`
    files, the one whose name sorts last (the time stamp: `ray.tune.execution.experiment_state.
    _find_newest_experiment_checkpoint`); None when Tune has saved none yet."""
    names = fnmatch.filter(study.listdir(), EXPERIMENT_STATE)
    return study.join(max(names)) if names else None


def experiment_trials(study) -> list[Trial] | None:
    """The trials of the study folder `study` as Tune saved them, each exactly as `launch.conclusions.tune_trial`
    makes it of `ray.tune.ExperimentAnalysis(study).trials`, in Tune's order; None when Tune has saved no experiment
    state yet. One read of the newest experiment state (`newest_experiment_state`) and, for a trial with an error
    file, two of that file: nothing per epoch (ExperimentAnalysis also reads every trial's `result.json`).

    The file (`TuneController.save_to_dir`) is `{"trial_data": [[trial state, run metadata], ...], ...}`, both JSON
    texts (`Trial.get_json_state`). Read with plain `json`: the values Tune pickled into it (`CLOUDPICKLE_FALLBACK`,
    e.g. the trial's storage and checkpoint manager) are never unpickled, unpickling runs code. What a trial is made
    of is plain JSON: its id, trainable, name, status, config and folder (`relative_logdir`); its failures, error
    file and last result, the first fields of its run metadata, which is read no further (`_leading_values`). A
    pickled value inside the last result is left out of it; one in the other fields, or a file that does not read
    as an experiment state, is a StudyError naming the file."""
    location = newest_experiment_state(study)
    if location is None:
        return None
    try:
        return _trials_of_state(study, location)
    except ValueError as err:  # json's JSONDecodeError and UnicodeDecodeError too
        raise StudyError(_refusal(study, location, "json", _not_a_state(location, err), "reading it")) from err


def experiment_state_problem(study) -> str | None:
    """What `experiment_trials` refuses in the newest experiment state of the study folder `study`, which reads as
    JSON (one that does not is `problem`'s), or None: `a2 study check` names what `status` would refuse."""
    location = newest_experiment_state(study)
    if location is None or problem(location, "json") is not None:
        return None
    try:
        _trials_of_state(study, location)
    except ValueError as err:
        return _not_a_state(location, err)
    return None


def _not_a_state(location, err: Exception) -> str:
    return f"{location.uri}: not a readable Tune experiment state ({str(err).splitlines()[0][:200]})"


def _trials_of_state(study, location) -> list[Trial]:
    """The trials of the experiment state at `location` (`experiment_trials`); ValueError when it does not read."""
    text = _read_bytes(location)
    trials = []
    document = json.loads(text.decode("utf-8"))
    entries = document.get("trial_data") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ValueError("no trial_data list in it")
    for n, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
            raise ValueError(f"trial_data[{n}] is not a [trial state, run metadata] pair of JSON texts")
        state = json.loads(entry[0])
        if not isinstance(state, dict):
            raise ValueError(f"trial_data[{n}] trial state is not a JSON object")
        metadata = _leading_values(entry[1], _RUN_METADATA_KEYS, f"trial_data[{n}] run metadata")
        trials.extend(seed_trials(_tune_trial(study, state, metadata, n)))  # a fused trial's seeds apart
    return trials


_RUN_METADATA_KEYS = ("num_failures", "error_filename", "last_result")  # all a trial is made of, of its run metadata


def _leading_values(text: str, keys: tuple[str, ...], what: str) -> dict:
    """Of the JSON object `text`, the values of `keys`, read key by key from its start and no further than the last
    of them is found: Tune writes a trial's run metadata (`_TrainingRunMetadata.get_json_state`) with its small fields
    first and its per-metric statistics and pickled checkpoint record after them, which are never parsed (at 1,000
    trials they are most of the experiment state). The values Tune pickled into these are left out, never loaded."""
    decoder, left = _pickle_free_decoder()
    found: dict = {}
    i = _space(text, 0)
    if text[i:i + 1] != "{":
        raise ValueError(f"{what} is not a JSON object")
    i = _space(text, i + 1)
    closed = text[i:i + 1] == "}"
    while not closed and not all(key in found for key in keys):
        key, i = decoder.raw_decode(text, i)
        i = _space(text, i)
        if not isinstance(key, str) or text[i:i + 1] != ":":
            raise ValueError(f"{what} is not a JSON object (at character {i})")
        value, i = decoder.raw_decode(text, _space(text, i + 1))
        if value is _LEFT_OUT:  # a field Tune pickled whole
            left[0] -= 1
        else:
            found[key] = value
        i = _space(text, i)
        closed = text[i:i + 1] == "}"
        if not closed and text[i:i + 1] != ",":
            raise ValueError(f"{what} is not a JSON object (at character {i})")
        i = _space(text, i + 1)
    return _unpickled_part(found) if left[0] else found  # pickled values inside lists: taken out here


_LEFT_OUT = object()  # what a value Tune pickled reads as, until it is left out of what holds it


def _space(text: str, i: int) -> int:
    """The index of the first character at or after `i` that is not JSON whitespace."""
    return json.decoder.WHITESPACE.match(text, i).end()


def _pickle_free_decoder() -> tuple[json.JSONDecoder, list[int]]:
    """A JSON decoder that reads each value Tune pickled as `_LEFT_OUT` and leaves it out of the object holding it,
    and [how many it read that are still in place: inside lists, or the value decoded itself]."""
    left = [0]

    def hook(obj: dict):
        if obj.get("_type") == _PICKLED:
            left[0] += 1
            return _LEFT_OUT
        if _LEFT_OUT in obj.values():
            kept = {k: v for k, v in obj.items() if v is not _LEFT_OUT}
            left[0] -= len(obj) - len(kept)
            return kept
        return obj

    return json.JSONDecoder(object_hook=hook), left


def _tune_trial(study, state: dict, metadata: dict, n: int) -> Trial:
    """One trial of `trial_data[n]` as `tune_trial` makes it of the Tune `Trial` that Ray restores from it
    (`Trial.from_json_state(stub=True)`, `restore_run_metadata`); `metadata`: the leading fields of its run metadata,
    with the values Tune pickled left out."""
    def read(record: dict, key: str, kinds: tuple, default=None):
        value = record.get(key, default)
        if _pickled_inside(value):
            raise ValueError(f"trial_data[{n}] {key} holds a value Tune pickled ({_PICKLED}), which a2 never loads")
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
            raise ValueError(f"trial_data[{n}] {key} is {type(value).__name__}, not {kinds[0].__name__}")
        return value

    trial_id, trainable = read(state, "trial_id", (str,)), read(state, "trainable_name", (str,))
    custom = read(state, "custom_trial_name", (str, type(None)))
    config = read(state, "config", (dict, type(None))) or {}  # Trial.__init__'s `config or {}`
    status = read(state, "status", (str,))
    if status not in _STATES:
        raise ValueError(f"trial_data[{n}] status is {status!r}, not one of {', '.join(_STATES)}")
    failures = read(metadata, "num_failures", (int,), 0)
    error_file = read(metadata, "error_filename", (str, type(None)))
    last_result = metadata.get("last_result") or {}
    if not isinstance(last_result, dict):
        raise ValueError(f"trial_data[{n}] last_result is {type(last_result).__name__}, not dict")
    # Trial.__setstate__: a trial saved RUNNING is restored PENDING; Trial.last_result: it names its trial
    status = "PENDING" if status == "RUNNING" else status
    last_result.setdefault("trial_id", trial_id)
    # Trial.__str__ (`_trainable_name(include_trial_id=True)`)
    env = f"_{config['env']}" if "env" in config else ""
    name = custom or f"{trainable}{env}_{trial_id}".replace("/", "_")
    folder = state.get("relative_logdir")  # the trial's folder below the experiment: Ray's trial_fs_path
    lines = _error_lines(study, folder, error_file, status)
    return Trial(trial_id, name=name, state=status, sampled=dict(config), retries=failures,
                 error=lines[-1][:500] if lines else None, last_result=last_result)


def _error_lines(study, folder, error_file: str | None, status: str) -> list[str]:
    """The lines of the trial's error file (`Trial.get_error`: none when its run metadata names none or the file is
    gone), or ["the trial failed"] for an ERROR trial whose file cannot be read (`tune_trial`)."""
    if error_file is None:
        return []
    try:
        if not isinstance(folder, str):
            raise TypeError("no trial folder")
        text = study.join(folder, error_file).read_text()
        return [] if text is None else text.strip().splitlines()
    except Exception:  # noqa: BLE001 - as tune_trial: the error file may be gone with its node
        return ["the trial failed"] if status == "ERROR" else []


def _pickled_inside(value) -> bool:
    if isinstance(value, dict):
        return value.get("_type") == _PICKLED or any(_pickled_inside(v) for v in value.values())
    return isinstance(value, list) and any(_pickled_inside(v) for v in value)


def _unpickled_part(value):
    """`value` without the `_LEFT_OUT` values in it (dicts and lists walked)."""
    if isinstance(value, dict):
        return {k: _unpickled_part(v) for k, v in value.items() if v is not _LEFT_OUT}
    if isinstance(value, list):
        return [_unpickled_part(v) for v in value if v is not _LEFT_OUT]
    return value


# -- Tune's pointer checkpoints ------------------------------------------------------------------------------------
_TUNE_CHECKPOINT = re.compile(r"/checkpoint_\d{6}$")  # the storage path of a trial's Tune checkpoint folder


def tune_checkpoint_paths(text: str) -> set[str]:
    """The storage paths of the trial checkpoints (`checkpoint_NNNNNN`) an experiment state's text names. Tune keeps
    each trial's checkpoint record as a cloudpickle in hex (`CLOUDPICKLE_FALLBACK`, `ray.tune.utils.serialization`)
    inside JSON inside JSON: the paths are read from its opcodes' string arguments, nothing in it is run. This is
    the one place that reads that internal (checked against the pinned Ray by tests/test_checkpoint_windows.py)."""
    found: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, str):
            if value[:1] in "{[":
                try:
                    walk(json.loads(value))
                except ValueError:
                    pass
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            if value.get("_type") == _PICKLED and isinstance(value.get("value"), str):
                try:
                    ops = list(pickletools.genops(bytes.fromhex(value["value"])))
                except ValueError:
                    return
                found.update(arg for _, arg, _ in ops if isinstance(arg, str) and _TUNE_CHECKPOINT.search(arg))
                return
            for item in value.values():
                walk(item)

    try:
        walk(json.loads(text or "{}"))
    except ValueError:
        pass  # an unreadable state is `refuse_corrupt`'s
    return found


def put_back_tune_pointers(study) -> list[str]:
    """Put back, as an empty pointer, each trial checkpoint folder that the study's Tune experiment state names and
    the storage no longer has; returns a line for each. A driver killed after Tune saved a trial's newer checkpoint
    and deleted the one its last saved state names left the trial unrestorable ("Could not recover from checkpoint
    as it does not exist on storage anymore"), though a2's own checkpoints are all there: a trial resumes from the
    newest readable one of its run folder (`launch.trainable`), never from Tune's pointer, so an empty one serves."""
    lines = []
    for name in fnmatch.filter(study.listdir(), EXPERIMENT_STATE):
        for path in sorted(tune_checkpoint_paths(study.join(name).read_text())):
            folder = study.on_same_storage(path)  # Tune's path, as its filesystem names it
            if folder.exists():
                continue
            folder.join(TUNE_POINTER_FILE).write_text(json.dumps({"train_checkpoint": None, "put_back": True}))
            lines.append(f"Tune's record names {path}, which is gone (a driver killed between saving a checkpoint "
                         f"and deleting the one before): put back as a pointer; the trial resumes from its own "
                         f"newest readable checkpoint")
    return lines


def checkpoint_problem(location, model: dict | None = None, searched: tuple = ()) -> str | None:
    """Why the checkpoint file at `location` cannot be loaded (a2core's own loader, weights_only), or is not the
    model `model` (a config's model section; `model_mismatch`, its keys in `searched` left out), or None."""
    from a2core import checkpoint  # torch: as in `model_mismatch`

    if _dangling(location):  # else "checkpoint not found", which says nothing of the link
        return f"{location.uri}: a link to {os.readlink(location.uri)}, which is not there"
    with tempfile.TemporaryDirectory(prefix="a2-check-") as tmp:
        try:
            local = Path(location.uri) if location.local else location.download(Path(tmp) / "checkpoint.pt")
            state = checkpoint.load(local)  # a local file's SHA-256 beside it is checked there
            damaged = not location.local and checksum_problem(local, location.recorded_checksum(), str(local))
            if damaged:
                raise CheckpointError(damaged)
        except (CheckpointError, OSError) as err:
            return f"{location.uri}: {str(err).replace(str(local) + ': ', '') if location.local else err}"
    try:
        mismatch = model_mismatch(state, model, searched)
    except (AttributeError, TypeError, ValueError, RuntimeError) as err:  # its keys hold what a2 never writes there
        text = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        return f"{location.uri}: not a checkpoint a2tune wrote ({type(err).__name__}: {text})"
    return None if mismatch is None else f"{location.uri}: {mismatch}"


def _dangling(location) -> bool:
    """The local file at `location` is a symbolic link to nothing (a moved or unmounted target)."""
    return location.local and os.path.islink(location.uri) and not os.path.exists(location.uri)


def model_mismatch(state: dict, model: dict | None = None, searched: tuple = ()) -> str | None:
    """Why a loaded checkpoint (its dict) is not a model of the config section `model`: its own model config
    differs at a key (the first one, sorted; the keys in `searched`, a study's searched `model.` keys, are each
    trial's own), or its weights do not fit its own config (names or shapes: a swapped or hand-edited file, which
    would fail later as a long size-mismatch traceback; looked at first). None when it is that model. Shapes only: the model is built
    on torch's meta device, no memory for weights."""
    # torch: only when a checkpoint is read in full (`a2 study check`, packaging); `a2 study status` imports this
    # module for its quick check (launch.record)
    import torch

    from a2core.model.a2 import build_model

    try:
        saved = Config.from_dict(state["config"], saved=True)
    except (A2Error, KeyError, TypeError) as err:
        return f"its config does not read ({str(err).splitlines()[0][:200]})"
    weights = state.get("model")
    if not isinstance(weights, dict):
        return "no model weights in it"
    with torch.device("meta"):
        built = build_model(saved.model, len(state.get("vocab") or []), saved.longest_caption).state_dict()
    for name in sorted(set(built) | set(weights)):
        if name not in weights or name not in built:
            return (f"its weights do not fit its own config ({name} is {'missing' if name in built else 'extra'}; "
                    f"model.d_model {saved.model.d_model}, model.layers {saved.model.layers})")
        if tuple(weights[name].shape) != tuple(built[name].shape):
            return (f"its weights do not fit its own config ({name} is {tuple(weights[name].shape)}, the config "
                    f"makes {tuple(built[name].shape)}: model.d_model {saved.model.d_model})")
    return None if model is None else _other_model(saved, model, searched)


def _other_model(saved, model: dict, searched: tuple) -> str | None:
    """The first key (sorted) at which the checkpoint's model config `saved` differs from the study's `model`."""
    have, want = saved.model.model_dump(by_alias=True), Config.from_dict({"model": model}).model.model_dump(
        by_alias=True)
    for key in sorted(set(have) | set(want)):
        if f"model.{key}" not in searched and have.get(key) != want.get(key):
            return (f"a model of another config: model.{key} is {have.get(key)!r} in the checkpoint, "
                    f"{want.get(key)!r} in the study")


def quick_checkpoint_problem(location) -> str | None:
    """A cheap look at a local checkpoint file (no weights read): a zip whose directory is whole and whose members
    fit in the file. A truncated file fails it; `checkpoint_problem` reads everything. S3 objects: None (not read)."""
    if not location.local:
        return None
    try:
        with zipfile.ZipFile(location.uri) as archive:
            if sum(i.compress_size for i in archive.infolist()) > Path(location.uri).stat().st_size:
                raise zipfile.BadZipFile("members larger than the file")
    except (zipfile.BadZipFile, OSError) as err:
        return f"{location.uri}: unreadable checkpoint ({err})"
    return None


def checkpoint_files(study) -> list:
    """Every checkpoint file of the study's trials (`trials/<run>/checkpoint_epochNNNN/checkpoint.pt`), a link to a
    file that is not there included (`checkpoint_problem` names it; a folder without the file is a copy cut short,
    its file copied last, which no reader takes for a checkpoint)."""
    trials = study.join(TRIALS_DIR)
    return [file for run in trials.listdir(folders_only=True) for e in checkpoint_epochs(trials.join(run))
            if (file := trials.join(run, checkpoint_name(e), CHECKPOINT_FILE)).exists() or _dangling(file)]


def gone(location) -> bool:
    """The checkpoint file at `location` is no longer there, not even as a link: deleted since it was listed (a
    running trial keeps only its newest checkpoints, `launch.trainable`)."""
    return not location.exists() and not _dangling(location)


def study_model(location) -> tuple[dict | None, tuple]:
    """The model section every checkpoint of the study should match, and its searched `model.` keys (each trial's
    own); (None, ()) when the saved spec cannot be read (its own check says why)."""
    try:
        spec = load_saved_spec(location)
    except StudyError:
        return None, ()
    return spec.base["model"], tuple(p.path for p in spec.params.values())
