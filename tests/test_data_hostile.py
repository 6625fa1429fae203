"""Hostile region-feature sources and captions files: `a2 data prepare` and the readers refuse each with one
`a2: error:` line (exit 2) naming the file and the dataset, file name or image id, and write nothing."""
import json
import os
import shutil

import h5py
import numpy as np
import pytest

from a2core.data.captions import read_karpathy
from a2core.data.features import FeatureStore, prepare
from a2core.errors import DataError
from launch.cli import main

DIM = 8


def _h5(path, arrays: dict) -> str:
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f[key] = value
    return str(path)


def _ok(seed=0):
    return np.random.default_rng(seed).random((3, DIM)).astype(np.float32)


def _prepare_fails(source, tmp_path, capsys) -> str:
    out = tmp_path / "out.a2feat"
    assert main(["data", "prepare", str(source), "--out", str(out), "--feature-dim", str(DIM)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("a2: error: ") and "\n" not in err and "Traceback" not in err, err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".out.a2feat")]
    return err


def test_h5_group_named_like_features_is_refused(tmp_path, capsys):
    src = _h5(tmp_path / "grp.h5", {"1_features": _ok(), "2_features/x": _ok()})  # old: TypeError traceback
    err = _prepare_fails(src, tmp_path, capsys)
    assert f"{src}: image id 2: '2_features' is an HDF5 group, not a dataset" in err


@pytest.mark.parametrize("value, kind", [(np.ones((3, DIM), np.complex64), "complex64"),
                                         (np.array([b"abc"] * DIM * 3).reshape(3, DIM), "|S3")])
def test_non_real_features_are_refused(tmp_path, capsys, value, kind):
    # old: complex silently lost its imaginary part (a store was written); strings were a traceback or a shape error
    src = _h5(tmp_path / "odd.h5", {"1_features": _ok(), "2_features": value})
    err = _prepare_fails(src, tmp_path, capsys)
    assert f"{src}: image id 2: features are of type {kind}, not real numbers" in err


@pytest.mark.parametrize("name", ["01", "²", "99999999999999999999"])
def test_h5_names_that_are_not_canonical_ids(tmp_path, capsys, name):
    # old: "01" and "1" both became image id 1 (written twice, "01" never read: a silent wrong store); "²" a
    # ValueError traceback from int(); an id past int64 an OverflowError traceback
    src = _h5(tmp_path / "ids.h5", {"1_features": _ok(), f"{name}_features": _ok(1)})
    err = _prepare_fails(src, tmp_path, capsys)
    assert f"{src}: dataset '{name}_features' is not named {{image_id}}_features" in err


def test_npz_names_with_leading_zeros(tmp_path, capsys):
    src = tmp_path / "feats"
    src.mkdir()
    np.savez(src / "007.npz", feat=_ok())  # old: looked up as 7.npz: "no region features for image id 7"
    err = _prepare_fails(src, tmp_path, capsys)
    assert f"{src / '007.npz'}: file name is not an image id" in err


def test_npy_file_named_npz(tmp_path, capsys):
    src = tmp_path / "feats"
    src.mkdir()
    np.savez(src / "1.npz", feat=_ok())
    np.save(src / "2.npy", _ok())
    os.rename(src / "2.npy", src / "2.npz")  # old: TypeError ('numpy.ndarray' ... context manager) traceback
    err = _prepare_fails(src, tmp_path, capsys)
    assert f"{src / '2.npz'}: image id 2: not an .npz archive" in err


def test_text_file_named_npz(tmp_path, capsys):
    src = tmp_path / "feats"
    src.mkdir()
    np.savez(src / "1.npz", feat=_ok())
    (src / "2.npz").write_text("hello")  # old: numpy's "contains pickled (object) data ... allow_pickle" advice
    err = _prepare_fails(src, tmp_path, capsys)
    assert f"{src / '2.npz'}: image id 2: not an .npz archive" in err and "pickle" not in err


@pytest.fixture
def store(tmp_path):
    src = _h5(tmp_path / "ok.h5", {"1_features": _ok(), "2_features": _ok(1)})
    prepare(src, tmp_path / "s.a2feat", feature_dim=DIM)
    return tmp_path / "s.a2feat"


def test_zero_filled_index_is_named(store):
    index = store / "index.npy"
    index.write_bytes(b"\0" * index.stat().st_size)  # same size: check_copy's size check passes
    with pytest.raises(DataError) as err:  # old: numpy ValueError about pickled data
        FeatureStore(store, DIM)
    assert str(err.value).startswith(f"{index}: unreadable or damaged index")


def test_index_outside_rows_is_named(store):
    index = store / "index.npy"
    table = np.load(index)
    table[1, 2] = 10**6  # same size and shape; old: a slice past the rows, silently short features
    np.save(index, table)
    with pytest.raises(DataError) as err:
        FeatureStore(store, DIM)
    assert f"{index}: row 1 (image id 2) is out of order, repeated or outside the store's 6 rows" in str(err.value)


def test_sentences_of_the_wrong_type_are_named(tmp_path):
    doc = {"images": [{"cocoid": 5, "split": "test", "sentences": {}},
                      {"cocoid": 6, "split": "train", "sentences": [{"tokens": ["a", "dog"]}]}]}
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError) as err:  # old: a test image's {} was read as no sentences, silently
        read_karpathy(path)
    assert str(err.value) == f"{path}: image id 5: 'sentences' is a dict, not a list"
    doc["images"][0]["split"] = "train"
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError) as err:  # old: "image id 5 (train) has no sentences" (it has a dict)
        read_karpathy(path)
    assert str(err.value) == f"{path}: image id 5: 'sentences' is a dict, not a list"


def test_prepared_store_still_reads(store):
    s = FeatureStore(store, DIM)
    assert np.allclose(s.get(2), _ok(1), atol=1e-3) and s.get(1).shape == (3, DIM)
    shutil.rmtree(store)
