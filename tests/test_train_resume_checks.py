"""Resuming a run: the best checkpoint it reports is the one it used, and a changed selection rule is refused."""
import json

import pytest
import yaml

from a2core import checkpoint as ckpt
from a2core.config import Config
from a2core.data import synthetic
from a2core.errors import CheckpointError
from a2core.train import train

TINY = {"model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "dropout": 0.0, "max_regions": 10},
        "train": {"xe_epochs": 2, "scst_epochs": 0, "batch_size": 25, "warmup": 10, "log_every": 2,
                  "diag_images": 5, "diag_kendall_images": 2, "test_meteor": False, "beam_size": 2}}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn") / "tiny"
    synthetic.generate(root, seed=0, images=40)
    return {"kind": "synthetic", "seed": 0, "images": 40, "root": str(root)}


@pytest.fixture(scope="module")
def old_run(data, tmp_path_factory):
    """A finished tiny run: OLD/best.pt and OLD/last.pt."""
    out = tmp_path_factory.mktemp("old")
    result = train(_cfg(data), output_dir=out)
    assert (out / "best.pt").is_file() and (out / "last.pt").is_file()
    return out, result


def _cfg(data, **over):
    cfg = Config.from_dict({"data": data, **json.loads(json.dumps(TINY))})
    return cfg.replace(over) if over else cfg


def test_a_resume_into_a_new_folder_reports_the_best_checkpoint_it_scored_the_test_split_from(data, old_run,
                                                                                                 tmp_path):
    old, _ = old_run
    new = tmp_path / "new"
    # resumed from the last epoch: nothing is trained, the best epoch stays one of OLD's
    result = train(_cfg(data), output_dir=new, resume_from=old / "last.pt", best_from=old / "best.pt")
    assert not (new / "best.pt").exists()
    assert result["test"], "the test split is scored from OLD's best.pt"
    assert result["best_checkpoint"] == str(old / "best.pt")
    assert result["test"]["test/epoch"] == ckpt.load(result["best_checkpoint"])["epoch"]


def test_a_resume_with_no_copy_of_the_best_epoch_reports_no_best_checkpoint(data, old_run, tmp_path):
    old, _ = old_run
    result = train(_cfg(data), output_dir=tmp_path / "new", resume_from=old / "last.pt")
    assert result["best_checkpoint"] is None
    assert result["test"] == {}


def test_a_run_in_its_own_folder_reports_its_best_pt(old_run):
    old, result = old_run
    assert result["best_checkpoint"] == str(old / "best.pt")


def test_a2_train_prints_and_records_the_checkpoint_it_scored(data, old_run, tmp_path, capsys, monkeypatch):
    from launch.cli import main
    old, _ = old_run
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump({"data": data, **TINY}))
    new = tmp_path / "new"
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(config), "--resume", str(old / "last.pt"),
                 "--output-dir", str(new)]) == 0
    printed = capsys.readouterr().out
    assert f"checkpoint: {old / 'best.pt'}" in printed
    assert f"checkpoint: {new / 'best.pt'}" not in printed
    assert json.loads((new / "test_scores.json").read_text())["checkpoint"] == str(old / "best.pt")


@pytest.mark.parametrize("key, value, was", [("select_metric", "val/BLEU-4", "'val/CIDEr'"),
                                             ("select_mode", "min", "'max'")])
def test_a_resume_with_another_selection_rule_is_refused(data, old_run, tmp_path, key, value, was):
    old, _ = old_run
    cfg = _cfg(data, **{f"train.{key}": value})
    if key == "select_mode":
        cfg = cfg.replace({"train.select_metric": "val/CIDEr"})
    with pytest.raises(CheckpointError) as err:
        train(cfg, output_dir=tmp_path / "new", resume_from=old / "last.pt", best_from=old / "best.pt")
    message = str(err.value)
    assert str(old / "last.pt") in message and f"train.{key}" in message
    assert was in message and repr(value) in message
    assert not (tmp_path / "new" / "last.pt").exists()


def test_a_resume_with_the_same_selection_rule_is_accepted(data, old_run, tmp_path):
    old, _ = old_run
    cfg = _cfg(data, **{"train.select_metric": "val/CIDEr", "train.select_mode": "max"})
    train(cfg, output_dir=tmp_path / "new", resume_from=old / "last.pt", best_from=old / "best.pt")


@pytest.mark.parametrize("key, value", [("data.vocab_min_count", 1), ("data.val_images", 5), ("data.seed", 1)])
def test_a_resume_onto_other_data_is_refused_naming_the_key(data, old_run, tmp_path, key, value):
    """Other images or another vocabulary went on silently with the checkpoint's word ids; a data path may differ
    (a node's copy of the store)."""
    old, _ = old_run
    name = key.split(".")[1]
    was = data.get(name, Config.from_dict({}).to_dict()["data"][name])  # the file's value, else the default
    with pytest.raises(CheckpointError) as err:
        train(_cfg(data, **{key: value}), output_dir=tmp_path / "new", resume_from=old / "last.pt")
    assert str(err.value) == (f"{old / 'last.pt'}: it was trained on other data ({key} {was!r} in it, {value!r} here); "
                              f"cannot resume")
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


def test_a_resume_from_a_moved_copy_of_the_data_is_accepted(data, old_run, tmp_path):
    import shutil

    old, _ = old_run
    moved = tmp_path / "moved"
    shutil.copytree(data["root"], moved)
    result = train(_cfg({**data, "root": str(moved)}), output_dir=tmp_path / "new", resume_from=old / "last.pt")
    assert result["epochs"] == 2
