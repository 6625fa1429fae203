"""A study's saved state checked on read: every file that `resume`, `status` and `summary` read back is parsed
before anything uses it (Tune's experiment state as JSON, its pickles by their opcodes, without running them; the
study file as YAML; every trial's result log), so that a corrupt file is refused naming its storage path, instead of
Tune silently restarting the experiment over it. `a2 study check NAME` also loads every checkpoint.
"""
from __future__ import annotations

import json
import pickletools
import tempfile
from pathlib import Path

import yaml

from a2core.errors import StudyError

# Tune's files at the study's root (experiment state, searcher, callbacks, the Tuner) and how each is read
# (search_gen_state-*.json is a pickle, despite its name).
_ROOT_FILES = (("experiment_state-", ".json", "json"), ("search_gen_state-", ".json", "pickle"),
               ("searcher-state-", ".pkl", "pickle"), ("callback-states-", ".pkl", "pickle"),
               ("tuner", ".pkl", "pickle"))
STUDY_FILE = "study.yaml"  # launch.location.STUDY_FILE
TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of a trial's checkpoints


def _read_bytes(location) -> bytes:
    fs, path = location.filesystem
    with location._errors("read it"), fs.open_input_stream(path) as f:
        return f.readall()


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
        if not isinstance(json.loads(data.decode("utf-8")), list):
            raise ValueError("not a JSON list of results")
    else:  # a pickle: its opcodes to the STOP at its end, nothing in it runs
        ops = list(pickletools.genops(data))
        if not ops or ops[-1][0].name != "STOP":
            raise ValueError("not a whole pickle")


def problem(location, kind: str) -> str | None:
    """What is wrong with the file at `location` read as `kind` (json, jsonl, yaml, results, pickle), or None."""
    try:
        _parse(kind, _read_bytes(location))
    except Exception as err:  # noqa: BLE001 - every way a file can be unreadable is reported the same way
        text = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        return f"{location.uri}: unreadable ({type(err).__name__}: {text})"
    return None


def state_files(study, train_snapshots: bool = True) -> list[tuple[object, str]]:
    """(Location, kind) of the files a resume or a status reads back, below the study folder `study`; with
    `train_snapshots` also Ray Train's checkpoint records of multi-worker trials (read by their resume only)."""
    from launch.trainable import RESULTS_FILE, TRIALS_DIR

    names = study.listdir()
    files = [(study.join(STUDY_FILE), "yaml")] if STUDY_FILE in names else []
    files += [(study.join(n), kind) for n in names for prefix, suffix, kind in _ROOT_FILES
              if n.startswith(prefix) and n.endswith(suffix)]
    trials = study.join(TRIALS_DIR)
    for run in trials.listdir(folders_only=True):
        inside = trials.join(run).listdir()
        files += [(trials.join(run, n), kind) for n, kind in ((RESULTS_FILE, "results"), (TRAIN_SNAPSHOT, "json"))
                  if n in inside and (train_snapshots or n != TRAIN_SNAPSHOT)]
    return files


def refuse_corrupt(study, doing: str) -> None:
    """StudyError (exit 2) naming the first unreadable state file of the study: nothing is run or overwritten.
    `doing`: "resume" or "status" (which leaves out Ray Train's records, rewritten by running trials)."""
    for location, kind in state_files(study, train_snapshots=doing != "status"):
        found = problem(location, kind)
        if found:
            raise StudyError(f"{found}; {doing} refused, nothing was run or changed: restore the file from a copy, "
                             f"or run the study again under a new name (`a2 study check NAME` lists every problem)")


def checkpoint_problem(location) -> str | None:
    """Why the checkpoint file at `location` cannot be loaded (a2core's own loader, weights_only), or None."""
    from a2core import checkpoint
    from a2core.errors import CheckpointError

    with tempfile.TemporaryDirectory(prefix="a2-check-") as tmp:
        try:
            local = Path(location.uri) if location.local else location.download(Path(tmp) / "checkpoint.pt")
            checkpoint.load(local)
        except (CheckpointError, OSError) as err:
            return f"{location.uri}: {str(err).replace(str(local) + ': ', '') if location.local else err}"
    return None


def quick_checkpoint_problem(location) -> str | None:
    """A cheap look at a local checkpoint file (no weights read): a zip whose directory is whole and whose members
    fit in the file. A truncated file fails it; `checkpoint_problem` reads everything. S3 objects: None (not read)."""
    import zipfile

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
    """Every checkpoint file of the study's trials (`trials/<run>/checkpoint_epochNNNN/checkpoint.pt`)."""
    from launch.trainable import CHECKPOINT_FILE, TRIALS_DIR, checkpoint_epochs, checkpoint_name

    trials = study.join(TRIALS_DIR)
    return [trials.join(run, checkpoint_name(e), CHECKPOINT_FILE) for run in trials.listdir(folders_only=True)
            for e in checkpoint_epochs(trials.join(run))
            if trials.join(run, checkpoint_name(e), CHECKPOINT_FILE).exists()]


def cmd_check(args) -> int:
    """`a2 study check NAME`: every state file and every checkpoint of the study; exit 2 when one is unreadable."""
    from launch.location import locate

    study = locate(args.name, args.storage).at()
    files = state_files(study)
    checkpoints = checkpoint_files(study)
    problems = [p for p in (problem(loc, kind) for loc, kind in files) if p]
    problems += [p for p in map(checkpoint_problem, checkpoints) if p]
    for line in problems:
        print(f"unreadable: {line}")
    print(f"study {args.name} at {study.uri}: {len(files)} state files and {len(checkpoints)} checkpoints checked, "
          + (f"{len(problems)} unreadable (restore them from a copy; a trial resumes from its newest readable "
             f"checkpoint)" if problems else "all readable"))
    return 2 if problems else 0
