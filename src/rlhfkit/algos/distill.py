"""On-policy distillation's per-token terms (placeholder of the sampled term; the full module comes with its
tests)."""

from __future__ import annotations

from typing import Literal

import torch

from rlhfkit.algos.masked import fill_masked

DistillLoss = Literal["reverse_kl", "full_reverse_kl", "jsd"]


def sampled_reverse_kl(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """(B, T) log pi(y_t) - log pi_teacher(y_t), 0 at masked positions."""
    return fill_masked(logprobs - teacher_logprobs, mask)
