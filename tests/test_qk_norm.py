"""The fused per-head q/k RMSNorm + RoPE (apply_qk_norm_rope): bit-identity with
transformers' own norm modules followed by the rotary (transformers' in fp32, posenc's in
bf16 / fp16), forward and backward (q, k, both weights, cos / sin), on every SIMD variant,
thread count and torch CPU capability; an fp64 reference, gradcheck / gradgradcheck,
torch.library.opcheck, torch.compile / export, vmap, saved bytes, bad input."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb as gemma3_apply
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
from transformers.models.gemma3n.modeling_gemma3n import apply_rotary_pos_emb as _gemma3n_apply
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.olmo2.modeling_olmo2 import apply_rotary_pos_emb as olmo2_apply
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen3_apply
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import (
    apply_rotary_pos_emb as qwen3_next_apply,
)
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm
from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb as qwen3_vl_apply

import conftest
import posenc_torch as pt
from op_errors import raw_raises
from posenc_torch.qk_norm import SUM_LANES, torch_sum_lanes
from shapes import Shape

try:  # transformers 5.x (not 4.57)
    from transformers.models.afmoe.modeling_afmoe import AfmoeRMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb as _gemma4_apply
    from transformers.models.neomme.modeling_neomme import NeoMMERMSNorm
    from transformers.models.neomme.modeling_neomme import apply_rotary_pos_emb as neomme_apply
except ImportError:
    AfmoeRMSNorm = Gemma4RMSNorm = NeoMMERMSNorm = neomme_apply = None

pytestmark = pytest.mark.any_transformers  # the norm classes exist in 4.57 and 5.x alike

EPS = 1e-6

#: The tests of torch's side alone (its sum order by thread count and capability, the op
#: under torch.compile, opcheck) run in the passes that change torch (make test's main pass
#: and its compat passes), not again in each transformers overlay pass, whose torch is the
#: main pass's.
torch_side = pytest.mark.skipif(
    bool(os.environ.get("POSENC_EXPECT_TRANSFORMERS")),
    reason="a transformers overlay pass: torch's side runs in the main and compat passes")


@dataclasses.dataclass(frozen=True)
class Form:
    """A transformers norm module, the rotary function of its model, and posenc's form."""

    name: str
    norm_cls: type
    rotary: object  # the model's apply_rotary_pos_emb (used for fp32)
    norm: str
    weightless: bool = False  # the norm has no weight (with_scale=False)


def one_at_a_time(apply):
    """Gemma 3n's and Gemma 4's rotary (5.x) take one tensor at a time."""
    def both(q, k, cos, sin, unsqueeze_dim=1):
        return (apply(q, cos, sin, unsqueeze_dim=unsqueeze_dim),
                apply(k, cos, sin, unsqueeze_dim=unsqueeze_dim))
    return both


FORMS = [
    Form("qwen3", Qwen3RMSNorm, qwen3_apply, "weight"),
    Form("qwen3-vl-text", Qwen3VLTextRMSNorm, qwen3_vl_apply, "weight"),
    Form("gemma3", Gemma3RMSNorm, gemma3_apply, "one_plus_weight"),
    Form("qwen3-next", Qwen3NextRMSNorm, qwen3_next_apply, "one_plus_weight"),
    Form("olmo2", Olmo2RMSNorm, olmo2_apply, "weight_f32"),
]
if Gemma4RMSNorm is not None:  # 5.x: Gemma 3n's norm is the pow form (4.57's divides by sqrt)
    FORMS += [Form("gemma3n", Gemma3nRMSNorm, one_at_a_time(_gemma3n_apply), "pow"),
              Form("gemma3n-weightless", Gemma3nRMSNorm, one_at_a_time(_gemma3n_apply), "pow",
                   weightless=True),
              Form("gemma4", Gemma4RMSNorm, one_at_a_time(_gemma4_apply), "pow"),
              Form("neomme-weightless", NeoMMERMSNorm, neomme_apply, "pow", weightless=True)]
FORM_IDS = [f.name for f in FORMS]
#: the pow form (transformers 5.x), or None
POW = next((f for f in FORMS if f.name == "gemma3n"), None)
needs_pow = pytest.mark.skipif(POW is None, reason="transformers 4.57's Gemma 3n norm divides "
                               "by sqrt (another form); the pow form is 5.x's")

SHAPES = [
    Shape("qwen3-vl-8b-heads", 1, 32, 8, 7, 128),
    Shape("qwen3-4b-batch2", 2, 8, 4, 5, 128, cos_batch=2),
    Shape("gemma3-head256", 1, 4, 2, 6, 256),
    Shape("head64-mqa", 2, 6, 1, 5, 64),
    Shape("head80", 1, 4, 2, 9, 80),
    Shape("head96", 2, 3, 3, 4, 96, cos_batch=2),
    Shape("qwen3.5-partial-rotary", 1, 4, 2, 5, 256, R=64),
    Shape("decode-T1", 3, 4, 2, 1, 128, cos_batch=3),
]
LAYOUTS = ["hf-transposed", "bthd-unsqueeze2", "contiguous"]


def make_qk(s: Shape, layout: str, dtype: torch.dtype):
    """q, k as the model hands them over, and the unsqueeze_dim to use."""
    if layout == "hf-transposed":  # projection (B, T, H*D) viewed (B, T, H, D) -> (B, H, T, D)
        q = torch.randn(s.B, s.T, s.Hq * s.D).to(dtype).view(s.B, s.T, s.Hq, s.D).transpose(1, 2)
        k = torch.randn(s.B, s.T, s.Hk * s.D).to(dtype).view(s.B, s.T, s.Hk, s.D).transpose(1, 2)
        return q, k, 1
    if layout == "contiguous":
        return (torch.randn(s.B, s.Hq, s.T, s.D).to(dtype),
                torch.randn(s.B, s.Hk, s.T, s.D).to(dtype), 1)
    if layout == "bthd-unsqueeze2":
        return (torch.randn(s.B, s.T, s.Hq, s.D).to(dtype),
                torch.randn(s.B, s.T, s.Hk, s.D).to(dtype), 2)
    raise AssertionError(layout)


def make_tables(s: Shape, dtype: torch.dtype):
    """Real RoPE tables (cat(freqs, freqs)) at random positions, in q's dtype (as the
    rotary modules return them)."""
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, s.rot, 2, dtype=torch.float32) / s.rot)
    freqs = torch.randint(0, 8192, (s.cos_batch, s.T)).float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_norms(f: Form, D: int, dtype: torch.dtype, weight_dtype: torch.dtype | None = None):
    """Two of the model's norm modules (q_norm, k_norm) with random weights (of
    weight_dtype, else of dtype)."""
    norms = []
    for _ in range(2):
        if f.weightless:
            norms.append(f.norm_cls(D, EPS, with_scale=False).to(dtype))
            continue
        n = f.norm_cls(D, EPS).to(weight_dtype or dtype)
        with torch.no_grad():
            n.weight.copy_(torch.randn(D) * 0.5 + (0.0 if f.norm == "one_plus_weight" else 1.0))
        norms.append(n)
    return norms


def reference(f: Form, q, k, cos, sin, qn, kn, dim, pairing="half"):
    """transformers' norm, then the model's rotary (fp32) or posenc's (16-bit, adjacent)."""
    yq, yk = qn(q), kn(k)
    if q.dtype == torch.float32 and pairing == "half":
        rotary = qwen3_next_apply if cos.shape[-1] < q.shape[-1] else f.rotary
        return rotary(yq, yk, cos, sin, unsqueeze_dim=dim)
    return pt.apply_rotary_pos_emb(yq, yk, cos, sin, unsqueeze_dim=dim, pairing=pairing)


def fused(f: Form, q, k, cos, sin, qn, kn, dim, pairing="half"):
    weights = (None, None) if f.weightless else (qn.weight, kn.weight)
    return pt.apply_qk_norm_rope(q, k, cos, sin, *weights, EPS, dim, norm=f.norm,
                                 pairing=pairing)


def check_forward_backward(f: Form, s: Shape, layout: str, dtype: torch.dtype,
                           pairing: str = "half", tables=None,
                           weight_dtype: torch.dtype | None = None,
                           grad_layout: str = "output") -> None:
    """Forward and the gradients of q, k and both weights are bit-identical.  The incoming
    gradients are laid out as the reference's outputs are ("output", randn_like) or token
    by token ("tokens": (B, T, H, D) memory seen as (B, H, T, D), as SDPA gives them back
    for transformers' transposed q and k), which the backward walks token by token where
    the weight gradients' blocks allow."""
    q, k, dim = make_qk(s, layout, dtype)
    cos, sin = make_tables(s, dtype) if tables is None else tables
    ref_norms = make_norms(f, s.D, dtype, weight_dtype)
    norms = make_norms(f, s.D, dtype, weight_dtype)
    for a, b in zip(ref_norms, norms, strict=True):
        b.load_state_dict(a.state_dict())
    q_ref, k_ref = (t.detach().clone().requires_grad_() for t in (q, k))
    q_new, k_new = (t.detach().clone().requires_grad_() for t in (q, k))
    want = reference(f, q_ref, k_ref, cos, sin, *ref_norms, dim, pairing)
    got = fused(f, q_new, k_new, cos, sin, *norms, dim, pairing)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w), f"forward differs by {(g.double() - w.double()).abs().max()}"
    if grad_layout == "tokens":
        assert dim == 1
        grads = [torch.randn(w.shape[0], w.shape[2], w.shape[1], w.shape[3]).to(w.dtype)
                 .transpose(1, 2) for w in want]
    else:
        grads = [torch.randn_like(w) for w in want]
    torch.autograd.backward(want, grads)
    torch.autograd.backward(got, grads)
    pairs = [(q_new.grad, q_ref.grad, "dq"), (k_new.grad, k_ref.grad, "dk")]
    if not f.weightless:
        pairs += [(norms[0].weight.grad, ref_norms[0].weight.grad, "dq_weight"),
                  (norms[1].weight.grad, ref_norms[1].weight.grad, "dk_weight")]
    for g, w, name in pairs:
        assert g.dtype == w.dtype
        assert torch.equal(g, w), f"{name} differs by {(g.double() - w.double()).abs().max()}"


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("s", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("f", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_matches_transformers(dtype, f: Form, s: Shape, layout: str):
    check_forward_backward(f, s, layout, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("f", [FORMS[0], FORMS[2]], ids=[FORMS[0].name, FORMS[2].name])
def test_adjacent_pairing(f: Form, dtype):
    check_forward_backward(f, Shape("adjacent", 2, 4, 2, 6, 64), "hf-transposed", dtype,
                           pairing="adjacent")
    check_forward_backward(f, Shape("adjacent-partial", 1, 4, 2, 6, 64, R=32), "hf-transposed",
                           dtype, pairing="adjacent")


@needs_pow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pow_form_adjacent_pairing_and_long_rows(dtype):
    """The pow form (Gemma 3n / Gemma 4) with adjacent pairs, partial rotary, and rows long
    enough for torch's cascade levels; and with rows whose count leaves a tail past torch's
    vector blocks of the pow (its scalar path rounds differently: 2 * 3 * 7 = 42 rows)."""
    check_forward_backward(POW, Shape("adjacent", 2, 4, 2, 6, 64), "hf-transposed", dtype,
                           pairing="adjacent")
    check_forward_backward(POW, Shape("wide-rows", 1, 2, 1, 3, 4096, R=64), "contiguous", dtype)
    check_forward_backward(POW, Shape("tail-rows", 2, 3, 1, 7, 256, R=128), "hf-transposed",
                           dtype)


# The forms that apply the weight in fp32 take an fp32 weight beside 16-bit q and k (as
# mixed-precision training keeps the norm weights): AFMoE's OLMo-style norm (5.x), Gemma 3's
# 1 + w, Gemma 3n's pow form (5.x).
FP32_WEIGHT_FORMS = [FORMS[4], FORMS[2]] + (
    [Form("afmoe", AfmoeRMSNorm, qwen3_apply, "weight_f32"), POW] if POW is not None else [])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("f", FP32_WEIGHT_FORMS, ids=[f.name for f in FP32_WEIGHT_FORMS])
def test_fp32_weight_with_16bit_tensors(f: Form, dtype):
    for s in (SHAPES[0], SHAPES[4], SHAPES[6]):
        check_forward_backward(f, s, "hf-transposed", dtype, weight_dtype=torch.float32)


def test_one_fp32_weight_and_one_16bit_weight():
    """q_weight fp32, k_weight bf16: each gradient in its weight's dtype, autograd's bits."""
    s = SHAPES[1]
    q, k, dim = make_qk(s, "hf-transposed", torch.bfloat16)
    cos, sin = make_tables(s, torch.bfloat16)
    f = FORMS[2]
    ref = make_norms(f, s.D, torch.bfloat16)
    ref[0].float()
    new = make_norms(f, s.D, torch.bfloat16)
    new[0].float()
    for a, b in zip(ref, new, strict=True):
        b.load_state_dict(a.state_dict())
    qa, ka, qb, kb = (t.detach().clone().requires_grad_() for t in (q, k, q, k))
    want = reference(f, qa, ka, cos, sin, *ref, dim)
    got = fused(f, qb, kb, cos, sin, *new, dim)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    grads = [torch.randn_like(w) for w in want]
    torch.autograd.backward(want, grads)
    torch.autograd.backward(got, grads)
    assert new[0].weight.grad.dtype == torch.float32
    assert new[1].weight.grad.dtype == torch.bfloat16
    for a, b in zip(ref, new, strict=True):
        assert torch.equal(a.weight.grad, b.weight.grad)
    assert torch.equal(qa.grad, qb.grad) and torch.equal(ka.grad, kb.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qwen3_vl_interleaved_mrope_tables(dtype):
    """Qwen3-VL's (B, T, R) tables of interleaved MRoPE, as compute_mrope_cos_sin makes them."""
    s = Shape("qwen3-vl-8b-heads", 2, 32, 8, 11, 128, cos_batch=2)
    pos = torch.randint(0, 500, (3, 2, 11))
    inv_freq = 1.0 / 5e6 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    cos, sin = pt.compute_mrope_cos_sin(pos, inv_freq, [24, 20, 20], interleaved=True,
                                        dtype=dtype)
    check_forward_backward(FORMS[1], s, "hf-transposed", dtype, tables=(cos, sin))


@pytest.mark.parametrize("dtype, cos_batch", [(torch.float32, 2), (torch.bfloat16, 1)],
                         ids=["fp32-model-rotary", "bf16-posenc-rotary"])
def test_table_gradients_match(dtype, cos_batch):
    """cos / sin that require grad get autograd's gradients through the reference chain
    (fp32: the model's rotary; bf16: posenc's rotary)."""
    s = Shape("qwen3-heads", cos_batch, 4, 2, 5, 64, cos_batch=cos_batch)
    f = FORMS[0]
    q, k, dim = make_qk(s, "hf-transposed", dtype)
    norms = make_norms(f, s.D, dtype)
    cos, sin = make_tables(s, dtype)
    tables = [[t.clone().requires_grad_() for t in (cos, sin)] for _ in range(2)]
    want = reference(f, q, k, *tables[0], *norms, dim)
    got = fused(f, q, k, *tables[1], *norms, dim)
    grads = [torch.randn_like(w) for w in want]
    ref = torch.autograd.grad(want, tables[0], grads)
    new = torch.autograd.grad(got, tables[1], grads)
    assert torch.equal(new[0], ref[0]) and torch.equal(new[1], ref[1])


def test_large_head_dim_cascade():
    """Rows of 4096 channels: torch's cascade levels carry (64 or more vectors per
    accumulator)."""
    check_forward_backward(FORMS[0], Shape("wide-rows", 1, 2, 1, 3, 4096, R=64), "contiguous",
                           torch.float32)


#: shapes whose weight-gradient sums take every branch of torch's order: D / threads
#: splits that leave columns to the 4-lane order (80, 96 and 40 columns), rows past a
#: level-3 carry (65,536) and past 2^20 (a level power of 5), ragged row counts, no rows
WGRAD_SHAPES = [
    Shape("head80-split", 2, 4, 2, 301, 80),
    Shape("head96-batch2", 2, 3, 1, 257, 96, cos_batch=2),
    Shape("head40-partial", 1, 5, 3, 411, 40, R=24),
    Shape("head32-long", 1, 1, 1, 70_001, 32),
    Shape("head8-million-rows", 1, 1, 1, (1 << 20) + 3, 8),
    Shape("no-k-heads", 2, 3, 0, 7, 64),  # k's weight gradient: a sum of nothing
]


@torch_side
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("s", WGRAD_SHAPES, ids=[s.name for s in WGRAD_SHAPES])
def test_weight_gradients_in_torchs_sum_order(s: Shape, threads):
    """The kernel sums the weights' gradient products itself, in the order of torch's sum
    over autograd's product, which depends on the thread count (its split of the columns,
    by the products' element size), the layout (row order) and the row count (the cascade's
    levels): bit-identical for each, with fp32 products (fp32 tensors, and bf16 with the
    (1 + w) form) and 16-bit ones (the Llama form: bf16, and fp16 at 2 threads, which splits
    as bf16 does and differs only in the final rounding)."""
    if s.T > 100_000 and threads not in (1, 2):
        pytest.skip("the million-row shape runs at 1 and 2 threads (its columns split "
                    "alike at more)")
    cases = [(FORMS[0], torch.float32), (FORMS[0], torch.bfloat16), (FORMS[3], torch.bfloat16)]
    if threads == 2:
        cases.append((FORMS[0], torch.float16))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for f, dtype in cases:
            for layout in ("hf-transposed", "bthd-unsqueeze2"):
                if s.T > 100_000 and (dtype != torch.bfloat16 or layout != "hf-transposed"):
                    continue  # (time: the other dtypes and layouts run on the other shapes)
                check_forward_backward(f, s, layout, dtype)
                if layout == "hf-transposed" and s.T < 1000:
                    check_forward_backward(f, s, layout, dtype, grad_layout="tokens")
    finally:
        torch.set_num_threads(old)


# T a multiple of the weight gradients' blocks of rows (16 for the plain order, 64 for the
# 4-lane order, 32 past 2^19 rows), so that the backward of transposed q and k with
# token-major gradients walks their rows token by token, each head's blocks summed apart.
BY_TOKEN_SHAPES = [
    Shape("qwen3-vl-8b-heads-T64", 1, 32, 8, 64, 128),
    Shape("head80-T320-batch2", 2, 4, 2, 320, 80, cos_batch=2),  # plain and 4-lane columns
    Shape("head40-partial-T192", 1, 5, 3, 192, 40, R=24),
    Shape("head16-T65536", 1, 16, 2, 65536, 16),  # 2^20 rows of q: bf16's blocks of 32
]


@torch_side
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("s", BY_TOKEN_SHAPES, ids=[s.name for s in BY_TOKEN_SHAPES])
def test_backward_token_by_token(s: Shape, threads):
    """Gradients that lie token by token: dq, dk and the weight gradients (summed in
    torch's order over the (B, H, T) products) are bit-identical to autograd's through
    transformers' norm and rotary; and with the gradients laid out as the reference's
    outputs."""
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for f, dtype in ((FORMS[0], torch.float32), (FORMS[0], torch.bfloat16),
                         (FORMS[3], torch.bfloat16)):
            check_forward_backward(f, s, "hf-transposed", dtype, grad_layout="tokens")
            if s.T < 1000:
                check_forward_backward(f, s, "hf-transposed", dtype)
    finally:
        torch.set_num_threads(old)


@torch_side
def test_weight_gradients_with_more_threads_than_column_blocks():
    """70 threads: torch gives most of them no columns (their shares round to nothing) and
    the last a share of 16 columns, summed in the 4-lane order."""
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(70)
        for dtype in (torch.float32, torch.bfloat16):
            check_forward_backward(FORMS[0], WGRAD_SHAPES[0], "hf-transposed", dtype)
    finally:
        torch.set_num_threads(old)


def test_inputs_are_not_modified():
    s = SHAPES[1]
    q, k, dim = make_qk(s, "hf-transposed", torch.bfloat16)
    cos, sin = make_tables(s, torch.bfloat16)
    qw, kw = torch.randn(s.D, dtype=torch.bfloat16), torch.randn(s.D, dtype=torch.bfloat16)
    before = [t.clone() for t in (q, k, cos, sin, qw, kw)]
    pt.apply_qk_norm_rope(q, k, cos, sin, qw, kw, EPS, dim)
    for a, b in zip((q, k, cos, sin, qw, kw), before, strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------- threads, variants, capability


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_simd_variant_and_thread_count(isa, threads, dtype):
    """Large enough to run threaded (more than 2^17 elements)."""
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert pt.kernel_isa() == isa
        for f in (FORMS[0], FORMS[3]) + ((POW,) if POW is not None else ()):
            check_forward_backward(f, Shape("qwen3-vl-8b-heads", 1, 32, 8, 40, 128),
                                   "hf-transposed", dtype)
        check_forward_backward(FORMS[4], Shape("head80", 2, 4, 2, 9, 80), "bthd-unsqueeze2",
                               dtype)
    finally:
        torch.set_num_threads(old)


_NEXT = next(f for f in FORMS if f.name == "qwen3-next")


@pytest.mark.parametrize("f", [FORMS[0], _NEXT] + ([POW] if POW is not None else []),
                         ids=["qwen3", "qwen3-next"] + (["gemma3n"] if POW is not None else []))
@pytest.mark.parametrize("s", [Shape("qwen3-vl-8b-heads", 1, 32, 8, 6, 128),
                               Shape("qwen3-next-heads", 1, 16, 2, 6, 256, R=64)],
                         ids=lambda s: s.name)
def test_bf16_denormal_results_every_variant(isa, f, s):
    """Results that are fp32 denormals, which the avx512bf16 variant's hardware rounding
    would take as zeros (those rows are rounded again in software): through weights so small
    that the normalized and weighted values, their rotations and the gradients are
    denormals, or (one_plus_weight, whose 1 + w is near 1) through input channels far below
    the rest of their row.  With a partial rotary only the channels past it are made small,
    so that no rotated channel gives the row away."""
    q, k, dim = make_qk(s, "hf-transposed", torch.bfloat16)
    cos, sin = make_tables(s, torch.bfloat16)
    ref_norms, norms = make_norms(f, s.D, torch.bfloat16), make_norms(f, s.D, torch.bfloat16)
    R = s.R or s.D
    tiny = torch.tensor([1e-39, -3e-40, 2e-38, 1.0], dtype=torch.bfloat16).repeat(s.D // 4)
    tiny = tiny[torch.randperm(s.D)]
    if R < s.D:
        tiny[:R] = 1.0
    if f.norm == "one_plus_weight":
        for t in (q, k):  # in place: the layout stays the model's
            t.mul_(tiny)
    else:
        for a in ref_norms:
            with torch.no_grad():
                a.weight.copy_(tiny)
    for a, b in zip(ref_norms, norms, strict=True):
        b.load_state_dict(a.state_dict())
    qa, ka, qb, kb = (t.detach().clone().requires_grad_() for t in (q, k, q, k))
    want = reference(f, qa, ka, cos, sin, *ref_norms, dim)
    got = fused(f, qb, kb, cos, sin, *norms, dim)
    for w in want:  # denormals in the channels made small, and only there
        small = (w.float().abs() < 1.2e-38).logical_and(w != 0)
        assert small[..., R:].any() if R < s.D else small.any()
        assert not small[..., :R].any() or R == s.D
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    grads = [torch.randn_like(w) * 1e-37 for w in want]
    torch.autograd.backward(want, grads)
    torch.autograd.backward(got, grads)
    assert torch.equal(qa.grad, qb.grad) and torch.equal(ka.grad, kb.grad)
    for a, b in zip(ref_norms, norms, strict=True):
        assert torch.equal(a.weight.grad, b.weight.grad)


_OLMO2 = next(f for f in FORMS if f.norm == "weight_f32")


def _bits_where_numbers(got: torch.Tensor, want: torch.Tensor) -> bool:
    """NaN in the same elements and the same bits everywhere else (NaN payloads are not
    part of the result: which operand's NaN an instruction passes on is the compiler's
    choice of operand order)."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(
        got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("f", [FORMS[0], _NEXT, _OLMO2], ids=["qwen3", "qwen3-next", "olmo2"])
@pytest.mark.parametrize("s", [Shape("qwen3-vl-8b-heads", 1, 32, 8, 6, 128),
                               Shape("qwen3-next-heads", 1, 16, 2, 6, 256, R=64)],
                         ids=lambda s: s.name)
def test_bf16_nan_infinity_and_zero_inputs_every_variant(isa, f, s):
    """bf16 rows holding NaNs (quiet and signalling, with payloads), infinities, zeros of
    both signs and denormals, and for the fp32-weight form weights holding fp32 NaNs whose
    low 16 bits are not zero (the software rounding of the bf16 pair rows rounds numbers
    only, so such weights must not reach it); forward and backward."""
    q, k, dim = make_qk(s, "hf-transposed", torch.bfloat16)
    cos, sin = make_tables(s, torch.bfloat16)
    specials = torch.tensor([0x7FC1, 0xFFA0, 0x7F81, 0x7F80, 0xFF80, 0x0001, 0x8040, 0x0000,
                             0x8000], dtype=torch.int32).to(torch.int16)
    for t in (q, k):  # a few elements of some rows (one per token and head in 3 of 6 tokens)
        bits = t.view(torch.int16)
        for j in range(3):
            idx = torch.randperm(s.D)[: 1 + j]
            bits[:, :, 2 * j, idx] = specials[torch.randint(0, len(specials), (len(idx),))]
    wd = torch.float32 if f is _OLMO2 else None
    ref_norms, norms = make_norms(f, s.D, torch.bfloat16, wd), make_norms(f, s.D, torch.bfloat16, wd)
    if f is _OLMO2:
        nans = torch.tensor([0x7FFFFFFF, 0xFFFF8001 - (1 << 32), 0x7F800001], dtype=torch.int32)
        for n in ref_norms:
            with torch.no_grad():
                n.weight.view(torch.int32)[torch.randperm(s.D)[:3]] = nans
    for a, b in zip(ref_norms, norms, strict=True):
        b.load_state_dict(a.state_dict())
    qa, ka, qb, kb = (t.detach().clone().requires_grad_() for t in (q, k, q, k))
    want = reference(f, qa, ka, cos, sin, *ref_norms, dim)
    got = fused(f, qb, kb, cos, sin, *norms, dim)
    assert all(w.isnan().any() for w in want)
    assert all(_bits_where_numbers(g, w) for g, w in zip(got, want, strict=True))
    grads = [torch.randn_like(w) for w in want]
    torch.autograd.backward(want, grads)
    torch.autograd.backward(got, grads)
    # (a NaN weight makes every row's sum, so all of dx, NaN)
    assert qa.grad.isnan().any() and (f is _OLMO2 or not qa.grad.isnan().all())
    assert _bits_where_numbers(qb.grad, qa.grad) and _bits_where_numbers(kb.grad, ka.grad)
    for a, b in zip(ref_norms, norms, strict=True):
        assert _bits_where_numbers(b.weight.grad, a.weight.grad)


_CAPABILITY_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    import test_qk_norm as t
    from shapes import Shape
    assert torch.backends.cpu.get_cpu_capability() == {want!r}, \\
        torch.backends.cpu.get_cpu_capability()
    torch.manual_seed(0)
    for isa in t.ISAS:
        t.pt.set_kernel_isa(isa)
        for f in t.FORMS:
            for D in (64, 80, 96, 128, 256):
                t.check_forward_backward(f, Shape("cap", 2, 4, 2, 9, D), "hf-transposed",
                                         torch.float32)
    print("ok")
""")


@torch_side
@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2", "AVX512"])
def test_every_torch_cpu_capability(capability):
    """torch's CPU kernels (the mean's additions) under each ATEN_CPU_CAPABILITY, in a fresh
    interpreter: fp32 stays bit-identical."""
    if capability == "AVX512" and "avx512" not in ISAS:
        pytest.skip("this CPU has no AVX-512")
    if capability == "AVX2" and "avx2" not in ISAS:
        pytest.skip("this CPU has no AVX2")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability.lower())
    script = _CAPABILITY_SCRIPT.format(tests=tests, want=capability)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_sum_lanes_of_torch_capabilities():
    assert SUM_LANES == torch_sum_lanes()
    for cap in ("DEFAULT", "AVX2", "AVX512"):
        assert torch_sum_lanes(cap, "x86_64") == 8
    assert torch_sum_lanes("DEFAULT", "aarch64") == 4
    assert torch_sum_lanes("SVE256", "aarch64") == 8


# ---------------------------------------------------------------------------- fp64


def fp64_reference(q, k, cos, sin, qw, kw, norm, dim, pairing="half"):
    """The chain in fp64, written from the definitions."""
    def one(x, w):
        n = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)
        y = w * n if norm != "one_plus_weight" else n * (1 + w)  # pow: the same in fp64
        R = cos.shape[-1]
        c, s = cos.unsqueeze(dim), sin.unsqueeze(dim)
        yr = y[..., :R]
        if pairing == "half":
            rot = torch.cat((-yr[..., R // 2:], yr[..., : R // 2]), -1)
        else:
            rot = torch.stack((-yr[..., 1::2], yr[..., ::2]), -1).flatten(-2)
        return torch.cat((yr * c + rot * s, y[..., R:]), -1)
    return one(q, qw), one(k, kw)


@pytest.mark.parametrize("norm", ["weight", "one_plus_weight", "weight_f32", "pow"])
@pytest.mark.parametrize("s", [SHAPES[1], SHAPES[6]], ids=lambda s: s.name)
def test_fp64_matches_fp64_reference(norm, s):
    q, k, dim = make_qk(s, "hf-transposed", torch.float64)
    cos, sin = make_tables(s, torch.float64)
    qw, kw = torch.randn(s.D, dtype=torch.float64), torch.randn(s.D, dtype=torch.float64)
    got = pt.apply_qk_norm_rope(q, k, cos, sin, qw, kw, EPS, dim, norm=norm)
    want = fp64_reference(q, k, cos, sin, qw, kw, norm, dim)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-13)


GRADCHECK = [("weight", "half", 1, None), ("one_plus_weight", "half", 2, None),
             ("weight_f32", "adjacent", 1, None), ("weight", "half", 1, 4),
             ("pow", "half", 1, None), ("pow", "adjacent", 2, 4)]


@pytest.mark.parametrize("norm,pairing,dim,R", GRADCHECK,
                         ids=["weight", "one_plus_weight-bthd", "weight_f32-adjacent",
                              "weight-partial", "pow", "pow-bthd-adjacent-partial"])
def test_gradcheck_and_gradgradcheck_fp64(norm, pairing, dim, R):
    s = Shape("tiny", 2, 2, 1, 3, 8, R=R, cos_batch=2)
    q, k, dim = make_qk(s, "hf-transposed" if dim == 1 else "bthd-unsqueeze2", torch.float64)
    cos, sin = make_tables(s, torch.float64)
    qw, kw = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    args = [t.detach().clone().requires_grad_() for t in (q, k, cos, sin, qw, kw)]

    def f(*a):
        return pt.apply_qk_norm_rope(*a, EPS, dim, norm=norm, pairing=pairing)

    assert torch.autograd.gradcheck(f, args, fast_mode=True)
    assert torch.autograd.gradgradcheck(f, args, fast_mode=True)


def test_gradcheck_pow_without_weights_fp64():
    s = Shape("tiny", 2, 2, 1, 3, 8, cos_batch=2)
    q, k, dim = make_qk(s, "hf-transposed", torch.float64)
    cos, sin = make_tables(s, torch.float64)
    args = [t.detach().clone().requires_grad_() for t in (q, k, cos, sin)]

    def f(q, k, c, s):
        return pt.apply_qk_norm_rope(q, k, c, s, None, None, EPS, dim, norm="pow")

    got = f(*args)
    want = fp64_reference(q, k, cos, sin, torch.ones(8, dtype=torch.float64),
                          torch.ones(8, dtype=torch.float64), "pow", dim)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-13)
    assert torch.autograd.gradcheck(f, args, fast_mode=True)
    assert torch.autograd.gradgradcheck(f, args, fast_mode=True)


# ------------------------------------------------------- opcheck, compile, export, vmap


def _op_args(dtype=torch.float32, rg=False, heads_first=True, form=0):
    q = torch.randn(2, 3, 5, 16, dtype=dtype)
    k = torch.randn(2, 1, 5, 16, dtype=dtype)
    if not heads_first:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = torch.randn(1, 5, 16, dtype=dtype), torch.randn(1, 5, 16, dtype=dtype)
    qw, kw = torch.randn(16, dtype=dtype), torch.randn(16, dtype=dtype)
    tensors = [t.requires_grad_(rg) for t in (q, k, cos, sin, qw, kw)]
    return (*tensors, EPS, form, 0, SUM_LANES, heads_first)


@torch_side
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rg", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("form", [0, 1, 2, 3])
def test_opcheck(dtype, rg, form):
    torch.library.opcheck(torch.ops.posenc.qk_norm_rope.default,
                          _op_args(dtype, rg, form=form))


@pytest.mark.parametrize("form", [1, 3])
def test_opcheck_backward_op(form):
    args = _op_args(torch.float32, heads_first=False, form=form)
    q, k, cos, sin, qw, kw = args[:6]
    _, _, qr, kr = torch.ops.posenc.qk_norm_rope(*args)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    pows = (qr.pow(-1.5), kr.pow(-1.5)) if form == 3 else ()
    torch.library.opcheck(torch.ops.posenc.qk_norm_rope_backward.default,
                          (gq, gk, q, k, cos, sin, qw, kw, qr, kr, *args[6:], *pows))


@pytest.mark.parametrize("form", [0, 1, 3])
def test_backward_op_nan_rstd_every_variant(isa, form):
    """The backward op called directly takes whatever rstd (and ms^-1.5) it is given: a row
    given an fp32 NaN whose low 16 bits carry into the bf16 (the software rounding of the
    bf16 pair rows rounds numbers only) comes back all NaN, and the other rows as with the
    forward's rstd."""
    q = torch.randn(1, 4, 3, 64).to(torch.bfloat16).transpose(1, 2)  # (B, H, T, D) views
    k = torch.randn(1, 4, 1, 64).to(torch.bfloat16).transpose(1, 2)
    cos, sin = torch.randn(1, 4, 64).to(torch.bfloat16), torch.randn(1, 4, 64).to(torch.bfloat16)
    qw, kw = torch.randn(64).to(torch.bfloat16), torch.randn(64).to(torch.bfloat16)
    args = (q, k, cos, sin, qw, kw, EPS, form, 0, SUM_LANES, True)
    _, _, qr, kr = torch.ops.posenc.qk_norm_rope(*args)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    pows = (qr.pow(-1.5), kr.pow(-1.5)) if form == 3 else ()
    want = torch.ops.posenc.qk_norm_rope_backward(gq, gk, *args[:6], qr, kr, *args[6:], *pows)
    bad_r = qr.clone()
    bad_r.view(-1)[1:2].view(torch.int32).fill_(0x7FFFFFFF)
    bad_pows = pows
    if form == 3:
        bad_pows = (pows[0].clone(), pows[1])
        bad_pows[0].view(-1)[1:2].view(torch.int32).fill_(0xFFFF8001 - (1 << 32))
    got = torch.ops.posenc.qk_norm_rope_backward(gq, gk, *args[:6], bad_r, kr, *args[6:],
                                                 *bad_pows)
    row = torch.zeros_like(qr, dtype=torch.bool)
    row.view(-1)[1] = True
    dq, dq_want = got[0], want[0]
    assert dq[row].isnan().all()
    assert torch.equal(dq[~row].view(torch.int16), dq_want[~row].view(torch.int16))
    assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))


def test_opcheck_eager_pow():
    torch.library.opcheck(torch.ops.posenc.eager_pow.default, (torch.rand(37) + 0.5, -1.5))


def test_pow_form_backward_op_needs_the_pows():
    args = _op_args(torch.float32, form=3)
    q, k, cos, sin, qw, kw = args[:6]
    _, _, qr, kr = torch.ops.posenc.qk_norm_rope(*args)
    with raw_raises(ValueError, "q_pow"):
        torch.ops.posenc.qk_norm_rope_backward(q, k, q, k, cos, sin, qw, kw, qr, kr, *args[6:])


def _step(q, k, cos, sin, qw, kw, norm="weight"):
    qo, ko = pt.apply_qk_norm_rope(q, k, cos, sin, qw, kw, EPS, norm=norm)
    return (qo * 2).sum() + ko.square().sum()


@torch_side
@pytest.mark.parametrize("norm,T", [("weight", 16), ("pow", 16), ("pow", 7)])
def test_compile_fullgraph_forward_backward(norm, T):
    """Compiled gradients are eager's bits (pow: torch's eager pow kernel, also for the
    rows of its scalar tail: 32 * 7 and 8 * 7 rows)."""
    torch._dynamo.reset()
    s = Shape("qwen3-vl-8b-heads", 1, 32, 8, T, 128)
    q, k, _ = make_qk(s, "hf-transposed", torch.float32)
    cos, sin = make_tables(s, torch.float32)
    w = [torch.randn(128), torch.randn(128)]
    a = [t.detach().clone().requires_grad_() for t in (q, k, *w)]
    b = [t.detach().clone().requires_grad_() for t in (q, k, *w)]
    torch.compile(_step, fullgraph=True)(a[0], a[1], cos, sin, a[2], a[3], norm).backward()
    _step(b[0], b[1], cos, sin, b[2], b[3], norm).backward()
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.grad, y.grad)


def test_compile_dynamic_no_recompiles():
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def f(q, k, cos, sin, qw, kw):
        return pt.apply_qk_norm_rope(q, k, cos, sin, qw, kw, EPS)

    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    qw, kw = torch.randn(32), torch.randn(32)
    for T in (8, 13, 21):
        s = Shape("dyn", 1, 4, 2, T, 32)
        q, k, _ = make_qk(s, "hf-transposed", torch.float32)
        cos, sin = make_tables(s, torch.float32)
        out = compiled(q, k, cos, sin, qw, kw)
        ref = f(q, k, cos, sin, qw, kw)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert counter.frame_count == 1


@torch_side
def test_compile_inductor_dynamic_with_backward():
    torch._dynamo.reset()
    compiled = torch.compile(_step, dynamic=True, fullgraph=True)
    for T in (5, 9):
        s = Shape("dyn", 1, 2, 1, T, 16)
        q, k, _ = make_qk(s, "hf-transposed", torch.float32)
        cos, sin = make_tables(s, torch.float32)
        w = [torch.randn(16), torch.randn(16)]
        a = [t.detach().clone().requires_grad_() for t in (q, k, *w)]
        b = [t.detach().clone().requires_grad_() for t in (q, k, *w)]
        compiled(a[0], a[1], cos, sin, a[2], a[3]).backward()
        _step(b[0], b[1], cos, sin, b[2], b[3]).backward()
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.grad, y.grad)


def test_export():
    class Prologue(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_norm, self.k_norm = Qwen3RMSNorm(32, EPS), Qwen3RMSNorm(32, EPS)

        def forward(self, q, k, cos, sin):
            return pt.apply_qk_norm_rope(q, k, cos, sin, self.q_norm.weight,
                                         self.k_norm.weight, EPS)

    s = Shape("export", 1, 4, 2, 8, 32)
    q, k, _ = make_qk(s, "hf-transposed", torch.float32)
    cos, sin = make_tables(s, torch.float32)
    m = Prologue()
    ep = torch.export.export(m, (q, k, cos, sin))
    assert any("posenc.qk_norm_rope" in str(n.target) for n in ep.graph.nodes)
    out = ep.module()(q, k, cos, sin)
    ref = qwen3_apply(m.q_norm(q), m.k_norm(k), cos, sin)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_vmap_matches_a_loop():
    s = Shape("vmap", 2, 4, 2, 5, 32)
    qs = torch.randn(3, s.B, s.Hq, s.T, s.D)
    ks = torch.randn(3, s.B, s.Hk, s.T, s.D)
    cos, sin = make_tables(s, torch.float32)
    qw, kw = torch.randn(32), torch.randn(32)

    def f(q, k):
        return pt.apply_qk_norm_rope(q, k, cos, sin, qw, kw, EPS)

    got = torch.vmap(f)(qs, ks)
    for i in range(3):
        want = f(qs[i], ks[i])
        assert torch.equal(got[0][i], want[0]) and torch.equal(got[1][i], want[1])


# ------------------------------------------------------------------ memory for backward


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn runs."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_saved_for_backward_bf16_at_most_2_5_bytes_per_element():
    """q and k (2 bytes each element) and one fp32 scale per row, besides the tables and
    weights every method keeps."""
    s = Shape("qwen3-vl-8b-heads", 1, 32, 8, 64, 128)
    q, k, _ = make_qk(s, "hf-transposed", torch.bfloat16)
    cos, sin = make_tables(s, torch.bfloat16)
    qw, kw = (torch.randn(128, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    n = saved_bytes(lambda: pt.apply_qk_norm_rope(q, k, cos, sin, qw, kw, EPS))
    elements = q.numel() + k.numel()
    assert n / elements <= 2.5, n / elements


# ----------------------------------------------------------------------------- bad input


def _ok():
    return (torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 5, 16),
            torch.randn(2, 5, 16), torch.randn(16), torch.randn(16))


BAD = [
    ("q-rank", lambda q, k, c, s, a, b: (q[0], k, c, s, a, b), {}, ValueError, "q must be 4-D"),
    ("k-head-dim", lambda q, k, c, s, a, b: (q, k[..., :8], c, s, a, b), {}, ValueError,
     "k head_dim"),
    ("k-seq", lambda q, k, c, s, a, b: (q, k[:, :, :3], c, s, a, b), {}, ValueError,
     "k sequence length"),
    ("cos-rank", lambda q, k, c, s, a, b: (q, k, c[0], s, a, b), {}, ValueError,
     "cos must be 3-D"),
    ("cos-batch", lambda q, k, c, s, a, b: (q, k, torch.randn(3, 5, 16), torch.randn(3, 5, 16),
                                            a, b), {}, ValueError, "cos batch size"),
    ("odd-rotary", lambda q, k, c, s, a, b: (q, k, c[..., :7], s[..., :7], a, b), {},
     ValueError, "must be even"),
    ("q-weight-size", lambda q, k, c, s, a, b: (q, k, c, s, a[:8], b), {}, ValueError,
     "q_weight must have shape"),
    ("k-weight-rank", lambda q, k, c, s, a, b: (q, k, c, s, a, b[None]), {}, ValueError,
     "k_weight must be 1-D"),
    ("int-q", lambda q, k, c, s, a, b: (q.int(), k, c, s, a, b), {}, TypeError,
     "q must be float32"),
    ("k-dtype", lambda q, k, c, s, a, b: (q, k.double(), c, s, a, b), {}, TypeError,
     "k dtype"),
    ("cos-dtype", lambda q, k, c, s, a, b: (q, k, c.bfloat16(), s, a, b), {}, TypeError,
     "cos dtype"),
    ("weight-dtype", lambda q, k, c, s, a, b: (q, k, c, s, a.bfloat16(), b), {}, TypeError,
     "q_weight dtype"),
    ("norm", lambda *t: t, {"norm": "gemma3n"}, ValueError, "norm must be one of"),
    ("fp32-weight-llama-form", lambda q, k, c, s, a, b: (q.bfloat16(), k.bfloat16(),
                                                         c.bfloat16(), s.bfloat16(), a, b),
     {}, TypeError, r"q_weight dtype Float must equal q dtype BFloat16 \(or be Float for the "
     "norms that apply the weight in fp32"),
    ("fp32-weight-fp64-q", lambda q, k, c, s, a, b: (q.double(), k.double(), c.double(),
                                                     s.double(), a.double(), b),
     {"norm": "pow"}, TypeError, "k_weight dtype Float must equal q dtype Double$"),
    ("bf16-weight-fp16-q", lambda q, k, c, s, a, b: (q.half(), k.half(), c.half(), s.half(),
                                                     a.bfloat16(), b.half()),
     {"norm": "weight_f32"}, TypeError, "q_weight dtype BFloat16 must equal q dtype Half"),
    ("no-weight-llama-form", lambda q, k, c, s, a, b: (q, k, c, s, None, b), {}, ValueError,
     "q_weight may be None only for norm='pow'"),
    ("no-weight-q-not-a-tensor", lambda q, k, c, s, a, b: (q.tolist(), k, c, s, None, None),
     {"norm": "pow"}, TypeError, "q must be a torch.Tensor"),
    ("norm-type", lambda *t: t, {"norm": 1}, TypeError, "norm must be a str"),
    ("pairing", lambda *t: t, {"pairing": "gptj"}, ValueError, "pairing must be"),
    ("unsqueeze-dim", lambda *t: t, {"unsqueeze_dim": 3}, ValueError, "unsqueeze_dim must be"),
    ("eps-negative", lambda *t: t, {"eps": -1.0}, ValueError, "eps must be finite"),
    ("eps-type", lambda *t: t, {"eps": torch.tensor(1e-6)}, TypeError, "eps must be a real"),
    ("device", lambda q, k, c, s, a, b: (q, k, c, s, a.to("meta"), b), {}, ValueError,
     "q_weight is on meta"),
    ("not-a-tensor", lambda q, k, c, s, a, b: (q, k, c, s, a.tolist(), b), {}, TypeError,
     "q_weight must be a torch.Tensor"),
]


@pytest.mark.parametrize("name,mutate,kw,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(name, mutate, kw, exc, msg):
    args = list(mutate(*_ok()))
    kw = dict(kw)
    eps = kw.pop("eps", EPS)
    with pytest.raises(exc, match=msg):
        pt.apply_qk_norm_rope(*args, eps, **kw)


def test_op_called_directly_rejects_bad_arguments():
    q, k, c, s, a, b = _ok()
    with raw_raises(ValueError, "form must be"):
        torch.ops.posenc.qk_norm_rope(q, k, c, s, a, b, EPS, 7, 0, 8, True)
    with raw_raises(ValueError, "sum_lanes must be"):
        torch.ops.posenc.qk_norm_rope(q, k, c, s, a, b, EPS, 0, 0, 3, True)
    with raw_raises(ValueError, "pairing must be"):
        torch.ops.posenc.qk_norm_rope(q, k, c, s, a, b, EPS, 0, 2, 8, True)
    with raw_raises(TypeError, "^q must be float32"):
        torch.ops.posenc.qk_norm_rope(q.int(), k, c, s, a, b, EPS, 0, 0, 8, True)


def test_cuda_tensors_are_not_implemented():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    q, k, c, s, a, b = (t.cuda() for t in _ok())
    with pytest.raises(NotImplementedError, match="CPU tensors only"):
        pt.apply_qk_norm_rope(q, k, c, s, a, b, EPS)


ISAS = conftest.ISAS  # every kernel variant this CPU runs
