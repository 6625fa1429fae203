"""CIDEr-D speed: a2core.metrics.CiderD against pycocoevalcap's Cider, side by side.

Setting: one SCST batch = 50 images x 5 sampled captions x 5 references (250 candidates),
synthetic sentences of 8-16 words drawn from a 1000-word vocabulary with Zipf-like word
frequencies (fixed seed). Two comparisons, each timed on the same batches, interleaved:

* SCST reward: ``CiderD.scores`` with df precomputed once from a 5000-image training corpus,
  against pycocoevalcap ``Cider().compute_score`` on the 250 candidates (5 references each),
  which is what a pycocoevalcap-based SCST loop calls per batch;
* drop-in: ``CiderD().compute_score`` against ``Cider().compute_score`` on the same input
  (df from the batch's references, identical numbers; the largest difference is printed).

Usage: python benchmarks/bench_cider.py [--repeats 15] [--seed 0]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np
from pycocoevalcap.cider.cider import Cider

from a2core.metrics import CiderD

IMAGES, SAMPLES, REFS, VOCAB = 50, 5, 5, 1000
CORPUS_IMAGES = 5000


def make_sentence_sampler(rng: np.random.Generator):
    words = np.array([f"w{i}" for i in range(VOCAB)])
    p = 1.0 / np.arange(1, VOCAB + 1)
    p /= p.sum()

    def sentence() -> str:
        return " ".join(words[rng.choice(VOCAB, size=int(rng.integers(8, 17)), p=p)])

    return sentence


def timed(fn):
    gc.collect()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    sentence = make_sentence_sampler(rng)
    corpus = [[sentence() for _ in range(REFS)] for _ in range(CORPUS_IMAGES)]
    t_df, scorer = timed(lambda: CiderD.from_corpus(corpus))

    batches = []
    for _ in range(args.repeats):
        images = rng.choice(CORPUS_IMAGES, size=IMAGES, replace=False)
        refs = [corpus[i] for i in images for _ in range(SAMPLES)]  # shared per image
        cands = [sentence() for _ in range(IMAGES * SAMPLES)]
        gts = {k: r for k, r in enumerate(refs)}
        res = {k: [c] for k, c in enumerate(cands)}
        batches.append((cands, refs, gts, res))

    # warm-up (imports, allocator)
    scorer.scores(batches[0][0], batches[0][1])
    Cider().compute_score(batches[0][2], batches[0][3])

    t_scst, t_coco_scst, t_drop, t_coco_drop = [], [], [], []
    max_diff = 0.0
    for cands, refs, gts, res in batches:
        t, _ = timed(lambda: scorer.scores(cands, refs))
        t_scst.append(t)
        t, (mean_ref, per_ref) = timed(lambda: Cider().compute_score(gts, res))
        t_coco_scst.append(t)
        t_coco_drop.append(t)  # the same pycocoevalcap call serves as the drop-in baseline
        t, (mean_ours, per_ours) = timed(lambda: CiderD().compute_score(gts, res))
        t_drop.append(t)
        max_diff = max(max_diff, float(np.max(np.abs(per_ours - np.asarray(per_ref)))))

    def ms(xs):
        return 1e3 * statistics.median(xs)

    n_pairs = IMAGES * SAMPLES * REFS
    print(f"batch: {IMAGES} images x {SAMPLES} samples x {REFS} references = {IMAGES * SAMPLES} candidates, "
          f"{n_pairs} candidate/reference pairs; vocabulary {VOCAB}; {args.repeats} repeats, medians")
    print(f"df corpus: {CORPUS_IMAGES} images x {REFS} references, CiderD.from_corpus took {1e3 * t_df:.0f} ms "
          f"({scorer.ref_len:.3f} = log(num_docs))")
    print(f"{'setting':<34}{'CiderD ms':>11}{'pycocoevalcap ms':>18}{'speed-up':>10}")
    r1 = ms(t_coco_scst) / ms(t_scst)
    r2 = ms(t_coco_drop) / ms(t_drop)
    print(f"{'SCST reward (precomputed df)':<34}{ms(t_scst):>11.2f}{ms(t_coco_scst):>18.2f}{r1:>9.1f}x")
    print(f"{'drop-in compute_score (batch df)':<34}{ms(t_drop):>11.2f}{ms(t_coco_drop):>18.2f}{r2:>9.1f}x")
    print(f"drop-in: largest per-image |CiderD - Cider| = {max_diff:.2e}")
    verdict = "met" if r1 >= 10 else "NOT met"
    print(f"SUMMARY: CIDEr-D SCST reward for {IMAGES}x{SAMPLES}x{REFS}: CiderD {ms(t_scst):.2f} ms vs "
          f"pycocoevalcap {ms(t_coco_scst):.1f} ms median = {r1:.1f}x faster (target >= 10x {verdict}); "
          f"drop-in {r2:.1f}x, max diff {max_diff:.1e}")


if __name__ == "__main__":
    main()
