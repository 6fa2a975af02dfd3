"""The Qwen-VL ``get_rope_index`` of transformers replaced by posenc's position walk.

``posenc_torch.hf.patch()`` runs :func:`install` for the model types it patches.  For
``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl`` and ``qwen3_vl_moe`` it replaces the
``get_rope_index`` method of the class that defines it in the installed transformers
(``<Model>Model`` in 4.57 and 5.x) with a wrapper that computes the same position ids and
deltas with :func:`posenc_torch.compute_mrope_position_ids` under the convention ("4.57",
"5.17" or "5.18") the installed method follows, bit for bit, dtypes included.  Which one
is decided by running it (:func:`installed_convention`): the installed method and the
walk of each convention on a fixed set of small prompts that tells the conventions apart;
exactly one must give the method's results on all of them, else the method is kept, with
one warning.  ``handle.undo()`` puts the original back.

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
import types
import warnings
from collections.abc import Callable

import torch

from . import _installed
from . import positions as _positions
from ._tables import CONVENTIONS, MROPE_MODELS, MROPE_QWEN3_VL

#: The model types whose get_rope_index is replaced.
MODEL_TYPES = tuple(MROPE_MODELS)
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
    fractional = CONVENTIONS[convention].fractional_seconds
    if value is None or isinstance(value, torch.Tensor):
        if (value is not None and fractional
                and value.dtype in (torch.float16, torch.bfloat16)):
            raise _Skip("half-precision seconds")
        return value
    if fractional:
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
    v5 = CONVENTIONS[convention].v5
    if v5:
        types = _tensor(arguments.get("mm_token_type_ids"), "mm_token_type_ids", 2)
        if types is None:
            raise _Skip("mm_token_type_ids")
        kwargs["mm_token_type_ids"] = host(types)
    else:
        kwargs.update(image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                      vision_start_token_id=config.vision_start_token_id)
    if MROPE_MODELS[model].reads_seconds:
        tps = vision.tokens_per_second
        if CONVENTIONS[convention].integral_tokens_per_second and (
                isinstance(tps, bool) or not isinstance(tps, int)):
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
    from .hf import bump  # hf imports this module: imported when patch() runs

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
                bump(fallbacks)
            return original(self, *args, **kwargs)
        if count:
            bump(calls)
        return result

    get_rope_index.__signature__ = signature
    return get_rope_index


# ---------------------------------------------------------------------------------------
# Which convention the installed get_rope_index follows, decided by running it.


def _stand_in(owner: type, config) -> types.SimpleNamespace:
    """An object holding ``config`` and the owner class's other methods (5.x's
    get_rope_index calls ``self.get_vision_position_ids``), on which get_rope_index runs
    without building a model."""
    obj = types.SimpleNamespace(config=config)
    for name, value in vars(owner).items():
        if isinstance(value, types.FunctionType) and not name.startswith("__"):
            setattr(obj, name, value.__get__(obj))
    return obj


def _probe_prompts(model: str, config) -> list[tuple[str, dict]]:
    """get_rope_index keyword arguments, as the processors lay prompts out, that tell the
    conventions apart: left padding (padded slots, deltas over padded or real length);
    a video of more frames than rows and columns followed by text (where text resumes);
    an image of two frames (Qwen2.5-VL's image temporal index); Qwen2.5-VL's 0.5 seconds
    per grid (truncated by 4.57 and 5.17, kept by 5.18); a row without vision and the
    call without grids (the no-grid branch); no mask.  Vision runs are marked both ways
    (vision start before the placeholders, and ``mm_token_type_ids``)."""
    image, video, start = config.image_token_id, config.video_token_id, config.vision_start_token_id
    end = getattr(config, "vision_end_token_id", None)
    end = start + 1 if end is None else end
    special = {image, video, start, end}
    text_ids = [i for i in range(3, 60) if i not in special]
    merge = config.vision_config.spatial_merge_size
    per_frame = MROPE_MODELS[model].mrope == MROPE_QWEN3_VL

    def text(n: int, offset: int) -> list[int]:
        return [text_ids[(offset + j) % len(text_ids)] for j in range(n)]

    def vision(token: int, grid: tuple[int, int, int]) -> list[int]:
        t, h, w = grid
        run = (h // merge) * (w // merge)
        if token == video and per_frame:  # <timestamp> <vision_start> frame <vision_end>
            return [tok for f in range(t) for tok in text(2, f) + [start] + [token] * run + [end]]
        return [start] + [token] * (t * run) + [end]

    def batch(rows: list[list[int]], images, videos, mask=True, seconds=None) -> dict:
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        kw = dict(input_ids=ids,
                  image_grid_thw=torch.tensor(images) if images else None,
                  video_grid_thw=torch.tensor(videos) if videos else None,
                  attention_mask=torch.tensor([[0] * (width - len(r)) + [1] * len(r)
                                               for r in rows]) if mask else None,
                  mm_token_type_ids=(ids == image).long() + 2 * (ids == video).long())
        if MROPE_MODELS[model].reads_seconds:
            kw["second_per_grid_ts"] = (torch.tensor(seconds, dtype=torch.float32)
                                        if seconds else None)
        return kw

    img, img2, vid = (1, 4, 8), (2, 4, 4), (6, 4, 4)
    mixed = [text(3, 0) + vision(image, img) + text(2, 1) + vision(video, vid) + text(3, 2),
             text(5, 3) + vision(image, img2) + text(2, 4)]
    seconds = [0.5] if MROPE_MODELS[model].reads_seconds else None
    return [
        ("image and video rows, left padding", batch(mixed, [img, img2], [vid], True, seconds)),
        ("the same without attention_mask", batch(mixed, [img, img2], [vid], False, seconds)),
        ("a text row beside an image row", batch([text(4, 5), text(2, 6) + vision(image, img)],
                                                 [img], None)),
        ("text only, left padding, no grids", batch([text(6, 7), text(3, 8)], None, None)),
    ]


def _identical(ours: tuple, theirs: object) -> bool:
    if not (isinstance(theirs, tuple) and len(theirs) == 2
            and all(isinstance(t, torch.Tensor) for t in theirs)):
        return False
    return all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
               for a, b in zip(ours, theirs, strict=True))


# The special tokens of the released Qwen-VL checkpoints, for configs that leave them unset.
_QWEN_TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656,
                   "vision_start_token_id": 151652, "vision_end_token_id": 151653}
_DECIDED: dict[tuple[str, types.ModuleType], tuple[str | None, str]] = {}


def _decide(model_type: str, module: types.ModuleType) -> tuple[str | None, str]:
    """(the convention whose walk gives what the module's get_rope_index gives on every
    probe prompt, "") or (None, why none or several do)."""
    model = model_type
    try:
        owner = _owner_class(module)
    except RuntimeError as e:
        return None, str(e)
    original = vars(owner)[_NAME]
    original = getattr(original, "posenc_original", original)
    import transformers

    try:
        config = transformers.AutoConfig.for_model(model_type)
        for name, value in _QWEN_TOKEN_IDS.items():  # some releases leave them unset
            if getattr(config, name, None) is None:
                setattr(config, name, value)
        obj = _stand_in(owner, config)
        params = inspect.signature(original).parameters
        prompts = _probe_prompts(model, config)
    except Exception as e:  # noqa: BLE001 -- reported as the reason
        return None, (f"the probe of {owner.__qualname__}.{_NAME} could not be set up "
                      f"({type(e).__name__}: {e})")
    # Conventions with the same rules for this model (all but Qwen2.5-VL, which reads the
    # seconds that 5.17 and 5.18 treat differently, have one rule set per major release)
    # are probed once, under the newest name.
    reads_seconds = MROPE_MODELS[model].reads_seconds
    candidates = []
    for convention in reversed(CONVENTIONS.values()):
        if not any(convention.same_rules_for(CONVENTIONS[c], reads_seconds) for c in candidates):
            candidates.append(convention.name)
    candidates.reverse()
    for label, kw in prompts:
        kw = {name: value for name, value in kw.items() if name in params}
        try:
            theirs = original(obj, **kw)
        except Exception as e:  # noqa: BLE001 -- reported as the reason
            return None, (f"{owner.__qualname__}.{_NAME} raised {type(e).__name__} on the probe "
                          f"prompt '{label}': {e}")
        arguments = inspect.signature(original).bind(obj, **kw).arguments
        kept = []
        for convention in candidates:
            try:
                ours = _walk(obj, arguments, model, convention)
            except Exception:  # noqa: BLE001 -- _Skip, or the walk refusing: no match
                continue
            if _identical(ours, theirs):
                kept.append(convention)
        candidates = kept
        if not candidates:
            return None, (f"{owner.__qualname__}.{_NAME} gives, on the probe prompt '{label}', "
                          "what none of the conventions "
                          f"{', '.join(_positions.MROPE_CONVENTIONS)} gives")
    if len(candidates) > 1:
        return None, (f"{owner.__qualname__}.{_NAME} matches several conventions "
                      f"({', '.join(candidates)}) on the probe prompts")
    convention = candidates[0]
    # The same rules under two names: the one of the installed version's release.
    try:
        named = _positions.convention_for_version(transformers.__version__)
    except ValueError:
        named = convention
    if CONVENTIONS[named].same_rules_for(CONVENTIONS[convention], reads_seconds):
        convention = named
    return convention, ""


def installed_convention(model_type: str) -> str:
    """The convention whose rules the installed transformers' ``get_rope_index`` of
    ``model_type`` follows, found by running it on fixed prompts (cached per model type
    and modeling module).  ValueError when none, or more than one, gives its results."""
    name = f"transformers.models.{model_type}.modeling_{model_type}"
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        import transformers

        raise ValueError(f"transformers {transformers.__version__} has no {model_type} model "
                         f"({e}); pass convention= one of {_positions.MROPE_CONVENTIONS} "
                         "explicitly") from None
    decided = _DECIDED.get((model_type, module))
    if decided is None:
        from .hf import _plain_mode

        with _plain_mode():
            decided = _DECIDED[(model_type, module)] = _decide(model_type, module)
    convention, reason = decided
    if convention is None:
        import transformers

        raise ValueError(f"the position-id rules of transformers {transformers.__version__} "
                         f"for {model_type} are not one posenc_torch follows: {reason}; pass "
                         f"convention= one of {_positions.MROPE_CONVENTIONS} explicitly")
    return convention


def install(handle, model_types: tuple[str, ...]) -> None:
    """Replace ``get_rope_index`` for the Qwen-VL types among ``model_types`` (the
    ``posenc_torch.hf.INSTALLERS`` interface); ``handle.undo()`` restores it.  A type whose
    installed ``get_rope_index`` follows none of the conventions (or several) keeps it,
    with one warning."""
    from .hf import UnsupportedModelWarning

    for mt in model_types:
        if mt not in MODEL_TYPES:
            continue
        try:
            convention = installed_convention(mt)
        except ValueError as e:
            warnings.warn(f"posenc_torch.hf.patch leaves {mt}.{_NAME} to transformers: {e}",
                          UnsupportedModelWarning, stacklevel=3)
            continue
        module = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
        owner = _owner_class(module)
        original = vars(owner)[_NAME]
        target = f"{mt}.{_NAME}"
        handle._add_counters(target)
        wrapper = _make(original, handle, target, mt, convention)
        wrapper.__doc__ = (f"posenc_torch replacement for transformers' {owner.__qualname__}."
                           f"{_NAME}; see posenc_torch._hf_positions.")
        handle.install(owner, _NAME, wrapper, target)


_installed.provide("convention", installed_convention)
