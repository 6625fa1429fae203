"""A searched model key that some fusions do not use (`a2core.config.inapplicable_model_keys`) must not reach a trial of
such a fusion: there all its values give one configuration, which the plan would count once per value. And an
override of a dotted space key (`search.space.model.mask_net.grid=[linear]`, as `a2 study validate` suggests) sets
that key."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from a2core.config import ConfigError, inapplicable_model_keys
from launch.cli import main as a2
from launch.spec import apply_study_overrides, load_study

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "studies" / "smoke.yaml"
FUSIONS = ["none", "max", "moving_average", "exp_decay", "gate"]
USE_MASK = ["max", "moving_average", "exp_decay", "gate"]


def study(tmp_path: Path, space: dict, model: dict | None = None, name: str = "study.yaml", **search) -> Path:
    """studies/smoke.yaml (small, synthetic data) with this space, model keys added and search keys replaced."""
    raw = yaml.safe_load(SMOKE.read_text())
    raw["search"]["space"] = space
    raw["search"].update(search)
    raw["model"].update(model or {})
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def refused(path: Path, overrides=()) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_study(path, list(overrides))
    return err.value


def distinct_configs(spec) -> int:
    """Distinct applicable configurations of a study without sampled keys (its grid cells' trial configs)."""
    return len({json.dumps(spec.trial_config(cell), sort_keys=True) for cell in spec.grid_cells()})


# -- refused -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,spelled", [("lambda", {"loguniform": [0.005, 0.2]}),
                                         ("model.lambda", {"loguniform": [0.005, 0.2]}),
                                         ("model.mask_net", {"grid": ["content", "linear"]}),
                                         ("model.renormalize", {"grid": [False, True]}),
                                         ("model.mask_bias_init", {"choice": [1.0, 2.0]})])
def test_a_mask_network_key_with_none_in_the_fusion_grid_is_refused(tmp_path, key, spelled):
    err = refused(study(tmp_path, {"fusion": {"grid": ["none", "gate"]}, key: spelled}))
    message = str(err)
    assert err.path == f"search.space.{key}", message
    assert f"search.space.{key}:" in message and "only used by fusion" in message
    assert "'none'" in message and "changes nothing" in message
    assert "add `when: {fusion: gate}`" in message  # the fusions of the grid that use it


def test_eta_with_fusions_other_than_moving_average_is_refused(tmp_path):
    err = refused(study(tmp_path, {"fusion": {"grid": ["gate", "moving_average", "max"]},
                                   "eta": {"uniform": [0.05, 0.5]}}))
    message = str(err)
    assert err.path == "search.space.eta"
    assert "model.eta is only used by fusion 'moving_average'" in message
    assert "'gate' and 'max'" in message and "add `when: {fusion: moving_average}`" in message


def test_eta_when_no_searched_fusion_uses_it_says_so(tmp_path):
    err = refused(study(tmp_path, {"fusion": {"grid": ["none", "gate"]}, "model.eta": {"grid": [0.1, 0.2]}}))
    assert err.path == "search.space.model.eta"
    assert "no value of search.space.fusion uses it" in str(err) and "'moving_average'" in str(err)


def test_a_when_that_still_allows_none_is_refused(tmp_path):
    path = study(tmp_path, {"fusion": {"grid": FUSIONS},
                            "model.renormalize": {"grid": [False, True], "when": {"fusion": ["none", "max", "gate"]}},
                            "temperature": {"grid": [400], "when": {"fusion": "exp_decay"}}})
    err = refused(path)
    assert err.path == "search.space.model.renormalize"
    assert "'none'" in str(err) and "narrow its `when` to `{fusion: [max, gate]}`" in str(err)


@pytest.mark.parametrize("fusion", ["none", None])  # the smoke study's model has no fusion: the schema's default
def test_fixed_fusion_that_does_not_use_a_searched_key_is_refused(tmp_path, fusion):
    if fusion is None:  # the default fusion (gate) uses lambda, but not T_P
        err = refused(study(tmp_path, {"temperature": {"loguniform": [1000, 50000]}}))
        assert err.path == "search.space.temperature"
        assert "only used by fusion 'exp_decay'" in str(err) and "set model.fusion: exp_decay" in str(err)
        return
    err = refused(study(tmp_path, {"lambda": {"loguniform": [0.005, 0.2]}}, model={"fusion": fusion}))
    assert err.path == "search.space.lambda"
    assert "'none'" in str(err) and "set model.fusion to one that uses it" in str(err)
    assert "search.space.lambda" in str(err)


def test_the_temperatures_refusal_keeps_its_words(tmp_path):
    err = refused(study(tmp_path, {"fusion": {"grid": ["gate", "exp_decay"]},
                                   "temperature": {"loguniform": [1000, 50000]}}))
    assert err.path == "search.space.temperature"
    assert "the temperature T_P is only used by fusion 'exp_decay', but trials can use 'gate'" in str(err)
    assert "add `when: {fusion: exp_decay}`" in str(err)


# -- accepted ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,spelled", [("lambda", {"loguniform": [0.005, 0.2]}),
                                         ("model.mask_net", {"grid": ["content", "linear"]}),
                                         ("model.renormalize", {"grid": [False, True]})])
def test_a_mask_network_key_with_a_correct_when_is_accepted(tmp_path, key, spelled):
    spec = load_study(study(tmp_path, {"fusion": {"grid": ["none", "gate", "max"]},
                                       key: {**spelled, "when": {"fusion": ["gate", "max"]}}}))
    assert spec.params[key].when == {"fusion": ["gate", "max"]}


@pytest.mark.parametrize("fusion,key,spelled", [("gate", "lambda", {"loguniform": [0.005, 0.2]}),
                                                ("max", "model.mask_net", {"grid": ["content", "linear"]}),
                                                ("moving_average", "eta", {"uniform": [0.05, 0.5]}),
                                                ("exp_decay", "temperature", {"grid": [400, 800]})])
def test_a_fixed_fusion_that_uses_the_key_is_accepted(tmp_path, fusion, key, spelled):
    spec = load_study(study(tmp_path, {key: spelled}, model={"fusion": fusion}, replicates=2))
    assert key in spec.params and spec.base["model"]["fusion"] == fusion


def test_every_inapplicable_key_is_checked():
    """The keys the check covers are a2core's: every one of them is a model key a space can name."""
    from launch.spec import resolve_key

    keys = set().union(*(inapplicable_model_keys(f) for f in FUSIONS))
    assert keys == {"lambda", "mask_net", "renormalize", "mask_bias_init", "eta", "temperature"}
    assert all(resolve_key(f"model.{k}") == f"model.{k}" for k in keys)


# -- the plan counts distinct configurations ---------------------------------------------------------------------------
def test_fusion_ablation_without_its_when_is_refused_and_with_it_counts_what_runs():
    path = ROOT / "studies" / "fusion_ablation.yaml"
    with pytest.raises(ConfigError) as err:  # its `when` dropped: fusion none's two renormalize cells were one
        load_study(path, ["search.space.model.renormalize={grid: [false, true]}"], check_files=False)
    assert err.value.path == "search.space.model.renormalize" and "'none'" in str(err.value)
    spec = load_study(path, check_files=False)
    # none runs once; max, moving_average and gate once per renormalize; exp_decay's 2 cells 4 T_P samples each
    cells = spec.grid_cells()
    assert len({json.dumps(spec.trial_config({**c, **spec.fill(c, lambda p: p.default())}), sort_keys=True)
                for c in cells}) == len(cells) == 9
    assert spec.num_configs == 1 + 3 * 2 + 2 * 4 == 15
    assert spec.search_trials == 30 and spec.num_trials == 30 + 5 * 5  # not 32 + 25 = 57


def test_a_grid_study_plans_exactly_its_distinct_configurations(tmp_path):
    space = {"fusion": {"grid": FUSIONS},
             "model.renormalize": {"grid": [False, True], "when": {"fusion": USE_MASK}},
             "temperature": {"grid": [400], "when": {"fusion": "exp_decay"}}}
    spec = load_study(study(tmp_path, space, algorithm="grid", num_samples=1, scheduler={"fifo": {}}))
    assert spec.num_configs == distinct_configs(spec) == 1 + 4 * 2
    assert spec.num_trials == 9 * 4  # smoke's 4 replicates


# -- overrides of dotted space keys ------------------------------------------------------------------------------------
def test_the_hinted_override_of_a_dotted_space_key_works_when_typed(tmp_path, capsys):
    path = study(tmp_path, {"model.mask_net": {"grid": ["content", "linear"]}}, model={"mask_net": "linear"},
                 replicates=2)
    assert a2(["study", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    hint = re.search(r"write (search\.space\.\S+=\[[^\]]*\])\)", err)
    assert hint is not None, err
    assert hint.group(1) == "search.space.model.mask_net.grid=[linear]"
    raw = yaml.safe_load(path.read_text())
    del raw["model"]["mask_net"]  # "remove it from model"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    spec = load_study(path, [hint.group(1)])
    assert set(spec.params) == {"model.mask_net"}
    assert spec.params["model.mask_net"].kind == "grid" and spec.params["model.mask_net"].values == ("linear",)
    assert a2(["study", "validate", str(path), hint.group(1)]) == 0, capsys.readouterr().err


def test_the_hint_for_a_dotted_choice_key_works_when_typed(tmp_path, capsys):
    path = study(tmp_path, {"model.mask_net": {"choice": ["content", "linear"]}}, model={"mask_net": "linear"},
                 replicates=2)
    assert a2(["study", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    hint = re.search(r"write '([^']+)'\)", err)
    assert hint is not None and hint.group(1) == "search.space.model.mask_net={grid: [linear]}", err
    raw = yaml.safe_load(path.read_text())
    del raw["model"]["mask_net"]
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    spec = load_study(path, [hint.group(1)])  # the shell takes the quotes off
    assert spec.params["model.mask_net"].kind == "grid" and spec.params["model.mask_net"].values == ("linear",)


def test_an_override_sets_a_field_of_a_dotted_space_key(tmp_path):
    path = ROOT / "studies" / "fusion_ablation.yaml"
    spec = load_study(path, ["search.space.model.renormalize.when={fusion: [max, gate]}",
                             "search.space.model.renormalize.grid=[true]"], check_files=False)
    p = spec.params["model.renormalize"]
    assert p.when == {"fusion": ["max", "gate"]} and p.values == (True,)
    assert set(spec.params) == {"fusion", "model.renormalize", "temperature"}  # no new key, no nested "model"
    # a dotted config path the space does not have yet is added as one key
    spec = load_study(path, ["search.space.model.mask_net={grid: [content, linear], when: {fusion: [gate]}}"],
                      check_files=False)
    assert spec.params["model.mask_net"].values == ("content", "linear")
    # and the refusal of a `when` that allows none comes through an override too
    err = refused(study(tmp_path, {"fusion": {"grid": ["none", "gate"]},
                                   "model.renormalize": {"grid": [False, True], "when": {"fusion": "gate"}}}),
                  ["search.space.model.renormalize.when.fusion=[none, gate]"])
    assert err.path == "search.space.model.renormalize" and "'none'" in str(err)


def test_study_overrides_elsewhere_are_apply_overrides():
    raw = {"search": {"space": {"fusion": {"grid": ["gate"]}, "model.mask_net": {"grid": ["content"]}}},
           "model": {"d_model": 64}}
    out = apply_study_overrides(raw, ["model.d_model=32", "search.space.fusion.grid=[none]", "search.num_samples=2",
                                      "search.space.model.mask_net.when={fusion: gate}"])
    assert out == {"search": {"space": {"fusion": {"grid": ["none"]},
                                        "model.mask_net": {"grid": ["content"], "when": {"fusion": "gate"}}},
                              "num_samples": 2},
                   "model": {"d_model": 32}}
    assert raw["model"]["d_model"] == 64  # a copy
    with pytest.raises(ConfigError):
        apply_study_overrides(raw, ["not an override"])


# -- the data set is the study's, not a searched key ------------------------------------------------------------------
@pytest.mark.parametrize("key,spelled", [("data.images", {"grid": [2000, 20000]}),
                                         ("data.seed", {"grid": [0, 1]}),
                                         ("data.val_images", {"choice": [100, 500]})])
def test_a_data_key_that_decides_the_splits_images_is_not_searched(tmp_path, key, spelled):
    """`a2 study plan` priced a searched data.images at its schema default (1,500 images: 750 train) while the trials
    trained on 2,000 or 20,000; and such trials are ranked on different val images and compared on different test
    images."""
    raw = yaml.safe_load(SMOKE.read_text())
    raw["data"].pop(key.split(".")[1], None)
    raw["search"]["space"][key] = spelled
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    err = refused(path)
    assert err.path == f"search.space.{key}", str(err)
    assert "decides which images the splits hold" in str(err) and "set it in data" in str(err)


def test_the_vocabulary_keys_of_data_may_be_searched(tmp_path):
    raw = yaml.safe_load(SMOKE.read_text())
    raw["search"]["space"]["data.vocab_min_count"] = {"grid": [2, 5]}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    spec = load_study(path)
    assert sorted(spec.values_of("data.vocab_min_count")) == [2, 5]
    assert spec.images["train"] == 1000  # the file's 2,000 images, as every trial's


def test_a_study_saved_before_the_check_is_still_read(tmp_path, monkeypatch):
    """status, compare, report and resume read a study's saved study.yaml (`load_saved_spec`): a space saved before
    `_check_applicable` refused it (lambda beside fusion none without `when`) still loads, while a new study of it is
    refused."""
    from launch.location import STUDY_FILE, StudyLocation, load_saved_spec, saved_form

    path = study(tmp_path, {"fusion": {"grid": ["none", "gate"]}, "lambda": {"loguniform": [0.005, 0.2]}})
    refused(path)
    monkeypatch.setattr("launch.spec._check_applicable", lambda space, sections: None)  # as the older code saved it
    spec = load_study(path)
    monkeypatch.undo()
    folder = tmp_path / "storage" / spec.name
    folder.mkdir(parents=True)
    (folder / STUDY_FILE).write_text(yaml.safe_dump(saved_form(spec), sort_keys=False))
    again = load_saved_spec(StudyLocation(spec.name, str(tmp_path / "storage")))
    assert again.values_of("model.fusion") == spec.values_of("model.fusion") and again.num_trials == spec.num_trials


def test_the_validate_summary_counts_one_configuration_in_the_singular():
    spec = load_study(ROOT / "studies" / "mask_nets.yaml", ["search.space.model.mask_net.grid=[linear]"])
    assert spec.summary().startswith("OK a2-mask-nets: 3 trials = 1 configuration x 3 seeds in 1 grid cell (")
