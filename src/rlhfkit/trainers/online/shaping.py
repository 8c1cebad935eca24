"""Stages 3 and 4 of the online loop: the KL-shaped rewards (:func:`shape_rollout`, with a process reward
model's step rewards, :mod:`rlhfkit.rollout.process_rewards`, ``online.process_reward_model``) and the
advantages (:func:`estimate_advantages`), with the degenerate-group counts of a critic-free rollout
(:mod:`rlhfkit.algos.groups`)."""

from __future__ import annotations

import torch

from rlhfkit.algos import ADVANTAGE_ESTIMATORS, sampled_reverse_kl, shape_rewards
from rlhfkit.algos.groups import group_counts
from rlhfkit.rollout.process_rewards import outcome_and_steps, process_rewards, step_ends
from rlhfkit.trainers.online.context import OnlineContext, StatSums, input_mask, model_inputs
from rlhfkit.trainers.online.layout import teacher_in_rewards
from rlhfkit.types import Rollout


def with_process_rewards(ctx: OnlineContext, rollout: Rollout) -> tuple[torch.Tensor, StatSums]:
    """The scores for ``shape_rewards``: ``rollout.scores`` (B,) without a PRM; with one, (B, T): the outcome
    score on the last trained token plus the PRM's step rewards on the step-end tokens
    (:mod:`rlhfkit.rollout.process_rewards`; the PRM reads what the policy reads, :func:`input_mask`: a tool
    episode's whole row, its step ends the model's tokens), with ``score/process_mean`` (per response) and
    ``score/process_steps`` (step ends per response)."""
    s = StatSums(ctx.device)
    if ctx.process_reward_model is None:
        return rollout.scores, s
    # the step ends are the model's tokens; the PRM reads the row as the policy does (a tool episode's results
    # and template text too, so later tokens sit at their positions in the row)
    ends = step_ends(rollout.response_ids, rollout.mask, ctx.step_end_table)  # (B, T)
    reads = input_mask(rollout)  # (B, T)
    size = ctx.cfg.online.rollout_batch_size or rollout.batch_size
    dense = torch.zeros(rollout.mask.shape, device=rollout.mask.device)
    for i in range(0, rollout.batch_size, size):
        rows = slice(i, i + size)
        ids, attn, start, w = model_inputs(
            rollout.query_ids[rows], rollout.query_mask[rows], rollout.response_ids[rows], reads[rows]
        )
        dense[rows, :w] = process_rewards(ctx.process_reward_model, ids, attn, start, ends[rows, :w])
    kept = rollout.mask.any(1).sum()
    s.add_sum("score/process_mean", dense.double().sum(), kept)
    s.add_sum("score/process_steps", ends.sum(), kept)
    return outcome_and_steps(rollout.scores, dense, rollout.mask), s


def shape_rollout(
    ctx: OnlineContext, rollout: Rollout, kl_coef: float, teacher_metric: bool = True
) -> StatSums:
    """Stage 3: ``rollout.rewards`` and ``rollout.kl`` from ``shape_rewards``: ``-kl_coef * kl_t`` on every
    token (0 under ``online.kl_in_loss``: the KL is then a loss term), the score on the last real token and a
    process reward model's step rewards on the step-end tokens (:func:`with_process_rewards`); with a
    distillation teacher, ``-teacher_coef * (log pi(y_t) - log pi_teacher(y_t))`` on every token too
    (:func:`~rlhfkit.trainers.online.layout.teacher_in_rewards`), its mean logged as ``distill/teacher_kl``
    (nats per token; with ``teacher_metric=False`` not here: the update's own forward gives the log-probs, and
    :func:`teacher_stats` logs it after). Returns the PRM's and the teacher's statistics (none without them)."""
    online = ctx.cfg.online
    shaped, stats = with_process_rewards(ctx, rollout)
    rollout.rewards, rollout.kl = shape_rewards(
        shaped,
        rollout.logprobs,
        rollout.ref_logprobs,
        rollout.mask,
        0.0 if online.kl_in_loss else kl_coef,
        online.kl_estimator,
    )
    # on-policy distillation: the teacher in the reference's place
    in_rewards = teacher_in_rewards(ctx.cfg)
    if rollout.teacher_logprobs is not None and (teacher_metric or in_rewards):
        term = sampled_reverse_kl(rollout.logprobs, rollout.teacher_logprobs, rollout.mask)  # (B, T)
        if teacher_metric:
            stats.merge(teacher_stats(rollout, term))
        if in_rewards:
            rollout.rewards = rollout.rewards - online.teacher_coef * term
    return stats


def teacher_stats(rollout: Rollout, term: torch.Tensor | None = None) -> StatSums:
    """``distill/teacher_kl``: the mean of ``log pi(y_t) - log pi_teacher(y_t)`` over the rollout's valid tokens
    (nothing without a teacher); ``term``: that (B, T) term where the caller has it already."""
    s = StatSums(rollout.mask.device)
    if rollout.teacher_logprobs is not None:
        if term is None:
            term = sampled_reverse_kl(rollout.logprobs, rollout.teacher_logprobs, rollout.mask)  # (B, T)
        s.add_sum("distill/teacher_kl", term.double().sum(), rollout.mask.sum())
    return s


def measured_kl(ctx: OnlineContext, rollout: Rollout) -> torch.Tensor:
    """(B, T) the per-token KL estimate ``online.kl_estimator`` of the rollout's log-probs to the reference's,
    0 at masked positions: what :func:`shape_rollout` puts in ``rollout.kl``, for when the old log-probs come
    from the update's own forward (:func:`rlhfkit.trainers.online.layout.old_logprobs_from_update`), and for
    held-out evaluation (no score needed)."""
    zeros = torch.zeros(rollout.mask.shape[0], device=rollout.mask.device)
    return shape_rewards(
        zeros, rollout.logprobs, rollout.ref_logprobs, rollout.mask, 0.0, ctx.cfg.online.kl_estimator
    )[1]


def estimate_advantages(ctx: OnlineContext, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """``ADVANTAGE_ESTIMATORS[online.advantage_estimator]`` on the shaped rewards: (advantages, returns), (B, T).

    A fully masked response (``missing_eos=mask``) is put in a group of its own, so that it neither gets an
    advantage nor shifts its group's baseline (grpo / rloo).
    """
    online = ctx.cfg.online
    first, _, _ = ctx.rows()
    rows = first + torch.arange(
        rollout.batch_size, device=rollout.group_ids.device
    )  # (B,) global row numbers
    group_ids = torch.where(
        rollout.mask.any(1), rollout.group_ids, -1 - rows
    )  # (B,); -1 - row: distinct, alone
    if online.advantage_estimator in ("grpo", "rloo"):
        check_groups_on_one_process(ctx, group_ids)
    # Each estimator defines its own normalisation (algos.ADVANTAGE_ESTIMATORS): whitening over the batch
    # for gae and reinforce_pp (all processes: all_sum), the group std for grpo, none for rloo.
    return ADVANTAGE_ESTIMATORS[online.advantage_estimator](
        rollout.rewards,
        rollout.mask,
        rollout.values,
        group_ids,
        gamma=online.gamma,
        lam=online.lam,
        norm_by_std=online.normalize_advantages,
        eps=online.advantage_eps,
        all_sum=ctx.all_sum,
    )


def check_groups_on_one_process(ctx: OnlineContext, group_ids: torch.Tensor) -> None:
    """RuntimeError if a group id (a prompt's position in the rollout) is held by two processes: grpo and rloo
    compute each group's statistics where it is, so a split group would get two baselines. One all-reduce
    of a (batch_size,) count; nothing to check on one process."""
    if ctx.accelerator.num_processes == 1:
        return
    ids = group_ids[group_ids >= 0].unique()
    held = torch.zeros(ctx.cfg.train.batch_size, device=ctx.device)
    held[ids.to(ctx.device)] = 1.0
    split = (ctx.all_sum(held) > 1).nonzero().flatten().tolist()
    if split:
        raise RuntimeError(
            f"the groups of prompts {split[:5]} are split between processes; each group's "
            "responses must be on one process (rlhfkit.trainers.online.collect.prompt_batch)"
        )


def group_stats(ctx: OnlineContext, rollout: Rollout) -> StatSums:
    """``groups/*_fraction`` of a grpo / rloo rollout (:mod:`rlhfkit.algos.groups`); nothing otherwise."""
    s = StatSums(ctx.device)
    if ctx.cfg.online.advantage_estimator in ("grpo", "rloo"):
        counts = group_counts(rollout.scores, rollout.group_ids, rollout.mask.any(1))
        for name in ("zero_std", "singleton", "partial", "empty"):
            s.add_sum(f"groups/{name}_fraction", counts[name], counts["groups"])
    return s
