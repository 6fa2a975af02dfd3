"""Sinusoidal absolute position encoding (Vaswani et al., "Attention Is All You Need")."""

from __future__ import annotations

import math

import torch

from ._checks import check_float_dtype


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if isinstance(value, int) and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def sinusoidal_position_encoding(
    num_positions: int,
    dim: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The fixed sin/cos position table that is added to token embeddings.

    Returns a (num_positions, dim) CPU tensor with, for position p and column j,

        angle = p / base ** (2 * (j // 2) / dim)
        PE[p, j] = sin(angle) if j is even else cos(angle)

    (interleaved sin/cos, the layout of transformers' DistilBERT
    ``create_sinusoidal_embeddings``).  Angles and sin/cos are computed in float64 and
    rounded to float32, as transformers stores them; bfloat16/float16 tables are that
    float32 table rounded once more, a float64 table keeps the float64 values.  An odd
    ``dim`` ends with a sine column, as in transformers.

    Args:
        num_positions: number of rows (positions 0 .. num_positions - 1), >= 0.
        dim: embedding width, >= 1.
        base: the wavelength base (10000 in the paper); finite and > 0.
        dtype: float32 (default), float64, bfloat16 or float16.
    """
    _check_int("num_positions", num_positions, 0)
    _check_int("dim", dim, 1)
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        raise TypeError(f"base must be a float, got {type(base).__name__}")
    if not 0.0 < base < math.inf:  # also rejects NaN
        raise ValueError(f"base must be finite and > 0, got {base}")
    check_float_dtype("dtype", dtype)
    return torch.ops.posenc.sinusoidal(num_positions, dim, float(base), dtype)
