"""Checkpoint paths as a user gives them: a folder named `checkpoint.pt` (in a trial's checkpoint folder) is named once
as a folder and never searched for a file inside, a run's folder given to `a2 decode` is told to name its last.pt or
best.pt, a checkpoint folder still stands for its checkpoint.pt; a torch.save file cut short is called cut short; and
`~` in `--opt=~/...` (which the shell leaves as written) is the home folder in every path option of `a2 train`,
`a2 decode` and `a2 evaluate`."""
import pickle
from pathlib import Path

import pytest
import torch

from a2core import checkpoint as ckpt
from a2core.data.captions import SPECIALS
from a2core.errors import A2Error, CheckpointError
from launch.cli import main, parse
from launch.layout import CHECKPOINT_FILE, TRIALS_DIR, checkpoint_name, train_run_name
from tests.studyfolder import fabricated_study

# no test here starts Ray
pytestmark = [pytest.mark.outside_ray_group, pytest.mark.usefixtures("one_torch_thread")]


def _save(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    return ckpt.save({"model": {"w": torch.arange(64.0)}, "config": {}, "vocab": list(SPECIALS)}, path)


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip()


# -- 1. a folder where a checkpoint file goes --------------------------------------------------------------------
def test_a_folder_named_checkpoint_pt_is_a_folder_never_searched(tmp_path):
    """trials/<run>/checkpoint_epoch0001/checkpoint.pt made a folder holding a checkpoint.pt of its own: the inner
    file was loaded in its place; empty, the error named the path twice (".../checkpoint.pt/checkpoint.pt")."""
    folder = tmp_path / TRIALS_DIR / "run" / "checkpoint_epoch0001"
    named = folder / CHECKPOINT_FILE
    _save(named / CHECKPOINT_FILE)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(named)
    assert str(err.value) == f"{named}: is a folder, not a checkpoint file"
    (named / CHECKPOINT_FILE).unlink()
    with pytest.raises(CheckpointError) as err:
        ckpt.load(named)
    assert str(err.value) == f"{named}: is a folder, not a checkpoint file"
    # the checkpoint folder above it: its checkpoint.pt is the folder, named as such (not ".../checkpoint.pt" twice)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(folder)
    assert str(err.value) == f"{named}: is a folder, not a checkpoint file"


def test_a_checkpoint_folder_still_stands_for_its_checkpoint_and_an_empty_one_is_named_once(tmp_path):
    folder = tmp_path / "checkpoint_epoch0003"
    folder.mkdir()
    with pytest.raises(CheckpointError) as err:
        ckpt.load(folder)
    assert str(err.value) == f"{folder}: is a folder with no {CHECKPOINT_FILE} in it, not a checkpoint file"
    _save(folder / CHECKPOINT_FILE)
    assert ckpt.resolve(folder) == folder / CHECKPOINT_FILE
    assert ckpt.load(folder)["model"]["w"].tolist() == list(range(64))  # the documented convenience, kept


def test_decode_of_a_run_folder_says_to_name_its_last_or_best(tmp_path, capsys):
    """`a2 decode --checkpoints runs/a2` (a2 train's run folder): was "runs/a2/checkpoint.pt: checkpoint not found",
    a file the user never named and a run folder never holds."""
    run = tmp_path / "run"
    _save(run / "best.pt")
    _save(run / "last.pt")
    assert _error(capsys, ["decode", "--checkpoints", str(run), "--out", str(tmp_path / "r.json")]) == (
        f"a2: error: {run}: is a run's folder, not a checkpoint file (name its last.pt or best.pt)")
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("inner", [False, True], ids=["empty", "holding_a_checkpoint"])
def test_study_check_names_a_checkpoint_folder_once(tmp_path, capsys, inner):
    """`a2 study check`: a trial's checkpoint.pt that is a folder read "unreadable: P: P/checkpoint.pt: checkpoint
    not found", or, holding a checkpoint.pt, the inner file was checked in its place."""
    fab = fabricated_study(tmp_path, "folded", epochs=2)
    fab.add("a0", {"fusion": "none", "seed": 0}, [{"epoch": 1, "val/CIDEr": 10.0}])
    path = Path(fab.location.at(TRIALS_DIR, train_run_name("folded", "a0"), checkpoint_name(1), CHECKPOINT_FILE).uri)
    path.mkdir(parents=True)
    if inner:
        _save(path / CHECKPOINT_FILE)
    code = main(["study", "check", "folded", "--storage", str(fab.spec.storage)])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out[0] == f"unreadable: {path}: is a folder, not a checkpoint file"
    assert out[1].endswith("1 checkpoints checked, 1 unreadable (restore them from a copy; a trial resumes from its "
                           "newest readable checkpoint)")


# -- 2. a checkpoint cut short -----------------------------------------------------------------------------------
def test_a_checkpoint_cut_short_is_called_cut_short(tmp_path, capsys):
    """Its first half: was "not a checkpoint written by torch.save; refused", as for a file that never was one."""
    whole = _save(tmp_path / "whole.pt").read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole[:len(whole) // 2])
    expected = (f"{cut}: not a checkpoint written by torch.save in full: it is cut short (a zip without its end, "
                f"{len(whole) // 2} bytes; a copy or save stopped part way); restore it from a copy")
    with pytest.raises(CheckpointError) as err:
        ckpt.load(cut)
    assert str(err.value) == expected
    assert _error(capsys, ["decode", "--checkpoints", str(cut), "--out", str(tmp_path / "r.json")]) == (
        f"a2: error: {expected}")
    # files that never were a checkpoint keep their message
    text = tmp_path / "notes.pt"
    text.write_text("my notes")
    with pytest.raises(CheckpointError) as err:
        ckpt.load(text)
    assert str(err.value) == f"{text}: not a checkpoint written by torch.save; refused"
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps({"model": {}}))
    with pytest.raises(CheckpointError) as err:
        ckpt.load(raw)
    assert str(err.value) == f"{raw}: not a checkpoint written by torch.save; refused"


# -- 3. `~` in path options --------------------------------------------------------------------------------------
@pytest.fixture
def home(tmp_path, monkeypatch):
    """$HOME in tmp_path, the working folder beside it: a folder literally named `~` would appear there."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path / "home"


def test_every_path_option_of_the_local_commands_expands_tilde(home):
    train = parse(["train", "--output-dir=~/runs", "--resume=~/runs/last.pt"])
    assert (train.output_dir, train.resume) == (f"{home}/runs", f"{home}/runs/last.pt")
    decode = parse(["decode", "--checkpoints=~/a.pt", "--out=~/r.json"])
    assert (decode.checkpoints, decode.out) == ([f"{home}/a.pt"], f"{home}/r.json")
    # an ensemble's every member (a `~` the shell left as written: quoted, or from a script)
    assert parse(["decode", "--checkpoints", "~/a.pt", "~/b.pt", "--out", "r.json"]).checkpoints == [
        f"{home}/a.pt", f"{home}/b.pt"]
    evaluate = parse(["evaluate", "--results=~/r.json", "--captions=~/c.json"])
    assert (evaluate.results, evaluate.captions) == (f"{home}/r.json", f"{home}/c.json")
    assert parse(["train"]).output_dir is None  # no option, no path


def test_every_other_path_option_and_argument_expands_tilde(home):
    """`--out=~/x` reaches argparse as written (the shell expands `~` only at a word's start): `a2 data synth`,
    `report`, `export`, `package` and `pipeline` made a folder named `~` in the working folder; a quoted `"~/s.yaml"`
    was a study file that did not exist."""
    assert parse(["data", "synth", "--out=~/synth"]).out == f"{home}/synth"
    prepared = parse(["data", "prepare", "~/f.h5", "--out=~/f.a2feat"])
    assert (prepared.source, prepared.out) == (f"{home}/f.h5", f"{home}/f.a2feat")
    assert parse(["data", "push", "~/f.a2feat", "s3://b/f.a2feat"]).store == f"{home}/f.a2feat"
    fetched = parse(["data", "fetch", "s3://b/f.a2feat", "~/f.a2feat"])
    assert (fetched.source, fetched.target) == ("s3://b/f.a2feat", f"{home}/f.a2feat")  # a URI is left as it is
    assert parse(["train", "--config=~/c.yaml"]).config == f"{home}/c.yaml"
    assert parse(["report", "fusions", "--out=~/r"]).out == f"{home}/r"
    assert parse(["results", "export", "fusions", "--out=~/r.json"]).out == f"{home}/r.json"
    assert parse(["results", "show", "~/r.json"]).record == f"{home}/r.json"
    validated = parse(["study", "validate", "~/s.yaml", "--cluster=~/c.yaml"])
    assert (validated.file, validated.cluster) == (f"{home}/s.yaml", f"{home}/c.yaml")
    assert parse(["package", "fusions", "--out=~/p"]).out == f"{home}/p"
    pipeline = parse(["pipeline", "--study=~/s.yaml", "--out=~/o"])
    assert (pipeline.study, pipeline.out) == (f"{home}/s.yaml", f"{home}/o")
    assert parse(["study", "plan", "~/s.yaml", "--cluster=~/c.yaml"]).cluster == f"{home}/c.yaml"
    assert parse(["study", "rehearse", "~/s.yaml"]).file == f"{home}/s.yaml"
    assert parse(["package", "fusions"]).out is None  # no option, no path


def test_train_output_dir_with_tilde_is_the_home_folder(home, monkeypatch, capsys):
    """`a2 train --output-dir=~/runs` made a folder named `~` in the working folder."""
    import launch.commands.local as local
    seen = []

    def stopped(cfg, **kwargs):  # where the run would write; no training
        seen.append(kwargs["output_dir"])
        raise A2Error("stopped before training")

    monkeypatch.setattr(local, "train", stopped)
    assert _error(capsys, ["train", "--output-dir=~/runs", "train.xe_epochs=1"]) == "a2: error: stopped before training"
    assert seen == [home / "runs"]
    assert _error(capsys, ["train", "--resume=~/runs/last.pt"]) == (
        f"a2: error: --resume {home}/runs/last.pt: no such checkpoint file")
    assert _error(capsys, ["decode", "--checkpoints=~/gone.pt", "--out=~/r.json"]) == (
        f"a2: error: {home}/gone.pt: checkpoint not found")
    assert _error(capsys, ["evaluate", "--results=~/r.json", "--captions=~/c.json"]) == (
        f"a2: error: results file not found: {home}/r.json")
    assert list(home.parent.joinpath("cwd").iterdir()) == []  # no `~` folder
