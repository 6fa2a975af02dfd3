"""The digests of the installed transformers' integer walks, for maintainers:

    python -m posenc_torch.hf.digests          # a line per walk: digest, known or not
    python -m posenc_torch.hf.digests --json   # the unknown ones as rows for verified.json

A digest the table lacks means the installed release changed that function (or its helpers):
posenc leaves it to transformers until a row is added and ``tests/test_hf_digests.py``
passes with it (the tests run the function against posenc's walk that the row names).
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Iterator

from .._tables import MODELS
from . import _digests, _transformers
from ._rope_index import MODEL_TYPES as _ROPE_INDEX_TYPES
from ._vision import _FUNCTIONS as _VISION_FUNCTIONS
from ._vision_methods import METHODS


def walks() -> Iterator[tuple[str, str, object, type | None]]:
    """(model type, function name, function, owner class or None) of every integer walk
    of the known model types that the installed transformers has."""
    for mt in MODELS:
        try:
            module = _transformers.modeling_module(mt)
        except _transformers.Unsupported:
            continue
        names = [n for n in (*(("get_rope_index",) if mt in _ROPE_INDEX_TYPES else ()),
                             *METHODS)]
        for name in names:
            try:
                owner = _transformers.owner_class(module, name)
            except _transformers.Unsupported:
                continue
            yield mt, name, vars(owner)[name], owner
        for name in _VISION_FUNCTIONS:
            func = vars(module).get(name)
            if func is not None:
                yield mt, name, func, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posenc_torch.hf.digests",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true",
                        help="print the unknown digests as rows for verified.json")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    release = _transformers.version()
    unknown = {}
    for mt, name, func, owner in walks():
        func = getattr(func, "posenc_original", func)
        try:
            value = _digests.digest(func, owner)
        except _digests.Unverified as e:
            print(f"{mt:14s} {name:46s} cannot be digested: {e}")
            continue
        entry = _digests.TABLE.get(value)
        if entry is None or entry.function != name:
            unknown.setdefault(value, {"digest": value, "function": name, "use": "?",
                                       "releases": [release]})
        state = f"verified: {entry.use}" if entry and entry.function == name else "UNKNOWN"
        if not args.json:
            print(f"{mt:14s} {name:46s} {value[:16]}  {state}")
    if args.json:
        print(json.dumps(list(unknown.values()), indent=1))
    else:
        print(f"transformers {release}: {len(unknown)} unknown digest(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
