"""The rows of the q/k-norm attentions (``posenc_torch.hf._qk_attention``): which norm form
a norm class's ``forward`` computes, and which template computes what an attention's
``forward`` computes.

A norm class: a module of the class taken from a tiny attention, with random weights,
against the fused op with the identity rotation (cos 1, sin 0) for each form the op has
and each float attribute of the module as eps (set to 0.25 so that it matters): outputs in
float32 and bfloat16 and the float32 gradients of the input and the weight, bit for bit.
Exactly one (form, attribute) may pass.

An attention class: a tiny attention of the class (random weights, the verify command's
recording attention function as its attention implementation) runs transformers'
``forward`` and each template's, with a recording cache and without, with the full and a
half-width rotary, in eval and training mode, and once more (eval, full width, with and
without a cache) with each bool attribute of the attention flipped and each None attribute
set to 3 (a forward that branches on one shows it).  Where transformers' ``forward``
raises (a half-width table its rotary does not take), the template must decline the call
(``partial=0``).  What the attention function and the cache receive (tensors by value,
dtype and strides; keywords), the outputs and the float32 gradients of the hidden states
and every parameter must be the same bits.  Exactly one template may pass.
"""

from __future__ import annotations

import copy
import inspect
import sys
import warnings

import torch

from ... import qk_norm as _qk_norm
from .. import _qk_attention as QA
from .. import _transformers

_RECORDER = "posenc_verify_recorder"
_SIZES = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              attention_dropout=0.0)
_RECORDS: list = []


def _record_attention(module, query, key, value, attention_mask, **kwargs):
    _RECORDS.append(("attention", (query, key, value, attention_mask), kwargs))
    eager = vars(sys.modules[type(module).__module__])["eager_attention_forward"]
    return eager(module, query, key, value, attention_mask, **kwargs)


class _RecordingCache:
    """Stands in for a cache: records each update and returns what it was given."""

    def update(self, *args, **kwargs):
        _RECORDS.append(("update", args, kwargs))
        return args[0], args[1]


def _register() -> None:
    interface = getattr(_transformers.module(), "AttentionInterface", None)
    if interface is None:
        from transformers.modeling_utils import AttentionInterface as interface  # noqa: N813
    interface.register(_RECORDER, _record_attention)


def tiny_attention(model_type: str, cls: type) -> torch.nn.Module:
    """A tiny random attention of ``cls`` (float32), attention function the recorder."""
    config = _transformers.module().AutoConfig.for_model(model_type)
    if "text_config" in (getattr(config, "sub_configs", None) or {}):
        config = config.get_text_config()
    for name, value in _SIZES.items():
        setattr(config, name, value)
    _register()
    config._attn_implementation = _RECORDER
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attn = cls(config, 0)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_()
    return attn


# ---------------------------------------------------------------------------------------
# Bit-for-bit comparison of what two runs produced.


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or (type(a) is type(b) and a == b)


def _outcome(run, inputs: list[torch.Tensor], params: list[torch.Tensor]) -> tuple:
    """(records, output, gradients) of ``run()``, or the exception's type."""
    _RECORDS.clear()
    try:
        out = run()
        first = out[0] if isinstance(out, tuple) else out
        grads = ()
        if first.requires_grad and inputs + params:
            g = torch.linspace(-1, 1, first.numel(), dtype=first.dtype).view_as(first)
            grads = torch.autograd.grad((first * g).sum(), inputs + params, allow_unused=True)
        return list(_RECORDS), tuple(x.detach() if isinstance(x, torch.Tensor) else x
                                     for x in (out if isinstance(out, tuple) else (out,))), grads
    except Exception as e:  # noqa: BLE001 -- compared by type with the other run
        return (type(e),)
    finally:
        _RECORDS.clear()


# ---------------------------------------------------------------------------------------
# Norm classes.


def check_norm(norm: torch.nn.Module) -> tuple[str | None, str]:
    """(the row's use, "") for the class of ``norm`` (a module of a tiny attention), or
    (None, why)."""
    floats = [n for n, v in vars(norm).items() if type(v) is float]
    if "weight" not in norm._parameters or not floats:
        return None, "the norm has no weight parameter or no float eps"
    passing = []
    for form in _qk_norm.ops.QK_NORM_FORMS:
        for eps in floats:
            if _norm_agrees(norm, QA.Norm(form, eps)):
                passing.append(QA.Norm(form, eps))
    if len(passing) != 1:
        return None, ("no form of the fused op computes it" if not passing else
                      f"the samples do not tell {[n.use for n in passing]} apart")
    return passing[0].use, ""


def _norm_agrees(norm: torch.nn.Module, spec: QA.Norm) -> bool:
    for dtype, value in ((torch.float32, None), (torch.float32, 0.25), (torch.bfloat16, 0.25)):
        m = copy.deepcopy(norm).to(dtype)
        if value is not None:
            setattr(m, spec.eps, value)
        d = m.weight.shape[0]
        x = (torch.randn(2, 3, 5, d, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
        x.requires_grad_(dtype == torch.float32)
        params = [m.weight] if dtype == torch.float32 else []
        found = QA.norm_inputs(m, spec, dtype, d)
        if found is None:
            return False
        cos, sin = torch.ones(1, 5, d, dtype=dtype), torch.zeros(1, 5, d, dtype=dtype)

        def fused(m=m, x=x, cos=cos, sin=sin, w=found[0], eps=found[1]):
            return _qk_norm.apply_qk_norm_rope(x, x, cos, sin, w, w, eps, norm=spec.form)[0]

        if not _same(_outcome(lambda m=m, x=x: m(x), [x] if x.requires_grad else [], params),
                     _outcome(fused, [x] if x.requires_grad else [], params)):
            return False
    return True


# ---------------------------------------------------------------------------------------
# Attention classes.


def _perturbations(attn: torch.nn.Module) -> list[tuple[str, object]]:
    out = [("", None)]
    for name, value in vars(attn).items():
        if name.startswith("_") or name == "training":
            continue
        if type(value) is bool:
            out.append((name, not value))
        elif value is None:
            out.append((name, 3))
    return out


def check_attention(model_type: str, cls: type, forward, norm_use: str | None
                    ) -> tuple[str | None, str]:
    """(the row's use, "") when exactly one template computes what ``forward`` computes
    on tiny attentions of ``cls``, else (None, why)."""
    norm = QA.parse_norm(norm_use) if norm_use else None
    if norm is None:
        return None, "its norm class has no verified form"
    try:
        attn = tiny_attention(model_type, cls)
    except Exception as e:  # noqa: BLE001 -- any failure to build means no row
        return None, f"no tiny attention of it could be built ({type(e).__name__}: {e})"
    passing = [t for t in QA.TEMPLATES if _attention_agrees(attn, forward, t, norm)]
    if len(passing) != 1:
        return None, ("no template computes what it computes" if not passing else
                      f"the samples do not tell {[t.use for t in passing]} apart")
    return passing[0].use, ""


def _attention_agrees(attn, forward, t: QA.Template, norm: QA.Norm) -> bool:
    binding = QA.CallArguments(forward)
    cache_name = "cache" if "cache" in binding.keyword else "past_key_values"
    module = vars(sys.modules[type(attn).__module__])
    d = attn.head_dim
    for name, value in _perturbations(attn):
        saved = getattr(attn, name) if name else None
        if name:
            setattr(attn, name, value)
        # (training mode and the half-width table with the attention as built; each
        # perturbation with and without a cache)
        try:
            for training in (False, True) if not name else (False,):
                attn.train(training)
                for width in (d, d // 2) if not name else (d,):
                    for cache in (None, _RecordingCache()):
                        theirs, ours = (_run(attn, forward, t, norm, width, cache, binding,
                                             cache_name, module, fused)
                                        for fused in (False, True))
                        # (a call the template declines goes to the forward: it must raise)
                        if not (_same(theirs, ours) or (ours == (QA.Decline,)
                                                        and len(theirs) == 1)):
                            return False
        finally:
            if name:
                setattr(attn, name, saved)
            attn.train(False)
    return True


def _run(attn, forward, t, norm, width, cache, binding, cache_name, module, fused: bool):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, attn.config.hidden_size, generator=g).requires_grad_()
    angles = torch.randn(2, 5, width // 2, generator=g) * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    mask = torch.zeros(2, 1, 5, 5).masked_fill(torch.ones(5, 5).triu(1).bool(), -1e9)
    kw = {cache_name: cache}
    if "cache_position" in inspect.signature(forward).parameters:
        kw["cache_position"] = torch.arange(5)
    params = list(attn.parameters())

    def run():
        if not fused:
            return forward(attn, hidden, (cos, sin), mask, **kw)
        a = binding.bind((attn, hidden, (cos, sin), mask), kw)
        kwargs = a.get(binding.var_keyword, {}) if binding.var_keyword else {}
        q_in = QA.norm_inputs(attn.q_norm, norm, hidden.dtype, attn.head_dim)
        k_in = QA.norm_inputs(attn.k_norm, norm, hidden.dtype, attn.head_dim)
        return QA._forward(attn, t, a, kwargs, cache_name, norm, q_in[0], k_in[0], q_in[1],
                           module)

    return _outcome(run, [hidden], params)
