"""KL estimators (values, signs, direction), shape_rewards (where the score lands), KL controllers."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfkit.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    kl_k1,
    kl_k2,
    kl_k3,
    shape_rewards,
)

from .strategies import add_junk, batches

NAN = float("nan")


# --- tier 1: hand-computed -----------------------------------------------------------------------------
def test_estimators_hand_computed():
    # pi_theta(y) = 0.5, pi_ref(y) = 0.25: log_r = log(0.25 / 0.5) = -ln 2
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2.0)
    torch.testing.assert_close(kl_k1(lp, ref), torch.tensor([[ln2]]))
    torch.testing.assert_close(kl_k2(lp, ref), torch.tensor([[0.5 * ln2**2]]))
    torch.testing.assert_close(kl_k3(lp, ref), torch.tensor([[0.5 - 1.0 + ln2]]))  # r - 1 - log r, r = 1/2


def test_estimator_names_match_the_literal():
    assert tuple(KL_ESTIMATORS) == KLEstimator.__args__ == ("k1", "k2", "k3")
    assert KL_ESTIMATORS["k1"] is kl_k1 and KL_ESTIMATORS["k2"] is kl_k2 and KL_ESTIMATORS["k3"] is kl_k3


# --- step-0 sanity ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_zero_when_policy_equals_reference(name):
    lp = torch.randn(4, 7, generator=torch.Generator().manual_seed(0)) - 3.0
    assert torch.equal(KL_ESTIMATORS[name](lp, lp.clone()), torch.zeros(4, 7))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-4, 0.1, 3.0, 30.0]))
def test_k2_and_k3_are_never_negative(seed, scale):
    gen = torch.Generator().manual_seed(seed)
    lp, ref = torch.randn(8, 16, generator=gen) * scale, torch.randn(8, 16, generator=gen) * scale
    assert (kl_k2(lp, ref) >= 0).all() and (kl_k3(lp, ref) >= 0).all()


# --- KL direction: Monte-Carlo on a categorical ------------------------------------------------------------
def test_k1_and_k3_estimate_kl_policy_to_reference_not_the_reverse():
    p = torch.tensor([0.9, 0.05, 0.05], dtype=torch.float64)  # policy
    q = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)  # reference
    forward = float((p * (p / q).log()).sum())  # KL(p || q) = 0.795
    reverse = float((q * (q / p).log()).sum())  # KL(q || p) = 1.040
    n = 200_000
    y = torch.multinomial(
        p, n, replacement=True, generator=torch.Generator().manual_seed(0)
    )  # from the policy
    lp, ref = p.log()[y], q.log()[y]
    for estimate in (kl_k1(lp, ref), kl_k3(lp, ref)):
        mean, se = float(estimate.mean()), float(estimate.std() / math.sqrt(n))
        assert abs(mean - forward) < 3 * se, (mean, forward, se)
        assert abs(mean - reverse) > 30 * se  # and clearly not the reverse KL
    # the widely copied k3 with the ratio upside down (pi_theta / pi_ref) estimates something else
    flipped = torch.expm1(lp - ref) - (lp - ref)
    assert abs(float(flipped.mean()) - forward) > 30 * float(flipped.std() / math.sqrt(n))


# --- shape_rewards --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mask, last",
    [([1, 1, 1, 0, 0], 2), ([0, 0, 1, 1, 1], 4), ([1, 0, 1, 1, 0], 3), ([0, 1, 0, 0, 1], 4)],
    ids=["right-pad", "left-pad", "holes", "left-pad-and-hole"],
)
def test_score_lands_on_the_last_valid_token(mask, last):
    m = torch.tensor([mask], dtype=torch.bool)
    lp = torch.tensor([[-1.0, -2.0, -1.5, -0.5, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.5, -1.0, -2.0]])
    lp_junk = torch.where(m, lp, NAN)  # masked log-probs are never read
    rewards, kl = shape_rewards(torch.tensor([2.0]), lp_junk, ref, m, kl_coef=0.1)
    expected_kl = torch.where(m, lp - ref, 0.0)  # k1 = log pi - log pi_ref
    expected = -0.1 * expected_kl
    expected[0, last] += 2.0
    torch.testing.assert_close(kl, expected_kl)
    torch.testing.assert_close(rewards, expected)


def test_dense_scores_land_where_given_and_rows_without_tokens_get_nothing():
    m = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    lp = torch.zeros(2, 3)
    dense = torch.tensor([[0.5, -1.0, NAN], [NAN, NAN, NAN]])  # NaN only where masked
    rewards, kl = shape_rewards(dense, lp, lp, m, kl_coef=0.3)
    assert torch.equal(rewards, torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(kl, torch.zeros(2, 3))
    rewards, _ = shape_rewards(torch.tensor([4.0, 7.0]), lp, lp, m, kl_coef=0.3)
    assert torch.equal(rewards, torch.tensor([[0.0, 4.0, 0.0], [0.0, 0.0, 0.0]]))


@settings(max_examples=40, deadline=None)
@given(batch=batches(max_t=30), name=st.sampled_from(["k1", "k2", "k3"]), dense=st.booleans())
def test_shape_rewards_matches_reference_loop(batch, name, dense):
    gen, B, T, mask = batch
    lp, ref = -torch.rand(B, T, generator=gen) * 3, -torch.rand(B, T, generator=gen) * 3
    scores = torch.randn(B, T, generator=gen) if dense else torch.randn(B, generator=gen)
    rewards, kl = shape_rewards(scores, lp, ref, mask, 0.07, name)
    junk = shape_rewards(
        add_junk(gen, scores, mask) if dense else scores,
        add_junk(gen, lp, mask),
        add_junk(gen, ref, mask),
        mask,
        0.07,
        name,
    )
    assert torch.equal(junk[0], rewards) and torch.equal(
        junk[1], kl
    )  # junk at masked positions changes nothing
    for b in range(B):
        valid = [t for t in range(T) if mask[b, t]]
        for t in range(T):
            k = float(KL_ESTIMATORS[name](lp[b, t], ref[b, t])) if t in valid else 0.0
            r = -0.07 * k
            if t in valid and (dense or t == valid[-1]):
                r += float(scores[b, t] if dense else scores[b])
            assert kl[b, t].item() == pytest.approx(k, abs=1e-6)
            assert rewards[b, t].item() == pytest.approx(r, abs=1e-5)


def test_shape_rewards_errors():
    lp, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="unknown KL estimator 'kl'"):
        shape_rewards(torch.zeros(2), lp, lp, m, 0.1, "kl")  # no aliases
    with pytest.raises(ValueError, match="scores"):
        shape_rewards(torch.zeros(3), lp, lp, m, 0.1)
    with pytest.raises(ValueError, match="scores has NaN/inf .* row 1"):
        shape_rewards(torch.tensor([0.0, NAN]), lp, lp, m, 0.1)


def test_kl_coef_as_tensor_and_k3_selected():
    lp, ref, m = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -1.0]]), torch.ones(1, 2)
    rewards, kl = shape_rewards(torch.tensor([1.0]), lp, ref, m, torch.tensor(0.5), "k3")
    torch.testing.assert_close(kl, kl_k3(lp, ref))
    torch.testing.assert_close(rewards, -0.5 * kl_k3(lp, ref) + torch.tensor([[0.0, 1.0]]))


# --- controllers ----------------------------------------------------------------------------------------
def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(kl=100.0, n_steps=512)
    assert c.value == 0.05
    assert c.state_dict() == {"value": 0.05}


@pytest.mark.parametrize(
    "kl, error", [(12.0, 0.2), (6.6, 0.1), (6.0, 0.0), (5.4, -0.1), (0.0, -0.2)]
)  # target 6: e = clip(kl / 6 - 1, -0.2, 0.2)
def test_adaptive_controller_hand_computed(kl, error):
    c = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10_000)
    c.update(kl, n_steps=256)
    assert c.value == pytest.approx(0.1 * (1 + error * 256 / 10_000), rel=1e-12)


def test_adaptive_controller_state_round_trip():
    a = AdaptiveKLController(0.2, target=1.0, horizon=100)
    for kl in (3.0, 0.5, 1.2):
        a.update(kl, n_steps=10)
    state = json.loads(json.dumps(a.state_dict()))  # plain floats, fit for a JSON checkpoint
    b = AdaptiveKLController(0.2, target=1.0, horizon=100)
    b.load_state_dict(state)
    for kl in (0.1, 4.0):
        a.update(kl, 10)
        b.update(kl, 10)
    assert a.value == b.value != 0.2


def test_controller_arguments_checked():
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError):
        FixedKLController(-1.0)
