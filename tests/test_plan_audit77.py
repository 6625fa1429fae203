"""`a2 study plan`'s audit 77: the head node priced for the study's wall time; every worker type a trial fits priced
as Ray places the trials (the head's GPUs first, then the autoscaler's best-scored type, the next at its
max_workers), not only the first GPU type listed; a trial no node, or not the whole cluster, can hold refused
before anything is priced; whole workers a node by its GPUs and CPUs. No Ray."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from a2core.errors import StudyError
from launch import plan
from launch.spec import load_study

pytestmark = pytest.mark.outside_ray_group

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "ray-cluster.yaml"


def _study(name, *overrides):
    return load_study(ROOT / "studies" / f"{name}.yaml", list(overrides), check_files=False)


def _node(instance, cpus, gpus, **extra):
    return {"resources": {"CPU": cpus, "GPU": gpus}, "node_config": {"InstanceType": instance}, **extra}


def _cluster(tmp_path, types, limit=8, head="head.cpu"):
    raw = {"max_workers": limit, "available_node_types": {"head.cpu": _node("m5.2xlarge", 8, 0), **types},
           "head_node_type": head}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _line(out, start):
    return next(line for line in out.splitlines() if line.startswith(start))


def test_the_head_node_is_priced_for_the_whole_wall_time():
    """ray-cluster.yaml's head, an on-demand m5.2xlarge at $0.384/h, runs the study's whole wall time: fusion_ablation's
    ~55 h at 100 images/s add $21 to the worker nodes' $1,169 billed (the plan had left the head out; the workers were
    $1,068 before they were billed by whole nodes, tests/test_plan_billing.py)."""
    spec = _study("fusion_ablation")
    est = plan.estimate(spec, 100.0, plan.cluster_workers(CLUSTER))
    out = plan.study_plan(spec, images_per_second=100.0, cluster=CLUSTER, sd=1.0, deltas=[2.0])
    head = est.wall_hours * 0.384
    workers = est.gpu_hours * 5.672 / 4  # the GPU-hours' worth, the cost line
    # billed: 4 waves of 16, 14, 16, 9 trials on 4, 4, 4, 3 nodes, each wave a trial's 13.69 h; 1 node idle 10 min
    # (ray-cluster.yaml's idle_timeout_minutes) after wave 3, 3 after the last: 206.0 node-hours, $1,169
    billed = (15 * est.wall_hours / 4 + 4 * 10 / 60) * 5.672
    assert f"{billed:,.0f}" == "1,169"
    assert _line(out, "  head") == (f"  head      ${head:,.0f}: m5.2xlarge (head.cpu) at $0.384/h (on-demand list "
                                    f"price, us-west-2, 2025, assumed) for the whole ~{est.wall_hours:,.0f} h wall "
                                    f"time")
    assert f"{head:,.0f}" == "21"
    spot = billed * plan.SPOT_SHARE + head  # spot workers, an on-demand head
    assert _line(out, "  in all") == (f"  in all    ${billed + head:,.0f}, head and worker nodes billed; "
                                      f"${spot:,.0f} with spot at ~35%")
    assert f"${workers:,.0f}: g5.12xlarge" in out  # the workers' line as before


def test_a_head_of_unknown_price_is_said_not_priced(tmp_path):
    path = _cluster(tmp_path, {"worker.gpu": _node("g5.12xlarge", 48, 4, max_workers=4)})
    path.write_text(path.read_text().replace("m5.2xlarge", "c9.huge"))
    out = plan.study_plan(_study("seeds"), images_per_second=100.0, cluster=path, sd=1.0, deltas=[2.0])
    assert _line(out, "  head") == ("  head      no price known for c9.huge (head.cpu): not in the dollars "
                                    "(launch.plan.ON_DEMAND_PRICES)")
    assert "  in all" not in out


def test_a_cpu_type_listed_first_and_a_gpu_type_too_small_for_a_worker_are_passed_over(tmp_path):
    """A CPU worker type listed first, then g5.xlarge (1 GPU, 4 CPUs: lambda_sweep's 8-CPU worker does not fit),
    then g5.12xlarge x 2: the trials run on the 8 GPUs of the g5.12xlarge nodes, priced at its $1.418 a GPU-hour
    (the plan had priced the g5.xlarge, 2 nodes of 1 GPU, the first GPU type listed)."""
    types = {"worker.cpu": _node("m5.2xlarge", 8, 0, max_workers=4), "small.gpu": _node("g5.xlarge", 4, 1,
                                                                                         max_workers=2),
             "big.gpu": _node("g5.12xlarge", 48, 4, max_workers=2)}
    path = _cluster(tmp_path, types)
    spec = _study("lambda_sweep")
    out = plan.study_plan(spec, images_per_second=100.0, cluster=path, sd=1.0, deltas=[2.0])
    hours = plan.estimate(spec, 100.0, None).gpu_hours
    assert "about" in out and " on 8 GPUs at once, 8 trials side by side" in out, out
    assert _line(out, "  cost") == (f"  cost      ${hours * 5.672 / 4:,.0f}: g5.12xlarge at $5.672/h (on-demand list "
                                    f"price, us-west-2, 2025, assumed) / 4 GPUs = $1.418 a GPU-hour: the GPU-hours' "
                                    f"worth; billed by whole nodes below")


def test_two_gpu_worker_types_that_fit_are_priced_as_ray_places_the_trials(tmp_path):
    """lambda_sweep's 16 one-GPU 8-CPU workers at once on g5.2xlarge x 4 (1 GPU, 8 CPUs: one worker a node) listed
    first and g5.12xlarge x 2 (4 workers a node): 12 at once. Ray's autoscaler scores a g5.12xlarge higher for 4
    pending workers (its GPUs filled: 4 x 1^3 = 4, against the g5.2xlarge's 1), so it launches both of those (8
    workers), then the 4 g5.2xlarge; the GPU-hours split 8 : 4."""
    types = {"small.gpu": _node("g5.2xlarge", 8, 1, max_workers=4), "big.gpu": _node("g5.12xlarge", 48, 4,
                                                                                     max_workers=2)}
    path = _cluster(tmp_path, types)
    spec = _study("lambda_sweep")
    nodes = plan.trial_nodes(spec, plan.read_cluster(path))
    assert [n.instance for n in nodes] == ["g5.2xlarge", "g5.12xlarge"]
    assert [(n.instance, count, w) for n, count, w in plan.worker_placement(spec.resources, nodes, 12)] == [
        ("g5.2xlarge", 4, 4), ("g5.12xlarge", 2, 8)]
    est = plan.estimate(spec, 100.0, nodes)
    assert est.gpus_at_once == 12
    out = plan.study_plan(spec, images_per_second=100.0, cluster=path, sd=1.0, deltas=[2.0])
    dollars = est.gpu_hours * (8 / 12 * 5.672 / 4 + 4 / 12 * 1.212 / 1)
    assert _line(out, "  cost").startswith(
        f"  cost      ${dollars:,.0f}: the GPU-hours split by where the 12 trial workers running at once are placed "
        f"(on-demand list price, us-west-2, 2025, assumed): 4 on 4 g5.2xlarge (small.gpu) at $1.212/h / 1 GPUs = "
        f"$1.212 a GPU-hour; 8 on 2 g5.12xlarge (big.gpu) at $5.672/h / 4 GPUs = $1.418 a GPU-hour"), out
    assert "the node type Ray's autoscaler scores best" in out
    # 4 workers at once: one g5.12xlarge holds them all, nothing else is launched
    assert [(n.instance, count, w) for n, count, w in plan.worker_placement(spec.resources, nodes, 4)] == [
        ("g5.12xlarge", 1, 4)]


def test_a_gpu_head_runs_trials_first_and_is_priced_as_the_head(tmp_path):
    """A head of 1 GPU (g5.2xlarge) beside g5.12xlarge x 1: 5 workers at once, one on the head (it runs already),
    4 on the worker; the worker's dollars are its 4/5 of the GPU-hours, the head's its wall time."""
    types = {"head.gpu": _node("g5.2xlarge", 8, 1), "worker.gpu": _node("g5.12xlarge", 48, 4, max_workers=1)}
    path = _cluster(tmp_path, types, head="head.gpu")
    spec = _study("lambda_sweep")
    out = plan.study_plan(spec, images_per_second=100.0, cluster=path, sd=1.0, deltas=[2.0])
    est = plan.estimate(spec, 100.0, plan.trial_nodes(spec, plan.read_cluster(path)))
    assert est.gpus_at_once == 5
    assert _line(out, "  cost").startswith(f"  cost      ${est.gpu_hours * 4 / 5 * 5.672 / 4:,.0f}: the GPU-hours "
                                           f"split"), out
    assert "1 on the head's GPUs; 4 on 1 g5.12xlarge (worker.gpu)" in out
    assert _line(out, "  head").startswith(f"  head      ${est.wall_hours * 1.212:,.0f}: g5.2xlarge (head.gpu) at "
                                           f"$1.212/h")
    assert _line(out, "  head").endswith("h wall time, running 1 trial workers on its GPUs")


@pytest.mark.parametrize("overrides, message", [
    (["resources.gpus_per_worker=8"],
     "resources.gpus_per_worker: a trial worker needs 8 GPUs and 8 CPUs, more than any node of {path} has "
     "(head.cpu (m5.2xlarge): 0 GPUs, 8 CPUs; worker.gpu.spot (g5.12xlarge): 4 GPUs, 48 CPUs)"),
    (["resources.cpus_per_worker=64"],
     "resources.cpus_per_worker: a trial worker needs 1 GPU and 64 CPUs, more than any node of {path} has "
     "(head.cpu (m5.2xlarge): 0 GPUs, 8 CPUs; worker.gpu.spot (g5.12xlarge): 4 GPUs, 48 CPUs)"),
    (["resources.gpus_per_worker=4", "resources.workers_per_trial=5"],
     "resources.workers_per_trial: 5 workers a trial (a trial worker needs 4 GPUs and 8 CPUs each), more than "
     "{path} holds at max_workers: 4 (worker.gpu.spot (g5.12xlarge): 1 a node x 4 nodes)"),
])
def test_a_trial_no_node_or_not_the_whole_cluster_holds_is_refused_before_pricing(overrides, message):
    spec = _study("lambda_sweep", *overrides)
    with pytest.raises(StudyError) as caught:
        plan.study_plan(spec, images_per_second=100.0, cluster=CLUSTER, sd=1.0, deltas=[2.0])
    assert str(caught.value) == message.format(path=CLUSTER)
    assert "\n" not in str(caught.value)


def test_a_node_holds_whole_workers_by_its_gpus_and_its_cpus():
    """ray-cluster.yaml's 4 nodes of 4 GPUs and 48 CPUs: 3-GPU workers are one a node, 4 at once (the plan had said
    16 / 3 = 5 trials, 15 GPUs); 16-CPU workers are 3 a node, 12 trials at once, not the 16 its GPUs would hold; and
    quarter-card workers of 16 CPUs are 3 a node too, not 16 (the wall time had been priced 4 times too short)."""
    workers = plan.Workers("g5.12xlarge", 4, True, 4, cpus=48)
    three_gpus = _study("lambda_sweep", "resources.gpus_per_worker=3")
    assert plan.workers_per_node(three_gpus.resources, workers) == 1
    assert plan.estimate(three_gpus, 100.0, workers).gpus_at_once == 12  # 4 trials of 3 GPUs
    sixteen_cpus = _study("lambda_sweep", "resources.cpus_per_worker=16")
    assert plan.workers_per_node(sixteen_cpus.resources, workers) == 3
    est = plan.estimate(sixteen_cpus, 100.0, workers)
    assert est.gpus_at_once == 12  # 36 trials, 12 at a time: 3 waves
    assert est.wall_hours == pytest.approx(est.gpu_hours / 36 * 3)
    quarter = _study("lambda_sweep", "resources.cpus_per_worker=16", "resources.gpus_per_worker=0.25")
    assert plan.workers_per_node(quarter.resources, workers) == 3
    est = plan.estimate(quarter, 100.0, workers)
    assert est.gpus_at_once == pytest.approx(12 * 0.25)  # 12 trials on a quarter card each
    assert est.wall_hours == pytest.approx(est.gpu_hours / 36 * 3 / 0.25)  # 3 waves, each trial at a quarter speed


def test_a_packed_plan_says_when_a_nodes_cpus_leave_cards_idle():
    """fusion_ablation packed 4 trials a card on ray-cluster.yaml's g5.12xlarge (48 CPUs, 4 GPUs): its 8-CPU workers
    are 6 a node, a card and a half of parts, not the 16 parts its cards have; the plan says so and what fills them
    (3 CPUs a worker), and says nothing where they are filled."""
    text = plan.study_plan(_study("fusion_ablation", "resources.gpus_per_worker=0.25"), images_per_second=100.0,
                           cluster=CLUSTER, sd=1.0, deltas=[2.0])
    assert ("            but a g5.12xlarge's 48 CPUs hold 6 of them at 8 CPUs each, not the 16 its 4 cards have room "
            "for: resources.cpus_per_worker 3 or less fills the cards") in text.splitlines(), text
    assert "up to 3 at once" in text  # 16 trials at once on nodes of 6: 3 nodes billed
    filled = plan.study_plan(_study("fusion_ablation", "resources.gpus_per_worker=0.25",
                                    "resources.cpus_per_worker=3"), images_per_second=100.0, cluster=CLUSTER, sd=1.0,
                             deltas=[2.0])
    assert "but a g5.12xlarge" not in filled and "up to 1 at once" in filled, filled


def test_a_worker_type_whose_max_workers_is_left_empty_takes_the_clusters(tmp_path):
    """`max_workers:` with no value (YAML null) is no limit of its own: the cluster's 3 (it failed in int(None))."""
    path = _cluster(tmp_path, {"worker.gpu": _node("g5.12xlarge", 48, 4, max_workers=None)}, limit=3)
    assert plan.cluster_workers(path) == plan.Workers("g5.12xlarge", 4, False, 3)
