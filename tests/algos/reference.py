"""Plain reference loops (float64, one row and one step at a time) that the vectorised algos must match.

Each is the definition in DESIGN.md written as directly as possible, with no tensor tricks.
"""

from __future__ import annotations

import math

import torch


def gae_loop(rewards, values, mask, gamma, lam, dones=None):
    """GAE by the definition: walk each row backwards over its valid positions only. Returns float64."""
    r, v, m = rewards.double().tolist(), values.double().tolist(), mask.bool().tolist()
    d = dones.bool().tolist() if dones is not None else None
    B, T = len(r), len(r[0]) if len(r) else 0
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_value, next_adv = 0.0, 0.0  # after the row's last valid token
        for t in reversed(range(T)):
            if not m[b][t]:
                continue
            not_done = 0.0 if (d is not None and d[b][t]) else 1.0
            delta = r[b][t] + gamma * not_done * next_value - v[b][t]
            adv[b][t] = delta + gamma * lam * not_done * next_adv
            next_value, next_adv = v[b][t], adv[b][t]
    adv = torch.tensor(adv, dtype=torch.float64).reshape(B, T)
    ret = torch.where(mask.bool(), adv + values.double().nan_to_num(0.0, 0.0, 0.0), 0.0)
    return adv, ret


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
