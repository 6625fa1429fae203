"""A study driver's stop on SIGINT (Ctrl-C) or SIGTERM (a scheduler's or a spot node's stop): both end the study
the same clean way. The first signal asks Tune to stop through its own stop signal, SIGUSR1 (the trials are stopped,
the experiment state saved one last time, the callbacks' `on_experiment_end` marks the open MLflow runs KILLED);
the driver then writes the summary, releases the lease and says how to continue. A second signal ends the driver at
once (the lease is still released on the way out).

Without this, Ray's own SIGTERM handler (installed by `ray.init`) aborts the driver with a stack dump, and Tune's
SIGINT handler ends with "Resume experiment with: Tuner.restore(...)", a line for Ray users, not a2's.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Tune's lines about its own interruption: replaced by a2's one line (`launch.driver.fit_and_finish`).
_TUNE_INTERRUPT_LINES = ("Stop signal received", "Experiment has been interrupted", "Trials did not complete")

_received: int | None = None


def received() -> int | None:
    """The stop signal this driver received (a number), or None."""
    return _received


def signal_name(number: int) -> str:
    return signal.Signals(number).name


def exit_status(number: int) -> int:
    """The shell's exit status of a process ended by signal `number` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(number)


class _DropTuneInterruptLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_received is not None and str(record.msg).startswith(_TUNE_INTERRUPT_LINES))


def _before_tune(number, frame) -> None:
    pass


@contextmanager
def stop_on_signals():
    """While inside (in the main thread, after `ray.init`): SIGINT and SIGTERM stop the study cleanly, as above."""
    global _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received = None
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # Tune's SIGUSR1 handler stays: the way in

    def handle(number, frame):
        global _received
        if _received is None:
            _received = number
            if signal.getsignal(signal.SIGUSR1) is not _before_tune:  # Tune runs: its own stop signal stops it
                print(f"a2: {signal_name(number)} received: stopping the study (trials stop, their state is saved); "
                      f"send it again to stop at once", flush=True)
                os.kill(os.getpid(), signal.SIGUSR1)
                return
        # a second signal, or Tune has not started (nothing to stop but us): stop now
        raise KeyboardInterrupt if number == signal.SIGINT else SystemExit(exit_status(number))

    # Tune installs its SIGUSR1 handler when its loop starts; until then SIGUSR1 must not end the process.
    previous = {number: signal.signal(number, handler)
                for number, handler in [*((n, handle) for n in STOP_SIGNALS), (signal.SIGUSR1, _before_tune)]}
    tune_logger = logging.getLogger("ray.tune.tune")
    quiet = _DropTuneInterruptLines()
    tune_logger.addFilter(quiet)
    try:
        yield
    finally:
        tune_logger.removeFilter(quiet)
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
