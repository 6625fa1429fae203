"""A driver killed anywhere: the kill windows of a tiny study (2 trials of 2 epochs, one one-worker trial at a time,
on a local Ray) are found by watching it run, not chosen by reading the code.

`scripts/observe_writes.py` records every file the driver, Tune and a trial create, rename or delete in the study's
folder (a C library loaded with LD_PRELOAD into each of the study's processes, `tests/faults/fswrites.c`), reduces
them to the writes that change the study's state and keeps them, one kill window before each, in
`tests/faults/kill_windows.txt`:

1. `test_the_observed_writes_are_the_checked_in_kill_windows`: one run's writes are those windows, no more, no
   fewer. A new write fails it until the script is run again, which makes it a new window of the sweep below.
2. `test_a_study_killed_in_every_window_finishes_every_planned_trial_once`: one study, its driver SIGKILLed right
   before each window's write in turn (the same library fires the kill, in the process that makes the write, before
   the call: hit exactly), each time continued as an operator would: `a2 study resume`, or, where the kill left
   nothing to continue (before `study.yaml`), `resume` saying so in one line and `a2 study run` starting the study
   again in place. Meanwhile a trial's worker kills itself right before each of its own writes, once each (Tune
   retries it). Two more kills are at code points (`launch.killpoints`), for what is not a file of the study: the
   last MLflow export (`export-final`) and the moment before the lease is given back (`study-end`); and one more at
   the second trial's last checkpoint (a trial Tune may not have saved yet: its configuration continues it).

Then every command exited 0 or died of its kill, none printed a traceback, every planned trial finished once with
its epochs and its test scores, and MLflow holds every (run, key, step) once.

The sweep is grouped for time: each kill's `resume` is itself killed at the next window, so the study advances
from window to window in one chain of drivers (one local Ray start each), and the workers' windows ride along. A
resume that finishes the study without meeting its window (a write the resumed study does not make again) leaves
that window to a new study, whose chain goes on from there; every study of the sweep is checked at the end. A
worker killed on purpose makes Tune log the trial's failure: its one line reaches the terminal, its traceback only
the study's `driver.log` (`launch.runlog`).
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.raycluster import (  # noqa: F401 - tiny_data is a fixture
    a2, kill_group, mlflow_client, mlflow_history, mlflow_trials, start_a2, tail, tiny_data, tiny_study, trial_runs)
from tests.killwindows import marker, observe, shim  # noqa: F401 - shim is a fixture
from tests.test_interruptions import duplicated_points, local_env, statuses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.ray_beside]
NAME = observe.STUDY
EPOCHS = 2
CODE_POINTS = ("export-final", "study-end")  # `launch.killpoints`' points outside the study's files


def _study(tmp_path: Path, data: Path, fusions=("none", "max"), epochs=EPOCHS, **extra) -> Path:
    return tiny_study(tmp_path, NAME, data, fusions=fusions, epochs=epochs, workers=1, cpus_per_worker=1,
                      max_concurrent=1, **extra)


def test_the_observed_writes_are_the_checked_in_kill_windows(tmp_path, tiny_data, shim):
    started = time.monotonic()
    study, log = _study(tmp_path, tiny_data), tmp_path / "writes.log"
    env = observe.shim_env(local_env(tmp_path), shim, tmp_path / "studies" / NAME, log=log)
    done = a2("study", "run", str(study), cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    writes = observe.read_log(log)
    assert {w.writer for w in writes} == {"driver", "trial"}, sorted({w.writer for w in writes})
    observed, kept = observe.kill_windows(writes), observe.read_windows()
    assert set(observed) == set(kept), (
        f"the study's writes are not the kill windows of {observe.WINDOWS_FILE.name}: new "
        f"{[w.line() for w in observed if w not in kept]}, gone {[w.line() for w in kept if w not in observed]}; "
        f"run `flock /tmp/a2-ray.lock python scripts/observe_writes.py` and check what the sweep finds")
    print(f"observed {len(writes)} writes, {len(observed)} windows: {time.monotonic() - started:.0f} s")


def _steps(windows: list) -> list[tuple[str, str]]:
    """The chain's kills in the order a study meets them: ("window", entry) or ("code", point)."""
    steps = [("window", f"driver {w.op} {w.pattern}") for w in windows]
    at = next(i for i, (_, entry) in enumerate(steps) if entry.startswith("driver") and "outage.json" in entry)
    steps.insert(at, ("code", "export-final"))  # the last export runs before the study's summary is made
    at = next(i for i, (_, entry) in enumerate(steps) if "delete lease.json" in entry)
    steps.insert(at, ("code", "study-end"))
    # again at the second trial's last checkpoint, after the first trial's windows (its checkpoints all made)
    last_trial = max(i for i, (_, entry) in enumerate(steps) if entry.startswith("driver") and " trials/" in entry
                     or "a2_local_trial_" in entry)
    again = next(entry for _, entry in steps if "checkpoint_epoch" in entry and entry.startswith("driver")
                 and entry.endswith(f"{EPOCHS:04d}"))
    steps.insert(last_trial + 1, ("window", again + "@1"))
    return steps


class _Segment:
    """One study of the sweep's chain, in its own folder, storage and MLflow store. A chain goes on in the same study
    while each window comes again; when a resume finishes the study without reaching its window (a write the study
    no longer makes, having made it already), the window is killed in a new study of its own: of one trial where only
    the study's end is left to kill (the lease given back: the same writes, sooner; its epochs are the chain's, for a
    worker window only a second epoch reaches)."""

    def __init__(self, tmp_path: Path, n: int, data: Path, max_failures: int, *, end_only: bool = False):
        self.directory = tmp_path / f"study{n}"
        self.directory.mkdir()
        self.fusions, self.epochs = ("none",) if end_only else ("none", "max"), EPOCHS
        self.file = _study(self.directory, data, self.fusions, self.epochs, max_failures=max_failures)
        self.storage, self.folder = self.directory / "studies", self.directory / "studies" / NAME
        self.uri = f"sqlite:///{self.directory / 'mlflow.db'}"

    def command(self, verb: str) -> tuple[str, ...]:
        if verb == "run":
            return "study", "run", str(self.file)
        return "study", "resume", NAME, "--storage", str(self.storage)


def test_a_study_killed_in_every_window_finishes_every_planned_trial_once(tmp_path, tiny_data, shim):
    started = time.monotonic()
    windows = observe.read_windows()
    workers = [f"self {w.op} {w.pattern}" for w in windows if w.writer == "trial"]
    failures = len(workers) + 2  # every worker kill is one more try of its trial
    base, fired, writes = local_env(tmp_path), tmp_path / "fired", tmp_path / "writes.log"
    fired.mkdir()
    segments = [_Segment(tmp_path, 0, tiny_data, failures)]
    outputs: dict[str, str] = {}
    timings, wording = [], []  # wording: what a command should have said (asserted last: the state comes first)

    steps = _steps(windows)
    end = 1 + next(i for i, (_, entry) in enumerate(steps) if "record-digest.json" in entry)  # the lease's windows
    for n, (kind, entry) in enumerate(steps):
        step_started = time.monotonic()
        for attempt in (0, 1):  # 1: in a new study, the chain's having finished without reaching the window
            seg = segments[-1]
            leftover = seg.folder.is_dir() and any(seg.folder.iterdir())
            verb = "resume" if (seg.folder / "study.yaml").exists() else "run"
            if verb == "run" and leftover:  # nothing to continue: resume says so in one line, run starts it again
                refused = a2(*seg.command("resume"), cwd=seg.directory, env=base, timeout=120)
                outputs[f"{n} resume"] = refused.stdout
                assert refused.returncode == 2 and len(refused.stdout.strip().splitlines()) == 1, \
                    (entry, refused.stdout[-3000:])
                if "a2 study run" not in refused.stdout:
                    wording.append((entry, "resume does not point at `a2 study run`", refused.stdout.strip()))
            arms = workers if kind == "code" else [entry, *workers]  # the step's driver window first: it wins a tie
            marker(fired, entry).unlink(missing_ok=True)  # an entry armed again (the second trial's checkpoint)
            env = observe.shim_env(base, shim, seg.folder, log=writes, kill=arms, fired=fired)
            if kind == "code":
                env["A2_KILL_AT"] = entry
            log = tmp_path / f"step{n:02d}-{attempt}.log"
            proc = start_a2(*seg.command(verb), cwd=seg.directory, log=log, env=env)
            try:
                rc = proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                rc = None  # never reached its window: said below with the log
            finally:
                kill_group(proc)  # the killed driver's local Ray, and a worker waiting where it killed the driver
            out = log.read_text(errors="replace")
            outputs[f"{n} {verb} {entry}"] = out
            if verb == "run" and leftover and f"study {NAME}: starting again in place" not in out:
                wording.append((entry, "run does not say it starts the study again in place", tail(log, 5)))
            if rc == 0 and attempt == 0:  # finished: every planned trial done, the window not met again
                segments.append(_Segment(tmp_path, len(segments), tiny_data, failures, end_only=n >= end))
                continue
            break
        assert rc == -signal.SIGKILL, (n, verb, entry, rc, sorted(p.name for p in fired.iterdir()), tail(log, 80))
        if kind == "code":
            assert f"a2 kill point {entry}: SIGKILL" in out, (entry, tail(log, 80))
        else:
            assert marker(fired, entry).exists(), (entry, "killed elsewhere", tail(log, 80))
        timings.append(f"{entry}: {verb}{' in a new study' if attempt else ''} {time.monotonic() - step_started:.0f} s")

    for seg in segments:
        if not (seg.folder / "study.yaml").exists():
            continue
        last = a2(*seg.command("resume"), cwd=seg.directory, env=base, timeout=300)
        outputs[f"{seg.directory.name}: last resume"] = last.stdout
        assert last.returncode == 0, last.stdout[-4000:]
        assert "planned trials finished already; nothing to resume" in last.stdout or seg is segments[-1], \
            last.stdout[-3000:]  # a study the chain left finished says so
        _finished_every_planned_trial_once(seg)
    again = a2(*segments[-1].command("resume"), cwd=segments[-1].directory, env=base, timeout=120)
    assert again.returncode == 0 and "planned trials finished already; nothing to resume" in again.stdout, \
        again.stdout[-3000:]
    for what, out in outputs.items():
        assert "Traceback" not in out, (what, out[-4000:])
    # a2's files at the study's root are replaced whole (temp file, rename) or, the lease, created once: never opened
    # over in place, as Tune's restore-and-upload did to every .json there (the lease read empty by its holder)
    copied_over = sorted({(w.op, w.path) for w in observe.read_log(writes) if w.op == "write" and "/" not in w.path
                          and w.path.endswith(".json") and not w.path.startswith(".") and w.path != "lease.json"
                          and not w.path.startswith(("experiment_state-", "search_gen_state-"))})
    assert copied_over == [], copied_over
    assert wording == [], wording
    unfired = [w for w in workers if not marker(fired, w).exists()]
    assert unfired == [], f"a trial's worker never reached these windows: {unfired}"
    print("\n".join(timings))
    print(f"kill-anywhere sweep: {len(timings)} kills in {len(segments)} studies, {len(workers)} worker kills, "
          f"{time.monotonic() - started:.0f} s")


def _finished_every_planned_trial_once(seg: _Segment) -> None:
    """Every planned trial finished once, with its epochs and test scores; MLflow holds each (run, key, step) once."""
    summary = json.loads((seg.folder / "summary.json").read_text())
    epochs = list(range(1, seg.epochs + 1))
    assert summary["complete"] and summary["trials_finished"] == len(seg.fusions), seg.directory
    trials = {t["trial_id"]: t for t in summary["trials"]}
    assert sorted(t["fusion"] for t in trials.values()) == sorted(seg.fusions)
    for trial in trials.values():
        assert trial["state"] == "TERMINATED" and trial["epochs_reported"] == epochs, trial
        assert trial["test"] is not None, trial
    # a trial folder outside the record is one a killed driver lost: continued (superseded.json), or an older lost
    # folder of a configuration whose newest lost folder was continued (`launch.trainable.adopt` takes the newest)
    runs_on_disk = trial_runs(seg.storage, NAME)
    continued = {tid for tid, run in runs_on_disk.items() if (run / "superseded.json").exists()}
    config = {tid: json.loads((run / "trial.json").read_text())["config"] for tid, run in runs_on_disk.items()
              if (run / "trial.json").exists()}
    for tid in set(runs_on_disk) - set(trials) - continued:
        assert any(config.get(c) == config.get(tid) for c in continued), (tid, sorted(continued), sorted(trials))
    assert set(trials) <= set(runs_on_disk), (sorted(runs_on_disk), sorted(trials))

    assert duplicated_points(seg.uri, NAME) == []
    parent, runs = statuses(seg.uri, NAME)
    assert parent == "FINISHED", (parent, runs)
    for trial_id, (status, reason) in runs.items():
        if trial_id in trials:
            assert status == "FINISHED", (trial_id, status, reason)
        else:  # a trial a killed driver lost: ended, saying which trial continued it
            assert status == "KILLED" and reason.startswith("superseded"), (trial_id, status, reason)
    client = mlflow_client(seg.uri)
    for trial_id in trials:
        run_id = mlflow_trials(seg.uri, NAME)[trial_id].info.run_id
        assert [step for step, _, _ in sorted(mlflow_history(seg.uri, run_id))] == epochs
        assert [m.step for m in client.get_metric_history(run_id, "test/CIDEr")] == [seg.epochs]
