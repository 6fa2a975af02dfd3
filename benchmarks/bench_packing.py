"""Packed (padding-free) batches: the position ids of a packed batch, posenc's one call
against the per-example loop over transformers' get_rope_index that trainers run today.

Case "packed_position_ids" (this module): 64 Qwen2.5-VL training examples, lengths drawn
log-uniformly from 128 to 4096 tokens (a third text-only, a third with images, a third with
a video of fractional seconds per grid), packed first-fit into rows of at most 65,536
tokens (padding after the last example of a row).

- posenc_torch: ``compute_packed_mrope_position_ids(input_ids, seq_lens, image_grid_thw,
  video_grid_thw, model="qwen2_5_vl", convention="installed", ...)`` -> (4, B, L) int64, one
  call into the C walk for the whole batch.
- hf_eager: for every example, ``Qwen2_5_VLModel.get_rope_index`` of the transformers the
  part runs under, called on the example alone (its tokens, its grids and seconds, a mask of
  ones; unbound, on a stand-in holding the config), its ids written into the (4, B, L)
  result beside the text positions 0..n-1; the padding gets 0, 1, 2, ... (what posenc gives
  it).  The per-example inputs are sliced before timing, as a collator has them.

Both results must be equal before anything is timed.  Parts: "qwen2_5_vl" under transformers
4.57.6 (the .venv/hf4 overlay), "qwen2_5_vl_5x" under the environment's 5.x.  Forward only.

Other cases of the topic live in their own modules, listed in ``CASE_MODULES`` (each with
``PARTS``, ``plan(opts)`` and ``run(opts, rep)`` as a topic module has them, but no
``TOPIC``: the topic is this module); a listed module that is not there is left out.

Run alone: ``python benchmarks/bench_packing.py [--full]`` (goes through run.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import random
import sys
import types

import torch

import harness as H

TOPIC = "packing"
CASE_MODULES = ("bench_packing_train",)

OWN_PARTS = {"qwen2_5_vl": 4, "qwen2_5_vl_5x": 5}
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 151652, 151653, 151655, 151656
PAD = 151643
MERGE = 2
TOKENS_PER_SECOND = 2  # the released Qwen2.5-VL checkpoints' vision_config value
# (examples, shortest, longest, row length)
SHAPES = {"quick": (64, 128, 4096, 65536), "full": (64, 128, 4096, 65536),
          "smoke": (8, 128, 512, 2048)}
METHOD_NAMES = ("posenc", "hf_eager", "hf_compile", "copy")


def _case_modules() -> list:
    here = [name for name in CASE_MODULES if importlib.util.find_spec(name) is not None]
    return [importlib.import_module(name) for name in here]


CASES = _case_modules()
PARTS = dict(OWN_PARTS)
for _module in CASES:
    for _part, _major in _module.PARTS.items():
        if PARTS.setdefault(_part, _major) != _major:
            raise ValueError(f"part {_part!r} of {_module.__name__} needs transformers "
                             f"{_major}, another case of the topic {PARTS[_part]}")


def _case(opts: H.Options, batch: int, length: int, examples: int) -> H.Case:
    return H.Case(TOPIC, "packed_position_ids", "Qwen2.5-VL-7B", batch, length, "int64", "fwd",
                  opts.threads, opts.device,
                  f"examples={examples},transformers{OWN_PARTS.get(opts.part, '?')}")


def _own_plan(opts: H.Options):
    n, lo, hi, row = SHAPES[opts.suite]
    batch, length = _rows_needed(make_examples(n, lo, hi), row)
    return [(_case(opts, batch, length, n), METHOD_NAMES)]


def plan(opts: H.Options):
    out = _own_plan(opts) if opts.part in OWN_PARTS else []
    for module in CASES:
        if opts.part in module.PARTS:
            out += module.plan(opts)
    return out


# ---------------------------------------------------------------------------------------
# Examples as the Qwen2.5-VL processor lays them out.


def _grid_tokens(grid) -> int:
    t, h, w = grid
    return t * h * w // MERGE**2


def make_examples(n: int, shortest: int, longest: int, seed: int = 0) -> list[dict]:
    """``n`` examples, lengths log-uniform in [shortest, longest]: by turns text-only, with
    images (1 to 3), with one video (2 to 8 temporal steps, 0.5, 2/3, 1 or 1.5 s per step).
    Each: ``ids`` (list), ``images`` / ``videos`` (lists of (t, h, w) patch grids),
    ``seconds`` (per video)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        size = int(round(math.exp(rng.uniform(math.log(shortest), math.log(longest)))))
        ids: list[int] = []
        images, videos, seconds = [], [], []

        def text(count: int) -> None:
            ids.extend(rng.randrange(0, 151000) for _ in range(count))

        kind = i % 3
        if kind == 1:
            for _ in range(rng.randint(1, 3)):
                budget = (size - len(ids)) // 2 - 2
                side = int(math.sqrt(max(budget, 1) * MERGE**2))
                h = max(MERGE, min(side, 2 * rng.randint(8, 40)) // MERGE * MERGE)
                w = max(MERGE, min(side * side // h, 2 * rng.randint(8, 40)) // MERGE * MERGE)
                if len(ids) + 4 + _grid_tokens((1, h, w)) > size:
                    break
                text(rng.randint(1, 3))
                images.append((1, h, w))
                ids += [VISION_START] + [IMAGE_PAD] * _grid_tokens((1, h, w)) + [VISION_END]
        elif kind == 2:
            t = rng.randint(2, 8)
            budget = max((size * 2 // 3) // t, 1)
            side = max(MERGE, int(math.sqrt(budget * MERGE**2)) // MERGE * MERGE)
            h, w = side, max(MERGE, budget * MERGE**2 // side // MERGE * MERGE)
            if _grid_tokens((t, h, w)) + 4 <= size:
                text(rng.randint(1, 3))
                videos.append((t, h, w))
                seconds.append(rng.choice([0.5, 2 / 3, 1.0, 1.5]))
                ids += [VISION_START] + [VIDEO_PAD] * _grid_tokens((t, h, w)) + [VISION_END]
        text(size - len(ids))
        out.append(dict(ids=ids, images=images, videos=videos, seconds=seconds))
    return out


def _rows_needed(examples: list[dict], row: int) -> tuple[int, int]:
    rows = _first_fit(examples, row)
    return len(rows), max(sum(len(examples[i]["ids"]) for i in r) for r in rows)


def _first_fit(examples: list[dict], row: int) -> list[list[int]]:
    """Example indices per row, as the packing collator places them (first fit, in order)."""
    from posenc_torch.packing import first_fit

    return first_fit([len(ex["ids"]) for ex in examples], row)


def pack(examples: list[dict], row: int):
    """The packed batch: ``(order, rows, input_ids (B, L), image_grid_thw, video_grid_thw,
    second_per_grid_ts)``, L the longest row; ``order`` lists the examples in batch order
    (row by row), the grids follow it."""
    rows = _first_fit(examples, row)
    L = max(sum(len(examples[i]["ids"]) for i in r) for r in rows)
    ids = torch.full((len(rows), L), PAD, dtype=torch.long)
    for b, r in enumerate(rows):
        row_ids = [t for i in r for t in examples[i]["ids"]]
        ids[b, :len(row_ids)] = torch.tensor(row_ids)
    order = [i for r in rows for i in r]
    images = [g for i in order for g in examples[i]["images"]]
    videos = [g for i in order for g in examples[i]["videos"]]
    seconds = [s for i in order for s in examples[i]["seconds"]]
    tensor = lambda g: torch.tensor(g, dtype=torch.long) if g else None  # noqa: E731
    return (order, rows, ids, tensor(images), tensor(videos),
            torch.tensor(seconds, dtype=torch.float32) if seconds else None)


def _stand_in(major: int):
    """get_rope_index of Qwen2.5-VL bound to an object holding the config it reads."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as modeling

    owner = next(v for v in vars(modeling).values() if isinstance(v, type)
                 and v.__module__ == modeling.__name__ and "get_rope_index" in vars(v))
    config = types.SimpleNamespace(
        vision_config=types.SimpleNamespace(spatial_merge_size=MERGE,
                                            tokens_per_second=TOKENS_PER_SECOND),
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START)
    obj = types.SimpleNamespace(config=config)
    if "get_vision_position_ids" in vars(owner):  # 5.x: get_rope_index calls it
        obj.get_vision_position_ids = vars(owner)["get_vision_position_ids"].__get__(obj)
    return vars(owner)["get_rope_index"].__get__(obj)


def per_example_loop(examples: list[dict], rows: list[list[int]], batch_shape, major: int):
    """What a trainer runs today: get_rope_index on every example alone, the ids written
    into the packed (4, B, L) layout.  Returns the callable; its per-example inputs are
    built here, outside any timing."""
    get_rope_index = _stand_in(major)
    calls = []
    for b, r in enumerate(rows):
        start = 0
        for i in r:
            ex = examples[i]
            ids = torch.tensor([ex["ids"]])
            kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                      image_grid_thw=torch.tensor(ex["images"]) if ex["images"] else None,
                      video_grid_thw=torch.tensor(ex["videos"]) if ex["videos"] else None,
                      second_per_grid_ts=(torch.tensor(ex["seconds"], dtype=torch.float32)
                                          if ex["seconds"] else None))
            if major >= 5:
                kw["mm_token_type_ids"] = ((ids == IMAGE_PAD).int() + 2 * (ids == VIDEO_PAD).int())
            calls.append((b, start, ids.shape[1], kw))
            start += ids.shape[1]

    def run():
        out = torch.empty((4, *batch_shape), dtype=torch.long)
        ends = {}
        for b, start, n, kw in calls:
            pos, _ = get_rope_index(**kw)
            out[0, b, start:start + n] = torch.arange(n)
            out[1:, b, start:start + n] = pos[:, 0]
            ends[b] = start + n
        for b in range(batch_shape[0]):
            end = ends.get(b, 0)
            out[:, b, end:] = torch.arange(batch_shape[1] - end)
        return out

    return run


def _run_own(opts: H.Options, rep: H.Reporter) -> None:
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major != OWN_PARTS[opts.part]:
        raise SystemExit(f"bench_packing part {opts.part!r} needs transformers "
                         f"{OWN_PARTS[opts.part]}.x, found {transformers.__version__}; run it "
                         "through benchmarks/run.py (it puts .venv/hf4 on PYTHONPATH for 4.x)")
    import posenc_torch

    n, lo, hi, row = SHAPES[opts.suite]
    examples = make_examples(n, lo, hi)
    order, rows, ids, images, videos, seconds = pack(examples, row)
    types_ = (ids == IMAGE_PAD).long() + 2 * (ids == VIDEO_PAD).long()
    seq_lens = [[len(examples[i]["ids"]) for i in r] for r in rows]
    hf = per_example_loop(examples, rows, tuple(ids.shape), major)
    ref = hf()

    def build(name):
        if name == "posenc":
            return H.Workload(lambda: posenc_torch.compute_packed_mrope_position_ids(
                ids, seq_lens, images, videos, model="qwen2_5_vl", convention="installed",
                mm_token_type_ids=types_, image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
                vision_start_token_id=VISION_START, spatial_merge_size=MERGE,
                second_per_grid_ts=seconds, tokens_per_second=TOKENS_PER_SECOND))
        if name == "hf_eager":
            return H.Workload(hf)
        if name == "hf_compile":
            raise NotImplementedError(
                "get_rope_index walks tokens in Python with data-dependent shapes; "
                "torch.compile breaks the graph at every step, so there is no compiled peer")
        if name == "copy":
            raise NotImplementedError(
                "no q/k tensors here: position ids are an index computation, so there is no "
                "copy floor")
        raise KeyError(name)

    case = _case(opts, ids.shape[0], ids.shape[1], n)
    for res in H.run_case(case, METHOD_NAMES, build, ref, opts.policy, exact=True,
                          transformers_version=transformers.__version__):
        rep.add(res, f"{case.name} {res.method}")


def run(opts: H.Options, rep: H.Reporter) -> None:
    if opts.part in OWN_PARTS:
        _run_own(opts, rep)
    for module in CASES:
        if opts.part in module.PARTS:
            module.run(opts, rep)


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
