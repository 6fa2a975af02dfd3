"""The verified table: which function digests posenc replaces, and with what.

The shipped table (``verified.json``: data, no transformers source text) is made and
re-checked by ``python -m posenc_torch.hf.verify`` under every transformers release
``make test`` installs.  A :class:`Row` holds a digest (``_digests``), the function it was
verified as, what posenc runs for it (``use``) and the releases it was verified under.  The
same file holds the release facts (:func:`releases`).  A user's table file (the verify
command's ``--write FILE``, named by ``patch(table=FILE)`` or ``POSENC_TORCH_HF_TABLE``) is
refused with one warning, never a crash or a wait, when it is not a regular file of the
user's own that others cannot write, is larger than a table can be, is not a table of this
format, or was written for another transformers release; its rows never override the
shipped ones, and its rotary rows are checked on sampled inputs before use (``_rotary``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
from pathlib import Path
from typing import NamedTuple

from . import _digests

FORMAT = "posenc_torch.hf verified table 1"
#: The environment variable naming a table file written by the verify command.
ENV = "POSENC_TORCH_HF_TABLE"
COMMAND = "python -m posenc_torch.hf.verify --write FILE"
_MAX_BYTES = 4 << 20
_DIGEST = re.compile(r"[0-9a-f]{64}")


class Row(NamedTuple):
    """One verified digest: the function it is, what posenc runs for it, the releases it
    was verified under, and where the row comes from (``None``: the shipped table)."""

    digest: str
    function: str
    use: str
    releases: tuple[str, ...]
    source: str | None = None


class TableError(ValueError):
    """A table file that is not one posenc reads; says why."""


def _rows(data: object, source: str | None) -> dict[tuple[str, str], Row]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TableError(f"not a table of the format {FORMAT!r}")
    rows = data.get("rows")
    if not isinstance(rows, list):
        raise TableError("it has no list of rows")
    out = {}
    for i, row in enumerate(rows):
        if not (isinstance(row, dict) and isinstance(row.get("digest"), str)
                and _DIGEST.fullmatch(row["digest"]) and isinstance(row.get("function"), str)
                and isinstance(row.get("use"), str) and isinstance(row.get("releases"), list)
                and all(isinstance(r, str) for r in row["releases"])):
            raise TableError(f"row {i} is not a row of digest, function, use and releases")
        out[(row["digest"], row["function"])] = Row(
            row["digest"], row["function"], row["use"], tuple(row["releases"]), source)
    return out


@functools.cache
def _shipped() -> tuple[dict, dict[tuple[str, str], Row]]:
    data = json.loads((Path(__file__).parent / "verified.json").read_text())
    return data, _rows(data, None)


def releases() -> dict:
    """The release facts: ``{"test_passes": {make target: transformers release},
    "patched": {release: [model types patch() patches]}, "fused": {release: [model types
    whose q/k norm + rotary patch() fuses]}}``."""
    data = _shipped()[0]
    return {key: data[key] for key in ("test_passes", "patched", "fused")}


def shipped() -> dict[tuple[str, str], Row]:
    """The shipped rows by (digest, function)."""
    return _shipped()[1]


def read_file(path: str | os.PathLike, transformers_version: str) -> dict[tuple[str, str], Row]:
    """The rows of a table file the verify command wrote; TableError naming why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise TableError(f"it cannot be opened ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TableError("it is not a regular file")
        if hasattr(os, "getuid") and (info.st_uid != os.getuid()
                                      or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            raise TableError("it is not the user's own, or others can write it")
        if info.st_size > _MAX_BYTES:
            raise TableError(f"it is larger than {_MAX_BYTES} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            text = f.read(_MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise TableError(f"it is not JSON ({e})") from None
    rows = _rows(data, str(path))
    if data.get("transformers") != transformers_version:
        raise TableError(f"it was written for transformers {data.get('transformers')!r}, "
                         f"not the installed {transformers_version}")
    return rows


_USER: dict[str, tuple[tuple, dict[tuple[str, str], Row]]] = {}


def user_rows(path: str | os.PathLike | None, transformers_version: str
              ) -> dict[tuple[str, str], Row]:
    """The rows of the table file ``path`` (else ``$POSENC_TORCH_HF_TABLE``; none when
    neither names one): read once per file state; a file that cannot be used gives one
    ``UnsupportedModelWarning`` and no rows."""
    from ._handle import warn_once

    path = path if path is not None else os.environ.get(ENV) or None
    if path is None:
        return {}
    try:
        info = os.stat(path)
        state = (info.st_ino, info.st_mtime_ns, info.st_size, transformers_version)
    except OSError:
        state = None
    known = _USER.get(str(path))
    if known is not None and state is not None and known[0] == state:
        return known[1]
    try:
        rows = read_file(path, transformers_version)
    except TableError as e:
        warn_once(f"posenc_torch.hf: the table file {str(path)!r} is not used: {e}; write "
                  f"one with `{COMMAND}`", stacklevel=4)
        return {}
    if state is not None:
        _USER[str(path)] = (state, rows)
    return rows


def verified(func: object, owner: type | None, function: str,
             extra: dict[tuple[str, str], Row] | None = None) -> tuple[Row, _digests.Watch]:
    """The row of ``func`` (which must be the function named ``function``) and its watch;
    ``_digests.Unverified`` naming the digest and the command otherwise."""
    hint = f"run `{COMMAND}` and pass patch(table=FILE) or set {ENV}"
    try:
        value, watch = _digests.identity(func, owner)
    except _digests.Unverified as e:
        raise _digests.Unverified(f"{e}; no verified table can hold it ({hint})") from None
    row = shipped().get((value, function)) or (extra or {}).get((value, function))
    if row is None:
        name = getattr(func, "__qualname__", repr(func))
        raise _digests.Unverified(
            f"{name} has the digest {value[:16]}, which no verified table holds ({hint})")
    return row, watch

