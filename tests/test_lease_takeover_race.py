"""Two takers of one stale lease at once: only the one that creates the take-over claim (`lease.json.takeover-<the
stale holder's token>`, if absent, as the lease) replaces the lease, and only while the lease still reads as the one
it judged stale; the other gets the one-line "another process took the lease first". A claim left by a taker killed
mid-way holds later takers off only for the holder's stale period; claims are removed once a take-over is done."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import launch.lease as lease_module
from a2core.errors import StudyError
from launch.lease import LEASE_FILE, StudyLease
from launch.storage import Location, open_location
from tests.s3server import make_bucket

pytestmark = pytest.mark.outside_ray_group

TAKEN_FIRST = "another process took the lease first"
STALE = {"user": "someone", "host": "elsewhere", "pid": 4242, "token": "theirs", "started": "2026-01-01T00:00:00Z",
         "heartbeat": 0.0, "stale_after": 60.0}


def _aged(location, text: str, age: float) -> None:
    """`text` written at `location` (a local file), last modified `age` s ago: what staleness is judged on."""
    location.write_text(text)
    then = time.time() - age
    os.utime(location.uri, (then, then))


def _stale_study(tmp_path, text: str | None = None):
    study = open_location(tmp_path / "study")
    _aged(study.join(LEASE_FILE), json.dumps(STALE) if text is None else text, 1000.0)
    return study


def _claims(study) -> list[str]:
    return [name for name in study.listdir() if ".takeover-" in name]


def _token(study) -> str:
    return json.loads(study.join(LEASE_FILE).read_text())["token"]


def _on_the_lease_delete(monkeypatch, then) -> None:
    """Run `then()` once, right before the first removal of a lease file (a taker between claim and create)."""
    real, done = lease_module.delete_if_unchanged, []

    def delete(location, version):  # the lease's compare-and-swap removal (`launch.storage.delete_if_unchanged`)
        if location.uri.endswith("/" + LEASE_FILE) and not done:
            done.append(True)
            then()
        return real(location, version)
    monkeypatch.setattr(lease_module, "delete_if_unchanged", delete)


def _after_judging(monkeypatch, then) -> None:
    """Run `then()` once, right after the first taker has read the lease's age (it has judged the lease stale)."""
    real, done = lease_module.lease_age, []

    def lease_age(*args, **kwargs):
        age = real(*args, **kwargs)
        if not done:
            done.append(True)
            then()
        return age
    monkeypatch.setattr(lease_module, "lease_age", lease_age)


@pytest.mark.parametrize("text", [None, '{"user": "someone", "heart'], ids=["whole", "damaged"])
def test_a_second_taker_while_the_first_is_between_claim_and_create_gives_up(tmp_path, monkeypatch, text):
    """Before the fix B removed the stale lease and created its own, then A removed B's and created its own: both
    held the study. Now A's claim stops B; a damaged lease (no token) is claimed by its bytes' digest."""
    study = _stale_study(tmp_path, text)
    first, second = StudyLease(study), StudyLease(study)
    errors = []

    def second_takes_over():
        with pytest.raises(StudyError) as caught:
            second.acquire(force=True)
        errors.append(str(caught.value))
    _on_the_lease_delete(monkeypatch, second_takes_over)
    first.acquire(force=True)
    try:
        assert len(errors) == 1 and TAKEN_FIRST in errors[0] and f"pid {os.getpid()}" in errors[0]
        assert "\n" not in errors[0]
        assert _token(study) == first.mine["token"] and first.holds() and not second.lost.is_set()
        assert lease_module.held_lease(study.uri) is first
        assert _claims(study) == []
    finally:
        first.release()


def test_a_taker_that_judged_a_lease_already_taken_over_gives_up(tmp_path, monkeypatch):
    """B read the stale lease, then A took it over whole (claim removed): B's claim now succeeds, but the lease no
    longer reads as the one B judged, so B leaves A's lease alone."""
    study = _stale_study(tmp_path)
    first, second = StudyLease(study), StudyLease(study)
    _after_judging(monkeypatch, lambda: first.acquire(force=True))
    try:
        with pytest.raises(StudyError, match=f"{TAKEN_FIRST}: .*pid {os.getpid()}"):
            second.acquire(force=True)
        assert _token(study) == first.mine["token"] and first.holds()
        assert _claims(study) == []
    finally:
        first.release()


def test_a_holder_that_beats_again_after_being_judged_stale_keeps_its_lease(tmp_path, monkeypatch):
    study = _stale_study(tmp_path)
    revived = dict(STALE, heartbeat=time.time(), beats=1)
    _after_judging(monkeypatch, lambda: study.join(LEASE_FILE).write_text(json.dumps(revived)))
    with pytest.raises(StudyError, match=TAKEN_FIRST):
        StudyLease(study).acquire(force=True)
    assert json.loads(study.join(LEASE_FILE).read_text()) == revived
    assert _claims(study) == []


def test_two_takers_racing_after_both_judged_leave_exactly_one_holder(tmp_path, monkeypatch):
    real = lease_module.lease_age
    for attempt in range(5):
        study = _stale_study(tmp_path / str(attempt))
        takers = [StudyLease(study), StudyLease(study)]
        both_judged = threading.Barrier(2, timeout=10)

        def lease_age(*args, **kwargs):
            age = real(*args, **kwargs)
            both_judged.wait()
            return age
        monkeypatch.setattr(lease_module, "lease_age", lease_age)
        outcome: dict[int, str] = {}

        def take(i):
            try:
                takers[i].acquire(force=True)
                outcome[i] = "held"
            except StudyError as err:
                outcome[i] = str(err)
        threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        winners = [i for i in range(2) if outcome.get(i) == "held"]
        try:
            assert len(winners) == 1, outcome
            assert TAKEN_FIRST in outcome[1 - winners[0]]
            assert _token(study) == takers[winners[0]].mine["token"] and _claims(study) == []
        finally:
            for i in winners:
                takers[i].release()


def test_a_claim_left_by_a_killed_taker_holds_off_only_for_the_holders_period(tmp_path):
    study = _stale_study(tmp_path)
    crashed = dict(STALE, user="crashed", token="killed-taker", heartbeat=time.time())
    claim = study.join(LEASE_FILE + ".takeover-theirs")
    _aged(claim, json.dumps(crashed), 5.0)  # its taker may still be at it
    with pytest.raises(StudyError, match=f"{TAKEN_FIRST}: crashed@elsewhere"):
        StudyLease(study).acquire(force=True)
    assert _token(study) == "theirs" and claim.exists()
    _aged(claim, json.dumps(crashed), 61.0)  # older than the stale holder's 60 s: its taker was killed mid-way
    _aged(study.join(LEASE_FILE + ".takeover-older"), "{}", 5000.0)  # one of an earlier lease, left so as well
    taker = StudyLease(study, stale_after=30)
    with taker.held(force=True):
        assert _token(study) == taker.mine["token"]
        assert _claims(study) == []  # its own and every one left behind


def test_s3_a_second_taker_between_claim_and_create_gives_up(s3_endpoint, monkeypatch):
    """On S3 (a conditional PUT): a lease whose process is gone from this host, taken over twice at once."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    bucket = make_bucket(s3_endpoint, "a2-lease-takeover-race")
    study = open_location(f"s3://{bucket}/studies/raced", s3_endpoint)
    study.join(LEASE_FILE).write_text(json.dumps(dict(STALE, host=socket.gethostname(), pid=dead.pid,
                                                      pid_ns=os.readlink("/proc/self/ns/pid"))))
    first, second = StudyLease(study), StudyLease(study)
    errors = []

    def second_takes_over():
        with pytest.raises(StudyError) as caught:
            second.acquire()
        errors.append(str(caught.value))
    _on_the_lease_delete(monkeypatch, second_takes_over)
    first.acquire()
    try:
        assert len(errors) == 1 and TAKEN_FIRST in errors[0]
        assert _token(study) == first.mine["token"] and first.holds()
        assert _claims(study) == []
    finally:
        first.release()
