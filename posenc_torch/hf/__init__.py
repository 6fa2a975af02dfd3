"""Use posenc_torch inside Hugging Face transformers models with one line.

    import posenc_torch.hf
    handle = posenc_torch.hf.patch()      # before building / compiling the model
    ...                                    # train or run as usual
    print(handle.calls)                    # proof that the posenc functions ran
    handle.undo()                          # or: with posenc_torch.hf.patch(): ...

This package is the one part of posenc_torch that reads the installed transformers; the
core (``posenc_torch.rope``, ``positions``, ``packing``, ``vision``, ``ops``) imports
nothing of it and no transformers, and reaches it only through ``posenc_torch._installed``
(``convention="installed"``).  Importing it does not import transformers either.

``patch`` replaces, for each model type it knows whose installed code fits:

* ``apply_rotary_pos_emb`` (decoder attention): Llama-like models, models with adjacent
  pairs (Cohere, GLM-4V), partial rotary (Phi-3, GPT-NeoX, Qwen3-Next, Qwen3.5,
  GLM-4-MoE, ...), models that reshape their tables first (GLM, GLM-4, ERNIE-4.5,
  gpt-oss), and DeepSeek-V3's ``apply_rotary_pos_emb_interleave`` (``_rotary``);
* ``apply_multimodal_rotary_pos_emb`` (Qwen2-VL / Qwen2.5-VL decoder attention in 4.x) and
  ``apply_rotary_pos_emb_vision`` (the Qwen-VL vision towers);
* the Qwen-VL ``get_rope_index`` (``_rope_index``), and a check of packed batches reaching
  the model in a way that would let examples attend to each other (``_packing_guard``);
* the vision towers' grid computations, routed to posenc's C walks: the 5.x
  ``vision_utils`` functions (``_vision``) and the 4.57 towers' ``rot_pos_emb``,
  ``get_window_index`` and ``fast_pos_embed_interpolate`` methods (``_vision_methods``).

How a function is judged (README, "The decision rule"): by what its code computes, never by
sampled inputs.

1. A tensor function (the rotary functions) is replaced when the graph torch's tracer
   captures from it, with every size symbolic, equals the graph of posenc's own reference
   of one form, with nothing the tracer would fix silently left able to hide a branch
   (``_graphs``, ``_references``).
2. An integer walk (``get_rope_index``, the vision helpers and 4.57 tower methods) is
   replaced when the digest of its normalized code, and of everything it calls, is one the
   tests verified against posenc's walk (``_digests``, ``verified.json``).
3. A verdict is kept per content: a rotary verdict on disk, keyed on the code and the
   globals' values (a second process decides nothing again); a digest per code identity.

A model type that fails is left to transformers with one ``UnsupportedModelWarning``
naming it and the reason (see ``unsupported_model_types()``); when no requested type
remains, ``patch`` raises instead of returning a handle that patches nothing.

transformers 5.x decorates ``apply_rotary_pos_emb`` with a hub-kernel decorator and the
attention classes with ``use_kernelized_func(apply_rotary_pos_emb)``.  Those decorators
only record the function object (for ``kernels.kernelize``); the attention ``forward``
still calls the module-level name on every call, so replacing that name takes effect as
long as the model is not kernelized.  The rotary *modules* (cos/sin once per forward) are
left alone, which keeps the patched model's tables bit-identical to the unpatched one.

Calls the posenc kernels do not take (tensors on another device than the CPU, dtypes or
shapes other than the model's own layouts, other argument forms, calls under functorch
transforms or forward AD) go to the original transformers function unchanged, with the
caller's own arguments (``fallback=True``, the default), so the patch never changes what
a model computes or which errors it raises; ``handle.fallbacks`` counts those calls.  With
``fallback=False`` inputs posenc does not take raise posenc's error instead.

Patch before ``torch.compile``: torch.compile guards the global functions it traced, so
patching (or undoing) after compiling recompiles every compiled region on its next call.
Exported or ahead-of-time compiled programs keep the functions they traced.
"""

from __future__ import annotations

from ._handle import PatchHandle, UnsupportedModelWarning
from ._patch import INSTALLERS, KNOWN_MODEL_TYPES, patch, support, unsupported_model_types  # noqa: F401
from ._vision import precompute_vision_kwargs

__all__ = ["KNOWN_MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "PatchHandle",  # noqa: F822
           "UnsupportedModelWarning", "patch", "precompute_vision_kwargs",
           "unsupported_model_types"]


def __getattr__(name: str) -> object:
    # computed on each use, so that importing posenc_torch.hf does not import
    # transformers, and a changed function is seen
    if name == "SUPPORTED_MODEL_TYPES":
        return tuple(mt for mt, reason in support().items() if reason is None)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
