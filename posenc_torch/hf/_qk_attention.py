"""The attentions that norm q and k per head right before the rotary, run with posenc's
fused op (``posenc_torch.apply_qk_norm_rope``): one pass over q and k instead of
transformers' eager norm followed by the rotary.

The route: the attention class's ``forward`` is replaced by posenc's (``_forward``, one
implementation for every template), where the verified table holds a row for the digest
of transformers' ``forward`` (with everything it reaches: ``apply_rotary_pos_emb``, the
attention functions).  The row names the template (``Template``): how the cache is
updated, whether ``sliding_window`` goes to the attention function, whether q carries a
gate (Qwen3-Next, Qwen3.5), whether the rotary takes tables narrower than the head.  The
norm modules (``self.q_norm``, ``self.k_norm``) are
instances, so the digest of their class's ``forward`` has a row of its own naming the
norm form of the fused op and the attribute that holds eps.  The verify command makes both
kinds of row (``verify/_attention.py``): on tiny attentions of the class it runs
transformers' ``forward`` and each template, with a recording cache and a recording
attention function, and keeps the one template that passes the same tensors (values and
strides), keywords and results, gradients included, bit for bit.

Why the forward and not the norm modules: the norm's output is the rotary's input; fusing
them needs the call that sees both, and only the attention's ``forward`` does.  Replacing
it keeps the norm modules and ``apply_rotary_pos_emb`` as they are for everyone else.

Calls go to transformers' ``forward`` (counted in ``handle.fallbacks``) when: the norm
class has no row (or is first seen while compiling), the norm modules have hooks (or global
module hooks exist), their ``forward`` was replaced on the instance, their weight is not a
plain tensor of the hidden states' dtype and the head's size, eps is not a float, CPU
autocast is on, the hidden states are not a plain CPU tensor (no subclass) of float32,
bfloat16 or float16, the rotary tables are not two 3-D tensors of that dtype (or are
narrower than the head where the template's rotary refuses that), the call uses a cache
keyword the forward's decorator renames, or the arguments do not bind.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import qk_norm as _qk_norm
from . import _digests, _table, _transformers
from ._handle import CallArguments, Decline, original_of, warn_once

ATTENTION = "attention.forward"
NORM = "norm.forward"
#: Names of the cache keyword that transformers' decorators rename to the forward's own.
_RENAMED = ("past_key_value", "past_key_values", "cache")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: How the forward updates the cache and picks the attention function: 4.57 (the tables
#: and cache_position in a dict; ``ALL_ATTENTION_FUNCTIONS[name]`` unless "eager"), 5.17
#: (no extra arguments; ``get_interface``), 5.25 (``kwargs=kwargs``; ``get_interface``).
UPDATES = ("cache_kwargs", "plain", "kwargs")


class Template(NamedTuple):
    """What sets one q/k-norm attention ``forward`` apart from another."""

    update: str  # one of UPDATES
    sliding: bool  # passes sliding_window=self.sliding_window to the attention function
    gate: bool  # q_proj gives q and a gate per head (Qwen3-Next); the output is gated
    # the forward's rotary takes tables narrower than the head (else it raises) and returns
    # contiguous (B, H, T, D) tensors (it concatenates the rotated and the passed channels)
    partial: bool

    @property
    def use(self) -> str:
        return (f"qk_norm_attention update={self.update} sliding={int(self.sliding)} "
                f"gate={int(self.gate)} partial={int(self.partial)}")


TEMPLATES = tuple(Template(u, s, g, p) for u in UPDATES for s in (False, True)
                  for g in (False, True) for p in (False, True))
_BY_USE = {t.use: t for t in TEMPLATES}


class Norm(NamedTuple):
    """A norm class's row: the fused op's form and the attribute holding eps."""

    form: str
    eps: str

    @property
    def use(self) -> str:
        return f"qk_norm {self.form} eps={self.eps}"


def parse_norm(use: str) -> Norm | None:
    parts = use.split()
    if len(parts) != 3 or parts[0] != "qk_norm" or not parts[2].startswith("eps="):
        return None
    return Norm(parts[1], parts[2][4:])


# ---------------------------------------------------------------------------------------
# The forward of every template.


def norm_inputs(module: torch.nn.Module, norm: Norm, dtype: torch.dtype, size: int
                ) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of a norm module the fused op may stand in for, else None."""
    if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
            or module._backward_pre_hooks or "forward" in vars(module)):
        return None
    weight = module._parameters.get("weight")
    eps = getattr(module, norm.eps, None)
    if (weight is None or type(weight) not in (torch.nn.Parameter, torch.Tensor)
            or weight.dtype != dtype or weight.dim() != 1 or weight.shape[0] != size
            or type(eps) is not float):
        return None
    return weight, eps


def _forward(self, t: Template, a: dict, kwargs: dict, cache_name: str, norm: Norm,
             wq: torch.Tensor, wk: torch.Tensor, eps: float, module: dict):
    """transformers' q/k-norm attention ``forward`` with the norms and the rotary as one
    op; every other step is the forward's own, in its order."""
    hidden_states = a["hidden_states"]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    if t.gate:
        query_states, gate = torch.chunk(
            self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
        query_states = query_states.view(hidden_shape)
    else:
        query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(hidden_shape)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = a["position_embeddings"]
    if not t.partial and cos.shape[-1] != self.head_dim:
        raise Decline("tables narrower than the head, which transformers' rotary refuses")
    query_states, key_states = _qk_norm.apply_qk_norm_rope(
        query_states.transpose(1, 2), key_states.transpose(1, 2), cos, sin, wq, wk, eps,
        norm=norm.form)
    if t.partial:  # the layout transformers' concatenation gives (one more pass)
        query_states, key_states = query_states.contiguous(), key_states.contiguous()

    cache = a.get(cache_name)
    if cache is not None:
        if t.update == "cache_kwargs":
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": a.get("cache_position")}
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx,
                                                    cache_kwargs)
        elif t.update == "plain":
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        else:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx,
                                                    kwargs=kwargs)
    functions, eager = module["ALL_ATTENTION_FUNCTIONS"], module["eager_attention_forward"]
    if t.update == "cache_kwargs":
        interface = eager
        if self.config._attn_implementation != "eager":
            interface = functions[self.config._attn_implementation]
    else:
        interface = functions.get_interface(self.config._attn_implementation, eager)
    dropout = 0.0 if not self.training else self.attention_dropout
    mask = a.get("attention_mask")
    if t.sliding:
        attn_output, attn_weights = interface(
            self, query_states, key_states, value_states, mask, dropout=dropout,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)
    else:
        attn_output, attn_weights = interface(
            self, query_states, key_states, value_states, mask, dropout=dropout,
            scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if t.gate:
        attn_output = attn_output * torch.sigmoid(gate)
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


# ---------------------------------------------------------------------------------------
# Which calls the fused forward takes.

def norm_row(cls: type, rows: dict, memo: dict) -> tuple[Norm, _digests.Watch] | None:
    """The verified row of a norm class's ``forward`` (kept in ``memo``, the handle's),
    else None."""
    if cls not in memo:
        found = None
        try:
            row, watch = _table.verified(original_of(getattr(cls, "forward", None)), cls,
                                         NORM, rows)
            norm = parse_norm(row.use)
            if norm is not None and norm.form in _qk_norm.ops.QK_NORM_FORMS:
                found = (norm, watch)
        except _digests.Unverified:
            pass
        memo[cls] = found
    return memo[cls]


def _global_hooks() -> bool:
    m = torch.nn.modules.module
    return any(getattr(m, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks"))


def computation(t: Template, original: Callable, module: dict, rows: dict,
                norms: dict) -> Callable:
    """``compute`` for ``PatchHandle.replace``: the fused forward, or Decline.  ``norms``:
    the norm rows decided so far (``norm_row``), filled at install time for the modeling
    module's norm classes; a class first seen while compiling is declined (its digest
    reads source files, which is no code to trace)."""
    binding = CallArguments(original)
    cache_name = "cache" if "cache" in binding.keyword else "past_key_values"
    var_keyword = binding.var_keyword

    def compute(*args, **kw):
        a = binding.bind(args, kw)
        if a is None:
            raise Decline("the arguments do not bind")
        kwargs = a.get(var_keyword, {}) if var_keyword else {}
        if any(name in kwargs for name in _RENAMED):
            raise Decline("a cache keyword the forward's decorator renames")
        self, hidden = a["self"], a.get("hidden_states")
        tables = a.get("position_embeddings")
        if (type(hidden) is not torch.Tensor or hidden.device.type != "cpu"
                or hidden.dtype not in _DTYPES or torch.is_autocast_enabled("cpu")
                or not isinstance(tables, tuple) or len(tables) != 2
                or not all(isinstance(x, torch.Tensor) and x.dim() == 3
                           and x.dtype == hidden.dtype for x in tables)
                or _global_hooks()):
            raise Decline("inputs the fused op does not take")
        q_norm, k_norm = self._modules.get("q_norm"), self._modules.get("k_norm")
        if q_norm is None or k_norm is None or type(q_norm) is not type(k_norm):
            raise Decline("no q/k norm modules of one class")
        if type(q_norm) not in norms and torch.compiler.is_compiling():
            raise Decline("a norm class first seen while compiling")
        found = norm_row(type(q_norm), rows, norms)
        if found is None or not (found[1].unchanged(q_norm) and found[1].unchanged(k_norm)):
            raise Decline("a norm class without a verified row")
        norm = found[0]
        q_in = norm_inputs(q_norm, norm, hidden.dtype, self.head_dim)
        k_in = norm_inputs(k_norm, norm, hidden.dtype, self.head_dim)
        if q_in is None or k_in is None or q_in[1] != k_in[1]:
            raise Decline("norm modules the fused op cannot stand in for")
        return _forward(self, t, a, kwargs, cache_name, norm, q_in[0], k_in[0], q_in[1],
                        module)

    return compute


# ---------------------------------------------------------------------------------------
# Installation.


def candidates(module) -> list[type]:
    """The classes of a modeling module whose ``forward`` names both ``q_norm`` and
    ``k_norm`` (the verified table decides which of them are q/k-norm attentions)."""
    import inspect

    out = []
    for value in vars(module).values():
        if (isinstance(value, type) and value.__module__ == module.__name__
                and "forward" in vars(value)):
            code = getattr(inspect.unwrap(original_of(vars(value)["forward"])), "__code__", None)
            if code is not None and {"q_norm", "k_norm"} <= set(code.co_names):
                out.append(value)
    return out


def install(handle, model_types: tuple[str, ...]) -> None:
    """Replace the ``forward`` of the q/k-norm attention classes of ``model_types`` whose
    code has a template row (``handle.fuse_qk_norm`` False: none), among the types the
    release facts list as fused for the installed release (every type under a release they
    do not name); a class of a listed type whose code has no row stays transformers' with
    one ``UnsupportedModelWarning``."""
    if not getattr(handle, "fuse_qk_norm", False):
        return
    facts = _table.releases()["fused"]
    release = _transformers.version()
    fused = set(facts.get(release, ()))
    norms: dict = {}
    for mt in model_types:
        # (a release the facts name: only its fused types can have rows, and digesting the
        # other types' attentions would cost most of patch(); another release: every type)
        if release in facts and mt not in fused:
            continue
        try:
            module = _transformers.modeling_module(mt)
        except _transformers.Unsupported:
            continue
        prewarmed = False
        for cls in candidates(module):
            original = original_of(vars(cls)["forward"])
            try:
                row, watch = _table.verified(original, cls, ATTENTION, handle.rows)
            except _digests.Unverified as e:
                # (silent for the types the release facts do not list: their code is
                # known not to be a template's, e.g. a norm over all heads)
                if mt in fused:
                    warn_once(f"posenc_torch.hf.patch runs {mt}'s {cls.__name__} without "
                              f"the fused q/k norm + rotary: {e}", stacklevel=4)
                continue
            template = _BY_USE.get(row.use)
            if template is None:
                continue
            if not prewarmed:  # the module's norm classes, which its attentions build
                prewarmed = True
                for value in vars(module).values():
                    if (isinstance(value, type) and value.__module__ == module.__name__
                            and "Norm" in value.__name__ and "forward" in vars(value)):
                        norm_row(value, handle.rows, norms)
            handle.replace(cls, "forward", computation(template, original, vars(sys.modules[
                cls.__module__]), handle.rows, norms), f"{mt}.{cls.__name__}.forward",
                f"posenc_torch's fused q/k norm + rotary in transformers' "
                f"{cls.__qualname__}.forward; see posenc_torch.hf.", watch)
