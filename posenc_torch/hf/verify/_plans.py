"""The plan of a 5.x vision tower's ``forward``: which ``vision_utils`` functions it calls
with its caller's ``kwargs`` (so that a precomputed entry is read), with which arguments,
read off its source.  The verify command writes it as the ``use`` of the forward's row
(JSON, evaluated on the model's module by ``posenc_torch.hf._vision_utils``).

Each call's arguments must be ``grid_thw``, a constant or a ``self.<attribute>`` chain; a
call of a function of that family posenc does not precompute, two calls that would read
one entry, or a ``get_max_seqlen`` of boundaries the forward did not compute refuse the
forward.  A call not given ``kwargs`` reads nothing precomputed and is left out (a forward
that gives none, an attention calling ``get_max_seqlen`` on its own, has an empty plan).
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
import types

from .._vision_utils import _FAMILY, _MAX, FUNCTIONS


class Refused(Exception):
    """The plan cannot be read off the code; says why."""


def _expression(node: ast.AST) -> object:
    """A row's argument: ``{"value": constant}`` or ``"self.a.b"``; Refused else."""
    if isinstance(node, ast.Constant):
        return {"value": node.value}
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "self" and chain):
        raise Refused(f"an argument {ast.unparse(node)!r} that is not self.<attribute>")
    return "self." + ".".join(reversed(chain))


def _assignment_of(tree: ast.AST, call: ast.Call) -> str | None:
    """The name the last output of ``call`` is assigned to (``a, b = f(...)`` -> "b")."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and node.value is call and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[-1],
                                                                             ast.Name):
                return target.elts[-1].id
            if isinstance(target, ast.Name):
                return target.id
    return None


def plan(cls: type, forward: types.FunctionType, module: types.ModuleType) -> str:
    """The row's ``use`` for ``cls.forward`` (``forward``: its body), as JSON."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError) as e:
        raise Refused(f"the source of {cls.__qualname__}.forward cannot be read ({e})") from None
    produced: dict[str, int] = {}  # variable -> index of the call whose last output it is
    calls: list[dict] = []
    seen: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in (*_FAMILY, _MAX)):
            continue
        name = node.func.id
        if name not in FUNCTIONS and name != _MAX:
            raise Refused(f"{cls.__qualname__}.forward calls {name}, which posenc does not "
                          "precompute")
        given = {kw.arg: kw.value for kw in node.keywords}
        if not (isinstance(given.get("kwargs"), ast.Name) and given["kwargs"].id == "kwargs"):
            continue  # computes without looking for a precomputed entry
        params = [p for p in inspect.signature(getattr(module, name)).parameters
                  if p != "kwargs"]
        bound = dict(zip(params, node.args, strict=False))
        bound.update({k: v for k, v in given.items() if k != "kwargs"})
        if name == _MAX:
            source = bound.get("cu_seqlens")
            if not isinstance(source, ast.Name) or source.id not in produced:
                raise Refused(f"{cls.__qualname__}.forward measures "
                              f"{ast.unparse(source) if source else 'nothing'}, not "
                              "boundaries it computed")
            key = bound.get("kwarg_name")
            key = {"value": "max_seqlen"} if key is None else _expression(key)
            keys = [str(key)]
            call = {"name": _MAX, "key": key, "of": produced[source.id]}
        else:
            if not (isinstance(bound.get("grid_thw"), ast.Name)
                    and bound["grid_thw"].id == "grid_thw"):
                raise Refused(f"{name} is not given the forward's grid_thw as its grids")
            arguments = [[p, "grid_thw" if p == "grid_thw" else _expression(v)]
                         for p, v in bound.items()]
            keys = list(FUNCTIONS[name][1])
            call = {"name": name, "arguments": arguments}
        if seen & set(keys):
            raise Refused(f"two computations read the precomputed {sorted(seen & set(keys))}")
        seen.update(keys)
        calls.append(call)
        parent = _assignment_of(tree, node)
        if parent is not None:
            produced[parent] = len(calls) - 1
    return json.dumps(calls)  # (empty: it reads no precomputed entry)
