"""`a2 data fetch` SIGKILLed right before each of its writes, the writes found by watching a real fetch, not chosen by
reading the code (tests/test_datastore_edges.py kills it at three points picked that way).

A fetch (`python -m launch.cli data fetch`, against moto's S3 server) runs once with tests/faults/fswrites.c loaded
(LD_PRELOAD, compiled by scripts/observe_writes.py's `build_shim`), `A2_FS_ROOT` the folder that holds the target:
every file it creates, renames or deletes there, and every folder it makes or removes, is logged. Two starting
states: a first fetch onto an empty node folder, and a fetch of a new version over the node's verified copy of the
old one (`pushed_twice`'s shape). Each distinct (op, path) of the log becomes a kill window (a glob, `_pattern`), in
the order the fetch made them; the fetch then runs again from the same starting state once per window, with
`A2_FS_KILL="driver OP GLOB"`: the shim SIGKILLs it right before the first such call (not made). Each time:

- it died of SIGKILL, at that write (the `A2_FS_FIRED` marker names the write, whose pattern is the window's);
- the target is a complete copy of the old version or the new one (full SHA-256 check against its manifest), or
  absent where there was none before (the swap is one renameat2(RENAME_EXCHANGE) call; only where this machine
  cannot swap in one call may a kill between its two renames leave none); its `.verified` stamp, when there, naming
  that copy (a stamp is what makes a later fetch download nothing); nothing else beside it is named as a copy a user
  would read (only hidden building folders);
- a plain fetch then succeeds with the new version, verified in full, and leaves only the target and its lock.

The windows are a glob each (`*` in fnmatch(3) crosses `/`): what differs from run to run is reduced, the way
scripts/observe_writes.py reduces a study's temp names. `_pattern`'s rules, each for one maker of names:
  1. `building_folder`'s `.NAME.HOST.pPID.XXXXXXXX.fetch|.old`          -> `.NAME.*.fetch|.old`
  2. storage.download's `tempfile.TemporaryDirectory(prefix=".FILE.")`  -> `.FILE.*`  (8 of [a-z0-9_])
  3. boto3's download temp file `FILE.XXXXXXXX` (8 hex digits)          -> `FILE.*`
Every other path is kept as it is. A pattern that still held a run's own name would differ between the two
starting states' runs: the shared part of their windows must be the same (asserted). The windows are the first write
of each (op, pattern): the first call of the killed run that matches its glob must be that write (the marker's path
reduces to the window's pattern: asserted), so a glob that also matched an earlier write would show.
Needs no Ray; a C compiler (cc or gcc), else skipped.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import time
from pathlib import Path

import pytest

from a2core.data import prepared
from a2core.errors import DataError
from launch import datastore
from tests.killwindows import (fired_write, needs_compiler, run_data, shim,  # noqa: F401 - shim is a fixture
                               SWAPS_IN_ONE_CALL, start, two_step_gap)
from tests.test_datastore_edges import LOCK, pushed_twice  # noqa: F401 - pushed_twice is a fixture

NAME = "features.a2feat"  # pushed_twice's target's name

pytestmark = [pytest.mark.slow, needs_compiler("the fetch")]


# -- the windows --------------------------------------------------------------------------------------------------
_TWO_STEP_GAP = two_step_gap(NAME)
_BUILDING = re.compile(rf"^\.{re.escape(NAME)}\.{re.escape(socket.gethostname())}\.p\d+\.[a-z0-9_]+\.(fetch|old)$")
_TEMP_DIR = re.compile(r"^(\.[^/]+)\.[a-z0-9_]{8}$")  # tempfile's names: 8 of [a-z0-9_]
_BOTO_TEMP = re.compile(r"^([^./][^/]*)\.[0-9A-Fa-f]{8}$")  # s3transfer's random_file_extension: 8 hex digits


def _pattern(path: str) -> str:
    """`path` (relative to the target's folder) with the names that differ from run to run as `*` (rules 1-3)."""
    parts = path.split("/")
    out = []
    for i, part in enumerate(parts):
        if i == 0 and _BUILDING.match(part):
            part = f".{NAME}.*.{_BUILDING.match(part).group(1)}"
        elif i > 0 and _TEMP_DIR.match(part):
            part = _TEMP_DIR.sub(r"\1.*", part)
        elif i > 0 and _BOTO_TEMP.match(part):
            part = _BOTO_TEMP.sub(r"\1.*", part)
        out.append(part)
    return "/".join(out)


def _windows(log: Path) -> list[tuple[str, str]]:
    """(op, glob) of each distinct write of the shim's log, first ones first; a rename's is its new path."""
    seen: dict[tuple[str, str], None] = {}
    for line in log.read_text().splitlines():
        pid, who, op, *paths = line.split("\t")
        assert who == "driver", line  # the fetch starts no process that writes
        if paths[-1]:  # "": the root itself (made by `_locked` when the node has no such folder; here it has)
            seen.setdefault((op, _pattern(paths[-1])), None)
    return list(seen)


# -- a fetch from a starting state ----------------------------------------------------------------------------------
def _fetch(shim: Path, uri: str, endpoint: str, target: Path, **shim_options):
    """`a2 data fetch URI TARGET` in a process of its own, the shim watching the target's folder."""
    return run_data(shim, ["fetch", uri, str(target), "--endpoint-url", endpoint], target, timeout=60, **shim_options)


def _kill_at(shim, uri, endpoint, state, work: Path, window: tuple[str, str]) -> tuple[Path, str | None]:
    """The fetch from `state` in `work`, SIGKILLed at `window`: (target, what went wrong or None)."""
    op, glob = window
    target, fired = start(state, work / "node", NAME), work / "fired"
    fired.mkdir()
    entry = f"driver {op} {glob}"
    where = fired_write(_fetch(shim, uri, endpoint, target, kill=entry, fired=fired), fired, entry)
    if isinstance(where, str):
        return target, where
    fired_op, fired_path = where
    if (fired_op, _pattern(fired_path)) != window:
        return target, f"killed at another write than the window's: {fired_op} {fired_path}"
    return target, None


def _copy_problem(target: Path, versions: dict[str, str]) -> str | None:
    """What is wrong with what a killed fetch left: None when `target` is absent or a whole copy of one of
    `versions` ({checksum: name}), its stamp (if any) naming it, and nothing else beside it but hidden folders."""
    beside = sorted(os.listdir(target.parent))
    shown = [name for name in beside if not name.startswith(".") and name != NAME]
    if shown:
        return f"beside the target: {shown}"
    for name in beside:  # a hidden building folder of the killed fetch: never a store's name
        if name.startswith(f".{NAME}.") and not name.endswith(".lock") and not _BUILDING.match(name):
            return f"a leftover that no fetch clears: {name}"
    if not os.path.lexists(target):
        return None
    try:
        manifest = prepared.check_copy(target, full=True)
    except DataError as err:
        return f"half-written copy at the target: {err}"
    if manifest["checksum"] not in versions:
        return f"a copy of neither version: {manifest['checksum']}"
    stamp = target / datastore.STAMP
    if stamp.exists() and stamp.read_text().strip() != manifest["checksum"]:
        return f"its stamp names {stamp.read_text().strip()}, the copy is {manifest['checksum']}"
    return None


def _sweep(shim, uri, endpoint, state: Path | None, work: Path, old: dict | None, new: dict) -> list[tuple[str, str]]:
    """Observe the fetch from `state`, then kill it in every window and fetch again; the windows."""
    target = start(state, work / "observed" / "node", NAME)
    log = work / "observed" / "writes.log"
    done = _fetch(shim, uri, endpoint, target, log=log)
    assert done.returncode == 0, done.stderr[-4000:]
    assert prepared.check_copy(target, full=True, expected=new["checksum"])
    windows = _windows(log)
    versions = {new["checksum"]: "new", **({old["checksum"]: "old"} if old else {})}

    # One fetch at a time under pytest-xdist: the suite's other worker runs the Ray group's studies beside this one
    # on a 2-core machine, and it is the suite's longest path.
    parallel = 1 if "PYTEST_XDIST_WORKER" in os.environ else 2
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        killed = list(pool.map(lambda iw: _kill_at(shim, uri, endpoint, state, work / f"w{iw[0]:02d}", iw[1]),
                               enumerate(windows)))
    problems = []
    for (op, glob), (target, wrong) in zip(windows, killed):
        where = f"killed before {op} {glob}"
        if wrong is not None:
            problems.append(f"{where}: {wrong}")
            continue
        if (bad := _copy_problem(target, versions)) is not None:
            problems.append(f"{where}: {bad}")
        if state is not None and not os.path.lexists(target) and (op, glob) not in _TWO_STEP_GAP:
            problems.append(f"{where}: the node's copy is gone")
        try:
            got = datastore.fetch(uri, target, endpoint_url=endpoint, quiet=True)
        except Exception as err:  # noqa: BLE001 - said with the window
            problems.append(f"{where}: the fetch after it failed: {type(err).__name__}: {err}")
            continue
        if got["checksum"] != new["checksum"]:
            problems.append(f"{where}: the fetch after it gave {got['checksum']}")
        try:
            prepared.check_copy(target, full=True, expected=new["checksum"])
        except DataError as err:
            problems.append(f"{where}: the fetch after it left a bad copy: {err}")
        if (left := sorted(os.listdir(target.parent))) != [LOCK, NAME]:
            problems.append(f"{where}: the fetch after it left {left}")
    assert problems == [], "\n".join(problems)
    return windows


def _observed(windows: list[tuple[str, str]]) -> str:
    return "\n  ".join(f"{op} {glob}" for op, glob in windows)


@pytest.mark.timeout(180)
def test_a_fetch_killed_before_each_of_its_writes_leaves_a_whole_copy_or_none(s3_endpoint, pushed_twice, tmp_path,
                                                                              shim):
    """Both starting states, every window: see the module's docstring."""
    started = time.monotonic()
    uri, target, v1, v2 = pushed_twice  # target: the node holding v1, verified; v2 pushed since
    state = target.parent
    first = _sweep(shim, uri, s3_endpoint, None, tmp_path / "empty", None, v2)
    over = _sweep(shim, uri, s3_endpoint, state, tmp_path / "over", v1, v2)

    old = f".{NAME}.*.old"
    fetch = f".{NAME}.*.fetch"
    # not vacuous: the download, the building folder's files and the swap were all seen and killed at
    for op, glob in (("write", LOCK), ("mkdir", fetch), ("write", f"{fetch}/manifest.json"),
                     ("write", f"{fetch}/{datastore.STAMP}"), ("rename", f"{fetch}/{prepared.ROWS}"),
                     ("rename", f"{fetch}/{prepared.INDEX}"), ("rename", NAME)):
        assert (op, glob) in first and (op, glob) in over, (op, glob, _observed(first), _observed(over))
    if SWAPS_IN_ONE_CALL:  # the old copy swapped out under the building folder's name in the one rename, then removed
        gone = fetch
        assert not any(glob.startswith(old) for _, glob in over), _observed(over)
    else:  # moved aside onto `.old` first
        gone = old
        assert over.index(("rename", old)) < over.index(("rename", NAME)), _observed(over)
    for op, glob in (("rmdir", gone), ("delete", f"{gone}/{prepared.ROWS}")):  # the old copy's
        assert (op, glob) in over and (op, glob) not in first, (op, glob, _observed(over))
    assert over.index(("rename", NAME)) < over.index(("rmdir", gone)), _observed(over)
    assert len(first) >= 12 and len(over) >= len(first) + 5, (_observed(first), _observed(over))
    # the runs' own names reduced: the first fetch's windows are the replacing one's, in the same order
    assert [w for w in over if w in first] == first, (_observed(first), _observed(over))
    print(f"\nfirst fetch, {len(first)} windows:\n  {_observed(first)}\nover the old version, {len(over)} windows:"
          f"\n  {_observed(over)}\n{len(first) + len(over)} kills in {time.monotonic() - started:.0f} s")
