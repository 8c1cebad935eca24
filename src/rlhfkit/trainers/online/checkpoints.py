"""Checkpoints of the online loop: actor, critic (and a refreshed reward model), optimizers, schedules, the KL
controller, the non-finite guard and RNG states (:func:`save`, :func:`resume_state`), and the checkpoint taken
when a reward function fails (:func:`score_or_stop`), so that ``--resume`` continues once it is fixed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhfkit.engine import sharded
from rlhfkit.engine.checkpoint import load_checkpoint, save_checkpoint
from rlhfkit.engine.folder import RunDir
from rlhfkit.engine.seed import set_rng_state
from rlhfkit.models import unwrap_model
from rlhfkit.rollout.episodes import Episodes
from rlhfkit.rollout.scoring import BIAS_KEY, GAIN_KEY, RewardFunctionError, reward_normalization
from rlhfkit.trainers.online.collect import Scores, score_rollout
from rlhfkit.trainers.online.context import OnlineContext
from rlhfkit.trainers.online.hooks import OnlineHooks
from rlhfkit.trainers.online.sharding import is_sharded
from rlhfkit.types import Rollout


def score_or_stop(
    ctx: OnlineContext,
    run: RunDir,
    hooks: OnlineHooks,
    rollout: Rollout,
    records: list[dict],
    step: int,
    *,
    first_step: int,
    last_eval: dict[str, float],
    rng_state: dict[str, Any],
    episodes: Episodes | None = None,
    extra_state: Callable[[int], dict[str, Any]] | None = None,
) -> Scores:
    """:func:`score_rollout`, or, when a reward function fails (on any process), a checkpoint of rollout
    ``step - 1`` (unless one exists: the resume point, or a ``save_steps`` multiple) with the RNG as it was when
    that rollout ended, then a RewardFunctionError naming the rollout, so that ``--resume`` continues from there
    once the function is fixed. ``extra_state``: the checkpoint's further trainer state at a rollout (the
    asynchronous trainer's kept weight versions)."""
    accelerator = ctx.accelerator
    try:
        result, failure = score_rollout(ctx, rollout, records, episodes), None
    except RewardFunctionError as e:
        result, failure = None, e
    failed = failure is not None
    if accelerator.num_processes > 1:  # every process must stop together (the checkpoint is collective)
        failed = bool(ctx.all_sum(torch.tensor([float(failed)])).item() > 0)
    if not failed:
        return result
    done = step - 1
    if done >= first_step and done % ctx.cfg.train.save_steps != 0:
        set_rng_state(rng_state)
        save(ctx, run, hooks, done, last_eval, extra_state(done) if extra_state is not None else None)
    where = (
        (
            f"the newest checkpoint is rollout {done}; fix the function and run the same command with --resume to "
            f"continue from rollout {step}"
        )
        if done > 0
        else "no rollout was completed; fix the function and run again"
    )
    reason = str(failure) if failure is not None else "a reward function failed on another process"
    raise RewardFunctionError(f"rollout {step}: {reason}; {where}") from failure


def _checkpoint_models(ctx: OnlineContext, hooks: OnlineHooks) -> dict[str, torch.nn.Module]:
    models = {"actor": ctx.roles.actor}
    if ctx.roles.critic is not None:
        models["critic"] = ctx.roles.critic
    if hooks.refresh_reward_model is not None:
        models["reward_model"] = ctx.roles.reward_model
    return models


def save(
    ctx: OnlineContext,
    run: RunDir,
    hooks: OnlineHooks,
    step: int,
    last_eval: dict[str, float],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``checkpoints/step-<step>/`` (main process; the others wait); sharded, also
    ``step-<step>.sharded/`` (every process its shards, :func:`rlhfkit.engine.sharded.save_roles`). ``extra``:
    more trainer state (plain data and tensors)."""
    accelerator = ctx.accelerator
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process and not is_sharded(ctx):
        return
    state = {
        "kl_controller": ctx.kl_ctl.state_dict(),
        "prompts_seen": step * ctx.cfg.train.batch_size,
        "last_eval": last_eval,
        **(extra or {}),
    }
    if ctx.guard is not None:
        state["guard"] = ctx.guard.state_dict()
    if hooks.refresh_reward_model is not None:  # a refresh may re-fit the normalisation in the model's config
        state["reward_normalization"] = list(reward_normalization(ctx.roles.reward_model))
    if hasattr(hooks.refresh_reward_model, "state_dict"):
        state["reward_refresh"] = hooks.refresh_reward_model.state_dict()
    if is_sharded(ctx):
        sharded.save_roles(
            run.checkpoints_dir,
            step,
            _checkpoint_models(ctx, hooks),
            ctx.optimizers,
            ctx.schedulers,
            state,
            main_process=accelerator.is_main_process,
            keep_last=ctx.cfg.train.keep_last_checkpoints,
        )
        return
    save_checkpoint(
        run.checkpoints_dir,
        step,
        _checkpoint_models(ctx, hooks),
        ctx.optimizers,
        ctx.schedulers,
        state,
        keep_last=ctx.cfg.train.keep_last_checkpoints,
    )


def resume_state(ctx: OnlineContext, run: RunDir, hooks: OnlineHooks) -> dict[str, Any]:
    """Restore the newest complete checkpoint when resuming; ``{"step": 0}`` for a fresh start."""
    if run.resume_checkpoint is None:
        return {"step": 0}
    load = sharded.load_roles if is_sharded(ctx) else load_checkpoint
    state = load(run.resume_checkpoint, _checkpoint_models(ctx, hooks), ctx.optimizers, ctx.schedulers)
    ctx.kl_ctl.load_state_dict(state["kl_controller"])
    if ctx.guard is not None:
        ctx.guard.load_state_dict(state.get("guard"))
    if "reward_normalization" in state:
        config = unwrap_model(ctx.roles.reward_model).config
        setattr(config, GAIN_KEY, state["reward_normalization"][0])
        setattr(config, BIAS_KEY, state["reward_normalization"][1])
    if "reward_refresh" in state and hasattr(hooks.refresh_reward_model, "load_state_dict"):
        hooks.refresh_reward_model.load_state_dict(state["reward_refresh"])
    return state
