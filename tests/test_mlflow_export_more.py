"""More edges of the MLflow export (`launch.mlflow_export`, `launch.tracking_writer`) on a SQLite store, of a study
built on disk without Ray (`tests.studyfolder.fabricated_study`): metric keys MLflow refuses as paths, and a study's
parent run deleted by hand before `a2 mlflow sync`."""
from __future__ import annotations

from collections import Counter

from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from dashboards.tracking import study_runs
from tests.studyfolder import fabricated_study


def results(extra: dict, epochs: int = 2) -> list[dict]:
    return [{"epoch": e, "val/CIDEr": 10.0 + e, "timestamp": 1000.0 + e, **extra} for e in range(1, epochs + 1)]


def points(uri: str, name: str) -> dict:
    """{trial id: {key: Counter(step)}} over the study's trial runs."""
    client = MlflowClient(uri)
    _, children = study_runs(uri, name)
    return {run.data.tags["a2.trial_id"]: {key: Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
                                           for key in run.data.metrics} for run in children}


def test_metric_keys_a_path_would_resolve_are_exported_and_do_not_stop_the_trials_after_them(tmp_path, monkeypatch):
    """MLflow refuses a metric key that names another as a path (`val/`, `diag//mask`, `./x`, or a long key cut on a
    `/`), and with it the whole batch; before, the export raised on such a trial at every try, and no later trial
    was ever exported."""
    monkeypatch.chdir(tmp_path)  # SQLite stores keep their artifacts under ./mlruns
    study = fabricated_study(tmp_path, "odd-keys", 2)
    long_key = "k" * 249 + "/x"  # cut to MLflow's 250 characters, it ends on "/"
    study.add("t0", {"fusion": "none", "seed": 0},
              results({"val/": 1.0, "diag//mask": 2.0, "./x": 3.0, "a/../b": 4.0, long_key: 5.0}))
    study.add("t1", {"fusion": "none", "seed": 1}, results({}))
    study.export()
    study.export()  # again: nothing written twice
    got = points(study.spec.tracking.mlflow_uri, study.spec.name)
    both = Counter({1: 1, 2: 1})
    assert got["t1"] == {"val/CIDEr": both}
    assert got["t0"] == {"val/CIDEr": both, "val/_": both, "diag/_/mask": both, "_/x": both, "a/_/b": both,
                         "k" * 249 + "_": both}


def test_a_parent_run_deleted_by_hand_is_restored_not_made_again(tmp_path, monkeypatch):
    """The study's parent run deleted in the MLflow UI, then `a2 mlflow sync`: before, the export made a new parent
    and new trial runs beside the old ones, which stayed active, so the study's views listed every trial twice."""
    monkeypatch.chdir(tmp_path)
    study = fabricated_study(tmp_path, "deleted-parent", 2)
    study.add("t0", {"fusion": "none", "seed": 0}, results({}))
    study.export()
    uri = study.spec.tracking.mlflow_uri
    client = MlflowClient(uri)
    parent, children = study_runs(uri, study.spec.name)
    client.delete_run(parent.info.run_id)
    study.export()
    exp = client.get_experiment_by_name(study.spec.name)
    every = client.search_runs([exp.experiment_id], "", run_view_type=ViewType.ALL)
    assert sorted((r.data.tags["a2.role"], r.info.run_id, r.info.lifecycle_stage) for r in every) == sorted(
        [("study", parent.info.run_id, "active"), ("trial", children[0].info.run_id, "active")])
    assert client.get_run(parent.info.run_id).info.status == parent.info.status  # ended as the first export left it
    assert points(uri, study.spec.name) == {"t0": {"val/CIDEr": Counter({1: 1, 2: 1})}}
