"""Features onto every node: `a2 data push` / `a2 data fetch` through a real S3 server (moto), and a study on
`kind: coco` that refuses to start when a node of a real multi-node Ray cluster holds no copy or another version
(a node with a file system view of its own: `unshare --mount` with a bind mount over the store)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from a2core.data import features, prepared, synthetic
from a2core.errors import DataError
from launch import datastore
from launch.cli import main
from tests.raycluster import a2, ray_cluster_factory  # noqa: F401 - fixture
from tests.s3server import s3_client, unique_bucket
from tests.test_datastore_edges import _store


@pytest.mark.slow
def test_push_then_fetch_verifies_skips_and_replaces(s3_endpoint, tmp_path, capsys):
    bucket = unique_bucket(s3_endpoint, "feat")
    v1 = _store(tmp_path / "v1.a2feat", seed=1)
    uri = f"s3://{bucket}/coco/features.a2feat"
    assert main(["data", "push", str(tmp_path / "v1.a2feat"), uri, "--endpoint-url", s3_endpoint]) == 0
    target = tmp_path / "node" / "features.a2feat"
    got = datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)
    assert got == {"checksum": v1["checksum"], "target": str(target), "fetched": True}
    assert prepared.check_copy(target, full=True, expected=v1["checksum"])
    for name in v1["files"]:
        assert (target / name).read_bytes() == (tmp_path / "v1.a2feat" / name).read_bytes()
    # a node that holds this version already downloads nothing (the CLI, as the cluster's setup command runs it)
    capsys.readouterr()
    assert main(["data", "fetch", uri, str(target), "--endpoint-url", s3_endpoint]) == 0
    assert json.loads(capsys.readouterr().out)["fetched"] is False
    # a truncated copy is fetched again
    rows = target / prepared.ROWS
    rows.write_bytes(rows.read_bytes()[:-4])
    assert datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)["fetched"] is True
    assert prepared.check_copy(target, full=True, expected=v1["checksum"])
    # a new version pushed to the same place replaces the old copy whole
    v2 = _store(tmp_path / "v2.a2feat", seed=2)
    datastore.push(tmp_path / "v2.a2feat", uri, endpoint_url=s3_endpoint, quiet=True)
    assert datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)["checksum"] == v2["checksum"]
    assert prepared.check_copy(target, full=True, expected=v2["checksum"])
    # an object that does not match its manifest is refused, naming it; the node's copy stays as it was
    key = f"coco/features.a2feat/{prepared.ROWS}"
    damaged = bytearray((tmp_path / "v2.a2feat" / prepared.ROWS).read_bytes())
    damaged[7] ^= 0xFF
    s3_client(s3_endpoint).put_object(Bucket=bucket, Key=key, Body=bytes(damaged))
    (target / datastore.STAMP).unlink()  # make the node fetch again
    shutil.copyfile(tmp_path / "v1.a2feat" / prepared.ROWS, target / prepared.ROWS)
    with pytest.raises(DataError, match=rf"s3://{bucket}/{key}: SHA-256 differs"):
        datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)
    assert (target / prepared.ROWS).read_bytes() == (tmp_path / "v1.a2feat" / prepared.ROWS).read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == [".features.a2feat.lock", "features.a2feat"]
    # nothing at the URI (a typo): named as given; a folder without its manifest: not a store, and how to make one
    with pytest.raises(DataError, match=rf"^s3://{bucket}/nothing\.a2feat: no such file or feature store$"):
        datastore.fetch(f"s3://{bucket}/nothing.a2feat", tmp_path / "x", endpoint_url=s3_endpoint, quiet=True)
    s3_client(s3_endpoint).put_object(Bucket=bucket, Key=f"half.a2feat/{prepared.ROWS}", Body=b"rows")
    with pytest.raises(DataError, match=r"half\.a2feat/manifest\.json: no such file \(not a prepared feature store"):
        datastore.fetch(f"s3://{bucket}/half.a2feat", tmp_path / "x", endpoint_url=s3_endpoint, quiet=True)


def test_push_and_fetch_a_plain_file(s3_endpoint, tmp_path):
    bucket = unique_bucket(s3_endpoint, "feat")
    captions = tmp_path / "dataset_coco.json"
    captions.write_text('{"images": []}')
    uri = f"s3://{bucket}/coco/dataset_coco.json"
    assert datastore.push(captions, uri, endpoint_url=s3_endpoint, quiet=True)["sha256"]
    target = tmp_path / "node" / "dataset_coco.json"
    assert datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)["fetched"] is True
    assert target.read_text() == captions.read_text()
    assert datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)["fetched"] is False
    target.write_text('{"images": [1]}')
    assert datastore.fetch(uri, target, endpoint_url=s3_endpoint, quiet=True)["fetched"] is True
    assert target.read_text() == captions.read_text()


def test_fetch_from_a_local_folder(tmp_path):
    v1 = _store(tmp_path / "v1.a2feat", seed=1)
    got = datastore.fetch(str(tmp_path / "v1.a2feat"), tmp_path / "copy", quiet=True)
    assert got["fetched"] and prepared.check_copy(tmp_path / "copy", full=True, expected=v1["checksum"])
    assert datastore.fetch(str(tmp_path / "v1.a2feat"), tmp_path / "copy", quiet=True)["fetched"] is False


def test_fetch_replaces_only_a_store_never_another_folder(tmp_path):
    """The target is replaced whole: a typo'd target that is someone's folder (a synthetic data set here) is
    refused with nothing touched; an empty folder or an older store is replaced."""
    v1, v2 = _store(tmp_path / "v1.a2feat", seed=1), _store(tmp_path / "v2.a2feat", seed=2)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("precious")
    with pytest.raises(DataError, match=r"mine: a folder that is not a feature store \(it holds no manifest\.json\) "
                                        r"and would be replaced whole"):
        datastore.fetch(str(tmp_path / "v1.a2feat"), mine, quiet=True)
    assert (mine / "thesis.txt").read_text() == "precious" and os.listdir(mine) == ["thesis.txt"]
    (tmp_path / "empty").mkdir()
    assert datastore.fetch(str(tmp_path / "v1.a2feat"), tmp_path / "empty", quiet=True)["fetched"]
    got = datastore.fetch(str(tmp_path / "v2.a2feat"), tmp_path / "empty", quiet=True)  # an older store: replaced
    assert got["fetched"] and prepared.check_copy(tmp_path / "empty", full=True, expected=v2["checksum"])
    assert v1["checksum"] != v2["checksum"]


def _can_unshare() -> bool:
    if not shutil.which("unshare") or not shutil.which("mount"):
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs none /mnt"], capture_output=True)
    return probe.returncode == 0


def _own_view(over: Path, source: Path) -> list[str]:
    """A wrapper that starts a Ray node seeing `source` at `over` (a machine with other files there)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount --bind "{source}" "{over}" && exec "$@"', "sh"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare --mount` (root or user namespaces)")
def test_study_refuses_a_node_whose_copy_is_missing_or_differs(tmp_path, ray_cluster_factory):
    paths = synthetic.generate(tmp_path / "s", seed=0, images=40, test_images=10)
    data_dir = tmp_path / "data"
    store = data_dir / "features.a2feat"
    features.prepare(paths["features"], store)
    other = tmp_path / "other" / "features.a2feat"  # another version of the features, on the "spot" node
    _store(other, seed=5, dim=2048)
    empty = tmp_path / "empty"
    empty.mkdir()
    study = tmp_path / "coco-nodes.yaml"
    study.write_text(yaml.safe_dump({
        "name": "coco-nodes",
        "data": {"kind": "coco", "captions": str(paths["captions"]), "features": str(store)},
        "model": {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "max_regions": 8},
        "train": {"xe_epochs": 1, "scst_epochs": 0, "batch_size": 50},
        "search": {"metric": "val/CIDEr", "mode": "max", "algorithm": "grid", "space": {}},
        "resources": {"workers_per_trial": 1, "cpus_per_worker": 0.5},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "storage": str(tmp_path / "studies")}))
    cluster = ray_cluster_factory(num_cpus=1)
    cluster.add_node(num_cpus=1, name="spot", wrapper=_own_view(store, other))  # joined with another version
    cluster.add_node(num_cpus=1, name="bare", wrapper=_own_view(data_dir, empty))  # joined without the features
    cluster.wait_for_nodes(3)
    run = a2("study", "run", str(study), cwd=tmp_path, env=cluster.env(), timeout=300)
    assert run.returncode == 2, run.stdout
    problems = [x.strip() for x in run.stdout.splitlines() if x.strip().startswith("node ")]
    assert len(problems) == 2, run.stdout  # the two odd nodes, not the head
    assert any(f"{store} holds store {prepared.read_manifest(other)['checksum']}, the driver's copy is store "
               f"{prepared.read_manifest(store)['checksum']}" in x for x in problems), run.stdout
    assert any(x.endswith(f"{store}: missing") for x in problems), run.stdout
    assert all(re.match(r"node \S+ \(\S+, id [0-9a-f]{12}\): ", x) for x in problems), run.stdout  # address, host, id
    assert not (tmp_path / "studies" / "coco-nodes" / "study.yaml").exists()  # nothing of the study started
