"""docs/how-to/reproduce-table-3.md as a test: its command blocks, in order, as written.

Each ```bash block of the page carries a `<!-- howto-test: runs ... -->` or `<!-- howto-test: skip: REASON -->` line
(above its readme-test marker); the blocks marked `runs` are run here as one bash script each, in a copy of the
checkout, with only these changes:

- the bucket: `s3://your-bucket` is a bucket of moto's S3 server on 127.0.0.1, reached through $AWS_ENDPOINT_URL;
- sizes: the `a2 study` and `ray submit` lines get `SHRINK` appended (two configurations x 2 search seeds, then 2
  confirmation seeds of each, of a 1-layer model for 1 epoch on 60 synthetic images), the data are the synthetic COCO written under the real names and in the
  real formats (dataset_coco.json, the train/val2014 and test2014 HDF5 files, image_info_test2014.json,
  captions_val2014.json);
- `--tmux` is dropped, so that a command returns when its work is done;
- `ray-cluster.yaml` in the copy is the shipped file with its AWS parts (provider, docker, node types) replaced by
  ray-cluster.local.yaml's local provider, its head an account of its own on 127.0.0.1 (tests/test_cluster_launch.py's
  `head_account`: no access to the checkout, its packages from a wheelhouse); everything else (setup commands with
  their data fetches, start commands, the head's MLflow server) is the shipped file's. The account's "image" is an
  empty virtual environment first on its PATH, as Ray's images have a Python of their own.

Like every cluster test it runs under the Ray lock (RULES: `flock /tmp/a2-ray.lock`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import h5py
import pytest
import yaml

from a2core.data import synthetic
from tests.raycluster import REPO, a2_env, arrow_s3_compatible_moto  # noqa: F401 (a fixture)
from tests.s3server import unique_bucket
from tests.test_cluster_launch import _account_pids, _is_ray, _tool, head_account  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PAGE = REPO / "docs" / "how-to" / "reproduce-table-3.md"
HOWTO = re.compile(r"<!--\s*howto-test:\s*(runs\b.*?|skip:\s*(?P<reason>.*?))\s*-->")
# The space as one YAML value: its comma must reach a2 whole through bash, which would brace-expand it unquoted;
# `ray submit` joins its arguments unquoted into a command line the head's bash reads again, so quoted twice there.
SPACE = "search.space={fusion:{grid:[none,gate]}}"
SHRINK = ("search.replicates=2 search.confirm=2 model.d_model=32 model.layers=1 "
          "model.heads=2 model.d_ff=64 model.max_regions=8 train.xe_epochs=1 train.batch_size=10 train.warmup=10 "
          "train.num_workers=0 train.val_decode=greedy train.test_meteor=false resources.cpus_per_worker=1 "
          "resources.gpus_per_worker=0 resources.max_concurrent_trials=2")
SHRUNK = ("a2 study plan ", "a2 study validate ", "ray submit ")


def page_blocks(text: str) -> list[dict]:
    """The page's ```bash blocks in order: {"lines", "runs", "reason"}; a block without a howto-test line fails."""
    blocks, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "```bash":
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        above = [lines[j] for j in range(max(0, i - 3), i)]
        match = next((m for m in map(HOWTO.search, reversed(above)) if m), None)
        blocks.append({"lines": lines[i + 1:end], "line": i + 1, "runs": bool(match and match.group("reason") is None),
                       "reason": match.group("reason") if match else None, "marked": match is not None})
    return blocks


def script(lines: list[str], bucket: str) -> str:
    out = []
    for line in lines:
        line = line.replace("s3://your-bucket", f"s3://{bucket}").replace("--tmux ", "")
        command, hash_, comment = line.partition(" #")
        if command.startswith(SHRUNK):
            space = f"\"'{SPACE}'\"" if command.startswith("ray submit ") else f"'{SPACE}'"
            line = f"{command.rstrip()} {space} {SHRINK}" + (f"  #{comment}" if hash_ else "")
        out.append(line)
    return "set -euo pipefail\n" + "\n".join(out) + "\n"


@pytest.mark.outside_ray_group  # starts no Ray: runs beside the group
def test_every_block_of_the_page_says_whether_the_test_runs_it():
    blocks = page_blocks(PAGE.read_text())
    assert blocks and all(b["marked"] for b in blocks), [b["line"] for b in blocks if not b["marked"]]
    assert all(b["runs"] or b["reason"] for b in blocks)


def laptop_checkout(root: Path) -> Path:
    """A copy of the working tree as `git` sees it (tracked and new files, nothing ignored): the user's clone."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, root / rel)
    return root


def coco_downloads(folder: Path) -> None:
    """The five downloads of section 2, synthetic, under the names their publishers use: the train/val2014 features
    and the test2014 features in two HDF5 files, as the real downloads split them."""
    folder.mkdir(parents=True, exist_ok=True)
    files = synthetic.generate(folder / "synth", seed=0, images=60, test_images=6)
    test_ids = {img["id"] for img in json.loads(Path(files["test_images"]).read_text())["images"]}
    with h5py.File(files["features"], "r") as src, h5py.File(folder / "coco_detections.hdf5", "w") as trainval, \
            h5py.File(folder / "test2014_detections.hdf5", "w") as test:
        for key in src:
            (test if int(key.split("_")[0]) in test_ids else trainval).create_dataset(key, data=src[key][()])
    shutil.copy(files["captions"], folder / "dataset_coco.json")
    shutil.copy(files["test_images"], folder / "image_info_test2014.json")
    val = json.loads(Path(files["val_images"]).read_text())  # images[].id, as COCO's captions_val2014.json has
    (folder / "captions_val2014.json").write_text(json.dumps({**val, "annotations": []}))
    shutil.rmtree(folder / "synth")


def local_cluster_file(head) -> dict:
    """The shipped ray-cluster.yaml on the local provider: its AWS parts swapped for ray-cluster.local.yaml's."""
    shipped = yaml.safe_load((REPO / "ray-cluster.yaml").read_text())
    local = yaml.safe_load((REPO / "ray-cluster.local.yaml").read_text())
    for key in ("docker", "available_node_types", "head_node_type"):
        shipped.pop(key, None)
    shipped.update(cluster_name=f"a2tune-howto-{os.getpid()}", provider=local["provider"], max_workers=0,
                   auth={"ssh_user": head.name, "ssh_private_key": str(head.key),
                         "ssh_proxy_command": f"nc 127.0.0.1 {head.port}"})
    return shipped


def run_block(number: int, text: str, cwd: Path, env: dict, log: Path, timeout: float = 900) -> str:
    started = time.monotonic()
    run = subprocess.run(["bash", "-c", text], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=timeout)
    with log.open("a") as f:
        f.write(f"\n=== block {number} ({time.monotonic() - started:.0f}s, exit {run.returncode}) ===\n{text}\n"
                f"{run.stdout}")
    assert run.returncode == 0, f"block {number} failed (exit {run.returncode}):\n{text}\n{run.stdout[-6000:]}"
    return run.stdout


def test_the_how_to_runs_as_written(tmp_path, head_account, s3_endpoint, arrow_s3_compatible_moto):
    head = head_account
    with socket.socket() as s:  # the shipped head starts its MLflow server on 127.0.0.1:5000
        if s.connect_ex(("127.0.0.1", 5000)) == 0:
            pytest.skip("127.0.0.1:5000 is taken: the head's MLflow server of ray-cluster.yaml listens there")
    started = time.monotonic()
    laptop = laptop_checkout(tmp_path / "a2tune")
    coco_downloads(laptop / "data" / "coco")
    bucket = unique_bucket(s3_endpoint, "a2-howto")
    (laptop / "ray-cluster.yaml").write_text(yaml.safe_dump(local_cluster_file(head), sort_keys=False).replace(
        "YOUR-BUCKET", bucket))
    # the head's image: a Python of its own first on PATH (Ray's images have one); the bucket's endpoint
    image = subprocess.run(["su", "-", head.name, "-c", "python3 -m venv ~/image-python"], capture_output=True,
                           text=True, timeout=300)
    assert image.returncode == 0, image.stderr
    bashrc = head.home / ".bashrc"
    bashrc.write_text(f'export PATH="$HOME/image-python/bin:$PATH"\nexport AWS_ENDPOINT_URL={s3_endpoint}\n'
                      + bashrc.read_text())
    env = {**a2_env({k: v for k, v in os.environ.items() if not k.startswith("RAY_")}),
           "AWS_ENDPOINT_URL": s3_endpoint}
    log = tmp_path / "howto.log"
    blocks = page_blocks(PAGE.read_text())
    ran = []
    try:
        for number, block in enumerate(blocks, 1):
            if not block["runs"]:
                continue
            out = run_block(number, script(block["lines"], bucket), laptop, env, log)
            ran.append((number, block, out))
    finally:
        if not any("ray down" in "\n".join(b["lines"]) for _, b, _ in ran):  # a failed block: take the cluster down
            subprocess.run([_tool("ray"), "down", "-y", "ray-cluster.yaml"], cwd=laptop, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
        print(f"how-to test: {time.monotonic() - started:.0f}s; log {log}")
    outputs = "\n".join(out for _, _, out in ran)
    assert not [p for p in _account_pids(head.uid) if _is_ray(p)], "ray down left the head's Ray running"
    # the study ran on the cluster from the relative study path, every trial finished, and the verdict table is there
    assert "a2-fusion-ablation" in outputs
    package = laptop / "a2-packages" / "a2-fusion-ablation"
    assert (package / "results.zip").is_file() and (package / "leaderboard.json").is_file()
    leaderboard = json.loads((package / "leaderboard.json").read_text())
    assert leaderboard, leaderboard
    # the MLflow history outlived the head: the study's parent run and its 8 trials' runs, finished
    with sqlite3.connect(laptop / "mlflow-a2-fusion-ablation.db") as db:
        runs = db.execute("SELECT status FROM runs").fetchall()
    assert sum(1 for (status,) in runs if status == "FINISHED") >= 9, runs
