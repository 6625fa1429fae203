"""Checkpoints load with `weights_only=True`: a crafted pickle never runs under `a2 decode`, `a2 train --resume` or
`load_ensemble` (what packaging uses), and is refused naming the file and the global it needs; checkpoints written
with numpy's array RNG state (the older form) keep loading and resume exactly; ensembles of checkpoints that read
different inputs are refused."""
import os
import pickle
import random

import numpy as np
import pytest
import torch

from a2core import checkpoint as ckpt
from a2core.config import Config
from a2core.data import synthetic
from a2core.data.captions import SPECIALS
from a2core.errors import CheckpointError
from a2core.model.a2 import build_model
from a2core.train import train
from launch.cli import main as cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_MODEL = {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10}


class _Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(params=["torch.save", "raw pickle"])
def malicious(request, tmp_path):
    """A checkpoint.pt in a folder, whose loading with weights_only=False would create the marker file."""
    marker = tmp_path / "marker"
    path = tmp_path / "ckpt" / ckpt.CHECKPOINT_FILE
    path.parent.mkdir()
    state = {"model": _Payload(marker), "config": {}, "vocab": list(SPECIALS)}
    if request.param == "torch.save":
        torch.save(state, path)
    else:
        path.write_bytes(pickle.dumps(state))
    return path, marker


def _assert_refused(capsys, code, path, marker):
    assert code == 2
    err = capsys.readouterr().err
    assert str(path) in err and "posix.system" in err and "Traceback" not in err
    assert not marker.exists()


def test_malicious_checkpoint_never_runs_under_decode(malicious, tmp_path, capsys):
    path, marker = malicious
    code = cli(["decode", "--checkpoints", str(path.parent), "--out", str(tmp_path / "r.json")])
    _assert_refused(capsys, code, path, marker)


def test_malicious_checkpoint_never_runs_under_train_resume(malicious, tmp_path, capsys):
    path, marker = malicious
    code = cli(["train", "--resume", str(path), "--output-dir", str(tmp_path / "out"), "train.xe_epochs=1"])
    _assert_refused(capsys, code, path, marker)


def test_malicious_checkpoint_never_runs_under_load_ensemble(malicious):
    path, marker = malicious
    with pytest.raises(CheckpointError, match=rf"{path}: .*posix\.system"):
        ckpt.load_ensemble([path])
    assert not marker.exists()


def test_truncated_and_foreign_files_are_refused(tmp_path):
    good = tmp_path / "good.pt"
    ckpt.save({"model": {}, "config": {}, "vocab": list(SPECIALS)}, good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=rf"{cut}: not a checkpoint written by torch.save"):
        ckpt.load(cut)
    weights = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, weights)
    with pytest.raises(CheckpointError, match=rf"{weights}: not an a2tune checkpoint \(no 'model'\)"):
        ckpt.load(weights)


def _checkpoint(cfg: Config, vocab: list[str], seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = build_model(cfg.model, len(vocab), cfg.data.max_caption_len + 2)
    return {"model": model.state_dict(), "config": cfg.to_dict(), "vocab": vocab, "epoch": 1}


def test_new_checkpoints_hold_only_plain_data_and_restore_every_rng(tmp_path):
    path = ckpt.save({"model": {}, "config": {}, "vocab": list(SPECIALS), "rng": ckpt.rng_state()}, tmp_path / "c.pt")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []  # nothing to allow-list
    expected = (random.random(), np.random.rand(), np.random.randn(), torch.rand(1).item())
    ckpt.set_rng_state(ckpt.load(path)["rng"])
    assert (random.random(), np.random.rand(), np.random.randn(), torch.rand(1).item()) == expected


def test_a_checkpoint_with_the_older_numpy_rng_state_loads_and_restores_it(tmp_path):
    cfg = Config.from_dict({"model": TINY_MODEL})
    state = _checkpoint(cfg, list(SPECIALS) + ["a", "dog"])
    np.random.seed(3)
    np.random.randn()  # a cached gaussian is part of the state too
    state["rng"] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                    "cuda": None}  # what checkpoints held before: numpy's tuple with a uint32 array
    expected = np.random.rand(3)
    path = ckpt.save(state, tmp_path / "old.pt")
    assert "numpy.ndarray" in torch.serialization.get_unsafe_globals_in_checkpoint(path)

    loaded = ckpt.load(path)
    assert isinstance(loaded["rng"]["numpy"]["state"]["key"], list)  # converted to plain data
    ckpt.set_rng_state(loaded["rng"])
    assert np.array_equal(np.random.rand(3), expected)
    model, vocab, config = ckpt.load_model(path)
    assert len(vocab) == 6 and config["model"]["d_model"] == 16
    assert torch.equal(model.state_dict()["embed.weight"], state["model"]["embed.weight"])


@pytest.mark.parametrize("key, value", [("model.feature_dim", 64), ("model.max_regions", 20),
                                        ("data.max_caption_len", 12)])
def test_an_ensemble_of_checkpoints_reading_different_inputs_is_refused(tmp_path, key, value):
    vocab = list(SPECIALS) + ["a"]
    base = Config.from_dict({"model": TINY_MODEL})
    first = ckpt.save(_checkpoint(base, vocab), tmp_path / "a.pt")
    other = ckpt.save(_checkpoint(base.replace({key: value}), vocab, seed=1), tmp_path / "b.pt")
    models, _, _ = ckpt.load_ensemble([first, first])
    assert len(models) == 2
    with pytest.raises(CheckpointError, match=rf"{other}: {key} is {value}, but .* in {first}"):
        ckpt.load_ensemble([first, other])
    # architecture keys may differ: an ensemble of two depths is fine
    deeper = ckpt.save(_checkpoint(base.replace({"model.layers": 2}), vocab), tmp_path / "c.pt")
    assert len(ckpt.load_ensemble([first, deeper])[0]) == 2


@pytest.mark.slow
def test_resume_from_a_checkpoint_with_the_older_rng_state_is_exact(tmp_path):
    """Resuming converts the older state and continues bit-identically to a run that never stopped."""
    root = tmp_path / "syn"
    synthetic.generate(root, seed=5, images=40, test_images=5)
    cfg = Config.from_dict({"data": {"root": str(root), "images": 40, "seed": 5, "val_images": 5},
                            "model": TINY_MODEL, "train": {"xe_epochs": 2, "batch_size": 50, "warmup": 20}})
    full: list[dict] = []
    train(cfg, report=lambda m, d: full.append(m), output_dir=tmp_path / "full")
    train(cfg.replace({"train.xe_epochs": 1}), report=None, output_dir=tmp_path / "part")
    state = torch.load(tmp_path / "part" / "last.pt", weights_only=True)
    key = np.asarray(state["rng"]["numpy"]["state"]["key"], np.uint32)
    np_state = state["rng"]["numpy"]
    state["rng"]["numpy"] = ("MT19937", key, np_state["state"]["pos"], np_state["has_gauss"], np_state["gauss"])
    old = ckpt.save(state, tmp_path / "old.pt")
    resumed: list[dict] = []
    train(cfg, report=lambda m, d: resumed.append(m), output_dir=tmp_path / "part", resume_from=old)
    assert [m["epoch"] for m in resumed] == [2]
    assert resumed[0]["train/loss"] == full[1]["train/loss"] and resumed[0]["val/CIDEr"] == full[1]["val/CIDEr"]


def test_a_view_is_saved_as_its_own_tensor_not_its_whole_storage(tmp_path):
    """A fused seed's weights and Adam moments are slices of the (k, ...) stacked tensors: torch.save wrote the
    whole stack into every seed's checkpoint (k times its size, every seed's weights)."""
    import torch

    from a2core import checkpoint as ckpt

    stacked = torch.arange(3 * 1024, dtype=torch.float32).reshape(3, 32, 32)
    ckpt.save({"model": {"w": stacked[1]}, "opt": [{"exp_avg": stacked[2]}]}, tmp_path / "seed.pt")
    state = torch.load(tmp_path / "seed.pt", weights_only=True)
    assert torch.equal(state["model"]["w"], stacked[1]) and torch.equal(state["opt"][0]["exp_avg"], stacked[2])
    assert state["model"]["w"].untyped_storage().nbytes() == 32 * 32 * 4


def test_a_checkpoint_whose_select_metric_a_later_rule_refuses_still_loads_and_decodes(tmp_path):
    """A checkpoint's config describes a run already trained: a rule added later on how a run selects its best epoch
    (here: METEOR selected without train.val_meteor) refused it, so it could not be decoded, packaged or checked."""
    cfg = Config.from_dict({"model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "feature_dim": 8,
                                      "max_regions": 4}})
    vocab = [*SPECIALS, "a", "dog"]
    state = _checkpoint(cfg, vocab)
    state["config"]["train"]["select_metric"] = "val/METEOR"  # what an older a2core accepted
    from a2core.errors import ConfigError
    with pytest.raises(ConfigError, match="select_metric"):
        Config.from_dict(state["config"])  # a new run configured so is still refused
    path = ckpt.save(state, tmp_path / "old.pt")
    model, loaded_vocab, config = ckpt.model_from_state(ckpt.load(path))
    assert config["train"]["select_metric"] == "val/METEOR" and loaded_vocab.words == vocab
    assert all(torch.equal(value, state["model"][key]) for key, value in model.state_dict().items())
