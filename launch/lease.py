"""One writer per study: `<storage>/<name>/lease.json`, created only if absent (`O_CREAT | O_EXCL` on disk, a
conditional PUT, `put_object(IfNoneMatch="*")`, on S3), naming its holder, its heartbeat renewed by a thread.
A stale lease (no heartbeat for `stale_after` s) is taken over with `force=True`, one whose process is gone from
this host without it, both loudly; a live one never (docs/explanation/faults.md)."""
from __future__ import annotations

import contextlib
import getpass
import json
import os
import socket
import sys
import threading
import time
import uuid

from a2core.errors import StorageError, StudyError
from launch.defaults import DEFAULT_STALE_AFTER
from launch.storage import make_client, parse_s3_uri

LEASE_FILE = "lease.json"


def _pid_gone(holder: dict) -> bool:
    """The holder ran on this host and its process is no longer there."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)  # signal 0: only asks whether the process exists
    except OSError as err:  # PermissionError: alive, another user's
        return isinstance(err, ProcessLookupError)
    return False


def describe(holder: dict) -> str:
    age = time.time() - float(holder.get("heartbeat", 0))
    return (f"{holder.get('user', '?')}@{holder.get('host', '?')} pid {holder.get('pid', '?')} since "
            f"{holder.get('started', '?')} (last heartbeat {age:.0f} s ago)")


def live_writer(study) -> dict | None:
    """The holder of the lease of the study at `study` (a Location of its folder) while it is alive: a heartbeat
    younger than `DEFAULT_STALE_AFTER` and, on this host, its process still there; else None."""
    holder = StudyLease(study).read()
    if holder is None or _pid_gone(holder) or time.time() - float(holder.get("heartbeat", 0)) >= DEFAULT_STALE_AFTER:
        return None
    return holder


class StudyLease:
    """The lease of the study at `study` (a `launch.storage.Location` of the study's folder)."""

    def __init__(self, study, stale_after: float = DEFAULT_STALE_AFTER):
        if not stale_after > 0:
            raise StudyError(f"--stale-after must be a positive number of seconds, got {stale_after!r}")
        self.location = study.join(LEASE_FILE)
        self.stale_after = float(stale_after)
        self.every = min(30.0, self.stale_after / 4)
        now = time.time()
        self.mine = {"user": getpass.getuser(), "host": socket.gethostname(), "pid": os.getpid(),
                     "token": uuid.uuid4().hex,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "heartbeat": now}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- storage ---------------------------------------------------------------------------------------------
    def _create(self, info: dict) -> bool:
        """Write the lease if there is none; False when one exists."""
        body = json.dumps(info, indent=2) + "\n"
        if self.location.local:
            try:
                os.makedirs(os.path.dirname(self.location.uri), exist_ok=True)
                with open(self.location.uri, "x") as f:  # O_CREAT | O_EXCL
                    f.write(body)
            except FileExistsError:
                return False
            except OSError as err:  # read-only, full, a file in the way, not allowed: one line, before Ray starts
                raise StorageError(f"{self.location.uri}: cannot write the study's lease "
                                   f"({err.strerror or err}); a study is run, resumed and synced only where its "
                                   f"storage can be written") from None
            return True
        from botocore.exceptions import ClientError  # boto3's: only for a lease on S3, as in launch.storage

        bucket, key = parse_s3_uri(self.location.uri, require_key=True)
        try:
            make_client(self.location.endpoint_url).put_object(Bucket=bucket, Key=key, Body=body.encode(),
                                                               IfNoneMatch="*")
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        return True

    def read(self) -> dict | None:
        text = self.location.read_text()
        try:
            return json.loads(text) if text else None
        except ValueError:  # cut short by a crash while written: as good as stale
            return {"heartbeat": 0}

    # -- taking, keeping and giving back ---------------------------------------------------------------------
    def acquire(self, force: bool = False) -> None:
        if not self._create(self.mine):
            holder = self.read()
            if holder is not None or not self._create(self.mine):  # None: released between our two looks
                self._take_over(holder or {}, force)
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="a2-lease", daemon=True)
        self._thread.start()

    def _take_over(self, holder: dict, force: bool) -> None:
        """Replace a lease whose process is gone from this host, or a stale one with `force`; refuse the rest."""
        age = time.time() - float(holder.get("heartbeat", 0))
        gone = _pid_gone(holder)
        study = os.path.dirname(self.location.uri)
        if not gone and age < self.stale_after:
            raise StudyError(f"study at {study} is being written by {describe(holder)}; one writer per study: "
                             f"wait for it to end (`--force` takes over only a lease with no heartbeat for "
                             f"{self.stale_after:.0f} s)")
        if not force and not gone:
            raise StudyError(f"study at {study} has a stale lease of {describe(holder)}; if that process is "
                             f"gone, take the study over with --force")
        why = "its process is gone from this host" if gone else "--force"
        print(f"a2 study: WARNING: taking over the stale lease of {describe(holder)} on {study} ({why})",
              file=sys.stderr, flush=True)
        self.location.delete()
        if not self._create(self.mine):
            raise StudyError(f"study at {study}: another process took the lease first: "
                             f"{describe(self.read() or {})}")

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            try:
                holder = self.read()
                if not holder or holder.get("token") != self.mine["token"]:
                    print(f"a2 study: WARNING: the lease on {self.location.uri} was taken over by "
                          f"{describe(holder or {})}; this process is no longer the study's one writer",
                          file=sys.stderr, flush=True)
                    return
                self.mine["heartbeat"] = time.time()
                self.location.write_text(json.dumps(self.mine, indent=2) + "\n")  # atomic: a reader never sees half
            except Exception as err:  # noqa: BLE001 - storage trouble: try again at the next beat
                print(f"a2 study: note: lease heartbeat failed: {err}", file=sys.stderr, flush=True)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        with contextlib.suppress(Exception):  # a lease left behind only goes stale
            holder = self.read()
            if holder and holder.get("token") == self.mine["token"]:
                self.location.delete()

    @contextlib.contextmanager
    def held(self, force: bool = False):
        self.acquire(force)
        try:
            yield self
        finally:
            self.release()
