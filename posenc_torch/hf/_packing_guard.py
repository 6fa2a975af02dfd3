"""A packed batch reaching a Qwen-VL model in a way that does not give each example its own
attention is warned about, once per reason (``posenc_torch.packing.packed_attention_leaks``:
a KV cache, a 2-D attention mask, flash-attention boundaries missing or other than the
examples', position ids without the text row, non-consecutive text positions).

``patch()`` wraps the ``forward`` of the class that owns ``get_rope_index`` for the Qwen-VL
types it patches.  The wrapper resolves ``use_cache`` as transformers does (``None``: the
text config's, off under gradient checkpointing in training; a ``past_key_values`` given
means a cache) and reads the position ids (one device sync) when the call gives them;
traced calls are not checked.  It only warns (arguments it cannot read leave it silent),
computes nothing, and is not one of the handle's ``targets`` (``undo()`` removes it too).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ..packing import warn_packed_attention_leaks
from . import _transformers
from ._handle import CallArguments
from ._rope_index import MODEL_TYPES

_NAME = "forward"


def _check(self, arguments: dict) -> None:
    """``arguments``: the forward's bound arguments, its ``**kwargs`` merged in (some
    models take ``use_cache`` only there)."""
    position_ids = arguments.get("position_ids")
    if not isinstance(position_ids, torch.Tensor):
        return  # computed by the model: not packed
    text = getattr(self, "language_model", self)
    use_cache = arguments.get("use_cache")
    if use_cache is None:
        use_cache = getattr(text.config, "use_cache", False)
    if getattr(text, "gradient_checkpointing", False) and text.training:
        use_cache = False
    use_cache = bool(use_cache) or arguments.get("past_key_values") is not None
    mask = arguments.get("attention_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        return  # a mask mapping (prepared by generate): the caller's own
    warn_packed_attention_leaks(
        position_ids, attention_mask=mask, use_cache=use_cache,
        cu_seq_lens_q=arguments.get("cu_seq_lens_q"),
        cu_seq_lens_k=arguments.get("cu_seq_lens_k"),
        attn_implementation=getattr(text.config, "_attn_implementation", None))


def _make(original: Callable) -> Callable:
    binding = CallArguments(original)

    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            arguments = binding.bind((self, *args), kwargs)
            if arguments is not None:  # (else transformers raises its own error)
                extra = arguments.get(binding.var_keyword, {}) if binding.var_keyword else {}
                try:
                    _check(self, {**extra, **arguments})
                except Warning:
                    raise  # the caller turned warnings into errors
                except Exception:  # noqa: BLE001  a guard warns; it never stops a call
                    pass
        return original(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(original)
    return forward


def install(handle, model_types: tuple[str, ...]) -> None:
    """Wrap the model forward of the Qwen-VL types among ``model_types``."""
    for mt in model_types:
        if mt not in MODEL_TYPES:
            continue
        try:
            owner = _transformers.owner_class(_transformers.modeling_module(mt),
                                              "get_rope_index")
        except _transformers.Unsupported:
            continue  # the get_rope_index installer warns about it
        wrapper = _make(vars(owner)[_NAME])
        wrapper.__doc__ = vars(owner)[_NAME].__doc__
        handle.install(owner, _NAME, wrapper, f"{mt}.{owner.__name__}.forward", listed=False)
