"""Run a small override of the smoke study and dump what MLflow holds of it, to compare two versions of the code.

    python3 scripts/mlflow_dump.py run OUT.json [--keep DIR]   # runs the study (starts a local Ray), then dumps
    python3 scripts/mlflow_dump.py dump URI NAME ROOT OUT.json  # dumps a study already in MLflow
    python3 scripts/mlflow_dump.py diff A.json B.json           # exit 1 and the differing lines when they differ

The dump holds, per run (the study's parent and one child per trial, in trial order): its name, status, params,
tags, every metric's (step, value) history and its artifacts' names with a digest of their content. What differs
between two runs of the same study is left out or normalised: run ids, timestamps and durations (the values of
`compute/*` and `time/*`; their steps stay), the git commit, the study's folder (`<root>`), Tune's random trial ids
and the replicate groups' hashes (of configs that hold the data folder): trials are numbered in config, seed order.
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME = "a2-smoke"
# The smoke study made smaller and deterministic: 2 configurations x 2 seeds, 3 epochs (ASHA's rung at epoch 2),
# trials one at a time (the scheduler's decisions do not depend on which trial reports first).
OVERRIDES = ["data.images=300", "data.val_images=40", "train.xe_epochs=3", "search.replicates=2",
             "resources.max_concurrent_trials=1", "resources.cpus_per_worker=1", "train.diag_images=40",
             "train.diag_kendall_images=5", "train.warmup=30"]
_VOLATILE_TAGS = ("mlflow.user", "mlflow.source.name", "mlflow.source.type", "mlflow.source.git.commit",
                  "a2.git_commit", "mlflow.runName", "mlflow.parentRunId")


def run_study(workdir: Path) -> tuple[str, Path]:
    """Run the study in `workdir` (its storage and MLflow database there); returns (tracking URI, storage root)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "launch.cli", "study", "run", str(REPO / "studies" / "smoke.yaml"), *OVERRIDES,
           f"tracking.mlflow_uri={uri}", f"storage={workdir / 'studies'}", f"data.root={workdir / 'data'}"]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    (workdir / "run.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"study failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return uri, workdir


def _normalise(text: str, root: str, names: dict[str, str]) -> str:
    text = text.replace(root, "<root>")
    for trial_id, name in names.items():
        text = text.replace(trial_id, name)
    return text


def dump(uri: str, name: str, root: str) -> dict:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow

    from dashboards.tracking import study_runs

    client = mlflow.MlflowClient(uri)
    parent, children = study_runs(uri, name)
    # Tune's trial ids are random: trials are named by their place in (replicate group, seed) order
    # (and the replicate groups' hashes, of configs holding the data folder, by the trials' order)
    children = sorted(children, key=lambda run: json.dumps(
        {k: v.replace(root, "<root>") for k, v in run.data.params.items() if k != "train.seed"}, sort_keys=True)
        + run.data.tags.get("a2.seed", ""))
    names = {run.data.tags["a2.trial_id"]: f"<trial{i}>" for i, run in enumerate(children)}
    for run in children:
        names.setdefault(run.data.tags.get("a2.config_hash", "-"), f"<group{len(set(names.values())) - len(children)}>")

    def one(run) -> dict:
        rid = run.info.run_id
        metrics = {}
        for key in sorted(run.data.metrics):
            history = sorted((m.step, m.value) for m in client.get_metric_history(rid, key))
            metrics[key] = [[s, None if key.startswith(("compute/", "time/")) else v] for s, v in history]
        artifacts = {}
        pending = [None]
        with tempfile.TemporaryDirectory() as folder:
            while pending:
                for info in client.list_artifacts(rid, pending.pop()):
                    if info.is_dir:
                        pending.append(info.path)
                    else:
                        local = client.download_artifacts(rid, info.path, folder)
                        data = _normalise(Path(local).read_text(), root, names)
                        artifacts[info.path] = hashlib.sha256(data.encode()).hexdigest()[:16]
        return {"name": _normalise(run.info.run_name or "", root, names), "status": run.info.status,
                "params": {k: _normalise(v, root, names) for k, v in sorted(run.data.params.items())},
                "tags": {k: _normalise(v, root, names) for k, v in sorted(run.data.tags.items())
                         if k not in _VOLATILE_TAGS},
                "metrics": metrics, "artifacts": dict(sorted(artifacts.items()))}

    return {"parent": None if parent is None else one(parent), "trials": [one(run) for run in children]}


def diff(a: Path, b: Path) -> int:
    lines_a = json.dumps(json.loads(a.read_text()), indent=1, sort_keys=True).splitlines()
    lines_b = json.dumps(json.loads(b.read_text()), indent=1, sort_keys=True).splitlines()
    if lines_a == lines_b:
        print(f"identical: {a} and {b} ({len(lines_a)} lines)")
        return 0
    print("\n".join(difflib.unified_diff(lines_a, lines_b, str(a), str(b), lineterm="", n=2)))
    return 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("out", type=Path)
    run.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temp folder)")
    one = sub.add_parser("dump")
    for arg in ("uri", "name", "root"):
        one.add_argument(arg)
    one.add_argument("out", type=Path)
    two = sub.add_parser("diff")
    two.add_argument("a", type=Path)
    two.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "diff":
        return diff(args.a, args.b)
    if args.command == "dump":
        result = dump(args.uri, args.name, args.root)
    else:
        workdir = args.keep or Path(tempfile.mkdtemp(prefix="a2-dump-"))
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            uri, root = run_study(workdir.resolve())
            result = dump(uri, NAME, str(root))
        finally:
            if args.keep is None:
                shutil.rmtree(workdir, ignore_errors=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"{args.out}: parent and {len(result['trials'])} trial runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
