"""Online RL from a reward signal: PPO with a critic, and GRPO / RLOO / REINFORCE++ without one, in ONE loop.

PPO for language models as in Ziegler et al. 2019 and Ouyang et al. 2022, with the implementation details
of Huang et al. 2024 ("The N+ Implementation Details of RLHF with PPO"). Every rollout (``train.max_steps``
of them) runs five stages, numbered in :func:`train_online`:

1. **generate**: ``train.batch_size`` prompts (a stateless function of (seed, rollout number)) and
   ``online.group_size`` responses each, sampled from the actor at ``online.temperature`` (top-p / top-k
   optional) from LEFT-padded prompts, with torch's generator seeded from (seed, rollout number, process)
   (so resuming needs no sampler state, and every process samples its own noise); each response is cut after its first stop token (EOS, or also
   ``online.stop_token``), the stop token inside the mask and everything after it outside, also when the
   pad token is EOS. The log-probs of the actor and of the frozen reference, and the critic's values, are
   recomputed at the sampling temperature (never taken from ``generate``: OpenRLHF PR #853, trl#2358).
2. **score**: the frozen reward model (normalised by the reward trainer) and/or reward functions
   (:mod:`rlhfkit.rollout.scoring`, TRL's keyword convention). A response that nothing scores (every function
   returned None) is left out of every loss and counted (``score/unscored``). A reward function that raises or
   returns a wrong count stops the run after a checkpoint of the last completed rollout (:func:`score_or_stop`),
   so that ``--resume`` continues once it is fixed. A response that hits ``online.response_length`` without a stop token
   is scored ``online.missing_eos_score`` (``missing_eos=penalty``, the N+ "EOS trick"), or left out of
   every loss (``mask``: its tokens are masked and, for grpo/rloo, it leaves its group), or scored as it is
   (``none``). Optional clipping to ``[-score_clip, score_clip]``.
3. **KL-shaped rewards**: ``shape_rewards``: the score on each response's last real token and
   ``-kl_coef * kl_t`` on every token, with the ``k1``/``k2``/``k3`` estimator; ``kl_coef`` fixed or adaptive
   (Ziegler et al. 2019, ``online.kl_target``). The logged ``kl/mean`` (nats per response: the batch mean of
   the per-sequence sum) and ``kl/per_token`` are of the very ``kl_t`` that is trained on (trl#1161).
4. **advantages**: ``ADVANTAGE_ESTIMATORS[online.advantage_estimator]``: GAE over the critic's values
   (gamma 1, lam 0.95, whitened; the returns train the critic), or grpo / rloo / reinforce_pp (no critic).
5. **PPO epochs**: ``online.ppo_epochs`` passes over the rollout in ``online.num_minibatches`` shuffled
   minibatches, one optimizer step each for the actor and the critic (separate AdamW, learning rates and
   schedules; gradient clipping), accumulated over micro-batches of ``train.micro_batch_size`` responses.
   Clipped surrogate (Schulman et al. 2017, eq. 7), clipped value loss times ``vf_coef``, entropy bonus
   ``ent_coef``, each aggregated by ``aggregate_loss`` with the whole minibatch as normaliser.

Each stage is one call in :func:`train_online`: :func:`~rlhfkit.trainers.online_steps.sample_rollout` (1) and
:func:`~rlhfkit.trainers.online_steps.score_rollout` (2), :func:`~rlhfkit.trainers.online_shaping.shape_rollout`
(3) and :func:`~rlhfkit.trainers.online_shaping.estimate_advantages` (4),
:func:`~rlhfkit.trainers.online_update.ppo_update` (5). The :class:`rlhfkit.types.Rollout` carries what they
compute, the response mask and the actor's entropy included.

Before the first ``online.critic_warmup_steps`` rollouts end, only the critic is trained (Zheng et al. 2023).
Learning-rate schedules count rollouts (one scheduler step per rollout).

Under data parallelism (N processes, :mod:`rlhfkit.engine.accel`) each process generates for a contiguous
slice of the rollout's prompts, whole groups included, and N processes compute what one process computes on
the same rollout: advantages are whitened with the whole rollout's mean and variance (one all-reduce; TRL
whitens each process's share, which makes the result depend on N), a prompt's group is never split between
processes (checked), the minibatches are cut from the whole rollout, loss normalisers count the whole
minibatch, the KL controller reads the whole rollout's KL, and the logged statistics are summed over
processes once per rollout. Only the sampling noise depends on N (each process seeds its own from
(seed, rollout, process)).

Files: ``metrics.jsonl`` (one line per rollout: ``score/mean``, ``kl/mean``, ``kl/per_token``, ``kl_coef``,
``loss/policy``, ``loss/value``, ``entropy/mean``, ``clipfrac``, ``approx_kl``, ``ratio/mean``,
``value/explained_variance``, ``grad_norm/<role>``, ``learning_rate/<role>``,
``response_length/mean``, ``advantages/mean``, ``time/*``, ``tokens_per_second``, ...),
``samples.jsonl`` (``logging.samples_per_step`` responses of each rollout with their scores:
:mod:`rlhfkit.rollout.samples`), ``checkpoints/step-N/`` (actor, critic, both optimizers and schedules, the KL controller, RNG states; the
data position is the step), ``final/`` (the policy as a Hugging Face folder) and ``final_critic/`` beside it
(the critic, an ``AutoModelForSequenceClassification`` folder; gae only), ``summary.json``.

Callers such as the pipeline pass :class:`OnlineHooks`: an ``evaluate(policy, step)`` callback (e.g. the
gold score on held-out prompts; its metrics go into ``metrics.jsonl`` as named) and a reward-model refresh
between rollouts. The trainer itself knows nothing of any task.

Launch:
    rlhfkit train ppo --config ppo.yaml                  # one process
    rlhfkit train grpo --config grpo.yaml                # group_size 4 by default, no critic
    rlhfkit train ppo --config ppo.yaml --resume         # continue from the newest complete checkpoint
    torchrun --standalone --nproc_per_node 2 -m rlhfkit.cli train ppo --config ppo.yaml   # 2 processes
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit.algos import AdaptiveKLController, FixedKLController, explained_variance
from rlhfkit.config import RunConfig
from rlhfkit.config.checks import check_process_count
from rlhfkit.data import TokenLimits, prepare_run_data
from rlhfkit.engine.accel import make_accelerator
from rlhfkit.engine.folder import logged_at
from rlhfkit.engine.guards import FiniteGuard, masked
from rlhfkit.engine.run import RunDir, open_run
from rlhfkit.engine.seed import get_rng_state, seed_everything
from rlhfkit.errors import ConfigError
from rlhfkit.models import sampling_for
from rlhfkit.rollout.samples import SamplesWriter, rollout_samples
from rlhfkit.rollout.scoring import Scorer, check_signature, data_columns
from rlhfkit.trainers.loop import finish_run, router_aux_coef, run_tokenizer
from rlhfkit.trainers.online_checkpoint import resume_state, save, score_or_stop
from rlhfkit.trainers.online_context import OnlineContext, StageClock, StatSums, derived_seed
from rlhfkit.trainers.online_metrics import evaluate, rollout_stats
from rlhfkit.trainers.online_roles import build_optimizers, build_roles
from rlhfkit.trainers.online_shaping import (
    estimate_advantages,
    group_stats,
    load_process_reward_model,
    shape_rollout,
)
from rlhfkit.trainers.online_steps import prompt_batch, sample_rollout, take_scores
from rlhfkit.trainers.online_update import UpdateResult, ppo_update

CRITIC_DIR = "final_critic"


@dataclass
class OnlineHooks:
    """Optional callbacks from the caller; the trainer stays task-agnostic.

    Attributes:
        evaluate: ``(policy, step) -> {name: number}``, called with the unwrapped actor in eval mode under
            ``torch.no_grad`` every ``train.eval_steps`` rollouts, after the last one, and (when
            ``evaluate_at_start``) before the first. Its metrics are logged under the names it returns
            (e.g. ``gold/mean``). It runs with every global RNG seeded from (seed, step) and restored after,
            so it never changes what training samples.
        evaluate_at_start: also evaluate the initial policy, logged as step 0.
        refresh_reward_model: ``(policy, reward_model, step) -> {name: number}``, called after the update
            of every ``refresh.every``-th rollout (:class:`rlhfkit.config.RefreshConfig`); it may train the
            reward model in place (:mod:`rlhfkit.trainers.refresh`). The reward model is then saved in every checkpoint, and when the
            callable has ``state_dict()`` / ``load_state_dict()`` (e.g. its accumulated pairs, as plain data) that state is
            checkpointed too, and so is the model's normalisation (gain, bias in its config), which a refresh
            may re-fit. It is frozen again (eval mode, no gradients) after each call.
    """

    evaluate: Callable[[torch.nn.Module, int], dict[str, float]] | None = None
    evaluate_at_start: bool = True
    refresh_reward_model: Callable[[torch.nn.Module, torch.nn.Module, int], dict[str, float]] | None = None


def train(
    cfg: RunConfig, resume: bool = False, overwrite: bool = False, hooks: OnlineHooks | None = None
) -> dict[str, Any]:
    """Run ppo / grpo / rloo as configured; write ``final/``, ``final_critic/`` and ``summary.json``.

    Args:
        cfg: a :class:`rlhfkit.config.RunConfig` of kind ppo, grpo or rloo.
        resume: continue from the newest complete checkpoint in ``cfg.output_dir``.
        overwrite: delete the folder's previous run first.
        hooks: evaluation and reward-model refresh callbacks (see :class:`OnlineHooks`).
    Returns:
        the summary (also written to ``summary.json``).
    """
    hooks = hooks or OnlineHooks()
    seed_everything(cfg.seed)
    accelerator = make_accelerator()
    check_process_count(cfg, accelerator.num_processes)
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
    functions = Scorer.load_functions(cfg.online.reward_functions)
    columns = data_columns([*examples.records, *(eval_examples.records if eval_examples else [])])
    for i, (name, fn) in enumerate(functions):
        check_signature(name, fn, columns, f"online.reward_functions[{i}]")
    run = open_run(cfg, accelerator, resume, overwrite)
    ctx = build_context(
        cfg, accelerator, tokenizer, functions, train_reward_model=hooks.refresh_reward_model is not None
    )
    if hooks.refresh_reward_model is not None and ctx.roles.reward_model is None:
        raise ConfigError("a reward-model refresh needs online.reward_model")

    result = train_online(ctx, run, examples, hooks, eval_examples)
    summary = {
        "kind": cfg.kind,
        "steps": result["step"],
        **result["last"],
        "eval": result["eval"],
        "wall_seconds": result["wall_seconds"],
        "seconds_per_rollout": result["seconds_per_rollout"],
        "train_prompts": len(examples),
    }
    critic = {run.path / CRITIC_DIR: ctx.roles.critic} if ctx.roles.critic is not None else {}
    finish_run(run, accelerator, summary, tokenizer, ctx.roles.actor, cfg.model.save_dtype, critic)
    return summary


def build_context(
    cfg: RunConfig, accelerator, tokenizer, functions: list | None = None, train_reward_model: bool = False
) -> OnlineContext:
    """Load the roles, build the optimizers, the scorer, the KL controller and the sampling, and prepare for
    accelerate.

    ``functions``: the reward functions as ``Scorer.load_functions`` gives them (default: loaded from
    ``online.reward_functions``); ``train_reward_model``: a refresh hook trains the reward model (see
    :func:`rlhfkit.trainers.online_roles.build_roles`)."""
    roles = build_roles(cfg, tokenizer, accelerator.device, train_reward_model)
    optimizers, schedulers = build_optimizers(cfg, roles)
    names = list(optimizers)
    prepared = accelerator.prepare(*[getattr(roles, n) for n in names], *[optimizers[n] for n in names])
    trained = dict(zip(names, prepared[: len(names)], strict=True))
    optimizers = dict(zip(names, prepared[len(names) :], strict=True))
    online = cfg.online
    kl_ctl = (
        AdaptiveKLController(online.kl_coef, online.kl_target, online.kl_horizon)
        if online.kl_target is not None
        else FixedKLController(online.kl_coef)
    )
    if functions is None:
        functions = Scorer.load_functions(online.reward_functions)
    scorer = Scorer(roles.reward_model, functions, online.rollout_batch_size)
    stops = stop_token_ids(cfg, tokenizer)
    sampling = sampling_for(tokenizer.pad_token_id, stops, online.temperature, online.top_k, online.top_p)
    prm, table = load_process_reward_model(cfg, tokenizer, accelerator.device)
    return OnlineContext(
        cfg,
        accelerator,
        tokenizer,
        roles,
        trained,
        optimizers,
        schedulers,
        scorer,
        kl_ctl,
        stops,
        sampling,
        router_aux_coef(roles.actor, cfg.model.router_aux_loss_coef),
        process_reward_model=prm,
        step_end_table=table,
    )


def stop_token_ids(cfg: RunConfig, tokenizer) -> list[int]:
    """EOS, plus ``online.stop_token`` when set (a token's text as in the vocabulary, or text that is one token)."""
    ids = [tokenizer.eos_token_id]
    text = cfg.online.stop_token
    if text:
        token = tokenizer.convert_tokens_to_ids(text)
        if token is None or token == tokenizer.unk_token_id:
            encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(encoded) != 1:
                raise ConfigError(
                    f"online.stop_token: {text!r} is not one token of the tokenizer "
                    f"(it encodes to {len(encoded)} tokens)"
                )
            token = encoded[0]
        if token not in ids:
            ids.append(token)
    return ids


def train_online(
    ctx: OnlineContext,
    run: RunDir,
    examples: list[dict],
    hooks: OnlineHooks,
    eval_examples: list[dict] | None = None,
) -> dict[str, Any]:
    """The loop: ``train.max_steps`` rollouts of the five stages, with logging, evaluation and checkpoints."""
    cfg, accelerator = ctx.cfg, ctx.accelerator
    online, train = cfg.online, cfg.train
    ctx.guard = FiniteGuard(accelerator, train.skip_nonfinite_steps, run.checkpoints_dir, unit="rollout")
    state = resume_state(ctx, run, hooks)
    last_eval: dict[str, float] = dict(state.get("last_eval", {}))
    if state["step"] == 0 and hooks.evaluate_at_start and (hooks.evaluate or eval_examples):
        last_eval = evaluate(ctx, hooks, eval_examples, 0)
        run.metrics.log(0, last_eval)
    samples = SamplesWriter(
        run.path / "samples.jsonl",
        keep_until=run.resume_step if run.resume_checkpoint else -1,
        enabled=accelerator.is_main_process and cfg.logging.samples_per_step > 0,
    )
    start_time, step_seconds = time.perf_counter(), []
    # a run that has nothing left to train reports its last logged step
    last = logged_at(run.path, state["step"]) if state["step"] == train.max_steps else {}
    for step in run.progress(
        range(state["step"] + 1, train.max_steps + 1), total=train.max_steps, desc=cfg.kind
    ):
        clock, step_start, rng_at_start = StageClock(accelerator.device), time.perf_counter(), get_rng_state()
        # 1. generate: sample responses, cut them at the stop token; old and reference log-probs, values
        torch.manual_seed(derived_seed("sampling", cfg.seed, step, accelerator.process_index))
        batch = prompt_batch(ctx, examples, step)
        rollout = sample_rollout(ctx, batch, clock)

        # 2. score: reward model and/or reward functions; the missing-EOS rule; clipping. A response that
        # nothing scored (every function said None) leaves the loss. A failing reward function stops the run
        # after a checkpoint of the last completed rollout.
        with clock("score"):
            scores = score_or_stop(
                ctx,
                run,
                hooks,
                rollout,
                batch["records"],
                step,
                first_step=state["step"] + 1,
                last_eval=last_eval,
                rng_state=rng_at_start,
            )
        take_scores(rollout, scores)

        # 3. KL-shaped rewards: -kl_coef * kl_t per token (unless kl_in_loss), the score on the last real
        # token, and a process reward model's step rewards on the step-end tokens (dense form)
        kl_coef = ctx.kl_ctl.value
        with clock("score"):
            step_stats = shape_rollout(ctx, rollout, kl_coef)

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
                "advantage": masked(rollout.advantages, mask),
            },
        )

        # 5. PPO epochs: shuffled minibatches, one optimizer step each, micro-batch accumulation
        with clock("update"):
            update = (
                UpdateResult(StatSums(ctx.device))
                if skip
                else ppo_update(ctx, rollout, step, train_actor=step > online.critic_warmup_steps)
            )

        # the rollout's and the update's statistics, summed over processes in one all-reduce
        metrics = (
            rollout_stats(ctx, rollout, scores)
            .merge(update.stats)
            .merge(step_stats)
            .merge(group_stats(ctx, rollout))
            .means(ctx)
        )
        if rollout.values is not None:  # of the values the advantages were computed from, before the update
            explained = float(explained_variance(rollout.values, rollout.returns, rollout.mask, ctx.all_sum))
            if math.isfinite(explained):  # undefined (not logged) when the returns are constant
                metrics["value/explained_variance"] = explained
        metrics["kl_coef"] = kl_coef
        samples.write(
            rollout_samples(
                step,
                batch["records"],
                rollout,
                scores.parts,
                ctx.tokenizer,
                cfg.logging.samples_per_step,
                scores.responses,
            )
        )
        metrics.update(update.metrics())
        metrics.update(ctx.guard.metrics())
        # The update's losses and gradient norms, already the same on every process: a non-finite one stops
        # the run before anything is saved from the weights it moved.
        ctx.guard.check_agreed(
            step, {k: v for k, v in metrics.items() if k.startswith(("loss/", "grad_norm/"))}
        )
        if not skip:
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
        last = metrics
        if step % train.log_steps == 0 or step == train.max_steps or evaluated:
            run.metrics.log(step, metrics)
        if step % train.save_steps == 0 or step == train.max_steps or ctx.guard.stop_signal:
            save(ctx, run, hooks, step, last_eval)
        ctx.guard.stop_if_asked(step)  # SIGTERM / SIGINT: this rollout is checkpointed; exit 128 + signal
    samples.close()
    wall = time.perf_counter() - start_time
    summary_keys = ("score/mean", "kl/mean", "kl_coef", "response_length/mean", "tokens_per_second")
    return {
        "step": train.max_steps,
        "last": {k.replace("/", "_"): last[k] for k in summary_keys if k in last},
        "eval": last_eval,
        "wall_seconds": wall,
        "seconds_per_rollout": sum(step_seconds) / len(step_seconds) if step_seconds else None,
    }


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
    """Call the refresh hook with the actor (eval mode) and the reward model, then freeze the reward model."""
    actor, reward_model = ctx.roles.actor, ctx.roles.reward_model
    was_training = actor.training
    actor.eval()
    try:
        metrics = hooks.refresh_reward_model(actor, reward_model, step) or {}
    finally:
        actor.train(was_training)
        reward_model.eval()
        reward_model.requires_grad_(False)
    return metrics
