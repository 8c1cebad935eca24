"""Two additions to the online loop's stages 3 and 4, kept beside it: a process reward model's step rewards
(:mod:`rlhfkit.rollout.process_rewards`, ``online.process_reward_model``) and the degenerate-group counts of a
critic-free rollout (:mod:`rlhfkit.algos.groups`)."""

from __future__ import annotations

import torch

from rlhfkit.algos.groups import group_counts
from rlhfkit.data import TokenLimits
from rlhfkit.models import load_scalar_model
from rlhfkit.rollout.process_rewards import outcome_and_steps, process_rewards, step_end_table, step_ends
from rlhfkit.trainers.online_roles import check_same_vocabulary
from rlhfkit.trainers.online_steps import OnlineContext, StatSums, model_inputs
from rlhfkit.types import Rollout


def load_process_reward_model(cfg, tokenizer, device) -> tuple[torch.nn.Module | None, torch.Tensor | None]:
    """The frozen PRM of ``online.process_reward_model`` and its step-end table (None, None without one)."""
    path = cfg.online.process_reward_model
    if not path:
        return None, None
    check_same_vocabulary(tokenizer, path, "online.process_reward_model", cfg.model.trust_remote_code)
    model = load_scalar_model(
        path,
        frozen=True,
        trust_remote_code=cfg.model.trust_remote_code,
        dtype=cfg.model.dtype,
        tokenizer=tokenizer,
    ).to(device)
    model.eval().requires_grad_(False)
    return model, step_end_table(tokenizer, TokenLimits().step_separator)


def with_process_rewards(ctx: OnlineContext, rollout: Rollout) -> tuple[torch.Tensor, StatSums]:
    """The scores for ``shape_rewards``: ``rollout.scores`` (B,) without a PRM; with one, (B, T): the outcome
    score on the last trained token plus the PRM's step rewards on the step-end tokens
    (:mod:`rlhfkit.rollout.process_rewards`), with ``score/process_mean`` (per response) and
    ``score/process_steps`` (step ends per response)."""
    s = StatSums(ctx.device)
    if ctx.process_reward_model is None:
        return rollout.scores, s
    ends = step_ends(rollout.response_ids, rollout.mask, ctx.step_end_table)  # (B, T)
    size = ctx.cfg.online.rollout_batch_size or rollout.batch_size
    dense = torch.zeros(rollout.mask.shape, device=rollout.mask.device)
    for i in range(0, rollout.batch_size, size):
        rows = slice(i, i + size)
        ids, attn, start, w = model_inputs(
            rollout.query_ids[rows], rollout.query_mask[rows], rollout.response_ids[rows], rollout.mask[rows]
        )
        dense[rows, :w] = process_rewards(ctx.process_reward_model, ids, attn, start, ends[rows, :w])
    kept = rollout.mask.any(1).sum()
    s.add_sum("score/process_mean", dense.double().sum(), kept)
    s.add_sum("score/process_steps", ends.sum(), kept)
    return outcome_and_steps(rollout.scores, dense, rollout.mask), s


def group_stats(ctx: OnlineContext, rollout: Rollout) -> StatSums:
    """``groups/*_fraction`` of a grpo / rloo rollout (:mod:`rlhfkit.algos.groups`); nothing otherwise."""
    s = StatSums(ctx.device)
    if ctx.cfg.online.advantage_estimator in ("grpo", "rloo"):
        counts = group_counts(rollout.scores, rollout.group_ids, rollout.mask.any(1))
        for name in ("zero_std", "singleton", "partial", "empty"):
            s.add_sum(f"groups/{name}_fraction", counts[name], counts["groups"])
    return s
