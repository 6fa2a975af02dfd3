"""posenc_torch.hf.patch on every model type it supports, each built from a tiny random
config (the config class's defaults, shrunk: 2 layers, hidden 64, 4 query heads, 2 kv
heads; nothing downloaded).

For each type of ``hf.SUPPORTED_MODEL_TYPES`` (the set written for the installed release
in the release facts, not computed: a type refused by mistake fails here;
``make test`` runs this file under 5.x and again under 4.57.6): one forward + backward of a
text batch with and without the patch gives the same logits and parameter gradients in
fp32, the patched bf16 run is as close to an fp64 run as transformers' own bf16 run, and
the posenc functions computed every rotary call (``calls > 0``, ``fallbacks == 0``).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from contextlib import nullcontext

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

import posenc_torch.hf as hf
from posenc_torch.hf import _handle, _rotary

pytestmark = pytest.mark.any_transformers

SUPPORTED = hf.SUPPORTED_MODEL_TYPES
LAYERS = 2

# Sizes of the tiny decoder, applied to whichever of these attributes a config has.
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, sliding_window=8, bos_token_id=0, eos_token_id=1,
            pad_token_id=2, n_group=1, topk_group=1)
VISION = dict(depth=1, num_hidden_layers=1, hidden_size=32, embed_dim=32, num_heads=2,
              num_attention_heads=2, intermediate_size=48, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16, deepstack_visual_indexes=[0])

# Per model: changes to the shrunk config so the tiny model exercises the model's own
# rotary layout (partial rotary where the real model has it, attention layers among the
# linear-attention ones).
EXTRA: dict[str, dict] = {
    "phi3": dict(partial_rotary_factor=0.75),  # Phi-4-mini's factor
    # Multi-head latent attention: rotary on 8 of the 16 query channels (q and k).
    "deepseek_v3": dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        qk_head_dim=16, v_head_dim=16, head_dim=8, num_key_value_heads=4),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5": dict(layer_types=["linear_attention", "full_attention"], head_dim=32),
    "qwen3_5_moe": dict(layer_types=["linear_attention", "full_attention"], head_dim=32),
    "glm4v_moe": dict(head_dim=32),
}
def modeling(model_type: str) -> types.ModuleType:
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def _pick(defaults: dict, sizes: dict) -> dict:
    return {key: value for key, value in sizes.items() if key in defaults}


def _fit_mrope(text: dict, defaults: dict) -> None:
    """M-RoPE sections (T, H, W) that fit the tiny head: sum == rotary width / 2."""
    key = "rope_parameters" if "rope_parameters" in defaults else "rope_scaling"
    rope = dict(defaults.get(key) or {"rope_type": "default"})
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    partial = rope.get("partial_rotary_factor") or defaults.get("partial_rotary_factor") or 1
    half = int(head_dim * partial) // 2
    text[key] = {**rope, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}


def tiny_config(model_type: str):
    default = AutoConfig.for_model(model_type)
    extra = EXTRA.get(model_type, {})
    if "text_config" in (getattr(default, "sub_configs", None) or {}):
        text_defaults = default.text_config.to_dict()
        text = _pick(text_defaults, TEXT) | extra
        kwargs = {"text_config": text}
        if "vision_config" in default.sub_configs:
            kwargs["vision_config"] = _pick(default.vision_config.to_dict(), VISION)
        if "mrope_section" in inspect.getsource(modeling(model_type)):
            _fit_mrope(text, text_defaults)
        return AutoConfig.for_model(model_type, **kwargs)
    defaults = default.to_dict()
    kwargs = _pick(defaults, TEXT) | extra
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, dtype: torch.dtype, attn: str = "eager"):
    config = tiny_config(model_type)
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    except ValueError:  # a vision-language model: no causal-LM class for its config
        model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn)
    return model.to(dtype)


def forward_backward(model_type: str, dtype: torch.dtype, patched: bool, attn: str = "eager"):
    """Logits, {parameter name: gradient} and the patch handle (None if unpatched) of one
    training step's forward and backward on two rows of 13 text tokens."""
    model = tiny_model(model_type, dtype, attn)
    input_ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(1))
    handle = hf.patch(model_type) if patched else None
    with handle or nullcontext():
        out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
        out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads, handle


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def all_grads(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.double().flatten() for _, g in sorted(grads.items())])


# ---------------------------------------------------------------------------------------
# Which model types are patched


def test_patch_replaces_exactly_the_functions_of_the_supported_types():
    """patch() of everything: each supported type's module holds posenc replacements and
    each other type's module its own functions, however the support was computed; a
    refused type asked for by name raises with its reason."""
    unsupported = hf.unsupported_model_types()
    names = ("apply_rotary_pos_emb", "apply_multimodal_rotary_pos_emb",
             "apply_rotary_pos_emb_vision", "apply_rotary_pos_emb_interleave")
    with hf.patch() as handle:
        for model_type in hf.KNOWN_MODEL_TYPES:
            try:
                module = importlib.import_module(
                    f"transformers.models.{model_type}.modeling_{model_type}")
            except ImportError:
                assert "cannot import" in unsupported[model_type]
                continue
            replaced = [n for n in names
                        if _handle.original_of(getattr(module, n, None)) is not getattr(module, n, None)]
            assert bool(replaced) == (model_type not in unsupported), (model_type, replaced)
        assert {t.split(".")[0] for t in handle.targets} == set(SUPPORTED)
    # The five types of the first integration stay supported on every version tested.
    assert {"llama", "qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"} <= set(SUPPORTED)
    for model_type, reason in unsupported.items():
        with pytest.raises(RuntimeError) as error:
            hf.patch(model_type)
        assert reason in str(error.value)


def test_an_unknown_source_form_is_not_patched(monkeypatch):
    """A function whose source differs from the recognised forms and that computes
    something else (here: a sign flipped) is refused, even though its name and call are
    the same: its digest has no row (tests/test_hf_decisions.py has more edits, refused
    and accepted)."""
    tiny_config("mistral")
    module = modeling("mistral")
    rotate_half = module.rotate_half

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = (q * cos) - (rotate_half(q) * sin)
        k_embed = (k * cos) - (rotate_half(k) * sin)
        return q_embed, k_embed

    monkeypatch.setattr(module, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    with pytest.raises(RuntimeError, match="python -m posenc_torch.hf.verify"):
        hf.patch("mistral")
    assert module.apply_rotary_pos_emb is apply_rotary_pos_emb
    # and the verify command makes no row for it, saying why
    from posenc_torch.hf.verify._forms import which_form

    verdict = which_form(apply_rotary_pos_emb, _rotary._FORMS["apply_rotary_pos_emb"],
                         "apply_rotary_pos_emb")
    assert verdict["form"] is None
    assert "none of posenc's apply_rotary_pos_emb forms" in verdict["reason"]


# ---------------------------------------------------------------------------------------
# Each supported model: the same logits and gradients as transformers


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_fp32_logits_and_gradients_match(model_type):
    ref_logits, ref_grads, _ = forward_backward(model_type, torch.float32, False)
    logits, grads, handle = forward_backward(model_type, torch.float32, True)
    torch.testing.assert_close(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], msg=lambda m, n=name: f"{n}: {m}")
    decoder = [t for t in handle.targets if not t.endswith("_vision")]
    assert sum(handle.calls[t] for t in decoder) > 0, handle
    assert all(n == 0 for n in handle.fallbacks.values()), handle


QK_NORM_TYPES = [mt for mt in ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_next") if mt in SUPPORTED]


@pytest.mark.parametrize("model_type", QK_NORM_TYPES)
def test_fp32_training_step_is_bit_identical_with_per_head_norms(model_type):
    """Models that normalize q and k per head before the rotation: with SDPA attention the
    gradient reaching the rotation is laid out (B, T, H, D); the patched backward must hand
    back q's and k's gradients in the layout transformers' autograd gives (contiguous
    (B, H, T, D)), or the norms' weight gradients sum in another order.  Every parameter
    gradient is the same bits."""
    ref_logits, ref_grads, _ = forward_backward(model_type, torch.float32, False, "sdpa")
    logits, grads, handle = forward_backward(model_type, torch.float32, True, "sdpa")
    assert sum(handle.calls.values()) > 0, handle
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    assert any(".q_norm." in name for name in grads)
    different = [name for name, g in grads.items() if not torch.equal(g, ref_grads[name])]
    assert not different, different


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_bf16_as_close_to_fp64_as_transformers(model_type):
    """transformers rounds after each elementwise op (or computes in fp32 and rounds once,
    for Cohere and ERNIE), posenc rounds once: the patched bf16 model must be as close to
    an fp64 run (fp32 for MoE models, whose grouped products have no fp64) as
    transformers' bf16 run (within 2x, plus 1e-3 of the largest value for
    the routing ties of random MoE weights)."""
    try:
        ref_logits, ref_grads, _ = forward_backward(model_type, torch.float64, False)
    except RuntimeError as e:  # grouped matrix products of MoE experts have no fp64
        if "Double" not in str(e):
            raise
        ref_logits, ref_grads, _ = forward_backward(model_type, torch.float32, False)
    hf_logits, hf_grads, _ = forward_backward(model_type, torch.bfloat16, False)
    pe_logits, pe_grads, handle = forward_backward(model_type, torch.bfloat16, True)
    assert sum(handle.calls.values()) > 0 and not any(handle.fallbacks.values()), handle
    for name, hf_x, pe_x, ref_x in (
            ("logits", hf_logits, pe_logits, ref_logits),
            ("gradients", all_grads(hf_grads), all_grads(pe_grads), all_grads(ref_grads))):
        hf_err, pe_err = rel_err(hf_x, ref_x), rel_err(pe_x, ref_x)
        assert pe_err <= 2 * hf_err + 1e-3, (
            f"{name}: posenc {pe_err:.2e} vs transformers {hf_err:.2e}")


# ---------------------------------------------------------------------------------------
# Each supported function against the original, on any tables and call forms


def _qk(layout_dim: int, dtype: torch.dtype, dim: int = 16, batch: int = 2, seq: int = 5):
    """q (B, 4, T, D), k (B, 2, T, D) as transposed views of projection outputs
    (layout_dim 1), or (B, T, H, D) (layout_dim 2); they require grad."""
    q = torch.randn(batch, seq, 4 * dim, dtype=dtype).view(batch, seq, 4, dim)
    k = torch.randn(batch, seq, 2 * dim, dtype=dtype).view(batch, seq, 2, dim)
    q, k = q.requires_grad_(), k.requires_grad_()
    return (q.transpose(1, 2), k.transpose(1, 2)) if layout_dim == 1 else (q, k)


def _run(fn, q, k, cos, sin, **kwargs):
    """The outputs, and the gradients of q, k, cos, sin for a fixed random cotangent."""
    out = fn(q, k, cos, sin, **kwargs)
    gen = torch.Generator().manual_seed(3)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
               for o in out)
    grads = torch.autograd.grad(loss, [q, k, cos, sin], allow_unused=True)
    return out, grads


def _outcome(fn, *args, **kwargs):
    try:
        return _run(fn, *args, **kwargs), None
    except Exception as e:  # noqa: BLE001 -- compared with the original's own error
        return None, e


def skip_if_multimodal(model_type: str) -> None:
    if model_type in ("qwen2_vl", "qwen2_5_vl") and hasattr(modeling(model_type),
                                                          "apply_multimodal_rotary_pos_emb"):
        pytest.skip(f"transformers {transformers.__version__}'s {model_type} attention calls "
                    "apply_multimodal_rotary_pos_emb (test_hf_patch.py tests it)")


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 -- compared with the original's own error
        return None, e


ROTARY_FUNCTIONS = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")


def _functions(model_type: str) -> list[str]:
    """The rotary functions ``patch`` replaces in the model's module (decoder only)."""
    with hf.patch(model_type) as handle:
        return [t.split(".", 1)[1] for t in handle.targets
                if t.split(".", 1)[1] in ROTARY_FUNCTIONS]


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_function_matches_for_any_table_width(model_type):
    """For tables of every width from 1 to 2 * head_dim (arbitrary values; the two halves
    differ), both layouts, Bc in {1, B}: the patched function returns what transformers'
    returns (fp32: the same bits; gradients of q, k, cos, sin to fp32 rounding) or raises
    the same error; the posenc op computes the widths the model's form defines."""
    tiny_config(model_type)
    skip_if_multimodal(model_type)
    for function in _functions(model_type):
        _check_any_table_width(model_type, function)


def _check_any_table_width(model_type: str, function: str) -> None:
    module = modeling(model_type)
    original = getattr(module, function)
    computed = 0
    with hf.patch(model_type) as handle:
        patched = getattr(module, function)
        target = f"{model_type}.{function}"
        for width in range(1, 33):
            for layout_dim, cos_batch in ((1, 1), (2, 2)):
                q, k = _qk(layout_dim, torch.float32)
                angle = torch.rand(cos_batch, 5, width, dtype=torch.float64) * 6
                cos = angle.cos().float().requires_grad_()
                sin = (angle * 1.3).sin().float().requires_grad_()
                kwargs = {"unsqueeze_dim": 2} if layout_dim == 2 else {}
                ref, ref_error = _outcome(original, q, k, cos, sin, **kwargs)
                before = handle.calls[target]
                got, error = _outcome(patched, q, k, cos, sin, **kwargs)
                case = f"{function}, width {width}, unsqueeze_dim {layout_dim}"
                if ref_error is not None:
                    assert type(error) is type(ref_error) and str(error) == str(ref_error), case
                    assert handle.calls[target] == before, case
                    continue
                assert error is None, f"{case}: {error!r}"
                computed += handle.calls[target] - before
                (ref_out, ref_grads), (out, grads) = ref, got
                for o, r in zip(out, ref_out, strict=True):
                    assert o.dtype == r.dtype and o.shape == r.shape, case
                    torch.testing.assert_close(o, r, rtol=0, atol=0, msg=case)
                for g, r in zip(grads, ref_grads, strict=True):
                    torch.testing.assert_close(g, r, msg=case)
    assert computed > 0, function


@pytest.mark.parametrize("model_type", SUPPORTED)
@pytest.mark.parametrize(("q_dtype", "cos_dtype"), [
    (torch.bfloat16, torch.float32),  # autocast: bf16 projections, fp32 tables
    (torch.float64, torch.float64), (torch.float16, torch.float16)])
def test_function_dtypes(model_type, q_dtype, cos_dtype):
    """Other dtype combinations: the result has transformers' dtype and is as close to an
    fp64 evaluation of transformers' function as transformers' own result."""
    tiny_config(model_type)
    skip_if_multimodal(model_type)
    module = modeling(model_type)
    q, k = (t.detach() for t in _qk(1, q_dtype))
    angle = torch.rand(1, 5, 16, dtype=torch.float64) * 6
    for function in _functions(model_type):
        original = getattr(module, function)
        for width in (16, 8):
            cos, sin = angle[..., :width].cos(), angle[..., :width].sin()
            try:
                ref = original(q, k, cos.to(cos_dtype), sin.to(cos_dtype))
            except RuntimeError:
                continue  # a width this model's function does not take
            exact = original(q.double(), k.double(), cos, sin)
            with hf.patch(model_type):
                out = getattr(module, function)(q, k, cos.to(cos_dtype), sin.to(cos_dtype))
            for o, r, e in zip(out, ref, exact, strict=True):
                assert o.dtype == r.dtype
                assert rel_err(o, e) <= 2 * rel_err(r, e) + 1e-7, (function, width)


@pytest.mark.parametrize("model_type", ["llama", "cohere", "glm", "gpt_oss", "phi3"])
def test_calls_in_other_forms_go_to_the_original(model_type):
    """Argument forms transformers' attention does not use reach the original function
    as they were given: the same result, or the same TypeError."""
    if model_type not in SUPPORTED:
        pytest.skip(f"{model_type} is not supported by transformers {transformers.__version__}")
    tiny_config(model_type)
    module = modeling(model_type)
    original = module.apply_rotary_pos_emb
    q, k = (t.detach() for t in _qk(1, torch.float32))
    angle = torch.rand(1, 5, 8 if model_type == "gpt_oss" else 16) * 6
    cos, sin = angle.cos(), angle.sin()
    calls = [
        ((q,), dict(cos=cos, sin=sin)),  # no k
        ((q, k, cos, sin, 1, 1, 1), {}),  # too many arguments
        ((q, k, cos, sin), dict(unsqueeze=1)),  # an unknown keyword
        ((q, k, cos), dict(sin=sin, cos=cos)),  # cos twice
        ((q, k, cos, sin, 1), dict(unsqueeze_dim=1)),  # unsqueeze_dim twice
    ]
    with hf.patch(model_type) as handle:
        patched = module.apply_rotary_pos_emb
        for args, kwargs in calls:
            ref, ref_error = _call(original, *args, **kwargs)
            got, error = _call(patched, *args, **kwargs)
            assert (ref_error is None) == (error is None), (args, kwargs, error, ref_error)
            if ref_error is not None:
                assert type(error) is type(ref_error) and str(error) == str(ref_error)
            else:
                for o, r in zip(got, ref, strict=True):
                    torch.testing.assert_close(o, r, rtol=0, atol=0)
        target = f"{model_type}.apply_rotary_pos_emb"
        # (4.x: the last call passes 1 as position_ids, which the function never reads, and
        # the default unsqueeze_dim: the captured form, computed by posenc)
        computed = int("position_ids" in inspect.signature(original).parameters)
        assert handle.calls[target] == computed
        assert handle.fallbacks[target] == len(calls) - computed
        # The form transformers uses, however its arguments are passed, is computed by posenc.
        patched(q, k, cos, sin, unsqueeze_dim=1)
        patched(q=q, k=k, cos=cos, sin=sin)
        assert handle.calls[target] == computed + 2
