"""The Qwen-VL ``get_rope_index`` of transformers replaced by posenc's position walk.

``posenc_torch.hf.patch()`` runs :func:`install` for the model types it patches.  For
``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl`` and ``qwen3_vl_moe`` it replaces the
``get_rope_index`` method of the class that defines it in the installed transformers
(``<Model>Model`` in 4.57 and 5.x) with a wrapper that computes the same position ids and
deltas with :func:`posenc_torch.compute_mrope_position_ids` under the installed release's
convention (4.57, 5.17 or 5.18+; bit for bit, dtypes included).  ``handle.undo()`` puts
the original back.

Inputs on another device are copied to the CPU once, walked there, and the results copied
back once.  Calls the walk does not take go to the original method unchanged and count in
``handle.fallbacks`` (with ``fallback=False`` they raise posenc's error instead): no
``input_ids``, arguments that do not bind to the original signature, grids that disagree
with the tokens (transformers raises on most of those, or ignores extra grids), values
outside 0/1 in the mask or 0/1/2 in ``mm_token_type_ids``, and, for Qwen2.5-VL, seconds
per grid that 5.18+ would compute in another precision (a Python list, float16/bfloat16) or
a ``tokens_per_second`` that 5.17 cannot use (not a Python int).

The vision towers' per-image position helpers (4.57 ``rot_pos_emb``, 5.x
``vision_utils.get_vision_position_ids``) are left alone: their Python loop runs once per
image, next to a vision tower forward that costs far more.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable

import torch

from . import positions as _positions

#: model type -> the ``model=`` of compute_mrope_position_ids.
MODEL_TYPES = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl",
               "qwen3_vl_moe": "qwen3_vl"}
_NAME = "get_rope_index"


class _Skip(Exception):
    """The call goes to transformers' original method."""


def _owner_class(module) -> type:
    """The class of ``module`` that defines ``get_rope_index``."""
    owners = [value for value in vars(module).values()
              if isinstance(value, type) and value.__module__ == module.__name__
              and _NAME in vars(value)]
    if len(owners) != 1:
        raise RuntimeError(
            f"posenc_torch.hf.patch: expected one class defining {_NAME} in {module.__name__}, "
            f"found {[c.__name__ for c in owners]}; this transformers version computes the "
            "Qwen-VL position ids in a way posenc_torch does not know")
    return owners[0]


def _tensor(value, name: str, dims: int | None = None) -> torch.Tensor | None:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or (dims is not None and value.dim() != dims):
        raise _Skip(f"{name} is not a {dims}-D tensor")
    return value


def _seconds(value, convention: str) -> torch.Tensor | None:
    """second_per_grid_ts as the walk takes it under ``convention`` (see module doc)."""
    if value is None or isinstance(value, torch.Tensor):
        if (value is not None and convention == "5.18"
                and value.dtype in (torch.float16, torch.bfloat16)):
            raise _Skip("half-precision seconds")
        return value
    if convention == "5.18":
        raise _Skip("5.18 multiplies Python floats in float64, then float32")
    # 4.57 and 5.17 truncate each value: float64 keeps a Python float exactly
    return torch.tensor([float(s) for s in value], dtype=torch.float64)


def _walk(self, arguments: dict, model: str, convention: str):
    """Position ids and deltas as the original method returns them, or _Skip."""
    input_ids = arguments.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise _Skip("input_ids")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise _Skip("input_ids dtype")
    device = input_ids.device
    cpu = torch.device("cpu")

    def host(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(cpu)

    mask = host(_tensor(arguments.get("attention_mask"), "attention_mask", 2))
    images = host(_tensor(arguments.get("image_grid_thw"), "image_grid_thw", 2))
    videos = host(_tensor(arguments.get("video_grid_thw"), "video_grid_thw", 2))
    config = self.config
    vision = config.vision_config
    kwargs = dict(model=model, convention=convention,
                  spatial_merge_size=vision.spatial_merge_size)
    v5 = convention != "4.57"
    if v5:
        types = _tensor(arguments.get("mm_token_type_ids"), "mm_token_type_ids", 2)
        if types is None:
            raise _Skip("mm_token_type_ids")
        kwargs["mm_token_type_ids"] = host(types)
    else:
        kwargs.update(image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                      vision_start_token_id=config.vision_start_token_id)
    if model == "qwen2_5_vl":
        tps = vision.tokens_per_second
        if convention == "5.17" and (isinstance(tps, bool) or not isinstance(tps, int)):
            raise _Skip("5.17 needs an int tokens_per_second")
        kwargs["tokens_per_second"] = tps
        kwargs["second_per_grid_ts"] = host(_seconds(arguments.get("second_per_grid_ts"),
                                                     convention))
    pos, deltas = _positions.compute_mrope_position_ids(host(input_ids), images, videos, mask,
                                                        **kwargs)
    if v5 or images is not None or videos is not None:
        pos = pos.to(input_ids.dtype)
    elif mask is None:  # 4.57 without grids: arange and zero deltas of input_ids' dtype
        deltas = deltas.to(input_ids.dtype)
    return pos.to(device), deltas.to(device)


def _make(original: Callable, handle, target: str, model: str, convention: str) -> Callable:
    signature = inspect.signature(original)
    calls, fallbacks = handle._calls.get(target), handle._fallbacks.get(target)
    count, fallback = handle.count, handle.fallback

    def get_rope_index(self, *args, **kwargs):
        try:
            arguments = signature.bind(self, *args, **kwargs).arguments
            result = _walk(self, arguments, model, convention)
        except (_Skip, TypeError, ValueError) as e:
            if not fallback and not isinstance(e, _Skip):
                raise
            if count:
                fallbacks.add_(1)
            return original(self, *args, **kwargs)
        if count:
            calls.add_(1)
        return result

    get_rope_index.__signature__ = signature
    return get_rope_index


def install(handle, model_types: tuple[str, ...]) -> None:
    """Replace ``get_rope_index`` for the Qwen-VL types among ``model_types`` (the
    ``posenc_torch.hf.INSTALLERS`` interface); ``handle.undo()`` restores it."""
    wanted = [mt for mt in model_types if mt in MODEL_TYPES]
    if not wanted:
        return
    import transformers

    try:
        convention = _positions.convention_for_version(transformers.__version__)
    except ValueError as e:
        warnings.warn(f"posenc_torch.hf.patch leaves {_NAME} to transformers: {e}",
                      RuntimeWarning, stacklevel=3)
        return
    for mt in wanted:
        module = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
        owner = _owner_class(module)
        original = vars(owner)[_NAME]
        has_types = "mm_token_type_ids" in inspect.signature(original).parameters
        if has_types != (convention != "4.57"):
            raise RuntimeError(
                f"posenc_torch.hf.patch: {owner.__qualname__}.{_NAME} of transformers "
                f"{transformers.__version__} {'takes' if has_types else 'lacks'} "
                "mm_token_type_ids, unlike the release rules posenc_torch follows for it")
        target = f"{mt}.{_NAME}"
        handle._add_counters(target)
        wrapper = _make(original, handle, target, MODEL_TYPES[mt], convention)
        wrapper.__doc__ = (f"posenc_torch replacement for transformers' {owner.__qualname__}."
                           f"{_NAME}; see posenc_torch._hf_positions.")
        handle.install(owner, _NAME, wrapper, target)
