"""Faults a cluster week brings, each as an operator meets it, without Ray (tests/test_probe_faults_ray.py has the
driver's part): `a2 mlflow sync --force` takes over a stale lease; a study's data changed under it is refused on
resume naming the file; a copied or moved study reads and packages its own checkpoints (summary.json holds paths
relative to the study's folder; an older one's absolute paths are placed where the study is now); a checkpoint's
flipped byte is named by `a2 study check`, by packaging and by a trial's resume (its SHA-256 beside it); a damaged
summary.json is one line; readers of a study that is starting say so; an MLflow artifact store on a full disk is
named as such, not as a server down."""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from a2core.checksum import SUFFIX, write_checksum
from a2core.errors import PackageError
from launch.cli import main
from launch.layout import TRIALS_DIR, checkpoint_name, train_run_name
from launch.lease import LEASE_FILE, StudyLease
from launch.location import SUMMARY_FILE, StudyLocation
from tests.studyfolder import fabricated_study

TINY_MODEL = ("model.d_model=16", "model.layers=1", "model.heads=2", "model.d_ff=32")
SEEDS = (0, 1, 2, 3)


def _stale_lease(study_dir: Path, age: float) -> None:
    """The lease of a driver on another host, last written `age` s ago (its file's time: the storage's clock)."""
    (study_dir / LEASE_FILE).write_text(json.dumps(
        {"user": "someone", "host": "elsewhere", "pid": 4242, "token": "theirs", "started": "2026-01-01T00:00:00Z",
         "heartbeat": time.time() - age, "stale_after": 120.0}))
    os.utime(study_dir / LEASE_FILE, (time.time() - age, time.time() - age))


def _checkpoint(spec, sampled: dict, file: Path, epoch: int) -> None:
    """A real checkpoint of the trial's configuration (tiny weights), with its SHA-256 beside it, as a trial stores it."""
    import torch

    from a2core import checkpoint as ckpt
    from a2core.config import Config
    from a2core.data.captions import SPECIALS
    from a2core.model.a2 import build_model

    torch.manual_seed(epoch)
    config = spec.trial_config(sampled)
    cfg = Config.from_dict(config)
    vocab = [*SPECIALS, "a", "b", "c"]
    model = build_model(cfg.model, len(vocab), cfg.data.max_caption_len + 2)
    file.parent.mkdir(parents=True, exist_ok=True)
    ckpt.save({"format": ckpt.FORMAT, "model": model.state_dict(), "config": config, "vocab": vocab,
               "epoch": epoch, "best": {"val/CIDEr": 10.0 + epoch, "epoch": epoch}}, file)
    write_checksum(file)


@pytest.fixture
def replicated(tmp_path, monkeypatch):
    """A study of one configuration (fusion none) over 4 seeds, 2 epochs each, every epoch's checkpoint stored, its
    summary written by the driver's own `finish`."""
    from launch.driver import finish

    fab = fabricated_study(tmp_path, "rep", epochs=2, overrides=TINY_MODEL)
    for seed in SEEDS:
        sampled = {"fusion": "none", "seed": seed}
        fab.add(f"t{seed}", sampled, [{"epoch": e, "val/CIDEr": 10.0 + e + seed} for e in (1, 2)])
        run = Path(fab.location.uri(TRIALS_DIR, train_run_name("rep", f"t{seed}")))
        for epoch in (1, 2):
            _checkpoint(fab.spec, sampled, run / checkpoint_name(epoch) / "checkpoint.pt", epoch)
    fab.patch_tune(monkeypatch)
    finish(fab.spec, fab.location, verbose=False)
    return fab


# -- 6: `a2 mlflow sync` takes a stale lease over with --force ------------------------------------------------------
def test_mlflow_sync_takes_over_a_stale_lease_with_force(tmp_path, monkeypatch, capsys):
    fab = fabricated_study(tmp_path, "synced", epochs=1)
    fab.add("a0", {"fusion": "none", "seed": 0}, [{"epoch": 1, "val/CIDEr": 10.0}])
    fab.patch_tune(monkeypatch)
    study_dir = Path(fab.location.uri())
    _stale_lease(study_dir, age=1000)
    storage = str(fab.spec.storage)
    assert main(["mlflow", "sync", "synced", "--storage", storage]) == 2
    refused = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stale lease of someone@elsewhere pid 4242" in refused and "--force" in refused, refused
    assert main(["mlflow", "sync", "synced", "--storage", storage, "--force"]) == 0  # what the refusal says works
    out = capsys.readouterr()
    assert "taking over the stale lease of someone@elsewhere pid 4242" in out.err
    assert out.out.strip().splitlines()[-1].startswith("study synced: exported to MLflow")
    assert not (study_dir / LEASE_FILE).exists()  # released


# -- 2: a study's data fingerprinted at start, a changed file refused on resume --------------------------------------
def _coco_study(tmp_path: Path, name: str):
    from a2core.data.synthetic import ensure

    data = tmp_path / "coco"
    ensure(data, seed=0, images=60)
    fab = fabricated_study(tmp_path, name, epochs=1, overrides=(
        "data={kind: coco}", f"data.captions={data / 'dataset_coco.json'}", f"data.features={data / 'features.h5'}",
        f"data.test_images={data / 'image_info_test2014.json'}", *TINY_MODEL))
    return fab, data


def test_changed_features_are_refused_on_resume_naming_the_file(tmp_path, monkeypatch, capsys):
    """Features regenerated at the same path (other values, same size) between a stop and a resume: exit 2, one
    line naming data.features, its path and both digests, before Ray (no driver is started)."""
    import launch.driver
    from a2core.data.synthetic import ensure
    from launch.fingerprint import FINGERPRINT_FILE, refuse_changed_data, save_data_fingerprint

    fab, data = _coco_study(tmp_path, "fp")
    save_data_fingerprint(fab.spec, fab.location)  # what `run` writes before study.yaml
    saved = json.loads(Path(fab.location.uri(FINGERPRINT_FILE)).read_text())
    assert sorted(saved) == ["data.captions", "data.features", "data.test_images"]
    monkeypatch.setattr(launch.driver, "_drive", lambda *a, **k: pytest.fail("resumed on changed data"))

    shutil.copytree(data, tmp_path / "coco-copy", copy_function=shutil.copyfile)  # same bytes, other times
    shutil.rmtree(data)
    shutil.copytree(tmp_path / "coco-copy", data, copy_function=shutil.copyfile)
    refuse_changed_data(fab.spec, fab.location)  # not a change
    shutil.rmtree(data)
    ensure(data, seed=1, images=60)  # regenerated: another seed's features at the same path
    for kept in ("dataset_coco.json", "image_info_test2014.json"):  # the rest as it was
        shutil.copyfile(tmp_path / "coco-copy" / kept, data / kept)
    code = main(["study", "resume", "fp", "--storage", str(fab.spec.storage)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2, line
    assert f"data.features ({data / 'features.h5'}) changed since the study started" in line, line
    assert saved["data.features"]["id"][:8] in line and "run the study again under another name" in line


def test_a_copy_of_the_data_is_the_same_data_and_big_files_are_sampled(tmp_path, monkeypatch):
    """Past FULL_HASH_MAX a file is known by its size and sampled blocks: a copy with another modification time is
    the same; a block changed in its middle is not."""
    import launch.fingerprint as fp

    monkeypatch.setattr(fp, "FULL_HASH_MAX", 1 << 20)
    monkeypatch.setattr(fp, "BLOCK", 4096)
    big = tmp_path / "features.h5"
    big.write_bytes(os.urandom(3 << 20))
    first = fp.file_fingerprint(big)
    assert first["how"].startswith("size and sha256 of 16 blocks")
    shutil.copyfile(big, tmp_path / "copy.h5")
    assert fp.file_fingerprint(tmp_path / "copy.h5")["id"] == first["id"]
    middle = (big.stat().st_size - fp.BLOCK) * 8 // 15  # the 9th sampled block
    with open(big, "r+b") as f:
        f.seek(middle + 10)
        f.write(b"\xff\x00\xff")
    assert fp.file_fingerprint(big)["id"] != first["id"]


# -- 3: a copied or moved study reads and packages its own checkpoints -----------------------------------------------
def test_summary_paths_are_relative_so_a_copy_and_a_moved_study_package_their_own(replicated, tmp_path):
    from launch.package import candidates, ensemble_members, open_study

    fab, root = replicated, tmp_path / "st"
    text = (root / "rep" / SUMMARY_FILE).read_text()
    assert str(root) not in text  # no absolute path of the study's own files (its data's are the data's)
    saved = json.loads(text)
    assert saved["best"]["checkpoint"] == f"trials/{train_run_name('rep', 't3')}/{checkpoint_name(2)}/checkpoint.pt"

    shutil.copytree(root, tmp_path / "copy", symlinks=True)  # `cp -a`
    location, spec, record = open_study("rep", str(tmp_path / "copy"), verbose=False)
    assert record.best().best_checkpoint.startswith(str(tmp_path / "copy" / "rep" / TRIALS_DIR))
    assert all(c.best_checkpoint.startswith(str(tmp_path / "copy")) for c in candidates(spec, record.trials))
    _, members = ensemble_members(spec, location, record, None, no_train=True, address=None, verbose=False)
    assert [m.seed for m in members] == list(SEEDS)
    assert all(m.best_checkpoint.startswith(str(tmp_path / "copy" / "rep")) for m in members)

    shutil.move(root, tmp_path / "moved")  # the original gone: a moved study finds its 4 replicates
    location, spec, record = open_study("rep", str(tmp_path / "moved"), verbose=False)
    _, members = ensemble_members(spec, location, record, None, no_train=True, address=None, verbose=False)
    assert [Path(m.best_checkpoint).is_file() for m in members] == [True] * 4
    assert all(m.best_checkpoint.startswith(str(tmp_path / "moved" / "rep")) for m in members)


def test_an_older_summary_with_absolute_paths_reads_the_copys_own_files(replicated, tmp_path):
    from launch.conclusions import read_summary

    root = tmp_path / "st"
    summary = replicated.record().summary()  # as summary.json was written before: absolute paths
    assert summary["best"]["checkpoint"].startswith(str(root / "rep"))
    (root / "rep" / SUMMARY_FILE).write_text(json.dumps(summary))
    shutil.copytree(root, tmp_path / "copy", symlinks=True)
    placed = read_summary(StudyLocation("rep", str(tmp_path / "copy")))
    assert placed["best"]["checkpoint"] == summary["best"]["checkpoint"].replace(str(root), str(tmp_path / "copy"))
    assert all(r["best_checkpoint"].startswith(str(tmp_path / "copy")) for r in placed["trials"])


# -- 4: a flipped byte in a checkpoint -------------------------------------------------------------------------------
def _flip(file: Path) -> None:
    """One byte in the middle of the file (the weights) changed, the size kept."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def test_a_flipped_byte_is_named_by_check_package_and_a_trials_resume(replicated, tmp_path, capsys):
    from launch.package import ensemble_members, fetch_checkpoint, open_study, refuse_unreadable
    from launch.storage import open_location
    from launch.trainable import newest_readable_checkpoint

    run = tmp_path / "st" / "rep" / TRIALS_DIR / train_run_name("rep", "t3")
    best = run / checkpoint_name(2) / "checkpoint.pt"
    assert (run / checkpoint_name(2) / f"checkpoint.pt{SUFFIX}").is_file()
    assert main(["study", "check", "rep", "--storage", str(tmp_path / "st")]) == 0
    capsys.readouterr()
    size = best.stat().st_size
    _flip(best)
    assert best.stat().st_size == size

    assert main(["study", "check", "rep", "--storage", str(tmp_path / "st")]) == 1
    lines = capsys.readouterr().out.strip().splitlines()  # check's own report: on stdout
    assert any(ln.startswith(f"damaged: {best}: damaged since it was written: its SHA-256 is") for ln in lines), lines
    assert "8 checkpoints checked, 1 unreadable" in lines[-1]

    location, spec, summary = open_study("rep", str(tmp_path / "st"), verbose=False)
    _, members = ensemble_members(spec, location, summary, None, no_train=True, address=None, verbose=False)
    local = [fetch_checkpoint(m.best_checkpoint, tmp_path / "cache") for m in members]
    with pytest.raises(PackageError) as refused:
        refuse_unreadable(members, local)
    assert str(refused.value).startswith(f"{best} (trial t3, seed 3): damaged since it was written")

    work = tmp_path / "work"
    work.mkdir()
    epoch, _ = newest_readable_checkpoint(open_location(run), [1, 2], work)
    assert epoch == 1  # the damaged newest passed over, as an unreadable one is
    assert f"checkpoint {best} is unreadable" in capsys.readouterr().out


# -- 5: a damaged summary.json is one line ---------------------------------------------------------------------------
def test_a_truncated_summary_is_one_line_for_package_and_sync(replicated, tmp_path, monkeypatch, capsys):
    summary = tmp_path / "st" / "rep" / SUMMARY_FILE
    summary.write_text(summary.read_text()[:200])
    # `a2 package` reads the study's record, not its summary (a cache of it): tests/test_package.py
    for argv in (["mlflow", "sync", "rep", "--storage", str(tmp_path / "st")],):
        assert main(argv) == 2
        out = capsys.readouterr()
        line = out.err.strip().splitlines()[-1]
        assert line.startswith(f"a2: error: {summary}: the study's summary is not readable JSON"), line
        assert "Traceback" not in out.out + out.err and "cut short or damaged" in line


# -- 7: a study starting; an artifact store on a full disk -----------------------------------------------------------
def test_readers_say_a_study_is_starting_while_its_driver_holds_the_lease(tmp_path, capsys):
    from launch.storage import open_location

    study = open_location(tmp_path / "st" / "early")
    with StudyLease(study).held():  # the driver's first seconds: the lease, no study.yaml yet
        assert main(["study", "status", "early", "--storage", str(tmp_path / "st")]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"study 'early' at {tmp_path / 'st' / 'early'} is starting" in line and "try again" in line, line
    assert main(["study", "status", "early", "--storage", str(tmp_path / "st")]) == 2
    assert "no study 'early'" in capsys.readouterr().err  # nothing there, nobody starting it


def test_a_full_artifact_disk_is_named_not_called_a_server_down(caplog):
    from launch.mlflow_export import StudyExporter

    full = OSError(errno.ENOSPC, "No space left on device", "/data/mlruns/1/abc/artifacts/samples.json")
    exporter = SimpleNamespace(uri="sqlite:////data/mlflow.db", down_since=None)
    with caplog.at_level(logging.WARNING, logger="launch.mlflow_export"):
        StudyExporter._down(exporter, full)
    line = caplog.records[-1].getMessage()
    assert "/data/mlruns/1/abc/artifacts/samples.json: [Errno 28] No space left on device" in line, line
    assert "disk is full" in line and "not answering" not in line
    caplog.clear()
    exporter.down_since = None
    with caplog.at_level(logging.WARNING, logger="launch.mlflow_export"):
        StudyExporter._down(exporter, ConnectionRefusedError("refused"))
    assert "not answering" in caplog.records[-1].getMessage()
