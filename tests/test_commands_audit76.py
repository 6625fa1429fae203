"""The read-only commands as a researcher types them, at their mistakes: a study file's path given as the study's
name, a file given as --storage or as `a2 report --out`, and `a2 study status` of a running study whose state file is
read mid-copy (`tests.studyfolder.fabricated_study`, no Ray)."""
from __future__ import annotations

import pytest

import launch.commands.show as show
from a2core.errors import StudyError
from launch import cli
from launch.lease import StudyLease
from tests.studyfolder import fabricated_study

pytestmark = pytest.mark.outside_ray_group  # starts no Ray


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./.a2 pointer of another test, reports under tmp_path


def exit_code(argv: list[str]) -> int:
    """`a2 ARGV`'s exit status, argparse's refusals (SystemExit) included."""
    try:
        return cli.main(argv)
    except SystemExit as stop:
        return stop.code


def study(tmp_path, monkeypatch, name: str = "audit"):
    fab = fabricated_study(tmp_path, name, epochs=1)
    for fusion in ("none", "gate"):
        fab.add(f"{fusion}-0", {"fusion": fusion, "seed": 0},
                [{"epoch": 1, "val/CIDEr": 100.0, "val/BLEU-4": 30.0, "train/loss": 1.0}])
    fab.patch_tune(monkeypatch)
    return fab


@pytest.mark.parametrize("command", [["study", "status"], ["study", "compare"], ["study", "check"], ["report"]])
def test_a_study_files_path_given_as_the_name_says_the_name_to_give(tmp_path, capsys, command):
    """`a2 study status studies/smoke.yaml` said only that the name must be lowercase letters, digits and '-'."""
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "smoke.yaml").write_text("name: smoke-x\nstorage: runs\n")
    assert exit_code([*command, "studies/smoke.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("argument name: 'studies/smoke.yaml' is a study file; give the study's name (its `name:` "
                        "key, here `smoke-x`)")
    assert exit_code([*command, "other.yml"]) == 2  # not there: the hint without the name
    assert capsys.readouterr().err.strip().endswith("'other.yml' is a study file; give the study's name (its `name:` "
                                                    "key)")


@pytest.mark.parametrize("command", [["study", "status"], ["study", "compare"], ["study", "check"], ["report"]])
def test_storage_given_as_a_file_is_refused_naming_it(tmp_path, capsys, command):
    """--storage naming a file read as "FILE/NAME/lease.json: cannot read it: Not a directory"."""
    (tmp_path / "notes.txt").write_text("x")
    assert exit_code([*command, "audit", "--storage", str(tmp_path / "notes.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"argument --storage: {tmp_path / 'notes.txt'}: a file, not a storage folder (a folder or "
                        f"s3://bucket/prefix)")


def test_report_out_given_as_a_file_is_refused_and_the_file_kept(tmp_path, capsys, monkeypatch):
    """`a2 report NAME --out FILE` read "FILE: File exists" after reading the whole record."""
    fab = study(tmp_path, monkeypatch)
    (tmp_path / "report.html").write_text("mine")
    assert exit_code(["report", "audit", "--storage", fab.spec.storage, "--out", str(tmp_path / "report.html")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{tmp_path / 'report.html'} is a file, not a folder to write into")
    assert (tmp_path / "report.html").read_text() == "mine"


def test_a_right_name_and_storage_still_reach_the_command(tmp_path, capsys, monkeypatch):
    fab = study(tmp_path, monkeypatch)
    assert exit_code(["study", "status", "audit", "--storage", fab.spec.storage]) == 0
    assert "study audit at " in capsys.readouterr().out


def read_mid_copy_once(monkeypatch):
    """The record's first read refuses a state file as one read mid-copy is refused; later reads see it whole."""
    load, reads = show.StudyRecord.load, []

    def flaky(location, *args, **kwargs):
        reads.append(1)
        if len(reads) == 1:
            raise StudyError("experiment_state.json: cut short; status refused, nothing was run or changed: restore "
                             "the file from a copy")
        return load(location, *args, **kwargs)

    monkeypatch.setattr(show.StudyRecord, "load", staticmethod(flaky))
    monkeypatch.setattr(show, "RECHECK_S", 0.0, raising=False)  # absent before the recheck
    return reads


@pytest.mark.parametrize("watch", [[], ["--watch", "0.01"]])
def test_status_of_a_running_study_reads_a_state_file_found_mid_copy_again(tmp_path, capsys, monkeypatch, watch):
    """A driver holds the lease and Tune rewrites its state file in place: status (and every --watch round) ended with
    "status refused ... restore the file from a copy" (exit 2) when one read fell mid-copy; `a2 study check` already
    read such a file again before naming it."""
    fab = study(tmp_path, monkeypatch)
    reads = read_mid_copy_once(monkeypatch)

    def sleep(seconds):  # the recheck's (RECHECK_S 0 here) passes; the watch's next round is Ctrl-C
        if seconds:
            raise KeyboardInterrupt

    monkeypatch.setattr(show.time, "sleep", sleep)
    with StudyLease(fab.location.at()).held():
        # --watch ends with Ctrl-C here: 130, as after any SIGINT
        assert exit_code(["study", "status", "audit", "--storage", fab.spec.storage, "--json", *watch]) == (
            130 if watch else 0)
    assert len(reads) == 2 and '"trials_finished": 2' in capsys.readouterr().out


def test_status_of_a_study_no_driver_runs_still_refuses_an_unreadable_file_at_once(tmp_path, capsys, monkeypatch):
    fab = study(tmp_path, monkeypatch)
    reads = read_mid_copy_once(monkeypatch)
    assert exit_code(["study", "status", "audit", "--storage", fab.spec.storage]) == 2
    assert len(reads) == 1 and "status refused" in capsys.readouterr().err
