"""A lease writer frozen (SIGSTOP, a long GC) right after it read the lease, for longer than the holder's period,
must not, once it runs again, remove or overwrite the lease another process wrote meanwhile: every change of the
lease is a compare-and-swap against the version it read (on S3 a conditional PUT/DELETE, `IfMatch`; on disk under
an flock, `launch.storage.replace_if_unchanged` / `delete_if_unchanged`). The freeze is simulated deterministically:
the other process runs inside a hook on the frozen one's read of the lease, before it goes on."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

import launch.lease as lease_module
import launch.storage as storage_module
from a2core.errors import StorageError, StudyError
from launch.lease import CLAIM_INFIX, LEASE_FILE, StudyLease
from launch.storage import Location, open_location
from tests import raycluster
from tests.s3server import unique_bucket

pytestmark = pytest.mark.outside_ray_group
arrow_s3_compatible_moto = raycluster.arrow_s3_compatible_moto  # a fixture: pyarrow's writes to moto at once

REFUSED = r"another process took the lease first|is being written by|is held by"
STALE = {"user": "someone", "host": "elsewhere", "pid": 4242, "token": "theirs", "started": "2026-01-01T00:00:00Z",
         "heartbeat": 0.0, "stale_after": 60.0}


def _token(study) -> str | None:
    text = study.join(LEASE_FILE).read_text()
    return json.loads(text)["token"] if text else None


def _after_read(monkeypatch, nth: int, then) -> list[bool]:
    """Run `then()` once, right after the `nth` look at a lease file (a read through `Location.read_bytes` or the
    storage's versioned read where there is one; its time, `Location.stamp`): the reader frozen there while `then`
    runs. Returns [True] once it ran."""
    fired, count, inside = [], [0], [False]

    def wrap(real):
        def read(*args, **kwargs):
            location = args[0]
            nested = inside[0]
            inside[0] = True
            try:
                result = real(*args, **kwargs)
            finally:
                inside[0] = nested
            if not nested and not fired and str(location).endswith("/" + LEASE_FILE):
                count[0] += 1
                if count[0] == nth:
                    fired.append(True)
                    then()
            return result
        return read
    monkeypatch.setattr(Location, "read_bytes", wrap(Location.read_bytes))
    monkeypatch.setattr(Location, "stamp", wrap(Location.stamp))
    if hasattr(lease_module, "read_versioned"):  # the lease's reads and compare-and-swaps, where it has them
        monkeypatch.setattr(lease_module, "read_versioned", wrap(lease_module.read_versioned))
        for name in ("replace_if_unchanged", "delete_if_unchanged"):  # a compare-and-swap's own look: not a point
            monkeypatch.setattr(lease_module, name, _uncounted(getattr(lease_module, name), inside))
    return fired


def _uncounted(real, inside: list[bool]):
    def call(*args, **kwargs):
        nested, inside[0] = inside[0], True
        try:
            return real(*args, **kwargs)
        finally:
            inside[0] = nested
    return call


def _age_local(study, seconds: float) -> None:
    """Every lease and claim file of `study` (local) last written `seconds` ago: time passing, a taker frozen."""
    then = time.time() - seconds
    for name in study.listdir():
        if name.startswith(LEASE_FILE):
            os.utime(study.join(name).uri, (then, then))


def _race(monkeypatch, study, make_taker, freeze, lease: dict = STALE) -> int:
    """For each point at which taker A looks at the lease: A frozen right after that look, `freeze()` (time passing),
    then B takes the study over whole; then A goes on. Returns how many points were tried."""
    for nth in range(1, 6):
        here = study.join(f"try{nth}")
        here.join(LEASE_FILE).write_text(json.dumps(lease))
        first, second = make_taker(here), make_taker(here)

        def second_takes_over():
            freeze(here)
            second.acquire(force=True)
        fired = _after_read(monkeypatch, nth, second_takes_over)
        try:
            try:
                first.acquire(force=True)
            except StudyError as err:
                message = str(err)
            else:
                assert not fired, "A took the study over although B had taken it over meanwhile"
                return nth - 1  # A read the lease fewer than `nth` times: no point left to freeze it at
            assert fired, f"A failed before its frozen point: {message}"
            assert re.search(REFUSED, message), message
            assert "\n" not in message  # one line
            # the refusal names who holds the study now (B), not the stale holder A had read
            assert "4242" not in message and "elsewhere" not in message, message
            assert _token(here) == second.mine["token"], "B's lease was replaced or removed by the frozen A"
            assert second.holds() and not second.lost.is_set()
            assert lease_module.held_lease(here.uri) is second
        finally:
            second.release()
            first.release()
            monkeypatch.undo()
    return 5


def test_a_taker_frozen_after_reading_the_lease_never_replaces_a_newer_takers_lease_on_disk(tmp_path, monkeypatch):
    study = open_location(tmp_path / "study")

    def aged(location):
        _age_local(location, 1000.0)  # the stale lease, and A's claim (if any) older than the holder's 60 s
    tried = _race(monkeypatch, study, lambda here: (_age_local(here, 1000.0), StudyLease(here))[1], aged)
    assert tried >= 1


@pytest.mark.usefixtures("arrow_s3_compatible_moto")
def test_a_taker_frozen_after_reading_the_lease_never_replaces_a_newer_takers_lease_on_s3(s3_endpoint, monkeypatch):
    """The stale lease is one whose process is gone from this host (no waiting for it to age); A is frozen for
    longer than the takers' 4 s period wherever it has made its claim by then (none at the points it has now)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = dict(STALE, host=socket.gethostname(), pid=dead.pid, pid_ns=os.readlink("/proc/self/ns/pid"),
                stale_after=1.0)
    study = open_location(f"s3://{unique_bucket(s3_endpoint, 'a2-lease-cas')}/studies/raced", s3_endpoint)

    def freeze(here):
        if any(CLAIM_INFIX in name for name in here.listdir()):
            time.sleep(4.2)  # A's claim older than the period: B walks past it
    tried = _race(monkeypatch, study, lambda here: StudyLease(here, stale_after=4.0), freeze, gone)
    assert tried >= 1


def _remote_holder(study) -> StudyLease:
    """A holder of `study`'s lease that looks, to a taker, like a process on another host (its heartbeat thread
    stopped: the test makes its beats)."""
    holder = StudyLease(study)
    holder.mine["host"] = "elsewhere"
    holder.acquire()
    holder._stop.set()
    holder._thread.join(5)
    return holder


def test_a_holder_frozen_in_its_heartbeat_never_overwrites_the_lease_of_the_one_that_took_it_over(tmp_path,
                                                                                                monkeypatch):
    study = open_location(tmp_path / "study")
    holder, taker = _remote_holder(study), StudyLease(study)
    holder._stop.clear()  # a beat is written only while not released

    def taken_over():
        _age_local(study, 1000.0)
        taker.acquire(force=True)
    fired = _after_read(monkeypatch, 1, taken_over)
    try:
        found = holder._rewrite(json.dumps(dict(holder.mine, beats=7)) + "\n")
        assert fired
        assert found and found["token"] == taker.mine["token"]  # what the beat found there: the taker's
        assert _token(study) == taker.mine["token"] and taker.holds()
    finally:
        monkeypatch.undo()
        taker.release()
    assert study.join(LEASE_FILE).read_text() is None  # the taker's release removed its own lease


def test_a_holder_frozen_in_its_release_never_removes_the_lease_of_the_one_that_took_it_over(tmp_path, monkeypatch):
    study = open_location(tmp_path / "study")
    holder, taker = _remote_holder(study), StudyLease(study)

    def taken_over():
        _age_local(study, 1000.0)
        taker.acquire(force=True)
    fired = _after_read(monkeypatch, 1, taken_over)
    try:
        holder.release()
        assert fired
        assert _token(study) == taker.mine["token"] and taker.holds()
    finally:
        monkeypatch.undo()
        taker.release()


@pytest.mark.usefixtures("arrow_s3_compatible_moto")
def test_compare_and_swap_primitives_on_disk_and_on_s3(tmp_path, s3_endpoint):
    from launch.storage import delete_if_unchanged, read_versioned, replace_if_unchanged

    for location in (open_location(tmp_path / "cas" / "x.json"),
                     open_location(f"s3://{unique_bucket(s3_endpoint, 'a2-cas')}/a/x.json", s3_endpoint)):
        assert read_versioned(location) == (None, None)
        assert replace_if_unchanged(location, "no-such-version", "new") is None  # nothing there to replace
        assert location.read_text() is None
        location.write_text("one")
        text, first = read_versioned(location)
        assert text == "one" and first
        second = replace_if_unchanged(location, first, "two")
        assert second and second != first and read_versioned(location) == ("two", second)
        assert replace_if_unchanged(location, first, "three") is None  # changed since `first` was read
        assert not delete_if_unchanged(location, first)
        assert location.read_text() == "two"
        assert delete_if_unchanged(location, second) and location.read_text() is None
        assert not delete_if_unchanged(location, second)  # gone already
    assert os.listdir(tmp_path / "cas") == []  # the lock file on disk goes with the file


def test_a_taker_frozen_inside_its_compare_and_swap_holds_the_other_off_until_it_ends(tmp_path, monkeypatch):
    """On disk the compare and the swap happen under one flock: a second taker waits for it (here 0.2 s), then
    refuses in one line naming the lock; the first, thawed, completes its take-over."""
    monkeypatch.setattr(storage_module, "CAS_LOCK_WAIT", 0.2)
    study = open_location(tmp_path / "study")
    study.join(LEASE_FILE).write_text(json.dumps(STALE))
    _age_local(study, 1000.0)
    first, second = StudyLease(study), StudyLease(study)
    real, errors = Location.delete, []

    def delete(self):  # the first taker, frozen inside its compare-and-swap, right before it removes the lease
        if self.uri.endswith("/" + LEASE_FILE) and not errors:
            _age_local(study, 1000.0)  # its claim older than the holder's period: walked past
            with pytest.raises(StorageError) as caught:
                second.acquire(force=True)
            errors.append(str(caught.value))
        return real(self)
    monkeypatch.setattr(Location, "delete", delete)
    first.acquire(force=True)
    try:
        assert len(errors) == 1 and ".lease.json.lock: locked by another process" in errors[0], errors
        assert "\n" not in errors[0]
        assert _token(study) == first.mine["token"] and first.holds()
    finally:
        first.release()


def test_a_taker_killed_between_its_claim_and_its_lease_does_not_hold_the_study_off(tmp_path, capsys):
    """Found by tests/test_kill_anywhere.py's sweep: a resume SIGKILLed inside its take-over of a dead driver's lease
    (its claim made, the old lease not yet replaced) left a young claim; the next resume refused for the holder's
    whole period ("another process took the lease first", naming the killed taker). A claim whose taker's process
    is gone from this host is walked past at once, as that taker's lease would be."""
    study = open_location(str(tmp_path / "study"))
    dead_driver, dead_taker = (subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2))
    dead_driver.wait()
    dead_taker.wait()
    here = {"host": socket.gethostname(), "pid_ns": os.readlink("/proc/self/ns/pid")}
    seen = json.dumps(dict(STALE, **here, pid=dead_driver.pid, heartbeat=time.time()))
    study.join(LEASE_FILE).write_text(seen)
    killed = dict(StudyLease(study).mine, pid=dead_taker.pid, token="killed-mid-take-over")
    claim = lease_module._claim_name(json.loads(seen), seen, 1)
    study.join(claim).write_text(json.dumps(killed))  # written just now: young, by a process that is gone

    taker = StudyLease(study, stale_after=60.0)
    taker.acquire()
    try:
        assert _token(study) == taker.mine["token"]
        assert f"pid {dead_driver.pid}" in capsys.readouterr().err  # the take-over said whose lease it replaced
        assert not [n for n in study.listdir() if CLAIM_INFIX in n]  # the killed taker's claim cleared too
    finally:
        taker.release()
    # a claim whose taker is alive on this host still holds a second taker off (the claim's purpose)
    seen = json.dumps(dict(STALE, **here, pid=dead_driver.pid, heartbeat=time.time(), token="again"))
    study.join(LEASE_FILE).write_text(seen)
    study.join(lease_module._claim_name(json.loads(seen), seen, 1)).write_text(json.dumps(StudyLease(study).mine))
    with pytest.raises(StudyError, match="another process took the lease first"):
        StudyLease(study, stale_after=60.0).acquire()


def test_an_s3_endpoint_that_ignores_conditional_writes_is_named_once_a_process(s3_endpoint, monkeypatch, capsys):
    """moto, like AWS S3, refuses a PUT whose condition does not hold (412): a lease taken there says nothing. Some
    S3-compatible servers write anyway (here the server never sees the conditions: each PUT's If-None-Match and
    If-Match headers are removed before it is signed). There the lease cannot keep a second driver out, and the first
    lease taken says so, naming the endpoint, once a process."""
    monkeypatch.setattr(storage_module, "CONDITIONS_IGNORED", {})
    monkeypatch.setattr(lease_module, "_WARNED_CONDITIONS", set())
    study = open_location(f"s3://{unique_bucket(s3_endpoint, 'a2-conditions')}/studies/honoured", s3_endpoint)
    lease = StudyLease(study)
    lease.acquire()
    lease.release()
    assert storage_module.CONDITIONS_IGNORED == {s3_endpoint: False}
    assert "conditional PUT" not in capsys.readouterr().err
    assert study.join(LEASE_FILE).write_if_absent("{}") and not study.join(LEASE_FILE).write_if_absent("{}")

    real = storage_module.make_client

    def conditions_dropped(*args, **kwargs):
        client = real(*args, **kwargs)

        def strip(request, **_):
            for header in ("If-None-Match", "If-Match"):
                if header in request.headers:
                    del request.headers[header]
        client.meta.events.register("before-sign.s3.PutObject", strip)
        return client

    monkeypatch.setattr(storage_module, "make_client", conditions_dropped)
    monkeypatch.setattr(storage_module, "CONDITIONS_IGNORED", {})
    ignored = open_location(f"s3://{unique_bucket(s3_endpoint, 'a2-conditions')}/studies/ignored", s3_endpoint)
    first = StudyLease(ignored)
    first.acquire()
    try:
        err = capsys.readouterr().err
        assert err.count("conditional PUT") == 1, err
        assert (f"warning: the S3 endpoint of {ignored.uri} ({s3_endpoint}) wrote over an object that a conditional "
                f"PUT said not to (If-None-Match / If-Match): it ignores those conditions, so the study's lease "
                f"cannot keep a second driver out there; run one driver per study yourself") in err, err
        # what the warning is about: a second writer's create of the held lease is written over it
        assert json.loads(ignored.join(LEASE_FILE).read_text())["token"] == first.mine["token"]
        assert ignored.join(LEASE_FILE).write_if_absent(json.dumps({"token": "second"}))
        assert json.loads(ignored.join(LEASE_FILE).read_text())["token"] == "second"
    finally:
        first._stop.set()
        first._thread.join(5)
    again = StudyLease(open_location(ignored.uri + "-again", s3_endpoint))
    again.acquire()
    again.release()
    assert "conditional PUT" not in capsys.readouterr().err  # said once a process
