"""A killed `a2 package` leaves nothing a rerun duplicates: a model version registered but never tagged (the job
died between the two) is removed before the rerun registers its own, and the rerun writes into the killed run's
folder (no manifest yet) rather than a new NAME-2."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from a2core.atomic import fresh_folder
from launch.model_registry import TAG_CONTENT_HASH, drop_unfinished_versions


@pytest.mark.slow
def test_untagged_versions_of_the_run_are_removed_and_tagged_ones_kept(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("pkg", artifact_location=str(tmp_path / "artifacts"))
    run, other = (client.create_run(exp).info.run_id for _ in range(2))
    client.create_registered_model("m")
    done = client.create_model_version("m", f"runs:/{run}/ensemble", run_id=run, tags={TAG_CONTENT_HASH: "abc"})
    killed = client.create_model_version("m", f"runs:/{run}/ensemble", run_id=run)  # tag never set
    foreign = client.create_model_version("m", f"runs:/{other}/ensemble", run_id=other)
    assert drop_unfinished_versions(client, "m", run) == [int(killed.version)]
    left = sorted(int(v.version) for v in client.search_model_versions("name='m'"))
    assert left == sorted([int(done.version), int(foreign.version)])


def test_a_package_folder_without_its_manifest_is_reused(tmp_path):
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "results.zip").write_bytes(b"half")  # a killed run: its zip, no package.json yet
    assert fresh_folder(out, ("package.json",), "package") == out
    (out / "package.json").write_text("{}")
    assert fresh_folder(out, ("package.json",), "package") == tmp_path / "pkg-2"


def test_an_unfinished_runs_outputs_are_removed_before_the_rerun_writes(tmp_path):
    """The reused folder's zip, leaderboard and results files are the killed run's: a rerun that fails must not leave
    them beside its own as if they were its output. Only those names go; the checkpoint cache and other files stay."""
    from launch.package import clear_attempt

    out = tmp_path / "pkg"
    (out / ".checkpoints").mkdir(parents=True)
    (out / ".checkpoints" / "c.pt").write_bytes(b"ckpt")
    stale = ["results.zip", "leaderboard.json", "captions_val2014_old_results.json",
             "captions_test2014_old_results.json", "captions_karpathy_test_ensemble.json", ".results.zip.staging"]
    for name in stale + ["notes.txt"]:
        (out / name).write_text("run one")
    clear_attempt(out, verbose=False)
    assert sorted(p.name for p in out.iterdir()) == [".checkpoints", "notes.txt"]
    assert (out / ".checkpoints" / "c.pt").read_bytes() == b"ckpt"


def _fake_decode(calls):
    """`decode_shard` without models: every image's caption names it, each member's too (a shard decoded twice is
    seen in `calls`)."""
    def decode(checkpoints, data_config, shard, single_split=None, **options):
        calls.append(sorted(set().union(*shard.values())))
        return {"ensemble": {split: {i: f"a {i}" for i in ids} for split, ids in shard.items()},
                "single": [{i: f"m{k} {i}" for i in shard[single_split]} for k in range(len(checkpoints))]}
    return decode


def test_a_kept_shard_that_is_damaged_or_short_is_decoded_again(tmp_path, monkeypatch, capsys):
    """Kept shards let a killed package go on; one cut short, or one that lacks an image's caption, used to be a
    JSONDecodeError traceback or "decoding lost 1 images" on every rerun. It is decoded again, with a note naming
    it, and the captions are an uninterrupted run's."""
    import launch.package as package
    from launch.storage import open_location

    calls = []
    monkeypatch.setattr(package, "decode_shard", _fake_decode(calls))
    splits = {"val2014": list(range(10)), "test2014": list(range(100, 106)), "test": [0, 1, 2]}
    options = dict(beam_size=3, max_len=12, batch_size=4, workers=0, address=None, endpoint_url=None,
                   verbose=True, shard_images=4)
    keep = open_location(str(tmp_path)).join("kept")
    whole = package.decode_all(["c0", "c1"], {}, splits, "test", keep=keep, **options)
    assert whole["shards"] == 4 and len(calls) == 4
    text = keep.join("shard-00001.json").read_text()
    keep.join("shard-00001.json").write_text(text[:40])  # cut short
    short = package.json.loads(keep.join("shard-00002.json").read_text())
    del short["ensemble"]["test2014"][str(splits["test2014"][0])]  # valid JSON, one caption short
    keep.join("shard-00002.json").write_text(package.json.dumps(short))
    calls.clear()
    again = package.decode_all(["c0", "c1"], {}, splits, "test", keep=keep, **options)
    assert (again["reused"], len(calls)) == (2, 2)
    assert again["ensemble"] == whole["ensemble"] and again["single"] == whole["single"]
    printed = capsys.readouterr()
    assert "shard-00001.json is damaged or does not cover its images; decoding that shard again" in printed.out
    calls.clear()
    assert package.decode_all(["c0", "c1"], {}, splits, "test", keep=keep, **options)["reused"] == 4 and not calls


def test_the_kept_shards_key_changes_with_the_feature_store(tmp_path):
    """Shards decoded from one feature file are not reused for another, or for the same path rewritten: the key
    holds the data config and its files' identity (a prepared store's manifest)."""
    import os

    from launch.package import decode_key

    ckpt = tmp_path / "c.pt"
    ckpt.write_bytes(b"weights")
    splits = {"val2014": [1], "test2014": [2], "test": [1]}
    old, new = tmp_path / "old.h5", tmp_path / "new.h5"
    old.write_bytes(b"x" * 10)
    new.write_bytes(b"y" * 10)
    key = lambda data: decode_key([str(ckpt)], splits, "test", data, beam_size=3)  # noqa: E731
    assert key({"features": str(old)}) == key({"features": str(old)})
    assert key({"features": str(old)}) != key({"features": str(new)})
    before = key({"features": str(old)})
    old.write_bytes(b"z" * 11)
    os.utime(old, ns=(1, 1))
    assert key({"features": str(old)}) != before
    store = tmp_path / "f.a2feat"
    store.mkdir()
    (store / "manifest.json").write_text('{"checksum": "a"}')
    first = key({"features": str(store)})
    (store / "manifest.json").write_text('{"checksum": "b"}')
    assert key({"features": str(store)}) != first


def test_val2014_and_test2014_lists_that_share_images_are_refused_before_decoding(tmp_path):
    """COCO's val2014 and test2014 share no image: the test2014 list given as --val-images made a zip whose two
    results files held the same captions, and it validated. Refused before any decoding, naming both files."""
    from a2core import checkpoint as ckpt
    from a2core.config import Config
    from a2core.data import synthetic
    from a2core.errors import PackageError
    from launch.package import decoding_data

    paths = synthetic.generate(tmp_path / "syn", seed=0, images=40, test_images=10)
    cfg = Config.from_dict({"data": {"kind": "coco", "captions": str(paths["captions"]),
                                     "features": str(paths["features"]), "test_images": str(paths["test_images"])},
                            "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32}})
    state = {"model": {}, "config": cfg.to_dict(), "vocab": ["<pad>", "<bos>", "<eos>", "<unk>"]}
    path = ckpt.save(state, tmp_path / "c.pt")
    _, _, images = decoding_data(str(path), None, None, None)  # the data's own lists: disjoint
    assert not set(images["splits"]["val2014"]) & set(images["splits"]["test2014"])
    with pytest.raises(PackageError, match=r"10 image id\(s\) are in both the val2014 list \(.*image_info_test2014"
                                           r"\.json\) and the test2014 list \(.*image_info_test2014\.json\)"):
        decoding_data(str(path), None, str(paths["test_images"]), None)
