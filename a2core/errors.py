"""The one family of user-facing errors. The `a2` command prints an `A2Error` as one line and exits 2; any other
exception is a bug and shows its traceback. Each subclass names what went wrong in its message: the file, key
path, image id or argument at fault.

Subclasses that describe a bad value also derive from `ValueError`, so plain-Python callers of `a2core` can keep
catching that.
"""
from __future__ import annotations

import os


class A2Error(Exception):
    """A problem the user can fix (bad input, missing file, unreachable service); never a bug."""


class ConfigError(A2Error, ValueError):
    """A config or study-spec value is wrong. `path` is the dotted key (`model.lambda`); `source` the file, if any."""

    def __init__(self, path: str, message: str, source: str | None = None):
        self.path, self.source, self.reason = path, source, message
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{path}: {message}" if path else f"{where}{message}")


class DataError(A2Error, ValueError):
    """Captions, image lists or region features are missing or malformed (the message names file and image id)."""


class CheckpointError(A2Error, ValueError):
    """A checkpoint cannot be read safely: missing, corrupt, from another model, or holding disallowed objects."""


class TrainingDiverged(A2Error):
    """Training produced a non-finite loss (`a2core.train`): the run stops there. `epoch` (1-based, the epoch being
    trained), `step` (global optimizer steps done) and `key` (the loss that was not finite) say where."""

    def __init__(self, epoch: int, step: int, key: str, value: float):
        self.epoch, self.step, self.key, self.value = int(epoch), int(step), key, float(value)
        super().__init__(f"training diverged at epoch {self.epoch} step {self.step}: {key} is {value} "
                         "(a learning rate too high? train.lr_factor, train.warmup, train.grad_clip)")


class StorageError(A2Error):
    """Study storage (a local path or s3://) is unreachable, missing, or refused an operation."""


class StudyError(A2Error):
    """A study cannot be run, resumed or read as asked (unknown name, held by another writer, unfinished...)."""


class TrackingError(A2Error, ValueError):
    """The MLflow tracking URI is malformed or its server cannot be used."""


class SubmissionError(A2Error, ValueError):
    """A COCO server submission (results JSON or zip) is invalid; the message lists what is wrong."""


class PackageError(A2Error):
    """Packaging a study into a server submission cannot go on as asked."""


def folder_instead(path, what: str) -> str | None:
    """"PATH: is a folder, not a WHAT" when a folder is where the `what` ("captions file") was to be read, else None
    (the caller's own "not found"): a plain "not found" for a path that is there sends the user looking for it."""
    return f"{path}: is a folder, not a {what}" if os.path.isdir(path) else None
