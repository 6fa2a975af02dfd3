"""Public RoPE functions: transformers drop-ins and the fused positions-in path.

The op validates its arguments (the C++ shim); each function here calls it first and runs
its own checks (``_checks``: tensor types, ranks in the caller's layout, devices) only when
the op has failed, to raise the error of the policy class that names the public argument.
While tracing (``torch.compile`` / export: fake tensors, no kernel runs) the checks come
first instead.  The path is the same for every device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import ops
from ._checks import (
    InputTypeError,
    InputValueError,
    check_bool,
    check_dtype,
    check_real,
    check_same_device,
    check_sections,
    check_tensor,
    check_unsqueeze_dim,
    explain,
    pairing_code,
)

_QK_LAYOUT = {1: "(batch, heads, seq, head_dim)", 2: "(batch, seq, heads, head_dim)"}
_is_compiling = torch.compiler.is_compiling


def _check_qk(q: object, k: object, unsqueeze_dim: int) -> None:
    layout = _QK_LAYOUT[unsqueeze_dim]
    check_tensor("q", q, 4, f"4-D {layout} for unsqueeze_dim={unsqueeze_dim}")
    check_tensor("k", k, 4, f"4-D {layout} for unsqueeze_dim={unsqueeze_dim}")


def _check_no_inv_freq_grad(inv_freq: torch.Tensor) -> None:
    if inv_freq.requires_grad and torch.is_grad_enabled():
        raise InputValueError(
            "inv_freq requires grad, but posenc_torch does not differentiate with respect to "
            "the frequencies; pass inv_freq.detach() (rotary modules keep it as a buffer)")


def _check_table_call(q: object, k: object, cos: object, sin: object, dim: int,
                      sections: list[int] | None) -> None:
    """What the op cannot say in the caller's terms: tensor types, ranks in the layout of
    ``unsqueeze_dim``, devices.  ``sections`` None for RoPE (3-D tables), a list for MRoPE
    ((3, batch, seq, head_dim) tables)."""
    _check_qk(q, k, dim)
    if sections is None:
        check_tensor("cos", cos, 3, "3-D (batch, seq, rot_dim)")
        check_tensor("sin", sin, 3, "3-D (batch, seq, rot_dim)")
    else:
        check_tensor("cos", cos, 4, "4-D (3, batch, seq, head_dim)")
        check_tensor("sin", sin, 4, "4-D (3, batch, seq, head_dim)")
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

    if _is_compiling():
        _check_table_call(q, k, cos, sin, dim, None)
    try:
        return ops.rope(q, k, cos, sin, [], False, code, False, None, None, dim == 1)
    except Exception as err:
        raise explain(err, _check_table_call, q, k, cos, sin, dim, None) from None


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

    if _is_compiling():
        _check_table_call(q, k, cos, sin, dim, sections)
    try:
        return ops.rope(q, k, cos, sin, sections, False, 0, False, None, None, dim == 1)
    except Exception as err:
        raise explain(err, _check_table_call, q, k, cos, sin, dim, sections) from None


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
    if _is_compiling():
        _check_vision_call(q, k, cos, sin)
    # fp64 is the one dtype the kernels would not narrow to fp32: round it here, and widen
    # the fp32 results afterwards, as transformers' casts do (forward and backward).
    f64, f32 = torch.float64, torch.float32
    try:
        if cos.dtype != f32 or sin.dtype != f32:  # transformers takes cos.float(), sin.float()
            cos, sin = _vision_table("cos", cos), _vision_table("sin", sin)
        q_out, k_out = ops.rope(
            (q.float() if q.dtype == f64 else q).unsqueeze(0),
            (k.float() if k.dtype == f64 else k).unsqueeze(0),
            cos.unsqueeze(0), sin.unsqueeze(0), [], False, 0, False,
            f32 if q.dtype == f64 else q.dtype, f32 if k.dtype == f64 else k.dtype)
    except Exception as err:
        raise explain(err, _check_vision_call, q, k, cos, sin) from None
    return q_out.squeeze(0).to(q.dtype), k_out.squeeze(0).to(k.dtype)


def _vision_table(name: str, t: torch.Tensor) -> torch.Tensor:
    """A float table as fp32 (an integer one is a TypeError, not a silent conversion)."""
    if not t.is_floating_point():
        raise InputTypeError(f"{name} must be float32, float64, bfloat16 or float16, got {t.dtype}")
    return t.float()


def _check_vision_call(q: object, k: object, cos: object, sin: object) -> None:
    check_tensor("q", q, 3, "3-D (patches, heads, head_dim)")
    check_tensor("k", k, 3, "3-D (patches, heads, head_dim)")
    check_tensor("cos", cos, 2, "2-D (patches, head_dim)")
    check_tensor("sin", sin, 2, "2-D (patches, head_dim)")
    patches = q.shape[0]  # the op sees them as a sequence: name them as the caller does
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.shape[0] != patches:
            raise InputValueError(f"{name} has {t.shape[0]} patches (dim 0) but q has {patches}")
    check_same_device(q=q, k=k, cos=cos, sin=sin)


def _check_positions(position_ids: object, inv_freq: object) -> None:
    check_tensor("position_ids", position_ids, (2, 3), "(batch, seq) or (3, batch, seq)")
    check_tensor("inv_freq", inv_freq, 1, "1-D (rot_dim / 2,)")
    check_same_device(position_ids=position_ids, inv_freq=inv_freq)


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
    when it requires grad in grad mode: pass ``inv_freq.detach()``).  ``attention_scaling``
    is a real number (int or float; a tensor is a ``TypeError``, as its gradient would be
    lost) and ``interleaved_mrope`` a bool.
    """
    dim = check_unsqueeze_dim(unsqueeze_dim)
    code = pairing_code(pairing)
    sections = [] if mrope_section is None else check_sections(mrope_section)
    check_bool("interleaved_mrope", interleaved_mrope)
    scaling = (attention_scaling if type(attention_scaling) is float
               else check_real("attention_scaling", attention_scaling))
    if _is_compiling():
        _check_fused_call(q, k, position_ids, inv_freq, dim)
    try:
        _check_no_inv_freq_grad(inv_freq)  # the op would ignore it: never silently
        return ops.rope_fused(q, k, position_ids, inv_freq, sections, interleaved_mrope,
                              scaling, code, False, dim == 1)
    except Exception as err:
        raise explain(err, _check_fused_call, q, k, position_ids, inv_freq, dim) from None


def _check_fused_call(q: object, k: object, position_ids: object, inv_freq: object,
                      dim: int) -> None:
    _check_qk(q, k, dim)
    _check_positions(position_ids, inv_freq)
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
    rejected with a ``ValueError`` naming it, and ``attention_scaling`` is a real number
    (int or float; a tensor is a ``TypeError``).  ``interleaved`` is a bool.
    """
    sections = [] if mrope_section is None else check_sections(mrope_section)
    check_bool("interleaved", interleaved)
    scaling = check_real("attention_scaling", attention_scaling)
    check_dtype("dtype", dtype)
    code = pairing_code(pairing)
    if _is_compiling():
        _check_positions(position_ids, inv_freq)
    try:
        _check_no_inv_freq_grad(inv_freq)
        return ops.rope_tables(position_ids, inv_freq, sections, interleaved, scaling, code,
                               dtype)
    except Exception as err:
        raise explain(err, _check_positions, position_ids, inv_freq) from None
