"""The correction for tokens sampled by a generation engine rather than by the trainer's own model.

An inference engine (vLLM) computes the policy with other kernels and precision than the trainer, so the
responses come from pi_engine, not from pi_trainer = pi_old, and PPO's surrogate is then slightly
off-policy. Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training", eq. 3; Ionides 2008 for the truncation) weights each token's policy loss by

    w_t = min(pi_trainer(y_t) / pi_engine(y_t), C)

held constant (no gradient): an unbiased correction for the mismatch up to the truncation, whose cap ``C``
bounds the variance. Both log-probs are of the sampled token under the same sampling processing
(temperature, top-k / top-p).

Shapes: ``B`` responses, ``T`` response length.
"""

from __future__ import annotations

import torch

from rlhfkit.algos.masked import fill_masked


def tis_weights(
    logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
) -> torch.Tensor:
    """Per-token truncated importance weights ``min(exp(logprobs - engine_logprobs), cap)``, detached.

    Args:
        logprobs: ``(B, T)`` log pi_trainer(y_t) of the sampled tokens: the trainer's log-probs at sampling
            time (the PPO ``old_logprobs``).
        engine_logprobs: ``(B, T)`` log pi_engine(y_t), the log-probs the engine sampled with.
        mask: ``(B, T)`` valid tokens; masked positions are never read and get weight 0.
        cap: ``C > 0``, the truncation.
    Returns:
        ``(B, T)`` weights in ``(0, cap]`` at valid positions, 0 elsewhere; no gradient flows through them.
    """
    if logprobs.shape != engine_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, engine_logprobs {tuple(engine_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have one shape"
        )
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    log_ratio = logprobs.detach() - engine_logprobs.detach()  # (B, T)
    weights = torch.exp(log_ratio).clamp(max=cap)  # (B, T)
    return fill_masked(weights, mask)
