"""Connecting to Ray: `connect()` joins the cluster at `address` / `RAY_ADDRESS` when there is one, else starts a
local Ray with this machine's CPUs. (tests/raycluster.py starts real multi-node clusters on one machine.)
"""
from __future__ import annotations

import contextlib
import os


PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def connect(address: str | None = None, *, num_cpus: int | None = None, log_to_driver: bool = True,
            quiet: bool = False, runtime_env_vars: dict | None = None) -> dict:
    """Join the Ray cluster at `address` / `$RAY_ADDRESS`, or start a local one. Returns cluster resources.

    Without an address this always starts a new local Ray (`address="local"`), never silently joins some other
    `ray start` cluster of the machine; `address="auto"` joins this machine's running cluster when there is one
    (Ray's own lookup), else starts a local Ray too. `runtime_env_vars` reach every worker of this job on every
    node (storage and tracking credentials). A process that is connected already keeps its connection.
    """
    import ray

    if ray.is_initialized():
        return dict(ray.cluster_resources())
    # Ray Train starts a node-drain watcher actor with every worker group and force-kills it when the group stops,
    # which Ray's core worker logs at ERROR level ("actor restart will fail") for every trial. The watcher only
    # reports drains to `ray.train.get_preemption_info`, which a2 does not use: off, unless the user sets it.
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
    runtime_env_vars = {PREEMPTION_WATCHER_ENV: os.environ[PREEMPTION_WATCHER_ENV], **(runtime_env_vars or {})}
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict = dict(log_to_driver=log_to_driver)
    if quiet:
        import logging

        kwargs["logging_level"] = logging.WARNING
    # A script run by `ray job submit` has its job's runtime env (working_dir, ...); leave it alone there.
    if runtime_env_vars and address and not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        kwargs["runtime_env"] = {"env_vars": dict(runtime_env_vars)}
    if address:
        try:
            ray.init(address=address, **kwargs)
            return dict(ray.cluster_resources())
        except ConnectionError:
            if address != "auto":
                raise
            kwargs.pop("runtime_env", None)  # no cluster is running here: a local Ray, as without an address
    # The dashboard stays on: Ray Train's placement-group cleaner asks the state API whether a trial's Train
    # controller is alive; without it, the placement group of a dead controller is never released.
    with _quiet_token_auth_notice():
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, **kwargs)
    return dict(ray.cluster_resources())


@contextlib.contextmanager
def _quiet_token_auth_notice():
    """A new local Ray turns token authentication on (the secure default) and logs a WARNING saying so on every
    run; there is nothing to act on, so that one notice is held back while it starts. (Setting RAY_AUTH_MODE
    silences it in Ray itself, but only before `ray` is imported: Ray caches its config at import.)"""
    import logging

    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = notice.level
    if "RAY_AUTH_MODE" not in os.environ:
        notice.setLevel(logging.ERROR)
    try:
        yield
    finally:
        notice.setLevel(level)
