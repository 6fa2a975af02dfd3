"""posenc_torch.hf.patch's fused q/k norm + rotary (posenc_torch/hf/_qk_attention.py) in
tiny random models of every type the verified table's release facts list as fused for the
installed transformers: fp32 logits and the gradients of every parameter (the q/k norm
weights included) bit-identical to the unpatched model, with the eager and the SDPA
attention; bf16 logits and gradients bit-identical to the model patched with
``fuse_qk_norm=False``; greedy generation with the dynamic cache (prefill, then T = 1
steps) and the static cache as unpatched (where transformers raises, as 4.57's qwen3_next
does with a static cache, the patched model raises the same); what the attention function
and the cache receive; torch.compile(fullgraph=True) from the first call; the calls the
fused forward does not take (hooks on a norm, a norm class without a row, CPU autocast, a
tensor subclass, another device) go to transformers' forward, counted; ``undo()`` restores
it.

(Generation compiled with ``fullgraph=True``, beam search, left padding and images for
qwen3, qwen3_vl, qwen3_vl_moe and gemma3 are in test_hf_generate.py, which runs the
default patch and so the fused forward.)
"""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext

import pytest
import test_hf_models as models
import torch
from transformers import StaticCache

import posenc_torch.hf as hf
from posenc_torch.hf import _qk_attention, _table, _transformers

pytestmark = pytest.mark.any_transformers

FUSED = tuple(_table.releases()["fused"].get(_transformers.version(), ()))


def attention_targets(handle) -> list[str]:
    return [t for t in handle.targets if t.endswith(".forward") and "Attention" in t]


def run(model_type: str, dtype: torch.dtype, attn: str, patch: dict | None):
    """Logits and {name: gradient} of one training step on two rows of 13 tokens, and the
    handle (None unpatched)."""
    model = models.tiny_model(model_type, dtype, attn)
    input_ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(1))
    handle = hf.patch(model_type, **patch) if patch is not None else None
    with handle or nullcontext():
        out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
        out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads, handle


def assert_identical(a, b) -> None:
    logits, grads = a[0], a[1]
    assert torch.equal(logits, b[0])
    assert grads.keys() == b[1].keys() and any(".q_norm." in n for n in grads)
    different = [n for n, g in grads.items() if not torch.equal(g, b[1][n])]
    assert not different, different


def test_the_written_types_are_fused():
    """Every type the release facts list runs the fused forward, and no other type does."""
    assert FUSED, f"no fused types written for transformers {_transformers.version()}"
    with hf.patch() as handle:
        fused = {t.split(".")[0] for t in attention_targets(handle)}
    assert fused == set(FUSED)
    with hf.patch(fuse_qk_norm=False) as handle:
        assert not attention_targets(handle)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", FUSED)
def test_fp32_step_is_bit_identical_to_transformers(model_type, attn):
    ref = run(model_type, torch.float32, attn, None)
    out = run(model_type, torch.float32, attn, {})
    assert_identical(out, ref)
    handle = out[2]
    targets = attention_targets(handle)
    assert targets and all(handle.calls[t] > 0 and handle.fallbacks[t] == 0 for t in targets)


@pytest.mark.parametrize("model_type", FUSED)
def test_bf16_step_is_bit_identical_to_the_unfused_patch(model_type):
    ref = run(model_type, torch.bfloat16, "sdpa", {"fuse_qk_norm": False})
    out = run(model_type, torch.bfloat16, "sdpa", {})
    assert_identical(out, ref)
    assert sum(out[2].calls[t] for t in attention_targets(out[2])) > 0


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("model_type", FUSED)
def test_greedy_generation_as_unpatched(model_type, cache):
    model = models.tiny_model(model_type, torch.float32, "sdpa").eval()
    input_ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(3))

    def generate():
        kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True,
                      return_dict_in_generate=True, pad_token_id=2)
        if cache == "static":
            kwargs["past_key_values"] = StaticCache(config=model.config, max_cache_len=16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model.generate(input_ids, **kwargs)

    try:
        ref = generate()
    except Exception as e:  # noqa: BLE001 -- transformers' own failure: the same patched
        with hf.patch(model_type), pytest.raises(type(e)):
            generate()
        return
    with hf.patch(model_type) as handle:
        out = generate()
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores, strict=True))
    assert sum(handle.calls[t] for t in attention_targets(handle)) > 0


# ---------------------------------------------------------------------------------------
# Calls that go to transformers' forward.


def _qwen3_step(handle_kwargs: dict | None = None, prepare=None):
    model = models.tiny_model("qwen3", torch.float32, "sdpa").eval()
    if prepare is not None:
        prepare(model)
    input_ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(input_ids=input_ids).logits
        with hf.patch("qwen3", **(handle_kwargs or {})) as handle:
            out = model(input_ids=input_ids).logits
    return out, ref, handle


def _counts(handle) -> tuple[int, int]:
    (target,) = attention_targets(handle)
    return handle.calls[target], handle.fallbacks[target]


@pytest.mark.skipif("qwen3" not in FUSED, reason="qwen3 is not fused under this release")
def test_hooks_on_a_norm_go_to_transformers():
    seen = []

    def prepare(model):
        model.model.layers[0].self_attn.q_norm.register_forward_hook(
            lambda *args: seen.append(1))

    out, ref, handle = _qwen3_step(prepare=prepare)
    assert torch.equal(out, ref) and len(seen) == 2  # the hook ran in both calls
    calls, fallbacks = _counts(handle)
    assert fallbacks == 1 and calls == models.LAYERS - 1


@pytest.mark.skipif("qwen3" not in FUSED, reason="qwen3 is not fused under this release")
def test_a_norm_class_without_a_row_goes_to_transformers():
    def prepare(model):
        attn = model.model.layers[1].self_attn
        norm_class = type(attn.k_norm)

        class MyNorm(norm_class):
            def forward(self, hidden_states):
                return super().forward(hidden_states) * 1.0

        for name in ("q_norm", "k_norm"):
            old = getattr(attn, name)
            new = MyNorm(old.weight.shape[0], eps=old.variance_epsilon)
            new.load_state_dict(old.state_dict())
            setattr(attn, name, new)

    out, ref, handle = _qwen3_step(prepare=prepare)
    assert torch.equal(out, ref)
    assert _counts(handle) == (models.LAYERS - 1, 1)


@pytest.mark.skipif("qwen3" not in FUSED, reason="qwen3 is not fused under this release")
def test_autocast_goes_to_transformers():
    model = models.tiny_model("qwen3", torch.float32, "sdpa").eval()
    input_ids = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(input_ids=input_ids).logits
        with hf.patch("qwen3") as handle:
            out = model(input_ids=input_ids).logits
    assert torch.equal(out, ref)
    assert _counts(handle) == (0, models.LAYERS)


@pytest.mark.skipif("qwen3" not in FUSED, reason="qwen3 is not fused under this release")
def test_fuse_qk_norm_false_and_undo_leave_the_forward_alone():
    cls = _transformers.modeling_module("qwen3").Qwen3Attention
    before = vars(cls)["forward"]
    with hf.patch("qwen3", fuse_qk_norm=False):
        assert vars(cls)["forward"] is before
    with hf.patch("qwen3"):
        assert vars(cls)["forward"] is not before
    assert vars(cls)["forward"] is before
    with pytest.raises(TypeError, match="fuse_qk_norm must be a bool"):
        hf.patch("qwen3", fuse_qk_norm=1)


@pytest.mark.skipif("qwen3" not in FUSED, reason="qwen3 is not fused under this release")
def test_attention_function_and_cache_get_what_they_get_unpatched():
    """A flash-attention stand-in (a registered attention function that records its
    arguments) and a cache that records its updates: the same tensors (values, dtype,
    strides) and keywords patched as unpatched, sliding window included."""
    from transformers import AttentionInterface

    records = []

    def stand_in(module, query, key, value, attention_mask, **kwargs):
        records.append((query, key, value, dict(kwargs)))
        sdpa = vars(_transformers.modeling_module("qwen3"))["ALL_ATTENTION_FUNCTIONS"]["sdpa"]
        return sdpa(module, query, key, value, attention_mask,
                    **{k: v for k, v in kwargs.items() if k != "sliding_window"})

    AttentionInterface.register("posenc_test_stand_in", stand_in)
    config = models.tiny_config("qwen3")
    config.use_sliding_window, config.sliding_window = True, 4
    config.layer_types = ["sliding_attention", "full_attention"]
    model = models.AutoModelForCausalLM.from_config(
        config, attn_implementation="posenc_test_stand_in").eval()
    input_ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model(input_ids=input_ids)
        ref, records[:] = list(records), []
        with hf.patch("qwen3") as handle:
            model(input_ids=input_ids)
    assert _counts(handle) == (models.LAYERS, 0)
    assert len(records) == len(ref) == models.LAYERS
    assert [r[3].get("sliding_window") for r in ref] == [4, None]
    for (q, k, v, kw), (q0, k0, v0, kw0) in zip(records, ref, strict=True):
        for a, b in ((q, q0), (k, k0), (v, v0)):
            assert a.stride() == b.stride() and torch.equal(a, b)
        assert kw.keys() == kw0.keys()


def test_the_templates_are_named_in_the_table():
    """Every attention row names a template the fused forward has, every norm row a form
    of the op."""
    rows = _table.shipped().values()
    uses = {r.use for r in rows if r.function == _qk_attention.ATTENTION}
    assert uses and uses <= {t.use for t in _qk_attention.TEMPLATES}
    norms = [_qk_attention.parse_norm(r.use) for r in rows if r.function == _qk_attention.NORM]
    assert norms and all(n is not None for n in norms)


@pytest.mark.parametrize("model_type", FUSED[:1])
def test_a_wrong_rotation_in_the_fused_op_would_be_caught(model_type, monkeypatch):
    """The comparisons above can fail: the fused op rotating the wrong way moves the
    logits."""
    from posenc_torch import qk_norm

    ref = run(model_type, torch.float32, "sdpa", None)
    real = qk_norm.apply_qk_norm_rope
    monkeypatch.setattr(qk_norm, "apply_qk_norm_rope",
                        lambda q, k, cos, sin, *a, **kw: real(q, k, cos, -sin, *a, **kw))
    out = run(model_type, torch.float32, "sdpa", {})
    assert sum(out[2].calls[t] for t in attention_targets(out[2])) > 0
    assert not torch.equal(out[0], ref[0])


class _Marked(torch.Tensor):
    """A tensor subclass (as a wrapper library would pass)."""


@pytest.mark.skipif("qwen3" not in FUSED, reason="qwen3 is not fused under this release")
def test_a_tensor_subclass_another_device_and_float64_go_to_transformers():
    model = models.tiny_model("qwen3", torch.float32, "sdpa").eval()
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, 5, model.config.hidden_size, generator=gen)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(5)[None])
    with torch.no_grad():
        ref = attn(hidden, (cos, sin), None)[0]
        with hf.patch("qwen3") as handle:
            out = attn(hidden.as_subclass(_Marked), (cos, sin), None)[0]
            assert _counts(handle) == (0, 1)
            out_meta = copy.deepcopy(attn).to("meta")(
                hidden.to("meta"), (cos.to("meta"), sin.to("meta")), None)[0]
            assert _counts(handle) == (0, 2) and out_meta.device.type == "meta"
            attn64 = copy.deepcopy(attn).double()  # a dtype the fused op does not take
            out64 = attn64(hidden.double(), (cos.double(), sin.double()), None)[0]
            assert _counts(handle) == (0, 3) and out64.dtype == torch.float64
            assert torch.equal(attn(hidden, (cos, sin), None)[0], ref)
            assert _counts(handle) == (1, 3)
    assert torch.equal(out.as_subclass(torch.Tensor), ref)


@pytest.mark.parametrize("model_type", [mt for mt in ("qwen3", "qwen3_next") if mt in FUSED])
def test_compiled_fullgraph_from_the_first_call(model_type):
    """torch.compile(fullgraph=True) of a freshly patched model, compiled on its first
    call (nothing decided in eager calls before): the fused forward traces, and the logits
    are those of the unpatched model compiled the same way (aot_eager on both sides)."""
    model = models.tiny_model(model_type, torch.float32, "sdpa").eval()
    input_ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(8))

    def logits():
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            return compiled(input_ids=input_ids).logits

    try:
        ref = logits()
    except Exception as e:  # noqa: BLE001 -- transformers' own (4.57's qwen3_next branches
        # on data): the same patched
        with hf.patch(model_type), pytest.raises(type(e)):
            logits()
        torch._dynamo.reset()
        return
    with hf.patch(model_type) as handle:
        out = logits()
    torch._dynamo.reset()
    assert torch.equal(out, ref)
    assert _counts(handle) == (models.LAYERS if model_type == "qwen3" else 1, 0)
