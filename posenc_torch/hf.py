"""Use posenc_torch inside Hugging Face transformers models with one line.

    import posenc_torch.hf
    handle = posenc_torch.hf.patch()      # before building / compiling the model
    ...                                    # train or run as usual
    print(handle.calls)                    # proof that the posenc functions ran
    handle.undo()                          # or: with posenc_torch.hf.patch(): ...

``patch`` replaces the module-level rotary functions that the attention layers of
transformers' Llama, Qwen2, Qwen2-VL, Qwen2.5-VL and Qwen3-VL look up when they run:

* ``apply_rotary_pos_emb`` (decoder attention; in transformers 5.x also Qwen2-VL and
  Qwen2.5-VL, whose rotary module merges the M-RoPE sections into plain tables),
* ``apply_multimodal_rotary_pos_emb`` (Qwen2-VL / Qwen2.5-VL decoder attention in 4.x),
* ``apply_rotary_pos_emb_vision`` (the vision towers).

Which of these a model's attention calls differs between transformers versions, so
``patch`` reads it from the code of the installed version (the global names that the
model file's classes load at run time) and patches exactly those; a missing function or
a model file whose attention calls none of them is an error, never a silent no-op.

transformers 5.x decorates ``apply_rotary_pos_emb`` with a hub-kernel decorator and the
attention classes with ``use_kernelized_func(apply_rotary_pos_emb)``.  Those decorators
only record the function object (for ``kernels.kernelize``); the attention ``forward``
still calls the module-level name on every call, so replacing that name is what takes
effect, with or without the ``kernels`` package installed.

The rotary *modules* (which compute cos/sin once per forward pass) are left alone: their
tables are computed once per forward and shared by every layer, so the cost that grows
with depth is the rotation, and keeping transformers' own tables keeps the patched model's
cos/sin bit-identical to the unpatched one.

Inputs the posenc kernels do not take (tensors on another device than the CPU, other
shapes than transformers' own layouts, an ``mrope_section`` that does not fit the head
size) go to the original transformers function unchanged (``fallback=True``, the
default), so the patch never changes what a model computes or which errors it raises;
``handle.fallbacks`` counts those calls.  With ``fallback=False`` they raise posenc's
error instead.

Patch before ``torch.compile``.  torch.compile guards the global functions it traced,
so patching (or undoing) after compiling recompiles every compiled region on its next call;
patching first compiles once.  Exported or ahead-of-time compiled programs
(``torch.export``, AOTInductor) keep the functions they traced.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import types
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch

from . import rope as _rope
from ._checks import KERNEL_DEVICES

__all__ = ["SUPPORTED_MODEL_TYPES", "PatchHandle", "patch"]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_VISION_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})

_TEXT = "apply_rotary_pos_emb"
_MULTIMODAL = "apply_multimodal_rotary_pos_emb"
_VISION = "apply_rotary_pos_emb_vision"
_ROTARY_NAMES = (_TEXT, _MULTIMODAL, _VISION)

_FLOAT = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_VISION_FLOAT = (torch.float32, torch.bfloat16, torch.float16)

# (module name, attribute) -> the handle whose wrapper is installed there.
_ACTIVE: dict[tuple[str, str], PatchHandle] = {}


class PatchHandle:
    """What ``patch`` installed; undoes it with ``undo()`` or at the end of a ``with`` block.

    Attributes:
        model_types: the model types that were patched.
        targets: ``"<model_type>.<function>"`` for every function that was replaced.
        calls: per target, how many calls the posenc kernels computed.
        fallbacks: per target, how many calls went to the original transformers function
            (inputs posenc does not take, see the module docstring).
        Both are empty when ``patch(count=False)``.
    """

    def __init__(self, model_types: tuple[str, ...], fallback: bool, count: bool) -> None:
        self.model_types = model_types
        self.fallback = fallback
        self.count = count
        # One int64 scalar tensor per counter, bumped in place by the replacements: an
        # in-place add is traced into compiled graphs like any other op, so counting
        # neither breaks a graph nor (as a Python int would) makes torch.compile guard
        # on, and recompile for, every new count.
        self._calls: dict[str, torch.Tensor] = {}
        self._fallbacks: dict[str, torch.Tensor] = {}
        # (module, attribute, original, wrapper, target)
        self._installed: list[tuple[types.ModuleType, str, Callable, Callable, str]] = []
        self._targets: list[str] = []

    @property
    def calls(self) -> dict[str, int]:
        """Per replaced function, how many calls the posenc kernels computed."""
        return {target: int(n) for target, n in self._calls.items()}

    @property
    def fallbacks(self) -> dict[str, int]:
        """Per replaced function, how many calls went to the original function."""
        return {target: int(n) for target, n in self._fallbacks.items()}

    @property
    def targets(self) -> tuple[str, ...]:
        """``"<model_type>.<function>"`` for every function ``patch`` replaced."""
        return tuple(self._targets)

    @property
    def active(self) -> bool:
        """True until ``undo()``."""
        return bool(self._installed)

    def reset_counts(self) -> None:
        """Set every counter in ``calls`` and ``fallbacks`` back to zero."""
        for counter in (*self._calls.values(), *self._fallbacks.values()):
            counter.zero_()

    def undo(self) -> None:
        """Put the original transformers functions back.  Calling it again does nothing.

        A function that someone else replaced after ``patch`` is left as it is (with a
        warning) rather than overwritten.
        """
        while self._installed:
            module, name, original, wrapper, target = self._installed.pop()
            _ACTIVE.pop((module.__name__, name), None)
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)
            else:
                warnings.warn(
                    f"{module.__name__}.{name} was replaced by someone else after "
                    "posenc_torch.hf.patch(); leaving it as it is", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return (f"PatchHandle({state}, model_types={list(self.model_types)}, "
                f"calls={self.calls}, fallbacks={self.fallbacks})")


# ---------------------------------------------------------------------------------------
# Which inputs the posenc kernels take.  Plain metadata checks (no data access), so that
# torch.compile traces them into guards instead of breaking the graph.


def _float_cpu(dtypes: tuple, *tensors: object) -> bool:
    for t in tensors:
        if (not isinstance(t, torch.Tensor) or t.device.type not in KERNEL_DEVICES
                or t.dtype not in dtypes):
            return False
    return True


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _qk_tables_fit(q, k, cos, sin, unsqueeze_dim, table_dims: int) -> bool:
    """q, k (B, H, T, D) or (B, T, H, D); cos, sin (..., Bc, T, D) of one dtype."""
    if not (_is_int(unsqueeze_dim) and unsqueeze_dim in (1, 2, -3, -2)):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != table_dims or sin.shape != cos.shape:
        return False
    if sin.dtype != cos.dtype:
        return False
    seq_dim = 2 if unsqueeze_dim in (1, -3) else 1
    batch, seq, dim = q.shape[0], q.shape[seq_dim], q.shape[3]
    return (k.shape[0] == batch and k.shape[seq_dim] == seq and k.shape[3] == dim
            and cos.shape[-3] in (1, batch) and cos.shape[-2] == seq
            and cos.shape[-1] == dim and dim % 2 == 0 and dim >= 2)


def _text_supported(q, k, cos, sin, unsqueeze_dim) -> bool:
    return _float_cpu(_FLOAT, q, k, cos, sin) and _qk_tables_fit(q, k, cos, sin, unsqueeze_dim, 3)


def _multimodal_supported(q, k, cos, sin, mrope_section, unsqueeze_dim) -> bool:
    if not (_float_cpu(_FLOAT, q, k, cos, sin)
            and _qk_tables_fit(q, k, cos, sin, unsqueeze_dim, 4) and cos.shape[0] == 3):
        return False
    if not isinstance(mrope_section, (list, tuple)) or len(mrope_section) != 3:
        return False
    if not all(_is_int(s) and s >= 0 for s in mrope_section):
        return False
    return 2 * sum(mrope_section) == cos.shape[-1]


def _vision_supported(q, k, cos, sin) -> bool:
    if not (_float_cpu(_VISION_FLOAT, q, k) and _float_cpu(_FLOAT, cos, sin)):
        return False
    if q.dim() != 3 or k.dim() != 3 or cos.dim() != 2 or sin.shape != cos.shape:
        return False
    n, dim = q.shape[0], q.shape[2]
    return (k.shape[0] == n and k.shape[2] == dim and cos.shape[0] == n
            and cos.shape[1] == dim and dim % 2 == 0 and dim >= 2)


# ---------------------------------------------------------------------------------------
# Replacements.  Each takes the call forms transformers uses, counts, and either runs the
# posenc op or hands the call to the original function.


def _make_text(original: Callable, handle: PatchHandle, target: str) -> Callable:
    calls, fallbacks = handle._calls.get(target), handle._fallbacks.get(target)
    count, fallback = handle.count, handle.fallback

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        # transformers <= 4.x: (q, k, cos, sin, position_ids=None, unsqueeze_dim=1) with
        # position_ids unused; 5.x: (q, k, cos, sin, unsqueeze_dim=1).  A fifth positional
        # int is unsqueeze_dim, anything else there is the unused position_ids.
        if _is_int(position_ids):
            unsqueeze_dim = position_ids
        if fallback and not _text_supported(q, k, cos, sin, unsqueeze_dim):
            if count:
                fallbacks.add_(1)
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        if count:
            calls.add_(1)
        return _rope.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    return apply_rotary_pos_emb


def _make_multimodal(original: Callable, handle: PatchHandle, target: str) -> Callable:
    calls, fallbacks = handle._calls.get(target), handle._fallbacks.get(target)
    count, fallback = handle.count, handle.fallback

    def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        if fallback and not _multimodal_supported(q, k, cos, sin, mrope_section, unsqueeze_dim):
            if count:
                fallbacks.add_(1)
            return original(q, k, cos, sin, mrope_section, unsqueeze_dim=unsqueeze_dim)
        if count:
            calls.add_(1)
        return _rope.apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section,
                                                     unsqueeze_dim=unsqueeze_dim)

    return apply_multimodal_rotary_pos_emb


def _make_vision(original: Callable, handle: PatchHandle, target: str) -> Callable:
    calls, fallbacks = handle._calls.get(target), handle._fallbacks.get(target)
    count, fallback = handle.count, handle.fallback

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        if fallback and not _vision_supported(q, k, cos, sin):
            if count:
                fallbacks.add_(1)
            return original(q, k, cos, sin)
        if count:
            calls.add_(1)
        return _rope.apply_rotary_pos_emb_vision(q, k, cos, sin)

    return apply_rotary_pos_emb_vision


_FACTORIES = {_TEXT: _make_text, _MULTIMODAL: _make_multimodal, _VISION: _make_vision}


# ---------------------------------------------------------------------------------------
# Finding what the installed transformers' attention calls.


def _global_loads(code: types.CodeType) -> set[str]:
    """Global names loaded by ``code`` and the functions nested in it."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname == "LOAD_GLOBAL"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_loads(const)
    return names


def _code_of(obj: object) -> types.CodeType | None:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    if not callable(obj):
        return None
    obj = inspect.unwrap(obj)
    return getattr(obj, "__code__", None)


def _callers(module: types.ModuleType) -> dict[str, list[str]]:
    """For each rotary name: the qualified names of the module's functions and methods
    whose code looks that name up in the module globals (i.e. calls it at run time)."""
    found: dict[str, list[str]] = {name: [] for name in _ROTARY_NAMES}

    def scan(qualname: str, obj: object) -> None:
        code = _code_of(obj)
        if code is None:
            return
        for name in _global_loads(code) & found.keys():
            found[name].append(qualname)

    for attr, value in vars(module).items():
        if isinstance(value, type) and value.__module__ == module.__name__:
            for meth_name, meth in vars(value).items():
                scan(f"{value.__name__}.{meth_name}", meth)
        elif (isinstance(value, types.FunctionType) and value.__module__ == module.__name__
              and attr not in _ROTARY_NAMES):
            scan(attr, value)
    return found


def _modeling_module(model_type: str) -> types.ModuleType:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("posenc_torch.hf.patch needs transformers installed") from e
    name = f"transformers.models.{model_type}.modeling_{model_type}"
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise RuntimeError(
            f"posenc_torch.hf.patch: cannot import {name} from transformers "
            f"{transformers.__version__} ({e}); model type {model_type!r} needs a transformers "
            "version that has it (4.57 or 5.x)") from e


def _plan(model_type: str, module: types.ModuleType) -> list[str]:
    """The rotary names to replace in ``module``; raises if the layout is not understood."""
    import transformers

    where = f"{module.__name__} (transformers {transformers.__version__})"
    callers = _callers(module)
    names = [name for name in _ROTARY_NAMES if callers[name]]
    for name in names:
        if not callable(getattr(module, name, None)):
            raise RuntimeError(
                f"posenc_torch.hf.patch: {', '.join(callers[name])} in {where} call {name}, "
                "but the module has no such function")
    if _TEXT not in names and _MULTIMODAL not in names:
        missing = [n for n in (_TEXT, _MULTIMODAL) if not hasattr(module, n)]
        raise RuntimeError(
            f"posenc_torch.hf.patch: no attention in {where} calls {_TEXT} or {_MULTIMODAL} "
            f"(absent from the module: {missing or 'none'}); this transformers version "
            f"computes the {model_type} decoder rotary embedding in a way posenc_torch does "
            "not know, so patching it would do nothing")
    if model_type in _VISION_MODEL_TYPES and _VISION not in names:
        raise RuntimeError(
            f"posenc_torch.hf.patch: the vision attention in {where} does not call {_VISION}"
            f"{'' if hasattr(module, _VISION) else ' (absent from the module)'}; this "
            "transformers version is not supported for the vision tower")
    return names


def _normalize(model_types: str | Iterable[str] | None) -> tuple[str, ...]:
    if model_types is None:
        return SUPPORTED_MODEL_TYPES
    if isinstance(model_types, str):
        model_types = [model_types]
    out: list[str] = []
    for mt in model_types:
        if not isinstance(mt, str):
            raise TypeError(f"model_types must be strings, got {type(mt).__name__}")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {mt!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        if mt not in out:
            out.append(mt)
    if not out:
        raise ValueError("model_types is empty")
    return tuple(out)


def patch(model_types: str | Sequence[str] | None = None, *,
          fallback: bool = True, count: bool = True) -> PatchHandle:
    """Make transformers models use the posenc rotary kernels.

    Args:
        model_types: one or more of ``SUPPORTED_MODEL_TYPES`` ("llama", "qwen2",
            "qwen2_vl", "qwen2_5_vl", "qwen3_vl"), i.e. ``model.config.model_type``;
            None patches all of them.
        fallback: hand inputs the posenc kernels do not take (non-CPU tensors, shapes other
            than transformers' layouts, an ``mrope_section`` that does not fit) to the
            original transformers function (True), or raise posenc's error (False).
        count: keep ``handle.calls`` / ``handle.fallbacks``.  Each counter is a CPU scalar
            tensor bumped in place, which compiled graphs include as a tiny op; pass False
            to leave it out (e.g. for CUDA graphs on the fallback path).

    Returns:
        A ``PatchHandle``; ``handle.undo()`` (or leaving ``with patch(...):``) restores the
        original functions; ``handle.calls`` / ``handle.fallbacks`` count the calls per
        replaced function.

    Raises:
        ValueError: an unknown model type.
        RuntimeError: the installed transformers lacks the model, its attention calls none
            of the rotary functions posenc replaces, or a function is already patched by
            another active handle.

    Call it before ``torch.compile`` (patching later recompiles the compiled regions on
    their next call).  It patches the functions in transformers' modules, so it affects
    every model of those types in the process, including ones built before the call.
    """
    types_ = _normalize(model_types)
    plans = [(mt, module, _plan(mt, module))
             for mt in types_ for module in (_modeling_module(mt),)]
    for mt, module, names in plans:
        for name in names:
            owner = _ACTIVE.get((module.__name__, name))
            if owner is not None:
                raise RuntimeError(
                    f"posenc_torch.hf.patch: {mt}.{name} is already patched by {owner!r}; "
                    "undo that handle first")
    handle = PatchHandle(types_, bool(fallback), bool(count))
    for mt, module, names in plans:
        for name in names:
            target = f"{mt}.{name}"
            original = getattr(module, name)
            if handle.count:
                handle._calls[target] = torch.zeros((), dtype=torch.int64)
                handle._fallbacks[target] = torch.zeros((), dtype=torch.int64)
            wrapper = _FACTORIES[name](original, handle, target)
            wrapper.__module__ = __name__
            wrapper.__qualname__ = f"patched.{mt}.{name}"
            wrapper.__doc__ = (f"posenc_torch replacement for transformers' {mt} {name}; "
                               "see posenc_torch.hf.")
            wrapper.posenc_original = original
            setattr(module, name, wrapper)
            _ACTIVE[(module.__name__, name)] = handle
            handle._installed.append((module, name, original, wrapper, target))
            handle._targets.append(target)
    return handle
