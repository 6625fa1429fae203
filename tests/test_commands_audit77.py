"""`a2 study status --watch` stopped with Ctrl-C, `a2 study check`'s exit codes, two `a2 report`s started at once, and
`a2 report --out` checked as every other command's output path is (`a2core.atomic.check_output_path`), without Ray
(`tests.studyfolder.fabricated_study`)."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import dashboards.report
import launch.commands.show as show
from launch.lease import StudyLease
from launch.layout import RESULTS_FILE, TRIALS_DIR, train_run_name
from tests.test_commands_audit76 import exit_code, study

pytestmark = pytest.mark.outside_ray_group  # starts no Ray


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./.a2 pointer of another test, reports under tmp_path


# -- 1. --watch ended by Ctrl-C ------------------------------------------------------------------------------------
def test_a_watch_stopped_with_ctrl_c_exits_130_without_a_traceback_and_leaves_the_table(tmp_path, capsys,
                                                                                       monkeypatch):
    fab = study(tmp_path, monkeypatch)
    sleeps = []

    def sleep(seconds):  # the watch's wait for its next round: Ctrl-C there
        sleeps.append(seconds)
        raise KeyboardInterrupt

    monkeypatch.setattr(show.time, "sleep", sleep)
    with StudyLease(fab.location.at()).held():  # a driver runs it: the watch goes on until stopped
        code = exit_code(["study", "status", "audit", "--storage", fab.spec.storage, "--watch", "5"])
    captured = capsys.readouterr()
    assert (code, sleeps) == (130, [5.0])
    assert captured.err == ""  # neither a traceback nor a line over the last table
    assert captured.out.startswith("a2 study status audit (every 5 s; Ctrl-C stops)")  # no clearing: not a tty
    assert captured.out.count("study audit at ") == 1 and captured.out.endswith(
        "progress: 2/8 trial-epochs (25%); time left: known once a trial-epoch has ended\n")  # left as it was


# -- 2. check: a faulty file (1) is not a missing study (2) --------------------------------------------------------
def test_check_exits_1_on_a_damaged_file_and_2_when_there_is_no_such_study(tmp_path, capsys, monkeypatch):
    fab = study(tmp_path, monkeypatch)
    results = Path(fab.location.at(TRIALS_DIR, train_run_name("audit", "none-0"), RESULTS_FILE).uri)
    assert exit_code(["study", "check", "audit", "--storage", fab.spec.storage]) == 0
    assert capsys.readouterr().out.rstrip().endswith("all readable")

    results.write_bytes(b"[{\"epoch\": 1, \"val/CIDEr\": 10")  # cut short
    assert exit_code(["study", "check", "audit", "--storage", fab.spec.storage]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"unreadable: {results}")
    assert out[-1].endswith("1 unreadable (restore them from a copy; a trial resumes from its newest readable "
                            "checkpoint)")

    assert exit_code(["study", "check", "nothere", "--storage", fab.spec.storage]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"a2: error: no study 'nothere' at {fab.spec.storage}")


# -- 3. two reports at once ------------------------------------------------------------------------------------------
def slow_report(monkeypatch, parties: int):
    """`build_report` that waits for `parties` reports to have picked their folders before writing: two reports that
    picked the same folder wrote into one."""
    barrier, picked = threading.Barrier(parties, timeout=20), []

    def build(study_view, out):
        picked.append(Path(out))
        Path(out).mkdir(parents=True, exist_ok=True)  # as the real one does
        barrier.wait()
        (Path(out) / "report.html").write_text(f"report {threading.get_ident()}")
        return {"html": str(Path(out) / "report.html")}

    monkeypatch.setattr(dashboards.report, "build_report", build)
    return picked


def test_two_reports_started_at_once_write_into_two_folders(tmp_path, capsys, monkeypatch):
    fab = study(tmp_path, monkeypatch)
    (tmp_path / "a2-reports" / "audit").mkdir(parents=True)
    (tmp_path / "a2-reports" / "audit" / "report.html").write_text("earlier")
    picked = slow_report(monkeypatch, 2)
    codes = []
    threads = [threading.Thread(target=lambda: codes.append(exit_code(["report", "audit", "--storage",
                                                                       fab.spec.storage])))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert codes == [0, 0]
    assert sorted(p.name for p in picked) == ["audit-2", "audit-3"]
    assert (tmp_path / "a2-reports" / "audit" / "report.html").read_text() == "earlier"
    texts = {(tmp_path / "a2-reports" / n / "report.html").read_text() for n in ("audit-2", "audit-3")}
    assert len(texts) == 2  # each report's own page, none written over by the other


def test_report_folder_claims_each_folder_once_among_many_threads(tmp_path):
    base, barrier, got = tmp_path / "rep", threading.Barrier(8, timeout=20), []

    def claim():
        barrier.wait()
        got.append(show.report_folder(base, say=lambda line: None))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(got) == sorted([base] + [tmp_path / f"rep-{n}" for n in range(2, 9)])
    assert all((p / "report.html").is_file() for p in got)


def test_a_report_into_dot_holding_a_report_numbers_a_sibling(tmp_path, capsys, monkeypatch):
    """`a2 report NAME --out .` where a report is: `Path('.').with_name` raised ValueError (a traceback)."""
    fab = study(tmp_path, monkeypatch)
    work = tmp_path / "work"
    work.mkdir()
    (work / "report.html").write_text("earlier")
    monkeypatch.chdir(work)
    slow_report(monkeypatch, 1)
    assert exit_code(["report", "audit", "--storage", fab.spec.storage, "--out", "."]) == 0
    assert f"{work} holds an earlier report; this run writes to {tmp_path / 'work-2'}" in capsys.readouterr().out
    assert (work / "report.html").read_text() == "earlier" and (tmp_path / "work-2" / "report.html").is_file()


def test_a_failed_report_leaves_no_claim_behind(tmp_path, capsys, monkeypatch):
    fab = study(tmp_path, monkeypatch)

    def broken(study_view, out):
        raise OSError(28, "No space left on device", str(Path(out) / "lambda.png"))

    monkeypatch.setattr(dashboards.report, "build_report", broken)
    assert exit_code(["report", "audit", "--storage", fab.spec.storage, "--out", "rep"]) == 2
    assert capsys.readouterr().err.strip() == f"a2: error: {Path('rep') / 'lambda.png'}: No space left on device"
    assert list((tmp_path / "rep").iterdir()) == []  # the next report writes to rep, not rep-2


# -- 4. report --out is checked as every output path is ---------------------------------------------------------------
def test_report_out_refuses_a_file_in_the_words_of_every_output_path(tmp_path, capsys, monkeypatch):
    fab = study(tmp_path, monkeypatch)
    (tmp_path / "afile").write_text("x")
    loads = []
    monkeypatch.setattr(show.StudyRecord, "load", staticmethod(lambda *a, **k: loads.append(1)))
    for out, said in [(tmp_path / "afile", f"{tmp_path}/afile is a file, not a folder to write into"),
                      (tmp_path / "afile" / "rep", f"{tmp_path}/afile/rep: {tmp_path}/afile is a file, not a folder"),
                      ("", "is empty; name the folder to write")]:
        assert exit_code(["report", "audit", "--storage", fab.spec.storage, "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == f"a2: error: --out: {said}"
    assert loads == [] and (tmp_path / "afile").read_text() == "x"  # refused before the record is read


def test_report_out_expands_the_home_folder(tmp_path, capsys, monkeypatch):
    fab = study(tmp_path, monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    slow_report(monkeypatch, 1)
    assert exit_code(["report", "audit", "--storage", fab.spec.storage, "--out=~/rep"]) == 0
    assert (tmp_path / "home" / "rep" / "report.html").is_file() and not (tmp_path / "~").exists()


def unwritable(monkeypatch, folder: Path) -> None:
    """`folder` not writable by this user (tests run as root, whom chmod does not stop)."""
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (Path(path) != folder) and access(path, mode, **kw))


@pytest.mark.parametrize("command", ["report", "decode"])
def test_an_output_path_in_an_unwritable_folder_is_refused_before_any_work(tmp_path, capsys, monkeypatch, command):
    """It read "[Errno 13] Permission denied" once the record was read and the plots drawn (or the split decoded)."""
    fab = study(tmp_path, monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir()
    unwritable(monkeypatch, locked)
    monkeypatch.setattr(show.StudyRecord, "load", staticmethod(lambda *a, **k: pytest.fail("record read")))
    argv = {"report": ["report", "audit", "--storage", fab.spec.storage, "--out", str(locked / "rep")],
            "decode": ["decode", "--checkpoints", str(tmp_path / "missing.pt"), "--out", str(locked / "r.json")]}
    assert exit_code(argv[command]) == 2
    out = locked / ("rep" if command == "report" else "r.json")
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"a2: error: --out: {out}: {locked} is not writable by this user"
    assert list(locked.iterdir()) == []
