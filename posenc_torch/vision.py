"""Vision towers: what their encoders compute from the patch grids alone, in one C walk per
batch: patch position ids, attention boundaries, Qwen2.5-VL's window order, the taps and
weights that resample a learned position-embedding table, nearest-neighbour position ids.

The functions take the arguments of the transformers 5.x functions of the same names
(``transformers.vision_utils``, minus their ``kwargs``) and return the same tensors:
integers identical, weights bit for bit (float32, each operation rounded as transformers'
torch expression rounds it).  They import no transformers.

Grids are ``(num_grids, 3)`` integer tensors of ``(t, h, w)`` patch counts before merging, one
row per image or video; a grid with a value below 1, or (where a merge size is read) h or w
not divisible by it, is a ValueError that names its row, ``grid_thw[i]``.  Unlike
transformers, an empty list of grids gives empty results (transformers raises).  Grids on
another device than the CPU are read on the CPU and the results put on their device.
"""

from __future__ import annotations

import torch

from ._checks import (
    InputTypeError,
    InputValueError,
    check_bool,
    check_int,
    check_same_device,
    check_str,
    check_tensor,
    explain,
)
from ._tables import CONVENTIONS

__all__ = [
    "get_vision_position_ids",
    "get_vision_cu_seqlens",
    "get_vision_attention_seqlens",
    "get_vision_window_index",
    "get_vision_interpolation_indices_and_weights",
    "get_vision_bilinear_indices_and_weights",
    "get_vision_nearest_position_ids",
    "get_vision_merged_shape",
    "vision_rotary_position_ids",
]

# csrc/posenc.h: pe_interp_mode, pe_interp_padding, pe_interp_rule
INTERP_MODES = {"bilinear": 0, "bicubic": 1}
INTERP_PADDINGS = {"border": 0, "zeros": 1}
INTERP_RULES_5, INTERP_LINSPACE, INTERP_LINSPACE_TWO_ROUNDINGS = 0, 1, 2

_is_compiling = torch.compiler.is_compiling


# ---------------------------------------------------------------------------------------
# Checks (run after an op failed, or while tracing, where no kernel runs).


def _check_readable(name: str, t: torch.Tensor) -> None:
    """The walks read the grids' values (their results' sizes depend on them): a meta
    tensor has none, so it is a device these functions do not run on."""
    if t.is_meta:
        raise NotImplementedError(f"{name} is a meta tensor: the vision functions read its "
                                  "values, which a meta tensor does not have")


def _check_grids(name: str, grid_thw: object, columns: int = 3) -> None:
    layout = "(num_grids, 3) of (t, h, w)" if columns == 3 else "(num_images, 2) of (h, w)"
    t = check_tensor(name, grid_thw, 2, f"2-D {layout}")
    _check_readable(name, t)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InputTypeError(f"{name} must be an integer tensor (int64 or int32), got {t.dtype}")
    if t.shape[1] != columns:
        raise InputValueError(f"{name} must have shape {layout}, got shape {tuple(t.shape)}")


def _check_grid_thw(grid_thw: object) -> None:
    check_tensor("grid_thw", grid_thw, 2, "2-D (num_grids, 3) of (t, h, w)")
    check_same_device(grid_thw=grid_thw)
    _check_readable("grid_thw", grid_thw)


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """t where the kernels read it: the CPU (meta tensors stay meta)."""
    return t if t.device.type in ("cpu", "meta") else t.cpu()


def _to(device: torch.device, *outs: torch.Tensor):
    moved = tuple(o if o.device == device else o.to(device) for o in outs)
    return moved if len(moved) > 1 else moved[0]


def _call(op, name: str, grids: object, *args: object, columns: int = 3):
    """op(grids on the CPU, *args) with its results on the grids' device; the op's failure
    explained in terms of the public arguments."""
    if not isinstance(grids, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(grids).__name__}")
    if _is_compiling():
        _check_grids(name, grids, columns)
    try:
        out = op(_on_host(grids), *args)
    except Exception as err:
        raise explain(err, _check_grids, name, grids, columns) from None
    return _to(grids.device, *out) if isinstance(out, tuple) else _to(grids.device, out)


def _choice(name: str, value: object, choices: dict[str, int]) -> int:
    code = choices.get(check_str(name, value))
    if code is None:
        raise InputValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return code


# ---------------------------------------------------------------------------------------
# Position ids.


def get_vision_position_ids(grid_thw: torch.Tensor, spatial_merge_size: int | torch.Tensor,
                            include_temporal: bool = False) -> torch.Tensor:
    """The rotary position ids of every patch, in the order the vision tower sees them.

    Shapes:
        grid_thw: (n, 3) integer, (t, h, w) patches per image / video
        spatial_merge_size: an int, or an (n,) integer tensor of one merge size per grid
            (VideoLLaMA3)
    Returns (N, 2) int64 (row, col), or (N, 3) (frame, row, col) with ``include_temporal``
    (MiniMax-M3-VL), N = sum of t * h * w: grid by grid, frame by frame (the same ids in
    every frame), and within a frame the (h/m) x (w/m) merge blocks row-major, within a
    block its m x m patches row-major.  transformers: ``vision_utils.get_vision_position_ids``.
    """
    check_bool("include_temporal", include_temporal)
    merge_sizes = None
    if isinstance(spatial_merge_size, torch.Tensor):
        merge_sizes, spatial_merge_size = _on_host(spatial_merge_size), 1
    else:
        check_int("spatial_merge_size", spatial_merge_size, 1)
    return _call(torch.ops.posenc.vision_position_ids, "grid_thw", grid_thw, spatial_merge_size,
                 merge_sizes, include_temporal)


def vision_rotary_position_ids(grid_thw: torch.Tensor,
                               spatial_merge_size: int = 2) -> torch.Tensor:
    """(row, col) patch positions of the Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision tower.

    Shapes:
        grid_thw: (n, 3) integer patch grids (t, h, w) of the images / videos
    Returns (N, 2) int64, N = sum of t * h * w, in the order the vision tower sees its
    patches: grid by grid, t repeats of one frame; within a frame the
    (h/m) x (w/m) merge windows row-major, and within a window its m x m patches
    row-major (m = ``spatial_merge_size``).  These are the ids that transformers'
    ``rot_pos_emb`` (4.x) / ``get_vision_position_ids`` (5.x) gather the vision rotary
    frequencies with.  ValueError for values <= 0 or h, w not divisible by m;
    RuntimeError naming grid_thw when the (N, 2) ids cannot be allocated.
    """
    check_int("spatial_merge_size", spatial_merge_size, 1)
    if _is_compiling():
        _check_grid_thw(grid_thw)
    try:  # the op checks the grids (dtype, shape, values) first; see rope.py
        return torch.ops.posenc.vision_position_ids(grid_thw, spatial_merge_size)
    except Exception as err:
        raise explain(err, _check_grid_thw, grid_thw) from None


# ---------------------------------------------------------------------------------------
# Attention boundaries.


def get_vision_cu_seqlens(grid_thw: torch.Tensor, merge_temporal: bool = False) -> torch.Tensor:
    """Cumulative lengths of the vision tower's attention segments.

    Shapes:
        grid_thw: (n, 3) integer
    Returns (S + 1,) int32 (the grids' dtype while ``torch.jit`` traces, as transformers
    does), starting at 0: one segment of h * w patches per frame (S = sum of t: Qwen2-VL,
    GLM-4V, ...), or with ``merge_temporal`` one of t * h * w per grid (S = n: Kimi-K2.5).
    ValueError when the total passes 2^31 - 1.  transformers:
    ``vision_utils.get_vision_cu_seqlens``.
    """
    check_bool("merge_temporal", merge_temporal)
    cu, _ = _call(torch.ops.posenc.vision_cu_seqlens, "grid_thw", grid_thw, merge_temporal)
    return cu.to(grid_thw.dtype) if torch.jit.is_tracing() else cu


def get_vision_attention_seqlens(grid_thw: torch.Tensor, config: object | None = None,
                                 merge_temporal: bool = False) -> tuple[torch.Tensor, int | None]:
    """:func:`get_vision_cu_seqlens` and the longest segment.

    Shapes:
        grid_thw: (n, 3) integer
    Returns ``(cu_seqlens (S + 1,) int32, max_seqlen)``.  ``max_seqlen`` is a Python int,
    or, as transformers gives it, None when ``config`` is given and its
    ``_attn_implementation`` is not a flash-attention one (only flash attention reads it);
    0 without grids.  transformers: ``vision_utils.get_vision_attention_seqlens``.
    """
    check_bool("merge_temporal", merge_temporal)
    cu, longest = _call(torch.ops.posenc.vision_cu_seqlens, "grid_thw", grid_thw, merge_temporal)
    if torch.jit.is_tracing():
        cu = cu.to(grid_thw.dtype)
    if config is not None:
        implementation = getattr(config, "_attn_implementation", None)
        if implementation is None or "flash" not in implementation:
            return cu, None
    return cu, int(longest)


# ---------------------------------------------------------------------------------------
# Window order (Qwen2.5-VL).


def get_vision_window_index(grid_thw: torch.Tensor, spatial_merge_size: int, window_size: int,
                            patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's window order of the merged tokens and the window boundaries.

    Shapes:
        grid_thw: (n, 3) integer
    Returns ``(window_index (M,) int64, cu_window_seqlens (W + 1,) int32)``, M = sum of
    t * (h/m) * (w/m) merged tokens.  Each frame's merged grid is cut into windows of
    ``window_size // spatial_merge_size // patch_size`` tokens a side from its top left
    corner; ``window_index`` lists the merged tokens (numbered across the batch) window by
    window, row-major inside each, and ``cu_window_seqlens`` is 0 followed by the running
    patch count (tokens * m^2) at the end of every window that holds a token (transformers
    drops the repeated boundaries of the empty padding windows with
    ``torch.unique_consecutive``: the same values).  ValueError when a window would hold no
    token (window_size < spatial_merge_size * patch_size).  transformers:
    ``vision_utils.get_vision_window_index`` (4.57: ``Qwen2_5_VisionTransformerPretrainedModel
    .get_window_index``).
    """
    for name, value in (("spatial_merge_size", spatial_merge_size), ("window_size", window_size),
                        ("patch_size", patch_size)):
        check_int(name, value, 1)
    return _call(torch.ops.posenc.vision_window_index, "grid_thw", grid_thw, spatial_merge_size,
                 window_size, patch_size)


# ---------------------------------------------------------------------------------------
# Interpolated position embeddings.

def _probe_linspace_rule() -> int:
    """Whether this torch's ``linspace`` rounds ``end - step * k`` once (its AVX2 / AVX-512
    CPU kernels) or twice (its portable one): asked of torch once, on a value that tells."""
    probe = torch.linspace(0.0, 1.0, 10, dtype=torch.float32, device="cpu")[6]
    twice = 1.0 - torch.tensor(1.0, dtype=torch.float32) / 9 * 3
    return INTERP_LINSPACE_TWO_ROUNDINGS if bool(probe == twice) else INTERP_LINSPACE


#: The ``torch.linspace`` rounding of the running torch (4.57's interpolation uses it),
#: asked at import: a constant that torch.compile reads like any module global.
_LINSPACE_RULE: int = _probe_linspace_rule()


def _linspace_rule() -> int:
    return _LINSPACE_RULE


def get_vision_interpolation_indices_and_weights(
        grid_thw: torch.Tensor, num_grid_per_side: int, mode: str = "bilinear",
        align_corners: bool = False, spatial_merge_size: int = 1, padding: str = "border", *,
        convention: str = "5.17") -> tuple[torch.Tensor, torch.Tensor]:
    """Taps and weights that resample a learned square position-embedding table to every
    patch of every grid.

    Shapes:
        grid_thw: (n, 3) integer
    Returns ``(indices (N, taps) int64, weights (N, taps) float32)``, N = sum of t * h * w
    in patch order (merge blocks of ``spatial_merge_size``; 1 is raster order), taps = 4
    (``mode="bilinear"``) or 16 (``"bicubic"``, Keys' kernel with a = -0.75): patch k's
    embedding is ``sum_j weights[k, j] * table[indices[k, j]]`` for the flattened
    (num_grid_per_side ** 2, D) table, what ``F.interpolate(mode=mode,
    align_corners=align_corners)`` gives (``padding="zeros"``: out-of-table taps weigh 0, as
    ``F.grid_sample(padding_mode="zeros")``).  Bit for bit what transformers 5.x's
    ``vision_utils.get_vision_interpolation_indices_and_weights`` returns.

    ``convention="4.57"``: what transformers 4.57's Qwen3-VL ``fast_pos_embed_interpolate``
    gathers and weighs (its positions come from ``torch.linspace``; bilinear,
    ``align_corners=True`` and border padding only), in the same layout; "5.17" and "5.18"
    (the default form) give the 5.x function's results.
    """
    code = _choice("mode", mode, INTERP_MODES)
    check_bool("align_corners", align_corners)
    pad = _choice("padding", padding, INTERP_PADDINGS)
    check_int("num_grid_per_side", num_grid_per_side, 1)
    check_int("spatial_merge_size", spatial_merge_size, 1)
    if check_str("convention", convention) not in CONVENTIONS:
        raise InputValueError(f"convention must be one of {tuple(CONVENTIONS)}, got {convention!r}")
    rule = INTERP_RULES_5
    if not CONVENTIONS[convention].v5:  # 4.57: fast_pos_embed_interpolate
        if code != INTERP_MODES["bilinear"] or not align_corners or padding != "border":
            raise InputValueError(
                "convention='4.57' (Qwen3-VL's fast_pos_embed_interpolate) is "
                "bilinear with align_corners=True and padding='border' only, got "
                f"mode={mode!r}, align_corners={align_corners}, padding={padding!r}")
        rule = _linspace_rule()
    return _call(torch.ops.posenc.vision_interpolation, "grid_thw", grid_thw, num_grid_per_side,
                 code, align_corners, spatial_merge_size, pad, rule)


def get_vision_bilinear_indices_and_weights(
        grid_thw: torch.Tensor, num_grid_per_side: int, spatial_merge_size: int,
        align_corners: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The older layout of :func:`get_vision_interpolation_indices_and_weights` (bilinear,
    ``align_corners``, border padding), as transformers 5.x's deprecated function of this
    name returns it: the transposed views.

    Shapes:
        grid_thw: (n, 3) integer
    Returns ``(indices (4, N) int64, weights (4, N) float32)``.  Note that transformers'
    function always uses ``align_corners=True``, whatever it is given; so does this one.
    """
    check_bool("align_corners", align_corners)
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side, "bilinear", True, spatial_merge_size)
    return indices.transpose(0, 1), weights.transpose(0, 1)


# ---------------------------------------------------------------------------------------
# NaViT-style packers (MiniCPM-V).


def get_vision_nearest_position_ids(target_sizes: torch.Tensor,
                                    num_patches_per_side: int) -> torch.Tensor:
    """Nearest-neighbour ids into a learned (side, side) position table, image by image.

    Shapes:
        target_sizes: (n, 2) integer, (h, w) patches per image
    Returns (N,) int64, N = sum of h * w in raster order: row y of an image of h rows takes
    the bucket of y / h among the boundaries ``torch.arange(1/side, 1, 1/side)`` (likewise
    the columns), and the patch gets ``bucket_row * side + bucket_col``.  transformers:
    ``vision_utils.get_vision_nearest_position_ids``.  ValueError names a size row below 1,
    ``target_sizes[i]``.
    """
    check_int("num_patches_per_side", num_patches_per_side, 1)
    return _call(torch.ops.posenc.vision_nearest_position_ids, "target_sizes", target_sizes,
                 num_patches_per_side, columns=2)


def get_vision_merged_shape(target_sizes: torch.Tensor,
                            window_kernel_size: tuple[int, int]) -> tuple[int, int]:
    """The grid of an image after window merging, ``(h // window_h, w // window_w)`` of its
    first row, as Python ints (the batch's images share one size).

    Shapes:
        target_sizes: (n, 2) integer, n >= 1
    transformers: ``vision_utils.get_vision_merged_shape``.
    """
    _check_grids("target_sizes", target_sizes, 2)
    if (isinstance(window_kernel_size, torch.Tensor)
            or not isinstance(window_kernel_size, (tuple, list)) or len(window_kernel_size) != 2):
        raise InputTypeError(
            f"window_kernel_size must be a (window_h, window_w) tuple of ints, got "
            f"{window_kernel_size!r}")
    window_h = check_int("window_kernel_size[0]", window_kernel_size[0], 1)
    window_w = check_int("window_kernel_size[1]", window_kernel_size[1], 1)
    if target_sizes.shape[0] == 0:
        raise InputValueError(
            "target_sizes has no row: the merged shape is that of its first image")
    h, w = (int(v) for v in target_sizes[0].tolist())
    if h < 1 or w < 1:
        raise InputValueError(f"target_sizes[0] = ({h}, {w}) is not a valid size: h and w must be "
                              "positive")
    return h // window_h, w // window_w
