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

from rlhfkit.algos import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    explained_variance,
    shape_rewards,
)
from rlhfkit.algos.masked import fill_masked
from rlhfkit.data import PromptCollator, TokenLimits, prepare_run_data
from rlhfkit.engine.accel import make_accelerator
from rlhfkit.engine.checkpoint import load_checkpoint, save_checkpoint
from rlhfkit.engine.folder import logged_at
from rlhfkit.engine.guards import FiniteGuard, masked
from rlhfkit.engine.run import RunDir, open_run
from rlhfkit.engine.seed import get_rng_state, seed_everything, set_rng_state
from rlhfkit.errors import ConfigError
from rlhfkit.models import sampling_for, save_hf_folder, unwrap_model
from rlhfkit.report import write_report
from rlhfkit.rollout.samples import SamplesWriter, rollout_samples
from rlhfkit.rollout.scoring import (
    BIAS_KEY,
    GAIN_KEY,
    RewardFunctionError,
    Scorer,
    check_signature,
    data_columns,
    reward_normalization,
)
from rlhfkit.trainers.loop import micro_batches, router_aux_coef, run_tokenizer
from rlhfkit.trainers.online_roles import build_optimizers, build_roles, check_online_config
from rlhfkit.trainers.online_shaping import group_stats, load_process_reward_model, with_process_rewards
from rlhfkit.trainers.online_steps import (
    OnlineContext,
    StageClock,
    StatSums,
    UpdateResult,
    derived_seed,
    ppo_update,
    prompt_batch,
    sample_rollout,
    score_rollout,
)
from rlhfkit.types import Rollout

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
            of every ``refresh_steps``-th rollout; it may train the reward model in place
            (:mod:`rlhfkit.trainers.refresh`). The reward model is then saved in every checkpoint, and when the
            callable has ``state_dict()`` / ``load_state_dict()`` (e.g. its accumulated pairs, as plain data) that state is
            checkpointed too, and so is the model's normalisation (gain, bias in its config), which a refresh
            may re-fit. It is frozen again (eval mode, no gradients) after each call.
        refresh_steps: how often ``refresh_reward_model`` runs (in rollouts; 0 = never).
    """

    evaluate: Callable[[torch.nn.Module, int], dict[str, float]] | None = None
    evaluate_at_start: bool = True
    refresh_reward_model: Callable[[torch.nn.Module, torch.nn.Module, int], dict[str, float]] | None = None
    refresh_steps: int = 0


def train(
    cfg, resume: bool = False, overwrite: bool = False, hooks: OnlineHooks | None = None
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
    check_online_config(cfg, accelerator.num_processes)

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
    if accelerator.is_main_process:
        save_hf_folder(ctx.roles.actor, tokenizer, run.final_dir, dtype=cfg.model.save_dtype)
        if ctx.roles.critic is not None:
            save_hf_folder(ctx.roles.critic, tokenizer, run.path / CRITIC_DIR, dtype=cfg.model.save_dtype)
        run.write_summary(summary)
    run.close()
    if accelerator.is_main_process:
        write_report(run.path)
    return summary


def build_context(
    cfg, accelerator, tokenizer, functions: list | None = None, train_reward_model: bool = False
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
    o = cfg.online
    kl_ctl = (
        AdaptiveKLController(o.kl_coef, o.kl_target, o.kl_horizon)
        if o.kl_target is not None
        else FixedKLController(o.kl_coef)
    )
    if functions is None:
        functions = Scorer.load_functions(o.reward_functions)
    scorer = Scorer(roles.reward_model, functions, o.rollout_batch_size)
    stops = stop_token_ids(cfg, tokenizer)
    sampling = sampling_for(tokenizer.pad_token_id, stops, o.temperature, o.top_k, o.top_p)
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


def stop_token_ids(cfg, tokenizer) -> list[int]:
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
    cfg, acc = ctx.cfg, ctx.accelerator
    o, t = cfg.online, cfg.train
    ctx.guard = FiniteGuard(acc, t.skip_nonfinite_steps, run.checkpoints_dir, unit="rollout")
    state = resume_state(ctx, run, hooks)
    last_eval: dict[str, float] = dict(state.get("last_eval", {}))
    if state["step"] == 0 and hooks.evaluate_at_start and (hooks.evaluate or eval_examples):
        last_eval = evaluate(ctx, hooks, eval_examples, 0)
        run.metrics.log(0, last_eval)
    samples = SamplesWriter(
        run.path / "samples.jsonl",
        keep_until=run.resume_step if run.resume_checkpoint else -1,
        enabled=acc.is_main_process and cfg.logging.samples_per_step > 0,
    )
    start_time, step_seconds = time.perf_counter(), []
    last = logged_at(run.path, state["step"]) if state["step"] == t.max_steps else {}  # nothing left to train
    for step in run.progress(range(state["step"] + 1, t.max_steps + 1), total=t.max_steps, desc=cfg.kind):
        clock, step_start, rng_at_start = StageClock(acc.device), time.perf_counter(), get_rng_state()
        # 1. generate: sample responses, cut them at the stop token; old and reference log-probs, values
        torch.manual_seed(derived_seed("sampling", cfg.seed, step, acc.process_index))
        batch = prompt_batch(ctx, examples, step)
        rollout, response_mask, entropy = sample_rollout(ctx, batch, clock)

        # 2. score: reward model and/or reward functions; the missing-EOS rule; clipping. A response that
        # nothing scored (every function said None) leaves the loss. A failing reward function stops the run
        # after a checkpoint of the last completed rollout.
        with clock("score"):
            scored = score_or_stop(
                ctx,
                run,
                hooks,
                rollout,
                response_mask,
                batch["records"],
                step,
                first_step=state["step"] + 1,
                last_eval=last_eval,
                rng_state=rng_at_start,
            )
        rollout.scores, raw_scores, parts, is_scored, responses = scored
        rollout.mask = rollout.mask & is_scored[:, None]
        entropy = fill_masked(entropy, rollout.mask)

        # 3. KL-shaped rewards: -kl_coef * kl_t per token (unless kl_in_loss), the score on the last real
        # token, and a process reward model's step rewards on the step-end tokens (dense form)
        kl_coef = ctx.kl_ctl.value
        with clock("score"):
            shaped, step_stats = with_process_rewards(ctx, rollout)
        rollout.rewards, rollout.kl = shape_rewards(
            shaped,
            rollout.logprobs,
            rollout.ref_logprobs,
            rollout.mask,
            0.0 if o.kl_in_loss else kl_coef,
            o.kl_estimator,
        )

        # 4. advantages (and the critic's returns)
        rollout.advantages, rollout.returns = estimate_advantages(ctx, rollout)

        # Non-finite scores, values, log-probs or advantages stop the run (or skip the update), on every
        # process: one host sync, which also agrees on a SIGTERM / SIGINT stop.
        m = rollout.mask
        skip = ctx.guard.check(
            step,
            {
                "reward-model score": parts.get("reward_model"),
                "reward": rollout.scores,
                "value": masked(rollout.values, m),
                "log-prob": masked(rollout.logprobs, m),
                "reference log-prob": masked(rollout.ref_logprobs, m),
                "advantage": masked(rollout.advantages, m),
            },
        )

        # 5. PPO epochs: shuffled minibatches, one optimizer step each, micro-batch accumulation
        with clock("update"):
            update = (
                UpdateResult(StatSums(ctx.device))
                if skip
                else ppo_update(ctx, rollout, step, train_actor=step > o.critic_warmup_steps)
            )

        # the rollout's and the update's statistics, summed over processes in one all-reduce
        metrics = (
            rollout_stats(ctx, rollout, response_mask, raw_scores, parts, entropy, is_scored)
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
                response_mask,
                parts,
                ctx.tokenizer,
                cfg.logging.samples_per_step,
                responses,
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
            ctx.kl_ctl.update(metrics["kl/mean"], t.batch_size * o.group_size)
        step_schedulers(ctx, metrics)

        # Between rollouts: the reward-model refresh, then timing, evaluation, the log line, the checkpoint.
        if hooks.refresh_reward_model is not None and hooks.refresh_steps and step % hooks.refresh_steps == 0:
            metrics.update(refresh_reward_model(ctx, hooks, step))
        seconds = time.perf_counter() - step_start
        step_seconds.append(seconds)
        metrics.update({f"time/{k}": v for k, v in clock.seconds.items()})
        metrics["time/step_seconds"] = seconds
        metrics["tokens_per_second"] = metrics["response_length/mean"] * t.batch_size * o.group_size / seconds
        evaluated = bool(hooks.evaluate or eval_examples) and (
            step % t.eval_steps == 0 or step == t.max_steps
        )
        if evaluated:
            last_eval = evaluate(ctx, hooks, eval_examples, step)
            metrics.update(last_eval)
        last = metrics
        if step % t.log_steps == 0 or step == t.max_steps or evaluated:
            run.metrics.log(step, metrics)
        if step % t.save_steps == 0 or step == t.max_steps or ctx.guard.stop_signal:
            save(ctx, run, hooks, step, last_eval)
        ctx.guard.stop_if_asked(step)  # SIGTERM / SIGINT: this rollout is checkpointed; exit 128 + signal
    samples.close()
    wall = time.perf_counter() - start_time
    summary_keys = ("score/mean", "kl/mean", "kl_coef", "response_length/mean", "tokens_per_second")
    return {
        "step": t.max_steps,
        "last": {k.replace("/", "_"): last[k] for k in summary_keys if k in last},
        "eval": last_eval,
        "wall_seconds": wall,
        "seconds_per_rollout": sum(step_seconds) / len(step_seconds) if step_seconds else None,
    }


def score_or_stop(
    ctx: OnlineContext,
    run: RunDir,
    hooks: OnlineHooks,
    rollout: Rollout,
    response_mask: torch.Tensor,
    records: list[dict],
    step: int,
    *,
    first_step: int,
    last_eval: dict[str, float],
    rng_state: dict[str, Any],
) -> tuple:
    """:func:`score_rollout`, or, when a reward function fails (on any process), a checkpoint of rollout
    ``step - 1`` (unless one exists: the resume point, or a ``save_steps`` multiple) with the RNG as it was when
    that rollout ended, then a RewardFunctionError naming the rollout, so that ``--resume`` continues from there
    once the function is fixed."""
    acc = ctx.accelerator
    try:
        result, failure = score_rollout(ctx, rollout, response_mask, records), None
    except RewardFunctionError as e:
        result, failure = None, e
    failed = failure is not None
    if acc.num_processes > 1:  # every process must stop together (the checkpoint is collective)
        failed = bool(ctx.all_sum(torch.tensor([float(failed)])).item() > 0)
    if not failed:
        return result
    done = step - 1
    if done >= first_step and done % ctx.cfg.train.save_steps != 0:
        set_rng_state(rng_state)
        save(ctx, run, hooks, done, last_eval)
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


def estimate_advantages(ctx: OnlineContext, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """``ADVANTAGE_ESTIMATORS[online.advantage_estimator]`` on the shaped rewards: (advantages, returns), (B, T).

    A fully masked response (``missing_eos=mask``) is put in a group of its own, so that it neither gets an
    advantage nor shifts its group's baseline (grpo / rloo).
    """
    o = ctx.cfg.online
    first, _, _ = ctx.rows()
    rows = first + torch.arange(
        rollout.batch_size, device=rollout.group_ids.device
    )  # (B,) global row numbers
    group_ids = torch.where(
        rollout.mask.any(1), rollout.group_ids, -1 - rows
    )  # (B,); -1 - row: distinct, alone
    if o.advantage_estimator in ("grpo", "rloo"):
        check_groups_on_one_process(ctx, group_ids)
    # grpo's division by the group std is its own switch (off = Dr. GRPO); for gae and reinforce_pp the
    # estimator's normalisation is whitening over the batch (all processes: all_sum); rloo has none.
    norm_by_std = o.norm_by_std if o.advantage_estimator == "grpo" else o.whiten_advantages
    return ADVANTAGE_ESTIMATORS[o.advantage_estimator](
        rollout.rewards,
        rollout.mask,
        rollout.values,
        group_ids,
        gamma=o.gamma,
        lam=o.lam,
        norm_by_std=norm_by_std,
        eps=o.advantage_eps,
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
            "responses must be on one process (rlhfkit.trainers.online_steps.prompt_batch)"
        )


def rollout_stats(
    ctx: OnlineContext,
    rollout: Rollout,
    response_mask: torch.Tensor,
    raw_scores: torch.Tensor,
    parts: dict[str, torch.Tensor],
    entropy: torch.Tensor,
    scored: torch.Tensor,
) -> StatSums:
    """Per-rollout statistics (names in the module docstring), as sums to be reduced over processes
    (``.means(ctx)``).

    ``kl/mean`` is the mean over responses (those with a valid token) of sum_t kl_t, in nats per response,
    the unit of the adaptive controller; ``score/mean`` is the score as it enters the rewards and
    ``score/raw_mean`` the scorer's before the missing-EOS rule and clipping, both over the responses that
    something scored; ``score/<part>`` is each part's mean where it had an opinion; ``score/unscored`` counts
    the responses that nothing scored (left out of the loss). Sums are taken in float64:
    a float32 sum of values that nearly cancel (whitened advantages) depends on the order of addition.
    """
    s = StatSums(ctx.device)
    rows, mask = rollout.batch_size, rollout.mask
    kept, tokens = mask.any(1).sum(), mask.sum()
    s.add_sum("score/mean", rollout.scores[scored].double().sum(), scored.sum())
    s.add_sum("score/raw_mean", raw_scores[scored].double().sum(), scored.sum())
    # A count, not a mean: the weights of all processes add up to 1.
    s.add_sum("score/unscored", (~scored).sum(), 1.0 / ctx.accelerator.num_processes)
    if len(parts) > 1 or ctx.scorer.functions:  # the same names on every process (one all-reduce)
        for name, values in parts.items():
            known = ~values.isnan()
            s.add_sum(f"score/{name}", values[known].double().sum(), known.sum())
    s.add_sum("kl/mean", rollout.kl.double().sum(), kept)
    s.add_sum("kl/per_token", rollout.kl.double().sum(), tokens)
    s.add_sum("reward/mean", rollout.rewards.double().sum(), kept)
    s.add_sum("entropy/mean", entropy.double().sum(), tokens)
    s.add_sum("response_length/mean", response_mask.sum(), rows)
    s.add_sum("response/ended_frac", rollout.ended.sum(), rows)
    s.add_sum("response/trained_frac", kept, rows)
    s.add_sum("advantages/mean", rollout.advantages.double().sum(), tokens)
    s.add_sum("returns/mean", rollout.returns.double().sum(), tokens)
    if rollout.values is not None:
        s.add_sum("values/mean", rollout.values.double().sum(), tokens)
    return s


def evaluate(
    ctx: OnlineContext, hooks: OnlineHooks, eval_examples: list[dict] | None, step: int
) -> dict[str, float]:
    """The caller's ``evaluate`` hook and, with ``data.eval_file``, the built-in held-out figures.

    Runs with every global RNG seeded from (seed, step) and restored afterwards: evaluation never changes
    what training samples, and an interrupted and resumed run evaluates the same samples.
    """
    saved = get_rng_state()
    seed_everything(derived_seed("evaluation", ctx.cfg.seed, step, ctx.accelerator.process_index) % 2**32)
    actor = ctx.roles.actor
    was_training = actor.training
    actor.eval()
    try:
        with torch.no_grad():
            metrics = evaluate_prompts(ctx, eval_examples) if eval_examples else {}
            if hooks.evaluate is not None:
                extra = hooks.evaluate(actor, step)
                clash = sorted(set(extra) & set(metrics))
                if clash:
                    raise ValueError(f"the evaluate hook returned metric names the trainer uses: {clash}")
                metrics.update(extra)
    finally:
        actor.train(was_training)
        set_rng_state(saved)
    return metrics


def evaluate_prompts(ctx: OnlineContext, examples: list[dict]) -> dict[str, float]:
    """One response per held-out prompt at the training temperature: ``eval/score/mean`` (the scorer's raw
    score, over the responses something scored), ``eval/kl/mean`` (nats per response, the trained estimator over each response's trained
    tokens), ``eval/response_length/mean``, ``eval/response/ended_frac``."""
    acc, o = ctx.accelerator, ctx.cfg.online
    s = StatSums(ctx.device)
    mine = examples[acc.process_index :: acc.num_processes]
    size = max(1, ctx.cfg.train.batch_size * o.group_size // acc.num_processes)
    collate = PromptCollator(ctx.tokenizer.pad_token_id)
    for chunk in micro_batches(mine, size):
        b = collate(list(chunk))
        batch = {
            "query_ids": b["input_ids"].to(ctx.device),
            "query_mask": b["attention_mask"].to(ctx.device),
            "records": b["records"],
            "group_ids": torch.arange(len(chunk), device=ctx.device),
        }
        rollout, response_mask, _ = sample_rollout(ctx, batch)
        _, raw_scores, _, scored, _ = score_rollout(ctx, rollout, response_mask, batch["records"])
        _, kl = shape_rewards(
            torch.zeros_like(raw_scores),
            rollout.logprobs,
            rollout.ref_logprobs,
            rollout.mask,
            0.0,
            o.kl_estimator,
        )
        s.add_sum("eval/score/mean", raw_scores[scored].sum(), scored.sum())
        s.add_sum("eval/kl/mean", kl.sum(), len(chunk))
        s.add_sum("eval/response_length/mean", response_mask.sum(), len(chunk))
        s.add_sum("eval/response/ended_frac", rollout.ended.sum(), len(chunk))
    return s.means(ctx)


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


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: actor, critic (and a refreshed reward model), optimizers, schedules, KL controller, RNG.


def _checkpoint_models(ctx: OnlineContext, hooks: OnlineHooks) -> dict[str, torch.nn.Module]:
    models = {"actor": ctx.roles.actor}
    if ctx.roles.critic is not None:
        models["critic"] = ctx.roles.critic
    if hooks.refresh_reward_model is not None:
        models["reward_model"] = ctx.roles.reward_model
    return models


def save(ctx: OnlineContext, run: RunDir, hooks: OnlineHooks, step: int, last_eval: dict[str, float]) -> None:
    """Write ``checkpoints/step-<step>/`` (main process; the others wait)."""
    acc = ctx.accelerator
    acc.wait_for_everyone()
    if not acc.is_main_process:
        return
    state = {
        "kl_controller": ctx.kl_ctl.state_dict(),
        "prompts_seen": step * ctx.cfg.train.batch_size,
        "last_eval": last_eval,
    }
    if ctx.guard is not None:
        state["guard"] = ctx.guard.state_dict()
    if hooks.refresh_reward_model is not None:  # a refresh may re-fit the normalisation in the model's config
        state["reward_normalization"] = list(reward_normalization(ctx.roles.reward_model))
    if hasattr(hooks.refresh_reward_model, "state_dict"):
        state["reward_refresh"] = hooks.refresh_reward_model.state_dict()
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
    state = load_checkpoint(
        run.resume_checkpoint, _checkpoint_models(ctx, hooks), ctx.optimizers, ctx.schedulers
    )
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
