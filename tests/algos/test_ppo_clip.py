"""ppo_policy_loss's clip-higher (DAPO) and dual clip (Ye et al. 2020): every branch by hand with its gradient,
the clip fractions, the symmetric default against the formula it replaced, a reference loop, junk (at both
importance-sampling levels), bad settings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfkit.algos import IMPORTANCE_SAMPLING_LEVELS, ppo_policy_loss
from rlhfkit.algos.kl import kl_k3
from rlhfkit.algos.masked import fill_masked, masked_mean

from .reference import ppo_policy_loss_loop
from .strategies import add_junk, batches

torch.set_num_threads(1)
BRANCHES = ("low", "high", "dual")


def test_every_branch_by_hand():
    # clip_eps 0.2 (lower bound 0.8), clip_eps_high 0.28 (upper bound 1.28), dual clip c = 3
    cases = [
        # (A, ratio, loss, d loss / d logprob, branch)
        (1.0, 1.1, -1.1, -1.1, "none"),  # A > 0 inside the range: -A * ratio, gradient -A * ratio
        (-1.0, 0.9, 0.9, 0.9, "none"),  # A < 0 inside the range
        (-1.0, 0.5, 0.8, 0.0, "low"),  # A < 0, ratio < 0.8: -A * 0.8 wins, no gradient
        (1.0, 1.5, -1.28, 0.0, "high"),  # A > 0, ratio > 1.28: -A * 1.28 wins
        (1.0, 1.25, -1.25, -1.25, "none"),  # clipped if symmetric (1.25 > 1.2), not with clip-higher
        (-1.0, 4.0, 3.0, 0.0, "dual"),  # A < 0, ratio > c: max(4, 1.28) = 4 capped at -A * c = 3
        (-1.0, 2.0, 2.0, 2.0, "none"),  # A < 0, 1.28 < ratio < c: unclipped, the dual bound not reached
        (2.0, 4.0, -2.56, 0.0, "high"),  # A > 0 and ratio > c: the dual clip is not for A > 0
        (2.0, 0.1, -0.2, -0.2, "none"),  # A > 0: min(-0.2, -A * c = -6) would be wrong; the dual clip is off
        (0.0, 3.5, 0.0, 0.0, "none"),  # A = 0: nothing to clip
    ]
    adv = torch.tensor([[c[0] for c in cases]], dtype=torch.float64)
    ratio = torch.tensor([[c[1] for c in cases]], dtype=torch.float64)
    logprobs = ratio.log().requires_grad_()
    loss, stats = ppo_policy_loss(
        logprobs, torch.zeros_like(ratio), adv, clip_eps=0.2, clip_eps_high=0.28, dual_clip=3.0
    )
    torch.testing.assert_close(loss, torch.tensor([[c[2] for c in cases]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[c[3] for c in cases]], dtype=torch.float64))
    n = len(cases)
    for b in BRANCHES:
        assert stats[f"clipfrac/{b}"].item() == pytest.approx(sum(c[4] == b for c in cases) / n), b
    assert stats["clipfrac"].item() == pytest.approx(4 / n)  # 1 low + 2 high + 1 dual
    # without the dual clip the A < 0, ratio 4 token keeps its unclipped loss 4 and gradient 4
    loss, stats = ppo_policy_loss(logprobs, torch.zeros_like(ratio), adv, clip_eps=0.2, clip_eps_high=0.28)
    assert loss[0, 5].item() == pytest.approx(4.0) and loss[0, 8].item() == pytest.approx(-0.2)
    assert stats["clipfrac/dual"].item() == 0.0 and stats["clipfrac"].item() == pytest.approx(3 / n)


def _ppo_before(logprobs, old_logprobs, advantages, clip_eps, mask):
    """ppo_policy_loss as it was before clip-higher and the dual clip (loss and clipfrac)."""
    logprobs, old_logprobs, advantages = (fill_masked(x, mask) for x in (logprobs, old_logprobs, advantages))
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss = fill_masked(torch.maximum(unclipped, clipped), mask)
    return (
        loss,
        masked_mean((clipped > unclipped).float(), mask),
        masked_mean(kl_k3(old_logprobs, logprobs), mask),
    )


@settings(max_examples=30, deadline=None)
@given(batch=batches(max_t=20), eps=st.sampled_from([0.1, 0.2, 0.3]))
def test_symmetric_default_is_bit_identical_to_the_formula_it_replaced(batch, eps):
    gen, B, T, mask = batch
    lp, old = -torch.rand(B, T, generator=gen) * 2, -torch.rand(B, T, generator=gen) * 2
    adv = torch.randn(B, T, generator=gen)
    x0 = lp.clone().requires_grad_()
    loss0, clipfrac0, kl0 = _ppo_before(x0, old, adv, eps, mask)
    loss0.sum().backward()
    for kwargs in ({}, {"clip_eps_high": eps}, {"clip_eps_high": None, "dual_clip": None}):
        x = lp.clone().requires_grad_()
        loss, stats = ppo_policy_loss(x, old, adv, eps, mask=mask, **kwargs)
        loss.sum().backward()
        assert torch.equal(loss, loss0) and torch.equal(x.grad, x0.grad), kwargs
        assert torch.equal(stats["clipfrac"], clipfrac0) and torch.equal(stats["approx_kl"], kl0)
        assert stats["clipfrac/dual"].item() == 0.0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    eps=st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.1, 0.5), (0.0, 0.0)]),
    dual_clip=st.sampled_from([None, 1.1, 3.0]),
)
def test_matches_the_reference_loop_with_gradients_and_clip_fractions(seed, eps, dual_clip):
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 9
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64)  # ratios from ~0.05 to ~20
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    x = lp.clone().requires_grad_()
    loss, stats = ppo_policy_loss(x, old, adv, eps[0], clip_eps_high=eps[1], dual_clip=dual_clip)
    loss.sum().backward()
    expected, branch = ppo_policy_loss_loop(lp, old, adv, eps[0], eps[1], dual_clip)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    free = torch.tensor([[b == "none" for b in row] for row in branch])  # (B, T) gradient not cut
    ratio = torch.exp(lp - old)
    torch.testing.assert_close(x.grad, torch.where(free, -adv * ratio, 0.0), rtol=1e-12, atol=1e-12)
    fractions = {b: sum(row.count(b) for row in branch) / (B * T) for b in BRANCHES}
    for b in BRANCHES:
        assert stats[f"clipfrac/{b}"].item() == pytest.approx(fractions[b], abs=1e-7), b
    assert stats["clipfrac"].item() == pytest.approx(sum(fractions.values()), abs=1e-7)
    assert stats["clipfrac"].item() == pytest.approx(
        sum(stats[f"clipfrac/{b}"].item() for b in BRANCHES), abs=1e-6
    )


@settings(max_examples=30, deadline=None)
@given(
    batch=batches(max_t=20),
    dual_clip=st.sampled_from([None, 2.0]),
    level=st.sampled_from(IMPORTANCE_SAMPLING_LEVELS),
)
def test_junk_at_masked_positions_changes_nothing(batch, dual_clip, level):
    gen, B, T, mask = batch
    lp = -torch.rand(B, T, generator=gen) * 2
    old, adv = -torch.rand(B, T, generator=gen) * 2, torch.randn(B, T, generator=gen)
    runs = []
    for junk in (False, True):
        dirty = (lambda t: add_junk(gen, t, mask)) if junk else (lambda t: t)
        x = dirty(lp).detach().clone().requires_grad_()
        loss, stats = ppo_policy_loss(
            x,
            dirty(old),
            dirty(adv),
            0.2,
            clip_eps_high=0.28,
            dual_clip=dual_clip,
            mask=mask,
            importance_sampling_level=level,
        )
        loss.sum().backward()
        runs.append((loss, x.grad, stats))
    (clean, clean_grad, clean_stats), (dirty_loss, dirty_grad, dirty_stats) = runs
    assert torch.equal(clean, dirty_loss) and torch.equal(clean_grad, dirty_grad)
    assert not dirty_loss[~mask].any() and not dirty_grad[~mask].any()
    assert clean_stats.keys() == dirty_stats.keys()
    for k in clean_stats:
        assert torch.equal(clean_stats[k], dirty_stats[k]), k
        assert clean_stats[k].dim() == 0 and not clean_stats[k].requires_grad, k


def test_bad_settings_raise():
    x = torch.zeros(2, 3)
    for c in (1.0, 0.5, -3.0):
        with pytest.raises(ValueError, match="dual_clip must be a constant > 1"):
            ppo_policy_loss(x, x, x, dual_clip=c)
    with pytest.raises(ValueError, match="must be >= 0"):
        ppo_policy_loss(x, x, x, clip_eps=-0.1)
    with pytest.raises(ValueError, match="must be >= 0"):
        ppo_policy_loss(x, x, x, clip_eps_high=-0.1)
    with pytest.raises(ValueError, match="shapes must match"):
        ppo_policy_loss(x, x, torch.zeros(2, 4), dual_clip=3.0)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_a_huge_log_ratio_gives_a_finite_loss_and_gradient(dual_clip):
    """float32's exp overflows above a log-ratio of ~88.7; one stale or corrupted token must not make the loss
    or the gradient NaN (verl and OpenRLHF bound the log-ratio at +-20 before the exp). Where the token is
    clipped its gradient is 0, as it is at any finite ratio; with A = 0 its loss is 0, not 0 * inf."""
    adv = torch.tensor([[1.0, 0.0, -1.0, 1.0, -1.0, 0.5]])
    log_ratio = torch.tensor([[100.0, 100.0, 100.0, -200.0, -200.0, 0.1]])
    old = torch.full_like(log_ratio, -3.0)
    x = (old + log_ratio).requires_grad_()
    loss, stats = ppo_policy_loss(x, old, adv, 0.2, dual_clip=dual_clip)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(v).all() for v in stats.values()), stats
    # A > 0 and ratio huge: -A * 1.2 wins; A = 0: 0; A > 0 and ratio ~0: -A * ratio ~ 0; A < 0 and ratio ~0:
    # -A * 0.8 wins; the last token is inside the range and untouched
    assert loss[0, 0].item() == pytest.approx(-1.2) and loss[0, 1].item() == 0.0
    assert loss[0, 4].item() == pytest.approx(0.8) and loss[0, 5].item() == pytest.approx(
        -0.5 * 1.1052, rel=1e-4
    )
    assert x.grad[0, :5].eq(0).all()  # clipped or beyond the bound: no gradient (not NaN)
    assert x.grad[0, 5].item() == pytest.approx(-0.5 * 1.1052, rel=1e-4)
    if dual_clip:
        assert loss[0, 2].item() == pytest.approx(dual_clip)  # A < 0, ratio huge: capped at -A * c
    else:
        assert loss[0, 2].item() == pytest.approx(float(torch.tensor(20.0).exp()))  # the bounded ratio


def test_float32_values_and_gradients_equal_the_unbounded_formula_inside_the_bound():
    """For every log-ratio within +-20 (a ratio from 2e-9 to 4.9e8) the bound changes nothing, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 50, generator=gen) * 5
    lp = old + (torch.rand(8, 50, generator=gen) * 2 - 1) * 19.9
    lp[0, :3] = old[0, :3] + torch.tensor([20.0, -20.0, 0.0])  # on the bound: still the gradient of exp
    adv = torch.randn(8, 50, generator=gen)
    x0, x1 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    want, _, want_kl = _ppo_before(x0, old, adv, 0.2, torch.ones(8, 50, dtype=torch.bool))
    want.sum().backward()
    got, stats = ppo_policy_loss(x1, old, adv, 0.2)
    got.sum().backward()
    assert torch.equal(got, want) and torch.equal(x1.grad, x0.grad)
    assert torch.equal(stats["approx_kl"], want_kl)
