"""Use posenc_torch inside Hugging Face transformers models with one line.

    import posenc_torch.hf
    handle = posenc_torch.hf.patch()      # before building / compiling the model
    ...                                    # train or run as usual
    print(handle.calls)                    # proof that the posenc functions ran
    handle.undo()                          # or: with posenc_torch.hf.patch(): ...

``patch`` replaces the module-level rotary functions that the attention layers of
transformers models look up when they run:

* ``apply_rotary_pos_emb`` (decoder attention) of every model type in
  ``SUPPORTED_MODEL_TYPES``: Llama-like models, models with adjacent pairs (Cohere, GLM-4V),
  partial rotary (Phi-3, GPT-NeoX, Qwen3-Next, Qwen3.5, GLM-4-MoE, ...) and models that
  reshape their tables first (GLM, GLM-4, ERNIE-4.5, gpt-oss), and DeepSeek-V3's
  ``apply_rotary_pos_emb_interleave`` (pairs de-interleaved),
* ``apply_multimodal_rotary_pos_emb`` (Qwen2-VL / Qwen2.5-VL decoder attention in 4.x),
* ``apply_rotary_pos_emb_vision`` (the vision towers of Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

Nothing here is a list per version.  For each model type it knows, ``patch`` reads the
code of the installed transformers: which rotary names the model file's classes load at
run time, and what the functions behind them compute.  The source of
``apply_rotary_pos_emb`` (with the helpers it calls, such as ``rotate_half``) is compared
with the forms in ``_FORMS`` below as syntax trees (formatting, comments, docstrings and
decorators aside), which names the likely form; then the behaviour probe (below) runs the
original and the form's posenc path on a small fixed set of inputs, and only a form whose
results match is used (every known form is tried when the source matches none).  A model
type that fails is left to transformers with one ``UnsupportedModelWarning`` naming it and
the reason (see ``unsupported_model_types()``); when no requested type remains, ``patch``
raises instead of returning a handle that patches nothing.  ``SUPPORTED_MODEL_TYPES`` is
computed on first use, for the installed code.

transformers 5.x decorates ``apply_rotary_pos_emb`` with a hub-kernel decorator and the
attention classes with ``use_kernelized_func(apply_rotary_pos_emb)``.  Those decorators
only record the function object (for ``kernels.kernelize``); the attention ``forward``
still calls the module-level name on every call, so replacing that name is what takes
effect as long as the model is not kernelized (README, "Use with transformers", says
where transformers' own kernel mechanism stands).

The rotary *modules* (which compute cos/sin once per forward pass) are left alone: their
tables are computed once per forward and shared by every layer, so the cost that grows
with depth is the rotation, and keeping transformers' own tables keeps the patched model's
cos/sin bit-identical to the unpatched one.

Calls the posenc kernels do not take (tensors on another device than the CPU, dtypes or
shapes other than the model's own layouts, other argument forms, calls under functorch
transforms or forward AD) go to the original transformers function unchanged, with the
caller's own arguments (``fallback=True``, the default), so the patch never changes what
a model computes or which errors it raises;
``handle.fallbacks`` counts those calls.  With ``fallback=False`` inputs posenc does not
take raise posenc's error instead.

Patch before ``torch.compile``.  torch.compile guards the global functions it traced,
so patching (or undoing) after compiling recompiles every compiled region on its next call;
patching first compiles once.  Exported or ahead-of-time compiled programs
(``torch.export``, AOTInductor) keep the functions they traced.
"""

from __future__ import annotations

import ast
import contextlib
import dis
import functools
import importlib
import inspect
import textwrap
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
import torch.autograd.forward_ad as _forward_ad

from . import rope as _rope
from ._checks import FLOAT_DTYPES, KERNEL_DEVICES
from ._tables import MODELS

# SUPPORTED_MODEL_TYPES comes from the module __getattr__ below.
__all__ = ["SUPPORTED_MODEL_TYPES", "PatchHandle", "UnsupportedModelWarning", "patch",  # noqa: F822
           "unsupported_model_types"]

# The model types this integration knows and tests (tests/test_hf_models.py builds each
# from a tiny config), from the one model table.  ``SUPPORTED_MODEL_TYPES`` is the subset
# whose installed code fits.
KNOWN_MODEL_TYPES: tuple[str, ...] = tuple(MODELS)
_VISION_MODEL_TYPES = frozenset(name for name, m in MODELS.items() if m.vision_rotary)

_TEXT = "apply_rotary_pos_emb"
_MULTIMODAL = "apply_multimodal_rotary_pos_emb"
_VISION = "apply_rotary_pos_emb_vision"
_INTERLEAVE = "apply_rotary_pos_emb_interleave"
_ROTARY_NAMES = (_TEXT, _MULTIMODAL, _VISION, _INTERLEAVE)

_FLOAT = FLOAT_DTYPES
_VISION_FLOAT = tuple(dt for dt in FLOAT_DTYPES if dt != torch.float64)

# (module name, attribute) -> the handle whose wrapper is installed there.
_ACTIVE: dict[tuple[str, str], PatchHandle] = {}
# Orders patch() and undo() across threads (re-entrant: patch undoes on failure).
_LOCK = threading.RLock()


class UnsupportedModelWarning(RuntimeWarning):
    """``patch`` left a model type to transformers; the message names it and says why."""

# Further installers run by ``patch`` after the rotary functions, in order, each as
# ``installer(handle, model_types)``; they replace module attributes with
# ``handle.install(module, name, replacement, target)``, so ``undo()`` reverses them too.
INSTALLERS: list[Callable[[PatchHandle, tuple[str, ...]], None]] = []

# Qwen-VL position ids (get_rope_index) through posenc's C walk: see _hf_positions.
from . import _hf_positions  # noqa: E402
INSTALLERS.append(_hf_positions.install)


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

    def install(self, module: types.ModuleType, name: str, replacement: Callable,
                target: str) -> None:
        """Replace ``module.<name>`` with ``replacement`` until ``undo()``; ``target`` is
        its name in ``targets``.  Raises RuntimeError if another active handle replaced it."""
        with _LOCK:
            self._install(module, name, replacement, target)

    def _install(self, module: types.ModuleType, name: str, replacement: Callable,
                 target: str) -> None:
        owner = _ACTIVE.get((module.__name__, name))
        if owner is not None:
            raise RuntimeError(f"posenc_torch.hf.patch: {module.__name__}.{name} is already "
                               f"patched by {owner!r}; undo that handle first")
        original = getattr(module, name)
        replacement.__module__ = __name__
        replacement.__qualname__ = f"patched.{target}"
        replacement.posenc_original = original
        setattr(module, name, replacement)
        _ACTIVE[(module.__name__, name)] = self
        self._installed.append((module, name, original, replacement, target))
        self._targets.append(target)

    def _add_counters(self, target: str) -> None:
        if self.count:
            # Ordinary CPU tensors whatever the caller's context: a default device (``with
            # torch.device("meta")``) or inference mode (whose tensors could not be bumped
            # outside it) must not reach them.
            with torch.inference_mode(False):
                self._calls[target] = torch.zeros((), dtype=torch.int64, device="cpu")
                self._fallbacks[target] = torch.zeros((), dtype=torch.int64, device="cpu")

    def reset_counts(self) -> None:
        """Set every counter in ``calls`` and ``fallbacks`` back to zero."""
        with torch.inference_mode(False):
            for counter in (*self._calls.values(), *self._fallbacks.values()):
                counter.zero_()

    def undo(self) -> None:
        """Put the original transformers functions back.  Calling it again does nothing.

        A function that someone else replaced after ``patch`` is left as it is (with a
        warning) rather than overwritten.
        """
        with _LOCK:
            while self._installed:
                module, name, original, wrapper, target = self._installed.pop()
                _ACTIVE.pop((module.__name__, name), None)
                if getattr(module, name, None) is wrapper:
                    setattr(module, name, original)
                else:
                    warnings.warn(
                        f"{module.__name__}.{name} was replaced by someone else after "
                        "posenc_torch.hf.patch(); leaving it as it is", RuntimeWarning,
                        stacklevel=2)

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return (f"PatchHandle({state}, model_types={list(self.model_types)}, "
                f"calls={self.calls}, fallbacks={self.fallbacks})")


# ---------------------------------------------------------------------------------------
# The forms of transformers' rotary functions that posenc computes exactly.  Each form is
# the source of a function as transformers writes it (any name; the 4.x signature's unused
# ``position_ids=None`` is ignored when comparing) with the helpers it calls by name.


class _Form(NamedTuple):
    """How one source form maps onto the posenc op.

    pairing: "half" (rotate_half) or "adjacent" (pairs 2i, 2i+1).
    table: "as_given"; "first_half_interleaved" (cos[..., :W//2] with each entry repeated
        twice: GLM, ERNIE-4.5); "doubled" (cat(cos, cos): gpt-oss keeps only one half).
    partial: the rotary width R may be less than head_dim (the rest passes through).
    cast: None (result dtype ``result_type(q, cos)``); "each" (q's and k's own dtypes);
        "fp32_to_q" (computed in fp32, both results in q's dtype).
    permute: None; "input" (q and k de-interleaved first: channels 0, 2, 4, ..., then
        1, 3, 5, ...; DeepSeek-V3 in 4.x); "output" (rotate adjacent pairs, return the
        results de-interleaved; DeepSeek-V3 in 5.x).
    """

    pairing: str
    table: str
    partial: bool
    cast: str | None
    permute: str | None = None


_ROTATE_HALF = """
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
"""
_ROTATE_ADJACENT = (
    """
def rotate_half(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    rot_x = torch.stack([-x2, x1], dim=-1).flatten(-2)
    return rot_x
""", """
def rotate_half(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)
""")
_CHUNK_HALF = """
def _apply_rotary_emb(x, cos, sin):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)
"""

_PLAIN = """
def f(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (ROTATE(q) * sin)
    k_embed = (k * cos) + (ROTATE(k) * sin)
    return q_embed, k_embed
"""
_CAST_EACH = """
def f(q, k, cos, sin, unsqueeze_dim=1):
    q_type, k_type = q.dtype, k.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(q_type), k_embed.to(k_type)
"""
_FP32 = """
def f(q, k, cos, sin, unsqueeze_dim=1):
    dtype = q.dtype
    q = q.float()
    k = k.float()
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)
"""
_PARTIAL = """
def f(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (ROTATE(q_rot) * sin)
    k_embed = (k_rot * cos) + (ROTATE(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed
"""
_PARTIAL_ONE_CAT = """
def f(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed
"""
_GLM = """
def f(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed
"""
_ERNIE = """
def f(q, k, cos, sin, unsqueeze_dim=1):
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    q_embed = (q.float() * cos) + (rotate_half(q).float() * sin)
    k_embed = (k.float() * cos) + (rotate_half(k).float() * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)
"""
_GPT_OSS = """
def f(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = _apply_rotary_emb(q, cos, sin)
    k_embed = _apply_rotary_emb(k, cos, sin)
    return q_embed, k_embed
"""

# DeepSeek-V3's apply_rotary_pos_emb_interleave (rope_interleave=True, the default).
_DEINTERLEAVE_INPUT = """
def f(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""
_DEINTERLEAVE_OUTPUT = """
def f(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed
"""

# (source, {helper name: accepted helper sources}, form)
_FORMS: tuple[tuple[str, dict[str, tuple[str, ...]], _Form], ...] = (
    (_PLAIN.replace("ROTATE", "rotate_half"), {"rotate_half": (_ROTATE_HALF,)},
     _Form("half", "as_given", False, None)),
    (_CAST_EACH, {"rotate_half": (_ROTATE_HALF,)}, _Form("half", "as_given", False, "each")),
    (_FP32, {"rotate_half": _ROTATE_ADJACENT}, _Form("adjacent", "as_given", False, "fp32_to_q")),
    (_PARTIAL.replace("ROTATE", "rotate_half"), {"rotate_half": (_ROTATE_HALF,)},
     _Form("half", "as_given", True, None)),
    (_PARTIAL_ONE_CAT, {"rotate_half": (_ROTATE_HALF,)}, _Form("half", "as_given", True, None)),
    (_PARTIAL.replace("ROTATE", "rotate_half_llm"),
     {"rotate_half_llm": tuple(s.replace("rotate_half", "rotate_half_llm")
                               for s in _ROTATE_ADJACENT)},
     _Form("adjacent", "as_given", True, None)),
    (_GLM, {"rotate_half": _ROTATE_ADJACENT},
     _Form("adjacent", "first_half_interleaved", True, None)),
    (_ERNIE, {"rotate_half": _ROTATE_ADJACENT},
     _Form("adjacent", "first_half_interleaved", False, "fp32_to_q")),
    (_GPT_OSS, {"_apply_rotary_emb": (_CHUNK_HALF,)}, _Form("half", "doubled", False, None)),
    (_DEINTERLEAVE_INPUT, {"rotate_half": (_ROTATE_HALF,)},
     _Form("half", "as_given", False, None, "input")),
    (_DEINTERLEAVE_OUTPUT, {}, _Form("adjacent", "first_half_interleaved", False, None, "output")),
)


def _tree(source: str) -> str:
    """A function's syntax tree without its name, docstring, decorators, type hints and
    the 4.x signature's unused ``position_ids=None``."""
    node = ast.parse(textwrap.dedent(source)).body[0]
    if not isinstance(node, ast.FunctionDef):
        raise TypeError("not a function")
    node.name, node.decorator_list, node.returns = "f", [], None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    node.body = body
    args = node.args
    for arg in (*args.args, *args.kwonlyargs):
        arg.annotation = None
    names = [a.arg for a in args.args]
    if "position_ids" in names:
        i = names.index("position_ids")
        j = i - (len(args.args) - len(args.defaults))
        if j >= 0 and isinstance(args.defaults[j], ast.Constant) and args.defaults[j].value is None:
            del args.args[i]
            del args.defaults[j]
    return ast.dump(node)


@functools.cache
def _form_trees() -> tuple[tuple[str, dict[str, frozenset[str]], _Form], ...]:
    return tuple((_tree(src), {name: frozenset(_tree(h) for h in helpers)
                               for name, helpers in helpers_.items()}, form)
                 for src, helpers_, form in _FORMS)


def _source_tree(func: object) -> str | None:
    try:
        return _tree(inspect.getsource(inspect.unwrap(func)))
    except (OSError, TypeError, SyntaxError, IndexError):
        return None


def _form_of(module: types.ModuleType, func: object) -> _Form | None:
    """The form of ``func`` (a function of ``module``), or None if it is none we know."""
    tree = _source_tree(func)
    if tree is None:
        return None
    for form_tree, helpers, form in _form_trees():
        if tree == form_tree and all(_source_tree(getattr(module, name, None)) in accepted
                                     for name, accepted in helpers.items()):
            return form
    return None


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


_HALF = _Form("half", "as_given", False, None)


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

_TEXT_PARAMS = ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim")
_transforms_active = torch._C._are_functorch_transforms_active


def _to_original() -> bool:
    """Calls under functorch transforms (torch.func.grad / vjp / jvp / vmap) and forward AD
    go to the original function: transformers' elementwise ops support every transform,
    the posenc ops have no forward-mode or batching rule."""
    if torch.compiler.is_compiling():
        return False
    return _transforms_active() or _forward_ad._current_level >= 0


def bump(counter: torch.Tensor) -> None:
    """Add one to a call counter (an int64 CPU scalar): traced into compiled graphs as a
    tiny op; outside the functorch transforms, which would see the in-place add on a
    captured tensor."""
    if not torch.compiler.is_compiling() and _transforms_active():
        with torch._C._DisableFuncTorch():
            counter.add_(1)
    else:
        counter.add_(1)


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


_FACTORIES = {_TEXT: _make_text, _INTERLEAVE: _make_text, _MULTIMODAL: _make_multimodal,
              _VISION: _make_vision}


# ---------------------------------------------------------------------------------------
# The behaviour probe.  Whatever its source looks like, a function is patched only when
# the wrapper would return what the function returns: at patch time the original and the
# wrapper's posenc path run on a small fixed set of inputs that covers what could differ
# (fp32, bf16 and bf16 q/k with fp32 tables; full and partial table widths; both
# unsqueeze_dim layouts; grouped-query heads; per-row and shared tables, with arbitrary
# values so that both halves of every table matter).  Inputs the wrapper hands to the
# original function anyway are not compared.  Accepted only when, on every input posenc
# computes:
#
# * the results have the original's number, types, shapes and dtypes;
# * fp32 (tables and q/k of any dtype giving an fp32 result): the same bits, and the
#   gradients of q, k, cos and sin to fp32 rounding (a detached term would show there);
# * bf16 / fp16: element by element, posenc's value is the original's or at least as
#   close as the original's to the original evaluated in fp64, up to twice the fp32
#   rounding of the terms (posenc rounds the fp32 result once; transformers rounds after
#   each op, so its value may be one rounding further from the exact one, never nearer:
#   a round-to-nearest of a value within fp32 error of the exact one cannot be).  A
#   missing or extra cast changes the dtype or moves values by bf16 ulps, a wrong half,
#   sign or table by far more, and all of those fail;
# * the original raising where posenc computes is a difference, and so is the original
#   writing into its inputs.
# A function that fails is left to transformers, with the first difference as the reason.

_PROBE_BATCH, _PROBE_HEADS, _PROBE_KV_HEADS, _PROBE_SEQ, _PROBE_DIM = 2, 4, 2, 5, 16
_PROBE_WIDTHS = (16, 12, 8)  # full rotary, Phi-3's 0.75, half (partial, or gpt-oss' tables)
_PROBE_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                 (torch.bfloat16, torch.float32))
_FP32_SLACK = 2.0 ** -22  # twice fp32's unit roundoff


class _ProbeCase(NamedTuple):
    label: str
    args: tuple
    kwargs: dict


def _probe_qk(gen: torch.Generator, dtype: torch.dtype, heads_first: bool,
              heads: int = _PROBE_HEADS, kv_heads: int = _PROBE_KV_HEADS):
    """q (B, H, T, D) as transformers' attention has it (a transposed view of a projection
    output) for ``heads_first``, else (B, T, H, D); k likewise with fewer heads."""
    b, t, d = _PROBE_BATCH, _PROBE_SEQ, _PROBE_DIM
    q = torch.randn(b, t, heads * d, generator=gen).to(dtype).view(b, t, heads, d)
    k = torch.randn(b, t, kv_heads * d, generator=gen).to(dtype).view(b, t, kv_heads, d)
    return (q.transpose(1, 2), k.transpose(1, 2)) if heads_first else (q, k)


def _probe_tables(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype):
    angle = torch.rand(shape, generator=gen, dtype=torch.float64) * 6
    return angle.cos().to(dtype), (angle * 1.3 + 0.4).sin().to(dtype)


def _text_cases() -> list[_ProbeCase]:
    gen = torch.Generator().manual_seed(20)
    cases = []
    for q_dtype, table_dtype in _PROBE_DTYPES:
        for width in _PROBE_WIDTHS:
            for unsqueeze_dim in (1, 2):
                q, k = _probe_qk(gen, q_dtype, unsqueeze_dim == 1)
                rows = 1 if unsqueeze_dim == 1 else _PROBE_BATCH
                cos, sin = _probe_tables(gen, (rows, _PROBE_SEQ, width), table_dtype)
                kwargs = {} if unsqueeze_dim == 1 else {"unsqueeze_dim": unsqueeze_dim}
                cases.append(_ProbeCase(
                    f"q {q_dtype}, tables {table_dtype} of width {width}, "
                    f"unsqueeze_dim={unsqueeze_dim}", (q, k, cos, sin), kwargs))
    return cases


def _multimodal_cases() -> list[_ProbeCase]:
    gen = torch.Generator().manual_seed(21)
    cases = []
    for q_dtype, table_dtype in _PROBE_DTYPES:
        for section in ([2, 3, 3], [4, 2, 2]):
            for unsqueeze_dim in (1, 2):
                q, k = _probe_qk(gen, q_dtype, unsqueeze_dim == 1)
                rows = 1 if unsqueeze_dim == 1 else _PROBE_BATCH
                cos, sin = _probe_tables(gen, (3, rows, _PROBE_SEQ, _PROBE_DIM), table_dtype)
                cases.append(_ProbeCase(
                    f"q {q_dtype}, tables {table_dtype}, mrope_section {section}, "
                    f"unsqueeze_dim={unsqueeze_dim}", (q, k, cos, sin, section),
                    {"unsqueeze_dim": unsqueeze_dim}))
    return cases


def _vision_cases() -> list[_ProbeCase]:
    gen = torch.Generator().manual_seed(22)
    cases = []
    n = 7
    for q_dtype, table_dtype in _PROBE_DTYPES:
        # (N, H, D) slices of the vision attention's packed qkv, fp32 tables of width D
        qkv = torch.randn(n, 3, _PROBE_HEADS, _PROBE_DIM, generator=gen).to(q_dtype)
        q, k = qkv.permute(1, 0, 2, 3)[:2]
        cos, sin = _probe_tables(gen, (n, _PROBE_DIM), table_dtype)
        cases.append(_ProbeCase(f"q {q_dtype}, tables {table_dtype}", (q, k, cos, sin), {}))
    return cases


def _clone_args(args: tuple, grad: bool) -> tuple:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.detach().clone(memory_format=torch.preserve_format)
            a.requires_grad_(grad)
        out.append(a)
    return tuple(out)


def _tensors_out(result: object) -> tuple[torch.Tensor, ...] | None:
    if isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
        return tuple(result)
    return None


def _close_to_exact(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor,
                    scale: float) -> bool:
    """Element by element: posenc's value is the original's, or at least as close to the
    exact value (up to fp32 rounding of terms no larger than ``scale``)."""
    ours, theirs, exact = ours.double(), theirs.double(), exact.double()
    slack = _FP32_SLACK * scale
    return bool(((ours == theirs) | ((ours - exact).abs() <= (theirs - exact).abs() + slack))
                .all())


def _grads(outputs: tuple[torch.Tensor, ...], inputs: tuple) -> tuple:
    gen = torch.Generator().manual_seed(23)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
               for o in outputs)
    leaves = [a for a in inputs if isinstance(a, torch.Tensor)]
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def _probe(original: Callable, ours: Callable, supported: Callable,
           cases: list[_ProbeCase]) -> tuple[str | None, tuple[int, int]]:
    """None when ``ours`` returns what ``original`` returns on every case that
    ``supported`` lets it compute (see above), else the first difference in words; with
    how far the probe went (cases that agreed, index of the case reached)."""
    reason, progress = _first_difference(original, ours, supported, cases)
    if reason is None and progress[0] == 0:
        reason = "posenc computes none of the probe inputs"
    return reason, progress


def _first_difference(original: Callable, ours: Callable, supported: Callable,
                      cases: list[_ProbeCase]) -> tuple[str | None, tuple[int, int]]:
    """(None or the first difference, (cases that agreed, index of the case reached))."""
    computed = 0
    for i, case in enumerate(cases):
        if not supported(*case.args, **case.kwargs):
            continue  # the wrapper hands this call to the original function
        reason = _case_difference(original, ours, case)
        if reason is not None:
            return f"{reason} for {case.label}", (computed, i)
        computed += 1
    return None, (computed, len(cases))


def _case_difference(original: Callable, ours: Callable, case: _ProbeCase) -> str | None:
    try:
        expected = ours(*_clone_args(case.args, False), **case.kwargs)
    except Exception as e:  # noqa: BLE001 -- a difference, reported as such
        return f"posenc raised {type(e).__name__} ({e})"
    fp32 = all(o.dtype == torch.float32 for o in expected)
    # gradients compared where every input is fp32 (bf16 gradients round differently)
    grad = fp32 and all(a.dtype == torch.float32 for a in case.args
                        if isinstance(a, torch.Tensor))
    theirs_args = _clone_args(case.args, grad)
    inputs = _clone_args(case.args, False)
    try:
        with torch.enable_grad():
            result = original(*theirs_args, **case.kwargs)
    except Exception as e:  # noqa: BLE001 -- transformers rejects what posenc computes
        return f"it raises {type(e).__name__} where posenc computes"
    got = _tensors_out(result)
    if got is None or len(got) != len(expected):
        return f"it returns {type(result).__name__}, not two tensors"
    for name, a, b in zip(("first", "second"), expected, got, strict=False):
        if a.dtype != b.dtype or a.shape != b.shape:
            return (f"its {name} result is {b.dtype} {tuple(b.shape)}, posenc's "
                    f"{a.dtype} {tuple(a.shape)}")
    if any(not torch.equal(x, y) for x, y in zip(theirs_args, inputs, strict=True)
           if isinstance(x, torch.Tensor)):
        return "it writes into its inputs"
    if fp32:
        if not all(torch.equal(a, b) for a, b in zip(expected, got, strict=False)):
            return "its fp32 results differ from posenc's in bits"
        if grad:
            ours_args = _clone_args(case.args, True)
            with torch.enable_grad():
                ours_grads = _grads(ours(*ours_args, **case.kwargs), ours_args)
                their_grads = _grads(got, theirs_args)
            for a, b in zip(ours_grads, their_grads, strict=True):
                if (a is None) != (b is None) or (
                        a is not None and not torch.allclose(a, b, rtol=1.3e-6, atol=1e-5)):
                    return "its gradients differ from posenc's"
        return None
    exact_args = tuple(a.double() if isinstance(a, torch.Tensor) else a for a in inputs)
    try:
        exact = _tensors_out(original(*exact_args, **case.kwargs))
    except Exception as e:  # noqa: BLE001
        return f"it raises {type(e).__name__} in float64 ({e})"
    if exact is None or len(exact) != len(got):
        return "it returns no tensor pair in float64"
    # a bound of the two terms' sum, for the fp32 rounding allowance
    magnitudes = [a.abs().max().item() for a in exact_args[:4]]
    scale = 2 * max(magnitudes[:2]) * max(magnitudes[2:])
    for name, a, b, e in zip(("first", "second"), expected, got, exact, strict=False):
        if not _close_to_exact(a, b, e, scale):
            return (f"posenc's {a.dtype} {name} result is further from the function's exact "
                    "(fp64) value than the function's own rounding")
    return None


def _text_probe(original: Callable, form: _Form) -> tuple[str | None, tuple[int, int]]:
    def ours(*args, **kwargs):
        return _rotate_as(form, *_text_args(args, kwargs))

    def supported(*args, **kwargs):
        return _text_supported(form, *_text_args(args, kwargs))

    return _probe(original, ours, supported, _text_cases())


def _multimodal_probe(original: Callable) -> tuple[str | None, tuple[int, int]]:
    return _probe(original, _rope.apply_multimodal_rotary_pos_emb, _multimodal_supported,
                  _multimodal_cases())


def _vision_probe(original: Callable) -> tuple[str | None, tuple[int, int]]:
    return _probe(original, _rope.apply_rotary_pos_emb_vision, _vision_supported,
                  _vision_cases())


_DISTINCT_FORMS = tuple(dict.fromkeys(form for _, _, form in _FORMS))


def _describe(form: _Form) -> str:
    words = [f"{form.pairing} pairs", f"tables {form.table.replace('_', ' ')}"]
    if form.partial:
        words.append("partial rotary")
    if form.cast:
        words.append({"each": "results cast to q's and k's dtypes",
                      "fp32_to_q": "computed in fp32, cast to q's dtype"}[form.cast])
    if form.permute:
        words.append(f"channels de-interleaved at the {form.permute}")
    return "the form with " + ", ".join(words)


def _behaviour_key(func: object) -> tuple | None:
    """What the behaviour of ``func`` depends on: its syntax tree and, for every global
    name its code reads, that function's own key (helpers such as ``rotate_half``) or the
    object itself (``torch``).  The 100-odd model files that carry a copy of one function
    share one key, so they share one probe.  None when the source cannot be read."""
    func = inspect.unwrap(func)
    code = getattr(func, "__code__", None)
    tree = _source_tree(func)
    if code is None or tree is None:
        return None
    parts: list[tuple] = [(tree, getattr(func, "__defaults__", None))]
    namespace = getattr(func, "__globals__", {})
    for name in sorted(_global_loads(code)):
        value = namespace.get(name, namespace.get("__builtins__"))
        if isinstance(value, types.FunctionType) and value is not func:
            key = _behaviour_key(value)
            if key is None:
                return None
            parts.append((name, key))
        else:
            parts.append((name, id(value)))
    return tuple(parts)


# Probe outcomes: per function object, and per behaviour key (shared by equal copies).
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROBED_BY_KEY: dict[tuple, tuple] = {}
_PROBE_SECONDS = [0.0]  # spent probing in this process (not counting cache hits)


def _bindings(func: object, seen: frozenset = frozenset()) -> tuple:
    """The objects the global names of ``func`` (and of the functions among them) are bound
    to now: a function probed before is probed again when one of them was replaced."""
    code = getattr(func, "__code__", None)
    if code is None or id(func) in seen:
        return ()
    namespace = getattr(func, "__globals__", {})
    out = []
    for name in sorted(_global_loads(code)):
        value = namespace.get(name)
        out.append((name, id(value)))
        if isinstance(value, types.FunctionType):
            out.append(_bindings(value, seen | {id(func)}))
    return tuple(out)


@contextlib.contextmanager
def _plain_mode():
    """The probe runs as in plain eager code, whatever the caller's context: CPU default
    device, autograd on, no inference mode, no autocast."""
    with (torch.device("cpu"), torch.inference_mode(False), torch.enable_grad(),
          torch.autocast("cpu", enabled=False)):
        yield


def _probed(kind: str, func: Callable, run: Callable[[], object]) -> object:
    """``run()``'s outcome for ``func``, computed once per function object (while the names
    it reads stay bound to the same objects) and once per behaviour key."""
    inner = inspect.unwrap(func)
    bindings = _bindings(inner)
    try:
        cached_bindings, outcome = _PROBED[inner][kind]
        if cached_bindings == bindings:
            return outcome
    except (KeyError, TypeError):
        pass
    key = _behaviour_key(inner)
    if key is not None and (kind, key) in _PROBED_BY_KEY:
        outcome = _PROBED_BY_KEY[(kind, key)]
    else:
        start = time.perf_counter()
        with _plain_mode():
            outcome = run()
        _PROBE_SECONDS[0] += time.perf_counter() - start
        if key is not None:
            _PROBED_BY_KEY[(kind, key)] = outcome
    try:
        _PROBED.setdefault(inner, {})[kind] = (bindings, outcome)
    except TypeError:  # not weakly referenceable: cached by key only
        pass
    return outcome


def _text_behaviour(func: Callable, syntactic: _Form | None) -> tuple[_Form | None, str | None]:
    """(the form whose posenc path returns what ``func`` returns, None) or (None, why
    not).  The form its source matches is tried first, then every other known form."""

    def run() -> tuple[_Form | None, str | None]:
        candidates = [syntactic] if syntactic is not None else []
        candidates += [f for f in _DISTINCT_FORMS if f != syntactic]
        closest = None  # (cases that agreed, reason, form); the first form on ties
        for form in candidates:
            reason, (agreed, _) = _text_probe(func, form)
            if reason is None:
                return form, None
            if closest is None or agreed > closest[0]:
                closest = (agreed, reason, form)
        _, reason, form = closest
        if syntactic is not None:
            what = "its source has a known form, but it does not compute what that form does"
        else:
            what = ("its source is not one of the forms posenc_torch knows, and it computes "
                    "what none of them does")
        return None, f"{what}; closest: {_describe(form)}, where {reason}"

    return _probed(f"text:{syntactic}", func, run)


# ---------------------------------------------------------------------------------------
# Finding what the installed transformers' attention calls.


@functools.cache  # code objects are immutable; patch() scans the same ones each call
def _global_loads(code: types.CodeType) -> frozenset[str]:
    """Global names loaded by ``code`` and the functions nested in it."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname == "LOAD_GLOBAL"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_loads(const)
    return frozenset(names)


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


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("posenc_torch.hf.patch needs transformers installed") from e
    return transformers.__version__


def _modeling_module(model_type: str) -> types.ModuleType:
    version = _transformers_version()
    name = f"transformers.models.{model_type}.modeling_{model_type}"
    try:
        return importlib.import_module(name)
    except ImportError as e:
        # the model itself missing from this release, or its module failing to import
        absent = isinstance(e, ModuleNotFoundError) and e.name in (
            name, f"transformers.models.{model_type}")
        raise (_Absent if absent else _Unsupported)(
            f"cannot import {name} from transformers {version} ({e}); model type "
            f"{model_type!r} needs a transformers version that has it") from e


class _Unsupported(RuntimeError):
    """A known model type that the installed transformers does not let posenc patch."""


class _Absent(_Unsupported):
    """A known model type that the installed transformers does not have at all: patch()
    with no arguments passes it by without a warning (it did not drop out, it is not
    there); asked for by name it is refused like any other."""


def _plan(model_type: str, module: types.ModuleType) -> list[tuple[str, _Form | None]]:
    """The rotary names to replace in ``module``, each with its form; raises
    ``_Unsupported`` (with the reason) if the installed code is not one posenc runs."""
    where = f"{module.__name__} (transformers {_transformers_version()})"
    callers = _callers(module)
    called = [name for name in _ROTARY_NAMES if callers[name]]
    for name in called:
        if not callable(getattr(module, name, None)):
            raise _Unsupported(
                f"{', '.join(callers[name])} in {where} call {name}, "
                "but the module has no such function")
    original = model_type in _VISION_MODEL_TYPES or model_type in ("llama", "qwen2")
    decoder = (_TEXT, _MULTIMODAL) if original else (_TEXT,)
    if not original and _MULTIMODAL in called:
        raise _Unsupported(
            f"the attention in {where} calls {_MULTIMODAL}, whose section merge for this "
            "model is not one posenc_torch runs")
    if not any(name in called for name in decoder):
        absent = [n for n in decoder if not hasattr(module, n)]
        raise _Unsupported(
            f"no attention in {where} calls {' or '.join(decoder)} "
            f"(absent from the module: {absent or 'none'}); this transformers version "
            f"computes the {model_type} decoder rotary embedding in a way posenc_torch does "
            "not know, so patching it would do nothing")
    if model_type in _VISION_MODEL_TYPES and _VISION not in called:
        raise _Unsupported(
            f"the vision attention in {where} does not call {_VISION}"
            f"{'' if hasattr(module, _VISION) else ' (absent from the module)'}; this "
            "transformers version is not supported for the vision tower")
    plan: list[tuple[str, _Form | None]] = []
    for name in called:
        if name not in (_TEXT, _INTERLEAVE) and not original:
            continue
        # Already replaced by an active handle: judge the function it replaced (patch
        # then reports the conflict).
        func = getattr(module, name)
        func = getattr(func, "posenc_original", func)
        form = None
        if name in (_TEXT, _INTERLEAVE):
            form, reason = _text_behaviour(func, _form_of(module, func))
        else:
            probe = _multimodal_probe if name == _MULTIMODAL else _vision_probe
            reason = _probed(name, func, lambda probe=probe, func=func: probe(func)[0])
        if reason is not None:
            raise _Unsupported(f"{module.__name__}.{name} (transformers "
                               f"{_transformers_version()}): {reason}")
        plan.append((name, form))
    return plan


@functools.cache
def _support() -> dict[str, str | None]:
    """Per known model type: None if the installed transformers lets posenc patch it, else
    the reason.  Imports the modeling modules (once per process)."""
    reasons: dict[str, str | None] = {}
    for mt in KNOWN_MODEL_TYPES:
        try:
            _plan(mt, _modeling_module(mt))
            reasons[mt] = None
        except _Unsupported as e:
            reasons[mt] = str(e)
    return reasons


def unsupported_model_types() -> dict[str, str]:
    """The model types of ``KNOWN_MODEL_TYPES`` that ``patch`` does not take with the
    installed transformers, each with the reason (computed from the installed code)."""
    return {mt: reason for mt, reason in _support().items() if reason is not None}


def __getattr__(name: str) -> object:
    # SUPPORTED_MODEL_TYPES is computed on first use, so that importing posenc_torch.hf
    # does not import transformers.
    if name == "SUPPORTED_MODEL_TYPES":
        return tuple(mt for mt, reason in _support().items() if reason is None)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _normalize(model_types: str | Iterable[str] | None) -> tuple[str, ...]:
    if isinstance(model_types, str):
        model_types = [model_types]
    if not isinstance(model_types, Iterable):
        raise TypeError(f"model_types must be a model type, a sequence of them or None, got "
                        f"{type(model_types).__name__}")
    out: list[str] = []
    for mt in model_types:
        if not isinstance(mt, str):
            raise TypeError(f"model_types must be strings, got {type(mt).__name__}")
        if mt not in KNOWN_MODEL_TYPES:
            raise ValueError(f"model type {mt!r} is not supported; known model types: "
                             f"{', '.join(KNOWN_MODEL_TYPES)}")
        if mt not in out:
            out.append(mt)
    if not out:
        raise ValueError("model_types is empty")
    return tuple(out)


def patch(model_types: str | Sequence[str] | None = None, *,
          fallback: bool = True, count: bool = True) -> PatchHandle:
    """Make transformers models use the posenc rotary kernels.

    Args:
        model_types: one or more of ``KNOWN_MODEL_TYPES`` (``model.config.model_type``,
            e.g. "llama", "qwen2_vl", "phi3"); None patches every one the installed
            transformers lets posenc patch (which imports the modeling module of every
            known type: a few seconds, once per process).  A requested type whose installed
            code posenc does not run exactly is left to transformers with one
            ``UnsupportedModelWarning`` naming it and the reason.
        fallback: hand inputs the posenc kernels do not take (tensors on a device they were
            not built for: CUDA tensors unless ``posenc_torch._C.has_cuda()``; shapes other
            than transformers' layouts, an ``mrope_section`` that does not fit) to the
            original transformers function (True), or raise posenc's error (False).
            Calls in argument forms other than transformers' go to the original function
            either way.
        count: keep ``handle.calls`` / ``handle.fallbacks``.  Each counter is a CPU scalar
            tensor bumped in place, which compiled graphs include as a tiny op; pass False
            to leave it out (e.g. for CUDA graphs on the fallback path).

    Returns:
        A ``PatchHandle``; ``handle.undo()`` (or leaving ``with patch(...):``) restores the
        original functions; ``handle.calls`` / ``handle.fallbacks`` count the calls per
        replaced function.

    Raises:
        ValueError: a model type this module does not know.
        RuntimeError: none of the requested types can be patched (the installed transformers
            lacks the model, its attention calls none of the rotary functions posenc
            replaces, or its rotary function does not compute what posenc computes:
            ``unsupported_model_types()`` says which and why), or a function is already
            patched by another active handle.

    Call it before ``torch.compile`` (patching later recompiles the compiled regions on
    their next call).  It patches the functions in transformers' modules, so it affects
    every model of those types in the process, including ones built before the call.
    ``patch`` and ``undo`` are thread-safe (one lock orders them).
    """
    for name, flag in (("fallback", fallback), ("count", count)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    requested = KNOWN_MODEL_TYPES if model_types is None else _normalize(model_types)
    with _LOCK:
        plans, refused, absent = [], {}, {}
        for mt in requested:
            try:
                module = _modeling_module(mt)
                plans.append((mt, module, _plan(mt, module)))
            except _Absent as e:
                (absent if model_types is None else refused)[mt] = str(e)
            except _Unsupported as e:
                refused[mt] = str(e)
        if not plans:
            refused.update(absent)
        if not plans:  # (absent types included: nothing at all could be patched)
            if len(refused) == 1:
                raise RuntimeError(f"posenc_torch.hf.patch: {next(iter(refused.values()))}")
            raise RuntimeError("posenc_torch.hf.patch: none of the model types can be patched "
                               "with the installed transformers: " +
                               "; ".join(f"{mt}: {why}" for mt, why in refused.items()))
        for mt, module, names in plans:
            for name, _ in names:
                owner = _ACTIVE.get((module.__name__, name))
                if owner is not None:
                    raise RuntimeError(
                        f"posenc_torch.hf.patch: {mt}.{name} is already patched by "
                        f"{owner!r}; undo that handle first")
        for mt, why in refused.items():
            warnings.warn(f"posenc_torch.hf.patch leaves {mt} to transformers: {why}",
                          UnsupportedModelWarning, stacklevel=2)
        handle = PatchHandle(tuple(mt for mt, _, _ in plans), fallback, count)
        try:
            for mt, module, names in plans:
                for name, form in names:
                    target = f"{mt}.{name}"
                    original = getattr(module, name)
                    handle._add_counters(target)
                    wrapper = _FACTORIES[name](original, handle, target, form)
                    wrapper.__doc__ = (f"posenc_torch replacement for transformers' {mt} "
                                       f"{name}; see posenc_torch.hf.")
                    handle.install(module, name, wrapper, target)
            for installer in INSTALLERS:
                installer(handle, handle.model_types)
        except BaseException:
            handle.undo()
            raise
    return handle
