"""Confirmation seeds (`search.confirm`; docs/explanation/statistics.md, "Confirmation seeds"): each fusion's best
configuration, chosen on val over the search's seeds, runs fresh seeds, and the verdicts rest on those alone. The
spec's trial count and refusals, the searcher handing the fresh seeds to the chosen configurations only once the
search has ended, the comparison's rows and verdicts, the Ray-free rehearsal (where the selection leans a fixed
design's verdicts and the confirmation seeds do not), and (slow) the real driver through Ray."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from a2core.errors import ConfigError
from dashboards.compare import chosen_configuration, compare_table, study_comparison
from dashboards.runs import CIDER, TEST_CIDER, Study
from dashboards.runs import Trial as RecordTrial
from launch import rehearse
from launch.adaptive import next_round_groups
from launch.search import GridCrossedSearcher, Searcher
from launch.spec import load_study

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "studies" / "smoke.yaml"
# the baseline and gate with three lambdas drawn by TPE: gate's row is chosen among three configurations
THREE_GATES = ("search.num_samples=3", "search.scheduler={fifo: {}}")


def smoke(*overrides: str):
    return load_study(SMOKE, list(overrides), check_files=False)


def test_confirmation_seeds_follow_the_search_and_count_one_configuration_a_fusion():
    spec = smoke(*THREE_GATES, "search.replicates=2", "search.confirm=3")
    assert spec.confirm_seeds == [2, 3, 4] and spec.confirm_from == 2
    assert spec.seed_rounds == (2, 5) and spec.replicate_rounds is None
    assert spec.search_trials == 4 * 2  # none (one configuration) and gate's 3, 2 seeds each
    assert spec.confirm_arms == 2 and spec.num_trials == 8 + 2 * 3
    assert spec.verdict_seeds == 3 and spec.num_arms == 4
    listed = smoke(*THREE_GATES, "search.replicates=[3, 7]", "search.confirm=2")
    assert listed.confirm_seeds == [8, 9] and listed.seed_rounds == (2, 4)
    plain = smoke(*THREE_GATES, "search.replicates=2")
    assert plain.confirm_seeds == [] and plain.seed_rounds is None and plain.num_trials == 8


@pytest.mark.parametrize("overrides, message", [
    (("search.replicates={min: 2, max: 4}", "search.confirm=3"), "adaptive replicates"),
    (("search.replicates=null", "search.purpose=explore", "search.confirm=3"), "set search.replicates"),
    (("search.replicates=2", "search.purpose=explore", "search.confirm=3"), "an `explore` study claims none"),
    (("search.replicates=2", "search.confirm=1"), "must be >= 2, got 1"),
])
def test_a_confirmation_the_study_cannot_run_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        smoke(*THREE_GATES, *overrides)
    text = str(err.value)
    assert "search.confirm" in text and message in text and "\n" not in text.strip(), text


def test_the_searcher_hands_the_confirmation_seeds_to_the_chosen_configurations_after_the_search():
    spec = smoke(*THREE_GATES, "search.replicates=2", "search.confirm=3")
    searcher = GridCrossedSearcher(spec)
    asked = []

    class Chosen:  # what `RoundDecider` answers: here the baseline and gate's second configuration
        def next_round(self, finished, configs, trials, failed=frozenset()):
            asked.append((finished, len(configs), len(trials)))
            gates = [g for g, c in configs.items() if c["fusion"] == "gate"]
            return [g for g, c in configs.items() if c["fusion"] == "none"] + gates[1:2]

    searcher.set_round_decider(Chosen())
    first = {f"t{i}": searcher.suggest(f"t{i}") for i in range(8)}
    assert sorted(c["seed"] for c in first.values()) == [0] * 4 + [1] * 4
    assert searcher.suggest("t8") is None  # the search's trials still run: confirmation waits for all of them
    for i, tid in enumerate(first):
        searcher.on_trial_complete(tid, {"val/CIDEr": 50.0 + i, "epoch": spec.total_epochs})
    more = {f"u{i}": searcher.suggest(f"u{i}") for i in range(6)}
    assert asked == [(0, 4, 8)]
    gate_lambda = [c for c in first.values() if c["fusion"] == "gate"][2]["lambda"]  # the second group's first
    assert sorted((c["fusion"], c["seed"]) for c in more.values()) == sorted(
        (f, s) for f in ("none", "gate") for s in (2, 3, 4))
    assert {c["lambda"] for c in more.values() if c["fusion"] == "gate"} == {gate_lambda}
    assert searcher.suggest("u6") is None
    again = GridCrossedSearcher(spec)  # Tune saves the searcher with the experiment: a resumed study goes on
    again.set_state(searcher.get_state())
    assert again._round == 1 and again.group_of("u0") == searcher.group_of("u0")
    for tid in more:
        searcher.on_trial_complete(tid, {"val/CIDEr": 60.0, "epoch": spec.total_epochs})
    assert searcher.suggest("u7") == Searcher.FINISHED and len(asked) == 1


def test_fused_seeds_train_each_round_as_one_trial_a_configuration():
    """`resources.fuse_replicates` with confirmation seeds: each configuration's 2 search seeds are one trial, a group
    of one for Optuna; once every one has ended, each chosen configuration's 3 confirmation seeds are one more trial
    of its group, holding them all; a resumed searcher goes on from the same round."""
    spec = smoke(*THREE_GATES, "search.replicates=2", "search.confirm=3", "resources.fuse_replicates=true")
    searcher = GridCrossedSearcher(spec)

    class Chosen:  # the baseline and gate's second configuration, as in the unfused test above
        def next_round(self, finished, configs, trials, failed=frozenset()):
            gates = [g for g, c in configs.items() if c["fusion"] == "gate"]
            return [g for g, c in configs.items() if c["fusion"] == "none"] + gates[1:2]

    searcher.set_round_decider(Chosen())
    first = {f"t{i}": searcher.suggest(f"t{i}") for i in range(4)}
    assert all(c["seeds"] == [0, 1] and "seed" not in c for c in first.values())
    assert searcher.suggest("t4") is None
    for i, tid in enumerate(first):
        searcher.on_trial_complete(tid, {"val/CIDEr": 50.0 + i, "epoch": spec.total_epochs})
        assert searcher.optuna_trial(tid).value == pytest.approx(50.0 + i)  # the group's mean, told at once
    more = {f"u{i}": searcher.suggest(f"u{i}") for i in range(2)}
    assert searcher.suggest("u2") is None
    gate = [c for c in first.values() if c["fusion"] == "gate"][1]
    assert sorted((c["fusion"], c.get("lambda"), tuple(c["seeds"])) for c in more.values()) == sorted(
        [("none", None, (2, 3, 4)), ("gate", gate["lambda"], (2, 3, 4))])
    assert searcher.group_of("u1") == ["t2", "u1"]  # one group: its search trial, then its confirmation trial
    again = GridCrossedSearcher(spec)
    again.set_state(searcher.get_state())
    for tid in more:
        again.on_trial_complete(tid, {"val/CIDEr": 60.0, "epoch": spec.total_epochs})
    assert again.suggest("u2") == Searcher.FINISHED
    assert spec.tune_samples == len(first) + len(more)


def test_a_fused_groups_seeds_in_the_record_choose_its_group():
    """The record holds a fused trial's seeds apart (`<tune id>-s<seed>`): the configuration chosen on them is the
    group of the Tune trial that trained them."""
    spec = smoke(*THREE_GATES, "search.replicates=2", "search.confirm=3", "resources.fuse_replicates=true")
    runs = [run(f"n0-s{s}", "none", None, s, 100, 100) for s in (0, 1)]
    runs += [run(f"a0-s{s}", "gate", 0.1, s, 90, 90) for s in (0, 1)]
    runs += [run(f"b0-s{s}", "gate", 0.01, s, 95, 95) for s in (0, 1)]
    configs = {"n0": {"fusion": "none", "seeds": [0, 1]}, "a0": {"fusion": "gate", "lambda": 0.1, "seeds": [0, 1]},
               "b0": {"fusion": "gate", "lambda": 0.01, "seeds": [0, 1]}}
    assert next_round_groups(spec, None, configs, Study("s", runs, confirm_from=2)) == ["n0", "b0"]


def test_a_fused_studys_rehearsal_without_ray_confirms_as_the_unfused_one():
    """The Ray-free rehearsal of a fused study with confirmation seeds runs the trials of the record the unfused one
    runs, with the same draws: fused seeds are statistically seeds apart."""
    overrides = (*THREE_GATES, "search.replicates=2", "search.confirm=3", "train.xe_epochs=2")
    spec, fused = smoke(*overrides), smoke(*overrides, "resources.fuse_replicates=true")
    model = rehearse.score_model(spec, means=["none=100", "gate=103"], storage="/nonexistent-a2-storage")
    runs = {name: sorted((r.fusion, r.config_hash, int(r.seed), r.best_value)
                         for r in rehearse.simulate(s, model, repeat=1).runs)
            for name, s in (("plain", spec), ("fused", fused))}
    assert len(runs["fused"]) == 14 and runs["fused"] == runs["plain"]


IMAGES = 40


def run(tid: str, fusion: str, lam: float | None, seed: int, val: float, test: float,
        stopped: bool = False) -> RecordTrial:
    """A finished trial whose val and test per-image CIDEr-D average `val` and `test`."""
    spread = np.random.default_rng(7).normal(0, 10, IMAGES)  # the same images for every run
    scores = {split: {f"{i:03d}": float(v) for i, v in enumerate(spread - spread.mean() + mean)}
              for split, mean in (("val", val), ("test", test))}
    sampled = {"fusion": fusion, "seed": seed, **({} if lam is None else {"lambda": lam})}
    return RecordTrial(tid, state="TERMINATED", status="FINISHED", sampled=sampled,
                       config={"model": {"fusion": fusion}}, config_hash=f"{fusion}-{lam}",
                       final={CIDER: val, TEST_CIDER: test}, best_value=val, best_step=1,
                       history={CIDER: [(1, val)]}, stopped_early={"rung": 1} if stopped else None,
                       per_image=lambda split, s=scores: s.get(split))


def lucky_study(confirmed: bool) -> Study:
    """gate at lambda 0.1 looks best on val over seeds 0-1 (a lucky seed shift, +3 on val and test alike) but its
    confirmation seeds 2-4 score as the baseline does; gate at 0.01 is as good as the baseline throughout."""
    runs = []
    for seed in range(5 if confirmed else 2):
        luck = 3.0 if seed < 2 else 0.0
        runs.append(run(f"n{seed}", "none", None, seed, 100 + 0.1 * seed, 100 + 0.1 * seed))
        runs.append(run(f"a{seed}", "gate", 0.1, seed, 100 + luck + 0.1 * seed, 100 + luck + 0.2 * seed))
        if seed < 2:
            runs.append(run(f"b{seed}", "gate", 0.01, seed, 100.5 + 0.1 * seed, 100 + 0.1 * seed))
    return Study("lucky", runs, confirm_from=2)


def test_a_row_is_chosen_on_the_search_seeds_and_its_verdict_rests_on_the_confirmation_seeds():
    study = lucky_study(confirmed=True)
    group, confirmed = chosen_configuration([r for r in study.runs if r.fusion == "gate"], study)
    assert confirmed and [r.trial_id for r in group] == ["a2", "a3", "a4"]
    comparison, _, _ = study_comparison(study)
    gate = dict((arm.label, arm) for arm, _ in comparison.rows)["gate"]
    assert gate.seed_ids == [2, 3, 4]
    diff = comparison.differences["gate"]
    assert (diff.seeds_a, diff.seeds_b) == (3, 3)
    assert diff.delta == pytest.approx(0.3, abs=1e-6)  # the confirmation seeds' gap (100.6 - 100.3), not +3
    # the same runs read without confirmation: the lucky seeds make the verdict
    lucky = study_comparison(Study("lucky", study.runs))[0].differences["gate"]
    assert lucky.delta > 1.0
    text = compare_table(study)
    assert "chosen on its seeds below 2; its numbers and its verdict are its seeds from 2 on" in text


def test_before_the_confirmation_seeds_have_run_there_is_no_verdict_and_the_table_says_why():
    study = lucky_study(confirmed=False)
    comparison, _, _ = study_comparison(study)
    assert comparison.differences == {} and comparison.baseline == "none"
    assert "no verdict for none, gate: no confirmation seeds (from seed 2)" in comparison.note
    assert "the baseline's among them: no verdicts yet" in comparison.note
    assert comparison.note in compare_table(study)


def test_each_fusions_chosen_configuration_gets_the_seeds_even_one_early_stopping_stopped():
    """The replicate ASHA stops a stopped group's later seeds at their first result: the study still runs its
    planned trials, and that row is on val, as a fixed design's row of a stopped group is."""
    spec = smoke(*THREE_GATES, "search.replicates=2", "search.confirm=3")
    runs = [run(f"n{s}", "none", None, s, 100, 100) for s in (0, 1)]
    runs += [run(f"a{s}", "gate", 0.1, s, 90, 90, stopped=True) for s in (0, 1)]
    runs += [run(f"b{s}", "gate", 0.01, s, 80, 80, stopped=True) for s in (0, 1)]
    configs = {"n0": {"fusion": "none"}, "a0": {"fusion": "gate", "lambda": 0.1},
               "b0": {"fusion": "gate", "lambda": 0.01}}
    assert next_round_groups(spec, None, configs, Study("s", runs, confirm_from=2)) == ["n0", "a0"]


def test_a_rehearsal_confirms_the_configuration_chosen_on_the_search_seeds():
    spec = smoke(*THREE_GATES, "search.replicates=2", "search.confirm=3", "train.xe_epochs=2")
    model = rehearse.score_model(spec, means=["none=100", "gate=100"], storage="/nonexistent-a2-storage")
    study = rehearse.simulate(spec, model, repeat=0)
    assert len(study.runs) == spec.num_trials == 14
    gate = [r for r in study.runs if r.fusion == "gate"]
    searched = {}
    for r in gate:
        if int(r.seed) < 2:
            searched.setdefault(r.config_hash, []).append(r.best_value)
    confirmed = {r.config_hash for r in gate if int(r.seed) >= 2}
    assert confirmed == {max(searched, key=lambda h: np.mean(searched[h]))}  # the best on val over seeds 0-1
    outcome = rehearse.analyse(study, spec, model)
    assert outcome["rows"]["gate"]["seeds"] == 3 and outcome["seed_trials"] == 14


def test_the_selection_leans_a_fixed_designs_verdicts_and_the_confirmation_seeds_do_not():
    """Both arms equal; gate's row the best of 16 configurations on val; seed shifts large against the images' noise,
    so a seed that lifts a configuration on val lifts it on test too. Fixed 3 seeds: the chosen row's verdict is
    wrong twice as often as the nominal 5%; 2 search seeds then 3 confirmation seeds: at it. 400 rehearsals each
    (fixed draws)."""
    common = ("search.num_samples=16", "search.scheduler={fifo: {}}", "train.xe_epochs=1")
    rates = {}
    for name, overrides in {"fixed": ("search.replicates=3",),
                            "confirm": ("search.replicates=2", "search.confirm=3")}.items():
        spec = smoke(*common, *overrides)
        model = rehearse.score_model(spec, means=["none=100", "gate=100"], storage="/nonexistent-a2-storage")
        model = dataclasses.replace(model, seed_sd=4.0, arm_image_sd=0.5)
        agg = rehearse.aggregate(rehearse.repeated(spec, model, 400, 0), spec, model)
        rates[name] = agg["rows"]["gate"]["wrong"]
    # these draws: fixed 11.2%, confirmation 5.5% (400 rehearsals: +-2.2 points at 5%)
    assert rates["fixed"] > 0.09, rates
    assert rates["confirm"] < 0.075, rates


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fused", [False, True], ids=["seed-trials", "fused"])
def test_the_driver_runs_the_confirmation_seeds_of_the_chosen_configurations(tmp_path, fused):
    """Through Ray (the stand-in trainer, the real driver and searcher): two gate configurations and the baseline,
    2 search seeds, then seeds 2-3 of the baseline and of gate's configuration with the best val mean; the summary's
    and status' verdicts rest on those. Fused (`resources.fuse_replicates`), the same trials of the record come from
    5 Tune trials: each configuration's search seeds in one, each chosen configuration's confirmation seeds in one."""
    from tests.raycluster import a2

    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    storage = tmp_path / "rehearsals"
    run_ = a2("study", "rehearse", str(SMOKE), "search.num_samples=2", "search.scheduler={fifo: {}}",
              "search.replicates=2", "search.confirm=2", "train.xe_epochs=2", "--mean", "none=100",
              *(["resources.fuse_replicates=true"] if fused else []),
              "--mean", "gate=130", "--storage", str(storage), "--quiet", cwd=tmp_path, env=env, timeout=400)
    out = run_.stdout
    assert run_.returncode == 0, out[-5000:]
    assert "confirmation seeds 2..3: chosen on val over the search's seeds" in out
    name = "a2-smoke-rehearsal"
    summary = json.loads((storage / name / "summary.json").read_text())
    trials = summary["trials"]
    assert summary["complete"] is True and len(trials) == 3 * 2 + 2 * 2
    searched, confirmed = {}, {}
    for t in trials:
        key = (t["fusion"], t.get("lambda"))
        (searched if int(t["seed"]) < 2 else confirmed).setdefault(key, []).append(t)
    gates = {k: np.mean([t["best"] for t in v]) for k, v in searched.items() if k[0] == "gate"}
    assert set(confirmed) == {("none", None), max(gates, key=gates.get)}
    assert all(sorted(int(t["seed"]) for t in v) == [2, 3] for v in confirmed.values())
    tune_trials = [json.loads(f.read_text().splitlines()[0]) for f in (storage / name).glob("*/result.json")]
    if fused:
        assert sorted(tuple(r["config"]["seeds"]) for r in tune_trials) == [(0, 1)] * 3 + [(2, 3)] * 2
        assert {t["trial_id"].rsplit("-s", 1)[0] for v in confirmed.values() for t in v} <= {
            r["trial_id"] for r in tune_trials if r["config"]["seeds"] == [2, 3]}
    else:
        assert len(tune_trials) == len(trials)
    gate = next(c for c in summary["verdicts"]["comparisons"] if c["arm"] == "gate")
    assert gate["seeds"] == [2, 2] and gate["resolved"] is True
    best = summary["best_group"]  # what packaging ensembles: the chosen gate configuration, all 4 of its seeds
    assert (best["fusion"], best.get("lambda")) == max(gates, key=gates.get)
    assert sorted(int(s) for s in best["seeds"]) == [0, 1, 2, 3]
    status = a2("study", "status", name, "--storage", str(storage), cwd=tmp_path, env=env, timeout=120)
    assert status.returncode == 0, status.stdout[-3000:]
    assert gate["verdict"] in status.stdout  # status' group verdict is the summary's, on the confirmation seeds
    assert "2 seeds x" in gate["verdict"]


def test_the_plan_says_where_a_fixed_design_chooses_among_configurations_and_prices_confirmation():
    from launch.plan import study_plan

    fixed = study_plan(load_study(REPO / "studies" / "fusion_ablation.yaml", ["search.replicates=5",
                                                                             "search.confirm=null"], check_files=False))
    assert ("a fusion's row is its best configuration on val (max among 2, moving_average among 2, exp_decay among "
            "8, gate among 2), chosen on the seeds its verdict uses") in fixed
    spec = load_study(REPO / "studies" / "fusion_ablation.yaml", check_files=False)  # as shipped: 2 + confirm 5
    confirmed = study_plan(spec)
    assert "among 8" not in confirmed
    assert ("trials    55 = 15 configurations x 2 seeds + 5 fusions' chosen configuration x 5 confirmation seeds "
            "(the verdicts')") in confirmed
    assert "power at 5" in confirmed  # the verdicts' seeds


def test_the_best_configuration_is_a_confirmed_one_once_any_has_its_fresh_seeds():
    """A runner-up that ran the search's seeds alone can out-score the chosen configuration, whose fresh seeds
    regress to its true mean; the record's best group (status, packaging) is still a confirmed one."""
    from dashboards.runs import ReplicateGroup
    from launch.record import best_group

    spec = smoke(*THREE_GATES, "search.replicates=2", "search.confirm=3")
    chosen = ReplicateGroup("a", fusion="gate", seeds=[0, 1, 2, 3, 4], values=[104, 104, 100, 100, 100])
    runner_up = ReplicateGroup("b", fusion="gate", seeds=[0, 1], values=[103, 103])
    assert best_group(spec, [chosen, runner_up]) is chosen
    assert best_group(smoke(*THREE_GATES, "search.replicates=2"), [chosen, runner_up]) is runner_up
    assert best_group(spec, [ReplicateGroup("a", seeds=[0, 1], values=[104, 104]), runner_up]).config_hash == "a"


def test_a_published_record_of_confirmation_seeds_prints_the_verdicts_compare_gives(tmp_path):
    """`a2 results export` of a study with confirmation seeds: its table (`render_table`) judges the rows as
    `a2 study compare` does, on the seed variance pooled over the rows' fresh seeds; before those seeds have all run
    there is no verdict to publish, and nothing is written (the record would have judged a row on the seeds it was
    chosen on)."""
    from a2core.errors import DataError
    from dashboards.records import export_record, render_table

    study = lucky_study(confirmed=True)
    record = export_record(study, "fusion", tmp_path / "lucky.json")
    assert record["pooled"] is True
    diff = study_comparison(study)[0].differences["gate"]
    gate_row = next(line for line in render_table(record).splitlines() if line.startswith("| gate "))
    assert f"[{diff.low:+.1f}, {diff.high:+.1f}]" in gate_row, (diff.interval_text(), gate_row)
    with pytest.raises(DataError, match=r"study lucky: no verdict for none, gate: the confirmation seeds \(from seed 2\)"):
        export_record(lucky_study(confirmed=False), "fusion", tmp_path / "early.json")
    assert not (tmp_path / "early.json").exists()
