"""The importance ratio per token or per sequence (GSPO, Zheng et al. 2025) in ``ppo_policy_loss``: hand-computed
tensors with clip-higher and the dual clip, a plain reference loop with gradients, the paper's sequence objective,
the ratio exactly 1 before the first update, a huge log-ratio, bad names (junk at masked positions: test_ppo_clip.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfkit.algos import (
    IMPORTANCE_LOG_RATIOS,
    IMPORTANCE_SAMPLING_LEVELS,
    aggregate_loss,
    ppo_policy_loss,
    sequence_log_ratio,
    token_log_ratio,
)

from .reference import gspo_policy_loss_loop
from .strategies import add_junk, batches

torch.set_num_threads(1)
BRANCHES = ("low", "high", "dual")
NAN = float("nan")

# Three responses, T = 3; the second has one padded position (junk there). Row ratios, by hand:
# row 0: mean(0.3, -0.1, 0.1) = 0.1 -> s = e^0.1; row 1: mean(0.6, 0.0) = 0.3 -> e^0.3 (the padding is not
# counted: a mean over 3 positions would give e^0.2); row 2: mean(-0.5, -0.1, -0.45) = -0.35 -> e^-0.35.
OLD = torch.tensor([[-1.0, -2.0, -1.5], [-1.0, -1.0, NAN], [-2.0, -0.5, -3.0]], dtype=torch.float64)
DELTA = torch.tensor([[0.3, -0.1, 0.1], [0.6, 0.0, NAN], [-0.5, -0.1, -0.45]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
S0, S1, S2 = math.exp(0.1), math.exp(0.3), math.exp(-0.35)


def _hand_case(adv, **kwargs):
    x = (OLD + DELTA).requires_grad_()
    loss, stats = ppo_policy_loss(
        x,
        OLD,
        torch.tensor(adv, dtype=torch.float64),
        mask=MASK,
        importance_sampling_level="sequence",
        **kwargs,
    )
    loss.sum().backward()
    return loss, x.grad, stats


def test_symmetric_clip_by_hand():
    # clip_eps 0.2: [0.8, 1.2]. Row 0 inside: -A * s for each token, whatever the sign of its own advantage.
    # Row 1 (A > 0) above 1.2: the clip wins for the whole response. Row 2 below 0.8: its A < 0 tokens are
    # clipped (loss 0.8, no gradient), its A > 0 token is not (-0.705 > -0.8).
    loss, grad, stats = _hand_case([[1.0, -1.0, 2.0], [1.0, 1.0, NAN], [1.0, -1.0, -1.0]], clip_eps=0.2)
    want = [[-S0, S0, -2 * S0], [-1.2, -1.2, 0.0], [-S2, 0.8, 0.8]]
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64))
    want_grad = [[-S0, S0, -2 * S0], [0.0, 0.0, 0.0], [-S2, 0.0, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64))
    assert stats["clipfrac/high"].item() == pytest.approx(2 / 8)
    assert stats["clipfrac/low"].item() == pytest.approx(2 / 8)
    assert stats["clipfrac"].item() == pytest.approx(4 / 8) and stats["clipfrac/dual"].item() == 0.0
    assert stats["ratio/mean"].item() == pytest.approx((3 * S0 + 2 * S1 + 3 * S2) / 8)
    # k3 of KL(pi_old || pi) with r = pi / pi_old per token (r - 1 - log r), as at the token level
    token_k3 = [math.exp(v) - 1 - v for v in (0.3, -0.1, 0.1, 0.6, 0.0, -0.5, -0.1, -0.45)]
    assert stats["approx_kl"].item() == pytest.approx(sum(token_k3) / 8)


def test_clip_higher_and_dual_clip_act_on_the_whole_response_by_hand():
    # upper bound 1.4: row 1's ratio e^0.3 = 1.35 is no longer clipped for its A > 0 token; its A < 0 token has
    # the loss max(1.35, 1.2) = 1.35 > c = 1.3: capped at -A * c with no gradient. Row 0 (1.105 < c) is not capped.
    loss, grad, stats = _hand_case(
        [[1.0, -1.0, 2.0], [-1.0, 1.0, NAN], [1.0, -1.0, -1.0]],
        clip_eps=0.2,
        clip_eps_high=0.4,
        dual_clip=1.3,
    )
    want = [[-S0, S0, -2 * S0], [1.3, -S1, 0.0], [-S2, 0.8, 0.8]]
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64))
    want_grad = [[-S0, S0, -2 * S0], [0.0, -S1, 0.0], [-S2, 0.0, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64))
    assert stats["clipfrac/dual"].item() == pytest.approx(1 / 8)
    assert stats["clipfrac/high"].item() == 0.0 and stats["clipfrac/low"].item() == pytest.approx(2 / 8)


def test_a_large_sequence_ratio_is_dual_clipped_on_every_negative_token_of_the_response():
    old = torch.zeros(1, 4, dtype=torch.float64)
    x = torch.tensor([[2.0, 1.0, 1.5, 1.5]], dtype=torch.float64).requires_grad_()  # s = e^1.5 = 4.48 > c = 3
    adv = torch.tensor([[-1.0, -2.0, -0.5, 1.0]], dtype=torch.float64)
    loss, stats = ppo_policy_loss(x, old, adv, 0.2, dual_clip=3.0, importance_sampling_level="sequence")
    loss.sum().backward()
    torch.testing.assert_close(loss, torch.tensor([[3.0, 6.0, 1.5, -1.2]], dtype=torch.float64))
    assert x.grad.eq(0).all()  # every token clipped: three by the dual clip, the A > 0 one by 1 + clip_eps
    assert stats["clipfrac/dual"].item() == 0.75 and stats["clipfrac/high"].item() == 0.25


@settings(max_examples=40, deadline=None)
@given(
    batch=batches(max_t=16),
    eps=st.sampled_from([(0.2, 0.2), (0.2, 0.28), (3e-4, 4e-4), (0.0, 0.0)]),
    dual_clip=st.sampled_from([None, 1.1, 3.0]),
)
def test_matches_the_reference_loop_with_gradients_and_clip_fractions(batch, eps, dual_clip):
    gen, B, T, mask = batch
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    x = lp.clone().requires_grad_()
    loss, stats = ppo_policy_loss(
        x,
        old,
        adv,
        eps[0],
        clip_eps_high=eps[1],
        dual_clip=dual_clip,
        mask=mask,
        importance_sampling_level="sequence",
    )
    loss.sum().backward()
    expected, branch, ratios = gspo_policy_loss_loop(lp, old, adv, mask, eps[0], eps[1], dual_clip)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # d loss_t / d logprob_t = -A_t * s_i where no clip wins (GSPO-token: sg[s_i] * pi(y_t) / sg[pi(y_t)]), and
    # nothing flows to the row's other tokens
    free = torch.tensor([[b == "none" for b in row] for row in branch])  # (B, T)
    s = torch.tensor(ratios, dtype=torch.float64)[:, None]  # (B, 1)
    torch.testing.assert_close(x.grad, torch.where(free, -adv * s, 0.0), rtol=1e-12, atol=1e-12)
    valid = int(mask.sum())
    for b in BRANCHES:
        share = sum(row.count(b) for row in branch) / max(valid, 1)
        assert stats[f"clipfrac/{b}"].item() == pytest.approx(share, abs=1e-7), b


def _gspo_sequence_objective(lp, old, adv_seq, mask, eps_low, eps_high, dual_clip):
    """The paper's GSPO objective (eq. 5), written per response with the gradient through s_i itself (as TRL's
    importance_sampling_level="sequence" computes it): sum_i max(-A_i s_i, -A_i clip(s_i)) / N_seq."""
    rows = []
    for i in range(lp.shape[0]):
        m = mask[i]
        if not m.any():
            continue
        s = torch.exp((lp[i][m] - old[i][m]).mean())
        a = adv_seq[i]
        loss = torch.maximum(-a * s, -a * s.clamp(1 - eps_low, 1 + eps_high))
        if dual_clip is not None and a < 0:
            loss = torch.minimum(loss, -a * dual_clip)
        rows.append(loss)
    return torch.stack(rows).sum() / len(rows) if rows else lp.sum() * 0


@settings(max_examples=30, deadline=None)
@given(batch=batches(max_t=16), dual_clip=st.sampled_from([None, 1.05]))
def test_with_one_advantage_per_response_the_gradient_is_the_sequence_objectives(batch, dual_clip):
    """GSPO-token with A_i,t = A_i and the loss averaged per response has GSPO's own gradient (the paper)."""
    gen, B, T, mask = batch
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.2
    adv_seq = torch.randn(B, generator=gen, dtype=torch.float64)
    x, y = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    loss, _ = ppo_policy_loss(
        x,
        old,
        adv_seq[:, None].expand(B, T),
        0.05,
        dual_clip=dual_clip,
        mask=mask,
        importance_sampling_level="sequence",
    )
    got = aggregate_loss(loss, mask, "seq-mean-token-mean")
    got.backward()
    want = _gspo_sequence_objective(y, old, adv_seq, mask, 0.05, 0.05, dual_clip)
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(batch=batches(max_t=20), mode=st.sampled_from(["token-mean", "seq-mean-token-mean"]))
def test_before_the_first_update_the_ratio_is_exactly_one_and_the_gradient_the_token_levels(batch, mode):
    """logprobs == old_logprobs: the ratio is 1 at both levels, bit for bit, and so are the loss and the gradient
    (the sequence level weighs each token's gradient by s_i = 1); the aggregated gradients agree too."""
    gen, B, T, mask = batch
    lp = -torch.rand(B, T, generator=gen) * 3
    adv = torch.randn(B, T, generator=gen)
    runs = {}
    for level in IMPORTANCE_SAMPLING_LEVELS:
        x = lp.clone().requires_grad_()
        loss, stats = ppo_policy_loss(x, lp.clone(), adv, 0.2, mask=mask, importance_sampling_level=level)
        aggregate_loss(loss, mask, mode).backward()
        runs[level] = (loss, x.grad, stats)
    (tl, tg, ts), (sl, sg, ss) = runs["token"], runs["sequence"]
    assert torch.equal(tl, sl) and torch.equal(tg, sg)
    for key in ts:
        assert torch.equal(ts[key], ss[key]), key
    if mask.any():
        assert ss["ratio/mean"].item() == 1.0 and ss["clipfrac"].item() == 0.0


def test_off_policy_the_token_gradient_is_weighed_by_the_sequence_ratio_not_its_own():
    old = torch.zeros(1, 3, dtype=torch.float64)
    delta = torch.tensor([[0.1, -0.05, 0.04]], dtype=torch.float64)  # inside the clip range at both levels
    adv = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    grads = {}
    for level in IMPORTANCE_SAMPLING_LEVELS:
        x = (old + delta).requires_grad_()
        loss, _ = ppo_policy_loss(x, old, adv, 0.2, importance_sampling_level=level)
        loss.sum().backward()
        grads[level] = x.grad
    s = math.exp(float(delta.mean()))
    torch.testing.assert_close(grads["token"], -adv * delta.exp())
    torch.testing.assert_close(grads["sequence"], -adv * s)


@settings(max_examples=30, deadline=None)
@given(batch=batches(max_t=20))
def test_the_log_ratio_functions_by_themselves(batch):
    """Each row's valid tokens carry the row's mean log-ratio; masked outputs are 0 whatever is there; no mask
    means every position; the token variant is the clamped difference; the dict holds both under their names."""
    gen, B, T, mask = batch
    lp, old = -torch.rand(B, T, generator=gen) * 2, -torch.rand(B, T, generator=gen) * 2
    got = sequence_log_ratio(add_junk(gen, lp, mask), add_junk(gen, old, mask), mask)  # (B, T)
    for i in range(B):
        m = mask[i]
        want = float((lp[i][m] - old[i][m]).double().mean()) if m.any() else 0.0
        assert torch.allclose(got[i][m].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
        assert not got[i][~m].any()
    full = torch.ones(B, T, dtype=torch.bool)
    assert torch.equal(sequence_log_ratio(lp, old), sequence_log_ratio(lp, old, full))
    assert torch.equal(token_log_ratio(lp, old, mask), torch.where(mask, lp - old, 0.0))
    assert IMPORTANCE_LOG_RATIOS == {"token": token_log_ratio, "sequence": sequence_log_ratio}


def test_a_huge_sequence_log_ratio_gives_a_finite_loss_and_no_gradient():
    old = torch.full((2, 3), -3.0)
    x = (old + torch.tensor([[100.0, 100.0, 100.0], [-200.0, -200.0, -200.0]])).requires_grad_()
    adv = torch.tensor([[-1.0, 1.0, -1.0], [-1.0, 1.0, 0.0]])
    loss, stats = ppo_policy_loss(x, old, adv, 0.2, importance_sampling_level="sequence")
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(x.grad).all() and x.grad.eq(0).all()
    assert all(torch.isfinite(v).all() for v in stats.values()), stats
    assert loss[0, 0].item() == pytest.approx(float(torch.tensor(20.0).exp()))  # the bounded ratio


def test_an_unknown_level_is_refused_by_name():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"importance_sampling_level must be one of \['sequence', 'token'\]"):
        ppo_policy_loss(x, x, x, importance_sampling_level="seq")
