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


def has_tf32(device: torch.device) -> bool:
    """Whether `device` has TF32 tensor cores (a CUDA GPU of compute capability 8.0 or later: A100, A10G, H100,
    H200); a CPU never does."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8


def fp32_matmul(device: torch.device, tf32: bool = True) -> str:
    """Set how fp32 matrix products run on `device` and say which: "tf32" (10-bit mantissa inputs, fp32 accumulation, on
    the tensor cores) where the card has it and `tf32`, else
    "fp32" ("ieee", torch's default). A training step at the paper's sizes is launch-bound on an H200, where
    the measured figures (benchmarks/bench_gpu.py) decide whether TF32 or bf16 autocast pays; TF32 keeps
    fp32 storage and the fp32 code path, so no loss scaling and no casts are added. The setting is process-wide
    (torch has no per-module one); a CPU is left as it is."""
    if not has_tf32(device):
        return "fp32"
    # torch >= 2.9's settings (the allow_tf32 flags are deprecated there, and mixing the two kinds is refused)
    torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
    torch.backends.cudnn.conv.fp32_precision = "tf32" if tf32 else "ieee"
    return "tf32" if tf32 else "fp32"
