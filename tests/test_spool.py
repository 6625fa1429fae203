"""The tracking spool: records kept in order across drivers, replayed once each (a replay cut short goes on
without duplicates), and the queue that spools while the server is down and replays when it is back."""
from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient

import dashboards.spool as spool_mod
from a2core.errors import TrackingError
from dashboards.spool import Spool, TrackingQueue, apply, outage_line, replay
from dashboards.storage import open_location
from dashboards.tracking import StudyTracker, study_runs
from tests.raycluster import tiny_data, tiny_study  # noqa: F401 - tiny_data is a fixture


class Server:
    """Whether the (pretend) server answers; a tracker behind it fails every call while it does not."""

    def __init__(self):
        self.up = True
        self.calls = 0


class Behind:
    def __init__(self, tracker: StudyTracker, server: Server, fail_after: int | None = None):
        self._tracker, self._server, self._fail_after = tracker, server, fail_after

    def __getattr__(self, name):
        value = getattr(self._tracker, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            self._server.calls += 1
            if self._fail_after is not None and self._server.calls > self._fail_after:
                self._server.up = False
            if not self._server.up:
                raise ConnectionError("connection refused")
            return value(*args, **kwargs)

        return call


@pytest.fixture
def server(monkeypatch):
    state = Server()
    monkeypatch.setattr(spool_mod, "server_answers", lambda tracker, timeout=2.0: state.up)
    return state


def _records(trial="t0", epochs=4):
    yield {"op": "trial", "trial": trial, "config": {"train": {"seed": 0}}, "tags": {}, "run_name": trial}
    for epoch in range(1, epochs + 1):
        yield {"op": "metrics", "trial": trial, "step": epoch, "ts": 1_700_000_000_000 + epoch,
               "metrics": {"val/CIDEr": 10.0 * epoch, "train/loss": 1.0 / epoch}}
    yield {"op": "end_trial", "trial": trial, "status": "FINISHED"}


def _history(uri, run_id, key="val/CIDEr"):
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def test_spool_keeps_order_across_drivers(tmp_path):
    study = open_location(tmp_path / "study")
    first = Spool(study)
    for i in range(3):
        first.append({"op": "tags", "trial": "t0", "tags": {"i": i}})
    first.delete(first.names()[0])
    second = Spool(study)  # a restarted driver numbers on after the last record, never over one
    second.append({"op": "tags", "trial": "t0", "tags": {"i": 3}})
    assert [second.read(n)["tags"]["i"] for n in second.names()] == [1, 2, 3]
    assert second.names() == ["0000000002.json", "0000000003.json", "0000000004.json"]


def test_replay_cut_short_goes_on_without_duplicates(tmp_path, server):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = StudyTracker(uri, "spool-study")
    tracker.start_study()
    spool = Spool(open_location(tmp_path / "study"))
    for record in _records():
        spool.append(record)

    with pytest.raises(TrackingError, match="2 records replayed"):  # the server dies after two calls
        replay(Behind(tracker, server, fail_after=2), spool)
    assert len(spool.names()) == 4  # trial and epoch 1 applied and gone; epochs 2-4 and the end wait
    apply(tracker, {"op": "metrics", "trial": "t0", "step": 1, "ts": 1_700_000_000_001,  # applied twice:
                    "metrics": {"val/CIDEr": 10.0, "train/loss": 1.0}})                # a driver died before delete
    server.up = True
    restarted = StudyTracker(uri, "spool-study")  # a new driver: finds the parent and the trial's run by tags
    restarted.start_study()
    assert replay(restarted, Spool(open_location(tmp_path / "study"))) == (4, 0)

    run_id = restarted.trial_runs["t0"]
    assert _history(uri, run_id) == [(1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0)]
    assert _history(uri, run_id, "train/loss") == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (4, 0.25)]
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
    assert spool.names() == []


def test_queue_spools_while_down_and_replays_when_back(tmp_path, server):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = StudyTracker(uri, "queue-study")
    tracker.start_study()
    study = open_location(tmp_path / "study")
    q = TrackingQueue(Behind(tracker, server), Spool(study), probe_every=0.05)
    records = list(_records(epochs=5))
    q.put(records[0])
    q.put(records[1])
    q.queue.join()
    server.up = False
    for record in records[2:5]:  # epochs 2-4 while the server is down
        q.put(record)
    q.queue.join()
    assert q.status()["spooled"] == 3 and len(Spool(study).names()) == 3
    time.sleep(0.3)  # down for a while: the outage's length is rounded to 0.1 s
    server.up = True
    for record in records[5:]:
        q.put(record)
    outage = q.close()
    assert outage["spooled"] == outage["replayed"] >= 3 and outage["pending"] == 0 and outage["down_seconds"] > 0
    assert outage_line(outage).startswith(f"tracking: server down ") and "all replayed" in outage_line(outage)
    assert _history(uri, tracker.trial_runs["t0"]) == [(e, 10.0 * e) for e in range(1, 6)]
    assert MlflowClient(uri).get_run(tracker.trial_runs["t0"]).info.status == "FINISHED"
    assert Spool(study).add_outage()["spooled"] == outage["spooled"]  # saved for summary.json


def test_outage_line():
    assert outage_line({"down_seconds": 0, "spooled": 0, "replayed": 0, "pending": 0}) is None
    assert outage_line({"down_seconds": 31.2, "spooled": 14, "replayed": 14, "pending": 0}) == (
        "tracking: server down 31 s, 14 records spooled, all replayed")
    assert "2 waiting in the spool" in outage_line({"down_seconds": 5, "spooled": 2, "replayed": 0, "pending": 2})


def test_mlflow_sync_replays_a_finished_studys_spool(tmp_path, tiny_data, capsys):  # noqa: F811
    """`a2 mlflow sync NAME` after a study that ended while the server was down: the spool goes to MLflow in
    order, the parent run takes the status the study ended with, summary.json's `tracking` says all replayed."""
    import argparse
    import json

    import yaml

    from launch.spec import load_study
    from launch.study import cmd_sync, saved_form

    spec = load_study(tiny_study(tmp_path, "synced", tiny_data))
    study_dir = tmp_path / "studies" / "synced"
    study_dir.mkdir(parents=True)
    (study_dir / "study.yaml").write_text(yaml.safe_dump(saved_form(spec), sort_keys=False))
    (study_dir / "summary.json").write_text(json.dumps({"name": "synced", "tracking": {"pending": 8}}))
    tracker = StudyTracker(spec.tracking["mlflow_uri"], "synced")
    tracker.start_study()  # the study started with the server up ...
    spool = Spool(open_location(study_dir))  # ... which was down from the first trial to the end
    for record in [*_records(epochs=5), {"op": "end_study", "status": "FINISHED"}]:
        spool.append(record)
    spool.add_outage(down_seconds=12.0, spooled=8)

    assert cmd_sync(argparse.Namespace(name="synced", storage=str(tmp_path / "studies"))) == 0
    assert "8 tracking records replayed; tracking: server down 12 s, 8 records spooled, all replayed" \
        in capsys.readouterr().out
    tracking = json.loads((study_dir / "summary.json").read_text())["tracking"]
    assert tracking == {"down_seconds": 12.0, "spooled": 8, "replayed": 8, "dropped": 0, "pending": 0}
    uri = spec.tracking["mlflow_uri"]
    parent, children = study_runs(uri, "synced")
    assert parent.info.status == "FINISHED" and [c.info.status for c in children] == ["FINISHED"]
    assert _history(uri, children[0].info.run_id) == [(e, 10.0 * e) for e in range(1, 6)]
