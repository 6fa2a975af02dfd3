"""Position ids for multimodal RoPE: decoder ids (transformers' ``get_rope_index``), the
ids of decoding steps, and the vision tower's patch ids.  Integer outputs, no gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import check_same_device, check_tensor

MROPE_MODELS = {"qwen2_vl": 0, "qwen2_5_vl": 1, "qwen3_vl": 2}

#: ``vision_config.tokens_per_second`` of the released Qwen2.5-VL checkpoints (3B, 7B, 32B,
#: 72B).  The config class default is 4 and some docstrings say 25; pass the value of your
#: checkpoint's config when it differs.
QWEN2_5_VL_TOKENS_PER_SECOND = 2.0


def _check_int_arg(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_integer_tensor(name: str, t: object, ndim: int, layout: str) -> torch.Tensor:
    check_tensor(name, t, ndim, layout)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int64 or int32), got {t.dtype}")
    return t


def _check_grid(name: str, grid: object) -> torch.Tensor | None:
    if grid is None:
        return None
    _check_integer_tensor(name, grid, 2, "2-D (num_grids, 3) of (t, h, w)")
    if grid.shape[1] != 3:
        raise ValueError(f"{name} must have shape (num_grids, 3) of (t, h, w) patch counts, "
                         f"got shape {tuple(grid.shape)}")
    return grid


def compute_mrope_position_ids(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    model: str = "qwen2_vl",
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int = 2,
    second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
    tokens_per_second: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """3-D (T, H, W) position ids of a multimodal prompt, as transformers 4.57's
    ``get_rope_index`` of Qwen2-VL, Qwen2.5-VL or Qwen3-VL computes them.

    Shapes:
        input_ids:          (B, L) integer token ids
        image_grid_thw:     (n_images, 3) patch grids (t, h, w) *before* merging, in the
                            order the images appear in the batch (row 0 first)
        video_grid_thw:     (n_videos, 3), likewise
        attention_mask:     (B, L) of 0/1 (bool, integer or floating); 0 marks padding,
                            left or right
        second_per_grid_ts: (n_videos,) seconds per temporal grid step (Qwen2.5-VL only;
                            ``temporal_patch_size / fps`` from the processor)
    Returns ``(position_ids, mrope_position_deltas)``: (3, B, L) int64 and (B, 1) int64.

    Per row, over the unmasked tokens: an image (video) is a run of
    ``t * (h/m) * (w/m)`` ``image_token_id`` (``video_token_id``) tokens right after a
    ``vision_start_token_id`` (m = ``spatial_merge_size``); it gets positions
    ``start + (tidx(ti), hi, wi)`` on its LLM grid, text gets one position per token
    on all three rows, and whatever follows an image starts at its largest position + 1.
    Padded slots hold 1, and ``mrope_position_deltas[b] = max position + 1 - L`` (L the
    padded length) is what decoding adds to the cache position
    (see :func:`compute_mrope_decode_position_ids`).  Temporal index ``tidx``:

    - ``"qwen2_vl"``: the frame index ``ti``.
    - ``"qwen2_5_vl"``: images 0; videos ``trunc(ti * second_per_grid_ts[v] *
      tokens_per_second)``, computed in float64 (1.0 s per grid when
      ``second_per_grid_ts`` is None).  ``tokens_per_second`` defaults to
      ``QWEN2_5_VL_TOKENS_PER_SECOND`` = 2, the value in the released checkpoints'
      ``vision_config``.  With integral seconds this equals transformers 4.57; fractional
      seconds (fps > 2, e.g. 0.5 s per grid) keep their fraction, where some transformers
      releases truncate the seconds to an integer first (all frames then share one index).
    - ``"qwen3_vl"``: each video grid (t, h, w) is t frames of (1, h, w), each with its
      own vision start (the processor puts a timestamp before every frame), so videos get
      no temporal offset; images use ``ti``.  ``tokens_per_second`` does not apply.

    Without grids (both None) every row gets text positions (``cumsum(mask) - 1`` or
    ``arange(L)``), as transformers does; a row that nevertheless holds a vision run is an
    error.  Grids that disagree with the tokens raise ``ValueError`` naming
    ``image_grid_thw`` / ``video_grid_thw``: too few or too many grids, a run shorter or
    longer than its grid, a placeholder without vision start, h or w not divisible by
    ``spatial_merge_size``, or values <= 0.
    """
    if not isinstance(model, str) or model not in MROPE_MODELS:
        raise ValueError(f"model must be one of {sorted(MROPE_MODELS)}, got {model!r}")
    _check_integer_tensor("input_ids", input_ids, 2, "2-D (batch, seq)")
    image_grid_thw = _check_grid("image_grid_thw", image_grid_thw)
    video_grid_thw = _check_grid("video_grid_thw", video_grid_thw)
    ids = {name: _check_int_arg(name, value, 0) for name, value in (
        ("image_token_id", image_token_id), ("video_token_id", video_token_id),
        ("vision_start_token_id", vision_start_token_id))}
    if len(set(ids.values())) != 3:
        raise ValueError(f"image_token_id, video_token_id and vision_start_token_id must be "
                         f"distinct, got {ids}")
    _check_int_arg("spatial_merge_size", spatial_merge_size, 1)
    tensors = {"input_ids": input_ids}
    if attention_mask is not None:
        check_tensor("attention_mask", attention_mask, 2, "2-D (batch, seq)")
        if attention_mask.is_complex():
            raise TypeError(f"attention_mask must be bool, integer or floating, got "
                            f"{attention_mask.dtype}")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} must equal "
                             f"input_ids shape {tuple(input_ids.shape)}")
        tensors["attention_mask"] = attention_mask
    if image_grid_thw is not None:
        tensors["image_grid_thw"] = image_grid_thw
    if video_grid_thw is not None:
        tensors["video_grid_thw"] = video_grid_thw

    if model == "qwen2_5_vl":
        if tokens_per_second is None:
            tokens_per_second = QWEN2_5_VL_TOKENS_PER_SECOND
        if isinstance(tokens_per_second, bool) or not isinstance(tokens_per_second,
                                                                 (int, float)):
            raise TypeError(f"tokens_per_second must be a number, got "
                            f"{type(tokens_per_second).__name__}")
        if not tokens_per_second >= 0 or tokens_per_second == float("inf"):
            raise ValueError(f"tokens_per_second must be finite and >= 0, got "
                             f"{tokens_per_second}")
        if second_per_grid_ts is not None:
            if not isinstance(second_per_grid_ts, torch.Tensor):
                if not isinstance(second_per_grid_ts, Sequence):
                    raise TypeError("second_per_grid_ts must be a tensor or a sequence of "
                                    f"floats, got {type(second_per_grid_ts).__name__}")
                second_per_grid_ts = torch.tensor([float(s) for s in second_per_grid_ts],
                                                  dtype=torch.float64,
                                                  device=input_ids.device)
            check_tensor("second_per_grid_ts", second_per_grid_ts, 1, "1-D (num_videos,)")
            if second_per_grid_ts.is_complex() or second_per_grid_ts.dtype == torch.bool:
                raise TypeError(f"second_per_grid_ts must be real, got "
                                f"{second_per_grid_ts.dtype}")
            n_videos = 0 if video_grid_thw is None else video_grid_thw.shape[0]
            if second_per_grid_ts.shape[0] != n_videos:
                raise ValueError(f"second_per_grid_ts has {second_per_grid_ts.shape[0]} "
                                 f"values but video_grid_thw has {n_videos} rows")
            tensors["second_per_grid_ts"] = second_per_grid_ts
    else:
        if second_per_grid_ts is not None:
            raise ValueError(f"second_per_grid_ts applies only to model='qwen2_5_vl', "
                             f"got model={model!r}")
        if tokens_per_second is not None:
            raise ValueError(f"tokens_per_second applies only to model='qwen2_5_vl', "
                             f"got model={model!r}")
        tokens_per_second = 0.0
    check_same_device(**tensors)
    return torch.ops.posenc.mrope_position_ids(
        input_ids, image_grid_thw, video_grid_thw, attention_mask, second_per_grid_ts,
        MROPE_MODELS[model], image_token_id, video_token_id, vision_start_token_id,
        spatial_merge_size, float(tokens_per_second))


def compute_mrope_decode_position_ids(
    mrope_position_deltas: torch.Tensor,
    past_length: int | torch.Tensor,
    num_new_tokens: int = 1,
    *,
    batch_size: int | None = None,
) -> torch.Tensor:
    """Position ids (3, B, n) of the tokens generated after a multimodal prefill.

    Shapes:
        mrope_position_deltas: (B, 1) or (B,) integer — the second output of
            :func:`compute_mrope_position_ids` for the prefill
        past_length: number of tokens already in the KV cache (the prefill's padded length,
            then one more per step), as an int, a 0-d tensor, or transformers'
            ``cache_position`` (1-D; its first entry is used)
        num_new_tokens: n, the tokens of this step (1 for plain decoding)
    Returns int64 ids (3, B', n), equal on the three rows:
    ``ids[:, b, i] = past_length + i + mrope_position_deltas[b]``, which is what
    transformers 4.57's Qwen-VL forward computes once ``rope_deltas`` is set.
    ``batch_size`` B' (a multiple of B) repeats every row's delta B'/B times, for beam search
    or several samples per prompt; default B.
    """
    check_tensor("mrope_position_deltas", mrope_position_deltas, (1, 2), "(batch, 1) or (batch,)")
    if mrope_position_deltas.is_floating_point() or mrope_position_deltas.dtype == torch.bool:
        raise TypeError(f"mrope_position_deltas must be an integer tensor, got "
                        f"{mrope_position_deltas.dtype}")
    if mrope_position_deltas.dim() == 2 and mrope_position_deltas.shape[1] != 1:
        raise ValueError(f"mrope_position_deltas must be (batch, 1) or (batch,), got shape "
                         f"{tuple(mrope_position_deltas.shape)}")
    _check_int_arg("num_new_tokens", num_new_tokens, 0)
    deltas = mrope_position_deltas.reshape(-1, 1).long()
    if batch_size is not None:
        _check_int_arg("batch_size", batch_size, 1)
        if batch_size % deltas.shape[0]:
            raise ValueError(f"batch_size {batch_size} must be a multiple of the "
                             f"{deltas.shape[0]} rows of mrope_position_deltas")
        deltas = deltas.repeat_interleave(batch_size // deltas.shape[0], dim=0)
    if isinstance(past_length, torch.Tensor):
        if past_length.is_floating_point() or past_length.dtype == torch.bool:
            raise TypeError(f"past_length must be an int or an integer tensor, got "
                            f"{past_length.dtype}")
        if past_length.dim() > 1 or past_length.numel() == 0:
            raise ValueError("past_length as a tensor must be 0-d, or 1-D cache_position "
                             f"with at least one entry, got shape {tuple(past_length.shape)}")
        start = past_length.reshape(-1)[:1].to(device=deltas.device, dtype=torch.int64)
    else:
        start = _check_int_arg("past_length", past_length, 0)
    steps = torch.arange(num_new_tokens, device=deltas.device, dtype=torch.int64)
    ids = steps.unsqueeze(0) + start + deltas
    return ids.unsqueeze(0).repeat(3, 1, 1)


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
    frequencies with.  ValueError for values <= 0 or h, w not divisible by m.
    """
    _check_integer_tensor("grid_thw", grid_thw, 2, "2-D (num_grids, 3) of (t, h, w)")
    if grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must have shape (num_grids, 3), got "
                         f"{tuple(grid_thw.shape)}")
    _check_int_arg("spatial_merge_size", spatial_merge_size, 1)
    check_same_device(grid_thw=grid_thw)
    return torch.ops.posenc.vision_position_ids(grid_thw, spatial_merge_size)
