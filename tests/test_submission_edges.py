"""Edges of the COCO server submission and the leaderboard: captions the server's tokenizer would misread, results
files whose names the server would not read, leaderboard JSON that strict parsers refuse, members that did not score,
ties across studies, and a system whose name collided with the references. Needs no Ray, no Java."""
from __future__ import annotations

import json
import zipfile

import pytest

from a2core.errors import SubmissionError
from dashboards import leaderboard as lb
from dashboards.submission import make_zip, results_filename, validate_zip

VAL_IDS = [391895, 522418, 184613]
TEST_IDS = [1, 8, 14]
VAL_NAME, TEST_NAME = results_filename("val", "a2"), results_filename("test", "a2")


def entries(ids):
    return [{"image_id": i, "caption": f"a man riding a horse {i}"} for i in ids]


def build_zip(tmp_path, members, name="results.zip"):
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as zf:
        for arcname, content in members.items():
            zf.writestr(arcname, content if isinstance(content, bytes) else json.dumps(content).encode("utf-8"))
    return path


def check(path):
    return validate_zip(path, VAL_IDS, TEST_IDS, alg="a2")


# -- captions the server's tokenizer cannot read one a line --------------------------------------------------------
@pytest.mark.parametrize("caption", ["a dog\ron grass", "a dog\u2028on grass", "a dog\x0bon grass", "a dog\r\n"])
def test_a_caption_with_a_line_break_the_server_keeps_is_refused(tmp_path, caption):
    """pycocoevalcap's PTBTokenizer replaces only "\\n" and reads the lexer's output one caption a line: a "\\r" or
    U+2028 makes two lines of one caption and every later caption is scored against the wrong image. Passed before."""
    val = entries(VAL_IDS)
    val[1]["caption"] = caption
    report = check(build_zip(tmp_path, {VAL_NAME: val, TEST_NAME: entries(TEST_IDS)}))
    assert report.kinds() == ["caption_line_break"]
    (problem,) = report.problems
    assert problem.file == VAL_NAME and problem.image_ids == (VAL_IDS[1],)
    assert problem.message.startswith("1 captions hold a line break other than \\n")


def test_unicode_and_a_plain_newline_in_captions_are_accepted(tmp_path):
    """UTF-8 text is what the server reads, and it replaces "\\n" itself: neither is a problem."""
    val = entries(VAL_IDS)
    val[0]["caption"], val[1]["caption"] = "ünïcode café 日本 🐴", "a dog\non grass"
    path = tmp_path / "results.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(VAL_NAME, json.dumps(val, ensure_ascii=False).encode("utf-8"))
        zf.writestr(TEST_NAME, json.dumps(entries(TEST_IDS)).encode("utf-8"))
    report = check(path)
    assert report.ok, str(report)
    assert report.files == {VAL_NAME: 3, TEST_NAME: 3}


def test_a_lone_surrogate_in_a_caption_is_refused(tmp_path):
    """JSON may escape a lone surrogate and Python reads it, but the server's tokenizer encodes the captions as UTF-8,
    which cannot hold one: its evaluation fails. Passed before."""
    val = json.dumps(entries(VAL_IDS)).replace("a man riding a horse 522418", "a horse \\ud800").encode("ascii")
    report = check(build_zip(tmp_path, {VAL_NAME: val, TEST_NAME: entries(TEST_IDS)}))
    assert report.kinds() == ["caption_not_unicode"]
    assert report.problems[0].image_ids == (522418,)


@pytest.mark.parametrize("raw", ["1.0", '"1"', "true", "NaN", "-1", "9223372036854775808", "null"])
def test_an_image_id_that_is_not_an_int64_is_refused_and_its_image_missing(tmp_path, raw):
    """A guard (these passed before): float, string, bool, NaN, negative, beyond int64 and null ids."""
    test = json.dumps(entries(TEST_IDS)).replace('"image_id": 1,', f'"image_id": {raw},', 1).encode("utf-8")
    report = check(build_zip(tmp_path, {VAL_NAME: entries(VAL_IDS), TEST_NAME: test}))
    assert report.kinds() == ["bad_image_id", "missing_ids"]
    assert report.problems[1].image_ids == (1,)


# -- make_zip refuses names the server would not read --------------------------------------------------------------
def _results(tmp_path, name, ids):
    path = tmp_path / name
    path.write_text(json.dumps(entries(ids)))
    return path


@pytest.mark.parametrize("val_name, test_name, says", [
    ("val.json", TEST_NAME, "val results file"),  # not a server name
    (TEST_NAME.replace("test", "tst"), TEST_NAME, "val results file"),
    (TEST_NAME, VAL_NAME, "val results file"),  # swapped: the val argument holds the test file
    (VAL_NAME, results_filename("test", "other"), "different algorithms"),
    (VAL_NAME, "captions_test2014_a2_results.JSON", "test results file"),
])
def test_make_zip_refuses_names_the_server_would_not_read_and_keeps_the_old_zip(tmp_path, val_name, test_name, says):
    """The server finds each file by its name: make_zip zipped whatever two names it was given (a zip the server
    refuses, found only by a later validation, if any ran)."""
    old = make_zip(tmp_path / "out" / "results.zip", _results(tmp_path, VAL_NAME, VAL_IDS),
                   _results(tmp_path, TEST_NAME, TEST_IDS))
    before = old.read_bytes()
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(SubmissionError, match=says):
        make_zip(old, _results(src, val_name, VAL_IDS), _results(src, test_name, TEST_IDS))
    assert old.read_bytes() == before
    assert sorted(p.name for p in old.parent.iterdir()) == ["results.zip"]


def test_make_zip_that_fails_half_way_leaves_the_old_zip_and_no_temp_file(tmp_path, monkeypatch):
    """A guard (passed before): the zip is written to a temp file and renamed."""
    val, test = _results(tmp_path, VAL_NAME, VAL_IDS), _results(tmp_path, TEST_NAME, TEST_IDS)
    old = make_zip(tmp_path / "out" / "results.zip", val, test)
    before = old.read_bytes()
    real = zipfile.ZipFile.writestr
    calls = []

    def crash_on_second(self, info, data, *args, **kwargs):
        calls.append(info)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(self, info, data, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "writestr", crash_on_second)
    with pytest.raises(OSError, match="disk full"):
        make_zip(old, val, test)
    assert old.read_bytes() == before
    assert sorted(p.name for p in old.parent.iterdir()) == ["results.zip"]


# -- the leaderboard ---------------------------------------------------------------------------------------------------
def _metrics(cider: float) -> dict:
    return {"BLEU-1": 70.0, "BLEU-4": 30.0, "METEOR": 25.0, "ROUGE-L": 50.0, "CIDEr": cider}


CONFIG = {"data": {"kind": "synthetic"}, "model": {"fusion": "max", "lambda": 0.035},
          "train": {"seed": 0, "xe_epochs": 2, "scst_epochs": 0}}


def _board(values=(0.5, 0.5, 0.6, 0.4), ciders=(100.0, 101.0, 102.0, 103.0), ensemble=110.0, studies=None,
           trial_ids=None, selected=None):
    members = [{"seed": s, "trial_id": (trial_ids or [f"t{s}" for s in range(4)])[s],
                "study": (studies or ["st"] * 4)[s], "checkpoint": f"c{s}.pt", "value": values[s],
                "metrics": _metrics(ciders[s])} for s in range(4)]
    return lb.build_leaderboard(study="st", config=CONFIG, members=members, ensemble_metrics=_metrics(ensemble),
                                images=20, selected_by={"metric": "val/CIDEr", "mode": "max", **(selected or {})})


def _strict(text: str):
    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_the_leaderboard_file_is_strict_json_with_null_where_a_score_is_not_a_number(tmp_path):
    """A member whose study metric (or a score) is NaN was written as the token NaN, which is not JSON: jq, browsers
    and most parsers refuse the whole file. It is null now, and the rest of the board is unchanged."""
    board = _board(values=(0.5, float("nan"), 0.6, float("inf")))
    board["entries"][0]["metrics"]["SPICE"] = float("nan")
    path = lb.write_leaderboard(tmp_path / "leaderboard.json", board)
    read = _strict(path.read_text())
    assert [e.get("study_metric") for e in read["entries"]] == [0.5, None, 0.6, None, None]
    assert read["entries"][0]["metrics"]["SPICE"] is None
    assert read["entries"][0]["metrics"]["CIDEr"] == 100.0
    assert read["ensemble"]["gain_over_chosen"]["member"] == "seed-2"  # NaN and inf never chosen


def test_a_member_whose_cider_is_nan_is_left_out_of_the_gains_as_of_the_seed_mean():
    """The seed mean left a NaN CIDEr out but the gains kept it: gain_over_members was NaN and the gain over the
    chosen member had a NaN interval with the verdict "no difference resolved"."""
    board = _board(ciders=(100.0, float("nan"), 102.0, 103.0))
    assert board["seed_mean"]["CIDEr"]["n"] == 3
    over = board["ensemble"]["gain_over_members"]
    assert over["seeds"] == 3 and over["delta"] == pytest.approx(110.0 - 305.0 / 3, abs=1e-3)
    assert over["low"] is not None and over["low"] < over["delta"] < over["high"]
    chosen = board["ensemble"]["gain_over_chosen"]
    assert chosen["member"] == "seed-2" and chosen["delta"] == pytest.approx(8.0)
    assert chosen["low"] is not None and chosen["low"] < 8.0 < chosen["high"]
    assert "beats" in chosen["verdict"]


def test_an_ensemble_cider_that_is_nan_gives_no_gain():
    board = _board(ensemble=float("nan"))
    assert board["ensemble"]["gain_over_members"] is None and board["ensemble"]["gain_over_chosen"] is None
    assert lb.gain_lines(board) == []


def test_members_tied_on_validation_across_studies_follow_the_one_rule_lower_study_then_trial_id():
    """`dashboards.stats.best_trial` (packaging's pick) takes the lower (study, trial id) of equals; the leaderboard
    took the lower trial id alone, and of a selected trial id found in two studies the first by seed."""
    ties = dict(values=(0.7, 0.7, 0.5, 0.5), studies=["b", "a", "a", "a"])
    board = _board(trial_ids=["t00000", "t00001", "t00002", "t00003"], **ties)
    assert board["ensemble"]["gain_over_chosen"]["member"] == "seed-1"  # (a, t00001) before (b, t00000)
    same_id = ["t00000", "t00000", "t00002", "t00003"]
    board = _board(trial_ids=same_id, selected={"trial_id": "t00000", "tie_break": "lower trial id"}, **ties)
    assert board["ensemble"]["gain_over_chosen"]["member"] == "seed-1"
    board = _board(trial_ids=same_id, selected={"trial_id": "t00000", "study": "b"}, **ties)
    assert board["ensemble"]["gain_over_chosen"]["member"] == "seed-0"  # the study named picks it
    board = _board(trial_ids=same_id, selected={"trial_id": "t00000"}, values=(0.7, 0.7, 0.5, 0.5),
                   studies=["a", "a", "a", "a"])
    assert board["ensemble"]["gain_over_chosen"]["member"] == "seed-0"  # one study: unchanged


def test_a_system_named_gts_is_scored_against_the_references_not_against_itself(monkeypatch):
    """score_systems keyed the references ("gts", id) and each system (name, id) in one dict: a system named "gts"
    replaced the references with its own captions and scored a perfect CIDEr. Java is stood in for (whitespace
    tokens, a constant METEOR): what is checked is which captions are the references."""
    class FakeMeteor:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def compute_score(self, gts, res):
            return 0.2, [0.2] * len(res)

    monkeypatch.setattr(lb, "ptb_tokenize", lambda caps: {k: [c.lower() for c in v] for k, v in caps.items()})
    monkeypatch.setattr(lb, "Meteor", FakeMeteor)
    refs = {1: ["a dog runs on the grass", "a brown dog on grass"], 2: ["two cats sleep on a sofa", "cats on a couch"],
            3: ["a man rides a horse", "a person riding a horse"]}
    caps = {1: "a cat on a table", 2: "a dog in a car", 3: "a man rides a horse"}
    as_x, _ = lb.score_systems(refs, {"x": caps}, spice=False)
    as_gts, per_image = lb.score_systems(refs, {"gts": caps, "x": caps}, spice=False)
    assert as_gts["gts"] == as_x["x"] == as_gts["x"]
    assert as_gts["gts"]["METEOR"] == pytest.approx(20.0)  # x100
    assert per_image["gts"] == per_image["x"]
