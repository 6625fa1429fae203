"""A trial has at most three shapes: Tune's, the record's (`dashboards.runs.Trial`) and the leaderboard's entry.
The record, the live table, status, `summary.json`, compare, report, package and the MLflow export take the record's
`Trial`; `summary.json` holds its row."""
from __future__ import annotations

import ast
import inspect
import json
import typing
from pathlib import Path
from types import SimpleNamespace

from dashboards.runs import ROW_KEYS, ReplicateGroup, Trial
from tests.studyfolder import fabricated_study

ROOT = Path(__file__).resolve().parents[1]


def _classes_with_a_trial_id() -> set[str]:
    """`module.Class` of every class in launch/ and dashboards/ that holds a `trial_id` (a field or `self.trial_id`)."""
    found = set()
    for path in sorted([*ROOT.glob("launch/*.py"), *ROOT.glob("dashboards/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for inner in ast.walk(node):
                field = isinstance(inner, ast.AnnAssign) and getattr(inner.target, "id", None) == "trial_id"
                attribute = (isinstance(inner, ast.Attribute) and inner.attr == "trial_id"
                             and isinstance(inner.ctx, ast.Store) and getattr(inner.value, "id", None) == "self")
                if field or attribute:
                    found.add(f"{path.parent.name}.{path.stem}.{node.name}")
    return found


def test_one_trial_type_besides_tunes():
    # launch.rehearse._Trial: a stand-in for Tune's Trial, which the rehearsal's scheduler reads; TrialRecorder: the
    # writer inside a trial's own process (its result log), which knows the trial by its id only
    assert _classes_with_a_trial_id() == {"dashboards.runs.Trial", "launch.rehearse._Trial",
                                          "launch.trainable.TrialRecorder"}


def test_every_view_takes_the_records_trial():
    from dashboards import compare, report
    from launch import conclusions, driver, mlflow_export, package, record

    takes = {record.summarize: "rows", record.replicate_groups: "rows", record.table_row: "tune",
             package.select_best: "cands", package.seed_checkpoints: "cands", package.write_manifest: "members",
             mlflow_export.Export.run: "trials", compare.configurations: "runs", report.runs_table_html: "runs",
             report.plot_curves: "runs"}
    for function, argument in takes.items():
        hint = typing.get_type_hints(function)[argument]
        assert Trial in typing.get_args(hint) or hint is Trial, (function.__qualname__, hint)
    for function in (conclusions.tune_trial, record.table_row, record.trial_row, package.candidates,
                     driver.live_rows):
        hint = inspect.signature(function).return_annotation
        assert hint in ("Trial", "list[Trial]"), (function.__qualname__, hint)


def test_the_record_the_dashboards_and_the_summary_hold_the_same_trials(tmp_path):
    fab = fabricated_study(tmp_path, "shape", epochs=2)
    fab.add("a0", {"fusion": "gate", "lambda": 0.05, "seed": 0}, [{"epoch": e, "val/CIDEr": 50.0 + e} for e in (1, 2)])
    fab.add("b0", {"fusion": "none", "seed": 0}, [], status="PENDING")
    record = fab.record()
    assert all(type(t) is Trial for t in record.trials)
    [started] = record.study().runs  # the trials that started, the very objects of the record
    assert started is record.trials[0]
    rows = json.loads(json.dumps(record.summary()))["trials"]
    assert [list(r) for r in rows] == [[k for k in ROW_KEYS if k != "config"]] * 2  # summary.json's row, in order
    assert rows[0] == {**record.trials[0].row(config=False)} and rows[0]["best_epoch"] == 2
    assert record.trials[0]["lambda"] == record.trials[0].lam == 0.05 and record.trials[1]["lambda"] is None


def test_the_live_table_row_is_the_records_trial():
    from launch.driver import live_rows
    from launch.spec import load_study
    from tests.studyfolder import SMOKE

    tune = SimpleNamespace(trial_id="t1", status="RUNNING", config={"fusion": "none", "seed": 3},
                           last_result={"epoch": 2, "val/CIDEr": 0.9}, metric_analysis={"val/CIDEr": {"max": 0.95}})
    [row] = live_rows(load_study(SMOKE), tune)
    assert type(row) is Trial and (row.trial_id, row.state, row.seed, row.epochs_done) == ("t1", "RUNNING", 3, 2)
    assert (row.last, row.best_value, row["lambda"]) == (0.9, 0.95, None)
    # a fused trial (`resources.fuse_replicates`): a row per seed, each with its own id, last result and best, as
    # the record has it (`launch.layout.seed_trials`)
    fused = SimpleNamespace(trial_id="t2", status="RUNNING", config={"fusion": "none", "seeds": [0, 1]},
                            last_result={"epoch": 2, "val/CIDEr": 0.85, "seed0/epoch": 2, "seed0/val/CIDEr": 0.8,
                                         "seed1/epoch": 2, "seed1/val/CIDEr": 0.9},
                            metric_analysis={"val/CIDEr": {"max": 0.85}, "seed0/val/CIDEr": {"max": 0.8},
                                             "seed1/val/CIDEr": {"max": 0.95}})
    rows = live_rows(load_study(SMOKE), fused)
    assert [(r.trial_id, r.seed, r.epochs_done, r.last, r.best_value) for r in rows] == [
        ("t2-s0", 0, 2, 0.8, 0.8), ("t2-s1", 1, 2, 0.9, 0.95)]
    assert all(type(r) is Trial and r.state == "RUNNING" for r in rows)


def test_one_best_trial_rule_names_the_same_trial_in_the_summary_and_the_package():
    """`dashboards.stats.best_trial`: the better value in the study's mode; of equal values the lower (study, trial id),
    in whatever order the trials come; a trial the scheduler stopped is never best while another finished. The
    record's best trial, its group's best trial and package's choice within the group are all this one."""
    from dashboards.stats import best_trial
    from launch import package, record

    for mode, sign in (("max", 1), ("min", -1)):
        spec = SimpleNamespace(mode=mode)

        def trial(trial_id, value, study="s", **kw):
            return Trial(trial_id, study=study, state="TERMINATED", config={"train": {"seed": int(trial_id[-1])}},
                         config_hash="h", best_value=sign * value, best_checkpoint=f"/c/{trial_id}", **kw)

        equal = [trial("t1", 70.0), trial("t0", 70.0), trial("t2", 60.0),
                 trial("t3", 99.0, stopped_early={"rung": 1, "cutoff": 80.0})]
        group = ReplicateGroup("h")  # naming no trial with a checkpoint
        for rows in (equal, equal[::-1]):
            assert best_trial(rows, mode).trial_id == "t0"
            assert record.best_trial(spec, rows).trial_id == "t0"
            assert record.replicate_groups(spec, rows)[0]["best_trial"] == "t0"
            assert package.select_best(group, rows, mode, "s").trial_id == "t0"
        assert best_trial(equal[3:], mode).trial_id == "t3"  # every trial stopped: the best of them
        assert best_trial([trial("t0", 1.0, study="b"), trial("t9", 1.0, study="a")], mode).trial_id == "t9"
        assert best_trial([Trial("t0")], mode) is None
