"""What the tests that kill a command right before each of its observed writes share (tests/test_kill_anywhere.py
for a study's driver, tests/test_fetch_kill_windows.py and tests/test_data_kill_windows.py for the data commands):
scripts/observe_writes.py loaded once, the C compiler its library needs, the library itself, and one `a2 data`
command run under it and checked to have died at its window."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from a2core import atomic
from tests.repo_scripts import ROOT


def _load_observer():
    """scripts/observe_writes.py as a module (registered first: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("observe_writes", ROOT / "scripts" / "observe_writes.py")
    module = sys.modules.setdefault("observe_writes", importlib.util.module_from_spec(spec))
    if not hasattr(module, "STUDY"):
        spec.loader.exec_module(module)
    return module


observe = _load_observer()
COMPILER = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def needs_compiler(what: str):
    """Skip, saying why, where no C compiler can build the library that watches `what`'s writes."""
    return pytest.mark.skipif(COMPILER is None, reason=f"no C compiler (cc, gcc) to build tests/faults/fswrites.c, "
                                                       f"the LD_PRELOAD library that watches {what}'s writes")


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    """tests/faults/fswrites.c, built once a module."""
    return observe.build_shim(tmp_path_factory.mktemp("shim"))


def _swaps_in_one_call() -> bool:
    """Whether this machine's temp file system swaps two folders in one call (renameat2's RENAME_EXCHANGE)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a").mkdir()
        (Path(tmp) / "b").mkdir()
        return atomic._exchange(Path(tmp) / "a", Path(tmp) / "b")


SWAPS_IN_ONE_CALL = _swaps_in_one_call()


def two_step_gap(name: str) -> set[tuple[str, str]]:
    """The windows (op, pattern) in which a whole-folder replace of `name` may leave no `name` at all: only between
    the two renames of `atomic.replace_folder` where it cannot swap in one call (NFS, macOS); none here otherwise."""
    return set() if SWAPS_IN_ONE_CALL else {("rename", name)}


def marker(fired: Path, entry: str) -> Path:
    return fired / "".join("_" if c in "/ *" else c for c in entry)  # as fswrites.c names it


def start(state: Path | None, node: Path, name: str) -> Path:
    """`node` as a copy of `state` (a folder holding the old target), or empty; the target `name` in it."""
    if state is None:
        node.mkdir(parents=True)
    else:
        shutil.copytree(state, node, symlinks=True)
    return node / name


def run_data(shim: Path, args: list[str], target: Path, *, log: Path | None = None, kill: str | None = None,
             fired: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`a2 data ARGS` in a process of its own, the library watching the target's folder (logging to `log`, armed
    with the window `kill`)."""
    env = observe.shim_env({**os.environ, "PYTHONPATH": str(ROOT)}, shim, target.parent, log=log,
                           kill=[kill] if kill else [], fired=fired)
    return subprocess.run([sys.executable, "-m", "launch.cli", "data", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def fired_write(done: subprocess.CompletedProcess, fired: Path, entry: str) -> tuple[str, str] | str:
    """(op, path) of the write at which `done` was killed by the window `entry`, or what went wrong instead."""
    if done.returncode != -signal.SIGKILL:
        return f"exit {done.returncode}, not SIGKILL: {done.stderr[-2000:]}"
    if not marker(fired, entry).exists():
        return f"killed, but not by this window: {sorted(p.name for p in fired.iterdir())}"
    _, _, op, path = marker(fired, entry).read_text().rstrip("\n").split("\t")
    return op, path
