"""`a2 study plan`'s figures recomputed by hand from the study file and the cost model's documented constants (an XE
image 1 in the images layout, the encoder's share 0.26, an SCST image 6.9 (x 0.57 for beam candidates), a greedy
decoded image 2.0, beam 5 / greedy 1.46 linear in the width, 100 images/s a GPU): the shipped studies, and variants a
researcher writes (a batch of 64 pairs, fused seeds, a fraction of a card that does not divide it, trials of several
workers on a fraction of a card each, adaptive rounds, SCST only, one epoch, a capped validation, a large grid on a
quarter card). No Ray."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from launch import plan
from launch.cli import main as a2
from launch.spec import load_study

ROOT = Path(__file__).resolve().parents[1]
WORKERS = plan.Workers("g5.12xlarge", 4, True, 4)  # ray-cluster.yaml's worker type: 4 nodes of 4 GPUs


def _study(name, *overrides):
    return load_study(ROOT / "studies" / f"{name}.yaml", list(overrides), check_files=False)


def _decoded(k):
    """A decoded image in XE images: greedy 2.0, a beam of k linear from it to 1.46 x it at k = 5."""
    return 2.0 * (1 + 0.46 * (k - 1) / 4)


def _hand_trial_hours(train, val, test, batch, layout, xe_epochs, scst_epochs=0, val_beam=1, test_beam=5,
                      scst_beam=False, ips=100.0):
    """One trial's GPU-hours, by hand: steps = ceil(pairs / batch) (pairs) or ceil(images / (batch / 5)); an epoch's
    images = steps x batch / 5; a pairs step's encoder passes the expected distinct images among its pairs."""
    if layout == "pairs":
        steps = math.ceil(train * 5 / batch)
        pairs = train * 5
        missed = math.prod((pairs - batch - i) / (pairs - i) for i in range(5))
        passes = train * (1 - missed)
        xe_cost = 1 + 0.26 * (passes / (batch / 5) - 1)
    else:
        steps = math.ceil(train / (batch // 5))
        xe_cost = 1.0
    images = steps * batch // 5
    scst_cost = 6.9 * (0.57 if scst_beam else 1.0)
    v = _decoded(val_beam) * val
    work = xe_epochs * (xe_cost * images + v) + scst_epochs * (scst_cost * images + v) + _decoded(test_beam) * test
    return work / ips / 3600


# the shipped COCO studies: Karpathy counts 113,287 / 5,000 / 5,000, 50 pairs a step, beam-5 validation and test
FUSION_TRIAL = _hand_trial_hours(113_287, 5_000, 5_000, 50, "pairs", 20, val_beam=5)
LAMBDA_TRIAL = _hand_trial_hours(113_287, 5_000, 5_000, 50, "pairs", 15, val_beam=5)
SEEDS_TRIAL = _hand_trial_hours(113_287, 5_000, 5_000, 50, "pairs", 20, 10, val_beam=5, scst_beam=True)


def _text(spec, workers=WORKERS):
    """The plan's lines without the noise (power) part: the per-trial, trials and cost lines."""
    return plan.plan_text(spec, None, "none", None, 100.0, "given", workers, None)


@pytest.mark.parametrize("name, trials, per_trial, waves, gpus, hours, wall, dollars", [
    # 15 configurations (none; 3 fusions x renormalize 2; exp_decay x 2 x 4 T_P samples) x 2 seeds, then 5 fusions x 5
    # confirmation seeds: waves ceil(30 / 16) + ceil(25 / 16)
    ("fusion_ablation", 15 * 2 + 5 * 5, FUSION_TRIAL, 2 + 2, 16, "753", "55", "1,068"),
    ("lambda_sweep", 12 * 3, LAMBDA_TRIAL, 3, 16, "370", "31", "525"),  # 12 lambdas x 3 seeds, 16 at a time
    ("seeds", 4, SEEDS_TRIAL, 1, 4, "106", "26", "150"),  # 4 seeds side by side
])
def test_shipped_studies_print_their_hand_computed_figures(name, trials, per_trial, waves, gpus, hours, wall, dollars):
    spec = _study(name)
    assert spec.steps_per_epoch == math.ceil(113_287 * 5 / 50) == 11_329
    est = plan.estimate(spec, 100.0, WORKERS)
    assert spec.num_trials == trials
    assert est.gpu_hours == pytest.approx(trials * per_trial, rel=1e-4)
    assert est.wall_hours == pytest.approx(waves * per_trial, rel=1e-4)
    assert est.gpus_at_once == gpus
    assert f"{trials * per_trial:,.0f}" == hours and f"{waves * per_trial:,.0f}" == wall
    assert f"{trials * per_trial * 5.672 / 4:,.0f}" == dollars
    text = _text(spec)
    assert f"GPU-hours {hours} for {trials} trials; about {wall} h wall on {gpus} GPUs at once" in text, text
    assert f"  cost      ${dollars}: g5.12xlarge at $5.672/h" in text, text
    assert f"{_n(trials * spec.total_epochs)} trial-epochs" in text


def _n(x):
    return f"{x:,.0f}"


def test_a_pairs_batch_not_a_multiple_of_5_is_priced_by_its_pairs():
    """64 pairs a step (valid in the pairs layout without SCST) are 12.8 images' captions and ~64 encoder passes:
    an XE image costs 1 + 0.26 x (64 / 12.8 - 1) = 2.04, as at 50 pairs. Flooring 64 / 5 to 12 priced it
    1 + 0.26 x (64 / 12 - 1) = 2.13, and lambda_sweep's 370 GPU-hours at 385."""
    spec = _study("lambda_sweep", "train.batch_size=64")
    assert spec.steps_per_epoch == math.ceil(113_287 * 5 / 64) == 8_851
    assert plan.xe_image_cost(spec) == pytest.approx(1 + 0.26 * (63.986 / 12.8 - 1), abs=1e-3)
    per_trial = _hand_trial_hours(113_287, 5_000, 5_000, 64, "pairs", 15, val_beam=5)
    est = plan.estimate(spec, 100.0, WORKERS)
    assert est.gpu_hours == pytest.approx(36 * per_trial, rel=1e-4)
    assert f"{est.gpu_hours:,.0f}" == "370"  # the same work as at 50 pairs: the same images and encoder passes
    assert "an XE image 2.04 (pairs layout" in _text(spec)
    # the images layout keeps its 1.00 (its batch is a multiple of 5)
    assert plan.xe_image_cost(_study("smoke")) == 1.0


def test_fused_seeds_run_a_configurations_seeds_in_one_trial_round_after_round():
    """fusion_ablation with resources.fuse_replicates: 15 fused trials of 2 seeds (one wave on 16 GPUs: 2 seed-trials'
    time), then 5 fused trials of 5 confirmation seeds (5 seed-trials' time): 7 x 13.69 = 96 h. Spread over all 16
    GPUs the plan said 753 / 16 = 47 h, less than the 68 h its own 5-seed confirmation trials take."""
    spec = _study("fusion_ablation", "resources.fuse_replicates=true")
    assert spec.seed_rounds_trials == [(15, 2), (5, 5)] and spec.tune_samples == 20
    est = plan.estimate(spec, 100.0, WORKERS)
    assert est.gpu_hours == pytest.approx(55 * FUSION_TRIAL, rel=1e-4)
    assert est.wall_hours == pytest.approx((2 + 5) * FUSION_TRIAL, rel=1e-4)
    assert est.wall_hours >= 5 * FUSION_TRIAL  # never below its longest trial
    assert "GPU-hours 753 for 55 trials; about 96 h wall on 16 GPUs at once" in _text(spec)
    # 4 fused trials at a time: the 15 of round one in ceil(15 / 4) = 4 waves of 2 seeds, then 2 waves of 5
    four = _study("fusion_ablation", "resources.fuse_replicates=true", "resources.max_concurrent_trials=4")
    assert plan.estimate(four, 100.0, WORKERS).wall_hours == pytest.approx((4 * 2 + 2 * 5) * FUSION_TRIAL, rel=1e-4)


def test_a_fraction_that_does_not_divide_a_card_packs_whole_trials():
    """gpus_per_worker 0.4: Ray puts int(1 / 0.4) = 2 trials on a card, so 16 cards hold 32 trials, not 40 (nor the
    36 the study has): lambda_sweep's 36 trials take 2 waves of trials at 0.4 of a card, not 1; and the plan says 2
    trials share a card, not 2.5."""
    spec = _study("lambda_sweep", "resources.gpus_per_worker=0.4", "resources.max_concurrent_trials=100")
    est = plan.estimate(spec, 100.0, WORKERS)
    assert est.gpus_at_once == pytest.approx(32 * 0.4)
    assert est.wall_hours == pytest.approx(2 * LAMBDA_TRIAL / 0.4, rel=1e-4)
    assert est.gpu_hours == pytest.approx(36 * LAMBDA_TRIAL, rel=1e-4)
    text = _text(spec)
    assert "32 trials side by side in waves" in text and "            2 trials share a card:" in text, text
    # 0.33: 3 trials a card (it said 3.0303); 16 side by side on 5.28 GPUs' worth
    third = _text(_study("lambda_sweep", "resources.gpus_per_worker=0.33"))
    assert "            3 trials share a card:" in third and "3.0303" not in third, third
    assert "on 5.28 GPUs at once, 16 trials side by side" in third, third
    # a divisor of a card is unchanged: 0.25 x 100 trials allowed, 16 cards of 4 = 64 > 36 trials
    quarter = plan.estimate(_study("lambda_sweep", "resources.gpus_per_worker=0.25",
                                   "resources.max_concurrent_trials=100"), 100.0, WORKERS)
    assert quarter.gpus_at_once == 9 and quarter.wall_hours == pytest.approx(LAMBDA_TRIAL / 0.25, rel=1e-4)


def test_workers_on_half_a_card_each_are_said_to_share_it_not_trials():
    """2 workers of 0.5 GPU a trial: a trial holds a whole card's worth, so no two trials share a card; its two
    workers do. Priced as one-GPU trials: 4 seeds side by side on 4 GPUs."""
    spec = _study("seeds", "resources.gpus_per_worker=0.5", "resources.workers_per_trial=2")
    est = plan.estimate(spec, 100.0, WORKERS)
    assert est.gpus_at_once == 4 and est.wall_hours == pytest.approx(SEEDS_TRIAL, rel=1e-4)
    text = _text(spec)
    assert "            2 workers share a card:" in text and "trials share a card" not in text, text


def test_adaptive_rounds_run_one_after_another():
    """search.replicates {min: 3, max: 7}: 15 configurations x 7 seeds at most = 105 trials, rounds of 3, 2 and 2
    seeds: ceil(45 / 16) + ceil(30 / 16) + ceil(30 / 16) = 3 + 2 + 2 waves."""
    spec = _study("fusion_ablation", "search.replicates={min: 3, max: 7}", "search.confirm=null")
    assert spec.num_trials == 105 and spec.seed_rounds_trials == [(15, 3), (15, 2), (15, 2)]
    est = plan.estimate(spec, 100.0, WORKERS)
    assert est.gpu_hours == pytest.approx(105 * FUSION_TRIAL, rel=1e-4)
    assert est.wall_hours == pytest.approx(7 * FUSION_TRIAL, rel=1e-4)
    assert "105 = 15 configurations x 7 seeds; 2,100 trial-epochs" in _text(spec)


@pytest.mark.parametrize("overrides, per_trial, epochs", [
    # SCST only, from a checkpoint: 10 epochs of beam SCST images
    (("train.xe_epochs=0", "train.scst_from=/tmp/none.pt"),
     _hand_trial_hours(113_287, 5_000, 5_000, 50, "pairs", 0, 10, val_beam=5, scst_beam=True), 10),
    # one XE epoch, no SCST
    (("train.xe_epochs=1", "train.scst_epochs=0", "train.warmup=100"),
     _hand_trial_hours(113_287, 5_000, 5_000, 50, "pairs", 1, 0, val_beam=5), 1),
    # validation on the first 1,000 val images, greedy; a test beam of 3
    (("data.val_images=1000", "train.val_decode=greedy", "train.beam_size=3"),
     _hand_trial_hours(113_287, 1_000, 5_000, 50, "pairs", 20, 10, val_beam=1, test_beam=3, scst_beam=True), 30),
    # no end-of-run test evaluation
    (("train.test_at_end=false",),
     _hand_trial_hours(113_287, 5_000, 0, 50, "pairs", 20, 10, val_beam=5, scst_beam=True), 30),
])
def test_seeds_variants_by_hand(overrides, per_trial, epochs):
    spec = _study("seeds", *overrides)
    assert spec.total_epochs == epochs and spec.total_steps == 11_329 * epochs
    est = plan.estimate(spec, 100.0, WORKERS)
    assert est.gpu_hours == pytest.approx(4 * per_trial, rel=1e-4)
    assert est.wall_hours == pytest.approx(per_trial, rel=1e-4)  # the 4 seeds side by side


def test_a_large_grid_on_a_quarter_card_by_hand(tmp_path):
    """synthetic_fusions with a lambda grid of 40 values in the 4 fusions' cells: 1 + 4 x 40 = 161 configurations x 5
    seeds = 805 trials; a quarter card a trial, 40 side by side: ceil(805 / 40) = 21 waves of trials at a quarter
    of a card's speed."""
    raw = yaml.safe_load((ROOT / "studies" / "synthetic_fusions.yaml").read_text())
    del raw["model"]["lambda"]
    raw["search"]["space"]["lambda"] = {"grid": [round(0.01 * i, 2) for i in range(1, 41)],
                                        "when": {"fusion": ["max", "moving_average", "exp_decay", "gate"]}}
    raw["resources"].update(gpus_per_worker=0.25, max_concurrent_trials=40)
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(raw))
    spec = load_study(path, [], check_files=False)
    assert spec.images == {"train": 1000, "val": 500, "test": 2000}
    assert spec.num_trials == 805 and spec.num_arms == 161 and spec.steps_per_epoch == 1000 // 5
    per_trial = _hand_trial_hours(1000, 500, 2000, 25, "images", 8)  # greedy validation, beam-5 test
    est = plan.estimate(spec, 100.0, WORKERS)
    assert est.gpu_hours == pytest.approx(805 * per_trial, rel=1e-4)
    assert est.gpus_at_once == 10 and est.wall_hours == pytest.approx(21 * per_trial / 0.25, rel=1e-4)
    text = _text(spec)
    assert "805 = 161 configurations x 5 seeds; 6,440 trial-epochs" in text
    assert "4 trials share a card:" in text


def test_the_cli_plan_of_a_fused_study(capsys):
    """As the user runs it: the fused fusion_ablation's wall time in the printed plan."""
    assert a2(["study", "plan", str(ROOT / "studies" / "fusion_ablation.yaml"), "resources.fuse_replicates=true"]) == 0
    out = capsys.readouterr().out
    assert f"GPU-hours 753 for 55 trials; about {7 * FUSION_TRIAL:,.0f} h wall on 16 GPUs at once" in out, out
    assert "  fused     20 Tune trials, each a configuration's seeds of a round trained together" in out
