"""Position-id conventions: which transformers release's ``get_rope_index`` rules a walk
follows (``convention=``), and the Qwen-VL model types (``model=``), as the public functions
of ``posenc_torch.positions`` resolve them."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

import torch

from . import _installed
from ._checks import InputValueError, check_str
from ._tables import CONVENTIONS, MROPE_MODELS, Convention, ModelType

#: The position-id rules of the transformers releases that were checked bit for bit,
#: by the name ``convention=`` takes (each one's record is in ``posenc_torch._tables``):
#:
#: - ``"4.57"``: transformers 4.57 (checked: 4.57.6).  Vision items are found in the token
#:   ids (a placeholder right after ``vision_start_token_id``); text after an item resumes
#:   at the item's largest position + 1; padded slots hold 1; deltas are
#:   ``max + 1 - L`` with L the padded length; Qwen2.5-VL truncates
#:   ``second_per_grid_ts`` to an integer and gives images temporal index 0.
#: - ``"5.17"``: transformers 5.17 (checked: 5.17.0).  Vision items are the runs of
#:   ``mm_token_type_ids`` (0 text, 1 image, 2 video; token ids are not read); text after an
#:   item resumes at its start + ``max(h, w) // merge`` (frames do not count); padded slots
#:   hold 0; deltas are ``max + 1 - (number of real tokens)``; Qwen2.5-VL's temporal step is
#:   ``tokens_per_second * int(second_per_grid_ts)``, images use the frame index.
#: - ``"5.18"``: transformers 5.18 and later 5.x (checked: 5.18.0, 5.25.0).  As 5.17, except
#:   that Qwen2.5-VL keeps the fraction of the seconds: frame k of a video gets
#:   ``long(k * (tokens_per_second * s))`` computed in the dtype of ``second_per_grid_ts``
#:   (float32 as the processor returns it; float64 when given so).
MROPE_CONVENTIONS = tuple(CONVENTIONS)


def _installed_transformers_version() -> str | None:
    """The version of the transformers that ``import transformers`` gives, without
    importing it when it is not imported yet; None when it is not installed."""
    module = sys.modules.get("transformers")
    if module is not None and getattr(module, "__version__", None):
        return module.__version__
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def convention_for_version(version: str) -> str:
    """The convention (one of :data:`MROPE_CONVENTIONS`) that the checked releases of
    transformers ``version``'s line follow: "4.57" for 4.x, "5.17", "5.18" for 5.18 and
    later 5.x.  ValueError for 5.0 to 5.16 (rewritten and fixed over several releases)
    and 6 or later.  A version number is a name, not a behaviour: ``"installed"`` (see
    :func:`resolve_convention`) runs the installed code instead, and this mapping only
    names which of two conventions that give the same results for a model is reported."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        raise InputValueError(f"cannot read the transformers version {version!r}") from None
    for convention in CONVENTIONS.values():
        if convention.names_release(major, minor):
            return convention.name
    checked = ", ".join(r for c in CONVENTIONS.values() for r in c.checked)
    raise InputValueError(
        f"the position-id rules of transformers {version} were not checked (checked: "
        f"{checked}); pass convention= one of {MROPE_CONVENTIONS} explicitly")


def _constant_when_traced(fn: Callable[..., str]) -> Callable[..., str]:
    """``torch.compiler.assume_constant_result(fn)`` (traced code gets the answer, not the
    check) without importing ``torch._dynamo`` with posenc_torch (about a second): the
    marker that decorator sets, set here while dynamo is not loaded
    (``tests/test_layers.py`` checks that the decorator still sets just that)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@_constant_when_traced
def _installed_convention(model: str) -> str:
    if _installed_transformers_version() is None:
        raise InputValueError(
            "convention='installed' needs transformers installed; without it pass "
            f"convention= one of {MROPE_CONVENTIONS}")
    return _installed.ask("convention", model)


def resolve_convention(convention: str, model: str | None = None) -> str:
    """``convention`` itself, or for ``"installed"`` the one whose rules the installed
    transformers' ``get_rope_index`` of ``model`` (a model type such as "qwen2_vl";
    "qwen2_vl" when None, for the rules every model shares) follows.

    That is decided by code, not by version number: the digest of the installed
    ``get_rope_index`` and of everything it calls is looked up in the verified table,
    whose row names the convention (``posenc_torch.hf._rope_index``; the verify command
    and the tests check each row against the walk on prompts that tell the conventions
    apart); this imports transformers and the model's modeling module.
    ValueError when transformers is not installed, or when the digest has no row."""
    return convention_record(convention, model).name


def convention_record(convention: str, model: str | None = None) -> Convention:
    """The record of :func:`resolve_convention`'s answer."""
    if model is not None:
        model_record(model)
    if convention == "installed":
        return CONVENTIONS[_installed_convention(model or "qwen2_vl")]
    record = CONVENTIONS.get(check_str("convention", convention))
    if record is None:
        raise InputValueError(f"convention must be 'installed' or one of {MROPE_CONVENTIONS}, got "
                              f"{convention!r}")
    return record


def model_record(model: object) -> ModelType:
    """The table record of a Qwen-VL model type."""
    record = MROPE_MODELS.get(model) if isinstance(model, str) else None
    if record is None:
        check_str("model", model)
        raise InputValueError(f"model must be one of {sorted(MROPE_MODELS)}, got {model!r}")
    return record
