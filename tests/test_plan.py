"""`a2 study plan`: seeds per arm for the paper's Table 3 gaps, from a given or a measured seed spread."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from a2core.errors import StudyError
from dashboards.stats import TAG_CONFIG_HASH, seeds_needed
from dashboards.tracking import StudyTracker
from launch.cli import main as a2
from launch.plan import measured_sd, table3_gaps

SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"


@pytest.fixture
def study_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load(SMOKE.read_text())
    raw["search"]["replicates"] = 3
    raw["search"]["num_samples"] = 2  # none and 2 gate samples
    raw["train"].update(xe_epochs=20, scst_epochs=0)  # pinned: the expected trial-epochs below use 20
    raw["tracking"] = {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_table3_gaps_are_the_worked_example():
    assert table3_gaps() == [("max vs none", 2.8), ("moving_average vs none", 2.3), ("exp_decay vs none", 4.2),
                             ("gate vs none", 5.0), ("max vs moving_average", 0.5)]


def test_plan_with_a_given_spread(study_file, capsys):
    assert a2(["study", "plan", str(study_file), "--sd", "1.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line[:26].strip(): line.split()[-2:] for line in out[2:-1]}
    # smoke: 3 configurations (none, 2 gate samples) x 20 epochs
    assert rows["gate vs none"] == [str(seeds_needed(5.0, 1.5)), str(3 * seeds_needed(5.0, 1.5) * 20)]
    assert rows["max vs moving_average"] == ["143", str(3 * 143 * 20)]
    assert out[-1] == "trial-epochs = 3 configurations x seeds x 20 epochs (before early stopping)"


def test_plan_measures_the_spread_in_the_finished_study(study_file, tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = StudyTracker(uri, "a2-smoke")
    tracker.start_study({}, {})
    with pytest.raises(StudyError, match="no configuration with two seeds"):
        measured_sd(uri, "a2-smoke")
    for group, values in {"a": (10.0, 12.0, 14.0), "b": (20.0, 21.0, 22.0)}.items():
        for seed, v in enumerate(values):
            run = tracker.trial_run(f"{group}{seed}", {"train": {"seed": seed}}, tags={TAG_CONFIG_HASH: group})
            tracker.log_metrics(run, {"val/CIDEr": v}, step=1)
    sd, groups = measured_sd(uri, "a2-smoke")
    assert groups == 2 and sd == pytest.approx(((4 + 1) / 2) ** 0.5)  # pooled variances 4 and 1
    assert a2(["study", "plan", str(study_file), "--delta", "3"]) == 0
    out = capsys.readouterr().out
    assert "sd 1.58 CIDEr (measured in study a2-smoke, 2 replicate groups)" in out
    assert f"3 CIDEr                       3.0{seeds_needed(3.0, sd):>11d}" in out
