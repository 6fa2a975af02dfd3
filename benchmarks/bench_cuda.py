"""GPU benchmark: the posenc CUDA kernels against transformers (eager and torch.compile) and
Liger-Kernel, as ratios to two memory floors measured in the same run.

    python benchmarks/bench_cuda.py [--suite quick|full|smoke] [--out DIR]

Cases (Qwen2-VL-7B text shapes: 28 q heads, 4 kv heads, head_dim 128; q and k are the
transposed views of the projection output that transformers passes; bf16 unless noted):

- ``rope``: ``apply_rotary_pos_emb`` with (1, T, 128) tables, T = 4096 and 32768, forward and
  backward.  Methods: transformers eager, ``torch.compile`` of it, Liger-Kernel (rotates in
  place), posenc.
- ``mrope``: the Qwen2-VL section form, T = 4096 and 32768.  posenc and Liger take the
  (3, 1, T, 128) per-axis tables (``apply_multimodal_rotary_pos_emb``); transformers 5.x
  merges the sections inside its rotary module, so its apply is the plain function on the
  merged (1, T, 128) tables (the same rotation; the merge is not timed).
- ``rotary_step``: positions in, rotated q and k out, T = 8192: transformers' own
  Qwen2VLRotaryEmbedding + apply (eager and compiled), Liger-Kernel on transformers' tables,
  posenc ``apply_rope`` (fused) and posenc tables + apply; forward and forward+backward.
- ``decode``: one decode step, B = 64, T = 1: posenc's fused call (also timed end to end in
  microseconds per call) against transformers.

Floors: ``clone`` of q and k (allocates like every method does) and ``copy_`` into
preallocated tensors (the bandwidth limit).  Timing: CUDA events around blocks of calls,
methods alternating round by round (benchmarks/harness.py), ratios paired per round.
Results: ``<out>/cuda-<suite>.json`` and ``<out>/plots-cuda-<suite>/*.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import harness as H

MODEL = "Qwen2-VL-7B"
PLAN = {
    "quick": {"rope": (4096, 32768), "mrope": (4096, 32768), "rotary_step": (8192,),
              "decode": (1,)},
    "full": {"rope": (1024, 4096, 16384, 32768), "mrope": (1024, 4096, 16384, 32768),
             "rotary_step": (4096, 8192, 32768), "decode": (1,)},
    "smoke": {"rope": (256,), "mrope": (256,), "rotary_step": (256,), "decode": (1,)},
}
MODES = {"rope": ("fwd", "bwd"), "mrope": ("fwd", "bwd"), "rotary_step": ("fwd", "fwdbwd"),
         "decode": ("fwd",)}
DECODE_BATCH = 64
FLOORS = ("copy", "copy_into")
LABELS = {"posenc": "posenc_torch", "posenc_fused": "posenc_torch apply_rope (fused)",
          "posenc_tables": "posenc_torch tables + apply", "hf_eager": "transformers eager",
          "hf_compile": "torch.compile(transformers)", "liger": "Liger-Kernel",
          "copy": "clone q,k (floor)", "copy_into": "copy_ into preallocated (floor)"}


def copy_into_workload(fwd_in, grads) -> H.Workload:
    """The bandwidth floor: ``copy_`` of the same tensors into preallocated ones."""
    dst_f = [torch.empty_like(t) for t in fwd_in]
    dst_g = [torch.empty_like(g) for g in grads]

    def fwd():
        with torch.no_grad():
            return tuple(d.copy_(s) for d, s in zip(dst_f, fwd_in))

    def bwd():
        return tuple(d.copy_(s) for d, s in zip(dst_g, grads))

    def fwdbwd():
        return (*fwd(), *bwd())

    return H.Workload(timed={"fwd": fwd, "bwd": bwd, "fwdbwd": fwdbwd}, verify=False)


def liger_available() -> str | None:
    """None when Liger-Kernel imports, else why not."""
    try:
        import liger_kernel  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return f"Liger-Kernel is not importable ({type(exc).__name__}: {exc})"
    return None


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


def _builder(op, model, q, k, gq, gk, device):
    """(build(name) -> Workload, reference function, method names) for one table case."""
    import posenc_torch

    section = list(model.mrope_section)
    common = {"wrt": (q, k), "grad_outputs": (gq, gk)}
    cos3, sin3, (cos, sin), hf_apply = _tables(model, q.shape[2], q.dtype, device)
    if op == "rope":
        cos3 = sin3 = None
        ours = lambda: posenc_torch.apply_rotary_pos_emb(q, k, cos, sin)  # noqa: E731
    else:
        ours = lambda: posenc_torch.apply_multimodal_rotary_pos_emb(  # noqa: E731
            q, k, cos3, sin3, section)

    def hf():
        return hf_apply(q, k, cos, sin)

    def build(name):
        if name == "posenc":
            return H.Workload(ours, **common)
        if name == "hf_eager":
            return H.Workload(hf, **common)
        if name == "hf_compile":
            fn = H.compile_fn(hf_apply, fullgraph=True)
            return H.Workload(lambda: fn(q, k, cos, sin), compiled=True, **common)
        if name == "liger":
            lq, lk = H.inplace_copies(q, k)
            if op == "rope":
                from liger_kernel.transformers.rope import liger_rotary_pos_emb
                return H.Workload(lambda: liger_rotary_pos_emb(lq, lk, cos, sin), wrt=(lq, lk),
                                  grad_outputs=(gq, gk))
            from liger_kernel.transformers.qwen2vl_mrope import liger_multimodal_rotary_pos_emb
            return H.Workload(lambda: liger_multimodal_rotary_pos_emb(lq, lk, cos3, sin3, section),
                              wrt=(lq, lk), grad_outputs=(gq, gk))
        if name == "copy":
            return H.copy_workload((q, k), (gq, gk))
        if name == "copy_into":
            return copy_into_workload((q, k), (gq, gk))
        raise KeyError(name)

    return build, hf, ("posenc", "hf_eager", "hf_compile", "liger", *FLOORS)


def _step_builder(model, b, t, dtype, device):
    import bench_rotary_step as step

    rotary, hf_apply = step.hf_rotary(model)
    rotary = rotary.to(device)
    q, k, x, pos = step.step_inputs(model, b, t, dtype, device)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    build_step, hf_step = step.step_builder(model, q, k, x, pos, gq, gk, rotary, hf_apply)

    def build(name):
        if name == "copy_into":
            return copy_into_workload((q, k), (gq, gk))
        return build_step(name)

    names = ("posenc_fused", "posenc_tables", "hf_eager", "hf_compile", "liger", *FLOORS)
    return build, (lambda: hf_step(q, k, x, pos)), names, (q, k, gq, gk)


def run_case(op: str, t: int, mode: str, build, ref_fn, names, floor_bytes: int,
             policy: H.TimingPolicy, wrt, grads) -> list[dict]:
    """Check every method against transformers' output, then time them together."""
    if mode == "fwd":
        with torch.no_grad():
            ref = ref_fn()
    else:
        ref = torch.autograd.grad(ref_fn(), wrt, grads)
    rows, ready = {}, {}
    for name in names:
        row = {"op": op, "model": MODEL, "seq": t, "mode": mode, "method": name,
               "label": LABELS[name], "status": "ok", "reason": None}
        rows[name] = row
        if name == "liger" and liger_available():
            row.update(status="skipped", reason=liger_available())
            continue
        try:
            work = build(name)
            fn = H.timed_callable(work, mode)
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            if work.verify:
                err = H.max_rel_err(out, ref)
                row["max_rel_err"] = err
                if not err <= H.VERIFY_TOL["bf16"]:
                    row.update(status="failed", reason=f"max rel err {err:.3g}; not timed")
                    continue
            for _ in range(policy.warmup):
                fn()
            ready[name] = fn
        except Exception as exc:  # noqa: BLE001 - a method that raises is reported, not fatal
            row.update(status="failed", reason=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    samples = H.measure_interleaved(ready, "cuda", policy) if ready else {}
    for name, xs in samples.items():
        row = rows[name]
        row.update(H.summarize(xs), samples=len(xs))
        row["gbps"] = floor_bytes / (row["median_ms"] * 1e-3) / 1e9
        for f in FLOORS:
            if f in samples:
                row[f"ratio_to_{f}"] = H.paired_ratio(xs, samples[f])
    return list(rows.values())


def decode_call_us(n: int = 2000) -> dict:
    """Wall-clock microseconds per fused decode call (B=64, T=1, Qwen2-VL-7B, bf16),
    launches included: host time of n back-to-back calls plus the final synchronize."""
    import bench_rotary_step as step
    import posenc_torch

    model = H.MODELS[MODEL]
    rotary, _ = step.hf_rotary(model)
    rotary = rotary.to("cuda")
    q, k, _, pos = step.step_inputs(model, DECODE_BATCH, 1, torch.bfloat16, "cuda")
    q, k = q.detach(), k.detach()
    section = list(model.mrope_section)
    with torch.no_grad():
        for _ in range(50):
            posenc_torch.apply_rope(q, k, pos, rotary.inv_freq, mrope_section=section)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            posenc_torch.apply_rope(q, k, pos, rotary.inv_freq, mrope_section=section)
        torch.cuda.synchronize()
    return {"op": "decode_call", "model": MODEL, "batch": DECODE_BATCH, "seq": 1,
            "us_per_call": (time.perf_counter() - t0) / n * 1e6, "calls": n}


def run(suite: str, out: Path) -> Path:
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda: no CUDA device (this benchmark times the CUDA kernels)")
    import posenc_torch

    if not posenc_torch._C.has_cuda():
        raise SystemExit("bench_cuda: posenc_torch was built without its CUDA kernels")
    H.configure_dynamo()
    policy = H.POLICIES[suite]
    model = H.MODELS[MODEL]
    rows: list[dict] = []
    for op, seqs in PLAN[suite].items():
        for t in seqs:
            torch.manual_seed(0)
            if op in ("rope", "mrope"):
                _, _, q, k = H.qk_as_hf(1, t, model, torch.bfloat16, "cuda")
                gq, gk = torch.randn_like(q), torch.randn_like(k)
                build, ref_fn, names = _builder(op, model, q, k, gq, gk, "cuda")
                wrt, grads, b = (q, k), (gq, gk), 1
            else:
                b = DECODE_BATCH if op == "decode" else 1
                build, ref_fn, names, (q, k, gq, gk) = _step_builder(
                    model, b, t, torch.bfloat16, "cuda")
                wrt, grads = (q, k), (gq, gk)
            floor = H.floor_bytes(q, k)
            for mode in MODES[op]:
                print(f"bench_cuda: {op} T={t} B={b} {mode}", file=sys.stderr, flush=True)
                for row in run_case(op, t, mode, build, ref_fn, names,
                                    floor * (2 if mode == "fwdbwd" else 1), policy, wrt, grads):
                    rows.append({**row, "batch": b, "dtype": "bf16"})
            del q, k, gq, gk, build
            torch.cuda.empty_cache()
    rows.append(decode_call_us())
    payload = {"suite": suite, "created": H.now_iso(), "machine": H.machine_info("cuda"),
               "versions": H.versions(), "results": rows}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cuda-{suite}.json"
    path.write_text(json.dumps(payload, indent=1))
    plot(payload, out / f"plots-cuda-{suite}")
    print(table(rows))
    return path


def table(rows: list[dict]) -> str:
    """Markdown: time / clone floor and / copy_ floor per case and method."""
    lines = ["| op | T | B | mode | method | ms | / clone | / copy_ | GB/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["op"] == "decode_call":
            lines.append(f"| decode call | 1 | {r['batch']} | fwd | posenc apply_rope, end to end "
                         f"| {r['us_per_call'] / 1e3:.4f} | | | |")
            continue
        if r["status"] != "ok":
            lines.append(f"| {r['op']} | {r['seq']} | {r['batch']} | {r['mode']} | {r['label']} | "
                         f"{r['status']}: {r['reason']} | | | |")
            continue
        lines.append(f"| {r['op']} | {r['seq']} | {r['batch']} | {r['mode']} | {r['label']} | "
                     f"{r['median_ms']:.4f} | {r.get('ratio_to_copy', float('nan')):.2f} | "
                     f"{r.get('ratio_to_copy_into', float('nan')):.2f} | {r['gbps']:.0f} |")
    return "\n".join(lines)


def plot(payload: dict, out: Path) -> None:
    """One bar chart per (op, mode): time / clone floor for each method and T."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_cuda: matplotlib not installed, no plots", file=sys.stderr)
        return
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in payload["results"] if r.get("status") == "ok"]
    for op, mode in sorted({(r["op"], r["mode"]) for r in ok}):
        rs = [r for r in ok if r["op"] == op and r["mode"] == mode]
        seqs = sorted({r["seq"] for r in rs})
        methods = [m for m in LABELS if any(r["method"] == m for r in rs)]
        fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(seqs) * len(methods) / 3, 3.6))
        width = 0.8 / max(len(methods), 1)
        for i, m in enumerate(methods):
            ys = [next((r.get("ratio_to_copy", float("nan")) for r in rs
                        if r["method"] == m and r["seq"] == t), float("nan")) for t in seqs]
            ax.bar([j + i * width for j in range(len(seqs))], ys, width, label=LABELS[m])
        ax.axhline(1.0, color="#555555", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(seqs))], [f"T={t}" for t in seqs])
        ax.set_ylabel("time / clone of q, k")
        ax.set_yscale("log")
        ax.set_title(f"{op} {H.MODE_LABEL[mode]}, {MODEL} bf16, "
                     f"{payload['machine'].get('gpu', 'GPU')}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{op}-{mode}.png", dpi=120)
        plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=tuple(PLAN), default="quick")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    print(run(args.suite, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
