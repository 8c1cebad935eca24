"""Losses, per token (``(B, T)``) or per pair (``(B,)``), plus a dict of statistics.

A loss here never averages itself: :func:`rlhfkit.algos.aggregate_loss` is the one place where
per-token values become a scalar. The statistics are detached 0-d tensors (no host synchronisation;
call ``.item()`` when logging). Where a ``mask`` is accepted, masked inputs are never read, masked
outputs are 0 (with an exact zero gradient), and the statistics are means over valid positions.

Shapes: ``B`` batch (sequences or pairs), ``T`` response length, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhfkit.algos.importance import IMPORTANCE_LOG_RATIOS, token_log_ratio
from rlhfkit.algos.masked import fill_masked, masked_mean

Stats = dict[str, torch.Tensor]


def _mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    x = x.detach().float()
    return x.mean() if mask is None else masked_mean(x, mask)


def _read(mask: torch.Tensor | None, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors with masked entries replaced by 0 (so junk there is never read), or as they are."""
    return list(tensors) if mask is None else [fill_masked(x, mask) for x in tensors]


def _pair_accuracy(diff: torch.Tensor) -> torch.Tensor:
    """Share of pairs whose ``diff`` (chosen minus rejected) is positive; a tie counts 1/2."""
    return ((diff > 0).float() + 0.5 * (diff == 0).float()).mean()


def _check_same_shape(**tensors: torch.Tensor | None) -> None:
    shapes = {name: tuple(x.shape) for name, x in tensors.items() if x is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shapes must match: {shapes}")


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
) -> tuple[torch.Tensor, Stats]:
    """Bradley-Terry loss of a reward model on preference pairs, one value per pair.

    ``-logsigmoid(chosen - rejected - margin) + center_coef * (chosen + rejected)**2``: the pairwise loss
    of Ouyang et al. 2022 (eq. 1), the margin of Touvron et al. 2023 (Llama 2, eq. 2), and the centring
    term of Eisenstein et al. 2023 (TRL's ``center_rewards_coefficient``) that pins the reward's offset.
    An untrained model (chosen == rejected, no margin) gives ln 2.

    Args:
        chosen: ``(B,)`` rewards of the preferred responses.
        rejected: ``(B,)`` rewards of the other responses.
        margin: optional ``(B,)`` how much chosen should beat rejected by.
        center_coef: weight of the centring term (0 = off; TRL suggests 0.01).

    Returns:
        ``(loss (B,), stats)`` with stats ``accuracy`` (chosen > rejected; a tie counts 1/2),
        ``margin`` (mean chosen - rejected), ``chosen``, ``rejected`` (means).
    """
    _check_same_shape(chosen=chosen, rejected=rejected, margin=margin)
    diff = chosen - rejected  # (B,)
    loss = -F.logsigmoid(diff if margin is None else diff - margin)  # (B,)
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    d = diff.detach().float()
    stats = {
        "accuracy": _pair_accuracy(d),
        "margin": d.mean(),
        "chosen": _mean(chosen, None),
        "rejected": _mean(rejected, None),
    }
    return loss, stats


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float = 0.2,
    *,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    mask: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
) -> tuple[torch.Tensor, Stats]:
    """PPO's clipped surrogate, as a per-token loss to minimise (Schulman et al. 2017, eq. 7).

    ``max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))`` with
    ``ratio = exp(logprobs - old_logprobs)``, its log bounded at +-20 before the exp as in verl and OpenRLHF
    (:func:`rlhfkit.algos.kl.importance_ratio`: the same value and gradient at any ratio in [2e-9, 4.9e8], and a
    finite one, with gradient 0, beyond, where float32's exp would overflow and the gradient be NaN); an upper
    bound above the lower one is DAPO's "clip-higher"
    (Yu et al. 2025, arXiv 2503.14476, section 3.1). With ``dual_clip = c``, a token with ``A < 0`` has its
    loss capped at ``-A * c``: ``min(max(...), -A * c)`` (Ye et al. 2020, arXiv 1912.09729, eq. 5), so that a
    ratio far above 1 cannot make one token's loss unbounded. When ``logprobs == old_logprobs`` the ratio is
    exactly 1 and the loss exactly ``-A``.

    ``importance_sampling_level="sequence"`` takes GSPO's ratio instead (Zheng et al. 2025,
    :func:`rlhfkit.algos.importance.sequence_log_ratio`): one value per response, the geometric mean of its
    token ratios, so that the clips above act on whole responses, with each token's own gradient. The paper's
    clip ranges are then far narrower (3e-4 / 4e-4) and its loss is averaged per sequence
    (``seq-mean-token-mean``).

    Args:
        logprobs: ``(B, T)`` log-probs of the sampled tokens under the current policy (with gradient).
        old_logprobs: ``(B, T)`` the same at sampling time.
        advantages: ``(B, T)``.
        clip_eps: the clipping range epsilon (the lower one when ``clip_eps_high`` is given), >= 0.
        clip_eps_high: the upper epsilon, >= 0; None: ``clip_eps`` (symmetric, the PPO paper's; DAPO uses
            0.2 / 0.28).
        dual_clip: the constant c > 1 of the dual clip (3 in Ye et al. 2020), or None (off).
        mask: optional ``(B, T)`` valid tokens.
        importance_sampling_level: a key of :data:`rlhfkit.algos.importance.IMPORTANCE_LOG_RATIOS`,
            ``"token"`` (PPO's) or ``"sequence"`` (GSPO's).

    Returns:
        ``(loss (B, T), stats)``. A token is "clipped" where a clip term STRICTLY wins, which is where its
        gradient is 0 (at a tie the terms are equal and so are their gradients, ``-A * ratio``). The three ways
        are disjoint, so ``clipfrac == clipfrac/low + clipfrac/high + clipfrac/dual``:

        - ``clipfrac/low``: ``A < 0`` and ``-A * clip(ratio) > -A * ratio``, i.e. ratio < 1 - clip_eps;
        - ``clipfrac/high``: ``A > 0`` and the same, i.e. ratio > 1 + clip_eps_high;
        - ``clipfrac/dual``: ``A < 0`` and ``max(...) > -A * c``, i.e. ratio > c (0 without ``dual_clip``);
        - ``clipfrac``: their sum (without ``dual_clip``, exactly the figure of the symmetric PPO before).

        Also ``approx_kl`` (k3 estimate of KL(pi_old || pi) from the per-token ratios whatever the level,
        the samples being pi_old's) and ``ratio/mean`` (of the ratio the loss uses): the names the online
        trainer logs them under.

    Raises:
        ValueError: on a negative epsilon, ``dual_clip <= 1`` or an unknown ``importance_sampling_level``.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if clip_eps < 0 or eps_high < 0:
        raise ValueError(f"clip_eps and clip_eps_high must be >= 0, got {clip_eps} and {clip_eps_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be a constant > 1 (Ye et al. 2020 use 3) or None, got {dual_clip}")
    if importance_sampling_level not in IMPORTANCE_LOG_RATIOS:
        raise ValueError(
            f"importance_sampling_level must be one of {sorted(IMPORTANCE_LOG_RATIOS)}, "
            f"got {importance_sampling_level!r}"
        )
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    logprobs, old_logprobs, advantages = _read(mask, logprobs, old_logprobs, advantages)
    token_ratio = token_log_ratio(logprobs, old_logprobs)  # (B, T), bounded
    log_ratio = IMPORTANCE_LOG_RATIOS[importance_sampling_level](logprobs, old_logprobs, mask)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T), finite: no NaN gradient from one stale token
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)  # (B, T)
    loss = torch.maximum(unclipped, clipped)  # (B, T)
    negative = advantages < 0  # (B, T)
    cut = (clipped > unclipped).detach()  # (B, T) a clip term strictly wins
    if dual_clip is None:
        dual = torch.zeros_like(cut)
    else:
        bound = -advantages * dual_clip  # (B, T), > 0 where A < 0
        dual = (negative & (loss > bound)).detach()
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    if mask is not None:
        loss = fill_masked(loss, mask)
    stats = {
        "clipfrac": _mean(cut | dual, mask),
        "clipfrac/low": _mean(cut & negative, mask),
        "clipfrac/high": _mean(cut & (advantages > 0), mask),
        "clipfrac/dual": _mean(dual, mask),
        "approx_kl": _mean(torch.expm1(token_ratio) - token_ratio, mask),  # k3(old, new), bounded log-ratio
        "ratio/mean": _mean(ratio, mask),
    }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_clip_eps: float | None = 0.2,
    *,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Clipped value loss, per token: ``0.5 * max((V - R)**2, (V_clip - R)**2)``.

    ``V_clip = old_values + clip(values - old_values, -value_clip_eps, value_clip_eps)``, as in OpenAI
    baselines' PPO2 and lm-human-preferences (Huang et al. 2024, detail on value clipping).
    ``value_clip_eps=None`` turns clipping off: ``0.5 * (V - R)**2``.

    Args:
        values: ``(B, T)`` the critic's current values (with gradient).
        old_values: ``(B, T)`` its values at sampling time.
        returns: ``(B, T)`` targets (``compute_gae``'s returns).
        value_clip_eps: the clipping range, or None.
        mask: optional ``(B, T)`` valid tokens.

    Returns:
        ``(loss (B, T), stats)`` with stats ``clipfrac`` (share of tokens where the clipped error is
        the larger; logged as ``value/clipfrac``) and ``mse`` (mean unclipped squared error).
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    values, old_values, returns = _read(mask, values, old_values, returns)
    unclipped = (values - returns) ** 2  # (B, T)
    if value_clip_eps is None:
        loss, clipfrac = 0.5 * unclipped, torch.zeros((), device=values.device)
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -value_clip_eps, value_clip_eps)
        clipped = (v_clipped - returns) ** 2  # (B, T)
        loss = 0.5 * torch.maximum(unclipped, clipped)
        clipfrac = _mean((clipped > unclipped).float(), mask)
    if mask is not None:
        loss = fill_masked(loss, mask)
    return loss, {"clipfrac": clipfrac, "mse": _mean(unclipped, mask)}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits`` ``(B, T, V)`` -> ``(B, T)`` (nats).

    ``H = -sum_v p_v log p_v`` from ``log_softmax`` (stable), in float32 at least; tokens with
    probability 0 (logit -inf, e.g. after top-k) contribute 0, not NaN. Pass the logits at the
    sampling temperature.
    """
    logp = F.log_softmax(
        logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, dim=-1
    )
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(-1)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, Stats]:
    """Direct Preference Optimization loss, one value per pair (Rafailov et al. 2023, eq. 7).

    With ``h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))``:

    - ``sigmoid`` (DPO): ``-(1 - label_smoothing) * logsigmoid(beta * h) - label_smoothing *
      logsigmoid(-beta * h)`` (the smoothing is conservative DPO, Mitchell 2023, as in TRL's ``sigmoid``
      loss). At the start (policy == reference) it is ln 2;
    - ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
      Preferences", eq. 17): ``(h - 1 / (2 * beta))^2``, a regression of h on a fixed target instead of a
      push to infinity (``label_smoothing`` must be 0). At the start it is ``1 / (4 beta^2)``.

    Args:
        policy_chosen_logps: ``(B,)`` summed log-probs of the chosen responses under the policy.
        policy_rejected_logps: ``(B,)`` the same for the rejected responses.
        ref_chosen_logps: ``(B,)`` chosen, under the frozen reference.
        ref_rejected_logps: ``(B,)`` rejected, under the frozen reference.
        beta: the KL strength (temperature of the implicit reward).
        label_smoothing: assumed probability that a label is flipped, in [0, 0.5) (``sigmoid`` only).
        loss_type: ``"sigmoid"`` or ``"ipo"``.

    Returns:
        ``(loss (B,), stats)`` with stats ``reward_chosen`` and ``reward_rejected`` (means of the
        implicit rewards ``beta * (log pi - log pi_ref)``), ``accuracy`` (chosen reward larger; a tie
        counts 1/2) and ``margin`` (mean reward difference).
    """
    _check_same_shape(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if loss_type not in ("sigmoid", "ipo"):
        raise ValueError(f"loss_type must be 'sigmoid' or 'ipo', got {loss_type!r}")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError("label_smoothing is for the sigmoid loss; IPO takes none")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected = policy_rejected_logps - ref_rejected_logps  # (B,)
    if loss_type == "ipo":
        loss = (chosen - rejected - 1.0 / (2.0 * beta)).pow(2)  # (B,)
    else:
        logits = beta * (chosen - rejected)  # (B,)
        loss = -(1.0 - label_smoothing) * F.logsigmoid(logits)
        if label_smoothing:
            loss = loss - label_smoothing * F.logsigmoid(-logits)
    rc, rr = (beta * chosen).detach().float(), (beta * rejected).detach().float()
    stats = {
        "reward_chosen": rc.mean(),
        "reward_rejected": rr.mean(),
        "accuracy": _pair_accuracy(rc - rr),
        "margin": (rc - rr).mean(),
    }
    return loss, stats
