"""Advantage estimation: GAE and the critic-free estimators, behind one dict ``ADVANTAGE_ESTIMATORS``.

Shapes: ``B`` batch, ``T`` response length; ``mask`` is 1 on real response tokens. Masked inputs are
never read and masked outputs are 0. NaN or inf at a VALID position of ``rewards`` or ``values`` raises
``ValueError`` (a broken reward function or critic must not train silently on NaN).

``compute_gae`` follows Schulman et al. 2016 ("High-Dimensional Continuous Control Using Generalized
Advantage Estimation", eq. 16) with the textbook ``done`` convention, ``delta = r + gamma * V' * (1 - done)
- V``. It has no Python loop over time: each row's valid tokens are made one run (left as they are when
they already are, any padding side; gathered together when the mask has holes), and the backward
recursion ``A_t = delta_t + c * A_{t+1}`` (c = gamma * lam) is a discounted reverse cumulative sum,
computed in chunks of ``_CHUNK`` steps by one matrix product per chunk plus the same recursion over the
chunk heads. Only positive powers ``c**k <= 1`` appear, so nothing overflows. Episode ends (``dones``)
cut the sum: with z the uncut sum and b the step after the next done, ``A_t = z_t - c**(b - t) * z_b``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhfkit.algos.masked import _bool_mask, float_mask

_CHUNK = 32  # steps per chunk of the scan; 16-64 are equally fast on CPU at B=512, T=1024

_FLOAT64_ABOVE_LAM = 0.95  # above this lam the sum spans hundreds of steps: accumulate in float64


def _decay_matrix(n: int, c: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(n, n)`` upper-triangular ``M[j, k] = c**(k - j)`` for ``k >= j`` (built in float64)."""
    idx = torch.arange(n, dtype=torch.float64, device=device)
    lag = idx[None, :] - idx[:, None]  # (n, n): k - j
    return torch.where(lag >= 0, c ** lag.clamp(min=0), 0.0).to(dtype)


def discounted_cumsum(x: torch.Tensor, c: float, chunk: int = _CHUNK) -> torch.Tensor:
    """Reverse discounted cumulative sum along the last dim: ``y_t = x_t + c * y_{t+1}``, 0 past the end.

    Args:
        x: ``(B, L)``.
        c: the discount, ``0 <= c <= 1``.

    Returns:
        ``(B, L)`` in ``x``'s dtype.
    """
    B, L = x.shape
    if L <= chunk:
        return x @ _decay_matrix(L, c, x.dtype, x.device).T
    n = -(-L // chunk)
    xc = F.pad(x, (0, n * chunk - L)).view(B, n, chunk)  # (B, n, C)
    m = _decay_matrix(chunk, c, x.dtype, x.device)  # (C, C)
    heads = xc @ m[0]  # (B, n): each chunk's own sum seen from its first step
    full_heads = discounted_cumsum(heads, c**chunk, chunk)  # (B, n): the same with all later chunks
    carry = F.pad(full_heads[:, 1:], (0, 1))  # (B, n): the full sum at the start of the next chunk
    to_end = c ** (chunk - torch.arange(chunk, dtype=torch.float64, device=x.device))  # (C,)
    y = (xc @ m.T).addcmul_(carry[:, :, None], to_end.to(x.dtype))  # (B, n, C)
    return y.view(B, n * chunk)[:, :L]


def _cut_at_dones(x: torch.Tensor, c: float, done: torch.Tensor) -> torch.Tensor:
    """``y_t = x_t + c * (1 - done_t) * y_{t+1}``: the reverse discounted sum, cut after each done.

    Args:
        x: ``(B, L)``.
        done: ``(B, L)`` bool.
    """
    B, L = x.shape
    z = discounted_cumsum(x, c)  # (B, L), uncut
    steps = torch.arange(L, device=x.device)
    next_done = torch.where(done, steps, L).flip(1).cummin(1).values.flip(1)  # (B, L): first done >= t
    after = (next_done + 1).clamp(max=L)  # (B, L): b, the first step of the next episode
    z_after = F.pad(z, (0, 1)).gather(1, after)  # (B, L); 0 when no done follows
    return z - (c ** (after - steps).to(x.dtype)) * z_after


def _gae_one_run(
    rewards: torch.Tensor, values: torch.Tensor, done: torch.Tensor | None, gamma: float, lam: float
) -> torch.Tensor:
    """GAE for rows whose valid tokens form one run, ``rewards``/``values`` ``(B, L)`` zero elsewhere.

    Then n(t) = t + 1 inside the run, V and A are 0 after it (what the zeros give), and positions
    before the run are never read by the run; their junk outputs are masked by the caller.
    """
    v_next = F.pad(values[:, 1:], (0, 1))  # (B, L): V_{t+1}
    if done is None:
        delta = torch.add(rewards - values, v_next, alpha=gamma)  # (B, L)
        return discounted_cumsum(delta, gamma * lam)
    not_done = 1.0 - float_mask(done, rewards.dtype)  # (B, L)
    delta = rewards - values + gamma * not_done * v_next  # (B, L)
    return _cut_at_dones(delta, gamma * lam, done)


def _zeroed_and_checked(named: dict[str, torch.Tensor], mask: torch.Tensor, mask_f: torch.Tensor, dtype):
    """The tensors with masked positions set to 0 (junk never read); ValueError on NaN/inf where valid.

    Fast path: ``x * mask`` is right unless some entry is non-finite, which one sum per tensor detects
    (one host sync for all); only then the slower exact ``torch.where`` runs and names the culprit.
    """
    out = {name: x.to(dtype) * mask_f for name, x in named.items()}
    if torch.isfinite(torch.stack([y.sum() for y in out.values()])).all():
        return list(out.values())
    for name, x in named.items():
        bad = ~torch.isfinite(x) & mask
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} has {int(bad.sum())} NaN/inf value(s) at valid (mask = 1) positions, the first at "
                f"row {row}, position {col}; fix the reward function / model that produced them"
            )
        out[name] = torch.where(mask, x.to(dtype), 0.0)
    return list(out.values())


def _check_gae_args(rewards, values, mask, gamma, lam, dones) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (B, T), got shape {tuple(rewards.shape)}")
    for name, x in (("values", values), ("mask", mask), ("dones", dones)):
        if x is not None and x.shape != rewards.shape:
            raise ValueError(f"{name} {tuple(x.shape)} must have the shape of rewards {tuple(rewards.shape)}")
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= float(x) <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {x}")


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    dones: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the valid tokens of each row (DESIGN.md defines it).

    For a valid t with next valid position n(t) in its row (V_{n(t)} = A_{n(t)} = 0 after the row's last
    valid token)::

        delta_t = r_t + gamma * (1 - done_t) * V_{n(t)} - V_t
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{n(t)}

    ``done_t = 1`` ends the episode after action t. To bootstrap a truncated fragment, add
    ``gamma * V(s_T)`` to its last reward. lam = 0 is one-step TD; lam = 1 is the Monte-Carlo return
    minus V.

    Args:
        rewards: ``(B, T)`` per-token rewards.
        values: ``(B, T)`` critic values V_t (of the state before token t).
        mask: ``(B, T)`` 1/True on valid tokens; holes and either padding side are allowed.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1]; above 0.95 the sum is accumulated in float64.
        dones: optional ``(B, T)`` 0/1 (or bool) episode ends; read only at valid positions.

    Returns:
        ``(advantages, returns)``, both ``(B, T)``, ``returns = advantages + values``, 0 at masked
        positions; float32 unless an input is float64.

    Raises:
        ValueError: on mismatched shapes, gamma/lam outside [0, 1], or NaN/inf at valid positions.
    """
    _check_gae_args(rewards, values, mask, gamma, lam, dones)
    gamma, lam = float(gamma), float(lam)
    out_dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    work = torch.float64 if lam > _FLOAT64_ABOVE_LAM else out_dtype
    mask = _bool_mask(mask)
    mask_f = float_mask(mask, work)  # (B, T)
    r, v = _zeroed_and_checked({"rewards": rewards, "values": values}, mask, mask_f, work)
    done = None if dones is None else (dones != 0) & mask  # (B, T) bool, junk at masked dropped
    runs = mask_f[:, :1].sum(1) + torch.relu(mask_f[:, 1:] - mask_f[:, :-1]).sum(1)  # (B,): runs per row
    if rewards.shape[1] == 0 or bool((runs <= 1).all()):
        adv = _gae_one_run(r, v, done, gamma, lam) * mask_f  # (B, T)
    else:
        adv = _gae_with_holes(r, v, mask, mask_f, done, gamma, lam)
    return adv.to(out_dtype), (adv + v).to(out_dtype)


def _gae_with_holes(r, v, mask, mask_f, done, gamma, lam) -> torch.Tensor:
    """Gather each row's valid tokens to the left (so n(t) = t + 1), run GAE there, scatter back."""
    B, T = r.shape
    counts = mask.sum(1)  # (B,)
    L = int(counts.max())
    pos = mask.cumsum(1) - 1  # (B, T): index of each valid token among its row's valid tokens
    slot = torch.where(mask, pos, L)  # (B, T); masked tokens go to a spare column L, dropped below

    def compact(x: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, L)
        return x.new_zeros(B, L + 1).scatter_(1, slot, x)[:, :L]

    done_c = None if done is None else compact(done)
    adv_c = _gae_one_run(compact(r), compact(v), done_c, gamma, lam)  # (B, L)
    return adv_c.gather(1, pos.clamp(min=0)) * mask_f  # (B, T)
