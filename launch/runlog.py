"""Where the INFO lines of Ray, Tune and MLflow go while a study or the main job runs: a log file, not the terminal.

A person watching `a2 study run` or `a2 pipeline` reads the project's own trial table, progress lines and
conclusions; "Started a local Ray instance", "Wrote the latest version of all result files", "Total run time",
"Creating initial MLflow database tables" and the like are kept in the log file (warnings and errors still reach
the terminal as well). Tune's per-result lines ("Trial ... reported ...", "... completed. Last result: ...") are
not logged at all: the driver runs Tune at verbosity 1 (`launch.driver.build_tuner`), which prints only our table.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator

import ray  # noqa: F401 (imported first: its loggers exist before `diverted` turns them down)

from dashboards.tracking import import_mlflow

# Loggers with their own terminal handlers (they do not propagate to the root logger): Ray's ("ray", configured
# when ray is imported, reached by ray.tune, ray.train, ...) and MLflow's ("mlflow", configured when it is imported).
LOGGERS = ("ray", "mlflow")
LOG_FILE = "driver.log"


class _FolderFileHandler(logging.Handler):
    """Appends each line to the log file, opening and closing it for every line: the file is never held open, so a
    study's storage can be unmounted or remounted read-only under it (an operator's, or a test's, fault), and a new
    study's folder need not exist before its first line (the folder is made then; a study refused before anything is
    logged leaves no file). A full, read-only or over-quota storage stops the study with one line (`launch.driver`):
    the log file failing there too stops logging quietly, without logging's "--- Logging error ---" traceback."""

    terminator = "\n"

    def __init__(self, path: Path):
        super().__init__()
        self.baseFilename = str(path)
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed:
            return
        try:
            line = self.format(record) + self.terminator
            Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
            with open(self.baseFilename, "a", encoding="utf-8") as log:
                log.write(line)
        except OSError:
            self.failed = True
        except Exception:  # a record that cannot be formatted: logging's own report, as for any handler
            self.handleError(record)


def log_path(study_uri: str, name: str) -> Path:
    """The study's log file: in the study's folder (`study_uri`) when its storage is local; for storage on S3 (a
    folder this process cannot append to), `~/.cache/a2tune/logs/NAME/driver.log` on the machine the driver runs on."""
    if "://" not in study_uri:
        return Path(study_uri) / LOG_FILE
    return Path(os.path.expanduser("~")) / ".cache" / "a2tune" / "logs" / name / LOG_FILE


def _without_traceback(terminal: logging.Handler, path: Path):
    """`terminal.format` while diverted: a record's traceback (Tune's "Trial task failed" for a trial whose worker
    was killed, which Tune retries) goes to the log file only; the terminal shows the record's own line and where its
    traceback is. The handler's method, not its formatter: `ray.init` sets the formatters of Ray's handlers anew."""
    def format(record: logging.LogRecord) -> str:
        if not (record.exc_info or record.exc_text or record.stack_info):
            return type(terminal).format(terminal, record)
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return f"{type(terminal).format(terminal, record)} (traceback in {path})"
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
    return format


@contextlib.contextmanager
def diverted(path: Path, loggers: tuple[str, ...] = LOGGERS) -> Iterator[Path]:
    """While inside: the INFO lines of `loggers` go to `path` (appended), their terminal handlers show WARNING and
    above only. Everything is put back on the way out (an in-process caller, a test, sees no lasting change)."""
    # Both imported first, so that their own handlers exist before they are turned down (a later import would add a
    # fresh terminal handler): ray at this module's top, mlflow here; every study imports them anyway.
    import_mlflow()

    handler = _FolderFileHandler(Path(path))
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved: dict[logging.Handler, int] = {}  # a handler shared by two loggers is saved (and put back) once
    for name in loggers:
        logger = logging.getLogger(name)
        for terminal in logger.handlers:
            if isinstance(terminal, logging.StreamHandler) and not isinstance(terminal, logging.FileHandler) \
                    and terminal not in saved:
                saved[terminal] = terminal.level
                terminal.setLevel(max(terminal.level, logging.WARNING))
                terminal.format = _without_traceback(terminal, Path(path))
        logger.addHandler(handler)
    try:
        yield Path(path)
    finally:
        for name in loggers:
            logging.getLogger(name).removeHandler(handler)
        handler.close()
        for terminal, level in saved.items():
            terminal.setLevel(level)
            vars(terminal).pop("format", None)
