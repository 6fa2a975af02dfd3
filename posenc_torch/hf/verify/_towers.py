"""Tiny random vision towers of a transformers 4.57 class, and the check that a
replacement of one of its methods gives what the method gives on them (results and the
gradients that reach the tower's parameters) on probe grids: images and videos, grids
that do and do not divide the window, a 1 x 2 x 2 grid, several grids at once, int64 and
int32, with and without autograd, with the tower's own merge size, window, patch size and
table side and with merge sizes 1, 2 and 4 (the verify command verifies the table's
method rows with it).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

_TINY = dict(depth=1, num_heads=2, hidden_size=16, embed_dim=16, out_hidden_size=16,
             intermediate_size=16, mlp_ratio=1, in_channels=1, temporal_patch_size=1,
             deepstack_visual_indexes=[], fullatt_block_indexes=[0])
_MERGE_SIZES = (1, 2, 4)


def _read(module: object, chain: str) -> object:
    for name in chain.split("."):
        module = getattr(module, name)
    return module


def _values(reads: tuple[str, ...], tower: object) -> tuple[tuple[str, object], ...] | None:
    """What ``tower`` holds for the form's reads; None where one is not an int (a dtype
    for the table's)."""
    out = []
    for chain in reads:
        try:
            value = _read(tower, chain)
        except AttributeError:
            return None
        if not (type(value) is int or (chain.endswith("dtype")
                                       and isinstance(value, torch.dtype))):
            return None
        out.append((chain, value))
    return tuple(out)


def _tower(cls: type, values: dict[str, object]) -> torch.nn.Module:
    """A tiny random tower of ``cls`` (eval mode) holding ``values``."""
    config_class = cls.config_class
    defaults = config_class().to_dict()
    sizes = {k: v for k, v in _TINY.items() if k in defaults}
    side = values.get("num_grid_per_side")
    if side is not None and "num_position_embeddings" in defaults:
        sizes["num_position_embeddings"] = side * side
    config = config_class(**sizes)
    config._attn_implementation = "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tower = cls._from_config(config).eval()
    for chain, value in values.items():
        if chain == "pos_embed.weight.dtype":
            tower.to(value)
            continue
        owner, _, name = chain.rpartition(".")
        setattr(_read(tower, owner) if owner else tower, name, value)
    return tower


def _probe_grids(merge: int) -> list[torch.Tensor]:
    m = merge
    grids = [torch.tensor([[1, 2, 2]])] if 2 % m == 0 else []
    grids += [
        torch.tensor([[1, 2 * m, 2 * m]]),
        torch.tensor([[1, m, m]]),
        torch.tensor([[1, 8 * m, 12 * m], [3, 4 * m, 6 * m], [1, 2 * m, 2 * m]]),
        torch.tensor([[16, 2 * m, 4 * m], [1, 10 * m, 6 * m]], dtype=torch.int32),
        torch.tensor([[2, 14 * m, 18 * m], [1, 6 * m, 2 * m]]),
        torch.tensor([[4, 4 * m, 4 * m]], dtype=torch.int32),
    ]
    return grids


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and (a.dtype, a.shape, a.device, a.requires_grad)
                == (b.dtype, b.shape, b.device, b.requires_grad) and torch.equal(a, b))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b, strict=True)))
    return type(a) is type(b) and a == b


def _outcome(fn: Callable, tower: torch.nn.Module, grids: torch.Tensor, grad: bool):
    """(result, gradients of the tower's parameters) or the exception raised."""
    tower.zero_grad(set_to_none=True)
    try:
        with torch.set_grad_enabled(grad):
            out = fn(tower, grids)
            if not grad:
                return out, None
            first = out[0] if isinstance(out, tuple) else out
            if not first.requires_grad:
                return out, None
            gen = torch.Generator().manual_seed(0)
            first.backward(torch.randn(first.shape, generator=gen, dtype=first.dtype))
            return out, [p.grad for p in tower.parameters()]
    except Exception as e:  # noqa: BLE001 -- compared by kind
        return e


def _check(cls: type, name: str, replacement: Callable, original: Callable,
           values: tuple[tuple[str, object], ...]) -> str | None:
    """None when the replacement gives what ``original`` gives (results and gradients) on
    every probe grid on a tiny tower of ``cls`` holding ``values``, else the difference."""
    try:
        tower = _tower(cls, dict(values))
    except Exception as e:  # noqa: BLE001 -- reported
        return (f"a tiny {cls.__name__} to probe {name} could not be built "
                f"({type(e).__name__}: {e})")
    merge = next(v for k, v in values if k.endswith("spatial_merge_size"))
    for grids in _probe_grids(merge):
        for grad in (False, True):
            theirs = _outcome(original, tower, grids, grad)
            ours = _outcome(replacement, tower, grids, grad)
            if isinstance(theirs, Exception) and isinstance(ours, Exception):
                continue  # both refuse: the route hands such calls to the method
            what = f"{cls.__name__}.{name} with {dict(values)} on the grids {grids.tolist()}"
            if isinstance(theirs, Exception) or isinstance(ours, Exception):
                failed = theirs if isinstance(theirs, Exception) else ours
                side = "the method" if failed is theirs else "the replacement"
                return f"{what}: {side} raised {type(failed).__name__}: {failed}"
            if not _same(ours, theirs):
                return f"{what}{' (gradients)' if grad else ''}: another result than the walk's"
    return None



def check_method(cls: type, name: str, replacement, original: Callable) -> str | None:
    """None when ``replacement`` (a ``_tower_methods_457.Replacement``) gives what
    ``original`` gives on tiny towers of ``cls``: with the values of a tower built from
    the class's default config, and with each of the merge sizes 1, 2 and 4; else the
    first difference."""
    tower = _tower(cls, {})
    reads = (*replacement.reads, "pos_embed.weight.dtype") if name == \
        "fast_pos_embed_interpolate" else replacement.reads
    values = _values(reads, tower)
    if values is None:
        return f"the tower does not hold {', '.join(reads)} as ints"
    chain = next(k for k, _ in values if k.endswith("spatial_merge_size"))
    for merge in dict.fromkeys((dict(values)[chain], *_MERGE_SIZES)):
        variant = tuple((k, merge if k == chain else v) for k, v in values)
        if chain == "spatial_merge_size" and "spatial_merge_unit" in dict(values):
            variant = tuple((k, merge * merge if k == "spatial_merge_unit" else v)
                            for k, v in variant)
        reason = _check(cls, name, replacement.compute, original, variant)
        if reason is not None:
            return reason
    return None
