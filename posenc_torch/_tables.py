"""The project's two tables: the position-id rule sets (conventions) and the model types.

Everything else that needs a convention's behaviour or a model type's properties reads it
from here: the position walks and packing (core), and the transformers integration
(``posenc_torch.hf``), whose lists of model types are derived from :data:`MODELS`.  The
numbers passed to the C walks are the enums of ``csrc/posenc.h`` (``tests/test_constants.py``
holds the two together).  This module imports nothing but the standard library.
"""

from __future__ import annotations

from typing import NamedTuple

# pe_mrope_rules
RULES_4_57, RULES_5 = 0, 1
# pe_mrope_time (Qwen2.5-VL's temporal step; TIME_F64, 0, is the walk's default)
TIME_F64, TIME_TRUNC_SECONDS, TIME_F32, TIME_F64_INTERVAL = 0, 1, 2, 3


class Convention(NamedTuple):
    """The position-id rules of ``get_rope_index`` as one line of transformers releases
    computes them (see ``posenc_torch.positions`` for each rule in words).

    name: what ``convention=`` takes ("4.57", "5.17", "5.18").
    rules: pe_mrope_rules: RULES_4_57 (vision runs found from the vision-start and
        placeholder token ids) or RULES_5 (runs of ``mm_token_type_ids``).
    fractional_seconds: Qwen2.5-VL keeps the fraction of ``second_per_grid_ts`` and computes
        the temporal step in the seconds' own float dtype (5.18 and later); otherwise each
        value is truncated to an integer first.
    integral_tokens_per_second: Qwen2.5-VL's ``tokens_per_second`` must be integral (5.17
        multiplies it with ``int(s)`` and fails otherwise).
    lines: the ``(major, minor)`` release lines it names: ``minor`` None for every minor
        release of ``major``, else that minor release and, with ``later``, the later ones.
    later: see ``lines``.
    checked: the releases it was checked against, bit for bit.
    """

    name: str
    rules: int
    fractional_seconds: bool
    integral_tokens_per_second: bool
    lines: tuple[tuple[int, int | None], ...]
    later: bool
    checked: tuple[str, ...]

    @property
    def v5(self) -> bool:
        """Vision runs are read from ``mm_token_type_ids`` (the 5.x processors' output)."""
        return self.rules == RULES_5

    def names_release(self, major: int, minor: int) -> bool:
        """True when transformers ``major.minor`` belongs to this convention's lines."""
        for line_major, line_minor in self.lines:
            if major == line_major and (line_minor is None or minor == line_minor
                                        or (self.later and minor > line_minor)):
                return True
        return False

    def same_rules_for(self, other: Convention, reads_seconds: bool) -> bool:
        """Both conventions give the same ids for every prompt of a model that does
        (``reads_seconds``) or does not read ``second_per_grid_ts``."""
        if self.rules != other.rules:
            return False
        if not reads_seconds:
            return True
        return (self.fractional_seconds == other.fractional_seconds
                and self.integral_tokens_per_second == other.integral_tokens_per_second)


#: The rule sets by name, oldest first.
CONVENTIONS: dict[str, Convention] = {c.name: c for c in (
    Convention("4.57", RULES_4_57, fractional_seconds=False, integral_tokens_per_second=False,
               lines=((4, None),), later=False, checked=("4.57.6",)),
    Convention("5.17", RULES_5, fractional_seconds=False, integral_tokens_per_second=True,
               lines=((5, 17),), later=False, checked=("5.17.0",)),
    Convention("5.18", RULES_5, fractional_seconds=True, integral_tokens_per_second=False,
               lines=((5, 18),), later=True, checked=("5.18.0", "5.25.0")),
)}


class ModelType(NamedTuple):
    """One transformers model type the project knows.

    name: ``config.model_type``.
    mrope: the pe_mrope_model id of its ``get_rope_index`` rules (Qwen-VL family), else
        None (a text model: only its rotary function is replaced).
    reads_seconds: its position ids read ``second_per_grid_ts`` (Qwen2.5-VL).
    vision_rotary: its vision tower calls ``apply_rotary_pos_emb_vision``.
    multimodal_rotary: ``posenc_torch.hf`` replaces the 4.x multimodal rotary function
        (``apply_multimodal_rotary_pos_emb``) where its attention calls it (the Qwen-VL
        types with a vision tower, Llama and Qwen2); for the others such a call means a
        section merge posenc does not run, and the type is refused.
    """

    name: str
    mrope: int | None = None
    reads_seconds: bool = False
    vision_rotary: bool = False
    multimodal_rotary: bool = False


# pe_mrope_model
MROPE_QWEN2_VL, MROPE_QWEN2_5_VL, MROPE_QWEN3_VL = 0, 1, 2

#: Every model type the project knows, in the order ``posenc_torch.hf`` patches them.
MODELS: dict[str, ModelType] = {m.name: m for m in (
    # The first five: Llama, Qwen2, and the Qwen-VL models with their vision towers.
    ModelType("llama", multimodal_rotary=True),
    ModelType("qwen2", multimodal_rotary=True),
    ModelType("qwen2_vl", MROPE_QWEN2_VL, vision_rotary=True, multimodal_rotary=True),
    ModelType("qwen2_5_vl", MROPE_QWEN2_5_VL, reads_seconds=True, vision_rotary=True,
              multimodal_rotary=True),
    ModelType("qwen3_vl", MROPE_QWEN3_VL, vision_rotary=True, multimodal_rotary=True),
    # Llama's rotate_half math (olmo*: the result is cast back to q's and k's dtypes).
    *(ModelType(name) for name in (
        "mistral", "mixtral", "ministral", "gemma", "gemma2", "gemma3", "phi", "qwen2_moe",
        "qwen3", "qwen3_moe")),
    ModelType("qwen3_vl_moe", MROPE_QWEN3_VL),  # Qwen3-VL's position rules
    *(ModelType(name) for name in (
        "olmo", "olmo2", "olmo3", "granite", "granitemoe", "starcoder2", "smollm3",
        "deepseek_v3", "exaone4", "seed_oss", "apertus", "hunyuan_v1_dense", "paddleocr_vl")),
    # Adjacent pairs (2i, 2i+1).
    *(ModelType(name) for name in ("cohere", "cohere2", "glm4v")),
    # Partial rotary: tables narrower than head_dim, the other channels pass through.
    *(ModelType(name) for name in (
        "phi3", "gpt_neox", "qwen3_next", "qwen3_5", "qwen3_5_moe", "glm4_moe", "glm4v_moe")),
    # Tables reshaped inside the function.
    *(ModelType(name) for name in ("glm", "glm4", "ernie4_5", "gpt_oss")),
)}

#: Model types with Qwen-VL position ids (``get_rope_index``), by name.
MROPE_MODELS: dict[str, ModelType] = {n: m for n, m in MODELS.items() if m.mrope is not None}
