"""Every instantiation of the CUDA kernels (csrc/cuda/rope.cu) and a call through the torch
ops that launches it, for tests/test_cuda.py (which checks, with torch's profiler, that each
one ran) and for ``scripts/gpu_check.sh sanitize`` (which runs them, and one 5,000-token
Qwen2-VL-7B case, under compute-sanitizer):

    python tests/cuda_variants.py [--shared-only]

``--shared-only`` keeps the kernels that use shared memory (the fused apply kernels and the
tables kernel), the only ones racecheck has anything to check in.  The calls use the ops of
posenc_torch, which the caller imports.  Kernel names are written as the profiler reports
them, without namespaces and spaces (``normalize``).  The apply
kernels' 64-bit-offset variants need a head stride past 2^31 elements: those calls view 2^31
elements and more of one allocation (4 GiB in bf16, 16 GiB in fp64), of which they read a
few rows.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator

import torch

WIDE = 2**31  # a head stride in elements that takes the 64-bit-offset kernels

STORAGE = {"Bf16": torch.bfloat16, "F16": torch.float16, "float": torch.float32,
           "double": torch.float64}
VECTOR = {"Bf16": 8, "F16": 8, "float": 4, "double": 2}


def normalize(name: str) -> str:
    """A kernel's demangled name as written here: no namespaces, spaces or parameters."""
    name = re.sub(r"\(anonymous namespace\)::|<unnamed>::|pe_cuda::|^void ", "", name.strip())
    name = name.split("(")[0]
    return name.replace(" ", "")


def apply_name(r: str, t: str, v: int, off: str, src: str) -> str:
    return normalize(f"rope_apply_kernel<{r}, {t}, {v}, {off}, {src}>")


def _qk(dq: torch.dtype, dk: torch.dtype, *, aligned: bool, wide: bool, T: int = 3, D: int = 64):
    """q (1, T, 2, D) and k (1, T, 1, D) in (B, T, H, D); misaligned: one element of storage
    offset; wide: q's head stride WIDE elements (one allocation of WIDE + a few rows)."""
    shift = 0 if aligned else 1
    if wide:
        base = torch.empty(WIDE + T * D + shift, dtype=dq, device="cuda")
        base[: T * D + shift].normal_()
        base[WIDE: WIDE + T * D + shift].normal_()
        q = base.as_strided((1, T, 2, D), (T * D, D, WIDE, 1), shift)
    else:
        q = torch.randn(1 * T * 2 * D + shift, device="cuda").to(dq)[shift:].view(1, T, 2, D)
    k = torch.randn(1 * T * 1 * D + shift, device="cuda").to(dk)[shift:].view(1, T, 1, D)
    return q, k


def _tables(dtype: torch.dtype, T: int = 3, R: int = 64):
    c = torch.randn(1, T, R, device="cuda").to(dtype)
    return c, torch.randn_like(c)


def _fused(q, k, R: int = 64):
    T = q.shape[1]
    pos = torch.arange(T, device="cuda")[None]
    inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, device="cuda", dtype=torch.float32) / R))
    return torch.ops.posenc.rope_fused(q, k, pos, inv, [], False, 1.0, 0, False)


def apply_calls() -> Iterator[tuple[str, Callable[[], object] | None, str]]:
    """(kernel, call, why not) for each apply instantiation (R, T, V, Off, S)."""
    for t, dt in STORAGE.items():
        r = "double" if t == "double" else "float"
        for v in (VECTOR[t], 1):
            for off in ("int", "long"):
                wide, aligned = off == "long", v > 1

                def tables(dt=dt, aligned=aligned, wide=wide):
                    q, k = _qk(dt, dt, aligned=aligned, wide=wide)
                    c, s = _tables(dt)
                    return torch.ops.posenc.rope(q, k, c, s, [], False, 0, False)

                def fused(dt=dt, aligned=aligned, wide=wide):
                    return _fused(*_qk(dt, dt, aligned=aligned, wide=wide))

                yield apply_name(r, t, v, off, f"Tables<{t}>"), tables, ""
                yield apply_name(r, t, v, off, "Positions"), fused, ""
    for off in ("int", "long"):
        wide = off == "long"

        def mixed_tables(wide=wide):  # bf16 q, k and fp32 tables: an fp32 result
            q, k = _qk(torch.bfloat16, torch.bfloat16, aligned=True, wide=wide)
            return torch.ops.posenc.rope(q, k, *_tables(torch.float32), [], False, 0, False)

        def mixed_fused(wide=wide):  # q bf16, k fp16
            return _fused(*_qk(torch.bfloat16, torch.float16, aligned=True, wide=wide))

        def f64_tables(wide=wide):  # fp16 q, k with fp64 tables: the fp64 core
            q, k = _qk(torch.float16, torch.float16, aligned=True, wide=wide)
            return torch.ops.posenc.rope(q, k, *_tables(torch.float64), [], False, 0, False)

        yield apply_name("float", "void", 1, off, "Tables<void>"), mixed_tables, ""
        yield apply_name("float", "void", 1, off, "Positions"), mixed_fused, ""
        yield apply_name("double", "void", 1, off, "Tables<void>"), f64_tables, ""
        yield (apply_name("double", "void", 1, off, "Positions"), None,
               "fp64 with mixed dtypes on the fused path: the C API only (the fused op's "
               "outputs keep each input's dtype)")


def table_grad_calls() -> Iterator[tuple[str, Callable[[], object] | None, str]]:
    """(kernel, call, why not) for each table-gradient instantiation (R, G, X)."""
    names = {torch.bfloat16: "Bf16", torch.float16: "F16", torch.float32: "float",
             torch.float64: "double"}
    for g in names:
        for x in names:
            for r in ("float", "double"):
                if r == "float" and torch.float64 in (g, x):
                    continue  # an fp64 operand makes the sums fp64: no such kernel
                table = torch.float64 if r == "double" else torch.float32

                def call(g=g, x=x, table=table):
                    q, k = _qk(x, x, aligned=True, wide=False)
                    gq, gk = torch.randn_like(q).to(g), torch.randn_like(k).to(g)
                    return torch.ops.posenc.rope_table_grad(gq, gk, q, k, _tables(table)[0], [],
                                                            False, 0)

                yield normalize(f"rope_table_grad_kernel<{r}, {names[g]}, {names[x]}>"), call, ""
    for r, (dq, dk), table in (("float", (torch.bfloat16, torch.float16), torch.float32),
                               ("double", (torch.float16, torch.float32), torch.float64)):
        def mixed(dq=dq, dk=dk, table=table):
            q, k = _qk(dq, dk, aligned=True, wide=False)
            gq, gk = torch.randn_like(q), torch.randn_like(k)
            return torch.ops.posenc.rope_table_grad(gq, gk, q, k, _tables(table)[0], [], False, 0)

        yield normalize(f"rope_table_grad_kernel<{r}, void, void>"), mixed, ""


def tables_calls() -> Iterator[tuple[str, Callable[[], object] | None, str]]:
    def call():
        pos = torch.arange(12, device="cuda").view(3, 1, 4)
        inv = torch.rand(32, device="cuda")
        return torch.ops.posenc.rope_tables(pos, inv, [16, 8, 8], False, 1.0, 0, torch.bfloat16)

    yield "rope_tables_kernel", call, ""


def every_variant(shared_only: bool = False):
    """(kernel, call, why not) for every kernel instantiation; call is None where no torch op
    can launch it (why not says so)."""
    for name, call, why in (*apply_calls(), *table_grad_calls(), *tables_calls()):
        if shared_only and not ("Positions" in name or name == "rope_tables_kernel"):
            continue
        yield name, call, why


def long_case(T: int = 5000) -> None:
    """Qwen2-VL-7B heads over T tokens in bf16, forward and backward: tables requiring grad
    (the table-gradient kernel), the (3, 1, T, 128) MRoPE tables, and the fused positions."""
    import posenc_torch as pt

    H, Hk, D = 28, 4, 128
    q = torch.randn(1, T, H * D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, Hk * D, device="cuda", dtype=torch.bfloat16)
    q = q.view(1, T, H, D).transpose(1, 2).requires_grad_(True)
    k = k.view(1, T, Hk, D).transpose(1, 2).requires_grad_(True)
    cos = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    sin = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    cos3 = torch.randn(3, 1, T, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    sin3 = torch.randn(3, 1, T, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    pos = torch.randint(0, 100000, (3, 1, T), device="cuda")
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    for out, wrt in ((pt.apply_rotary_pos_emb(q, k, cos, sin), (q, k, cos, sin)),
                     (pt.apply_multimodal_rotary_pos_emb(q, k, cos3, sin3, [16, 24, 24]),
                      (q, k, cos3, sin3)),
                     (pt.apply_rope(q, k, pos, inv, mrope_section=[16, 24, 24]), (q, k))):
        torch.autograd.grad(out, wrt, [torch.randn_like(o) for o in out])
    torch.cuda.synchronize()


def main(argv: list[str]) -> int:
    import posenc_torch  # noqa: F401  (registers torch.ops.posenc)

    shared_only = "--shared-only" in argv
    ran = skipped = 0
    for name, call, why in every_variant(shared_only):
        if call is None:
            print(f"not reachable from the torch ops: {name} ({why})")
            skipped += 1
            continue
        call()
        torch.cuda.synchronize()
        ran += 1
    long_case()
    print(f"cuda_variants: {ran} kernel instantiations launched once, {skipped} not reachable "
          "from the torch ops, and the 5,000-token case (forward, backward, table gradients)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
