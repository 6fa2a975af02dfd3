"""Argument checks that need Python: layouts, option names, devices.

The C++ shim checks the shapes, dtypes and sizes of what an op receives (it is the
contract of the ops).  The checks here speak in terms of the public functions' own
arguments; the rotation functions run them only where the shim cannot (see rope.py).
The float dtype list and its message are defined here once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _C

# Devices the kernels run on: the CPU, and CUDA GPUs when the extension has its CUDA kernels.
KERNEL_DEVICES: tuple[str, ...] = ("cpu", "cuda") if _C.has_cuda() else ("cpu",)

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_FLOAT_TEXT = "float32, float64, bfloat16 or float16"


def pairing_code(pairing: str) -> int:
    if pairing == "half":
        return 0
    if pairing == "adjacent":
        return 1
    raise ValueError(f"pairing must be 'half' or 'adjacent', got {pairing!r}")


def check_tensor(name: str, t: object, ndim: int | tuple[int, ...], layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in dims:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    return t


def check_float_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be {_FLOAT_TEXT}, got {dtype}")


def check_float(name: str, t: torch.Tensor) -> None:
    check_float_dtype(name, t.dtype)


def check_same_device(**tensors: torch.Tensor) -> None:
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on the same device")
    if first.device.type not in ("meta", *KERNEL_DEVICES):
        raise NotImplementedError(
            f"posenc_torch kernels run on {' and '.join(KERNEL_DEVICES)} tensors; "
            f"{first_name} is on {first.device}")


def check_sections(mrope_section: object, name: str = "mrope_section") -> list[int]:
    """A list or tuple of 3 non-negative ints (never a tensor: HF repeats it as a list)."""
    if isinstance(mrope_section, torch.Tensor) or not isinstance(mrope_section, Sequence):
        raise TypeError(f"{name} must be a list or tuple of 3 ints, got "
                        f"{type(mrope_section).__name__}")
    sections = list(mrope_section)
    if len(sections) != 3 or not all(isinstance(s, int) and not isinstance(s, bool)
                                     for s in sections):
        raise ValueError(f"{name} must be 3 ints (T, H, W), got {mrope_section!r}")
    if any(s < 0 for s in sections):
        raise ValueError(f"{name} entries must be non-negative, got {mrope_section!r}")
    return sections


def check_unsqueeze_dim(unsqueeze_dim: object) -> int:
    """1 for (B, H, T, D) q/k, 2 for (B, T, H, D); -3 and -2 name the same dims."""
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"unsqueeze_dim must be an int, got {type(unsqueeze_dim).__name__}")
    canonical = {1: 1, -3: 1, 2: 2, -2: 2}.get(unsqueeze_dim)
    if canonical is None:
        raise ValueError(
            f"unsqueeze_dim must be 1 (q, k as (batch, heads, seq, head_dim)) or 2 "
            f"((batch, seq, heads, head_dim)), got {unsqueeze_dim}")
    return canonical
