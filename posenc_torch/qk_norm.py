"""The fused per-head q/k RMSNorm + RoPE: the attention prologue of the models that norm q
and k per head right before ``apply_rotary_pos_emb`` (Qwen3, Qwen3-VL, Qwen3.5, Gemma 3,
OLMo and others; the forms and their model types are in docs/qk_norm.md).

The op validates its arguments (the C++ shim); the function here calls it first and runs
its own checks only when the op has failed (or while tracing), as rope.py does.
"""

from __future__ import annotations

import platform

import torch

from . import ops
from ._checks import (
    InputValueError,
    check_real,
    check_same_device,
    check_str,
    check_tensor,
    check_unsqueeze_dim,
    explain,
    pairing_code,
)

_QK_LAYOUT = {1: "(batch, heads, seq, head_dim)", 2: "(batch, seq, heads, head_dim)"}
_is_compiling = torch.compiler.is_compiling


def torch_sum_lanes(capability: str | None = None, machine: str | None = None) -> int:
    """The lanes of torch's ``Vectorized<float>`` in the CPU sum kernel that
    ``x.pow(2).mean(-1)`` runs, which fix its order of additions: 8 on x86-64 for every
    capability (DEFAULT and AVX2 are 256-bit; torch registers no AVX-512 sum kernel, so
    AVX512 runs the AVX2 one), 8 for SVE256 and 4 for NEON on aarch64."""
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    machine = platform.machine().lower() if machine is None else machine
    if machine in ("aarch64", "arm64"):
        return 8 if capability.upper() == "SVE256" else 4
    return 8


#: torch_sum_lanes() of this process (the capability is fixed when torch starts)
SUM_LANES = torch_sum_lanes()


def _form(norm: object) -> int:
    check_str("norm", norm)
    try:
        return ops.QK_NORM_FORMS[norm]
    except KeyError:
        names = ", ".join(repr(n) for n in ops.QK_NORM_FORMS)
        raise InputValueError(f"norm must be one of {names}, got {norm!r}") from None


def _check_call(q: object, k: object, cos: object, sin: object, q_weight: object,
                k_weight: object, dim: int) -> None:
    """What the op cannot say in the caller's terms: tensor types, ranks in the layout of
    ``unsqueeze_dim``, devices (CUDA: NotImplementedError, the op has no CUDA kernel yet)."""
    layout = _QK_LAYOUT[dim]
    check_tensor("q", q, 4, f"4-D {layout} for unsqueeze_dim={dim}")
    check_tensor("k", k, 4, f"4-D {layout} for unsqueeze_dim={dim}")
    check_tensor("cos", cos, 3, "3-D (batch, seq, rot_dim)")
    check_tensor("sin", sin, 3, "3-D (batch, seq, rot_dim)")
    check_tensor("q_weight", q_weight, 1, "1-D (head_dim,)")
    check_tensor("k_weight", k_weight, 1, "1-D (head_dim,)")
    tensors = {"q": q, "k": k, "cos": cos, "sin": sin, "q_weight": q_weight,
               "k_weight": k_weight}
    check_same_device(**tensors)
    for name, t in tensors.items():
        if t.device.type not in ("cpu", "meta"):
            raise NotImplementedError(
                f"apply_qk_norm_rope runs on CPU tensors only (no CUDA kernel yet); {name} is "
                f"on {t.device}")


def _weightless(x: object, name: str, form: int) -> torch.Tensor | None:
    """The weight of a norm without one (transformers' ``with_scale=False``): ones, whose
    products are exact, so the result is the weightless norm's bit for bit.  (None when x
    is not a tensor with a channel dim: the op's checks then name x.)"""
    if form != ops.QK_NORM_FORMS["pow"]:
        raise InputValueError(f"{name} may be None only for norm='pow' (a norm without a "
                              "weight, transformers' with_scale=False)")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    return x.new_ones(x.shape[-1])


def apply_qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    unsqueeze_dim: int = 1,
    *,
    norm: str = "weight",
    pairing: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' per-head RMSNorm of q and k followed by the rotary, in one pass.

    Equal to ``apply_rotary_pos_emb(N_q(q), N_k(k), cos, sin, unsqueeze_dim)`` where ``N`` is
    the per-head norm over the last dim of the form ``norm`` with weight ``q_weight`` /
    ``k_weight`` and ``eps``:

        "weight"           ``w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)``
                           (Llama-style: Qwen3, Qwen3-MoE, Qwen3-VL, ...)
        "one_plus_weight"  ``(x32 * rsqrt(...) * (1 + w.float())).to(dtype)``
                           (Gemma 3, Qwen3.5, Qwen3-Next, ...)
        "weight_f32"       ``(w * x32 * rsqrt(...)).to(dtype)``, the weight applied in fp32
                           (OLMo-style per-head norms: AFMoE, ...)
        "pow"              ``(x32 * torch.pow(mean(x32^2) + eps, -0.5) * w.float())
                           .to(dtype)`` (Gemma 3n, Gemma 4, ...); its gradients are
                           autograd's through ``pow``, not ``rsqrt``.  A weight of None is
                           the norm without one (``with_scale=False``: NeoMME)

    Shapes (``unsqueeze_dim=1``, the transformers layout; ``2`` swaps heads and seq):
        q:   (B, Hq, T, D), any strides with a contiguous last dim (transposed views of
             the projection are read as they are)
        k:   (B, Hkv, T, D)
        cos, sin: (Bc, T, R) with Bc in {1, B}; R <= D even (R < D: partial rotary), e.g.
             Qwen3-VL's interleaved-MRoPE tables
        q_weight, k_weight: (D,), or None for norm="pow" without a weight
    Every tensor has q's dtype (float32, float64, bfloat16 or float16), except that the
    weights may be float32 beside bfloat16 / float16 q and k for the forms that apply the
    weight in fp32 ("one_plus_weight", "weight_f32", "pow": mixed-precision training keeps
    them so); their gradients come back in the weights' dtype.  Returns ``(q_embed,
    k_embed)`` of q's and k's shapes and dtype.

    fp32 results are bit-identical to transformers' norm modules followed by transformers'
    ``apply_rotary_pos_emb`` (torch's own order of the mean's additions); bf16 / fp16
    results to transformers' norm followed by posenc's ``apply_rotary_pos_emb``; fp64
    computes in fp64.  The gradients of q, k and the weights are autograd's through the
    same chain, bit for bit; cos and sin get gradients when they require them.  ``pairing``
    "adjacent" rotates channel pairs (2i, 2i+1).  CPU only: CUDA tensors raise
    NotImplementedError.
    """
    dim = check_unsqueeze_dim(unsqueeze_dim)
    form = _form(norm)
    code = pairing_code(pairing)
    eps = check_real("eps", eps)

    if q_weight is None:
        q_weight = _weightless(q, "q_weight", form)
    if k_weight is None:
        k_weight = _weightless(k, "k_weight", form)
    if _is_compiling():
        _check_call(q, k, cos, sin, q_weight, k_weight, dim)
    try:
        out = ops.qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, form, code, SUM_LANES,
                               dim == 1)
    except Exception as err:
        raise explain(err, _check_call, q, k, cos, sin, q_weight, k_weight, dim) from None
    return out[0], out[1]


__all__ = ["apply_qk_norm_rope", "torch_sum_lanes", "SUM_LANES"]
