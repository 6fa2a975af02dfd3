"""The examples of a packed or padded batch, as ``posenc_torch.packing`` reads them: the
settings it needs from a Qwen-VL config, each example's token rows, grids, pixels and
seconds checked and converted, and the token types of an example."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ._checks import INT64_MAX, InputTypeError, InputValueError
from ._tables import MROPE_MODELS
from .positions import MropeOptions, token_type_ids

IGNORE_INDEX = -100  # the label transformers' loss skips

#: (pixels, grid) keys of the two kinds of vision input an example may carry.
VISION_KEYS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


@dataclass(frozen=True)
class ModelSettings:
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


def model_settings(config: object) -> ModelSettings:
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
    return ModelSettings(model_type, **ids, spatial_merge_size=merge,
                          tokens_per_second=tokens_per_second,
                          pad_token_id=pad if isinstance(pad, int) else 0, patch_dim=patch_dim)


def check_count(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 1:
        raise InputValueError(f"{name} must be >= 1, got {value}")
    if value > INT64_MAX:
        raise InputValueError(f"{name} must fit in int64 (at most 2^63 - 1), got {value}")
    return value


def as_tensor(value: object, where: str) -> torch.Tensor:
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
    t = as_tensor(value, where)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise InputValueError(f"{where} must be (length,) or (1, length), got shape "
                              f"{tuple(t.shape)}")
    if t.numel() and (t.is_floating_point() or t.is_complex()):
        raise InputTypeError(f"{where} must hold integers, got {t.dtype}")
    return t.to(torch.int64)


def _grid(value: object, where: str) -> torch.Tensor:
    t = as_tensor(value, where)
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2 or t.shape[1] != 3:
        raise InputValueError(f"{where} must be (n, 3) of (t, h, w), got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InputTypeError(f"{where} must hold integers, got {t.dtype}")
    return t.to(torch.int64)


@dataclass
class Example:
    input_ids: torch.Tensor                 # (n,) int64
    labels: torch.Tensor                    # (n,) int64, first entry IGNORE_INDEX
    mm_token_type_ids: torch.Tensor | None  # (n,) int64
    grids: dict[str, torch.Tensor | None]   # image_grid_thw / video_grid_thw: (k, 3)
    pixels: dict[str, torch.Tensor | None]  # pixel_values / pixel_values_videos: (patches, d)
    seconds: object                         # second_per_grid_ts as given (tensor or list)


def _read_example(i: int, example: object, settings: ModelSettings) -> Example:
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
    for pixel_key, grid_key in VISION_KEYS:
        grid = example.get(grid_key)
        grids[grid_key] = None if grid is None else _grid(grid, where(grid_key))
        pix = example.get(pixel_key)
        if pix is None:
            if grids[grid_key] is not None and grids[grid_key].shape[0]:
                raise InputValueError(f"examples[{i}] has {grid_key} but no {pixel_key}")
            pixels[pixel_key] = None
            continue
        pix = as_tensor(pix, where(pixel_key))
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
        n_seconds = as_tensor(seconds, where("second_per_grid_ts")).reshape(-1).numel()
        n_videos = 0 if grids["video_grid_thw"] is None else grids["video_grid_thw"].shape[0]
        if n_seconds != n_videos:
            raise InputValueError(f"{where('second_per_grid_ts')} has {n_seconds} values for "
                                  f"{n_videos} videos")
    return Example(ids, labels, rows.get("mm_token_type_ids"), grids, pixels, seconds)


def read_examples(examples: object, settings: ModelSettings) -> list[Example]:
    if isinstance(examples, Mapping) or not isinstance(examples, Sequence):
        raise InputTypeError(f"examples must be a list of examples (mappings), got "
                             f"{type(examples).__name__}")
    if not examples:
        raise InputValueError("examples is empty")
    return [_read_example(i, ex, settings) for i, ex in enumerate(examples)]



def token_types(ex: Example, settings: ModelSettings) -> torch.Tensor:
    """The example's mm_token_type_ids, or as the 5.x processors derive it from its tokens
    (:func:`posenc_torch.positions.token_type_ids`); (n,) int64."""
    if ex.mm_token_type_ids is not None:
        return ex.mm_token_type_ids
    return token_type_ids(ex.input_ids, settings.image_token_id, settings.video_token_id)
