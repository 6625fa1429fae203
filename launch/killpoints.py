"""Fault injection at points in the code: with `A2_KILL_AT=POINT` in the environment of `a2 study run`/`resume`, the
study's driver is SIGKILLed the first time the code passes `kill_point(POINT)`, as an OOM kill, a lost head node or
a spot preemption would, at a moment chosen exactly.

The kill-anywhere test (tests/test_kill_anywhere.py) kills a study right before each write of its files that a run
was seen to make (`scripts/observe_writes.py`, `tests/faults/kill_windows.txt`: found, not chosen); it uses these
points for what is no file of the study: `export-final` (MLflow's store) and `study-end` (the driver's last moment
holding the lease). The others stay for kills between a file write and the next step in memory.
`POINT@VALUE` only where the call passes that value (`kill_point("checkpoint-saved", epoch)` and
`A2_KILL_AT=checkpoint-saved@2`: at the second epoch's checkpoint). Without the variable each call is one
environment lookup, and the code path is the real one.

The points (where each call is):
- `study-file-written`: the driver, after `study.yaml` is written, before Tune starts (no Tune state exists).
- `checkpoint-saved`: a one-worker trial, after an epoch's checkpoint is in the trial's folder, before its result is
  logged and the checkpoints it no longer keeps are deleted; value: the epoch.
- `trial-result`: the driver, when Tune hands it a trial's result; value: the epoch.
- `export-final`: the driver's last MLflow export of a run, after the first trial's run is written, before the
  runs are ended.
- `study-end`: the driver, after the study's summary and MLflow export, before its lease is given back.

A trial process kills the driver (its pid rides in `A2_KILL_DRIVER_PID`, set by the driver, inherited by the local
Ray it starts and handed to workers with the job's environment) and then waits to be killed with the rest of the
study's processes, so that nothing after the point happens in it either.
"""
from __future__ import annotations

import os
import signal
import time

KILL_AT_ENV = "A2_KILL_AT"
DRIVER_PID_ENV = "A2_KILL_DRIVER_PID"


def arm_driver() -> None:
    """In the driver, before Ray starts: name this process as the one a trial's kill point kills."""
    if os.environ.get(KILL_AT_ENV):
        os.environ[DRIVER_PID_ENV] = str(os.getpid())


def kill_point(name: str, value: object = None) -> None:
    """SIGKILL the study's driver here when `A2_KILL_AT` names this point (see the module docstring)."""
    wanted = os.environ.get(KILL_AT_ENV)
    if not wanted or (wanted != name and wanted != f"{name}@{value}"):
        return
    driver = int(os.environ.get(DRIVER_PID_ENV) or os.getpid())
    print(f"a2 kill point {wanted}: SIGKILL to the driver (pid {driver})", flush=True)
    os.kill(driver, signal.SIGKILL)
    while True:  # a trial process: killed with the driver's local Ray; nothing after the point runs meanwhile
        time.sleep(60)
