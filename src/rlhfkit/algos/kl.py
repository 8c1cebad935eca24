"""Per-token KL estimators, KL-shaped rewards, and the KL coefficient controllers.

The estimators follow Schulman, "Approximating KL divergence" (2020): with samples from the policy
pi_theta and ``log_r = ref_logprobs - logprobs`` (log pi_ref / pi_theta at the sampled token), all three
estimate KL(pi_theta || pi_ref)::

    k1 = -log_r                 unbiased, high variance, can be negative per token
    k2 = 0.5 * log_r**2         biased, low variance, >= 0
    k3 = exp(log_r) - 1 - log_r unbiased, low variance, >= 0

(The ratio in k3 is pi_ref / pi_theta; a widely copied snippet takes it the other way round, which
estimates a different quantity.) ``shape_rewards`` is the per-token KL penalty of Ziegler et al. 2019
and Stiennon et al. 2020 (torchtune ``rlhf/rewards.py`` ``get_rewards_ppo`` has the same shape); the
adaptive controller is Ziegler et al. 2019, section 2.2.

``kl_penalty_loss`` is the other way to apply the KL: a per-token LOSS term added to the policy loss
(GRPO-style, Shao et al. 2024), not a reward. Its forms are chosen for their GRADIENT, which is what a loss
contributes (Liu et al. 2025, "Rethinking KL Regularization in RLHF", arXiv 2510.01555): ``k2`` and ``k3_is``
have, in expectation over the tokens sampled from pi_old, exactly the gradient of KL(pi_theta || pi_ref);
the plain ``k3`` (what GRPO ships) does not.

Shapes: ``B`` batch, ``T`` response length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

from rlhfkit.algos.masked import fill_masked

# Bound on the log of an importance ratio pi_theta / pi_old before its exp, as verl (trainer/ppo/core_algos.py,
# compute_policy_loss: ``torch.clamp(negative_approx_kl, min=-20.0, max=20.0)``) and OpenRLHF (models/loss.py,
# PolicyLoss: ``log_ratio.clamp(min=-20.0, max=20.0)``) bound it: float32's exp overflows above ~88.7, and the
# backward of an infinite ratio is 0 * inf = NaN even where the token is clipped and its true gradient is 0.
LOG_RATIO_BOUND = 20.0


def importance_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(log_ratio, -20, 20))``, ``(B, T)`` -> ``(B, T)``: the ratio ``exp(log_ratio)`` with its value
    and gradient unchanged for ``|log_ratio| <= 20`` (a ratio in [2e-9, 4.9e8], far outside any trust region),
    and finite beyond, where the clamp stops the gradient (:data:`LOG_RATIO_BOUND`)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


KLEstimator = Literal["k1", "k2", "k3"]
"""The names of the KL estimators (a config field uses this ``Literal``)."""


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``log pi_theta - log pi_ref`` per token. ``(B, T)``, ``(B, T)`` -> ``(B, T)``."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``0.5 * (log pi_ref - log pi_theta)**2`` per token. ``(B, T)``, ``(B, T)`` -> ``(B, T)``."""
    return 0.5 * (ref_logprobs - logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``r - 1 - log r`` with ``r = pi_ref / pi_theta`` per token. ``(B, T)``, ``(B, T)`` -> ``(B, T)``.

    ``expm1`` keeps it accurate (and exactly 0) when the policies agree.
    """
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def kl_estimator(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The estimator called ``name`` (``k1``, ``k2`` or ``k3``); ValueError names the choices."""
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown KL estimator {name!r}; choose one of {', '.join(KL_ESTIMATORS)}") from None


KLLossEstimator = Literal["k2", "k3_is", "k3"]
"""The forms of :func:`kl_penalty_loss` (a config field uses this ``Literal``)."""

KL_LOSS_ESTIMATOR_NAMES: tuple[str, ...] = get_args(KLLossEstimator)

# k2, not k3_is: the two have the SAME per-token gradient, w * (logprobs - ref_logprobs) * grad logprobs
# (on- and off-policy; tests/algos/test_kl_loss.py checks it), but k3_is reaches it by autograd as the
# difference of two terms of size w * pi_ref / pi_theta, which cancel in float32: at pi_ref / pi_theta = e^15
# it gives -13.5 for -13.57, at e^20 -32 for -18.1. k2 computes the gradient directly. k3_is's one advantage,
# a VALUE that is an unbiased KL estimate, is for logging, and kl_k3 of the rollout already logs that.
DEFAULT_KL_LOSS_ESTIMATOR: KLLossEstimator = "k2"


def kl_loss_k2(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor | None
) -> torch.Tensor:
    """``w * 0.5 * (logprobs - ref_logprobs)**2`` with ``w = exp(logprobs - old_logprobs)`` DETACHED (1 when
    ``old_logprobs`` is None). All ``(B, T)`` -> ``(B, T)``.

    Gradient ``w * log(pi_theta / pi_ref) * grad log pi_theta``: under pi_old it averages to
    ``sum_y pi_theta(y) log(pi_theta / pi_ref)(y) grad log pi_theta(y) = grad KL(pi_theta || pi_ref)`` exactly
    (the score-function term ``sum pi_theta grad log pi_theta`` is 0). On-policy it is the gradient of k1 in
    the reward (Liu et al. 2025, arXiv 2510.01555, "k2 as loss"); the detached weight is their off-policy
    correction. The VALUE is not an unbiased KL estimate (Schulman 2020: k2 is biased).
    """
    k2 = 0.5 * (logprobs - ref_logprobs) ** 2  # (B, T)
    if old_logprobs is None:
        return k2
    return importance_ratio(logprobs - old_logprobs).detach() * k2


def kl_loss_k3_is(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor | None
) -> torch.Tensor:
    """``(pi_theta / pi_old) * k3`` with the ratio CARRYING the gradient (DeepSeek-AI 2025, DeepSeek-V3.2,
    "unbiased KL estimate"); ``k3 = r - 1 - log r``, ``r = pi_ref / pi_theta`` (Schulman 2020). ``old_logprobs``
    None means on-policy: ``old = logprobs.detach()`` (ratio 1, gradient ``grad log pi_theta``). All ``(B, T)``.

    Under pi_old the value averages to ``sum_y pi_theta (r - 1 - log r) = KL(pi_theta || pi_ref)`` for every
    theta, so its gradient is ``grad KL(pi_theta || pi_ref)`` exactly. Per token the gradient is
    ``w * (k3 + 1 - r) * grad log pi_theta = w * log(pi_theta / pi_ref) * grad log pi_theta``: the same as
    :func:`kl_loss_k2`'s, computed through a cancellation that loses precision in float32 where
    ``pi_ref / pi_theta`` is large (see ``DEFAULT_KL_LOSS_ESTIMATOR``).
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    return importance_ratio(logprobs - old) * kl_k3(logprobs, ref_logprobs)  # (B, T)


def kl_loss_k3(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor | None
) -> torch.Tensor:
    """The plain k3 as a loss, as GRPO uses it (Shao et al. 2024, eq. 4), kept for comparison: BIASED.
    ``old_logprobs`` is ignored (no weight, on- or off-policy). All ``(B, T)`` -> ``(B, T)``.

    Its gradient is ``(1 - pi_ref / pi_theta) * grad log pi_theta``; under pi_theta that averages to
    ``-sum_y pi_ref grad log pi_theta = grad KL(pi_ref || pi_theta)``, the gradient of the FORWARD KL, not of
    the KL(pi_theta || pi_ref) it estimates the value of (Liu et al. 2025, arXiv 2510.01555); off-policy it
    is neither.
    """
    return kl_k3(logprobs, ref_logprobs)


KL_LOSS_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    "k2": kl_loss_k2,
    "k3_is": kl_loss_k3_is,
    "k3": kl_loss_k3,
}


def kl_penalty_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    estimator: KLLossEstimator,
    old_logprobs: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-token KL loss term, to add to the policy loss (times a ``kl_coef``) before
    :func:`rlhfkit.algos.aggregate_loss`.

    Args:
        logprobs: ``(B, T)`` log pi_theta of the sampled tokens (with gradient).
        ref_logprobs: ``(B, T)`` log pi_ref of the same tokens.
        estimator: ``k2`` or ``k3_is`` (unbiased: the expected gradient under pi_old is that of
            KL(pi_theta || pi_ref)), or ``k3`` (biased; for comparison). ``DEFAULT_KL_LOSS_ESTIMATOR`` says
            which to choose and why.
        old_logprobs: ``(B, T)`` log pi_old, the policy that sampled the tokens (the rollout's
            ``logprobs``), for the importance weight of later PPO epochs; None: on-policy
            (pi_old = pi_theta).
        mask: optional ``(B, T)`` valid tokens.

    Returns:
        ``(B, T)``; masked positions are 0, with a zero gradient, whatever was stored there.

    Raises:
        ValueError: on an unknown estimator or mismatched shapes.
    """
    if estimator not in KL_LOSS_ESTIMATORS:
        raise ValueError(
            f"unknown KL loss estimator {estimator!r}; choose one of {', '.join(KL_LOSS_ESTIMATOR_NAMES)}"
        )
    shapes = {"logprobs": logprobs, "ref_logprobs": ref_logprobs, "old_logprobs": old_logprobs, "mask": mask}
    shapes = {name: tuple(x.shape) for name, x in shapes.items() if x is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shapes must match, all (B, T): {shapes}")
    if mask is None:
        return KL_LOSS_ESTIMATORS[estimator](logprobs, ref_logprobs, old_logprobs)
    # never read masked entries: 0 there gives finite values whose gradient fill_masked then cuts
    logprobs, ref_logprobs = fill_masked(logprobs, mask), fill_masked(ref_logprobs, mask)
    old = None if old_logprobs is None else fill_masked(old_logprobs, mask)
    return fill_masked(KL_LOSS_ESTIMATORS[estimator](logprobs, ref_logprobs, old), mask)  # (B, T)


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` long: the column of each row's last valid token (any padding side, holes allowed); -1
    for a row with no valid token. ``mask`` ``(B, T)``."""
    T = mask.shape[-1]
    m = mask if mask.dtype == torch.bool else mask != 0
    steps = torch.arange(T, device=mask.device)
    return torch.where(m, steps, -1).amax(dim=-1) if T else torch.full(m.shape[:-1], -1, device=mask.device)


def shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float | torch.Tensor,
    estimator: KLEstimator = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: ``r_t = -kl_coef * kl_t``, plus the score.

    Args:
        scores: ``(B,)`` one score per sequence, added on the LAST VALID token of each row (whatever
            the padding side, holes allowed; a row with no valid token gets nothing), or ``(B, T)``
            dense scores (a process reward model), added where the mask is 1.
        logprobs: ``(B, T)`` log pi_theta of the sampled tokens (at sampling time).
        ref_logprobs: ``(B, T)`` log pi_ref of the same tokens.
        mask: ``(B, T)`` 1 on valid response tokens.
        kl_coef: the KL coefficient (a float or a 0-d tensor, e.g. a controller's ``value``).
        estimator: ``k1``, ``k2`` or ``k3`` (Schulman 2020), the one that is logged as well.

    Returns:
        ``(rewards, kl)``, both ``(B, T)`` and 0 at masked positions. ``kl`` is the per-token estimate.

    Raises:
        ValueError: on mismatched shapes, an unknown estimator, or a NaN/inf score where it would land.
    """
    estimate = kl_estimator(estimator)
    if not (logprobs.shape == ref_logprobs.shape == mask.shape) or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must all be (B, T)"
        )
    if scores.shape not in (mask.shape[:1], mask.shape):
        raise ValueError(f"scores {tuple(scores.shape)} must be (B,) or (B, T) for mask {tuple(mask.shape)}")
    _check_scores(scores, mask)
    # never read masked entries: a junk log-prob there must not reach the estimate (nor its gradient)
    kl = fill_masked(estimate(fill_masked(logprobs, mask), fill_masked(ref_logprobs, mask)), mask)  # (B, T)
    rewards = -kl_coef * kl  # (B, T)
    if scores.dim() == 2:
        return rewards + fill_masked(scores.to(rewards.dtype), mask), kl
    last = last_valid_index(mask)  # (B,)
    has_token = last >= 0
    rows = torch.arange(len(last), device=mask.device)[has_token]
    rewards = rewards.index_put((rows, last[has_token]), scores[has_token].to(rewards.dtype), accumulate=True)
    return rewards, kl


def _check_scores(scores: torch.Tensor, mask: torch.Tensor) -> None:
    """ValueError naming the first row whose score is NaN/inf (where it would land in the rewards)."""
    bad = ~torch.isfinite(scores)
    bad = (bad & (mask != 0)).any(dim=-1) if scores.dim() == 2 else bad & (mask != 0).any(dim=-1)  # (B,)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"scores has NaN/inf for {int(bad.sum())} sequence(s), the first at row {row}; "
            "fix the reward model / reward function that produced it"
        )


class FixedKLController:
    """A constant KL coefficient.

    Args:
        kl_coef: the coefficient (0.05 in Huang et al. 2024's reproduction of Stiennon et al. 2020).
    """

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, kl: float, n_steps: int) -> None:
        """Does nothing: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019 (section 2.2): steer the KL towards ``target``.

    ``e = clip(kl / target - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.

    Args:
        init_kl_coef: the starting coefficient.
        target: the target KL, in the units of ``update``'s ``kl``: nats per response (the batch mean of
            the per-sequence sum of kl_t, what ``kl/mean`` logs).
        horizon: how many samples (responses) it takes to move the coefficient by e (10,000 in the paper).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if init_kl_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"need init_kl_coef >= 0, target > 0 and horizon > 0; got {init_kl_coef}, {target}, {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, kl: float, n_steps: int) -> None:
        """Move the coefficient after a rollout of ``n_steps`` responses whose mean per-sequence KL is ``kl``."""
        error = min(max(float(kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
