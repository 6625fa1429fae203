"""`a2 train` as a user runs it: one line per epoch, a short summary at the end, the history in a file, and a
second run that never overwrites the first one's checkpoints."""
import json
import subprocess
import sys

import pytest
import yaml

from a2core.data import synthetic

pytestmark = pytest.mark.slow


def a2_train(*args, cwd):
    return subprocess.run([sys.executable, "-m", "launch.cli", "train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_train_summarises_and_never_overwrites_an_earlier_run(tmp_path):
    root = tmp_path / "data"
    synthetic.generate(root, seed=3, images=40, test_images=5)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"root": str(root), "images": 40, "seed": 3, "val_images": 5},
        "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10, "fusion": "gate"},
        "train": {"xe_epochs": 2, "batch_size": 50, "warmup": 10}}))
    first = a2_train("--config", str(config), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["epoch 1", "epoch 2"]
    assert "val/CIDEr" in lines[0] and "{" not in first.stdout  # no JSON dump of the history
    assert lines[-3].startswith("best val/CIDEr ") and lines[-2] == "checkpoint: runs/a2/best.pt"
    history = json.loads((tmp_path / "runs/a2/history.json").read_text())
    assert [h["epoch"] for h in history] == [1, 2]
    best_before = (tmp_path / "runs/a2/best.pt").read_bytes()

    second = a2_train("--config", str(config), "train.xe_epochs=1", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "runs/a2 holds an earlier run's checkpoints; this run writes to runs/a2-2" in second.stdout
    assert (tmp_path / "runs/a2/best.pt").read_bytes() == best_before
    assert [h["epoch"] for h in json.loads((tmp_path / "runs/a2-2/history.json").read_text())] == [1]
