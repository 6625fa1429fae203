"""The kill windows of a study, found by watching one run: every file the driver, Tune and a trial create, rename or
delete in the study's folder, reduced to the writes that change the study's state, one window before each
(tests/faults/kill_windows.txt, which tests/test_kill_anywhere.py kills a study at, window by window).

    python scripts/observe_writes.py           # run the tiny study, write tests/faults/kill_windows.txt
    python scripts/observe_writes.py --check   # exit 1 when the observed windows differ from the file's

The writes are seen from inside every process of the study by a small C library loaded with LD_PRELOAD
(tests/faults/fswrites.c, compiled here with the system's C compiler): it wraps the C library's open-for-writing,
rename, unlink, mkdir and rmdir, through which Python's file calls and pyarrow's C++ ones (Tune's experiment state,
`tuner.pkl`) both go. The same library kills the study at a window in the test (`A2_FS_KILL`): the window is hit
exactly, in the process that makes the write, before the call.

A write changes the study's state unless it is one of `NOT_STATE` (each with why): a log, Tune's storage probe, a
temp file or a staging folder whose rename is the write, an empty folder, Tune's logger files that nothing reads
back, a whole copy of one of Tune's files, the lease's heartbeat. Paths are reduced to patterns (trial ids, Tune's
time stamps and temp names as `*`; epoch numbers kept), and the windows are the first write of each pattern by each
writer (`driver` or `trial`), in the order the run made them. A new write is thereby a new window: the test that
compares a run's windows with the file fails until this script is run again and the test kills the study there.

Every command that can start Ray runs under the shared lock when there is one: `flock /tmp/a2-ray.lock python
scripts/observe_writes.py`.
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIM_SOURCE = ROOT / "tests" / "faults" / "fswrites.c"
WINDOWS_FILE = ROOT / "tests" / "faults" / "kill_windows.txt"
STUDY = "kill-anywhere"  # the study the windows are observed on (tests/test_kill_anywhere.py's)

# Writes that change nothing a reader or a resume takes from the study's folder: (writer, op, glob, why).
NOT_STATE = (
    ("*", "*", "driver.log", "the driver's log of Ray's, Tune's and MLflow's lines"),
    ("*", "*", ".validate_storage_marker", "Tune's probe that the storage can be written"),
    ("*", "write", "*.tmp", "a temp file: its rename is the write (`atomic_write`)"),
    ("*", "*", "*.partial*", "a checkpoint's staging folder: its rename is the write"),
    ("*", "mkdir", "*", "an empty folder: no reader takes one for state; the first write into it is a window"),
    ("*", "*", "a2_local_trial_*/params.*", "Tune's logger files: nothing reads them back (the record is "
                                            "trials/*/results.json, Tune's state its experiment state)"),
    ("*", "*", "a2_local_trial_*/progress.csv", "Tune's logger file, as params.*"),
    ("*", "*", "a2_local_trial_*/result.json", "Tune's logger file, as params.*"),
    ("*", "*", "state-copies/*", "whole copies of Tune's files, read only when one of them is unreadable "
                                 "(`resume --restore-state`); each is written whole (temp file, rename)"),
    ("driver", "rename", "lease.json", "the lease's heartbeat: the same holder, a newer time"),
    ("trial", "rename", "trials/*/progress.json", "where a running trial is within its epoch, for `a2 study status` "
                                                  "alone: no resume reads it (`launch.layout.progress_record`)"),
)

_STAMP = re.compile(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d")  # Tune's time stamps: experiment_state-2026-12-02_03-18-30
_TUNE_TRIAL = re.compile(r"a2_local_trial_[^/]*")  # Tune's trial folder: a2_local_trial_<id>_<n>_<params>_<stamp>
_TEMP = re.compile(r"(/|^)\.([^/]+)\.[^./]+\.tmp$")  # atomic_write's temp file: .summary.json.k3j2h1g0.tmp


@dataclass(frozen=True)
class Write:
    pid: int
    writer: str  # "driver", "trial" (a trial's process), or the process's title
    op: str  # write, rename, delete, mkdir, rmdir
    path: str  # relative to the study's folder; a rename's new path
    pattern: str


@dataclass(frozen=True, order=True)
class Window:
    """A kill window: right before the first `op` of a path matching `pattern` by `writer`."""
    writer: str
    op: str
    pattern: str

    def line(self) -> str:
        return f"{self.writer} {self.op} {self.pattern}"

    @classmethod
    def parse(cls, line: str) -> "Window":
        writer, op, pattern = line.split(" ", 2)
        return cls(writer, op, pattern)


def pattern_of(path: str, study: str = STUDY) -> str:
    """`path` with what differs from run to run as `*`: trial ids, Tune's folders and time stamps, temp names."""
    path = _TUNE_TRIAL.sub("a2_local_trial_*", path)
    path = re.sub(rf"(^|/)trials/{re.escape(study)}-[0-9a-f]+", r"\1trials/*", path)
    path = _STAMP.sub("*", path)
    return _TEMP.sub(r"\1.\2.*.tmp", path)


def writer_of(title: str) -> str:
    """`driver`, `trial` (a Ray worker process: the study's only ones that write in its folder are its trials',
    titled by Ray `ray::ImplicitFunc.train` and the like), or the process's title."""
    if title == "driver":
        return "driver"
    return "trial" if title.startswith("ray::") else title


def read_log(path: Path, study: str = STUDY) -> list[Write]:
    """The shim's log (`A2_FS_LOG`), one Write a line, in the order they were made."""
    writes = []
    for line in path.read_text().splitlines():
        pid, title, op, *paths = line.split("\t")
        target = paths[-1]  # a rename's new path
        writes.append(Write(int(pid), writer_of(title), op, target, pattern_of(target, study)))
    return writes


def not_state(write: Write) -> str | None:
    """Why `write` changes nothing of the study's state, or None when it does."""
    for writer, op, glob, why in NOT_STATE:
        if fnmatch.fnmatch(write.writer, writer) and fnmatch.fnmatch(write.op, op) and \
                fnmatch.fnmatch(write.pattern, glob):
            return why
    return None


def kill_windows(writes: list[Write]) -> list[Window]:
    """One window before the first write of each (writer, op, pattern) that changes the study's state, in order."""
    seen: dict[Window, None] = {}
    for write in writes:
        if write.path and not_state(write) is None:
            seen.setdefault(Window(write.writer, write.op, write.pattern), None)
    return list(seen)


def read_windows(path: Path = WINDOWS_FILE) -> list[Window]:
    return [Window.parse(line) for line in path.read_text().splitlines() if line and not line.startswith("#")]


def write_windows(windows: list[Window], path: Path = WINDOWS_FILE) -> None:
    header = ("# The kill windows of the kill-anywhere study, observed by scripts/observe_writes.py (do not edit: run\n"
              "# it again). One a line: WRITER OP PATTERN, a kill right before the first such write of the run.\n")
    path.write_text(header + "".join(w.line() + "\n" for w in windows))


# -- the shim and a run under it ---------------------------------------------------------------------------------
def build_shim(folder: Path) -> Path:
    """tests/faults/fswrites.c compiled into `folder`; RuntimeError naming the missing compiler or its error."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc) to build tests/faults/fswrites.c: install gcc "
                           "(scripts/setup.sh does)")
    library = Path(folder) / "fswrites.so"
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(SHIM_SOURCE), "-ldl"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} could not build {SHIM_SOURCE}: {done.stderr.strip()[-2000:]}")
    return library


def shim_env(env: dict, library: Path, study_folder: Path, *, log: Path | None = None, kill: list[str] = (),
             fired: Path | None = None) -> dict:
    """`env` with the shim loaded into the study's every process, watching `study_folder`."""
    env = dict(env)
    for key in ("A2_FS_LOG", "A2_FS_KILL", "A2_FS_FIRED", "A2_FS_DRIVER_PID"):
        env.pop(key, None)
    env["LD_PRELOAD"] = str(library)
    env["A2_FS_ROOT"] = str(Path(study_folder).absolute())
    if log is not None:
        env["A2_FS_LOG"] = str(log)
    if kill:
        env["A2_FS_KILL"] = ";".join(kill)
        env["A2_FS_FIRED"] = str(fired)
    return env


def observe(workdir: Path) -> list[Write]:
    """Run the kill-anywhere study once, to its end, under the shim; its writes. Ray starts here: hold the lock."""
    sys.path.insert(0, str(ROOT))
    from a2core.data.synthetic import ensure
    from tests.raycluster import DATA_IMAGES, a2_command, a2_env, tiny_study

    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "data"
    ensure(data, seed=0, images=DATA_IMAGES)
    study = study_file(workdir, data, tiny_study)
    log = workdir / "writes.log"
    env = a2_env({k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, TMPDIR=str(workdir),
                 RAY_TMPDIR="/tmp")
    env = shim_env(env, build_shim(workdir), workdir / "studies" / STUDY, log=log)
    done = subprocess.run(a2_command("study", "run", str(study)), cwd=workdir, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the observed study failed (exit {done.returncode}):\n{done.stdout[-4000:]}")
    return read_log(log)


def study_file(directory: Path, data: Path, tiny_study) -> Path:
    """The kill-anywhere study: 2 configurations x 1 seed, 2 epochs, one one-worker trial at a time."""
    return tiny_study(directory, STUDY, data, fusions=("none", "max"), epochs=2, workers=1, cpus_per_worker=1,
                      max_concurrent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="a2-observe-") as work:
        windows = kill_windows(observe(Path(work)))
    if args.check:
        wanted = read_windows()
        if set(windows) != set(wanted):
            print(f"{WINDOWS_FILE}: differs from the observed windows: new {sorted(set(windows) - set(wanted))}, "
                  f"gone {sorted(set(wanted) - set(windows))}")
            return 1
        print(f"{len(windows)} windows, as {WINDOWS_FILE} has them")
        return 0
    write_windows(windows)
    print(f"{len(windows)} windows written to {WINDOWS_FILE}")
    for window in windows:
        print(f"  {window.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
