"""The memory-floor check: posenc's CPU kernels against a copy of the same bytes, per SIMD
variant, with the cost of allocating outputs taken out.

Every posenc op allocates its outputs, and on a CPU a fresh block of tens of MiB is new pages
that fault on first touch (often several times the copy itself, and whether a block is fresh
or recycled moves with the allocator's state; README "Allocation cost on CPU").  The other
topics time posenc as users run it, allocator as it comes.  This topic asks what the kernels
themselves cost: its workers run with glibc's mmap threshold and top pad raised
(``WORKER_ENV``), so that freed blocks are reused and the outputs of every method, posenc's
and the clone floor's alike, are recycled memory; the copy_ floor (``copy_`` into tensors
allocated once) is then the bandwidth limit the kernels are held to.

Cases: Qwen2-VL-7B shapes (28 q heads, 4 kv heads, head_dim 128, sections [16, 24, 24]),
B = 1, T = 4096 and 8192, fp32 and bf16, forward and backward, for the 4.x table form
(``apply_multimodal_rotary_pos_emb`` with 4.57.6's own tables, the target) and the fused
``apply_rope`` (positions in, for information).  One part per kernel variant and form: each
worker forces its variant (``set_kernel_isa``) and records it as the case's variant; a
variant this CPU lacks is reported as skipped.  Outputs are checked against transformers as
in the other topics.  Besides the interleaved blocks of every topic, each method is timed
against copy_ in single calls back to back, ``pair_rounds`` rounds (harness.measure_pairs):
the median of those per-round ratios (``ratio_pair_copy_into``) cancels a memory bandwidth
that moves on a shared host, and is what the check reads.  run.py prints the check per
variant and thread count ("Floor check"), the blocks' ratio next to it.

Run alone: ``python benchmarks/bench_floor.py`` (goes through run.py).
"""

from __future__ import annotations

import dataclasses
import sys

import bench_mrope as mrope
import bench_rotary_step as step
import harness as H

TOPIC = "floor"
VARIANTS = ("avx512bf16", "avx512", "avx2")
PARTS = {f"{form}-{isa}": major for isa in VARIANTS
         for form, major in (("apply", 4), ("fused", 5))}
# Freed blocks stay in the process for reuse (glibc's tunables, read at start-up).
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TOP_PAD_": str(1 << 30)}
METHODS = {"apply": ("posenc", *H.FLOORS), "fused": ("posenc_fused", *H.FLOORS)}
OPS = {"apply": "mrope", "fused": "mrope_fused"}
_MODEL = "Qwen2-VL-7B"
PLAN = {
    "quick": [H.Sweep(_MODEL, 1, (4096, 8192), ("fp32", "bf16"), ("fwd", "bwd"))],
    "full": [H.Sweep(_MODEL, 1, (4096, 8192, 16384), ("fp32", "bf16"), ("fwd", "bwd"))],
    "smoke": [H.Sweep(_MODEL, 1, (64,), ("fp32",), ("fwd",))],
}


def _split(part: str) -> tuple[str, str]:
    form, _, isa = part.partition("-")
    if form not in METHODS or isa not in VARIANTS:
        raise ValueError(f"unknown part {part!r}; parts: {sorted(PARTS)}")
    return form, isa


def _groups(opts: H.Options):
    return [g[1:] for g in H.expand(PLAN[opts.suite], opts.seqs)]


def plan(opts: H.Options):
    form, isa = _split(opts.part)
    return [(step.make_case(opts, TOPIC, OPS[form], m, b, t, dt, mode, isa), METHODS[form])
            for m, b, t, dt, modes in _groups(opts) for mode in modes]


def _skip_all(opts: H.Options, rep: H.Reporter, reason: str) -> None:
    for case, methods in plan(opts):
        for m in methods:
            rep.add(H.Result.for_case(case, m, "skipped", reason=reason), f"{case.name} {m}")


def run(opts: H.Options, rep: H.Reporter) -> None:
    form, isa = _split(opts.part)
    opts = dataclasses.replace(opts, paired=True)  # single calls against copy_ too
    try:
        H.apply_isa(isa)
    except ValueError as exc:  # the CPU lacks this variant
        _skip_all(opts, rep, f"no {isa} kernels on this CPU ({exc})")
        return
    if form == "apply":
        mrope.run_apply(opts, rep, TOPIC, OPS[form], _groups(opts), METHODS[form], isa)
    else:
        mrope.require_transformers(5)
        step.run_steps(opts, rep, TOPIC, OPS[form], _groups(opts), METHODS[form], isa)


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
