"""Divergence ends a trial with a reason: a non-finite loss stops `a2core.train` at that step (`TrainingDiverged`),
`a2 train` says so in one line, and a study's trial that diverged is recorded (`ended.json`), shown by status,
compare and report, and exported FAILED with `a2.end_reason=diverged` while the study itself finishes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from a2core import checkpoint as ckpt
from a2core.config import Config
from a2core.data import synthetic
from a2core.errors import TrainingDiverged
from a2core.train import Trainer, _Dist, train
from launch.layout import ENDED_FILE, TRIALS_DIR, end_record, run_status, train_run_name
from launch.conclusions import state_text
from tests.raycluster import tiny_data  # noqa: F401 - a fixture
from tests.studyfolder import fabricated_study

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = {"model": {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "max_regions": 10, "fusion": "gate"},
        "train": {"xe_epochs": 3, "batch_size": 50, "warmup": 1, "lr_factor": 0.5, "diag_every": 0}}
EXPLODES = 1e30  # lr_factor: Adam's first steps move every weight by ~1e28, the next forward pass overflows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn") / "tiny"
    synthetic.generate(root, seed=5, images=100, test_images=10)
    return {"root": str(root), "images": 100, "seed": 5, "val_images": 10}


def _cfg(data, **over) -> Config:
    return Config.from_dict({"data": data, **json.loads(json.dumps(TINY))}).replace(over)


def test_training_stops_at_the_first_non_finite_loss(data, tmp_path):
    seen = []
    with pytest.raises(TrainingDiverged) as caught:
        train(_cfg(data, **{"train.lr_factor": EXPLODES}), report=lambda m, d: seen.append(m["epoch"]),
              output_dir=tmp_path / "run")
    err = caught.value
    # step 1 is finite (the weights are still the initial ones); step 2's forward pass sees the exploded weights
    assert (err.epoch, err.step, err.key, str(err.value)) == (1, 2, "train/loss", "nan")
    assert str(err).startswith("training diverged at epoch 1 step 2: train/loss is nan")
    assert seen == [] and not (tmp_path / "run" / "last.pt").exists()  # the epoch is neither reported nor saved


def test_a_run_diverging_later_keeps_its_earlier_epochs(data, tmp_path):
    """Epoch 1 trains normally; resumed from its checkpoint with an exploding learning rate, the run stops in
    epoch 2 (5 steps an epoch: 50 train images, 10 a step) at step 8, its third (Adam's moments from epoch 1 damp the
    first steps' moves; fixed seed, so the same step every time)."""
    kept = tmp_path / "epoch1.pt"

    def keep(metrics, folder):
        if metrics["epoch"] == 1:
            kept.write_bytes((Path(folder) / ckpt.CHECKPOINT_FILE).read_bytes())

    train(_cfg(data, **{"train.xe_epochs": 1}), report=keep, output_dir=tmp_path / "first")
    seen = []
    with pytest.raises(TrainingDiverged) as caught:
        train(_cfg(data, **{"train.lr_factor": EXPLODES}), report=lambda m, d: seen.append(m["epoch"]),
              output_dir=tmp_path / "again", resume_from=kept)
    assert (caught.value.epoch, caught.value.step) == (2, 8)
    assert seen == [] and ckpt.load(kept)["epoch"] == 1


@pytest.mark.parametrize("log_every", [1000, 2])
def test_a_cross_entropy_step_reads_nothing_back_to_the_host(data, tmp_path, monkeypatch, log_every):
    """Losses, running means and the divergence flag stay on the device between the steps the trainer reads them
    (`train.log_every` and the epoch's last): no a2core code reads a tensor's value (`item`, `tolist`, `float`,
    `bool`, `int`) at any other step. On a GPU each such read would wait for the step's kernels (a host sync)."""
    trainer = Trainer(_cfg(data, **{"train.xe_epochs": 1, "train.log_every": log_every}), tmp_path / "run")
    read_at = []
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        def reading(self, *args, _read=getattr(torch.Tensor, name), **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "/a2core/" in caller and "/data/" not in caller:  # the loader's own bookkeeping is on the host
                read_at.append(trainer.step)
            return _read(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, reading)
    trainer.model.train()
    metrics = trainer.xe_epoch()
    monkeypatch.undo()
    steps = len(trainer._batches())
    assert trainer.step == steps == 5 and metrics["train/loss"] > 0
    assert sorted(set(read_at)) == ([5] if log_every > steps else [2, 4, 5]), read_at


def test_every_rank_learns_of_a_non_finite_loss_in_the_gradient_all_reduce(tmp_path):
    """The flag rides in the gradients' one all-reduce (gloo, one rank here): summed, and the gradients untouched."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        param = torch.nn.Parameter(torch.zeros(3))
        param.grad = torch.tensor([1.0, 2.0, 3.0])
        flag = _Dist().average_grads([param], torch.tensor([1.0]))
        assert flag.tolist() == [1.0] and param.grad.tolist() == [1.0, 2.0, 3.0]
        assert _Dist().average_grads([param], torch.tensor([0.0])).tolist() == [0.0]
        assert _Dist().average_grads([param]) is None
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a2_train_prints_one_line_and_exits_non_zero(data, tmp_path):
    config = tmp_path / "diverges.yaml"
    config.write_text(yaml.safe_dump({"data": data, **TINY, "train": {**TINY["train"], "lr_factor": EXPLODES}}))
    done = subprocess.run([sys.executable, "-m", "launch.cli", "train", "--config", str(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("a2: error:")]
    assert errors == ["a2: error: training diverged at epoch 1 step 2: train/loss is nan (a learning rate too "
                      "high? train.lr_factor, train.warmup, train.grad_clip)"]
    assert "Traceback" not in done.stderr


# -- the study's record, its views and its MLflow export -------------------------------------------------------
DIVERGED = {"reason": "diverged", "epoch": 2, "step": 7, "key": "train/loss", "value": "nan"}


@pytest.fixture
def fab(tmp_path):
    fab = fabricated_study(tmp_path, "div", epochs=3, overrides=("search.replicates=2",))  # 2 arms x 2 seeds
    for seed in (0, 1):
        fab.add(f"none{seed}", {"fusion": "none", "seed": seed},
                [{"epoch": e, "val/CIDEr": 90.0 + e + seed, "compute/wall_s": 10.0 * e} for e in (1, 2, 3)])
    fab.add("gate1", {"fusion": "gate", "lambda": 0.05, "seed": 1},
            [{"epoch": e, "val/CIDEr": 95.0 + e, "compute/wall_s": 10.0 * e} for e in (1, 2, 3)])
    # diverged in epoch 2: its one epoch stays, Tune ended it TERMINATED (the trial returned), its end record says why
    fab.add("gate0", {"fusion": "gate", "lambda": 0.05, "seed": 0},
            [{"epoch": 1, "val/CIDEr": 50.0, "compute/wall_s": 10.0}])
    folder = fab.location.at(TRIALS_DIR, train_run_name(fab.spec.name, "gate0"))
    folder.join(ENDED_FILE).write_text(json.dumps(DIVERGED))
    return fab


def test_the_record_keeps_the_reason_and_does_not_call_it_stopped_early(fab):
    record = fab.record()
    rows = {r["trial_id"]: r for r in record.trials}
    assert rows["gate0"]["ended"] == DIVERGED and rows["none0"]["ended"] is None
    assert rows["gate0"]["stopped_early"] is None  # not the scheduler's stop
    assert state_text(rows["gate0"]) == "diverged at epoch 2 step 7 (train/loss nan)"
    summary = record.summary()
    assert summary["compute"]["total_wall_s"] == 100.0 and summary["compute"]["stopped_wall_s"] == 0.0
    runs = {r.trial_id: r for r in record.study().runs}
    assert runs["gate0"].status == "FAILED" and runs["gate0"].tags["a2.end_reason"] == "diverged"
    assert runs["none0"].status == "FINISHED" and "a2.end_reason" not in runs["none0"].tags


def test_the_export_tags_the_run_diverged_and_the_study_finishes(fab):
    from launch.tracking_writer import StudyTracker

    fab.export()
    tracker = StudyTracker(fab.spec.tracking.mlflow_uri, fab.spec.name)
    runs = {r.data.tags.get("a2.trial_id"): r for r in tracker.client.search_runs([tracker.experiment_id])}
    assert runs["gate0"].info.status == "FAILED" and runs["gate0"].data.tags["a2.end_reason"] == "diverged"
    assert runs["none0"].info.status == "FINISHED" and "a2.end_reason" not in runs["none0"].data.tags
    parent = runs[None]
    assert parent.info.status == "FINISHED" and "a2.end_reason" not in parent.data.tags  # the study went on, whole


def test_status_compare_and_report_show_the_reason(fab, monkeypatch, tmp_path, capsys):
    from launch.cli import main

    fab.patch_tune(monkeypatch)
    storage = str(fab.spec.storage)
    assert main(["study", "status", "div", "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert "4/4 trials finished" in out and "diverged at epoch 2 step 7 (train/loss nan)" in out
    assert main(["study", "compare", "div", "--storage", storage]) == 0
    assert "note: trial gate0 diverged at epoch 2 step 7 (train/loss nan)" in capsys.readouterr().out
    assert main(["report", "div", "--storage", storage, "--out", str(tmp_path / "rep")]) == 0
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "FAILED (diverged)" in html and "1 diverged" in html


def test_an_end_record_that_is_not_one_is_named(fab):
    from a2core.errors import StudyError

    folder = fab.location.at(TRIALS_DIR, train_run_name(fab.spec.name, "gate0"))
    folder.join(ENDED_FILE).write_text('{"reason": "bored"}')
    with pytest.raises(StudyError, match=f"{ENDED_FILE}: not an end record"):
        end_record(folder)
    assert run_status("TERMINATED", 1, None, 3, True, DIVERGED) == "FAILED"
    assert run_status("TERMINATED", 1, None, 3, True) == "KILLED"


# -- a real study: one arm diverges, the study goes on ------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("workers", [1, 2])  # a one-worker trial trains in Tune's process; two run on Ray Train
def test_a_study_whose_arm_diverges_goes_on_and_records_why(tmp_path, tiny_data, workers):
    """Run under the Ray lock (tests/test_readme.py): `flock /tmp/a2-ray.lock pytest ...`."""
    from launch.tracking_writer import StudyTracker
    from tests.raycluster import a2, tiny_study

    study = tiny_study(tmp_path, "div", tiny_data, fusions=("none",), epochs=2, workers=workers,
                       cpus_per_worker=0.5, extra={"train.warmup": 1})
    raw = yaml.safe_load(study.read_text())
    raw["search"]["space"]["train.lr_factor"] = {"grid": [0.5, EXPLODES]}
    study.write_text(yaml.safe_dump(raw, sort_keys=False))
    done = a2("study", "run", str(study), cwd=tmp_path, timeout=800)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "diverged at epoch 1 step 2 (train/loss nan): it ends here, the study goes on" in done.stdout
    summary = json.loads((tmp_path / "studies" / "div" / "summary.json").read_text())
    assert summary["complete"] and summary["trials_finished"] == 2
    rows = {t["sampled"]["train.lr_factor"]: t for t in summary["trials"]}
    assert rows[EXPLODES]["ended"]["reason"] == "diverged" and rows[EXPLODES]["epochs_done"] == 0
    assert rows[0.5]["ended"] is None and rows[0.5]["epochs_done"] == 2
    status = a2("study", "status", "div", "--storage", str(tmp_path / "studies"), cwd=tmp_path, timeout=300)
    assert "diverged at epoch 1 step 2 (train/loss nan)" in status.stdout, status.stdout[-3000:]
    tracker = StudyTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "div")
    runs = tracker.client.search_runs([tracker.experiment_id])
    trial_runs = [r for r in runs if r.data.tags.get("a2.role") == "trial"]
    assert sorted((r.info.status, str(r.data.tags.get("a2.end_reason"))) for r in trial_runs) == [
        ("FAILED", "diverged"), ("FINISHED", "None")]
    assert [r.info.status for r in runs if r.data.tags.get("a2.role") == "study"] == ["FINISHED"]


def test_a_test_image_without_sentences_is_refused_before_training_not_at_the_test_evaluation(data, tmp_path):
    """read_karpathy lets test images have no sentences (a split only decoded), but the run's last act, the test
    evaluation, scores every test image with CIDEr-D: it used to fail there with a ValueError after every epoch was
    paid for. Now the run is refused at its start naming the image; a run that does not score test goes ahead."""
    from a2core.errors import DataError

    doc = json.loads((Path(data["root"]) / "dataset_coco.json").read_text())
    bare = next(img for img in doc["images"] if img["split"] == "test")
    bare["sentences"] = []
    (tmp_path / "captions.json").write_text(json.dumps(doc))
    coco = {"kind": "coco", "captions": str(tmp_path / "captions.json"),
            "features": str(Path(data["root"]) / "features.h5")}
    cfg = Config.from_dict({"data": coco, **json.loads(json.dumps(TINY))})
    with pytest.raises(DataError, match=rf"captions\.json: 1 test image\(s\) have no sentences to score captions "
                                        rf"against, e\.g\. image id {bare['cocoid']}"):
        Trainer(cfg, tmp_path / "run")
    assert Trainer(cfg.replace({"train.test_at_end": False}), tmp_path / "run2").data.references("test")[
        bare["cocoid"]] == []
