"""A study at the team's scale, rehearsed (`launch.rehearse`): what the driver, Tune's experiment state and the
read side cost as trials grow, each trial 20 stand-in epochs.

    flock /tmp/a2-ray.lock python benchmarks/bench_rehearse.py                      # 75 and 1,005 trials
    flock /tmp/a2-ray.lock python benchmarks/bench_rehearse.py --sizes 75 1005 2005 --epoch-s 0.05
    flock /tmp/a2-ray.lock python benchmarks/bench_rehearse.py --sizes 75 155 --state-saves periodic shipped
    flock /tmp/a2-ray.lock python benchmarks/bench_rehearse.py --sizes 75 --s3     # storage on a moto S3 server
    flock /tmp/a2-ray.lock python benchmarks/bench_rehearse.py --sizes 1005 2005 --keep /tmp/keep
    python benchmarks/bench_rehearse.py --reread /tmp/keep/*   # the reads on the kept records, without/with digest
    flock /tmp/a2-ray.lock python benchmarks/bench_rehearse.py --sizes 75 --baseline-code /tmp/base   # side by side
    flock /tmp/a2-ray.lock python benchmarks/bench_rehearse.py --sizes 75 --tracking server --baseline-code /tmp/base

Each size is `studies/fusion_ablation.yaml` at fixed 5 seeds (15 configurations x 5 = 75 trials; `search.num_samples=N` gives
the exp_decay cells 2N T_P samples: 5 x (7 + 2N) trials) rehearsed once through `launch.rehearse.run_rehearsal`: the
real driver, searcher (GridCrossedSearcher), FIFO scheduler, trial storage, record, MLflow export (SQLite) and
summary, on a local Ray whose 16 logical GPUs stand in for the cluster's, with the stand-in trainer sleeping
`--epoch-s` an epoch and reporting drawn scores with `--images` per-image scores (the real trainer reports 5,000).
Per size it prints:

- driver overhead per trial: (wall - ideal makespan, ceil(trials / 16) x 20 x epoch-s) / trials (target flat,
  <= 0.5 s); the driver's own CPU seconds per trial (all its threads: the MLflow export's too, and with the default
  SQLite store the store's database work; `--tracking server` moves that to `a2 mlflow serve`, whose CPU a trial is
  printed apart); its peak memory (max RSS); the whole machine's CPU a trial (every process, `/proc/stat`) and so
  the least wall a trial any schedule could take on this machine's cores: where the overhead's floor is the box's;
- Tune's experiment-state saves (`TuneController.save_to_dir`, each writes every trial's state and the searcher's:
  O(trials)): how many, their mean and last time, and their share of the driver's wall time. `--state-saves`:
  `shipped` (the driver as it is: `CheckpointConfig(num_to_keep=None)`, so Tune saves on its own period, at least
  10 s and about 5% of the time), `periodic` (the same, with Tune's forcing switched off explicitly: identical now,
  kept to rerun the earlier comparison), or both, side by side. (Until 2026-11-27 the driver kept one Tune
  checkpoint a trial, `num_to_keep=1`, which made Tune save at every trial checkpoint: trials x epochs saves of
  O(trials) each, the first thing that broke; RESULTS.md has those runs.)
- the bytes the study's storage holds per trial, and Tune's own result log (`result.json`) among them;
- with `--s3`, the study's storage on moto's S3 server (a process on 127.0.0.1 logging each request): the S3
  requests of the whole rehearsal per trial (the write side: driver, trials, record, export) and of each read
  command, by HTTP method;
- `a2 study status`, `a2 study compare` and `a2 report` wall time on the finished record (each a fresh process,
  its Python start-up and imports included, as people wait for it; targets 2 s, 5 s, 30 s at 1,000 trials).

Run it alone on the machine (it starts Ray). benchmarks/RESULTS.md has the figures: 75 and 1,005 trials, the
bound of the MLflow export behind them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = Path(os.environ.get("A2_BENCH_CODE") or ROOT)  # the code rehearsed: another with --baseline-code
if str(CODE) not in sys.path:
    sys.path.insert(0, str(CODE))

STUDY = ROOT / "studies" / "fusion_ablation.yaml"
CONCURRENT = 16  # fusion_ablation's max_concurrent_trials: 4 g5.12xlarge workers x 4 GPUs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[75, 1005],
                   help="trials per study: 75, or 5 x (7 + 2N) for N exp_decay samples a cell")
    p.add_argument("--epoch-s", type=float, default=0.05, help="seconds a stand-in epoch sleeps")
    p.add_argument("--images", type=int, default=500, help="val and test images of the per-image scores")
    p.add_argument("--read-timeout", type=float, default=300, help="seconds a status/compare/report may take")
    p.add_argument("--state-saves", nargs="+", choices=("shipped", "periodic"), default=["shipped"],
                   help="Tune's experiment-state saves: at every trial checkpoint (shipped) or Tune's period")
    p.add_argument("--s3", action="store_true",
                   help="the study's storage on a moto S3 server (its own process on 127.0.0.1): S3 requests per "
                        "trial of the whole rehearsal and of each read command, by method")
    p.add_argument("--keep", default=None,
                   help="a folder to keep each size's storage and MLflow store in (to time later reads on them)")
    p.add_argument("--reread", nargs="+", default=None, metavar="WORK",
                   help="no rehearsal: time status, compare and report (median of --repeats) on the records that "
                        "--keep kept in these folders, without the driver's digest and with it")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per command with --reread")
    p.add_argument("--tracking", choices=("sqlite", "server"), default="sqlite",
                   help="the MLflow store: SQLite inside the driver's process, or `a2 mlflow serve` (its own "
                        "process, SQLite behind it, as a team runs it), whose CPU is reported apart")
    p.add_argument("--baseline-code", default=None, metavar="DIR",
                   help="each size rehearsed with the code in DIR (e.g. `git archive <commit> | tar -x -C DIR`) and "
                        "with this code, one after the other, each a fresh process; the ratios printed")
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)  # the rows, for --baseline-code's parent
    return p.parse_args(argv)


def samples_for(trials: int) -> int:
    n = (trials // 5 - 7) / 2
    if trials % 5 or n < 1 or n != int(n):
        raise SystemExit(f"bench_rehearse: {trials} trials is not 5 x (7 + 2N)")
    return int(n)


def folder_bytes(path: Path, name: str | None = None) -> int:
    return sum(p.stat().st_size for p in path.rglob(name or "*") if p.is_file())


def timed(code: Path, args: list[str], cwd: Path, timeout: float, env: dict | None = None) -> tuple[float, int, str]:
    """`a2 ARGS` as a fresh process with the code at `code` (start-up and imports included, as people wait for it):
    (seconds, exit status, the output's end)."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(code)}
    t0 = time.monotonic()
    try:
        run = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return time.monotonic() - t0, -1, f"timed out after {timeout:.0f} s"
    return time.monotonic() - t0, run.returncode, run.stdout[-400:]


def run_size(trials: int, args, work: Path, saves_mode: str = "shipped") -> dict:
    import ray
    from ray.tune.execution.tune_controller import TuneController

    from launch import rehearse
    from launch.spec import StudySpec

    # fixed 5 seeds of every configuration (the sizes below count so), not the shipped file's confirmation seeds
    overrides = ["search.replicates=5", "search.confirm=null", f"search.num_samples={samples_for(trials)}",
                 f"data.val_images={args.images}",
                 f"train.test_images={args.images}"]
    environ = dict(os.environ)  # the driver moves S3 keys into a credentials file of its own (`launch.raycluster`)
    server = None
    storage = str(work / "storage")
    if args.s3:  # the driver, its Ray workers (they inherit this environment) and the read commands reach moto
        from benchmarks.bench_read import MotoServer, make_bucket

        server = MotoServer(work)
        os.environ.update(server.env)
        make_bucket(server, "bench-rehearse")
        storage = "s3://bench-rehearse/studies"
    tracking, served = f"sqlite:///{work / 'mlflow.db'}", None
    if args.tracking == "server":
        from tests.mlflowserver import free_port, start_server

        served, tracking = start_server(tracking, str(work / "mlartifacts"), free_port(),
                                        log_path=str(work / "server.log"), timeout=120)
    raw, own = rehearse.rehearsal_raw(str(STUDY), overrides, storage, tracking)
    original = StudySpec.from_dict(raw, source=str(STUDY), check_files=False)
    spec = StudySpec.from_dict(own, source=str(STUDY))
    assert spec.num_trials == trials, (spec.num_trials, trials)
    model = rehearse.score_model(original)
    model = rehearse.ScoreModel(**{**model.to_dict(), "means": model.means, "val_images": args.images,
                                   "test_images": args.images})
    saves: list[float] = []
    save_to_dir = TuneController.save_to_dir

    def timed_save(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return save_to_dir(self, *a, **k)
        finally:
            saves.append(time.perf_counter() - t0)

    TuneController.save_to_dir = timed_save
    create = TuneController._create_checkpoint_manager
    if saves_mode == "periodic":  # no save forced by a trial's checkpoint: Tune's own period alone
        def periodic(self):
            manager = create(self)
            manager._sync_every_n_trial_checkpoints = None
            return manager
        TuneController._create_checkpoint_manager = periodic
    try:
        cpu0, machine0 = time.process_time(), machine_cpu_seconds()
        out = rehearse.run_rehearsal(spec, model, epoch_seconds=args.epoch_s, time_scale=1.0, verbose=False)
        driver_cpu, machine_cpu = time.process_time() - cpu0, machine_cpu_seconds() - machine0
    finally:
        TuneController.save_to_dir, TuneController._create_checkpoint_manager = save_to_dir, create
        ray.shutdown()
        server_cpu = None
        if served is not None:
            from tests.mlflowserver import stop_server

            server_cpu = group_cpu_seconds(served.pid)
            stop_server(served)
        os.environ.clear()  # the read commands and the counts below: this process's environment as it was
        os.environ.update(environ)
        if server is not None:
            run_requests = server.requests()
    try:
        row = _measured(trials, args, work, spec, out, saves, driver_cpu, saves_mode, server, storage,
                        run_requests if server is not None else None)
        row["tracking_server_cpu_per_trial_s"] = server_cpu / trials if server_cpu is not None else None
        row["machine_cpu_per_trial_s"] = machine_cpu / trials
        return row
    finally:
        if server is not None:
            server.stop()


def _measured(trials, args, work, spec, out, saves, driver_cpu, saves_mode, server, storage, run_requests) -> dict:
    summary = out["summary"]
    if summary["trials_finished"] != trials:
        raise SystemExit(f"bench_rehearse: {summary['trials_finished']}/{trials} trials finished")
    wall = out["seconds"]
    ideal = math.ceil(trials / CONCURRENT) * spec.total_epochs * args.epoch_s
    from benchmarks.bench_read import by_method, prefix_bytes

    reads, s3 = {}, {}
    if run_requests is not None:
        s3["run"] = by_method(run_requests)
    for label, command in (("status", ("study", "status", spec.name)), ("compare", ("study", "compare", spec.name)),
                           ("report", ("report", spec.name, "--out", str(work / "report")))):
        before = len(server.requests()) if server is not None else 0
        seconds, rc, tail = timed(CODE, [*command, "--storage", storage], work, args.read_timeout,
                                  env=server.env if server is not None else None)
        reads[label] = seconds if rc == 0 else None
        if server is not None:
            s3[label] = by_method(server.requests()[before:])
        if rc != 0:
            print(f"  {label} failed (exit {rc}): {tail}", flush=True)
    if server is not None:  # the storage's bytes, listed after the counts
        prefix = f"studies/{spec.name}/"
        stored = (prefix_bytes(server, "bench-rehearse", prefix), prefix_bytes(server, "bench-rehearse", prefix,
                                                                                "/result.json"))
    else:
        folder = work / "storage" / spec.name
        stored = (folder_bytes(folder), folder_bytes(folder, "result.json"))
    return {"trials": trials, "mode": saves_mode, "wall_s": wall, "ideal_s": ideal, "overhead_per_trial_s": (wall - ideal) / trials,
            "driver_cpu_per_trial_s": driver_cpu / trials,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "saves": len(saves), "save_mean_s": sum(saves) / max(1, len(saves)), "save_last_s": saves[-1] if saves
            else 0.0, "save_share": sum(saves) / wall, "bytes_per_trial": stored[0] / trials,
            "tune_result_bytes_per_trial": stored[1] / trials,
            "s3_requests": s3, **reads}


def machine_cpu_seconds() -> float:
    """CPU seconds every process of the machine has used since boot, all cores together (Linux /proc/stat: user,
    nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds of the processes of process group `pgid` so far, with their waited-for children's (Linux /proc)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[2]) == pgid:  # fields from state (3rd of stat): pgrp is the 5th
            total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    return total / tick


def print_row(r: dict) -> None:
    def s(v):
        return "failed" if v is None else f"{v:.1f} s"
    print(f"{r['trials']:5d} trials, state saves {r['mode']}: wall {r['wall_s']:7.1f} s (ideal {r['ideal_s']:.1f} s), overhead "
          f"{r['overhead_per_trial_s']:.2f} s/trial, driver CPU {r['driver_cpu_per_trial_s']:.2f} s/trial, driver max "
          f"RSS {r['max_rss_mb']:.0f} MB; experiment-state saves {r['saves']} x {r['save_mean_s'] * 1000:.0f} ms "
          f"(last {r['save_last_s'] * 1000:.0f} ms, {r['save_share']:.0%} of the wall); storage "
          f"{r['bytes_per_trial'] / 1e6:.2f} MB/trial (Tune's result.json {r['tune_result_bytes_per_trial'] / 1e6:.2f}); "
          f"status {s(r['status'])}, compare {s(r['compare'])}, report {s(r['report'])}", flush=True)
    cores = os.cpu_count() or 1
    print(f"  the machine's CPU a trial (every process: driver, trials, Ray, the store): "
          f"{r['machine_cpu_per_trial_s']:.2f} s; on {cores} cores no schedule takes less than "
          f"{r['machine_cpu_per_trial_s'] / cores:.2f} s of wall a trial (here {r['wall_s'] / r['trials']:.2f} s)",
          flush=True)
    if r.get("tracking_server_cpu_per_trial_s") is not None:
        print(f"  the tracking server's own CPU (`a2 mlflow serve`, not the driver's): "
              f"{r['tracking_server_cpu_per_trial_s']:.2f} s/trial", flush=True)
    for what, methods in r["s3_requests"].items():
        total = sum(methods.values())
        by = ", ".join(f"{m} {c / r['trials']:.1f}" for m, c in sorted(methods.items()))
        print(f"  S3 requests, {what}: {total} ({total / r['trials']:.1f} a trial: {by})", flush=True)


def reread(work: Path, args) -> None:
    """status, compare and report on a kept record, each the median of `args.repeats` fresh processes, without the
    digest (`record-digest.json` set aside) and with the one the driver writes (`StudyRecord.save_digest`)."""
    import statistics

    from benchmarks.bench_read import save_digest

    storage = work / "storage"
    (folder,) = [p for p in storage.iterdir() if (p / "study.yaml").is_file()]
    digest = folder / "record-digest.json"
    trials = len(list((folder / "trials").iterdir()))
    aside = digest.with_name(digest.name + ".aside")
    if digest.exists():
        digest.replace(aside)
    for variant in ("without", "with"):
        if variant == "with":
            print(f"  the driver's digest written in {save_digest(folder.name, str(storage)):.1f} s, "
                  f"{digest.stat().st_size / 1e6:.1f} MB", flush=True)
        for label, command in (("status", ("study", "status")), ("compare", ("study", "compare")),
                               ("report", ("report",))):
            extra = ["--out", str(work / "report-reread")] if label == "report" else []
            runs = []
            for _ in range(args.repeats):
                shutil.rmtree(work / "report-reread", ignore_errors=True)
                seconds, rc, tail = timed(ROOT, [*command, folder.name, "--storage", str(storage), *extra], work,
                                          args.read_timeout)
                if rc != 0:
                    raise SystemExit(f"bench_rehearse: {label} failed (exit {rc}): {tail}")
                runs.append(seconds)
            print(f"{trials} trials, {variant} digest: {label} {statistics.median(runs):.2f} s (median of "
                  f"{args.repeats}: {', '.join(f'{r:.2f}' for r in runs)})", flush=True)


def side_by_side(args) -> int:
    """Each size with the baseline code, then with this code, each rehearsal a fresh process of this script (the
    driver's CPU and memory are its own), then the ratios (this / baseline)."""
    own = ["--epoch-s", str(args.epoch_s), "--images", str(args.images), "--read-timeout", str(args.read_timeout),
           "--state-saves", *args.state_saves, "--tracking", args.tracking, *(["--s3"] if args.s3 else []),
           *(["--keep", args.keep] if args.keep else [])]
    for size in args.sizes:
        rows = {}
        for label, code in (("baseline", Path(args.baseline_code).resolve()), ("this code", ROOT)):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                print(f"{size} trials, {label} ({code}):", flush=True)
                subprocess.run([sys.executable, __file__, *own, "--sizes", str(size), "--json", out.name], cwd=code,
                               check=True, env={**os.environ, "PYTHONPATH": str(code), "A2_BENCH_CODE": str(code)})
                (rows[label],) = json.loads(Path(out.name).read_text())
        before, after = rows["baseline"], rows["this code"]
        cpu = before["driver_cpu_per_trial_s"], after["driver_cpu_per_trial_s"]
        server = before["tracking_server_cpu_per_trial_s"], after["tracking_server_cpu_per_trial_s"]
        print(f"SIDE BY SIDE {size} trials, tracking {args.tracking}: driver CPU {cpu[0]:.3f} -> {cpu[1]:.3f} s/trial "
              f"(x{cpu[1] / cpu[0]:.2f}), overhead {before['overhead_per_trial_s']:.2f} -> "
              f"{after['overhead_per_trial_s']:.2f} s/trial"
              + (f", tracking server CPU {server[0]:.3f} -> {server[1]:.3f} s/trial (x{server[1] / server[0]:.2f})"
                 if None not in server else ""), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reread:
        for work in args.reread:
            reread(Path(work), args)
        return 0
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.baseline_code:
        return side_by_side(args)
    rows = []
    for size in args.sizes:
        samples_for(size)
    for size in args.sizes:
        for mode in args.state_saves:
            work = Path(tempfile.mkdtemp(prefix=f"a2-bench-rehearse-{size}-", dir=args.keep))
            try:
                rows.append(run_size(size, args, work, mode))
                print_row(rows[-1])
            finally:
                if args.keep is None:
                    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    first, last = rows[0], rows[-1]
    print(f"SUMMARY bench_rehearse: overhead per trial {first['overhead_per_trial_s']:.2f} s at {first['trials']} "
          f"trials, {last['overhead_per_trial_s']:.2f} s at {last['trials']} "
          f"(x{last['overhead_per_trial_s'] / max(first['overhead_per_trial_s'], 1e-9):.2f}); experiment-state save "
          f"{first['save_mean_s'] * 1000:.0f} -> {last['save_mean_s'] * 1000:.0f} ms, "
          f"{first['save_share']:.0%} -> {last['save_share']:.0%} of the driver's wall time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
