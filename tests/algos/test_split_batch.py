"""Statistics over a batch that two processes hold in halves: ``all_sum`` makes them the whole batch's.

The two "processes" are simulated in one: the second half's packed sums are recorded, and the first half's
``all_sum`` adds them, as an all-reduce would.
"""

from __future__ import annotations

import pytest
import torch

from rlhfkit.algos import ADVANTAGE_ESTIMATORS, masked_moments, masked_whiten


def _halves(fn, cut: int):
    """``fn(rows, all_sum)`` on rows [:cut] and on rows [cut:], each half's ``all_sum`` adding the other half's
    sums; the two results."""
    first, second = slice(0, cut), slice(cut, None)
    results = []
    for mine, other in ((first, second), (second, first)):
        recorded: list[torch.Tensor] = []
        fn(other, lambda t, into=recorded: into.append(t.clone()) or t)  # the other process's sums
        results.append(fn(mine, lambda t, other_sums=recorded: t + other_sums[0]))
    return results


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 7, generator=g, dtype=torch.float64) * 3 + 1
    mask = torch.rand(6, 7, generator=g) > 0.3
    mask[1] = False  # a row without a valid token
    return x, mask


def test_moments_and_whitening_of_halves_are_the_whole_batchs():
    x, mask = _batch()
    mean, var = masked_moments(x, mask)
    for part in _halves(lambda rows, s: torch.stack(masked_moments(x[rows], mask[rows], s)), 2):
        assert torch.allclose(part, torch.stack([mean, var]), rtol=1e-12, atol=1e-12)
    whole = masked_whiten(x, mask)
    first, second = _halves(lambda rows, s: masked_whiten(x[rows], mask[rows], all_sum=s), 4)
    assert torch.allclose(torch.cat([first, second]), whole, atol=1e-12)
    # the control: each half whitened on its own is not the whole batch's whitening
    assert not torch.allclose(
        torch.cat([masked_whiten(x[:4], mask[:4]), masked_whiten(x[4:], mask[4:])]), whole, atol=1e-3
    )


@pytest.mark.parametrize("name", ["gae", "reinforce_pp"])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_whitening_estimators_on_halves_give_the_whole_batchs_advantages(name, norm_by_std):
    rewards, mask = _batch(1)
    values = torch.randn(6, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    estimator = ADVANTAGE_ESTIMATORS[name]

    def run(rows, all_sum=None):
        return estimator(
            rewards[rows], mask[rows], values[rows], None, norm_by_std=norm_by_std, all_sum=all_sum
        )[0]

    whole = run(slice(None))
    first, second = _halves(run, 3)
    assert torch.allclose(torch.cat([first, second]), whole, atol=1e-12)
