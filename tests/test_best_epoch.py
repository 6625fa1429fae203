"""One rule for the best epoch (`a2core.selection`): the best finite value in the study's mode, the latest of equal
values. Every view of one study names the same epoch: the record's row, its best stored checkpoint, the dashboards'
run (reports, comparisons), the MLflow export's best-checkpoint tag, checkpoint retention and training's best.pt."""
from __future__ import annotations

import json
import math

import pytest

from a2core.selection import best_epoch, improves, rank
from dashboards.tracking import TAG_BEST_CKPT, study_runs
from launch.layout import CHECKPOINT_FILE, TRIALS_DIR, checkpoint_name, train_run_name
from tests.studyfolder import fabricated_study


def test_the_rule():
    assert best_epoch({1: 50.0, 2: 70.0, 3: 70.0, 4: 60.0}) == 3  # the latest of equals
    assert best_epoch({1: 5.0, 2: 3.0, 3: 3.0, 4: 4.0}, "min") == 3
    assert best_epoch({1: 5.0, 2: math.nan, 3: None, 4: math.inf}) == 1  # only finite values count
    assert best_epoch({}) is None and best_epoch({1: math.nan}) is None
    assert improves(70.0, 70.0) and not improves(69.0, 70.0) and improves(1.0, None) and improves(1.0, -math.inf)
    assert improves(3.0, 3.0, "min") and not improves(4.0, 3.0, "min") and not improves(math.nan, 1.0)
    assert sorted([(1, 3.0), (2, 2.0), (3, 2.0)], key=lambda ev: rank(ev[1], ev[0], "min"))[-1] == (3, 2.0)


@pytest.mark.parametrize("mode, metric, values", [("max", "val/CIDEr", [50.0, 70.0, 70.0, 60.0]),
                                                  ("min", "train/loss", [5.0, 3.0, 3.0, 4.0])])
@pytest.mark.slow
def test_every_view_names_the_same_epoch(tmp_path, mode, metric, values):
    overrides = () if mode == "max" else (f"search.metric={metric}", "search.mode=min")
    fab = fabricated_study(tmp_path, f"tie-{mode}", epochs=4, overrides=overrides)
    metric = fab.spec.metric
    run = fab.location.at(TRIALS_DIR, train_run_name(fab.spec.name, "t0"))
    results = []
    for epoch, value in enumerate(values, 1):
        run.join(checkpoint_name(epoch), CHECKPOINT_FILE).write_text("not read here")
        results.append({"epoch": epoch, metric: value, "val/CIDEr": value if mode == "max" else 80.0 - value,
                        "checkpoint_path": run.join(checkpoint_name(epoch)).uri})
    fab.add("t0", {"fusion": "none", "seed": 0}, results)
    record = fab.record()
    [row] = record.trials
    assert row["best_epoch"] == 3 and row["best_checkpoint_epoch"] == 3
    assert row["best_checkpoint"].endswith(f"{checkpoint_name(3)}/{CHECKPOINT_FILE}")
    [summary_run] = record.study().runs  # reports and comparisons read this (best by val CIDEr, max)
    assert summary_run.best_step == 3
    fab.export()
    _, [child] = study_runs(fab.spec.tracking.mlflow_uri, fab.spec.name)
    assert child.data.tags[TAG_BEST_CKPT].endswith(f"{checkpoint_name(3)}/{CHECKPOINT_FILE}")
    assert json.loads(json.dumps(record.summary()))["best"]["epoch"] == 3


def test_retention_keeps_the_best_epoch(tmp_path):
    from launch.storage import open_location
    from launch.trainable import LocalCheckpoints

    for mode, values in (("max", {1: 50.0, 2: 70.0, 3: 70.0, 4: 60.0}), ("min", {1: 5.0, 2: 3.0, 3: 3.0, 4: 4.0})):
        run = open_location(tmp_path / mode)
        for epoch in values:
            run.join(checkpoint_name(epoch), CHECKPOINT_FILE).write_text("x")
        LocalCheckpoints(run, "m", mode, num_to_keep=1).prune(values)
        kept = sorted(int(n[-4:]) for n in run.listdir(folders_only=True))
        assert kept == [3, 4], (mode, kept)  # the best epoch by the rule, and the latest


@pytest.mark.slow
def test_training_keeps_the_latest_of_equal_val_scores_as_best(tmp_path, monkeypatch):
    """Trainer.fit's choice of best.pt (the checkpoint the test split is scored from) follows the same rule."""
    import a2core.train as train_mod
    from a2core.config import Config
    from a2core.data import synthetic

    root = tmp_path / "synth"
    synthetic.generate(root, seed=1, images=40)
    cfg = Config.from_dict({"data": {"root": str(root), "images": 40, "seed": 1},
                            "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10},
                            "train": {"xe_epochs": 3, "batch_size": 50, "log_every": 1000, "test_at_end": False}})
    scores = iter([40.0, 40.0, 10.0])
    monkeypatch.setattr(train_mod.Trainer, "validate", lambda self: {"val/CIDEr": next(scores), "samples": []})
    result = train_mod.train(cfg, lambda metrics, folder: None, output_dir=tmp_path / "run")
    assert result["best_epoch"] == 2


@pytest.mark.parametrize("mode", ["max", "min"])
def test_every_view_names_the_same_best_configuration(tmp_path, mode, monkeypatch, capsys):
    """One best configuration: the record's (`launch.record.best_group`). Two groups of equal mean (the one whose first
    trial came first wins), and a better-looking group the scheduler stopped (never best while others finished): the
    summary, the dashboards' study, `compare`'s row, the report's line and package's selection name the same group
    and trial, in `max` and in `min` mode."""
    from dashboards.compare import study_comparison
    from dashboards.report import _summary
    from launch.package import candidates, select_best
    from launch.record import best_group

    sign = 1 if mode == "max" else -1  # min mode: the study metric is a loss, lower is better
    overrides = () if mode == "max" else ("search.metric=train/loss", "search.mode=min")
    fab = fabricated_study(tmp_path, f"group-{mode}", epochs=2, overrides=overrides)
    metric = fab.spec.metric

    def add(tid, fusion, seed, value, **kw):
        run = fab.location.at(TRIALS_DIR, train_run_name(fab.spec.name, tid))
        run.join(checkpoint_name(2), CHECKPOINT_FILE).write_text("not read here")
        results = [{"epoch": e, metric: sign * (value - 2 + e), "val/CIDEr": value - 2 + e,
                    "checkpoint_path": run.join(checkpoint_name(e)).uri} for e in (1, 2)]
        fab.add(tid, {"fusion": fusion, "lambda": 0.05, "seed": seed} if fusion != "none" else
                {"fusion": fusion, "seed": seed}, results, **kw)

    add("a0", "max", 0, 70.0), add("b0", "gate", 0, 66.0), add("a1", "max", 1, 60.0), add("b1", "gate", 1, 64.0)
    add("c0", "moving_average", 0, 99.0, stopped={"rung": 1, "cutoff": 0.0}), add("c1", "moving_average", 1, 98.0, stopped={"rung": 1, "cutoff": 0.0})
    record = fab.record()
    summary = json.loads(json.dumps(record.summary()))
    group = summary["best_group"]
    assert group["trials"] == ["a0", "a1"] and group["best_trial"] == "a0"  # 65 = 65: a0 came before b0
    study = record.study()
    assert study.best_group == group["config_hash"] and study.best_trial == summary["best"]["trial_id"] == "a0"
    assert study.mode == mode
    comparison, _, _ = study_comparison(study, by="model.lambda")  # one row, lambda 0.05: its best configuration
    [(arm, _)] = comparison.rows
    assert arm.label == "0.05" and sorted(s["val/CIDEr"] for s in arm.seeds) == [60.0, 70.0]  # group a's
    assert "Best single run: a0 (max)" in _summary(study)
    assert select_best(best_group(fab.spec, record.groups()), candidates(fab.spec, record.trials), mode,
                       fab.spec.name)["trial_id"] == "a0"
