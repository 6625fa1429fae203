"""Storage that cannot take more writes mid-study stops the study with one line naming the path and the error (not
Ray's `EOFError` traceback over a 0-byte error.pkl), and once fixed `a2 study resume` finishes it with every epoch
once in MLflow: a full disk (a 3 MB tmpfs: two epochs' checkpoints), a folder made read-only (the tmpfs remounted
`ro`: root writes through a chmod) and a quota exceeded (EDQUOT from every write below the storage, tests/faults).
A disk that fills while Tune copies its own experiment state (a plain copy) cuts that file short: `resume` names its
whole copy and `resume --restore-state` puts it back (tests/test_corrupt_state.py makes that case on purpose)."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.raycluster import (  # noqa: F401 - tiny_data is a fixture
    a2, kill_group, start_a2, tail, tiny_data, tiny_study, wait_for)
from tests.test_interruptions import epochs_reported, duplicated_points, local_env

FAULTS = Path(__file__).resolve().parent / "faults"  # sitecustomize.py: EDQUOT on demand

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _tmpfs(tmp_path: Path, size: str):
    mount = tmp_path / "store"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.decode()[:200]}")
    return mount


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = _tmpfs(tmp_path, "3m")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def tmpfs(tmp_path):
    mount = _tmpfs(tmp_path, "64m")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def stopped_line(out: str, name: str) -> str:
    return next((ln for ln in out.splitlines() if ln.startswith(f"study {name} stopped")), "")


def stop_mid_study(tmp_path: Path, name: str, command: tuple, storage: Path, env: dict, fault) -> str:
    """`a2 study *command`, with `fault()` applied once it has trained an epoch; the command's output, which must end
    with exit 1 within the timeout."""
    before = epochs_reported(storage, name)
    log = tmp_path / f"{command[0]}.log"
    proc = start_a2("study", *command, cwd=tmp_path, log=log, env=env)
    try:
        wait_for(lambda: epochs_reported(storage, name) > before, 300, "an epoch", proc=proc, log=log)
        fault()
        rc = proc.wait(timeout=300)
    finally:
        kill_group(proc)
    out = log.read_text(errors="replace")
    assert rc == 1, tail(log, 80)
    return out


def assert_one_line_stop(out: str, name: str, storage: Path, error: str) -> None:
    line = stopped_line(out, name)
    assert error in line and str(storage) in line and ".tmp:" not in line, out[-6000:]  # the file, not a temp name
    assert f"continue with `a2 study resume {name}`" in line
    assert "EOFError" not in out and "Traceback (most recent call last)" not in out.split(line)[-1]


def assert_resume_finishes(tmp_path: Path, name: str, storage: Path, env: dict, epochs: int) -> str:
    """`a2 study resume NAME` finishes the study, every epoch once in MLflow; its output."""
    resume = a2("study", "resume", name, cwd=tmp_path, env=env, timeout=400)
    assert resume.returncode == 0, resume.stdout[-6000:]
    summary = json.loads((storage / name / "summary.json").read_text())
    assert summary["complete"] and summary["trials"][0]["epochs_reported"] == list(range(1, epochs + 1))
    assert duplicated_points(f"sqlite:///{tmp_path / 'mlflow.db'}", name) == []
    return resume.stdout


def test_a_full_disk_stops_the_study_with_one_line_and_resume_finishes_it(tmp_path, tiny_data, small_tmpfs):
    name = "full"
    storage = small_tmpfs / "studies"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    study = tiny_study(tmp_path, name, tiny_data, epochs=4, workers=1, cpus_per_worker=1, storage=storage)
    env = local_env(tmp_path)
    run = a2("study", "run", str(study), cwd=tmp_path, env=env, timeout=400)
    assert run.returncode == 1, run.stdout[-6000:]
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith(f"study {name} stopped")), "")
    assert "No space left on device" in line and str(storage) in line, run.stdout[-6000:]
    assert f"continue with `a2 study resume {name}`" in line
    assert "EOFError" not in run.stdout and "Traceback (most recent call last)" not in run.stdout.split(line)[-1]
    assert not (storage / name / "lease.json").exists()

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)  # the disk fixed
    resume = a2("study", "resume", name, cwd=tmp_path, env=env, timeout=400)
    if resume.returncode == 2:  # the disk filled during Tune's own (non-atomic) copy of its state: cut short
        assert f"`a2 study resume {name} --restore-state` puts it back" in resume.stdout, resume.stdout[-6000:]
        resume = a2("study", "resume", name, "--restore-state", cwd=tmp_path, env=env, timeout=400)
        assert "restored " in resume.stdout and "from its whole copy" in resume.stdout, resume.stdout[-6000:]
    assert resume.returncode == 0, resume.stdout[-6000:]
    summary = json.loads((storage / name / "summary.json").read_text())
    assert summary["complete"] and summary["trials"][0]["epochs_reported"] == [1, 2, 3, 4]
    assert duplicated_points(uri, name) == []


def test_a_storage_made_read_only_then_over_its_quota_stops_the_study_with_one_line_and_resume_finishes_it(
        tmp_path, tiny_data, tmpfs):
    """One study, two faults in turn: the storage remounted read-only mid-run, then, in the resume that took over the
    lease it left, a quota exceeded (EDQUOT from every write below the storage, tests/faults); each stops the study
    with one line, and the last resume finishes it."""
    name = "readonly-quota"
    storage, switch = tmpfs / "studies", tmp_path / "over-quota"
    study = tiny_study(tmp_path, name, tiny_data, epochs=6, workers=1, cpus_per_worker=1, storage=storage,
                       extra={"train.batch_size": 20})
    env = {**local_env(tmp_path), "A2_FAULT_QUOTA_ROOT": str(storage), "A2_FAULT_QUOTA_SWITCH": str(switch)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULTS), env.get("PYTHONPATH")) if p)

    def read_only():  # a file being written keeps a remount busy (EBUSY) for a moment: try again
        for _ in range(200):
            if subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], capture_output=True).returncode == 0:
                return
            time.sleep(0.05)
        pytest.fail("could not remount the storage read-only")

    out = stop_mid_study(tmp_path, name, ("run", str(study)), storage, env, read_only)
    assert_one_line_stop(out, name, storage, "[Errno 30] Read-only file system")
    assert (storage / name / "lease.json").exists()  # a read-only folder keeps it

    subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)  # the storage fixed
    out = stop_mid_study(tmp_path, name, ("resume", name), storage, env, switch.touch)
    assert "WARNING: taking over the stale lease" in out and "its process is gone from this host" in out, out[-6000:]
    assert_one_line_stop(out, name, storage, "[Errno 122] Disk quota exceeded")

    switch.unlink()  # the quota raised
    assert_resume_finishes(tmp_path, name, storage, env, epochs=6)
