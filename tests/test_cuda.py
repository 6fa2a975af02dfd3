"""The CUDA kernels: parity with the CPU kernels (bit for bit: the same per-element math in
csrc/rope_math.h, the same rounding; a NaN where the CPU has one, whatever its payload) and
with transformers' own functions, fp64 gradcheck, torch.library.opcheck, torch.compile with
backward, torch.export, CUDA graphs, strided views, decode batches, long sequences with
every gradient, MRoPE interleaved through the table op, no heads at all, NaN and infinities,
the current stream, devices that do not match, tensors past 2^31 elements and head strides
past 2^31 (the 64-bit-offset kernels), and every kernel instantiation launched
(tests/cuda_variants.py).

Everything here needs an NVIDIA GPU and a build with the CUDA kernels (meson option
``cuda``); without them every test is skipped with the reason, after the module and its
parameters are collected (tests/test_gpu_stage.py collects it so on the CPU, from the stage
``scripts/gpu_check.sh`` runs it from on a GPU machine).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    apply_rotary_pos_emb_vision as hf_vision,
)

import cuda_variants
import posenc_torch as pt
import posenc_torch.hf  # noqa: F401  (pt.hf)
from shapes import Shape

pytestmark = [
    pytest.mark.skipif(not pt._C.has_cuda(),
                       reason="posenc_torch was built without its CUDA kernels (needs nvcc and "
                              "a CUDA build of torch at build time; scripts/gpu_check.sh builds "
                              "them)"),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: these tests run the CUDA kernels "
                              "(scripts/gpu_check.sh on a GPU machine)"),
]

CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

SHAPES = [
    Shape("qwen2-vl-7b-heads", 1, 28, 4, 37, 128),
    Shape("llama3-8b-per-batch-cos", 2, 32, 8, 9, 128, cos_batch=2),
    Shape("mqa-single-kv-head", 2, 6, 1, 7, 64),
    Shape("decode-B64-T1", 64, 28, 4, 1, 128, cos_batch=64),
    Shape("vision-head80", 1, 16, 16, 13, 80),
    Shape("partial-rotary-quarter", 2, 4, 2, 11, 128, R=32),
    Shape("tiny-head6", 1, 3, 1, 5, 6),
]
LAYOUTS = ["hf-transposed", "contiguous-bhtd", "fused-qkv-slice", "misaligned-offset"]


def make_qk(s: Shape, layout: str, dtype: torch.dtype, device=CUDA):
    """q (B, Hq, T, D) and k (B, Hk, T, D) in the memory layouts models hand over."""
    if layout == "hf-transposed":
        q = torch.randn(s.B, s.T, s.Hq * s.D, device=device).to(dtype)
        k = torch.randn(s.B, s.T, s.Hk * s.D, device=device).to(dtype)
        return (q.view(s.B, s.T, s.Hq, s.D).transpose(1, 2),
                k.view(s.B, s.T, s.Hk, s.D).transpose(1, 2))
    if layout == "contiguous-bhtd":
        return (torch.randn(s.B, s.Hq, s.T, s.D, device=device).to(dtype),
                torch.randn(s.B, s.Hk, s.T, s.D, device=device).to(dtype))
    if layout == "fused-qkv-slice":
        qkv = torch.randn(s.B, s.T, (s.Hq + 2 * s.Hk) * s.D, device=device).to(dtype)
        q = qkv[..., : s.Hq * s.D].view(s.B, s.T, s.Hq, s.D).transpose(1, 2)
        k = qkv[..., s.Hq * s.D: (s.Hq + s.Hk) * s.D].view(s.B, s.T, s.Hk, s.D).transpose(1, 2)
        return q, k
    if layout == "misaligned-offset":  # storage offset of one element: no 16-byte rows
        n = s.B * s.T * s.Hq * s.D
        q = torch.randn(n + 1, device=device).to(dtype)[1:].view(s.B, s.T, s.Hq, s.D)
        k = torch.randn(s.B * s.T * s.Hk * s.D + 1, device=device).to(dtype)[1:]
        return q.transpose(1, 2), k.view(s.B, s.T, s.Hk, s.D).transpose(1, 2)
    raise AssertionError(layout)


def make_tables(s: Shape, dtype: torch.dtype, device=CUDA, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, s.rot, 2, dtype=torch.float32) / s.rot)
    pos = torch.randint(0, 32768, (s.cos_batch, s.T)).float()
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def cpu(*ts):
    return tuple(t.detach().cpu() for t in ts)


_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def assert_bitwise(got, want):
    """Same dtype, shape and bits (signed zeros and NaN payloads included)."""
    for g, w in zip(got, want):
        g, w = g.detach().cpu().contiguous(), w.detach().cpu().contiguous()
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        if g.is_floating_point():
            same = torch.equal(g.view(_BITS[g.element_size()]), w.view(_BITS[w.element_size()]))
        else:
            same = torch.equal(g, w)
        assert same, f"max |diff| {(g.double() - w.double()).abs().max().item():.3g}"


def assert_bitwise_or_nan(got, want):
    """NaN exactly where the CPU has NaN (the device's arithmetic returns a canonical NaN,
    the CPU an input's payload), the same bits everywhere else."""
    for g, w in zip(got, want):
        g, w = g.detach().cpu().contiguous(), w.detach().cpu().contiguous()
        assert g.dtype == w.dtype and g.shape == w.shape
        nan = torch.isnan(w)
        assert torch.equal(torch.isnan(g), nan), "NaN where the CPU has none, or the reverse"
        bits = _BITS[g.element_size()]
        assert torch.equal(g.view(bits)[~nan], w.view(bits)[~nan])


def launched_kernels(fn) -> set[str]:
    """The kernels fn() launches, named as tests/cuda_variants.py names them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {cuda_variants.normalize(e.name) for e in prof.events()}


# =======================================================================================
# Parity with the CPU kernels: the same bits.


def _table_cases():
    """(q dtype, table dtype): tables as transformers' rotary module returns them (the
    model's dtype) and in fp32 (bf16/fp16 q then give an fp32 result)."""
    for dtype in DTYPES:
        yield pytest.param(dtype, dtype, id=f"{dtype}-same-dtype-tables")
        if dtype != torch.float64:
            yield pytest.param(dtype, torch.float32, id=f"{dtype}-fp32-tables")


@pytest.mark.parametrize("dtype,table_dtype", list(_table_cases()))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("s", SHAPES, ids=lambda s: s.name)
def test_rope_forward_backward_bitwise_equal_to_cpu(s, layout, dtype, table_dtype):
    q, k = make_qk(s, layout, dtype)
    cos, sin = make_tables(s, table_dtype)
    q.requires_grad_(True)
    k.requires_grad_(True)
    cos.requires_grad_(True)
    sin.requires_grad_(True)
    out = pt.apply_rotary_pos_emb(q, k, cos, sin)
    grads = [torch.randn_like(o) for o in out]
    got = torch.autograd.grad(out, (q, k, cos, sin), grads)

    qc, kc, cc, sc = (t.detach().cpu().requires_grad_(True) for t in (q, k, cos, sin))
    want_out = pt.apply_rotary_pos_emb(qc, kc, cc, sc)
    want = torch.autograd.grad(want_out, (qc, kc, cc, sc), cpu(*grads))
    assert_bitwise(out, cpu(*want_out))
    assert_bitwise(got, want)


@pytest.mark.parametrize("interleaved", [False, True],
                         ids=["qwen2-vl-sections", "qwen3-vl-interleaved"])
@pytest.mark.parametrize("pairing", ["half", "adjacent"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_and_tables_bitwise_equal_to_cpu(interleaved, pairing, dtype):
    sections = [24, 20, 20] if interleaved else [16, 24, 24]
    s = Shape("qwen-vl", 2, 28, 4, 33, 128)
    q, k = make_qk(s, "hf-transposed", dtype)
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float32, device=CUDA) / 128))
    pos = torch.randint(0, 200000, (3, 2, 33), device=CUDA)
    pos[:, 0, 0] = 3_000_000  # an angle past the fast reduction
    kw = dict(mrope_section=sections, interleaved_mrope=interleaved, attention_scaling=0.9,
              pairing=pairing)
    got = pt.apply_rope(q, k, pos, inv, **kw)
    want = pt.apply_rope(*cpu(q, k, pos, inv), **kw)
    assert_bitwise(got, want)
    for out_dtype in DTYPES:
        tabs = pt.compute_mrope_cos_sin(pos, inv, sections, interleaved=interleaved,
                                        attention_scaling=0.9, dtype=out_dtype, pairing=pairing)
        want_tabs = pt.compute_mrope_cos_sin(*cpu(pos, inv), sections, interleaved=interleaved,
                                             attention_scaling=0.9, dtype=out_dtype,
                                             pairing=pairing)
        assert_bitwise(tabs, want_tabs)


def test_fused_backward_bitwise_equal_to_cpu():
    s = Shape("llama", 2, 8, 2, 17, 64)
    q, k = (t.requires_grad_(True) for t in make_qk(s, "hf-transposed", torch.bfloat16))
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device=CUDA) / 64))
    pos = torch.randint(0, 8192, (2, 17), device=CUDA)
    out = pt.apply_rope(q, k, pos, inv)
    grads = [torch.randn_like(o) for o in out]
    got = torch.autograd.grad(out, (q, k), grads)
    qc, kc = (t.detach().cpu().requires_grad_(True) for t in (q, k))
    want = torch.autograd.grad(pt.apply_rope(qc, kc, *cpu(pos, inv)), (qc, kc), cpu(*grads))
    assert_bitwise(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_mrope_tables_bitwise_equal_to_cpu(dtype):
    """transformers 4.x MRoPE form: (3, B, T, D) tables in the model's dtype, sections
    [16, 24, 24], forward and every gradient (q, k, cos, sin); and the same tables with
    adjacent pairs through the op (forward)."""
    s = Shape("qwen2-vl-7b", 2, 28, 4, 45, 128)
    q, k = make_qk(s, "hf-transposed", dtype)
    cos, sin = torch.randn(2, 3, 2, 45, 128, device=CUDA).to(dtype).unbind(0)
    args = [t.requires_grad_(True) for t in (q, k, cos, sin)]
    out = pt.apply_multimodal_rotary_pos_emb(*args, [16, 24, 24])
    grads = [torch.randn_like(o) for o in out]
    got = torch.autograd.grad(out, args, grads)
    cpu_args = [t.detach().cpu().requires_grad_(True) for t in (q, k, cos, sin)]
    want_out = pt.apply_multimodal_rotary_pos_emb(*cpu_args, [16, 24, 24])
    want = torch.autograd.grad(want_out, cpu_args, cpu(*grads))
    assert_bitwise(out, cpu(*want_out))
    assert_bitwise(got, want)

    bthd = [q.detach().transpose(1, 2), k.detach().transpose(1, 2), cos.detach(), sin.detach()]
    adjacent = torch.ops.posenc.rope(*bthd, [16, 24, 24], False, 1, False)
    assert_bitwise(adjacent, torch.ops.posenc.rope(*cpu(*bthd), [16, 24, 24], False, 1, False))


@pytest.mark.parametrize("dtype,table_dtype",
                         [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                          (torch.float32, torch.float32)], ids=str)
def test_adjacent_pairing_and_partial_rotary_with_tables_bitwise_equal_to_cpu(dtype,
                                                                              table_dtype):
    """GPT-J pairs (2i, 2i+1) from tables, full width and a quarter of the head (the rest
    passes through), with gradients."""
    for s in (Shape("cohere-like", 2, 8, 2, 19, 128),
              Shape("glm-partial", 2, 8, 2, 19, 128, R=32)):
        q, k = make_qk(s, "hf-transposed", dtype)
        cos, sin = make_tables(s, table_dtype)
        args = [t.requires_grad_(True) for t in (q, k, cos, sin)]
        out = pt.apply_rotary_pos_emb(*args, pairing="adjacent")
        grads = [torch.randn_like(o) for o in out]
        got = torch.autograd.grad(out, args, grads)
        cpu_args = [t.detach().cpu().requires_grad_(True) for t in (q, k, cos, sin)]
        want_out = pt.apply_rotary_pos_emb(*cpu_args, pairing="adjacent")
        want = torch.autograd.grad(want_out, cpu_args, cpu(*grads))
        assert_bitwise(out, cpu(*want_out))
        assert_bitwise(got, want)


@pytest.mark.parametrize("form", ["rope-tables", "mrope-tables", "fused-mrope"])
def test_long_sequence_forward_backward_and_table_gradients_bitwise_equal_to_cpu(form):
    """10,000 tokens of Qwen2-VL-7B heads in bf16, forward and every gradient (q, k and, with
    tables, cos and sin): many more tokens than blocks, so every block loops over several
    groups, and more table rows than the table-gradient grid (it wraps)."""
    s = Shape("qwen2-vl-7b-10k", 1, 28, 4, 10000, 128)
    q, k = make_qk(s, "hf-transposed", torch.bfloat16)
    if form == "fused-mrope":
        inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float32, device=CUDA) / 128))
        pos = torch.randint(0, 100000, (3, 1, 10000), device=CUDA)
        args = [q, k]

        def fn(q, k):
            return pt.apply_rope(q, k, pos.to(q.device), inv.to(q.device),
                                 mrope_section=[16, 24, 24])
    else:
        if form == "rope-tables":
            cos, sin = make_tables(s, torch.bfloat16)
            fn = pt.apply_rotary_pos_emb
        else:
            cos, sin = torch.randn(2, 3, 1, 10000, 128, device=CUDA).to(torch.bfloat16).unbind(0)

            def fn(q, k, cos, sin):
                return pt.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [16, 24, 24])
        args = [q, k, cos, sin]
    args = [t.requires_grad_(True) for t in args]
    out = fn(*args)
    grads = [torch.randn_like(o) for o in out]
    got = torch.autograd.grad(out, args, grads)
    cpu_args = [t.detach().cpu().requires_grad_(True) for t in args]
    want_out = fn(*cpu_args)
    want = torch.autograd.grad(want_out, cpu_args, cpu(*grads))
    assert_bitwise(out, cpu(*want_out))
    assert_bitwise(got, want)


@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "transpose"])
@pytest.mark.parametrize("pairing", [0, 1], ids=["half", "adjacent"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mrope_interleaved_through_the_table_op_bitwise_equal_to_cpu(dtype, pairing, transpose):
    """Qwen3-VL's interleaved axes ([24, 20, 20]) on (3, B, T, 128) tables through the table
    op (no vector chunk has one axis: the one-element kernels) and its table gradient."""
    B, T, H, Hk, D = 2, 37, 8, 2, 128
    q = torch.randn(B, T, H, D, device=CUDA).to(dtype)
    k = torch.randn(B, T, Hk, D, device=CUDA).to(dtype)
    cos, sin = torch.randn(2, 3, B, T, D, device=CUDA).to(dtype).unbind(0)
    args = (q, k, cos, sin, [24, 20, 20], True, pairing, transpose)
    assert_bitwise(torch.ops.posenc.rope(*args), torch.ops.posenc.rope(*cpu(q, k, cos, sin),
                                                                          *args[4:]))
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    grad_args = (gq, gk, q, k, cos, [24, 20, 20], True, pairing)
    assert_bitwise(torch.ops.posenc.rope_table_grad(*grad_args),
                   torch.ops.posenc.rope_table_grad(*cpu(gq, gk, q, k, cos), *grad_args[5:]))


def test_no_heads_at_all_returns_empty_outputs():
    """q and k with no heads and tokens (B T > 0): empty outputs, no launch, no crash; and
    with heads in k only."""
    q = torch.randn(2, 0, 7, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 0, 7, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = torch.randn(2, 1, 7, 64, device=CUDA, dtype=torch.bfloat16).unbind(0)
    oq, ok = pt.apply_rotary_pos_emb(q, k, cos, sin)
    assert oq.shape == q.shape and ok.shape == k.shape
    gq, gk = torch.autograd.grad((oq, ok), (q, k), (torch.ones_like(oq), torch.ones_like(ok)))
    assert gq.shape == q.shape and gk.shape == k.shape
    inv = torch.rand(32, device=CUDA)
    pos = torch.arange(7, device=CUDA)[None].expand(2, 7)
    fq, fk = pt.apply_rope(q.detach(), k.detach(), pos, inv)
    assert fq.shape == q.shape and fk.shape == k.shape
    torch.cuda.synchronize()
    k3 = torch.randn(2, 3, 7, 64, device=CUDA, dtype=torch.bfloat16)
    assert_bitwise(pt.apply_rotary_pos_emb(q.detach(), k3, cos, sin),
                   pt.apply_rotary_pos_emb(*cpu(q, k3, cos, sin)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_nan_and_infinities_give_nan_where_the_cpu_does(dtype):
    """NaN, infinities, signed zeros, subnormals and the largest finite value in q, k and the
    tables, forward and backward: NaN exactly where the CPU has one, the CPU's bits
    elsewhere (overflow to infinity included)."""
    s = Shape("qwen2-vl", 1, 28, 4, 19, 128)
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, info.tiny / 4,
                             info.max, -info.max], dtype=torch.float32).to(dtype)

    def spiked(t, stride):
        flat = t.reshape(-1)
        idx = torch.arange(0, flat.numel(), stride, device=t.device)
        flat[idx] = specials.to(t.device)[torch.arange(idx.numel(), device=t.device) % 7]
        return t

    q = spiked(torch.randn(s.B, s.T, s.Hq, s.D, device=CUDA).to(dtype), 13).transpose(1, 2)
    k = spiked(torch.randn(s.B, s.T, s.Hk, s.D, device=CUDA).to(dtype), 11).transpose(1, 2)
    cos, sin = make_tables(s, dtype)
    cos, sin = spiked(cos.clone(), 29), spiked(sin.clone(), 31)
    args = [t.requires_grad_(True) for t in (q, k, cos, sin)]
    out = pt.apply_rotary_pos_emb(*args)
    grads = [spiked(torch.randn_like(o).contiguous(), 17) for o in out]
    got = torch.autograd.grad(out, args, grads)
    cpu_args = [t.detach().cpu().requires_grad_(True) for t in args]
    want_out = pt.apply_rotary_pos_emb(*cpu_args)
    want = torch.autograd.grad(want_out, cpu_args, cpu(*grads))
    assert_bitwise_or_nan(out, want_out)
    assert_bitwise_or_nan(got, want)


def test_mixed_dtypes_bitwise_equal_to_cpu():
    """bf16 q with fp32 tables (the result is fp32, as HF's promotion gives) and fp16 q with
    fp64 tables (the fp64 core)."""
    s = Shape("mix", 1, 4, 2, 9, 64)
    for qdt, cdt in ((torch.bfloat16, torch.float32), (torch.float16, torch.float64)):
        q, k = make_qk(s, "hf-transposed", qdt)
        cos, sin = make_tables(s, cdt)
        assert_bitwise(pt.apply_rotary_pos_emb(q, k, cos, sin),
                       pt.apply_rotary_pos_emb(*cpu(q, k, cos, sin)))


def test_vision_bitwise_equal_to_cpu_and_matches_hf():
    n, heads, d = 1000, 16, 80
    qkv = torch.randn(n, 3, heads, d, device=CUDA)
    q, k = qkv[:, 0], qkv[:, 1]
    freqs = torch.randn(n, d // 2, device=CUDA) * 30
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    got = pt.apply_rotary_pos_emb_vision(q, k, cos, sin)
    assert_bitwise(got, pt.apply_rotary_pos_emb_vision(*cpu(q, k, cos, sin)))
    for g, w in zip(got, hf_vision(q, k, cos, sin)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# =======================================================================================
# Parity with transformers: no larger error against fp64 than transformers' own.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("s", SHAPES[:3], ids=lambda s: s.name)
def test_rope_error_no_larger_than_transformers(s, dtype):
    q, k = make_qk(s, "hf-transposed", dtype)
    cos, sin = make_tables(s, dtype)
    ref = hf_apply(q.double(), k.double(), cos.double(), sin.double())
    ours = pt.apply_rotary_pos_emb(q, k, cos, sin)
    theirs = hf_apply(q, k, cos, sin)
    for o, t, r in zip(ours, theirs, ref):
        assert o.dtype == t.dtype and o.shape == t.shape
        err_ours = (o.double() - r).abs().max().item()
        err_hf = (t.double() - r).abs().max().item()
        assert err_ours <= err_hf + 1e-7, (err_ours, err_hf)


# =======================================================================================
# Autograd, opcheck, compile, export, CUDA graphs.


def test_gradcheck_fp64_tables_and_fused():
    s = Shape("small", 2, 3, 1, 5, 16, R=12, cos_batch=2)
    q, k = (t.requires_grad_(True) for t in make_qk(s, "hf-transposed", torch.float64))
    cos, sin = (t.requires_grad_(True) for t in make_tables(s, torch.float64))
    assert torch.autograd.gradcheck(lambda *a: pt.apply_rotary_pos_emb(*a), (q, k, cos, sin))
    inv = torch.rand(6, device=CUDA)
    pos = torch.randint(0, 100, (3, 2, 5), device=CUDA)
    assert torch.autograd.gradcheck(
        lambda a, b: pt.apply_rope(a, b, pos, inv, mrope_section=[2, 2, 2]), (q, k))


def _opcheck_samples():
    ops = torch.ops.posenc
    q = torch.randn(2, 5, 3, 16, device=CUDA).requires_grad_(True)  # (B, T, H, D)
    k = torch.randn(2, 1, 5, 16, device=CUDA).transpose(1, 2).requires_grad_(True)
    cos3 = torch.randn(3, 2, 5, 16, device=CUDA).requires_grad_(True)
    sin3 = torch.randn(3, 2, 5, 16, device=CUDA).requires_grad_(True)
    c1, s1 = torch.randn(1, 5, 12, device=CUDA), torch.randn(1, 5, 12, device=CUDA)
    pos3 = torch.randint(0, 300000, (3, 2, 5), device=CUDA)
    inv = torch.rand(8, device=CUDA)
    gq, gk = torch.randn(2, 5, 3, 16, device=CUDA), torch.randn(2, 5, 1, 16, device=CUDA)
    return [
        (ops.rope, (q, k, cos3, sin3, [2, 3, 3], False, 0, False)),
        (ops.rope, (q.bfloat16(), k.bfloat16(), cos3, sin3, [4, 2, 2], True, 0, True)),
        (ops.rope, (q, k, c1, s1, [], False, 1, False)),
        (ops.rope_fused, (q, k, pos3, inv, [2, 3, 3], False, 1.5, 0, False)),
        (ops.rope_fused, (q.half(), k.half(), pos3[0, :1], inv[:6], [], False, 1.0, 1, True)),
        (ops.rope_table_grad, (gq, gk, q.detach(), k.detach(), cos3.detach(), [2, 3, 3], True, 0)),
        (ops.rope_tables, (pos3, inv, [2, 3, 3], True, 1.0, 0, torch.bfloat16)),
        (ops.rope_tables, (pos3[1].int(), inv[:5], [], False, 0.5, 1, torch.float32)),
        (ops.rope, (q.transpose(1, 2), k.transpose(1, 2), cos3, sin3, [2, 3, 3], False, 0,
                    False, None, None, True)),
        (ops.rope_fused, (q.transpose(1, 2), k.transpose(1, 2), pos3, inv, [2, 3, 3], False,
                          1.0, 0, True, True)),
    ]


@pytest.mark.parametrize("sample", range(10))
def test_opcheck(sample):
    torch.manual_seed(sample)
    op, args = _opcheck_samples()[sample]
    torch.library.opcheck(op, args)


def test_compile_fullgraph_inductor_forward_backward():
    torch._dynamo.reset()
    s = Shape("qwen2-vl", 1, 28, 4, 64, 128)
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float32, device=CUDA) / 128))

    def step(q, k, cos, sin, pos):
        a, b = pt.apply_rotary_pos_emb(q, k, cos, sin)
        c, d = pt.apply_rope(q, k, pos, inv, mrope_section=[16, 24, 24])
        return (a.float() * c.float()).sum() + (b.float() * d.float()).sum()

    compiled = torch.compile(step, fullgraph=True)
    q, k = (t.requires_grad_(True) for t in make_qk(s, "hf-transposed", torch.bfloat16))
    cos, sin = make_tables(s, torch.bfloat16)
    pos = torch.randint(0, 5000, (3, 1, 64), device=CUDA)
    got = torch.autograd.grad(compiled(q, k, cos, sin, pos), (q, k))
    want = torch.autograd.grad(step(q, k, cos, sin, pos), (q, k))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2)


def test_export():
    class Rotary(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            return pt.apply_rotary_pos_emb(q, k, cos, sin)

    s = Shape("llama", 1, 8, 2, 16, 64)
    args = (*make_qk(s, "contiguous-bhtd", torch.bfloat16), *make_tables(s, torch.bfloat16))
    ep = torch.export.export(Rotary(), args)
    assert any("posenc" in str(n.target) for n in ep.graph.nodes)
    assert_bitwise(ep.module()(*args), cpu(*Rotary()(*args)))


def test_cuda_graph_capture_and_replay():
    s = Shape("decode", 64, 28, 4, 1, 128, cos_batch=64)
    q, k = make_qk(s, "hf-transposed", torch.bfloat16)
    cos, sin = make_tables(s, torch.bfloat16)
    inv = torch.rand(64, device=CUDA)
    pos = torch.randint(0, 9000, (3, 64, 1), device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as torch.cuda.graphs advises
        for _ in range(2):
            pt.apply_rotary_pos_emb(q, k, cos, sin)
            pt.apply_rope(q, k, pos, inv, mrope_section=[16, 24, 24])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pt.apply_rotary_pos_emb(q, k, cos, sin)
        fused = pt.apply_rope(q, k, pos, inv, mrope_section=[16, 24, 24])
    for _ in range(3):  # new data in the captured inputs, then replay
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        pos.random_(0, 9000)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(out, cpu(*pt.apply_rotary_pos_emb(q, k, cos, sin)))
        assert_bitwise(fused, cpu(*pt.apply_rope(q, k, pos, inv, mrope_section=[16, 24, 24])))


def test_runs_on_the_current_stream():
    """A kernel launched on a side stream while that stream is busy sees the work queued
    before it on the same stream (the op must use torch's current stream, not stream 0)."""
    s = Shape("qwen", 1, 28, 4, 2048, 128)
    q, k = make_qk(s, "hf-transposed", torch.bfloat16)
    cos, sin = make_tables(s, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # keep the stream busy
        q.mul_(2)  # queued behind the sleep; the rotation must see it
        out = pt.apply_rotary_pos_emb(q, k, cos, sin)
    torch.cuda.synchronize()
    assert_bitwise(out, cpu(*pt.apply_rotary_pos_emb(*cpu(q, k, cos, sin))))


# =======================================================================================
# Devices, errors, integration, size.


def test_mixed_devices_raise_naming_the_argument():
    s = Shape("x", 1, 2, 1, 3, 8)
    q, k = make_qk(s, "hf-transposed", torch.float32)
    cos, sin = make_tables(s, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="cos"):
        pt.apply_rotary_pos_emb(q, k, cos, sin)
    with pytest.raises(ValueError, match="cos"):  # the op itself, past the Python checks
        torch.ops.posenc.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, [], False, 0, False)


def test_rotary_width_past_the_cuda_limit_is_an_error():
    """The kernels take rot_dim <= 2048 (the axis map travels in the kernel's parameters);
    a wider rotation is refused with an error, never computed wrongly."""
    q = torch.randn(1, 2, 1, 2050, device=CUDA)
    cos = torch.randn(1, 2, 2050, device=CUDA)
    with pytest.raises(ValueError, match="rejected its arguments"):
        torch.ops.posenc.rope(q, q.clone(), cos, cos.clone(), [], False, 0, False)


def test_hf_patch_routes_cuda_tensors_to_posenc():
    from transformers.models.llama import modeling_llama

    s = Shape("llama", 1, 8, 2, 16, 64)
    q, k = make_qk(s, "hf-transposed", torch.bfloat16)
    cos, sin = make_tables(s, torch.bfloat16)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    with pt.hf.patch("llama") as handle:
        got = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        calls, fallbacks = sum(handle.calls.values()), sum(handle.fallbacks.values())
    assert calls >= 1 and fallbacks == 0
    assert_bitwise(got, cpu(*pt.apply_rotary_pos_emb(q, k, cos, sin)))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_more_than_2_pow_31_elements():
    """64-bit token offsets: q of 2^31 + a few thousand bf16 elements (4 GiB; 9 GiB with the
    output and the check) whose per-token offsets fit in 32 bits, rotated and compared with
    the CPU on the last tokens."""
    H, D = 28, 128
    T = (2**31) // (H * D) + 8
    need = 3 * T * H * D * 2
    free, _ = torch.cuda.mem_get_info()
    if free < need + (2 << 30):
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} free")
    q = torch.randn(1, T, H * D, device=CUDA, dtype=torch.bfloat16).view(1, T, H, D).transpose(1, 2)
    k = torch.randn(1, T, D, device=CUDA, dtype=torch.bfloat16).view(1, T, 1, D).transpose(1, 2)
    assert q.numel() > 2**31
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32, device=CUDA) / D))
    pos = torch.arange(T, device=CUDA)[None]
    oq, ok = pt.apply_rope(q, k, pos, inv)
    tail = slice(T - 64, T)
    want = pt.apply_rope(*cpu(q[:, :, tail], k[:, :, tail], pos[:, tail], inv))
    assert_bitwise((oq[:, :, tail], ok[:, :, tail]), want)
    del oq, ok, q, k
    torch.cuda.empty_cache()


@pytest.mark.parametrize("source", ["tables", "fused"])
def test_head_stride_past_2_pow_31_runs_the_64_bit_offset_kernel(source):
    """q in (B, H, T, D) with T D > 2^31 elements per head (8 GiB of bf16): offsets inside a
    token pass int32, so the 64-bit-offset kernel runs (checked in the profiler); the first
    and last tokens of both heads against the CPU."""
    H, D = 2, 128
    T = 2**31 // D + 8
    # q and k in and out, and the two tables, in bf16
    need = 2 * (2 * (H + 1) * T * D + (2 * T * D if source == "tables" else 0))
    free, _ = torch.cuda.mem_get_info()
    if free < need + (4 << 30):
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} free")
    q = torch.randn(1, H, T, D, device=CUDA, dtype=torch.bfloat16)
    k = torch.randn(1, 1, T, D, device=CUDA, dtype=torch.bfloat16)
    assert q.stride(1) > 2**31
    if source == "tables":
        cos = torch.randn(1, T, D, device=CUDA, dtype=torch.bfloat16)
        sin = torch.randn(1, T, D, device=CUDA, dtype=torch.bfloat16)

        def fn(q, k, sl=slice(None)):
            return pt.apply_rotary_pos_emb(q, k, cos[:, sl].to(q.device), sin[:, sl].to(q.device))
    else:
        inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32, device=CUDA) / D))
        pos = torch.arange(T, device=CUDA)[None]

        def fn(q, k, sl=slice(None)):
            return pt.apply_rope(q, k, pos[:, sl].to(q.device), inv.to(q.device))
    out = []
    names = launched_kernels(lambda: out.append(fn(q, k)))
    assert any(n.startswith("rope_apply_kernel") and ",long," in n for n in names), names
    oq, ok = out[0]
    for sl in (slice(0, 64), slice(T - 64, T)):
        want = fn(q[:, :, sl].cpu(), k[:, :, sl].cpu(), sl)
        assert_bitwise((oq[:, :, sl], ok[:, :, sl]), want)
    del out, oq, ok, q, k
    torch.cuda.empty_cache()


def test_every_kernel_instantiation_is_launched_by_its_call():
    """Each kernel of the build (the list is checked against the binary by make cuda-compile)
    runs from the call tests/cuda_variants.py gives for it."""
    unreachable = []
    for name, call, why in cuda_variants.every_variant():
        if call is None:
            unreachable.append(name)
            continue
        got = launched_kernels(call)
        assert name in got, (name, sorted(n for n in got if n.startswith("rope_")))
        torch.cuda.empty_cache()
    assert len(unreachable) <= 2, unreachable  # fp64 fused with mixed dtypes: C API only
