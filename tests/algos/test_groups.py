"""Degenerate-group counts against a plain per-group loop; junk at left-out rows changes nothing; and GRPO /
RLOO advantages stay finite on every kind of degenerate group."""

import math

import pytest
import torch

from rlhfkit.algos import grpo_advantages, rloo_advantages
from rlhfkit.algos.groups import group_counts


def plain_counts(scores, group_ids, kept):
    out = {"groups": 0, "zero_std": 0, "singleton": 0, "partial": 0, "empty": 0}
    for g in sorted(set(group_ids.tolist())):
        rows = [i for i in range(len(scores)) if group_ids[i] == g]
        values = [float(scores[i]) for i in rows if kept[i]]
        out["groups"] += 1
        out["zero_std"] += len(values) >= 2 and max(values) == min(values)
        out["singleton"] += len(values) == 1
        out["partial"] += len(values) < len(rows)
        out["empty"] += not values
    return out


def test_hand_built_groups():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 5.0, 2.0, 2.0, 7.0, 3.0])
    group_ids = torch.tensor([4, 4, 9, 9, 1, 1, 1, 2, 2])  # ids need not be contiguous nor sorted
    kept = torch.tensor([True, True, True, True, True, True, False, False, False])
    counts = {k: float(v) for k, v in group_counts(scores, group_ids, kept).items()}
    # group 4: all equal; 9: varied; 1: two kept, different, one left out; 2: none kept
    assert counts == {"groups": 4.0, "zero_std": 1.0, "singleton": 0.0, "partial": 2.0, "empty": 1.0}
    kept[5] = False  # group 1 now holds one scored response: a singleton
    counts = {k: float(v) for k, v in group_counts(scores, group_ids, kept).items()}
    assert counts["singleton"] == 1.0 and counts["zero_std"] == 1.0


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_counts_equal_a_plain_loop_and_ignore_junk(seed):
    g = torch.Generator().manual_seed(seed)
    n = 40
    group_ids = torch.randint(0, 9, (n,), generator=g)
    scores = torch.randint(0, 2, (n,), generator=g).float()  # 0/1 rewards: many zero-std groups
    kept = torch.rand(n, generator=g) > 0.25
    expected = plain_counts(scores, group_ids, kept)
    counts = {k: float(v) for k, v in group_counts(scores, group_ids, kept).items()}
    assert counts == {k: float(v) for k, v in expected.items()}
    junk = scores.masked_fill(~kept, float("nan"))  # a NaN where nothing scored changes nothing
    junk[~kept & (torch.arange(n) % 2 == 0)] = 1e30
    assert {k: float(v) for k, v in group_counts(junk, group_ids, kept).items()} == counts


def test_shapes_are_checked_and_an_empty_batch_counts_nothing():
    with pytest.raises(ValueError, match=r"\(B,\)"):
        group_counts(torch.zeros(3), torch.zeros(2, dtype=torch.long), torch.ones(3, dtype=torch.bool))
    empty = group_counts(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool))
    assert all(float(v) == 0 for v in empty.values())


@pytest.mark.parametrize("estimator", [grpo_advantages, rloo_advantages])
def test_degenerate_groups_give_finite_advantages(estimator):
    """All rewards equal, a group of one, and a left-out response (its own group, as the loop puts it)."""
    rewards = torch.zeros(5, 3)
    rewards[:, -1] = torch.tensor([1.0, 1.0, 0.5, 2.0, 0.0])
    mask = torch.ones(5, 3, dtype=torch.bool)
    mask[4] = False  # nothing scored it: no valid token
    group_ids = torch.tensor([0, 0, 1, 2, -5])  # equal pair, singleton, singleton, left out
    adv, ret = estimator(rewards, mask, None, group_ids)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv == 0).all()  # nothing to compare with in any group: no signal, and no NaN
    loss = -(adv * mask).sum() / mask.sum()
    assert math.isfinite(float(loss))
