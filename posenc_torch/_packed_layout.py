"""Packed-row layouts: where the examples of packed rows lie, from whichever description
the caller gives (``seq_lens``, ``cu_seqlens`` or a packed ``attention_mask``), as the packed
position-id op takes it, and the lengths' errors in the caller's terms."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ._checks import (
    INT64_MAX,
    INT64_MIN,
    InputTypeError,
    InputValueError,
    check_tensor,
    check_tensors,
)


def _length(name: str, value: object) -> int:
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)):
        raise InputTypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if not INT64_MIN <= value <= INT64_MAX:  # read into an int64 tensor
        raise InputValueError(f"{name} must fit in int64, got {value}")
    return value


def _on_device_of(name: str, t: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """A layout tensor whose values are read here: on input_ids' device, or an error."""
    check_tensors(input_ids=input_ids, **{name: t})
    return t


def _rows_of(name: str, value: object, batch: int) -> list[list[int]]:
    """``value`` as one list of ints per row of input_ids: a (B, n) tensor or a sequence of
    B sequences; for B = 1 also a 1-D tensor or a flat sequence."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise InputTypeError(f"{name} must be an integer tensor, got {value.dtype}")
        if value.dim() == 1 and batch == 1:
            return [value.tolist()]
        if value.dim() != 2 or value.shape[0] != batch:
            raise InputValueError(
                f"{name} as a tensor must be (batch, n) with batch = {batch} (the "
                f"rows of input_ids){' or 1-D' if batch == 1 else ''}, got shape "
                f"{tuple(value.shape)}")
        return value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise InputTypeError(
            f"{name} must be a tensor or a list of lists of ints (one list per row), "
            f"got {type(value).__name__}")
    if batch == 1 and all(not isinstance(v, Sequence | torch.Tensor) or
                          (isinstance(v, torch.Tensor) and v.dim() == 0) for v in value):
        value = [value]
    if len(value) != batch:
        raise InputValueError(f"{name} must have one list per row of input_ids ({batch}), got "
                              f"{len(value)}")
    rows = []
    for b, row in enumerate(value):
        if isinstance(row, torch.Tensor):
            row = row.tolist() if row.dim() == 1 else row
        if not isinstance(row, Sequence) or isinstance(row, (str, bytes)):
            raise InputTypeError(f"{name}[{b}] must be a list of ints, got {type(row).__name__}")
        rows.append([_length(f"{name}[{b}][{k}]", v) for k, v in enumerate(row)])
    return rows


class PackedLayout(NamedTuple):
    """Where the packed examples lie, as the packed op takes it."""

    example_lens: torch.Tensor  # (N,) integer, in example order across the batch
    row_examples: torch.Tensor  # (B,) integer: examples per row


def packed_layout(input_ids: torch.Tensor, seq_lens: object, cu_seqlens: object,
                  attention_mask: object) -> PackedLayout:
    """The example lengths and examples per row from whichever of the three descriptions
    was given.  A (B, n) or 1-D tensor ``seq_lens`` is passed on as it is (no value is read:
    it traces); lists are read here; ``cu_seqlens`` must start every row at 0 and a packed
    mask must number its examples 1, 2, 3, ... (what the op cannot see).  The lengths'
    values (>= 0, within the row) are the op's to check."""
    given = [name for name, v in (("seq_lens", seq_lens), ("cu_seqlens", cu_seqlens),
                                  ("attention_mask", attention_mask)) if v is not None]
    if len(given) != 1:
        raise InputTypeError("pass exactly one of seq_lens, cu_seqlens and attention_mask, got "
                             f"{', '.join(given) if given else 'none'}")
    check_tensor("input_ids", input_ids, 2, "2-D (batch, seq)")  # the layout reads its shape
    batch, device = input_ids.shape[0], input_ids.device
    if attention_mask is not None:
        lens, per_row = _mask_layout(_on_device_of("attention_mask", attention_mask, input_ids),
                                     input_ids)
    elif isinstance(seq_lens, torch.Tensor) and (seq_lens.dim() == 2 or (
            seq_lens.dim() == 1 and batch == 1)):
        if seq_lens.dim() == 2 and seq_lens.shape[0] != batch:
            raise InputValueError(f"seq_lens as a tensor must be (batch, n) with batch = {batch} "
                                  f"(the rows of input_ids), got shape {tuple(seq_lens.shape)}")
        n = seq_lens.shape[-1]
        return PackedLayout(seq_lens.reshape(-1),
                       torch.full((batch,), n, dtype=torch.int64, device=seq_lens.device))
    elif seq_lens is not None:
        if isinstance(seq_lens, torch.Tensor):
            _on_device_of("seq_lens", seq_lens, input_ids)
        rows = _rows_of("seq_lens", seq_lens, batch)
        lens, per_row = [n for row in rows for n in row], [len(row) for row in rows]
    else:
        if isinstance(cu_seqlens, torch.Tensor):
            _on_device_of("cu_seqlens", cu_seqlens, input_ids)
        lens, per_row = [], []
        for b, row in enumerate(_rows_of("cu_seqlens", cu_seqlens, batch)):
            if not row or row[0] != 0:
                raise InputValueError(f"cu_seqlens[{b}] must start with 0 (cumulative lengths "
                                      f"[0, l0, l0 + l1, ...]), got {row[:3]}")
            lens += [row[k] - row[k - 1] for k in range(1, len(row))]
            per_row.append(len(row) - 1)
    return PackedLayout(torch.tensor(lens, dtype=torch.int64, device=device),
                   torch.tensor(per_row, dtype=torch.int64, device=device))


def explain_layout(input_ids: torch.Tensor, seq_lens: object, cu_seqlens: object) -> None:
    """The lengths' values in the caller's terms, run after the op refused them: a
    negative length or examples that need more tokens than a row has."""
    batch, length = input_ids.shape
    name = "seq_lens" if seq_lens is not None else "cu_seqlens"
    rows = _rows_of(name, seq_lens if seq_lens is not None else cu_seqlens, batch)
    example = 0
    for b, row in enumerate(rows):
        if name == "cu_seqlens":
            for k in range(1, len(row)):
                where = f"cu_seqlens[{b}][{k}] (end of example {example + k - 1})"
                if row[k] < row[k - 1]:
                    raise InputValueError(f"{where} is {row[k]}, below cu_seqlens[{b}][{k - 1}] = "
                                          f"{row[k - 1]}; cumulative lengths must not decrease")
                if row[k] > length:
                    raise InputValueError(f"{where} is {row[k]}, past the {length} tokens of the "
                                          "input_ids rows")
            example += len(row) - 1
            continue
        used = 0
        for k, n in enumerate(row):
            where = f"seq_lens[{b}][{k}] (example {example})"
            if n < 0:
                raise InputValueError(f"{where} is {n}; lengths must be >= 0")
            used += n
            if used > length:
                raise InputValueError(f"{where}: the examples of row {b} up to this one need "
                                      f"{used} tokens, but input_ids rows have {length}")
            example += 1


def _mask_layout(mask: object, input_ids: torch.Tensor) -> tuple[list[int], list[int]]:
    """Example lengths of a packed attention mask: per row example numbers 1, 2, 3, ... in
    order, 0 for padding after the last example."""
    check_tensor("attention_mask", mask, 2, "2-D (batch, seq) of example numbers")
    if mask.is_floating_point() or mask.is_complex():
        raise InputTypeError(f"attention_mask must hold integer example numbers (1, 2, 3, ... per "
                             f"row, 0 for padding), got {mask.dtype}")
    if mask.shape != input_ids.shape:
        raise InputValueError(
            f"attention_mask shape {tuple(mask.shape)} must equal input_ids shape "
            f"{tuple(input_ids.shape)}")
    m = mask.long()
    if m.numel() == 0:
        return [], [0] * m.shape[0]
    prev = torch.cat([torch.zeros_like(m[:, :1]), m[:, :-1]], dim=1)
    first = torch.zeros_like(m, dtype=torch.bool)
    first[:, 0] = True
    # a token continues its example, starts the next one, or (after an example) starts the
    # padding; the first token of a row is example 1 or padding
    ok = (m == prev) | ((m == prev + 1) & ((prev > 0) | first)) | ((m == 0) & (prev > 0))
    if not bool(ok.all()):
        b, j = divmod(int((~ok).flatten().int().argmax()), m.shape[1])
        after = int(m[b, j - 1]) if j else 0
        where = (f"after example {after} of row {b} (example "
                 f"{int(m[:b].amax(dim=1).sum()) + after - 1} of the batch)" if after > 0 else
                 "after padding" if j else "at the start of the row")
        raise InputValueError(
            f"attention_mask[{b}, {j}] is {int(m[b, j])} {where}: a packed mask numbers the "
            "examples of each row 1, 2, 3, ... in order, each example's tokens together, and "
            "holds 0 only for padding after the last example")
    top = int(m.max())
    counts = torch.bincount((m + (top + 1) * torch.arange(m.shape[0], device=m.device)[:, None])
                            .flatten(), minlength=m.shape[0] * (top + 1)).view(-1, top + 1)
    per_row = m.amax(dim=1).tolist()
    lens = [n for b, k in enumerate(per_row) for n in counts[b, 1:k + 1].tolist()]
    return lens, per_row
