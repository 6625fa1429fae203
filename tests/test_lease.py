"""One writer per study: the lease refuses a second `run` and a concurrent `resume` at once (real processes), a
stale lease is taken over only with --force, and on S3 the lease is a conditional create (moto)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from a2core.errors import StudyError
from launch.storage import open_location
from launch.lease import LEASE_FILE, StudyLease
from tests.raycluster import a2, a2_env, tiny_data, tiny_study  # noqa: F401 - fixture
from tests.s3server import make_bucket

HOLD = """
import sys, time
from launch.storage import open_location
from launch.lease import StudyLease
lease = StudyLease(open_location(sys.argv[1]), stale_after=60)
lease.acquire()
print("held", flush=True)
time.sleep(300)
"""


@pytest.mark.ray
@pytest.mark.slow
def test_second_run_and_concurrent_resume_are_refused_naming_the_holder(tmp_path, tiny_data):  # noqa: F811
    from launch.spec import load_study
    from launch.location import saved_form

    study_file = tiny_study(tmp_path, "leased", tiny_data)
    study_dir = tmp_path / "studies" / "leased"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(study_dir)], env=a2_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lease = json.loads((study_dir / LEASE_FILE).read_text())
        assert (lease["pid"], lease["host"]) == (holder.pid, socket.gethostname())

        second = a2("study", "run", str(study_file), cwd=tmp_path, timeout=120)
        assert second.returncode == 2, second.stdout
        assert f"being written by {lease['user']}@{lease['host']} pid {holder.pid} since {lease['started']}" \
            in second.stdout
        assert "Traceback" not in second.stdout and not (study_dir / "study.yaml").exists()

        (study_dir / "study.yaml").write_text(yaml.safe_dump(saved_form(load_study(study_file)), sort_keys=False))
        resume = a2("study", "resume", "leased", "--storage", str(tmp_path / "studies"), cwd=tmp_path, timeout=120)
        assert resume.returncode == 2, resume.stdout
        assert f"pid {holder.pid} since {lease['started']}" in resume.stdout
        assert json.loads((study_dir / LEASE_FILE).read_text())["token"] == lease["token"]  # still the holder's
    finally:
        holder.kill()
        holder.wait()


def _stale_lease(study, host="elsewhere", age=1000.0, **fields) -> dict:
    """A lease of another holder last written `age` s ago: its heartbeat field, and its file's modification time,
    which is what staleness is judged on (the storage's clock, `launch.lease.lease_age`)."""
    info = {"user": "someone", "host": host, "pid": 4242, "token": "theirs", "started": "2026-01-01T00:00:00Z",
            "heartbeat": time.time() - age, **fields}
    _write_aged(study, info, age)
    return info


def _write_aged(study, info: dict, age: float) -> None:
    study.join(LEASE_FILE).write_text(json.dumps(info))
    then = time.time() - age
    os.utime(study.join(LEASE_FILE).uri, (then, then))


def test_force_takes_over_only_a_stale_lease(tmp_path, capsys):
    study = open_location(tmp_path / "study")
    _stale_lease(study, age=5)  # live: refused, --force or not
    for force in (False, True):
        with pytest.raises(StudyError, match=r"being written by someone@elsewhere pid 4242 .* heartbeat 5 s ago"):
            StudyLease(study, stale_after=120).acquire(force=force)

    _stale_lease(study, age=1000)
    with pytest.raises(StudyError, match="stale lease of someone@elsewhere pid 4242.*--force"):
        StudyLease(study, stale_after=120).acquire()
    lease = StudyLease(study, stale_after=120)
    with lease.held(force=True):
        assert "WARNING: taking over the stale lease of someone@elsewhere pid 4242" in capsys.readouterr().err
        held = json.loads((tmp_path / "study" / LEASE_FILE).read_text())
        assert (held["token"], held["pid"]) == (lease.mine["token"], os.getpid())
    assert not (tmp_path / "study" / LEASE_FILE).exists()  # released


def test_a_lease_whose_process_is_gone_from_this_host_is_taken_over(tmp_path, capsys):
    """A driver killed with SIGKILL leaves its lease; `resume` on the same machine needs no --force."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    study = open_location(tmp_path / "study")
    _stale_lease(study, host=socket.gethostname(), age=1, pid=dead.pid)
    with StudyLease(study).held():
        assert f"pid {dead.pid}" in capsys.readouterr().err
        assert json.loads((tmp_path / "study" / LEASE_FILE).read_text())["pid"] == os.getpid()


def test_heartbeat_keeps_the_lease_live(tmp_path):
    study = open_location(tmp_path / "study")
    with StudyLease(study, stale_after=0.4).held():
        first = json.loads((tmp_path / "study" / LEASE_FILE).read_text())["heartbeat"]
        time.sleep(0.6)  # longer than stale_after: only the heartbeat keeps it live
        with pytest.raises(StudyError, match="being written by"):
            StudyLease(study, stale_after=0.4).acquire(force=True)
        assert json.loads((tmp_path / "study" / LEASE_FILE).read_text())["heartbeat"] > first


def test_a_lease_copied_over_in_place_is_not_read_as_lost(tmp_path):
    """A plain copy over the lease (truncate, then write: what Tune 2.60's experiment upload did to every .json at a
    resumed study's root) shows the file empty for a moment; the holder's check reads it again before it stops."""
    import threading

    study = open_location(tmp_path / "study")
    with StudyLease(study, stale_after=60).held() as lease:
        path = tmp_path / "study" / LEASE_FILE
        text = path.read_text()
        path.write_text("")  # mid-copy: truncated, not yet written
        threading.Timer(0.2, path.write_text, [text]).start()
        lease.check("writing")  # no LeaseLost
        assert not lease.lost.is_set()
        path.write_text(text[: len(text) // 2])  # cut short, and left so: not the holder's lease any more
        with pytest.raises(StudyError, match="taken over"):
            lease.check("writing")


def test_a2s_root_files_are_kept_out_of_tunes_restore_staging(tmp_path):
    """Tune's restore copies every .json and .pkl at the study's root into its staging folder and uploads that
    folder back at each experiment checkpoint, plainly: a2's files are removed from it, and Tune's own that the
    restore has read; the callback states, read next, stay."""
    from launch.verify import keep_out_of_tunes_uploads

    staging = tmp_path / "driver_artifacts"
    staging.mkdir()
    read = ["experiment_state-2026-12-02_10-46-00.json", "search_gen_state-2026-12-02_10-46-00.json",
            "searcher-state-2026-12-02_10-46-00.pkl", "tuner.pkl"]  # Tune's, read by the restore already
    ours = ["data-fingerprint.json", "lease.json", "record-digest.json", "rounds.json", "summary.json"]
    kept = ["callback-states-2026-12-02_10-46-00.pkl"]  # Tune reads it from there next
    for name in read + ours + kept:
        (staging / name).write_text("{}")
    (staging / "a2_trial_1").mkdir()
    assert keep_out_of_tunes_uploads(str(staging)) == sorted(read + ours)
    assert sorted(p.name for p in staging.iterdir()) == ["a2_trial_1", *kept]
    study = tmp_path / "study"  # the study's own folder (its study.yaml): never emptied, whoever passes it
    study.mkdir()
    for name in ("study.yaml", *ours):
        (study / name).write_text("{}")
    assert keep_out_of_tunes_uploads(str(study)) == [] and len(list(study.iterdir())) == 6


def test_s3_lease_is_a_conditional_create(s3_endpoint):
    bucket = make_bucket(s3_endpoint, "a2-lease-test")
    study = open_location(f"s3://{bucket}/studies/leased", s3_endpoint)
    first = StudyLease(study)
    first.acquire()
    try:
        with pytest.raises(StudyError, match=rf"being written by .*pid {os.getpid()}"):
            StudyLease(study).acquire(force=True)
    finally:
        first.release()
    assert not study.join(LEASE_FILE).exists()
    with StudyLease(study).held() as second:
        assert json.loads(study.join(LEASE_FILE).read_text())["token"] == second.mine["token"]


HOLD_FROZEN = """
import sys, time
from launch.storage import open_location
from launch.lease import StudyLease
lease = StudyLease(open_location(sys.argv[1]), stale_after=float(sys.argv[2]))
lease.acquire()
print("held", flush=True)
time.sleep(300)
"""


def test_a_live_holder_on_this_host_is_never_taken_over(tmp_path):
    """A driver frozen on this host (SIGSTOP: a suspended laptop, a stalled head), its lease unwritten for longer
    than any period: refused even with --force and a short --stale-after, naming the process and what to do."""
    study = open_location(tmp_path / "study")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_FROZEN, study.uri, "120"], env=a2_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)
        info = json.loads(study.join(LEASE_FILE).read_text())
        _write_aged(study, {**info, "heartbeat": time.time() - 1000}, 1000)  # frozen for 1000 s
        with pytest.raises(StudyError) as refused:
            StudyLease(study, stale_after=20).acquire(force=True)
        line = str(refused.value)
        assert "\n" not in line and f"pid {holder.pid}" in line and "alive on this host" in line, line
        assert f"kill -9 {holder.pid}" in line and "not even --force" in line, line
        assert json.loads(study.join(LEASE_FILE).read_text())["token"] == info["token"]  # still the holder's
    finally:
        holder.kill()
        holder.wait()


def test_staleness_is_the_holders_own_period_not_the_takers(tmp_path):
    """A healthy holder elsewhere beats every 30 s within its 120 s: a taker's `--stale-after 20` 24 s after its last
    heartbeat is refused; past the holder's own 120 s, --force takes it over."""
    study = open_location(tmp_path / "study")
    _stale_lease(study, age=24, stale_after=120.0, every=30.0)
    with pytest.raises(StudyError, match=r"being written by someone@elsewhere .* heartbeat 24 s ago.* 120 s, the "
                                         r"holder's own period"):
        StudyLease(study, stale_after=20).acquire(force=True)
    _stale_lease(study, age=130, stale_after=120.0, every=30.0)
    lease = StudyLease(study, stale_after=20)
    with lease.held(force=True):
        held = json.loads(study.join(LEASE_FILE).read_text())
        assert held["token"] == lease.mine["token"] and held["stale_after"] == 20.0  # its own period, for others


def test_a_holders_clock_an_hour_off_neither_locks_out_nor_expires_the_lease(tmp_path, capsys):
    """Staleness on the storage's clock: a dead holder whose host's clock ran an hour ahead is stale once its lease
    file is older than its period (not for an hour more); one whose clock runs an hour behind is not stale while its
    lease file is rewritten."""
    study = open_location(tmp_path / "study")
    _stale_lease(study, age=300, heartbeat=time.time() + 3600)  # written 300 s ago, by a clock an hour ahead
    with StudyLease(study).held(force=True):
        err = capsys.readouterr().err
        assert "taking over the stale lease of someone@elsewhere pid 4242" in err and "heartbeat 300 s ago" in err
        assert not re.search(r"heartbeat -\d", err)  # no negative age from the holder's clock
    _stale_lease(study, age=2, heartbeat=time.time() - 3600)  # rewritten 2 s ago, by a clock an hour behind
    with pytest.raises(StudyError, match="being written by someone@elsewhere .* heartbeat 2 s ago"):
        StudyLease(study).acquire(force=True)


def test_a_superseded_holder_stops_before_its_next_write(tmp_path, capsys):
    """Once another process took the lease, `check` (called before each write of results, exports and the summary)
    raises one line naming the new holder, and the heartbeat says so too; the old holder never removes the new
    lease."""
    from launch.lease import LeaseLost, held_lease

    study = open_location(tmp_path / "study")
    lease = StudyLease(study, stale_after=0.4)
    lease.acquire()
    try:
        assert held_lease(study.uri) is lease
        lease.check("writing the summary")  # still ours: nothing happens
        _stale_lease(study, age=0, stale_after=120.0)  # taken over (by someone@elsewhere)
        with pytest.raises(LeaseLost) as lost:
            lease.check("writing the summary")
        line = str(lost.value)
        assert "\n" not in line and "taken over by someone@elsewhere pid 4242" in line
        assert "stopped before writing the summary" in line
        time.sleep(0.3)
        assert "no longer the study's one writer" in capsys.readouterr().err
    finally:
        lease.release()
    assert json.loads(study.join(LEASE_FILE).read_text())["token"] == "theirs"
    assert held_lease(study.uri) is None


def test_an_older_lease_whose_pid_may_be_reused_is_taken_over_when_stale(tmp_path):
    """A lease of an a2 that recorded no process start time: its pid alive here may be another process by now (a
    reboot, pids wrapped), so a stale one is taken over with --force as before, not refused as a live holder."""
    study = open_location(tmp_path / "study")
    _stale_lease(study, host=socket.gethostname(), age=1000, pid=os.getppid())  # alive, not the holder
    with pytest.raises(StudyError, match="stale lease of .*--force"):
        StudyLease(study).acquire()
    with StudyLease(study).held(force=True) as lease:
        assert json.loads(study.join(LEASE_FILE).read_text())["token"] == lease.mine["token"]


def test_a_lease_write_that_fails_leaves_no_file_and_the_retry_takes_it(tmp_path, monkeypatch):
    """`write_if_absent` (the lease's create) removes the file it created (O_EXCL: its own) when the write fails: a
    disk that fills up mid-write used to leave a partial lease.json that made every later run find "one exists"."""
    import errno

    from launch import storage
    from launch.storage import WriteRefused

    target = open_location(str(tmp_path)).join("s", LEASE_FILE)
    real_fdopen = os.fdopen

    def full_disk(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        f.write = lambda data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
        return f

    with monkeypatch.context() as patch:
        patch.setattr(storage.os, "fdopen", full_disk)
        with pytest.raises(WriteRefused, match="No space left on device"):
            target.write_if_absent('{"user": "me", "pid": 1}')
    assert os.listdir(tmp_path / "s") == []
    assert target.write_if_absent('{"user": "me", "pid": 1}') is True
    assert target.write_if_absent('{"user": "you", "pid": 2}') is False
    assert json.loads(target.read_text()) == {"user": "me", "pid": 1} and os.listdir(tmp_path / "s") == [LEASE_FILE]
