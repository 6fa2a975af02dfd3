"""Vision towers: what their encoders compute from the patch grids, posenc_torch.vision
against transformers' own helpers, per computation and all together.

Computations (the settings of the Qwen-VL towers: spatial merge 2; Qwen2.5-VL's window of
112 pixels over 14-pixel patches; Qwen3-VL's 48 x 48 learned table, bilinear with
``align_corners=True``):

- ``vision_position_ids``: the (row, col) rotary ids of every patch;
- ``vision_attention_seqlens``: per-frame ``cu_seqlens`` and their maximum (flash attention
  reads it);
- ``vision_window_index``: Qwen2.5-VL's window order and window boundaries;
- ``vision_interpolation``: the taps and weights that resample the learned table;
- ``vision_all``: the four, one after the other (what a tower whose kwargs are all
  precomputed saves per forward).

Batches: 32 images of 896 x 896 (grid (1, 64, 64), 131,072 patches); 256 images of 224 x 224
((1, 16, 16), 65,536 patches); 8 images of 896 x 896 and 2 videos of 64 frames at 896 x 896
(temporal patch 2: (32, 64, 64), 294,912 patches in all).

Parts:

- "vision_5x": transformers 5.x of the environment, ``transformers.vision_utils``
  (``get_vision_position_ids``, ``get_vision_attention_seqlens`` with a flash-attention
  config, ``get_vision_window_index``, ``get_vision_interpolation_indices_and_weights``)
  against the posenc_torch.vision functions of the same names.
- "vision_4_57": transformers 4.57.6 (the .venv/hf4 overlay), the vision models' methods on
  stand-ins holding what they read: Qwen2-VL's ``rot_pos_emb`` (ids, then its rotary
  frequency table gathered with them; a table of one frequency, which posenc gathers with
  its ids the same way),
  the ``cu_seqlens`` expression of the towers' forward, Qwen2.5-VL's ``get_window_index``
  plus the int32 tensor and ``torch.unique_consecutive`` of its forward, Qwen3-VL's
  ``fast_pos_embed_interpolate`` with a table of width 1 (the taps and weights gathered and
  summed as it does, posenc's taps and weights gathered and summed the same way).

Outputs must be equal (integers identical, weights bit for bit) before anything is timed.
"copy" is the floor of writing the outputs: a clone of the reference's tensors.  Forward
only (integer outputs; the weights have no gradient here).

Run alone: ``python benchmarks/bench_vision.py [--full]`` (goes through run.py).
"""

from __future__ import annotations

import sys
import types

import torch

import harness as H

TOPIC = "vision"
PARTS = {"vision_5x": 5, "vision_4_57": 4}

MERGE, WINDOW, PATCH, SIDE = 2, 112, 14, 48
IMAGE_896, IMAGE_224, VIDEO_64 = (1, 64, 64), (1, 16, 16), (32, 64, 64)
BATCHES = {
    "32x896^2": [IMAGE_896] * 32,
    "256x224^2": [IMAGE_224] * 256,
    "8img+2vid64f": [IMAGE_896] * 8 + [VIDEO_64] * 2,
}
SMOKE = {"smoke": [(1, 8, 8), (2, 4, 6), (1, 2, 2)]}
COMPUTATIONS = ("position_ids", "attention_seqlens", "window_index", "interpolation", "all")
METHOD_NAMES = ("posenc", "hf_eager", "hf_compile", "copy")


def batches(suite: str) -> dict[str, list[tuple[int, int, int]]]:
    return SMOKE if suite == "smoke" else BATCHES


def _case(opts: H.Options, computation: str, label: str, grids: list) -> H.Case:
    patches = sum(t * h * w for t, h, w in grids)
    return H.Case(TOPIC, f"vision_{computation}", "Qwen-VL-ViT", len(grids), patches, "int64",
                  "fwd", opts.threads, opts.device,
                  f"{label},transformers{PARTS.get(opts.part, '?')}")


def plan(opts: H.Options):
    return [(_case(opts, c, label, grids), METHOD_NAMES)
            for label, grids in batches(opts.suite).items() for c in COMPUTATIONS]


# ---------------------------------------------------------------------------------------
# The two sides of each computation: {computation: (posenc callable, transformers callable)}.


def _all(parts: dict) -> tuple:
    """The four computations one after the other, their outputs in one tuple."""
    def side(i):
        fns = [parts[c][i] for c in COMPUTATIONS[:-1]]
        return lambda: tuple(t for fn in fns for t in fn())
    return side(0), side(1)


def computations_5x(grid_thw: torch.Tensor) -> dict:
    from transformers import vision_utils as hf

    from posenc_torch import vision as pv

    flash = types.SimpleNamespace(_attn_implementation="flash_attention_2")
    parts = {
        "position_ids": (lambda: (pv.get_vision_position_ids(grid_thw, MERGE),),
                         lambda: (hf.get_vision_position_ids(grid_thw, MERGE),)),
        # the maximum is computed (a flash-attention config) and checked apart: not a tensor
        "attention_seqlens": (lambda: pv.get_vision_attention_seqlens(grid_thw, flash)[:1],
                              lambda: hf.get_vision_attention_seqlens(grid_thw, flash)[:1]),
        "window_index": (lambda: pv.get_vision_window_index(grid_thw, MERGE, WINDOW, PATCH),
                         lambda: hf.get_vision_window_index(grid_thw, MERGE, WINDOW, PATCH)),
        "interpolation": (
            lambda: pv.get_vision_interpolation_indices_and_weights(
                grid_thw, SIDE, "bilinear", True, MERGE),
            lambda: hf.get_vision_interpolation_indices_and_weights(
                grid_thw, SIDE, "bilinear", True, MERGE)),
    }
    ours, theirs = (pv.get_vision_attention_seqlens(grid_thw, flash)[1],
                    hf.get_vision_attention_seqlens(grid_thw, flash)[1])
    if ours != theirs:
        raise AssertionError(f"max_seqlen {ours} != transformers' {theirs}")
    parts["all"] = _all(parts)
    return parts


def computations_4_57(grid_thw: torch.Tensor) -> dict:
    import torch.nn.functional as F
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel as Qwen25Tower,
    )
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel as Qwen2Tower,
        VisionRotaryEmbedding,
    )
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Qwen3Tower

    from posenc_torch import vision as pv

    rotary = VisionRotaryEmbedding(2)  # one frequency: the gather costs little on both sides
    rot_owner = types.SimpleNamespace(spatial_merge_size=MERGE, rotary_pos_emb=rotary)
    window_owner = types.SimpleNamespace(window_size=WINDOW, spatial_merge_size=MERGE,
                                         patch_size=PATCH, spatial_merge_unit=MERGE * MERGE)
    table = torch.nn.Embedding(SIDE * SIDE, 1).requires_grad_(False)
    interp_owner = types.SimpleNamespace(num_grid_per_side=SIDE, pos_embed=table,
                                         config=types.SimpleNamespace(spatial_merge_size=MERGE))
    longest = int(grid_thw[:, 1:].max())

    def hf_window():
        index, boundaries = Qwen25Tower.get_window_index(window_owner, grid_thw)
        return index, torch.unique_consecutive(torch.tensor(boundaries, dtype=torch.int32))

    def hf_cu_seqlens():  # the expression of the towers' forward
        cu = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(
            dim=0, dtype=torch.int32)
        return (F.pad(cu, (1, 0), value=0),)

    def ours_interp():
        taps, weights = pv.get_vision_interpolation_indices_and_weights(
            grid_thw, SIDE, "bilinear", True, MERGE, convention="4.57")
        embeds = table(taps.T) * weights.T[:, :, None]
        return (embeds[0] + embeds[1] + embeds[2] + embeds[3],)

    parts = {
        "position_ids": (
            lambda: (rotary(longest)[pv.get_vision_position_ids(grid_thw, MERGE)].flatten(1),),
            lambda: (Qwen2Tower.rot_pos_emb(rot_owner, grid_thw),)),
        "attention_seqlens": (lambda: (pv.get_vision_cu_seqlens(grid_thw),), hf_cu_seqlens),
        "window_index": (lambda: pv.get_vision_window_index(grid_thw, MERGE, WINDOW, PATCH),
                         hf_window),
        "interpolation": (ours_interp,
                          lambda: (Qwen3Tower.fast_pos_embed_interpolate(interp_owner,
                                                                         grid_thw),)),
    }
    parts["all"] = _all(parts)
    return parts


def run(opts: H.Options, rep: H.Reporter) -> None:
    import transformers

    if opts.part not in PARTS:
        raise ValueError(f"unknown part {opts.part!r}; parts: {sorted(PARTS)}")
    major = int(transformers.__version__.split(".")[0])
    if major != PARTS[opts.part]:
        raise SystemExit(f"bench_vision part {opts.part!r} needs transformers "
                         f"{PARTS[opts.part]}.x, found {transformers.__version__}; run it through "
                         "benchmarks/run.py (it puts .venv/hf4 on PYTHONPATH for 4.x)")
    for label, rows in batches(opts.suite).items():
        grid_thw = torch.tensor(rows, dtype=torch.int64, device=opts.device)
        parts = (computations_5x if major >= 5 else computations_4_57)(grid_thw)
        for computation in COMPUTATIONS:
            ours, theirs = parts[computation]
            with torch.no_grad():
                ref = theirs()

            def build(name, ours=ours, theirs=theirs, ref=ref):
                if name == "posenc":
                    return H.Workload(ours)
                if name == "hf_eager":
                    return H.Workload(theirs)
                if name == "hf_compile":
                    raise NotImplementedError(
                        "transformers' helpers loop over the grids in Python (.tolist(), "
                        "data-dependent shapes): torch.compile breaks the graph at each step, "
                        "so there is no compiled peer worth timing")
                if name == "copy":
                    return H.Workload(timed={"fwd": lambda: tuple(t.clone() for t in ref)},
                                      verify=False)
                raise KeyError(name)

            case = _case(opts, computation, label, rows)
            floor = H.floor_bytes(*ref)
            for res in H.run_case(case, METHOD_NAMES, build, ref, opts.policy, exact=True,
                                  floor=floor, transformers_version=transformers.__version__):
                rep.add(res, f"{case.name} {res.method}")


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
