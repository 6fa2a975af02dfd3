"""The error policy (README, "Errors"), function by function and class by class.

TypeError for a wrong type or dtype, ValueError for a wrong shape, size, section or value,
RuntimeError only for failures of allocation, threads or a device (NotImplementedError, a
RuntimeError, for a device without posenc kernels).  Each message names the argument.
The bad-input errors of the core are ``InputTypeError`` / ``InputValueError`` (both
``InputError``), on every torch (`make compat`, `compat-min` and `compat-newest` run this
file under torch 2.14.1, 2.11.0 and the newest release).  Raw ``torch.ops.posenc`` calls
state the class in their message, "TypeError: " or "ValueError: ", and raise the type
torch chooses (ValueError up to torch 2.14, RuntimeError from 2.15 on: tests/op_errors.py).

Also here: the checks run only when a call fails, for every device; the plain path taken
when torch lacks a private name; the fake kernels' strides; vmap.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import posenc_torch as P
from op_errors import raw_raises
from posenc_torch import _checks, ops, packing, positions, rope, vision
from posenc_torch._checks import InputError, InputTypeError, InputValueError

# ----------------------------------------------------------------------- valid arguments


def _qk(b=2, hq=4, hk=2, t=5, d=16):
    return torch.randn(b, hq, t, d), torch.randn(b, hk, t, d)


def _tables(b=2, t=5, r=16):
    return torch.randn(b, t, r), torch.randn(b, t, r)


def _mrope_tables(b=2, t=5, d=16):
    return torch.randn(3, b, t, d), torch.randn(3, b, t, d)


POS = torch.arange(5).repeat(2, 1)          # (2, 5)
POS3 = torch.arange(5).repeat(3, 2, 1)      # (3, 2, 5)
INV = torch.rand(8)                         # rotary width 16
IDS = torch.tensor([[1, 2, 3, 4]])
_GRID = torch.tensor([[1, 4, 4]])                # one image grid, merge size 2


def _rot(**kw):
    q, k = _qk()
    cos, sin = _tables()
    args = dict(q=q, k=k, cos=cos, sin=sin)
    args.update(kw)
    return P.apply_rotary_pos_emb(**args)


def _mrot(**kw):
    q, k = _qk()
    cos, sin = _mrope_tables()
    args = dict(q=q, k=k, cos=cos, sin=sin, mrope_section=[2, 3, 3])
    args.update(kw)
    return P.apply_multimodal_rotary_pos_emb(**args)


def _vision(**kw):
    args = dict(q=torch.randn(6, 2, 16), k=torch.randn(6, 2, 16), cos=torch.randn(6, 16),
                sin=torch.randn(6, 16))
    args.update(kw)
    return P.apply_rotary_pos_emb_vision(**args)


def _fused(**kw):
    q, k = _qk()
    args = dict(q=q, k=k, position_ids=POS, inv_freq=INV)
    args.update(kw)
    return P.apply_rope(**args)


def _qk_norm(**kw):
    q, k = _qk()
    cos, sin = _tables()
    args = dict(q=q, k=k, cos=cos, sin=sin, q_weight=torch.ones(16), k_weight=torch.ones(16),
                eps=1e-6)
    args.update(kw)
    return P.apply_qk_norm_rope(**args)


def _tables_fn(**kw):
    args = dict(position_ids=POS, inv_freq=INV)
    args.update(kw)
    return P.compute_mrope_cos_sin(**args)


def _positions(**kw):
    args = dict(input_ids=IDS, convention="5.17")
    args.update(kw)
    return P.compute_mrope_position_ids(**args)


def _decode(**kw):
    args = dict(mrope_position_deltas=torch.zeros(2, 1, dtype=torch.long), past_length=4)
    args.update(kw)
    return P.compute_mrope_decode_position_ids(**args)


def _packed(**kw):
    args = dict(input_ids=IDS, seq_lens=[[4]], model="qwen2_vl", convention="5.17")
    args.update(kw)
    return P.compute_packed_mrope_position_ids(**args)


# A Qwen2-VL config as packing reads it (no transformers needed), and examples for it.
CONFIG = types.SimpleNamespace(
    model_type="qwen2_vl", image_token_id=7, video_token_id=8, vision_start_token_id=6,
    pad_token_id=0, vision_config=types.SimpleNamespace(
        spatial_merge_size=2, in_channels=3, temporal_patch_size=2, patch_size=2))
TEXT_EXAMPLE = {"input_ids": torch.tensor([[1, 2, 3]])}
# an image of grid (1, 2, 4): 2 placeholder tokens after a vision start, 8 patches of 24
IMAGE_EXAMPLE = {"input_ids": torch.tensor([[1, 6, 7, 7, 9]]),
                 "image_grid_thw": torch.tensor([[1, 2, 4]]), "pixel_values": torch.ones(8, 24)}


def _pack(**kw):
    args = dict(examples=[TEXT_EXAMPLE, IMAGE_EXAMPLE], config=CONFIG, convention="4.57")
    args.update(kw)
    return packing.pack_multimodal_examples(**args)


def _collator(**kw):
    return packing.MultimodalPackingCollator(CONFIG, convention="4.57", **kw)


PACKED_POS = torch.tensor([0, 1, 2, 0, 1]).expand(4, 2, 5)


def _leaks(fn=packing.packed_attention_leaks, **kw):
    args = dict(position_ids=PACKED_POS)
    args.update(kw)
    return fn(**args)


def _patch(**kw):
    from posenc_torch import hf

    handle = hf.patch(**kw)
    handle.undo()


B16 = torch.randn(2, 5, 16)

# (id, call, exception, message fragment): every class of every public function.
CASES = [
    # apply_rotary_pos_emb
    ("rot/q-type", lambda: _rot(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    ("rot/q-dtype", lambda: _rot(q=torch.ones(2, 4, 5, 16, dtype=torch.long)), TypeError,
     "q must be float32"),
    ("rot/cos-dtype", lambda: _rot(cos=B16.int()), TypeError, "cos must be float32"),
    ("rot/sin-dtype", lambda: _rot(sin=B16.double()), TypeError, "sin dtype"),
    ("rot/unsqueeze-type", lambda: _rot(unsqueeze_dim=1.0), TypeError, "unsqueeze_dim"),
    ("rot/q-rank", lambda: _rot(q=torch.randn(4, 5, 16)), ValueError, "q must be 4-D"),
    ("rot/cos-rank", lambda: _rot(cos=B16[0]), ValueError, "cos must be 3-D"),
    ("rot/k-batch", lambda: _rot(k=torch.randn(1, 2, 5, 16)), ValueError, "k batch size"),
    ("rot/k-head-dim", lambda: _rot(k=torch.randn(2, 2, 5, 8)), ValueError, "k head_dim"),
    ("rot/cos-seq", lambda: _rot(cos=B16[:, :4], sin=B16[:, :4]), ValueError,
     "cos sequence length"),
    ("rot/sin-shape", lambda: _rot(sin=B16[..., :8]), ValueError, "sin shape"),
    ("rot/odd-width", lambda: _rot(cos=B16[..., :7], sin=B16[..., :7]), ValueError,
     r"rotary width \(the last dim of cos\) must be even"),
    ("rot/too-wide", lambda: _rot(cos=torch.randn(2, 5, 18), sin=torch.randn(2, 5, 18)),
     ValueError, "must not exceed head_dim"),
    ("rot/unsqueeze-value", lambda: _rot(unsqueeze_dim=0), ValueError, "unsqueeze_dim"),
    ("rot/pairing", lambda: _rot(pairing="gptj"), ValueError, "pairing"),
    ("rot/pairing-type", lambda: _rot(pairing=1), TypeError, "pairing must be a str"),
    ("rot/devices", lambda: _rot(cos=B16.to("meta")), ValueError, "cos is on meta"),
    # apply_multimodal_rotary_pos_emb
    ("mrot/sections-type", lambda: _mrot(mrope_section=torch.tensor([2, 3, 3])), TypeError,
     "mrope_section"),
    ("mrot/section-entry", lambda: _mrot(mrope_section=[2.0, 3, 3]), TypeError,
     "mrope_section"),
    ("mrot/q-dtype", lambda: _mrot(q=torch.ones(2, 4, 5, 16, dtype=torch.int32)), TypeError,
     "q must be float32"),
    ("mrot/sections-sum", lambda: _mrot(mrope_section=[2, 3, 2]), ValueError,
     r"mrope_section \[2, 3, 2\] must satisfy 2 \* sum == 16"),
    ("mrot/sections-count", lambda: _mrot(mrope_section=[4, 4]), ValueError, "mrope_section"),
    ("mrot/section-negative", lambda: _mrot(mrope_section=[-1, 5, 4]), ValueError,
     "non-negative"),
    ("mrot/section-huge", lambda: _mrot(mrope_section=[2**63, 0, 0]), ValueError,
     "mrope_section entries must fit in int64"),
    ("mrot/cos-rank", lambda: _mrot(cos=B16, sin=B16), ValueError, "cos must be 4-D"),
    ("mrot/cos-axes", lambda: _mrot(cos=torch.randn(2, 2, 5, 16), sin=torch.randn(2, 2, 5, 16)),
     ValueError, "3 axes"),
    # apply_rotary_pos_emb_vision
    ("vision/q-type", lambda: _vision(q=None), TypeError, "q must be a torch.Tensor"),
    ("vision/q-dtype", lambda: _vision(q=torch.ones(6, 2, 16, dtype=torch.long)), TypeError,
     "q must be float32"),
    ("vision/cos-dtype", lambda: _vision(cos=torch.ones(6, 16, dtype=torch.long)), TypeError,
     "cos must be float32"),
    ("vision/q-rank", lambda: _vision(q=torch.randn(1, 6, 2, 16)), ValueError,
     r"q must be 3-D \(patches, heads, head_dim\)"),
    ("vision/patches", lambda: _vision(cos=torch.randn(5, 16), sin=torch.randn(5, 16)),
     ValueError, "cos has 5 patches"),
    ("vision/too-wide", lambda: _vision(cos=torch.randn(6, 18), sin=torch.randn(6, 18)),
     ValueError, "must not exceed head_dim"),
    # apply_rope
    ("fused/scaling-tensor", lambda: _fused(attention_scaling=torch.tensor(2.0,
                                                                       requires_grad=True)),
     TypeError, "attention_scaling must be a real number"),
    ("fused/scaling-str", lambda: _fused(attention_scaling="2"), TypeError,
     "attention_scaling"),
    ("fused/scaling-bool", lambda: _fused(attention_scaling=True), TypeError,
     "attention_scaling"),
    ("fused/scaling-huge", lambda: _fused(attention_scaling=10**400), ValueError,
     "attention_scaling is too large for a float"),
    ("fused/interleaved-str", lambda: _fused(position_ids=POS3, mrope_section=[2, 3, 3],
                                             interleaved_mrope="no"), TypeError,
     "interleaved_mrope must be a bool"),
    ("fused/position-dtype", lambda: _fused(position_ids=POS.float()), TypeError,
     "position_ids must be int64 or int32"),
    ("fused/inv-freq-dtype", lambda: _fused(inv_freq=torch.arange(8)), TypeError,
     "inv_freq must be floating point"),
    ("fused/inv-freq-type", lambda: _fused(inv_freq=[1.0] * 8), TypeError,
     "inv_freq must be a torch.Tensor"),
    ("fused/q-rank", lambda: _fused(q=torch.randn(4, 5, 16)), ValueError, "q must be 4-D"),
    ("fused/position-rank", lambda: _fused(position_ids=POS[0]), ValueError, "position_ids"),
    ("fused/position-seq", lambda: _fused(position_ids=POS[:, :3]), ValueError,
     "position_ids sequence length"),
    ("fused/position-batch", lambda: _fused(position_ids=POS.repeat(2, 1)), ValueError,
     "position_ids batch size"),
    ("fused/no-sections", lambda: _fused(position_ids=POS3), ValueError, "mrope_section"),
    ("fused/sections-sum", lambda: _fused(position_ids=POS3, mrope_section=[3, 3, 3]),
     ValueError, "mrope_section"),
    ("fused/too-wide", lambda: _fused(inv_freq=torch.rand(9)), ValueError,
     r"rotary width 18 \(2 \* len\(inv_freq\)\) must not exceed head_dim 16"),
    ("fused/inv-freq-grad", lambda: _fused(inv_freq=torch.rand(8, requires_grad=True)),
     ValueError, "inv_freq requires grad"),
    ("fused/pairing-type", lambda: _fused(pairing=None), TypeError, "pairing must be a str"),
    # compute_mrope_cos_sin
    ("tables/dtype", lambda: _tables_fn(dtype=torch.int32), TypeError, "dtype must be float32"),
    ("tables/dtype-type", lambda: _tables_fn(dtype="float32"), TypeError,
     "dtype must be a torch.dtype"),
    ("tables/scaling-tensor", lambda: _tables_fn(attention_scaling=torch.tensor(1.0)),
     TypeError, "attention_scaling"),
    ("tables/interleaved", lambda: _tables_fn(position_ids=POS3, mrope_section=[2, 3, 3],
                                              interleaved=1), TypeError, "interleaved"),
    ("tables/position-dtype", lambda: _tables_fn(position_ids=POS.double()), TypeError,
     "position_ids"),
    ("tables/position-rank", lambda: _tables_fn(position_ids=POS[0]), ValueError,
     "position_ids"),
    ("tables/inv-freq-rank", lambda: _tables_fn(inv_freq=INV[None]), ValueError, "inv_freq"),
    ("tables/sections-sum", lambda: _tables_fn(position_ids=POS3, mrope_section=[1, 1, 1]),
     ValueError, "mrope_section"),
    # compute_mrope_position_ids
    ("positions/ids-dtype", lambda: _positions(input_ids=IDS.float()), TypeError, "input_ids"),
    ("positions/merge-type", lambda: _positions(spatial_merge_size="2"), TypeError,
     "spatial_merge_size"),
    ("positions/ids-rank", lambda: _positions(input_ids=IDS[0]), ValueError, "input_ids"),
    ("positions/model", lambda: _positions(model="qwen9"), ValueError, "model"),
    ("positions/convention", lambda: _positions(convention="4.0"), ValueError, "convention"),
    ("positions/grid-shape", lambda: _positions(image_grid_thw=torch.ones(1, 2,
                                                                        dtype=torch.long),
                                                mm_token_type_ids=torch.zeros_like(IDS)),
     ValueError, "image_grid_thw"),
    ("positions/mask-shape", lambda: _positions(attention_mask=torch.ones(1, 3)), ValueError,
     "attention_mask"),
    ("positions/merge-value", lambda: _positions(spatial_merge_size=0), ValueError,
     "spatial_merge_size"),
    ("positions/merge-huge", lambda: _positions(spatial_merge_size=2**63), ValueError,
     "spatial_merge_size must fit in int64"),
    ("positions/token-id-huge", lambda: _positions(convention="4.57", image_token_id=2**64,
                                                   video_token_id=8, vision_start_token_id=9),
     ValueError, "image_token_id must fit in int64"),
    ("positions/ids-type", lambda: _positions(input_ids=[[1, 2]]), TypeError,
     "input_ids must be a torch.Tensor"),
    ("positions/model-type", lambda: _positions(model=2), TypeError, "model must be a str"),
    ("positions/convention-type", lambda: _positions(convention=5.17), TypeError,
     "convention must be a str"),
    ("positions/unknown-keyword", lambda: _positions(merge_size=2), TypeError,
     "unexpected keyword argument 'merge_size'"),
    ("positions/seconds-str", lambda: _positions(model="qwen2_5_vl", second_per_grid_ts="1.0"),
     TypeError, "second_per_grid_ts must be a tensor or a sequence of real numbers"),
    ("positions/seconds-entry", lambda: _positions(model="qwen2_5_vl",
                                                   second_per_grid_ts=["1.0"]),
     TypeError, r"second_per_grid_ts\[0\] must be a real number"),
    ("positions/seconds-dtype", lambda: _positions(model="qwen2_5_vl",
                                                   second_per_grid_ts=torch.ones(0, dtype=bool)),
     TypeError, "second_per_grid_ts must be a real tensor"),
    ("positions/tokens-per-second-type", lambda: _positions(model="qwen2_5_vl",
                                                            tokens_per_second="2"),
     TypeError, "tokens_per_second must be a real number"),
    # a missing input is a TypeError under every convention
    ("positions/missing-4.57", lambda: _positions(convention="4.57",
                                                  image_grid_thw=torch.tensor([[1, 2, 2]])),
     TypeError, "pass image_token_id, video_token_id, vision_start_token_id"),
    ("positions/missing-5", lambda: _positions(image_grid_thw=torch.tensor([[1, 2, 2]])),
     TypeError, "pass it, or image_token_id and video_token_id"),
    ("positions/ids-none-4.57", lambda: _positions(input_ids=None, convention="4.57",
                                                   image_token_id=7, video_token_id=8,
                                                   vision_start_token_id=9), TypeError,
     "input_ids must be a torch.Tensor, got NoneType"),
    ("positions/ids-none-5", lambda: _positions(input_ids=None), TypeError,
     "input_ids must be a torch.Tensor, got NoneType"),
    ("positions/ids-none-grids", lambda: _positions(input_ids=None, image_grid_thw=_GRID,
                                                    image_token_id=7, video_token_id=8),
     TypeError, "input_ids must be a torch.Tensor, got NoneType"),
    ("positions/mask-meta", lambda: _positions(attention_mask=torch.ones(1, 4, device="meta")),
     ValueError, "attention_mask is on meta but input_ids is on cpu"),
    ("positions/grid-meta", lambda: _positions(
        image_grid_thw=torch.ones(1, 3, dtype=torch.long, device="meta"),
        mm_token_type_ids=torch.zeros_like(IDS)),
     ValueError, "image_grid_thw is on meta but input_ids is on cpu"),
    # compute_packed_mrope_position_ids
    ("packed/ids-type", lambda: _packed(input_ids=[[1, 2, 3, 4]]), TypeError,
     "input_ids must be a torch.Tensor"),
    ("packed/model-missing", lambda: P.compute_packed_mrope_position_ids(IDS, [4]), TypeError,
     "missing required keyword argument 'model'"),
    ("packed/model-type", lambda: _packed(model=None), TypeError, "model must be a str"),
    ("packed/seq-lens-float", lambda: _packed(seq_lens=[[2, 2.0]]), TypeError,
     r"seq_lens\[0\]\[1\] must be an int"),
    ("packed/seq-lens-tensor-dtype", lambda: _packed(seq_lens=torch.tensor([[2.0, 2.0]])),
     TypeError, "seq_lens must be an integer tensor"),
    ("packed/layout-missing", lambda: _packed(seq_lens=None), TypeError,
     "pass exactly one of seq_lens, cu_seqlens and attention_mask"),
    ("packed/seq-lens-negative", lambda: _packed(seq_lens=[[3, -1]]), ValueError,
     r"seq_lens\[0\]\[1\] \(example 1\) is -1"),
    ("packed/seq-lens-tensor-negative", lambda: _packed(seq_lens=torch.tensor([[3, -1]])),
     ValueError, r"seq_lens\[0\]\[1\] \(example 1\) is -1"),
    ("packed/seq-lens-long", lambda: _packed(seq_lens=torch.tensor([[3, 2]])), ValueError,
     r"seq_lens\[0\]\[1\] \(example 1\): the examples of row 0 up to this one need 5"),
    ("packed/cu-start", lambda: _packed(seq_lens=None, cu_seqlens=[1, 4]), ValueError,
     r"cu_seqlens\[0\] must start with 0"),
    ("packed/cu-decrease", lambda: _packed(seq_lens=None, cu_seqlens=[0, 3, 2]), ValueError,
     r"cu_seqlens\[0\]\[2\] \(end of example 1\) is 2, below"),
    ("packed/seq-lens-meta", lambda: _packed(seq_lens=torch.tensor([4], device="meta")),
     ValueError, "seq_lens is on meta but input_ids is on cpu"),
    ("packed/seq-lens-table-meta", lambda: _packed(seq_lens=torch.tensor([[4]], device="meta")),
     ValueError, "seq_lens is on meta but input_ids is on cpu"),
    ("packed/mask-meta", lambda: _packed(seq_lens=None, attention_mask=torch.ones(
        1, 4, dtype=torch.long, device="meta")), ValueError,
     "attention_mask is on meta but input_ids is on cpu"),
    ("packed/seq-lens-huge", lambda: _packed(seq_lens=[[2**64]]), ValueError,
     r"seq_lens\[0\]\[0\] must fit in int64"),
    ("packed/cu-huge", lambda: _packed(seq_lens=None, cu_seqlens=[0, 2**64]), ValueError,
     r"cu_seqlens\[0\]\[1\] must fit in int64"),
    ("packed/merge-huge", lambda: _packed(spatial_merge_size=-2**63 - 1), ValueError,
     "spatial_merge_size must fit in int64"),
    # resolve_convention
    ("resolve/type", lambda: positions.resolve_convention(["5.17"]), TypeError,
     "convention must be a str"),
    ("resolve/model-type", lambda: positions.resolve_convention("5.17", 3), TypeError,
     "model must be a str"),
    ("resolve/value", lambda: positions.resolve_convention("5.x"), ValueError,
     "convention must be 'installed' or one of"),
    # compute_mrope_decode_position_ids
    ("decode/deltas-dtype", lambda: _decode(mrope_position_deltas=torch.zeros(2, 1)), TypeError,
     "mrope_position_deltas"),
    ("decode/past-type", lambda: _decode(past_length="4"), TypeError, "past_length"),
    ("decode/past-dtype", lambda: _decode(past_length=torch.tensor(4.0)), TypeError,
     "past_length"),
    ("decode/past-negative", lambda: _decode(past_length=-1), ValueError, "past_length"),
    ("decode/past-negative-tensor", lambda: _decode(past_length=torch.tensor(-7)), ValueError,
     "past_length must be >= 0, got -7"),
    ("decode/past-overflow", lambda: _decode(past_length=2**63), ValueError, "past_length"),
    ("decode/past-overflow-tensor", lambda: _decode(
        past_length=torch.tensor(2**63 - 1), mrope_position_deltas=torch.ones(2, 1,
                                                                               dtype=torch.long)),
     ValueError, "past int64"),
    ("decode/new-tokens", lambda: _decode(num_new_tokens=-1), ValueError, "num_new_tokens"),
    ("decode/batch-size", lambda: _decode(batch_size=3), ValueError, "batch_size"),
    ("decode/deltas-shape", lambda: _decode(mrope_position_deltas=torch.zeros(2, 2,
                                                                              dtype=torch.long)),
     ValueError, "mrope_position_deltas"),
    ("decode/deltas-complex", lambda: _decode(mrope_position_deltas=torch.zeros(
        2, 1, dtype=torch.complex64)), TypeError, "mrope_position_deltas must be an integer"),
    ("decode/new-tokens-huge", lambda: _decode(num_new_tokens=2**70), ValueError,
     "num_new_tokens must fit in int64"),
    ("decode/allocation", lambda: _decode(num_new_tokens=2**40), RuntimeError,
     r"could not allocate the \(3, 2, num_new_tokens\) position ids of num_new_tokens = "
     "1099511627776"),
    ("decode/allocation-prompt", lambda: _decode(num_new_tokens=2**40, prompt_position_ids=(
        torch.zeros(3, 2, 4, dtype=torch.long))), RuntimeError,
     r"could not allocate the \(3, 2, num_new_tokens\) position ids of num_new_tokens"),
    ("decode/batch-size-type", lambda: _decode(batch_size=2.0), TypeError, "batch_size"),
    ("decode/convention-type", lambda: _decode(convention=5.17), TypeError,
     "convention must be a str"),
    ("decode/convention-value", lambda: _decode(convention="5.x"), ValueError, "convention"),
    ("decode/mask-complex", lambda: _decode(convention="5.17", attention_mask=torch.ones(
        2, 5, dtype=torch.complex64)), TypeError, "attention_mask must be bool, integer or"),
    ("decode/mask-meta", lambda: _decode(convention="5.17", attention_mask=torch.ones(
        2, 5, device="meta")), ValueError, "attention_mask is on meta but "
     "mrope_position_deltas is on cpu"),
    ("decode/prompt-meta", lambda: _decode(prompt_position_ids=torch.zeros(
        3, 2, 4, dtype=torch.long, device="meta")), ValueError, "prompt_position_ids is on meta"),
    ("decode/prompt-complex", lambda: _decode(prompt_position_ids=torch.zeros(
        3, 2, 4, dtype=torch.complex64)), TypeError, "prompt_position_ids must be an integer"),
    # vision_rotary_position_ids
    ("vision-ids/grid-dtype", lambda: P.vision_rotary_position_ids(torch.ones(1, 3)), TypeError,
     "grid_thw"),
    ("vision-ids/merge-type", lambda: P.vision_rotary_position_ids(
        torch.tensor([[1, 2, 2]]), 1.5), TypeError, "spatial_merge_size"),
    ("vision-ids/grid-shape", lambda: P.vision_rotary_position_ids(
        torch.ones(1, 2, dtype=torch.long)), ValueError, "grid_thw"),
    ("vision-ids/grid-value", lambda: P.vision_rotary_position_ids(torch.tensor([[1, 3, 4]])),
     ValueError, r"grid_thw\[0\] = \(1, 3, 4\)"),
    ("vision-ids/allocation", lambda: P.vision_rotary_position_ids(
        torch.tensor([[1, 2**22, 2**22]])), RuntimeError,
     r"could not allocate the \(patches, 2\) ids of grid_thw"),
    ("vision-ids/grid-meta", lambda: P.vision_rotary_position_ids(_GRID.to("meta")),
     NotImplementedError, "grid_thw is a meta tensor: the vision functions read its values"),
    # posenc_torch.vision
    ("vision-pos/grid-dtype", lambda: vision.get_vision_position_ids(torch.ones(1, 3), 2),
     TypeError, "grid_thw must be an integer tensor"),
    ("vision-pos/merge-type", lambda: vision.get_vision_position_ids(_GRID, 2.0), TypeError,
     "spatial_merge_size must be an int"),
    ("vision-pos/grid-value", lambda: vision.get_vision_position_ids(
        torch.tensor([[1, 4, 4], [1, 4, 3]]), 2), ValueError, r"grid_thw\[1\] = \(1, 4, 3\)"),
    ("vision-pos/merge-tensor", lambda: vision.get_vision_position_ids(
        _GRID, torch.tensor([2, 2])), ValueError, "spatial_merge_size as a tensor must have one"),
    ("vision-pos/grid-meta", lambda: vision.get_vision_position_ids(_GRID.to("meta"), 2),
     NotImplementedError, "grid_thw is a meta tensor"),
    ("vision-cu/flag-type", lambda: vision.get_vision_cu_seqlens(_GRID, "yes"), TypeError,
     "merge_temporal must be a bool"),
    ("vision-cu/grid-shape", lambda: vision.get_vision_cu_seqlens(torch.ones(2, 2,
                                                                             dtype=torch.long)),
     ValueError, r"grid_thw must have shape \(num_grids, 3\)"),
    ("vision-att/grid-type", lambda: vision.get_vision_attention_seqlens([[1, 2, 2]]), TypeError,
     "grid_thw must be a torch.Tensor"),
    ("vision-att/grid-value", lambda: vision.get_vision_attention_seqlens(
        torch.tensor([[0, 2, 2]])), ValueError, r"grid_thw\[0\] = \(0, 2, 2\)"),
    ("vision-att/grid-meta", lambda: vision.get_vision_attention_seqlens(_GRID.to("meta")),
     NotImplementedError, "grid_thw is a meta tensor"),
    ("vision-win/window-type", lambda: vision.get_vision_window_index(_GRID, 2, 112.0, 14),
     TypeError, "window_size must be an int"),
    ("vision-win/window-small", lambda: vision.get_vision_window_index(_GRID, 2, 20, 14),
     ValueError, "window_size .* must be at least"),
    ("vision-interp/mode-type", lambda: vision.get_vision_interpolation_indices_and_weights(
        _GRID, 4, 1), TypeError, "mode must be a str"),
    ("vision-interp/mode", lambda: vision.get_vision_interpolation_indices_and_weights(
        _GRID, 4, "nearest"), ValueError, "mode must be one of"),
    ("vision-interp/side", lambda: vision.get_vision_interpolation_indices_and_weights(
        _GRID, 0), ValueError, "num_grid_per_side must be >= 1"),
    ("vision-bilinear/grid-dtype", lambda: vision.get_vision_bilinear_indices_and_weights(
        torch.ones(1, 3, dtype=torch.bool), 4, 2), TypeError, "grid_thw must be an integer"),
    ("vision-bilinear/grid-value", lambda: vision.get_vision_bilinear_indices_and_weights(
        torch.tensor([[1, 2, -2]]), 4, 2), ValueError, r"grid_thw\[0\]"),
    ("vision-nearest/sizes-dtype", lambda: vision.get_vision_nearest_position_ids(
        torch.ones(1, 2), 4), TypeError, "target_sizes must be an integer tensor"),
    ("vision-nearest/sizes-value", lambda: vision.get_vision_nearest_position_ids(
        torch.tensor([[1, 2], [0, 2]]), 4), ValueError, r"target_sizes\[1\] = \(0, 2\)"),
    ("vision-merged/window-type", lambda: vision.get_vision_merged_shape(
        torch.tensor([[4, 4]]), 2), TypeError, "window_kernel_size must be"),
    ("vision-merged/sizes-value", lambda: vision.get_vision_merged_shape(
        torch.tensor([[0, 4]]), (2, 2)), ValueError, r"target_sizes\[0\] = \(0, 4\)"),
    ("vision-merged/sizes-meta", lambda: vision.get_vision_merged_shape(
        torch.tensor([[4, 4]], device="meta"), (2, 2)), NotImplementedError,
     "target_sizes is a meta tensor"),
    # sinusoidal_position_encoding
    ("sinusoidal/positions-type", lambda: P.sinusoidal_position_encoding(4.0, 8), TypeError,
     "num_positions"),
    ("sinusoidal/base-type", lambda: P.sinusoidal_position_encoding(4, 8, base="1e4"),
     TypeError, "base"),
    ("sinusoidal/dtype", lambda: P.sinusoidal_position_encoding(4, 8, dtype=torch.int64),
     TypeError, "dtype must be float32"),
    ("sinusoidal/positions-value", lambda: P.sinusoidal_position_encoding(-1, 8), ValueError,
     "num_positions must be >= 0"),
    ("sinusoidal/dim-value", lambda: P.sinusoidal_position_encoding(4, 0), ValueError,
     "dim must be >= 1"),
    ("sinusoidal/base-value", lambda: P.sinusoidal_position_encoding(4, 8, base=float("nan")),
     ValueError, "base"),
    ("sinusoidal/overflow", lambda: P.sinusoidal_position_encoding(2**62, 8), ValueError,
     "num_positions \\* dim overflows"),
    ("sinusoidal/allocation", lambda: P.sinusoidal_position_encoding(2**40, 8), RuntimeError,
     r"could not allocate the \(num_positions, dim\) table"),
    ("sinusoidal/positions-huge", lambda: P.sinusoidal_position_encoding(2**63, 8), ValueError,
     "num_positions must fit in int64"),
    ("sinusoidal/dim-huge", lambda: P.sinusoidal_position_encoding(4, 2**63), ValueError,
     "dim must fit in int64"),
    # posenc_torch.packing
    ("pack/examples-type", lambda: _pack(examples=TEXT_EXAMPLE), TypeError,
     "examples must be a list"),
    ("pack/example-type", lambda: _pack(examples=[TEXT_EXAMPLE, 3]), TypeError,
     r"examples\[1\] must be a mapping"),
    ("pack/ids-dtype", lambda: _pack(examples=[{"input_ids": torch.tensor([[1.0]])}]),
     TypeError, r"examples\[0\]\['input_ids'\] must hold integers"),
    ("pack/flash-kwargs-str", lambda: _pack(return_flash_attn_kwargs="no"), TypeError,
     "return_flash_attn_kwargs must be a bool"),
    ("pack/max-tokens-bool", lambda: _pack(max_tokens=True), TypeError,
     "max_tokens must be an int"),
    ("pack/convention-type", lambda: _pack(convention=4.57), TypeError,
     "convention must be a str"),
    ("pack/empty", lambda: _pack(examples=[]), ValueError, "examples is empty"),
    ("pack/max-tokens-value", lambda: _pack(max_tokens=4), ValueError,
     r"examples\[1\] has 5 tokens, more than max_tokens=4"),
    ("pack/config", lambda: _pack(config=types.SimpleNamespace()), ValueError,
     "config must be a Qwen-VL model or config"),
    ("pack/config-none", lambda: _pack(config=None), TypeError,
     "config is required: the Qwen-VL model or its config, got None"),
    ("pack/no-input-ids", lambda: _pack(examples=[TEXT_EXAMPLE, {"attention_mask": torch.ones(
        1, 3)}]), TypeError, r"examples\[1\] has no 'input_ids'"),
    ("pack/grid-meta", lambda: _pack(examples=[TEXT_EXAMPLE, dict(
        IMAGE_EXAMPLE, image_grid_thw=IMAGE_EXAMPLE["image_grid_thw"].to("meta"))]), ValueError,
     r"examples\[1\]\['image_grid_thw'\] is a meta tensor"),
    ("pack/multiple-huge", lambda: _pack(pad_to_multiple_of=2**70), ValueError,
     "pad_to_multiple_of must fit in int64"),
    ("pack/allocation", lambda: _pack(pad_to_multiple_of=2**40), RuntimeError,
     r"could not allocate the \(rows, L\) batch of shape \(1, 1099511627776\): L is the "
     r"longest row \(8 tokens\) rounded up to a multiple of pad_to_multiple_of = 1099511627776"),
    ("pack/grid-tokens", lambda: _pack(examples=[TEXT_EXAMPLE, dict(
        IMAGE_EXAMPLE, input_ids=torch.tensor([[1, 6, 7, 9, 9]]))]), ValueError,
     r"^examples\[1\]: image_grid_thw\[0\] = \(1, 2, 4\) needs 2 image_token_id tokens"),
    ("collator/flash-kwargs-str", lambda: _collator(return_flash_attn_kwargs=1), TypeError,
     "return_flash_attn_kwargs must be a bool"),
    ("collator/multiple-value", lambda: _collator(pad_to_multiple_of=0), ValueError,
     "pad_to_multiple_of must be >= 1"),
    ("collator/config-none", lambda: packing.MultimodalPackingCollator(None), TypeError,
     "config is required"),
    ("collator/max-tokens-huge", lambda: _collator(max_tokens=2**70), ValueError,
     "max_tokens must fit in int64"),
    ("collator/precompute-str", lambda: _collator(precompute_vision="yes"), TypeError,
     "precompute_vision must be a bool"),
    ("pack/precompute-int", lambda: _pack(precompute_vision=1), TypeError,
     "precompute_vision must be a bool"),
    ("pad/examples-type", lambda: packing.pad_multimodal_examples(TEXT_EXAMPLE, CONFIG),
     TypeError, "examples must be a list of examples"),
    ("pad/side-type", lambda: packing.pad_multimodal_examples([TEXT_EXAMPLE], CONFIG,
                                                             padding_side=0), TypeError,
     "padding_side must be a str"),
    ("pad/side-value", lambda: packing.pad_multimodal_examples([TEXT_EXAMPLE], CONFIG,
                                                              padding_side="top"), ValueError,
     "padding_side must be 'right' or 'left'"),
    ("pad/empty", lambda: packing.pad_multimodal_examples([], CONFIG), ValueError,
     "examples is empty"),
    ("pad/config-none", lambda: packing.pad_multimodal_examples([TEXT_EXAMPLE], None), TypeError,
     "config is required"),
    ("pad/multiple-huge", lambda: packing.pad_multimodal_examples(
        [TEXT_EXAMPLE], CONFIG, pad_to_multiple_of=2**70), ValueError,
     "pad_to_multiple_of must fit in int64"),
    ("pad/allocation", lambda: packing.pad_multimodal_examples(
        [TEXT_EXAMPLE], CONFIG, pad_to_multiple_of=2**40), RuntimeError,
     r"could not allocate the \(rows, L\) batch of shape \(1, 1099511627776\): L is the "
     r"longest row \(3 tokens\)"),
    ("pad/grid-pixels", lambda: packing.pad_multimodal_examples([dict(
        IMAGE_EXAMPLE, pixel_values=torch.ones(7, 24))], CONFIG), ValueError,
     r"^examples\[0\]\['pixel_values'\] has 7 patches but image_grid_thw describes 8"),
    ("pad-collator/precompute-str", lambda: packing.MultimodalPaddingCollator(
        CONFIG, precompute_vision="no"), TypeError, "precompute_vision must be a bool"),
    ("pad-collator/config-none", lambda: packing.MultimodalPaddingCollator(None), TypeError,
     "config is required"),
    ("pad-collator/multiple-value", lambda: packing.MultimodalPaddingCollator(
        CONFIG, pad_to_multiple_of=0), ValueError, "pad_to_multiple_of must be >= 1"),
    ("first-fit/length-float", lambda: packing.first_fit([3, 1.5], 4), TypeError,
     r"lengths\[1\] must be an int"),
    ("first-fit/lengths-type", lambda: packing.first_fit(3, 4), TypeError,
     "lengths must be a sequence of ints"),
    ("first-fit/max-tokens-bool", lambda: packing.first_fit([1, 1], True), TypeError,
     "max_tokens must be an int"),
    ("first-fit/length-huge", lambda: packing.first_fit([3, 2**64], None), ValueError,
     r"lengths\[1\] must fit in int64"),
    ("first-fit/length-negative", lambda: packing.first_fit([3, -1], 4), ValueError,
     r"lengths\[1\] must be >= 0"),
    ("first-fit/too-long", lambda: packing.first_fit([3, 5], 4), ValueError,
     r"examples\[1\] has 5 tokens, more than max_tokens=4"),
    ("leaks/position-type", lambda: _leaks(position_ids=[0, 1, 0]), TypeError,
     "position_ids must be a torch.Tensor"),
    ("leaks/use-cache-type", lambda: _leaks(use_cache=None), TypeError,
     "use_cache must be a bool"),
    ("leaks/attn-type", lambda: _leaks(attn_implementation=2), TypeError,
     "attn_implementation must be a str"),
    ("leaks/position-rank", lambda: _leaks(position_ids=torch.arange(4)), ValueError,
     "position_ids must be"),
    ("leaks/position-no-rows", lambda: _leaks(position_ids=torch.zeros(0, 2, 5, dtype=torch.long),
                                              use_cache=True), ValueError,
     r"position_ids must be \(1, 3 or 4, batch, seq\) or \(batch, seq\), got shape \(0, 2, 5\)"),
    ("leaks/mask-meta", lambda: _leaks(attention_mask=torch.ones(2, 5, device="meta")),
     ValueError, "attention_mask is on meta but position_ids is on cpu"),
    ("leaks/mask-meta-flash", lambda: _leaks(attention_mask=torch.ones(2, 5, device="meta"),
                                             attn_implementation="flash_attention_2"),
     ValueError, "attention_mask is on meta but position_ids is on cpu"),
    ("leaks/position-complex", lambda: _leaks(position_ids=PACKED_POS.to(torch.complex64),
                                              use_cache=True), TypeError,
     "position_ids must be an integer tensor, got torch.complex64"),
    ("leaks/position-bool", lambda: _leaks(position_ids=PACKED_POS.bool(), use_cache=True),
     TypeError, "position_ids must be an integer tensor, got torch.bool"),
    ("leaks/position-float", lambda: _leaks(position_ids=PACKED_POS.float(), use_cache=True),
     TypeError, "position_ids must be an integer tensor, got torch.float32"),
    ("leaks/mask-complex", lambda: _leaks(attention_mask=torch.ones(2, 5, dtype=torch.complex64)),
     TypeError, "attention_mask must be bool, integer or floating"),
    ("leaks/cu-seq-lens-float", lambda: _leaks(cu_seq_lens_q=torch.tensor([0.0, 3.0, 5.0]),
                                               attn_implementation="flash_attention_2"),
     TypeError, "cu_seq_lens_q must be an integer tensor"),
    ("warn-leaks/use-cache-type", lambda: _leaks(packing.warn_packed_attention_leaks,
                                                 use_cache="no"), TypeError,
     "use_cache must be a bool"),
    ("warn-leaks/position-rank", lambda: _leaks(packing.warn_packed_attention_leaks,
                                                position_ids=torch.zeros(1, 1, 1, 4)),
     ValueError, "position_ids must be"),
    # set_kernel_isa
    ("isa/type", lambda: P.set_kernel_isa(2), TypeError, "name must be a str"),
    ("isa/value", lambda: P.set_kernel_isa("sse2"), ValueError, "name must be"),
    # hf.patch
    ("patch/type", lambda: _patch(model_types=["llama", 3]), TypeError,
     "model_types must be strings"),
    ("patch/unknown", lambda: _patch(model_types="gpt99"), ValueError, "gpt99"),
    ("patch/not-iterable", lambda: _patch(model_types=3), TypeError, "model_types"),
    ("patch/fallback", lambda: _patch(fallback="no"), TypeError, "fallback"),
    ("patch/count", lambda: _patch(count=1), TypeError, "count"),
    # apply_qk_norm_rope
    ("qk-norm/weight-dtype", lambda: _qk_norm(q_weight=torch.ones(16, dtype=torch.float64)),
     TypeError, "q_weight dtype"),
    ("qk-norm/q-dtype", lambda: _qk_norm(q=torch.ones(2, 4, 5, 16, dtype=torch.long)),
     TypeError, "q must be float32"),
    ("qk-norm/norm-type", lambda: _qk_norm(norm=None), TypeError, "norm must be a str"),
    ("qk-norm/eps-str", lambda: _qk_norm(eps="1e-6"), TypeError, "eps must be a real number"),
    ("qk-norm/weight-shape", lambda: _qk_norm(k_weight=torch.ones(8)), ValueError,
     "k_weight must have shape"),
    ("qk-norm/norm", lambda: _qk_norm(norm="layer"), ValueError, "norm must be one of"),
    ("qk-norm/eps-negative", lambda: _qk_norm(eps=-1.0), ValueError, "eps must be finite"),
    ("qk-norm/q-rank", lambda: _qk_norm(q=torch.randn(4, 5, 16)), ValueError, "q must be 4-D"),
    ("patch/empty", lambda: _patch(model_types=[]), ValueError, "model_types is empty"),
]


# posenc's own class for each bad-input class of the table: what "posenc refused the
# arguments" is raised as, on every torch.
INPUT_CLASSES = {TypeError: InputTypeError, ValueError: InputValueError}
# The cases of the transformers integration's own argument checks (posenc_torch.hf.patch):
# they raise the built-in classes, not InputError (the integration is not part of the core).
INTEGRATION = ("patch",)


@pytest.mark.parametrize("call,exc,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_policy(request, call, exc, fragment):
    with pytest.raises(exc, match=fragment) as info:
        call()
    # never the shim's class tag in a public message
    assert not str(info.value).startswith((_checks.TYPE_ERROR_TAG, _checks.VALUE_ERROR_TAG))
    if request.node.callspec.id.split("/")[0] in INTEGRATION:
        assert type(info.value) is exc
    elif exc in INPUT_CLASSES:
        # bad input: posenc's InputError of the class, whatever exception torch delivered
        assert type(info.value) is INPUT_CLASSES[exc]
        assert isinstance(info.value, InputError)
    else:
        # allocation, threads, a device: the class itself, never an InputError
        assert type(info.value) is exc and not isinstance(info.value, InputError)


# The public functions of posenc_torch, posenc_torch.packing and posenc_torch.vision (their
# __all__), by the prefix of their cases above; kernel_isa takes no argument.
PUBLIC = {
    "apply_rotary_pos_emb": "rot", "apply_multimodal_rotary_pos_emb": "mrot",
    "apply_rotary_pos_emb_vision": "vision", "apply_rope": "fused",
    "apply_qk_norm_rope": "qk-norm",
    "compute_mrope_cos_sin": "tables", "compute_mrope_position_ids": "positions",
    "compute_mrope_decode_position_ids": "decode",
    "compute_packed_mrope_position_ids": "packed", "vision_rotary_position_ids": "vision-ids",
    "sinusoidal_position_encoding": "sinusoidal", "set_kernel_isa": "isa",
    "pack_multimodal_examples": "pack", "MultimodalPackingCollator": "collator",
    "pad_multimodal_examples": "pad", "MultimodalPaddingCollator": "pad-collator",
    "first_fit": "first-fit", "packed_attention_leaks": "leaks",
    "warn_packed_attention_leaks": "warn-leaks",
    "get_vision_position_ids": "vision-pos", "get_vision_cu_seqlens": "vision-cu",
    "get_vision_attention_seqlens": "vision-att", "get_vision_window_index": "vision-win",
    "get_vision_interpolation_indices_and_weights": "vision-interp",
    "get_vision_bilinear_indices_and_weights": "vision-bilinear",
    "get_vision_nearest_position_ids": "vision-nearest", "get_vision_merged_shape": "vision-merged",
}


def test_every_public_function_has_each_class():
    """The table covers TypeError and ValueError for every public function taking tensors
    or options (the names come from the modules' __all__, so a new function without cases
    fails here), and RuntimeError where the function allocates from a size argument."""
    functions = {}
    for name, _, exc, _ in CASES:
        functions.setdefault(name.split("/")[0], set()).add(exc)
    public = [n for n in (*P.__all__, *packing.__all__, *vision.__all__)
              if n != "kernel_isa" and not n.startswith("Input")]  # InputError and its classes
    missing = [n for n in public if PUBLIC.get(n) not in functions]
    assert not missing, f"public functions without cases in CASES: {missing}"
    for name in public:
        assert {TypeError, ValueError} <= functions[PUBLIC[name]], name
    assert {"resolve", "patch"} <= functions.keys()
    assert RuntimeError in functions["vision-ids"] and RuntimeError in functions["sinusoidal"]


# ------------------------------------------------------------------------------ raw ops


def test_raw_ops_state_the_class_in_the_message():
    q, k = _qk()
    cos, sin = _tables()
    with raw_raises(TypeError, "^q must be float32"):
        torch.ops.posenc.rope(q.long(), k, cos, sin, [], False, 0, False, None, None, True)
    with raw_raises(ValueError, "^k batch size 1 must equal q batch size 2$"):
        torch.ops.posenc.rope(q, k[:1], cos, sin, [], False, 0, False, None, None, True)
    with raw_raises(TypeError, "^dtype must be float32"):
        torch.ops.posenc.rope_tables(POS, INV, [], False, 1.0, 0, torch.int64)
    with raw_raises(TypeError, "^input_ids must be an integer tensor"):
        torch.ops.posenc.mrope_position_ids(IDS.float(), None, None, None, None, 0, 7, 8, 9, 2,
                                            0.0)
    # a missing input: a type failure, as the public function's TypeError
    with raw_raises(TypeError, "^mm_token_type_ids is required"):
        torch.ops.posenc.mrope_position_ids(IDS, torch.tensor([[1, 2, 2]]), None, None, None, 0,
                                            0, 1, 2, 2, 0.0, None, 1)
    # an example's error inside the packed walk: one tag, at the start
    with raw_raises(ValueError, r"^example 0 \(row 0, input_ids\[0, 0:4\]\): input_ids\[0, 2\]"):
        torch.ops.posenc.mrope_packed_position_ids(
            torch.tensor([[1, 9, 7, 4]]), torch.tensor([4]), torch.tensor([1]), None, None,
            None, 0, 7, 8, 9, 2, 0.0, None, 0, 0)
    # allocation: a RuntimeError under every torch, without a tag
    with pytest.raises(RuntimeError, match="^could not allocate") as info:
        torch.ops.posenc.sinusoidal(2**40, 8, 10000.0, torch.float32)
    assert type(info.value) is RuntimeError


def test_op_error_reads_the_tag_whatever_the_exception_type():
    """ValueError is what torch 2.11 to 2.14 deliver, RuntimeError what 2.15 delivers: the
    tag alone decides the class."""
    for delivered in (ValueError, RuntimeError, Exception):
        err = _checks.op_error(delivered("TypeError: q must be float32"))
        assert type(err) is InputTypeError and str(err) == "q must be float32"
        err = _checks.op_error(delivered("ValueError: k batch size 1"))
        assert type(err) is InputValueError and str(err) == "k batch size 1"
        assert isinstance(err, ValueError) and isinstance(err, InputError)
        untagged = delivered("could not allocate the table")
        assert _checks.op_error(untagged) is untagged
    found = InputValueError("ValueError: a message of Python's own")  # not the shim's
    assert _checks.op_error(found) is found


def test_input_classes_are_the_builtin_classes_too():
    assert issubclass(InputTypeError, TypeError) and issubclass(InputTypeError, InputError)
    assert issubclass(InputValueError, ValueError) and issubclass(InputValueError, InputError)
    assert not issubclass(InputError, (TypeError, ValueError, RuntimeError))
    assert (P.InputError, P.InputTypeError, P.InputValueError) == (
        InputError, InputTypeError, InputValueError)


def _delivered_as_runtime_errors(monkeypatch) -> None:
    """Every shim failure of the ops below reaches Python as a RuntimeError with its message
    unchanged, as torch 2.15 delivers them, whatever torch runs the test."""
    def relabel(op):
        def call(*args, **kwargs):
            try:
                return op(*args, **kwargs)
            except (ValueError, RuntimeError) as err:
                if isinstance(err, InputError):  # raised by Python (a fake kernel's check)
                    raise
                raise RuntimeError(str(err)) from None
        return call

    monkeypatch.setattr(ops, "rope", relabel(ops.rope))
    for name in ("sinusoidal", "mrope_position_ids", "vision_position_ids"):
        monkeypatch.setattr(torch.ops.posenc, name, relabel(getattr(torch.ops.posenc, name)))


@pytest.mark.parametrize("case", [
    "rot/k-batch", "rot/q-dtype", "rot/sin-dtype", "sinusoidal/positions-value",
    "sinusoidal/dtype", "sinusoidal/allocation", "positions/mask-shape", "positions/ids-dtype",
    "vision-ids/grid-value", "vision-ids/allocation", "vision-pos/grid-value",
])
def test_public_classes_do_not_depend_on_the_delivered_type(monkeypatch, case):
    """The public functions raise the table's class from the shim's tag when the failure
    reaches Python as a RuntimeError (torch 2.15's delivery; the table above runs under the
    torch at hand only)."""
    _, call, exc, fragment = next(c for c in CASES if c[0] == case)
    _delivered_as_runtime_errors(monkeypatch)
    with pytest.raises(exc, match=fragment) as info:
        call()
    assert type(info.value) is INPUT_CLASSES.get(exc, exc)


# --------------------------------------------------- the checks run only on failure


@pytest.fixture
def counted_checks(monkeypatch):
    calls = []

    def counting(original):
        def check(*args):
            calls.append(original.__name__)
            return original(*args)
        return check

    for name in ("_check_table_call", "_check_vision_call", "_check_fused_call",
                 "_check_positions"):
        monkeypatch.setattr(rope, name, counting(getattr(rope, name)))
    return calls


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_checks_do_not_run_when_the_call_succeeds(counted_checks, device):
    """The public functions take one path for every device: the op first, the checks only
    after it failed.  Meta tensors stand in for CUDA ones here (same path: no device test in
    the functions); on CPU the kernels run."""
    q, k = (t.to(device) for t in _qk())
    cos, sin = (t.to(device) for t in _tables())
    cos3, sin3 = (t.to(device) for t in _mrope_tables())
    P.apply_rotary_pos_emb(q, k, cos, sin)
    P.apply_multimodal_rotary_pos_emb(q, k, cos3, sin3, [2, 3, 3])
    P.apply_rotary_pos_emb_vision(q[0], q[0], cos[0, :4], sin[0, :4])
    P.apply_rope(q, k, POS.to(device), INV.to(device))
    P.compute_mrope_cos_sin(POS.to(device), INV.to(device))
    assert counted_checks == []


def test_checks_run_once_when_the_call_fails(counted_checks):
    q, k = _qk()
    cos, sin = _tables()
    with pytest.raises(ValueError, match="k batch size"):
        P.apply_rotary_pos_emb(q, k[:1], cos, sin)
    assert counted_checks == ["_check_table_call"]


def test_position_checks_run_only_when_the_op_fails(monkeypatch):
    """compute_mrope_position_ids and compute_packed_mrope_position_ids call their op first
    (on CPU and meta tensors alike) and explain only a failure."""
    calls = []

    def counted(name):
        original = getattr(positions, name)

        def counting(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        return counting

    for name in ("check_tensors", "explain_layout"):
        monkeypatch.setattr(positions, name, counted(name))
    grid = torch.tensor([[1, 2, 2]])
    for device in ("cpu", "meta"):
        ids = IDS.to(device)
        P.compute_mrope_position_ids(ids, convention="5.17")
        image = torch.tensor([[1, 9, 7, 4]], device=device)  # vision start, one image token
        P.compute_mrope_position_ids(image, grid.to(device), convention="4.57", image_token_id=7,
                                     video_token_id=8, vision_start_token_id=9)
        P.compute_packed_mrope_position_ids(ids, [[1, 3]], model="qwen2_vl", convention="5.17")
        P.compute_packed_mrope_position_ids(ids, torch.tensor([[1, 3]], device=device),
                                            model="qwen2_vl", convention="5.17")
    assert calls == []
    with pytest.raises(ValueError, match=r"seq_lens\[0\]\[1\]"):
        P.compute_packed_mrope_position_ids(IDS, [[3, 3]], model="qwen2_vl", convention="5.17")
    assert calls == ["check_tensors", "explain_layout"]


def test_fake_tensors_take_the_same_path(counted_checks):
    with FakeTensorMode():
        q, k = _qk()
        cos, sin = _tables()
        out_q, out_k = P.apply_rotary_pos_emb(q, k, cos, sin)
    assert out_q.shape == q.shape and counted_checks == []


# ------------------------------------------- private torch names: the plain fallback


@pytest.fixture
def plain_path():
    ops._choose_path(None)
    try:
        yield
    finally:
        ops._choose_path(ops.PRIVATE)


def _grads(fn, *tensors):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out_q, out_k = fn(*tensors)
    (out_q.square().sum() + (out_k * 3).sum()).backward()
    return (out_q.detach(), out_k.detach(), *(t.grad for t in tensors))


CALLS = {
    "rope": (lambda q, k, c, s: P.apply_rotary_pos_emb(q, k, c, s), lambda: (*_qk(), *_tables())),
    "mrope": (lambda q, k, c, s: P.apply_multimodal_rotary_pos_emb(q, k, c, s, [2, 3, 3]),
              lambda: (*_qk(), *_mrope_tables())),
    "fused": (lambda q, k: P.apply_rope(q, k, POS3, INV, mrope_section=[2, 3, 3],
                                        interleaved_mrope=True, attention_scaling=0.5),
              _qk),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_plain_path_gives_the_same_results_and_gradients(name, plain_path):
    assert ops.PRIVATE is not None, "this torch has the names: the fast path is the default"
    fn, make = CALLS[name]
    torch.manual_seed(0)
    inputs = make()
    plain = _grads(fn, *inputs)
    with torch.no_grad():
        plain_no_grad = fn(*inputs)
    ops._choose_path(ops.PRIVATE)
    fast = _grads(fn, *inputs)
    with torch.no_grad():
        fast_no_grad = fn(*inputs)
    for a, b in zip((*plain, *plain_no_grad), (*fast, *fast_no_grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_plain_path_serves_torch_func_and_rejects_forward_mode(plain_path):
    q, k = _qk()
    cos, sin = _tables()
    grad = torch.func.grad(lambda x: P.apply_rotary_pos_emb(x, k, cos, sin)[0].square().sum())
    ops._choose_path(ops.PRIVATE)
    want = grad(q)
    ops._choose_path(None)
    torch.testing.assert_close(grad(q), want, rtol=0, atol=0)
    with pytest.raises((NotImplementedError, RuntimeError), match="jvp|forward"):
        torch.func.jvp(lambda x: P.apply_rotary_pos_emb(x, k, cos, sin)[0], (q,), (q,))


@pytest.mark.parametrize("name", ["_AutoDispatchBelowAutograd",
                                  "_are_functorch_transforms_active"])
def test_lookup_finds_no_fast_path_without_a_name(monkeypatch, name):
    """A torch without one of the names gets the plain path (the lookup returns None)."""
    assert ops._lookup_private() is not None
    monkeypatch.delattr(torch._C, name)
    assert ops._lookup_private() is None


# ------------------------------------------------------------ fake kernels' strides


def _layouts():
    for (b, h, t, d), heads_first, kind in itertools.product(
            itertools.product((1, 2), (1, 3), (1, 4), (2, 8)), (True, False),
            ("projection", "contiguous", "slice")):
        if kind == "projection":  # transformers: view of (B, T, H * D), then transposed
            x = torch.randn(b, t, h * d).view(b, t, h, d)
        elif kind == "contiguous":
            x = torch.randn(b, t, h, d)
        else:  # a slice of a wider buffer (fused qkv)
            x = torch.randn(b, t, h, 2 * d)[..., :d]
        yield (x.transpose(1, 2) if heads_first else x), heads_first


def test_fake_strides_equal_the_real_kernel_strides():
    for x, heads_first in _layouts():
        t, d = x.shape[2 if heads_first else 1], x.shape[-1]
        cos = torch.randn(1, t, d)
        pos, inv = torch.zeros(1, t, dtype=torch.long), torch.rand(d // 2)
        real = (torch.ops.posenc.rope(x, x, cos, cos, [], False, 0, False, None, None,
                                      heads_first),
                torch.ops.posenc.rope_fused(x, x, pos, inv, [], False, 1.0, 0, False,
                                            heads_first))
        with FakeTensorMode() as mode:
            fx, fc, fp, fi = (mode.from_tensor(a) for a in (x, cos, pos, inv))
            fake = (torch.ops.posenc.rope(fx, fx, fc, fc, [], False, 0, False, None, None,
                                          heads_first),
                    torch.ops.posenc.rope_fused(fx, fx, fp, fi, [], False, 1.0, 0, False,
                                                heads_first))
        for r, f in zip(real, fake):
            assert r[0].stride() == f[0].stride(), (tuple(x.shape), x.stride(), heads_first)
            assert r[1].stride() == f[1].stride()


# -------------------------------------------------------------------------------- vmap


def test_vmap_of_the_rotations_equals_the_unbatched_calls():
    torch.manual_seed(0)
    qs, ks = torch.randn(3, 2, 4, 5, 16), torch.randn(3, 2, 2, 5, 16)
    cos, sin = torch.randn(3, 1, 5, 16), torch.randn(3, 1, 5, 16)
    cases = [
        (lambda q, k, c, s: P.apply_rotary_pos_emb(q, k, c, s), (qs, ks, cos, sin),
         (0, 0, 0, 0)),
        (lambda q, k, c, s: P.apply_rotary_pos_emb(q, k, c, s), (qs, ks, cos[0], sin[0]),
         (0, 0, None, None)),
        (lambda q, k, c, s: P.apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=2),
         (qs.transpose(2, 3), ks.transpose(2, 3), cos, sin), (0, 0, 0, 0)),
        (lambda q, k, c, s: P.apply_multimodal_rotary_pos_emb(q, k, c, s, [2, 3, 3]),
         (qs, ks, torch.randn(3, 2, 5, 16).expand(3, 3, 2, 5, 16).movedim(1, 0) + 0,
          torch.randn(3, 3, 2, 5, 16)), (0, 0, 0, 0)),
        (lambda q, k, p: P.apply_rope(q, k, p, INV, mrope_section=[2, 3, 3]),
         (qs, ks, torch.randint(0, 50, (3, 3, 1, 5))), (0, 0, 0)),
        (lambda q, k, p: P.apply_rope(q, k, p, INV), (qs, ks, POS[:1]), (0, 0, None)),
        (lambda q, k, i: P.apply_rope(q, k, POS, i), (qs, ks, torch.rand(3, 8)), (0, 0, 0)),
    ]
    for fn, args, in_dims in cases:
        batched = torch.vmap(fn, in_dims=in_dims)(*args)
        for i in range(3):
            one = fn(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims)))
            for b, o in zip(batched, one):
                torch.testing.assert_close(b[i], o, rtol=0, atol=0)


def test_vmap_of_tables_and_gradients():
    torch.manual_seed(0)
    pos, inv = torch.randint(0, 50, (4, 3, 2, 5)), torch.rand(8)
    cos, sin = torch.vmap(lambda p: P.compute_mrope_cos_sin(p, inv, [2, 3, 3],
                                                            interleaved=True))(pos)
    for i in range(4):
        want = P.compute_mrope_cos_sin(pos[i], inv, [2, 3, 3], interleaved=True)
        assert torch.equal(cos[i], want[0]) and torch.equal(sin[i], want[1])

    q = torch.randn(3, 2, 4, 5, 16)
    c, s = torch.randn(2, 5, 16), torch.randn(2, 5, 16)

    def loss(x, c=c):
        return P.apply_rotary_pos_emb(x, x, c, s)[0].square().sum()

    per_sample = torch.vmap(torch.func.grad(loss))(q)
    for i in range(3):
        torch.testing.assert_close(per_sample[i], torch.func.grad(loss)(q[i]), rtol=0, atol=0)
    # the table gradient through a vmapped call (the vmapped rows are summed in another order)
    c.requires_grad_(True)
    batched = torch.autograd.grad(torch.vmap(lambda x: loss(x, c))(q).sum(), c)[0]
    looped = torch.autograd.grad(sum(loss(q[i], c) for i in range(3)), c)[0]
    torch.testing.assert_close(batched, looped)


def test_vmap_of_the_raw_op():
    qs, ks = torch.randn(3, 2, 5, 4, 16), torch.randn(3, 2, 5, 2, 16)
    cos = torch.randn(2, 5, 16)
    out = torch.vmap(lambda q, k: torch.ops.posenc.rope(q, k, cos, cos, [], False, 0, False))(
        qs, ks)
    for i in range(3):
        ref = torch.ops.posenc.rope(qs[i], ks[i], cos, cos, [], False, 0, False)
        torch.testing.assert_close(out[0][i], ref[0], rtol=0, atol=0)
        torch.testing.assert_close(out[1][i], ref[1], rtol=0, atol=0)


def test_vmap_over_a_patched_model():
    """torch.vmap over a patched transformers attention layer gives the unbatched layer's
    outputs.  The patch hands functorch transforms to transformers' own function (counted as
    a fallback); the ops' own vmap rules are tested above."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    from posenc_torch import hf

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, num_hidden_layers=1, vocab_size=32)
    config._attn_implementation = "eager"
    attention = modeling_llama.LlamaAttention(config, layer_idx=0).eval()
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    x = torch.randn(3, 1, 6, 64)
    positions = torch.arange(6)[None]
    with torch.no_grad():
        cos, sin = rotary(x[0], positions)
        handle = hf.patch("llama")
        try:
            def layer(h):
                return attention(h, position_embeddings=(cos, sin), attention_mask=None)[0]
            batched = torch.vmap(layer)(x)
            handed_back = int(handle.fallbacks["llama.apply_rotary_pos_emb"])
            unbatched = torch.stack([layer(x[i]) for i in range(3)])
        finally:
            handle.undo()
        reference = torch.stack([layer(x[i]) for i in range(3)])  # transformers' own
    assert handed_back >= 1
    torch.testing.assert_close(batched, unbatched, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(batched, reference, rtol=1e-5, atol=1e-5)
