"""The attention prologue of models that norm q and k per head before the rotary: per-head
RMSNorm of q and k, then ``apply_rotary_pos_emb``.

Methods: posenc_torch's fused ``apply_qk_norm_rope`` (one pass); transformers eager (the
model's norm modules, then its ``apply_rotary_pos_emb``); transformers' norm modules
followed by posenc_torch's ``apply_rotary_pos_emb`` (what a patched model runs without the
fused op); ``torch.compile`` of transformers' norm + rotary; and the clone and copy_ floors
of q and k.  Gradients are taken with respect to q, k and both norm weights.  Models:
Qwen3-VL-8B (32 q heads, 8 kv heads, head_dim 128, Llama-form norm), Qwen3-Next-80B-A3B
(the Qwen3.5 / Qwen3-Next attention: 16 / 2 / 256, rotary 64 of 256, (1 + w) norm) and
Gemma-3-12B (16 / 8 / 256, (1 + w) norm).  The forward+backward rows also carry the bytes
each method keeps for backward per q/k element (``saved_bytes_per_element``, measured with
``torch.autograd.graph.saved_tensors_hooks``: the distinct storages saved, q and k
included when a method saves them).

Run alone: ``python benchmarks/bench_qk_norm.py [--full]`` (goes through run.py).
"""

from __future__ import annotations

import sys

import torch

import harness as H

TOPIC = "qknorm"
PARTS = {"qknorm": 5}

METHOD_NAMES = ("posenc", "hf_norm_posenc_rotary", "hf_eager", "hf_compile", *H.FLOORS)
#: (transformers module, norm class, posenc norm form) per model; the rotary width where
#: it is partial.
NORMS = {
    "Qwen3-VL-8B": ("qwen3_vl", "Qwen3VLTextRMSNorm", "weight"),
    "Qwen3-Next-80B-A3B": ("qwen3_next", "Qwen3NextRMSNorm", "one_plus_weight"),
    "Gemma-3-12B": ("gemma3", "Gemma3RMSNorm", "one_plus_weight"),
}
ROTARY = {"Qwen3-Next-80B-A3B": 64}
_MODELS = ("Qwen3-VL-8B", "Qwen3-Next-80B-A3B", "Gemma-3-12B")
PLAN = {
    "quick": [H.Sweep("Qwen3-VL-8B", 1, (4096,)),
              H.Sweep("Qwen3-Next-80B-A3B", 1, (4096,), ("bf16",)),
              H.Sweep("Gemma-3-12B", 1, (4096,), ("bf16",))],
    "full": [H.Sweep(m, 1, (4096, 16384)) for m in _MODELS],
    "smoke": [H.Sweep("Qwen3-VL-8B", 1, (64,), ("fp32",))],
}


def _groups(opts: H.Options):
    return [g[1:] for g in H.expand(PLAN[opts.suite], opts.seqs)]


def make_case(opts, model, b, t, dtype, mode) -> H.Case:
    return H.Case(TOPIC, "qk_norm_rope", model, b, t, dtype, mode, opts.threads, opts.device)


def plan(opts: H.Options):
    return [(make_case(opts, m, b, t, dt, mode), METHOD_NAMES)
            for m, b, t, dt, modes in _groups(opts) for mode in modes]


def hf_parts(model: H.Model):
    """The model's norm class and ``apply_rotary_pos_emb`` from the installed transformers."""
    import importlib

    module, norm_cls, form = NORMS[model.name]
    m = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(m, norm_cls), m.apply_rotary_pos_emb, form


def run(opts: H.Options, rep: H.Reporter) -> None:
    import transformers

    import posenc_torch

    for model_name, b, t, dtype_name, modes in _groups(opts):
        model = H.MODELS[model_name]
        dtype = H.DTYPES[dtype_name]
        torch.manual_seed(0)
        norm_cls, hf_apply, form = hf_parts(model)
        qn = norm_cls(model.head_dim, 1e-6).to(opts.device, dtype)
        kn = norm_cls(model.head_dim, 1e-6).to(opts.device, dtype)
        with torch.no_grad():
            for n in (qn, kn):
                n.weight.copy_(torch.randn(model.head_dim) * 0.1 + (form == "weight"))
        _, _, q, k = H.qk_as_hf(b, t, model, dtype, opts.device)
        cos, sin = (x.to(opts.device) for x in H.rope_tables(model, t, dtype,
                                                              ROTARY.get(model.name)))
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        wrt = (q, k, qn.weight, kn.weight)

        def hf_step(q, k, cos, sin):
            return hf_apply(qn(q), kn(k), cos, sin)

        def methods():
            return {
                "posenc": lambda: posenc_torch.apply_qk_norm_rope(
                    q, k, cos, sin, qn.weight, kn.weight, 1e-6, norm=form),
                "hf_norm_posenc_rotary": lambda: posenc_torch.apply_rotary_pos_emb(
                    qn(q), kn(k), cos, sin),
                "hf_eager": lambda: hf_step(q, k, cos, sin),
            }

        eager = methods()

        def build(name: str) -> H.Workload:
            common = {"wrt": wrt, "grad_outputs": (gq, gk)}
            if name in eager:
                return H.Workload(eager[name], **common)
            if name == "hf_compile":
                fn = H.compile_fn(hf_step)
                return H.Workload(lambda: fn(q, k, cos, sin), compiled=True, **common)
            if name in H.FLOORS:
                return H.floor_workload(name, (q, k), (gq, gk))
            raise KeyError(name)

        with torch.no_grad():
            ref_fwd = hf_step(q, k, cos, sin)
        ref_grad = (torch.autograd.grad(hf_step(q, k, cos, sin), wrt, (gq, gk))
                    if set(modes) - {"fwd"} else None)
        floor = H.floor_bytes(q, k)
        elements = q.numel() + k.numel()
        for mode in modes:
            case = make_case(opts, model_name, b, t, dtype_name, mode)
            results = H.run_case(case, METHOD_NAMES, build,
                                 ref_fwd if mode == "fwd" else ref_grad, opts.policy,
                                 floor=floor * (2 if mode == "fwdbwd" else 1),
                                 transformers_version=transformers.__version__)
            for res in results:
                if mode == "fwdbwd" and res.status == "ok" and res.method in eager:
                    res.saved_bytes_per_element = H.saved_bytes(eager[res.method]) / elements
                rep.add(res, f"{case.name} {res.method}")


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
