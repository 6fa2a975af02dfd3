"""GPU cases: the posenc CUDA kernels against the two memory floors (and, in the full suite,
transformers eager and torch.compile and Liger-Kernel), with each method's GPU time alone.

Run with ``python benchmarks/run.py --device cuda --topics gpu`` (scripts/gpu_check.sh bench
does); on a CPU run this topic is not selected.  Cases (Qwen2-VL-7B text shapes: 28 q heads,
4 kv heads, head_dim 128; q and k are the transposed views of the projection output that
transformers passes; bf16):

- ``rope``: ``apply_rotary_pos_emb`` with (1, T, 128) tables from transformers' rotary
  module, forward and backward.
- ``mrope``: the Qwen2-VL section form.  posenc and Liger take the (3, 1, T, 128) per-axis
  tables (``apply_multimodal_rotary_pos_emb``); transformers 5.x merges the sections inside
  its rotary module, so its apply is the plain function on the merged (1, T, 128) tables
  (the same rotation; the merge is not timed).
- ``rotary_step``: positions in, rotated q and k out: transformers' own rotary module +
  apply, Liger-Kernel on transformers' tables, posenc ``apply_rope`` (fused) and posenc
  tables + apply; forward and backward; also one decode step (B = 64, T = 1).

The quick suite (``bench``: a few minutes with the machine's start) has posenc and the two
floors at T = 4096 and 32768; the full suite adds the peers and more lengths.  Every method
is timed as the harness does (CUDA events around blocks of calls, methods alternating round
by round: the wall time of back-to-back calls, launches and Python included).  Beside it,
``kernel_ms`` is the GPU time of one call alone, forward or backward: the call captured in a
CUDA graph and the graph replayed (no Python, no dispatcher), L2 flushed before every replay
(a 256 MiB write: the tables and q/k come from memory, as in a model, not from the previous
replay's L2), for the methods that can be captured; a backward is the forward and backward
captured together less the forward.
"""

from __future__ import annotations

import sys

import torch

import harness as H

TOPIC = "gpu"
PARTS = {"cuda": 5}
DEVICES = ("cuda",)  # run.py selects this topic only for --device cuda

MODEL = "Qwen2-VL-7B"
DECODE_BATCH = 64
PEERS = ("hf_eager", "hf_compile", "liger")
TABLE_METHODS = ("posenc", *PEERS, *H.FLOORS)
STEP_METHODS = ("posenc_fused", "posenc_tables", *PEERS, *H.FLOORS)
PLAN = {
    "quick": {"rope": (4096, 32768), "mrope": (4096, 32768), "rotary_step": (4096, 32768)},
    "full": {"rope": (1024, 4096, 16384, 32768), "mrope": (1024, 4096, 16384, 32768),
             "rotary_step": (4096, 8192, 32768)},
    "smoke": {"rope": (256,), "mrope": (256,), "rotary_step": (256,)},
}
MODES = {"rope": ("fwd", "bwd"), "mrope": ("fwd", "bwd"), "rotary_step": ("fwd", "bwd")}
FLUSH_BYTES = 256 << 20  # over 4x the H200's 60 MB L2


def _methods(opts: H.Options, op: str) -> tuple[str, ...]:
    """The methods of a case: no peers in the quick suite."""
    methods = STEP_METHODS if op == "rotary_step" else TABLE_METHODS
    return tuple(m for m in methods if opts.suite == "full" or m not in PEERS)


def _groups(opts: H.Options):
    """(op, batch, seq, modes) of every input group, the decode step last."""
    for op, seqs in PLAN[opts.suite].items():
        for t in opts.seqs or seqs:
            yield op, 1, t, MODES[op]
    yield "rotary_step", DECODE_BATCH, 1, ("fwd",)


def _case(opts, op, b, t, mode) -> H.Case:
    return H.Case(TOPIC, op, MODEL, b, t, "bf16", mode, opts.threads, opts.device,
                  "decode" if t == 1 else "")


def plan(opts: H.Options):
    return [(_case(opts, op, b, t, mode), _methods(opts, op))
            for op, b, t, modes in _groups(opts) for mode in modes]


# ---------------------------------------------------------------------------------------


def _tables(model: H.Model, t: int, dtype, device):
    """Per-axis (3, 1, T, D) cos/sin at Qwen2-VL image positions, and transformers' own
    merged (1, T, D) tables from its rotary module for the same positions."""
    import bench_rotary_step as step
    import posenc_torch

    rotary, hf_apply = step.hf_rotary(model)
    rotary = rotary.to(device)
    pos = step.mrope_positions(1, t, device)
    x = torch.empty(1, t, 8, device=device, dtype=dtype)
    merged = rotary(x, pos)
    axes = [posenc_torch.compute_mrope_cos_sin(pos[a], rotary.inv_freq, dtype=dtype)
            for a in range(3)]
    cos3 = torch.stack([c for c, _ in axes])
    sin3 = torch.stack([s for _, s in axes])
    return cos3, sin3, merged, hf_apply


def _table_builder(op, model, q, k, gq, gk, device):
    """(build(name) -> Workload, transformers' function of the case) for rope and mrope."""
    import posenc_torch

    section = list(model.mrope_section)
    common = {"wrt": (q, k), "grad_outputs": (gq, gk)}
    cos3, sin3, (cos, sin), hf_apply = _tables(model, q.shape[2], q.dtype, device)

    def hf():
        return hf_apply(q, k, cos, sin)

    def build(name):
        if name == "posenc":
            if op == "rope":
                return H.Workload(lambda: posenc_torch.apply_rotary_pos_emb(q, k, cos, sin),
                                  **common)
            return H.Workload(lambda: posenc_torch.apply_multimodal_rotary_pos_emb(
                q, k, cos3, sin3, section), **common)
        if name == "hf_eager":
            return H.Workload(hf, **common)
        if name == "hf_compile":
            fn = H.compile_fn(hf_apply, fullgraph=True)
            return H.Workload(lambda: fn(q, k, cos, sin), compiled=True, **common)
        if name == "liger":
            lq, lk = H.inplace_copies(q, k)  # Liger rotates in place: its own q, k
            if op == "rope":
                from liger_kernel.transformers.rope import liger_rotary_pos_emb
                return H.Workload(lambda: liger_rotary_pos_emb(lq, lk, cos, sin), wrt=(lq, lk),
                                  grad_outputs=(gq, gk))
            from liger_kernel.transformers.qwen2vl_mrope import liger_multimodal_rotary_pos_emb
            return H.Workload(lambda: liger_multimodal_rotary_pos_emb(lq, lk, cos3, sin3, section),
                              wrt=(lq, lk), grad_outputs=(gq, gk))
        if name in H.FLOORS:
            return H.floor_workload(name, (q, k), (gq, gk))
        raise KeyError(name)

    return build, hf


def kernel_ms(fn, replays: int = 20, flush_bytes: int = FLUSH_BYTES) -> float | None:
    """GPU milliseconds of one call of ``fn`` (a forward under no grad, or a backward) alone:
    captured in a CUDA graph, replayed ``replays`` times, each replay after a write of
    ``flush_bytes`` (which evicts the L2) and timed between two events of its own.  None when
    the call cannot be captured (a compiled function, a host synchronization inside)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            fn()  # warm-up on the capturing stream, as torch.cuda.graphs advises
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device="cuda")
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(replays)]
        torch.cuda.synchronize()
        for start, end in events:
            flush.fill_(1)
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in events) / replays
    except Exception:  # noqa: BLE001 - not capturable: reported as None
        torch.cuda.synchronize()
        return None


def kernel_ms_of(work: H.Workload, mode: str) -> float | None:
    """kernel_ms of a method in ``mode``.  A backward captured alone would run on the
    forward's stream, outside the capture: it is the forward and backward captured together
    less the forward."""
    if mode == "bwd" and "bwd" not in work.timed:
        both = kernel_ms(H.timed_callable(work, "fwdbwd"))
        fwd = kernel_ms(H.timed_callable(work, "fwd"))
        return None if both is None or fwd is None else max(both - fwd, 0.0)
    return kernel_ms(H.timed_callable(work, mode))


def run(opts: H.Options, rep: H.Reporter) -> None:
    import transformers

    import bench_rotary_step as step

    hf_version = transformers.__version__
    model = H.MODELS[MODEL]
    for op, b, t, modes in _groups(opts):
        torch.manual_seed(0)
        if op == "rotary_step":
            rotary, hf_apply = step.hf_rotary(model)
            rotary = rotary.to(opts.device)
            q, k, x, pos = step.step_inputs(model, b, t, torch.bfloat16, opts.device)
            gq, gk = torch.randn_like(q), torch.randn_like(k)
            build, hf_step = step.step_builder(model, q, k, x, pos, gq, gk, rotary, hf_apply)
            ref_fn = lambda: hf_step(q, k, x, pos)  # noqa: E731
        else:
            _, _, q, k = H.qk_as_hf(b, t, model, torch.bfloat16, opts.device)
            gq, gk = torch.randn_like(q), torch.randn_like(k)
            build, ref_fn = _table_builder(op, model, q, k, gq, gk, opts.device)
        methods = _methods(opts, op)
        with torch.no_grad():
            ref_fwd = ref_fn()
        ref_grad = (torch.autograd.grad(ref_fn(), (q, k), (gq, gk))
                    if set(modes) - {"fwd"} else None)
        floor = H.floor_bytes(q, k)
        for mode in modes:
            case = _case(opts, op, b, t, mode)
            results = H.run_case(case, methods, build, ref_fwd if mode == "fwd" else ref_grad,
                                 opts.policy, floor=floor * (2 if mode == "fwdbwd" else 1),
                                 transformers_version=hf_version)
            for res in results:
                if res.status == "ok" and opts.device == "cuda":
                    work = build(res.method)
                    res.kernel_ms = kernel_ms_of(work, mode)
                rep.add(res, f"{case.name} {res.method}")
        del q, k, gq, gk, build, ref_fwd, ref_grad
        if opts.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
