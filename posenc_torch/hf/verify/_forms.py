"""Which of posenc's rotary forms a tensor function is: its captures (``_graphs``) against
the captures of each form's reference (``_references``), under every
regime the form is computed in: the tables shared over the batch and per row, and, when
the function reads a dtype or an element size, every dtype pair posenc takes."""

from __future__ import annotations

from collections.abc import Callable

from .._rotary import DTYPES, Form
from . import _graphs
from ._references import REFERENCES, REPRESENTATIVE

_REFERENCES: dict[str, _graphs.Tracer] = {}


def regimes(form: Form, reads_dtype: bool) -> list[_graphs.Regime]:
    """The captures that decide whether a function is ``form``: the representative dtypes
    first, then (for a function that reads a dtype) every other pair the form takes."""
    dtypes = sorted(DTYPES, key=lambda d: d != REPRESENTATIVE) if reads_dtype else [
        REPRESENTATIVE]
    shared = (True,) if form.layout == "vision" else (True, False)
    return [_graphs.Regime(form.layout, s, d) for d in dtypes for s in shared]


def reference(form: Form) -> _graphs.Tracer:
    """The captures of ``form``'s reference (kept for the process)."""
    if form.name not in _REFERENCES:
        _REFERENCES[form.name] = _graphs.Tracer(REFERENCES[form.name], form.layout)
    return _REFERENCES[form.name]


def _difference(theirs: tuple, ours: tuple) -> tuple[int, str]:
    """(how many ops differ, which) between two captures' op counts."""
    a, b = dict(theirs), dict(ours)
    extra = {op: n - b.get(op, 0) for op, n in a.items() if n > b.get(op, 0)}
    missing = {op: n - a.get(op, 0) for op, n in b.items() if n > a.get(op, 0)}
    words = "; ".join(part for part in (
        "it also runs " + ", ".join(f"{op} x{n}" for op, n in extra.items()) if extra else "",
        "it lacks " + ", ".join(f"{op} x{n}" for op, n in missing.items()) if missing else "",
    ) if part)
    return sum(extra.values()) + sum(missing.values()), words or "the same ops, combined otherwise"


def _mismatch(theirs: _graphs.Tracer, form: Form, reads_dtype: bool) -> tuple[int, str] | None:
    """None when the function traced by ``theirs`` is ``form``, else (how far, why): a
    guard says the most (-1), then the fewest ops that differ, then a failed capture."""
    ours = reference(form)
    for regime in regimes(form, reads_dtype):
        try:
            got = theirs.graph(regime)
        except _graphs.Refused as e:
            return 10**6, str(e)
        want = ours.graph(regime)
        if got[0] != want[0]:
            return _difference(got[1], want[1])
    extra = sorted(theirs.guards - ours.guards)
    if extra:
        return -1, f"its trace holds only where {extra[0]} (a branch or specialization on a size)"
    return None


def which_form(func: Callable, forms: tuple[Form, ...], kind: str) -> dict:
    """``{"form": name}`` for the first of ``forms`` that ``func`` is, else
    ``{"form": None, "reason": why}``."""
    try:
        reached = _graphs.reach(func)
    except _graphs.Refused as e:
        return {"form": None, "reason": f"it reaches what posenc does not look into: {e}"}
    tracers: dict[str, _graphs.Tracer] = {}
    misses = []
    with _graphs.plain_mode():
        # the forms whose references read the same attributes first: usually the one
        for form in sorted(forms, key=lambda f: len(
                _graphs.reach(REFERENCES[f.name]).attributes ^ reached.attributes)):
            if form.layout not in tracers:
                tracers[form.layout] = _graphs.Tracer(func, form.layout)
            miss = _mismatch(tracers[form.layout], form, reached.reads_dtype)
            if miss is None:
                return {"form": form.name}
            misses.append((*miss, form.name))
    far, why, name = min(misses, key=lambda m: m[0])
    return {"form": None, "reason": f"its graph is none of posenc's {kind} forms "
                                    f"(closest: {name}: {why})"}
