"""MRoPE apply: the transformers 4.x table form and the fused positions-in path.

Part "apply" (runs under transformers 4.57.6): ``apply_multimodal_rotary_pos_emb(q, k, cos,
sin, mrope_section)`` with (3, B, T, D) cos/sin tables made by 4.57.6's own
``Qwen2VLRotaryEmbedding``; HF reference = 4.57.6's function (removed from transformers 5.x).
Qwen2-VL-7B shapes (28 q heads, 4 kv heads, head_dim 128, sections [16, 24, 24]; the same as
Qwen2.5-VL-7B's), sequence sweep plus a decode step.

Part "fused" (transformers 5.x): posenc_torch ``apply_rope`` (positions in) against the
model's 5.x rotary module + ``apply_rotary_pos_emb``, eager and compiled, for Qwen2-VL-7B and
Qwen3-VL-8B (interleaved).  Inputs and methods are those of bench_rotary_step.py.

Why two processes: transformers 4.57.6 is an overlay (.venv/hf4) that must come first on
PYTHONPATH.  Loading one of its module files into a process that already imported 5.x would
resolve that file's own ``transformers.*`` imports to 5.x, a mixture neither version is.  So
run.py starts each part in its own interpreter, with the overlay on PYTHONPATH for "apply"
only (the same way ``make test`` runs the transformers-4 tests), and each part checks which
major version it got.

Run alone: ``python benchmarks/bench_mrope.py [--full]`` (goes through run.py).
"""

from __future__ import annotations

import sys

import torch

import bench_rotary_step as step
import harness as H

TOPIC = "mrope"
PARTS = {"apply": 4, "fused": 5}

APPLY_METHODS = ("posenc", "hf_eager", "hf_compile", "liger", *H.FLOORS)
FUSED_METHODS = ("posenc_fused", "hf_eager", "hf_compile", "liger",
                 *H.FLOORS)
_QWEN2, _QWEN3 = "Qwen2-VL-7B", "Qwen3-VL-8B"
APPLY_PLAN = {
    "quick": [H.Sweep(_QWEN2, 1, (4096,)), H.decode(_QWEN2, ("bf16",))],
    "full": [H.Sweep(_QWEN2, 1, H.SEQ_FULL), H.decode(_QWEN2)],
    "smoke": [H.Sweep(_QWEN2, 1, (64,), ("fp32",))],
}
FUSED_PLAN = {
    "quick": [H.Sweep(_QWEN2, 1, (4096,)), H.Sweep(_QWEN2, 1, (8192,), ("bf16",), ("fwd", "fwdbwd"))],
    "full": [H.Sweep(_QWEN2, 1, H.SEQ_FULL), H.Sweep(_QWEN3, 1, H.SEQ_FULL)],
    "smoke": [H.Sweep(_QWEN2, 1, (64,), ("fp32",))],
}


def _apply_groups(opts: H.Options):
    return [g[1:] for g in H.expand(APPLY_PLAN[opts.suite], opts.seqs)]


def _fused_groups(opts: H.Options):
    return [g[1:] for g in H.expand(FUSED_PLAN[opts.suite], opts.seqs)]


def plan(opts: H.Options):
    if opts.part == "apply":
        return [(step.make_case(opts, TOPIC, "mrope", m, b, t, dt, mode), APPLY_METHODS)
                for m, b, t, dt, modes in _apply_groups(opts) for mode in modes]
    if opts.part == "fused":
        return [(step.make_case(opts, TOPIC, "mrope_fused", m, b, t, dt, mode), FUSED_METHODS)
                for m, b, t, dt, modes in _fused_groups(opts) for mode in modes]
    raise ValueError(f"unknown part {opts.part!r}; parts: {sorted(PARTS)}")


def require_transformers(major: int) -> str:
    import transformers

    found = int(transformers.__version__.split(".")[0])
    if found != major:
        raise SystemExit(
            f"bench_mrope part needs transformers {major}.x, found {transformers.__version__}; "
            f"run it through benchmarks/run.py (it puts .venv/hf4 on PYTHONPATH for 4.x)")
    return transformers.__version__


def run_apply(opts: H.Options, rep: H.Reporter, topic: str = TOPIC, op: str = "mrope",
              groups=None, methods=APPLY_METHODS, variant: str = "") -> None:
    """The "apply" cases (``groups``: the suite's by default) with ``methods``, reported as
    ``topic``/``op`` (bench_floor.py runs them too, with the floors only)."""
    hf_version = require_transformers(4)
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m4
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig

    import posenc_torch

    for model_name, b, t, dtype_name, modes in groups or _apply_groups(opts):
        model = H.MODELS[model_name]
        dtype = H.DTYPES[dtype_name]
        section = list(model.mrope_section)
        cfg = Qwen2VLTextConfig(hidden_size=model.heads * model.head_dim,
                                num_attention_heads=model.heads,
                                num_key_value_heads=model.kv_heads,
                                max_position_embeddings=131072, rope_theta=model.rope_theta,
                                rope_scaling={"type": "mrope", "mrope_section": section})
        rotary = m4.Qwen2VLRotaryEmbedding(cfg).to(opts.device)
        torch.manual_seed(0)
        q, k, x, pos = step.step_inputs(model, b, t, dtype, opts.device)
        cos, sin = rotary(x, pos)  # (3, B, T, D) in q's dtype, as 4.57.6 makes them
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        hf = m4.apply_multimodal_rotary_pos_emb
        with torch.no_grad():
            ref_fwd = hf(q, k, cos, sin, section)
        ref_grad = (torch.autograd.grad(hf(q, k, cos, sin, section), (q, k), (gq, gk))
                    if set(modes) - {"fwd"} else None)
        common = {"wrt": (q, k), "grad_outputs": (gq, gk)}

        def build(name, q=q, k=k, cos=cos, sin=sin, gq=gq, gk=gk, section=section, common=common):
            if name == "posenc":
                return H.Workload(lambda: posenc_torch.apply_multimodal_rotary_pos_emb(
                    q, k, cos, sin, section), **common)
            if name == "hf_eager":
                return H.Workload(lambda: hf(q, k, cos, sin, section), **common)
            if name == "hf_compile":
                fn = H.compile_fn(hf, fullgraph=True)
                return H.Workload(lambda: fn(q, k, cos, sin, section), compiled=True, **common)
            if name == "liger":
                from liger_kernel.transformers.qwen2vl_mrope import (
                    liger_multimodal_rotary_pos_emb,
                )
                lq, lk = H.inplace_copies(q, k)
                return H.Workload(lambda: liger_multimodal_rotary_pos_emb(
                    lq, lk, cos, sin, section), wrt=(lq, lk), grad_outputs=(gq, gk))
            if name in H.FLOORS:
                return H.floor_workload(name, (q, k), (gq, gk))
            raise KeyError(name)

        floor = H.floor_bytes(q, k)
        for mode in modes:
            case = step.make_case(opts, topic, op, model_name, b, t, dtype_name, mode, variant)
            results = H.run_case(case, methods, build,
                                 ref_fwd if mode == "fwd" else ref_grad, opts.policy,
                                 floor=floor * (2 if mode == "fwdbwd" else 1),
                                 transformers_version=hf_version)
            for res in results:
                rep.add(res, f"{case.name} {res.method}")


def run(opts: H.Options, rep: H.Reporter) -> None:
    if opts.part == "apply":
        run_apply(opts, rep)
    elif opts.part == "fused":
        require_transformers(5)
        step.run_steps(opts, rep, TOPIC, "mrope_fused", _fused_groups(opts), FUSED_METHODS)
    else:
        raise ValueError(f"unknown part {opts.part!r}; parts: {sorted(PARTS)}")


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
