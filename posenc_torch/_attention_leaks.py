"""The attention-leak guard of packed batches: the calls that would let the examples of a
packed row attend to each other, seen from the arguments a Qwen-VL model receives
(``posenc_torch.packing.packed_attention_leaks`` / ``warn_packed_attention_leaks``, and the
guard of ``posenc_torch.hf.patch``)."""

from __future__ import annotations

import warnings

import torch

from ._checks import InputTypeError, InputValueError, check_bool, check_tensor

CACHE_LEAK = (
    "packed position ids (several sequences in a row) reach the model with a KV cache "
    "(use_cache on, or past_key_values given): transformers then builds a plain causal mask "
    "(and a cache that holds several examples of a row), so the examples of a row attend "
    "to each other; pass use_cache=False (the batches of posenc_torch.packing carry it)")
MASK_LEAK = (
    "packed position ids (several sequences in a row) reach the model with a 2-D "
    "attention_mask: transformers then builds the mask from it alone (flash-attention, for a "
    "mask that holds a 0, unpads by it and ignores cu_seq_lens), and the examples of a row "
    "attend to each other; pass no attention_mask with a packed batch")
FLASH_LEAK = (
    "packed position ids in a batch of several rows reach a flash-attention model without "
    "cu_seq_lens_q/k: transformers reads the boundaries from position ids only for one row, "
    "so the examples of a row attend to each other; pass cu_seq_lens_q/k and "
    "max_length_q/k (the batches of posenc_torch.packing carry them), or one row")
BOUNDARY_LEAK = (
    "cu_seq_lens_q/k given to a flash-attention model mark other boundaries than the "
    "examples of the packed position ids (each starting at position 0): attention follows "
    "cu_seq_lens, so examples attend to each other or are cut; pass the boundaries "
    "posenc_torch.packing computes (return_flash_attn_kwargs=True)")
TEXT_ROW_LEAK = (
    "packed position ids without the text-position row ((batch, seq), (1 or 3, batch, seq)) "
    "reach a Qwen-VL model: transformers finds packed sequences only in the text row of the "
    "(4, batch, seq) layout, so the examples of a row attend to each other; pass the 4-row "
    "position ids of posenc_torch.compute_packed_mrope_position_ids")
SPLIT_LEAK = (
    "the text positions of a packed example are not consecutive: transformers starts a new "
    "sequence wherever a text position is not one more than the one before (flash-attention "
    "with one row: wherever it is the row's smallest), so it splits or joins examples "
    "otherwise than their positions say; give each example the text positions 0, 1, 2, ...")


def _starts(rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: where the position ids' examples start: each row's first kept token,
    and every kept token whose positions are all 0 (an example's first)."""
    first = keep & (keep.cumsum(-1) == 1)
    return first | (keep & (rows == 0).all(0))


def packed_attention_leaks(
    position_ids: torch.Tensor | None,
    *,
    attention_mask: torch.Tensor | None = None,
    use_cache: bool = False,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    attn_implementation: str | None = None,
) -> list[str]:
    """Why the examples of a packed batch would not each get their own attention in this
    model call, as messages (empty when they do, or when the position ids are not packed).

    The arguments are those a Qwen-VL model's ``forward`` receives (transformers 4.57 and
    5.x):
        position_ids:        (4, B, L) with the text positions in row 0; (3, B, L),
                             (1, B, L) (one row for every axis, as ``generate`` passes
                             when it continues from a cache) or (B, L), without a text
                             row; None: not packed
        attention_mask:      as passed to the model; a 2-D (B, L) mask counts, any other
                             (a 4-D mask) is the caller's own: never a reason
        use_cache:           whether the call builds or reads a KV cache: ``use_cache``
                             resolved against the model's config, or ``past_key_values``
                             given
        cu_seq_lens_q/k:     the varlen boundaries passed along, or None
        attn_implementation: ``config._attn_implementation`` (a name containing "flash"
                             is a flash-attention implementation)

    The examples are what the position ids say: a new one starts at each kept token whose
    positions are all 0 (each row's first kept token starts one too); packed means that
    some row holds several.  For a packed batch this computes where transformers will let
    attention start a new sequence, as it does: with a 2-D mask (under flash-attention a
    mask that holds a 0: it drops one of all ones), only at each row's start; under
    flash-attention, at ``cu_seq_lens_q`` when both boundaries are given, else with one row
    wherever the text position is the row's smallest, else at each row's start; otherwise,
    with a cache at each row's start, and without one wherever a text position (row 0 of
    the 4-row layout; none in the others) is not one more than the one before.  A reason is
    given exactly when those starts differ from the examples', naming the cause; a KV cache
    with packed examples is always one (it holds several examples of a row, which a later
    decoding step would attend across).  Reading the position ids costs one device sync.
    TypeError for arguments of the wrong type (``use_cache`` not a bool, position ids or
    ``cu_seq_lens`` not integer tensors, a complex mask), ValueError for position ids of
    another shape and for a meta tensor beside tensors with values.
    """
    check_bool("use_cache", use_cache)
    if attn_implementation is not None and not isinstance(attn_implementation, str):
        raise InputTypeError(f"attn_implementation must be a str or None, got "
                             f"{type(attn_implementation).__name__}")
    for name, t in (("attention_mask", attention_mask), ("cu_seq_lens_q", cu_seq_lens_q),
                    ("cu_seq_lens_k", cu_seq_lens_k)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
    if attention_mask is not None and attention_mask.is_complex():
        raise InputTypeError(f"attention_mask must be bool, integer or floating, got "
                             f"{attention_mask.dtype}")
    for name, t in (("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k)):
        if t is not None and not _is_integer(t):
            raise InputTypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if position_ids is None:
        return []
    check_tensor("position_ids", position_ids, (2, 3), "(1, 3 or 4, batch, seq) or (batch, seq)")
    if not _is_integer(position_ids):
        raise InputTypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    if position_ids.dim() == 3 and position_ids.shape[0] not in (1, 3, 4):
        raise InputValueError(f"position_ids must be (1, 3 or 4, batch, seq) or (batch, seq), "
                              f"got shape {tuple(position_ids.shape)}")
    if attention_mask is not None and attention_mask.dim() != 2:
        return []  # the caller's own mask
    rows = position_ids if position_ids.dim() == 3 else position_ids.unsqueeze(0)
    batch, length = rows.shape[1:]
    mask = attention_mask if attention_mask is not None and attention_mask.shape == \
        rows.shape[1:] else None
    if mask is not None and mask.is_meta != rows.is_meta:  # a mask that would be read
        raise InputValueError(f"attention_mask is on {mask.device} but position_ids is on "
                              f"{rows.device}; meta tensors cannot be mixed with others")
    if rows.is_meta or length == 0:
        return []
    rows = rows.long()
    keep = torch.ones(batch, length, dtype=torch.bool, device=rows.device) if mask is None \
        else mask.to(device=rows.device) != 0
    examples = _starts(rows, keep)
    flash = attn_implementation is not None and "flash" in attn_implementation
    text = rows[0] if rows.shape[0] == 4 else None
    row_starts = _starts(rows.new_ones(1, batch, length), keep)  # each row's first only
    reasons = [CACHE_LEAK] if use_cache else []
    if mask is not None and (not flash or not bool((mask != 0).all())):
        starts, cause = row_starts, MASK_LEAK
    elif flash and cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        total = batch * length
        flat = torch.zeros(total + 1, dtype=torch.bool, device=rows.device)
        bounds = cu_seq_lens_q.to(device=rows.device, dtype=torch.long).flatten()
        if (bounds.numel() >= 2 and bool((bounds.diff() >= 0).all())
                and int(bounds[0]) == 0 and int(bounds[-1]) == total):
            flat[bounds] = True  # (else boundaries of another batch: no start matches)
        starts, cause = flat[:-1].view(batch, length), BOUNDARY_LEAK
    elif flash and text is not None and batch == 1:
        arange = torch.arange(length, device=rows.device) + text.min()
        packed = bool((text[0] != arange).any())
        starts = (text == text.min()) | row_starts if packed else row_starts
        cause = SPLIT_LEAK
    elif flash:
        starts, cause = row_starts, FLASH_LEAK if batch > 1 else TEXT_ROW_LEAK
    elif use_cache:
        starts, cause = row_starts, CACHE_LEAK
    elif text is not None:
        before = torch.cat([text[:, :1] - 1, text[:, :-1]], dim=-1)
        starts, cause = ((text - before) != 1) | row_starts, SPLIT_LEAK
    else:
        starts, cause = row_starts, TEXT_ROW_LEAK
    if not bool((examples.sum(-1) > 1).any()):
        return []  # one example a row: nothing to keep apart
    if not torch.equal(starts & keep, examples) and cause not in reasons:
        reasons.append(cause)
    return reasons


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


_WARNED: set[str] = set()


def warn_packed_attention_leaks(position_ids: torch.Tensor | None,
                                **arguments: object) -> list[str]:
    """:func:`packed_attention_leaks` with the same arguments, each reason warned once per
    process (``UserWarning``); returns the reasons found in this call."""
    reasons = packed_attention_leaks(position_ids, **arguments)
    for reason in reasons:
        if reason not in _WARNED:
            _WARNED.add(reason)
            warnings.warn(reason, UserWarning, stacklevel=2)
    return reasons
