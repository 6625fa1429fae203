"""`a2 study plan`'s edges: power rows that are the study's own family of verdicts (each searched fusion against none,
Holm over them; a pair of fusions says how it is tested; a study that compares no fusion states its gaps as
assumed), validation and test images priced with the decoding they use (beam search, not greedy), and the cluster
and price options never silently ignored."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from a2core.errors import StudyError
from dashboards.stats import Noise, power, seeds_needed
from launch import plan
from launch.spec import load_study

ROOT = Path(__file__).resolve().parents[1]
WORKERS = plan.Workers("g5.12xlarge", 4, True, 4)  # ray-cluster.yaml's worker type


def _study(name, *overrides):
    return load_study(ROOT / "studies" / f"{name}.yaml", list(overrides), check_files=False)


def _noise(spec, sd=plan.COCO_SEED_SD):
    return Noise(sd, 0.0, plan.ARM_IMAGE_SD, plan.verdict_images(spec))


def _text(spec, noise, gaps=None):
    return plan.plan_text(spec, noise, "given", gaps, 100.0, "given", WORKERS, None)


def _rows(out: str) -> dict[str, list[str]]:
    """The power table: {difference: [delta, seeds needed, power at the study's seeds]}."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("difference")) + 1
    rows = {}
    for line in lines[start:]:
        if not line.startswith("    ") or line.startswith("    never"):
            break
        rows[line[4:30].strip()] = line[30:].split()
    return rows


def _cell(p: float) -> str:
    return plan._power_text(p)


def _smoke_file(tmp_path, fusions):
    raw = yaml.safe_load((ROOT / "studies" / "smoke.yaml").read_text())
    raw["search"]["space"]["fusion"] = {"grid": list(fusions)}
    raw["search"]["space"]["lambda"]["when"] = {"fusion": [f for f in fusions if f != "none"]}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# -- 1. the power rows are the study's family ----------------------------------------------------------------------------
def test_fusion_ablation_rows_are_its_verdicts_and_the_pair_says_how_it_is_tested():
    """Each fusion against none at the verdicts' family (4, Holm); max vs moving_average is no verdict of the study:
    the plan says `compare --baseline moving_average` tests it, one of 4 comparisons with that row."""
    spec = _study("fusion_ablation")
    noise = _noise(spec)
    out = _text(spec, noise)
    rows = _rows(out)
    assert list(rows) == ["max vs none", "moving_average vs none", "exp_decay vs none", "gate vs none",
                          "max vs moving_average"]
    for label, delta in [("max vs none", 2.8), ("moving_average vs none", 2.3), ("exp_decay vs none", 4.2),
                         ("gate vs none", 5.0)]:
        assert rows[label] == [f"{delta:.1f}", str(seeds_needed(delta, noise, family=4)),
                               _cell(power(5, delta, noise, family=4))]
    assert rows["moving_average vs none"] == ["2.3", "7", "62%"]
    assert rows["max vs moving_average"][:2] == ["0.5", "never"]
    assert rows["max vs moving_average"][2] == _cell(power(5, 0.5, noise, family=4))
    assert ("max vs moving_average, Table 3's smallest gap between two of its fusions: no verdict of the study "
            "(those are each fusion against none); `a2 study compare --by fusion --baseline moving_average` tests "
            "it, one of the 4 comparisons with moving_average (Holm)") in out
    assert "4 fusions against the baseline are one family (Holm), each tested at 5% / 4 = 0.0125" in out


def test_a_study_of_none_and_gate_has_one_row_its_one_verdict(tmp_path):
    """smoke searches none and gate: one comparison, no Holm; no row for the fusions it does not run (there used to be
    four more, max vs moving_average among them, at a family that was not the study's)."""
    spec = load_study(ROOT / "studies" / "smoke.yaml", check_files=False)
    noise = _noise(spec, 1.5)
    out = _text(spec, noise)
    rows = _rows(out)
    assert rows == {"gate vs none": ["5.0", str(seeds_needed(5.0, noise)), _cell(power(4, 5.0, noise))]}
    assert "Holm" not in out and "max vs" not in out and "moving_average" not in out


def test_three_fusions_are_a_family_of_two_and_their_pair_is_tested_against_the_lower(tmp_path):
    spec = load_study(_smoke_file(tmp_path, ["none", "max", "moving_average"]), check_files=False)
    noise = _noise(spec, 1.5)
    assert plan.verdict_family(spec) == 2
    rows, notes = plan.power_rows(spec)
    assert rows == [plan.PowerRow("max vs none", 2.8, 2), plan.PowerRow("moving_average vs none", 2.3, 2),
                    plan.PowerRow("max vs moving_average", 0.5, 2)]
    out = _text(spec, noise)
    table = _rows(out)
    assert list(table) == ["max vs none", "moving_average vs none", "max vs moving_average"]
    assert table["max vs none"][2] == _cell(power(4, 2.8, noise, family=2))
    assert "--baseline moving_average` tests it, one of the 2 comparisons with moving_average (Holm)" in out
    assert "2 fusions against the baseline are one family (Holm), each tested at 5% / 2 = 0.025" in out


def test_given_gaps_are_tested_as_the_studys_verdicts():
    spec = _study("fusion_ablation")
    rows, _ = plan.power_rows(spec, [("3 CIDEr", 3.0)])
    assert rows == [plan.PowerRow("3 CIDEr", 3.0, 4)]


# -- 3. a study that compares no fusion --------------------------------------------------------------------------------
def test_lambda_sweep_power_is_at_assumed_gaps_between_its_lambdas():
    """lambda_sweep searches 12 lambdas under gate and no fusion: no row names a fusion comparison; the gaps are said
    to be assumed (Table 3's, as sizes), each tested as `compare --by lambda --baseline VALUE` does: one of the 11
    other rows against the one named, Holm."""
    spec = _study("lambda_sweep")
    assert spec.num_arms == 12 and plan.searched_fusions(spec) == []
    noise = _noise(spec)
    out = _text(spec, noise)
    rows = _rows(out)
    assert list(rows) == ["0.5 CIDEr", "2.3 CIDEr", "2.8 CIDEr", "4.2 CIDEr", "5 CIDEr"]
    assert not any("vs none" in label for label in rows)
    for label, row in rows.items():
        delta = float(row[0])
        needed = seeds_needed(delta, noise, family=11)
        assert row[1:] == ["never" if needed is None else str(needed), _cell(power(3, delta, noise, family=11))]
    assert rows["2.3 CIDEr"] == ["2.3", "8", "11%"]
    assert ("`a2 study compare --by lambda --baseline VALUE` compares each of the other 11 rows with one (Holm over "
            "them)") in out
    assert "the gaps are ASSUMED: no record gives the CIDEr gaps between its lambda values" in out
    assert "11 rows against the one named are one family (Holm), each tested at 5% / 11" in out
    given, _ = plan.power_rows(spec, [("1.5 CIDEr", 1.5)])
    assert given == [plan.PowerRow("1.5 CIDEr", 1.5, 11)]


# -- 2. validation and test images priced with their decoding --------------------------------------------------------
def test_decoding_is_priced_at_its_beam():
    greedy, beam5 = plan.VAL_IMAGE_COST, plan.VAL_IMAGE_COST * plan.BEAM5_OVER_GREEDY
    assert plan.BEAM5_OVER_GREEDY == 1.46 and beam5 == pytest.approx(2.92)
    assert plan.decode_image_cost(1) == greedy
    assert plan.decode_image_cost(5) == pytest.approx(beam5)
    assert plan.decode_image_cost(3) == pytest.approx(2.0 * (1 + 0.46 / 2))  # linear in the width
    spec = _study("fusion_ablation")  # val_decode beam, beam_size 5
    assert plan.val_image_cost(spec) == plan.test_image_cost(spec) == pytest.approx(beam5)
    greedy_val = _study("fusion_ablation", "train.val_decode=greedy")
    assert plan.val_image_cost(greedy_val) == greedy
    assert plan.test_image_cost(greedy_val) == pytest.approx(beam5)  # the test evaluation is always beam search
    one = _study("fusion_ablation", "train.beam_size=1")  # beam 1 decodes greedily
    assert plan.val_image_cost(one) == plan.test_image_cost(one) == greedy


def test_fusion_ablation_gpu_hours_price_beam_validation_and_test():
    """One trial: 20 epochs of 113,290 pairs-layout images (2.04 each) and 5,000 beam-5 val images (2.92 each), then
    5,000 beam-5 test images; at 100 images/s."""
    spec = _study("fusion_ablation")
    xe = 1 + plan.ENCODER_SHARE * (50 / 10 - 1)
    work = 20 * (xe * 113_290 + 2.92 * 5_000) + 2.92 * 5_000
    per_trial = work / 100 / 3600
    assert per_trial == pytest.approx(13.69, abs=0.01)  # 13.42 with greedy-priced decoding
    est = plan.estimate(spec, 100.0, WORKERS)
    assert est.gpu_hours == pytest.approx(55 * per_trial, rel=1e-3)
    assert est.wall_hours == pytest.approx(4 * per_trial, rel=1e-3)  # 4 waves of 16
    greedy_val = plan.estimate(_study("fusion_ablation", "train.val_decode=greedy"), 100.0, WORKERS)
    assert greedy_val.gpu_hours == pytest.approx(55 * (work - 20 * 0.92 * 5_000) / 100 / 3600, rel=1e-3)
    out = _text(spec, _noise(spec))
    assert "a validation image 2.92 (beam 5), a test image (5,000 when a trial ends, beam 5) 2.92" in out
    assert "beam 5 / greedy 1.46 measured on a CPU" in out
    assert "a validation image 2.00 (greedy)" in _text(_study("fusion_ablation", "train.val_decode=greedy"), None)


# -- options never silently ignored ----------------------------------------------------------------------------------
def test_a_missing_cluster_file_is_an_error_and_no_cluster_prices_nothing():
    spec = _study("seeds")
    with pytest.raises(StudyError, match="--cluster .*nope.yaml: no such cluster-launcher file"):
        plan.study_plan(spec, cluster=ROOT / "nope.yaml", sd=1.0)
    out = plan.study_plan(spec, cluster=None, sd=1.0)  # used to fail in Path(None)
    assert "GPU-hours" in out and "g5.12xlarge" not in out


def test_a_price_without_a_gpu_worker_type_says_it_is_not_used(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"available_node_types": {"head": {"resources": {"CPU": 4}}}}))
    out = plan.study_plan(_study("seeds"), cluster=cluster, price_per_hour=3.0, sd=1.0)
    assert ("cost      not priced: the cluster file names no GPU worker type, so a node's --price-per-hour 3 has no "
            "GPUs to divide by") in out
