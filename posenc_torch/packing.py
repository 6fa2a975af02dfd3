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
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from . import _installed
from ._checks import (
    INT64_MAX,
    InputTypeError,
    InputValueError,
    allocation_error,
    check_bool,
    check_str,
    check_tensor,
)
from ._tables import MROPE_MODELS
from .positions import MropeOptions, _Layout, _packed_for_examples, resolve_convention

__all__ = ["pack_multimodal_examples", "MultimodalPackingCollator", "pad_multimodal_examples",
           "MultimodalPaddingCollator", "first_fit", "packed_attention_leaks",
           "warn_packed_attention_leaks"]

IGNORE_INDEX = -100  # the label transformers' loss skips

# (pixels, grid) keys of the two kinds of vision input an example may carry.
_VISION = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


@dataclass(frozen=True)
class _ModelSettings:
    """What packing needs from a Qwen-VL config."""

    model_type: str
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    spatial_merge_size: int
    tokens_per_second: float | None
    pad_token_id: int
    patch_dim: int | None  # values per patch row of pixel_values, when the config says

    def options(self, convention: str) -> MropeOptions:
        """The position-id keywords this config gives (posenc_torch.positions)."""
        options = MropeOptions(
            model=self.model_type, convention=convention, image_token_id=self.image_token_id,
            video_token_id=self.video_token_id, vision_start_token_id=self.vision_start_token_id,
            spatial_merge_size=self.spatial_merge_size)
        if MROPE_MODELS[self.model_type].reads_seconds:
            options["tokens_per_second"] = self.tokens_per_second
        return options


def _settings(config: object) -> _ModelSettings:
    """Model type and token ids from a Qwen-VL model (or anything with its ``config``, such
    as a PEFT wrapper) or its config; the vision settings are read from ``vision_config``,
    the pad token from the text config where the top level has none."""
    if config is None:
        raise InputTypeError("config is required: the Qwen-VL model or its config, got None")
    cfg = config if hasattr(config, "model_type") else getattr(config, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in MROPE_MODELS:
        raise InputValueError(
            f"config must be a Qwen-VL model or config (model_type one of "
            f"{sorted(MROPE_MODELS)}), got "
            f"{model_type if model_type is not None else type(config).__name__!r}")
    vision = getattr(cfg, "vision_config", None)
    text = getattr(cfg, "text_config", None)
    ids = {}
    for name in ("image_token_id", "video_token_id", "vision_start_token_id"):
        value = getattr(cfg, name, None)
        if not isinstance(value, int):
            raise InputValueError(f"config has no integer {name} (got {value!r})")
        ids[name] = value
    merge = getattr(vision, "spatial_merge_size", None)
    if not isinstance(merge, int) or merge < 1:
        raise InputValueError(f"config.vision_config.spatial_merge_size must be an int >= 1, got "
                              f"{merge!r}")
    tokens_per_second = getattr(vision, "tokens_per_second", None) \
        if MROPE_MODELS[model_type].reads_seconds else None
    pad = getattr(cfg, "pad_token_id", None)
    if pad is None:
        pad = getattr(text, "pad_token_id", None)
    sizes = [getattr(vision, name, None) for name in
             ("in_channels", "temporal_patch_size", "patch_size")]
    patch_dim = sizes[0] * sizes[1] * sizes[2] ** 2 \
        if all(isinstance(v, int) for v in sizes) else None
    return _ModelSettings(model_type, **ids, spatial_merge_size=merge,
                          tokens_per_second=tokens_per_second,
                          pad_token_id=pad if isinstance(pad, int) else 0, patch_dim=patch_dim)


def first_fit(lengths: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """Rows of example indices: each example, in order, goes into the first row whose
    examples leave room for it (at most ``max_tokens`` tokens a row); all in one row when
    ``max_tokens`` is None.  The batch lays the examples of row 0 first, then row 1, ...

    ``lengths``: a sequence of ints >= 0 (TypeError for a float or a bool, ValueError for a
    negative one, naming ``lengths[i]``); ``max_tokens``: an int >= 1 or None."""
    max_tokens = _check_count("max_tokens", max_tokens)
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


def _check_count(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 1:
        raise InputValueError(f"{name} must be >= 1, got {value}")
    if value > INT64_MAX:
        raise InputValueError(f"{name} must fit in int64 (at most 2^63 - 1), got {value}")
    return value


def _as_tensor(value: object, where: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise InputValueError(f"{where} is a meta tensor: an example's tensors are read, "
                                  "and a meta tensor has no values")
        return value
    if isinstance(value, (list, tuple)) or hasattr(value, "__array__"):
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputTypeError(f"{where} must be a tensor or a (nested) list of numbers: {e}") \
                from None
    raise InputTypeError(f"{where} must be a tensor or a list, got {type(value).__name__}")


def _token_row(value: object, where: str) -> torch.Tensor:
    """(L,) int64 from a (L,) or (1, L) tensor, or a list of ints (or a list of one)."""
    t = _as_tensor(value, where)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise InputValueError(f"{where} must be (length,) or (1, length), got shape "
                              f"{tuple(t.shape)}")
    if t.numel() and (t.is_floating_point() or t.is_complex()):
        raise InputTypeError(f"{where} must hold integers, got {t.dtype}")
    return t.to(torch.int64)


def _grid(value: object, where: str) -> torch.Tensor:
    t = _as_tensor(value, where)
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2 or t.shape[1] != 3:
        raise InputValueError(f"{where} must be (n, 3) of (t, h, w), got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InputTypeError(f"{where} must hold integers, got {t.dtype}")
    return t.to(torch.int64)


@dataclass
class _Example:
    input_ids: torch.Tensor                 # (n,) int64
    labels: torch.Tensor                    # (n,) int64, first entry IGNORE_INDEX
    mm_token_type_ids: torch.Tensor | None  # (n,) int64
    grids: dict[str, torch.Tensor | None]   # image_grid_thw / video_grid_thw: (k, 3)
    pixels: dict[str, torch.Tensor | None]  # pixel_values / pixel_values_videos: (patches, d)
    seconds: object                         # second_per_grid_ts as given (tensor or list)


def _read_example(i: int, example: object, settings: _ModelSettings) -> _Example:
    if not isinstance(example, Mapping):
        raise InputTypeError(f"examples[{i}] must be a mapping (dict or BatchFeature), got "
                             f"{type(example).__name__}")
    where = lambda key: f"examples[{i}][{key!r}]"  # noqa: E731
    if example.get("input_ids") is None:  # a missing input: a TypeError (README, "Errors")
        raise InputTypeError(f"examples[{i}] has no 'input_ids'")
    ids = _token_row(example["input_ids"], where("input_ids"))
    rows = {"input_ids": ids}
    for key in ("attention_mask", "labels", "mm_token_type_ids"):
        if example.get(key) is not None:
            rows[key] = _token_row(example[key], where(key))
            if rows[key].shape != ids.shape:
                raise InputValueError(f"{where(key)} has {rows[key].numel()} entries, input_ids "
                                      f"{ids.numel()}")
    mask = rows.pop("attention_mask", None)
    if mask is not None and not bool((mask == 1).all()):
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise InputValueError(f"{where('attention_mask')} must hold 0 and 1")
        keep = mask == 1  # an example padded by its processor: drop the padding
        rows = {key: row[keep] for key, row in rows.items()}
        ids = rows["input_ids"]
    if ids.numel() == 0:
        raise InputValueError(f"examples[{i}] has no tokens")
    labels = rows.get("labels", ids).clone()
    labels[0] = IGNORE_INDEX
    grids, pixels = {}, {}
    for pixel_key, grid_key in _VISION:
        grid = example.get(grid_key)
        grids[grid_key] = None if grid is None else _grid(grid, where(grid_key))
        pix = example.get(pixel_key)
        if pix is None:
            if grids[grid_key] is not None and grids[grid_key].shape[0]:
                raise InputValueError(f"examples[{i}] has {grid_key} but no {pixel_key}")
            pixels[pixel_key] = None
            continue
        pix = _as_tensor(pix, where(pixel_key))
        if not pix.is_floating_point():
            raise InputTypeError(f"{where(pixel_key)} must be floating, got {pix.dtype}")
        if pix.dim() != 2 or settings.patch_dim not in (None, pix.shape[1]):
            width = settings.patch_dim or "patch_dim"
            raise InputValueError(f"{where(pixel_key)} must be (patches, {width}) (in_channels * "
                                  f"temporal_patch_size * patch_size**2 of the config), got shape "
                                  f"{tuple(pix.shape)}")
        patches = 0 if grids[grid_key] is None else int(grids[grid_key].prod(-1).sum())
        if pix.shape[0] != patches:
            raise InputValueError(f"{where(pixel_key)} has {pix.shape[0]} patches but {grid_key} "
                                  f"describes {patches}")
        pixels[pixel_key] = pix
    seconds = example.get("second_per_grid_ts")
    if seconds is not None and not MROPE_MODELS[settings.model_type].reads_seconds:
        raise InputValueError(f"{where('second_per_grid_ts')} applies only to qwen2_5_vl, the "
                              f"config is {settings.model_type}")
    if seconds is not None:
        n_seconds = _as_tensor(seconds, where("second_per_grid_ts")).reshape(-1).numel()
        n_videos = 0 if grids["video_grid_thw"] is None else grids["video_grid_thw"].shape[0]
        if n_seconds != n_videos:
            raise InputValueError(f"{where('second_per_grid_ts')} has {n_seconds} values for "
                                  f"{n_videos} videos")
    return _Example(ids, labels, rows.get("mm_token_type_ids"), grids, pixels, seconds)


def _read_examples(examples: object, settings: _ModelSettings) -> list[_Example]:
    if isinstance(examples, Mapping) or not isinstance(examples, Sequence):
        raise InputTypeError(f"examples must be a list of examples (mappings), got "
                             f"{type(examples).__name__}")
    if not examples:
        raise InputValueError("examples is empty")
    return [_read_example(i, ex, settings) for i, ex in enumerate(examples)]


def _token_types(ex: _Example, settings: _ModelSettings) -> torch.Tensor:
    """The example's mm_token_type_ids, or 1 on image and 2 on video tokens."""
    if ex.mm_token_type_ids is not None:
        return ex.mm_token_type_ids
    return ((ex.input_ids == settings.image_token_id).long()
            + 2 * (ex.input_ids == settings.video_token_id).long())


def _check_side(padding_side: object) -> str:
    if check_str("padding_side", padding_side) not in ("right", "left"):
        raise InputValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    return padding_side


def _packed_position_ids(examples: list[_Example], rows: list[list[int]], input_ids: torch.Tensor,
                         types: torch.Tensor | None, seconds: torch.Tensor | None,
                         settings: _ModelSettings, convention: str) -> torch.Tensor:
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
    layout = _Layout(torch.tensor([examples[k].input_ids.numel() for k in order],
                                  dtype=torch.int64),
                     torch.tensor([len(row) for row in rows], dtype=torch.int64))
    return _packed_for_examples(input_ids, layout, torch.tensor(order, dtype=torch.int64), owned,
                                grids["image_grid_thw"], grids["video_grid_thw"], **options)


def _seconds(examples: list[_Example], order: list[int]) -> torch.Tensor | None:
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
    parts = [_as_tensor(examples[k].seconds, "").reshape(-1) for k in given]
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
    settings = _settings(config)
    convention = resolve_convention(convention, settings.model_type)
    max_tokens = _check_count("max_tokens", max_tokens)
    multiple = _check_count("pad_to_multiple_of", pad_to_multiple_of) or 1
    if return_flash_attn_kwargs is not None:
        check_bool("return_flash_attn_kwargs", return_flash_attn_kwargs)
    check_bool("precompute_vision", precompute_vision)
    exs = _read_examples(examples, settings)
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
                types[r, at:at + n] = _token_types(ex, settings)
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


def _vision_inputs(exs: list[_Example], order: list[int]) -> dict[str, torch.Tensor]:
    """The pixels and grids of the examples in ``order``, concatenated."""
    out = {}
    for pixel_key, grid_key in _VISION:
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
    settings = _settings(config)
    multiple = _check_count("pad_to_multiple_of", pad_to_multiple_of) or 1
    _check_side(padding_side)
    check_bool("precompute_vision", precompute_vision)
    exs = _read_examples(examples, settings)
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
            types[r, at] = _token_types(ex, settings)
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
        _settings(config)
        self.config = getattr(config, "config", config) if not hasattr(config, "model_type") \
            else config  # the config, not the model: a collator travels to loader workers
        self.pad_to_multiple_of = _check_count("pad_to_multiple_of", pad_to_multiple_of)
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
        settings = _settings(config)
        self.precompute_vision = check_bool("precompute_vision", precompute_vision)
        self.config = getattr(config, "config", config) if not hasattr(config, "model_type") \
            else config
        self.convention = resolve_convention(convention, settings.model_type)
        self.max_tokens = _check_count("max_tokens", max_tokens)
        self.pad_to_multiple_of = _check_count("pad_to_multiple_of", pad_to_multiple_of)
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


# ---------------------------------------------------------------------------------------
# Calls that let packed examples attend to each other, seen from the model's arguments.

_CACHE_LEAK = (
    "packed position ids (several sequences in a row) reach the model with a KV cache "
    "(use_cache on, or past_key_values given): transformers then builds a plain causal mask "
    "(and a cache that holds several examples of a row), so the examples of a row attend "
    "to each other; pass use_cache=False (the batches of posenc_torch.packing carry it)")
_MASK_LEAK = (
    "packed position ids (several sequences in a row) reach the model with a 2-D "
    "attention_mask: transformers then builds the mask from it alone (flash-attention, for a "
    "mask that holds a 0, unpads by it and ignores cu_seq_lens), and the examples of a row "
    "attend to each other; pass no attention_mask with a packed batch")
_FLASH_LEAK = (
    "packed position ids in a batch of several rows reach a flash-attention model without "
    "cu_seq_lens_q/k: transformers reads the boundaries from position ids only for one row, "
    "so the examples of a row attend to each other; pass cu_seq_lens_q/k and "
    "max_length_q/k (the batches of posenc_torch.packing carry them), or one row")
_BOUNDARY_LEAK = (
    "cu_seq_lens_q/k given to a flash-attention model mark other boundaries than the "
    "examples of the packed position ids (each starting at position 0): attention follows "
    "cu_seq_lens, so examples attend to each other or are cut; pass the boundaries "
    "posenc_torch.packing computes (return_flash_attn_kwargs=True)")
_TEXT_ROW_LEAK = (
    "packed position ids without the text-position row ((batch, seq) or (3, batch, seq)) "
    "reach a Qwen-VL model: transformers finds packed sequences only in the text row of the "
    "(4, batch, seq) layout, so the examples of a row attend to each other; pass the 4-row "
    "position ids of posenc_torch.compute_packed_mrope_position_ids")
_SPLIT_LEAK = (
    "the text positions of a packed example are not consecutive: transformers starts a new "
    "sequence wherever a text position is not one more than the one before (flash-attention "
    "with one row: wherever it is the row's smallest), so it splits or joins examples "
    "otherwise than their positions say; give each example the text positions 0, 1, 2, ...")


def _starts(rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: where the position ids' examples start: each row's first kept token,
    and every kept token whose positions are all 0 (an example's first)."""
    first = keep & (keep.cumsum(-1) == 1)
    return first | (keep & (rows == 0).all(0))


def packed_attention_leaks(
    position_ids: torch.Tensor | None,
    *,
    attention_mask: torch.Tensor | None = None,
    use_cache: bool = False,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    attn_implementation: str | None = None,
) -> list[str]:
    """Why the examples of a packed batch would not each get their own attention in this
    model call, as messages (empty when they do, or when the position ids are not packed).

    The arguments are those a Qwen-VL model's ``forward`` receives (transformers 4.57 and
    5.x):
        position_ids:        (4, B, L) with the text positions in row 0, (3, B, L) or
                             (B, L); None: not packed
        attention_mask:      as passed to the model; a 2-D (B, L) mask counts, any other
                             (a 4-D mask) is the caller's own: never a reason
        use_cache:           whether the call builds or reads a KV cache: ``use_cache``
                             resolved against the model's config, or ``past_key_values``
                             given
        cu_seq_lens_q/k:     the varlen boundaries passed along, or None
        attn_implementation: ``config._attn_implementation`` (a name containing "flash"
                             is a flash-attention implementation)

    The examples are what the position ids say: a new one starts at each kept token whose
    positions are all 0 (each row's first kept token starts one too); packed means that
    some row holds several.  For a packed batch this computes where transformers will let
    attention start a new sequence, as it does: with a 2-D mask (under flash-attention a
    mask that holds a 0: it drops one of all ones), only at each row's start; under
    flash-attention, at ``cu_seq_lens_q`` when both boundaries are given, else with one row
    wherever the text position is the row's smallest, else at each row's start; otherwise,
    with a cache at each row's start, and without one wherever a text position (row 0 of
    the 4-row layout; none in the others) is not one more than the one before.  A reason is
    given exactly when those starts differ from the examples', naming the cause; a KV cache
    with packed examples is always one (it holds several examples of a row, which a later
    decoding step would attend across).  Reading the position ids costs one device sync.
    TypeError for arguments of the wrong type (``use_cache`` not a bool, position ids or
    ``cu_seq_lens`` not integer tensors, a complex mask), ValueError for position ids of
    another shape and for a meta tensor beside tensors with values.
    """
    check_bool("use_cache", use_cache)
    if attn_implementation is not None and not isinstance(attn_implementation, str):
        raise InputTypeError(f"attn_implementation must be a str or None, got "
                             f"{type(attn_implementation).__name__}")
    for name, t in (("attention_mask", attention_mask), ("cu_seq_lens_q", cu_seq_lens_q),
                    ("cu_seq_lens_k", cu_seq_lens_k)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
    if attention_mask is not None and attention_mask.is_complex():
        raise InputTypeError(f"attention_mask must be bool, integer or floating, got "
                             f"{attention_mask.dtype}")
    for name, t in (("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k)):
        if t is not None and not _is_integer(t):
            raise InputTypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if position_ids is None:
        return []
    check_tensor("position_ids", position_ids, (2, 3), "(3 or 4, batch, seq) or (batch, seq)")
    if not _is_integer(position_ids):
        raise InputTypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    if position_ids.dim() == 3 and position_ids.shape[0] not in (3, 4):
        raise InputValueError(f"position_ids must be (3 or 4, batch, seq) or (batch, seq), got "
                              f"shape {tuple(position_ids.shape)}")
    if attention_mask is not None and attention_mask.dim() != 2:
        return []  # the caller's own mask
    rows = position_ids if position_ids.dim() == 3 else position_ids.unsqueeze(0)
    batch, length = rows.shape[1:]
    mask = attention_mask if attention_mask is not None and attention_mask.shape == \
        rows.shape[1:] else None
    if mask is not None and mask.is_meta != rows.is_meta:  # a mask that would be read
        raise InputValueError(f"attention_mask is on {mask.device} but position_ids is on "
                              f"{rows.device}; meta tensors cannot be mixed with others")
    if rows.is_meta or length == 0:
        return []
    rows = rows.long()
    keep = torch.ones(batch, length, dtype=torch.bool, device=rows.device) if mask is None \
        else mask.to(device=rows.device) != 0
    examples = _starts(rows, keep)
    flash = attn_implementation is not None and "flash" in attn_implementation
    text = rows[0] if rows.shape[0] == 4 else None
    row_starts = _starts(rows.new_ones(1, batch, length), keep)  # each row's first only
    reasons = [_CACHE_LEAK] if use_cache else []
    if mask is not None and (not flash or not bool((mask != 0).all())):
        starts, cause = row_starts, _MASK_LEAK
    elif flash and cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        total = batch * length
        flat = torch.zeros(total + 1, dtype=torch.bool, device=rows.device)
        bounds = cu_seq_lens_q.to(device=rows.device, dtype=torch.long).flatten()
        if (bounds.numel() >= 2 and bool((bounds.diff() >= 0).all())
                and int(bounds[0]) == 0 and int(bounds[-1]) == total):
            flat[bounds] = True  # (else boundaries of another batch: no start matches)
        starts, cause = flat[:-1].view(batch, length), _BOUNDARY_LEAK
    elif flash and text is not None and batch == 1:
        arange = torch.arange(length, device=rows.device) + text.min()
        packed = bool((text[0] != arange).any())
        starts = (text == text.min()) | row_starts if packed else row_starts
        cause = _SPLIT_LEAK
    elif flash:
        starts, cause = row_starts, _FLASH_LEAK if batch > 1 else _TEXT_ROW_LEAK
    elif use_cache:
        starts, cause = row_starts, _CACHE_LEAK
    elif text is not None:
        before = torch.cat([text[:, :1] - 1, text[:, :-1]], dim=-1)
        starts, cause = ((text - before) != 1) | row_starts, _SPLIT_LEAK
    else:
        starts, cause = row_starts, _TEXT_ROW_LEAK
    if not bool((examples.sum(-1) > 1).any()):
        return []  # one example a row: nothing to keep apart
    if not torch.equal(starts & keep, examples) and cause not in reasons:
        reasons.append(cause)
    return reasons


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


_WARNED: set[str] = set()


def warn_packed_attention_leaks(position_ids: torch.Tensor | None,
                                **arguments: object) -> list[str]:
    """:func:`packed_attention_leaks` with the same arguments, each reason warned once per
    process (``UserWarning``); returns the reasons found in this call."""
    reasons = packed_attention_leaks(position_ids, **arguments)
    for reason in reasons:
        if reason not in _WARNED:
            _WARNED.add(reason)
            warnings.warn(reason, UserWarning, stacklevel=2)
    return reasons
