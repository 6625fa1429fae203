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

from tests.raycluster import REPO, a2_env, arrow_s3_compatible_moto  # noqa: F401 (a fixture)
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
    """The head account: name, home, and an ssh into it."""

    def __init__(self, name: str, key: Path, port: int):
        self.name, self.key, self.port = name, key, port
        self.home = Path(pwd.getpwnam(name).pw_dir)
        self.uid = pwd.getpwnam(name).pw_uid

    def ssh(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([_tool("ssh"), "-i", str(self.key), "-o", "StrictHostKeyChecking=no",
                               "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
                               "-o", f"ProxyCommand=nc 127.0.0.1 {self.port}", f"{self.name}@127.0.0.1",
                               command], capture_output=True, text=True, timeout=timeout)


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
        for key in ("host_key", "user_key"):
            subprocess.run([_tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
        _write_as(home, home / ".ssh" / "authorized_keys", (d / "user_key.pub").read_text(), uid, 0o600)
        # The "image": pip looks in the wheelhouse only (a mirror); S3 credentials by reference, in the account's
        # own AWS files, never in the environment Ray hands on.
        _write_as(home, home / ".config" / "pip" / "pip.conf",
                  f"[global]\nno-index = true\nfind-links = {wheelhouse()}\ndisable-pip-version-check = true\n"
                  "[install]\nno-compile = true\n", uid)
        _write_as(home, home / ".aws" / "credentials", "[default]\naws_access_key_id = testing\n"
                                                 "aws_secret_access_key = testing\n", uid, 0o600)
        _write_as(home, home / ".aws" / "config", "[default]\nregion = us-east-1\n", uid, 0o600)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        (d / "sshd_config").write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile .ssh/authorized_keys\n"
            f"PidFile {d / 'sshd.pid'}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            f"AllowUsers {name}\nStrictModes no\nUsePAM no\n")
        Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory sshd insists on
        # sshd and every session it starts see the HIDDEN folders empty: the account cannot read the checkout even
        # if its permissions would let it; and a /tmp/ray of their own, as another machine has (Ray's session folders)
        hide = "".join(f"mount -t tmpfs -o size=1m,mode=755 a2-hidden {folder} && " for folder in HIDDEN)
        proc = subprocess.Popen([_tool("unshare"), "--mount", "--propagation", "private", "sh", "-c",
                                 f"{hide}mkdir -p /tmp/ray && "
                                 f"mount -t tmpfs -o mode=1777 a2-head-ray /tmp/ray && exec {_tool('sshd')} -D "
                                 f"-f {d / 'sshd_config'} -E {d / 'sshd.log'}"], start_new_session=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(f"sshd did not start: {(d / 'sshd.log').read_text()[-2000:]}")
                time.sleep(0.2)
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


def cluster_file(tmp_path: Path, head: Head) -> Path:
    """ray-cluster.local.yaml as shipped, with the head's account, key and sshd filled in."""
    config = yaml.safe_load((REPO / "ray-cluster.local.yaml").read_text())
    config["cluster_name"] = f"a2tune-test-{os.getpid()}"
    config["auth"].update(ssh_user=head.name, ssh_private_key=str(head.key),
                          ssh_proxy_command=f"nc 127.0.0.1 {head.port}")
    assert config["file_mounts"] == {"~/a2tune": "."}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_ray_up_submit_down_on_a_head_that_shares_nothing(tmp_path, head_account, s3_endpoint,
                                                           arrow_s3_compatible_moto):
    head = head_account
    started = time.monotonic()
    # The account cannot read the checkout nor this machine's Python, and has no a2tune before `ray up`.
    probe = head.ssh(f"test -r {REPO / 'pyproject.toml'} && echo CHECKOUT; ls /root >/dev/null 2>&1 && echo ROOT; "
                     "python3 -c 'import a2core' 2>/dev/null && echo A2CORE; echo HOME=$HOME")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == [f"HOME={head.home}"], probe.stdout
    bucket = unique_bucket(s3_endpoint, "a2-cluster")
    storage = f"s3://{bucket}/a2-studies"
    config = cluster_file(tmp_path, head)
    env = a2_env({k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
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
        assert (head.home / ".ray" / "auth_token").is_file()
        out = _ray(["submit", "--no-config-cache", str(config), "launch/commands/submit.py", "--",
                    "studies/smoke.yaml", "--quiet", *overrides], env, timeout=600)
    finally:
        down = subprocess.run([_tool("ray"), "down", "-y", str(config)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert down.returncode == 0, down.stdout[-4000:]
    assert not [p for p in _account_pids(head.uid) if _is_ray(p)], "ray down left the head's Ray running"
    print(f"cluster test: ray up {up_s:.0f}s, all {time.monotonic() - started:.0f}s")

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
    # the study's relative data path meant the head's copy of the repository
    assert list((head.home / "a2tune" / "data" / "synth-60").rglob("dataset_coco.json"))
    with sqlite3.connect(head.home / "mlflow.db") as db:
        runs = db.execute("SELECT run_uuid, status FROM runs").fetchall()
    assert len(runs) == 2 and {status for _, status in runs} == {"FINISHED"}  # the study's run and its trial's


def _is_ray(pid: int) -> bool:
    try:
        return any(n in Path(f"/proc/{pid}/cmdline").read_bytes() for n in (b"raylet", b"gcs_server"))
    except OSError:
        return False
