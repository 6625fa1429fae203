"""What `a2 train`, `a2 decode` and `a2 package` take and say: every override that decoding would ignore is
refused in one line saying what to write instead (exit 2), before any checkpoint is read or seed trained; the help
names the key that really sets a default; a key the search space sets says how to set it there."""
from __future__ import annotations

import pytest

from launch.cli import build_parser, main

DATA_KEYS = "kind, captions, features, test_images, root, seed, images, test_split_images, vocab_min_count"


@pytest.mark.parametrize("item, says", [
    ("features=/x.h5", "features: is a data key; write data.features=/x.h5"),
    ("model.d_model=8", "model.d_model: only data.* keys are read here and model.d_model is the checkpoint's own "
                        "(decoding changes only where its data is); write data.KEY=VALUE, KEY one of " + DATA_KEYS),
    ("train.seed=1", "train.seed: only data.* keys are read here and train.seed is the checkpoint's own"),
    ("output_dir=x", "output_dir: only data.* keys are read here and output_dir is the checkpoint's own"),
    ("fetaures=/x.h5", "fetaures: only data.* keys are read here and fetaures is no key of a config"),
    ("/x.h5", "/x.h5: is not of the form data.KEY=VALUE; write e.g. data.features=/x.h5"),
    ("data={features: /x.h5}", "data: one key at a time; write data.KEY=VALUE"),
])
def test_decode_refuses_every_override_it_would_ignore(tmp_path, capsys, item, says):
    """The checkpoint does not exist: the refusal comes first, before any checkpoint is read."""
    code = main(["decode", "data.val_images=5", item, "--checkpoints", str(tmp_path / "missing.pt"),
                 "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"a2: error: {says}") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r.json").exists()


def test_decode_takes_data_keys_and_refuses_unknown_ones_naming_the_known(tmp_path, capsys):
    from a2core.decode import check_data_overrides
    from a2core.errors import ConfigError

    check_data_overrides(["data.features=/x.h5", "data.val_images=5"])  # what the overrides are for: no error
    code = main(["decode", "--checkpoints", str(tmp_path / "missing.pt"), "--out", str(tmp_path / "r.json"), "--",
                 "data.features=/x.h5"])
    assert code == 2 and "missing.pt" in capsys.readouterr().err  # past the overrides: the missing checkpoint is next
    with pytest.raises(ConfigError, match=r"data.featurs: unknown key; known keys here: kind, captions, features"):
        from a2core.decode import checkpoint_data

        checkpoint_data({"data": {"kind": "synthetic"}, "model": {"max_regions": 10, "feature_dim": 8}}, None,
                        ["data.featurs=/x.h5"])


def test_package_refuses_an_ignored_data_item_before_anything_else(tmp_path, capsys):
    """`a2 package` of a study that does not exist: the ignored override is refused first (nothing located, trained
    or decoded), in the same words as `a2 decode`'s."""
    code = main(["package", "no-such-study", "model.d_model=8", "--storage", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("a2: error: model.d_model: only data.* keys are read here"), err
    assert not list(tmp_path.iterdir())


def test_train_output_dir_help_names_the_top_level_key_that_sets_its_default(tmp_path):
    from launch.commands.local import training_config

    train = next(a for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions
                 if "--output-dir" in a.option_strings)
    assert "train.output_dir" not in train.help and "top-level output_dir, runs/a2" in train.help
    assert training_config(None, [f"output_dir={tmp_path / 'x'}"]).output_dir == str(tmp_path / "x")  # the key works
    from a2core.errors import ConfigError

    with pytest.raises(ConfigError, match="train.output_dir: unknown key here; output_dir is a top-level key"):
        training_config(None, ["train.output_dir=x"])


def test_a_key_the_search_space_sets_says_how_to_set_it_there(capsys):
    from pathlib import Path

    from launch.spec import load_study

    smoke = str(Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml")
    assert main(["study", "validate", smoke, "model.fusion=gate"]) == 2
    out = capsys.readouterr()
    assert "model.fusion: is set by search.space.fusion; remove it from model (to give every trial this value, write " \
           "search.space.fusion.grid=[gate])" in out.err + out.out, out
    # what it says to write is a study that validates: gate's configuration over the 4 seeds
    spec = load_study(smoke, ["search.space.fusion.grid=[gate]"], check_files=False)
    assert spec.num_trials == 4
