"""transformers 4.57's vision-tower methods routed by ``patch()`` to posenc's C walks.

transformers 4.57 computes in methods of the vision model classes what 5.x computes in
``vision_utils`` (routed by ``_vision``), each with one Python loop iteration per image
or video:

* ``rot_pos_emb(grid_thw)`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, GLM-4V,
  GLM-4V-MoE): the patches' (row, col) ids, then a gather of the rotary table;
* ``get_window_index(grid_thw)`` (Qwen2.5-VL): the window order and the list of window
  boundaries (one per window, the empty padding windows repeating the boundary before
  them; ``forward`` drops the repeats with ``torch.unique_consecutive``);
* ``fast_pos_embed_interpolate(grid_thw)`` (Qwen3-VL, Qwen3-VL-MoE): bilinear taps and
  weights into the learned position table, their weighted sum, reordered into merge
  blocks and repeated per frame.

The replacement of each computes the grid-dependent part with the walk
(``posenc_torch.vision``, convention "4.57") and the rest with the method's own
expressions in the same order: the same rotary-table gather, the same embedding lookups,
products and sum, so every result is the method's bit for bit, dtypes and devices
included, and so are the gradients that reach the position table (the reordering is one
gather, except where the gradient reaches the table through a grid of three frames or
more: there the method's own per-grid repeat is kept, which sums the frames' gradients in
its order).

Which class gets which replacement is decided by behaviour, with the rules of the rest of
the patch: the method's source must be one of the forms below (compared as syntax trees,
reading only ``torch`` and ``torch.nn.functional``: every one of these methods loops over
the grids), and the replacement must give what the method gives on probe grids (images
and videos, grids that do and do not divide the window, a 1 x 2 x 2 grid, several grids
at once, int64 and int32, with and without autograd) run on a tiny random tower of the
class (its own submodules) built from its config class, with the merge size, window,
patch size and table side of the config and merge sizes 1, 2 and 4.  A method that fails
either stays transformers' with one ``UnsupportedModelWarning``.  At a call, the values
the method reads from the tower (merge size, window and patch size, table side and dtype)
are checked once per set of values the same way (a tower of the class with those values;
the verdict is kept while the method and what it reads stay the same, ``_verdicts``).

Calls go to the original method (``handle.fallbacks``) while compiling, under functorch
transforms, in another call form, with grids that are not a non-empty 2-D integer tensor,
grids the walk refuses (the method raises on most of those, or reads memory it never
wrote), values read from the tower that are not ints, or values whose check failed.
"""

from __future__ import annotations

import builtins
import inspect
import types
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import vision as _vision
from . import _transformers, _verdicts
from ._forms import global_loads, tree
from ._handle import UnsupportedModelWarning, bump, to_original

# ---------------------------------------------------------------------------------------
# The replacements (``self`` is the vision tower).


def _host(grid_thw: torch.Tensor) -> torch.Tensor:
    return grid_thw if grid_thw.device.type == "cpu" else grid_thw.cpu()


def _rot_pos_emb(self, grid_thw: torch.Tensor) -> torch.Tensor:
    # the method's ids come from torch.arange: int64 on the CPU whatever the grids' device
    pos_ids = _vision.get_vision_position_ids(_host(grid_thw), self.spatial_merge_size)
    max_grid_size = grid_thw[:, 1:].max()
    rotary_pos_emb_full = self.rotary_pos_emb(max_grid_size)
    return rotary_pos_emb_full[pos_ids].flatten(1)


def _rot_pos_emb_with_ids(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pos_ids = _vision.get_vision_position_ids(_host(grid_thw), self.spatial_merge_size)
    max_grid_size = grid_thw[:, 1:].max()
    rotary_pos_emb_full = self.rotary_pos_emb(max_grid_size)
    return rotary_pos_emb_full[pos_ids].flatten(1), pos_ids


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
        raise ValueError("spatial_merge_unit is not spatial_merge_size ** 2")
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
# The forms (transformers 4.57.6's sources: compared, never run).

_ROT_POS_EMB_LOOP = """
def rot_pos_emb(self, grid_thw):
    pos_ids = []
    for t, h, w in grid_thw:
        hpos_ids = torch.arange(h).unsqueeze(1).expand(-1, w)
        hpos_ids = hpos_ids.reshape(
            h // self.spatial_merge_size,
            self.spatial_merge_size,
            w // self.spatial_merge_size,
            self.spatial_merge_size,
        )
        hpos_ids = hpos_ids.permute(0, 2, 1, 3)
        hpos_ids = hpos_ids.flatten()

        wpos_ids = torch.arange(w).unsqueeze(0).expand(h, -1)
        wpos_ids = wpos_ids.reshape(
            h // self.spatial_merge_size,
            self.spatial_merge_size,
            w // self.spatial_merge_size,
            self.spatial_merge_size,
        )
        wpos_ids = wpos_ids.permute(0, 2, 1, 3)
        wpos_ids = wpos_ids.flatten()
        pos_ids.append(torch.stack([hpos_ids, wpos_ids], dim=-1).repeat(t, 1))
    pos_ids = torch.cat(pos_ids, dim=0)
    max_grid_size = grid_thw[:, 1:].max()
    rotary_pos_emb_full = self.rotary_pos_emb(max_grid_size)
    rotary_pos_emb = rotary_pos_emb_full[pos_ids].flatten(1)
    return RESULT
"""

_ROT_POS_EMB_BLOCKS = """
def rot_pos_emb(self, grid_thw):
    merge_size = self.spatial_merge_size

    max_hw = int(grid_thw[:, 1:].max().item())
    freq_table = self.rotary_pos_emb(max_hw)
    device = freq_table.device

    total_tokens = int(torch.prod(grid_thw, dim=1).sum().item())
    pos_ids = torch.empty((total_tokens, 2), dtype=torch.long, device=device)

    offset = 0
    for num_frames, height, width in grid_thw:
        merged_h, merged_w = height // merge_size, width // merge_size

        block_rows = torch.arange(merged_h, device=device)
        block_cols = torch.arange(merged_w, device=device)
        intra_row = torch.arange(merge_size, device=device)
        intra_col = torch.arange(merge_size, device=device)

        row_idx = block_rows[:, None, None, None] * merge_size + intra_row[None, None, :, None]
        col_idx = block_cols[None, :, None, None] * merge_size + intra_col[None, None, None, :]

        row_idx = row_idx.expand(merged_h, merged_w, merge_size, merge_size).reshape(-1)
        col_idx = col_idx.expand(merged_h, merged_w, merge_size, merge_size).reshape(-1)

        coords = torch.stack((row_idx, col_idx), dim=-1)

        if num_frames > 1:
            coords = coords.repeat(num_frames, 1)

        num_tokens = coords.shape[0]
        pos_ids[offset : offset + num_tokens] = coords
        offset += num_tokens

    embeddings = freq_table[pos_ids]
    embeddings = embeddings.flatten(1)
    return embeddings
"""

_GET_WINDOW_INDEX = """
def get_window_index(self, grid_thw):
    window_index: list = []
    cu_window_seqlens: list = [0]
    window_index_id = 0
    vit_merger_window_size = self.window_size // self.spatial_merge_size // self.patch_size

    for grid_t, grid_h, grid_w in grid_thw:
        llm_grid_h, llm_grid_w = (
            grid_h // self.spatial_merge_size,
            grid_w // self.spatial_merge_size,
        )
        index = torch.arange(grid_t * llm_grid_h * llm_grid_w).reshape(
            grid_t, llm_grid_h, llm_grid_w)
        pad_h = vit_merger_window_size - llm_grid_h % vit_merger_window_size
        pad_w = vit_merger_window_size - llm_grid_w % vit_merger_window_size
        num_windows_h = (llm_grid_h + pad_h) // vit_merger_window_size
        num_windows_w = (llm_grid_w + pad_w) // vit_merger_window_size
        index_padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        index_padded = index_padded.reshape(
            grid_t,
            num_windows_h,
            vit_merger_window_size,
            num_windows_w,
            vit_merger_window_size,
        )
        index_padded = index_padded.permute(0, 1, 3, 2, 4).reshape(
            grid_t,
            num_windows_h * num_windows_w,
            vit_merger_window_size,
            vit_merger_window_size,
        )
        seqlens = (index_padded != -100).sum([2, 3]).reshape(-1)
        index_padded = index_padded.reshape(-1)
        index_new = index_padded[index_padded != -100]
        window_index.append(index_new + window_index_id)
        cu_seqlens_tmp = seqlens.cumsum(0) * self.spatial_merge_unit + cu_window_seqlens[-1]
        cu_window_seqlens.extend(cu_seqlens_tmp.tolist())
        window_index_id += (grid_t * llm_grid_h * llm_grid_w).item()
    window_index = torch.cat(window_index, dim=0)

    return window_index, cu_window_seqlens
"""

_FAST_POS_EMBED_INTERPOLATE = """
def fast_pos_embed_interpolate(self, grid_thw):
    grid_ts, grid_hs, grid_ws = grid_thw[:, 0], grid_thw[:, 1], grid_thw[:, 2]

    idx_list = [[] for _ in range(4)]
    weight_list = [[] for _ in range(4)]

    for t, h, w in zip(grid_ts, grid_hs, grid_ws):
        h_idxs = torch.linspace(0, self.num_grid_per_side - 1, h)
        w_idxs = torch.linspace(0, self.num_grid_per_side - 1, w)

        h_idxs_floor = h_idxs.int()
        w_idxs_floor = w_idxs.int()
        h_idxs_ceil = (h_idxs.int() + 1).clip(max=self.num_grid_per_side - 1)
        w_idxs_ceil = (w_idxs.int() + 1).clip(max=self.num_grid_per_side - 1)

        dh = h_idxs - h_idxs_floor
        dw = w_idxs - w_idxs_floor

        base_h = h_idxs_floor * self.num_grid_per_side
        base_h_ceil = h_idxs_ceil * self.num_grid_per_side

        indices = [
            (base_h[None].T + w_idxs_floor[None]).flatten(),
            (base_h[None].T + w_idxs_ceil[None]).flatten(),
            (base_h_ceil[None].T + w_idxs_floor[None]).flatten(),
            (base_h_ceil[None].T + w_idxs_ceil[None]).flatten(),
        ]

        weights = [
            ((1 - dh)[None].T * (1 - dw)[None]).flatten(),
            ((1 - dh)[None].T * dw[None]).flatten(),
            (dh[None].T * (1 - dw)[None]).flatten(),
            (dh[None].T * dw[None]).flatten(),
        ]

        for i in range(4):
            idx_list[i].extend(indices[i].tolist())
            weight_list[i].extend(weights[i].tolist())

    idx_tensor = torch.tensor(idx_list, dtype=torch.long, device=self.pos_embed.weight.device)
    weight_tensor = torch.tensor(
        weight_list, dtype=self.pos_embed.weight.dtype, device=self.pos_embed.weight.device
    )
    pos_embeds = self.pos_embed(idx_tensor) * weight_tensor[:, :, None]
    patch_pos_embeds = pos_embeds[0] + pos_embeds[1] + pos_embeds[2] + pos_embeds[3]

    patch_pos_embeds = patch_pos_embeds.split([h * w for h, w in zip(grid_hs, grid_ws)])

    patch_pos_embeds_permute = []
    merge_size = self.config.spatial_merge_size
    for pos_embed, t, h, w in zip(patch_pos_embeds, grid_ts, grid_hs, grid_ws):
        pos_embed = pos_embed.repeat(t, 1)
        pos_embed = (
            pos_embed.view(t, h // merge_size, merge_size, w // merge_size, merge_size, -1)
            .permute(0, 1, 3, 2, 4, 5)
            .flatten(0, 4)
        )
        patch_pos_embeds_permute.append(pos_embed)
    patch_pos_embeds = torch.cat(patch_pos_embeds_permute)
    return patch_pos_embeds
"""


class Form(NamedTuple):
    """One known source form of a 4.57 method: its source, the replacement, and the values
    the method reads from the tower that the grid-dependent part depends on (attribute
    chains; "pos_embed.weight.dtype" is the table's dtype)."""

    source: str
    replacement: Callable
    reads: tuple[str, ...]


#: method name -> its known forms
FORMS: dict[str, tuple[Form, ...]] = {
    "rot_pos_emb": (
        Form(_ROT_POS_EMB_LOOP.replace("RESULT", "rotary_pos_emb"), _rot_pos_emb,
             ("spatial_merge_size",)),
        Form(_ROT_POS_EMB_LOOP.replace("RESULT", "rotary_pos_emb, pos_ids"),
             _rot_pos_emb_with_ids, ("spatial_merge_size",)),
        Form(_ROT_POS_EMB_BLOCKS, _rot_pos_emb_blocks, ("spatial_merge_size",)),
    ),
    "get_window_index": (
        Form(_GET_WINDOW_INDEX, _get_window_index,
             ("spatial_merge_size", "window_size", "patch_size", "spatial_merge_unit")),
    ),
    "fast_pos_embed_interpolate": (
        Form(_FAST_POS_EMBED_INTERPOLATE, _fast_pos_embed_interpolate,
             ("config.spatial_merge_size", "num_grid_per_side", "pos_embed.weight.dtype")),
    ),
}
_GLOBALS = {"torch": torch, "F": F}  # what the forms' globals must be bound to


def form_of(name: str, method: object) -> Form | None:
    """The known form of the 4.57 method ``name``, or None (another source, or globals
    bound to something else than ``torch`` / ``torch.nn.functional``)."""
    if not isinstance(method, types.FunctionType):
        return None
    try:
        theirs = tree(inspect.getsource(method))
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    namespace = method.__globals__
    for read in global_loads(method.__code__):
        if read in _GLOBALS:
            if namespace.get(read) is not _GLOBALS[read]:
                return None
        elif read in namespace or not hasattr(builtins, read):  # a builtin, not shadowed
            return None
    return next((form for form in FORMS[name] if tree(form.source) == theirs), None)


# ---------------------------------------------------------------------------------------
# The behaviour check, on tiny towers of the class.

#: Sizes of the tiny tower, applied to whichever of these its config has.
_TINY = dict(depth=1, num_heads=2, hidden_size=16, embed_dim=16, out_hidden_size=16,
             intermediate_size=16, mlp_ratio=1, in_channels=1, temporal_patch_size=1,
             deepstack_visual_indexes=[], fullatt_block_indexes=[0])
_MERGE_SIZES = (1, 2, 4)


def _read(module: object, chain: str) -> object:
    for name in chain.split("."):
        module = getattr(module, name)
    return module


def _values(form: Form, tower: object) -> tuple[tuple[str, object], ...] | None:
    """What ``tower`` holds for the form's reads; None where one is not an int (a dtype
    for the table's)."""
    out = []
    for chain in form.reads:
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


def _check(cls: type, name: str, form: Form, original: Callable,
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
            ours = _outcome(form.replacement, tower, grids, grad)
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


def _key(cls: type, name: str, original: Callable, values: tuple) -> tuple:
    return (cls.__module__, cls.__qualname__, name, _verdicts.behaviour_key(original),
            _verdicts.behaviour_key(cls.config_class), values)


def _decided(cls: type, name: str, form: Form, original: Callable, values: tuple) -> str | None:
    return _verdicts.decided("vision-method", _key(cls, name, original, values),
                             lambda: _check(cls, name, form, original, values),
                             account="vision")


def _install_check(cls: type, name: str, form: Form, original: Callable) -> str | None:
    """The check with the values of a tower built from the class's default config, and
    with each of the merge sizes 1, 2 and 4."""
    try:
        with _verdicts.plain_mode():
            tower = _tower(cls, {})
    except Exception as e:  # noqa: BLE001 -- reported
        return f"a tiny {cls.__name__} could not be built ({type(e).__name__}: {e})"
    values = _values(form, tower)
    if values is None:
        return f"the tower does not hold {', '.join(form.reads)} as ints"
    chain = next(k for k, _ in values if k.endswith("spatial_merge_size"))
    for merge in dict.fromkeys((dict(values)[chain], *_MERGE_SIZES)):
        variant = tuple((k, merge if k == chain else v) for k, v in values)
        if chain == "spatial_merge_size" and "spatial_merge_unit" in dict(values):
            variant = tuple((k, merge * merge if k == "spatial_merge_unit" else v)
                            for k, v in variant)
        reason = _decided(cls, name, form, original, variant)
        if reason is not None:
            return reason
    return None


# ---------------------------------------------------------------------------------------
# The routes.

_WARNED: set[str] = set()


def _make_route(cls: type, name: str, form: Form, original: Callable, handle,
                target: str) -> Callable:
    signature = inspect.signature(original)
    calls, fallbacks = handle._calls.get(target), handle._fallbacks.get(target)
    count = handle.count

    def routed(*args, **kw):
        try:
            arguments = signature.bind(*args, **kw).arguments
        except TypeError:
            arguments = None
        if arguments is not None and not (torch.compiler.is_compiling() or to_original()):
            self, grid = arguments.get("self"), arguments.get("grid_thw")
            values = _values(form, self)
            if (isinstance(grid, torch.Tensor) and grid.dim() == 2 and grid.shape[0] > 0
                    and not grid.is_floating_point() and grid.dtype != torch.bool
                    and not grid.is_complex() and values is not None):
                try:
                    reason = _decided(cls, name, form, original, values)
                except TypeError:  # a value that cannot be a key
                    reason = "values that cannot be compared"
                if reason is None:
                    try:
                        result = form.replacement(self, grid)
                    except (TypeError, ValueError):
                        result = None
                    if result is not None:
                        if count:
                            bump(calls)
                        return result
                elif reason not in _WARNED:
                    _WARNED.add(reason)
                    warnings.warn(f"posenc_torch.hf.patch hands {target} to transformers "
                                  f"for this tower: {reason}", UnsupportedModelWarning,
                                  stacklevel=2)
        if count:
            bump(fallbacks)
        return original(*args, **kw)

    routed.__signature__ = signature
    routed.__doc__ = (f"posenc_torch route of transformers' {cls.__qualname__}.{name}; see "
                      "posenc_torch.hf.")
    return routed


def install(handle, model_types: tuple[str, ...]) -> None:
    """Route the 4.57 vision-tower methods of the classes of ``model_types`` whose form
    and behaviour match (a 5.x module defines none of them)."""
    for mt in model_types:
        try:
            module = _transformers.modeling_module(mt)
        except _transformers.Unsupported:
            continue
        for name in FORMS:
            owners = [c for c in vars(module).values() if isinstance(c, type)
                      and c.__module__ == module.__name__ and name in vars(c)]
            if not owners:
                continue
            try:
                cls = _transformers.owner_class(module, name)
            except _transformers.Unsupported as e:
                reason = str(e)
            else:
                original = vars(cls)[name]
                original = getattr(original, "posenc_original", original)
                form = form_of(name, original)
                if form is None:
                    reason = (f"the source of {cls.__qualname__}.{name} is not a form "
                              "posenc_torch knows")
                else:
                    reason = _install_check(cls, name, form, original)
            if reason is not None:
                warnings.warn(f"posenc_torch.hf.patch leaves {mt}.{name} to transformers: "
                              f"{reason}", UnsupportedModelWarning, stacklevel=3)
                continue
            target = f"{mt}.{name}"
            handle._add_counters(target)
            handle.install(cls, name, _make_route(cls, name, form, original, handle, target),
                           target)
