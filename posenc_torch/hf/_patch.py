"""``patch()``: which model types the installed transformers lets posenc patch, and the
installation of every replacement (rotary functions, get_rope_index, the packed-batch
guard) under one handle."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Sequence

from .._tables import MODELS
from . import (_packing_guard, _qk_attention, _rope_index, _rotary, _table, _tower_methods_457,
               _transformers, _vision_utils)
from ._handle import _ACTIVE, LOCK, PatchHandle, UnsupportedModelWarning

# The model types this integration knows and tests (tests/test_hf_models.py builds each
# from a tiny config), from the one model table.  ``SUPPORTED_MODEL_TYPES`` is the subset
# written for the installed release (``_table.releases()``).
KNOWN_MODEL_TYPES: tuple[str, ...] = tuple(MODELS)

# Run by ``patch`` after the rotary functions, in order, each as
# ``installer(handle, model_types)``; they replace attributes with
# ``handle.install(owner, name, replacement, target)``, so ``undo()`` reverses them too.
INSTALLERS: list[Callable[[PatchHandle, tuple[str, ...]], None]] = [
    _qk_attention.install, _rope_index.install, _vision_utils.install, _tower_methods_457.install,
    _packing_guard.install]


def written_supported() -> tuple[str, ...]:
    """The model types ``patch()`` patches under the installed transformers release, as
    written for it in the verified table's release facts (empty for a release they do
    not name); reading it imports no modeling module and decides nothing."""
    patched = set(_table.releases()["patched"].get(_transformers.version(), ()))
    return tuple(mt for mt in KNOWN_MODEL_TYPES if mt in patched)


def support(table: str | None = None) -> dict[str, str | None]:
    """Per known model type: None if the installed code lets posenc patch it, else the
    reason (imports the modeling modules; a digest lookup per rotary function)."""
    rows = _table.user_rows(table, _transformers.version())
    reasons: dict[str, str | None] = {}
    for mt in KNOWN_MODEL_TYPES:
        try:
            _rotary.plan(mt, _transformers.modeling_module(mt), rows)
            reasons[mt] = None
        except _transformers.Unsupported as e:
            reasons[mt] = str(e)
    return reasons


def unsupported_model_types() -> dict[str, str]:
    """The model types of ``KNOWN_MODEL_TYPES`` that ``patch`` does not take with the
    installed transformers, each with the reason (computed from the installed code)."""
    return {mt: reason for mt, reason in support().items() if reason is not None}


def _normalize(model_types: str | Iterable[str] | None) -> tuple[str, ...]:
    if isinstance(model_types, str):
        model_types = [model_types]
    if not isinstance(model_types, Iterable):
        raise TypeError(f"model_types must be a model type, a sequence of them or None, got "
                        f"{type(model_types).__name__}")
    out: list[str] = []
    for mt in model_types:
        if not isinstance(mt, str):
            raise TypeError(f"model_types must be strings, got {type(mt).__name__}")
        if mt not in KNOWN_MODEL_TYPES:
            raise ValueError(f"model type {mt!r} is not supported; known model types: "
                             f"{', '.join(KNOWN_MODEL_TYPES)}")
        if mt not in out:
            out.append(mt)
    if not out:
        raise ValueError("model_types is empty")
    return tuple(out)


def patch(model_types: str | Sequence[str] | None = None, *,
          fallback: bool = True, count: bool = True,
          table: str | os.PathLike | None = None, fuse_qk_norm: bool = True) -> PatchHandle:
    """Make transformers models use the posenc rotary kernels.

    Args:
        model_types: one or more of ``KNOWN_MODEL_TYPES`` (``model.config.model_type``,
            e.g. "llama", "qwen2_vl", "phi3"); None patches every one the installed
            transformers lets posenc patch (which imports the modeling module of every
            known type).  A requested type whose installed code has no row in the verified
            table is left to transformers with one ``UnsupportedModelWarning`` naming it,
            the reason and the verify command.
        fallback: hand inputs the posenc kernels do not take (tensors on a device they were
            not built for: CUDA tensors unless ``posenc_torch._C.has_cuda()``; shapes other
            than transformers' layouts, an ``mrope_section`` that does not fit) to the
            original transformers function (True), or raise posenc's error (False).
            Calls in argument forms other than transformers' go to the original function
            either way.
        count: keep ``handle.calls`` / ``handle.fallbacks``.  Each counter is a CPU scalar
            tensor bumped in place, which compiled graphs include as a tiny op; pass False
            to leave it out (e.g. for CUDA graphs on the fallback path).
        table: a table file written by ``python -m posenc_torch.hf.verify --write FILE``
            for a transformers release the shipped table does not know (default: the
            ``POSENC_TORCH_HF_TABLE`` environment variable, else none).  A file that is
            malformed, foreign (another release or format), not a regular file of the
            user's own, or whose rotary rows fail a sampled check is not used (one
            warning).
        fuse_qk_norm: in the attentions that norm q and k per head right before the
            rotary (Qwen3, Qwen3-VL, Qwen3-Next, Qwen3.5, Gemma 3, ...: the verified
            table's "fused" release facts list them per release), run the norms and the
            rotary as posenc's one fused op (``apply_qk_norm_rope``) by replacing the
            attention's ``forward`` (True, the default; the same bits as without it), or
            leave the norms to transformers and replace the rotary alone (False).

    Returns:
        A ``PatchHandle``; ``handle.undo()`` (or leaving ``with patch(...):``) restores the
        original functions; ``handle.calls`` / ``handle.fallbacks`` count the calls per
        replaced function.

    Raises:
        ValueError: a model type this module does not know.
        RuntimeError: none of the requested types can be patched (the installed transformers
            lacks the model, its attention calls none of the rotary functions posenc
            replaces, or its rotary function does not compute what posenc computes:
            ``unsupported_model_types()`` says which and why), or a function is already
            patched by another active handle.

    Call it before ``torch.compile`` (patching later recompiles the compiled regions on
    their next call).  It patches the functions in transformers' modules, so it affects
    every model of those types in the process, including ones built before the call.
    ``patch`` and ``undo`` are thread-safe (one lock orders them).
    """
    for name, flag in (("fallback", fallback), ("count", count),
                       ("fuse_qk_norm", fuse_qk_norm)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    requested = KNOWN_MODEL_TYPES if model_types is None else _normalize(model_types)
    with LOCK:
        rows = _table.user_rows(table, _transformers.version())
        plans, refused, absent = [], {}, {}
        for mt in requested:
            try:
                module = _transformers.modeling_module(mt)
                plans.append((mt, module, _rotary.plan(mt, module, rows)))
            except _transformers.Absent as e:
                (absent if model_types is None else refused)[mt] = str(e)
            except _transformers.Unsupported as e:
                refused[mt] = str(e)
        if not plans:  # (absent types included: nothing at all could be patched)
            refused.update(absent)
            if len(refused) == 1:
                raise RuntimeError(f"posenc_torch.hf.patch: {next(iter(refused.values()))}")
            raise RuntimeError("posenc_torch.hf.patch: none of the model types can be patched "
                               "with the installed transformers: " +
                               "; ".join(f"{mt}: {why}" for mt, why in refused.items()))
        for mt, module, names in plans:
            for planned in names:
                name = planned.name
                owner = _ACTIVE.get((module.__name__, name))
                if owner is not None:
                    raise RuntimeError(
                        f"posenc_torch.hf.patch: {mt}.{name} is already patched by "
                        f"{owner!r}; undo that handle first")
        # Code without a row: one warning for all such types, naming the command once.
        unknown = {mt: why for mt, why in refused.items() if _table.COMMAND in why}
        if len(unknown) > 1:
            hint = f" (run `{_table.COMMAND}` and pass patch(table=FILE) or set {_table.ENV})"
            warnings.warn(
                f"posenc_torch.hf.patch leaves {', '.join(unknown)} to transformers: their code "
                "has no row in the verified table" + hint + ": " + "; ".join(
                    f"{mt}: {why.split(' (run `')[0]}" for mt, why in unknown.items()),
                UnsupportedModelWarning, stacklevel=2)
        for mt, why in refused.items():
            if len(unknown) <= 1 or mt not in unknown:
                warnings.warn(f"posenc_torch.hf.patch leaves {mt} to transformers: {why}",
                              UnsupportedModelWarning, stacklevel=2)
        handle = PatchHandle(tuple(mt for mt, _, _ in plans), fallback, count, rows,
                             fuse_qk_norm)
        try:
            _rotary.install(handle, plans)
            for installer in INSTALLERS:
                installer(handle, handle.model_types)
        except BaseException:
            handle.undo()
            raise
    return handle
