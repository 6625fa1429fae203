"""Completion is checked, not assumed, and the saved spec is the spec: a study that ends short of its planned trials
says so in one line and exits non-zero; `resume` of a finished study says so in one line and writes nothing (no
lease, no summary, no MLflow run or compute totals again); `resume` refuses a `study.yaml` edited since the study
started, naming the first key that differs."""
from __future__ import annotations

import json
import os

import pytest
import yaml

from launch.cli import main
from launch.driver import STARTED_SPEC_FILE, finish
from launch.location import STUDY_FILE
from launch.driver import exit_code
from tests.studyfolder import fabricated_study


def _fab(tmp_path, trials: int):
    """A study of 2 arms x 2 seeds (4 planned trials), `trials` of them finished with all their 2 epochs."""
    fab = fabricated_study(tmp_path, "done", epochs=2, overrides=("search.replicates=2",))
    arms = [("none", 0), ("none", 1), ("gate", 0), ("gate", 1)][:trials]
    for fusion, seed in arms:
        sampled = {"fusion": fusion, "seed": seed, **({"lambda": 0.05} if fusion == "gate" else {})}
        fab.add(f"{fusion}{seed}", sampled, [{"epoch": e, "val/CIDEr": 50.0 + e + seed} for e in (1, 2)])
    # as `a2 study run` keeps it: the spec as first written, beside study.yaml
    fab.location.write_text(fab.location.read_text(STUDY_FILE), STARTED_SPEC_FILE)
    return fab


def _files(root) -> dict[str, float]:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(root) for f in fs}


def test_a_study_short_of_its_plan_says_so_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    fab = _fab(tmp_path, trials=3)
    fab.patch_tune(monkeypatch)
    summary = finish(fab.spec, fab.location)
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "study done: 3 of 4 planned trials finished, 1 missing; `a2 study resume done` runs them")
    assert summary["trials_finished"] == 3 and not summary["complete"] and exit_code(summary) == 1


def test_a_study_with_every_planned_trial_exits_zero(tmp_path, monkeypatch, capsys):
    fab = _fab(tmp_path, trials=4)
    fab.patch_tune(monkeypatch)
    summary = finish(fab.spec, fab.location)
    assert "planned trials finished," not in capsys.readouterr().out
    assert summary["complete"] and exit_code(summary) == 0


def test_resume_of_a_finished_study_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import ray

    fab = _fab(tmp_path, trials=4)
    fab.patch_tune(monkeypatch)
    fab.export()  # its MLflow runs, as the study's end left them
    finish(fab.spec, fab.location)  # its summary.json, complete
    capsys.readouterr()
    before = {**_files(fab.spec.storage), **_files(tmp_path / "mlflow.db")}
    for _ in range(2):
        assert main(["study", "resume", "done", "--storage", str(fab.spec.storage)]) == 0
        assert capsys.readouterr().out.strip().splitlines() == [
            "study done: all 4 planned trials finished already; nothing to resume (`a2 study status done` shows "
            "them)"]
    assert {**_files(fab.spec.storage), **_files(tmp_path / "mlflow.db")} == before  # no lease, summary, metric
    assert not ray.is_initialized()


def test_resume_of_finished_trials_whose_end_was_not_recorded_goes_on(tmp_path, monkeypatch):
    """Every trial finished but the driver was killed before `summary.json`: no shortcut, the resume records the
    end (here it stops at the lease, taken by another live writer, before Ray: what matters is that it got there)."""
    from a2core.errors import StudyError
    from launch.driver import finished_already, resume_study
    from launch.lease import StudyLease

    fab = _fab(tmp_path, trials=4)
    fab.patch_tune(monkeypatch)
    assert finished_already(fab.spec, fab.location) is None
    with StudyLease(fab.location.at()).held():
        with pytest.raises(StudyError, match="is being written by"):
            resume_study(fab.location)


def test_resume_refuses_a_study_yaml_edited_since_the_start(tmp_path, monkeypatch, capsys):
    fab = _fab(tmp_path, trials=2)
    fab.patch_tune(monkeypatch)
    raw = yaml.safe_load(fab.location.read_text(STUDY_FILE))
    raw["search"]["replicates"] = [0, 1, 2]  # 6 trials now: Tune would still run its 4
    raw["train"]["warmup"] = 7
    fab.location.write_text(yaml.safe_dump(raw, sort_keys=False), STUDY_FILE)
    before = _files(fab.spec.storage)
    assert main(["study", "resume", "done", "--storage", str(fab.spec.storage)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    study_file, started = fab.location.uri(STUDY_FILE), fab.location.uri(STARTED_SPEC_FILE)
    assert err == [f"a2: error: study done: {study_file} differs from the spec it was started with at "
                   f"`train.warmup` (7 now, 300 at the start): Tune resumes the trials it started with, so the change "
                   f"would never apply; put {STUDY_FILE} back as it was ({started} holds it), or run the changed "
                   f"study under another name"]
    assert _files(fab.spec.storage) == before
    raw["train"]["warmup"] = 300
    fab.location.write_text(yaml.safe_dump(raw, sort_keys=False), STUDY_FILE)
    assert main(["study", "resume", "done", "--storage", str(fab.spec.storage)]) == 2
    assert "differs from the spec it was started with at `search.replicates` ([0, 1, 2] now, [0, 1] at the start)" \
        in capsys.readouterr().err


def test_a_study_started_before_a_schema_key_was_added_resumes_at_its_default(tmp_path, monkeypatch):
    """The spec a study was started with, from before train.select_metric and select_mode existed, lacks them: at
    their defaults now they change nothing the study runs, so the resume is not refused; at another value it is."""
    from a2core.errors import StudyError
    from launch.driver import refuse_changed_spec

    fab = _fab(tmp_path, trials=2)
    started = yaml.safe_load(fab.location.read_text(STARTED_SPEC_FILE))
    assert started["train"]["select_metric"] == "val/CIDEr" and started["train"]["select_mode"] == "max"
    for key in ("select_metric", "select_mode"):
        del started["train"][key]
    fab.location.write_text(yaml.safe_dump(started, sort_keys=False), STARTED_SPEC_FILE)
    refuse_changed_spec(fab.spec, fab.location)  # not refused
    started["train"]["warmup"] = 7
    fab.location.write_text(yaml.safe_dump(started, sort_keys=False), STARTED_SPEC_FILE)
    with pytest.raises(StudyError, match="at `train.warmup`"):
        refuse_changed_spec(fab.spec, fab.location)
