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
