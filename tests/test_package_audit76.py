"""Audit of the COCO server submission path (`a2 submission validate`, `dashboards.submission`, `launch.package`):
the edges its other tests leave out."""
from __future__ import annotations

import json
import zipfile

import pytest

from dashboards.submission import make_zip, results_filename, validate_zip

pytestmark = pytest.mark.outside_ray_group

VAL_IDS, TEST_IDS = list(range(1, 40)), list(range(1000, 1040))


def _zip(tmp_path, method=zipfile.ZIP_DEFLATED):
    """A valid results.zip of small splits, its members compressed with `method`."""
    path = tmp_path / "results.zip"
    with zipfile.ZipFile(path, "w", method) as zf:
        for split, ids in (("val", VAL_IDS), ("test", TEST_IDS)):
            entries = [{"image_id": i, "caption": f"a dog runs on the grass {i}"} for i in ids]
            zf.writestr(results_filename(split, "a2"), json.dumps(entries))
    assert validate_zip(path, VAL_IDS, TEST_IDS, alg="a2").ok
    return path


def _damage_first_member_data(path, byte: int, at: int = 0) -> None:
    """Overwrite byte `at` of the first member's compressed data (a broken download or copy)."""
    with zipfile.ZipFile(path) as zf:
        info = zf.infolist()[0]
    raw = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw[start + at] = byte
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_LZMA])
def test_a_member_whose_compressed_data_is_damaged_is_reported_not_a_traceback(tmp_path, method):
    """A results.zip with a damaged compressed stream (a download cut or bit-flipped) made `validate_zip` raise
    zlib.error / LZMAError: `a2 submission validate`, the command meant to check such a file, died with a traceback.
    It is a problem of that member now, and the other member is still checked."""
    path = _zip(tmp_path, method)
    # deflate: block type 3, which does not exist; lzma (after zipfile's 4-byte header): properties past their range
    _damage_first_member_data(path, 0xFF, at=0 if method == zipfile.ZIP_DEFLATED else 4)
    report = validate_zip(path, VAL_IDS, TEST_IDS, alg="a2")
    assert report.kinds() == ["unreadable"], str(report)
    assert report.problems[0].file == results_filename("val", "a2")
    assert report.files == {results_filename("test", "a2"): len(TEST_IDS)}


def test_an_archive_whose_central_directory_is_damaged_is_reported_as_not_a_zip(tmp_path):
    """A damaged central directory (a header's "version needed to extract" no reader knows, a member name flagged
    UTF-8 that is not) made zipfile raise NotImplementedError / UnicodeDecodeError on opening: a traceback."""
    path = _zip(tmp_path)
    raw = bytearray(path.read_bytes())
    central = raw.index(b"PK\x01\x02")
    raw[central + 6] = 200  # version needed to extract: 20.0
    path.write_bytes(bytes(raw))
    report = validate_zip(path, VAL_IDS, TEST_IDS, alg="a2")
    assert report.kinds() == ["not_zip"], str(report)

    path = _zip(tmp_path)
    raw = bytearray(path.read_bytes())
    central = raw.index(b"PK\x01\x02")
    flags = int.from_bytes(raw[central + 8:central + 10], "little") | 0x800  # names are UTF-8
    raw[central + 8:central + 10] = flags.to_bytes(2, "little")
    name_at = central + 46
    raw[name_at] = 0xFF  # never valid UTF-8
    path.write_bytes(bytes(raw))
    report = validate_zip(path, VAL_IDS, TEST_IDS, alg="a2")
    assert report.kinds() == ["not_zip"], str(report)


def test_submission_validate_reports_a_damaged_zip_and_exits_1(tmp_path, capsys):
    """The command prints the report and exits 1 (the zip would be refused), not a traceback."""
    from launch.cli import main

    path = _zip(tmp_path)
    _damage_first_member_data(path, 0xFF)
    lists = {}
    for split, ids in (("val", VAL_IDS), ("test", TEST_IDS)):
        lists[split] = tmp_path / f"{split}.json"
        lists[split].write_text(json.dumps({"images": [{"id": i} for i in ids]}))
    code = main(["submission", "validate", str(path), "--val-images", str(lists["val"]),
                 "--test-images", str(lists["test"])])
    out = capsys.readouterr().out
    assert code == 1
    assert f"[unreadable] {results_filename('val', 'a2')}: cannot be extracted" in out


def test_make_zip_then_validate_round_trip_still_passes(tmp_path):
    """The package's own zip is unaffected by the wider error handling."""
    files = []
    for split, ids in (("val", VAL_IDS), ("test", TEST_IDS)):
        files.append(tmp_path / results_filename(split, "a2"))
        files[-1].write_text(json.dumps([{"image_id": i, "caption": "a cat"} for i in ids]))
    zip_path = make_zip(tmp_path / "results.zip", *files)
    assert validate_zip(zip_path, VAL_IDS, TEST_IDS, alg="a2").ok


@pytest.mark.parametrize("shape", [(8, 3), (3, 4), (0, 8), (2, 3, 8), (12,)])
def test_the_registered_models_given_features_of_a_wrong_shape_are_refused_naming_the_image(shape):
    """The registered ensemble's `predict` takes an image's region features (n_regions, feature_dim); any array was
    reshaped to rows of feature_dim, so features transposed (D, n), of another extractor's width or of no region
    were captioned from scrambled regions without an error. Refused now, naming the image id."""
    import numpy as np

    from a2core.errors import DataError
    from dashboards.leaderboard import GivenFeatures

    store = GivenFeatures({7: np.ones(shape)}, 8)
    with pytest.raises(DataError, match=r"image id 7: shape"):
        store.get(7)


def test_the_registered_models_given_features_keep_regions_and_refuse_nan():
    """(n, D) and a flat list of n*D values stay n regions; NaN features are refused as the stores refuse them."""
    import numpy as np

    from a2core.errors import DataError
    from dashboards.leaderboard import GivenFeatures

    regions = np.arange(24, dtype=np.float64).reshape(3, 8)
    store = GivenFeatures({1: regions, 2: regions.ravel().tolist(), 3: [[float("nan")] * 8]}, 8)
    assert store.get(1).shape == (3, 8) and np.array_equal(store.get(2), store.get(1))
    feats, mask = store.padded(1, 5)
    assert feats.shape == (5, 8) and mask.tolist() == [True, True, True, False, False]
    with pytest.raises(DataError, match=r"image id 3: contain NaN"):
        store.get(3)
