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
  ``vision_utils`` functions (``_vision_utils``, which also computes ``precompute_vision_kwargs``)
  and the 4.57 towers' ``rot_pos_emb``, ``get_window_index`` and
  ``fast_pos_embed_interpolate`` methods (``_tower_methods_457``).

How a function is judged (docs/transformers.md, "What it replaces, and how it decides"):
by the digest of its normalized code and of everything it reaches (``_digests``), looked up
in the verified table (``_table``, ``verified.json``), whose row says what posenc runs for
it (a rotary form, a ``get_rope_index`` convention, a walk, a tower-method replacement).
The rows are made and re-checked by ``python -m posenc_torch.hf.verify`` (the graph
torch's tracer captures from a rotary function against posenc's references; the integer
walks against posenc's walks), which ``make test`` runs under every transformers release it
installs; a user on a release the table does not know runs it once with ``--write FILE``
and passes ``patch(table=FILE)``.  At run time nothing is traced and nothing is written.
While patched, a replacement hands a call back to transformers when anything its row was
decided on has changed (a global, a closure cell, a default, a method reached through
``self`` on the object's own class).

A model type that fails is left to transformers with one ``UnsupportedModelWarning``
naming it and the reason (see ``unsupported_model_types()``); when no requested type
remains, ``patch`` raises instead of returning a handle that patches nothing.

transformers 5.x decorates ``apply_rotary_pos_emb`` with a hub-kernel decorator and the
attention classes with ``use_kernelized_func(apply_rotary_pos_emb)``.  Without the
``kernels`` package those decorators only record the function object; with it, transformers
puts a hub-kernel layer in the function's place, which ``patch`` reads through (it decides
on the function inside the layer and installs its replacement in the layer's place, in
either order of ``patch`` and ``kernelize``; calls it hands back go to the layer).  The
rotary *modules* (cos/sin once per forward) are left alone, which keeps the patched
model's tables bit-identical to the unpatched one.

Calls the posenc kernels do not take (tensors on a device posenc was not built for: CUDA
tensors unless ``posenc_torch._C.has_cuda()``; dtypes or shapes other than the model's own
layouts, other argument forms, calls under functorch
transforms or forward AD) go to the original transformers function unchanged, with the
caller's own arguments (``fallback=True``, the default), so the patch never changes what
a model computes or which errors it raises; ``handle.fallbacks`` counts those calls.  With
``fallback=False`` inputs posenc does not take raise posenc's error instead.

Patch before ``torch.compile``: torch.compile guards the global functions it traced, so
patching (or undoing) after compiling recompiles every compiled region on its next call.
Exported or ahead-of-time compiled programs keep the functions they traced.
"""

from __future__ import annotations

from ._handle import PatchHandle, UnsupportedModelWarning, original_of
from ._patch import (  # noqa: F401
    INSTALLERS,
    KNOWN_MODEL_TYPES,
    patch,
    support,
    unsupported_model_types,
    written_supported,
)
from ._vision_utils import precompute_vision_kwargs

__all__ = ["KNOWN_MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "PatchHandle",  # noqa: F822
           "UnsupportedModelWarning", "original_of", "patch", "precompute_vision_kwargs",
           "unsupported_model_types"]


def __getattr__(name: str) -> object:
    # computed on each use, so that importing posenc_torch.hf does not import
    # transformers, and a changed function is seen
    if name == "SUPPORTED_MODEL_TYPES":
        return written_supported()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
