"""The rotary functions of transformers' attention, replaced: which function of a model
file is replaced (the one its attention calls, whose digest the verified table holds; the
row names its :class:`Form`), which calls posenc computes, and how.

The attention calls ``apply_rotary_pos_emb(q, k, cos, sin)`` (DeepSeek-V3:
``apply_rotary_pos_emb_interleave``), the vision towers ``apply_rotary_pos_emb_vision(q,
k, cos, sin)`` and the 4.x Qwen2-VL / Qwen2.5-VL decoders
``apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section)``.  The row was verified
for that call form over the inputs the verify command's capture covers, so the replacement
computes only such calls whose tensors have the form's layout (q, k (B, H, T, D) of one
dtype, tables (1 or B, T, W) of one dtype and the width W the form takes; the vision and
multimodal layouts likewise) and dtypes among ``DTYPES``; any other call goes to the
original function.
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import rope as _rope
from .._checks import KERNEL_DEVICES
from .._tables import MODELS
from . import _table, _transformers
from ._digests import Unverified, Watch, nested_codes
from ._handle import CallArguments, Decline, PatchHandle, original_of

TEXT = "apply_rotary_pos_emb"
MULTIMODAL = "apply_multimodal_rotary_pos_emb"
VISION = "apply_rotary_pos_emb_vision"
INTERLEAVE = "apply_rotary_pos_emb_interleave"
ROTARY_NAMES = (TEXT, MULTIMODAL, VISION, INTERLEAVE)


class Form(NamedTuple):
    """A rotary form posenc computes, named by the rows of the verified table (its
    reference in plain torch: ``verify._references``).

    layout: the tables' width the form takes ("full", "partial", "half", "vision",
        "sections"; ``verify._graphs.Regime``).
    pairing: "half" (channel j with j + R/2) or "adjacent" (2i with 2i + 1).
    table: "as_given"; "first_half_interleaved" (the first half of the tables, each entry
        twice: GLM, ERNIE-4.5); "doubled" (one half given, used for both: gpt-oss).
    cast: None (result dtype ``result_type(q, cos)``); "each" (q's and k's own dtypes);
        "fp32_to_q" (computed in fp32, both results in q's dtype).
    permute: None; "input" (q, k de-interleaved first: channels 0, 2, 4, ..., then 1, 3,
        5, ...); "output" (adjacent pairs rotated, results de-interleaved).
    """

    name: str
    layout: str
    pairing: str = "half"
    table: str = "as_given"
    cast: str | None = None
    permute: str | None = None


#: The forms of ``apply_rotary_pos_emb`` (and DeepSeek-V3's ``..._interleave``), in the
#: order they are tried (the common ones first).
TEXT_FORMS: tuple[Form, ...] = (
    Form("half", "full"),
    Form("half, partial", "partial"),
    Form("half, each dtype", "full", cast="each"),
    Form("adjacent, fp32", "full", pairing="adjacent", cast="fp32_to_q"),
    Form("adjacent, partial", "partial", pairing="adjacent"),
    Form("adjacent, first half of the tables, partial", "partial", pairing="adjacent",
         table="first_half_interleaved"),
    Form("adjacent, first half of the tables, fp32", "full", pairing="adjacent",
         table="first_half_interleaved", cast="fp32_to_q"),
    Form("half, one half of the tables", "half", table="doubled"),
    Form("half, de-interleaved input", "full", permute="input"),
    Form("adjacent, de-interleaved output", "full", pairing="adjacent",
         table="first_half_interleaved", permute="output"),
)
VISION_FORM = Form("vision", "vision")
SECTIONS_FORM = Form("sections", "sections")
FORMS_BY_NAME = {form.name: form for form in (*TEXT_FORMS, VISION_FORM, SECTIONS_FORM)}
_FORMS = {TEXT: TEXT_FORMS, INTERLEAVE: TEXT_FORMS, VISION: (VISION_FORM,),
          MULTIMODAL: (SECTIONS_FORM,)}
_VISION_MODEL_TYPES = frozenset(name for name, m in MODELS.items() if m.vision_rotary)
#: The (q and k, tables) dtypes of the calls posenc computes; others go to transformers.
DTYPES = tuple((d, t) for d in (torch.float16, torch.bfloat16, torch.float32)
               for t in dict.fromkeys((d, torch.float32)))


# ---------------------------------------------------------------------------------------
# Which calls posenc computes: plain metadata checks (no data access), so that
# torch.compile traces them into guards instead of breaking the graph.


def _fits(form: Form, q, k, cos, sin) -> bool:
    """The tensors have the layout and dtypes the decision covered for ``form``."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if (q.dtype != k.dtype or cos.dtype != sin.dtype or (q.dtype, cos.dtype) not in DTYPES
            or cos.shape != sin.shape):
        return False
    if form.layout == "vision":  # q, k (N, H, D); cos, sin (N, D)
        return (q.dim() == 3 and k.dim() == 3 and cos.dim() == 2 and k.shape[0] == q.shape[0]
                and k.shape[2] == q.shape[2] and cos.shape == (q.shape[0], q.shape[2])
                and q.shape[2] % 2 == 0)
    tables = 4 if form.layout == "sections" else 3
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != tables:
        return False
    batch, _, seq, dim = q.shape
    width = cos.shape[-1]
    if form.layout == "full" or form.layout == "sections":
        # (the de-interleaving reshape's trace holds from a head size of 4 on)
        width_fits = width == dim and dim % 2 == 0 and (form.permute != "input" or dim >= 4)
    elif form.layout == "partial":
        width_fits = width % 2 == 0 and 2 <= width <= dim
    else:  # "half": one half of the tables
        width_fits = 2 * width == dim
    return (width_fits and k.shape[0] == batch and k.shape[2] == seq and k.shape[3] == dim
            and cos.shape[-3] in (1, batch) and cos.shape[-2] == seq
            and (tables == 3 or cos.shape[0] == 3))


def _on_kernel_device(*tensors: torch.Tensor) -> bool:
    return all(t.device.type in KERNEL_DEVICES for t in tensors)


def rotate_as(form: Form, q, k, cos, sin):
    """What ``form``'s reference computes, on the posenc op; q, k (B, H, T, D)."""
    if form.table == "first_half_interleaved":
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    elif form.table == "doubled":
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if form.permute == "input":  # channels 0, 2, 4, ... first, then 1, 3, 5, ...
        q = q.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        k = k.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    q_out, k_out = _rope.apply_rotary_pos_emb(q, k, cos, sin, pairing=form.pairing)
    if form.permute == "output":
        q_out = q_out.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        k_out = k_out.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    if form.cast == "each":
        return q_out.to(q.dtype), k_out.to(k.dtype)
    if form.cast == "fp32_to_q":
        return q_out.to(q.dtype), k_out.to(q.dtype)
    return q_out, k_out


def _run(form: Form, args: tuple):
    if form.layout == "sections":
        return _rope.apply_multimodal_rotary_pos_emb(*args[:4], list(args[4]))
    if form.layout == "vision":
        return _rope.apply_rotary_pos_emb_vision(*args)
    return rotate_as(form, *args)


def _unread(func: Callable) -> frozenset[str]:
    """The parameters ``func``'s code never reads (4.x's ``position_ids``): any value of
    theirs gives the same result, so a call may pass one."""
    code = getattr(func, "__code__", None)
    if code is None:
        return frozenset()
    read = {ins.argval for ins in dis.get_instructions(code)
            if ins.opname.startswith(("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE",
                                      "DELETE_FAST"))}
    return frozenset(set(inspect.signature(func).parameters) - read - set(code.co_cellvars))


def _defaults(func: Callable, arity: int) -> tuple[tuple[str, bool, object], ...]:
    """(name, variadic, default) of each parameter after the first ``arity`` that
    ``func``'s code reads: a call must leave these at their default (``*args`` /
    ``**kwargs``: empty)."""
    unread = _unread(func)
    return tuple((p.name, p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD), p.default)
                 for p in list(inspect.signature(func).parameters.values())[arity:]
                 if p.name not in unread)


def _is_default(value: object, variadic: bool, default: object) -> bool:
    if variadic:
        return not value
    return value is default or (type(value) is type(default) and value == default)


def _computation(form: Form, original: Callable, fallback: bool) -> Callable:
    """``compute`` for ``PatchHandle.replace``: calls that give the original's leading
    parameters (q, k, cos, sin [, mrope_section]) and leave every other that its code reads
    at its default, i.e. calls of the form the decision captured.  Everything it does per
    call is a plain tuple, dict or tensor-metadata operation, so ``torch.compile`` traces
    it in any frame."""
    arity = 5 if form.layout == "sections" else 4
    binding = CallArguments(original)
    leading = binding.positional[:arity]
    defaults = _defaults(original, arity)

    def compute(*args, **kwargs):
        given = binding.bind(args, kwargs)
        if given is None:
            raise Decline  # transformers raises its own error
        if any(name not in given for name in leading) or not all(
                _is_default(given[name], variadic, default)
                for name, variadic, default in defaults if name in given):
            raise Decline
        args = tuple(given[name] for name in leading)
        if form.layout == "sections":
            sections = args[4]
            if not (isinstance(sections, (list, tuple)) and len(sections) == 3
                    and all(type(s) is int and s >= 0 for s in sections)):
                raise Decline
        if _fits(form, *args[:4]) and _on_kernel_device(*args[:4]) and (
                form.layout != "sections" or 2 * sum(args[4]) == args[0].shape[-1]):
            return _run(form, args)
        if not fallback:
            _run(form, args)  # posenc's error for what its kernels do not take
        raise Decline  # (or what posenc takes but the decision did not cover)

    return compute


# ---------------------------------------------------------------------------------------
# Which functions are replaced: by their digest, looked up in the verified table.


@functools.cache  # code objects are immutable
def global_loads(code: types.CodeType) -> frozenset[str]:
    """Global names loaded by ``code`` and the functions nested in it."""
    return frozenset(ins.argval for c in nested_codes(code) for ins in dis.get_instructions(c)
                     if ins.opname == "LOAD_GLOBAL")


@functools.cache
def _names(code: types.CodeType) -> frozenset[str]:
    """Every name ``code`` and the functions nested in it use (globals among them)."""
    return frozenset(name for c in nested_codes(code) for name in c.co_names)


def _code_of(obj: object) -> types.CodeType | None:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    if callable(obj):  # a decorated forward (decorators on decorators): its body calls
        obj = inspect.unwrap(obj)
    return getattr(obj, "__code__", None)


def callers(module: types.ModuleType) -> dict[str, list[str]]:
    """For each rotary name: the qualified names of the module's functions and methods
    whose code looks that name up in the module globals (i.e. calls it at run time)."""
    found: dict[str, list[str]] = {name: [] for name in ROTARY_NAMES}

    def scan(qualname: str, obj: object) -> None:
        code = _code_of(obj)
        if code is not None and _names(code) & found.keys():  # (a set read first: cheap)
            for name in global_loads(code) & found.keys():
                found[name].append(qualname)

    for attr, value in vars(module).items():
        if isinstance(value, type) and value.__module__ == module.__name__:
            for meth_name, meth in vars(value).items():
                scan(f"{value.__name__}.{meth_name}", meth)
        elif (isinstance(value, types.FunctionType) and value.__module__ == module.__name__
              and attr not in ROTARY_NAMES):
            scan(attr, value)
    return found


def called(model_type: str, module: types.ModuleType) -> list[str]:
    """The rotary names of ``module`` posenc replaces for ``model_type``: those its
    attention calls; raises ``Unsupported`` when that is not a set posenc can patch."""
    Unsupported = _transformers.Unsupported
    where = f"{module.__name__} (transformers {_transformers.version()})"
    found = callers(module)
    names = [name for name in ROTARY_NAMES if found[name]]
    for name in names:
        if not callable(getattr(module, name, None)):
            raise Unsupported(f"{', '.join(found[name])} in {where} call {name}, "
                              "but the module has no such function")
    every_name = MODELS[model_type].multimodal_rotary
    decoder = (TEXT, MULTIMODAL) if every_name else (TEXT,)
    if not every_name and MULTIMODAL in names:
        raise Unsupported(
            f"the attention in {where} calls {MULTIMODAL}, whose section merge for this "
            "model is not one posenc_torch runs")
    if not any(name in names for name in decoder):
        absent = [n for n in decoder if not hasattr(module, n)]
        raise Unsupported(
            f"no attention in {where} calls {' or '.join(decoder)} "
            f"(absent from the module: {absent or 'none'}); this transformers version "
            f"computes the {model_type} decoder rotary embedding in a way posenc_torch does "
            "not know, so patching it would do nothing")
    if model_type in _VISION_MODEL_TYPES and VISION not in names:
        raise Unsupported(
            f"the vision attention in {where} does not call {VISION}"
            f"{'' if hasattr(module, VISION) else ' (absent from the module)'}; this "
            "transformers version is not supported for the vision tower")
    return [name for name in names if name in (TEXT, INTERLEAVE) or every_name]


class Planned(NamedTuple):
    """A rotary function to replace: its name, the form its row names, its watch."""

    name: str
    form: Form
    watch: Watch


def plan(model_type: str, module: types.ModuleType,
         extra: dict | None = None) -> list[Planned]:
    """The rotary functions to replace in ``module``, each with its form (its verified
    row) and its watch; raises ``Unsupported`` (with the reason) for code posenc does not
    know."""
    out = []
    for name in called(model_type, module):
        # Already replaced by an active handle: the function it replaced (patch then
        # reports the conflict).
        func = function(module, name)
        try:
            row, watch = _table.verified(func, None, name, extra)
        except Unverified as e:
            raise _transformers.Unsupported(f"{module.__name__}.{name}: {e}") from None
        form = FORMS_BY_NAME.get(row.use)
        if form is None or form not in _FORMS[name]:
            raise _transformers.Unsupported(
                f"{module.__name__}.{name}: its row names {row.use!r}, not a form of {name}")
        if row.source is not None:
            _sampled(form, func, f"{module.__name__}.{name}", row.source)
        out.append(Planned(name, form, watch))
    return out


def _sampled(form: Form, func: Callable, where: str, source: str) -> None:
    """A row from a user's table file, checked once more on sampled inputs: ``func`` must
    give what posenc gives for the row's form; Unsupported otherwise."""
    gen = torch.Generator().manual_seed(0)
    for dim, width in ((16, 16), (64, 64), (64, 32), (128, 96)):
        if form.layout == "half":
            width = dim // 2
        elif form.layout != "partial":
            width = dim
        if form.layout == "vision":
            q, k = (torch.randn(9, 3, dim, generator=gen) for _ in range(2))
            args = (q, k, *(torch.randn(9, dim, generator=gen) for _ in range(2)))
        else:
            q = torch.randn(2, 4, 5, dim, generator=gen)
            k = torch.randn(2, 2, 5, dim, generator=gen)
            rows = (3, 2, 5, width) if form.layout == "sections" else (2, 5, width)
            args = (q, k, *(torch.randn(rows, generator=gen) for _ in range(2)))
            if form.layout == "sections":
                args = (*args, [dim // 8, dim // 8 + dim // 16, dim // 4 - dim // 16])
        try:
            theirs, ours = func(*args), _run(form, args)
            same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in
                       zip(theirs, ours, strict=True))
        except Exception:  # noqa: BLE001 -- whatever it raises, it is not the form
            same = False
        if not same:
            raise _transformers.Unsupported(
                f"{where}: the row of the table file {source!r} says {form.name!r}, which "
                "its results on sampled inputs are not")


def function(module: types.ModuleType, name: str) -> Callable:
    """The function ``module.<name>`` computes when no kernel runs in its place: the one
    an active handle replaced, the one inside a hub-kernel layer (``kernels``
    importable), else the attribute itself.  The decision is made on it; the replacement
    takes the attribute's place (the layer's too, so a kernel that ``kernelize`` attaches
    to it runs only for the calls posenc hands back)."""
    func = original_of(getattr(module, name))
    return _transformers.hub_kernel_function(func, name) or func


def install(handle: PatchHandle, plans: list[tuple[str, types.ModuleType, list]]) -> None:
    """Install the replacement of every planned function."""
    for mt, module, names in plans:
        for name, form, watch in names:
            handle.replace(module, name, _computation(form, function(module, name),
                                                      handle.fallback), f"{mt}.{name}",
                           f"posenc_torch replacement for transformers' {mt} {name} "
                           f"({form.name}); see posenc_torch.hf.", watch)
