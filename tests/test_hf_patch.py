"""posenc_torch.hf.patch on transformers' real model classes, built from tiny random configs.

Runs under transformers 5.x and again under 4.57 (``make test``'s second pass): the same
weights and inputs with and without the patch give the same logits and parameter gradients
(text-only, and image / video inputs with real grids for the VL models, so the 3-D
position-id path runs), the call counters prove the posenc functions ran, and a compiled
attention has no graph break in its rotary part.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import types
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

import posenc_torch.hf as hf
from posenc_torch.hf import _handle
import posenc_torch.rope as pt_rope
from conftest import TRANSFORMERS_MAJOR

pytestmark = pytest.mark.any_transformers

TEXT_TYPES = ("llama", "qwen2")
VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
ORIGINAL_TYPES = TEXT_TYPES + VL_TYPES  # tests/test_hf_models.py covers the others
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
LAYERS, VISION_DEPTH = 2, 2
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------
# Tiny models: hidden 64, 2 layers, 4 query heads, 2 kv heads, head_dim 16; M-RoPE
# sections with 2 * sum == 16; vision towers of 2 blocks with 4-pixel patches.


def tiny_config(model_type: str):
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if model_type in TEXT_TYPES:
        return AutoConfig.for_model(model_type, **text, **({"head_dim": 16}
                                                          if model_type == "llama" else {}))
    if model_type == "qwen2_vl":
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
        vision = dict(depth=VISION_DEPTH, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2,
                      patch_size=4)
    elif model_type == "qwen2_5_vl":
        # A tuple, as a config round trip can give (HF repeats it as a sequence).
        text["rope_scaling"] = {"type": "mrope", "mrope_section": (2, 3, 3)}
        vision = dict(depth=VISION_DEPTH, hidden_size=32, intermediate_size=48, num_heads=2,
                      out_hidden_size=64, patch_size=4, window_size=16, fullatt_block_indexes=[1],
                      tokens_per_second=2)
    else:
        text.update(head_dim=16, rope_scaling={"rope_type": "default", "mrope_section": [3, 3, 2],
                                               "mrope_interleaved": True})
        vision = dict(depth=VISION_DEPTH, hidden_size=32, intermediate_size=48, num_heads=2,
                      out_hidden_size=64, patch_size=4, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision,
                                image_token_id=IMAGE, video_token_id=VIDEO,
                                vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    auto = AutoModelForCausalLM if model_type in TEXT_TYPES else AutoModelForImageTextToText
    return auto.from_config(tiny_config(model_type), attn_implementation="sdpa").to(dtype)


def make_inputs(model_type: str, config, kind: str, dtype: torch.dtype = torch.float32) -> dict:
    """Two rows of text with, for "image" / "video", vision-start + placeholder tokens and
    pixel values of the real patch grids (image (1, 4, 8), video (2, 4, 4))."""
    gen = torch.Generator().manual_seed(1)

    def text(n: int) -> list[int]:
        return torch.randint(3, 100, (n,), generator=gen).tolist()

    if kind == "text":
        return dict(input_ids=torch.tensor([text(13), text(13)]))
    vc = config.vision_config
    merge = vc.spatial_merge_size
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    rows, images, videos, image_grids, video_grids = [], [], [], [], []
    for _ in range(2):
        ids = text(3)
        if "image" in kind:
            t, h, w = 1, 4, 8
            image_grids.append([t, h, w])
            images.append(torch.randn(t * h * w, patch_dim, generator=gen))
            ids += [VISION_START] + [IMAGE] * (t * h * w // merge ** 2) + [VISION_END] + text(2)
        if "video" in kind:
            t, h, w = 2, 4, 4
            video_grids.append([t, h, w])
            videos.append(torch.randn(t * h * w, patch_dim, generator=gen))
            if model_type == "qwen3_vl":  # per frame: <timestamp> <vision_start> frame <vision_end>
                for _ in range(t):
                    ids += text(2) + [VISION_START] + [VIDEO] * (h * w // merge ** 2) + [VISION_END]
            else:
                ids += [VISION_START] + [VIDEO] * (t * h * w // merge ** 2) + [VISION_END]
            ids += text(2)
        rows.append(ids)
    input_ids = torch.tensor(rows)
    out = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    if images:
        out.update(pixel_values=torch.cat(images).to(dtype),
                   image_grid_thw=torch.tensor(image_grids))
    if videos:
        out.update(pixel_values_videos=torch.cat(videos).to(dtype),
                   video_grid_thw=torch.tensor(video_grids))
        if model_type == "qwen2_5_vl":
            out["second_per_grid_ts"] = torch.tensor([1.0, 1.0])
    if TRANSFORMERS_MAJOR >= 5:  # 5.x builds the 3-D positions from the token types
        out["mm_token_type_ids"] = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
    return out


def forward_backward(model_type: str, kind: str, dtype: torch.dtype, patched: bool,
                     **patch_kwargs):
    """Logits, {parameter name: gradient}, the model and the patch handle (None if unpatched)."""
    model = tiny_model(model_type, dtype)
    inputs = make_inputs(model_type, model.config, kind, dtype)
    handle = hf.patch(model_type, **patch_kwargs) if patched else None
    with handle or nullcontext():
        out = model(**inputs, labels=inputs["input_ids"], use_cache=False)
        out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads, model, handle


def text_target(model_type: str) -> str:
    """What the decoder attention of the installed transformers calls (reference §9.8)."""
    if model_type in ("qwen2_vl", "qwen2_5_vl") and TRANSFORMERS_MAJOR < 5:
        return f"{model_type}.apply_multimodal_rotary_pos_emb"
    return f"{model_type}.apply_rotary_pos_emb"


def fused_attention(model_type: str) -> str | None:
    """The target of the decoder attention's forward where patch() runs it with the fused
    q/k norm + rotary (the types the release facts list as fused), else None."""
    from posenc_torch.hf import _qk_attention, _table, _transformers

    if model_type not in _table.releases()["fused"].get(_transformers.version(), ()):
        return None
    (cls,) = _qk_attention.candidates(modeling(model_type))
    return f"{model_type}.{cls.__name__}.forward"


def decoder_target(model_type: str) -> str:
    """The target that counts the decoder attention's rotary calls."""
    return fused_attention(model_type) or text_target(model_type)


def modeling(model_type: str):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def all_grads(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.double().flatten() for _, g in sorted(grads.items())])


CASES = [(mt, "text") for mt in ORIGINAL_TYPES] + [
    (mt, kind) for mt in VL_TYPES for kind in ("image", "video", "image+video")]


# ---------------------------------------------------------------------------------------
# What gets patched


VISION_UTILS = ("get_vision_position_ids", "get_vision_cu_seqlens",
                "get_vision_attention_seqlens", "get_vision_window_index",
                "get_vision_interpolation_indices_and_weights")
# 4.57: the vision towers' methods, routed (see test_vision_hf.py)
VISION_METHODS = ("rot_pos_emb", "get_window_index", "fast_pos_embed_interpolate")


def is_vision_route(target: str) -> bool:
    """A route of the towers' grid computations (5.x functions, 4.57 methods)."""
    return ".get_vision_" in target or target.split(".", 1)[1] in VISION_METHODS


def tower_methods(module) -> list[str]:
    """The 4.57 methods that classes of ``module`` define, in the order patch() routes them."""
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and c.__module__ == module.__name__]
    return [name for name in VISION_METHODS if any(name in vars(c) for c in classes)]


def qk_norm_attentions(model_type: str) -> list[type]:
    """The attention classes patch() runs with the fused q/k norm + rotary: those of the
    types the release facts list as fused."""
    from posenc_torch.hf import _qk_attention, _table, _transformers

    fused = _table.releases()["fused"].get(_transformers.version(), ())
    return _qk_attention.candidates(modeling(model_type)) if model_type in fused else []


@pytest.mark.parametrize("model_type", ORIGINAL_TYPES)
def test_patch_replaces_what_the_attention_calls(model_type):
    tiny_model(model_type)  # imports the modeling file
    module = modeling(model_type)
    expected = [text_target(model_type)]
    if model_type in VL_TYPES:
        expected.append(f"{model_type}.apply_rotary_pos_emb_vision")
    names = [t.split(".", 1)[1] for t in expected]
    # the q/k-norm attention's forward, run with the fused op (see test_hf_qk_attention.py)
    expected += [f"{model_type}.{cls.__name__}.forward" for cls in qk_norm_attentions(model_type)]
    if model_type in VL_TYPES:  # a method, not a module function: see test_hf_positions.py
        expected.append(f"{model_type}.get_rope_index")
        # 5.x: the vision towers' vision_utils functions, routed (see test_vision_hf.py)
        expected += [f"{model_type}.{name}" for name in VISION_UTILS if name in vars(module)]
        expected += [f"{model_type}.{name}" for name in tower_methods(module)]
    originals = {name: getattr(module, name) for name in names}

    handle = hf.patch(model_type)
    try:
        assert handle.targets == tuple(expected)
        assert handle.active
        for name in names:
            assert getattr(module, name) is not originals[name]
            assert _handle.original_of(getattr(module, name)) is originals[name]
        assert handle.calls == dict.fromkeys(expected, 0)  # (the routes included)
    finally:
        handle.undo()
    assert not handle.active
    for name in names:
        assert getattr(module, name) is originals[name]
    handle.undo()  # a second undo does nothing

    with hf.patch([model_type]) as ctx:
        assert getattr(module, names[0]) is not originals[names[0]]
    assert not ctx.active and getattr(module, names[0]) is originals[names[0]]


def test_patch_all_by_default_and_unpatched_models_afterwards():
    with hf.patch() as handle:
        assert handle.model_types == hf.SUPPORTED_MODEL_TYPES
        assert {t.split(".")[0] for t in handle.targets} == set(hf.SUPPORTED_MODEL_TYPES)
    logits, _, _, _ = forward_backward("llama", "text", torch.float32, patched=False)
    assert handle.calls["llama.apply_rotary_pos_emb"] == 0  # nothing counted after undo
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------
# Same logits and gradients as transformers


@pytest.mark.parametrize(("model_type", "kind"), CASES)
def test_fp32_logits_and_gradients_match(model_type, kind):
    ref_logits, ref_grads, ref_model, _ = forward_backward(model_type, kind, torch.float32, False)
    logits, grads, model, handle = forward_backward(model_type, kind, torch.float32, True)

    torch.testing.assert_close(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and grads
    if kind != "text":  # the gradient went through the vision tower's rotary too
        assert any(name.startswith(("model.visual.", "visual.")) for name in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], msg=lambda m, n=name: f"{n}: {m}")

    # The posenc functions ran, once per decoder layer and vision block and modality.
    n_vision = VISION_DEPTH * (("image" in kind) + ("video" in kind))
    # (the fused forward calls no rotary function)
    expected = {text_target(model_type): 0, decoder_target(model_type): LAYERS}
    if model_type in VL_TYPES:
        expected[f"{model_type}.apply_rotary_pos_emb_vision"] = n_vision
        # 3-D position ids: 5.x asks for them only with grids (see test_hf_positions.py)
        expected[f"{model_type}.get_rope_index"] = int(kind != "text" or TRANSFORMERS_MAJOR < 5)
    routes = {t: n for t, n in handle.calls.items() if is_vision_route(t)}
    assert {t: n for t, n in handle.calls.items() if t not in routes} == expected
    assert handle.fallbacks == dict.fromkeys(handle.calls, 0)
    # the vision tower's vision_utils calls (5.x) or methods (4.57) went to the walks (once
    # per modality)
    assert all(n == ("image" in kind) + ("video" in kind) for n in routes.values()), routes
    assert bool(routes) == (model_type in VL_TYPES)
    if kind != "text":  # the 3-D position ids of the vision tokens were used
        assert (model.model.rope_deltas != 0).all()
        assert torch.equal(model.model.rope_deltas, ref_model.model.rope_deltas)


@pytest.mark.parametrize("model_type", ORIGINAL_TYPES)
def test_bf16_as_close_to_fp64_as_transformers(model_type):
    """bf16: transformers rounds after each of its three ops, posenc once, so the two differ
    by about a bf16 ulp per rotation; through the model that is the size of bf16's own error.
    The patched model must be as close to an fp64 run as transformers' bf16 run (within 2x)
    and stay within 2.5% (of the largest value) of it."""
    kind = "text" if model_type in TEXT_TYPES else "image+video"
    ref_logits, ref_grads, _, _ = forward_backward(model_type, kind, torch.float64, False)
    hf_logits, hf_grads, _, _ = forward_backward(model_type, kind, torch.bfloat16, False)
    pe_logits, pe_grads, _, handle = forward_backward(model_type, kind, torch.bfloat16, True)
    assert all(n > 0 for t, n in handle.calls.items()
               if not (fused_attention(model_type) and t == text_target(model_type)))
    for name, hf_x, pe_x, ref_x in (
            ("logits", hf_logits, pe_logits, ref_logits),
            ("gradients", all_grads(hf_grads), all_grads(pe_grads), all_grads(ref_grads))):
        hf_err, pe_err = rel_err(hf_x, ref_x), rel_err(pe_x, ref_x)
        assert pe_err <= 2 * hf_err, f"{name}: posenc {pe_err:.2e} vs transformers {hf_err:.2e}"
        assert rel_err(pe_x, hf_x) <= 2.5e-2, name


@pytest.mark.parametrize("model_type", VL_TYPES)
@pytest.mark.parametrize("broken", ["text", "vision"])
def test_a_wrong_rotation_would_be_caught(model_type, broken, monkeypatch):
    """The comparison above can fail: rotating the wrong way in any one of the replaced
    functions moves the logits outside the fp32 tolerance."""
    ref_logits, _, _, _ = forward_backward(model_type, "image+video", torch.float32, False)
    name = {"text": text_target(model_type).split(".")[1],
            "vision": "apply_rotary_pos_emb_vision"}[broken]
    real = getattr(pt_rope, name)
    monkeypatch.setattr(pt_rope, name,
                        lambda q, k, cos, sin, *a, **kw: real(q, k, cos, -sin, *a, **kw))
    # (the text rotary function as patch(fuse_qk_norm=False) runs it; the fused forward's
    # own check is in test_hf_qk_attention.py)
    logits, _, _, handle = forward_backward(model_type, "image+video", torch.float32, True,
                                            fuse_qk_norm=False)
    assert handle.calls[f"{model_type}.{name}"] > 0
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(logits, ref_logits)


@pytest.mark.parametrize("model_type", ["llama", "qwen2_vl"])
def test_generate_matches(model_type):
    """Decoding (one new token per step, positions offset by rope_deltas) under
    inference_mode gives the same tokens."""
    model = tiny_model(model_type).eval()
    inputs = make_inputs(model_type, model.config, "text" if model_type == "llama" else "image")
    with torch.inference_mode():
        ref = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    with hf.patch(model_type) as handle, torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref)
    assert handle.calls[text_target(model_type)] == 4 * LAYERS


# ---------------------------------------------------------------------------------------
# torch.compile


def capture_attention_inputs(model_type: str):
    """Run the model once and keep the arguments of the first decoder attention (and the
    first vision attention)."""
    model = tiny_model(model_type)
    inputs = make_inputs(model_type, model.config,
                         "text" if model_type in TEXT_TYPES else "image")
    if model_type in TEXT_TYPES:
        modules = {"text": model.model.layers[0].self_attn}
    else:
        modules = {"text": model.model.language_model.layers[0].self_attn,
                   "vision": model.model.visual.blocks[0].attn}
    captured = {}

    def detach(v):
        if isinstance(v, torch.Tensor):
            return v.detach()
        return tuple(detach(x) for x in v) if isinstance(v, tuple) else v

    def hook(name):
        def pre_hook(module, args, kwargs):
            captured[name] = (module, tuple(detach(a) for a in args),
                              {k: detach(v) for k, v in kwargs.items()})
        return pre_hook

    handles = [m.register_forward_pre_hook(hook(name), with_kwargs=True)
               for name, m in modules.items()]
    with torch.no_grad():
        model(**inputs, use_cache=False)
    for h in handles:
        h.remove()
    return captured


def mentions_rotary(text: str) -> bool:
    text = text.lower()
    return any(word in text for word in ("posenc", "rotary", "rope"))


@pytest.mark.parametrize("model_type", ORIGINAL_TYPES)
def test_compiled_attention_has_no_graph_break_in_rotary(model_type):
    from torch._dynamo.utils import counters

    captured = capture_attention_inputs(model_type)
    with hf.patch(model_type) as handle:
        for name, (module, args, kwargs) in captured.items():
            torch._dynamo.reset()
            explained = torch._dynamo.explain(module)(*args, **kwargs)
            ops = [str(op) for graph_ops in explained.ops_per_graph for op in graph_ops]
            fused = name == "text" and fused_attention(model_type)
            op = "posenc.qk_norm_rope" if fused else "posenc.rope"
            assert op in ops, f"{name}: no {op} in the graphs: {ops}"
            for reason in explained.break_reasons:
                where = " ".join(f"{f.filename} {f.name} {f.line}" for f in reason.user_stack)
                assert not mentions_rotary(f"{reason.reason} {where}"), (name, reason)
            if name == "text":  # the decoder attention compiles to a single graph
                assert explained.graph_break_count == 0, explained.break_reasons

        # Counting does not make the compiled attention recompile on every call.
        module, args, kwargs = captured["text"]
        torch._dynamo.reset()
        counters.clear()
        handle.reset_counts()
        compiled = torch.compile(module, backend="eager")
        for _ in range(3):
            compiled(*args, **kwargs)
        assert counters["stats"]["unique_graphs"] == 1
        assert handle.calls[decoder_target(model_type)] == 3
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------
# Call forms and fallbacks, against transformers' own functions


def qk(layout_dim: int, dtype=torch.float32, batch=2, seq=5, dim=16):
    """q (B, 4, T, D), k (B, 2, T, D) as non-contiguous views of a projection output
    (layout_dim 1), or (B, T, H, D) (layout_dim 2)."""
    q = torch.randn(batch, seq, 4 * dim, dtype=dtype).view(batch, seq, 4, dim)
    k = torch.randn(batch, seq, 2 * dim, dtype=dtype).view(batch, seq, 2, dim)
    return (q.transpose(1, 2), k.transpose(1, 2)) if layout_dim == 1 else (q, k)


def tables(batch, seq, dim, dtype=torch.float32, axes=None):
    shape = (batch, seq, dim) if axes is None else (axes, batch, seq, dim)
    angle = torch.rand(shape, dtype=torch.float64) * 6
    return angle.cos().to(dtype), angle.sin().to(dtype)


def test_apply_rotary_pos_emb_call_forms():
    """Calls that give q, k, cos, sin and leave the other parameters at their defaults (the
    form the decision captured) are computed by posenc; the others go to transformers'
    function.  Either way the result is transformers'."""
    tiny_model("llama")
    module = modeling("llama")
    original = module.apply_rotary_pos_emb
    cos, sin = tables(1, 5, 16)
    q1, k1 = qk(1)
    q2, k2 = qk(2)
    ref1 = original(q1, k1, cos, sin)
    ref2 = original(q2, k2, cos, sin, unsqueeze_dim=2)
    v4 = "position_ids" in inspect.signature(original).parameters
    with hf.patch("llama") as handle:
        patched = module.apply_rotary_pos_emb
        computed = [
            (patched(q1, k1, cos, sin), ref1),  # as the attention calls it
            (patched(q1, k1, cos, sin, unsqueeze_dim=1), ref1),
            (patched(q=q1, k=k1, cos=cos, sin=sin), ref1),
            (patched(q1, k1, cos.expand(2, -1, -1), sin.expand(2, -1, -1)), ref1),  # Bc == B
        ]
        if v4:  # 4.x: position_ids, which the function never reads
            computed.append((patched(q1, k1, cos, sin, None), ref1))
            computed.append((patched(q1, k1, cos, sin, torch.arange(5)[None]), ref1))
        assert handle.calls == {"llama.apply_rotary_pos_emb": len(computed)}
        handed = [
            (patched(q2, k2, cos, sin, unsqueeze_dim=2), ref2),
            (patched(q=q2, k=k2, cos=cos, sin=sin, unsqueeze_dim=-2), ref2),
        ]
        if not v4:
            handed.append((patched(q2, k2, cos, sin, 2), ref2))  # 5.x: unsqueeze_dim
        assert handle.fallbacks == {"llama.apply_rotary_pos_emb": len(handed)}
    for (q_out, k_out), (q_ref, k_ref) in computed + handed:
        assert q_out.shape == q_ref.shape and k_out.shape == k_ref.shape
        torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
        torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_apply_multimodal_rotary_pos_emb_call_forms(model_type):
    tiny_model(model_type)
    module = modeling(model_type)
    if not hasattr(module, "apply_multimodal_rotary_pos_emb"):
        pytest.skip(f"transformers {transformers.__version__} has no "
                    "apply_multimodal_rotary_pos_emb (its attention calls apply_rotary_pos_emb); "
                    "the transformers 4.57 pass runs this")
    original = module.apply_multimodal_rotary_pos_emb
    cos, sin = tables(2, 5, 16, axes=3)
    q1, k1 = qk(1)
    q2, k2 = qk(2)
    ref1 = original(q1, k1, cos, sin, [2, 3, 3])
    ref2 = original(q2, k2, cos, sin, [2, 3, 3], unsqueeze_dim=2)
    target = f"{model_type}.apply_multimodal_rotary_pos_emb"
    with hf.patch(model_type) as handle:
        patched = module.apply_multimodal_rotary_pos_emb
        results = [
            (patched(q1, k1, cos, sin, [2, 3, 3]), ref1),
            (patched(q1, k1, cos, sin, (2, 3, 3)), ref1),
            (patched(q1, k1, cos, sin, mrope_section=[2, 3, 3]), ref1),
        ]
        assert handle.calls[target] == len(results) and handle.fallbacks[target] == 0
        # another unsqueeze_dim than the default: transformers' function
        results += [(patched(q2, k2, cos, sin, [2, 3, 3], 2), ref2),
                    (patched(q2, k2, cos, sin, (2, 3, 3), unsqueeze_dim=2), ref2)]
        assert handle.fallbacks[target] == 2
        # A section list that does not fit: transformers' own error, as without the patch.
        with pytest.raises(RuntimeError) as patched_error:
            patched(q1, k1, cos, sin, [2, 3, 4])
        assert handle.fallbacks[target] == 3
    with pytest.raises(RuntimeError) as original_error:
        original(q1, k1, cos, sin, [2, 3, 4])
    assert str(patched_error.value) == str(original_error.value)
    for (q_out, k_out), (q_ref, k_ref) in results:
        torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
        torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_pos_emb_vision_matches(dtype):
    tiny_model("qwen2_vl")
    module = modeling("qwen2_vl")
    original = module.apply_rotary_pos_emb_vision
    qkv = torch.randn(30, 3, 2, 16, dtype=dtype).permute(1, 0, 2, 3)  # as the vision attention
    q, k = qkv[0], qkv[1]
    angle = torch.rand(30, 8) * 6
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    ref = original(q, k, cos, sin)
    with hf.patch("qwen2_vl") as handle:
        out = module.apply_rotary_pos_emb_vision(q, k, cos, sin)
        assert handle.calls["qwen2_vl.apply_rotary_pos_emb_vision"] == 1
    for o, r in zip(out, ref, strict=True):
        assert o.dtype == r.dtype == dtype
        torch.testing.assert_close(o, r, rtol=0, atol=0)


def test_unsupported_inputs_go_to_transformers():
    """Tensors posenc does not take (here on the meta device, standing in for CUDA tensors on
    a CPU-only build, and integer tensors) run transformers' function; with fallback=False
    posenc's error is raised."""
    tiny_model("qwen2_vl")
    module = modeling("qwen2_vl")
    q, k = (t.to("meta") for t in qk(1))
    cos, sin = (t.to("meta") for t in tables(1, 5, 16))
    vq, vk = torch.empty(30, 2, 16, device="meta"), torch.empty(30, 2, 16, device="meta")
    vcos, vsin = torch.empty(30, 16, device="meta"), torch.empty(30, 16, device="meta")
    text_name = text_target("qwen2_vl").split(".")[1]
    with hf.patch("qwen2_vl") as handle:
        if text_name == "apply_rotary_pos_emb":
            q_out, k_out = module.apply_rotary_pos_emb(q, k, cos, sin)
        else:
            cos3, sin3 = cos.expand(3, -1, -1, -1), sin.expand(3, -1, -1, -1)
            q_out, k_out = module.apply_multimodal_rotary_pos_emb(q, k, cos3, sin3, [2, 3, 3])
        assert q_out.device.type == "meta" and q_out.shape == q.shape and k_out.shape == k.shape
        vq_out, _ = module.apply_rotary_pos_emb_vision(vq, vk, vcos, vsin)
        assert vq_out.shape == vq.shape
        rotary = lambda counts: {t: n for t, n in counts.items()  # noqa: E731
                                 if not is_vision_route(t)}
        assert rotary(handle.fallbacks) == {f"qwen2_vl.{text_name}": 1,
                                            "qwen2_vl.apply_rotary_pos_emb_vision": 1,
                                            "qwen2_vl.get_rope_index": 0}
        assert rotary(handle.calls) == {f"qwen2_vl.{text_name}": 0,
                                        "qwen2_vl.apply_rotary_pos_emb_vision": 0,
                                        "qwen2_vl.get_rope_index": 0}

        # Shapes transformers' function itself rejects: the same error with the patch.
        cpu_q, cpu_k = qk(1)
        bad_cos, bad_sin = tables(1, 5, 12)
        if text_name == "apply_rotary_pos_emb":
            with pytest.raises(RuntimeError, match="size of tensor"):
                module.apply_rotary_pos_emb(cpu_q, cpu_k, bad_cos, bad_sin)

    int_q = int_k = torch.ones(30, 2, 16, dtype=torch.int32)
    cpu_cos, cpu_sin = torch.ones(30, 16), torch.zeros(30, 16)
    with hf.patch("qwen2_vl", fallback=False) as handle:
        with pytest.raises(TypeError, match="q must be float32"):
            module.apply_rotary_pos_emb_vision(int_q, int_k, cpu_cos, cpu_sin)
    with hf.patch("qwen2_vl") as handle:  # the same call falls back
        out, _ = module.apply_rotary_pos_emb_vision(int_q, int_k, cpu_cos, cpu_sin)
        assert out.dtype == torch.int32 and torch.equal(out, int_q)
        assert handle.fallbacks["qwen2_vl.apply_rotary_pos_emb_vision"] == 1
    with hf.patch("qwen2_vl", count=False) as handle:
        module.apply_rotary_pos_emb_vision(int_q.float(), int_k.float(), cpu_cos, cpu_sin)
        assert handle.calls == {} and handle.fallbacks == {}


# ---------------------------------------------------------------------------------------
# Errors instead of silent no-ops


def test_bad_model_types():
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        hf.patch("gpt2")
    with pytest.raises(ValueError, match="empty"):
        hf.patch([])
    with pytest.raises(TypeError, match="strings"):
        hf.patch([3])


def test_patching_twice_is_an_error():
    with hf.patch("llama") as first:
        with pytest.raises(RuntimeError, match="already patched"):
            hf.patch(["qwen2", "llama"])
        assert first.active
        # Nothing of the failed call stays installed.
        assert modeling("qwen2").apply_rotary_pos_emb.__module__ != "posenc_torch.hf"


def test_missing_function_is_an_error(monkeypatch):
    tiny_model("llama")
    monkeypatch.delattr(modeling("llama"), "apply_rotary_pos_emb")
    with pytest.raises(RuntimeError, match="LlamaAttention.forward .* call apply_rotary_pos_emb, "
                                           "but the module has no such function"):
        hf.patch("llama")


FAKE_QWEN2_VL = '''
import torch

def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)

def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    return q, k

def apply_rotary_pos_emb_3d(q, k, cos, sin):
    return q, k

def apply_rotary_pos_emb_vision(q, k, cos, sin):
    return q, k

class Qwen2VLAttention(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb_3d(q, k, cos, sin)

class VisionAttention(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return VISION_CALL(q, k, cos, sin)
'''


@pytest.mark.parametrize("case", ["decoder", "vision"])
def test_attention_that_calls_something_else_is_an_error(case, monkeypatch):
    """A transformers version whose attention no longer calls the known names (the case of
    reference §9.8, where Qwen2-VL dropped apply_multimodal_rotary_pos_emb) must not be
    'patched' by assigning names nobody calls."""
    name = "transformers.models.qwen2_vl.modeling_qwen2_vl"
    fake = types.ModuleType(name)
    source = FAKE_QWEN2_VL
    if case == "vision":  # decoder fine, vision attention calls an unknown helper
        source = source.replace("return apply_rotary_pos_emb_3d(", "return apply_rotary_pos_emb(")
        source = source.replace("VISION_CALL", "apply_rotary_pos_emb_3d")
    else:
        source = source.replace("VISION_CALL", "apply_rotary_pos_emb_vision")
    exec(compile(source, f"<{name}>", "exec"), fake.__dict__)
    monkeypatch.setitem(sys.modules, name, fake)
    message = ("no attention .* calls apply_rotary_pos_emb or apply_multimodal_rotary_pos_emb"
               if case == "decoder" else "vision attention .* does not call")
    with pytest.raises(RuntimeError, match=message):
        hf.patch("qwen2_vl")
    assert fake.apply_rotary_pos_emb.__module__ == name  # nothing was replaced


# ---------------------------------------------------------------------------------------
# Packaging and the example


def test_importing_posenc_torch_hf_does_not_import_transformers():
    code = ("import sys, posenc_torch, posenc_torch.hf; "
            "assert 'transformers' not in sys.modules, 'transformers imported'; "
            "assert posenc_torch.hf.patch")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent)


def test_finetune_example_quick(tmp_path):
    script = REPO / "examples" / "finetune_qwen2_vl.py"
    proc = subprocess.run([sys.executable, str(script), "--quick"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"transformers {transformers.__version__}" in proc.stdout
    assert "OK: losses match" in proc.stdout and "posenc kernels ran" in proc.stdout
    assert "all losses match" in proc.stdout


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_finetune_example_on_two_ranks(mode, tmp_path):
    """The example under torchrun with 2 CPU ranks (gloo): DDP and FSDP2 training steps
    give the same mean losses with and without the patch, and posenc ran on every rank."""
    script = REPO / "examples" / "finetune_qwen2_vl.py"
    # One thread per rank on a small machine; gloo on the loopback interface (the
    # hostname's address may be one the ranks cannot reach).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), "--quick", "--distributed", mode],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{mode.upper()} on 2 ranks (gloo, cpu)" in proc.stdout
    assert "OK: losses match" in proc.stdout and "posenc kernels ran" in proc.stdout
    assert "all losses match" in proc.stdout


def test_finetune_example_packed_on_two_ranks(tmp_path):
    """--packed under torchrun, FSDP2 on 2 CPU ranks: each rank's examples packed into one
    row (posenc_torch.packing), the same mean losses with and without the patch."""
    script = REPO / "examples" / "finetune_qwen2_vl.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), "--quick", "--packed", "--distributed", "fsdp2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FSDP2 on 2 ranks (gloo, cpu)" in proc.stdout
    assert "examples packed into 1 row" in proc.stdout
    assert "OK: losses match" in proc.stdout and "posenc kernels ran" in proc.stdout
