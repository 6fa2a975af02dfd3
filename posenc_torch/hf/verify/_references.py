"""posenc's references: the rotary forms posenc computes (``posenc_torch.hf._rotary.Form``),
each written as plain torch.

The verify command finds a transformers function to be a form when the graph torch's
tracer captures from it equals the reference's under every regime the form is computed in
(``_forms``).  The tests check each reference against the posenc op over shapes and
dtypes, and against transformers' own functions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: The dtypes of a capture of a function that reads none (its graph does not depend on them).
REPRESENTATIVE = (torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------
# The references.  q, k: (B, H, T, D); cos, sin: (Bc, T, W).


def _halves(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1), the halves split at the middle."""
    mid = x.shape[-1] // 2
    return torch.cat((-x[..., mid:], x[..., :mid]), dim=-1)


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _first_half_twice(t: torch.Tensor) -> torch.Tensor:
    return t[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1)


def _turn(x, cos, sin, rotate):
    return x * cos + rotate(x) * sin


def _heads(cos, sin):
    return cos.unsqueeze(1), sin.unsqueeze(1)


def _half_full(q, k, cos, sin):
    cos, sin = _heads(cos, sin)
    return _turn(q, cos, sin, _halves), _turn(k, cos, sin, _halves)


def _half_full_each(q, k, cos, sin):
    q_out, k_out = _half_full(q, k, cos, sin)
    return q_out.to(q.dtype), k_out.to(k.dtype)


def _pairs_fp32(q, k, cos, sin):
    dtype = q.dtype
    q, k = q.float(), k.float()
    cos, sin = _heads(cos, sin)
    return (_turn(q, cos, sin, _pairs).to(dtype=dtype),
            _turn(k, cos, sin, _pairs).to(dtype=dtype))


def _partial(rotate, tables=None):
    def reference(q, k, cos, sin):
        cos, sin = _heads(cos, sin)
        if tables is not None:
            cos, sin = tables(cos), tables(sin)
        width = cos.shape[-1]

        def one(x):
            return torch.cat([_turn(x[..., :width], cos, sin, rotate), x[..., width:]], dim=-1)

        return one(q), one(k)

    return reference


def _interleaved_fp32(q, k, cos, sin):
    dtype = q.dtype
    cos, sin = _heads(cos, sin)
    cos, sin = _first_half_twice(cos), _first_half_twice(sin)

    def one(x):
        return x.float() * cos + _pairs(x).float() * sin

    return one(q).to(dtype), one(k).to(dtype)


def _chunks(q, k, cos, sin):
    cos, sin = _heads(cos, sin)

    def one(x):
        first, second = torch.chunk(x, 2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    return one(q), one(k)


def _deinterleaved_input(q, k, cos, sin):
    cos, sin = _heads(cos, sin)

    def split(x):
        b, h, s, d = x.shape
        return x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)

    q, k = split(q), split(k)
    return _turn(q, cos, sin, _halves), _turn(k, cos, sin, _halves)


def _deinterleaved_output(q, k, cos, sin):
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)

    def one(x):
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)

    return one(q), one(k)


def _vision(q, k, cos, sin):
    """q, k: (N, H, D); cos, sin: (N, D); computed in fp32, cast back."""
    q_dtype, k_dtype = q.dtype, k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    return _turn(q, cos, sin, _halves).to(q_dtype), _turn(k, cos, sin, _halves).to(k_dtype)


def _sections(q, k, cos, sin, mrope_section):
    """cos, sin: (3, Bc, T, D); channel block i of the sections (twice over) from axis
    i % 3."""
    sizes = mrope_section * 2

    def merge(t):
        return torch.cat([part[i % 3] for i, part in enumerate(t.split(sizes, dim=-1))],
                         dim=-1).unsqueeze(1)

    cos, sin = merge(cos), merge(sin)
    return _turn(q, cos, sin, _halves), _turn(k, cos, sin, _halves)


#: Form name -> its reference ``reference(q, k, cos, sin[, mrope_section])``.
REFERENCES: dict[str, Callable] = {
    "half": _half_full,
    "half, partial": _partial(_halves),
    "half, each dtype": _half_full_each,
    "adjacent, fp32": _pairs_fp32,
    "adjacent, partial": _partial(_pairs),
    "adjacent, first half of the tables, partial": _partial(_pairs, _first_half_twice),
    "adjacent, first half of the tables, fp32": _interleaved_fp32,
    "half, one half of the tables": _chunks,
    "half, de-interleaved input": _deinterleaved_input,
    "adjacent, de-interleaved output": _deinterleaved_output,
    "vision": _vision,
    "sections": _sections,
}
