"""The 5.x vision towers' ``vision_utils`` functions: their precomputed keyword arguments,
computed by posenc's C walks (``posenc_torch.vision``) once, in the data path
(``precompute_vision_kwargs``), and ``patch()``'s routes of the calls themselves.

transformers 5.x encoders call ``get_vision_position_ids``, ``get_vision_attention_seqlens``,
``get_vision_window_index``, ``get_vision_interpolation_indices_and_weights`` and
``get_max_seqlen`` with a ``kwargs`` dict, and each returns the entry it finds there instead
of computing it; ``get_image_features`` / ``get_video_features`` take the entries prefixed
``image_`` / ``video_``, so ``model(**batch)`` carries them down.  Which entries, with which
arguments, is decided per model by code identity (:func:`vision_plan`): on the model (or
one built on the meta device from the config), every module of its modeling file whose
``forward`` calls those functions must have a verified row, which holds its plan
(``verify._plans``: the calls that read precomputed entries, their arguments ``grid_thw``,
constants or ``self.<attribute>`` chains, evaluated here on that module), and every planned
function must have its own row.  Otherwise, or when two calls would read one entry, the
model type gets no kwargs (one warning).  The plan is kept per model or config object while
its vision config stays the same.  ``max_seqlen`` entries are given only where transformers
computes them (a flash-attention implementation).  4.57 towers take no precomputed kwargs;
``patch()`` routes their methods instead (``_tower_methods_457``).
"""

from __future__ import annotations

import inspect
import json
import types
import warnings
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import _installed
from .. import vision as _vision
from .._checks import InputError
from . import _digests, _table, _transformers
from ._handle import CallArguments, Decline, original_of, warn_once
from ._rotary import global_loads

# transformers' function -> (posenc's function, the kwargs entries it pops, its outputs)
FUNCTIONS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "get_vision_position_ids": (_vision.get_vision_position_ids, ("position_ids",)),
    "get_vision_cu_seqlens": (_vision.get_vision_cu_seqlens, ("cu_seqlens",)),
    "get_vision_attention_seqlens": (_vision.get_vision_attention_seqlens,
                                     ("cu_seqlens", "max_seqlen")),
    "get_vision_window_index": (_vision.get_vision_window_index,
                                ("window_index", "cu_window_seqlens")),
    "get_vision_interpolation_indices_and_weights": (
        _vision.get_vision_interpolation_indices_and_weights, ("interp_indices", "interp_weights")),
}
_MAX = "get_max_seqlen"
_FAMILY = (*FUNCTIONS, "get_vision_bilinear_indices_and_weights",
           "get_vision_nearest_position_ids", "get_vision_merged_shape")
_GRID = object()  # the grids' place among a call's arguments


class _Refused(Exception):
    """The plan cannot be read off the installed code."""


class Call(NamedTuple):
    """One planned computation: transformers' function ``name`` with ``arguments`` (the
    grids' place marked), the entries it reads (``keys``) and, for ``get_max_seqlen``,
    the call whose boundaries it measures (``of``: its index in the plan)."""

    name: str
    arguments: tuple[tuple[str, object], ...]
    keys: tuple[str, ...]
    of: int | None = None


class VisionPlan(NamedTuple):
    model_type: str
    calls: tuple[Call, ...]
    flash: bool  # max_seqlen entries are given (a flash-attention implementation)

    def kwargs(self, grid_thw: torch.Tensor, prefix: str) -> dict[str, object]:
        """The entries for one modality's grids, prefixed (``image_`` / ``video_``)."""
        out: dict[str, object] = {}
        results: list[tuple] = []
        for call in self.calls:
            if call.name == _MAX:
                cu = results[call.of][-1]
                value = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
                results.append((value,))
                if self.flash:
                    out[prefix + call.keys[0]] = value
                continue
            result = FUNCTIONS[call.name][0](
                **{k: (grid_thw if v is _GRID else v) for k, v in call.arguments})
            result = result if isinstance(result, tuple) else (result,)
            results.append(result)
            for key, value in zip(call.keys, result, strict=True):
                if value is not None:  # max_seqlen: None outside flash-attention
                    out[prefix + key] = value
        return out


# ---------------------------------------------------------------------------------------
# The plan: the verified rows of the towers' forwards, evaluated on the model's modules.

#: The table's function name of a vision-tower ``forward`` whose row holds its plan.
FORWARD = "vision tower forward"


def tower_forwards(module: types.ModuleType) -> list[tuple[type, types.FunctionType]]:
    """(class, forward as its body runs: decorators record) of every class of ``module``
    whose forward calls one of the ``vision_utils`` functions or ``get_max_seqlen``."""
    out = []
    for cls in vars(module).values():
        forward = inspect.unwrap(vars(cls).get("forward", None) or (lambda: None)) \
            if isinstance(cls, type) and cls.__module__ == module.__name__ else None
        if (isinstance(forward, types.FunctionType)
                and global_loads(forward.__code__) & {*_FAMILY, _MAX}):
            out.append((cls, forward))
    return out


def _value(expression: object, module: torch.nn.Module) -> object:
    """An argument of a row's call: the grids' place, ``self.a.b`` on ``module``, or a
    constant (``{"value": v}``)."""
    if expression == "grid_thw":
        return _GRID
    if isinstance(expression, dict):
        return expression["value"]
    value: object = module
    for name in str(expression).split(".")[1:]:
        value = getattr(value, name)
    return value


def _calls_of(sub: torch.nn.Module, use: str, seen: dict[str, int],
              calls: list[Call]) -> None:
    """Append the calls a forward's row lists (``use``: JSON, see ``verify._plans``),
    evaluated on the module ``sub``."""
    start = len(calls)
    for spec in json.loads(use):
        if spec["name"] == _MAX:
            call = Call(_MAX, (), (_value(spec["key"], sub),), start + spec["of"])
        elif spec["name"] in FUNCTIONS:
            call = Call(spec["name"], tuple((p, _value(e, sub)) for p, e in spec["arguments"]),
                        FUNCTIONS[spec["name"]][1])
        else:
            raise _Refused(f"the row names {spec['name']}, which posenc does not precompute")
        for key in call.keys:
            if key in seen:
                raise _Refused(f"two computations read the precomputed {key!r}")
            seen[key] = len(calls)
        calls.append(call)


def _meta_model(config) -> torch.nn.Module:
    transformers = _transformers.module()
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModel.from_config(config)


def _read_plan(model: torch.nn.Module, model_type: str, rows: dict) -> VisionPlan:
    module = _transformers.modeling_module(model_type)
    transformers = _transformers.module()
    generic = getattr(transformers.utils, "generic", None)
    if not hasattr(generic, "accepts_precomputed_kwargs"):
        raise _Refused(f"transformers {_transformers.version()} takes no precomputed "
                       "vision-tower kwargs (its towers compute them in their methods)")
    calls: list[Call] = []
    seen: dict[str, int] = {}
    forwards = dict(tower_forwards(module))
    for sub in model.modules():
        forward = forwards.pop(type(sub), None)  # (the first module of each class)
        if forward is not None:
            row, _ = _table.verified(forward, type(sub), FORWARD, rows)
            _calls_of(sub, row.use, seen, calls)
    if not any(c.name != _MAX for c in calls):
        raise _Refused(f"no module of {module.__name__} reads precomputed vision kwargs")
    config = model.config
    vision_config = getattr(config, "vision_config", config)
    implementation = getattr(vision_config, "_attn_implementation", None) or getattr(
        config, "_attn_implementation", None)
    return VisionPlan(model_type, tuple(calls), bool(implementation and "flash" in implementation))


# ---------------------------------------------------------------------------------------
# The decision, and the plan kept per object.


# id(config or model) -> (fingerprint, plan or why none was read); dropped with the object
_PLANS: dict[int, tuple[tuple, VisionPlan | str]] = {}


def _fingerprint(config) -> tuple:
    """What the plan reads of a config: its vision config's fields, the attention."""
    vision = getattr(config, "vision_config", config)
    return (repr(sorted(vars(vision).items(), key=lambda kv: kv[0])),
            getattr(config, "_attn_implementation", None))


def vision_plan(config_or_model: object) -> VisionPlan | None:
    """The verified plan for this model, or None with one ``UnsupportedModelWarning`` per
    model type and reason."""
    model = config_or_model if isinstance(config_or_model, torch.nn.Module) else None
    config = getattr(config_or_model, "config", None) if model is not None else config_or_model
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise TypeError(f"config_or_model must be a transformers model or config, got "
                        f"{type(config_or_model).__name__}")
    fingerprint = _fingerprint(config)
    known = _PLANS.get(id(config_or_model))
    try:
        module = _transformers.modeling_module(model_type)
        rows = _table.user_rows(None, _transformers.version())
        if known is not None and known[0] == fingerprint:
            found = known[1]
        else:
            try:
                found = _read_plan(model if model is not None else _meta_model(config),
                                   model_type, rows)
            except (_Refused, _digests.Unverified, AttributeError, TypeError, ValueError,
                    KeyError) as e:
                found = f"{e}"
            if known is None:
                weakref.finalize(config_or_model, _PLANS.pop, id(config_or_model), None)
            # (building a model may set fields of its config: read them afterwards)
            _PLANS[id(config_or_model)] = (_fingerprint(config), found)
        # every planned function, as the module binds it now, must be verified too
        for call in () if isinstance(found, str) else found.calls:
            if call.name != _MAX:
                _table.verified(original_of(getattr(module, call.name)), None, call.name, rows)
    except (_digests.Unverified, _transformers.Unsupported, ImportError) as e:
        found = f"{e}"
    if isinstance(found, str):
        warn_once(f"posenc_torch.hf.precompute_vision_kwargs gives no kwargs for {model_type} "
                  f"(transformers {_transformers.version()}): {found}", stacklevel=4)
        return None
    return found


def precompute_vision_kwargs(config_or_model: object, image_grid_thw: torch.Tensor | None = None,
                             video_grid_thw: torch.Tensor | None = None) -> dict[str, object]:
    """The vision tower's keyword arguments the installed transformers accepts for this
    model, computed from the grids by posenc's C walks, for ``model(**batch, **kwargs)``.

    Shapes:
        image_grid_thw, video_grid_thw: (n, 3) integer (t, h, w) patch grids, or None

    Returns ``image_<entry>`` / ``video_<entry>`` for every entry the model's encoder reads
    precomputed (e.g. Qwen2.5-VL: ``position_ids`` (N, 2) int64, ``cu_seqlens`` (S + 1,)
    int32, ``window_index`` (M,) int64, ``cu_window_seqlens`` (W + 1,) int32; Qwen3-VL:
    ``position_ids``, ``cu_seqlens``, ``interp_indices`` (N, 4) int64, ``interp_weights``
    (N, 4) float32; ``max_seqlen`` ints under flash-attention), equal to what the encoder
    would compute; an empty dict (with one ``UnsupportedModelWarning``) for a model whose
    encoder could not be matched (see the module docstring).  A grid absent (None) gives no
    entries of its modality.  Bad grids raise posenc's TypeError / ValueError naming the
    row, ``grid_thw[i]``.
    """
    plan = vision_plan(config_or_model)
    if plan is None:
        return {}
    out: dict[str, object] = {}
    for prefix, grids in (("image_", image_grid_thw), ("video_", video_grid_thw)):
        if grids is None:
            continue
        try:
            out.update(plan.kwargs(grids, prefix))
        except (InputError, RuntimeError) as e:  # posenc's message names grid_thw (row i)
            if "grid_thw" not in str(e):
                raise
            raise type(e)(str(e).replace("grid_thw", f"{prefix}grid_thw")) from e
    return out


_installed.provide("vision_kwargs", precompute_vision_kwargs)


def _computation(name: str, original: Callable) -> Callable:
    """``patch()``'s route of transformers' ``name``: posenc's walk with the caller's
    arguments.  An entry precomputed in ``kwargs``, a grid the walk refuses (posenc's
    InputError), an empty grid list, another call form or a traced call go to the original
    function (which pops a precomputed entry, as before): no result or error changes."""
    binding = CallArguments(original)
    keys, ours = FUNCTIONS[name][1], FUNCTIONS[name][0]

    def compute(*args, **kw):
        arguments = binding.bind(args, kw)
        if arguments is None:
            raise Decline
        given = arguments.pop("kwargs", None)
        if given is not None and any(given.get(k) is not None for k in keys):
            raise Decline(counted=False)  # an entry posenc precomputed: the original pops it
        grid = arguments.get("grid_thw")
        if (torch.compiler.is_compiling() or not isinstance(grid, torch.Tensor)
                or grid.numel() == 0):
            raise Decline  # traced, or no grids: transformers' own answer
        return ours(**arguments)

    return compute


def install(handle, model_types: tuple[str, ...]) -> None:
    """Route the vision_utils functions the modules of ``model_types`` bind (transformers
    5.x; a 4.57 module binds none of them: its towers' methods are routed by
    ``_tower_methods_457.install``), each whose code is verified."""
    for mt in model_types:
        try:
            module = _transformers.modeling_module(mt)
        except _transformers.Unsupported:
            continue
        for name in FUNCTIONS:
            original = vars(module).get(name)
            if original is None:
                continue
            original = original_of(original)
            try:
                _, watch = _table.verified(original, None, name, handle.rows)
            except _digests.Unverified as e:
                warn_once(f"posenc_torch.hf.patch leaves {name} to transformers: {e}",
                          stacklevel=4)
                continue
            handle.replace(module, name, _computation(name, original), f"{mt}.{name}",
                           f"posenc_torch route of transformers' {name} for {mt}; see "
                           "posenc_torch.hf.", watch)
