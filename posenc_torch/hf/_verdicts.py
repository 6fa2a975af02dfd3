"""Verdicts about the installed transformers' functions, kept for exactly as long as what
they judged stays the same.

A verdict (what the probe found a function to compute) is stored under the function's
*behaviour key*: everything its result can depend on that Python lets one read, namely its
code (bytecode, constants, names; not its file or line numbers), its defaults, the
contents of its closure cells, what it wraps, and every global name its code reads, each
bound object by identity, each bound Python function by its own key, transitively.  A
wrapper's key holds the key of the function it wraps; two closures of one factory differ in
their cells; the many model files that carry one copy of a function share a key and so one
probe.  The key is recomputed on every ``patch()``: a function modified, replaced or
restored since is judged as it is now.  Objects bound by identity (``torch``, a table) are
not looked into: a module attribute rebound later (``torch.cat = ...``) is not seen.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import time
import types
from collections.abc import Callable

import torch

from ._forms import global_loads


class _Same:
    """An object compared by identity (and held, so that its id is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


_PLAIN_VALUES = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis))
_MISSING = object()


def _value_key(value: object, seen: tuple) -> object:
    if isinstance(value, _PLAIN_VALUES):
        return (type(value), value)
    if isinstance(value, (tuple, frozenset)) and len(value) < 64:
        return (type(value), tuple(_value_key(v, seen) for v in value))
    return behaviour_key(value, seen)


@functools.cache
def _code_key(code: types.CodeType) -> tuple:
    consts = tuple(_code_key(c) if isinstance(c, types.CodeType) else (type(c), c)
                   for c in code.co_consts)
    return (code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars,
            code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
            code.co_kwonlyargcount, code.co_flags)


def behaviour_key(obj: object, _seen: tuple = ()) -> object:
    """What the result of calling ``obj`` can depend on (see the module docstring), as a
    hashable value equal for two callables exactly when those parts are the same."""
    if isinstance(obj, types.MethodType):
        return ("method", behaviour_key(obj.__func__, _seen), _Same(obj.__self__))
    if isinstance(obj, functools.partial):
        return ("partial", behaviour_key(obj.func, _seen), _value_key(obj.args, _seen),
                tuple(sorted((k, _value_key(v, _seen)) for k, v in obj.keywords.items())))
    if not isinstance(obj, types.FunctionType):
        return _Same(obj)
    if id(obj) in _seen:  # recursion (a function reading its own name)
        return ("again", _seen.index(id(obj)))
    seen = (*_seen, id(obj))
    cells = []
    for cell in obj.__closure__ or ():
        try:
            cells.append(_value_key(cell.cell_contents, seen))
        except ValueError:  # an empty cell
            cells.append("empty cell")
    namespace = obj.__globals__
    reads = []
    for name in sorted(global_loads(obj.__code__)):
        value = namespace.get(name, _MISSING)
        if value is _MISSING:
            value = getattr(builtins, name, _MISSING)
        reads.append((name, _value_key(value, seen)))
    wrapped = getattr(obj, "__wrapped__", _MISSING)
    return ("function", _code_key(obj.__code__), _value_key(obj.__defaults__, seen),
            tuple(sorted((k, _value_key(v, seen)) for k, v in (obj.__kwdefaults__ or {}).items())),
            tuple(cells), tuple(reads),
            None if wrapped is _MISSING else behaviour_key(wrapped, seen))


# (kind, behaviour key) -> outcome.  The outcomes are small (a form, a reason).
_VERDICTS: dict[tuple[str, object], object] = {}
#: Seconds spent deciding in this process (cache hits not counted), per kind of decision
#: ("rotary", "get_rope_index", ...).
SECONDS: dict[str, float] = {}


@contextlib.contextmanager
def plain_mode():
    """Probes run as in plain eager code, whatever the caller's context: CPU default
    device, autograd on, no inference mode, no autocast; and on one torch thread (their
    tensors are small, and on a loaded machine OpenMP's spinning threads made the first
    patch() of every type 30 times slower).  The thread count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with (torch.device("cpu"), torch.inference_mode(False), torch.enable_grad(),
              torch.autocast("cpu", enabled=False)):
            yield
    finally:
        torch.set_num_threads(threads)


def decided(kind: str, key: object, run: Callable[[], object], account: str = "rotary"
            ) -> object:
    """``run()``'s outcome for ``(kind, key)``, computed once while the key stays the same
    (``run`` is called in :func:`plain_mode`; its time is added to ``SECONDS[account]``)."""
    try:
        return _VERDICTS[(kind, key)]
    except KeyError:
        pass
    start = time.perf_counter()
    with plain_mode():
        outcome = run()
    SECONDS[account] = SECONDS.get(account, 0.0) + time.perf_counter() - start
    _VERDICTS[(kind, key)] = outcome
    return outcome


def forget() -> None:
    """Drop every verdict (tests; a changed function needs no call: its key changes)."""
    _VERDICTS.clear()
