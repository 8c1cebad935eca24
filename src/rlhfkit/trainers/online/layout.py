"""Which rows of a rollout go through the model together: the minibatches of each PPO epoch and, inside
each, the micro-batches of the forwards (:func:`micro_batches`).

The layout is a stateless function of (seed, step, epoch, the rows' lengths), so stage 1 (the old log-probs,
reference log-probs and values, :mod:`rlhfkit.trainers.online.collect`) and the first epoch of stage 5 (the
update, :mod:`rlhfkit.trainers.online.ppo_update`) run the very same forwards: the same rows, in the same
order, cut to the same columns. In bf16 a matrix product's rounding depends on its shapes, so any other
layout makes the first ratio differ from 1 by up to ~1e-3 on a tiny model (docs/design.md, "Models").

Inside a minibatch the rows are sorted by length before they are cut into micro-batches, so that trimming
the columns no row of a micro-batch uses (:func:`rlhfkit.trainers.online.context.model_inputs`) removes most
padding. With groups (``online.group_size`` G > 1 and a critic-free estimator: :func:`group_layout`) the
permutation and the sort move whole groups (a group sorts by its longest row), so a micro-batch holds the G
rows of a prompt together and its forwards read that prompt once (:mod:`rlhfkit.models.prompt_cache`). A
minibatch's rows and its loss normaliser are unchanged by the order (the loss of every micro-batch is divided
by the whole minibatch's normaliser), so the gradient changes by float rounding only; which rows a process
holds is unchanged too (docs/design.md, "Data parallelism").

Shapes: ``B`` responses of this process.
"""

from __future__ import annotations

import torch

from rlhfkit.models.readout import hf_model
from rlhfkit.trainers.online.context import OnlineContext, derived_seed


def minibatch_order(
    n: int, seed: int, step: int, epoch: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A permutation of ``n`` rows, a stateless function of (seed, step, epoch): resume needs no sampler state."""
    g = torch.Generator().manual_seed(derived_seed("minibatches", seed, step, epoch))
    return torch.randperm(n, generator=g).to(device)


def group_layout(ctx: OnlineContext) -> int:
    """G when the layout moves whole groups of G rows (the group estimators: grpo, rloo, reinforce_pp, with
    ``online.group_size`` > 1), else 1: rows. GAE (PPO) keeps the row layout, whose minibatches hold rows
    of every group."""
    online = ctx.cfg.online
    return online.group_size if online.advantage_estimator != "gae" else 1


def local_minibatches(ctx: OnlineContext, step: int, epoch: int) -> list[torch.Tensor]:
    """This process's rows (local indices) of each of the epoch's ``online.num_minibatches`` minibatches.

    The minibatches are cut from ONE permutation of the whole rollout's rows (all processes), so that N
    processes train on the minibatches one process would; each takes the rows it holds, in that order. A
    process may hold more rows of one minibatch than of another, or none (see
    :func:`rlhfkit.trainers.online.ppo_update.ppo_update`).
    """
    first, local, total = ctx.rows()
    g = group_layout(ctx)
    if g > 1 and total % g == 0:  # whole groups: a group's rows stay together (their prompt is read once)
        groups = minibatch_order(total // g, ctx.cfg.seed, step, epoch, ctx.device)
        order = (groups[:, None] * g + torch.arange(g, device=ctx.device)).flatten()
    else:
        order = minibatch_order(total, ctx.cfg.seed, step, epoch, ctx.device)
    size = total // ctx.cfg.online.num_minibatches
    out = []
    for k in range(ctx.cfg.online.num_minibatches):
        rows = order[k * size : (k + 1) * size]
        out.append(rows[(rows >= first) & (rows < first + local)] - first)
    return out


def row_lengths(query_mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Real tokens of each row, prompt and response: (B,) long, from (B, P) and (B, T) masks."""
    return query_mask.long().sum(1) + response_mask.long().sum(1)


ACTIVATION_BUDGET_BYTES = (
    2 * 2**30
)  # estimated activations of one micro-batch under the default micro_batch_size


def activation_bytes_per_token(config, sequence: int, logits: bool = True) -> int:
    """Estimated bytes one token of a training forward holds for its backward: per layer 34 h + 5 a s (16-bit
    activations, no recomputation: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", eq. 1, divided by s b), plus, with ``logits``, the float32 logits, their log-softmax
    and its gradient (12 V). It errs high: fused kernels and bf16 autocast hold less.

    Args:
        config: the model's transformers config (``hidden_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``vocab_size``).
        sequence: s, the tokens of a row (prompt + response).
        logits: the model reads out the vocabulary (the actor); a critic's scalar head does not.
    """
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    read_out = 12 * int(config.vocab_size) if logits else 0
    return layers * (34 * hidden + 5 * heads * sequence) + read_out


def default_micro_batch(ctx: OnlineContext, minibatch_rows: int) -> int:
    """Rows per forward / backward when ``train.micro_batch_size`` is unset: as many rows of the longest
    possible sequence (``data.max_prompt_length`` + ``online.response_length``, the same on every process, plus
    the tokens tools add to a prompt) as
    fit :data:`ACTIVATION_BUDGET_BYTES` of :func:`activation_bytes_per_token`, at least 1 and at most the
    minibatch (a small model takes its whole minibatch in one forward, as before). With a critic (PPO's
    ``gae``), the actor's and the critic's forwards make one loss and one backward, so a row holds both
    models' activations."""
    sequence = ctx.cfg.data.max_prompt_length + ctx.cfg.online.response_length
    if ctx.episodes is not None:  # an episode's prompt also holds what the tools add to it
        sequence += ctx.episodes.prompt_limit() - ctx.cfg.data.max_prompt_length
    per_token = activation_bytes_per_token(hf_model(ctx.roles.actor).config, sequence)
    if ctx.roles.critic is not None:
        per_token += activation_bytes_per_token(hf_model(ctx.roles.critic).config, sequence, logits=False)
    per_row = sequence * per_token
    return max(1, min(minibatch_rows, ACTIVATION_BUDGET_BYTES // per_row))


def micro_batches(
    ctx: OnlineContext, step: int, epoch: int, lengths: torch.Tensor
) -> list[list[torch.Tensor]]:
    """The micro-batches of each minibatch of ``epoch`` of rollout ``step``: local row indices.

    Each minibatch of :func:`local_minibatches` is sorted by ``lengths`` (stable, so ties keep the shuffled
    order) and cut into ``train.micro_batch_size`` rows (default: :func:`default_micro_batch`).

    Args:
        lengths: (B,) the length of each local row (:func:`row_lengths`).
    Returns:
        one list per minibatch (possibly empty: this process holds no row of it) of (b,) long tensors.
    """
    first, local, total = ctx.rows()
    micro = ctx.cfg.train.micro_batch_size or default_micro_batch(
        ctx, local // ctx.cfg.online.num_minibatches
    )
    g = group_layout(ctx)
    if g > 1 and first % g == 0 and local % g == 0:  # sort whole groups, by their longest row
        lengths = lengths.view(-1, g).amax(1).repeat_interleave(g)
    out = []
    for rows in local_minibatches(ctx, step, epoch):
        rows = rows[torch.argsort(lengths[rows], stable=True)]
        out.append(list(rows.split(max(micro, 1))) if rows.numel() else [])  # split([]) is [[]]
    return out


def old_logprobs_from_update(ctx: OnlineContext, step: int) -> bool:
    """Whether rollout ``step`` takes its old log-probs (and logged entropies) from the update's own forward.

    With one PPO epoch of one minibatch the old log-probs are the log-probs of the update's first (and only)
    forward, so that forward can give them, detached: the ratio is 1 by construction and the separate no-grad
    forward of the actor is saved (``online.old_logprobs_from_update``). Only where nothing reads them before
    the update: the per-token rewards do not (the KL is in the loss, or kl_coef is 0 with no adaptive
    target, and no distillation teacher), the engine's log-prob gap and rollout correction do not (generation_backend=hf), and the actor
    is trained this rollout (not during the critic warm-up); never with ``online.max_staleness`` > 0, whose old
    log-probs are the ones the samples were drawn with (:mod:`rlhfkit.trainers.online.async_loop`).
    """
    online = ctx.cfg.online
    return bool(
        online.old_logprobs_from_update
        and online.ppo_epochs == 1
        and online.num_minibatches == 1
        and (online.kl_in_loss or (online.kl_coef == 0 and online.kl_target is None))
        and not online.teacher_model  # the teacher's term (and its metric) reads them at stage 3
        and not online.max_staleness  # asynchronous: they are the behaviour policy's, sampled elsewhere
        and ctx.engine is None
        and step > online.critic_warmup_steps
        and "actor" in ctx.trained
    )


def teacher_in_rewards(cfg) -> bool:
    """Whether a distillation teacher's sampled term -teacher_coef * (log pi - log pi_teacher) goes into the
    per-token rewards: with ``online.teacher_model``, in every kind but `train distill` with a full-vocabulary
    ``distill.loss`` (full_reverse_kl, jsd), which is a loss term of the update instead."""
    if not cfg.online.teacher_model:
        return False
    return cfg.kind != "distill" or cfg.distill.loss == "reverse_kl"


def reads_reference(cfg) -> bool:
    """Whether stage 1 reads the reference's log-probs: always but in `train distill` with no KL to it (kl_coef
    0, no adaptive target, not in the loss: the kind's default), where nothing uses them. There the rollout's
    ``ref_logprobs`` are the actor's own (a KL of exactly 0 in the rewards) and no ``kl/*`` is logged; one
    forward of the policy per rollout is saved (TRL's distillation reads no reference either)."""
    online = cfg.online
    unused = online.kl_coef == 0 and online.kl_target is None and not online.kl_in_loss
    return not (cfg.kind == "distill" and unused)
