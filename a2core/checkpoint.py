"""Checkpoints: plain dicts written atomically; a model is rebuilt from a checkpoint file alone."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from .atomic import atomic_write
from .config import Config
from .data.captions import Vocab
from .model.a2 import A2Transformer, build_model
from .errors import CheckpointError

CHECKPOINT_FILE = "checkpoint.pt"
# Next to CHECKPOINT_FILE in a reported checkpoint folder: every epoch's metrics up to it, readable without
# loading the weights (a restarted study recovers results its dead driver never logged).
HISTORY_FILE = "history.json"


def save(state: dict, path: str | Path) -> Path:
    """torch.save to a temp file in the same directory, then rename: a reader never sees half a file."""
    return atomic_write(path, lambda f: torch.save(state, f))


def resolve(path: str | Path) -> Path:
    """A checkpoint file, or a directory holding `checkpoint.pt`."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    return path


def load(path: str | Path, map_location="cpu") -> dict:
    path = resolve(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:  # truncated or not a checkpoint at all
        raise CheckpointError(f"{path}: not a readable checkpoint ({err})") from None
    for key in ("model", "config", "vocab"):
        if key not in state:
            raise CheckpointError(f"{path}: not an a2tune checkpoint (no {key!r})")
    return state


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_from_state(state: dict, device="cpu") -> tuple[A2Transformer, Vocab, dict]:
    config = Config.from_dict(state["config"])
    vocab = Vocab(state["vocab"])
    model = build_model(config.model, len(vocab), config.data.max_caption_len + 2)
    model.load_state_dict(state["model"])
    model.to(device).eval()
    return model, vocab, config.to_dict()


def load_model(path: str | Path, device="cpu") -> tuple[A2Transformer, Vocab, dict]:
    return model_from_state(load(path), device)


def load_ensemble(paths: list[str | Path], device="cpu") -> tuple[list[A2Transformer], Vocab, dict]:
    """Models of several checkpoints; they must share one vocabulary (word ids must mean the same words)."""
    models, vocab, config, first = [], None, None, None
    for path in paths:
        model, v, cfg = load_model(path, device)
        if vocab is None:
            vocab, config, first = v, cfg, path
        elif v != vocab:
            raise CheckpointError(f"{path}: its vocabulary ({len(v)} words) differs from that of {first} "
                             f"({len(vocab)} words); an ensemble averages word distributions, so all checkpoints "
                             f"must share one vocabulary")
        models.append(model)
    return models, vocab, config
