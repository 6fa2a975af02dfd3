"""The core's one hook into what the installed transformers does.

A few answers of the core depend on the installed transformers' code, which only the
transformers integration reads (``posenc_torch.hf``): the position-id rules of a model
type's ``get_rope_index`` (``convention="installed"``), for instance.  The core asks
:func:`ask`; the integration's module that answers a question registers its answer with
:func:`provide` when it is imported, and the first question imports that module by name.
So importing a core module never loads the integration or transformers, and the core
names no module of the integration besides the table below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

# question -> the module of the integration that answers it (registers with provide()).
_PROVIDERS: dict[str, str] = {
    # (model_type: str) -> the name of the convention its installed get_rope_index follows;
    # ValueError when transformers is not installed or the digest of its code has no row
    # in the verified table (posenc_torch.hf._table).
    "convention": "posenc_torch.hf._rope_index",
    # (config_or_model, image_grid_thw, video_grid_thw) -> the vision tower's precomputed
    # kwargs the installed transformers accepts for that model ({} when none).
    "vision_kwargs": "posenc_torch.hf._vision_utils",
}
_ANSWERS: dict[str, Callable[..., object]] = {}


def provide(question: str, answer: Callable[..., object]) -> None:
    """Register ``answer`` for ``question`` (called by the integration's modules)."""
    if question not in _PROVIDERS:
        raise ValueError(f"unknown question {question!r}; known: {sorted(_PROVIDERS)}")
    _ANSWERS[question] = answer


def ask(question: str, *args: object) -> object:
    """The integration's answer to ``question`` for ``args`` (imports its module once)."""
    answer = _ANSWERS.get(question)
    if answer is None:
        importlib.import_module(_PROVIDERS[question])
        answer = _ANSWERS[question]
    return answer(*args)
