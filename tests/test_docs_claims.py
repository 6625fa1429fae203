"""Claims of the how-to pages and the study-file reference, checked as a new user meets them (docs/how-to/fill-a-gpu.md,
docs/reference/study-file.md): what `a2 study plan` says about its speed, and what `a2 study validate` warns."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from launch import plan
from launch.cli import main as a2
from launch.spec import StudySpec

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "studies" / "smoke.yaml"
FILL_A_GPU = ROOT / "docs" / "how-to" / "fill-a-gpu.md"


def _record(folder: Path) -> Path:
    """A CUDA record of benchmarks/bench_fused.py that measured one seed alone and 2 seeds fused, nothing captured."""
    folder.mkdir()
    arms = [("single", "fp32", 1, 115.0), ("single", "tf32", 1, 120.0), ("fused", "tf32", 2, 300.0)]
    (folder / "fused-card-2026-12-03.json").write_text(json.dumps({
        "date": "2026-12-03", "machine": "the card", "device": "cuda",
        "arms": [{"kind": kind, "precision": p, "k": k, "images_per_s": ips} for kind, p, k, ips in arms]}))
    return folder


def _speed(out: str) -> str:
    return next(line for line in out.splitlines() if line.lstrip().startswith("speed"))


def test_a_plan_says_that_the_gpu_record_did_not_measure_the_studys_mode(tmp_path, capsys, monkeypatch):
    """fill-a-gpu.md: where the record did not measure the study's mode, the plan keeps its estimate and says so."""
    monkeypatch.setattr(plan, "GPU_RECORDS", _record(tmp_path / "records"))
    monkeypatch.chdir(ROOT)
    fused = ["resources.gpus_per_worker=1", "resources.fuse_replicates=true"]
    assert a2(["study", "plan", str(SMOKE), *fused, "resources.capture_step=true"]) == 0
    speed = _speed(capsys.readouterr().out)
    assert speed.split()[1] == "100" and "(an estimate for an A10G;" in speed
    assert "the newest GPU record, fused-card-2026-12-03.json, did not measure this study's mode)" in speed
    # a mode it measured is priced from it, and says nothing of the kind
    assert a2(["study", "plan", str(SMOKE), *fused]) == 0
    speed = _speed(capsys.readouterr().out)
    assert "(measured: " in speed and "did not measure" not in speed


def test_the_modes_header_on_the_fill_a_gpu_page_is_the_plans(tmp_path, capsys, monkeypatch):
    """The `modes` block that fill-a-gpu.md quotes begins with the line the plan prints, the record's file, machine
    and date as placeholders."""
    monkeypatch.setattr(plan, "GPU_RECORDS", _record(tmp_path / "records"))
    monkeypatch.chdir(ROOT)
    assert a2(["study", "plan", str(SMOKE), "resources.gpus_per_worker=0.25"]) == 0
    printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("modes "))
    page = next(line for line in FILL_A_GPU.read_text().splitlines() if line.startswith("modes "))
    assert printed.replace("fused-card-2026-12-03.json: the card, 2026-12-03",
                           "fused-<card>-<date>.json: <card>, <date>") == page


def _smoke_searching_warmup(spec: dict) -> dict:
    raw = yaml.safe_load(SMOKE.read_text())
    del raw["train"]["warmup"]  # a key the space controls is not set in train (study-file.md)
    raw["search"]["space"]["train.warmup"] = spec
    return raw


def test_a_searched_warmup_is_warned_of_at_its_own_values_not_the_default():
    """The warmup warning of `a2 study validate` reads the searched warmup, not train.warmup's default (10,000
    steps), which no trial of such a study uses: smoke's 1,600 XE steps a trial take 100-300 steps of warmup
    without a warning, and a grid up to 3,000 is warned of at 3,000, naming the space key."""
    spec = StudySpec.from_dict(_smoke_searching_warmup({"randint": [100, 300]}))
    assert [w for w in spec.warnings if "warmup" in w] == []
    spec = StudySpec.from_dict(_smoke_searching_warmup({"grid": [100, 3000]}))
    (warning,) = [w for w in spec.warnings if "warmup" in w]
    assert re.match(r"search\.space\.train\.warmup: up to 3000 steps is 188% of the 1600 cross-entropy steps a trial "
                    r"takes \(200 a epoch x 8\): the learning rate peaks after training ends", warning), warning
