"""MLflow as an export of the study's record (`launch.mlflow_export`): a study folder written as trials write it,
exported once, again, cut short, while the server is down and by `a2 mlflow sync`: every (run, key, step) once,
params and tags set, run statuses true to the study."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import launch.mlflow_export as export_mod
from dashboards.compare import study_comparison
from dashboards.runs import Study
from a2core.errors import StudyError
from dashboards.tracking import study_runs
from launch.tracking_writer import StudyTracker
from launch.commands import study
from launch.record import StudyRecord
from launch.location import StudyLocation
from launch.mlflow_export import Export, StudyExporter, end_reason
from launch.conclusions import tune_trial
from launch.layout import STOPPED_FILE, outage_line
from launch.commands.pipeline import conclusion
from launch.spec import load_study
from tests.repo_scripts import load_script

SMOKE = Path(__file__).resolve().parents[1] / "studies" / "smoke.yaml"
IDS = list(range(10, 40))


@pytest.fixture
def spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # SQLite stores keep their artifacts under ./mlruns
    return load_study(SMOKE, [f"tracking.mlflow_uri=sqlite:///{tmp_path / 'm.db'}", f"storage={tmp_path / 'st'}",
                              "train.xe_epochs=3", f"data.root={tmp_path / 'data'}"], check_files=False)


class FakeTrial:  # what Export reads of a Tune trial
    def __init__(self, trial_id, config, status="RUNNING"):
        self.trial_id, self.config, self.status, self.num_failures = trial_id, config, status, 0

    def __str__(self):
        return f"a2_local_trial_{self.trial_id}"

    def get_error(self):
        return "Traceback ...\nRuntimeError: out of memory"


def write_epoch(location: StudyLocation, trial: FakeTrial, epoch: int, value: float) -> None:
    """An epoch's result and artifacts, as `launch.trainable.TrialRecorder` leaves them in the trial's folder."""
    folder = location.at("trials", f"{location.name}-{trial.trial_id}")
    results = json.loads(folder.join("results.json").read_text() or "[]")
    checkpoint = folder.join(f"checkpoint_epoch{epoch:04d}").uri  # stored before the result is (a folder per epoch)
    folder.join(f"checkpoint_epoch{epoch:04d}", "checkpoint.pt").write_text(f"weights of epoch {epoch}")
    results.append({"epoch": epoch, "val/CIDEr": value, "train/loss": 3.0 / epoch, "stage": "xe",
                    "timestamp": 1000.0 + epoch, "training_iteration": epoch, "checkpoint_path": checkpoint})
    folder.join("results.json").write_text(json.dumps(results))
    folder.join("artifacts", f"samples/epoch_{epoch:03d}.txt").write_text(f"{epoch}: a dog\n")
    folder.join("artifacts", f"samples/.epoch_{epoch + 1:03d}.txt.x1y2.tmp").write_text("half wri")  # being written
    if value >= max(r["val/CIDEr"] for r in results):
        scores = {str(i): value + i % 7 for i in IDS}
        folder.join("artifacts", "eval/per_image_cider.json").write_text(json.dumps(scores, sort_keys=True))


def trials_of(location, values: dict[str, list[float]], statuses: dict[str, str]) -> list[FakeTrial]:
    trials = []
    for n, (tid, per_epoch) in enumerate(values.items()):
        fusion = "none" if n % 2 == 0 else "gate"
        trial = FakeTrial(tid, {"fusion": fusion, "seed": n // 2, **({"lambda": 0.035} if fusion == "gate" else {})},
                          statuses.get(tid, "TERMINATED"))
        for epoch, value in enumerate(per_epoch, 1):
            write_epoch(location, trial, epoch, value)
        trials.append(trial)
    return trials


def points(uri: str, study_name: str) -> dict:
    """{trial id: {key: Counter(step)}} over the study's trial runs."""
    client = MlflowClient(uri)
    _, children = study_runs(uri, study_name)
    return {run.data.tags["a2.trial_id"]: {key: Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
                                           for key in run.data.metrics} for run in children}


def runs_by_trial(uri: str, name: str):
    parent, children = study_runs(uri, name)
    return parent, {run.data.tags["a2.trial_id"]: run for run in children}


@pytest.mark.slow
def test_export_is_the_record_in_mlflow_and_exporting_again_changes_nothing(spec):
    location = StudyLocation(spec.name, spec.storage)
    uri = spec.tracking.mlflow_uri
    trials = trials_of(location, {"t0": [10.0, 30.0, 20.0], "t1": [12.0, 25.0, 33.0]}, {"t1": "RUNNING"})
    states = [tune_trial(t) for t in trials]
    Export(spec, location).run(states)  # while the study runs
    parent, runs = runs_by_trial(uri, spec.name)
    assert parent.info.status == "RUNNING" and parent.data.params["search.metric"] == "val/CIDEr"
    assert parent.data.tags["a2.storage"] == location.uri()
    assert {tid: run.info.status for tid, run in runs.items()} == {"t0": "FINISHED", "t1": "RUNNING"}
    t0 = runs["t0"]
    # names a person reads: the searched keys that apply (no lambda for fusion none) and the seed; Tune's in a tag
    t1 = runs["t1"]
    assert t0.info.run_name == "none seed=0" and t1.info.run_name == "gate lambda=0.035 seed=0"
    assert t0.data.tags["a2.ray_trial_name"] == "a2_local_trial_t0"
    assert t1.data.tags["a2.config"] == f"gate lambda=0.035 ({t1.data.tags['a2.config_hash'][:12]})"
    assert t0.data.tags["a2.config"] == f"none ({t0.data.tags['a2.config_hash'][:12]})"
    assert t0.data.tags["a2.fusion"] == "none"
    assert t0.data.params["model.fusion"] == "none" and "model.lambda" not in t0.data.params
    assert t0.data.tags["a2.best_checkpoint"].endswith("checkpoint_epoch0002/checkpoint.pt")
    assert t0.data.tags["a2.checkpoint"].endswith("checkpoint_epoch0003/checkpoint.pt")
    assert "training_iteration" not in t0.data.metrics and "stage" not in t0.data.metrics
    client = MlflowClient(uri)
    history = client.get_metric_history(t0.info.run_id, "val/CIDEr")
    assert sorted((m.step, m.value, m.timestamp) for m in history) == [
        (1, 10.0, 1001000), (2, 30.0, 1002000), (3, 20.0, 1003000)]
    saved = json.loads(open(client.download_artifacts(t0.info.run_id, "eval/per_image_cider.json")).read())
    assert saved == {str(i): 30.0 + i % 7 for i in IDS}  # the best epoch's
    assert [a.path for a in client.list_artifacts(t0.info.run_id, "samples")] == [
        "samples/epoch_001.txt", "samples/epoch_002.txt", "samples/epoch_003.txt"]

    trials[1].status = "TERMINATED"
    again = Export(spec, location)  # a new driver, or `a2 mlflow sync`
    again.run([tune_trial(t) for t in trials], end_reason(spec.name))
    again.run([tune_trial(t) for t in trials], end_reason(spec.name))
    parent, runs = runs_by_trial(uri, spec.name)
    assert parent.info.status == "KILLED"  # 2 of the study's 4 trials: it can resume
    assert {tid: run.info.status for tid, run in runs.items()} == {"t0": "FINISHED", "t1": "FINISHED"}
    assert all(n == 1 for keys in points(uri, spec.name).values() for steps in keys.values() for n in steps.values())
    assert points(uri, spec.name)["t1"]["val/CIDEr"] == {1: 1, 2: 1, 3: 1}


@pytest.mark.slow
def test_statuses_follow_the_study_failed_killed_and_stopped_early(spec):
    location = StudyLocation(spec.name, spec.storage)
    uri = spec.tracking.mlflow_uri
    trials = trials_of(location, {"t0": [10.0, 30.0, 31.0], "t1": [12.0, 13.0], "t2": [9.0, 8.0], "t3": [5.0],
                                  "t4": [7.0]},
                       {"t1": "ERROR", "t2": "TERMINATED", "t3": "PENDING", "t4": "TERMINATED"})
    folder = location.at("trials", f"{spec.name}-t2")
    folder.join(STOPPED_FILE).write_text(json.dumps({"rung": 2, "cutoff": 20.5, "group_mean": 8.0, "threshold": 1}))
    Export(spec, location).run([tune_trial(t) for t in trials], end_reason(spec.name, "SIGINT"))
    parent, runs = runs_by_trial(uri, spec.name)
    assert parent.info.status == "FAILED" and parent.data.tags["a2.end_reason"] == "a trial failed"
    # t3: Tune saved it part way (PENDING: a resume starts it again); t4: Tune ended it short without the scheduler's
    # record (a driver killed before writing it): the record's rule, only the scheduler ends a trial short
    assert {tid: run.info.status for tid, run in runs.items()} == {
        "t0": "FINISHED", "t1": "FAILED", "t2": "FINISHED", "t3": "KILLED", "t4": "FINISHED"}
    assert runs["t4"].data.tags["a2.stopped_early"] == "true" and "a2.stopped_rung" not in runs["t4"].data.tags
    assert runs["t1"].data.tags["a2.end_reason"].startswith("RuntimeError: out of memory")
    assert runs["t3"].data.tags["a2.end_reason"] == (
        f"interrupted by SIGINT; continue with `a2 study resume {spec.name}`")
    tags = runs["t2"].data.tags
    assert (tags["a2.stopped_early"], tags["a2.stopped_rung"], tags["a2.stopped_cutoff"]) == ("true", "2", "20.5")
    record = {t.trial_id: t for t in StudyRecord.load(location, spec, trials=[tune_trial(t) for t in trials]).trials}
    assert record["t2"].stopped_early == {"rung": 2, "cutoff": 20.5}  # `status` reads the record, the export its tags
    assert {tid: run.info.status for tid, run in runs.items()} == {tid: t.status for tid, t in record.items()}
    assert runs["t0"].data.tags["a2.config_hash"] != runs["t1"].data.tags["a2.config_hash"]
    assert runs["t0"].data.tags["a2.config_hash"] == runs["t2"].data.tags["a2.config_hash"]  # replicates
    # one label per replicate group: the UI's configurations view groups by it
    assert runs["t0"].data.tags["a2.config"] == runs["t2"].data.tags["a2.config"] != runs["t1"].data.tags["a2.config"]
    assert [runs[t].info.run_name for t in ("t0", "t1", "t2", "t3")] == [
        "none seed=0", "gate lambda=0.035 seed=0", "none seed=1", "gate lambda=0.035 seed=1"]

    folder.join(STOPPED_FILE).write_text("{rung: 2")  # garbage: refused naming the file, by status and export
    with pytest.raises(StudyError, match=f"{STOPPED_FILE}: not a stop record"):
        StudyRecord.load(location, spec, trials=[tune_trial(t) for t in trials])
    with pytest.raises(StudyError, match=f"{STOPPED_FILE}: not a stop record"):
        Export(spec, location).run([tune_trial(t) for t in trials])
    folder.join(STOPPED_FILE).write_text(json.dumps({"rung": 2, "cutoff": 20.5}))

    trials[1].status, trials[3].status = "RUNNING", "RUNNING"  # resumed: the runs continue, RUNNING again
    Export(spec, location).run([tune_trial(t) for t in trials])
    parent, runs = runs_by_trial(uri, spec.name)
    assert parent.info.status == "RUNNING" and runs["t3"].info.status == "RUNNING"
    assert runs["t0"].info.status == "FINISHED"  # a finished run is left as it is


@pytest.mark.slow
def test_an_export_cut_short_goes_on_without_duplicates(spec, monkeypatch):
    location = StudyLocation(spec.name, spec.storage)
    uri = spec.tracking.mlflow_uri
    trials = trials_of(location, {"t0": [10.0, 30.0, 20.0], "t1": [12.0, 25.0, 33.0]}, {})
    calls = {"n": 0}
    real = StudyTracker.log_epochs

    def dies_part_way(self, run_id, epochs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second trial's batch: a request of its first two epochs went through, then none
            real(self, run_id, epochs[:2])
            raise ConnectionError("server gone")
        return real(self, run_id, epochs)

    monkeypatch.setattr(StudyTracker, "log_epochs", dies_part_way)
    with pytest.raises(ConnectionError):
        Export(spec, location).run([tune_trial(t) for t in trials], end_reason(spec.name))
    assert calls["n"] == 2
    monkeypatch.setattr(StudyTracker, "log_epochs", real)
    Export(spec, location).run([tune_trial(t) for t in trials], end_reason(spec.name))
    parent, runs = runs_by_trial(uri, spec.name)
    assert points(uri, spec.name) == {tid: {"val/CIDEr": Counter({1: 1, 2: 1, 3: 1}),
                                            "train/loss": Counter({1: 1, 2: 1, 3: 1})} for tid in ("t0", "t1")}
    assert parent.info.status == "KILLED" and {r.info.status for r in runs.values()} == {"FINISHED"}


@pytest.mark.slow
def test_the_export_thread_waits_out_a_server_that_is_down(spec, monkeypatch):
    location = StudyLocation(spec.name, spec.storage)
    uri = spec.tracking.mlflow_uri
    trials = trials_of(location, {"t0": [10.0], "t1": [12.0]}, {"t0": "RUNNING", "t1": "RUNNING"})
    up = {"now": True}
    monkeypatch.setattr(export_mod, "server_answers", lambda uri, timeout=2.0: up["now"])
    exporter = StudyExporter(Export(spec, location), lambda: trials, every=3600)  # no periodic export here
    exporter.poke()  # what the callback's hooks do: the thread exports at once
    for _ in range(200):
        if exporter.done:
            break
        time.sleep(0.1)
    assert exporter.done and set(runs_by_trial(uri, spec.name)[1]) == {"t0", "t1"}
    up["now"] = False
    for trial in trials:
        write_epoch(location, trial, 2, 20.0)
    assert not exporter.once()
    assert exporter.status()["pending"] and "not all exported yet" in outage_line(exporter.status())
    up["now"] = True
    for trial in trials:
        write_epoch(location, trial, 3, 30.0)
        trial.status = "TERMINATED"
    outage = exporter.close(end_reason(spec.name))
    assert outage["exported_late"] == 4 and not outage["pending"] and outage["down_seconds"] > 0
    assert outage_line(outage).endswith("4 epochs exported once it was back")
    assert json.loads(location.read_text("tracking", "outage.json"))["exported_late"] == 4  # for summary.json
    parent, runs = runs_by_trial(uri, spec.name)
    assert {r.info.status for r in runs.values()} == {"FINISHED"}
    assert points(uri, spec.name)["t0"]["val/CIDEr"] == {1: 1, 2: 1, 3: 1}


@pytest.mark.slow
def test_mlflow_sync_exports_a_study_that_ended_while_the_server_was_down(spec, monkeypatch, capsys):
    location = StudyLocation(spec.name, spec.storage)
    uri = spec.tracking.mlflow_uri
    trials = trials_of(location, {"t0": [10.0, 30.0, 20.0], "t1": [12.0, 25.0, 33.0]}, {})
    location.write_text(json.dumps({"study": spec.name, "tracking": {}}), "summary.json")
    export_mod.add_outage(location, down_seconds=12.0, pending=True)  # the driver's last export did not get through
    monkeypatch.setattr(study, "locate", lambda name, storage=None: location)
    monkeypatch.setattr(study, "load_saved_spec", lambda loc: spec)
    monkeypatch.setattr(study, "tune_trials", lambda loc: [tune_trial(t) for t in trials])
    assert study.cmd_sync(argparse.Namespace(name=spec.name, storage=None)) == 0
    assert "exported to MLflow; tracking: server down 12 s, 0 epochs exported once it was back" in \
        capsys.readouterr().out
    assert json.loads(location.read_text("summary.json"))["tracking"]["pending"] is False
    parent, runs = runs_by_trial(uri, spec.name)
    assert {r.info.status for r in runs.values()} == {"FINISHED"} and len(runs) == 2
    assert points(uri, spec.name)["t1"]["val/CIDEr"] == {1: 1, 2: 1, 3: 1}


@pytest.mark.slow
def test_best_epochs_per_image_cider_is_the_artifact_compare_pairs(spec):
    location = StudyLocation(spec.name, spec.storage)
    uri = spec.tracking.mlflow_uri
    trials = []
    for fusion, lift in (("none", 0.0), ("gate", 5.0)):
        for seed in range(3):
            trial = FakeTrial(f"{fusion}{seed}", {"fusion": fusion, "seed": seed}, "TERMINATED")
            folder = location.at("trials", f"{spec.name}-{trial.trial_id}")
            scores = {str(i): 100.0 + lift + (i % 7) + seed for i in IDS}
            folder.join("results.json").write_text(json.dumps([{"epoch": e, "val/CIDEr": 100.0} for e in (1, 2, 3)]))
            folder.join("artifacts", "eval/per_image_cider.json").write_text(json.dumps(scores))
            trials.append(trial)
    states = [tune_trial(t) for t in trials]
    Export(spec, location).run(states, end_reason(spec.name))
    record = StudyRecord.load(location, spec, trials=states)
    comparison, _, _ = study_comparison(record.study(), by="fusion")
    diff = comparison.differences["gate"]
    assert diff.images == len(IDS) and diff.delta == pytest.approx(5.0)
    assert diff.verdict().startswith("gate beats none by 5.0 val CIDEr [") and diff.verdict().endswith(
        "3 seeds x 30 images")
    # the record's per-image scores are the artifact the export uploaded
    run = runs_by_trial(uri, spec.name)[1]["gate1"]
    uploaded = Path(MlflowClient(uri).download_artifacts(run.info.run_id, "eval/per_image_cider.json"))
    assert json.loads(uploaded.read_text()) == record.per_image("gate1")
    # `a2 pipeline` ends with these verdicts, then the ensemble's gain from the leaderboard
    gain = "ensemble beats seed-1 by 4.2 CIDEr [2.0, 6.3], 1 seed x 30 images"
    assert conclusion(record.study(), {"ensemble_gain": {"verdict": gain}}) == [diff.verdict(), gain]
    assert conclusion(Study("nope", []), {}) == ["no baseline (fusion none) to compare with in study nope"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_study_exported_from_its_record_alone_is_what_the_driver_exported(tmp_path, monkeypatch):
    """The smoke study of `scripts/mlflow_dump.py` (4 trials, 3 epochs), run; then its MLflow database set aside and
    `a2 mlflow sync` run: the study's storage alone gives the same runs (params, tags, metrics by step, artifacts,
    statuses). The parent's compute totals are left out of the comparison: `a2 study run` logs them when it ends,
    they are not part of the export."""
    dump = load_script("scripts/mlflow_dump.py")
    uri, root = dump.run_study(tmp_path)
    live = dump.dump(uri, dump.NAME, str(root))
    (tmp_path / "mlflow.db").rename(tmp_path / "live.db")
    sync = subprocess.run([sys.executable, "-m", "launch.cli", "mlflow", "sync", dump.NAME,
                           "--storage", str(tmp_path / "studies")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(SMOKE.parents[1])})
    assert sync.returncode == 0, sync.stdout + sync.stderr
    again = dump.dump(uri, dump.NAME, str(root))
    for result in (live, again):
        result["parent"]["metrics"] = {k: v for k, v in result["parent"]["metrics"].items()
                                       if not k.startswith("compute/")}
    assert again == live
    assert live["parent"]["status"] == "FINISHED" and {t["status"] for t in live["trials"]} == {"FINISHED"}


@pytest.mark.slow
def test_run_names_show_only_the_searched_keys_that_apply_and_old_names_are_replaced_on_export(tmp_path, spec,
                                                                                               monkeypatch):
    import yaml

    from launch.mlflow_export import trial_names

    # lambda searched for every fusion (no `when`), a model key by its path, no replicates, a seed grid; `a2 study
    # validate` now refuses lambda without `when` beside fusion none (launch.spec._check_applicable), but a study
    # saved before it did is read as it is, and its run names must still leave the key out where it does not apply
    monkeypatch.setattr("launch.spec._check_applicable", lambda space, sections: None)
    raw = yaml.safe_load(SMOKE.read_text())
    raw["search"].update(replicates=None, scheduler={"fifo": {}}, space={
        "fusion": {"grid": ["none", "gate"]}, "lambda": {"loguniform": [0.005, 0.2]},
        "model.d_model": {"grid": [32, 64]}, "seed": {"grid": [0, 1]}})
    raw["search"].pop("replicates")
    raw["model"].pop("d_model")
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    searched = load_study(tmp_path / "s.yaml", check_files=False)
    digest = "0123456789abcdef" * 4
    assert trial_names(searched, {"fusion": "gate", "lambda": 0.0123456, "model.d_model": 32, "seed": 1}, digest) == (
        "gate lambda=0.01235 d_model=32 seed=1", "gate lambda=0.01235 d_model=32 (0123456789ab)")
    # fusion none has no mask loss: its lambda does not apply and is not named
    assert trial_names(searched, {"fusion": "none", "lambda": 0.05, "model.d_model": 64, "seed": 0}, digest) == (
        "none d_model=64 seed=0", "none d_model=64 (0123456789ab)")
    # a study that searches nothing but the seed: the configuration is its hash
    raw["search"]["space"] = {"seed": {"grid": [0, 1]}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    assert trial_names(load_study(tmp_path / "s.yaml", check_files=False), {"seed": 1}, digest) == (
        "seed=1", "config 0123456789ab")

    # a run exported before runs had readable names gets its readable name at the next export (`a2 mlflow sync`)
    location = StudyLocation(spec.name, spec.storage)
    trials = trials_of(location, {"t0": [10.0]}, {})
    tracker = StudyTracker(spec.tracking.mlflow_uri, spec.name)
    tracker.start_study()
    tracker.trial_run("t0", spec.trial_config(trials[0].config), run_name="a2_local_trial_t0")
    Export(spec, location).run([tune_trial(t) for t in trials])
    _, runs = runs_by_trial(spec.tracking.mlflow_uri, spec.name)
    assert list(runs) == ["t0"] and runs["t0"].info.run_name == "none seed=0"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["max", "min"])
def test_the_export_names_the_records_best_checkpoint(tmp_path, monkeypatch, mode):
    """`a2.best_checkpoint` is the record's best checkpoint (the best epoch, by the one rule, the latest of equal
    values, that still has a stored checkpoint: what `a2 package` takes), in `max` and in `min` mode; not the best
    epoch's result's checkpoint path, which names a folder retention may have pruned."""
    from dashboards.tracking import TAG_BEST_CKPT
    from launch.layout import CHECKPOINT_FILE, TRIALS_DIR, checkpoint_name, train_run_name
    from tests.studyfolder import fabricated_study

    monkeypatch.chdir(tmp_path)  # the SQLite store keeps its artifacts under ./mlruns
    sign = 1 if mode == "max" else -1
    overrides = () if mode == "max" else ("search.metric=train/loss", "search.mode=min")
    fab = fabricated_study(tmp_path, f"best-{mode}", epochs=5, overrides=overrides)
    values = [sign * v for v in (50.0, 70.0, 70.0, 60.0, 65.0)]  # epochs 2 and 3 equal: epoch 3 is the best
    for tid, kept in (("whole", (1, 2, 3, 4, 5)), ("pruned", (2, 5))):  # "pruned": retention kept 2 and the latest
        run = fab.location.at(TRIALS_DIR, train_run_name(fab.spec.name, tid))
        for epoch in kept:
            run.join(checkpoint_name(epoch), CHECKPOINT_FILE).write_text(f"weights of epoch {epoch}")
        fab.add(tid, {"fusion": "none", "seed": 0 if tid == "whole" else 1},
                [{"epoch": e, fab.spec.metric: v, "checkpoint_path": run.join(checkpoint_name(e)).uri}
                 for e, v in enumerate(values, 1)])
    fab.export()
    record = {t.trial_id: t for t in fab.record().trials}
    _, runs = runs_by_trial(fab.spec.tracking.mlflow_uri, fab.spec.name)
    for tid, checkpoint_epoch in (("whole", 3), ("pruned", 2)):
        trial = record[tid]
        assert trial.best_step == 3 and trial.best_checkpoint_epoch == checkpoint_epoch
        assert runs[tid].data.tags[TAG_BEST_CKPT] == trial.best_checkpoint
        assert trial.best_checkpoint.endswith(f"{checkpoint_name(checkpoint_epoch)}/{CHECKPOINT_FILE}")
    assert runs["pruned"].data.tags["a2.checkpoint"].endswith(f"{checkpoint_name(5)}/{CHECKPOINT_FILE}")


@pytest.mark.slow
def test_an_export_tick_reads_only_the_trials_that_can_have_changed(spec, monkeypatch):
    """The driver exports every 2 s: a trial whose run was left ended, Tune's word on it unchanged, is not read again
    (on S3, 1,000 trials x 4 requests a tick); a running trial is read, and its new epoch exported."""
    from launch.storage import Location

    location = StudyLocation(spec.name, spec.storage)
    uri = spec.tracking.mlflow_uri
    trials = trials_of(location, {"done": [10.0, 30.0, 20.0], "live": [12.0], "todo": []},
                       {"live": "RUNNING", "todo": "PENDING"})
    reads: Counter = Counter()

    def counted(method):
        def read(self, *args, **kwargs):
            for trial in trials:
                if f"/{spec.name}-{trial.trial_id}" in self.uri:
                    reads[trial.trial_id] += 1
            return method(self, *args, **kwargs)
        return read

    for name in ("read_text", "listdir", "exists"):
        monkeypatch.setattr(Location, name, counted(getattr(Location, name)))
    export = Export(spec, location)
    export.run([tune_trial(t) for t in trials])
    assert reads["done"] > 0 and reads["todo"] > 0  # the first export reads every trial
    reads.clear()
    export.run([tune_trial(t) for t in trials])  # nothing changed
    # the running trial: its result log, stop record, end record and checkpoint folders; nothing else
    assert reads == {"live": 4}

    reads.clear()
    write_epoch(location, trials[1], 2, 22.0)  # the running trial's next epoch
    export.run([tune_trial(t) for t in trials])
    assert reads["done"] == reads["todo"] == 0
    assert points(uri, spec.name)["live"]["val/CIDEr"] == {1: 1, 2: 1}

    trials[1].status = "TERMINATED"  # it ended (Tune's state changed): read once more, then left alone
    write_epoch(location, trials[1], 3, 25.0)
    export.run([tune_trial(t) for t in trials])
    assert runs_by_trial(uri, spec.name)[1]["live"].info.status == "FINISHED"
    reads.clear()
    export.run([tune_trial(t) for t in trials])
    assert reads == {}

    # Tune ends a trial the scheduler stopped, then the driver's callback writes its stop record: until the record is
    # there, the trial is read again at every tick (its run ended, stopped early as the record says meanwhile)
    late_stop = FakeTrial("cut", {"fusion": "none", "seed": 2}, "TERMINATED")
    write_epoch(location, late_stop, 1, 5.0)
    trials.append(late_stop)
    export.run([tune_trial(t) for t in trials])
    reads.clear()
    export.run([tune_trial(t) for t in trials])
    assert set(reads) == {"cut"}
    location.at("trials", f"{spec.name}-cut").join(STOPPED_FILE).write_text(json.dumps({"rung": 1, "cutoff": 9.5}))
    export.run([tune_trial(t) for t in trials])
    assert runs_by_trial(uri, spec.name)[1]["cut"].data.tags["a2.stopped_cutoff"] == "9.5"
    reads.clear()
    export.run([tune_trial(t) for t in trials])
    assert reads == {}

    trials[0].num_failures = 1  # Tune's word on a settled trial changed: read again
    export.run([tune_trial(t) for t in trials])
    assert reads["done"] > 0 and runs_by_trial(uri, spec.name)[1]["done"].data.tags["a2.retries"] == "1"
    reads.clear()
    export.run([tune_trial(t) for t in trials], end_reason(spec.name))  # the study's end: every trial once more
    assert set(reads) == {"done", "live", "todo", "cut"}
    reads.clear()
    export.run([tune_trial(t) for t in trials], end_reason(spec.name))
    assert reads == {}
    assert all(n == 1 for keys in points(uri, spec.name).values() for steps in keys.values() for n in steps.values())


def test_a_running_trials_next_export_is_one_batch_of_its_new_epochs(spec):
    """A running trial exported again: its new epochs go in one batch, with only the tags that changed; its run is
    not searched for again (an epoch a request and a run search an export were the export's cost, in the driver's
    process with an SQLite store: `benchmarks/bench_rehearse.py`)."""
    location = StudyLocation(spec.name, spec.storage)
    trials = trials_of(location, {"live": [12.0]}, {"live": "RUNNING"})
    export = Export(spec, location)
    export.run([tune_trial(t) for t in trials])
    client, calls = export.tracker.client, []

    def spy(name, method):
        def call(*args, **kwargs):
            calls.append((name, {kind: sorted(getattr(e, "key") for e in v) for kind, v in kwargs.items()
                                 if isinstance(v, list)}))
            return method(*args, **kwargs)
        return call

    for name in ("search_runs", "create_run", "update_run", "get_run", "log_batch", "set_terminated", "delete_tag"):
        setattr(client, name, spy(name, getattr(client, name)))
    write_epoch(location, trials[0], 2, 22.0)
    write_epoch(location, trials[0], 3, 21.0)
    export.run([tune_trial(t) for t in trials])
    assert calls == [("log_batch", {"metrics": ["train/loss", "train/loss", "val/CIDEr", "val/CIDEr"]}),
                     ("log_batch", {"tags": ["a2.best_checkpoint", "a2.checkpoint"]})]
    assert points(spec.tracking.mlflow_uri, spec.name)["live"]["val/CIDEr"] == {1: 1, 2: 1, 3: 1}

    calls.clear()
    trials[0].status = "TERMINATED"
    export.run([tune_trial(t) for t in trials])  # it ended: its run ends, nothing else is written
    assert calls == [("set_terminated", {})]
    run = runs_by_trial(spec.tracking.mlflow_uri, spec.name)[1]["live"]
    assert run.info.status == "FINISHED"
    assert run.data.tags["a2.checkpoint"].endswith("checkpoint_epoch0003/checkpoint.pt")


def test_a_trial_the_saved_spec_cannot_rebuild_is_exported_under_its_configurations_digest():
    """A trial of a key the study's saved spec no longer has: the record reads it (`launch.record.table_columns`),
    and the export names its run by its configuration's digest instead of failing the whole study's export."""
    from launch.mlflow_export import trial_names
    from launch.spec import load_study
    from tests.studyfolder import SMOKE

    spec = load_study(SMOKE, [], check_files=False)
    sampled = {"fusion": "gate", "model.old_knob": 1, "seed": 0}
    assert trial_names(spec, sampled, "0123456789abcdef") == ("config 0123456789ab", "config 0123456789ab")
