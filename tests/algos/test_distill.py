"""Distillation terms (rlhfkit.algos.distill): the sampled reverse KL with masks, and the full-vocabulary reverse
KL and generalized JSD against plain float64 loops, hand-computed cases, their identities and -inf handling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings

from rlhfkit.algos import DISTILL_LOSSES, DistillLoss, sampled_reverse_kl, token_divergence

from .strategies import add_junk, batches

INF = float("inf")
BETAS = (0.1, 0.25, 0.5, 0.9)


def divergence_loop(student_logits, teacher_logits, loss, beta=0.5):
    """The definitions, one row and one vocabulary entry at a time, in float64 (a -inf logit: probability 0)."""

    def log_probs(row):
        top = max(x for x in row if x != -INF)
        log_z = top + math.log(sum(math.exp(x - top) for x in row if x != -INF))
        return [x - log_z if x != -INF else -INF for x in row]

    out = []
    for s_row, t_row in zip(student_logits.double().tolist(), teacher_logits.double().tolist(), strict=True):
        ls, lt = log_probs(s_row), log_probs(t_row)
        if loss == "full_reverse_kl":
            out.append(sum(math.exp(a) * (a - b) for a, b in zip(ls, lt, strict=True) if a != -INF))
            continue
        kl_t = kl_s = 0.0
        for a, b in zip(ls, lt, strict=True):
            ps, pt = math.exp(a), math.exp(b)
            m = beta * pt + (1 - beta) * ps
            kl_t += pt * math.log(pt / m) if pt > 0 else 0.0
            kl_s += ps * math.log(ps / m) if ps > 0 else 0.0
        out.append(beta * kl_t + (1 - beta) * kl_s)
    return torch.tensor(out, dtype=torch.float64)


def _logits(n=6, vocab=11, seed=0, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)


# --- tier 1: hand-computed -----------------------------------------------------------------------------
def test_sampled_reverse_kl_hand_computed():
    # student 1/2 and 1/4 where the teacher says 1/4 and 1/2; the second column is padding holding NaN
    lp = torch.tensor([[math.log(0.5), math.log(0.25), float("nan")]])
    teacher = torch.tensor([[math.log(0.25), math.log(0.5), 0.0]])
    out = sampled_reverse_kl(lp, teacher, torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(out, torch.tensor([[math.log(2.0), -math.log(2.0), 0.0]]))


def test_two_token_vocabulary_hand_computed():
    # p_s = (1/2, 1/2), p_t = (3/4, 1/4)
    student = torch.tensor([[0.0, 0.0]])
    teacher = torch.tensor([[math.log(3.0), 0.0]])
    rkl = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # = 0.5 log(4/3) = 0.143841
    torch.testing.assert_close(token_divergence(student, teacher, "full_reverse_kl"), torch.tensor([rkl]))
    # beta = 1/2: M = (5/8, 3/8); 0.5 KL(p_t || M) + 0.5 KL(p_s || M) = 0.5 (0.035375 + 0.032269) = 0.033822
    kl_t = 0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)
    kl_s = 0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375)
    torch.testing.assert_close(token_divergence(student, teacher, "jsd"), torch.tensor([0.5 * (kl_t + kl_s)]))
    assert abs(0.5 * (kl_t + kl_s) - 0.0338221) < 1e-6
    # beta = 1/4 weighs the teacher 1/4 in the mixture: M = 1/4 p_t + 3/4 p_s = (9/16, 7/16)
    kl_t = 0.75 * math.log(0.75 / 0.5625) + 0.25 * math.log(0.25 / 0.4375)
    kl_s = 0.5 * math.log(0.5 / 0.5625) + 0.5 * math.log(0.5 / 0.4375)
    # 0.0248700; with the weights the other way round (M = 3/4 p_t + 1/4 p_s, 3/4 on KL(p_t || M)): 0.0260482
    want = 0.25 * kl_t + 0.75 * kl_s
    got = token_divergence(student, teacher, "jsd", beta=0.25)
    torch.testing.assert_close(got, torch.tensor([want]))
    assert abs(want - 0.0248700) < 1e-6


def test_names_match_the_literal():
    assert DISTILL_LOSSES == DistillLoss.__args__ == ("reverse_kl", "full_reverse_kl", "jsd")


# --- tier 2: against the plain loop --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("beta", BETAS)
def test_token_divergence_equals_the_plain_loop(dtype, beta):
    student, teacher = _logits(seed=1, dtype=dtype), _logits(seed=2, dtype=dtype)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    for loss in ("full_reverse_kl", "jsd"):
        got = token_divergence(student, teacher, loss, beta)
        assert got.dtype == dtype and got.shape == (6,)
        torch.testing.assert_close(got.double(), divergence_loop(student, teacher, loss, beta), **tol)


def test_half_precision_logits_are_computed_in_float32():
    student, teacher = _logits(seed=3, dtype=torch.bfloat16), _logits(seed=4, dtype=torch.bfloat16)
    for loss in ("full_reverse_kl", "jsd"):
        got = token_divergence(student, teacher, loss, 0.3)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, token_divergence(student.float(), teacher.float(), loss, 0.3))


@settings(max_examples=30, deadline=None)
@given(batches(max_b=4, max_t=20))
def test_sampled_reverse_kl_junk_at_masked_positions_changes_nothing(batch):
    gen, B, T, mask = batch
    lp = torch.randn(B, T, generator=gen, dtype=torch.float64) - 2
    teacher = torch.randn(B, T, generator=gen, dtype=torch.float64) - 2
    clean = sampled_reverse_kl(lp, teacher, mask)
    torch.testing.assert_close(clean, torch.where(mask, lp - teacher, 0.0))
    junk_lp = add_junk(gen, lp, mask).requires_grad_()
    junk = sampled_reverse_kl(junk_lp, add_junk(gen, teacher, mask), mask)
    assert torch.equal(junk, clean) and not junk[~mask].any()
    (grad,) = torch.autograd.grad(junk.sum(), junk_lp)
    assert torch.equal(grad, mask.double())  # 1 at valid tokens, an exact 0 at the junk


# --- identities ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_distribution_against_itself_gives_exactly_zero(dtype):
    logits = _logits(n=8, vocab=50, seed=5, scale=6.0, dtype=dtype)
    logits[0, :10] = -INF  # a truncated row too
    zero = torch.zeros(8, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(token_divergence(logits, logits.clone(), "full_reverse_kl"), zero)
    for beta in BETAS:
        assert torch.equal(token_divergence(logits, logits.clone(), "jsd", beta), zero)


def test_jsd_is_symmetric_at_one_half_and_bounded_by_the_entropy_of_beta():
    student, teacher = _logits(seed=6, dtype=torch.float64), _logits(seed=7, dtype=torch.float64)
    half = token_divergence(student, teacher, "jsd", 0.5)
    torch.testing.assert_close(half, token_divergence(teacher, student, "jsd", 0.5), atol=1e-14, rtol=0)
    for beta in BETAS:  # JSD_beta(s, t) = JSD_(1 - beta)(t, s)
        torch.testing.assert_close(
            token_divergence(student, teacher, "jsd", beta),
            token_divergence(teacher, student, "jsd", 1 - beta),
            atol=1e-14,
            rtol=0,
        )
    # disjoint supports reach the bound -beta log beta - (1 - beta) log(1 - beta) (log 2 at one half)
    s, t = torch.full((1, 4), -INF), torch.full((1, 4), -INF)
    s[0, :2], t[0, 2:] = torch.tensor([0.3, -1.0]), torch.tensor([2.0, 0.1])
    for beta in BETAS:
        bound = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
        assert (token_divergence(student, teacher, "jsd", beta) < bound).all()
        torch.testing.assert_close(token_divergence(s, t, "jsd", beta), torch.tensor([bound]))
    assert abs(float(token_divergence(s, t, "jsd", 0.5)) - math.log(2.0)) < 1e-6


def test_jsd_tends_to_trl_s_reverse_kl_as_beta_tends_to_one_and_to_the_forward_kl_at_zero():
    """TRL's beta = 1 is KL(student || teacher), its beta = 0 KL(teacher || student): the same direction here."""
    student = _logits(seed=8, scale=1.5, dtype=torch.float64)
    teacher = _logits(seed=9, scale=1.5, dtype=torch.float64)
    eps = 1e-8
    reverse = token_divergence(student, teacher, "full_reverse_kl")
    forward = token_divergence(teacher, student, "full_reverse_kl")
    assert not torch.allclose(reverse, forward, rtol=0.05)
    torch.testing.assert_close(
        token_divergence(student, teacher, "jsd", 1 - eps) / eps, reverse, rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        token_divergence(student, teacher, "jsd", eps) / eps, forward, rtol=1e-5, atol=0
    )


# --- gradients and -inf --------------------------------------------------------------------------------
def test_gradients_are_the_derivative_of_the_value_and_go_to_the_student_only():
    student = _logits(n=3, vocab=5, seed=10, dtype=torch.float64).requires_grad_()
    teacher = _logits(n=3, vocab=5, seed=11, dtype=torch.float64)
    for loss, beta in (("full_reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.2)):
        assert torch.autograd.gradcheck(
            lambda s, loss=loss, beta=beta: token_divergence(s, teacher, loss, beta), student
        )
        with_grad = teacher.clone().requires_grad_()
        value = token_divergence(student, with_grad, loss, beta).sum()
        (grad,) = torch.autograd.grad(value, student)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0
        assert with_grad.grad is None  # the teacher is a target: no gradient reaches it


@pytest.mark.parametrize("loss", ["full_reverse_kl", "jsd"])
def test_a_student_equal_to_its_teacher_gets_exactly_zero_gradient(loss):
    """Autograd through log_softmax would leave p * (1 - sum p), ~1e-8 of rounding, which Adam scales up to a
    full step: a student distilled from its own copy would move."""
    teacher = _logits(n=64, vocab=1000, seed=21) * 4
    student = teacher.clone().requires_grad_()
    value = token_divergence(student, teacher, loss, 0.3)
    (grad,) = torch.autograd.grad(value.sum(), student)
    assert (value == 0).all() and (grad == 0).all()


def test_minus_inf_logits_count_as_probability_zero():
    student, teacher = _logits(n=4, vocab=6, seed=12), _logits(n=4, vocab=6, seed=13)
    student[0, :2] = teacher[0, :2] = -INF  # masked in both: no NaN
    student[1, 3] = -INF  # masked in the student only: contributes 0 to the reverse KL
    student[2, 1:4] = -INF  # the student's support inside the teacher's, which is truncated elsewhere
    teacher[2, 1] = -INF
    teacher[3, 0] = -INF  # the teacher gives 0 to a token the student may sample
    student.requires_grad_()
    for loss in ("full_reverse_kl", "jsd"):
        got = token_divergence(student, teacher, loss, 0.4)
        want = divergence_loop(student.detach(), teacher, loss, 0.4)
        torch.testing.assert_close(
            got.double(), want, atol=1e-5, rtol=1e-5
        )  # +inf for the reverse KL's row 3
        for weights in (torch.ones(4), torch.tensor([1.0, 1.0, 1.0, 0.0])):  # all rows; row 3 masked
            (grad,) = torch.autograd.grad((got * weights).sum(), student, retain_graph=True)
            assert torch.isfinite(grad).all() and (grad[student.detach() == -INF] == 0).all()
            assert (grad[3] == 0).all() == (weights[3] == 0)
    assert token_divergence(student, teacher, "full_reverse_kl")[3] == INF  # KL(s || t) is unbounded there
    assert torch.isfinite(token_divergence(student, teacher, "jsd", 0.4)[3])


def test_bad_arguments_raise_named_errors():
    s = t = torch.zeros(2, 3)
    for beta in (0.0, 1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="beta must be in"):
            token_divergence(s, t, "jsd", beta)
    token_divergence(s, t, "full_reverse_kl", 1.0)  # beta unused there
    with pytest.raises(ValueError, match="sampled_reverse_kl"):
        token_divergence(s, t, "reverse_kl")
    with pytest.raises(ValueError, match="full_reverse_kl or jsd"):
        token_divergence(s, t, "kl")
    with pytest.raises(ValueError, match="one vocabulary"):
        token_divergence(s, torch.zeros(2, 4), "jsd")
