"""Beam search at its edges: a beam wider than the vocabulary (refused by `a2 decode` before decoding, naming
--beam-size and the vocabulary), wider than the captions a tiny vocabulary can form (all_beams refused rather than
padded with impossible hypotheses), no possible caption at all (refused), an ensemble whose members cannot drop
finished images (kept to the end, the same results), and rank shards that do not divide the images."""
import json

import pytest
import torch

from a2core import checkpoint as ckpt
from a2core.config import Config, ModelConfig
from a2core.data import synthetic
from a2core.data.dataset import CaptionData
from a2core.decode import EnsembleStepper, MinLengthStepper, ModelStepper, beam_search, captions_for
from a2core.model.a2 import build_model
from launch.cli import main as cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(vocab_size, seed=0, eos_bias=0.0):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=16, layers=1, heads=2, d_ff=32, dropout=0.0, feature_dim=8, max_regions=4,
                      fusion="gate")
    model = build_model(cfg, vocab_size=vocab_size).eval()
    with torch.no_grad():
        model.head.weight[2] += eos_bias * torch.randn(16)  # <eos> early for some images, late for others
    return model


def _batch(b=2, seed=0):
    torch.manual_seed(seed)
    return torch.randn(b, 4, 8), torch.ones(b, 4, dtype=torch.bool)  # feats (B, R, D), region_mask (B, R)


def test_all_beams_wider_than_the_possible_captions_is_refused():
    """Vocabulary <pad> <bos> <eos> and one word (3), max_len 3: exactly 4 captions exist. Beam 4 returns them all;
    beam 5 returned a fifth, impossible one at -inf ([3, <eos>, <pad>, <bos>], a duplicate of [3, <eos>] once
    decoded: an SCST candidate trained as a real one)."""
    model = _model(4)
    feats, mask = _batch()
    beams, scores = beam_search(model, feats, mask, beam_size=4, max_len=3, all_beams=True)  # (2, 4, 4), (2, 4)
    for b in range(2):
        assert sorted(beams[b].tolist()) == [[2, 0, 0, 0], [3, 2, 0, 0], [3, 3, 2, 0], [3, 3, 3, 2]]
        assert torch.isfinite(scores[b]).all() and scores[b].tolist() == sorted(scores[b].tolist(), reverse=True)
    with pytest.raises(ValueError, match=r"beam_size 5 is more than the 4 captions of at most 3 words"):
        beam_search(model, feats, mask, beam_size=5, max_len=3, all_beams=True)
    # the best caption alone is possible at any width: the one of the widest beam that can be filled
    seq8, score8 = beam_search(model, feats, mask, beam_size=8, max_len=3)
    assert torch.equal(seq8, beams[:, 0]) and torch.equal(score8, scores[:, 0])


def test_no_possible_caption_is_refused():
    """<eos> banned for the first 3 words but forced after max_len 2: nothing can end. The search returned the
    empty caption [<eos>, <eos>, <eos>] at -inf as if it were the best one."""
    stepper = MinLengthStepper(ModelStepper(_model(12)), eos=2, min_len=3)
    feats, mask = _batch()
    with pytest.raises(ValueError, match="no possible caption of at most 2 words"):
        beam_search(stepper, feats, mask, beam_size=2, max_len=2)
    seq, score = beam_search(MinLengthStepper(ModelStepper(_model(12)), eos=2, min_len=2), feats, mask,
                             beam_size=2, max_len=2)
    assert seq.shape == (2, 3) and (seq[:, :2] > 2).all() and (seq[:, 2] == 2).all() and torch.isfinite(score).all()


class NoSelect:
    """A stepper without `select_rows`, which the module's stepper protocol allows: every image stays to the end."""

    def __init__(self, inner):
        self.inner = inner

    def init_state(self, feats, region_mask):
        return self.inner.init_state(feats, region_mask)

    def expand_state(self, state, k):
        return self.inner.expand_state(state, k)

    def step(self, last, state):
        return self.inner.step(last, state)

    def reorder_state(self, state, index):
        return self.inner.reorder_state(state, index)


@pytest.mark.parametrize("min_length", [False, True], ids=["ensemble", "min-length"])
def test_an_ensemble_of_members_that_cannot_drop_rows_keeps_every_image(min_length):
    """An ensemble claimed it could drop finished images whatever its members: a member without `select_rows` made
    the search fail (AttributeError) as soon as one image finished before the others."""
    models = [_model(20, seed=s, eos_bias=1.5) for s in (0, 1)]
    feats, mask = _batch(6)
    wrap = (lambda s: MinLengthStepper(s, eos=2)) if min_length else (lambda s: s)  # noqa: E731
    kept = wrap(EnsembleStepper([NoSelect(Rows(m)) for m in models]))
    dropping = wrap(EnsembleStepper([Rows(m) for m in models]))
    seq_k, score_k = beam_search(kept, feats, mask, beam_size=3, max_len=12)
    seq_d, score_d = beam_search(dropping, feats, mask, beam_size=3, max_len=12)
    assert torch.equal(seq_k, seq_d) and torch.equal(score_k, score_d)
    rows_k, rows_d = kept_rows(kept), kept_rows(dropping)  # rows (beams) of each step, first member
    assert rows_k[0] == rows_d[0] == 6 and set(rows_k[1:]) == {18} and len(rows_k) == len(rows_d)
    assert 3 <= min(rows_d[1:]) < 18  # some images finished first and left the batch of the other search


class Rows(ModelStepper):
    """A model's stepper that records the rows of each step."""

    def __init__(self, model):
        super().__init__(model)
        self.rows = []

    def step(self, last, state):
        self.rows.append(last.shape[0])
        return super().step(last, state)


def kept_rows(stepper):
    ensemble = stepper.inner if isinstance(stepper, MinLengthStepper) else stepper
    member = ensemble.members[0]
    return (member.inner if isinstance(member, NoSelect) else member).rows


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """Synthetic data (a 38-word vocabulary) and one checkpoint of an untrained model."""
    tmp = tmp_path_factory.mktemp("decode_edges")
    synthetic.generate(tmp / "synth", seed=21, images=40)
    cfg = Config.from_dict({
        "data": {"root": str(tmp / "synth"), "images": 40, "seed": 21},
        "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10, "fusion": "gate"},
    })
    data = CaptionData(cfg.data, cfg.model.max_regions, cfg.model.feature_dim)
    torch.manual_seed(0)
    model = build_model(cfg.model, len(data.vocab), cfg.data.max_caption_len + 2).eval()
    path = ckpt.save({"model": model.state_dict(), "config": cfg.to_dict(), "vocab": data.vocab.words, "epoch": 1},
                     tmp / "model.pt")
    return {"tmp": tmp, "data": data, "model": model, "path": str(path)}


def test_a2_decode_refuses_a_beam_wider_than_the_vocabulary(synth, capsys):
    """38 word ids, 36 of which a caption can hold: beam 37 was decoded (its first step cannot be filled); now a
    one-line error naming --beam-size and the vocabulary, before any decoding. Beam 36 decodes."""
    assert len(synth["data"].vocab) == 38
    out = synth["tmp"] / "wide.json"
    capsys.readouterr()
    assert cli(["decode", "--checkpoints", synth["path"], "--split", "test", "--out", str(out),
                "--beam-size", "37", "--max-len", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--beam-size" in err and "37" in err and "38 word ids" in err
    assert "at most 36" in err and not out.exists()
    widest = synth["tmp"] / "widest.json"
    assert cli(["decode", "--checkpoints", synth["path"], "--split", "test", "--out", str(widest),
                "--beam-size", "36", "--max-len", "3"]) == 0
    assert len(json.loads(widest.read_text())) == len(synth["data"].images("test")) == 10


def test_rank_shards_that_do_not_divide_the_images_cover_each_once(synth):
    """7 images over 3 ranks (3 + 3 + 1, the last rank filled up from the start): their union is the 7 images, each
    with the caption of the undivided decode."""
    stepper = ModelStepper(synth["model"])
    options = dict(beam_size=2, max_len=3, batch_size=2, limit=7)
    whole = captions_for(synth["data"], stepper, "train", **options)
    shards = [captions_for(synth["data"], stepper, "train", rank=r, world=3, **options) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]
    joined = {i: c for s in shards for i, c in s.items()}
    assert list(whole) == [img.image_id for img in synth["data"].images("train")[:7]]
    assert joined == whole
