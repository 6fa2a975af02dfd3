"""Deciding a transformers tensor function by the graph torch's tracer captures from it.

A rotary function (``apply_rotary_pos_emb`` and its relatives) is replaced only when it
computes, op for op, what posenc's own reference of one form computes
(``_references``).  Three steps, each of which can refuse:

1. **Reach** (:func:`reach`).  Everything the function can run is collected from its code
   object: the function itself (a wrapper is judged as itself, never by what
   ``__wrapped__`` names), the functions its globals, closure cells and defaults bind,
   transitively, and their nested code.  Each must keep to the allow-list:

   * a global is the ``torch`` module, one of the builtins in ``_BUILTINS``, a plain
     Python function (reached in turn) or a plain value (a number, bool, None, or a tuple
     of those); a closure cell or a default likewise;
   * every attribute it reads is in :data:`ALLOWED_ATTRIBUTES`: ops that the tracer
     records as graph nodes, the shape reads it makes symbolic (``shape``, ``size``) or
     that are the same for every input posenc takes (``dim``, ``ndim``: the layouts fix
     the rank), dtype constants, and ``dtype`` (a function that reads it is captured
     under every dtype combination posenc takes, see below);
   * it writes no attribute or global, imports nothing, catches no exception, and loads
     or builds no string.

   This is complete for what a trace fixes silently.  A trace runs the Python code once
   and keeps the ops; every Python value a branch could test is, for such a function,
   either a size (symbolic: the branch leaves a guard, step 2), a rank (fixed by the
   layouts posenc takes), a dtype (every combination is captured), or a value the key
   holds (globals, cells, defaults: step 3).  Device, grad mode, ``requires_grad``,
   ``grad_fn``, ``is_leaf``, storage offset, data pointer, ``type()``, ``globals()``, a
   class attribute, a tensor held in a global: each is reachable only through a name the
   list lacks, a global of another kind, formatting a tensor into a string (its repr
   shows them), or catching the error an op raises for some of them.

2. **Capture** (:func:`capture`).  torch's ``make_fx`` tracer in pre-dispatch mode (the
   tracer under ``torch.export``'s non-strict mode) records the ATen ops as Python calls
   them, above autograd and above the composite decompositions, so a cast, a detach or a
   clamp is a node whatever the inputs' dtypes.  Every size is symbolic, built from the
   relations posenc requires and nothing more (``_inputs``: q and k share batch, length
   and head size; the tables' width is the head size, a part of it, or half of it, as
   the form takes them; the tables' batch is 1 or the batch, one capture each), with
   size-oblivious reasoning so that no size is specialized at 0 or 1.  The capture must
   succeed (a read of tensor data, an unsupported op: refused) and record no guard: a
   guard means the trace holds only for some sizes, i.e. a branch or a specialization.

3. **Compare** (:func:`canonical`).  Two graphs are the same when their outputs are the
   same expressions: each node stands for its op and its arguments' expressions, sizes
   for their symbolic formulas; node names, order and shared subexpressions do not
   count, and the two operands of ``mul`` and ``add`` are put in one order (both are
   exactly commutative).  Nothing that could change a rounding is rewritten.  Ops that
   write in place are refused.

The verify command runs these steps on transformers' functions and writes the verdict as
a row of the table (``posenc_torch.hf._table``); nothing here runs inside ``patch()``.
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import hashlib
import types
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

#: Attribute names a reached function may read (see the module docstring).
ALLOWED_ATTRIBUTES = frozenset({
    # ops, each recorded as a graph node
    "cat", "concat", "stack", "chunk", "split", "flatten", "unflatten", "view", "reshape",
    "transpose", "permute", "unsqueeze", "squeeze", "repeat_interleave", "float", "to",
    "neg", "mul", "add", "sub",
    # shapes: symbolic in the trace (shape, size) or fixed by the layout (dim, ndim)
    "shape", "size", "dim", "ndim",
    # dtypes: constants, and the one read that makes the decision capture every dtype
    "float16", "bfloat16", "float32", "float64", "dtype",
})
_DTYPE_READS = frozenset({"dtype", "float16", "bfloat16", "float32", "float64", "view", "to",
                          "float"})
_BUILTINS = {name: getattr(builtins, name)
             for name in ("enumerate", "len", "range", "zip", "tuple", "list")}
# Opcodes (CPython 3.11 to 3.13) that write state, import, or build strings.
_REFUSED_OPCODES = frozenset({
    "STORE_ATTR", "DELETE_ATTR", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME",
    "LOAD_NAME", "DELETE_NAME", "IMPORT_NAME", "IMPORT_FROM", "IMPORT_STAR",
    "LOAD_BUILD_CLASS", "LOAD_CLASSDEREF", "LOAD_SUPER_ATTR", "LOAD_FROM_DICT_OR_GLOBALS",
    "LOAD_FROM_DICT_OR_DEREF", "FORMAT_VALUE", "FORMAT_SIMPLE", "FORMAT_WITH_SPEC",
    "CONVERT_VALUE", "BUILD_STRING", "BEFORE_WITH", "SETUP_WITH", "STORE_SUBSCR",
    "DELETE_SUBSCR", "DELETE_DEREF"})
_ATTRIBUTE_OPCODES = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


class Refused(Exception):
    """The function is not one posenc replaces; the message says why."""


# ---------------------------------------------------------------------------------------
# 1. Reach.


class Reached(NamedTuple):
    """What a function can run: the functions in the order reached (the function first),
    the attributes they read, and what each holds."""

    functions: tuple[types.FunctionType, ...]
    attributes: frozenset[str]
    parts: tuple

    @property
    def reads_dtype(self) -> bool:
        """Reads a dtype or an element size (``view`` to another dtype): captured under
        every dtype pair."""
        return bool(self.attributes & _DTYPE_READS)


def _plain(value: object) -> bool:
    if isinstance(value, tuple):
        return all(map(_plain, value))
    return value is None or type(value) in (int, float, bool)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def code_part(code: types.CodeType) -> tuple:
    """A code object as the key holds it: what it executes, not where it was written."""
    consts = tuple(code_part(c) if isinstance(c, types.CodeType) else (type(c).__name__, c)
                   for c in code.co_consts)
    return (code.co_code.hex(), consts, code.co_names, code.co_varnames, code.co_freevars,
            code.co_cellvars, code.co_argcount, code.co_posonlyargcount,
            code.co_kwonlyargcount, code.co_flags,
            getattr(code, "co_exceptiontable", b"").hex())


def reach(func: object) -> Reached:
    """Every function ``func`` can run, checked against the allow-list; Refused with the
    first thing that is not allowed."""
    if not isinstance(func, types.FunctionType):
        raise Refused(f"it is a {type(func).__name__}, not a plain Python function")
    order: list[types.FunctionType] = []
    index: dict[int, int] = {}
    attributes: set[str] = set()
    parts = []

    def value_part(value: object, where: str) -> object:
        if value is torch:
            return ("torch", torch.__version__)
        if isinstance(value, types.FunctionType):
            return ("function", visit(value))
        if _plain(value):
            return ("value", repr(value))
        raise Refused(f"{where} is a {type(value).__name__}, which posenc does not look into")

    def visit(f: types.FunctionType) -> int:
        if id(f) in index:
            return index[id(f)]
        index[id(f)] = len(order)
        order.append(f)
        name = f.__qualname__
        globals_read, read_here, strings = set(), [], []
        for code in _codes(f.__code__):
            if getattr(code, "co_exceptiontable", b""):
                raise Refused(f"{name} catches exceptions")
            for ins in dis.get_instructions(code):
                if ins.opname in _REFUSED_OPCODES:
                    raise Refused(f"{name} uses {ins.opname}")
                if ins.opname == "STORE_DEREF" and ins.argval in code.co_freevars:
                    raise Refused(f"{name} writes the variable {ins.argval} of an enclosing "
                                  "function (nonlocal)")
                if ins.opname in _ATTRIBUTE_OPCODES:
                    read_here.append(ins.argval)
                elif ins.opname == "LOAD_GLOBAL":
                    globals_read.add(ins.argval)
                elif ins.opname == "LOAD_CONST" and isinstance(ins.argval, (str, bytes)):
                    strings.append(ins.argval)
        reads = []
        for g in sorted(globals_read):
            if g in f.__globals__:
                reads.append((g, value_part(f.__globals__[g], f"the global {g} of {name}")))
            elif g in _BUILTINS and f.__builtins__ is vars(builtins) and \
                    vars(builtins).get(g) is _BUILTINS[g]:
                reads.append((g, ("builtin", g)))
            else:
                raise Refused(f"{name} reads the builtin {g}")
        for attribute in read_here:
            if attribute not in ALLOWED_ATTRIBUTES:
                raise Refused(f"{name} reads .{attribute}")
        if strings:
            raise Refused(f"{name} loads the string {strings[0]!r}")
        attributes.update(read_here)
        cells = []
        for var, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=True):
            try:
                contents = cell.cell_contents
            except ValueError:
                contents = None  # an empty cell
            cells.append(value_part(contents, f"the closure variable {var} of {name}"))
        defaults = [value_part(d, f"a default of {name}") for d in f.__defaults__ or ()]
        kwdefaults = sorted((k, value_part(v, f"the default of {k} in {name}"))
                            for k, v in (f.__kwdefaults__ or {}).items())
        parts.append((index[id(f)], code_part(f.__code__), tuple(reads), tuple(cells),
                      tuple(defaults), tuple(kwdefaults)))
        return index[id(f)]

    visit(func)
    return Reached(tuple(order), frozenset(attributes), tuple(sorted(parts)))


# ---------------------------------------------------------------------------------------
# 2. Capture.


class Regime(NamedTuple):
    """One capture's inputs.

    layout: "full" (tables as wide as the heads), "partial" (tables of an even width up
        to the head size), "half" (tables of half the head size), "vision" (q, k of
        (N, H, D), tables (N, D)), "sections" (the 4.x multimodal tables (3, Bc, T, D)
        and three section sizes).
    shared: the tables' batch is 1 (broadcast over the batch), else the batch itself.
    dtypes: q's and k's dtype, the tables' dtype.
    """

    layout: str
    shared: bool
    dtypes: tuple[torch.dtype, torch.dtype]


@contextlib.contextmanager
def _size_oblivious() -> Iterator[None]:
    import torch.fx.experimental._config as fx_config
    with fx_config.patch(backed_size_oblivious=True):
        yield


class _Sizes:
    """The symbolic sizes of one layout, in one shape environment, and the inputs of each
    regime built from them.  Sizes that may be 0 range over [0, inf); the rotary widths
    over [1, inf) (posenc takes no empty rotation)."""

    def __init__(self, layout: str) -> None:
        from torch._dynamo.source import ConstantSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
        from torch.utils._sympy.value_ranges import ValueRanges

        self.layout = layout
        self.env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.env)
        self.labels: dict = {}

        def size(label: str, hint: int, least: int = 0) -> torch.SymInt:
            symbol = self.env.create_symbol(hint, ConstantSource(label),
                                            dynamic_dim=DimDynamic.DYNAMIC)
            self.env.var_to_range[symbol] = ValueRanges(least, self.env.var_to_range[symbol].upper)
            self.labels[symbol] = label
            return self.env.create_symintnode(symbol, hint=hint)

        if layout == "vision":
            self.n, self.heads, self.dim = size("N", 7), size("H", 3), 2 * size("d", 6, 1)
            return
        self.batch, self.heads, self.kv_heads = size("B", 2), size("Hq", 3), size("Hk", 5)
        self.seq = size("T", 7)
        self.sections = None
        if layout == "full":
            self.dim = self.width = 2 * size("d", 6, 1)
        elif layout == "partial":
            self.width = 2 * size("r", 4, 1)
            self.dim = self.width + size("p", 6)
        elif layout == "half":
            self.width = size("r", 6, 1)
            self.dim = 2 * self.width
        elif layout == "sections":
            self.sections = (size("a", 2), size("b", 3), size("c", 4))
            self.dim = self.width = 2 * sum(self.sections)
        else:
            raise ValueError(f"unknown layout {layout!r}")

    def inputs(self, regime: Regime) -> tuple[tuple, Callable]:
        """(the tensor arguments, how the traced function calls the judged one)."""
        qd, td = regime.dtypes
        with self.mode:
            if self.layout == "vision":
                q, k = (torch.empty(self.n, self.heads, self.dim, dtype=qd) for _ in range(2))
                cos, sin = (torch.empty(self.n, self.dim, dtype=td) for _ in range(2))
                return (q, k, cos, sin), lambda f, *a: f(*a)
            # contiguous: strides are not a name the allow-list has, and their symbolic
            # formulas only slow the trace down
            q = torch.empty(self.batch, self.heads, self.seq, self.dim, dtype=qd)
            k = torch.empty(self.batch, self.kv_heads, self.seq, self.dim, dtype=qd)
            rows = (1 if regime.shared else self.batch, self.seq, self.width)
            if self.sections is None:
                cos, sin = (torch.empty(rows, dtype=td) for _ in range(2))
                return (q, k, cos, sin), lambda f, *a: f(*a)
            # the section sizes as sizes of an input, so that the graph binds them
            sections = torch.empty(self.sections)
            cos, sin = (torch.empty((3, *rows), dtype=td) for _ in range(2))
        return ((q, k, cos, sin, sections),
                lambda f, q, k, cos, sin, s: f(q, k, cos, sin, list(s.shape)))


class Tracer:
    """Captures of one function under regimes of one layout, in one shape environment
    (the sizes' reasoning is shared, and so are the guards)."""

    def __init__(self, func: Callable, layout: str) -> None:
        self.func = func
        with _size_oblivious():
            self.sizes = _Sizes(layout)
        self.graphs: dict[Regime, tuple[str, tuple] | Refused] = {}

    def graph(self, regime: Regime) -> tuple[str, tuple]:
        """(digest, op counts) of the capture under ``regime``; Refused when it cannot be
        captured, writes in place, or does not return two tensors."""
        if regime not in self.graphs:
            try:
                self.graphs[regime] = self._capture(regime)
            except Refused as e:
                self.graphs[regime] = e
        got = self.graphs[regime]
        if isinstance(got, Refused):
            raise got
        return got

    @property
    def guards(self) -> frozenset[str]:
        """Every guard recorded so far: where the captures hold."""
        return frozenset(_expression(g.expr, self.sizes.labels) for g in self.sizes.env.guards)

    def _capture(self, regime: Regime) -> tuple[str, tuple]:
        from torch.fx.experimental.proxy_tensor import make_fx

        returned = []
        with _size_oblivious():
            args, call = self.sizes.inputs(regime)

            def traced(*a):
                returned.append(call(self.func, *a))
                return returned[-1]

            try:
                with self.sizes.mode:
                    gm = make_fx(traced, pre_dispatch=True)(*args)
            except Exception as e:  # noqa: BLE001 -- what the tracer could not capture, said
                raise Refused(f"the tracer cannot capture it ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
        out = returned[0] if returned else None
        if not (type(out) is tuple and len(out) == 2
                and all(isinstance(t, torch.Tensor) for t in out)):
            raise Refused(f"it returns {type(out).__name__}, not a tuple of two tensors")
        return canonical(gm, self.sizes.labels)


def _expression(expr, labels) -> str:
    import sympy
    return str(expr.xreplace({s: sympy.Symbol(label) for s, label in labels.items()}))


_COMMUTATIVE = frozenset({"aten.mul.Tensor", "aten.add.Tensor"})


def canonical(gm: torch.fx.GraphModule, labels: dict) -> tuple[str, tuple]:
    """The graph's digest as expressions (see the module docstring, step 3), and the count
    of each op."""
    digests: dict[torch.fx.Node, str] = {}
    ops: dict[str, int] = {}
    placeholders = 0

    def arg(a: object) -> object:
        if isinstance(a, torch.fx.Node):
            return digests[a]
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("sym", _expression(a.node.expr, labels))
        if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(a)
        if a is None or type(a) in (int, float, bool, str):
            return (type(a).__name__, a)
        raise Refused(f"its graph holds a {type(a).__name__} argument")

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            digests[node] = f"input {placeholders}"
            placeholders += 1
        elif node.op == "call_function" and isinstance(val, (torch.SymInt, torch.SymFloat,
                                                             torch.SymBool, int)):
            digests[node] = repr(arg(val))  # a size: its formula, however it was computed
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target._schema.is_mutable:
                raise Refused(f"it writes in place ({node.target})")
            name = str(node.target)
            args = [arg(a) for a in node.args]
            if name in _COMMUTATIVE and "alpha" not in node.kwargs:
                args[:2] = sorted(args[:2], key=repr)
            kwargs = tuple(sorted((k, arg(v)) for k, v in node.kwargs.items()))
            digests[node] = _sha((name, tuple(args), kwargs))
            ops[name] = ops.get(name, 0) + 1
        elif node.op == "call_function" and node.target.__name__ == "getitem":
            digests[node] = _sha(("getitem", arg(node.args[0]), node.args[1]))
        elif node.op == "output":
            return _sha(arg(node.args[0])), tuple(sorted(ops.items()))
        else:
            raise Refused(f"its graph calls {node.target} ({node.op}), not an ATen op")
    raise Refused("its graph has no output")


def _sha(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------
# 4. The context of a capture.

@contextlib.contextmanager
def plain_mode() -> Iterator[None]:
    """Captures run as plain eager code whatever the caller's context (CPU default device,
    autograd on, no inference mode, no autocast) and on one thread (their tensors are fake:
    spinning OpenMP threads only slow them down)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with (torch.device("cpu"), torch.inference_mode(False), torch.enable_grad(),
              torch.autocast("cpu", enabled=False)):
            yield
    finally:
        torch.set_num_threads(threads)
