"""Tests of a2core.metrics: CIDEr-D against pycocoevalcap, df files, COCO evaluation, baselines."""
from __future__ import annotations

import contextlib
import io
import json
import math
import random
from collections import Counter

import numpy as np
import pytest

from a2core.errors import A2Error, DataError
from pycocoevalcap.cider.cider import Cider

from a2core import metrics
from a2core.metrics import CiderD, best_constant_caption, coco_scores, evaluate_results_file


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def random_sentence(rng: random.Random, vocab: list[str], lengths=(0, 1, 2, 3, 5, 9, 14, 30)) -> str:
    return " ".join(rng.choice(vocab) for _ in range(rng.choice(lengths)))


def random_case(seed: int, images: int | None = None):
    """gts/res with varied vocabularies, lengths (empty included) and reference counts."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(rng.choice([2, 5, 40, 800]))]
    num = images or rng.randint(2, 25)
    ids = rng.sample(range(10_000), num)  # not sorted: the order of gts must be kept
    gts = {i: [random_sentence(rng, vocab) for _ in range(rng.choice([1, 2, 5, 12]))] for i in ids}
    res_ids = ids[:]
    rng.shuffle(res_ids)  # res in another order than gts
    res = {i: [random_sentence(rng, vocab)] for i in res_ids}
    return gts, res


def ngram_counts(s: str, n: int = 4) -> Counter:
    w = s.split()
    return Counter(tuple(w[i:i + k]) for k in range(1, n + 1) for i in range(len(w) - k + 1))


def corpus_df(corpus: list[list[str]]) -> dict:
    df: Counter = Counter()
    for refs in corpus:
        df.update(set().union(*(ngram_counts(r) for r in refs)))
    return dict(df)


def reference_cider(cands, refs, df: dict, ref_len: float, n: int = 4, sigma: float = 6.0) -> np.ndarray:
    """Plain transcription of pycocoevalcap's CIDEr-D with a given df and ref_len."""

    def vec(counts):
        v = [dict() for _ in range(n)]
        norm = [0.0] * n
        length = 0
        for g, tf in counts.items():
            x = float(tf) * (ref_len - math.log(max(1.0, df.get(g, 0.0))))
            v[len(g) - 1][g] = x
            norm[len(g) - 1] += x * x
            if len(g) == 2:
                length += tf
        return v, [math.sqrt(x) for x in norm], length

    out = []
    for c, rs in zip(cands, refs):
        vc, nc, lc = vec(ngram_counts(c, n))
        total = 0.0
        for r in rs:
            vr, nr, lr = vec(ngram_counts(r, n))
            for k in range(n):
                val = sum(min(x, vr[k].get(g, 0.0)) * vr[k].get(g, 0.0) for g, x in vc[k].items())
                if nc[k] != 0 and nr[k] != 0:
                    val /= nc[k] * nr[k]
                total += val * math.exp(-((lc - lr) ** 2) / (2 * sigma ** 2))
        out.append(total / n / len(rs) * 10.0)
    return np.array(out)


# ---------------------------------------------------------------------------------------------
# CIDEr-D == pycocoevalcap Cider
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_ciderd_equals_pycocoevalcap_on_random_inputs(seed):
    gts, res = random_case(seed)
    mean_ref, per_ref = Cider().compute_score(gts, res)
    mean, per = CiderD().compute_score(gts, res)
    assert isinstance(per, np.ndarray) and per.shape == (len(gts),)
    np.testing.assert_allclose(per, per_ref, rtol=0, atol=1e-6)
    assert mean == pytest.approx(mean_ref, abs=1e-6)


def test_ciderd_edge_cases_equal_pycocoevalcap():
    cases = [
        # one image: ref_len = log(1) = 0, every score is 0
        ({1: ["a dog runs"]}, {1: ["a dog runs"]}),
        # empty candidate, empty reference, one-word sentences, repeated words
        ({1: ["a dog runs on grass", ""], 2: ["cat"], 3: ["the the the the the", "the cat the cat"]},
         {1: [""], 2: ["cat"], 3: ["the the the the the the the"]}),
        # candidate identical to its references / long against short
        ({"x": ["a man riding a horse"] * 5, "y": ["a plate of food"] * 3, "z": ["two dogs"]},
         {"x": ["a man riding a horse"], "y": [" ".join(["food"] * 40)], "z": ["two dogs playing in the snow"]}),
        # many references per image
        ({i: [f"w{i} w{j} w{(i * j) % 7} common words here" for j in range(20)] for i in range(4)},
         {i: [f"w{i} common words w{i + 1}"] for i in range(4)}),
    ]
    for gts, res in cases:
        _, per_ref = Cider().compute_score(gts, res)
        _, per = CiderD().compute_score(gts, res)
        np.testing.assert_allclose(per, per_ref, rtol=0, atol=1e-6)
    _, per = CiderD().compute_score(*cases[0])
    assert per.tolist() == [0.0]


def test_reference_transcription_agrees_with_pycocoevalcap():
    # validates reference_cider, which then checks the precomputed-df mode
    gts, res = random_case(100, images=15)
    keys = list(gts)
    df = corpus_df([gts[k] for k in keys])
    ours = reference_cider([res[k][0] for k in keys], [gts[k] for k in keys], df, math.log(len(keys)))
    np.testing.assert_allclose(ours, Cider().compute_score(gts, res)[1], rtol=0, atol=1e-9)


def test_compute_score_rejects_mismatched_ids():
    with pytest.raises(ValueError, match="missing from res: 2"):
        CiderD().compute_score({1: ["a"], 2: ["b"]}, {1: ["a"]})
    with pytest.raises(ValueError, match="not in gts: 7"):
        CiderD().compute_score({1: ["a"]}, {1: ["a"], 7: ["b"]})
    with pytest.raises(ValueError, match="one caption"):
        CiderD().compute_score({1: ["a"]}, {1: ["a", "b"]})
    with pytest.raises(ValueError, match="non-empty list"):
        CiderD().compute_score({1: []}, {1: ["a"]})


# ---------------------------------------------------------------------------------------------
# precomputed df: from_corpus, scores(), state_dict
# ---------------------------------------------------------------------------------------------
def make_corpus(seed: int = 7, images: int = 300):
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(60)]
    return [[random_sentence(rng, vocab, lengths=(3, 6, 8, 11)) for _ in range(rng.choice([1, 3, 5]))]
            for _ in range(images)]


def scst_batch(corpus, seed: int = 3, images: int = 12, samples: int = 4):
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(70)]  # w60..w69 never occur in the corpus
    refs, cands = [], []
    for img in rng.sample(range(len(corpus)), images):
        for s in range(samples):
            # the same list object for the first samples, an equal copy for the last one
            refs.append(corpus[img] if s < samples - 1 else list(corpus[img]))
            cands.append(random_sentence(rng, vocab, lengths=(0, 2, 5, 8, 12)))
    refs.append(["w61 w62 w63 unseen reference words"])  # references outside the corpus
    cands.append("w61 w62 w63 unseen words")
    return cands, refs


def test_from_corpus_df_matches_reference_and_corpus_mode():
    corpus = make_corpus()
    scorer = CiderD.from_corpus(corpus)
    assert scorer.mode == "precomputed" and scorer.num_docs == len(corpus)
    assert scorer.ref_len == pytest.approx(math.log(len(corpus)))
    cands, refs = scst_batch(corpus)
    expected = reference_cider(cands, refs, corpus_df(corpus), math.log(len(corpus)))
    np.testing.assert_allclose(scorer.scores(cands, refs), expected, rtol=0, atol=1e-9)

    # df from exactly the references of the call == pycocoevalcap's Cider
    gts, res = random_case(5, images=20)
    on_gts = CiderD.from_corpus(list(gts.values()))
    np.testing.assert_allclose(on_gts.compute_score(gts, res)[1], Cider().compute_score(gts, res)[1], atol=1e-9)


def test_scores_matches_compute_score_with_same_df():
    corpus = make_corpus()
    scorer = CiderD.from_corpus(corpus)
    cands, refs = scst_batch(corpus)
    fast = scorer.scores(cands, refs)
    assert fast.shape == (len(cands),) and np.all(fast >= 0) and fast.max() > 0
    gts = {i: r for i, r in enumerate(refs)}
    res = {i: [c] for i, c in enumerate(cands)}
    mean, per = scorer.compute_score(gts, res)
    np.testing.assert_allclose(fast, per, rtol=0, atol=1e-12)
    assert mean == pytest.approx(float(np.mean(fast)))
    # one at a time (different call-local n-gram numbering) gives the same numbers
    singles = np.concatenate([scorer.scores([c], [r]) for c, r in zip(cands[:8], refs[:8])])
    np.testing.assert_allclose(singles, fast[:8], rtol=0, atol=1e-12)
    # df='corpus' mode: scores() counts every candidate as one image, like compute_score / pycocoevalcap
    np.testing.assert_allclose(CiderD().scores(cands, refs), Cider().compute_score(gts, res)[1], atol=1e-9)
    assert CiderD().scores([], []).shape == (0,)
    with pytest.raises(ValueError, match="2 candidates but 1"):
        scorer.scores(["a", "b"], [["a"]])


def test_state_dict_round_trip():
    corpus = make_corpus()
    scorer = CiderD.from_corpus(corpus, chunk_images=70)  # several chunks
    cands, refs = scst_batch(corpus)
    before = scorer.scores(cands, refs)
    np.testing.assert_allclose(before, CiderD.from_corpus(corpus).scores(cands, refs), rtol=0, atol=1e-12)

    # plain JSON-serialisable state, e.g. kept inside a checkpoint dict
    state = scorer.state_dict()
    assert set(state) >= {"n", "sigma", "num_docs", "ref_len", "words", "prefix", "last_word", "df"}
    df = corpus_df(corpus)
    assert len(state["df"]) == len(df)
    for gram in list(df)[:: max(1, len(df) // 50)]:
        assert scorer.document_frequency(" ".join(gram)) == df[gram]
    assert scorer.document_frequency("w1 w61") == 0.0
    restored = CiderD.from_state_dict(json.loads(json.dumps({"cider_df": state}))["cider_df"])
    np.testing.assert_array_equal(restored.scores(cands, refs), before)


def test_state_errors():
    with pytest.raises(ValueError, match="from_corpus"):
        CiderD().state_dict()
    with pytest.raises(ValueError, match="from_corpus"):
        CiderD(df="train")
    state = CiderD.from_corpus([["a b c"], ["a d"]]).state_dict()
    with pytest.raises(ValueError, match="format"):
        CiderD.from_state_dict({**state, "format": "other"})
    with pytest.raises(ValueError, match="num_docs"):
        CiderD.from_state_dict({**state, "df": [5] * len(state["df"])})
    with pytest.raises(ValueError, match="same length"):
        CiderD.from_state_dict({**state, "df": state["df"][:-1]})
    with pytest.raises(ValueError, match="earlier n-grams"):
        CiderD.from_state_dict({**state, "prefix": [len(state["prefix"])] * len(state["prefix"])})


def test_constant_scores_equal_compute_score():
    gts, _ = random_case(9, images=10)
    refs = list(gts.values())
    cand = " ".join(refs[0][0].split()[:6])
    per = CiderD().constant_scores(cand, refs)
    _, expected = Cider().compute_score(gts, {k: [cand] for k in gts})
    np.testing.assert_allclose(per, expected, rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# COCO evaluation (Java: PTB tokenizer and METEOR; one real run for the module)
# ---------------------------------------------------------------------------------------------
COCO_GTS = {
    11: ["A dog runs on the grass.", "A dog runs on the grass.", "A dog runs on the grass!"],
    22: ["Two people ride bikes down the street.", "A couple of cyclists on a city road."],
    33: ["A plate of food with broccoli and rice.", "Broccoli and rice on a white plate."],
}
COCO_RES = {11: "A dog runs on the grass.", 22: "A plate of broccoli.", 33: ""}


@pytest.fixture(scope="module")
def coco_run(tmp_path_factory):
    empty_lib = tmp_path_factory.mktemp("no_spice_models")
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setattr(metrics, "_spice_lib_dir", lambda: str(empty_lib))
        out = coco_scores(COCO_GTS, COCO_RES, spice=None, per_image=True)
    return out, err.getvalue(), str(empty_lib)


@pytest.mark.slow
def test_coco_scores_values_and_keys(coco_run):
    out, _, _ = coco_run
    names = ["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr"]
    assert list(out) == names + ["per_image"]
    assert all(isinstance(out[k], float) for k in names)
    assert 1 < out["BLEU-4"] < 100 and 1 < out["METEOR"] < 100 and 1 < out["ROUGE-L"] < 100  # x100
    per = out["per_image"]
    assert set(per) == set(COCO_GTS) and all(list(v) == names for v in per.values())
    assert per[11]["BLEU-4"] == pytest.approx(100.0, abs=1e-4)
    assert per[11]["METEOR"] == pytest.approx(100.0, abs=1e-4)
    assert per[11]["ROUGE-L"] == pytest.approx(100.0)
    assert per[11]["CIDEr"] > per[22]["CIDEr"] > per[33]["CIDEr"] == 0.0
    assert out["CIDEr"] == pytest.approx(np.mean([per[k]["CIDEr"] for k in per]))
    # CIDEr is pycocoevalcap's on the PTB-tokenized captions (lower-cased, punctuation removed), x100
    tok_gts = {k: [" ".join(c.lower().rstrip(".!").split()) for c in v] for k, v in COCO_GTS.items()}
    tok_res = {11: ["a dog runs on the grass"], 22: ["a plate of broccoli"], 33: [""]}
    assert out["CIDEr"] == pytest.approx(100 * Cider().compute_score(tok_gts, tok_res)[0], abs=1e-7)


@pytest.mark.slow
def test_caption_scores_on_tokenized_text_match_coco_scores(coco_run):
    out, _, _ = coco_run
    tok_gts = {k: [" ".join(c.lower().rstrip(".!").split()) for c in v] for k, v in COCO_GTS.items()}
    tok_res = {11: "a dog runs on the grass", 22: "a  plate of broccoli", 33: ""}
    fast = metrics.caption_scores(tok_gts, tok_res, per_image=True)  # no Java without METEOR
    assert list(fast) == ["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "ROUGE-L", "CIDEr", "per_image"]
    for key in ("BLEU-1", "BLEU-4", "ROUGE-L", "CIDEr"):
        assert fast[key] == pytest.approx(out[key], abs=1e-12)
        assert fast["per_image"][22][key] == pytest.approx(out["per_image"][22][key], abs=1e-12)


@pytest.mark.slow
def test_coco_scores_spice_notice_and_progress(coco_run):
    out, err, lib = coco_run
    assert "SPICE" not in out
    notices = [line for line in err.splitlines() if line.startswith("SPICE skipped")]
    assert len(notices) == 1 and lib in notices[0] and "download" in notices[0]
    for step in ("PTB tokenizer", "BLEU", "METEOR", "ROUGE-L", "CIDEr"):
        assert any(step in line for line in err.splitlines() if line.startswith("coco_scores:")), step


def test_coco_scores_checks_before_running_java(monkeypatch, tmp_path):
    monkeypatch.setattr(metrics, "_spice_lib_dir", lambda: str(tmp_path))
    assert metrics.spice_available() is False
    with pytest.raises(A2Error, match="SPICE was requested"):
        coco_scores(COCO_GTS, COCO_RES, spice=True, progress=False)
    with pytest.raises(ValueError, match="33"):
        coco_scores(COCO_GTS, {11: "a", 22: "b"}, progress=False)
    with pytest.raises(ValueError, match="44"):
        coco_scores(COCO_GTS, {**COCO_RES, 44: "extra"}, progress=False)
    for name in ("stanford-corenlp-3.6.0.jar", "stanford-corenlp-3.6.0-models.jar"):
        (tmp_path / name).write_bytes(b"")
    assert metrics.spice_available() is True


# ---------------------------------------------------------------------------------------------
# evaluate_results_file
# ---------------------------------------------------------------------------------------------
def write_karpathy(path):
    def img(cocoid, split, caps, raw=True):
        sents = [{"raw": c, "tokens": c.lower().split()} if raw else {"tokens": c.lower().split()} for c in caps]
        return {"cocoid": cocoid, "split": split, "filename": f"{cocoid}.jpg", "sentences": sents}

    data = {"images": [
        img(1, "train", ["A cat."]), img(2, "restval", ["A bird."]), img(3, "val", ["A val image."]),
        img(4, "test", ["A red bus.", "A bus on a road."]), img(5, "test", ["two men talking"], raw=False),
    ]}
    path.write_text(json.dumps(data))
    return path


def write_results(path, entries):
    path.write_text(json.dumps([{"image_id": i, "caption": c} for i, c in entries]))
    return path


def test_evaluate_results_file_passes_split_references(monkeypatch, tmp_path):
    caps = write_karpathy(tmp_path / "dataset_coco.json")
    seen = {}

    def fake(gts, res, spice=None, per_image=False, progress=True):
        seen.update(gts=gts, res=res, spice=spice, per_image=per_image)
        return {"CIDEr": 1.0}

    monkeypatch.setattr(metrics, "coco_scores", fake)
    results = write_results(tmp_path / "res.json", [(5, "two men"), (4, "a bus")])
    assert evaluate_results_file(results, caps, per_image=True) == {"CIDEr": 1.0}
    assert seen["gts"] == {4: ["A red bus.", "A bus on a road."], 5: ["two men talking"]}
    assert seen["res"] == {4: "a bus", 5: "two men"} and seen["per_image"] is True
    evaluate_results_file(write_results(tmp_path / "tr.json", [(1, "x"), (2, "y")]), caps, split="train")
    assert set(seen["gts"]) == {1, 2}  # restval counts as train


def test_evaluate_results_file_errors(tmp_path):
    caps = write_karpathy(tmp_path / "dataset_coco.json")
    res_path = str(tmp_path / "res.json")
    with pytest.raises(DataError, match="missing.json"):
        evaluate_results_file(tmp_path / "missing.json", caps)
    with pytest.raises(DataError, match="nocaps.json"):
        evaluate_results_file(write_results(tmp_path / "res.json", [(4, "a"), (5, "b")]), tmp_path / "nocaps.json")
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(ValueError, match="broken.json"):
        evaluate_results_file(tmp_path / "broken.json", caps)
    (tmp_path / "obj.json").write_text('{"image_id": 4}')
    with pytest.raises(ValueError, match="obj.json"):
        evaluate_results_file(tmp_path / "obj.json", caps)
    write_results(tmp_path / "res.json", [(4, "a bus")])
    with pytest.raises(ValueError, match=r"res\.json.*no caption for image id\(s\) 5"):
        evaluate_results_file(res_path, caps)
    write_results(tmp_path / "res.json", [(4, "a"), (5, "b"), (3, "val image")])
    with pytest.raises(ValueError, match=r"res\.json.*image id\(s\) 3 are not in split 'test'"):
        evaluate_results_file(res_path, caps)
    write_results(tmp_path / "res.json", [(4, "a"), (5, "b"), (4, "again")])
    with pytest.raises(ValueError, match=r"res\.json.*duplicate image id\(s\) 4"):
        evaluate_results_file(res_path, caps)
    (tmp_path / "res.json").write_text(json.dumps([{"image_id": "4", "caption": "a"}]))
    with pytest.raises(ValueError, match=r"res\.json.*entry 0"):
        evaluate_results_file(res_path, caps)
    with pytest.raises(ValueError, match="unknown split"):
        evaluate_results_file(res_path, caps, split="dev")


# ---------------------------------------------------------------------------------------------
# best constant caption
# ---------------------------------------------------------------------------------------------
def test_best_constant_caption_picks_obvious_winner():
    gts = {
        1: ["a man riding a horse on a beach", "A man riding a horse.", "man on a horse"],
        2: ["a man riding a horse in a field", "a person riding a brown horse"],
        3: ["A man riding a horse down a road.", "a cat sitting on a couch"],
        4: ["a bowl of soup", "soup in a white bowl"],
    }
    train = (["A cat sitting on a couch."] * 6 + ["a man riding a horse"] * 4 + ["a bowl of soup"] * 3
             + ["an airplane flying in the sky"] * 5)
    caption, score = best_constant_caption(train, gts, candidates=4)
    assert caption == "a man riding a horse"
    norm = {k: [metrics.simple_tokenize(c) for c in v] for k, v in gts.items()}
    expected = 100 * Cider().compute_score(norm, {k: [caption] for k in gts})[0]  # x100
    assert score == pytest.approx(expected, abs=1e-7) and score > 0
    # only the most frequent caption as candidate
    assert best_constant_caption(train, gts, candidates=1)[0] == "a cat sitting on a couch"
