"""Random batches for the algos tests: masks of every kind, dones, and junk for masked positions."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

MASK_KINDS = ("full", "right", "left", "middle", "holes")


def make_mask(gen: torch.Generator, B: int, T: int, kind: str) -> torch.Tensor:
    """``(B, T)`` bool: 'right'/'left' padding, one 'middle' run, random 'holes' (any row may be empty)."""
    if kind == "full":
        return torch.ones(B, T, dtype=torch.bool)
    if kind == "holes":
        return torch.rand(B, T, generator=gen) < torch.rand(B, 1, generator=gen)
    steps = torch.arange(T)
    n = torch.randint(0, T + 1, (B, 1), generator=gen)  # valid tokens per row, 0 allowed
    if kind == "right":
        return steps < n
    if kind == "left":
        return steps >= T - n
    start = (torch.rand(B, 1, generator=gen) * (T - n + 1)).long()
    return (steps >= start) & (steps < start + n)


def add_junk(gen: torch.Generator, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN, +-inf and huge values written at the masked positions."""
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -7.0], dtype=x.dtype)
    pick = junk[torch.randint(0, len(junk), x.shape, generator=gen)]
    return torch.where(mask.bool(), x, pick)


@st.composite
def batches(draw, max_b: int = 4, max_t: int = 80, kinds=MASK_KINDS):
    """(generator, B, T, mask): a seeded generator for the tensors, and a mask of a drawn kind."""
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    kind = draw(st.sampled_from(kinds))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return gen, B, T, make_mask(gen, B, T, kind)
