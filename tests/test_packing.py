"""Packed (padding-free) Qwen-VL batches: ``posenc_torch.packing`` against each example run
alone, on tiny random-weight Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE models (the
configs of tests/test_hf_positions.py), eager and sdpa attention, fp32, with and without
``posenc_torch.hf.patch()``.  ``make test`` runs this file under transformers 5.17.0,
4.57.6, 5.18.0 and 5.24.0.

Six examples as a processor returns them (image + video, image, image + a video of
fractional seconds per grid, a small image, text only given as lists, one token), packed
into two rows by first fit (so the images follow the row order, not the example order) and
padded to a multiple of 8:

- the packed forward gives every example the logits it gets alone (relative 1e-5; the
  largest difference per model is printed and recorded as a test property);
- the packed batch's loss times its label count equals the summed token loss of the
  examples alone, and every parameter gradient agrees (relative 1e-5 per parameter);
- rows 1-3 of ``position_ids`` equal transformers' ``get_rope_index`` of each example alone;
- without the batch's ``use_cache=False`` the examples attend across their boundaries;
- bad input raises errors naming the example and the key;
- real clients: TRL's ``SFTTrainer`` with a PEFT LoRA adapter and ``transformers.Trainer``,
  with the collator, start from the loss of the same examples run alone;
- the padded-vs-packed training-step benchmark checks equal gradients before timing.
"""

from __future__ import annotations

import importlib.util
import math
import types

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_hf_positions import (
    IMAGE,
    MODEL_TYPES,
    V5,
    VIDEO,
    VISION_END,
    VISION_START,
    WALK,
)
from test_hf_positions import tiny_model as tiny_vl_model

import posenc_torch
import posenc_torch.hf as hf
from posenc_torch.packing import (
    IGNORE_INDEX,
    MultimodalPackingCollator,
    _packed_position_ids_loop,
    _read_example,
    _settings,
    first_fit,
    pack_multimodal_examples,
)

pytestmark = pytest.mark.any_transformers

TOL = 1e-5
MAX_TOKENS = 50  # two rows; the images of examples 2 and 3 change places
MULTIPLE = 8


def tiny_model(model_type: str, attn: str = "sdpa"):
    model = tiny_vl_model(model_type)
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    return model


def make_examples(model_type: str, config, seed: int = 1) -> list[dict]:
    """Examples as a Qwen-VL processor returns them one by one (batch dimension 1)."""
    gen = torch.Generator().manual_seed(seed)
    vc = config.vision_config
    merge = vc.spatial_merge_size
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    qwen3 = WALK[model_type] == "qwen3_vl"

    def text(n: int) -> list[int]:
        return torch.randint(3, 100, (n,), generator=gen).tolist()

    def example(parts: list, seconds: list[float] | None = None) -> dict:
        ids, images, videos = [], [], []
        for part in parts:
            if isinstance(part, int):
                ids += text(part)
            elif part[0] == "image":
                _, h, w = part
                images.append((1, h, w))
                ids += [VISION_START] + [IMAGE] * (h * w // merge ** 2) + [VISION_END]
            else:
                _, t, h, w = part
                videos.append((t, h, w))
                if qwen3:  # per frame: <timestamp> <vision_start> frame <vision_end>
                    for _ in range(t):
                        ids += text(2) + [VISION_START] + [VIDEO] * (h * w // merge ** 2) \
                            + [VISION_END]
                else:
                    ids += [VISION_START] + [VIDEO] * (t * h * w // merge ** 2) + [VISION_END]
        input_ids = torch.tensor([ids])
        out = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        if images:
            out["pixel_values"] = torch.randn(sum(t * h * w for t, h, w in images), patch_dim,
                                              generator=gen)
            out["image_grid_thw"] = torch.tensor(images)
        if videos:
            out["pixel_values_videos"] = torch.randn(sum(t * h * w for t, h, w in videos),
                                                     patch_dim, generator=gen)
            out["video_grid_thw"] = torch.tensor(videos)
            if model_type == "qwen2_5_vl":
                out["second_per_grid_ts"] = torch.tensor(seconds)
        if V5:
            out["mm_token_type_ids"] = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
        return out

    examples = [
        example([2, ("image", 4, 4), 1, ("video", 2, 4, 4), 3], seconds=[1.5]),
        example([4, ("image", 4, 8), 3]),
        example([2, ("image", 2, 2), ("video", 3, 4, 4), 2], seconds=[2 / 3]),
        example([2, ("image", 2, 2)]),
        example([9]),
        example([1]),
    ]
    # one example as plain lists, as a dataset without tensors holds it
    examples[4] = {key: value.tolist() for key, value in examples[4].items()}
    return examples


def alone_inputs(example: dict) -> dict:
    out = {}
    for key, value in example.items():
        value = torch.as_tensor(value)
        out[key] = value[None] if key in ("input_ids", "attention_mask", "mm_token_type_ids") \
            and value.dim() == 1 else value
    return out


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over the tokens of the next-token cross entropy (one row)."""
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=IGNORE_INDEX,
                           reduction="sum")


def placements(examples: list[dict]) -> dict[int, tuple[int, int, int]]:
    """{example index: (row, start, length)} of the packed batch."""
    lengths = [len(torch.as_tensor(ex["input_ids"]).reshape(-1)) for ex in examples]
    where = {}
    for r, row in enumerate(first_fit(lengths, MAX_TOKENS)):
        at = 0
        for k in row:
            where[k] = (r, at, lengths[k])
            at += lengths[k]
    return where


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def run_alone_and_packed(model, examples: list[dict], **pack_kw):
    """Logits per example alone and packed, the summed losses, and the gradients of both."""
    params = [p for p in model.parameters() if p.requires_grad]
    alone_logits, total = [], 0.0
    for ex in examples:
        inputs = alone_inputs(ex)
        logits = model(**inputs, use_cache=False).logits[0]
        alone_logits.append(logits.detach())
        total = total + summed_token_loss(logits, inputs["input_ids"][0])
    alone_grads = torch.autograd.grad(total, params, allow_unused=True)

    batch = pack_multimodal_examples(examples, model, **pack_kw)
    out = model(**batch)
    count = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    packed = out.loss * count
    packed_grads = torch.autograd.grad(packed, params, allow_unused=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return dict(batch=batch, logits=out.logits.detach(), alone_logits=alone_logits,
                alone_loss=total.detach(), packed_loss=packed.detach(), count=count.item(),
                grads={n: (a, b) for n, a, b in zip(names, alone_grads, packed_grads,
                                                    strict=True)})


# ---------------------------------------------------------------------------------------
# The packed forward and backward equal the examples run alone.


@pytest.mark.parametrize("patched", [False, True], ids=["transformers", "posenc-patch"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_packed_equals_examples_alone(model_type, attn, patched, record_property):
    model = tiny_model(model_type, attn)
    examples = make_examples(model_type, model.config)
    with hf.patch(model_type) if patched else _no_patch() as handle:
        res = run_alone_and_packed(model, examples, max_tokens=MAX_TOKENS,
                                   pad_to_multiple_of=MULTIPLE)
    batch = res["batch"]
    rows = first_fit([len(torch.as_tensor(ex["input_ids"]).reshape(-1)) for ex in examples],
                     MAX_TOKENS)
    images = [k for row in rows for k in row if "image_grid_thw" in examples[k]]
    assert len(rows) == 2 and images != sorted(images), rows
    assert batch["input_ids"].shape[1] % MULTIPLE == 0 and batch["use_cache"] is False
    assert "attention_mask" not in batch

    worst = 0.0
    for k, (r, start, n) in placements(examples).items():
        err = rel_err(res["logits"][r, start:start + n], res["alone_logits"][k])
        worst = max(worst, err)
        assert err <= TOL, f"examples[{k}]: packed logits differ from alone by {err:.2e}"
    print(f"\n{model_type} {attn} {'patched' if patched else 'unpatched'}: largest packed-vs-"
          f"alone logit difference {worst:.2e} (relative to the largest logit)")
    record_property("max_logit_rel_diff", worst)

    assert res["count"] == sum(len(torch.as_tensor(ex["input_ids"]).reshape(-1)) - 1
                               for ex in examples)
    assert math.isclose(res["packed_loss"].item(), res["alone_loss"].item(), rel_tol=TOL)
    checked = 0
    for name, (alone, packed) in res["grads"].items():
        if alone is None:
            assert packed is None, name
            continue
        scale = alone.abs().max().item()
        assert (packed - alone).abs().max().item() <= TOL * max(scale, 1e-30), name
        checked += 1
    assert checked > 0
    if patched:
        assert sum(handle.calls.values()) > 0 and not any(handle.fallbacks.values()), handle


class _no_patch:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_one_row_and_flash_attention_kwargs(model_type):
    """max_tokens None: one row, no padding; the flash-attention lengths equal what
    transformers derives from the row-0 positions, and sdpa ignores them."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    model = tiny_model(model_type)
    examples = make_examples(model_type, model.config, seed=2)
    batch = pack_multimodal_examples(examples, model.config, return_flash_attn_kwargs=True)
    lengths = [len(torch.as_tensor(ex["input_ids"]).reshape(-1)) for ex in examples]
    assert batch["input_ids"].shape == (1, sum(lengths))
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch["position_ids"][0])
    assert torch.equal(batch["cu_seq_lens_q"], cu_q) and torch.equal(batch["cu_seq_lens_k"], cu_k)
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == int(max_q) == max(lengths) == batch["max_length_k"]
    with torch.no_grad():
        logits = model(**batch).logits[0]
        at = 0
        for ex, n in zip(examples, lengths, strict=True):
            alone = model(**alone_inputs(ex), use_cache=False).logits[0]
            assert rel_err(logits[at:at + n], alone) <= TOL
            at += n


def test_flash_attention_kwargs_count_the_padding_as_a_sequence():
    model = tiny_model("qwen2_vl")
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    examples = make_examples("qwen2_vl", model.config)
    batch = pack_multimodal_examples(examples, model, max_tokens=MAX_TOKENS, pad_to_multiple_of=16,
                                     return_flash_attn_kwargs=True)
    (cu_q, _), (max_q, _) = prepare_fa_kwargs_from_position_ids(batch["position_ids"][0])
    assert torch.equal(batch["cu_seq_lens_q"], cu_q) and batch["max_length_q"] == int(max_q)
    assert len(cu_q) - 1 == len(examples) + 2  # each row ends in padding


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_position_ids_are_get_rope_index_of_each_example(model_type):
    model = tiny_model(model_type)
    examples = make_examples(model_type, model.config)
    batch = pack_multimodal_examples(examples, model, max_tokens=MAX_TOKENS,
                                     pad_to_multiple_of=MULTIPLE)
    pos = batch["position_ids"]
    assert pos.dtype == torch.int64 and pos.shape == (4, *batch["input_ids"].shape)
    for k, (r, start, n) in placements(examples).items():
        inputs = alone_inputs(examples[k])
        kw = {key: inputs.get(key) for key in ("input_ids", "image_grid_thw", "video_grid_thw",
                                               "attention_mask")}
        if model_type == "qwen2_5_vl":
            kw["second_per_grid_ts"] = inputs.get("second_per_grid_ts")
        if V5:
            kw["mm_token_type_ids"] = inputs["mm_token_type_ids"]
        theirs, _ = model.model.get_rope_index(**kw)
        assert torch.equal(pos[1:, r, start:start + n], theirs[:, 0].long()), k
        assert torch.equal(pos[0, r, start:start + n], torch.arange(n)), k
    # the padding after each row's last example counts from 0: a sequence of its own
    ends = {}
    for r, start, n in placements(examples).values():
        ends[r] = max(ends.get(r, 0), start + n)
    assert any(end < pos.shape[2] for end in ends.values())
    for r, end in ends.items():
        pad = pos.shape[2] - end
        assert torch.equal(pos[:, r, end:], torch.arange(pad).expand(4, pad))
        assert (batch["labels"][r, end:] == IGNORE_INDEX).all()


def test_packed_function_agrees_with_the_loop():
    """The one-call packed position ids equal the per-example loop (packing's way of naming
    the example at fault) on every example token."""
    for model_type in MODEL_TYPES:
        model = tiny_model(model_type)
        examples = make_examples(model_type, model.config, seed=3)
        batch = pack_multimodal_examples(examples, model, max_tokens=MAX_TOKENS,
                                         pad_to_multiple_of=MULTIPLE)
        settings = _settings(model)
        exs = [_read_example(i, ex, settings) for i, ex in enumerate(examples)]
        rows = first_fit([ex.input_ids.numel() for ex in exs], MAX_TOKENS)
        convention = posenc_torch.positions.resolve_convention("installed", model_type)
        loop = _packed_position_ids_loop(exs, rows, batch["input_ids"].shape[1], settings,
                                         convention)
        for r, row in enumerate(rows):
            n = sum(exs[k].input_ids.numel() for k in row)
            assert torch.equal(batch["position_ids"][:, r, :n], loop[:, r, :n]), model_type


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_arguments_given_to_the_packed_function(model_type, monkeypatch):
    """Packing calls compute_packed_mrope_position_ids once with
    the rows' example lengths and the grids and seconds in row order (a stand-in records the
    call here); an error it raises is re-raised, naming the culprit by its index in
    ``examples`` when one example alone is at fault."""
    model = tiny_model(model_type)
    examples = make_examples(model_type, model.config)
    expected = pack_multimodal_examples(examples, model, max_tokens=MAX_TOKENS)
    calls = []

    def stand_in(input_ids, seq_lens, image_grid_thw=None, video_grid_thw=None, **kw):
        calls.append(dict(kw, input_ids=input_ids, seq_lens=seq_lens,
                          image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw))
        return expected["position_ids"].clone()

    monkeypatch.setattr(posenc_torch, "compute_packed_mrope_position_ids", stand_in,
                        raising=False)
    batch = pack_multimodal_examples(examples, model, max_tokens=MAX_TOKENS)
    assert torch.equal(batch["position_ids"], expected["position_ids"]) and len(calls) == 1
    call = calls[0]
    rows = first_fit([len(torch.as_tensor(ex["input_ids"]).reshape(-1)) for ex in examples],
                     MAX_TOKENS)
    assert call["seq_lens"] == [[len(torch.as_tensor(examples[k]["input_ids"]).reshape(-1))
                                 for k in row] for row in rows]
    assert torch.equal(call["input_ids"], batch["input_ids"])
    order = [k for row in rows for k in row]
    for key in ("image_grid_thw", "video_grid_thw"):
        want = torch.cat([torch.as_tensor(examples[k][key]) for k in order if key in examples[k]])
        assert torch.equal(call[key], want) and torch.equal(batch[key], want), key
    assert call["model"] == model_type and call["spatial_merge_size"] == 2
    if model_type == "qwen2_5_vl":
        want = torch.cat([examples[k]["second_per_grid_ts"] for k in order
                          if "second_per_grid_ts" in examples[k]])
        assert torch.equal(call["second_per_grid_ts"], want)
        assert torch.equal(batch["second_per_grid_ts"], want)

    def refusing(*args, **kw):
        raise ValueError("example 3 of the batch: a vision run is cut")

    monkeypatch.setattr(posenc_torch, "compute_packed_mrope_position_ids", refusing)
    with pytest.raises(ValueError, match="a vision run is cut"):
        pack_multimodal_examples(examples, model, max_tokens=MAX_TOKENS)
    keep = torch.ones(examples[1]["input_ids"].shape[1], dtype=torch.bool)
    keep[(examples[1]["input_ids"][0] == IMAGE).nonzero()[0]] = False
    bad = {k: v[:, keep] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
           for k, v in examples[1].items()}
    with pytest.raises(ValueError, match=r"examples\[1\].*image_grid_thw"):
        pack_multimodal_examples([examples[0], bad], model)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_the_cache_would_let_examples_attend_across(model_type):
    """Why the batch holds use_cache=False: with a cache transformers builds no
    block-diagonal mask, and the later examples of a row see the earlier ones."""
    model = tiny_model(model_type)
    examples = make_examples(model_type, model.config)
    batch = pack_multimodal_examples(examples, model)
    with torch.no_grad():
        isolated = model(**batch).logits[0]
        leaky = model(**{**batch, "use_cache": True}).logits[0]
        first = model(**alone_inputs(examples[0]), use_cache=False).logits[0]
        alone = model(**alone_inputs(examples[1]), use_cache=False).logits[0]
    n0, n1 = first.shape[0], alone.shape[0]
    assert rel_err(isolated[n0:n0 + n1], alone) <= TOL
    assert rel_err(leaky[n0:n0 + n1], alone) > 1e-3
    assert rel_err(leaky[:n0], first) <= TOL  # the first example has nothing before it


def test_collator_and_labels():
    model = tiny_model("qwen2_vl")
    examples = make_examples("qwen2_vl", model.config)
    examples[0] = dict(examples[0], labels=examples[0]["input_ids"].masked_fill(
        examples[0]["input_ids"] >= IMAGE, IGNORE_INDEX))
    collator = MultimodalPackingCollator(model.config, max_tokens=MAX_TOKENS,
                                         pad_to_multiple_of=MULTIPLE)
    batch = collator(examples)
    again = pack_multimodal_examples(examples, model.config, max_tokens=MAX_TOKENS,
                                     pad_to_multiple_of=MULTIPLE)
    assert batch.keys() == again.keys()
    for key, value in batch.items():
        assert torch.equal(value, again[key]) if isinstance(value, torch.Tensor) \
            else value == again[key]
    for k, (r, start, n) in placements(examples).items():
        want = torch.as_tensor(examples[k].get("labels", examples[k]["input_ids"])).reshape(-1)
        got = batch["labels"][r, start:start + n]
        assert got[0] == IGNORE_INDEX and torch.equal(got[1:], want[1:]), k
        assert torch.equal(batch["input_ids"][r, start:start + n],
                           torch.as_tensor(examples[k]["input_ids"]).reshape(-1))
    # inputs are not modified
    assert examples[0]["labels"][0, 0] != IGNORE_INDEX
    assert "qwen2_vl" in repr(collator)


def test_processor_padding_is_dropped():
    """An example whose attention mask has zeros (padded by its processor) packs as the
    example without them."""
    model = tiny_model("qwen2_vl")
    examples = make_examples("qwen2_vl", model.config)
    padded = dict(examples[2])
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in padded:
            fill = {"input_ids": 2, "attention_mask": 0, "mm_token_type_ids": 0}[key]
            padded[key] = torch.cat([torch.full((1, 3), fill), padded[key]], 1)
    a = pack_multimodal_examples([examples[0], padded], model)
    b = pack_multimodal_examples([examples[0], examples[2]], model)
    for key in b:
        assert torch.equal(a[key], b[key]) if isinstance(b[key], torch.Tensor) \
            else a[key] == b[key]


# ---------------------------------------------------------------------------------------
# Bad input: errors that name the example and the key.


def _bad_cases(config):
    ex = make_examples("qwen2_vl", config)
    image = ex[1]
    return [
        (dict(image, input_ids=torch.tensor([[1.0, 2.0]])), TypeError,
         r"examples\[1\]\['input_ids'\]"),
        (dict(image, labels=torch.tensor([[1, 2]])), ValueError, r"examples\[1\]\['labels'\]"),
        (dict(image, image_grid_thw=torch.tensor([[1, 4, 4]])), ValueError,
         r"examples\[1\]\['pixel_values'\].*image_grid_thw"),
        (dict(image, image_grid_thw=torch.tensor([[1, 4]])), ValueError,
         r"examples\[1\]\['image_grid_thw'\]"),
        (dict(image, image_grid_thw=torch.tensor([[1.0, 4.0, 8.0]])), TypeError,
         r"examples\[1\]\['image_grid_thw'\]"),
        (dict(image, pixel_values=image["pixel_values"].long()), TypeError,
         r"examples\[1\]\['pixel_values'\]"),
        (dict(image, pixel_values=image["pixel_values"][:, :-1]), ValueError,
         r"examples\[1\]\['pixel_values'\]"),
        ({k: v for k, v in image.items() if k != "pixel_values"}, ValueError,
         r"examples\[1\] has image_grid_thw but no pixel_values"),
        # two images' worth of grid rows and pixels for one run of image tokens
        (dict(image, image_grid_thw=torch.tensor([[1, 4, 8], [1, 2, 2]]),
              pixel_values=torch.cat([image["pixel_values"], image["pixel_values"][:4]])),
         ValueError, r"examples\[1\].*image_grid_thw"),
        (dict(image, input_ids=torch.tensor([[]], dtype=torch.long),
              attention_mask=torch.tensor([[]], dtype=torch.long),
              **({"mm_token_type_ids": torch.tensor([[]], dtype=torch.long)} if V5 else {})),
         ValueError, r"examples\[1\] has no tokens"),
        (dict(image, input_ids=image["input_ids"][0][None, None]), ValueError,
         r"examples\[1\]\['input_ids'\]"),
        (dict(image, second_per_grid_ts=torch.tensor([1.0])), ValueError,
         r"examples\[1\]\['second_per_grid_ts'\].*qwen2_5_vl"),
        ("not a mapping", TypeError, r"examples\[1\] must be a mapping"),
        ({"attention_mask": image["attention_mask"]}, ValueError,
         r"examples\[1\] has no 'input_ids'"),
    ]


@pytest.mark.parametrize("case", range(14))
def test_bad_example_names_the_example_and_key(case):
    config = tiny_model("qwen2_vl").config
    bad, error, match = _bad_cases(config)[case]
    good = make_examples("qwen2_vl", config)[1]
    with pytest.raises(error, match=match):
        pack_multimodal_examples([good, bad], config)


def test_bad_arguments():
    config = tiny_model("qwen2_vl").config
    examples = make_examples("qwen2_vl", config)
    with pytest.raises(ValueError, match=r"examples\[0\] has 22 tokens, more than max_tokens=20"):
        pack_multimodal_examples(examples, config, max_tokens=20)
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        pack_multimodal_examples(examples, config, max_tokens=8.0)
    with pytest.raises(ValueError, match="pad_to_multiple_of must be >= 1"):
        pack_multimodal_examples(examples, config, pad_to_multiple_of=0)
    with pytest.raises(ValueError, match="examples is empty"):
        pack_multimodal_examples([], config)
    with pytest.raises(TypeError, match="examples must be a list"):
        pack_multimodal_examples(examples[0], config)
    with pytest.raises(ValueError, match="convention must be"):
        pack_multimodal_examples(examples, config, convention="4.0")
    with pytest.raises(ValueError, match="config must be a Qwen-VL model or config"):
        pack_multimodal_examples(examples, transformers.LlamaConfig())
    with pytest.raises(ValueError, match="config must be a Qwen-VL model or config"):
        MultimodalPackingCollator(types.SimpleNamespace())
    # patch sizes that disagree between examples
    odd = dict(examples[2], pixel_values=examples[2]["pixel_values"].double())
    with pytest.raises(TypeError, match=r"examples\[1\]\['pixel_values'\].*dtype must agree"):
        pack_multimodal_examples([examples[0], odd], config)


def test_grid_that_disagrees_with_tokens_names_the_example():
    """A run of image tokens one short of its grid: the position walk refuses it, and the
    error names the example by its index in ``examples`` (not its place in the rows)."""
    config = tiny_model("qwen2_vl").config
    examples = make_examples("qwen2_vl", config)
    keep = torch.ones(examples[0]["input_ids"].shape[1], dtype=torch.bool)
    keep[(examples[0]["input_ids"][0] == IMAGE).nonzero()[0]] = False
    bad = {k: v[:, keep] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
           for k, v in examples[0].items()}
    with pytest.raises(ValueError, match=r"examples\[2\].*image_grid_thw"):
        pack_multimodal_examples([examples[4], examples[2], bad], config, max_tokens=30)


def test_qwen2_5_videos_without_seconds_beside_videos_with():
    model = tiny_model("qwen2_5_vl")
    examples = make_examples("qwen2_5_vl", model.config)
    without = {k: v for k, v in examples[2].items() if k != "second_per_grid_ts"}
    with pytest.raises(ValueError, match=r"examples\[1\] has videos but no second_per_grid_ts"):
        pack_multimodal_examples([examples[0], without], model.config)


# ---------------------------------------------------------------------------------------
# A real client: TRL's SFTTrainer with a PEFT LoRA adapter.


def _have(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def tiny_tokenizer():
    """A word-level tokenizer over the tiny models' 128 ids, built in memory (SFTTrainer
    wants a processing class; the dataset below is already tokenized)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(128)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
        pad_token="t2", eos_token="t1", unk_token="t3")


class RecordingCollator(MultimodalPackingCollator):
    """The packing collator, keeping the examples of every batch it made."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[list] = []

    def __call__(self, examples):
        self.calls.append(list(examples))
        return super().__call__(examples)


# transformers' Trainer imports `datasets` where it is installed; the datasets release that
# TRL 1.16 brings needs a newer huggingface_hub than the 0.36 of the 4.57.6 overlay.
TRAINER_NEEDS_5 = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="the transformers 4.57.6 overlay brings huggingface_hub 0.36, older than the "
           "datasets release (beside TRL 1.16) that Trainer imports; make test runs this under "
           "5.17.0, 5.18.0 and 5.24.0")


@TRAINER_NEEDS_5
@pytest.mark.skipif(not (_have("trl") and _have("peft") and _have("datasets")),
                    reason="needs trl, peft and datasets (requirements-dev.txt)")
def test_trl_sft_trainer_with_lora_and_the_packing_collator(tmp_path):
    """Three optimizer steps of TRL's SFTTrainer with a PEFT LoRA adapter on a tiny Qwen2-VL,
    fed by the packing collator from a pre-tokenized dataset (lists, as a dataset stores
    them).  The first step's loss equals the token-mean loss of the same examples run alone
    (LoRA starts as the identity: PEFT initialises B to zero); the adapter trains and the
    base weights do not.  fp32 throughout: ``bf16=False`` (SFTConfig's default bf16 autocast
    would change the arithmetic of the trained run only)."""
    import copy

    import datasets
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    model = tiny_model("qwen2_vl").train()
    reference = copy.deepcopy(model).eval()
    examples = make_examples("qwen2_vl", model.config, seed=4) \
        + make_examples("qwen2_vl", model.config, seed=5)
    rows = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in ex.items()}
            for ex in examples]
    dataset = datasets.Dataset.from_list(rows)
    collator = RecordingCollator(model.config, max_tokens=96, pad_to_multiple_of=8)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                     learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                     use_cpu=True, bf16=False, seed=0, gradient_checkpointing=False,
                     max_length=None, remove_unused_columns=False, dataloader_num_workers=0,
                     dataset_kwargs={"skip_prepare_dataset": True})
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                         processing_class=tiny_tokenizer(),
                         peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                target_modules=["q_proj", "v_proj"]))
    losses = []
    compute_loss = trainer.compute_loss

    def recording_compute_loss(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        losses.append(loss.detach().item())
        return loss

    trainer.compute_loss = recording_compute_loss
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                   if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                   if "lora_" in n}
    trainer.train()
    assert trainer.state.global_step == 3 and len(losses) == 3 and len(collator.calls) == 3
    assert all(math.isfinite(x) for x in losses)

    total, count = 0.0, 0
    with torch.no_grad():
        for ex in collator.calls[0]:
            inputs = {k: v for k, v in alone_inputs({k: v for k, v in ex.items() if v is not None})
                      .items()}
            logits = reference(**inputs, use_cache=False).logits[0]
            total += summed_token_loss(logits, inputs["input_ids"][0]).item()
            count += inputs["input_ids"].shape[1] - 1
    print(f"\nSFTTrainer + LoRA, packed: step losses {losses}; first step unpacked "
          f"{total / count:.6f}")
    assert math.isclose(losses[0], total / count, rel_tol=1e-5), (losses[0], total / count)
    params = dict(trainer.model.named_parameters())
    assert lora_before and any(not torch.equal(params[n], p) for n, p in lora_before.items())
    assert all(torch.equal(params[n], p) for n, p in base_before.items())


def test_training_step_benchmark_checks_the_gradients_before_timing():
    """benchmarks/bench_packing_train.py (smoke sizes): the padded and the packed step give
    the same gradients (the harness times a method only after that check) and the summary
    reports real tokens per second and the padding share."""
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import bench_packing_train as B
        import harness as H
    finally:
        sys.path.remove(str(bench))
    opts = H.Options("train", "smoke", torch.get_num_threads(), "cpu", None)
    (case, methods), = B.plan(opts)
    rep = H.Reporter(len(methods), to_driver=True)
    B.run(opts, rep)
    by = {r.method: r for r in rep.results}
    assert by.keys() == {"padded", "packed"}
    for r in by.values():
        assert r.status == "ok", r.reason
        assert r.max_rel_err <= H.VERIFY_TOL["fp32"]
    lengths = B.example_lengths("smoke")
    (row,) = B.summarize([r.to_dict() for r in rep.results])
    assert row["real_tokens"] == sum(lengths) and row["padded_slots"] == len(lengths) * max(lengths)
    assert row["packed_tokens_per_s"] > 0 and row["padded_tokens_per_s"] > 0


@TRAINER_NEEDS_5
def test_transformers_trainer_with_the_packing_collator(tmp_path):
    """transformers.Trainer with the collator as data_collator (examples from a plain list):
    two optimizer steps; the first step's loss is that of the same examples run alone."""
    import copy

    from transformers import Trainer, TrainingArguments

    model = tiny_model("qwen2_5_vl").train()
    reference = copy.deepcopy(model).eval()
    examples = make_examples("qwen2_5_vl", model.config, seed=6)
    collator = RecordingCollator(model, max_tokens=MAX_TOKENS, pad_to_multiple_of=MULTIPLE)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=3,
                             learning_rate=1e-3, save_strategy="no", report_to="none",
                             use_cpu=True, seed=0, remove_unused_columns=False,
                             dataloader_num_workers=0, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=collator)
    losses = []
    compute_loss = trainer.compute_loss

    def recording_compute_loss(*a, **kw):
        loss = compute_loss(*a, **kw)
        losses.append(loss.detach().item())
        return loss

    trainer.compute_loss = recording_compute_loss
    trainer.train()
    assert trainer.state.global_step == 2 and len(losses) == 2
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in collator.calls[0]:
            inputs = alone_inputs(ex)
            logits = reference(**inputs, use_cache=False).logits[0]
            total += summed_token_loss(logits, inputs["input_ids"][0]).item()
            count += inputs["input_ids"].shape[1] - 1
    assert math.isclose(losses[0], total / count, rel_tol=1e-5), (losses[0], total / count)
