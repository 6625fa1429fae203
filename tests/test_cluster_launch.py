"""The launch path the README promises: `ray up` / `ray submit` / `ray down` with ray-cluster.local.yaml.

An SSH server started by the test on 127.0.0.1 (a free port, a throwaway key, reached through the config's
`ssh_proxy_command`) stands in for the head machine; everything else is the shipped config and the real Ray CLI.
The head is a machine of its own as far as Python goes: its sessions get a home of their own (sshd's SetEnv HOME),
whose ~/.bashrc puts a fresh venv first on PATH. That venv reaches this machine's third-party packages through a
plain path entry and has nothing of this checkout (tests/test_cluster_sync.py), so the shipped setup_commands
must install the copy `ray up` synced to ~/a2tune, and the trials run that copy: a file the sync drops fails here.
`ray down` runs `ray stop` on the head, which stops every Ray of this user on the machine: like every cluster test,
this one must not run beside another Ray.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.raycluster import REPO, a2_env
from tests.test_cluster_sync import node_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOOLS = ("sshd", "ssh", "ssh-keygen", "rsync", "nc", "ray")


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


def head_home(root: Path) -> Path:
    """The head's home: a ~/.bashrc that puts a fresh venv (with a `ray` command, as Ray's images have one) first."""
    home = root / "head-home"
    venv = node_venv(home / "venv")
    (venv / "bin" / "ray").write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom ray.scripts.scripts import main\n"
                                      "sys.exit(main())\n")
    os.chmod(venv / "bin" / "ray", 0o755)
    (home / ".bashrc").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    return home


@pytest.fixture
def ssh_head(tmp_path):
    """An sshd on 127.0.0.1 accepting a fresh key for this user, its sessions in the head's home (`head_home`).
    Yields (port, private key path, head home)."""
    missing = [t for t in TOOLS if not _tool(t)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (scripts/setup.sh installs openssh-server, rsync and "
                    "netcat-openbsd from Debian's packages when run as root)")
    d = tmp_path / "ssh"
    d.mkdir()
    for key in ("host_key", "user_key"):
        subprocess.run([_tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        f"PidFile {d / 'sshd.pid'}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n")
    home = head_home(tmp_path)
    with (d / "sshd_config").open("a") as config:
        config.write(f"SetEnv HOME={home}\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory sshd insists on
    proc = subprocess.Popen([_tool("sshd"), "-D", "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"sshd did not start: {(d / 'sshd.log').read_text()[-2000:]}")
            time.sleep(0.2)
    try:
        yield port, d / "user_key", home
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _ray(args: list[str], cwd: Path, env: dict, timeout: float = 400) -> str:
    run = subprocess.run([_tool("ray"), *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=timeout)
    assert run.returncode == 0, f"ray {' '.join(args[:2])} failed:\n{run.stdout[-6000:]}"
    return run.stdout


def test_ray_up_submit_down_on_the_local_provider(tmp_path, ssh_head):
    port, key, home = ssh_head
    mount = home / "a2tune"  # the cluster's copy of the repository: ~/a2tune on the head, as shipped
    config = yaml.safe_load((REPO / "ray-cluster.local.yaml").read_text())
    config["cluster_name"] = f"a2tune-test-{os.getpid()}"
    config["auth"].update(ssh_user=os.environ.get("USER") or "root", ssh_private_key=str(key),
                          ssh_proxy_command=f"nc 127.0.0.1 {port}")
    assert config["file_mounts"] == {"~/a2tune": "."}
    config["file_mounts"] = {"~/a2tune": str(REPO)}  # `ray up` runs in tmp_path here, not in the repository
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(yaml.safe_dump(config, sort_keys=False))
    token_file = home / ".ray" / "auth_token"
    env = a2_env({k: v for k, v in os.environ.items() if not k.startswith("RAY_")})

    study_dir = tmp_path / "studies"
    overrides = [f"data.root={tmp_path / 'data'}", "data.images=60", "data.val_images=10",
                 "model.d_model=32", "model.layers=1", "model.heads=2", "model.d_ff=64", "model.max_regions=8",
                 "train.xe_epochs=2", "search.num_samples=1", "search.space.fusion.grid=[gate]",
                 "search.replicates=[0]", "search.scheduler={fifo:{}}",  # no spaces: ray submit splits on them
                 "resources.workers_per_trial=1", f"storage={study_dir}",
                 f"tracking.mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    try:
        _ray(["up", "-y", "--no-config-cache", str(cluster_file)], tmp_path, env)
        assert (mount / "a2core" / "data" / "synthetic.py").is_file()  # file_mounts synced the repository
        # setup_commands installed the synced copy into the head's Python, which had no a2tune before
        where = subprocess.run([str(home / "venv" / "bin" / "python"), "-I", "-c",
                                "import a2core; print(a2core.__file__)"],
                               stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
        assert Path(where).is_relative_to(mount), where
        assert token_file.is_file()  # head_setup_commands generated the cluster's token where clients find it
        out = _ray(["submit", "--no-config-cache", str(cluster_file), str(REPO / "launch" / "submit.py"), "--",
                    "studies/smoke.yaml", f"--repo={mount}", "--quiet", *overrides], tmp_path, env, timeout=600)
        # the driver joined the cluster `ray up` started (Ray's INFO lines go to the study's log, not the terminal)
        log = (study_dir / "a2-smoke" / "driver.log").read_text()
        assert "Connected to Ray cluster" in log or "Connecting to existing Ray cluster" in log, (out[-2000:], log[-2000:])
        assert "Started a local Ray instance" not in log + out
    finally:
        down = subprocess.run([_tool("ray"), "down", "-y", str(cluster_file)], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert down.returncode == 0, down.stdout[-4000:]

    summary = json.loads((study_dir / "a2-smoke" / "summary.json").read_text())
    assert summary["complete"], summary
    [trial] = summary["trials"]
    assert trial["state"] == "TERMINATED" and trial["epochs_reported"] == [1, 2]
    # The trial ran the synced copy: its checkpoints say which a2core trained them.
    checkpoints = sorted((study_dir / "a2-smoke").rglob("checkpoint.pt"))
    assert checkpoints, sorted(str(p) for p in (study_dir / "a2-smoke").rglob("*"))[:40]
    for checkpoint in checkpoints:
        code = torch.load(checkpoint, map_location="cpu", weights_only=True)["code"]["a2core"]
        assert Path(code).is_relative_to(mount), code
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        runs = db.execute("SELECT run_uuid, status FROM runs").fetchall()
        steps = db.execute("SELECT DISTINCT step FROM metrics WHERE key = 'val/CIDEr' ORDER BY step").fetchall()
    assert len(runs) == 2 and {status for _, status in runs} == {"FINISHED"}  # the study's run and its trial's
    assert [s for (s,) in steps] == [1, 2]
    ps = subprocess.run(["pgrep", "-f", "raylet|gcs_server"], stdout=subprocess.PIPE, text=True)
    assert ps.stdout.strip() == "", "ray down left Ray processes running"
