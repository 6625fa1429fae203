"""`train.precision` (fp32 | bf16 | fp16) as torch objects: the autocast context of training and decoding, and the
loss scaler (active for fp16 only, whose small exponent range would flush small gradients to zero).

fp16 is allowed on CPU too: torch 2.13 has CPU fp16 autocast and `GradScaler("cpu")` (slow there, but the
same code path as on a GPU). A device whose autocast lacks the dtype is a ConfigError naming the key.
"""
from __future__ import annotations

import warnings

import torch

from .errors import ConfigError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check(precision: str, device: torch.device) -> None:
    """ConfigError (train.precision) unless this torch autocasts to `precision` on `device`."""
    dtype = DTYPES[precision]
    if dtype is None:
        return
    supported = torch.amp.is_autocast_available(device.type)
    if supported:
        with warnings.catch_warnings(record=True) as caught:  # an unsupported dtype only warns and disables
            warnings.simplefilter("always")
            torch.autocast(device.type, dtype=dtype)
        supported = not any("autocast" in str(w.message).lower() for w in caught)
    if not supported:
        raise ConfigError("train.precision", f"{precision} autocast is not supported on {device.type} by torch "
                                             f"{torch.__version__}; use fp32 there")


def autocast(precision: str, device: torch.device):
    """The context every forward pass of training and decoding runs in (fp32: disabled, a no-op)."""
    dtype = DTYPES[precision]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Dynamic loss scaling for fp16; for fp32/bf16 a disabled scaler, whose calls pass straight through."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
