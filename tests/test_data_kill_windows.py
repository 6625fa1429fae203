"""`a2 data prepare` and `a2 data synth` SIGKILLed right before each of their writes, the writes found by watching a
real run, not chosen by reading the code (tests/test_fetch_kill_windows.py does the same for `a2 data fetch`).

Each command (`python -m launch.cli data prepare|synth`, tiny inputs) runs once with tests/faults/fswrites.c loaded
(LD_PRELOAD, compiled by scripts/observe_writes.py's `build_shim`), `A2_FS_ROOT` the folder that holds the target:
every file it creates, renames or deletes there, and every folder it makes or removes, is logged. Starting states:

- prepare onto an empty folder (the source HDF5 file lives outside it), and prepare over an existing store of other
  features: `prepare` refuses an existing `--out`, so that run must fail, write nothing (an empty log: no windows)
  and leave the old store whole;
- synth onto an empty folder, and synth over an existing synthetic set of another seed (`generate` replaces a folder
  holding `synthetic.json` whole).

Each distinct (op, path) of the log becomes a kill window (a glob, `_pattern`), in the order the run made them; the
command then runs again from the same starting state once per window, with `A2_FS_KILL="driver OP GLOB[@N]"`: the
shim SIGKILLs it right before that call (not made). Each time:

- it died of SIGKILL at that write (the `A2_FS_FIRED` marker names the write, whose pattern is the window's);
- the target is absent, or the old whole thing, or the new whole thing: a store passes `prepared.check_copy` at full
  depth (SHA-256 of every file) with the old or new checksum; a synthetic set is byte for byte a clean run's files
  (old seed or new; `generate` is byte-deterministic, .npz members included). Never absent over an old copy: the
  swap is one renameat2(RENAME_EXCHANGE) call (only where this machine cannot swap in one call may a kill between
  its two renames leave none). Beside it only hidden building folders of this host (`.NAME.HOST.pPID.XXXXXXXX.SUFFIX`,
  which the next run clears): nothing a user or a reader would take as a copy;
- a plain rerun (in this process) succeeds, gives the clean run's result, and leaves only the target in its folder.

The windows are globs (`*` in fnmatch(3) crosses `/`); `_pattern`'s rules, each for one maker of names:
  1. `building_folder`'s `.NAME.HOST.pPID.XXXXXXXX.prepare|.synth|.old` -> `.NAME.*.prepare|.synth|.old`
  2. `atomic_write`'s temp file `.FILE.XXXXXXXX.tmp` (mkstemp: 8 of [a-z0-9_]) -> `.FILE.*.tmp`
  3. synth's per-image files `features/<image id>.npz` (one loop line writes them all, and rmtree deletes them all
     alike) -> `features/*.npz`, swept at its first and its last call (`@N`, N = how many the observed run made):
     21 windows of the same line would only cost time.
Every other path is kept as it is. The windows are the first write of each (op, pattern) (and the last, rule 3):
the killed run's marker path must reduce to the window's pattern (asserted), so a glob that also matched an earlier
write would show. Needs no Ray; a C compiler (cc or gcc), else skipped. One command runs at a time.
"""
from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest

from a2core.data import features, prepared, synthetic
from a2core.errors import DataError
from tests.killwindows import (fired_write, needs_compiler, run_data, shim,  # noqa: F401 - shim is a fixture
                               SWAPS_IN_ONE_CALL, start, two_step_gap)

STORE = "features.a2feat"
SET = "synth"
IMAGES, TEST_IMAGES = 20, 1  # the smallest set `generate` makes: 21 images, 21 .npz files

pytestmark = [pytest.mark.slow, needs_compiler("the commands")]


# -- the windows --------------------------------------------------------------------------------------------------
def _building(name: str) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(name)}\.{re.escape(socket.gethostname())}\.p\d+\.[a-z0-9_]+"
                      rf"\.(prepare|synth|old)$")


_ATOMIC_TMP = re.compile(r"^(\.[^/]+)\.[a-z0-9_]{8}\.tmp$")  # atomic_write's mkstemp name
_IMAGE_FILE = re.compile(r"^\d+\.npz$")  # synth's features/<image id>.npz


def _pattern(name: str, path: str) -> tuple[str, bool]:
    """`path` (relative to the target's folder) with the names that differ from run to run as `*` (rules 1-3), and
    whether it is a per-image file (rule 3)."""
    parts, per_image = path.split("/"), False
    out = []
    for i, part in enumerate(parts):
        if i == 0 and (m := _building(name).match(part)):
            part = f".{name}.*.{m.group(1)}"
        elif i > 0 and _ATOMIC_TMP.match(part):
            part = _ATOMIC_TMP.sub(r"\1.*.tmp", part)
        elif i > 0 and parts[i - 1] == "features" and _IMAGE_FILE.match(part):
            part, per_image = "*.npz", True
        out.append(part)
    return "/".join(out), per_image


def _windows(log: Path, name: str) -> list[tuple[str, str, int]]:
    """(op, glob, N) of the log's distinct writes, in the order made: the first call of each (op, pattern), and for
    per-image files also the last (N: its count); a rename's path is its new one."""
    first: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], tuple[int, int]] = {}  # per-image: (position, count)
    lines = log.read_text().splitlines() if log.exists() else []
    for at, line in enumerate(lines):
        pid, who, op, *paths = line.split("\t")
        assert who == "driver", line  # neither command starts a process that writes
        glob, per_image = _pattern(name, paths[-1])
        first.setdefault((op, glob), at)
        if per_image:
            last[(op, glob)] = (at, last.get((op, glob), (0, 0))[1] + 1)
    found = [(at, (op, glob, 1)) for (op, glob), at in first.items()]
    found += [(at, (op, glob, n)) for (op, glob), (at, n) in last.items() if n > 1]
    return [w for _, w in sorted(found)]


def _entry(window: tuple[str, str, int]) -> str:
    op, glob, n = window
    return f"driver {op} {glob}" + (f"@{n}" if n > 1 else "")


def _observed(windows) -> str:
    return "\n  ".join(_entry(w)[len("driver "):] for w in windows)


# -- a run from a starting state ------------------------------------------------------------------------------------
def _kill_at(shim, make_args, target: Path, fired: Path, name: str, window) -> str | None:
    """The command SIGKILLed at `window`: None, or what went wrong."""
    fired.mkdir()
    entry = _entry(window)
    where = fired_write(run_data(shim, make_args(target), target, kill=entry, fired=fired), fired, entry)
    if isinstance(where, str):
        return where
    fired_op, fired_path = where
    if (fired_op, _pattern(name, fired_path)[0]) != window[:2]:
        return f"killed at another write than the window's: {fired_op} {fired_path}"
    return None


def _beside_problem(target: Path) -> str | None:
    """Anything beside `target` but this host's hidden building folders (which the next run clears)."""
    for other in sorted(os.listdir(target.parent)):
        if other == target.name:
            continue
        if not other.startswith("."):
            return f"beside the target: {other}"
        if not _building(target.name).match(other):
            return f"a leftover that no run clears: {other}"
    return None


def _tree(path: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None) below `path`, by relative path."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        rel = Path(dirpath).relative_to(path)
        for d in dirnames:
            out[str(rel / d)] = None
        for f in filenames:
            out[str(rel / f)] = (Path(dirpath) / f).read_bytes()
    return out


def _sweep(shim, make_args, name: str, state: Path | None, work: Path, whole, rerun) -> list[tuple[str, str, int]]:
    """Observe the command from `state`, then kill it in every window and rerun it; the windows.
    whole(target) -> "old"/"new" or a problem string (target present); rerun(target) -> problem or None."""
    target = start(state, work / "observed" / "node", name)
    log = work / "observed" / "writes.log"
    done = run_data(shim, make_args(target), target, log=log)
    assert done.returncode == 0, done.stderr[-4000:]
    assert whole(target) == "new"
    assert sorted(os.listdir(target.parent)) == [name]
    windows = _windows(log, name)
    problems = []
    for i, window in enumerate(windows):
        where = f"killed before {_entry(window)[len('driver '):]}"
        target = start(state, work / f"w{i:02d}" / "node", name)
        if (wrong := _kill_at(shim, make_args, target, work / f"w{i:02d}" / "fired", name, window)) is not None:
            problems.append(f"{where}: {wrong}")
            continue
        if (bad := _beside_problem(target)) is not None:
            problems.append(f"{where}: {bad}")
        if os.path.lexists(target):
            if (got := whole(target)) not in ("old", "new") or (got == "old" and state is None):
                problems.append(f"{where}: at the target: {got}")
        elif state is not None and window[:2] not in two_step_gap(name):
            problems.append(f"{where}: the old copy is gone")
        if (bad := rerun(target)) is not None:
            problems.append(f"{where}: {bad}")
        elif (left := sorted(os.listdir(target.parent))) != [name]:
            problems.append(f"{where}: the rerun left {left}")
    assert problems == [], "\n".join(problems)
    return windows


# -- prepare --------------------------------------------------------------------------------------------------------
def test_a_prepare_killed_before_each_of_its_writes_leaves_a_whole_store_or_none(shim, tmp_path):
    started = time.monotonic()
    src = synthetic.generate(tmp_path / "src-new", seed=0, images=IMAGES, test_images=TEST_IMAGES)
    other = synthetic.generate(tmp_path / "src-old", seed=1, images=IMAGES, test_images=TEST_IMAGES)
    new = features.prepare(src["features"], tmp_path / "clean" / STORE)["checksum"]
    old_state = tmp_path / "old-state"
    old = features.prepare(other["features_dir"], old_state / STORE)["checksum"]  # the .npz layout
    assert old != new
    args = ["prepare", str(src["features"]), "--out"]

    def whole(target: Path) -> str:
        try:
            manifest = prepared.check_copy(target, full=True)
        except DataError as err:
            return f"a half-written store: {err}"
        return {new: "new", old: "old"}.get(manifest["checksum"], f"a store of neither: {manifest['checksum']}")

    def rerun(target: Path) -> str | None:
        try:
            got = features.prepare(src["features"], target)["checksum"]
            prepared.check_copy(target, full=True, expected=new)
        except Exception as err:  # noqa: BLE001 - said with the window
            return f"the rerun failed: {type(err).__name__}: {err}"
        return None if got == new else f"the rerun gave {got}"

    first = _sweep(shim, lambda target: args + [str(target)], STORE, None, tmp_path / "empty", whole, rerun)

    building = f".{STORE}.*.prepare"
    for op, glob in (("mkdir", building), ("write", f"{building}/{prepared.ROWS}"),
                     ("write", f"{building}/{prepared.INDEX}"), ("write", f"{building}/.{prepared.MANIFEST}.*.tmp"),
                     ("rename", f"{building}/{prepared.MANIFEST}"), ("rename", STORE)):
        assert (op, glob, 1) in first, (op, glob, _observed(first))
    assert first[-1] == ("rename", STORE, 1), _observed(first)  # the folder appears last, at once
    assert first.index(("write", f"{building}/{prepared.ROWS}", 1)) \
        < first.index(("rename", f"{building}/{prepared.MANIFEST}", 1)), _observed(first)  # the manifest after

    # over an existing store of other features: refused, nothing written, the old store whole
    target = start(old_state, tmp_path / "over" / "node", STORE)
    log = tmp_path / "over" / "writes.log"
    done = run_data(shim, ["prepare", str(src["features"]), "--out", str(target)], target, log=log)
    assert done.returncode != 0 and "exists already" in done.stderr, (done.returncode, done.stderr[-2000:])
    assert _windows(log, STORE) == [], log.read_text()
    assert whole(target) == "old" and os.listdir(target.parent) == [STORE]
    print(f"\nprepare onto an empty folder, {len(first)} windows:\n  {_observed(first)}\nprepare over a store: "
          f"refused, no writes\n{len(first)} kills in {time.monotonic() - started:.0f} s")


# -- synth ----------------------------------------------------------------------------------------------------------
def test_a_synth_killed_before_each_of_its_writes_leaves_a_whole_set_or_none(shim, tmp_path):
    started = time.monotonic()
    new = _tree(synthetic.generate(tmp_path / "clean-new" / SET, seed=0, images=IMAGES,
                                   test_images=TEST_IMAGES)["root"])
    old_state = tmp_path / "old-state"
    old = _tree(synthetic.generate(old_state / SET, seed=1, images=IMAGES, test_images=TEST_IMAGES)["root"])
    assert old != new and "synthetic.json" in new and f"features{os.sep}100000.npz" in new
    args = ["synth", "--seed", "0", "--images", str(IMAGES), "--test-images", str(TEST_IMAGES), "--out"]

    def whole(target: Path) -> str:
        got = _tree(target)
        if got == new:
            return "new"
        if got == old:
            return "old"
        return f"a set that is neither whole one: {sorted(got)[:8]}..."

    def rerun(target: Path) -> str | None:
        try:
            synthetic.generate(target, seed=0, images=IMAGES, test_images=TEST_IMAGES)
        except Exception as err:  # noqa: BLE001 - said with the window
            return f"the rerun failed: {type(err).__name__}: {err}"
        return None if _tree(target) == new else "the rerun's set differs from a clean run's"

    first, over = (_sweep(shim, lambda target: args + [str(target)], SET, state, tmp_path / case, whole, rerun)
                   for case, state in (("empty", None), ("over", old_state)))

    building, old_folder = f".{SET}.*.synth", f".{SET}.*.old"
    for op, glob, n in (("mkdir", building, 1), ("mkdir", f"{building}/features", 1),
                        ("write", f"{building}/features.h5", 1), ("write", f"{building}/features/*.npz", 1),
                        ("write", f"{building}/features/*.npz", IMAGES + TEST_IMAGES),
                        ("write", f"{building}/dataset_coco.json", 1), ("write", f"{building}/grounding.json", 1),
                        ("write", f"{building}/synthetic.json", 1), ("rename", SET, 1)):
        assert (op, glob, n) in first and (op, glob, n) in over, (op, glob, n, _observed(first), _observed(over))
    assert first[-1] == ("rename", SET, 1), _observed(first)  # the set appears last, at once
    if SWAPS_IN_ONE_CALL:  # the old set swapped out under the building folder's name in the one rename, then removed
        gone = building
        assert not any(glob.startswith(old_folder) for _, glob, _ in over), _observed(over)
    else:  # moved aside onto `.old` first
        gone = old_folder
        assert over.index(("rename", old_folder, 1)) < over.index(("rename", SET, 1)), _observed(over)
    for window in (("rmdir", gone, 1), ("delete", f"{gone}/features/*.npz", 1),  # the old set's, removed
                   ("delete", f"{gone}/features/*.npz", IMAGES + TEST_IMAGES)):
        assert window in over and window not in first, (window, _observed(over))
    assert over.index(("rename", SET, 1)) < over.index(("rmdir", gone, 1)), _observed(over)
    assert [w for w in over if w in first] == first, (_observed(first), _observed(over))  # names reduced alike
    print(f"\nsynth onto an empty folder, {len(first)} windows:\n  {_observed(first)}\nover another seed's set, "
          f"{len(over)} windows:\n  {_observed(over)}\n{len(first) + len(over)} kills in "
          f"{time.monotonic() - started:.0f} s")
