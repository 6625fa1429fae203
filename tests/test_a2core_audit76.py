"""Audit of a2core's decoding, SCST step and CIDEr-D on what the other tests leave out:

* an ensemble of copies of one fp32 checkpoint is that checkpoint bit for bit (log-probabilities, beam scores and
  captions), and the averaged distribution is right by hand and at -inf;
* narrow beams (not only full-width ones) equal an independent list-based beam search, batch of one, max_len 1 and
  <eos> as the best first word included;
* an image with few regions decodes the same padded in a batch (whatever is in its padded slots) as alone, unpadded;
* decoding changes neither the global RNG, grad mode nor the model's mode;
* sampled log-probabilities carry the gradient of a teacher-forced pass;
* one SCST step's loss, with real candidates and the real CIDEr-D reward, equals a hand computation, each
  candidate scored against its own image's references;
* CiderD.scores of reference lists handed out fresh per item (a lazy sequence) equals that of a plain list.
"""
from __future__ import annotations

import copy
import math
import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import a2core.train as train_mod
from a2core.config import Config, ModelConfig
from a2core.data import synthetic
from a2core.decode import (EnsembleStepper, ModelStepper, UncachedStepper, beam_search, greedy,
                           mean_of_distributions, sample)
from a2core.metrics import CiderD
from a2core.model.a2 import build_model, next_word_logp
from tests.test_beam_exhaustive import Stub, table

pytestmark = [pytest.mark.outside_ray_group, pytest.mark.usefixtures("one_torch_thread")]

PAD, BOS, EOS = 0, 1, 2
V = 7  # <pad> <bos> <eos> and words 3..6


def _model(seed, vocab=V, dtype=torch.float32, dropout=0.0, fusion="gate", mask_net="content", max_len=64, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=16, layers=2, heads=2, d_ff=32, dropout=dropout, feature_dim=8, max_regions=4,
                      fusion=fusion, mask_net=mask_net, **kw)
    model = build_model(cfg, vocab_size=vocab, max_len=max_len).to(dtype).eval()
    with torch.no_grad():  # sharper distributions than the initial near-uniform ones
        model.embed.weight.mul_(3.0)
    return model


# -- ensembles ------------------------------------------------------------------------------------------------------
def test_the_averaged_distribution_by_hand():
    p1, p2 = torch.tensor([0.5, 0.25, 0.25, 0.0]), torch.tensor([0.1, 0.1, 0.8, 0.0])
    got = mean_of_distributions(torch.stack([p1.log(), p2.log()]))
    assert torch.allclose(got.exp(), torch.tensor([0.3, 0.175, 0.525, 0.0]), atol=1e-7)
    assert got[3] == float("-inf")  # impossible for every member: impossible for the ensemble
    one_impossible = mean_of_distributions(torch.tensor([[-1.0, float("-inf")], [float("-inf"), -2.0]]))
    assert torch.allclose(one_impossible, torch.tensor([-1.0 - math.log(2), -2.0 - math.log(2)]))
    assert torch.isnan(mean_of_distributions(torch.tensor([[float("nan")], [-1.0]]))).all()  # a diverged member
    # fp32 against the float64 value, members far apart
    torch.manual_seed(0)
    members = (4.0 * torch.randn(3, 50, 40, dtype=torch.float64)).log_softmax(-1)
    want = torch.logsumexp(members, 0) - math.log(3)
    assert torch.allclose(mean_of_distributions(members.float()).double(), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("copies", [2, 3])
def test_an_ensemble_of_copies_of_one_fp32_checkpoint_is_that_checkpoint_bit_for_bit(copies):
    """logsumexp(l, l) - log 2 is a few ulps off l in fp32: the scores of two copies of a checkpoint differed from
    the checkpoint's, and near-tied beams could be ordered otherwise."""
    model = _model(0, vocab=40)
    ens = EnsembleStepper([model] + [copy.deepcopy(model) for _ in range(copies - 1)])
    torch.manual_seed(1)
    feats, mask = torch.randn(6, 4, 8), torch.ones(6, 4, dtype=torch.bool)
    mask[1, 2:] = False
    with torch.no_grad():
        one, many = ModelStepper(model), ens
        s1, s2 = one.init_state(feats, mask), many.init_state(feats, mask)
        last = torch.full((6,), BOS)
        for _ in range(4):  # a few steps of the same words: every step's log-probabilities equal, bit for bit
            l1, l2 = one.step(last, s1), many.step(last, s2)
            assert torch.equal(l1, l2)
            last = l1.argmax(-1)
    for k in (1, 3, 5):
        seq1, sc1 = beam_search(model, feats, mask, k, 12, all_beams=True)
        seq2, sc2 = beam_search(ens, feats, mask, k, 12, all_beams=True)
        assert torch.equal(seq1, seq2) and torch.equal(sc1, sc2)
    assert torch.equal(greedy(model, feats, mask, 12), greedy(ens, feats, mask, 12))


# -- narrow beams against a reference beam search ---------------------------------------------------------------------
# the stepper of tests/test_beam_exhaustive.py: its next-word distribution a fixed random function of (image =
# feats[i, 0], words so far), `table`


def _reference_beam(logp, k, max_len):
    """Textbook beam search: each step, the finished hypotheses (kept as they are) and every one-word extension of
    the others compete for the k places; after max_len words only <eos> may follow. [(words + (<eos>,), score)]."""
    beams = [((), 0.0, False)]
    for t in range(max_len + 1):
        cands = []
        for words, score, done in beams:
            if done:
                cands.append((words, score, True))
                continue
            lp = logp(words)
            for w in (range(3, V) if t < max_len else ()):
                cands.append((words + (w,), score + float(lp[w]), False))
            cands.append((words + (EOS,), score + float(lp[EOS]), True))
        beams = sorted(cands, key=lambda c: -c[1])[:k]
        if all(done for _, _, done in beams):
            break
    return [(words, score) for words, score, _ in beams]


def _strip(seq):
    return tuple(seq[:seq.index(EOS) + 1])


@pytest.mark.parametrize("trial", range(40))
def test_narrow_beams_equal_a_reference_beam_search(trial):
    rng = random.Random(trial)
    seed, eos_shift = rng.randint(0, 99), rng.choice([-6.0, 0.0, 1.0, 3.0, 8.0])  # 8: <eos> the best first word
    k, max_len, images = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 5])
    ids = rng.sample(range(50), images)
    feats = torch.tensor(ids, dtype=torch.float64)[:, None]
    mask = torch.ones(images, 1, dtype=torch.bool)
    for can_select in (True, False):
        stub = Stub(seed, eos_shift, can_select)
        seqs, scores = beam_search(stub, feats, mask, k, max_len, all_beams=True)
        assert seqs.shape[:2] == (images, k) and seqs.shape[2] <= max_len + 1
        for b, img in enumerate(ids):
            want = _reference_beam(lambda words: table(seed, img, words, eos_shift), k, max_len)
            got = [_strip(s) for s in seqs[b].tolist()]
            assert got == [w for w, _ in want]
            assert scores[b].tolist() == pytest.approx([s for _, s in want], abs=1e-9)
            for s in seqs[b].tolist():  # pad 0 after <eos>, real words before it
                e = s.index(EOS)
                assert all(w == PAD for w in s[e + 1:]) and all(w > EOS for w in s[:e])
        best, best_score = beam_search(Stub(seed, eos_shift, can_select), feats, mask, k, max_len)
        assert torch.equal(best, seqs[:, 0, :best.shape[1]]) and torch.equal(best_score, scores[:, 0])


# -- regions, modes, RNG --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fusion,mask_net,extra", [("gate", "content", {}), ("gate", "linear", {}),
                                                   ("exp_decay", "content", {"temperature": 3.0}),
                                                   ("moving_average", "linear", {"eta": 0.5}),
                                                   ("max", "content", {"renormalize": True}), ("none", "content", {})])
def test_an_image_with_few_regions_decodes_the_same_padded_in_a_batch_as_alone(fusion, mask_net, extra):
    model = _model(3, dtype=torch.float64, fusion=fusion, mask_net=mask_net, **extra)
    model.train_step.fill_(5)
    torch.manual_seed(0)
    feats = torch.randn(3, 4, 8, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    feats[~mask] = 50.0  # whatever the padded slots hold
    batch = beam_search(model, feats, mask, 3, 6, all_beams=True)
    for b, regions in enumerate((4, 2, 1)):
        alone = beam_search(model, feats[b:b + 1, :regions], mask[b:b + 1, :regions], 3, 6, all_beams=True)
        width = alone[0].shape[2]
        assert torch.equal(batch[0][b, :, :width], alone[0][0]) and not batch[0][b, :, width:].any()
        assert torch.allclose(batch[1][b], alone[1][0], atol=1e-12)
        g_batch, g_alone = greedy(model, feats, mask, 6), greedy(model, feats[b:b + 1, :regions],
                                                                  mask[b:b + 1, :regions], 6)
        assert g_batch[b, :g_alone.shape[1]].tolist() == g_alone[0].tolist()


def test_decoding_changes_neither_the_rng_nor_grad_mode_nor_the_models_mode():
    models = [_model(0), _model(1)]
    torch.manual_seed(2)
    feats, mask = torch.randn(3, 4, 8), torch.ones(3, 4, dtype=torch.bool)
    rng = torch.get_rng_state()
    for stepper in (models[0], UncachedStepper(models[0]), EnsembleStepper(models)):
        beam_search(stepper, feats, mask, 3, 5)
        greedy(stepper, feats, mask, 5)
    assert torch.equal(torch.get_rng_state(), rng)  # eval mode: no dropout, no draw
    assert torch.is_grad_enabled() and not any(m.training for m in models)
    models[0].train()
    beam_search(models[0], feats, mask, 3, 5)
    assert models[0].training and torch.is_grad_enabled()


# -- SCST ------------------------------------------------------------------------------------------------------------
def test_sampled_log_probabilities_carry_the_teacher_forced_gradient():
    """`sample` builds its graph step by step through the decoder cache; its REINFORCE gradient must be that of one
    teacher-forced pass over the same words (pads after <eos> contributing nothing, not NaN)."""
    model = _model(0, vocab=9, dtype=torch.float64).train()  # dropout 0: both passes see the same model
    with torch.no_grad():
        # <eos> likely enough that lengths vary: its logit is 0.5 x the last state's sum (0.15 d_model: norm3's bias)
        model.decoder[-1].norm3.bias.fill_(0.15)
        model.embed.weight[EOS] = 0.5
    torch.manual_seed(1)
    feats = torch.randn(3, 4, 8, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    tokens, logps, valid = sample(model, feats, mask, 4, max_len=20)
    assert len({int(v.sum()) for v in valid}) > 1
    advantage = torch.randn(tokens.shape[0], 1, dtype=torch.float64)
    params = list(model.captioner_parameters())
    loss = -(advantage * logps * valid).sum() / valid.shape[0]
    got = torch.autograd.grad(loss, params, allow_unused=True)
    inp = torch.cat([torch.full_like(tokens[:, :1], BOS), tokens[:, :-1]], 1)
    logits, _ = model(feats, mask, inp)
    teacher = next_word_logp(logits).gather(-1, tokens[..., None]).squeeze(-1).masked_fill(~valid, 0.0)
    want = torch.autograd.grad(-(advantage * teacher * valid).sum() / valid.shape[0], params, allow_unused=True)
    assert float(loss.detach()) == pytest.approx(float(-(advantage * teacher.detach() * valid).sum() / valid.shape[0]),
                                                 abs=1e-12)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-10)


@pytest.fixture(scope="module")
def synth_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit76") / "synth"
    synthetic.generate(root, seed=31, images=60)
    return root


@pytest.mark.parametrize("candidates", ["sample", "beam"])
def test_one_scst_step_by_hand_with_the_real_reward(synth_root, tmp_path, monkeypatch, candidates):
    k = 3
    cfg = Config.from_dict({
        "data": {"root": str(synth_root), "images": 60, "seed": 31},
        "model": {"d_model": 32, "layers": 2, "heads": 4, "d_ff": 64, "max_regions": 10, "fusion": "gate"},
        "train": {"xe_epochs": 0, "scst_epochs": 1, "log_every": 1000, "scst_samples": k, "batch_size": 50,
                  "scst_candidates": candidates, "max_len": 8}})
    trainer = train_mod.Trainer(cfg, tmp_path)
    seen = {}
    real_sample, real_beam = train_mod.sample, trainer.beam_candidates

    def recording_sample(*args, **kwargs):
        seen["out"] = real_sample(*args, **kwargs)
        return seen["out"]

    def recording_beam(*args, **kwargs):
        seen["out"] = real_beam(*args, **kwargs)
        return seen["out"]

    monkeypatch.setattr(train_mod, "sample", recording_sample)
    monkeypatch.setattr(trainer, "beam_candidates", recording_beam)
    losses = []
    monkeypatch.setattr(trainer.updates, "apply", lambda loss, params, opt, clip=0.0: losses.append(loss.detach()))
    batch = next(iter(trainer._batches("scst")))
    monkeypatch.setattr(trainer, "_batches", lambda stage="xe": [batch])
    out = trainer.scst_epoch()

    tokens, logps, valid = seen["out"]
    ids = batch["image_ids"].tolist()
    assert tokens.shape[0] == len(ids) * k
    for b, image_id in enumerate(ids):  # row b of the batch is image ids[b]: its candidates are rows b*k .. b*k+k-1
        feats, _ = trainer.data.region_features(image_id)
        assert torch.equal(batch["feats"][b].float(), torch.from_numpy(feats))
    refs = trainer.data.references("train")
    cider = CiderD.from_corpus(list(refs.values()))  # train.scst_reward_df "images": one document per image
    words = [trainer.vocab.decode(row) for row in tokens.tolist()]
    reward = torch.tensor(cider.scores(words, [refs[i] for i in ids for _ in range(k)])).view(-1, k)
    assert reward.std() > 0  # the rewards differ: the baseline matters
    if candidates == "sample":  # the mean of the image's other samples
        baseline = (reward.sum(1, keepdim=True) - reward) / (k - 1)
    else:  # M2: the mean of the image's k beams, itself included
        baseline = reward.mean(1, keepdim=True)
    # every row's log-probability: the sum over its words up to and including the first <eos>, nothing after it
    eos_at = [row.index(EOS) if EOS in row else len(row) - 1 for row in tokens.tolist()]
    assert valid.sum(1).tolist() == [e + 1 for e in eos_at]
    assert (logps.detach()[~valid] == 0).all()
    sums = torch.stack([logps.detach()[r, :e + 1].double().sum() for r, e in enumerate(eos_at)]).view(-1, k)
    want = -((reward - baseline) * sums).sum() / (len(ids) * k)
    assert float(losses[0]) == pytest.approx(float(want), rel=1e-5, abs=1e-8)
    assert out["train/reward"] == pytest.approx(float(reward.mean()), rel=1e-6)


# -- CIDEr-D -------------------------------------------------------------------------------------------------------
class _FreshLists(Sequence):
    """Reference lists handed out as a new list at every access (a lazy view of some storage)."""

    def __init__(self, groups):
        self.groups = groups

    def __len__(self):
        return len(self.groups)

    def __getitem__(self, i):
        return list(self.groups[i])


def test_ciderd_scores_of_reference_lists_made_per_item_equal_those_of_a_list():
    """The reference lists are deduplicated by id(): a list freed after its turn could hand its id() to the next
    one, which was then scored against the freed list's references."""
    rng = random.Random(0)
    pool = [("a dog runs",), ("a cat sits",), ("two birds fly",), ("a dog sits here",)]
    groups = [rng.choice(pool) for _ in range(200)]
    cands = [rng.choice(["a dog runs on grass", "a cat sits", "birds fly"]) for _ in groups]
    scorer = CiderD.from_corpus([list(p) for p in pool])
    want = scorer.scores(cands, [list(g) for g in groups])
    np.testing.assert_allclose(scorer.scores(cands, _FreshLists(groups)), want, rtol=0, atol=1e-12)
    # and each is the candidate's score against its own references alone
    alone = np.array([scorer.scores([c], [list(g)])[0] for c, g in zip(cands, groups)])
    np.testing.assert_allclose(want, alone, rtol=0, atol=1e-12)
    # df from the call's references (pycocoevalcap's mode) too
    corpus = CiderD()
    np.testing.assert_allclose(corpus.scores(cands, _FreshLists(groups)),
                               corpus.scores(cands, [list(g) for g in groups]), rtol=0, atol=1e-12)

