"""`launch.frames.study_frames`: a study's trials, replicate groups, epochs and per-image scores as pandas
DataFrames, read from its storage by the record's reader (`dashboards.frames` makes the frames)."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from launch.frames import study_frames
from tests.studyfolder import FabricatedStudy, fabricated_study

IMAGES = {"val": {"101": 80.0, "102": 120.0}, "test": {"201": 70.0, "202": 110.0, "203": 90.0}}


def stored_study(root: Path, name: str = "frames", overrides: tuple[str, ...] = ()) -> FabricatedStudy:
    """A finished study in storage (`root/st` unless `overrides` set `storage=...`) as `a2 study run` leaves it, without Ray: fusion none
    and gate over seeds 0 and 1, three epochs each, the test split scored at the end; Tune's experiment state saved
    by Tune's own classes (`tests.tunestate`), so the study is found by name as any reader finds it."""
    from tests.tunestate import experiment_storage, save_experiment_state, tune_trial

    fab = fabricated_study(root, name, epochs=3, overrides=overrides)
    for fusion, base in (("none", 90.0), ("gate", 95.0)):
        for seed in (0, 1):
            results = [{"epoch": e, "stage": "xe", "val/CIDEr": base + e + seed, "val/BLEU-4": 30.0 + e,
                        "train/loss": 3.0 / e} for e in (1, 2, 3)]
            results[-1]["test/CIDEr"] = base - 1 + seed
            sampled = {"fusion": fusion, "seed": seed, **({"lambda": 0.035} if fusion == "gate" else {})}
            per_image = {split: {k: v + seed for k, v in scores.items()} for split, scores in IMAGES.items()}
            fab.add(f"{fusion}{seed}", sampled, results, per_image=per_image)
    scratch = root / "tune" / name  # saved here, then stored beside the study's files (a bucket too)
    scratch.mkdir(parents=True)
    state = save_experiment_state(scratch, [tune_trial(experiment_storage(scratch), t.trial_id, t.sampled, n + 1,
                                                       status=t.state) for n, t in enumerate(fab.trials)])
    fab.location.write_text(state.read_text(), state.name)
    return fab


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    root = tmp_path_factory.mktemp("frames")
    stored_study(root)
    return study_frames("frames", storage=str(root / "st"))


def test_trials_one_row_each_with_its_group_keys_and_scores(frames):
    trials = frames.trials
    assert list(trials["trial_id"]) == ["none0", "none1", "gate0", "gate1"] and list(trials.index) == list(trials.trial_id)
    assert list(trials.columns[:6]) == ["trial_id", "group", "fusion", "lambda", "seed", "state"]
    gate1 = trials.loc["gate1"]
    assert (gate1.fusion, gate1.seed, gate1["lambda"], gate1.best, gate1.best_epoch, gate1.test) == \
        ("gate", 1, 0.035, 99.0, 3, 95.0)
    assert gate1["val/CIDEr"] == 99.0 and gate1["val/BLEU-4"] == 33.0 and gate1["train/loss"] == pytest.approx(1.0)
    assert math.isnan(trials.loc["none0", "lambda"])  # lambda does not apply to fusion none: missing, not a value
    assert trials.groupby("group").size().tolist() == [2, 2]  # the two seeds of each configuration share a group
    assert not trials.stopped_early.any() and set(trials.state) == {"TERMINATED"}
    # a pandas user's first question: each fusion's mean best val CIDEr over seeds
    assert trials.groupby("fusion")["best"].mean().to_dict() == {"gate": 98.5, "none": 93.5}


def test_groups_with_mean_interval_and_the_best(frames):
    groups = frames.groups
    assert list(groups.fusion) == ["none", "gate"] and list(groups.n) == [2, 2]
    gate = groups[groups.fusion == "gate"].iloc[0]
    assert gate["mean"] == pytest.approx(98.5) and gate.low < 98.5 < gate.high
    assert gate["values"] == [98.0, 99.0] and gate.test_values == [94.0, 95.0] and gate.trials == ["gate0", "gate1"]
    assert gate.best_group and not groups[groups.fusion == "none"].iloc[0].best_group and gate.best_trial == "gate1"
    assert set(groups.group) == set(frames.trials.group)


def test_epochs_are_the_learning_curves(frames):
    epochs = frames.epochs
    assert len(epochs) == 4 * 3 and list(epochs.columns[:4]) == ["trial_id", "group", "seed", "epoch"]
    curve = epochs[epochs.trial_id == "gate1"].set_index("epoch")["val/CIDEr"].to_dict()
    assert curve == {1: 97.0, 2: 98.0, 3: 99.0}


def test_per_image_scores_by_trial_and_image(frames):
    test = frames.per_image("test")
    assert list(test.columns) == ["trial_id", "group", "seed", "image_id", "cider"] and len(test) == 4 * 3
    table = test.pivot(index="image_id", columns="trial_id", values="cider")
    assert table.loc["202", "gate1"] == 111.0 and table.loc["201", "none0"] == 70.0
    assert frames.per_image("val").groupby("trial_id").size().to_dict() == {t: 2 for t in frames.trials.trial_id}
    with pytest.raises(ValueError, match="split must be"):
        frames.per_image("train")


def test_an_unknown_study_is_a_one_line_error(tmp_path):
    from a2core.errors import StudyError

    with pytest.raises(StudyError, match="no study 'nope' at"):
        study_frames("nope", storage=str(tmp_path))


@pytest.mark.slow  # an S3 server (moto) on 127.0.0.1
def test_a_study_on_s3_gives_the_same_frames(tmp_path, s3_endpoint, monkeypatch, frames):
    from tests.s3server import unique_bucket

    bucket = unique_bucket(s3_endpoint)
    stored_study(tmp_path, overrides=(f"storage=s3://{bucket}/studies", f"storage_endpoint_url={s3_endpoint}"))
    monkeypatch.setenv("A2_STORAGE_ENDPOINT_URL", s3_endpoint)
    on_s3 = study_frames("frames", storage=f"s3://{bucket}/studies")
    assert on_s3.study.source.startswith(f"s3://{bucket}/studies/frames")
    same = ["fusion", "lambda", "seed", "best", "best_epoch", "test", "val/CIDEr"]  # the group hashes differ: the
    pd.testing.assert_frame_equal(on_s3.trials[same], frames.trials[same])         # data folders do
    pd.testing.assert_frame_equal(on_s3.groups.drop(columns="group").reset_index(drop=True),
                                  frames.groups.drop(columns="group").reset_index(drop=True))
    pd.testing.assert_frame_equal(on_s3.per_image("test").drop(columns="group"),
                                  frames.per_image("test").drop(columns="group"))
