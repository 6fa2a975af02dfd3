"""A training step on a padded batch against the same examples packed (topic ``packing``).

A small Qwen2-VL (Qwen2-VL-2B's text shapes scaled down to fit a small CPU: 2 decoder
layers, hidden 256, 2 query heads and 1 kv head of head_dim 128 with the real M-RoPE
sections [16, 24, 24], MLP 1536, vocabulary 8192; a 2-block vision tower), fp32, random
weights.  16 examples whose token lengths are drawn (seeded) from the long-tailed
distribution in ``data/packing_lengths.json``; every other example of 32 tokens or more
holds an image of 16 tokens (patch grid (1, 8, 8)).  Two methods, one forward + backward
each (the gradients of the summed token loss with respect to every weight; the optimizer
step is the same for both and not timed):

- ``padded``: the 16 examples right-padded to the longest, with an attention mask (what a
  padding collator gives; the model computes the 3-D position ids itself);
- ``packed``: the same examples laid end to end in one row by
  ``posenc_torch.packing.pack_multimodal_examples`` (no padding, per-example position ids,
  block-diagonal attention built by transformers from them).

Before timing, the harness checks that both give the same gradients (so the packed step
computes the same training signal).  The figure of merit is real (non-padding) tokens per
second; the case name carries the real token count and the padding share of the padded
batch.  Note: sdpa on a CPU computes the packed row's full L x L attention and masks it, so
packing saves the padded share of the matrix products but not of the attention; with
flash-attention's varlen kernels (GPU) the attention shrinks too.

``python benchmarks/bench_packing_train.py --summary RESULTS.json`` prints the tokens per
second of a results file.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import harness as H
import torch

_TOPIC = "packing"  # a case of bench_packing's topic (CASE_MODULES there)
PARTS = {"train": 5}
MODEL = "Qwen2-VL-scaled"
LENGTHS = Path(__file__).resolve().parent / "data" / "packing_lengths.json"
IMAGE, VIDEO, VISION_START, VISION_END = 8000, 8001, 8002, 8003
GRID = (1, 8, 8)  # an image's patch grid: 16 tokens after the 2x2 merge
# (examples per step, text config, vision config) per suite; smoke is the harness's own test
SIZES = {
    "quick": (16, dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=128, intermediate_size=1536, num_hidden_layers=2,
                       vocab_size=8192), dict(depth=2, embed_dim=160, num_heads=2)),
    "smoke": (4, dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, intermediate_size=128, num_hidden_layers=1,
                      vocab_size=8192), dict(depth=1, embed_dim=32, num_heads=2)),
}
SIZES["full"] = SIZES["quick"]
SMOKE_MAX = 48  # smoke: lengths 8 to 47, so that a step takes milliseconds

# The two ways of batching, registered with the harness's method table.
H.METHODS.setdefault("padded", H.Method("padded", "padded batch + attention mask", "peer"))
H.METHODS.setdefault("packed", H.Method("packed", "posenc_torch.packing: one packed row",
                                        "posenc"))
H.PRIMARY.setdefault("packed", 3)


def example_lengths(suite: str) -> list[int]:
    """The token lengths of one step's examples: drawn with a fixed seed from the file."""
    n = SIZES[suite][0]
    lengths = random.Random(0).sample(json.loads(LENGTHS.read_text())["lengths"], n)
    return [8 + x % (SMOKE_MAX - 8) for x in lengths] if suite == "smoke" else lengths


def _case(opts: H.Options) -> H.Case:
    lengths = example_lengths(opts.suite)
    real, longest = sum(lengths), max(lengths)
    share = 1 - real / (len(lengths) * longest)
    return H.Case(_TOPIC, "train_step", MODEL, len(lengths), longest, "fp32", "fwdbwd",
                  opts.threads, opts.device, extra=f"real={real},pad={100 * share:.0f}%")


def plan(opts: H.Options):
    return [(_case(opts), ("padded", "packed"))]


def build_model(suite: str, device: str):
    import transformers
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    _, text, vision = SIZES[suite]
    rope = {"rope_type": "default", "mrope_section": [16, 24, 24] if text["head_dim"] == 128
            else [4, 6, 6]}
    rope_key = "rope_parameters" if int(transformers.__version__.split(".")[0]) >= 5 \
        else "rope_scaling"
    text = dict(text, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                pad_token_id=2, **{rope_key: rope})
    vision = dict(vision, hidden_size=text["hidden_size"], mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                           video_token_id=VIDEO, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).to(device).train()
    return model


def make_examples(model, lengths: list[int]) -> list[dict]:
    """One example per length, as a processor returns it; every other one of 32 tokens or
    more has an image."""
    import transformers

    gen = torch.Generator().manual_seed(1)
    vc = model.config.vision_config
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    image_tokens = GRID[0] * GRID[1] * GRID[2] // vc.spatial_merge_size ** 2
    out = []
    for i, n in enumerate(lengths):
        with_image = i % 2 == 0 and n >= 32
        text = n - (image_tokens + 2 if with_image else 0)
        ids = torch.randint(3, 7000, (text,), generator=gen)
        if with_image:
            ids = torch.cat([ids[:text // 4], torch.tensor([VISION_START]),
                             torch.full((image_tokens,), IMAGE), torch.tensor([VISION_END]),
                             ids[text // 4:]])
        ex = dict(input_ids=ids[None], attention_mask=torch.ones(1, n, dtype=torch.int64))
        if with_image:
            ex["pixel_values"] = torch.randn(GRID[0] * GRID[1] * GRID[2], patch_dim,
                                             generator=gen)
            ex["image_grid_thw"] = torch.tensor([GRID])
        if int(transformers.__version__.split(".")[0]) >= 5:
            ex["mm_token_type_ids"] = (ids == IMAGE).long()[None]
        out.append(ex)
    return out


def padded_batch(examples: list[dict], pad_token_id: int) -> dict:
    """The examples right-padded to the longest, with an attention mask and labels -100 on
    the padding, as a padding collator makes them."""
    longest = max(ex["input_ids"].shape[1] for ex in examples)

    def pad(key, value):
        return torch.stack([torch.nn.functional.pad(ex[key][0], (0, longest - ex[key].shape[1]),
                                                    value=value) for ex in examples])

    batch = dict(input_ids=pad("input_ids", pad_token_id), attention_mask=pad("attention_mask", 0))
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    if "mm_token_type_ids" in examples[0]:
        batch["mm_token_type_ids"] = pad("mm_token_type_ids", 0)
    with_images = [ex for ex in examples if "pixel_values" in ex]
    if with_images:
        batch["pixel_values"] = torch.cat([ex["pixel_values"] for ex in with_images])
        batch["image_grid_thw"] = torch.cat([ex["image_grid_thw"] for ex in with_images])
    batch["use_cache"] = False
    return batch


def summed_loss(model, batch: dict) -> torch.Tensor:
    """The model's token-mean loss times its token count: the summed token loss."""
    count = (batch["labels"][:, 1:] != -100).sum()
    return model(**batch).loss * count


def run(opts: H.Options, rep: H.Reporter) -> None:
    import transformers

    from posenc_torch.packing import pack_multimodal_examples

    case = _case(opts)
    model = build_model(opts.suite, opts.device)
    examples = make_examples(model, example_lengths(opts.suite))
    to_device = lambda b: {k: v.to(opts.device) if isinstance(v, torch.Tensor) else v  # noqa: E731
                           for k, v in b.items()}
    pad_token_id = model.config.get_text_config().pad_token_id
    batches = {"padded": to_device(padded_batch(examples, pad_token_id)),
               "packed": to_device(pack_multimodal_examples(examples, model))}
    params = [p for p in model.parameters() if p.requires_grad]
    used = [p for p, g in zip(params, torch.autograd.grad(
        summed_loss(model, batches["padded"]), params, allow_unused=True), strict=True)
        if g is not None]
    one = torch.ones((), device=opts.device)
    reference = torch.autograd.grad(summed_loss(model, batches["padded"]), used)

    def build(method: str) -> H.Workload:
        batch = batches[method]
        return H.Workload(lambda: (summed_loss(model, batch),), wrt=used, grad_outputs=(one,))

    results = H.run_case(case, ("padded", "packed"), build, reference, opts.policy,
                         transformers_version=transformers.__version__)
    for res in results:
        rep.add(res, f"{case.name} {res.method}")
    for line in format_summary(summarize([res.to_dict() for res in results])).splitlines():
        print(line, flush=True)


# ---------------------------------------------------------------------------------------
# Summary: real tokens per second.


def summarize(results: list[dict]) -> list[dict]:
    """Per case of this topic: tokens per second of real tokens, padded and packed, the
    padding share of the padded batch, and the ratio packed / padded."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in results:
        if r.get("topic") == _TOPIC and r.get("op") == "train_step" and r.get("status") == "ok":
            key = (r["device"], r["threads"], r["batch"], r["seq"], r["extra"])
            by_case.setdefault(key, {})[r["method"]] = r
    rows = []
    for (device, threads, batch, seq, extra), methods in sorted(by_case.items()):
        fields = dict(item.split("=", 1) for item in extra.split(","))
        real = int(fields["real"])
        row = {"device": device, "threads": threads, "examples": batch, "real_tokens": real,
               "padded_slots": batch * seq, "padding_share": 1 - real / (batch * seq)}
        for method in ("padded", "packed"):
            r = methods.get(method)
            row[f"{method}_ms"] = r["median_ms"] if r else None
            row[f"{method}_tokens_per_s"] = real / (r["median_ms"] / 1e3) if r else None
        row["packed_over_padded"] = (row["packed_tokens_per_s"] / row["padded_tokens_per_s"]
                                     if row["packed_ms"] and row["padded_ms"] else None)
        rows.append(row)
    return rows


def format_summary(rows: list[dict]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [f"{MODEL} training step (forward + backward, fp32): real tokens per second"]
    for r in rows:
        lines.append(
            f"  {r['device']} thr={r['threads']}: {r['examples']} examples, {r['real_tokens']} "
            f"real tokens; padded batch {r['padded_slots']} slots ({100 * r['padding_share']:.0f}%"
            f" padding): {f(r['padded_ms'], '.0f')} ms, {f(r['padded_tokens_per_s'], '.0f')} "
            f"tok/s; packed: {f(r['packed_ms'], '.0f')} ms, "
            f"{f(r['packed_tokens_per_s'], '.0f')} tok/s; packed / padded "
            f"{f(r['packed_over_padded'], '.2f')}x")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--summary":
        print(format_summary(summarize(json.loads(Path(sys.argv[2]).read_text())["results"])))
        sys.exit(0)
    sys.exit("usage: bench_packing_train.py --summary RESULTS.json (the case itself runs in "
             "topic packing: benchmarks/run.py --topics packing)")
