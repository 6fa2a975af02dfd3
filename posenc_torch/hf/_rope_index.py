"""The Qwen-VL ``get_rope_index`` of transformers: which convention it follows, decided by
its code, and its replacement by posenc's position walk.

For ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl`` and ``qwen3_vl_moe``, :func:`install`
replaces the ``get_rope_index`` of the class that defines it (``<Model>Model``) with the
same position ids and deltas, bit for bit, dtypes included, from
:func:`posenc_torch.compute_mrope_position_ids` under the convention ("4.57", "5.17" or
"5.18") that the method's verified row names (:func:`installed_convention`, which also
answers the core's ``convention="installed"``); any other method is kept, with one
warning.  Inputs on another device are walked on the CPU and the results copied back once.
Calls the walk does not take go to the original method (``handle.fallbacks``; with
``fallback=False`` posenc's error): no ``input_ids``, arguments that do not bind, grids
that disagree with the tokens, values outside 0/1 in the mask or 0/1/2 in
``mm_token_type_ids``, and, for Qwen2.5-VL, seconds per grid that 5.18+ would compute in
another precision (a Python list, float16/bfloat16) or a ``tokens_per_second`` that 5.17
cannot use (not a Python int).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import _installed
from .. import positions as _positions
from .._tables import CONVENTIONS, MROPE_MODELS
from . import _digests, _table, _transformers
from ._handle import CallArguments, Decline, original_of, warn_once

#: The model types whose get_rope_index is replaced.
MODEL_TYPES = tuple(MROPE_MODELS)
_NAME = "get_rope_index"


def _tensor(value, name: str, dims: int | None = None) -> torch.Tensor | None:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or (dims is not None and value.dim() != dims):
        raise Decline(f"{name} is not a {dims}-D tensor")
    return value


def _seconds(value, convention: str) -> torch.Tensor | None:
    """second_per_grid_ts as the walk takes it under ``convention`` (see module doc)."""
    fractional = CONVENTIONS[convention].fractional_seconds
    if value is None or isinstance(value, torch.Tensor):
        if (value is not None and fractional
                and value.dtype in (torch.float16, torch.bfloat16)):
            raise Decline("half-precision seconds")
        return value
    if fractional:
        raise Decline("5.18 multiplies Python floats in float64, then float32")
    # 4.57 and 5.17 truncate each value: float64 keeps a Python float exactly
    return torch.tensor([float(s) for s in value], dtype=torch.float64)


def _walk(self, arguments: dict, model: str, convention: str):
    """Position ids and deltas as the original method returns them; Decline for a call the
    walk does not take in this form, posenc's InputError for one it refuses."""
    input_ids = arguments.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise Decline("input_ids")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise Decline("input_ids dtype")
    # transformers writes int64 positions into a tensor of input_ids' dtype where the
    # mask (5.x) or the grids (4.57) send it down that path: it raises there
    if input_ids.dtype != torch.int64 and (
            arguments.get("attention_mask") is not None if CONVENTIONS[convention].v5
            else arguments.get("image_grid_thw") is not None
            or arguments.get("video_grid_thw") is not None):
        raise Decline("transformers raises for these ids")
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
    v5 = CONVENTIONS[convention].v5
    if v5:
        types = _tensor(arguments.get("mm_token_type_ids"), "mm_token_type_ids", 2)
        if types is None:
            raise Decline("mm_token_type_ids")
        kwargs["mm_token_type_ids"] = host(types)
    else:
        kwargs.update(image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                      vision_start_token_id=config.vision_start_token_id)
    if MROPE_MODELS[model].reads_seconds:
        tps = vision.tokens_per_second
        if CONVENTIONS[convention].integral_tokens_per_second and (
                isinstance(tps, bool) or not isinstance(tps, int)):
            raise Decline("5.17 needs an int tokens_per_second")
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


def _computation(original: Callable, model: str, convention: str) -> Callable:
    binding = CallArguments(original)

    def compute(self, *args, **kwargs):
        arguments = binding.bind((self, *args), kwargs)
        if arguments is None:
            raise Decline  # transformers raises its own error
        return _walk(self, arguments, model, convention)

    return compute


_OWNERS: dict[str, type] = {}


def _owner_and_original(model_type: str) -> tuple[type, Callable]:
    """The class that defines get_rope_index (found once; checked to be still the module's)
    and the method it holds now."""
    module = _transformers.modeling_module(model_type)
    owner = _OWNERS.get(model_type)
    if owner is None or vars(module).get(owner.__name__) is not owner or _NAME not in vars(owner):
        owner = _OWNERS[model_type] = _transformers.owner_class(module, _NAME)
    return owner, original_of(vars(owner)[_NAME])


def _decided(model_type: str, rows: dict | None = None) -> tuple[str, _digests.Watch]:
    """(the convention of the installed ``get_rope_index`` of ``model_type``, its watch);
    ValueError when its code is not one a verified table holds."""
    try:
        owner, original = _owner_and_original(model_type)
        if rows is None:
            rows = _table.user_rows(None, _transformers.version())
        entry, watch = _table.verified(original, owner, _NAME, rows)
    except (_transformers.Unsupported, _digests.Unverified, ImportError) as e:
        raise ValueError(f"the position-id rules of transformers {_transformers.version()} "
                         f"for {model_type} are not ones posenc_torch verified: {e}; pass "
                         f"convention= one of {_positions.MROPE_CONVENTIONS} explicitly"
                         ) from None
    if entry.use not in CONVENTIONS:
        raise ValueError(f"the verified row of {model_type}.{_NAME} names {entry.use!r}, "
                         "not a convention")
    return entry.use, watch


def installed_convention(model_type: str) -> str:
    """The convention whose rules the installed transformers' ``get_rope_index`` of
    ``model_type`` follows, by its digest (the shipped table, and the file
    ``$POSENC_TORCH_HF_TABLE`` names); ValueError when its code is not one a verified
    table holds, or when this transformers has no such model."""
    return _decided(model_type)[0]


def install(handle, model_types: tuple[str, ...]) -> None:
    """Replace ``get_rope_index`` for the Qwen-VL types among ``model_types``;
    ``handle.undo()`` restores it.  A type whose installed ``get_rope_index`` is not a
    verified one keeps it, with one warning."""
    for mt in model_types:
        if mt not in MODEL_TYPES:
            continue
        try:
            convention, watch = _decided(mt, handle.rows)
        except ValueError as e:
            warn_once(f"posenc_torch.hf.patch leaves {mt}.{_NAME} to transformers: {e}",
                      stacklevel=4)
            continue
        owner, original = _owner_and_original(mt)
        handle.replace(owner, _NAME, _computation(original, mt, convention), f"{mt}.{_NAME}",
                       f"posenc_torch replacement for transformers' {owner.__qualname__}."
                       f"{_NAME} (convention {convention}); see posenc_torch.hf.", watch)


_installed.provide("convention", installed_convention)
