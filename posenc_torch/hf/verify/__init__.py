"""The verify command: the rows of the verified table for the installed transformers.

    python -m posenc_torch.hf.verify                # every function, its digest, its verdict
    python -m posenc_torch.hf.verify --write FILE   # a table file for patch(table=FILE)
    python -m posenc_torch.hf.verify --check        # make test: exit 1 on what lost its row
    python -m posenc_torch.hf.verify --update       # maintainers: into verified.json

``patch()`` replaces a transformers function only when the digest of its code
(``posenc_torch.hf._digests``) has a row in the verified table (``_table``).  This command
makes the rows, for every function ``patch()`` would replace in the installed release:

* a rotary function (``apply_rotary_pos_emb`` and its kin, with what it calls): the graph
  torch's tracer captures from it, every size symbolic, equals the graph of posenc's
  reference of one form (``_graphs``, ``_forms``), under every dtype pair posenc takes
  where the function reads a dtype or an element size; the row names the form;
* ``get_rope_index``: on prompts laid out as the processors lay them out, written to tell
  the conventions apart and drawn from a fixed seed, it gives bit for bit what posenc's
  walk of one convention gives (``_prompts``); the row names the convention;
* a 5.x ``vision_utils`` function: on grids drawn from a fixed seed it gives what posenc's
  function of the same name gives (``_walks``);
* a 4.57 tower method: on tiny towers of its class the row's replacement gives what the
  method gives, results and gradients (``_towers``);
* a 5.x vision tower's ``forward``: the calls of ``vision_utils`` functions that read its
  caller's precomputed entries, with their arguments, read off its source (``_plans``);
  the row holds that plan, which ``precompute_vision_kwargs`` follows;
* an attention ``forward`` that names ``q_norm`` and ``k_norm``, and the class of its norm
  modules: on tiny attentions of the class, the norm form of the fused q/k norm + rotary op
  that gives what the norm gives, and the one template of posenc's fused ``forward`` that
  gives what the ``forward`` gives, records of its cache and attention calls, results and
  gradients (``_attention``).

Integer walks are checked on samples; the project's table holds only rows its tests also
verified.  ``make test`` runs ``--check`` under every transformers release it installs: a
model type of the release's written patched set whose function has no row listing the
release, or a shipped row whose function no longer verifies to the row's use, fails it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from ..._tables import CONVENTIONS, MODELS, MROPE_MODELS
from .. import (_digests, _qk_attention, _rotary, _table, _tower_methods_457, _transformers,
               _vision_utils)
from .._handle import original_of


class Function(NamedTuple):
    """A function ``patch()`` would replace for ``model_type``."""

    model_type: str
    name: str
    func: object
    owner: type | None
    kind: str  # "rotary", "get_rope_index", "vision_utils", "method", "plan", "norm",
    # "attention"


class Refusal(NamedTuple):
    """A model type none of whose rotary functions ``patch()`` would replace, and why."""

    model_type: str
    reason: str


def functions() -> Iterator[Function | Refusal]:
    """Every function of the known model types that ``patch()`` would replace in the
    installed transformers; a :class:`Refusal` for a type none of whose rotary functions
    would be."""
    for mt in MODELS:
        try:
            module = _transformers.modeling_module(mt)
        except _transformers.Absent:
            continue
        except _transformers.Unsupported as e:
            yield Refusal(mt, str(e))
            continue
        try:
            for name in _rotary.called(mt, module):
                yield Function(mt, name, _rotary.function(module, name), None, "rotary")
        except _transformers.Unsupported as e:
            yield Refusal(mt, str(e))
        owned = (("get_rope_index",) if mt in MROPE_MODELS else ()) + _tower_methods_457.METHODS
        for name in owned:
            try:
                owner = _transformers.owner_class(module, name)
            except _transformers.Unsupported:
                continue
            kind = "get_rope_index" if name == "get_rope_index" else "method"
            yield Function(mt, name, original_of(vars(owner)[name]), owner, kind)
        for name in _vision_utils.FUNCTIONS:
            func = vars(module).get(name)
            if func is not None:
                yield Function(mt, name, original_of(func), None, "vision_utils")
        for cls, forward in _vision_utils.tower_forwards(module):
            yield Function(mt, _vision_utils.FORWARD, forward, cls, "plan")
        yield from _attention_functions(mt, module)


# norm class -> a module of it, from a tiny attention (what the norm check runs)
_NORM_MODULES: dict[type, object] = {}


def _attention_functions(mt: str, module) -> Iterator[Function]:
    """The norm class and the ``forward`` of each q/k-norm attention candidate."""
    from ._attention import tiny_attention

    for cls in _qk_attention.candidates(module):
        try:
            norm = tiny_attention(mt, cls).q_norm
        except Exception:  # noqa: BLE001 -- no tiny attention: the attention check says why
            norm = None
        if isinstance(norm, torch.nn.Module):
            _NORM_MODULES[type(norm)] = norm
            yield Function(mt, _qk_attention.NORM, original_of(type(norm).forward),
                           type(norm), "norm")
        yield Function(mt, _qk_attention.ATTENTION, original_of(vars(cls)["forward"]), cls,
                       "attention")


_DECIDED: dict[tuple[str, str, str], tuple[str | None, str]] = {}


def decide(f: Function, digest: str) -> tuple[str | None, str]:
    """(what posenc runs for it, "") or (None, why not), by the checks of the module
    docstring; kept per digest, function name and model type for the process."""
    key = (digest, f.name, f.model_type if f.kind in ("get_rope_index", "plan") else "")
    if key not in _DECIDED:
        _DECIDED[key] = _decide(f)
    return _DECIDED[key]


def _decide(f: Function) -> tuple[str | None, str]:
    if f.kind == "rotary":
        from ._forms import which_form

        verdict = which_form(f.func, _rotary._FORMS[f.name], f.name)
        return verdict["form"], verdict.get("reason", "")
    if f.kind == "get_rope_index":
        from ._prompts import matching_conventions

        found = matching_conventions(f.model_type, f.owner, f.func)
        if not found:
            return None, "no convention's walk gives its results on every prompt"
        # several give the same ids for a model that reads no seconds: the release's own
        major, minor = (int(x) for x in _transformers.version().split(".")[:2])
        named = [c for c in found if CONVENTIONS[c].names_release(major, minor)]
        return (named or found)[-1], ""
    if f.kind == "plan":
        from ._plans import Refused, plan

        try:
            return plan(f.owner, f.func, _transformers.modeling_module(f.model_type)), ""
        except Refused as e:
            return None, str(e)
    if f.kind == "norm":
        from ._attention import check_norm

        return check_norm(_NORM_MODULES[f.owner])
    if f.kind == "attention":
        from ._attention import check_attention, tiny_attention

        try:
            q_norm = tiny_attention(f.model_type, f.owner).q_norm
            norm_cls = type(q_norm)
            _NORM_MODULES.setdefault(norm_cls, q_norm)
            norm = Function(f.model_type, _qk_attention.NORM, original_of(norm_cls.forward),
                            norm_cls, "norm")
            norm_use = decide(norm, _digests.digest(norm.func, norm_cls))[0]
        except Exception as e:  # noqa: BLE001
            return None, f"its norm class cannot be checked ({type(e).__name__}: {e})"
        return check_attention(f.model_type, f.owner, f.func, norm_use)
    if f.kind == "vision_utils":
        from ._walks import check

        why = check(f.name, f.func)
        return (f.name, "") if why is None else (None, why)
    from ._towers import check_method

    whys = []
    for use, replacement in _tower_methods_457.REPLACEMENTS.items():
        if use.split(",")[0] == f.name:
            why = check_method(f.owner, f.name, replacement, f.func)
            if why is None:
                return use, ""
            whys.append(f"{use}: {why}")
    return None, "; ".join(whys) or "no replacement of that name"


class Verdict(NamedTuple):
    function: Function
    digest: str | None
    use: str | None
    reason: str
    shipped: _table.Row | None


def verdicts(kinds: set[str] | None = None) -> Iterator[Verdict | Refusal]:
    """A verdict per function of :func:`functions` (of ``kinds``, default all) and the
    types it cannot name one for."""
    for f in functions():
        if isinstance(f, Refusal):
            yield f
            continue
        if kinds is not None and f.kind not in kinds:
            continue
        try:
            digest = _digests.digest(f.func, f.owner)
        except _digests.Unverified as e:
            yield Verdict(f, None, None, str(e), None)
            continue
        use, reason = decide(f, digest)
        yield Verdict(f, digest, use, reason, _table.shipped().get((digest, f.name)))


def _problems(found: list, release: str) -> list[str]:
    """What ``--check`` fails on (see the module docstring)."""
    written = set(_table.releases()["patched"].get(release, ()))
    fused = set(_table.releases()["fused"].get(release, ()))
    out = []
    if not written:
        out.append(f"no patched set is written for transformers {release} in verified.json")
    for v in found:
        if isinstance(v, Refusal):
            if v[0] in written:
                out.append(f"{v[0]}: {v[1]}")
            continue
        where = f"{v.function.model_type}.{v.function.name}"
        if v.shipped is not None and v.use != v.shipped.use:
            out.append(f"{where}: the shipped row {v.digest[:16]} says {v.shipped.use!r}, "
                       f"but it verifies as {v.use!r} ({v.reason})")
        elif v.function.model_type in (fused if v.function.kind in ("norm", "attention")
                                       else written) and (v.shipped is None
                                                   or release not in v.shipped.releases):
            state = "no shipped row" if v.shipped is None else "a row not listing it"
            out.append(f"{where}: digest {v.digest}, {state} for {release}: "
                       f"{v.use or v.reason}")
    return out


def _update(found: list, release: str) -> int:
    """Add this release's verified rows to the shipped verified.json."""
    path = Path(_table.__file__).parent / "verified.json"
    data = json.loads(path.read_text())
    rows = {(r["digest"], r["function"]): r for r in data["rows"]}
    for v in found:
        if isinstance(v, Refusal) or v.use is None:
            continue
        row = rows.setdefault((v.digest, v.function.name), {
            "digest": v.digest, "function": v.function.name, "use": v.use, "releases": []})
        if row["use"] != v.use:
            print(f"not updated: {v.digest} is {row['use']!r} in the table, {v.use!r} here")
            return 1
        row["releases"] = sorted({*row["releases"], release},
                                 key=lambda r: tuple(map(int, r.split("."))))
    data["rows"] = sorted(rows.values(), key=lambda r: (r["function"], r["use"], r["digest"]))
    path.write_text(_dump(data))
    print(f"{path}: {len(data['rows'])} rows")
    return 0


def _dump(data: dict) -> str:
    """The table file's text: one entry of the release facts, one row, a line."""
    def block(items: list[str], close: str) -> str:
        return "[\n" + ",\n".join(items) + f"\n {close}"

    parts = []
    for key, value in data.items():
        if key == "rows":
            text = block(["  " + json.dumps(r) for r in value], "]")
        elif isinstance(value, dict):
            text = "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}"
                                       for k, v in value.items()) + "\n }"
        else:
            text = json.dumps(value)
        parts.append(f" {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write(path: str | os.PathLike, rows: list[dict]) -> None:
    """Write ``rows`` as a table file of the installed transformers release (readable by
    the user alone to write: ``patch()`` refuses a file others can write)."""
    data = {"format": _table.FORMAT, "transformers": _transformers.version(),
            "torch": torch.__version__, "rows": rows}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "w") as out:
        out.write(_dump(data))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posenc_torch.hf.verify",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="FILE",
                        help="write the verified rows to FILE, for patch(table=FILE) or "
                             f"{_table.ENV}=FILE")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a type of this release's written patched set has "
                             "a function without a row, or a shipped row does not verify")
    parser.add_argument("--update", action="store_true",
                        help="add this release's rows to the shipped verified.json")
    parser.add_argument("--only", metavar="KINDS",
                        help="comma-separated kinds to verify: rotary, get_rope_index, "
                             "vision_utils, method, plan, norm, attention (default: all)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    release = _transformers.version()
    found = list(verdicts(set(args.only.split(",")) if args.only else None))
    for v in found:
        if isinstance(v, Refusal):
            print(f"{v[0]:18s} not patched: {v[1]}")
            continue
        state = ("shipped" if v.shipped is not None and v.shipped.use == v.use
                 else "NEW" if v.use is not None else "REFUSED")
        print(f"{v.function.model_type:18s} {v.function.name:46s} "
              f"{(v.digest or '-')[:16]:16s} {state:8s} {v.use or v.reason}")
    rows = {(v.digest, v.function.name): {"digest": v.digest, "function": v.function.name,
                                          "use": v.use, "releases": [release]}
            for v in found if not isinstance(v, Refusal) and v.use is not None}
    print(f"transformers {release}: {len(rows)} verified digests")
    if args.write:
        write(args.write, list(rows.values()))
        print(f"wrote {args.write}: patch(table={args.write!r}) or {_table.ENV}={args.write}")
    if args.update and _update(found, release):
        return 1
    if args.check:
        problems = _problems(found, release)
        for p in problems:
            print(f"FAILED {p}", file=sys.stderr)
        return 1 if problems else 0
    return 0
