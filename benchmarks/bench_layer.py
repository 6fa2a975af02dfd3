"""A training step of one real decoder layer, with and without posenc_torch.hf.patch().

One Qwen2-VL-7B decoder layer (hidden 3584, 28 query heads, 4 kv heads, head_dim 128, MLP
18944; random weights), built from transformers' own ``Qwen2VLDecoderLayer`` class with a
config, batch 1: forward + backward (gradients of the input and of every weight), with
transformers' rotary function and with the posenc replacement, eagerly and with the layer
compiled.  The rotary call of the same layer is also timed alone (forward + backward, with
the q/k views, strides and cos/sin tables the layer passes), which gives the rotary share of
the step.  cos/sin come from the model's rotary module once, outside the step, as in the
model (it computes them once per forward for all layers).

Full suite only (T = 1024 and 2048, bf16 and fp32; on a GPU also T = 8192); the quick suite
has no cases of this topic.  On a CPU whose bf16 matmul is a slow fallback (no bf16 matrix
instructions) the bf16 cases are reported as skipped, with the measured rate and the
step time it implies.  ``python benchmarks/bench_layer.py --figure RESULTS.json``
draws the step times, speed-ups and rotary shares of a results file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import harness as H
import torch

TOPIC = "layer"
PARTS = {"layer": 5}
MODEL = "Qwen2-VL-7B"
# (hidden, heads, kv heads, MLP) of the layer; smoke (the harness's own test) shrinks it.
SHAPES = {"full": (3584, 28, 4, 18944), "quick": (3584, 28, 4, 18944), "smoke": (256, 2, 1, 512)}
PLAN = {
    "quick": [],
    "full": [H.Sweep(MODEL, 1, (1024, 2048), ("bf16", "fp32"), ("fwdbwd",))],
    "smoke": [H.Sweep(MODEL, 1, (16,), ("fp32",), ("fwdbwd",))],
}
GPU_SEQS = (8192,)
# op -> the methods timed: the layer step eager and compiled, and the rotary call alone.
OPS = {"layer_step": ("hf_eager", "posenc"), "layer_step_compiled": ("hf_compile", "posenc"),
       "layer_rotary": ("hf_eager", "posenc")}


def _groups(opts: H.Options):
    groups = [g[1:] for g in H.expand(PLAN[opts.suite], opts.seqs)]
    if opts.device == "cuda" and opts.suite == "full" and not opts.seqs:
        groups += [(MODEL, 1, t, dt, ("fwdbwd",)) for t in GPU_SEQS for dt in ("bf16", "fp32")]
    return groups


def _case(opts: H.Options, op: str, b: int, t: int, dtype: str) -> H.Case:
    return H.Case(TOPIC, op, MODEL, b, t, dtype, "fwdbwd", opts.threads, opts.device)


def plan(opts: H.Options):
    return [(_case(opts, op, b, t, dt), methods)
            for _, b, t, dt, _ in _groups(opts) for op, methods in OPS.items()]


# ---------------------------------------------------------------------------------------
# The layer and its inputs.


def build_layer(suite: str, dtype: torch.dtype, device: str):
    """(layer, modeling module, rotary module) of Qwen2-VL-7B's text decoder."""
    import transformers
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m

    hidden, heads, kv_heads, mlp = SHAPES[suite]
    model = H.MODELS[MODEL]
    rope = {"rope_type": "default", "rope_theta": model.rope_theta,
            "mrope_section": list(model.mrope_section)}
    common = dict(hidden_size=hidden, intermediate_size=mlp, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, num_hidden_layers=1,
                  max_position_embeddings=32768)
    if int(transformers.__version__.split(".")[0]) >= 5:
        config = transformers.Qwen2VLTextConfig(rope_parameters=rope, **common)
    else:
        config = transformers.Qwen2VLConfig(rope_scaling={"type": "mrope", **rope}, **common)
        config = config.get_text_config()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = m.Qwen2VLDecoderLayer(config, layer_idx=0).to(device=device, dtype=dtype).train()
    rotary = m.Qwen2VLRotaryEmbedding(config=config).to(device)
    return layer, m, rotary


def _layer_output(out):
    return out[0] if isinstance(out, tuple) else out


def _cpu_matmul_gflops(dtype: torch.dtype) -> float:
    """Rate of one (256 x 1024) @ (1024 x 1024) product in dtype on the CPU, after a
    warm-up call."""
    a, w = torch.randn(256, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
    a @ w
    t0 = time.perf_counter()
    a @ w
    return 2 * 256 * 1024 * 1024 / (time.perf_counter() - t0) / 1e9


def _too_slow(opts: H.Options, dtype_name: str, t: int) -> str | None:
    """Why a layer step in this dtype is not timed on this machine, or None.  CPUs without
    bf16 matrix instructions run torch's bf16 matmul through a slow fallback (measured at
    0.14 GFLOPS against 32 in fp32 on an AVX2 machine): a step would take hours."""
    if opts.device != "cpu" or dtype_name == "fp32" or opts.suite == "smoke":
        return None
    rate, fp32 = _cpu_matmul_gflops(H.DTYPES[dtype_name]), _cpu_matmul_gflops(torch.float32)
    if rate >= fp32 / 8:
        return None
    hidden, heads, kv_heads, mlp = SHAPES[opts.suite]
    head_dim = hidden // heads
    params = hidden * (2 * hidden + 2 * kv_heads * head_dim) + 3 * hidden * mlp
    step_min = 6 * params * t / (rate * 1e9) / 60
    return (f"{dtype_name} matmul on this CPU runs at {rate:.2g} GFLOPS (fp32: {fp32:.3g}); one "
            f"forward + backward of the layer would take about {step_min:.0f} min")


def run(opts: H.Options, rep: H.Reporter) -> None:
    for _, b, t, dtype_name, _ in _groups(opts):
        why = _too_slow(opts, dtype_name, t)
        if why:
            for op, methods in OPS.items():
                case = _case(opts, op, b, t, dtype_name)
                for method in methods:
                    rep.add(H.Result.for_case(case, method, "skipped", reason=why),
                            f"{case.name} {method}")
            continue
        _run_group(opts, rep, b, t, dtype_name)


def _run_group(opts: H.Options, rep: H.Reporter, b: int, t: int, dtype_name: str) -> None:
    """The three ops (layer step eager and compiled, rotary alone) of one (T, dtype)."""
    import transformers
    from bench_rotary_step import mrope_positions

    import posenc_torch.hf

    dtype = H.DTYPES[dtype_name]
    layer, m, rotary = build_layer(opts.suite, dtype, opts.device)
    handle = posenc_torch.hf.patch("qwen2_vl", count=False)
    name = next(tg.split(".", 1)[1] for tg in handle.targets if "vision" not in tg)
    posenc_fn, hf_fn = getattr(m, name), posenc_torch.hf.original_of(getattr(m, name))
    handle.undo()

    gen = torch.Generator().manual_seed(1)
    hidden_size = layer.self_attn.config.hidden_size
    x = torch.randn(b, t, hidden_size, generator=gen).to(opts.device, dtype).requires_grad_()
    grad_out = torch.randn(b, t, hidden_size, generator=gen).to(opts.device, dtype)
    pos = mrope_positions(b, t, opts.device)
    with torch.no_grad():
        cos, sin = rotary(x, pos)
        if name == "apply_multimodal_rotary_pos_emb" and cos.dim() == 3:
            cos, sin = cos.expand(3, -1, -1, -1), sin.expand(3, -1, -1, -1)
    kwargs = dict(position_embeddings=(cos, sin), position_ids=pos, use_cache=False)
    wrt = (x, *layer.parameters())

    def with_rotary(fn, call):
        """``call`` with the layer's attention calling ``fn`` as its rotary function."""
        def run_with():
            saved = getattr(m, name)
            setattr(m, name, fn)
            try:
                return call()
            finally:
                setattr(m, name, saved)
        return run_with

    def step(module):
        return lambda: (_layer_output(module(x, **kwargs)),)

    compiled = {}

    def build_step(method: str, compile_: bool) -> H.Workload:
        fn = posenc_fn if method == "posenc" else hf_fn
        module = compiled.setdefault(method, torch.compile(layer)) if compile_ else layer
        return H.Workload(with_rotary(fn, step(module)), wrt=wrt, grad_outputs=(grad_out,),
                          compiled=compile_)

    # The rotary call's own arguments, captured from one forward of the layer.
    seen = {}

    def capture(*args, **kw):
        seen.setdefault("call", (args, kw))
        return hf_fn(*args, **kw)

    with torch.no_grad():
        with_rotary(capture, step(layer))()
    (q, k, *rest), rot_kw = seen["call"]
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def build_rotary(method: str) -> H.Workload:
        fn = posenc_fn if method == "posenc" else hf_fn
        return H.Workload(lambda: fn(q, k, *rest, **rot_kw), wrt=(q, k), grad_outputs=(gq, gk))

    ref_step = torch.autograd.grad(with_rotary(hf_fn, step(layer))(), wrt, (grad_out,))
    ref_rot = torch.autograd.grad(hf_fn(q, k, *rest, **rot_kw), (q, k), (gq, gk))
    builders = {"layer_step": (lambda n: build_step(n, False), ref_step),
                "layer_step_compiled": (lambda n: build_step(n, True), ref_step),
                "layer_rotary": (build_rotary, ref_rot)}
    for op, methods in OPS.items():
        build, ref = builders[op]
        case = _case(opts, op, b, t, dtype_name)
        torch._dynamo.reset()
        compiled.clear()
        for res in H.run_case(case, methods, build, ref, opts.policy,
                              transformers_version=transformers.__version__):
            rep.add(res, f"{case.name} {res.method}")


# ---------------------------------------------------------------------------------------
# Summary and figure.


def summarize(results: list[dict]) -> list[dict]:
    """Per (device, threads, T, dtype): step times, step speed-ups (eager and compiled) and
    the rotary share of the eager step with transformers' function and with posenc's."""
    by_key: dict[tuple, dict[tuple[str, str], float]] = {}
    for r in results:
        if r.get("topic") != TOPIC or r.get("status") != "ok":
            continue
        key = (r["device"], r["threads"], r["seq"], r["dtype"])
        by_key.setdefault(key, {})[(r["op"], r["method"])] = r["median_ms"]
    rows = []
    for (device, threads, seq, dtype), ms in sorted(by_key.items()):
        row = {"device": device, "threads": threads, "seq": seq, "dtype": dtype}
        hf_step, pe_step = ms.get(("layer_step", "hf_eager")), ms.get(("layer_step", "posenc"))
        hf_comp = ms.get(("layer_step_compiled", "hf_compile"))
        pe_comp = ms.get(("layer_step_compiled", "posenc"))
        hf_rot, pe_rot = ms.get(("layer_rotary", "hf_eager")), ms.get(("layer_rotary", "posenc"))
        row.update(hf_step_ms=hf_step, posenc_step_ms=pe_step, hf_compiled_ms=hf_comp,
                   posenc_compiled_ms=pe_comp, hf_rotary_ms=hf_rot, posenc_rotary_ms=pe_rot)
        row["step_speedup"] = hf_step / pe_step if hf_step and pe_step else None
        row["compiled_speedup"] = hf_comp / pe_comp if hf_comp and pe_comp else None
        row["hf_rotary_share"] = hf_rot / hf_step if hf_rot and hf_step else None
        row["posenc_rotary_share"] = pe_rot / pe_step if pe_rot and pe_step else None
        rows.append(row)
    return rows


def format_summary(rows: list[dict]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [f"{MODEL} decoder layer, batch 1, forward + backward (ms; median)",
             f"{'dev':>4} {'thr':>3} {'T':>5} {'dtype':>5} | {'hf':>8} {'posenc':>8} {'x':>5} | "
             f"{'hf cmp':>8} {'pe cmp':>8} {'x':>5} | {'rot hf':>7} {'rot pe':>7} "
             f"{'share hf':>8} {'share pe':>8}"]
    for r in rows:
        lines.append(
            f"{r['device']:>4} {r['threads']:>3} {r['seq']:>5} {r['dtype']:>5} | "
            f"{f(r['hf_step_ms'], '8.1f')} {f(r['posenc_step_ms'], '8.1f')} "
            f"{f(r['step_speedup'], '5.3f')} | {f(r['hf_compiled_ms'], '8.1f')} "
            f"{f(r['posenc_compiled_ms'], '8.1f')} {f(r['compiled_speedup'], '5.3f')} | "
            f"{f(r['hf_rotary_ms'], '7.2f')} {f(r['posenc_rotary_ms'], '7.2f')} "
            f"{f(r['hf_rotary_share'] and 100 * r['hf_rotary_share'], '7.2f')}% "
            f"{f(r['posenc_rotary_share'] and 100 * r['posenc_rotary_share'], '7.2f')}%")
    return "\n".join(lines)


def figure(json_path: str) -> Path:
    """``layer-<name>.png`` beside the results file: step time per case (transformers vs
    posenc, eager and compiled) and the rotary share of the eager step."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(json_path)
    rows = summarize(json.loads(path.read_text())["results"])
    if not rows:
        raise SystemExit(f"{path} has no results of the {TOPIC!r} topic")
    labels = [f"{r['device']} {r['threads']}thr\nT={r['seq']} {r['dtype']}" for r in rows]
    xs = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(9, 2.4 * len(rows)), 4.2))
    bars = (("hf_step_ms", "transformers, eager", "#999999", -1.5),
            ("posenc_step_ms", "posenc, eager", "#1b6ca8", -0.5),
            ("hf_compiled_ms", "transformers, compiled", "#cccccc", 0.5),
            ("posenc_compiled_ms", "posenc, compiled", "#6aa9d8", 1.5))
    for key, label, color, off in bars:
        ax1.bar([x + 0.2 * off for x in xs], [r[key] or 0 for r in rows], 0.2, color=color,
                label=label)
    for x, r in zip(xs, rows, strict=True):
        for key, off in (("step_speedup", -1), ("compiled_speedup", 1)):
            if r[key]:
                top = max(r["hf_step_ms"] or 0, r["posenc_step_ms"] or 0) if off < 0 else \
                    max(r["hf_compiled_ms"] or 0, r["posenc_compiled_ms"] or 0)
                ax1.text(x + 0.2 * off, top, f"{r[key]:.3f}x", ha="center", va="bottom",
                         fontsize=7)
    ax1.set_xticks(list(xs), labels, fontsize=8)
    ax1.set_ylabel("ms per forward + backward")
    ax1.set_title(f"{MODEL} decoder layer step (speed-up above the bars)", fontsize=10)
    ax1.legend(fontsize=7)
    for key, label, color, off in (("hf_rotary_share", "transformers", "#999999", -0.5),
                                   ("posenc_rotary_share", "posenc", "#1b6ca8", 0.5)):
        vals = [100 * (r[key] or 0) for r in rows]
        ax2.bar([x + 0.35 * off for x in xs], vals, 0.35, color=color, label=label)
        for x, v in zip(xs, vals, strict=True):
            ax2.text(x + 0.35 * off, v, f"{v:.2f}%", ha="center", va="bottom", fontsize=7)
    ax2.set_xticks(list(xs), labels, fontsize=8)
    ax2.set_ylabel("% of the eager step")
    ax2.set_title("rotary call (forward + backward) share of the step", fontsize=10)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    out = path.with_name(f"layer-{path.stem}.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--figure":
        import json

        rows = summarize(json.loads(Path(sys.argv[2]).read_text())["results"])
        print(format_summary(rows))
        print(f"Figure: {figure(sys.argv[2])}")
        sys.exit(0)
    sys.exit(H.worker_main(sys.modules[__name__]))
