"""The training recipe against M2's code (aimagelab/meshed-memory-transformer, the snapshot at commit 239100b), the
code the paper builds on: the XE learning-rate schedule, the SCST loss and its baseline, and the CIDEr-D reward.

M2's formulas are transcribed below, each with the file and lines it comes from; nothing is imported from M2 or
fetched at test time. Where a2tune differs on purpose (docs/explanation/model.md, "Recipe vs. the paper and M2"),
the test pins the documented relation, so that an undocumented change of it fails here:
  * Noam: the same formula and the same 0-based step (s = step + 1); M2 also calls `scheduler.step()` once at the
    start of every epoch (train.py:72), which a2tune does not copy: M2's update j of epoch e (0-based) runs at the
    rate of a2tune's update j + e + 1.
  * SCST loss: a2tune sums the word log-probabilities of a candidate (up to and including <eos>) where M2 averages
    its max_len (20) positions (zeros after <eos>): a2tune's loss is exactly max_len x M2's, same direction.
"""
from __future__ import annotations

import math
import random
from collections import defaultdict

import numpy as np
import pytest
import torch

from a2core.config import Config
from a2core.data import synthetic
from a2core.metrics import CiderD
from a2core.train import Trainer, Updates, learning_rate, noam

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEED = 5


# -- M2, transcribed -----------------------------------------------------------------------------------------------
def m2_lambda_lr(s: int, d_model: int, warmup: int) -> float:
    """M2 train.py:191-194 (`lambda_lr`), the LambdaLR factor of the base lr 1 (train.py:198)."""
    warm_up = warmup
    s += 1
    return (d_model ** -.5) * min(s ** -.5, s * warm_up ** -1.5)


def m2_xe_rates(epochs: int, batches: int, d_model: int, warmup: int) -> list[list[float]]:
    """The rate of each `optim.step()` of M2's XE stage: LambdaLR built once (train.py:199), `scheduler.step()` at the
    start of `train_xe` (train.py:72) and after each batch (train.py:90). Replayed with torch's own LambdaLR."""
    p = torch.nn.Parameter(torch.zeros(1))
    optim = torch.optim.Adam([p], lr=1, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: m2_lambda_lr(s, d_model, warmup))
    out = []
    for _ in range(epochs):
        scheduler.step()  # train.py:72
        rates = []
        for _ in range(batches):
            rates.append(optim.param_groups[0]["lr"])  # what optim.step() (train.py:84) uses
            scheduler.step()  # train.py:90
        out.append(rates)
    return out


def m2_scst_loss(log_probs: torch.Tensor, reward: torch.Tensor) -> torch.Tensor:
    """M2 train.py:118-122: log_probs (B, beam, max_len), zero after <eos> (beam_search.py:110-112), reward
    (B, beam); the baseline is the mean reward of the image's beams, the beam itself included."""
    reward_baseline = torch.mean(reward, -1, keepdim=True)
    loss = -torch.mean(log_probs, -1) * (reward - reward_baseline)
    return loss.mean()


def _m2_precook(s, n=4):  # evaluation/cider/cider_scorer.py:10-25
    words = s.split()
    counts = defaultdict(int)
    for k in range(1, n + 1):
        for i in range(len(words) - k + 1):
            counts[tuple(words[i:i + k])] += 1
    return counts


class M2Cider:
    """evaluation/cider/cider.py (Cider) with evaluation/cider/cider_scorer.py (CiderScorer): document frequencies
    and ref_len fixed from `gts` at construction (cider.py:24-27, cider_scorer.py:66-70 and 82-85), scoring with
    the vrama91 clipping (cider_scorer.py:133), the Gaussian length penalty sigma 6 over the bigram count
    (cider_scorer.py:110-111, 126, 140), mean over n, / refs, x 10 (cider_scorer.py:153-157)."""

    def __init__(self, gts: dict, n: int = 4, sigma: float = 6.0):
        self.n, self.sigma = n, sigma
        crefs = [[_m2_precook(r, n) for r in gts[k]] for k in gts]
        self.doc_frequency = defaultdict(float)
        for refs in crefs:
            for ngram in set(ng for ref in refs for ng in ref):
                self.doc_frequency[ngram] += 1
        self.ref_len = np.log(float(len(crefs)))

    def _vec(self, cnts):
        vec = [defaultdict(float) for _ in range(self.n)]
        norm = [0.0] * self.n
        length = 0
        for ngram, tf in cnts.items():
            df = np.log(max(1.0, self.doc_frequency.get(ngram, 0.0)))
            i = len(ngram) - 1
            vec[i][ngram] = float(tf) * (self.ref_len - df)
            norm[i] += vec[i][ngram] ** 2
            if i == 1:
                length += tf
        return vec, [np.sqrt(x) for x in norm], length

    def compute_score(self, gts: dict, res: dict):
        scores = []
        for k in gts:
            vec, norm, length = self._vec(_m2_precook(res[k][0], self.n))
            score = np.zeros(self.n)
            for ref in gts[k]:
                vr, nr, lr = self._vec(_m2_precook(ref, self.n))
                delta = float(length - lr)
                val = np.zeros(self.n)
                for i in range(self.n):
                    for ngram in vec[i]:
                        val[i] += min(vec[i][ngram], vr[i].get(ngram, 0.0)) * vr[i].get(ngram, 0.0)
                    if norm[i] != 0 and nr[i] != 0:
                        val[i] /= norm[i] * nr[i]
                    val[i] *= np.e ** (-(delta ** 2) / (2 * self.sigma ** 2))
                score += val
            scores.append(np.mean(score) / len(gts[k]) * 10.0)
        return np.mean(scores), np.array(scores)


# -- fixtures --------------------------------------------------------------------------------------------------------
def _raw(root, **train) -> dict:
    return {"data": {"root": str(root), "images": 60, "seed": SEED, "val_images": 8},
            "model": {"d_model": 32, "layers": 1, "heads": 2, "d_ff": 64, "max_regions": 10, "fusion": "gate",
                      "dropout": 0.0},
            "train": {"xe_epochs": 2, "batch_size": 10, "warmup": 7, "lr_factor": 1.0, "log_every": 1000, **train}}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipe-m2") / "synth"
    synthetic.ensure(str(path), SEED, 60)  # 30 train images
    return path


# -- the XE learning-rate schedule -----------------------------------------------------------------------------------
@pytest.mark.parametrize("d_model,warmup", [(512, 10000), (32, 7), (64, 1)])
def test_noam_is_m2s_lambda_lr_at_every_step(d_model, warmup):
    for step in [0, 1, 2, warmup - 2, warmup - 1, warmup, warmup + 1, 11_328, 226_579]:
        if step < 0:
            continue
        assert noam(step, d_model, warmup) == m2_lambda_lr(step, d_model, warmup)
        assert learning_rate(step, d_model, warmup) == m2_lambda_lr(step, d_model, warmup)
    # the paper's sizes: the first update at 512^-0.5 * 10000^-1.5, the peak at step 9999 (s = warmup)
    assert noam(0, 512, 10000) == pytest.approx(512 ** -0.5 * 1e-6, rel=1e-12)
    assert noam(9999, 512, 10000) == pytest.approx(512 ** -0.5 * 1e-2, rel=1e-12)
    assert max(noam(s, 512, 10000) for s in range(9990, 10010)) == noam(9999, 512, 10000)
    assert noam(3, 512, 10000, factor=0.25) == pytest.approx(0.25 * m2_lambda_lr(3, 512, 10000), rel=1e-15)


def test_each_update_takes_the_rate_of_its_0_based_step_and_m2s_runs_e_plus_1_steps_ahead(root, monkeypatch):
    """Two XE epochs through the Trainer, the mask network's steps included (fusion gate, mask_every 1): the
    captioner's update j (0-based, over the run) uses noam(j), i.e. M2's lambda_lr(j); one schedule step per
    optimizer step, none for a mask step. M2's update j of epoch e uses lambda_lr(e * N + j + e + 1) (its extra
    scheduler.step() an epoch, docs: "not copied"): twice a2tune's rate at the first update, in warmup."""
    cfg = Config.from_dict(_raw(root))
    trainer = Trainer(cfg, str(root.parent / "out-lr"))
    u = trainer.updates
    rates, mask_updates = [], []
    real_apply = u.apply

    def apply(loss, params, opt, clip=0.0):
        if opt is u.opt:
            rates.append(opt.param_groups[0]["lr"])
        else:
            mask_updates.append(opt.param_groups[0]["lr"])
        real_apply(loss, params, opt, clip)

    monkeypatch.setattr(u, "apply", apply)
    per_epoch = []
    for e in range(2):
        before = len(rates)
        trainer.xe_epoch()
        trainer.epoch += 1
        per_epoch.append(len(rates) - before)
    n = per_epoch[0]
    assert per_epoch == [n, n] and n == 15  # 30 train images, batch_size 10 / 5 = 2 a step (batch_layout images)
    assert mask_updates and len(mask_updates) == len(rates)  # a mask step every step, at the mask lr
    assert rates == pytest.approx([m2_lambda_lr(j, 32, 7) for j in range(2 * n)], rel=1e-12)
    assert u.sched.last_epoch == 2 * n
    m2 = m2_xe_rates(2, n, 32, 7)
    for e in range(2):
        for j in range(n):
            assert m2[e][j] == pytest.approx(noam(e * n + j + e + 1, 32, 7), rel=1e-12)
    assert m2[0][0] / rates[0] == pytest.approx(2.0, rel=1e-12)


def test_a_resumed_schedule_continues_at_the_next_step(root):
    cfg = Config.from_dict(_raw(root))
    trainer = Trainer(cfg, str(root.parent / "out-lr-resume"))
    trainer.xe_epoch()
    done = trainer.updates.sched.last_epoch
    state = trainer.updates.state_dict()
    fresh = Updates(trainer.model, cfg, trainer.device)
    assert fresh.opt.param_groups[0]["lr"] == pytest.approx(m2_lambda_lr(0, 32, 7), rel=1e-12)
    fresh.load_state_dict(state)
    assert fresh.sched.last_epoch == done
    assert fresh.opt.param_groups[0]["lr"] == pytest.approx(m2_lambda_lr(done, 32, 7), rel=1e-12)
    fresh.sched.step()
    assert fresh.opt.param_groups[0]["lr"] == pytest.approx(m2_lambda_lr(done + 1, 32, 7), rel=1e-12)


# -- SCST: beam candidates, the mean-of-beams baseline, the loss -----------------------------------------------------
def test_beam_scst_loss_is_max_len_times_m2s_with_the_baseline_that_includes_the_beam(root, monkeypatch):
    k, max_len = 3, 8
    cfg = Config.from_dict(_raw(root, xe_epochs=0, scst_epochs=1, scst_candidates="beam", scst_samples=k,
                                max_len=max_len))
    trainer = Trainer(cfg, str(root.parent / "out-scst-m2"))
    rewards = [0.3, 1.2, 0.0]  # per beam, the same for every image

    class Reward:
        def scores(self, cands, refs):
            return [rewards[i % k] for i in range(len(cands))]

    trainer._cider = Reward()
    losses = []
    monkeypatch.setattr(trainer.updates, "apply", lambda loss, params, opt, clip=0.0: losses.append(loss.detach()))
    batches = list(trainer._batches("scst"))
    monkeypatch.setattr(trainer, "_batches", lambda stage="xe": batches[:1])
    got = {}
    real = trainer.beam_candidates

    def candidates(feats, mask):
        tokens, logps, valid = real(feats, mask)
        got.update(tokens=tokens, logps=logps.detach(), valid=valid)
        return tokens, logps, valid

    monkeypatch.setattr(trainer, "beam_candidates", candidates)
    trainer.scst_epoch()
    tokens, logps, valid = got["tokens"], got["logps"], got["valid"]
    b = tokens.shape[0] // k
    # M2's per-word log-probabilities: max_len positions, <eos> counted, 0 after it (beam_search.py:110-112, 135-141)
    lengths = valid.sum(1)
    assert (tokens.gather(1, (lengths - 1)[:, None]).squeeze(1) == trainer.vocab.eos).all()
    assert int(lengths.max()) <= max_len + 1  # a2tune forces <eos> after max_len words (M2: at most max_len tokens)
    width = max(max_len, tokens.shape[1])
    m2_logp = torch.zeros(b * k, width)
    m2_logp[:, :tokens.shape[1]] = torch.where(valid, logps, torch.zeros_like(logps))
    reward = torch.tensor(rewards).repeat(b).view(b, k)
    m2 = -(m2_logp.sum(-1).view(b, k) / max_len * (reward - reward.mean(-1, keepdim=True))).mean()
    # the literal transcription (its mean over the `width` positions held, rescaled to M2's max_len positions); float32
    # sums in another order differ by ~1e-6 relative on some CPUs (seen on an Intel Xeon: 1.3e-6), hence rel=1e-5
    assert float(m2) == pytest.approx(float(m2_scst_loss(m2_logp.view(b, k, width), reward)) * width / max_len,
                                      rel=1e-5)
    assert float(losses[0]) == pytest.approx(max_len * float(m2), rel=1e-5, abs=1e-7)
    # the baseline includes the beam itself: advantages -0.2, 0.7, -0.5 (not the leave-one-out -0.3, 1.05, -0.75)
    adv = torch.tensor([-0.2, 0.7, -0.5])
    expected = -(logps.masked_fill(~valid, 0).sum(1).view(b, k) * adv).sum() / (b * k)
    assert float(losses[0]) == pytest.approx(float(expected), rel=1e-5, abs=1e-7)
    assert float(losses[0]) != 0.0


# -- the CIDEr-D reward ----------------------------------------------------------------------------------------------
def _candidates(refs: list[str], rng: random.Random) -> list[str]:
    words = sorted({w for r in refs for w in r.split()})
    out = ["", "zzz unseen words only", refs[0], " ".join(refs[1].split()[::-1])]
    for _ in range(40):
        base = rng.choice(refs).split()
        cut = rng.randint(1, len(base))
        out.append(" ".join(base[:cut] + [rng.choice(words) for _ in range(rng.randint(0, 6))]))
    return out


def test_scst_reward_with_caption_df_is_m2s_cider_train(root):
    """M2's reward (train.py:185-186, 115-117): Cider(PTBTokenizer.tokenize(list(train_dataset.text))), one document
    per training caption (tokenizer.py:28-32 makes a list of captions {i: [caption]}), ref_len log(#captions); each
    candidate scored against all the references of its image. a2tune's `scst_reward_df: captions` reward is the
    same, on its tokenized references."""
    cfg = Config.from_dict(_raw(root, xe_epochs=0, scst_epochs=1, scst_reward_df="captions"))
    trainer = Trainer(cfg, str(root.parent / "out-cider"))
    refs_by_id = trainer.data.references("train")
    all_caps = [c for group in refs_by_id.values() for c in group]
    m2 = M2Cider({i: [c] for i, c in enumerate(all_caps)})
    ours = trainer.cider()
    assert ours.num_docs == len(all_caps) and ours.ref_len == pytest.approx(math.log(len(all_caps)), rel=1e-15)
    rng = random.Random(SEED)
    ids = list(refs_by_id)
    cands, refs = [], []
    for i in ids[:6]:
        for c in _candidates(refs_by_id[i], rng):
            cands.append(c)
            refs.append(refs_by_id[i])
    got = ours.scores(cands, refs)
    _, want = m2.compute_score({j: r for j, r in enumerate(refs)}, {j: [c] for j, c in enumerate(cands)})
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert got[0] == 0.0 and got[1] == 0.0  # an empty caption and one of unseen words earn nothing
    # a reference scored against its own image: the clipping caps it; the df makes it image-specific
    assert 0 < got[2] < 10 * 1.0 + 1e-9


def test_the_default_image_df_is_coco_captions_per_image_df_not_m2s(root):
    """`scst_reward_df: images` (default; documented as deliberate): one document per image, ref_len log(#images),
    as pycocoevalcap's Cider computes over a corpus; a different number from M2's caption df."""
    cfg = Config.from_dict(_raw(root, xe_epochs=0, scst_epochs=1))
    trainer = Trainer(cfg, str(root.parent / "out-cider-img"))
    refs_by_id = trainer.data.references("train")
    ours = trainer.cider()
    assert ours.num_docs == len(refs_by_id)
    m2_img = M2Cider(refs_by_id)  # crefs per image: what CiderScorer does with a dict of image -> captions
    m2_cap = M2Cider({j: [c] for j, c in enumerate(c for g in refs_by_id.values() for c in g)})
    rng = random.Random(SEED + 1)
    ids = list(refs_by_id)[:4]
    cands = [c for i in ids for c in _candidates(refs_by_id[i], rng)]
    refs = [refs_by_id[i] for i in ids for _ in range(len(cands) // len(ids))]
    got = ours.scores(cands, refs)
    gts, res = {j: r for j, r in enumerate(refs)}, {j: [c] for j, c in enumerate(cands)}
    np.testing.assert_allclose(got, m2_img.compute_score(gts, res)[1], rtol=1e-9, atol=1e-12)
    assert not np.allclose(got, m2_cap.compute_score(gts, res)[1], rtol=1e-3)


def test_corpus_mode_matches_pycocoevalcap(root):
    """Per-evaluation df (validation, test): the installed pycocoevalcap's Cider, every key one image."""
    from pycocoevalcap.cider.cider import Cider
    cfg = Config.from_dict(_raw(root))
    trainer = Trainer(cfg, str(root.parent / "out-coco"))
    refs_by_id = trainer.data.references("val")
    rng = random.Random(SEED + 2)
    gts = {i: refs_by_id[i] for i in refs_by_id}
    res = {i: [c] for i, c in zip(gts, (rng.choice(_candidates(g, rng)[2:]) for g in gts.values()))}
    want_mean, want = Cider().compute_score(gts, res)
    got_mean, got = CiderD().compute_score(gts, res)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert got_mean == pytest.approx(want_mean, rel=1e-9)
