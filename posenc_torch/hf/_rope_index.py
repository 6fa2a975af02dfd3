"""The Qwen-VL ``get_rope_index`` of transformers: which convention it follows, decided by
running it, and its replacement by posenc's position walk.

``posenc_torch.hf.patch()`` runs :func:`install` for the model types it patches.  For
``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl`` and ``qwen3_vl_moe`` it replaces the
``get_rope_index`` method of the class that defines it in the installed transformers
(``<Model>Model`` in 4.57 and 5.x) with a wrapper that computes the same position ids and
deltas with :func:`posenc_torch.compute_mrope_position_ids` under the convention ("4.57",
"5.17" or "5.18") the installed method follows, bit for bit, dtypes included.

Which convention is decided by behaviour (:func:`installed_convention`, which also answers
the core's ``convention="installed"`` through ``posenc_torch._installed``): the installed
method and the walk of each convention run on a fixed set of prompts, a few written to tell
the conventions apart and more drawn from a fixed seed (images of one and two frames,
videos of 1 to 16 frames, spatial merge sizes 1, 2 and 4 through stand-in configs,
fractional seconds per grid, several images per row, left and right padding, attention
masks with holes, text-only rows); exactly one convention must give the method's results,
dtypes included, on all of them, else the method is kept with one warning.  The verdict is
kept while the method, the other methods of its class (which it calls), and everything they
read stay the same (``_verdicts``); it is re-decided when any of it changes.

Inputs on another device are copied to the CPU once, walked there, and the results copied
back once.  Calls the walk does not take go to the original method unchanged and count in
``handle.fallbacks`` (with ``fallback=False`` they raise posenc's error instead): no
``input_ids``, arguments that do not bind to the original signature, grids that disagree
with the tokens (transformers raises on most of those, or ignores extra grids), values
outside 0/1 in the mask or 0/1/2 in ``mm_token_type_ids``, and, for Qwen2.5-VL, seconds
per grid that 5.18+ would compute in another precision (a Python list, float16/bfloat16) or
a ``tokens_per_second`` that 5.17 cannot use (not a Python int).
"""

from __future__ import annotations

import copy
import inspect
import random
import types
import warnings
from collections.abc import Callable

import torch

from .. import _installed
from .. import positions as _positions
from .._tables import CONVENTIONS, MROPE_MODELS, MROPE_QWEN3_VL
from . import _transformers, _verdicts
from ._handle import UnsupportedModelWarning, bump

#: The model types whose get_rope_index is replaced.
MODEL_TYPES = tuple(MROPE_MODELS)
_NAME = "get_rope_index"


class _Skip(Exception):
    """The call goes to transformers' original method."""


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




def _stand_in(owner: type, config) -> types.SimpleNamespace:
    """An object holding ``config`` and the owner class's other methods (5.x's
    get_rope_index calls ``self.get_vision_position_ids``), on which get_rope_index runs
    without building a model."""
    obj = types.SimpleNamespace(config=config)
    for name, value in vars(owner).items():
        if isinstance(value, types.FunctionType) and not name.startswith("__"):
            setattr(obj, name, value.__get__(obj))
    return obj


class _Prompts:
    """get_rope_index keyword arguments laid out as the processors lay prompts out."""

    def __init__(self, model: str, config) -> None:
        self.model, self.config = model, config
        self.image, self.video = config.image_token_id, config.video_token_id
        self.start = config.vision_start_token_id
        end = getattr(config, "vision_end_token_id", None)
        self.end = self.start + 1 if end is None else end
        special = {self.image, self.video, self.start, self.end}
        self.text_ids = [i for i in range(3, 60) if i not in special]
        self.merge = config.vision_config.spatial_merge_size
        self.per_frame = MROPE_MODELS[model].mrope == MROPE_QWEN3_VL
        self.reads_seconds = MROPE_MODELS[model].reads_seconds

    def text(self, n: int, offset: int) -> list[int]:
        return [self.text_ids[(offset + j) % len(self.text_ids)] for j in range(n)]

    def vision(self, token: int, grid: tuple[int, int, int]) -> list[int]:
        t, h, w = grid
        run = (h // self.merge) * (w // self.merge)
        if token == self.video and self.per_frame:  # <timestamp> <start> frame <end>
            return [tok for f in range(t)
                    for tok in self.text(2, f) + [self.start] + [token] * run + [self.end]]
        return [self.start] + [token] * (t * run) + [self.end]

    def batch(self, rows: list[list[int]], images, videos, mask=True, seconds=None,
              left=True, holes: list[list[int]] | None = None) -> dict:
        width = max(map(len, rows))
        pad = [[0] * (width - len(r)) for r in rows]
        ids = torch.tensor([p + r if left else r + p for r, p in zip(rows, pad, strict=True)])
        masks = [[0] * len(p) + [1] * len(r) if left else [1] * len(r) + [0] * len(p)
                 for r, p in zip(rows, pad, strict=True)]
        for row, cols in zip(masks, holes or [], strict=False):
            for col in cols:
                row[col] = 0
        kw = dict(input_ids=ids,
                  image_grid_thw=torch.tensor(images) if images else None,
                  video_grid_thw=torch.tensor(videos) if videos else None,
                  attention_mask=torch.tensor(masks) if mask else None,
                  mm_token_type_ids=(ids == self.image).long() + 2 * (ids == self.video).long())
        if self.reads_seconds:
            kw["second_per_grid_ts"] = (torch.tensor(seconds, dtype=torch.float32)
                                        if seconds else None)
        return kw

    def fixed(self) -> list[tuple[str, dict]]:
        """Prompts that tell the conventions apart: left padding (padded slots, deltas over
        padded or real length); a video of more frames than rows and columns followed by
        text (where text resumes); an image of two frames (Qwen2.5-VL's image temporal
        index); 0.5 seconds per grid (truncated by 4.57 and 5.17, kept by 5.18); a row
        without vision and the call without grids; no mask."""
        m = self.merge
        img, img2, vid = (1, 2 * m, 4 * m), (2, 2 * m, 2 * m), (6, 2 * m, 2 * m)
        text, vision, image, video = self.text, self.vision, self.image, self.video
        mixed = [text(3, 0) + vision(image, img) + text(2, 1) + vision(video, vid) + text(3, 2),
                 text(5, 3) + vision(image, img2) + text(2, 4)]
        seconds = [0.5] if self.reads_seconds else None
        return [
            ("image and video rows, left padding",
             self.batch(mixed, [img, img2], [vid], True, seconds)),
            ("the same without attention_mask",
             self.batch(mixed, [img, img2], [vid], False, seconds)),
            ("a text row beside an image row",
             self.batch([text(4, 5), text(2, 6) + vision(image, img)], [img], None)),
            ("text only, left padding, no grids",
             self.batch([text(6, 7), text(3, 8)], None, None)),
        ]

    def drawn(self, rng: random.Random, frames: list[int], count: int) -> list[tuple[str, dict]]:
        """At least ``count`` batches drawn from ``rng``: 1 to 3 rows of text runs, images
        (1 or 2 frames) and videos (the frame counts taken in turn from ``frames``, until
        each was used), left or right padding, holes in the mask over text tokens, seconds
        from a fractional set."""
        m, out, n = self.merge, [], 0
        while n < count or frames:  # until every frame count was drawn
            rows, holes, images, videos, seconds = [], [], [], [], []
            for r in range(rng.randint(1, 3)):
                row, text_at = [], []
                for _ in range(rng.randint(1, 4)):
                    what = rng.choice(("text", "image", "video") if n < count else ("video",))
                    if what == "image" or what == "video":
                        grid = ((rng.choice((1, 2)) if what == "image" else frames.pop(0)
                                 if frames else rng.randint(1, 16)),
                                m * rng.randint(1, 3), m * rng.randint(1, 3))
                        (images if what == "image" else videos).append(grid)
                        if what == "video":
                            seconds.append(rng.choice((0.25, 0.5, 1.0, 1.5, 2.0, 3.0)))
                        row += self.vision(self.image if what == "image" else self.video, grid)
                    k = rng.randint(1, 5)
                    text_at += range(len(row), len(row) + k)
                    row += self.text(k, r + n)
                rows.append(row)
                holes.append(text_at)
            left = rng.random() < 0.5
            width = max(map(len, rows))
            # holes: one or two masked-out text tokens in some rows (mask positions)
            hole_cols = []
            for row, text_at in zip(rows, holes, strict=True):
                offset = width - len(row) if left else 0
                chosen = rng.sample(text_at, min(len(text_at), rng.choice((0, 0, 1, 2))))
                hole_cols.append([offset + c for c in chosen])
            label = (f"drawn batch {n} (merge size {m}, {'left' if left else 'right'} padding, "
                     f"images {images}, videos {videos})")
            out.append((label, self.batch(rows, images, videos, True,
                                          seconds if videos else None, left, hole_cols)))
            n += 1
        return out


def _identical(ours: tuple, theirs: object) -> bool:
    if not (isinstance(theirs, tuple) and len(theirs) == 2
            and all(isinstance(t, torch.Tensor) for t in theirs)):
        return False
    return all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
               for a, b in zip(ours, theirs, strict=True))


# The special tokens of the released Qwen-VL checkpoints, for configs that leave them unset.
_QWEN_TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656,
                   "vision_start_token_id": 151652, "vision_end_token_id": 151653}
_MERGE_SIZES = (1, 2, 4)
_DRAWN_PER_MERGE_SIZE = 6


def _configs(model_type: str) -> list:
    """The model type's default config as stand-ins with each spatial merge size."""
    config = _transformers.default_config(model_type)
    for name, value in _QWEN_TOKEN_IDS.items():  # some releases leave them unset
        if getattr(config, name, None) is None:
            setattr(config, name, value)
    out = []
    for merge in _MERGE_SIZES:
        variant = copy.deepcopy(config)
        variant.vision_config.spatial_merge_size = merge
        out.append(variant)
    return out


def prompts(model_type: str) -> list[tuple[str, object, dict]]:
    """(label, config, get_rope_index keyword arguments) of every probe prompt."""
    rng = random.Random(25)
    out = []
    for config in _configs(model_type):
        p = _Prompts(model_type, config)
        frames = list(range(1, 17))
        rng.shuffle(frames)
        out += [(label, config, kw) for label, kw in p.fixed()]
        out += [(label, config, kw)
                for label, kw in p.drawn(rng, frames, _DRAWN_PER_MERGE_SIZE)]
    return out


def _decide(model_type: str, owner: type, original: Callable) -> tuple[str | None, str]:
    """(the convention whose walk gives what ``original`` gives on every probe prompt, "")
    or (None, why none or several do)."""
    model = model_type
    try:
        params = inspect.signature(original).parameters
        cases = prompts(model)
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
    for label, config, kw in cases:
        obj = _stand_in(owner, config)
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
        named = _positions.convention_for_version(_transformers.version())
    except ValueError:
        named = convention
    if CONVENTIONS[named].same_rules_for(CONVENTIONS[convention], reads_seconds):
        convention = named
    return convention, ""


def _owner_and_original(model_type: str) -> tuple[type, Callable]:
    module = _transformers.modeling_module(model_type)
    owner = _transformers.owner_class(module, _NAME)
    original = vars(owner)[_NAME]
    return owner, getattr(original, "posenc_original", original)


def _key(model_type: str, owner: type, original: Callable) -> tuple:
    """Everything the decision depends on: the method, the class's other methods (which it
    calls through ``self``), the config class the stand-ins are built from."""
    methods = tuple((name, _verdicts.behaviour_key(value)) for name, value in
                    sorted(vars(owner).items())
                    if isinstance(value, types.FunctionType) and name != _NAME)
    config_class = type(_transformers.default_config(model_type))
    return (model_type, _verdicts.behaviour_key(original), methods,
            _verdicts.behaviour_key(config_class))


def installed_convention(model_type: str) -> str:
    """The convention whose rules the installed transformers' ``get_rope_index`` of
    ``model_type`` follows, found by running it on the probe prompts (kept while the
    method and what it reads stay the same).  ValueError when none, or more than one,
    gives its results, or when this transformers has no such model."""
    try:
        owner, original = _owner_and_original(model_type)
        key = _key(model_type, owner, original)
    except (_transformers.Unsupported, ImportError) as e:
        raise ValueError(f"{e}; pass convention= one of {_positions.MROPE_CONVENTIONS} "
                         "explicitly") from None
    convention, reason = _verdicts.decided(
        _NAME, key, lambda: _decide(model_type, owner, original), account=_NAME)
    if convention is None:
        raise ValueError(f"the position-id rules of transformers {_transformers.version()} "
                         f"for {model_type} are not one posenc_torch follows: {reason}; pass "
                         f"convention= one of {_positions.MROPE_CONVENTIONS} explicitly")
    return convention


def install(handle, model_types: tuple[str, ...]) -> None:
    """Replace ``get_rope_index`` for the Qwen-VL types among ``model_types``;
    ``handle.undo()`` restores it.  A type whose installed ``get_rope_index`` follows none
    of the conventions (or several) keeps it, with one warning."""
    for mt in model_types:
        if mt not in MODEL_TYPES:
            continue
        try:
            convention = installed_convention(mt)
        except ValueError as e:
            warnings.warn(f"posenc_torch.hf.patch leaves {mt}.{_NAME} to transformers: {e}",
                          UnsupportedModelWarning, stacklevel=3)
            continue
        owner, _ = _owner_and_original(mt)
        original = vars(owner)[_NAME]
        target = f"{mt}.{_NAME}"
        handle._add_counters(target)
        wrapper = _make(original, handle, target, mt, convention)
        wrapper.__doc__ = (f"posenc_torch replacement for transformers' {owner.__qualname__}."
                           f"{_NAME}; see posenc_torch.hf.")
        handle.install(owner, _NAME, wrapper, target)


_installed.provide("convention", installed_convention)
