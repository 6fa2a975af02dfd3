"""Use posenc_torch inside Hugging Face transformers models with one line.

    import posenc_torch.hf
    handle = posenc_torch.hf.patch()      # before building / compiling the model
    ...                                    # train or run as usual
    print(handle.calls)                    # proof that the posenc functions ran
    handle.undo()                          # or: with posenc_torch.hf.patch(): ...

This package is the one part of posenc_torch that reads the installed transformers; the
core imports nothing of it and no transformers, and reaches it only through
``posenc_torch._installed`` (``convention="installed"``).  Importing it does not import
transformers either.  docs/transformers.md says it all in full.

``patch`` replaces, for each model type it knows whose installed code fits: the decoder's
``apply_rotary_pos_emb`` in its forms (``_rotary``: Llama-like, adjacent pairs, partial
rotary, tables reshaped first, DeepSeek-V3's ``apply_rotary_pos_emb_interleave``), the
4.x ``apply_multimodal_rotary_pos_emb`` and the vision towers'
``apply_rotary_pos_emb_vision``; the Qwen-VL ``get_rope_index`` (``_rope_index``, with a
check of packed batches that would let examples attend to each other:
``_packing_guard``); the towers' grid computations, routed to posenc's C walks (the 5.x
``vision_utils`` functions: ``_vision_utils``, which also computes
``precompute_vision_kwargs``; the 4.57 tower methods: ``_tower_methods_457``).

A function is replaced only when the digest of its normalized code and of everything it
reaches (``_digests``) has a row in the verified table (``_table``, ``verified.json``),
which says what posenc runs for it.  ``python -m posenc_torch.hf.verify`` makes and
re-checks the rows (``make test`` runs it under every transformers release it installs);
a user on a release the table does not know runs it once with ``--write FILE`` and passes
``patch(table=FILE)``.  At run time nothing is traced and nothing is written.  While
patched, a replacement hands a call back to transformers when anything its row was
decided on has changed (a global, a closure cell, a default, a method reached through
``self`` on the object's own class).  A model type that fails is left to transformers
with one ``UnsupportedModelWarning`` naming it and the reason
(``unsupported_model_types()``); when no requested type remains, ``patch`` raises.

With the ``kernels`` package, transformers 5.x puts a hub-kernel layer in place of a
rotary function; ``patch`` decides on the function inside the layer and installs its
replacement in the layer's place (either order of ``patch`` and ``kernelize``; calls it
hands back go to the layer).  The rotary *modules* are left alone, so the patched model's
cos/sin tables are bit-identical to the unpatched one's.  Calls the posenc kernels do not
take (see ``patch``; also calls under functorch transforms or forward AD) go to the
original function with the caller's own arguments, counted in ``handle.fallbacks``, so the
patch never changes what a model computes or which errors it raises.  Patch before
``torch.compile``: patching or undoing after compiling recompiles every compiled region;
exported or ahead-of-time compiled programs keep the functions they traced.
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
