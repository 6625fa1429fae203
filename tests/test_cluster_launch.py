"""The launch path the docs promise, on a head that shares nothing with the launching account.

`ray up` / `ray submit` / `ray down` with the shipped ray-cluster.local.yaml, the head being another Linux account on
127.0.0.1 (made here with useradd, removed afterwards), reached over an sshd this test starts. That account:

- has a home of its own, and cannot read this checkout nor this machine's Python (the sshd runs in a mount namespace
  where /work is an empty tmpfs, and /root, where the Python lives, is private): the test asserts both;
- gets its Python environment only from the cluster file's own `setup_commands` (a venv built from the tree `ray up`
  synced to its ~/a2tune), with pip pointed at a shared read-only wheelhouse of this machine's versions
  (tests/wheelhouse.py), as a node's image would point it at a mirror: no network, torch stays the CPU build;
- reaches the bucket, moto's S3 server on 127.0.0.1, with credentials in its ~/.aws/credentials, as
  docs/how-to/cluster.md tells a team to provide them.

The cluster has a worker machine too, as the file's `worker_ips` give one: the same account (one `ssh_user` for
every node, as on AWS) behind its own sshd on 127.0.0.2, in a mount namespace where a folder of its own is the
account's home and /tmp/ray is its own, so it shares no file with the head or the launching account. The head's
autoscaler sets it up from what `ray up` sent the head (the tree, the cluster's token), the file's setup commands
build its environment there, and the trial runs on it: the head offers no CPUs (the AWS head has no GPU). The driver
starts before the worker has joined (its setup installs an environment: about a minute), so it finds a cluster
without the trial's resources; the autoscaler's config says the worker brings them, and the driver waits for it.

The study is submitted with the relative path of the docs (`studies/smoke.yaml`, its data path relative too), checked
from the launching account through S3 (`a2 study status`), and its checkpoints say which a2core trained them: the one
under the head account's ~/a2tune. `ray down` runs `ray stop` as that account, which cannot stop anyone else's Ray.
Like every cluster test it runs under the Ray lock (RULES: `flock /tmp/a2-ray.lock`).
"""
from __future__ import annotations

import io
import json
import os
import pwd
import shutil
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.raycluster import REPO, a2_env, arrow_s3_compatible_moto, free_port  # noqa: F401 (a fixture)
from tests.s3server import s3_client, unique_bucket
from tests.wheelhouse import wheelhouse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TOOLS = ("sshd", "ssh", "ssh-keygen", "rsync", "nc", "ray", "useradd", "userdel", "unshare")
# What the head account's sessions see as empty tmpfs: the checkout wherever it was cloned (CI clones outside
# /work, where its permissions let any account read it) and /work, where this machine keeps its other copies.
HIDDEN = ["/work"] if REPO.is_relative_to("/work") else [str(REPO)] + (["/work"] if Path("/work").is_dir() else [])


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def _account_pids(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def _kill_account(uid: int) -> None:
    """Every process of the account this test made (by id: nobody else runs as it)."""
    for _ in range(50):
        pids = _account_pids(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)


class Head:
    """The head account: name, home, and an ssh into it (or into a worker node's sshd at `address`)."""

    def __init__(self, name: str, key: Path, port: int):
        self.name, self.key, self.port = name, key, port
        self.home = Path(pwd.getpwnam(name).pw_dir)
        self.uid = pwd.getpwnam(name).pw_uid

    def ssh(self, command: str, timeout: float = 120, address: str = "127.0.0.1",
            port: int | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([_tool("ssh"), "-i", str(self.key), "-o", "StrictHostKeyChecking=no",
                               "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
                               "-o", f"ProxyCommand=nc {address} {port or self.port}", f"{self.name}@{address}",
                               command], capture_output=True, text=True, timeout=timeout)


class Worker:
    """A worker machine of the head's cluster: the head's account (one ssh_user for every node, as on AWS) behind its
    own sshd on `address`, port 22, whose sessions see `home` (a folder of this machine) as the account's home."""

    port = 22  # the head's autoscaler reaches a worker on SSH's port: the config it gets from `ray up` has no proxy

    def __init__(self, address: str, home: Path):
        self.address, self.home = address, home


def _node_image(home: Path, head_home: Path, uid: int, public_key: str) -> None:
    """What a node's image gives the account before `ray up`: its key, pip pointed at the wheelhouse (a mirror),
    S3 credentials by reference in its own AWS files, never in the environment Ray hands on. `head_home`: the
    account's home as the node's sessions see it (`_write_as` walks the folders below `home`)."""
    _write_as(home, home / ".ssh" / "authorized_keys", public_key, uid, 0o600)
    _write_as(home, home / ".config" / "pip" / "pip.conf",
              f"[global]\nno-index = true\nfind-links = {wheelhouse()}\ndisable-pip-version-check = true\n"
              # no bytecode for the ~19,000 modules installed (65 of the 108 s a node's `pip install -e ~/a2tune`
              # took): `compile = false`, pip's key for that; `no-compile = true` turned it on (pip reads a
              # store_false option's config value as the option's own value, so "true" meant compile)
              "[install]\ncompile = false\n", uid)
    _write_as(home, home / ".aws" / "credentials", "[default]\naws_access_key_id = testing\n"
                                             "aws_secret_access_key = testing\n", uid, 0o600)
    _write_as(home, home / ".aws" / "config", "[default]\nregion = us-east-1\n", uid, 0o600)


def _node_sshd(d: Path, name: str, address: str, port: int, home_over: tuple[Path, Path] | None = None):
    """An sshd for the account on `address`:`port` in a mount namespace of its own: the HIDDEN folders empty (the
    account cannot read the checkout even if its permissions would let it), a /tmp/ray of its own as another machine
    has (Ray's session folders), and with `home_over` (folder, home) the folder mounted over the account's home (a
    worker machine's own home). Returns the sshd's process once it answers."""
    d.mkdir(exist_ok=True)
    if not (d / "host_key").exists():
        subprocess.run([_tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key")], check=True)
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress {address}\nHostKey {d / 'host_key'}\nAuthorizedKeysFile .ssh/authorized_keys\n"
        f"PidFile {d / 'sshd.pid'}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        f"AllowUsers {name}\nStrictModes no\nUsePAM no\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory sshd insists on
    hide = "".join(f"mount -t tmpfs -o size=1m,mode=755 a2-hidden {folder} && " for folder in HIDDEN)
    home = f"mount --bind {home_over[0]} {home_over[1]} && " if home_over else ""
    proc = subprocess.Popen([_tool("unshare"), "--mount", "--propagation", "private", "sh", "-c",
                             f"{hide}{home}mkdir -p /tmp/ray && "
                             f"mount -t tmpfs -o mode=1777 a2-node-ray /tmp/ray && exec {_tool('sshd')} -D "
                             f"-f {d / 'sshd_config'} -E {d / 'sshd.log'}"], start_new_session=True)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"sshd did not start: {(d / 'sshd.log').read_text()[-2000:]}")
            time.sleep(0.2)
    pytest.fail(f"sshd on {address}:{port} did not answer in 15 s")


def _write_as(home: Path, path: Path, text: str, uid: int, mode: int = 0o644) -> None:
    """A file of the account's home, it and the folders made for it owned by the account."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    for p in [path, *path.relative_to(home).parents]:
        os.chown(home / p, uid, uid)


@pytest.fixture
def head_account(tmp_path, s3_endpoint):
    """A Linux account for the head, its sshd on 127.0.0.1 in a mount namespace without the checkout. Yields Head."""
    missing = [t for t in TOOLS if not _tool(t)]
    if missing or os.geteuid() != 0:
        pytest.skip(f"needs root and {', '.join(missing) or 'nothing else'} (scripts/setup.sh installs "
                    "openssh-server, rsync and netcat-openbsd when run as root)")
    name = f"a2head{os.getpid()}"[:32]
    # password "*": no password login, but not a locked account (sshd without PAM refuses locked ones, "!")
    subprocess.run([_tool("useradd"), "--create-home", "--shell", "/bin/bash", "--password", "*", name], check=True)
    user = pwd.getpwnam(name)
    home, uid = Path(user.pw_dir), user.pw_uid
    proc = None
    try:
        d = tmp_path / "ssh"
        d.mkdir()
        subprocess.run([_tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(d / "user_key")], check=True)
        _node_image(home, home, uid, (d / "user_key.pub").read_text())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = _node_sshd(d, name, "127.0.0.1", port)
        yield Head(name, d / "user_key", port)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        _kill_account(uid)
        subprocess.run([_tool("userdel"), "--remove", name], stderr=subprocess.DEVNULL)


def _ray(args: list[str], env: dict, timeout: float = 600) -> str:
    run = subprocess.run([_tool("ray"), *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=timeout)
    assert run.returncode == 0, f"ray {' '.join(args[:2])} failed:\n{run.stdout[-6000:]}"
    return run.stdout


def cluster_token(tmp_path: Path, env: dict) -> Path:
    """The cluster's token as the file's header makes it (`ray get-auth-token --generate` on the launching machine),
    in a home of the test's own so that the launching account's ~/.ray is left alone."""
    home = tmp_path / "laptop-home"
    home.mkdir()
    run = subprocess.run([_tool("ray"), "get-auth-token", "--generate"], env={**env, "HOME": str(home)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return home / ".ray" / "auth_token"


def cluster_file(tmp_path: Path, head: Head, token: Path, worker: Worker | None = None) -> Path:
    """ray-cluster.local.yaml as shipped, with the head's account, key and sshd filled in, the token's source, and
    a worker machine's address. What one machine standing in for two needs besides: the worker's Ray starts on
    127.0.0.2 with ports of its own (two machines would each have Ray's defaults). The head offers no CPUs, so the trials run on the worker: the AWS head has no GPU either."""
    config = yaml.safe_load((REPO / "ray-cluster.local.yaml").read_text())
    config["cluster_name"] = f"a2tune-test-{os.getpid()}"
    config["auth"].update(ssh_user=head.name, ssh_private_key=str(head.key),
                          ssh_proxy_command=f"nc 127.0.0.1 {head.port}")  # `ray up`'s way to the head
    assert config["file_mounts"] == {"~/a2tune": ".", "~/.ray/auth_token": "~/.ray/auth_token"}
    config["file_mounts"]["~/.ray/auth_token"] = str(token)
    if worker is not None:
        config["provider"]["worker_ips"] = [worker.address]
        [head_start] = config["head_start_ray_commands"]
        config["head_start_ray_commands"] = [head_start + " --num-cpus=0"]
        [worker_start] = config["worker_start_ray_commands"]
        ports = " ".join(f"{flag}={free_port()}" for flag in (
            "--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"))
        config["worker_start_ray_commands"] = [f"{worker_start} --node-ip-address={worker.address} {ports}"]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def worker_node(head_account, tmp_path):
    """The head account's second machine: its sshd on 127.0.0.2:22, where the account's home is a folder of its own,
    made as the head's image makes it (`_node_image`). Yields Worker."""
    head = head_account
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.2", Worker.port)) == 0:
            pytest.skip("port 22 of 127.0.0.2 is taken (an SSH server of this machine listening on every address): "
                        "the worker machine's sshd needs it")
    home = Path(f"{head.home}-node2")
    home.mkdir(mode=0o750)
    os.chown(home, head.uid, head.uid)
    proc = None
    try:
        _node_image(home, home, head.uid, Path(f"{head.key}.pub").read_text())
        (home / "machine").write_text("worker\n")
        proc = _node_sshd(tmp_path / "ssh-node2", head.name, "127.0.0.2", Worker.port, home_over=(home, head.home))
        yield Worker("127.0.0.2", home)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        _kill_account(head.uid)
        shutil.rmtree(home, ignore_errors=True)


def test_ray_up_submit_down_on_a_head_that_shares_nothing(tmp_path, head_account, worker_node, s3_endpoint,
                                                           arrow_s3_compatible_moto):
    head, worker = head_account, worker_node
    started = time.monotonic()
    # Neither machine's account can read the checkout nor this machine's Python, and neither has a2tune before
    # `ray up`; the worker's sessions see a home of their own under the same path, as another machine's.
    for address, port, machine in (("127.0.0.1", head.port, ""), (worker.address, worker.port, "worker")):
        probe = head.ssh(f"test -r {REPO / 'pyproject.toml'} && echo CHECKOUT; ls /root >/dev/null 2>&1 && echo ROOT; "
                         "python3 -c 'import a2core' 2>/dev/null && echo A2CORE; echo HOME=$HOME; "
                         "cat ~/machine 2>/dev/null; true", address=address, port=port)
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.split() == [f"HOME={head.home}", *filter(None, [machine])], probe.stdout
    bucket = unique_bucket(s3_endpoint, "a2-cluster")
    storage = f"s3://{bucket}/a2-studies"
    env = a2_env({k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
    token = cluster_token(tmp_path, env)
    config = cluster_file(tmp_path, head, token, worker)
    overrides = ["data.root=data/synth-60", "data.images=60", "data.val_images=10",  # relative: in ~/a2tune
                 "model.d_model=32", "model.layers=1", "model.heads=2", "model.d_ff=64", "model.max_regions=8",
                 "train.xe_epochs=2", "search.num_samples=1", "search.space.fusion.grid=[gate]",
                 "search.replicates=[0]", "search.scheduler={fifo:{}}",  # no spaces: ray submit splits on them
                 "resources.workers_per_trial=1", f"storage={storage}", f"storage_endpoint_url={s3_endpoint}",
                 f"tracking.mlflow_uri=sqlite:///{head.home / 'mlflow.db'}"]
    try:
        _ray(["up", "-y", "--no-config-cache", str(config)], env)
        up_s = time.monotonic() - started
        # as Ray runs a command there: an interactive login shell, so ~/.bashrc puts the setup's venv first
        where = head.ssh("bash --login -i -c \"python -c 'import a2core, sys; print(a2core.__file__, sys.prefix)'\" "
                         "2>/dev/null")
        a2core_file, prefix = where.stdout.split()[-2:]
        assert Path(a2core_file).is_relative_to(head.home / "a2tune"), where.stdout
        assert Path(prefix).is_relative_to(head.home), where.stdout  # the venv the setup commands built
        assert (head.home / ".ray" / "auth_token").read_text() == token.read_text()  # the file mount's
        out = _ray(["submit", "--no-config-cache", str(config), "launch/commands/submit.py", "--",
                    "studies/smoke.yaml", "--quiet", *overrides], env, timeout=600)
        # the head alone has no CPU for the trial: the driver waits for the worker the autoscaler adds
        assert ("the cluster has 0 now and its autoscaler can add nodes whose resources Ray detects when they join: "
                "trials wait for the worker nodes it starts") in out, out[-3000:]
    finally:
        down = subprocess.run([_tool("ray"), "down", "-y", str(config)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert down.returncode == 0, down.stdout[-4000:]
    # `ray down` runs `ray stop` on the head, which here stops the worker's Ray too (the same account on the same
    # machine); on two machines the worker's raylet exits once it has lost the head for a minute (the file says so)
    down_at = time.monotonic()
    while [p for p in _account_pids(head.uid) if _is_ray(p)] and time.monotonic() - down_at < 180:
        time.sleep(2)
    assert not [p for p in _account_pids(head.uid) if _is_ray(p)], "a Ray of the cluster outlived ray down"
    print(f"cluster test: ray up {up_s:.0f}s, all {time.monotonic() - started:.0f}s")
    # The worker built itself from what the head's autoscaler sent: the tree, the token, its own environment by the
    # file's setup commands; and the trial ran there (the head offers no CPUs): its synthetic data were made in the
    # worker's copy of the repository, which the study's relative data path meant there.
    assert (worker.home / ".ray" / "auth_token").read_text() == token.read_text()
    assert (worker.home / "a2tune" / "pyproject.toml").is_file() and (worker.home / "a2tune-venv" / "bin").is_dir()
    assert list((worker.home / "a2tune" / "data" / "synth-60").rglob("dataset_coco.json"))

    # The launching account reads the study through S3, as a team does from a laptop.
    s3_env = {**env, "AWS_ENDPOINT_URL": s3_endpoint}
    status = subprocess.run(["a2", "study", "status", "a2-smoke", "--storage", storage], env=s3_env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert status.returncode == 0, status.stderr[-3000:]
    assert "a2-smoke" in status.stdout, status.stdout[-3000:]
    s3 = s3_client(s3_endpoint)
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="a2-studies/")
            for o in page.get("Contents", [])]
    summary = json.loads(s3.get_object(Bucket=bucket, Key="a2-studies/a2-smoke/summary.json")["Body"].read())
    assert summary["complete"], (summary, out[-2000:])
    [trial] = summary["trials"]
    assert trial["state"] == "TERMINATED" and trial["epochs_reported"] == [1, 2]
    checkpoints = [k for k in keys if k.endswith("checkpoint.pt")]
    assert checkpoints, keys[:40]
    for key in checkpoints:  # the trial ran the head account's copy, installed by the setup commands
        state = torch.load(io.BytesIO(s3.get_object(Bucket=bucket, Key=key)["Body"].read()), map_location="cpu",
                           weights_only=True)
        assert Path(state["code"]["a2core"]).is_relative_to(head.home / "a2tune"), state["code"]
    with sqlite3.connect(head.home / "mlflow.db") as db:
        runs = db.execute("SELECT run_uuid, status FROM runs").fetchall()
    assert len(runs) == 2 and {status for _, status in runs} == {"FINISHED"}  # the study's run and its trial's


def _is_ray(pid: int) -> bool:
    try:
        return any(n in Path(f"/proc/{pid}/cmdline").read_bytes() for n in (b"raylet", b"gcs_server"))
    except OSError:
        return False
