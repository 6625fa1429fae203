"""`a2 package` edges a user reaches without Ray: an `--out` folder holding files no package run wrote (a hand-made
submission is not a killed run's to clear), a malformed or unreachable `--upload` target (refused before any
decoding, not after it), and a server image list with no images (a zip of no captions is not a valid submission).
`package()` runs here with its training, decoding and MLflow steps replaced by stubs; the folder, upload and
manifest steps are the real ones."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from a2core.errors import PackageError
from dashboards.runs import Trial
from tests.studyfolder import fabricated_study

pytestmark = pytest.mark.outside_ray_group  # starts no Ray (every step that would is a stub)

NAME = "pkg-edges"
IMAGES = {"splits": {"val2014": [1, 2], "test2014": [3, 4], "test": [1]}, "sources": {}, "max_len": 20}


def _member(tmp_path: Path, seed: int) -> Trial:
    checkpoint = tmp_path / f"ckpt{seed}.pt"
    checkpoint.write_bytes(b"weights %d" % seed)  # read for the kept shards' key only
    config = {"model": {"fusion": "gate"}, "train": {"seed": seed}}
    return Trial(f"t{seed}", study=NAME, state="TERMINATED", config=config, config_hash="h" * 64,
                 best_value=10.0 + seed, best_checkpoint=str(checkpoint))


@pytest.fixture
def stubbed(tmp_path, monkeypatch):
    """`launch.package.package` of a fabricated study whose steps that need Ray, torch models or MLflow are stubs;
    `calls` lists the steps that ran, `deliver_fails` makes delivery fail (a run that stops after its zip)."""
    import launch.package as package

    fab = fabricated_study(tmp_path, NAME, epochs=1)
    members = [_member(tmp_path, s) for s in (0, 1)]
    calls, state = [], {"deliver_fails": False}

    def decode_all(sources, data_config, splits, single_split, **kwargs):
        calls.append("decode")
        ensemble = {split: {i: f"a caption of {i}" for i in ids} for split, ids in splits.items()}
        return {"ensemble": ensemble, "single": [dict(ensemble["test"]) for _ in sources], "seconds": 0.0}

    def deliver(name, spec, best, members, local, data, decoded, results, images, **kwargs):
        calls.append("deliver")
        if state["deliver_fails"]:
            raise PackageError("MLflow is down (a stub)")
        board_path = results["zip"].parent / package.LEADERBOARD
        board_path.write_text("{}")
        board = {"seed_mean": {}, "ensemble": {"gain_over_members": None}}
        return {"scores": {"ensemble": {}, **{f"seed-{m.seed}": {} for m in members}}, "board": board,
                "leaderboard": board_path, "mlflow": {"model_uri": "models:/x/1", "parent_run_id": "r",
                                                      "artifacts": "a"}}

    monkeypatch.setenv(package.WORKER_START_TIMEOUT_ENV, package.WORKER_START_TIMEOUT_S)
    monkeypatch.setattr(package, "open_study", lambda name, storage, verbose=True: (fab.location, fab.spec, None))
    monkeypatch.setattr(package, "ensemble_members",
                        lambda *a, **kw: (calls.append("members"), (members[0], members))[1])
    monkeypatch.setattr(package, "refuse_unreadable", lambda members, local: None)
    monkeypatch.setattr(package, "decoding_data", lambda *a: (None, {}, IMAGES))
    monkeypatch.setattr(package, "decode_all", decode_all)
    monkeypatch.setattr(package, "deliver", deliver)

    def run(out: Path, **options):
        return package.package(NAME, out=out, workers=0, verbose=False, **options)

    return {"run": run, "calls": calls, "state": state}


# -- 1: an --out folder holding someone else's submission -----------------------------------------------------------
def test_a_submission_already_in_the_out_folder_is_never_removed(stubbed, tmp_path, capsys):
    """A folder without package.json was taken for a killed package run's, so its results.zip and results files
    were deleted before this run wrote its own: `a2 package NAME --out ~/coco` over a hand-made submission lost it.
    The folder holds no attempt of this package, so the run writes to NAME-2 and leaves every file as it was."""
    out = tmp_path / "coco"
    out.mkdir()
    mine = {"results.zip": b"my own zip", "captions_val2014_mine_results.json": b"[]",
            "leaderboard.json": b"{\"mine\": 1}", "notes.txt": b"n"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    manifest = stubbed["run"](out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == mine  # untouched, nothing added
    assert manifest["out"] == str(tmp_path / "coco-2")
    assert (tmp_path / "coco-2" / "package.json").is_file() and (tmp_path / "coco-2" / "results.zip").is_file()
    assert (f"{out} holds submission files that no stopped run of {NAME}'s package left; this run writes to {out}-2"
            in capsys.readouterr().out)


def test_a_killed_run_of_this_package_is_still_continued_in_its_own_folder(stubbed, tmp_path):
    """What the outputs of a folder without package.json may be cleared for: a run of this package that stopped
    after its zip (here its delivery failed). The rerun writes into that folder, its stale files replaced; a killed
    run of another study's package in a folder is not this one's to clear."""
    out = tmp_path / "pkg"
    stubbed["state"]["deliver_fails"] = True
    with pytest.raises(PackageError, match="MLflow is down"):
        stubbed["run"](out)
    assert (out / "results.zip").is_file() and not (out / "package.json").exists()
    (out / "captions_val2014_old_results.json").write_text("[]")  # an earlier attempt's, under another --alg
    stubbed["state"]["deliver_fails"] = False
    manifest = stubbed["run"](out)
    assert manifest["out"] == str(out) and (out / "package.json").is_file()
    assert not (out / "captions_val2014_old_results.json").exists()
    assert not (tmp_path / "pkg-2").exists()

    other = tmp_path / "other"
    stubbed["state"]["deliver_fails"] = True
    with pytest.raises(PackageError):
        stubbed["run"](other)
    marker = next(p for p in other.iterdir() if p.name.startswith(".") and p.is_file())
    marker.write_text(json.dumps({"study": "another-study"}))
    zip_bytes = (other / "results.zip").read_bytes()
    stubbed["state"]["deliver_fails"] = False
    assert stubbed["run"](other)["out"] == str(tmp_path / "other-2")
    assert (other / "results.zip").read_bytes() == zip_bytes


# -- 2: the upload target ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("upload", ["s3://", "s3:///packages/", "s3://x/packages/", "s3://Bad_Bucket!/p/"])
def test_a_malformed_upload_uri_is_refused_before_anything_runs(stubbed, tmp_path, upload):
    """`--upload s3://` became the prefix "s3:/", and a bucket name S3 cannot have was taken as it was: both were
    found out only by the upload itself, after the seeds were trained, the images decoded and the model
    registered. Refused first, naming --upload, with no folder made."""
    out = tmp_path / "out"
    with pytest.raises(PackageError, match=r"--upload"):
        stubbed["run"](out, upload=upload)
    assert stubbed["calls"] == [] and not out.exists()


def test_an_upload_bucket_that_does_not_exist_is_refused_before_decoding(stubbed, tmp_path, s3_endpoint):
    """An --upload bucket that is not there (a typo) failed only at the end, after the decoding and the MLflow
    model; it is asked for first (HeadBucket, as a study's storage is), and an existing one still gets the files."""
    from tests.s3server import s3_client, unique_bucket

    out = tmp_path / "out"
    with pytest.raises(PackageError, match=r"--upload s3://no-such-bucket-a2pkg/p/.*no such bucket"):
        stubbed["run"](out, upload="s3://no-such-bucket-a2pkg/p/", s3_endpoint_url=s3_endpoint)
    assert stubbed["calls"] == [] and not out.exists()
    bucket = unique_bucket(s3_endpoint)
    manifest = stubbed["run"](out, upload=f"s3://{bucket}/p", s3_endpoint_url=s3_endpoint)
    assert [u["uri"] for u in manifest["uploads"]] == [f"s3://{bucket}/p/results.zip",
                                                       f"s3://{bucket}/p/leaderboard.json"]
    listed = s3_client(s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]
    assert sorted(o["Key"] for o in listed) == ["p/leaderboard.json", "p/results.zip"]


# -- 3: a server image list with no images -------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["val", "test"])
def test_a_server_image_list_with_no_images_is_refused_naming_it(tmp_path, which):
    """`{"images": []}` as --val-images or --test-images made a zip whose results file held no caption, and it
    validated (every one of no images covered): a submission the server refuses, uploaded as valid. Refused before
    any decoding, naming the file."""
    from a2core import checkpoint as ckpt
    from a2core.config import Config
    from a2core.data import synthetic
    from launch.package import decoding_data

    paths = synthetic.generate(tmp_path / "syn", seed=0, images=40, test_images=10)
    cfg = Config.from_dict({"data": {"kind": "coco", "captions": str(paths["captions"]),
                                     "features": str(paths["features"]), "test_images": str(paths["test_images"])},
                            "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32}})
    path = ckpt.save({"model": {}, "config": cfg.to_dict(), "vocab": ["<pad>", "<bos>", "<eos>", "<unk>"]},
                     tmp_path / "c.pt")
    empty = tmp_path / "image_info_empty.json"
    empty.write_text(json.dumps({"images": []}))
    images = {"val_images": str(empty)} if which == "val" else {"test_images": str(empty)}
    split = f"{which}2014"
    with pytest.raises(PackageError, match=rf"the {split} image list \({empty}\) holds no image"):
        decoding_data(str(path), None, images.get("val_images"), images.get("test_images"))
    _, _, found = decoding_data(str(path), None, None, None)  # the data's own lists have images
    assert found["splits"]["val2014"] and found["splits"]["test2014"]


@pytest.mark.parametrize("which", ["val", "test"])
def test_submission_validate_refuses_an_image_list_with_no_images(tmp_path, capsys, which):
    """`a2 submission validate` against `{"images": []}` passed any zip whose results file for that split was empty
    (every one of no images covered); the server's lists are never empty: refused, exit 2, naming the file."""
    import zipfile

    from launch.cli import main

    files = {"val": tmp_path / "val.json", "test": tmp_path / "test.json"}
    for split, path in files.items():
        path.write_text(json.dumps({"images": [] if split == which else [{"id": 7}]}))
    zip_path = tmp_path / "results.zip"
    with zipfile.ZipFile(zip_path, "w") as zf:
        for split in ("val", "test"):
            captions = [] if split == which else [{"image_id": 7, "caption": "a dog"}]
            zf.writestr(f"captions_{split}2014_a2_results.json", json.dumps(captions))
    code = main(["submission", "validate", str(zip_path), "--val-images", str(files["val"]),
                 "--test-images", str(files["test"])])
    assert code == 2
    assert f"{files[which]}: holds no image (--{which}-images)" in capsys.readouterr().err


@pytest.mark.parametrize("upload", ["s3://", "s3://x/p/", "/tmp/subs"])
def test_a2_pipeline_refuses_a_malformed_upload_before_its_study(tmp_path, monkeypatch, capsys, upload):
    """`a2 pipeline --upload` was checked only when its package step started: after the whole study had trained and
    its report was built. Refused first now, exit 2, with nothing written and no study started."""
    import launch.commands.pipeline as pipeline
    from launch.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pipeline, "run_or_reuse", lambda *a, **k: pytest.fail("the study started"))
    assert main(["pipeline", "--upload", upload, "--out", str(tmp_path / "out")]) == 2
    assert "--upload" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
