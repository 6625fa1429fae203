"""Every state error is one line, exit 2, naming the file and the cause, before Ray starts: storage that cannot be
written on `resume` and `mlflow sync` (a read-only tmpfs), a SQLite MLflow store that is not a database or is locked
by another process, and a checkpoint of another model (`a2 study check` reports it mismatched, `a2 package` refuses
it), or one whose weights do not fit its own config."""
from __future__ import annotations

import json
import sqlite3
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from a2core import checkpoint as ckpt
from a2core.config import Config
from a2core.data import synthetic
from a2core.errors import PackageError
from a2core.train import train
from dashboards.runs import Trial
from launch.cli import main
from launch.layout import CHECKPOINT_FILE, TRIALS_DIR, checkpoint_name, train_run_name
from launch.package import refuse_unreadable
from tests.studyfolder import fabricated_study

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.strip()]


@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "store"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.decode()[:200]}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_read_only_storage_on_resume_and_sync_is_one_line(tmp_path, tmpfs, capsys):
    import ray

    fab = fabricated_study(tmp_path, "ro", epochs=2, overrides=(f"storage={tmpfs}",))
    fab.add("a0", {"fusion": "none", "seed": 0}, [{"epoch": 1, "val/CIDEr": 10.0}])
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    lease = tmpfs / "ro" / "lease.json"
    expected = (f"a2: error: {lease}: cannot write the study's lease (Read-only file system); a study is run, "
                f"resumed and synced only where its storage can be written")
    assert main(["study", "resume", "ro", "--storage", str(tmpfs)]) == 2
    assert error_lines(capsys) == [expected]
    assert main(["mlflow", "sync", "ro", "--storage", str(tmpfs)]) == 2
    assert error_lines(capsys) == [expected]
    assert not ray.is_initialized() and not (tmp_path / "mlflow.db").exists()


def test_a_corrupt_mlflow_db_is_one_line_before_ray_and_before_the_study_folder(tmp_path, capsys):
    import ray

    fab = fabricated_study(tmp_path, "bad-db", epochs=2)
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"this is no sqlite database, just bytes where one was\n" * 100)
    assert main(["study", "resume", "bad-db", "--storage", str(fab.spec.storage)]) == 2
    assert error_lines(capsys) == [
        f"a2: error: tracking.mlflow_uri: {db}: file is not a database; the MLflow store is damaged: move it aside, "
        f"and `a2 mlflow sync bad-db` writes the study's runs again from its record"]
    assert not (fab.location.at().join("lease.json").exists())
    smoke = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"
    assert main(["study", "run", str(smoke), "name=fresh", f"storage={tmp_path / 'new'}",
                 f"tracking.mlflow_uri=sqlite:///{db}"]) == 2
    assert "file is not a database" in error_lines(capsys)[-1]
    assert not (tmp_path / "new" / "fresh").exists() and not ray.is_initialized()


def test_a_locked_mlflow_db_is_one_line(tmp_path, capsys):
    fab = fabricated_study(tmp_path, "locked", epochs=2)
    db = tmp_path / "mlflow.db"
    holder = sqlite3.connect(db)
    holder.execute("CREATE TABLE t (x)")
    holder.commit()
    holder.execute("BEGIN EXCLUSIVE")  # another process mid-write, for longer than the check waits
    try:
        assert main(["mlflow", "sync", "locked", "--storage", str(fab.spec.storage)]) == 2
    finally:
        holder.rollback()
        holder.close()
    assert error_lines(capsys) == [
        f"a2: error: tracking.mlflow_uri: {db}: database is locked after 5 s; another process holds it (`fuser "
        f"{db}` names it); wait for it to end, or point tracking.mlflow_uri elsewhere"]


# -- checkpoints of another model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint of one epoch of a d_model-16 model (the smoke study's is 64)."""
    root = tmp_path_factory.mktemp("small")
    synthetic.generate(root / "data", seed=3, images=40, test_images=5)
    cfg = Config.from_dict({"data": {"root": str(root / "data"), "images": 40, "seed": 3, "val_images": 5},
                            "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10},
                            "train": {"xe_epochs": 1, "batch_size": 50, "warmup": 10, "diag_every": 0,
                                      "test_at_end": False}})
    train(cfg, output_dir=root / "run")
    return root / "run" / "last.pt"


def _swap_in(fab, trial_id: str, source: Path, epoch: int = 1) -> Path:
    target = Path(fab.location.at(TRIALS_DIR, train_run_name(fab.spec.name, trial_id), checkpoint_name(epoch),
                                  CHECKPOINT_FILE).uri)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.read_bytes())
    return target


def test_check_reports_a_checkpoint_of_another_model_and_one_whose_weights_do_not_fit(tmp_path, small_checkpoint,
                                                                                      capsys):
    fab = fabricated_study(tmp_path, "swapped", epochs=2)
    fab.add("a0", {"fusion": "none", "seed": 0}, [{"epoch": 1, "val/CIDEr": 10.0}])
    other = _swap_in(fab, "a0", small_checkpoint)
    state = ckpt.load(small_checkpoint)
    state["config"]["model"]["d_model"] = 64  # the study's size on the label, d_model-16 weights inside
    state["config"]["model"]["d_ff"], state["config"]["model"]["heads"] = 128, 4
    state["config"]["model"]["layers"] = 2
    relabelled = tmp_path / "relabelled.pt"
    torch.save(state, relabelled)
    fab.add("a1", {"fusion": "none", "seed": 1}, [{"epoch": 1, "val/CIDEr": 11.0}])
    mislabelled = _swap_in(fab, "a1", relabelled)
    assert main(["study", "check", "swapped", "--storage", str(fab.spec.storage)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert (f"mismatched: {other}: a model of another config: model.d_ff is 32 in the checkpoint, 128 in the study"
            in out)
    assert any(line.startswith(f"mismatched: {mislabelled}: its weights do not fit its own config (") and
               "model.d_model 64" in line for line in out), out
    assert out[-1].endswith("2 checkpoints checked, 2 unreadable (restore them from a copy; a trial resumes from "
                            "its newest readable checkpoint)")


@pytest.mark.ray
def test_package_refuses_a_checkpoint_of_another_model_in_one_line(tmp_path, small_checkpoint):
    fab = fabricated_study(tmp_path, "pkg", epochs=2)
    member = Trial("a0", best_checkpoint="s3://bucket/pkg/trials/pkg-a0/checkpoint_epoch0001/checkpoint.pt",
                   config=fab.spec.trial_config({"fusion": "none", "seed": 0}))
    with pytest.raises(PackageError) as err:
        refuse_unreadable([member], [str(small_checkpoint)])
    assert str(err.value) == (f"{member.best_checkpoint} (trial a0, seed 0): a model of another config: model.d_ff is "
                              f"32 in the checkpoint, 128 in the study; nothing was decoded: restore the trial's own "
                              f"checkpoint (`a2 study check NAME` verifies every checkpoint)")
    own = replace(member, config={**member.config, "model": ckpt.load(small_checkpoint)["config"]["model"]})
    refuse_unreadable([own], [str(small_checkpoint)])  # its own model: nothing to refuse
