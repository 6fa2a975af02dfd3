"""Property tests of the Python API against an fp64 reference written here.

Hypothesis draws shapes, layouts (transposed views, slices of wider buffers, expanded
stride-0 dims, non-unit channel strides), dtypes (mixed too), pairings, partial rotary
widths, table batches and MRoPE sections (contiguous and interleaved).  Every example must
match the fp64 rotation of the same (already rounded) inputs to within the rounding of the
fp32 arithmetic and the one rounding at the store; pass-through channels must be copied
exactly; inputs must not change.  Example counts are fixed and the search is derandomized,
so a run is reproducible and takes seconds.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import posenc_torch as pt

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
QK_LAYOUTS = ["contiguous", "transposed", "slice", "expanded", "channel-strided"]
TABLE_LAYOUTS = ["contiguous", "slice", "expanded-seq"]


# ------------------------------------------------------------------- the fp64 reference


def slot_axes(half: int, sections: list[int] | None, interleaved: bool) -> list[int]:
    """Which position axis (0 T, 1 H, 2 W) frequency slot j of R/2 takes its angle from."""
    if sections is None:
        return [0] * half
    if not interleaved:  # Qwen2-VL: contiguous runs
        return [0] * sections[0] + [1] * sections[1] + [2] * sections[2]
    return [1 if j % 3 == 1 and j < 3 * sections[1] else
            2 if j % 3 == 2 and j < 3 * sections[2] else 0 for j in range(half)]


def merge_tables(t: torch.Tensor, axes: list[int], pairing: str) -> torch.Tensor:
    """(3, Bc, T, R) -> (Bc, T, R): channel c reads the axis of its frequency slot."""
    half = len(axes)
    slot = [c % half for c in range(2 * half)] if pairing == "half" else \
        [c // 2 for c in range(2 * half)]
    return torch.stack([t[axes[slot[c]], ..., c] for c in range(2 * half)], -1)


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str):
    """x (B, H, T, D), cos/sin (Bc, T, R), all fp64: out, and the bound |x c| + |x' s|."""
    rot = cos.shape[-1]
    c, s = cos[:, None], sin[:, None]
    xr = x[..., :rot]
    if pairing == "half":
        partner = torch.cat((-xr[..., rot // 2:], xr[..., : rot // 2]), -1)
    else:
        partner = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
    out = torch.cat((xr * c + partner * s, x[..., rot:]), -1)
    size = torch.cat(((xr * c).abs() + (partner * s).abs(), torch.zeros_like(x[..., rot:])), -1)
    return out, size


def assert_close_to_reference(got, x, cos, sin, pairing, out_dtype, rot):
    assert got.dtype == out_dtype and got.shape == x.shape
    ref, size = reference(x.double(), cos.double(), sin.double(), pairing)
    err = (got.double() - ref).abs()
    eps_out = torch.finfo(out_dtype).eps
    bound = eps_out * ref.abs() + 4 * torch.finfo(torch.float32).eps * size + 1e-300
    assert bool((err[..., :rot] <= bound[..., :rot]).all()), float(err.max())
    assert torch.equal(got[..., rot:], x[..., rot:].to(out_dtype)), "pass-through changed"


# ----------------------------------------------------------------------------- inputs


def make_qk(draw, B: int, H: int, T: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, T, D) with a drawn memory layout."""
    layout = draw(st.sampled_from(QK_LAYOUTS))
    if layout == "contiguous":
        return torch.randn(B, H, T, D).to(dtype)
    if layout == "transposed":  # HF: projection (B, T, H*D) viewed and transposed
        return torch.randn(B, T, H, D).to(dtype).transpose(1, 2)
    if layout == "slice":  # part of a fused qkv buffer, channel-sliced too
        extra = draw(st.integers(1, 3))
        return torch.randn(B, T, H + extra, D + 2).to(dtype)[:, :, extra:, 1:D + 1].transpose(1, 2)
    if layout == "expanded":
        dim = draw(st.sampled_from([0, 1, 2]))
        shape = [B, H, T, D]
        shape[dim] = 1
        return torch.randn(shape).to(dtype).expand(B, H, T, D)
    return torch.randn(B, H, T, 2 * D).to(dtype)[..., ::2]  # channel stride 2


def make_tables(draw, lead: tuple[int, ...], T: int, R: int, dtype: torch.dtype):
    layout = draw(st.sampled_from(TABLE_LAYOUTS))
    if layout == "contiguous":
        cos, sin = torch.randn(*lead, T, R), torch.randn(*lead, T, R)
    elif layout == "slice":
        cos, sin = torch.randn(*lead, T, R + 3)[..., 2:R + 2], torch.randn(*lead, T, R + 3)[..., :R]
    else:
        cos = torch.randn(*lead, 1, R).expand(*lead, T, R)
        sin = torch.randn(*lead, 1, R).expand(*lead, T, R)
    return cos.to(dtype), sin.to(dtype)


@st.composite
def rope_problems(draw, mrope: bool = False):
    B, T = draw(st.integers(1, 3)), draw(st.integers(0, 5))
    Hq, Hk = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    D = 2 * draw(st.integers(1, 12))
    qdt, kdt = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES))
    tdt = draw(st.sampled_from(DTYPES))
    Bc = draw(st.sampled_from([1, B]))
    if mrope:  # transformers 4.x form: (3, Bc, T, D) tables, sections summing to D / 2
        a = draw(st.integers(0, D // 2))
        b = draw(st.integers(0, D // 2 - a))
        sections, R, pairing, lead = [a, b, D // 2 - a - b], D, "half", (3, Bc)
    else:
        R = 2 * draw(st.integers(1, D // 2))
        sections, pairing, lead = None, draw(st.sampled_from(["half", "adjacent"])), (Bc,)
    q, k = make_qk(draw, B, Hq, T, D, qdt), make_qk(draw, B, Hk, T, D, kdt)
    cos, sin = make_tables(draw, lead, T, R, tdt)
    dim = draw(st.sampled_from([1, 2]))
    return dict(q=q, k=k, cos=cos, sin=sin, sections=sections, pairing=pairing, R=R, dim=dim)


def _as_layout(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if dim == 1 else x.transpose(1, 2)


# ----------------------------------------------------------------------------- properties


@SETTINGS
@given(rope_problems())
def test_apply_rotary_pos_emb_matches_fp64_reference(p):
    q, k, cos, sin, dim = p["q"], p["k"], p["cos"], p["sin"], p["dim"]
    before = [t.clone() for t in (q, k, cos, sin)]
    qo, ko = pt.apply_rotary_pos_emb(_as_layout(q, dim), _as_layout(k, dim), cos, sin,
                                     unsqueeze_dim=dim, pairing=p["pairing"])
    for got, x in ((qo, q), (ko, k)):
        assert_close_to_reference(_as_layout(got, dim), x, cos, sin, p["pairing"],
                                  torch.result_type(x, cos), p["R"])
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, cos, sin), strict=True))


@SETTINGS
@given(rope_problems(mrope=True))
def test_apply_multimodal_rotary_pos_emb_matches_fp64_reference(p):
    q, k, cos, sin, dim = p["q"], p["k"], p["cos"], p["sin"], p["dim"]
    qo, ko = pt.apply_multimodal_rotary_pos_emb(_as_layout(q, dim), _as_layout(k, dim), cos,
                                                sin, p["sections"], unsqueeze_dim=dim)
    axes = slot_axes(p["R"] // 2, p["sections"], False)
    mc, ms = merge_tables(cos, axes, "half"), merge_tables(sin, axes, "half")
    for got, x in ((qo, q), (ko, k)):
        assert_close_to_reference(_as_layout(got, dim), x, mc, ms, "half",
                                  torch.result_type(x, cos), p["R"])


@SETTINGS
@given(st.data())
def test_interleaved_mrope_op_matches_fp64_reference(data):
    """Qwen3-VL slot order through the op (the public 4.x function has no interleaving)."""
    B, T, D = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 4)), 2 * data.draw(
        st.integers(2, 10))
    half = data.draw(st.integers(1, D // 2))
    a = data.draw(st.integers(0, half))
    b = data.draw(st.integers(0, half - a))
    sections, pairing = [a, b, half - a - b], data.draw(st.sampled_from(["half", "adjacent"]))
    dtype = data.draw(st.sampled_from(DTYPES))
    q, k = make_qk(data.draw, B, 3, T, D, dtype), make_qk(data.draw, B, 1, T, D, dtype)
    cos, sin = make_tables(data.draw, (3, data.draw(st.sampled_from([1, B]))), T, 2 * half,
                           dtype)
    code = 0 if pairing == "half" else 1
    qo, ko = torch.ops.posenc.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, sections,
                                   True, code, False)
    axes = slot_axes(half, sections, True)
    mc, ms = merge_tables(cos, axes, pairing), merge_tables(sin, axes, pairing)
    for got, x in ((qo, q), (ko, k)):
        assert_close_to_reference(got.transpose(1, 2), x, mc, ms, pairing, dtype, 2 * half)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(rope_problems())
def test_fp64_gradients_match_the_reference(p):
    q, k, cos, sin = (t.double().detach().requires_grad_() for t in
                      (p["q"], p["k"], p["cos"], p["sin"]))
    gq, gk = torch.randn(q.shape, dtype=torch.float64), torch.randn(k.shape, dtype=torch.float64)
    qo, ko = pt.apply_rotary_pos_emb(q, k, cos, sin, pairing=p["pairing"])
    mine = torch.autograd.grad((qo * gq).sum() + (ko * gk).sum(), (q, k, cos, sin))
    rq, _ = reference(q, cos, sin, p["pairing"])
    rk, _ = reference(k, cos, sin, p["pairing"])
    ref = torch.autograd.grad((rq * gq).sum() + (rk * gk).sum(), (q, k, cos, sin))
    for name, a, b in zip(("q", "k", "cos", "sin"), mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
