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

Sampling: both distributions are the sampler's (:func:`rlhfkit.models.sampling.processed_logits`: suppressed ids,
temperature, top-k / top-p), each truncated by its own logits with the sampled token kept in both, as the
log-probs are scored. Under truncation the student's set may hold a token outside the teacher's: there the
reverse KL is ``+inf`` (:func:`rlhfkit.algos.token_divergence`), while the JSD stays finite.

Shapes: ``B`` rows, ``L`` sequence length, ``R`` response length, ``H`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import functools

import torch

from rlhfkit.algos import token_divergence
from rlhfkit.algos.distill import FULL_DIVERGENCES
from rlhfkit.models.head_chunks import (
    checkpointed_chunks,
    chunk_size,
    head_autocast,
    head_logits,
    head_transform,
    response_hidden,
)
from rlhfkit.models.readout import hf_model, response_forward
from rlhfkit.models.sampling import Sampling, processed_logits


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
) -> torch.Tensor:
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
    Returns:
        (B, R) float32 with R = L - p0; padding positions hold a value too (mask them).
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
    divergence = functools.partial(_divergence, sampling, loss, beta)
    s_transform, t_transform = head_transform(student), head_transform(teacher)
    if s_transform is None or t_transform is None:
        return _plain_divergence(
            student, teacher, input_ids, attention_mask, start, labels, divergence, chunk_tokens
        )
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
    parts = checkpointed_chunks(read, flat, chunk_size(vocab, chunk_tokens), recorded)
    return torch.cat(parts).view(labels.shape)


def _divergence(sampling, loss, beta, s_logits, t_logits, labels) -> torch.Tensor:
    """token_divergence of the processed logits (n, V) and (n, V) of one chunk, labels (n,) -> (n,)."""
    s = processed_logits(s_logits[None], sampling, labels[None])[0]  # (n, V) float32
    t = processed_logits(t_logits[None], sampling, labels[None])[0]
    return token_divergence(s, t, loss, beta)


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
    and without grad; the divergence a checkpointed chunk of positions at a time."""
    with torch.no_grad():
        t_logits, _ = response_forward(teacher, input_ids, attention_mask, start)  # (B, R, V)
    s_logits, _ = response_forward(student, input_ids, attention_mask, start)  # (B, R, V)
    recorded = torch.is_grad_enabled() and s_logits.requires_grad
    flat = (s_logits.flatten(0, 1), t_logits.flatten(0, 1), labels.reshape(-1))  # (B R, V), (B R, V), (B R,)
    parts = checkpointed_chunks(divergence, flat, chunk_size(s_logits.shape[-1], chunk_tokens), recorded)
    return torch.cat(parts).view(labels.shape)
