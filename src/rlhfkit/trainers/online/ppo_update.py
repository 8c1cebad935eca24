"""Stage 5 of the online loop: PPO epochs over shuffled minibatches of the rollout, one optimizer step per
minibatch and role, gradients accumulated over micro-batches (:func:`ppo_update`).

The minibatches are cut from one permutation of the whole rollout (all processes), a stateless function of
(seed, rollout, epoch) (:func:`rlhfkit.trainers.online.layout.local_minibatches`), so N processes take the optimizer steps one process takes
and resuming needs no sampler state. The training forwards go through the accelerate-prepared models (DDP
synchronises gradients).

Shapes: ``B`` responses of this process, ``T`` response length, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from rlhfkit.algos import (
    aggregate_loss,
    kl_penalty_loss,
    loss_normalizer,
    ppo_policy_loss,
    tis_weights,
    value_loss,
)
from rlhfkit.algos.masked import fill_masked
from rlhfkit.engine import sharded
from rlhfkit.engine.accel import dp_scale
from rlhfkit.models import response_readout, set_update_mode
from rlhfkit.models.distill_readout import teacher_divergence
from rlhfkit.models.head_chunks import Readout
from rlhfkit.trainers.online.context import OnlineContext, StatSums, critic_values, input_mask, model_inputs
from rlhfkit.trainers.online.layout import (
    micro_batches,
    old_logprobs_from_update,
    row_lengths,
    teacher_in_rewards,
    teacher_read_in_update,
)
from rlhfkit.trainers.online.sharding import micro_batch_passes
from rlhfkit.types import Rollout


@dataclass
class UpdateResult:
    """What :func:`ppo_update` reports: its statistics, not yet summed over processes (the loop sums them
    together with the rollout's, in one all-reduce), the count of skipped minibatches and, per epoch, the
    largest |logprobs - old_logprobs| on that epoch's first minibatch over all processes (0 before any
    update: dropout, padding or chunking would break that — huggingface/trl#454, CarperAI/trlx#107)."""

    stats: StatSums
    skipped_minibatches: int = 0
    first_minibatch_logprob_diff: list[float] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """What goes into ``metrics.jsonl`` beside the summed statistics."""
        out: dict[str, float] = {"update/skipped_minibatches": self.skipped_minibatches}
        if self.first_minibatch_logprob_diff:
            out["ratio/first_minibatch_max_logprob_diff"] = self.first_minibatch_logprob_diff[0]
        return out


def ppo_update(ctx: OnlineContext, rollout: Rollout, step: int, train_actor: bool = True) -> UpdateResult:
    """Stage 5: ``online.ppo_epochs`` passes over ``rollout`` in ``online.num_minibatches`` shuffled minibatches.

    Each minibatch is one optimizer step of the actor and of the critic, accumulated over micro-batches
    of ``train.micro_batch_size`` responses; every loss is ``aggregate_loss`` with the WHOLE minibatch's
    normaliser (summed over processes), so neither the micro-batch size nor the process count changes
    the gradient (huggingface/transformers PR #34191; huggingface/trl#3021). The minibatches are those of the whole rollout
    (:func:`rlhfkit.trainers.online.layout.local_minibatches`): N processes take the optimizer steps one process takes. A process that holds
    no row of a minibatch still joins the gradient all-reduce, with a zero-weighted backward pass. A
    minibatch without a valid token (every response masked out) is skipped: no optimizer step, so the
    parameters do not move. ``train_actor=False`` (critic warm-up) trains the critic alone.

    Args:
        rollout: with ``advantages``, ``returns`` and (critic) ``values`` filled in; this process's rows.
        step: the rollout's number (seeds the minibatch order).
    """
    online = ctx.cfg.online
    names = [name for name in ("actor", "critic") if name in ctx.trained and (name != "actor" or train_actor)]
    for name in names:  # the forwards of the rollout, whose outputs are the old log-probs and values
        set_update_mode(ctx.trained[name], dropout=not ctx.cfg.model.disable_dropout)
    result, diffs = UpdateResult(StatSums(ctx.device)), []
    lengths = row_lengths(rollout.query_mask, input_mask(rollout))
    # one epoch of one minibatch: the old log-probs are this forward's own, written back into the rollout
    fused = train_actor and old_logprobs_from_update(ctx, step)
    for epoch in range(online.ppo_epochs):
        epoch_stats = StatSums(ctx.device)  # the micro-batches' token-weighted figures of this epoch
        # the layout of stage 1's forwards in epoch 0 (rlhfkit.trainers.online.layout): length-sorted micro-batches
        for k, micros in enumerate(micro_batches(ctx, step, epoch, lengths)):
            minibatch = rollout.select(
                torch.cat(micros) if micros else torch.zeros(0, dtype=torch.long, device=ctx.device)
            )
            normalizer = float(ctx.all_sum(loss_normalizer(minibatch.mask, online.loss_agg_mode)))
            if normalizer == 0:
                result.skipped_minibatches += 1
                continue
            tokens = float(ctx.all_sum(minibatch.mask.sum())) if ctx.router_aux_coef else 0.0
            losses: dict[str, torch.Tensor] = {}
            first_diff = torch.zeros((), dtype=torch.float64, device=ctx.device)
            starts = micro_batch_passes(ctx, micros)  # None: a pass with no row of this process
            for j, rows in enumerate(starts):
                with _no_sync(ctx, names, last=j == len(starts) - 1):
                    if rows is None:  # the same all-reduce as the others, adding nothing to the gradient
                        ignored = StatSums(ctx.device)
                        loss, parts, _ = micro_batch_loss(
                            ctx, rollout.select(slice(0, 1)), normalizer, ignored, train_actor, tokens
                        )
                        ctx.accelerator.backward(loss * 0.0)
                        parts = {
                            key: value * 0.0 for key, value in parts.items()
                        }  # nothing of the loss either
                        for key in ignored.sums:  # the same statistics on every process, weighing nothing
                            epoch_stats.add_sum(key, 0.0, 0.0)
                    else:
                        read: dict[str, torch.Tensor] | None = {} if fused else None
                        loss, parts, diff = micro_batch_loss(
                            ctx,
                            rollout.select(rows),
                            normalizer,
                            epoch_stats,
                            train_actor,
                            tokens,
                            read=read,
                        )
                        if read:
                            w = read["logprobs"].shape[1]
                            rollout.logprobs[rows, :w] = read["logprobs"]
                            rollout.entropy[rows, :w] = read["entropy"]
                            if "teacher_logprobs" in read:  # read with the student's (layout)
                                rollout.teacher_logprobs[rows, :w] = read["teacher_logprobs"]
                        ctx.accelerator.backward(loss * dp_scale(ctx.accelerator))
                        first_diff = torch.maximum(first_diff, diff.double())
                for key, value in parts.items():
                    losses[key] = losses.get(key, 0.0) + value.detach()
            for key, value in losses.items():  # each process holds a part of the minibatch's loss
                result.stats.add_sum(key, value, 1.0 / ctx.accelerator.num_processes)
            if k == 0 and train_actor:
                diffs.append(first_diff)
            for name in names:
                _optimizer_step(ctx, name, result.stats)
        if online.epoch_stats:  # the drift from pi_old epoch by epoch (the sums over epochs are kept as well)
            for key in ("clipfrac", "approx_kl"):
                if key in epoch_stats.sums:
                    result.stats.sums[f"{key}/epoch{epoch + 1}"] = epoch_stats.sums[key]
        result.stats.merge(epoch_stats)
    if diffs:
        result.first_minibatch_logprob_diff = _all_max(ctx, torch.stack(diffs)).tolist()
    return result


def micro_batch_loss(
    ctx: OnlineContext,
    mb: Rollout,
    normalizer: float,
    stats: StatSums,
    train_actor: bool,
    minibatch_tokens: float = 0.0,
    read: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The loss of one micro-batch, already divided by the whole minibatch's ``normalizer``.

    ``vf_coef * value loss + policy loss - ent_coef * entropy``, each per-token loss from
    :mod:`rlhfkit.algos` and aggregated by ``aggregate_loss``, plus, for a mixture-of-experts actor,
    ``router_aux_coef`` times its router load-balancing loss weighted by the micro-batch's share of the
    ``minibatch_tokens`` (all processes); with `train distill` and a full-vocabulary ``distill.loss``,
    ``teacher_coef`` times the divergence from the teacher at every sampled position
    (:func:`rlhfkit.models.distill_readout.teacher_divergence`: ``loss/distill``). The logits are computed once
    and serve the log-probs (under ``ctx.sampling``, as at sampling time) and the entropy. Token-weighted
    statistics go to ``stats``.

    With ``read`` (a dict; :func:`~rlhfkit.trainers.online.layout.old_logprobs_from_update`) the old
    log-probs are this forward's own, detached (the ratio is exactly 1 and its gradient is that of the log-
    probs), and ``read["logprobs"]``, ``read["entropy"]`` receive them, (b, w), 0 at masked positions; where
    this forward reads the teacher too (:func:`~rlhfkit.trainers.online.layout.teacher_read_in_update`: one
    pass of the student gives its log-probs and the divergence), ``read["teacher_logprobs"]`` as well.

    Returns:
        (loss: a scalar to backpropagate; parts: ``loss/policy``, ``loss/value``, ``loss/entropy``, each
        aggregated like the loss; the largest |logprobs - old_logprobs| at a valid token).
    """
    online = ctx.cfg.online
    ids, attn, start, w = model_inputs(mb.query_ids, mb.query_mask, mb.response_ids, input_mask(mb))
    mask = mb.mask[:, :w]  # (b, w)
    tokens = mask.sum()

    def aggregate(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(
            per_token, mask, online.loss_agg_mode, normalizer, max_length=online.response_length
        )

    loss = torch.zeros((), device=ctx.device)
    parts: dict[str, torch.Tensor] = {}
    diff = torch.zeros((), device=ctx.device)
    if train_actor:
        # `train distill`'s full-vocabulary term (b, w), gradient through the student only
        read_teacher = functools.partial(
            teacher_divergence,
            ctx.trained["actor"],
            ctx.roles.teacher,
            ids,
            attn,
            start,
            ctx.sampling,
            ctx.cfg.distill.loss,
            ctx.cfg.distill.jsd_beta,
        )
        divergence = None  # read here when this pass reads the teacher too
        if read is not None and teacher_read_in_update(ctx):  # the student once for both (layout)
            # the log-probs take a gradient only where a loss has one through them: with every advantage 0 (`train
            # distill` without a score) the policy loss adds exactly 0 to the gradient
            moving = bool(fill_masked(mb.advantages[:, :w], mask).ne(0).any())
            both = read_teacher(
                readout=True, entropy_grad=online.ent_coef > 0, logprob_grad=moving or online.kl_in_loss
            )
            divergence, read["teacher_logprobs"] = both.divergence, fill_masked(both.teacher_logprobs, mask)
            readout = Readout(both.logprobs, both.entropy, None)
        else:
            readout = response_readout(  # the kernels and chunks of stage 1's no-grad read-out
                ctx.trained["actor"],
                ids,
                attn,
                start,
                ctx.sampling,
                entropy=online.ent_coef > 0 or read is not None,
                entropy_grad=online.ent_coef > 0,  # else a metric (and the rollout's, when read): no graph
                router_aux=ctx.router_aux_coef > 0,
                share_prompts=online.group_size > 1,
            )
        logprobs, aux = readout.logprobs, readout.aux_loss  # (b, w)
        old = mb.logprobs[:, :w] if read is None else logprobs.detach()
        if read is not None:
            read["logprobs"] = fill_masked(old, mask)
            read["entropy"] = fill_masked(readout.entropy.detach(), mask)
        per_token, pg = ppo_policy_loss(
            logprobs,
            old,
            mb.advantages[:, :w],
            online.clip_eps,
            clip_eps_high=online.clip_eps_high,
            dual_clip=online.dual_clip,
            mask=mask,
            importance_sampling_level=online.importance_sampling_level,
        )
        if online.rollout_correction == "tis":  # the engine sampled, not pi_old: Yao et al. 2025 (algos)
            per_token = per_token * tis_weights(
                old, mb.engine_logprobs[:, :w], mask, online.rollout_correction_cap
            )
        parts["loss/policy"] = aggregate(per_token)
        loss = loss + parts["loss/policy"]
        diff = fill_masked((logprobs.detach() - old).abs(), mask).max()
        for name, value in pg.items():  # clipfrac (and its low / high / dual parts), approx_kl, ratio/mean
            stats.add(name, value, tokens)
        if online.ent_coef > 0:
            parts["loss/entropy"] = aggregate(readout.entropy)
            loss = loss - online.ent_coef * parts["loss/entropy"]
        if (
            online.kl_in_loss
        ):  # DeepSeekMath's GRPO: the KL to the reference as a loss term, not in the reward
            kl = kl_penalty_loss(  # (b, w); its gradient is that of KL(pi || pi_ref) in every epoch
                logprobs,
                mb.ref_logprobs[:, :w],
                estimator=online.kl_loss_estimator,
                old_logprobs=old,
                mask=mask,
            )
            parts["loss/kl"] = aggregate(kl)
            loss = loss + float(ctx.kl_ctl.value) * parts["loss/kl"]
        if ctx.roles.teacher is not None and not teacher_in_rewards(ctx.cfg):
            # `train distill` with distill.loss full_reverse_kl / jsd: the divergence from the teacher over the
            # whole vocabulary at every sampled position, both heads a chunk of positions at a time
            if divergence is None:  # else read with the student's log-probs above
                divergence = read_teacher()
            parts["loss/distill"] = aggregate(fill_masked(divergence, mask))
            loss = loss + online.teacher_coef * parts["loss/distill"]
        if aux is not None:
            parts["loss/router_aux"] = aux * (float(tokens) / max(minibatch_tokens, 1.0))
            loss = loss + ctx.router_aux_coef * parts["loss/router_aux"]
    if "critic" in ctx.trained:
        values = critic_values(ctx.trained["critic"], ids, attn, start)  # (b, w)
        per_token, vf = value_loss(
            values, mb.values[:, :w], mb.returns[:, :w], online.value_clip_eps, mask=mask
        )
        parts["loss/value"] = aggregate(per_token)
        loss = loss + online.vf_coef * parts["loss/value"]
        stats.add("value/clipfrac", vf["clipfrac"], tokens)
    return loss, parts, diff


def _optimizer_step(ctx: OnlineContext, name: str, stats: StatSums) -> None:
    """Clip the gradient of role ``name`` (``train.max_grad_norm``), step its optimizer, zero its gradient."""
    model, optimizer = ctx.trained[name], ctx.optimizers[name]
    if ctx.cfg.train.max_grad_norm is not None and sharded.is_sharded(model):  # every process's shards
        norm = sharded.clip_grad_norm(model, ctx.cfg.train.max_grad_norm)
        stats.add(f"grad_norm/{name}", norm, 1.0 / ctx.accelerator.num_processes)
    elif ctx.cfg.train.max_grad_norm is not None:
        norm = ctx.accelerator.clip_grad_norm_(model.parameters(), ctx.cfg.train.max_grad_norm)
        stats.add(f"grad_norm/{name}", norm, 1.0 / ctx.accelerator.num_processes)  # the same on every process
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _no_sync(ctx: OnlineContext, names: list[str], last: bool):
    """No gradient all-reduce until the last micro-batch of a minibatch (data parallel only)."""
    stack = contextlib.ExitStack()
    if not last and ctx.accelerator.num_processes > 1:
        for name in names:
            stack.enter_context(ctx.accelerator.no_sync(ctx.trained[name]))
    return stack


def _all_max(ctx: OnlineContext, values: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over processes (one all-reduce)."""
    values = values.detach().to(ctx.device).clone()
    if ctx.accelerator.num_processes > 1:
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return values
