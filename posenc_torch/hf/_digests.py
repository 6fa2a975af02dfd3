"""Deciding a transformers integer walk by the exact identity of its code.

``get_rope_index``, the 5.x ``vision_utils`` helpers and the 4.57 vision-tower methods loop
over Python integers read out of tensors; no tracer captures them as a graph.  posenc
replaces one only when its code is, up to names and formatting, code that the project's
tests verified against posenc's walk (``tests/test_hf_digests.py``):

1. **Source.**  The function's source is located from its code object (file and first
   line) and compiled again: it must compile to that very code object (the bytecode,
   constants and names; not the line numbers), so a function made by ``exec`` or a file
   edited after it was imported is not mistaken for the file's text.
2. **Normal form.**  Its syntax tree without docstrings, comments, annotations,
   decorators and formatting; its arguments and local names renamed in the order they
   first appear.  Attribute names, global names and constants stay as they are.
3. **Reach.**  The same for everything it can call that is Python code: the methods of
   its class it calls through ``self``, and every function a global it loads binds (its
   module's helpers, ``vision_utils``' functions), transitively; other globals by what
   they are (a module's name, a class's name, a plain value).
4. **Digest.**  A SHA-256 of all of it.  :data:`TABLE` (``verified.json``, data) lists
   the digests the tests verified, each with what posenc runs for it (a ``get_rope_index``
   convention, a walk, a method replacement) and the releases it was seen in.
   ``python -m posenc_torch.hf.digests`` prints the installed release's digests and
   which are unknown.

A digest is computed once per code identity (the function objects, their code objects
and the objects their globals bind), so a call that routes pays for a dictionary lookup.
"""

from __future__ import annotations

import __future__
import ast
import functools
import hashlib
import inspect
import json
import linecache
import textwrap
import types
from pathlib import Path
from typing import NamedTuple

from ._graphs import _code_part


class Unverified(Exception):
    """The code cannot be digested, or its digest is not in the table; says which."""


class Entry(NamedTuple):
    """One row of the table: the digest, the function's name, what posenc runs for it, and
    the transformers releases the tests verified it under."""

    digest: str
    function: str
    use: str
    releases: tuple[str, ...]


def _load_table() -> dict[str, Entry]:
    rows = json.loads((Path(__file__).parent / "verified.json").read_text())
    return {row["digest"]: Entry(row["digest"], row["function"], row["use"],
                                 tuple(row["releases"])) for row in rows}


#: The verified digests.
TABLE: dict[str, Entry] = _load_table()


# ---------------------------------------------------------------------------------------
# 1. Source, checked against the code object.


def _future_flags(namespace: dict) -> int:
    flags = 0
    for name in __future__.all_feature_names:
        feature = getattr(__future__, name)
        if namespace.get(name) is feature:
            flags |= feature.compiler_flag
    return flags


def _find_code(code: types.CodeType, name: str, line: int) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name and const.co_firstlineno == line:
                return const
            found = _find_code(const, name, line)
            if found is not None:
                return found
    return None


@functools.cache
def _imported(filename: str) -> tuple[str, ...]:
    """The names the module in ``filename`` binds by import statements outside functions
    and classes (CPython compiles a method call on such a name differently)."""
    try:
        module = ast.parse("".join(linecache.getlines(filename)))
    except SyntaxError:
        return ()
    names, todo = set(), list(module.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt))
    return tuple(sorted(n for n in names if n.isidentifier() and n != "*"))


def _tree(func: types.FunctionType) -> ast.FunctionDef:
    """The function's definition, read from its file and checked to be what runs."""
    code = func.__code__
    try:
        lines, first = inspect.getsourcelines(code)
    except (OSError, TypeError) as e:
        raise Unverified(f"the source of {func.__qualname__} cannot be read ({e})") from None
    source = textwrap.dedent("".join(lines))
    # A method is compiled inside a class of its class's name (super(), name mangling),
    # after the module's imports, on the lines it has in the file.
    parts = func.__qualname__.split(".")
    owner = parts[-2] if len(parts) > 1 and parts[-2] != "<locals>" else None
    body = f"class {owner}:\n" + textwrap.indent(source, "    ") if owner else source
    imports = "".join(f"import {name}\n" for name in _imported(code.co_filename))
    padding = first - (2 if owner else 1) - imports.count("\n")
    if padding < 0:
        raise Unverified(f"{func.__qualname__} is too near the top of its file to be checked")
    try:
        compiled = compile(imports + "\n" * padding + body, code.co_filename, "exec",
                           flags=_future_flags(func.__globals__), dont_inherit=True)
    except SyntaxError as e:
        raise Unverified(f"the source of {func.__qualname__} does not compile ({e})") from None
    again = _find_code(compiled, code.co_name, code.co_firstlineno)
    if again is None or _code_part(again) != _code_part(code):
        raise Unverified(f"the source of {func.__qualname__} in {code.co_filename} is not the "
                         "code that runs (made by exec, or the file changed after import)")
    node = ast.parse(source).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise Unverified(f"{func.__qualname__} is not defined by a def statement")
    return node


# ---------------------------------------------------------------------------------------
# 2. The normal form.


class _Normalize(ast.NodeTransformer):
    """Drops docstrings, annotations and decorators; renames the bound names."""

    def __init__(self, bound: set[str]) -> None:
        self.bound = bound
        self.names: dict[str, str] = {}

    def rename(self, name: str) -> str:
        if name not in self.bound:
            return name
        return self.names.setdefault(name, f"v{len(self.names)}")

    def visit_FunctionDef(self, node):  # noqa: N802 -- ast's naming
        node.decorator_list, node.returns = [], None
        if (node.body and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
                and isinstance(node.body[0].value.value, str)):
            node.body = node.body[1:] or [ast.Pass()]
        node.name = self.rename(node.name)
        self.generic_visit(node)
        return node

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_arg(self, node):  # noqa: N802
        node.annotation = None
        node.arg = self.rename(node.arg)
        return node

    def visit_AnnAssign(self, node):  # noqa: N802
        if node.value is None:
            return None
        return self.visit(ast.Assign(targets=[node.target], value=node.value, lineno=0))

    def visit_Name(self, node):  # noqa: N802
        node.id = self.rename(node.id)
        return node


def _bound_names(node: ast.AST) -> set[str]:
    """Arguments and every name stored anywhere in the definition."""
    bound = set()
    for n in ast.walk(node):
        if isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            bound.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not node:
            bound.add(n.name)
    return bound


def _dump(node: object) -> str:
    """A dump that leaves out empty fields, so that a Python release adding an optional
    field (3.12's ``type_params``) does not change it."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={_dump(value)}" for name, value in ast.iter_fields(node)
                  if value not in (None, [])]
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(_dump(x) for x in node)}]"
    return repr(node)


# ---------------------------------------------------------------------------------------
# 3 and 4. Reach and digest.


def _plain(value: object) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(map(_plain, value))
    return value is None or type(value) in (int, float, bool, str, bytes)


def _what(value: object) -> str:
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    if _plain(value):
        return f"value {value!r}"
    if isinstance(value, types.BuiltinFunctionType):
        return f"builtin {getattr(value, '__module__', None)}.{value.__qualname__}"
    return f"object of {type(value).__module__}.{type(value).__qualname__}"


def _unwrap_method(value: object) -> object:
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _parts(func: types.FunctionType, owner: type | None
           ) -> tuple[list[tuple[str, str]], list[tuple[types.FunctionType, type | None]]]:
    """(role, normal form or what it is) of ``func`` and of everything it reaches, and the
    functions reached (with the class whose methods they are)."""
    out: list[tuple[str, str]] = []
    seen: dict[int, str] = {}
    reached: list[tuple[types.FunctionType, type | None]] = []

    def visit(f: types.FunctionType, role: str, cls: type | None) -> None:
        if id(f) in seen:
            out.append((role, f"same as {seen[id(f)]}"))
            return
        seen[id(f)] = role
        reached.append((f, cls))
        node = _tree(f)
        self_name = node.args.args[0].arg if cls is not None and node.args.args else None
        loads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                 and isinstance(n.ctx, ast.Load)}
        calls = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                 and isinstance(n.value, ast.Name) and n.value.id == self_name}
        normal = _Normalize(_bound_names(node)).visit(node)
        out.append((role, _dump(normal)))
        for cell_name, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=True):
            value = cell.cell_contents
            if isinstance(value, types.FunctionType):
                visit(value, f"{role} cell {cell_name}", None)
            else:
                out.append((f"{role} cell {cell_name}", _what(value)))
        for name in sorted(loads):
            if name not in f.__globals__:
                continue  # a builtin (its name is in the normal form) or a local
            value = f.__globals__[name]
            if isinstance(value, types.FunctionType):
                visit(value, f"global {name}", None)
            else:
                out.append((f"{role} global {name}", _what(value)))
        for name in sorted(calls):
            value = _unwrap_method(inspect.getattr_static(cls, name, None))
            if isinstance(value, types.FunctionType):
                visit(value, f"self.{name}", cls)

    visit(func, "function", owner)
    return out, reached


# (function, owner) -> (identity of what was reached, digest)
_MEMO: dict[tuple, tuple[tuple, str, list]] = {}


def _identity(reached: list[tuple[types.FunctionType, type | None]]) -> tuple:
    """What a digest depends on, by identity: each function reached, its code, its cells'
    and its globals' objects, and its class's attributes (cheap to recompute)."""
    out = []
    for f, cls in reached:
        out.append((id(f.__code__), tuple(id(c.cell_contents) for c in f.__closure__ or ()),
                    tuple(id(f.__globals__.get(n)) for n in f.__code__.co_names),
                    tuple(map(id, vars(cls).values())) if cls is not None else ()))
    return tuple(out)


def digest(func: object, owner: type | None = None) -> str:
    """The digest of ``func`` (a method of ``owner``, or a plain function); Unverified
    when its code cannot be read as it runs."""
    func = _unwrap_method(func)
    if not isinstance(func, types.FunctionType):
        raise Unverified(f"{func!r} is not a Python function")
    known = _MEMO.get((func, owner))
    if known is not None and known[0] == _identity(known[2]):
        return known[1]
    parts, reached = _parts(func, owner)
    value = hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    _MEMO[(func, owner)] = (_identity(reached), value, reached)
    return value


def verified(func: object, owner: type | None, kind: str) -> Entry:
    """The table's entry for ``func``, which must be the function named ``kind``;
    Unverified (naming the digest) otherwise."""
    name = getattr(func, "__qualname__", repr(func))
    value = digest(func, owner)
    entry = TABLE.get(value)
    if entry is None or entry.function != kind:
        raise Unverified(f"{name} has the digest {value[:16]}, which no test of posenc_torch "
                         "verified (`python -m posenc_torch.hf.digests` lists the installed "
                         "ones)")
    return entry
