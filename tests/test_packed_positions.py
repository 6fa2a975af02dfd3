"""Packed rows: ``compute_packed_mrope_position_ids`` against the ``get_rope_index`` of the
installed transformers run on every example alone (``make test`` runs this file under
5.17.0, 4.57.6, 5.18.0 and the newest 5.x).

- qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe; examples with images, videos (Qwen2.5-VL:
  fractional seconds per grid, float32 and float64), long videos, text-only examples and
  examples of one token, packed into one row or several rows, with padding after the last
  example (and a row of padding only): rows 1-3 equal transformers' ids of each example
  alone, row 0 restarts at every example, padding counts 0, 1, 2, ...
- The three ways to describe the rows (``seq_lens``, ``cu_seqlens``, a packed
  ``attention_mask``) give the same result.
- transformers' own readers of packed position ids (``find_packed_sequence_indices`` for
  eager/sdpa, ``prepare_fa_kwargs_from_position_ids`` for flash-attention) split the rows
  exactly at the examples, with the padding as a sequence of its own.
- Every class of bad input raises the documented exception naming the argument and the
  example.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_hf_positions import (
    IMG,
    MODEL_TYPES,
    PAD,
    V5,
    VID,
    VS,
    api_kwargs,
    make_batch,
    rope_index,
    stand_in,
)
from transformers.masking_utils import find_packed_sequence_indices
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

import posenc_torch
from posenc_torch import compute_packed_mrope_position_ids

pytestmark = pytest.mark.any_transformers

PER_EXAMPLE = ("input_ids", "attention_mask", "mm_token_type_ids")


def example(seed: int, model_type: str, kind: str, **case) -> dict:
    """One example alone, as get_rope_index takes it: a batch of one row, no padding.
    ``kind``: "vision" (make_batch's layout: text with 1 to 4 images and videos), "text"
    or "one" (a single text token)."""
    if kind == "vision":
        kw = make_batch(seed, model_type, 1, "right", **case)
        n = int(kw["attention_mask"].sum())
        return {k: (v[:, :n] if k in PER_EXAMPLE else v) for k, v in kw.items()}
    n = 1 if kind == "one" else random.Random(seed).randint(2, 40)
    ids = torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(seed))
    kw = dict(input_ids=ids, image_grid_thw=None, video_grid_thw=None,
              attention_mask=torch.ones_like(ids))
    if model_type == "qwen2_5_vl":
        kw["second_per_grid_ts"] = None
    if V5:
        kw["mm_token_type_ids"] = torch.zeros_like(ids, dtype=torch.int32)
    return kw


def length(ex: dict) -> int:
    return ex["input_ids"].shape[1]


def cat_rows(tensors: list) -> torch.Tensor | None:
    tensors = [t for t in tensors if t is not None]
    return torch.cat(tensors) if tensors else None


def pack(examples: list[dict], rows: list[list[int]], extra: int) -> tuple[dict, list]:
    """The examples laid end to end in rows (``rows[b]``: indices into ``examples``, in
    example order across the batch), ``extra`` padding tokens after the longest row.
    Returns get_rope_index-style keyword arguments (no mask) and the seq_lens."""
    assert [i for row in rows for i in row] == list(range(len(examples)))
    L = max(sum(length(examples[i]) for i in row) for row in rows) + extra
    ids = torch.full((len(rows), L), PAD, dtype=torch.int64)
    types = torch.zeros((len(rows), L), dtype=torch.int32)
    for b, row in enumerate(rows):
        used = 0
        for i in row:
            ex, n = examples[i], length(examples[i])
            ids[b, used:used + n] = ex["input_ids"][0]
            if V5:
                types[b, used:used + n] = ex["mm_token_type_ids"][0]
            used += n
    kw = dict(input_ids=ids,
              image_grid_thw=cat_rows([ex["image_grid_thw"] for ex in examples]),
              video_grid_thw=cat_rows([ex["video_grid_thw"] for ex in examples]))
    if "second_per_grid_ts" in examples[0]:
        kw["second_per_grid_ts"] = cat_rows([ex["second_per_grid_ts"] for ex in examples])
    if V5:
        kw["mm_token_type_ids"] = types
    return kw, [[length(examples[i]) for i in row] for row in rows]


def expected(model_type: str, examples: list[dict], rows: list[list[int]], L: int):
    """(4, B, L): row 0 restarting per example, rows 1-3 transformers' get_rope_index of
    each example alone, padding 0, 1, 2, ... on all rows."""
    get_rope_index = rope_index(model_type, stand_in(model_type), original=True)
    alone: dict[int, torch.Tensor] = {}  # by example object: repeated examples run once
    out = torch.empty((4, len(rows), L), dtype=torch.int64)
    for b, row in enumerate(rows):
        used = 0
        for i in row:
            n = length(examples[i])
            key = id(examples[i])
            if key not in alone:
                alone[key] = get_rope_index(**examples[i])[0]
            pos = alone[key]
            out[0, b, used:used + n] = torch.arange(n)
            out[1:, b, used:used + n] = pos[:, 0].long()
            used += n
        out[:, b, used:] = torch.arange(L - used)
    return out


def packed(model_type: str, kw: dict, **layout) -> torch.Tensor:
    args = api_kwargs(model_type, kw)
    return compute_packed_mrope_position_ids(
        args.pop("input_ids"), layout.pop("seq_lens", None), args.pop("image_grid_thw"),
        args.pop("video_grid_thw"), **layout, **args)


def examples_for(model_type: str, seconds_dtype=torch.float32) -> list[dict]:
    """Images, videos (fractional seconds, a long video), text-only and one-token examples."""
    cases = [("vision", {}), ("text", {}), ("one", {}),
             ("vision", dict(fractional=True, seconds_dtype=seconds_dtype)),
             ("one", {}), ("vision", dict(long_video=True, seconds_dtype=seconds_dtype)),
             ("text", {}), ("vision", dict(fractional=True, seconds_dtype=seconds_dtype)),
             ("one", {})]
    return [example(seed, model_type, kind, **case) for seed, (kind, case) in enumerate(cases)]


LAYOUTS = {
    # one row, padding after the last example (flash-attention reads packed rows at B = 1)
    "one_row": ([list(range(9))], 7),
    # several rows; the longest row has no padding, a row without examples is all padding
    "rows": ([[0, 1, 2], [3, 4], [], [5, 6, 7, 8]], 0),
    "rows_padded": ([[0], [1, 2, 3, 4], [5, 6, 7, 8]], 3),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_matches_get_rope_index_per_example(model_type, layout):
    rows, extra = LAYOUTS[layout]
    dtypes = [torch.float32, torch.float64] if model_type == "qwen2_5_vl" else [torch.float32]
    for seconds_dtype in dtypes:
        examples = examples_for(model_type, seconds_dtype)
        kw, seq_lens = pack(examples, rows, extra)
        want = expected(model_type, examples, rows, kw["input_ids"].shape[1])
        got = packed(model_type, kw, seq_lens=seq_lens)
        assert got.dtype == torch.int64 and got.shape == want.shape
        assert torch.equal(got, want), (got - want).abs().amax(dim=(0, 1))


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_layout_forms_agree(model_type):
    """seq_lens (lists, a tensor), cu_seqlens and a packed attention mask."""
    rows, extra = LAYOUTS["rows_padded"]
    examples = examples_for(model_type)
    kw, seq_lens = pack(examples, rows, extra)
    want = packed(model_type, kw, seq_lens=seq_lens)
    cu = [[0, *torch.tensor(r).cumsum(0).tolist()] for r in seq_lens]
    mask = torch.zeros_like(kw["input_ids"])
    for b, row in enumerate(seq_lens):
        bounds = [0, *torch.tensor(row).cumsum(0).tolist()]
        for k in range(len(row)):
            mask[b, bounds[k]:bounds[k + 1]] = k + 1
    assert torch.equal(packed(model_type, kw, cu_seqlens=cu), want)
    assert torch.equal(packed(model_type, kw, attention_mask=mask), want)
    assert torch.equal(packed(model_type, kw, attention_mask=mask.int()), want)
    # a (B, n) tensor: rows padded with zero-length examples
    n = max(map(len, seq_lens))
    table = torch.tensor([r + [0] * (n - len(r)) for r in seq_lens])
    assert torch.equal(packed(model_type, kw, seq_lens=table), want)
    # B = 1: flat list, 1-D tensors
    one = [examples[i] for i in range(3)]
    kw1, lens1 = pack(one, [[0, 1, 2]], 2)
    want1 = packed(model_type, kw1, seq_lens=lens1)
    assert torch.equal(packed(model_type, kw1, seq_lens=lens1[0]), want1)
    assert torch.equal(packed(model_type, kw1, seq_lens=torch.tensor(lens1[0])), want1)
    cu1 = torch.tensor([0, *torch.tensor(lens1[0]).cumsum(0).tolist()], dtype=torch.int32)
    assert torch.equal(packed(model_type, kw1, cu_seqlens=cu1), want1)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_transformers_reads_the_example_boundaries(model_type):
    """Row 0 splits into exactly the examples plus the padding under transformers' eager/sdpa
    rule and its flash-attention rule."""
    rows, extra = LAYOUTS["one_row"]
    examples = examples_for(model_type)
    kw, seq_lens = pack(examples, rows, extra)
    text = packed(model_type, kw, seq_lens=seq_lens)[0]
    L = text.shape[1]
    bounds = [0, *torch.tensor(seq_lens[0]).cumsum(0).tolist()]
    if bounds[-1] < L:
        bounds.append(L)  # the padding: a sequence of its own
    seq_index = torch.repeat_interleave(torch.arange(len(bounds) - 1),
                                        torch.tensor(bounds).diff())
    assert torch.equal(find_packed_sequence_indices(text)[0], seq_index)
    (cu_q, cu_k), (max_q, _) = prepare_fa_kwargs_from_position_ids(text)
    assert cu_q.tolist() == bounds and torch.equal(cu_q, cu_k)
    assert max_q == max(torch.tensor(bounds).diff().tolist())


def test_threads_and_many_examples():
    """A batch past the serial threshold (2^18 tokens): threads over examples, same ids as
    one thread."""
    model_type = "qwen2_vl"
    examples = [example(seed, model_type, "vision" if seed % 3 else "text") for seed in range(60)]
    total = sum(map(length, examples))
    big = examples * ((1 << 18) // total + 1)
    per_row = len(big) // 4
    rows = [list(range(i, i + per_row)) for i in range(0, len(big), per_row)]
    kw, seq_lens = pack(big, rows, 5)
    assert kw["input_ids"].numel() >= 1 << 18
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = packed(model_type, kw, seq_lens=seq_lens)
        torch.set_num_threads(4)
        threaded = packed(model_type, kw, seq_lens=seq_lens)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, threaded)
    assert torch.equal(serial, expected(model_type, big, rows, kw["input_ids"].shape[1]))


def test_opcheck():
    examples = examples_for("qwen2_5_vl")
    kw, seq_lens = pack(examples, LAYOUTS["rows"][0], 2)
    lens = torch.tensor([n for row in seq_lens for n in row])
    per_row = torch.tensor([len(row) for row in seq_lens])
    types = (kw["input_ids"] == IMG).long() + 2 * (kw["input_ids"] == VID).long()
    common = (kw["input_ids"], lens, per_row, kw["image_grid_thw"], kw["video_grid_thw"],
              kw["second_per_grid_ts"], 1, IMG, VID, VS, 2, 2.0)
    torch.library.opcheck(torch.ops.posenc.mrope_packed_position_ids, (*common, None, 0, 1))
    torch.library.opcheck(torch.ops.posenc.mrope_packed_position_ids, (*common, types, 1, 2))
    # the caller's numbering of the examples and the grids each one owns
    examples = [[i for i in row] for row in LAYOUTS["rows"][0]]
    order = torch.tensor([i for row in examples for i in row])
    owned = torch.tensor([[0 if ex["image_grid_thw"] is None else len(ex["image_grid_thw"]),
                           0 if ex["video_grid_thw"] is None else len(ex["video_grid_thw"])]
                          for ex in examples_for("qwen2_5_vl")])
    torch.library.opcheck(torch.ops.posenc.mrope_packed_position_ids,
                          (*common, types, 1, 2, order + 10, owned))


def test_examples_that_own_their_grids():
    """The walk packing calls (example ids and the grids each example owns): the same ids
    when the grids fit, and an error that names the caller's example and speaks of it
    alone, also where the grids still add up but one example gives a grid to the next."""
    from posenc_torch._packed_layout import PackedLayout
    from posenc_torch.positions import _packed_for_examples

    model_type = "qwen2_5_vl"
    examples = examples_for(model_type)
    kw, seq_lens = pack(examples, LAYOUTS["rows_padded"][0], 3)
    want = packed(model_type, kw, seq_lens=seq_lens)
    args = api_kwargs(model_type, kw)
    tensors = [args.pop(k) for k in ("input_ids", "image_grid_thw", "video_grid_thw")]
    layout = PackedLayout(torch.tensor([n for row in seq_lens for n in row]),
                          torch.tensor([len(row) for row in seq_lens]))
    owned = torch.tensor([[0 if ex[key] is None else len(ex[key])
                           for key in ("image_grid_thw", "video_grid_thw")] for ex in examples])
    ids = torch.arange(len(examples)) * 3 + 5

    def walk(ids, owned):
        return _packed_for_examples(tensors[0], layout, ids, owned, *tensors[1:], **args)

    assert torch.equal(walk(ids, owned), want)
    first = next(i for i, (n, _) in enumerate(owned.tolist()) if n)
    moved = owned.clone()
    moved[first, 0] -= 1
    moved[first + 1, 0] += 1
    n = int(owned[first, 0])
    with pytest.raises(ValueError, match=rf"^examples\[{5 + 3 * first}\]: image_grid_thw has "
                                         rf"{n - 1} rows, but input_ids has {n} images"):
        walk(ids, moved)
    with pytest.raises(ValueError, match=r"example_grids sums to"):
        walk(ids, owned * 2)
    with pytest.raises(ValueError, match=r"example_ids must have one entry per example"):
        walk(ids[:-1], owned)
    with pytest.raises(TypeError, match=r"^example_grids must be an integer"):
        walk(ids, owned.float())


def _compile_case(layout: str):
    model_type = "qwen2_5_vl"
    kw, seq_lens = pack(examples_for(model_type), LAYOUTS["rows"][0], 2)
    args = api_kwargs(model_type, kw)
    tensors = [args.pop(k) for k in ("input_ids", "image_grid_thw", "video_grid_thw")]
    n = max(map(len, seq_lens))
    table = [r + [0] * (n - len(r)) for r in seq_lens]  # rows padded with empty examples
    cu = [[0, *torch.tensor(r).cumsum(0).tolist()] for r in table]
    mask = torch.zeros_like(tensors[0])
    for b, row in enumerate(seq_lens):
        bounds = [0, *torch.tensor(row).cumsum(0).tolist()]
        for k in range(len(row)):
            mask[b, bounds[k]:bounds[k + 1]] = k + 1
    given = {"seq_lens list": dict(seq_lens=seq_lens), "cu_seqlens list": dict(cu_seqlens=cu),
             "seq_lens tensor": dict(seq_lens=torch.tensor(table)),
             "cu_seqlens tensor": dict(cu_seqlens=torch.tensor(cu)),
             "attention_mask": dict(attention_mask=mask)}[layout]
    layout_tensors = {k: v for k, v in given.items() if isinstance(v, torch.Tensor)}
    constants = {k: v for k, v in given.items() if k not in layout_tensors}

    def fn(ids, images, videos, **layout_tensors):
        return compute_packed_mrope_position_ids(ids, image_grid_thw=images,
                                                 video_grid_thw=videos, **constants,
                                                 **layout_tensors, **args)

    return fn, tensors, layout_tensors


@pytest.mark.parametrize("layout", ["seq_lens list", "cu_seqlens list", "seq_lens tensor"])
def test_compile_fullgraph(layout):
    """One op node under torch.compile(fullgraph=True) for the layouts the README lists as
    tracing: lengths as Python ints (constants of the graph) or a seq_lens tensor."""
    fn, tensors, layout_tensors = _compile_case(layout)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*tensors, **layout_tensors), fn(*tensors, **layout_tensors))


@pytest.mark.parametrize("layout", ["cu_seqlens tensor", "attention_mask"])
def test_layouts_read_from_tensors_do_not_trace(layout):
    """The README says so: their layout is checked on its values (cu_seqlens starting every
    row at 0, a mask numbering its examples 1, 2, 3, ...), which fullgraph cannot trace;
    without fullgraph they run (with a graph break)."""
    fn, tensors, layout_tensors = _compile_case(layout)
    with pytest.raises(Exception, match="data-dependent|Data-dependent|graph break|Unsupported"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(*tensors, **layout_tensors)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager")
    assert torch.equal(compiled(*tensors, **layout_tensors), fn(*tensors, **layout_tensors))


def test_exported():
    assert "compute_packed_mrope_position_ids" in posenc_torch.__all__


# ---------------------------------------------------------------------------------------
# Bad input: each class, its exception and a message that names the argument and the example.


def small(model_type: str = "qwen2_vl"):
    """Row 0: [text, image (1, 4, 4), text] [one token] [text x2], 3 tokens of padding."""
    ids = torch.tensor([[5, VS, IMG, IMG, IMG, IMG, 153, 6, 7, 8, 9, PAD, PAD, PAD]])
    kw = dict(input_ids=ids, image_grid_thw=torch.tensor([[1, 4, 4]]), video_grid_thw=None)
    if model_type == "qwen2_5_vl":
        kw["second_per_grid_ts"] = None
    kw["mm_token_type_ids"] = (ids == IMG).int()
    return kw


def call(kw: dict, model_type: str = "qwen2_vl", **layout):
    return packed(model_type, dict(kw), **layout)


BAD_LAYOUT = [
    # (layout, exception, message fragments)
    (dict(seq_lens=[8, 1, 9]), ValueError, ["seq_lens[0][2] (example 2)", "18 tokens"]),
    (dict(seq_lens=[[8], [1]]), ValueError, ["seq_lens must have one list per row"]),
    (dict(seq_lens=[8, -1, 2]), ValueError, ["seq_lens[0][1] (example 1) is -1"]),
    (dict(seq_lens=[8, 1.0]), TypeError, ["seq_lens[0][1] must be an int"]),
    (dict(seq_lens=[8, True]), TypeError, ["seq_lens[0][1] must be an int"]),
    (dict(seq_lens=torch.tensor([8.0, 1.0])), TypeError, ["seq_lens must be an integer tensor"]),
    (dict(seq_lens=torch.tensor([[[8]]])), ValueError, ["seq_lens as a tensor must be"]),
    (dict(seq_lens=8), TypeError, ["seq_lens must be a tensor or a list of lists"]),
    (dict(cu_seqlens=[1, 8, 9]), ValueError, ["cu_seqlens[0] must start with 0"]),
    (dict(cu_seqlens=[0, 8, 7]), ValueError, ["cu_seqlens[0][2] (end of example 1)", "decrease"]),
    (dict(cu_seqlens=[0, 8, 15]), ValueError, ["cu_seqlens[0][2] (end of example 1)",
                                               "past the 14 tokens"]),
    (dict(attention_mask=torch.tensor([[1] * 8 + [3, 3, 3, 0, 0, 0]])), ValueError,
     ["attention_mask[0, 8] is 3 after example 1 of row 0 (example 0 of the batch)"]),
    (dict(attention_mask=torch.tensor([[1] * 8 + [2, 2, 2, 0, 2, 0]])), ValueError,
     ["attention_mask[0, 12] is 2 after padding"]),
    (dict(attention_mask=torch.tensor([[2] * 14])), ValueError,
     ["attention_mask[0, 0] is 2 at the start of the row"]),
    (dict(attention_mask=torch.tensor([[-1] * 14])), ValueError, ["attention_mask[0, 0] is -1"]),
    (dict(attention_mask=torch.ones(1, 14)), TypeError, ["attention_mask must hold integer"]),
    (dict(attention_mask=torch.ones(1, 13, dtype=torch.long)), ValueError,
     ["attention_mask shape (1, 13) must equal input_ids shape (1, 14)"]),
    (dict(), TypeError, ["pass exactly one of seq_lens, cu_seqlens and attention_mask, got none"]),
    (dict(seq_lens=[8], cu_seqlens=[0, 8]), TypeError, ["got seq_lens, cu_seqlens"]),
]


@pytest.mark.parametrize("layout,exc,fragments", BAD_LAYOUT,
                         ids=[str(i) for i in range(len(BAD_LAYOUT))])
def test_bad_layout(layout, exc, fragments):
    with pytest.raises(exc) as info:
        call(small(), **layout)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_bad_grids():
    kw = small()
    ok = dict(seq_lens=[8, 1, 2])
    assert call(kw, **ok).shape == (4, 1, 14)
    # a vision run cut by an example boundary (4.57: the second half is also a stray run)
    with pytest.raises(ValueError, match=r"example 0 \(row 0, input_ids\[0, 0:4\]\): the image "
                                         r"run .* cut by an example boundary"):
        call(kw, seq_lens=[4, 4, 1])
    # ... and by the end of the last example (padding follows)
    with pytest.raises(ValueError, match=r"example 0 .* cut by an example boundary"):
        call(kw, seq_lens=[4])
    # grids left over: two grids, one image
    two = dict(kw, image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]))
    with pytest.raises(ValueError, match=r"image_grid_thw has 2 rows, but the 3 examples hold "
                                         r"only 1 image runs"):
        call(two, **ok)
    # grids running out: a second image in example 1, one grid
    ids = torch.tensor([[5, VS, IMG, IMG, IMG, IMG, 153, VS, IMG, IMG, IMG, IMG, 153, PAD]])
    more = dict(kw, input_ids=ids, mm_token_type_ids=(ids == IMG).int())
    with pytest.raises(ValueError, match=r"example 1 \(row 0, input_ids\[0, 7:13\]\): "
                                         r"input_ids\[0, 8\] starts image run number 2 of the "
                                         r"batch, but image_grid_thw has only 1 rows"):
        call(more, seq_lens=[7, 6])
    # a run longer than its grid, in example 1
    small_grid = dict(more, image_grid_thw=torch.tensor([[1, 4, 4], [1, 2, 4]]))
    with pytest.raises(ValueError, match=r"example 1 \(row 0, input_ids\[0, 7:13\]\): "
                                         r"input_ids\[0, 10\] is .* belongs to no image"):
        call(small_grid, seq_lens=[7, 6])
    # a run shorter than its grid, in example 1
    big_grid = dict(more, image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 6]]))
    with pytest.raises(ValueError, match=r"example 1 .*image_grid_thw\[1\] = \(1, 4, 6\) needs 6"):
        call(big_grid, seq_lens=[7, 6])
    # no grids at all but an image in example 0
    none = dict(kw, image_grid_thw=None)
    with pytest.raises(ValueError, match=r"example 0 .*image_grid_thw and video_grid_thw are "
                                         r"both None"):
        call(none, **ok)
    # a bad grid value (no example involved: the grid is named)
    with pytest.raises(ValueError, match=r"image_grid_thw\[0\] = \(1, 3, 4\) is not a valid"):
        call(dict(kw, image_grid_thw=torch.tensor([[1, 3, 4]])), **ok)
    # wrong grid dtype / shape
    with pytest.raises(TypeError, match="image_grid_thw must be an integer tensor"):
        call(dict(kw, image_grid_thw=torch.tensor([[1.0, 4.0, 4.0]])), **ok)
    with pytest.raises(ValueError, match=r"image_grid_thw must have shape \(num_grids, 3\)"):
        call(dict(kw, image_grid_thw=torch.tensor([[1, 4]])), **ok)
    # wrong input_ids
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        call(dict(kw, input_ids=kw["input_ids"].float()), **ok)
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor"):
        call(dict(kw, input_ids=kw["input_ids"].tolist()), **ok)
    # the inputs are left as they were
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    call(kw, **ok)
    assert all(torch.equal(kw[k], v) for k, v in before.items())


def test_video_cut_qwen3_frames():
    """Qwen3-VL: a frame run cut by a boundary is named by its video and frame."""
    ids = torch.tensor([[5, 9, VS, VID, VID, 153, 9, VS, VID, VID, 153, 6]])
    kw = dict(input_ids=ids, image_grid_thw=None, video_grid_thw=torch.tensor([[2, 2, 4]]),
              mm_token_type_ids=2 * (ids == VID).int())
    assert call(kw, "qwen3_vl", seq_lens=[12]).shape == (4, 1, 12)
    with pytest.raises(ValueError, match=r"example 0 \(row 0, input_ids\[0, 0:9\]\): the video "
                                         r"run .* \(video_grid_thw\[0\] = \(2, 2, 4\), frame 1\), "
                                         r"1 of them .* cut by an example "
                                         r"boundary"):
        call(kw, "qwen3_vl", seq_lens=[9, 3])
