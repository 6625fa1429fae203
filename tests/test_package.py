"""`a2 package` on the synthetic set: best configuration -> 4 seeds -> ensemble -> results.zip, leaderboard,
upload, MLflow model.

The "pre-run study" is built without Ray to save time: three tiny checkpoints of one configuration (gate fusion,
seeds 0, 1, 2) are trained directly with `a2core.train.train`, put where Ray Train puts a trial's checkpoints,
and described by `study.yaml`, their result logs and Tune's experiment state (`tests.tunestate`, Ray's own classes),
which packaging reads as the study's record (`launch.record.StudyRecord`). A fourth trial (the baseline) errored
without a result. Packaging seeds 0-3 then has to train seed 3, which it does as a real
Ray study.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.raycluster import tiny_data, tiny_study  # noqa: F401
from tests.s3server import s3_client, unique_bucket

NAME = "pkg"
TRAINED_SEEDS = (0, 1, 2)


# -- unit: selection and hashing (no training) ---------------------------------------------------------------------
def _cand(trial_id, seed, value, digest="h1", state="TERMINATED", study="s"):
    from dashboards.runs import Trial

    return Trial(trial_id, study=study, state=state, config={"train": {"seed": seed}}, config_hash=digest,
                 best_value=value, best_checkpoint=f"/ckpt/{trial_id}")



@pytest.mark.parametrize("fused", [False, True])
def test_an_unfinished_seed_study_is_resumed_and_its_seeds_not_trained_again(tmp_path, monkeypatch, fused):
    """A package run killed while its companion study trained the missing seeds: the next one resumes that study
    and trains only the seeds it does not cover, its seeds fused in one trial or a seed grid alike (fused seeds have
    no `seed` key in the space: their study was refused with a KeyError)."""
    from types import SimpleNamespace

    from launch import package
    from launch.location import StudyLocation
    from launch.spec import load_study
    from tests.studyfolder import SMOKE

    parent = load_study(SMOKE, [f"resources.fuse_replicates={str(fused).lower()}", f"storage={tmp_path}"])
    config = parent.trial_config({"fusion": "gate", "lambda": 0.035, "seed": 0})
    location = StudyLocation(parent.name, str(tmp_path))
    companion = package.seeds_spec(parent, location, config, [4, 5], "a2-smoke-seeds-x-0")
    assert companion.seed_values == [4, 5] and companion.resources.fuse_replicates is fused
    comp_location = StudyLocation(companion.name, str(tmp_path))
    calls = []
    monkeypatch.setattr(package, "_companions", lambda loc, digest: [(comp_location, companion,
                                                                      SimpleNamespace(trials=[]))])
    monkeypatch.setattr(package, "resume_study", lambda loc, **kw: calls.append(("resume", loc.name)))
    monkeypatch.setattr(package, "run_study", lambda spec, **kw: calls.append(("run", spec.seed_values)))
    monkeypatch.setattr(package.StudyRecord, "load", lambda *a, **kw: SimpleNamespace(trials=[]))
    best = SimpleNamespace(config_hash="0123456789abcdef", config=config, trial_id="t1")
    assert package.train_missing(parent, location, best, [4, 5, 6], address=None, verbose=False) == []
    assert calls == [("resume", companion.name), ("run", [6])]


def test_package_takes_the_records_best_trial_and_seeds_group_by_config():
    """The best configuration and trial are the record's (`launch.record.best_group`, tested for every view in
    tests/test_best_epoch.py); package only falls back within that configuration when its trial has no checkpoint."""
    from dashboards.runs import ReplicateGroup
    from launch.package import PackageError, select_best, seed_checkpoints

    rows = [_cand("t3", 0, 0.5, "h2"), _cand("t1", 1, 0.5, "h1"), _cand("t2", 0, 0.4, "h1"),
            _cand("t4", 2, 0.45, "h1", state="ERROR"), _cand("t5", 2, 0.3, "h1"), _cand("t6", 1, 0.2, "h1")]
    group = ReplicateGroup("h1", trials=["t1", "t2", "t4", "t5", "t6"], best_trial="t1")
    assert select_best(group, rows, "max", "s")["trial_id"] == "t1"
    without = [r for r in rows if r.trial_id != "t1"]  # the named trial's checkpoint is not a candidate
    assert select_best(group, without, "max", "s")["trial_id"] == "t4"
    assert select_best(group, without, "min", "s")["trial_id"] == "t6"
    chosen, missing = seed_checkpoints(rows, "h1", [0, 1, 2, 3], "max", exists=lambda uri: uri != "/ckpt/t2")
    # seed 0: t2 is the only h1 trial and its checkpoint is gone (t3 has another config); seed 2: finished t5
    # before the errored (if better) t4; seed 1: the best, t1.
    assert {s: c.trial_id for s, c in chosen.items()} == {1: "t1", 2: "t5"}
    assert missing == [0, 3]
    with pytest.raises(PackageError, match="nothing to package"):
        select_best(None, [], "max", "s")
    with pytest.raises(PackageError, match=r"study s: no trial .*config h9.*trials x0, x1\) has a stored checkpoint"):
        select_best(ReplicateGroup("h9", trials=["x0", "x1"]), rows, "max", "s")


def test_four_replicates_of_the_best_configuration_are_the_ensemble():
    from launch.package import ensemble_seeds

    rows = [_cand(f"r{s}", s, 0.5, "h1") for s in (3, 5, 7, 9)] + [_cand("x", 0, 0.9, "h2")]
    assert ensemble_seeds(rows, "h1", exists=lambda uri: True)[0] == [3, 5, 7, 9]  # nothing to train
    seeds, why = ensemble_seeds(rows, "h1", exists=lambda uri: uri != "/ckpt/r9")
    assert seeds == [0, 1, 2, 3] and "3 replicate(s)" in why


def test_config_hash_ignores_seed_and_output_dir():
    from dashboards.leaderboard import config_hash

    a = {"model": {"fusion": "gate", "lambda": 0.035}, "train": {"seed": 0, "xe_epochs": 2}, "output_dir": "x"}
    b = {"output_dir": "y", "train": {"xe_epochs": 2, "seed": 3}, "model": {"lambda": 0.035, "fusion": "gate"}}
    c = {"model": {"fusion": "gate", "lambda": 0.05}, "train": {"seed": 0, "xe_epochs": 2}}
    assert config_hash(a) == config_hash(b) != config_hash(c)
    assert len(config_hash(a)) == 64


# -- unit: the steps of package() that need no training ---------------------------------------------------------------
FILES = ("captions_val2014_alg_results.json", "captions_test2014_alg_results.json")


def test_write_submission_validates_before_the_zip_exists(tmp_path):
    from launch.package import PackageError, write_submission

    images = {"splits": {"val2014": [1, 2], "test2014": [3], "test": [7]}, "sources": {}, "max_len": 20}
    decoded = {"ensemble": {"val2014": {1: "a dog", 2: "a cat"}, "test2014": {3: "a bird"}, "test": {7: "x"}}}
    out = write_submission(tmp_path, FILES, decoded, images, "alg", verbose=False)
    assert out["zip"] == tmp_path / "results.zip" and out["alg"] == "alg"
    assert zipfile.ZipFile(out["zip"]).namelist() == list(FILES)
    assert json.loads((tmp_path / FILES[1]).read_text()) == [{"image_id": 3, "caption": "a bird"}]
    assert json.loads((tmp_path / "captions_karpathy_test_ensemble.json").read_text()) == [
        {"image_id": 7, "caption": "x"}]
    out["zip"].unlink()
    decoded["ensemble"]["test2014"][3] = " "
    with pytest.raises(PackageError, match="empty_caption"):
        write_submission(tmp_path, FILES, decoded, images, "alg", verbose=False)
    assert not list(tmp_path.glob("*.zip*")) and not list(tmp_path.glob(".results.zip*"))


def test_candidates_keep_trials_with_a_checkpoint_of_the_configuration_asked_for(capsys):
    from a2core.errors import ConfigError
    from dashboards.leaderboard import config_hash
    from dashboards.runs import Trial
    from launch.package import candidates

    class Spec:
        name = "s"

        def trial_config(self, sampled):
            if sampled["fusion"] == "old":
                raise ConfigError("model.fusion", "unknown fusion 'old'")
            return {"model": {"fusion": sampled["fusion"]}, "train": {"seed": sampled["seed"]}}

    def trial(trial_id, sampled, best, checkpoint):  # as the record makes it: its config resolved, {} if it is not
        config = {} if sampled["fusion"] == "old" else Spec().trial_config(sampled)
        return Trial(trial_id, sampled=sampled, config=config, config_hash=config_hash(config) if config else None,
                     best_value=best, best_checkpoint=checkpoint)

    trials = [trial("a", {"fusion": "gate", "seed": 0}, 1.5, "/c/a"),
              trial("b", {"fusion": "gate", "seed": 1}, None, "/c/b"),
              trial("c", {"fusion": "none", "seed": 0}, 2.0, "/c/c"),
              trial("d", {"fusion": "gate", "seed": 2}, 1.0, None),
              trial("e", {"fusion": "old", "seed": 0}, 3.0, "/c/e")]
    assert [c.trial_id for c in candidates(Spec(), trials)] == ["a", "c"]
    assert "a2 package: note: skipping trial e of s: model.fusion: unknown fusion 'old'" in capsys.readouterr().err
    gate = config_hash({"model": {"fusion": "gate"}, "train": {"seed": 0}})
    (row,) = candidates(Spec(), trials, gate)
    assert (row.trial_id, row.seed, row.best_value, row.best_checkpoint) == ("a", 0, 1.5, "/c/a")


def test_upload_prefix_seed_study_names_and_local_checkpoints(tmp_path):
    from launch.package import PackageError, _upload_prefix, fetch_checkpoint, seed_study_name
    from launch.location import StudyLocation

    local, on_s3 = StudyLocation("st", str(tmp_path)), StudyLocation("st", "s3://bucket/studies")
    assert _upload_prefix(local, None) is None  # a local study uploads nothing unless asked
    assert _upload_prefix(on_s3, None) == "s3://bucket/studies/st/package/"
    assert _upload_prefix(local, "s3://subs-bucket/subs") == "s3://subs-bucket/subs/"
    with pytest.raises(PackageError, match="--upload must be an s3:// URI"):
        _upload_prefix(local, "/tmp/subs")
    assert seed_study_name("pkg", "0123456789abcdef", 2) == "pkg-seeds-01234567-2"
    assert len(seed_study_name("x" * 80, "0123456789abcdef", 0)) == 64
    checkpoint = tmp_path / "checkpoint.pt"
    assert fetch_checkpoint(str(checkpoint), tmp_path / "cache") == str(checkpoint)  # a local one is not copied



def test_a_checkpoint_stored_again_under_its_uri_is_downloaded_again(tmp_path, s3_endpoint):
    """The download cache outlives a package run: a checkpoint trained again under the same URI (a study started
    again in place) is fetched anew, with or without the object's stored sha256 (a trial's checkpoints are copied to
    S3 without it, their checksum file beside them), never the older bytes, which their older checksum file passed."""
    from a2core.checksum import checksum_problem, write_checksum
    from launch.package import fetch_checkpoint
    from launch.storage import open_location, upload_file

    bucket = unique_bucket(s3_endpoint, "ckcache")
    local = tmp_path / "checkpoint.pt"
    for n, (uploaded, body) in enumerate([(True, "old weights"), (True, "new weights"),
                                          (False, "old again!!"), (False, "new again!!")]):  # one length
        local.write_text(body)
        uri = f"s3://{bucket}/st/trials/t{n // 2}/checkpoint_000003/checkpoint.pt"
        if uploaded:  # with its sha256 in the object's metadata
            upload_file(local, uri, endpoint_url=s3_endpoint)
        else:  # as `copy_folder` stores a trial's: plain objects, the checksum file beside
            write_checksum(local)
            open_location(uri + ".sha256", s3_endpoint).write_text(Path(f"{local}.sha256").read_text())
            open_location(uri, s3_endpoint).write_text(body)
        got = fetch_checkpoint(uri, tmp_path / "cache", s3_endpoint)
        assert Path(got).read_text() == body
        if not uploaded:  # the checksum file beside the copy is its own, which `a2core.checkpoint.load` checks
            assert checksum_problem(got, Path(f"{got}.sha256").read_text(), got) is None


def test_write_manifest_names_members_scores_and_uploads(tmp_path):
    from launch.package import write_manifest
    from launch.location import StudyLocation

    from dashboards.runs import Trial

    members = [Trial(f"t{s}", study="st", config={"model": {"fusion": "gate"}, "train": {"seed": s}}, config_hash="h",
                     best_checkpoint=f"/c/{s}", best_value=1.0 + s) for s in (0, 1)]
    best = members[1]
    results = {"zip": tmp_path / "results.zip", "files": [tmp_path / "v.json", tmp_path / "t.json"]}
    delivered = {"leaderboard": tmp_path / "leaderboard.json", "mlflow": {"model_uri": "models:/st/1"},
                 "scores": {"ensemble": {"CIDEr": 9.0}, "seed-0": {"CIDEr": 7.0}, "seed-1": {"CIDEr": 8.0}},
                 "board": {"seed_mean": {"CIDEr": {"mean": 7.5}}, "ensemble": {"gain_over_members": {"delta": 1.0}}}}
    uploads = [{"uri": "s3://b/results.zip", "sha256": "ab", "size": 3, "bucket": "b", "uploaded": False}]
    manifest = write_manifest(tmp_path, StudyLocation("st", str(tmp_path / "studies")), best, members, results,
                              delivered, uploads, 1.234, 5.678)
    assert json.loads((tmp_path / "package.json").read_text()) == json.loads(json.dumps(manifest, default=str))
    assert manifest["study"] == "st" and manifest["seeds"] == [0, 1] and manifest["best_trial"] == "t1"
    assert manifest["seed_CIDEr"] == {0: 7.0, 1: 8.0} and manifest["ensemble_CIDEr"] == 9.0
    assert manifest["fusion"] == "gate" and manifest["ensemble_gain"] == {"delta": 1.0}
    # "uploaded" False: the prefix held these bytes already (a rerun), left as they were
    assert manifest["uploads"] == [{"uri": "s3://b/results.zip", "sha256": "ab", "size": 3, "uploaded": False}]
    assert (manifest["decode_seconds"], manifest["seconds"]) == (1.23, 5.68)


def test_upload_all_is_verified_or_a_package_error(s3_endpoint, tmp_path):
    from launch.package import PackageError, upload_all

    bucket = unique_bucket(s3_endpoint)
    board = tmp_path / "leaderboard.json"
    board.write_text('{"study": "x"}')
    assert upload_all([board], None, s3_endpoint, verbose=False) == []  # no prefix: nothing to upload
    (info,) = upload_all([board], f"s3://{bucket}/sub/", s3_endpoint, verbose=False)
    assert info["uri"] == f"s3://{bucket}/sub/leaderboard.json" and info["sha256"] == _sha256(board)
    with pytest.raises(PackageError, match="upload of leaderboard.json to s3://no-such-bucket-a2tune/x/"):
        upload_all([board], "s3://no-such-bucket-a2tune/x/", s3_endpoint, verbose=False)


# -- the pre-run study ---------------------------------------------------------------------------------------------
def _study_file(directory: Path, data_root: Path, storage: Path, mlflow_uri: str) -> Path:
    return tiny_study(directory, NAME, data_root, fusions=("none", "gate"), seeds=TRAINED_SEEDS, epochs=2,
                      workers=1, cpus_per_worker=1, storage=storage, mlflow_uri=mlflow_uri,
                      extra={"model.max_regions": 10})


@pytest.fixture(scope="session")
def trained(tmp_path_factory, tiny_data):
    """Tiny gate-fusion checkpoints of seeds 0, 1, 2 (d_model 32, 1 layer, 2 heads, 200 images, 2 epochs)."""
    from a2core.train import train
    from launch.spec import load_study

    root = tmp_path_factory.mktemp("pkg-trained")
    spec = load_study(_study_file(root, tiny_data, root / "unused", f"sqlite:///{root / 'unused.db'}"))
    runs = {}
    for seed in TRAINED_SEEDS:
        runs[seed] = train(spec.trial_config({"fusion": "gate", "seed": seed}), output_dir=str(root / f"seed{seed}"))
    return {"data": tiny_data, "runs": runs}


@pytest.fixture
def study(tmp_path, trained, monkeypatch):
    """A finished study in tmp_path/studies laid out as `a2 study run` leaves it (study.yaml, Tune's experiment
    state, Ray Train trial folders with their result logs and best checkpoints, summary.json); cwd is tmp_path."""
    from launch.spec import load_study
    from launch.record import StudyRecord
    from launch.location import STUDY_FILE, SUMMARY_FILE, StudyLocation, saved_form
    from launch.layout import CHECKPOINT_FILE, RESULTS_FILE, TRIALS_DIR, train_run_name
    from tests.tunestate import experiment_storage, save_experiment_state, tune_trial

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = load_study(_study_file(tmp_path, trained["data"], tmp_path / "studies", uri))
    location = StudyLocation(NAME, spec.storage)
    location.write_text(yaml.safe_dump(saved_form(spec), sort_keys=False), STUDY_FILE)
    folder = Path(location.uri())
    storage, tune = experiment_storage(folder), []
    for i, seed in enumerate(TRAINED_SEEDS):
        trial_id = f"fixt0_{i:05d}"
        result = trained["runs"][seed]
        run_dir = Path(location.uri(TRIALS_DIR, train_run_name(NAME, trial_id)))
        target = run_dir / f"checkpoint_epoch{result['best_epoch']:04d}" / CHECKPOINT_FILE
        target.parent.mkdir(parents=True)
        shutil.copy(result["best_checkpoint"], target)
        (run_dir / RESULTS_FILE).write_text(json.dumps(result["history"], default=str))
        tune.append(tune_trial(storage, trial_id, {"fusion": "gate", "seed": seed}, i, results=result["history"],
                               started=False))
    # the baseline errored without a result
    tune.append(tune_trial(storage, "fixt0_00003", {"fusion": "none", "seed": 0}, 3, status="ERROR", started=False))
    save_experiment_state(folder, tune)
    summary = StudyRecord.load(location, spec).summary()
    assert summary["best"]["fusion"] == "gate" and [t["state"] for t in summary["trials"]] == ["TERMINATED"] * 3 + [
        "ERROR"]
    location.write_text(json.dumps(summary, indent=2, default=str), SUMMARY_FILE)
    return {"spec": spec, "location": location, "storage": tmp_path / "studies", "uri": uri,
            "data": trained["data"], "summary": summary}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()




# -- --no-train ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_no_train_refuses_naming_the_missing_seeds(study, tmp_path, capsys):
    from launch.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "results.zip").write_bytes(b"earlier")  # an earlier package: never overwritten, never removed
    rc = main(["package", NAME, "--storage", str(study["storage"]), "--no-train", "--out", str(out),
               "--seeds", "0", "1", "2", "3", "--workers", "0"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "seed(s) 3" in err and "--no-train" in err
    assert "seed 0: trial fixt0_00000" in err  # says what it found, too
    assert (out / "results.zip").read_bytes() == b"earlier"
    assert not (tmp_path / "out-2" / "results.zip").exists()  # the refused run wrote no package anywhere
    assert not (study["storage"] / NAME / "seed_studies.json").exists()  # nothing was trained


# -- the whole package, with the missing seed trained on Ray --------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_package_trains_missing_seed_on_ray_and_delivers(study, tmp_path, s3_endpoint, capsys):
    import mlflow
    from mlflow.tracking import MlflowClient

    from dashboards.leaderboard import config_hash
    from a2core.data.captions import read_image_info
    from dashboards.submission import validate_zip
    from launch.cli import main
    from launch.package import decode_all

    bucket = unique_bucket(s3_endpoint, "pkg")
    out = tmp_path / "out"
    rc = main(["package", NAME, "--storage", str(study["storage"]), "--out", str(out), "--workers", "2",
               "--upload", f"s3://{bucket}/submissions/", "--s3-endpoint-url", s3_endpoint, "--quiet"])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-4000:]

    # Seed 3 was trained as a companion Ray study of the best configuration.
    companions = json.loads((study["storage"] / NAME / "seed_studies.json").read_text())["studies"]
    assert len(companions) == 1
    comp_summary = json.loads((study["storage"] / companions[0] / "summary.json").read_text())
    (trial,) = comp_summary["trials"]
    assert trial["seed"] == 3 and trial["state"] == "TERMINATED"
    assert (study["storage"] / companions[0] / trial["best_checkpoint"]).is_file()  # relative to the study's folder

    # The zip: exactly the two server files at its root, valid against the image lists.
    data = study["data"]
    val_ids = read_image_info(data / "image_info_val2014.json")
    test_ids = read_image_info(data / "image_info_test2014.json")
    zip_path = out / "results.zip"
    zip_bytes = zip_path.read_bytes()
    report = validate_zip(zip_path, val_ids, test_ids, alg=NAME)
    assert report.ok, str(report)
    with zipfile.ZipFile(zip_path) as zf:
        assert sorted(zf.namelist()) == [f"captions_test2014_{NAME}_results.json",
                                         f"captions_val2014_{NAME}_results.json"]
        test_entries = json.loads(zf.read(f"captions_test2014_{NAME}_results.json"))
        val_entries = json.loads(zf.read(f"captions_val2014_{NAME}_results.json"))
    assert sorted(e["image_id"] for e in test_entries) == sorted(test_ids)  # each test image exactly once
    assert len(test_entries) == len(set(test_ids)) == 20
    assert len(val_entries) == len(set(val_ids))
    assert all(isinstance(e["caption"], str) and e["caption"].strip() for e in test_entries + val_entries)

    # The leaderboard: four seeds, their mean with its interval, the ensemble and its gain over the best seed.
    board = json.loads((out / "leaderboard.json").read_text())
    entries = {e["name"]: e for e in board["entries"]}
    assert list(entries) == ["seed-0", "seed-1", "seed-2", "seed-3", "ensemble"]
    ens = entries["ensemble"]["metrics"]["CIDEr"]
    assert isinstance(ens, float) and ens >= 0
    for seed in range(4):
        e = entries[f"seed-{seed}"]
        assert e["seed"] == seed and "ensemble_CIDEr" not in e
        assert set(e["metrics"]) >= {"BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr"}
        assert Path(e["checkpoint"]).is_file()
    assert entries["seed-3"]["study"] == companions[0]
    assert {entries[f"seed-{s}"]["trial_id"] for s in TRAINED_SEEDS} == {"fixt0_00000", "fixt0_00001", "fixt0_00002"}
    expected_hash = config_hash(study["spec"].trial_config({"fusion": "gate", "seed": 0}))
    assert board["configuration"]["hash"] == expected_hash
    assert all(e["config_hash"] == expected_hash for e in board["entries"])
    assert board["seeds"] == [0, 1, 2, 3] and board["evaluation"]["images"] == 50  # the synthetic test split: a quarter of 200
    assert board["paper"]["table3"]["row"] == "Gate Mechanism"
    assert board["paper"]["table3"]["metrics"]["CIDEr"] == 125.0
    assert board["paper"]["table1"]["row"] == "A2 Transformer"
    assert board["paper"]["table1"]["metrics"]["CIDEr"] == 125.0  # cross-entropy column: no SCST epochs here
    assert len(board["git_commit"]) == 40
    seed_ciders = [entries[f"seed-{s}"]["metrics"]["CIDEr"] for s in range(4)]
    assert board["seed_mean"]["CIDEr"]["n"] == 4
    assert board["seed_mean"]["CIDEr"]["mean"] == pytest.approx(sum(seed_ciders) / 4, abs=1e-3)
    gain = board["ensemble"]["gain_over_members"]
    assert gain["images"] == 50 and gain["seeds"] == 4  # paired over the test images, the members' seed spread
    assert gain["delta"] == pytest.approx(ens - sum(seed_ciders) / 4, abs=1e-3)
    if gain["low"] is None:  # this tiny fixture's seeds can caption every test image alike: then no interval
        assert len(set(seed_ciders)) == 1 and "the seed changes nothing" in gain["verdict"], gain
    else:
        assert gain["low"] <= gain["delta"] <= gain["high"]
    chosen = board["ensemble"]["gain_over_chosen"]  # the member with the best validation score, not the best test
    seeds = [entries[f"seed-{s}"] for s in range(4)]
    assert chosen["member"] == max(seeds, key=lambda e: e["study_metric"])["name"]
    assert board["evaluation"]["scale"] == "x100"
    assert "ens C" not in printed and "seed mean [95% CI]" in printed and "paper T3 Gate Mechanism" in printed

    # Provenance: the trained seed's MLflow run is the companion study's trial run.
    client = MlflowClient(tracking_uri=study["uri"])
    seed3_run = client.get_run(entries["seed-3"]["mlflow_run_id"])
    assert seed3_run.data.tags["a2.trial_id"] == entries["seed-3"]["trial_id"]
    assert seed3_run.data.tags["a2.seed"] == "3"

    # Uploads landed on the S3 endpoint with the local bytes' sha256.
    s3 = s3_client(s3_endpoint)
    for fname in ("results.zip", "leaderboard.json"):
        head = s3.head_object(Bucket=bucket, Key=f"submissions/{fname}")
        assert head["Metadata"]["sha256"] == _sha256(out / fname)
        assert head["ContentLength"] == (out / fname).stat().st_size

    # MLflow: zip and leaderboard are artifacts of the study's parent run; the ensemble is a model version.
    parent_id = board["mlflow"]["parent_run_id"]
    names = {f.path for f in client.list_artifacts(parent_id, "package")}
    assert names == {"package/results.zip", "package/leaderboard.json"}
    versions = client.search_model_versions(f"name='{NAME}'")
    assert [int(v.version) for v in versions] == [board["mlflow"]["model_version"]] == [1]
    assert versions[0].tags["a2.config_hash"] == expected_hash

    # The registered model captions like the submission did (same checkpoints, same beam search).
    captions = {e["image_id"]: e["caption"] for e in test_entries}
    mlflow.set_tracking_uri(study["uri"])
    try:
        model = mlflow.pyfunc.load_model(f"models:/{NAME}/1")
    finally:
        mlflow.set_tracking_uri(None)
    some = sorted(test_ids)[:3]
    pred = model.predict(pd.DataFrame({"image_id": some}))
    assert list(pred["image_id"]) == some
    assert list(pred["caption"]) == [captions[i] for i in some]

    # The in-process fallback (--workers 0) gives the same captions as the Ray shards.
    checkpoints = [e["checkpoint"] for e in board["entries"] if e["kind"] == "checkpoint"]
    config = study["spec"].trial_config({"fusion": "gate", "seed": 0})
    local = decode_all(checkpoints, config["data"], {"test2014": sorted(test_ids)}, None, beam_size=5, max_len=20,
                       batch_size=50, workers=0, address=None, endpoint_url=None, verbose=False)
    assert local["ensemble"]["test2014"] == captions

    # Packaging again: a new numbered folder, and the same model version (nothing registered twice).
    rc = main(["package", NAME, "--storage", str(study["storage"]), "--out", str(out), "--workers", "0", "--quiet"])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-4000:]
    assert f"{out} holds an earlier package; this run writes to {out}-2" in printed
    assert (out / "results.zip").read_bytes() == zip_bytes  # the first package is untouched
    again = json.loads((tmp_path / "out-2" / "package.json").read_text())["mlflow"]
    assert (again["version"], again["reused"]) == (1, True)
    assert [int(v.version) for v in client.search_model_versions(f"name='{NAME}'")] == [1]


# -- a submission that fails validation is refused, and leaves no results.zip -----------------------------------------
@pytest.mark.slow
def test_invalid_submission_is_refused_and_leaves_no_zip(study, tmp_path, capsys, monkeypatch):
    import launch.package as package_mod
    from launch.cli import main

    def decode_with_a_blank(checkpoints, data_config, splits, single_split, **kwargs):
        ens = {split: {i: "a caption" for i in ids} for split, ids in splits.items()}
        ens["test2014"][sorted(splits["test2014"])[0]] = "  "
        return {"ensemble": ens, "single": [dict(ens["test"]) for _ in checkpoints], "seconds": 0.0}

    monkeypatch.setattr(package_mod, "decode_all", decode_with_a_blank)
    out = tmp_path / "out"
    rc = main(["package", NAME, "--storage", str(study["storage"]), "--out", str(out), "--seeds", "0", "1", "2",
               "--workers", "0", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "failed validation" in err and "empty_caption" in err
    assert not (out / "results.zip").exists()
    assert not list(out.glob("*.zip*")) and not list(out.glob(".results.zip*"))
    assert not (out / "leaderboard.json").exists()



def test_each_account_of_a_machine_caches_checkpoints_in_a_folder_of_its_own(monkeypatch):
    """A cluster node's Ray runs as one account and a laptop's tests or another user as others, all sharing the
    temp folder: the copies of s3:// checkpoints go to a folder per user, so that one account's folder never blocks
    another's packaging (a how-to run beside the suite failed on a root-owned cache with PermissionError)."""
    import os
    import tempfile

    from launch.package import checkpoint_cache

    mine = checkpoint_cache()
    assert mine == Path(tempfile.gettempdir()) / f"a2-package-checkpoints-{os.getuid()}"
    monkeypatch.setattr(os, "getuid", lambda: 65534)
    assert checkpoint_cache() != mine and checkpoint_cache().name == "a2-package-checkpoints-65534"


def test_missing_seeds_of_a_fused_study_train_fused(tmp_path):
    """The companion study that trains the ensemble's missing seeds (`launch.package.seeds_spec`) fuses them, in one
    trial, when the study's seeds were fused and there are two or more; one missing seed is a trial of its own."""
    from launch.location import StudyLocation
    from launch.package import seeds_spec
    from launch.spec import load_study
    from tests.studyfolder import SMOKE

    parent = load_study(SMOKE, ["resources.fuse_replicates=true", f"storage={tmp_path}"])
    config = parent.trial_config({"fusion": "gate", "lambda": 0.035, "seed": 0})
    location = StudyLocation("a2-smoke", str(tmp_path))
    two = seeds_spec(parent, location, config, [4, 5], "a2-smoke-seeds")
    assert two.resources.fuse_replicates and two.replicate_seeds == [4, 5]
    assert (two.num_trials, two.tune_samples) == (2, 1)
    assert two.trial_config({"seed": 4})["model"] == config["model"]
    one = seeds_spec(parent, location, config, [4], "a2-smoke-seeds")
    assert not one.resources.fuse_replicates and (one.num_trials, one.tune_samples) == (1, 1)
    assert one.seed_values == [4]
    # a parent's captured step: kept for fused seeds, dropped with the fusion (no fused step to capture)
    captured = load_study(SMOKE, ["resources.fuse_replicates=true", "resources.capture_step=true",
                                  "resources.gpus_per_worker=1", f"storage={tmp_path}"])
    assert seeds_spec(captured, location, config, [4, 5], "a2-smoke-seeds").resources.capture_step
    assert not seeds_spec(captured, location, config, [4], "a2-smoke-seeds").resources.capture_step
