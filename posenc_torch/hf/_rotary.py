"""The rotary functions of transformers' attention, replaced: which inputs the posenc
kernels take, the replacements themselves, and the decision which function of a model
file is replaced (its source form, the branch rule, the probe)."""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from .. import rope as _rope
from .._checks import KERNEL_DEVICES
from .._tables import MODELS
from . import _forms, _probe, _transformers, _verdicts
from ._forms import HALF as _HALF
from ._forms import Form as _Form
from ._handle import PatchHandle, bump
from ._handle import to_original as _to_original
from ._probe import FLOAT as _FLOAT
from ._probe import VISION_FLOAT as _VISION_FLOAT

TEXT = "apply_rotary_pos_emb"
MULTIMODAL = "apply_multimodal_rotary_pos_emb"
VISION = "apply_rotary_pos_emb_vision"
INTERLEAVE = "apply_rotary_pos_emb_interleave"
ROTARY_NAMES = (TEXT, MULTIMODAL, VISION, INTERLEAVE)
_VISION_MODEL_TYPES = frozenset(name for name, m in MODELS.items() if m.vision_rotary)


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


def _rotary_width(form: _Form, width: int) -> int:
    """The width of the tables the posenc op gets, from the width of the caller's cos."""
    if form.table == "first_half_interleaved":
        return 2 * (width // 2)
    if form.table == "doubled":
        return 2 * width
    return width


def _qk_tables_fit(q, k, cos, sin, unsqueeze_dim, table_dims: int, form: _Form) -> bool:
    """q, k (B, H, T, D) or (B, T, H, D); cos, sin (..., Bc, T, W) of one dtype."""
    if not (_is_int(unsqueeze_dim) and unsqueeze_dim in (1, 2, -3, -2)):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != table_dims or sin.shape != cos.shape:
        return False
    if sin.dtype != cos.dtype:
        return False
    seq_dim = 2 if unsqueeze_dim in (1, -3) else 1
    batch, seq, dim = q.shape[0], q.shape[seq_dim], q.shape[3]
    rot = _rotary_width(form, cos.shape[-1])
    width_fits = rot == dim or (form.partial and rot < dim)
    return (k.shape[0] == batch and k.shape[seq_dim] == seq and k.shape[3] == dim
            and cos.shape[-3] in (1, batch) and cos.shape[-2] == seq
            and width_fits and rot % 2 == 0 and rot >= 2)


def _text_supported(form: _Form, q, k, cos, sin, unsqueeze_dim) -> bool:
    if not _float_cpu(_FLOAT, q, k, cos, sin):
        return False
    if form.cast == "fp32_to_q" and (q.dtype != k.dtype or torch.float64 in (q.dtype, cos.dtype)):
        return False  # transformers computes these in fp32 (q.float()); posenc would in fp64
    return _qk_tables_fit(q, k, cos, sin, unsqueeze_dim, 3, form)


def _multimodal_supported(q, k, cos, sin, mrope_section, unsqueeze_dim) -> bool:
    if not (_float_cpu(_FLOAT, q, k, cos, sin)
            and _qk_tables_fit(q, k, cos, sin, unsqueeze_dim, 4, _HALF) and cos.shape[0] == 3):
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




def _rotate_as(form: _Form, q, k, cos, sin, unsqueeze_dim):
    """What transformers' function of this form computes, on the posenc op."""
    if form.table == "first_half_interleaved":
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    elif form.table == "doubled":
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if form.permute == "input":  # channels 0, 2, 4, ... first, then 1, 3, 5, ...
        q = q.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        k = k.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    q_out, k_out = _rope.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim,
                                              pairing=form.pairing)
    if form.permute == "output":
        q_out = q_out.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        k_out = k_out.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    if form.cast == "each":
        return q_out.to(q.dtype), k_out.to(k.dtype)
    if form.cast == "fp32_to_q":
        return q_out.to(q.dtype), k_out.to(q.dtype)
    return q_out, k_out


# ---------------------------------------------------------------------------------------
# Replacements.  Each takes the call forms transformers uses, counts, and either runs the
# posenc op or hands the caller's own arguments to the original function.

# ---------------------------------------------------------------------------------------
# Replacements.  Each takes the call forms transformers uses, counts, and either runs the
# posenc op or hands the caller's own arguments to the original function.

_TEXT_PARAMS = ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim")


def _text_args(args: tuple, kwargs: dict):
    """(q, k, cos, sin, unsqueeze_dim) from a call of ``apply_rotary_pos_emb`` in either
    signature, or None for anything else (left to the original function)."""
    if len(args) == 4 and not kwargs:  # how transformers' attention calls it
        return (*args, 1)
    if len(args) > len(_TEXT_PARAMS):
        return None
    bound = dict(zip(_TEXT_PARAMS, args, strict=False))
    for name, value in kwargs.items():
        if name not in _TEXT_PARAMS or name in bound:
            return None
        bound[name] = value
    if not all(name in bound for name in _TEXT_PARAMS[:4]):
        return None
    unsqueeze_dim = bound.get("unsqueeze_dim", 1)
    # 4.x: (q, k, cos, sin, position_ids=None, unsqueeze_dim=1) with position_ids unused;
    # 5.x: (q, k, cos, sin, unsqueeze_dim=1).  A fifth positional int is unsqueeze_dim.
    if _is_int(bound.get("position_ids")):
        if "unsqueeze_dim" in bound:
            return None
        unsqueeze_dim = bound["position_ids"]
    return bound["q"], bound["k"], bound["cos"], bound["sin"], unsqueeze_dim


def _make_text(original: Callable, handle: PatchHandle, target: str, form: _Form) -> Callable:
    calls, fallbacks = handle._calls.get(target), handle._fallbacks.get(target)
    count, fallback = handle.count, handle.fallback

    def apply_rotary_pos_emb(*args, **kwargs):
        parsed = None if _to_original() else _text_args(args, kwargs)
        if parsed is None or (fallback and not _text_supported(form, *parsed)):
            if count:
                bump(fallbacks)
            return original(*args, **kwargs)
        if count:
            bump(calls)
        return _rotate_as(form, *parsed)

    return apply_rotary_pos_emb


def _make_multimodal(original: Callable, handle: PatchHandle, target: str,
                     form: _Form | None) -> Callable:
    calls, fallbacks = handle._calls.get(target), handle._fallbacks.get(target)
    count, fallback = handle.count, handle.fallback

    def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
        if _to_original() or (fallback and not _multimodal_supported(
                q, k, cos, sin, mrope_section, unsqueeze_dim)):
            if count:
                bump(fallbacks)
            return original(q, k, cos, sin, mrope_section, unsqueeze_dim=unsqueeze_dim)
        if count:
            bump(calls)
        return _rope.apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section,
                                                     unsqueeze_dim=unsqueeze_dim)

    return apply_multimodal_rotary_pos_emb


def _make_vision(original: Callable, handle: PatchHandle, target: str,
                 form: _Form | None) -> Callable:
    calls, fallbacks = handle._calls.get(target), handle._fallbacks.get(target)
    count, fallback = handle.count, handle.fallback

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        if _to_original() or (fallback and not _vision_supported(q, k, cos, sin)):
            if count:
                bump(fallbacks)
            return original(q, k, cos, sin)
        if count:
            bump(calls)
        return _rope.apply_rotary_pos_emb_vision(q, k, cos, sin)

    return apply_rotary_pos_emb_vision


_FACTORIES = {TEXT: _make_text, INTERLEAVE: _make_text, MULTIMODAL: _make_multimodal,
              VISION: _make_vision}


# ---------------------------------------------------------------------------------------
# Deciding.


def _text_ours(form: _Form) -> tuple[Callable, Callable]:
    def ours(*args, **kwargs):
        return _rotate_as(form, *_text_args(args, kwargs))

    def supported(*args, **kwargs):
        parsed = _text_args(args, kwargs)
        return parsed is not None and _text_supported(form, *parsed)

    return ours, supported


def _text_verdict(func: Callable) -> tuple[_Form | None, str | None]:
    """(the form whose posenc path returns what ``func`` returns, None) or (None, why not).

    A function whose source branches (``_forms.branches``) is probed only as the form its
    source is, and refused when its source is none; a branch-free one is probed as every
    known form, and takes the first that agrees on every probe case."""
    syntactic = _forms.form_of(func)
    branching = _forms.branches(func)
    if syntactic is None and branching:
        return None, ("its source is none of the forms posenc_torch knows and can take "
                      f"another path for inputs no probe reaches ({'; '.join(branching[:3])})")
    candidates = [syntactic] if syntactic is not None else list(_forms.DISTINCT_FORMS)
    cases = _probe.text_cases()
    closest = None  # (cases that agreed, reason, form); the first form on ties
    for form in candidates:
        reason, agreed = _probe.first_difference(func, *_text_ours(form), cases)
        if reason is None:
            return form, None
        if closest is None or agreed > closest[0]:
            closest = (agreed, reason, form)
    _, reason, form = closest
    if syntactic is not None:
        what = "its source has a known form, but it does not compute what that form does"
    else:
        what = ("its source is branch-free but none of the forms posenc_torch knows, and it "
                "computes what none of them does")
    return None, f"{what}; closest: {_forms.describe(form)}, where {reason}"


def _other_verdict(name: str, func: Callable) -> str | None:
    """None when the vision / multimodal function ``func`` may be replaced, else why not."""
    if not _forms.is_known(name, func) and _forms.branches(func):
        return ("its source is not the known form of this function and can take another path "
                "for inputs no probe reaches")
    if name == MULTIMODAL:
        ours, supported, cases = (_rope.apply_multimodal_rotary_pos_emb, _multimodal_supported,
                                  _probe.multimodal_cases())
    else:
        ours, supported, cases = (_rope.apply_rotary_pos_emb_vision, _vision_supported,
                                  _probe.vision_cases())
    return _probe.first_difference(func, ours, supported, cases)[0]


def verdict(name: str, func: Callable) -> tuple[_Form | None, str | None]:
    """(form or None, None) when transformers' rotary function ``name`` (``func``, as the
    model module binds it now) may be replaced, else (None, why not); decided once per
    behaviour key (``_verdicts``)."""
    key = _verdicts.behaviour_key(func)
    if name in (TEXT, INTERLEAVE):
        return _verdicts.decided("text", key, lambda: _text_verdict(func))
    return None, _verdicts.decided(name, key, lambda: _other_verdict(name, func))


def _code_of(obj: object) -> types.CodeType | None:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    if not callable(obj):
        return None
    obj = getattr(obj, "__wrapped__", obj)
    return getattr(obj, "__code__", None)


def callers(module: types.ModuleType) -> dict[str, list[str]]:
    """For each rotary name: the qualified names of the module's functions and methods
    whose code looks that name up in the module globals (i.e. calls it at run time)."""
    found: dict[str, list[str]] = {name: [] for name in ROTARY_NAMES}

    def scan(qualname: str, obj: object) -> None:
        code = _code_of(obj)
        if code is None:
            return
        for name in _forms.global_loads(code) & found.keys():
            found[name].append(qualname)

    for attr, value in vars(module).items():
        if isinstance(value, type) and value.__module__ == module.__name__:
            for meth_name, meth in vars(value).items():
                scan(f"{value.__name__}.{meth_name}", meth)
        elif (isinstance(value, types.FunctionType) and value.__module__ == module.__name__
              and attr not in ROTARY_NAMES):
            scan(attr, value)
    return found


def plan(model_type: str, module: types.ModuleType) -> list[tuple[str, _Form | None]]:
    """The rotary names to replace in ``module``, each with its form; raises
    ``Unsupported`` (with the reason) if the installed code is not one posenc runs."""
    Unsupported = _transformers.Unsupported
    release = _transformers.version()
    where = f"{module.__name__} (transformers {release})"
    found = callers(module)
    called = [name for name in ROTARY_NAMES if found[name]]
    for name in called:
        if not callable(getattr(module, name, None)):
            raise Unsupported(f"{', '.join(found[name])} in {where} call {name}, "
                              "but the module has no such function")
    original = model_type in _VISION_MODEL_TYPES or model_type in ("llama", "qwen2")
    decoder = (TEXT, MULTIMODAL) if original else (TEXT,)
    if not original and MULTIMODAL in called:
        raise Unsupported(
            f"the attention in {where} calls {MULTIMODAL}, whose section merge for this "
            "model is not one posenc_torch runs")
    if not any(name in called for name in decoder):
        absent = [n for n in decoder if not hasattr(module, n)]
        raise Unsupported(
            f"no attention in {where} calls {' or '.join(decoder)} "
            f"(absent from the module: {absent or 'none'}); this transformers version "
            f"computes the {model_type} decoder rotary embedding in a way posenc_torch does "
            "not know, so patching it would do nothing")
    if model_type in _VISION_MODEL_TYPES and VISION not in called:
        raise Unsupported(
            f"the vision attention in {where} does not call {VISION}"
            f"{'' if hasattr(module, VISION) else ' (absent from the module)'}; this "
            "transformers version is not supported for the vision tower")
    out: list[tuple[str, _Form | None]] = []
    for name in called:
        if name not in (TEXT, INTERLEAVE) and not original:
            continue
        # Already replaced by an active handle: judge the function it replaced (patch
        # then reports the conflict).
        func = getattr(module, name)
        func = getattr(func, "posenc_original", func)
        form, reason = verdict(name, func)
        if reason is not None:
            raise Unsupported(f"{module.__name__}.{name} (transformers {release}): {reason}")
        out.append((name, form))
    return out


def install(handle: PatchHandle, plans: list[tuple[str, types.ModuleType, list]]) -> None:
    """Install the replacement of every planned function."""
    for mt, module, names in plans:
        for name, form in names:
            target = f"{mt}.{name}"
            original = getattr(module, name)
            handle._add_counters(target)
            wrapper = _FACTORIES[name](original, handle, target, form)
            wrapper.__doc__ = (f"posenc_torch replacement for transformers' {mt} "
                               f"{name}; see posenc_torch.hf.")
            handle.install(module, name, wrapper, target)
