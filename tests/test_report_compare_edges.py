"""`a2 report` and `a2 study compare` on study folders at their edges (`tests.studyfolder.fabricated_study`, no Ray):
a study whose Table 3 comparison cannot be made still gets its report, the table saying why."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from a2core.errors import DataError
from dashboards.compare import compare_table, study_verdicts
from dashboards.report import build_report
from tests.studyfolder import fabricated_study


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a SQLite store keeps artifacts under ./mlruns


def result(cider: float) -> dict:
    return {"epoch": 1, "val/CIDEr": cider, "val/BLEU-4": 30.0, "train/loss": 1.0}


def test_a_report_of_arms_scored_on_different_images_is_written_with_the_table_saying_why(tmp_path):
    """Per-image val CIDEr-D of none on images 000-004, of gate on 003-007 (a data.val_images change between
    them): compare refuses the paired comparison, and the report, which used to stop with that error and write
    nothing, is written without its Table 3, saying why, as `study_verdicts` does in the record."""
    fab = fabricated_study(tmp_path, "images", epochs=1)
    for shift, fusion in enumerate(("none", "gate")):
        for seed in (0, 1):
            ids = range(0, 5) if fusion == "none" else range(3, 8)
            fab.add(f"{fusion}-{seed}", {"fusion": fusion, "seed": seed}, [result(100.0 + seed + shift)],
                    per_image={"val": {f"{k:03d}": 100.0 + k + seed + shift for k in ids}})
    study = fab.record().study()
    with pytest.raises(DataError, match="arms gate and none were scored on different images"):
        compare_table(study)

    paths = build_report(study, tmp_path / "out")
    page = Path(paths["html"]).read_text()
    table3 = page.split("<h2>Fusion ablation (Table 3 layout)</h2>")[1].split("<h2>")[0]
    assert table3.startswith("<p class='missing'>No fusion table: arms gate and none were scored on different "
                             "images (5 and 5 images; only in gate: [&#x27;005&#x27;, &#x27;006&#x27;, "
                             "&#x27;007&#x27;], only in none: [&#x27;000&#x27;, &#x27;001&#x27;, &#x27;002&#x27;])")
    assert "<table class='runs'>" in page and Path(paths["curves"]).is_file()  # the rest of the report is there
    verdicts = json.loads(Path(paths["verdicts"]).read_text())
    assert verdicts == study_verdicts(study) and verdicts["comparisons"] == []
    assert verdicts["error"].startswith("arms gate and none were scored on different images")


def test_a_report_of_a_study_whose_saved_spec_no_longer_resolves_its_trials_is_written(tmp_path):
    """An old study whose fusions the code no longer knows: its trials' configs do not resolve ({}), so no run has
    a fusion param; the report used to stop with compare's "--by fusion: no run ... has fusion", an option the
    user never gave, and write nothing. The fusion its search sampled for each trial groups them (as
    `Trial.fusion` reads it): one arm, no baseline to compare with."""
    fab = fabricated_study(tmp_path, "old", epochs=1)
    for seed in (0, 1):
        fab.add(f"retired-{seed}", {"fusion": "retired_fusion", "seed": seed}, [result(100.0 + seed)])
    study = fab.record().study()
    assert all(r.config == {} for r in study.runs)
    table = compare_table(study).splitlines()
    assert table[-1].split()[:7] == ["retired_fusion", "30.0", "(2", "seeds,", "all", "equal:", "the"]
    assert "100.5 [94.1, 106.9]      2" in table[-1]

    paths = build_report(study, tmp_path / "out")
    page = Path(paths["html"]).read_text()
    assert "<tr><th>retired_fusion</th><td>2</td>" in page and "No fusion table" not in page
    assert page.count("<tr><th>retired-") == 2  # both runs in the runs table, their val CIDEr there
    assert "<td>101.0</td>" in page and "<td>100.0</td>" in page
    assert json.loads(Path(paths["verdicts"]).read_text())["comparisons"] == []
