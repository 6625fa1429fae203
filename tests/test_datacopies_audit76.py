"""Audit of the data copies between a laptop, S3 and a cluster's nodes: `a2 study validate --cluster` reading the
fetches of setup commands written as a shell writes them, multipart uploads whose parts S3's limits resize, and a
download whose reads keep failing. Against moto's S3 server (tests/s3server.py); needs no Ray."""
from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import pytest
from botocore.exceptions import ReadTimeoutError

from launch import datacopies, storage
from launch.cli import main
from launch.storage import MiB, upload_file
from tests.s3server import s3_client, unique_bucket

pytestmark = pytest.mark.outside_ray_group


def _fetches(command: str) -> list[tuple[str, str, str | None]]:
    return datacopies.fetch_commands({"setup_commands": [command]})


def test_fetch_commands_are_read_as_the_nodes_shell_runs_them():
    """A relative target after `cd ~/a2tune`, `python -m launch.cli data fetch`, a command continued with a
    backslash and an endpoint set in the command's environment were missed or misread, so validate --cluster
    silently checked nothing (or another server) for those copies."""
    assert _fetches("cd ~/a2tune && a2 data fetch s3://b/f.a2feat data/coco/f.a2feat") == [
        ("s3://b/f.a2feat", "~/a2tune/data/coco/f.a2feat", None)]
    assert _fetches("(cd $HOME/a2tune; cd data; a2 data fetch s3://b/s s)") == [
        ("s3://b/s", "$HOME/a2tune/data/s", None)]
    assert _fetches("a2 data fetch s3://b/r rel") == [("s3://b/r", "~/rel", None)]  # Ray runs it in the home folder
    assert _fetches("echo cd x; a2 data fetch s3://b/t /abs/t") == [("s3://b/t", "/abs/t", None)]
    assert _fetches("python3 -m launch.cli data fetch s3://b/y ~/a2tune/y") == [("s3://b/y", "~/a2tune/y", None)]
    assert _fetches("a2 data fetch \\\n  s3://b/z \\\n  ~/a2tune/z") == [("s3://b/z", "~/a2tune/z", None)]
    assert _fetches("AWS_ENDPOINT_URL=http://e:9000 a2 data fetch s3://b/e ~/a2tune/e") == [
        ("s3://b/e", "~/a2tune/e", "http://e:9000")]
    assert _fetches("export AWS_ENDPOINT_URL=http://f; a2 data fetch s3://b/f ~/f --endpoint-url=http://g && "
                    "a2 data fetch s3://b/f2 ~/f2 2>&1 | tee log") == [
        ("s3://b/f", "~/f", "http://g"), ("s3://b/f2", "~/f2", "http://f")]


def test_validate_cluster_matches_a_fetch_written_relative_to_the_checkout(tmp_path):
    """`cd ~/a2tune && a2 data fetch SOURCE data/coco/features.a2feat` is the study's data.features copy."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("setup_commands:\n"
                       "  - cd ~/a2tune && a2 data fetch s3://my-bucket/coco/features.a2feat "
                       "data/coco/features.a2feat\n"
                       "  - >-\n    python -m launch.cli data fetch s3://my-bucket/coco/c.json\n"
                       "    ~/a2tune/data/coco/dataset_coco.json --endpoint-url http://minio:9000\n")
    root = tmp_path / "repo"
    spec = SimpleNamespace(data={"features": str(root / "data/coco/features.a2feat"),
                                 "captions": str(root / "data/coco/dataset_coco.json")}, train={})
    assert datacopies.cluster_copies(cluster, spec, str(root)) == [
        datacopies.ClusterCopy("data.captions", "s3://my-bucket/coco/c.json", spec.data["captions"],
                               "http://minio:9000"),
        datacopies.ClusterCopy("data.features", "s3://my-bucket/coco/features.a2feat", spec.data["features"])]


def test_a_multipart_upload_whose_parts_s3_resizes_is_verified(s3_endpoint, tmp_path):
    """s3transfer raises a part size below S3's 5 MiB least (and doubles one that would make over 10,000 parts):
    the composite checksum was computed over the parts asked for, so a good upload failed verification and was
    deleted."""
    bucket = unique_bucket(s3_endpoint, "audit")
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(6 * MiB + 5))
    sent = upload_file(big, f"s3://{bucket}/big.bin", endpoint_url=s3_endpoint, part_size=1 * MiB)
    head = s3_client(s3_endpoint).head_object(Bucket=bucket, Key="big.bin")
    assert sent["etag"].strip('"').endswith("-2")  # two parts of 5 MiB least, not seven of 1 MiB
    assert sent["sha256"] == hashlib.sha256(big.read_bytes()).hexdigest() == head["Metadata"]["sha256"]


def test_a_fetch_whose_reads_keep_failing_is_one_line(s3_endpoint, tmp_path, monkeypatch, capsys):
    """A download whose every read times out ended in boto3's RetriesExceededError traceback, not one line."""
    bucket = unique_bucket(s3_endpoint, "audit")
    captions = tmp_path / "c.json"
    captions.write_text("{}")
    upload_file(captions, f"s3://{bucket}/c.json", endpoint_url=s3_endpoint)
    real = storage.make_client

    def timing_out(endpoint_url=None, **_):
        client = real(endpoint_url, max_attempts=1)

        def read_timeout(request, **_):
            raise ReadTimeoutError(endpoint_url=request.url)

        client.meta.events.register("before-send.s3.GetObject", read_timeout)
        return client

    monkeypatch.setattr(storage, "make_client", timing_out)
    target = tmp_path / "node" / "c.json"
    assert main(["data", "fetch", f"s3://{bucket}/c.json", str(target), "--endpoint-url", s3_endpoint]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"a2: error: download of s3://{bucket}/c.json failed: Read timeout on endpoint URL: "
        f"\"{s3_endpoint}/{bucket}/c.json\"")
    assert not target.exists() and os.listdir(target.parent) == [".c.json.lock"]


def test_an_upload_is_served_as_what_it_is(s3_endpoint, tmp_path):
    """results.zip and leaderboard.json were stored as binary/octet-stream (S3's default): a browser opening the
    package's leaderboard downloaded it. A file of no known kind stays S3's default."""
    bucket = unique_bucket(s3_endpoint, "types")
    kinds = {}
    for name in ("results.zip", "leaderboard.json", "index.html", "features.a2feat"):
        (tmp_path / name).write_bytes(b"x" * 10)
        upload_file(tmp_path / name, f"s3://{bucket}/p/", endpoint_url=s3_endpoint)
        kinds[name] = s3_client(s3_endpoint).head_object(Bucket=bucket, Key=f"p/{name}")["ContentType"]
    assert kinds == {"results.zip": "application/zip", "leaderboard.json": "application/json",
                     "index.html": "text/html", "features.a2feat": "binary/octet-stream"}
