"""The study's lease against holders it cannot see as tests/test_lease.py's do: a driver dead but not yet reaped (a
zombie), a live one in another pid namespace under the same host name, an older a2's lease whose pid is another
process's by now (as a reader judges it), and a lease.json damaged into bytes or fields of the wrong kind."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from a2core.errors import StudyError
from launch.lease import LEASE_FILE, StudyLease, _process_start, describe, live_writer
from launch.storage import open_location


def _write_aged(study, info: dict, age: float) -> None:
    """The lease `info`, its file last written `age` s ago (staleness is judged on the file's modification time)."""
    study.join(LEASE_FILE).write_text(json.dumps(info))
    then = time.time() - age
    os.utime(study.join(LEASE_FILE).uri, (then, then))


def _lease(**fields) -> dict:
    return {"user": "someone", "host": socket.gethostname(), "pid": 4242, "token": "theirs",
            "started": "2026-01-01T00:00:00Z", "heartbeat": time.time(), "stale_after": 120.0, **fields}


def test_a_holder_dead_but_not_reaped_is_gone_not_alive(tmp_path, capsys):
    """A driver started by a parent that has not waited for it (a notebook's Popen) and killed stays a zombie: it
    holds nothing, and `kill -9` cannot end it. Its lease is taken over as one whose process is gone, no --force."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.time() + 5
        while _state(zombie.pid) != "Z" and time.time() < deadline:
            time.sleep(0.02)
        assert _state(zombie.pid) == "Z"
        study = open_location(tmp_path / "study")
        _write_aged(study, _lease(pid=zombie.pid, pid_start=_process_start(zombie.pid)), 1000)
        assert live_writer(study) is None  # was: its driver "running" for status and check
        with StudyLease(study).held() as lease:  # was: "not even --force takes it over: kill -9 PID"
            assert f"pid {zombie.pid}" in capsys.readouterr().err
            assert json.loads(study.join(LEASE_FILE).read_text())["token"] == lease.mine["token"]
    finally:
        zombie.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_live_holder_in_another_pid_namespace_is_not_gone(tmp_path):
    """Containers with the host's network (Docker's `--network host`) share its name but number processes apart: a
    live driver's pid there is no process here. Its fresh lease is refused, --force or not, and read as live."""
    study = open_location(tmp_path / "study")
    absent = _absent_pid()
    _write_aged(study, _lease(pid=absent, pid_ns="pid:[1]", pid_start="7"), 1)
    assert live_writer(study) is not None  # was: None, its pid not being one here
    for force in (False, True):  # was: taken over without --force, as a dead process's
        with pytest.raises(StudyError, match=f"being written by someone@{socket.gethostname()} pid {absent}"):
            StudyLease(study).acquire(force=force)
    assert json.loads(study.join(LEASE_FILE).read_text())["token"] == "theirs"
    own = StudyLease(study).mine["pid_ns"]
    assert own == os.readlink("/proc/self/ns/pid")  # what a lease records for the next reader to compare
    _write_aged(study, _lease(pid=absent, pid_ns=own), 1)  # the same namespace: gone, as before
    with StudyLease(study).held() as lease:
        assert json.loads(study.join(LEASE_FILE).read_text())["token"] == lease.mine["token"]


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_a_live_driver_in_its_own_pid_namespace_keeps_its_lease(tmp_path):
    """The same, with a real holder: a process in a new pid namespace (as a container's) holds the lease."""
    study = open_location(tmp_path / "study")
    hold = ("import sys, time\nfrom launch.storage import open_location\nfrom launch.lease import StudyLease\n"
            "StudyLease(open_location(sys.argv[1]), stale_after=60).acquire()\nprint('held', flush=True)\n"
            "time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    # --kill-child: the holder (pid 1 of its namespace) goes down with unshare, not 60 s later
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-c",
                               hold, study.uri], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline().strip()
        if line != "held":
            pytest.skip("unshare could not make a pid namespace here")
        info = json.loads(study.join(LEASE_FILE).read_text())
        assert live_writer(study) is not None  # was: None (its pid 1 here is init, another start time: "gone")
        with pytest.raises(StudyError, match="being written by"):  # was: taken over, no --force
            StudyLease(study).acquire()
        assert json.loads(study.join(LEASE_FILE).read_text())["token"] == info["token"]
        assert info["pid_ns"] != os.readlink("/proc/self/ns/pid")
    finally:
        holder.kill()
        holder.wait()


def _absent_pid() -> int:
    """A pid no process has here now."""
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def test_a_reader_judges_an_older_lease_with_a_reused_pid_by_its_age(tmp_path):
    """A lease of an older a2 (no process start time) whose pid is another process's by now: `resume --force` takes
    it over once stale, so `status` and `check` must not call its driver running for ever (trials RUNNING, not
    KILLED; "starting: try again in a few seconds" for a study with no study.yaml)."""
    study = open_location(tmp_path / "study")
    _write_aged(study, _lease(pid=os.getppid(), heartbeat=time.time() - 1000), 1000)  # alive here, not the holder
    assert live_writer(study) is None  # was: the holder, however old its lease
    _write_aged(study, _lease(pid=os.getppid()), 1)  # rewritten a moment ago: live
    assert live_writer(study)["token"] == "theirs"


def test_a_lease_of_damaged_bytes_is_a_stale_lease_not_a_traceback(tmp_path):
    """Bytes that are not UTF-8 (a damaged disk block): read as a lease cut short, refused while fresh and taken over
    with --force once stale, in one line; they used to raise UnicodeDecodeError out of run, resume and status."""
    study = open_location(tmp_path / "study")
    _write_aged(study, {}, 1)
    (tmp_path / "study" / LEASE_FILE).write_bytes(b"\xff\xfe{\x80 not a lease")
    assert StudyLease(study).read() == {"heartbeat": 0}
    with pytest.raises(StudyError, match="being written by"):
        StudyLease(study).acquire(force=True)
    then = time.time() - 1000
    os.utime(study.join(LEASE_FILE).uri, (then, then))
    assert live_writer(study) is None
    with StudyLease(study).held(force=True) as lease:
        assert json.loads(study.join(LEASE_FILE).read_text())["token"] == lease.mine["token"]


@pytest.mark.parametrize("pid", [0, -1, True])
def test_a_lease_whose_pid_is_no_process_is_judged_by_its_age(tmp_path, pid):
    """A damaged lease's pid 0 or -1 asks the kernel about this process's group or every process (both "alive"), and
    true is pid 1: each made a stale lease "alive on this host", refused for ever with `kill -9 0` (or -1: every
    process of the user) as its advice. Such a pid is no process: the lease is judged by its age."""
    study = open_location(tmp_path / "study")
    _write_aged(study, _lease(pid=pid, pid_start="1", heartbeat=time.time() - 1000), 1000)
    assert live_writer(study) is None
    with pytest.raises(StudyError) as stale:
        StudyLease(study).acquire()
    assert "stale lease of" in str(stale.value) and "kill -9" not in str(stale.value)
    with StudyLease(study).held(force=True) as lease:
        assert json.loads(study.join(LEASE_FILE).read_text())["token"] == lease.mine["token"]


def test_a_heartbeat_field_of_the_wrong_kind_is_described_not_raised(tmp_path):
    """`describe` (status's and check's line naming a live writer, LeaseLost's) read the holder's `heartbeat` with a
    bare float(): a lease whose field is no number raised ValueError out of `a2 study check`."""
    assert "last heartbeat" in describe(_lease(heartbeat="yesterday"))
    assert "last heartbeat" in describe(_lease(heartbeat=[1]))
    study = open_location(tmp_path / "study")
    lease = StudyLease(study, stale_after=60)
    with lease.held():
        _write_aged(study, _lease(host="elsewhere", heartbeat="yesterday"), 0)  # taken over, by a damaged lease
        with pytest.raises(StudyError, match="taken over by someone@elsewhere pid 4242"):
            lease.check("writing")
