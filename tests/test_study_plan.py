"""The shipped COCO studies as the paper ran them, planned and validated before anything runs; the validation
rules that make a study meaningless (errors) or doubtful (warnings); studies saved in the old batch unit."""
import math
import re
from pathlib import Path

import pytest
import yaml

from a2core.config import ConfigError, steps_per_epoch
from a2core.data import synthetic
from launch import plan
from launch.cli import main as a2
from launch.spec import KARPATHY_IMAGES, StudySpec, load_study

ROOT = Path(__file__).resolve().parents[1]
COCO_STUDIES = {"fusion_ablation": (20, 0, 55), "lambda_sweep": (15, 0, 36), "seeds": (20, 10, 4)}
SMOKE = ROOT / "studies" / "smoke.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("name", COCO_STUDIES)
def test_shipped_coco_study_plans_at_the_papers_scale(name, capsys):
    """No data here: the plan counts with the Karpathy split (11,329 steps an epoch at 50 pairs a step)."""
    xe, scst, trials = COCO_STUDIES[name]
    path = ROOT / "studies" / f"{name}.yaml"
    spec = load_study(path, check_files=False)
    t = spec.base["train"]
    assert (t["batch_size"], t["warmup"], t["xe_epochs"], t["scst_epochs"]) == (50, 10_000, xe, scst)
    assert t["val_decode"] == "beam" and t["beam_size"] == 5  # selected and compared as the paper reports
    assert spec.images == {"train": 113_287, "val": 5_000, "test": 5_000}
    assert spec.steps_per_epoch == steps_per_epoch(113_287, 50) == 11_329
    assert spec.total_steps == 11_329 * (xe + scst)
    assert t["warmup"] < 0.1 * 11_329 * xe  # the learning rate peaks in the first epoch, as in the paper
    tp = spec.temperature_range()
    assert tp is None or tp[1] < spec.total_steps
    assert spec.num_trials == trials and spec.warnings == []
    assert spec.num_arms == 1 or spec.verdict_seeds >= 5 if name == "fusion_ablation" else True

    assert a2(["study", "plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"steps     11,329 a epoch; {11_329 * (xe + scst):,} in {xe + scst} epochs" in out
    assert "the standard Karpathy split" in out
    images = 11_329 * 10  # the last step filled up; all 5,000 val images every epoch
    # a decoded image: VAL_IMAGE_COST greedy (measured on an H200), times BEAM5_OVER_GREEDY for a beam of 5 (measured
    # on a CPU: benchmarks/bench_decode.py); these studies validate with beam 5, and the end-of-run test evaluation
    # (once a trial) always decodes with beam search of train.beam_size (5)
    beam5 = plan.VAL_IMAGE_COST * plan.BEAM5_OVER_GREEDY
    assert plan.decode_image_cost(1) == plan.VAL_IMAGE_COST and plan.decode_image_cost(5) == pytest.approx(beam5)
    val = beam5 * 5_000
    test = beam5 * 5_000
    # the paper's recipe (train.batch_layout pairs): ~50 encoder passes a step instead of 10, priced by the encoder's
    # share of a step; SCST with beam candidates: SCST_IMAGE_COST XE images an SCST image, times the beam / sample
    # cost (both measured on an H200: benchmarks/bench_gpu.py)
    assert t["batch_layout"] == "pairs" and plan.encoder_passes(spec) == pytest.approx(50, abs=0.02)
    xe_cost = 1 + plan.ENCODER_SHARE * (plan.encoder_passes(spec) / 10 - 1)
    assert plan.xe_image_cost(spec) == pytest.approx(xe_cost)
    scst_cost = plan.SCST_IMAGE_COST * plan.BEAM_SCST_COST
    assert "~50.0 encoder passes a step (one per distinct image)" in out
    if scst:
        assert t["scst_candidates"] == "beam" and plan.scst_image_cost(spec) == pytest.approx(scst_cost)
        assert "SCST      10 images x 5 beams of a beam search of width 5" in out
    gpu_hours = (trials * (xe * (xe_cost * images + val) + scst * (scst_cost * images + val) + test)
                 / plan.IMAGES_PER_SECOND / 3600)
    assert (f"a validation image {beam5:.2f} (beam 5), a test image (5,000 when a trial ends, beam 5) {beam5:.2f}: "
            f"greedy {plan.VAL_IMAGE_COST:g} measured on an H200") in out and "113,287 train, 5,000 val, 5,000 test" in out
    assert f"beam 5 / greedy {plan.BEAM5_OVER_GREEDY:g} measured on a CPU" in out
    assert f"GPU-hours {gpu_hours:,.0f} for {trials} trials" in out
    price = plan.ON_DEMAND_PRICES["g5.12xlarge"] / 4
    assert f"cost      ${gpu_hours * price:,.0f}: g5.12xlarge at $5.672/h" in out
    header = path.read_text().split("\nname:")[0]  # each file's header states its plan
    assert f"{11_329 * (xe + scst):,}" in header and f"{trials} trials" in header
    stated = float(re.search(r"about ([\d,]+) GPU-hours", header)[1].replace(",", ""))
    assert stated == pytest.approx(gpu_hours, rel=0.05)


def test_fusion_ablation_seeds_resolve_every_table3_gap_to_the_baseline(capsys):
    spec = load_study(ROOT / "studies" / "fusion_ablation.yaml", check_files=False)
    seeds = spec.verdict_seeds  # the confirmation seeds
    from dashboards.stats import seeds_needed

    gaps = [delta for label, delta in plan.table3_gaps() if label.endswith("vs none")]
    from dashboards.stats import Noise

    noise = Noise(plan.COCO_SEED_SD, 0.0, plan.ARM_IMAGE_SD, plan.verdict_images(spec))  # what the plan assumes
    assert seeds == max(seeds_needed(delta, noise) for delta in gaps)


@pytest.mark.parametrize("name", COCO_STUDIES)
def test_shipped_coco_study_validates_on_a_synthetic_stand_in(name, tmp_path, capsys, s3_endpoint):
    """`a2 data synth` writes the files a COCO study names; with them the study validates completely (its bucket
    asked once, here an S3 endpoint on 127.0.0.1) and the plan counts the captions file."""
    from tests.s3server import unique_bucket

    paths = synthetic.generate(tmp_path / "coco", seed=0, images=120, test_images=12)
    bucket = unique_bucket(s3_endpoint, "a2-team")
    overrides = [f"data.captions={paths['captions']}", f"data.features={paths['features']}",
                 f"data.test_images={paths['test_images']}", f"storage=s3://{bucket}/a2-studies",
                 f"storage_endpoint_url={s3_endpoint}"]
    spec = load_study(ROOT / "studies" / f"{name}.yaml", overrides)
    train = synthetic.split_sizes(120)["train"]
    assert spec.images == synthetic.split_sizes(120) == {"train": train, "val": 30, "test": 30}
    assert spec.steps_per_epoch == math.ceil(train / 10)
    assert any(w.startswith("train.warmup:") for w in spec.warnings)  # 10,000 steps on 96 images: said so
    assert a2(["study", "validate", str(ROOT / "studies" / f"{name}.yaml"), *overrides]) == 0
    assert "warning: train.warmup" in capsys.readouterr().err


def test_synthetic_split_sizes_match_the_generator(tmp_path):
    from a2core.data.captions import read_karpathy

    paths = synthetic.generate(tmp_path / "d", seed=0, images=130, test_images=10)
    splits = read_karpathy(paths["captions"])
    assert {k: len(v) for k, v in splits.items()} == synthetic.split_sizes(130)


def test_the_throughput_default_is_the_recorded_estimate():
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert "Throughput for `a2 study plan`" in results
    assert f"**{plan.IMAGES_PER_SECOND:g} images/s per GPU**" in results
    assert KARPATHY_IMAGES == {"train": 113_287, "val": 5_000, "test": 5_000}


# -- what validate refuses and warns about ------------------------------------------------------------------------
def smoke(**changes) -> dict:
    raw = yaml.safe_load(SMOKE.read_text())
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if value is None:
            raw[section].pop(name, None)
        else:
            raw[section][name] = value
    return raw


def test_asha_with_one_replicate_is_an_error():
    with pytest.raises(ConfigError) as err:
        StudySpec.from_dict(smoke(search__replicates=None, search__purpose="explore"))
    assert err.value.path == "search.scheduler.asha" and "can never stop anything" in err.value.reason


def test_a_comparison_with_one_seed_per_arm_is_an_error_unless_it_explores():
    fifo = {"fifo": {}}
    with pytest.raises(ConfigError) as err:
        StudySpec.from_dict(smoke(search__replicates=None, search__scheduler=fifo))
    assert err.value.path == "search.replicates" and "2 configurations with one seed each" in err.value.reason
    spec = StudySpec.from_dict(smoke(search__replicates=None, search__scheduler=fifo, search__purpose="explore"))
    assert spec.num_arms == 2 and spec.seed_values == [0]
    # a seed grid gives every arm its seeds too
    space = {**smoke()["search"]["space"], "seed": {"grid": [0, 1]}}
    seeded = smoke(search__replicates=None, search__scheduler=fifo, search__space=space)
    assert StudySpec.from_dict(seeded).num_arms == 2


def test_a_batch_that_does_not_split_over_the_workers_is_refused():
    raw = smoke()
    raw["resources"]["workers_per_trial"] = 4
    with pytest.raises(ConfigError) as err:
        StudySpec.from_dict(raw)
    assert err.value.path == "train.batch_size"
    assert "25 image-caption pairs (5 images x 5 captions) do not split evenly over 4 workers" in err.value.reason
    assert "resources.workers_per_trial: 4" in err.value.reason


def test_long_warmup_and_tp_past_the_last_step_are_warnings(tmp_path, capsys):
    raw = smoke(train__warmup=850)  # 1600 XE steps in 8 epochs of 200
    raw["search"]["space"]["fusion"]["grid"] = ["none", "exp_decay"]
    raw["search"]["space"]["lambda"]["when"] = {"fusion": "exp_decay"}
    raw["search"]["space"]["temperature"] = {"loguniform": [100, 2000], "when": {"fusion": "exp_decay"}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    spec = load_study(path)
    assert [w.split(":")[0] for w in spec.warnings] == ["train.warmup", "search.space.temperature"]
    assert "53% of the 1600 cross-entropy steps" in spec.warnings[0]
    assert f"keeps {math.exp(-1600 / 2000):.0%} of the original attention" in spec.warnings[1]
    assert a2(["study", "validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert "warning: train.warmup: 850 steps" in err and "warning: search.space.temperature: T_P up to 2000" in err


def test_asha_with_no_rung_before_the_last_epoch_is_a_warning(tmp_path):
    """Rungs are epochs before the last (a group behind at its last epoch has nothing left to save): a grace period
    equal to the planned epochs gives ASHA no rung, which the study is told; one epoch less gives it one."""
    from launch.spec import scheduler_rungs
    warned = {}
    for grace, rungs in ((8, []), (7, [7])):
        raw = smoke()
        raw["search"]["scheduler"] = {"asha": {"grace_period": grace, "reduction_factor": 2}}
        spec = StudySpec.from_dict(raw)
        assert scheduler_rungs(spec) == rungs
        warned[grace] = [w for w in spec.warnings if w.startswith("search.scheduler.asha.grace_period")]
    assert warned[7] == []
    assert len(warned[8]) == 1 and "8 is the last of the 8 planned epochs, so ASHA has no rung" in warned[8][0]


def test_a_searched_batch_is_checked_warned_and_planned_at_the_trials_sizes(tmp_path, capsys):
    """The base holds a searched key at its schema default: a layout searched as pairs with a batch of 12 (which
    only the images layout refuses) is a valid study, and the schema's warnings and the plan read the trials'
    batches, not the base's."""
    raw = smoke(train__batch_size=12, train__batch_layout=None)
    raw["search"]["space"]["train.batch_layout"] = {"grid": ["pairs"]}
    spec = StudySpec.from_dict(raw)
    assert spec.trial_batches == [(12, "pairs")]

    raw = smoke(train__batch_size=None, train__warmup=500)  # 1000 train images: batch 25 -> 200 steps, 50 -> 100
    raw["search"]["space"]["train.batch_size"] = {"grid": [25, 50]}
    spec = StudySpec.from_dict(raw)
    assert spec.trial_batches == [(25, "images"), (50, "images")] and spec.fewest_steps_per_epoch == 100
    # warmup 500 is 31% of batch 25's 1600 XE steps, but 62% of batch 50's 800: warned for the trials at 50
    assert [w.split(":")[0] for w in spec.warnings] == ["train.warmup"]
    assert "500 steps is 62% of the 800 cross-entropy steps a trial takes (100 a epoch x 8)" in spec.warnings[0]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert a2(["study", "plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("trials train at a batch of 25 images (200 steps an epoch), 50 images (100 steps an epoch); the lines "
            "here and the cost are at 50 images (a searched key at its schema default)") in out


def test_purpose_is_documented_in_the_schema():
    from launch.spec import Search

    assert "explore" in Search.model_fields["purpose"].description


# -- the saved spec's format -----------------------------------------------------------------------------------------
def test_a_saved_study_yaml_records_its_format_and_one_without_reads_as_today(tmp_path):
    """`a2 study run` saves `format: 2`; a study file without it (every shipped one) is read as format 2, and a format
    from before the first release is refused naming the key."""
    from launch.location import STUDY_FILE, StudyLocation, load_saved_spec, saved_form

    spec = load_study(SMOKE, [f"storage={tmp_path}", f"tracking.mlflow_uri=sqlite:///{tmp_path / 'm.db'}"])
    saved = saved_form(spec)
    assert saved["format"] == 2
    (tmp_path / spec.name).mkdir()
    (tmp_path / spec.name / STUDY_FILE).write_text(yaml.safe_dump({k: v for k, v in saved.items() if k != "format"}))
    again = load_saved_spec(StudyLocation(spec.name, str(tmp_path)))
    assert again.to_dict() == spec.to_dict() and again.base["train"]["batch_size"] == 25
    with pytest.raises(ConfigError, match=r"format: .*2"):
        StudySpec.from_dict({**saved, "format": 1})


# -- adaptive replicates, priced beside the fixed design --------------------------------------------------------------
def test_plan_prices_adaptive_replicates_beside_the_fixed_design(tmp_path, capsys):
    """fusion_ablation's plan prints, after the fixed design's cost, the adaptive design's expected seed-trials and
    GPU-hours against the fixed design's at equal power, labelled an estimate of a design the driver does not run,
    from `dashboards.sequential.simulate` with a fixed seed (the same figures every run), under 62% of the fixed
    design's seed-trials (benchmarks/bench_sequential.py: 56%, the seed variance pooled over the arms); with --delta
    or one arm it prints none."""
    from dashboards.sequential import Design, simulate, spending_weights
    from dashboards.stats import Noise

    path = ROOT / "studies" / "fusion_ablation.yaml"
    assert a2(["study", "plan", str(path), f"storage={tmp_path}"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("adaptive replicates"):]
    assert out.index("GPU-hours 753 for 55 trials") < out.index("adaptive replicates")
    assert "an ESTIMATE for search.replicates: {min: 3, max: 9}, which the driver runs in rounds" in block
    assert f"{plan.ADAPTIVE_STUDIES:,} simulated studies, seed {plan.ADAPTIVE_SEED}" in block
    spec = load_study(path, check_files=False)
    noise = Noise(plan.COCO_SEED_SD, 0.0, plan.ARM_IMAGE_SD, 5_000)
    rounds = plan.ADAPTIVE_ROUNDS
    run = simulate(Design(rounds, spending_weights(rounds), futility_gap=2.3), noise, [2.8, 2.3, 4.2, 5.0],
                   [1, 2, 2, 8, 2], plan.ADAPTIVE_STUDIES, plan.ADAPTIVE_SEED)
    per_trial = plan.estimate(spec, plan.IMAGES_PER_SECOND, plan.cluster_workers()).gpu_hours / 55
    found = re.search(r"seed-trials ([\d.]+) expected \(([\d.]+) with all arms equal\) against ([\d.]+) for fixed "
                      r"seeds at equal power \(moving_average's (\d+)%\): (\d+)%; the study's 5 confirmation seeds: 55", block)
    assert found, block
    adaptive, fixed = float(found[1]), float(found[3])
    assert adaptive == pytest.approx(run["seed_trials"], abs=0.05) and found[4] == f"{run['power'][1]:.0%}"[:-1]
    assert 75 < fixed < 105 and adaptive / fixed < 0.62 and found[5] == f"{adaptive / fixed:.0%}"[:-1]
    hours = re.search(r"GPU-hours ([\d,]+) expected against ([\d,]+) fixed at equal power", block)
    assert hours, block  # the plan prices the unrounded seed-trials: within a rounding of the figures printed above
    assert [float(h.replace(",", "")) for h in hours.groups()] == [pytest.approx(adaptive * per_trial, abs=2),
                                                                 pytest.approx(fixed * per_trial, abs=2)]
    # the power also priced with seeds lost (errored or diverged): lower than with none, from the same simulation
    lossy = simulate(Design(rounds, spending_weights(rounds), futility_gap=2.3), noise, [2.8, 2.3, 4.2, 5.0],
                     [1, 2, 2, 8, 2], plan.ADAPTIVE_STUDIES, plan.ADAPTIVE_SEED, seed_loss=plan.PRICED_SEED_LOSS)
    assert plan.PRICED_SEED_LOSS == 0.1 and sum(lossy["power"]) < sum(run["power"])  # an arm at 100% may stay
    assert (f"losses    the above with no seed lost; with 10% of seeds lost (errored or diverged, each on its own): "
            f"power {' / '.join(f'{p:.0%}' for p in lossy['power'])}, {lossy['seed_trials']:.1f} seed-trials "
            f"expected") in block
    again = plan.adaptive_text(spec, noise, per_trial)
    assert again.strip() == block.strip()  # a fixed seed: the same figures every run

    assert a2(["study", "plan", str(path), f"storage={tmp_path}", "--delta", "2"]) == 0
    assert "adaptive replicates" not in capsys.readouterr().out
    assert plan.adaptive_text(spec, None, per_trial) == ""
    assert a2(["study", "plan", str(SMOKE), f"storage={tmp_path}"]) == 0  # synthetic, nothing measured: no noise
    assert "adaptive replicates" not in capsys.readouterr().out
    assert a2(["study", "plan", str(SMOKE), f"storage={tmp_path}", "--sd", "1.0"]) == 0
    smoke_out = capsys.readouterr().out  # gate against none, no GPU: seed-trials only
    assert "gate vs none at 5:" in smoke_out and "seed-trials" in smoke_out
    assert "GPU-hours" not in smoke_out[smoke_out.index("adaptive replicates"):]


def test_the_wall_time_uses_no_more_gpus_than_the_studys_trials_hold_and_says_a_fraction_as_one():
    """studies/seeds.yaml runs 4 one-GPU trials: 16 side by side allowed still hold 4 GPUs (its wall time is a
    quarter of its GPU-hours, not a sixteenth); trials of a quarter GPU, two side by side, hold half a card."""
    spec = load_study(ROOT / "studies" / "seeds.yaml", ["resources.max_concurrent_trials=16"], check_files=False)
    est = plan.estimate(spec, plan.IMAGES_PER_SECOND, None)
    assert spec.tune_samples == 4 and est.gpus_at_once == 4
    assert est.wall_hours == pytest.approx(est.gpu_hours / 4)
    packed = load_study(SMOKE, ["resources.gpus_per_worker=0.25"], check_files=False)
    assert plan.estimate(packed, plan.IMAGES_PER_SECOND, None).gpus_at_once == 0.5


@pytest.mark.parametrize("warmup, epoch", [(400, 2), (401, 3), (200, 1), (1, 1)])
def test_the_learning_rate_peaks_in_the_epoch_of_the_last_warmup_step(warmup, epoch, capsys):
    """Noam's rate peaks at step `warmup` (1-based): smoke's 200 steps an epoch put warmup 400 at epoch 2's end."""
    assert a2(["study", "plan", str(SMOKE), f"train.warmup={warmup}"]) == 0
    out = capsys.readouterr().out
    assert "steps     200 a epoch" in out and f"(the learning rate peaks in epoch {epoch})" in out, out


def test_a_seed_grid_is_one_configurations_seeds_as_replicates_are():
    """search.space.seed as a grid is the same study as search.replicates: 5 fusions, one configuration each, 3 seeds
    (its seed cells counted as configurations tripled the adaptive design's seed-trials and said each fusion was
    chosen among 3)."""
    grid = load_study(ROOT / "studies" / "synthetic_fusions.yaml",
                      ["search.replicates=null", "search.space.seed={grid: [0, 1, 2]}"], check_files=False)
    replicates = load_study(ROOT / "studies" / "synthetic_fusions.yaml", ["search.replicates=3"], check_files=False)
    assert plan.configurations_per_fusion(grid) == plan.configurations_per_fusion(replicates) == {
        "none": 1, "max": 1, "moving_average": 1, "exp_decay": 1, "gate": 1}
    assert plan.selected_fusions(grid) == ""


def test_a_one_seed_study_is_priced_with_no_power_and_its_own_trials(capsys):
    """An explore study of one seed a configuration: its verdicts need two seeds, so the adaptive lines give it no
    power and its 5 trials (they printed the 2-seed design's power and 10 seed-trials)."""
    assert a2(["study", "plan", str(ROOT / "studies" / "synthetic_fusions.yaml"), "search.replicates=1",
               "search.purpose=explore", "--sd", "1"]) == 0
    out = capsys.readouterr().out
    assert "(the study's 1 fixed seed: 0% / 0% / 0% / 0%)" in out and "; the study's 1 seed: 5\n" in out, out
