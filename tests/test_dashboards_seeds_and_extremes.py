"""`dashboards.stats`, `leaderboard` and `records` on inputs a researcher can hand them: scores near the float's
limit (a diverged metric compared over all of an arm's metrics), a member whose seed is unknown or is text, and a
study whose seeds are text, floats, missing or run twice. Numbers are checked against scipy/numpy here."""
from __future__ import annotations

import json
import math
import re
import warnings

import numpy as np
import pytest
from scipy import stats as sps

from a2core.errors import DataError
from dashboards import leaderboard as lb
from dashboards.records import export_record, load_record, render_table
from dashboards.runs import CIDER, Study, Trial
from dashboards.stats import best_group, paired_difference, pooled_sd, seed_difference, seed_interval


def scaled_t_interval(x) -> tuple[float, float, float]:
    """scipy's t-interval of the scores scaled by their largest magnitude, scaled back (scipy's own overflows)."""
    x = np.asarray(x, dtype=float)
    k = np.abs(x).max()
    low, high = sps.t.interval(0.95, x.size - 1, loc=(x / k).mean(), scale=sps.sem(x / k))
    return float((x / k).mean() * k), float(low * k), float(high * k)


# -- stats: scores near the float's limit ----------------------------------------------------------------------------
def test_seed_interval_near_the_float_limit_has_the_true_mean_and_no_infinite_bounds():
    """[1e308, 1.5e308] gave mean inf, interval [nan, inf]: the sum overflowed. The true interval's upper bound is
    4.4e308, beyond a float, so there is none, said so."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning either
        iv = seed_interval([1e308, 1.5e308])
    assert iv.mean == pytest.approx(1.25e308, rel=1e-12)
    assert (iv.low, iv.high, iv.n, iv.identical) == (None, None, 2, False)
    assert iv.text().endswith("(2 seeds: no interval, its bounds are beyond a float's range)")
    assert "inf" not in iv.text() and "nan" not in iv.text()


def test_seed_interval_of_many_scores_near_the_limit_matches_scipy():
    """14 seeds near 1.7e308: the bounds are representable; they were 'inf [inf, inf]'."""
    x = [1.7e308] * 7 + [1.6e308] * 7
    mean, low, high = scaled_t_interval(x)
    iv = seed_interval(x)
    assert (iv.mean, iv.low, iv.high) == pytest.approx((mean, low, high), rel=1e-12)


def test_seed_interval_of_opposite_scores_near_the_limit_is_no_infinite_interval():
    """[-1e308, 1e308] gave '0.0 [-inf, inf]' (and an overflow in max - min)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        iv = seed_interval([-1e308, 1e308])
    assert (iv.mean, iv.low, iv.high, iv.identical) == (0.0, None, None, False)


def test_a_difference_of_scores_near_the_limit_has_a_finite_delta_and_no_verdict():
    """delta was NaN (inf - inf) and the verdict '+nan CIDEr'."""
    d = seed_difference([1e308, 1.5e308], [1e308, 1.2e308], ("gate", "none"))
    assert d.delta == pytest.approx(1.5e307, rel=1e-12)
    assert (d.low, d.high, d.p) == (None, None, None)
    assert "nan" not in d.verdict() and "no verdict" in d.verdict()
    a, b = np.full((2, 3), 1.7e308), np.full((2, 3), 1.6e308)
    a[1] *= 0.9
    d = paired_difference(a, b)
    assert d.delta == pytest.approx(1.7e308 * 0.95 - 1.6e308, rel=1e-12)


def test_pooled_sd_of_huge_scores_is_finite():
    """pooled_sd gave inf where the squares overflowed (scores from about 1e154)."""
    groups = [[1e200, 1.5e200], [1.0, 2.0]]
    k = 1.5e200
    scaled = [np.asarray(g) / k for g in groups]
    expect = k * math.sqrt(sum(((g - g.mean()) ** 2).sum() for g in scaled) / 2)
    assert pooled_sd(groups) == pytest.approx(expect, rel=1e-12)
    assert pooled_sd([[1.0, 2.0], [3.0, 5.0]]) == pytest.approx(math.sqrt((0.5 + 2.0) / 2), rel=1e-15)


def test_best_group_tells_apart_means_near_the_limit():
    """Both means overflowed to inf, a tie: the first group was 'best' though the second's mean is higher."""
    groups = {"a": [1.5e308, 1.5e308], "b": [1.6e308, 1.6e308]}
    assert best_group(list(groups), groups.get, "max") == "b"
    assert best_group(list(groups), groups.get, "min") == "a"


# -- leaderboard: a member's seed unknown, text, or twice -------------------------------------------------------------
CONFIG = {"data": {"kind": "synthetic"}, "model": {"fusion": "max", "lambda": 0.035}, "train": {"seed": 0}}


def _metrics(cider: float) -> dict:
    return {"BLEU-1": 70.0, "BLEU-4": 30.0, "METEOR": 25.0, "ROUGE-L": 50.0, "CIDEr": cider}


def _members(seeds, ciders=(100.0, 102.0, 105.0)) -> list[dict]:
    return [{"seed": s, "trial_id": f"t{i}", "study": "st", "checkpoint": f"c{i}.pt", "value": 50.0 + i,
             "metrics": _metrics(c)} for i, (s, c) in enumerate(zip(seeds, ciders))]


@pytest.mark.parametrize("seeds,names", [
    ((1, None, 0), ["seed-0", "seed-1", "seed-? (trial t1)"]),
    (("2", 1, 0), ["seed-0", "seed-1", "seed-2"]),
], ids=["unknown", "text"])
def test_a_member_of_unknown_or_text_seed_is_a_row_of_the_board(tmp_path, seeds, names):
    """Sorting the members by seed raised TypeError ('<' between NoneType/str and int)."""
    members = _members(seeds)
    board = lb.build_leaderboard(study="st", config=CONFIG, members=members, ensemble_metrics=_metrics(110.0),
                                 images=20, selected_by={"metric": "val/CIDEr"})
    assert [e["name"] for e in board["entries"]] == [*names, "ensemble"]
    ciders = [100.0, 102.0, 105.0]
    mean = float(np.mean(ciders))
    low, high = sps.t.interval(0.95, 2, loc=mean, scale=sps.sem(ciders))
    assert board["seed_mean"]["CIDEr"] == {"mean": round(mean, 4), "low": round(low, 4), "high": round(high, 4),
                                           "n": 3, "identical": False}
    assert board["ensemble"]["gain_over_members"]["seeds"] == 3
    assert board["ensemble"]["gain_over_members"]["delta"] == pytest.approx(110.0 - mean, abs=1e-4)
    path = lb.write_leaderboard(tmp_path / "board.json", board)
    stored = json.loads(path.read_text())
    assert sorted(map(str, stored["seeds"])) == sorted(map(str, seeds))
    table = lb.format_table(stored)
    assert all(name in table for name in names)


def test_two_members_of_one_seed_are_refused_naming_their_trials():
    """Both were named seed-0, and the gain over members counted them as one (2 member seeds for 3 members)."""
    with pytest.raises(DataError, match=re.escape("members named seed-0 more than once (trials t0, t1)")):
        lb.build_leaderboard(study="st", config=CONFIG, members=_members((0, 0, 1)), ensemble_metrics=_metrics(110.0),
                             images=20)


# -- records: the seeds of an exported study ------------------------------------------------------------------------
def trial(tid: str, fusion: str, seed, cider: float) -> Trial:
    model = {"fusion": fusion, **({"lambda": 0.1} if fusion != "none" else {})}
    return Trial(tid, name=tid, state="TERMINATED", config={"model": model, "train": {"seed": seed}},
                 config_hash=fusion, best_value=cider, best_step=1, final={CIDER: cider},
                 history={CIDER: [(1, cider)]}, status="FINISHED", per_image=lambda split: None)


def study(gate_seeds) -> Study:
    runs = [trial(f"n{i}", "none", i, 100.0 + i) for i in range(3)]
    runs += [trial(f"g{i}", "gate", s, 104.0 + i * 1.5) for i, s in enumerate(gate_seeds)]
    return Study("s", runs)


def test_export_record_takes_seeds_logged_as_text_or_integer_floats(tmp_path):
    """int('1.0') raised a bare ValueError: a seed from a hand-edited spec or an MLflow param is text."""
    record = export_record(study(["0", "1.0", 2.0]), "fusion", tmp_path / "r.json")
    gate = next(a for a in record["arms"] if a["label"] == "gate")
    # each seed with its own trial's score, whatever order the rows list them in
    assert dict(zip(gate["seeds"], gate["scores"][CIDER])) == {0: 104.0, 1: 105.5, 2: 107.0}
    table = render_table(load_record(tmp_path / "r.json"))
    assert "| gate | 0-2 |" in table


@pytest.mark.parametrize("bad", ["abc", 2.5, None], ids=["text", "fraction", "unknown"])
def test_export_record_refuses_a_seed_that_is_no_integer_naming_trial_and_value(tmp_path, bad):
    """'abc' raised a bare ValueError, 2.5 was published as seed 2 and None as seed 1 (its position)."""
    with pytest.raises(DataError, match=re.escape(f"study s: row gate, trial g1: seed {bad!r} is not an integer "
                                                  f"seed")):
        export_record(study([0, bad, 3]), "fusion", tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()


def test_export_record_refuses_a_seed_run_twice_in_one_row(tmp_path):
    """A row of seeds [1, 1, 2] was written, and `load_record` then refused the file it had written."""
    with pytest.raises(DataError, match=re.escape("study s: row gate: seed 1 is several trials' (g0, g1)")):
        export_record(study([1, "1", 2]), "fusion", tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()
