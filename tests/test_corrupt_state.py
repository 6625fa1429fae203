"""A study's saved state is verified on read, never silently replaced: garbage in Tune's experiment or search state,
a binary study file or a garbage result log is refused by `resume` and `status` with one line naming the file (exit
2, nothing run or changed); `a2 study check NAME` lists every unreadable file and checkpoint. A trial whose latest
checkpoint is truncated resumes from the newest readable one, saying so; a finished trial's truncated best checkpoint
is reported by `status` and refused by `a2 package` before any decoding. Tune's experiment state cut short (a full disk
during its own, non-atomic copy) is put back from its whole copy by `resume --restore-state`."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from tests.raycluster import (  # noqa: F401 - tiny_data is a fixture
    a2, kill_group, mlflow_trials, snapshot_epochs, start_a2, tiny_data, tiny_study, trial_runs, wait_for)
from tests.test_interruptions import duplicated_points, epoch_logged, local_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "corrupt"


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_data):
    """A finished 2-trial study: (its folder, the tracking URI, the environment)."""
    root = tmp_path_factory.mktemp("finished")
    study = tiny_study(root, NAME, tiny_data, fusions=("none", "max"), epochs=2, workers=1, cpus_per_worker=1,
                       max_concurrent=1)
    env = local_env(root)
    run = a2("study", "run", str(study), cwd=root, env=env, timeout=400)
    assert run.returncode == 0, run.stdout[-4000:]
    return root / "studies", f"sqlite:///{root / 'mlflow.db'}", env, root


def _copy(finished, tmp_path) -> Path:
    storage = tmp_path / "copy"
    shutil.copytree(finished[0], storage)
    return storage


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _corrupt(storage: Path, what: str) -> Path:
    study = storage / NAME
    if what == "study.yaml":
        target = study / "study.yaml"
        target.write_bytes(bytes(range(256)) * 4)
        return target
    if what == "results.json":
        target = next(iter(trial_runs(storage, NAME).values())) / "results.json"
    else:
        target = next(study.glob(f"{what}-*"))
    target.write_bytes(b"\x80\x04garbage" + os.urandom(64))
    return target


@pytest.mark.parametrize("what", ["searcher-state", "experiment_state", "study.yaml", "results.json"])
def test_corrupt_state_is_refused_by_resume_and_status(finished, tmp_path, what):
    _, uri, env, root = finished
    storage = _copy(finished, tmp_path)
    runs_before = len(mlflow_trials(uri, NAME))
    target = _corrupt(storage, what)
    before = _tree(storage)
    for command in (["resume"], ["status"], ["check"]):
        done = a2("study", *command, NAME, "--storage", str(storage), cwd=root, env=env, timeout=120)
        # a refusal (2) by resume and status; check's finding (1)
        assert done.returncode == (1 if command == ["check"] else 2), done.stdout[-3000:]
        assert str(target) in done.stdout, done.stdout[-3000:]
        assert "Traceback" not in done.stdout, done.stdout[-3000:]
    assert _tree(storage) == before  # nothing run, nothing overwritten
    assert len(mlflow_trials(uri, NAME)) == runs_before


def test_check_passes_a_whole_study_and_names_a_truncated_best_checkpoint(finished, tmp_path):
    _, _, env, root = finished
    storage = _copy(finished, tmp_path)
    check = a2("study", "check", NAME, "--storage", str(storage), cwd=root, env=env, timeout=120)
    assert check.returncode == 0 and "all readable" in check.stdout, check.stdout[-3000:]

    summary = json.loads((storage / NAME / "summary.json").read_text())
    best = storage / NAME / summary["best"]["checkpoint"].replace(str(finished[0]), str(storage))  # relative, or old
    best.write_bytes(best.read_bytes()[:best.stat().st_size // 2])
    status = a2("study", "status", NAME, "--storage", str(storage), cwd=root, env=env, timeout=120)
    assert status.returncode == 0, status.stdout[-3000:]
    assert f"trial {summary['best']['trial_id']}: best checkpoint" in status.stdout and str(best) in status.stdout
    check = a2("study", "check", NAME, "--storage", str(storage), cwd=root, env=env, timeout=120)
    assert check.returncode == 1 and f"unreadable: {best}" in check.stdout, check.stdout[-3000:]


def _stopped_part_way(tmp_path, tiny_data, name: str, *, workers: int, batch_size: int):
    """A one-trial study of 6 epochs on `workers` workers, stopped with Ctrl-C after its second epoch is logged:
    (storage, MLflow URI, env, the trial's run folder, the epochs it has checkpoint folders of)."""
    storage = tmp_path / "studies"
    study = tiny_study(tmp_path, name, tiny_data, epochs=6, workers=workers, cpus_per_worker=1 / workers,
                       extra={"train.batch_size": batch_size})
    env = local_env(tmp_path)
    log = tmp_path / "run.log"
    proc = start_a2("study", "run", str(study), cwd=tmp_path, log=log, env=env)
    try:
        wait_for(lambda: epoch_logged(storage, name, epoch=2), 300, "the trial's second epoch", proc=proc, log=log)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=90) == 130
    finally:
        kill_group(proc)
    (run_dir,) = trial_runs(storage, name).values()
    epochs = sorted(int(p.name[-4:]) for p in run_dir.glob("checkpoint_epoch*"))
    assert 2 <= epochs[-1] < 6, epochs  # the trial stopped part way (epochs take about a second)
    return storage, f"sqlite:///{tmp_path / 'mlflow.db'}", env, run_dir, epochs


def test_a_ray_train_trials_truncated_latest_checkpoint_falls_back_too(tmp_path, tiny_data):
    """A trial of 2 gloo workers: Ray Train would resume from its latest checkpoint, unread; the trial resumes from
    the newest one that loads instead, and trains the epochs after it again."""
    name = "fallback-train"
    storage, uri, env, run_dir, epochs = _stopped_part_way(tmp_path, tiny_data, name, workers=2, batch_size=40)
    # Ray Train's resume point: the latest checkpoint its record names (a newer folder may be there, unrecorded)
    recorded = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    recorded = int(recorded["latest_checkpoint_result"]["checkpoint_dir_name"][-4:])
    assert recorded >= 2 and recorded in epochs, (recorded, epochs)
    for epoch in (e for e in epochs if e >= recorded):  # truncated: the recorded one and any newer
        truncated = run_dir / f"checkpoint_epoch{epoch:04d}" / "checkpoint.pt"
        truncated.write_bytes(truncated.read_bytes()[:truncated.stat().st_size // 2])
    latest = run_dir / f"checkpoint_epoch{recorded:04d}" / "checkpoint.pt"
    fallback = max(e for e in epochs if e < recorded)
    readable = run_dir / f"checkpoint_epoch{fallback:04d}" / "checkpoint.pt"
    logged_before = {r["epoch"]: r["timestamp"] for r in json.loads((run_dir / "results.json").read_text())}

    resume = a2("study", "resume", name, cwd=tmp_path, env=env, timeout=400)
    assert resume.returncode == 0, resume.stdout[-6000:]
    assert f"checkpoint {latest} is unreadable" in resume.stdout, resume.stdout[-6000:]
    assert f"resuming from {readable} (epoch {fallback})" in resume.stdout, resume.stdout[-6000:]
    summary = json.loads((storage / name / "summary.json").read_text())
    assert summary["complete"] and summary["trials"][0]["epochs_reported"] == [1, 2, 3, 4, 5, 6]
    # the epochs after the fallback were trained again (reported anew), those up to it were not
    logged_after = {r["epoch"]: r["timestamp"] for r in json.loads((run_dir / "results.json").read_text())}
    assert [e for e in logged_before if logged_after[e] != logged_before[e]] == \
        [e for e in logged_before if e > fallback], (logged_before, logged_after)
    assert snapshot_epochs(run_dir)[-1] == 6
    assert duplicated_points(uri, name) == []


def test_a_cut_experiment_state_is_put_back_and_a_truncated_latest_checkpoint_falls_back(tmp_path, tiny_data):
    """One stopped study, two damaged files (as a disk that filled can leave them). Tune copies its experiment state
    into the storage with a plain copy: `resume` refuses the cut file naming its whole copy in `state-copies/`, and
    `resume --restore-state` puts it back, saying so. The trial's latest checkpoint, truncated: the trial resumes from
    the newest one that loads instead. The study finishes with every epoch once."""
    name = "cut-state"
    storage, uri, env, run_dir, epochs = _stopped_part_way(tmp_path, tiny_data, name, workers=1, batch_size=20)
    state = max((storage / name).glob("experiment_state-*.json"))
    copy = storage / name / "state-copies" / state.name
    json.loads(copy.read_text())  # the driver kept a whole copy of it
    state.write_bytes(state.read_bytes()[:state.stat().st_size // 2])
    latest = run_dir / f"checkpoint_epoch{epochs[-1]:04d}" / "checkpoint.pt"
    latest.write_bytes(latest.read_bytes()[:latest.stat().st_size // 2])
    readable = run_dir / f"checkpoint_epoch{epochs[-2]:04d}" / "checkpoint.pt"

    refused = a2("study", "resume", name, cwd=tmp_path, env=env, timeout=120)
    assert refused.returncode == 2, refused.stdout[-3000:]
    assert str(state) in refused.stdout and f"a whole copy of it is at {copy}" in refused.stdout, refused.stdout[-3000:]
    assert f"`a2 study resume {name} --restore-state` puts it back" in refused.stdout

    resume = a2("study", "resume", name, "--restore-state", cwd=tmp_path, env=env, timeout=400)
    assert resume.returncode == 0, resume.stdout[-6000:]
    assert f"restored {state} from its whole copy {copy}" in resume.stdout, resume.stdout[-6000:]
    assert f"checkpoint {latest} is unreadable" in resume.stdout, resume.stdout[-6000:]
    assert f"resuming from {readable} (epoch {epochs[-2]})" in resume.stdout, resume.stdout[-6000:]
    summary = json.loads((storage / name / "summary.json").read_text())
    assert summary["complete"] and summary["trials"][0]["epochs_reported"] == [1, 2, 3, 4, 5, 6]
    assert duplicated_points(uri, name) == []
