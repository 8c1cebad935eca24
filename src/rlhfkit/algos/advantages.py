"""Advantage estimation: GAE and the critic-free estimators, behind one dict ``ADVANTAGE_ESTIMATORS``.

Shapes: ``B`` batch, ``T`` response length; ``mask`` is 1 on real response tokens. Masked inputs are
never read and masked outputs are 0. NaN or inf at a VALID position of ``rewards`` or ``values`` raises
``ValueError`` (a broken reward function or critic must not train silently on NaN).

GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
eq. 16) is defined here by :func:`gae_loop`, the plain reverse loop, with the textbook ``done`` convention
``delta = r + gamma * V' * (1 - done) - V``. Training calls :func:`compute_gae`
(:mod:`rlhfkit.algos.gae_scan`), a chunked scan with no Python loop over time that must equal ``gae_loop``.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from rlhfkit.algos.gae_scan import _raise_if_nonfinite, compute_gae
from rlhfkit.algos.masked import (
    AllSum,
    _bool_mask,
    fill_masked,
    masked_moments,
    masked_sum,
    masked_whiten,
)


def gae_loop(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    dones: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE by its definition: each row walked backwards over its valid tokens, one step at a time.

    For a valid t with next valid position n(t) in its row (V_{n(t)} = A_{n(t)} = 0 after the row's last
    valid token, where the episode ends)::

        delta_t = r_t + gamma * (1 - done_t) * V_{n(t)} - V_t
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{n(t)}
        returns = A + V

    This is the reference implementation (the form of CleanRL's ``ppo.py`` and torchtune's
    ``estimate_advantages``, with masked positions skipped rather than read). It is slow (a Python loop
    over B * T) and exact (float64); :func:`compute_gae` is the fast equal that training uses.

    Args:
        rewards: ``(B, T)`` per-token rewards.
        values: ``(B, T)`` critic values V_t (of the state before token t).
        mask: ``(B, T)`` 1/True on valid tokens; holes and either padding side are allowed.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].
        dones: optional ``(B, T)`` 0/1 (or bool); ``done_t = 1`` ends the episode after action t.

    Returns:
        ``(advantages, returns)``, both ``(B, T)`` float64, 0 at masked positions.
    """
    r, v, m = rewards.double().tolist(), values.double().tolist(), mask.bool().tolist()
    d = dones.bool().tolist() if dones is not None else None
    B, T = len(r), len(r[0]) if len(r) else 0
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_value, next_adv = 0.0, 0.0  # after the row's last valid token
        for t in reversed(range(T)):
            if not m[b][t]:
                continue  # a masked position is never read: n(t) skips it
            not_done = 0.0 if (d is not None and d[b][t]) else 1.0
            delta = r[b][t] + gamma * not_done * next_value - v[b][t]
            adv[b][t] = delta + gamma * lam * not_done * next_adv
            next_value, next_adv = v[b][t], adv[b][t]
    advantages = torch.tensor(adv, dtype=torch.float64).reshape(B, T).to(rewards.device)
    returns = torch.where(mask.bool(), advantages + values.double().nan_to_num(0.0, 0.0, 0.0), 0.0)
    return advantages, returns


# --- the estimators behind one signature -----------------------------------------------------------------
AdvantageEstimator = Literal["gae", "grpo", "rloo", "reinforce_pp"]
"""The names in :data:`ADVANTAGE_ESTIMATORS` (a config field uses this ``Literal``)."""


class AdvantageFn(Protocol):
    def __call__(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        values: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
        *,
        gamma: float = 1.0,
        lam: float = 0.95,
        norm_by_std: bool = True,
        eps: float = 1e-6,
        all_sum: AllSum | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def gae_advantages(
    rewards,
    mask,
    values=None,
    group_ids=None,
    *,
    gamma=1.0,
    lam=0.95,
    norm_by_std=True,
    eps=1e-6,
    all_sum=None,
):
    """PPO's estimator: :func:`compute_gae` with the critic's ``values`` ``(B, T)`` (required).

    With ``norm_by_std`` the advantages are whitened over the valid tokens of the batch (mean 0, std 1;
    lm-human-preferences does this, Huang et al. 2024); the returns are GAE's, unwhitened. With ``all_sum``
    (the batch split over processes, :data:`rlhfkit.algos.masked.AllSum`) the whitening statistics are the
    whole batch's. ``group_ids`` is not used.
    """
    if values is None:
        raise ValueError("the 'gae' advantage estimator needs the critic's values; the critic-free ones are "
                         "'grpo', 'rloo' and 'reinforce_pp'")  # fmt: skip
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    if norm_by_std:
        advantages = masked_whiten(advantages, mask, eps=eps, all_sum=all_sum)
    return advantages, returns


def grpo_advantages(
    rewards,
    mask,
    values=None,
    group_ids=None,
    *,
    gamma=1.0,
    lam=0.95,
    norm_by_std=True,
    eps=1e-6,
    all_sum=None,
):
    """GRPO (Shao et al. 2024, DeepSeekMath section 4.1.2, outcome supervision): ``(s - mean_g) / (std_g + eps)``.

    s_i is the sum of row i's valid rewards; mean and std (Bessel's correction) are over the rows that
    share its group id; a group of one gets 0. With ``norm_by_std=False`` there is no division (Dr. GRPO,
    Liu et al. 2025). The returns are s_i, broadcast like the advantages. ``values``, ``gamma`` and
    ``lam`` are not used, nor ``all_sum``: a group's statistics are its own, so a group must not be split
    between processes.
    """
    s, members = _sequence_returns(rewards, mask), _Groups(group_ids, len(rewards), "grpo")
    centred = s - members.mean(s)  # (B,)
    advantages = centred / (members.std(s) + eps) if norm_by_std else centred
    return _broadcast(advantages, mask), _broadcast(s, mask)


def rloo_advantages(
    rewards,
    mask,
    values=None,
    group_ids=None,
    *,
    gamma=1.0,
    lam=0.95,
    norm_by_std=True,
    eps=1e-6,
    all_sum=None,
):
    """RLOO (Ahmadian et al. 2024, eq. 4; Kool et al. 2019): ``s_i - (sum_g s - s_i) / (k - 1)``.

    The baseline is the mean of the other k - 1 responses to the same prompt (same group id); a group of
    one gets 0. The returns are s_i, broadcast like the advantages. ``values``, ``gamma``, ``lam``,
    ``norm_by_std`` and ``eps`` are not used (the leave-one-out baseline is not normalised), nor
    ``all_sum`` (a group must not be split between processes).
    """
    s, members = _sequence_returns(rewards, mask), _Groups(group_ids, len(rewards), "rloo")
    k = members.size()  # (B,)
    others = (members.sum(s) - s) / (k - 1).clamp(min=1)  # (B,)
    return _broadcast(torch.where(k > 1, s - others, 0.0), mask), _broadcast(s, mask)


def reinforce_pp_advantages(
    rewards,
    mask,
    values=None,
    group_ids=None,
    *,
    gamma=1.0,
    lam=0.95,
    norm_by_std=True,
    eps=1e-6,
    all_sum=None,
):
    """REINFORCE++ (Hu 2025): the reward-to-go ``G_t = sum_{k>=t} gamma**(k-t) r_k``, whitened over all
    valid tokens of the batch (k runs over valid positions, as n(t) does in GAE).

    With ``norm_by_std=False`` it is only centred. The returns are G, unwhitened. With ``all_sum`` the
    statistics are the whole batch's (split over processes). ``values``, ``group_ids`` and ``lam`` are not
    used.
    """
    returns, _ = compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, lam=1.0)  # A = G when V = 0
    if norm_by_std:
        return masked_whiten(returns, mask, eps=eps, all_sum=all_sum), returns
    return fill_masked(returns - masked_moments(returns, mask, all_sum)[0], mask), returns


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}
"""Name -> estimator, one signature: ``f(rewards (B, T), mask (B, T), values=None, group_ids=None, *,
gamma, lam, norm_by_std, eps, all_sum=None) -> (advantages (B, T), returns (B, T))``, both 0 at masked
positions; ``all_sum`` makes batch-wide statistics span the processes that hold the batch in parts.
NaN/inf rewards at valid positions raise ValueError."""


def _sequence_returns(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` s_i = sum of row i's valid rewards (float32 at least); ValueError on NaN/inf where valid."""
    if rewards.dim() != 2 or rewards.shape != mask.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} must both be (B, T)")
    mask = _bool_mask(mask)
    _raise_if_nonfinite({"rewards": rewards}, mask, 0)
    return masked_sum(rewards.to(torch.promote_types(rewards.dtype, torch.float32)), mask, dim=1)


def _broadcast(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` -> ``(B, T)``: each row's value on its valid tokens, 0 elsewhere."""
    return fill_masked(per_row[:, None].expand(mask.shape), mask)


class _Groups:
    """Per-group sums over rows with the same id (ids need not be contiguous), read back per row."""

    def __init__(self, group_ids: torch.Tensor | None, batch_size: int, estimator: str):
        if group_ids is None:
            raise ValueError(
                f"the '{estimator}' advantage estimator needs group_ids (B,): the prompt of each response"
            )
        if group_ids.shape != (batch_size,) or group_ids.is_floating_point():
            raise ValueError(f"group_ids must be an integer tensor of shape ({batch_size},), got "
                             f"{group_ids.dtype} {tuple(group_ids.shape)}")  # fmt: skip
        _, self.index = torch.unique(group_ids, return_inverse=True)  # (B,): group of each row, 0..G-1
        self.n_groups = int(self.index.max()) + 1 if batch_size else 0

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``(B,)``: the sum of ``x`` over each row's group."""
        return x.new_zeros(self.n_groups).index_add_(0, self.index, x)[self.index]

    def size(self) -> torch.Tensor:
        """``(B,)`` float: k, the number of rows in each row's group."""
        return self.sum(torch.ones(len(self.index), device=self.index.device))

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        return self.sum(x) / self.size().to(x.dtype)

    def std(self, x: torch.Tensor) -> torch.Tensor:
        """``(B,)``: the group's standard deviation with Bessel's correction; 0 for a group of one."""
        k = self.size().to(x.dtype)
        sq = self.sum((x - self.mean(x)) ** 2)
        return torch.where(k > 1, sq / (k - 1).clamp(min=1), 0.0).sqrt()
