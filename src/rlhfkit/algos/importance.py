"""The log importance ratio of the policy loss, per token or per sequence: a name-to-function dict
(:data:`IMPORTANCE_LOG_RATIOS`) that :func:`rlhfkit.algos.ppo_policy_loss` looks its variant up in.

Both variants return a ``(B, T)`` log-ratio bounded at +-:data:`~rlhfkit.algos.kl.LOG_RATIO_BOUND` (finite after
the exp; the clamp stops the gradient beyond the bound) whose gradient at each token is that of
``logprobs[b, t]``; they differ in its value.

Shapes: ``B`` batch, ``T`` response length; ``mask`` ``(B, T)`` 1 (or True) on valid tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

from rlhfkit.algos.kl import LOG_RATIO_BOUND
from rlhfkit.algos.masked import fill_masked, masked_mean

ImportanceSamplingLevel = Literal["token", "sequence"]
"""The variants of :data:`IMPORTANCE_LOG_RATIOS` (a config field uses this ``Literal``)."""

IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = get_args(ImportanceSamplingLevel)

LogRatio = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def token_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """PPO's per-token log-ratio ``log pi(y_t) - log pi_old(y_t)`` (Schulman et al. 2017, eq. 6), bounded.

    Args:
        logprobs: ``(B, T)`` log-probs under the current policy (with gradient).
        old_logprobs: ``(B, T)`` the same at sampling time.
        mask: optional ``(B, T)``; masked outputs are 0 (never reading the inputs there).

    Returns:
        ``(B, T)``.
    """
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    return log_ratio if mask is None else fill_masked(log_ratio, mask)


def sequence_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """GSPO's sequence-level log-ratio in its GSPO-token form (Zheng et al. 2025, "Group Sequence Policy
    Optimization", arXiv 2507.18071: the ratio s_i of the objective in eq. 5, and the GSPO-token variant).

    ``log s_i = mean over the valid tokens of row i of (logprobs - old_logprobs)``, i.e.
    ``s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|)``, and ``log s_i,t = sg[log s_i] + logprobs_t - sg[logprobs_t]``:
    every valid token of a row has the value ``log s_i`` (so a clip on the ratio clips the whole response at
    once), and the gradient ``s_i * grad log pi(y_t)`` of its own token, so that per-token advantages still
    weigh each token (the paper's GSPO-token; with one advantage per sequence and the loss averaged per
    sequence its gradient is GSPO's). verl's ``gspo`` policy loss has the same form. A row without a
    valid token has log-ratio 0.

    Args:
        logprobs: ``(B, T)`` log-probs under the current policy (with gradient).
        old_logprobs: ``(B, T)`` the same at sampling time.
        mask: optional ``(B, T)``; None: every position is valid. Masked inputs are never read; masked outputs
            are 0 with gradient 0.

    Returns:
        ``(B, T)``.
    """
    if mask is None:
        seq = (logprobs - old_logprobs).mean(-1, keepdim=True)  # (B, 1)
    else:
        logprobs, old_logprobs = fill_masked(logprobs, mask), fill_masked(old_logprobs, mask)
        seq = masked_mean(logprobs - old_logprobs, mask, dim=-1).unsqueeze(-1)  # (B, 1)
    log_ratio = seq.detach() + (logprobs - logprobs.detach())  # (B, T) value log s_i, gradient per token
    log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return log_ratio if mask is None else fill_masked(log_ratio, mask)


IMPORTANCE_LOG_RATIOS: dict[str, LogRatio] = {"token": token_log_ratio, "sequence": sequence_log_ratio}
"""``online.importance_sampling_level`` -> the log-ratio function, all with one signature
``f(logprobs (B, T), old_logprobs (B, T), mask (B, T) | None) -> (B, T)``."""
