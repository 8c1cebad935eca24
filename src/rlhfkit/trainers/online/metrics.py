"""What the online loop logs beside the update's statistics: each rollout's statistics
(:func:`rollout_stats`, names in :mod:`rlhfkit.trainers.online`'s docstring) and the held-out evaluation
(:func:`evaluate`: the caller's hook and the built-in ``eval/*`` figures of ``data.eval_file``)."""

from __future__ import annotations

import torch

from rlhfkit.algos import sampled_reverse_kl
from rlhfkit.data import PromptCollator
from rlhfkit.engine.seed import get_rng_state, seed_everything, set_rng_state
from rlhfkit.models.sampler import RowStreams
from rlhfkit.trainers.common import micro_batches
from rlhfkit.trainers.online.collect import Scores, sample_rollout, score_rollout
from rlhfkit.trainers.online.context import OnlineContext, StatSums, derived_seed
from rlhfkit.trainers.online.hooks import OnlineHooks
from rlhfkit.trainers.online.layout import reads_reference
from rlhfkit.trainers.online.shaping import measured_kl
from rlhfkit.types import Rollout


def rollout_stats(ctx: OnlineContext, rollout: Rollout, scores: Scores) -> StatSums:
    """Per-rollout statistics (names in the module docstring), as sums to be reduced over processes
    (``.means(ctx)``).

    ``kl/mean`` is the mean over responses (those with a valid token) of sum_t kl_t, in nats per response,
    the unit of the adaptive controller; ``score/mean`` is the score as it enters the rewards and
    ``score/raw_mean`` the scorer's before the missing-EOS rule and clipping, both over the responses that
    something scored; ``score/<part>`` is each part's own mean where it had an opinion (before the
    missing-EOS rule); ``score/penalised_frac`` (under ``missing_eos=penalty``) is the share of all responses
    whose score the rule replaced by ``online.missing_eos_score`` (they did not end); ``score/unscored``
    counts the responses that nothing scored (left out of the loss). Sums are taken in float64:
    a float32 sum of values that nearly cancel (whitened advantages) depends on the order of addition.
    """
    s = StatSums(ctx.device)
    rows, mask = rollout.batch_size, rollout.mask
    kept, tokens = mask.any(1).sum(), mask.sum()
    scored = scores.scored
    s.add_sum("score/mean", rollout.scores[scored].double().sum(), scored.sum())
    s.add_sum("score/raw_mean", scores.raw_scores[scored].double().sum(), scored.sum())
    # A count, not a mean: the weights of all processes add up to 1.
    s.add_sum("score/unscored", (~scored).sum(), 1.0 / ctx.accelerator.num_processes)
    if ctx.cfg.online.missing_eos == "penalty":  # the share of responses whose score the penalty replaced
        s.add_sum("score/penalised_frac", (scored & ~rollout.ended).sum(), rows)
    if len(scores.parts) > 1 or ctx.scorer.functions:  # the same names on every process (one all-reduce)
        for name, values in scores.parts.items():
            known = ~values.isnan()
            s.add_sum(f"score/{name}", values[known].double().sum(), known.sum())
    if reads_reference(ctx.cfg):  # else (distill, no KL to the reference) it was not read
        s.add_sum("kl/mean", rollout.kl.double().sum(), kept)
        s.add_sum("kl/per_token", rollout.kl.double().sum(), tokens)
    s.add_sum("reward/mean", rollout.rewards.double().sum(), kept)
    s.add_sum("entropy/mean", rollout.entropy.double().sum(), tokens)
    s.add_sum("response_length/mean", rollout.response_mask.sum(), rows)
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
            metrics = evaluate_prompts(ctx, eval_examples, step) if eval_examples else {}
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


def evaluate_prompts(ctx: OnlineContext, examples: list[dict], step: int = 0) -> dict[str, float]:
    """One response per held-out prompt at the training temperature: ``eval/score/mean`` (the scorer's raw
    score, over the responses something scored), ``eval/kl/mean`` (nats per response, the trained estimator over each response's trained
    tokens), ``eval/response_length/mean``, ``eval/response/ended_frac``, and with a distillation teacher
    ``eval/distill/teacher_kl`` (log pi - log pi_teacher of the sampled tokens, nats per token). Under ``online.sampler=exact`` a
    prompt's response is drawn from its own stream (seeded from (seed, ``step``), the prompt's index in
    ``examples``), the same on any number of processes."""
    accelerator, online = ctx.accelerator, ctx.cfg.online
    s = StatSums(ctx.device)
    mine = examples[accelerator.process_index :: accelerator.num_processes]
    size = max(1, ctx.cfg.train.batch_size * online.group_size // accelerator.num_processes)
    collate = PromptCollator(ctx.tokenizer.pad_token_id)
    mine_index = torch.arange(accelerator.process_index, len(examples), accelerator.num_processes)
    seed = derived_seed("evaluation-draw", ctx.cfg.seed, step)
    for i, chunk in enumerate(micro_batches(mine, size)):
        b = collate(list(chunk))
        prompt_index = mine_index[i * size : i * size + len(chunk)].to(ctx.device)
        batch = {
            "query_ids": b["input_ids"].to(ctx.device),
            "query_mask": b["attention_mask"].to(ctx.device),
            "records": b["records"],
            "group_ids": torch.arange(len(chunk), device=ctx.device),
            "streams": RowStreams(seed, prompt_index, torch.zeros_like(prompt_index)),
        }
        rollout = sample_rollout(ctx, batch, sync_engine=i == 0)  # vllm: the actor's weights loaded once
        _, raw_scores, _, scored, _ = score_rollout(ctx, rollout, batch["records"], batch.get("episodes"))
        kl = measured_kl(ctx, rollout)
        s.add_sum("eval/score/mean", raw_scores[scored].sum(), scored.sum())
        if reads_reference(ctx.cfg):
            s.add_sum("eval/kl/mean", kl.sum(), len(chunk))
        s.add_sum("eval/response_length/mean", rollout.response_mask.sum(), len(chunk))
        s.add_sum("eval/response/ended_frac", rollout.ended.sum(), len(chunk))
        if rollout.teacher_logprobs is not None:  # distillation: the held-out KL to the teacher
            term = sampled_reverse_kl(rollout.logprobs, rollout.teacher_logprobs, rollout.mask)
            s.add_sum("eval/distill/teacher_kl", term.double().sum(), rollout.mask.sum())
    return s.means(ctx)
