"""`a2 study plan`'s figures recomputed by hand: steps, trials, GPU-hours, wall time in waves of concurrent trials
(each round of seeds after the one before), the early-stopping caveat and a fraction of a card's assumption."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from a2core.config import CAPTIONS_PER_IMAGE
from launch import plan
from launch.spec import load_study

ROOT = Path(__file__).resolve().parents[1]
WORKERS = plan.Workers("g5.12xlarge", 4, True, 4)  # ray-cluster.yaml's worker type: 16 GPUs


def _study(name, *overrides):
    return load_study(ROOT / "studies" / f"{name}.yaml", list(overrides), check_files=False)


def _per_trial_hours(spec, ips=plan.IMAGES_PER_SECOND):
    """One trial's GPU-hours from the cost model's constants, independently of `plan.estimate`."""
    t = spec.base["train"]
    n, b = spec.images["train"], t["batch_size"]
    steps = math.ceil(n * 5 / b) if t["batch_layout"] == "pairs" else math.ceil(n / (b // 5))
    images = steps * (b // CAPTIONS_PER_IMAGE)
    xe_cost = 1 + plan.ENCODER_SHARE * (50 / 10 - 1) if t["batch_layout"] == "pairs" else 1.0
    scst_cost = plan.SCST_IMAGE_COST * (plan.BEAM_SCST_COST if t.get("scst_candidates") == "beam" else 1.0)
    # decoding: a greedy image costs VAL_IMAGE_COST; a beam of k, linear in k from greedy (k = 1) to beam 5's
    # BEAM5_OVER_GREEDY times it. Validation decodes as train.val_decode says, the end-of-run test with beam search.
    def decoded(k):
        return plan.VAL_IMAGE_COST * (1 + (plan.BEAM5_OVER_GREEDY - 1) * (k - 1) / (5 - 1))

    val = decoded(t["beam_size"] if t.get("val_decode") == "beam" else 1) * 5_000
    test = decoded(t["beam_size"]) * 5_000
    work = t["xe_epochs"] * (xe_cost * images + val) + t["scst_epochs"] * (scst_cost * images + val) + test
    return work / ips / 3600


@pytest.mark.parametrize("overrides, trials, slots, gpus, waves, trial_gpus", [
    ((), 55, 16, 16, 2 + 2, 1),  # 30 search trials then 25 confirmation ones, 16 at a time
    (("search.confirm=7",), 65, 16, 16, 2 + 3, 1),
    (("search.replicates=5",), 100, 16, 16, 5 + 2, 1),
    (("resources.workers_per_trial=2",), 55, 8, 16, 4 + 4, 2),
    (("resources.gpus_per_worker=0.5",), 55, 16, 8, 2 + 2, 0.5),
    (("resources.max_concurrent_trials=100",), 55, 16, 16, 2 + 2, 1),  # the cluster's 16 GPUs cap it
])
def test_fusion_ablation_wall_time_runs_in_waves(overrides, trials, slots, gpus, waves, trial_gpus):
    spec = _study("fusion_ablation", *overrides)
    per_trial = _per_trial_hours(spec)
    assert per_trial == pytest.approx(13.69, abs=0.01)  # one trial's GPU-hours, every variant alike
    est = plan.estimate(spec, plan.IMAGES_PER_SECOND, WORKERS)
    assert spec.num_trials == trials
    assert est.gpu_hours == pytest.approx(trials * per_trial, rel=1e-3)
    assert est.gpus_at_once == gpus and est.gpus_at_once / trial_gpus == slots
    # a trial of a fraction of a card runs at that fraction; of 2 cards, twice as fast (linear scaling)
    assert est.wall_hours == pytest.approx(waves * per_trial / trial_gpus, rel=1e-3)
    assert est.wall_hours >= est.gpu_hours / est.gpus_at_once - 1e-9  # never below the perfect spread


def test_the_printed_table3_plan_quotes_the_wall_time_in_waves(capsys):
    from launch.cli import main as a2

    assert a2(["study", "plan", str(ROOT / "studies" / "fusion_ablation.yaml"), "--sd", "1.5"]) == 0
    out = capsys.readouterr().out
    hours = 4 * _per_trial_hours(_study("fusion_ablation"))  # 4 waves of 13.69 h: 54.8, not 753 / 16 = 47
    assert f"{55 * hours / 4:,.0f}" == "753"  # 55 trials of 13.69 h
    assert f"GPU-hours {55 * hours / 4:,.0f} for 55 trials; about {hours:,.0f} h wall on 16 GPUs at once" in out
    assert "1,100 trial-epochs (no early stopping: fifo)" in out  # fifo: nothing stops early
    assert "before ASHA" not in out
    cost = 55 * hours / 4 * 5.672 / 4  # 753 GPU-hours at g5.12xlarge's $5.672 a node of 4 GPUs
    assert f"${cost:,.0f}: g5.12xlarge" in out and f"${cost * plan.SPOT_SHARE:,.0f}" in out
    for page in ("docs/how-to/reproduce-table-3.md", "docs/explanation/statistics.md"):
        assert f"about {hours:,.0f} h wall on 16 GPUs at once" in (ROOT / page).read_text()


def test_an_asha_study_says_its_cost_is_before_early_stopping(capsys):
    from launch.cli import main as a2

    spec = _study("lambda_sweep")
    per_trial = _per_trial_hours(spec)
    est = plan.estimate(spec, plan.IMAGES_PER_SECOND, WORKERS)
    assert est.wall_hours == pytest.approx(math.ceil(36 / 16) * per_trial, rel=1e-3)  # 3 waves
    assert a2(["study", "plan", str(ROOT / "studies" / "lambda_sweep.yaml"), "--sd", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "540 trial-epochs (before early stopping)" in out
    assert f"{36 * per_trial:,.0f}" == "370"  # 36 trials of 10.28 h
    gpu_line = next(line for line in out.splitlines() if line.startswith("  GPU-hours 370 for 36 trials"))
    assert "before ASHA's early stopping, an upper bound" in gpu_line


def test_a_fraction_of_a_card_says_the_cards_speed_is_shared(capsys):
    from launch.cli import main as a2

    assert a2(["study", "plan", str(ROOT / "studies" / "seeds.yaml"), "resources.gpus_per_worker=0.5",
               "--images-per-second", "100"]) == 0
    out = capsys.readouterr().out
    per_trial = _per_trial_hours(_study("seeds"))
    assert per_trial == pytest.approx(26.47, abs=0.01)
    # 4 trials at half a card each: 2 cards, one wave, each trial at 50 images/s
    assert f"GPU-hours {4 * per_trial:,.0f} for 4 trials; about {2 * per_trial:,.0f} h wall on 2 GPUs at once" in out
    assert "2 trials share a card: 100 images/s is the card's, all of them together" in out
