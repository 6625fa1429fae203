"""COCO caption server submission files: naming, writing, zipping and validation."""

from __future__ import annotations

import json
import zipfile

import pytest

from a2core.data.captions import read_image_info
from a2core.decode import write_results_json
from a2core.errors import DataError
from dashboards.submission import (
    SubmissionError,
    ValidationReport,
    make_zip,
    results_filename,
    validate_zip,
)

VAL_IDS = [391895, 522418, 184613, 318219, 554625]
TEST_IDS = [1, 8, 14, 16, 20, 22]
VAL_NAME = "captions_val2014_a2-max_results.json"
TEST_NAME = "captions_test2014_a2-max_results.json"


def entries(ids, caption="a man riding a horse"):
    return [{"image_id": i, "caption": f"{caption} {i}"} for i in ids]


def build_zip(tmp_path, members, name="results.zip"):
    """Zip ``members`` ({arcname: list/dict (JSON-encoded) or bytes}) into tmp_path/name."""
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as zf:
        for arcname, content in members.items():
            if not isinstance(content, bytes):
                content = json.dumps(content).encode("utf-8")
            zf.writestr(arcname, content)
    return path


def valid_members():
    return {VAL_NAME: entries(VAL_IDS), TEST_NAME: entries(TEST_IDS)}


def check(path, alg="a2-max"):
    return validate_zip(path, VAL_IDS, TEST_IDS, alg=alg)


# ----------------------------------------------------------------------------------------- names


def test_results_filename():
    assert results_filename("val", "a2-max") == "captions_val2014_a2-max_results.json"
    assert results_filename("test", "A2Gate3") == "captions_test2014_A2Gate3_results.json"


@pytest.mark.parametrize("alg", ["a2_max", "a2 max", "", "a2/max", "a2.max", "ä2"])
def test_results_filename_rejects_bad_alg(alg):
    with pytest.raises(ValueError) as e:
        results_filename("val", alg)
    assert repr(alg) in str(e.value)


def test_results_filename_rejects_bad_split():
    with pytest.raises(ValueError, match="train"):
        results_filename("train", "a2")


# ------------------------------------------------------------------------------- write/zip/read


def test_write_results_sorted_utf8_atomic(tmp_path):
    path = tmp_path / "out" / VAL_NAME
    write_results_json(path, {3: "ünïcode café", 1: "a dog", 2: "a cat"})
    raw = path.read_bytes()
    assert json.loads(raw.decode("utf-8")) == [
        {"image_id": 1, "caption": "a dog"},
        {"image_id": 2, "caption": "a cat"},
        {"image_id": 3, "caption": "ünïcode café"},
    ]
    assert "café".encode("utf-8") in raw
    assert sorted(p.name for p in path.parent.iterdir()) == [VAL_NAME]  # no temp files left


def test_write_results_rejects_non_int_id_and_keeps_old_file(tmp_path):
    path = tmp_path / VAL_NAME
    write_results_json(path, {1: "old"})
    with pytest.raises(SubmissionError, match="'7'"):
        write_results_json(path, {1: "new", "7": "bad"})
    assert json.loads(path.read_text()) == [{"image_id": 1, "caption": "old"}]
    with pytest.raises(SubmissionError, match="image 2"):
        write_results_json(path, {2: None})


def test_round_trip_passes_validation(tmp_path):
    val, test = tmp_path / results_filename("val", "a2-max"), tmp_path / results_filename("test", "a2-max")
    write_results_json(val, {i: f"cap {i}" for i in VAL_IDS})
    write_results_json(test, {i: f"cap {i}" for i in TEST_IDS})
    zip_path = make_zip(tmp_path / "sub" / "results.zip", val, test)
    with zipfile.ZipFile(zip_path) as zf:
        assert sorted(zf.namelist()) == sorted([TEST_NAME, VAL_NAME])
    report = check(zip_path)
    assert report.ok, str(report)
    assert report.problems == []
    assert report.files == {VAL_NAME: len(VAL_IDS), TEST_NAME: len(TEST_IDS)}
    assert "OK" in str(report)
    assert sorted(p.name for p in zip_path.parent.iterdir()) == ["results.zip"]


def test_make_zip_missing_input(tmp_path):
    val = tmp_path / VAL_NAME
    write_results_json(val, {1: "x"})
    with pytest.raises(SubmissionError, match="nope.json"):
        make_zip(tmp_path / "results.zip", val, tmp_path / "nope.json")
    assert not (tmp_path / "results.zip").exists()


def test_read_image_info(tmp_path):
    info = tmp_path / "image_info_test2014.json"
    info.write_text(json.dumps({"images": [{"id": 5, "file_name": "a.jpg"}, {"id": 2}], "info": {}}))
    assert read_image_info(info) == [5, 2]
    captions = tmp_path / "captions_val2014.json"
    captions.write_text(json.dumps({"images": [{"id": 9}], "annotations": [{"image_id": 9, "caption": "x"}]}))
    assert read_image_info(captions) == [9]


@pytest.mark.parametrize("content", ['{"images": [{"id": "5"}]}', '{"annotations": []}', "not json", "[1, 2]"])
def test_read_image_info_errors_name_the_file(tmp_path, content):
    info = tmp_path / "broken_info.json"
    info.write_text(content)
    with pytest.raises(DataError, match="broken_info.json"):
        read_image_info(info)
    with pytest.raises(DataError, match="missing_info.json"):
        read_image_info(tmp_path / "missing_info.json")


# ------------------------------------------------------------------------------------ validation


def test_valid_zip_passes(tmp_path):
    report = check(build_zip(tmp_path, valid_members()))
    assert isinstance(report, ValidationReport)
    assert report.ok
    assert report.problems == []
    # alg inferred from the names when not given
    assert validate_zip(build_zip(tmp_path, valid_members()), VAL_IDS, TEST_IDS).ok
    # ids can come as a set
    assert validate_zip(build_zip(tmp_path, valid_members()), set(VAL_IDS), set(TEST_IDS), alg="a2-max").ok


def test_extra_entry_keys_are_allowed(tmp_path):
    members = valid_members()
    members[VAL_NAME][0]["score"] = 0.5
    assert check(build_zip(tmp_path, members)).ok


def test_missing_image(tmp_path):
    members = valid_members()
    members[TEST_NAME] = entries(TEST_IDS[1:])
    report = check(build_zip(tmp_path, members))
    assert not report.ok
    assert report.kinds() == ["missing_ids"]
    (p,) = report.problems
    assert p.file == TEST_NAME
    assert p.image_ids == (TEST_IDS[0],)
    assert "missing 1 image ids: 1" in p.message
    assert f"{TEST_NAME}: missing 1 image ids" in str(report)


def test_many_missing_ids_message_is_capped(tmp_path):
    val_ids = list(range(100, 140))
    members = {VAL_NAME: entries(val_ids[:3]), TEST_NAME: entries(TEST_IDS)}
    report = validate_zip(build_zip(tmp_path, members), val_ids, TEST_IDS)
    (p,) = report.problems
    assert p.kind == "missing_ids"
    assert len(p.image_ids) == 37  # all of them, uncapped
    assert p.message == "missing 37 image ids: 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, ... (27 more)"


def test_duplicate_id(tmp_path):
    members = valid_members()
    members[VAL_NAME].append({"image_id": VAL_IDS[2], "caption": "again"})
    report = check(build_zip(tmp_path, members))
    assert report.kinds() == ["duplicate_ids"]
    assert report.problems[0].file == VAL_NAME
    assert report.problems[0].image_ids == (VAL_IDS[2],)
    assert f"{VAL_IDS[2]} (x2)" in report.problems[0].message


def test_string_image_id(tmp_path):
    members = valid_members()
    members[VAL_NAME][0]["image_id"] = str(VAL_IDS[0])
    report = check(build_zip(tmp_path, members))
    assert report.kinds() == ["bad_image_id", "missing_ids"]
    assert report.problems[0].file == VAL_NAME
    assert f"entry #0: '{VAL_IDS[0]}'" in report.problems[0].message
    assert report.problems[1].image_ids == (VAL_IDS[0],)


def test_bool_image_id(tmp_path):
    members = valid_members()
    members[TEST_NAME][1]["image_id"] = True
    report = check(build_zip(tmp_path, members))
    assert "bad_image_id" in report.kinds()


def test_empty_caption(tmp_path):
    members = valid_members()
    members[TEST_NAME][3]["caption"] = "   "
    report = check(build_zip(tmp_path, members))
    assert report.kinds() == ["empty_caption"]
    assert report.problems[0].file == TEST_NAME
    assert report.problems[0].image_ids == (TEST_IDS[3],)


def test_non_string_caption_and_missing_key(tmp_path):
    members = valid_members()
    members[VAL_NAME][0]["caption"] = 42
    del members[VAL_NAME][1]["caption"]
    report = check(build_zip(tmp_path, members))
    assert sorted(report.kinds()) == ["bad_caption", "missing_key"]


def test_wrong_file_name(tmp_path):
    members = valid_members()
    members["captions_val2014_a2-max_result.json"] = members.pop(VAL_NAME)
    report = check(build_zip(tmp_path, members))
    assert report.kinds() == ["bad_name", "missing_file"]
    assert report.problems[0].file == "captions_val2014_a2-max_result.json"
    assert VAL_NAME in report.problems[1].message


def test_wrong_alg(tmp_path):
    report = check(build_zip(tmp_path, valid_members()), alg="a2-gate")
    assert report.kinds() == ["alg_mismatch", "alg_mismatch"]
    members = valid_members()
    members["captions_test2014_other_results.json"] = members.pop(TEST_NAME)
    report = validate_zip(build_zip(tmp_path, members), VAL_IDS, TEST_IDS)
    assert report.kinds() == ["alg_mismatch"]


def test_file_in_folder(tmp_path):
    members = valid_members()
    members[f"results/{VAL_NAME}"] = members.pop(VAL_NAME)
    report = check(build_zip(tmp_path, members))
    assert report.kinds() == ["not_at_root"]


def test_zip_with_one_file(tmp_path):
    report = check(build_zip(tmp_path, {VAL_NAME: entries(VAL_IDS)}))
    assert report.kinds() == ["file_count", "missing_file"]
    assert "holds 1 files" in report.problems[0].message
    assert "test2014" in report.problems[1].message


def test_zip_with_three_files(tmp_path):
    members = valid_members()
    members["README.txt"] = b"hello"
    report = check(build_zip(tmp_path, members))
    assert report.kinds() == ["file_count", "bad_name"]


def test_not_a_zip(tmp_path):
    path = tmp_path / "results.zip"
    path.write_text("definitely not a zip")
    report = check(path)
    assert report.kinds() == ["not_zip"]
    assert check(tmp_path / "absent.zip").kinds() == ["not_found"]


def test_non_json_content(tmp_path):
    members = valid_members()
    members[VAL_NAME] = b'[{"image_id": 1, "caption": "x"'
    report = check(build_zip(tmp_path, members))
    assert report.kinds() == ["not_json"]
    assert report.problems[0].file == VAL_NAME


def test_non_utf8_bytes(tmp_path):
    members = valid_members()
    members[TEST_NAME] = json.dumps(entries(TEST_IDS, "caf\u00e9"), ensure_ascii=False).encode("latin-1")
    report = check(build_zip(tmp_path, members))
    assert report.kinds() == ["not_utf8"]
    assert report.problems[0].file == TEST_NAME


def test_top_level_not_a_list(tmp_path):
    members = valid_members()
    members[VAL_NAME] = {"annotations": entries(VAL_IDS)}
    assert check(build_zip(tmp_path, members)).kinds() == ["not_list"]


def test_extra_id(tmp_path):
    members = valid_members()
    members[VAL_NAME].append({"image_id": 999999, "caption": "not in val"})
    report = check(build_zip(tmp_path, members))
    assert report.kinds() == ["extra_ids"]
    assert report.problems[0].image_ids == (999999,)
    assert "999999" in report.problems[0].message


def test_all_problems_reported_at_once(tmp_path):
    val = entries(VAL_IDS[1:])  # missing VAL_IDS[0]
    val.append({"image_id": VAL_IDS[1], "caption": "dup"})  # duplicate
    val.append({"image_id": 7, "caption": "extra"})  # extra
    val[2]["caption"] = ""  # empty caption
    assert val[3]["image_id"] == 554625
    val[3]["image_id"] = "554625"  # string id -> also missing
    members = {
        "captions_val2014_a2-max_results.json": val,
        "captions_test2014_a2-max_results.json": b"\xff\xfe garbage",
        "notes.txt": b"x",
    }
    report = check(build_zip(tmp_path, members))
    assert not report.ok
    assert sorted(report.kinds()) == sorted([
        "file_count", "bad_name",  # archive level
        "bad_image_id", "empty_caption", "duplicate_ids", "missing_ids", "extra_ids",  # val file
        "not_utf8",  # test file
    ])
    (missing,) = [p for p in report.problems if p.kind == "missing_ids"]
    assert missing.image_ids == (391895, 554625)
    text = str(report)
    assert text.startswith(f"{tmp_path / 'results.zip'}: 8 problem(s)")
    assert len(text.splitlines()) == 9
    for p in report.problems:
        assert p.message in text


def test_the_command_says_a_missing_zip_in_one_line_and_exits_2_and_a_refused_one_exits_1(tmp_path, capsys):
    """Exit 2 is every user error's (no file to check); exit 1 is a zip the server would refuse."""
    from launch.cli import main

    infos = []
    for name, ids in (("val.json", VAL_IDS), ("test.json", TEST_IDS)):
        infos.append(tmp_path / name)
        infos[-1].write_text(json.dumps({"images": [{"id": i} for i in ids]}))
    lists = ["--val-images", str(infos[0]), "--test-images", str(infos[1])]
    missing = str(tmp_path / "nosuch.zip")
    assert main(["submission", "validate", missing, *lists]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"a2: error: {missing}: no such file (give the results.zip to check)"]
    refused = build_zip(tmp_path, {VAL_NAME: entries(VAL_IDS)})  # the test split's file is missing
    assert main(["submission", "validate", str(refused), *lists]) == 1
    assert main(["submission", "validate", str(build_zip(tmp_path, valid_members(), "ok.zip")), *lists]) == 0
