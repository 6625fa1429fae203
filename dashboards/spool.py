"""Tracking that never blocks training and loses nothing: a queue drained by a thread, and a spool in the study's
storage (`tracking/spool/`, one record per file; `tracking/outage.json`: the totals) for what MLflow could not take.

A record is one tracking call keyed by trial id (a trial that starts while the server is down has no run yet).
Applying one twice changes nothing (MLflow keeps one row per key, step, timestamp and value; runs are found again by
their trial id tag), so a replay deletes each record once applied, and one cut short goes on without duplicates.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time

from a2core.errors import StorageError, TrackingError
from dashboards.tracking import check_tracking_uri

logger = logging.getLogger(__name__)


class Spool:
    """Records in `<study>/tracking/spool/` (`study`: a `dashboards.storage.Location`), oldest first, and the outage
    totals of the study's drivers in `<study>/tracking/outage.json`."""

    def __init__(self, study):
        self.folder = study.join("tracking", "spool")
        self.outage_file = study.join("tracking", "outage.json")
        names = self.names()
        self.next_seq = int(names[-1].split(".")[0]) + 1 if names else 1  # a new driver never numbers over one

    def names(self) -> list[str]:
        return [n for n in self.folder.listdir() if n.endswith(".json")]  # zero-padded: sorted is in order

    def append(self, record: dict) -> None:
        self.folder.join(f"{self.next_seq:010d}.json").write_text(json.dumps(record, default=_plain) + "\n")
        self.next_seq += 1

    def read(self, name: str) -> dict:
        return json.loads(self.folder.join(name).read_text())

    def delete(self, name: str) -> None:
        self.folder.join(name).delete()

    def add_outage(self, **counts) -> dict:
        """Add this driver's figures to the study's saved ones; returns the totals with `pending` (records left)."""
        saved = json.loads(self.outage_file.read_text() or "{}")
        keys = ("down_seconds", "spooled", "replayed", "dropped")
        totals = {key: saved.get(key, 0) + counts.get(key, 0) for key in keys}
        totals["down_seconds"] = round(float(totals["down_seconds"]), 3)
        if any(counts.values()):
            self.outage_file.write_text(json.dumps(totals, indent=2) + "\n")
        return {**totals, "pending": len(self.names())}


def _plain(value):
    """numpy scalars (results carry them) as numbers, anything else as its text."""
    return value.item() if hasattr(value, "item") else str(value)


def outage_line(outage: dict | None) -> str | None:
    """`tracking: server down 31 s, 14 records spooled, all replayed`; None when nothing happened."""
    if not outage or not (outage.get("spooled") or outage.get("down_seconds") or outage.get("pending")):
        return None
    pending = outage.get("pending", 0)
    text = (f"tracking: server down {outage.get('down_seconds', 0):.0f} s, {outage.get('spooled', 0)} records "
            f"spooled, " + (f"{pending} waiting in the spool (`a2 mlflow sync NAME` replays them)" if pending
                            else "all replayed"))
    if outage.get("dropped"):
        text += f", {outage['dropped']} refused by the server (see the log)"
    return text


def apply(tracker, record: dict) -> None:
    """Make the tracking call that `record` stands for (`StudyTracker` methods; idempotent, see the module doc)."""
    op, trial = record["op"], record.get("trial")
    if op == "end_study":
        tracker.end_study(record["status"], record.get("reason"))
        return
    if op == "trial":
        tracker.trial_run(trial, record.get("config"), tags=record.get("tags"), run_name=record.get("run_name"))
        return
    if op not in ("metrics", "backfill", "tags", "text", "end_trial"):
        raise ValueError(f"unknown tracking record {op!r}")
    run_id = tracker.trial_runs.get(trial) or tracker.trial_run(trial)
    if op == "metrics":
        tracker.log_metrics(run_id, record["metrics"], step=record["step"], timestamp_ms=record.get("ts"))
    elif op == "backfill":  # epochs of the trial's result log that its run lacks
        logged = tracker.logged_steps(run_id, record["metric"])
        for entry in record["entries"]:
            if entry["step"] not in logged:
                tracker.log_metrics(run_id, entry["metrics"], step=entry["step"], timestamp_ms=entry.get("ts"))
    elif op == "tags":
        tracker.set_tags(run_id, record["tags"])
    elif op == "text":
        tracker.client.log_text(run_id, record["text"], record["file"])
    else:
        tracker.end_trial(run_id, record["status"], record.get("reason"))


def server_answers(tracker, timeout: float = 2.0) -> bool:
    try:
        check_tracking_uri(tracker.tracking_uri, timeout=timeout)
        return True
    except TrackingError:
        return False


def replay(tracker, spool: Spool, *, stop_on_error: bool = True) -> tuple[int, int]:
    """Apply the spooled records in order, deleting each once applied; returns (replayed, dropped). A record the
    server refuses is dropped with a warning; a server that stops answering stops the replay (TrackingError, or
    quietly without `stop_on_error`) and the rest stays spooled."""
    replayed = dropped = 0
    for name in spool.names():
        record = spool.read(name)
        try:
            apply(tracker, record)
            replayed += 1
        except Exception as err:  # noqa: BLE001 - the server's or the connection's
            if not server_answers(tracker):
                if not stop_on_error:
                    break
                raise TrackingError(f"MLflow server {tracker.tracking_uri} stopped answering during the "
                                    f"replay ({replayed} records replayed): {err}") from err
            logger.warning("MLflow refused spooled record %s (%s): %s", name, record.get("op"), err)
            dropped += 1
        spool.delete(name)
    return replayed, dropped


_STOP = object()


class TrackingQueue:
    """`put(record)` returns at once; a thread applies the records while the server answers, spools them (in order,
    behind any older spooled record) while it does not, and replays the spool when a probe (every `probe_every` s)
    finds the server back. At most `maxsize` records wait in memory, which only a stalled storage fills."""

    def __init__(self, tracker, spool: Spool, *, maxsize: int = 10_000, probe_every: float = 5.0):
        self.tracker, self.spool, self.probe_every = tracker, spool, probe_every
        self.queue: queue.Queue = queue.Queue(maxsize)
        self.backlog = len(spool.names())  # left by an earlier driver: replayed before anything new
        self.down_since: float | None = None
        self.down_seconds = 0.0
        self.spooled = self.replayed = self.dropped = 0
        self.last_probe = 0.0
        self.thread = threading.Thread(target=self._work, name="a2-tracking", daemon=True)
        self.thread.start()

    def put(self, record: dict) -> None:
        self.queue.put(record)

    def status(self) -> dict:
        down = self.down_seconds + (time.monotonic() - self.down_since if self.down_since is not None else 0.0)
        return {"down_seconds": round(down, 3), "spooled": self.spooled, "replayed": self.replayed,
                "dropped": self.dropped, "pending": self.backlog}

    def close(self, timeout: float = 120.0) -> dict:
        """Apply or spool what is queued, replay the spool if the server answers, stop the thread; then add this
        driver's outage to the study's record and return the totals."""
        self.queue.put(_STOP)
        self.thread.join(timeout)
        if self.thread.is_alive():
            logger.warning("MLflow tracking still busy after %.0f s; what it has not applied stays spooled", timeout)
        self._outage_over()
        return self.spool.add_outage(down_seconds=self.down_seconds, spooled=self.spooled,
                                     replayed=self.replayed, dropped=self.dropped)

    def _outage_over(self) -> None:
        if self.down_since is not None:
            self.down_seconds += time.monotonic() - self.down_since
            self.down_since = None

    def _work(self) -> None:
        while True:
            try:
                record = self.queue.get(timeout=self.probe_every)
            except queue.Empty:
                record = None
            if record is not None and record is not _STOP:
                self._handle(record)
                self.queue.task_done()  # `queue.join()` waits until every record is applied or spooled
            self._catch_up(force=record is _STOP)
            if record is _STOP:
                self.queue.task_done()
                return

    def _handle(self, record: dict) -> None:
        if not self.backlog:
            try:
                apply(self.tracker, record)
                return
            except Exception as err:  # noqa: BLE001
                if server_answers(self.tracker):  # the server is there and refused this call: nothing to retry
                    logger.warning("MLflow refused %s for trial %s: %s", record.get("op"), record.get("trial"), err)
                    self.dropped += 1
                    return
                logger.warning("MLflow server %s not answering (%s); spooling to %s", self.tracker.tracking_uri,
                               err, self.spool.folder.uri)
                self.down_since = self.last_probe = time.monotonic()
        try:
            self.spool.append(record)
        except StorageError as err:  # storage down too: the result log still has the metrics (backfill)
            logger.error("tracking record lost (%s for trial %s): %s", record.get("op"), record.get("trial"), err)
            self.dropped += 1
            return
        self.spooled += 1
        self.backlog += 1

    def _catch_up(self, force: bool = False) -> None:
        """Replay the spool when the server answers again (probed at most every `probe_every` s)."""
        if not self.backlog or (not force and time.monotonic() - self.last_probe < self.probe_every):
            return
        self.last_probe = time.monotonic()
        if not server_answers(self.tracker):
            return
        try:
            replayed, dropped = replay(self.tracker, self.spool, stop_on_error=False)
        except StorageError as err:
            logger.error("could not replay the tracking spool: %s", err)
            return
        self.replayed += replayed
        self.dropped += dropped
        self.backlog = len(self.spool.names())
        if not self.backlog and self.down_since is not None:
            self._outage_over()
            logger.warning("MLflow server back; %d spooled records replayed", self.replayed)
