"""Interrupted studies on a local Ray: Ctrl-C (SIGINT to the driver's process group), SIGTERM (a scheduler's or a
spot node's stop) and SIGKILL after an epoch, then `a2 study resume NAME`. Every run's status is true to the study
at each point, no temp folder is left behind, and MLflow holds every (run, key, step) once.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from tests.raycluster import (  # noqa: F401 - tiny_data is a fixture
    a2, kill_group, mlflow_client, mlflow_trials, start_a2, tail, tiny_data, tiny_study, trial_runs, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EPOCHS = 3
TEMP_PREFIXES = ("a2-trial-", "a2-tune-ckpt-", "a2ckpt-")


def local_env(tmp_path: Path) -> dict:
    """A study that starts its own local Ray, with a temp folder of its own (to see what is left in it), reached as
    `tmp_path/tmp`. The folder itself is short, below /tmp: Ray's dashboard puts a socket in it (a forkserver's), and
    a socket path longer than 107 bytes (a test's folder below pytest-xdist's worker folder) keeps the dashboard from
    starting, which Ray waits a minute for."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    link = tmp_path / "tmp"
    if not link.exists():
        temp = tempfile.mkdtemp(prefix="a2i-", dir="/tmp")
        atexit.register(shutil.rmtree, temp, ignore_errors=True)
        link.symlink_to(temp, target_is_directory=True)
    env["TMPDIR"] = str(link.resolve())
    env["RAY_TMPDIR"] = "/tmp"  # Ray's session folder stays where its socket paths are short
    return env


def duplicated_points(uri: str, study: str) -> list[tuple]:
    """(trial, key, step, count) of every metric point that MLflow holds more than once, over the study's runs."""
    client = mlflow_client(uri)
    out = []
    for trial_id, run in mlflow_trials(uri, study).items():
        for key in run.data.metrics:
            counts = Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
            out += [(trial_id, key, step, n) for step, n in counts.items() if n > 1]
    return out


def epochs_by_trial(storage: Path, study: str) -> list[int]:
    """The epochs in each trial's result log (each reported to Tune right after it was written)."""
    counts = []
    for run_dir in trial_runs(storage, study).values():
        try:
            counts.append(len(json.loads((run_dir / "results.json").read_text())))
        except (OSError, ValueError):
            continue
    return counts


def epochs_reported(storage: Path, study: str) -> int:
    """The epochs in the study's trials' result logs."""
    return sum(epochs_by_trial(storage, study))


def left_temp_folders(tmp_path: Path) -> list[str]:
    return sorted(str(p) for p in (tmp_path / "tmp").rglob("*") if p.name.startswith(TEMP_PREFIXES))


def epoch_logged(storage: Path, study: str, epoch: int = 1):
    """A trial whose result log has `epoch` (it was reported to Tune right after)."""
    for tid, run_dir in trial_runs(storage, study).items():
        try:
            results = json.loads((run_dir / "results.json").read_text())
        except (OSError, ValueError):
            continue
        if any(r.get("epoch") == epoch for r in results):
            return tid
    return None


def statuses(uri: str, study: str) -> tuple[str | None, dict]:
    from dashboards.tracking import study_runs

    parent, _ = study_runs(uri, study)
    trials = mlflow_trials(uri, study)
    return (parent.info.status if parent else None,
            {tid: (run.info.status, run.data.tags.get("a2.end_reason")) for tid, run in trials.items()})


# SIGKILL after an epoch, then resume: tests/test_kill_anywhere.py's sweep, at every window of the study's writes
def test_a_signal_after_an_epoch_then_resume_logs_every_epoch_once(tmp_path, tiny_data):
    """Ctrl-C after the study's first epoch, then SIGTERM to the resumed driver after an epoch it trained: each
    stops the study with exit 128 + the signal, saying how to continue, and the last resume finishes it. One study
    for both signals (a second would cost a driver's whole start for nothing new)."""
    name = "sig"
    storage = tmp_path / "studies"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    study = tiny_study(tmp_path, name, tiny_data, fusions=("none", "max"), epochs=EPOCHS, workers=1,
                       cpus_per_worker=1, max_concurrent=1, extra={"train.batch_size": 20})
    env = local_env(tmp_path)
    for sig, command in ((signal.SIGINT, ("run", str(study))), (signal.SIGTERM, ("resume", name))):
        before = epochs_reported(storage, name)
        log = tmp_path / f"{sig.name}.log"
        proc = start_a2("study", *command, cwd=tmp_path, log=log, env=env)
        def trained_one_with_more_to_come():
            """An epoch this driver trained, of a trial with epochs left: the signal finds it running. (An epoch
            that ended a trial, when the other had not started yet, left no trial for the signal to cut short.)"""
            counts = epochs_by_trial(storage, name)
            return sum(counts) > before and any(0 < n < EPOCHS for n in counts)

        try:  # the study's first epoch, then one more of a trial that goes on
            wait_for(trained_one_with_more_to_come, 300, "an epoch of a trial with epochs left", proc=proc, log=log)
            os.killpg(proc.pid, sig)
            rc = proc.wait(timeout=60)
        finally:
            kill_group(proc)  # whatever a signal left of the local Ray
        out = tail(log, 40)
        assert rc == 128 + sig, (sig, out)
        assert f"continue with `a2 study resume {name}`" in out, out
        assert "Tuner.restore" not in out and "*** SIGTERM received" not in out, out
        parent, trials = statuses(uri, name)
        assert parent == "KILLED", (sig, parent, trials)
        assert all(status in ("FINISHED", "KILLED") for status, _ in trials.values()), trials
        assert all(reason for status, reason in trials.values() if status == "KILLED"), trials
        # FIFO stops nothing early: the trial the signal cut short ends KILLED (a resume continues it), never
        # FINISHED as stopped early (Tune's cleanup sets a running trial TERMINATED after saving it PENDING)
        stopped = {tid for tid, run in mlflow_trials(uri, name).items() if run.data.tags.get("a2.stopped_early")}
        assert not stopped and "KILLED" in {status for status, _ in trials.values()}, (sig, stopped, trials)
        assert left_temp_folders(tmp_path) == []
        assert not (storage / name / "lease.json").exists()

    resume = a2("study", "resume", name, cwd=tmp_path, env=env, timeout=400)
    assert resume.returncode == 0, resume.stdout[-6000:]
    summary = json.loads((storage / name / "summary.json").read_text())
    assert summary["complete"]
    assert all(t["epochs_reported"] == list(range(1, EPOCHS + 1)) for t in summary["trials"])
    assert duplicated_points(uri, name) == []
    parent, trials = statuses(uri, name)
    assert parent == "FINISHED" and {s for s, _ in trials.values()} == {"FINISHED"}, (parent, trials)
    assert left_temp_folders(tmp_path) == []
