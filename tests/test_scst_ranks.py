"""SCST on a multi-worker trial: only rank 0 writes best.pt (into its own folder, as launch/trainable.py gives each
rank one), so every other rank crashed at the switch from cross-entropy to SCST with "best.pt: checkpoint not
found". Rank 0 now sends the weights, as the test evaluation does. Two gloo processes, no Ray."""
from __future__ import annotations

import os
import tempfile

import torch.multiprocessing as mp

from a2core.data import synthetic


def _rank(rank: int, world: int, root: str, init: str, results) -> None:
    import torch
    import torch.distributed as dist

    from a2core.train import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    raw = {"data": {"root": root, "images": 40, "seed": 3, "val_images": 4},
           "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10, "fusion": "gate"},
           "train": {"xe_epochs": 1, "scst_epochs": 1, "batch_size": 20, "warmup": 4, "diag_every": 0,
                     "test_at_end": False, "max_len": 8}}
    try:
        result = train(raw, None, output_dir=tempfile.mkdtemp(prefix=f"a2-trial-r{rank}-"))
        results.put((rank, result["epochs"]))
    except Exception as err:  # noqa: BLE001 - the test reads it
        results.put((rank, f"{type(err).__name__}: {err}"))
    finally:
        dist.destroy_process_group()


def test_every_rank_enters_scst_from_rank_0s_best_checkpoint(tmp_path):
    root = str(tmp_path / "syn")
    synthetic.ensure(root, 3, 40)
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(2, root, str(tmp_path / "pginit"), results), nprocs=2, join=True)
    got = dict(results.get() for _ in range(2))
    assert got == {0: 2, 1: 2}, got
