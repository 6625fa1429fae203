"""What `ray up` puts on a node from the shipped cluster files, checked on the copy and not on this checkout.

The copy is made as Ray makes it: Ray's own SSH command runner builds the rsync command (its `-avz`, and the
`--exclude` / `--filter` arguments it derives from `rsync_exclude` / `rsync_filter`) for each of `file_mounts`, with
the trailing-slash rule Ray's node updater applies to a folder; only the remote `user@host:` target is replaced by a
folder here. The copy is then installed alone into a fresh venv, as a node's `setup_commands` install it: the venv sees
this machine's third-party packages through a plain path entry (so no `.pth` of theirs runs, the checkout's own
editable install included), and nothing of the checkout. A sync rule that drops code fails here, not on a cluster.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from tests.raycluster import REPO

CLUSTER_FILES = ("ray-cluster.yaml", "ray-cluster.local.yaml")
# Outputs a user's checkout holds that must stay home (each ignored by .gitignore), and one that must travel.
IGNORED = ("data/coco/features.a2feat", "runs/a2/last.pt", "a2-studies/a2-smoke/study.yaml", "mlflow.db",
           "mlartifacts/0/x.bin", "a2-pipeline/leaderboard.json", ".venv/bin/python", ".git/HEAD",
           "a2core/__pycache__/config.cpython-311.pyc", "docs/_build/index.html", "a2tune.egg-info/PKG-INFO")
UNTRACKED_KEPT = "studies/my-variant.yaml"


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, stdout=subprocess.PIPE, check=True).stdout
    return [f for f in out.decode().split("\0") if f and (REPO / f).is_file()]


def ray_rsync_command(config: dict, source: str, node_target: str) -> list[str]:
    """The rsync command Ray's SSH command runner runs for one file mount (its own code path), as a list."""
    from ray.autoscaler._private.command_runner import SSHCommandRunner

    class Recorder:  # stands in for the subprocess module Ray hands commands to
        DEVNULL = subprocess.DEVNULL

        def __init__(self):
            self.commands = []

        def check_call(self, cmd, **_):
            self.commands.append(cmd)
            return 0

    recorder = Recorder()
    runner = SSHCommandRunner(log_prefix="", node_id="node", provider=None,
                              auth_config={"ssh_user": "a2", "ssh_private_key": None}, cluster_name="sync-test",
                              process_runner=recorder, use_internal_ip=False)
    runner.ssh_ip = "127.0.0.1"  # what Ray would have asked the provider for
    runner.run_rsync_up(source, node_target, options={"rsync_exclude": config.get("rsync_exclude"),
                                                      "rsync_filter": config.get("rsync_filter")})
    [cmd] = recorder.commands
    assert cmd[0] == "rsync" and cmd[-1] == f"a2@127.0.0.1:{node_target}", cmd
    rsh = cmd.index("--rsh")
    return cmd[:rsh] + cmd[rsh + 2:-1] + [node_target]  # the same command, to a local folder instead of over SSH


def sync_like_ray(config: dict, laptop: Path, node_home: Path) -> None:
    """`ray up`'s file mounts, from `laptop` (where `ray up` runs) to a node whose home is `node_home`."""
    for remote, local in config["file_mounts"].items():
        if str(local).startswith("~"):  # a file of the user's home (the cluster's token), not of the tree
            continue
        source, target = str(local), str(remote).replace("~", str(node_home), 1)
        if (laptop / source).is_dir():  # NodeUpdater.sync_file_mounts: a folder is synced by its contents
            source, target = source.rstrip("/") + "/", target.rstrip("/") + "/"
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(ray_rsync_command(config, source, target), cwd=laptop, check=True,
                       stdout=subprocess.DEVNULL)


def user_checkout(tmp: Path) -> Path:
    """This working tree's files (tracked ones, as they are now) with a user's ignored outputs planted beside them."""
    laptop = tmp / "laptop"
    for name in tracked_files():
        (laptop / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, laptop / name)
    for name in (*IGNORED, UNTRACKED_KEPT):
        (laptop / name).parent.mkdir(parents=True, exist_ok=True)
        (laptop / name).write_text("planted\n")
    return laptop


def node_venv(root: Path) -> Path:
    """A fresh venv that reaches this machine's third-party packages through a plain path entry: a .pth line that
    is a path adds the folder but runs none of the `.pth` files inside it, so the checkout's editable-install finder
    never loads and only what is installed into this venv provides a2core, launch and dashboards."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    purelib = Path(subprocess.run([str(root / "bin" / "python"), "-c", "import sysconfig; "
                                   "print(sysconfig.get_paths()['purelib'])"], stdout=subprocess.PIPE, text=True,
                                  check=True).stdout.strip())
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "machine_packages.pth").write_text("\n".join(sorted(paths)) + "\n")
    return root


def node_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("RAY_")}


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_the_sync_ships_every_tracked_file_and_none_of_the_outputs(name, tmp_path):
    config = yaml.safe_load((REPO / name).read_text())
    laptop = user_checkout(tmp_path)
    sync_like_ray(config, laptop, tmp_path / "node")
    copy = tmp_path / "node" / "a2tune"
    missing = [f for f in tracked_files() if not (copy / f).is_file()]
    assert not missing, f"{name}: `ray up` would not copy {len(missing)} tracked files, e.g. {missing[:8]}"
    assert all((copy / f).read_bytes() == (laptop / f).read_bytes() for f in tracked_files())
    shipped = [f for f in IGNORED if (copy / f).exists()]
    assert not shipped, f"{name}: `ray up` would copy local outputs {shipped}"
    assert (copy / UNTRACKED_KEPT).is_file()  # a new study file, not yet committed, reaches the cluster too


def test_both_cluster_files_sync_by_the_same_rules():
    rules = [{k: yaml.safe_load((REPO / name).read_text()).get(k) for k in ("rsync_exclude", "rsync_filter")}
             for name in CLUSTER_FILES]
    assert rules[0] == rules[1]
    assert rules[0]["rsync_filter"] == [".gitignore"]
    # Every exclude is anchored to the copy's root: an unanchored name matches a folder of that name at any depth.
    assert all(str(rule).startswith("/") for rule in rules[0]["rsync_exclude"] or [])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_synced_copy_alone_installs_and_runs_a2(tmp_path):
    """`a2 --help` and `a2 study validate studies/smoke.yaml` from an install of the synced copy alone."""
    config = yaml.safe_load((REPO / "ray-cluster.yaml").read_text())
    sync_like_ray(config, user_checkout(tmp_path), tmp_path / "node")
    copy = tmp_path / "node" / "a2tune"
    venv = node_venv(tmp_path / "node" / "venv")
    env = node_env()
    # setup_commands' `pip install -e ~/a2tune`, without fetching a build backend this machine already has
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "-e", str(copy)], check=True, env=env, cwd=tmp_path)
    where = subprocess.run([str(venv / "bin" / "python"), "-I", "-c",
                            "import a2core.data.synthetic, launch.cli, dashboards.stats as m; print(m.__file__)"],
                           stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path, check=True).stdout.strip()
    assert Path(where).is_relative_to(copy), where
    a2 = str(venv / "bin" / "a2")
    usage = subprocess.run([a2, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           cwd=copy)
    assert usage.returncode == 0 and "study" in usage.stdout, usage.stdout[-3000:]
    valid = subprocess.run([a2, "study", "validate", "studies/smoke.yaml"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env, cwd=copy)
    assert valid.returncode == 0, valid.stdout[-3000:]
    assert "a2-smoke" in valid.stdout
