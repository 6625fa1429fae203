"""A trial's result log recovers what a dead driver lost: the epoch history saved with the newest checkpoint."""
from __future__ import annotations

import json

from launch.storage import open_location
from launch.layout import RESULTS_FILE, ResultLog, latest_checkpoint_history
from tests.s3server import make_bucket


def _write_run(put, epochs_with_history: dict[int, list[int]]) -> None:
    """A Train run folder: checkpoint_epochNNNN/{checkpoint.pt, history.json} (None: an older checkpoint
    without a history file)."""
    for epoch, history in epochs_with_history.items():
        put(f"checkpoint_epoch{epoch:04d}/checkpoint.pt", b"weights")
        if history is not None:
            put(f"checkpoint_epoch{epoch:04d}/history.json",
                json.dumps([{"epoch": e, "val/CIDEr": e / 10, "stage": "xe"} for e in history]).encode())


def _check(run_uri: str, endpoint: str | None) -> None:
    run = open_location(run_uri, endpoint)
    history = latest_checkpoint_history(run)
    assert [h["epoch"] for h in history] == [1, 2, 3]  # checkpoint 3 is the newest one with a history

    log = ResultLog(run.join(RESULTS_FILE))
    log.add({"epoch": 1, "val/CIDEr": 0.5, "samples": ["not kept: a list"]})
    assert log.add_missing(history) == [2, 3]  # epoch 1 keeps what the driver saw
    assert log.add_missing(history) == []
    again = ResultLog(run.join(RESULTS_FILE))  # what a restarted trial reads
    assert [(r["epoch"], r["val/CIDEr"]) for r in again.by_epoch.values()] == [(1, 0.5), (2, 0.2), (3, 0.3)]
    assert "samples" not in again.by_epoch[1]


def test_local_run_folder(tmp_path):
    run = tmp_path / "trials" / "study-abc"

    def put(rel: str, data: bytes) -> None:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(data)

    assert latest_checkpoint_history(open_location(run)) == []  # no run folder yet
    _write_run(put, {1: [1], 3: [1, 2, 3], 4: None})
    _check(str(run), None)


def test_s3_run_folder(s3_endpoint):
    from tests.s3server import s3_client

    bucket = make_bucket(s3_endpoint, "result-log")
    client = s3_client(s3_endpoint)

    def put(rel: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=f"studies/s/trials/s-abc/{rel}", Body=data)

    run_uri = f"s3://{bucket}/studies/s/trials/s-abc"
    assert latest_checkpoint_history(open_location(run_uri, s3_endpoint)) == []
    _write_run(put, {1: [1], 3: [1, 2, 3], 4: None})
    _check(run_uri, s3_endpoint)
