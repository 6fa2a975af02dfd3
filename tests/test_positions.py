"""Position ids: compute_mrope_position_ids under convention "4.57" against transformers
4.57.6's own ``get_rope_index`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), the worked examples of the
specification under every convention, convention resolution, decode-step ids, vision-tower
patch ids, bad grids and op registration.  The comparison with the ``get_rope_index`` of
whichever transformers is installed (4.57.6, 5.17.0, 5.18.0, 5.25.0) is in
test_hf_positions.py.
"""

from __future__ import annotations

import importlib.metadata
import random
import sys
import types

import pytest
import torch

import posenc_torch
from posenc_torch import (
    compute_mrope_decode_position_ids,
    compute_mrope_position_ids,
    vision_rotary_position_ids,
)
from op_errors import raw_raises

VS, VE, IMG, VID, PAD = 151652, 151653, 151655, 151656, 151643
IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS)
MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def mrope(input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None, **kw):
    """compute_mrope_position_ids with the Qwen token ids, under convention "4.57" unless
    told otherwise."""
    kw.setdefault("convention", "4.57")
    return compute_mrope_position_ids(input_ids, image_grid_thw, video_grid_thw, attention_mask,
                                      **IDS, **kw)


def mm_types(input_ids: torch.Tensor) -> torch.Tensor:
    """mm_token_type_ids as the transformers 5.x processors give them."""
    return (input_ids == IMG).long() + 2 * (input_ids == VID).long()


# ---------------------------------------------------------------------------------------
# Random prompts: text, images and videos as the processors lay them out.


def make_row(rng: random.Random, model: str, max_items: int, fractional: bool = False):
    """One row's tokens plus its image grids, video grids and seconds per grid, in order."""
    tokens, images, videos, seconds = [], [], [], []

    def text(lo, hi):
        tokens.extend(rng.randrange(0, 1000) for _ in range(rng.randint(lo, hi)))

    for _ in range(rng.randint(0, max_items)):
        text(0, 5)
        h, w = 2 * rng.randint(1, 4), 2 * rng.randint(1, 4)
        if rng.random() < 0.5:
            t = 2 if rng.random() < 0.15 else 1
            images.append((t, h, w))
            tokens += [VS] + [IMG] * (t * h * w // 4) + [VE]
        else:
            t = rng.randint(1, 4)
            videos.append((t, h, w))
            seconds.append(rng.choice([0.25, 0.5, 1.5]) if fractional else rng.choice([1.0, 2.0]))
            if model == "qwen3_vl":  # a timestamp before every frame
                for _ in range(t):
                    text(1, 3)
                    tokens += [VS] + [VID] * (h * w // 4) + [VE]
            else:
                tokens += [VS] + [VID] * (t * h * w // 4) + [VE]
    text(0, 5)
    return tokens, images, videos, seconds


def make_batch(seed: int, model: str, batch: int, padding: str, max_items: int = 4,
               fractional: bool = False):
    """padding: 'none' (rows made equal with text, no mask), 'left', 'right' or 'mixed'."""
    rng = random.Random(seed)
    rows = [make_row(rng, model, max_items, fractional) for _ in range(batch)]
    length = max(len(r[0]) for r in rows) + (0 if padding == "none" else rng.randint(0, 3))
    length = max(length, 1)
    ids, mask = [], []
    for b, (tokens, *_ ) in enumerate(rows):
        if not tokens:
            tokens.append(7)
        pad = length - len(tokens)
        side = {"left": "left", "right": "right", "mixed": ("left", "right")[b % 2]}.get(padding)
        if side is None:
            ids.append(tokens + [rng.randrange(0, 1000) for _ in range(pad)])
            mask.append([1] * length)
        elif side == "left":
            ids.append([PAD] * pad + tokens)
            mask.append([0] * pad + [1] * len(tokens))
        else:
            ids.append(tokens + [PAD] * pad)
            mask.append([1] * len(tokens) + [0] * pad)
    images = [g for r in rows for g in r[1]]
    videos = [g for r in rows for g in r[2]]
    seconds = [s for r in rows for s in r[3]]
    grid = lambda gs: torch.tensor(gs, dtype=torch.int64).reshape(-1, 3) if gs else None
    return (torch.tensor(ids), grid(images), grid(videos),
            None if padding == "none" else torch.tensor(mask),
            torch.tensor(seconds, dtype=torch.float64) if videos else None)


# ---------------------------------------------------------------------------------------
# transformers 4.57.6's get_rope_index, bound to a stand-in carrying only `config`.


def hf_rope_index(model: str, tokens_per_second: int = 2, spatial_merge_size: int = 2):
    if model == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig as cfg_cls
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as model_cls
    elif model == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLConfig as cfg_cls,
        )
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VLModel as model_cls,
        )
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig as cfg_cls
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as model_cls
    config = cfg_cls()
    assert (config.image_token_id, config.video_token_id, config.vision_start_token_id) == (
        IMG, VID, VS)
    config.vision_config.spatial_merge_size = spatial_merge_size
    if model == "qwen2_5_vl":
        config.vision_config.tokens_per_second = tokens_per_second
    owner = types.SimpleNamespace(config=config)
    return model_cls.get_rope_index.__get__(owner)


def hf_call(model, ids, images, videos, mask, seconds, **kw):
    fn = hf_rope_index(model, **kw)
    if model == "qwen2_5_vl":
        return fn(ids, images, videos, seconds, mask)
    return fn(ids, images, videos, mask)


def assert_same(ours, theirs):
    (pos, deltas), (hpos, hdeltas) = ours, theirs
    assert pos.dtype == torch.int64 and deltas.dtype == torch.int64
    assert pos.shape == hpos.shape and deltas.shape == hdeltas.shape
    assert torch.equal(pos, hpos.long()), (pos, hpos)
    assert torch.equal(deltas, hdeltas.long()), (deltas, hdeltas)


@pytest.mark.transformers4
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("padding", ["none", "left", "right", "mixed"])
def test_matches_transformers_random(model, padding):
    for seed in range(6):
        ids, images, videos, mask, seconds = make_batch(seed, model, 3, padding)
        if images is None and videos is None:
            continue  # the grid-less branch has its own test
        kw = {"second_per_grid_ts": seconds} if model == "qwen2_5_vl" else {}
        ours = mrope(ids, images, videos, mask, model=model, **kw)
        assert_same(ours, hf_call(model, ids, images, videos, mask, seconds))


@pytest.mark.transformers4
@pytest.mark.parametrize("model", MODELS)
def test_matches_transformers_rows_without_vision(model):
    ids, images, videos, mask, seconds = make_batch(11, model, 2, "mixed")
    rng = random.Random(3)
    plain = torch.tensor([[PAD] * 4 + [rng.randrange(1000) for _ in range(ids.shape[1] - 4)]])
    ids = torch.cat([plain, ids, plain.flip(1)])
    mask = torch.cat([(plain != PAD).long(), mask, (plain.flip(1) != PAD).long()])
    if images is None:
        images = torch.empty(0, 3, dtype=torch.int64)
    kw = {"second_per_grid_ts": seconds} if model == "qwen2_5_vl" else {}
    ours = mrope(ids, images, videos, mask, model=model, **kw)
    assert_same(ours, hf_call(model, ids, images, videos, mask, seconds))
    # grids given but empty: every row is a text row of the walk
    empty = torch.empty(0, 3, dtype=torch.int64)
    ours = mrope(plain, empty, None, (plain != PAD).long(), model=model)
    assert_same(ours, hf_call(model, plain, empty, None, (plain != PAD).long(), None))


@pytest.mark.transformers4
@pytest.mark.parametrize("model", MODELS)
def test_matches_transformers_without_grids(model):
    ids = torch.randint(0, 1000, (3, 9))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 1, 1, 1, 0, 0],
                         [0, 0, 0, 0, 0, 0, 0, 1, 0]])  # one kept token: the pads' 1 is the max
    assert_same(mrope(ids, model=model), hf_call(model, ids, None, None, None, None))
    assert_same(mrope(ids, attention_mask=mask, model=model),
                hf_call(model, ids, None, None, mask, None))
    assert_same(mrope(ids, attention_mask=mask.bool(), model=model),
                hf_call(model, ids, None, None, mask.bool(), None))


@pytest.mark.transformers4
def test_matches_transformers_qwen2_5_tokens_per_second_and_seconds():
    for seed in range(4):
        ids, images, videos, mask, seconds = make_batch(20 + seed, "qwen2_5_vl", 2, "left")
        if videos is None:
            continue
        # default tokens_per_second (2) vs the released config value; then 4 (config default)
        assert_same(mrope(ids, images, videos, mask, model="qwen2_5_vl",
                          second_per_grid_ts=seconds),
                    hf_call("qwen2_5_vl", ids, images, videos, mask, seconds))
        assert_same(mrope(ids, images, videos, mask, model="qwen2_5_vl",
                          second_per_grid_ts=seconds.tolist(), tokens_per_second=4),
                    hf_call("qwen2_5_vl", ids, images, videos, mask, seconds,
                            tokens_per_second=4))
        # no second_per_grid_ts: one second per grid
        assert_same(mrope(ids, images, videos, mask, model="qwen2_5_vl"),
                    hf_call("qwen2_5_vl", ids, images, videos, mask, None))


@pytest.mark.transformers4
@pytest.mark.parametrize("model", MODELS)
def test_matches_transformers_merge_size_and_int32(model):
    ids, images, videos, mask, seconds = make_batch(5, model, 2, "right")
    if images is None and videos is None:
        pytest.fail("seed 5 must give a batch with vision")
    kw = {"second_per_grid_ts": seconds} if model == "qwen2_5_vl" else {}
    ours = mrope(ids.int(), images.int() if images is not None else None, videos, mask,
                 model=model, **kw)
    assert_same(ours, hf_call(model, ids, images, videos, mask, seconds))
    # merge size 1: the same tokens read as grids with half the height and width
    half = lambda g: None if g is None else torch.stack([g[:, 0], g[:, 1] // 2, g[:, 2] // 2], 1)
    ours = mrope(ids, half(images), half(videos), mask, model=model, spatial_merge_size=1, **kw)
    theirs = hf_call(model, ids, half(images), half(videos), mask, seconds, spatial_merge_size=1)
    assert_same(ours, theirs)


# ---------------------------------------------------------------------------------------
# Worked examples (specification §5.3, §5.4, §7.2), no transformers needed.


@pytest.mark.parametrize("model", MODELS)
def test_example_image(model):
    ids = torch.tensor([[17, VS, IMG, IMG, IMG, IMG, VE, 18]])
    pos, deltas = mrope(ids, torch.tensor([[1, 4, 4]]), model=model)
    assert pos[:, 0].tolist() == [[0, 1, 2, 2, 2, 2, 4, 5],
                                  [0, 1, 2, 2, 3, 3, 4, 5],
                                  [0, 1, 2, 3, 2, 3, 4, 5]]
    assert deltas.tolist() == [[-2]]
    # next token: 8 + (-2) = 6 on all rows
    assert compute_mrope_decode_position_ids(deltas, 8).tolist() == [[[6]], [[6]], [[6]]]
    # left padding: padded slots are 1, the delta uses the padded length
    ids = torch.cat([torch.tensor([[PAD, PAD]]), ids], 1)
    mask = torch.tensor([[0, 0] + [1] * 8])
    pos, deltas = mrope(ids, torch.tensor([[1, 4, 4]]), attention_mask=mask, model=model)
    assert pos[:, 0].tolist() == [[1, 1, 0, 1, 2, 2, 2, 2, 4, 5],
                                  [1, 1, 0, 1, 2, 2, 3, 3, 4, 5],
                                  [1, 1, 0, 1, 2, 3, 2, 3, 4, 5]]
    assert deltas.tolist() == [[-4]]


def test_example_qwen2_5_video():
    ids = torch.tensor([[17, VS] + [VID] * 12 + [VE, 18]])
    pos, deltas = mrope(ids, None, torch.tensor([[3, 4, 4]]), model="qwen2_5_vl",
                        second_per_grid_ts=torch.tensor([2.0]), tokens_per_second=2)
    assert pos[:, 0].tolist() == [
        [0, 1, 2, 2, 2, 2, 6, 6, 6, 6, 10, 10, 10, 10, 11, 12],
        [0, 1] + [2, 2, 3, 3] * 3 + [11, 12],
        [0, 1] + [2, 3, 2, 3] * 3 + [11, 12]]
    assert deltas.tolist() == [[-3]]
    # tokens_per_second defaults to 2 for qwen2_5_vl
    assert torch.equal(mrope(ids, None, torch.tensor([[3, 4, 4]]), model="qwen2_5_vl",
                             second_per_grid_ts=[2.0])[0], pos)


def test_example_qwen3_frames():
    ids = torch.tensor([[11, 12, 13, VS, VID, VID, VID, VID, VE,
                         14, 15, 16, VS, VID, VID, VID, VID, VE]])
    pos, deltas = mrope(ids, None, torch.tensor([[2, 4, 4]]), model="qwen3_vl")
    assert pos[:, 0].tolist() == [
        [0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8, 9, 10, 11, 11, 11, 11, 13],
        [0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8, 9, 10, 11, 11, 12, 12, 13],
        [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 10, 11, 12, 11, 12, 13]]
    assert deltas.tolist() == [[-4]]
    # per-frame grids given explicitly are the same thing
    same = mrope(ids, None, torch.tensor([[1, 4, 4], [1, 4, 4]]), model="qwen3_vl")
    assert torch.equal(same[0], pos) and torch.equal(same[1], deltas)
    # and the 5.x rules agree here
    for convention in ("5.17", "5.18"):
        v5 = mrope(ids, None, torch.tensor([[2, 4, 4]]), model="qwen3_vl",
                   mm_token_type_ids=mm_types(ids), convention=convention)
        assert torch.equal(v5[0], pos) and torch.equal(v5[1], deltas)


@pytest.mark.parametrize("convention", ["5.17", "5.18"])
def test_example_5x_rules(convention):
    """The issue's example: a video with more frames than rows and columns."""
    ids = torch.tensor([[17, VS, VID, VID, VID, VID, VE, 18]])
    grid = torch.tensor([[4, 2, 2]])
    old = mrope(ids, None, grid)
    assert old[0][0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7] and old[1].tolist() == [[0]]
    pos, deltas = mrope(ids, None, grid, mm_token_type_ids=mm_types(ids), convention=convention)
    assert pos[:, 0].tolist() == [[0, 1, 2, 3, 4, 5, 3, 4], [0, 1, 2, 2, 2, 2, 3, 4],
                                  [0, 1, 2, 2, 2, 2, 3, 4]]
    assert deltas.tolist() == [[-2]]
    # token ids are not read under 5.x: the types alone decide
    blind = compute_mrope_position_ids(torch.zeros_like(ids), None, grid,
                                       mm_token_type_ids=mm_types(ids), convention=convention)
    assert torch.equal(blind[0], pos)
    # left padding: padded slots 0, deltas from the real tokens
    pids = torch.cat([torch.tensor([[PAD, PAD]]), ids], 1)
    mask = torch.tensor([[0, 0] + [1] * 8])
    pos, deltas = mrope(pids, None, grid, mask, mm_token_type_ids=mm_types(pids),
                        convention=convention)
    assert pos[0, 0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 3, 4] and deltas.tolist() == [[-2]]
    # the decode helper continues from the real tokens: 8 + (-2) = 6
    full = torch.cat([mask, torch.ones(1, 1, dtype=torch.int64)], 1)
    step = compute_mrope_decode_position_ids(deltas, 10, attention_mask=full,
                                             convention=convention)
    assert step.tolist() == [[[6]]] * 3
    # transformers 5.x's generate continues from the last slot instead: 4 + 1, then 6
    gen = compute_mrope_decode_position_ids(deltas, 11, 1, prompt_position_ids=pos)
    assert gen.tolist() == [[[6]]] * 3
    assert compute_mrope_decode_position_ids(deltas, 10, 2,
                                             prompt_position_ids=pos).tolist() == [[[5, 6]]] * 3
    with pytest.raises(ValueError, match="prompt_position_ids"):
        compute_mrope_decode_position_ids(deltas, 10, prompt_position_ids=pos[:2])
    # 4.57 deltas are relative to the padded length instead
    old = mrope(pids, None, grid, mask)
    assert old[0][0, 0].tolist() == [1, 1, 0, 1, 2, 3, 4, 5, 6, 7] and old[1].tolist() == [[-2]]
    assert compute_mrope_decode_position_ids(old[1], 10, attention_mask=full,
                                             convention="4.57").tolist() == [[[8]]] * 3
    # without grids: text positions, padded slots 0, deltas 0
    pos, deltas = mrope(pids, attention_mask=mask, convention=convention)
    assert pos[0, 0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7] and deltas.tolist() == [[0]]
    # without mm_token_type_ids: derived from the token ids, as the processors do
    derived = mrope(pids, None, grid, mask, convention=convention)
    given = mrope(pids, None, grid, mask, mm_token_type_ids=mm_types(pids), convention=convention)
    assert torch.equal(derived[0], given[0]) and torch.equal(derived[1], given[1])
    # a missing input is a TypeError under every convention (as under "4.57")
    with pytest.raises(TypeError, match="mm_token_type_ids"):
        compute_mrope_position_ids(ids, None, grid, convention=convention)
    bad = mm_types(ids)
    bad[0, 0] = 3
    with pytest.raises(ValueError, match=r"mm_token_type_ids\[0, 0\] is 3"):
        mrope(ids, None, grid, mm_token_type_ids=bad, convention=convention)
    with pytest.raises(ValueError, match="video_grid_thw"):
        mrope(ids, None, torch.tensor([[2, 2, 2]]), mm_token_type_ids=mm_types(ids),
              convention=convention)


def test_convention_resolution(monkeypatch):
    from posenc_torch import positions

    assert positions.convention_for_version("4.57.6") == "4.57"
    assert positions.convention_for_version("5.17.0") == "5.17"
    assert positions.convention_for_version("5.18.0") == "5.18"
    assert positions.convention_for_version("5.24.0.dev0") == "5.18"
    for unchecked in ("5.3.0", "6.0.0"):
        with pytest.raises(ValueError, match="not checked"):
            positions.convention_for_version(unchecked)
    import transformers

    assert positions.resolve_convention("installed") == positions.convention_for_version(
        transformers.__version__)
    with pytest.raises(ValueError, match="convention"):
        positions.resolve_convention("5.x")
    # without transformers installed, "installed" asks for an explicit convention
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: (_ for _ in ()).throw(
                            importlib.metadata.PackageNotFoundError(name)))
    with pytest.raises(ValueError, match="needs transformers installed"):
        compute_mrope_position_ids(ONE_IMAGE, torch.tensor([[1, 4, 4]]), **IDS)
    assert mrope(ONE_IMAGE, torch.tensor([[1, 4, 4]]))[1].tolist() == [[-2]]
    # decoding needs no convention without a mask
    assert compute_mrope_decode_position_ids(torch.tensor([[-2]]), 8).tolist() == [[[6]]] * 3


SECONDS_CASES = [(0.5, 2), (0.25, 2), (1 / 3, 2), (0.5, 3.0), (1.5, 2), (2 / 3, 25), (0.7, 4)]


def _float32_steps(seconds: float, tps: float, t: int) -> list[int]:
    """long(k * fl32(tps * fl32(s))) in float32, written out with numpy-free struct math."""
    import struct

    f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]
    step = f32(f32(tps) * f32(seconds))
    return [int(f32(f32(k) * step)) for k in range(t)]


@pytest.mark.parametrize("convention", ["4.57", "5.17", "5.18"])
@pytest.mark.parametrize("seconds,tps", SECONDS_CASES)
def test_qwen2_5_seconds_formula(convention, seconds, tps):
    t, h, w = 5, 4, 6
    n = t * (h // 2) * (w // 2)
    ids = torch.tensor([[17, 18, VS] + [VID] * n + [VE, 19]])
    pos, deltas = mrope(ids, None, torch.tensor([[t, h, w]]), model="qwen2_5_vl",
                        mm_token_type_ids=mm_types(ids), convention=convention,
                        second_per_grid_ts=torch.tensor([seconds]), tokens_per_second=tps)
    base = 3
    if convention == "5.18":  # the fraction is kept, in float32
        tidx = _float32_steps(seconds, tps, t)
    else:  # the seconds are truncated to an integer first
        tidx = [k * int(seconds) * int(tps) for k in range(t)]
    want_t = [base + tidx[k // 6] for k in range(n)]
    want_h = [base + (k % 6) // 3 for k in range(n)]
    want_w = [base + k % 3 for k in range(n)]
    assert pos[0, 0, 3:3 + n].tolist() == want_t
    assert pos[1, 0, 3:3 + n].tolist() == want_h
    assert pos[2, 0, 3:3 + n].tolist() == want_w
    after = base + (max(tidx[-1], 1, 2) + 1 if convention == "4.57" else max(h, w) // 2)
    assert pos[:, 0, 3 + n:].tolist() == [[after, after + 1]] * 3
    top = max(base + max(tidx[-1], 1, 2), after + 1)
    assert deltas.item() == top + 1 - ids.shape[1]
    if convention == "5.18" and seconds < 1:  # frames do not all share one index
        assert len(set(tidx)) > 1
    if convention == "5.18":  # float64 seconds compute in float64
        pos64, _ = mrope(ids, None, torch.tensor([[t, h, w]]), model="qwen2_5_vl",
                         mm_token_type_ids=mm_types(ids), convention="5.18",
                         second_per_grid_ts=torch.tensor([seconds], dtype=torch.float64),
                         tokens_per_second=tps)
        tidx64 = [int(k * (tps * seconds)) for k in range(t)]
        assert pos64[0, 0, 3:3 + n].tolist() == [base + tidx64[k // 6] for k in range(n)]


def test_qwen2_5_float32_and_float64_seconds_differ():
    """fps 3 (2/3 s per grid) at 25 tokens per second: float32 rounds 16.666667 up."""
    ids = torch.tensor([[17, VS] + [VID] * 8 + [VE, 18]])
    kw = dict(model="qwen2_5_vl", mm_token_type_ids=mm_types(ids), convention="5.18",
              tokens_per_second=25)
    grid = torch.tensor([[8, 2, 2]])
    p32, _ = mrope(ids, None, grid, second_per_grid_ts=torch.tensor([2 / 3]), **kw)
    p64, _ = mrope(ids, None, grid, second_per_grid_ts=torch.tensor([2 / 3], dtype=torch.float64),
                   **kw)
    assert (p32[0, 0, 2:10] - 2).tolist() == [0, 16, 33, 50, 66, 83, 100, 116]
    assert (p64[0, 0, 2:10] - 2).tolist() == [0, 16, 33, 49, 66, 83, 99, 116]
    with pytest.raises(ValueError, match="integral"):
        mrope(ids, None, grid, model="qwen2_5_vl", mm_token_type_ids=mm_types(ids),
              convention="5.17", tokens_per_second=2.5)
    with pytest.raises(TypeError, match="float32, float64"):
        mrope(ids, None, grid, second_per_grid_ts=torch.tensor([0.5], dtype=torch.bfloat16),
              **kw)


@pytest.mark.transformers4
def test_matches_transformers_qwen2_5_fractional_seconds():
    """transformers 4.57.6 casts second_per_grid_ts to int (0.5 -> 0), and so does "4.57"."""
    ids = torch.tensor([[17, VS] + [VID] * 12 + [VE, 18]])
    grid = torch.tensor([[3, 4, 4]])
    for seconds in ([0.5], [1.5], [2.75]):
        for tps in (2, 25, 2.5):
            ours = mrope(ids, None, grid, model="qwen2_5_vl", second_per_grid_ts=seconds,
                         tokens_per_second=tps)
            assert_same(ours, hf_call("qwen2_5_vl", ids, None, grid, None,
                                      torch.tensor(seconds), tokens_per_second=tps))


@pytest.mark.parametrize("model", MODELS)
def test_random_batches_threads_and_padding_sides(model):
    """Left- and right-padded copies of a row give the same positions on its tokens, and
    the threaded run equals the serial one."""
    ids, images, videos, mask, seconds = make_batch(7, model, 2, "right")
    kw = {"second_per_grid_ts": seconds} if model == "qwen2_5_vl" else {}
    pos, deltas = mrope(ids, images, videos, mask, model=model, **kw)
    left = torch.stack([torch.cat([r[m == 0], r[m == 1]]) for r, m in zip(ids, mask)])
    lmask = torch.stack([torch.cat([m[m == 0], m[m == 1]]) for m in mask])
    lpos, ldeltas = mrope(left, images, videos, lmask, model=model, **kw)
    assert torch.equal(deltas, ldeltas)
    for b in range(ids.shape[0]):
        assert torch.equal(pos[:, b][:, mask[b] == 1], lpos[:, b][:, lmask[b] == 1])
        assert (pos[:, b][:, mask[b] == 0] == 1).all()

    # large enough for the threaded path (>= 2^18 tokens): threaded equals serial
    ids, images, videos, mask, seconds = tiled_batch(8, model, 8, 40_000)
    assert ids.numel() >= 1 << 18
    kw = {"second_per_grid_ts": seconds} if model == "qwen2_5_vl" else {}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        many = mrope(ids, images, videos, mask, model=model, **kw)
        torch.set_num_threads(1)
        one = mrope(ids, images, videos, mask, model=model, **kw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many[0], one[0]) and torch.equal(many[1], one[1])
    # rows are independent: the last row alone gives its own ids
    b = ids.shape[0] - 1
    row_ids = ids[b:][:, mask[b] == 1]
    im, vi, se = tiled_row_grids(8, model, 8, 40_000, b)
    alone = mrope(row_ids, im, vi, model=model,
                  **({"second_per_grid_ts": se} if model == "qwen2_5_vl" and vi is not None
                     else {}))
    assert torch.equal(one[0][:, b][:, mask[b] == 1], alone[0][:, 0])


def _tiled_rows(seed, model, batch, length):
    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        tokens, images, videos, seconds = make_row(rng, model, 6)
        reps = max(1, (length - rng.randrange(0, length // 8)) // max(1, len(tokens)))
        rows.append((tokens * reps, images * reps, videos * reps, seconds * reps))
    return rows


def tiled_row_grids(seed, model, batch, length, row):
    _, images, videos, seconds = _tiled_rows(seed, model, batch, length)[row]
    grid = lambda gs: torch.tensor(gs, dtype=torch.int64).reshape(-1, 3) if gs else None
    return grid(images), grid(videos), torch.tensor(seconds, dtype=torch.float64)


def tiled_batch(seed, model, batch, length):
    """Long right-padded rows made of a short random row repeated (fast to build)."""
    rows = _tiled_rows(seed, model, batch, length)
    width = max(len(r[0]) for r in rows)
    ids = torch.full((batch, width), PAD)
    mask = torch.zeros(batch, width, dtype=torch.int64)
    for b, (tokens, *_) in enumerate(rows):
        ids[b, :len(tokens)] = torch.tensor(tokens)
        mask[b, :len(tokens)] = 1
    grid = lambda gs: torch.tensor(gs, dtype=torch.int64).reshape(-1, 3) if gs else None
    images = grid([g for r in rows for g in r[1]])
    videos = grid([g for r in rows for g in r[2]])
    seconds = torch.tensor([s for r in rows for s in r[3]], dtype=torch.float64)
    return ids, images, videos, mask, seconds if videos is not None else None


def test_inputs_not_modified():
    ids, images, videos, mask, seconds = make_batch(2, "qwen3_vl", 3, "mixed")
    copies = [t.clone() if t is not None else None for t in (ids, images, videos, mask)]
    mrope(ids, images, videos, mask, model="qwen3_vl")
    for a, b in zip((ids, images, videos, mask), copies):
        assert (a is None and b is None) or torch.equal(a, b)


def test_empty_and_strided_inputs():
    empty = torch.empty(0, 3, dtype=torch.int64)
    pos, deltas = mrope(torch.empty(0, 5, dtype=torch.int64), empty)
    assert pos.shape == (3, 0, 5) and deltas.shape == (0, 1)
    pos, deltas = mrope(torch.empty(2, 0, dtype=torch.int64), empty)
    assert pos.shape == (3, 2, 0) and deltas.tolist() == [[0], [0]]
    grid = torch.tensor([[1, 4, 4], [1, 4, 4]])
    want = mrope(torch.cat([ONE_IMAGE, ONE_IMAGE]), grid)
    transposed = torch.cat([ONE_IMAGE, ONE_IMAGE]).T.contiguous().T  # column-major
    every_other = torch.stack([ONE_IMAGE, ONE_IMAGE + 1], -1).reshape(1, 16)[:, ::2]
    for ids, g in ((transposed, grid), (every_other, grid[:1])):
        assert not ids.is_contiguous()
        got = mrope(ids, g)
        assert torch.equal(got[0], want[0][:, :ids.shape[0]])
        assert torch.equal(got[1], want[1][:ids.shape[0]])


# ---------------------------------------------------------------------------------------
# Decode-step ids.


def test_decode_ids_continue_the_prompt():
    ids, images, videos, mask, seconds = make_batch(9, "qwen2_vl", 3, "none")
    pos, deltas = mrope(ids, images, videos, model="qwen2_vl")
    L = ids.shape[1]
    step = compute_mrope_decode_position_ids(deltas, L, 3)
    assert step.shape == (3, 3, 3) and step.dtype == torch.int64
    # the same as computing the prompt plus three text tokens at once
    longer = torch.cat([ids, torch.full((3, 3), 5)], 1)
    lpos, _ = mrope(longer, images, videos, model="qwen2_vl")
    assert torch.equal(step, lpos[:, :, L:])
    # cache_position (1-D, first entry used) and a 0-d tensor give the same
    assert torch.equal(compute_mrope_decode_position_ids(deltas, torch.arange(L, L + 3), 3), step)
    assert torch.equal(compute_mrope_decode_position_ids(deltas.view(-1), torch.tensor(L), 3), step)
    # several samples per prompt: rows repeat in place
    rep = compute_mrope_decode_position_ids(deltas, L, 3, batch_size=6)
    assert torch.equal(rep, step.repeat_interleave(2, dim=1))
    with pytest.raises(ValueError, match="multiple"):
        compute_mrope_decode_position_ids(deltas, L, 1, batch_size=4)
    with pytest.raises(TypeError, match="integer"):
        compute_mrope_decode_position_ids(deltas.float(), L)
    with pytest.raises(ValueError, match="past_length"):
        compute_mrope_decode_position_ids(deltas, -1)
    with pytest.raises(ValueError, match=r"\(batch, 1\)"):
        compute_mrope_decode_position_ids(torch.zeros(3, 2, dtype=torch.int64), 4)


# ---------------------------------------------------------------------------------------
# Vision tower ids.


def random_vision_grids(seed: int, n: int = 6) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([[rng.randint(1, 3), 2 * rng.randint(1, 9), 2 * rng.randint(1, 9)]
                         for _ in range(n)])


def test_vision_ids_example():
    ids = vision_rotary_position_ids(torch.tensor([[1, 4, 4]]))
    assert ids.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3],
                            [2, 0], [2, 1], [3, 0], [3, 1], [2, 2], [2, 3], [3, 2], [3, 3]]
    two = vision_rotary_position_ids(torch.tensor([[2, 2, 4]]))
    assert two.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]] * 2
    assert vision_rotary_position_ids(torch.empty(0, 3, dtype=torch.int64)).shape == (0, 2)


def test_vision_ids_match_transformers_5():
    vision_utils = pytest.importorskip(
        "transformers.vision_utils",
        reason="this transformers has no vision_utils (the 5.x home of get_vision_position_ids)")
    for seed, merge in [(0, 2), (1, 2), (2, 1)]:
        grids = random_vision_grids(seed)
        ours = vision_rotary_position_ids(grids, merge)
        theirs = vision_utils.get_vision_position_ids(grids, merge)
        assert torch.equal(ours, theirs)


@pytest.mark.transformers4
@pytest.mark.parametrize("model", ["qwen2_vl", "qwen3_vl"])
def test_vision_ids_match_transformers_4_rot_pos_emb(model):
    """4.57.6 has no position-id function; its rot_pos_emb gathers rotary frequencies with
    them, so gathering the same table with our ids must give its output."""
    if model == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as tower,
            VisionRotaryEmbedding as rotary,
        )
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import (
            Qwen3VLVisionModel as tower,
            Qwen3VLVisionRotaryEmbedding as rotary,
        )
    owner = types.SimpleNamespace(spatial_merge_size=2, rotary_pos_emb=rotary(20))
    for seed in range(3):
        grids = random_vision_grids(seed)
        theirs = tower.rot_pos_emb(owner, grids)
        table = owner.rotary_pos_emb(int(grids[:, 1:].max()))
        ours = table[vision_rotary_position_ids(grids)].flatten(1)
        assert torch.equal(ours, theirs)


def test_vision_ids_bad_grids():
    for bad in ([[1, 4, 3]], [[0, 4, 4]], [[1, -2, 4]]):
        with pytest.raises(ValueError, match=r"grid_thw\[0\]"):
            vision_rotary_position_ids(torch.tensor(bad))
    with pytest.raises(ValueError, match=r"grid_thw\[1\]"):
        vision_rotary_position_ids(torch.tensor([[1, 4, 8], [1, 6, 4]]), 4)
    with pytest.raises(TypeError, match="integer"):
        vision_rotary_position_ids(torch.tensor([[1.0, 2.0, 2.0]]))
    with pytest.raises(ValueError, match=r"\(num_grids, 3\)"):
        vision_rotary_position_ids(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="spatial_merge_size"):
        vision_rotary_position_ids(torch.tensor([[1, 2, 2]]), 0)


# ---------------------------------------------------------------------------------------
# Grids that disagree with the tokens, and bad arguments.

ONE_IMAGE = torch.tensor([[17, VS, IMG, IMG, IMG, IMG, VE, 18]])


@pytest.mark.parametrize("model", MODELS)
def test_bad_grids(model):
    g = lambda *rows: torch.tensor(rows)
    cases = [
        (dict(image_grid_thw=g([1, 4, 4], [1, 2, 2])), r"image_grid_thw has 2 rows.* 1 images"),
        (dict(image_grid_thw=torch.empty(0, 3, dtype=torch.int64)), "image_grid_thw has 0 rows"),
        (dict(video_grid_thw=g([1, 4, 4])), "image_grid_thw has 0 rows"),
        (dict(image_grid_thw=g([1, 4, 8])), r"image_grid_thw\[0\] = \(1, 4, 8\) needs 8 .* has 4"),
        (dict(image_grid_thw=g([1, 2, 4])), r"input_ids\[0, 4\] is image_token_id"),
        (dict(image_grid_thw=g([1, 4, 3])), r"image_grid_thw\[0\] = \(1, 4, 3\) is not a valid"),
        (dict(image_grid_thw=g([0, 4, 4])), r"image_grid_thw\[0\]"),
        (dict(image_grid_thw=g([1, -4, 4])), r"image_grid_thw\[0\]"),
        (dict(), r"image_grid_thw and video_grid_thw are both None"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            compute_mrope_position_ids(ONE_IMAGE, model=model, convention="4.57", **IDS, **kwargs)
    # a placeholder run without vision start
    ids = torch.tensor([[17, 3, IMG, IMG, IMG, IMG, VE, 18]])
    with pytest.raises(ValueError, match="1 rows, but input_ids has 0 images"):
        mrope(ids, torch.tensor([[1, 4, 4]]), model=model)
    # a stray placeholder before a real image
    ids = torch.tensor([[IMG, VS, IMG, IMG, IMG, IMG, VE, 18]])
    with pytest.raises(ValueError, match=r"input_ids\[0, 0\] is image_token_id"):
        mrope(ids, torch.tensor([[1, 4, 4]]), model=model)
    # the run is cut by padding: tokens under the mask do not count
    mask = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"needs 4 .* input_ids\[0, 2\] has 3"):
        mrope(ONE_IMAGE, torch.tensor([[1, 4, 4]]), attention_mask=mask, model=model)
    # the error names the first bad row of a batch
    batch = torch.cat([ONE_IMAGE, ONE_IMAGE, ONE_IMAGE])
    with pytest.raises(ValueError, match=r"image_grid_thw\[1\] = \(1, 4, 8\).* input_ids\[1, 2\]"):
        mrope(batch, torch.tensor([[1, 4, 4], [1, 4, 8], [1, 4, 4]]), model=model)


def test_bad_video_grids():
    frames = torch.tensor([[11, VS, VID, VID, VID, VID, VE, 12]])
    with pytest.raises(ValueError, match="video_grid_thw describes 2 frames.* 1 video frame runs"):
        mrope(frames, None, torch.tensor([[2, 4, 4]]), model="qwen3_vl")
    frames2 = torch.tensor([[11, VS, VID, VID, VE, 12, VS, VID, VE]])
    with pytest.raises(ValueError, match=r"video_grid_thw\[0\] = \(2, 2, 4\) \(frame 1\) needs 2 .* input_ids\[0, 7\] has 1"):
        mrope(frames2, None, torch.tensor([[2, 2, 4]]), model="qwen3_vl")
    with pytest.raises(ValueError, match=r"second_per_grid_ts\[0\]"):
        mrope(frames, None, torch.tensor([[1, 4, 4]]), model="qwen2_5_vl",
              second_per_grid_ts=[-1.0])
    with pytest.raises(ValueError, match=r"second_per_grid_ts\[0\]"):
        mrope(frames, None, torch.tensor([[4, 2, 2]]), model="qwen2_5_vl",
              second_per_grid_ts=[float("nan")])
    with pytest.raises(ValueError, match=r"second_per_grid_ts must have shape \(num_videos,\) "
                                         r"= \(1,\) to match video_grid_thw, got shape \[2\]"):
        mrope(frames, None, torch.tensor([[1, 4, 4]]), model="qwen2_5_vl",
              second_per_grid_ts=[1.0, 2.0])


def test_bad_arguments():
    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(ValueError, match="model must be one of"):
        mrope(ONE_IMAGE, grid, model="qwen2-vl")
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        mrope(ONE_IMAGE.float(), grid)
    with pytest.raises(ValueError, match=r"input_ids must be 2-D"):
        mrope(ONE_IMAGE[0], grid)
    with pytest.raises(TypeError, match="image_grid_thw must be an integer tensor"):
        mrope(ONE_IMAGE, grid.float())
    with pytest.raises(ValueError, match=r"image_grid_thw must have shape \(num_grids, 3\)"):
        mrope(ONE_IMAGE, grid[:, :2])
    with pytest.raises(ValueError, match="attention_mask shape"):
        mrope(ONE_IMAGE, grid, attention_mask=torch.ones(1, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"attention_mask\[0, 3\] is 2"):
        mrope(ONE_IMAGE, grid, attention_mask=torch.tensor([[1, 1, 1, 2, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="only 0 and 1"):
        mrope(ONE_IMAGE, grid, attention_mask=torch.full((1, 8), 0.5))
    with pytest.raises(ValueError, match="non-negative|>= 0"):
        compute_mrope_position_ids(ONE_IMAGE, grid, convention="4.57",
                                   image_token_id=-1, video_token_id=VID,
                                   vision_start_token_id=VS)
    with pytest.raises(ValueError, match="distinct"):
        compute_mrope_position_ids(ONE_IMAGE, grid, convention="4.57",
                                   image_token_id=IMG, video_token_id=IMG,
                                   vision_start_token_id=VS)
    with pytest.raises(TypeError, match="image_token_id must be an int"):
        compute_mrope_position_ids(ONE_IMAGE, grid, convention="4.57",
                                   image_token_id=torch.tensor(IMG),
                                   video_token_id=VID, vision_start_token_id=VS)
    with pytest.raises(ValueError, match="spatial_merge_size"):
        mrope(ONE_IMAGE, grid, spatial_merge_size=0)
    with pytest.raises(ValueError, match="second_per_grid_ts is only used by qwen2_5_vl"):
        mrope(ONE_IMAGE, grid, model="qwen2_vl", second_per_grid_ts=[1.0])
    with pytest.raises(ValueError, match="tokens_per_second applies only"):
        mrope(ONE_IMAGE, grid, model="qwen3_vl", tokens_per_second=2)
    with pytest.raises(ValueError, match="tokens_per_second must be finite"):
        mrope(ONE_IMAGE, grid, model="qwen2_5_vl", tokens_per_second=-1.0)
    # the op checks too, for direct callers
    with raw_raises(ValueError, "model must be 0"):
        torch.ops.posenc.mrope_position_ids(ONE_IMAGE, grid, None, None, None, 5, IMG, VID, VS,
                                            2, 2.0)


# ---------------------------------------------------------------------------------------
# Op registration: opcheck and torch.compile.


def test_opcheck_mrope_position_ids():
    ids, images, videos, mask, seconds = make_batch(4, "qwen2_5_vl", 2, "left")
    args = (ids, images, videos, mask, seconds, 1, IMG, VID, VS, 2, 2.0)
    torch.library.opcheck(torch.ops.posenc.mrope_position_ids, args)
    text = torch.randint(0, 1000, (3, 7))
    torch.library.opcheck(torch.ops.posenc.mrope_position_ids,
                          (text, None, None, None, None, 0,
                           IMG, VID, VS, 2, 0.0))
    torch.library.opcheck(torch.ops.posenc.mrope_position_ids,
                          (text, None, None, torch.ones(3, 7, dtype=torch.int64), None, 2,
                           IMG, VID, VS, 2, 0.0))
    # the 5.x rules: mm_token_type_ids, rules 1, time rules F32 (2) and F64 interval (3)
    args5 = (ids, images, videos, mask, seconds, 1, IMG, VID, VS, 2, 2.0, mm_types(ids), 1)
    torch.library.opcheck(torch.ops.posenc.mrope_position_ids, (*args5, 2))
    torch.library.opcheck(torch.ops.posenc.mrope_position_ids, (*args5, 3))


def test_opcheck_vision_position_ids():
    # Data-dependent output size: the fake kernel allocates an unbacked size, which the
    # faketensor and aot_dispatch checks exercise.
    torch.library.opcheck(torch.ops.posenc.vision_position_ids, (random_vision_grids(0), 2))


@pytest.mark.parametrize("convention", ["installed", "4.57", "5.18"])
def test_compile_fullgraph(convention):
    ids, images, videos, mask, seconds = make_batch(6, "qwen2_5_vl", 2, "mixed")
    types = mm_types(ids)

    def fn(ids, images, videos, mask, seconds):
        pos, deltas = compute_mrope_position_ids(
            ids, images, videos, mask, model="qwen2_5_vl", **IDS, second_per_grid_ts=seconds,
            mm_token_type_ids=types, convention=convention)
        return pos, compute_mrope_decode_position_ids(deltas, ids.shape[1], 2)

    # aot_eager: the op must trace as one node through dynamo and AOTAutograd; Inductor
    # would only add a slow C++ build around an opaque custom op.
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(ids, images, videos, mask, seconds), fn(ids, images, videos, mask,
                                                                    seconds)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_compile_fullgraph_decode():
    """The decode ids trace with a tensor past_length (cache_position) and a 5.x mask."""
    deltas = torch.tensor([[-2], [3]])
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :2] = 0

    def fn(deltas, past, mask):
        return (compute_mrope_decode_position_ids(deltas, past, 1, attention_mask=mask,
                                                  convention="5.17"),
                compute_mrope_decode_position_ids(deltas, past, 2))

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(deltas, torch.tensor([8]), mask), fn(deltas, torch.tensor([8]), mask)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_compile_fullgraph_vision_ids():
    grids = random_vision_grids(1)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(lambda g: vision_rotary_position_ids(g) * 1, fullgraph=True,
                                 backend="aot_eager")
        assert torch.equal(compiled(grids), vision_rotary_position_ids(grids))


def test_exported_names():
    for name in ("compute_mrope_position_ids", "compute_mrope_decode_position_ids",
                 "vision_rotary_position_ids"):
        assert name in posenc_torch.__all__ and hasattr(posenc_torch, name)
