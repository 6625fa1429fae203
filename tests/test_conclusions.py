"""A study's conclusions from constructed trials: replicate groups with intervals in `a2 study status` and
summary.json, early-stopped trials shown as such and kept out of "best", the scheduler's record wired into the
MLflow callback."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
from scipy import stats as sps

from launch.conclusions import format_table, verdict
from launch.driver import build_tuner
from launch.record import StudyRecord, summarize, trial_row
from launch.location import StudyLocation
from launch.spec import load_study
from launch.commands.show import cmd_status

SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"


@pytest.fixture
def spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return load_study(SMOKE, [f"tracking.mlflow_uri=sqlite:///{tmp_path / 'm.db'}", f"storage={tmp_path / 'st'}",
                              "name=concl"])


def _rows(spec, location, values: dict[tuple, list[float]], stopped: set = frozenset()) -> list[dict]:
    """Trial rows: per (fusion, lambda) one trial per seed whose best val CIDEr is the given value."""
    rows = []
    for (fusion, lam), seeds in values.items():
        for seed, value in enumerate(seeds):
            sampled = {"fusion": fusion, "seed": seed, **({} if lam is None else {"lambda": lam})}
            tid = f"{fusion}-{lam}-{seed}"
            epochs = 2 if (fusion, lam) in stopped else spec.total_epochs
            history = [{"epoch": e, spec.metric: value - (epochs - e)} for e in range(1, epochs + 1)]
            row = trial_row(spec, location, tid, sampled, "TERMINATED", history, history[-1])
            # the scheduler's record and the final value, as `launch.record.record_trial` completes the trial
            rows.append(replace(row, stopped_early={"rung": 2, "cutoff": 108.0} if (fusion, lam) in stopped else None,
                                final={spec.metric: value}))
    return rows


def test_summary_groups_replicates_with_intervals_and_keeps_stopped_ones_out_of_best(spec, tmp_path):
    location = StudyLocation(spec.name, spec.storage)
    values = {("none", None): [100.0, 101.0, 102.0], ("gate", 0.035): [104.0, 105.0, 106.0],
              ("gate", 0.2): [111.0, 90.0, 92.0]}  # its seed 0 is the best single trial, but it was stopped
    rows = _rows(spec, location, values, stopped={("gate", 0.2)})
    summary = summarize(spec, location, rows)
    assert summary["best"]["trial_id"] == "gate-0.035-2" and summary["best"]["stopped_early"] is None
    groups = {(g["fusion"], g["lambda"]): g for g in summary["groups"]}
    assert groups[("none", None)]["lambda"] is None  # the baseline has no lambda
    gate = groups[("gate", 0.035)]
    half = sps.t.ppf(0.975, 2) / 3 ** 0.5
    assert gate["n"] == 3 and gate["mean"] == 105.0 and gate["seeds"] == [0, 1, 2]
    assert gate["low"] == pytest.approx(105.0 - half) and gate["high"] == pytest.approx(105.0 + half)
    assert groups[("gate", 0.2)]["stopped_early"] == {"rung": 2, "cutoff": 108.0}
    assert summary["best_group"]["config_hash"] == gate["config_hash"]
    json.dumps(summary)  # summary.json holds it as it is

    text = verdict(summary)
    assert text.splitlines()[1].startswith(
        f"best configuration (fusion gate, lambda 0.035): val/CIDEr 105.0 [{105 - half:.1f}, {105 + half:.1f}] "
        f"over 3 seeds; gate beats none by 4.0 val CIDEr")
    table = format_table(rows, spec)
    assert table.count("stopped early (rung 2, cutoff 108.0)") == 3
    assert "TERMINATED" in table


def test_a_study_whose_every_trial_was_stopped_still_has_a_best(spec):
    location = StudyLocation(spec.name, spec.storage)
    rows = _rows(spec, location, {("gate", 0.1): [90.0], ("gate", 0.2): [95.0]},
                 stopped={("gate", 0.1), ("gate", 0.2)})
    summary = summarize(spec, location, rows)
    assert summary["best"]["trial_id"] == "gate-0.2-0" and summary["best"]["stopped_early"]
    assert summary["best_group"]["fusion"] == "gate" and summary["best_group"]["n"] == 1
    assert "best configuration" not in verdict(summary)  # one seed per configuration: no group line


def test_the_closing_lines_name_every_key_that_varies_between_configurations(tmp_path):
    """studies/mask_nets.yaml compares mask networks at one fusion and lambda: the lines name the mask network."""
    spec = load_study(SMOKE.with_name("mask_nets.yaml"), [f"tracking.mlflow_uri=sqlite:///{tmp_path / 'm.db'}",
                                                          f"storage={tmp_path / 'st'}"])
    location = StudyLocation(spec.name, spec.storage)
    rows = []
    for net, values in {"content": [100.0, 101.0, 102.0], "linear": [104.0, 105.0, 106.0]}.items():
        for seed, value in enumerate(values):
            history = [{"epoch": spec.total_epochs, spec.metric: value}]
            rows.append(trial_row(spec, location, f"{net}-{seed}", {"model.mask_net": net, "seed": seed},
                                  "TERMINATED", history, history[-1]))
    first, group = verdict(summarize(spec, location, rows)).splitlines()
    assert "(fusion gate, lambda 0.035, mask_net linear, seed 2)" in first
    assert group.startswith("best configuration (fusion gate, lambda 0.035, mask_net linear): val/CIDEr 105.0 [")


def test_status_prints_groups_with_intervals(spec, tmp_path, monkeypatch, capsys):
    import launch.commands.show as show

    location = StudyLocation(spec.name, spec.storage)
    rows = _rows(spec, location, {("none", None): [100.0, 101.0, 102.0], ("gate", 0.035): [104.0, 105.0, 106.0]})
    monkeypatch.setattr(show, "locate", lambda name, storage=None: location)
    monkeypatch.setattr(StudyRecord, "load", classmethod(lambda cls, loc, *a, **kw: StudyRecord(spec, loc, rows)))
    assert cmd_status(argparse.Namespace(name=spec.name, storage=None, json=False)) == 0
    out = capsys.readouterr().out
    assert "replicate groups" in out and "105.0 [102.5, 107.5]" in out and "101.0 [98.5, 103.5]" in out
    assert "gate beats none by 4.0 val CIDEr" in out


def test_build_tuner_wires_the_schedulers_record_into_the_mlflow_callback(spec, monkeypatch):
    import launch.driver as driver
    import launch.mlflow_callback as cb
    import ray.tune

    seen = {}

    class Capture(cb.A2MLflowCallback):
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(driver, "A2MLflowCallback", Capture)
    monkeypatch.setattr(ray.tune, "Tuner", lambda *a, **kw: kw)
    kwargs = build_tuner(spec, StudyLocation(spec.name, spec.storage), verbose=False)
    scheduler = kwargs["tune_config"].scheduler
    assert seen["stopped_early_of"] == scheduler.stopped_early  # ReplicateASHA's record, bound to that scheduler


def test_the_group_verdict_rests_on_the_test_split_when_trials_reported_it(spec):
    """Groups are chosen on val (the study metric); their verdict is on the test scores each trial reported when it
    ended (its selected checkpoint), which here show no difference although val does."""
    location = StudyLocation(spec.name, spec.storage)
    rows = _rows(spec, location, {("none", None): [100.0, 101.0, 102.0], ("gate", 0.035): [104.0, 105.0, 106.0]})
    rows = [replace(row, test=test, final={**row.final, "test/CIDEr": test})
            for row, test in zip(rows, [90.0, 95.0, 100.0, 91.0, 96.0, 99.0])]
    summary = summarize(spec, location, rows)
    gate = next(g for g in summary["groups"] if g["fusion"] == "gate")
    assert gate["values"] == [104.0, 105.0, 106.0] and gate["test_values"] == [91.0, 96.0, 99.0]
    from dashboards.stats import seed_difference

    expect = seed_difference([91.0, 96.0, 99.0], [90.0, 95.0, 100.0], ("gate", "none"), metric="test CIDEr")
    line = verdict(summary).splitlines()[1]
    assert line.endswith("; " + expect.verdict()) and not expect.resolved and "+0.3 test CIDEr [" in line, line


def test_the_trial_table_shows_every_searched_key_that_tells_cells_apart():
    """fusion_ablation searches fusion, model.renormalize (not for none) and temperature (exp_decay only): each is a
    column, "-" where it does not apply; the seed has its own column."""
    from dataclasses import replace as copy_with

    from dashboards.runs import Trial
    from launch.record import table_row

    spec = load_study(SMOKE.with_name("fusion_ablation.yaml"), ["storage=/tmp/unused"], check_files=False)
    sampled = [{"fusion": "none", "seed": 0}, {"fusion": "exp_decay", "model.renormalize": True,
                                                "temperature": 12000.0, "seed": 1}]
    rows = [copy_with(table_row(spec, Trial(f"t{i}", sampled=s), {"epoch": 1, "val/CIDEr": 50.0}, 50.0),
                      state="RUNNING") for i, s in enumerate(sampled)]
    header, _, none, exp_decay = format_table(rows, spec).splitlines()
    assert header.split()[:5] == ["trial", "fusion", "renormalize", "temperature", "seed"]
    assert none.split()[:5] == ["t0", "none", "-", "-", "0"]
    assert exp_decay.split()[:5] == ["t1", "exp_decay", "True", "12000", "1"]


@pytest.mark.parametrize("metric, test", [("val/CIDEr", "test/CIDEr"), ("best/val/CIDEr", "test/CIDEr"),
                                          ("val/BLEU-4", "test/BLEU-4")])
def test_a_val_metrics_test_counterpart_is_the_one_training_reports(metric, test):
    """What a trial's test score is read as (`launch.record`): a study searching on best/val/CIDEr has the same test
    score as one on val/CIDEr (a2core reports test/CIDEr), not a test/val/CIDEr that no trial reports."""
    from launch.conclusions import test_metric

    assert test_metric(metric) == test
