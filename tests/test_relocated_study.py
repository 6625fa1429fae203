"""A study's storage copied or moved elsewhere: `resume` refuses it before Ray starts, naming where the study was
run, where it is now and the MLflow store its saved experiment logs to (a resumed copy would write into the
original's storage and MLflow runs); `status` reads the copy, and `a2 mlflow sync` says which store it replays into.
Nothing is written anywhere, `resume --restore-state` of a copy included."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import yaml

from launch.spec import load_study
from launch.location import STUDY_FILE, saved_form
from tests.raycluster import (  # noqa: F401 - tiny_data is a fixture
    a2, kill_group, start_a2, tiny_data, tiny_study, wait_for)

# each test runs `a2` in a subprocess (a few seconds of imports each): not in the fast tier
pytestmark = pytest.mark.slow

NAME = "moved"


def _saved_study(tmp_path: Path, tiny_data: Path) -> tuple[Path, str]:
    """A study folder as `run` leaves it before its first trial (its saved study file): (storage root, MLflow URI)."""
    # no MLflow store yet (a refused resume must not make one)
    spec = load_study(str(tiny_study(tmp_path, NAME, tiny_data, workers=1, cpus_per_worker=1, new_store=True)), [])
    folder = Path(spec.storage) / NAME
    folder.mkdir(parents=True)
    (folder / STUDY_FILE).write_text(yaml.safe_dump(saved_form(spec), sort_keys=False))
    return Path(spec.storage), spec.tracking.mlflow_uri


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_copied_study_is_refused_by_resume_naming_both_places_and_the_store(tmp_path, tiny_data):
    original, uri = _saved_study(tmp_path, tiny_data)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    before = (_tree(original), _tree(copy))
    done = a2("study", "resume", NAME, "--storage", str(copy), cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stdout[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert f"study {NAME} at {copy / NAME} was run at {original / NAME} (the original is still there)" in line, line
    assert f"logs to MLflow at {uri}" in line and f"--storage {original}" in line, line
    assert "Traceback" not in done.stdout and "Ray" not in done.stdout, done.stdout[-3000:]
    assert (_tree(original), _tree(copy)) == before  # nothing written in either place
    assert not Path(uri[len("sqlite:///"):]).exists()  # nor in MLflow

    status = a2("study", "status", NAME, "--storage", str(copy), cwd=tmp_path, timeout=120)
    assert "was run at" not in status.stdout and "Traceback" not in status.stdout, status.stdout[-3000:]
    sync = a2("mlflow", "sync", NAME, "--storage", str(copy), cwd=tmp_path, timeout=120)
    assert f"study {NAME}: exporting its record into MLflow at {uri}" in sync.stdout, sync.stdout[-3000:]


@pytest.mark.slow
def test_a_moved_study_is_refused_by_resume_and_resumes_once_moved_back(tmp_path, tiny_data):
    original, uri = _saved_study(tmp_path, tiny_data)
    moved = tmp_path / "elsewhere"
    shutil.move(str(original), str(moved))
    done = a2("study", "resume", NAME, "--storage", str(moved), cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stdout[-3000:]
    assert f"was run at {original / NAME} (nothing is there now)" in done.stdout, done.stdout[-3000:]
    assert not original.exists()  # the old folder not made again

    shutil.move(str(moved), str(original))
    log = tmp_path / "back.log"
    back = start_a2("study", "resume", NAME, "--storage", str(original), cwd=tmp_path, log=log)
    try:  # past the check: this study never started a trial, so its trials start in place (said before Ray starts)
        wait_for(lambda: "Tune saved no experiment state" in log.read_text(errors="replace"), 120,
                 "resume to start the study's trials in place", proc=back, log=log)
    finally:
        kill_group(back)


@pytest.mark.slow
def test_restore_state_changes_nothing_in_a_copy(tmp_path, tiny_data):
    """`resume --restore-state` of a copy is refused as a copy before any file of it is put back."""
    original, _ = _saved_study(tmp_path, tiny_data)
    state = "experiment_state-2026-11-26_07-00-00.json"
    (original / NAME / "state-copies").mkdir()
    (original / NAME / "state-copies" / state).write_text('{"trial_data": []}')
    (original / NAME / state).write_text('{"trial_da')  # cut short
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    before = _tree(copy)
    done = a2("study", "resume", NAME, "--storage", str(copy), "--restore-state", cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stdout[-3000:]
    assert f"was run at {original / NAME} (the original is still there)" in done.stdout, done.stdout[-3000:]
    assert "restored" not in done.stdout and _tree(copy) == before
