"""The online loop (:func:`train_online`): ``train.max_steps`` rollouts of the five numbered stages, with
logging, evaluation, the reward-model refresh between rollouts and checkpoints; :func:`train` reads and
checks the data, opens the run folder and builds the :class:`~rlhfkit.trainers.online.context.OnlineContext`
first. The algorithm and its files are described in :mod:`rlhfkit.trainers.online`."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from typing import Any

import torch

from rlhfkit.algos import explained_variance
from rlhfkit.config import RunConfig
from rlhfkit.config.checks import check_process_count
from rlhfkit.data import TokenLimits, prepare_run_data
from rlhfkit.engine.accel import make_accelerator
from rlhfkit.engine.finite import masked
from rlhfkit.engine.folder import RunDir, logged_at, open_run
from rlhfkit.engine.seed import get_rng_state, seed_everything
from rlhfkit.engine.transfer import open_transfers
from rlhfkit.errors import ConfigError
from rlhfkit.models.precision import frozen_linears_cast
from rlhfkit.rollout.preflight import check_scoring
from rlhfkit.rollout.samples import SamplesWriter, rollout_samples
from rlhfkit.trainers.common import finish_run, run_tokenizer
from rlhfkit.trainers.online.async_loop import AsyncTrainer, ProcessView, generate_rollouts, generator_index
from rlhfkit.trainers.online.checkpoints import resume_state, save, score_or_stop
from rlhfkit.trainers.online.collect import (
    Scores,
    episode_runner,
    episode_samples,
    episode_stats,
    prompt_batch,
    sample_rollout,
    start_sandbox,
    take_scores,
)
from rlhfkit.trainers.online.context import OnlineContext, StageClock, StatSums, build_context, derived_seed
from rlhfkit.trainers.online.dynamic import fill_informative_groups
from rlhfkit.trainers.online.engine_rollout import check_logprob_gap, engine_for_hook, start_engine
from rlhfkit.trainers.online.hooks import OnlineHooks
from rlhfkit.trainers.online.layout import old_logprobs_from_update, reads_reference
from rlhfkit.trainers.online.metrics import evaluate, rollout_stats
from rlhfkit.trainers.online.ppo_update import UpdateResult, ppo_update
from rlhfkit.trainers.online.shaping import (
    estimate_advantages,
    group_stats,
    measured_kl,
    shape_rollout,
    teacher_stats,
)
from rlhfkit.trainers.online.sharding import final_models
from rlhfkit.trainers.online.side_by_side import SideBySideWriter
from rlhfkit.types import Rollout

CRITIC_DIR = "final_critic"


def train(
    cfg: RunConfig, resume: bool = False, overwrite: bool = False, hooks: OnlineHooks | None = None
) -> dict[str, Any]:
    """Run ppo / grpo / rloo / distill as configured; write ``final/``, ``final_critic/`` and ``summary.json``.

    Args:
        cfg: a :class:`rlhfkit.config.RunConfig` of kind ppo, grpo, rloo or distill.
        resume: continue from the newest complete checkpoint in ``cfg.output_dir``.
        overwrite: delete the folder's previous run first.
        hooks: evaluation and reward-model refresh callbacks (see :class:`OnlineHooks`).
    Returns:
        the summary (also written to ``summary.json``).
    """
    hooks = hooks or OnlineHooks()
    seed_everything(cfg.seed)
    accelerator = make_accelerator(
        sharding=True, collective_timeout=cfg.train.collective_timeout
    )  # an accelerate FSDP config: the roles sharded here
    check_process_count(cfg, accelerator.num_processes)
    overlap = cfg.online.max_staleness > 0  # rlhfkit.trainers.online.async_loop
    if overlap:  # its transfers go over gloo (a group of their own beside NCCL), opened by every process
        open_transfers(cfg.train.collective_timeout)
    if cfg.refresh.every and hooks.refresh_reward_model is None:
        raise ConfigError(
            f"refresh.every={cfg.refresh.every}: nothing refreshes the reward model (a refresh needs a "
            "labeller: the quickstart's --refresh-steps, or OnlineHooks.refresh_reward_model from Python); "
            "set it to 0"
        )

    # All data is read and validated, and the reward functions imported and checked against its columns,
    # before any model is loaded or the run folder written: bad input stops here and leaves nothing behind.
    tokenizer = run_tokenizer(cfg)
    limits = TokenLimits(cfg.data.max_prompt_length, None, cfg.data.truncation)
    examples, eval_examples = prepare_run_data(cfg.data, "prompts", tokenizer, limits, accelerator)
    # the reward functions, tools and environment against every row (rlhfkit.rollout.preflight)
    functions, toolbox = check_scoring(
        cfg, [examples.records, *([eval_examples.records] if eval_examples else [])]
    )
    start_sandbox(
        cfg
    )  # rlhfkit:python / rlhfkit:code_tests: bubblewrap present and working, or a named error
    runner = episode_runner(cfg, tokenizer, toolbox)  # tools: the chat template checked with them
    run = open_run(cfg, accelerator, resume, overwrite)
    generator = generator_index(cfg, accelerator) if overlap else None
    ctx = build_context(
        cfg,
        ProcessView(accelerator, main=generator is None) if overlap else accelerator,
        tokenizer,
        functions,
        train_reward_model=hooks.refresh_reward_model is not None,
        checkpoints_dir=run.checkpoints_dir,
    )
    if hooks.refresh_reward_model is not None and ctx.roles.reward_model is None:
        raise ConfigError("a reward-model refresh needs online.reward_model")
    # vllm: the engine, once; tools: the episode runner
    ctx = dataclasses.replace(ctx, engine=start_engine(cfg, ctx.roles.actor, runner), episodes=runner)
    if generator is not None:  # this process only samples, for the trainer (process 0)
        run.close()
        resumed = run.resume_step if run.resume_checkpoint else 0
        return {"kind": cfg.kind, "generator": generator, **generate_rollouts(ctx, examples, resumed)}
    trainer = AsyncTrainer(ctx) if overlap else None

    try:
        result = train_online(ctx, run, examples, hooks, eval_examples, trainer)
    finally:  # also when the run stops: a later engine in this process (a resume) needs vLLM's groups gone
        if ctx.engine is not None:
            ctx.engine.close()
    summary = {
        "kind": cfg.kind,
        "steps": result["step"],
        **result["last"],
        "eval": result["eval"],
        "wall_seconds": result["wall_seconds"],
        "seconds_per_rollout": result["seconds_per_rollout"],
        "train_prompts": len(examples),
    }
    actor, critic_model = final_models(ctx)  # sharded: gathered whole on every process
    critic = {run.path / CRITIC_DIR: critic_model} if critic_model is not None else {}
    finish_run(run, accelerator, summary, tokenizer, actor, cfg.model.save_dtype, critic)
    return summary


def train_online(
    ctx: OnlineContext,
    run: RunDir,
    examples: list[dict],
    hooks: OnlineHooks,
    eval_examples: list[dict] | None = None,
    trainer: AsyncTrainer | None = None,
) -> dict[str, Any]:
    """The loop: ``train.max_steps`` rollouts of the five stages, with logging, evaluation and checkpoints.
    ``trainer``: rollouts sampled by other processes (``online.max_staleness`` > 0): stage 1 receives them and
    the weights go back after each update (:mod:`rlhfkit.trainers.online.async_loop`)."""
    cfg, accelerator = ctx.cfg, ctx.accelerator
    online, train = cfg.online, cfg.train
    state = resume_state(ctx, run, hooks)
    last_eval: dict[str, float] = dict(state.get("last_eval", {}))
    side_by_side = SideBySideWriter(
        ctx, run, examples, eval_examples
    )  # a teacher's samples beside the student's
    if state["step"] == 0 and hooks.evaluate_at_start and (hooks.evaluate or eval_examples):
        last_eval = evaluate(ctx, hooks, eval_examples, 0)
        run.metrics.log(0, last_eval)
        side_by_side(0)
    samples = SamplesWriter(
        run.path / "samples.jsonl",
        keep_until=run.resume_step if run.resume_checkpoint else -1,
        enabled=accelerator.is_main_process and cfg.logging.samples_per_step > 0,
    )
    start_time, step_seconds = time.perf_counter(), []
    if trainer is not None:  # resumed: the weights the next rollouts were sampled with, sent again
        trainer.start(state["step"], state)
    # a run that has nothing left to train reports its last logged step
    last = logged_at(run.path, state["step"]) if state["step"] == train.max_steps else {}
    for step in run.progress(
        range(state["step"] + 1, train.max_steps + 1), total=train.max_steps, desc=cfg.kind
    ):
        clock, step_start, rng_at_start = StageClock(accelerator.device), time.perf_counter(), get_rng_state()
        # 1. generate: sample responses, cut them at the stop token; old and reference log-probs, values
        torch.manual_seed(derived_seed("sampling", cfg.seed, step, accelerator.process_index))
        batch = prompt_batch(ctx, examples, step)
        if trainer is None:
            rollout = sample_rollout(ctx, batch, clock, step)
        else:  # sampled by a generation process, its stale samples masked out
            rollout = trainer.collect(ctx, batch, clock, step)
        engine_gap = check_logprob_gap(ctx, rollout)  # vllm: the engine's weights are the actor's, or a stop

        # 2. score: reward model and/or reward functions; the missing-EOS rule; clipping. A response that
        # nothing scored (every function said None) leaves the loss. A failing reward function stops the run
        # after a checkpoint of the last completed rollout.
        score = functools.partial(
            _score,
            ctx,
            run,
            hooks,
            clock,
            step,
            first_step=state["step"] + 1,
            last_eval=last_eval,
            rng_state=rng_at_start,
            extra_state=trainer.checkpoint_state if trainer is not None else None,
        )
        scores = score(rollout, batch["records"], episodes=batch.get("episodes"))
        # grpo / rloo with dynamic sampling: groups that all score the same make way for new prompts' groups
        dynamic = StatSums(ctx.device)
        if online.dynamic_sampling:
            draw = functools.partial(_draw, ctx, examples, step, clock, score)
            batch, rollout, scores, dynamic = fill_informative_groups(ctx, batch, rollout, scores, draw)
        take_scores(rollout, scores)

        # 3. KL-shaped rewards: -kl_coef * kl_t per token (unless kl_in_loss), the score on the last real
        # token, and a process reward model's step rewards on the step-end tokens (dense form)
        kl_coef = ctx.kl_ctl.value
        fused = old_logprobs_from_update(ctx, step)  # the update's forward gives the old log-probs
        with clock("score"):
            step_stats = shape_rollout(ctx, rollout, kl_coef, teacher_metric=not fused)

        # 4. advantages (and the critic's returns)
        rollout.advantages, rollout.returns = estimate_advantages(ctx, rollout)

        # Non-finite scores, values, log-probs or advantages stop the run (or skip the update), on every
        # process: one host sync, which also agrees on a SIGTERM / SIGINT stop.
        mask = rollout.mask
        skip = ctx.guard.check(
            step,
            {
                "reward-model score": scores.parts.get("reward_model"),
                "reward": rollout.scores,
                "value": masked(rollout.values, mask),
                "log-prob": masked(rollout.logprobs, mask),
                "reference log-prob": masked(rollout.ref_logprobs, mask),
                "teacher log-prob": masked(rollout.teacher_logprobs, mask),
                "advantage": masked(rollout.advantages, mask),
            },
        )

        # 5. PPO epochs: shuffled minibatches, one optimizer step each, micro-batch accumulation
        with clock("update"), frozen_linears_cast(ctx.roles.actor):  # bit-identical to autocast's own casts
            update = (
                UpdateResult(StatSums(ctx.device))
                if skip
                else ppo_update(ctx, rollout, step, train_actor=step > online.critic_warmup_steps)
            )
        if trainer is not None:  # the new weights to the generator that samples with them next
            trainer.publish(step)
        if fused:  # the update's forward gave the old log-probs (none if skipped)
            if not reads_reference(cfg):  # the reference's are the actor's own (collect.sample_rollout)
                rollout.ref_logprobs = rollout.logprobs.clone()
            rollout.kl = torch.zeros_like(rollout.kl) if skip else measured_kl(ctx, rollout)
            if not skip:  # and the teacher's, where it read them too (layout.teacher_read_in_update)
                step_stats.merge(teacher_stats(rollout))

        # the rollout's and the update's statistics, summed over processes in one all-reduce
        metrics = (
            rollout_stats(ctx, rollout, scores)
            .merge(update.stats)
            .merge(step_stats)
            .merge(group_stats(ctx, rollout))
            .merge(dynamic)
            .merge(episode_stats(ctx, batch.get("episodes")))
            .means(ctx)
        )
        if rollout.values is not None:  # of the values the advantages were computed from, before the update
            explained = float(explained_variance(rollout.values, rollout.returns, rollout.mask, ctx.all_sum))
            if math.isfinite(explained):  # undefined (not logged) when the returns are constant
                metrics["value/explained_variance"] = explained
        metrics["kl_coef"] = kl_coef
        rows = rollout_samples(
            step,
            batch["records"],
            rollout,
            scores.parts,
            ctx.tokenizer,
            cfg.logging.samples_per_step,
            scores.responses,
        )
        samples.write(episode_samples(rows, batch.get("episodes")))  # tools: each episode's turns
        metrics.update(update.metrics())
        metrics.update(engine_gap)
        metrics.update(ctx.guard.metrics())
        metrics.update(trainer.metrics if trainer is not None else {})
        # The update's losses and gradient norms, already the same on every process: a non-finite one stops
        # the run before anything is saved from the weights it moved.
        ctx.guard.check_agreed(
            step, {k: v for k, v in metrics.items() if k.startswith(("loss/", "grad_norm/"))}
        )
        if not skip and "kl/mean" in metrics:  # not read in `train distill` with no KL to the reference
            ctx.kl_ctl.update(metrics["kl/mean"], train.batch_size * online.group_size)
        step_schedulers(ctx, metrics)

        # Between rollouts: the reward-model refresh, then timing, evaluation, the log line, the checkpoint.
        every = cfg.refresh.every
        if hooks.refresh_reward_model is not None and every and step % every == 0:
            metrics.update(refresh_reward_model(ctx, hooks, step))
        seconds = time.perf_counter() - step_start
        step_seconds.append(seconds)
        metrics.update({f"time/{k}": v for k, v in clock.seconds.items()})
        metrics["time/step_seconds"] = seconds
        metrics["tokens_per_second"] = (
            metrics["response_length/mean"] * train.batch_size * online.group_size / seconds
        )
        evaluated = bool(hooks.evaluate or eval_examples) and (
            step % train.eval_steps == 0 or step == train.max_steps
        )
        if evaluated:
            last_eval = evaluate(ctx, hooks, eval_examples, step)
            metrics.update(last_eval)
        if evaluated or step == train.max_steps:
            side_by_side(step)
        last = metrics
        if step % train.log_steps == 0 or step == train.max_steps or evaluated:
            run.metrics.log(step, metrics)
        if step % train.save_steps == 0 or step == train.max_steps or ctx.guard.stop_signal:
            save(ctx, run, hooks, step, last_eval, trainer.checkpoint_state(step) if trainer else None)
        ctx.guard.stop_if_asked(step)  # SIGTERM / SIGINT: this rollout is checkpointed; exit 128 + signal
    samples.close()
    side_by_side.close()
    if trainer is not None:
        trainer.close()
    wall = time.perf_counter() - start_time
    summary_keys = (
        "score/mean",
        "score/raw_mean",
        *(f"score/{name}" for name, _ in ctx.scorer.functions),  # each reward function's own score
        "score/penalised_frac",
        "response/ended_frac",
        "kl/mean",
        "kl_coef",
        "response_length/mean",
        "tokens_per_second",
    )
    return {
        "step": train.max_steps,
        "last": {k.replace("/", "_"): last[k] for k in summary_keys if k in last},
        "eval": last_eval,
        "wall_seconds": wall,
        "seconds_per_rollout": sum(step_seconds) / len(step_seconds) if step_seconds else None,
    }


def _score(
    ctx: OnlineContext,
    run: RunDir,
    hooks: OnlineHooks,
    clock: StageClock,
    step: int,
    rollout: Rollout,
    records: list[dict],
    **checkpoint: Any,
) -> Scores:
    """Stage 2 of rollout ``step``, timed: :func:`~rlhfkit.trainers.online.checkpoints.score_or_stop`."""
    with clock("score"):
        return score_or_stop(ctx, run, hooks, rollout, records, step, **checkpoint)


def _draw(
    ctx: OnlineContext, examples: list[dict], step: int, clock: StageClock, score, round_: int
) -> tuple[dict, Rollout, Scores]:
    """Stages 1 and 2 on the prompts of dynamic sampling's extra round ``round_`` of rollout ``step``.

    vllm: the engine samples from the weights stage 1 of this rollout loaded (the actor has not moved since;
    loading them again each round would copy the whole model, merged LoRA included, for nothing), and the
    round's log-prob gap is checked as stage 1's is: its tokens are trained too."""
    batch = prompt_batch(ctx, examples, step, stream=round_)
    actor_forward = not old_logprobs_from_update(ctx, step)
    rollout = sample_rollout(ctx, batch, clock, actor_forward=actor_forward, sync_engine=False)
    check_logprob_gap(ctx, rollout, round_)  # vllm: a stop when this round's engine log-probs are off
    return batch, rollout, score(rollout, batch["records"], episodes=batch.get("episodes"))


def step_schedulers(ctx: OnlineContext, metrics: dict[str, float]) -> None:
    """One learning-rate schedule step per rollout (the rate used is logged as ``learning_rate/<role>``).

    A role that took no optimizer step (the actor during critic warm-up, or every minibatch masked out) still
    counts the rollout; torch's warning about that order is silenced as intended.
    """
    for name, scheduler in ctx.schedulers.items():
        metrics[f"learning_rate/{name}"] = scheduler.get_last_lr()[0]
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="Detected call of `lr_scheduler.step", category=UserWarning
            )
            scheduler.step()


def refresh_reward_model(ctx: OnlineContext, hooks: OnlineHooks, step: int) -> dict[str, float]:
    """Call the refresh hook with the actor (eval mode) and the reward model, then freeze the reward model.

    With the vLLM engine, a hook that takes ``generate`` samples its pairs from the engine, loaded with the
    actor's weights after this rollout's update (:func:`rlhfkit.rollout.vllm_engine.engine_generate`)."""
    actor, reward_model = ctx.roles.actor, ctx.roles.reward_model
    was_training = actor.training
    actor.eval()
    extra = engine_for_hook(ctx, hooks.refresh_reward_model)  # vllm: {"generate": ...}
    try:
        metrics = hooks.refresh_reward_model(actor, reward_model, step, **extra) or {}
    finally:
        actor.train(was_training)
        reward_model.eval()
        reward_model.requires_grad_(False)
    return metrics
