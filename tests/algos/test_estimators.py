"""ADVANTAGE_ESTIMATORS: one signature; hand-computed tensors; reference loops; degenerate groups."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfkit.algos import ADVANTAGE_ESTIMATORS, AdvantageEstimator, compute_gae, masked_whiten

from .reference import group_members, reward_to_go_loop, sequence_sums, std_bessel
from .strategies import add_junk, batches

NAN = float("nan")
EPS = 1e-6


def test_one_signature_for_all():
    assert (
        tuple(ADVANTAGE_ESTIMATORS) == AdvantageEstimator.__args__ == ("gae", "grpo", "rloo", "reinforce_pp")
    )
    signatures = {str(inspect.signature(f)) for f in ADVANTAGE_ESTIMATORS.values()}
    assert len(signatures) == 1, signatures


# --- tier 1: hand-computed -----------------------------------------------------------------------------
def _last_token_rewards(scores):
    r = torch.zeros(len(scores), 3)
    r[:, -1] = torch.tensor(scores)
    return r, torch.ones(len(scores), 3, dtype=torch.bool)


def test_grpo_by_hand_with_non_contiguous_groups():
    r, m = _last_token_rewards([1.0, 2.0, 3.0, 5.0])
    ids = torch.tensor([7, 3, 7, 3])  # group 7: s = 1, 3 (mean 2, std sqrt 2); group 3: s = 2, 5
    adv, ret = ADVANTAGE_ESTIMATORS["grpo"](r, m, group_ids=ids, eps=0.0)
    s2, s45 = math.sqrt(2.0), math.sqrt(4.5)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1 / s2, -1.5 / s45, 1 / s2, 1.5 / s45]))
    assert torch.equal(adv, adv[:, :1].expand(4, 3))  # broadcast to every valid token
    assert torch.equal(ret[:, 0], torch.tensor([1.0, 2.0, 3.0, 5.0]))
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](r, m, group_ids=ids, norm_by_std=False)
    assert torch.equal(adv[:, 0], torch.tensor([-1.0, -1.5, 1.0, 1.5]))


def test_grpo_degenerate_groups_give_zero():
    r, m = _last_token_rewards([4.0, 4.0, 9.0])
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](r, m, group_ids=torch.tensor([0, 0, 1]))  # std 0; group of one
    assert torch.equal(adv, torch.zeros(3, 3))


def test_rloo_by_hand():
    r, m = _last_token_rewards([1.0, 2.0, 6.0, 4.0])
    adv, ret = ADVANTAGE_ESTIMATORS["rloo"](r, m, group_ids=torch.tensor([0, 0, 0, 1]))
    # group 0 (k = 3): 1 - (2 + 6) / 2 = -3, 2 - (1 + 6) / 2 = -1.5, 6 - (1 + 2) / 2 = 4.5; group of one: 0
    assert torch.equal(adv[:, 0], torch.tensor([-3.0, -1.5, 4.5, 0.0]))
    assert torch.equal(ret[:, 2], torch.tensor([1.0, 2.0, 6.0, 4.0]))


def test_reinforce_pp_by_hand():
    r = torch.tensor([[1.0, NAN, 0.0, 2.0]])
    m = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    # gamma 0.5 over the valid steps: G = [1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2] = [1.5, 1, 2]
    adv, ret = ADVANTAGE_ESTIMATORS["reinforce_pp"](r, m, gamma=0.5, eps=0.0)
    assert torch.equal(ret, torch.tensor([[1.5, 0.0, 1.0, 2.0]]))
    sd = math.sqrt(((1.5 - 1.5) ** 2 + (1 - 1.5) ** 2 + (2 - 1.5) ** 2) / 2)  # mean 1.5, Bessel
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, -0.5 / sd, 0.5 / sd]]))
    adv, _ = ADVANTAGE_ESTIMATORS["reinforce_pp"](r, m, gamma=0.5, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, -0.5, 0.5]]))


def test_gae_estimator_is_compute_gae_then_whitened():
    gen = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    m = torch.rand(3, 6, generator=gen) < 0.7
    adv, ret = ADVANTAGE_ESTIMATORS["gae"](r, m, v, gamma=0.9, lam=0.8, eps=1e-8)
    raw, expected_ret = compute_gae(r, v, m, 0.9, 0.8)
    assert torch.equal(ret, expected_ret)
    torch.testing.assert_close(adv, masked_whiten(raw, m))
    adv, _ = ADVANTAGE_ESTIMATORS["gae"](r, m, v, gamma=0.9, lam=0.8, norm_by_std=False)
    assert torch.equal(adv, raw)


# --- tier 2: against reference loops ---------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(batch=batches(max_b=8, max_t=12), n_groups=st.integers(1, 4), norm=st.booleans())
def test_grpo_and_rloo_match_loops(batch, n_groups, norm):
    gen, B, T, mask = batch
    r = torch.randn(B, T, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, n_groups, (B,), generator=gen) * 10  # any integers, in any order
    s = sequence_sums(r, mask)
    grpo, grpo_ret = ADVANTAGE_ESTIMATORS["grpo"](r, mask, group_ids=ids, norm_by_std=norm, eps=EPS)
    rloo, rloo_ret = ADVANTAGE_ESTIMATORS["rloo"](r, mask, group_ids=ids)
    for rows in group_members(ids).values():
        vals = [s[i] for i in rows]
        mean, sd, k = sum(vals) / len(vals), std_bessel(vals), len(vals)
        for i in rows:
            g = (s[i] - mean) / (sd + EPS) if norm else s[i] - mean
            loo = s[i] - (sum(vals) - s[i]) / (k - 1) if k > 1 else 0.0
            for t in range(T):
                on = bool(mask[i, t])
                assert grpo[i, t].item() == pytest.approx(g if on else 0.0, abs=1e-9)
                assert rloo[i, t].item() == pytest.approx(loo if on else 0.0, abs=1e-9)
                assert (
                    grpo_ret[i, t].item()
                    == rloo_ret[i, t].item()
                    == pytest.approx(s[i] if on else 0.0, abs=1e-12)
                )
    junk = add_junk(gen, r, mask)  # invariance
    assert torch.equal(
        ADVANTAGE_ESTIMATORS["grpo"](junk, mask, group_ids=ids, norm_by_std=norm, eps=EPS)[0], grpo
    )
    assert torch.equal(ADVANTAGE_ESTIMATORS["rloo"](junk, mask, group_ids=ids)[0], rloo)


@settings(max_examples=30, deadline=None)
@given(batch=batches(max_t=40), gamma=st.sampled_from([0.0, 0.9, 1.0]))
def test_reinforce_pp_matches_loop(batch, gamma):
    gen, B, T, mask = batch
    r = torch.randn(B, T, generator=gen)
    adv, ret = ADVANTAGE_ESTIMATORS["reinforce_pp"](r, mask, gamma=gamma, eps=1e-8)
    g = reward_to_go_loop(r, mask, gamma)
    vals = [g[b, t].item() for b in range(B) for t in range(T) if mask[b, t]]
    mean = sum(vals) / len(vals) if vals else 0.0
    sd2 = sum((x - mean) ** 2 for x in vals) / (len(vals) - 1) if len(vals) > 1 else 0.0
    expected = torch.where(mask, (g - mean) / math.sqrt(sd2 + 1e-8), 0.0)
    torch.testing.assert_close(ret.double(), g, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv.double(), expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(
        ADVANTAGE_ESTIMATORS["reinforce_pp"](add_junk(gen, r, mask), mask, gamma=gamma, eps=1e-8)[0], adv
    )


# --- edge cases and errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "gae"])
def test_edge_cases_stay_finite(name):
    r = torch.tensor([[1.0, NAN], [NAN, NAN], [2.0, 3.0]])
    m = torch.tensor([[1, 0], [0, 0], [1, 1]], dtype=torch.bool)  # one-token row, fully masked row
    ids = torch.tensor([0, 1, 2])  # all groups of one
    adv, ret = ADVANTAGE_ESTIMATORS[name](r, m, torch.zeros(3, 2), ids)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert not adv[1].any() and not ret[1].any()
    if name in ("grpo", "rloo"):
        assert not adv.any()  # a group of one has no baseline to compare with


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "gae"])
def test_nan_reward_at_a_valid_position_raises(name):
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    r[1, 1] = NAN
    with pytest.raises(ValueError, match="rewards has NaN/inf .* row 1, position 1"):
        ADVANTAGE_ESTIMATORS[name](r, m, torch.zeros(2, 3), torch.tensor([0, 0]))


def test_missing_inputs_raise():
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs the critic's values"):
        ADVANTAGE_ESTIMATORS["gae"](r, m)
    for name in ("grpo", "rloo"):
        with pytest.raises(ValueError, match="needs group_ids"):
            ADVANTAGE_ESTIMATORS[name](r, m)
        with pytest.raises(ValueError, match="integer tensor of shape"):
            ADVANTAGE_ESTIMATORS[name](r, m, group_ids=torch.tensor([0.0, 1.0]))
