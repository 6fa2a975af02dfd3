"""Packed (padding-free) Qwen-VL batches: ``posenc_torch.packing`` against each example run
alone, on tiny random-weight Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE models (the
configs of tests/test_hf_positions.py), eager and sdpa attention, fp32, with and without
``posenc_torch.hf.patch()``.  ``make test`` runs this file under transformers 5.17.0,
4.57.6, 5.18.0 and 5.25.0.

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
- under flash-attention (transformers' own dispatch down to its varlen call, with a CPU
  function that attends within each ``cu_seqlens`` segment standing in for the kernel),
  batches of one row and of several rows give every example its logits alone, and several
  rows without ``cu_seq_lens_*`` would not;
- under ``posenc_torch.hf.patch``, the guard around the model forward names exactly the
  calls whose examples attend to each other (a cache, an added attention mask, several
  rows under flash-attention without the boundaries), each warned once, and resolves
  ``use_cache`` as transformers does (off under gradient checkpointing in training);
- the whole batch is one call of the packed walk, also when an example is at fault, and
  its errors name the example by its index in ``examples``;
- bad input raises errors naming the example and the key;
- real clients: TRL's ``SFTTrainer`` with a PEFT LoRA adapter and ``transformers.Trainer``,
  with the collator, start from the loss of the same examples run alone;
- the padded-vs-packed training-step benchmark checks equal gradients before timing.
"""

from __future__ import annotations

import contextlib
import importlib

import importlib.util
import math
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
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
from posenc_torch import _attention_leaks, packing
from posenc_torch.hf import _handle
from posenc_torch.packing import (
    IGNORE_INDEX,
    MultimodalPackingCollator,
    first_fit,
    pack_multimodal_examples,
    packed_attention_leaks,
    warn_packed_attention_leaks,
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


def placements(examples: list[dict], batch: dict) -> dict[int, tuple[int, int, int]]:
    """{example index: (row, start, length)}, read off the packed batch itself: each row of
    ``batch["input_ids"]`` must parse as whole examples laid end to end from its first
    token (each found by its token ids, exactly one candidate at each step), then padding;
    every example must be found once."""
    ids = batch["input_ids"]
    tokens = [torch.as_tensor(ex["input_ids"]).reshape(-1) for ex in examples]
    left, where = set(range(len(examples))), {}
    for r in range(ids.shape[0]):
        at = 0
        while True:
            fits = [k for k in sorted(left) if len(tokens[k]) and at + len(tokens[k])
                    <= ids.shape[1] and torch.equal(ids[r, at:at + len(tokens[k])], tokens[k])]
            if not fits:
                break
            assert len(fits) == 1, f"row {r} at {at}: examples {fits} all match"
            where[fits[0]] = (r, at, len(tokens[fits[0]]))
            left.discard(fits[0])
            at += len(tokens[fits[0]])
    assert not left, f"examples {sorted(left)} not found in the batch"
    return where


def row_order(where: dict[int, tuple[int, int, int]]) -> list[list[int]]:
    """The examples of each row, in the order they are laid out."""
    rows: dict[int, list[int]] = {}
    for k in sorted(where, key=lambda k: where[k][:2]):
        rows.setdefault(where[k][0], []).append(k)
    return [rows[r] for r in sorted(rows)]


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
# first_fit: stated placements, and the rule's invariants on any lengths.


@pytest.mark.parametrize("lengths,max_tokens,rows", [
    ([5, 3, 4, 2, 6], 8, [[0, 1], [2, 3], [4]]),
    ([6, 6, 2, 2, 1], 8, [[0, 2], [1, 3], [4]]),  # the 2s go back to the first two rows
    ([1, 7, 1, 7], 8, [[0, 1], [2, 3]]),
    ([4, 4, 4], 4, [[0], [1], [2]]),
    ([3, 0, 4], 4, [[0, 1], [2]]),  # an empty example fits any row
    ([2, 9, 2, 9, 3], 10, [[0, 2, 4], [1], [3]]),
    ([5, 5, 5], None, [[0, 1, 2]]),
    ([], 8, []),
    ([], None, []),
])
def test_first_fit_places_as_stated(lengths, max_tokens, rows):
    assert first_fit(lengths, max_tokens) == rows


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 12), max_size=30), st.integers(1, 16))
def test_first_fit_invariants(lengths, max_tokens):
    lengths = [min(n, max_tokens) for n in lengths]
    rows = first_fit(lengths, max_tokens)
    placed = [k for row in rows for k in row]
    assert sorted(placed) == list(range(len(lengths)))  # every example placed once
    for r, row in enumerate(rows):
        assert row and row == sorted(row)  # no empty row; examples keep their order
        assert sum(lengths[k] for k in row) <= max_tokens  # capacity
        # opened by its first example, which fit in no earlier row at that point
        assert r == 0 or row[0] > rows[r - 1][0]
        for k in row:
            for earlier in rows[:r]:
                assert sum(lengths[j] for j in earlier if j < k) + lengths[k] > max_tokens


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
    rows = row_order(placements(examples, batch))
    images = [k for row in rows for k in row if "image_grid_thw" in examples[k]]
    assert len(rows) == 2 and images != sorted(images), rows
    assert batch["input_ids"].shape[1] % MULTIPLE == 0 and batch["use_cache"] is False
    assert "attention_mask" not in batch
    # two rows: the flash-attention boundaries come with the batch (eager and sdpa ignore
    # them, as this test's equality shows)
    assert batch["cu_seq_lens_q"][-1] == batch["input_ids"].numel()

    worst = 0.0
    for k, (r, start, n) in placements(examples, batch).items():
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
    """Several rows carry the boundaries by default (one row does not: transformers reads
    them from its position ids); they equal transformers' reading of the rows laid end to
    end, each row's padding a sequence of its own."""
    model = tiny_model("qwen2_vl")
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    examples = make_examples("qwen2_vl", model.config)
    batch = pack_multimodal_examples(examples, model, max_tokens=MAX_TOKENS, pad_to_multiple_of=16)
    (cu_q, _), (max_q, _) = prepare_fa_kwargs_from_position_ids(batch["position_ids"][0])
    assert torch.equal(batch["cu_seq_lens_q"], cu_q) and batch["max_length_q"] == int(max_q)
    assert torch.equal(batch["cu_seq_lens_k"], cu_q) and batch["max_length_k"] == int(max_q)
    assert len(cu_q) - 1 == len(examples) + 2  # each row ends in padding
    one_row = pack_multimodal_examples(examples, model)
    assert one_row["input_ids"].shape[0] == 1 and "cu_seq_lens_q" not in one_row
    never = pack_multimodal_examples(examples, model, max_tokens=MAX_TOKENS,
                                     return_flash_attn_kwargs=False)
    assert never["input_ids"].shape[0] == 2 and "cu_seq_lens_q" not in never


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_position_ids_are_get_rope_index_of_each_example(model_type):
    model = tiny_model(model_type)
    examples = make_examples(model_type, model.config)
    batch = pack_multimodal_examples(examples, model, max_tokens=MAX_TOKENS,
                                     pad_to_multiple_of=MULTIPLE)
    pos = batch["position_ids"]
    assert pos.dtype == torch.int64 and pos.shape == (4, *batch["input_ids"].shape)
    for k, (r, start, n) in placements(examples, batch).items():
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
    for r, start, n in placements(examples, batch).values():
        ends[r] = max(ends.get(r, 0), start + n)
    assert any(end < pos.shape[2] for end in ends.values())
    for r, end in ends.items():
        pad = pos.shape[2] - end
        assert torch.equal(pos[:, r, end:], torch.arange(pad).expand(4, pad))
        assert (batch["labels"][r, end:] == IGNORE_INDEX).all()


def drop_one(example: dict, token: int) -> dict:
    """The example without its first ``token`` (a vision run one token short of its grid)."""
    keep = torch.ones(example["input_ids"].shape[1], dtype=torch.bool)
    keep[(example["input_ids"][0] == token).nonzero()[0]] = False
    return {k: v[:, keep] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
            for k, v in example.items()}


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_one_walk_of_the_batch_and_errors_that_name_the_example(model_type, monkeypatch):
    """Packing walks the whole batch in one call of the packed walk (counted by a wrapper
    that calls it through) and never an example alone, also when an example is at fault:
    the walk itself names it ``examples[i]``, its index in ``examples`` (not its place in
    the rows), and speaks of that example alone.  The ids it gives are transformers'
    ``get_rope_index`` of each example; the grids and seconds follow the rows."""
    model = tiny_model(model_type)
    examples = make_examples(model_type, model.config)
    calls = []
    walk = packing._packed_for_examples

    def counted(*args, **kwargs):
        calls.append(1)
        return walk(*args, **kwargs)

    def alone(*args, **kwargs):
        raise AssertionError("an example was walked on its own")

    posenc_torch.positions.resolve_convention("installed", model_type)  # decided by walks
    monkeypatch.setattr(packing, "_packed_for_examples", counted)
    monkeypatch.setattr(posenc_torch.positions, "compute_mrope_position_ids", alone)
    monkeypatch.setattr(posenc_torch, "compute_mrope_position_ids", alone)
    batch = pack_multimodal_examples(examples, model, max_tokens=MAX_TOKENS)
    assert len(calls) == 1
    for k, (r, start, n) in placements(examples, batch).items():
        assert torch.equal(batch["position_ids"][1:, r, start:start + n],
                           transformers_rope_index(model, examples[k])), k
    order = [k for row in row_order(placements(examples, batch)) for k in row]
    assert order != sorted(order)
    for key in ("image_grid_thw", "video_grid_thw") + (
            ("second_per_grid_ts",) if model_type == "qwen2_5_vl" else ()):
        want = torch.cat([torch.as_tensor(examples[k][key]) for k in order if key in examples[k]])
        assert torch.equal(batch[key], want), key

    # examples[1] (the second example, in the first row after examples[0]) one token short
    calls.clear()
    short = drop_one(examples[1], IMAGE)
    token_name = "mm_token_type_ids == 1" if V5 else "image_token_id"
    with pytest.raises(ValueError, match=rf"^examples\[1\]: image_grid_thw\[0\] = \(1, 4, 8\) "
                                         rf"needs 8 {token_name} tokens .* has 7$"):
        pack_multimodal_examples([examples[0], short, examples[2]], model, max_tokens=MAX_TOKENS)
    assert len(calls) == 1
    # examples[0] brings a second grid (with its pixels) for its one image: named as its own
    # error, not as a run of a later example that the grid would shift onto
    two = dict(examples[0], image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]),
               pixel_values=examples[0]["pixel_values"].repeat(2, 1))
    with pytest.raises(ValueError, match=r"^examples\[0\]: image_grid_thw has 2 rows, but "
                                         r"input_ids has 1 images"):
        pack_multimodal_examples([two, examples[3], examples[1]], model)
    # a bad grid value is named with the example that owns it
    bad = dict(examples[3], image_grid_thw=torch.tensor([[1, 2, 3]]),
               pixel_values=examples[3]["pixel_values"].repeat(2, 1)[:6])
    with pytest.raises(ValueError, match=r"^examples\[1\]: image_grid_thw\[0\] = \(1, 2, 3\) "
                                         r"is not a valid patch grid"):
        pack_multimodal_examples([examples[4], bad], model)


def transformers_rope_index(model, example: dict) -> torch.Tensor:
    """(3, n) T/H/W ids of one example alone from the model's own ``get_rope_index``."""
    inputs = alone_inputs(example)
    kw = {key: inputs.get(key) for key in ("input_ids", "image_grid_thw", "video_grid_thw",
                                           "attention_mask")}
    if model.config.model_type == "qwen2_5_vl":
        kw["second_per_grid_ts"] = inputs.get("second_per_grid_ts")
    if V5:
        kw["mm_token_type_ids"] = inputs["mm_token_type_ids"]
    return model.model.get_rope_index(**kw)[0][:, 0].long()


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


# ---------------------------------------------------------------------------------------
# Flash-attention, through transformers' own dispatch: the model is set to
# "flash_attention_2" and transformers' flash-attention helpers are handed CPU functions in
# place of the kernels (the lazy import that would load flash_attn), so everything above
# the kernel (the attention interface, the mask functions, _flash_attention_forward's
# choice between position ids, cu_seq_lens_* and an attention mask, the reshapes) is
# transformers' code.


def cpu_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                               max_seqlen_k=None, dropout_p=0.0, softmax_scale=None,
                               causal=False, window_size=(-1, -1), softcap=0.0,
                               deterministic=False):
    """flash_attn_varlen_func's contract on the CPU: q (total_q, Hq, D), k and v
    (total_k, Hkv, D); attention within each [cu[i], cu[i + 1]) segment only, causal
    aligned to the bottom right as flash-attention does (equal lengths here)."""
    assert dropout_p == 0.0 and window_size == (-1, -1) and not softcap
    CPU_FLASH_CALLS.append(len(cu_seqlens_q) - 1)
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    bounds = zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(),
                 cu_seqlens_k[:-1].tolist(), cu_seqlens_k[1:].tolist(), strict=True)
    for q0, q1, k0, k1 in bounds:
        assert q1 - q0 == k1 - k0
        qs = q[q0:q1].transpose(0, 1)
        ks, vs = (x[k0:k1].transpose(0, 1).repeat_interleave(groups, 0) for x in (k, v))
        out[q0:q1] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal,
                                                    scale=softmax_scale).transpose(0, 1)
    return out


def cpu_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, deterministic=False):
    """flash_attn_func: (B, L, H, D), every row one sequence."""
    b, n = q.shape[:2]
    cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32)
    flat = [x.reshape(b * n, *x.shape[2:]) for x in (q, k, v)]
    return cpu_flash_attn_varlen_func(*flat, cu, cu, n, n, dropout_p, softmax_scale, causal,
                                      window_size, softcap, deterministic).view(q.shape)


CPU_FLASH_CALLS: list[int] = []


@pytest.fixture
def cpu_flash_attention(monkeypatch):
    """transformers' flash-attention path with the CPU functions above as its kernels."""
    from transformers import modeling_flash_attention_utils as fa

    # 4.57 returns four functions, 5.x five (with flash_attn_with_kvcache)
    five = hasattr(fa, "_flash_with_kvcache_fn")

    def lazy_imports(*args, **kwargs):
        pair = (fa._pad_input, fa._unpad_input)
        return (cpu_flash_attn_func, cpu_flash_attn_varlen_func, None, *pair) if five \
            else (cpu_flash_attn_func, cpu_flash_attn_varlen_func, *pair)

    monkeypatch.setattr(fa, "_lazy_imports", lazy_imports)
    for name in ("_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                 "_unpad_fn", "_process_flash_kwargs_fn", "_loaded_implementation"):
        if hasattr(fa, name):
            monkeypatch.setattr(fa, name, None)
    CPU_FLASH_CALLS.clear()

    def flash_model(model_type: str):
        model = tiny_model(model_type)
        for config in (model.config, model.config.text_config, model.config.vision_config):
            config._attn_implementation = "flash_attention_2"
        return model
    return flash_model


def text_examples(seed: int = 7) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 100, (1, n), generator=gen)}
            for n in (5, 17, 30, 2, 44, 9)]


def worst_packed_vs_alone(model, examples: list[dict], max_tokens, **pack_kw) -> float:
    batch = pack_multimodal_examples(examples, model, max_tokens=max_tokens, **pack_kw)
    with torch.no_grad():
        logits = model(**batch).logits
        worst = 0.0
        for k, (r, start, n) in placements(examples, batch).items():
            alone = model(**alone_inputs(examples[k]), use_cache=False).logits[0]
            worst = max(worst, rel_err(logits[r, start:start + n], alone))
    return worst


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_flash_attention_keeps_the_examples_of_every_row_apart(model_type, cpu_flash_attention):
    """One row (boundaries read from position_ids[0]) and several rows (the batch's
    cu_seq_lens_*): every example gets its logits alone under flash-attention.  Without the
    boundaries several rows let the examples of a row attend to each other; that the test
    sees this shows the varlen path and its segments are what decides."""
    model = cpu_flash_attention(model_type)
    vision, text = make_examples(model_type, model.config), text_examples()
    assert worst_packed_vs_alone(model, vision, None) <= TOL
    assert CPU_FLASH_CALLS and max(CPU_FLASH_CALLS) == len(vision)  # one row's segments
    assert worst_packed_vs_alone(model, text, MAX_TOKENS) <= TOL
    leaks = [worst_packed_vs_alone(model, exs, MAX_TOKENS, return_flash_attn_kwargs=False)
             for exs in (text, vision)]
    print(f"\n{model_type} flash-attention, two rows without cu_seq_lens: largest relative "
          f"logit difference to the examples alone {leaks[0]:.2f} (text), {leaks[1]:.2f} "
          "(vision)")
    assert min(leaks) > 1e-3
    # transformers 5.17 and 5.18 hand the model's keyword arguments on to the vision tower,
    # whose flash-attention call passes its own cu_seq_lens_q besides: loud, and what
    # docs/packing.md tells (one row there; 4.57.6 and 5.25.0 take them); the text rows
    # above are kept apart
    hands_on = transformers.__version__.startswith(("5.17.", "5.18."))
    try:
        worst = worst_packed_vs_alone(model, vision, MAX_TOKENS)
    except TypeError as e:
        assert hands_on, f"docs/packing.md says transformers {transformers.__version__} takes them"
        assert "multiple values for keyword argument 'cu_seq_lens_q'" in str(e), e
        print(f"\n{model_type} transformers {transformers.__version__}: {e}")
    else:
        assert not hands_on, f"docs/packing.md says transformers {transformers.__version__} raises"
        assert worst <= TOL


# ---------------------------------------------------------------------------------------
# packed_attention_leaks: what a transformers integration calls with the model's arguments.


def padding_mask(batch: dict) -> dict:
    """The 0/1 mask a padded batch would carry: 0 on the padding after the row's examples."""
    text = batch["position_ids"][0]
    assert text.shape[0] == 1
    starts = (text[0] == 0).nonzero().flatten().tolist()
    mask = torch.ones_like(batch["input_ids"])
    mask[0, starts[-1]:] = 0  # the last sequence of the row is its padding
    return {"attention_mask": mask}


def shifted_boundaries(batch: dict) -> dict:
    """The batch's flash-attention boundaries with one inside a row moved by a token."""
    cu = batch["cu_seq_lens_q"].clone()
    length = batch["input_ids"].shape[1]
    inner = [i for i in range(1, cu.numel() - 1) if int(cu[i]) % length]
    cu[inner[0]] += 1
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}


def block_mask(batch: dict) -> torch.Tensor:
    """A 4-D boolean mask that keeps each example to itself (causal inside it), from the
    text positions: the caller's own mask."""
    example = (batch["position_ids"][0] == 0).cumsum(-1)  # (B, L)
    length = example.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return (example[:, :, None] == example[:, None, :]) & causal  # (B, L, L)


@contextlib.contextmanager
def leak_guard(model_type: str, found: list, monkeypatch):
    """``posenc_torch.hf.patch`` of the model type, whose guard around the Qwen-VL model
    forward checks every call; the reasons of each call go to ``found``."""
    from posenc_torch.hf import _packing_guard

    real = _packing_guard.warn_packed_attention_leaks

    def recording(*args, **kwargs):
        reasons = real(*args, **kwargs)
        found.append(reasons)
        return reasons

    monkeypatch.setattr(_packing_guard, "warn_packed_attention_leaks", recording)
    with hf.patch(model_type):
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        owner = next(c for c in vars(module).values() if isinstance(c, type)
                     and c.__module__ == module.__name__ and "get_rope_index" in vars(c))
        assert _handle.original_of(vars(owner)["forward"]) is not vars(owner)["forward"]
        yield


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_attention_leaks, "_WARNED", set())


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_leak_warnings_name_exactly_the_calls_that_leak(model_type, cpu_flash_attention,
                                                       fresh_warnings, monkeypatch):
    """Under ``posenc_torch.hf.patch``, each call: whether the examples get their logits
    alone, against whether the guard found a reason; each reason is warned once.  Several rows under flash-attention use text
    examples (see the test above for transformers 5.17 and 5.18 with vision inputs there)."""
    import warnings

    sdpa = tiny_model(model_type)
    flash = cpu_flash_attention(model_type)
    examples = make_examples(model_type, sdpa.config)
    ones = lambda b: {"attention_mask": torch.ones_like(b["input_ids"])}  # noqa: E731
    cases = [  # (name, model, examples, max_tokens, pack keywords, extra model arguments)
        ("sdpa", sdpa, examples, MAX_TOKENS, {}, lambda b: {}),
        ("sdpa cache", sdpa, examples, MAX_TOKENS, {}, lambda b: {"use_cache": True}),
        # use_cache not given: the config's (True), as the model calls it directly
        ("sdpa config cache", sdpa, examples, None, {}, lambda b: {"use_cache": None}),
        ("sdpa mask", sdpa, examples, None, {}, ones),
        ("flash one row", flash, examples, None, {}, lambda b: {}),
        ("flash rows", flash, text_examples(), MAX_TOKENS, {}, lambda b: {}),
        ("flash rows, no boundaries", flash, text_examples(), MAX_TOKENS,
         {"return_flash_attn_kwargs": False}, lambda b: {}),
        ("flash mask", flash, text_examples(), None, {}, ones),  # dropped there: no leak
        ("flash mask with padding", flash, text_examples(), None, {"pad_to_multiple_of": 8},
         padding_mask),
        ("flash rows, wrong boundaries", flash, text_examples(), MAX_TOKENS, {},
         shifted_boundaries),
        ("sdpa without the text row", sdpa, examples, MAX_TOKENS, {},
         lambda b: {"position_ids": b["position_ids"][1:]}),
        ("sdpa block mask, cache", sdpa, examples, MAX_TOKENS, {},
         lambda b: {"attention_mask": block_mask(b)[:, None], "use_cache": True}),
    ]
    found: list[list[str]] = []
    warned = []
    with leak_guard(model_type, found, monkeypatch):
        for name, model, exs, max_tokens, pack_kw, extra in cases:
            batch = pack_multimodal_examples(exs, model, max_tokens=max_tokens, **pack_kw)
            found.clear()
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                logits = model(**{**batch, **extra(batch)}).logits
            reasons = found[0]
            warned += [str(w.message) for w in caught if "packed position ids" in str(w.message)]
            worst = 0.0
            with torch.no_grad():
                for k, (r, start, n) in placements(exs, batch).items():
                    alone = model(**alone_inputs(exs[k]), use_cache=False).logits[0]
                    worst = max(worst, rel_err(logits[r, start:start + n], alone))
            assert (worst > 1e-3) == bool(reasons), (name, worst, reasons)
            assert worst <= TOL or worst > 1e-3, (name, worst)
    # each reason warned once, though found in several calls
    assert sorted(warned) == sorted([_attention_leaks.CACHE_LEAK, _attention_leaks.MASK_LEAK,
                                     _attention_leaks.FLASH_LEAK, _attention_leaks.BOUNDARY_LEAK,
                                     _attention_leaks.TEXT_ROW_LEAK])


def test_packed_attention_leaks_reasons():
    leaks = _attention_leaks
    cache, mask, flash_rows = leaks.CACHE_LEAK, leaks.MASK_LEAK, leaks.FLASH_LEAK
    bounds, text_row, split = leaks.BOUNDARY_LEAK, leaks.TEXT_ROW_LEAK, leaks.SPLIT_LEAK
    packed = torch.cat([torch.arange(5), torch.arange(3), torch.arange(2)]).expand(4, 1, 10)
    plain = torch.arange(10).expand(4, 1, 10)
    two_rows = packed.expand(4, 2, 10)
    cu = torch.tensor([0, 5, 8, 10, 15, 18, 20], dtype=torch.int32)
    ones = torch.ones(1, 10, dtype=torch.long)
    assert packed_attention_leaks(packed) == []
    assert packed_attention_leaks(packed, use_cache=True) == [cache]
    assert packed_attention_leaks(plain, use_cache=True) == []
    assert packed_attention_leaks(packed, attention_mask=ones) == [mask]
    assert packed_attention_leaks(packed, attention_mask=ones.float()) == [mask]
    four_d = torch.zeros(1, 1, 10, 10)  # the caller's own mask: never a reason
    assert packed_attention_leaks(packed, attention_mask=four_d) == []
    assert packed_attention_leaks(packed, attention_mask=four_d, use_cache=True) == []
    # left padding of a plain row is no example (the mask's zeros are skipped)
    left = torch.tensor([[1, 1, 1, 0, 1, 2, 3, 4, 5, 6]]).expand(4, 1, 10)
    pad = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    assert packed_attention_leaks(left, attention_mask=pad) == []
    assert packed_attention_leaks(left, attention_mask=pad.bool()) == []
    assert packed_attention_leaks(left, attention_mask=pad, use_cache=True) == []
    fa = dict(attn_implementation="flash_attention_2")
    assert packed_attention_leaks(two_rows, **fa) == [flash_rows]
    assert packed_attention_leaks(two_rows, cu_seq_lens_q=cu, cu_seq_lens_k=cu, **fa) == []
    # boundaries other than the examples': one off, one missing, another batch's
    for wrong in ([0, 4, 8, 10, 15, 18, 20], [0, 5, 10, 15, 18, 20], [0, 5, 8, 10]):
        wrong = torch.tensor(wrong, dtype=torch.int32)
        assert packed_attention_leaks(two_rows, cu_seq_lens_q=wrong, cu_seq_lens_k=wrong,
                                      **fa) == [bounds]
    assert packed_attention_leaks(two_rows, cu_seq_lens_q=cu, **fa) == [flash_rows]  # no k
    assert packed_attention_leaks(packed, **fa) == []  # one row: read from position ids
    assert packed_attention_leaks(two_rows, attn_implementation="sdpa") == []
    # flash-attention drops a mask of all ones (no leak), and unpads by one that holds a 0
    assert packed_attention_leaks(packed, attention_mask=ones, **fa) == []
    padded = ones.clone()
    padded[0, -1] = 0
    assert packed_attention_leaks(packed, attention_mask=padded, **fa) == [mask]
    assert packed_attention_leaks(two_rows, use_cache=True, attention_mask=padded.expand(2, 10),
                                  **fa) == [cache, mask]
    assert packed_attention_leaks(packed, use_cache=True, **fa) == [cache]  # the cache joins
    # without the text row (the model then finds no packed sequences)
    assert packed_attention_leaks(packed[0]) == [text_row]
    assert packed_attention_leaks(packed[1:]) == [text_row]
    assert packed_attention_leaks(packed[0], use_cache=True) == [cache]
    assert packed_attention_leaks(packed[1:], **fa) == [text_row]
    # an example's text positions with a gap: transformers splits it there
    gap = packed.clone()
    gap[0, 0, 3:5] += 1
    assert packed_attention_leaks(gap) == [split]
    # MRoPE rows that stay at one value over an image are no new example
    image = torch.tensor([[0, 1, 2, 2, 2, 2, 4, 5, 0, 1]]).expand(3, 1, 10)
    assert packed_attention_leaks(torch.cat([torch.arange(10).view(1, 1, 10), image])) == []
    assert packed_attention_leaks(None, use_cache=True) == []


def test_leak_warnings_come_once(fresh_warnings):
    packed = torch.cat([torch.arange(5), torch.arange(3)]).expand(4, 1, 8)
    with pytest.warns(UserWarning, match="KV cache"):
        assert warn_packed_attention_leaks(packed, use_cache=True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_packed_attention_leaks(packed, use_cache=True)  # found, not warned again


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
    for k, (r, start, n) in placements(examples, batch).items():
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
        ({"attention_mask": image["attention_mask"]}, TypeError,  # a missing input
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
           "5.17.0, 5.18.0 and 5.25.0")


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


def test_gradient_checkpointing_in_training_turns_the_cache_off(fresh_warnings, monkeypatch):
    """use_cache left to the config (True) is no leak when the language model checkpoints
    in training: transformers turns the cache off there, and so does the guard."""
    model = tiny_model("qwen2_vl")
    examples = make_examples("qwen2_vl", model.config)
    batch = pack_multimodal_examples(examples, model)
    batch["use_cache"] = None
    found: list[list[str]] = []
    with leak_guard("qwen2_vl", found, monkeypatch):
        model.gradient_checkpointing_enable()
        model.train()
        try:
            model(**batch)
        finally:
            model.gradient_checkpointing_disable()
            model.eval()
        model(**batch)
    assert found == [[], [_attention_leaks.CACHE_LEAK]]
