"""A frozen teacher's full-vocabulary divergence from the student at every response position (on-policy
distillation, :mod:`rlhfkit.algos.distill`), without a (B, R, V) logits tensor of either model.

Both models run once with ``logits_to_keep=1`` and give their last hidden states (the teacher under
``torch.no_grad``); then, ``chunk_tokens`` positions at a time, each model's own output module (and final
transform: :func:`rlhfkit.models.head_chunks.head_transform`) makes that chunk's logits, both are processed as the
sampler processes them, and :func:`rlhfkit.algos.token_divergence` compares them. Under autograd each chunk runs
inside ``torch.utils.checkpoint`` (non-reentrant), so that the backward recomputes the chunk's logits (the
teacher's under no_grad again) instead of keeping them: peak memory is the two models' (B, R, H) hidden states
plus a few (chunk_tokens, V) float32 blocks, as in :mod:`rlhfkit.models.head_chunks`. The teacher may be another
architecture (another hidden size) with the same vocabulary.

The plain path: when either model is not :func:`rlhfkit.models.head_chunks.chunkable` (its logits are not its
head of its hidden states up to a known transform, or it is FSDP-sharded), each model's whole response logits
come from its own forward (:func:`rlhfkit.models.readout.response_forward`), the teacher's first and without
grad, then the student's; the divergence is still taken a chunk of positions at a time, checkpointed, so only
the two models' (B, R, V) logits are whole.

With ``readout=True`` the same forwards also give what the update's own read-out of the student would
(:func:`rlhfkit.models.head_chunks.response_readout`): the student's log-probs of the sampled tokens (with grad)
and its entropies under the sampler's processing, and the teacher's log-probs of those tokens under the
untruncated processing (as the rollout's teacher log-probs are read, :func:`rlhfkit.models.sampling.untruncated`),
from the logits of the chunk the divergence already holds: a distillation update with a full-vocabulary loss
then runs the student once, not once for its log-probs and once for the divergence (a :class:`TeacherRead`).

Sampling: both distributions are the sampler's (:func:`rlhfkit.models.sampling.processed_logits`: suppressed ids,
temperature, top-k / top-p), each truncated by its own logits with the sampled token kept in both, as the
log-probs are scored. Under truncation the student's set may hold a token outside the teacher's: there the
reverse KL is ``+inf`` (:func:`rlhfkit.algos.token_divergence`), while the JSD stays finite.

Shapes: ``B`` rows, ``L`` sequence length, ``R`` response length, ``H`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from rlhfkit.algos import entropy_from_logits, token_divergence
from rlhfkit.algos.distill import FULL_DIVERGENCES
from rlhfkit.models.head_chunks import (
    checkpointed_chunks,
    chunk_size,
    head_autocast,
    head_logits,
    head_transform,
    response_hidden,
)
from rlhfkit.models.readout import hf_model, response_forward, sampled_logprobs
from rlhfkit.models.sampling import Sampling, processed_logits, untruncated


class TeacherRead(NamedTuple):
    """:func:`teacher_divergence` with ``readout=True``; each (B, R) float32, padding positions hold a value too.

    Attributes:
        divergence: the per-token divergence, with gradient through the student.
        logprobs: the student's log-probs of the sampled tokens under the sampler's processing, with gradient.
        entropy: the student's entropy of that distribution (with gradient only when ``entropy_grad``).
        teacher_logprobs: the teacher's log-probs of the sampled tokens, untruncated, without gradient.
    """

    divergence: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor
    teacher_logprobs: torch.Tensor


def teacher_divergence(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    start: int,
    sampling: Sampling | None,
    loss: str,
    beta: float = 0.5,
    chunk_tokens: int | None = None,
    readout: bool = False,
    entropy_grad: bool = True,
    logprob_grad: bool = True,
) -> torch.Tensor | TeacherRead:
    """The per-token divergence between the student's and the teacher's next-token distributions over the
    response positions, with gradient through the student only (module docstring).

    Args:
        student: the trained causal LM (possibly wrapped: DDP, peft); its forward runs with grad as the caller
            has it.
        teacher: a frozen causal LM with the student's vocabulary, run under no_grad as it is (its train / eval
            mode is the caller's).
        input_ids, attention_mask: (B, L) = left-padded prompts then right-padded responses.
        start: p0 (>= 1), the column of the first response token; position t is read at column p0 + t - 1, as
            :func:`rlhfkit.models.head_chunks.response_readout` reads ``logprobs[:, t]``.
        sampling: the sampler's processing, applied to both models (None: the plain softmax).
        loss: ``full_reverse_kl`` or ``jsd`` (:func:`rlhfkit.algos.token_divergence`).
        beta: the JSD's teacher weight, in (0, 1).
        chunk_tokens: positions per chunk (default :func:`rlhfkit.models.head_chunks.chunk_size`).
        readout: also the student's and the teacher's read-outs of the sampled tokens (:class:`TeacherRead`).
        entropy_grad: with ``readout``, False when no loss uses the student's entropies (a metric).
        logprob_grad: with ``readout``, False when no loss takes a gradient through the student's log-probs (a
            policy loss whose advantages are all 0): they are returned without one.
    Returns:
        (B, R) float32 with R = L - p0; padding positions hold a value too (mask them). With ``readout`` a
        :class:`TeacherRead` of such tensors.
    """
    sampling = sampling or Sampling()
    length = input_ids.shape[1]
    if not 1 <= start <= length:
        raise ValueError(f"start must be in [1, {length}], got {start}")
    if loss not in FULL_DIVERGENCES:
        raise ValueError(f"teacher_divergence computes {' or '.join(FULL_DIVERGENCES)}, not {loss!r}")
    if loss == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"jsd beta must be in (0, 1), got {beta}")
    labels = input_ids[:, start:].long().clamp(min=0)  # (B, R): kept in each model's truncation set
    divergence = functools.partial(_divergence, sampling, loss, beta, readout, entropy_grad, logprob_grad)
    s_transform, t_transform = head_transform(student), head_transform(teacher)
    if s_transform is None or t_transform is None:
        parts = _plain_divergence(
            student, teacher, input_ids, attention_mask, start, labels, divergence, chunk_tokens
        )
        return _joined(parts, labels.shape, readout)
    with torch.no_grad():
        t_hidden, _ = response_hidden(
            teacher, input_ids, attention_mask, start, use_cache=False
        )  # (B, R, H_t)
    s_hidden, _ = response_hidden(student, input_ids, attention_mask, start, use_cache=False)  # (B, R, H)
    s_head, t_head = hf_model(student).get_output_embeddings(), hf_model(teacher).get_output_embeddings()
    vocab = getattr(s_head, "out_features", None) or s_head.weight.shape[0]
    recorded = torch.is_grad_enabled() and (
        s_hidden.requires_grad or any(p.requires_grad for p in s_head.parameters())
    )
    read = functools.partial(
        _chunk_from_hidden, (student, s_head, s_transform), (teacher, t_head, t_transform), divergence
    )
    flat = (
        s_hidden.flatten(0, 1),
        t_hidden.flatten(0, 1),
        labels.reshape(-1),
    )  # (B R, H), (B R, H_t), (B R,)
    size = chunk_size(vocab, chunk_tokens)
    if recorded and not any(
        p.requires_grad for p in s_head.parameters()
    ):  # a frozen head: LoRA, a frozen base
        # the outputs that take a gradient: the divergence, and the student's log-probs and entropies if asked
        which = (0, *((1,) if logprob_grad else ()), *((2,) if entropy_grad else ())) if readout else (0,)
        chunks = zip(*(t.split(size) for t in flat), strict=True)
        parts = [_RowGradients.apply(read, which, *chunk) for chunk in chunks]
        return _joined([p if readout else p[0] for p in parts], labels.shape, readout)
    parts = checkpointed_chunks(read, flat, size, recorded)
    return _joined(parts, labels.shape, readout)


class _RowGradients(torch.autograd.Function):
    """One chunk of the chunked path for a student whose output head takes no gradient: every output of the chunk
    at row i depends on the student's hidden state at row i alone, so the gradient of an output's sum with
    respect to the chunk's hidden states holds each row's own gradient. The forward builds the chunk's graph
    once, takes those gradients (one backward through the chunk per output that needs one: the divergence, and
    with ``readout`` the log-probs and the entropies where asked for), and keeps only them, (n, H) each; the
    backward scales them by the incoming gradients. Against the checkpointed chunk (forward, then in the backward
    the whole chunk again and its backward), both heads run once, not twice, and no (n, V) block lives past the
    forward. Returns the chunk's outputs, detached; those not in ``which`` are not differentiable."""

    @staticmethod
    def forward(ctx, read, which, s_hidden, t_hidden, labels):
        with torch.enable_grad():
            hidden = s_hidden.detach().requires_grad_()
            outs = read(hidden, t_hidden, labels)
            outs = outs if isinstance(outs, tuple) else (outs,)
            rows = [  # (n, H) each
                torch.autograd.grad(outs[i].sum(), hidden, retain_graph=k < len(which) - 1)[0]
                for k, i in enumerate(which)
            ]
        ctx.save_for_backward(*rows)
        ctx.which, ctx.dtype = which, s_hidden.dtype
        outs = tuple(o.detach() for o in outs)
        ctx.mark_non_differentiable(*(o for i, o in enumerate(outs) if i not in which))
        return outs

    @staticmethod
    def backward(ctx, *upstream):
        grad = None
        for i, rows in zip(ctx.which, ctx.saved_tensors, strict=True):
            if upstream[i] is not None:
                term = upstream[i][:, None].to(rows.dtype) * rows
                grad = term if grad is None else grad + term
        return None, None, None if grad is None else grad.to(ctx.dtype), None, None


def _joined(parts: list, shape: torch.Size, readout: bool) -> torch.Tensor | TeacherRead:
    """The chunks' outputs, each (n,) or a tuple of four (n,), joined into (B, R) tensors."""
    if not readout:
        return torch.cat(parts).view(shape)
    return TeacherRead(*(torch.cat([p[i] for p in parts]).view(shape) for i in range(4)))


def _divergence(sampling, loss, beta, readout, entropy_grad, logprob_grad, s_logits, t_logits, labels):
    """token_divergence of the processed logits (n, V) and (n, V) of one chunk, labels (n,) -> (n,); with
    ``readout`` also (n,) each: the student's log-probs and entropies (as ``response_readout`` computes them
    from the same logits; each without a graph unless asked for) and the teacher's untruncated log-probs of
    ``labels``."""
    s = processed_logits(s_logits[None], sampling, labels[None])[0]  # (n, V) float32
    with torch.no_grad():
        t = processed_logits(t_logits[None], sampling, labels[None])[0]
    value = token_divergence(s, t, loss, beta)
    if not readout:
        return value
    logprobs = sampled_logprobs(
        s_logits[None] if logprob_grad else s_logits[None].detach(), labels[None], sampling
    )[0]
    entropy = entropy_from_logits(s if entropy_grad else s.detach())  # no graph for a metric
    with torch.no_grad():
        teacher = sampled_logprobs(t_logits[None], labels[None], untruncated(sampling))[0]
    return value, logprobs, entropy, teacher


def _chunk_from_hidden(student, teacher, divergence, s_hidden, t_hidden, labels) -> torch.Tensor:
    """One chunk of the chunked path: (n, H), (n, H_t), (n,) -> (n,); each head under its model's autocast,
    the teacher's without grad (also when the backward recomputes the chunk)."""
    model, head, transform = student
    with head_autocast(model):
        s_logits = head_logits(head, transform, s_hidden)  # (n, V)
    model, head, transform = teacher
    with torch.no_grad(), head_autocast(model):
        t_logits = head_logits(head, transform, t_hidden)  # (n, V)
    return divergence(s_logits, t_logits, labels)


def _plain_divergence(student, teacher, input_ids, attention_mask, start, labels, divergence, chunk_tokens):
    """The plain path (module docstring): whole response logits from each model's forward, the teacher's first
    and without grad; the divergence a checkpointed chunk of positions at a time. Returns the chunks' outputs."""
    with torch.no_grad():
        t_logits, _ = response_forward(teacher, input_ids, attention_mask, start)  # (B, R, V)
    s_logits, _ = response_forward(student, input_ids, attention_mask, start)  # (B, R, V)
    recorded = torch.is_grad_enabled() and s_logits.requires_grad
    flat = (s_logits.flatten(0, 1), t_logits.flatten(0, 1), labels.reshape(-1))  # (B R, V), (B R, V), (B R,)
    return checkpointed_chunks(divergence, flat, chunk_size(s_logits.shape[-1], chunk_tokens), recorded)
