"""The lease's heartbeat thread against a stderr that cannot be written (it must keep beating, or a live driver's
lease goes stale and is taken over) and against a release or a takeover while a beat reads the lease: the beat must
neither recreate the lease nor overwrite a new holder's. (A write already on its way when that happens still lands:
the storage layer has no compare-and-swap, S3 none at all; reading just before writing narrows the window.)"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time

from launch.lease import LEASE_FILE, StudyLease
from launch.storage import open_location


class _HungUp:
    """A stderr whose terminal hung up: every write fails."""

    def write(self, _text):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def _token(study) -> str | None:
    text = study.join(LEASE_FILE).read_text()
    return json.loads(text)["token"] if text else None


def _release_without_waiting(lease, monkeypatch) -> threading.Thread:
    """`release`, its wait for the heartbeat thread cut short (as by a write slower than its 5 s); the thread."""
    thread = lease._thread
    monkeypatch.setattr(thread, "join", lambda timeout=None: None)
    lease.release()
    return thread


def test_a_heartbeat_survives_a_failed_write_whose_note_cannot_be_written(tmp_path, monkeypatch):
    """A write that fails once, its note to a hung-up stderr failing too: the thread keeps beating (it used to end
    there, silently, and the lease went stale under a live driver)."""
    study = open_location(tmp_path / "study")
    failed, real = threading.Event(), os.fsync

    def fails_once(fd):
        if not failed.is_set():
            failed.set()
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(sys, "stderr", _HungUp())
    monkeypatch.setattr(os, "fsync", fails_once)
    lease = StudyLease(study, stale_after=0.4)  # a beat every 0.1 s
    lease.acquire()
    try:
        assert failed.wait(2)
        time.sleep(0.3)
        assert lease._thread.is_alive()
        beats = json.loads(study.join(LEASE_FILE).read_text())["beats"]
        time.sleep(0.5)
        assert json.loads(study.join(LEASE_FILE).read_text())["beats"] >= beats + 2
        assert lease.holds() and not lease.lost.is_set()
    finally:
        lease.release()
    assert not study.join(LEASE_FILE).exists()


def _hold_beat_reads(monkeypatch):
    """The heartbeat's read returns what it found only once `go` is set (S3 retrying a GET); (reading, go)."""
    reading, go = threading.Event(), threading.Event()
    real = StudyLease._read_settled

    def slow(self):
        holder = real(self)
        if threading.current_thread().name == "a2-lease":
            reading.set()
            go.wait(3)
        return holder

    monkeypatch.setattr(StudyLease, "_read_settled", slow)
    return reading, go


def test_a_release_during_a_beats_read_stops_the_beat_before_it_writes(tmp_path, monkeypatch):
    """`release` while a beat was reading the lease (S3's latency): the stop flag is looked at just before the
    write, which would recreate the lease released."""
    study = open_location(tmp_path / "study")
    lease = StudyLease(study, stale_after=0.4)
    lease.acquire()
    reading, go = _hold_beat_reads(monkeypatch)
    assert reading.wait(2)  # a beat found its own lease, and has not written yet
    thread = _release_without_waiting(lease, monkeypatch)
    go.set()
    threading.Thread.join(thread, 3)
    assert not thread.is_alive()
    assert not study.join(LEASE_FILE).exists()  # was: recreated


def test_a_lease_taken_over_during_a_beats_read_is_not_written_over(tmp_path, monkeypatch):
    """The same, the lease taken over (another host's --force) while the beat's read was on its way: the token read
    again just before the write keeps the beat off the new holder's lease, and this holder knows it lost it."""
    study = open_location(tmp_path / "study")
    lease = StudyLease(study, stale_after=0.4)
    lease.acquire()
    try:
        reading, go = _hold_beat_reads(monkeypatch)
        assert reading.wait(2)
        theirs = {"user": "someone", "host": "elsewhere", "pid": 4242, "token": "theirs", "heartbeat": time.time(),
                  "stale_after": 120.0}
        assert theirs["host"] != socket.gethostname()
        study.join(LEASE_FILE).write_text(json.dumps(theirs))
        go.set()
        assert lease.lost.wait(2)
        assert _token(study) == "theirs"  # was: the beat's own, the new holder then stopping with LeaseLost
    finally:
        lease.release()
    assert _token(study) == "theirs"
