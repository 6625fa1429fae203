"""Claims of the how-to pages on studies (docs/how-to/resume.md, rehearse.md, results-in-python.md,
compare-trials-in-mlflow.md, tracking-server.md) checked without Ray."""
from __future__ import annotations

import signal

from tests.studyfolder import fabricated_study


class _TuneTrial:
    """What the driver's MLflow callback reads of one of Tune's live trials."""

    def __init__(self, trial_id: str, config: dict, status: str):
        self.trial_id, self.config, self.status = trial_id, config, status
        self.num_failures, self.last_result = 0, {}

    def get_error(self):
        return None

    def __str__(self):
        return f"a2_local_trial_{self.trial_id}"


def test_a_stopped_study_ends_the_runs_of_its_running_trials_killed_not_finished(tmp_path, monkeypatch):
    """resume.md, "Stopping": Ctrl-C or SIGTERM stops a study, and the runs of the trials it stopped are marked KILLED
    (tag `a2.end_reason`). Tune's cleanup sets a running trial TERMINATED (after saving it as PENDING) before the
    callback's last export: that trial's run was FINISHED, tagged `a2.stopped_early`, as if early stopping had cut
    it."""
    import mlflow

    import launch.stop
    from launch.mlflow_callback import A2MLflowCallback

    fab = fabricated_study(tmp_path, "stopped", epochs=2)
    fab.add("done0000", {"fusion": "none", "seed": 0},
            [{"epoch": e, "stage": "xe", "val/CIDEr": 10.0 + e} for e in (1, 2)])
    fab.add("half0000", {"fusion": "none", "seed": 1}, [{"epoch": 1, "stage": "xe", "val/CIDEr": 11.0}])
    done = _TuneTrial("done0000", {"fusion": "none", "seed": 0}, "TERMINATED")
    half = _TuneTrial("half0000", {"fusion": "none", "seed": 1}, "RUNNING")

    callback = A2MLflowCallback(fab.spec, fab.location, every=3600.0)
    callback.setup()
    callback.on_step_begin(1, [done, half])
    callback.on_step_end(1, [done, half])
    half.status = "TERMINATED"  # Tune's cleanup of a trial still running when the study stopped
    monkeypatch.setattr(launch.stop, "received", lambda: int(signal.SIGINT))
    callback.on_experiment_end([done, half])

    client = mlflow.tracking.MlflowClient(fab.spec.tracking.mlflow_uri)
    experiment = client.get_experiment_by_name("stopped")
    runs = {run.data.tags.get("a2.trial_id"): run for run in client.search_runs([experiment.experiment_id])}
    assert runs["done0000"].info.status == "FINISHED"
    half_run = runs["half0000"]
    assert half_run.info.status == "KILLED", half_run.data.tags
    assert "interrupted by SIGINT" in half_run.data.tags.get("a2.end_reason", ""), half_run.data.tags
    assert "a2.stopped_early" not in half_run.data.tags, half_run.data.tags
    assert runs[None].info.status == "KILLED"  # the study's parent run
