"""MRoPE position ids: compute_mrope_position_ids against transformers' get_rope_index.

Reference: ``Qwen2VLModel.get_rope_index`` of the transformers that the part runs under,
called unbound on a stand-in holding a default ``Qwen2VLConfig``:

- part "qwen2_vl": transformers 4.57.6 (the .venv/hf4 overlay; run.py starts the part in
  its own process with the overlay first on PYTHONPATH, see bench_mrope.py for why),
  vision runs found from vision-start + placeholder tokens;
- part "qwen2_vl_5x": the transformers 5.x of the environment, vision runs from
  ``mm_token_type_ids``.

posenc_torch: ``compute_mrope_position_ids(input_ids, image_grid_thw, None, attention_mask,
model="qwen2_vl", convention="installed", mm_token_type_ids=..., image_token_id=...,
video_token_id=..., vision_start_token_id=..., spatial_merge_size=2)`` -> ``(position_ids
(3, B, L), deltas (B, 1))``, under the same transformers' rules.  Both results must be equal
(values and dtypes) before anything is timed.

Cases: B=8, L=8192 with 4 images per row (odd rows left-padded), and B=1, L=1024 with one
image.  Forward only (integer outputs have no gradient).

Run alone: ``python benchmarks/bench_positions.py [--full]`` (goes through run.py).
"""

from __future__ import annotations

import sys

import torch

import harness as H

TOPIC = "positions"
PARTS = {"qwen2_vl": 4, "qwen2_vl_5x": 5}

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 151652, 151653, 151655, 151656
MERGE = 2
# (batch, length, images per row)
SHAPES = {"quick": ((8, 8192, 4), (1, 1024, 1)), "full": ((8, 8192, 4), (1, 1024, 1)),
          "smoke": ((2, 256, 1),)}
GRIDS = ((1, 64, 64), (1, 48, 80), (1, 56, 72), (1, 80, 48))  # patch grids (t, h, w)
METHOD_NAMES = ("posenc", "hf_eager", "hf_compile", "copy")


def _case(opts, b, length, images) -> H.Case:
    return H.Case(TOPIC, "mrope_position_ids", "Qwen2-VL-7B", b, length, "int64", "fwd",
                  opts.threads, opts.device,
                  f"images={images}/row,transformers{PARTS.get(opts.part, '?')}")


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

    if opts.part not in PARTS:
        raise ValueError(f"unknown part {opts.part!r}; parts: {sorted(PARTS)}")
    major = int(transformers.__version__.split(".")[0])
    if major != PARTS[opts.part]:
        raise SystemExit(f"bench_positions part {opts.part!r} needs transformers "
                         f"{PARTS[opts.part]}.x, found {transformers.__version__}; run it through "
                         "benchmarks/run.py (it puts .venv/hf4 on PYTHONPATH for 4.x)")
    from types import SimpleNamespace

    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    import posenc_torch

    stand_in = SimpleNamespace(config=Qwen2VLConfig())
    if "get_vision_position_ids" in vars(Qwen2VLModel):  # 5.x: get_rope_index calls it
        stand_in.get_vision_position_ids = Qwen2VLModel.get_vision_position_ids.__get__(stand_in)
    get_rope_index = Qwen2VLModel.get_rope_index.__get__(stand_in)

    for b, length, images in SHAPES[opts.suite]:
        ids, grids, mask = make_prompts(b, length, images)
        ids, grids, mask = ids.to(opts.device), grids.to(opts.device), mask.to(opts.device)
        types = (ids == IMAGE_PAD).long() + 2 * (ids == VIDEO_PAD).long()
        if major >= 5:
            hf = lambda ids=ids, grids=grids, mask=mask, types=types: get_rope_index(  # noqa: E731
                ids, types, grids, None, mask)
        else:
            hf = lambda ids=ids, grids=grids, mask=mask: get_rope_index(  # noqa: E731
                ids, grids, None, mask)
        ref = hf()

        def build(name, ids=ids, grids=grids, mask=mask, types=types, hf=hf):
            if name == "posenc":
                return H.Workload(lambda: posenc_torch.compute_mrope_position_ids(
                    ids, grids, None, mask, model="qwen2_vl", convention="installed",
                    mm_token_type_ids=types, image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
                    vision_start_token_id=VISION_START, spatial_merge_size=MERGE))
            if name == "hf_eager":
                return H.Workload(hf)
            if name == "hf_compile":
                raise NotImplementedError(
                    "get_rope_index walks rows and tokens in Python (.tolist(), groupby or "
                    "list.index, .item()) with data-dependent shapes: torch.compile breaks the "
                    "graph at every step, so there is no compiled peer worth timing")
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
