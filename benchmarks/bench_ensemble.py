"""Ensemble decoding throughput: one checkpoint against the 4-checkpoint averaging ensemble, beam 5.

The decode path is the one `a2 package` runs in each shard (a2core.decode.caption_images over an
`EnsembleStepper` with the minimum-length guard): batched beam search, each model with its own decoder cache,
word distributions averaged every step. The ensemble does four models' work per step, so the ideal ratio of
throughputs is 0.25; what beam bookkeeping and the averaging cost shows as the distance from it.

Models: `--checkpoints A B C D` (the first one alone, then all four), or four randomly initialised models of the
given size (default d_model 512, 3 layers, 8 heads; random weights rarely emit <eos>, so every caption runs the
full `--max-len` steps: the slow case). Features: random (images x 50 regions x 2048), in memory, so only the
decoding is timed. Timings are interleaved (1, 4, 1, 4, ...) and the median of `--repeats` is reported.

Usage: python benchmarks/bench_ensemble.py [--images 100] [--repeats 3] [--checkpoints a.pt b.pt c.pt d.pt]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np
import torch


def random_models(n: int, d_model: int, layers: int, heads: int, vocab: int, max_len: int, regions: int, device):
    from a2core.config import ModelConfig
    from a2core.model.a2 import build_model

    cfg = ModelConfig(d_model=d_model, layers=layers, heads=heads, d_ff=4 * d_model, max_regions=regions,
                      fusion="gate")
    cfg.validate()
    models = []
    for i in range(n):
        torch.manual_seed(i)
        models.append(build_model(cfg, vocab, max_len + 2).to(device).eval())
    return models, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", nargs="*", default=None, help="4 checkpoints (default: random models)")
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--beam-size", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--regions", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from a2core.data.captions import SPECIALS, Vocab
    from a2core.decode import EnsembleStepper, MinLengthStepper, caption_images
    from dashboards.leaderboard import GivenFeatures

    if args.checkpoints:
        from a2core.checkpoint import load_ensemble

        if len(args.checkpoints) < 4:
            ap.error("--checkpoints: give 4 checkpoints")
        models, vocab, config = load_ensemble(args.checkpoints[:4], device=args.device)
        regions, dim = config["model"]["max_regions"], config["model"]["feature_dim"]
        what = f"checkpoints {', '.join(args.checkpoints[:4])}"
    else:
        vocab = Vocab(list(SPECIALS) + [f"w{i}" for i in range(args.vocab - len(SPECIALS))])
        models, cfg = random_models(4, args.d_model, args.layers, args.heads, len(vocab), args.max_len,
                                    args.regions, args.device)
        regions, dim = cfg.max_regions, cfg.feature_dim
        what = (f"random models d_model {args.d_model}, {args.layers} layers, {args.heads} heads, "
                f"vocabulary {len(vocab)}")

    rng = np.random.default_rng(0)
    store = GivenFeatures({i: rng.standard_normal((int(rng.integers(regions // 2, regions + 1)), dim))
                           for i in range(args.images)}, dim)
    feats = {i: store.padded(i, regions) for i in store.given}
    ids = list(feats)

    def run(k: int) -> float:
        stepper = MinLengthStepper(EnsembleStepper(models[:k]), vocab.eos)
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            caps = caption_images(stepper, vocab, ids, feats.__getitem__, beam_size=args.beam_size,
                                    max_len=args.max_len, batch_size=args.batch_size, device=args.device)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        assert len(caps) == len(ids)
        return len(ids) / (time.perf_counter() - t)

    # warm-up (allocator, kernels) on one batch of each
    warm = ids[: min(len(ids), args.batch_size)]
    for k in (1, 4):
        with torch.no_grad():
            caption_images(MinLengthStepper(EnsembleStepper(models[:k]), vocab.eos), vocab, warm, feats.__getitem__,
                             beam_size=args.beam_size, max_len=args.max_len, batch_size=args.batch_size,
                             device=args.device)
    rates = {1: [], 4: []}
    for _ in range(args.repeats):
        for k in (1, 4):
            rates[k].append(run(k))
    one, four = statistics.median(rates[1]), statistics.median(rates[4])
    print(f"ensemble decoding, beam {args.beam_size}, max {args.max_len} words, {args.images} images in batches of "
          f"{args.batch_size}, {args.device} ({torch.get_num_threads()} threads); {what}; median of {args.repeats}")
    print(f"{'checkpoints':<12} {'images/s':>10} {'s/100 img':>10}")
    print(f"{1:<12} {one:>10.2f} {100 / one:>10.2f}")
    print(f"{4:<12} {four:>10.2f} {100 / four:>10.2f}")
    print(f"ratio 4/1 throughput: {four / one:.3f} (0.25 = exactly four times the work; "
          f"the ensemble is {one / four:.2f}x slower)")


if __name__ == "__main__":
    main()
