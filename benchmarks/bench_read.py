"""The read side at the team's scale: `a2 study status`, `a2 study compare` and `a2 report` on a finished study's
record, each timed as a fresh process (its Python start-up and imports included, as people wait for it), and the S3
requests one `status` makes. No Ray runs: the record is fabricated as a finished study leaves it.

    python benchmarks/bench_read.py                                   # 75 and 1,005 trials, 20 epochs, local
    python benchmarks/bench_read.py --baseline-code /tmp/base         # the same commands with other code, side by side
    python benchmarks/bench_read.py --sizes 75 --s3-epochs 10 20      # S3 requests of one `status`, moto server
    python benchmarks/bench_read.py --sizes 1005 --profile status     # cProfile of one command, in this process

The record (`fabricate`) is `studies/fusion_ablation.yaml` at fixed 5 seeds with `search.num_samples` set for the size (5 x (7 + 2N)
trials: 75, 1,005) and ASHA (grace 2) standing in for its FIFO, so that some groups hold the scheduler's stop record,
each trial as the trainer and Tune leave it: its run folder (`launch.trainable`: `trial.json`, `results.json` with
every epoch's result as the real trainer reports it, the best val epoch's and the test split's per-image scores over
`--images` images, a caption-samples file per epoch, the best and the latest checkpoint folder, each a small
`a2core.checkpoint` file and its `history.json`, `stopped_early.json` for stopped trials), Tune's trial folder
(`result.json` with every result as reported, per-image scores included; `params.json`; its pointer checkpoint),
Tune's experiment state written by Ray's own `Trial` classes, every result fed through `Trial.update_last_result`
and the last checkpoint registered (`tests/tunestate.py`), and Tune's other root files. Scores are drawn per
configuration and seed (`numpy`, seed 0).

Per size it prints each command's wall time (median of `--repeats` fresh processes; all three run the same way),
without the driver's digest and with it (`--digest`: the record as the driver leaves it, `record-digest.json`, written
by `StudyRecord.save_digest` as at the end of a study), and with `--baseline-code` the same for that code (e.g.
`git archive <commit> | tar -x -C /tmp/base`), and the ratio.
With `--s3-epochs` it puts the record of the first size on a moto server (a separate process on 127.0.0.1, one log
line a request) once per epoch count and counts the requests of one `status` (and of the baseline's), per trial.
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pickle
import pstats
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_rehearse import folder_bytes, samples_for, timed  # noqa: E402 - the same study sizes, the same bytes

STUDY = ROOT / "studies" / "fusion_ablation.yaml"
COMMANDS = {"status": ("study", "status"), "compare": ("study", "compare"), "report": ("report",)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[75, 1005], help="trials: 5 x (7 + 2N), e.g. 75, 1005")
    p.add_argument("--epochs", type=int, default=20, help="epochs every trial that was not stopped ran")
    p.add_argument("--images", type=int, default=500, help="val and test images of the per-image scores")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per command (the median is shown)")
    p.add_argument("--commands", nargs="+", choices=tuple(COMMANDS), default=list(COMMANDS))
    p.add_argument("--baseline-code", default=None, help="a copy of the code to time side by side (PYTHONPATH)")
    p.add_argument("--s3-epochs", type=int, nargs="*", default=[],
                   help="count the S3 requests of one `status` on the first size with these epochs a trial")
    p.add_argument("--profile", choices=tuple(COMMANDS), default=None,
                   help="cProfile this command on each size in this process (top 30 by cumulative time)")
    p.add_argument("--digest", nargs="+", choices=("without", "with"), default=["without", "with"],
                   help="time the commands on the record without the driver's digest, with it (`record-digest.json`, "
                        "as the driver leaves it at the end of a study: `StudyRecord.save_digest`), or both")
    p.add_argument("--work", default=None, help="folder for the records (default: a temporary one, removed)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a command may take")
    return p.parse_args(argv)


# -- the record --------------------------------------------------------------------------------------------------
def study_spec(storage: Path, trials: int, epochs: int):
    """fusion_ablation at `trials` trials of `epochs` epochs, ASHA for its FIFO, its COCO data replaced by a small
    synthetic set as a rehearsal's (`launch.rehearse.rehearsal_raw`: the saved spec is validated on every read)."""
    from launch import rehearse
    from launch.spec import StudySpec

    # fixed 5 seeds of every configuration (the sizes count so), not the shipped file's confirmation seeds
    overrides = ["search.replicates=5", "search.confirm=null", f"search.num_samples={samples_for(trials)}",
                 f"train.xe_epochs={epochs}",
                 "search.scheduler={asha: {grace_period: 2, reduction_factor: 2}}"]
    # the MLflow store is not there: `report` logs nothing (MLflow is not what is timed here)
    _, own = rehearse.rehearsal_raw(str(STUDY), overrides, str(storage), f"sqlite:///{storage / 'mlflow.db'}")
    own["name"] = f"bench-read-{trials}-{epochs}"
    return StudySpec.from_dict(own, source=str(STUDY), check_files=False)


def epoch_result(epoch: int, value: float, best: tuple[int, float], steps: int, run: str, rng) -> dict:
    """An epoch's result with the keys the real trainer reports (`a2core.train`, launch.trainable's compute)."""
    result = {"epoch": epoch, "step": epoch * steps, "stage": "xe", "train/loss": 4.0 / epoch ** 0.3,
              "train/lr": 5e-4 * min(1.0, epoch / 2), "train/mask_loss": float(rng.normal(0.1, 0.01)),
              "train/mask_mean": float(rng.uniform(0.4, 0.6))}
    for n in range(1, 5):
        result[f"val/BLEU-{n}"] = value * 0.7 / n + float(rng.normal(0, 0.2))
    result.update({"val/METEOR": value * 0.25, "val/ROUGE-L": value * 0.5, "val/CIDEr": value})
    for layer in range(6):
        result[f"diag/jsd/layer{layer}"] = float(rng.uniform(0, 0.1))
        result[f"diag/kendall/layer{layer}/attention"] = float(rng.uniform(0.5, 0.9))
    result.update({"diag/kendall/attention": 0.7, "diag/kendall/mask": 0.6, "diag/mask_mean": 0.5,
                   "diag/grounding/accuracy": 0.3, "diag/grounding/control": 0.2, "diag/grounding/lift": 0.1,
                   "diag/grounding/chance": 0.19, "diag/grounding/subject_object": 0.45, "time/diag_s": 3.1,
                   "best/val/CIDEr": best[1], "best/epoch": best[0], "time/epoch_s": 2400.0,
                   "checkpoint_path": f"{run}/checkpoint_epoch{epoch:04d}", "timestamp": 1795795195.0 + epoch * 2400,
                   "compute/wall_s": 2400.0 * epoch, "compute/gpu_s": 2400.0 * epoch})
    return result


def fabricate(work: Path, trials: int, epochs: int, images: int) -> tuple[str, Path]:
    """A finished study of `trials` trials in `work/storage` (see the module's docstring); its name and storage."""
    import numpy as np
    import yaml

    from a2core import checkpoint
    from a2core.selection import best_epoch
    from launch import rehearse
    from launch.layout import RESULTS_FILE, STOPPED_FILE, TRIAL_FILE, TRIALS_DIR, checkpoint_name, train_run_name
    from launch.location import STUDY_FILE, StudyLocation, saved_form
    from launch.spec import SEED_KEYS
    from tests.tunestate import experiment_storage, save_experiment_state, tune_trial

    storage = work / "storage"
    spec = study_spec(storage, trials, epochs)
    location = StudyLocation(spec.name, spec.storage, spec.storage_endpoint_url)
    folder = Path(location.at().uri)
    location.write_text(yaml.safe_dump(saved_form(spec), sort_keys=False), STUDY_FILE)
    configs = rehearse.suggestions(spec)
    assert len(configs) == trials == spec.num_trials, (len(configs), trials, spec.num_trials)
    tune_storage = experiment_storage(folder)
    groups: dict[str, int] = {}
    ids = [str(i) for i in range(images)]
    steps = 11329
    small = Path(tempfile.mkdtemp(prefix="a2-bench-read-"))
    tune_trials = []
    for n, sampled in enumerate(configs):
        trial_id = hashlib.sha256(f"{spec.name}-{n}".encode()).hexdigest()[:8]
        group = groups.setdefault(json.dumps({k: v for k, v in sampled.items() if k not in SEED_KEYS},
                                             sort_keys=True, default=str), len(groups))
        rng = np.random.default_rng([group, n])
        # about a quarter of the groups stopped at rung 2, another quarter at rung 8 (whole groups: ReplicateASHA)
        rung = {1: 2, 2: 8}.get(group % 4) if epochs > 8 else None
        done = rung or epochs
        mean = 110.0 + 2.0 * (group % 5) + float(rng.normal(0, 1.0))
        values = [mean * (1 - 0.5 ** (e / 3)) + float(rng.normal(0, 0.3)) for e in range(1, done + 1)]
        run = location.at(TRIALS_DIR, train_run_name(spec.name, trial_id))
        run_folder = Path(run.uri)
        results, tune_results = [], []
        for e in range(1, done + 1):
            best = best_epoch({i + 1: v for i, v in enumerate(values[:e])})
            result = epoch_result(e, values[e - 1], (best, values[best - 1]), steps, run.uri, rng)
            val_scores = (values[e - 1] + rng.normal(0, 30, images)).round(3).tolist()
            # what Tune is sent: the plain values (`launch.layout.plain_values`), the per-image scores only to files
            tune_result = dict(result)
            if e == epochs:  # the selected checkpoint on the test split (train.test_at_end)
                test = (values[best - 1] + rng.normal(0, 30, images)).round(3)
                result.update({"test/BLEU-1": 70.0, "test/BLEU-4": 35.0, "test/METEOR": 28.0, "test/ROUGE-L": 56.0,
                               "test/CIDEr": float(test.mean()), "test/epoch": best, "time/test_s": 900.0})
                tune_result.update({k: v for k, v in result.items() if k.startswith("test/")})
                (run_folder / "artifacts" / "eval").mkdir(parents=True, exist_ok=True)
                (run_folder / "artifacts" / "eval" / "test_per_image_cider.json").write_text(
                    json.dumps(dict(zip(ids, test.tolist())), sort_keys=True))
            if best == e:
                (run_folder / "artifacts" / "eval").mkdir(parents=True, exist_ok=True)
                (run_folder / "artifacts" / "eval" / "per_image_cider.json").write_text(json.dumps(
                    dict(zip(ids, val_scores)), sort_keys=True))
            (run_folder / "artifacts" / "samples").mkdir(parents=True, exist_ok=True)
            (run_folder / "artifacts" / "samples" / f"epoch_{e:03d}.txt").write_text(
                "".join(f"{i}: a man riding a wave on top of a surfboard\n" for i in range(5)))
            results.append(result)
            tune_results.append(tune_result)
        best = best_epoch({i + 1: v for i, v in enumerate(values)})
        for e in sorted({best, done}):  # the best and the latest checkpoint are kept
            ckpt = run_folder / checkpoint_name(e)
            ckpt.mkdir(parents=True, exist_ok=True)
            checkpoint.save({"format": checkpoint.FORMAT, "model": {}, "config": spec.trial_config(dict(sampled)),
                             "vocab": [], "epoch": e, "best": {"epoch": best, "value": values[best - 1]},
                             "history": results[:e]}, small / "checkpoint.pt")
            shutil.copyfile(small / "checkpoint.pt", ckpt / "checkpoint.pt")
            (ckpt / checkpoint.HISTORY_FILE).write_text(json.dumps(results[:e]))
        (run_folder / RESULTS_FILE).write_text(json.dumps(results, indent=1))
        (run_folder / TRIAL_FILE).write_text(json.dumps({"trial_id": trial_id, "config": sampled}, sort_keys=True,
                                                        default=str))
        if rung:
            (run_folder / STOPPED_FILE).write_text(json.dumps(
                {"rung": rung, "cutoff": mean - 1.0, "group_mean": mean - 2.0, "threshold": mean - 1.0}, indent=1))
        tune_trials.append(tune_trial(tune_storage, trial_id, sampled, n + 1, results=tune_results,
                                      result_log=True))
    shutil.rmtree(small, ignore_errors=True)
    stamp = "2026-11-27_10-00-00"
    save_experiment_state(folder, tune_trials, stamp=stamp)
    for name in (f"search_gen_state-{stamp}.json", f"searcher-state-{stamp}.pkl", "tuner.pkl"):
        (folder / name).write_bytes(pickle.dumps({"stand-in": name, "trials": [t.trial_id for t in tune_trials]}))
    (folder / "state-copies").mkdir(exist_ok=True)
    for path in folder.glob("*"):
        if path.is_file() and path.name != STUDY_FILE:
            shutil.copyfile(path, folder / "state-copies" / path.name)
    return spec.name, storage


# -- timing ------------------------------------------------------------------------------------------------------
def save_digest(name: str, storage: str, env: dict | None = None) -> float:
    """Write the study's digest as the driver does at the end of a study (a fresh process); its seconds."""
    code = ("import sys; from launch.location import locate; from launch.record import StudyRecord; "
            "StudyRecord.load(locate(sys.argv[1], sys.argv[2]), for_digest=True).save_digest()")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code, name, storage], check=True, cwd=ROOT,
                   env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)})
    return time.monotonic() - t0


def command_args(label: str, name: str, storage: str, work: Path) -> list[str]:
    extra = ["--out", str(work / f"report-{time.monotonic_ns()}")] if label == "report" else []
    return [*COMMANDS[label], name, "--storage", storage, *extra]


def time_commands(codes: dict[str, Path], name: str, storage: Path, work: Path, args) -> dict:
    """{(code label, command): median seconds or None}; the codes' runs interleaved, one command at a time."""
    times: dict[tuple[str, str], list[float]] = {}
    failed: set[tuple[str, str]] = set()
    for label in args.commands:
        for _ in range(args.repeats):
            for code_label, code in codes.items():
                seconds, rc, tail = timed(code, command_args(label, name, str(storage), work), work, args.timeout)
                if rc != 0:
                    failed.add((code_label, label))
                    print(f"  {code_label} {label} failed (exit {rc}): {tail}", flush=True)
                times.setdefault((code_label, label), []).append(seconds)
    return {key: None if key in failed else statistics.median(v) for key, v in times.items()}


def profile(label: str, name: str, storage: Path, work: Path) -> str:
    """cProfile of one command in this process, top 30 cumulative (its imports mostly done by `fabricate` already)."""
    from launch.cli import main

    profiler = cProfile.Profile()
    out = io.StringIO()
    saved = sys.stdout
    sys.stdout = io.StringIO()
    try:
        profiler.enable()
        main(command_args(label, name, str(storage), work))
        profiler.disable()
    finally:
        sys.stdout = saved
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(30)
    return out.getvalue()


# -- S3 requests -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's S3 server in its own process on 127.0.0.1; its stderr (one line a request) in a file."""

    def __init__(self, work: Path):
        self.log = work / "moto.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.url,
                    "AWS_CONFIG_FILE": str(work / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(work / "none")}
        # moto's server, patched as the tests patch it so that pyarrow (Ray's storage) can write to it
        serve = ("import sys; from tests.raycluster import patch_moto_for_arrow; patch_moto_for_arrow(); "
                 "from moto.server import main; main(sys.argv[1:])")
        self.process = subprocess.Popen([sys.executable, "-c", serve, "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=open(self.log, "w"), cwd=ROOT,
                                        env={**os.environ, "PYTHONPATH": str(ROOT)})
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit("bench_read: moto did not start")

    def requests(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if '" ' in line and "HTTP/1.1" in line]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def moto_client(server: MotoServer):
    import boto3

    return boto3.client("s3", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def make_bucket(server: MotoServer, bucket: str):
    """The bucket on the server (made unless there); a boto3 client of the server."""
    client = moto_client(server)
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return client


def prefix_bytes(server: MotoServer, bucket: str, prefix: str, suffix: str = "") -> int:
    """Bytes of the objects below `prefix` whose keys end in `suffix` (listed without going through the counted
    code: these requests come after the counts)."""
    pages = moto_client(server).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sum(o["Size"] for page in pages for o in page.get("Contents", []) if o["Key"].endswith(suffix))


def upload(server: MotoServer, folder: Path, bucket: str, prefix: str) -> int:
    client = make_bucket(server, bucket)
    files = [p for p in folder.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: client.put_object(Bucket=bucket, Key=f"{prefix}/{p.relative_to(folder).as_posix()}",
                                                  Body=p.read_bytes()), files))
    return len(files)


def count_status_requests(server: MotoServer, codes: dict[str, Path], name: str, storage: str, work: Path,
                          timeout: float) -> dict[str, tuple[int, float, dict]]:
    """{code label: (requests of one `status`, its seconds, requests by method)}."""
    out = {}
    for code_label, code in codes.items():
        before = len(server.requests())
        seconds, rc, tail = timed(code, command_args("status", name, storage, work), work, timeout, env=server.env)
        if rc != 0:
            print(f"  {code_label} status on S3 failed (exit {rc}): {tail}", flush=True)
        lines = server.requests()[before:]
        out[code_label] = (len(lines), seconds, by_method(lines))
    return out


def by_method(lines: list[str]) -> dict[str, int]:
    """{HTTP method: requests} of moto's request log lines."""
    methods: dict[str, int] = {}
    for line in lines:
        method = line.split('"', 2)[1].split(" ", 1)[0]
        methods[method] = methods.get(method, 0) + 1
    return methods


# -- the run -----------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="a2-bench-read-"))
    work.mkdir(parents=True, exist_ok=True)
    codes = {"this": ROOT}
    if args.baseline_code:
        codes = {"baseline": Path(args.baseline_code).resolve(), "this": ROOT}
    print(f"bench_read: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"{args.epochs} epochs a trial, {args.images} per-image scores; median of {args.repeats} fresh processes",
          flush=True)
    rows = []
    try:
        for trials in args.sizes:
            t0 = time.monotonic()
            size_work = work / f"n{trials}-e{args.epochs}"
            name, storage = fabricate(size_work, trials, args.epochs, args.images)
            folder = storage / name
            state = next(folder.glob("experiment_state-*.json"))
            print(f"{trials} trials: record fabricated in {time.monotonic() - t0:.0f} s, "
                  f"{folder_bytes(folder) / trials / 1e6:.2f} MB a trial, experiment state "
                  f"{state.stat().st_size / 1e6:.1f} MB", flush=True)
            if args.profile:
                print(profile(args.profile, name, storage, size_work), flush=True)
                continue
            for variant in args.digest:
                if variant == "with":
                    seconds = save_digest(name, str(storage))
                    print(f"  the driver's digest written in {seconds:.1f} s, "
                          f"{(folder / 'record-digest.json').stat().st_size / 1e6:.1f} MB", flush=True)
                times = time_commands(codes, name, storage, size_work, args)
                rows.append((trials, variant, times))
                for label in args.commands:
                    shown = [f"{code_label} {_s(times[(code_label, label)])}" for code_label in codes]
                    ratio = ""
                    if len(codes) == 2 and None not in (times[("baseline", label)], times[("this", label)]):
                        ratio = f" (x{times[('baseline', label)] / times[('this', label)]:.1f} faster)"
                    print(f"  {label:8s} {variant} digest: " + " / ".join(shown) + ratio, flush=True)
            print(f"  load average now {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
        for variant in args.digest:
            sized = [(trials, times) for trials, v, times in rows if v == variant]
            if len(sized) >= 2:
                (small, a), (large, b) = sized[0], sized[-1]
                for key in b:
                    if a.get(key) is not None and b.get(key) is not None:
                        print(f"growth {key[0]} {key[1]} {variant} digest: "
                              f"{(b[key] - a[key]) / (large - small) * 1000:.2f} ms a trial ({small} -> {large} trials)")
        if args.s3_epochs:
            trials = args.sizes[0]
            server = MotoServer(work)
            try:
                for epochs in args.s3_epochs:
                    size_work = work / f"s3-n{trials}-e{epochs}"
                    name, storage = fabricate(size_work, trials, epochs, args.images)
                    bucket = f"bench-read-{epochs}"
                    files = upload(server, storage / name, bucket, f"studies/{name}")
                    for variant in args.digest:
                        if variant == "with":  # made of the objects on S3, their sizes and times
                            save_digest(name, f"s3://{bucket}/studies", server.env)
                        counts = count_status_requests(server, codes, name, f"s3://{bucket}/studies", size_work,
                                                       args.timeout)
                        for code_label, (n, seconds, methods) in counts.items():
                            by = ", ".join(f"{m} {c}" for m, c in sorted(methods.items()))
                            print(f"S3 {trials} trials x {epochs} epochs ({files} objects), {variant} digest: "
                                  f"{code_label} status made {n} requests, {n / trials:.2f} a trial ({by}); "
                                  f"{seconds:.1f} s", flush=True)
            finally:
                server.stop()
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _s(seconds: float | None) -> str:
    return "failed" if seconds is None else f"{seconds:.2f} s"


if __name__ == "__main__":
    raise SystemExit(main())
