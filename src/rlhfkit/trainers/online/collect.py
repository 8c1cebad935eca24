"""Stages 1 and 2 of the online loop, called in order by :func:`rlhfkit.trainers.online.train_online`.

- :func:`prompt_batch`: the prompts of a rollout, a stateless function of (seed, step);
- :func:`sample_rollout` (stage 1): sample responses, cut them at the stop token, and read the actor's and
  the reference's (and a distillation teacher's) log-probs, the actor's entropy and the critic's values of the
  sampled tokens, at the sampling temperature; the rollout carries its response mask and entropy;
- :func:`score_rollout` (stage 2): the reward model and/or reward functions, the missing-EOS rule, clipping.

Stages 3 and 4 (KL-shaped rewards, advantages) are in :mod:`rlhfkit.trainers.online.shaping`, stage 5 (the
PPO epochs) in :mod:`rlhfkit.trainers.online.ppo_update`. The no-grad forwards of a rollout read the unwrapped
models, without the columns no row uses (:func:`rlhfkit.trainers.online.context.model_inputs`).

Shapes: ``B`` responses of this process, ``P`` padded prompt length, ``T`` response length (the longest
response of the rollout), ``V`` vocabulary.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from rlhfkit.algos.masked import fill_masked
from rlhfkit.config import RunConfig
from rlhfkit.data import PromptCollator
from rlhfkit.models import can_share_prompts, response_readout, sampling_for
from rlhfkit.models.precision import frozen_linears_cast
from rlhfkit.models.sampler import RowStreams
from rlhfkit.models.sampling import untruncated
from rlhfkit.rollout import generate_responses
from rlhfkit.rollout.episodes import EpisodeRunner, Episodes, run_episodes
from rlhfkit.rollout.sandbox import uses_sandbox
from rlhfkit.rollout.scoring import check_function_scores, combine_parts
from rlhfkit.rollout.tools import Toolbox
from rlhfkit.trainers.common import batch_indices
from rlhfkit.trainers.online.context import (
    OnlineContext,
    StageClock,
    StatSums,
    critic_values,
    derived_seed,
    model_inputs,
    stop_token_ids,
)
from rlhfkit.trainers.online.engine_rollout import generate_pieces
from rlhfkit.trainers.online.layout import (
    micro_batches,
    old_logprobs_from_update,
    reads_reference,
    row_lengths,
    teacher_read_in_update,
)
from rlhfkit.trainers.online.sharding import generation_model, is_sharded, reshard
from rlhfkit.types import Rollout


def prompt_batch(ctx: OnlineContext, examples: list[dict], step: int, stream: int = 0) -> dict[str, Any]:
    """This process's prompts of rollout ``step`` (1-based), each repeated ``online.group_size`` times.

    The batch is ``rlhfkit.trainers.common.batch_indices`` of (seed, step): resuming needs only the step
    (docs/known-bugs.md, 11). ``stream`` > 0 draws from another order of the prompts, seeded from (seed,
    stream): the extra prompts of dynamic sampling's round ``stream`` (:mod:`rlhfkit.trainers.online.dynamic`).
    Each process takes a contiguous slice, so a prompt's group lives on one process.

    Returns:
        ``query_ids`` (B, P) left padded, ``query_mask`` (B, P), ``records`` (B data rows), ``group_ids``
        (B,) long (the prompt's position in the global batch), ``streams`` (the rows' random streams under
        ``online.sampler=exact``: seeded from (seed, step, stream), a row's prompt's place in the global batch
        and its sample of that prompt; the same on any number of processes).
    """
    cfg, accelerator = ctx.cfg, ctx.accelerator
    seed = cfg.seed if stream == 0 else derived_seed("dynamic-sampling", cfg.seed, stream) % 2**31
    indices = batch_indices(len(examples), cfg.train.batch_size, step, seed, cfg.data.shuffle or stream > 0)
    local = len(indices) // accelerator.num_processes
    first = accelerator.process_index * local
    batch = PromptCollator(ctx.tokenizer.pad_token_id)([examples[i] for i in indices[first : first + local]])
    g = cfg.online.group_size
    group_ids = torch.arange(first, first + local, device=ctx.device).repeat_interleave(g)
    sample_index = torch.arange(g, device=ctx.device).repeat(local)
    return {
        "query_ids": batch["input_ids"].repeat_interleave(g, 0).to(ctx.device),
        "query_mask": batch["attention_mask"].repeat_interleave(g, 0).to(ctx.device),
        "records": [record for record in batch["records"] for _ in range(g)],
        "group_ids": group_ids,
        "streams": RowStreams(derived_seed("draw", cfg.seed, step, stream), group_ids, sample_index),
    }


@torch.no_grad()
def sample_rollout(
    ctx: OnlineContext,
    batch: dict[str, Any],
    clock: StageClock | None = None,
    step: int | None = None,
    actor_forward: bool | None = None,
    sync_engine: bool = True,
) -> Rollout:
    """Stage 1: sample one response per row of ``batch`` and read log-probs and values at sampling time.

    The responses are cut after their first stop token (the token is inside the mask, also when pad ==
    EOS). Under ``online.missing_eos=mask`` a response without a stop token gets an all-False ``mask``
    (it trains nothing). Log-probs of the actor (``logprobs``, the PPO ``old_logprobs``) and of the
    reference are recomputed from the models themselves under the sampling's processing (``ctx.sampling``:
    temperature, suppressed pad, top-k / top-p), never taken from ``generate`` (OpenRLHF PR #853;
    huggingface/trl#2358).

    With ``step`` (a rollout the PPO update will train on), the no-grad forwards run on the micro-batches of
    the update's first epoch (:func:`rlhfkit.trainers.online.layout.micro_batches`: the same rows, order and
    columns), so the first epoch recomputes exactly these log-probs, in bf16 too; without it (evaluation),
    on chunks of ``online.rollout_batch_size`` rows. ``actor_forward=False`` (default: when
    :func:`~rlhfkit.trainers.online.layout.old_logprobs_from_update` says so for ``step``) skips the actor's
    forward: ``logprobs`` and ``entropy`` stay 0 until the update's own forward fills them in (and so do
    ``teacher_logprobs`` where that forward reads the teacher too: ``layout.teacher_read_in_update``).
    ``sync_engine=False`` (vllm): sample from the weights already in the engine, which the caller loaded
    since the actor last moved (dynamic sampling's extra rounds; an evaluation's later chunks).

    Returns:
        the rollout with ``logprobs``, ``ref_logprobs``, ``teacher_logprobs`` (``online.teacher_model``
        only), ``values`` (critic only), ``group_ids``, ``ended``,
        ``response_mask`` ((B, T) bool: the response up to its stop token, also for masked-out responses;
        what the reward model reads) and ``entropy`` ((B, T): the actor's entropy at each valid token).
    """
    online, roles = ctx.cfg.online, ctx.roles
    n = batch["query_ids"].shape[0]
    size = online.rollout_batch_size or n
    clock = clock or StageClock()
    pieces = []
    if ctx.episodes is not None:  # tools: multi-turn episodes; the model's tokens only are trained
        model_mask, response_mask, response_ids, ended = play_episodes(ctx, batch, clock, sync=sync_engine)
        width = response_mask.shape[1]
    else:
        pieces = generate_pieces(  # hf or vllm (generation_backend)
            ctx, batch, size, clock, generate_responses, sync=sync_engine
        )
        response_mask = torch.cat([p.mask for p in pieces])  # (B, R)
        width = max(int(response_mask.sum(1).max()), 1)  # T: the longest response
        response_mask = response_mask[:, :width]
        response_ids = torch.cat([p.response_ids for p in pieces])[:, :width]  # (B, T)
        ended = torch.cat([p.ended for p in pieces])  # (B,)
        model_mask = response_mask
    mask = model_mask & ended[:, None] if online.missing_eos == "mask" else model_mask

    def zeros():
        return torch.zeros(n, width, device=ctx.device)

    logprobs, ref_logprobs, entropy = zeros(), zeros(), zeros()
    teacher_logprobs = zeros() if roles.teacher is not None else None
    if actor_forward is None:  # else the update's own forward gives them (layout.old_logprobs_from_update)
        actor_forward = step is None or not old_logprobs_from_update(ctx, step)
    # distillation with a full-vocabulary loss: that forward reads the teacher too (layout.teacher_read_in_update)
    teacher_forward = teacher_logprobs is not None and (actor_forward or not teacher_read_in_update(ctx))
    reference = reads_reference(ctx.cfg)  # else (distill, no KL to it) the actor's own: a KL of exactly 0
    values = zeros() if roles.critic is not None else None
    for model in (roles.actor, roles.critic):
        if model is not None:
            model.eval()
    # The actor's read-out shares a group's prompt exactly where the update's forward does (a DDP-wrapped actor
    # does not), so both take the same kernels; the reference's always may.
    share = online.group_size > 1
    share_actor = share and can_share_prompts(ctx.trained["actor"])
    with clock("forward"), frozen_linears_cast(roles.actor):  # a LoRA base in bf16 once, not each forward
        for rows in _forward_rows(ctx, step, batch["query_mask"], response_mask, size):
            ids, attn, start, w = model_inputs(
                batch["query_ids"][rows], batch["query_mask"][rows], response_ids[rows], response_mask[rows]
            )
            # chunked over the vocabulary: no (b, w, V) logits (rlhfkit.models.head_chunks)
            # a group's prompt read once (rlhfkit.models.prompt_cache), as in the update's forward
            if actor_forward:
                actor = response_readout(
                    roles.actor, ids, attn, start, ctx.sampling, entropy=True, share_prompts=share_actor
                )
                logprobs[rows, :w], entropy[rows, :w] = actor.logprobs, actor.entropy  # (b, w)
            if reference:
                ref_logprobs[rows, :w] = response_readout(
                    roles.reference, ids, attn, start, ctx.sampling, share_prompts=share
                ).logprobs
            if teacher_forward:  # distillation: the teacher reads the row as the reference does
                teacher_logprobs[rows, :w] = response_readout(  # untruncated: every sampled token has a
                    roles.teacher, ids, attn, start, untruncated(ctx.sampling), share_prompts=share
                ).logprobs  # probability under the teacher, whatever its own top-k / top-p would keep
            if values is not None:
                values[rows, :w] = critic_values(roles.critic, ids, attn, start)
    reshard(roles)  # sharded: the trained roots, kept gathered for a backward that no-grad forwards lack
    rollout = Rollout(
        query_ids=batch["query_ids"],
        query_mask=batch["query_mask"],
        response_ids=response_ids,
        mask=mask,
        logprobs=fill_masked(logprobs, mask),
        ref_logprobs=fill_masked(ref_logprobs if reference else logprobs.clone(), mask),
        values=None if values is None else fill_masked(values, mask),
        group_ids=batch["group_ids"],
        ended=ended,
        response_mask=response_mask,
        entropy=fill_masked(entropy, mask),
        teacher_logprobs=None if teacher_logprobs is None else fill_masked(teacher_logprobs, mask),
    )
    if ctx.engine is not None:  # the engine's own log-probs of its tokens (rollout correction, the gap)
        engine_logprobs = (  # (B, T)
            batch["episodes"].sampled_logprobs.to(ctx.device)
            if ctx.episodes is not None
            else torch.cat([p.sampled_logprobs for p in pieces])[:, :width]
        )
        rollout.engine_logprobs = fill_masked(engine_logprobs, mask)
    return rollout


def episode_runner(cfg: RunConfig, tokenizer, toolbox: Toolbox | None = None) -> EpisodeRunner | None:
    """The run's multi-turn episode runner under ``online.tools`` / ``online.environment`` (else None), made at
    start-up, before any model loads: a bad tool, environment or chat template is a ConfigError here.
    ``toolbox``: the run's tools already loaded (:func:`rlhfkit.rollout.preflight.check_scoring`)."""
    online = cfg.online
    if not online.tools and not online.environment:
        return None
    toolbox = toolbox or Toolbox.load(
        online.tools, online.environment, timeout=online.tool_timeout, memory_mb=online.tool_memory_mb
    )
    stops = stop_token_ids(cfg, tokenizer)
    return EpisodeRunner.create(
        tokenizer,
        toolbox,
        max_turns=online.max_turns,
        response_length=online.response_length,
        tool_timeout=online.tool_timeout,
        max_tool_response_length=online.max_tool_response_length,
        stop_token_ids=stops,
        pad_token_id=tokenizer.pad_token_id,
        sampling=sampling_for(tokenizer.pad_token_id, stops, online.temperature, online.top_k, online.top_p),
        max_prompt_length=cfg.data.max_prompt_length,
        truncation=cfg.data.truncation,
    )


def start_sandbox(cfg: RunConfig) -> None:
    """When a tool or reward function runs model-written code (``rlhfkit:python``, ``rlhfkit:code_tests``):
    set up and check the sandbox (``online.sandbox``) at start-up, a ConfigError naming the package when
    bubblewrap is missing; ``online.sandbox=none`` is warned. Its runs stop a little before the tool timeout,
    so that the model reads the sandbox's own account of the limit rather than the tool process's."""
    online = cfg.online
    if not uses_sandbox([*online.tools, *online.reward_functions]):
        return
    from rlhfkit.rollout import sandbox

    sandbox.configure(online.sandbox, timeout=0.75 * online.tool_timeout, memory_mb=online.tool_memory_mb)
    if online.sandbox == "none":
        warnings.warn(
            "online.sandbox=none: model-written code runs as a plain child process with limits only, not "
            "isolated from this machine's files and network (docs/tools.md)",
            UserWarning,
            stacklevel=2,
        )


def play_episodes(
    ctx: OnlineContext, batch: dict[str, Any], clock: StageClock, greedy: bool = False, sync: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's generation as multi-turn episodes (:func:`rlhfkit.rollout.episodes.run_episodes`), one per row
    of ``batch``, each prompt rendered by the runner with the tools (the data layer's rendering is replaced:
    ``batch["query_ids"]`` / ``["query_mask"]`` become the episodes', and ``batch["episodes"]`` holds them for
    scoring and the logs). With the vllm backend each turn's rows go to the engine as token-id prompts
    (:func:`rlhfkit.rollout.vllm_engine.engine_generate`), after the actor's weights are loaded into it (not
    with ``sync=False``: :func:`sample_rollout`'s ``sync_engine``).

    Returns:
        (model_mask (B, T) bool: the sampled tokens only, response_mask (B, T) bool: every token of the row,
        response_ids (B, T), ended (B,) bool), on the run's device.
    """
    records = batch["records"]
    generate = generate_responses  # looked up here: tests replace it
    if ctx.engine is not None:
        from rlhfkit.rollout.vllm_engine import engine_generate

        if sync:
            with clock("weight_sync"):
                ctx.engine.load_weights(ctx.roles.actor)
        generate = engine_generate(ctx.engine)  # one base seed per turn from the rollout's seeded generator
    with clock("generate"), generation_model(ctx, engine=ctx.engine is not None) as actor:
        episodes = run_episodes(
            ctx.episodes,
            actor,
            [r["prompt"] for r in records],
            records,
            greedy=greedy,
            generate=generate,
            rollout_batch_size=ctx.cfg.online.rollout_batch_size,
            streams=batch.get("streams"),
        )
    device = ctx.device
    batch["query_ids"], batch["query_mask"] = episodes.query_ids.to(device), episodes.query_mask.to(device)
    batch["episodes"] = episodes
    return (
        episodes.mask.to(device),
        episodes.response_mask.to(device),
        episodes.response_ids.to(device),
        episodes.ended.to(device),
    )


def episode_stats(ctx: OnlineContext, episodes: Episodes | None) -> StatSums:
    """The episodes' ``tools/*``, ``turns/mean`` and ``episodes/*`` (:func:`rlhfkit.rollout.episodes.episode_metrics`)
    as sums over processes: every process adds the same names (each known tool's count, also when 0)."""
    stats = StatSums(ctx.device)
    if episodes is None:
        return stats
    n = len(episodes.records)
    calls = sum(len(r.calls) for r in episodes.records)
    values = episodes.metrics()
    for name, value in values.items():
        if name.startswith("tools/errors"):  # shares of the calls
            stats.add_sum(name, value * calls, calls)
        elif not name.startswith("tools/calls/"):
            stats.add_sum(name, value * n, n)
    for tool in ctx.episodes.toolbox.names:
        stats.add_sum(f"tools/calls/{tool}", values.get(f"tools/calls/{tool}", 0.0) * n, n)
    return stats


def episode_samples(rows: list[dict], episodes: Episodes | None) -> list[dict]:
    """``samples.jsonl`` rows with each episode's ``turns`` (its model turns and tool calls, in order)."""
    if episodes is None:
        return rows
    return [{**row, "turns": record.turns} for row, record in zip(rows, episodes.records, strict=False)]


@torch.no_grad()
def critic_read(ctx: OnlineContext, rollout: Rollout, step: int | None) -> torch.Tensor:
    """(B, T) the critic's values of ``rollout``'s responses (0 under the mask), read on stage 1's row groups as
    :func:`sample_rollout` reads them: for a rollout sampled by another process
    (:mod:`rlhfkit.trainers.online.async_loop`), whose trainer holds the critic."""
    critic, (n, width) = ctx.roles.critic, rollout.mask.shape
    critic.eval()
    values = torch.zeros(n, width, device=ctx.device)
    size = ctx.cfg.online.rollout_batch_size or n
    for rows in _forward_rows(ctx, step, rollout.query_mask, rollout.response_mask, size):
        q, qm, r, rm = (
            x[rows]
            for x in (rollout.query_ids, rollout.query_mask, rollout.response_ids, rollout.response_mask)
        )
        ids, attn, start, w = model_inputs(q, qm, r, rm)
        values[rows, :w] = critic_values(critic, ids, attn, start)
    return fill_masked(values, rollout.mask)


def _forward_rows(
    ctx: OnlineContext, step: int | None, query_mask: torch.Tensor, response_mask: torch.Tensor, size: int
) -> list[torch.Tensor]:
    """The row groups of stage 1's forwards: the update's first-epoch micro-batches for rollout ``step``, else
    consecutive chunks of ``size`` rows. Returns (b,) long tensors that hold every row once."""
    n = query_mask.shape[0]
    # Sharded, each forward is a collective: every process must make as many, and the update's micro-batch
    # counts differ between processes, so stage 1 keeps the equal chunks there (the ratio is then exact to
    # float rounding, not to the bit).
    if step is None or is_sharded(ctx):
        return list(torch.arange(n, device=query_mask.device).split(size))
    if n != ctx.rows()[1]:
        raise ValueError(f"a rollout of step {step} has {ctx.rows()[1]} rows on this process, got {n}")
    groups = [
        rows
        for micros in micro_batches(ctx, step, 0, row_lengths(query_mask, response_mask))
        for rows in micros
    ]
    return groups


class Scores(NamedTuple):
    """What stage 2 gives (:func:`score_rollout`), for the rollout (:func:`take_scores`) and the logs.

    Attributes:
        scores: (B,) float32, as they enter the rewards (after the missing-EOS rule and clipping).
        raw_scores: (B,) the sum of the scorer's parts, before the missing-EOS rule and clipping.
        parts: name -> (B,), NaN where a function had no opinion.
        scored: (B,) bool, False where no part had an opinion (such a response is left out of the loss).
        responses: the decoded responses, or None when nothing needed them.
    """

    scores: torch.Tensor
    raw_scores: torch.Tensor
    parts: dict[str, torch.Tensor]
    scored: torch.Tensor
    responses: list[str] | None


def score_rollout(
    ctx: OnlineContext, rollout: Rollout, records: list[dict], episodes: Episodes | None = None
) -> Scores:
    """Stage 2: score each response; apply ``online.missing_eos`` and ``online.score_clip``.

    Multi-turn ``episodes`` (:func:`play_episodes`): reward functions also receive each episode's messages as
    ``completions=`` and its environment as ``environments=``, and an environment's ``get_reward()`` is the
    part ``"environment"`` of the score, added to the others (NaN, no opinion, where it has none or a tool's
    timeout stopped it), checked as a reward function's values are (NaN, inf or a non-number stops the run
    naming it). The episodes' tool processes are closed here.

    The reward model reads each response up to its stop token (``rollout.response_mask``), also one that
    ``missing_eos=mask`` leaves out of the loss. Under ``missing_eos=penalty`` a response without a stop
    token scores ``online.missing_eos_score`` whatever it says (the N+ "EOS trick", Huang et al. 2024).
    """
    online = ctx.cfg.online
    response_mask = rollout.response_mask
    ids, attn, _, _ = model_inputs(rollout.query_ids, rollout.query_mask, rollout.response_ids, response_mask)
    texts, responses = {}, None
    if ctx.scorer.needs_text:
        kept = [row[m].tolist() for row, m in zip(rollout.response_ids, response_mask, strict=True)]
        responses = ctx.tokenizer.batch_decode(kept, skip_special_tokens=True)
        texts = {
            "prompts": [r["prompt"] for r in records],
            "records": records,
            "responses": responses,
            "completion_ids": kept,
        }
    extra = {}
    if episodes is not None:
        extra = {"episodes": {"completions": episodes.completions, "environments": episodes.environments}}
    parts: dict[str, torch.Tensor] = {}
    if ctx.scorer.reward_model is not None or ctx.scorer.functions:
        _, parts, _ = ctx.scorer(ids, attn, **texts, **(extra if ctx.scorer.needs_text else {}))
    if episodes is not None and episodes.environments and any(e is not None for e in episodes.environments):
        found = episodes.environment_scores(online.tool_timeout)  # checked like a reward function's
        prompts = [r["prompt"] for r in records]
        shown = responses or [c[-1]["content"] if c else "" for c in episodes.completions]
        checked = check_function_scores(found, len(found), "environment.get_reward", prompts, shown)
        parts["environment"] = checked.to(ids.device)  # (B,) NaN where no opinion
    if episodes is not None:
        episodes.close()  # the episodes' tool processes: nothing reads their environments after this
    if parts:
        raw_scores, scored = combine_parts(parts, ctx.scorer.part_weights)
    else:  # distillation or a PRM alone: the teacher's term or the step rewards are the whole reward (stage 3)
        raw_scores = torch.zeros(len(records), device=ids.device)
        scored = torch.ones(len(records), dtype=torch.bool, device=ids.device)
    scores = raw_scores
    if online.missing_eos == "penalty":
        scores = torch.where(rollout.ended, scores, torch.full_like(scores, online.missing_eos_score))
    if online.score_clip is not None:
        scores = scores.clamp(-online.score_clip, online.score_clip)
    return Scores(scores, raw_scores, parts, scored, responses)


def take_scores(rollout: Rollout, scores: Scores) -> None:
    """Put stage 2's scores on the rollout; a response that nothing scored leaves every loss (its mask, and
    its entropy, are cleared)."""
    rollout.scores = scores.scores
    rollout.mask = rollout.mask & scores.scored[:, None]
    rollout.entropy = fill_masked(rollout.entropy, rollout.mask)
