"""`a2 study check NAME` on the studies it said were whole, or failed on, without Ray: an experiment state that reads
as JSON but that `status` refuses, a checkpoint that is a link to a file that is not there, a checkpoint a running
trial deleted while the check ran, one whose keys hold values a2 never writes there (a traceback), and a study still
running whose Tune file is read in the middle of Tune's copy of it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import launch.commands.check as check_command
from launch import verify
from launch.cli import main
from launch.lease import StudyLease
from launch.layout import CHECKPOINT_FILE, TRIALS_DIR, checkpoint_name, train_run_name
from tests.studyfolder import fabricated_study

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _study(tmp_path: Path, name: str):
    fab = fabricated_study(tmp_path, name, epochs=2)
    fab.add("a0", {"fusion": "none", "seed": 0}, [{"epoch": 1, "val/CIDEr": 10.0}])
    return fab


def _checkpoint(fab, epoch: int = 1) -> Path:
    """Where trial a0's checkpoint of `epoch` is, its folder made."""
    path = Path(fab.location.at(TRIALS_DIR, train_run_name(fab.spec.name, "a0"), checkpoint_name(epoch),
                                CHECKPOINT_FILE).uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _check(fab, capsys) -> tuple[int, list[str]]:
    code = main(["study", "check", fab.spec.name, "--storage", str(fab.spec.storage)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, captured.out.splitlines()


def test_an_experiment_state_that_status_refuses_is_named_by_check(tmp_path, capsys):
    """Valid JSON that is no Tune experiment state: `status` refused it and sent the user to `check`, which said
    "all readable", exit 0."""
    fab = _study(tmp_path, "notune")
    state = Path(fab.location.uri("experiment_state-2024-01-01_00-00-00.json"))
    state.write_text(json.dumps({"runner_data": {}}))
    assert main(["study", "status", "notune", "--storage", str(fab.spec.storage)]) == 2
    assert "`a2 study check NAME` lists every problem" in capsys.readouterr().err
    code, out = _check(fab, capsys)
    assert code == 1
    assert out == [f"unreadable: {state}: not a readable Tune experiment state (no trial_data list in it)",
                   f"study notune at {fab.location.uri()}: 3 state files and 0 checkpoints checked, 1 unreadable "
                   f"(restore them from a copy; a trial resumes from its newest readable checkpoint)"]
    # one that is not JSON at all is named once, as before
    state.write_text('{"trial_data": [')
    code, out = _check(fab, capsys)
    assert code == 1 and len(out) == 2 and out[0].startswith(f"unreadable: {state}: unreadable (JSONDecodeError: ")


def test_a_checkpoint_that_links_to_a_missing_file_is_named(tmp_path, capsys):
    """A checkpoint moved to another disk and linked back, the disk gone: skipped, "0 checkpoints checked, all
    readable"."""
    fab = _study(tmp_path, "linked")
    link = _checkpoint(fab)
    target = tmp_path / "other disk" / "checkpoint.pt"
    link.symlink_to(target)
    code, out = _check(fab, capsys)
    assert code == 1
    assert out == [f"unreadable: {link}: a link to {target}, which is not there",
                   f"study linked at {fab.location.uri()}: 2 state files and 1 checkpoints checked, 1 unreadable "
                   f"(restore them from a copy; a trial resumes from its newest readable checkpoint)"]


def test_a_checkpoint_deleted_while_the_check_runs_is_not_unreadable(tmp_path, capsys, monkeypatch):
    """A running trial keeps only its newest checkpoints: one listed by the check and deleted before it was read
    was reported "unreadable: ... checkpoint not found", exit 2, as if the study were damaged."""
    fab = _study(tmp_path, "pruned")
    old = _checkpoint(fab)
    old.write_bytes(b"not read: deleted first")
    listed = verify.checkpoint_files

    def list_then_prune(study):
        files = listed(study)
        shutil.rmtree(old.parent)  # the trial's retention, between the listing and the read
        return files

    monkeypatch.setattr(verify, "checkpoint_files", list_then_prune)
    code, out = _check(fab, capsys)
    assert (code, out) == (0, [f"study pruned at {fab.location.uri()}: 2 state files and 0 checkpoints checked, "
                               f"all readable"])


def test_a_checkpoint_holding_values_a2_never_writes_is_one_line(tmp_path, capsys):
    """A dict with a2's keys but a vocab that is no list: `model_mismatch` raised TypeError out of `check`, a
    traceback, and no later checkpoint was checked."""
    fab = _study(tmp_path, "odd")
    odd = _checkpoint(fab)
    torch.save({"config": fab.spec.trial_config({"fusion": "none", "seed": 0}), "model": {}, "vocab": 3}, odd)
    code, out = _check(fab, capsys)
    assert code == 1
    assert out[0] == (f"unreadable: {odd}: not a checkpoint a2tune wrote (TypeError: object of type 'int' has no "
                      f"len())")
    assert out[1].endswith("1 checkpoints checked, 1 unreadable (restore them from a copy; a trial resumes from its "
                           "newest readable checkpoint)")


def _running_study(tmp_path, monkeypatch, written_whole: bool):
    """A study whose lease this process holds, Tune's searcher state cut short as its copy leaves it for a moment;
    `written_whole`: the copy ends before the check reads it again."""
    fab = _study(tmp_path, "live")
    searcher = Path(fab.location.uri("searcher-state-2024-01-01_00-00-00.pkl"))
    searcher.write_bytes(b"")  # truncated: Tune's plain copy over itself, not yet written

    def copy_ends(seconds):
        assert seconds == 2.0
        if written_whole:
            searcher.write_bytes(b"\x80\x04]\x94.")  # a whole pickle (an empty list)

    monkeypatch.setattr(check_command, "time", SimpleNamespace(sleep=copy_ends), raising=False)  # the check's wait
    return fab, searcher


def test_a_running_study_reads_a_file_cut_short_again_before_naming_it(tmp_path, capsys, monkeypatch):
    """`check` on a running study named the state file Tune was copying as unreadable, exit 2, and said to restore
    it from a copy: over a file its driver writes."""
    fab, _ = _running_study(tmp_path, monkeypatch, written_whole=True)
    with StudyLease(fab.location.at(), stale_after=60).held():
        code, out = _check(fab, capsys)
    assert code == 0
    assert out[0].startswith("note: study live is running: its driver (")
    assert out[0].endswith("holds its lease and writes its files while they are checked; a file found unreadable is "
                           "read again 2 s later")
    assert out[1:] == [f"study live at {fab.location.uri()}: 3 state files and 0 checkpoints checked, all readable"]


def test_a_running_study_names_a_file_still_unreadable_without_advising_a_restore(tmp_path, capsys, monkeypatch):
    fab, searcher = _running_study(tmp_path, monkeypatch, written_whole=False)
    with StudyLease(fab.location.at(), stale_after=60).held():
        code, out = _check(fab, capsys)
    assert code == 1
    assert out[1:] == [f"unreadable: {searcher}: unreadable (ValueError: empty file)",
                       f"study live at {fab.location.uri()}: 3 state files and 0 checkpoints checked, 1 unreadable "
                       f"(its driver is running: check again once the study has ended before restoring any)"]
