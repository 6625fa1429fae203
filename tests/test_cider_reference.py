"""a2core's CIDEr-D against the reference implementation that M2 (meshed-memory transformer) uses.

``_M2CiderScorer`` below is a REFERENCE COPY, kept as close to the original as the test allows, of
evaluation/cider/cider_scorer.py and evaluation/cider/cider.py of
https://github.com/aimagelab/meshed-memory-transformer, commit 239100befa61d1e77ddf3b538810c83703d1e3a7
(M2 itself took them from the MS-COCO caption evaluation code, github.com/tylin/coco-caption).
Original authors: Tsung-Yi Lin <tl483@cornell.edu>, Ramakrishna Vedantam <vrama91@vt.edu>;
M2 repository: Copyright (c) 2019, AImageLab, BSD 3-Clause License (redistribution of source
with this notice permitted); coco-caption: BSD 2-Clause License. Changes from the original: the
constructor and compute_score of ``CiderScorer``/``Cider`` folded into one class, Python-2-isms and
the debug comments removed; the n-gram counting, df, tf-idf, clipping, length penalty, averaging
and x10 are unchanged (including the original's quirk that the "length" of a sentence is its
number of *bigrams*, ``if n == 1``).

M2 uses it two ways, both checked here:

* evaluation (``evaluation.compute_scores`` -> ``Cider().compute_score``): df from the references
  of the evaluated images, ``ref_len = log(number of evaluated images)``;
* SCST reward (train.py: ``Cider(PTBTokenizer.tokenize(ref_caps_train))``): df and ref_len fixed
  from a training corpus. NB: M2 passes ``list(train_dataset.text)``, one entry per training
  *caption* (its train dataset holds (image, caption) pairs), so M2's SCST df counts captions and
  ref_len = log(number of training captions); a2core's ``CiderD.from_corpus`` is given one group
  per image (a2core/train.py), the CIDEr-D definition's df (as in coco-caption and
  self-critical.pytorch). Both are checked: per image groups and, M2's exact setup, one caption
  per group.
"""
from __future__ import annotations

import math
import random
from collections import defaultdict

import numpy as np
import pytest

from a2core.metrics import CiderD, caption_scores


# ------------------------------------------------------------------------------------------------
# REFERENCE COPY (see the module docstring for source, commit, authors and license)
# ------------------------------------------------------------------------------------------------
def _m2_precook(s, n=4):
    words = s.split()
    counts = defaultdict(int)
    for k in range(1, n + 1):
        for i in range(len(words) - k + 1):
            ngram = tuple(words[i:i + k])
            counts[ngram] += 1
    return counts


class _M2CiderScorer:
    """M2's CiderScorer + Cider: ``_M2CiderScorer(gts_train)`` fixes df (SCST), ``_M2CiderScorer()``
    takes df from each call's references (evaluation)."""

    def __init__(self, gts=None, n=4, sigma=6.0):
        self.n = n
        self.sigma = sigma
        self.doc_frequency = None
        self.ref_len = None
        if gts is not None:
            crefs = [[_m2_precook(r, n) for r in gts[k]] for k in gts.keys()]
            self.doc_frequency = self._compute_doc_freq(crefs)
            self.ref_len = np.log(float(len(crefs)))

    @staticmethod
    def _compute_doc_freq(crefs):
        doc_frequency = defaultdict(float)
        for refs in crefs:
            for ngram in set([ngram for ref in refs for (ngram, count) in ref.items()]):
                doc_frequency[ngram] += 1
        return doc_frequency

    def compute_score(self, gts, res):
        assert gts.keys() == res.keys()
        crefs, ctest = [], []
        for k in gts.keys():
            crefs.append([_m2_precook(r, self.n) for r in gts[k]])
            ctest.append(_m2_precook(res[k][0], self.n))
        if self.doc_frequency is None and self.ref_len is None:
            doc_frequency = self._compute_doc_freq(crefs)
            ref_len = np.log(float(len(crefs)))
        else:
            doc_frequency = defaultdict(float, self.doc_frequency)  # a copy: lookups insert keys
            ref_len = self.ref_len
        scores = self._compute_cider(ctest, crefs, doc_frequency, ref_len)
        return np.mean(np.array(scores)), np.array(scores)

    def _compute_cider(self, ctest, crefs, doc_frequency, ref_len):
        def counts2vec(cnts):
            vec = [defaultdict(float) for _ in range(self.n)]
            length = 0
            norm = [0.0 for _ in range(self.n)]
            for (ngram, term_freq) in cnts.items():
                # give word count 1 if it doesn't appear in reference corpus
                df = np.log(max(1.0, doc_frequency[ngram]))
                n = len(ngram) - 1
                vec[n][ngram] = float(term_freq) * (ref_len - df)
                norm[n] += pow(vec[n][ngram], 2)
                if n == 1:
                    length += term_freq
            norm = [np.sqrt(n) for n in norm]
            return vec, norm, length

        def sim(vec_hyp, vec_ref, norm_hyp, norm_ref, length_hyp, length_ref):
            delta = float(length_hyp - length_ref)
            val = np.array([0.0 for _ in range(self.n)])
            for n in range(self.n):
                for (ngram, count) in vec_hyp[n].items():
                    # vrama91 : added clipping
                    val[n] += min(vec_hyp[n][ngram], vec_ref[n][ngram]) * vec_ref[n][ngram]
                if (norm_hyp[n] != 0) and (norm_ref[n] != 0):
                    val[n] /= (norm_hyp[n] * norm_ref[n])
                assert not math.isnan(val[n])
                # vrama91: added a length based gaussian penalty
                val[n] *= np.e ** (-(delta ** 2) / (2 * self.sigma ** 2))
            return val

        scores = []
        for test, refs in zip(ctest, crefs):
            vec, norm, length = counts2vec(test)
            score = np.array([0.0 for _ in range(self.n)])
            for ref in refs:
                vec_ref, norm_ref, length_ref = counts2vec(ref)
                score += sim(vec, vec_ref, norm, norm_ref, length, length_ref)
            score_avg = np.mean(score)  # mean of the n-gram orders
            score_avg /= len(refs)  # divided by the number of references
            score_avg *= 10.0
            scores.append(score_avg)
        return scores
# ------------------------------------------------------------------------------------------------
# end of the reference copy
# ------------------------------------------------------------------------------------------------

TOL = 1e-6
VOCAB = ["a", "man", "dog", "on", "the", "red", "with", "two", "is", "of", "in", "cat"]
RARE = ["zebra", "kite", "surf"]  # in evaluation captions only: n-grams outside the training df


def _sentence(rng: random.Random, vocab, lo: int = 0, hi: int = 14) -> str:
    return " ".join(rng.choice(vocab) for _ in range(rng.randint(lo, hi)))


def _refs(rng: random.Random, vocab, max_refs: int = 5) -> list[str]:
    return [_sentence(rng, vocab, 1, 14) for _ in range(rng.randint(1, max_refs))]


def _corpus(seed: int, images: int, vocab=VOCAB) -> list[list[str]]:
    rng = random.Random(seed)
    return [_refs(rng, vocab) for _ in range(images)]


def _eval_set(seed: int, images: int = 40) -> tuple[dict, dict]:
    """Random images plus the edge cases; gts {id: [refs]}, res {id: [candidate]}."""
    rng = random.Random(seed)
    vocab = VOCAB + RARE
    gts, res = {}, {}
    for i in range(images):
        gts[i] = _refs(rng, vocab)
        # half the candidates borrow a reference with one word changed, so scores are not all ~0
        if i % 2 and gts[i]:
            words = rng.choice(gts[i]).split()
            words[rng.randrange(len(words))] = rng.choice(vocab)
            res[i] = [" ".join(words)]
        else:
            res[i] = [_sentence(rng, vocab)]
    edge = {
        "empty candidate": (["a man on the red dog", "two dog with a cat"], ""),
        "one-word candidate": (["a man on the red dog", "the cat"], "dog"),
        "longer than refs": (["a dog", "the red cat", "a cat"],
                             "a dog on the red cat with a man of the dog in the red cat"),
        "repeated words": (["a dog on the red dog", "the dog is red"], "dog dog dog dog dog dog dog"),
        "repeated words (clipping)": (["a dog dog", "dog on a dog"], "a dog dog dog dog a dog dog"),
        "single reference": (["a man with two dog in the cat"], "a man with two dog in a cat"),
        "single reference, equal": (["the red dog is on the cat"], "the red dog is on the cat"),
        "identical refs": (["a cat on the red dog"] * 5, "a cat on a red dog"),
        "identical refs, equal": (["two cat with the man"] * 3, "two cat with the man"),
        "one-word references": (["dog", "cat", "dog"], "dog"),
        "rare words": (["a zebra with a kite", "zebra and kite"], "a zebra with a kite surf"),
    }
    for name, (refs, cand) in edge.items():
        gts[name], res[name] = list(refs), [cand]
    # two images with the same reference list (df counts each image), one of them twice in a row
    gts["same refs 1"], res["same refs 1"] = ["a red dog on the man", "the man"], ["a red dog"]
    gts["same refs 2"], res["same refs 2"] = ["a red dog on the man", "the man"], ["the man on a dog"]
    return gts, res


def _assert_close(ours, ref, what):
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, what
    bad = np.flatnonzero(~(np.abs(ours - ref) <= TOL))
    assert not bad.size, f"{what}: {bad.size} differ, first at {bad[0]}: a2core {ours[bad[0]]!r} vs M2 {ref[bad[0]]!r}"


# ------------------------------------------------------------------------------------------------
# per-evaluation df (M2's / pycocoevalcap's CIDEr evaluation)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_evaluation_df_matches_m2(seed):
    gts, res = _eval_set(seed)
    m2_mean, m2_per = _M2CiderScorer().compute_score(gts, res)
    mean, per = CiderD().compute_score(gts, res)
    _assert_close(per, m2_per, "per-image CIDEr-D, df from the evaluated refs")
    assert abs(mean - m2_mean) <= TOL
    assert float(np.max(m2_per)) > 1.0  # the set exercises non-trivial scores
    # the same through scores() (one reference list per candidate)
    keys = list(gts)
    _assert_close(CiderD().scores([res[k][0] for k in keys], [gts[k] for k in keys]), m2_per, "CiderD.scores")


def test_per_evaluation_df_matches_pycocoevalcap():
    from pycocoevalcap.cider.cider import Cider  # the COCO evaluation's CIDEr (the same CIDEr-D code)

    gts, res = _eval_set(7)
    ref_mean, ref_per = Cider().compute_score(gts, res)
    mean, per = CiderD().compute_score(gts, res)
    _assert_close(per, ref_per, "per-image CIDEr-D vs pycocoevalcap")
    assert abs(mean - ref_mean) <= TOL
    _assert_close(per, _M2CiderScorer().compute_score(gts, res)[1], "per-image CIDEr-D vs M2")


def test_caption_scores_cider_is_m2_times_100():
    gts, res = _eval_set(3, images=25)
    # caption_scores takes one caption string per image and only normalises whitespace
    out = caption_scores(gts, {k: "  " + v[0].replace(" ", "  ") for k, v in res.items()}, per_image=True)
    m2_mean, m2_per = _M2CiderScorer().compute_score(gts, res)
    assert abs(out["CIDEr"] - 100.0 * m2_mean) <= 100 * TOL
    _assert_close([out["per_image"][k]["CIDEr"] / 100.0 for k in gts], m2_per, "caption_scores per-image CIDEr")


def test_constant_caption_matches_m2():
    gts, _ = _eval_set(4, images=20)
    for cand in ["a man on the red dog", "", "dog dog dog"]:
        m2 = _M2CiderScorer().compute_score(gts, {k: [cand] for k in gts})[1]
        _assert_close(CiderD().constant_scores(cand, list(gts.values())), m2, f"constant caption {cand!r}")


# ------------------------------------------------------------------------------------------------
# corpus df (the SCST reward)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 5])
def test_corpus_df_per_image_matches_m2(seed):
    train = _corpus(100 + seed, images=60)
    gts, res = _eval_set(seed)
    m2 = _M2CiderScorer({i: refs for i, refs in enumerate(train)})
    ours = CiderD.from_corpus(train)
    assert ours.ref_len == pytest.approx(np.log(60.0), abs=1e-12)
    m2_mean, m2_per = m2.compute_score(gts, res)
    mean, per = ours.compute_score(gts, res)
    _assert_close(per, m2_per, "CIDEr-D with corpus df (one group per image)")
    assert abs(mean - m2_mean) <= TOL
    keys = list(gts)
    _assert_close(ours.scores([res[k][0] for k in keys], [gts[k] for k in keys]), m2_per, "corpus df, scores()")
    # document frequencies themselves
    for ngram in [("a",), ("the", "red"), ("a", "man", "on"), ("dog", "on", "the", "red"), ("zebra",)]:
        assert ours.document_frequency(" ".join(ngram)) == m2.doc_frequency.get(ngram, 0.0)
    # through a checkpoint round trip
    again = CiderD.from_state_dict(ours.state_dict())
    _assert_close(again.compute_score(gts, res)[1], m2_per, "corpus df after state_dict round trip")


def test_corpus_df_per_caption_matches_m2_scst_setup():
    """M2's SCST exactly: each training caption its own document, ref_len = log(number of captions)."""
    train = _corpus(200, images=50)
    captions = [c for refs in train for c in refs]
    m2 = _M2CiderScorer({i: [c] for i, c in enumerate(captions)})
    ours = CiderD.from_corpus([[c] for c in captions])
    assert ours.ref_len == pytest.approx(np.log(float(len(captions))), abs=1e-12)
    gts, res = _eval_set(9)
    _assert_close(ours.compute_score(gts, res)[1], m2.compute_score(gts, res)[1], "CIDEr-D, per-caption df")
    # the SCST batch layout: each image's references repeated for its k beams
    k = 5
    keys = list(gts)[:12]
    rng = random.Random(11)
    cands = [_sentence(rng, VOCAB + RARE) if j % 2 else gts[key][0] for key in keys for j in range(k)]
    refs = [gts[key] for key in keys for _ in range(k)]
    m2_per = m2.compute_score({i: r for i, r in enumerate(refs)}, {i: [c] for i, c in enumerate(cands)})[1]
    _assert_close(ours.scores(cands, refs), m2_per, "SCST reward, per-caption df")


def test_corpus_df_chunking_does_not_change_df():
    train = _corpus(300, images=45)
    gts, res = _eval_set(12)
    whole = CiderD.from_corpus(train).compute_score(gts, res)[1]
    chunked = CiderD.from_corpus(train, chunk_images=7).compute_score(gts, res)[1]
    _assert_close(chunked, whole, "from_corpus in chunks")
    _assert_close(whole, _M2CiderScorer(dict(enumerate(train))).compute_score(gts, res)[1], "vs M2")


# ------------------------------------------------------------------------------------------------
# the reference check is sensitive to each ingredient the brief names
# ------------------------------------------------------------------------------------------------
class _Variant(_M2CiderScorer):
    """The reference with one ingredient changed, to show the comparison would catch it."""

    def __init__(self, change, gts=None):
        super().__init__(gts, sigma=5.0 if change == "sigma" else 6.0)
        self.change = change

    def _compute_cider(self, ctest, crefs, doc_frequency, ref_len):
        if self.change == "ref_len":  # log(number of reference captions) instead of images
            ref_len = np.log(float(sum(len(r) for r in crefs)))
        if self.change == "df":  # log(df + 1) instead of log(max(1, df))
            doc_frequency = defaultdict(float, {g: v + 1.0 for g, v in doc_frequency.items()})
        scores = np.array(super()._compute_cider(ctest, crefs, doc_frequency, ref_len))
        return list(scores * (1.0 if self.change != "scale" else 0.1))


@pytest.mark.parametrize("change", ["sigma", "ref_len", "df", "scale"])
def test_reference_comparison_is_sensitive(change):
    gts, res = _eval_set(0)
    train = dict(enumerate(_corpus(100, images=60)))
    if change == "df":
        ref = _Variant(change, train).compute_score(gts, res)[1]
        ours = CiderD.from_corpus(list(train.values())).compute_score(gts, res)[1]
    else:
        ref = _Variant(change).compute_score(gts, res)[1]
        ours = CiderD().compute_score(gts, res)[1]
    assert np.max(np.abs(ours - ref)) > 1e-3


def test_clipping_and_length_penalty_by_hand():
    """One image, one reference, df fixed so idf is the same for every n-gram: CIDEr-D by hand."""
    ref, cand = "a dog", "a a a dog"  # "a" 3x in the candidate, 1x in the reference: clipped to 1
    scorer = CiderD.from_corpus([["x"], ["y"], ["z"]])  # ref_len = log 3, every n-gram unseen: idf = log 3
    got = scorer.scores([cand], [[ref]])[0]
    idf = np.log(3.0)
    # unigrams: cand vec a=3w, dog=w; ref a=w, dog=w (w = idf); clipped dot = min(3w,w)w + w*w = 2w^2
    uni = 2 * idf ** 2 / (np.sqrt(10) * idf * np.sqrt(2) * idf)
    # bigrams: cand "a a"=2w, "a dog"=w; ref "a dog"=w -> w^2 / (sqrt(5) w * w)
    bi = 1 / np.sqrt(5)
    # the "length" is the number of bigrams: 3 vs 1 -> delta 2, sigma 6
    penalty = np.exp(-(2.0 ** 2) / (2 * 6.0 ** 2))
    expected = 10.0 * (uni + bi + 0 + 0) / 4 * penalty
    assert abs(got - expected) <= 1e-12
    assert abs(got - _M2CiderScorer({i: [s] for i, s in enumerate("xyz")}).compute_score(
        {0: [ref]}, {0: [cand]})[1][0]) <= 1e-12


@pytest.mark.parametrize("df", ["images", "captions"])
def test_the_scst_reward_takes_its_document_frequencies_as_train_scst_reward_df_says(tmp_path, df):
    """`train.scst_reward_df: captions` is M2's SCST reward (each training caption a document); `images` (the
    default, a2tune's earlier reward) is coco-caption's CIDEr-D. Checked against the reference copy above on the
    training references of a synthetic set."""
    from a2core.config import Config
    from a2core.data import synthetic
    from a2core.train import Trainer

    synthetic.ensure(str(tmp_path / "synth"), 0, 40)
    cfg = Config.from_dict({"data": {"root": str(tmp_path / "synth"), "images": 40, "seed": 0},
                            "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10},
                            "train": {"xe_epochs": 0, "scst_epochs": 1, "scst_reward_df": df,
                                      "scst_from": None, "batch_size": 10}})
    trainer = Trainer.__new__(Trainer)  # the reward needs the data and the config only, not a model
    trainer.cfg, trainer._cider = cfg, None
    from a2core.data.dataset import CaptionData
    trainer.data = CaptionData(cfg.data, cfg.model.max_regions, cfg.model.feature_dim)
    train_refs = trainer.data.references("train")  # image id -> its captions
    docs = ({i: refs for i, refs in train_refs.items()} if df == "images"
            else {n: [c] for n, c in enumerate(c for refs in train_refs.values() for c in refs)})
    m2 = _M2CiderScorer(docs)
    gts, res = _eval_set(5)
    _assert_close(trainer.cider().compute_score(gts, res)[1], m2.compute_score(gts, res)[1], f"reward, df {df}")
    assert trainer.cider().ref_len == pytest.approx(np.log(float(len(docs))), abs=1e-12)
