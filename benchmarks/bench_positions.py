"""MRoPE position ids: compute_mrope_position_ids against transformers' get_rope_index.

Reference: transformers 4.57.6 ``Qwen2VLModel.get_rope_index`` (the vision-start based
algorithm; runs under the .venv/hf4 overlay, see bench_mrope.py for why in its own process),
called unbound on a stand-in holding a default ``Qwen2VLConfig``.  posenc_torch:
``compute_mrope_position_ids(input_ids, image_grid_thw, video_grid_thw, attention_mask,
model="qwen2_vl", image_token_id=..., video_token_id=..., vision_start_token_id=...,
spatial_merge_size=2)`` -> ``(position_ids (3, B, L), deltas (B, 1))``.  Both results must be
equal before anything is timed.

Cases: B=8, L=8192 with 4 images per row (odd rows left-padded), and B=1, L=1024 with one
image.  Forward only (integer outputs have no gradient).

Run alone: ``python benchmarks/bench_positions.py [--full]`` (goes through run.py).
"""

from __future__ import annotations

import sys

import torch

import harness as H

TOPIC = "positions"
PARTS = {"qwen2_vl": 4}

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 151652, 151653, 151655, 151656
MERGE = 2
# (batch, length, images per row)
SHAPES = {"quick": ((8, 8192, 4), (1, 1024, 1)), "full": ((8, 8192, 4), (1, 1024, 1)),
          "smoke": ((2, 256, 1),)}
GRIDS = ((1, 64, 64), (1, 48, 80), (1, 56, 72), (1, 80, 48))  # patch grids (t, h, w)
METHOD_NAMES = ("posenc", "hf_eager", "hf_compile", "copy")


def _case(opts, b, length, images) -> H.Case:
    return H.Case(TOPIC, "mrope_position_ids", "Qwen2-VL-7B", b, length, "int64", "fwd",
                  opts.threads, opts.device, f"images={images}/row")


def plan(opts: H.Options):
    return [(_case(opts, b, n, i), METHOD_NAMES) for b, n, i in SHAPES[opts.suite]]


def make_prompts(batch: int, length: int, images_per_row: int, seed: int = 0):
    """Token ids of image prompts as the Qwen2-VL processor lays them out.

    Each row: [left padding] text <vision_start> <image_pad>*n <vision_end> text ... ; the
    image patch grids cycle through ``GRIDS`` scaled to fit; odd rows are left-padded.
    Returns ``(input_ids (B, L), image_grid_thw (B*images, 3), attention_mask (B, L))``.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    grids = []
    for b in range(batch):
        pad = 0 if b % 2 == 0 else 16 + (37 * b) % 240
        row_grids = []
        budget = (length - pad) // 2  # about half of every row is image tokens
        for i in range(images_per_row):
            t, h, w = GRIDS[(b + i) % len(GRIDS)]
            scale = min(1.0, (budget / images_per_row / (h * w // MERGE**2)) ** 0.5)
            h = max(MERGE, int(h * scale) // MERGE * MERGE)
            w = max(MERGE, int(w * scale) // MERGE * MERGE)
            row_grids.append((t, h, w))
        n_image = sum(t * h * w // MERGE**2 for t, h, w in row_grids)
        n_text = length - pad - n_image - 2 * images_per_row
        if n_text < images_per_row + 1:
            raise ValueError(f"length {length} too short for {images_per_row} images per row")
        cuts = torch.randperm(n_text - 1, generator=g)[:images_per_row].sort().values + 1
        bounds = [0, *cuts.tolist(), n_text]
        row: list[torch.Tensor] = []
        for i in range(images_per_row + 1):
            row.append(torch.randint(0, 151000, (bounds[i + 1] - bounds[i],), generator=g))
            if i < images_per_row:
                t, h, w = row_grids[i]
                row.append(torch.tensor([VISION_START]))
                row.append(torch.full((t * h * w // MERGE**2,), IMAGE_PAD))
                row.append(torch.tensor([VISION_END]))
        ids[b, pad:] = torch.cat(row)
        mask[b, pad:] = 1
        grids.extend(row_grids)
    return ids, torch.tensor(grids, dtype=torch.long), mask


def run(opts: H.Options, rep: H.Reporter) -> None:
    import transformers

    if int(transformers.__version__.split(".")[0]) != 4:
        raise SystemExit(f"bench_positions needs transformers 4.x (the 4.57.6 overlay), found "
                         f"{transformers.__version__}; run it through benchmarks/run.py")
    from types import SimpleNamespace

    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    import posenc_torch

    stand_in = SimpleNamespace(config=Qwen2VLConfig())

    def hf(ids, grids, mask):
        return Qwen2VLModel.get_rope_index(stand_in, ids, grids, None, mask)

    for b, length, images in SHAPES[opts.suite]:
        ids, grids, mask = make_prompts(b, length, images)
        ids, grids, mask = ids.to(opts.device), grids.to(opts.device), mask.to(opts.device)
        ref = hf(ids, grids, mask)

        def build(name, ids=ids, grids=grids, mask=mask):
            if name == "posenc":
                fn = getattr(posenc_torch, "compute_mrope_position_ids", None)
                if fn is None:
                    raise NotImplementedError(
                        "posenc_torch.compute_mrope_position_ids is not in this build yet "
                        "(it is being added separately); rerun once it is merged")
                return H.Workload(lambda: fn(
                    ids, grids, None, mask, model="qwen2_vl", image_token_id=IMAGE_PAD,
                    video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                    spatial_merge_size=MERGE))
            if name == "hf_eager":
                return H.Workload(lambda: hf(ids, grids, mask))
            if name == "hf_compile":
                raise NotImplementedError(
                    "get_rope_index walks rows and tokens in Python (.tolist(), list.index, "
                    ".item()) with data-dependent shapes: torch.compile breaks the graph at "
                    "every step, so there is no compiled peer worth timing")
            if name == "copy":
                raise NotImplementedError(
                    "no q/k tensors here: position ids are an index computation, so there "
                    "is no copy floor")
            raise KeyError(name)

        case = _case(opts, b, length, images)
        for res in H.run_case(case, METHOD_NAMES, build, ref, opts.policy, exact=True,
                              transformers_version=transformers.__version__):
            rep.add(res, f"{case.name} {res.method}")


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
