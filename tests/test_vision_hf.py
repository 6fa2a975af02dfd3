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

from posenc_torch.hf import _digests, _handle, _table, _tower_methods_457
from posenc_torch.hf.verify._towers import _same as same
from posenc_torch.hf.verify._towers import check_method
from posenc_torch.hf._handle import PatchHandle

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

    assert hf.precompute_vision_kwargs(model.config, GRIDS["image"])  # (the plan is kept)
    monkeypatch.setattr(module, "get_vision_window_index", get_vision_window_index)
    monkeypatch.setattr(_handle, "_WARNED", set())
    with pytest.warns(hf.UnsupportedModelWarning, match="get_vision_window_index"):
        assert hf.precompute_vision_kwargs(model.config, GRIDS["image"]) == {}
    monkeypatch.setattr(module, "get_vision_window_index", real)
    assert hf.precompute_vision_kwargs(model.config, GRIDS["image"])


@v5
def test_a_vision_function_verified_in_the_users_table_file_gets_kwargs(monkeypatch, tmp_path):
    """A vision_utils function whose code the shipped table does not hold gets no kwargs;
    with the verify command's row for it in the user's table file it gets them (the
    plan's functions are looked up in that file as the plan is), the same entries."""
    import linecache

    from posenc_torch.hf import verify
    from posenc_torch.hf.verify._walks import check

    model = tiny_qwen("qwen2_5_vl")
    module = importlib.import_module("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
    name = "get_vision_window_index"
    expected = hf.precompute_vision_kwargs(model.config, GRIDS["image"])
    source = (f"def {name}(grid_thw, spatial_merge_size, window_size, patch_size, kwargs=None):\n"
              "    index, cu = real(grid_thw, spatial_merge_size, window_size, patch_size, "
              "kwargs)\n    return index, cu\n")
    filename = f"<{name} of its own>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"real": getattr(module, name)}
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    func = namespace[name]
    assert check(name, func) is None
    monkeypatch.setattr(module, name, func)
    monkeypatch.setattr(_handle, "_WARNED", set())
    with pytest.warns(hf.UnsupportedModelWarning, match="no verified table holds"):
        assert hf.precompute_vision_kwargs(model.config, GRIDS["image"]) == {}
    path = tmp_path / "table.json"
    verify.write(path, [{"digest": _digests.digest(func), "function": name, "use": name,
                         "releases": [importlib.import_module("transformers").__version__]}])
    monkeypatch.setenv(_table.ENV, str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UnsupportedModelWarning)
        got = hf.precompute_vision_kwargs(model.config, GRIDS["image"])
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)


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
    monkeypatch.setattr(_handle, "_WARNED", set())
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
        # a function whose code is not verified: not routed at all
        assert "qwen2_vl.get_vision_position_ids" not in handle.targets
        assert handle.calls["qwen2_vl.get_vision_attention_seqlens"] > 0


@v5
def test_an_empty_grid_list_goes_to_transformers():
    """Under patch() a grid list with no rows reaches transformers' function: its result or
    its error, as without the patch."""
    module = importlib.import_module("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
    empty = torch.zeros(0, 3, dtype=torch.int64)
    calls = {"get_vision_position_ids": (empty, 2),
             "get_vision_attention_seqlens": (empty, tiny_qwen("qwen2_5_vl").config),
             "get_vision_window_index": (empty, 2, 112, 14)}

    def outcome(fn, args):
        try:
            return fn(*args), None
        except Exception as e:  # noqa: BLE001 -- compared by type and message
            return None, (type(e), str(e))

    expected = {name: outcome(getattr(module, name), args) for name, args in calls.items()}
    with hf.patch("qwen2_5_vl") as handle:
        for name, args in calls.items():
            got, error = outcome(getattr(module, name), args)
            want, want_error = expected[name]
            assert error == want_error, name
            assert error is not None or same(got, want), name
            assert handle.fallbacks[f"qwen2_5_vl.{name}"] == 1, name


# ---------------------------------------------------------------------------------------
# transformers 4.57: patch() routes the towers' methods (posenc_torch/hf/_tower_methods_457.py)

METHODS_4_57 = {
    "qwen2_vl": {"rot_pos_emb"},
    "qwen2_5_vl": {"rot_pos_emb", "get_window_index"},
    "qwen3_vl": {"rot_pos_emb", "fast_pos_embed_interpolate"},
    "qwen3_vl_moe": {"rot_pos_emb", "fast_pos_embed_interpolate"},
}
# images; videos of 1 to 3 frames (3: the table's gradient through the method's own repeat)
GRIDS_4_57 = {"image": torch.tensor([[1, 8, 12], [1, 2, 2], [1, 4, 6]]),
              "video": torch.tensor([[3, 4, 8], [1, 6, 4], [2, 4, 4]]),
              "video of two frames": torch.tensor([[2, 8, 4], [2, 2, 2]], dtype=torch.int32)}


def _method_targets(handle) -> set[str]:
    return {t for t in handle.targets if t.split(".", 1)[1] in _tower_methods_457.METHODS}


def _tower_step(tower, pix, grids):
    """The tower's outputs (every tensor it returns) and its parameters' gradients after a
    backward of a fixed weighted sum of them."""
    tower.zero_grad(set_to_none=True)
    out = tower(pix, grid_thw=grids)
    flat = [out] if isinstance(out, torch.Tensor) else [out[0], *out[1]]
    sum((o * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in flat).backward()
    grads = {name: p.grad for name, p in tower.named_parameters() if p.grad is not None}
    return [o.detach() for o in flat], grads


def _tower_pixels(config, grids):
    vc = config.vision_config
    gen = torch.Generator().manual_seed(3)
    return torch.randn(int(grids.prod(-1).sum()),
                       vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2, generator=gen)


def _assert_same_step(a, b, what):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert len(out_a) == len(out_b) and all(map(torch.equal, out_a, out_b)), what
    assert grads_a.keys() == grads_b.keys() and grads_a, what
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a), what


@pytest.mark.transformers4
@pytest.mark.parametrize("model_type", QWEN)
def test_patch_routes_the_4_57_tower_methods(model_type):
    """Under 4.57.6 the towers' methods are routed; the tower's fp32 outputs and every
    parameter gradient are bit for bit the plain ones, for images and videos; every method
    computed each call (no fallback); undo() puts the methods back."""
    model = tiny_qwen(model_type)
    tower = model.model.visual
    cls = type(tower)
    originals = {name: vars(cls)[name] for name in METHODS_4_57[model_type]}
    plain = {kind: _tower_step(tower, _tower_pixels(model.config, g), g)
             for kind, g in GRIDS_4_57.items()}
    with hf.patch(model_type) as handle:
        targets = _method_targets(handle)
        assert targets == {f"{model_type}.{n}" for n in METHODS_4_57[model_type]}
        assert all(vars(cls)[n] is not originals[n] for n in originals)
        for kind, g in GRIDS_4_57.items():
            before = dict(handle.calls)
            routed = _tower_step(tower, _tower_pixels(model.config, g), g)
            _assert_same_step(routed, plain[kind], f"{model_type}, {kind}")
            assert all(handle.calls[t] == before[t] + 1 for t in targets), handle.calls
        assert all(handle.fallbacks[t] == 0 for t in targets), handle.fallbacks
    assert all(vars(cls)[n] is originals[n] for n in originals)


@pytest.mark.transformers4
@pytest.mark.parametrize("model_type", ["glm4v", "glm4v_moe"])
def test_the_glm4v_method_matches_though_patch_leaves_the_type(model_type):
    """patch() leaves GLM-4V to transformers under 4.57 (its decoder's multimodal rotary
    is refused, and with it the type); its tower's rot_pos_emb is verified (its digest, and
    the check on tiny towers), and installed alone it gives the tower's own output."""
    model = tiny(model_type)
    tower = model.model.visual
    with pytest.raises(RuntimeError, match="apply_multimodal_rotary_pos_emb"):
        hf.patch(model_type)
    cls = type(tower)
    original = vars(cls)["rot_pos_emb"]
    entry, _ = _table.verified(original, cls, "rot_pos_emb")
    assert check_method(cls, "rot_pos_emb", _tower_methods_457.REPLACEMENTS[entry.use],
                        original) is None
    vc = model.config.vision_config
    # (4.57's GLM-4V tower takes videos as one grid row per frame)
    for grids in (GRIDS_4_57["image"], torch.tensor([[1, 4, 8]] * 3 + [[1, 2, 2]])):
        n = int(grids.prod(-1).sum())
        pix = torch.randn(n, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                          generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            plain = tower(pix, grids)
            handle = PatchHandle((model_type,), True, True)
            _tower_methods_457.install(handle, (model_type,))
            try:
                assert torch.equal(tower(pix, grids), plain)
                assert handle.calls == {f"{model_type}.rot_pos_emb": 1}, handle.calls
            finally:
                handle.undo()


@pytest.mark.transformers4
def test_a_changed_4_57_method_is_left_to_transformers(monkeypatch):
    """A method whose code is another (here: the window order reversed) keeps its own
    code, with one warning; the type's other methods are still routed."""
    module = importlib.import_module("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
    cls = module.Qwen2_5_VisionTransformerPretrainedModel
    real = cls.get_window_index

    def get_window_index(self, grid_thw):
        index, cu = real(self, grid_thw)
        return index.flip(0), cu

    monkeypatch.setattr(cls, "get_window_index", get_window_index)
    with pytest.warns(hf.UnsupportedModelWarning, match="get_window_index to transformers"):
        handle = hf.patch("qwen2_5_vl")
    with handle:
        assert cls.get_window_index is get_window_index
        assert _method_targets(handle) == {"qwen2_5_vl.rot_pos_emb"}


@pytest.mark.transformers4
def test_the_tower_check_finds_a_replacement_that_differs():
    """The check that verified the table's method rows (tests/test_hf_digests.py) finds a
    replacement that gives another result (here the walk's ids with rows and columns
    swapped)."""
    module = importlib.import_module("transformers.models.qwen2_vl.modeling_qwen2_vl")
    cls = module.Qwen2VisionTransformerPretrainedModel
    right = _tower_methods_457.REPLACEMENTS["rot_pos_emb"]
    assert check_method(cls, "rot_pos_emb", right, vars(cls)["rot_pos_emb"]) is None

    def swapped(self, grid_thw):
        return right.compute(self, grid_thw[:, [0, 2, 1]])

    wrong = right._replace(compute=swapped)
    assert "another result" in check_method(cls, "rot_pos_emb", wrong, vars(cls)["rot_pos_emb"])


@pytest.mark.transformers4
def test_4_57_routes_fall_back(monkeypatch):
    """Grids the walk refuses, an empty list, other call forms, compiling, and tower values
    the replacement does not take go to the method: the same result or error, counted as
    fallbacks."""
    model = tiny_qwen("qwen2_5_vl")
    tower = model.model.visual
    with hf.patch("qwen2_5_vl") as handle:
        target = "qwen2_5_vl.get_window_index"
        original = _handle.original_of(tower.get_window_index.__func__)
        odd = torch.tensor([[1, 4, 3]])  # w not divisible by the merge size: floored
        assert same(tower.get_window_index(odd), original(tower, odd))
        empty = torch.zeros(0, 3, dtype=torch.int64)
        with pytest.raises(Exception) as theirs:
            original(tower, empty)
        with pytest.raises(type(theirs.value)):
            tower.get_window_index(empty)
        assert handle.fallbacks[target] == 2 and handle.calls[target] == 0
        grids = GRIDS_4_57["image"]
        assert same(tower.get_window_index(grid_thw=grids), original(tower, grids))
        assert handle.calls[target] == 1
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert same(tower.get_window_index(grids), original(tower, grids))
        monkeypatch.undo()
        assert handle.fallbacks[target] == 3
        tower.spatial_merge_unit = 3  # not spatial_merge_size ** 2
        got = tower.get_window_index(grids)
        assert same(got, original(tower, grids)) and handle.fallbacks[target] == 4


def test_patch_routes_no_tower_method_under_5():
    """transformers 5.x towers define none of the 4.57 methods (their vision_utils
    functions are routed instead)."""
    if not V5:
        pytest.skip("5.x only")
    with hf.patch(QWEN) as handle:
        assert not _method_targets(handle)


@pytest.mark.transformers4
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_4_57_routes_on_fuzzed_grids(model_type):
    """The routed methods against the methods themselves on a real tiny tower, for fuzzed
    grid batches, merge sizes 1, 2 and 4, windows, patch sizes and table sides (fp32, bit
    for bit; get_window_index's boundary list with its repeats, element by element)."""
    from test_vision import batches

    tower = tiny_qwen(model_type).model.visual
    tables = {side: torch.nn.Embedding(side * side, 8) for side in (2, 3, 7, 16, 27, 48)}
    names = sorted(METHODS_4_57[model_type])
    originals = {n: vars(type(tower))[n] for n in names}
    with hf.patch(model_type) as handle, torch.no_grad():
        for rng, grids, merge in batches(26, 150, nonempty=True):
            tower.spatial_merge_size, tower.spatial_merge_unit = merge, merge * merge
            if model_type == "qwen2_5_vl":
                tower.patch_size = rng.choice((1, 2, 14))
                tower.window_size = (merge * tower.patch_size * rng.randint(1, 6)
                                     + rng.randrange(merge * tower.patch_size))
            else:
                tower.config.spatial_merge_size = merge
                tower.num_grid_per_side = rng.choice(list(tables))
                tower.pos_embed = tables[tower.num_grid_per_side]
            grids = grids.int() if rng.random() < 0.3 else grids
            for n in names:
                what = f"{n}: {grids.tolist()}, merge {merge}"
                assert same(getattr(tower, n)(grids), originals[n](tower, grids)), what
    assert all(handle.calls[f"{model_type}.{n}"] == 150 for n in names), handle.calls
    assert not any(handle.fallbacks.values()), handle.fallbacks
