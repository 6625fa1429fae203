"""Audit of a2core.train's checkpoints: a run killed between writing last.pt and linking best.pt to it resumes with
the right best epoch (SCST starts from it, as in the uninterrupted run), and a file system without hard links still
gets its best.pt."""
import errno
import json
import os

import pytest
import torch

from a2core import checkpoint as ckpt
from a2core.config import Config
from a2core.data import synthetic
from a2core.train import train

pytestmark = [pytest.mark.outside_ray_group, pytest.mark.usefixtures("one_torch_thread")]

SEED = 31


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit76") / "synth"
    synthetic.generate(root, seed=SEED, images=60)  # 30 train, 15 val, 15 test
    return root


def _cfg(root, **train) -> Config:
    # selected by the training loss, which falls every epoch here: each epoch is the best so far
    return Config.from_dict({
        "data": {"root": str(root), "images": 60, "seed": SEED},
        "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10, "fusion": "gate"},
        "train": {"xe_epochs": 2, "scst_epochs": 1, "batch_size": 10, "warmup": 5, "log_every": 1000,
                  "scst_samples": 3, "diag_every": 0, "test_at_end": False, "select_metric": "train/loss",
                  "select_mode": "min", **train}})


def test_a_run_killed_before_best_pt_was_linked_resumes_into_scst_from_its_best_epoch(root, tmp_path, monkeypatch):
    cfg = _cfg(root)
    full: list[dict] = []
    train(cfg, report=lambda m, d: full.append(m), output_dir=tmp_path / "full")
    assert [m["best/epoch"] for m in full[:2]] == [1, 2]  # epoch 2 is the XE checkpoint SCST starts from

    real_link, links = os.link, []

    def killed_at_epoch_2s_best(src, dst, *args, **kwargs):
        if str(dst).endswith(".best.pt.tmp"):
            links.append(dst)
            if len(links) == 2:  # epoch 2's last.pt is written; the kill comes before best.pt follows it
                raise KeyboardInterrupt
        return real_link(src, dst, *args, **kwargs)

    part = tmp_path / "part"
    monkeypatch.setattr(os, "link", killed_at_epoch_2s_best)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, output_dir=part)
    monkeypatch.setattr(os, "link", real_link)
    assert ckpt.load(part / "last.pt")["epoch"] == 2 and ckpt.load(part / "best.pt")["epoch"] == 1

    # `a2 train --resume part/last.pt` goes on in its own folder with no best_from
    resumed: list[dict] = []
    result = train(cfg, report=lambda m, d: resumed.append(m), output_dir=part, resume_from=part / "last.pt")
    assert ckpt.load(result["best_checkpoint"])["epoch"] == result["best_epoch"] == 3
    a, b = ckpt.load(tmp_path / "full" / "last.pt"), ckpt.load(part / "last.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # SCST began from epoch 2, as in full
    assert resumed[0]["train/reward"] == full[2]["train/reward"]
    assert resumed[0]["train/loss"] == full[2]["train/loss"]


def test_a_file_system_without_hard_links_still_gets_best_pt(root, tmp_path, monkeypatch):
    def no_hard_links(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted", str(dst))

    monkeypatch.setattr(os, "link", no_hard_links)
    cfg = _cfg(root, scst_epochs=0)
    seen: list[dict] = []
    result = train(cfg, report=lambda m, d: seen.append(json.loads(json.dumps(m["epoch"]))), output_dir=tmp_path)
    assert seen == [1, 2] and result["best_epoch"] == 2
    best, last = ckpt.load(tmp_path / "best.pt"), ckpt.load(tmp_path / "last.pt")
    assert best["epoch"] == last["epoch"] == 2
    assert all(torch.equal(best["model"][k], last["model"][k]) for k in last["model"])
