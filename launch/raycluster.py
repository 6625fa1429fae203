"""Joining or starting Ray (`connect`), with secrets passed by reference, never by value: Ray Tune copies the
driver's AWS_* variables into every trial's runtime env, which Ray logs (ray-project/ray#28276), so AWS keys move
into a 0600 credentials file first; MLflow's secrets stay with the driver (trials never talk to MLflow).
"""
from __future__ import annotations

import atexit
import contextlib
import glob
import logging
import math
import os
import signal
import shutil
import tempfile

import ray
import yaml
from ray._private import worker as ray_worker  # `shutdown` only: Ray's handle on a local Ray's processes

# Environment variable -> key of an AWS shared-credentials file (AWS_SECURITY_TOKEN: the old name of the token).
AWS_SECRETS = {"AWS_ACCESS_KEY_ID": "aws_access_key_id", "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
               "AWS_SESSION_TOKEN": "aws_session_token", "AWS_SECURITY_TOKEN": "aws_session_token"}
DRIVER_ONLY_SECRETS = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
AWS_PROFILE = "a2tune"
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # Ray Train's node-drain watcher, off (`connect`)


def stash_credentials() -> str | None:
    """Move the AWS keys of `os.environ` into a 0600 credentials file (profile `a2tune`, removed at exit) that
    AWS_SHARED_CREDENTIALS_FILE / AWS_PROFILE point at; returns the file, None without keys."""
    found = {var: os.environ.pop(var) for var in list(AWS_SECRETS) if os.environ.get(var)}
    if not found:
        return None
    entries: dict[str, str] = {}
    for var, value in found.items():
        entries.setdefault(AWS_SECRETS[var], value)  # AWS_SESSION_TOKEN wins over the old AWS_SECURITY_TOKEN
    remove_orphaned_credentials()
    folder = tempfile.mkdtemp(prefix=f"{CREDENTIALS_PREFIX}{os.getpid()}-")  # 0700
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = os.path.join(folder, "credentials")
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(f"[{AWS_PROFILE}]\n" + "".join(f"{key} = {value}\n" for key, value in entries.items()))
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = path
    os.environ["AWS_PROFILE"] = AWS_PROFILE
    os.environ.pop("AWS_DEFAULT_PROFILE", None)
    return path


CREDENTIALS_PREFIX = "a2-credentials-"  # + the driver's pid: a folder in the temp folder (`stash_credentials`)


def remove_orphaned_credentials() -> list[str]:
    """Remove the credentials folders of drivers that ended without their exit handler (SIGKILL, a power cut): every
    `a2-credentials-<pid>-*` of this user in the temp folder whose process is gone. Returns the folders removed."""
    removed = []
    with contextlib.suppress(OSError), os.scandir(tempfile.gettempdir()) as entries:
        for entry in entries:
            pid = entry.name[len(CREDENTIALS_PREFIX):].split("-", 1)[0]
            if (entry.name.startswith(CREDENTIALS_PREFIX) and pid.isdigit() and not alive(int(pid))
                    and entry.is_dir(follow_symlinks=False) and entry.stat().st_uid == os.getuid()):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


@contextlib.contextmanager
def driver_only_secrets():
    """MLflow's secrets out of the environment while Ray's processes start (they inherit it), back afterwards."""
    held = {var: os.environ.pop(var) for var in DRIVER_ONLY_SECRETS if var in os.environ}
    try:
        yield
    finally:
        os.environ.update(held)


def connect(address: str | None = None, *, runtime_env_vars: dict | None = None, dashboard: bool = True) -> dict:
    """Join the Ray cluster at `address` / `$RAY_ADDRESS` ("auto": this machine's, if any), else start a new
    local Ray (never silently some other cluster of the machine); returns the cluster's resources.
    `runtime_env_vars` reach every worker of this job (never secrets). A connected process stays connected.
    `dashboard`: whether a local Ray started here has its dashboard (a cluster joined keeps what it has)."""
    if ray.is_initialized():
        return dict(ray.cluster_resources())
    stash_credentials()
    # Ray Train starts a node-drain watcher actor with every worker group and force-kills it when the group stops,
    # which Ray's core worker logs at ERROR level ("actor restart will fail") for every trial. The watcher only
    # reports drains to `ray.train.get_preemption_info`, which a2 does not use: off, unless the user sets it.
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
    runtime_env_vars = {PREEMPTION_WATCHER_ENV: os.environ[PREEMPTION_WATCHER_ENV], **(runtime_env_vars or {})}
    address = address or os.environ.get("RAY_ADDRESS") or None
    with driver_only_secrets():
        if address:
            # A script run by `ray job submit` has its job's runtime env (working_dir, ...); leave it alone there.
            job_env = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
            try:
                ray.init(address=address, runtime_env=None if job_env else {"env_vars": runtime_env_vars})
                return dict(ray.cluster_resources())
            except ConnectionError:
                if address != "auto":
                    raise
                # no cluster is running here: a local Ray, as without an address
        # The dashboard is on where Ray Train runs: its placement-group cleaner asks the state API whether a trial's
        # Train controller is alive; without it, the placement group of a dead controller is never released. Off,
        # a local Ray answers its first task about a second sooner (benchmarks/bench_ray_start.py).
        with _quiet_token_auth_notice(), _sigterm_blocked():
            ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=dashboard)
        atexit.register(shutdown)  # before Ray's own exit hook (atexit runs last-registered first)
        return dict(ray.cluster_resources())


# `ray up` leaves the cluster file, as its autoscaler reads it, in the head's home (`ray start --head
# --autoscaling-config=~/ray_bootstrap_config.yaml`); a driver started by `ray submit` or `ray job submit` runs there.
AUTOSCALING_CONFIG = "~/ray_bootstrap_config.yaml"


def autoscaler_limits(path: str = AUTOSCALING_CONFIG) -> dict | None:
    """What the autoscaler of the cluster this head runs may add to it, by resource: each worker node type's declared
    resources x its max_workers (at most the file's max_workers), summed. A resource a node type leaves undeclared
    (the local provider's: Ray detects a node's CPUs and GPUs when it joins) is math.inf. None: no autoscaler
    config here (a cluster started by hand, a local Ray, a laptop), or one that cannot be read."""
    try:
        with open(os.path.expanduser(path)) as f:
            config = yaml.safe_load(f)
        types = config["available_node_types"]
        cap = config.get("max_workers")
        cap = 1 << 30 if cap is None else int(cap)  # no global cap: each node type's own
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None
    head = config.get("head_node_type")
    limits: dict[str, float] = {"CPU": 0.0, "GPU": 0.0}
    for name, node_type in (types or {}).items():
        most = min(int(node_type.get("max_workers", 0 if name == head else cap) or 0), cap)
        if most <= 0:
            continue
        declared = node_type.get("resources") or {}
        for kind in limits:
            limits[kind] += most * float(declared[kind]) if kind in declared else math.inf
    return limits


def shutdown() -> None:
    """Disconnect this process from Ray; a local Ray it started (`connect`) stops at once. Its processes were started
    with SIGTERM blocked (`_sigterm_blocked`), so `ray.shutdown`'s graceful stop (SIGTERM, a second's wait, then
    SIGKILL, for each of the raylet, GCS, monitor and log monitor in turn) would wait out four seconds at the end of
    every local study. They get that SIGKILL at once instead, and so do the processes below them (the raylet's agents
    and idle workers, which the waits gave time to notice the raylet's end and exit). Ray's private names used here
    (`ray._private.worker._global_node`, its `all_processes`, `kill_all_processes`, `destroy_external_storage`) are
    held against the installed release by tests/test_adapters.py."""
    node = ray_worker._global_node
    if node is None or not node.is_head() or not os.path.isdir("/proc/self/task"):
        ray.shutdown()  # a cluster it joined (a disconnect is all there is), or no /proc to find the processes by
        return
    below = [pid for infos in node.all_processes.values() for info in infos for pid in descendants(info.process.pid)]
    node.destroy_external_storage()  # what `ray.shutdown` does first for a head it started (spilled objects)
    ray_worker._global_node = None  # `ray.shutdown` now disconnects only ...
    try:
        ray.shutdown()
    finally:
        node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)  # ... and this stops the rest
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether process `pid` has not ended (a zombie, ended but not yet reaped, has), from Linux's /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from Linux's /proc/PID/task/TID/children (none found where it cannot be read)."""
    found, todo = [], [pid]
    while todo:
        for children in glob.glob(f"/proc/{todo.pop()}/task/*/children"):
            try:
                with open(children) as f:
                    pids = [int(p) for p in f.read().split()]
            except OSError:  # the process ended meanwhile
                continue
            found += pids
            todo += pids
    return found


@contextlib.contextmanager
def _sigterm_blocked():
    """SIGTERM blocked while a local Ray starts, as Ray blocks SIGINT: its processes (GCS, raylet, which share the
    driver's process group) inherit the mask, so a SIGTERM to the group stops the study through the driver
    (`launch.stop`) instead of pulling the cluster from under it. The driver ends them at its exit."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextlib.contextmanager
def _quiet_token_auth_notice():
    """Drop, while Ray starts, the WARNING that a new local Ray uses token authentication (nothing to act on), by
    a filter on the handlers of Ray's logger (RAY_AUTH_MODE would silence it only before `ray` is imported)."""
    def not_the_token_notice(record) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")

    handlers = logging.getLogger("ray").handlers if "RAY_AUTH_MODE" not in os.environ else []
    for handler in handlers:
        handler.addFilter(not_the_token_notice)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(not_the_token_notice)
