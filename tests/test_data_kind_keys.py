"""A data key only the other data.kind reads is refused where a user wrote it (a study file, `a2 train`'s config
and overrides), not silently unused: a `captions` file without `kind: coco` would train on the synthetic set,
`images: 5000` would not limit COCO. An override that switches the kind leaves the replaced kind's keys out, and
configs saved with every key at its default (checkpoints, a ran study's study.yaml) still load."""
import pytest
import yaml

from a2core.config import Config, ConfigError, apply_overrides, check_data_kind
from launch.commands.local import training_config
from launch.spec import load_study
from tests.test_spec import SMOKE


@pytest.mark.parametrize("data, key, kind", [
    ({"captions": "c.json"}, "data.captions", "'synthetic' (the default)"),
    ({"kind": "synthetic", "features": "f.h5"}, "data.features", "'synthetic'"),
    ({"kind": "synthetic", "test_images": "t.json"}, "data.test_images", "'synthetic'"),
    ({"kind": "coco", "captions": "c", "features": "f", "images": 5000}, "data.images", "'coco'"),
    ({"kind": "coco", "captions": "c", "features": "f", "seed": 3}, "data.seed", "'coco'"),
    ({"kind": "coco", "captions": "c", "features": "f", "root": "/d"}, "data.root", "'coco'"),
])
def test_a_key_of_the_other_kind_is_refused_naming_it_and_the_fix(data, key, kind):
    with pytest.raises(ConfigError) as err:
        check_data_kind(data, "s.yaml")
    only = "coco" if kind.startswith("'synthetic") else "synthetic"
    assert err.value.path == key and f"data.kind is {kind}" in err.value.reason
    assert f"set data.kind: {only}, or drop {key}" in str(err.value) and "s.yaml" in str(err.value)


def test_keys_at_their_defaults_and_the_saved_form_pass():
    check_data_kind({"kind": "coco", "captions": "c", "features": "f", "seed": 0, "images": 1500, "root": None})
    check_data_kind({"kind": "synthetic", "captions": None, "features": None, "images": 40})
    for data in ({"kind": "synthetic", "images": 40}, {"kind": "coco", "captions": "c", "features": "f"}):
        check_data_kind(Config.from_dict({"data": data}).to_dict()["data"])  # every key, as a checkpoint holds it
    check_data_kind({"kind": "cocoa", "captions": "c"})  # an unknown kind is the Config check's to name


def test_an_override_that_switches_the_kind_leaves_the_replaced_kinds_keys_out():
    raw = {"data": {"kind": "synthetic", "seed": 0, "images": 2000, "val_images": 5}}
    coco = apply_overrides(raw, ["data.kind=coco", "data.captions=c.json", "data.features=f.h5"])
    assert coco["data"] == {"kind": "coco", "val_images": 5, "captions": "c.json", "features": "f.h5"}
    back = apply_overrides(coco, ["data.kind=synthetic"])
    assert back["data"] == {"kind": "synthetic", "val_images": 5}
    assert apply_overrides(raw, ["data.kind=synthetic"])["data"] == raw["data"]  # no switch: nothing left out
    # a key of the other kind given after the switch is the user's: refused, not dropped
    with pytest.raises(ConfigError, match="data.images: only data.kind synthetic reads it"):
        check_data_kind(apply_overrides(raw, ["data.kind=coco", "data.images=5000"])["data"])


def test_a_study_file_and_a2_train_refuse_it(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_study(SMOKE, ["data.captions=c.json"])
    assert err.value.path == "data.captions" and "smoke.yaml" in str(err.value)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"data": {"kind": "coco", "captions": "c", "features": "f", "images": 300}}))
    with pytest.raises(ConfigError) as err:
        training_config(str(config), [])
    assert err.value.path == "data.images" and str(config) in str(err.value)
    assert training_config(None, ["data.images=40"]).data.images == 40


def test_a_synthetic_stand_in_for_a_coco_study_loads_without_its_coco_keys(tmp_path):
    """fusion_ablation.yaml on the synthetic set by override: its captions/features/test_images are left out."""
    from tests.test_spec import ROOT
    spec = load_study(ROOT / "studies" / "fusion_ablation.yaml",
                      ["data.kind=synthetic", "data.images=200", f"storage={tmp_path / 'st'}",
                       "resources.cpus_per_worker=1", "resources.gpus_per_worker=0"], check_files=False)
    data = spec.base["data"]
    assert data["kind"] == "synthetic" and data["images"] == 200
    assert data["captions"] is None and data["features"] is None and data["test_images"] is None
