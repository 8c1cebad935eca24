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
