"""Hostile and edge inputs to the read side (`dashboards.records`, `stats`, `compare`, `tables`): a score so large its
variance overflows, a `--baseline` written as another text of the row's number, a `|` in a markdown cell, per-image
scores of fewer than 2 images, and a per-image file that holds no numbers. Each gives the right numbers or a one-line
error (`A2Error`) naming the file, the arm, the seed or the trial; never a traceback or an infinite interval."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from a2core.errors import DataError, StudyError
from a2core.selection import finite
from dashboards.compare import compare_table, study_comparison
from dashboards.records import SCORE_BOUND, check_markdown, load_record, render_table, tables_in
from dashboards.runs import CIDER, Study, Trial
from dashboards.stats import paired_difference, seed_difference, seed_interval
from dashboards.tables import markdown_cell, text_table
from tests.test_records import make_record


def write(tmp_path, record: dict):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    return path


# -- 1. a per-seed or per-image score beyond any x100 score -------------------------------------------------------
@pytest.mark.parametrize("value", [1e308, 1e200, -1e7], ids=["1e308", "1e200", "-1e7"])
def test_a_per_seed_score_beyond_the_bound_is_refused_naming_file_label_and_seed(tmp_path, value):
    """1e308 gave the row '3.3e307 [-inf, inf]' and a '[-inf, +inf]: not resolved' verdict (its square overflowed)."""
    record = make_record({"none": 3, "gate": 3})
    record["arms"][1]["seeds"] = [4, 5, 6]
    record["arms"][1]["scores"]["val/CIDEr"][1] = value
    with pytest.raises(DataError, match=re.escape(f"r.json: arm gate, seed 5: val/CIDEr {value!r} is beyond "
                                                  f"1,000,000 in magnitude: no x100 score")) as err:
        load_record(write(tmp_path, record))
    assert "\n" not in str(err.value)


def test_a_per_image_score_beyond_the_bound_is_refused_naming_the_image(tmp_path):
    record = make_record({"none": 3, "gate": 3})
    record["arms"][0]["per_image"]["scores"][2][4] = 1e308
    with pytest.raises(DataError, match=re.escape("r.json: arm none, seed 2: per-image score of image 104 1e+308 is "
                                                  "beyond 1,000,000 in magnitude")):
        load_record(write(tmp_path, record))


def test_scores_up_to_the_bound_load_and_give_finite_intervals(tmp_path):
    record = make_record({"none": 3, "gate": 3})
    for arm in record["arms"]:
        arm.pop("per_image")
    record["arms"][1]["scores"]["val/CIDEr"] = [SCORE_BOUND, -SCORE_BOUND, 0.0]
    table = render_table(load_record(write(tmp_path, record)))
    gate = next(line for line in table.splitlines() if line.startswith("| gate"))
    assert seed_interval([SCORE_BOUND, -SCORE_BOUND, 0.0]).text() in gate and "inf" not in table


def test_an_overflowing_variance_gives_no_verdict_and_a_finite_interval():
    """Outside records (a study's own scores), the arithmetic itself: the seeds' spread is computed on scaled scores
    (the same interval, scaled), and a difference whose variance is infinite has no interval, never a verdict."""
    scaled = seed_interval([1.0, 1e-200, 2e-200])
    big = seed_interval([1e200, 1.0, 2.0])
    assert all(math.isfinite(v) for v in (big.low, big.high))
    assert (big.mean, big.low, big.high) == pytest.approx((scaled.mean * 1e200, scaled.low * 1e200,
                                                           scaled.high * 1e200), rel=1e-12)
    diff = seed_difference([1e200, 1.0, 2.0], [1.0, 2.0, 3.0], ("gate", "none"))
    assert (diff.low, diff.high, diff.p, diff.se) == (None, None, None, None)
    assert diff.delta == pytest.approx(1e200 / 3)
    assert "no verdict: the scores give no interval" in diff.verdict() and "inf" not in diff.verdict()
    ordinary = seed_difference([1.0, 2.0, 3.0], [1.0, 2.0, 4.0], ("gate", "none"))  # unchanged
    assert ordinary.low + ordinary.high == pytest.approx(2 * ordinary.delta)
    assert ordinary.p == pytest.approx(0.77, abs=0.01)


# -- 2. --baseline matched as a number ----------------------------------------------------------------------------
def run(trial_id: str, lam, seed: int, cider: float, per_image=None) -> Trial:
    config = {"model": {"fusion": "gate", "lambda": lam}, "train": {"seed": seed}}
    return Trial(trial_id, name=trial_id, state="TERMINATED", config=config, config_hash=f"lam-{lam!r}",
                 best_value=cider, best_step=1, final={CIDER: cider}, history={CIDER: [(1, cider)]},
                 per_image=lambda split: per_image)


def lambda_study(lams=(0.01, 0.1), per_image=lambda lam, seed: None) -> Study:
    runs = [run(f"{lam}-{seed}", lam, seed, 100.0 + 100 * (finite(lam) or 0.5) + seed, per_image(lam, seed))
            for lam in lams for seed in (0, 1, 2)]
    return Study("lam", runs)


@pytest.mark.parametrize("baseline", ["0.10", "1e-1", ".1", "0.1"])
def test_a_baseline_is_matched_as_a_number(baseline):
    """`--baseline 0.10` was 'no run has lambda=0.10 (it has 0.01, 0.1)': values were matched as text."""
    comparison, _, _ = study_comparison(lambda_study(), by="lambda", baseline=baseline)
    assert comparison.baseline == "0.1"
    assert list(comparison.differences) == ["0.01"]
    diff = comparison.differences["0.01"]
    expect = seed_difference([101.0, 102.0, 103.0], [110.0, 111.0, 112.0], ("0.01", "0.1"))
    assert (diff.a, diff.b, diff.delta) == ("0.01", "0.1", pytest.approx(-9.0))
    assert (diff.low, diff.high) == (pytest.approx(expect.low), pytest.approx(expect.high))
    assert "0.1 (baseline)" in compare_table(lambda_study(), by="lambda", baseline=baseline)


def test_a_baseline_of_text_is_matched_as_text_and_a_missing_one_lists_the_rows():
    study = lambda_study(lams=("small", "0.1"))
    comparison, _, _ = study_comparison(study, by="lambda", baseline="small")
    assert comparison.baseline == "small" and list(comparison.differences) == ["0.1"]
    with pytest.raises(StudyError, match=re.escape("--baseline Small: no run of study lam with val/CIDEr has "
                                                   "lambda=Small (it has 0.1, small)")):
        study_comparison(study, by="lambda", baseline="Small")
    with pytest.raises(StudyError, match=re.escape("--baseline 0.2: no run of study lam with val/CIDEr has "
                                                   "lambda=0.2 (it has 0.01, 0.1)")):
        study_comparison(lambda_study(), by="lambda", baseline="0.2")
    with pytest.raises(StudyError, match=re.escape("(it has 0.01, 0.1)")):
        study_comparison(lambda_study(), by="lambda", baseline="nan")


def test_a_number_logged_as_two_texts_is_ambiguous_unless_named_exactly():
    study = lambda_study(lams=("0.10", 0.1))
    assert study_comparison(study, by="lambda", baseline="0.10")[0].baseline == "0.10"  # its own text: that row
    with pytest.raises(StudyError, match=re.escape("--baseline 1e-1: lambda=1e-1 is several rows of study lam as a "
                                                   "number (0.10, 0.1): name one (it has 0.10, 0.1)")):
        study_comparison(study, by="lambda", baseline="1e-1")


# -- 3. a '|' in a markdown cell ----------------------------------------------------------------------------------
def _cells(row: str) -> list[str]:
    """A markdown row's cells, split at the pipes that are not escaped."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]


def test_a_pipe_in_a_label_is_escaped_in_the_markdown_table(tmp_path):
    """A label 'gate|v2' split its row into one cell too many: every later column shifted under the wrong heading."""
    record = make_record({"none|v1": 3, "gate|v2": 3})
    record.update(baseline="none|v1", by="fusion|variant")
    record["columns"] = [["val CIDEr|x100", "val/CIDEr"], ["lift", "diag/grounding/lift"]]
    table = render_table(load_record(write(tmp_path, record))).splitlines()
    head, _, base, gate = table
    assert _cells(head) == ["fusion\\|variant", "seeds", "val CIDEr\\|x100", "lift",
                            "val CIDEr vs none\\|v1 [95% CI], p: verdict"]
    none_scores, gate_scores = (np.asarray(a["per_image"]["scores"]) for a in record["arms"])
    diff = paired_difference(gate_scores, none_scores)
    word = "resolved" if diff.resolved else "not resolved"
    assert _cells(base) == ["none\\|v1", "0-2", seed_interval(none_scores.mean(axis=1)).text(),
                            seed_interval([0.0, 0.01, 0.02]).text(), "(baseline)"]
    assert _cells(gate) == ["gate\\|v2", "0-2", seed_interval(gate_scores.mean(axis=1)).text(),
                            seed_interval([0.01, 0.02, 0.03]).text(),
                            f"{diff.interval_text().replace(' CIDEr', '')}, p {diff.p:.3f}: {word}"]
    # the escaped table is what a marked page holds, and reads back as it
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text(json.dumps(record))
    page = tmp_path / "page.md"
    page.write_text("<!-- results: results/r.json -->\n" + "\n".join(table) + "\n")
    assert tables_in(page.read_text()) == [("results/r.json", "\n".join(table))]
    assert check_markdown(page, tmp_path) == []


def test_a_line_break_in_a_label_stays_in_its_row(tmp_path):
    record = make_record({"none": 3, "gate\nv2": 3})
    table = render_table(load_record(write(tmp_path, record))).splitlines()
    assert len(table) == 4 and _cells(table[3])[0] == "gate v2"


def test_markdown_cells_escape_pipes_and_plain_text_tables_keep_them():
    assert markdown_cell("a|b|c") == "a\\|b\\|c" and markdown_cell(3) == "3" and markdown_cell("") == ""
    assert markdown_cell("x\r\ny") == "x y"
    assert text_table(["by", "config"], [["a|b", "x=1|2"]]) == "by   config\n---  ------\na|b  x=1|2"


# -- per-image scores of fewer than 2 images, and a per-image file of no numbers ----------------------------------
@pytest.mark.parametrize("images", [0, 1])
def test_a_record_with_per_image_scores_of_under_two_images_is_refused(tmp_path, images):
    """It was a ValueError traceback ('per-image scores need at least 2 images') from `a2 results show`."""
    record = make_record({"none": 3, "gate": 3})
    for arm in record["arms"]:
        arm["per_image"] = {"image_ids": arm["per_image"]["image_ids"][:images],
                            "scores": [row[:images] for row in arm["per_image"]["scores"]]}
    with pytest.raises(DataError, match=re.escape(f"r.json: arms[0].per_image: scores of {images} image"
                                                  f"{'s' if images != 1 else ''}: a paired comparison needs 2 or "
                                                  f"more images")):
        load_record(write(tmp_path, record))


def test_a_study_scored_on_one_image_is_compared_on_seed_means():
    """A study whose per-image files hold one image: `a2 study compare` raised a ValueError traceback; one image
    measures no image variance, so the comparison is the seed means' (Welch's t)."""
    study = lambda_study(per_image=lambda lam, seed: {"101": 100.0 + 100 * lam + seed})
    comparison, _, _ = study_comparison(study, by="lambda", baseline="0.01")
    diff = comparison.differences["0.1"]
    expect = seed_difference([110.0, 111.0, 112.0], [101.0, 102.0, 103.0], ("0.1", "0.01"))
    assert diff.images is None and diff.delta == pytest.approx(9.0)
    assert (diff.low, diff.high) == (pytest.approx(expect.low), pytest.approx(expect.high))


@pytest.mark.parametrize("scores, message", [
    ({"101": 1.0, "102": None}, "trial 0.1-0: its per-image val CIDEr of image 102 is None, not a finite number"),
    ({"101": 1.0, "102": "x"}, "trial 0.1-0: its per-image val CIDEr of image 102 is 'x', not a finite number"),
    ({"101": 1.0, "102": float("inf")}, "trial 0.1-0: its per-image val CIDEr of image 102 is inf, not a finite"),
    ([1.0, 2.0], "trial 0.1-0: its per-image val CIDEr is a JSON list, not {image id: score}"),
], ids=["null", "string", "inf", "list"])
def test_a_per_image_file_of_no_numbers_is_one_line_naming_the_trial(scores, message):
    """A hand-edited or corrupt per-image file was a TypeError traceback from `a2 study compare`; Infinity (a JSON
    number) gave the row an infinite difference."""
    good = {str(100 + i): 100.0 + i for i in range(5)}
    study = lambda_study(per_image=lambda lam, seed: scores if (lam, seed) == (0.1, 0) else good)
    with pytest.raises(DataError, match=re.escape(message)):
        study_comparison(study, by="lambda")
