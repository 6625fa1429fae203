"""GridCrossedSearcher without a Ray cluster: suggest / on_trial_result / on_trial_complete called directly."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import yaml
from optuna.trial import TrialState
from types import SimpleNamespace

from ray.tune.schedulers import FIFOScheduler, TrialScheduler
from ray.tune.search import ConcurrencyLimiter, Searcher

from a2core.config import ConfigError
from launch.search import (GridCrossedSearcher, ReplicateASHA, asha_rungs, build_scheduler, group_key,
                           n_startup_trials, tune_config_kwargs)
from launch.spec import load_study

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "studies" / "smoke.yaml"
METRIC = "val/CIDEr"


def study_file(tmp_path: Path, space: dict, **search) -> Path:
    raw = yaml.safe_load(SMOKE.read_text())
    raw["search"]["space"] = space
    raw["search"].pop("replicates", None)  # the spaces below carry their seeds themselves, or pass replicates
    if "replicates" not in search:  # ASHA needs replicate groups to judge, a comparison seeds (`a2 study validate`)
        raw["search"].update(scheduler={"fifo": {}}, purpose="explore")  # these test the search, they compare nothing
    raw["search"].update(search)
    raw["train"].update(xe_epochs=4, scst_epochs=0)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


ABLATION = {
    "fusion": {"grid": ["max", "exp_decay", "gate"]},
    "lambda": {"loguniform": [0.005, 0.2]},
    "temperature": {"loguniform": [1000, 50000], "when": {"fusion": "exp_decay"}},
    "seed": {"grid": [0, 1]},
}


@pytest.fixture
def spec(tmp_path):
    return load_study(study_file(tmp_path, ABLATION, num_samples=3, seed=7))


REPLICATED_ABLATION = {k: v for k, v in ABLATION.items() if k != "seed"}
SMOKE_ASHA = {"asha": {"grace_period": 2, "reduction_factor": 2}}


@pytest.fixture
def asha_spec(tmp_path):
    """The ablation with 2 replicates under the smoke study's ASHA."""
    return load_study(study_file(tmp_path, REPLICATED_ABLATION, num_samples=3, seed=7, replicates=2,
                                 scheduler=SMOKE_ASHA))


def cell_key(config: dict, spec) -> tuple:
    return tuple(config[k] for k, p in spec.params.items() if not p.sampled)


def drain(searcher, prefix="t", limit=1000) -> list[tuple[str, dict]]:
    out = []
    for i in range(limit):
        config = searcher.suggest(f"{prefix}{i}")
        if config == Searcher.FINISHED:
            return out
        out.append((f"{prefix}{i}", config))
    raise AssertionError("the searcher never finished")


def finish(searcher, trial_id, value, epoch):
    for e in range(1, epoch + 1):
        searcher.on_trial_result(trial_id, {METRIC: value * e / epoch, "epoch": e})
    searcher.on_trial_complete(trial_id, {METRIC: value, "epoch": epoch})


def test_every_cell_gets_exactly_num_samples(spec):
    searcher = GridCrossedSearcher(spec)
    suggestions = drain(searcher)
    assert len(suggestions) == spec.num_trials == 6 * 3
    counts = Counter(cell_key(c, spec) for _, c in suggestions)
    assert counts == {cell_key(c, spec): 3 for c in spec.grid_cells()}
    assert searcher.suggest("again") == Searcher.FINISHED
    # round-robin: the first 6 suggestions visit the 6 cells once each
    assert len({cell_key(c, spec) for _, c in suggestions[:6]}) == 6


def test_first_suggestion_per_cell_is_the_paper_default(spec):
    searcher = GridCrossedSearcher(spec)
    first = {}
    for _, config in drain(searcher):
        first.setdefault(cell_key(config, spec), config)
    for key, config in first.items():
        assert config["lambda"] == 0.035
        if config["fusion"] == "exp_decay":
            assert config["temperature"] == pytest.approx(math.sqrt(1000 * 50000), rel=1e-5)


def test_when_conditions_are_respected(spec):
    searcher = GridCrossedSearcher(spec)
    for _, config in drain(searcher):
        assert ("temperature" in config) == (config["fusion"] == "exp_decay")
        assert set(config) - {"temperature"} == {"fusion", "seed", "lambda"}
        assert 0.005 <= config["lambda"] <= 0.2
        cfg = spec.trial_config(config)  # a valid a2core config
        assert cfg["model"]["fusion"] == config["fusion"]
        assert cfg["model"].get("temperature") == config.get("temperature")  # absent unless exp_decay


def test_cells_without_active_sampled_keys_run_once(tmp_path):
    space = {"fusion": {"grid": ["none", "gate"]}, "lambda": {"loguniform": [0.01, 0.1], "when": {"fusion": "gate"}}}
    spec = load_study(study_file(tmp_path, space, num_samples=4))
    suggestions = [c for _, c in drain(GridCrossedSearcher(spec))]
    assert suggestions.count({"fusion": "none"}) == 1
    assert sum(1 for c in suggestions if c["fusion"] == "gate") == 4
    assert {"fusion": "gate", "lambda": 0.035} in suggestions


def test_suggestions_are_pure_flat_dicts(spec):
    searcher = GridCrossedSearcher(spec)
    config = searcher.suggest("a")
    assert all(k in spec.params for k in config)
    config["fusion"] = "mutated"
    again = searcher.suggest("a")
    assert again["fusion"] != "mutated"  # the searcher keeps its own copy
    assert {k: again[k] for k in spec.grid_cells()[0]} in spec.grid_cells()  # one cell's grid values


def test_state_save_restore_continues_without_repeating(spec, tmp_path):
    searcher = GridCrossedSearcher(spec)
    before = [(f"t{i}", searcher.suggest(f"t{i}")) for i in range(7)]
    for trial_id, _ in before[:4]:
        finish(searcher, trial_id, 0.5, spec.total_epochs)
    path = tmp_path / "searcher.pkl"
    searcher.save(str(path))

    restored = GridCrossedSearcher(spec)
    restored.restore(str(path))
    # a trial that was running when the state was saved completes after the restore
    finish(restored, before[5][0], 0.7, spec.total_epochs)
    assert restored.outcome(before[5][0]) == "COMPLETE"
    after = drain(restored, prefix="u")
    assert len(before) + len(after) == spec.num_trials
    seen = [c for _, c in before + after]
    counts = Counter(cell_key(c, spec) for c in seen)
    assert set(counts.values()) == {3}
    # nothing suggested twice: every (cell, sampled values) is new, and paper defaults appear once per cell
    assert len({tuple(sorted(c.items())) for c in seen}) == len(seen)
    # the restored searcher continues the original's exact sequence (samplers' random states included)
    finish(searcher, before[5][0], 0.7, spec.total_epochs)
    assert [c for _, c in drain(searcher, prefix="u")] == [c for _, c in after]


def test_get_state_set_state_round_trip(spec):
    a = GridCrossedSearcher(spec)
    for i in range(5):
        a.suggest(f"t{i}")
    b = GridCrossedSearcher(spec)
    b.set_state(a.get_state())
    assert b.get_state()["assigned"] == a.get_state()["assigned"]  # configurations suggested per cell
    assert b.suggest("t5") == a.suggest("t5")


def test_asha_stopped_trial_is_pruned(spec):
    searcher = GridCrossedSearcher(spec)
    ids = [searcher.suggest(f"t{i}") and f"t{i}" for i in range(3)]
    finish(searcher, ids[0], 0.9, spec.total_epochs)  # full run
    finish(searcher, ids[1], 0.4, 2)  # stopped by ASHA after 2 of 4 epochs
    searcher.on_trial_complete(ids[2], None, error=True)
    assert [searcher.outcome(t) for t in ids] == ["COMPLETE", "PRUNED", "FAIL"]

    trial = searcher.optuna_trial(ids[1])
    assert trial.state == TrialState.PRUNED
    assert trial.intermediate_values == {1: pytest.approx(0.2), 2: pytest.approx(0.4)}
    assert trial.value == pytest.approx(0.4)  # the last intermediate value

    complete = searcher.optuna_trial(ids[0])
    assert complete.state == TrialState.COMPLETE and complete.value == pytest.approx(0.9)
    assert complete.intermediate_values[spec.total_epochs] == pytest.approx(0.9)


def test_trial_without_metric_fails_and_repeats_are_ignored(spec):
    searcher = GridCrossedSearcher(spec)
    searcher.suggest("a")
    searcher.suggest("b")
    searcher.on_trial_complete("a", {"epoch": 1})
    assert searcher.outcome("a") == "FAIL"
    finish(searcher, "b", 0.5, spec.total_epochs)
    searcher.on_trial_complete("b", {METRIC: 0.1, "epoch": 1})  # a second completion changes nothing
    assert searcher.outcome("b") == "COMPLETE"
    searcher.on_trial_complete("unknown", {METRIC: 1.0, "epoch": 4})
    assert searcher.outcome("unknown") is None
    # NaN values and repeated epochs (a restored worker group) are not reported
    searcher.suggest("c")
    searcher.on_trial_result("c", {METRIC: float("nan"), "epoch": 1})
    searcher.on_trial_result("c", {METRIC: 0.3, "epoch": 1})
    searcher.on_trial_result("c", {METRIC: 0.2, "epoch": 1})
    searcher.on_trial_complete("c", {METRIC: 0.35, "epoch": 2})
    trial = searcher.optuna_trial("c")
    assert trial.intermediate_values == {1: 0.3, 2: 0.35}
    assert trial.state == TrialState.PRUNED


def test_tpe_learns_from_completed_trials(tmp_path):
    space = {"lambda": {"loguniform": [0.001, 1.0]}}
    spec = load_study(study_file(tmp_path, space, num_samples=30, seed=0))
    searcher = GridCrossedSearcher(spec)
    values = []
    for i in range(30):
        config = searcher.suggest(f"t{i}")
        values.append(config["lambda"])
        finish(searcher, f"t{i}", -abs(math.log(config["lambda"] / 0.03)), spec.total_epochs)
    assert values[0] == 0.035
    late = values[-10:]
    assert sum(abs(math.log(v / 0.03)) < 1.0 for v in late) >= 6  # TPE concentrates near the optimum
    assert n_startup_trials(30) == 10 and n_startup_trials(2) == 1


def test_grid_algorithm_runs_the_points(tmp_path):
    space = {"fusion": {"grid": ["max", "gate"]}, "lambda": {"loguniform": [0.005, 0.2]}}
    spec = load_study(study_file(tmp_path, space, algorithm="grid",
                                 points_to_evaluate=[{"lambda": 0.01}, {"lambda": 0.1}]))
    got = [c for _, c in drain(GridCrossedSearcher(spec))]
    assert sorted(got, key=lambda c: (c["fusion"], c["lambda"])) == [
        {"fusion": "gate", "lambda": 0.01}, {"fusion": "gate", "lambda": 0.1},
        {"fusion": "max", "lambda": 0.01}, {"fusion": "max", "lambda": 0.1}]


def test_random_algorithm_and_choice_conditions(tmp_path):
    space = {"fusion": {"grid": ["moving_average"]}, "model.renormalize": {"choice": [True, False]},
             "eta": {"uniform": [0.0, 0.5], "when": {"model.renormalize": True}},
             "seed": {"grid": [0, 1]}}
    spec = load_study(study_file(tmp_path, space, algorithm="random", num_samples=8))
    got = [c for _, c in drain(GridCrossedSearcher(spec))]
    assert len(got) == 16
    for c in got:
        assert ("eta" in c) == (c["model.renormalize"] is True)
    assert {c["model.renormalize"] for c in got} == {True, False}
    # renormalize False has no eta: one configuration, run once per seed however often it is drawn
    assert sorted(c["seed"] for c in got if not c["model.renormalize"]) == [0, 1]


def test_duplicate_suggestions_never_run_twice(tmp_path, monkeypatch):
    """Suggestions that resolve to a configuration already run (the same values, or values of keys that do not
    apply to it: eta without moving_average) are told to Optuna as FAIL and not run: no replicate group twice
    with the same seeds. A grid cell with nothing new left is done."""
    from dashboards.stats import config_hash

    # eta for fusions that do not use it: `a2 study validate` refuses such a space (launch.spec._check_applicable);
    # a study saved before it did is taken as it is, and its searcher must still never run a duplicate
    monkeypatch.setattr("launch.spec._check_applicable", lambda space, sections: None)
    space = {"fusion": {"grid": ["none", "gate"]}, "eta": {"uniform": [0.0, 0.5]},
             "lambda": {"choice": [0.01, 0.1], "when": {"fusion": "gate"}}}
    spec = load_study(study_file(tmp_path, space, algorithm="random", num_samples=6, replicates=2))
    searcher = GridCrossedSearcher(spec)
    got = drain(searcher)
    groups = {}
    for tid, c in got:
        groups.setdefault(config_hash(spec.trial_config(c)), []).append(c["seed"])
    # none: one configuration; gate: lambda 0.01 or 0.1 (eta does not apply to either): three groups of seeds 0, 1
    assert sorted(map(sorted, groups.values())) == [[0, 1]] * 3
    failed = [t for study in searcher._studies for t in study.trials if t.state == TrialState.FAIL]
    assert failed and all(len(t.user_attrs["duplicate_of"]) == 12 for t in failed)
    # after a restore of a state saved before duplicates were tracked, they are still known
    state = searcher.get_state()
    del state["hashes"]
    restored = GridCrossedSearcher(spec)
    restored.set_state(state)
    assert restored._hashes == searcher._hashes


def test_build_scheduler_and_tune_config(asha_spec, tmp_path):
    spec = asha_spec
    searcher, scheduler = GridCrossedSearcher(spec), build_scheduler(spec)
    assert isinstance(searcher, GridCrossedSearcher)
    assert isinstance(scheduler, ReplicateASHA)
    assert scheduler.rungs == [2]  # grace 2, below max_t = 4 planned epochs (study_file trains 4)
    assert searcher.metric == METRIC and searcher.mode == "max"
    kwargs = tune_config_kwargs(spec)
    assert kwargs["num_samples"] == spec.num_trials
    assert kwargs["max_concurrent_trials"] == spec.resources.max_concurrent_trials
    assert (kwargs["metric"], kwargs["mode"]) == (METRIC, "max")
    assert kwargs["reuse_actors"] is True  # one worker per trial: the next trial reuses the trial process
    raw = yaml.safe_load(study_file(tmp_path, ABLATION).read_text())
    raw["resources"].update(workers_per_trial=2, cpus_per_worker=0.5)
    raw.setdefault("train", {})["batch_size"] = 50  # 10 images: 5 per worker
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(raw))
    assert tune_config_kwargs(load_study(tmp_path / "train.yaml"))["reuse_actors"] is False  # Ray Train trials
    # the scheduler takes metric and mode from the TuneConfig, the searcher accepts the same ones
    assert scheduler.set_search_properties(METRIC, "max")
    assert searcher.set_search_properties(METRIC, "max", {})
    with pytest.raises(ValueError):
        searcher.set_search_properties("val/BLEU-4", "max", {})
    # Tune wraps it in a ConcurrencyLimiter, which must not confuse the state saving
    limited = ConcurrencyLimiter(searcher, max_concurrent=1)
    assert limited.suggest("x") is not None and limited.suggest("y") is None
    fifo = load_study(study_file(tmp_path, ABLATION, scheduler={"fifo": {}}))
    assert isinstance(build_scheduler(fifo), FIFOScheduler)


def test_a_trial_stopped_at_a_rung_ends_with_its_diagnostics(tmp_path):
    """The smoke study runs diagnostics after the last epoch only (diag_every: 0), but ASHA may stop a trial at
    epochs 2 or 4: its trials also run them at the scheduler's rungs, so a stopped trial logs diag/... too."""
    from launch.spec import scheduler_rungs
    from launch.trainable import plan_from_spec

    smoke = load_study(SMOKE)
    assert smoke.base["train"]["diag_every"] == 0 and scheduler_rungs(smoke) == [2, 4]
    config = plan_from_spec(smoke).config({"fusion": "gate", "lambda": 0.035, "seed": 1})
    assert config["train"]["diag_epochs"] == [2, 4] and config["train"]["seed"] == 1
    fifo = load_study(study_file(tmp_path, ABLATION, scheduler={"fifo": {}}))
    assert scheduler_rungs(fifo) == []
    assert plan_from_spec(fifo).config({"fusion": "max", "lambda": 0.035, "seed": 0})["train"]["diag_epochs"] == []


# -- replicate groups ----------------------------------------------------------------------------------------------
REPLICATED = {"fusion": {"grid": ["none", "gate"]},
              "lambda": {"loguniform": [0.005, 0.2], "when": {"fusion": "gate"}}}


def test_replicate_group_is_one_optuna_observation_of_its_mean(tmp_path):
    spec = load_study(study_file(tmp_path, REPLICATED, num_samples=2, replicates=3))
    assert spec.replicate_seeds == [0, 1, 2] and spec.num_trials == 3 * 3
    searcher = GridCrossedSearcher(spec)
    got = drain(searcher)
    assert len(got) == 9
    first = [c for _, c in got[:3]]
    assert [c["seed"] for c in first] == [0, 1, 2]
    assert len({group_key(c, spec.trial_config) for c in first}) == 1  # one group: same config hash, seeds differ
    assert len({group_key(c, spec.trial_config) for _, c in got}) == 3
    assert spec.trial_config(first[1])["train"]["seed"] == 1

    ids = [t for t, _ in got[:3]]
    assert searcher.group_of(ids[2]) == ids
    for t, v in zip(ids[:2], (0.9, 1.2)):
        finish(searcher, t, v, spec.total_epochs)
    study = searcher.study_of(ids[0])
    trial = searcher.optuna_trial(ids[0])
    assert trial.state == TrialState.RUNNING and trial.intermediate_values == {}  # waits for the third seed
    finish(searcher, ids[2], 1.5, spec.total_epochs)
    trial = searcher.optuna_trial(ids[0])
    assert trial.state == TrialState.COMPLETE and trial.value == pytest.approx(1.2)
    assert trial.intermediate_values[1] == pytest.approx(1.2 / spec.total_epochs)
    assert len(study.trials) == 1  # three Tune trials, one Optuna observation


def test_replicate_group_with_a_stopped_replicate_is_pruned_and_restores(tmp_path):
    spec = load_study(study_file(tmp_path, REPLICATED, num_samples=2, replicates=[3, 7]))
    searcher = GridCrossedSearcher(spec)
    a = searcher.suggest("a")
    path = tmp_path / "searcher.pkl"
    searcher.save(str(path))
    restored = GridCrossedSearcher(spec)
    restored.restore(str(path))
    b = restored.suggest("b")  # the second replicate of the same configuration, after a restore
    assert (a["seed"], b["seed"]) == (3, 7) and group_key(a, spec.trial_config) == group_key(b, spec.trial_config)
    finish(restored, "a", 1.0, spec.total_epochs)
    finish(restored, "b", 0.4, 2)  # stopped early
    assert restored.study_of("a").trials[0].state == TrialState.PRUNED


def test_replicates_and_a_seed_key_are_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"search.space.seed: names train.seed like search.replicates already does"):
        load_study(study_file(tmp_path, {**REPLICATED, "seed": {"grid": [0, 1]}}, replicates=3))
    with pytest.raises(ConfigError, match=r"train.seed: is set by search.replicates; remove it from train"):
        load_study(study_file(tmp_path, REPLICATED, replicates=3), ["train.seed=1"])
    with pytest.raises(ConfigError, match=r"search.replicates\[1\]: seed 0 is listed twice"):
        load_study(study_file(tmp_path, REPLICATED, replicates=[0, 0]))
    with pytest.raises(ConfigError, match=r"search.replicates: must be >= 1"):
        load_study(study_file(tmp_path, REPLICATED, replicates=0))


def test_a_fused_configuration_is_one_trial_with_its_seeds(tmp_path):
    """`resources.fuse_replicates`: each configuration goes out once, with all its replicate seeds (`seeds`), as a
    group of one for Optuna, which gets the seeds' mean that the fused trial reports."""
    path = study_file(tmp_path, REPLICATED, num_samples=2, replicates=3)
    spec = load_study(path, ["resources.fuse_replicates=true"])
    assert spec.tune_samples == 3 and spec.num_trials == 9
    searcher = GridCrossedSearcher(spec)
    got = drain(searcher)
    assert len(got) == 3 and all(c["seeds"] == [0, 1, 2] and "seed" not in c for _, c in got)
    plain = [c for _, c in drain(GridCrossedSearcher(load_study(path)))]
    # the same configurations in the same order as the unfused study's groups
    assert [{k: v for k, v in c.items() if k != "seeds"} for _, c in got] == [
        {k: v for k, v in c.items() if k != "seed"} for c in plain[::3]]
    assert group_key(got[0][1], spec.trial_config) == group_key(plain[0], spec.trial_config)
    finish(searcher, got[0][0], 1.2, spec.total_epochs)
    trial = searcher.optuna_trial(got[0][0])
    assert trial.state == TrialState.COMPLETE and trial.value == pytest.approx(1.2)
    # a study started before fused trials (`fuse_replicates` then priced only) resumes with one seed a trial
    unfused = GridCrossedSearcher(load_study(path))
    unfused.suggest("a")
    state = unfused.get_state()
    del state["fused"]
    restored = GridCrossedSearcher(spec)
    restored.set_state(state)
    assert restored.suggest("b")["seed"] == 1 and "seeds" not in restored.suggest("c")


# -- the replicate-group scheduler ----------------------------------------------------------------------------------
def trial(tid: str, config: dict):
    return SimpleNamespace(trial_id=tid, config=config)


def run_rung(sched, groups: dict[str, list[float]], epoch: int = 1) -> dict[str, list[str]]:
    """Report `groups` (name -> one value per replicate) at `epoch`, group after group; decisions per trial."""
    out = {}
    for name, values in groups.items():
        out[name] = []
        for seed, v in enumerate(values):
            t = trial(f"{name}-{seed}", {"fusion": name, "seed": seed})
            sched.on_trial_add(None, t)
            out[name].append(sched.on_trial_result(None, t, {METRIC: v, "epoch": epoch}))
    return out


def scheduler(k=2.0, replicates=3):
    sched = ReplicateASHA(max_t=8, grace_period=1, reduction_factor=2, replicates=replicates, min_gap_se=k)
    assert sched.set_search_properties(METRIC, "max")
    return sched


# seed spread 1.0 in every group (values m-1, m, m+1): pooled sd 1, threshold 2 * 1 * sqrt(2/3) = 1.633
SPREAD = (-1.0, 0.0, 1.0)



@pytest.mark.parametrize("max_t, grace, factor, rungs", [
    (8, 1, 2, [1, 2, 4]), (8, 2, 2, [2, 4]), (30, 1, 3, [1, 3, 9, 27]), (8, 8, 2, []),
    (4, 1, 1.5, [1, 2, 3]),  # 1, 1.5, 2.25, 3.375: rounded up, 2 once and never the last epoch (4)
    (10, 1, 1.1, [1, 2, 3, 4, 5, 6, 7, 8, 9]),  # 1.1**i: each epoch once, not 2, 2, 2, ...
    (6, 2, 1.2, [2, 3, 4, 5])])
def test_rungs_are_whole_epochs_before_the_last_each_once(max_t, grace, factor, rungs):
    assert asha_rungs(max_t, grace, factor) == rungs


def test_scheduler_never_stops_a_group_within_its_threshold():
    sched = scheduler()
    threshold = 2 * 1.0 * math.sqrt(2 / 3)
    decisions = run_rung(sched, {"a": [10 + d for d in SPREAD], "b": [10 - threshold + 0.01 + d for d in SPREAD]})
    assert decisions["b"] == [TrialScheduler.CONTINUE] * 3  # below the cutoff 10, but by less than the threshold
    assert sched.stopped_early("b-2") is None
    # one seed far below the cutoff does not stop its group when the group mean is close
    decisions = run_rung(sched, {"c": [4.0, 12.0, 12.0]})
    assert decisions["c"] == [TrialScheduler.CONTINUE] * 3


def test_scheduler_stops_a_group_clearly_below_and_all_its_replicates():
    sched = scheduler()
    run_rung(sched, {"a": [10 + d for d in SPREAD]})
    decisions = run_rung(sched, {"b": [6 + d for d in SPREAD]})  # 4 below, threshold 1.63
    assert decisions["b"] == [TrialScheduler.CONTINUE, TrialScheduler.CONTINUE, TrialScheduler.STOP]
    info = sched.stopped_early("b-2")
    assert info["rung"] == 1 and info["cutoff"] == pytest.approx(10.0) and info["group_mean"] == pytest.approx(6.0)
    assert info["threshold"] == pytest.approx(2 * math.sqrt(2 / 3))
    # the replicates that were still running stop at their next result, with the same record
    t = trial("b-0", {"fusion": "b", "seed": 0})
    assert sched.on_trial_result(None, t, {METRIC: 6.5, "epoch": 2}) == TrialScheduler.STOP
    assert sched.stopped_early("b-0") == info
    assert sched.stopped_early("a-0") is None


def test_scheduler_without_measured_spread_stops_nothing():
    sched = scheduler(replicates=1)
    decisions = run_rung(sched, {"a": [10.0], "b": [1.0], "c": [0.5]})
    assert all(d == [TrialScheduler.CONTINUE] for d in decisions.values())


def test_scheduler_min_mode_and_a_replicate_that_ended_early():
    sched = ReplicateASHA(max_t=8, grace_period=1, reduction_factor=2, replicates=3, mode="min", metric="loss")
    for name, values in {"a": [1.0, 1.1, 0.9], "b": [5.0, 5.1]}.items():
        for seed, v in enumerate(values):
            t = trial(f"{name}-{seed}", {"fusion": name, "seed": seed})
            sched.on_trial_add(None, t)
            sched.on_trial_result(None, t, {"loss": v, "epoch": 1})
    assert sched.group_means(1) == {group_key({"fusion": "a", "seed": 0}): pytest.approx(1.0)}  # b waits for its third
    failed = trial("b-2", {"fusion": "b", "seed": 2})
    sched.on_trial_add(None, failed)
    sched.on_trial_error(None, failed)  # ... which fails before the rung: the group is decided on two seeds
    assert sched.stopped_early("b-0") is None
    assert sched.on_trial_result(None, trial("b-0", {"fusion": "b", "seed": 0}), {"loss": 5.0, "epoch": 2}) == "STOP"
    assert sched.stopped_early("b-0")["cutoff"] == pytest.approx(1.0)


class Controller:
    """The part of Tune's controller a scheduler sees: its trials, each with a status."""

    def __init__(self):
        self.trials: list[SimpleNamespace] = []

    def add(self, sched, tid: str, config: dict, status: str = "RUNNING"):
        t = SimpleNamespace(trial_id=tid, config=config, status=status)
        self.trials.append(t)
        sched.on_trial_add(self, t)
        return t

    def get_trials(self):
        return list(self.trials)


def holding_scheduler(hold=True):
    sched = ReplicateASHA(max_t=8, grace_period=1, reduction_factor=2, replicates=3, min_gap_se=2.0,
                          hold_at_rungs=hold)
    sched.set_search_properties(METRIC, "max")
    return sched, Controller()


def report(sched, controller, t, value: float, epoch: int = 1) -> str:
    decision = sched.on_trial_result(controller, t, {METRIC: value, "epoch": epoch})
    t.status = {TrialScheduler.PAUSE: "PAUSED", TrialScheduler.STOP: "TERMINATED"}.get(decision, t.status)
    return decision


def test_replicates_wait_at_a_rung_for_their_group_and_resume_when_it_goes_on():
    sched, controller = holding_scheduler()
    a = [controller.add(sched, f"a-{i}", {"fusion": "a", "seed": i}) for i in range(3)]
    assert report(sched, controller, a[0], 9.0) == TrialScheduler.PAUSE  # a-1, a-2 still to come: a-0 waits
    assert report(sched, controller, a[1], 10.0) == TrialScheduler.PAUSE
    assert sched.choose_trial_to_run(controller) is None  # both held; a-2 is running
    assert report(sched, controller, a[2], 11.0) == TrialScheduler.CONTINUE  # the last one: the group is judged
    assert sched.choose_trial_to_run(controller) is a[0]  # the held ones are released, paused first
    a[0].status = "RUNNING"
    assert sched.choose_trial_to_run(controller) is a[1]
    # a-0 resumed reports its rung result again (launch.trainable), then trains on to the next rung
    assert report(sched, controller, a[0], 9.0) == TrialScheduler.CONTINUE
    assert sched.group_means(1) == {group_key({"fusion": "a", "seed": 0}): pytest.approx(10.0)}


def test_replicates_held_at_a_rung_stop_with_their_group_when_resumed():
    sched, controller = holding_scheduler()
    for i, v in enumerate((9.0, 10.0, 11.0)):  # group a: the cutoff 10 at rung 1, spread 1
        t = controller.add(sched, f"a-{i}", {"fusion": "a", "seed": i})
        report(sched, controller, t, v)
    b = [controller.add(sched, f"b-{i}", {"fusion": "b", "seed": i}) for i in range(3)]
    assert report(sched, controller, b[0], 5.0) == TrialScheduler.PAUSE
    assert report(sched, controller, b[1], 6.0) == TrialScheduler.PAUSE
    assert report(sched, controller, b[2], 7.0) == TrialScheduler.STOP  # 4 below the cutoff, threshold 1.63
    assert sched.choose_trial_to_run(controller) is b[0]  # released: it stops at its first result
    for t in b[:2]:
        t.status = "RUNNING"
        assert report(sched, controller, t, 5.0) == TrialScheduler.STOP  # its rung result, reported again
    for t in b:
        assert sched.stopped_early(t.trial_id)["rung"] == 1
    assert sched.choose_trial_to_run(controller) is None


def test_a_replicate_is_not_held_for_one_that_is_not_on_its_way():
    sched, controller = holding_scheduler()
    first = controller.add(sched, "a-0", {"fusion": "a", "seed": 0})
    controller.add(sched, "a-1", {"fusion": "a", "seed": 1})  # a-2 not suggested yet: holding could deadlock
    assert report(sched, controller, first, 9.0) == TrialScheduler.CONTINUE
    sched, controller = holding_scheduler(hold=False)  # Ray Train trials: never held
    a = [controller.add(sched, f"a-{i}", {"fusion": "a", "seed": i}) for i in range(3)]
    assert report(sched, controller, a[0], 9.0) == TrialScheduler.CONTINUE


def test_held_trials_run_on_when_nothing_else_can_run():
    sched, controller = holding_scheduler()
    a = [controller.add(sched, f"a-{i}", {"fusion": "a", "seed": i}) for i in range(3)]
    assert report(sched, controller, a[0], 9.0) == TrialScheduler.PAUSE
    a[1].status = a[2].status = "PAUSED"  # e.g. paused by Tune itself: no group member left running
    assert sched.choose_trial_to_run(controller) is a[0]


def test_hold_at_rungs_is_a_one_worker_option(asha_spec, tmp_path):
    from a2core.config import ConfigError

    assert not build_scheduler(asha_spec).hold_at_rungs  # off unless asked for
    raw = yaml.safe_load(study_file(tmp_path, REPLICATED_ABLATION, replicates=2).read_text())
    raw["search"]["scheduler"] = {"asha": {"grace_period": 1, "hold_at_rungs": True}}
    (tmp_path / "hold.yaml").write_text(yaml.safe_dump(raw))
    assert build_scheduler(load_study(tmp_path / "hold.yaml")).hold_at_rungs
    raw["resources"].update(workers_per_trial=2, cpus_per_worker=0.5)
    raw.setdefault("train", {})["batch_size"] = 50  # 10 images: 5 per worker
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="search.scheduler.asha.hold_at_rungs.*one-worker trials"):
        load_study(tmp_path / "train.yaml")


def test_one_config_hash_for_tags_scheduler_status_and_package(tmp_path, monkeypatch):
    """A sampled key that does not apply to a configuration (lambda for fusion none) changes nothing: the
    scheduler's group, the MLflow tag (`group_key` with the spec's resolver), `a2 study status`'s groups and
    packaging's hash (`config_hash` of the resolved config) are one value."""
    from dashboards.runs import Trial
    from dashboards.stats import config_hash
    from launch.record import replicate_groups

    # lambda without `when: {fusion: gate}`: refused by `a2 study validate` (launch.spec._check_applicable), yet a
    # study saved before it was is read as it is, and must still hash as one configuration
    monkeypatch.setattr("launch.spec._check_applicable", lambda space, sections: None)
    spec = load_study(study_file(tmp_path, {"fusion": {"grid": ["none", "gate"]}, "lambda": {"loguniform": [0.005, 0.2]}},
                                 replicates=2))
    a, b = {"fusion": "none", "lambda": 0.05, "seed": 0}, {"fusion": "none", "lambda": 0.1, "seed": 1}
    digest = config_hash(spec.trial_config(a))
    assert group_key(a, spec.trial_config) == group_key(b, spec.trial_config) == digest
    scheduler = build_scheduler(spec)
    for tid, c in (("x", a), ("y", b)):
        scheduler.on_trial_add(None, SimpleNamespace(trial_id=tid, config=c))
    assert scheduler._groups == {"x": digest, "y": digest}
    rows = [Trial(tid, sampled=c, config=spec.trial_config(c), best_value=v)
            for tid, c, v in (("x", a, 1.0), ("y", b, 2.0))]
    (group,) = replicate_groups(spec, rows)
    assert group["config_hash"] == digest and group["seeds"] == [0, 1] and group["n"] == 2


def test_the_scheduler_judges_a_fused_trials_seeds_as_its_replicates():
    """A fused trial reports its seeds' values (`seed<N>/<metric>`): the scheduler takes them as the group's
    replicates, with their spread, and stops the fused trial (the whole group) as it would stop the group's trials."""
    sched = scheduler()
    run_rung(sched, {"a": [10 + d for d in SPREAD]})
    fused = trial("f", {"fusion": "b", "seeds": [0, 1, 2]})
    sched.on_trial_add(None, fused)
    result = {METRIC: 6.0, "epoch": 1, **{f"seed{s}/{METRIC}": 6 + d for s, d in enumerate(SPREAD)}}
    assert sched.on_trial_result(None, fused, result) == TrialScheduler.STOP
    info = sched.stopped_early("f")
    assert info["group_mean"] == pytest.approx(6.0) and info["threshold"] == pytest.approx(2 * math.sqrt(2 / 3))
    # within the threshold: it goes on
    close = trial("g", {"fusion": "c", "seeds": [0, 1, 2]})
    sched.on_trial_add(None, close)
    result = {METRIC: 9.0, "epoch": 1, **{f"seed{s}/{METRIC}": 9 + d for s, d in enumerate(SPREAD)}}
    assert sched.on_trial_result(None, close, result) == TrialScheduler.CONTINUE
