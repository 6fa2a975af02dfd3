"""posenc's references (``posenc_torch/hf/verify/_references.py``) against the posenc ops that the
patch runs in their place (``_rotary.rotate_as`` and the vision / multimodal functions).

``patch()`` replaces a transformers function when its captured graph is a reference's
graph (test_hf_decisions.py); this file holds the other half of the argument: each
reference computes what posenc computes for it, on the inputs the replacement takes
(``_rotary._fits``: the form's table widths, tables shared over the batch or per row,
head sizes, one token and many, grouped heads, every dtype pair of
``_rotary.DTYPES``):

* fp32 results: the same bits; gradients of q, k, cos and sin to fp32 rounding;
* bf16 / fp16: element by element, posenc's value is the reference's, or at least as close
  as the reference's to the reference evaluated in fp64, up to twice the fp32 rounding of
  the terms (posenc rounds the fp32 result once, plain torch after each op);
* the result dtypes and shapes are the reference's.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from posenc_torch.hf import _rotary
from posenc_torch.hf._rotary import DTYPES, FORMS_BY_NAME, SECTIONS_FORM, TEXT_FORMS, VISION_FORM
from posenc_torch.hf.verify._references import REFERENCES

pytestmark = pytest.mark.any_transformers
_FP32_SLACK = 2.0 ** -22


def _tables(gen, shape, dtype):
    angle = torch.rand(shape, generator=gen, dtype=torch.float64) * 6
    return angle.cos().to(dtype), (angle * 1.3 + 0.4).sin().to(dtype)


def _widths(form, dim: int) -> list[int]:
    if form.layout == "partial":
        return sorted({w for w in (dim, dim * 3 // 4, dim // 2, dim // 4, 2) if w % 2 == 0})
    if form.layout == "half":
        return [dim // 2]
    return [dim]


SHAPES = [  # batch, q heads, k heads, tokens, head size, scale of q and k
    (2, 4, 2, 5, 16, 1.0), (1, 2, 2, 1, 64, 1.0), (1, 2, 1, 300, 64, 1.0),
    (3, 2, 2, 3, 128, 40.0), (1, 3, 1, 2, 256, 1.0), (2, 1, 1, 4, 4, 1.0)]


def _cases(form):
    gen = torch.Generator().manual_seed(7)
    for (batch, heads, kv_heads, seq, dim, scale), (qd, td), shared in itertools.product(
            SHAPES, DTYPES, (True, False)):
        if form.permute == "input" and dim < 4:
            continue
        for width in _widths(form, dim):
            q = (torch.randn(batch, seq, heads, dim, generator=gen, dtype=torch.float64)
                 * scale).to(qd).transpose(1, 2)
            k = (torch.randn(batch, seq, kv_heads, dim, generator=gen, dtype=torch.float64)
                 * scale).to(qd).transpose(1, 2)
            cos, sin = _tables(gen, (1 if shared else batch, seq, width), td)
            yield f"{qd}/{td} {tuple(q.shape)} width {width} shared {shared}", (q, k, cos, sin)


def _vision_cases():
    gen = torch.Generator().manual_seed(8)
    for (n, heads, dim, scale), (qd, td) in itertools.product(
            ((7, 4, 16, 1.0), (1, 2, 80, 1.0), (300, 1, 64, 1.0), (5, 2, 80, 40.0)), DTYPES):
        qkv = torch.randn(n, 3, heads, dim, generator=gen, dtype=torch.float64) * scale
        q, k = qkv.to(qd).permute(1, 0, 2, 3)[:2]
        cos, sin = _tables(gen, (n, dim), td)
        yield f"{qd}/{td} N={n} H={heads} D={dim}", (q, k, cos, sin)


def _sections_cases():
    gen = torch.Generator().manual_seed(9)
    for (batch, heads, seq, sections), (qd, td), shared in itertools.product(
            ((2, 4, 5, [2, 3, 3]), (1, 2, 1, [16, 24, 24]), (1, 2, 300, [4, 0, 4])), DTYPES,
            (True, False)):
        dim = 2 * sum(sections)
        q = torch.randn(batch, seq, heads, dim, generator=gen).to(qd).transpose(1, 2)
        k = torch.randn(batch, seq, 1, dim, generator=gen).to(qd).transpose(1, 2)
        cos, sin = _tables(gen, (3, 1 if shared else batch, seq, dim), td)
        yield f"{qd}/{td} {tuple(q.shape)} {sections}", (q, k, cos, sin, sections)


def _posenc(form, args):
    compute = _rotary._computation(form, REFERENCES[form.name], fallback=True)
    assert _rotary._fits(form, *args[:4]), "a case the replacement would not take"
    return compute(*args)


def _close_to_exact(ours, theirs, exact, slack) -> bool:
    ours, theirs, exact = ours.double(), theirs.double(), exact.double()
    return bool(((ours == theirs) | ((ours - exact).abs() <= (theirs - exact).abs() + slack))
                .all())


def _grads(outputs, inputs):
    gen = torch.Generator().manual_seed(3)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
               for o in outputs)
    return torch.autograd.grad(loss, inputs)


def _check(form, label, args, reference=None):
    reference = reference or REFERENCES[form.name]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    ours = _posenc(form, args)
    theirs = reference(*args)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), label
    if all(t.dtype == torch.float32 for t in tensors):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), label
        leaves = [t.detach().requires_grad_() for t in tensors]
        rest = args[len(leaves):]
        ours_g = _grads(_posenc(form, (*leaves, *rest)), leaves)
        leaves2 = [t.detach().requires_grad_() for t in tensors]
        theirs_g = _grads(reference(*leaves2, *rest), leaves2)
        for a, b in zip(ours_g, theirs_g, strict=True):  # sums in another order: to the scale
            torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-6 * max(1.0, b.abs().max()),
                                       msg=label)
        return
    exact = reference(*(t.double() for t in tensors), *args[len(tensors):])
    scale = 2 * max(t.abs().max().item() for t in tensors[:2]) * max(
        t.abs().max().item() for t in tensors[2:4])
    for a, b, e in zip(ours, theirs, exact, strict=True):
        assert _close_to_exact(a, b, e, _FP32_SLACK * scale), label


@pytest.mark.parametrize("form", TEXT_FORMS, ids=lambda f: f.name)
def test_text_forms_compute_what_posenc_computes(form):
    cases = list(_cases(form))
    assert cases
    for label, args in cases:
        _check(form, label, args)


def test_the_vision_form_computes_what_posenc_computes():
    for label, args in _vision_cases():
        _check(VISION_FORM, label, args)


def test_the_sections_form_computes_what_posenc_computes():
    for label, args in _sections_cases():
        _check(SECTIONS_FORM, label, args)


def test_a_wrong_posenc_path_would_be_found():
    """The comparison is not blind: posenc's half-pairing form against the adjacent
    reference (and the reverse) differs, in fp32 and in bf16."""
    half = FORMS_BY_NAME["half"]
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 2, 3, 8).to(dtype)
        cos, sin = _tables(torch.Generator().manual_seed(0), (1, 3, 8), dtype)
        args = (q, q.clone(), cos, sin)
        with pytest.raises(AssertionError):
            _check(half, "swapped", args, reference=REFERENCES["adjacent, partial"])


def test_every_form_has_one_reference():
    assert REFERENCES.keys() == FORMS_BY_NAME.keys()
