"""Study records (`dashboards.records`): a results table is printed by today's code from a stored record, and the
README's (and docs') marked tables fail this suite when they differ from what the code prints."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from a2core.errors import DataError
from dashboards.records import FORMAT, VERSION, check_markdown, load_record, render_table, tables_in
from dashboards.stats import paired_difference, seed_interval

ROOT = Path(__file__).resolve().parents[1]


def make_record(seeds: dict[str, int]) -> dict:
    rng = np.random.default_rng(0)
    ids = [str(100 + i) for i in range(20)]
    difficulty = rng.gamma(2.0, 50.0, 20)
    arms = []
    for k, (label, n) in enumerate(seeds.items()):
        scores = difficulty + 8 * k + rng.normal(0, 5, (n, 20)) + rng.normal(0, 2, (n, 1))
        arms.append({"label": label, "config": f"fusion={label}", "seeds": list(range(n)),
                     "scores": {"val/CIDEr": [float(v) for v in scores.mean(axis=1)],
                                "diag/grounding/lift": [0.01 * (k + i) for i in range(n)]},
                     "per_image": {"image_ids": ids, "scores": scores.tolist()}})
    return {"record": FORMAT, "version": VERSION, "study": "s", "spec": "studies/s.yaml", "split": "val",
            "by": "fusion", "metric": "val/CIDEr", "mode": "max", "baseline": "none",
            "columns": [["val CIDEr", "val/CIDEr"], ["lift", "diag/grounding/lift"]],
            "measured": "today", "note": "", "arms": arms}


def test_a_record_renders_as_compare_arms_prints_it(tmp_path):
    record = make_record({"none": 3, "gate": 3, "max": 1})
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    table = render_table(load_record(path)).splitlines()
    assert table[0] == "| fusion | seeds | val CIDEr | lift | val CIDEr vs none [95% CI], p: verdict |"
    none, gate, one = (np.asarray(a["per_image"]["scores"]) for a in record["arms"])
    diff = paired_difference(gate, none, ("gate", "none"))
    word = "resolved" if diff.resolved else "not resolved"
    assert table[2] == (f"| none | 0-2 | {seed_interval(none.mean(axis=1)).text()} | "
                        f"{seed_interval([0.0, 0.01, 0.02]).text()} | (baseline) |")
    assert table[3] == (f"| gate | 0-2 | {seed_interval(gate.mean(axis=1)).text()} | "
                        f"{seed_interval([0.01, 0.02, 0.03]).text()} | "
                        f"{diff.interval_text().replace(' CIDEr', '')}, p {diff.p:.3f}: {word} |")
    # one seed: the difference, never a verdict
    assert table[4].endswith(f"| {one.mean() - none.mean():+.1f}: no verdict (1 seed of max measures no seed noise) |")


def test_marked_tables_must_be_what_the_code_prints(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text(json.dumps(make_record({"none": 3, "gate": 3})))
    table = render_table(load_record(tmp_path / "results" / "r.json"))
    page = tmp_path / "page.md"
    page.write_text(f"# Results\n\nText.\n\n<!-- results: results/r.json -->\n{table}\n\nMore text.\n")
    assert tables_in(page.read_text()) == [("results/r.json", table)]
    assert check_markdown(page, tmp_path) == []
    page.write_text(page.read_text().replace(table.splitlines()[3].split(" | ")[2], "999.9 [1.0, 2.0]"))
    (problem,) = check_markdown(page, tmp_path)
    assert "results/r.json" in problem and table in problem


def test_a_record_on_the_test_split_names_each_columns_split(tmp_path):
    """Rows selected on val, judged on test: every column is a test score but the selection column, and the
    headings say so; a record that mixes a val result into a test table, or hides a column's split, is refused."""
    record = make_record({"none": 3, "gate": 3})
    for arm in record["arms"]:
        arm["scores"] = {"test/CIDEr": arm["scores"]["val/CIDEr"], "test/BLEU-4": [30.0, 31.0, 32.0],
                         "val/CIDEr": [v + 10.0 for v in arm["scores"]["val/CIDEr"]]}
    record.update(split="test", metric="test/CIDEr", columns=[["test B-4", "test/BLEU-4"], ["test CIDEr", "test/CIDEr"],
                                                              ["val CIDEr (selection)", "val/CIDEr"]])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    table = render_table(load_record(path)).splitlines()
    assert table[0] == ("| fusion | seeds | test B-4 | test CIDEr | val CIDEr (selection) | "
                        "test CIDEr vs none [95% CI], p: verdict |")
    none, gate = (np.asarray(a["per_image"]["scores"]) for a in record["arms"])
    diff = paired_difference(gate, none, ("gate", "none"))
    word = "resolved" if diff.resolved else "not resolved"
    assert table[3] == (f"| gate | 0-2 | {seed_interval([30.0, 31.0, 32.0]).text()} | "
                        f"{seed_interval(gate.mean(axis=1)).text()} | {seed_interval(gate.mean(axis=1) + 10).text()} "
                        f"| {diff.interval_text().replace(' CIDEr', '')}, p {diff.p:.3f}: {word} |")
    for columns, message in [([["B-4", "test/BLEU-4"]], "column 'B-4' .* does not say its split: start it with 'test'"),
                             ([["val CIDEr", "val/CIDEr"]], "is on val in a record on the test split: only the "
                                                            "selection criterion may be")]:
        path.write_text(json.dumps({**record, "columns": columns}))
        with pytest.raises(DataError, match=message):
            load_record(path)
    path.write_text(json.dumps({**record, "split": "val"}))
    with pytest.raises(DataError, match="the verdicts are of test/CIDEr, not on the record's split 'val'"):
        load_record(path)


# synthetic_fusions: version 5 of the set with a test split of 2000 images (data.test_split_images), METEOR scored on
# it; mask_nets: version 2 (100 test images)
@pytest.mark.parametrize("name, test_images, meteor", [("synthetic_fusions", 2000, ["test/METEOR"]),
                                                       ("mask_nets", 100, [])])
def test_the_published_records_are_on_the_test_split_but_the_selection_column(name, test_images, meteor):
    record = load_record(ROOT / "results" / f"{name}.json")
    assert record["split"] == "test" and record["metric"] == "test/CIDEr"
    assert [m for _, m in record["columns"]] == ["test/BLEU-1", "test/BLEU-4", *meteor, "test/ROUGE-L",
                                                 "test/CIDEr", "val/CIDEr"]
    assert record["columns"][-1] == ["val CIDEr (selection)", "val/CIDEr"]
    for arm in record["arms"]:
        assert len(arm["per_image"]["image_ids"]) == test_images  # the study's synthetic set's test split
        assert len(arm["per_image"]["scores"]) == len(arm["seeds"])
        # the per-image scores are the test CIDEr each seed's mean is
        assert np.mean(arm["per_image"]["scores"], axis=1) == pytest.approx(arm["scores"]["test/CIDEr"], abs=1e-3)


def test_a_record_with_a_missing_seed_is_refused(tmp_path):
    record = make_record({"none": 3})
    record["arms"][0]["scores"]["val/CIDEr"].pop()
    (tmp_path / "r.json").write_text(json.dumps(record))
    with pytest.raises(DataError, match="arm none: 2 values of val/CIDEr for 3 seeds"):
        load_record(tmp_path / "r.json")


def _without(record: dict, *keys) -> dict:
    """`record` with the key at the path `keys` removed ("arms", 0, "seeds" -> the first arm's seeds)."""
    record = json.loads(json.dumps(record))
    *parents, last = keys
    target = record
    for key in parents:
        target = target[key]
    del target[last]
    return record


@pytest.mark.parametrize("edit, message", [
    (lambda r: _without(r, "arms"), r"r\.json: missing key 'arms'"),
    (lambda r: _without(r, "metric"), r"r\.json: missing key 'metric'"),
    (lambda r: _without(r, "columns"), r"r\.json: missing key 'columns'"),
    (lambda r: _without(r, "arms", 0, "seeds"), r"r\.json: arms\[0\]: missing key 'seeds'"),
    (lambda r: {**r, "arms": {"none": 1}}, r"r\.json: 'arms' must be a JSON list, got dict"),
    (lambda r: {**r, "columns": [["val CIDEr"]]}, r"r\.json: columns\[0\] must be \[heading, metric\]"),
    (lambda r: {**r, "arms": [None]}, r"r\.json: arms\[0\] must be a JSON object, got NoneType"),
    (lambda r: {**r, "arms": [{**r["arms"][0], "seeds": ["x", 1, 2]}]},
     r"r\.json: arms\[0\]\.seeds\[0\]: must be an integer seed, got 'x'"),
    (lambda r: {**r, "arms": [{**r["arms"][0], "scores": {"val/CIDEr": ["x", 1.0, 2.0]}}]},
     r"r\.json: arm none: scores of val/CIDEr must be a list of numbers"),
    (lambda r: _without(r, "arms", 0, "per_image", "scores"), r"r\.json: arms\[0\]\.per_image: must be"),
    (lambda r: _without(r, "arms", 0, "per_image", "image_ids"), r"r\.json: arms\[0\]\.per_image: must be"),
], ids=["arms", "metric", "columns", "seeds", "arms-type", "column-shape", "arm-type", "seed-type", "score-type",
        "per-image-scores", "per-image-ids"])
def test_a_record_missing_a_key_is_refused_naming_the_file_and_the_key(tmp_path, edit, message):
    """A record cut short or edited by hand: a DataError naming the file and the key, which `a2 results show` prints
    as one line (it was a KeyError, ValueError or TypeError traceback); a folder is not a record either."""
    (tmp_path / "r.json").write_text(json.dumps(edit(make_record({"none": 3, "gate": 3}))))
    with pytest.raises(DataError, match=message):
        load_record(tmp_path / "r.json")
    with pytest.raises(DataError, match="a folder, not a record file"):
        load_record(tmp_path)


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_published_tables_are_what_todays_code_prints_from_their_records(page):
    assert check_markdown(page, ROOT) == []


def test_a2_results_export_writes_a_studys_record_and_show_prints_it(tmp_path, capsys, monkeypatch):
    """`a2 results export NAME` writes the record of `a2 study compare NAME` from the study's storage (every seed's
    scores and per-image CIDEr-D); `a2 results show` prints its table as `render_table` does."""
    from launch.cli import main as a2
    from tests.studyfolder import fabricated_study

    fab = fabricated_study(tmp_path, "rec", epochs=2)
    ids = [str(i) for i in range(6)]
    for fusion, shift in (("none", 0.0), ("gate", 5.0)):
        for seed in (0, 1, 2):
            sampled = {"fusion": fusion, "seed": seed, **({"lambda": 0.035} if fusion == "gate" else {})}
            scores = {i: 90.0 + shift + seed + int(i) for i in ids}
            fab.add(f"{fusion}{seed}", sampled, [{"epoch": e, "val/CIDEr": 80.0 + shift + seed + e} for e in (1, 2)],
                    per_image={"val": scores})
    fab.patch_tune(monkeypatch)
    out = tmp_path / "results" / "rec.json"
    assert a2(["results", "export", "rec", "--storage", str(tmp_path / "st"), "--out", str(out),
               "--measured", "today"]) == 0
    record = load_record(out)
    assert record["study"] == "rec" and record["by"] == "fusion" and record["measured"] == "today"
    arms = {arm["label"]: arm for arm in record["arms"]}
    assert set(arms) == {"none", "gate"} and arms["gate"]["seeds"] == [0, 1, 2]
    assert arms["gate"]["scores"]["val/CIDEr"] == [87.0, 88.0, 89.0]  # each seed's best epoch (the last here)
    capsys.readouterr()
    assert a2(["results", "show", str(out)]) == 0
    assert capsys.readouterr().out.strip() == render_table(record).strip()


@pytest.mark.parametrize("seeds, cell", [([0, 1, 2], "0-2"), ([-1, 0, 1], "-1 to 1"), ([3, 1], "1, 3"),
                                         ([0, 2, 3], "0, 2, 3")])
def test_the_seeds_cell_names_a_run_of_seeds_unambiguously(tmp_path, seeds, cell):
    """Seeds -1, 0, 1 printed as "-1-1", which reads as one seed or a subtraction."""
    record = make_record({"none": len(seeds), "gate": len(seeds)})
    for arm in record["arms"]:
        arm["seeds"] = seeds
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    assert render_table(load_record(path)).splitlines()[2].startswith(f"| none | {cell} | ")
