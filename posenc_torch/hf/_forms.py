"""The source forms of transformers' rotary functions that posenc computes exactly, and
the rule that says when a function's source must be one of them.

A form is the source of a function as transformers writes it (any name; the 4.x
signature's unused ``position_ids=None`` is ignored) with the helpers it calls by name
(``rotate_half``, ...), compared as syntax trees: formatting, comments, docstrings, type
hints and decorators aside.

The rule (``branches``): a function whose source, or the source of a wrapper around it or
of a helper it calls, can take another path for some inputs (an ``if``, a conditional
expression, ``and``/``or``, a loop or comprehension, ``try``/``match``, or a read of
``.shape``, ``.dtype``, ``.device``, ``.ndim``, ``size()``, ``dim()``, ``is_grad_enabled``
and the like) may compute something else exactly where no probe input looks.  Such a
function is replaced only when its source is a known form *and* the probe agrees; a
branch-free function computes one formula on every input, which the probe decides.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from typing import NamedTuple


class Form(NamedTuple):
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


_Form = Form  # the table below names it so

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


HALF = Form("half", "as_given", False, None)
DISTINCT_FORMS: tuple[Form, ...] = tuple(dict.fromkeys(form for _, _, form in _FORMS))

# The vision towers' apply_rotary_pos_emb_vision (computed in fp32, cast back to q's and
# k's dtypes) and the 4.x Qwen2-VL apply_multimodal_rotary_pos_emb (sections merged by
# axis i % 3), each with transformers' rotate_half.
_VISION = """
def f(q, k, cos, sin):
    orig_q_dtype = q.dtype
    orig_k_dtype = k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    q_embed = q_embed.to(orig_q_dtype)
    k_embed = k_embed.to(orig_k_dtype)
    return q_embed, k_embed
"""
_MULTIMODAL = """
def f(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    mrope_section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1).unsqueeze(
        unsqueeze_dim
    )
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1).unsqueeze(
        unsqueeze_dim
    )
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""
#: For the vision and multimodal functions: their one known form each.
OTHER_FORMS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "apply_rotary_pos_emb_vision": (_VISION, {"rotate_half": (_ROTATE_HALF,)}),
    "apply_multimodal_rotary_pos_emb": (_MULTIMODAL, {"rotate_half": (_ROTATE_HALF,)}),
}


def tree(source: str) -> str:
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
def _trees(source: str, helpers: tuple[tuple[str, tuple[str, ...]], ...]
           ) -> tuple[str, dict[str, frozenset[str]]]:
    return tree(source), {name: frozenset(tree(h) for h in accepted) for name, accepted in helpers}


def _source_tree(func: object) -> str | None:
    """The tree of ``func`` itself (not of what it wraps), None when unreadable."""
    if not isinstance(func, types.FunctionType):
        return None
    try:
        return tree(inspect.getsource(func))
    except (OSError, TypeError, SyntaxError, IndexError):
        return None


def _matches(func: object, source: str, helpers: dict[str, tuple[str, ...]]) -> bool:
    if _source_tree(func) != _trees(source, tuple(helpers.items()))[0]:
        return False
    namespace = func.__globals__
    accepted = _trees(source, tuple(helpers.items()))[1]
    return all(_source_tree(namespace.get(name)) in trees for name, trees in accepted.items())


def form_of(func: object) -> Form | None:
    """The form of the text rotary function ``func`` (with the helpers its globals bind),
    or None if it is none we know.  A wrapper is judged as itself: a function that wraps a
    known form is not that form."""
    for source, helpers, form in _FORMS:
        if _matches(func, source, helpers):
            return form
    return None


def is_known(name: str, func: object) -> bool:
    """Whether ``func`` (transformers' ``name``: the vision or multimodal function) is its
    known form."""
    source, helpers = OTHER_FORMS[name]
    return _matches(func, source, helpers)


_READS = frozenset({"shape", "dtype", "device", "ndim", "size", "dim", "numel", "stride",
                    "is_grad_enabled", "is_inference_mode_enabled", "is_autocast_enabled",
                    "requires_grad", "is_floating_point", "is_complex", "is_cuda", "layout",
                    "is_contiguous", "is_compiling", "training", "names"})
_BRANCHES = {ast.If: "an if", ast.IfExp: "a conditional expression", ast.BoolOp: "and/or",
             ast.For: "a loop", ast.While: "a loop", ast.comprehension: "a comprehension",
             ast.Try: "a try", ast.Match: "a match"}


def _branches_of(func: types.FunctionType) -> set[str]:
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError, IndexError):
        return {"a source that cannot be read"}
    found = set()
    for n in ast.walk(node):
        what = _BRANCHES.get(type(n))
        if what is not None:
            found.add(what)
        elif isinstance(n, ast.Attribute) and n.attr in _READS:
            found.add(f"a read of .{n.attr}")
        elif isinstance(n, ast.Name) and n.id in ("len", "isinstance", "getattr", "hasattr"):
            found.add(f"a call of {n.id}")
    return found


def _reached(func: object) -> list[types.FunctionType] | None:
    """``func``, what it wraps (``__wrapped__``, closure cells) and the functions its
    globals bind, transitively; None when one of them is not a plain Python function
    whose source could be read (a callable object, a builtin it was replaced by)."""
    seen: dict[int, types.FunctionType] = {}
    todo = [func]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        if not isinstance(f, types.FunctionType):
            return None
        seen[id(f)] = f
        namespace = f.__globals__
        for name in global_loads(f.__code__):
            value = namespace.get(name)
            if isinstance(value, types.FunctionType):
                todo.append(value)
            elif callable(value) and not isinstance(value, (type, types.ModuleType,
                                                             types.BuiltinFunctionType)):
                return None
        for cell in f.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if callable(value) and not isinstance(value, (type, types.BuiltinFunctionType)):
                todo.append(value)
        if hasattr(f, "__wrapped__"):
            todo.append(f.__wrapped__)
    return list(seen.values())


def branches(func: object) -> list[str]:
    """Why ``func`` can compute something else for inputs no probe reaches: the branching
    constructs and metadata reads of its source and of everything it reaches (see the
    module docstring), as "<qualname>: <what>" strings; empty for a branch-free function."""
    reached = _reached(func)
    if reached is None:
        return [f"{getattr(func, '__qualname__', func)!s}: a callable that is not a Python "
                "function reached"]
    out = []
    for f in reached:
        out += [f"{f.__qualname__}: {what}" for what in sorted(_branches_of(f))]
    return out


@functools.cache  # code objects are immutable; patch() scans the same ones each call
def global_loads(code: types.CodeType) -> frozenset[str]:
    """Global names loaded by ``code`` and the functions nested in it."""
    import dis

    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname == "LOAD_GLOBAL"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_loads(const)
    return frozenset(names)


def describe(form: Form) -> str:
    words = [f"{form.pairing} pairs", f"tables {form.table.replace('_', ' ')}"]
    if form.partial:
        words.append("partial rotary")
    if form.cast:
        words.append({"each": "results cast to q's and k's dtypes",
                      "fp32_to_q": "computed in fp32, cast to q's dtype"}[form.cast])
    if form.permute:
        words.append(f"channels de-interleaved at the {form.permute}")
    return "the form with " + ", ".join(words)
