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

import os

import torch

from rlhfkit.models.head_chunks import chunk_size, chunkable
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


# The default micro-batch (:func:`default_micro_batch`): the update's predicted peak above the loaded models
# stays within ACTIVATION_BUDGET_BYTES on a CPU (ACCELERATOR_ACTIVATION_BUDGET_BYTES on a GPU) and within
# MEMORY_FRACTION of the machine's (or the GPU's) memory. On a CPU the update's time per token is flat from a
# few hundred tokens a forward up while every row adds its activations (SmolLM2-135M, bf16: 4% between 8 and
# 16 rows of 48 tokens, 1 GB of peak; docs/performance.md), so the CPU's budget is the smaller.
ACTIVATION_BUDGET_BYTES = 2**30
ACCELERATOR_ACTIVATION_BUDGET_BYTES = 2 * 2**30
MEMORY_FRACTION = 1 / 8

# The terms of :func:`update_peak_bytes`, fitted to the peaks of benchmarks/micro_batch_calibration.py
# (tests/trainers/online/micro_batch_peaks.json; docs/performance.md): bytes a token holds for the backward,
# per decoder layer (plus one for the embeddings and the final norm) in units of the hidden size, in float32 or
# under 16-bit autocast, with LoRA (adapters trained, frozen base) or full fine-tuning. The most measured: 86.2,
# 83.9, 65.1 and 63.2.
LAYER_BYTES_PER_HIDDEN = {
    "float32": {"lora": 94, "full": 92},
    "16-bit": {"lora": 72, "full": 72},
}
# The chunked read-out (rlhfkit.models.head_chunks) holds this many (chunk, V) float32 blocks at once.
READOUT_BLOCKS = 4
# Bytes per trained parameter of the update beyond the loaded weights and AdamW's moments: the gradient
# (float32) and the optimizer step's temporaries.
GRADIENT_BYTES_PER_PARAMETER = 6
# What a micro-batch's update holds whatever its size: the loss's small tensors, the allocator's blocks.
UPDATE_OVERHEAD_BYTES = 8 * 2**20
# Eager attention keeps the (heads, s, s) scores of every layer: Korthikanti et al. 2022 (eq. 1) count 5 a s
# bytes per token and layer in 16 bits; 12 a s for float32 scores and softmax (not measured here: the fused
# kernels, sdpa and flash, keep none).
EAGER_ATTENTION_BYTES = 12


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def activation_bytes_per_token(config, sequence: int, lora: bool = False, half: bool = False) -> int:
    """Bytes one token of a training forward holds for its backward in the decoder: (layers + 1) x
    :data:`LAYER_BYTES_PER_HIDDEN` x the hidden size, plus :data:`EAGER_ATTENTION_BYTES` a s per layer under eager attention. Without
    the vocabulary read-out (:func:`readout_bytes`).

    Args:
        config: the model's transformers config (``hidden_size``, ``num_hidden_layers``, and for eager
            attention ``num_attention_heads``).
        sequence: s, the tokens of a row (prompt + response).
        lora: adapters trained on a frozen base (``model.lora_rank``), else full fine-tuning.
        half: the forward runs under 16-bit autocast (``model.dtype=bfloat16``).
    """
    config = _text_config(config)
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    per_layer = LAYER_BYTES_PER_HIDDEN["16-bit" if half else "float32"]["lora" if lora else "full"] * hidden
    if getattr(config, "_attn_implementation", None) == "eager":
        per_layer += EAGER_ATTENTION_BYTES * int(getattr(config, "num_attention_heads", 1) or 1) * sequence
    return (layers + 1) * per_layer


def readout_bytes(config, tokens: int, chunked: bool = True) -> int:
    """Bytes the vocabulary read-out of ``tokens`` response tokens holds: :data:`READOUT_BLOCKS` float32
    blocks of (min(tokens, chunk), V) for the chunked read-out (:data:`rlhfkit.models.head_chunks.CHUNK_ELEMENTS`
    per block), else the whole float32 logits, their log-softmax and its gradient (12 V per token)."""
    vocab = int(_text_config(config).vocab_size)
    if not chunked:
        return 12 * vocab * tokens
    return READOUT_BLOCKS * 4 * vocab * min(tokens, chunk_size(vocab))


def prompts_held(rows: int, group: int) -> int:
    """The most distinct prompts ``rows`` consecutive rows of the layout hold when whole groups of ``group``
    rows sit together (:func:`group_layout`; 1: no group): ``rows / group`` for micro-batches of whole
    groups, else the groups a window of ``rows`` rows can touch."""
    if group <= 1 or rows <= 1:
        return rows
    return rows // group if rows % group == 0 else min(rows, (rows - 2) // group + 2)


def update_peak_bytes(
    config,
    rows: int,
    prompt: int,
    response: int,
    trained_parameters: int,
    lora: bool = False,
    critic_config=None,
    chunked: bool = True,
    group: int = 1,
    half: bool = False,
) -> int:
    """The predicted peak of one micro-batch's forward, backward and optimizer step above the loaded models
    (with AdamW's moments), an upper bound of every peak measured (tests/trainers/online/micro_batch_peaks.json).

    The actor's activations of its tokens (``rows`` x ``response``, plus ``prompt`` tokens for each distinct
    prompt: a group's prompt is read once, :mod:`rlhfkit.models.prompt_cache`), the critic's of ``rows`` whole
    rows (both forwards make one backward), the actor's read-out of ``rows`` x ``response`` tokens, and
    :data:`GRADIENT_BYTES_PER_PARAMETER` per trained parameter.

    Args:
        config, critic_config: the actor's and (None: no critic) the critic's transformers configs.
        rows: the micro-batch; prompt, response: the tokens of a row's prompt and response (the longest).
        trained_parameters: of the actor and the critic together.
        lora: adapters on a frozen base (``model.lora_rank``); chunked: the read-out is chunked; half: under
            16-bit autocast.
        group: rows of a group that sit together (:func:`group_layout`).
    """
    sequence = prompt + response
    tokens = prompts_held(rows, group) * prompt + rows * response
    out = tokens * activation_bytes_per_token(config, sequence, lora, half)
    if critic_config is not None:
        out += rows * sequence * activation_bytes_per_token(critic_config, sequence, lora, half)
    return (
        out
        + readout_bytes(config, rows * response, chunked)
        + GRADIENT_BYTES_PER_PARAMETER * trained_parameters
        + UPDATE_OVERHEAD_BYTES
    )


def memory_bytes(device: torch.device | str = "cpu") -> int:
    """The memory of the machine the update runs on: a GPU's own, else the physical memory (or the cgroup's
    limit, where it is lower): a property of the machine, so a run and its resume agree."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as f:
                total = min(total, int(f.read().strip()))
        except (OSError, ValueError):  # absent, or "max"
            continue
    return total


def default_micro_batch(ctx: OnlineContext, minibatch_rows: int) -> int:
    """Rows per forward / backward when ``train.micro_batch_size`` is unset: the most rows, up to the
    minibatch, whose :func:`update_peak_bytes` stays within :data:`ACTIVATION_BUDGET_BYTES` on a CPU
    (:data:`ACCELERATOR_ACTIVATION_BUDGET_BYTES` on a GPU) and within :data:`MEMORY_FRACTION` of
    :func:`memory_bytes`, at least 1. Fewer forwards are not slower, so the default takes the largest that
    fits; :func:`micro_batches` then cuts the minibatch into even pieces of at most that many rows.

    The rows are of the longest possible sequence (``data.max_prompt_length`` + ``online.response_length``,
    the same on every process, plus the tokens tools add to a prompt). With a critic (PPO's ``gae``), the
    actor's and the critic's forwards make one loss and one backward, so a row holds both models'
    activations. A model whose read-out is not chunked (:func:`rlhfkit.models.head_chunks.chunkable`)
    counts its whole logits. GRPO-like estimators read a group's prompt once (:func:`prompts_held`). A model
    under 16-bit autocast (:func:`rlhfkit.models.precision.autocast_forward`) holds less per token. An explicit
    ``train.micro_batch_size`` is used as it is (:func:`micro_batches`)."""
    prompt = ctx.cfg.data.max_prompt_length
    if ctx.episodes is not None:  # an episode's prompt also holds what the tools add to it, its own per row
        prompt = ctx.episodes.prompt_limit()
    actor, critic = ctx.roles.actor, ctx.roles.critic
    trained = sum(
        p.numel() for m in (actor, critic) if m is not None for p in m.parameters() if p.requires_grad
    )
    device = torch.device(getattr(ctx, "device", "cpu"))
    ceiling = ACTIVATION_BUDGET_BYTES if device.type == "cpu" else ACCELERATOR_ACTIVATION_BUDGET_BYTES
    budget = min(ceiling, int(MEMORY_FRACTION * memory_bytes(device)))
    shape = dict(
        config=hf_model(actor).config,
        prompt=prompt,
        response=ctx.cfg.online.response_length,
        trained_parameters=trained,
        lora=bool(ctx.cfg.model.lora_rank),
        critic_config=None if critic is None else hf_model(critic).config,
        chunked=chunkable(actor),
        group=group_layout(ctx) if ctx.episodes is None else 1,
        half=any(
            getattr(m, "rlhfkit_autocast", None) not in (None, torch.float32)
            for m in (actor, hf_model(actor))
        ),
    )
    # From the top: with groups the peak is not monotone in the rows (4 rows of a group hold one prompt, 3
    # rows may straddle two groups).
    for rows in range(max(1, minibatch_rows), 1, -1):
        if update_peak_bytes(rows=rows, **shape) <= budget:
            return rows
    return 1


def micro_batches(
    ctx: OnlineContext, step: int, epoch: int, lengths: torch.Tensor
) -> list[list[torch.Tensor]]:
    """The micro-batches of each minibatch of ``epoch`` of rollout ``step``: local row indices.

    Each minibatch of :func:`local_minibatches` is sorted by ``lengths`` (stable, so ties keep the shuffled
    order) and cut into ``train.micro_batch_size`` rows; without it, into the fewest micro-batches of at most
    :func:`default_micro_batch` rows, of even sizes (:func:`even_sizes`; in whole groups where the layout
    keeps them).

    Args:
        lengths: (B,) the length of each local row (:func:`row_lengths`).
    Returns:
        one list per minibatch (possibly empty: this process holds no row of it) of (b,) long tensors.
    """
    first, local, total = ctx.rows()
    explicit = ctx.cfg.train.micro_batch_size
    micro = max(explicit or default_micro_batch(ctx, local // ctx.cfg.online.num_minibatches), 1)
    g = group_layout(ctx)
    whole_groups = g > 1 and first % g == 0 and local % g == 0
    if whole_groups:  # sort whole groups, by their longest row
        lengths = lengths.view(-1, g).amax(1).repeat_interleave(g)
    out = []
    for rows in local_minibatches(ctx, step, epoch):
        rows = rows[torch.argsort(lengths[rows], stable=True)]
        if not rows.numel():  # split([]) is [[]]
            out.append([])
        elif explicit:
            out.append(list(rows.split(micro)))
        else:  # as many forwards as the largest fitting size needs, of even sizes: a lower peak, no more work
            unit = g if whole_groups and micro >= g and rows.numel() % g == 0 else 1
            sizes = even_sizes(rows.numel() // unit, micro // unit)
            out.append(list(rows.split([s * unit for s in sizes])))
    return out


def even_sizes(n: int, most: int) -> list[int]:
    """``n`` items cut into the fewest pieces of at most ``most`` items, of sizes that differ by at most one,
    the larger first (they take the shorter rows of a length-sorted minibatch). ``even_sizes(32, 24)`` is
    ``[16, 16]`` where cutting by ``most`` would give ``[24, 8]``: as many forwards, a third less peak."""
    count = -(-n // max(most, 1))
    base, extra = divmod(n, count)
    return [base + 1] * extra + [base] * (count - extra)


def old_logprobs_from_update(ctx: OnlineContext, step: int) -> bool:
    """Whether rollout ``step`` takes its old log-probs (and logged entropies) from the update's own forward.

    With one PPO epoch of one minibatch the old log-probs are the log-probs of the update's first (and only)
    forward, so that forward can give them, detached: the ratio is 1 by construction and the separate no-grad
    forward of the actor is saved (``online.old_logprobs_from_update``). Only where nothing reads them before
    the update: the per-token rewards do not (the KL is in the loss, or kl_coef is 0 with no adaptive
    target, and no distillation teacher's term is in them: `train distill` with a full-vocabulary loss may),
    the engine's log-prob gap and rollout correction do not (generation_backend=hf), and the actor is trained
    this rollout (not during the critic warm-up); never with ``online.max_staleness`` > 0, whose old log-probs
    are the ones the samples were drawn with (:mod:`rlhfkit.trainers.online.async_loop`). The teacher's
    ``distill/teacher_kl`` is then logged after the update (:func:`rlhfkit.trainers.online.shaping.teacher_stats`).
    """
    online = ctx.cfg.online
    return bool(
        online.old_logprobs_from_update
        and online.ppo_epochs == 1
        and online.num_minibatches == 1
        and (online.kl_in_loss or (online.kl_coef == 0 and online.kl_target is None))
        and not teacher_in_rewards(ctx.cfg)  # the teacher's sampled term reads them at stage 3
        and not online.max_staleness  # asynchronous: they are the behaviour policy's, sampled elsewhere
        and ctx.engine is None
        and step > online.critic_warmup_steps
        and "actor" in ctx.trained
    )


def teacher_read_in_update(ctx: OnlineContext) -> bool:
    """Whether an update whose old log-probs are its own (:func:`old_logprobs_from_update`) reads the student and
    the teacher in one pass (:func:`rlhfkit.models.distill_readout.teacher_divergence` with ``readout``): in
    `train distill` with a full-vocabulary ``distill.loss``, whose divergence needs both models' logits anyway.
    The student then runs once a micro-batch, not once for its log-probs and again for the divergence, and the
    teacher's log-probs of the sampled tokens come from that pass, not from a stage-1 read. Not for a mixture of
    experts with a router loss, which the student's own read-out gives."""
    return bool(ctx.roles.teacher is not None and not teacher_in_rewards(ctx.cfg) and not ctx.router_aux_coef)


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
