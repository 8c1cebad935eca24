"""How many groups of a critic-free rollout can teach anything: degenerate-group counts.

GRPO and RLOO compare the responses to one prompt with each other (Shao et al. 2024; Ahmadian et al. 2024),
so a group whose responses all score the same (every answer right, or every answer wrong: a zero standard
deviation) gets zero advantages and teaches nothing, and so does a group of one. DAPO (Yu et al. 2025,
"dynamic sampling") reports and filters such groups; here they are counted per rollout:

- ``groups/zero_std_fraction``: groups with two or more scored responses that all score the same;
- ``groups/singleton_fraction``: groups with exactly one scored response (its advantage is 0);
- ``groups/partial_fraction``: groups where some response was left out (nothing scored it, e.g. every
  reward function returned None, or it was masked for a missing stop token);
- ``groups/empty_fraction``: groups with no scored response at all.

Each is a fraction of the rollout's groups; the group is the prompt (``group_ids``), whatever was left out.
"""

from __future__ import annotations

import torch


def _check_rows(scores: torch.Tensor, group_ids: torch.Tensor, kept: torch.Tensor) -> None:
    if not (scores.shape == group_ids.shape == kept.shape) or scores.dim() != 1:
        raise ValueError(
            f"scores {tuple(scores.shape)}, group_ids {tuple(group_ids.shape)} and kept {tuple(kept.shape)} "
            "must all be (B,)"
        )


def _per_group(
    scores: torch.Tensor, group_ids: torch.Tensor, kept: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(index (B,), size, scored, high, low)``: each row's group 0..G-1, and per group ``(G,)`` float64 its
    responses, its kept responses, and the highest and lowest kept score (-inf / inf without one). Junk at
    left-out rows is never read. ``scores`` must hold at least one row."""
    _, index = torch.unique(group_ids, return_inverse=True)  # (B,): 0..G-1
    n_groups = int(index.max()) + 1
    kept = kept.bool()
    x = scores.double()
    size = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).index_add_(
        0, index, torch.ones_like(x)
    )  # (G,)
    scored = torch.zeros_like(size).index_add_(0, index, kept.double())  # (G,)
    high = torch.full_like(size, -torch.inf).scatter_reduce(
        0, index, x.masked_fill(~kept, -torch.inf), "amax"
    )
    low = torch.full_like(size, torch.inf).scatter_reduce(0, index, x.masked_fill(~kept, torch.inf), "amin")
    return index, size, scored, high, low


def group_counts(
    scores: torch.Tensor, group_ids: torch.Tensor, kept: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Counts of degenerate groups (see the module docstring), vectorised.

    Args:
        scores: ``(B,)`` each response's score (read only where ``kept``; junk elsewhere is ignored).
        group_ids: ``(B,)`` integer, the prompt of each response.
        kept: ``(B,)`` bool, True for a response that enters the loss.
    Returns:
        ``{"groups", "zero_std", "singleton", "partial", "empty"}``: 0-d float64 counts.
    """
    _check_rows(scores, group_ids, kept)
    if not len(scores):
        zero = torch.zeros((), dtype=torch.float64, device=scores.device)
        return {k: zero for k in ("groups", "zero_std", "singleton", "partial", "empty")}
    _, size, scored, high, low = _per_group(scores, group_ids, kept)
    return {
        "groups": torch.tensor(float(len(size)), dtype=torch.float64, device=scores.device),
        "zero_std": ((scored >= 2) & (high == low)).sum().double(),
        "singleton": (scored == 1).sum().double(),
        "partial": (scored < size).sum().double(),
        "empty": (scored == 0).sum().double(),
    }


def informative_rows(scores: torch.Tensor, group_ids: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Which responses belong to a group that can teach a critic-free estimator something: two or more kept
    responses whose scores are not all the same (the complement of zero-std, singleton and empty groups;
    DAPO's dynamic-sampling filter, Yu et al. 2025, eq. 11).

    Args:
        scores: ``(B,)`` each response's score (read only where ``kept``).
        group_ids: ``(B,)`` integer, the prompt of each response.
        kept: ``(B,)`` bool, True for a response that enters the loss.
    Returns:
        ``(B,)`` bool, the same for every response of a group.
    """
    _check_rows(scores, group_ids, kept)
    if not len(scores):
        return torch.zeros(0, dtype=torch.bool, device=scores.device)
    index, _, scored, high, low = _per_group(scores, group_ids, kept)
    return ((scored >= 2) & (high > low))[index]  # (B,)
