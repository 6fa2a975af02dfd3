"""transformers 4.57's vision-tower methods routed by ``patch()`` to posenc's C walks.

transformers 4.57 computes in methods of the vision model classes, with one Python loop
iteration per image or video, what 5.x computes in ``vision_utils`` (``_vision_utils``):
``rot_pos_emb`` (the Qwen-VL and GLM-4V towers: the patches' (row, col) ids, then a
gather of the rotary table), ``get_window_index`` (Qwen2.5-VL: the window order and the
window boundaries, the empty padding windows repeating the boundary before them) and
``fast_pos_embed_interpolate`` (Qwen3-VL: bilinear taps and weights into the learned
position table, their weighted sum, reordered into merge blocks and repeated per frame).

Each replacement computes the grid-dependent part with the walk (convention "4.57") and
the rest with the method's own expressions in the same order, so every result is the
method's bit for bit, dtypes and devices included, and so are the gradients that reach
the position table (the reordering is one gather, except where the gradient reaches the
table through a grid of three frames or more: there the method's own per-grid repeat is
kept, which sums the frames' gradients in its order).  A class gets the replacement its
method's verified row names (``_digests``, ``_table``); a method without one stays
transformers' with one ``UnsupportedModelWarning``.  Calls go to the original method
(``handle.fallbacks``) while compiling, in another call form, with grids that are not a
non-empty 2-D integer tensor or that the walk refuses, or tower values (merge size,
window, patch size, table side) that are not ints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import vision as _vision
from . import _digests, _table, _transformers
from ._handle import CallArguments, Decline, original_of, warn_once

# ---------------------------------------------------------------------------------------
# The replacements (``self`` is the vision tower).


def _host(grid_thw: torch.Tensor) -> torch.Tensor:
    return grid_thw if grid_thw.device.type == "cpu" else grid_thw.cpu()


def _rot_pos_emb_with_ids(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # the method's ids come from torch.arange: int64 on the CPU whatever the grids' device
    pos_ids = _vision.get_vision_position_ids(_host(grid_thw), self.spatial_merge_size)
    max_grid_size = grid_thw[:, 1:].max()
    rotary_pos_emb_full = self.rotary_pos_emb(max_grid_size)
    return rotary_pos_emb_full[pos_ids].flatten(1), pos_ids


def _rot_pos_emb(self, grid_thw: torch.Tensor) -> torch.Tensor:
    return _rot_pos_emb_with_ids(self, grid_thw)[0]


def _rot_pos_emb_blocks(self, grid_thw: torch.Tensor) -> torch.Tensor:
    pos_ids = _vision.get_vision_position_ids(_host(grid_thw), self.spatial_merge_size)
    max_hw = int(grid_thw[:, 1:].max().item())
    freq_table = self.rotary_pos_emb(max_hw)
    return freq_table[pos_ids.to(freq_table.device)].flatten(1)


def _boundaries_with_empty_windows(grids: list[list[int]], cu: list[int], merge: int,
                                   side: int) -> list[int]:
    """4.57's boundary list from the walk's (one per non-empty window): every frame's
    windows row-major, with one more window column when the LLM grid's width is a multiple
    of ``side`` and one more window row when its height is, each of those empty and
    repeating the boundary before it."""
    out, k = [cu[0]], 1
    for t, h, w in grids:
        rows, cols = -(-(h // merge) // side), -(-(w // merge) // side)
        extra_col, extra_row = (w // merge) % side == 0, (h // merge) % side == 0
        for _ in range(t):
            for _ in range(rows):
                out += cu[k:k + cols]
                k += cols
                if extra_col:
                    out.append(out[-1])
            if extra_row:
                out += [out[-1]] * (cols + extra_col)
    return out


def _get_window_index(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    merge, window, patch = self.spatial_merge_size, self.window_size, self.patch_size
    host = _host(grid_thw)
    index, cu = _vision.get_vision_window_index(host, merge, window, patch)
    if self.spatial_merge_unit != merge * merge:
        raise Decline  # a tower whose merge unit is not the square of its merge size
    return index, _boundaries_with_empty_windows(host.tolist(), cu.tolist(), merge,
                                                 window // merge // patch)


def _fast_pos_embed_interpolate(self, grid_thw: torch.Tensor) -> torch.Tensor:
    host = _host(grid_thw)
    merge = self.config.spatial_merge_size
    order = _vision.get_vision_position_ids(host, merge)  # checks the grids first
    frame = host.clone()
    frame[:, 0] = 1  # the method weighs one frame of each grid, in raster order
    taps, weights = _vision.get_vision_interpolation_indices_and_weights(
        frame, self.num_grid_per_side, "bilinear", True, 1, convention="4.57")
    table = self.pos_embed.weight
    idx_tensor = taps.T.to(table.device)
    weight_tensor = weights.T.to(device=table.device, dtype=table.dtype)
    pos_embeds = self.pos_embed(idx_tensor) * weight_tensor[:, :, None]
    patch_pos_embeds = pos_embeds[0] + pos_embeds[1] + pos_embeds[2] + pos_embeds[3]

    ts, hs, ws = host[:, 0], host[:, 1], host[:, 2]
    if patch_pos_embeds.requires_grad and bool((ts > 2).any()):
        # the gradient of a repeated frame is summed by repeat's backward: keep its order
        parts = patch_pos_embeds.split((hs * ws).tolist())
        out = []
        for pos_embed, t, h, w in zip(parts, ts.tolist(), hs.tolist(), ws.tolist(),
                                      strict=True):
            out.append(pos_embed.repeat(t, 1)
                       .view(t, h // merge, merge, w // merge, merge, -1)
                       .permute(0, 1, 3, 2, 4, 5).flatten(0, 4))
        return torch.cat(out)
    sizes = ts * hs * ws
    starts = torch.repeat_interleave(torch.cumsum(hs * ws, 0) - hs * ws, sizes)
    rows = starts + order[:, 0] * torch.repeat_interleave(ws, sizes) + order[:, 1]
    return patch_pos_embeds[rows.to(table.device)]


# ---------------------------------------------------------------------------------------
# The routes.


class Replacement(NamedTuple):
    """A replacement, and the values it reads from the tower (attribute chains; a route
    hands the call to the method unless each is an int)."""

    compute: Callable
    reads: tuple[str, ...]


#: The table's names (``verified.json``, "use") -> the replacement.
REPLACEMENTS: dict[str, Replacement] = {
    "rot_pos_emb": Replacement(_rot_pos_emb, ("spatial_merge_size",)),
    "rot_pos_emb, with ids": Replacement(_rot_pos_emb_with_ids, ("spatial_merge_size",)),
    "rot_pos_emb, blocks": Replacement(_rot_pos_emb_blocks, ("spatial_merge_size",)),
    "get_window_index": Replacement(_get_window_index, (
        "spatial_merge_size", "window_size", "patch_size", "spatial_merge_unit")),
    "fast_pos_embed_interpolate": Replacement(_fast_pos_embed_interpolate, (
        "config.spatial_merge_size", "num_grid_per_side")),
}
METHODS = ("rot_pos_emb", "get_window_index", "fast_pos_embed_interpolate")


def _ints(tower: object, chains: tuple[str, ...]) -> bool:
    for chain in chains:
        value = tower
        for name in chain.split("."):
            value = getattr(value, name, None)
        if type(value) is not int:
            return False
    return True


def _computation(replacement: Replacement, original: Callable) -> Callable:
    binding = CallArguments(original)

    def compute(*args, **kw):
        arguments = binding.bind(args, kw)
        if arguments is None:
            raise Decline
        tower, grid = arguments.get("self"), arguments.get("grid_thw")
        if (torch.compiler.is_compiling() or not isinstance(grid, torch.Tensor)
                or grid.dim() != 2 or grid.shape[0] == 0 or grid.is_floating_point()
                or grid.is_complex() or grid.dtype == torch.bool
                or not _ints(tower, replacement.reads)):
            raise Decline
        return replacement.compute(tower, grid)

    return compute


def install(handle, model_types: tuple[str, ...]) -> None:
    """Route the 4.57 vision-tower methods of the classes of ``model_types`` whose code is
    verified (a 5.x module defines none of them)."""
    for mt in model_types:
        try:
            module = _transformers.modeling_module(mt)
        except _transformers.Unsupported:
            continue
        for name in METHODS:
            if not any(isinstance(c, type) and c.__module__ == module.__name__
                       and name in vars(c) for c in vars(module).values()):
                continue
            try:
                cls = _transformers.owner_class(module, name)
                original = original_of(vars(cls)[name])
                entry, watch = _table.verified(original, cls, name, handle.rows)
                replacement = REPLACEMENTS[entry.use]
            except (_transformers.Unsupported, _digests.Unverified, KeyError) as e:
                warn_once(f"posenc_torch.hf.patch leaves {mt}.{name} to transformers: {e}",
                          stacklevel=4)
                continue
            handle.replace(cls, name, _computation(replacement, original),
                           f"{mt}.{name}", f"posenc_torch route of transformers' "
                           f"{cls.__qualname__}.{name}; see posenc_torch.hf.", watch)
