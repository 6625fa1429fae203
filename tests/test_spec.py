"""Study files: every shipped study validates; bad ones fail fast, before Ray, naming the key and the file."""
from __future__ import annotations

import re
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from a2core.config import Config, ConfigError
from launch.cli import main as cli_main
from launch.commands.validate import validate_main
from launch.spec import StudySpec, check_cluster, load_study
from launch.location import saved_form

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted((ROOT / "studies").glob("*.yaml"))
SMOKE = ROOT / "studies" / "smoke.yaml"


@pytest.fixture
def coco_files(tmp_path) -> list[str]:
    """data.* overrides pointing the paper studies' kind: coco at files that exist (captions: one train and one
    val image, since validation reads them), and a bucket of the team's in place of the shipped placeholder."""
    images = [{"cocoid": i, "split": split, "sentences": [{"tokens": ["a", "dog"]}]}
              for i, split in enumerate(["train", "val"])]
    (tmp_path / "dataset_coco.json").write_text(json.dumps({"images": images}))
    (tmp_path / "features").mkdir()
    (tmp_path / "image_info_test2014.json").write_text("{}")
    return [f"data.captions={tmp_path / 'dataset_coco.json'}", f"data.features={tmp_path / 'features'}",
            f"data.test_images={tmp_path / 'image_info_test2014.json'}", "storage=s3://a2-team-bucket/a2-studies"]


def write(tmp_path: Path, raw: dict, name: str = "study.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def smoke_raw() -> dict:
    return yaml.safe_load(SMOKE.read_text())


# -- shipped studies --------------------------------------------------------------------------------------------
def test_there_are_shipped_studies():
    assert {p.stem for p in STUDIES} >= {"smoke", "lambda_sweep", "fusion_ablation", "seeds"}


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.stem)
def test_every_shipped_study_validates(path, coco_files):
    raw = yaml.safe_load(path.read_text())
    overrides = coco_files if raw["data"].get("kind") == "coco" else []
    spec = load_study(path, overrides)
    assert spec.name == raw["name"]
    assert spec.source == str(path)
    assert spec.num_trials >= 1
    for cell in spec.grid_cells():
        for point in spec.points_for_cell(cell) or [{}]:
            cfg = spec.trial_config({**cell, **point})
            Config.from_dict(cfg)  # a valid a2core config
    again = StudySpec.from_dict(saved_form(spec), source=str(path))  # what study.yaml holds, read back
    assert again.to_dict() == spec.to_dict()


@pytest.mark.parametrize("name", ["lambda_sweep", "fusion_ablation", "seeds"])
def test_the_placeholder_bucket_is_refused_before_anything_starts(name, coco_files, capsys):
    """The COCO studies ship with `storage: s3://YOUR-BUCKET/...`: validate (and so run and submit) refuses it in one
    line naming the file and the key, before the data is even read; `plan` still prices the study as shipped."""
    path = ROOT / "studies" / f"{name}.yaml"
    assert "s3://YOUR-BUCKET/" in yaml.safe_load(path.read_text())["storage"]
    with pytest.raises(ConfigError) as err:
        load_study(path, [o for o in coco_files if not o.startswith("storage=")])
    assert str(err.value).startswith(f"{path}: storage: s3://YOUR-BUCKET/a2-studies: YOUR-BUCKET is the placeholder")
    assert "\n" not in str(err.value)
    assert load_study(path, check_files=False).storage == "s3://YOUR-BUCKET/a2-studies"
    assert cli_main(["study", "validate", str(path), *[o for o in coco_files if not o.startswith("storage=")]]) == 2
    assert "replace it with your bucket" in capsys.readouterr().err


def test_the_cluster_files_name_no_placeholder_a2_does_not_refuse():
    """Every s3:// URI the shipped cluster files use names either a real bucket or the placeholder that `a2 data
    fetch` refuses on the head, in one line, before any GPU node is asked for."""
    from launch.placeholders import PLACEHOLDER_BUCKET, refuse_placeholder
    from a2core.errors import StorageError

    text = (ROOT / "ray-cluster.yaml").read_text()
    uris = re.findall(r"s3://[^\s'\"]+", text)
    assert uris and all(u.startswith(f"s3://{PLACEHOLDER_BUCKET}/") for u in uris)
    for uri in uris:
        with pytest.raises(StorageError, match="replace it with your bucket"):
            refuse_placeholder(uri)
    assert cli_main(["data", "fetch", f"s3://{PLACEHOLDER_BUCKET}/coco/dataset_coco.json", "/nonexistent/x"]) == 2


def test_paper_studies_name_missing_coco_files():
    with pytest.raises(ConfigError) as err:
        load_study(ROOT / "studies" / "lambda_sweep.yaml", ["data.captions=/nonexistent/dataset_coco.json",
                                                            "storage=s3://a2-team-bucket/a2-studies"])
    assert err.value.path == "data.captions"
    assert "lambda_sweep.yaml" in str(err.value) and "/nonexistent/dataset_coco.json" in str(err.value)


def test_smoke_study_shape():
    spec = load_study(SMOKE)
    assert spec.base["data"]["kind"] == "synthetic"
    assert spec.base["model"]["d_model"] <= 128
    assert spec.resources.gpus_per_worker == 0
    assert spec.resources.workers_per_trial == 1 and spec.resources.max_concurrent_trials == 2
    assert spec.resources.max_concurrent_trials * spec.trial_resources()["CPU"] <= 2  # side by side on 2 cores
    assert spec.storage == str(Path.cwd() / "a2-studies")
    assert spec.tracking.mlflow_uri == "sqlite:///" + str(Path.cwd() / "mlflow.db")
    assert spec.tracking.experiment == "a2-smoke"
    # fusion none: one configuration (lambda only exists for gate); gate: num_samples; each with 4 seeds
    assert spec.grid_cells() == [{"fusion": "none"}, {"fusion": "gate"}]
    assert [spec.samples_per_cell(c) for c in spec.grid_cells()] == [1, 1]
    assert spec.replicate_seeds == [0, 1, 2, 3]
    assert spec.num_trials == 2 * 4


def test_fusion_ablation_space(coco_files):
    spec = load_study(ROOT / "studies" / "fusion_ablation.yaml", coco_files)
    cells = [(c["fusion"], c.get("model.renormalize")) for c in spec.grid_cells()]
    # Each fusion as written and renormalised; the baseline fuses nothing, so it has no renormalize.
    assert cells == [("none", None)] + [(f, r) for f in ("max", "moving_average", "exp_decay", "gate")
                                        for r in (False, True)]
    # every configuration runs the search's 2 seeds; each fusion's chosen one 5 fresh seeds, the verdicts'
    assert (spec.replicate_seeds, spec.confirm_seeds) == ([0, 1], [2, 3, 4, 5, 6])
    assert spec.search_trials == (1 + 3 * 2 + 2 * spec.search.num_samples) * 2
    assert spec.num_trials == spec.search_trials + 5 * 5 and spec.verdict_seeds == 5
    assert spec.points_for_cell({"fusion": "gate", "seed": 0, "model.renormalize": False}) == []
    (point,) = spec.points_for_cell({"fusion": "exp_decay", "seed": 0, "model.renormalize": True})
    assert set(point) == {"temperature"}


def test_seeds_study_is_grid_only(coco_files):
    spec = load_study(ROOT / "studies" / "seeds.yaml", coco_files)
    assert spec.algorithm == "grid"
    assert spec.sampled_keys == []
    assert [c["seed"] for c in spec.grid_cells()] == [0, 1, 2, 3]
    assert spec.num_trials == 4
    assert [spec.trial_config(c)["train"]["seed"] for c in spec.grid_cells()] == [0, 1, 2, 3]
    assert spec.base["train"]["scst_epochs"] > 0


# -- overrides, trial configs, defaults --------------------------------------------------------------------------
def test_overrides_apply_before_validation():
    spec = load_study(SMOKE, ["search.num_samples=5", "train.xe_epochs=1", "search.scheduler={fifo: {}}",
                              "model.d_model=32", "name=a2-smoke-2"])
    assert spec.search.num_samples == 5
    assert spec.base["train"]["xe_epochs"] == 1
    assert spec.total_epochs == 1
    assert spec.base["model"]["d_model"] == 32
    assert spec.name == "a2-smoke-2"
    assert spec.num_trials == (1 + 5) * 4  # none once, gate 5 samples; 4 seeds each
    with pytest.raises(ConfigError) as err:
        load_study(SMOKE, ["train.xe_epochs=0"])
    assert err.value.path == "train.xe_epochs" and "smoke.yaml" in str(err.value)


def test_scst_with_no_xe_epochs_needs_a_checkpoint_to_start_from(tmp_path):
    """xe_epochs 0 with SCST passes a2core's validation (its tests set scst_from later) but has nothing to start stage
    2 from: `a2 study validate` and `a2 train` refuse it at train.scst_from (the epochs cannot be searched, so the
    base decides for every trial); with a checkpoint named it is a study of stage 2 alone."""
    from launch.commands.local import training_config
    with pytest.raises(ConfigError) as err:
        load_study(SMOKE, ["train.xe_epochs=0", "train.scst_epochs=1"])
    assert err.value.path == "train.scst_from" and "xe_epochs is 0" in err.value.reason
    assert "smoke.yaml" in str(err.value)
    with pytest.raises(ConfigError) as err:
        training_config(None, ["train.xe_epochs=0", "train.scst_epochs=2"])
    assert err.value.path == "train.scst_from" and "scst_epochs 2" in err.value.reason
    xe = tmp_path / "xe.pt"
    xe.write_bytes(b"x")
    spec = load_study(SMOKE, ["train.xe_epochs=0", "train.scst_epochs=2", f"train.scst_from={xe}"])
    assert spec.base["train"]["scst_from"] == str(xe) and spec.total_epochs == 2
    assert training_config(None, ["train.xe_epochs=0", "train.scst_epochs=1", f"train.scst_from={xe}"]).train.scst_from


def test_trial_config_maps_aliases_to_paths():
    spec = load_study(SMOKE)
    cfg = spec.trial_config({"fusion": "gate", "lambda": 0.031, "seed": 3})
    assert cfg["model"]["fusion"] == "gate"
    assert cfg["model"]["lambda"] == 0.031
    assert cfg["train"]["seed"] == 3
    assert cfg["model"]["d_model"] == spec.base["model"]["d_model"]
    # dotted paths work too, and the result is validated
    assert spec.trial_config({"model.eta": 0.2, "fusion": "moving_average"})["model"]["eta"] == 0.2
    with pytest.raises(ConfigError) as err:
        spec.trial_config({"lambda": -1.0})
    assert err.value.path == "model.lambda"
    with pytest.raises(ConfigError) as err:
        spec.trial_config({"bogus": 1})
    assert err.value.path == "bogus"
    assert spec.base["model"]["fusion"] == "gate"  # the base is never modified


def test_trial_config_leaves_out_the_parameters_its_fusion_does_not_use():
    spec = load_study(SMOKE)
    model = {f: spec.trial_config({"fusion": f, "lambda": 0.05, **({"model.temperature": 100.0}
                                                                  if f == "exp_decay" else {})})["model"]
             for f in ("none", "max", "moving_average", "exp_decay", "gate")}
    assert not {"lambda", "eta", "temperature", "renormalize", "mask_bias_init"} & set(model["none"])
    assert model["gate"]["lambda"] == model["max"]["lambda"] == 0.05 and "renormalize" in model["gate"]
    assert [f for f, m in model.items() if "eta" in m] == ["moving_average"]
    assert [f for f, m in model.items() if "temperature" in m] == ["exp_decay"]
    assert model["exp_decay"]["temperature"] == 100.0
    assert model["none"]["d_model"] == model["gate"]["d_model"]  # the rest of the model is there


@pytest.mark.slow
def test_tracked_trial_runs_have_no_inapplicable_params(tmp_path):
    from a2core.config import Config
    from launch.tracking_writer import StudyTracker

    tracker = StudyTracker(f"sqlite:///{tmp_path / 'm.db'}", "absent", artifact_location=str(tmp_path / "art"))
    run_id = tracker.trial_run("t0", Config.from_dict({"model": {"fusion": "none"}}).to_dict())  # with defaults
    params = tracker.client.get_run(run_id).data.params
    assert params["model.fusion"] == "none" and "model.d_model" in params
    assert not {"model.lambda", "model.eta", "model.temperature", "model.renormalize"} & set(params)


def test_default_points_are_the_paper_values(tmp_path):
    raw = smoke_raw()
    raw["search"]["space"] = {
        "fusion": {"grid": ["max", "moving_average"]},
        "lambda": {"loguniform": [0.005, 0.2]},
        "eta": {"uniform": [0.0, 0.5], "when": {"fusion": "moving_average"}},
        "model.dropout": {"uniform": [0.2, 0.4]},  # schema default 0.1 outside: the middle
    }
    del raw["model"]["dropout"]
    spec = load_study(write(tmp_path, raw))
    assert spec.search.points_to_evaluate == [{"lambda": 0.035, "model.dropout": 0.3, "eta": 0.1}]
    assert spec.points_for_cell({"fusion": "max"}) == [{"lambda": 0.035, "model.dropout": 0.3}]
    assert spec.points_for_cell({"fusion": "moving_average"}) == [{"lambda": 0.035, "model.dropout": 0.3, "eta": 0.1}]


def test_explicit_points_and_grid_algorithm(tmp_path):
    raw = smoke_raw()
    raw["search"].update(algorithm="grid", points_to_evaluate=[{"lambda": 0.01}, {"lambda": 0.1}])
    spec = load_study(write(tmp_path, raw))
    assert spec.points_for_cell({"fusion": "gate", "seed": 0}) == [{"lambda": 0.01}, {"lambda": 0.1}]
    assert spec.num_trials == (1 + 2) * 4  # none: once; gate: one configuration per point; 4 seeds each


def test_conditional_grid_key_and_choice(tmp_path):
    raw = smoke_raw()
    raw["search"]["space"] = {
        "fusion": {"grid": ["gate", "exp_decay"]},
        "temperature": {"grid": [1000, 10000], "when": {"fusion": "exp_decay"}},
        "model.renormalize": {"choice": [True, False]},
    }
    spec = load_study(write(tmp_path, raw))
    assert spec.grid_cells() == [{"fusion": "gate"}, {"fusion": "exp_decay", "temperature": 1000},
                                 {"fusion": "exp_decay", "temperature": 10000}]
    assert spec.num_trials == 3 * 1 * 4  # 3 cells x num_samples (1) x 4 seeds


def test_dotted_space_keys_must_exist_and_fit_the_type(tmp_path):
    raw = smoke_raw()
    del raw["model"]["layers"]
    raw["search"]["space"]["model.layers"] = {"uniform": [1, 3]}
    with pytest.raises(ConfigError) as err:
        load_study(write(tmp_path, raw))
    assert err.value.path == "search.space.model.layers.uniform" and "randint" in str(err.value)
    raw["search"]["space"]["model.layers"] = {"randint": [1, 3]}
    spec = load_study(write(tmp_path, raw))
    assert spec.params["model.layers"].path == "model.layers"
    raw["search"]["space"]["model.layerz"] = {"randint": [1, 3]}
    with pytest.raises(ConfigError) as err:
        load_study(write(tmp_path, raw))
    assert err.value.path == "search.space.model.layerz"


def test_cluster_resources_are_checked():
    load_study(SMOKE, cluster_resources={"CPU": 2, "GPU": 0})
    load_study(SMOKE, ["resources.cpus_per_worker=2"], cluster_resources={"CPU": 2, "GPU": 0})  # a worker's CPUs
    with pytest.raises(ConfigError) as err:
        load_study(SMOKE, ["resources.cpus_per_worker=3"], cluster_resources={"CPU": 2, "GPU": 0})
    assert err.value.path == "resources.cpus_per_worker" and "cluster has 2" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_study(SMOKE, ["resources.gpus_per_worker=2"], cluster_resources={"CPU": 2, "GPU": 1})
    assert err.value.path == "resources.gpus_per_worker" and "2 GPUs" in str(err.value)
    spec = load_study(SMOKE)  # the driver checks the validated spec once it knows its cluster
    check_cluster(spec, {"CPU": 2, "GPU": 0})
    with pytest.raises(ConfigError) as err:
        check_cluster(spec, {"CPU": 0.5})
    assert err.value.path == "resources.cpus_per_worker" and "smoke.yaml" in str(err.value)


def test_a_gpu_study_waits_for_the_workers_an_autoscaling_cluster_adds(tmp_path):
    """The how-to's cluster (ray-cluster.yaml): its head has 8 CPUs and no GPU, its spot workers (min 0) join when
    trials ask for them. Right after `ray up` Ray counts the head alone, so the driver reads what the autoscaler may
    add from the config `ray up` left in the head's home: the study waits for the workers; a trial larger than the
    whole cluster can ever be is still refused, naming both figures."""
    from ray.autoscaler._private.local.config import prepare_local

    from launch.raycluster import autoscaler_limits

    limits = autoscaler_limits(str(ROOT / "ray-cluster.yaml"))
    assert limits == {"CPU": 4 * 48, "GPU": 4 * 4}  # worker.gpu.spot: g5.12xlarge, max_workers 4; the head adds none
    spec = load_study(ROOT / "studies" / "fusion_ablation.yaml", ["storage=/tmp/unused"], check_files=False)
    head = {"CPU": 8.0, "GPU": 0.0}
    with pytest.raises(ConfigError) as err:
        check_cluster(spec, head)  # without the autoscaler's figures: refused, as before
    assert err.value.path == "resources.gpus_per_worker"
    waits = check_cluster(spec, head, can_add=limits)
    need = spec.trial_resources()
    # a one-worker trial asks Ray for its worker's CPUs only (no Ray Train driver): it fits the head's 8 CPUs
    assert need == {"CPU": 8, "GPU": 1} and waits == [
        "a trial needs 1 workers x 1 GPU = 1 GPUs; the cluster has 0 now and its autoscaler can add 16: trials wait "
        "for the worker nodes it starts"]
    two = load_study(ROOT / "studies" / "fusion_ablation.yaml", ["storage=/tmp/unused", "resources.workers_per_trial=2"],
                     check_files=False)  # a Ray Train job: its Tune driver function holds driver_cpus beside them
    assert two.trial_resources() == {"CPU": 16.01, "GPU": 2}
    assert check_cluster(two, {"CPU": 16.01, "GPU": 2.0}) == []
    with pytest.raises(ConfigError, match=r"2 workers x 8 CPU \+ 0.01 \(driver\) = 16.01 CPUs but the cluster has 16$"):
        check_cluster(two, {"CPU": 16.0, "GPU": 2.0})
    huge = load_study(ROOT / "studies" / "fusion_ablation.yaml", ["storage=/tmp/unused", "resources.workers_per_trial=25"],
                      check_files=False)
    with pytest.raises(ConfigError) as err:
        check_cluster(huge, head, can_add=limits)
    assert err.value.path == "resources.cpus_per_worker" and str(err.value).endswith(
        "a trial needs 25 workers x 8 CPU + 0.01 (driver) = 200.01 CPUs but the cluster has 8 (and its autoscaler can "
        "add 192)")
    # Ray's local provider (ray-cluster.local.yaml with a worker's address) declares no resources: Ray detects a
    # node's when it joins, so nothing the workers could bring is refused
    local = yaml.safe_load((ROOT / "ray-cluster.local.yaml").read_text())
    local["provider"]["worker_ips"] = ["192.0.2.7"]
    prepared, _ = prepare_local(local)
    (tmp_path / "bootstrap.yaml").write_text(yaml.safe_dump(prepared))
    assert autoscaler_limits(str(tmp_path / "bootstrap.yaml")) == {"CPU": math.inf, "GPU": math.inf}
    assert check_cluster(huge, {"CPU": 0.0}, can_add={"CPU": math.inf, "GPU": math.inf})[1].endswith(
        "its autoscaler can add nodes whose resources Ray detects when they join: trials wait for the worker nodes "
        "it starts")
    assert autoscaler_limits(str(tmp_path / "none.yaml")) is None  # a laptop, a local Ray: no autoscaler here


def test_storage_and_tracking_resolve(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_study(SMOKE, ["storage=s3://my-bucket/a2/", "storage_endpoint_url=http://127.0.0.1:9000",
                              "tracking.mlflow_uri=null", "tracking.experiment=exp-1"])
    assert spec.storage == "s3://my-bucket/a2"
    assert spec.storage_endpoint_url == "http://127.0.0.1:9000"
    assert spec.tracking.mlflow_uri == (os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{tmp_path}/mlflow.db")
    assert spec.tracking.experiment == "exp-1"
    assert load_study(SMOKE, ["storage=runs/x"]).storage == str(tmp_path / "runs" / "x")


# -- bad specs ---------------------------------------------------------------------------------------------------
BAD = [
    # (id, overrides, key path in the error, words in the message)
    ("unknown top-level key", ["serch.metric=val/CIDEr"], "serch", "unknown key"),
    ("unknown key in a space entry", ["search.space.seed.grdi=[0]"], "search.space.seed.grdi", "unknown key"),
    ("unknown config key", ["model.dmodel=64"], "model.dmodel", "unknown key"),
    ("a conditional choice's value", ["model={d_model: 64, layers: 1, d_ff: 64}",
                                      "search.space={fusion: {choice: [none, gate]}, model.heads: {choice: [4, 3, 8], "
                                      "when: {fusion: gate}}}"],
     "search.space.model.heads.choice", "3 gives an invalid model.heads"),
    ("a layer some trials lack", ["search.metric=diag/jsd/layer2", "model={d_model: 32, heads: 2, d_ff: 64}",
                                  "search.space={fusion: {grid: [none]}, model.layers: {grid: [3, 2]}}"],
     "search.metric", "the model has 2 layers in some trials (model.layers is searched)"),
    ("fp16 searched with fused seeds", ["resources.fuse_replicates=true",
                                        "search.space={fusion: {grid: [none]}, train.precision: {grid: [fp32, fp16]}}"],
     "resources.fuse_replicates", "fp16's loss scaler"),
    ("a number listed twice in a grid", ["search.space={fusion: {grid: [none]}, model.heads: {grid: [4, 4.0]}}"],
     "search.space.model.heads.grid[1]", "4.0 is listed twice"),
    ("unknown resources key", ["resources.gpus=1"], "resources.gpus", "unknown key"),
    ("wrong type", ["train.batch_size=big"], "train.batch_size", "integer"),
    ("a boolean for an integer", ["train.batch_size=true"], "train.batch_size", "must be an integer, got True"),
    ("a boolean for a number", ["resources.cpus_per_worker=true"], "resources.cpus_per_worker", "must be a number"),
    ("lambda <= 0 in a range", ["search.space.lambda={uniform: [0, 0.1], when: {fusion: gate}}"],
     "search.space.lambda.uniform", "must be > 0"),
    ("loguniform low <= 0", ["search.space.lambda.loguniform=[-0.1, 0.2]"], "search.space.lambda.loguniform",
     "low > 0"),
    ("low >= high", ["search.space.lambda.loguniform=[0.2, 0.01]"], "search.space.lambda.loguniform", "low must be < high"),
    ("eta < 0", ["model.eta=-0.1"], "model.eta", ">= 0"),
    ("eta < 0 in a grid", ["search.space.fusion.grid=[none, gate, moving_average]",
                           "search.space.eta={grid: [0.1, -0.5], when: {fusion: moving_average}}"],
     "search.space.eta.grid", ">= 0"),
    ("unknown fusion in the grid", ["search.space.fusion.grid=[none, gate, mean]"], "search.space.fusion.grid",
     "unknown fusion 'mean'"),
    ("temperature without exp_decay", ["model.temperature=5000"], "model.temperature", "only used by fusion"),
    ("temperature key without when", ["search.space.temperature={loguniform: [1000, 50000]}"],
     "search.space.temperature", "when"),
    ("exp_decay without temperature", ["search.space.fusion.grid=[gate, exp_decay]"], "model.temperature",
     "required when fusion is 'exp_decay'"),
    ("empty grid", ["search.space.seed.grid=[]"], "search.space.seed.grid", "non-empty"),
    ("unknown space key", ["search.space.lamda={loguniform: [0.01, 0.1]}"], "search.space.lamda", "unknown search key"),
    ("when names a key outside the space", ["search.space.temperature={loguniform: [1, 2], when: {eta: 0.1}}"],
     "search.space.temperature.when.eta", "not a key of the search space"),
    ("when value not in the grid", ["search.space.lambda.when={fusion: max}"], "search.space.lambda.when.fusion",
     "not one of"),
    ("bad name", ["name=A2 Sweep"], "name", "lowercase"),
    ("name too long", ["name=" + "a" * 65], "name", "64"),
    ("unknown mode", ["search.mode=maximize"], "search.mode", "'max' or 'min'"),
    ("unknown metric", ["search.metric=val/CIDEr-D"], "search.metric", "not reported"),
    ("unknown algorithm", ["search.algorithm=bayes"], "search.algorithm", "optuna"),
    ("unknown scheduler", ["search.scheduler={hyperband: {}}"], "search.scheduler.hyperband", "unknown key"),
    ("grace period beyond the epochs", ["search.scheduler.asha.grace_period=99"], "search.scheduler.asha.grace_period",
     "planned epochs"),
    ("point outside the range", ["search.points_to_evaluate=[{lambda: 0.5}]"], "search.points_to_evaluate[0].lambda",
     "outside"),
    ("more points than samples", ["search.points_to_evaluate=[{lambda: 0.01}, {lambda: 0.02}, {lambda: 0.03}]"],
     "search.points_to_evaluate", "num_samples"),
    ("key in the space and the base", ["model.lambda=0.05"], "model.lambda", "search.space.lambda"),
    ("epochs in the space", ["search.space={xe_epochs: {grid: [1]}}"], "search.space.xe_epochs", "unknown search key"),
    ("no workers", ["resources.workers_per_trial=0"], "resources.workers_per_trial", ">= 1"),
    ("negative gpus", ["resources.gpus_per_worker=-1"], "resources.gpus_per_worker", ">= 0"),
    ("fractional gpus > 1", ["resources.gpus_per_worker=1.5"], "resources.gpus_per_worker", "whole number"),
    ("no concurrency", ["resources.max_concurrent_trials=0"], "resources.max_concurrent_trials", ">= 1"),
    ("zero cpus", ["resources.cpus_per_worker=0"], "resources.cpus_per_worker", "> 0"),
    ("storage scheme", ["storage=gs://bucket/a2"], "storage", "s3://"),
    ("endpoint without s3", ["storage_endpoint_url=http://127.0.0.1:9000"], "storage_endpoint_url", "s3://"),
    ("tracking scheme", ["tracking.mlflow_uri=ftp://host/x"], "tracking.mlflow_uri", "unknown scheme"),
    ("coco data missing", ["data={kind: coco, captions: /nonexistent/c.json, features: /nonexistent/f.h5}"],
     "data.captions", "no such file"),
    ("zero samples", ["search.num_samples=0"], "search.num_samples", ">= 1"),
    ("best epoch by another metric than the study's", ["search.metric=val/BLEU-4", "train.select_metric=val/CIDEr"],
     "train.select_metric", "search.metric is 'val/BLEU-4': a trial's best epoch is the one the study ranks it by"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_specs_name_the_key_and_the_file(case, tmp_path):
    _, overrides, key, words = case
    study = write(tmp_path, smoke_raw(), "bad-study.yaml")
    with pytest.raises(ConfigError) as err:
        load_study(study, overrides)
    assert err.value.path == key, str(err.value)
    assert err.value.source == str(study)
    message = str(err.value)
    assert "bad-study.yaml" in message and key in message and words in message, message


def test_missing_coco_features_name_the_key(tmp_path, coco_files):
    study = write(tmp_path, yaml.safe_load((ROOT / "studies" / "lambda_sweep.yaml").read_text()), "sweep.yaml")
    overrides = coco_files[:1] + ["data.features=/nonexistent/feats.h5"] + coco_files[2:]
    with pytest.raises(ConfigError) as err:
        load_study(study, overrides)
    assert err.value.path == "data.features" and "sweep.yaml" in str(err.value)


def test_conditional_sampled_key_cannot_be_active_for_other_fusions(tmp_path):
    raw = smoke_raw()
    raw["search"]["space"] = {"fusion": {"grid": ["gate", "exp_decay"]},
                              "temperature": {"loguniform": [1000, 50000], "when": {"fusion": ["exp_decay", "gate"]}}}
    with pytest.raises(ConfigError) as err:
        load_study(write(tmp_path, raw))
    assert err.value.path == "search.space.temperature.loguniform"
    assert "fusion=gate" in str(err.value) and "only used by fusion 'exp_decay'" in str(err.value)


def test_not_a_mapping_and_missing_file(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as err:
        load_study(path)
    assert "list.yaml" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_study(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(err.value) and "not found" in str(err.value)
    raw = smoke_raw()
    raw["search"]["space"] = [1, 2]
    with pytest.raises(ConfigError) as err:
        load_study(write(tmp_path, raw))
    assert err.value.path == "search.space" and "mapping" in str(err.value)


def test_validate_main_prints_one_line(capsys, tmp_path):
    assert validate_main(SMOKE) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("OK a2-smoke: 8 trials = 2 configurations x 4 seeds in 2 grid cells") and "\n" not in out
    bad = write(tmp_path, {**smoke_raw(), "name": "Bad Name"}, "bad.yaml")
    assert validate_main(bad) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "name:" in err


# -- no Ray before validation ------------------------------------------------------------------------------------
def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_validation_never_imports_ray(tmp_path):
    bad = write(tmp_path, {**smoke_raw(), "storage": "gs://nope"}, "bad.yaml")
    code = ("import sys; from launch.commands.validate import validate_main; "
            "rc = validate_main(sys.argv[1]); print('ray' in sys.modules, 'optuna' in sys.modules); sys.exit(rc)")
    good = _run(code, str(SMOKE))
    assert good.returncode == 0, good.stderr
    assert good.stdout.splitlines()[-1].split()[:2] == ["False", "False"]
    res = _run(code, str(bad))
    assert res.returncode == 2
    assert "bad.yaml" in res.stderr and "storage" in res.stderr
    assert res.stdout.split() == ["False", "False"]


def test_cli_study_validate_fails_fast_without_ray(tmp_path):
    bad = write(tmp_path, {**smoke_raw(), "search": {**smoke_raw()["search"], "mode": "maximize"}}, "bad.yaml")
    code = ("import sys; sys.argv = ['a2', 'study', 'validate', sys.argv[1]]; "
            "from launch.cli import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('RAY', 'ray' in sys.modules, 'MLFLOW', 'mlflow' in sys.modules, 'HEAVY', "
            "[m for m in ('torch', 'scipy', 'matplotlib', 'pyarrow', 'boto3') if m in sys.modules]); sys.exit(rc)")
    res = _run(code, str(bad))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "bad.yaml" in res.stderr and "search.mode" in res.stderr
    assert "RAY False MLFLOW False" in res.stdout
    ok = _run(code, str(SMOKE))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "RAY False MLFLOW False HEAVY []" in ok.stdout  # launch/cli.py's docstring promises it


def test_a_study_file_is_a_training_config():
    """`a2 train --config studies/smoke.yaml key=value`: the study's data / model / train sections, overridden."""
    from launch.commands.local import training_config

    raw = smoke_raw()
    cfg = training_config(str(SMOKE), ["train.xe_epochs=3", "model.fusion=max"])
    assert cfg.train.xe_epochs == 3 and cfg.model.fusion == "max"
    assert cfg.data.images == raw["data"]["images"] and cfg.model.d_model == raw["model"]["d_model"]
    assert cfg.train.batch_size == raw["train"]["batch_size"]
    with pytest.raises(ConfigError) as err:  # still checked like any config, naming the file
        training_config(str(SMOKE), ["model.d_modl=3"])
    assert "model.d_modl" in str(err.value) and "smoke.yaml" in str(err.value)
    # its relative data paths mean what they mean to the study: against the study's root, whatever the directory
    study = load_study(SMOKE, ["data.root=data/tiny"], check_files=False)
    assert cfg.data.root == load_study(SMOKE, check_files=False).base["data"]["root"]
    assert training_config(str(SMOKE), ["data.root=data/tiny"]).data.root == study.base["data"]["root"]
    assert study.base["data"]["root"] == str(ROOT / "data" / "tiny")
    assert training_config(None, ["data.root=data/tiny"]).data.root == "data/tiny"  # no file: the working directory's


def test_local_storage_under_a_file_or_out_of_reach_is_refused_in_one_line(tmp_path):
    """A storage root below a regular file, or in a folder this user cannot enter, fails validation (so `run` before
    Ray starts) naming the key and what is wrong, not as a traceback of the study's first write."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"storage: .*/afile/sub: .*/afile is a file, not a directory$"):
        load_study(SMOKE, [f"storage={tmp_path / 'afile' / 'sub'}"])
    with pytest.raises(ConfigError, match=r"storage: .*/afile exists and is not a directory$"):
        load_study(SMOKE, [f"storage={tmp_path / 'afile'}"])
    try:  # init's root folder: closed to this sandbox's root as to anyone but init's owner on a plain machine
        reachable = (Path("/proc/1/root") / "x").exists() or True
    except PermissionError:
        reachable = False
    if not reachable:
        with pytest.raises(ConfigError, match=r"storage: /proc/1/root/x: cannot be reached \(Permission denied\)$"):
            load_study(SMOKE, ["storage=/proc/1/root/x"])


@pytest.mark.parametrize("override, reason", [
    ("storage=", "storage: must not be empty"),
    ("search.metric=", "search.metric: must not be empty"),
    ("tracking.experiment=", "tracking.experiment: must not be empty"),
    ("train.xe_epochs=abc", "train.xe_epochs: must be an integer, got 'abc'"),
    ("train.test_meteor=maybe", "train.test_meteor: must be true or false, got 'maybe'"),
])
def test_refusals_speak_the_house_style_not_pydantics(override, reason):
    """Every refusal names the key and says what it must be in the project's words (never pydantic's "String should
    have at least 1 character")."""
    from a2core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_study(SMOKE, [override], check_files=False)
    assert str(info.value).endswith(reason), str(info.value)
    assert "should" not in str(info.value)


def test_fused_replicates_run_one_tune_trial_per_configuration(tmp_path):
    """`resources.fuse_replicates`: Tune runs one trial per configuration (its seeds trained together), the record
    still one trial per seed; a study that sets it hears no warning about it."""
    fused = load_study(SMOKE, ["resources.fuse_replicates=true", f"storage={tmp_path}"])
    plain = load_study(SMOKE, [f"storage={tmp_path}"])
    assert (fused.num_trials, fused.tune_samples) == (8, 2)  # 2 configurations x 4 seeds
    assert (plain.num_trials, plain.tune_samples) == (8, 8)
    assert not any("fuse_replicates" in w for w in fused.warnings + plain.warnings)
    # a round of seeds is one more trial a configuration: confirmation seeds, the chosen configuration of each fusion
    confirmed = load_study(SMOKE, ["resources.fuse_replicates=true", f"storage={tmp_path}", "search.replicates=2",
                                   "search.confirm=3", "search.scheduler={fifo: {}}", "search.num_samples=3"])
    assert confirmed.seed_rounds_trials == [(4, 2), (2, 3)]  # none's and gate's 3 configurations, then 2 chosen
    assert (confirmed.num_trials, confirmed.tune_samples) == (4 * 2 + 2 * 3, 4 + 2)
    # adaptive replicates: every configuration in every round at most (its last round of one seed trains alone)
    adaptive = load_study(SMOKE, ["resources.fuse_replicates=true", f"storage={tmp_path}",
                                  "search.replicates={min: 2, max: 5, rounds: [2, 4, 5]}"])
    assert adaptive.seed_rounds_trials == [(2, 2), (2, 2), (2, 1)]
    assert (adaptive.num_trials, adaptive.tune_samples) == (10, 6)


@pytest.mark.parametrize("overrides, says", [
    (["search.replicates=1", "search.scheduler={fifo: {}}", "search.purpose=explore"],
     "set search.replicates to 2 or more"),
    (["resources.workers_per_trial=5"], "a fused trial trains on one worker"),
    (["train.precision=fp16"], "use fp32 or bf16"),
])
def test_fused_replicates_are_refused_where_seeds_cannot_train_together(tmp_path, overrides, says):
    """A fused trial needs two or more seeds in its first round and one worker: anything else is refused in one
    line naming `resources.fuse_replicates` and the file, before anything runs."""
    with pytest.raises(ConfigError) as err:
        load_study(SMOKE, ["resources.fuse_replicates=true", f"storage={tmp_path}", *overrides])
    assert err.value.path == "resources.fuse_replicates"
    assert says in str(err.value) and str(SMOKE) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, says", [
    (["resources.gpus_per_worker=1"], "captures the fused step of resources.fuse_replicates"),
    (["resources.fuse_replicates=true"], "which need a GPU: set resources.gpus_per_worker"),
])
def test_a_captured_step_is_refused_without_fused_seeds_or_a_gpu(tmp_path, overrides, says):
    """`resources.capture_step` compiles the fused step into CUDA graphs: without fused seeds there is no such step,
    without a GPU no CUDA graph; either is refused in one line naming the key and the file. With both it is kept."""
    with pytest.raises(ConfigError) as err:
        load_study(SMOKE, ["resources.capture_step=true", f"storage={tmp_path}", *overrides])
    assert err.value.path == "resources.capture_step"
    assert says in str(err.value) and str(SMOKE) in str(err.value) and "\n" not in str(err.value)
    kept = load_study(SMOKE, ["resources.capture_step=true", "resources.fuse_replicates=true",
                              "resources.gpus_per_worker=0.5", f"storage={tmp_path}"], check_files=False)
    assert kept.resources.capture_step and kept.resources.model_dump()["capture_step"] is True


def test_a_jsd_metric_names_a_layer_of_every_trial_when_the_layers_are_searched():
    """The layers of the space's trials, not the schema default that the base holds for a searched key (6)."""
    spec = load_study(SMOKE, ["search.metric=diag/jsd/layer7", "model={d_model: 32, heads: 2, d_ff: 64}",
                              "search.space={fusion: {grid: [none]}, model.layers: {grid: [8, 9]}}"], check_files=False)
    assert spec.metric == "diag/jsd/layer7"


def test_a_postgres_uri_is_saved_as_the_postgresql_one_mlflow_takes():
    """`postgres://` (Heroku's short alias) is refused by SQLAlchemy, so by MLflow, with its own error."""
    spec = load_study(SMOKE, ["tracking.mlflow_uri=postgres://alice@db.lab:5432/mlflow"], check_files=False)
    assert spec.tracking.mlflow_uri == "postgresql://alice@db.lab:5432/mlflow"


def test_a_trials_best_epoch_is_picked_by_the_study_metric(tmp_path):
    """search.metric and mode set a2core's train.select_metric and select_mode in every trial's config (its best.pt
    and test scores are of the epoch the record names best); a metric no epoch report carries leaves val CIDEr."""
    study = write(tmp_path, smoke_raw())
    spec = load_study(study, ["search.metric=val/BLEU-4", "search.mode=min"])
    config = spec.trial_config({"fusion": "gate", "lambda": 0.03, "seed": 0})
    assert (config["train"]["select_metric"], config["train"]["select_mode"]) == ("val/BLEU-4", "min")
    config = load_study(study, ["search.metric=best/val/CIDEr"]).trial_config({"fusion": "gate", "lambda": 0.03})
    assert (config["train"]["select_metric"], config["train"]["select_mode"]) == ("val/CIDEr", "max")


@pytest.mark.parametrize("overrides, key, message", [
    (["search.replicates=[0, 4294967296]"], "search.replicates",
     "seed 4294967296 is beyond train.seed's range 0 .. 4294967295"),
    (["search.replicates=[4294967294, 4294967295]", "search.confirm=3"], "search.confirm",
     "seed 4294967298 is beyond train.seed's range"),
    (["search.confirm=3", "search.space={lambda: {loguniform: [0.01, 0.1]}}"], "search.confirm",
     "does not search model.fusion over two or more values"),
    (["search.algorithm=grid", "search.num_samples=5"], "search.num_samples",
     "algorithm 'grid' runs search.points_to_evaluate, not samples"),
])
def test_seeds_and_samples_that_no_trial_would_use_are_refused_at_validation(overrides, key, message):
    """What validation passed and no trial could use: a replicate or confirmation seed beyond numpy's range (each
    trial then failed), confirmation seeds in a study whose verdicts are not by fusion (the extra trials never
    settle a verdict), and num_samples with algorithm grid (it ran 1 where 5 were asked, silently)."""
    with pytest.raises(ConfigError) as err:
        load_study(ROOT / "studies" / "smoke.yaml", overrides, check_files=False)
    assert err.value.path == key and message in str(err.value)
