"""The study's MLflow experiment, or one of its runs, deleted on the server while the study runs (someone cleaning up
in the MLflow UI): the driver's export thread (`launch.mlflow_export.Export`, the same object export after export)
notices, restores what was deleted, says so in one warning line and goes on; before, its tracker kept the deleted
experiment's and runs' ids, and every later export failed with a traceback until the study ended. Against a real
tracking server (`tests/mlflowserver.py`); no Ray."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections import Counter

import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from dashboards.tracking import TAG_PARENT
from launch.conclusions import tune_trial
from launch.location import StudyLocation
from launch.mlflow_export import Export, end_reason
import tests.mlflowserver as servers
from tests.test_mlflow_export import points, runs_by_trial, trials_of, write_epoch
from tests.test_mlflow_export_edges import spec  # noqa: F401 - a fixture: the smoke study on this server

mlflow_server = servers.mlflow_server  # the real server, a fixture of this module


def study_midway(spec):
    """A study part way: t0 finished (3 epochs, its run settled), t1 running (2 epochs); exported once."""
    location = StudyLocation(spec.name, spec.storage)
    trials = trials_of(location, {"t0": [10.0, 30.0, 20.0], "t1": [12.0, 25.0]}, {"t1": "RUNNING"})
    export = Export(spec, location)
    export.run([tune_trial(t) for t in trials])
    return location, trials, export


def assert_every_epoch_once(spec, expected: dict[str, int]):
    uri = spec.tracking.mlflow_uri
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(spec.name)
    assert exp.lifecycle_stage == "active"
    parent, runs = runs_by_trial(uri, spec.name)
    assert parent is not None and parent.info.lifecycle_stage == "active"
    assert sorted(runs) == sorted(expected)
    for run in runs.values():
        assert run.info.lifecycle_stage == "active" and run.data.tags[TAG_PARENT] == parent.info.run_id
    got = points(uri, spec.name)
    for tid, epochs in expected.items():
        want = Counter(range(1, epochs + 1))
        assert got[tid]["val/CIDEr"] == want and got[tid]["train/loss"] == want, tid
    # one run per trial among every run of the experiment, deleted ones included: nothing made twice
    every = client.search_runs([exp.experiment_id], "tags.`a2.role` = 'trial'", run_view_type=ViewType.ALL)
    assert sorted(r.data.tags["a2.trial_id"] for r in every) == sorted(expected)


def export_after(spec, location, trials, export, caplog):
    """t1's epoch 3 written, exported by the same `Export` (as the driver's thread does); then the study's end,
    exported by it again (t0's run, settled, is written to only then, if at all)."""
    write_epoch(location, trials[1], 3, 33.0)
    with caplog.at_level(logging.WARNING, logger="launch.mlflow_export"):
        export.run([tune_trial(t) for t in trials])  # before: RestException, the deleted run is not 'active'
        trials[1].status = "TERMINATED"
        export.run([tune_trial(t) for t in trials], end_reason(spec.name))


def test_experiment_deleted_while_the_study_runs(spec, caplog):
    location, trials, export = study_midway(spec)
    client = MlflowClient(spec.tracking.mlflow_uri)
    client.delete_experiment(client.get_experiment_by_name(spec.name).experiment_id)
    export_after(spec, location, trials, export, caplog)
    assert_every_epoch_once(spec, {"t0": 3, "t1": 3})
    one_warning(caplog)


def one_warning(caplog):
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("launch.")]
    assert len(warned) == 1 and "deleted; restored" in warned[0].getMessage() and warned[0].exc_info is None


@pytest.mark.parametrize("which", ["t1", "t0", "parent"])
def test_a_run_deleted_while_the_study_runs(spec, caplog, which):
    location, trials, export = study_midway(spec)
    uri = spec.tracking.mlflow_uri
    parent, runs = runs_by_trial(uri, spec.name)
    MlflowClient(uri).delete_run((parent if which == "parent" else runs[which]).info.run_id)
    export_after(spec, location, trials, export, caplog)
    assert_every_epoch_once(spec, {"t0": 3, "t1": 3})
    one_warning(caplog)


def test_a_run_gone_for_good_is_made_again(spec, caplog, mlflow_server):
    """A deleted run that `mlflow gc` then removed cannot be restored: a new tracker makes it again, every epoch in."""
    location, trials, export = study_midway(spec)
    uri = spec.tracking.mlflow_uri
    run_id = runs_by_trial(uri, spec.name)[1]["t1"].info.run_id
    MlflowClient(uri).delete_run(run_id)
    subprocess.run([sys.executable, "-m", "mlflow", "gc", "--backend-store-uri", mlflow_server.backend_uri,
                    "--run-ids", run_id], check=True, timeout=120, capture_output=True,
                   env={**os.environ, "MLFLOW_TRACKING_URI": str(mlflow_server)})
    export_after(spec, location, trials, export, caplog)
    assert_every_epoch_once(spec, {"t0": 3, "t1": 3})
    assert runs_by_trial(uri, spec.name)[1]["t1"].info.run_id != run_id
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("launch.")]
    assert len(warned) == 1 and "gone from the server" in warned[0].getMessage() and warned[0].exc_info is None
