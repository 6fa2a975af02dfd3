"""The problem shapes of the rotation tests (tests/test_rope.py, tests/test_cuda.py), each
named after the model it mimics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    """q (B, Hq, T, D), k (B, Hk, T, D), tables (cos_batch, T, R)."""

    name: str
    B: int
    Hq: int
    Hk: int
    T: int
    D: int
    R: int | None = None  # rotary width; None = D
    cos_batch: int = 1

    @property
    def rot(self) -> int:
        return self.R or self.D
