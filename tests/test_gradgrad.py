"""Second derivatives: every differentiable op's backward is itself differentiable.

``posenc::rope``'s backward runs ``posenc::rope`` (transposed) and ``posenc::rope_table_grad``;
both carry autograd formulas, so double backward through q, k, cos and sin is exact.  Checked
with ``torch.autograd.gradgradcheck`` in fp64 on random (not rotation-like) tables, and the
issue's reproducer against transformers' eager function.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply

import posenc_torch as pt

F64 = torch.float64


def _leaves(*shapes, requires=None):
    requires = requires if requires is not None else (True,) * len(shapes)
    return [torch.randn(s, dtype=F64).requires_grad_(r) for s, r in zip(shapes, requires,
                                                                          strict=True)]


def _check(f, inputs):
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


# (name, q (B, Hq, T, D), k heads, table batch, rotary width, pairing)
ROPE_CASES = [
    ("plain-table-batch-B", (2, 3, 4, 8), 1, 2, 8, "half"),
    ("plain-table-batch-1", (2, 2, 3, 8), 2, 1, 8, "half"),
    ("partial-rotary", (1, 2, 5, 10), 1, 1, 6, "half"),
    ("adjacent", (2, 2, 3, 8), 1, 2, 8, "adjacent"),
    ("adjacent-partial-batch-1", (2, 1, 3, 10), 1, 1, 4, "adjacent"),
]


@pytest.mark.parametrize("name,qshape,hk,bc,rot,pairing", ROPE_CASES,
                         ids=[c[0] for c in ROPE_CASES])
def test_gradgradcheck_rope(name, qshape, hk, bc, rot, pairing):
    B, _, T, D = qshape
    inputs = _leaves(qshape, (B, hk, T, D), (bc, T, rot), (bc, T, rot))

    def f(q, k, cos, sin):
        return pt.apply_rotary_pos_emb(q, k, cos, sin, pairing=pairing)

    _check(f, inputs)


@pytest.mark.parametrize("requires", [r for r in itertools.product((False, True), repeat=4)
                                      if any(r)],
                         ids=lambda r: "+".join(n for n, x in zip("q k cos sin".split(), r) if x))
def test_gradgradcheck_every_requires_grad_combination(requires):
    inputs = _leaves((2, 2, 3, 6), (2, 1, 3, 6), (1, 3, 4), (1, 3, 4), requires=requires)
    _check(lambda q, k, c, s: pt.apply_rotary_pos_emb(q, k, c, s), inputs)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("bc", [1, 2], ids=["table-batch-1", "table-batch-B"])
def test_gradgradcheck_mrope_three_axis_tables(bc, unsqueeze_dim):
    """transformers 4.x form: (3, Bc, T, D) tables, contiguous sections."""
    T, D = 3, 12
    q_shape = (2, 2, T, D) if unsqueeze_dim == 1 else (2, T, 2, D)
    k_shape = (2, 1, T, D) if unsqueeze_dim == 1 else (2, T, 1, D)
    inputs = _leaves(q_shape, k_shape, (3, bc, T, D), (3, bc, T, D))

    def f(q, k, cos, sin):
        return pt.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 2, 2],
                                                  unsqueeze_dim=unsqueeze_dim)

    _check(f, inputs)


@pytest.mark.parametrize("interleaved", [False, True], ids=["sections", "interleaved"])
@pytest.mark.parametrize("pairing", [0, 1], ids=["half", "adjacent"])
def test_gradgradcheck_raw_op_mrope(interleaved, pairing):
    """The op itself in (B, T, H, D) with partial rotary, Qwen2-VL or Qwen3-VL slot order."""
    B, T, D, R = 2, 3, 14, 10  # 5 slots: [2, 2, 1]
    inputs = _leaves((B, T, 2, D), (B, T, 1, D), (3, 1, T, R), (3, 1, T, R))

    def f(q, k, cos, sin):
        return torch.ops.posenc.rope(q, k, cos, sin, [2, 2, 1], interleaved, pairing, False)

    _check(f, inputs)


def test_gradgradcheck_table_grad_op():
    """The table-gradient op on its own, in both argument orders the backward uses."""
    inputs = _leaves((2, 3, 2, 10), (2, 3, 1, 10), (2, 3, 2, 10), (2, 3, 1, 10))
    cos = torch.zeros(1, 3, 6, dtype=F64)

    def f(gq, gk, q, k):
        return torch.ops.posenc.rope_table_grad(gq, gk, q, k, cos, [], False, 0)

    _check(f, inputs)


def test_double_backward_reproducer_matches_transformers():
    """The gradient of cos's gradient reaches q (it was silently dropped before)."""
    def run(fn):
        torch.manual_seed(1)
        q, k, c, s = _leaves((1, 2, 3, 8), (1, 1, 3, 8), (1, 3, 8), (1, 3, 8))
        qo, _ = fn(q, k, c, s)
        (gc,) = torch.autograd.grad((qo ** 2).sum(), [c], create_graph=True)
        gc.sum().backward()
        return q.grad, k.grad, c.grad, s.grad

    mine, ref = run(pt.apply_rotary_pos_emb), run(hf_apply)
    assert mine[0] is not None
    for name, a, b in zip(("q", "k", "cos", "sin"), mine, ref, strict=True):
        if b is None:
            assert a is None or torch.count_nonzero(a) == 0, name
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("mrope", [False, True], ids=["rope", "mrope-interleaved"])
def test_gradgradcheck_fused(mrope):
    T = 4
    q, k = _leaves((2, 2, T, 8), (2, 1, T, 8))
    inv_freq = torch.tensor([1.0, 0.1], dtype=torch.float32)  # R = 4: partial rotary
    if mrope:
        pos = torch.randint(0, 50, (3, 1, T))
        kw = dict(mrope_section=[1, 1, 0], interleaved_mrope=True)
    else:
        pos = torch.randint(0, 50, (2, T))
        kw = {}
    _check(lambda q, k: pt.apply_rope(q, k, pos, inv_freq, **kw), [q, k])


def test_gradgradcheck_vision():
    q, k, cos, sin = _leaves((5, 2, 8), (5, 2, 8), (5, 8), (5, 8))
    # fp32 math (as transformers): check the fp64 derivatives at fp32 tolerance.
    f = pt.apply_rotary_pos_emb_vision
    kw = dict(eps=1e-3, atol=1e-3, rtol=1e-3)
    assert torch.autograd.gradcheck(f, (q, k, cos, sin), **kw)
    assert torch.autograd.gradgradcheck(f, (q, k, cos, sin), **kw)


def test_forward_mode_is_an_error_not_a_dropped_tangent():
    """Reverse-mode formulas only: forward AD and torch.func.jvp must raise, not return a
    zero tangent (they did before).  Reverse-mode transforms work (torch.func.grad raised
    before: torch.library's autograd does not support functorch)."""
    import torch.autograd.forward_ad as fwAD

    q, k, c, s = (t.detach() for t in _leaves((1, 2, 3, 8), (1, 1, 3, 8), (1, 3, 8), (1, 3, 8)))
    with fwAD.dual_level():
        qd = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="forward-mode"):
            pt.apply_rotary_pos_emb(qd, k, c, s)
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda x: pt.apply_rotary_pos_emb(x, k, c, s)[0], (q,),
                       (torch.randn_like(q),))
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda x: pt.apply_rope(x, k, torch.arange(3)[None],
                                               torch.rand(4))[0], (q,), (torch.randn_like(q),))
    def loss(fn, x, cos):
        return fn(x, k, cos, s)[0].square().sum()

    mine = torch.func.grad(lambda x, cos: loss(pt.apply_rotary_pos_emb, x, cos), (0, 1))(q, c)
    ref = torch.func.grad(lambda x, cos: loss(hf_apply, x, cos), (0, 1))(q, c)
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    pos, inv_freq = torch.arange(3)[None], torch.rand(4)
    fused = torch.func.grad(lambda x: pt.apply_rope(x, k, pos, inv_freq)[0].square().sum())(q)
    x = q.clone().requires_grad_()
    pt.apply_rope(x, k, pos, inv_freq)[0].square().sum().backward()
    torch.testing.assert_close(fused, x.grad, rtol=1e-12, atol=1e-12)
