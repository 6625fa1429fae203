"""One writer per study: `<storage>/<name>/lease.json`, created only if absent (`O_CREAT | O_EXCL` on disk, a
conditional PUT, `put_object(IfNoneMatch="*")`, on S3), naming its holder and the holder's own staleness period, its
heartbeat renewed by a thread. A stale lease is taken over with `force=True`, one whose process is gone from this
host without it, both loudly; a live one never, and never one whose process is alive on this host, whatever
`--force` and the clocks say (a frozen head node, a suspended laptop: it would wake up as a second writer).

Staleness is judged on the storage's own clock: the age of the lease is the time since the lease file was last
written (its modification time, set by the storage when the holder's heartbeat rewrites it), measured against the
modification time of a file the taker writes there now. The holder's clock (its `heartbeat` field, for people) and
the taker's never meet, so a holder on a host whose clock runs an hour ahead neither locks the study out for an hour
nor is taken as stale early. The period is the holder's own (`stale_after` in its lease: `--stale-after` of the
driver that wrote it, or a taker's longer one), so a taker's short `--stale-after` never makes a healthy holder
stale. A driver whose lease was taken over stops before its next write (`StudyLease.check`, `LeaseLost`).

A take-over removes the stale lease and creates its own, two calls: two takers of one stale lease could each do both,
the second removing the first's fresh lease. So only the taker that creates the claim `lease.json.takeover-<token of
the stale holder>` (if-absent, as the lease) replaces it, and it removes the lease only if it is still the version it
judged stale: a compare-and-swap in the storage (`launch.storage.delete_if_unchanged`: S3's conditional DELETE, an
flock on disk), as are a heartbeat's rewrite and a release. A claim alone is not enough: a taker frozen (SIGSTOP, a
long GC) after its last look at the lease for longer than the holder's period has its claim walked past, and a
check-then-remove would, once it runs again, remove the lease of the one that took the study over meanwhile."""
from __future__ import annotations

import calendar
import contextlib
import getpass
import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
import uuid
from typing import NoReturn

from a2core.errors import StorageError, StudyError
from launch.defaults import DEFAULT_STALE_AFTER
from launch.storage import (WriteRefused, delete_if_unchanged, open_location, read_versioned, replace_if_unchanged,
                            resolve_endpoint_url)

LEASE_FILE = "lease.json"
CLOCK_PREFIX = ".a2-clock-"  # the file a taker writes next to the lease to read the storage's clock (then removed)
CLAIM_INFIX = ".takeover-"  # lease.json.takeover-<id>[.<n>]: the one taker of the stale lease <id> (`_claim_name`)
CLAIM_GENERATIONS = 4  # claims a take-over walks past (each left, stale, by a taker killed mid-way) before it gives up
_HELD: dict[str, "StudyLease"] = {}  # the leases this process holds now, by the lease file's URI (`held_lease`)
_WARNED_CONDITIONS: set[str | None] = set()  # the endpoints whose ignored conditions this process has said


class LeaseLost(StudyError):
    """The study's lease was taken over: this driver is no longer its writer and stops before its next write."""


def _proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command's name (field 3, the state, first), or [] where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22), or None where unknown: with the
    pid, it tells the holder from a later process that got the same pid."""
    fields = _proc_stat(pid)
    return fields[19] if len(fields) > 19 else None


def _pid_namespace() -> str | None:
    """This process's pid namespace ("pid:[4026531836]"), or None where unknown: containers sharing the host's name
    (Docker's `--network host`, Kubernetes' `hostNetwork`) each number their processes apart."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _on_this_host(holder: dict) -> bool:
    """The holder's pid names a process this one can look up: the same host and pid namespace (a lease of an older
    a2 records no namespace: its host alone), and a pid that is one (a damaged lease's 0 or -1 would ask about this
    process's group, or every process)."""
    pid, namespace = holder.get("pid"), holder.get("pid_ns")
    return (holder.get("host") == socket.gethostname() and type(pid) is int and 0 < pid < 2 ** 31
            and not (namespace and _pid_namespace() and namespace != _pid_namespace()))


def _alive_here(holder: dict) -> bool:
    """The holder ran on this host and its process is still there (the same process: its start time matches)."""
    if not _on_this_host(holder):
        return False
    try:
        os.kill(holder["pid"], 0)  # signal 0: only asks whether the process exists
    except OSError as err:  # PermissionError: alive, another user's
        if isinstance(err, ProcessLookupError):
            return False
    fields = _proc_stat(holder["pid"])
    if fields and fields[0] in ("Z", "X"):  # dead, its exit not yet collected by its parent: `kill -9` cannot end it
        return False
    started, now = holder.get("pid_start"), fields[19] if len(fields) > 19 else None
    return not (started and now and started != now)


def _command_of(pid) -> str:
    """The command line of process `pid` on this host, shortened (empty where unknown)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            text = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())  # one line
    except OSError:
        return ""
    return text if len(text) <= 80 else text[:77] + "..."


def _pid_gone(holder: dict) -> bool:
    """The holder ran on this host and its process is no longer there."""
    return _on_this_host(holder) and not _alive_here(holder)


def _say(line: str) -> None:
    """`line` to stderr, or nowhere: a closed pipe or hung-up terminal must not end the heartbeat thread, whose
    silent end would let the lease of a live driver go stale and be taken over."""
    with contextlib.suppress(Exception):
        print(line, file=sys.stderr, flush=True)


def holder_period(holder: dict, floor: float = 0.0) -> float:
    """Seconds without a heartbeat after which `holder`'s lease is stale: the period it wrote in its lease (leases
    written before it did: `DEFAULT_STALE_AFTER`), or `floor` when longer."""
    try:
        own = float(holder.get("stale_after") or DEFAULT_STALE_AFTER)
    except (TypeError, ValueError):
        own = DEFAULT_STALE_AFTER
    return max(own, float(floor))


def _storage_now(folder) -> float:
    """The storage's clock now (s): the modification time of a file written into `folder` (the study's) and removed
    again; this host's clock where that cannot be done (a read-only copy: a reader only)."""
    probe = folder.join(f"{CLOCK_PREFIX}{uuid.uuid4().hex[:12]}")
    try:
        probe.write_text("")
        stamp = probe.stamp()
    except Exception:  # noqa: BLE001 - storage that cannot be written: this host's clock
        return time.time()
    finally:
        with contextlib.suppress(Exception):
            probe.delete()
    return stamp[1] / 1e9 if stamp else time.time()


def lease_age(location, holder: dict, *, probe: bool = False) -> float:
    """Seconds since the lease at `location` (its file) was last written: its modification time against the
    storage's clock (`probe`: read by writing a file beside it, as a taker does) or this host's (a reader). A lease
    whose time cannot be read: its `heartbeat` field against this host's clock."""
    try:
        stamp = location.stamp()
    except Exception:  # noqa: BLE001 - unreachable: the holder's own word
        stamp = None
    if stamp is None:
        return _heartbeat_age(holder)
    now = _storage_now(open_location(location.uri.rsplit("/", 1)[0], location.endpoint_url)) if probe else time.time()
    return max(0.0, now - stamp[1] / 1e9)


def _heartbeat_age(holder: dict) -> float:
    """The holder's own word: its `heartbeat` field against this host's clock."""
    try:
        beat = float(holder.get("heartbeat", 0) or 0)
    except (TypeError, ValueError):  # a damaged lease: no word at all
        beat = 0.0
    return max(0.0, time.time() - beat)


def _claim_name(holder: dict, seen: str, generation: int) -> str:
    """The name of the claim on the stale lease `seen` (its text; `holder` parsed from it), the same for every taker
    of it: its holder's token (a taker that read it before and one that read it after the holder's last beat claim
    alike), or a digest of its text where it has none fit for a file name (damaged, an older a2's); `generation` > 1:
    the claim after as many left stale by takers killed between claiming and creating the lease."""
    token = holder.get("token")
    if not (isinstance(token, str) and re.fullmatch(r"[0-9A-Za-z_-]{1,64}", token)):
        token = "sha256-" + hashlib.sha256(seen.encode("utf-8", "replace")).hexdigest()[:32]
    return f"{LEASE_FILE}{CLAIM_INFIX}{token}" + (f".{generation}" if generation > 1 else "")


def holder_started(holder: dict) -> float | None:
    """When the lease's holder took it (its `started`, whole seconds since the epoch), or None where it has none."""
    try:
        return float(calendar.timegm(time.strptime(holder["started"], "%Y-%m-%dT%H:%M:%SZ")))
    except (KeyError, TypeError, ValueError):
        return None


def describe(holder: dict, age: float | None = None) -> str:
    age = _heartbeat_age(holder) if age is None else age
    return (f"{holder.get('user', '?')}@{holder.get('host', '?')} pid {holder.get('pid', '?')} since "
            f"{holder.get('started', '?')} (last heartbeat {age:.0f} s ago)")


def live_writer(study) -> dict | None:
    """The holder of the lease of the study at `study` (a Location of its folder) while it is alive: its lease
    rewritten within its own period (`holder_period`) and, on this host, its process still there; else None."""
    location = study.join(LEASE_FILE)
    holder = StudyLease(study).read()
    if holder is None or _pid_gone(holder):
        return None
    if holder.get("pid_start") and _alive_here(holder):  # as `_take_over`: without a start time, the pid may be reused
        return holder
    return holder if lease_age(location, holder) < holder_period(holder) else None


def held_lease(study_uri: str) -> "StudyLease | None":
    """The lease of the study at `study_uri` (its folder's URI) that this process holds, if any."""
    return _HELD.get(study_uri.rstrip("/") + "/" + LEASE_FILE)


class StudyLease:
    """The lease of the study at `study` (a `launch.storage.Location` of the study's folder)."""

    def __init__(self, study, stale_after: float = DEFAULT_STALE_AFTER):
        if not stale_after > 0:
            raise StudyError(f"--stale-after must be a positive number of seconds, got {stale_after!r}")
        self.study = study
        self.location = study.join(LEASE_FILE)
        self.stale_after = float(stale_after)
        self.every = min(30.0, self.stale_after / 4)
        now = time.time()
        self.mine = {"user": getpass.getuser(), "host": socket.gethostname(), "pid": os.getpid(),
                     "pid_start": _process_start(os.getpid()), "pid_ns": _pid_namespace(), "token": uuid.uuid4().hex,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "heartbeat": now,
                     "beats": 0, "every": self.every, "stale_after": self.stale_after}
        self.lost = threading.Event()  # set once this process saw its lease taken over
        self.lost_error: LeaseLost | None = None  # the first `check` that found it so (the line to stop with)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- storage ---------------------------------------------------------------------------------------------
    def _create(self, info: dict, where=None) -> bool:
        """Write the lease (or the file `where`: a take-over's claim) if there is none; False when one exists."""
        try:
            return (where or self.location).write_if_absent(json.dumps(info, indent=2) + "\n")
        except WriteRefused as err:  # one line, before Ray starts
            raise StorageError(f"{err.uri}: cannot write the study's lease ({err.reason}); a study is run, resumed "
                               f"and synced only where its storage can be written") from None

    def read(self) -> dict | None:
        return self._parse(self.location.read_text(errors="replace"))  # damaged bytes: not JSON, not a traceback

    @staticmethod
    def _parse(text: str | None) -> dict | None:
        try:
            holder = json.loads(text) if text else None
        except ValueError:  # cut short by a crash while written: as good as stale
            return {"heartbeat": 0}
        return holder if isinstance(holder, dict) or holder is None else {"heartbeat": 0}

    def _read_settled(self) -> dict | None:
        """`read`, looked at again twice a quarter second apart while it finds no whole lease (none, or one cut short):
        a copy made over the file (truncated, then written) shows it empty for that moment, while a lease taken
        over shows its taker's at once (`_take_over` removes and creates it in two calls, read as the taker's)."""
        holder = self.read()
        for _ in range(2):
            if holder and "token" in holder:
                break
            time.sleep(0.25)
            holder = self.read()
        return holder

    # -- taking, keeping and giving back ---------------------------------------------------------------------
    def acquire(self, force: bool = False) -> None:
        if not self._create(self.mine):
            seen, version = read_versioned(self.location)  # damaged bytes: not JSON, not a traceback
            if seen is not None or not self._create(self.mine):  # None: released between our two looks
                self._take_over(self._parse(seen) or {}, force, seen, version)
        endpoint = resolve_endpoint_url(self.location.endpoint_url)
        if self.location.conditions_ignored() and endpoint not in _WARNED_CONDITIONS:
            _WARNED_CONDITIONS.add(endpoint)
            _say(f"warning: the S3 endpoint of {os.path.dirname(self.location.uri)} "
                 f"({endpoint or 'AWS'}) wrote over an object that a "
                 f"conditional PUT said not to (If-None-Match / If-Match): it ignores those conditions, so the "
                 f"study's lease cannot keep a second driver out there; run one driver per study yourself")
        # held now, however it was taken: the claims of takers killed mid-way go (one killed after it removed the
        # lease it claimed, before it made its own, left a claim nothing would read again)
        self._remove_claims()
        self.lost.clear()
        self.lost_error = None
        _HELD[self.location.uri] = self
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="a2-lease", daemon=True)
        self._thread.start()

    def _take_over(self, holder: dict, force: bool, seen: str | None, version: str | None) -> None:
        """Replace a lease whose process is gone from this host, or a stale one with `force`; refuse the rest, and
        always one whose process is alive on this host. `seen`: the lease's text as read (`version`: its version,
        `read_versioned`), `holder` parsed from it."""
        age = lease_age(self.location, holder, probe=True)
        period = holder_period(holder, self.stale_after)
        study = os.path.dirname(self.location.uri)
        pid = holder.get("pid", "?")
        # surely the holder itself: its lease records its process's start time, and the process with its pid started
        # then (a lease of an older a2 records none: its pid may be another process's by now)
        if holder.get("pid_start") and _alive_here(holder) and age >= period:
            command = _command_of(pid)
            raise StudyError(f"study at {study} is held by {describe(holder, age)}, a process still alive on this "
                             f"host{f' ({command})' if command else ''}, stopped or hung: its heartbeat stopped; one "
                             f"writer per study, so not even --force takes it over: end that process first "
                             f"(`kill -9 {pid}`), then resume")
        gone = _pid_gone(holder)
        if not gone and age < period:
            now, now_version = read_versioned(self.location)
            if now is not None and now_version != version:  # written since it was read (a taker, a beat): the age
                holder = self._parse(now) or holder  # is of that lease, so is who is named
            raise StudyError(f"study at {study} is being written by {describe(holder, age)}; one writer per study: "
                             f"wait for it to end (`--force` takes over only a lease with no heartbeat for "
                             f"{period:.0f} s, the holder's own period)")
        if not force and not gone:
            raise StudyError(f"study at {study} has a stale lease of {describe(holder, age)}; if that process is "
                             f"gone, take the study over with --force")
        why = "its process is gone from this host" if gone else "--force"
        print(f"a2 study: WARNING: taking over the stale lease of {describe(holder, age)} on {study} ({why})",
              file=sys.stderr, flush=True)
        if seen is None:  # gone again since it was judged: no lease of anyone's to remove
            if not self._create(self.mine):
                self._taken_first(study)
            return
        claim = self._claim(holder, seen, period, study)
        try:
            # removed only if still the version judged stale, in one step of the storage: a taker that judged the
            # same lease and finished already (its claim removed, so ours was created) left its own lease here, a
            # holder that beat again is not stale, and either may have happened while this process was frozen
            if not delete_if_unchanged(self.location, version):
                self._taken_first(study)
            if not self._create(self.mine):  # a plain `acquire` found none between the two calls
                self._taken_first(study)
        finally:
            with contextlib.suppress(Exception):  # one left behind is walked past once stale (`_claim`)
                claim.delete()

    def _taken_first(self, study: str, holder: dict | None = None) -> NoReturn:
        """The one-line error of a take-over that another process made first; `holder`: who (else the lease's)."""
        raise StudyError(f"study at {study}: another process took the lease first: "
                         f"{describe(holder or self.read() or {})}")

    def _claim(self, holder: dict, seen: str, period: float, study: str):
        """The claim on the stale lease `seen`, created by this taker (its Location); else the one-line error of a
        take-over another process made first. A claim older than the holder's `period` was left by a taker killed
        before it created its lease, as is a younger one whose taker's process is gone from this host: the next
        generation's is claimed instead (created if absent too, so that of takers finding the same one stale one
        wins; none is removed, which would race with its re-creation)."""
        now = claimer = None
        for generation in range(1, CLAIM_GENERATIONS + 1):
            claim = self.study.join(_claim_name(holder, seen, generation))
            if self._create(self.mine, claim):
                return claim
            stamp = claim.stamp()
            if stamp is None:  # removed since: its taker finished; ours now, then the lease reads as not `seen`
                if self._create(self.mine, claim):
                    return claim
                stamp = claim.stamp()
            now = _storage_now(self.study) if now is None else now
            # its taker is at it now, unless that taker's process is gone from this host (killed between its claim
            # and its lease): walked past at once, as its lease would be, not after `period`
            if stamp is not None and now - stamp[1] / 1e9 < period:
                claimer = self._claimer(claim)
                if not (claimer and _pid_gone(claimer)):
                    break
                claimer = None
        self._taken_first(study, claimer or self._claimer(claim))

    def _claimer(self, claim) -> dict | None:
        """The taker as its claim names it (who replaces the lease), or None where it cannot be read."""
        try:
            return self._parse(claim.read_text(errors="replace"))
        except Exception:  # noqa: BLE001 - removed since, or out of reach
            return None

    def _remove_claims(self) -> None:
        """Remove every claim beside the lease now that this process holds it: its own, and those of takers killed
        mid-way; one of a taker at it now is removed harmlessly: that taker reads the lease as this one's, not the
        one it judged, and gives up."""
        with contextlib.suppress(Exception):  # a claim left behind is a small file, walked past once stale
            for name in self.study.file_stamps():
                if name.startswith(LEASE_FILE + CLAIM_INFIX):
                    self.study.join(name).delete()

    def check(self, before: str = "writing") -> None:
        """LeaseLost (one line) unless this process still holds the study's lease: a driver calls it before each
        write of the study's record, results, exports and summary, so that one whose lease was taken over stops
        before writing anything more."""
        if self.lost_error is not None:
            raise self.lost_error
        if self.lost.is_set():
            self.lost_error = self._lost_error(None, before)
            raise self.lost_error
        try:
            holder = self._read_settled()
        except Exception:  # noqa: BLE001 - storage out of reach: the write itself says so
            return
        if not holder or holder.get("token") != self.mine["token"]:
            self.lost.set()
            self.lost_error = self._lost_error(holder, before)
            raise self.lost_error

    def holds(self, before: str = "writing") -> bool:
        """Whether this process still holds the study's lease (`check` without raising)."""
        try:
            self.check(before)
        except LeaseLost:
            return False
        return True

    def _lost_error(self, holder: dict | None, before: str) -> LeaseLost:
        if holder is None:
            with contextlib.suppress(Exception):
                holder = self.read()
        who = describe(holder) if holder else "nobody (the lease was removed)"
        return LeaseLost(f"study at {os.path.dirname(self.location.uri)}: its lease was taken over by {who}; this "
                         f"driver stopped before {before}, writing nothing more (one writer per study: the one that "
                         f"took it over continues it)")

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            try:
                holder = self._read_settled()
                if holder and holder.get("token") == self.mine["token"]:
                    self.mine["heartbeat"] = time.time()
                    self.mine["beats"] += 1
                    holder = self._rewrite(json.dumps(self.mine, indent=2) + "\n")
                if self._stop.is_set():  # released meanwhile: the lease is gone or another's, none of this one's
                    return
                if not holder or holder.get("token") != self.mine["token"]:
                    self.lost.set()
                    _say(f"a2 study: WARNING: the lease on {self.location.uri} was taken over by "
                         f"{describe(holder or {})}; this process is no longer the study's one writer and stops "
                         f"before its next write")
                    return
            except Exception as err:  # noqa: BLE001 - storage trouble: try again at the next beat
                _say(f"a2 study: note: lease heartbeat failed: {err}")

    def _rewrite(self, text: str) -> dict | None:
        """Write the heartbeat `text` over the lease only while it is still this holder's and not released; the
        lease found there (`self.mine` once written): a beat must neither recreate a lease that `release` removed
        (it waits for this thread 5 s at most) nor overwrite a new holder's."""
        if self._stop.is_set():
            return None
        seen, version = read_versioned(self.location)
        found = self._parse(seen)
        if not found or found.get("token") not in (None, self.mine["token"]) or self._stop.is_set():
            return found
        # written only over the version just read (a reader never sees half): a lease taken over or released while
        # this thread was frozen between the two is left as it is, and whose it is now decides
        if replace_if_unchanged(self.location, version, text) is None:
            return self.read()
        return self.mine

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        if _HELD.get(self.location.uri) is self:
            del _HELD[self.location.uri]
        with contextlib.suppress(Exception):  # a lease left behind only goes stale
            seen, version = read_versioned(self.location)
            holder = self._parse(seen)
            if holder and holder.get("token") == self.mine["token"]:
                delete_if_unchanged(self.location, version)  # not one written by a taker since it was read

    @contextlib.contextmanager
    def held(self, force: bool = False):
        self.acquire(force)
        try:
            yield self
        finally:
            self.release()
