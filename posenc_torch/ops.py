"""Fake (meta) kernels and autograd formulas for the ops in ``torch.ops.posenc``, and the
eager entry points ``rope`` / ``rope_fused`` / ``rope_tables`` that the public functions use.

The schemas and kernels (CPU; CUDA when built in) are registered in C++
(csrc/torch/module.cpp); importing ``posenc_torch._C`` loads them.  This module must be
imported after it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.autograd.forward_ad as _forward_ad

from . import _C  # noqa: F401
from ._checks import check_same_device


# ---------------------------------------------------------------------------------------
# Fake kernels: shapes, dtypes and strides exactly as the C++ kernels produce them.  They
# also serve meta tensors, where the devices are all they check (sizes are the shim's).


def _non_overlapping_and_dense(x: torch.Tensor) -> bool:
    """Some permutation of x's dims of size >= 2 is contiguous (csrc/torch/stable_support.h,
    non_overlapping_and_dense)."""
    want = 1
    for stride, size in sorted((st, sz) for sz, st in zip(x.shape, x.stride()) if sz >= 2):
        if stride != want:
            return False
        want *= size
    return True


def _output_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output layout of the rotation ops (stable_support.h, output_like): x's own
    strides when x is non-overlapping and dense with a unit channel stride (strides of
    size-1 dims included: fake empty_like would normalize those), else empty_like's layout
    when that has a unit channel stride, else contiguous."""
    if _non_overlapping_and_dense(x):
        if x.shape[-1] <= 1 or x.stride(-1) == 1:
            return x.new_empty_strided(x.shape, x.stride(), dtype=dtype)
    else:
        out = torch.empty_like(x, dtype=dtype)
        if out.shape[-1] <= 1 or out.stride(-1) == 1:
            return out
    return x.new_empty(x.shape, dtype=dtype)


@torch.library.register_fake("posenc::rope")
def _rope_fake(q, k, cos, sin, mrope_section, interleaved, pairing, transpose,
               q_dtype=None, k_dtype=None, heads_first=False):
    check_same_device(q=q, k=k, cos=cos, sin=sin)
    qd = q_dtype if q_dtype is not None else torch.result_type(q, cos)
    kd = k_dtype if k_dtype is not None else torch.result_type(k, cos)
    if transpose:  # the backward pass writes contiguous gradients (stable_support.h)
        return q.new_empty(q.shape, dtype=qd), k.new_empty(k.shape, dtype=kd)
    return _output_like(q, qd), _output_like(k, kd)


@torch.library.register_fake("posenc::rope_table_grad")
def _rope_table_grad_fake(grad_q, grad_k, q, k, cos, mrope_section, interleaved, pairing):
    check_same_device(grad_q=grad_q, grad_k=grad_k, q=q, k=k, cos=cos)
    return (cos.new_empty(cos.shape).contiguous(), cos.new_empty(cos.shape).contiguous())


@torch.library.register_fake("posenc::rope_fused")
def _rope_fused_fake(q, k, position_ids, inv_freq, mrope_section, interleaved,
                     attention_scaling, pairing, transpose, heads_first=False):
    check_same_device(q=q, k=k, position_ids=position_ids, inv_freq=inv_freq)
    if transpose:  # the backward pass writes contiguous gradients (stable_support.h)
        return q.new_empty(q.shape), k.new_empty(k.shape)
    return _output_like(q, q.dtype), _output_like(k, k.dtype)


@torch.library.register_fake("posenc::rope_tables")
def _rope_tables_fake(position_ids, inv_freq, mrope_section, interleaved, attention_scaling,
                      pairing, dtype):
    check_same_device(position_ids=position_ids, inv_freq=inv_freq)
    shape = (position_ids.shape[-2], position_ids.shape[-1], 2 * inv_freq.shape[0])
    return (position_ids.new_empty(shape, dtype=dtype), position_ids.new_empty(shape, dtype=dtype))


@torch.library.register_fake("posenc::qk_norm_rope")
def _qk_norm_rope_fake(q, k, cos, sin, q_weight, k_weight, eps, form, pairing, sum_lanes,
                       heads_first):
    check_same_device(q=q, k=k, cos=cos, sin=sin, q_weight=q_weight, k_weight=k_weight)
    rd = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (_output_like(q, q.dtype), _output_like(k, k.dtype),
            q.new_empty(q.shape[:-1], dtype=rd), k.new_empty(k.shape[:-1], dtype=rd))


@torch.library.register_fake("posenc::qk_norm_rope_backward")
def _qk_norm_rope_backward_fake(grad_q, grad_k, q, k, cos, sin, q_weight, k_weight, q_rstd,
                                k_rstd, eps, form, pairing, sum_lanes, heads_first, q_pow=None,
                                k_pow=None):
    check_same_device(grad_q=grad_q, grad_k=grad_k, q=q, k=k, cos=cos, sin=sin)
    return (q.new_empty(q.shape), k.new_empty(k.shape), q_weight.new_empty(q_weight.shape),
            k_weight.new_empty(k_weight.shape))


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
    q, k, cos, sin, mrope_section, interleaved, pairing, transpose, _, _, heads_first = inputs
    ctx.args = (list(mrope_section), interleaved, pairing, transpose, heads_first)
    ctx.dtypes = (q.dtype, k.dtype)
    ctx.table_grad = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, *((q, k) if ctx.table_grad else ()))
    ctx.set_materialize_grads(False)
    ctx.out_meta = _meta(output)


def _rope_backward(ctx, grad_q, grad_k):
    sections, interleaved, pairing, transpose, heads_first = ctx.args
    cos, sin, *saved = ctx.saved_tensors
    if grad_q is None and grad_k is None:
        return (None,) * 11
    grad_q = _grad_or_zeros(grad_q, ctx.out_meta[0])
    grad_k = _grad_or_zeros(grad_k, ctx.out_meta[1])
    dq, dk = rope(grad_q, grad_k, cos, sin, sections, interleaved, pairing, not transpose,
                  ctx.dtypes[0], ctx.dtypes[1], heads_first)
    # dq, dk come contiguous (the op's transpose pass writes them so), as autograd of
    # transformers' expression returns them whatever the layout of the incoming gradient:
    # what consumes them (e.g. a per-head norm's weight gradient) then sums in the same
    # order, and a training step is bit-identical.
    dcos = dsin = None
    if ctx.table_grad:
        q, k = saved
        if heads_first:  # rope_table_grad takes (batch, seq, heads, head_dim) views
            q, k, grad_q, grad_k = (x.transpose(1, 2) for x in (q, k, grad_q, grad_k))
        if transpose:  # adjoint rotation: the table gradients swap input and gradient
            dcos, dsin = rope_table_grad(q, k, grad_q, grad_k, cos, sections, interleaved,
                                         pairing)
        else:
            dcos, dsin = rope_table_grad(grad_q, grad_k, q, k, cos, sections, interleaved,
                                         pairing)
        dcos = dcos if cos.requires_grad else None
        dsin = dsin if sin.requires_grad else None
    return dq, dk, dcos, dsin, None, None, None, None, None, None, None


torch.library.register_autograd("posenc::rope", _rope_backward, setup_context=_rope_setup_context)


# rope_table_grad(a_q, a_k, b_q, b_k, cos) is bilinear in (a, b): over the rotary channels
# of every head (and every batch row when the tables have batch 1),
#     dcos = sum a * b,    dsin = sum a * rot(b),
# rot(b) being the partner term of the forward rotation (out = cos * b + sin * rot(b)).
# With incoming table gradients (Gc, Gs) its derivatives are therefore rotations again:
#     d/da = Gc * b + Gs * rot(b)          the forward rotation of b with tables (Gc, Gs)
#     d/db = Gc * a + rot^T(Gs * a)        the transpose rotation of a with the same tables
# and zero in the channels past the rotary width (the tables do not reach them).


def _rope_table_grad_setup_context(ctx, inputs, output):
    grad_q, grad_k, q, k, cos, mrope_section, interleaved, pairing = inputs
    ctx.args = (list(mrope_section), interleaved, pairing)
    ctx.dtypes = (grad_q.dtype, grad_k.dtype, q.dtype, k.dtype)
    ctx.save_for_backward(grad_q, grad_k, q, k)


def _rotary_part(x: torch.Tensor, rot_dim: int) -> torch.Tensor:
    return x if x.shape[-1] == rot_dim else x.narrow(-1, 0, rot_dim)


def _pad_channels(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    pad = head_dim - x.shape[-1]
    return x if pad == 0 else torch.nn.functional.pad(x, (0, pad))


def _rope_table_grad_backward(ctx, g_cos, g_sin):
    sections, interleaved, pairing = ctx.args
    grad_q, grad_k, q, k = ctx.saved_tensors
    need = ctx.needs_input_grad
    rot_dim, head_dim = g_cos.shape[-1], q.shape[-1]
    d_grad_q = d_grad_k = d_q = d_k = None
    if need[0] or need[1]:
        d_grad_q, d_grad_k = rope(
            _rotary_part(q, rot_dim), _rotary_part(k, rot_dim), g_cos, g_sin, sections,
            interleaved, pairing, False, ctx.dtypes[0], ctx.dtypes[1])
        d_grad_q, d_grad_k = _pad_channels(d_grad_q, head_dim), _pad_channels(d_grad_k, head_dim)
    if need[2] or need[3]:
        d_q, d_k = rope(
            _rotary_part(grad_q, rot_dim), _rotary_part(grad_k, rot_dim), g_cos, g_sin,
            sections, interleaved, pairing, True, ctx.dtypes[2], ctx.dtypes[3])
        d_q, d_k = _pad_channels(d_q, head_dim), _pad_channels(d_k, head_dim)
    return d_grad_q, d_grad_k, d_q, d_k, None, None, None, None


torch.library.register_autograd("posenc::rope_table_grad", _rope_table_grad_backward,
                                setup_context=_rope_table_grad_setup_context)


def _rope_fused_setup_context(ctx, inputs, output):
    (_, _, position_ids, inv_freq, mrope_section, interleaved, scaling, pairing, transpose,
     heads_first) = inputs
    ctx.args = (list(mrope_section), interleaved, scaling, pairing, transpose, heads_first)
    ctx.save_for_backward(position_ids, inv_freq)
    ctx.set_materialize_grads(False)
    ctx.out_meta = _meta(output)


def _rope_fused_backward(ctx, grad_q, grad_k):
    sections, interleaved, scaling, pairing, transpose, heads_first = ctx.args
    position_ids, inv_freq = ctx.saved_tensors
    if grad_q is None and grad_k is None:
        return (None,) * 10
    grad_q = _grad_or_zeros(grad_q, ctx.out_meta[0])
    grad_k = _grad_or_zeros(grad_k, ctx.out_meta[1])
    dq, dk = rope_fused(grad_q, grad_k, position_ids, inv_freq, sections, interleaved, scaling,
                        pairing, not transpose, heads_first)
    return dq, dk, None, None, None, None, None, None, None, None


torch.library.register_autograd("posenc::rope_fused", _rope_fused_backward,
                                setup_context=_rope_fused_setup_context)


# ---------------------------------------------------------------------------------------
# Fused per-head q/k RMSNorm + RoPE (posenc::qk_norm_rope).  The forward saves q, k and one
# scale per row (rstd).  The backward op returns the gradients of q, k and both weights: the
# weights' gradients are the sums autograd computes over its per-element product in
# transformers' chain (contiguous in q's shape: the gradient of a rotation comes back
# contiguous), which the kernel adds up in the order torch's sum over that layout takes on
# this many threads (posenc.h), without writing the product (fp64: written, and summed by
# torch), so they are autograd's bits in eager mode and under torch.compile alike (Inductor
# never re-generates that sum).  Gradients of cos/sin, and a backward that is itself
# differentiable (create_graph), come from the same chain in torch ops.

#: norm= of apply_qk_norm_rope -> the op's form (posenc.h, pe_norm_form)
QK_NORM_FORMS = {"weight": 0, "one_plus_weight": 1, "weight_f32": 2, "pow": 3}
_POW = QK_NORM_FORMS["pow"]


def _qk_norm(x: torch.Tensor, w: torch.Tensor, eps: float, form: int) -> torch.Tensor:
    """transformers' per-head RMSNorm of each form in torch ops (fp64 stays fp64)."""
    x32 = x if x.dtype == torch.float64 else x.float()
    ms = x32.pow(2).mean(-1, keepdim=True) + eps
    if form == _POW:
        return (x32 * torch.pow(ms, -0.5) * w.to(x32.dtype)).to(x.dtype)
    n = x32 * torch.rsqrt(ms)
    if form == 0:
        return w * n.to(x.dtype)
    if form == 1:
        return (n * (1.0 + w.to(x32.dtype))).to(x.dtype)
    return (w.to(x32.dtype) * n).to(x.dtype)


@torch.library.custom_op("posenc::eager_pow", mutates_args=())
def eager_pow(x: torch.Tensor, exponent: float) -> torch.Tensor:
    """``torch.pow(x, exponent)`` by torch's eager kernel, as one op that torch.compile
    calls rather than generates: the backward of the pow form needs pow's bits as autograd's
    ``pow_backward`` gets them (torch's CPU kernel rounds its vector path and its scalar
    tail differently), the same in eager mode and in a compiled graph."""
    return torch.pow(x, exponent)


@eager_pow.register_fake
def _eager_pow_fake(x, exponent):
    return torch.empty_like(x)


@eager_pow.register_vmap
def _eager_pow_vmap(info, in_dims, x, exponent):
    return eager_pow(x, exponent), in_dims[0]


def _rotate(x: torch.Tensor, pairing: int) -> torch.Tensor:
    """The partner term of the rotation: rotate_half (half) or its adjacent-pair form."""
    if pairing == 0:
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rotary(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: int,
            heads_first: bool) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb of one tensor (partial rotary included)."""
    c, s = cos.unsqueeze(1 if heads_first else 2), sin.unsqueeze(1 if heads_first else 2)
    r = cos.shape[-1]
    if r == y.shape[-1]:
        return y * c + _rotate(y, pairing) * s
    y_rot, y_pass = y[..., :r], y[..., r:]
    return torch.cat((y_rot * c + _rotate(y_rot, pairing) * s, y_pass), dim=-1)


def _qk_chain(q, k, cos, sin, q_weight, k_weight, eps, form, pairing, heads_first):
    """The op's result in torch ops: the norm, then transformers' rotary (fp32, fp64) or
    posenc's (16-bit, as the op's 16-bit contract reads)."""
    yq, yk = _qk_norm(q, q_weight, eps, form), _qk_norm(k, k_weight, eps, form)
    if q.dtype in (torch.float32, torch.float64):
        return (_rotary(yq, cos, sin, pairing, heads_first),
                _rotary(yk, cos, sin, pairing, heads_first))
    return rope(yq, yk, cos, sin, [], False, pairing, False, None, None, heads_first)


def _qk_norm_rope_setup_context(ctx, inputs, output):
    q, k, cos, sin, q_weight, k_weight, eps, form, pairing, sum_lanes, heads_first = inputs
    ctx.args = (eps, form, pairing, sum_lanes, heads_first)
    ctx.save_for_backward(q, k, cos, sin, q_weight, k_weight, output[2], output[3])
    ctx.set_materialize_grads(False)
    ctx.out_meta = _meta(output[:2])


def _qk_norm_rope_backward(ctx, grad_q, grad_k, _grad_q_rstd=None, _grad_k_rstd=None):
    eps, form, pairing, sum_lanes, heads_first = ctx.args
    q, k, cos, sin, q_weight, k_weight, q_rstd, k_rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    none = (None,) * 5
    if grad_q is None and grad_k is None:
        return (None,) * 6 + none
    grad_q = _grad_or_zeros(grad_q, ctx.out_meta[0])
    grad_k = _grad_or_zeros(grad_k, ctx.out_meta[1])
    inputs = (q, k, cos, sin, q_weight, k_weight)
    if torch.is_grad_enabled():  # create_graph: a backward autograd can differentiate
        with torch.enable_grad():  # the saved tensors are the graph's own inputs
            outs = _qk_chain(*inputs, eps, form, pairing, heads_first)
            wanted = [x for x, n in zip(inputs, need[:6]) if n]
            got = iter(torch.autograd.grad(outs, wanted, (grad_q, grad_k), create_graph=True,
                                           allow_unused=True))
        return tuple(next(got) if n else None for n in need[:6]) + none
    # pow: the rows' ms^-1.5 as autograd's pow_backward computes it (torch's pow on a
    # contiguous tensor of the rows, the layout of the norm's mean, so the same kernel paths)
    pows = (eager_pow(q_rstd, -1.5), eager_pow(k_rstd, -1.5)) if form == _POW else (None, None)
    dq, dk, dq_weight, dk_weight = qk_norm_rope_backward(
        grad_q, grad_k, q, k, cos, sin, q_weight, k_weight, q_rstd, k_rstd, eps, form,
        pairing, sum_lanes, heads_first, *pows)
    dcos = dsin = None
    if need[2] or need[3]:  # the rotation's own autograd, over the recomputed norm
        with torch.enable_grad():
            c, s = cos.detach().requires_grad_(), sin.detach().requires_grad_()
            yq, yk = _qk_norm(q, q_weight, eps, form), _qk_norm(k, k_weight, eps, form)
            if q.dtype in (torch.float32, torch.float64):
                outs = (_rotary(yq, c, s, pairing, heads_first),
                        _rotary(yk, c, s, pairing, heads_first))
            else:
                outs = rope(yq, yk, c, s, [], False, pairing, False, None, None, heads_first)
            dcos, dsin = torch.autograd.grad(outs, (c, s), (grad_q, grad_k))
        dcos = dcos if need[2] else None
        dsin = dsin if need[3] else None
    return (dq if need[0] else None, dk if need[1] else None, dcos, dsin,
            dq_weight if need[4] else None, dk_weight if need[5] else None) + none


torch.library.register_autograd("posenc::qk_norm_rope", _qk_norm_rope_backward,
                                setup_context=_qk_norm_rope_setup_context)



# ---------------------------------------------------------------------------------------
# Position ids (integer outputs, not differentiable).


def _present(**tensors: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if t is not None}


@torch.library.register_fake("posenc::mrope_position_ids")
def _mrope_position_ids_fake(input_ids, image_grid_thw, video_grid_thw, attention_mask,
                             second_per_grid_ts, model, image_token_id, video_token_id,
                             vision_start_token_id, spatial_merge_size, tokens_per_second,
                             mm_token_type_ids=None, rules=0, time_rule=0):
    check_same_device(**_present(
        input_ids=input_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
        attention_mask=attention_mask, second_per_grid_ts=second_per_grid_ts,
        mm_token_type_ids=mm_token_type_ids))
    batch, seq = input_ids.shape
    return (input_ids.new_empty((3, batch, seq), dtype=torch.int64),
            input_ids.new_empty((batch, 1), dtype=torch.int64))


@torch.library.register_fake("posenc::mrope_packed_position_ids")
def _mrope_packed_position_ids_fake(input_ids, example_lens, row_examples, image_grid_thw,
                                    video_grid_thw, second_per_grid_ts, model, image_token_id,
                                    video_token_id, vision_start_token_id, spatial_merge_size,
                                    tokens_per_second, mm_token_type_ids, rules, time_rule,
                                    example_ids=None, example_grids=None):
    check_same_device(**_present(
        input_ids=input_ids, example_lens=example_lens, row_examples=row_examples,
        image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
        second_per_grid_ts=second_per_grid_ts, mm_token_type_ids=mm_token_type_ids,
        example_ids=example_ids, example_grids=example_grids))
    batch, seq = input_ids.shape
    return input_ids.new_empty((4, batch, seq), dtype=torch.int64)


# The vision ops' output sizes (patches sum(t * h * w), frames sum(t), merged tokens,
# windows) depend on the values of the grids: each is a new dynamic size.


@torch.library.register_fake("posenc::vision_position_ids")
def _vision_position_ids_fake(grid_thw, spatial_merge_size, merge_sizes=None,
                              include_temporal=False):
    check_same_device(**_present(grid_thw=grid_thw, merge_sizes=merge_sizes))
    n = torch.library.get_ctx().new_dynamic_size()
    return grid_thw.new_empty((n, 3 if include_temporal else 2), dtype=torch.int64)


@torch.library.register_fake("posenc::vision_cu_seqlens")
def _vision_cu_seqlens_fake(grid_thw, merge_temporal=False):
    check_same_device(grid_thw=grid_thw)
    # one segment per grid (a static size), or one per frame
    n = grid_thw.shape[0] + 1 if merge_temporal else torch.library.get_ctx().new_dynamic_size(
        min=1)
    return (grid_thw.new_empty((n,), dtype=torch.int32),
            grid_thw.new_empty((), dtype=torch.int64))


@torch.library.register_fake("posenc::vision_window_index")
def _vision_window_index_fake(grid_thw, spatial_merge_size, window_size, patch_size):
    check_same_device(grid_thw=grid_thw)
    ctx = torch.library.get_ctx()
    tokens, boundaries = ctx.new_dynamic_size(), ctx.new_dynamic_size(min=1)
    return (grid_thw.new_empty((tokens,), dtype=torch.int64),
            grid_thw.new_empty((boundaries,), dtype=torch.int32))


@torch.library.register_fake("posenc::vision_interpolation")
def _vision_interpolation_fake(grid_thw, num_grid_per_side, mode=0, align_corners=False,
                               spatial_merge_size=1, padding=0, rule=0):
    check_same_device(grid_thw=grid_thw)
    n, taps = torch.library.get_ctx().new_dynamic_size(), 4 if mode == 0 else 16
    return (grid_thw.new_empty((n, taps), dtype=torch.int64),
            grid_thw.new_empty((n, taps), dtype=torch.float32))


@torch.library.register_fake("posenc::vision_nearest_position_ids")
def _vision_nearest_position_ids_fake(target_sizes, num_patches_per_side):
    check_same_device(target_sizes=target_sizes)
    n = torch.library.get_ctx().new_dynamic_size()
    return target_sizes.new_empty((n,), dtype=torch.int64)


# ---------------------------------------------------------------------------------------
# vmap: the rotations fold the vmapped dim into the batch dim and run once; the other ops
# (a per-sample frequency vector, the table gradients, the tables) run once per sample.


def _fold(x: torch.Tensor, bdim: int | None, n: int) -> torch.Tensor:
    """x with its vmapped dim (or n copies when it has none) folded into dim 0."""
    x = x.expand(n, *x.shape) if bdim is None else x.movedim(bdim, 0)
    return x.flatten(0, 1)


def _fold_batched(t: torch.Tensor, bdim: int | None, n: int, batch: int,
                  at: int) -> torch.Tensor:
    """Tables or position ids whose batch dim (1 or ``batch`` rows) is dim ``at`` (1 when
    they lead with the 3 MRoPE axes): n * batch rows there, or as they are when unbatched
    with one row (it broadcasts)."""
    if bdim is None and t.shape[at] == 1:
        return t
    t = (t.expand(n, *t.shape) if bdim is None else t.movedim(bdim, 0)).movedim(0, at)
    shape = list(t.shape)
    shape[at + 1] = batch
    return t.expand(shape).flatten(at, at + 1)


def _unfold(outputs: tuple[torch.Tensor, ...], n: int) -> tuple[tuple, tuple]:
    return tuple(o.unflatten(0, (n, -1)) for o in outputs), (0,) * len(outputs)


def _per_sample_vmap(call: Callable) -> Callable:
    def rule(info, in_dims, *args):
        outs = [call(*(a.select(d, i) if isinstance(a, torch.Tensor) and d is not None else a
                       for a, d in zip(args, in_dims)))
                for i in range(info.batch_size)]
        return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])
    return rule


def _rope_vmap(call: Callable) -> Callable:
    def rule(info, in_dims, q, k, cos, sin, mrope_section, *rest):
        n = info.batch_size
        q, k = _fold(q, in_dims[0], n), _fold(k, in_dims[1], n)
        batch, at = q.shape[0] // n, 1 if len(mrope_section) else 0
        cos = _fold_batched(cos, in_dims[2], n, batch, at)
        sin = _fold_batched(sin, in_dims[3], n, batch, at)
        return _unfold(call(q, k, cos, sin, mrope_section, *rest), n)
    return rule


def _rope_fused_vmap(call: Callable) -> Callable:
    def rule(info, in_dims, q, k, position_ids, inv_freq, *rest):
        if in_dims[3] is not None:  # one frequency vector per sample
            return _per_sample_vmap(call)(info, in_dims, q, k, position_ids, inv_freq, *rest)
        n = info.batch_size
        q, k = _fold(q, in_dims[0], n), _fold(k, in_dims[1], n)
        at = 1 if position_ids.dim() - (in_dims[2] is not None) == 3 else 0
        position_ids = _fold_batched(position_ids, in_dims[2], n, q.shape[0] // n, at)
        return _unfold(call(q, k, position_ids, inv_freq, *rest), n)
    return rule


def _qk_norm_rope_vmap(call: Callable) -> Callable:
    def rule(info, in_dims, q, k, cos, sin, q_weight, k_weight, *rest):
        if in_dims[4] is not None or in_dims[5] is not None:  # weights per sample
            return _per_sample_vmap(call)(info, in_dims, q, k, cos, sin, q_weight, k_weight,
                                          *rest)
        n = info.batch_size
        q, k = _fold(q, in_dims[0], n), _fold(k, in_dims[1], n)
        batch = q.shape[0] // n
        cos = _fold_batched(cos, in_dims[2], n, batch, 0)
        sin = _fold_batched(sin, in_dims[3], n, batch, 0)
        return _unfold(call(q, k, cos, sin, q_weight, k_weight, *rest), n)
    return rule



# Raw op calls under vmap; the autograd.Functions below get the same rules.
torch.library.register_vmap("posenc::rope", _rope_vmap(torch.ops.posenc.rope))
torch.library.register_vmap("posenc::rope_fused", _rope_fused_vmap(torch.ops.posenc.rope_fused))
torch.library.register_vmap("posenc::rope_table_grad",
                            _per_sample_vmap(torch.ops.posenc.rope_table_grad))
torch.library.register_vmap("posenc::rope_tables", _per_sample_vmap(torch.ops.posenc.rope_tables))
torch.library.register_vmap("posenc::qk_norm_rope",
                            _qk_norm_rope_vmap(torch.ops.posenc.qk_norm_rope))
torch.library.register_vmap("posenc::qk_norm_rope_backward",
                            _per_sample_vmap(torch.ops.posenc.qk_norm_rope_backward))


# ---------------------------------------------------------------------------------------
# Eager entry points.  Calling an op through the dispatcher runs torch.library's Python
# autograd kernel on every call, even when nothing records a gradient, which costs more
# than a decode-size rotation itself.  So in eager mode these functions call the op below
# the autograd layer when no input can record a gradient, and otherwise apply an
# autograd.Function built from the same setup_context/backward as the registered formula
# (the legacy-style one in plain eager autograd, the setup_context one under functorch
# transforms: unlike torch.library's formula, it also serves torch.func.grad / vjp / vmap).
# Under torch.compile / export tracing they call the registered op, so graphs keep one
# ``posenc::*`` node with its registered autograd.  Forward mode (forward AD,
# torch.func.jvp) raises: there is no jvp.
#
# That fast path uses private torch names, looked up once, at import (PRIVATE).  Where one
# is missing (another torch release) every call takes the plain path instead: the
# setup_context autograd.Function, whose forward calls the op through the dispatcher;
# slower, the same results and gradients.

_ROPE = torch.ops.posenc.rope.default
_ROPE_TABLE_GRAD = torch.ops.posenc.rope_table_grad.default
_ROPE_FUSED = torch.ops.posenc.rope_fused.default
_ROPE_TABLES = torch.ops.posenc.rope_tables.default
_QK_NORM_ROPE = torch.ops.posenc.qk_norm_rope.default
_QK_NORM_ROPE_BACKWARD = torch.ops.posenc.qk_norm_rope_backward.default
_is_compiling, _is_grad_enabled = torch.compiler.is_compiling, torch.is_grad_enabled


class _Private(NamedTuple):
    below_autograd: type  # torch._C._AutoDispatchBelowAutograd
    transforms_active: Callable[[], bool]  # torch._C._are_functorch_transforms_active
    interpreters: Callable[[], list]  # torch._functorch's retrieve_all_functorch_interpreters
    jvp: object  # torch._C._functorch.TransformType.Jvp
    forward_ad: types.ModuleType  # its _current_level (>= 0 inside forward AD) is read per call


def _lookup_private() -> _Private | None:
    try:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        found = _Private(torch._C._AutoDispatchBelowAutograd,
                         torch._C._are_functorch_transforms_active,
                         retrieve_all_functorch_interpreters,
                         torch._C._functorch.TransformType.Jvp, _forward_ad)
        if not isinstance(_forward_ad._current_level, int):
            return None
    except (ImportError, AttributeError):
        return None
    return found


#: The private torch names the fast path uses, or None (then every call takes the plain path).
PRIVATE = _lookup_private()
_fast: _Private | None = PRIVATE  # what the entry points use: PRIVATE, or None (plain path)


def _choose_path(private: _Private | None) -> None:
    """The entry points take the fast path with ``private``'s names, or the plain path when
    it is None (the tests run the plain path on a torch that has the names)."""
    global _fast
    _fast = private


def _below_autograd() -> contextlib.AbstractContextManager:
    """Below the autograd layer on the fast path; on the plain path the op runs through the
    dispatcher (in no-grad mode inside an autograd.Function's forward)."""
    return contextlib.nullcontext() if _fast is None else _fast.below_autograd()


def _reject_forward_mode(op: str, fast: _Private, tensors: tuple[torch.Tensor, ...]) -> None:
    """The ops have reverse-mode formulas only; a forward-mode tangent would be dropped
    without a word (torch.library has no jvp hook), so forward mode is an error."""
    dual = fast.forward_ad._current_level >= 0 and any(
        fast.forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    jvp = fast.transforms_active() and any(i.key() == fast.jvp for i in fast.interpreters())
    if dual or jvp:
        raise NotImplementedError(
            f"posenc::{op} has no forward-mode derivative (forward AD / torch.func.jvp); "
            "use reverse mode (backward, torch.func.grad / vjp)")


def _functions(name: str, op, setup_context, backward, vmap) -> tuple[type, type]:
    """Two autograd.Functions with the same formula: ``setup_context`` style, which functorch
    transforms (torch.func.grad / vjp / vmap) need and the plain path uses for every call,
    and the legacy ``forward(ctx, ...)`` style for plain eager autograd on the fast path,
    whose ``apply`` skips the per-call signature binding of the other (that binding costs
    several times a decode-size rotation)."""

    def forward(*args):
        with _below_autograd():
            return op(*args)

    def forward_ctx(ctx, *args):
        with _below_autograd():
            out = op(*args)
        setup_context(ctx, args, out)
        return out

    base = (torch.autograd.Function,)
    for_transforms = type(f"_{name}Function", base, {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "vmap": staticmethod(vmap)})
    eager = type(f"_{name}EagerFunction", base, {
        "forward": staticmethod(forward_ctx), "backward": staticmethod(backward)})
    return for_transforms, eager


_RopeFunction, _RopeEagerFunction = _functions(
    "Rope", _ROPE, _rope_setup_context, _rope_backward, _rope_vmap(lambda *a: rope(*a)))
_RopeTableGradFunction, _RopeTableGradEagerFunction = _functions(
    "RopeTableGrad", _ROPE_TABLE_GRAD, _rope_table_grad_setup_context, _rope_table_grad_backward,
    _per_sample_vmap(lambda *a: rope_table_grad(*a)))
_RopeFusedFunction, _RopeFusedEagerFunction = _functions(
    "RopeFused", _ROPE_FUSED, _rope_fused_setup_context, _rope_fused_backward,
    _rope_fused_vmap(lambda *a: rope_fused(*a)))
_QkNormRopeFunction, _QkNormRopeEagerFunction = _functions(
    "QkNormRope", _QK_NORM_ROPE, _qk_norm_rope_setup_context, _qk_norm_rope_backward,
    _qk_norm_rope_vmap(lambda *a: qk_norm_rope(*a)))


def rope(q, k, cos, sin, mrope_section, interleaved, pairing, transpose=False, q_dtype=None,
         k_dtype=None, heads_first=False):
    """posenc::rope (q, k rotated by the tables cos, sin) -> (q_out, k_out), with autograd;
    the tensors are those of the op's schema (csrc/torch/module.cpp)."""
    args = (q, k, cos, sin, mrope_section, interleaved, pairing, transpose, q_dtype, k_dtype,
            heads_first)
    if _is_compiling():
        return torch.ops.posenc.rope(*args)
    fast = _fast
    if fast is None:
        return _RopeFunction.apply(*args)
    transforms = fast.transforms_active()
    if transforms or fast.forward_ad._current_level >= 0:
        _reject_forward_mode("rope", fast, (q, k, cos, sin))
    if transforms:
        return _RopeFunction.apply(*args)
    if _is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad
                               or sin.requires_grad):
        return _RopeEagerFunction.apply(*args)
    with fast.below_autograd():
        return _ROPE(*args)


def rope_table_grad(grad_q, grad_k, q, k, cos, mrope_section, interleaved, pairing):
    """posenc::rope_table_grad (the gradients of the tables) -> (dcos, dsin), with autograd."""
    args = (grad_q, grad_k, q, k, cos, mrope_section, interleaved, pairing)
    if _is_compiling():
        return torch.ops.posenc.rope_table_grad(*args)
    fast = _fast
    if fast is None or fast.transforms_active():
        return _RopeTableGradFunction.apply(*args)
    if _is_grad_enabled() and (grad_q.requires_grad or grad_k.requires_grad or q.requires_grad
                               or k.requires_grad):
        return _RopeTableGradEagerFunction.apply(*args)
    with fast.below_autograd():
        return _ROPE_TABLE_GRAD(*args)


def rope_fused(q, k, position_ids, inv_freq, mrope_section, interleaved, attention_scaling,
               pairing, transpose=False, heads_first=False):
    """posenc::rope_fused (q, k rotated by the angles of position_ids and inv_freq)
    -> (q_out, k_out), with autograd for q and k."""
    args = (q, k, position_ids, inv_freq, mrope_section, interleaved, attention_scaling,
            pairing, transpose, heads_first)
    if _is_compiling():
        return torch.ops.posenc.rope_fused(*args)
    fast = _fast
    if fast is None:
        return _RopeFusedFunction.apply(*args)
    transforms = fast.transforms_active()
    if transforms or fast.forward_ad._current_level >= 0:
        _reject_forward_mode("rope_fused", fast, (q, k))
    if transforms:
        return _RopeFusedFunction.apply(*args)
    if _is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RopeFusedEagerFunction.apply(*args)
    with fast.below_autograd():
        return _ROPE_FUSED(*args)


def rope_tables(position_ids, inv_freq, mrope_section, interleaved, attention_scaling,
                pairing, dtype):
    """posenc::rope_tables (the cos, sin tables of position_ids and inv_freq) -> (cos, sin);
    not differentiable."""
    args = (position_ids, inv_freq, mrope_section, interleaved, attention_scaling, pairing,
            dtype)
    fast = _fast
    if fast is None or _is_compiling() or fast.transforms_active():
        return torch.ops.posenc.rope_tables(*args)
    with fast.below_autograd():
        return _ROPE_TABLES(*args)


def qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, form, pairing, sum_lanes,
                 heads_first):
    """posenc::qk_norm_rope (q, k normed per head and rotated) -> (q_out, k_out, q_rstd,
    k_rstd), with autograd for q, k, cos, sin and both weights."""
    args = (q, k, cos, sin, q_weight, k_weight, eps, form, pairing, sum_lanes, heads_first)
    if _is_compiling():
        return torch.ops.posenc.qk_norm_rope(*args)
    fast = _fast
    if fast is None:
        return _QkNormRopeFunction.apply(*args)
    transforms = fast.transforms_active()
    if transforms or fast.forward_ad._current_level >= 0:
        _reject_forward_mode("qk_norm_rope", fast, (q, k, cos, sin, q_weight, k_weight))
    if transforms:
        return _QkNormRopeFunction.apply(*args)
    if _is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin, q_weight, k_weight)):
        return _QkNormRopeEagerFunction.apply(*args)
    with fast.below_autograd():
        return _QK_NORM_ROPE(*args)


def qk_norm_rope_backward(grad_q, grad_k, q, k, cos, sin, q_weight, k_weight, q_rstd, k_rstd,
                          eps, form, pairing, sum_lanes, heads_first, q_pow=None, k_pow=None):
    """posenc::qk_norm_rope_backward -> (dq, dk, dq_weight, dk_weight); not differentiable
    itself (a create_graph backward takes the torch-ops chain instead)."""
    args = (grad_q, grad_k, q, k, cos, sin, q_weight, k_weight, q_rstd, k_rstd, eps, form,
            pairing, sum_lanes, heads_first, q_pow, k_pow)
    fast = _fast
    if fast is None or _is_compiling() or fast.transforms_active():
        return torch.ops.posenc.qk_norm_rope_backward(*args)
    with fast.below_autograd():
        return _QK_NORM_ROPE_BACKWARD(*args)
