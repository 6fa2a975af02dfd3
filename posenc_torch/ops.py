"""Fake (meta) kernels and autograd formulas for the ops in ``torch.ops.posenc``.

The schemas and CPU kernels are registered in C++ (csrc/torch/ops.cpp); importing
``posenc_torch._C`` loads them.  This module must be imported after it.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401


# ---------------------------------------------------------------------------------------
# Fake kernels: shapes, dtypes and strides exactly as the C++ kernels produce them.


def _output_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output layout of the rotation ops (csrc/torch/ops.cpp, output_like): like x when
    that has a unit channel stride, else contiguous."""
    out = torch.empty_like(x, dtype=dtype)
    if out.shape[-1] > 1 and out.stride(-1) != 1:
        out = x.new_empty(x.shape, dtype=dtype)
    return out


@torch.library.register_fake("posenc::rope")
def _rope_fake(q, k, cos, sin, mrope_section, interleaved, pairing, transpose,
               q_dtype=None, k_dtype=None):
    qd = q_dtype if q_dtype is not None else torch.result_type(q, cos)
    kd = k_dtype if k_dtype is not None else torch.result_type(k, cos)
    return _output_like(q, qd), _output_like(k, kd)


@torch.library.register_fake("posenc::rope_table_grad")
def _rope_table_grad_fake(grad_q, grad_k, q, k, cos, mrope_section, interleaved, pairing):
    return (cos.new_empty(cos.shape).contiguous(), cos.new_empty(cos.shape).contiguous())


@torch.library.register_fake("posenc::rope_fused")
def _rope_fused_fake(q, k, position_ids, inv_freq, mrope_section, interleaved,
                     attention_scaling, pairing, transpose):
    return _output_like(q, q.dtype), _output_like(k, k.dtype)


@torch.library.register_fake("posenc::rope_tables")
def _rope_tables_fake(position_ids, inv_freq, mrope_section, interleaved, attention_scaling,
                      pairing, dtype):
    shape = (position_ids.shape[-2], position_ids.shape[-1], 2 * inv_freq.shape[0])
    return (position_ids.new_empty(shape, dtype=dtype), position_ids.new_empty(shape, dtype=dtype))


@torch.library.register_fake("posenc::sinusoidal")
def _sinusoidal_fake(num_positions, dim, base, dtype):
    return torch.empty((num_positions, dim), dtype=dtype)


# ---------------------------------------------------------------------------------------
# Autograd.  The backward of a rotation is the transpose rotation (the same op with
# transpose flipped); table gradients are a separate reduction op.


def _meta(outputs) -> list[tuple]:
    return [(o.shape, o.dtype, o.device) for o in outputs]


def _grad_or_zeros(g: torch.Tensor | None, meta: tuple) -> torch.Tensor:
    """The gradient of an output that did not get one (e.g. only q was used) is zero."""
    if g is not None:
        return g
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


def _rope_setup_context(ctx, inputs, output):
    q, k, cos, sin, mrope_section, interleaved, pairing, transpose, _, _ = inputs
    ctx.args = (list(mrope_section), interleaved, pairing, transpose)
    ctx.dtypes = (q.dtype, k.dtype)
    ctx.table_grad = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, *((q, k) if ctx.table_grad else ()))
    ctx.set_materialize_grads(False)
    ctx.out_meta = _meta(output)


def _rope_backward(ctx, grad_q, grad_k):
    sections, interleaved, pairing, transpose = ctx.args
    cos, sin, *saved = ctx.saved_tensors
    if grad_q is None and grad_k is None:
        return (None,) * 10
    grad_q = _grad_or_zeros(grad_q, ctx.out_meta[0])
    grad_k = _grad_or_zeros(grad_k, ctx.out_meta[1])
    dq, dk = torch.ops.posenc.rope(grad_q, grad_k, cos, sin, sections, interleaved, pairing,
                                   not transpose, ctx.dtypes[0], ctx.dtypes[1])
    dcos = dsin = None
    if ctx.table_grad:
        q, k = saved
        if transpose:  # adjoint rotation: the table gradients swap input and gradient
            dcos, dsin = torch.ops.posenc.rope_table_grad(q, k, grad_q, grad_k, cos, sections,
                                                         interleaved, pairing)
        else:
            dcos, dsin = torch.ops.posenc.rope_table_grad(grad_q, grad_k, q, k, cos, sections,
                                                         interleaved, pairing)
        dcos = dcos if cos.requires_grad else None
        dsin = dsin if sin.requires_grad else None
    return dq, dk, dcos, dsin, None, None, None, None, None, None


torch.library.register_autograd("posenc::rope", _rope_backward, setup_context=_rope_setup_context)


def _rope_fused_setup_context(ctx, inputs, output):
    _, _, position_ids, inv_freq, mrope_section, interleaved, scaling, pairing, transpose = inputs
    ctx.args = (list(mrope_section), interleaved, scaling, pairing, transpose)
    ctx.save_for_backward(position_ids, inv_freq)
    ctx.set_materialize_grads(False)
    ctx.out_meta = _meta(output)


def _rope_fused_backward(ctx, grad_q, grad_k):
    sections, interleaved, scaling, pairing, transpose = ctx.args
    position_ids, inv_freq = ctx.saved_tensors
    if grad_q is None and grad_k is None:
        return (None,) * 9
    grad_q = _grad_or_zeros(grad_q, ctx.out_meta[0])
    grad_k = _grad_or_zeros(grad_k, ctx.out_meta[1])
    dq, dk = torch.ops.posenc.rope_fused(grad_q, grad_k, position_ids, inv_freq, sections,
                                         interleaved, scaling, pairing, not transpose)
    return dq, dk, None, None, None, None, None, None, None


torch.library.register_autograd("posenc::rope_fused", _rope_fused_backward,
                                setup_context=_rope_fused_setup_context)


# ---------------------------------------------------------------------------------------
# Position ids (integer outputs, not differentiable).


@torch.library.register_fake("posenc::mrope_position_ids")
def _mrope_position_ids_fake(input_ids, image_grid_thw, video_grid_thw, attention_mask,
                             second_per_grid_ts, model, image_token_id, video_token_id,
                             vision_start_token_id, spatial_merge_size, tokens_per_second,
                             mm_token_type_ids=None, rules=0, time_rule=0):
    batch, seq = input_ids.shape
    return (input_ids.new_empty((3, batch, seq), dtype=torch.int64),
            input_ids.new_empty((batch, 1), dtype=torch.int64))


@torch.library.register_fake("posenc::vision_position_ids")
def _vision_position_ids_fake(grid_thw, spatial_merge_size):
    # The patch count sum(t * h * w) depends on the values of grid_thw.
    n = torch.library.get_ctx().new_dynamic_size()
    return grid_thw.new_empty((n, 2), dtype=torch.int64)
