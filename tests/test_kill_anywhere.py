"""A driver killed anywhere: one tiny study (2 trials of 2 epochs, one at a time, on a local Ray), its driver
SIGKILLed at five points spread over its life and resumed after each, as an OOM kill, a lost head node or a spot
preemption would leave it. The points are hit exactly by `launch.killpoints` (`A2_KILL_AT`: the driver kills itself,
or a trial kills the driver, when the code passes the point; the real code path otherwise):

1. `study-file-written`: `run` wrote `study.yaml`, Tune has saved nothing. `resume` starts the trials in place.
2. `checkpoint-saved@2`: a trial's last checkpoint is in its folder, its result (with its test scores) is not, the
   checkpoints it no longer keeps not deleted. Tune's files are then removed, as a driver killed before Tune's first
   save leaves them, but with a trial that trained: the resumed study's trial of that configuration continues it
   from its checkpoint (`launch.trainable.adopt`) and, its epochs all done, scores the test split.
3. `trial-result@1`: the driver has the next trial's first result. Tune saves its state every 10 s or so, so
   it often has not saved that trial yet: resumed, its configuration runs again under a new trial id, which
   continues the lost trial's checkpoint; else Tune restores it. Either way the checks below hold.
4. `export-final`: the driver's last MLflow export has ended one trial's run, not the others nor the study's.
5. `study-end`: the summary and the export are written, the lease is not given back.

Then every planned trial finished once, with its epochs and its test scores; MLflow holds every (run, key, step)
once; every run is FINISHED but the lost trial's, KILLED and tagged superseded by the trial that continued it; the
last `resume` says the study is finished and writes nothing.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from launch.verify import _root_kind
from tests.raycluster import (  # noqa: F401 - tiny_data is a fixture
    a2, kill_group, mlflow_client, mlflow_history, mlflow_trials, start_a2, tail, tiny_data, tiny_study, trial_runs)
from tests.test_interruptions import duplicated_points, local_env, statuses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "kill-anywhere"
EPOCHS = 2


def _killed_at(point: str, *command: str, cwd: Path, env: dict) -> str:
    """Run `a2 COMMAND` with the kill point armed; it must die of the SIGKILL there. Returns its output."""
    log = cwd / f"{point}.log"
    proc = start_a2(*command, cwd=cwd, log=log, env={**env, "A2_KILL_AT": point})
    try:
        rc = proc.wait(timeout=240)
    finally:
        kill_group(proc)  # the killed driver's local Ray, and a trial process that waits at its kill point
    out = log.read_text(errors="replace")
    assert rc == -signal.SIGKILL, (point, rc, tail(log, 80))
    # the driver's own kill says so; a trial's line dies with the driver that would have printed it (the folders
    # show where that one stopped)
    assert point.startswith("checkpoint-saved") or f"a2 kill point {point}: SIGKILL" in out, (point, tail(log, 80))
    return out


def _results(run_dir: Path) -> list[dict]:
    path = run_dir / "results.json"
    return json.loads(path.read_text()) if path.exists() else []


def test_a_study_killed_at_five_points_finishes_every_planned_trial_once(tmp_path, tiny_data):
    started = time.monotonic()
    storage, folder = tmp_path / "studies", tmp_path / "studies" / NAME
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    study = tiny_study(tmp_path, NAME, tiny_data, fusions=("none", "max"), epochs=EPOCHS, workers=1,
                       cpus_per_worker=1, max_concurrent=1)
    env = local_env(tmp_path)

    # 1. before Tune's state exists
    _killed_at("study-file-written", "study", "run", str(study), cwd=tmp_path, env=env)
    assert (folder / "study.yaml").exists() and not list(folder.glob("experiment_state-*"))

    # 2. between a trial's last checkpoint and its result; then Tune's files gone
    out = _killed_at("checkpoint-saved@2", "study", "resume", NAME, cwd=tmp_path, env=env)
    assert f"study {NAME}: Tune saved no experiment state before the study's driver stopped" in out, out[-3000:]
    assert "run it again" not in out
    (lost_id, lost_dir), = trial_runs(storage, NAME).items()
    assert (lost_dir / "checkpoint_epoch0002" / "checkpoint.pt").exists()
    assert [r["epoch"] for r in _results(lost_dir)] == [1]  # epoch 2's result, with the test scores, not kept
    for tune_file in (p for p in folder.iterdir() if p.is_file() and _root_kind(p.name)):
        tune_file.unlink()

    # 3. after the next trial's first result
    out = _killed_at("trial-result@1", "study", "resume", NAME, cwd=tmp_path, env=env)
    assert "Tune saved no experiment state" in out
    assert f"continues {lost_dir}, a trial of the same configuration" in out, out[-3000:]
    successor = json.loads((lost_dir / "superseded.json").read_text())["by"]
    assert successor != lost_id
    scored = _results(trial_runs(storage, NAME)[successor])
    assert [r["epoch"] for r in scored] == [1, 2] and scored[-1]["test/epoch"] in (1, 2), scored

    # 4. during the last MLflow export; 5. at the very end
    _killed_at("export-final", "study", "resume", NAME, cwd=tmp_path, env=env)
    assert not (folder / "summary.json").exists()
    _killed_at("study-end", "study", "resume", NAME, cwd=tmp_path, env=env)
    assert (folder / "summary.json").exists()

    last = a2("study", "resume", NAME, cwd=tmp_path, env=env, timeout=240)
    assert last.returncode == 0, last.stdout[-4000:]
    assert f"all {2} planned trials finished already; nothing to resume" in last.stdout, last.stdout[-4000:]

    summary = json.loads((folder / "summary.json").read_text())
    assert summary["complete"] and summary["trials_finished"] == 2
    trials = {t["trial_id"]: t for t in summary["trials"]}
    assert successor in trials and lost_id not in trials
    assert sorted(t["fusion"] for t in trials.values()) == ["max", "none"]
    for trial in trials.values():
        assert trial["state"] == "TERMINATED" and trial["epochs_reported"] == [1, 2], trial
        assert trial["test"] is not None, trial  # test scores present, the continued trial's too

    assert duplicated_points(uri, NAME) == []
    parent, runs = statuses(uri, NAME)
    assert parent == "FINISHED", (parent, runs)
    for trial_id, (status, reason) in runs.items():
        if trial_id in trials:
            assert status == "FINISHED", (trial_id, status, reason)
        else:  # a trial the killed drivers lost: ended, saying which trial continued it
            assert status == "KILLED" and reason.startswith("superseded"), (trial_id, status, reason)
    if lost_id in runs:  # exported before its driver was killed
        assert f"trial {successor} (same configuration) continued it" in runs[lost_id][1]
    client = mlflow_client(uri)
    for trial_id in trials:
        run_id = mlflow_trials(uri, NAME)[trial_id].info.run_id
        assert [step for step, _, _ in sorted(mlflow_history(uri, run_id))] == [1, 2]
        assert [m.step for m in client.get_metric_history(run_id, "test/CIDEr")] == [2]
    print(f"kill-anywhere study: {time.monotonic() - started:.0f} s")
