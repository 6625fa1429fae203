"""What a running study prints: the live trial table and the quiet per-epoch logs of its trials (no Ray started)."""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch.spec import load_study
from launch.driver import _reporter
from launch.trainable import _quiet_per_epoch_logs

SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"


def _trial(trial_id, status, config, epoch, value, best):
    return SimpleNamespace(trial_id=trial_id, status=status, config=config,
                           last_result={"epoch": epoch, "val/CIDEr": value},
                           metric_analysis={"val/CIDEr": {"max": best, "last": value}})


def test_live_table_shows_a_best_trial_without_a_conditional_key(capsys):
    """The fusion-none trial has no lambda; while it is the best trial the table shows "-" for its lambda (Tune's
    CLIReporter stopped the study with a KeyError there) and every trial's last and best value."""
    spec = load_study(SMOKE)
    reporter = _reporter(spec)
    baseline = _trial("t1", "RUNNING", {"fusion": "none", "seed": 0}, 2, 0.9, 0.95)
    gate = _trial("t2", "PENDING", {"fusion": "gate", "lambda": 0.035, "seed": 0}, 1, 0.5, 0.5)
    assert reporter.should_report([baseline, gate])
    reporter.report([baseline, gate], False)
    header, rule, *rows = capsys.readouterr().out.splitlines()
    assert header.split() == ["trial", "fusion", "lambda", "seed", "state", "epochs", "last", "CIDEr", "best", "CIDEr"]
    assert rows[0].split() == ["t1", "none", "-", "0", "RUNNING", f"2/{spec.total_epochs}", "0.9", "0.95"]
    assert rows[1].split() == ["t2", "gate", "0.035", "0", "PENDING", f"1/{spec.total_epochs}", "0.5", "0.5"]
    assert baseline.config == {"fusion": "none", "seed": 0}  # the trial itself is left alone
    assert not reporter.should_report([baseline, gate])  # at most every 30 s ...
    assert reporter.should_report([baseline, gate], done=True)  # ... and at the end


@pytest.fixture
def restore_log_levels():
    names = ["", "ray.train", "a2core"]
    levels = {n: logging.getLogger(n).level for n in names}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_trial_logs_keep_our_epoch_line_and_drop_ray_trains_per_report_lines(restore_log_levels):
    """Ray Train V2 logs each report through a logger named after its source file (not below "ray.train"), so it
    is quieted through the root logger; this pins that the loggers Ray reports through are quiet after the call."""
    from ray.train.v2._internal.execution import context, storage

    logging.getLogger().setLevel(logging.INFO)
    _quiet_per_epoch_logs()
    for name in (context.__file__, storage.__name__, "ray.train._internal.storage"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
        assert logging.getLogger(name).isEnabledFor(logging.WARNING), name
    assert logging.getLogger("a2core.train").isEnabledFor(logging.INFO)


def test_the_last_table_is_printed_once_though_tune_reports_it_twice_in_another_order(capsys):
    spec = load_study(SMOKE)
    reporter = _reporter(spec)
    a = _trial("t1", "TERMINATED", {"fusion": "none", "seed": 0}, 8, 0.9, 0.95)
    b = _trial("t2", "TERMINATED", {"fusion": "gate", "lambda": 0.035, "seed": 0}, 8, 0.5, 0.6)
    for trial in (a, b):  # 8 epochs in 80 s of wall time each (cumulative, as launch.trainable reports it)
        trial.last_result["compute/wall_s"] = 80.0
    reporter.report([a, b], True)
    reporter.report([b, a], True)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and out[2].split()[0] == "t1" and out[3].split()[0] == "t2"
    # 6 of the smoke study's 8 trials not started: 48 trial-epochs of 10 s, 2 side by side, early stopping on
    assert out[4] == ("progress: 16/64 trial-epochs (25%); 10 s a trial-epoch; about 4 min left at 2 trials at a "
                      "time (at most: early stopping may end trials sooner)")
    b.last_result = {"epoch": 8, "val/CIDEr": 0.7}  # a change is printed
    reporter.report([a, b], True)
    assert capsys.readouterr().out.splitlines()[3].split()[-2:] == ["0.7", "0.6"]


def test_ray_and_mlflow_info_lines_go_to_the_log_file_and_warnings_still_reach_the_terminal(tmp_path):
    import io

    import mlflow  # noqa: F401  (their own handlers exist, as when a study runs)
    import ray  # noqa: F401

    from launch import runlog

    path = runlog.log_path(str(tmp_path / "studies" / "s"), "s")
    assert path == tmp_path / "studies" / "s" / "driver.log"
    assert runlog.log_path("s3://bucket/studies/s", "s").parts[-4:] == ("a2tune", "logs", "s", "driver.log")
    # a terminal handler on each logger, as Ray and MLflow install theirs (whatever earlier tests left of theirs)
    terminal = io.StringIO()
    handler = logging.StreamHandler(terminal)
    loggers = [logging.getLogger(name) for name in runlog.LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    ray_log, mlflow_log = logging.getLogger("ray.tune.tune"), logging.getLogger("mlflow.store.db.utils")
    try:
        with runlog.diverted(path) as log:
            assert log == path and not path.exists()  # nothing logged yet: no file (a refused study leaves none)
            ray_log.info("Total run time: 1.00 seconds")
            mlflow_log.info("Creating initial MLflow database tables...")
            ray_log.warning("a trial failed")
        assert terminal.getvalue().splitlines() == ["a trial failed"]  # warnings still reach the terminal
        logged = path.read_text().splitlines()
        assert [line.split(": ", 1)[1] for line in logged] == [
            "Total run time: 1.00 seconds", "Creating initial MLflow database tables...", "a trial failed"]
        # everything is put back: after the study, INFO reaches the terminal as before and no more the file
        ray_log.info("after the study")
        assert terminal.getvalue().splitlines()[-1] == "after the study" and len(path.read_text().splitlines()) == 3
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)


def test_a_log_file_that_cannot_be_written_adds_no_traceback_to_the_terminal(tmp_path, capfd):
    """A study whose storage fills up or turns read-only stops with one line (tests/test_storage_full.py): the log
    file in that storage failing too must not print logging's "--- Logging error ---" traceback."""
    import logging

    from launch import runlog

    blocked = tmp_path / "study"
    blocked.write_text("a regular file where the log's folder would be: no file can be made below it")
    with runlog.diverted(blocked / runlog.LOG_FILE) as path:
        logging.getLogger("ray").info("Started a local Ray instance")
        logging.getLogger("ray").info("a second line, after the failure")
    assert not path.exists()
    captured = capfd.readouterr()
    assert "Logging error" not in captured.err + captured.out and "Traceback" not in captured.err + captured.out
