"""Per-call overhead: one decode step's rotation, where the Python and dispatch cost of a
call is larger than the work.

Case: Qwen2-VL-7B heads (28 q, 4 kv, head_dim 128), B=8, T=1, bf16, q/k transposed views of
the projections, (B, 1, 128) cos/sin tables as the 5.x rotary module gives them.  Two
variants, both forward only: "no grad" (``torch.no_grad()``, serving) and "grad recording"
(the projections require grad and autograd records the call, training; no backward timed).
Methods: the public ``apply_rotary_pos_emb``, the op alone (``torch.ops.posenc.rope`` on
q and k as they are, ``heads_first=True``, through the dispatcher and its autograd key),
transformers eager, and both copy floors.

This case is 2^15 elements, below the 2^17 at which the kernels start a parallel region
(csrc/cpu/internal.h, PE_SERIAL_ELEMENTS), so the call runs on the calling thread at any
thread count; the rows per thread count differ only by the machine's noise.

Run alone: ``python benchmarks/bench_overhead.py`` (goes through run.py).
"""

from __future__ import annotations

import sys

import torch

import harness as H

TOPIC = "overhead"
PARTS = {"decode": 5}

MODEL = "Qwen2-VL-7B"
METHOD_NAMES = ("posenc", "posenc_op", "hf_eager", *H.FLOORS)
VARIANTS = ("no grad", "grad recording")


def _case(opts: H.Options, variant: str) -> H.Case:
    return H.Case(TOPIC, "rope_call", MODEL, H.DECODE_BATCH, 1, "bf16", "fwd", opts.threads,
                  opts.device, variant)


def plan(opts: H.Options):
    return [(_case(opts, v), METHOD_NAMES) for v in VARIANTS]


def run(opts: H.Options, rep: H.Reporter) -> None:
    import transformers
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb as hf_apply

    import posenc_torch

    model = H.MODELS[MODEL]
    for variant in VARIANTS:
        grad = variant == "grad recording"
        torch.manual_seed(0)
        _, _, q, k = H.qk_as_hf(H.DECODE_BATCH, 1, model, torch.bfloat16, opts.device,
                                requires_grad=grad)
        angles = torch.rand(H.DECODE_BATCH, 1, model.head_dim // 2, device=opts.device) * 3000
        emb = torch.cat((angles, angles), -1)
        cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
        with torch.no_grad():
            ref = hf_apply(q, k, cos, sin)
        op = torch.ops.posenc.rope

        def timed(fn, grad=grad):
            def call():
                with torch.set_grad_enabled(grad):
                    return fn()
            return H.Workload(timed={"fwd": call})

        def build(name, q=q, k=k, cos=cos, sin=sin):
            if name == "posenc":
                return timed(lambda: posenc_torch.apply_rotary_pos_emb(q, k, cos, sin))
            if name == "posenc_op":
                return timed(lambda: op(q, k, cos, sin, [], False, 0, False, None, None, True))
            if name == "hf_eager":
                return timed(lambda: hf_apply(q, k, cos, sin))
            if name in H.FLOORS:
                return H.floor_workload(name, (q, k), ())
            raise KeyError(name)

        case = _case(opts, variant)
        for res in H.run_case(case, METHOD_NAMES, build, ref, opts.policy,
                              floor=H.floor_bytes(q, k),
                              transformers_version=transformers.__version__):
            rep.add(res, f"{case.name} {res.method}")


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
