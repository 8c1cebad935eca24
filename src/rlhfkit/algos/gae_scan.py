"""The fast GAE: :func:`compute_gae`, a chunked scan that must equal :func:`rlhfkit.algos.gae_loop`.

``gae_loop`` (in :mod:`rlhfkit.algos.advantages`) is the definition, the reverse loop
``A_t = delta_t + gamma * lam * (1 - done_t) * A_{n(t)}`` over each row's valid tokens, one step at a time
in float64. ``compute_gae`` computes the same numbers without a Python loop over time, and
``tests/algos/test_gae.py`` holds it to ``gae_loop`` within ``1e-5 * (1 + |A|)`` on random masks (holes,
either padding side, dones) and on junk at masked positions. Shapes: ``B`` batch, ``T`` response length;
``mask`` is 1 on real response tokens. Masked inputs are never read and masked outputs are 0. NaN or inf at
a VALID position of ``rewards`` or ``values`` raises ``ValueError`` (a broken reward function or critic
must not train silently on NaN).

How: each row's valid tokens are made one run (left as they are when they already are, any padding side;
gathered together when the mask has holes), and the backward recursion ``A_t = delta_t + c * A_{t+1}``
(c = gamma * lam) is a discounted reverse cumulative sum, computed in chunks of ``_CHUNK`` steps by one
matrix product per chunk plus the same recursion over the chunk heads. Only positive powers ``c**k <= 1``
appear, so nothing overflows. Episode ends (``dones``) cut the sum: with z the uncut sum and b the step
after the next done, ``A_t = z_t - c**(b - t) * z_b``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from rlhfkit.algos.masked import _bool_mask, float_mask

_CHUNK = 32  # steps per chunk of the scan; 16-64 are equally fast on CPU at B=512, T=1024

_BLOCK_BYTES = 1 << 21  # on CPU, rows go in blocks of ~2 MB per (b, T) temporary (fewer ops beat cache)

_FLOAT64_ABOVE_LAM = 0.95  # above this lam the sum spans hundreds of steps: accumulate in float64


@functools.lru_cache(maxsize=64)
def _decay_matrix(n: int, c: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(n + 1, n)``: rows 0..n-1 upper-triangular ``M[j, k] = c**(k - j)`` for ``k >= j``; row n holds
    ``c**(n - k)``, the decay from step k to the step after the chunk. Built in float64, then cast."""
    idx = torch.arange(n + 1, dtype=torch.float64, device=device)
    lag = idx[None, :n] - idx[:, None]  # (n + 1, n): k - j
    m = torch.where(lag >= 0, c ** lag.clamp(min=0), 0.0)
    m[n] = c ** (n - idx[:n])
    return m.to(dtype)


def discounted_cumsum(
    x: torch.Tensor, c: float, chunk: int = _CHUNK, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Reverse discounted cumulative sum along the last dim: ``y_t = x_t + c * y_{t+1}``, 0 past the end.

    Args:
        x: ``(B, L)``.
        c: the discount, ``0 <= c <= 1``.
        chunk: steps per chunk (one ``(chunk, chunk)`` matrix product each).
        out: optional contiguous ``(B, L)`` tensor (not ``x``) to write the result into.

    Returns:
        ``(B, L)`` in ``x``'s dtype (``out`` when given).
    """
    B, L = x.shape
    if L <= chunk:
        return torch.matmul(x, _decay_matrix(L, c, x.dtype, x.device)[:L].T, out=out)
    n = -(-L // chunk)
    padded = L % chunk != 0
    xc = F.pad(x, (0, n * chunk - L)).view(B, n, chunk) if padded else x.view(B, n, chunk)  # (B, n, C)
    m = _decay_matrix(chunk, c, x.dtype, x.device)  # (C + 1, C)
    y = torch.matmul(xc, m[:chunk].T, out=None if out is None or padded else out.view(B, n, chunk))
    # y (B, n, C) holds the sums within each chunk; add what the later chunks contribute
    full_heads = discounted_cumsum(y[:, :, 0], c**chunk, chunk)  # (B, n): chunk starts, all later chunks
    carry = F.pad(full_heads[:, 1:], (0, 1))  # (B, n): the full sum at the start of the next chunk
    y.addcmul_(carry[:, :, None], m[chunk])  # (B, n, C)
    y = y.view(B, n * chunk)[:, :L]
    return out.copy_(y) if out is not None and padded else y


def _cut_at_dones(x: torch.Tensor, c: float, done: torch.Tensor) -> torch.Tensor:
    """``y_t = x_t + c * (1 - done_t) * y_{t+1}``: the reverse discounted sum, cut after each done.

    With z the uncut sum and b the step after the next done at or after t (L if none, where z is 0),
    ``y_t = z_t - c**(b - t) * z_b``. Step indices are held in ``x``'s float dtype (exact below 2**24).

    Args:
        x: ``(B, L)``.
        done: ``(B, L)``, 0./1. in ``x``'s dtype.
    """
    B, L = x.shape
    z = discounted_cumsum(x, c)  # (B, L), uncut
    steps = torch.arange(L, dtype=x.dtype, device=x.device)  # (L,)
    marked = L - (L - steps) * done  # (B, L): t where done_t, else L
    next_done = marked.flip(1).cummin(1).values.flip(1)  # (B, L): the first done at or after t
    after = (next_done + 1).clamp_(max=L)  # (B, L): b
    z_after = F.pad(z, (0, 1)).gather(1, after.long())  # (B, L); 0 when no done follows
    log_c = math.log(c) if c > 0 else -math.inf
    decay = torch.exp_((after - steps).mul_(log_c))  # (B, L): c**(b - t), b - t >= 1
    return z.sub_(decay.mul_(z_after))


def _gae_one_run(
    rewards: torch.Tensor,
    values: torch.Tensor,
    done: torch.Tensor | None,
    gamma: float,
    lam: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """GAE for rows whose valid tokens form one run, ``rewards``/``values``/``done`` ``(B, L)`` zero elsewhere.

    Then n(t) = t + 1 inside the run, V and A are 0 after it (what the zeros give), and positions
    before the run are never read by the run; their junk outputs are masked by the caller.
    Overwrites ``rewards`` (fresh (B, L) buffers are costly: each one page-faults in on CPU); writes
    into ``out`` when given (without dones).
    """
    delta = rewards.sub_(values)  # (B, L): r_t - V_t, then + gamma * (1 - done_t) * V_{t+1}
    if done is None:
        delta[:, :-1].add_(values[:, 1:], alpha=gamma)
        return discounted_cumsum(delta, gamma * lam, out=out)
    not_done = 1.0 - done[:, :-1]  # (B, L - 1)
    delta[:, :-1].addcmul_(values[:, 1:], not_done, value=gamma)
    return _cut_at_dones(delta, gamma * lam, done)


def _raise_if_nonfinite(named: dict[str, torch.Tensor], mask: torch.Tensor, first_row: int) -> None:
    """ValueError naming the first NaN/inf at a valid position of any of the tensors, if there is one."""
    for name, x in named.items():
        bad = ~torch.isfinite(x) & mask
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} has NaN/inf value(s) at valid (mask = 1) positions, the first at row "
                f"{first_row + row}, position {col}; fix the reward function / model that produced them"
            )


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
    """Generalized advantage estimation over the valid tokens of each row: what ``gae_loop`` computes, fast.

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
    B, T = rewards.shape
    out_dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    work = torch.float64 if lam > _FLOAT64_ABOVE_LAM else out_dtype
    mask = _bool_mask(mask)
    advantages = torch.empty(B, T, dtype=out_dtype, device=rewards.device)
    returns = torch.empty_like(advantages)
    # On CPU, blocks of rows keep every temporary in cache (and fresh (B, T) buffers, which page-fault
    # in, out of the way); an accelerator takes the whole batch at once.
    block = _BLOCK_BYTES // (T * work.itemsize + 1) if rewards.device.type == "cpu" else B
    for first in range(0, B, max(1, block)):
        rows = slice(first, first + max(1, block))
        d = None if dones is None else dones[rows]
        named = {"rewards": rewards[rows], "values": values[rows]}
        _gae_rows(named, mask[rows], d, gamma, lam, work, advantages[rows], returns[rows], first)
    return advantages, returns


def _gae_rows(named, mask, dones, gamma, lam, work, adv_out, ret_out, first_row) -> None:
    """compute_gae on a block of rows in the working dtype ``work``, written into ``adv_out``/``ret_out``.

    Fast path: zero masked inputs by multiplying with the mask, which is exact unless some entry is
    NaN/inf; then the returns are not all finite (NaN * 0 = NaN spreads), one sum tells, and the block
    is redone with ``torch.where`` after checking that no VALID entry is NaN/inf. The outputs double as
    the buffers for the zeroed values and rewards: on CPU each fresh (B, T) buffer costs page faults.
    """
    in_place = adv_out.dtype == work
    mask_f = float_mask(mask, work)  # (b, T)
    done = None if dones is None else float_mask(_bool_mask(dones) & mask, work)  # (b, T), junk dropped
    one_run = _one_run_per_row(mask_f, scratch=adv_out if in_place else None)
    v = torch.mul(named["values"], mask_f, out=adv_out if in_place else None)  # (b, T)
    r = torch.mul(named["rewards"], mask_f, out=ret_out if in_place else None)  # (b, T)
    adv = _masked_advantages(r, v, mask, mask_f, done, one_run, gamma, lam)  # (b, T)
    returns = torch.add(adv, v, out=r)  # (b, T)
    if not torch.isfinite(returns.sum()):
        _raise_if_nonfinite(named, mask, first_row)
        v, r = (torch.where(mask, named[k], 0.0).to(work) for k in ("values", "rewards"))
        adv = _masked_advantages(r, v, mask, float_mask(mask, work), done, one_run, gamma, lam)
        returns = torch.add(adv, v, out=r)
    adv_out.copy_(adv)
    if returns is not ret_out:
        ret_out.copy_(returns)


def _masked_advantages(r, v, mask, mask_f, done, one_run, gamma, lam) -> torch.Tensor:
    """The GAE arithmetic on zeroed ``r``, ``v`` ``(b, T)``, 0 at masked positions.

    Uses up ``r`` and ``mask_f`` (``r`` is free when this returns): in the common case (one run per row,
    no dones) the advantages are written into ``mask_f``'s buffer, and the mask is read again from the
    bool ``mask`` into ``r``'s, so no other (b, T) buffer is needed.
    """
    if one_run and done is None:
        adv = _gae_one_run(r, v, None, gamma, lam, out=mask_f)  # (b, T), junk before each run
        return adv.mul_(r.copy_(mask.view(torch.uint8)))
    if one_run:
        adv = _gae_one_run(r, v, done, gamma, lam)
    else:
        adv = _gae_with_holes(r, v, mask, done, gamma, lam)
    return adv.mul_(mask_f)


def _one_run_per_row(mask_f: torch.Tensor, scratch: torch.Tensor | None = None) -> bool:
    """Whether the valid tokens of every row of ``mask_f`` ``(B, T)`` (0./1.) form at most one run.

    ``scratch``: an optional ``(B, T)`` buffer of ``mask_f``'s dtype to use (and overwrite).
    """
    both = torch.mul(mask_f[:, 1:], mask_f[:, :-1], out=None if scratch is None else scratch[:, 1:])
    pairs = both.sum(1)  # (B,): adjacent valid pairs; runs = tokens - pairs
    return bool((mask_f.sum(1) - pairs <= 1).all())


def _gae_with_holes(r, v, mask, done, gamma, lam) -> torch.Tensor:
    """Gather each row's valid tokens to the left (so n(t) = t + 1), run GAE there, spread back.

    ``r``, ``v``, ``done`` ``(B, T)`` are 0 at masked positions, so a masked token can share the slot of
    the valid token before it: ``scatter_add_`` adds its 0 there.
    """
    B, T = r.shape
    slot = mask.view(torch.uint8).cumsum(1, dtype=torch.int64).sub_(1)  # (B, T): rank among valid tokens
    L = int(slot[:, -1].max()) + 1
    slot.clamp_(min=0)

    def compact(x: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, L)
        return x.new_zeros(B, L).scatter_add_(1, slot, x)

    done_c = None if done is None else compact(done)
    adv_c = _gae_one_run(compact(r), compact(v), done_c, gamma, lam)  # (B, L)
    return adv_c.gather(1, slot)  # (B, T), junk at masked positions
