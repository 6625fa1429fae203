"""`a2 train` and `a2 decode` refuse an output path they cannot write before any work (not after an epoch, or after
decoding a whole split), number a run folder given as `.`, and name the model keys that stop a resume."""
import pytest
import yaml

from a2core.data import synthetic
from launch.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A one-epoch tiny run's config and its finished run folder (runs/a2 under the module's folder)."""
    base = tmp_path_factory.mktemp("hostile")
    synthetic.generate(base / "data", seed=3, images=40, test_images=5)
    config = base / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"root": str(base / "data"), "images": 40, "seed": 3, "val_images": 5},
        "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10},
        "train": {"xe_epochs": 1, "batch_size": 50, "warmup": 10, "test_meteor": False, "diag_images": 5,
                  "diag_kendall_images": 2, "test_at_end": False}}))
    assert main(["train", "--config", str(config), "--output-dir", str(base / "run")]) == 0
    return base, config


def _no_training(monkeypatch):
    """Fail the test if any training starts."""
    import launch.commands.local as local
    monkeypatch.setattr(local, "train", lambda *a, **k: pytest.fail("training started"))


@pytest.mark.parametrize("where", ["afile", "afile/sub"])
def test_train_refuses_an_output_dir_under_a_file_before_training(tiny, tmp_path, capsys, monkeypatch, where):
    _, config = tiny
    (tmp_path / "afile").write_text("x")
    _no_training(monkeypatch)
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err.strip()
    expected = (f"{tmp_path}/afile is a file, not a folder to write into" if where == "afile"
                else f"{tmp_path}/afile/sub: {tmp_path}/afile is a file, not a folder")
    assert err == f"a2: error: --output-dir: {expected}"
    assert (tmp_path / "afile").read_text() == "x"


def test_train_refuses_a_configured_output_dir_that_is_a_file_naming_the_config(tiny, tmp_path, capsys,
                                                                                   monkeypatch):
    _, config = tiny
    (tmp_path / "afile").write_text("x")
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "output_dir": str(tmp_path / "afile")}))
    _no_training(monkeypatch)
    assert main(["train", "--config", str(other)]) == 2
    assert capsys.readouterr().err.strip() == \
        f"a2: error: {other}: output_dir: {tmp_path}/afile is a file, not a folder to write into"


def test_train_refuses_an_empty_output_dir(tiny, capsys, monkeypatch):
    _, config = tiny
    _no_training(monkeypatch)
    assert main(["train", "--config", str(config), "--output-dir", ""]) == 2
    assert capsys.readouterr().err.strip() == \
        "a2: error: --output-dir: is empty; name the folder for the run's checkpoints"


def test_train_into_dot_holding_a_run_numbers_a_new_folder(tiny, capsys, monkeypatch):
    """`--output-dir .` in a run's folder: a new numbered folder beside it (was a ValueError traceback)."""
    from launch.commands.local import resumed_output
    base, _ = tiny
    monkeypatch.chdir(base / "run")
    out, best = resumed_output(None, ".", "runs/a2")
    assert (out, best) == (base / "run-2", None)
    assert f"holds an earlier run's checkpoints; this run writes to {base}/run-2" in capsys.readouterr().out


@pytest.mark.parametrize("what", ["folder", "under_file", "empty"])
def test_decode_refuses_an_unwritable_out_before_decoding(tiny, tmp_path, capsys, monkeypatch, what):
    base, _ = tiny
    import a2core.decode
    monkeypatch.setattr(a2core.decode, "load_ensemble", lambda *a, **k: pytest.fail("checkpoints read"))
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    out, expected = {"folder": (tmp_path / "adir", f"{tmp_path}/adir is a folder, not a file to write"),
                     "under_file": (tmp_path / "afile/r.json",
                                    f"{tmp_path}/afile/r.json: {tmp_path}/afile is a file, not a folder"),
                     "empty": ("", "is empty; name the file to write")}[what]
    assert main(["decode", "--checkpoints", str(base / "run/best.pt"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"a2: error: --out: {expected}"


def test_a_resume_with_another_model_names_the_keys(tiny, tmp_path, capsys):
    base, config = tiny
    assert main(["train", "--config", str(config), "--resume", str(base / "run/last.pt"), "--output-dir",
                 str(tmp_path / "new"), "model.max_regions=8", "model.fusion=max", "train.xe_epochs=2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"a2: error: {base}/run/last.pt: its model config differs from this run's (model.max_regions 10 in it, 8 "
        f"here; model.fusion 'gate' in it, 'max' here); cannot resume")
