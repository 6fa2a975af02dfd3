"""Position ids for multimodal RoPE: decoder ids (transformers' ``get_rope_index``) and the
ids of decoding steps.  Integer outputs, no gradients.  (The vision tower's patch ids are in
``posenc_torch.vision``; ``vision_rotary_position_ids`` is still importable from here.)

transformers changed ``get_rope_index`` between releases, so the decoder ids follow a
*convention* named after the release whose rules it reproduces (see
:data:`MROPE_CONVENTIONS`); ``convention="installed"`` picks the one of the installed
transformers.  How a convention is resolved is in ``posenc_torch._conventions``; how the
layout of packed rows is read, in ``posenc_torch._packed_layout``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, TypedDict, Unpack

import torch

from ._checks import (
    INT64_MAX,
    InputTypeError,
    InputValueError,
    allocation_error,
    check_int,
    check_real,
    check_tensor,
    check_tensors,
    explain,
    op_error,
)
from ._conventions import (  # noqa: F401  (MROPE_CONVENTIONS, convention_for_version: public here)
    MROPE_CONVENTIONS,
    convention_for_version,
    convention_record,
    model_record,
    resolve_convention,
)
from ._packed_layout import PackedLayout, explain_layout, packed_layout
from ._tables import TIME_F32, TIME_F64_INTERVAL, TIME_TRUNC_SECONDS, Convention

#: ``vision_config.tokens_per_second`` of the released Qwen2.5-VL checkpoints (3B, 7B, 32B,
#: 72B).  The config class default is 4 and some docstrings say 25; pass the value of your
#: checkpoint's config when it differs.
QWEN2_5_VL_TOKENS_PER_SECOND = 2

_is_compiling = torch.compiler.is_compiling


class MropeOptions(TypedDict, total=False):
    """The keyword arguments that :func:`compute_mrope_position_ids` and
    :func:`compute_packed_mrope_position_ids` share (one definition for both, taken as
    ``**options``; the defaults are :data:`MROPE_OPTION_DEFAULTS`; an unknown keyword is a
    TypeError).

    model: the model type, "qwen2_vl", "qwen2_5_vl", "qwen3_vl" or "qwen3_vl_moe"
        (``config.model_type``; the last two share one rule).
    convention: "installed" or one of :data:`MROPE_CONVENTIONS` (see
        :func:`compute_mrope_position_ids`).
    mm_token_type_ids: (B, L) integer, 0 text, 1 image, 2 video, as the transformers 5.x
        processors return it (5.x conventions only; when None it is derived from
        ``image_token_id`` / ``video_token_id`` as the processors derive it).
    image_token_id, video_token_id, vision_start_token_id: the config's token ids (ints;
        the "4.57" convention finds vision runs from them).
    spatial_merge_size: ``vision_config.spatial_merge_size`` (an int >= 1).
    second_per_grid_ts: (n_videos,) seconds per temporal grid step (Qwen2.5-VL only;
        ``temporal_patch_size / fps`` from the processor), a tensor or a sequence of real
        numbers; a sequence is taken as float32 under "5.18" (the processor's tensor), as
        float64 (exactly) under the others.
    tokens_per_second: ``vision_config.tokens_per_second`` (Qwen2.5-VL only; a real number,
        default :data:`QWEN2_5_VL_TOKENS_PER_SECOND`).
    """

    model: str
    convention: str
    mm_token_type_ids: torch.Tensor | None
    image_token_id: int | None
    video_token_id: int | None
    vision_start_token_id: int | None
    spatial_merge_size: int
    second_per_grid_ts: torch.Tensor | Sequence[float] | None
    tokens_per_second: float | None


#: The defaults of :class:`MropeOptions` (``model`` has none for packed rows).
MROPE_OPTION_DEFAULTS: dict[str, object] = {
    "model": "qwen2_vl", "convention": "installed", "mm_token_type_ids": None,
    "image_token_id": None, "video_token_id": None, "vision_start_token_id": None,
    "spatial_merge_size": 2, "second_per_grid_ts": None, "tokens_per_second": None}


def token_type_ids(input_ids: torch.Tensor, image_token_id: int,
                   video_token_id: int) -> torch.Tensor:
    """``mm_token_type_ids`` as the transformers 5.x processors build it from the token ids
    (``create_mm_token_type_ids``): 1 on ``image_token_id``, 2 on ``video_token_id``, 0
    elsewhere.  input_ids: any shape, integer; returns int64 of the same shape."""
    return ((input_ids == image_token_id).long() + 2 * (input_ids == video_token_id).long())


class _Walk(NamedTuple):
    """The options of a position walk, converted for its ops."""

    second_per_grid_ts: torch.Tensor | None
    op_args: tuple  # model .. time_rule, as the ops list them after second_per_grid_ts
    mm_token_type_ids: torch.Tensor | None  # as given (None when derived or not read)


def _walk_options(function: str, options: dict[str, object], input_ids: object,
                  has_grids: bool, *required: str) -> _Walk:
    """Checks what only Python sees of :class:`MropeOptions` (names, types, int64 ranges,
    what a convention needs) and converts it for the ops; the ops check the rest."""
    unknown = options.keys() - MROPE_OPTION_DEFAULTS.keys()
    if unknown:
        raise InputTypeError(
            f"{function}() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    missing = [name for name in required if name not in options]
    if missing:
        raise InputTypeError(f"{function}() missing required keyword argument {missing[0]!r}")
    opt = {**MROPE_OPTION_DEFAULTS, **options}
    model_type = model_record(opt["model"])
    convention = convention_record(opt["convention"], opt["model"])
    ids = {name: opt[name] for name in ("image_token_id", "video_token_id",
                                        "vision_start_token_id")}
    for name, value in ids.items():
        if value is not None:
            check_int(name, value)
    merge = check_int("spatial_merge_size", opt["spatial_merge_size"])
    given_types = types = opt["mm_token_type_ids"] if convention.v5 else None
    if convention.v5:
        if types is None and has_grids:
            missing = [n for n in ("image_token_id", "video_token_id") if ids[n] is None]
            if missing:
                raise InputTypeError(
                    f"convention {convention.name!r} finds vision runs from "
                    "mm_token_type_ids (0 text, 1 image, 2 video, from the "
                    f"processor): pass it, or {' and '.join(missing)} to derive it")
            if isinstance(input_ids, torch.Tensor):  # else the op names input_ids
                types = token_type_ids(input_ids, ids["image_token_id"], ids["video_token_id"])
        token_ids = (0, 1, 2)  # not read by the 5.x walk
    else:
        missing = [name for name, value in ids.items() if value is None]
        if missing:
            raise InputTypeError(
                f"convention {convention.name!r} finds vision runs from token ids: "
                f"pass {', '.join(missing)}")
        token_ids = tuple(ids.values())

    seconds, tps, time_rule = opt["second_per_grid_ts"], opt["tokens_per_second"], 0
    if seconds is not None and not isinstance(seconds, torch.Tensor):
        seconds = _seconds_tensor(seconds, input_ids, convention)
    if model_type.reads_seconds:
        tps = check_real("tokens_per_second",
                         QWEN2_5_VL_TOKENS_PER_SECOND if tps is None else tps)
        if convention.integral_tokens_per_second and math.isfinite(tps) and tps != int(tps):
            raise InputValueError(f"tokens_per_second must be integral under convention "
                                  f"{convention.name!r} (its temporal step is tokens_per_second * "
                                  f"int(s)), got {tps}")
        time_rule = TIME_TRUNC_SECONDS
        if convention.fractional_seconds:
            dtype = None if seconds is None else seconds.dtype
            if dtype in (torch.float16, torch.bfloat16):
                raise InputTypeError("second_per_grid_ts must be float32, float64 or integer under "
                                     f"convention {convention.name!r}, got {dtype}")
            time_rule = TIME_F64_INTERVAL if dtype == torch.float64 else TIME_F32
    else:
        if tps is not None:
            raise InputValueError(f"tokens_per_second applies only to model='qwen2_5_vl', "
                                  f"got model={opt['model']!r}")
        tps = 0.0
    return _Walk(seconds, (model_type.mrope, *token_ids, merge, tps, types, convention.rules,
                           time_rule), given_types)


def _seconds_tensor(seconds: object, input_ids: object, convention: Convention) -> torch.Tensor:
    """A sequence of seconds as the tensor the processor gives (float32 under 5.18 and
    later), or exactly (float64) under the conventions that truncate them."""
    if isinstance(seconds, (str, bytes)) or not isinstance(seconds, Sequence):
        raise InputTypeError("second_per_grid_ts must be a tensor or a sequence of real numbers, "
                             f"got {type(seconds).__name__}")
    values = [check_real(f"second_per_grid_ts[{i}]", s) for i, s in enumerate(seconds)]
    device = input_ids.device if isinstance(input_ids, torch.Tensor) else None
    dtype = torch.float32 if convention.fractional_seconds else torch.float64
    return torch.tensor(values, dtype=dtype, device=device)


def compute_mrope_position_ids(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **options: Unpack[MropeOptions],
) -> tuple[torch.Tensor, torch.Tensor]:
    """3-D (T, H, W) position ids of a multimodal prompt, bit for bit as transformers'
    ``get_rope_index`` of Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE (``model`` =
    ``model_type``; the last two share one rule) computes them under ``convention``.

    Shapes:
        input_ids:          (B, L) integer token ids
        image_grid_thw:     (n_images, 3) patch grids (t, h, w) *before* merging, in the
                            order the images appear in the batch (row 0 first)
        video_grid_thw:     (n_videos, 3), likewise
        attention_mask:     (B, L) of 0/1 (bool, integer or floating); 0 marks padding,
                            left or right
    Keywords (:class:`MropeOptions`; defaults ``model="qwen2_vl"``,
    ``convention="installed"``, ``spatial_merge_size=2``, the rest None):
        mm_token_type_ids:  (B, L) integer, 0 text, 1 image, 2 video (5.x conventions)
        second_per_grid_ts: (n_videos,) seconds per temporal grid step (Qwen2.5-VL)
        model, convention, image_token_id, video_token_id, vision_start_token_id,
        spatial_merge_size, tokens_per_second: as :class:`MropeOptions` says
    Returns ``(position_ids, mrope_position_deltas)``: (3, B, L) int64 and (B, 1) int64.

    ``convention`` is ``"installed"`` (the default: the rules of the transformers release
    that ``import transformers`` finds; ValueError when it is not installed or its rules
    are none of the conventions) or one of :data:`MROPE_CONVENTIONS`:
    ``"4.57"`` (4.57.6 checked), ``"5.17"`` (5.17.0), ``"5.18"`` (5.18.0 and 5.25.0).  Per row,
    over the unmasked tokens, with m = ``spatial_merge_size``:

    - An image (video) is a run of ``t * (h/m) * (w/m)`` tokens: under ``"4.57"``
      ``image_token_id`` (``video_token_id``) tokens right after a
      ``vision_start_token_id``; under 5.x a run of ``mm_token_type_ids`` 1 (2).  It gets
      positions ``start + (tidx(ti), hi, wi)`` on its LLM grid; text gets one position per
      token on all three rows.
    - After an image, text resumes at its largest position + 1 (``"4.57"``) or at
      ``start + max(h, w) // m`` (5.x, which ignores the frames of a video).
    - Padded slots hold 1 (``"4.57"``) or 0 (5.x).  ``mrope_position_deltas[b]`` is
      ``max + 1 - L`` (``"4.57"``, L the padded length) or ``max + 1 - (real tokens)``
      (5.x); :func:`compute_mrope_decode_position_ids` turns it into the ids of later
      tokens.
    - Temporal index ``tidx``: the frame index ``ti``, except for ``"qwen2_5_vl"``:
      images 0 under ``"4.57"``; videos ``ti * int(s) * tokens_per_second`` under
      ``"4.57"`` and ``"5.17"`` (the fraction of s is dropped: 0.5 s per grid puts every
      frame at one index), ``long(ti * (tokens_per_second * s))`` in float32 (float64 when
      ``second_per_grid_ts`` is float64) under ``"5.18"``; s = 1 when
      ``second_per_grid_ts`` is None.  ``tokens_per_second`` defaults to
      ``QWEN2_5_VL_TOKENS_PER_SECOND`` = 2, the value in the released checkpoints'
      ``vision_config``; ``"5.17"`` needs it integral (transformers 5.17 fails otherwise).
    - ``"qwen3_vl"``: each video grid (t, h, w) is t frames of (1, h, w), each its own run
      (the processor puts a timestamp and vision start/end around every frame), so video
      frames get no temporal offset.

    Arguments a convention does not read may be passed and are ignored, so that one call
    serves every release: ``mm_token_type_ids`` under ``"4.57"``, the token ids under 5.x
    when ``mm_token_type_ids`` is given (they are required under ``"4.57"``, and under 5.x
    with grids but no ``mm_token_type_ids``: a ``TypeError`` names the missing ones either
    way).  Without grids (both None) every row gets text positions as transformers does; a
    row that nevertheless holds a vision run is an error.  Grids that disagree with the
    tokens raise ``ValueError`` naming ``image_grid_thw`` / ``video_grid_thw``: too few or
    too many grids, a run shorter or longer than its grid, a placeholder without vision
    start (``"4.57"``), h or w not divisible by ``spatial_merge_size``, or values <= 0.
    The op validates the tensors (csrc/torch/positions.cpp); this function checks what only
    Python sees and explains an op's failure in its own arguments' names.
    """
    walk = _walk_options("compute_mrope_position_ids", options, input_ids,
                         image_grid_thw is not None or video_grid_thw is not None)
    named = dict(input_ids=input_ids, image_grid_thw=image_grid_thw,
                 video_grid_thw=video_grid_thw, attention_mask=attention_mask,
                 second_per_grid_ts=walk.second_per_grid_ts,
                 mm_token_type_ids=walk.mm_token_type_ids)
    if _is_compiling():
        _check_walk_tensors(named)
    try:
        return torch.ops.posenc.mrope_position_ids(
            input_ids, image_grid_thw, video_grid_thw, attention_mask, walk.second_per_grid_ts,
            *walk.op_args)
    except Exception as err:
        raise explain(err, _check_walk_tensors, named) from None


def _check_walk_tensors(named: dict[str, object]) -> None:
    """What a position walk's op cannot say in the caller's terms: ``input_ids`` (always
    given) and the optional tensors are tensors, on one device."""
    if not isinstance(named["input_ids"], torch.Tensor):
        raise InputTypeError("input_ids must be a torch.Tensor, got "
                             f"{type(named['input_ids']).__name__}")
    check_tensors(**named)


def compute_mrope_decode_position_ids(
    mrope_position_deltas: torch.Tensor,
    past_length: int | torch.Tensor,
    num_new_tokens: int = 1,
    *,
    batch_size: int | None = None,
    attention_mask: torch.Tensor | None = None,
    convention: str = "installed",
    prompt_position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position ids (3, B, n) of the tokens after a multimodal prompt, from its deltas.

    Shapes:
        mrope_position_deltas: (B, 1) or (B,) integer — the second output of
            :func:`compute_mrope_position_ids` (or transformers' ``rope_deltas``)
        past_length: number of tokens already in the KV cache (the prompt's padded length,
            then one more per step), as an int, a 0-d tensor, or transformers'
            ``cache_position`` (1-D; its first entry is used)
        num_new_tokens: n, the tokens of this step (1 for plain decoding)
        attention_mask: (B', past_length + n) of 0/1 over the cache and the new tokens
            (5.x conventions; ignored under ``"4.57"``)
        prompt_position_ids: (3, B', L) or transformers 5.x's (4, B', L) — the prompt's
            position ids; when given, the result is what ``generate`` gives (below) and
            the deltas are not read
    Returns int64 ids (3, B', n), equal on the three rows (without ``prompt_position_ids``):
    what the Qwen-VL model's
    ``forward`` computes from its stored ``rope_deltas`` when it is given no position ids
    (transformers 4.57.6, 5.17.0, 5.18.0 and 5.25.0 checked):

    - ``"4.57"``, and 5.x without ``attention_mask``:
      ``ids[:, b, i] = past_length + i + deltas[b]``;
    - 5.x with ``attention_mask``: ``ids[:, b, i] = c[b, past_length + i] + deltas[b]``,
      c = ``cumsum(attention_mask) - 1`` with masked slots 0 — the count of real tokens
      before the new one, which 5.x's deltas (``max + 1 - real tokens``) are relative to.
      (With 5.x deltas and a padded prompt, ``past_length + deltas`` is off by the padding.)

    The convention is resolved only when ``attention_mask`` is given (the rules agree
    otherwise), so this needs transformers only then, and only for ``"installed"``.
    transformers 5.x's ``generate`` instead continues every row of the prompt's position ids
    from its last slot: ``ids[r, b, i] = prompt_position_ids[r, b, -1] + 1 + (past_length -
    L) + i`` (checked 5.17.0, 5.18.0, 5.25.0; 4.57's ``generate`` uses the deltas as above).
    That equals the deltas' result whenever the prompt's last real token holds its largest
    position, e.g. a prompt that ends in text after images, and not after a 5.x video whose
    temporal positions outrun ``max(h, w) // merge`` (the text then resumes below them);
    pass ``prompt_position_ids`` for generate's positions.
    ``batch_size`` B' (a multiple of B) repeats every row's delta B'/B times, for beam search
    or several samples per prompt; default B (or the mask's rows).
    A negative ``past_length`` and ids past int64 are ``ValueError``s; in eager mode a tensor
    ``past_length`` and the deltas are read for that check (a sync for CUDA tensors).
    """
    check_tensor("mrope_position_deltas", mrope_position_deltas, (1, 2), "(batch, 1) or (batch,)")
    _check_integer("mrope_position_deltas", mrope_position_deltas)
    if mrope_position_deltas.dim() == 2 and mrope_position_deltas.shape[1] != 1:
        raise InputValueError(f"mrope_position_deltas must be (batch, 1) or (batch,), got shape "
                              f"{tuple(mrope_position_deltas.shape)}")
    check_int("num_new_tokens", num_new_tokens, 0)
    deltas = mrope_position_deltas.reshape(-1, 1).long()
    use_mask = attention_mask is not None and convention_record(convention).v5
    if attention_mask is None and convention != "installed":
        convention_record(convention)  # checked also where the rules agree
    if batch_size is None and use_mask:
        batch_size = attention_mask.shape[0] if isinstance(attention_mask, torch.Tensor) else None
    if batch_size is not None:
        check_int("batch_size", batch_size, 1)
        if batch_size % deltas.shape[0]:
            raise InputValueError(f"batch_size {batch_size} must be a multiple of the "
                                  f"{deltas.shape[0]} rows of mrope_position_deltas")
        deltas = deltas.repeat_interleave(batch_size // deltas.shape[0], dim=0)
    if isinstance(past_length, torch.Tensor):
        if not _is_integer(past_length):
            raise InputTypeError(f"past_length must be an int or an integer tensor, got "
                                 f"{past_length.dtype}")
        if past_length.dim() > 1 or past_length.numel() == 0:
            raise InputValueError("past_length as a tensor must be 0-d, or 1-D cache_position "
                                  f"with at least one entry, got shape {tuple(past_length.shape)}")
        _check_movable("past_length", past_length, mrope_position_deltas)
        start = past_length.reshape(-1)[:1].to(device=deltas.device, dtype=torch.int64)
        # a sync for CUDA cache_position; meta values are unknown, as while tracing
        first = None if _is_compiling() or start.is_meta else int(start)
        if first is not None and first < 0:
            raise InputValueError(f"past_length must be >= 0, got {first}")
    else:
        start = first = check_int("past_length", past_length, 0)
    if prompt_position_ids is not None:
        check_tensor("prompt_position_ids", prompt_position_ids, 3, "(3 or 4, batch, seq)")
        _check_integer("prompt_position_ids", prompt_position_ids)
        _check_movable("prompt_position_ids", prompt_position_ids, mrope_position_deltas)
        if prompt_position_ids.shape[0] not in (3, 4) or prompt_position_ids.shape[2] == 0:
            raise InputValueError(
                f"prompt_position_ids must be (3 or 4, batch, seq >= 1), got shape "
                f"{tuple(prompt_position_ids.shape)}")
        if prompt_position_ids.shape[1] != deltas.shape[0]:
            raise InputValueError(f"prompt_position_ids has {prompt_position_ids.shape[1]} rows, "
                                  f"mrope_position_deltas {deltas.shape[0]} (after batch_size)")
        last = prompt_position_ids[-3:, :, -1:].to(device=deltas.device, dtype=torch.int64)
        _check_no_overflow(first, num_new_tokens, last, 1 - prompt_position_ids.shape[2])
        try:
            steps = torch.arange(num_new_tokens, device=deltas.device, dtype=torch.int64)
            return last + 1 + (start - prompt_position_ids.shape[2]) + steps
        except RuntimeError as err:
            raise _decode_allocation_error(err, deltas.shape[0], num_new_tokens) from err
    if use_mask:
        check_tensor("attention_mask", attention_mask, 2, "2-D (batch, past_length + n)")
        if attention_mask.is_complex():
            raise InputTypeError(f"attention_mask must be bool, integer or floating, got "
                                 f"{attention_mask.dtype}")
        _check_movable("attention_mask", attention_mask, mrope_position_deltas)
        if attention_mask.shape[0] != deltas.shape[0]:
            raise InputValueError(f"attention_mask has {attention_mask.shape[0]} rows, "
                                  f"mrope_position_deltas {deltas.shape[0]} (after batch_size)")
        if isinstance(start, int) and attention_mask.shape[1] != start + num_new_tokens:
            raise InputValueError(f"attention_mask must cover past_length + num_new_tokens = "
                                  f"{start + num_new_tokens} tokens, got {attention_mask.shape[1]}")
        mask = attention_mask.to(deltas.device)
        counted = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        _check_no_overflow(0, counted.shape[1], deltas, 0)
        ids = counted[:, counted.shape[1] - num_new_tokens:] + deltas
    else:
        _check_no_overflow(first, num_new_tokens, deltas, 0)
        try:
            steps = torch.arange(num_new_tokens, device=deltas.device, dtype=torch.int64)
            ids = steps.unsqueeze(0) + start + deltas
        except RuntimeError as err:
            raise _decode_allocation_error(err, deltas.shape[0], num_new_tokens) from err
    try:
        return ids.unsqueeze(0).repeat(3, 1, 1)
    except RuntimeError as err:
        raise _decode_allocation_error(err, deltas.shape[0], num_new_tokens) from err


def _decode_allocation_error(err: RuntimeError, batch: int, num_new_tokens: int) -> RuntimeError:
    return allocation_error(err, f"the (3, {batch}, num_new_tokens) position ids of "
                                 f"num_new_tokens = {num_new_tokens}")


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _check_integer(name: str, t: torch.Tensor) -> None:
    if not _is_integer(t):
        raise InputTypeError(f"{name} must be an integer tensor, got {t.dtype}")


def _check_movable(name: str, t: torch.Tensor, deltas: torch.Tensor) -> None:
    """Decoding moves its other tensors to the deltas' device; a meta tensor has no values
    to move (and no values to move into)."""
    if t.device != deltas.device and "meta" in (t.device.type, deltas.device.type):
        raise InputValueError(f"{name} is on {t.device} but mrope_position_deltas is on "
                              f"{deltas.device}; meta tensors cannot be mixed with others")


def _check_no_overflow(past_length: int | None, num_new_tokens: int, offsets: torch.Tensor,
                       shift: int) -> None:
    """The largest id, past_length + num_new_tokens - 1 + max(offsets) + shift, computed in
    Python ints, must fit in int64 (the ids are int64: they would wrap around).  Eager only:
    the values are not known while tracing (past_length is None then) or on meta tensors."""
    if past_length is None or _is_compiling() or offsets.is_meta:
        return
    largest = past_length + num_new_tokens - 1 + shift + (
        int(offsets.max()) if offsets.numel() else 0)
    if largest > INT64_MAX:
        raise InputValueError(
            f"past_length {past_length} + num_new_tokens {num_new_tokens} and the "
            f"position offsets give ids up to {largest}, past int64 (2^63 - 1)")


# ---------------------------------------------------------------------------------------
# Packed rows (padding-free batches).


def compute_packed_mrope_position_ids(
    input_ids: torch.Tensor,
    seq_lens: torch.Tensor | Sequence[Sequence[int]] | Sequence[int] | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | Sequence[Sequence[int]] | Sequence[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    **options: Unpack[MropeOptions],
) -> torch.Tensor:
    """Position ids of packed rows (padding-free batches): several examples laid end to end
    in each row, every one given the ids it would get alone, in the (4, B, L) layout that
    transformers' Qwen-VL models take for packed rows.

    Shapes:
        input_ids:          (B, L) integer token ids; row b holds its examples one after
                            the other from token 0, then (optionally) padding
        seq_lens:           the example lengths of each row: a list of B lists of ints, or
                            a (B, n) integer tensor (every row n examples; 0 is a valid
                            length); for B = 1 also a flat list or a 1-D tensor
        cu_seqlens:         instead of seq_lens, cumulative lengths per row as
                            flash-attention's varlen functions take them, ``[0, l0, l0 + l1,
                            ...]``: for B = 1 a 1-D tensor or list (n + 1,); for B > 1 one
                            such list per row (a list of lists, or a (B, n + 1) tensor).
                            Each row starts at 0 (a row's offsets, not offsets into the
                            flattened batch); its last value may be below L (padding follows)
        attention_mask:     instead of seq_lens, (B, L) integer example numbers as
                            LLaMA-Factory's packed collator makes them: 1, 2, 3, ... for the
                            examples of a row in order, 0 for padding after the last one
        image_grid_thw:     (n_images, 3) patch grids (t, h, w) before merging, in example
                            order across the batch (row 0's examples first, left to right)
        video_grid_thw:     (n_videos, 3), likewise
    Keywords (:class:`MropeOptions`; ``model`` is required here): ``mm_token_type_ids``
    (B, L), ``second_per_grid_ts`` (n_videos,) in example order, and the others, mean what
    they mean for :func:`compute_mrope_position_ids`, and the convention is resolved the
    same way (:func:`resolve_convention`).
    Exactly one of ``seq_lens``, ``cu_seqlens`` and ``attention_mask`` (else TypeError).
    Returns int64 (4, B, L).  For token k (0-based) of an example:

    - row 0: k, the text positions restarting at 0 in every example;
    - rows 1-3: the T, H, W ids that transformers' ``get_rope_index`` of ``model`` gives for
      that example alone (one row of its tokens, no padding, its own grids) under
      ``convention``, bit for bit; i.e. what :func:`compute_mrope_position_ids` gives for it.

    Padding: the P tokens after a row's last example get 0, 1, ..., P-1 on all four rows,
    i.e. they form one more (text-only) sequence and never join an example.  That is what
    transformers needs to keep them apart: for eager and sdpa attention it splits a packed
    row where row 0 does not grow by exactly 1 (``find_packed_sequence_indices`` in
    ``masking_utils``, 4.57 and 5.x; the padding's 0 follows an example's last position, which
    is >= 0), and for flash-attention it starts a sequence wherever row 0 holds its minimum,
    0 (``prepare_fa_kwargs_from_position_ids``; transformers reads packed boundaries from
    position ids there only for B = 1: for B > 1 pass ``cu_seq_lens_q/k`` and
    ``max_length_q/k``, as :func:`posenc_torch.packing.pack_multimodal_examples` does).  Both
    block-diagonal forms need no attention mask: pass none to the model (and no cache:
    transformers builds the packed mask only when ``past_key_values`` is empty).

    The whole batch is one call into the C walk, its examples spread over threads.  Under
    ``torch.compile(fullgraph=True)`` the forms whose layout is known without reading a
    tensor trace: ``seq_lens`` and ``cu_seqlens`` as lists of ints (constants of the graph)
    and ``seq_lens`` as a tensor; a ``cu_seqlens`` tensor and a packed ``attention_mask``
    are read (their layout is checked) and break the graph.

    Bad input raises ``ValueError`` naming the argument and the example (numbered from 0
    across the batch, row 0's first): a negative length, examples longer than their row,
    cumulative lengths that decrease or do not start at 0, a mask whose example numbers do
    not run 1, 2, 3, ... with padding only at the end; a grid that does not fit its example
    (grids running out at an example, grids left over, a run longer or shorter than its
    grid, a placeholder outside every vision run), and a vision run cut by an example
    boundary; every error of :func:`compute_mrope_position_ids` besides.  ``TypeError`` for
    wrong types or dtypes (a float length, a float mask, ...).  Examples of length 1 and
    text-only examples are valid; so is a row with no example (all padding).
    """
    walk = _walk_options("compute_packed_mrope_position_ids", options, input_ids,
                         image_grid_thw is not None or video_grid_thw is not None, "model")
    layout = packed_layout(input_ids, seq_lens, cu_seqlens, attention_mask)
    named = dict(input_ids=input_ids, seq_lens=seq_lens if isinstance(seq_lens, torch.Tensor)
                 else None, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                 second_per_grid_ts=walk.second_per_grid_ts,
                 mm_token_type_ids=walk.mm_token_type_ids)

    def explain_failure() -> None:
        check_tensors(**named)
        if attention_mask is None:
            explain_layout(input_ids, seq_lens, cu_seqlens)

    if _is_compiling():
        check_tensors(**named)
    try:
        return torch.ops.posenc.mrope_packed_position_ids(
            input_ids, layout.example_lens, layout.row_examples, image_grid_thw,
            video_grid_thw, walk.second_per_grid_ts, *walk.op_args)
    except Exception as err:
        raise explain(err, explain_failure) from None


def _packed_for_examples(
    input_ids: torch.Tensor, layout: PackedLayout, example_ids: torch.Tensor,
    example_grids: torch.Tensor, image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None, **options: Unpack[MropeOptions],
) -> torch.Tensor:
    """The packed op for a caller that numbers its own examples (posenc_torch.packing):
    ``example_ids`` (N,) the caller's index of each example in op order, ``example_grids``
    (N, 2) the image and video grids each example owns.  The op's errors then name
    ``examples[i]`` and speak of the example alone (its tokens and grids numbered from 0),
    as :func:`compute_mrope_position_ids` on that example would."""
    walk = _walk_options("_packed_for_examples", options, input_ids,
                         image_grid_thw is not None or video_grid_thw is not None, "model")
    try:
        return torch.ops.posenc.mrope_packed_position_ids(
            input_ids, layout.example_lens, layout.row_examples, image_grid_thw,
            video_grid_thw, walk.second_per_grid_ts, *walk.op_args, example_ids, example_grids)
    except Exception as err:
        raise op_error(err) from None


from .vision import vision_rotary_position_ids  # noqa: E402, F401  (its former home)
