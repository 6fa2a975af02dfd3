"""posenc's references: the rotary forms posenc computes, each written as plain torch.

Each :class:`Form` pairs a reference with the way the posenc op computes the same thing
(``pairing``, ``table``, ``cast``, ``permute``; ``_rotary.rotate_as``); a row of the
verified table names a form by its ``name``.  The verify command
(``posenc_torch.hf.verify``) finds a transformers function to be a form when the graph
torch's tracer captures from it equals the reference's under every regime the form is
computed in.  The tests check each reference against the posenc op over shapes and
dtypes, and against transformers' own functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def _dtype_pairs(q_dtypes: tuple[torch.dtype, ...]) -> tuple[tuple[torch.dtype, ...], ...]:
    """(q and k, tables): the tables in q's dtype or in fp32."""
    return tuple(dict.fromkeys((d, t) for d in q_dtypes for t in (d, F32)))


#: The (q and k, tables) dtypes of the calls posenc computes; others go to transformers.
DTYPES = _dtype_pairs((F16, BF16, F32))
#: The dtypes of a capture of a function that reads none (its graph does not depend on them).
REPRESENTATIVE = (BF16, F32)


class Form(NamedTuple):
    """One form: ``reference(q, k, cos, sin[, mrope_section])`` and how posenc computes it.

    layout: the tables' width the form takes ("full", "partial", "half", "vision",
        "sections"; ``verify._graphs.Regime``).
    pairing: "half" (channel j with j + R/2) or "adjacent" (2i with 2i + 1).
    table: "as_given"; "first_half_interleaved" (the first half of the tables, each entry
        twice: GLM, ERNIE-4.5); "doubled" (one half given, used for both: gpt-oss).
    cast: None (result dtype ``result_type(q, cos)``); "each" (q's and k's own dtypes);
        "fp32_to_q" (computed in fp32, both results in q's dtype).
    permute: None; "input" (q, k de-interleaved first: channels 0, 2, 4, ..., then 1, 3,
        5, ...); "output" (adjacent pairs rotated, results de-interleaved).
    """

    name: str
    reference: Callable
    layout: str
    pairing: str = "half"
    table: str = "as_given"
    cast: str | None = None
    permute: str | None = None

    @property
    def partial(self) -> bool:
        return self.layout == "partial"


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


#: The forms of ``apply_rotary_pos_emb`` (and DeepSeek-V3's ``..._interleave``), in the
#: order they are tried (the common ones first).
TEXT_FORMS: tuple[Form, ...] = (
    Form("half", _half_full, "full"),
    Form("half, partial", _partial(_halves), "partial"),
    Form("half, each dtype", _half_full_each, "full", cast="each"),
    Form("adjacent, fp32", _pairs_fp32, "full", pairing="adjacent", cast="fp32_to_q"),
    Form("adjacent, partial", _partial(_pairs), "partial", pairing="adjacent"),
    Form("adjacent, first half of the tables, partial", _partial(_pairs, _first_half_twice),
         "partial", pairing="adjacent", table="first_half_interleaved"),
    Form("adjacent, first half of the tables, fp32", _interleaved_fp32, "full",
         pairing="adjacent", table="first_half_interleaved", cast="fp32_to_q"),
    Form("half, one half of the tables", _chunks, "half", table="doubled"),
    Form("half, de-interleaved input", _deinterleaved_input, "full", permute="input"),
    Form("adjacent, de-interleaved output", _deinterleaved_output, "full",
         pairing="adjacent", table="first_half_interleaved", permute="output"),
)
VISION_FORM = Form("vision", _vision, "vision")
SECTIONS_FORM = Form("sections", _sections, "sections")


FORMS_BY_NAME = {form.name: form for form in (*TEXT_FORMS, VISION_FORM, SECTIONS_FORM)}
