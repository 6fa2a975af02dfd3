"""A patched Qwen3-VL attention's q/k norm + rotary (``posenc_torch.hf.patch()``), and a
training step of a model that runs it.

Part "prologue": transformers' own ``Qwen3VLTextAttention`` (Qwen3-VL-8B: 32 q heads,
8 kv heads, head_dim 128; hidden 4096) whose projections return fixed (B, T, H*D)
tensors (the leaves gradients are taken of) and whose attention function is a registered
stand-in returning q (as (B, T, H, D)) and k, so that what each method times is the path
from the projections' outputs to the rotated q and k the attention function receives, run
through the layer's ``forward``:

- ``posenc``: the forward ``patch()`` installs (the fused q/k norm + rotary op);
- ``posenc_unfused``: transformers' forward with ``patch(fuse_qk_norm=False)``'s rotary
  (transformers' norm modules, posenc's rotary: what a patched model ran before);
- ``hf_eager``: transformers' forward, unpatched;
- ``hf_compile``: ``torch.compile`` of the unpatched layer;
- the clone and copy_ floors of the projections' outputs.

The methods alternate within a case, so the patch state is switched per call by setting
the two attributes ``patch()`` sets (the attention class's ``forward``, the modeling
module's ``apply_rotary_pos_emb``) to the replacements taken from ``patch()`` handles, and
back.  The forward+backward rows carry the bytes each method keeps for backward per q/k
element (``saved_bytes_per_element``: distinct storages saved during the forward, the
projections' outputs included).

Part "step": one training step (forward + backward: gradients of the input embeddings and
every weight) of a one-layer Qwen3-VL text model as wide as Qwen3-VL-8B's attention (32 /
8 / 128 heads, hidden 1024, MLP 1024), T = 4096, SDPA attention, patched (fused), patched
with ``fuse_qk_norm=False`` and unpatched; ``saved_bytes_per_element`` here is the bytes the
whole step keeps for backward per q/k element.  The step is dominated by SDPA at this
length: it shows what the fused prologue is worth in a whole step, and the memory it
saves.

Run alone: ``python benchmarks/bench_qk_attention.py [--full]`` (goes through run.py).
"""

from __future__ import annotations

import sys

import harness as H
import torch

TOPIC = "qkattn"
PARTS = {"qkattn": 5}
MODEL = "Qwen3-VL-8B"
PROLOGUE_METHODS = ("posenc", "posenc_unfused", "hf_eager", "hf_compile", *H.FLOORS)
STEP_METHODS = ("posenc", "posenc_unfused", "hf_eager")
PLAN = {
    "quick": [H.Sweep(MODEL, 1, (4096,), H.BOTH, ("fwd", "fwdbwd"), "qk_attention_prologue"),
              H.Sweep(MODEL, 1, (4096,), ("bf16",), ("fwdbwd",), "qk_attention_step")],
    "full": [H.Sweep(MODEL, 1, (4096, 16384), H.BOTH, ("fwd", "fwdbwd"),
                     "qk_attention_prologue"),
             H.Sweep(MODEL, 1, (4096,), H.BOTH, ("fwdbwd",), "qk_attention_step")],
    "smoke": [H.Sweep(MODEL, 1, (64,), ("fp32",), ("fwd", "fwdbwd"), "qk_attention_prologue"),
              H.Sweep(MODEL, 1, (64,), ("fp32",), ("fwdbwd",), "qk_attention_step")],
}
#: The step takes seconds a call: three rounds, no warm-up beyond the checked first call.
STEP_POLICY = H.TimingPolicy(min_run_time=0.0, min_rounds=3, max_time=0.0, warmup=0)
_STAND_IN = "posenc_bench_stand_in"


def plan(opts: H.Options):
    out = []
    for op, model, b, t, dt, modes in H.expand(PLAN[opts.suite], opts.seqs):
        methods = PROLOGUE_METHODS if op == "qk_attention_prologue" else STEP_METHODS
        out += [(H.Case(TOPIC, op, model, b, t, dt, mode, opts.threads, opts.device), methods)
                for mode in modes]
    return out


class _Fixed(torch.nn.Module):
    """A projection that returns a fixed tensor (the timed leaf)."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.out


def _stand_in(module, query, key, value, attention_mask, **kwargs):
    return query.transpose(1, 2), key


class States:
    """The patch states of one modeling module, switched per call (see the docstring)."""

    def __init__(self, cls: type, module) -> None:
        import posenc_torch.hf as hf

        self.cls, self.module = cls, module
        self.forward, self.rotary = vars(cls)["forward"], module.apply_rotary_pos_emb
        with hf.patch("qwen3_vl", count=False):
            self.fused = vars(cls)["forward"]
        with hf.patch("qwen3_vl", count=False, fuse_qk_norm=False):
            self.posenc_rotary = module.apply_rotary_pos_emb

    def run(self, method: str, fn):
        forward = self.fused if method == "posenc" else self.forward
        rotary = self.posenc_rotary if method == "posenc_unfused" else self.rotary
        self.cls.forward, self.module.apply_rotary_pos_emb = forward, rotary
        try:
            return fn()
        finally:
            self.cls.forward, self.module.apply_rotary_pos_emb = self.forward, self.rotary


def _config(hidden: int, layers: int = 1):
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_vl").text_config
    model = H.MODELS[MODEL]
    for name, value in dict(hidden_size=hidden, num_attention_heads=model.heads,
                            num_key_value_heads=model.kv_heads, head_dim=model.head_dim,
                            intermediate_size=1024, num_hidden_layers=layers, vocab_size=1000,
                            rms_norm_eps=1e-6).items():
        setattr(config, name, value)
    return config


def _prologue(opts, rep, b, t, dtype_name, modes, states, modeling) -> None:
    import transformers

    dtype = H.DTYPES[dtype_name]
    model = H.MODELS[MODEL]
    config = _config(model.heads * model.head_dim)
    config._attn_implementation = _STAND_IN
    torch.manual_seed(0)
    attn = modeling.Qwen3VLTextAttention(config, 0).to(dtype)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(torch.randn(model.head_dim) * 0.1 + 1)
    q_proj, k_proj, _, _ = H.qk_as_hf(b, t, model, dtype, opts.device)
    attn.q_proj, attn.k_proj, attn.v_proj = _Fixed(q_proj), _Fixed(k_proj), _Fixed(k_proj)
    attn.o_proj = torch.nn.Identity()
    hidden = torch.empty(b, t, config.hidden_size, dtype=dtype)
    tables = H.rope_tables(model, t, dtype)
    gq = torch.randn(b, t, model.heads * model.head_dim, dtype=dtype)
    gk = torch.randn(b, model.kv_heads, t, model.head_dim, dtype=dtype)
    wrt = (q_proj, k_proj, attn.q_norm.weight, attn.k_norm.weight)

    def forward():
        out, key = attn(hidden, tables, None)
        return out, key

    compiled = None

    def build(name: str) -> H.Workload:
        nonlocal compiled
        common = {"wrt": wrt, "grad_outputs": (gq, gk)}
        if name in H.FLOORS:
            return H.floor_workload(name, (q_proj, k_proj), (gq, gk))
        if name == "hf_compile":
            compiled = H.compile_fn(attn)
            return H.Workload(lambda: compiled(hidden, tables, None), compiled=True, **common)
        return H.Workload(lambda: states.run(name, forward), **common)

    with torch.no_grad():
        ref_fwd = forward()
    ref_grad = torch.autograd.grad(forward(), wrt, (gq, gk)) if "fwdbwd" in modes else None
    elements = q_proj.numel() + k_proj.numel()
    for mode in modes:
        case = H.Case(TOPIC, "qk_attention_prologue", MODEL, b, t, dtype_name, mode,
                      opts.threads, opts.device)
        results = H.run_case(case, PROLOGUE_METHODS, build,
                             ref_fwd if mode == "fwd" else ref_grad, opts.policy,
                             floor=H.floor_bytes(q_proj, k_proj) * (2 if mode == "fwdbwd" else 1),
                             transformers_version=transformers.__version__)
        for res in results:
            if (mode == "fwdbwd" and res.status == "ok" and res.method in STEP_METHODS):
                res.saved_bytes_per_element = H.saved_bytes(
                    lambda m=res.method: states.run(m, forward)) / elements
            rep.add(res, f"{case.name} {res.method}")


def _step(opts, rep, b, t, dtype_name, states, modeling) -> None:
    import transformers

    dtype = H.DTYPES[dtype_name]
    model = H.MODELS[MODEL]
    hidden_size = 1024 if opts.suite != "smoke" else 64
    config = _config(hidden_size)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    text = modeling.Qwen3VLTextModel(config).to(dtype)
    x = torch.randn(b, t, hidden_size, dtype=dtype, requires_grad=True)
    g = torch.randn(b, t, hidden_size, dtype=dtype)
    wrt = (x, *(p for n, p in text.named_parameters() if "embed_tokens" not in n))

    def forward():
        return (text(inputs_embeds=x, use_cache=False).last_hidden_state,)

    def build(name: str) -> H.Workload:
        return H.Workload(lambda: states.run(name, forward), wrt=wrt, grad_outputs=(g,))

    ref = torch.autograd.grad(forward(), wrt, (g,))
    elements = b * t * (model.heads + model.kv_heads) * model.head_dim
    case = H.Case(TOPIC, "qk_attention_step", MODEL, b, t, dtype_name, "fwdbwd",
                  opts.threads, opts.device)
    policy = STEP_POLICY if opts.suite != "smoke" else opts.policy
    for res in H.run_case(case, STEP_METHODS, build, ref, policy,
                          transformers_version=transformers.__version__):
        if res.status == "ok":
            res.saved_bytes_per_element = H.saved_bytes(
                lambda m=res.method: states.run(m, forward)) / elements
        rep.add(res, f"{case.name} {res.method}")


def run(opts: H.Options, rep: H.Reporter) -> None:
    from transformers import AttentionInterface
    from transformers.models.qwen3_vl import modeling_qwen3_vl as modeling

    AttentionInterface.register(_STAND_IN, _stand_in)
    states = States(modeling.Qwen3VLTextAttention, modeling)
    for op, _, b, t, dtype_name, modes in H.expand(PLAN[opts.suite], opts.seqs):
        if op == "qk_attention_prologue":
            _prologue(opts, rep, b, t, dtype_name, modes, states, modeling)
        else:
            _step(opts, rep, b, t, dtype_name, states, modeling)


if __name__ == "__main__":
    sys.exit(H.worker_main(sys.modules[__name__]))
