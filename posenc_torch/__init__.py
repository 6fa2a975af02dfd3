"""posenc_torch: rotary position embeddings for PyTorch with C kernels.

RoPE and the multimodal RoPE (MRoPE) of Qwen2-VL / Qwen2.5-VL / Qwen3-VL, forward and
backward, as ``torch.ops.posenc`` custom ops with autograd and ``torch.compile`` support,
the sinusoidal absolute position table, and (``posenc_torch.vision``) what the vision
towers compute from their patch grids.
The functions are drop-ins for the transformers functions of the same names.
"""

import torch  # noqa: F401  (maps libtorch before the extension is loaded)

from . import _C  # noqa: F401  (registers torch.ops.posenc)
from . import ops  # noqa: F401  (fake kernels and autograd formulas)
from . import vision  # noqa: F401  (the vision towers' position ids, boundaries, taps)
from ._checks import InputError, InputTypeError, InputValueError
from .positions import (
    compute_mrope_decode_position_ids,
    compute_packed_mrope_position_ids,
    compute_mrope_position_ids,
)
from .qk_norm import apply_qk_norm_rope
from .rope import (
    apply_multimodal_rotary_pos_emb,
    apply_rope,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_vision,
    compute_mrope_cos_sin,
)
from .sinusoidal import sinusoidal_position_encoding
from .vision import vision_rotary_position_ids

__version__ = "0.1.0"

__all__ = [
    "apply_rotary_pos_emb",
    "apply_multimodal_rotary_pos_emb",
    "apply_rotary_pos_emb_vision",
    "apply_rope",
    "apply_qk_norm_rope",
    "compute_mrope_cos_sin",
    "compute_mrope_position_ids",
    "compute_mrope_decode_position_ids",
    "compute_packed_mrope_position_ids",
    "vision_rotary_position_ids",
    "sinusoidal_position_encoding",
    "kernel_isa",
    "set_kernel_isa",
    "InputError",
    "InputTypeError",
    "InputValueError",
]


def kernel_isa() -> str:
    """Name of the SIMD kernel variant in use: 'baseline', 'avx2', 'avx512' or 'avx512bf16'
    (AVX-512 with bf16 rounded by the hardware's AVX512_BF16, to the same bits)."""
    return _C.isa()


def set_kernel_isa(name: str | None) -> None:
    """Force a SIMD kernel variant ('baseline', 'avx2', 'avx512', 'avx512bf16'); None picks the
    best.

    Meant for tests and benchmarks.  TypeError for a name that is not a str or None,
    ValueError for an unknown name or a variant this CPU lacks (both :class:`InputError`).
    """
    if name is not None and not isinstance(name, str):
        raise InputTypeError(f"name must be a str or None, got {type(name).__name__}")
    try:
        _C.set_isa(_C.best_isa() if name is None else name)
    except ValueError as err:  # the extension module's own check (plain Python C API)
        message = str(err)
        if message.startswith("isa "):  # the argument's name here
            message = "name " + message[len("isa "):]
        raise InputValueError(message) from None
