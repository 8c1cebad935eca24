"""Truncated importance sampling weights (Yao et al. 2025): hand-computed tensors, the cap, no gradient, and
junk at masked positions changing nothing."""

import math

import pytest
import torch

from rlhfkit.algos import tis_weights


def test_hand_computed_weights_and_cap():
    # ratios exp(0) = 1, exp(ln 0.5) = 0.5, exp(ln 3) = 3 -> capped at 2, and exp(ln 1.5) = 1.5
    logprobs = torch.tensor([[math.log(0.4), math.log(0.1), math.log(0.6)], [math.log(0.3), 0.0, 0.0]])
    engine = torch.tensor([[math.log(0.4), math.log(0.2), math.log(0.2)], [math.log(0.2), 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    w = tis_weights(logprobs, engine, mask, cap=2.0)
    expected = torch.tensor([[1.0, 0.5, 2.0], [1.5, 0.0, 0.0]])
    torch.testing.assert_close(w, expected, rtol=1e-6, atol=1e-7)


def test_equal_distributions_weigh_one():
    lp = torch.randn(4, 5)
    mask = torch.ones(4, 5, dtype=torch.bool)
    assert torch.equal(tis_weights(lp, lp.clone(), mask, cap=2.0), torch.ones(4, 5))


def test_junk_at_masked_positions_changes_nothing():
    g = torch.Generator().manual_seed(0)
    lp, eng = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.rand(3, 6, generator=g) > 0.4
    clean = tis_weights(lp, eng, mask, cap=3.0)
    junk_lp = torch.where(mask, lp, torch.tensor(float("nan")))
    junk_eng = torch.where(mask, eng, torch.tensor(float("inf")))
    assert torch.equal(tis_weights(junk_lp, junk_eng, mask, cap=3.0), clean)
    assert bool((clean[~mask] == 0).all())


def test_no_gradient_flows_through_the_weight():
    lp = torch.randn(2, 3, requires_grad=True)
    w = tis_weights(lp, torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), cap=2.0)
    assert not w.requires_grad


def test_reference_loop_on_random_inputs():
    g = torch.Generator().manual_seed(1)
    lp, eng = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    w = tis_weights(lp, eng, mask, cap=1.7)
    for i in range(5):
        for t in range(7):
            want = min(math.exp(float(lp[i, t]) - float(eng[i, t])), 1.7) if mask[i, t] else 0.0
            assert float(w[i, t]) == pytest.approx(want, rel=1e-6)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="one shape"):
        tis_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool), cap=2.0)
    with pytest.raises(ValueError, match="cap"):
        tis_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), cap=0.0)
