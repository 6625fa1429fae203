"""`a2 study compare` with intervals, on replicate groups logged to a SQLite MLflow store in tmp_path."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from a2core.errors import StudyError
from dashboards.compare import PER_IMAGE_ARTIFACT, compare_table, study_comparison
from dashboards.compare import main as compare_main
from dashboards.stats import TAG_CONFIG_HASH, paired_difference, seed_interval, stopped_early_tags
from dashboards.tracking import StudyTracker

STUDY = "cmp-study"
IMAGES = 60
# (fusion, lambda) -> true mean val CIDEr (x100); seeds add +-1, images add their own noise
CONFIGS = {("none", None): 110.0, ("gate", 0.01): 113.0, ("gate", 0.1): 116.0}
SEEDS = (0, 1, 2)


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a SQLite store keeps artifacts under ./mlruns


def per_image(mean: float, seed: int, rng_seed: int) -> np.ndarray:
    rng = np.random.default_rng(rng_seed)
    difficulty = np.random.default_rng(99).normal(0, 30, IMAGES)  # the same images for every run
    scores = mean + difficulty + rng.normal(0, 5, IMAGES)
    return scores - scores.mean() + mean + (seed - 1)  # the run's mean is exactly mean + (seed - 1)


@pytest.fixture
def study(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = StudyTracker(uri, STUDY)
    tracker.start_study({}, {})
    truth = {}
    for i, ((fusion, lam), mean) in enumerate(CONFIGS.items()):
        for seed in SEEDS:
            model = {"fusion": fusion} if lam is None else {"fusion": fusion, "lambda": lam}  # none: no lambda
            run = tracker.trial_run(f"{fusion}-{lam}-{seed}", {"model": model, "train": {"seed": seed}},
                                    tags={TAG_CONFIG_HASH: f"hash{i}"})
            scores = per_image(mean, seed, 10 * i + seed)
            tracker.log_metrics(run, {"val/CIDEr": float(scores.mean()), "val/BLEU-4": 30.0 + seed}, step=1)
            tracker.client.log_dict(run, {f"{k:03d}": float(v) for k, v in enumerate(scores)}, PER_IMAGE_ARTIFACT)
            truth.setdefault((fusion, lam), []).append(scores)
            tracker.end_trial(run, "FINISHED")
    # a better-looking configuration that the scheduler stopped early: never the best while others finished
    for seed in SEEDS:
        run = tracker.trial_run(f"stopped-{seed}", {"model": {"fusion": "gate", "lambda": 0.05},
                                                    "train": {"seed": seed}}, tags={TAG_CONFIG_HASH: "hash9"})
        tracker.log_metrics(run, {"val/CIDEr": 130.0 + seed}, step=1)
        if seed == 0:
            tracker.set_tags(run, stopped_early_tags(1, 131.0))
        tracker.end_trial(run, "FINISHED")
    tracker.end_study("FINISHED")
    return uri, {k: np.stack(v) for k, v in truth.items()}


def test_compare_by_fusion_rows_intervals_and_difference_to_baseline(study):
    uri, truth = study
    text = compare_table(uri, STUDY, by="fusion")
    lines = text.splitlines()
    rows = {line.split()[0]: line for line in lines[3:5]}
    assert list(rows) == ["none", "gate"]
    gate = truth[("gate", 0.1)]
    expect = seed_interval(gate.mean(axis=1)).text()
    assert expect.startswith("116.0 [") and expect in rows["gate"]  # the best gate config, not the stopped one
    assert "model.lambda=0.1" in rows["gate"] and "130" not in text
    assert "(baseline)" in rows["none"] and seed_interval(truth[("none", None)].mean(axis=1)).text() in rows["none"]
    diff = paired_difference(gate, truth[("none", None)], ("gate", "none"))
    assert diff.interval_text() in rows["gate"]
    assert lines[-1] == diff.verdict()
    assert lines[-1].startswith("gate beats none by 6.0 CIDEr [") and lines[-1].endswith("3 seeds x 60 images")
    assert " 3  " in rows["gate"]  # n seeds


def test_compare_by_lambda_ignores_trials_without_a_mask_network(study, capsys):
    uri, truth = study
    comparison, labelled, _ = study_comparison(uri, STUDY, by="lambda")
    labels = [arm.label for arm, _ in comparison.rows]
    # lambda 0.05 has only its stopped group, so that is its row; the baseline is a reference row, not a lambda
    assert labels == ["0.01", "0.05", "0.1", "fusion=none"]
    assert set(comparison.differences) == {"0.01", "0.05", "0.1"}
    assert comparison.differences["0.05"].images is None  # no per-image scores logged: Welch over seed means
    assert comparison.differences["0.01"].resolved and comparison.differences["0.01"].delta == pytest.approx(3.0)
    assert compare_main(argparse.Namespace(name=STUDY, by="lambda", baseline=None, tracking_uri=uri)) == 0
    assert "0.1 beats fusion=none by 6.0 CIDEr" in capsys.readouterr().out


def test_compare_against_a_chosen_baseline_row(study, capsys):
    uri, truth = study
    comparison, _, _ = study_comparison(uri, STUDY, by="lambda", baseline="0.01")
    assert comparison.baseline == "0.01" and [arm.label for arm, _ in comparison.rows] == ["0.01", "0.05", "0.1"]
    assert set(comparison.differences) == {"0.05", "0.1"}  # no fusion=none reference row
    diff = paired_difference(truth[("gate", 0.1)], truth[("gate", 0.01)], ("0.1", "0.01"))
    assert comparison.differences["0.1"].interval_text() == diff.interval_text()
    assert compare_main(argparse.Namespace(name=STUDY, by="lambda", baseline="0.01", tracking_uri=uri)) == 0
    out = capsys.readouterr().out
    assert "0.01 (baseline)" in out and out.splitlines()[-1] == diff.verdict()
    with pytest.raises(StudyError, match=r"--baseline 0.2: .* lambda=0.2 \(it has 0.01, 0.05, 0.1\)"):
        study_comparison(uri, STUDY, by="lambda", baseline="0.2")


def test_stopped_group_is_best_when_it_is_the_only_one(tmp_path):
    uri = f"sqlite:///{tmp_path / 'only.db'}"
    tracker = StudyTracker(uri, "only")
    tracker.start_study({}, {})
    for seed in SEEDS:
        run = tracker.trial_run(f"t{seed}", {"model": {"fusion": "gate"}, "train": {"seed": seed}},
                                tags={TAG_CONFIG_HASH: "h", **stopped_early_tags(2, 50.0)})
        tracker.log_metrics(run, {"val/CIDEr": 40.0 + seed}, step=2)
    comparison, _, _ = study_comparison(uri, "only")
    ((arm, intervals),) = comparison.rows
    assert intervals["val/CIDEr"].mean == pytest.approx(41.0) and intervals["val/CIDEr"].n == 3
    assert comparison.differences == {}  # no baseline in this study


def test_rows_are_selected_on_val_and_judged_on_the_test_split(tmp_path):
    """With test scores logged (each run's selected checkpoint on the test split, per image), the row of each fusion
    is still its best configuration on val, but the difference and the verdict are on the test images."""
    from dashboards.compare import TEST_PER_IMAGE_ARTIFACT

    uri = f"sqlite:///{tmp_path / 'test.db'}"
    tracker = StudyTracker(uri, "split")
    tracker.start_study({}, {})
    truth = {}
    for i, ((fusion, lam), val_mean) in enumerate(CONFIGS.items()):
        for seed in SEEDS:
            model = {"fusion": fusion} if lam is None else {"fusion": fusion, "lambda": lam}
            run = tracker.trial_run(f"{fusion}-{lam}-{seed}", {"model": model, "train": {"seed": seed}},
                                    tags={TAG_CONFIG_HASH: f"hash{i}"})
            test = per_image(100.0, seed, 50 + 10 * i + seed)  # on test every configuration scores about 100
            tracker.log_metrics(run, {"val/CIDEr": val_mean + seed, "test/CIDEr": float(test.mean())}, step=1)
            tracker.client.log_dict(run, {f"{k:03d}": float(v) for k, v in enumerate(test)}, TEST_PER_IMAGE_ARTIFACT)
            truth.setdefault((fusion, lam), []).append(test)
            tracker.end_trial(run, "FINISHED")
    tracker.end_study("FINISHED")
    comparison, configs, _ = study_comparison(uri, "split", by="fusion")
    assert configs["gate"] == "model.lambda=0.1"  # selected on val (116 against 113)
    diff = comparison.differences["gate"]
    expect = paired_difference(np.stack(truth[("gate", 0.1)]), np.stack(truth[("none", None)]), ("gate", "none"),
                               metric="test CIDEr")
    assert (diff.delta, diff.low, diff.high) == pytest.approx((expect.delta, expect.low, expect.high))
    assert diff.verdict() == expect.verdict() and "test CIDEr" in diff.verdict()
    text = compare_table(uri, "split", by="fusion")
    assert "differences and verdicts on the test images" in text and "vs baseline (test CIDEr)" in text
