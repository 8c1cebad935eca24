"""Plain reference loops (float64, one row and one step at a time) that the vectorised estimators must match.

Each is an estimator's definition (docs/design.md, "The algorithm core") written as directly as possible,
with no tensor tricks. GAE's reference loop is not here: it ships in the package, ``rlhfkit.algos.gae_loop``.
"""

from __future__ import annotations

import math

import torch


def reward_to_go_loop(rewards, mask, gamma):
    """G_t = sum over later valid k of gamma**(number of valid steps from t to k) * r_k. float64."""
    r, m = rewards.double().tolist(), mask.bool().tolist()
    out = [[0.0] * len(row) for row in r]
    for b, row in enumerate(r):
        g = 0.0
        for t in reversed(range(len(row))):
            if m[b][t]:
                g = row[t] + gamma * g
                out[b][t] = g
    return torch.tensor(out, dtype=torch.float64).reshape(rewards.shape)


def sequence_sums(rewards, mask):
    """s_i = sum of the valid rewards of row i, as a list of floats."""
    return [
        sum(x for x, keep in zip(row, mrow, strict=True) if keep)
        for row, mrow in zip(rewards.double().tolist(), mask.bool().tolist(), strict=True)
    ]


def group_members(group_ids):
    """{group id: [row indices]} in row order."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        groups.setdefault(g, []).append(i)
    return groups


def std_bessel(xs):
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def kl_penalty_loop(logprobs, ref_logprobs, old_logprobs, estimator):
    """The per-token KL loss VALUES of ``kl_penalty_loss``, one float at a time (float64 lists); ``old_logprobs``
    None is on-policy (weight 1). k2: w * (lp - ref)^2 / 2; k3_is: w * (r - 1 - log r), r = pi_ref / pi_theta;
    k3: r - 1 - log r; w = pi_theta / pi_old."""
    lp, ref = logprobs.double().tolist(), ref_logprobs.double().tolist()
    old = lp if old_logprobs is None else old_logprobs.double().tolist()
    out = []
    for lrow, rrow, orow in zip(lp, ref, old, strict=True):
        row = []
        for x, y, o in zip(lrow, rrow, orow, strict=True):
            w, r = math.exp(x - o), math.exp(y - x)
            k3 = r - 1 - math.log(r)
            row.append({"k2": w * 0.5 * (x - y) ** 2, "k3_is": w * k3, "k3": k3}[estimator])
        out.append(row)
    return out


def ppo_policy_loss_loop(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip):
    """PPO's per-token loss and which branch set it, one token at a time: the clipped surrogate with the
    ratio clipped to [1 - eps_low, 1 + eps_high] (DAPO), then, for A < 0, capped at -A * dual_clip (Ye et al.
    2020, eq. 5). Returns (losses, branches), float lists and one of "none", "low", "high", "dual" per token."""
    losses, branches = [], []
    for lrow, orow, arow in zip(logprobs.tolist(), old_logprobs.tolist(), advantages.tolist(), strict=True):
        lrow_out, brow = [], []
        for x, o, a in zip(lrow, orow, arow, strict=True):
            loss, branch = clipped_token_loss(a, math.exp(x - o), eps_low, eps_high, dual_clip)
            lrow_out.append(loss)
            brow.append(branch)
        losses.append(lrow_out)
        branches.append(brow)
    return losses, branches


def clipped_token_loss(a, ratio, eps_low, eps_high, dual_clip):
    """One token's clipped surrogate with advantage ``a`` and ``ratio``: (loss, branch), the branch one of
    "none", "low", "high", "dual"."""
    unclipped = -a * ratio
    clipped = -a * min(max(ratio, 1 - eps_low), 1 + eps_high)
    loss, branch = unclipped, "none"
    if clipped > unclipped:
        loss, branch = clipped, "low" if a < 0 else "high"
    if dual_clip is not None and a < 0 and loss > -a * dual_clip:
        loss, branch = -a * dual_clip, "dual"
    return loss, branch


def gspo_policy_loss_loop(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, dual_clip):
    """GSPO-token's per-token loss, one row at a time (Zheng et al. 2025): the row's ratio
    s = exp(mean over its valid tokens of (logprob - old_logprob)), then PPO's clipped surrogate of each valid
    token with that ratio and its own advantage (:func:`clipped_token_loss`). Returns (losses, branches,
    ratios): float lists, one of "none", "low", "high", "dual" per token ("masked" at padding, loss 0), and the
    ratio of each row."""
    losses, branches, ratios = [], [], []
    for lrow, orow, arow, mrow in zip(
        logprobs.tolist(), old_logprobs.tolist(), advantages.tolist(), mask.tolist(), strict=True
    ):
        diffs = [x - o for x, o, m in zip(lrow, orow, mrow, strict=True) if m]
        s = math.exp(sum(diffs) / len(diffs)) if diffs else 1.0
        ratios.append(s)
        lrow_out, brow = [], []
        for a, m in zip(arow, mrow, strict=True):
            if not m:
                lrow_out.append(0.0)
                brow.append("masked")
                continue
            loss, branch = clipped_token_loss(a, s, eps_low, eps_high, dual_clip)
            lrow_out.append(loss)
            brow.append(branch)
        losses.append(lrow_out)
        branches.append(brow)
    return losses, branches, ratios
