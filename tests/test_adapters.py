"""The places that lean on private names, each behind one module (docs/explanation/design.md, "Design notes"):
`launch/verify.py` knows the names of the files Tune writes at an experiment's root (it checks them, keeps whole
copies and puts them back), `dashboards/mlflow_views.py` knows the MLflow UI's saved views
(`launch/tracking_writer.py` writes them), and `launch/raycluster.py`'s `shutdown` stops a local Ray through Ray's
handle on its processes. These tests hold each assumption against the installed release, and the release against
what pyproject.toml allows, so that a Ray or MLflow upgrade fails here, by name, instead of in a study."""
from __future__ import annotations

import json
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def allowed(distribution: str) -> SpecifierSet:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [d for d in deps if re.match(rf"{distribution}(\[|[<>=!~ ]|$)", d)]
    return SpecifierSet(re.sub(r"^[A-Za-z0-9_.-]+(\[[^]]*\])?", "", spec))


@pytest.mark.parametrize("distribution, module", [("ray", "launch.verify"), ("mlflow", "dashboards.mlflow_views")])
def test_pyproject_allows_only_the_release_each_adapter_was_written_for(distribution, module):
    import importlib

    tested = getattr(importlib.import_module(module), f"TESTED_{distribution.upper()}")
    spec = allowed(distribution)
    assert Version(version(distribution)) in spec, (distribution, version(distribution), str(spec))
    # every release the range allows is the tested minor release, and the tested one is allowed
    assert Version(f"{tested}.0") in spec and Version(f"{tested}.99") in spec
    major, minor = map(int, tested.split("."))
    assert Version(f"{major}.{minor + 1}.0") not in spec and Version(f"{major}.{minor - 1}.99") not in spec


def test_tunes_state_file_names_are_those_verify_reads():
    from ray.tune.callback import CallbackList
    from ray.tune.execution.tune_controller import TuneController
    from ray.tune.impl.tuner_internal import _TUNER_PKL
    from ray.tune.search.search_generator import SearchGenerator
    from ray.tune.search.searcher import Searcher

    from launch.verify import _root_kind

    stamp = "2026-11-27_10-00-00"
    written = {TuneController.CKPT_FILE_TMPL.format(stamp): "json",
               SearchGenerator.CKPT_FILE_TMPL.format(stamp): "pickle",  # a pickle, despite its .json name
               Searcher.CKPT_FILE_TMPL.format(stamp): "pickle",
               CallbackList.CKPT_FILE_TMPL.format(stamp): "pickle",
               _TUNER_PKL: "pickle"}
    assert {name: _root_kind(name) for name in written} == written
    assert _root_kind("study.yaml") is None and _root_kind("summary.json") is None


STOP_A_LOCAL_RAY = """
import json, os, subprocess, time
from ray._private import worker
from launch.raycluster import alive, connect, descendants, shutdown
connect()
node = worker._global_node
kinds = sorted(node.all_processes)
pids = [info.process.pid for infos in node.all_processes.values() for info in infos]
pids += [d for p in list(pids) for d in descendants(p)]
graceful = []  # Ray's graceful stop sends SIGTERM through Popen.terminate, then waits a second
terminate = subprocess.Popen.terminate
subprocess.Popen.terminate = lambda self: graceful.append(self.pid) or terminate(self)
shutdown()
time.sleep(0.5)  # a killed process whose parent is gone is reaped by init
print(json.dumps({"kinds": kinds, "pids": len(pids), "alive": [p for p in pids if alive(p)], "graceful": graceful,
                  "connected": worker.global_worker.connected, "node": worker._global_node is None}))
"""


@pytest.mark.ray
@pytest.mark.slow
def test_a_local_ray_stops_at_once_with_every_process_below_it(tmp_path):
    """`launch.raycluster.shutdown` on the local Ray `connect` started (SIGTERM blocked in its processes): every
    process of it and below it (agents, idle workers) is gone, the process is disconnected, and no process was sent
    Ray's graceful SIGTERM, which those processes ignore: each would wait out its second before the SIGKILL."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run([sys.executable, "-c", STOP_A_LOCAL_RAY], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"raylet", "gcs_server", "dashboard"} <= set(out["kinds"]) and out["pids"] >= 6, out
    assert out["alive"] == [] and not out["connected"] and out["node"], out
    assert out["graceful"] == [], out


def test_the_mlflow_ui_reads_the_view_state_tags_mlflow_views_writes():
    import mlflow

    from dashboards.mlflow_views import TAG_EXPERIMENT_KIND, VIEW_TAG_PREFIX

    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    text = "".join(p.read_text(errors="replace") for p in bundle.glob("*.js"))
    assert VIEW_TAG_PREFIX in text and TAG_EXPERIMENT_KIND in text


# -- Tune's experiment state, read without Ray (launch.verify.experiment_trials) ------------------------------------
class _OpensAFile:
    """Unpickling this opens (creates) `path`: a stand-in for a pickle that runs code when it is loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _epochs(n: int, first: float = 90.0) -> list[dict]:
    return [{"epoch": e, "val/CIDEr": first + e, "train/loss": 3.0 / e, "stage": "xe", "done": False,
             "nan_metric": float("nan")} for e in range(1, n + 1)]


def _experiment(folder: Path) -> list:
    """An experiment of the trials `experiment_trials` must read as Ray does: finished, RUNNING (saved; read back
    PENDING), ERROR with its error file, ERROR whose error file is gone, retried, never started, a custom name and
    an `env` key (both change Tune's trial name)."""
    from tests.tunestate import experiment_storage, save_experiment_state, tune_trial

    storage = experiment_storage(folder)
    trials = [
        tune_trial(storage, "aaaa0001", {"fusion": "none", "seed": 0}, 1, results=_epochs(3)),
        tune_trial(storage, "aaaa0002", {"fusion": "gate", "lambda": 0.05, "seed": 0}, 2, status="RUNNING",
                   results=_epochs(2)),
        tune_trial(storage, "aaaa0003", {"fusion": "max", "lambda": 0.05, "seed": 0}, 3, status="ERROR",
                   results=_epochs(1), failures=2, error="Traceback (most recent call last):\n  ...\n"
                   "a2core.errors.TrainingDiverged: training diverged at epoch 2 step 20: train/loss is nan"),
        tune_trial(storage, "aaaa0004", {"fusion": "max", "lambda": 0.1, "seed": 1}, 4, status="ERROR",
                   failures=1, error="lost"),
        tune_trial(storage, "aaaa0005", {"fusion": "none", "seed": 1}, 5, results=_epochs(3, 80.0), failures=1),
        tune_trial(storage, "aaaa0006", {"fusion": "gate", "lambda": 0.02, "seed": 1}, 6, status="PENDING",
                   started=False),
        tune_trial(storage, "aaaa0007", {"fusion": "none", "seed": 2, "env": "a/b"}, 7, results=_epochs(1)),
    ]
    (folder / trials[3].relative_logdir / "error.txt").unlink()  # gone with its node
    custom = tune_trial(storage, "aaaa0008", {"fusion": "none", "seed": 3}, 8, results=_epochs(1))
    custom.custom_trial_name = "my-trial"
    trials.append(custom)
    # an older state first: Ray reads the newest by the time stamp in the name
    save_experiment_state(folder, trials[:2], stamp="2026-11-27_09-59-59")
    save_experiment_state(folder, trials, runner_data={"_session_str": "x", "callback": lambda: None})
    return trials


def test_tunes_experiment_state_reads_without_ray_as_experiment_analysis_reads_it(tmp_path):
    from ray.tune import ExperimentAnalysis

    from launch.conclusions import tune_trial
    from launch.storage import Location
    from launch.verify import experiment_trials

    folder = tmp_path / "st" / "exp"
    _experiment(folder)
    expected = [tune_trial(t) for t in ExperimentAnalysis(str(folder)).trials]
    read = experiment_trials(Location(str(folder)))
    assert read == expected
    # what the experiment above is made to hold, so that the equality covers it
    by_id = {t.trial_id: t for t in read}
    assert [t.trial_id for t in read] == [f"aaaa000{i}" for i in range(1, 9)]
    assert by_id["aaaa0002"].state == "PENDING" and by_id["aaaa0006"].state == "PENDING"
    assert by_id["aaaa0003"].state == "ERROR" and by_id["aaaa0003"].retries == 2
    assert by_id["aaaa0003"].error == ("a2core.errors.TrainingDiverged: training diverged at epoch 2 step 20: "
                                       "train/loss is nan")
    assert by_id["aaaa0004"].error is None and by_id["aaaa0005"].retries == 1
    assert by_id["aaaa0001"].name == "a2_local_trial_aaaa0001" and by_id["aaaa0007"].name == "a2_local_trial_a_b_aaaa0007"
    assert by_id["aaaa0008"].name == "my-trial"
    assert by_id["aaaa0001"].last_result["epoch"] == 3 and by_id["aaaa0006"].last_result == {"trial_id": "aaaa0006"}
    assert by_id["aaaa0001"].sampled == {"fusion": "none", "seed": 0}


def test_tunes_experiment_state_reads_the_same_from_s3(tmp_path, s3_endpoint):
    from launch.storage import Location
    from launch.verify import experiment_trials
    from tests.s3server import unique_bucket

    import boto3

    folder = tmp_path / "st" / "exp"
    _experiment(folder)
    bucket = unique_bucket(s3_endpoint)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    for path in (p for p in folder.rglob("*") if p.is_file()):
        client.put_object(Bucket=bucket, Key=f"studies/exp/{path.relative_to(folder).as_posix()}", Body=path.read_bytes())
    on_s3 = Location(f"s3://{bucket}/studies/exp", s3_endpoint)
    assert experiment_trials(on_s3) == experiment_trials(Location(str(folder)))
    assert experiment_trials(on_s3)[2].error.startswith("a2core.errors.TrainingDiverged")


def test_tunes_pickles_in_the_experiment_state_are_never_loaded(tmp_path):
    """A value Tune pickled into a trial's last result is left out, not loaded; one in a field a trial is made of
    (its config) refuses the file, naming it; the pickles elsewhere (the trial's storage, checkpoint manager, the
    runner's data) are not looked at."""
    from a2core.errors import StudyError
    from launch.storage import Location
    from launch.verify import experiment_trials
    from tests.tunestate import experiment_storage, save_experiment_state, tune_trial

    folder, marker = tmp_path / "st" / "exp", tmp_path / "loaded"
    storage = experiment_storage(folder)
    trial = tune_trial(storage, "bbbb0001", {"fusion": "none", "seed": 0}, 1, results=_epochs(2))
    trial.run_metadata.last_result["odd"] = _OpensAFile(str(marker))
    trial.run_metadata.last_result["odd_list"] = [1, _OpensAFile(str(marker)), {"x": _OpensAFile(str(marker))}]
    path = save_experiment_state(folder, [trial], runner_data={"poison": _OpensAFile(str(marker))})
    assert '"CLOUDPICKLE_FALLBACK"' in path.read_text()
    (read,) = experiment_trials(Location(str(folder)))
    assert "odd" not in read.last_result and read.last_result["epoch"] == 2
    assert read.last_result["odd_list"] == [1, {}]
    assert not marker.exists()

    trial.config["seed"] = _OpensAFile(str(marker))
    trial.invalidate_json_state()
    path = save_experiment_state(folder, [trial], stamp="2026-11-27_10-00-01")
    with pytest.raises(StudyError) as err:
        experiment_trials(Location(str(folder)))
    assert str(path) in str(err.value) and "pickled" in str(err.value) and "config" in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("damage, says", [
    (lambda text: text[: len(text) // 2], "not a readable Tune experiment state"),
    (lambda text: "[]", "no trial_data list"),
    (lambda text: json.dumps({"trial_data": [["{}"]]}), "trial_data[0] is not a [trial state, run metadata] pair"),
    (lambda text: json.dumps({"trial_data": [[json.dumps({"trial_id": 7}), "{}"]]}), "trial_data[0] trial_id is int"),
    (lambda text: text.replace('\\"TERMINATED\\"', '\\"DONE\\"'), "trial_data[0] status is 'DONE'"),
])
def test_an_unreadable_experiment_state_is_refused_naming_the_file(tmp_path, damage, says):
    from a2core.errors import StudyError
    from launch.storage import Location
    from launch.verify import experiment_trials
    from tests.tunestate import experiment_storage, save_experiment_state, tune_trial

    folder = tmp_path / "st" / "exp"
    path = save_experiment_state(folder, [tune_trial(experiment_storage(folder), "cccc0001", {"seed": 0}, 1,
                                                     results=_epochs(1))])
    whole = path.read_text()
    path.write_text(damage(whole))
    with pytest.raises(StudyError) as err:
        experiment_trials(Location(str(folder)))
    assert str(err.value).startswith(f"{path}: not a readable Tune experiment state") and says in str(err.value)
    assert "restore the file from a copy" in str(err.value)
    # with its whole copy kept while the study ran (`WholeCopies`), the line says how to put it back
    (folder / "state-copies").mkdir()
    (folder / "state-copies" / path.name).write_text(whole)
    with pytest.raises(StudyError) as err:
        experiment_trials(Location(str(folder)))
    assert f"a whole copy of it is at {folder / 'state-copies' / path.name}" in str(err.value)
    assert "`a2 study resume exp --restore-state` puts it back" in str(err.value)


def test_no_experiment_state_yet_is_none(tmp_path):
    from launch.storage import Location
    from launch.verify import experiment_trials

    assert experiment_trials(Location(str(tmp_path / "nothing"))) is None
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "search_gen_state-2026-11-27_10-00-00.json").write_text("{}")
    assert experiment_trials(Location(str(tmp_path / "st"))) is None
