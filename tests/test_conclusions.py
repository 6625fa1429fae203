"""A study's conclusions from constructed trials: replicate groups with intervals in `a2 study status` and
summary.json, early-stopped trials shown as such and kept out of "best", the scheduler's record wired into the
MLflow callback."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from scipy import stats as sps

from dashboards.stats import stopped_early_tags
from dashboards.tracking import StudyTracker
from launch.spec import load_study
from launch.study import (StudyLocation, build_tuner, cmd_status, format_table, stopped_early_trials, summarize,
                          trial_row, verdict)

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
            row["stopped_early"] = {"rung": 2, "cutoff": 108.0} if (fusion, lam) in stopped else None
            rows.append(row)
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
        f"over 3 seeds; gate beats none by 4.0 CIDEr")
    table = format_table(rows, spec.metric)
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


def test_stopped_early_tags_come_back_from_mlflow(spec):
    tracker = StudyTracker(spec.tracking["mlflow_uri"], spec.name)
    tracker.start_study({}, {})
    for tid in ("t0", "t1"):
        run = tracker.trial_run(tid, {"model": {"fusion": "gate"}, "train": {"seed": 0}})
        if tid == "t1":
            tracker.set_tags(run, stopped_early_tags(2, 107.25))
        tracker.end_trial(run, "FINISHED")
    tracker.end_study("FINISHED")
    assert stopped_early_trials(spec) == {"t1": {"rung": 2, "cutoff": 107.25}}


def test_status_prints_groups_with_intervals(spec, tmp_path, monkeypatch, capsys):
    import launch.study as study

    location = StudyLocation(spec.name, spec.storage)
    rows = _rows(spec, location, {("none", None): [100.0, 101.0, 102.0], ("gate", 0.035): [104.0, 105.0, 106.0]})
    monkeypatch.setattr(study, "locate", lambda name, storage=None: location)
    monkeypatch.setattr(study, "load_saved_spec", lambda loc: spec)
    monkeypatch.setattr(study, "collect", lambda s, loc: rows)
    assert cmd_status(argparse.Namespace(name=spec.name, storage=None, json=False)) == 0
    out = capsys.readouterr().out
    assert "replicate groups" in out and "105.0 [102.5, 107.5]" in out and "101.0 [98.5, 103.5]" in out
    assert "gate beats none by 4.0 CIDEr" in out


def test_build_tuner_wires_the_schedulers_record_into_the_mlflow_callback(spec, monkeypatch):
    import launch.mlflow_callback as cb
    import ray.tune

    seen = {}

    class Capture(cb.A2MLflowCallback):
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cb, "A2MLflowCallback", Capture)
    monkeypatch.setattr(ray.tune, "Tuner", lambda *a, **kw: kw)
    kwargs = build_tuner(spec, StudyLocation(spec.name, spec.storage), verbose=False)
    scheduler = kwargs["tune_config"].scheduler
    assert seen["stopped_early_of"] == scheduler.stopped_early  # ReplicateASHA's record, bound to that scheduler


class _Trial:
    def __init__(self, trial_id, config):
        self.trial_id, self.config, self.status, self.last_result, self.num_failures = trial_id, config, "RUNNING", {}, 0

    def __str__(self):
        return f"fn_{self.trial_id}"


def test_best_epochs_per_image_cider_is_the_run_artifact_compare_reads(tmp_path, monkeypatch):
    """The MLflow callback logs the per-image CIDEr-D of a trial's best epoch (the validation result's
    PER_IMAGE_KEY) as eval/per_image_cider.json; `study_comparison` then pairs its arms over those images."""
    from mlflow.tracking import MlflowClient

    from a2core.train import PER_IMAGE_KEY
    from dashboards.compare import PER_IMAGE_ARTIFACT, study_comparison
    from launch.mlflow_callback import A2MLflowCallback

    monkeypatch.chdir(tmp_path)  # the experiment keeps its artifacts under ./mlruns
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    cb = A2MLflowCallback(uri, "pi", strict=True,
                          resolve_config=lambda c: {"model": {"fusion": c["fusion"]}, "train": {"seed": c["seed"]}})
    cb.setup()
    ids = list(range(10, 40))
    trials = [_Trial(f"{f}{s}", {"fusion": f, "seed": s}) for f in ("none", "gate") for s in range(3)]
    for t in trials:
        cb.on_trial_start(0, trials, t)
        lift = 5.0 if t.config["fusion"] == "gate" else 0.0
        for epoch, shift in ((1, -10.0), (2, 0.0), (3, -3.0)):  # epoch 2 is the best
            scores = [100.0 + lift + shift + (i % 7) + t.config["seed"] for i in ids]
            cb.on_trial_result(0, trials, t, {"epoch": epoch, "val/CIDEr": sum(scores) / len(scores),
                                              PER_IMAGE_KEY: {"ids": ids, "scores": scores}})
        cb.on_trial_complete(0, trials, t)
    client = MlflowClient(uri)
    saved = json.loads(open(client.download_artifacts(cb.trial_runs["gate1"], PER_IMAGE_ARTIFACT)).read())
    assert saved == {str(i): 106.0 + i % 7 for i in ids}  # the best epoch's, not the last one's
    assert "val/per_image_cider" not in client.get_run(cb.trial_runs["gate1"]).data.metrics
    comparison, _, _ = study_comparison(uri, "pi", by="fusion")
    diff = comparison.differences["gate"]
    assert diff.images == len(ids) and diff.delta == pytest.approx(5.0)
    assert diff.verdict().startswith("gate beats none by 5.0 CIDEr [") and diff.verdict().endswith(
        "3 seeds x 30 images")
    # `a2 pipeline` ends with these verdicts, then the ensemble's gain from the leaderboard
    from launch.pipeline import conclusion

    gain = "ensemble beats seed-1 by 4.2 CIDEr [2.0, 6.3], 1 seed x 30 images"
    assert conclusion(uri, "pi", {"ensemble_gain": {"verdict": gain}}) == [diff.verdict(), gain]
    assert conclusion(uri, "nope", {})[0].startswith("no comparison: ")


def test_the_group_verdict_rests_on_the_test_split_when_trials_reported_it(spec):
    """Groups are chosen on val (the study metric); their verdict is on the test scores each trial reported when it
    ended (its selected checkpoint), which here show no difference although val does."""
    location = StudyLocation(spec.name, spec.storage)
    rows = _rows(spec, location, {("none", None): [100.0, 101.0, 102.0], ("gate", 0.035): [104.0, 105.0, 106.0]})
    for row, test in zip(rows, [90.0, 95.0, 100.0, 91.0, 96.0, 99.0]):
        row["test"] = test
    summary = summarize(spec, location, rows)
    gate = next(g for g in summary["groups"] if g["fusion"] == "gate")
    assert gate["values"] == [104.0, 105.0, 106.0] and gate["test_values"] == [91.0, 96.0, 99.0]
    from dashboards.stats import seed_difference

    expect = seed_difference([91.0, 96.0, 99.0], [90.0, 95.0, 100.0], ("gate", "none"), metric="test CIDEr")
    line = verdict(summary).splitlines()[1]
    assert line.endswith("; " + expect.verdict()) and not expect.resolved and "+0.3 test CIDEr [" in line, line
