"""On-policy distillation: the student (the policy) samples responses, a frozen teacher with the same vocabulary
scores every token of them (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD), arXiv 2306.13649; Thinking Machines, "On-Policy Distillation", 2025).

Three per-token terms, named by :data:`DistillLoss`:

- ``reverse_kl``: the sampled reverse KL ``log pi(y_t) - log pi_teacher(y_t)`` at the sampled token
  (:func:`sampled_reverse_kl`); an unbiased one-sample estimate of KL(student || teacher), used as a reward
  ``-coef * sampled_reverse_kl`` (Thinking Machines 2025);
- ``full_reverse_kl``: the exact KL(student || teacher) over the whole vocabulary at each position;
- ``jsd``: GKD's generalized Jensen-Shannon divergence over the whole vocabulary (:func:`token_divergence`).

Shapes: ``B`` batch, ``T`` response length, ``N`` rows (positions), ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from rlhfkit.algos.masked import fill_masked

DistillLoss = Literal["reverse_kl", "full_reverse_kl", "jsd"]
"""The per-token distillation terms (a config field uses this ``Literal``)."""

DISTILL_LOSSES: tuple[str, ...] = get_args(DistillLoss)

# The terms token_divergence computes from whole distributions (reverse_kl needs only the sampled token's log-probs).
FULL_DIVERGENCES: tuple[str, ...] = ("full_reverse_kl", "jsd")


def sampled_reverse_kl(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``log pi(y_t) - log pi_teacher(y_t)`` per token, exactly 0 at masked positions whatever they hold.

    The distillation reward is ``-coef * sampled_reverse_kl`` (GKD's on-policy reverse KL as a per-token reward,
    Thinking Machines 2025); its expectation over the student's samples is KL(student || teacher).

    Args:
        logprobs: (B, T) the student's log-probs of the sampled tokens.
        teacher_logprobs: (B, T) the teacher's log-probs of the same tokens.
        mask: (B, T) 1 on response tokens, 0 elsewhere.
    Returns:
        (B, T), with the gradient of the difference at valid positions and an exact 0 at masked ones.
    """
    return fill_masked(logprobs - teacher_logprobs, mask)


def token_divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, loss: str, beta: float = 0.5
) -> torch.Tensor:
    """The divergence between the student's and the teacher's next-token distributions at each row.

    ``full_reverse_kl``: ``sum_v p_s(v) (log p_s(v) - log p_t(v))`` = KL(student || teacher).

    ``jsd``: GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024, sec. 3), with
    ``M = beta * p_t + (1 - beta) * p_s``: ``JSD_beta = beta * KL(p_t || M) + (1 - beta) * KL(p_s || M)``.
    ``beta`` weighs the teacher, as TRL's ``generalized_jsd_loss`` (trl/trainer/gkd_trainer.py) does: for
    ``0 < beta < 1`` the two agree term for term. Near the ends ``JSD_beta / (1 - beta)`` tends to the reverse KL
    (beta -> 1) and ``JSD_beta / beta`` to the forward KL(teacher || student) (beta -> 0); TRL's ``beta = 1`` and
    ``beta = 0`` ARE those KLs, while here beta must lie strictly inside (0, 1) (``full_reverse_kl`` is the
    reverse KL). ``JSD_beta`` is at most ``-beta log beta - (1 - beta) log(1 - beta)`` (log 2 at 0.5).
    ``log M`` is ``logsumexp(log p_t + log beta, log p_s + log(1 - beta))``, taken relative to the larger of the
    two log-probs: with ``d = log p_t - log p_s``, ``log M - log p_t = log1p((1 - beta) expm1(-d))`` for
    ``d >= 0`` (in [log beta, 0]) and ``log M - log p_s = log1p(beta expm1(d))`` for ``d < 0`` (in
    [log(1 - beta), 0]), bounded whatever ``d`` is and exactly 0 where the two log-probs agree: JSD(p, p) = 0.

    A ``-inf`` logit (a token masked out of a distribution, e.g. by top-k) is a probability of exactly 0, and
    ``0 * log 0`` counts 0, never NaN, with finite gradients. A token the teacher gives probability 0 and the
    student does not makes the reverse KL ``+inf`` (it is unbounded there), with the gradient of the row's finite
    terms (the infinite one adds none): a masked row gives a zero gradient, not NaN. The JSD stays finite there,
    since ``M >= (1 - beta) p_s``. Each row needs at least one finite logit.

    Args:
        student_logits: (N, V) (or any (..., V)), any float dtype; computed in float32 at least.
        teacher_logits: the same shape; pass it without grad for a gradient into ``student_logits`` only
            (nothing is detached here).
        loss: ``full_reverse_kl`` or ``jsd``.
        beta: the JSD's teacher weight, in (0, 1); unused by ``full_reverse_kl``.
    Returns:
        (N,) float32 (float64 for float64 logits), >= 0 up to rounding.
    """
    if loss not in FULL_DIVERGENCES:
        sampled = (
            " (the sampled reverse_kl: sampled_reverse_kl of the log-probs)" if loss == "reverse_kl" else ""
        )
        raise ValueError(f"token_divergence computes {' or '.join(FULL_DIVERGENCES)}, not {loss!r}{sampled}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"the student's logits {tuple(student_logits.shape)} and the teacher's {tuple(teacher_logits.shape)} "
            "differ: distillation needs one vocabulary"
        )
    if loss == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"jsd beta must be in (0, 1), got {beta}")
    with torch.no_grad():
        logp_s, logp_t = _log_softmax(student_logits), _log_softmax(teacher_logits)  # (N, V)
        if loss == "full_reverse_kl":
            value, grad = _reverse_kl(logp_s, logp_t)
        else:
            value, grad = _generalized_jsd(logp_s, logp_t, float(beta))
    if not student_logits.requires_grad:
        return value
    # The value, with the gradient d value / d student_logits written out (``grad``), so that it is exactly 0
    # wherever the two distributions agree: autograd through log_softmax leaves p * (1 - sum p), a rounding
    # residue of ~1e-8 that Adam would scale up to a full step (a student distilled from its own copy would move).
    finite = student_logits.masked_fill(~torch.isfinite(student_logits), 0.0)  # a -inf logit: no -inf * 0
    surrogate = (finite * grad.to(student_logits.dtype)).sum(-1)  # (N,), its gradient is grad
    return value + (surrogate - surrogate.detach()).to(value.dtype)


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 (at least) log-probabilities over the last dimension."""
    return torch.log_softmax(
        logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, dim=-1
    )


def _reverse_kl(logp_s: torch.Tensor, logp_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(student || teacher) per row from log-probs (N, V): (value (N,), its gradient with respect to the
    student's logits (N, V)).

    With F the tokens where both have probability > 0, g = log p_s - log p_t on F (0 elsewhere) and S = sum_F p_s g:
    d KL / d z_j = p_s,j (g_j - S) + p_s,j ([j in F] - P_F), P_F = sum_F p_s; the second term is 0 in a row where
    the student's support is inside the teacher's (P_F = 1), and is left out there rather than computed from a
    rounded P_F."""
    p_s = logp_s.exp()  # (N, V)
    live_s, dead_t = p_s > 0, logp_t == -torch.inf
    # Where p_s = 0 the term is 0 whatever the teacher says (-inf - -inf would be NaN). Where p_s > 0 and p_t = 0
    # it is +inf, put in as a constant: its gradient is 0, so that the row's other terms keep a finite gradient
    # and a row the caller masks (a zero upstream gradient) never sends 0 * inf = NaN into the student.
    inside = live_s & ~dead_t  # F
    gap = torch.where(inside, logp_s - logp_t, 0.0)  # (N, V)
    finite = (p_s * gap).sum(-1, keepdim=True)  # (N, 1) S
    value = torch.where(live_s & dead_t, torch.inf, p_s * gap).sum(-1)
    grad = p_s * (gap - finite)
    outside = (live_s & dead_t).any(-1, keepdim=True)  # (N, 1): a row with an infinite term
    if bool(outside.any()):
        mass = (p_s * inside).sum(-1, keepdim=True)  # P_F
        grad = grad + torch.where(outside, p_s * (inside.to(p_s.dtype) - mass), 0.0)
    return value, grad


def _generalized_jsd(
    logp_s: torch.Tensor, logp_t: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GKD's JSD_beta per row from log-probs (N, V) (:func:`token_divergence`): (value (N,), its gradient with
    respect to the student's logits (N, V))."""
    p_s, p_t = logp_s.exp(), logp_t.exp()  # (N, V)
    live_s, live_t = p_s > 0, p_t > 0
    either = live_s | live_t  # where both are 0 the terms are 0; 0 there keeps -inf - -inf out
    d = torch.where(either, logp_t, 0.0) - torch.where(either, logp_s, 0.0)  # log p_t / p_s, +-inf at a 0
    # Each branch on its own half-line, so that the branch torch.where drops has a finite gradient too.
    m_over_t = torch.log1p((1.0 - beta) * torch.expm1(-d.clamp(min=0)))  # log M / p_t where d >= 0
    m_over_s = torch.log1p(beta * torch.expm1(d.clamp(max=0)))  # log M / p_s where d < 0
    ahead = d >= 0
    log_m_t = torch.where(ahead, m_over_t, m_over_s - d)  # log M - log p_t, +inf where p_t = 0
    log_m_s = torch.where(ahead, m_over_t + d, m_over_s)  # log M - log p_s, +inf where p_s = 0
    kl_t = (p_t * torch.where(live_t, -log_m_t, 0.0)).sum(-1)  # KL(p_t || M)
    h = torch.where(live_s, -log_m_s, 0.0)  # log p_s - log M, 0 where p_s = 0
    kl_s = (p_s * h).sum(-1)  # KL(p_s || M)
    # d JSD / d p_s = (1 - beta) h (the other terms cancel), through the softmax: p_s (u - sum p_s u), u = (1 - beta) h
    grad = (1.0 - beta) * p_s * (h - kl_s.unsqueeze(-1))
    return beta * kl_t + (1.0 - beta) * kl_s, grad
