"""posenc's MRoPE apply (or fused q/k norm + rotary) against copy_ of the same bytes,
per-round ratios, in either layout.

The floor topic of the suite (benchmarks/bench_floor.py) holds the kernels to copy_ in
transformers' layout, a token's heads adjacent in memory.  This script times that layout
and the other one, heads outer ((B, H, T, D) contiguous, as eager attention's query
gradient is), the same way: one call of posenc_torch.apply_multimodal_rotary_pos_emb
(forward under no_grad, or backward through autograd.grad) and one copy_ of q and k into
tensors allocated once, back to back (the order alternating), for `rounds` rounds
(harness.measure_pairs, as the floor topic); it
prints the median of the per-round ratios, the medians of both times and copy_'s GB/s.
Qwen2-VL-7B shapes (28 q heads, 4 kv heads, head_dim 128, sections [16, 24, 24]), B = 1,
cos and sin as 4.x passes them, (3, B, T, 128) in q's dtype.  With ``--op qk_norm``:
posenc_torch.apply_qk_norm_rope on Qwen3-VL-8B shapes (32 q heads, 8 kv heads, head_dim
128, the `weight` form), cos and sin (B, T, 128) and the weights in q's dtype; its backward
(``--mode bwd``) gives the gradients of q, k and both weights, and reads q, k and the two
output gradients, 1.5x copy_'s bytes.

Run with glibc's allocator keeping freed memory, as the floor topic's workers do, so that
no output is fresh pages:

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=1073741824 \\
        .venv/bin/python scripts/rope_pairs.py --seq 4096 --threads 1 --isa avx512bf16 \\
        --mode fwd --dtype bf16 --layout outer

Run it from outside the repository root (or with the wheel installed), so that the
installed package is imported rather than the source tree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

import posenc_torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import harness as H  # noqa: E402  (the floor topic's paired rounds: measure_pairs)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def inputs(t: int, dtype: torch.dtype, layout: str,
           heads: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """q (1, heads[0], t, 128) and k (1, heads[1], t, 128): views of (B, T, H, D)
    projections ("hf") or contiguous tensors ("outer")."""
    if layout == "hf":
        return tuple(torch.randn(1, t, h, 128, dtype=dtype).transpose(1, 2) for h in heads)
    return tuple(torch.randn(1, h, t, 128, dtype=dtype) for h in heads)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", default=None,
                    help="a kernel variant to force (posenc_torch.set_kernel_isa); default: "
                         "the best this CPU has")
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--layout", choices=("hf", "outer"), default="hf")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--op", choices=("mrope", "qk_norm"), default="mrope")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.isa:
        posenc_torch.set_kernel_isa(args.isa)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    q, k = inputs(args.seq, dtype, args.layout, (28, 4) if args.op == "mrope" else (32, 8))
    angle = torch.rand(3 if args.op == "mrope" else 1, 1, args.seq, 128) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    section = [16, 24, 24]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)

    if args.op == "qk_norm":
        cos, sin = cos[0], sin[0]
        q_weight, k_weight = torch.rand(128, dtype=dtype) + 0.5, torch.rand(128, dtype=dtype) + 0.5
        if args.mode == "fwd":
            def op() -> object:
                with torch.no_grad():
                    return posenc_torch.apply_qk_norm_rope(q, k, cos, sin, q_weight, k_weight,
                                                           1e-6)
        else:
            leaves = tuple(x.detach().requires_grad_() for x in (q, k, q_weight, k_weight))
            grads = torch.randn_like(q), torch.randn_like(k)
            outs = posenc_torch.apply_qk_norm_rope(leaves[0], leaves[1], cos, sin, leaves[2],
                                                   leaves[3], 1e-6)

            def op() -> object:
                return torch.autograd.grad(outs, leaves, grads, retain_graph=True)
    elif args.mode == "fwd":
        def op() -> object:
            with torch.no_grad():
                return posenc_torch.apply_multimodal_rotary_pos_emb(q, k, cos, sin, section)
    else:
        qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        oq, ok = posenc_torch.apply_multimodal_rotary_pos_emb(qg, kg, cos, sin, section)

        def op() -> object:
            return torch.autograd.grad((oq, ok), (qg, kg), (gq, gk), retain_graph=True)

    def copy() -> None:
        q_out.copy_(q)
        k_out.copy_(k)

    for _ in range(5):
        op()
        copy()
    rounds: list[tuple[float, float]] = []
    ratios = H.measure_pairs(op, copy, "cpu", args.rounds, rounds)
    t_op, copy_s = (statistics.median(t) for t in zip(*rounds, strict=True))
    gbps = 2 * (q.numel() + k.numel()) * q.element_size() / copy_s / 1e9
    print(f"{posenc_torch.kernel_isa()} {args.op} {args.layout} {args.dtype} {args.mode} "
          f"T={args.seq} threads={args.threads}: {statistics.median(ratios):.3f} x copy_ "
          f"(median of {args.rounds} paired rounds); op {t_op * 1e3:.3f} ms, copy_ "
          f"{copy_s * 1e3:.3f} ms ({gbps:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
