"""MRoPE, the cos/sin table builder, fused RoPE and the vision RoPE against transformers.

References are transformers' own functions and rotary modules (imported, built from small
configs), or the same expressions evaluated in float64.  Rules used throughout:

* fp32 / fp64 data with tables given: bit-identical to transformers' eager expression
  (same operations, no fused multiply-add), compared with ``torch.equal``.
* bf16 / fp16 data: the kernels compute in fp32 and round once, transformers rounds after
  every op; the test is that our largest error against a float64 evaluation of the same
  expression is no larger than transformers' own largest error.
* cos/sin built from positions: trigonometry is correctly rounded fp32 here and within one
  ulp in torch, so fp32 tables agree to one ulp; see ``assert_tables_match``.
"""

from __future__ import annotations

import contextlib
import importlib
import math

import pytest
import torch
import transformers

import posenc_torch as P

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
needs_transformers5 = pytest.mark.skipif(
    TRANSFORMERS_MAJOR < 5,
    reason="compares with the transformers 5.x rotary modules (rope_parameters configs)")

SECTIONS = [([16, 24, 24], 128), ([8, 12, 12], 64), ([2, 1, 1], 8)]
LOW = (torch.bfloat16, torch.float16)


def hf_module(name: str):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def partner_abs(x: torch.Tensor, pairing: str = "half", rot: int | None = None) -> torch.Tensor:
    """|x[p(e)]| of each rotary channel e (pass-through channels: 0)."""
    rot = x.shape[-1] if rot is None else rot
    r = x[..., :rot].abs()
    if pairing == "half":
        p = torch.cat((r[..., rot // 2:], r[..., : rot // 2]), dim=-1)
    else:
        p = r.unflatten(-1, (rot // 2, 2)).flip(-1).flatten(-2)
    return torch.cat((p, torch.zeros_like(x[..., rot:])), dim=-1)


def ulp(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.nextafter(a, torch.full_like(a, math.inf)) - a


def make_qk(B, H, T, D, dtype, layout, unsqueeze_dim):
    """q/k in the layout the public functions take, built with the given memory layout.

    unsqueeze_dim=1 wants (B, H, T, D), 2 wants (B, T, H, D).  Layouts:
      "dense":    contiguous in the wanted shape
      "swapped":  a transpose(1, 2) view of the other layout (what HF attention passes)
      "strided":  a head/channel slice of a wider tensor (not dense)
      "channels": the channel dim is not innermost (forces a copy inside)
    """
    shape = (B, H, T, D) if unsqueeze_dim == 1 else (B, T, H, D)
    if layout == "dense":
        return torch.randn(shape, dtype=torch.float64).to(dtype)
    if layout == "swapped":
        other = (shape[0], shape[2], shape[1], shape[3])
        return torch.randn(other, dtype=torch.float64).to(dtype).transpose(1, 2)
    if layout == "strided":
        wide = torch.randn(shape[0], shape[1] + 1, shape[2], D + 3, dtype=torch.float64).to(dtype)
        return wide[:, 1:, :, 2:2 + D]
    if layout == "channels":
        return torch.randn(*shape[:3], D, dtype=torch.float64).to(dtype).transpose(-1, -2) \
            .contiguous().transpose(-1, -2)
    raise AssertionError(layout)


def mrope_tables(Bc, T, D, dtype, kind="random"):
    """(3, Bc, T, D) cos/sin.  "random": arbitrary values (both halves differ, so every
    channel's own entry matters); "positions": real tables from 3-D position ids."""
    if kind == "random":
        cos = torch.randn(3, Bc, T, D, dtype=torch.float64).to(dtype)
        sin = torch.randn(3, Bc, T, D, dtype=torch.float64).to(dtype)
        return cos, sin
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    pos = torch.randint(0, 4000, (3, Bc, T))
    freqs = pos[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def assert_low_precision_ok(ours, hf, ref64):
    """Our worst error against float64 is no larger than transformers' eager worst error."""
    assert ours.dtype == hf.dtype and ours.shape == hf.shape
    err_ours = (ours.double() - ref64).abs().max().item()
    err_hf = (hf.double() - ref64).abs().max().item()
    assert err_ours <= err_hf, (err_ours, err_hf)
    # and each element is one rounding (plus fp32 arithmetic) away from the reference
    tol = ulp(ref64.to(ours.dtype)).double() + 2.0 ** -20 * ref64.abs().max()
    assert ((ours.double() - ref64).abs() <= tol).all()


def check_result(ours, hf, ref64):
    if hf.dtype in LOW:
        assert_low_precision_ok(ours, hf, ref64)
    else:
        assert ours.dtype == hf.dtype and ours.shape == hf.shape
        assert torch.equal(ours, hf)


# =======================================================================================
# apply_multimodal_rotary_pos_emb vs transformers 4.57 (Qwen2-VL, Qwen2.5-VL)
# =======================================================================================

# (B, Bc, Hq, Hkv, T, unsqueeze_dim, layout)
SHAPES = [
    (1, 1, 2, 2, 1, 1, "swapped"),     # T = 1 (decode step), HF's transposed view
    (2, 1, 4, 2, 7, 1, "swapped"),     # GQA, cos shared by the batch, odd T
    (2, 2, 4, 1, 16, 1, "dense"),      # MQA, per-batch cos
    (2, 2, 2, 2, 5, 2, "dense"),       # (B, T, H, D) with unsqueeze_dim=2
    (2, 1, 3, 1, 9, 2, "swapped"),     # (B, T, H, D) view of (B, H, T, D) memory
    (1, 1, 2, 1, 3, 1, "strided"),     # not dense
    (2, 2, 2, 2, 4, 1, "channels"),    # channel dim not innermost
]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _hf_mrope(mod, q, k, cos, sin, sections, unsqueeze_dim):
    return mod.apply_multimodal_rotary_pos_emb(q, k, cos, sin, sections, unsqueeze_dim)


@pytest.mark.transformers4
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sections,D", SECTIONS, ids=["16-24-24", "8-12-12", "2-1-1"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_mrope_forward_matches_hf4(shape, sections, D, dtype, isa):
    mod = hf_module("qwen2_vl")
    B, Bc, Hq, Hkv, T, usd, layout = shape
    q = make_qk(B, Hq, T, D, dtype, layout, usd)
    k = make_qk(B, Hkv, T, D, dtype, layout, usd)
    cos, sin = mrope_tables(Bc, T, D, dtype)
    saved = [t.clone() for t in (q, k, cos, sin)]
    ours = P.apply_multimodal_rotary_pos_emb(q, k, cos, sin, sections, usd)
    hf = _hf_mrope(mod, q, k, cos, sin, sections, usd)
    ref = _hf_mrope(mod, q.double(), k.double(), cos.double(), sin.double(), sections, usd)
    for o, h, r in zip(ours, hf, ref):
        check_result(o, h, r)
    for before, after in zip(saved, (q, k, cos, sin)):
        assert torch.equal(before, after), "an input was modified"


@pytest.mark.transformers4
@pytest.mark.parametrize("model", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("container", [list, tuple])
@pytest.mark.parametrize("kind", ["random", "positions"])
def test_mrope_sections_list_or_tuple(model, container, kind):
    mod = hf_module(model)
    sections = container([16, 24, 24])
    q = make_qk(2, 4, 6, 128, torch.bfloat16, "swapped", 1)
    k = make_qk(2, 2, 6, 128, torch.bfloat16, "swapped", 1)
    cos, sin = mrope_tables(2, 6, 128, torch.bfloat16, kind)
    ours = P.apply_multimodal_rotary_pos_emb(q, k, cos, sin, sections)
    hf = mod.apply_multimodal_rotary_pos_emb(q, k, cos, sin, sections)
    ref = mod.apply_multimodal_rotary_pos_emb(q.double(), k.double(), cos.double(),
                                              sin.double(), sections)
    for o, h, r in zip(ours, hf, ref):
        assert_low_precision_ok(o, h, r)
    # fp32 of the same data is bit-identical
    ours = P.apply_multimodal_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float(),
                                             sections)
    hf = mod.apply_multimodal_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float(),
                                             sections)
    for o, h in zip(ours, hf):
        assert torch.equal(o, h)


@pytest.mark.transformers4
@pytest.mark.parametrize("cos_dtype", [torch.float32, torch.float64])
def test_mrope_mixed_dtypes_promote_like_hf(cos_dtype):
    """bf16 q/k with fp32 cos/sin (autocast with an fp32 model) give fp32 results."""
    mod = hf_module("qwen2_vl")
    q = make_qk(2, 4, 5, 64, torch.bfloat16, "swapped", 1)
    k = make_qk(2, 2, 5, 64, torch.bfloat16, "swapped", 1)
    cos, sin = mrope_tables(1, 5, 64, cos_dtype)
    ours = P.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [8, 12, 12])
    hf = mod.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [8, 12, 12])
    for o, h in zip(ours, hf):
        assert o.dtype == h.dtype == cos_dtype
        assert torch.equal(o, h)


@pytest.mark.transformers4
def test_mrope_threaded_size_matches_hf(isa):
    """Large enough for the threaded path, on every SIMD variant of this CPU."""
    mod = hf_module("qwen2_vl")
    for dtype in (torch.float32, torch.bfloat16):
        q = make_qk(1, 4, 96, 128, dtype, "swapped", 1)
        k = make_qk(1, 2, 96, 128, dtype, "swapped", 1)
        cos, sin = mrope_tables(1, 96, 128, dtype, "positions")
        ours = P.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [16, 24, 24])
        hf = mod.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [16, 24, 24])
        ref = mod.apply_multimodal_rotary_pos_emb(q.double(), k.double(), cos.double(),
                                                  sin.double(), [16, 24, 24])
        for o, h, r in zip(ours, hf, ref):
            check_result(o, h, r)


def test_mrope_tiny_example_section_4_2():
    """head_dim 8, theta 1e4, sections [2, 1, 1], token at (T, H, W) = (2, 2, 3), q = 1..8."""
    inv = torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64)
    pos = torch.tensor([2.0, 2.0, 3.0], dtype=torch.float64)
    freqs = pos[:, None] * inv                      # (3, 4): one row per axis
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]   # (3, 1, 1, 8)
    q = torch.arange(1.0, 9.0, dtype=torch.float64).view(1, 1, 1, 8)
    out, _ = P.apply_multimodal_rotary_pos_emb(q, q.clone(), emb.cos(), emb.sin(), [2, 1, 1])
    expected = torch.tensor([-4.9626, 0.7681, 2.8594, 3.9760, -1.1714, 6.2777, 7.0586, 8.0120],
                            dtype=torch.float64)
    torch.testing.assert_close(out.flatten(), expected, rtol=0, atol=6e-5)
    # the same through positions: fused and table builder
    pos_ids = torch.tensor([2, 2, 3]).view(3, 1, 1)
    fused, _ = P.apply_rope(q, q.clone(), pos_ids, inv.float(), mrope_section=[2, 1, 1])
    torch.testing.assert_close(fused.flatten(), expected, rtol=0, atol=6e-5)
    cos, sin = P.compute_mrope_cos_sin(pos_ids, inv.float(), [2, 1, 1], dtype=torch.float64)
    angles = torch.tensor([2.0, 0.2, 0.02, 0.003] * 2)
    torch.testing.assert_close(cos.flatten(), angles.double().cos(), rtol=0, atol=1e-7)


@needs_transformers5
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mrope_matches_hf5_merged_tables(dtype):
    """transformers 5.x merges the axes in Qwen2VLRotaryEmbedding and then calls the plain
    apply_rotary_pos_emb; our unmerged (3, B, T, D) path gives the same values."""
    mod = hf_module("qwen2_vl")
    cfg = transformers.Qwen2VLTextConfig(
        hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    rot = mod.Qwen2VLRotaryEmbedding(cfg)
    cos3, sin3 = mrope_tables(2, 7, 128, dtype, "positions")
    merged_cos = rot.recomposition_frequencies(cos3[..., :64])
    merged_sin = rot.recomposition_frequencies(sin3[..., :64])
    q = make_qk(2, 4, 7, 128, dtype, "swapped", 1)
    k = make_qk(2, 2, 7, 128, dtype, "swapped", 1)
    ours = P.apply_multimodal_rotary_pos_emb(q, k, cos3, sin3, [16, 24, 24])
    hf = mod.apply_rotary_pos_emb(q, k, merged_cos, merged_sin)
    ref = mod.apply_rotary_pos_emb(q.double(), k.double(), merged_cos.double(),
                                   merged_sin.double())
    for o, h, r in zip(ours, hf, ref):
        check_result(o, h, r)


# ---- backward ------------------------------------------------------------------------


def _grads(fn, q, k, cos, sin, go_q, go_k, wrt_tables):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k)]
    tabs = [t.detach().clone().requires_grad_(wrt_tables) for t in (cos, sin)]
    oq, ok = fn(*leaves, *tabs)
    inputs = leaves + (tabs if wrt_tables else [])
    return torch.autograd.grad((oq, ok), inputs, (go_q.to(oq.dtype), go_k.to(ok.dtype)))


@pytest.mark.transformers4
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("wrt_tables", [False, True], ids=["qk", "qk+tables"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], SHAPES[4]],
                         ids=lambda s: "-".join(map(str, s)))
def test_mrope_backward_matches_hf4(shape, wrt_tables, dtype, isa):
    mod = hf_module("qwen2_vl")
    B, Bc, Hq, Hkv, T, usd, layout = shape
    sections, D = [8, 12, 12], 64
    q = make_qk(B, Hq, T, D, dtype, layout, usd)
    k = make_qk(B, Hkv, T, D, dtype, layout, usd)
    cos, sin = mrope_tables(Bc, T, D, dtype)
    # output gradients representable in the dtype, so the fp64 reference sees the same ones
    go_q = torch.randn(q.shape).to(dtype).double()
    go_k = torch.randn(k.shape).to(dtype).double()

    def ours_fn(*a):
        return P.apply_multimodal_rotary_pos_emb(*a, sections, usd)

    def hf_fn(*a):
        return mod.apply_multimodal_rotary_pos_emb(*a, sections, usd)

    ours = _grads(ours_fn, q, k, cos, sin, go_q, go_k, wrt_tables)
    hf = _grads(hf_fn, q, k, cos, sin, go_q, go_k, wrt_tables)
    ref = _grads(hf_fn, q.double(), k.double(), cos.double(), sin.double(), go_q, go_k,
                 wrt_tables)
    names = ["q", "k", "cos", "sin"]
    for name, o, h, r in zip(names, ours, hf, ref):
        assert o.dtype == h.dtype and o.shape == h.shape, name
        if dtype in LOW:
            err_o = (o.double() - r).abs().max().item()
            err_h = (h.double() - r).abs().max().item()
            if name in ("cos", "sin"):
                # sums over heads (and batch): ours accumulate in fp32, HF in the 16-bit dtype
                assert err_o <= err_h + ulp(r.abs().max().to(dtype)).item(), (name, err_o, err_h)
            else:
                assert err_o <= err_h, (name, err_o, err_h)
        elif name in ("q", "k"):
            assert torch.equal(o, h), name      # the same two products and one sum
        else:
            # table gradients are sums over heads and batch; only the order differs
            tol = 1e-12 if dtype == torch.float64 else 2e-6
            torch.testing.assert_close(o, h, rtol=tol, atol=tol)


@pytest.mark.transformers4
def test_mrope_backward_mixed_dtypes_and_unused_output():
    """bf16 q/k with fp32 tables that require grad; and a loss that uses only q."""
    mod = hf_module("qwen2_vl")
    q = make_qk(2, 4, 5, 16, torch.bfloat16, "swapped", 1)
    k = make_qk(2, 2, 5, 16, torch.bfloat16, "swapped", 1)
    cos, sin = mrope_tables(1, 5, 16, torch.float32)
    go_q, go_k = torch.randn(q.shape), torch.randn(k.shape)
    ours = _grads(lambda *a: P.apply_multimodal_rotary_pos_emb(*a, [2, 3, 3]),
                  q, k, cos, sin, go_q, go_k, True)
    hf = _grads(lambda *a: mod.apply_multimodal_rotary_pos_emb(*a, [2, 3, 3]),
                q, k, cos, sin, go_q, go_k, True)
    ref = _grads(lambda *a: mod.apply_multimodal_rotary_pos_emb(*a, [2, 3, 3]),
                 q.double(), k.double(), cos.double(), sin.double(), go_q, go_k, True)
    for name, o, h, r in zip("q k cos sin".split(), ours, hf, ref):
        assert o.dtype == h.dtype, name
        err_o = (o.double() - r).abs().max().item()
        err_h = (h.double() - r).abs().max().item()
        if name in ("q", "k"):     # HF rounds each path's gradient to bf16, then adds
            assert err_o <= err_h, (name, err_o, err_h)
        else:                      # fp32 sums over heads and batch
            torch.testing.assert_close(o, h, rtol=2e-6, atol=2e-6)
    # only q's output reaches the loss: k's gradient is zero, q's matches HF
    ql = q.float().requires_grad_(True)
    kl = k.float().requires_grad_(True)
    oq, _ = P.apply_multimodal_rotary_pos_emb(ql, kl, cos, sin, [2, 3, 3])
    dq, dk = torch.autograd.grad(oq.sum(), (ql, kl), allow_unused=True)
    assert dk is None or torch.equal(dk, torch.zeros_like(kl))
    ql2 = q.float().requires_grad_(True)
    hq, _ = mod.apply_multimodal_rotary_pos_emb(ql2, k.float(), cos, sin, [2, 3, 3])
    (hdq,) = torch.autograd.grad(hq.sum(), (ql2,))
    assert torch.equal(dq, hdq)


def test_mrope_gradcheck_fp64():
    q = make_qk(2, 3, 4, 8, torch.float64, "swapped", 1).requires_grad_(True)
    k = make_qk(2, 1, 4, 8, torch.float64, "swapped", 1).requires_grad_(True)
    cos, sin = (t.requires_grad_(True) for t in mrope_tables(1, 4, 8, torch.float64))
    assert torch.autograd.gradcheck(
        lambda *a: P.apply_multimodal_rotary_pos_emb(*a, [2, 1, 1]), (q, k, cos, sin))
    cos2, sin2 = (t.requires_grad_(True) for t in mrope_tables(2, 4, 8, torch.float64))
    assert torch.autograd.gradcheck(
        lambda *a: P.apply_multimodal_rotary_pos_emb(*a, [1, 2, 1], 2),
        (q.detach().transpose(1, 2).requires_grad_(True),
         k.detach().transpose(1, 2).requires_grad_(True), cos2, sin2))


# =======================================================================================
# compute_mrope_cos_sin vs the transformers 5.x rotary modules
# =======================================================================================


def assert_tables_match(ours, hf, hf32, ours32, n_ulp=1):
    """fp32: within n_ulp ulps (torch's vectorised sin/cos are within 1 ulp, ours are
    correctly rounded).  16-bit: equal wherever our fp32 value equals transformers' fp32
    value (both round that value once); elsewhere at most one 16-bit ulp apart, and such
    elements are rare (< 1%)."""
    assert ours.shape == hf.shape and ours.dtype == hf.dtype
    if hf.dtype == torch.float32:
        diff = (ours - hf).abs()
        assert (diff <= n_ulp * torch.maximum(ulp(hf), ulp(ours))).all(), diff.max()
        return
    same32 = ours32 == hf32
    assert torch.equal(ours[same32], hf[same32])
    diff = (ours.float() - hf.float()).abs()
    assert (diff <= ulp(torch.maximum(ours.abs(), hf.abs())).float()).all()
    assert (ours != hf).float().mean().item() < 0.01


def _llama_rotary(rope_parameters, head_dim=64):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=4096,
                                   rope_parameters=rope_parameters)
    return LlamaRotaryEmbedding(cfg)


LLAMA_ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 1024},
}


def _positions(shape, kind):
    if kind == "small":
        return torch.randint(0, 2048, shape)
    # past 2^17 and up to ~1e6 (angles of the first frequency are the positions)
    return torch.randint(1 << 17, 1_000_000, shape)


@needs_transformers5
@pytest.mark.parametrize("rope", list(LLAMA_ROPES))
@pytest.mark.parametrize("kind", ["small", "large"])
@pytest.mark.parametrize("Bp", [1, 2])
def test_tables_llama(rope, kind, Bp, isa):
    rot = _llama_rotary(LLAMA_ROPES[rope])
    if rope == "yarn":
        assert rot.attention_scaling != 1.0
    pos = _positions((Bp, 37), kind)
    hf = {dt: rot(torch.zeros(1, dtype=dt), pos) for dt in (torch.float32, torch.bfloat16)}
    ours = {dt: P.compute_mrope_cos_sin(pos, rot.inv_freq, attention_scaling=rot.attention_scaling,
                                        dtype=dt) for dt in (torch.float32, torch.bfloat16)}
    # scaling multiplies an fp32 cos that may be one ulp off: two ulps after the product
    n = 1 if rot.attention_scaling == 1.0 else 2
    for i in range(2):
        assert_tables_match(ours[torch.float32][i], hf[torch.float32][i], None, None, n)
        assert_tables_match(ours[torch.bfloat16][i], hf[torch.bfloat16][i],
                            hf[torch.float32][i], ours[torch.float32][i])


@needs_transformers5
@pytest.mark.parametrize("kind", ["small", "large"])
def test_tables_qwen2_vl(kind, isa):
    mod = hf_module("qwen2_vl")
    cfg = transformers.Qwen2VLTextConfig(
        hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    rot = mod.Qwen2VLRotaryEmbedding(cfg)
    pos = _positions((3, 2, 23), kind)
    hf = {dt: rot(torch.zeros(1, dtype=dt), pos) for dt in (torch.float32, torch.bfloat16)}
    assert hf[torch.float32][0].shape == (2, 23, 128)     # 5.x merges the axes itself
    ours = {dt: P.compute_mrope_cos_sin(pos, rot.inv_freq, [16, 24, 24], dtype=dt)
            for dt in (torch.float32, torch.bfloat16)}
    for i in range(2):
        assert_tables_match(ours[torch.float32][i], hf[torch.float32][i], None, None)
        assert_tables_match(ours[torch.bfloat16][i], hf[torch.bfloat16][i],
                            hf[torch.float32][i], ours[torch.float32][i])
    # sections given as a tuple; int32 ids; a batch-shared (3, 1, T) id tensor
    c1, _ = P.compute_mrope_cos_sin(pos.int(), rot.inv_freq, (16, 24, 24))
    assert torch.equal(c1, ours[torch.float32][0])
    c2, _ = P.compute_mrope_cos_sin(pos[:, :1], rot.inv_freq, [16, 24, 24])
    assert torch.equal(c2, ours[torch.float32][0][:1])


@needs_transformers5
@pytest.mark.parametrize("sections,head_dim", [([24, 20, 20], 128), ([6, 5, 5], 32)])
def test_tables_qwen3_vl_interleaved(sections, head_dim, isa):
    mod = hf_module("qwen3_vl")
    cfg = transformers.Qwen3VLTextConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": sections,
                         "mrope_interleaved": True})
    rot = mod.Qwen3VLTextRotaryEmbedding(cfg)
    for kind in ("small", "large"):
        pos = _positions((3, 2, 11), kind)
        hf = {dt: rot(torch.zeros(1, dtype=dt), pos) for dt in (torch.float32, torch.bfloat16)}
        assert hf[torch.float32][0].shape == (2, 11, head_dim)
        ours = {dt: P.compute_mrope_cos_sin(pos, rot.inv_freq, sections, interleaved=True,
                                            dtype=dt) for dt in (torch.float32, torch.bfloat16)}
        for i in range(2):
            assert_tables_match(ours[torch.float32][i], hf[torch.float32][i], None, None)
            assert_tables_match(ours[torch.bfloat16][i], hf[torch.bfloat16][i],
                                hf[torch.float32][i], ours[torch.float32][i])


def test_tables_interleaved_tiny_example_section_7_1():
    """head_dim 8, [2, 1, 1] interleaved, theta 1e4, token at (2, 2, 3): slots T, H, W, T."""
    inv = torch.tensor([1.0, 0.1, 0.01, 0.001])
    pos = torch.tensor([2, 2, 3]).view(3, 1, 1)
    cos, sin = P.compute_mrope_cos_sin(pos, inv, [2, 1, 1], interleaved=True,
                                       dtype=torch.float64)
    # slots T, H, W, T: angles 2*1, 2*0.1, 3*0.01, 2*0.001, in fp32 as the kernels form them
    angles = (inv.repeat(2) * torch.tensor([2.0, 2.0, 3.0, 2.0] * 2)).double()
    torch.testing.assert_close(cos.flatten(), angles.cos(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin.flatten(), angles.sin(), rtol=0, atol=1e-7)
    q = torch.arange(1.0, 9.0).view(1, 1, 1, 8)
    out, _ = P.apply_rotary_pos_emb(q, q.clone(), cos.float(), sin.float())
    expected = torch.tensor([-4.9626, 0.7681, 2.7887, 3.9840, -1.1714, 6.2777, 7.0868, 8.0080])
    torch.testing.assert_close(out.flatten(), expected, rtol=0, atol=6e-5)
    fused, _ = P.apply_rope(q, q.clone(), pos, inv, mrope_section=[2, 1, 1],
                            interleaved_mrope=True)
    torch.testing.assert_close(fused.flatten(), expected, rtol=0, atol=6e-5)


def test_tables_adjacent_pairing_layout():
    """pairing='adjacent' puts frequency i in channels 2i and 2i+1."""
    inv = torch.tensor([1.0, 0.25, 0.0625])
    pos = torch.arange(5)[None]
    half, _ = P.compute_mrope_cos_sin(pos, inv)
    adj, _ = P.compute_mrope_cos_sin(pos, inv, pairing="adjacent")
    assert torch.equal(adj[..., 0::2], half[..., :3])
    assert torch.equal(adj[..., 1::2], half[..., 3:])


# =======================================================================================
# fused apply_rope == table path
# =======================================================================================

# name: (position-id shape kind, inv_freq length, head_dim, sections, interleaved, pairing)
FUSED_CASES = {
    "llama": ("2d", 32, 64, None, False, "half"),
    "qwen2_vl": ("3d", 32, 64, [8, 12, 12], False, "half"),
    "qwen3_vl": ("3d", 32, 64, [12, 10, 10], True, "half"),
    "adjacent": ("2d", 16, 32, None, False, "adjacent"),
    "partial": ("2d", 8, 32, None, False, "half"),
    "partial_interleaved": ("3d", 11, 40, [4, 4, 3], True, "adjacent"),
    "mrope_2d_ids": ("2d", 8, 16, [2, 3, 3], False, "half"),
}


def _fused_inputs(case, dtype, B=2, T=9, positions="small", Bp=None, heads=(4, 2)):
    ids, n, D, sections, inter, pairing = FUSED_CASES[case]
    Bp = B if Bp is None else Bp
    shape = (Bp, T) if ids == "2d" else (3, Bp, T)
    pos = _positions(shape, positions)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n)))
    q = make_qk(B, heads[0], T, D, dtype, "swapped", 1)
    k = make_qk(B, heads[1], T, D, dtype, "swapped", 1)
    kw = dict(mrope_section=sections, interleaved_mrope=inter, pairing=pairing)
    return q, k, pos, inv, kw


def _table_path(q, k, pos, inv, kw, scaling=1.0):
    cos, sin = P.compute_mrope_cos_sin(pos, inv, kw["mrope_section"], interleaved=kw[
        "interleaved_mrope"], attention_scaling=scaling, pairing=kw["pairing"])
    real = torch.float64 if q.dtype == torch.float64 else torch.float32
    return P.apply_rotary_pos_emb(q.to(real), k.to(real), cos.to(real), sin.to(real),
                                  pairing=kw["pairing"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("positions", ["small", "large"])
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_equals_table_path(case, positions, dtype, isa):
    """Same fp32 cos/sin (one implementation), same fp32 rotation, one rounding to q's dtype:
    the fused result is the table path's fp32 result rounded, bit for bit."""
    q, k, pos, inv, kw = _fused_inputs(case, dtype, positions=positions)
    scaling = 0.875 if case == "qwen2_vl" else 1.0
    ours = P.apply_rope(q, k, pos, inv, attention_scaling=scaling, **kw)
    table = _table_path(q, k, pos, inv, kw, scaling)
    for o, t, x in zip(ours, table, (q, k)):
        assert o.dtype == x.dtype and o.shape == x.shape
        assert torch.equal(o, t.to(x.dtype))
        R = 2 * inv.shape[0]
        assert torch.equal(o[..., R:], x[..., R:])      # pass-through channels untouched


@needs_transformers5
@pytest.mark.parametrize("positions", ["small", "large"])
def test_fused_vs_hf_fp32_tables(positions, isa):
    """Against transformers' own fp32 tables the only difference is the last bit of
    sin/cos: |ours - hf| <= 2^-22 (|x[e]| + |x[p(e)]|) per element."""
    rot = _llama_rotary(LLAMA_ROPES["yarn"])
    pos = _positions((2, 13), positions)
    q = make_qk(2, 4, 13, 64, torch.float32, "swapped", 1)
    k = make_qk(2, 2, 13, 64, torch.float32, "swapped", 1)
    ours = P.apply_rope(q, k, pos, rot.inv_freq, attention_scaling=rot.attention_scaling)
    cos, sin = rot(q, pos)
    hf = hf_module("llama").apply_rotary_pos_emb(q, k, cos, sin)
    for o, h, x in zip(ours, hf, (q, k)):
        bound = 2.0 ** -22 * (x.abs() + partner_abs(x)) * rot.attention_scaling
        assert ((o - h).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["llama", "qwen2_vl", "qwen3_vl", "partial_interleaved"])
def test_fused_backward_equals_table_path(case, dtype):
    q, k, pos, inv, kw = _fused_inputs(case, dtype, positions="large", Bp=1)
    go_q, go_k = torch.randn(q.shape).to(dtype), torch.randn(k.shape).to(dtype)
    ql, kl = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    oq, ok = P.apply_rope(ql, kl, pos, inv, **kw)
    ours = torch.autograd.grad((oq, ok), (ql, kl), (go_q, go_k))
    cos, sin = P.compute_mrope_cos_sin(pos, inv, kw["mrope_section"],
                                       interleaved=kw["interleaved_mrope"], pairing=kw["pairing"])
    ql, kl = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    real = torch.float64 if dtype == torch.float64 else torch.float32
    tq, tk = P.apply_rotary_pos_emb(ql.to(real), kl.to(real), cos.to(real), sin.to(real),
                                    pairing=kw["pairing"])
    table = torch.autograd.grad((tq, tk), (ql, kl), (go_q.to(real), go_k.to(real)))
    for o, t, x in zip(ours, table, (q, k)):
        assert o.dtype == x.dtype
        assert torch.equal(o, t)


@pytest.mark.parametrize("case", ["llama", "qwen3_vl", "partial_interleaved", "adjacent"])
def test_fused_gradcheck_fp64(case):
    q, k, pos, inv, kw = _fused_inputs(case, torch.float64, B=2, T=2, Bp=1, heads=(2, 1))
    q.requires_grad_(True)
    k.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda a, b: P.apply_rope(a, b, pos, inv, attention_scaling=1.25, **kw), (q, k))


def test_fused_unsqueeze_dim_2_and_layouts():
    q, k, pos, inv, kw = _fused_inputs("qwen2_vl", torch.float32)
    ref = P.apply_rope(q, k, pos, inv, **kw)
    for layout in ("dense", "swapped", "strided", "channels"):
        q2 = make_qk(2, 4, 9, 64, torch.float32, layout, 2)
        k2 = make_qk(2, 2, 9, 64, torch.float32, layout, 2)
        q2.copy_(q.transpose(1, 2))
        k2.copy_(k.transpose(1, 2))
        out = P.apply_rope(q2, k2, pos, inv, unsqueeze_dim=2, **kw)
        assert torch.equal(out[0], ref[0].transpose(1, 2))
        assert torch.equal(out[1], ref[1].transpose(1, 2))


def test_threaded_paths_equal_single_thread(isa):
    """Sizes past the serial threshold: the threaded kernels give the single-thread results
    (each token's row is computed the same way), on every SIMD variant of this CPU."""
    q = make_qk(2, 8, 256, 64, torch.bfloat16, "swapped", 1).requires_grad_(True)
    k = make_qk(2, 2, 256, 64, torch.bfloat16, "swapped", 1).requires_grad_(True)
    cos, sin = (t.requires_grad_(True) for t in mrope_tables(1, 256, 64, torch.float32))
    pos = _positions((3, 2, 256), "large")
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    go = (torch.randn(q.shape), torch.randn(k.shape))

    def run():
        out = P.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [8, 12, 12])
        grads = torch.autograd.grad(out, (q, k, cos, sin), go)
        fused = P.apply_rope(q, k, pos, inv, mrope_section=[12, 10, 10], interleaved_mrope=True)
        fgrads = torch.autograd.grad(fused, (q, k), go)
        tables = P.compute_mrope_cos_sin(pos, torch.cat((inv, inv, inv, inv)),
                                         [32, 48, 48], dtype=torch.bfloat16)
        return (*out, *grads, *fused, *fgrads, *tables)

    threads = torch.get_num_threads()
    many = run()
    torch.set_num_threads(1)
    try:
        one = run()
    finally:
        torch.set_num_threads(threads)
    for i, (a, b) in enumerate(zip(many, one)):
        assert torch.equal(a, b), i


# =======================================================================================
# apply_rotary_pos_emb_vision vs transformers
# =======================================================================================


def _vision_tables(N, head_dim=80):
    dim = head_dim // 2
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    rows = torch.randint(0, 32, (N,))
    cols = torch.randint(0, 32, (N,))
    freqs = torch.cat((rows[:, None] * inv, cols[:, None] * inv), dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _check_vision(model):
    mod = hf_module(model)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        N, H = 37, 3
        q = torch.randn(N, H, 80).to(dtype)
        k = torch.randn(N, H + 1, 80)[:, 1:].to(dtype)       # a non-contiguous view
        cos, sin = _vision_tables(N)
        if dtype == torch.float64:  # fp64 everywhere still computes in fp32, as HF does
            q, k, cos, sin = (t.double() + 1e-12 for t in (q, k, cos, sin))
            assert not torch.equal(q.float().double(), q)  # fp64 math would differ
        ours = P.apply_rotary_pos_emb_vision(q, k, cos, sin)
        hf = mod.apply_rotary_pos_emb_vision(q, k, cos, sin)
        for o, h in zip(ours, hf):
            assert o.dtype == h.dtype == dtype
            assert torch.equal(o, h)          # both compute in fp32 and round once
        # backward, with gradients to cos/sin as well
        go = (torch.randn(q.shape).to(dtype), torch.randn(k.shape).to(dtype))
        grads = []
        for fn in (P.apply_rotary_pos_emb_vision, mod.apply_rotary_pos_emb_vision):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, cos, sin)]
            out = fn(*leaves)
            grads.append(torch.autograd.grad(out, leaves, go))
        for name, o, h in zip("q k cos sin".split(), *grads):
            assert o.dtype == h.dtype, name
            if name in ("q", "k"):
                assert torch.equal(o, h), name
            else:  # sums over heads, in a different order
                torch.testing.assert_close(o, h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_matches_hf(model):
    _check_vision(model)


@pytest.mark.transformers4
@pytest.mark.parametrize("model", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_matches_hf4(model):
    _check_vision(model)


def test_vision_gradcheck_fp64():
    """fp64 inputs, fp32 math (as transformers): derivatives at fp32 tolerance."""
    q = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(5, 1, 8, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(5, 8, dtype=torch.float32, requires_grad=False)
    sin = torch.randn(5, 8, dtype=torch.float32, requires_grad=False)
    assert torch.autograd.gradcheck(
        lambda a, b: P.apply_rotary_pos_emb_vision(a, b, cos, sin), (q, k),
        eps=1e-3, atol=1e-3, rtol=1e-3)


# =======================================================================================
# opcheck, torch.compile, torch.export
# =======================================================================================


def _opcheck_samples():
    """(op, args) pairs for torch.library.opcheck."""
    ops = torch.ops.posenc
    out = []
    for rg in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            q = make_qk(2, 3, 5, 16, dtype, "swapped", 2).requires_grad_(rg)  # (B, T, H, D) view
            k = make_qk(2, 1, 5, 16, dtype, "dense", 2).requires_grad_(rg)
            cos3, sin3 = (t.requires_grad_(rg) for t in mrope_tables(2, 5, 16, torch.float32))
            out.append((ops.rope, (q, k, cos3, sin3, [2, 3, 3], False, 0, False)))
            c1, s1 = (t.requires_grad_(rg) for t in mrope_tables(1, 5, 16, dtype))
            out.append((ops.rope, (q, k, c1, s1, [4, 2, 2], True, 0, False)))
            out.append((ops.rope, (q, k, c1[0, :, :, :12], s1[0, :, :, :12], [], False, 1, True)))
            pos3 = torch.randint(0, 300000, (3, 2, 5))
            inv = torch.rand(8)
            out.append((ops.rope_fused, (q, k, pos3, inv, [2, 3, 3], False, 1.5, 0, False)))
            out.append((ops.rope_fused, (q, k, pos3[0, :1], inv[:6], [], False, 1.0, 1, True)))
            qc = make_qk(2, 2, 5, 16, dtype, "channels", 2).requires_grad_(rg)
            out.append((ops.rope_fused, (qc, k, pos3, inv, [3, 3, 2], True, 1.0, 0, False)))
            kc = make_qk(2, 2, 5, 16, dtype, "strided", 2).requires_grad_(rg)
            out.append((ops.rope, (qc, kc, cos3, sin3, [3, 3, 2], True, 0, False)))
            # heads_first: q, k as transformers holds them, (B, H, T, D)
            qh, kh = q.transpose(1, 2), kc.transpose(1, 2)
            out.append((ops.rope, (qh, kh, cos3, sin3, [2, 3, 3], False, 0, True, None, None,
                                   True)))
            out.append((ops.rope_fused, (qh, kh, pos3, inv, [3, 3, 2], True, 1.0, 1, False,
                                         True)))
        gq = make_qk(2, 3, 5, 16, torch.float32, "strided", 2)
        gk = make_qk(2, 1, 5, 16, torch.float32, "swapped", 2)
        q = make_qk(2, 3, 5, 16, torch.bfloat16, "swapped", 2)
        k = make_qk(2, 1, 5, 16, torch.bfloat16, "dense", 2)
        cos3 = torch.randn(3, 1, 5, 16)
        out.append((ops.rope_table_grad, (gq, gk, q, k, cos3, [2, 3, 3], False, 0)))
        out.append((ops.rope_table_grad, (gq, gk, q, k, cos3[0, :, :, :10], [], False, 1)))
        pos = torch.randint(0, 1_000_000, (3, 2, 7)).transpose(1, 2).contiguous().transpose(1, 2)
        out.append((ops.rope_tables, (pos, torch.rand(8), [2, 3, 3], True, 1.0, 0,
                                      torch.bfloat16)))
        out.append((ops.rope_tables, (pos[1].int(), torch.rand(5), [], False, 0.5, 1,
                                      torch.float32)))
    return out


@pytest.mark.parametrize("sample", range(len(_opcheck_samples())))
def test_opcheck(sample):
    torch.manual_seed(sample)
    op, args = _opcheck_samples()[sample]
    torch.library.opcheck(op, args)


def _no_recompile(active: bool):
    """After the first call, any recompilation raises."""
    return torch.compiler.set_stance("fail_on_recompile") if active else contextlib.nullcontext()


def _compile_fn(fn, backend="aot_eager"):
    """fullgraph, dynamic shapes, counting the graphs given to the backend.  (The first
    call may count 2: dynamo restarts once to specialize the float attention_scaling.)"""
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True, dynamic=True), counter


def test_compile_mrope_forward_backward_no_recompiles():
    torch._dynamo.reset()

    def step(q, k, cos, sin):
        oq, ok = P.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [8, 12, 12])
        return (oq * oq).sum() + (ok * 2).sum()

    compiled, counter = _compile_fn(step)
    for i, T in enumerate((5, 8, 13, 21)):
        q = make_qk(2, 4, T, 64, torch.float32, "swapped", 1).requires_grad_(True)
        k = make_qk(2, 2, T, 64, torch.float32, "swapped", 1).requires_grad_(True)
        cos, sin = (t.requires_grad_(True) for t in mrope_tables(2, T, 64, torch.float32))
        with _no_recompile(i > 0):
            got = torch.autograd.grad(compiled(q, k, cos, sin), (q, k, cos, sin))
        want = torch.autograd.grad(step(q, k, cos, sin), (q, k, cos, sin))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        if i == 0:
            frames = counter.frame_count
    assert frames >= 1 and counter.frame_count == frames


def test_compile_fused_forward_backward_no_recompiles():
    torch._dynamo.reset()
    inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))

    def step(q, k, pos):
        oq, ok = P.apply_rope(q, k, pos, inv, mrope_section=[6, 5, 5], interleaved_mrope=True)
        return (oq * oq).sum() + (ok * 2).sum()

    compiled, counter = _compile_fn(step, backend="inductor")
    for i, T in enumerate((5, 7, 10, 17)):
        q = make_qk(1, 4, T, 32, torch.float32, "swapped", 1).requires_grad_(True)
        k = make_qk(1, 2, T, 32, torch.float32, "swapped", 1).requires_grad_(True)
        pos = torch.randint(0, 1000, (3, 1, T))
        with _no_recompile(i > 0):
            got = torch.autograd.grad(compiled(q, k, pos), (q, k))
        want = torch.autograd.grad(step(q, k, pos), (q, k))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        if i == 0:
            frames = counter.frame_count
    assert frames >= 1 and counter.frame_count == frames


def test_export_apply_rope():
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))

    class Rope(torch.nn.Module):
        def forward(self, q, k, pos):
            return P.apply_rope(q, k, pos, inv, mrope_section=[4, 2, 2])

    q = make_qk(2, 4, 6, 16, torch.float32, "dense", 1)
    k = make_qk(2, 2, 6, 16, torch.float32, "dense", 1)
    pos = torch.randint(0, 100, (3, 2, 6))
    T = torch.export.Dim("T", min=2, max=4096)
    ep = torch.export.export(Rope(), (q, k, pos),
                             dynamic_shapes=({2: T}, {2: T}, {2: T}))
    assert "posenc.rope_fused" in str(ep.graph)
    q2 = make_qk(2, 4, 11, 16, torch.float32, "dense", 1)
    k2 = make_qk(2, 2, 11, 16, torch.float32, "dense", 1)
    pos2 = torch.randint(0, 100, (3, 2, 11))
    for a, b in zip(ep.module()(q2, k2, pos2), Rope()(q2, k2, pos2)):
        assert torch.equal(a, b)


# =======================================================================================
# bad input
# =======================================================================================


def _mrope_args(D=16, T=4):
    q = make_qk(2, 2, T, D, torch.float32, "dense", 1)
    k = make_qk(2, 1, T, D, torch.float32, "dense", 1)
    cos, sin = mrope_tables(2, T, D, torch.float32)
    return q, k, cos, sin


@pytest.mark.parametrize("sections,exc,pattern", [
    ([2, 3, 2], ValueError, "mrope_section"),            # sums to 7, D/2 = 8
    ([4, 4], ValueError, "mrope_section"),               # 2 sections
    ([2, 2, 2, 2], ValueError, "mrope_section"),
    (torch.tensor([2, 3, 3]), TypeError, "mrope_section"),
    ([2.0, 3, 3], TypeError, "mrope_section"),
    ([-1, 5, 4], ValueError, "mrope_section"),
    (8, TypeError, "mrope_section"),
])
def test_bad_sections(sections, exc, pattern):
    q, k, cos, sin = _mrope_args()
    with pytest.raises(exc, match=pattern):
        P.apply_multimodal_rotary_pos_emb(q, k, cos, sin, sections)
    pos = torch.zeros(3, 2, 4, dtype=torch.long)
    with pytest.raises(exc, match=pattern):
        P.apply_rope(q, k, pos, torch.rand(8), mrope_section=sections)
    with pytest.raises(exc, match=pattern):
        P.compute_mrope_cos_sin(pos, torch.rand(8), sections)


def test_bad_mrope_tables():
    q, k, cos, sin = _mrope_args()
    with pytest.raises(ValueError, match="cos"):
        P.apply_multimodal_rotary_pos_emb(q, k, cos[0], sin[0], [2, 3, 3])   # 3-D tables
    with pytest.raises(ValueError, match="cos sequence length"):
        P.apply_multimodal_rotary_pos_emb(q, k, cos[:, :, :3], sin[:, :, :3], [2, 3, 3])
    with pytest.raises(ValueError, match="cos batch size"):
        P.apply_multimodal_rotary_pos_emb(q, k, cos.repeat(1, 2, 1, 1), sin.repeat(1, 2, 1, 1),
                                          [2, 3, 3])
    with pytest.raises(ValueError, match="3 axes"):
        P.apply_multimodal_rotary_pos_emb(q, k, cos[:2], sin[:2], [2, 3, 3])
    with pytest.raises(ValueError, match="sin shape"):
        P.apply_multimodal_rotary_pos_emb(q, k, cos, sin[:, :1], [2, 3, 3])
    with pytest.raises(TypeError, match="sin dtype"):
        P.apply_multimodal_rotary_pos_emb(q, k, cos, sin.double(), [2, 3, 3])
    with pytest.raises(TypeError, match="cos"):
        P.apply_multimodal_rotary_pos_emb(q, k, cos.int(), sin, [2, 3, 3])
    with pytest.raises(TypeError, match="q"):
        P.apply_multimodal_rotary_pos_emb(q.int(), k, cos, sin, [2, 3, 3])
    with pytest.raises(ValueError, match="k batch size"):
        P.apply_multimodal_rotary_pos_emb(q, k[:1], cos, sin, [2, 3, 3])
    with pytest.raises(ValueError, match="k sequence length"):
        P.apply_multimodal_rotary_pos_emb(q, k[:, :, :3], cos, sin, [2, 3, 3])
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        P.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 3, 3], 3)


def test_bad_positions_and_inv_freq():
    q, k, _, _ = _mrope_args()
    inv = torch.rand(8)
    pos3 = torch.zeros(3, 2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="position_ids.*mrope_section"):
        P.apply_rope(q, k, pos3, inv)                       # 3-D ids without sections
    with pytest.raises(ValueError, match="position_ids.*mrope_section"):
        P.compute_mrope_cos_sin(pos3, inv)
    with pytest.raises(TypeError, match="position_ids"):
        P.apply_rope(q, k, pos3.float(), inv, mrope_section=[2, 3, 3])
    with pytest.raises(TypeError, match="inv_freq"):
        P.apply_rope(q, k, pos3, torch.arange(8), mrope_section=[2, 3, 3])   # int inv_freq
    with pytest.raises(TypeError, match="inv_freq"):
        P.compute_mrope_cos_sin(pos3, torch.arange(8), [2, 3, 3])
    with pytest.raises(ValueError, match="inv_freq"):
        P.apply_rope(q, k, pos3[0], torch.rand(9))            # R = 18 > head_dim 16
    with pytest.raises(ValueError, match="inv_freq"):
        P.apply_rope(q, k, pos3[0], torch.rand(2, 4))
    with pytest.raises(ValueError, match="position_ids sequence length"):
        P.apply_rope(q, k, pos3[0, :, :3], inv)               # T mismatch
    with pytest.raises(ValueError, match="position_ids batch size"):
        P.apply_rope(q, k, torch.zeros(3, 4, dtype=torch.long), inv)   # B mismatch
    with pytest.raises(ValueError, match="3 rows"):
        P.apply_rope(q, k, torch.zeros(4, 2, 4, dtype=torch.long), inv, mrope_section=[2, 3, 3])
    with pytest.raises(ValueError, match="position_ids"):
        P.apply_rope(q, k, torch.zeros(4, dtype=torch.long), inv)
    with pytest.raises(ValueError, match="pairing"):
        P.apply_rope(q, k, pos3[0], inv, pairing="interleaved")
    with pytest.raises(TypeError, match="dtype"):
        P.compute_mrope_cos_sin(pos3[0], inv, dtype=torch.int32)
    with pytest.raises(ValueError, match="q"):
        P.apply_rope(q[0], k, pos3[0], inv)


def test_bad_vision_inputs():
    q = torch.randn(5, 2, 8)
    cos = torch.randn(5, 8)
    with pytest.raises(ValueError, match="q"):
        P.apply_rotary_pos_emb_vision(q[None], q, cos, cos)
    with pytest.raises(ValueError, match="cos has 4 patches"):
        P.apply_rotary_pos_emb_vision(q, q, cos[:4], cos[:4])
    with pytest.raises(ValueError, match=r"rotary width 10 \(the last dim of cos\)"):
        P.apply_rotary_pos_emb_vision(q, q, torch.randn(5, 10), torch.randn(5, 10))


def test_empty_sequence():
    """T = 0 is valid (as in transformers) and gives empty results."""
    q = make_qk(2, 2, 0, 16, torch.float32, "swapped", 1)
    k = make_qk(2, 1, 0, 16, torch.float32, "swapped", 1)
    cos, sin = mrope_tables(2, 0, 16, torch.float32)
    oq, ok = P.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 3, 3])
    assert oq.shape == q.shape and ok.shape == k.shape
    pos = torch.zeros(3, 2, 0, dtype=torch.long)
    oq, ok = P.apply_rope(q, k, pos, torch.rand(8), mrope_section=[2, 3, 3])
    assert oq.shape == q.shape and ok.shape == k.shape
    c, s = P.compute_mrope_cos_sin(pos, torch.rand(8), [2, 3, 3])
    assert c.shape == s.shape == (2, 0, 16)


def test_empty_batch_table_gradients_are_zero():
    """B = 0 with batch-shared tables: the tables' gradient is a sum over nothing."""
    q = torch.randn(0, 2, 3, 8, requires_grad=True)
    k = torch.randn(0, 1, 3, 8, requires_grad=True)
    cos, sin = (t.requires_grad_(True) for t in mrope_tables(1, 3, 8, torch.float32))
    out = P.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 1, 1])
    gc, gs = torch.autograd.grad(out, (cos, sin), [torch.ones_like(o) for o in out])
    assert torch.equal(gc, torch.zeros_like(cos)) and torch.equal(gs, torch.zeros_like(sin))


# =======================================================================================
# inv_freq is a constant: requiring grad on it is an error, never silently ignored
# =======================================================================================


def test_inv_freq_requiring_grad_is_rejected():
    inv_freq = (1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)).requires_grad_()
    pos = torch.arange(5)[None]
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8)
    with pytest.raises(ValueError, match="inv_freq requires grad"):
        P.apply_rope(q, k, pos, inv_freq)
    with pytest.raises(ValueError, match="inv_freq requires grad"):
        P.apply_rope(q.requires_grad_(), k, pos, inv_freq)
    with pytest.raises(ValueError, match="inv_freq requires grad"):
        P.compute_mrope_cos_sin(pos, inv_freq)
    with torch.no_grad():  # nothing is recorded, so nothing is lost: allowed
        ref = P.apply_rope(q, k, pos, inv_freq.detach())
        assert torch.equal(P.apply_rope(q, k, pos, inv_freq)[0], ref[0])
        P.compute_mrope_cos_sin(pos, inv_freq)
    out = P.apply_rope(q, k, pos, inv_freq.detach())
    assert torch.equal(out[0], ref[0]) and out[0].requires_grad
