"""GridCrossedSearcher without a Ray cluster: suggest / on_trial_result / on_trial_complete called directly."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import yaml
from optuna.trial import TrialState
from ray.tune.schedulers import AsyncHyperBandScheduler, FIFOScheduler
from ray.tune.search import ConcurrencyLimiter, Searcher

from launch.search import GridCrossedSearcher, build_search, n_startup_trials, tune_config_kwargs
from launch.spec import load_study

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "studies" / "smoke.yaml"
METRIC = "val/CIDEr"


def study_file(tmp_path: Path, space: dict, **search) -> Path:
    raw = yaml.safe_load(SMOKE.read_text())
    raw["search"]["space"] = space
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


def cell_key(config: dict, spec) -> tuple:
    return tuple(config[k] for k in spec.grid_keys)


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
        assert cfg["model"]["temperature"] == config.get("temperature")


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
    assert searcher.suggest("a")["fusion"] != "mutated"  # the searcher keeps its own copy
    assert searcher.cell_of("a") in spec.grid_cells()


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
    assert b.counts() == a.counts()
    assert b.suggest("t5") == a.suggest("t5")


def test_asha_stopped_trial_is_pruned(spec):
    searcher = GridCrossedSearcher(spec)
    ids = [searcher.suggest(f"t{i}") and f"t{i}" for i in range(3)]
    finish(searcher, ids[0], 0.9, spec.total_epochs)  # full run
    finish(searcher, ids[1], 0.4, 2)  # stopped by ASHA after 2 of 4 epochs
    searcher.on_trial_complete(ids[2], None, error=True)
    assert [searcher.outcome(t) for t in ids] == ["COMPLETE", "PRUNED", "FAIL"]

    pruned_cell = searcher.cell_of(ids[1])
    study = searcher.study_of(pruned_cell)
    (trial,) = [t for t in study.trials if t.number == searcher.optuna_trial_number(ids[1])]
    assert trial.state == TrialState.PRUNED
    assert trial.intermediate_values == {1: pytest.approx(0.2), 2: pytest.approx(0.4)}
    assert trial.value == pytest.approx(0.4)  # the last intermediate value

    (complete,) = [t for t in searcher.study_of(searcher.cell_of(ids[0])).trials
                   if t.number == searcher.optuna_trial_number(ids[0])]
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
    (trial,) = [t for t in searcher.study_of(searcher.cell_of("c")).trials
                if t.number == searcher.optuna_trial_number("c")]
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
    space = {"model.renormalize": {"choice": [True, False]},
             "eta": {"uniform": [0.0, 0.5], "when": {"model.renormalize": True}},
             "seed": {"grid": [0, 1]}}
    spec = load_study(study_file(tmp_path, space, algorithm="random", num_samples=8))
    got = [c for _, c in drain(GridCrossedSearcher(spec))]
    assert len(got) == 16
    for c in got:
        assert ("eta" in c) == (c["model.renormalize"] is True)
    assert {c["model.renormalize"] for c in got} == {True, False}


def test_build_search_and_tune_config(spec, tmp_path):
    searcher, scheduler = build_search(spec)
    assert isinstance(searcher, GridCrossedSearcher)
    assert isinstance(scheduler, AsyncHyperBandScheduler)
    assert scheduler._time_attr == "epoch" and scheduler._max_t == spec.total_epochs
    assert searcher.metric == METRIC and searcher.mode == "max"
    kwargs = tune_config_kwargs(spec)
    assert kwargs["num_samples"] == spec.num_trials
    assert kwargs["max_concurrent_trials"] == spec.resources["max_concurrent_trials"]
    assert (kwargs["metric"], kwargs["mode"]) == (METRIC, "max")
    # the scheduler takes metric and mode from the TuneConfig, the searcher accepts the same ones
    assert scheduler.set_search_properties(METRIC, "max")
    assert searcher.set_search_properties(METRIC, "max", {})
    with pytest.raises(ValueError):
        searcher.set_search_properties("val/BLEU-4", "max", {})
    # Tune wraps it in a ConcurrencyLimiter, which must not confuse the state saving
    limited = ConcurrencyLimiter(searcher, max_concurrent=1)
    assert limited.suggest("x") is not None and limited.suggest("y") is None
    fifo = load_study(study_file(tmp_path, ABLATION, scheduler={"fifo": {}}))
    assert isinstance(build_search(fifo)[1], FIFOScheduler)
