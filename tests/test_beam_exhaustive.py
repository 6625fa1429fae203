"""Beam search against exhaustive search on tiny vocabularies: a deterministic stub stepper whose next-word
distribution is a fixed function of (image, prefix), and a tiny real model. With a beam at least as wide as the
captions that exist, beam search must return exactly the best ones (sum of word log-probabilities, <eos>
included; at most max_len words, then <eos> forced); beam 1 follows greedy; an image decodes the same alone as in
a batch; an ensemble of one is its member and an ensemble averages probabilities."""
import itertools
import math
from functools import lru_cache

import pytest
import torch

from a2core.config import ModelConfig
from a2core.decode import (EnsembleStepper, MinLengthStepper, ModelStepper, UncachedStepper, beam_search,
                           greedy)
from a2core.model.a2 import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAD, BOS, EOS = 0, 1, 2
V = 7  # <pad> <bos> <eos> and words 3..6


@lru_cache(maxsize=None)
def table(seed: int, img: int, prefix: tuple, eos_shift: float = 0.0) -> torch.Tensor:
    """(V,) float64 log-probabilities of the next word after <bos> + prefix, <pad> and <bos> at -inf."""
    g = torch.Generator().manual_seed(hash((seed, img) + prefix) & 0x7FFFFFFF)
    logits = 2.0 * torch.randn(V, generator=g, dtype=torch.float64)
    logits[EOS] += eos_shift
    logits[:2] = float("-inf")
    return logits.log_softmax(-1)


class Stub:
    """A stepper whose distribution depends only on (image id = feats[i, 0], the words so far)."""

    def __init__(self, seed=0, eos_shift=0.0, can_select=True):
        self.seed, self.eos_shift = seed, eos_shift
        if can_select:
            self.select_rows = self._select_rows

    def init_state(self, feats, region_mask):
        return {"img": feats[:, 0].long(), "prefix": torch.zeros(feats.shape[0], 0, dtype=torch.long)}

    def expand_state(self, state, k):
        return {n: v.repeat_interleave(k, 0) for n, v in state.items()}

    def step(self, last, state):
        state["prefix"] = torch.cat([state["prefix"], last[:, None]], 1)
        return torch.stack([table(self.seed, int(i), tuple(p[1:].tolist()), self.eos_shift)
                            for i, p in zip(state["img"], state["prefix"])])

    def reorder_state(self, state, index):
        return {n: v.index_select(0, index) for n, v in state.items()}

    def _select_rows(self, state, index):
        return {n: v.index_select(0, index) for n, v in state.items()}


def all_captions(max_len, words=range(3, V)):
    for n in range(max_len + 1):
        for ws in itertools.product(words, repeat=n):
            yield ws


def exhaustive(logp_fn, max_len, min_len=0):
    """[(score, caption + (<eos>,))] of every caption, best first; logp_fn(prefix tuple) -> (V,) log-probs."""
    out = []
    for ws in all_captions(max_len):
        if len(ws) < min_len:
            continue
        s = sum(float(logp_fn(ws[:i])[w]) for i, w in enumerate(ws)) + float(logp_fn(ws)[EOS])
        out.append((s, ws + (EOS,)))
    return sorted(out, key=lambda x: -x[0])


def strip(seq):
    seq = list(seq)
    return tuple(seq[:seq.index(EOS) + 1]) if EOS in seq else tuple(w for w in seq if w != PAD)


def feats_of(ids):
    return torch.tensor(ids, dtype=torch.float64)[:, None], torch.ones(len(ids), 1, dtype=torch.bool)


@pytest.mark.parametrize("max_len", [1, 2, 3])
@pytest.mark.parametrize("eos_shift", [0.0, 3.0, -6.0], ids=["mixed", "early-eos", "late-eos"])
@pytest.mark.parametrize("can_select", [True, False], ids=["compact", "kept"])
def test_full_width_beam_is_exhaustive_search(eos_shift, can_select, max_len):
    ids = [0, 1, 2]
    n = sum(4 ** i for i in range(max_len + 1))  # 85 captions
    feats, mask = feats_of(ids)
    beams, scores = beam_search(Stub(0, eos_shift, can_select), feats, mask, beam_size=n, max_len=max_len,
                                all_beams=True)
    for b, img in enumerate(ids):
        truth = exhaustive(lambda p: table(0, img, p, eos_shift), max_len)
        got = [(float(s), strip(seq)) for s, seq in zip(scores[b], beams[b].tolist())]
        assert [c for _, c in got] == [c for _, c in truth]
        assert [s for s, _ in got] == pytest.approx([s for s, _ in truth], abs=1e-9)
        # pad 0 after <eos>, nothing else
        for seq in beams[b].tolist():
            e = seq.index(EOS)
            assert all(w == PAD for w in seq[e + 1:]) and all(w > EOS for w in seq[:e])
    # wider than the captions that exist: the best one alone is still the true best
    seq, score = beam_search(Stub(0, eos_shift, can_select), feats, mask, beam_size=n + 7, max_len=max_len)
    for b, img in enumerate(ids):
        best = exhaustive(lambda p: table(0, img, p, eos_shift), max_len)[0]
        assert strip(seq[b].tolist()) == best[1] and float(score[b]) == pytest.approx(best[0], abs=1e-9)


@pytest.mark.parametrize("k", [2, 3, 5, 8])
@pytest.mark.parametrize("eos_shift", [0.0, 3.0, -6.0], ids=["mixed", "early-eos", "late-eos"])
def test_an_image_alone_decodes_as_in_a_batch(k, eos_shift):
    ids, max_len = [4, 5, 6, 7, 8], 4
    feats, mask = feats_of(ids)
    for can_select in (True, False):
        beams, scores = beam_search(Stub(1, eos_shift, can_select), feats, mask, beam_size=k, max_len=max_len,
                                    all_beams=True)
        for b, img in enumerate(ids):
            f1, m1 = feats_of([img])
            b1, s1 = beam_search(Stub(1, eos_shift, can_select), f1, m1, beam_size=k, max_len=max_len,
                                 all_beams=True)
            assert [strip(s) for s in beams[b].tolist()] == [strip(s) for s in b1[0].tolist()]
            assert torch.equal(scores[b], s1[0])
            # scores are those of the sequences returned
            for seq, s in zip(b1[0].tolist(), s1[0].tolist()):
                c = strip(seq)
                ref = sum(float(table(1, img, c[:i], eos_shift)[w]) for i, w in enumerate(c))
                assert s == pytest.approx(ref, abs=1e-9)


@pytest.mark.parametrize("eos_shift", [0.0, 3.0, -6.0])
@pytest.mark.parametrize("max_len", [1, 2, 4])
def test_beam_one_is_greedy(eos_shift, max_len):
    ids = [0, 1, 2, 3, 9]
    feats, mask = feats_of(ids)
    seq, score = beam_search(Stub(2, eos_shift), feats, mask, beam_size=1, max_len=max_len)
    g = greedy(Stub(2, eos_shift), feats, mask, max_len=max_len)
    for b, img in enumerate(ids):
        # follow argmax by hand: max_len words, then <eos> forced (beam); greedy cuts at max_len tokens
        ws = []
        while len(ws) < max_len:
            w = int(table(2, img, tuple(ws), eos_shift).argmax())
            ws.append(w)
            if w == EOS:
                break
        full = tuple(ws) if ws and ws[-1] == EOS else tuple(ws) + (EOS,)
        assert strip(seq[b].tolist()) == full
        assert strip(g[b].tolist()) == tuple(ws)
        ref = sum(float(table(2, img, full[:i], eos_shift)[w]) for i, w in enumerate(full))
        assert float(score[b]) == pytest.approx(ref, abs=1e-9)


def test_max_len_zero_is_the_empty_caption():
    feats, mask = feats_of([0, 1])
    seq, score = beam_search(Stub(0), feats, mask, beam_size=3, max_len=0)
    assert seq.tolist() == [[EOS], [EOS]]
    assert score.tolist() == pytest.approx([float(table(0, i, ())[EOS]) for i in (0, 1)])
    # greedy (caption_batches' beam_size 1) at max_len 0: the empty caption too, not a crash of torch.stack([])
    g = greedy(Stub(0), feats, mask, max_len=0)
    assert g.shape == (2, 0) and g.dtype == torch.long


def test_all_end_at_the_first_step_with_beam_one():
    feats, mask = feats_of([0, 1, 2])
    seq, score = beam_search(Stub(0, eos_shift=50.0), feats, mask, beam_size=1, max_len=5)
    assert seq.tolist() == [[EOS]] * 3


@pytest.mark.parametrize("min_len", [1, 2])
def test_min_length_beam_is_exhaustive_search(min_len):
    max_len, ids = 3, [0, 3]
    n = sum(4 ** i for i in range(min_len, max_len + 1))
    feats, mask = feats_of(ids)
    beams, scores = beam_search(MinLengthStepper(Stub(3, 2.0), EOS, min_len), feats, mask, beam_size=n,
                                max_len=max_len, all_beams=True)
    for b, img in enumerate(ids):
        truth = exhaustive(lambda p: table(3, img, p, 2.0), max_len, min_len)
        assert [strip(s) for s in beams[b].tolist()] == [c for _, c in truth]
        assert scores[b].tolist() == pytest.approx([s for s, _ in truth], abs=1e-9)


def test_ensemble_of_one_stub_is_the_stub_and_of_two_averages_probabilities():
    max_len, ids, n = 3, [0, 1, 2], 85
    feats, mask = feats_of(ids)
    b1, s1 = beam_search(Stub(4), feats, mask, beam_size=5, max_len=max_len, all_beams=True)
    be, se = beam_search(EnsembleStepper([Stub(4)]), feats, mask, beam_size=5, max_len=max_len, all_beams=True)
    assert torch.equal(b1, be) and torch.allclose(s1, se, atol=1e-12)
    beams, scores = beam_search(EnsembleStepper([Stub(4), Stub(5, 1.0)]), feats, mask, beam_size=n,
                                max_len=max_len, all_beams=True)
    for b, img in enumerate(ids):
        avg = lambda p: ((table(4, img, p).exp() + table(5, img, p, 1.0).exp()) / 2).log()  # noqa: E731
        truth = exhaustive(avg, max_len)
        assert [strip(s) for s in beams[b].tolist()] == [c for _, c in truth]
        assert scores[b].tolist() == pytest.approx([s for s, _ in truth], abs=1e-9)


def _model(seed):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=16, layers=2, heads=2, d_ff=32, dropout=0.0, feature_dim=8, max_regions=4,
                      fusion="gate")
    model = build_model(cfg, vocab_size=V).double().eval()
    with torch.no_grad():
        model.embed.weight.mul_(3.0)
        model.head.weight.mul_(4.0)
    return model


@pytest.mark.parametrize("which", ["model", "uncached", "ensemble"])
def test_real_model_full_width_beam_is_exhaustive_search(which):
    models = [_model(0), _model(1)]
    torch.manual_seed(7)
    feats = torch.randn(3, 4, 8, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    make = {"model": lambda: ModelStepper(models[0]), "uncached": lambda: UncachedStepper(models[0]),
            "ensemble": lambda: EnsembleStepper(models)}[which]
    max_len, n = 3, 85
    beams, scores = beam_search(make(), feats, mask, beam_size=n, max_len=max_len, all_beams=True)
    for b in range(3):
        ms = models if which == "ensemble" else models[:1]

        @lru_cache(maxsize=None)
        @torch.no_grad()
        def logp(prefix, b=b, ms=tuple(ms)):
            tokens = torch.tensor([[BOS, *prefix]])
            out = []
            for m in ms:
                st = UncachedStepper(m)
                state = st.init_state(feats[b:b + 1], mask[b:b + 1])
                state["prefix"] = tokens[:, :-1]
                out.append(st.step(tokens[:, -1], state)[0])
            return torch.logsumexp(torch.stack(out), 0) - math.log(len(out))

        truth = exhaustive(logp, max_len)
        assert [strip(s) for s in beams[b].tolist()] == [c for _, c in truth]
        assert scores[b].tolist() == pytest.approx([s for s, _ in truth], abs=1e-9)
        # the same image decoded alone, narrow beam
        s_all, _ = beam_search(make(), feats, mask, beam_size=3, max_len=max_len)
        s_one, _ = beam_search(make(), feats[b:b + 1], mask[b:b + 1], beam_size=3, max_len=max_len)
        assert strip(s_all[b].tolist()) == strip(s_one[0].tolist())


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("which", ["model", "uncached", "ensemble", "min-length"])
def test_real_model_images_ending_at_different_steps_decode_as_alone(k, which):
    """<eos> made very likely for some images (and not others) so that images leave the batch at the first step,
    later, or never before max_len."""
    models = [_model(0), _model(1)]
    with torch.no_grad():
        torch.manual_seed(0)
        for m in models:
            m.head.weight[EOS] += 6.0 * torch.randn(16, dtype=torch.float64)
    torch.manual_seed(3)
    feats = torch.randn(6, 4, 8, dtype=torch.float64)
    mask = torch.ones(6, 4, dtype=torch.bool)
    make = {"model": lambda: ModelStepper(models[0]), "uncached": lambda: UncachedStepper(models[0]),
            "ensemble": lambda: EnsembleStepper(models),
            "min-length": lambda: MinLengthStepper(EnsembleStepper(models), EOS, 1)}[which]
    seqs, scores = beam_search(make(), feats, mask, beam_size=k, max_len=5)
    lengths = set()
    for b in range(6):
        s1, sc1 = beam_search(make(), feats[b:b + 1], mask[b:b + 1], beam_size=k, max_len=5)
        assert strip(seqs[b].tolist()) == strip(s1[0].tolist())
        assert float(scores[b]) == pytest.approx(float(sc1[0]), abs=1e-9)
        lengths.add(len(strip(seqs[b].tolist())))
    if k == 1:
        # greedy cuts at max_len tokens, beam search forces <eos> after max_len words: the same first max_len
        g = greedy(make(), feats, mask, max_len=5)
        for b in range(6):
            assert strip(g[b].tolist()) == strip(seqs[b].tolist()[:5])
    assert len(lengths) > 1  # the images did end at different steps


def test_greedy_of_an_ensemble_follows_the_averaged_distribution():
    feats, mask = feats_of([0, 1, 2, 3])
    g = greedy(EnsembleStepper([Stub(4), Stub(5, 1.0)]), feats, mask, max_len=4)
    for b in range(4):
        ws = []
        while len(ws) < 4 and (not ws or ws[-1] != EOS):
            p = table(4, b, tuple(ws)).exp() + table(5, b, tuple(ws), 1.0).exp()
            ws.append(int(p.argmax()))
        assert strip(g[b].tolist()) == tuple(ws)


def test_sample_returns_the_log_probabilities_of_its_words():
    from a2core.decode import sample
    model = _model(2)
    torch.manual_seed(5)
    feats, mask = torch.randn(3, 4, 8, dtype=torch.float64), torch.ones(3, 4, dtype=torch.bool)
    torch.manual_seed(6)
    tokens, logps, masks = sample(model, feats, mask, n=4, max_len=5)
    assert tokens.shape[0] == 12
    with torch.no_grad():
        for r in range(12):
            b = r // 4  # an image's n samples adjacent
            row = tokens[r].tolist()
            st = UncachedStepper(model)
            state = st.init_state(feats[b:b + 1], mask[b:b + 1])
            last = torch.tensor([BOS])
            ended = False
            for i, w in enumerate(row):
                if ended:
                    assert w == PAD and not masks[r, i] and float(logps[r, i]) == 0.0
                    continue
                lp = st.step(last, state)[0]
                assert masks[r, i] and float(logps[r, i]) == pytest.approx(float(lp[w]), abs=1e-9)
                assert w > EOS or w == EOS
                ended = w == EOS
                last = torch.tensor([w])


def test_beam_search_reaches_the_last_position_the_model_has():
    """Beam search feeds <bos> and max_len words: max_len + 1 positions (`decode_to_file`'s bound)."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, layers=1, heads=2, d_ff=32, dropout=0.0, feature_dim=8, max_regions=4,
                      fusion="gate")
    model = build_model(cfg, vocab_size=V, max_len=4).eval()  # positions: 6
    feats, mask = torch.randn(2, 4, 8), torch.ones(2, 4, dtype=torch.bool)
    longest = model.pos.shape[0] - 1
    seq, score = beam_search(model, feats, mask, beam_size=3, max_len=longest)
    assert seq.shape[1] <= longest + 1 and torch.isfinite(score).all()
    with pytest.raises(ValueError, match="caption positions"):
        with torch.no_grad():
            model.head.weight[EOS] = -1e4  # never ends early: the last step needs position longest + 1
        beam_search(model, feats, mask, beam_size=3, max_len=longest + 1)


def test_encoded_members_searched_again_decode_as_fresh_models():
    """`ensemble_captions`' flow: each member encodes the batch once; the ensemble's search, then each member's own
    (and a second time) start from that encoding, and equal fresh searches."""
    from a2core.decode import EncodedStepper
    models = [_model(0), _model(1)]
    torch.manual_seed(0)
    with torch.no_grad():
        for m in models:
            m.head.weight[EOS] += 6.0 * torch.randn(16, dtype=torch.float64)
    torch.manual_seed(3)
    feats, mask = torch.randn(6, 4, 8, dtype=torch.float64), torch.ones(6, 4, dtype=torch.bool)
    members = [ModelStepper(m) for m in models]
    encoded = [EncodedStepper(s, s.init_state(feats, mask)) for s in members]
    ens = beam_search(EnsembleStepper(encoded), feats, mask, beam_size=3, max_len=5, all_beams=True)
    ref = beam_search(EnsembleStepper(models), feats, mask, beam_size=3, max_len=5, all_beams=True)
    assert torch.equal(ens[0], ref[0]) and torch.equal(ens[1], ref[1])
    for _ in range(2):
        for e, m in zip(encoded, models):
            got, want = beam_search(e, feats, mask, beam_size=3, max_len=5), beam_search(m, feats, mask, 3, 5)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert torch.equal(greedy(e, feats, mask, 5), greedy(m, feats, mask, 5))
