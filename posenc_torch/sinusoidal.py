"""Sinusoidal absolute position encoding (Vaswani et al., "Attention Is All You Need")."""

from __future__ import annotations

import torch

from ._checks import check_dtype, check_int, check_real, op_error


def _check_int(name: str, value: object) -> None:
    """An int in int64's range (the op checks its value), or a SymInt while tracing."""
    if not isinstance(value, torch.SymInt):
        check_int(name, value)


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

    Raises TypeError for arguments of the wrong type, ValueError for values out of range,
    RuntimeError naming the table when its memory cannot be allocated.
    """
    _check_int("num_positions", num_positions)
    _check_int("dim", dim)
    base = check_real("base", base)
    check_dtype("dtype", dtype)
    try:  # the op checks the values (num_positions >= 0, dim >= 1, base finite and > 0)
        return torch.ops.posenc.sinusoidal(num_positions, dim, base, dtype)
    except Exception as err:  # the shim's tag names the class, whatever torch raised
        raise op_error(err) from None
