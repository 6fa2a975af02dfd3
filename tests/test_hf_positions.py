"""Qwen-VL position ids against the ``get_rope_index`` of whichever transformers is
installed: ``make test`` runs this file under 5.17.0 (.venv), 4.57.6, 5.18.0 and the newest
5.x (overlays).

- ``compute_mrope_position_ids(convention="installed")`` and the ``get_rope_index`` that
  ``posenc_torch.hf.patch()`` installs give transformers' own result bit for bit (values,
  dtypes, shapes), with ``handle.calls`` counting the walk, on prompts with several images
  and videos per row, long videos (many frames of a small grid), fractional seconds per
  grid, left and right padding, rows without vision tokens, batch 1 and 8; for
  qwen2_vl, qwen2_5_vl, qwen3_vl and qwen3_vl_moe.  transformers' function is called on a
  stand-in holding the model's default config (no weights).
- Calls the walk does not take go to transformers (``handle.fallbacks``), results equal.
- Tiny random-weight models: the patched model's prefill position ids, deltas and logits,
  and the tokens of ``generate``, equal the unpatched ones; the decode helper gives what the
  model computes from its stored ``rope_deltas``.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import random
import types

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForImageTextToText

import posenc_torch.hf as hf
from posenc_torch.hf import _handle
from posenc_torch import compute_mrope_decode_position_ids, compute_mrope_position_ids
from posenc_torch.positions import convention_for_version

pytestmark = pytest.mark.any_transformers

CONVENTION = convention_for_version(transformers.__version__)
V5 = CONVENTION != "4.57"
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
WALK = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl",
        "qwen3_vl_moe": "qwen3_vl"}
VS, VE, IMG, VID, PAD = 151652, 151653, 151655, 151656, 151643


def modeling(model_type: str) -> types.ModuleType:
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def owner_class(model_type: str) -> type:
    module = modeling(model_type)
    return next(v for v in vars(module).values() if isinstance(v, type)
                and v.__module__ == module.__name__ and "get_rope_index" in vars(v))


def stand_in(model_type: str, config=None, tokens_per_second=None):
    """An object carrying only ``config`` (and, in 5.x, the helper get_rope_index calls) on
    which the class's current ``get_rope_index`` (patched or not) runs."""
    config = config or AutoConfig.for_model(model_type)
    if tokens_per_second is not None:
        # what get_rope_index reads, in a namespace: 5.x configs refuse a float here
        vision = types.SimpleNamespace(spatial_merge_size=config.vision_config.spatial_merge_size,
                                       tokens_per_second=tokens_per_second)
        config = types.SimpleNamespace(
            vision_config=vision, image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            vision_start_token_id=config.vision_start_token_id)
    obj = types.SimpleNamespace(config=config)
    cls = owner_class(model_type)
    for name in ("get_vision_position_ids",):
        if name in vars(cls):
            setattr(obj, name, vars(cls)[name].__get__(obj))
    return obj


def rope_index(model_type: str, obj, original: bool = False):
    fn = vars(owner_class(model_type))["get_rope_index"]
    return _handle.original_of(fn).__get__(obj) if original else fn.__get__(obj)


# ---------------------------------------------------------------------------------------
# Prompts as the processors lay them out.


def make_batch(seed: int, model_type: str, batch: int, padding: str, *, long_video=False,
               fractional=False, seconds_dtype=torch.float32):
    """Rows of text with 0..4 images and videos each (one row without any), left or right
    padding; returns the get_rope_index keyword arguments of the installed release."""
    rng = random.Random(seed)
    qwen3 = WALK[model_type] == "qwen3_vl"
    rows, images, videos, seconds = [], [], [], []
    for b in range(batch):
        tokens: list[int] = []

        def text(lo: int, hi: int) -> None:
            tokens.extend(rng.randrange(0, 1000) for _ in range(rng.randint(lo, hi)))

        items = 0 if batch > 1 and b == batch // 2 else rng.randint(1, 4)  # a text-only row
        for i in range(items):
            text(0, 4)
            h, w = 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)
            if rng.random() < 0.5 and not (long_video and i == 0):
                images.append((1, h, w))
                tokens += [VS] + [IMG] * (h * w // 4) + [VE]
                continue
            t = rng.randint(24, 40) if long_video and i == 0 else rng.randint(1, 4)
            if long_video and i == 0:
                h, w = 2, 4
            videos.append((t, h, w))
            seconds.append(rng.choice([0.25, 0.5, 2 / 3, 1.5]) if fractional
                           else rng.choice([1.0, 2.0]))
            if qwen3:  # <timestamp> <vision_start> frame <vision_end>, per frame
                for _ in range(t):
                    text(1, 3)
                    tokens += [VS] + [VID] * (h * w // 4) + [VE]
            else:
                tokens += [VS] + [VID] * (t * h * w // 4) + [VE]
        text(1, 5)
        rows.append(tokens)
    length = max(map(len, rows)) + rng.randint(0, 3)
    ids, mask = [], []
    for b, tokens in enumerate(rows):
        pad = length - len(tokens)
        left = padding == "left" or (padding == "mixed" and b % 2 == 0)
        ids.append([PAD] * pad + tokens if left else tokens + [PAD] * pad)
        mask.append([0] * pad + [1] * len(tokens) if left else [1] * len(tokens) + [0] * pad)
    input_ids = torch.tensor(ids)
    grid = lambda g: torch.tensor(g, dtype=torch.int64) if g else None
    out = dict(input_ids=input_ids, image_grid_thw=grid(images), video_grid_thw=grid(videos),
               attention_mask=torch.tensor(mask))
    if model_type == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor(seconds, dtype=seconds_dtype) if videos else None
    if V5:
        out["mm_token_type_ids"] = (input_ids == IMG).int() + 2 * (input_ids == VID).int()
    return out


def api_kwargs(model_type: str, kw: dict, tokens_per_second=None) -> dict:
    """compute_mrope_position_ids arguments for get_rope_index keyword arguments ``kw``."""
    out = dict(kw, model=model_type, image_token_id=IMG, video_token_id=VID,
               vision_start_token_id=VS)
    if model_type == "qwen2_5_vl":
        out["tokens_per_second"] = tokens_per_second or AutoConfig.for_model(
            model_type).vision_config.tokens_per_second
    return out


def assert_identical(ours, theirs):
    (pos, deltas), (hpos, hdeltas) = ours, theirs
    assert pos.dtype == hpos.dtype and deltas.dtype == hdeltas.dtype
    assert pos.shape == hpos.shape and deltas.shape == hdeltas.shape
    assert torch.equal(pos, hpos), (pos, hpos)
    assert torch.equal(deltas, hdeltas), (deltas, hdeltas)


# ---------------------------------------------------------------------------------------
# Against transformers' get_rope_index, through the public API and through the patch.


CASES = [dict(), dict(long_video=True), dict(fractional=True),
         dict(fractional=True, seconds_dtype=torch.float64)]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("padding", ["left", "right", "mixed"])
def test_matches_get_rope_index(model_type, batch, padding):
    obj = stand_in(model_type)
    with hf.patch(model_type) as handle:
        target = f"{model_type}.get_rope_index"
        for seed, case in enumerate(CASES):
            if case.get("seconds_dtype") and model_type != "qwen2_5_vl":
                continue
            kw = make_batch(seed, model_type, batch, padding, **case)
            theirs = rope_index(model_type, obj, original=True)(**kw)
            assert_identical(rope_index(model_type, obj)(**kw), theirs)
            pos, deltas = compute_mrope_position_ids(**api_kwargs(model_type, kw))
            assert torch.equal(pos, theirs[0].long()) and torch.equal(deltas, theirs[1])
        assert handle.calls[target] > 0 and handle.fallbacks[target] == 0


@pytest.mark.parametrize("tokens_per_second", [2, 25, 4.0, 2.5])
@pytest.mark.parametrize("seconds", [None, "float32", "float64", "list"])
def test_qwen2_5_seconds_and_tokens_per_second(tokens_per_second, seconds):
    """Each release's temporal rule, or transformers' own path where it fails or computes
    in a precision the walk does not reproduce (counted as a fallback)."""
    model_type = "qwen2_5_vl"
    obj = stand_in(model_type, tokens_per_second=tokens_per_second)
    kw = make_batch(3, model_type, 4, "left", fractional=True, long_video=True)
    s = kw["second_per_grid_ts"]
    kw["second_per_grid_ts"] = {None: None, "float32": s, "float64": s.double(),
                                "list": s.tolist()}[seconds]
    walked = not ((CONVENTION == "5.17" and not isinstance(tokens_per_second, int))
                  or (CONVENTION == "5.18" and seconds == "list"))
    try:
        theirs = rope_index(model_type, obj, original=True)(**kw)
    except RuntimeError:  # 5.17: float tokens_per_second makes meshgrid mix dtypes
        assert CONVENTION == "5.17" and not walked
        theirs = None
    with hf.patch(model_type) as handle:
        if theirs is None:
            with pytest.raises(RuntimeError):
                rope_index(model_type, obj)(**kw)
        else:
            assert_identical(rope_index(model_type, obj)(**kw), theirs)
        target = f"{model_type}.get_rope_index"
        assert (handle.calls[target], handle.fallbacks[target]) == ((1, 0) if walked else (0, 1))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_calls_the_walk_does_not_take_go_to_transformers(model_type):
    obj = stand_in(model_type)
    kw = make_batch(5, model_type, 3, "right")
    theirs = rope_index(model_type, obj, original=True)(**kw)
    images = kw["image_grid_thw"] if kw["image_grid_thw"] is not None else torch.empty(0, 3)
    extra = dict(kw, image_grid_thw=torch.cat([images.long(), torch.tensor([[1, 2, 2]])]))
    theirs_extra = rope_index(model_type, obj, original=True)(**extra)
    with hf.patch(model_type) as handle:
        target = f"{model_type}.get_rope_index"
        # an unused trailing grid: transformers ignores it, the walk refuses it
        assert_identical(rope_index(model_type, obj)(**extra), theirs_extra)
        assert (handle.calls[target], handle.fallbacks[target]) == (0, 1)
        # positional arguments bind like the original signature's
        names = [n for n in ("input_ids", "mm_token_type_ids", "image_grid_thw",
                             "video_grid_thw", "second_per_grid_ts", "attention_mask")
                 if n in kw]
        assert_identical(rope_index(model_type, obj)(*(kw[n] for n in names)), theirs)
        assert handle.calls[target] == 1
    with hf.patch(model_type, fallback=False):
        with pytest.raises(ValueError, match="image_grid_thw"):
            rope_index(model_type, obj)(**extra)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_int32_ids_give_what_transformers_gives(model_type):
    """int32 input_ids with and without grids, with and without a mask: the same result, or
    the same error (transformers writes int64 positions into ids of input_ids' dtype, with
    a mask under 5.x, with grids under 4.57)."""
    obj = stand_in(model_type)
    for mask, grids in itertools.product((True, False), (True, False)):
        kw = make_batch(5, model_type, 3, "right")
        kw["input_ids"] = kw["input_ids"].int()
        if not mask:
            kw.pop("attention_mask", None)
        if not grids:
            kw.update(image_grid_thw=None, video_grid_thw=None)
            vision = torch.isin(kw["input_ids"], torch.tensor([VS, VE, IMG, VID], dtype=torch.int32))
            kw["input_ids"][vision] = 7  # the vision tokens become text
            if "mm_token_type_ids" in kw:
                kw["mm_token_type_ids"] = torch.zeros_like(kw["mm_token_type_ids"])
        try:
            theirs, error = rope_index(model_type, obj, original=True)(**kw), None
        except RuntimeError as e:
            theirs, error = None, e
        with hf.patch(model_type):
            if error is None:
                assert_identical(rope_index(model_type, obj)(**kw), theirs)
            else:
                with pytest.raises(type(error), match="dtypes match"):
                    rope_index(model_type, obj)(**kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inputs_come_back_on_their_device():
    obj = stand_in("qwen2_vl")
    kw = make_batch(2, "qwen2_vl", 4, "left")
    theirs = rope_index("qwen2_vl", obj, original=True)(**kw)
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    with hf.patch("qwen2_vl") as handle:
        pos, deltas = rope_index("qwen2_vl", obj)(**cuda)
        assert handle.calls["qwen2_vl.get_rope_index"] == 1
    assert pos.device == cuda["input_ids"].device and deltas.device == pos.device
    assert_identical((pos.cpu(), deltas.cpu()), theirs)


# ---------------------------------------------------------------------------------------
# Tiny random-weight models: forward, decode ids, generate.

IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123


def tiny_model(model_type: str):
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    rope_key = "rope_parameters" if V5 else "rope_scaling"
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  patch_size=4)
    if model_type == "qwen2_vl":
        text[rope_key] = {"rope_type": "default", "mrope_section": [2, 3, 3]}
        vision = dict(depth=1, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2,
                      patch_size=4)
    elif model_type == "qwen2_5_vl":
        text[rope_key] = {"rope_type": "default", "mrope_section": [2, 3, 3]}
        vision.update(window_size=16, fullatt_block_indexes=[0], tokens_per_second=2)
    else:
        text[rope_key] = {"rope_type": "default", "mrope_section": [3, 3, 2],
                          "mrope_interleaved": True}
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
        if model_type == "qwen3_vl_moe":
            text.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                        decoder_sparse_step=1)
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision,
                                  image_token_id=IMAGE, video_token_id=VIDEO,
                                  vision_start_token_id=VISION_START,
                                  vision_end_token_id=VISION_END)
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").eval()


def model_inputs(model_type: str, config) -> dict:
    """Two left-padded rows: text, an image (1, 4, 8), a video of 6 frames (6, 4, 4) whose
    frames outnumber its rows and columns, text; pixel values of those grids."""
    gen = torch.Generator().manual_seed(1)
    vc = config.vision_config
    merge, qwen3 = vc.spatial_merge_size, WALK[model_type] == "qwen3_vl"
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    text = lambda n: torch.randint(3, 100, (n,), generator=gen).tolist()
    rows, pixels, frames = [], [], []
    for b in range(2):
        ids = text(3 + 2 * b) + [VISION_START] + [IMAGE] * 8 + [VISION_END] + text(2)
        t = 6
        if qwen3:
            for _ in range(t):
                ids += text(2) + [VISION_START] + [VIDEO] * 4 + [VISION_END]
        else:
            ids += [VISION_START] + [VIDEO] * (t * 4) + [VISION_END]
        rows.append(ids + text(3))
        pixels.append(torch.randn(32, patch_dim, generator=gen))
        frames.append(torch.randn(t * 16, patch_dim, generator=gen))
    width = max(map(len, rows))
    input_ids = torch.tensor([[2] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = dict(input_ids=input_ids, attention_mask=mask, pixel_values=torch.cat(pixels),
               image_grid_thw=torch.tensor([[1, 4, 8]] * 2),
               pixel_values_videos=torch.cat(frames), video_grid_thw=torch.tensor([[6, 4, 4]] * 2))
    if model_type == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor([0.5, 1.5])
    if V5:
        out["mm_token_type_ids"] = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
    return out


def base_model(model):
    return model.model


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_model_prefill_decode_and_generate(model_type):
    model = tiny_model(model_type)
    inputs = model_inputs(model_type, model.config)
    rope_kw = {k: v for k, v in inputs.items() if k in (
        "input_ids", "image_grid_thw", "video_grid_thw", "attention_mask", "second_per_grid_ts",
        "mm_token_type_ids")}
    seen = []  # the position ids generate gives the decoder, step by step
    base_model(model).language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("position_ids")), with_kwargs=True)
    with torch.inference_mode():
        ref_ids = base_model(model).get_rope_index(**rope_kw)
        ref_logits = model(**inputs).logits
        seen.clear()
        ref_tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    target = f"{model_type}.get_rope_index"
    with hf.patch(model_type) as handle, torch.inference_mode():
        ids = base_model(model).get_rope_index(**rope_kw)
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        calls = handle.calls[target]
    assert_identical(ids, ref_ids)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)
    assert calls >= 3 and handle.fallbacks[target] == 0  # prefill ids, forward, generate
    # the next positions from the deltas: what the 5.x model computes from rope_deltas
    # (cumsum of the mask), or 4.57's cache position + deltas
    deltas = ids[1]
    L = rope_kw["input_ids"].shape[1]
    mask = torch.cat([rope_kw["attention_mask"], torch.ones(2, 1, dtype=torch.int64)], 1)
    step = compute_mrope_decode_position_ids(deltas, L, 1, attention_mask=mask)
    # what generate gives the decoder: 4.57 from the deltas, 5.x from the prompt's last ids
    prompt, first, second = seen[:3]  # (3, B, .), or (4, B, .) in 5.x with a text row first
    if V5:
        for k, got in enumerate((first, second)):
            assert torch.equal(compute_mrope_decode_position_ids(
                deltas, L + k, prompt_position_ids=prompt), got[-3:])
    else:
        assert torch.equal(step, first[-3:])
    if V5:
        base = base_model(model)
        base.rope_deltas = deltas
        cache = types.SimpleNamespace(get_seq_length=lambda: L)
        params = inspect.signature(base.compute_3d_position_ids).parameters
        cache_kw = "cache" if "cache" in params else "past_key_values"
        want = base.compute_3d_position_ids(
            input_ids=None, inputs_embeds=torch.zeros(2, L + 1, 8), attention_mask=mask,
            image_grid_thw=None, video_grid_thw=None,
            **{cache_kw: cache})
        assert torch.equal(step, want[:, :, -1:])
    else:
        assert torch.equal(step, (L + deltas).view(1, 2, 1).expand(3, 2, 1))
