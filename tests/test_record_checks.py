"""A published record edited into the shapes that printed a wrong table: a non-finite per-image score, a baseline that
is no arm's label (refused, naming the file and the key), and the bold cell of Table 3's selection column in a study
that searches for the minimum."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from a2core.errors import DataError
from dashboards.records import arms_of, load_record, render_table
from dashboards.report import fusion_table_html
from dashboards.runs import TEST_CIDER
from dashboards.stats import MIN_SEEDS, compare_arms, seed_difference

ROOT = Path(__file__).resolve().parents[1]


def published(name: str = "mask_nets") -> dict:
    return json.loads((ROOT / "results" / f"{name}.json").read_text())


def write(tmp_path: Path, record: dict) -> Path:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))  # NaN and Infinity as JSON writes them (json.loads reads them back)
    return path


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_non_finite_per_image_score_is_refused_naming_the_file_and_the_key(tmp_path, value):
    record = published()
    assert render_table(load_record(write(tmp_path, record)))  # the published record loads
    record["arms"][1]["per_image"]["scores"][3][7] = value
    with pytest.raises(DataError, match=re.escape(f"r.json: arms[1].per_image.scores[3][7]: must be a finite "
                                                  f"number, got {value!r}")):
        load_record(write(tmp_path, record))


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_per_seed_score_is_refused_naming_the_key(tmp_path, value):
    record = published()
    metric = next(iter(record["arms"][0]["scores"]))
    record["arms"][0]["scores"][metric][2] = value  # the table printed '+nan' and blamed the seed count
    with pytest.raises(DataError, match=re.escape(f"r.json: arms[0].scores.{metric}[2]: must be a finite number "
                                                  f"(null: not measured), got {value!r}")):
        load_record(write(tmp_path, record))
    record["arms"][0]["scores"][metric][2] = None  # null stays 'not measured'
    assert render_table(load_record(write(tmp_path, record)))


def test_a_no_verdict_cites_the_seed_count_only_below_min_seeds():
    n = MIN_SEEDS + 8
    nan = seed_difference([1.0, float("nan"), *range(n - 2)], list(range(n)), ("gate", "none"))
    assert nan.low is None
    assert "seed" not in nan.no_verdict_reason()
    assert "seed noise" not in nan.verdict()
    one = seed_difference([1.0], [1.0, 2.0, 3.0], ("gate", "none"))
    assert one.no_verdict_reason() == "1 seed of gate measures no seed noise"
    both = seed_difference([1.0], [2.0], ("gate", "none"))
    assert both.no_verdict_reason() == "1 seed per arm measures no seed noise"


@pytest.mark.parametrize("baseline", ["contnet", 3, ""])
def test_a_baseline_that_is_no_arms_label_is_refused(tmp_path, baseline):
    record = {**published(), "baseline": baseline}
    with pytest.raises(DataError, match=re.escape(f"r.json: 'baseline' {baseline!r} is not the label of an arm: "
                                                  f"null or one of 'content', 'linear'")):
        load_record(write(tmp_path, record))


def test_a_null_baseline_or_an_arms_label_loads(tmp_path):
    for baseline in (None, "content", "linear"):
        assert load_record(write(tmp_path, {**published(), "baseline": baseline}))["baseline"] == baseline


def _bold(table: str) -> list[tuple[str, str]]:
    """(row label, bold cell text) of each bold cell of an HTML table."""
    out = []
    for row in re.findall(r"<tr><th>(.*?)</th>(.*?)</tr>", table):
        out += [(row[0], cell) for cell in re.findall(r"<td class='best'><b>(.*?)</b></td>", row[1])]
    return out


@pytest.mark.parametrize("mode", ["min", "max"])
def test_table_3_bolds_the_lowest_selection_mean_of_a_study_searching_for_the_minimum(mode):
    """search.metric train/loss, mode min: the row with the lower mean loss is the better one in the selection
    column; the test columns stay highest-is-best."""
    arms = arms_of(published())
    losses = {"content": 1.0, "linear": 2.0}  # content the lower loss; linear the higher test CIDEr
    for arm in arms:
        for i, seed in enumerate(arm.seeds):
            seed["train/loss"] = losses[arm.label] + 0.01 * i
    comparison = compare_arms(arms, baseline="content", metric=TEST_CIDER,
                              metrics=["test/CIDEr", "train/loss"])
    comparison.selected_by = "train/loss"
    table = fusion_table_html(comparison, {"content": "", "linear": ""}, mode)
    intervals = dict((arm.label, iv) for arm, iv in comparison.rows)
    assert intervals["linear"]["test/CIDEr"].mean > intervals["content"]["test/CIDEr"].mean
    loss_winner = "content" if mode == "min" else "linear"
    bold = _bold(table)
    assert (loss_winner, intervals[loss_winner]["train/loss"].text()) in bold
    assert ("linear", intervals["linear"]["test/CIDEr"].text()) in bold
    assert len(bold) == 2


def test_a_cell_over_fewer_seeds_than_its_row_says_so(tmp_path):
    """The seeds column counts every seed of the arm; a metric two of them did not report had its mean and interval
    over the other eight, with nothing saying so."""
    record = published()
    record["arms"][0]["scores"]["test/BLEU-4"][3] = None
    record["arms"][0]["scores"]["test/BLEU-4"][5] = None
    table = render_table(load_record(write(tmp_path, record)))
    row = next(line for line in table.splitlines() if line.startswith("| content"))
    assert row.count("(8 of 10 seeds)") == 1 and "of 10 seeds" not in next(
        line for line in table.splitlines() if line.startswith("| linear"))
