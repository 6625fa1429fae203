"""`a2 study plan` bills worker nodes whole (node-hours), not GPU-hours at a GPU's share of a node: the nodes each
wave of trials runs on, each kept `idle_timeout_minutes` (Ray's default 5) after its last trial; a CPU-only study is
billed too (its worker nodes and the head) when its throughput is given; one --price-per-hour for several worker
types is refused. No Ray."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from a2core.errors import StudyError
from launch import plan
from launch.cli import main as a2
from launch.spec import load_study

pytestmark = pytest.mark.outside_ray_group

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "studies" / "smoke.yaml"
# a smoke trial: 8 XE epochs of 1,000 train images at 1.0 and 500 greedy val images at 2.0, then 500 beam-5 test
# images at 2.92: 17,460 XE images
SMOKE_TRIAL_IMAGES = 8 * (1_000 * 1.0 + 500 * 2.0) + 500 * 2.0 * 1.46


def _node(instance, cpus, gpus, **extra):
    return {"resources": {"CPU": cpus, "GPU": gpus}, "node_config": {"InstanceType": instance}, **extra}


def _cluster(tmp_path, types, **top):
    raw = {"max_workers": 8, **top, "available_node_types": {"head.cpu": _node("m5.2xlarge", 8, 0), **types},
           "head_node_type": "head.cpu"}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _line(out, start):
    return next(line for line in out.splitlines() if line.startswith(start))


def test_two_one_gpu_trials_on_a_four_gpu_node_bill_the_whole_node(tmp_path):
    """The smoke study at 1 GPU a trial, 2 at a time, 4 waves, on one g5.12xlarge (4 GPUs) at 100 images/s: a trial
    is 17,460 / 100 = 174.6 s, 0.0485 h; GPU-hours 8 x 0.0485 = 0.388, worth 0.388 x $5.672 / 4 = $0.55. The node
    runs all 4 waves, 0.194 h, and 5 idle minutes (Ray's default: the file sets no idle_timeout_minutes) after the
    last: 0.194 + 0.0833 = 0.2773 node-hours x $5.672 = $1.57 billed (the plan had priced $0.55). The head:
    0.194 h x $0.384 = $0.0745; in all $1.65."""
    path = _cluster(tmp_path, {"worker.gpu": _node("g5.12xlarge", 48, 4, max_workers=1)})
    assert plan.read_cluster(path).idle_minutes == 5.0
    spec = load_study(SMOKE, ["resources.gpus_per_worker=1"], check_files=False)
    trial_h = SMOKE_TRIAL_IMAGES / 100 / 3600
    assert trial_h * 3600 == pytest.approx(174.6)
    est = plan.estimate(spec, 100.0, plan.trial_nodes(spec, plan.read_cluster(path)))
    assert [n for n, _ in est.waves] == [2] * 4 and [h for _, h in est.waves] == pytest.approx([trial_h] * 4)
    billed = (4 * trial_h + 5 / 60) * 5.672
    assert f"{billed:.2f}" == "1.57" and f"{8 * trial_h * 5.672 / 4:.2f}" == "0.55"
    out = plan.study_plan(spec, images_per_second=100.0, cluster=path, sd=1.0, deltas=[2.0], storage=str(tmp_path))
    assert _line(out, "  cost").startswith("  cost      $0.55: g5.12xlarge at $5.672/h"), out  # the compute's worth
    assert _line(out, "  billed").startswith("  billed    $1.57: 0.28 node-hours of g5.12xlarge (worker.gpu) at "
                                             "$5.672/h, up to 1 at once (on-demand list price"), out
    assert "each kept 5 min idle after its last (idle_timeout_minutes)" in out
    assert _line(out, "  in all") == f"  in all    ${billed + 4 * trial_h * 0.384:.2f}, head and worker nodes billed"
    assert f"{billed + 4 * trial_h * 0.384:.2f}" == "1.65"


def test_the_idle_timeout_is_read_from_the_cluster_file(tmp_path):
    """idle_timeout_minutes: 30 keeps the smoke study's node half an hour after its last wave: 0.194 + 0.5 = 0.694
    node-hours x $5.672 = $3.94."""
    path = _cluster(tmp_path, {"worker.gpu": _node("g5.12xlarge", 48, 4, max_workers=1)}, idle_timeout_minutes=30)
    assert plan.read_cluster(path).idle_minutes == 30.0
    assert plan.read_cluster(ROOT / "ray-cluster.yaml").idle_minutes == 10.0
    spec = load_study(SMOKE, ["resources.gpus_per_worker=1"], check_files=False)
    out = plan.study_plan(spec, images_per_second=100.0, cluster=path, sd=1.0, deltas=[2.0], storage=str(tmp_path))
    assert f"{(4 * SMOKE_TRIAL_IMAGES / 100 / 3600 + 0.5) * 5.672:.2f}" == "3.94"
    assert _line(out, "  billed").startswith("  billed    $3.94: 0.69 node-hours of g5.12xlarge"), out


def test_waves_of_fewer_trials_release_nodes_after_the_idle_timeout():
    """g5.12xlarge nodes of 4 one-GPU workers, idle 5 min (1/12 h). Waves of 16 then 9 trials, 2 h each: 4 then 3
    nodes, 14 node-hours busy, and each of the 4 nodes idles 1/12 h once: 14.33. Waves of 16, 4, 16 trials of 1 h:
    nodes 1-3 sit out the middle wave, longer than the timeout, so each is billed 1/12 h then, and again at the end:
    3 + 3 x (2 + 2/12) + 1/12 = 9.583. Of 0.05 h: the gap is shorter than the timeout, the nodes stay and are
    billed it: 4 x 0.15 + 4 / 12 = 0.933."""
    node = plan.Workers("g5.12xlarge", 4, False, 4, cpus=48)
    r = load_study(ROOT / "studies" / "lambda_sweep.yaml", check_files=False).resources
    assert plan.billed_nodes(r, [node], [(16, 2.0), (9, 2.0)]) == [(node, pytest.approx(14 + 4 / 12), 4)]
    assert plan.billed_nodes(r, [node], [(16, 1.0), (4, 1.0), (16, 1.0)])[0][1] == pytest.approx(9.5833, abs=1e-4)
    assert plan.billed_nodes(r, [node], [(16, 0.05), (4, 0.05), (16, 0.05)])[0][1] == pytest.approx(0.9333, abs=1e-4)


def test_a_cpu_only_study_bills_its_worker_nodes_and_the_head(tmp_path):
    """The smoke study on CPUs (gpus_per_worker 0) at 8 CPUs a worker, 10 images/s a worker given: a trial 17,460 /
    10 = 1,746 s; 8 trials 2 at a time, 4 waves, 1.94 h wall; 3.88 worker-hours. Each wave: 1 worker on the head's 8
    CPUs, 1 on an m5.2xlarge worker node: that node 1.94 h + 5 idle min = 2.0233 node-hours x $0.384 = $0.78; the
    head 1.94 x $0.384 = $0.74496; in all $1.52 (the plan had priced nothing). Hours print whole from 1 on."""
    path = _cluster(tmp_path, {"worker.cpu": _node("m5.2xlarge", 8, 0, max_workers=2)})
    spec = load_study(SMOKE, ["resources.cpus_per_worker=8"], check_files=False)
    assert spec.resources.gpus_per_worker == 0
    out = plan.study_plan(spec, images_per_second=10.0, cluster=path, sd=1.0, deltas=[2.0], storage=str(tmp_path))
    assert SMOKE_TRIAL_IMAGES / 10 == pytest.approx(1_746)
    assert "  worker-hours 4 for 8 trials (CPU trial workers); about 2 h wall on 2 trial workers at once" in out
    assert _line(out, "  billed").startswith("  billed    $0.78: 2 node-hours of m5.2xlarge (worker.cpu) at "
                                             "$0.384/h, up to 1 at once"), out
    assert _line(out, "  head") == ("  head      $0.74: m5.2xlarge (head.cpu) at $0.384/h (on-demand list price, "
                                    "us-west-2, 2025, assumed) for the whole ~2 h wall time, running 1 trial "
                                    "workers on its CPUs")
    assert _line(out, "  in all") == f"  in all    ${(1.94 + 1 / 12) * 0.384 + 1.94 * 0.384:.2f}, head and worker " \
                                      f"nodes billed"
    assert f"{(1.94 + 1 / 12) * 0.384 + 1.94 * 0.384:.2f}" == "1.52"
    # without a CPU throughput there is none to price from (the plan's figures are a GPU's)
    out = plan.study_plan(spec, cluster=path, sd=1.0, deltas=[2.0], storage=str(tmp_path))
    assert "give --images-per-second (a trial worker's training images/s)" in _line(out, "cost")


def test_one_price_for_several_worker_types_is_refused(tmp_path, capsys):
    """lambda_sweep's workers on g5.2xlarge x 4 and g5.12xlarge x 2 (tests/test_plan_audit77.py): --price-per-hour 3
    would price both instance types alike; it is refused in one line naming them. On one type it is that type's:
    fusion_ablation on ray-cluster.yaml, 206.0 node-hours (4 waves of 13.69 h on 4, 4, 4, 3 nodes and 4 x 10 idle
    minutes) x $3 = $618."""
    types = {"small.gpu": _node("g5.2xlarge", 8, 1, max_workers=4), "big.gpu": _node("g5.12xlarge", 48, 4,
                                                                                     max_workers=2)}
    path = _cluster(tmp_path, types)
    spec = load_study(ROOT / "studies" / "lambda_sweep.yaml", check_files=False)
    with pytest.raises(StudyError) as caught:
        plan.study_plan(spec, images_per_second=100.0, price_per_hour=3.0, cluster=path, sd=1.0, deltas=[2.0])
    assert str(caught.value).startswith("--price-per-hour: one price for 2 worker types, and the trials run on "
                                        "small.gpu (g5.2xlarge) and big.gpu (g5.12xlarge)")
    assert "\n" not in str(caught.value)
    assert a2(["study", "plan", str(ROOT / "studies" / "lambda_sweep.yaml"), "--cluster", str(path),
               "--price-per-hour", "3", "--sd", "1", "--delta", "2"]) != 0
    assert "small.gpu (g5.2xlarge) and big.gpu (g5.12xlarge)" in capsys.readouterr().err
    fusion = load_study(ROOT / "studies" / "fusion_ablation.yaml", check_files=False)
    est = plan.estimate(fusion, 100.0, plan.cluster_workers())
    out = plan.study_plan(fusion, images_per_second=100.0, price_per_hour=3.0, sd=1.0, deltas=[2.0])
    node_hours = 15 * est.wall_hours / 4 + 4 * 10 / 60
    assert f"{node_hours * 3:,.0f}" == "618"
    assert _line(out, "  billed").startswith("  billed    $618: 206 node-hours of g5.12xlarge (worker.gpu.spot) at "
                                             "$3.000/h, up to 4 at once (given)"), out
