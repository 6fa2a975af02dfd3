"""Text RoPE apply (apply_rotary_pos_emb) and the vision tower's apply_rotary_pos_emb_vision.

Cases: Llama-3-8B (32 q heads, 8 kv heads, head_dim 128) over the sequence sweep, a decode
step (B=8, T=1, forward only), and the Qwen2-VL vision tower (16 heads, head_dim 80, q/k
unbound from the fused qkv projection).  cos/sin come from transformers' own rotary code in
the activation dtype (fp32 for the vision tower, as transformers does).

Run alone: ``python benchmarks/bench_rope.py [--full]`` (goes through run.py).
"""

from __future__ import annotations

import sys

import torch

import harness as H

TOPIC = "rope"
PARTS = {"apply": 5}  # part -> transformers major version it runs under

METHOD_NAMES = ("posenc", "hf_eager", "hf_compile", "liger", *H.FLOORS)
_TEXT, _VISION = "Llama-3-8B", "Qwen2-VL-ViT"
PLAN = {
    "quick": [H.Sweep(_TEXT, 1, (4096,), op="rope"),
              H.decode(_TEXT, ("bf16",), op="rope"),
              H.Sweep(_VISION, 1, (4096,), ("bf16",), op="rope_vision")],
    "full": [H.Sweep(_TEXT, 1, H.SEQ_FULL, op="rope"),
             H.decode(_TEXT, op="rope"),
             H.Sweep(_VISION, 1, (1024, 4096, 16384), op="rope_vision")],
    "smoke": [H.Sweep(_TEXT, 1, (64,), ("fp32",), op="rope"),
              H.Sweep(_VISION, 1, (64,), ("fp32",), op="rope_vision")],
}


def _groups(opts: H.Options):
    """(op, model, batch, seq, dtype, modes) of every input group of this part."""
    return H.expand(PLAN[opts.suite], opts.seqs)


def _case(opts, op, model, b, t, dtype, mode) -> H.Case:
    extra = "decode" if t == 1 else ""
    return H.Case(TOPIC, op, model, b, t, dtype, mode, opts.threads, opts.device, extra)


def plan(opts: H.Options):
    return [(_case(opts, op, m, b, t, dt, mode), METHOD_NAMES)
            for op, m, b, t, dt, modes in _groups(opts) for mode in modes]


# ---------------------------------------------------------------------------------------


def _text_inputs(model: H.Model, b: int, t: int, dtype, device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=model.heads * model.head_dim, num_attention_heads=model.heads,
                      num_key_value_heads=model.kv_heads, head_dim=model.head_dim,
                      max_position_embeddings=131072,
                      rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta})
    rotary = LlamaRotaryEmbedding(cfg).to(device)
    q_proj, k_proj, q, k = H.qk_as_hf(b, t, model, dtype, device)
    start = 4096 if t == 1 else 0  # a decode step sits somewhere past the prompt
    pos = torch.arange(start, start + t, device=device)[None].expand(b, -1)
    cos, sin = rotary(q_proj, pos)
    return q, k, cos, sin


def _vision_inputs(model: H.Model, n: int, dtype, device):
    """q, k as the Qwen2-VL vision attention makes them, cos/sin of a (1, h, w) patch grid."""
    d, heads = model.head_dim, model.heads
    qkv = torch.randn(n, 3 * heads * d).to(device, dtype).requires_grad_()
    q, k, _ = qkv.reshape(n, 3, heads, d).permute(1, 0, 2, 3).unbind(0)
    h = 2 ** (max(n.bit_length() - 1, 0) // 2)
    w = n // h
    rows = torch.arange(h).repeat_interleave(w)
    cols = torch.arange(w).repeat(h)
    pos = torch.stack([rows, cols], -1)[:n].to(device)
    quarter = d // 4
    inv_freq = 1.0 / (model.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float,
                                                        device=device) / (2 * quarter)))
    freqs = (pos[..., None].float() * inv_freq).flatten(1)  # (n, d/2): [row | col] angles
    emb = torch.cat((freqs, freqs), -1)
    return q, k, emb.cos(), emb.sin()


def _liger(op: str):
    if op == "rope":
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        return liger_rotary_pos_emb
    raise NotImplementedError("Liger-Kernel has no vision-tower (N, H, D) function to compare")


def run(opts: H.Options, rep: H.Reporter) -> None:
    import transformers
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        apply_rotary_pos_emb_vision as hf_vision,
    )

    import posenc_torch

    hf_version = transformers.__version__
    for op, model_name, b, t, dtype_name, modes in _groups(opts):
        model = H.MODELS[model_name]
        dtype = H.DTYPES[dtype_name]
        torch.manual_seed(0)
        if op == "rope":
            q, k, cos, sin = _text_inputs(model, b, t, dtype, opts.device)
            hf_fn, ours = hf_rope, posenc_torch.apply_rotary_pos_emb
        else:
            q, k, cos, sin = _vision_inputs(model, t, dtype, opts.device)
            hf_fn, ours = hf_vision, posenc_torch.apply_rotary_pos_emb_vision
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        floor = H.floor_bytes(q, k)
        with torch.no_grad():
            ref_fwd = hf_fn(q, k, cos, sin)
        ref_grad = (torch.autograd.grad(hf_fn(q, k, cos, sin), (q, k), (gq, gk))
                    if set(modes) - {"fwd"} else None)

        def build(name, q=q, k=k, cos=cos, sin=sin, gq=gq, gk=gk, hf_fn=hf_fn, ours=ours, op=op):
            common = {"wrt": (q, k), "grad_outputs": (gq, gk)}
            if name == "posenc":
                return H.Workload(lambda: ours(q, k, cos, sin), **common)
            if name == "hf_eager":
                return H.Workload(lambda: hf_fn(q, k, cos, sin), **common)
            if name == "hf_compile":
                fn = H.compile_fn(hf_fn, fullgraph=True)
                return H.Workload(lambda: fn(q, k, cos, sin), compiled=True, **common)
            if name == "liger":
                fn = _liger(op)
                lq, lk = H.inplace_copies(q, k)  # Liger rotates in place: its own q, k
                return H.Workload(lambda: fn(lq, lk, cos, sin), wrt=(lq, lk),
                                  grad_outputs=(gq, gk))
            if name in H.FLOORS:
                return H.floor_workload(name, (q, k), (gq, gk))
            raise KeyError(name)

        for mode in modes:
            case = _case(opts, op, model_name, b, t, dtype_name, mode)
            ref = ref_fwd if mode == "fwd" else ref_grad
            results = H.run_case(case, METHOD_NAMES, build, ref, opts.policy,
                                 floor=floor * (2 if mode == "fwdbwd" else 1),
                                 transformers_version=hf_version)
            for res in results:
                rep.add(res, f"{case.name} {res.method}")


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
