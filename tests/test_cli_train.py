"""`a2 train` as a user runs it: one line per epoch, a short summary at the end (with the test scores), the history
and the test scores in files, and a second run that never overwrites the first one's checkpoints."""
import json
import subprocess
import sys

import pytest
import yaml

from a2core.data import synthetic

pytestmark = pytest.mark.slow


def synthetic_test_ids(root) -> list[int]:
    images = json.loads((root / "dataset_coco.json").read_text())["images"]
    return [im["cocoid"] for im in images if im["split"] == "test"]


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
    assert lines[-5].startswith("best val/CIDEr ") and lines[-2] == "checkpoint: runs/a2/best.pt"
    history = json.loads((tmp_path / "runs/a2/history.json").read_text())
    assert [h["epoch"] for h in history] == [1, 2]

    # The end-of-run test evaluation (best epoch, beam search) is printed on the x100 scale and kept in a file
    best_epoch = int(lines[-5].split(" at epoch ")[1].split()[0])
    test = json.loads((tmp_path / "runs/a2/test_scores.json").read_text())
    assert test["epoch"] == best_epoch and test["beam_size"] == 5 and test["split"] == "test"
    assert lines[-4].startswith(f"test (epoch {best_epoch}, beam 5, {test['images']} images, x100): BLEU-1 ")
    assert lines[-3] == "test scores: runs/a2/test_scores.json"
    shown = dict(zip(lines[-4].split(": ", 1)[1].split()[::2], map(float, lines[-4].split(": ", 1)[1].split()[1::2])))
    assert shown == {k: round(v, 2) for k, v in test["scores"].items()}
    assert {"BLEU-1", "BLEU-4", "ROUGE-L", "CIDEr"} <= set(test["scores"])
    assert all(0 <= v <= 1000 for v in test["scores"].values()) and test["scores"]["BLEU-1"] > 1  # x100, not x1
    assert len(test["per_image_cider"]) == test["images"] == len(synthetic_test_ids(root))
    assert sum(test["per_image_cider"].values()) / test["images"] == pytest.approx(test["scores"]["CIDEr"])
    # ... the same numbers as the tutorial's `a2 decode` + `a2 evaluate` of the best checkpoint
    decoded = subprocess.run([sys.executable, "-m", "launch.cli", "decode", "--checkpoints", "runs/a2/best.pt",
                              "--out", "res.json"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert decoded.returncode == 0, decoded.stderr
    scored = subprocess.run([sys.executable, "-m", "launch.cli", "evaluate", "--results", "res.json", "--captions",
                             str(root / "dataset_coco.json")], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert scored.returncode == 0, scored.stderr
    again = json.loads(scored.stdout)
    for name in ("BLEU-4", "ROUGE-L", "CIDEr"):
        assert again[name] == pytest.approx(test["scores"][name], abs=1e-6), name
    best_before = (tmp_path / "runs/a2/best.pt").read_bytes()

    second = a2_train("--config", str(config), "train.xe_epochs=1", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "runs/a2 holds an earlier run's checkpoints; this run writes to runs/a2-2" in second.stdout
    assert (tmp_path / "runs/a2/best.pt").read_bytes() == best_before
    assert [h["epoch"] for h in json.loads((tmp_path / "runs/a2-2/history.json").read_text())] == [1]
