"""Losses: hand-computed values and gradients, step-0 sanity, invariance to junk at masked positions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfkit.algos import bradley_terry_loss, dpo_loss, entropy_from_logits, ppo_policy_loss, value_loss

from .strategies import add_junk, batches

NAN, LN2 = float("nan"), math.log(2.0)


# --- PPO policy loss -------------------------------------------------------------------------------------
def test_ppo_ratio_is_exactly_one_before_the_first_update():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=gen) * 4
    adv = torch.randn(3, 5, generator=gen)
    logprobs = old.clone().requires_grad_()
    loss, stats = ppo_policy_loss(logprobs, old, adv)
    assert torch.equal(loss, -adv)
    assert (
        stats["ratio/mean"].item() == 1.0
        and stats["clipfrac"].item() == 0.0
        and stats["approx_kl"].item() == 0.0
    )
    loss.sum().backward()
    assert torch.equal(logprobs.grad, -adv)  # d(-A * ratio)/d logprob = -A * ratio = -A


def test_ppo_clipping_by_hand():
    # (A, ratio): the larger of -A * ratio and -A * clip(ratio, 0.8, 1.2) is taken
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5]])
    old = torch.zeros(1, 4)
    logprobs = ratio.log().requires_grad_()
    loss, stats = ppo_policy_loss(logprobs, old, adv, clip_eps=0.2)
    # A>0, r=1.5: max(-1.5, -1.2) = -1.2 clipped | A>0, r=0.5: max(-0.5, -0.8) = -0.5
    # A<0, r=1.5: max(1.5, 1.2) = 1.5           | A<0, r=0.5: max(0.5, 0.8) = 0.8 clipped
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 1.5, 0.8]]))
    loss.sum().backward()
    # no gradient where the clipped term wins; -A * ratio where the unclipped one does
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5, 1.5, 0.0]]))
    assert stats["clipfrac"].item() == 0.5
    expected_kl = (ratio - 1 - ratio.log()).mean()  # k3 of KL(old || new): r - 1 - log r, r = new / old
    torch.testing.assert_close(stats["approx_kl"], expected_kl)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), eps=st.sampled_from([0.1, 0.2, 0.3]))
def test_ppo_and_value_loss_match_per_element_formulas(seed, eps):
    gen = torch.Generator().manual_seed(seed)
    lp, old, adv = (
        -torch.rand(3, 7, generator=gen),
        -torch.rand(3, 7, generator=gen),
        torch.randn(3, 7, generator=gen),
    )
    values, old_values, ret = (torch.randn(3, 7, generator=gen, dtype=torch.float64) for _ in range(3))
    policy, _ = ppo_policy_loss(lp, old, adv, clip_eps=eps)
    critic, _ = value_loss(values, old_values, ret, value_clip_eps=eps)
    for i in range(3):
        for t in range(7):
            ratio = math.exp(lp[i, t].item() - old[i, t].item())
            a = adv[i, t].item()
            expected = max(-a * ratio, -a * min(max(ratio, 1 - eps), 1 + eps))
            assert policy[i, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
            v, o, r = values[i, t].item(), old_values[i, t].item(), ret[i, t].item()
            v_clip = o + min(max(v - o, -eps), eps)
            assert critic[i, t].item() == pytest.approx(0.5 * max((v - r) ** 2, (v_clip - r) ** 2), rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(batch=batches(max_t=20))
def test_ppo_and_value_loss_ignore_junk_at_masked_positions(batch):
    gen, B, T, mask = batch
    lp, old = -torch.rand(B, T, generator=gen), -torch.rand(B, T, generator=gen)
    adv, ret = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    for fn, args in ((ppo_policy_loss, (lp, old, adv)), (value_loss, (adv, ret, lp))):
        clean_x = args[0].clone().requires_grad_()
        clean, clean_stats = fn(clean_x, *args[1:], mask=mask)
        clean.sum().backward()
        junk_x = add_junk(gen, args[0], mask).requires_grad_()
        dirty, dirty_stats = fn(junk_x, *(add_junk(gen, a, mask) for a in args[1:]), mask=mask)
        dirty.sum().backward()
        assert torch.equal(clean, dirty) and torch.equal(dirty[~mask], torch.zeros_like(dirty[~mask]))
        assert torch.equal(clean_x.grad, junk_x.grad) and not junk_x.grad[~mask].any()
        for k in clean_stats:
            assert torch.equal(clean_stats[k], dirty_stats[k]), k


# --- value loss ----------------------------------------------------------------------------------------
def test_value_loss_by_hand():
    values = torch.tensor([[1.5, 0.9, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    returns = torch.tensor([[2.0, 0.0, 3.0, 0.5]])
    loss, stats = value_loss(values, old, returns, value_clip_eps=0.2)
    # V_clip = [1.2, 0.9, 1.2, 0.8]; unclipped (V-R)^2 = [0.25, 0.81, 1, 0.25]; clipped = [0.64, 0.81, 3.24, 0.09]
    torch.testing.assert_close(loss, 0.5 * torch.tensor([[0.64, 0.81, 3.24, 0.25]]))
    assert stats["clipfrac"].item() == 0.5  # the clipped error is larger at positions 0 and 2
    torch.testing.assert_close(stats["mse"], torch.tensor((0.25 + 0.81 + 1 + 0.25) / 4))
    loss.sum().backward()
    # gradient only through the unclipped branch, where it wins: (V - R) at positions 1 and 3
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.9, 0.0, -0.5]]))
    plain, _ = value_loss(values, old, returns, value_clip_eps=None)
    torch.testing.assert_close(plain, 0.5 * torch.tensor([[0.25, 0.81, 1.0, 0.25]]))


# --- entropy -------------------------------------------------------------------------------------------
def test_entropy_by_hand_and_with_minus_inf_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [5.0, -float("inf"), -float("inf"), -float("inf")]]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[math.log(4.0), 0.0]]))
    half = torch.tensor([[[0.0, 0.0, -float("inf")]]], dtype=torch.bfloat16)
    out = entropy_from_logits(half)
    assert out.dtype == torch.float32 and out.item() == pytest.approx(LN2)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.1, 1.0, 10.0, 100.0]))
def test_entropy_matches_definition(seed, scale):
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    p = torch.softmax(logits, -1)
    expected = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), expected, rtol=1e-9, atol=1e-9)


# --- Bradley-Terry -------------------------------------------------------------------------------------
def test_bradley_terry_untrained_is_ln2():
    r = torch.randn(16, generator=torch.Generator().manual_seed(0))
    loss, stats = bradley_terry_loss(r, r.clone())
    torch.testing.assert_close(loss, torch.full((16,), LN2))
    assert stats["accuracy"].item() == 0.5 and stats["margin"].item() == 0.0


def test_bradley_terry_by_hand():
    chosen = torch.tensor([1.0, 0.0, 2.0], requires_grad=True)
    rejected = torch.tensor([0.0, 1.0, 2.0])
    loss, stats = bradley_terry_loss(chosen, rejected)
    torch.testing.assert_close(
        loss, torch.tensor([math.log1p(math.exp(-1)), math.log1p(math.exp(1)), LN2])
    )  # -log sigmoid(d) = log(1 + e^-d)
    assert stats["accuracy"].item() == pytest.approx((1 + 0 + 0.5) / 3)
    loss.sum().backward()
    torch.testing.assert_close(chosen.grad, -torch.sigmoid(-torch.tensor([1.0, -1.0, 0.0])))
    with_margin, _ = bradley_terry_loss(chosen, rejected, margin=torch.tensor([0.5, 0.0, 0.0]))
    assert with_margin[0].item() == pytest.approx(math.log1p(math.exp(-0.5)))
    centred, _ = bradley_terry_loss(chosen, rejected, center_coef=0.01)
    torch.testing.assert_close(centred - loss, 0.01 * torch.tensor([1.0, 1.0, 16.0]))


# --- DPO -----------------------------------------------------------------------------------------------
def test_dpo_at_start_is_ln2_and_by_hand():
    lp = torch.tensor([-5.0, -7.0])
    loss, stats = dpo_loss(lp, lp - 1, lp.clone(), lp - 1)
    torch.testing.assert_close(loss, torch.full((2,), LN2))
    assert stats["accuracy"].item() == 0.5
    pc = torch.tensor([-3.0], requires_grad=True)  # chosen log-ratio +2, rejected log-ratio -1
    loss, stats = dpo_loss(pc, torch.tensor([-6.0]), torch.tensor([-5.0]), torch.tensor([-5.0]), beta=0.1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.3)))
    assert stats["reward_chosen"].item() == pytest.approx(0.2) and stats[
        "reward_rejected"
    ].item() == pytest.approx(-0.1)
    loss.backward()
    assert pc.grad.item() < 0  # raising the chosen log-prob lowers the loss
    smooth, _ = dpo_loss(pc, torch.tensor([-6.0]), torch.tensor([-5.0]), torch.tensor([-5.0]), 0.1, 0.1)
    expected = 0.9 * math.log1p(math.exp(-0.3)) + 0.1 * math.log1p(math.exp(0.3))
    assert smooth.item() == pytest.approx(expected)


def _published_dpo(pc, pr, rc, rr, beta, eps=0.0, ipo=False):
    """One pair, as the papers write it: h = log pi/pi_ref (y_w) - log pi/pi_ref (y_l); DPO (Rafailov et al.
    2023, eq. 7) with conservative smoothing eps (Mitchell 2023), or IPO (Azar et al. 2023, eq. 17)."""
    h = (pc - rc) - (pr - rr)
    if ipo:
        return (h - 1.0 / (2.0 * beta)) ** 2
    sig = 1.0 / (1.0 + math.exp(-beta * h))
    return -(1 - eps) * math.log(sig) - eps * math.log(1.0 - sig)


@pytest.mark.parametrize(
    "beta, eps, ipo", [(0.1, 0.0, False), (0.5, 0.2, False), (0.1, 0.0, True), (2.0, 0.0, True)]
)
def test_dpo_and_ipo_match_the_published_formulas(beta, eps, ipo):
    gen = torch.Generator().manual_seed(5)
    logps = [-20 * torch.rand(6, generator=gen, dtype=torch.float64) for _ in range(4)]
    loss, stats = dpo_loss(*logps, beta=beta, label_smoothing=eps, loss_type="ipo" if ipo else "sigmoid")
    expected = [_published_dpo(*(float(x[i]) for x in logps), beta, eps, ipo) for i in range(6)]
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    rewards = beta * ((logps[0] - logps[2]) - (logps[1] - logps[3]))
    assert stats["margin"].item() == pytest.approx(float(rewards.mean()), rel=1e-5)
    # IPO at the start (policy == reference) is 1 / (4 beta^2); its gradient pushes h towards 1 / (2 beta)
    same = torch.tensor([-4.0])
    start, _ = dpo_loss(same, same - 1, same, same - 1, beta=beta, loss_type="ipo")
    assert start.item() == pytest.approx(1 / (4 * beta**2))


def test_dpo_refuses_bad_settings():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(x, x, x, x, loss_type="hinge")
    with pytest.raises(ValueError, match="IPO takes none"):
        dpo_loss(x, x, x, x, label_smoothing=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(x, x, x, x, beta=0.0)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shapes must match"):
        ppo_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="shapes must match"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))
