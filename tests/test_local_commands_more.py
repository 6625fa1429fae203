"""`a2 train`, `a2 decode` and `a2 data prepare` as a user reaches them: a refused run names no numbered folder it
never writes, a resume from a run's best.pt never writes over that run's later last.pt (even with --output-dir
naming the run's folder), a results file never replaces a checkpoint or the data it was decoded from, and an
unwritable `--out` of `a2 data prepare` is named as such."""
import json
import os
import shutil

import pytest
import torch

from launch.cli import main
from tests.test_local_commands_hostile import tiny  # noqa: F401 - the one-epoch tiny run, a fixture


def _run_copy(base, to):
    """A copy of the fixture's run folder at `to`, its best.pt and last.pt separate files (not links)."""
    to.mkdir(parents=True)
    for name in ("best.pt", "last.pt", "history.json"):
        shutil.copyfile(base / "run" / name, to / name)
    return to


def test_a_train_refused_for_its_data_names_no_numbered_folder(tiny, tmp_path, capsys):
    """The data check fails (another synthetic set sits at data.root): no "this run writes to run-2" before it."""
    base, config = tiny
    run = _run_copy(base, tmp_path / "run")
    assert main(["train", "--config", str(config), "--output-dir", str(run), "data.images=50"]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == (f"a2: error: {base}/data: holds a synthetic dataset of seed 3 and 40 "
                                            f"images, not seed 3 and 50; choose another data.root or remove it")
    assert "holds an earlier" not in out and "writes to" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_resume_from_a_non_checkpoint_names_no_numbered_folder(tiny, tmp_path, capsys):
    base, config = tiny
    run = _run_copy(base, tmp_path / "run")
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    assert main(["train", "--config", str(config), "--output-dir", str(run), "--resume",
                 str(tmp_path / "notes.pt")]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == f"a2: error: {tmp_path}/notes.pt: not a checkpoint written by torch.save; " \
                                           f"refused"
    assert out == ""
    assert not (tmp_path / "run-2").exists()


def test_a_train_that_starts_names_its_numbered_folder_before_the_first_epoch(tiny, tmp_path, capsys):
    base, config = tiny
    run = _run_copy(base, tmp_path / "run")
    assert main(["train", "--config", str(config), "--output-dir", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{run} holds an earlier run's checkpoints; this run writes to {run}-2"
    assert lines[1].startswith("epoch 1: ")
    assert [h["epoch"] for h in json.loads((tmp_path / "run-2/history.json").read_text())] == [1]


def test_resumed_output_from_best_into_its_own_folder_is_numbered(tiny, tmp_path, capsys):
    """`--resume run/best.pt --output-dir run` (best.pt an earlier epoch than last.pt): a numbered sibling, as
    without --output-dir, the best so far read from run/best.pt (it went on in run, over its later last.pt)."""
    from launch.commands.local import resumed_output
    base, _ = tiny
    run = _run_copy(base, tmp_path / "run")
    assert resumed_output(str(run / "best.pt"), str(run), "runs/a2") == (tmp_path / "run-2", run / "best.pt")
    assert capsys.readouterr().out == f"{run} holds an earlier run's checkpoints; this run writes to {run}-2\n"
    said = []  # `a2 train` has the note handed to it, to print once the run starts
    assert resumed_output(str(run / "best.pt"), None, "runs/a2", say=said.append) == (tmp_path / "run-2",
                                                                                      run / "best.pt")
    assert said == [f"{run} holds an earlier run's checkpoints; this run writes to {run}-2"]
    # its newest checkpoint still goes on in its own folder, with or without --output-dir naming it
    assert resumed_output(str(run / "last.pt"), str(run), "runs/a2") == (run, None)
    assert resumed_output(str(run / "last.pt"), None, "runs/a2") == (run, None)
    assert capsys.readouterr().out == ""


def test_a_resume_from_best_into_its_own_folder_keeps_the_later_last(tiny, tmp_path, capsys):
    base, config = tiny
    run = _run_copy(base, tmp_path / "run")
    kept = {name: (run / name).read_bytes() for name in ("best.pt", "last.pt", "history.json")}
    assert main(["train", "--config", str(config), "--resume", str(run / "best.pt"), "--output-dir", str(run),
                 "train.xe_epochs=2"]) == 0
    assert {name: (run / name).read_bytes() for name in kept} == kept
    assert torch.load(tmp_path / "run-2/last.pt", weights_only=True)["epoch"] == 2
    assert capsys.readouterr().out.splitlines()[0] == \
        f"{run} holds an earlier run's checkpoints; this run writes to {run}-2"


@pytest.mark.parametrize("how", ["same", "linked"])
def test_decode_refuses_an_out_that_is_one_of_its_checkpoints(tiny, tmp_path, capsys, how):
    base, _ = tiny
    ckpt = tmp_path / "best.pt"
    shutil.copyfile(base / "run/best.pt", ckpt)
    out = ckpt
    if how == "linked":
        out = tmp_path / "last.pt"
        os.link(ckpt, out)
    before = ckpt.read_bytes()
    assert main(["decode", "--checkpoints", str(base / "run/last.pt"), str(ckpt), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"a2: error: --out: {out} is one of --checkpoints ({ckpt}); the results would write over it, so name "
        f"another file")
    assert ckpt.read_bytes() == out.read_bytes() == before


def test_decode_refuses_an_out_that_is_the_datas_captions(tiny, tmp_path, capsys):
    base, _ = tiny
    data = tmp_path / "data"
    shutil.copytree(base / "data", data)
    captions = data / "dataset_coco.json"
    before = captions.read_bytes()
    assert main(["decode", "--checkpoints", str(base / "run/best.pt"), "--split", "val", "--out", str(captions),
                 "--", f"data.root={data}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"a2: error: --out: {captions} is a file of the data it decodes ({captions}); the results would write over "
        f"it, so name another file")
    assert captions.read_bytes() == before


def test_decode_still_replaces_an_earlier_results_file(tiny, tmp_path):
    base, _ = tiny
    out = tmp_path / "res.json"
    out.write_text("[]")
    assert main(["decode", "--checkpoints", str(base / "run/best.pt"), "--split", "val", "--out", str(out)]) == 0
    val = [im["cocoid"] for im in json.loads((base / "data/dataset_coco.json").read_text())["images"]
           if im["split"] == "val"]
    assert sorted(r["image_id"] for r in json.loads(out.read_text())) == sorted(val) and len(val) == 10


@pytest.mark.parametrize("where", ["under_file", "empty"])
def test_data_prepare_names_an_unwritable_out(tiny, tmp_path, capsys, where):
    base, _ = tiny
    (tmp_path / "afile").write_text("x")
    out, expected = {"under_file": (tmp_path / "afile/store", f"{tmp_path}/afile/store: {tmp_path}/afile is a file, "
                                                              f"not a folder"),
                     "empty": ("", "is empty; name the folder to write")}[where]
    assert main(["data", "prepare", str(base / "data/features.h5"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"a2: error: --out: {expected}"
    assert (tmp_path / "afile").read_text() == "x"
