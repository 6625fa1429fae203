"""The MLflow export's lag during a study (issue #38): how long an export tick takes at N trials, and how long an
epoch's result takes from its result log to MLflow, when the export reads every trial at every tick ("before") and
when it reads only the trials that can have changed ("after", `launch.mlflow_export.Export._settled`).

    python benchmarks/bench_export.py                          # N = 75 and 1000, ~10 minutes on 2 cores
    python benchmarks/bench_export.py --trials 75 --window 20 --latency-ms 20
    python benchmarks/bench_export.py --before-commit 4c8cfc8  # "before" is that commit's export code

No Ray. A real MLflow tracking server (`a2 mlflow serve`, SQLite backend, local artifacts; `tests/mlflowserver.py`)
and a study folder on local disk written as `launch.trainable` writes it: every trial's `results.json` (the whole log
rewritten each epoch), a checkpoint folder per epoch (`checkpoint_epochNNNN/checkpoint.pt`), artifacts (an epoch's
samples, the best epoch's per-image scores). Of the N trials in Tune's list, 16 run, the others were stopped by the
scheduler after 2 epochs (their stop records written). Set-up, timed apart: the ended trials' runs are made by the
export itself, in-process on the SQLite store before the server starts on it (over HTTP on two shared cores a request
takes ~0.07 s, ten a trial: 1,000 trials would take the whole budget), and the export starts from what that export
remembers, as the driver's does when those trials ended; a warm-up export over HTTP makes the running trials' runs.
A writer thread appends epochs to the running trials and pokes the exporter, as the driver's Tune callback does on a
trial's result; the driver's `StudyExporter` thread exports (every 2 s, and when poked).

Cadences (per running trial): "paper" is the paper's cadence scaled to what a window can show: an epoch every 2,400 s
on the cluster gives the 16 running trials one epoch every 150 s between them, far apart beside a 2 s export period;
here the epochs come one at a time, 3 s apart (still isolated: the lag is the export tick, whatever the spacing).
"100x" is an epoch every 24 s per running trial; "1000x" every 2.4 s, and "3000x" every 0.8 s, to find where the
export falls behind. `--latency-ms` adds that much to each storage request under the study's trials (a stand-in
for S3's per-request latency; the storage here is local disk, read one trial after another as on a local folder).

Printed: per (N, cadence, before/after) the tick's duration (median, p95), the lag from an epoch's result being
written to its metrics being in MLflow (median, p95, max), and the epochs not yet exported when the window closed;
and where the exporter's busy time went: storage reads (`launch.record.record_trials`; not timed for
`--before-commit`, which reads inline), finding the trial's run (`StudyTracker.trial_run`: a run search), metrics,
tags, artifacts, ending runs.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mlflow.tracking import MlflowClient  # noqa: E402

import launch.mlflow_export as mlflow_export  # noqa: E402

from launch.conclusions import tune_trial  # noqa: E402
from launch.layout import (ARTIFACTS_DIR, CHECKPOINT_FILE, RESULTS_FILE, STOPPED_FILE, TRIALS_DIR,  # noqa: E402
                           checkpoint_name, train_run_name)
from launch.location import StudyLocation  # noqa: E402
from launch.mlflow_export import Export, StudyExporter  # noqa: E402
from launch.spec import load_study  # noqa: E402
from launch.storage import Location  # noqa: E402
from tests.mlflowserver import free_port, start_server, stop_server  # noqa: E402

RUNNING = 16  # trials running at a time (the paper's cluster: 16 trials of 4 GPUs)
EVERY = 2.0  # s between the driver's exports (`launch.mlflow_callback.A2MLflowCallback`)
PLANNED = 200  # epochs a trial plans (more than any window adds: a running trial never finishes here)
# cadence name -> s between epochs of one running trial, or None: one epoch at a time across the study
# (ISOLATED_GAP s apart)
CADENCES = {"paper": None, "100x": 24.0, "1000x": 2.4, "3000x": 0.8}
ISOLATED_GAP = 3.0


class FakeTrial:
    """What the export reads of a Tune trial (`launch.conclusions.tune_trial`)."""

    def __init__(self, trial_id: str, config: dict, status: str):
        self.trial_id, self.config, self.status, self.num_failures = trial_id, config, status, 0
        self.last_result: dict = {}

    def __str__(self):
        return f"a2_trial_{self.trial_id}"

    def get_error(self):
        return None


class StudyFolder:
    """The study's storage as trials write it, one lock for the writer's bookkeeping."""

    def __init__(self, spec, location: StudyLocation):
        self.spec, self.location = spec, location
        self.logs: dict[str, list[dict]] = {}
        self.best: dict[str, float] = {}

    def run(self, trial_id: str) -> Location:
        return self.location.at(TRIALS_DIR, train_run_name(self.spec.name, trial_id))

    def epoch(self, trial_id: str, epoch: int, value: float, artifacts: bool = True) -> None:
        """One epoch as `launch.trainable` leaves it: the checkpoint folder, the artifacts, then the result log."""
        run = self.run(trial_id)
        run.join(checkpoint_name(epoch), CHECKPOINT_FILE).write_text(f"weights of epoch {epoch}")
        if artifacts:
            run.join(ARTIFACTS_DIR, f"samples/epoch_{epoch:03d}.txt").write_text(f"{epoch}: a dog on a red mat\n")
            if value >= self.best.get(trial_id, float("-inf")):
                self.best[trial_id] = value
                scores = {str(i): round(value + (i % 7) - 3, 3) for i in range(500)}
                run.join(ARTIFACTS_DIR, "eval/per_image_cider.json").write_text(json.dumps(scores, sort_keys=True))
        log = self.logs.setdefault(trial_id, [])
        log.append({"epoch": epoch, "val/CIDEr": value, "val/BLEU-4": value / 3, "train/loss": 30.0 / (epoch + 9),
                    "stage": "xe", "timestamp": time.time(), "training_iteration": epoch,
                    "compute/wall_s": 60.0 * epoch, "checkpoint_path": run.join(checkpoint_name(epoch)).uri})
        run.join(RESULTS_FILE).write_text(json.dumps(log, indent=1))


def overrides(root: Path, n: int) -> list[str]:
    return [f"name=bench-export-{n}", f"storage={root / 'st'}", f"train.xe_epochs={PLANNED}",
            f"data.root={root / 'data'}"]


def make_study(root: Path, n: int, uri: str) -> tuple[object, StudyFolder, list[FakeTrial]]:
    spec = load_study(ROOT / "studies" / "smoke.yaml", [*overrides(root, n), f"tracking.mlflow_uri={uri}"],
                      check_files=False)
    folder = StudyFolder(spec, StudyLocation(spec.name, spec.storage))
    rng = random.Random(n)
    trials = []
    for i in range(n):
        seed, gate = i % 4, (i // 4) % 2 == 1
        config = {"fusion": "gate", "lambda": round(0.005 * 1.01 ** (i // 8), 6), "seed": seed} if gate else \
            {"fusion": "none", "seed": seed}
        running = i >= n - RUNNING
        trial = FakeTrial(f"{i:05d}", config, "RUNNING" if running else "TERMINATED")
        for epoch in (1, 2):
            folder.epoch(trial.trial_id, epoch, 80.0 + epoch + rng.gauss(0, 2), artifacts=running)
        if not running:  # the scheduler stopped it at its rung (ASHA): its record, as the driver's callback writes it
            folder.run(trial.trial_id).join(STOPPED_FILE).write_text(json.dumps({"rung": 2, "cutoff": 85.0}))
        trials.append(trial)
    return spec, folder, trials


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def slow_storage(latency_s: float) -> None:
    """Every read of a trial's folder costs `latency_s` more (S3's latency per request, on local disk)."""
    if latency_s <= 0:
        return
    for name in ("read_text", "listdir", "exists"):
        method = getattr(Location, name)

        def slow(self, *args, _method=method, **kwargs):
            if f"/{TRIALS_DIR}/" in self.uri:
                time.sleep(latency_s)
            return _method(self, *args, **kwargs)

        setattr(Location, name, slow)


def old_export(commit: str):
    """`Export` of `launch/mlflow_export.py` at `commit` (the code before this change), loaded under another name."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:launch/mlflow_export.py"], check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("a2_export_before")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{commit}:launch/mlflow_export.py", "exec"), module.__dict__)
    return module.Export


class Measured:
    """An exporter thread with its ticks timed and each (trial, epoch)'s arrival in MLflow stamped."""

    def __init__(self, export, trials: list[FakeTrial]):
        self.export, self.trials = export, trials
        self.ticks: list[float] = []
        self.logged: dict[tuple[str, int], float] = {}
        tracker = export.open()
        real_batch = tracker._log_batch

        def log_batch(run_id, kind, items):
            real_batch(run_id, kind, items)
            if kind == "metrics" and items:
                trial = self.run_trials.get(run_id) or self._trial_of(run_id)
                self.logged.setdefault((trial, int(items[0][3])), time.monotonic())

        tracker._log_batch = log_batch
        self.run_trials: dict[str, str] = {}
        self.exporter = StudyExporter(export, lambda: self.trials, every=EVERY)
        real_once = self.exporter.once

        def once(ended=None):
            start = time.monotonic()
            try:
                return real_once(ended)
            finally:
                self.ticks.append(time.monotonic() - start)

        self.exporter.once = once
        # where a tick's time goes (seconds, summed over the window)
        self.spent: Counter = Counter()
        for owner, name, label in ((tracker, "trial_run", "find run"), (tracker, "log_epochs", "metrics"),
                                   (tracker, "set_tags", "tags"), (tracker, "end_trial", "end"),
                                   (export, "_artifacts", "artifacts")):
            setattr(owner, name, self._timed(getattr(owner, name), label))
        if not hasattr(mlflow_export, "_bench_real_record_trials"):
            mlflow_export._bench_real_record_trials = mlflow_export.record_trials
        mlflow_export.record_trials = self._timed(mlflow_export._bench_real_record_trials, "storage reads")

    def _timed(self, method, label: str):
        def timed(*args, **kwargs):
            start = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent[label] += time.monotonic() - start
        return timed

    def _trial_of(self, run_id: str) -> str:
        self.run_trials = {run: trial for trial, run in self.export.tracker.trial_runs.items()}
        return self.run_trials.get(run_id, "?")

    def close(self) -> None:
        self.exporter.stop.set()
        self.exporter.wake.set()
        self.exporter.thread.join(600)


def window(measured: Measured, folder: StudyFolder, running: list[FakeTrial], cadence: float | None,
           seconds: float, rng: random.Random) -> dict:
    """Epochs written for `seconds` at `cadence`; then until every one is in MLflow (60 s at most)."""
    written: dict[tuple[str, int], float] = {}
    next_epoch = {t.trial_id: len(folder.logs[t.trial_id]) + 1 for t in running}
    ticks_before = len(measured.ticks)
    measured.spent.clear()
    start = time.monotonic()
    if cadence is None:  # one epoch at a time, across the study
        due = [(start + ISOLATED_GAP * (k + 0.5), running[k % len(running)]) for k in range(int(seconds / ISOLATED_GAP))]
    else:  # each running trial on its own clock, staggered
        due = sorted(((start + cadence * (rng.random() + k), t) for t in running
                      for k in range(int(seconds / cadence) + 1)), key=lambda item: item[0])
        due = [(when, t) for when, t in due if when < start + seconds]
    for when, trial in due:
        time.sleep(max(0.0, when - time.monotonic()))
        epoch = next_epoch[trial.trial_id]
        next_epoch[trial.trial_id] += 1
        folder.epoch(trial.trial_id, epoch, 80.0 + epoch * 0.1 + rng.gauss(0, 1))
        written[(trial.trial_id, epoch)] = time.monotonic()
        measured.exporter.poke()  # the driver's on_trial_result
    time.sleep(max(0.0, start + seconds - time.monotonic()))
    drain = time.monotonic() + 60
    while time.monotonic() < drain and any(key not in measured.logged for key in written):
        time.sleep(0.1)
    lags = [measured.logged[key] - at for key, at in written.items() if key in measured.logged]
    ticks = measured.ticks[ticks_before:]
    return {"epochs": len(written), "missing": sum(key not in measured.logged for key in written),
            "ticks": len(ticks), "tick_median": statistics.median(ticks) if ticks else float("nan"),
            "tick_p95": percentile(ticks, 0.95) if ticks else float("nan"),
            "lag_median": statistics.median(lags) if lags else float("nan"),
            "lag_p95": percentile(lags, 0.95) if lags else float("nan"), "lag_max": max(lags, default=float("nan")),
            "spent": dict(measured.spent), "busy": sum(ticks)}


def bench(n: int, args, root: Path) -> list[tuple]:
    """Set-up (the ended trials' runs made in the SQLite store in-process, by the export itself: over HTTP on two
    shared cores that takes ~0.07 s a request, ten requests a trial), then the server on that store and each mode's
    windows."""
    root = root / f"n{n}"
    # set-up's store on tmpfs where there is one (SQLite commits a write at a time: ~5 ms each on this disk), then
    # moved next to the study, where the server keeps it
    fast = Path(tempfile.mkdtemp(prefix="a2-bench-export-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    backend = f"sqlite:///{fast / 'mlflow.db'}"
    spec, folder, trials = make_study(root, n, backend)
    ended, running = trials[:-RUNNING], trials[-RUNNING:]
    experiment = MlflowClient(backend).create_experiment(spec.name, artifact_location=f"mlflow-artifacts:/{spec.name}")
    exports = {"after": Export(spec, folder.location)}
    if args.before_commit:
        exports["before"] = old_export(args.before_commit)(spec, folder.location)
    for mode, export in exports.items():
        start = time.monotonic()
        export.run([tune_trial(t) for t in ended])  # as the driver's export left them when they ended
        print(f"N={n}: set-up, {len(ended)} ended trials exported in-process ({mode} code) in "
              f"{time.monotonic() - start:.1f} s", flush=True)
    shutil.move(fast / "mlflow.db", root / "mlflow.db")
    shutil.rmtree(fast, ignore_errors=True)
    proc, uri = start_server(f"sqlite:///{root / 'mlflow.db'}", str(root / "mlartifacts"), free_port(),
                             log_path=str(root / "server.log"), timeout=120)
    rows = []
    try:
        served = load_study(ROOT / "studies" / "smoke.yaml", [*overrides(root, n), f"tracking.mlflow_uri={uri}"],
                            check_files=False)
        for mode in ("after", "before"):
            export = type(exports.get(mode, exports["after"]))(served, folder.location)
            export.exported = dict(exports.get(mode, exports["after"]).exported)  # what it remembers of them
            export.reread = mode == "before" and not args.before_commit
            start = time.monotonic()
            for trial in running:  # warm-up: the running trials' runs made or found, their steps read once
                folder.epoch(trial.trial_id, len(folder.logs[trial.trial_id]) + 1, 80.0)
            export.run([tune_trial(t) for t in trials])
            print(f"N={n} {mode}: warm-up export over HTTP {time.monotonic() - start:.1f} s (experiment "
                  f"{experiment})", flush=True)
            measured = Measured(export, trials)
            rng = random.Random(n)
            for name in args.cadences:
                result = window(measured, folder, running, CADENCES[name], args.window, rng)
                rows.append((n, name, mode, result))
                print(f"  {name:>6} {mode:>6}: {result['ticks']} ticks, tick median {result['tick_median']:.2f} s "
                      f"p95 {result['tick_p95']:.2f} s; {result['epochs']} epochs, lag median "
                      f"{result['lag_median']:.2f} s p95 {result['lag_p95']:.2f} s max {result['lag_max']:.2f} s, "
                      f"{result['missing']} unexported", flush=True)
                print("           exporting busy {:.1f} s: {}".format(result["busy"], ", ".join(
                    f"{label} {seconds:.1f} s" for label, seconds in sorted(result["spent"].items()))), flush=True)
            measured.close()
    finally:
        stop_server(proc)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, nargs="+", default=[75, 1000])
    parser.add_argument("--cadences", nargs="+", default=list(CADENCES), choices=list(CADENCES))
    parser.add_argument("--window", type=float, default=15.0, help="s of epochs written per cadence")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="added to each read of a trial's folder")
    parser.add_argument("--before-commit", help="'before' is this commit's launch/mlflow_export.py (default: this "
                        "code reading every trial at every tick, `Export.reread`)")
    args = parser.parse_args(argv)
    slow_storage(args.latency_ms / 1000)
    with tempfile.TemporaryDirectory(prefix="a2-bench-export-") as tmp:
        rows = [row for n in args.trials for row in bench(n, args, Path(tmp))]
    print(f"\nexport every {EVERY:.0f} s, {RUNNING} trials running, storage latency {args.latency_ms:.0f} ms a "
          f"request; 'before': {args.before_commit or 'every trial read at every tick (Export.reread)'}")
    print(f"{'N':>5} {'cadence':>8} | {'tick median/p95 s':>19} {'':>8} | {'lag median/p95/max s':>26} {'':>8} |"
          f" {'epochs':>6}")
    print(f"{'':>5} {'':>8} | {'before':>9} {'after':>9} {'ratio':>8} | {'before':>13} {'after':>12} {'ratio':>8} |")
    by = {(n, c, m): r for n, c, m, r in rows}
    for n in args.trials:
        for c in args.cadences:
            b, a = by[(n, c, "before")], by[(n, c, "after")]
            print(f"{n:>5} {c:>8} | {b['tick_median']:4.2f}/{b['tick_p95']:4.2f} {a['tick_median']:4.2f}/"
                  f"{a['tick_p95']:4.2f} {b['tick_median'] / a['tick_median']:7.1f}x | "
                  f"{b['lag_median']:4.1f}/{b['lag_p95']:4.1f}/{b['lag_max']:4.1f} "
                  f"{a['lag_median']:4.1f}/{a['lag_p95']:4.1f}/{a['lag_max']:4.1f} "
                  f"{b['lag_median'] / a['lag_median']:7.1f}x | {b['epochs']:>3}/{a['epochs']:<3}"
                  + (f" unexported {b['missing']}/{a['missing']}" if b["missing"] or a["missing"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
