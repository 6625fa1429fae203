"""ray-cluster.yaml passes Ray's own cluster-config validation (no network, no AWS credentials) and describes
the cluster the paper studies need."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tests.test_spec import coco_files  # noqa: F401 - fixture
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "ray-cluster.yaml"


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(CLUSTER.read_text())


@pytest.fixture(scope="module")
def prepared(raw) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(raw))
    validate_config(config)
    return config


def gpu_types(config: dict) -> dict:
    return {name: t for name, t in config["available_node_types"].items() if t["resources"].get("GPU", 0) > 0}


def test_ray_accepts_the_config(prepared):
    assert prepared["provider"]["type"] == "aws"
    assert prepared["provider"]["region"]
    assert prepared["provider"]["availability_zone"]
    assert prepared["auth"]["ssh_user"] == "ubuntu"
    assert prepared["cluster_name"] == "a2tune"


def test_ray_rejects_a_broken_config(raw):
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    broken = copy.deepcopy(raw)
    broken["available_node_types"]["worker.gpu.spot"]["resources"]["GPU"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def test_head_is_on_demand_and_cpu_only(prepared):
    head = prepared["available_node_types"][prepared["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert head["resources"]["CPU"] >= 2
    assert "InstanceMarketOptions" not in head["node_config"]
    assert head["node_config"]["InstanceType"].startswith("m5.")


def test_gpu_workers_are_multi_gpu_spot(prepared):
    types = gpu_types(prepared)
    assert list(types) == ["worker.gpu.spot"]
    worker = types["worker.gpu.spot"]
    assert worker["node_config"]["InstanceType"] == "g5.12xlarge"
    assert worker["resources"] == {"CPU": 48, "GPU": 4}
    assert worker["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
    assert worker["min_workers"] == 0 and worker["max_workers"] >= 1
    assert prepared["max_workers"] >= worker["max_workers"]


def test_docker_image_matches_local_ray(prepared):
    import ray

    assert prepared["docker"]["image"].startswith(f"rayproject/ray:{ray.__version__}-")
    assert prepared["docker"]["image"].endswith("-gpu")


def test_repository_and_studies_are_mounted_and_installed(prepared):
    mounts = prepared["file_mounts"]
    assert mounts["~/a2tune"] == "."
    assert mounts["~/a2tune/studies"] == "./studies"
    assert (ROOT / mounts["~/a2tune/studies"]).is_dir()
    assert any(sorted((ROOT / "studies").glob("*.yaml")))
    setup = prepared["setup_commands"]
    assert "pip install -e ~/a2tune" in setup
    assert any("ray start --head" in c for c in prepared["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in prepared["worker_start_ray_commands"])


def test_paper_studies_fit_the_cluster(prepared, coco_files):
    """Each GPU study's trials pack the GPUs of this cluster's worker nodes: a whole number of trials per node, and
    no more trials at once than the nodes hold."""
    from launch.spec import load_study

    data = coco_files
    (worker,) = gpu_types(prepared).values()
    for study in ("lambda_sweep", "fusion_ablation", "seeds"):
        spec = load_study(ROOT / "studies" / f"{study}.yaml", data, cluster_resources=worker["resources"])
        per_node = worker["resources"]["GPU"] / spec.trial_resources()["GPU"]
        assert per_node == int(per_node) >= 1
        assert spec.trial_resources()["CPU"] * per_node <= worker["resources"]["CPU"]
        assert spec.resources.max_concurrent_trials <= per_node * worker["max_workers"]
