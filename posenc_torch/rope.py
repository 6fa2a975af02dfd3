"""Public RoPE functions: transformers drop-ins and the fused positions-in path.

Argument checks live in one layer: the C++ shim checks sizes, dtypes and devices of what the
op receives.  The checks here cover what only Python sees (option names, the caller's
layout, tensor types, mixed devices) and run before the op only where a fast path does not
apply (tracing, non-CPU tensors); on the eager CPU path they run after the op has failed,
to replace its message with one in terms of the public function's own arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import ops
from ._checks import (
    check_float,
    check_float_dtype,
    check_same_device,
    check_sections,
    check_tensor,
    check_unsqueeze_dim,
    pairing_code,
)

_QK_LAYOUT = {1: "(batch, heads, seq, head_dim)", 2: "(batch, seq, heads, head_dim)"}


def _check_qk(q: torch.Tensor, k: torch.Tensor, unsqueeze_dim: int) -> None:
    layout = _QK_LAYOUT[unsqueeze_dim]
    check_tensor("q", q, 4, f"4-D {layout} for unsqueeze_dim={unsqueeze_dim}")
    check_tensor("k", k, 4, f"4-D {layout} for unsqueeze_dim={unsqueeze_dim}")
    check_float("q", q)
    check_float("k", k)


def _fast(a: object, b: object, c: object, d: object) -> bool:
    """Eager call on CPU tensors: the op's own checks come first (see the module doc)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and isinstance(c, torch.Tensor) and isinstance(d, torch.Tensor)
            and a.is_cpu and b.is_cpu and c.is_cpu and d.is_cpu
            and not torch.compiler.is_compiling())


def _explain(check: Callable[..., None], *args: object) -> None:
    """Called while the op's exception is handled on the fast path: raise ``check``'s error,
    which names the public function's arguments, if it finds one; else return (the caller
    re-raises the op's own)."""
    try:
        check(*args)
    except (TypeError, ValueError, NotImplementedError) as err:
        raise err from None


def _check_no_inv_freq_grad(inv_freq: torch.Tensor) -> None:
    if inv_freq.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "inv_freq requires grad, but posenc_torch does not differentiate with respect to "
            "the frequencies; pass inv_freq.detach() (rotary modules keep it as a buffer)")


def _check_table_call(q: object, k: object, cos: object, sin: object, dim: int,
                      sections: list[int] | None) -> None:
    """The checks of the table-driven rotations: ``sections`` None for RoPE (3-D tables),
    a list for MRoPE ((3, batch, seq, head_dim) tables)."""
    _check_qk(q, k, dim)
    if sections is None:
        check_tensor("cos", cos, 3, "3-D (batch, seq, rot_dim)")
        check_tensor("sin", sin, 3, "3-D (batch, seq, rot_dim)")
    else:
        check_tensor("cos", cos, 4, "4-D (3, batch, seq, head_dim)")
        check_tensor("sin", sin, 4, "4-D (3, batch, seq, head_dim)")
    check_float("cos", cos)
    check_float("sin", sin)
    if sections is not None and 2 * sum(sections) != cos.shape[-1]:
        raise ValueError(
            f"mrope_section {sections} must satisfy 2 * sum == {cos.shape[-1]} "
            f"(the last dim of cos), got 2 * {sum(sections)} = {2 * sum(sections)}")
    check_same_device(q=q, k=k, cos=cos, sin=sin)


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | int | None = None,
    unsqueeze_dim: int = 1,
    *,
    pairing: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k with per-token cos/sin tables (transformers' ``apply_rotary_pos_emb``).

    Shapes (``unsqueeze_dim=1``, the transformers layout; ``2`` swaps heads and seq):
        q:   (B, Hq, T, D), any strides with a contiguous last dim (views are not copied)
        k:   (B, Hkv, T, D)
        cos, sin: (Bc, T, R) with Bc in {1, B}; R <= D even (R < D: partial rotary, the
             channels past R are passed through)
    Returns ``(q_embed, k_embed)`` of q's and k's shapes, dtype ``torch.result_type(q, cos)``.

    ``position_ids`` is accepted and ignored, as in transformers 4.x; a fifth positional
    *int* is taken as ``unsqueeze_dim`` (the newer transformers signature).  ``pairing``
    chooses which channels rotate together: "half" (j with j + R/2, transformers'
    ``rotate_half``) or "adjacent" (2i with 2i+1, GPT-J; give tables whose entries 2i and
    2i+1 hold the same frequency).
    """
    if isinstance(position_ids, int) and not isinstance(position_ids, bool):
        unsqueeze_dim, position_ids = position_ids, None
    dim = check_unsqueeze_dim(unsqueeze_dim)
    code = pairing_code(pairing)

    fast = _fast(q, k, cos, sin)
    if not fast:
        _check_table_call(q, k, cos, sin, dim, None)
    try:
        return ops.rope(q, k, cos, sin, [], False, code, False, None, None, dim == 1)
    except Exception:
        if fast:
            _explain(_check_table_call, q, k, cos, sin, dim, None)
        raise


def apply_multimodal_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: Sequence[int],
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL / Qwen2.5-VL MRoPE (transformers 4.x ``apply_multimodal_rotary_pos_emb``).

    Shapes (``unsqueeze_dim=1``):
        q: (B, Hq, T, D), k: (B, Hkv, T, D)
        cos, sin: (3, Bc, T, D) — tables of the temporal, height and width positions
        mrope_section: 3 ints with 2 * sum == D, e.g. [16, 24, 24] for head_dim 128
    Frequency slot j (channels j and j + D/2) takes its cos/sin from axis T for
    j < s0, H for j < s0 + s1, else W; the merged (B, T, D) tables are never built.
    Returns ``(q_embed, k_embed)``, dtype ``torch.result_type(q, cos)``.
    """
    dim = check_unsqueeze_dim(unsqueeze_dim)
    sections = check_sections(mrope_section)

    fast = _fast(q, k, cos, sin)
    if not fast:
        _check_table_call(q, k, cos, sin, dim, sections)
    try:
        return ops.rope(q, k, cos, sin, sections, False, 0, False, None, None, dim == 1)
    except Exception:
        if fast:
            _explain(_check_table_call, q, k, cos, sin, dim, sections)
        raise


def apply_rotary_pos_emb_vision(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL / Qwen2.5-VL vision-tower RoPE (transformers' ``apply_rotary_pos_emb_vision``).

    Shapes:
        q, k: (N, H, D) — N patches
        cos, sin: (N, D)
    As in transformers (4.57 and 5.x alike), the rotation runs in fp32 for every input dtype,
    fp64 included (fp64 q, k, cos, sin are rounded to fp32 first), and the results are
    cast to q's and k's dtypes; fp32 and fp64 inputs give transformers' values exactly.
    """

    fast = _fast(q, k, cos, sin)
    if not fast:
        _check_vision_call(q, k, cos, sin)
    # fp64 is the one dtype the kernels would not narrow to fp32: round it here, and widen
    # the fp32 results afterwards, as transformers' casts do (forward and backward).
    f64, f32 = torch.float64, torch.float32
    try:
        q_out, k_out = ops.rope(
            (q.float() if q.dtype == f64 else q).unsqueeze(0),
            (k.float() if k.dtype == f64 else k).unsqueeze(0),
            cos.float().unsqueeze(0), sin.float().unsqueeze(0), [], False, 0, False,
            f32 if q.dtype == f64 else q.dtype, f32 if k.dtype == f64 else k.dtype)
    except Exception:
        if fast:
            _explain(_check_vision_call, q, k, cos, sin)
        raise
    return q_out.squeeze(0).to(q.dtype), k_out.squeeze(0).to(k.dtype)


def _check_vision_call(q: object, k: object, cos: object, sin: object) -> None:
    check_tensor("q", q, 3, "3-D (patches, heads, head_dim)")
    check_tensor("k", k, 3, "3-D (patches, heads, head_dim)")
    check_tensor("cos", cos, 2, "2-D (patches, head_dim)")
    check_tensor("sin", sin, 2, "2-D (patches, head_dim)")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
    check_same_device(q=q, k=k, cos=cos, sin=sin)


def _check_positions(position_ids: torch.Tensor, inv_freq: torch.Tensor,
                     mrope_section: Sequence[int] | None) -> list[int]:
    check_tensor("position_ids", position_ids, (2, 3), "(batch, seq) or (3, batch, seq)")
    if position_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"position_ids must be int64 or int32, got {position_ids.dtype}")
    check_tensor("inv_freq", inv_freq, 1, "1-D (rot_dim / 2,)")
    if not inv_freq.is_floating_point():
        raise TypeError(f"inv_freq must be floating point, got {inv_freq.dtype}")
    _check_no_inv_freq_grad(inv_freq)
    if mrope_section is None:
        if position_ids.dim() == 3:
            raise ValueError("position_ids of shape (3, batch, seq) need mrope_section")
        return []
    sections = check_sections(mrope_section)
    if sum(sections) != inv_freq.shape[0]:
        raise ValueError(
            f"mrope_section {list(mrope_section)} must sum to len(inv_freq) = "
            f"{inv_freq.shape[0]} (2 * sum == rotary width), got {sum(sections)}")
    return sections


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    mrope_section: Sequence[int] | None = None,
    interleaved_mrope: bool = False,
    attention_scaling: float = 1.0,
    unsqueeze_dim: int = 1,
    pairing: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused RoPE: positions in, rotated q and k out; no cos/sin tables in memory.

    Shapes (``unsqueeze_dim=1``):
        q: (B, Hq, T, D), k: (B, Hkv, T, D)
        position_ids: (Bp, T) for RoPE, or (3, Bp, T) with ``mrope_section`` for MRoPE
            (Qwen2-VL sections, or Qwen3-VL with ``interleaved_mrope=True``); Bp in {1, B}
        inv_freq: (R/2,) — the rotary module's ``inv_freq``; R = 2 * len(inv_freq) <= D
    Each token's angles fl32(inv_freq[i] * fl32(pos)) and their sin/cos are computed once,
    in fp32, and shared by all heads; cos/sin are scaled by ``attention_scaling`` and are
    not rounded to q's dtype.  Returns ``(q_embed, k_embed)`` in q's and k's dtypes.

    Gradients flow to q and k; ``inv_freq`` is a constant here (a ``ValueError`` names it
    when it requires grad in grad mode: pass ``inv_freq.detach()``).
    """
    dim = check_unsqueeze_dim(unsqueeze_dim)
    code = pairing_code(pairing)

    fast = _fast(q, k, position_ids, inv_freq)
    if not fast:
        _check_fused_call(q, k, position_ids, inv_freq, dim, mrope_section)
    _check_no_inv_freq_grad(inv_freq)  # the op would ignore it: never silently
    sections = [] if mrope_section is None else check_sections(mrope_section)
    try:
        return ops.rope_fused(q, k, position_ids, inv_freq, sections, bool(interleaved_mrope),
                              float(attention_scaling), code, False, dim == 1)
    except Exception:
        if fast:
            _explain(_check_fused_call, q, k, position_ids, inv_freq, dim, mrope_section)
        raise


def _check_fused_call(q: object, k: object, position_ids: object, inv_freq: object, dim: int,
                      mrope_section: Sequence[int] | None) -> None:
    _check_qk(q, k, dim)
    _check_positions(position_ids, inv_freq, mrope_section)
    if 2 * inv_freq.shape[0] > q.shape[-1]:
        raise ValueError(
            f"inv_freq has {inv_freq.shape[0]} frequencies, so the rotary width "
            f"2 * {inv_freq.shape[0]} = {2 * inv_freq.shape[0]} exceeds head_dim "
            f"{q.shape[-1]}")
    check_same_device(q=q, k=k, position_ids=position_ids, inv_freq=inv_freq)


def compute_mrope_cos_sin(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int] | None = None,
    *,
    interleaved: bool = False,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
    pairing: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables as transformers' rotary modules produce them.

    Shapes:
        position_ids: (Bp, T) — ``LlamaRotaryEmbedding``; or (3, Bp, T) with
            ``mrope_section`` — Qwen2-VL's section-merged tables, or Qwen3-VL's interleaved
            tables with ``interleaved=True``
        inv_freq: (R/2,)
    Returns ``(cos, sin)``, each (Bp, T, R) in ``dtype``: angles fl32(inv_freq * pos),
    cos/sin in fp32 times ``attention_scaling``, then one rounding to ``dtype``.  With
    ``pairing="adjacent"`` frequency i fills channels 2i and 2i+1 instead of i and i + R/2.
    The tables are not differentiable: an ``inv_freq`` that requires grad (in grad mode) is
    rejected with a ``ValueError`` naming it.
    """
    sections = _check_positions(position_ids, inv_freq, mrope_section)
    check_float_dtype("dtype", dtype)
    check_same_device(position_ids=position_ids, inv_freq=inv_freq)
    return ops.rope_tables(position_ids, inv_freq, sections, bool(interleaved),
                           float(attention_scaling), pairing_code(pairing), dtype)
