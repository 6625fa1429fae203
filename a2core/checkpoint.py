"""Checkpoints: plain dicts written atomically; a model is rebuilt from a checkpoint file alone.

A checkpoint holds tensors and plain data only (dicts, lists, tuples, str, int, float, bool, None): config and
vocabulary as JSON-able data, RNG states as lists. It is read with `torch.load(weights_only=True)`, whose unpickler
refuses every other global, so a crafted `checkpoint.pt` in shared storage cannot run code in whoever decodes,
resumes or packages it. Checkpoints written before RNG states were plain hold numpy's RNG key as an array: the
numpy array globals below are the one allow-list, and `load` turns such a state into the plain form.
"""
from __future__ import annotations

import pickle
import pickletools
import random
import re
import zipfile
from pathlib import Path

import numpy as np
import torch

from .atomic import atomic_write
from .checksum import checksum_path, checksum_problem
from .config import Config, get_dotted
from .data.captions import Vocab
from .model.a2 import A2Transformer, build_model
from .errors import CheckpointError

CHECKPOINT_FILE = "checkpoint.pt"
# 2: train.batch_size is the global batch in image-caption pairs. Format 1 (images per worker, before the first
# release) is refused by `load`: its batch cannot be read in today's units without its worker count.
FORMAT = 2
# Next to CHECKPOINT_FILE in a reported checkpoint folder: every epoch's metrics up to it, readable without
# loading the weights (a restarted study recovers results its dead driver never logged).
HISTORY_FILE = "history.json"


def save(state: dict, path: str | Path) -> Path:
    """torch.save to a temp file in the same directory, then rename: a reader never sees half a file. A tensor
    that is a view of a larger storage (a fused seed's weights and Adam moments are slices of the (k, ...) stacked
    ones, `a2core.fused`) is saved as a copy of its own: torch.save writes a view's whole storage."""
    return atomic_write(path, lambda f: torch.save(_own_storage(state), f))


def _own_storage(value):
    """`value` with every tensor that shares a larger storage copied out of it (dicts, lists, tuples walked)."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.untyped_storage().nbytes() > value.numel() * value.element_size() else value
    if isinstance(value, dict):
        return {k: _own_storage(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_own_storage(v) for v in value)
    return value


# What `a2 train` writes into its run folder (a2core.train): a folder holding these is named as a run's folder
RUN_FILES = ("last.pt", "best.pt")
# A zip's first bytes (a local file header): torch.save's format. A file starting so that is no zip lacks its end.
_ZIP_START = b"PK\x03\x04"


def resolve(path: str | Path) -> Path:
    """A checkpoint file, or a checkpoint folder holding `checkpoint.pt` (a study trial's `checkpoint_epochNNNN`).
    CheckpointError naming the path given once otherwise: a folder that is itself named `checkpoint.pt` is refused
    as a folder, not searched (a trial's checkpoint.pt replaced by a folder would load whatever file that holds), and
    a run's folder (`a2 train`'s last.pt, best.pt) is told to name one of them."""
    path = Path(path)
    if path.is_dir():
        inner = path / CHECKPOINT_FILE
        if path.name == CHECKPOINT_FILE or inner.is_dir():  # the innermost folder is the one named
            raise CheckpointError(f"{path if path.name == CHECKPOINT_FILE else inner}: is a folder, not a checkpoint "
                                  f"file")
        if inner.is_file():
            return inner
        if any((path / name).is_file() for name in RUN_FILES):
            raise CheckpointError(f"{path}: is a run's folder, not a checkpoint file (name its "
                                  f"{' or '.join(RUN_FILES)})")
        raise CheckpointError(f"{path}: is a folder with no {CHECKPOINT_FILE} in it, not a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    return path


# What a numpy array pickles to, under numpy 1.x and 2.x names. Rebuilding an array calls nothing else: these
# allow no code to run. Only checkpoints with the older RNG state need them.
_NUMPY_ARRAY_GLOBALS = [(np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype"),
                        (type(np.dtype(np.uint32)), "numpy.dtypes.UInt32DType"),
                        (np._core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
                        (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct")]
_ALLOWED = {name for _, name in _NUMPY_ARRAY_GLOBALS}


def load(path: str | Path, map_location="cpu") -> dict:
    """The checkpoint's dict, read without running any code of the file (see the module docstring). A checkpoint with
    its SHA-256 beside it (`a2core.checksum`, written when a study stores it) must match it: a flipped byte is a
    CheckpointError naming the file, even where torch would load the damaged weights."""
    path = resolve(path)
    if not zipfile.is_zipfile(path):  # torch.save writes a zip; anything else is a raw pickle or garbage
        with open(path, "rb") as f:
            start = f.read(len(_ZIP_START))
        if start == _ZIP_START:  # a zip's start without its end (torch: "failed finding central directory")
            # "not a checkpoint written by torch.save" kept first: callers and tests match that refusal
            raise CheckpointError(f"{path}: not a checkpoint written by torch.save in full: it is cut short (a zip "
                                  f"without its end, {path.stat().st_size} bytes; a copy or save stopped part way); "
                                  f"restore it from a copy")
        named = _raw_pickle_globals(path)
        needs = f" (a pickle needing {', '.join(named)})" if named else ""
        raise CheckpointError(f"{path}: not a checkpoint written by torch.save{needs}; refused")
    try:
        refused = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - _ALLOWED)
    except Exception as err:  # a zip without a data.pkl, or a broken one
        raise CheckpointError(f"{path}: not a readable checkpoint ({err})") from None
    if refused:
        raise CheckpointError(f"{path}: refused: it needs {', '.join(refused)}, and a checkpoint holds only tensors "
                              f"and plain data (loading it could run code)")
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:  # the scan above missed a global: name it from torch's message
        found = re.search(r"GLOBAL (\S+)|got <class '([^']+)'>", str(err))
        raise CheckpointError(f"{path}: refused: it needs {found[1] or found[2] if found else 'a disallowed object'} "
                              f"(loading it could run code)") from None
    except Exception as err:  # truncated or not a checkpoint at all
        raise CheckpointError(f"{path}: not a readable checkpoint ({err})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not an a2tune checkpoint (a {type(state).__name__}, not a dict)")
    for key in ("model", "config", "vocab"):
        if key not in state:
            raise CheckpointError(f"{path}: not an a2tune checkpoint (no {key!r})")
    if isinstance(state.get("format"), int) and state["format"] < FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state['format']}, from before the first release (this "
                              f"a2tune reads format {FORMAT}); train it again")
    recorded = checksum_path(path)  # checked once it loads: a file cut short says so as such
    if recorded.is_file():
        damaged = checksum_problem(path, recorded.read_text(errors="replace"), str(path))
        if damaged:
            raise CheckpointError(damaged)
    if isinstance(state.get("rng"), dict) and "numpy" in state["rng"]:  # the older form becomes plain data
        state["rng"] = {**state["rng"], "numpy": _plain_numpy_state(state["rng"]["numpy"])}
    return state


def _raw_pickle_globals(path: Path) -> list[str]:
    """The globals a raw pickle names, read from its opcodes (nothing in it runs); [] if it is no pickle."""
    names, strings = set(), []
    try:
        with open(path, "rb") as f:
            for op, arg, _ in pickletools.genops(f):
                if op.name == "GLOBAL":  # protocols 0-3: "module name"
                    names.add(arg.replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:  # protocol 4+: the last two strings pushed
                    names.add(".".join(strings[-2:]))
                elif isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # not a pickle, or a broken one: nothing more to name
        pass
    return sorted(names)


def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) RNG states as tensors and plain data (a checkpoint can hold them)."""
    return {"python": random.getstate(), "numpy": _plain_numpy_state(np.random.get_state(legacy=False)),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _plain_numpy_state(state) -> dict:
    """numpy's MT19937 state as a dict of plain values, from either form numpy gives (the older checkpoints hold
    the tuple `("MT19937", key array, pos, has_gauss, gauss)`)."""
    if isinstance(state, tuple):
        name, key, pos, has_gauss, gauss = state
        state = {"bit_generator": name, "state": {"key": key, "pos": pos}, "has_gauss": has_gauss, "gauss": gauss}
    return {"bit_generator": str(state["bit_generator"]),
            "state": {"key": [int(k) for k in state["state"]["key"]], "pos": int(state["state"]["pos"])},
            "has_gauss": int(state["has_gauss"]), "gauss": float(state["gauss"])}


def set_rng_state(state: dict) -> None:
    """Restore the RNG states that `rng_state` took."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_from_state(state: dict, device="cpu") -> tuple[A2Transformer, Vocab, dict]:
    """Rebuild a model from a checkpoint's dict alone.

    Returns:
        The model in eval mode on `device`, its vocabulary and its config as a plain dict.
    """
    config = Config.from_dict(state["config"], saved=True)
    vocab = Vocab(state["vocab"])
    model = build_model(config.model, len(vocab), config.longest_caption)
    model.load_state_dict(state["model"])
    model.to(device).eval()
    return model, vocab, config.to_dict()


def load_model(path: str | Path, device="cpu") -> tuple[A2Transformer, Vocab, dict]:
    """`model_from_state` of the checkpoint at `path` (a file, or a folder holding `checkpoint.pt`).

    Raises:
        CheckpointError: The file is missing, not a torch.save file, or would run code when loaded.
    """
    return model_from_state(load(path), device)


# Config keys every member of an ensemble must agree on: all members read the same padded region features
# (feature size, region count) and decode the same caption positions. Architecture keys may differ.
ENSEMBLE_KEYS = ("model.feature_dim", "model.max_regions", "data.max_caption_len")


def load_ensemble(paths: list[str | Path], device="cpu") -> tuple[list[A2Transformer], Vocab, dict]:
    """Models of several checkpoints; they must share one vocabulary (word ids must mean the same words) and the
    values of `ENSEMBLE_KEYS`. One checkpoint's state is in memory at a time. Returns the first one's vocabulary
    and config."""
    if not paths:
        raise CheckpointError("an ensemble needs at least one checkpoint")
    models, first = [], None
    for path in paths:
        model, vocab, config = load_model(path, device)
        if first is None:
            first = (path, vocab, config)
        else:
            _check_member(path, vocab, config, *first)
        models.append(model)
    return models, first[1], first[2]


def _check_member(path, vocab: Vocab, config: dict, first_path, first_vocab: Vocab, first_config: dict) -> None:
    if vocab != first_vocab:
        raise CheckpointError(f"{path}: its vocabulary ({len(vocab)} words) differs from that of {first_path} "
                              f"({len(first_vocab)} words); an ensemble averages word distributions, so all "
                              f"checkpoints must share one vocabulary")
    for key in ENSEMBLE_KEYS:
        mine, theirs = get_dotted(config, key), get_dotted(first_config, key)
        if mine != theirs:
            raise CheckpointError(f"{path}: {key} is {mine}, but {theirs} in {first_path}; the models of an "
                                  f"ensemble read the same inputs, so they must agree on {', '.join(ENSEMBLE_KEYS)}")
