"""The behaviour probe: whether a rotary replacement returns what transformers' function
returns, on inputs that cover every kind of call the replacement takes.

At patch time the original function and the replacement's posenc path run on a fixed set
of inputs (fixed seeds) that spans, axis by axis, what the replacement accepts (its
``*_supported`` predicate; ``tests/test_hf_probe.py`` derives the axes from the predicate,
so the two cannot drift apart):

* every dtype of q, of k and of the tables, in every combination;
* head sizes 16, 64, 128 and 256 (80 for the vision towers), with full, 3/4, 1/2 and 1/4
  rotary widths where the form is partial;
* one token (decode), a few, and more than a thousand;
* batch 1 and 2; equal and grouped head counts; shared and per-row tables, both
  ``unsqueeze_dim`` layouts;
* under grad and under no-grad; magnitudes of order 1 and of order 100.

Inputs the replacement hands to the original function anyway are not compared.  A
function is accepted only when, on every input posenc computes:

* the results have the original's number, types, shapes and dtypes;
* fp32 (a float32 result): the same bits, and under grad with fp32 inputs the gradients of
  q, k, cos and sin to fp32 rounding (a detached term would show there);
* float64: the same values to fp64 rounding of the terms;
* bf16 / fp16: element by element, posenc's value is the original's or at least as close
  as the original's to the original evaluated in fp64, up to twice the fp32 rounding of
  the terms (posenc rounds the fp32 result once; transformers rounds after each op, so its
  value may be one rounding further from the exact one, never nearer).  A missing or
  extra cast changes the dtype or moves values by bf16 ulps, a wrong half, sign or table by
  far more, and all of those fail;
* the original raising where posenc computes is a difference, and so is the original
  writing into its inputs.

The probe alone decides only for branch-free functions; see ``_forms`` for the rule that
asks more of a function whose source can take another path.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch

from .._checks import FLOAT_DTYPES

FLOAT = FLOAT_DTYPES
VISION_FLOAT = tuple(dt for dt in FLOAT_DTYPES if dt != torch.float64)
_FP32_SLACK = 2.0 ** -22  # twice fp32's unit roundoff
_FP64_SLACK = 2.0 ** -51


class Case(NamedTuple):
    label: str
    args: tuple
    kwargs: dict
    grad: bool  # the original runs under grad mode (and gradients are compared)


class Shape(NamedTuple):
    batch: int
    heads: int
    kv_heads: int
    seq: int
    dim: int
    scale: float  # q and k are scale * N(0, 1)
    grad: bool


# The shapes every kind of rotary function is probed at (besides the dtype cases): what a
# model could do differently for decode, batch 1, equal heads, long contexts, big heads,
# no-grad or large activations.
_SHAPES = (
    Shape(2, 4, 2, 5, 16, 1.0, True),
    Shape(1, 2, 2, 1, 64, 1.0, False),     # decode, batch 1, equal heads, no-grad
    Shape(1, 2, 1, 1100, 64, 1.0, True),   # a long sequence
    Shape(2, 2, 2, 3, 128, 40.0, False),   # large magnitudes
    Shape(1, 2, 1, 2, 256, 1.0, True),
    Shape(1, 3, 1, 1, 128, 1.0, True),     # decode under grad, grouped
)
_DTYPE_SHAPE = Shape(2, 4, 2, 5, 16, 1.0, True)


def _qk(gen: torch.Generator, s: Shape, q_dtype: torch.dtype, k_dtype: torch.dtype,
        heads_first: bool):
    """q (B, H, T, D) as transformers' attention has it (a transposed view of a projection
    output) for ``heads_first``, else (B, T, H, D); k likewise with its own head count."""
    q = (torch.randn(s.batch, s.seq, s.heads * s.dim, generator=gen, dtype=torch.float64)
         * s.scale).to(q_dtype).view(s.batch, s.seq, s.heads, s.dim)
    k = (torch.randn(s.batch, s.seq, s.kv_heads * s.dim, generator=gen, dtype=torch.float64)
         * s.scale).to(k_dtype).view(s.batch, s.seq, s.kv_heads, s.dim)
    return (q.transpose(1, 2), k.transpose(1, 2)) if heads_first else (q, k)


def _tables(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype):
    angle = torch.rand(shape, generator=gen, dtype=torch.float64) * 6
    return angle.cos().to(dtype), (angle * 1.3 + 0.4).sin().to(dtype)


def _widths(dim: int) -> tuple[int, ...]:
    """Table widths the text forms may be given: full, 3/4 (Phi-3), 1/2 (partial, or
    gpt-oss' one half), 1/4 (GLM-4, Qwen3-Next)."""
    return tuple(dict.fromkeys(w for w in (dim, dim * 3 // 4, dim // 2, dim // 4)
                               if w >= 2 and w % 2 == 0))


def _dtype_triples(q_dtypes: tuple, table_dtypes: tuple):
    return itertools.product(q_dtypes, q_dtypes, table_dtypes)


@functools.cache  # the probe clones every input it passes on
def text_cases() -> list[Case]:
    """Cases for ``apply_rotary_pos_emb`` (any form): q, k, cos, sin [, unsqueeze_dim]."""
    gen = torch.Generator().manual_seed(20)
    cases = []

    def add(s: Shape, q_dtype, k_dtype, t_dtype, width: int, unsqueeze_dim: int) -> None:
        q, k = _qk(gen, s, q_dtype, k_dtype, unsqueeze_dim == 1)
        rows = 1 if unsqueeze_dim == 1 else s.batch
        cos, sin = _tables(gen, (rows, s.seq, width), t_dtype)
        kwargs = {} if unsqueeze_dim == 1 else {"unsqueeze_dim": unsqueeze_dim}
        cases.append(Case(
            f"q {q_dtype}, k {k_dtype}, tables {t_dtype} of width {width}, {s}, "
            f"unsqueeze_dim={unsqueeze_dim}", (q, k, cos, sin), kwargs, s.grad))

    for i, (qd, kd, td) in enumerate(_dtype_triples(FLOAT, FLOAT)):
        s = _DTYPE_SHAPE
        for width in (s.dim, s.dim // 2):  # the full width, and gpt-oss' half
            add(s, qd, kd, td, width, 1 + i % 2)
    for i, s in enumerate(_SHAPES):
        for dtypes in ((torch.float32,) * 3, (torch.bfloat16, torch.bfloat16, torch.float32),
                       (torch.float16,) * 3):
            for width in _widths(s.dim):
                add(s, *dtypes, width, 1 + (i + len(cases)) % 2)
    return cases


@functools.cache  # the probe clones every input it passes on
def multimodal_cases() -> list[Case]:
    """Cases for the 4.x ``apply_multimodal_rotary_pos_emb``: q, k, cos, sin (3, ...),
    mrope_section, unsqueeze_dim."""
    gen = torch.Generator().manual_seed(21)
    cases = []

    def add(s: Shape, q_dtype, k_dtype, t_dtype, section: list[int], unsqueeze_dim: int):
        q, k = _qk(gen, s, q_dtype, k_dtype, unsqueeze_dim == 1)
        rows = 1 if unsqueeze_dim == 1 else s.batch
        cos, sin = _tables(gen, (3, rows, s.seq, s.dim), t_dtype)
        cases.append(Case(
            f"q {q_dtype}, k {k_dtype}, tables {t_dtype}, mrope_section {section}, {s}, "
            f"unsqueeze_dim={unsqueeze_dim}", (q, k, cos, sin, section),
            {"unsqueeze_dim": unsqueeze_dim}, s.grad))

    for i, (qd, kd, td) in enumerate(_dtype_triples(FLOAT, FLOAT)):
        add(_DTYPE_SHAPE, qd, kd, td, [2, 3, 3] if i % 2 else [4, 2, 2], 1 + i % 2)
    for i, s in enumerate(_SHAPES):
        # Qwen2-VL's real sections at head size 128, and sections scaled to the others
        d = s.dim // 2
        section = [16, 24, 24] if s.dim == 128 else [d // 4, d // 2 - d // 4 - d // 8,
                                                     d - d // 4 - (d // 2 - d // 4 - d // 8)]
        for dtypes in ((torch.float32,) * 3, (torch.bfloat16, torch.bfloat16, torch.float32),
                       (torch.float16,) * 3):
            add(s, *dtypes, section, 1 + i % 2)
    return cases


_VISION_SHAPES = (  # (N tokens, heads, head size, scale, grad); q and k (N, H, D)
    (7, 4, 16, 1.0, True), (1, 2, 80, 1.0, False), (1100, 1, 64, 1.0, True),
    (5, 2, 80, 40.0, False), (3, 1, 128, 1.0, True))


@functools.cache  # the probe clones every input it passes on
def vision_cases() -> list[Case]:
    """Cases for ``apply_rotary_pos_emb_vision``: q, k (N, H, D) slices of the vision
    attention's packed qkv, cos, sin (N, D)."""
    gen = torch.Generator().manual_seed(22)
    cases = []

    def add(n, heads, dim, scale, grad, qd, kd, td):
        qkv = torch.randn(n, 3, heads, dim, generator=gen, dtype=torch.float64) * scale
        q, k = qkv.permute(1, 0, 2, 3)[:2]
        cos, sin = _tables(gen, (n, dim), td)
        cases.append(Case(f"q {qd}, k {kd}, tables {td}, N={n}, heads={heads}, D={dim}, "
                          f"scale {scale}, grad={grad}", (q.to(qd), k.to(kd), cos, sin), {},
                          grad))

    for qd, kd, td in _dtype_triples(VISION_FLOAT, FLOAT):
        add(7, 4, 16, 1.0, True, qd, kd, td)
    for shape in _VISION_SHAPES:
        for dtypes in ((torch.float32,) * 3, (torch.bfloat16, torch.bfloat16, torch.float32)):
            add(*shape, *dtypes)
    return cases


def features(case: Case, qk_layout: str = "text") -> dict[str, object]:
    """The axes the module docstring lists, as one probe case has them (for the coverage
    test and for reasons)."""
    q, k, cos = case.args[:3]
    if qk_layout == "vision":
        heads_q, heads_k, seq, batch = q.shape[1], k.shape[1], q.shape[0], 1
    else:
        heads_first = case.kwargs.get("unsqueeze_dim", 1) == 1
        seq_dim, head_dim = (2, 1) if heads_first else (1, 2)
        heads_q, heads_k, seq, batch = (q.shape[head_dim], k.shape[head_dim], q.shape[seq_dim],
                                        q.shape[0])
    return {
        "dtypes": (q.dtype, k.dtype, cos.dtype),
        "head_dim": q.shape[-1],
        "partial": cos.shape[-1] < q.shape[-1],
        "seq": "one" if seq == 1 else "long" if seq > 1000 else "few",
        "batch": 1 if batch == 1 else "several",
        "heads": "equal" if heads_q == heads_k else "grouped",
        "grad": case.grad,
        "magnitude": "large" if q.abs().max().item() > 6 else "small",
    }


# ---------------------------------------------------------------------------------------


def _clone_args(args: tuple, grad: bool) -> tuple:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.detach().clone(memory_format=torch.preserve_format)
            a.requires_grad_(grad)
        out.append(a)
    return tuple(out)


def _tensors_out(result: object) -> tuple[torch.Tensor, ...] | None:
    if isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
        return tuple(result)
    return None


def close_to_exact(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor,
                   slack: float) -> bool:
    """Element by element: posenc's value is the original's, or at least as close to the
    exact value (up to ``slack``)."""
    ours, theirs, exact = ours.double(), theirs.double(), exact.double()
    return bool(((ours == theirs) | ((ours - exact).abs() <= (theirs - exact).abs() + slack))
                .all())


def _grads(outputs: tuple[torch.Tensor, ...], inputs: tuple) -> tuple:
    gen = torch.Generator().manual_seed(23)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
               for o in outputs)
    leaves = [a for a in inputs if isinstance(a, torch.Tensor)]
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def first_difference(original: Callable, ours: Callable, supported: Callable,
                     cases: list[Case]) -> tuple[str | None, int]:
    """(None, cases compared) when ``ours`` returns what ``original`` returns on every case
    that ``supported`` lets it compute (see the module docstring; "posenc computes none of
    the probe inputs" when there is none), else (the first difference in words, cases that
    agreed before it)."""
    computed = 0
    for case in cases:
        if not supported(*case.args, **case.kwargs):
            continue  # the wrapper hands this call to the original function
        reason = _case_difference(original, ours, case)
        if reason is not None:
            return f"{reason} for {case.label}", computed
        computed += 1
    if computed == 0:
        return "posenc computes none of the probe inputs", 0
    return None, computed


def _case_difference(original: Callable, ours: Callable, case: Case) -> str | None:
    try:
        with torch.no_grad():
            expected = ours(*_clone_args(case.args, False), **case.kwargs)
    except Exception as e:  # noqa: BLE001 -- a difference, reported as such
        return f"posenc raised {type(e).__name__} ({e})"
    fp32 = all(o.dtype == torch.float32 for o in expected)
    # gradients compared where every input is fp32 (bf16 gradients round differently)
    grad = case.grad and fp32 and all(a.dtype == torch.float32 for a in case.args
                                      if isinstance(a, torch.Tensor))
    theirs_args = _clone_args(case.args, grad)
    inputs = _clone_args(case.args, False)
    try:
        with torch.set_grad_enabled(case.grad):
            result = original(*theirs_args, **case.kwargs)
    except Exception as e:  # noqa: BLE001 -- transformers rejects what posenc computes
        return f"it raises {type(e).__name__} where posenc computes"
    got = _tensors_out(result)
    if got is None or len(got) != len(expected):
        return f"it returns {type(result).__name__}, not two tensors"
    for name, a, b in zip(("first", "second"), expected, got, strict=False):
        if a.dtype != b.dtype or a.shape != b.shape:
            return (f"its {name} result is {b.dtype} {tuple(b.shape)}, posenc's "
                    f"{a.dtype} {tuple(a.shape)}")
    if any(not torch.equal(x, y) for x, y in zip(theirs_args, inputs, strict=True)
           if isinstance(x, torch.Tensor)):
        return "it writes into its inputs"
    if fp32:
        if not all(torch.equal(a, b) for a, b in zip(expected, got, strict=False)):
            return "its fp32 results differ from posenc's in bits"
        if grad:
            ours_args = _clone_args(case.args, True)
            with torch.enable_grad():
                ours_grads = _grads(ours(*ours_args, **case.kwargs), ours_args)
                their_grads = _grads(got, theirs_args)
            for a, b in zip(ours_grads, their_grads, strict=True):
                if (a is None) != (b is None) or (
                        a is not None and not torch.allclose(a, b, rtol=1.3e-6, atol=1e-5)):
                    return "its gradients differ from posenc's"
        return None
    exact_args = tuple(a.double() if isinstance(a, torch.Tensor) else a for a in inputs)
    try:
        with torch.no_grad():
            exact = _tensors_out(original(*exact_args, **case.kwargs))
    except Exception as e:  # noqa: BLE001
        return f"it raises {type(e).__name__} in float64 ({e})"
    if exact is None or len(exact) != len(got):
        return "it returns no tensor pair in float64"
    # a bound of the two terms' sum, for the rounding allowance
    magnitudes = [a.abs().max().item() for a in exact_args[:4]]
    scale = 2 * max(magnitudes[:2]) * max(magnitudes[2:])
    f64 = all(o.dtype == torch.float64 for o in expected)
    slack = (_FP64_SLACK if f64 else _FP32_SLACK) * scale
    for name, a, b, e in zip(("first", "second"), expected, got, exact, strict=False):
        if not close_to_exact(a, b, e, slack):
            return (f"posenc's {a.dtype} {name} result is further from the function's exact "
                    "(fp64) value than the function's own rounding")
    return None
