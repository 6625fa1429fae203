"""`launch/commands/submit.py` as a Ray job: `ray job submit --working-dir <repo> -- python launch/commands/submit.py STUDY`.

`ray up` / `ray submit` need SSH to a head node, which this machine has not; the job API runs the same script on
a `ray start --head` cluster with its dashboard, which is how a job reaches a real cluster too.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.raycluster import (  # noqa: F401 - fixtures
    REPO, a2_env, arrow_s3_compatible_moto, ray_cluster_factory, tiny_data, tiny_study)
from tests.s3server import s3_client, unique_bucket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# What a job's working directory upload leaves out: history, outputs, caches.
EXCLUDES = [".git", "runs", "a2-studies", "a2-data", "mlruns", "mlflow.db", ".a2", ".pytest_cache", "__pycache__",
            "*.egg-info", "build", "dist", ".venv"]


def ray_cli() -> str:
    return shutil.which("ray") or str(pytest.fail("the `ray` command is not installed"))


def test_submit_runs_a_study_as_a_ray_job(tmp_path, tiny_data, ray_cluster_factory, s3_endpoint,
                                          arrow_s3_compatible_moto):
    """The job's study keeps its checkpoints, results and summary on S3 (an S3-compatible endpoint)."""
    bucket = unique_bucket(s3_endpoint, "a2-job")
    cluster = ray_cluster_factory(num_cpus=2, dashboard=True)  # its nodes inherit the test's S3 credentials
    name = "job-one"
    study = tiny_study(tmp_path, name, tiny_data, epochs=2, workers=2, cpus_per_worker=0.5,
                       extra={"storage": f"s3://{bucket}/studies", "storage_endpoint_url": s3_endpoint})
    cmd = [ray_cli(), "job", "submit", "--address", cluster.dashboard_url, "--working-dir", str(REPO),
           "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
           "--", "python", "launch/commands/submit.py", str(study), "--quiet"]
    env = a2_env(cluster.env(address=False))
    job = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=800)
    out = job.stdout
    assert job.returncode == 0, out[-6000:]
    assert re.search(r"Job 'raysubmit_\w+' succeeded", out), out[-3000:]
    s3 = s3_client(s3_endpoint)
    summary = json.loads(s3.get_object(Bucket=bucket, Key=f"studies/{name}/summary.json")["Body"].read())
    assert summary["complete"] and summary["best"] is not None
    assert summary["trials"][0]["epochs_reported"] == [1, 2]
    best = summary["best"]["checkpoint"]
    assert best.startswith("trials/") and best.endswith("/checkpoint.pt")  # relative to the study's folder
    s3.head_object(Bucket=bucket, Key=f"studies/{name}/{best}")  # the best checkpoint is there
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"studies/{name}/")["Contents"]}
    assert f"studies/{name}/study.yaml" in keys


@pytest.mark.outside_ray_group  # starts no Ray: runs beside the group
def test_submit_rejects_an_invalid_study_without_ray(tmp_path, tiny_data):
    study = tiny_study(tmp_path, "job-bad", tiny_data, extra={"resources.workers_per_trial": 0})
    run = subprocess.run([sys.executable, str(REPO / "launch" / "commands" / "submit.py"), str(study)], cwd=tmp_path,
                         env=a2_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert run.returncode == 2, run.stdout
    assert "resources.workers_per_trial" in run.stdout
    assert "Started a local Ray" not in run.stdout
