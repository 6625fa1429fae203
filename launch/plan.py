"""The plan of a study (`a2 study plan FILE`): what it will do and cost, read from the file alone, before anything runs.

Per trial: its images (counted in the captions file when it is there, else the standard Karpathy counts), the
global batch, steps per epoch and in all, warmup's share of the cross-entropy steps and the T_P range against the
trial's steps. Per study: trials, trial-epochs, seeds per arm and the power they give for the paper's Table 3 gaps
(`dashboards.stats.power` / `seeds_needed`: the power of the verdict rule `compare_arms` prints, the 95% interval
from the difference's variance components over seeds and the images the verdicts are on, no verdict below 2
seeds) at the study's noise (`dashboards.stats.Noise`): measured in the per-image scores of the study's finished
seeds, else in their seed values, else assumed (`--sd` for the seed spread, `COCO_SEED_SD` for a COCO study, the
arm x image term `ARM_IMAGE_SD`), and an estimate of GPU-hours, wall time and cost on the node types of
`ray-cluster.yaml` (the trials placed as Ray places them, `worker_placement`; the GPU-hours' worth at a GPU's share
of its node's price, the compute; billed: whole worker nodes for the waves they run and `idle_timeout_minutes`
after, `billed_nodes`, a CPU-only study's too; the head for the wall time; one --price-per-hour for one worker type
only) from a throughput (`--images-per-second`; default: the newest GPU record's for the study's
mode, `measured_throughput`, else `IMAGES_PER_SECOND`).
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from a2core.config import CAPTIONS_PER_IMAGE, load_yaml, steps_per_epoch
from a2core.errors import A2Error, ConfigError, StudyError, folder_instead
from dashboards.compare import configurations, per_image_scores
from dashboards.paper_results import TABLE3, TABLE3_ROW
from dashboards.stats import MIN_SEEDS, POWER, Noise, noise_of, pooled_sd, power, seeds_needed
from launch.location import locate
from launch.spec import SEED_KEYS, check_fused

CLUSTER_FILE = Path(__file__).resolve().parents[1] / "ray-cluster.yaml"

# Training images per second per GPU, cross-entropy, A2 gate model at the paper's sizes: an ESTIMATE for the
# cluster's A10G, derived in benchmarks/RESULTS.md, "Throughput for `a2 study plan`": 301 GFLOP per step of 10
# images x 5 captions at 10% of an A10G's 31.2 TFLOPS FP32 peak = about 100 images/s. MEASURED on an H200
# (benchmarks/bench_gpu.py (a), RESULTS.md "On a GPU"): 115 images/s in fp32 (87 ms a step; bf16 and fp16 no
# faster), i.e. the step is bound by its ~1,000 kernel launches and host work, not by the GPU's FLOPs, so a GPU of
# fewer FLOPs is not much slower. Measure it on the cluster (`time/epoch_s` of a first trial) and pass
# --images-per-second.
IMAGES_PER_SECOND = 100.0
# The other stages' images in cross-entropy images, MEASURED on an H200 at the paper's model sizes
# (benchmarks/bench_gpu.py (b), a2core's Trainer, one epoch of each stage): an SCST image with 5 sampled captions
# (decoded word by word keeping the graph, their backward, the CIDEr-D reward on the CPU) 6.9 (an assumed 2.0
# before the measurement); a validation image (greedy decoding), and a test image of the end-of-run evaluation,
# 2.0 (assumed 1.0 before). Both are launch-bound word-by-word decoding, slower against a cross-entropy step on a GPU
# than on a CPU; the SCST figure is from a model three epochs into training, whose samples run longer than a
# trained model's (an upper side). A trial's GPUs scale linearly (assumed).
SCST_IMAGE_COST = 6.9
VAL_IMAGE_COST = 2.0
# A beam search of width 5 against greedy decoding, per image (`decode_image_cost`): VAL_IMAGE_COST is a GREEDY
# image (bench_gpu.py (b) validates with val_decode greedy), while the studies validate with beam 5 and every test
# evaluation decodes with beam search (`Trainer.test_evaluation`). No GPU record times beam against greedy, so the
# factor is MEASURED on a CPU by benchmarks/bench_decode.py (benchmarks/RESULTS.md, "Decoding an image: beam search
# against greedy", 2026-12-06: Intel Xeon, torch 2.13.0+cpu, 1 thread, process CPU time): `a2core.decode.greedy` and
# `beam_search` on the paper-size A2 gate model, untrained (every caption runs all 20 words), 10 images a batch of
# 10-50 regions, interleaved repeats, medians: beam 5 / greedy 1.46, 1.42 and 1.48 in three runs (1.46 kept), beam 3
# / greedy 1.17-1.23, on the line linear in the width. The bounds it lies between: the matrix-multiply FLOPs 83.6
# against 36.3 GFLOP, 2.30 (all time arithmetic), and the ATen operator calls (about a kernel launch each on a GPU)
# 15,921 against 13,643, 1.17 (all time launches, as an H200's greedy decoding was). The greedy figure includes the
# CIDEr-D scoring, which beam does not multiply: scaling it all is the upper side.
BEAM5_OVER_GREEDY = 1.46
# The XE layout (train.batch_layout). IMAGES_PER_SECOND is for the `images` layout (10 encoder passes a step of 50
# pairs); a `pairs` step encodes each distinct image of its 50 random pairs once, ~50 passes. Priced by the
# encoder's share of an images-layout step, ENCODER_SHARE: the encoder's work (and the region keys/values) scales
# with the passes, the decoder's (the 50 captions, the mask step) does not. From a FLOP count, as
# IMAGES_PER_SECOND is (benchmarks/bench_recipe.py (a): A2 gate at the paper's sizes, FlopCounterMode, forward and
# backward): an images step 287 GFLOP, a pairs step 582, ratio 2.03, so share = (2.03 - 1) / (50 / 10 - 1) = 0.26.
# On a CPU, one thread, the time ratio was 2.0-2.6 (RESULTS.md); on an H200 it was 1.00 (share 0.00: the extra
# encoder passes hide under the step's launch-bound time, benchmarks/bench_gpu.py (a)). The plan keeps the FLOP
# figure, the upper side for a GPU of fewer FLOPs than an H200 (an A10G has a ninth of its dense bf16 FLOPs).
ENCODER_SHARE = 0.26
# SCST candidates (train.scst_candidates): a `beam` SCST image against a `sample` one (SCST_IMAGE_COST). Beam:
# a beam search of width k (k beams x up to max_len decoder steps, no graph) and one teacher-forced pass of the k
# beams (forward and backward); sample: k samples word by word keeping the graph, and their backward. MEASURED on
# an H200 at the paper's model sizes (benchmarks/bench_gpu.py (b), both from the same checkpoint): 0.57. On a CPU
# at the smoke study's sizes (benchmarks/bench_recipe.py (c), 5 seeds) it was 0.75x [0.62, 0.89].
BEAM_SCST_COST = 0.57
# Seed spread of best val CIDEr (x100) for a COCO study that has not run yet: an ASSUMED figure of 1.0 CIDEr. No
# source at hand measures it for this model (the paper reports one run per configuration); it is of the order of
# the differences between re-runs of one Transformer captioner on the Karpathy split. Replace it with the
# study's own: `a2 study plan` measures it from the finished seeds in the study's record.
COCO_SEED_SD = 1.0
# An arm's own per-image strengths (sd of its per-image CIDEr-D about the other arms', the same for every seed), for
# a study with no finished seeds: ASSUMED to be as in the one study measured, `results/synthetic_fusions.json`
# (10.4-11.9 for three fusions against none; 5.3 for the fourth). With thousands of test images it adds little to a
# difference's variance (2 x 10^2 / 5,000 = 0.04); with a few hundred it can dominate.
ARM_IMAGE_SD = 10.0
# On-demand price per hour of an instance (Linux, us-west-2), as listed by AWS EC2 On-Demand Pricing in 2025; an
# assumption: check the current price list. Spot prices move by the hour: --price-per-hour for a quoted one.
ON_DEMAND_PRICES = {"g5.12xlarge": 5.672, "g5.xlarge": 1.006, "g5.2xlarge": 1.212, "g5.48xlarge": 16.288,
                    "p3.2xlarge": 3.06, "p3.8xlarge": 12.24, "p4d.24xlarge": 32.773,
                    # CPU heads (ray-cluster.yaml's is an m5.2xlarge): priced for the study's whole wall time
                    "m5.xlarge": 0.192, "m5.2xlarge": 0.384, "m5.4xlarge": 0.768}
SPOT_SHARE = 0.35  # assumed: spot at about a third of on-demand for g5 in us-west-2 (check the spot price history)
# Ray's autoscaler removes a worker node idle for `idle_timeout_minutes` (a cluster file's key; ray.autoscaler's
# aws/defaults.yaml fills in 5 where the file leaves it out, and `StandardAutoscaler` terminates after 60 x it s):
# the minutes a node is billed after its last trial, before it goes (`billed_nodes`)
IDLE_TIMEOUT_MINUTES = 5.0


def table3_gaps() -> list[tuple[str, float]]:
    """Each fusion's CIDEr gain over the baseline in the paper's Table 3, and the smallest gap between fusions."""
    cider = {fusion: TABLE3["rows"][row]["CIDEr"] for fusion, row in TABLE3_ROW.items()}
    gaps = [(f"{f} vs none", round(c - cider["none"], 1)) for f, c in cider.items() if f != "none"]
    pairs = [(abs(cider[a] - cider[b]), a, b) for a, b in itertools.combinations([f for f in cider if f != "none"], 2)]
    d, a, b = min(pairs)
    return gaps + [(f"{a} vs {b}", round(d, 1))]


def measured_noise(record) -> tuple[Noise, str]:
    """The noise of a study's finished seeds (`launch.record.StudyRecord`) and where it comes from: from the
    per-image scores of its replicate groups with two or more seeds on the split the verdicts are on (test when
    every run has them, else val; `dashboards.stats.noise_of`), else the pooled seed spread of their values."""
    name = record.spec.name
    groups = [g for g in configurations([r for r in record.study().runs if r.best_value is not None])
              if len(g) >= MIN_SEEDS]
    for split in ("test", "val"):
        scored = [per_image_scores(g, split) for g in groups]
        if scored and all(ids is not None and ids == scored[0][1] for _, ids in scored):
            return (noise_of([x for x, _ in scored]),
                    f"measured in study {name}: {len(groups)} replicate groups' per-image {split} scores")
    sd, n = measured_sd(record)
    return Noise(sd), f"measured in study {name}, {n} replicate groups (seed values only: no per-image scores)"


def measured_sd(record) -> tuple[float, int]:
    """(pooled seed sd of the best study metric, replicate groups with >= 2 seeds) of a study's record
    (`launch.record.StudyRecord`)."""
    groups = [g["values"] for g in record.groups()]
    sd = pooled_sd(groups)
    if sd is None:
        raise StudyError(f"study {record.spec.name!r} at {record.location.uri()} has no configuration with two "
                         f"seeds: no seed spread to measure; give one with --sd")
    return sd, sum(len(g) > 1 for g in groups)


@dataclass(frozen=True)
class Workers:
    """A node type of a Ray cluster-launcher file (the GPU worker type the plan prices, or the head)."""
    instance: str
    gpus: int
    spot: bool
    max_nodes: int
    # compare=False: a type is still the one named by the four fields above (callers and records compare those)
    cpus: float = field(default=math.inf, compare=False)  # inf: undeclared, Ray detects them when the node joins
    name: str = field(default="", compare=False)  # its key in available_node_types
    gpus_declared: bool = field(default=True, compare=False)  # False: Ray detects them, the file cannot say


@dataclass(frozen=True)
class ClusterFile:
    """A cluster-launcher file as the plan reads it: its head node type (one node, running for the whole study) and
    the worker node types the autoscaler may launch (max_workers > 0), GPUs or not, in the file's order, and the
    minutes a worker node may stay idle before the autoscaler removes it (`idle_timeout_minutes`, Ray's default 5)."""
    path: str
    head: Workers | None
    workers: tuple[Workers, ...]
    idle_minutes: float = IDLE_TIMEOUT_MINUTES


def node_type(name: str, node: dict, max_nodes: int) -> Workers:
    """One entry of `available_node_types` (its declared resources, InstanceType and market) as `max_nodes` nodes."""
    declared = node.get("resources") or {}
    config = node.get("node_config") or {}
    spot = (config.get("InstanceMarketOptions") or {}).get("MarketType") == "spot"
    cpus = float(declared["CPU"]) if declared.get("CPU") is not None else math.inf
    return Workers(str(config.get("InstanceType")), int(declared.get("GPU") or 0), spot, max_nodes, cpus, name,
                   "GPU" in declared)


def read_cluster(path: str | Path = CLUSTER_FILE) -> ClusterFile | None:
    """The head and the worker node types of a cluster-launcher YAML (None: no such file)."""
    if not Path(path).is_file():
        return None
    cluster = load_yaml(path)
    head_name = cluster.get("head_node_type")
    # Ray's own defaults (autoscaler `fill_node_type_min_max_workers`): a worker type without `max_workers` may
    # launch up to the cluster's `max_workers`, which also caps every type; the old default of 1 node priced a
    # file that sets only the cluster-wide limit at a fraction of its GPUs
    limit = cluster.get("max_workers")
    head, workers = None, []
    for name, node in (cluster.get("available_node_types") or {}).items():
        node = node or {}
        if name == head_name:  # the head is one node however many workers it may have
            head = node_type(name, node, 1)
            continue
        own = node.get("max_workers")  # `max_workers:` with no value is no limit of its own, as when absent
        nodes = int(own if own is not None else limit if limit is not None else 1)
        nodes = min(nodes, int(limit)) if limit is not None else nodes
        if nodes > 0:  # a type of max_workers 0 never launches: it holds and prices nothing
            workers.append(node_type(name, node, nodes))
    idle = cluster.get("idle_timeout_minutes")
    return ClusterFile(str(path), head, tuple(workers), float(idle if idle is not None else IDLE_TIMEOUT_MINUTES))


def cluster_workers(path: str | Path = CLUSTER_FILE) -> Workers | None:
    """The first worker node type with GPUs that the autoscaler may launch in a cluster-launcher YAML, else a head
    node type with GPUs as one node (None: no such file or no GPU node type). The plan prices every type the trials
    fit (`worker_placement`); this names the first."""
    cluster = read_cluster(path)
    if cluster is None:
        return None
    found = [w for w in cluster.workers if w.gpus > 0]
    if found:
        return found[0]
    return cluster.head if cluster.head is not None and cluster.head.gpus > 0 else None


# A node type whose CPUs and GPUs are undeclared (Ray detects them when it joins): the file limits nothing there
UNBOUNDED = 1 << 30


def workers_per_node(resources, node: Workers) -> int:
    """Trial workers (`resources.gpus_per_worker` and `cpus_per_worker` each) that Ray places on one node of `node`:
    whole workers only, by its declared GPUs (a fraction of a card: `cards_share` a card) and CPUs, the fewer of the
    two; a count the file leaves undeclared limits nothing. A Ray Train trial's
    driver function (`resources.driver_cpus`, 0.01 CPU) is left out: it fits beside the workers on any node."""
    r, fits = resources, []
    if r.gpus_per_worker > 0 and node.gpus_declared:
        fits.append(node.gpus * cards_share(r.gpus_per_worker) if r.gpus_per_worker < 1
                    else int(node.gpus / r.gpus_per_worker + 1e-9))
    if math.isfinite(node.cpus):
        fits.append(int(node.cpus / r.cpus_per_worker + 1e-9))
    return min(fits, default=UNBOUNDED)


def trial_nodes(spec, cluster: ClusterFile) -> list[Workers]:
    """The node types a trial's workers can run on (the head first: it runs already), after refusing a trial that
    no node, or the whole cluster at max_workers, can hold: it would wait forever (StudyError naming the study's
    `resources.*` key and the cluster file's node types). A GPU study is checked only against a file that declares
    its nodes' GPUs (Ray detects undeclared ones when a node joins: the file cannot say)."""
    r = spec.resources
    nodes = [n for n in (cluster.head, *cluster.workers) if n is not None]
    if r.gpus_per_worker > 0:
        if not nodes or not all(n.gpus_declared for n in nodes):
            return [n for n in nodes if n.gpus > 0]  # priced where GPUs are declared, checked nowhere
    fitting = [n for n in nodes if workers_per_node(r, n) > 0]
    worker = (f"a trial worker needs {r.gpus_per_worker:g} GPU{'s' if r.gpus_per_worker != 1 else ''} and "
              f"{r.cpus_per_worker:g} CPU{'s' if r.cpus_per_worker != 1 else ''}")
    if not fitting:
        gpus_short = r.gpus_per_worker > 0 and all(
            (n.gpus * cards_share(r.gpus_per_worker) if r.gpus_per_worker < 1 else n.gpus / r.gpus_per_worker) < 1
            for n in nodes)
        cpus_short = all(n.cpus + 1e-9 < r.cpus_per_worker for n in nodes)
        # neither short alone: some node has the GPUs and another the CPUs, none both
        key = ("resources.gpus_per_worker and resources.cpus_per_worker" if gpus_short == cpus_short
               else "resources.gpus_per_worker" if gpus_short else "resources.cpus_per_worker")
        have = "; ".join(f"{n.name} ({n.instance}): {n.gpus} GPUs, {n.cpus:g} CPUs" for n in nodes) or "no node type"
        raise StudyError(f"{key}: {worker}, more than any node of {cluster.path} has ({have})")
    room = sum(workers_per_node(r, n) * n.max_nodes for n in fitting)
    if room < r.workers_per_trial:
        have = "; ".join(f"{n.name} ({n.instance}): {workers_per_node(r, n)} a node x {n.max_nodes} nodes"
                         for n in fitting)
        raise StudyError(f"resources.workers_per_trial: {r.workers_per_trial} workers a trial ({worker} each), more "
                         f"than {cluster.path} holds at max_workers: {room} ({have})")
    return fitting


def utilization_score(resources, node: Workers, workers: int) -> tuple[float, float]:
    """Ray's autoscaler's score of launching one node of `node` for `workers` pending trial workers
    (`_resource_based_utilization_scorer` of ray.autoscaler's resource_demand_scheduler): over the node's declared
    resources of 1 or more, each its amount x its used share cubed; the least of them, then their mean. It is no
    price: the type the workers fill best wins, the cheaper one only by chance."""
    r, terms = resources, []
    for have, each in ((node.gpus, r.gpus_per_worker), (node.cpus, r.cpus_per_worker)):
        if have >= 1 and math.isfinite(have):
            terms.append(have * (workers * each / have) ** 3)
    return (min(terms), sum(terms) / len(terms)) if terms else (0.0, 0.0)


def worker_placement(resources, nodes: list[Workers], demand: int, head: Workers | None = None
                     ) -> list[tuple[Workers, int, int]]:
    """(node type, nodes, trial workers on them) for `demand` trial workers running at once, placed as Ray places
    them: first on the head when it has room (it runs already, nothing is launched), then as Ray's autoscaler
    launches nodes (`get_nodes_for`): one node at a time of the type of the best `utilization_score` for the
    workers still pending, among the types below their max_workers. Types in `nodes` that hold no worker get none."""
    placed: list[tuple[Workers, int, int]] = []
    if head is not None and any(n is head for n in nodes):
        on_head = min(workers_per_node(resources, head), demand)
        if on_head > 0:
            placed.append((head, 1, on_head))
            demand -= on_head
    types = [n for n in nodes if n is not head and workers_per_node(resources, n) > 0]
    launched = [0] * len(types)
    held = [0] * len(types)
    while demand > 0:
        choices = [(utilization_score(resources, t, min(workers_per_node(resources, t), demand)), -i)
                   for i, t in enumerate(types) if launched[i] < t.max_nodes]
        if not choices:
            break
        i = -max(choices)[1]  # a tie goes to the type listed first
        fit = min(workers_per_node(resources, types[i]), demand)
        launched[i] += 1
        held[i] += fit
        demand -= fit
    return placed + [(t, launched[i], held[i]) for i, t in enumerate(types) if launched[i]]


def cards_share(gpus_per_worker: float) -> int:
    """Workers of `gpus_per_worker` (a fraction) that Ray places on one card: int(1 / fraction) (0.33: 3)."""
    return int(1 / gpus_per_worker + 1e-9)


@dataclass(frozen=True)
class Estimate:
    """GPU-hours (a CPU-only study: its trial workers' hours), wall hours, GPUs (trial workers) at once, and the
    waves the trials run in: (trials side by side, hours) in order (`trial_waves`)."""
    gpu_hours: float
    wall_hours: float
    gpus_at_once: float  # a fraction where trials share one card
    waves: tuple[tuple[int, float], ...] = field(default=(), compare=False)


def encoder_passes(spec) -> float:
    """Encoder passes of one cross-entropy step (all workers): batch_size / 5 in layout images; in layout pairs the
    expected distinct images among batch_size pairs drawn without replacement from the train images x 5 pairs
    (each drawn image is encoded once): N (1 - C(5N - 5, b) / C(5N, b))."""
    t = spec.base["train"]
    b = t["batch_size"]
    if t.get("batch_layout", "images") != "pairs":
        return b // CAPTIONS_PER_IMAGE
    n = spec.images["train"]
    pairs = n * CAPTIONS_PER_IMAGE
    missed = math.prod((pairs - b - i) / (pairs - i) for i in range(CAPTIONS_PER_IMAGE)) if b <= pairs - 5 else 0.0
    return n * (1 - missed)


def xe_image_cost(spec) -> float:
    """Cost of an epoch's training image in cross-entropy against the images layout's (1.0): the layout's encoder
    passes a step over the images layout's, weighted by the encoder's share of a step (ENCODER_SHARE)."""
    # batch_size / 5, not // 5: a pairs batch need not be a multiple of 5 (64 pairs are 12.8 images' captions, as
    # `estimate` counts an epoch's images), and flooring it priced 64 pairs 4% above 50
    images = spec.base["train"]["batch_size"] / CAPTIONS_PER_IMAGE
    return 1.0 + ENCODER_SHARE * (encoder_passes(spec) / images - 1.0)


def scst_image_cost(spec) -> float:
    """Cost of an SCST training image in cross-entropy images of the images layout: SCST_IMAGE_COST for sampled
    candidates, times BEAM_SCST_COST for beam candidates."""
    beam = spec.base["train"].get("scst_candidates", "sample") == "beam"
    return SCST_IMAGE_COST * (BEAM_SCST_COST if beam else 1.0)


def decode_image_cost(beam_size: int) -> float:
    """Cost of decoding one image in cross-entropy images: VAL_IMAGE_COST greedy (beam 1: `caption_batches` decodes
    greedily), times beam / greedy for a beam of `beam_size`, linear in the width through BEAM5_OVER_GREEDY."""
    return VAL_IMAGE_COST * (1.0 + (BEAM5_OVER_GREEDY - 1.0) * (max(beam_size, 1) - 1) / 4)


def val_image_cost(spec) -> float:
    """Cost of a validation image: decoded as `train.val_decode` says (greedy, or beam search of `train.beam_size`)."""
    t = spec.base["train"]
    return decode_image_cost(t["beam_size"] if t.get("val_decode", "greedy") == "beam" else 1)


def test_image_cost(spec) -> float:
    """Cost of a test image of the end-of-run evaluation: always beam search of `train.beam_size`."""
    return decode_image_cost(spec.base["train"]["beam_size"])


def estimate(spec, images_per_second: float, workers: Workers | Sequence[Workers] | None) -> Estimate:
    """GPU-hours of every trial run to its planned epochs, and the wall time with the GPUs the study can use at
    once (its concurrent trials, capped by the trial workers the cluster's node types hold at max_workers:
    `workers`, one node type or several, `trial_nodes`)."""
    t = spec.base["train"]
    train_images = spec.steps_per_epoch * t["batch_size"] // CAPTIONS_PER_IMAGE  # the last batch filled up
    val = val_image_cost(spec) * validated_images(spec)
    xe = xe_image_cost(spec) * train_images + val
    scst = scst_image_cost(spec) * train_images + val
    test = test_image_cost(spec) * test_images(spec)  # once, when the trial ends
    gpu_seconds = (t["xe_epochs"] * xe + t["scst_epochs"] * scst + test) / images_per_second
    gpu_hours = spec.num_trials * gpu_seconds / 3600
    # the trials side by side: no more than the study has (Tune trials: a fused trial holds a configuration's seeds)
    r = spec.resources
    trial_gpus = spec.trial_resources()["GPU"]
    # a CPU-only trial: its workers, each at `images_per_second` (given: `plan_text` prices no CPU study without it)
    unit = trial_gpus if trial_gpus > 0 else r.workers_per_trial
    at_once = unit * min(r.max_concurrent_trials, spec.tune_samples)
    nodes = (workers,) if isinstance(workers, Workers) else tuple(workers or ())
    if nodes:
        # Ray puts whole workers on a node (a fraction: int(1 / fraction) a card, 0.4: 2, not 2.5), as many as both
        # its GPUs and its CPUs hold: 3-GPU workers on 4-GPU nodes are one a node, not 4 / 3, and quarter-card
        # workers of 16 CPUs on a 48-CPU node of 4 GPUs are 3, not 16 (by its GPUs alone, the plan had priced them
        # 16 at once: a wall time 4 times too short)
        room = sum(workers_per_node(r, n) * n.max_nodes for n in nodes)
        at_once = min(at_once, unit * (room // r.workers_per_trial))
    # Trials of one length run in waves of `slots` side by side (a trial of a fraction of a card at that fraction of
    # its speed), and each round of seeds (`seed_rounds_trials`: the search's, then the confirmation seeds of the
    # configurations it chose) starts when the round before it has ended: 55 trials 16 at a time take 4 trials'
    # time, not 55 / 16. A fused trial (resources.fuse_replicates) is one Tune trial of a configuration's k seeds of
    # the round, k seed-trials' time on its GPUs: fusion_ablation's 5 confirmation trials of 5 seeds take 5 seed-
    # trials' time however many GPUs stand free (spread over every GPU, the plan had said 47 h, below its own 68 h
    # for those 5 trials alone)
    slots = max(1, int(at_once / unit + 1e-9))
    waves = trial_waves(spec, slots, gpu_seconds / 3600 / unit)
    return Estimate(gpu_hours, sum(h for _, h in waves), slots * unit, waves)


def trial_waves(spec, slots: int, trial_hours: float) -> tuple[tuple[int, float], ...]:
    """(trials side by side, hours) of each wave the study's trials run in, `slots` at a time, a trial `trial_hours`
    long: each round of seeds (`seed_rounds_trials`) in full waves, then one of the rest; a fused trial of k seeds
    is k trials' hours."""
    waves = []
    for n, k in spec.seed_rounds_trials:
        trials, hours = (n, k * trial_hours) if spec.resources.fuse_replicates else (n * k, trial_hours)
        waves += [(slots, hours)] * (trials // slots) + ([(trials % slots, hours)] if trials % slots else [])
    return tuple(waves)


def billed_nodes(resources, nodes: Sequence[Workers], waves: Sequence[tuple[int, float]], head: Workers | None = None,
                 idle_minutes: float = IDLE_TIMEOUT_MINUTES) -> list[tuple[Workers, float, int]]:
    """(node type, node-hours billed, most nodes at once) of each worker type the trials run on: a cloud bills whole
    nodes for the time they run, whatever share of them the trials use. Each wave (`trial_waves`) on the nodes
    `worker_placement` launches for its trial workers (the head, billed apart, left out); a node a wave no longer
    needs stays `idle_minutes` (the autoscaler's `idle_timeout_minutes`) before it goes, after the last wave too,
    and is kept when a later wave needs it within that time (the idle gap billed, not a new node)."""
    idle = idle_minutes / 60
    types = [n for n in nodes if n is not head]
    counts = [[0] * len(waves) for _ in types]  # nodes of each type in each wave
    for w, (trials, _) in enumerate(waves):
        for n, count, _ in worker_placement(resources, list(nodes), trials * resources.workers_per_trial, head):
            if n is not head:
                counts[next(i for i, t in enumerate(types) if t is n)][w] = count
    billed = []
    for t, c in zip(types, counts):
        hours = 0.0
        for j in range(max(c, default=0)):  # node j runs in the waves that need more than j nodes
            busy = [w for w, count in enumerate(c) if count > j]
            hours += sum(waves[w][1] for w in busy) + idle  # its waves, then idle until it goes
            hours += sum(min(idle, sum(waves[w][1] for w in range(a + 1, b))) for a, b in zip(busy, busy[1:]))
        if hours:
            billed.append((t, hours, max(c)))
    return billed


# benchmarks/bench_fused.py's records: the training images/s per card of each mode it measured on one machine (one
# trial, k seeds fused, k trials packed), named by the machine; the plan prices a study from the newest CUDA one.
GPU_RECORDS = Path(__file__).resolve().parents[1] / "benchmarks" / "records" / "gpu"


@dataclass(frozen=True)
class Throughput:
    """Training images/s per GPU of the mode a study trains in, read from a GPU record (`measured_throughput`)."""
    images_per_second: float
    source: str  # the record, its machine and date, and the mode's arm
    arm: str  # the kind of the record's arm the figure is from: single, packed, fused or captured


def newest_gpu_record() -> tuple[Path, dict] | None:
    """(path, record) of the newest benchmarks/bench_fused.py record measured on a CUDA card in `GPU_RECORDS`, by
    its date then its file name; None if there is none. Records of a CPU, and those of other scripts (no `arms`),
    are passed over."""
    found = []
    for path in sorted(Path(GPU_RECORDS).glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise StudyError(f"{path}: not a readable JSON benchmark record ({err})") from None
        if isinstance(rec, dict) and rec.get("device") == "cuda" and isinstance(rec.get("arms"), list):
            found.append((str(rec.get("date", "")), path.name, path, rec))
    return max(found, key=lambda f: f[:2])[2:] if found else None


def measured_throughput(spec, *, newest: tuple[Path, dict] | None = None) -> Throughput | None:
    """The aggregate training images/s per GPU of the mode `spec` trains in, from the newest GPU record
    (`newest_gpu_record`, or `newest` when the caller has read it); None when there is no record or it did not
    measure that mode.

    The mode: with `resources.fuse_replicates` (and one worker a trial), each configuration's seeds train as one
    fused model: stage 1 at the record's `fused` arm of k = the study's seeds (else the largest k below), its
    `captured` arm with `resources.capture_step`, in TF32 for an fp32 study (`a2core.fused` turns it on);
    validation, SCST and the test evaluation run per seed, at the `single` arm's speed, so the figure returned is the
    study's work over the time of the two (fused groups sharing a card are not measured: priced as one a card).
    With a fraction of a GPU per worker, 1 / gpus_per_worker trials share a card: the `packed` arm of that k (else
    the largest below), every stage at it. Otherwise one trial per card: the `single` arm in the study's
    precision."""
    if newest is None and (newest := newest_gpu_record()) is None:
        return None
    path, rec = newest
    arms = [a for a in rec["arms"] if a.get("images_per_s")]

    def arm(kind: str, k: int, precisions: list[str]) -> dict | None:
        """The arm of `kind` with the largest k up to `k`, in the first of `precisions` that has one."""
        for p in precisions:
            rows = [a for a in arms if a.get("kind") == kind and a.get("precision") == p and a.get("k", 0) <= k]
            if rows:
                return max(rows, key=lambda a: a["k"])
        return None

    resolved, root = path.resolve(), CLUSTER_FILE.parent  # the repository's root
    where = (f"{resolved.relative_to(root) if resolved.is_relative_to(root) else path} "
             f"({rec.get('machine', 'unnamed machine')}, {rec.get('date', 'undated')})")
    r, prec = spec.resources, spec.base["train"].get("precision", "fp32")
    seeds = len(spec.seed_values)
    if r.fuse_replicates and seeds > 1 and r.workers_per_trial == 1:
        precisions = ["tf32", "fp32"] if prec == "fp32" else [prec]
        kind, alone = "captured" if r.capture_step else "fused", arm("single", 1, precisions)
        # each round of seeds (`seed_rounds_trials`): its seed-trials, at the arm of its k seeds fused (one: alone)
        rounds = [(n * k, arm(kind, k, precisions) if k > 1 else alone) for n, k in spec.seed_rounds_trials]
        if alone is None or any(a is None or a is not alone and a["k"] < 2 for _, a in rounds):
            return None
        t = spec.base["train"]
        train_images = spec.steps_per_epoch * t["batch_size"] // CAPTIONS_PER_IMAGE  # as `estimate` counts them
        work = estimate(spec, 1.0, None).gpu_hours  # every stage, in XE images / 3600
        xe_trial = t["xe_epochs"] * xe_image_cost(spec) * train_images / 3600  # stage 1 of one seed-trial
        xe_time = sum(n * xe_trial / a["images_per_s"] for n, a in rounds)
        ips = work / (xe_time + (work - spec.num_trials * xe_trial) / alone["images_per_s"])
        stage1 = "; then at ".join(dict.fromkeys(  # a round's arm once, in the rounds' order
            f"{a['images_per_s']:.0f} images/s a card, {a['k']} seeds fused{', captured' if r.capture_step else ''} "
            f"({a['precision']})" if a is not alone else f"{a['images_per_s']:.0f}, one seed alone" for _, a in rounds))
        return Throughput(round(ips, 1), (
            f"measured: {where}; resources.fuse_replicates: stage 1 at {stage1}, the other stages per seed at "
            f"{alone['images_per_s']:.0f} (one seed, {alone['precision']})"), kind)
    if 0 < r.gpus_per_worker < 1 and r.workers_per_trial == 1:
        share = int(1 / r.gpus_per_worker + 1e-9)  # trials a card holds
        packed = arm("packed", share, [prec, "tf32", "fp32"])
        if packed is not None:
            return Throughput(round(packed["images_per_s"], 1), (
                f"measured: {where}; {packed['k']} trials packed on a card ({packed['precision']}), all together"),
                "packed")
    single = arm("single", 1, [prec])
    return None if single is None else Throughput(round(single["images_per_s"], 1),
                                                  f"measured: {where}; one trial a card ({prec})", "single")


# The modes a card can train a study in, as its study file sets them (`mode_prices`).
# Each: its name, the kind of the record's arm that prices it, and its `resources`.
MODES = (("one trial a card", "single", {"gpus_per_worker": 1}),
         ("2 trials packed a card", "packed", {"gpus_per_worker": 0.5}),
         ("4 trials packed a card", "packed", {"gpus_per_worker": 0.25}),
         ("seeds fused", "fused", {"gpus_per_worker": 1, "fuse_replicates": True}),
         ("seeds fused, captured", "captured", {"gpus_per_worker": 1, "fuse_replicates": True, "capture_step": True}))


def mode_prices(spec, newest: tuple[Path, dict]) -> list[str]:
    """The study priced in each of `MODES` from the GPU record `newest` ((path, record), `newest_gpu_record`), the
    same trials and power in each: a line per mode with its images/s a card and GPU-hours, or why it does not apply
    to the study or was not measured; the study's own mode marked."""
    r = spec.resources
    lines = []
    for name, arm, setting in MODES:
        resources = r.model_copy(update={"fuse_replicates": False, "capture_step": False, **setting})
        mode = spec.model_copy(update={"resources": resources})
        if resources.gpus_per_worker < 1 and r.workers_per_trial > 1:
            lines.append(f"  {name:<24} not for this study: a trial of {r.workers_per_trial} workers packs nothing")
            continue
        if resources.fuse_replicates:
            try:
                check_fused(mode)
            except ConfigError as err:
                lines.append(f"  {name:<24} not for this study: {err.reason}")
                continue
        measured = measured_throughput(mode, newest=newest)
        if measured is None or measured.arm != arm:  # (packed trials without their arm are priced as one a card)
            lines.append(f"  {name:<24} not measured by the record")
            continue
        hours = estimate(mode, measured.images_per_second, None).gpu_hours
        own = "   <- this study" if all(getattr(r, k) == getattr(resources, k) for k in
                                        ("gpus_per_worker", "fuse_replicates", "capture_step")) else ""
        lines.append(f"  {name:<24} {measured.images_per_second:>7,.1f} images/s a card  {_amount(hours):>7} "
                     f"GPU-hours{own}")
    return lines


def verdict_images(spec) -> int:
    """The images a verdict is on: the end-of-run test images, else (no `train.test_at_end`) the val images."""
    return test_images(spec) or validated_images(spec)


def validated_images(spec) -> int:
    """Images of a trial's validation after each epoch: the val split, or its first `data.val_images` (a cap, as
    the trainer applies it: more than the split validates the split)."""
    split = spec.images["val"]
    return min(split, spec.base["data"].get("val_images") or split)


def test_images(spec) -> int:
    """Images of a trial's end-of-run test evaluation: the test split, or its first `train.test_images`; 0 without
    `train.test_at_end`."""
    t = spec.base["train"]
    if not t["test_at_end"]:
        return 0
    split = spec.images.get("test", 0)
    return min(split, t.get("test_images") or split)


def verdict_family(spec) -> int:
    """The comparisons a study's verdicts are one family of (`dashboards.stats.adjust_family`): `compare --by
    fusion`'s, every searched fusion against the baseline `none`; 1 when the fusion is not searched against it."""
    values = searched_fusions(spec)
    return max(1, len(values) - 1) if "none" in values else 1


@dataclass(frozen=True)
class PowerRow:
    """A row of the plan's power table: a difference, its size in CIDEr, and the family of comparisons whose Holm's
    step-down tests it (`dashboards.stats.power(..., family=)`)."""
    label: str
    delta: float
    family: int


def power_rows(spec, gaps: list[tuple[str, float]] | None = None) -> tuple[list[PowerRow], list[str]]:
    """(the power table's rows, the lines that say what they are and how each is tested) for a study of several
    configurations, at the (label, gap)s given (`--delta`, a rehearsal's score model), each tested as one of the
    study's comparisons, else at gaps relevant to what the study compares.

    A study that searches fusions against `none`: its verdicts are `compare --by fusion`'s (and `a2 study status`'s,
    the report's), each searched fusion against the baseline, Holm over them (`verdict_family`); its rows are the
    searched fusions' Table 3 gains over `none`, each at that family, and the smallest Table 3 gap between two searched
    fusions, which is no verdict of the study: `compare --baseline` with the lower of the two tests it, one of that
    row's comparisons with the others (Holm over the other fusion rows). Fusions the study does not run get no row.
    Any other study compares nothing by default (no `none` rows); `compare --by KEY --baseline VALUE` compares every
    other row with one, Holm over them: its rows are the gaps given, else Table 3's gaps, which are then ASSUMED sizes
    of difference (no record gives the gaps between its configurations), said so."""
    fusions = searched_fusions(spec)
    if "none" in fusions:
        family = verdict_family(spec)
        arms = [f for f in fusions if f != "none"]
        if gaps:
            return [PowerRow(label, d, family) for label, d in gaps], []
        cider = {fusion: TABLE3["rows"][row]["CIDEr"] for fusion, row in TABLE3_ROW.items()}
        rows = [PowerRow(f"{f} vs none", round(cider[f] - cider["none"], 1), family) for f in arms if f in cider]
        notes = ["            each searched fusion's Table 3 gain over none (dashboards.paper_results)"]
        pairs = sorted((abs(cider[a] - cider[b]), *sorted((a, b), key=lambda f: -cider[f]))
                       for a, b in itertools.combinations([f for f in arms if f in cider], 2))
        if pairs:
            gap, high, low = pairs[0]
            others = len(fusions) - 1  # `compare --baseline low`: every other fusion row against it
            rows.append(PowerRow(f"{high} vs {low}", round(gap, 1), others))
            notes.append(f"            {high} vs {low}, Table 3's smallest gap between two of its fusions: no verdict "
                         f"of the study (those are each fusion against none); `a2 study compare --by fusion "
                         f"--baseline {low}` tests it, one of the {others} comparisons with {low} (Holm)")
        return rows, notes
    # the rows `compare --by KEY` shows: a fusion grid's fusions, else the first searched key's grid values, else (a
    # sampled key) one row a configuration
    by, values = ("fusion", fusions) if fusions else next(
        ((k, p.values if p.kind == "grid" else None) for k, p in spec.params.items()
         if k not in SEED_KEYS and p.path not in SEED_KEYS), ("fusion", None))
    by = by.rsplit(".", 1)[-1]
    family = max(1, (len(values) if values is not None else spec.num_arms) - 1)
    head = (f"            no verdicts by default: the study searches no fusion against none; `a2 study compare --by "
            f"{by} --baseline VALUE` compares each of the other {family} row{'s' if family > 1 else ''} with one "
            f"(Holm over them)")
    if gaps:
        return [PowerRow(label, d, family) for label, d in gaps], [head]
    assumed = sorted({d for _, d in table3_gaps()})
    return [PowerRow(f"{d:g} CIDEr", d, family) for d in assumed], [
        head, f"            the gaps are ASSUMED: no record gives the CIDEr gaps between its {by} values, so Table 3's "
              f"(the fusions' gains over none, {assumed[1]:.1f}-{assumed[-1]:.1f}, and the smallest between two "
              f"fusions, {assumed[0]:.1f}) stand in as sizes of difference; give yours with --delta"]


def searched_fusions(spec) -> list:
    """The fusions the study's grid runs ([] when the fusion is not a grid key)."""
    fusion = next((p for p in spec.params.values() if p.path == "model.fusion" and p.kind == "grid"), None)
    return list(fusion.values) if fusion is not None else []


def configurations_per_fusion(spec) -> dict[str, int]:
    """Each searched fusion's number of configurations (its grid cells' samples; a seed grid's cells are one
    configuration's seeds, counted once)."""
    counts: dict[str, int] = {}
    seen = set()
    for cell in spec.grid_cells():
        configuration = tuple(sorted((k, repr(v)) for k, v in cell.items() if k not in SEED_KEYS))
        if configuration not in seen:
            seen.add(configuration)
            counts[cell["fusion"]] = counts.get(cell["fusion"], 0) + spec.samples_per_cell(cell)
    return counts


def selected_fusions(spec) -> str:
    """"exp_decay among 8, gate among 2": the fusions a fixed-seed study chooses among several configurations on the
    seeds its verdicts use (empty with confirmation seeds, or when no fusion has several)."""
    values = searched_fusions(spec)
    if spec.confirm_seeds or "none" not in values or len(values) < 2:
        return ""
    return ", ".join(f"{fusion} among {n}" for fusion, n in configurations_per_fusion(spec).items() if n > 1)


def early_stopping(spec) -> bool:
    """Whether the study's scheduler stops trials before their last epoch (ASHA; fifo runs every epoch)."""
    return spec.search.scheduler.asha is not None


def _trials_text(n: float) -> str:
    return f"{n:g} trial{'s' if n != 1 else ''}"


def _n(value: float) -> str:
    return f"{value:,.0f}"


def _amount(value: float) -> str:
    """An hour or GPU-hour figure: whole from 1 on, two significant digits below (a study of 0.4 GPU-hours was
    printed as 0 GPU-hours, $0: free; one of 0.64 as 1)."""
    if value >= 1 or value <= 0 or not math.isfinite(value):
        return _n(value)
    return f"{value:.{1 - math.floor(math.log10(value))}f}"


def _dollars(value: float) -> str:
    """A price: whole dollars from $10 on, cents below ($0.55 was printed as $1, a spot $0.19 as $0)."""
    return _n(value) if value >= 10 else f"{value:.2f}"


def _power_text(value: float) -> str:
    return ">99%" if not math.isfinite(value) or value > 0.995 else f"{value:.0%}"


def plan_text(spec, noise: Noise | None, noise_source: str, deltas: list[tuple[str, float]] | None,
              images_per_second: float,
              ips_source: str, workers: Workers | Sequence[Workers] | None, price: float | None, *,
              head: Workers | None = None, idle_minutes: float = IDLE_TIMEOUT_MINUTES) -> str:
    """The plan's lines. `workers`: the node types the trials run on (one, or several: `trial_nodes`), `head` the
    cluster's head node, priced for the study's whole wall time; `price`: a worker node's price an hour, for a
    placement on one worker type (StudyError on several: one price for several instance types would be made up);
    `idle_minutes`: the cluster's `idle_timeout_minutes`. The worker nodes are billed whole for the hours they run
    (`billed_nodes`); the GPU-hours' worth at a GPU's share of its node's price is printed apart (the compute)."""
    t, r = spec.base["train"], spec.resources
    steps, total = spec.steps_per_epoch, spec.total_steps
    xe_steps = steps * t["xe_epochs"]
    images = t["batch_size"] // CAPTIONS_PER_IMAGE
    per_trial = f"{r.workers_per_trial} worker{'s' if r.workers_per_trial > 1 else ''}"
    if t.get("batch_layout", "images") == "pairs":
        batch = (f"{t['batch_size']} image-caption pairs a step at random over all {_n(spec.images['train'] * 5)} "
                 f"pairs ({per_trial} x {t['batch_size'] // r.workers_per_trial} pairs), ~{encoder_passes(spec):.1f} "
                 f"encoder passes a step (one per distinct image)")
    else:
        batch = (f"{t['batch_size']} image-caption pairs a step = {images} images x {CAPTIONS_PER_IMAGE} captions "
                 f"({per_trial} x {images // r.workers_per_trial} images), {images} encoder passes a step")
    k = t["scst_samples"]
    scst = (f"{images} images x {k} beams of a beam search of width {k} (up to {t['max_len']} steps of {k} beams an "
            f"image, then one teacher-forced pass of the {k}), mean-reward baseline"
            if t.get("scst_candidates", "sample") == "beam" else f"{images} images x {k} samples")
    lines = [f"{spec.name}: plan (nothing runs)",
             "per trial",
             f"  images    {_n(spec.images['train'])} train, {_n(spec.images['val'])} val, "
             f"{_n(spec.images.get('test', 0))} test ({spec.images_source})",
             f"  batch     {batch}",
             f"  SCST      {scst}" if t["scst_epochs"] else "  SCST      none (scst_epochs 0)",
             f"  steps     {_n(steps)} a epoch; {_n(total)} in {spec.total_epochs} epochs ({t['xe_epochs']} XE + "
             f"{t['scst_epochs']} SCST)"]
    if spec.trial_batches != [(t["batch_size"], t.get("batch_layout", "images"))]:  # searched: base at its default
        each = ", ".join(f"{size} {layout} ({_n(steps_per_epoch(spec.images['train'], size, layout))} steps an epoch)"
                         for size, layout in spec.trial_batches)
        lines.append(f"  searched  trials train at a batch of {each}; the lines here and the cost are at "
                     f"{t['batch_size']} {t.get('batch_layout', 'images')} (a searched key at its schema default)")
    if t["xe_epochs"]:
        lines.append(f"  warmup    {_n(t['warmup'])} steps = {t['warmup'] / xe_steps:.1%} of the {_n(xe_steps)} XE "
                     f"steps (the learning rate peaks in epoch {math.ceil(t['warmup'] / steps)})")
    tp = spec.temperature_range()
    if tp is not None:
        keep = [math.exp(-total / v) for v in tp]
        lines.append(f"  T_P       {tp[0]:,.0f} - {tp[1]:,.0f} steps against {_n(total)}: exp_decay keeps "
                     f"{keep[0]:.1%} - {keep[1]:.1%} of the original attention at the end")
    searched, seeds = len(spec.seed_values), spec.verdict_seeds
    confirm = (f" + {spec.confirm_arms} fusion{'s' if spec.confirm_arms > 1 else ''}' chosen configuration x "
               f"{seeds} confirmation seeds (the verdicts')" if spec.confirm_seeds else "")
    lines += ["per study",
              f"  trials    {spec.num_trials} = {spec.num_arms} configuration{'s' if spec.num_arms > 1 else ''} "
              f"x {searched} seed{'s' if searched > 1 else ''}{confirm}; "
              f"{_n(spec.num_trials * spec.total_epochs)} trial-epochs "
              f"({'before early stopping' if early_stopping(spec) else 'no early stopping: fifo'})"]
    if spec.resources.fuse_replicates:  # what max_concurrent_trials and a GPU each count
        rounds = ", then ".join(f"{n} of {k} seeds" if k > 1 else f"{n} of one seed (alone)"
                                for n, k in spec.seed_rounds_trials)
        lines.append(f"  fused     {spec.tune_samples} Tune trials{' at most' if spec.replicate_rounds else ''}, "
                     f"each a configuration's seeds of a round trained together (resources.fuse_replicates): {rounds}")
    if spec.num_arms < 2:
        lines.append("  power     one configuration: nothing is compared")
    elif noise is None:
        lines.append(f"  power     no seed spread ({noise_source}): give --sd")
    else:
        lines += [f"  power     CIDEr {noise.text()}", f"            ({noise_source})"]
        over = (f"seeds and {noise.images:,} images, each component once, Satterthwaite d.f." if noise.images
                else "seed means: Welch")
        rows, notes = power_rows(spec, deltas)
        family = verdict_family(spec) if "none" in searched_fusions(spec) else max(r.family for r in rows)
        lines.append(f"            the verdict rule (95% interval over {over}; no verdict below 2 seeds), "
                     f"{POWER:.0%} power wanted")
        if family > 1:
            what = (f"{family} fusions against the baseline are one family" if "none" in searched_fusions(spec) else
                    f"{family} rows against the one named are one family")
            lines.append(f"            for the adjusted verdict: {what} (Holm), each tested at 5% / {family} = "
                         f"{0.05 / family:.4g} at Holm's first step (a lower bound of its power)")
        lines += notes
        if chosen_among := selected_fusions(spec):
            lines.append(f"            a fusion's row is its best configuration on val ({chosen_among}), chosen on "
                         f"the seeds its verdict uses: with every arm equal fusion_ablation's fixed 5 seeds resolved "
                         f"some arm in 6.3% of 1,200 rehearsals; search.confirm gives the verdicts fresh seeds "
                         f"(docs/explanation/statistics.md, \"Confirmation seeds\")")
        lines.append(f"    {'difference':<26}{'delta':>6}{'seeds/arm needed':>18}{f'power at {seeds}':>14}")
        never = False
        for row in rows:
            needed = seeds_needed(row.delta, noise, family=row.family)
            never |= needed is None
            lines.append(f"    {row.label:<26}{row.delta:>6.1f}{'never' if needed is None else needed:>18}"
                         f"{_power_text(power(seeds, row.delta, noise, family=row.family)):>14}")
        if never:
            lines.append(f"    never: the images' own variance ({noise.images:,} images) stays however many seeds "
                         f"run; score more test images")
    cpu_only = r.gpus_per_worker == 0
    if cpu_only and ips_source != "given":  # every throughput the plan knows is a GPU's
        lines.append("cost      none estimated: the trials use no GPU (resources.gpus_per_worker: 0) and no CPU "
                     "throughput is known: give --images-per-second (a trial worker's training images/s)")
        return "\n".join(lines)
    est = estimate(spec, images_per_second, workers)
    unit = spec.trial_resources()["GPU"] if not cpu_only else r.workers_per_trial  # a trial's GPUs, else workers
    val_decode = (f"beam {t['beam_size']}" if t.get("val_decode", "greedy") == "beam" and t["beam_size"] > 1
                  else "greedy")
    speed = "per trial worker on its CPUs; a trial's workers scale linearly (assumed)" if cpu_only else "per GPU"
    side = f", {_trials_text(est.gpus_at_once / unit)} side by side in waves" if not r.fuse_replicates else ""
    asha = (" (every trial to its last epoch: before ASHA's early stopping, an upper bound)" if early_stopping(spec)
            else "")
    lines += ["cost (an estimate)",
              f"  speed     {images_per_second:g} training images/s {speed} ({ips_source})",
              f"            per image, in XE images: an XE image {xe_image_cost(spec):.2f} "
              f"({t.get('batch_layout', 'images')} layout, encoder share {ENCODER_SHARE:g} of an images-layout "
              f"step, from FLOPs), an SCST image {scst_image_cost(spec):.2f} "
              f"({t.get('scst_candidates', 'sample')} candidates); a trial's GPUs scale linearly (assumed)",
              f"            decoding, in XE images: a validation image {val_image_cost(spec):.2f} ({val_decode}), "
              f"a test image ({_n(test_images(spec))} when a trial ends, beam {t['beam_size']}) "
              f"{test_image_cost(spec):.2f}: "
              f"greedy {VAL_IMAGE_COST:g} measured on an H200 (benchmarks/bench_gpu.py), beam 5 / greedy "
              f"{BEAM5_OVER_GREEDY:g} measured on a CPU, linear in the width (launch.plan.BEAM5_OVER_GREEDY; "
              f"its FLOPs say 2.30, its kernel launches 1.17)",
              (f"  worker-hours {_amount(est.gpu_hours)} for {spec.num_trials} trials (CPU trial workers); about "
               f"{_amount(est.wall_hours)} h wall on {est.gpus_at_once:g} trial workers at once{side}{asha}"
               if cpu_only else
               f"  GPU-hours {_amount(est.gpu_hours)} for {spec.num_trials} trials; about {_amount(est.wall_hours)} h "
               f"wall on {est.gpus_at_once:g} GPUs at once{side}{asha}")]
    if 0 < r.gpus_per_worker < 1:
        one = "trial" if r.workers_per_trial == 1 else "worker"  # a trial of several workers holds several parts
        lines.append(f"            {cards_share(r.gpus_per_worker)} {one}s share a card: {images_per_second:g} "
                     f"images/s is the card's, all of them together (each {one} at its {r.gpus_per_worker:g} of it)")
    nodes = (workers,) if isinstance(workers, Workers) else tuple(workers or ())
    run_nodes = list(nodes) if cpu_only else [n for n in nodes if n.gpus > 0]  # the types the trials run on
    for n in run_nodes if 0 < r.gpus_per_worker < 1 else ():
        # Ray fills a card's parts only as far as the node's CPUs go: the rest of its cards are billed and idle
        holds, parts = workers_per_node(r, n), n.gpus * cards_share(r.gpus_per_worker)
        if holds < parts:
            fill = int(n.cpus / parts + 1e-9)
            lines.append(f"            but a {n.instance}'s {n.cpus:g} CPUs hold {holds} of them at "
                         f"{r.cpus_per_worker:g} CPUs each, not the {parts} its {n.gpus} cards have room for: "
                         + (f"resources.cpus_per_worker {fill} or less fills the cards" if fill >= 1 else
                            "a node type of more CPUs fills the cards"))
    if not run_nodes and price is not None:  # a node's price, and no node type to say its GPUs
        lines.append(f"  cost      not priced: the cluster file names no GPU worker type, so a node's "
                     f"--price-per-hour {price:g} has no GPUs to divide by" if not cpu_only else
                     f"  cost      not priced: no cluster file names the nodes the trials run on, so a node's "
                     f"--price-per-hour {price:g} has no nodes to count")
    what = "given" if price is not None else "on-demand list price, us-west-2, 2025, assumed"
    workers_dollars = spot_dollars = 0.0  # what the worker nodes are billed
    placement: list[tuple[Workers, int, int]] = []
    if run_nodes:
        trials_at_once = max(1, int(est.gpus_at_once / unit + 1e-9))
        placement = worker_placement(r, run_nodes, trials_at_once * r.workers_per_trial, head)
        billed = billed_nodes(r, run_nodes, est.waves, head, idle_minutes)
        if price is not None and len(billed) > 1:  # one price for several instance types would be made up
            raise StudyError(f"--price-per-hour: one price for {len(billed)} worker types, and the trials run on "
                             f"{' and '.join(f'{n.name} ({n.instance})' for n, _, _ in billed)}: leave it out to price "
                             f"each at its list price (launch.plan.ON_DEMAND_PRICES), or plan with a cluster file of "
                             f"one worker type")

        def node_price(n: Workers) -> float | None:
            return price if price is not None else ON_DEMAND_PRICES.get(n.instance)

        held = sum(w for _, _, w in placement) or 1
        # the GPU-hours' worth: each type's share in proportion to the workers it holds at once, the head's in its
        # price below (it runs for the whole study whatever it holds)
        priced = [(n, count, w, node_price(n)) for n, count, w in placement if n is not head]
        unknown = list(dict.fromkeys(n.instance for n in [p[0] for p in priced] + [b[0] for b in billed]
                                     if node_price(n) is None))
        if unknown:
            lines.append(f"  cost      no price known for {', '.join(unknown)}: give --price-per-hour")
            workers_dollars = math.nan
        worth = worth_spot = 0.0
        for n, _, w, p in priced if not unknown and not cpu_only else ():
            dollars = est.gpu_hours * w / held * p / n.gpus
            worth += dollars
            worth_spot += dollars * (SPOT_SHARE if n.spot and price is None else 1.0)
        billed_text = (f"whole nodes, as many as each wave of trials needs, each kept {idle_minutes:g} min idle after "
                       f"its last (idle_timeout_minutes)")
        if priced and not unknown and not cpu_only and len(placement) == 1:
            n, _, _, p = priced[0]
            lines.append(f"  cost      ${_dollars(worth)}: {n.instance} at ${p:.3f}/h ({what}) / {n.gpus} GPUs = "
                         f"${p / n.gpus:.3f} a GPU-hour: the GPU-hours' worth; billed by whole nodes below")
        elif priced and not unknown and not cpu_only:
            parts = "; ".join(f"{w} on {count} {n.instance} ({n.name}) at ${p:.3f}/h / {n.gpus} GPUs = "
                              f"${p / n.gpus:.3f} a GPU-hour" for n, count, w, p in priced)
            head_part = next((f"{w} on the head's GPUs; " for n, _, w in placement if n is head), "")
            lines.append(f"  cost      ${_dollars(worth)}: the GPU-hours split by where the {held} trial "
                         f"workers running at once are placed ({what}): {head_part}{parts}; the GPU-hours' worth, "
                         f"billed by whole nodes below")
        if priced and not unknown and not cpu_only and price is None and any(n.spot for n, _, _, _ in priced):
            lines.append(f"            spot at ~{SPOT_SHARE:.0%} of on-demand (assumed): ${_dollars(worth_spot)}")
        if len(placement) > 1:
            lines.append("            placed as Ray places them: on the head first when it has "
                         f"{'CPUs' if cpu_only else 'GPUs'} (it runs "
                         "already), then the node type Ray's autoscaler scores best, the one the pending workers "
                         "fill most (not the cheapest), the next when it reaches max_workers "
                         "(launch.plan.worker_placement)")
        for n, hours, _ in billed if not unknown else ():
            workers_dollars += hours * node_price(n)
            spot_dollars += hours * node_price(n) * (SPOT_SHARE if n.spot and price is None else 1.0)
        if billed and not unknown:
            each = "; ".join(f"{_amount(hours)} node-hours of {n.instance} ({n.name}) at ${node_price(n):.3f}/h, "
                             f"up to {most} at once" for n, hours, most in billed)
            lines.append(f"  billed    ${_dollars(workers_dollars)}: {each} ({what}): {billed_text}"
                         f"{', the trials on the head apart' if any(n is head for n, _, _ in placement) else ''} "
                         f"(launch.plan.billed_nodes)")
            if spot_dollars < workers_dollars - 1e-12:
                lines.append(f"            billed with spot at ~{SPOT_SHARE:.0%} of on-demand (assumed): "
                             f"${_dollars(spot_dollars)}")
    if head is not None and (run_nodes or price is not None):
        head_price = ON_DEMAND_PRICES.get(head.instance)
        runs = next((w for n, _, w in placement if n is head), 0)
        on_gpus = f", running {runs} trial workers on its {'CPUs' if cpu_only else 'GPUs'}" if runs else ""
        if head_price is None:
            lines.append(f"  head      no price known for {head.instance} ({head.name}){on_gpus}: not in the dollars "
                         f"(launch.plan.ON_DEMAND_PRICES)")
        else:
            # the head (Tune driver) runs from the study's start to its end, trials or none
            head_dollars = est.wall_hours * head_price
            lines.append(f"  head      ${_dollars(head_dollars)}: {head.instance} ({head.name}) at ${head_price:.3f}/h "
                         f"(on-demand list price, us-west-2, 2025, assumed) for the whole ~{_amount(est.wall_hours)} "
                         f"h wall time{on_gpus}")
            if math.isfinite(workers_dollars):
                head_spot = head_dollars * (SPOT_SHARE if head.spot else 1.0)
                spot = (f"; ${_dollars(spot_dollars + head_spot)} with spot at ~{SPOT_SHARE:.0%}"
                        if spot_dollars + head_spot < workers_dollars + head_dollars - 1e-12 else "")
                lines.append(f"  in all    ${_dollars(workers_dollars + head_dollars)}, head and worker nodes billed"
                             f"{spot}")
    return "\n".join(lines)


def study_noise(spec, sd: float | None = None, storage: str | None = None) -> tuple[Noise | None, str]:
    """The study's noise and where it comes from: measured in its finished seeds (the study at `storage`, default its
    own); else the seed spread `sd` given (`--sd`), else assumed, said so."""
    if sd is not None and not 0 < sd < math.inf:  # NaN passes `sd <= 0` and failed in the seeds' arithmetic
        raise StudyError(f"--sd must be a finite number > 0, got {sd}")
    if sd is None:
        try:
            location = locate(spec.name, storage or spec.storage)
            # The record reads the trials with Ray's Tune: imported only for a study that ran, so that the plan of
            # one that has not (`a2 study plan` before `run`) loads no Ray.
            from launch.record import StudyRecord

            return measured_noise(StudyRecord.load(location))
        except A2Error:  # not run yet (no study.yaml there), or no group with two seeds
            pass
    images = verdict_images(spec)
    assumed = "arm x image sd assumed, launch.plan.ARM_IMAGE_SD, as measured on synthetic data"
    if sd is not None:
        return Noise(sd, 0.0, ARM_IMAGE_SD, images), f"seed spread given; {assumed}"
    if spec.base["data"]["kind"] == "coco":
        return (Noise(COCO_SEED_SD, 0.0, ARM_IMAGE_SD, images),
                f"nothing measured: no finished seeds; seed spread assumed for COCO, launch.plan.COCO_SEED_SD; "
                f"{assumed}")
    return None, f"no finished seeds of study {spec.name} to measure"


# Adaptive replicates, priced beside the fixed design (`dashboards.sequential`; `launch.adaptive` runs it): the
# looks benchmarks/bench_sequential.py measured best on fusion_ablation's plan (cumulative seeds a configuration,
# error spent in proportion to the seeds), and the simulated studies a figure rests on (a fixed seed: the same
# figures every run; 4,000 draws give a power's Monte Carlo error of at most 0.8 points, a fraction of a second).
ADAPTIVE_ROUNDS = (3, 5, 7, 9)
ADAPTIVE_STUDIES = 4_000
ADAPTIVE_SEED = 0


def arm_gaps(spec) -> dict[str, float]:
    """{fusion: its Table 3 gap over the baseline} of the fusions the study searches beside `none` ({} when it does
    not search `none`)."""
    gaps = {label.split(" vs ")[0]: d for label, d in table3_gaps() if label.endswith(" vs none")}
    values = searched_fusions(spec)
    return {v: gaps[v] for v in values if v in gaps} if "none" in values else {}


def study_design(spec):
    """The adaptive design the driver runs for a study whose `search.replicates` is a range: its rounds, error spent
    in proportion to the seeds (`spending_weights`, rho 1) and the plan's gap for futility, an arm settled futile
    when its interval's upper end is below it (the smallest of `arm_gaps`; none without them); None for a fixed
    number of seeds."""
    from dashboards.sequential import Design, spending_weights  # numpy only: the plan stays light

    rounds = spec.replicate_rounds
    if rounds is None:
        return None
    return Design(rounds, spending_weights(rounds, 1.0), futility_gap=min(arm_gaps(spec).values(), default=None))


PRICED_SEED_LOSS = 0.1  # the share of seeds lost that the plan also prices: a study losing that many still has power


def adaptive_text(spec, noise: Noise | None, gpu_hours_per_trial: float | None) -> str:
    """The adaptive design's expected seed-trials and GPU-hours (`gpu_hours_per_trial`; None: no GPU) against the
    fixed design's at equal power, for the study's fusions against the baseline at the paper's Table 3 gaps
    (`dashboards.sequential.simulate`: the verdict rule's statistics drawn from `noise`, Holm over the arms on the
    union-bound sequential p-values; an arm is also settled when its interval lies below the smallest gap). Equal
    power: the fixed design's seed-trials interpolated, between 2 and 12 seeds, at the adaptive design's power on
    the hardest gap. Empty when there is nothing to price (no noise, no fusion searched against `none`)."""
    import numpy as np

    from dashboards.sequential import Design, simulate, spending_weights  # numpy only: the plan stays light

    gaps = arm_gaps(spec)
    if noise is None or not gaps:
        return ""
    arms, deltas = list(gaps), list(gaps.values())
    per_fusion = configurations_per_fusion(spec)
    configs = [per_fusion.get("none", 1), *(per_fusion.get(a, 1) for a in arms)]
    hardest = int(np.argmin(deltas))
    rounds = spec.replicate_rounds or ADAPTIVE_ROUNDS  # the study's own rounds when it gives a range
    design = Design(rounds, spending_weights(rounds, 1.0), futility_gap=min(deltas))
    run = simulate(design, noise, deltas, configs, ADAPTIVE_STUDIES, ADAPTIVE_SEED)
    null = simulate(design, noise, [0.0] * len(arms), configs, ADAPTIVE_STUDIES, ADAPTIVE_SEED + 1)
    fixed = {n: simulate(Design.fixed(n), noise, deltas, configs, ADAPTIVE_STUDIES, ADAPTIVE_SEED)
             for n in range(MIN_SEEDS, 13)}
    seeds = spec.verdict_seeds
    if seeds < MIN_SEEDS:  # one seed an arm measures no seed noise: no verdict, so no power; its own trials
        own = {"power": [0.0] * len(arms), "seed_trials": spec.num_trials}
    else:
        own = fixed.get(seeds) or simulate(Design.fixed(seeds), noise, deltas, configs, ADAPTIVE_STUDIES,
                                           ADAPTIVE_SEED)
    # with confirmation seeds the study's verdicts rest on its `seeds` confirmation seeds (the power above), and it
    # runs its own trial count, not every configuration at those seeds
    own_trials = spec.num_trials if spec.confirm_seeds else own["seed_trials"]
    plural = "s" if seeds != 1 else ""
    own_name, own_power_name = ((f"{seeds} confirmation seed{plural}",) * 2 if spec.confirm_seeds
                                else (f"{seeds} seed{plural}", f"{seeds} fixed seed{plural}"))
    curve = np.maximum.accumulate([fixed[n]["power"][hardest] for n in fixed])  # MC noise: keep it monotone
    trials = [fixed[n]["seed_trials"] for n in fixed]
    target = run["power"][hardest]
    pct = " / ".join(f"{p:.0%}" for p in run["power"])
    which = ("the study's own design, search.replicates' rounds, as the driver runs it" if spec.replicate_rounds
             else f"an ESTIMATE for search.replicates: {{min: {rounds[0]}, max: {rounds[-1]}}}, which the driver runs "
                  f"in rounds" + (" without confirmation seeds (search.confirm: null)" if spec.confirm_seeds else ""))
    lines = [f"adaptive replicates ({which}: dashboards.sequential.simulate, {ADAPTIVE_STUDIES:,} simulated studies, "
             f"seed {ADAPTIVE_SEED}, at the noise above)",
             f"  design    seeds in rounds to {', '.join(map(str, rounds))} a configuration; after each round an arm "
             f"Holm resolves, or whose interval lies below the smallest gap ({min(deltas):g}), gets no more; each "
             f"look spends error in proportion to its seeds (union bound)",
             f"  power     {' / '.join(arms)} vs none at {' / '.join(f'{d:g}' for d in deltas)}: {pct} "
             f"(the study's {own_power_name}: "
             f"{' / '.join(f'{p:.0%}' for p in own['power'])}); family-wise "
             f"false rate with all arms equal {null['family_wise']:.1%}"]
    # the figures above assume no seed is lost; a seed that errors or diverges leaves its arm's look on fewer seeds
    lossy = simulate(design, noise, deltas, configs, ADAPTIVE_STUDIES, ADAPTIVE_SEED, seed_loss=PRICED_SEED_LOSS)
    lines.append(f"  losses    the above with no seed lost; with {PRICED_SEED_LOSS:.0%} of seeds lost (errored or "
                 f"diverged, each on its own): power {' / '.join(f'{p:.0%}' for p in lossy['power'])}, "
                 f"{lossy['seed_trials']:.1f} seed-trials expected")
    if target > curve[-1]:
        equal, at = None, f"above the fixed design's power at 12 seeds ({curve[-1]:.0%})"
    else:
        equal = float(np.interp(target, curve, trials))
        at = (f"{equal:.1f} for fixed seeds at equal power ({arms[hardest]}'s {target:.0%}): "
              f"{run['seed_trials'] / equal:.0%}")
    lines.append(f"  seed-trials {run['seed_trials']:.1f} expected ({null['seed_trials']:.1f} with all arms equal) "
                 f"against {at}; the study's {own_name}: {own_trials:.0f}")
    if gpu_hours_per_trial is not None:
        fixed_hours = "-" if equal is None else _amount(equal * gpu_hours_per_trial)
        lines.append(f"  GPU-hours {_amount(run['seed_trials'] * gpu_hours_per_trial)} expected against {fixed_hours} "
                     f"fixed at equal power ({gpu_hours_per_trial:.2f} a trial, the estimate above)")
    return "\n".join(lines)


def study_plan(spec, *, deltas: list[float] | None = None, images_per_second: float | None = None,
               price_per_hour: float | None = None, cluster: str | Path | None = CLUSTER_FILE, sd: float | None = None,
               storage: str | None = None) -> str:
    """All that `a2 study plan` prints: `plan_text` at the given gaps (`--delta`; default Table 3's), throughput
    (default: the newest GPU record's, else `IMAGES_PER_SECOND`) and price, then the adaptive design's estimate when
    the study compares arms at Table 3's gaps. StudyError naming the option when a value is out of range."""
    if deltas is not None and not all(0 < d < math.inf for d in deltas):
        raise StudyError(f"--delta must be finite numbers > 0, got {' '.join(f'{d:g}' for d in deltas)}")
    for option, value in (("--images-per-second", images_per_second), ("--price-per-hour", price_per_hour)):
        if value is not None and not 0 < value < math.inf:
            raise StudyError(f"{option} must be a finite number > 0, got {value:g}")
    if cluster is not None and not Path(cluster).is_file():  # it used to price nothing and ignore --price-per-hour
        why = folder_instead(cluster, "cluster-launcher file") or f"{cluster}: no such cluster-launcher file"
        raise StudyError(f"--cluster {why}")
    cluster_file = read_cluster(cluster) if cluster is not None else None  # None: no cluster file, no price
    # a trial that fits no node, or not the whole cluster, is refused before anything is priced or read
    workers = trial_nodes(spec, cluster_file) if cluster_file is not None else None
    noise, noise_source = study_noise(spec, sd, storage)
    newest = newest_gpu_record() if images_per_second is None else None  # read once: the study's mode and the others
    measured = measured_throughput(spec, newest=newest) if newest is not None else None
    ips, ips_source = ((images_per_second, "given") if images_per_second is not None else
                       (measured.images_per_second, measured.source) if measured is not None else
                       (IMAGES_PER_SECOND, "an estimate for an A10G; 115 measured on an H200: benchmarks/RESULTS.md"
                        + (f"; the newest GPU record, {newest[0].name}, did not measure this study's mode"
                           if newest is not None else "")))
    gaps = [(f"{d:g} CIDEr", d) for d in deltas] if deltas else None  # None: the gaps relevant to the study
    text = plan_text(spec, noise, noise_source, gaps, ips, ips_source, workers, price_per_hour,
                     head=cluster_file.head if cluster_file is not None else None,
                     idle_minutes=cluster_file.idle_minutes if cluster_file is not None else IDLE_TIMEOUT_MINUTES)
    if newest is not None:
        path, rec = newest
        text += (f"\nmodes     each priced from the newest GPU record ({path.name}: "
                 f"{rec.get('machine', 'unnamed machine')}, {rec.get('date', 'undated')}), the same trials and power "
                 f"(docs/how-to/fill-a-gpu.md)\n" + "\n".join(mode_prices(spec, newest)))
    if spec.num_arms > 1 and not deltas:  # the adaptive design is priced at the Table 3 gaps
        per_trial = estimate(spec, ips, workers).gpu_hours / spec.num_trials if spec.resources.gpus_per_worker else None
        if adaptive := adaptive_text(spec, noise, per_trial):
            text += "\n" + adaptive
    return text
