"""`a2 study plan`: seeds per arm for the paper's Table 3 gaps, from a given or a measured seed spread."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from a2core.errors import StudyError
from dashboards.stats import Noise, seeds_needed
from launch.cli import main as a2
from launch.plan import ARM_IMAGE_SD, measured_sd, table3_gaps, verdict_images
from tests.studyfolder import fabricated_study

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


def _power_rows(out: str) -> dict[str, list[str]]:
    """The rows of the power table: {difference: [delta, seeds needed, power at the study's seeds]}."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("difference")) + 1
    rows = {}
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        rows[line[4:30].strip()] = line[30:].split()
    return rows


def test_a_val_cap_above_the_split_prices_and_powers_the_split(study_file):
    """data.val_images caps validation at the split's first N images (the trainer's `limit`): a cap above the split
    validates the split. It used to price 5000 val images an epoch for a 500-image split and judge the verdicts'
    power on 5000 images."""
    from launch import plan
    from launch.spec import load_study

    def spec(*overrides):
        return load_study(study_file, ["resources.gpus_per_worker=1", "train.test_at_end=false", *overrides],
                          check_files=False)

    split = spec().images["val"]
    assert split == 500 and plan.validated_images(spec()) == verdict_images(spec()) == split
    over, under = spec("data.val_images=5000"), spec("data.val_images=100")
    assert plan.validated_images(over) == verdict_images(over) == split
    assert plan.estimate(over, 100.0, None).gpu_hours == plan.estimate(spec(), 100.0, None).gpu_hours
    assert plan.validated_images(under) == verdict_images(under) == 100
    assert plan.estimate(under, 100.0, None).gpu_hours < plan.estimate(spec(), 100.0, None).gpu_hours


def test_plan_with_a_given_spread(study_file, capsys):
    assert a2(["study", "plan", str(study_file), "--sd", "1.5"]) == 0
    out = capsys.readouterr().out
    rows = _power_rows(out)
    from launch.spec import load_study

    images = verdict_images(load_study(study_file, check_files=False))
    noise = Noise(1.5, 0.0, ARM_IMAGE_SD, images)  # the given spread, the assumed arm x image term
    assert "CIDEr seed spread sd 1.50, arm x image sd 10.0 over" in out and "seed spread given; arm x image" in out
    # smoke runs none and gate: its one verdict, gate vs none, at Table 3's gain (a family of one); the fusions it
    # does not run (max, moving_average, exp_decay) get no row, and no pair of searched fusions is left to compare
    assert list(rows) == ["gate vs none"]
    assert rows["gate vs none"][:2] == ["5.0", str(seeds_needed(5.0, noise, family=1))]
    assert "for the adjusted verdict" not in out  # one comparison: no Holm family
    assert "never: the images' own variance" not in out
    assert a2(["study", "plan", str(study_file), "--sd", "1.5", "--delta", "0.5"]) == 0
    out = capsys.readouterr().out
    assert _power_rows(out)["0.5 CIDEr"][:2] == ["0.5", "never"]  # the images alone leave more than 0.5 / 2.8
    assert "never: the images' own variance (500 images)" in out
    # smoke with 3 replicates: 3 configurations (none, 2 gate samples) x 3 seeds x 20 epochs
    assert "trials    9 = 3 configurations x 3 seeds; 180 trial-epochs (before early stopping)" in out
    assert "steps     200 a epoch; 4,000 in 20 epochs (20 XE + 0 SCST)" in out
    assert "the trials use no GPU" in out


def test_plan_measures_the_spread_in_the_finished_study(study_file, tmp_path, capsys, monkeypatch):
    fab = fabricated_study(tmp_path, "a2-smoke", epochs=1)
    fab.patch_tune(monkeypatch)
    with pytest.raises(StudyError, match="no configuration with two seeds"):
        measured_sd(fab.record())
    for group, values in {0.01: (10.0, 12.0, 14.0), 0.02: (20.0, 21.0, 22.0)}.items():
        for seed, v in enumerate(values):
            fab.add(f"{group}-{seed}", {"fusion": "gate", "lambda": group, "seed": seed}, [{"epoch": 1, "val/CIDEr": v}])
    sd, groups = measured_sd(fab.record())
    assert groups == 2 and sd == pytest.approx(((4 + 1) / 2) ** 0.5)  # pooled variances 4 and 1
    assert a2(["study", "plan", str(study_file), "--delta", "3", "--storage", fab.spec.storage]) == 0
    out = capsys.readouterr().out
    assert "CIDEr seed spread sd 1.58\n            (measured in study a2-smoke, 2 replicate groups (seed values only" in out
    assert _power_rows(out)["3 CIDEr"][:2] == ["3.0", str(seeds_needed(3.0, sd))]


def test_plan_measures_the_noise_in_per_image_scores(study_file, tmp_path, capsys, monkeypatch):
    """Finished seeds with per-image test scores: the plan's power is the rule's at the components measured in
    them (`dashboards.stats.noise_of`) and at their number of images."""
    import numpy as np

    from dashboards.stats import noise_of, power
    from launch.plan import measured_noise

    fab = fabricated_study(tmp_path, "a2-smoke", epochs=1)
    fab.patch_tune(monkeypatch)
    rng = np.random.default_rng(0)
    ids = [str(i) for i in range(300)]
    scores, difficulty = {}, rng.normal(100, 30, 300)  # shared by the groups; each has its own strengths (sd 5)
    for group in (0.01, 0.02):
        strengths = difficulty + rng.normal(0, 5, 300)
        scores[group] = [strengths + rng.normal(0, 1.0) + rng.normal(0, 20, 300) for _ in range(3)]
        for seed, row in enumerate(scores[group]):
            fab.add(f"{group}-{seed}", {"fusion": "gate", "lambda": group, "seed": seed},
                    [{"epoch": 1, "val/CIDEr": float(row.mean()), "test/CIDEr": float(row.mean())}],
                    per_image={"test": dict(zip(ids, map(float, row)))})
    noise, source = measured_noise(fab.record())
    order = np.argsort(ids)  # the record's image order: sorted ids
    expected = noise_of([np.stack(scores[g])[:, order] for g in (0.01, 0.02)])
    assert noise.images == expected.images == 300
    assert (noise.seed_sd, noise.run_sd, noise.arm_image_sd) == pytest.approx(
        (expected.seed_sd, expected.run_sd, expected.arm_image_sd), rel=1e-9)
    assert noise.run_sd == pytest.approx(20, rel=0.1) and noise.arm_image_sd == pytest.approx(5, abs=2.5)  # as drawn
    assert source == "measured in study a2-smoke: 2 replicate groups' per-image test scores"
    assert a2(["study", "plan", str(study_file), "--delta", "8", "--storage", fab.spec.storage]) == 0
    out = capsys.readouterr().out
    assert f"CIDEr {noise.text()}\n            ({source})" in out
    assert _power_rows(out)["8 CIDEr"] == ["8.0", str(seeds_needed(8.0, noise)), f"{power(3, 8.0, noise):.0%}"]


def test_plan_prices_from_the_newest_gpu_record_in_the_study_mode(study_file, tmp_path, capsys, monkeypatch):
    """`a2 study plan` prices a study from the newest CUDA record of benchmarks/bench_fused.py (an older one, a CPU
    one and another script's passed over) at the aggregate images/s a card of the study's mode, and names the
    record: one trial a card, trials packed on a card (a fraction of a GPU), or its seeds fused
    (`resources.fuse_replicates`: stage 1 fused, the other stages per seed), their step captured in CUDA graphs
    (`resources.capture_step`: the `captured` arm)."""
    import json

    from launch import plan
    from launch.spec import load_study

    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setattr(plan, "GPU_RECORDS", records)
    assert plan.measured_throughput(load_study(study_file, check_files=False)) is None  # no record: the estimate

    def write(name, date, device, arms, **extra):
        (records / name).write_text(json.dumps({"date": date, "machine": f"card of {date}", "device": device, **extra,
                                                "arms": [{"kind": kind, "precision": p, "k": k, "images_per_s": ips}
                                                         for kind, p, k, ips in arms]}))
    write("fused-cpu-2026-12-09.json", "2026-12-09", "cpu", [("single", "fp32", 1, 5.0)])
    write("fused-card-2026-12-01.json", "2026-12-01", "cuda", [("single", "fp32", 1, 50.0)])
    (records / "h200-2026-12-08.json").write_text(json.dumps({"date": "2026-12-08", "device": "NVIDIA H200"}))
    write("fused-card-2026-12-05.json", "2026-12-05", "cuda",
          [("single", "fp32", 1, 100.0), ("single", "tf32", 1, 120.0), ("fused", "tf32", 2, 300.0),
           ("fused", "tf32", 4, 500.0), ("fused", "bf16", 2, 999.0), ("packed", "tf32", 2, 180.0),
           ("packed", "tf32", 4, 260.0), ("captured", "tf32", 2, 450.0)])
    name = "records/fused-card-2026-12-05.json (card of 2026-12-05, 2026-12-05)"

    def planned(*overrides):
        spec = load_study(study_file, ["resources.gpus_per_worker=1", *overrides], check_files=False)
        assert a2(["study", "plan", str(study_file), "resources.gpus_per_worker=1", *overrides, "--sd", "1"]) == 0
        return spec, plan.measured_throughput(spec), capsys.readouterr().out

    spec, got, out = planned()
    assert got.images_per_second == 100.0 and got.source.endswith(f"{name}; one trial a card (fp32)")
    assert "speed     100 training images/s per GPU (measured: " in out and f"{name}; one trial a card (fp32))" in out
    assert f"GPU-hours {plan.estimate(spec, 100.0, None).gpu_hours:,.0f} for 9 trials" in out
    # 4 trials a card: the packed arm of 4; 3 a card: the largest measured below, 2
    assert planned("resources.gpus_per_worker=0.25")[1].images_per_second == 260.0
    packed = planned("resources.gpus_per_worker=0.34")[1]
    assert packed.images_per_second == 180.0 and packed.source.endswith("2 trials packed on a card (tf32), all together")
    # 3 seeds fused: stage 1 at the fused arm of k = 2 (the largest <= 3) in TF32, validation at one seed's TF32 speed
    spec, got, out = planned("resources.fuse_replicates=true")
    t = spec.base["train"]
    work = plan.estimate(spec, 1.0, None).gpu_hours
    xe = 9 * t["xe_epochs"] * plan.xe_image_cost(spec) * spec.steps_per_epoch * t["batch_size"] // 5 / 3600
    assert got.images_per_second == pytest.approx(work / (xe / 300 + (work - xe) / 120), abs=0.05)
    assert 120 < got.images_per_second < 300
    assert "stage 1 at 300 images/s a card, 2 seeds fused (tf32), the other stages per seed at 120" in out
    hours = plan.estimate(spec, got.images_per_second, None).gpu_hours
    assert 0.1 < hours < 1 and f"GPU-hours {hours:.2f} for 9 trials" in out  # two significant digits below 1
    # the same, captured: stage 1 at the captured arm
    captured = planned("resources.fuse_replicates=true", "resources.capture_step=true")[1]
    assert captured.images_per_second == pytest.approx(work / (xe / 450 + (work - xe) / 120), abs=0.05)
    assert "stage 1 at 450 images/s a card, 2 seeds fused, captured (tf32)" in captured.source
    # a throughput given wins over the record
    assert a2(["study", "plan", str(study_file), "resources.gpus_per_worker=1", "--sd", "1",
               "--images-per-second", "77"]) == 0
    assert "speed     77 training images/s per GPU (given)" in capsys.readouterr().out


def test_the_fill_a_gpu_how_to_prices_every_mode(tmp_path, capsys, monkeypatch):
    """docs/how-to/fill-a-gpu.md's `a2 study plan` lines, as written there, each priced from a card's record in its
    own mode (the record: one of every arm the benchmark writes); a study with confirmation seeds fused in two rounds,
    each at the arm of its seeds (the search's 2, the confirmation's 5: the largest measured below, 4)."""
    import json
    import shlex

    from launch import plan
    from launch.spec import load_study

    from tests.test_readme import readme_blocks

    root = Path(__file__).resolve().parents[1]
    records = tmp_path / "records"
    records.mkdir()
    arms = [("single", "fp32", 1, 115.0), ("single", "tf32", 1, 120.0), ("fused", "tf32", 2, 300.0),
            ("fused", "tf32", 4, 500.0), ("captured", "tf32", 2, 450.0), ("packed", "tf32", 4, 400.0)]
    (records / "fused-card-2026-12-03.json").write_text(json.dumps({
        "date": "2026-12-03", "machine": "the card", "device": "cuda",
        "arms": [{"kind": kind, "precision": p, "k": k, "images_per_s": ips} for kind, p, k, ips in arms]}))
    monkeypatch.setattr(plan, "GPU_RECORDS", records)
    monkeypatch.chdir(root)
    page = (root / "docs" / "how-to" / "fill-a-gpu.md").read_text()
    lines = [line for block in readme_blocks(page) for line in block["lines"] if line.startswith("a2 study plan ")]
    expected = ["one trial a card (fp32)", "4 trials packed on a card (tf32), all together",
                "4 seeds fused (tf32)", "2 seeds fused, captured (tf32)",  # smoke's 4 seeds; captured: measured at 2
                "stage 1 at 300 images/s a card, 2 seeds fused (tf32); then at 500 images/s a card, 4 seeds fused",
                "4 trials packed on a card (tf32), all together"]
    assert len(lines) == len(expected)
    for line, arm in zip(lines, expected):
        assert a2(shlex.split(line)[1:]) == 0, line
        out = capsys.readouterr().out
        if "fusion_ablation" in line and "fuse_replicates=true" in line:
            assert ("  fused     20 Tune trials, each a configuration's seeds of a round trained together "
                    "(resources.fuse_replicates): 15 of 2 seeds, then 5 of 5 seeds\n") in out
        speed = next(s for s in out.splitlines() if s.lstrip().startswith("speed"))
        assert "(measured: " in speed and "the card, 2026-12-03" in speed and arm in speed, (line, speed)
    # every plan also prices the other modes from the record (the last line's: fusion_ablation, packed 4 a card)
    one, two, four, fused, captured = out[out.index("\nmodes "):].splitlines()[2:7]
    ablation = load_study(root / "studies" / "fusion_ablation.yaml", check_files=False)
    hours = plan.estimate(ablation, 1.0, None).gpu_hours
    assert one.split() == ["one", "trial", "a", "card", "115.0", "images/s", "a", "card", f"{hours / 115:,.0f}",
                           "GPU-hours"]
    assert two.split(None, 5)[5] == "not measured by the record"  # the record packed 4 trials a card, not 2
    assert "400.0 images/s a card" in four and four.endswith(f"{hours / 400:,.0f} GPU-hours   <- this study")
    # fused: the search's 30 seed-trials (15 configurations x 2) at the arm of 2, the confirmation's 25 (5 fusions x
    # 5) at the arm of 4 (the largest below 5), validation and test per seed at one seed's 120; captured: at 450
    t = ablation.base["train"]
    xe = t["xe_epochs"] * plan.xe_image_cost(ablation) * ablation.steps_per_epoch * t["batch_size"] // 5 / 3600
    assert ablation.num_trials == 30 + 25
    for row, rates in ((fused, (300, 500)), (captured, (450, 450))):
        ips = hours / (30 * xe / rates[0] + 25 * xe / rates[1] + (hours - 55 * xe) / 120)
        assert f"{round(ips, 1):,.1f} images/s a card" in row and f"{hours / round(ips, 1):,.0f} GPU-hours" in row, row
