"""posenc_torch.vision against transformers' own vision helpers.

Under transformers 5.x the reference is ``transformers.vision_utils`` (the same file in
5.17.0, 5.18.0 and 5.25.0; `make test` runs this module under each).  Under 4.57.6 (the
``transformers4`` tests, `make pytest-hf4`) the same logic lives in the vision models'
methods, called on stand-ins holding only what they read (``rot_pos_emb``,
``get_window_index``, ``fast_pos_embed_interpolate``), and the ``cu_seqlens`` /
``cu_window_seqlens`` lines of the towers' forward, captured from tiny random towers.

Fuzzed batches (fixed seeds): images and videos (t > 1), 1x2x2 grids, merge sizes 1, 2 and
4, grids that windows do not divide, tables whose side does and does not divide the grid,
empty lists.  Integers must be identical, weights bit for bit (their int32 views equal, so
-0.0 is not 0.0), dtypes equal.  Also: the worked examples of csrc/posenc.h, bad grids naming
their row, inputs never modified, opcheck and torch.compile(fullgraph=True).
"""

from __future__ import annotations

import random
import types
import warnings

import pytest
import torch

import posenc_torch
from posenc_torch import vision as V

FUZZ_BATCHES = 1500


def _hf():
    return pytest.importorskip(
        "transformers.vision_utils",
        reason="this transformers has no vision_utils (the 5.x home of the vision helpers)")


def random_grids(rng: random.Random, merge: int, n: int | None = None,
                 largest: int = 40) -> torch.Tensor:
    """A batch of (t, h, w) patch grids with h, w multiples of ``merge``: images and videos,
    now and then the smallest grid (1, 2, 2) (when merge allows it), sometimes none."""
    n = rng.choice((0, 1, 1, 2, 3, 4, 6)) if n is None else n
    rows = []
    for _ in range(n):
        if merge <= 2 and rng.random() < 0.1:
            rows.append((1, 2, 2))
            continue
        t = 1 if rng.random() < 0.6 else rng.randint(2, 5)
        side = largest // merge
        rows.append((t, merge * rng.randint(1, side), merge * rng.randint(1, side)))
    return torch.tensor(rows, dtype=torch.int64).reshape(n, 3)


def batches(seed: int, count: int = FUZZ_BATCHES, nonempty: bool = False):
    """(grids, merge size) pairs."""
    rng = random.Random(seed)
    for _ in range(count):
        merge = rng.choice((1, 2, 2, 4))
        grids = random_grids(rng, merge, rng.randint(1, 6) if nonempty else None)
        yield rng, grids, merge


def assert_same(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.dtype == theirs.dtype, f"{what}: dtype {ours.dtype} != {theirs.dtype}"
    assert ours.shape == theirs.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(theirs.shape)}"
    if ours.dtype == torch.float32:
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), what
    else:
        assert torch.equal(ours, theirs), what


def raises_on_empty(call) -> bool:
    try:
        call()
    except (RuntimeError, ValueError):
        return True
    return False


# ------------------------------------------------------------------- worked examples


def test_examples_of_the_specification():
    ids = V.get_vision_position_ids(torch.tensor([[1, 4, 4]]), 2)
    assert ids.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3],
                            [2, 0], [2, 1], [3, 0], [3, 1], [2, 2], [2, 3], [3, 2], [3, 3]]
    three = V.get_vision_position_ids(torch.tensor([[2, 2, 4]]), 2, include_temporal=True)
    frame = [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    assert three.tolist() == [[f, *p] for f in (0, 1) for p in frame]
    grids = torch.tensor([[2, 4, 4], [1, 2, 6]])
    assert V.get_vision_cu_seqlens(grids).tolist() == [0, 16, 32, 44]
    assert V.get_vision_attention_seqlens(grids, merge_temporal=True)[0].tolist() == [0, 32, 44]
    cu, longest = V.get_vision_attention_seqlens(grids)
    assert cu.tolist() == [0, 16, 32, 44] and longest == 16
    index, cu = V.get_vision_window_index(torch.tensor([[1, 8, 12]]), 2, 112, 14)
    assert index.tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15, 18, 19, 20, 21,
                              4, 5, 10, 11, 16, 17, 22, 23]
    assert cu.tolist() == [0, 64, 96] and cu.dtype == torch.int32
    index, cu = V.get_vision_window_index(torch.tensor([[1, 8, 8], [2, 4, 6]]), 2, 112, 14)
    assert index.tolist() == list(range(28)) and cu.tolist() == [0, 64, 88, 112]
    taps, weights = V.get_vision_interpolation_indices_and_weights(torch.tensor([[1, 2, 3]]), 2)
    assert taps[[0, 1, 5]].tolist() == [[0, 0, 2, 2], [0, 1, 2, 3], [3, 3, 3, 3]]
    f32 = torch.tensor([0.16666663, 0.83333337, 0.5, 0.0], dtype=torch.float32)
    assert torch.equal(weights[0], f32[[0, 1, 3, 3]]) and torch.equal(weights[1], f32[[2, 2, 3, 3]])
    assert torch.equal(weights[5], f32[[1, 0, 3, 3]])
    _, zeros = V.get_vision_interpolation_indices_and_weights(torch.tensor([[1, 2, 3]]), 2,
                                                              padding="zeros")
    assert torch.equal(zeros[0], f32[[3, 1, 3, 3]])
    near = V.get_vision_nearest_position_ids(torch.tensor([[2, 3]]), 4)
    assert near.tolist() == [0, 1, 2, 8, 9, 10]
    assert V.get_vision_merged_shape(torch.tensor([[8, 12], [8, 12]]), (2, 4)) == (4, 3)


def test_empty_lists_give_empty_results():
    none = torch.empty(0, 3, dtype=torch.int64)
    assert V.get_vision_position_ids(none, 2).shape == (0, 2)
    assert V.get_vision_position_ids(none, 2, True).shape == (0, 3)
    assert V.get_vision_cu_seqlens(none).tolist() == [0]
    cu, longest = V.get_vision_attention_seqlens(none)
    assert cu.tolist() == [0] and longest == 0
    index, cu = V.get_vision_window_index(none, 2, 112, 14)
    assert index.shape == (0,) and cu.tolist() == [0]
    taps, weights = V.get_vision_interpolation_indices_and_weights(none, 48, "bicubic")
    assert taps.shape == weights.shape == (0, 16) and weights.dtype == torch.float32
    assert V.get_vision_nearest_position_ids(torch.empty(0, 2, dtype=torch.long), 8).shape == (0,)


# --------------------------------------------------------- transformers 5.x: vision_utils


def test_position_ids_fuzz():
    hf = _hf()
    for rng, grids, merge in batches(1):
        temporal = rng.random() < 0.3
        if len(grids) == 0:
            assert raises_on_empty(lambda: hf.get_vision_position_ids(grids, merge))
            continue
        what = f"grids {grids.tolist()}, merge {merge}, temporal {temporal}"
        assert_same(V.get_vision_position_ids(grids, merge, temporal),
                    hf.get_vision_position_ids(grids, merge, temporal), what)


def test_position_ids_per_grid_merge_sizes():
    """VideoLLaMA3 passes one merge size per grid, as a tensor."""
    hf = _hf()
    rng = random.Random(2)
    for _ in range(300):
        merges = [rng.choice((1, 2, 4)) for _ in range(rng.randint(1, 5))]
        grids = torch.cat([random_grids(rng, m, 1) for m in merges])
        sizes = torch.tensor(merges)
        temporal = rng.random() < 0.3
        assert_same(V.get_vision_position_ids(grids, sizes, temporal),
                    hf.get_vision_position_ids(grids, sizes, temporal),
                    f"{grids.tolist()} {merges}")


def test_cu_seqlens_fuzz():
    hf = _hf()
    for rng, grids, _ in batches(3):
        merge_temporal = rng.random() < 0.5
        what = f"grids {grids.tolist()}, merge_temporal {merge_temporal}"
        assert_same(V.get_vision_cu_seqlens(grids, merge_temporal),
                    hf.get_vision_cu_seqlens(grids, merge_temporal), what)


@pytest.mark.parametrize("implementation", ["flash_attention_2", "sdpa", "eager", None])
def test_attention_seqlens(implementation):
    hf = _hf()
    config = types.SimpleNamespace(_attn_implementation=implementation)
    for rng, grids, _ in batches(4, 200, nonempty=True):
        merge_temporal = rng.random() < 0.5
        cu, longest = V.get_vision_attention_seqlens(grids, config, merge_temporal)
        want_cu, want_longest = hf.get_vision_attention_seqlens(grids, config, merge_temporal)
        assert_same(cu, want_cu, f"{grids.tolist()}")
        assert longest == want_longest and type(longest) is type(want_longest)


def test_window_index_fuzz():
    """Qwen2.5-VL (window 112, patch 14), the same with other merge and patch sizes, and
    MiniCPM-V 4.6's use (merge 1, patch 1, the window side as window_size): grids that
    windows do and do not divide, so that padding leaves empty windows."""
    hf = _hf()
    for rng, grids, merge in batches(5):
        patch = rng.choice((1, 2, 14))
        window = merge * patch * rng.randint(1, 6) + rng.randrange(merge * patch)
        if len(grids) == 0:
            assert raises_on_empty(lambda: hf.get_vision_window_index(grids, merge, window, patch))
            continue
        what = f"grids {grids.tolist()}, merge {merge}, window {window}, patch {patch}"
        ours = V.get_vision_window_index(grids, merge, window, patch)
        theirs = hf.get_vision_window_index(grids, merge, window, patch)
        assert_same(ours[0], theirs[0], what + " (window_index)")
        assert_same(ours[1], theirs[1], what + " (cu_window_seqlens)")


def interpolation_cases(seed: int, count: int):
    """(grids, side, mode, align_corners, merge, padding), every flag combination."""
    for rng, grids, merge in batches(seed, count):
        side = rng.choice((1, 2, 3, 7, 16, 27, 32, 48, 64))
        if len(grids) and rng.random() < 0.3:  # a side dividing (or equal to) a grid side
            h = int(grids[0, 1])
            side = rng.choice([d for d in range(1, h + 1) if h % d == 0])
        yield (grids, side, rng.choice(("bilinear", "bicubic")), rng.random() < 0.5, merge,
               rng.choice(("border", "zeros")))


def test_interpolation_fuzz():
    hf = _hf()
    for grids, side, mode, align, merge, padding in interpolation_cases(6, FUZZ_BATCHES):
        args = (grids, side, mode, align, merge, padding)
        if len(grids) == 0:
            assert raises_on_empty(lambda: hf.get_vision_interpolation_indices_and_weights(*args))
            continue
        what = f"grids {grids.tolist()}, side {side}, {mode}, align_corners {align}, " \
               f"merge {merge}, {padding}"
        ours = V.get_vision_interpolation_indices_and_weights(*args)
        theirs = hf.get_vision_interpolation_indices_and_weights(*args)
        assert_same(ours[0], theirs[0], what + " (indices)")
        assert_same(ours[1], theirs[1], what + " (weights)")


@pytest.mark.parametrize("model,side,mode,align,merge,padding", [
    ("qwen3_vl", 48, "bilinear", True, 2, "border"),        # also qwen3_vl_moe, qwen3_5, ...
    ("paddleocr_vl", 27, "bilinear", False, 1, "border"),   # 5.25 (True under 5.17, 5.18)
    ("kimi_k25", 64, "bicubic", False, 1, "border"),
    ("muse_glimmer", 32, "bilinear", False, 1, "zeros"),
])
def test_interpolation_real_model_settings(model, side, mode, align, merge, padding):
    """The settings of the models that call the function, on the image sizes they see."""
    hf = _hf()
    grids = torch.tensor([[1, 64, 64], [1, 16, 16], [4, 32, 48], [1, 2, 2], [2, 98, 74]])
    if merge == 1:
        grids[3] = torch.tensor([1, 1, 3])
    ours = V.get_vision_interpolation_indices_and_weights(grids, side, mode, align, merge, padding)
    theirs = hf.get_vision_interpolation_indices_and_weights(grids, side, mode, align, merge,
                                                             padding)
    assert_same(ours[0], theirs[0], model)
    assert_same(ours[1], theirs[1], model)


def test_bilinear_indices_and_weights():
    hf = _hf()
    for rng, grids, merge in batches(7, 100, nonempty=True):
        side = rng.choice((5, 16, 48))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = hf.get_vision_bilinear_indices_and_weights(grids, side, merge)
        ours = V.get_vision_bilinear_indices_and_weights(grids, side, merge)
        for o, t in zip(ours, theirs, strict=True):
            assert_same(o, t, f"{grids.tolist()}")
            assert o.stride() == t.stride()


def test_nearest_position_ids_fuzz():
    hf = _hf()
    rng = random.Random(8)
    for _ in range(FUZZ_BATCHES):
        side = rng.randint(1, 100)
        n = rng.choice((1, 1, 2, 4))
        sizes = torch.tensor([[rng.randint(1, 80), rng.randint(1, 80)] for _ in range(n)],
                             dtype=rng.choice((torch.int64, torch.int32)))
        assert_same(V.get_vision_nearest_position_ids(sizes, side),
                    hf.get_vision_nearest_position_ids(sizes, side), f"{sizes.tolist()}, {side}")


def test_merged_shape():
    hf = _hf()
    rng = random.Random(9)
    for _ in range(50):
        sizes = torch.tensor([[rng.randint(1, 90), rng.randint(1, 90)]] * rng.randint(1, 3))
        window = (rng.randint(1, 4), rng.randint(1, 4))
        assert V.get_vision_merged_shape(sizes, window) == hf.get_vision_merged_shape(sizes,
                                                                                       window)


# ---------------------------------------------------- transformers 4.57.6: the methods


def _hf4(module: str):
    import transformers

    if int(transformers.__version__.split(".")[0]) != 4:
        pytest.skip("needs transformers 4.x")
    return pytest.importorskip(f"transformers.models.{module}.modeling_{module}")


def _id_table(n: int) -> torch.Tensor:
    """A 'rotary table' whose row i is i: gathering it with position ids gives the ids."""
    return torch.arange(n, dtype=torch.float32)[:, None]


@pytest.mark.transformers4
@pytest.mark.parametrize("module,tower", [
    ("qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    ("qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
    ("qwen2_5_omni", "Qwen2_5OmniVisionEncoder"),
    ("qwen3_vl", "Qwen3VLVisionModel"),
    ("qwen3_vl_moe", "Qwen3VLMoeVisionModel"),
    ("qwen3_omni_moe", "Qwen3OmniMoeVisionEncoder"),
    ("glm4v", "Glm4vVisionModel"),
])
def test_rot_pos_emb_4_57(module, tower):
    """rot_pos_emb gathers a frequency table with the position ids: with a table whose row i
    is i it returns the ids themselves (GLM-4V also returns them)."""
    cls = getattr(_hf4(module), tower)
    for rng, grids, merge in batches(10, 300, nonempty=True):
        owner = types.SimpleNamespace(spatial_merge_size=merge, rotary_pos_emb=_id_table)
        out = cls.rot_pos_emb(owner, grids)
        if module == "glm4v":
            emb, ids = out
            assert_same(V.get_vision_position_ids(grids, merge), ids, f"{grids.tolist()}")
            out = emb
        ours = V.get_vision_position_ids(grids, merge).float()
        assert torch.equal(out, ours), f"{module}: {grids.tolist()}, merge {merge}"


@pytest.mark.transformers4
@pytest.mark.parametrize("module,tower", [
    ("qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
    ("qwen2_5_omni", "Qwen2_5OmniVisionEncoder"),
])
def test_get_window_index_4_57(module, tower):
    """get_window_index returns the index and the boundary list; forward turns the list into
    int32 and drops repeats (torch.unique_consecutive), done here as it does."""
    cls = getattr(_hf4(module), tower)
    for rng, grids, merge in batches(11, 600, nonempty=True):
        patch = rng.choice((1, 2, 14))
        window = merge * patch * rng.randint(1, 6) + rng.randrange(merge * patch)
        owner = types.SimpleNamespace(window_size=window, spatial_merge_size=merge,
                                      patch_size=patch, spatial_merge_unit=merge * merge)
        index, boundaries = cls.get_window_index(owner, grids)
        cu = torch.unique_consecutive(torch.tensor(boundaries, dtype=torch.int32))
        ours = V.get_vision_window_index(grids, merge, window, patch)
        what = f"{grids.tolist()}, merge {merge}, window {window}, patch {patch}"
        assert_same(ours[0], index, what)
        assert_same(ours[1], cu, what)


@pytest.mark.transformers4
@pytest.mark.parametrize("module,tower", [
    ("qwen3_vl", "Qwen3VLVisionModel"),
    ("qwen3_vl_moe", "Qwen3VLMoeVisionModel"),
    ("qwen3_omni_moe", "Qwen3OmniMoeVisionEncoder"),
])
def test_fast_pos_embed_interpolate_4_57(module, tower):
    """fast_pos_embed_interpolate gathers a learned table with its taps and weighs them: the
    same sums from our taps and weights (convention "4.57") are bit for bit its output."""
    cls = getattr(_hf4(module), tower)
    for rng, grids, merge in batches(12, 400, nonempty=True):
        side = rng.choice((2, 3, 7, 16, 27, 48))
        table = torch.nn.Embedding(side * side, 3)
        owner = types.SimpleNamespace(num_grid_per_side=side, pos_embed=table,
                                      config=types.SimpleNamespace(spatial_merge_size=merge))
        with torch.no_grad():
            theirs = cls.fast_pos_embed_interpolate(owner, grids)
            taps, weights = V.get_vision_interpolation_indices_and_weights(
                grids, side, "bilinear", True, merge, convention="4.57")
            embeds = table(taps.T) * weights.T[:, :, None]
            ours = embeds[0] + embeds[1] + embeds[2] + embeds[3]
        assert torch.equal(ours, theirs), f"{module}: {grids.tolist()}, side {side}, merge {merge}"


def _tiny_tower(module: str):
    if module == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as Tower)
        config = Qwen2VLVisionConfig(depth=1, embed_dim=16, hidden_size=16, num_heads=2,
                                     mlp_ratio=1, patch_size=2, temporal_patch_size=1,
                                     in_channels=1, spatial_merge_size=2)
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLVisionConfig)
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower)
        config = Qwen2_5_VLVisionConfig(depth=2, hidden_size=16, out_hidden_size=16,
                                        intermediate_size=16, num_heads=2, patch_size=2,
                                        temporal_patch_size=1, in_channels=1,
                                        spatial_merge_size=2, window_size=8,
                                        fullatt_block_indexes=[1])
    config._attn_implementation = "eager"
    return Tower._from_config(config).eval(), config


@pytest.mark.transformers4
@pytest.mark.parametrize("module", ["qwen2_vl", "qwen2_5_vl"])
def test_forward_boundaries_4_57(module):
    """The cu_seqlens (and Qwen2.5-VL's cu_window_seqlens) that 4.57's tower forward hands
    its blocks, captured from a tiny random tower."""
    _hf4(module)
    tower, config = _tiny_tower(module)
    seen: list[torch.Tensor] = []
    for block in tower.blocks:
        block.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append(kwargs["cu_seqlens"]), with_kwargs=True)
    rng = random.Random(13)
    for _ in range(25):
        grids = random_grids(rng, 2, rng.randint(1, 4), largest=12)
        patches = int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum())
        seen.clear()
        with torch.no_grad():
            tower(torch.randn(patches, config.patch_size ** 2), grids)
        assert_same(V.get_vision_cu_seqlens(grids), seen[-1], f"{grids.tolist()}")
        if module == "qwen2_5_vl":  # block 0 is windowed, block 1 full attention
            _, cu_window = V.get_vision_window_index(grids, 2, config.window_size,
                                                     config.patch_size)
            assert_same(cu_window, seen[0], f"{grids.tolist()} (windows)")


# ------------------------------------------------------------------- bad grids, inputs

GRIDS_ONLY = {
    "get_vision_position_ids": lambda g: V.get_vision_position_ids(g, 2),
    "get_vision_position_ids(temporal)": lambda g: V.get_vision_position_ids(g, 2, True),
    "get_vision_window_index": lambda g: V.get_vision_window_index(g, 2, 112, 14),
    "get_vision_interpolation_indices_and_weights": lambda g: (
        V.get_vision_interpolation_indices_and_weights(g, 48, "bicubic", False, 2)),
    "get_vision_bilinear_indices_and_weights": lambda g: (
        V.get_vision_bilinear_indices_and_weights(g, 48, 2)),
    "vision_rotary_position_ids": lambda g: V.vision_rotary_position_ids(g, 2),
}
NO_MERGE = {  # read no merge size: a grid not divisible by 2 is fine
    "get_vision_cu_seqlens": lambda g: V.get_vision_cu_seqlens(g),
    "get_vision_attention_seqlens": lambda g: V.get_vision_attention_seqlens(g, None, True),
}


@pytest.mark.parametrize("name", [*GRIDS_ONLY, *NO_MERGE])
@pytest.mark.parametrize("bad,fragment", [
    ([[1, 4, 4], [1, 4, 4], [1, 4, 4], [1, -2, 4]], r"grid_thw\[3\] = \(1, -2, 4\) .*positive"),
    ([[1, 4, 4], [0, 4, 4]], r"grid_thw\[1\] = \(0, 4, 4\) .*positive"),
    ([[1, 4, 0]], r"grid_thw\[0\] = \(1, 4, 0\) .*positive"),
    ([[1, 4, 4], [2, 6, 5]], r"grid_thw\[1\] = \(2, 6, 5\) .*divisible by spatial_merge_size = 2"),
])
def test_bad_grid_values_name_the_row(name, bad, fragment):
    call = {**GRIDS_ONLY, **NO_MERGE}[name]
    grids = torch.tensor(bad)
    if name in NO_MERGE and "divisible" in fragment:
        call(grids)
        return
    for g in (grids, grids.int(), grids.t().contiguous().t()):  # int32 and strided too
        with pytest.raises(ValueError, match=fragment):
            call(g)


@pytest.mark.parametrize("name", [*GRIDS_ONLY, *NO_MERGE])
def test_bad_grid_types_and_shapes(name):
    call = {**GRIDS_ONLY, **NO_MERGE}[name]
    with pytest.raises(TypeError, match="grid_thw must be an integer tensor"):
        call(torch.ones(2, 3))
    with pytest.raises(TypeError, match="grid_thw must be an integer tensor"):
        call(torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="grid_thw must be a torch.Tensor"):
        call([[1, 2, 2]])
    for shape in ((3,), (2, 2), (2, 4), (1, 2, 3)):
        with pytest.raises(ValueError, match=r"grid_thw must .*\(num_grids, 3\)"):
            call(torch.ones(shape, dtype=torch.long))


def test_bad_per_grid_merge_sizes():
    grids = torch.tensor([[1, 4, 4], [1, 4, 6]])
    with pytest.raises(ValueError, match=r"spatial_merge_size\[1\] is 0"):
        V.get_vision_position_ids(grids, torch.tensor([2, 0]))
    with pytest.raises(ValueError, match=r"grid_thw\[1\] = \(1, 4, 6\) .*"
                                         r"spatial_merge_size\[1\] = 4"):
        V.get_vision_position_ids(grids, torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="one entry per row of grid_thw"):
        V.get_vision_position_ids(grids, torch.tensor([2]))
    with pytest.raises(TypeError, match="spatial_merge_size must be an integer tensor"):
        V.get_vision_position_ids(grids, torch.tensor([2.0, 2.0]))


def test_bad_options():
    g = torch.tensor([[1, 4, 4]])
    with pytest.raises(ValueError, match="window_size .* must be at least"):
        V.get_vision_window_index(g, 2, 27, 14)
    with pytest.raises(ValueError, match="mode must be one of"):
        V.get_vision_interpolation_indices_and_weights(g, 4, "nearest")
    with pytest.raises(ValueError, match="padding must be one of"):
        V.get_vision_interpolation_indices_and_weights(g, 4, padding="reflect")
    with pytest.raises(ValueError, match="convention='4.57'"):
        V.get_vision_interpolation_indices_and_weights(g, 4, "bicubic", True, convention="4.57")
    with pytest.raises(ValueError, match="convention must be one of"):
        V.get_vision_interpolation_indices_and_weights(g, 4, convention="4.40")
    with pytest.raises(TypeError, match="align_corners must be a bool"):
        V.get_vision_interpolation_indices_and_weights(g, 4, align_corners=1)
    with pytest.raises(ValueError, match="num_grid_per_side must be >= 1"):
        V.get_vision_interpolation_indices_and_weights(g, 0)
    with pytest.raises(ValueError, match=r"target_sizes\[1\] = \(3, 0\)"):
        V.get_vision_nearest_position_ids(torch.tensor([[2, 2], [3, 0]]), 4)
    with pytest.raises(ValueError, match=r"target_sizes must have shape \(num_images, 2\)"):
        V.get_vision_nearest_position_ids(g, 4)
    with pytest.raises(ValueError, match=r"grid_thw\[1\] .* pass 2\^31 - 1"):
        V.get_vision_cu_seqlens(torch.tensor([[1, 2, 2], [1, 2**16, 2**16]]))


def test_inputs_are_not_modified():
    rng = random.Random(14)
    for _ in range(50):
        merge = rng.choice((1, 2))
        base = random_grids(rng, merge, rng.randint(1, 4))
        for grids in (base, base.int(), base.t().contiguous().t()):
            before = grids.clone()
            merges = torch.full((len(grids),), merge)
            V.get_vision_position_ids(grids, merges, True)
            V.get_vision_position_ids(grids, merge)
            V.get_vision_attention_seqlens(grids)
            V.get_vision_window_index(grids, merge, 112, 14)
            V.get_vision_interpolation_indices_and_weights(grids, 16, "bicubic", True, merge,
                                                           "zeros")
            V.get_vision_nearest_position_ids(grids[:, 1:], 16)
            assert torch.equal(grids, before) and grids.dtype == before.dtype
            assert torch.equal(merges, torch.full((len(grids),), merge))


# ------------------------------------------------------------------- ops, compile

def _op_samples():
    g = torch.tensor([[1, 4, 4], [2, 2, 6], [3, 8, 4]])
    ops = torch.ops.posenc
    return [
        (ops.vision_position_ids, (g, 2)),
        (ops.vision_position_ids, (g.int(), 1, torch.tensor([2, 2, 4]), True)),
        (ops.vision_cu_seqlens, (g, False)),
        (ops.vision_cu_seqlens, (g, True)),
        (ops.vision_window_index, (g, 2, 56, 14)),
        (ops.vision_interpolation, (g, 5, 0, True, 2, 0, 0)),
        (ops.vision_interpolation, (g, 7, 1, False, 1, 1, 0)),
        (ops.vision_interpolation, (g, 7, 0, True, 2, 0, 1)),
        (ops.vision_nearest_position_ids, (g[:, 1:], 7)),
    ]


@pytest.mark.parametrize("sample", range(len(_op_samples())))
def test_opcheck(sample):
    op, args = _op_samples()[sample]
    torch.library.opcheck(op, args)


COMPILED = {
    "position_ids": lambda g: V.get_vision_position_ids(g, 2) + 0,
    "position_ids_temporal": lambda g: V.get_vision_position_ids(g, 2, True) + 0,
    "cu_seqlens": lambda g: V.get_vision_cu_seqlens(g) + 0,
    "cu_seqlens_clip": lambda g: V.get_vision_cu_seqlens(g, True) + 0,
    "attention_seqlens": lambda g: V.get_vision_attention_seqlens(g)[0] + 0,
    "window_index": lambda g: [t + 0 for t in V.get_vision_window_index(g, 2, 56, 14)],
    "interpolation": lambda g: [t + 0 for t in V.get_vision_interpolation_indices_and_weights(
        g, 7, "bicubic", False, 2, "zeros")],
    "interpolation_4_57": lambda g: [t + 0 for t in V.get_vision_interpolation_indices_and_weights(
        g, 7, "bilinear", True, 2, convention="4.57")],
    "nearest": lambda g: V.get_vision_nearest_position_ids(g[:, 1:], 7) + 0,
    "rotary_ids": lambda g: V.vision_rotary_position_ids(g) + 0,
}


@pytest.mark.parametrize("name", list(COMPILED))
def test_compile_fullgraph(name):
    fn = COMPILED[name]
    grids = torch.tensor([[1, 4, 4], [2, 2, 6], [3, 8, 4]])
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        for g in (grids, grids[:2]):
            got, want = compiled(g), fn(g)
            for a, b in zip(got if isinstance(got, list) else [got],
                            want if isinstance(want, list) else [want], strict=True):
                assert_same(a, b, name)


def test_threads_do_not_change_results():
    rng = random.Random(15)
    grids = torch.cat([random_grids(rng, 2, 8, largest=64), torch.tensor([[4, 256, 256]])])
    calls = [lambda: V.get_vision_position_ids(grids, 2, True),
             lambda: V.get_vision_window_index(grids, 2, 112, 14),
             lambda: V.get_vision_interpolation_indices_and_weights(grids, 48, "bicubic"),
             lambda: V.get_vision_nearest_position_ids(grids[:, 1:], 48)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = [c() for c in calls]
        torch.set_num_threads(max(2, threads))
        for c, want in zip(calls, serial, strict=True):
            got = c()
            for a, b in zip(got if isinstance(got, tuple) else [got],
                            want if isinstance(want, tuple) else [want], strict=True):
                assert_same(a, b, "threads")
    finally:
        torch.set_num_threads(threads)


def test_exported():
    assert posenc_torch.vision is V
    assert posenc_torch.vision_rotary_position_ids is V.vision_rotary_position_ids
    from posenc_torch import positions

    assert positions.vision_rotary_position_ids is V.vision_rotary_position_ids
    for name in V.__all__:
        assert callable(getattr(V, name)), name
