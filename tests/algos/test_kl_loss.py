"""kl_penalty_loss: the EXACT expected gradient on a categorical (no sampling), hand-computed values and
gradients, a reference loop, junk at masked positions, bad inputs."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfkit.algos import (
    DEFAULT_KL_LOSS_ESTIMATOR,
    KL_LOSS_ESTIMATOR_NAMES,
    KL_LOSS_ESTIMATORS,
    KLLossEstimator,
    kl_penalty_loss,
)

from .reference import kl_penalty_loop
from .strategies import add_junk, batches

torch.set_num_threads(1)
UNBIASED = ("k2", "k3_is")
V = 7


def test_names_dict_and_default():
    assert (
        tuple(KL_LOSS_ESTIMATORS)
        == KL_LOSS_ESTIMATOR_NAMES
        == KLLossEstimator.__args__
        == ("k2", "k3_is", "k3")
    )
    assert DEFAULT_KL_LOSS_ESTIMATOR in UNBIASED
    assert len({str(inspect.signature(f)) for f in KL_LOSS_ESTIMATORS.values()}) == 1


# --- the exact expectation over a categorical ------------------------------------------------------------
def _categorical(seed):
    """theta logits (with gradient), and the log-probs of pi_ref and of an off-policy pi_old, float64 (V,)."""
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=gen, dtype=torch.float64).requires_grad_()
    ref = torch.randn(V, generator=gen, dtype=torch.float64).log_softmax(-1)
    old = (theta.detach() + torch.randn(V, generator=gen, dtype=torch.float64)).log_softmax(-1)
    return theta, ref, old


def _expected_grad(theta, ref, estimator, old, sampling):
    """grad_theta of sum_v pi_sampling(v) * loss(v): each vocabulary entry is one token of a (1, V) batch,
    weighted by the probability that pi_old (``sampling``, log-probs) draws it. ``old`` is what the loss gets."""
    lp = theta.log_softmax(-1)  # (V,)
    loss = kl_penalty_loss(
        lp[None], ref[None], estimator=estimator, old_logprobs=None if old is None else old[None]
    )
    (grad,) = torch.autograd.grad((sampling.exp() * loss[0]).sum(), theta)
    return grad


def _grad_of(theta, kl):
    (grad,) = torch.autograd.grad(kl, theta)
    return grad


def _reverse_kl(theta, ref):  # KL(pi_theta || pi_ref), the penalty RLHF means
    lp = theta.log_softmax(-1)
    return (lp.exp() * (lp - ref)).sum()


def _forward_kl(theta, ref):  # KL(pi_ref || pi_theta)
    return (ref.exp() * (ref - theta.log_softmax(-1))).sum()


@pytest.mark.parametrize("estimator", UNBIASED)
@pytest.mark.parametrize("seed", range(5))
def test_unbiased_forms_have_the_exact_gradient_of_kl_policy_to_reference(estimator, seed):
    theta, ref, off = _categorical(seed)
    target = _grad_of(theta, _reverse_kl(theta, ref))
    on = theta.detach().log_softmax(-1)
    cases = {
        "on-policy, old_logprobs=None": (None, on),
        "on-policy, old = theta detached": (on, on),
        "off-policy": (off, off),
    }
    for name, (old, sampling) in cases.items():
        grad = _expected_grad(theta, ref, estimator, old, sampling)
        torch.testing.assert_close(grad, target, rtol=0, atol=1e-6, msg=f"{estimator}, {name}")
    assert target.abs().max() > 0.05  # the check is not of a vanishing gradient


@pytest.mark.parametrize("seed", range(5))
def test_plain_k3_is_biased_and_is_the_forward_kl_gradient_on_policy(seed):
    theta, ref, off = _categorical(seed)
    reverse = _grad_of(theta, _reverse_kl(theta, ref))
    on = theta.detach().log_softmax(-1)
    on_grad = _expected_grad(theta, ref, "k3", None, on)
    assert (on_grad - reverse).abs().max() > 1e-2
    torch.testing.assert_close(on_grad, _grad_of(theta, _forward_kl(theta, ref)), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        _expected_grad(theta, ref, "k3", on, on), on_grad, rtol=0, atol=0
    )  # old unused
    assert (_expected_grad(theta, ref, "k3", off, off) - reverse).abs().max() > 1e-2


@pytest.mark.parametrize("seed", range(3))
def test_k3_is_value_is_an_unbiased_kl_estimate_off_policy(seed):
    theta, ref, off = _categorical(seed)
    lp = theta.detach().log_softmax(-1)
    value = (
        off.exp() * kl_penalty_loss(lp[None], ref[None], estimator="k3_is", old_logprobs=off[None])
    ).sum()
    torch.testing.assert_close(value, _reverse_kl(theta, ref).detach(), rtol=0, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.01, 0.5, 3.0]))
def test_k2_and_k3_is_have_the_same_per_token_gradient(seed, scale):
    gen = torch.Generator().manual_seed(seed)
    lp, ref, old = (-torch.rand(3, 6, generator=gen, dtype=torch.float64) * scale for _ in range(3))
    grads = {}
    for name in KL_LOSS_ESTIMATOR_NAMES:
        x = lp.clone().requires_grad_()
        kl_penalty_loss(x, ref, estimator=name, old_logprobs=old).sum().backward()
        grads[name] = x.grad
    expected = torch.exp(lp - old) * (lp - ref)  # w * log(pi_theta / pi_ref)
    torch.testing.assert_close(grads["k2"], expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads["k3_is"], expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grads["k3"], 1 - torch.exp(ref - lp), rtol=1e-12, atol=1e-14)


# --- tier 1: hand-computed -------------------------------------------------------------------------------
def test_values_and_gradients_by_hand():
    # token 0: pi_theta 1/2, pi_ref 1/4, pi_old 1/4 -> w = 2, log(pi_theta / pi_ref) = ln 2, r = pi_ref / pi_theta = 1/2
    # token 1: pi_theta 1/4, pi_ref 1/2, pi_old 1/2 -> w = 1/2, log(pi_theta / pi_ref) = -ln 2, r = 2
    # token 2: all 0.3 -> w = 1, r = 1: every form is 0 with gradient 0
    ln2 = math.log(2.0)
    lp = torch.tensor([[0.5, 0.25, 0.3]]).log()
    ref = torch.tensor([[0.25, 0.5, 0.3]]).log()
    old = torch.tensor([[0.25, 0.5, 0.3]]).log()
    k3 = [0.5 - 1 + ln2, 2 - 1 - ln2, 0.0]  # r - 1 - log r
    expected = {
        # (value, gradient w.r.t. logprobs), off-policy
        "k2": ([2 * 0.5 * ln2**2, 0.5 * 0.5 * ln2**2, 0.0], [2 * ln2, 0.5 * -ln2, 0.0]),
        "k3_is": ([2 * k3[0], 0.5 * k3[1], 0.0], [2 * ln2, 0.5 * -ln2, 0.0]),
        "k3": (k3, [1 - 0.5, 1 - 2, 0.0]),  # 1 - r, no weight
    }
    on_policy = {  # old_logprobs=None: w = 1, but k3_is's ratio still carries grad log pi_theta
        "k2": ([0.5 * ln2**2, 0.5 * ln2**2, 0.0], [ln2, -ln2, 0.0]),
        "k3_is": (k3, [ln2, -ln2, 0.0]),
        "k3": (k3, [0.5, -1.0, 0.0]),
    }
    for old_logprobs, table in ((old, expected), (None, on_policy)):
        for name, (value, grad) in table.items():
            x = lp.clone().requires_grad_()
            loss = kl_penalty_loss(x, ref, estimator=name, old_logprobs=old_logprobs)
            loss.sum().backward()
            msg = f"{name}, old={'given' if old_logprobs is not None else None}"
            torch.testing.assert_close(loss, torch.tensor([value]), msg=msg)
            torch.testing.assert_close(x.grad, torch.tensor([grad]), msg=msg)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), off_policy=st.booleans())
def test_matches_the_reference_loop(seed, off_policy):
    gen = torch.Generator().manual_seed(seed)
    lp, ref, old = (-torch.rand(3, 5, generator=gen, dtype=torch.float64) * 4 for _ in range(3))
    old = old if off_policy else None
    for name in KL_LOSS_ESTIMATOR_NAMES:
        expected = torch.tensor(kl_penalty_loop(lp, ref, old, name), dtype=torch.float64)
        torch.testing.assert_close(kl_penalty_loss(lp, ref, estimator=name, old_logprobs=old), expected)


# --- masks and bad input ---------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(batch=batches(max_t=20), name=st.sampled_from(KL_LOSS_ESTIMATOR_NAMES), off_policy=st.booleans())
def test_junk_at_masked_positions_changes_nothing(batch, name, off_policy):
    gen, B, T, mask = batch
    lp, ref, old = (-torch.rand(B, T, generator=gen) * 3 for _ in range(3))
    runs = []
    for junk in (False, True):
        dirty = (lambda x: add_junk(gen, x, mask)) if junk else (lambda x: x)
        x = dirty(lp).detach().clone().requires_grad_()
        loss = kl_penalty_loss(
            x, dirty(ref), estimator=name, old_logprobs=dirty(old) if off_policy else None, mask=mask
        )
        loss.sum().backward()
        runs.append((loss, x.grad))
    (clean, clean_grad), (dirty_loss, dirty_grad) = runs
    assert torch.equal(clean, dirty_loss) and torch.equal(clean_grad, dirty_grad)
    assert not dirty_loss[~mask].any() and not dirty_grad[~mask].any()
    assert torch.isfinite(dirty_loss).all() and torch.isfinite(dirty_grad).all()
    unmasked = kl_penalty_loss(lp, ref, estimator=name, old_logprobs=old if off_policy else None)
    assert torch.equal(clean[mask], unmasked[mask])


def test_bad_input_raises():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown KL loss estimator 'k1'; choose one of k2, k3_is, k3"):
        kl_penalty_loss(x, x, estimator="k1")
    with pytest.raises(ValueError, match="shapes must match"):
        kl_penalty_loss(x, torch.zeros(2, 4), estimator="k2")
    with pytest.raises(ValueError, match="old_logprobs"):
        kl_penalty_loss(x, x, estimator="k3_is", old_logprobs=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="mask"):
        kl_penalty_loss(x, x, estimator="k3", mask=torch.ones(2, 2, dtype=torch.bool))


@pytest.mark.parametrize("estimator", UNBIASED)
def test_a_huge_importance_ratio_gives_a_finite_value_and_gradient(estimator):
    """The importance weight exp(logprobs - old_logprobs) of k2 and k3_is has its log bounded at +-20 (as the
    policy loss's ratio): a log-ratio of 100 (float32's exp overflows above ~88.7) gives finite values and
    gradients; within the bound the value and gradient are the unbounded formula's."""
    ref = torch.tensor([[-2.0, -2.0, -2.0]])
    old = torch.tensor([[-105.0, -3.0, -2.5]])
    x = torch.tensor([[-5.0, -2.5, -2.2]], requires_grad=True)
    loss = kl_penalty_loss(x, ref, estimator=estimator, old_logprobs=old)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(x.grad).all()
    x0 = x.detach()[:, 1:].clone().requires_grad_()
    weight = torch.exp(x0 - old[:, 1:])
    k3 = torch.expm1(ref[:, 1:] - x0) - (ref[:, 1:] - x0)
    want = weight.detach() * 0.5 * (x0 - ref[:, 1:]) ** 2 if estimator == "k2" else weight * k3
    want.sum().backward()
    torch.testing.assert_close(loss[:, 1:], want, rtol=1e-6, atol=0)
    torch.testing.assert_close(x.grad[:, 1:], x0.grad, rtol=1e-6, atol=0)
