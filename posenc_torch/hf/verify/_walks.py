"""The 5.x ``vision_utils`` functions against posenc's functions of the same name, on grids
drawn from a fixed seed (int64 and int32, images and videos, one to four at once) under
every argument value the models use and more."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import torch

from ... import vision as _vision


def _grids(rng: random.Random, merge: int, count: int) -> list[torch.Tensor]:
    """Images and videos whose sides are multiples of ``merge``, one to four a batch."""
    out = [torch.tensor([[1, merge, merge]]), torch.tensor([[1, 2 * merge, 2 * merge]])]
    for i in range(count):
        rows = [[rng.choice((1, 1, 2, 3, 16)), merge * rng.randint(1, 14),
                 merge * rng.randint(1, 14)] for _ in range(rng.randint(1, 4))]
        out.append(torch.tensor(rows, dtype=torch.int32 if i % 3 == 0 else torch.int64))
    return out


class _Config:
    def __init__(self, implementation: str) -> None:
        self._attn_implementation = implementation


def cases(name: str) -> list[dict]:
    """Keyword arguments (all but the grids) under which the function is compared."""
    if name == "get_vision_position_ids":
        return [dict(spatial_merge_size=m) for m in (1, 2, 3, 4)]
    if name == "get_vision_cu_seqlens":
        return [dict(merge_temporal=t) for t in (False, True)]
    if name == "get_vision_attention_seqlens":
        return [dict(config=_Config(a), merge_temporal=t) for a in ("eager", "sdpa",
                "flash_attention_2") for t in (False, True)]
    if name == "get_vision_window_index":
        return [dict(spatial_merge_size=m, window_size=w, patch_size=p)
                for m, w, p in ((2, 112, 14), (1, 56, 14), (2, 64, 16), (4, 448, 14))]
    if name == "get_vision_interpolation_indices_and_weights":
        return [dict(num_grid_per_side=n, mode=mode, align_corners=a, spatial_merge_size=m,
                     padding=p) for n, mode, a, m, p in itertools.product(
                         (16, 48), ("bilinear", "bicubic"), (False, True), (1, 2),
                         ("border", "zeros"))]
    raise ValueError(f"no cases for {name}")


def same(a: object, b: object) -> bool:
    """Equal tensors of one dtype and shape, or equal values of one type, nested."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, tuple) or isinstance(b, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def check(name: str, func: Callable) -> str | None:
    """None when transformers' ``func`` (the ``vision_utils`` function ``name``) gives
    what posenc's function of that name gives on every sample, else the first that
    differs."""
    ours = getattr(_vision, name)
    rng = random.Random(32)
    for kwargs in cases(name):
        merge = kwargs.get("spatial_merge_size", 1)
        for grids in _grids(rng, merge, 12):
            try:
                theirs = func(grids, **kwargs)
            except Exception as e:  # noqa: BLE001 -- transformers refused a sample
                return f"it raises {type(e).__name__} for {grids.tolist()}"
            if not same(ours(grids, **kwargs), theirs):
                shown = {k: v for k, v in kwargs.items() if k != "config"}
                return f"it gives other results for {grids.tolist()} with {shown}"
    return None
