"""posenc_torch.hf.precompute_vision_kwargs and the collators' vision kwargs against the
installed transformers' vision towers (tiny random models, nothing downloaded).

For each tower: the kwargs computed by posenc's walks give the tower's output bit for bit
(fp32) as its own computation does, for images and videos, several grids at once; a
corrupted entry changes the output (so the entries are read, not ignored); the padded and
packed collators' batches give the model's logits with and without the kwargs; a tower
whose vision function changed gets no kwargs (one warning); the graph breaks of the tower
under ``torch._dynamo.explain`` are counted with and without them.  Under transformers
4.57 (whose towers take no precomputed kwargs) the function returns none, with a warning.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from test_hf_positions import V5
from test_hf_positions import tiny_model as tiny_qwen
from test_packing import make_examples

import posenc_torch.hf as hf
from posenc_torch import packing
from posenc_torch.hf import _vision

pytestmark = pytest.mark.any_transformers
QWEN = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
OTHERS = ["glm4v", "glm4v_moe", "paddleocr_vl", "qwen3_5"]
EXPECTED_KEYS = {
    "qwen2_vl": {"position_ids", "cu_seqlens"},
    "qwen2_5_vl": {"position_ids", "cu_seqlens", "window_index", "cu_window_seqlens"},
    "qwen3_vl": {"position_ids", "cu_seqlens", "interp_indices", "interp_weights"},
    "qwen3_vl_moe": {"position_ids", "cu_seqlens", "interp_indices", "interp_weights"},
    "glm4v": {"position_ids", "cu_seqlens"},
    "glm4v_moe": {"position_ids", "cu_seqlens"},
    "paddleocr_vl": {"position_ids", "cu_seqlens", "interp_indices", "interp_weights"},
    "qwen3_5": {"position_ids", "cu_seqlens", "interp_indices", "interp_weights"},
}
v5 = pytest.mark.skipif(not V5, reason="transformers 4.57's towers take no precomputed "
                        "kwargs (test_no_kwargs_under_4_57 covers that release)")


def tiny(model_type: str):
    if model_type in QWEN:
        return tiny_qwen(model_type)
    from test_hf_models import tiny_config
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForImageTextToText.from_config(tiny_config(model_type),
                                                       attn_implementation="sdpa").eval()


def pixels(model, grids: torch.Tensor, seed: int = 3) -> torch.Tensor:
    vc = model.config.vision_config
    gen = torch.Generator().manual_seed(seed)
    n = int(grids.prod(-1).sum())
    if model.config.model_type == "paddleocr_vl":
        return torch.randn(n, vc.num_channels, vc.patch_size, vc.patch_size, generator=gen)
    return torch.randn(n, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                       generator=gen)


def features(model, kind: str, pix, grids, **kwargs):
    get = getattr(model.model, f"get_{kind}_features")
    with torch.no_grad():
        out = get(pix, grids, **kwargs)
    out = getattr(out, "pooler_output", out)
    return torch.cat(list(out)) if isinstance(out, (tuple, list)) else out


GRIDS = {"image": torch.tensor([[1, 8, 12], [1, 2, 2], [1, 4, 6]]),
         "video": torch.tensor([[3, 4, 8], [1, 6, 4]])}


@v5
@pytest.mark.parametrize("model_type", QWEN + OTHERS)
def test_the_tower_gives_its_own_output_with_the_kwargs(model_type):
    model = tiny(model_type)
    kinds = ["image"] + (["video"] if hasattr(model.model, "get_video_features")
                         and model_type != "paddleocr_vl" else [])
    for kind in kinds:
        grids = GRIDS[kind]
        kw = hf.precompute_vision_kwargs(model.config, **{f"{kind}_grid_thw": grids})
        assert {k.removeprefix(f"{kind}_") for k in kw} == EXPECTED_KEYS[model_type], kw.keys()
        # the model itself instead of its config: the same entries, the same values
        from_model = hf.precompute_vision_kwargs(model, **{f"{kind}_grid_thw": grids})
        assert kw.keys() == from_model.keys()
        assert all(torch.equal(kw[k], from_model[k]) for k in kw)
        pix = pixels(model, grids)
        plain = features(model, kind, pix, grids)
        assert torch.equal(features(model, kind, pix, grids, **kw), plain), kind
        # the entries are read: one of them changed moves the output
        key = f"{kind}_position_ids"
        moved = {**kw, key: kw[key].flip(0)}
        assert not torch.equal(features(model, kind, pix, grids, **moved), plain)


@v5
@pytest.mark.parametrize("model_type", QWEN)
@pytest.mark.parametrize("collate", ["padded", "packed"])
def test_collated_batches_give_the_same_logits_with_and_without_the_kwargs(model_type,
                                                                          collate):
    model = tiny_qwen(model_type)
    examples = make_examples(model_type, model.config)
    cls = (packing.MultimodalPaddingCollator if collate == "padded"
           else packing.MultimodalPackingCollator)
    with_kw = cls(model.config)(examples)
    without = cls(model.config, precompute_vision=False)(examples)
    added = set(with_kw) - set(without)
    assert added and all(k.startswith(("image_", "video_")) for k in added), added
    assert {k.split("_", 1)[1] for k in added} == EXPECTED_KEYS[model_type]
    with torch.no_grad():
        a = model(**with_kw).logits
        b = model(**without).logits
    assert torch.equal(a, b)


def test_the_padded_collator_pads_and_masks():
    model = tiny_qwen("qwen2_vl")
    examples = make_examples("qwen2_vl", model.config)
    for side in ("right", "left"):
        batch = packing.pad_multimodal_examples(examples, model.config, padding_side=side,
                                                pad_to_multiple_of=8, precompute_vision=False)
        lengths = [torch.as_tensor(e["input_ids"]).numel() for e in examples]
        assert batch["input_ids"].shape == (len(examples), -(-max(lengths) // 8) * 8)
        assert batch["attention_mask"].sum(1).tolist() == lengths
        assert ((batch["labels"] == -100) | (batch["attention_mask"] == 1)).all()
        kept = batch["attention_mask"] == 1
        for r, e in enumerate(examples):
            assert torch.equal(batch["input_ids"][r][kept[r]], torch.as_tensor(e["input_ids"]).view(-1))
    with pytest.raises(ValueError, match="padding_side"):
        packing.pad_multimodal_examples(examples, model.config, padding_side="middle")
    with pytest.raises(TypeError, match="precompute_vision"):
        packing.MultimodalPaddingCollator(model.config, precompute_vision="yes")


@v5
def test_a_changed_vision_function_gets_no_kwargs(monkeypatch):
    model = tiny_qwen("qwen2_5_vl")
    module = importlib.import_module("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
    real = module.get_vision_window_index

    def get_vision_window_index(grid_thw, spatial_merge_size, window_size, patch_size,
                                kwargs=None):
        index, cu = real(grid_thw, spatial_merge_size, window_size, patch_size, kwargs)
        return index.flip(0), cu

    monkeypatch.setattr(module, "get_vision_window_index", get_vision_window_index)
    monkeypatch.setattr(_vision, "_PLANS", type(_vision._PLANS)())
    monkeypatch.setattr(_vision, "_WARNED", set())
    with pytest.warns(hf.UnsupportedModelWarning, match="get_vision_window_index"):
        assert hf.precompute_vision_kwargs(model.config, GRIDS["image"]) == {}
    monkeypatch.setattr(module, "get_vision_window_index", real)
    monkeypatch.setattr(_vision, "_PLANS", type(_vision._PLANS)())
    assert hf.precompute_vision_kwargs(model.config, GRIDS["image"])


@v5
def test_bad_grids_name_the_row():
    model = tiny_qwen("qwen2_vl")
    with pytest.raises(ValueError, match=r"image_grid_thw\[1\]"):
        hf.precompute_vision_kwargs(model.config, torch.tensor([[1, 4, 4], [1, 3, 4]]))
    with pytest.raises(ValueError, match=r"video_grid_thw\[0\]"):
        hf.precompute_vision_kwargs(model.config, video_grid_thw=torch.tensor([[0, 4, 4]]))
    with pytest.raises(TypeError, match="image_grid_thw"):
        hf.precompute_vision_kwargs(model.config, torch.tensor([[1.0, 4, 4]]))
    with pytest.raises(TypeError, match="config_or_model"):
        hf.precompute_vision_kwargs(object(), torch.tensor([[1, 4, 4]]))


@pytest.mark.transformers4
def test_no_kwargs_under_4_57(monkeypatch):
    model = tiny_qwen("qwen2_vl")
    monkeypatch.setattr(_vision, "_WARNED", set())
    with pytest.warns(hf.UnsupportedModelWarning, match="takes no precomputed"):
        assert hf.precompute_vision_kwargs(model.config, GRIDS["image"]) == {}


def _breaks(model, kind, pix, grids, **kw) -> int:
    import torch._dynamo as dynamo

    dynamo.reset()
    get = getattr(model.model, f"get_{kind}_features")
    explanation = dynamo.explain(lambda p: get(p, grids, **kw))(pix)
    return explanation.graph_break_count


@v5
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_graph_breaks_of_the_tower(model_type, record_property):
    """torch._dynamo.explain of the image tower with and without the precomputed kwargs:
    fewer graph breaks with them (the counts are recorded for the report)."""
    model = tiny_qwen(model_type)
    grids = GRIDS["image"]
    pix = pixels(model, grids)
    kw = hf.precompute_vision_kwargs(model.config, image_grid_thw=grids)
    without, with_kw = _breaks(model, "image", pix, grids), _breaks(model, "image", pix, grids,
                                                                   **kw)
    record_property("graph_breaks", {"without": without, "with": with_kw})
    print(f"{model_type}: graph breaks without kwargs {without}, with {with_kw}")
    assert with_kw < without


@v5
@pytest.mark.parametrize("model_type", QWEN + OTHERS)
def test_patch_routes_the_towers_own_calls_to_the_walks(model_type):
    model = tiny(model_type)
    grids = GRIDS["image"]
    pix = pixels(model, grids)
    plain = features(model, "image", pix, grids)
    with hf.patch(model_type) as handle:
        routed = {t for t in handle.targets if ".get_vision_" in t}
        assert routed, handle.targets
        assert torch.equal(features(model, "image", pix, grids), plain)
        assert all(handle.calls[t] > 0 for t in routed), handle.calls
        assert all(handle.fallbacks[t] == 0 for t in routed), handle.fallbacks
        # with precomputed kwargs the routes hand them over and compute nothing
        before = dict(handle.calls)
        kw = hf.precompute_vision_kwargs(model.config, image_grid_thw=grids)
        assert torch.equal(features(model, "image", pix, grids, **kw), plain)
        assert all(handle.calls[t] == before[t] for t in routed)


@v5
def test_a_route_whose_function_changed_falls_back(monkeypatch):
    model = tiny_qwen("qwen2_vl")
    module = importlib.import_module("transformers.models.qwen2_vl.modeling_qwen2_vl")
    real = module.get_vision_position_ids

    def get_vision_position_ids(grid_thw, spatial_merge_size, include_temporal=False,
                                kwargs=None):
        return real(grid_thw, spatial_merge_size, include_temporal, kwargs).flip(-1)

    monkeypatch.setattr(module, "get_vision_position_ids", get_vision_position_ids)
    grids = GRIDS["image"]
    pix = pixels(model, grids)
    changed = features(model, "image", pix, grids)
    with hf.patch("qwen2_vl") as handle:
        assert torch.equal(features(model, "image", pix, grids), changed)
        # a function of another module, not vision_utils': not routed at all
        assert "qwen2_vl.get_vision_position_ids" not in handle.targets
        assert handle.calls["qwen2_vl.get_vision_attention_seqlens"] > 0
