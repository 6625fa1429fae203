"""`launch.record.StudyRecord`: a study's folder read into one table, its groups, its best trial and per-image
scores; the dashboards' view of it is what the MLflow export of the same folder shows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dashboards.tracking import TAG_CONFIG_HASH, TAG_STOPPED_EARLY
from dashboards.tracking import study_runs
from launch.lease import StudyLease
from launch.record import StudyRecord
from tests.studyfolder import fabricated_study

IMAGES = {"101": 80.0, "102": 120.0}


def fabricate(fab):
    for seed in (0, 1):
        fab.add(f"none{seed}", {"fusion": "none", "seed": seed},
                [{"epoch": e, "val/CIDEr": 90.0 + e + seed, "train/loss": 3.0 / e, "stage": "xe"} for e in (1, 2, 3)],
                per_image={"val": IMAGES})
        fab.add(f"gate{seed}", {"fusion": "gate", "lambda": 0.05, "seed": seed},
                [{"epoch": e, "val/CIDEr": 95.0 + e + seed} for e in (1, 2, 3)])
    # the best-looking trial, stopped by the scheduler after its first epoch: never the best while others finished
    fab.add("max0", {"fusion": "max", "lambda": 0.05, "seed": 0}, [{"epoch": 1, "val/CIDEr": 150.0}],
            stopped={"rung": 1, "cutoff": 96.0})
    fab.add("max1", {"fusion": "max", "lambda": 0.05, "seed": 1}, [{"epoch": 1, "val/CIDEr": 20.0}], status="RUNNING")
    return fab


@pytest.fixture
def fab(tmp_path):
    return fabricate(fabricated_study(tmp_path, "rec", epochs=3))


def test_each_trial_holds_its_epochs_config_group_and_stop(fab):
    trials = {t.trial_id: t for t in fab.record().trials}
    assert sum(len(t.epochs_reported) for t in trials.values()) == 4 * 3 + 2  # every epoch each trial reported
    gate1 = trials["gate1"]
    assert gate1.epochs_reported == [1, 2, 3] and gate1.history["val/CIDEr"] == [(1, 97.0), (2, 98.0), (3, 99.0)]
    assert gate1.params["model.fusion"] == "gate" and gate1.config["model"]["lambda"] == 0.05
    assert gate1.best_value == gate1.last == 99.0
    hashes = {f: {t.config_hash for t in trials.values() if t.fusion == f} for f in ("gate", "max", "none")}
    assert all(len(h) == 1 for h in hashes.values())  # the seeds of a configuration are one group
    assert trials["max0"].stopped_early and not trials["gate0"].stopped_early
    assert "stage" not in trials["none0"].final  # text results are no metrics


def test_groups_best_and_per_image(fab):
    record = fab.record()
    groups = {g["fusion"]: g for g in record.groups()}
    assert groups["gate"]["values"] == [98.0, 99.0] and groups["gate"]["mean"] == pytest.approx(98.5)  # 95 + 3 + seed
    assert groups["max"]["stopped_early"] == {"rung": 1, "cutoff": 96.0}
    assert record.best()["trial_id"] == "gate1"  # not max0: the scheduler stopped it
    assert record.summary()["best_group"]["trials"] == ["gate0", "gate1"]
    assert record.per_image("none0") == IMAGES and record.per_image("gate0") is None


@pytest.mark.slow
def test_the_dashboards_view_is_the_mlflow_export_of_the_same_folder(fab):
    """params, tags, final metrics and statuses of the record's runs are those of the exported MLflow runs."""
    fab.export()
    runs = {r.trial_id: r for r in fab.record().study().runs}
    _, children = study_runs(fab.spec.tracking.mlflow_uri, fab.spec.name)
    assert len(children) == len(runs) == 6
    for child in children:
        run = runs[child.data.tags["a2.trial_id"]]
        assert run.params == child.data.params
        assert run.final == child.data.metrics
        assert run.status == child.info.status
        assert {k: v for k, v in run.tags.items() if k in child.data.tags} == run.tags
    assert runs["max1"].status == "KILLED" and runs["max0"].status == "FINISHED"
    assert runs["max0"].tags[TAG_STOPPED_EARLY] == "true"
    assert runs["gate0"].tags[TAG_CONFIG_HASH] == runs["gate1"].tags[TAG_CONFIG_HASH]
    assert runs["none1"].best_value == 94.0 and runs["none1"].best_step == 3


def test_a_trial_of_a_study_with_a_live_writer_is_running(fab):
    with StudyLease(fab.location.at()).held():
        study = fab.record().study()
    assert study.running and {r.trial_id: r.status for r in study.runs}["max1"] == "RUNNING"
    assert not fab.record().study().running


@pytest.mark.slow
def test_a_study_on_s3_reads_the_same(tmp_path, s3_endpoint, monkeypatch):
    """The record reads through the storage layer: a study in a bucket gives the same groups, best and scores."""
    from tests.s3server import unique_bucket

    bucket = unique_bucket(s3_endpoint)
    on_s3 = fabricate(fabricated_study(tmp_path / "s3", "rec", epochs=3, overrides=(
        f"storage=s3://{bucket}/studies", f"storage_endpoint_url={s3_endpoint}"))).record(for_digest=True)
    local = fabricate(fabricated_study(tmp_path / "local", "rec", epochs=3)).record()
    assert on_s3.location.uri().startswith("s3://")
    assert [g["values"] for g in on_s3.groups()] == [g["values"] for g in local.groups()]
    assert on_s3.best()["trial_id"] == "gate1" and on_s3.per_image("none0") == IMAGES
    def columns(record):
        return [(t.trial_id, t.history, t.best_value, t.stopped_early, t.fusion) for t in record.trials]

    assert columns(on_s3) == columns(local)
    on_s3.save_digest()  # one listing a trial on S3: every trial from the digest, as read from its files
    monkeypatch.setattr("launch.record.record_trial", lambda *a, **k: pytest.fail("read a trial's files"))
    assert _view(StudyRecord.load(on_s3.location, on_s3.spec, trials=list(on_s3.trials))) == _view(on_s3)


def test_status_shows_a_trial_tune_saved_as_pending_as_running_while_a_writer_holds_the_study(fab, monkeypatch, capsys):
    """Tune saves a running trial as PENDING (so that a resume starts it again). `a2 study status` of a study whose
    writer is alive shows such a trial, one that has reported epochs, as RUNNING; of a study nobody runs, as Tune
    saved it. A trial that has not started stays PENDING either way."""
    from launch.cli import main

    fab.add("max2", {"fusion": "max", "lambda": 0.05, "seed": 2}, [{"epoch": 1, "val/CIDEr": 30.0}], status="PENDING")
    fab.add("max3", {"fusion": "max", "lambda": 0.05, "seed": 3}, [], status="PENDING")
    fab.patch_tune(monkeypatch)

    def states() -> dict[str, str]:
        assert main(["study", "status", "rec", "--storage", str(fab.spec.storage)]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        return {row[0]: row[4] for row in rows if row and row[0] in ("max2", "max3", "gate0")}

    with StudyLease(fab.location.at()).held():
        assert states() == {"max2": "RUNNING", "max3": "PENDING", "gate0": "TERMINATED"}
    assert states() == {"max2": "PENDING", "max3": "PENDING", "gate0": "TERMINATED"}
    assert [t["state"] for t in fab.record().trials if t["trial_id"] == "max2"] == ["PENDING"]  # the record: Tune's


@pytest.mark.parametrize("garbage", [b"\x80\x04garbage", b"", b'{"epoch": 1}'], ids=["binary", "empty", "not-a-list"])
def test_status_refuses_an_unreadable_result_log_naming_it_as_it_reads_it(fab, monkeypatch, capsys, garbage):
    """`a2 study status` checks each trial's result log in its one read of the record (not in a second pass over
    every trial's folder): a log that is not a JSON list is refused, exit 2, naming the file, nothing printed of the
    table. Readers that go on with a study (the MLflow export, the driver's summary) read such a log as empty."""
    from launch.cli import main
    from launch.layout import RESULTS_FILE, TRIALS_DIR, train_run_name

    log = fab.location.at(TRIALS_DIR, train_run_name("rec", "gate1"), RESULTS_FILE)
    log.write_text(garbage)
    fab.patch_tune(monkeypatch)
    capsys.readouterr()
    assert main(["study", "status", "rec", "--storage", str(fab.spec.storage)]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert f"{log.uri}: unreadable" in text and "status refused, nothing was run or changed" in text
    assert "gate0" not in out.out  # no table before the refusal
    (gate1,) = [t for t in fab.record().trials if t["trial_id"] == "gate1"]
    assert gate1["epochs_reported"] == [] and gate1["best"] is None


def _view(record) -> list[tuple]:
    """Every field of every trial a read gives, its MLflow status included."""
    from launch.record import DIGEST_FIELDS

    return [({name: getattr(t, name) for name in DIGEST_FIELDS}, t.status) for t in record.trials]


def _reads(monkeypatch) -> list[str]:
    """The trials `StudyRecord.load` reads from their files from now on (not from the digest)."""
    import launch.record

    read, calls = launch.record.record_trial, []

    def counted(spec, location, tune, *args, **kwargs):
        calls.append(tune.trial_id)
        return read(spec, location, tune, *args, **kwargs)

    monkeypatch.setattr(launch.record, "record_trial", counted)
    return calls


def test_a_read_takes_each_unchanged_trial_from_the_digest_and_reads_each_changed_one(fab, monkeypatch):
    """The driver's digest (`StudyRecord.save_digest`, `record-digest.json`): a later read gives every field of every
    trial as a read of the files does, reading none of them; a trial whose files changed (a result log rewritten, a
    stop record deleted by hand) is read again, alone; a copy of the study elsewhere, a changed study file, or a digest
    that does not read, leaves every trial to its files."""
    import os
    import shutil

    from launch.layout import RESULTS_FILE, STOPPED_FILE, TRIALS_DIR, train_run_name
    from launch.location import DIGEST_FILE, STUDY_FILE, StudyLocation

    fresh = fab.record(for_digest=True)
    fresh.save_digest()
    reads = _reads(monkeypatch)
    assert _view(fab.record()) == _view(fresh) and reads == []
    with StudyLease(fab.location.at()).held():  # a live writer: the unfinished trial's run is RUNNING, not KILLED
        assert {t.trial_id: t.status for t in fab.record().trials}["max1"] == "RUNNING" and reads == []

    run = fab.location.at(TRIALS_DIR, train_run_name("rec", "gate1"))
    run.join(RESULTS_FILE).write_text(json.dumps([{"epoch": e, "val/CIDEr": 95.0 + 2 * e} for e in (1, 2, 3, 4)]))
    fab.location.at(TRIALS_DIR, train_run_name("rec", "max0"), STOPPED_FILE).delete()
    changed = fab.record()
    assert sorted(reads) == ["gate1", "max0"]
    trials = {t.trial_id: t for t in changed.trials}
    assert trials["gate1"].best_value == 103.0 and trials["gate1"].epochs_reported == [1, 2, 3, 4]
    assert trials["max0"].stopped_early == {"rung": None, "cutoff": None}  # cut short, its record gone: rung unknown
    assert _view(changed) == _view(_without_digest(fab))

    fab.record(for_digest=True).save_digest()
    reads.clear()  # a copy elsewhere with its files' times (cp -a): its trials' paths are the copy's
    shutil.copytree(fab.location.at().uri, Path(fab.location.at().uri).parent.parent / "copy" / "rec")
    copy = StudyLocation("rec", str(Path(fab.location.at().uri).parent.parent / "copy"))
    moved = StudyRecord.load(copy, fab.spec, trials=list(fab.trials))
    assert len(reads) == 6 and all(t.train_run.startswith(copy.at().uri) for t in moved.trials)
    reads.clear()
    study_file = fab.location.at(STUDY_FILE).uri
    os.utime(study_file, ns=(os.stat(study_file).st_atime_ns, os.stat(study_file).st_mtime_ns + 10**9))
    fab.record()
    assert len(reads) == 6  # the study file changed: no trial from the digest
    fab.record(for_digest=True).save_digest()
    digest = json.loads(fab.location.read_text(DIGEST_FILE))
    for entry, broken in zip(digest["trials"], ("files", "row", "history", "logged", "files", "row")):
        entry[broken] = {"files": 7, "row": {"trial_id": entry["row"]["trial_id"]}, "history": [3],
                         "logged": "many"}[broken]
    for garbage in ("{not json", "[]", '{"format": 1, "trials": [{"row": 3}]}', json.dumps(digest)):
        fab.location.write_text(garbage, DIGEST_FILE)
        reads.clear()
        assert _view(fab.record()) == _view(_without_digest(fab)) and len(reads) == 12


def _without_digest(fab):
    from launch.location import DIGEST_FILE

    saved = fab.location.read_text(DIGEST_FILE)
    fab.location.at(DIGEST_FILE).delete()
    try:
        return fab.record()
    finally:
        if saved is not None:
            fab.location.write_text(saved, DIGEST_FILE)


def test_tunes_word_on_the_trials_comes_from_the_digest_while_its_experiment_state_is_the_same(fab, monkeypatch):
    """A digest made from Tune's newest experiment state gives Tune's word on each trial (id, name, state, sampled
    keys, retries, error, last result) without parsing that file again, 47 MB at 1,005 trials; a newer experiment
    state is parsed, and a trial whose state Tune changed in it is read from its files again."""
    import launch.record
    from tests.tunestate import experiment_storage, save_experiment_state, tune_trial

    folder = Path(fab.location.at().uri)
    storage = experiment_storage(folder)

    def save_state(stamp: str, states: dict[str, str]):
        trials = [tune_trial(storage, t.trial_id, t.sampled, n + 1, status=states.get(t.trial_id, t.state))
                  for n, t in enumerate(fab.trials)]
        return save_experiment_state(folder, trials, stamp=stamp)

    save_state("2026-11-27_10-00-00", {"max1": "TERMINATED"})
    first = launch.record.StudyRecord.load(fab.location, for_digest=True)
    assert [t.trial_id for t in first.trials] == [t.trial_id for t in fab.trials]
    first.save_digest()
    parsed, parse = [], launch.record.tune_trials
    monkeypatch.setattr(launch.record, "tune_trials", lambda location: parsed.append(1) or parse(location))
    reads = _reads(monkeypatch)
    again = launch.record.StudyRecord.load(fab.location)
    assert parsed == [] and reads == [] and _view(again) == _view(first)

    save_state("2026-11-27_11-00-00", {"max1": "ERROR"})  # newer: Ray reads this one
    changed = launch.record.StudyRecord.load(fab.location)
    assert parsed == [1] and reads == ["max1"]
    assert {t.trial_id: t.state for t in changed.trials}["max1"] == "ERROR"


def test_a_result_log_cut_short_is_refused_with_the_studys_digest_saved_too(tmp_path):
    """The driver saves the record's digest without refusing (`launch.driver`): a trial whose log was cut short is
    in it with no epochs. A reader that refuses such a log (`a2 package`) refuses it all the same, instead of taking
    the digest's empty trial as it is."""
    from a2core.errors import StudyError
    from launch.layout import RESULTS_FILE, TRIALS_DIR, train_run_name

    study = fabricated_study(tmp_path, "dig", 2)
    study.add("t1", {"fusion": "none", "seed": 0}, [{"epoch": 1, "val/CIDEr": 10.0}, {"epoch": 2, "val/CIDEr": 12.0}])
    study.add("t2", {"fusion": "none", "seed": 1}, [{"epoch": 1, "val/CIDEr": 11.0}])
    study.location.at(TRIALS_DIR, train_run_name("dig", "t2"), RESULTS_FILE).write_text('[{"epoch": 1, "val/CI')
    study.record(for_digest=True).save_digest()  # as the driver leaves it
    assert StudyRecord.load(study.location, study.spec, trials=list(study.trials)).logged["t2"] == 0
    with pytest.raises(StudyError, match=r"dig-t2/results\.json: unreadable"):
        StudyRecord.load(study.location, study.spec, trials=list(study.trials), refuse="package")
