"""The read side audited (`dashboards.runs`, `tables`, `compare`, `stats`): a study's trials grouped by the keys
their search sampled when their config no longer resolves, seeds that are not whole numbers, and plain-text tables
with wide characters in a name."""
from __future__ import annotations

import unicodedata

import pytest

from dashboards.compare import compare_table, configurations, study_comparison
from dashboards.runs import CIDER, Study, Trial, group_value, seed_number
from dashboards.tables import display_width, text_table

pytestmark = pytest.mark.outside_ray_group


# -- 1. a trial of an older study: no resolved config, its values only in `sampled` ---------------------------------
def old_trial(tid: str, fusion: str, seed: int, cider: float, lam=None) -> Trial:
    """A trial whose config no longer resolves (`launch.record.table_columns` gives config {}): what Tune sampled."""
    sampled = {"fusion": fusion, "seed": seed, **({} if lam is None else {"model.lambda": lam})}
    return Trial(tid, name=tid, state="TERMINATED", sampled=sampled, config={}, config_hash=f"{fusion}-{lam}",
                 best_value=cider, best_step=1, final={CIDER: cider}, history={CIDER: [(1, cider)]},
                 status="FINISHED", per_image=lambda split: None)


def old_study() -> Study:
    runs = [old_trial(f"n{s}", "none", s, 100.0 + s) for s in range(3)]
    runs += [old_trial(f"g{s}", "gate", s, 110.0 + s, lam=0.1) for s in range(3)]
    return Study("old", runs)


def test_group_value_falls_back_to_the_sampled_keys_of_a_trial_without_config():
    """`--by fusion` on such trials was None for every run: 'no run of study old has fusion'."""
    gate = old_trial("g0", "gate", 0, 110.0, lam=0.1)
    assert (group_value(gate, "fusion"), group_value(gate, "lambda"), group_value(gate, "model.lambda")) == (
        "gate", "0.1", "0.1")
    assert group_value(gate, "seed") == "0"
    assert group_value(old_trial("n0", "none", 0, 100.0), "lambda") is None  # not applicable to fusion none
    assert group_value(gate, "eta") is None


def test_compare_by_fusion_of_trials_known_only_by_their_sampled_keys():
    comparison, _, n = study_comparison(old_study(), by="fusion")
    assert n == 6
    assert [arm.label for arm, _ in comparison.rows] == ["none", "gate"]
    assert comparison.baseline == "none"
    diff = comparison.differences["gate"]
    assert diff.delta == pytest.approx(10.0) and diff.resolved
    table = compare_table(old_study(), by="fusion")
    assert "none (baseline)" in table and "gate beats none by 10.0" in table


# -- 2. a seed that is not a whole number ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed, number", [(2, 2), (2.0, 2), ("2", 2), ("2.0", 2), (2**70, 2**70), (2.5, None),
                                          ("2.5", None), (float("nan"), None), (float("inf"), None), (True, None),
                                          (None, None), ("abc", None)])
def test_seed_number_is_a_whole_number_or_none(seed, number):
    """2.5 was seed 2 (int() truncates) while "2.5" was none; 2**70 stays exact."""
    assert seed_number(seed) == number


def test_seeds_2_and_2_point_5_are_not_one_seed_in_order():
    runs = [Trial(t, config={"train": {"seed": s}}, config_hash="h") for t, s in (("a", 2.5), ("b", 3), ("c", 2))]
    ((first, second, third),) = configurations(runs)
    # 2.5 is no seed number: after the numbered seeds (it sorted as 2, before 3)
    assert [first.trial_id, second.trial_id, third.trial_id] == ["c", "b", "a"]


# -- 3. plain-text tables with wide characters -----------------------------------------------------------------------
def test_text_table_of_ascii_is_unchanged():
    table = text_table(["name", "n"], [["a", "1"], ["bbb", "22"]], right={1})
    assert table == "name   n\n----  --\na      1\nbbb   22"


def test_text_table_aligns_wide_and_combining_characters_by_terminal_columns():
    """'研究' padded as 2 characters took 4 columns: every column after it shifted by 2."""
    rows = [["研究", "1"], ["abcd", "2"], ["🙂x", "3"], [unicodedata.normalize("NFD", "café"), "4"]]
    lines = text_table(["study", "n"], rows, right={1}).split("\n")
    # every line as wide as the header "study  n", so the "n" column is at one terminal column on each
    assert [display_width(line) for line in lines] == [8] * 6
    assert display_width("研究") == 4 and display_width("e\u0301") == 1 and display_width("abc") == 3
