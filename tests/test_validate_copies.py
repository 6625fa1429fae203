"""`a2 study validate FILE --cluster CLUSTER_YAML` checks each S3 copy of the study's data that the cluster file's setup
commands fetch (`a2 data fetch SOURCE ~/a2tune/PATH`, PATH one of the study's data paths relative to the repository):
there, and the same version as the local copy, one line per copy that is not, naming the study key, the URI, what
differs and the `a2 data push` that fixes it. Against moto's S3 server, in a copy of the repository's layout with the
shipped ray-cluster.yaml and studies/fusion_ablation.yaml."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from a2core.data import features, prepared
from launch import datastore
from launch.cli import main as cli_main
from launch.commands.validate import validate_main
from tests.s3server import unique_bucket

ROOT = Path(__file__).resolve().parents[1]
STUDY = "studies/fusion_ablation.yaml"
# the study's data paths, relative to the repository, and the names ray-cluster.yaml fetches them under
DATA = {"data.captions": "data/coco/dataset_coco.json", "data.features": "data/coco/features.a2feat",
        "data.test_images": "data/coco/image_info_test2014.json"}


def _store(path: Path, seed: int, images: int = 6, dim: int = 16) -> dict:
    """A small prepared store at `path` (its HDF5 source beside it); the manifest."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path.with_suffix(".h5"), "w") as f:
        for i in range(images):
            f[f"{i + 1}_features"] = rng.random((3, dim), dtype=np.float32)
    return features.prepare(path.with_suffix(".h5"), path, feature_dim=dim)


def _captions(path: Path, word: str) -> None:
    images = [{"cocoid": i, "split": split, "sentences": [{"tokens": ["a", word]}]}
              for i, split in enumerate(["train", "val"])]
    path.write_text(json.dumps({"images": images}))


@pytest.fixture
def checkout(tmp_path, monkeypatch, s3_endpoint):
    """A copy of the repository's layout, the working directory: the shipped study, the shipped cluster file with a
    bucket of moto's server in place of the placeholder (its endpoint in $AWS_ENDPOINT_URL, as a team's shell has
    it), and the three data files the study reads. Yields (folder, bucket)."""
    repo = tmp_path / "a2tune"
    (repo / "studies").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    shutil.copy(ROOT / STUDY, repo / STUDY)
    bucket = unique_bucket(s3_endpoint, "a2-copies")
    (repo / "ray-cluster.yaml").write_text((ROOT / "ray-cluster.yaml").read_text().replace("YOUR-BUCKET", bucket))
    coco = repo / "data" / "coco"
    _store(coco / "features.a2feat", seed=1)
    _captions(coco / "dataset_coco.json", "dog")
    (coco / "image_info_test2014.json").write_text(json.dumps({"images": [{"id": 7}]}))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.chdir(repo)
    return repo, bucket


def _push(repo: Path, bucket: str, keys=tuple(DATA)) -> None:
    for key in keys:
        datastore.push(repo / DATA[key], f"s3://{bucket}/coco/{Path(DATA[key]).name}", quiet=True)


def _validate(repo: Path, bucket: str, cluster: str = "ray-cluster.yaml") -> int:
    return validate_main(repo / STUDY, [f"storage=s3://{bucket}/a2-studies"], cluster)


def test_copies_present_and_equal_validate(checkout, capsys):
    """The how-to's command as written: the shipped cluster file also fetches server.a2feat and
    captions_val2014.json, which the study does not read and which are not in the bucket: left alone."""
    repo, bucket = checkout
    _push(repo, bucket)
    assert cli_main(["study", "validate", "--cluster", "ray-cluster.yaml", STUDY,
                     f"storage=s3://{bucket}/a2-studies"]) == 0
    out, err = capsys.readouterr()
    assert "a2: error" not in err, err
    assert out.splitlines()[-1] == ("ray-cluster.yaml: the S3 copies it fetches of data.captions, data.features, "
                                    "data.test_images are this checkout's")


def test_a_missing_copy_fails_naming_it(checkout, capsys):
    repo, bucket = checkout
    _push(repo, bucket, ["data.captions", "data.features"])
    assert _validate(repo, bucket) == 2
    uri = f"s3://{bucket}/coco/image_info_test2014.json"
    assert capsys.readouterr().err.splitlines() == [
        f"a2: error: {repo / STUDY}: data.test_images: {uri} (the cluster's copy): no such store or file; upload it: "
        f"a2 data push data/coco/image_info_test2014.json {uri}"]


def test_a_store_or_file_pushed_from_another_version_fails_naming_both(checkout, tmp_path, capsys):
    repo, bucket = checkout
    _push(repo, bucket, ["data.test_images"])
    mine = prepared.read_manifest(repo / DATA["data.features"])["checksum"]
    theirs = _store(tmp_path / "other" / "features.a2feat", seed=2)["checksum"]
    datastore.push(tmp_path / "other" / "features.a2feat", f"s3://{bucket}/coco/features.a2feat", quiet=True)
    _captions(tmp_path / "other" / "dataset_coco.json", "cat")  # the same size, other bytes
    their_sha = datastore.push(tmp_path / "other" / "dataset_coco.json", f"s3://{bucket}/coco/dataset_coco.json",
                               quiet=True)["sha256"]
    my_sha = prepared.file_sha256(repo / DATA["data.captions"])
    assert theirs != mine and their_sha != my_sha
    assert _validate(repo, bucket) == 2
    store, captions = f"s3://{bucket}/coco/features.a2feat", f"s3://{bucket}/coco/dataset_coco.json"
    assert capsys.readouterr().err.splitlines() == [
        f"a2: error: {repo / STUDY}: data.captions: {captions} (the cluster's copy) has SHA-256 {their_sha}, the local "
        f"copy data/coco/dataset_coco.json {my_sha}; upload it: a2 data push data/coco/dataset_coco.json {captions}",
        f"a2: error: {repo / STUDY}: data.features: {store} (the cluster's copy) is store {theirs}, the local copy "
        f"data/coco/features.a2feat store {mine} (another version); upload it: a2 data push data/coco/features.a2feat "
        f"{store}"]


def test_fetches_of_paths_the_study_does_not_read_are_ignored(checkout, capsys):
    """Matched by the path relative to the repository, whichever way the home is spelled and wherever the fetch
    sits in a command line: a fetch into another folder, or outside the cluster's copy, is not the study's."""
    repo, bucket = checkout
    _push(repo, bucket, ["data.features"])
    (repo / "cluster.yaml").write_text(json.dumps({"file_mounts": {"~/a2tune": "."}, "setup_commands": [
        f"cd ~ && a2 data fetch s3://{bucket}/coco/features.a2feat $HOME/a2tune/data/coco/features.a2feat; echo ok",
        f"a2 data fetch s3://{bucket}/missing/dataset_coco.json ~/a2tune/data/other/dataset_coco.json",
        f"a2 data fetch s3://{bucket}/missing/image_info_test2014.json ~/elsewhere/data/coco/image_info_test2014.json",
        f"a2 data fetch s3://{bucket}/missing/captions_val2014.json ~/a2tune/data/coco/captions_val2014.json"]}))
    assert _validate(repo, bucket, "cluster.yaml") == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("cluster.yaml: the S3 copies it fetches of data.features are "
                                                        "this checkout's")


def test_a_placeholder_bucket_in_the_cluster_file_is_refused(tmp_path, monkeypatch, capsys):
    """The shipped file as it is: refused in one line naming the file and the key, before any request (the study's
    storage is a local folder here, and no S3 endpoint is set)."""
    (tmp_path / "studies").mkdir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(ROOT / STUDY, tmp_path / STUDY)
    coco = tmp_path / "data" / "coco"
    _store(coco / "features.a2feat", seed=1)
    _captions(coco / "dataset_coco.json", "dog")
    (coco / "image_info_test2014.json").write_text(json.dumps({"images": [{"id": 7}]}))
    monkeypatch.chdir(tmp_path)
    assert validate_main(STUDY, [f"storage={tmp_path / 'a2-studies'}"], ROOT / "ray-cluster.yaml") == 2
    assert capsys.readouterr().err.splitlines() == [
        f"a2: error: {ROOT / 'ray-cluster.yaml'}: setup_commands: a2 data fetch s3://YOUR-BUCKET/coco/features.a2feat: "
        f"YOUR-BUCKET is the placeholder of the shipped cluster and study files; replace it with your bucket"]
