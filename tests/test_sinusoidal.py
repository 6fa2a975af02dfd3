"""sinusoidal_position_encoding against transformers' DistilBERT create_sinusoidal_embeddings
(imported) and against the formula evaluated with Python's math module in float64."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import posenc_torch as P
from op_errors import raw_raises


def hf_table(n: int, dim: int) -> torch.Tensor:
    from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings
    out = torch.full((n, dim), math.nan)
    create_sinusoidal_embeddings(n, dim, out)
    return out


def formula64(n: int, dim: int, base: float) -> torch.Tensor:
    rows = []
    for p in range(n):
        row = []
        for j in range(dim):
            angle = p / base ** (2 * (j // 2) / dim)
            row.append(math.sin(angle) if j % 2 == 0 else math.cos(angle))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64).reshape(n, dim)


# even and odd widths; dim 1 is a single sine column in transformers too
HF_SHAPES = [(64, 16), (512, 128), (100, 768), (33, 7), (10, 1), (5, 5), (1, 4)]


def _check_hf_parity(n, dim):
    ours = P.sinusoidal_position_encoding(n, dim)
    hf = hf_table(n, dim)
    assert ours.shape == (n, dim) and ours.dtype == torch.float32
    assert torch.equal(ours, hf)


@pytest.mark.parametrize("n,dim", HF_SHAPES)
def test_matches_transformers(n, dim):
    _check_hf_parity(n, dim)


@pytest.mark.transformers4
@pytest.mark.parametrize("n,dim", HF_SHAPES)
def test_matches_transformers4(n, dim):
    _check_hf_parity(n, dim)


def test_empty_table():
    """No positions: an empty (0, dim) table (transformers' numpy code fails on n = 0)."""
    for dt in (torch.float32, torch.bfloat16):
        t = P.sinusoidal_position_encoding(0, 6, dtype=dt)
        assert t.shape == (0, 6) and t.dtype == dt


def test_worked_example():
    """d = 4, pos = 1: [sin 1, cos 1, sin 0.01, cos 0.01]."""
    table = P.sinusoidal_position_encoding(2, 4)
    torch.testing.assert_close(table[1], torch.tensor([0.841471, 0.540302, 0.00999983, 0.99995]),
                               rtol=0, atol=5e-7)
    exact = torch.tensor([math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)])
    assert torch.equal(table[1], exact)
    assert torch.equal(table[0], torch.tensor([0.0, 1.0, 0.0, 1.0]))


@pytest.mark.parametrize("base", [10000.0, 500.0, 1e6, 2])
@pytest.mark.parametrize("n,dim", [(40, 12), (17, 9)])
def test_formula_and_dtypes(n, dim, base):
    """float64 keeps the float64 value (Python's math.sin/cos, the same libm); float32 is it
    rounded once; bfloat16 / float16 are the float32 table cast."""
    ref = formula64(n, dim, float(base))
    f64 = P.sinusoidal_position_encoding(n, dim, base=base, dtype=torch.float64)
    f32 = P.sinusoidal_position_encoding(n, dim, base=base)
    assert torch.equal(f64, ref)
    assert torch.equal(f32, ref.float())
    for dt in (torch.bfloat16, torch.float16):
        t = P.sinusoidal_position_encoding(n, dim, base=base, dtype=dt)
        assert t.dtype == dt and torch.equal(t, f32.to(dt))


def test_threaded_equals_single_thread():
    # 1500 x 96 = 144000 values: past the kernels' serial threshold (2^17).
    many = P.sinusoidal_position_encoding(1500, 96)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = P.sinusoidal_position_encoding(1500, 96)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(many, one)
    assert torch.equal(many, hf_table(1500, 96))


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(num_positions=-1, dim=4), ValueError, "num_positions"),
    (dict(num_positions=2.0, dim=4), TypeError, "num_positions"),
    (dict(num_positions=True, dim=4), TypeError, "num_positions"),
    (dict(num_positions=3, dim=0), ValueError, "dim"),
    (dict(num_positions=3, dim=-2), ValueError, "dim"),
    (dict(num_positions=3, dim=torch.tensor(4)), TypeError, "dim"),
    (dict(num_positions=3, dim=4, base=0.0), ValueError, "base"),
    (dict(num_positions=3, dim=4, base=-10.0), ValueError, "base"),
    (dict(num_positions=3, dim=4, base=math.nan), ValueError, "base"),
    (dict(num_positions=3, dim=4, base=math.inf), ValueError, "base"),
    (dict(num_positions=3, dim=4, base="1e4"), TypeError, "base"),
    (dict(num_positions=3, dim=4, dtype=torch.int64), TypeError, "dtype"),
    (dict(num_positions=3, dim=4, dtype=torch.complex64), TypeError, "dtype"),
])
def test_bad_arguments(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        P.sinusoidal_position_encoding(**kwargs)


@pytest.mark.parametrize("args,kind,pattern", [
    ((-1, 4, 10000.0, torch.float32), ValueError, "^num_positions"),
    ((3, 0, 10000.0, torch.float32), ValueError, "^dim"),
    ((3, 4, -1.0, torch.float32), ValueError, "^base"),
    ((3, 4, math.nan, torch.float32), ValueError, "^base"),
    ((3, 4, 10000.0, torch.int32), TypeError, "^dtype"),
    ((1 << 62, 4, 10000.0, torch.float32), ValueError, "overflow"),
])
def test_op_rejects_bad_arguments(args, kind, pattern):
    """The op checks its arguments itself (it is callable without the Python wrapper); a
    raw op's message starts with the class of the error policy (README, "Errors")."""
    with raw_raises(kind, pattern):
        torch.ops.posenc.sinusoidal(*args)


@pytest.mark.parametrize("args", [(5, 6, 10000.0, torch.float32), (0, 3, 10.0, torch.float64),
                                  (9, 7, 1e4, torch.bfloat16)])
def test_opcheck(args):
    torch.library.opcheck(torch.ops.posenc.sinusoidal, args)


def test_compile_dynamic_lengths_no_recompiles():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def add_positions(x):
        return x + P.sinusoidal_position_encoding(x.shape[0], x.shape[1])

    compiled = torch.compile(add_positions, backend=counter, fullgraph=True, dynamic=True)
    for i, n in enumerate((5, 8, 13)):
        x = torch.randn(n, 6)
        stance = (torch.compiler.set_stance("fail_on_recompile") if i
                  else contextlib.nullcontext())
        with stance:
            got = compiled(x)
        assert torch.equal(got, add_positions(x))
        if i == 0:
            frames = counter.frame_count
    assert frames >= 1 and counter.frame_count == frames


def test_export():
    class AddPositions(torch.nn.Module):
        def forward(self, x):
            return x + P.sinusoidal_position_encoding(x.shape[0], x.shape[1], dtype=x.dtype)

    x = torch.randn(6, 8)
    ep = torch.export.export(AddPositions(), (x,),
                             dynamic_shapes=({0: torch.export.Dim("n", min=2, max=4096)},))
    assert "posenc.sinusoidal" in str(ep.graph)
    y = torch.randn(11, 8)
    assert torch.equal(ep.module()(y), AddPositions()(y))
