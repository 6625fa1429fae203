"""Mistaken study files refused by `a2 study validate` in one line naming the file and the key, before Ray starts:
seed counts past the trial cap (refused before their seeds are listed), a searcher seed beyond numpy's range, a
mixed-type layers grid, numbers YAML 1.1 reads as strings (5e-3) in a float key's grid, points and `when`, and a
model key the study's fixed fusion does not use."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from a2core.config import SEED_LIMIT, ConfigError
from launch.commands.validate import validate_main
from launch.spec import MAX_TRIALS, load_study

pytestmark = pytest.mark.outside_ray_group

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "studies" / "smoke.yaml"


def study(tmp_path: Path, text: str = "", **search) -> Path:
    """studies/smoke.yaml (synthetic data, fusion grid [none, gate], lambda sampled) with `search` keys replaced and
    `text` (YAML, as a user types it) merged over the top-level sections."""
    raw = yaml.safe_load(SMOKE.read_text())
    raw["search"].update(search)
    raw["storage"] = str(tmp_path / "studies")
    raw["tracking"] = {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db"}
    for section, value in (yaml.safe_load(text) or {}).items():
        raw[section] = {**raw.get(section, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def refused(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_study(path)
    assert err.value.source == str(path)
    return err.value


def one_line_error(path: Path, capsys) -> str:
    assert validate_main(path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"a2: error: {path}: ")
    return err


# -- seed counts past the cap: refused before millions of seeds are listed --------------------------------------------
@pytest.mark.parametrize("replicates,key", [(10 ** 11, "search.replicates"),
                                            ({"min": 2, "max": 10 ** 11}, "search.replicates.max")])
def test_a_huge_replicate_count_is_refused_at_the_cap_not_by_memory(tmp_path, capsys, replicates, key):
    path = study(tmp_path, replicates=replicates)
    err = one_line_error(path, capsys)  # was a MemoryError (a list of 10^11 seeds)
    assert f"{key}: 100,000,000,000 seeds give at least as many trials, past the cap of {MAX_TRIALS:,}" in err
    assert load_study(study(tmp_path, replicates=MAX_TRIALS // 2, purpose="explore"),
                      ["search.space={fusion: {grid: [gate]}}"]).num_trials == MAX_TRIALS // 2


def test_a_huge_confirmation_count_is_refused_at_the_cap(tmp_path, capsys):
    path = study(tmp_path, confirm=10 ** 11)  # was a MemoryError building the confirmation seeds
    assert f"search.confirm: must be <= {MAX_TRIALS}, got 100000000000" in one_line_error(path, capsys)


# -- the searcher's seed: Optuna's sampler takes numpy's seeds only ---------------------------------------------------
def test_a_searcher_seed_beyond_numpys_range_is_refused(tmp_path):
    # two grid cells: cell 1's sampler is seeded search.seed + 1 (launch.search), which numpy refuses at run time
    err = refused(study(tmp_path, seed=SEED_LIMIT - 1))
    assert err.path == "search.seed"
    assert f"up to {SEED_LIMIT}, beyond the seed range 0 .. {SEED_LIMIT - 1}" in err.reason
    assert load_study(study(tmp_path, seed=SEED_LIMIT - 2)).search.seed == SEED_LIMIT - 2


# -- a grid of mixed types ---------------------------------------------------------------------------------------------
def test_a_layers_grid_with_a_string_is_one_line_not_a_type_error(tmp_path):
    path = study(tmp_path, space={"fusion": {"grid": ["none", "gate"]}, "model.layers": {"grid": [1, "2"]}})
    raw = yaml.safe_load(path.read_text())
    del raw["model"]["layers"]
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    err = refused(path)  # was TypeError: '<' not supported between 'str' and 'int' (the jsd metric's layer check)
    assert err.path == "search.space.model.layers.grid" and "'2' gives an invalid model.layers" in err.reason


# -- numbers YAML 1.1 reads as strings (no dot: 5e-3, 1e-2) ------------------------------------------------------------
def yaml11(tmp_path: Path, space: str, points: str | None = None) -> Path:
    """smoke.yaml with `space` (and `points`) spliced in as written, so 5e-3 reaches the loader as the string '5e-3'."""
    path = study(tmp_path, space="SPACE", points_to_evaluate="POINTS" if points else None)
    text = path.read_text().replace("space: SPACE", f"space: {space}")
    path.write_text(text.replace("points_to_evaluate: POINTS", f"points_to_evaluate: {points}"))
    return path


def test_a_number_string_and_its_number_in_one_grid_are_listed_twice(tmp_path):
    path = yaml11(tmp_path, "{fusion: {grid: [gate]}, lambda: {grid: [5e-3, 0.005]}}")
    assert yaml.safe_load(path.read_text())["search"]["space"]["lambda"]["grid"] == ["5e-3", 0.005]
    err = refused(path)  # was accepted: 2 grid cells of one configuration, each run and counted
    assert err.path == "search.space.lambda.grid[1]" and err.reason == "0.005 is listed twice"
    spec = load_study(yaml11(tmp_path, "{fusion: {grid: [gate]}, lambda: {grid: [5e-3, 1e-2]}}"))
    assert spec.params["lambda"].values == (0.005, 0.01)  # numbers, as a trial's config has them
    assert [spec.trial_config(c)["model"]["lambda"] for c in spec.grid_cells()] == [0.005, 0.01]


def test_a_point_written_without_a_dot_is_inside_its_range(tmp_path):
    path = yaml11(tmp_path, "{fusion: {grid: [gate]}, lambda: {loguniform: [1e-3, 1e-1]}}", "[{lambda: 1e-2}]")
    # was refused: "'1e-2' is outside search.space.lambda (loguniform [0.001, 0.1])"
    assert load_study(path).search.points_to_evaluate == [{"lambda": 0.01}]
    err = refused(yaml11(tmp_path, "{fusion: {grid: [gate]}, lambda: {loguniform: [1e-3, 1e-1]}}", "[{lambda: 1e0}]"))
    assert err.path == "search.points_to_evaluate[0].lambda" and err.reason.startswith("1.0 is outside")


def test_a_when_on_a_float_grid_matches_a_value_written_without_a_dot(tmp_path):
    space = ("{fusion: {grid: [moving_average]}, eta: {grid: [1e-1, 0.3]}, "
             "model.mask_bias_init: {grid: [1.0, 3.0], when: {eta: 1e-1}}}")
    spec = load_study(yaml11(tmp_path, space))
    assert spec.params["model.mask_bias_init"].when == {"eta": [0.1]}
    assert len(spec.grid_cells()) == 3  # eta 0.1 x 2 mask_bias_init, eta 0.3


# -- a fixed model key that the study's fusion does not use ------------------------------------------------------------
@pytest.mark.parametrize("model,fusions,key", [({"fusion": "max", "eta": 0.3}, None, "model.eta"),
                                               ({"fusion": "none", "lambda": 0.1}, None, "model.lambda"),
                                               ({"mask_net": "linear"}, ["none"], "model.mask_net"),
                                               ({"eta": 0.3}, ["none", "gate"], "model.eta")])
def test_a_fixed_model_key_no_trials_fusion_uses_is_refused(tmp_path, capsys, model, fusions, key):
    space = {"fusion": {"grid": fusions}} if fusions else {}
    path = study(tmp_path, space=space, points_to_evaluate=None, replicates=2)
    raw = yaml.safe_load(path.read_text())
    raw["model"].update(model)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    err = one_line_error(path, capsys)  # was accepted: every trial left the key out, silently
    assert f"{key}: " in err and "it would change nothing" in err


@pytest.mark.parametrize("model,fusions", [({"fusion": "moving_average", "eta": 0.3}, None),
                                           ({"fusion": "max", "eta": 0.1}, None),  # at its default: passes
                                           ({"eta": 0.3}, ["none", "moving_average"]),
                                           ({"lambda": 0.1}, ["none", "gate"])])
def test_a_fixed_model_key_some_trials_fusion_uses_is_accepted(tmp_path, model, fusions):
    space = {"fusion": {"grid": fusions}} if fusions else {}
    path = study(tmp_path, space=space, points_to_evaluate=None, replicates=2)
    raw = yaml.safe_load(path.read_text())
    raw["model"].update(model)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert load_study(path).name == "a2-smoke"
