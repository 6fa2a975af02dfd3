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

- "vision_5x" also times a tiny vision tower's forward (``vision_tower``: the image tower of a
  random Qwen2.5-VL and of a Qwen3-VL with one block of width 32, the real patch, merge,
  window and table settings, on 16 images of 224 x 224): ``posenc`` is the tower given
  the kwargs ``posenc_torch.hf.precompute_vision_kwargs`` made beforehand (as a collator
  does, outside the step), ``hf_eager`` the tower computing them itself.  The outputs
  must be equal bit for bit.

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


TOWER_GRIDS = {"smoke": [(1, 4, 4), (1, 8, 4)], "default": [(1, 16, 16)] * 16}
TOWERS = ("qwen2_5_vl", "qwen3_vl")


def _tower_grids(suite: str) -> list:
    return TOWER_GRIDS["smoke" if suite == "smoke" else "default"]


def _tower_case(opts: H.Options, model_type: str) -> H.Case:
    grids = _tower_grids(opts.suite)
    return H.Case(TOPIC, "vision_tower", model_type, len(grids),
                  sum(t * h * w for t, h, w in grids), "float32", "fwd", opts.threads,
                  opts.device, f"{len(grids)} images,transformers{PARTS.get(opts.part, '?')}")


def plan(opts: H.Options):
    cases = [(_case(opts, c, label, grids), METHOD_NAMES)
             for label, grids in batches(opts.suite).items() for c in COMPUTATIONS]
    if opts.part == "vision_5x":
        cases += [(_tower_case(opts, mt), METHOD_NAMES) for mt in TOWERS]
    return cases


def _tiny_tower(model_type: str):
    """The image tower (``model.model.get_image_features``) of a random model with one
    vision block of width 32 and the real patch (14), merge (2), window (112) and table
    (48 x 48) settings."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  patch_size=14, spatial_merge_size=2)
    if model_type == "qwen2_5_vl":
        vision.update(window_size=112, fullatt_block_indexes=[0])
    else:
        vision.update(num_position_embeddings=SIDE * SIDE, deepstack_visual_indexes=[0])
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [3, 3, 2],
                                   "mrope_interleaved": True}
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()
    return model


def _tower_parts(model_type: str, rows: list):
    import posenc_torch.hf

    model = _tiny_tower(model_type)
    vc = model.config.vision_config
    grids = torch.tensor(rows)
    gen = torch.Generator().manual_seed(5)
    pix = torch.randn(int(grids.prod(-1).sum()),
                      vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2, generator=gen)
    kwargs = posenc_torch.hf.precompute_vision_kwargs(model.config, image_grid_thw=grids)
    if not kwargs:
        raise RuntimeError(f"no precomputed vision kwargs for {model_type}")

    def tower(**kw):
        with torch.no_grad():
            out = model.model.get_image_features(pix, grids, **kw)
        out = getattr(out, "pooler_output", out)
        return (torch.cat(list(out)),) if isinstance(out, (tuple, list)) else (out,)

    return (lambda: tower(**kwargs)), (lambda: tower())


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
    if major < 5:
        return
    for model_type in TOWERS:
        ours, theirs = _tower_parts(model_type, _tower_grids(opts.suite))
        ref = theirs()

        def build_tower(name, ours=ours, theirs=theirs):
            if name == "posenc":
                return H.Workload(ours)
            if name == "hf_eager":
                return H.Workload(theirs)
            raise NotImplementedError(
                "the tower's forward with and without the precomputed kwargs is the "
                "comparison; a compiled tower and a copy floor are not part of it")

        case = _tower_case(opts, model_type)
        for res in H.run_case(case, METHOD_NAMES, build_tower, ref, opts.policy, exact=True,
                              transformers_version=transformers.__version__):
            rep.add(res, f"{case.name} {res.method}")


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
