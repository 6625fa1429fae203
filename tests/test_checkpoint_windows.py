"""Checkpoint windows closed: Tune's state of a trial names the trial checkpoint (a pointer folder, launch.trainable)
it saved last. Tune used to keep only the newest, deleting the one before right after saving it, so a driver killed
in between left a state naming a deleted folder, which no resume could restore ("Could not recover from checkpoint as
it does not exist on storage anymore"). Now every pointer is kept, and `resume` puts back any that a study's saved
state names and the storage lacks (`launch.verify.put_back_tune_pointers`), as Tune itself encodes that state."""
from __future__ import annotations

import json
from pathlib import Path

from ray.train import Checkpoint, CheckpointConfig
from ray.train._internal.checkpoint_manager import _CheckpointManager
from ray.train._internal.session import _TrainingResult
from ray.tune.trainable.metadata import _TrainingRunMetadata

from launch.layout import TUNE_POINTER_FILE
from launch.storage import open_location
from launch.verify import put_back_tune_pointers, tune_checkpoint_paths


def experiment_state(study: Path, trial_dirs: dict[str, list[int]]) -> Path:
    """An experiment_state-*.json whose trials' checkpoint records are encoded by Ray's own classes (the pinned
    Ray's `_TrainingRunMetadata.get_json_state`, a `_CheckpointManager` keeping one): {trial dir: [checkpoint
    indices registered, oldest first]}."""
    trial_data = []
    for name, indices in trial_dirs.items():
        metadata = _TrainingRunMetadata()
        metadata.checkpoint_manager = _CheckpointManager(CheckpointConfig(num_to_keep=1))
        for index in indices:
            folder = study / name / f"checkpoint_{index:06d}"
            folder.mkdir(parents=True, exist_ok=True)
            metadata.checkpoint_manager.register_checkpoint(
                _TrainingResult(checkpoint=Checkpoint(str(folder)), metrics={"epoch": index + 1}))
        trial_data.append([json.dumps({"trial_id": name}), metadata.get_json_state()])
    path = study / "experiment_state-2026-11-27_00-00-00.json"
    path.write_text(json.dumps({"trial_data": trial_data, "runner_data": {}, "stats": {}}))
    return path


def test_the_paths_are_read_from_tunes_own_encoding_without_running_it(tmp_path):
    study = tmp_path / "st" / "s"
    state = experiment_state(study, {"trial_a": [0, 1], "trial_b": [0]})
    # the manager keeping one deleted checkpoint_000000 of trial_a when it registered checkpoint_000001
    assert not (study / "trial_a" / "checkpoint_000000").exists()
    assert tune_checkpoint_paths(state.read_text()) == {str(study / "trial_a" / "checkpoint_000001"),
                                                        str(study / "trial_b" / "checkpoint_000000")}
    assert tune_checkpoint_paths("not json") == set()


def test_resume_puts_back_the_pointer_a_killed_driver_deleted(tmp_path):
    study = tmp_path / "st" / "s"
    experiment_state(study, {"trial_a": [0, 1], "trial_b": [0]})
    gone = study / "trial_a" / "checkpoint_000001"  # deleted after the state was saved, as a kill can leave it
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    lines = put_back_tune_pointers(open_location(str(study)))
    assert lines == [f"Tune's record names {gone}, which is gone (a driver killed between saving a checkpoint and "
                     f"deleting the one before): put back as a pointer; the trial resumes from its own newest "
                     f"readable checkpoint"]
    assert json.loads((gone / TUNE_POINTER_FILE).read_text()) == {"train_checkpoint": None, "put_back": True}
    assert put_back_tune_pointers(open_location(str(study))) == []  # once is enough
    assert not (study / "trial_b" / "checkpoint_000000" / TUNE_POINTER_FILE).exists()  # there: left as it is


# -- a trial resumed at its best epoch still scores the test split ------------------------------------------------
def _scripted_run(tmp_path, monkeypatch, scripted: dict[int, float]):
    """A tiny run of len(scripted) epochs whose val CIDEr is `scripted[epoch]`, each epoch's checkpoint kept in a run
    folder as a one-worker trial keeps it: (config, the run folder, the last epoch's report)."""
    import torch

    import a2core.train as train_mod
    from a2core.config import Config
    from a2core.data import synthetic
    from launch.layout import CHECKPOINT_FILE, checkpoint_name

    torch.set_num_threads(1)
    synthetic.generate(tmp_path / "data", seed=2, images=40, test_images=5)
    cfg = Config.from_dict({"data": {"root": str(tmp_path / "data"), "images": 40, "seed": 2, "val_images": 5},
                            "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10},
                            "train": {"xe_epochs": len(scripted), "batch_size": 50, "warmup": 10, "diag_every": 0,
                                      "test_meteor": False}})
    monkeypatch.setattr(train_mod.Trainer, "validate",
                        lambda self: {"val/CIDEr": scripted[self.epoch], "samples": []})
    monkeypatch.setattr(train_mod.Trainer, "diagnostics", lambda self: {})
    run = open_location(str(tmp_path / "run"))
    reports: list[dict] = []

    def keep(metrics, folder):
        reports.append(metrics)
        target = Path(run.join(checkpoint_name(metrics["epoch"])).uri)
        target.mkdir(parents=True)
        (target / CHECKPOINT_FILE).write_bytes((Path(folder) / CHECKPOINT_FILE).read_bytes())

    train_mod.train(cfg, keep, output_dir=tmp_path / "whole")
    return cfg, run, reports[-1]


def test_a_trial_resumed_at_its_best_epoch_scores_the_test_split_as_if_never_stopped(tmp_path, monkeypatch):
    """Val CIDEr scripted 10, 40, 20: epoch 2 is the best. Resumed from epoch 2's checkpoint (a driver killed after
    it), the trial's test scores are those of the uninterrupted run, from the same weights (`best_copy` hands the
    resumed checkpoint itself as the best one; before, the run found no copy and scored nothing)."""
    import a2core.train as train_mod
    from launch.layout import CHECKPOINT_FILE, checkpoint_name
    from launch.trainable import best_copy

    cfg, run, whole = _scripted_run(tmp_path, monkeypatch, {1: 10.0, 2: 40.0, 3: 20.0})
    assert whole["test/epoch"] == 2 and whole["test/CIDEr"] is not None

    work = tmp_path / "work"
    work.mkdir()
    resume_from = work / CHECKPOINT_FILE
    resume_from.write_bytes(Path(run.join(checkpoint_name(2), CHECKPOINT_FILE).uri).read_bytes())
    assert best_copy(run, resume_from, 2, work) == resume_from
    again: list[dict] = []
    train_mod.train(cfg, lambda m, d: again.append(m), output_dir=work / "out", resume_from=resume_from,
                    best_from=best_copy(run, resume_from, 2, work))
    assert [m["epoch"] for m in again] == [3]
    assert again[-1]["test/epoch"] == 2 and again[-1]["test/CIDEr"] == whole["test/CIDEr"]

    # resumed at epoch 3, whose best is epoch 2: a copy of epoch 2's checkpoint from the run folder
    later = work / "later.pt"
    later.write_bytes(Path(run.join(checkpoint_name(3), CHECKPOINT_FILE).uri).read_bytes())
    copy = best_copy(run, later, 3, work)
    assert copy == work / "best_epoch" / CHECKPOINT_FILE
    assert copy.read_bytes() == Path(run.join(checkpoint_name(2), CHECKPOINT_FILE).uri).read_bytes()


def test_a_trial_resumed_from_its_last_epoch_scores_the_test_split_and_reports_that_epoch_again(tmp_path,
                                                                                                 monkeypatch):
    """Killed after its last epoch's checkpoint reached its folder but before that epoch's result (which carries the
    test scores) was kept: resumed from that checkpoint, the run trains nothing, scores the test split from its best
    checkpoint and reports the last epoch again with the scores of the run never stopped (before, it returned with
    no test scores)."""
    import a2core.train as train_mod
    from launch.layout import CHECKPOINT_FILE, checkpoint_name
    from launch.trainable import best_copy

    # epoch 1 is the best: the test split is scored from a copy of its checkpoint
    cfg, run, whole = _scripted_run(tmp_path, monkeypatch, {1: 40.0, 2: 20.0})
    assert whole["epoch"] == 2 and whole["test/epoch"] == 1 and whole["test/CIDEr"] is not None

    work = tmp_path / "work"
    work.mkdir()
    last = work / CHECKPOINT_FILE
    last.write_bytes(Path(run.join(checkpoint_name(2), CHECKPOINT_FILE).uri).read_bytes())
    again: list[tuple] = []
    out = train_mod.train(cfg, lambda m, d: again.append((m, d)), output_dir=work / "out", resume_from=last,
                          best_from=best_copy(run, last, 2, work))
    assert [(m["epoch"], d) for m, d in again] == [(2, None)]  # no new checkpoint
    (metrics, _), = again
    assert metrics["val/CIDEr"] == 20.0 and metrics["test/epoch"] == 1
    assert {k: v for k, v in metrics.items() if k.startswith("test/")} == \
        {k: v for k, v in whole.items() if k.startswith("test/")}
    assert out["test"]["test/CIDEr"] == whole["test/CIDEr"] and out["epochs"] == 2



# -- damaged files beside a trial's checkpoints -----------------------------------------------------------------------
def _stored_checkpoint(folder: Path, epoch: int, best_epoch: int) -> None:
    """A checkpoint folder as a trial stores it: checkpoint.pt, its SHA-256 beside it, the epoch history."""
    import torch

    from a2core.checksum import write_checksum
    from launch.layout import CHECKPOINT_FILE

    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"w": torch.full((4096,), 1.0)}, "config": {}, "vocab": [], "epoch": epoch,
                "best": {"epoch": best_epoch, "val/CIDEr": 1.0}, "format": 2}, folder / CHECKPOINT_FILE)
    write_checksum(folder / CHECKPOINT_FILE)
    (folder / "history.json").write_text(json.dumps([{"epoch": e} for e in range(1, epoch + 1)]))


def test_a_damaged_best_checkpoint_is_not_the_one_the_test_split_is_scored_from(tmp_path, capsys):
    """A trial resumed at epoch 3 whose best epoch is 2 scores the test split from a copy of epoch 2's checkpoint
    (`best_copy`): a flipped byte in it is found by its checksum, as in a checkpoint it resumes from, and the copy
    is not used (None: the run says it has no best checkpoint to score) instead of scoring damaged weights."""
    from launch.layout import CHECKPOINT_FILE, checkpoint_name
    from launch.trainable import best_copy

    run = tmp_path / "run"
    for epoch in (2, 3):
        _stored_checkpoint(run / checkpoint_name(epoch), epoch, best_epoch=2)
    work = tmp_path / "work"
    work.mkdir()
    resume = run / checkpoint_name(3) / CHECKPOINT_FILE
    assert best_copy(open_location(str(run)), resume, 3, work) == work / "best_epoch" / CHECKPOINT_FILE
    stored = run / checkpoint_name(2) / CHECKPOINT_FILE
    data = bytearray(stored.read_bytes())
    data[data.find(bytes.fromhex("0000803f") * 8) + 2000] ^= 0x01  # one byte of the weights
    stored.write_bytes(bytes(data))
    assert best_copy(open_location(str(run)), resume, 3, work) is None
    assert "damaged since it was written" in capsys.readouterr().out


def test_a_flipped_bit_that_breaks_utf8_in_a_small_file_is_passed_over_not_a_crash(tmp_path):
    """A checksum file or an epoch history whose damage makes it no UTF-8 any more: the checkpoint is checked or
    passed over as with any other damage (the resume goes on from what reads), never a UnicodeDecodeError."""
    from a2core.checksum import SUFFIX
    from launch.layout import CHECKPOINT_FILE, checkpoint_name, latest_checkpoint_history
    from launch.trainable import newest_readable_checkpoint

    run = tmp_path / "run"
    for epoch in (1, 2):
        _stored_checkpoint(run / checkpoint_name(epoch), epoch, best_epoch=epoch)
    (run / checkpoint_name(2) / "history.json").write_bytes(b'[{"epoch": 1}, {"epoch": \xb2}]')  # '2' ^ 0x80
    assert latest_checkpoint_history(open_location(str(run))) == [{"epoch": 1}]  # epoch 1's, epoch 2's passed over
    checksum = run / checkpoint_name(2) / (CHECKPOINT_FILE + SUFFIX)
    checksum.write_bytes(b"\xb5" + checksum.read_bytes()[1:])
    work = tmp_path / "work"
    work.mkdir()
    epoch, local = newest_readable_checkpoint(open_location(str(run)), [1, 2], work)
    assert epoch in (1, 2) and local is not None  # a checksum that records nothing checks nothing; the file loads
