"""Audit 78: captions never hold <unk> (nor <pad>, <bos>) in greedy, beam and ensemble decoding; packaging decodes
in the trial's own `train.precision`; an image with more than 5 reference captions is scored against all of them
(and, as documented, trains on its first 5)."""
import dataclasses

import pytest
import torch

import a2core.decode as decode_mod
from a2core import checkpoint as ckpt
from a2core.config import Config, ModelConfig, steps_per_epoch
from a2core.data import synthetic
from a2core.data.captions import Vocab
from a2core.data.dataset import CaptionData
from a2core.decode import (EnsembleStepper, MinLengthStepper, caption_batches, decode_precision, ensemble_captions,
                           greedy)
from a2core.errors import ConfigError
from a2core.model.a2 import build_model

pytestmark = pytest.mark.outside_ray_group

WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", "a", "b", "c"]
NEXT_BEST = 5  # "b": what a caption holds once <pad>, <bos> and <unk> are out


def _favour_unk(state: dict, layers: int, next_best: int = NEXT_BEST) -> dict:
    """A state dict whose every step scores <pad> 70 > <bos> 60 > <unk> 50 > `next_best` 40 > the other words 0 >
    <eos> -100 (forced after max_len only), whatever the image and prefix: the last decoder norm gives the constant
    y = 1 (d,), and the tied head's logit of word w is then the sum of its embedding row (V, d)."""
    d = state["embed.weight"].shape[1]
    state[f"decoder.{layers - 1}.norm3.weight"] = torch.zeros(d)
    state[f"decoder.{layers - 1}.norm3.bias"] = torch.ones(d)
    logit = torch.zeros(state["embed.weight"].shape[0])
    logit[[0, 1, 2, 3, next_best]] = torch.tensor([70.0, 60.0, -100.0, 50.0, 40.0])
    state["embed.weight"] = state["head.weight"] = (logit / d)[:, None].expand(-1, d).clone()  # tied: both keys
    return state


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=16, layers=1, heads=2, d_ff=32, dropout=0.0, feature_dim=8, max_regions=4,
                      fusion="gate")
    model = build_model(cfg, vocab_size=len(WORDS)).eval()
    model.load_state_dict(_favour_unk(model.state_dict(), cfg.layers))
    return model


def _batch(n=3):
    g = torch.Generator().manual_seed(1)
    return [(list(range(n)), torch.rand(n, 4, 8, generator=g), torch.ones(n, 4, dtype=torch.bool))]


def test_the_biased_model_would_emit_unk_without_the_mask():
    """The search primitive takes every word its stepper allows: the captions' mask is what keeps <unk> out."""
    _, feats, mask = _batch()[0]
    assert greedy(_tiny_model(), feats, mask, max_len=3).tolist() == [[3, 3, 3]] * 3


@pytest.mark.parametrize("beam", [1, 3])
def test_greedy_and_beam_captions_skip_unk_for_the_next_best_word(beam):
    vocab = Vocab(WORDS)
    caps = caption_batches(_tiny_model(), vocab, _batch(), beam_size=beam, max_len=3)
    assert caps == {0: "b b b", 1: "b b b", 2: "b b b"}
    assert not any("<" in c for c in caps.values())


@pytest.mark.parametrize("beam", [1, 4])
def test_an_ensemble_caption_skips_unk_too(beam):
    vocab = Vocab(WORDS)
    stepper = MinLengthStepper(EnsembleStepper([_tiny_model(0), _tiny_model(1)]), vocab.eos)
    caps = caption_batches(stepper, vocab, _batch(2), beam_size=beam, max_len=4)
    assert caps == {0: "b b b b", 1: "b b b b"}


# -- packaging: ensemble_captions on checkpoints --------------------------------------------------------------------
@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("audit78")
    synthetic.generate(tmp / "synth", seed=21, images=40)
    raw = {"data": {"root": str(tmp / "synth"), "images": 40, "seed": 21},
           "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10, "fusion": "gate"},
           "train": {"batch_size": 10, "xe_epochs": 1, "warmup": 4, "log_every": 1000}}
    cfg = Config.from_dict(raw)
    data = CaptionData(cfg.data, cfg.model.max_regions, cfg.model.feature_dim)
    return {"tmp": tmp, "raw": raw, "cfg": cfg, "data": data}


def _checkpoint(synth, name: str, precision: str = "fp32", favour_unk: bool = False) -> str:
    cfg = Config.from_dict({**synth["raw"], "train": {**synth["raw"]["train"], "precision": precision}})
    torch.manual_seed(0)
    state = build_model(cfg.model, len(synth["data"].vocab), cfg.data.max_caption_len + 2).state_dict()
    if favour_unk:
        state = _favour_unk(state, cfg.model.layers)
    path = ckpt.save({"model": state, "config": cfg.to_dict(), "vocab": synth["data"].vocab.words, "epoch": 1},
                     synth["tmp"] / name)
    return str(path)


def test_packaging_decode_runs_under_the_trials_precision(synth, monkeypatch):
    seen = []
    real = decode_mod.autocast
    monkeypatch.setattr(decode_mod, "autocast", lambda precision, device: seen.append(precision)
                        or real(precision, device))
    ids = [img.image_id for img in synth["data"].images("test")][:3]
    for precision in ("bf16", "fp32"):
        seen.clear()
        path = _checkpoint(synth, f"p-{precision}.pt", precision)
        got = ensemble_captions([path, path], synth["cfg"].to_dict()["data"], {"test": ids}, "test",
                                beam_size=2, max_len=3, batch_size=2, device="cpu")
        assert seen and set(seen) == {precision}  # every decode of the shard, ensemble and solo
        assert set(got["ensemble"]["test"]) == set(ids)


def test_decode_precision_is_the_trials_where_the_device_has_it_else_fp32(monkeypatch):
    cpu = torch.device("cpu")
    assert decode_precision({"train": {"precision": "bf16"}}, cpu) == "bf16"
    assert decode_precision({"train": {"precision": "fp16"}}, cpu) == "fp16"  # torch 2.13 autocasts fp16 on CPU
    assert decode_precision({"train": {}}, cpu) == "fp32"  # a checkpoint from before the key: fp32, as trained

    def refuse(precision, device):
        raise ConfigError("train.precision", f"{precision} autocast is not supported on {device.type}")

    monkeypatch.setattr(decode_mod, "check_precision", refuse)
    assert decode_precision({"train": {"precision": "bf16"}}, cpu) == "fp32"


def test_packaging_captions_never_hold_unk(synth):
    """`ensemble_captions` (packaging's decode): the ensemble's captions and each member's alone skip <unk>."""
    vocab = synth["data"].vocab
    path = _checkpoint(synth, "unk.pt", favour_unk=True)
    ids = [img.image_id for img in synth["data"].images("test")][:4]
    got = ensemble_captions([path, path], synth["cfg"].to_dict()["data"], {"test": ids}, "test",
                            beam_size=3, max_len=3, batch_size=3, device="cpu")
    word = vocab.words[NEXT_BEST]
    expected = {i: f"{word} {word} {word}" for i in ids}
    assert got["ensemble"]["test"] == expected and got["single"] == [expected, expected]


# -- all reference captions of an image ------------------------------------------------------------------------------
def _with_seven_captions(data: CaptionData):
    """The first train image given 7 captions: its 5 and 2 more (of other images), as real COCO has; before any
    caption is encoded."""
    train = data.splits["train"]
    extra = [train[1].captions[0], train[2].captions[0]]
    train[0] = dataclasses.replace(train[0], captions=train[0].captions + extra)
    return train[0]


def test_an_image_with_7_captions_is_scored_on_7_and_trains_on_its_first_5(synth):
    """The references (SCST's CIDEr-D reward, validation and test scores) hold all 7 captions. Cross-entropy
    takes the first 5 in either layout, on purpose (docs/explanation/model.md, "captions per image": both layouts
    see the same pairs and steps an epoch, `a2core.config.steps_per_epoch`); M2 would train on 7 pairs."""
    data = CaptionData(synth["cfg"].data, 10)
    seven = _with_seven_captions(data)
    assert data.references("train")[seven.image_id] == [" ".join(c) for c in seven.captions]  # all 7
    train = data.images("train")
    loader = data.pair_loader(10, seed=1, epoch=0)
    assert len(loader) == steps_per_epoch(len(train), 10, "pairs") == 10  # 20 images x 5 pairs / 10
    pairs = [(int(batch["image_ids"][r]), tuple(c))
             for batch in loader for r, c in zip(batch["caption_image"].tolist(), batch["captions"].tolist())]
    mine = sorted(tuple(w for w in c if w) for i, c in pairs if i == seven.image_id)
    max_len = synth["cfg"].data.max_caption_len
    assert mine == sorted(tuple(data.vocab.encode(c, max_len)) for c in seven.captions[:5])


def test_the_registered_ensemble_model_decodes_in_the_trials_precision(synth, monkeypatch):
    """The leaderboard's MLflow model (`A2EnsembleModel.predict`) decodes as `a2 package` does: in the checkpoint's
    train.precision, and with no <unk> in its captions."""
    import types

    import pandas as pd

    import dashboards.leaderboard as leaderboard

    seen = []
    real = leaderboard.autocast
    monkeypatch.setattr(leaderboard, "autocast", lambda precision, device: seen.append(precision)
                        or real(precision, device))
    path = _checkpoint(synth, "model-bf16.pt", "bf16", favour_unk=True)
    model = leaderboard.A2EnsembleModel()
    model.load_context(types.SimpleNamespace(artifacts={"checkpoint_0": path},
                                             model_config={"beam_size": 2, "max_len": 3}))
    ids = [img.image_id for img in synth["data"].images("test")][:2]
    out = model.predict(None, pd.DataFrame({"image_id": ids}))
    word = synth["data"].vocab.words[NEXT_BEST]
    assert seen == ["bf16"] and list(out["caption"]) == [f"{word} {word} {word}"] * 2


def test_captions_kept_by_an_earlier_decoder_are_decoded_again(synth, monkeypatch):
    """`a2 package` keeps decoded shards under `decode_key`: a decoder whose captions changed (CAPTIONS_VERSION, e.g.
    the <unk> mask) gives another key, so no caption an earlier version kept is reused."""
    import launch.package as package

    path = _checkpoint(synth, "key.pt")
    args = ([path], {"test": [1, 2]}, "test", synth["cfg"].to_dict()["data"])
    now = package.decode_key(*args, beam_size=5, max_len=20)
    assert package.decode_key(*args, beam_size=5, max_len=20) == now  # the same decoder: the kept shards serve
    monkeypatch.setattr(package, "CAPTIONS_VERSION", decode_mod.CAPTIONS_VERSION - 1)
    assert package.decode_key(*args, beam_size=5, max_len=20) != now
