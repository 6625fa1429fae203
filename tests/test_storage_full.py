"""Storage that fills up mid-study (a 3 MB tmpfs: two epochs' checkpoints) stops the study with one line naming
the path and "No space left on device" (not Ray's `EOFError` traceback over a 0-byte error.pkl), the lease
released; once the storage has room again, `a2 study resume` finishes it with every epoch once in MLflow."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.raycluster import a2, tiny_data, tiny_study  # noqa: F401 - tiny_data is a fixture
from tests.test_interruptions import duplicated_points, local_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "store"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.decode()[:200]}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


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
    assert resume.returncode == 0, resume.stdout[-6000:]
    summary = json.loads((storage / name / "summary.json").read_text())
    assert summary["complete"] and summary["trials"][0]["epochs_reported"] == [1, 2, 3, 4]
    assert duplicated_points(uri, name) == []
