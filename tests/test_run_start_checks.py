"""What a run would find out only hours in is refused when it starts: a train.select_metric no epoch of the
configuration reports (no best epoch: no best.pt, nothing to test), one no cross-entropy epoch reports while SCST
starts from this run's best XE checkpoint (none to start from), and a train.scst_from checkpoint SCST could not
start from (missing, not a checkpoint, another vocabulary, weights of another shape)."""
import json
import subprocess
import sys

import pytest
import yaml

import a2core.config as config_mod
from a2core import checkpoint as ckpt
from a2core.config import SELECTABLE, Config, reported_metrics
from a2core.data import synthetic
from a2core.errors import CheckpointError, ConfigError
from a2core.train import Trainer, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEED = 5
TINY = {"model": {"d_model": 16, "layers": 2, "heads": 2, "d_ff": 32, "dropout": 0.0, "max_regions": 10,
                  "fusion": "gate"},
        "train": {"xe_epochs": 1, "scst_epochs": 0, "batch_size": 25, "warmup": 10, "log_every": 1000,
                  "diag_images": 5, "diag_kendall_images": 2, "test_meteor": False, "beam_size": 2,
                  "scst_samples": 2, "max_len": 8}}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("runstart") / "synth"
    synthetic.generate(root, seed=SEED, images=40)
    return {"kind": "synthetic", "seed": SEED, "images": 40, "root": str(root), "val_images": 5}


def _raw(data, **over) -> dict:
    raw = {"data": dict(data), **json.loads(json.dumps(TINY))}
    for key, value in over.items():
        config_mod.set_dotted(raw, key, value)
    return raw


def _cfg(data, **over) -> Config:
    return Config.from_dict(_raw(data, **over))


# -- 1. the select metric must be one an epoch of this configuration reports -------------------------------------
@pytest.mark.parametrize("over, hint", [
    ({"train.select_metric": "val/CIDER"}, ""),
    ({"train.select_metric": "val/BLEU4"}, ""),
    ({"train.select_metric": "val/ROUGE_L"}, ""),
    ({"train.select_metric": "time/epoch_s"}, ""),  # reported, but no val/, train/ or diag/ metric
    ({"train.select_metric": "val/METEOR"}, "train.val_meteor: true"),
    ({"train.select_metric": "train/mask_loss", "model.fusion": "none"}, "model.fusion 'none' has no mask network"),
    ({"train.select_metric": "diag/mask_mean", "model.fusion": "none"}, "model.fusion 'none' has no mask network"),
    ({"train.select_metric": "diag/jsd/layer2"}, "the model has 2 layers"),
    ({"train.select_metric": "train/reward"}, "only SCST epochs report it"),
    ({"train.select_metric": "train/lr", "train.xe_epochs": 0, "train.scst_epochs": 1, "train.scst_from": "x.pt"},
     "only cross-entropy epochs report it"),
])
def test_a_select_metric_no_epoch_reports_is_refused_naming_it_and_the_valid_ones(data, over, hint):
    with pytest.raises(ConfigError) as err:
        _cfg(data, **over)
    assert err.value.path == "train.select_metric"
    message = str(err.value)
    assert repr(over["train.select_metric"]) in message and "is not reported by any epoch" in message
    assert hint in message
    for valid in ("val/CIDEr", "val/BLEU-4", "val/ROUGE-L", "train/loss", "diag/jsd/layer<i>"):
        assert valid in message


def test_grounding_metrics_are_synthetic_only(data):
    coco = {"kind": "coco", "captions": "c.json", "features": "f.h5"}
    with pytest.raises(ConfigError, match="data.kind 'coco' has no ground-truth regions"):
        Config.from_dict({**_raw(data, **{"train.select_metric": "diag/grounding/lift"}), "data": coco})
    assert _cfg(data, **{"train.select_metric": "diag/grounding/lift"}).train.select_metric == "diag/grounding/lift"


@pytest.mark.parametrize("fusion", ["gate", "none"])
def test_the_metrics_accepted_are_the_ones_the_epochs_report(data, tmp_path, fusion):
    """A run of one XE and one SCST epoch reports exactly the names `reported_metrics` lists for it (val/METEOR on),
    and each of them is accepted as the select metric (the SCST-only ones with a train.scst_from to start from)."""
    cfg = _cfg(data, **{"model.fusion": fusion, "train.scst_epochs": 1, "train.val_meteor": False})
    result = train(cfg, output_dir=tmp_path / "run")
    seen = {k for h in result["history"] for k in h if k.startswith(SELECTABLE)}
    listed = reported_metrics(cfg.model, cfg.train, cfg.data.kind)
    assert seen == set(listed)
    assert {"train/reward", "train/lr", "diag/jsd/layer1", "val/ROUGE-L"} <= seen
    assert ("train/mask_loss" in seen) == ("diag/mask_mean" in seen) == (fusion != "none")
    for name in seen:
        over = {"model.fusion": fusion, "train.scst_epochs": 1, "train.select_metric": name}
        if listed[name] == "scst":
            over["train.scst_from"] = "xe.pt"
        assert _cfg(data, **over).train.select_metric == name
    assert _cfg(data, **{"train.select_metric": "val/METEOR", "train.val_meteor": True})


# -- 2. SCST from this run's best XE checkpoint needs an XE epoch that reports the metric -------------------------
@pytest.mark.parametrize("over, why", [
    ({"train.select_metric": "diag/mask_mean", "train.diag_every": 0}, "diag_every 0"),
    ({"train.select_metric": "diag/jsd/layer0", "train.diag_every": 3}, "diag_every 3"),
    ({"train.select_metric": "diag/kendall/attention", "train.diag_every": 0, "train.diag_epochs": [3]},
     "diag_epochs [3]"),
    ({"train.select_metric": "train/reward"}, "only SCST epochs report train/reward"),
])
def test_scst_from_the_best_xe_epoch_of_a_metric_no_xe_epoch_reports_is_refused(data, over, why):
    with pytest.raises(ConfigError) as err:
        _cfg(data, **{"train.xe_epochs": 2, "train.scst_epochs": 1, **over})
    assert err.value.path == "train.select_metric"
    assert why in err.value.reason and "SCST (scst_epochs 1)" in err.value.reason
    assert "would have none to start from" in err.value.reason


@pytest.mark.parametrize("over", [
    {"train.diag_every": 2},  # the second XE epoch has them
    {"train.diag_every": 0, "train.diag_epochs": [1]},
    {"train.diag_every": 0, "train.scst_from": "xe.pt"},  # SCST starts from a checkpoint of its own
    {"train.diag_every": 0, "train.scst_epochs": 0},  # no SCST: the last epoch has them
])
def test_a_diag_metric_with_an_xe_epoch_that_reports_it_or_no_switch_is_accepted(data, over):
    cfg = _cfg(data, **{"train.xe_epochs": 2, "train.scst_epochs": 1, "train.select_metric": "diag/mask_mean",
                        **over})
    assert cfg.train.select_metric == "diag/mask_mean"


def test_the_refused_scst_config_would_have_failed_at_the_switch_after_its_xe_epochs(data, tmp_path, monkeypatch):
    """The old check (a prefix) let it through: XE trains, no epoch reports the metric, and SCST has no checkpoint."""
    over = {"train.xe_epochs": 1, "train.scst_epochs": 1, "train.select_metric": "diag/mask_mean",
            "train.diag_every": 0}
    monkeypatch.setattr(config_mod, "check_select_metric", lambda *args, **kwargs: None)
    cfg = _cfg(data, **over)
    epochs = []
    with pytest.raises(CheckpointError, match="best.pt: checkpoint not found"):
        train(cfg, lambda metrics, _: epochs.append(metrics["epoch"]), output_dir=tmp_path / "run")
    assert epochs == [1] and (tmp_path / "run" / "last.pt").is_file()  # after the XE epoch
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="train.select_metric"):
        _cfg(data, **over)


# -- 3. a train.scst_from SCST could not start from is refused before the first epoch -----------------------------
@pytest.fixture(scope="module")
def xe_checkpoint(data, tmp_path_factory):
    """A checkpoint of this run's model and vocabulary (an initialised Trainer's state: its format matters)."""
    out = tmp_path_factory.mktemp("xe")
    return ckpt.save(Trainer(_cfg(data), out / "make").state_dict(), out / "xe.pt")


def _other_checkpoint(data, tmp_path, **model) -> str:
    over = {f"model.{k}": v for k, v in model.items()}
    return str(ckpt.save(Trainer(_cfg(data, **over), tmp_path / "make").state_dict(), tmp_path / "other.pt"))


def _refused_before_any_epoch(cfg, tmp_path) -> str:
    reports = []
    with pytest.raises(CheckpointError) as err:
        train(cfg, lambda metrics, _: reports.append(metrics), output_dir=tmp_path / "run")
    assert reports == [] and not (tmp_path / "run" / "last.pt").exists()
    return str(err.value)


def _scst(data, source) -> Config:
    return _cfg(data, **{"train.xe_epochs": 1, "train.scst_epochs": 1, "train.scst_from": str(source)})


def test_a_missing_scst_from_is_refused_before_any_epoch(data, tmp_path):
    message = _refused_before_any_epoch(_scst(data, tmp_path / "nowhere.pt"), tmp_path)
    assert message.startswith("train.scst_from: ") and f"{tmp_path / 'nowhere.pt'}: checkpoint not found" in message


def test_a_file_that_is_no_checkpoint_is_refused_before_any_epoch(data, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    message = _refused_before_any_epoch(_scst(data, junk), tmp_path)
    assert str(junk) in message and "not a checkpoint written by torch.save" in message


def test_a_checkpoint_of_another_vocabulary_is_refused_before_any_epoch(data, xe_checkpoint, tmp_path):
    state = ckpt.load(xe_checkpoint)
    other = ckpt.save({**state, "vocab": state["vocab"][:-1]}, tmp_path / "other-vocab.pt")
    message = _refused_before_any_epoch(_scst(data, other), tmp_path)
    assert str(other) in message and "vocabulary differs" in message
    assert f"({len(state['vocab']) - 1} words, {len(state['vocab'])} here)" in message


@pytest.mark.parametrize("model, expected", [
    ({"d_model": 32, "heads": 2}, "model.d_model 32 in the checkpoint, 16 here"),
    ({"layers": 1}, "model.layers 1 in the checkpoint, 2 here"),
    ({"fusion": "none"}, "model.fusion none in the checkpoint, gate here"),
])
def test_a_checkpoint_of_another_model_shape_is_refused_before_any_epoch(data, tmp_path, model, expected):
    other = _other_checkpoint(data, tmp_path, **model)
    message = _refused_before_any_epoch(_scst(data, other), tmp_path)
    assert other in message and expected in message and "cannot start SCST from it" in message
    assert "Traceback" not in message and "size mismatch" not in message  # not load_state_dict's RuntimeError
    if "d_model" in model:  # the first parameter that differs, with both shapes
        assert "first mismatch: " in message and "(32" in message and "(16" in message
    if "fusion" in model:
        assert "missing from it: " in message


def test_a_fitting_scst_from_is_accepted_and_one_already_passed_on_resume_is_not_read(data, xe_checkpoint,
                                                                                       tmp_path):
    Trainer(_scst(data, xe_checkpoint), tmp_path / "ok")  # the same shapes and vocabulary: no error
    # A run resumed after its switch to SCST never opens scst_from again: a file gone since is no reason to stop it.
    cfg = _cfg(data, **{"train.xe_epochs": 1, "train.scst_epochs": 2})
    state = ckpt.load(xe_checkpoint)
    past = ckpt.save({**state, "config": cfg.to_dict(), "epoch": 2, "step": 4}, tmp_path / "past.pt")
    resumed = Trainer(cfg.replace({"train.scst_from": str(tmp_path / "gone.pt")}), tmp_path / "resumed",
                      resume_from=past)
    assert resumed.epoch == 2
    with pytest.raises(CheckpointError, match="gone.pt: checkpoint not found"):  # at the switch still ahead: refused
        Trainer(cfg.replace({"train.scst_from": str(tmp_path / "gone.pt")}), tmp_path / "fresh")


@pytest.mark.slow
def test_a2_train_refuses_a_bad_scst_from_in_one_line(data, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(_raw(data, **{"train.scst_epochs": 1})))
    missing = tmp_path / "nowhere.pt"
    run = subprocess.run([sys.executable, "-m", "launch.cli", "train", "--config", str(config),
                          f"train.scst_from={missing}", "--output-dir", str(tmp_path / "run")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == f"a2: error: train.scst_from: {missing}: checkpoint not found"
    assert not (tmp_path / "run" / "last.pt").exists()


# -- 3. in a study, ASHA's rungs have diagnostics in every trial: they count -------------------------------------
def test_a_study_whose_asha_rungs_fall_on_xe_epochs_may_select_on_a_diag_metric_with_scst():
    """smoke.yaml has diag_every 0 and ASHA rungs at epochs 2 and 4 of 4 XE + 2 SCST epochs: every trial has its
    diagnostics at the rungs (`TrialPlan.config`), so SCST has a best XE checkpoint by diag/jsd/layer0 to start from.
    The same study with its rungs all in SCST epochs is refused, naming the key the study sets."""
    from launch.spec import load_study
    from launch.trainable import plan_from_spec
    from tests.test_spec import SMOKE

    over = ["train.xe_epochs=4", "train.scst_epochs=2", "search.metric=diag/jsd/layer0", "search.mode=min"]
    spec = load_study(SMOKE, over)
    assert spec.rungs == [2, 4] and spec.base["train"]["diag_every"] == 0
    trial = plan_from_spec(spec).config({"fusion": "gate"})
    assert trial["train"]["diag_epochs"] == [2, 4] and trial["train"]["select_metric"] == "diag/jsd/layer0"
    Config.from_dict(trial)  # the trial's own check passes with the rungs it has
    with pytest.raises(ConfigError) as err:
        load_study(SMOKE, ["train.xe_epochs=1", "train.scst_epochs=5", *over[2:]])  # rungs 2 and 4: SCST epochs
    assert err.value.path == "search.metric" and "would have none to start from" in err.value.reason
    assert "diag_epochs []" in err.value.reason  # the study's own keys, not the rungs tried
