"""A study trial as Ray runs it: the one file that knows training happens inside Ray.

A trial of one worker (`resources.workers_per_trial: 1`) trains in the Tune trial process itself,
`a2_local_trial`: no worker group, no process group, so it starts in about a second. It writes each epoch's
checkpoint into its run folder `<study>/trials/<study>-<trial id>/checkpoint_epochNNNN` (the place Ray Train
would use, so status, summary and packaging read both kinds alike), keeps the best `num_to_keep` by the study
metric plus the latest, and resumes from the newest complete one when Tune restarts or restores the trial
(`tune.FailureConfig`). Trials of several workers run on Ray Train, as follows.

Ray Train V2 (the default in Ray 2.60) does not run a `TorchTrainer` as a Tune trainable. A trial is therefore a
small Tune *driver function*, `a2_trial`, that needs almost nothing itself (`resources.driver_cpus`) and runs

    TorchTrainer(worker_fn, train_loop_config=<resolved a2core config>,
                 scaling_config=ScalingConfig(num_workers=N, resources_per_worker={...}),
                 run_config=ray.train.RunConfig(name=f"{study}-{trial_id}", storage_path=<study>/trials, ...),
                 callbacks=[<forward results to the driver>]).fit()

`worker_fn` runs on every Train worker (torch.distributed is set up by then: gloo on CPU, nccl on GPU) and calls
`a2core.train.train` with a `report` that hands each epoch's metrics and rank 0's checkpoint to `ray.train.report`.
A Train callback (like Ray's `TuneReportCallback`) forwards rank 0's metrics, with `checkpoint_path`, to the
driver, which reports them to Tune, so Tune's schedulers see the `epoch` key of every result. With every
checkpointed result the driver also gives Tune a tiny checkpoint pointing at the Train checkpoint, which keeps a
trial's result history across `Tuner.restore`.

Fault tolerance rests on the Train run name being a function of the Tune trial id alone:
- a worker or node dies: the Train controller restarts the worker group (`FailureConfig(max_failures)`), and the
  workers resume from the run's latest checkpoint (`ray.train.get_checkpoint()`);
- the trial itself fails, or the study driver dies and the study is resumed: Tune starts `a2_trial` again for
  the same trial id, the `TorchTrainer` finds its own run folder and snapshot, and again resumes from the latest
  checkpoint. No epoch is trained twice after its checkpoint was reported.

Compute accounting: every result carries `compute/wall_s` (the trial's wall time) and `compute/gpu_s` (wall time
x the trial's GPUs) or, on CPU, `compute/cpu_s` (user + system CPU seconds of its training processes, summed over
ranks, from `getrusage`), cumulative over the trial's epochs and restarts: the last value is what the trial cost.
Time spent after a trial's last reported epoch by an attempt that was then killed is not counted.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TRIALS_DIR = "trials"  # below the study's folder: one Ray Train run per trial
CHECKPOINT_FILE = "checkpoint.pt"  # a2core.checkpoint.CHECKPOINT_FILE (not imported: keeps this module light)
HISTORY_FILE = "history.json"  # a2core.checkpoint.HISTORY_FILE, likewise
CHECKPOINT_PREFIX = "checkpoint_epoch"  # + the epoch, 4 digits: one folder per checkpointed epoch
# Environment that Ray workers need to reach storage from any node of the cluster: settings and references
# (the credentials file, its profile), never a secret's value (launch.raycluster.stash_credentials).
PROPAGATED_ENV = ("AWS_SHARED_CREDENTIALS_FILE", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION",
                  "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MLFLOW_S3_ENDPOINT_URL", "A2_DATA_CACHE")


# -- storage -----------------------------------------------------------------------------------------------------
def train_run_name(study: str, trial_id: str) -> str:
    """The Ray Train run of a trial: the same on every retry and restore of that trial."""
    return f"{study}-{trial_id}"


# -- the plan a trial needs --------------------------------------------------------------------------------------
@dataclass
class TrialPlan:
    """Everything `a2_trial` needs besides the sampled config: plain values, cheap to ship with every trial."""

    study: str
    storage: str  # the study root (local folder or URI) holding `<study>/`
    storage_endpoint_url: str | None
    resolve: Callable[[dict], dict]  # sampled Tune config -> full a2core config dict
    resources: dict  # the spec's `resources` section, defaults filled in
    metric: str = "val/CIDEr"
    mode: str = "max"
    num_to_keep: int = 2

    def trials(self):
        """The study's `trials/` folder (a `dashboards.storage.Location`): one Ray Train run per trial."""
        from dashboards.storage import open_location

        return open_location(self.storage, self.storage_endpoint_url).join(self.study, TRIALS_DIR)

    def worker_resource_request(self) -> dict:
        res = {"CPU": float(self.resources["cpus_per_worker"])}
        if self.resources["gpus_per_worker"]:
            res["GPU"] = float(self.resources["gpus_per_worker"])
        return res


def plan_from_spec(spec) -> TrialPlan:
    """The trial plan of a `launch.spec.StudySpec`."""
    return TrialPlan(study=spec.name, storage=str(spec.storage), storage_endpoint_url=spec.storage_endpoint_url,
                     resolve=spec.trial_config, resources=dict(spec.resources), metric=spec.metric, mode=spec.mode)


# -- Train workers -----------------------------------------------------------------------------------------------
def _quiet_per_epoch_logs() -> None:
    """Ray Train and Tune log every report (all metrics, caption samples included) and every checkpoint at INFO,
    from every worker: several lines per epoch and worker on the driver's console. Our own epoch line stays
    (`a2core.train` logs one per `log_every` steps), and warnings still show.

    Only public names: Ray's documented library logger "ray.train", and the root logger, because the logger of
    Ray Train V2's report path is named after its source file and so sits outside "ray.train"
    (tests/test_search.py::test_quiet_trial_logs pins which loggers stay quiet)."""
    import logging

    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    logging.getLogger("a2core").setLevel(logging.INFO)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


ATTEMPT_CPU_KEY = "compute/attempt_cpu_s"  # worker -> trial driver: CPU seconds of this worker group, all ranks


def _cpu_seconds_all_ranks(since: float) -> float:
    """CPU seconds this process spent since `since`, summed over the ranks of the process group (a collective:
    every rank calls it with every report)."""
    import torch
    import torch.distributed as dist

    spent = cpu_seconds() - since
    if not (dist.is_available() and dist.is_initialized()):
        return spent
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    total = torch.tensor([spent], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total.item())


def worker_fn(config: dict) -> None:
    """The Ray Train loop of one worker: a2core's training with Ray's report, checkpoint and resume."""
    import ray.train
    from ray.train import Checkpoint

    from a2core.train import train

    cpu_start = cpu_seconds()
    _quiet_per_epoch_logs()
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    work = Path(tempfile.mkdtemp(prefix=f"a2-trial-r{rank}-"))

    def report(metrics: dict, checkpoint_dir: str | None) -> None:
        metrics = {**metrics, ATTEMPT_CPU_KEY: _cpu_seconds_all_ranks(cpu_start)}
        checkpoint = Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        # Every rank reports (a barrier); rank 0 alone brings the checkpoint, stored under a readable name.
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_name(metrics.get("epoch")))

    try:
        with ExitStack() as stack:
            resume_from = None
            checkpoint = ray.train.get_checkpoint()
            if checkpoint is not None:
                local = Path(stack.enter_context(checkpoint.as_directory()))
                if (local / CHECKPOINT_FILE).is_file():
                    resume_from = str(local / CHECKPOINT_FILE)
            train(config, report, output_dir=str(work / "out"), resume_from=resume_from)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def checkpoint_name(epoch) -> str | None:
    """`checkpoint_epochNNNN`: the folder of an epoch's checkpoint in a trial's run folder (both trial kinds)."""
    return f"{CHECKPOINT_PREFIX}{int(epoch):04d}" if isinstance(epoch, (int, float)) else None


# -- compute accounting ------------------------------------------------------------------------------------------
class ComputeMeter:
    """Stamps each result of one trial attempt with what the trial has cost so far (see the module docstring).

    `previous` is the trial's result log: what earlier attempts spent is the largest total logged there. Device
    seconds are GPU-seconds (wall x GPUs) when the trial holds GPUs, else CPU seconds of its workers, passed in
    per result as this attempt's own count (which restarts at 0 when Ray Train restarts the worker group)."""

    def __init__(self, previous: list[dict], gpus: float):
        self.gpus = float(gpus)
        self.device_key = "compute/gpu_s" if self.gpus else "compute/cpu_s"
        self.base_wall = max((float(r.get("compute/wall_s") or 0.0) for r in previous), default=0.0)
        self.base_device = max((float(r.get(self.device_key) or 0.0) for r in previous), default=0.0)
        self.start = time.monotonic()
        self.cpu_done = 0.0  # CPU seconds of earlier worker groups of this attempt
        self.cpu_last = 0.0

    def stamp(self, item: dict, attempt_cpu_s: float) -> None:
        if attempt_cpu_s < self.cpu_last:  # a new worker group counts from 0 again
            self.cpu_done += self.cpu_last
        self.cpu_last = attempt_cpu_s
        wall = time.monotonic() - self.start
        item["compute/wall_s"] = self.base_wall + wall
        spent = wall * self.gpus if self.gpus else self.cpu_done + attempt_cpu_s
        item[self.device_key] = self.base_device + spent


# -- one-worker trials: training in the Tune trial itself --------------------------------------------------------
class LocalCheckpoints:
    """The checkpoint folders of a one-worker trial's run folder (a Location), kept as Ray Train keeps them: the
    best `num_to_keep` by the study metric, plus the latest. A folder is complete when it has its
    `checkpoint.pt`: written last on S3, and a local folder is renamed into place whole."""

    def __init__(self, run, metric: str, mode: str, num_to_keep: int):
        self.run, self.metric, self.mode, self.num_to_keep = run, metric, mode, num_to_keep

    def complete_epochs(self) -> list[int]:
        names = self.run.listdir(folders_only=True)
        epochs = [int(n[len(CHECKPOINT_PREFIX):]) for n in names
                  if n.startswith(CHECKPOINT_PREFIX) and n[len(CHECKPOINT_PREFIX):].isdigit()]
        return sorted(e for e in epochs if self.run.join(checkpoint_name(e), CHECKPOINT_FILE).exists())

    def save(self, source: str, epoch: int) -> str:
        """Store the checkpoint folder `source` as epoch `epoch`'s; returns where it now is (path or URI)."""
        import pyarrow.fs as pafs

        target = self.run.join(checkpoint_name(epoch))
        fs, path = target.filesystem()
        if target.local:
            staging = Path(path).with_name(f".{Path(path).name}.partial")
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(source, staging)
            shutil.rmtree(path, ignore_errors=True)  # an epoch trained again after a restart
            os.replace(staging, path)
        else:
            names = sorted(p.name for p in Path(source).iterdir() if p.name != CHECKPOINT_FILE)
            for name in [*names, CHECKPOINT_FILE]:
                pafs.copy_files(str(Path(source) / name), f"{path}/{name}", destination_filesystem=fs)
        return target.uri

    def prune(self, values: dict[int, float]) -> None:
        """Delete the folders that are neither the latest nor among the best `num_to_keep` (`values`: epoch ->
        the study metric)."""
        epochs = self.complete_epochs()
        if len(epochs) <= self.num_to_keep:
            return
        scored = sorted((e for e in epochs if e in values), key=lambda e: (values[e], e),
                        reverse=self.mode == "max")
        keep = {epochs[-1], *scored[:self.num_to_keep]}
        for epoch in epochs:
            if epoch not in keep:
                fs, path = self.run.join(checkpoint_name(epoch)).filesystem()
                fs.delete_dir(path)


def a2_local_trial(config: dict, plan: "TrialPlan") -> None:
    """One study trial of one worker: `a2core.train.train` in this Tune trial process, each epoch's result
    reported with `ray.tune.report` (with a pointer checkpoint when the epoch was checkpointed, as `a2_trial`
    does); a restarted or restored trial resumes from its newest complete checkpoint."""
    import ray.tune

    from a2core.train import train

    cpu_start = cpu_seconds()
    _quiet_per_epoch_logs()
    trial_id = ray.tune.get_context().get_trial_id()
    train_config = plan.resolve(dict(config))
    run = plan.trials().join(train_run_name(plan.study, trial_id))
    result_log = ResultLog(run.join(RESULTS_FILE))
    result_log.add_missing(latest_checkpoint_history(run))
    meter = ComputeMeter(list(result_log.by_epoch.values()), plan.resources["gpus_per_worker"])
    checkpoints = LocalCheckpoints(run, plan.metric, plan.mode, plan.num_to_keep)
    work = Path(tempfile.mkdtemp(prefix="a2-trial-"))

    def report(metrics: dict, checkpoint_dir: str | None) -> None:
        item = dict(metrics)
        if checkpoint_dir is not None:
            item["checkpoint_path"] = checkpoints.save(checkpoint_dir, int(item["epoch"]))
        meter.stamp(item, cpu_seconds() - cpu_start)
        result_log.add(item)
        _report_to_tune(item)
        checkpoints.prune({e: r[plan.metric] for e, r in result_log.by_epoch.items()
                           if isinstance(r.get(plan.metric), (int, float))})

    try:
        epochs = checkpoints.complete_epochs()
        resume_from = None
        if epochs:
            resume_from = run.join(checkpoint_name(epochs[-1]), CHECKPOINT_FILE).download(work / CHECKPOINT_FILE)
        train(train_config, report, output_dir=str(work / "out"), resume_from=resume_from)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- the Tune driver function ------------------------------------------------------------------------------------
TUNE_POINTER_FILE = "train_checkpoint.json"
RESULTS_FILE = "results.json"  # in a trial's Train run folder: every epoch's result, across retries and restores


def _scalars(result: dict) -> dict:
    """The JSON-plain entries of a result (caption samples and nested dicts are left out of the log)."""
    return {k: v for k, v in result.items() if isinstance(v, (int, float, str, bool)) or v is None}


class ResultLog:
    """The results of one trial, kept next to its checkpoints and rewritten after every epoch.

    Tune's own result files are synced to storage only now and then, and a trial that Tune restarts keeps only
    what was synced; this log is written before Tune (and MLflow) hear of a result, so it holds every epoch a
    trial reported, whatever was restarted. An epoch reported again (after a restart) replaces its old entry."""

    def __init__(self, location):
        self.location = location
        text = location.read_text()
        self.by_epoch: dict[int, dict] = {}
        for item in json.loads(text) if text else []:
            if isinstance(item.get("epoch"), (int, float)):
                self.by_epoch[int(item["epoch"])] = item

    def add(self, result: dict) -> None:
        epoch = result.get("epoch")
        if not isinstance(epoch, (int, float)):
            return
        self.by_epoch[int(epoch)] = _scalars(result)
        self._write()

    def add_missing(self, results: list[dict]) -> list[int]:
        """Add the results of epochs the log does not have (what a checkpoint remembers); returns those epochs."""
        added = []
        for result in results:
            epoch = result.get("epoch")
            if isinstance(epoch, (int, float)) and int(epoch) not in self.by_epoch:
                self.by_epoch[int(epoch)] = _scalars(result)
                added.append(int(epoch))
        if added:
            self._write()
        return sorted(added)

    def _write(self) -> None:
        self.location.write_text(json.dumps([self.by_epoch[e] for e in sorted(self.by_epoch)], indent=1))


def latest_checkpoint_history(run) -> list[dict]:
    """The epoch history stored with the newest `checkpoint_epochNNNN` of a Train run folder (a Location; empty
    if none).

    A driver killed between Ray Train registering a checkpoint and Tune hearing of its result loses that result
    everywhere but here; the trial's result log (and from it MLflow) gets it back when the trial restarts."""
    prefix = CHECKPOINT_PREFIX
    names = run.listdir(folders_only=True)
    epochs = sorted(int(n[len(prefix):]) for n in names if n.startswith(prefix) and n[len(prefix):].isdigit())
    for epoch in reversed(epochs):  # the newest one that has its history (older checkpoints lack the file)
        text = run.join(f"{prefix}{epoch:04d}", HISTORY_FILE).read_text()
        if text:
            try:
                items = json.loads(text)
            except ValueError:
                continue
            return [item for item in items if isinstance(item, dict)]
    return []


def read_results(trials, study: str, trial_id: str) -> list[dict]:
    """The result log of a trial (see `ResultLog`) below the `trials` Location, oldest epoch first; empty when it
    has none yet."""
    text = trials.join(train_run_name(study, trial_id), RESULTS_FILE).read_text()
    return json.loads(text) if text else []


def _forwarder_class():
    from ray.train.v2.api.callback import UserCallback

    class ForwardToTrial(UserCallback):
        """Runs in the Train controller: hands rank 0's metrics (and its checkpoint's path) to the trial driver.

        Like Ray's `TuneReportCallback`, but through a queue the driver reads itself, so that the driver can give
        Tune a checkpoint of its own with every result (see `a2_trial`)."""

        def __init__(self, queue):
            self.queue = queue

        def after_report(self, run_context, metrics, checkpoint):
            item = dict(metrics[0])
            if checkpoint is not None:
                item["checkpoint_path"] = checkpoint.path
            self.queue.put(item)  # the queue holds one item: Train waits until Tune has taken the last one

    return ForwardToTrial


def _report_to_tune(item: dict) -> None:
    """Forward one epoch's result to Tune. A result with a Train checkpoint also gets a Tune checkpoint: a tiny
    folder that only points at the Train checkpoint. Tune then treats the trial as restorable: after a driver
    crash `Tuner.restore` keeps the trial's results so far, where a trial without a checkpoint would restart
    its result history from nothing. The weights stay where Ray Train put them."""
    import ray.tune

    path = item.get("checkpoint_path")
    if not path:
        ray.tune.report(item)
        return
    folder = Path(tempfile.mkdtemp(prefix="a2-tune-ckpt-"))
    try:
        (folder / TUNE_POINTER_FILE).write_text(json.dumps({"train_checkpoint": path, "epoch": item.get("epoch")}))
        ray.tune.report(item, checkpoint=ray.tune.Checkpoint.from_directory(str(folder)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def a2_trial(config: dict, plan: TrialPlan) -> None:
    """One study trial: run the trial's Ray Train job to the end (or resume it) and forward its results to Tune.

    `TorchTrainer.fit()` runs in a thread; this function's own thread reports what the Train controller
    forwards (one result per epoch) with `ray.tune.report`, then re-raises a failure of `fit()` so that Tune
    retries the trial under its FailureConfig.
    """
    import queue as stdlib_queue
    import threading

    import ray
    import ray.train
    import ray.tune
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Empty, Queue
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    _quiet_per_epoch_logs()
    trial_id = ray.tune.get_context().get_trial_id()
    train_config = plan.resolve(dict(config))
    trials = plan.trials()
    path, fs = trials.ray_storage()
    use_gpu = plan.resources["gpus_per_worker"] > 0
    # The queue lives and dies with this driver (same node), as the Train controller does.
    results = Queue(maxsize=1, actor_options={"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
        node_id=ray.get_runtime_context().get_node_id(), soft=False)})
    trainer = TorchTrainer(
        worker_fn,
        train_loop_config=train_config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=plan.resources["workers_per_trial"], use_gpu=use_gpu,
            resources_per_worker=plan.worker_resource_request()),
        run_config=ray.train.RunConfig(
            name=train_run_name(plan.study, trial_id),
            storage_path=path,
            storage_filesystem=fs,
            failure_config=ray.train.FailureConfig(max_failures=plan.resources["max_failures"]),
            # The latest checkpoint is always kept as well (resume point); the best by the study metric stays.
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=plan.num_to_keep, checkpoint_score_attribute=plan.metric,
                checkpoint_score_order=plan.mode),
            callbacks=[_forwarder_class()(results)],
        ),
    )
    run = trials.join(train_run_name(plan.study, trial_id))
    result_log = ResultLog(run.join(RESULTS_FILE))
    result_log.add_missing(latest_checkpoint_history(run))
    meter = ComputeMeter(list(result_log.by_epoch.values()),
                         plan.resources["workers_per_trial"] * plan.resources["gpus_per_worker"])
    outcome: dict = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as err:  # noqa: BLE001 - re-raised in the trial's thread below
            outcome["error"] = err

    runner = threading.Thread(target=fit, name=f"a2-train-{trial_id}", daemon=True)
    runner.start()
    while True:
        try:
            item = results.get(timeout=1.0)
        except (Empty, stdlib_queue.Empty):
            if runner.is_alive():
                continue
            try:  # fit() returned: its last result may still be in the queue
                item = results.get_nowait()
            except (Empty, stdlib_queue.Empty):
                break
        meter.stamp(item, float(item.pop(ATTEMPT_CPU_KEY, 0.0)))
        result_log.add(item)
        _report_to_tune(item)
    runner.join()
    ray.kill(results.actor)
    if "error" in outcome:
        raise outcome["error"]  # fit() failed for good: Tune retries the trial under its FailureConfig


def make_trainable(plan: TrialPlan, *, ray_train: bool = False):
    """The trial function bound to its plan and resource request, ready for `Tuner(...)` /
    `Tuner.restore(...)`: `a2_local_trial` holding one worker's resources for a one-worker trial, else
    `a2_trial` holding `driver_cpus` (its Train workers ask for their own). `ray_train` runs a one-worker trial
    on Ray Train too (benchmarks/bench_study.py compares the two)."""
    from ray import tune

    if plan.resources["workers_per_trial"] == 1 and not ray_train:
        return tune.with_resources(tune.with_parameters(a2_local_trial, plan=plan), plan.worker_resource_request())
    return tune.with_resources(tune.with_parameters(a2_trial, plan=plan), {"CPU": plan.resources["driver_cpus"]})


def propagated_env() -> dict:
    """Storage settings of this shell, for the Ray job's workers on every node: AWS keys of the environment are
    moved into a credentials file first, so only its path and profile travel (launch.raycluster)."""
    from launch.raycluster import stash_credentials

    stash_credentials()
    return {k: os.environ[k] for k in PROPAGATED_ENV if os.environ.get(k)}
