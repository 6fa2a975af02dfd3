"""RoPE with cos/sin tables: parity with transformers' own functions, an fp64 reference,
gradients, torch.library.opcheck, torch.compile / export, threads, SIMD variants, bad input."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm.modeling_glm import apply_rotary_pos_emb as hf_glm_apply
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as hf_neox_apply
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

import posenc_torch as pt
from op_errors import raw_raises
from shapes import Shape

LOW = (torch.bfloat16, torch.float16)


SHAPES = [
    Shape("llama3-8b-heads", 1, 32, 8, 19, 128),
    Shape("qwen2-vl-7b-heads", 2, 28, 4, 9, 128, cos_batch=2),
    Shape("mqa-single-kv-head", 2, 6, 1, 7, 64),
    Shape("decode-T1", 3, 4, 2, 1, 64, cos_batch=3),
    Shape("odd-T-head80", 1, 4, 4, 13, 80),
    Shape("partial-rotary-neox", 2, 4, 2, 11, 64, R=16),
]
LAYOUTS = ["hf-transposed", "contiguous", "fused-qkv-slice", "bthd-unsqueeze2"]


def make_qk(s: Shape, layout: str, dtype: torch.dtype):
    """q, k as the model would hand them over, and the unsqueeze_dim to use."""
    if layout == "hf-transposed":  # projection (B, T, H*D) viewed (B, T, H, D) -> (B, H, T, D)
        q = torch.randn(s.B, s.T, s.Hq * s.D).to(dtype).view(s.B, s.T, s.Hq, s.D).transpose(1, 2)
        k = torch.randn(s.B, s.T, s.Hk * s.D).to(dtype).view(s.B, s.T, s.Hk, s.D).transpose(1, 2)
        return q, k, 1
    if layout == "contiguous":
        return (torch.randn(s.B, s.Hq, s.T, s.D).to(dtype),
                torch.randn(s.B, s.Hk, s.T, s.D).to(dtype), 1)
    if layout == "fused-qkv-slice":  # slices of one (B, T, (Hq + 2 Hk) * D) buffer
        qkv = torch.randn(s.B, s.T, (s.Hq + 2 * s.Hk) * s.D).to(dtype)
        q = qkv[..., : s.Hq * s.D].view(s.B, s.T, s.Hq, s.D).transpose(1, 2)
        k = qkv[..., s.Hq * s.D: (s.Hq + s.Hk) * s.D].view(s.B, s.T, s.Hk, s.D).transpose(1, 2)
        return q, k, 1
    if layout == "bthd-unsqueeze2":
        return (torch.randn(s.B, s.T, s.Hq, s.D).to(dtype),
                torch.randn(s.B, s.T, s.Hk, s.D).to(dtype), 2)
    raise AssertionError(layout)


def make_tables(s: Shape, dtype: torch.dtype, base: float = 10000.0):
    """Real RoPE tables (cat(freqs, freqs)) at random positions, as the rotary module makes."""
    inv_freq = 1.0 / base ** (torch.arange(0, s.rot, 2, dtype=torch.float32) / s.rot)
    pos = torch.randint(0, 4096, (s.cos_batch, s.T)).float()
    freqs = pos[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def hf_reference(q, k, cos, sin, unsqueeze_dim, rot):
    if rot < q.shape[-1]:
        return hf_neox_apply(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return hf_apply(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("s", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
def test_matches_transformers(s: Shape, layout: str, dtype: torch.dtype):
    q, k, dim = make_qk(s, layout, dtype)
    cos, sin = make_tables(s, dtype)
    q0, k0 = q.clone(), k.clone()
    got = pt.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
    hf = hf_reference(q, k, cos, sin, dim, s.rot)
    assert torch.equal(q, q0) and torch.equal(k, k0), "inputs were modified"
    for g, h in zip(got, hf, strict=True):
        assert g.shape == h.shape and g.dtype == h.dtype
    if dtype in LOW:
        # One rounding (ours) against HF eager's three: measured against fp64 of the same
        # inputs, our worst error must not exceed HF's.
        ref = hf_reference(q.double(), k.double(), cos.double(), sin.double(), dim, s.rot)
        for g, h, r in zip(got, hf, ref, strict=True):
            assert max_err(g, r) <= max_err(h, r)
    else:
        for g, h in zip(got, hf, strict=True):
            assert torch.equal(g, h)


MIXED = [  # (q/k dtype, cos/sin dtype): HF's output dtype is result_type(q, cos)
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float16, torch.bfloat16),
    (torch.float32, torch.float64),
    (torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("qdt,cdt", MIXED, ids=lambda d: str(d).replace("torch.", ""))
def test_mixed_dtypes_follow_type_promotion(qdt, cdt):
    s = Shape("qwen2-vl-7b-heads", 1, 28, 4, 5, 128)
    q, k, dim = make_qk(s, "hf-transposed", qdt)
    cos, sin = make_tables(s, cdt)
    got = pt.apply_rotary_pos_emb(q, k, cos, sin)
    hf = hf_apply(q, k, cos, sin)
    for g, h in zip(got, hf, strict=True):
        assert g.dtype == h.dtype == torch.result_type(q, cos)
        assert torch.equal(g, h)  # HF promotes first, so both compute in the result dtype


@pytest.mark.parametrize("R", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_adjacent_pairing_matches_glm(R: int, dtype: torch.dtype):
    """GLM rotates adjacent pairs (2i, 2i+1) with half-layout tables; ours reads tables
    whose entries 2i and 2i+1 carry frequency i."""
    s = Shape("glm", 2, 4, 2, 9, 64, R=R)
    q, k, dim = make_qk(s, "hf-transposed", dtype)
    cos, sin = make_tables(s, dtype)
    adj_cos = cos[..., : R // 2].repeat_interleave(2, dim=-1)
    adj_sin = sin[..., : R // 2].repeat_interleave(2, dim=-1)
    got = pt.apply_rotary_pos_emb(q, k, adj_cos, adj_sin, pairing="adjacent")
    hf = hf_glm_apply(q, k, cos, sin)
    if dtype in LOW:
        ref = hf_glm_apply(q.double(), k.double(), cos.double(), sin.double())
        for g, h, r in zip(got, hf, ref, strict=True):
            assert max_err(g, r) <= max_err(h, r)
    else:
        for g, h in zip(got, hf, strict=True):
            assert torch.equal(g, h)


def test_fifth_positional_int_is_unsqueeze_dim():
    s = Shape("bthd", 1, 4, 2, 6, 32)
    q, k, _ = make_qk(s, "bthd-unsqueeze2", torch.float32)
    cos, sin = make_tables(s, torch.float32)
    a = pt.apply_rotary_pos_emb(q, k, cos, sin, 2)
    b = pt.apply_rotary_pos_emb(q, k, cos, sin, None, 2)
    h = hf_apply(q, k, cos, sin, unsqueeze_dim=2)
    for x, y, z in zip(a, b, h, strict=True):
        assert torch.equal(x, z) and torch.equal(y, z)
    # position_ids as a tensor is accepted and ignored (transformers 4.x signature)
    c = pt.apply_rotary_pos_emb(q, k, cos, sin, torch.arange(6)[None], 2)
    assert torch.equal(c[0], h[0])


def test_output_layout_follows_input():
    s = Shape("qwen2-vl-7b-heads", 1, 28, 4, 8, 128)
    q, k, _ = make_qk(s, "hf-transposed", torch.bfloat16)
    cos, sin = make_tables(s, torch.bfloat16)
    qo, ko = pt.apply_rotary_pos_emb(q, k, cos, sin)
    hq, hk = hf_apply(q, k, cos, sin)
    assert qo.stride() == hq.stride() and ko.stride() == hk.stride()


EXPANDED = [  # stride-0 dims, as expand() / broadcasting hand them over
    ("q-heads", lambda q, k, c, s: (q[:, :1].expand_as(q), k, c, s)),
    ("k-batch-and-seq", lambda q, k, c, s: (q, k[:1, :, :1].expand_as(k), c, s)),
    ("q-k-channels", lambda q, k, c, s: (q[..., :1].expand_as(q), k[..., :1].expand_as(k), c, s)),
    ("cos-sin-batch", lambda q, k, c, s: (q, k, c[:1].expand(2, -1, -1), s[:1].expand(2, -1, -1))),
    ("cos-sin-seq", lambda q, k, c, s: (q, k, c[:, :1].expand_as(c), s[:, :1].expand_as(s))),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name,expand", EXPANDED, ids=[e[0] for e in EXPANDED])
def test_expanded_inputs_match_transformers(name, expand, dtype):
    s = Shape("qwen2-vl-7b-heads", 2, 6, 2, 5, 64, cos_batch=2)
    q, k, _ = make_qk(s, "contiguous", dtype)
    cos, sin = make_tables(s, dtype)
    q, k, cos, sin = expand(q, k, cos, sin)
    assert 0 in (*q.stride(), *k.stride(), *cos.stride(), *sin.stride())
    got = pt.apply_rotary_pos_emb(q, k, cos, sin)
    hf = hf_apply(q, k, cos, sin)
    if dtype in LOW:
        ref = hf_apply(q.double(), k.double(), cos.double(), sin.double())
        for g, h, r in zip(got, hf, ref, strict=True):
            assert max_err(g, r) <= max_err(h, r)
    else:
        assert torch.equal(got[0], hf[0]) and torch.equal(got[1], hf[1])


def test_expanded_inputs_gradients():
    q = torch.randn(2, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(1, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 4, 8, dtype=torch.float64)
    sin = torch.randn(1, 4, 8, dtype=torch.float64)

    def run(fn):
        return fn(q.expand(2, 3, 4, 8), k, cos.expand(2, 4, 8), sin.expand(2, 4, 8))

    gq, gc = torch.autograd.grad(sum(o.square().sum() for o in run(pt.apply_rotary_pos_emb)),
                                 (q, cos))
    hq, hc = torch.autograd.grad(sum(o.square().sum() for o in run(hf_apply)), (q, cos))
    torch.testing.assert_close(gq, hq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gc, hc, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("s", [SHAPES[1], SHAPES[2], SHAPES[5]], ids=lambda s: s.name)
def test_gradients_match_transformers(s: Shape):
    q, k, dim = make_qk(s, "hf-transposed", torch.float32)
    cos, sin = make_tables(s, torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, cos, sin)]
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, cos, sin)]
    gq = torch.randn(q.shape)
    gk = torch.randn(k.shape)
    qo, ko = pt.apply_rotary_pos_emb(*leaves, unsqueeze_dim=dim)
    ((qo * gq).sum() + (ko * gk).sum()).backward()
    hq, hk = hf_reference(*ref_leaves, dim, s.rot)
    ((hq * gq).sum() + (hk * gk).sum()).backward()
    for mine, ref, name in zip(leaves, ref_leaves, ["q", "k", "cos", "sin"], strict=True):
        if name in ("q", "k"):
            torch.testing.assert_close(mine.grad, ref.grad, rtol=0, atol=0, msg=name)
        else:  # sums over heads (and batch): order of additions differs
            torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-5, atol=1e-5, msg=name)


GRADCHECK = [
    ("plain-cos-batch-B", dict(B=2, Hq=3, Hk=1, T=4, D=8, R=8, Bc=2), "half", 1),
    ("broadcast-cos-batch-1", dict(B=2, Hq=2, Hk=2, T=3, D=8, R=8, Bc=1), "half", 1),
    ("partial-unsqueeze2", dict(B=1, Hq=2, Hk=1, T=5, D=10, R=6, Bc=1), "half", 2),
    ("adjacent", dict(B=2, Hq=2, Hk=1, T=3, D=8, R=8, Bc=2), "adjacent", 1),
]


@pytest.mark.parametrize("name,d,pairing,dim", GRADCHECK, ids=[g[0] for g in GRADCHECK])
def test_gradcheck_fp64(name, d, pairing, dim):
    """Random (not rotation-like) tables: the backward must be the exact transpose."""
    qshape = (d["B"], d["Hq"], d["T"], d["D"]) if dim == 1 else (d["B"], d["T"], d["Hq"], d["D"])
    kshape = (d["B"], d["Hk"], d["T"], d["D"]) if dim == 1 else (d["B"], d["T"], d["Hk"], d["D"])
    q = torch.randn(qshape, dtype=torch.float64, requires_grad=True)
    k = torch.randn(kshape, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(d["Bc"], d["T"], d["R"], dtype=torch.float64, requires_grad=True)
    sin = torch.randn(d["Bc"], d["T"], d["R"], dtype=torch.float64, requires_grad=True)

    def f(q, k, cos, sin):
        return pt.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim, pairing=pairing)

    assert torch.autograd.gradcheck(f, (q, k, cos, sin))


def test_gradient_of_one_output_only():
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True)
    sin = torch.randn(1, 3, 8, dtype=torch.float64)
    qo, _ = pt.apply_rotary_pos_emb(q, k, cos, sin)
    qo.sum().backward()
    ref_q, ref_cos = q.detach().requires_grad_(), cos.detach().requires_grad_()
    hq, _ = hf_apply(ref_q, k.detach(), ref_cos, sin)
    hq.sum().backward()
    assert k.grad is None or torch.count_nonzero(k.grad) == 0
    torch.testing.assert_close(q.grad, ref_q.grad, rtol=0, atol=1e-15)
    torch.testing.assert_close(cos.grad, ref_cos.grad, rtol=1e-12, atol=1e-12)


def test_mixed_dtype_gradients_keep_input_dtypes():
    q = torch.randn(1, 4, 5, 16).bfloat16().requires_grad_()
    k = torch.randn(1, 2, 5, 16).bfloat16().requires_grad_()
    cos, sin = torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    qo, ko = pt.apply_rotary_pos_emb(q, k, cos, sin)
    assert qo.dtype == torch.float32
    (qo.sum() + ko.sum()).backward()
    assert q.grad.dtype == torch.bfloat16 and k.grad.dtype == torch.bfloat16
    ref_q = q.detach().float().requires_grad_()
    hq, _ = hf_apply(ref_q, k.detach().float(), cos, sin)
    hq.sum().backward()
    assert torch.equal(q.grad, ref_q.grad.bfloat16())


def test_eager_fast_paths_record_only_what_can_be_differentiated():
    """The eager helpers skip the autograd layer when nothing can record a gradient; the
    results must not depend on which path ran, and nothing may be silently detached."""
    s = Shape("qwen2-vl-7b-heads", 2, 4, 2, 3, 16, cos_batch=2)
    q, k, _ = make_qk(s, "hf-transposed", torch.float32)
    cos, sin = make_tables(s, torch.float32)
    ref = hf_apply(q, k, cos, sin)
    qg = q.detach().requires_grad_()
    with torch.no_grad():
        out = pt.apply_rotary_pos_emb(qg, k, cos, sin)
    assert not out[0].requires_grad and torch.equal(out[0], ref[0])
    with torch.inference_mode():
        out = pt.apply_rotary_pos_emb(q, k, cos, sin)
    assert out[0].is_inference() and torch.equal(out[1], ref[1])
    out = pt.apply_rotary_pos_emb(q, k, cos, sin)
    assert not out[0].requires_grad and out[0].grad_fn is None
    sg = sin.detach().requires_grad_()  # only a table records: q and k outputs both depend
    out = pt.apply_rotary_pos_emb(q, k, cos, sg)
    assert out[0].requires_grad and out[1].requires_grad
    (out[0].sum() + out[1].sum()).backward()
    sr = sin.detach().requires_grad_()
    sum(o.sum() for o in hf_apply(q, k, cos, sr)).backward()
    torch.testing.assert_close(sg.grad, sr.grad, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------- opcheck, compile, export


def opcheck_samples():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for rg in (False, True):
            q = torch.randn(2, 5, 3, 16, dtype=dtype)
            k = torch.randn(2, 5, 1, 16, dtype=dtype)
            cos, sin = torch.randn(1, 5, 16, dtype=dtype), torch.randn(1, 5, 16, dtype=dtype)
            yield [t.requires_grad_(rg) for t in (q, k, cos, sin)], dict(pairing=0)
    qkv = torch.randn(2, 6, 4 * 3 * 8)  # non-contiguous views, partial rotary, adjacent
    q = qkv[..., :16].view(2, 6, 2, 8).requires_grad_(False)
    k = qkv[..., 16:24].view(2, 6, 1, 8)
    yield [q, k, torch.randn(2, 6, 6, requires_grad=True), torch.randn(2, 6, 6)], dict(pairing=1)


@pytest.mark.parametrize("i", range(7))
def test_opcheck_rope(i):
    (q, k, cos, sin), kw = list(opcheck_samples())[i]
    torch.library.opcheck(torch.ops.posenc.rope.default,
                          (q, k, cos, sin, [], False, kw["pairing"], False))


def test_opcheck_rope_backward_ops():
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 1, 8)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    cos = torch.randn(1, 4, 8)
    torch.library.opcheck(torch.ops.posenc.rope_table_grad.default,
                          (gq, gk, q, k, cos, [], False, 0))
    torch.library.opcheck(torch.ops.posenc.rope.default,
                          (gq, gk, cos, cos, [], False, 0, True, torch.bfloat16, torch.float32))


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()
    s = Shape("qwen2-vl-7b-heads", 1, 28, 4, 16, 128)

    def step(q, k, cos, sin):
        qo, ko = pt.apply_rotary_pos_emb(q, k, cos, sin)
        return (qo * 2).sum() + ko.square().sum()

    compiled = torch.compile(step, fullgraph=True)
    q, k, _ = make_qk(s, "hf-transposed", torch.float32)
    cos, sin = make_tables(s, torch.float32)
    a = [t.detach().clone().requires_grad_() for t in (q, k, cos, sin)]
    b = [t.detach().clone().requires_grad_() for t in (q, k, cos, sin)]
    compiled(*a).backward()
    step(*b).backward()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-5)


def test_compile_dynamic_no_recompiles():
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def f(q, k, cos, sin):
        return pt.apply_rotary_pos_emb(q, k, cos, sin)

    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    for T in (8, 13, 21, 34):
        s = Shape("dyn", 1, 4, 2, T, 32)
        q, k, _ = make_qk(s, "hf-transposed", torch.float32)
        cos, sin = make_tables(s, torch.float32)
        out = compiled(q, k, cos, sin)
        ref = hf_apply(q, k, cos, sin)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert counter.frame_count == 1


def test_compile_inductor_dynamic_with_backward():
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, c, s: sum(o.sum() for o in pt.apply_rotary_pos_emb(q, k, c, s)),
                      dynamic=True, fullgraph=True)
    for T in (5, 9):
        s = Shape("dyn", 1, 2, 1, T, 16)
        q, k, _ = make_qk(s, "hf-transposed", torch.float32)
        cos, sin = make_tables(s, torch.float32)
        q = q.detach().requires_grad_()
        ref_q = q.detach().clone().requires_grad_()
        f(q, k, cos, sin).backward()
        sum(o.sum() for o in hf_apply(ref_q, k, cos, sin)).backward()
        torch.testing.assert_close(q.grad, ref_q.grad, rtol=1e-6, atol=1e-6)


def test_export():
    class Rotary(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            return pt.apply_rotary_pos_emb(q, k, cos, sin)

    s = Shape("export", 1, 4, 2, 8, 32)
    q, k, _ = make_qk(s, "contiguous", torch.float32)
    cos, sin = make_tables(s, torch.float32)
    ep = torch.export.export(Rotary(), (q, k, cos, sin))
    assert any("posenc.rope" in str(n.target) for n in ep.graph.nodes)
    out = ep.module()(q, k, cos, sin)
    ref = hf_apply(q, k, cos, sin)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


# --------------------------------------------------------------- threads and variants


def test_same_results_with_one_and_two_threads():
    s = Shape("qwen2-vl-7b-heads", 2, 28, 4, 64, 128)  # large enough to run threaded
    q, k, _ = make_qk(s, "hf-transposed", torch.bfloat16)
    cos, sin = make_tables(s, torch.bfloat16)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pt.apply_rotary_pos_emb(q, k, cos, sin)
        torch.set_num_threads(2)
        two = pt.apply_rotary_pos_emb(q, k, cos, sin)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=str)
def test_every_simd_variant_matches_an_independent_reference(isa, dtype):
    """Each variant (baseline included) against transformers, not against another variant:
    equal for fp32/fp64, no worse than HF eager against fp64 for bf16/fp16."""
    s = Shape("odd-T-head80", 2, 5, 3, 13, 80, R=72, cos_batch=2)
    q, k, _ = make_qk(s, "fused-qkv-slice", dtype)
    cos, sin = make_tables(s, dtype)
    got = pt.apply_rotary_pos_emb(q, k, cos, sin)
    assert pt.kernel_isa() == isa
    hf = hf_reference(q, k, cos, sin, 1, s.rot)
    if dtype in LOW:
        ref = hf_reference(q.double(), k.double(), cos.double(), sin.double(), 1, s.rot)
        for g, h, r in zip(got, hf, ref, strict=True):
            assert max_err(g, r) <= max_err(h, r)
    else:
        assert torch.equal(got[0], hf[0]) and torch.equal(got[1], hf[1])


def test_large_batch_threaded_matches_hf():
    s = Shape("qwen2-vl-7b-heads", 1, 28, 4, 300, 128)
    q, k, _ = make_qk(s, "hf-transposed", torch.float32)
    cos, sin = make_tables(s, torch.float32)
    got = pt.apply_rotary_pos_emb(q, k, cos, sin)
    hf = hf_apply(q, k, cos, sin)
    assert torch.equal(got[0], hf[0]) and torch.equal(got[1], hf[1])


@pytest.mark.parametrize("dtype,T", [(torch.float32, 2400), (torch.bfloat16, 4700)], ids=str)
def test_outputs_of_32_mib_and_more(dtype, T):
    """Large outputs (fresh pages from the allocator), threaded: fp32 bit-identical to
    transformers' function; bf16 no further from an fp64 reference than transformers' own
    bf16 result, element by element within one bf16 rounding of it."""
    s = Shape("qwen2-vl-7b-heads", 1, 28, 4, T, 128)
    q, k, _ = make_qk(s, "hf-transposed", dtype)
    assert (q.numel() + k.numel()) * q.element_size() >= 32 << 20
    cos, sin = make_tables(s, dtype)
    got = pt.apply_rotary_pos_emb(q, k, cos, sin)
    hf = hf_apply(q, k, cos, sin)
    if dtype == torch.float32:
        assert torch.equal(got[0], hf[0]) and torch.equal(got[1], hf[1])
        return
    ref = hf_apply(q.double(), k.double(), cos.double(), sin.double())
    for g, h, r in zip(got, hf, ref, strict=True):
        assert max_err(g, r) <= max_err(h, r)
        # each element one rounding of the exact value: within one bf16 ulp of it
        ulp = r.abs().clamp_min(2.0 ** -126) * 2.0 ** -7
        assert bool(((g.double() - r).abs() <= ulp).all())


def test_empty_sequence():
    q, k = torch.randn(1, 2, 0, 8), torch.randn(1, 1, 0, 8)
    cos = sin = torch.randn(1, 0, 8)
    qo, ko = pt.apply_rotary_pos_emb(q, k, cos, sin)
    assert qo.shape == q.shape and ko.shape == k.shape


# --------------------------------------------------------------------------- bad input


def _ok():
    return (torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 5, 16),
            torch.randn(2, 5, 16))


BAD = [
    ("q-rank", lambda q, k, c, s: (q[0], k, c, s), {}, ValueError, "q must be 4-D"),
    ("k-rank", lambda q, k, c, s: (q, k[None], c, s), {}, ValueError, "k must be 4-D"),
    ("cos-rank", lambda q, k, c, s: (q, k, c[0], s), {}, ValueError, "cos must be 3-D"),
    ("sin-rank", lambda q, k, c, s: (q, k, c, s[None]), {}, ValueError, "sin must be 3-D"),
    ("k-batch", lambda q, k, c, s: (q, k[:1], c, s), {}, ValueError, "k batch size"),
    ("k-seq", lambda q, k, c, s: (q, k[:, :, :3], c, s), {}, ValueError, "k sequence length"),
    ("k-head-dim", lambda q, k, c, s: (q, k[..., :8], c, s), {}, ValueError, "k head_dim"),
    ("cos-batch", lambda q, k, c, s: (q, k, torch.randn(3, 5, 16), torch.randn(3, 5, 16)), {},
     ValueError, "cos batch size"),
    ("cos-seq", lambda q, k, c, s: (q, k, c[:, :4], s[:, :4]), {}, ValueError,
     "cos sequence length"),
    ("sin-shape", lambda q, k, c, s: (q, k, c, s[..., :8]), {}, ValueError, "sin shape"),
    ("odd-rotary", lambda q, k, c, s: (q, k, c[..., :7], s[..., :7]), {}, ValueError,
     "must be even"),
    ("rotary-too-wide", lambda q, k, c, s: (q, k, torch.randn(2, 5, 18), torch.randn(2, 5, 18)),
     {}, ValueError, "must not exceed head_dim"),
    ("int-q", lambda q, k, c, s: (q.int(), k, c, s), {}, TypeError, "q must be float32"),
    ("int-cos", lambda q, k, c, s: (q, k, c.long(), s), {}, TypeError, "cos must be float32"),
    ("cos-sin-dtype", lambda q, k, c, s: (q, k, c, s.double()), {}, TypeError, "sin dtype"),
    ("unsqueeze-dim", lambda q, k, c, s: (q, k, c, s), {"unsqueeze_dim": 3}, ValueError,
     "unsqueeze_dim must be 1"),
    ("pairing", lambda q, k, c, s: (q, k, c, s), {"pairing": "gptj"}, ValueError,
     "pairing must be"),
    ("device", lambda q, k, c, s: (q, k, c.to("meta"), s), {}, ValueError, "cos is on meta"),
    ("not-a-tensor", lambda q, k, c, s: (q, k, c.tolist(), s), {}, TypeError,
     "cos must be a torch.Tensor"),
]


@pytest.mark.parametrize("name,mutate,kw,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(name, mutate, kw, exc, msg):
    args = mutate(*_ok())
    with pytest.raises(exc, match=msg):
        pt.apply_rotary_pos_emb(*args, **kw)


def test_op_called_directly_rejects_bad_sizes():
    q, k, c, s = _ok()
    qb, kb = q.transpose(1, 2), k.transpose(1, 2)
    with raw_raises(ValueError, "pairing must be 0"):
        torch.ops.posenc.rope(qb, kb, c, s, [], False, 5, False)
    with raw_raises(ValueError, "mrope_section"):
        torch.ops.posenc.rope(qb, kb, c[None].expand(3, -1, -1, -1), s[None].expand(3, -1, -1, -1),
                              [1, 2, 3], False, 0, False)
    with raw_raises(ValueError, "q must be 4-D"):
        torch.ops.posenc.rope(q[0], kb, c, s, [], False, 0, False)
    with raw_raises(TypeError, "^q_dtype must be float32"):
        torch.ops.posenc.rope(qb, kb, c, s, [], False, 0, False, torch.int32)
