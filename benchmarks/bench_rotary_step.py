"""The whole rotary step of an attention block: position ids -> cos/sin -> rotated q, k.

transformers (5.x): the model's rotary module ``rotary_emb(x, position_ids)`` builds the
(B, T, D) cos/sin tables, then the model file's ``apply_rotary_pos_emb`` rotates q and k.
posenc_torch: ``compute_mrope_cos_sin`` + ``apply_rotary_pos_emb`` (same two steps, tables in
memory), and the fused ``apply_rope`` (positions in, no tables).  Models: Llama-3-8B (2-D
position ids), Qwen2-VL-7B (MRoPE sections) and Qwen3-VL-8B (interleaved MRoPE), plus a
decode step (B=8, T=1, forward only).

bench_mrope.py's "fused" part reuses this file's inputs and methods for the MRoPE models.

Run alone: ``python benchmarks/bench_rotary_step.py [--full]`` (goes through run.py).
"""

from __future__ import annotations

import math
import sys

import torch

import harness as H

TOPIC = "step"
PARTS = {"step": 5}

METHOD_NAMES = ("posenc_fused", "posenc_tables", "hf_eager", "hf_compile", "liger",
                *H.FLOORS)
_FWD_FWDBWD = ("fwd", "fwdbwd")
# Qwen2-VL-7B's step at T=4096 is also bench_mrope's "fused" part; quick does not repeat it.
PLAN = {
    "quick": [H.Sweep("Llama-3-8B", 1, (4096,), ("bf16",), _FWD_FWDBWD),
              H.Sweep("Qwen3-VL-8B", 1, (4096,), ("bf16",), _FWD_FWDBWD),
              H.decode("Qwen2-VL-7B", ("bf16",))],
    "full": [H.Sweep(m, 1, H.SEQ_FULL) for m in ("Llama-3-8B", "Qwen2-VL-7B", "Qwen3-VL-8B")]
    + [H.decode("Qwen2-VL-7B")],
    "smoke": [H.Sweep("Qwen3-VL-8B", 1, (64,), ("fp32",))],
}


def _groups(opts: H.Options):
    """(model, batch, seq, dtype, modes) of every input group."""
    return [g[1:] for g in H.expand(PLAN[opts.suite], opts.seqs)]


def make_case(opts, topic, op, model, b, t, dtype, mode, variant: str = "") -> H.Case:
    return H.Case(topic, op, model, b, t, dtype, mode, opts.threads, opts.device,
                  variant or ("decode" if t == 1 else ""))


def plan(opts: H.Options):
    return [(make_case(opts, TOPIC, "rotary_step", m, b, t, dt, mode), METHOD_NAMES)
            for m, b, t, dt, modes in _groups(opts) for mode in modes]


# ---------------------------------------------------------------------------------------
# Inputs.


def hf_rotary(model: H.Model):
    """The model's own transformers 5.x rotary module and apply function."""
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    common = {"hidden_size": model.heads * model.head_dim, "num_attention_heads": model.heads,
              "num_key_value_heads": model.kv_heads, "max_position_embeddings": 131072}
    if model.name.startswith("Llama"):
        from transformers import LlamaConfig
        from transformers.models.llama import modeling_llama as m
        cfg = LlamaConfig(head_dim=model.head_dim, rope_parameters=rope, **common)
        return m.LlamaRotaryEmbedding(cfg), m.apply_rotary_pos_emb
    rope["mrope_section"] = list(model.mrope_section)
    if model.interleaved:
        from transformers import Qwen3VLTextConfig
        from transformers.models.qwen3_vl import modeling_qwen3_vl as m
        rope["mrope_interleaved"] = True
        cfg = Qwen3VLTextConfig(head_dim=model.head_dim, rope_parameters=rope, **common)
        return m.Qwen3VLTextRotaryEmbedding(cfg), m.apply_rotary_pos_emb
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m
    cfg = Qwen2VLTextConfig(rope_parameters=rope, **common)
    return m.Qwen2VLRotaryEmbedding(cfg), m.apply_rotary_pos_emb


def mrope_positions(batch: int, seq: int, device: str = "cpu") -> torch.Tensor:
    """(3, B, T) position ids of a prompt "text, one image, text" (as get_rope_index gives).

    A quarter of the tokens is text, about half is one image whose merged grid is
    (1, gh, gw), the rest is text that continues at start + max(gh, gw).  A decode step
    (T=1) gets a position past such a prompt.
    """
    if seq == 1:
        return torch.full((3, batch, 1), 3000, dtype=torch.long, device=device)
    n0 = seq // 4
    gh = max(1, int(math.isqrt(seq // 2)))
    gw = max(1, (seq // 2) // gh)
    n_img = gh * gw
    n1 = seq - n0 - n_img
    text0 = torch.arange(n0).expand(3, -1)
    img = torch.stack([torch.zeros(n_img, dtype=torch.long),
                       torch.arange(gh).repeat_interleave(gw),
                       torch.arange(gw).repeat(gh)]) + n0
    text1 = torch.arange(n1).expand(3, -1) + n0 + max(gh, gw)
    pos = torch.cat([text0, img, text1], dim=1)
    return pos[:, None, :].expand(3, batch, seq).contiguous().to(device)


def step_inputs(model: H.Model, b: int, t: int, dtype, device: str):
    q_proj, _, q, k = H.qk_as_hf(b, t, model, dtype, device)
    if model.mrope_section is None:
        start = 3000 if t == 1 else 0
        pos = torch.arange(start, start + t, device=device)[None].expand(b, -1).contiguous()
    else:
        pos = mrope_positions(b, t, device)
    x = q_proj.detach()  # the rotary module reads only x's dtype and device
    return q, k, x, pos


def step_builder(model: H.Model, q, k, x, pos, gq, gk, rotary, hf_apply):
    """``build(name) -> Workload`` for the rotary-step methods."""
    import posenc_torch

    inv_freq = rotary.inv_freq
    scaling = float(rotary.attention_scaling)
    section = list(model.mrope_section) if model.mrope_section else None
    common = {"wrt": (q, k), "grad_outputs": (gq, gk)}

    def hf_step(q, k, x, pos):
        cos, sin = rotary(x, pos)
        return hf_apply(q, k, cos, sin)

    def build(name: str) -> H.Workload:
        if name == "posenc_fused":
            return H.Workload(lambda: posenc_torch.apply_rope(
                q, k, pos, inv_freq, mrope_section=section, interleaved_mrope=model.interleaved,
                attention_scaling=scaling), **common)
        if name == "posenc_tables":
            def tables():
                cos, sin = posenc_torch.compute_mrope_cos_sin(
                    pos, inv_freq, section, interleaved=model.interleaved,
                    attention_scaling=scaling, dtype=x.dtype)
                return posenc_torch.apply_rotary_pos_emb(q, k, cos, sin)
            return H.Workload(tables, **common)
        if name == "hf_eager":
            return H.Workload(lambda: hf_step(q, k, x, pos), **common)
        if name == "hf_compile":
            fn = H.compile_fn(hf_step)
            return H.Workload(lambda: fn(q, k, x, pos), compiled=True, **common)
        if name == "liger":
            from liger_kernel.transformers.rope import liger_rotary_pos_emb
            lq, lk = H.inplace_copies(q, k)

            def liger_step():
                cos, sin = rotary(x, pos)
                return liger_rotary_pos_emb(lq, lk, cos, sin)
            return H.Workload(liger_step, wrt=(lq, lk), grad_outputs=(gq, gk))
        if name in H.FLOORS:
            return H.floor_workload(name, (q, k), (gq, gk))
        raise KeyError(name)

    return build, hf_step


def run_steps(opts: H.Options, rep: H.Reporter, topic: str, op: str, groups, methods,
              variant: str = "") -> None:
    import transformers

    for model_name, b, t, dtype_name, modes in groups:
        model = H.MODELS[model_name]
        dtype = H.DTYPES[dtype_name]
        torch.manual_seed(0)
        rotary, hf_apply = hf_rotary(model)
        rotary = rotary.to(opts.device)
        q, k, x, pos = step_inputs(model, b, t, dtype, opts.device)
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        build, hf_step = step_builder(model, q, k, x, pos, gq, gk, rotary, hf_apply)
        with torch.no_grad():
            ref_fwd = hf_step(q, k, x, pos)
        ref_grad = (torch.autograd.grad(hf_step(q, k, x, pos), (q, k), (gq, gk))
                    if set(modes) - {"fwd"} else None)
        floor = H.floor_bytes(q, k)
        for mode in modes:
            case = make_case(opts, topic, op, model_name, b, t, dtype_name, mode, variant)
            results = H.run_case(case, methods, build, ref_fwd if mode == "fwd" else ref_grad,
                                 opts.policy, floor=floor * (2 if mode == "fwdbwd" else 1),
                                 transformers_version=transformers.__version__)
            for res in results:
                rep.add(res, f"{case.name} {res.method}")


def run(opts: H.Options, rep: H.Reporter) -> None:
    run_steps(opts, rep, TOPIC, "rotary_step", _groups(opts), METHOD_NAMES)


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
