"""One run per trial, for ever: a trial that a killed driver lost (Tune's state saved before it started, so its
configuration ran again under a new trial id) leaves an MLflow run RUNNING that nothing would end; the export at
the study's end and `a2 mlflow sync` end it KILLED with `a2.end_reason` saying it was superseded."""
from __future__ import annotations

from launch.cli import main
from launch.mlflow_export import SUPERSEDED, Export
from launch.tracking_writer import StudyTracker
from tests.studyfolder import fabricated_study


def _runs(fab) -> dict:
    tracker = StudyTracker(fab.spec.tracking.mlflow_uri, fab.spec.name)
    return {r.data.tags.get("a2.trial_id"): r for r in tracker.client.search_runs([tracker.experiment_id])}


def test_sync_ends_a_superseded_run_killed_with_its_reason(tmp_path, monkeypatch, capsys):
    fab = fabricated_study(tmp_path, "lost", epochs=2, overrides=("search.replicates=2",))
    fab.add("old0", {"fusion": "none", "seed": 0}, [{"epoch": 1, "val/CIDEr": 10.0}], status="RUNNING")
    Export(fab.spec, fab.location).run(list(fab.trials))  # the live export of the driver that was then killed
    assert _runs(fab)["old0"].info.status == "RUNNING"

    fab.trials.clear()  # the resumed experiment knows nothing of old0: its configuration ran again as new0
    fab.add("new0", {"fusion": "none", "seed": 0}, [{"epoch": e, "val/CIDEr": 10.0 + e} for e in (1, 2)])
    fab.add("new1", {"fusion": "none", "seed": 1}, [{"epoch": e, "val/CIDEr": 11.0 + e} for e in (1, 2)])
    for seed in (0, 1):
        fab.add(f"gate{seed}", {"fusion": "gate", "lambda": 0.05, "seed": seed},
                [{"epoch": e, "val/CIDEr": 12.0 + e} for e in (1, 2)])
    fab.patch_tune(monkeypatch)
    assert main(["mlflow", "sync", "lost", "--storage", str(fab.spec.storage)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "study lost: exported to MLflow; nothing was missing; 1 run(s) left RUNNING by trials a killed driver lost "
        "ended KILLED (superseded)")
    runs = _runs(fab)
    assert runs["old0"].info.status == "KILLED" and runs["old0"].data.tags["a2.end_reason"] == SUPERSEDED
    assert {runs[t].info.status for t in ("new0", "new1", "gate0", "gate1")} == {"FINISHED"}
    assert runs[None].info.status == "FINISHED"  # the study itself: every planned trial finished
    assert main(["mlflow", "sync", "lost", "--storage", str(fab.spec.storage)]) == 0  # again: nothing to end
    assert capsys.readouterr().out.strip().splitlines()[-1] == "study lost: exported to MLflow; nothing was missing"
    assert _runs(fab)["old0"].info.status == "KILLED"


def test_a_run_of_a_known_trial_is_never_called_superseded(tmp_path):
    fab = fabricated_study(tmp_path, "known", epochs=2, overrides=("search.replicates=2",))
    fab.add("a0", {"fusion": "none", "seed": 0}, [{"epoch": 1, "val/CIDEr": 10.0}], status="PENDING")
    export = Export(fab.spec, fab.location)
    export.run(list(fab.trials), "the study stopped; continue with `a2 study resume known`")
    run = _runs(fab)["a0"]
    assert export.superseded == [] and run.info.status == "KILLED"
    assert run.data.tags["a2.end_reason"] == "the study stopped; continue with `a2 study resume known`"
