"""The identity of a transformers function: the digest of its normalized code and of
everything it reaches, and the watch that tells, per call, that none of it changed
(docs/transformers.md, "The decision rule").

The digest, computed once per code identity, is a SHA-256 of the function's syntax tree,
read from its file and checked to compile to the very code object that runs (1.; not code
made by ``exec`` or a file edited after import), in a normal form: no docstrings,
annotations, own decorators or formatting, arguments and locals renamed in order (2.);
and the same for everything it reaches (3.): the methods it calls through ``self``,
resolved on the object's class, and every function a global, a closure cell or a default
binds, transitively.  Other values count by what they are: a module by its name and a
class by its qualified name (each the one found under that name), a plain value by its
repr, a builtin by its name (the function's builtins must be Python's own, unchanged), a
global that is a transformers hub-kernel layer made of a function by that function.

:class:`Watch` holds, by identity, everything the digest was computed from; a replacement
asks :meth:`Watch.unchanged` on every call and hands the call back to transformers when
anything changed since the decision.
"""

from __future__ import annotations

import __future__
import ast
import builtins
import functools
import hashlib
import inspect
import json
import linecache
import sys
import textwrap
import types
from collections.abc import Iterator
from typing import NamedTuple


class Unverified(Exception):
    """The code cannot be digested, or its digest is not in the table; says which."""


#: The builtins as Python started them (a function whose builtins are another mapping,
#: or whose builtin was rebound since, is not digested).
_BUILTINS: dict[str, object] = dict(vars(builtins))
_ABSENT = object()
# replacement -> the function it replaced, while a handle has it installed (a registry,
# not an attribute: ``functools.wraps`` would copy one onto a user's wrapper).  Digests
# and watches see an active replacement as what it replaced.
_ORIGINALS: dict[object, object] = {}


def original_of(obj: object) -> object:
    """The function an active replacement ``obj`` replaced; ``obj`` itself otherwise."""
    try:
        return _ORIGINALS.get(obj, obj)
    except TypeError:  # unhashable
        return obj


# ---------------------------------------------------------------------------------------
# 1. Source, checked against the code object.


def code_part(code: types.CodeType) -> tuple:
    """A code object as what it executes, not where it was written."""
    consts = tuple(code_part(c) if isinstance(c, types.CodeType) else (type(c).__name__, c)
                   for c in code.co_consts)
    return (code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars,
            code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
            code.co_kwonlyargcount, code.co_flags, getattr(code, "co_exceptiontable", b""))


def _future_flags(namespace: dict) -> int:
    flags = 0
    for name in __future__.all_feature_names:
        feature = getattr(__future__, name)
        if namespace.get(name) is feature:
            flags |= feature.compiler_flag
    return flags


def nested_codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code objects of the functions and classes nested in it, depth
    first."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from nested_codes(const)


@functools.cache
def _imported(filename: str) -> tuple[str, ...]:
    """The names the module in ``filename`` binds by import statements outside functions
    and classes (CPython compiles a method call on such a name differently): each import
    statement outside a ``def`` or ``class`` block parsed alone (parsing whole modeling
    files would cost most of ``patch()``)."""
    lines = linecache.getlines(filename)
    names: set[str] = set()
    inside, i = False, 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        i += 1
        if stripped and line[0] not in " \t#)]}\n":
            inside = stripped.startswith(("def ", "async def ", "class ", "@"))
        if inside or not stripped.startswith(("import ", "from ")):
            continue
        statement = stripped
        while (statement.count("(") > statement.count(")")
               or statement.rstrip().endswith("\\")) and i < len(lines):
            statement, i = statement + lines[i], i + 1
        try:
            node = ast.parse(statement.strip()).body[0]
        except (SyntaxError, IndexError):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
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
    # A function defined in a function (a decorator's wrapper) inside a function that
    # binds its free variables.
    # (the code's own qualified name: functools.wraps gives a wrapper its function's)
    parts = getattr(code, "co_qualname", func.__qualname__).split(".")
    owner = parts[-2] if len(parts) > 1 and parts[-2] != "<locals>" else None
    if owner:
        body, above = f"class {owner}:\n" + textwrap.indent(source, "    "), 1
    elif code.co_freevars:
        body = (f"def _enclosing():\n    {' = '.join(code.co_freevars)} = None\n"
                + textwrap.indent(source, "    "))
        above = 2
    else:
        body, above = source, 0
    imports = "".join(f"import {name}\n" for name in _imported(code.co_filename))
    padding = first - 1 - above - imports.count("\n")
    if padding < 0:
        raise Unverified(f"{func.__qualname__} is too near the top of its file to be checked")
    try:
        compiled = compile(imports + "\n" * padding + body, code.co_filename, "exec",
                           flags=_future_flags(func.__globals__), dont_inherit=True)
    except SyntaxError as e:
        raise Unverified(f"the source of {func.__qualname__} does not compile ({e})") from None
    again = next((c for c in nested_codes(compiled) if c.co_name == code.co_name
                  and c.co_firstlineno == code.co_firstlineno), None)
    if again is None or code_part(again) != code_part(code):
        raise Unverified(f"the source of {func.__qualname__} in {code.co_filename} is not the "
                         "code that runs (made by exec, or the file changed after import)")
    node = ast.parse(source).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise Unverified(f"{func.__qualname__} is not defined by a def statement")
    return node


# ---------------------------------------------------------------------------------------
# 2. The normal form.


class _Normalize(ast.NodeTransformer):
    """Drops docstrings, annotations and the definition's own decorators (evaluated once,
    when it was defined); renames the bound names to ``<0>``, ``<1>``, ... (no global can
    be called that)."""

    def __init__(self, bound: set[str]) -> None:
        self.bound = bound
        self.names: dict[str, str] = {}
        self.top = True

    def rename(self, name: str) -> str:
        if name not in self.bound:
            return name
        return self.names.setdefault(name, f"<{len(self.names)}>")

    def visit_FunctionDef(self, node):  # noqa: N802 -- ast's naming
        if self.top:
            node.decorator_list, self.top = [], False
        node.returns = None
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
# 3. Reach, and what a call checks.


_VALUES = (int, float, bool, str, bytes, type(None))


def _plain(value: object) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(map(_plain, value))
    return type(value) in _VALUES


def _what(value: object) -> str:
    if isinstance(value, types.ModuleType):
        real = sys.modules.get(value.__name__) is value
        return f"module {value.__name__}" if real else f"a module {value.__name__!r} of its own"
    if isinstance(value, type):
        found = sys.modules.get(value.__module__)
        for part in value.__qualname__.split("."):
            found = getattr(found, part, None)
        where = "" if found is value else " (not found under that name)"
        return f"class {value.__module__}.{value.__qualname__}{where}"
    if _plain(value):
        return f"value {value!r}"
    if isinstance(value, types.BuiltinFunctionType):
        return f"builtin {getattr(value, '__module__', None)}.{value.__qualname__}"
    return f"object of {type(value).__module__}.{type(value).__qualname__}"


def _unwrap_method(value: object) -> object:
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _class_value(cls: type, name: str) -> object:
    """What ``type(obj).<name>`` gives, in a form that compares by identity."""
    value = getattr(cls, name, _ABSENT)
    return original_of(value.__func__ if isinstance(value, types.MethodType) else value)


def _same_value(now: object, then: object) -> bool:
    """The same object; for plain immutable values, the same type and value (torch.compile
    with dynamic shapes may hand an int default to the code as a symbolic int)."""
    return now is then or (type(then) in _VALUES and type(now) is type(then) and now == then)


def _same(now: tuple | dict | None, then: tuple | dict | None) -> bool:
    """The same defaults, element by element (torch.compile rebuilds the containers)."""
    if now is then:
        return True
    if now is None or then is None or len(now) != len(then):
        return False
    if isinstance(then, dict):
        return all(_same_value(now.get(k, _ABSENT), v) for k, v in then.items())
    return all(_same_value(a, b) for a, b in zip(now, then, strict=True))


def _identical(now: object, then: object) -> bool:
    """``now`` is ``then`` (or the replacement of it); a tuple element by element
    (torch.compile traces no identity test of two tuples)."""
    if type(then) is tuple:
        return (type(now) is tuple and len(now) == len(then)
                and all(_identical(a, b) for a, b in zip(now, then, strict=True)))
    return now is then or original_of(now) is then


class Watch(NamedTuple):
    """Everything a digest was computed from, by identity (see the module docstring)."""

    names: tuple[tuple[object, str, object], ...]  # (namespace, name, object or _ABSENT)
    cells: tuple[tuple[types.CellType, object], ...]
    functions: tuple[tuple[types.FunctionType, types.CodeType, object, object], ...]
    methods: tuple[tuple[str, object], ...]  # reached through self: (name, function)

    def unchanged(self, obj: object = _ABSENT) -> bool:
        """True while every global, builtin, cell, code object and default the decision
        read is the object it read, and ``obj`` (the ``self`` of a method: its class, a
        subclass, an instance attribute) resolves the methods reached through ``self`` to
        the same functions."""
        for namespace, name, value in self.names:
            if not _identical(namespace.get(name, _ABSENT), value):
                return False
        for cell, value in self.cells:
            if not _identical(cell.cell_contents, value):
                return False
        for func, code, defaults, kwdefaults in self.functions:
            if (func.__code__ is not code or not _same(func.__defaults__, defaults)
                    or not _same(func.__kwdefaults__, kwdefaults)):
                return False
        if obj is _ABSENT or not self.methods:
            return True
        # read on the class unless the object's own attributes hold the name (not through
        # the bound method: torch.compile 2.15 hands out no method identity to compare)
        cls = obj if isinstance(obj, type) else type(obj)
        own = {} if isinstance(obj, type) else getattr(obj, "__dict__", {})
        for name, value in self.methods:
            if name in own:
                now = getattr(own[name], "__func__", own[name])
                if now is not value and original_of(now) is not value:
                    return False
            elif _class_value(cls, name) is not value:
                return False
        return True


# id(code object) -> (the code object, its normal form): read once per code object (by
# identity: equal code made elsewhere is checked against its own file), as each function
# is reached from many digests (the rotary functions from every attention forward)
_NORMAL: dict[int, tuple[types.CodeType, tuple[str, frozenset, frozenset]]] = {}


def _normal_form(f: types.FunctionType) -> tuple[str, frozenset, frozenset]:
    """(the dump of the normal form of ``f``, the global or builtin names it loads, the
    attributes it reads of its first argument), from its checked source."""
    entry = _NORMAL.get(id(f.__code__))
    known = entry[1] if entry is not None and entry[0] is f.__code__ else None
    if known is None:
        node = _tree(f)
        normal = _Normalize(_bound_names(node)).visit(node)
        # (read off the normal form: the decorators, evaluated at definition, are gone)
        first = normal.args.args[0].arg if normal.args.args else None
        loads = frozenset(n.id for n in ast.walk(normal) if isinstance(n, ast.Name)
                          and isinstance(n.ctx, ast.Load) and not n.id.startswith("<"))
        attributes = frozenset(n.attr for n in ast.walk(normal) if isinstance(n, ast.Attribute)
                               and isinstance(n.value, ast.Name) and n.value.id == first)
        known = (_dump(normal), loads, attributes)
        _NORMAL[id(f.__code__)] = (f.__code__, known)
    return known


class _Reach:
    """The parts of a digest and its watch, collected while walking what a function
    reaches."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, str]] = []
        self.seen: dict[int, str] = {}
        self.names: list[tuple[object, str, object]] = []
        self.cells: list[tuple[types.CellType, object]] = []
        self.functions: list[tuple] = []
        self.methods: list[tuple[str, object]] = []

    def value(self, value: object, role: str) -> None:
        value = original_of(value)
        if isinstance(value, types.FunctionType):
            self.visit(value, role, None)
        else:
            self.parts.append((role, _what(value)))

    def visit(self, f: types.FunctionType, role: str, cls: type | None) -> None:
        if id(f) in self.seen:
            self.parts.append((role, f"same as {self.seen[id(f)]}"))
            return
        self.seen[id(f)] = role
        self.functions.append((f, f.__code__, f.__defaults__,
                               None if f.__kwdefaults__ is None else dict(f.__kwdefaults__)))
        dump, loads, first_attributes = _normal_form(f)
        calls = first_attributes if cls is not None else frozenset()
        self.parts.append((role, dump))
        for i, default in enumerate((*(f.__defaults__ or ()),
                                     *(f.__kwdefaults__ or {}).values())):
            self.value(default, f"{role} default {i}")
        for cell_name, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=True):
            try:
                contents = cell.cell_contents
            except ValueError as e:
                raise Unverified(f"the closure variable {cell_name} of {f.__qualname__} is "
                                 "empty") from e
            self.cells.append((cell, original_of(contents)))
            self.value(contents, f"{role} cell {cell_name}")
        free = set(f.__code__.co_freevars)
        own_builtins = f.__builtins__ is not vars(builtins)
        for name in sorted(loads - free):
            if name in f.__globals__:
                self.names.append((f.__globals__, name, original_of(f.__globals__[name])))
                self.value(_hub_function(original_of(f.__globals__[name]), name),
                           f"{role} global {name}")
                continue
            self.names.append((f.__globals__, name, _ABSENT))
            if name not in _BUILTINS:
                continue  # a name bound nowhere: the call raises NameError as it would
            if own_builtins or vars(builtins).get(name) is not _BUILTINS[name]:
                raise Unverified(f"{f.__qualname__} reads the builtin {name} from builtins "
                                 "that are not Python's own")
            self.names.append((vars(builtins), name, _BUILTINS[name]))
        for name in sorted(calls):
            value = original_of(_unwrap_method(inspect.getattr_static(cls, name, None)))
            if isinstance(value, types.FunctionType):
                self.methods.append((name, _class_value(cls, name)))
                self.visit(value, f"self.{name}", cls)
            elif value is not None:
                self.parts.append((f"self.{name}", _what(value)))


def _hub_function(value: object, name: str) -> object:
    """The function ``name`` a transformers hub-kernel layer is made of (with the
    ``kernels`` package importable, transformers puts such a layer in its rotary functions'
    place; ``patch()`` decides on and replaces the function inside, see ``_rotary``), else
    ``value``."""
    from . import _transformers

    try:
        return _transformers.hub_kernel_function(value, name) or value
    except _transformers.Unsupported as e:
        raise Unverified(str(e)) from None


# (function, owner) -> (digest, watch)
_MEMO: dict[tuple, tuple[str, Watch]] = {}


def identity(func: object, owner: type | None = None) -> tuple[str, Watch]:
    """The digest of ``func`` (a method of ``owner``, or a plain function) and its watch;
    Unverified when its code cannot be read as it runs.  Computed once per identity."""
    func = _unwrap_method(func)
    if not isinstance(func, types.FunctionType):
        raise Unverified(f"{func!r} is not a Python function")
    known = _MEMO.get((func, owner))
    if known is not None and known[1].unchanged(_ABSENT if owner is None else owner):
        return known
    reach = _Reach()
    reach.visit(func, "function", owner)
    value = hashlib.sha256(json.dumps(reach.parts).encode()).hexdigest()
    watch = Watch(tuple(reach.names), tuple(reach.cells), tuple(reach.functions),
                  tuple(reach.methods))
    _MEMO[(func, owner)] = (value, watch)
    return value, watch


def digest(func: object, owner: type | None = None) -> str:
    """The digest of ``func`` (see :func:`identity`)."""
    return identity(func, owner)[0]
