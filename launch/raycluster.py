"""Connecting to Ray: `connect()` joins the cluster at `address` / `RAY_ADDRESS` when there is one, else starts a
local Ray with this machine's CPUs. (tests/raycluster.py starts real multi-node clusters on one machine.)

Secrets go by reference, never by value. Ray Tune copies AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/... of the
driver's environment into every trial's runtime env, which Ray writes to its logs (ray-project/ray#28276). So
before Ray starts, `stash_credentials()` moves AWS keys found in the environment into a private shared-credentials
file (mode 0600 in a 0700 folder, profile `a2tune`) and leaves only AWS_SHARED_CREDENTIALS_FILE / AWS_PROFILE
behind, which boto3 and pyarrow read through their default credential chains. MLflow's secrets
(MLFLOW_TRACKING_PASSWORD / MLFLOW_TRACKING_TOKEN) are needed by the driver alone (trials never talk to MLflow): they
are kept out of the environment while Ray's processes start, and never given to a runtime env.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile

# Environment variable -> key of an AWS shared-credentials file (AWS_SECURITY_TOKEN: the old name of the token).
AWS_SECRETS = {"AWS_ACCESS_KEY_ID": "aws_access_key_id", "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
               "AWS_SESSION_TOKEN": "aws_session_token", "AWS_SECURITY_TOKEN": "aws_session_token"}
DRIVER_ONLY_SECRETS = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
AWS_PROFILE = "a2tune"


def stash_credentials() -> str | None:
    """Move the AWS keys of `os.environ` into a 0600 credentials file, profile `a2tune`, and point
    AWS_SHARED_CREDENTIALS_FILE / AWS_PROFILE at it. Returns the file (None: no keys in the environment). The file
    is removed when this process exits."""
    found = {var: os.environ.pop(var) for var in list(AWS_SECRETS) if os.environ.get(var)}
    if not found:
        return None
    entries: dict[str, str] = {}
    for var, value in found.items():
        entries.setdefault(AWS_SECRETS[var], value)  # AWS_SESSION_TOKEN wins over the old AWS_SECURITY_TOKEN
    folder = tempfile.mkdtemp(prefix="a2-credentials-")  # 0700
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = os.path.join(folder, "credentials")
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(f"[{AWS_PROFILE}]\n" + "".join(f"{key} = {value}\n" for key, value in entries.items()))
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = path
    os.environ["AWS_PROFILE"] = AWS_PROFILE
    os.environ.pop("AWS_DEFAULT_PROFILE", None)
    return path


@contextlib.contextmanager
def driver_only_secrets():
    """MLflow's secrets out of the environment while Ray's processes start (they inherit it), back afterwards."""
    held = {var: os.environ.pop(var) for var in DRIVER_ONLY_SECRETS if var in os.environ}
    try:
        yield
    finally:
        os.environ.update(held)


PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def connect(address: str | None = None, *, runtime_env_vars: dict | None = None) -> dict:
    """Join the Ray cluster at `address` / `$RAY_ADDRESS`, or start a local one. Returns cluster resources.

    Without an address this always starts a new local Ray (`address="local"`), never silently joins some other
    `ray start` cluster of the machine; `address="auto"` joins this machine's running cluster when there is one
    (Ray's own lookup), else starts a local Ray too. `runtime_env_vars` reach every worker of this job on every
    node (storage and tracking settings; never secrets: see `stash_credentials`, which runs first). A process that
    is connected already keeps its connection.
    """
    import ray

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
        # The dashboard stays on: Ray Train's placement-group cleaner asks the state API whether a trial's Train
        # controller is alive; without it, the placement group of a dead controller is never released.
        with _quiet_token_auth_notice():
            ray.init(address="local", num_cpus=os.cpu_count() or 1)
        return dict(ray.cluster_resources())


TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


def _not_the_token_notice(record) -> bool:
    return not record.getMessage().startswith(TOKEN_AUTH_NOTICE)


@contextlib.contextmanager
def _quiet_token_auth_notice():
    """A new local Ray turns token authentication on (the secure default) and logs a WARNING saying so on every
    run, with nothing to act on: that one notice is dropped while Ray starts, by a filter on the handlers of Ray's
    logger, which every Ray module's records pass through. (RAY_AUTH_MODE silences it in Ray itself, but only
    before `ray` is imported: Ray caches its config at import.)"""
    import logging

    handlers = logging.getLogger("ray").handlers if "RAY_AUTH_MODE" not in os.environ else []
    for handler in handlers:
        handler.addFilter(_not_the_token_notice)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(_not_the_token_notice)
