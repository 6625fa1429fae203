"""Ensembles: one model and two copies of one model decode exactly like the model; different models average their
word distributions at every step; checkpoints of different vocabularies are refused; `a2 decode` over two
checkpoints writes one caption per test image."""
import copy
import json
import math

import pytest
import torch

from a2core import checkpoint as ckpt
from a2core.config import Config
from a2core.data import synthetic
from a2core.data.dataset import CaptionData
from a2core.decode import EnsembleStepper, ModelStepper, UncachedStepper, beam_search, captions_for
from a2core.errors import CheckpointError
from a2core.model.a2 import build_model, next_word_logp
from launch.cli import main as cli

SEED = 21


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Synthetic data, its config, and two differently initialised models saved as checkpoints."""
    tmp = tmp_path_factory.mktemp("ensemble")
    synthetic.generate(tmp / "synth", seed=SEED, images=40)
    cfg = Config.from_dict({
        "data": {"root": str(tmp / "synth"), "images": 40, "seed": SEED},
        "model": {"d_model": 32, "layers": 2, "heads": 4, "d_ff": 64, "max_regions": 10, "fusion": "gate"},
    })
    data = CaptionData(cfg.data, cfg.model.max_regions, cfg.model.feature_dim)
    models, paths = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = build_model(cfg.model, len(data.vocab), cfg.data.max_caption_len + 2)
        with torch.no_grad():  # sharper, more different distributions than the initial near-uniform ones
            model.embed.weight.mul_(3.0)
            for layer in model.decoder:
                layer.cross.gate_w.normal_(0, 0.5)
        model.eval()
        path = tmp / f"model{seed}.pt"
        ckpt.save({"model": model.state_dict(), "config": cfg.to_dict(), "vocab": data.vocab.words, "epoch": 1}, path)
        models.append(model)
        paths.append(path)
    batch = next(iter(data.loader("test", 5, with_captions=False)))
    return {"tmp": tmp, "cfg": cfg, "data": data, "models": models, "paths": paths, "batch": batch}


def _double(setup):
    models = [copy.deepcopy(m).double().eval() for m in setup["models"]]
    feats = setup["batch"]["feats"].double()
    return models, feats, setup["batch"]["region_mask"]


def test_one_model_ensemble_is_the_model(setup):
    (model, _), feats, mask = _double(setup)
    seq, score = beam_search(model, feats, mask, beam_size=5, max_len=20)
    seq1, score1 = beam_search(EnsembleStepper([model]), feats, mask, beam_size=5, max_len=20)
    assert torch.equal(seq, seq1)
    assert torch.allclose(score, score1, atol=1e-12)


def test_ensemble_of_two_identical_models_is_the_model(setup):
    (model, _), feats, mask = _double(setup)
    twin = copy.deepcopy(model)
    seq, score = beam_search(model, feats, mask, beam_size=5, max_len=20)
    seq2, score2 = beam_search(EnsembleStepper([model, twin]), feats, mask, beam_size=5, max_len=20)
    assert torch.equal(seq, seq2)
    assert torch.allclose(score, score2, atol=1e-9)


def _teacher_logp(model, feats, mask, prefix):
    """log p(. | prefix) at every position of prefix (N, T) -> (N, T, V), by a full teacher-forced pass."""
    with torch.no_grad():
        logits, _ = model(feats, mask, prefix)
    return next_word_logp(logits)  # as every search steps: <pad> and <bos> are no next word


def test_ensemble_of_different_models_averages_probabilities(setup):
    models, feats, mask = _double(setup)
    ens = EnsembleStepper(models)
    state = ens.init_state(feats, mask)
    bos = torch.full((feats.shape[0],), 1, dtype=torch.long)
    logp = ens.step(bos, state)  # (B, V)
    members = [_teacher_logp(m, feats, mask, bos[:, None])[:, -1] for m in models]
    assert not torch.allclose(members[0], members[1], atol=1e-3)  # the members really differ
    mean_p = torch.stack([lp.exp() for lp in members]).mean(0)
    assert torch.allclose(logp.exp(), mean_p, atol=1e-12)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(feats.shape[0], dtype=torch.float64))


def test_ensemble_beam_score_is_the_log_of_the_averaged_distribution(setup):
    """The returned score equals sum_t log(mean_i p_i(w_t | w_<t)) of the returned sequence, each member scored
    by a full teacher-forced pass; and the cached ensemble equals one over uncached members."""
    models, feats, mask = _double(setup)
    seqs, scores = beam_search(EnsembleStepper(models), feats, mask, beam_size=5, max_len=20)
    uncached = EnsembleStepper(models)
    uncached.members = [UncachedStepper(m) for m in models]
    seqs_u, scores_u = beam_search(uncached, feats, mask, beam_size=5, max_len=20)
    assert torch.equal(seqs, seqs_u) and torch.allclose(scores, scores_u, atol=1e-9)
    for b in range(feats.shape[0]):
        words = seqs[b].tolist()
        words = words[: words.index(2) + 1]  # up to and including <eos>
        prefix = torch.tensor([[1] + words[:-1]])
        per_model = torch.stack([
            _teacher_logp(m, feats[b:b + 1], mask[b:b + 1], prefix)[0, torch.arange(len(words)), torch.tensor(words)]
            for m in models])  # (M, T)
        expected = (torch.logsumexp(per_model, 0) - math.log(len(models))).sum()
        assert float(scores[b]) == pytest.approx(float(expected), abs=1e-9)


def test_checkpoints_with_different_vocabularies_are_refused(setup, capsys):
    state = ckpt.load(setup["paths"][0])
    vocab = list(state["vocab"])
    vocab[4], vocab[5] = vocab[5], vocab[4]  # same size, two word ids swapped
    other = ckpt.save({**state, "vocab": vocab}, setup["tmp"] / "swapped.pt")
    a = str(setup["paths"][0])
    with pytest.raises(CheckpointError, match="vocabulary") as err:
        ckpt.load_ensemble([a, other])
    assert a in str(err.value) and str(other) in str(err.value)
    out = setup["tmp"] / "refused.json"
    assert cli(["decode", "--checkpoints", a, str(other), "--split", "test", "--out", str(out)]) == 2
    assert "vocabulary" in capsys.readouterr().err and not out.exists()
    # A model of another vocabulary size: the same refusal, before any decoding.
    cfg = setup["cfg"]
    bigger = build_model(cfg.model, len(vocab) + 1, cfg.data.max_caption_len + 2)
    third = ckpt.save({**state, "model": bigger.state_dict(), "vocab": state["vocab"] + ["zebra"]},
                      setup["tmp"] / "bigger.pt")
    with pytest.raises(CheckpointError, match=r"differs from that of .*model0\.pt"):
        ckpt.load_ensemble([a, third])


def test_a2_decode_with_two_checkpoints_writes_one_caption_per_test_image(setup):
    out = setup["tmp"] / "results" / "ens.json"
    a, b = map(str, setup["paths"])
    assert cli(["decode", "--checkpoints", a, b, "--split", "test", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    test_ids = [img.image_id for img in setup["data"].images("test")]
    assert sorted(r["image_id"] for r in results) == sorted(test_ids)
    assert all(isinstance(r["caption"], str) and r["caption"] for r in results)
    # The same captions as the averaging stepper over the checkpoints' models.
    models, vocab, _ = ckpt.load_ensemble([a, b])
    expected = captions_for(setup["data"], EnsembleStepper(models), "test", beam_size=5, max_len=20)
    assert {r["image_id"]: r["caption"] for r in results} == expected
    # One checkpoint: the single model's captions.
    single = setup["tmp"] / "single.json"
    assert cli(["decode", "--checkpoints", a, "--split", "test", "--out", str(single)]) == 0
    expected1 = captions_for(setup["data"], ModelStepper(models[0]), "test", beam_size=5, max_len=20)
    assert {r["image_id"]: r["caption"] for r in json.loads(single.read_text())} == expected1


def test_members_encode_each_image_once_for_the_ensemble_and_their_solo_captions(setup, monkeypatch):
    """`ensemble_captions` (packaging's decode): each member's encoder runs once per image, shared by the ensemble's
    search and the member's solo search on the single split; the captions equal those of separate passes (the
    ensemble over every image, each member alone over the single split, each encoding its images again)."""
    from a2core.decode import MinLengthStepper, caption_images, ensemble_captions
    from a2core.data.features import FeatureStore
    from a2core.model.a2 import A2Transformer

    data = setup["data"]
    val = [img.image_id for img in data.images("val")][:6]
    test = [img.image_id for img in data.images("test")][:7]
    shard = {"all": val + test, "test": test}  # the single split's images are in the other split too
    paths = list(map(str, setup["paths"]))
    options = dict(beam_size=3, max_len=12, batch_size=3)
    encoded = []
    encode = A2Transformer.encode
    monkeypatch.setattr(A2Transformer, "encode", lambda self, feats, mask: encoded.append(len(feats))
                        or encode(self, feats, mask))
    got = ensemble_captions(paths, setup["cfg"].to_dict()["data"], shard, "test", **options)
    assert sum(encoded) == 2 * len(val + test)  # two members, every image once each
    encoded.clear()

    models, vocab, _ = ckpt.load_ensemble(paths)
    store = FeatureStore(data.paths.features, setup["cfg"].model.feature_dim)
    fetch = lambda i: store.padded(i, setup["cfg"].model.max_regions)  # noqa: E731
    alone = lambda stepper, ids: caption_images(MinLengthStepper(stepper, vocab.eos), vocab, ids, fetch,  # noqa: E731
                                                batch_size=3, beam_size=3, max_len=12)
    ensemble = alone(EnsembleStepper(models), val + test)
    singles = [alone(ModelStepper(m), test) for m in models]
    assert sum(encoded) == 2 * len(val + test) + 2 * len(test)  # what separate passes cost
    assert got["ensemble"] == {"all": {i: ensemble[i] for i in val + test}, "test": {i: ensemble[i] for i in test}}
    assert got["single"] == singles and singles[0] != singles[1]  # the members differ
