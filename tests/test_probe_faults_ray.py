"""The driver's part of the faults of tests/test_probe_faults.py, on a real tiny study (one trial, a local Ray): a
driver whose lease another host's `resume --force` took over stops at its next result, with one line, nonzero exit,
no summary and its MLflow run left to the new writer; the study then resumes to its end, with its data fingerprint
(written at the start), every checkpoint's SHA-256 beside it and a summary whose paths are relative to its folder."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from a2core.checksum import SUFFIX, file_sha256, recorded_sha256
from launch.fingerprint import FINGERPRINT_FILE
from launch.lease import LEASE_FILE
from tests.raycluster import (  # noqa: F401 - tiny_data is a fixture
    a2, kill_group, mlflow_trials, start_a2, tail, tiny_data, tiny_study, trial_runs, wait_for)
from tests.test_interruptions import duplicated_points, epoch_logged, local_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _lease_of_another_host(study_dir: Path, age: float = 0.0) -> None:
    """What a `resume --force` on another host writes (atomically, as `launch.lease` does), `age` s ago."""
    tmp = study_dir / ".lease.tmp"
    tmp.write_text(json.dumps({"user": "someone", "host": "elsewhere", "pid": 4242, "token": "theirs",
                               "started": "2026-01-01T00:00:00Z", "heartbeat": time.time() - age,
                               "stale_after": 120.0, "every": 30.0}))
    os.utime(tmp, (time.time() - age, time.time() - age))
    os.replace(tmp, study_dir / LEASE_FILE)


def test_a_superseded_driver_stops_before_its_next_write_and_the_study_resumes(tmp_path, tiny_data):  # noqa: F811
    name, storage = "sup", tmp_path / "studies"
    data = {"kind": "coco", "captions": str(tiny_data / "dataset_coco.json"),
            "features": str(tiny_data / "features.h5"), "test_images": str(tiny_data / "image_info_test2014.json")}
    study = tiny_study(tmp_path, name, tiny_data, epochs=4, workers=1, cpus_per_worker=1.0, extra={"data": data})
    env, log = local_env(tmp_path), tmp_path / "run.log"
    proc = start_a2("study", "run", str(study), cwd=tmp_path, log=log, env=env)
    try:
        wait_for(lambda: epoch_logged(storage, name, epoch=1), 300, "the trial's first epoch", proc=proc, log=log)
        fingerprint = json.loads((storage / name / FINGERPRINT_FILE).read_text())  # written at the start
        assert fingerprint["data.features"]["id"] == file_sha256(tiny_data / "features.h5")
        _lease_of_another_host(storage / name)  # another host's `resume --force` took the study over
        assert proc.wait(timeout=240) == 2, tail(log)
    finally:
        kill_group(proc)
    out = log.read_text()
    stopped = [ln for ln in out.splitlines() if "its lease was taken over by someone@elsewhere pid 4242" in ln]
    assert len(stopped) == 1 and "stopped before" in stopped[0], tail(log)
    assert "Traceback" not in out, tail(log)
    assert not (storage / name / "summary.json").exists()  # no summary over the new writer's
    assert json.loads((storage / name / LEASE_FILE).read_text())["token"] == "theirs"  # not released: not its own
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (trial,) = mlflow_trials(uri, name).values()
    assert trial.info.status == "RUNNING"  # not ended by the superseded driver: the runs are the new writer's

    _lease_of_another_host(storage / name, age=1000)  # that writer died in turn: stale, taken over with --force
    resumed = a2("study", "resume", name, "--storage", str(storage), "--force", cwd=tmp_path, env=env, timeout=420)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    summary = json.loads((storage / name / "summary.json").read_text())
    assert summary["complete"] and summary["path"] == "."
    (row,) = summary["trials"]
    assert row["epochs_done"] == 4 and not Path(row["best_checkpoint"]).is_absolute()
    assert str(storage) not in (storage / name / "summary.json").read_text()
    (run,) = trial_runs(storage, name).values()
    folders = sorted(run.glob("checkpoint_epoch*"))
    assert folders
    for folder in folders:  # every stored checkpoint with its SHA-256 beside it, as written
        assert recorded_sha256((folder / f"checkpoint.pt{SUFFIX}").read_text()) == file_sha256(folder / "checkpoint.pt")
    assert duplicated_points(uri, name) == []
    check = a2("study", "check", name, "--storage", str(storage), cwd=tmp_path, timeout=120)
    assert check.returncode == 0 and "all readable" in check.stdout, check.stdout
