"""`a2 study plan`'s audit: a small study's GPU-hours and wall time printed to two digits where they round to 0, its
dollars in cents below $10 (not as $0), and the GPU worker type of a cluster file read as Ray's autoscaler reads it
(a type without `max_workers` may launch up to the cluster's `max_workers`, which caps every type; the head is one
node; a type of `max_workers: 0` never launches). No Ray."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launch import plan
from launch.cli import main as a2
from launch.spec import load_study

pytestmark = pytest.mark.outside_ray_group

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "studies" / "smoke.yaml"


def test_a_small_study_prints_its_gpu_hours_wall_time_and_cost_not_as_zero(tmp_path, capsys):
    """The smoke study on one GPU a trial: 8 trials of 8 XE epochs, each epoch 1,000 train images at 1.0 and 500
    greedy val images at 2.0, then 500 beam-5 test images at 2.92, at 100 images/s: 174.6 s a trial, 0.39
    GPU-hours; 2 at a time, 4 waves: 0.19 h wall; at g5.12xlarge's $5.672 / 4 GPUs: $0.55, spot $0.19."""
    spec = load_study(SMOKE, ["resources.gpus_per_worker=1"], check_files=False)
    per_trial = (8 * (1_000 * 1.0 + 500 * 2.0) + 500 * 2.0 * 1.46) / 100
    est = plan.estimate(spec, 100.0, plan.Workers("g5.12xlarge", 4, True, 4))
    assert est.gpu_hours == pytest.approx(8 * per_trial / 3600)
    assert est.wall_hours == pytest.approx(4 * per_trial / 3600)
    assert a2(["study", "plan", str(SMOKE), "resources.gpus_per_worker=1", f"storage={tmp_path}", "--sd", "1",
               "--images-per-second", "100"]) == 0
    out = capsys.readouterr().out
    assert "GPU-hours 0.39 for 8 trials; about 0.19 h wall on 2 GPUs at once" in out, out
    assert "  cost      $0.55: g5.12xlarge at $5.672/h" in out, out
    assert "spot at ~35% of on-demand (assumed): $0.19" in out, out
    assert "GPU-hours 0 " not in out and "$0\n" not in out
    # below 1, two significant digits (12 epochs are 0.57 GPU-hours, printed 1 before); from 1 on, whole
    assert a2(["study", "plan", str(SMOKE), "resources.gpus_per_worker=1", "train.xe_epochs=12",
               f"storage={tmp_path}", "--images-per-second", "100"]) == 0
    hours = 8 * (12 * 2_000 + 1_460) / 100 / 3600
    assert f"GPU-hours {hours:.2f} for 8 trials" in capsys.readouterr().out and f"{hours:.2f}" == "0.57"
    assert a2(["study", "plan", str(SMOKE), "resources.gpus_per_worker=1", "train.xe_epochs=30",
               f"storage={tmp_path}", "--images-per-second", "100"]) == 0
    hours = 8 * (30 * 2_000 + 1_460) / 100 / 3600
    assert f"GPU-hours {hours:,.0f} for 8 trials" in capsys.readouterr().out and f"{hours:,.0f}" == "1"


def _cluster(tmp_path, types, limit=None, head="head.cpu"):
    raw = {"available_node_types": {"head.cpu": {"resources": {"CPU": 8, "GPU": 0},
                                                 "node_config": {"InstanceType": "m5.2xlarge"}}, **types},
           "head_node_type": head}
    if limit is not None:
        raw["max_workers"] = limit
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _gpu(instance, gpus, cpus=8, **extra):

    return {"resources": {"CPU": cpus, "GPU": gpus}, "node_config": {"InstanceType": instance}, **extra}


def test_a_gpu_worker_type_without_its_own_max_workers_may_launch_the_clusters(tmp_path):
    """Ray gives a worker type without `max_workers` the cluster's `max_workers`: 8 nodes of g5.2xlarge are 8 GPUs,
    and lambda_sweep's 36 one-GPU trials (16 at a time allowed) run 8 side by side in 5 waves, not one in 36 (the
    plan had read 1 node and priced a wall time 7 times too long)."""
    path = _cluster(tmp_path, {"worker.gpu": _gpu("g5.2xlarge", 1)}, limit=8)
    workers = plan.cluster_workers(path)
    assert workers == plan.Workers("g5.2xlarge", 1, False, 8)
    spec = load_study(ROOT / "studies" / "lambda_sweep.yaml", check_files=False)
    est = plan.estimate(spec, 100.0, workers)
    assert est.gpus_at_once == 8
    assert est.wall_hours == pytest.approx(est.gpu_hours / 36 * 5)  # ceil(36 / 8) waves


def test_the_clusters_max_workers_caps_a_worker_type(tmp_path):
    """A type's `max_workers: 10` under the cluster's `max_workers: 2` launches 2 nodes (Ray's cap), 8 GPUs."""
    path = _cluster(tmp_path, {"worker.gpu": _gpu("g5.12xlarge", 4, 48, max_workers=10)}, limit=2)
    assert plan.cluster_workers(path).max_nodes == 2
    spec = load_study(ROOT / "studies" / "lambda_sweep.yaml", check_files=False)
    assert plan.estimate(spec, 100.0, plan.cluster_workers(path)).gpus_at_once == 8


def test_the_gpu_worker_type_is_chosen_over_a_gpu_head_and_a_type_that_never_launches(tmp_path):
    """A GPU head listed first is one node, not the workers' type; a GPU type of `max_workers: 0` is passed over;
    a cluster whose only GPUs are the head's prices that one node."""
    types = {"head.gpu": _gpu("g5.2xlarge", 1), "off.gpu": _gpu("p4d.24xlarge", 8, 96, max_workers=0),
             "worker.gpu": _gpu("g5.12xlarge", 4, 48, max_workers=3)}
    path = _cluster(tmp_path, types, limit=4, head="head.gpu")
    assert plan.cluster_workers(path) == plan.Workers("g5.12xlarge", 4, False, 3)
    only_head = _cluster(tmp_path, {"head.gpu": _gpu("g5.2xlarge", 1)}, limit=4, head="head.gpu")
    assert plan.cluster_workers(only_head) == plan.Workers("g5.2xlarge", 1, False, 1)


def test_the_shipped_cluster_file_reads_as_before():
    """ray-cluster.yaml: 4 spot g5.12xlarge nodes of 4 GPUs (its worker type sets max_workers 4, the cluster 4)."""
    assert plan.cluster_workers() == plan.Workers("g5.12xlarge", 4, True, 4)
