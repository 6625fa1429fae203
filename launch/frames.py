"""A study's results in Python: `study_frames(name, storage)` reads the study's record from its storage (a local
folder or `s3://`, the reader `a2 study status` and `compare` use) and gives its trials, replicate groups, epochs
and per-image scores as pandas DataFrames (`dashboards.frames.StudyFrames`). Nothing here starts Ray or reads
MLflow. docs/how-to/results-in-python.md shows it at work."""
from __future__ import annotations

from dashboards.frames import StudyFrames
from launch.location import locate
from launch.record import StudyRecord


def study_frames(name: str, storage: str | None = None) -> StudyFrames:
    """The frames of study `name` under the storage root `storage` (a folder or `s3://bucket/prefix`; default:
    where `a2 study run` put it, as `a2 study status` finds it). A study still running gives what its storage
    holds so far (`StudyFrames.study.running` says so); StudyError when there is no such study there."""
    record = StudyRecord.load(locate(name, storage))
    return StudyFrames(record.study(), record.groups())
