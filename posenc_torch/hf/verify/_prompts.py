"""Prompts for ``get_rope_index`` laid out as the Qwen-VL processors lay them out, and the
check that a ``get_rope_index`` gives, on all of them, what posenc's walk of one
convention gives (the verify command verifies the table's rows with it).

A few prompts are written to tell the conventions apart; more are drawn from a fixed seed:
images of one and two frames, videos of 1 to 16 frames, spatial merge sizes 1, 2 and 4
through stand-in configs, fractional seconds per grid, several images per row, left and
right padding, attention masks with holes, text-only rows.
"""

from __future__ import annotations

import copy
import inspect
import random
import types
from collections.abc import Callable

import torch

from ..._tables import CONVENTIONS, MROPE_MODELS, MROPE_QWEN3_VL
from .. import _rope_index, _transformers

def _stand_in(owner: type, config) -> types.SimpleNamespace:
    """An object holding ``config`` and the owner class's other methods (5.x's
    get_rope_index calls ``self.get_vision_position_ids``), on which get_rope_index runs
    without building a model."""
    obj = types.SimpleNamespace(config=config)
    for name, value in vars(owner).items():
        if isinstance(value, types.FunctionType) and not name.startswith("__"):
            setattr(obj, name, value.__get__(obj))
    return obj


class _Prompts:
    """get_rope_index keyword arguments laid out as the processors lay prompts out."""

    def __init__(self, model: str, config) -> None:
        self.model, self.config = model, config
        self.image, self.video = config.image_token_id, config.video_token_id
        self.start = config.vision_start_token_id
        end = getattr(config, "vision_end_token_id", None)
        self.end = self.start + 1 if end is None else end
        special = {self.image, self.video, self.start, self.end}
        self.text_ids = [i for i in range(3, 60) if i not in special]
        self.merge = config.vision_config.spatial_merge_size
        self.per_frame = MROPE_MODELS[model].mrope == MROPE_QWEN3_VL
        self.reads_seconds = MROPE_MODELS[model].reads_seconds

    def text(self, n: int, offset: int) -> list[int]:
        return [self.text_ids[(offset + j) % len(self.text_ids)] for j in range(n)]

    def vision(self, token: int, grid: tuple[int, int, int]) -> list[int]:
        t, h, w = grid
        run = (h // self.merge) * (w // self.merge)
        if token == self.video and self.per_frame:  # <timestamp> <start> frame <end>
            return [tok for f in range(t)
                    for tok in self.text(2, f) + [self.start] + [token] * run + [self.end]]
        return [self.start] + [token] * (t * run) + [self.end]

    def batch(self, rows: list[list[int]], images, videos, mask=True, seconds=None,
              left=True, holes: list[list[int]] | None = None) -> dict:
        width = max(map(len, rows))
        pad = [[0] * (width - len(r)) for r in rows]
        ids = torch.tensor([p + r if left else r + p for r, p in zip(rows, pad, strict=True)])
        masks = [[0] * len(p) + [1] * len(r) if left else [1] * len(r) + [0] * len(p)
                 for r, p in zip(rows, pad, strict=True)]
        for row, cols in zip(masks, holes or [], strict=False):
            for col in cols:
                row[col] = 0
        kw = dict(input_ids=ids,
                  image_grid_thw=torch.tensor(images) if images else None,
                  video_grid_thw=torch.tensor(videos) if videos else None,
                  attention_mask=torch.tensor(masks) if mask else None,
                  mm_token_type_ids=(ids == self.image).long() + 2 * (ids == self.video).long())
        if self.reads_seconds:
            kw["second_per_grid_ts"] = (torch.tensor(seconds, dtype=torch.float32)
                                        if seconds else None)
        return kw

    def fixed(self) -> list[tuple[str, dict]]:
        """Prompts that tell the conventions apart: left padding (padded slots, deltas over
        padded or real length); a video of more frames than rows and columns followed by
        text (where text resumes); an image of two frames (Qwen2.5-VL's image temporal
        index); 0.5 seconds per grid (truncated by 4.57 and 5.17, kept by 5.18); a row
        without vision and the call without grids; no mask."""
        m = self.merge
        img, img2, vid = (1, 2 * m, 4 * m), (2, 2 * m, 2 * m), (6, 2 * m, 2 * m)
        text, vision, image, video = self.text, self.vision, self.image, self.video
        mixed = [text(3, 0) + vision(image, img) + text(2, 1) + vision(video, vid) + text(3, 2),
                 text(5, 3) + vision(image, img2) + text(2, 4)]
        seconds = [0.5] if self.reads_seconds else None
        return [
            ("image and video rows, left padding",
             self.batch(mixed, [img, img2], [vid], True, seconds)),
            ("the same without attention_mask",
             self.batch(mixed, [img, img2], [vid], False, seconds)),
            ("a text row beside an image row",
             self.batch([text(4, 5), text(2, 6) + vision(image, img)], [img], None)),
            ("text only, left padding, no grids",
             self.batch([text(6, 7), text(3, 8)], None, None)),
        ]

    def drawn(self, rng: random.Random, frames: list[int], count: int) -> list[tuple[str, dict]]:
        """At least ``count`` batches drawn from ``rng``: 1 to 3 rows of text runs, images
        (1 or 2 frames) and videos (the frame counts taken in turn from ``frames``, until
        each was used), left or right padding, holes in the mask over text tokens, seconds
        from a fractional set."""
        m, out, n = self.merge, [], 0
        while n < count or frames:  # until every frame count was drawn
            rows, holes, images, videos, seconds = [], [], [], [], []
            for r in range(rng.randint(1, 3)):
                row, text_at = [], []
                for _ in range(rng.randint(1, 4)):
                    what = rng.choice(("text", "image", "video") if n < count else ("video",))
                    if what == "image" or what == "video":
                        grid = ((rng.choice((1, 2)) if what == "image" else frames.pop(0)
                                 if frames else rng.randint(1, 16)),
                                m * rng.randint(1, 3), m * rng.randint(1, 3))
                        (images if what == "image" else videos).append(grid)
                        if what == "video":
                            seconds.append(rng.choice((0.25, 0.5, 1.0, 1.5, 2.0, 3.0)))
                        row += self.vision(self.image if what == "image" else self.video, grid)
                    k = rng.randint(1, 5)
                    text_at += range(len(row), len(row) + k)
                    row += self.text(k, r + n)
                rows.append(row)
                holes.append(text_at)
            left = rng.random() < 0.5
            width = max(map(len, rows))
            # holes: one or two masked-out text tokens in some rows (mask positions)
            hole_cols = []
            for row, text_at in zip(rows, holes, strict=True):
                offset = width - len(row) if left else 0
                chosen = rng.sample(text_at, min(len(text_at), rng.choice((0, 0, 1, 2))))
                hole_cols.append([offset + c for c in chosen])
            label = (f"drawn batch {n} (merge size {m}, {'left' if left else 'right'} padding, "
                     f"images {images}, videos {videos})")
            out.append((label, self.batch(rows, images, videos, True,
                                          seconds if videos else None, left, hole_cols)))
            n += 1
        return out


def _identical(ours: tuple, theirs: object) -> bool:
    if not (isinstance(theirs, tuple) and len(theirs) == 2
            and all(isinstance(t, torch.Tensor) for t in theirs)):
        return False
    return all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
               for a, b in zip(ours, theirs, strict=True))


# The special tokens of the released Qwen-VL checkpoints, for configs that leave them unset.
_QWEN_TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656,
                   "vision_start_token_id": 151652, "vision_end_token_id": 151653}
_MERGE_SIZES = (1, 2, 4)
_DRAWN_PER_MERGE_SIZE = 6


def _configs(model_type: str) -> list:
    """The model type's default config as stand-ins with each spatial merge size."""
    config = _transformers.module().AutoConfig.for_model(model_type)
    for name, value in _QWEN_TOKEN_IDS.items():  # some releases leave them unset
        if getattr(config, name, None) is None:
            setattr(config, name, value)
    out = []
    for merge in _MERGE_SIZES:
        variant = copy.deepcopy(config)
        variant.vision_config.spatial_merge_size = merge
        out.append(variant)
    return out


def prompts(model_type: str) -> list[tuple[str, object, dict]]:
    """(label, config, get_rope_index keyword arguments) of every probe prompt."""
    rng = random.Random(25)
    out = []
    for config in _configs(model_type):
        p = _Prompts(model_type, config)
        frames = list(range(1, 17))
        rng.shuffle(frames)
        out += [(label, config, kw) for label, kw in p.fixed()]
        out += [(label, config, kw)
                for label, kw in p.drawn(rng, frames, _DRAWN_PER_MERGE_SIZE)]
    return out


def matching_conventions(model_type: str, owner: type, method: Callable) -> list[str]:
    """The conventions whose walk gives, on every prompt, exactly what ``method`` (a
    ``get_rope_index``) gives, dtypes included."""
    params = inspect.signature(method).parameters
    candidates = list(CONVENTIONS)
    for label, config, kw in prompts(model_type):
        obj = _stand_in(owner, config)
        kw = {name: value for name, value in kw.items() if name in params}
        theirs = method(obj, **kw)
        arguments = inspect.signature(method).bind(obj, **kw).arguments
        kept = []
        for convention in candidates:
            try:
                ours = _rope_index._walk(obj, arguments, model_type, convention)
            except Exception:  # noqa: BLE001 -- Decline, or the walk refusing: no match
                continue
            if _identical(ours, theirs):
                kept.append(convention)
        candidates = kept
    return candidates
