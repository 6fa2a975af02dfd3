"""What ``patch`` installed, and the one toolkit every replacement uses: the handle with
its call counters (:meth:`PatchHandle.replace` installs a replacement and decides, per
call, whether posenc computes it or the original function does), and the one-time
warnings."""

from __future__ import annotations

import inspect
import threading
import types
import warnings
from collections.abc import Callable

import torch

from .. import ops as _ops
from .._checks import InputError
from ._digests import _ORIGINALS, Watch, original_of  # noqa: F401

# (module name, attribute) -> the handle whose wrapper is installed there.
_ACTIVE: dict[tuple[str, str], PatchHandle] = {}
# Orders patch() and undo() across threads (re-entrant: patch undoes on failure).
LOCK = threading.RLock()


class UnsupportedModelWarning(RuntimeWarning):
    """``patch`` left a model type (or one of its functions) to transformers; the message
    names it and says why."""


class Decline(Exception):
    """Raised by a replacement's computation for a call it does not take (another call
    form, inputs outside what posenc verified), with the reason: the original function
    computes it, counted as a fallback unless ``counted`` is False (the original only
    returns what posenc computed before, e.g. a precomputed vision entry)."""

    def __init__(self, reason: str = "", counted: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.counted = counted


class CallArguments:
    """How a function binds the arguments of a call, read once from its signature.

    :meth:`bind` gives what ``inspect.Signature.bind(*args, **kwargs).arguments`` gives
    (defaults not applied; ``*args`` / ``**kwargs`` parameters only when they receive
    something) with plain tuple and dict operations, which ``torch.compile`` traces in any
    frame (``inspect``'s mapping proxies stop a graph where the frame mutated a dict).
    """

    def __init__(self, func: Callable) -> None:
        kind = inspect.Parameter
        params = list(inspect.signature(func).parameters.values())
        self.positional = tuple(p.name for p in params
                                if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD))
        self.keyword = frozenset(p.name for p in params
                                 if p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY))
        self.required = tuple(p.name for p in params if p.default is kind.empty
                              and p.kind not in (kind.VAR_POSITIONAL, kind.VAR_KEYWORD))
        self.var_positional = next((p.name for p in params
                                    if p.kind is kind.VAR_POSITIONAL), None)
        self.var_keyword = next((p.name for p in params if p.kind is kind.VAR_KEYWORD), None)

    def bind(self, args: tuple, kwargs: dict) -> dict | None:
        """{parameter name: value} of the call ``func(*args, **kwargs)``, or None where
        Python would raise TypeError (too many or too few arguments, an unknown or
        repeated keyword)."""
        count = len(self.positional)
        if len(args) > count and self.var_positional is None:
            return None
        bound = dict(zip(self.positional, args, strict=False))  # (args may be fewer)
        if len(args) > count:
            bound[self.var_positional] = tuple(args[count:])
        extra = {}
        for name, value in kwargs.items():
            if name in self.keyword:
                if name in bound:
                    return None
                bound[name] = value
            elif self.var_keyword is not None:  # (a positional-only name too)
                extra[name] = value
            else:
                return None
        if any(name not in bound for name in self.required):
            return None
        if extra:
            bound[self.var_keyword] = extra
        return bound


_WARNED: set[str] = set()


def warn_once(message: str, stacklevel: int = 3) -> None:
    """One ``UnsupportedModelWarning`` per message and process."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UnsupportedModelWarning, stacklevel=stacklevel)


class PatchHandle:
    """What ``patch`` installed; undoes it with ``undo()`` or at the end of a ``with`` block.

    ``model_types``: the model types that were patched; ``targets``, ``calls`` and
    ``fallbacks`` (empty when ``patch(count=False)``): below.
    """

    def __init__(self, model_types: tuple[str, ...], fallback: bool, count: bool,
                 rows: dict | None = None, fuse_qk_norm: bool = False) -> None:
        self.model_types = model_types
        self.fallback = fallback
        self.count = count
        # patch(fuse_qk_norm=...): the q/k-norm attentions run the fused op (_qk_attention)
        self.fuse_qk_norm = fuse_qk_norm
        # the rows of a user's table file beside the shipped table (``_table``)
        self.rows = rows or {}
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
        """Per replaced function, how many calls went to the original function (inputs
        posenc does not take, see ``posenc_torch.hf``)."""
        return {target: int(n) for target, n in self._fallbacks.items()}

    @property
    def targets(self) -> tuple[str, ...]:
        """``"<model_type>.<function>"`` for every function ``patch`` replaced."""
        return tuple(self._targets)

    @property
    def active(self) -> bool:
        """True until ``undo()``."""
        return bool(self._installed)

    def replace(self, owner: object, name: str, compute: Callable, target: str,
                doc: str, watch: Watch | None = None) -> None:
        """Install, in place of ``owner.<name>``, a function with the original's signature
        that returns ``compute(*args, **kwargs)`` and counts it in ``calls[target]``, or
        calls the original and counts it in ``fallbacks[target]`` when ``compute`` raises
        :class:`Decline`, when posenc refuses the inputs (an ``InputError``) and the
        handle falls back, under functorch transforms and forward AD, or when anything the
        decision read has changed since (``watch``; for a method of the class ``owner``,
        the methods it reaches through ``self`` are resolved on ``type(self)``)."""
        original = getattr(owner, name) if isinstance(owner, types.ModuleType) else \
            vars(owner)[name]
        self._add_counters(target)
        calls, fallbacks = self._calls.get(target), self._fallbacks.get(target)
        count, fallback = self.count, self.fallback
        method = not isinstance(owner, types.ModuleType)

        def replacement(*args, **kwargs):
            counted = count
            if watch is not None and not (watch.unchanged(args[0]) if method and args
                                          else watch.unchanged()):
                pass  # what was decided on changed: the original computes it
            elif not to_original():
                try:
                    result = compute(*args, **kwargs)
                except Decline as e:
                    counted = count and e.counted
                except InputError:
                    if not fallback:
                        raise
                else:
                    if count:
                        bump(calls)
                    return result
            if counted:
                bump(fallbacks)
            return original(*args, **kwargs)

        # (an nn.Module in the function's place, a hub-kernel layer: called as its forward)
        replacement.__signature__ = inspect.signature(
            original.forward if isinstance(original, torch.nn.Module) else original)
        replacement.__doc__ = doc
        self.install(owner, name, replacement, target)

    def install(self, module: types.ModuleType, name: str, replacement: Callable,
                target: str, listed: bool = True) -> None:
        """Replace ``module.<name>`` with ``replacement`` until ``undo()``; ``target`` is
        its name in ``targets`` (where ``listed``: a replacement that computes).  Raises
        RuntimeError if another active handle replaced it."""
        with LOCK:
            owner = _ACTIVE.get((module.__name__, name))
            if owner is not None:
                raise RuntimeError(f"posenc_torch.hf.patch: {module.__name__}.{name} is "
                                   f"already patched by {owner!r}; undo that handle first")
            original = getattr(module, name)
            replacement.__module__ = "posenc_torch.hf"
            replacement.__qualname__ = f"patched.{target}"
            setattr(module, name, replacement)
            _ORIGINALS[replacement] = original
            _ACTIVE[(module.__name__, name)] = self
            self._installed.append((module, name, original, replacement, target))
            if listed:
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
        with LOCK:
            while self._installed:
                module, name, original, wrapper, target = self._installed.pop()
                _ACTIVE.pop((module.__name__, name), None)
                _ORIGINALS.pop(wrapper, None)
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


# The private torch names below are looked up once, as posenc_torch.ops does for its fast
# paths; without them (a torch release that renamed them) every call is treated as plain
# eager code, which is what it is unless a functorch transform or forward AD is active.
_PRIVATE = _ops.PRIVATE
_DISABLE_FUNCTORCH = getattr(torch._C, "_DisableFuncTorch", None)


def to_original() -> bool:
    """Calls under functorch transforms (torch.func.grad / vjp / jvp / vmap) and forward AD
    go to the original function: transformers' elementwise ops support every transform,
    the posenc ops have no forward-mode or batching rule."""
    if torch.compiler.is_compiling() or _PRIVATE is None:
        return False
    return _PRIVATE.transforms_active() or _PRIVATE.forward_ad._current_level >= 0


def bump(counter: torch.Tensor) -> None:
    """Add one to a call counter (an int64 CPU scalar): traced into compiled graphs as a
    tiny op; outside the functorch transforms, which would see the in-place add on a
    captured tensor."""
    if (not torch.compiler.is_compiling() and _DISABLE_FUNCTORCH is not None
            and _PRIVATE is not None and _PRIVATE.transforms_active()):
        with _DISABLE_FUNCTORCH():
            counter.add_(1)
    else:
        counter.add_(1)
