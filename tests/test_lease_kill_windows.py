"""A resume's take-over of a dead driver's lease, killed right before each of its observed writes.

tests/test_kill_anywhere.py's windows are those of a study run from nothing, whose driver creates the lease; a
resume after a kill first takes over the dead driver's lease (a claim, a compare-and-swap under the lease's lock
file, the new lease, the claims cleared), writes no fresh run makes. A resume killed inside that take-over once left
a claim that held the next resume off for the holder's whole period, naming the dead taker ("another process took
the lease first"). Here the take-over's writes are found by watching them (tests/faults/fswrites.c, as the sweep
does), then a taker is SIGKILLed right before each in turn, and the next taker (as `a2 study resume` takes the
lease: no --force) must take the study over at once, and leave neither lease nor claim behind when it releases.
Needs no Ray; a C compiler (cc or gcc), else skipped.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from launch.lease import CLAIM_INFIX, LEASE_FILE
from tests.killwindows import fired_write, marker, needs_compiler, observe, shim  # noqa: F401 - shim is a fixture
from tests.repo_scripts import ROOT

pytestmark = [pytest.mark.outside_ray_group, needs_compiler("a lease take-over")]

TAKER = """
import sys
from launch.lease import StudyLease
from launch.storage import open_location
lease = StudyLease(open_location(sys.argv[1]))
lease.acquire()
print("holder", lease.mine["pid"], flush=True)
lease.release()
"""


def _dead_drivers_lease(study: Path) -> None:
    """The study as a SIGKILLed driver on this host left it: its lease, its heartbeat a second old."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    study.mkdir(parents=True)
    (study / LEASE_FILE).write_text(json.dumps({
        "user": "a2", "host": socket.gethostname(), "pid": dead.pid, "pid_ns": os.readlink("/proc/self/ns/pid"),
        "token": "killed-driver", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 60)),
        "heartbeat": now - 1, "beats": 5, "every": 10.0, "stale_after": 60.0}, indent=2) + "\n")


def _take(shim: Path, study: Path, *, log: Path | None = None, kill: str | None = None,
          fired: Path | None = None) -> subprocess.CompletedProcess:
    env = observe.shim_env({**os.environ, "PYTHONPATH": str(ROOT)}, shim, study, log=log,
                           kill=[kill] if kill else [], fired=fired)
    return subprocess.run([sys.executable, "-c", TAKER, str(study)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_take_over_killed_before_any_of_its_writes_leaves_a_study_the_next_resume_takes_at_once(tmp_path, shim):
    initial = tmp_path / "initial" / "study"
    _dead_drivers_lease(initial)
    watched = tmp_path / "watched" / "study"
    shutil.copytree(initial, watched)
    log = tmp_path / "writes.log"
    done = _take(shim, watched, log=log)
    assert done.returncode == 0 and "taking over the stale lease" in done.stderr, done.stderr[-3000:]
    # (op, pattern): what differs from run to run (a temp file's random part, a process's id) as `*`
    writes = [(w.op, re.sub(r"[0-9a-f]{12,}", "*", w.pattern)) for w in observe.read_log(log, study="study")
              if w.writer == "driver"]
    # a claim, the compare-and-swap's lock, the dead lease removed, ours written; at release ours removed
    assert ("write", LEASE_FILE) in writes and ("delete", LEASE_FILE) in writes, writes
    assert any(CLAIM_INFIX in path for _, path in writes), writes
    windows, seen = [], Counter()
    for op, path in writes:  # every write, the n-th of the same (op, path) its own window
        seen[op, path] += 1
        windows.append(f"driver {op} {path}@{seen[op, path]}")

    fired = tmp_path / "fired"
    fired.mkdir()
    refused, litter = [], []
    for n, window in enumerate(windows):
        study = tmp_path / f"kill{n}" / "study"
        shutil.copytree(initial, study)
        killed = _take(shim, study, kill=window, fired=fired)
        assert isinstance(fired_write(killed, fired, window), tuple), (window, fired_write(killed, fired, window))
        marker(fired, window).unlink()
        after = _take(shim, study)  # `a2 study resume` right after the kill: the lease, no --force
        if after.returncode != 0:
            refused.append((window, after.stderr.strip().splitlines()[-1:]))
            continue
        assert "Traceback" not in after.stderr, (window, after.stderr[-3000:])
        left = sorted(p.name for p in study.iterdir() if p.name == LEASE_FILE or CLAIM_INFIX in p.name)
        if left:  # released: no lease, and no claim of the killed taker (nothing would ever read it again)
            litter.append((window, left))
    assert refused == [], refused
    assert litter == [], litter
    print(f"{len(windows)} take-over windows: {', '.join(windows)}")
