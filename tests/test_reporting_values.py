"""The numbers and words of the reporting side (`dashboards.leaderboard`, `report`, `compare`, `records`) on inputs a
researcher produces: a seed that did not log a metric (SPICE unavailable on its node), members none of which scored,
a run whose config no longer resolves, a study selecting by train/loss, unequal seeds, ties and NaN. Every number is
checked against scipy/numpy computed here, not against the code's own reading of itself."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from dashboards import leaderboard as lb
from dashboards import report as rp
from dashboards.compare import compare_table, study_comparison
from dashboards.records import export_record, load_record, render_table
from dashboards.runs import CIDER, TEST_CIDER, Study, Trial


def t_interval(values) -> tuple[float, float, float]:
    x = np.asarray(values, dtype=float)
    low, high = sps.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=sps.sem(x))
    return float(x.mean()), float(low), float(high)


def text_of(values) -> str:
    mean, low, high = t_interval(values)
    return f"{mean:.1f} [{low:.1f}, {high:.1f}]"


def trial(tid: str, fusion: str | None, seed: int, cider: float, *, final: dict | None = None, lam: float = 0.1,
          config_hash: str | None = None, data: dict | None = None, per_image=None) -> Trial:
    model = {} if fusion is None else {"fusion": fusion, **({"lambda": lam} if fusion != "none" else {})}
    config = {"model": model, "train": {"seed": seed}, **({"data": data} if data else {})}
    return Trial(tid, name=tid, state="TERMINATED", config=config, config_hash=config_hash or f"{fusion}-{lam}",
                 best_value=cider, best_step=1, final={CIDER: cider, **(final or {})}, history={CIDER: [(1, cider)]},
                 status="FINISHED", per_image=per_image or (lambda split: None))


# -- leaderboard ------------------------------------------------------------------------------------------------------
CONFIG = {"data": {"kind": "synthetic"}, "model": {"fusion": "max", "lambda": 0.035}, "train": {"seed": 0}}


def _metrics(cider: float, spice: float | None = None) -> dict:
    out = {"BLEU-1": 70.0, "BLEU-4": 30.0, "METEOR": 25.0, "ROUGE-L": 50.0, "CIDEr": cider}
    return out if spice is None else {**out, "SPICE": spice}


def test_leaderboard_seed_mean_over_fewer_seeds_says_so(tmp_path):
    """One of 3 seeds has no SPICE (its node had no CoreNLP): the seed mean row said '3 seeds' and printed the
    2-seed SPICE interval as if it were over all three."""
    members = [{"seed": s, "trial_id": f"t{s}", "study": "st", "checkpoint": "c", "value": 50.0 + s,
                "metrics": _metrics(100.0 + s, None if s == 2 else 20.0 + s)} for s in range(3)]
    board = lb.build_leaderboard(study="st", config=CONFIG, members=members, ensemble_metrics=_metrics(110.0, 22.0),
                                 images=20, selected_by={"metric": "val/CIDEr"})
    mean, low, high = t_interval([20.0, 21.0])
    assert board["seed_mean"]["SPICE"] == {"mean": round(mean, 4), "low": round(low, 4), "high": round(high, 4),
                                           "n": 2, "identical": False}
    path = lb.write_leaderboard(tmp_path / "board.json", board)
    line = next(x for x in lb.format_table(json.loads(path.read_text())).splitlines() if x.startswith("seed mean"))
    assert f"{text_of([20.0, 21.0])} (2 of 3 seeds)" in line
    assert f"{text_of([100.0, 101.0, 102.0])} " in line and "(3 of 3" not in line  # CIDEr: every seed, no note
    # the gain over the members' mean: 110 - 101 with the members' seed spread (one-sample t over 3 seeds)
    gain = board["ensemble"]["gain_over_members"]
    _, low, high = t_interval([110.0 - c for c in (100.0, 101.0, 102.0)])
    assert (gain["delta"], gain["low"], gain["high"]) == pytest.approx((9.0, low, high), abs=1e-4)
    # chosen on validation: the highest study metric, seed 2 (value 52), never the best on the test images
    assert board["ensemble"]["gain_over_chosen"]["member"] == "seed-2"


def test_leaderboard_with_no_member_scored_has_no_gain_rather_than_a_nan_verdict(tmp_path):
    """Every member's CIDEr NaN (a broken scoring of the members): the gain was '+nan CIDEr, 0 member seeds'."""
    members = [{"seed": s, "trial_id": f"t{s}", "study": "st", "checkpoint": "c", "value": 50.0 + s,
                "metrics": _metrics(float("nan"))} for s in range(3)]
    board = lb.build_leaderboard(study="st", config=CONFIG, members=members, ensemble_metrics=_metrics(110.0),
                                 images=20)
    assert board["ensemble"]["gain_over_members"] is None and board["ensemble"]["gain_over_chosen"] is None
    assert "CIDEr" not in board["seed_mean"]
    text = lb.format_table(json.loads(lb.write_leaderboard(tmp_path / "b.json", board).read_text()))
    assert "nan" not in text and "ensemble gain" not in text


def test_leaderboard_gain_leaves_out_a_nan_member_and_ties_go_to_the_selected_trial():
    members = [{"seed": s, "trial_id": f"t{s}", "study": "st", "checkpoint": "c", "value": 60.0,
                "metrics": _metrics(float("nan") if s == 3 else 100.0 + 2 * s)} for s in range(4)]
    board = lb.build_leaderboard(study="st", config=CONFIG, members=members, ensemble_metrics=_metrics(110.0),
                                 images=20, selected_by={"metric": "val/CIDEr", "trial_id": "t1"})
    _, low, high = t_interval([110.0 - c for c in (100.0, 102.0, 104.0)])
    gain = board["ensemble"]["gain_over_members"]
    assert (gain["delta"], gain["low"], gain["high"], gain["seeds"]) == pytest.approx((8.0, low, high, 3), abs=1e-4)
    chosen = board["ensemble"]["gain_over_chosen"]
    assert chosen["member"] == "seed-1" and chosen["delta"] == pytest.approx(8.0)  # tie: packaging's choice
    assert board["seed_mean"]["CIDEr"]["n"] == 3


# -- report -----------------------------------------------------------------------------------------------------------
def _spice_study() -> Study:
    runs = [trial(f"n{s}", "none", s, 100.0 + s, final={"val/SPICE": 20.0 + s}) for s in range(3)]
    runs += [trial("g0", "gate", 0, 104.0, final={"val/SPICE": 21.0}),
             trial("g1", "gate", 1, 105.0, final={"val/SPICE": 22.5}),
             trial("g2", "gate", 2, 106.0)]  # no SPICE on its node
    return Study("s", runs)


def test_report_table3_cell_over_fewer_seeds_says_so_as_compare_does():
    """Table 3 of the report printed gate's SPICE over 2 seeds in a row whose seeds column says 3, with no note;
    `a2 study compare` says '(2 of 3 seeds)'."""
    study = _spice_study()
    comparison, configs, _ = study_comparison(study)
    page = rp.fusion_table_html(comparison, configs)
    assert f"{text_of([21.0, 22.5])} (2 of 3 seeds)" in page
    assert f"{text_of([21.0, 22.5])} (2 of 3 seeds)" in compare_table(study)
    assert f"<td>{text_of([20.0, 21.0, 22.0])}</td>" in page  # the baseline's, over its 3 seeds, no note
    # the difference: gate vs none on val CIDEr, Student's t = Welch's at 3 vs 3 equal spread
    res = sps.ttest_ind([104.0, 105.0, 106.0], [100.0, 101.0, 102.0], equal_var=False)
    ci = res.confidence_interval()
    assert f"+4.0 val CIDEr [{ci.low:+.1f}, {ci.high:+.1f}]" in page and f"<td>{res.pvalue:.3f}</td>" in page


def test_report_diagnostics_of_a_run_without_a_fusion_is_a_row_not_a_crash():
    """A run whose config no longer resolves ({}) and whose fusion was not sampled: AttributeError from html.escape."""
    runs = [trial("a", "gate", 0, 100.0, final={"diag/mask_mean": 0.30}),
            trial("b", "gate", 1, 101.0, final={"diag/mask_mean": 0.40}),
            trial("c", None, 0, 99.0, final={"diag/mask_mean": 0.5})]
    page = rp.diagnostics_table_html(runs)
    assert "<tr><th>gate</th><td>2</td><td>0.35 ± 0.07</td></tr>" in page  # mean 0.35, sd 0.0707
    assert "<tr><th>None</th><td>1</td><td>0.50</td></tr>" in page


def test_report_summary_of_a_study_selecting_by_train_loss_names_its_value():
    """A study selecting by train/loss whose best run logged no val CIDEr at that epoch: a TypeError (None
    formatted); and the value named is the one the run is best by."""
    best = Trial("y", name="y", config={"model": {"fusion": "gate"}}, best_value=2.3456, best_step=4,
                 final={"train/loss": 2.3456}, status="FINISHED")
    other = Trial("z", name="z", config={"model": {"fusion": "none"}}, best_value=2.5, best_step=3,
                  final={"train/loss": 2.5, CIDER: 90.0}, status="FINISHED")
    text = rp._summary(Study("s", [best, other], metric="train/loss", mode="min", best_trial="y"))
    assert "Best single run: y (gate) train/loss 2.346 at epoch 4" in text
    cider = Study("s", [trial("a", "gate", 0, 112.34)], best_trial="a")
    assert "Best single run: a (gate) val CIDEr 112.3 (x100) at epoch 1" in rp._summary(cider)


def test_report_runs_table_best_first_ties_kept_nan_last_and_min_mode():
    runs = [trial("a", "gate", 0, 100.0), trial("b", "gate", 1, float("nan")), trial("c", "gate", 2, 100.0),
            trial("d", "none", 0, 101.0)]
    page = rp.runs_table_html(runs, ["model.fusion"])
    order = [name for name in "abcd" if f"<tr><th>{name}</th>" in page]
    assert sorted(order, key=lambda n: page.index(f"<tr><th>{n}</th>")) == ["d", "a", "c", "b"]
    assert "<tr><th>b</th>" in page and page.count("<td>–</td>") >= 1
    low = rp.runs_table_html(runs, [], mode="min")
    assert sorted("acd", key=lambda n: low.index(f"<tr><th>{n}</th>")) == ["a", "c", "d"]


# -- compare ----------------------------------------------------------------------------------------------------------
def test_compare_config_column_keeps_a_searched_key_that_merely_ends_like_by():
    """`--by images` (data.images) dropped data.val_images, also searched, from every row's config: rows whose
    configurations differ read as the same."""
    # 1000 images: best with 100 val images; 2000: with 50
    runs = [trial(f"{n}-{v}-{s}", "gate", s, 100.0 + (v if n == 1000 else -v) / 100 + s, config_hash=f"{n}-{v}",
                  data={"images": n, "val_images": v}) for n in (1000, 2000) for v in (50, 100) for s in (0, 1)]
    comparison, configs, _ = study_comparison(Study("s", runs), by="images")
    assert [arm.label for arm, _ in comparison.rows] == ["1000", "2000"]
    assert configs == {"1000": "data.val_images=100", "2000": "data.val_images=50"}
    rows = compare_table(Study("s", runs), by="images").splitlines()
    assert rows[3].startswith("1000 ") and rows[3].endswith("data.val_images=100")
    assert rows[4].startswith("2000 ") and rows[4].endswith("data.val_images=50")


def test_compare_unequal_seeds_and_a_seed_without_test_scores():
    """2 vs 3 seeds with test scores: Student's pooled t (scipy's equal_var); one chosen run without a test score
    (stopped before it): the whole comparison falls back to val, as documented."""
    runs = [trial(f"n{s}", "none", s, 100.0 + s, final={TEST_CIDER: t}) for s, t in enumerate((90.0, 91.0, 93.0))]
    runs += [trial("g0", "gate", 0, 105.0, final={TEST_CIDER: 95.0}),
             trial("g1", "gate", 1, 104.0, final={TEST_CIDER: 97.0})]
    diff = study_comparison(Study("s", runs))[0].differences["gate"]
    res = sps.ttest_ind([95.0, 97.0], [90.0, 91.0, 93.0], equal_var=True)
    ci = res.confidence_interval()
    assert (diff.delta, diff.low, diff.high, diff.p) == pytest.approx((14 / 3, ci.low, ci.high, res.pvalue))
    runs.append(trial("g2", "gate", 2, 106.0))  # no test score
    comparison = study_comparison(Study("s", runs))[0]
    assert comparison.metric == CIDER
    res = sps.ttest_ind([105.0, 104.0, 106.0], [100.0, 101.0, 102.0])
    d = comparison.differences["gate"]
    assert (d.delta, d.p) == pytest.approx((4.0, res.pvalue))


# -- records ----------------------------------------------------------------------------------------------------------
def test_export_record_renders_what_compare_prints_with_holm_and_unequal_seeds(tmp_path):
    rng = np.random.default_rng(1)
    ids = [str(100 + i) for i in range(30)]
    difficulty = rng.normal(0, 20, 30)
    truth = {}

    def run(tid, fusion, seed, cider, shift):
        scores = 100 + difficulty + shift + rng.normal(0, 5, 30)
        truth.setdefault(fusion, []).append(scores)
        pi = {i: float(v) for i, v in zip(ids, scores)}
        return trial(tid, fusion, seed, cider, final={TEST_CIDER: float(scores.mean())},
                     per_image=lambda split, pi=pi: pi if split == "test" else None)

    runs = ([run(f"n{s}", "none", s, 100.0 + s, s) for s in range(3)]
            + [run(f"g{s}", "gate", s, 104.0 + s, 3 + s / 2) for s in range(4)]
            + [run(f"m{s}", "max", s, 103.0 + s, 1 + s) for s in range(2)])
    study = Study("s", runs)
    text = compare_table(study)
    record = export_record(study, "fusion", tmp_path / "r.json")
    table = render_table(load_record(tmp_path / "r.json")).splitlines()
    assert [line.split(" | ")[0:2] for line in table[2:]] == [["| none", "0-2"], ["| max", "0, 1"], ["| gate", "0-3"]]
    for line, label in zip(table[2:], ("none", "max", "gate")):
        means = np.stack(truth[label]).mean(axis=1)
        assert text_of(means) in line and text_of(means) in text
    # Holm over the two comparisons, from each one's own p
    diffs = study_comparison(study)[0].differences
    p = sorted((diffs["max"].p, diffs["gate"].p))
    adjusted = {diffs[k].p: diffs[k].p_adjusted for k in diffs}
    assert adjusted[p[0]] == pytest.approx(min(1.0, 2 * p[0]))
    assert adjusted[p[1]] == pytest.approx(max(min(1.0, 2 * p[0]), p[1]))
    assert record["split"] == "test" and [a["seeds"] for a in record["arms"]] == [[0, 1, 2], [0, 1], [0, 1, 2, 3]]


def test_record_with_a_seed_missing_the_metric_says_over_how_many_seeds(tmp_path):
    """A seed stopped before its test score (null): its row's mean is over the others, and says so."""
    record = {"record": "a2tune-study-record", "version": 1, "study": "s", "spec": "", "split": "test", "by": "fusion",
              "metric": "test/CIDEr", "mode": "max", "baseline": "none", "columns": [["test CIDEr", "test/CIDEr"]],
              "arms": [{"label": "none", "seeds": [0, 1, 2], "scores": {"test/CIDEr": [90.0, 91.0, 93.0]}},
                       {"label": "gáte-ünïcode", "seeds": [0, 1, 2], "scores": {"test/CIDEr": [95.0, None, 97.0]}}]}
    (tmp_path / "r.json").write_text(json.dumps(record))
    table = render_table(load_record(tmp_path / "r.json")).splitlines()
    res = sps.ttest_ind([95.0, 97.0], [90.0, 91.0, 93.0])
    ci = res.confidence_interval()
    assert table[3] == (f"| gáte-ünïcode | 0-2 | {text_of([95.0, 97.0])} (2 of 3 seeds) | "
                        f"{14 / 3:+.1f} [{ci.low:+.1f}, {ci.high:+.1f}], p {res.pvalue:.3f}: resolved |")
    assert not math.isnan(res.pvalue)
