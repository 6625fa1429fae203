"""Hostile input to the read side (`a2 results show`, `a2 study compare`): records edited by hand and options that
name more than one key get one line `a2: error: ...` (exit 2) naming the file and key, never a traceback or a table
that silently shows the wrong rows."""
from __future__ import annotations

import json

import pytest

from a2core.errors import DataError, StudyError
from dashboards.compare import study_comparison
from dashboards.records import load_record, render_table
from launch.cli import main
from tests.studyfolder import fabricated_study
from tests.test_records import make_record


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def write(tmp_path, record, name="r.json"):
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return path


def refused(tmp_path, capsys, record) -> str:
    """`a2 results show` of the record: exit 2 and its one error line."""
    path = write(tmp_path, record)
    assert main(["results", "show", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    return line.replace(str(path), "FILE")


def test_two_arms_with_one_label_are_refused(tmp_path, capsys):
    """Old: both rows printed as '(baseline)', the gate row's verdict gone, exit 0."""
    record = make_record({"none": 3, "gate": 3})
    record["arms"][1]["label"] = "none"
    assert refused(tmp_path, capsys, record) == ("a2: error: FILE: arms labelled 'none' more than once: each arm's "
                                                 "label must be its own")


def test_a_mode_other_than_max_or_min_is_refused(tmp_path, capsys):
    """Old: 'mode': 'maximum' was read as min (any value but "max" flips every verdict's direction)."""
    record = make_record({"none": 3, "gate": 3})
    record["mode"] = "maximum"
    assert refused(tmp_path, capsys, record) == "a2: error: FILE: 'mode' must be \"max\" or \"min\", got 'maximum'"


def test_a_metric_no_arm_scored_is_refused(tmp_path, capsys):
    """Old: 'val/CIDEr-D' (a typo) headed the verdict column, its numbers those of the per-image scores."""
    record = make_record({"none": 3, "gate": 3})
    record["metric"] = "val/CIDEr-D"
    assert refused(tmp_path, capsys, record) == ("a2: error: FILE: 'metric' 'val/CIDEr-D' is a score of no arm (their "
                                                 "scores: diag/grounding/lift, val/CIDEr)")


def test_a_seed_listed_twice_is_refused(tmp_path, capsys):
    """Old: seeds 0, 0, 1 counted as three seeds of the interval."""
    record = make_record({"none": 3, "gate": 3})
    record["arms"][0]["seeds"] = [0, 0, 1]
    assert refused(tmp_path, capsys, record) == "a2: error: FILE: arm none: seed 0 listed twice: one entry per seed"


def test_an_arm_without_seeds_is_refused(tmp_path, capsys):
    """Old: a row with no seeds and dashes, exit 0."""
    record = make_record({"none": 3, "gate": 3})
    gate = record["arms"][1]
    gate.update(seeds=[], scores={"val/CIDEr": []})
    gate.pop("per_image")
    assert refused(tmp_path, capsys, record) == ("a2: error: FILE: arm gate: no seeds (an arm is one or more seeds' "
                                                 "scores)")


def test_an_image_id_twice_is_one_line_not_a_traceback(tmp_path, capsys):
    """Old: ValueError traceback from dashboards.stats.Arm (exit 1)."""
    record = make_record({"none": 3, "gate": 3})
    record["arms"][0]["per_image"]["image_ids"][1] = record["arms"][0]["per_image"]["image_ids"][0]
    assert refused(tmp_path, capsys, record) == "a2: error: FILE: arm none: per-image image id 100 appears twice"


def test_per_image_scores_of_other_images_name_the_file(tmp_path, capsys):
    """Old: 'a2: error: arms gate and none were scored on different images ...' naming no file."""
    record = make_record({"none": 3, "gate": 3})
    record["arms"][1]["per_image"]["image_ids"] = [str(200 + i) for i in range(20)]
    assert refused(tmp_path, capsys, record) == (
        "a2: error: FILE: arm gate: per-image scores of other images than the baseline none's (20 and 20 images; "
        "in one only: ['100', '101', '102', '103', '104'])")


def test_no_arms_missing_split_and_a_pooled_string_are_refused(tmp_path, capsys):
    record = make_record({"none": 3})
    record.update(arms=[], baseline=None)
    # old: "'baseline' ... is not the label of an arm: null or one of " (nothing), or an empty table
    assert refused(tmp_path, capsys, record) == ("a2: error: FILE: 'arms' is empty: a record has one arm per row of "
                                                 "its table")
    record = make_record({"none": 3, "gate": 3})
    del record["split"]
    # old: "the verdicts are of val/CIDEr, not on the record's split None"
    assert refused(tmp_path, capsys, record) == ("a2: error: FILE: 'split' must be \"test\" or \"val\" (the images the "
                                                 "verdicts are on), got None")
    record = make_record({"none": 3, "gate": 3})
    record["pooled"] = "no"  # old: a non-empty string read as true: the pooled variance, unasked
    assert refused(tmp_path, capsys, record) == "a2: error: FILE: 'pooled' must be true or false, got 'no'"


def test_a_sound_record_still_renders(tmp_path):
    record = make_record({"none": 3, "gate": 3, "max": 1})
    record["mode"] = "min"
    table = render_table(load_record(write(tmp_path, record)))
    assert table.splitlines()[0].startswith("| fusion | seeds |") and len(table.splitlines()) == 5
    with pytest.raises(DataError, match="'mode'"):
        load_record(write(tmp_path, {**record, "mode": None}))


# -- a2 study compare --by KEY -----------------------------------------------------------------------------------
@pytest.fixture
def fab(tmp_path, monkeypatch):
    fab = fabricated_study(tmp_path, "hostile", epochs=1)
    for fusion, lam, mean in (("none", None, 110.0), ("gate", 0.1, 116.0)):
        for seed in (0, 1, 2):
            fab.add(f"{fusion}-{seed}", {"fusion": fusion, "seed": seed, **({} if lam is None else {"lambda": lam})},
                    [{"epoch": 1, "val/CIDEr": mean + seed}])
    fab.patch_tune(monkeypatch)
    return fab


def test_by_a_key_that_ends_two_config_keys_is_refused(fab, capsys):
    """Old: `--by seed` grouped by data.seed (the first key ending in .seed, 0 in every run): one row '0' that was
    gate's three seeds, printed as a verdict against none. Now: refused, naming both keys."""
    with pytest.raises(StudyError) as err:
        study_comparison(fab.record().study(), by="seed")
    assert str(err.value) == ("--by seed: ambiguous in study hostile: the end of data.seed, train.seed; name one of "
                              "them")
    assert main(["study", "compare", "hostile", "--storage", str(fab.spec.storage), "--by", "seed"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"a2: error: {err.value}"]
    # the full key works: one row per seed, one seed each, so no verdict
    comparison, _, _ = study_comparison(fab.record().study(), by="train.seed")
    assert [arm.label for arm, _ in comparison.rows] == ["0", "1", "2", "fusion=none"]
    assert all(d.low is None for d in comparison.differences.values())
    # an unambiguous suffix still works
    comparison, _, _ = study_comparison(fab.record().study(), by="fusion")
    assert [arm.label for arm, _ in comparison.rows] == ["none", "gate"]
