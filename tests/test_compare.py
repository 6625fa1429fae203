"""`a2 study compare` with intervals, on replicate groups written to a study's folder in tmp_path."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from a2core.errors import StudyError
from dashboards.compare import compare_table, configurations, study_comparison
from dashboards.stats import paired_difference, seed_interval
from launch.commands.show import cmd_compare
from tests.studyfolder import fabricated_study

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


def cmd_args(fab, **options) -> argparse.Namespace:
    return argparse.Namespace(name=fab.spec.name, storage=fab.spec.storage,
                              **{"by": "fusion", "baseline": None, "tracking_uri": None, **options})


@pytest.fixture
def fab(tmp_path, monkeypatch):
    fab = fabricated_study(tmp_path, STUDY, epochs=1)
    truth = {}
    for i, ((fusion, lam), mean) in enumerate(CONFIGS.items()):
        for seed in SEEDS:
            sampled = {"fusion": fusion, "seed": seed, **({} if lam is None else {"lambda": lam})}  # none: no lambda
            scores = per_image(mean, seed, 10 * i + seed)
            fab.add(f"{fusion}-{lam}-{seed}", sampled,
                    [{"epoch": 1, "val/CIDEr": float(scores.mean()), "val/BLEU-4": 30.0 + seed}],
                    per_image={"val": {f"{k:03d}": float(v) for k, v in enumerate(scores)}})
            truth.setdefault((fusion, lam), []).append(scores)
    # a better-looking configuration that the scheduler stopped early: never the best while others finished
    for seed in SEEDS:
        fab.add(f"stopped-{seed}", {"fusion": "gate", "lambda": 0.05, "seed": seed},
                [{"epoch": 1, "val/CIDEr": 130.0 + seed}],
                stopped={"rung": 1, "cutoff": 131.0} if seed == 0 else None)
    fab.patch_tune(monkeypatch)
    fab.truth = {k: np.stack(v) for k, v in truth.items()}
    return fab


@pytest.fixture
def study(fab):
    return fab.record().study(), fab.truth


def test_compare_by_fusion_rows_intervals_and_difference_to_baseline(study):
    study, truth = study
    text = compare_table(study, by="fusion")
    lines = text.splitlines()
    rows = {line.split()[0]: line for line in lines[3:5]}
    assert list(rows) == ["none", "gate"]
    gate = truth[("gate", 0.1)]
    expect = seed_interval(gate.mean(axis=1)).text()
    assert expect.startswith("116.0 [") and expect in rows["gate"]  # the best gate config, not the stopped one
    assert "model.lambda=0.1" in rows["gate"] and "130" not in text
    assert "(baseline)" in rows["none"] and seed_interval(truth[("none", None)].mean(axis=1)).text() in rows["none"]
    diff = paired_difference(gate, truth[("none", None)], ("gate", "none"), metric="val CIDEr")
    assert diff.interval_text() in rows["gate"]
    assert lines[-1] == diff.verdict()
    assert lines[-1].startswith("gate beats none by 6.0 val CIDEr [") and lines[-1].endswith("3 seeds x 60 images")
    # no run logged test scores: every column is on val and says so, and so does the header
    assert "every number is on the val images the rows were selected on" in lines[0]
    assert [c.strip() for c in lines[1].split("  ") if c.strip()][:3] == ["fusion", "val B-4 [95% CI]",
                                                                           "val CIDEr [95% CI]"]
    assert "vs baseline (val CIDEr)" in lines[1] and "test" not in lines[1]
    assert " 3  " in rows["gate"]  # n seeds


def test_compare_by_lambda_ignores_trials_without_a_mask_network(fab, study, capsys):
    study, truth = study
    comparison, labelled, _ = study_comparison(study, by="lambda")
    labels = [arm.label for arm, _ in comparison.rows]
    # lambda 0.05 has only its stopped group, so that is its row; the baseline is a reference row, not a lambda
    assert labels == ["0.01", "0.05", "0.1", "fusion=none"]
    assert set(comparison.differences) == {"0.01", "0.05", "0.1"}
    assert comparison.differences["0.05"].images is None  # no per-image scores logged: Welch over seed means
    assert comparison.differences["0.01"].resolved and comparison.differences["0.01"].delta == pytest.approx(3.0)
    assert cmd_compare(cmd_args(fab, by="lambda")) == 0
    assert "0.1 beats fusion=none by 6.0 val CIDEr" in capsys.readouterr().out


def test_compare_against_a_chosen_baseline_row(fab, study, capsys):
    study, truth = study
    comparison, _, _ = study_comparison(study, by="lambda", baseline="0.01")
    assert comparison.baseline == "0.01" and [arm.label for arm, _ in comparison.rows] == ["0.01", "0.05", "0.1"]
    assert set(comparison.differences) == {"0.05", "0.1"}  # no fusion=none reference row
    diff = paired_difference(truth[("gate", 0.1)], truth[("gate", 0.01)], ("0.1", "0.01"), metric="val CIDEr")
    assert comparison.differences["0.1"].interval_text() == diff.interval_text()
    assert cmd_compare(cmd_args(fab, by="lambda", baseline="0.01")) == 0
    out = capsys.readouterr().out
    # two rows against the baseline: one family, Holm's verdicts; the raw interval and p are printed beside them
    adjusted = comparison.differences["0.1"]
    assert adjusted.family == 2 and adjusted.p == pytest.approx(diff.p) and adjusted.p_adjusted >= adjusted.p
    assert "0.01 (baseline)" in out and out.splitlines()[-1] == adjusted.verdict()
    assert out.splitlines()[-1].startswith(diff.verdict() + f" (raw p {diff.p:.3f}, Holm over 2 comparisons: [")
    assert "Holm over 2 [CI], p" in out and "are one family" in out
    with pytest.raises(StudyError, match=r"--baseline 0.2: .* lambda=0.2 \(it has 0.01, 0.05, 0.1\)"):
        study_comparison(study, by="lambda", baseline="0.2")


def test_stopped_group_is_best_when_it_is_the_only_one(tmp_path):
    fab = fabricated_study(tmp_path, "only", epochs=3)
    for seed in SEEDS:
        fab.add(f"t{seed}", {"fusion": "gate", "lambda": 0.05, "seed": seed},
                [{"epoch": 2, "val/CIDEr": 40.0 + seed}], stopped={"rung": 2, "cutoff": 50.0})
    comparison, _, _ = study_comparison(fab.record().study())
    ((arm, intervals),) = comparison.rows
    assert intervals["val/CIDEr"].mean == pytest.approx(41.0) and intervals["val/CIDEr"].n == 3
    assert comparison.differences == {}  # no baseline in this study


def test_rows_are_selected_on_val_and_judged_on_the_test_split(tmp_path):
    """With test scores logged (each run's selected checkpoint on the test split, per image), the row of each fusion
    is still its best configuration on val, but the difference and the verdict are on the test images."""
    fab = fabricated_study(tmp_path, "split", epochs=1)
    truth = {}
    for i, ((fusion, lam), val_mean) in enumerate(CONFIGS.items()):
        for seed in SEEDS:
            sampled = {"fusion": fusion, "seed": seed, **({} if lam is None else {"lambda": lam})}
            test = per_image(100.0, seed, 50 + 10 * i + seed)  # on test every configuration scores about 100
            fab.add(f"{fusion}-{lam}-{seed}", sampled,
                    [{"epoch": 1, "val/CIDEr": val_mean + seed, "val/BLEU-4": 40.0 + seed,
                      "test/CIDEr": float(test.mean()), "test/BLEU-4": 30.0 + i + seed}],
                    per_image={"test": {f"{k:03d}": float(v) for k, v in enumerate(test)}})
            truth.setdefault((fusion, lam), []).append(test)
    study = fab.record().study()
    comparison, configs, _ = study_comparison(study, by="fusion")
    # selected on val (116 against 113); the model keys only a mask network has follow (the baseline lacks them)
    assert configs["gate"].split(", ")[0] == "model.lambda=0.1" and "model.mask_net=content" in configs["gate"]
    diff = comparison.differences["gate"]
    expect = paired_difference(np.stack(truth[("gate", 0.1)]), np.stack(truth[("none", None)]), ("gate", "none"),
                               metric="test CIDEr")
    assert (diff.delta, diff.low, diff.high) == pytest.approx((expect.delta, expect.low, expect.high))
    assert diff.verdict() == expect.verdict() and "test CIDEr" in diff.verdict()
    text = compare_table(study, by="fusion")
    lines = text.splitlines()
    assert "every column but the selection column (val) is on the test split, differences and verdicts too" in lines[0]
    # the columns: test metrics, then the val CIDEr the rows were selected by, labelled; no other val number
    assert [c.strip() for c in lines[1].split("  ") if c.strip()] == [
        "fusion", "test B-4 [95% CI]", "test CIDEr [95% CI]", "val CIDEr (selection) [95% CI]", "seeds",
        "vs baseline (test CIDEr)", "p", "config"]
    gate = next(line for line in lines if line.startswith("gate"))
    assert seed_interval([32.0, 33.0, 34.0]).text() in gate  # test B-4 of gate's lambda 0.1 (i = 2)
    assert seed_interval(np.stack(truth[("gate", 0.1)]).mean(axis=1)).text() in gate  # its test CIDEr
    assert seed_interval([116.0, 117.0, 118.0]).text() in gate  # the val CIDEr it was selected by
    assert "41.0 [" not in text  # val B-4 (40 + seed) is no column


def test_the_intervals_do_not_depend_on_which_trial_finished_first(tmp_path):
    """The bootstrap draws seeds by position: each group is put in seed order (numeric: seed 10 after 9), so two
    records of the same runs, their trials listed in opposite orders, print the same comparison."""
    def study(name, order):
        fab = fabricated_study(tmp_path / name, name, epochs=1)
        for i, ((fusion, lam), mean) in enumerate(CONFIGS.items()):
            for position, seed in enumerate(order):
                scores = per_image(mean, seed - 9, 10 * i + seed)
                sampled = {"fusion": fusion, "seed": seed, **({} if lam is None else {"lambda": lam})}
                fab.add(f"{fusion}-{lam}-{position}", sampled, [{"epoch": 1, "val/CIDEr": float(scores.mean())}],
                        per_image={"val": {f"{k:03d}": float(v) for k, v in enumerate(scores)}})
        return fab.record().study()

    forward, backward = study("forward", (9, 10, 11)), study("backward", (11, 10, 9))
    results = []
    for s in (forward, backward):
        comparison, _, _ = study_comparison(s)
        results.append({label: (d.delta, d.low, d.high) for label, d in comparison.differences.items()})
        baseline = next(g for g in configurations(s.runs) if g[0].fusion == "none")
        assert [int(r.seed) for r in baseline] == [9, 10, 11]
    assert results[0] == results[1] and results[0]["gate"][1] is not None
