"""The data checks of `a2 study resume` (`launch.fingerprint.refuse_changed_data`, `launch.driver.resume_study`),
Ray-free: the resume stops where the driver would take the lease and start Tune (`_drive`, replaced). A refusal
writes nothing into the study (--restore-state and a torn first save included); the same data at another path
resumes and says so; a prepared store's data file replaced under its manifest is refused; an unreadable data file
is one line naming it."""
from __future__ import annotations

import errno
import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import yaml

import launch.driver
from a2core.data import prepared
from a2core.data.synthetic import ensure
from a2core.errors import DataError, StudyError
from launch import datastore
from launch import fingerprint as fp
from launch.cli import main
from launch.location import STUDY_FILE, saved_form
from tests.studyfolder import fabricated_study
from tests.test_data_audit77 import TINY, coco_study, make_store

pytestmark = pytest.mark.outside_ray_group


def started_study(tmp_path: Path, name: str):
    """A COCO study as `run` leaves it before Tune starts: its data fingerprint, started spec and study.yaml."""
    fab = coco_study(tmp_path, name, tmp_path / "coco")
    fp.save_data_fingerprint(fab.spec, fab.location)
    fab.location.write_text(yaml.safe_dump(saved_form(fab.spec), sort_keys=False), launch.driver.STARTED_SPEC_FILE)
    return fab


def snapshot(folder: Path) -> dict:
    """Every file and folder below `folder`, with its bytes' digest and time: a write of any kind changes it."""
    return {str(p.relative_to(folder)): (p.is_dir(), p.stat().st_mtime_ns,
                                         None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def driven(monkeypatch):
    """The specs `_drive` was called with (it starts nothing here)."""
    calls = []
    monkeypatch.setattr(launch.driver, "_drive", lambda spec, location, **kw: calls.append(spec) or {"driven": True})
    return calls


def edit_study_file(fab, **data) -> None:
    path = Path(fab.location.uri(STUDY_FILE))
    saved = yaml.safe_load(path.read_text())
    saved["data"].update(data)
    path.write_text(yaml.safe_dump(saved, sort_keys=False))


# -- 1: a refused resume writes nothing, --restore-state and a torn first save included ----------------------------
@pytest.mark.parametrize("how", ["restore-state", "torn-first-save"])
def test_a_resume_refused_on_changed_data_leaves_the_study_byte_identical(tmp_path, driven, how):
    fab = started_study(tmp_path, f"w-{how}")
    study = Path(fab.location.uri())
    if how == "restore-state":  # an experiment state cut short, its whole copy beside it: --restore-state puts it back
        (study / "state-copies").mkdir()
        (study / "state-copies" / "experiment_state-2026.json").write_text(json.dumps({"trial_data": []}))
        (study / "experiment_state-2026.json").write_text("")
    else:  # Tune's first save cut short (no whole experiment state ever): set aside as *.torn, under a lease
        (study / "tuner.pkl").write_bytes(b"")
        (study / "searcher-state-2026.pkl").write_bytes(pickle.dumps({"x": 1})[:3])
    assert bool(launch.driver.torn_first_save(fab.location)) == (how == "torn-first-save")
    caps = tmp_path / "coco" / "dataset_coco.json"
    caps.write_text(caps.read_text().replace('"raw": "', '"raw": "x', 1))
    before = snapshot(study)
    with pytest.raises(StudyError, match=r"data\.captions .* changed since the study started"):
        launch.driver.resume_study(fab.location, restore_state=how == "restore-state")
    assert snapshot(study) == before
    assert driven == []


def test_restore_state_refuses_a_damaged_file_without_a_copy_before_putting_any_copy_back(tmp_path, driven):
    """--restore-state mends what has a whole copy; a damaged file without one (here the searcher's state) is refused
    first, naming it, and the experiment state that could have been mended stays as it was: a refused resume
    changes nothing (it used to put the copy back, then refuse the other file)."""
    fab = started_study(tmp_path, "two-damaged")
    study = Path(fab.location.uri())
    (study / "state-copies").mkdir()
    (study / "state-copies" / "experiment_state-2026.json").write_text(json.dumps({"trial_data": []}))
    (study / "experiment_state-2026.json").write_text("")
    (study / "searcher-state-2026.pkl").write_bytes(pickle.dumps({"x": 1})[:3])  # no copy of it
    before = snapshot(study)
    with pytest.raises(StudyError, match=r"searcher-state-2026\.pkl.*resume refused, nothing was run or changed"):
        launch.driver.resume_study(fab.location, restore_state=True)
    assert snapshot(study) == before
    assert driven == []
    (study / "searcher-state-2026.pkl").write_bytes(pickle.dumps({"x": 1}))  # mended by hand: the copy goes back
    launch.driver.resume_study(fab.location, restore_state=True)
    assert json.loads((study / "experiment_state-2026.json").read_text()) == {"trial_data": []}
    assert len(driven) == 1


# -- 2: the same data at another path --------------------------------------------------------------------------------
def test_the_same_data_at_another_path_resumes_and_says_which_path_it_uses(tmp_path, driven, capsys):
    fab = started_study(tmp_path, "moved")
    shutil.move(tmp_path / "coco", tmp_path / "mnt")  # the data mounted elsewhere on this machine
    new_caps, new_feats = tmp_path / "mnt" / "dataset_coco.json", tmp_path / "mnt" / "features.h5"
    edit_study_file(fab, captions=str(new_caps), features=str(new_feats))
    code = main(["study", "resume", "moved", "--storage", str(fab.spec.storage)])
    out = capsys.readouterr()
    assert code == 1, out.err  # the stand-in `_drive`'s summary has no trials: exit 1, but it was reached
    assert len(driven) == 1
    assert driven[0].base["data"]["features"] == str(new_feats)
    assert driven[0].base["data"]["captions"] == str(new_caps)
    assert (f"study moved: data.captions is read at {new_caps} now ({tmp_path / 'coco' / 'dataset_coco.json'} when "
            f"the study started): the same data (its fingerprint matches)") in out.out
    assert f"data.features is read at {new_feats} now ({tmp_path / 'coco' / 'features.h5'} when" in out.out


def test_other_data_at_another_path_is_refused_naming_both_paths(tmp_path, driven, capsys):
    fab = started_study(tmp_path, "moved-other")
    shutil.copytree(tmp_path / "coco", tmp_path / "mnt")
    new_caps = tmp_path / "mnt" / "dataset_coco.json"
    new_caps.write_text(new_caps.read_text().replace('"raw": "', '"raw": "x', 1))
    edit_study_file(fab, captions=str(new_caps))
    code = main(["study", "resume", "moved-other", "--storage", str(fab.spec.storage)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2, line
    assert (f"data.captions ({new_caps}) is not the data the study started with at "
            f"{tmp_path / 'coco' / 'dataset_coco.json'}") in line
    assert "put the data the study started with back" in line
    assert driven == []


def test_a_data_move_with_another_change_is_still_refused_at_that_key(tmp_path, driven):
    fab = started_study(tmp_path, "moved-edit")
    shutil.move(tmp_path / "coco", tmp_path / "mnt")
    edit_study_file(fab, captions=str(tmp_path / "mnt" / "dataset_coco.json"),
                    features=str(tmp_path / "mnt" / "features.h5"), vocab_min_count=7)
    with pytest.raises(StudyError, match=r"differs from the spec it was started with at `data\.vocab_min_count`"):
        launch.driver.resume_study(fab.location)
    assert driven == []


def test_a_data_file_dropped_from_the_study_file_is_still_refused_at_its_key(tmp_path, driven):
    """Only a data path set then and now is left to the fingerprint: one removed changes what the study runs."""
    data = tmp_path / "coco"
    ensure(data, seed=0, images=60)
    fab = fabricated_study(tmp_path, "dropped", epochs=1, overrides=(
        "data={kind: coco}", f"data.captions={data / 'dataset_coco.json'}", f"data.features={data / 'features.h5'}",
        f"data.test_images={data / 'image_info_test2014.json'}", *TINY))
    fab.location.write_text(yaml.safe_dump(saved_form(fab.spec), sort_keys=False), launch.driver.STARTED_SPEC_FILE)
    fp.save_data_fingerprint(fab.spec, fab.location)
    assert "data.test_images" in json.loads(Path(fab.location.uri(fp.FINGERPRINT_FILE)).read_text())
    launch.driver.resume_study(fab.location)  # unchanged: reaches the driver
    driven.clear()
    edit_study_file(fab, test_images=None)
    with pytest.raises(StudyError, match=r"differs from the spec it was started with at `data\.test_images`"):
        launch.driver.resume_study(fab.location)
    assert driven == []


# -- 3: a prepared store's data file replaced under its manifest ------------------------------------------------------
def test_a_store_data_file_replaced_under_an_unchanged_manifest_is_refused(tmp_path, driven):
    fab = started_study(tmp_path, "store")
    store = tmp_path / "f.a2feat"
    make_store(store, seed=3)
    fab.spec.base["data"]["features"] = str(store)
    fp.save_data_fingerprint(fab.spec, fab.location)
    fp.refuse_changed_data(fab.spec, fab.location)  # unchanged: accepted
    rows = store / prepared.ROWS
    data = bytearray(rows.read_bytes())
    data[5] ^= 0xFF  # same size, the manifest kept: what `launch.datastore.verify` catches
    rows.write_bytes(bytes(data))
    with pytest.raises(DataError):
        datastore.verify(store)
    with pytest.raises(StudyError) as refused:
        fp.refuse_changed_data(fab.spec, fab.location)
    assert f"data.features ({store}) changed since the study started: its file {rows}" in str(refused.value)


def test_a_store_fingerprint_without_its_files_is_checked_by_its_checksum(tmp_path):
    """A study started before the store's files were fingerprinted: its manifest checksum alone, as before."""
    fab = started_study(tmp_path, "store-old")
    store = tmp_path / "f.a2feat"
    make_store(store, seed=3)
    fab.spec.base["data"]["features"] = str(store)
    fp.save_data_fingerprint(fab.spec, fab.location)
    path = Path(fab.location.uri(fp.FINGERPRINT_FILE))
    saved = json.loads(path.read_text())
    assert set(saved["data.features"]["files"]) == {prepared.ROWS, prepared.INDEX}
    del saved["data.features"]["files"]
    path.write_text(json.dumps(saved))
    fp.refuse_changed_data(fab.spec, fab.location)


# -- 4: an unreadable data file ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("error", [PermissionError(errno.EACCES, "Permission denied"),
                                   OSError(errno.EIO, "Input/output error")])
def test_an_unreadable_data_file_is_one_line_naming_it(tmp_path, driven, monkeypatch, capsys, error):
    fab = started_study(tmp_path, "unread")
    caps = tmp_path / "coco" / "dataset_coco.json"

    def unreadable(path):  # the tests run as root, whom chmod does not stop: the read itself fails
        raise error

    monkeypatch.setattr(fp, "_sha256_file", unreadable)
    code = main(["study", "resume", "unread", "--storage", str(fab.spec.storage)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"data.captions ({caps}) cannot be read ({error.strerror})" in err
    assert driven == []


def test_a_folder_where_the_features_file_was_says_so(tmp_path, driven, capsys):
    fab = started_study(tmp_path, "folder")
    feats = tmp_path / "coco" / "features.h5"
    feats.unlink()
    feats.mkdir()
    code = main(["study", "resume", "folder", "--storage", str(fab.spec.storage)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2, line
    assert f"data.features ({feats}) changed since the study started" in line
    assert "a folder now, a file then" in line
    assert driven == []
