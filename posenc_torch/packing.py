"""Packed (padding-free) batches for Qwen-VL training.

A padded batch spends the padded share of every matrix product on nothing.  Packing lays
the examples end to end in a few rows instead; the Qwen-VL models of transformers (4.57 and
5.x: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) keep the examples apart when they get
``position_ids`` of shape (4, rows, L): row 0 holds the text positions, restarting at 0 for
every example (from which the model builds a block-diagonal causal mask for eager and
sdpa attention, and the varlen boundaries for flash-attention), rows 1-3 the temporal,
height and width MRoPE ids of each example as its ``get_rope_index`` gives them alone.

:func:`pack_multimodal_examples` builds such a batch from examples as a Qwen-VL processor
returns them one by one; :class:`MultimodalPackingCollator` is the same as a
``data_collator`` for ``transformers.Trainer`` and TRL's ``SFTTrainer``.

The batch carries ``use_cache=False``: transformers builds the block-diagonal mask only
when no cache is passed, and a forward with the models' default ``use_cache=True`` creates
one first and then lets every token attend across the example boundaries of its row.  A
batch of several rows also carries ``cu_seq_lens_q/k`` and ``max_length_q/k``:
transformers reads the flash-attention boundaries from the position ids only for a batch of
one row.  :func:`packed_attention_leaks` names the calls that would still let the examples
attend to each other (a cache, an attention mask, several rows under flash-attention without
the boundaries), for a caller that sees the model's arguments.

Where the parts live: the examples are read and checked in ``posenc_torch._examples``, the
attention-leak guard is ``posenc_torch._attention_leaks`` (its two functions are re-exported
here); this module places the examples in rows (:func:`first_fit`) and builds the batches.

Both kinds of batch (packed, and padded by :func:`pad_multimodal_examples` /
:class:`MultimodalPaddingCollator` for training without packing) carry, by default, the
vision tower's precomputed keyword arguments (``image_position_ids``, ``image_cu_seqlens``,
Qwen2.5-VL's ``image_window_index``, Qwen3-VL's ``image_interp_indices`` / ``_weights``,
and the ``video_`` twins) that the installed transformers accepts for the model, computed
by posenc's C walks (``posenc_torch.hf.precompute_vision_kwargs``, asked through
``posenc_torch._installed``): the tower then recomputes nothing from the grids.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence

import torch

from . import _installed
from ._attention_leaks import packed_attention_leaks, warn_packed_attention_leaks
from ._checks import (
    INT64_MAX,
    InputTypeError,
    InputValueError,
    allocation_error,
    check_bool,
    check_str,
)
from ._examples import (  # noqa: F401  (IGNORE_INDEX: public here)
    IGNORE_INDEX,
    VISION_KEYS,
    Example,
    ModelSettings,
    as_tensor,
    check_count,
    model_settings,
    read_examples,
    token_types,
)
from ._packed_layout import PackedLayout
from ._tables import MROPE_MODELS
from .positions import MropeOptions, _packed_for_examples, resolve_convention  # noqa: F401

__all__ = ["pack_multimodal_examples", "MultimodalPackingCollator", "pad_multimodal_examples",
           "MultimodalPaddingCollator", "first_fit", "packed_attention_leaks",
           "warn_packed_attention_leaks"]


def first_fit(lengths: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """Rows of example indices: each example, in order, goes into the first row whose
    examples leave room for it (at most ``max_tokens`` tokens a row); all in one row when
    ``max_tokens`` is None.  The batch lays the examples of row 0 first, then row 1, ...

    ``lengths``: a sequence of ints >= 0 (TypeError for a float or a bool, ValueError for a
    negative one, naming ``lengths[i]``); ``max_tokens``: an int >= 1 or None."""
    max_tokens = check_count("max_tokens", max_tokens)
    if isinstance(lengths, (str, bytes, Mapping)) or not isinstance(lengths, Sequence):
        raise InputTypeError(f"lengths must be a sequence of ints, got {type(lengths).__name__}")
    lengths = [_example_length(i, n) for i, n in enumerate(lengths)]
    if max_tokens is None:
        return [list(range(len(lengths)))] if lengths else []
    rows: list[list[int]] = []
    used: list[int] = []
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise InputValueError(
                f"examples[{i}] has {n} tokens, more than max_tokens={max_tokens}")
        row = next((r for r, u in enumerate(used) if u + n <= max_tokens), None)
        if row is None:
            rows.append([])
            used.append(0)
            row = len(rows) - 1
        rows[row].append(i)
        used[row] += n
    return rows


def _example_length(i: int, n: object) -> int:
    if isinstance(n, bool):
        raise InputTypeError(f"lengths[{i}] must be an int, got bool")
    try:
        n = operator.index(n)
    except TypeError:
        raise InputTypeError(f"lengths[{i}] must be an int, got {type(n).__name__}") from None
    if n < 0:
        raise InputValueError(f"lengths[{i}] must be >= 0, got {n}")
    if n > INT64_MAX:
        raise InputValueError(f"lengths[{i}] must fit in int64, got {n}")
    return n

def _check_side(padding_side: object) -> str:
    if check_str("padding_side", padding_side) not in ("right", "left"):
        raise InputValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    return padding_side


def _packed_position_ids(examples: list[Example], rows: list[list[int]], input_ids: torch.Tensor,
                         types: torch.Tensor | None, seconds: torch.Tensor | None,
                         settings: ModelSettings, convention: str) -> torch.Tensor:
    """(4, rows, L) int64 position ids in one call of the packed walk, which names an
    example at fault ``examples[i]``: it gets each example's index and the grids it owns."""
    order = [k for row in rows for k in row]
    grids = {}
    for key in ("image_grid_thw", "video_grid_thw"):
        parts = [examples[k].grids[key] for k in order if examples[k].grids[key] is not None]
        grids[key] = torch.cat(parts) if parts else None
    owned = torch.tensor([[0 if examples[k].grids[key] is None else examples[k].grids[key].shape[0]
                           for key in ("image_grid_thw", "video_grid_thw")] for k in order],
                         dtype=torch.int64).reshape(-1, 2)
    options = settings.options(convention)
    if types is not None:
        options["mm_token_type_ids"] = types
    if seconds is not None:
        options["second_per_grid_ts"] = seconds
    layout = PackedLayout(torch.tensor([examples[k].input_ids.numel() for k in order],
                                       dtype=torch.int64),
                          torch.tensor([len(row) for row in rows], dtype=torch.int64))
    return _packed_for_examples(input_ids, layout, torch.tensor(order, dtype=torch.int64), owned,
                                grids["image_grid_thw"], grids["video_grid_thw"], **options)


def _seconds(examples: list[Example], order: list[int]) -> torch.Tensor | None:
    """second_per_grid_ts of the videos in row order (float32, as the processor gives it,
    unless the examples carry another float dtype), or None when no example has any."""
    with_videos = [k for k in order if examples[k].grids["video_grid_thw"] is not None
                   and examples[k].grids["video_grid_thw"].shape[0]]
    given = [k for k in with_videos if examples[k].seconds is not None]
    if not given:
        return None
    if len(given) != len(with_videos):
        missing = next(k for k in with_videos if examples[k].seconds is None)
        raise InputValueError(f"examples[{missing}] has videos but no second_per_grid_ts, which "
                              "other examples have")
    parts = [as_tensor(examples[k].seconds, "").reshape(-1) for k in given]
    dtype = next((p.dtype for p in parts if p.is_floating_point()), torch.float32)
    return torch.cat([p.to(dtype) for p in parts])


def pack_multimodal_examples(
    examples: Sequence[Mapping[str, object]],
    config: object,
    *,
    max_tokens: int | None = None,
    pad_to_multiple_of: int | None = None,
    return_flash_attn_kwargs: bool | None = None,
    convention: str = "installed",
    precompute_vision: bool = True,
) -> dict[str, object]:
    """One packed batch for ``model(**batch)`` from Qwen-VL examples.

    ``examples``: what a Qwen-VL processor returns for one example each (a dict or
    ``BatchFeature``), with tensors of a leading batch dimension of 1 or lists:

        input_ids:            (1, n) or (n,) token ids
        attention_mask:       (1, n) of 0/1, optional; tokens where it is 0 are dropped
        labels:               (1, n), optional; input_ids when absent
        mm_token_type_ids:    (1, n), optional (transformers 5.x processors)
        pixel_values:         (patches, patch_dim) with image_grid_thw (k, 3)
        pixel_values_videos:  (patches, patch_dim) with video_grid_thw (k, 3)
        second_per_grid_ts:   (k_videos,) (Qwen2.5-VL)

    Other keys are ignored.  ``config``: the Qwen-VL model, or its config (model type, token
    ids, ``vision_config.spatial_merge_size`` and, for Qwen2.5-VL,
    ``vision_config.tokens_per_second`` are read from it).

    The examples are placed in rows by :func:`first_fit` (one row when ``max_tokens`` is
    None), each row filled up to L (the longest row, rounded up to a multiple of
    ``pad_to_multiple_of``) with the config's pad token.  Returns

        input_ids:         (rows, L) int64
        labels:            (rows, L) int64: each example's labels with its first token set to
                           -100 (the last token of one example does not learn to predict
                           the first of the next), -100 on the padding
        position_ids:      (4, rows, L) int64: row 0 the text positions 0, 1, ... of each
                           example, rows 1-3 its T/H/W MRoPE ids as transformers'
                           ``get_rope_index`` gives for the example alone; the padding counts
                           from 0 on all four rows, a sequence of its own
        pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw: concatenated in
                           the order the examples lie in the batch (row 0 left to right,
                           then row 1, ...), which is the order the model assigns them to
                           the placeholder tokens; absent when no example has any
        second_per_grid_ts:(videos,) Qwen2.5-VL, when the examples carry it
        mm_token_type_ids: (rows, L), when the examples carry it (0 on padding)
        use_cache:         False (see the module docstring)
        cu_seq_lens_q/k, max_length_q/k: when the batch has more than one row (or with
                           ``return_flash_attn_kwargs=True``): int32 cumulative lengths of
                           every sequence (examples, and each row's padding) over the rows
                           laid end to end, and the longest one
        image_* / video_*: the vision tower's precomputed kwargs for these grids, with
                           ``precompute_vision`` (the default) where the installed
                           transformers' tower of this model type was matched (see the module
                           docstring; one warning and none where it was not)

    There is no ``attention_mask``: the models derive the per-example causal mask from
    ``position_ids[0]`` (eager, sdpa; flash-attention for one row), and flash-attention
    takes the boundaries from ``cu_seq_lens_q/k``.  Those are returned by default
    (``return_flash_attn_kwargs=None``) whenever the batch has more than one row, because
    transformers derives flash-attention's boundaries from the position ids only for a
    batch of one row: without them, the examples of a row would attend to the earlier ones
    under flash-attention, silently.  A batch of one row goes without them, as the models
    read its boundaries from ``position_ids[0]`` under every attention implementation and
    every release, so nothing that works changes (transformers 5.17 and 5.18 pass these
    keywords on to the Qwen-VL vision tower too, whose flash-attention call then gets them
    twice: a TypeError there, for batches with images or videos; use one row on those
    releases).  ``True`` returns them for one row as well, ``False`` never (then a batch of
    several rows keeps its examples apart under eager and sdpa attention only).

    ``convention`` chooses the position-id rules as in
    :func:`posenc_torch.compute_mrope_position_ids` ("installed": those of the installed
    transformers).  ``max_tokens`` bounds the example tokens of a row; the padding to a
    multiple can add up to ``pad_to_multiple_of - 1``.

    Bad input raises TypeError (wrong type or dtype, a flag that is not a bool) or
    ValueError (wrong shape, an example longer than ``max_tokens``, grids that disagree
    with the tokens or the pixel rows, ...) naming ``examples[i]`` and the key; the
    position walk's errors (a grid that does not fit its example's tokens) name
    ``examples[i]`` and speak of that example alone, its tokens and grids numbered from 0.
    """
    settings = model_settings(config)
    convention = resolve_convention(convention, settings.model_type)
    max_tokens = check_count("max_tokens", max_tokens)
    multiple = check_count("pad_to_multiple_of", pad_to_multiple_of) or 1
    if return_flash_attn_kwargs is not None:
        check_bool("return_flash_attn_kwargs", return_flash_attn_kwargs)
    check_bool("precompute_vision", precompute_vision)
    exs = read_examples(examples, settings)
    lengths = [ex.input_ids.numel() for ex in exs]
    rows = first_fit(lengths, max_tokens)
    order = [k for row in rows for k in row]
    used = [sum(lengths[k] for k in row) for row in rows]
    length = math.ceil(max(used) / multiple) * multiple

    shape = (len(rows), length)
    input_ids = _batch_tensor(shape, settings.pad_token_id, max(used), multiple)
    labels = _batch_tensor(shape, IGNORE_INDEX, max(used), multiple)
    with_types = any(ex.mm_token_type_ids is not None for ex in exs)
    types = _batch_tensor(shape, 0, max(used), multiple) if with_types else None
    for r, row in enumerate(rows):
        at = 0
        for k in row:
            ex, n = exs[k], lengths[k]
            input_ids[r, at:at + n] = ex.input_ids
            labels[r, at:at + n] = ex.labels
            if types is not None:
                types[r, at:at + n] = token_types(ex, settings)
            at += n

    seconds = _seconds(exs, order) if MROPE_MODELS[settings.model_type].reads_seconds else None
    batch: dict[str, object] = {"input_ids": input_ids, "labels": labels}
    batch["position_ids"] = _packed_position_ids(exs, rows, input_ids, types, seconds, settings,
                                                 convention)
    batch.update(_vision_inputs(exs, order))
    if seconds is not None:
        batch["second_per_grid_ts"] = seconds
    if types is not None:
        batch["mm_token_type_ids"] = types
    batch["use_cache"] = False
    if return_flash_attn_kwargs or (return_flash_attn_kwargs is None and len(rows) > 1):
        seqs = []
        for row, u in zip(rows, used, strict=True):
            seqs += [lengths[k] for k in row] + ([length - u] if length > u else [])
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seqs).cumsum(0)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=max(seqs),
                     max_length_k=max(seqs))
    if precompute_vision:
        batch.update(_vision_kwargs(config, batch))
    return batch


def _batch_tensor(shape: tuple[int, int], fill: int, longest: int, multiple: int) -> torch.Tensor:
    """An int64 (rows, L) tensor of the batch filled with ``fill``; L is the ``longest`` row
    rounded up to a multiple of ``multiple``, and a failed allocation says so."""
    try:
        return torch.full(shape, fill, dtype=torch.int64)
    except RuntimeError as err:
        raise allocation_error(
            err, f"the (rows, L) batch of shape {shape}: L is the longest row ({longest} "
            f"tokens) rounded up to a multiple of pad_to_multiple_of = {multiple}") from err


def _vision_inputs(exs: list[Example], order: list[int]) -> dict[str, torch.Tensor]:
    """The pixels and grids of the examples in ``order``, concatenated."""
    out = {}
    for pixel_key, grid_key in VISION_KEYS:
        present = [k for k in order if exs[k].pixels[pixel_key] is not None]
        if not present:
            continue
        pix = [exs[k].pixels[pixel_key] for k in present]
        for k, p in zip(present, pix, strict=True):
            if p.shape[1] != pix[0].shape[1]:
                raise InputValueError(f"examples[{k}][{pixel_key!r}] has patches of {p.shape[1]} "
                                      f"values, examples[{present[0]}] of {pix[0].shape[1]}: the "
                                      "patch size must agree")
            if p.dtype != pix[0].dtype:
                raise InputTypeError(f"examples[{k}][{pixel_key!r}] is {p.dtype}, "
                                     f"examples[{present[0]}] {pix[0].dtype}: the dtype must agree")
        out[pixel_key] = torch.cat(pix)
        out[grid_key] = torch.cat([exs[k].grids[grid_key] for k in present])
    return out


def _vision_kwargs(config: object, batch: dict) -> dict[str, object]:
    if batch.get("image_grid_thw") is None and batch.get("video_grid_thw") is None:
        return {}
    return _installed.ask("vision_kwargs", config, batch.get("image_grid_thw"),
                          batch.get("video_grid_thw"))


def pad_multimodal_examples(
    examples: Sequence[Mapping[str, object]],
    config: object,
    *,
    pad_to_multiple_of: int | None = None,
    padding_side: str = "right",
    precompute_vision: bool = True,
) -> dict[str, object]:
    """One padded batch for ``model(**batch)`` from Qwen-VL examples, one row each: for
    training without packing.  ``examples`` and ``config`` as for
    :func:`pack_multimodal_examples`.  Returns

        input_ids:          (B, L) int64, padded with the config's pad token on
                            ``padding_side`` ("right" or "left") to the longest example,
                            rounded up to a multiple of ``pad_to_multiple_of``
        attention_mask:     (B, L) int64, 1 on the examples' tokens
        labels:             (B, L) int64, the examples' labels, -100 on the padding
        mm_token_type_ids:  (B, L), when the examples carry it
        pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
        second_per_grid_ts: concatenated in example order
        image_* / video_*:  the vision tower's precomputed kwargs, with
                            ``precompute_vision`` (see :func:`pack_multimodal_examples`)

    The model computes the position ids itself (``get_rope_index``; under
    ``posenc_torch.hf.patch()`` posenc's walk).  Errors as :func:`pack_multimodal_examples`.
    """
    settings = model_settings(config)
    multiple = check_count("pad_to_multiple_of", pad_to_multiple_of) or 1
    _check_side(padding_side)
    check_bool("precompute_vision", precompute_vision)
    exs = read_examples(examples, settings)
    lengths = [ex.input_ids.numel() for ex in exs]
    length = math.ceil(max(lengths) / multiple) * multiple
    shape = (len(exs), length)
    input_ids = _batch_tensor(shape, settings.pad_token_id, max(lengths), multiple)
    labels = _batch_tensor(shape, IGNORE_INDEX, max(lengths), multiple)
    mask = _batch_tensor(shape, 0, max(lengths), multiple)
    with_types = any(ex.mm_token_type_ids is not None for ex in exs)
    types = _batch_tensor(shape, 0, max(lengths), multiple) if with_types else None
    for r, (ex, n) in enumerate(zip(exs, lengths, strict=True)):
        at = slice(0, n) if padding_side == "right" else slice(length - n, length)
        input_ids[r, at], labels[r, at], mask[r, at] = ex.input_ids, ex.labels, 1
        if types is not None:
            types[r, at] = token_types(ex, settings)
    batch: dict[str, object] = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    order = list(range(len(exs)))
    batch.update(_vision_inputs(exs, order))
    if MROPE_MODELS[settings.model_type].reads_seconds:
        seconds = _seconds(exs, order)
        if seconds is not None:
            batch["second_per_grid_ts"] = seconds
    if types is not None:
        batch["mm_token_type_ids"] = types
    if precompute_vision:
        batch.update(_vision_kwargs(config, batch))
    return batch


class MultimodalPaddingCollator:
    """``data_collator`` that pads each list of examples with
    :func:`pad_multimodal_examples` and these options (checked here)."""

    def __init__(self, config: object, *, pad_to_multiple_of: int | None = None,
                 padding_side: str = "right", precompute_vision: bool = True) -> None:
        model_settings(config)
        self.config = getattr(config, "config", config) if not hasattr(config, "model_type") \
            else config  # the config, not the model: a collator travels to loader workers
        self.pad_to_multiple_of = check_count("pad_to_multiple_of", pad_to_multiple_of)
        self.padding_side = _check_side(padding_side)
        self.precompute_vision = check_bool("precompute_vision", precompute_vision)

    def __call__(self, examples: Sequence[Mapping[str, object]]) -> dict[str, object]:
        return pad_multimodal_examples(
            examples, self.config, pad_to_multiple_of=self.pad_to_multiple_of,
            padding_side=self.padding_side, precompute_vision=self.precompute_vision)

    def __repr__(self) -> str:
        return (f"MultimodalPaddingCollator({self.config.model_type}, pad_to_multiple_of="
                f"{self.pad_to_multiple_of}, padding_side={self.padding_side!r}, "
                f"precompute_vision={self.precompute_vision})")


class MultimodalPackingCollator:
    """``data_collator`` for ``transformers.Trainer`` and TRL's ``SFTTrainer``: packs each
    list of examples with :func:`pack_multimodal_examples` and these options.

    ``config`` (the model or its config) is read once, here; so is ``convention``, which is
    resolved against the transformers installed now.  The options are checked here, as
    :func:`pack_multimodal_examples` checks them.
    """

    def __init__(self, config: object, *, max_tokens: int | None = None,
                 pad_to_multiple_of: int | None = None,
                 return_flash_attn_kwargs: bool | None = None,
                 convention: str = "installed", precompute_vision: bool = True) -> None:
        settings = model_settings(config)
        self.precompute_vision = check_bool("precompute_vision", precompute_vision)
        self.config = getattr(config, "config", config) if not hasattr(config, "model_type") \
            else config
        self.convention = resolve_convention(convention, settings.model_type)
        self.max_tokens = check_count("max_tokens", max_tokens)
        self.pad_to_multiple_of = check_count("pad_to_multiple_of", pad_to_multiple_of)
        self.return_flash_attn_kwargs = return_flash_attn_kwargs if return_flash_attn_kwargs \
            is None else check_bool("return_flash_attn_kwargs", return_flash_attn_kwargs)

    def __call__(self, examples: Sequence[Mapping[str, object]]) -> dict[str, object]:
        return pack_multimodal_examples(
            examples, self.config, max_tokens=self.max_tokens,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_flash_attn_kwargs=self.return_flash_attn_kwargs, convention=self.convention,
            precompute_vision=self.precompute_vision)

    def __repr__(self) -> str:
        return (f"MultimodalPackingCollator({self.config.model_type}, max_tokens="
                f"{self.max_tokens}, pad_to_multiple_of={self.pad_to_multiple_of}, "
                f"return_flash_attn_kwargs={self.return_flash_attn_kwargs}, convention="
                f"{self.convention!r}, precompute_vision={self.precompute_vision})")

