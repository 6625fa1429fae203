"""A new user's first hour: a quiet successful run, idempotent re-runs, names that read well.

- a tiny study prints no ERROR-level line, none of the warnings a user cannot act on and none of Tune's per-result
  or INFO lines (they are in the study's driver.log), and MLflow's
  `a2.best_checkpoint` names the real `checkpoint.pt` (slow: starts Ray; run under `flock /tmp/a2-ray.lock`);
- registering the same checkpoints twice reuses the model version (tag `a2.content_hash`); the model has a
  signature and an input example and captions given features;
- `a2 report NAME` writes to `./a2-reports/NAME`, and never over an earlier report;
- the pipeline's closing lines name the best trial once.
"""
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from a2core import checkpoint as ckpt
from a2core.config import Config
from a2core.data.captions import SPECIALS
from a2core.model.a2 import build_model
from tests.raycluster import a2, tiny_data, tiny_study  # noqa: F401

TINY_MODEL = {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10, "feature_dim": 8}
# What a successful run must not print: Ray's C++ error lines about its own watcher actors, the placement-group
# cleaner's notice, Ray's token-auth notice, MLflow's pickling and signature advice.
NOISE = ("PreemptionWatcher", "actor restart will fail", "controller actor", "Token authentication is",
         "CloudPickle", "signature", "Downloading artifacts")
# Tune's per-result and end-of-trial lines (its verbosity 2), which a study must not print
TUNE_LINES = ("Trial a2_", " reported ", "completed. Last result", "Total run time", "Wrote the latest version")
# Ray's C++ log lines ("[2026-11-23 18:09:23,395 E 27296 27296] core_worker.cc:...") and Python logging's ERROR.
ERROR_LINE = re.compile(r"\[\d{4}-\d\d-\d\d [\d:,.]+ E \d+ \d+\]|\bERROR\b")


def _checkpoints(directory: Path, seeds=(0, 1)) -> list[Path]:
    cfg = Config.from_dict({"model": TINY_MODEL})
    vocab = list(SPECIALS) + ["a", "dog"]
    paths = []
    for seed in seeds:
        torch.manual_seed(seed)
        model = build_model(cfg.model, len(vocab), cfg.data.max_caption_len + 2)
        paths.append(ckpt.save({"model": model.state_dict(), "config": cfg.to_dict(), "vocab": vocab, "epoch": 1},
                               directory / f"seed{seed}.pt"))
    return paths


@pytest.mark.outside_ray_group  # starts no Ray: runs beside the group
@pytest.mark.slow
def test_registering_the_same_checkpoints_again_reuses_the_version(tmp_path, caplog, one_torch_thread, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a SQLite store keeps artifacts under ./mlruns
    import mlflow
    from mlflow.tracking import MlflowClient

    from launch.model_registry import TAG_CONTENT_HASH, content_hash, register_ensemble

    paths = _checkpoints(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("a2-smoke")).info.run_id
    first = register_ensemble(uri, run, paths, "a2-smoke", beam_size=2, max_len=5, tags={"a2.study": "a2-smoke"})
    again = register_ensemble(uri, run, paths, "a2-smoke", beam_size=2, max_len=5)
    other = register_ensemble(uri, run, paths[:1], "a2-smoke", beam_size=2, max_len=5)
    assert (first["version"], first["reused"]) == (1, False)
    assert (again["version"], again["reused"], again["model_uri"]) == (1, True, "models:/a2-smoke/1")
    assert (other["version"], other["reused"]) == (2, False)  # other checkpoints: a new version
    versions = {int(v.version): v for v in client.search_model_versions("name='a2-smoke'")}
    assert sorted(versions) == [1, 2]
    assert versions[1].tags[TAG_CONTENT_HASH] == content_hash(paths, 2, 5) != content_hash(paths, 5, 5)
    assert versions[1].tags["a2.study"] == "a2-smoke"
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR") and r.name.startswith("mlflow")]

    mlflow.set_tracking_uri(uri)
    try:
        info = mlflow.models.get_model_info("models:/a2-smoke/1")
        model = mlflow.pyfunc.load_model("models:/a2-smoke/1")
    finally:
        mlflow.set_tracking_uri(None)
    assert info.signature.inputs.input_names() == ["image_id", "features"]
    assert info.signature.outputs.input_names() == ["image_id", "caption"]
    assert info.saved_input_example_info is not None
    pred = model.predict(pd.DataFrame({"image_id": [7, 3], "features": [np.zeros((3, 8)), np.ones((2, 8))]}))
    assert list(pred["image_id"]) == [7, 3] and all(isinstance(c, str) for c in pred["caption"])


@pytest.mark.outside_ray_group  # starts no Ray: runs beside the group
def test_report_goes_to_a2_reports_name_and_never_over_an_earlier_one(tmp_path, monkeypatch, capsys):
    import dashboards.report as report
    from launch.commands.show import cmd_report
    from tests.studyfolder import fabricated_study

    written = []
    monkeypatch.setattr(report, "build_report", lambda study, out: (
        # the folder is claimed (made, its report.html created) before the report is built: `fresh_folder(claim=True)`
        written.append(Path(out)), Path(out).mkdir(parents=True, exist_ok=True),
        (Path(out) / "report.html").write_text("x"),
        {"html": str(Path(out) / "report.html")})[-1])
    fab = fabricated_study(tmp_path, "a2-smoke", epochs=1)
    fab.patch_tune(monkeypatch)
    monkeypatch.chdir(tmp_path)
    args = SimpleNamespace(name="a2-smoke", storage=fab.spec.storage, tracking_uri=None, out=None)
    assert cmd_report(args) == 0 and cmd_report(args) == 0
    assert written == [Path("a2-reports/a2-smoke"), Path("a2-reports/a2-smoke-2")]
    assert "a2-reports/a2-smoke holds an earlier report; this run writes to a2-reports/a2-smoke-2" in \
        capsys.readouterr().out


@pytest.mark.outside_ray_group  # starts no Ray: runs beside the group
def test_the_pipeline_result_line_names_the_best_trial_once():
    from launch.conclusions import verdict

    summary = {"study": "s", "metric": "val/CIDEr", "beats_baseline": None, "baseline": None,
               "best": {"trial_id": "a07af468", "value": 1.5, "epoch": 3, "fusion": "none", "lambda": None,
                        "seed": 0}}
    line = verdict(summary)  # the pipeline prints it after the label "result:"
    assert line.startswith("best trial a07af468") and line.count("best trial") == 1


@pytest.mark.slow
def test_a_successful_tiny_study_is_quiet_and_names_its_checkpoint_file(tmp_path, tiny_data):  # noqa: F811
    from dashboards.tracking import TAG_BEST_CKPT, study_runs

    study = tiny_study(tmp_path, "quiet", tiny_data, epochs=2, new_store=True)  # MLflow's INFO lines making it too
    done = a2("study", "run", str(study), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]
    errors = [line for line in done.stdout.splitlines() if ERROR_LINE.search(line)]
    noise = [line for line in done.stdout.splitlines() if any(n in line for n in NOISE)]
    assert errors == [] and noise == [], "\n".join(errors + noise)
    # The terminal shows the project's own lines: no per-result line of Tune's, no INFO line of Ray, Tune or MLflow
    tune_lines = [line for line in done.stdout.splitlines()
                  if any(n in line for n in TUNE_LINES) or re.search(r"\bINFO\b", line)]
    assert tune_lines == [], "\n".join(tune_lines)
    lines = done.stdout.splitlines()
    log = tmp_path / "studies" / "quiet" / "driver.log"
    assert f"study quiet: 1 trials, results in {tmp_path / 'studies' / 'quiet'} (Ray and Tune log: {log})" in lines
    assert sum(line.split()[:2] == ["trial", "fusion"] for line in lines) >= 1  # our table, ...
    assert lines[-1] == f"summary: {tmp_path / 'studies' / 'quiet' / 'summary.json'}"  # ... and conclusions
    # ... and what Ray, Tune and MLflow said is in the study's log file
    logged = log.read_text()
    assert "Started a local Ray instance" in logged and "Total run time" in logged, logged[-2000:]
    assert "Creating initial MLflow database tables" in logged, logged[-2000:]  # the new store it made
    _, children = study_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "quiet")
    (run,) = children
    best = run.data.tags[TAG_BEST_CKPT]
    assert best.endswith("/checkpoint.pt") and Path(best).is_file() and Path(best).stat().st_size > 10_000
