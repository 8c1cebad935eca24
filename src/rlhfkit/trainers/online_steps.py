"""The stages of one online-RL iteration, called in order by :mod:`rlhfkit.trainers.online`.

- :func:`prompt_batch`: the prompts of a rollout, a stateless function of (seed, step);
- :func:`sample_rollout` (stage 1): sample responses, cut them at the stop token, and read the actor's and
  the reference's log-probs and the critic's values of the sampled tokens, at the sampling temperature;
- :func:`score_rollout` (stage 2): the reward model and/or reward functions, the missing-EOS rule, clipping;
- :func:`ppo_update` (stage 5): PPO epochs over shuffled minibatches with gradient accumulation.

Stages 3 and 4 are one call each into :mod:`rlhfkit.algos` and stay in the loop.

Every forward pass here drops the columns that no row of its (micro-)batch uses (prompt padding on the
left, response padding on the right: :func:`model_inputs`); position ids come from the attention mask, so
this changes no valid output beyond float rounding. The no-grad forwards of a rollout read the unwrapped
models; the training forwards go through the accelerate-prepared ones (DDP synchronises gradients).

Shapes: ``B`` responses of this process, ``P`` padded prompt length, ``T`` response length (the longest
response of the rollout), ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfkit.algos import (
    aggregate_loss,
    entropy_from_logits,
    kl_estimator,
    loss_normalizer,
    ppo_policy_loss,
    value_loss,
)
from rlhfkit.algos.masked import fill_masked
from rlhfkit.data import PromptCollator
from rlhfkit.engine.accel import all_sum, dp_scale
from rlhfkit.models import (
    Sampling,
    processed_logits,
    response_forward,
    response_logits,
    response_values,
    sampled_logprobs,
    set_update_mode,
)
from rlhfkit.rollout import generate_responses
from rlhfkit.rollout.scoring import Scorer, reward_normalization
from rlhfkit.trainers.loop import batch_indices
from rlhfkit.trainers.online_roles import Roles
from rlhfkit.types import Rollout


@dataclass
class OnlineContext:
    """Everything the stages share.

    Attributes:
        cfg: the :class:`rlhfkit.config.RunConfig`.
        accelerator: the run's ``accelerate.Accelerator``.
        tokenizer: the policy's tokenizer.
        roles: the four models, unwrapped (for no-grad forwards, generation, saving).
        trained: ``"actor"`` / ``"critic"`` -> the model as prepared by accelerate (for training forwards).
        optimizers, schedulers: ``"actor"`` / ``"critic"`` -> AdamW and its LR schedule.
        scorer: scores responses (reward model and/or reward functions).
        kl_ctl: a Fixed- or AdaptiveKLController (``.value`` is the current coefficient).
        stop_token_ids: the ids that end a response.
        sampling: how responses are sampled, and scored (temperature, top-k / top-p, the pad token
            suppressed): :mod:`rlhfkit.models.sampling`.
        router_aux_coef: weight of the actor's router load-balancing loss in the update (0: none).
        process_reward_model: the frozen PRM of ``online.process_reward_model``, or None.
        step_end_table: ``(V,)`` bool, the token ids that end a step (with a PRM).
    """

    cfg: Any
    accelerator: Any
    tokenizer: Any
    roles: Roles
    trained: dict[str, torch.nn.Module]
    optimizers: dict[str, Any]
    schedulers: dict[str, Any]
    scorer: Scorer
    kl_ctl: Any
    stop_token_ids: list[int]
    sampling: Sampling
    router_aux_coef: float = 0.0
    guard: Any = None  # the run's rlhfkit.engine.guards.FiniteGuard (its state is checkpointed)
    process_reward_model: torch.nn.Module | None = None
    step_end_table: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over processes in one all-reduce (a float64 copy on one process)."""
        return all_sum(self.accelerator, values)

    def rows(self) -> tuple[int, int, int]:
        """(first, local, total): this process holds rows [first, first + local) of every rollout's ``total``
        responses (:func:`prompt_batch` gives each process a contiguous slice)."""
        total = self.cfg.train.batch_size * self.cfg.online.group_size
        local = total // self.accelerator.num_processes
        return self.accelerator.process_index * local, local, total


class StatSums:
    """Weighted means of statistics: ``add(name, value, weight)`` or ``add_sum(name, total, count)``;
    :meth:`means` gives sum(value * weight) / sum(weight) (0 when the weights sum to 0).

    Values stay tensors until :meth:`means`, which sums over processes in one all-reduce (so a rollout
    costs one host synchronisation for its statistics, not one per micro-batch).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        value = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach()
        self.add_sum(name, value * weight, weight)

    def add_sum(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
        """Add ``total`` to the numerator and ``count`` to the denominator of ``name``."""
        pair = torch.stack(
            [torch.as_tensor(x, dtype=torch.float64, device=self.device).detach() for x in (total, count)]
        )  # (2,)
        self.sums[name] = self.sums[name] + pair if name in self.sums else pair

    def merge(self, other: StatSums) -> StatSums:
        """Add ``other``'s sums to these (so that two sets of statistics cost one all-reduce)."""
        for name, pair in other.sums.items():
            self.sums[name] = self.sums[name] + pair if name in self.sums else pair
        return self

    def means(self, ctx: OnlineContext) -> dict[str, float]:
        if not self.sums:
            return {}
        names = sorted(self.sums)  # one order on every process (they may have met the names in another)
        packed = ctx.all_sum(torch.stack([self.sums[n] for n in names])).cpu()  # (K, 2)
        return {n: float(s / w) if w > 0 else 0.0 for n, (s, w) in zip(names, packed.tolist(), strict=True)}


def prompt_batch(ctx: OnlineContext, examples: list[dict], step: int) -> dict[str, Any]:
    """This process's prompts of rollout ``step`` (1-based), each repeated ``online.group_size`` times.

    The batch is ``loop.batch_indices`` of (seed, step): resuming needs only the step
    (docs/known-bugs.md, 11).
    Each process takes a contiguous slice, so a prompt's group lives on one process.

    Returns:
        ``query_ids`` (B, P) left padded, ``query_mask`` (B, P), ``records`` (B data rows), ``group_ids``
        (B,) long (the prompt's position in the global batch).
    """
    cfg, acc = ctx.cfg, ctx.accelerator
    indices = batch_indices(len(examples), cfg.train.batch_size, step, cfg.seed, cfg.data.shuffle)
    local = len(indices) // acc.num_processes
    first = acc.process_index * local
    batch = PromptCollator(ctx.tokenizer.pad_token_id)([examples[i] for i in indices[first : first + local]])
    g = cfg.online.group_size
    return {
        "query_ids": batch["input_ids"].repeat_interleave(g, 0).to(ctx.device),
        "query_mask": batch["attention_mask"].repeat_interleave(g, 0).to(ctx.device),
        "records": [record for record in batch["records"] for _ in range(g)],
        "group_ids": torch.arange(first, first + local, device=ctx.device).repeat_interleave(g),
    }


def critic_values(
    critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_start: int
) -> torch.Tensor:
    """V(x, y_<t) for every response position, (b, R) float32: the head's output under the normalisation
    stored in the critic's config, as the reward model's scores are read (a critic made from a reward model
    then starts at the normalised scores; Huang et al. 2024 initialise the critic from the reward model)."""
    gain, bias = reward_normalization(critic)
    return response_values(critic, input_ids, attention_mask, response_start).float() * gain + bias


def model_inputs(
    query_ids: torch.Tensor, query_mask: torch.Tensor, response_ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Prompt + response as one model input, without the columns that no row uses.

    Args:
        query_ids, query_mask: (b, P) left-padded prompts.
        response_ids, mask: (b, T) responses and the response attention (True on real tokens).
    Returns:
        (input_ids (b, P' + W), attention_mask (b, P' + W), response_start P', W): P' drops the prompt
        columns that are padding in every row, W (>= 1) the response columns after the last real token.
    """
    used = query_mask.bool().any(0)  # (P,); left padding: the unused columns are a prefix
    cut = int(used.to(torch.int8).argmax()) if bool(used.any()) else 0
    any_token = mask.any(0)  # (T,)
    width = int(any_token.nonzero().max()) + 1 if bool(any_token.any()) else 1
    input_ids = torch.cat([query_ids[:, cut:], response_ids[:, :width]], dim=1)
    attention_mask = torch.cat([query_mask[:, cut:], mask[:, :width].to(query_mask.dtype)], dim=1)
    return input_ids, attention_mask, query_ids.shape[1] - cut, width


class StageClock:
    """Wall seconds per stage: ``with clock("generate"): ...`` adds to ``clock.seconds["generate"]``."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:  # kernels run asynchronously: wait for them, or the time lands in a later stage
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@torch.no_grad()
def sample_rollout(
    ctx: OnlineContext, batch: dict[str, Any], clock: StageClock | None = None
) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
    """Stage 1: sample one response per row of ``batch`` and read log-probs and values at sampling time.

    The responses are cut after their first stop token (the token is inside the mask, also when pad ==
    EOS). Under ``online.missing_eos=mask`` a response without a stop token gets an all-False ``mask``
    (it trains nothing). Log-probs of the actor (``logprobs``, the PPO ``old_logprobs``) and of the
    reference are recomputed from the models themselves under the sampling's processing (``ctx.sampling``:
    temperature, suppressed pad, top-k / top-p), never taken from ``generate`` (OpenRLHF PR #853;
    huggingface/trl#2358).

    Returns:
        (rollout with ``logprobs``, ``ref_logprobs``, ``values`` (critic only), ``group_ids``, ``ended``;
        ``response_mask`` (B, T) bool: the response up to its stop token, also for masked-out responses
        (what the reward model reads); ``entropy`` (B, T): the actor's entropy at each valid token).
    """
    o, roles = ctx.cfg.online, ctx.roles
    n = batch["query_ids"].shape[0]
    size = o.rollout_batch_size or n
    pad = ctx.tokenizer.pad_token_id
    clock = clock or StageClock()
    with clock("generate"):
        pieces = [
            generate_responses(
                roles.actor,
                batch["query_ids"][i : i + size],
                batch["query_mask"][i : i + size],
                max_new_tokens=o.response_length,
                stop_token_ids=ctx.stop_token_ids,
                pad_token_id=pad,
                sampling=ctx.sampling,
            )
            for i in range(0, n, size)
        ]
    response_mask = torch.cat([p.mask for p in pieces])  # (B, R)
    width = max(int(response_mask.sum(1).max()), 1)  # T: the longest response
    response_mask = response_mask[:, :width]
    response_ids = torch.cat([p.response_ids for p in pieces])[:, :width]  # (B, T)
    ended = torch.cat([p.ended for p in pieces])  # (B,)
    mask = response_mask & ended[:, None] if o.missing_eos == "mask" else response_mask

    def zeros():
        return torch.zeros(n, width, device=ctx.device)

    logprobs, ref_logprobs, entropy = zeros(), zeros(), zeros()
    values = zeros() if roles.critic is not None else None
    for model in (roles.actor, roles.critic):
        if model is not None:
            model.eval()
    with clock("forward"):
        for i in range(0, n, size):
            rows = slice(i, i + size)
            ids, attn, start, w = model_inputs(
                batch["query_ids"][rows], batch["query_mask"][rows], response_ids[rows], mask[rows]
            )
            labels = response_ids[rows, :w]
            logits = response_logits(roles.actor, ids, attn, start)  # (b, w, V)
            logprobs[rows, :w] = sampled_logprobs(logits, labels, ctx.sampling)
            entropy[rows, :w] = entropy_from_logits(processed_logits(logits, ctx.sampling, labels))
            ref_logits = response_logits(roles.reference, ids, attn, start)  # (b, w, V)
            ref_logprobs[rows, :w] = sampled_logprobs(ref_logits, labels, ctx.sampling)
            if values is not None:
                values[rows, :w] = critic_values(roles.critic, ids, attn, start)
    rollout = Rollout(
        query_ids=batch["query_ids"],
        query_mask=batch["query_mask"],
        response_ids=response_ids,
        mask=mask,
        logprobs=fill_masked(logprobs, mask),
        ref_logprobs=fill_masked(ref_logprobs, mask),
        values=None if values is None else fill_masked(values, mask),
        group_ids=batch["group_ids"],
        ended=ended,
    )
    return rollout, response_mask, fill_masked(entropy, mask)


def score_rollout(
    ctx: OnlineContext, rollout: Rollout, response_mask: torch.Tensor, records: list[dict]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor, list[str] | None]:
    """Stage 2: score each response; apply ``online.missing_eos`` and ``online.score_clip``.

    The reward model reads each response up to its stop token (``response_mask``), also one that
    ``missing_eos=mask`` leaves out of the loss. Under ``missing_eos=penalty`` a response without a stop
    token scores ``online.missing_eos_score`` whatever it says (the N+ "EOS trick", Huang et al. 2024).

    Returns:
        (scores (B,) float32 as they enter the rewards; raw_scores (B,): the sum of the scorer's parts
        before the EOS rule and clipping; parts: name -> (B,), NaN where a function had no opinion;
        scored (B,) bool: False where no part had an opinion (such a response is left out of the loss);
        the decoded responses, or None when nothing needed them).
    """
    o = ctx.cfg.online
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
    raw_scores, parts, scored = ctx.scorer(ids, attn, **texts)
    scores = raw_scores
    if o.missing_eos == "penalty":
        scores = torch.where(rollout.ended, scores, torch.full_like(scores, o.missing_eos_score))
    if o.score_clip is not None:
        scores = scores.clamp(-o.score_clip, o.score_clip)
    return scores, raw_scores, parts, scored, responses


def derived_seed(*parts: object) -> int:
    """A 63-bit seed that is a stateless function of ``parts`` (e.g. ``("sampling", seed, step, rank)``)."""
    digest = hashlib.sha256("-".join(map(str, ("rlhfkit", *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def minibatch_order(
    n: int, seed: int, step: int, epoch: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A permutation of ``n`` rows, a stateless function of (seed, step, epoch): resume needs no sampler state."""
    g = torch.Generator().manual_seed(derived_seed("minibatches", seed, step, epoch))
    return torch.randperm(n, generator=g).to(device)


def local_minibatches(ctx: OnlineContext, step: int, epoch: int) -> list[torch.Tensor]:
    """This process's rows (local indices) of each of the epoch's ``online.num_minibatches`` minibatches.

    The minibatches are cut from ONE permutation of the whole rollout's rows (all processes), so that N
    processes train on the minibatches one process would; each takes the rows it holds, in that order. A
    process may hold more rows of one minibatch than of another, or none (see :func:`ppo_update`).
    """
    first, local, total = ctx.rows()
    order = minibatch_order(total, ctx.cfg.seed, step, epoch, ctx.device)
    size = total // ctx.cfg.online.num_minibatches
    out = []
    for k in range(ctx.cfg.online.num_minibatches):
        rows = order[k * size : (k + 1) * size]
        out.append(rows[(rows >= first) & (rows < first + local)] - first)
    return out


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
    (:func:`local_minibatches`): N processes take the optimizer steps one process takes. A process that holds
    no row of a minibatch still joins the gradient all-reduce, with a zero-weighted backward pass. A
    minibatch without a valid token (every response masked out) is skipped: no optimizer step, so the
    parameters do not move. ``train_actor=False`` (critic warm-up) trains the critic alone.

    Args:
        rollout: with ``advantages``, ``returns`` and (critic) ``values`` filled in; this process's rows.
        step: the rollout's number (seeds the minibatch order).
    """
    o, t = ctx.cfg.online, ctx.cfg.train
    micro = t.micro_batch_size or rollout.batch_size // o.num_minibatches
    names = [name for name in ("actor", "critic") if name in ctx.trained and (name != "actor" or train_actor)]
    for name in names:  # the forwards of the rollout, whose outputs are the old log-probs and values
        set_update_mode(ctx.trained[name], dropout=not ctx.cfg.model.disable_dropout)
    result, diffs = UpdateResult(StatSums(ctx.device)), []
    for epoch in range(o.ppo_epochs):
        for k, rows in enumerate(local_minibatches(ctx, step, epoch)):
            minibatch = rollout.select(rows)
            normalizer = float(ctx.all_sum(loss_normalizer(minibatch.mask, o.loss_agg_mode)))
            if normalizer == 0:
                result.skipped_minibatches += 1
                continue
            tokens = float(ctx.all_sum(minibatch.mask.sum())) if ctx.router_aux_coef else 0.0
            losses: dict[str, torch.Tensor] = {}
            first_diff = torch.zeros((), dtype=torch.float64, device=ctx.device)
            starts = list(range(0, len(rows), micro)) or [None]  # None: this process holds no row of it
            for j, start in enumerate(starts):
                with _no_sync(ctx, names, last=j == len(starts) - 1):
                    if start is None:  # the same all-reduce as the others, adding nothing to the gradient
                        ignored = StatSums(ctx.device)
                        loss, parts, _ = micro_batch_loss(
                            ctx, rollout.select(slice(0, 1)), normalizer, ignored, train_actor, tokens
                        )
                        ctx.accelerator.backward(loss * 0.0)
                        parts = {
                            key: value * 0.0 for key, value in parts.items()
                        }  # nothing of the loss either
                        for key in ignored.sums:  # the same statistics on every process, weighing nothing
                            result.stats.add_sum(key, 0.0, 0.0)
                    else:
                        loss, parts, diff = micro_batch_loss(
                            ctx,
                            minibatch.select(slice(start, start + micro)),
                            normalizer,
                            result.stats,
                            train_actor,
                            tokens,
                        )
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The loss of one micro-batch, already divided by the whole minibatch's ``normalizer``.

    ``vf_coef * value loss + policy loss - ent_coef * entropy``, each per-token loss from
    :mod:`rlhfkit.algos` and aggregated by ``aggregate_loss``, plus, for a mixture-of-experts actor,
    ``router_aux_coef`` times its router load-balancing loss weighted by the micro-batch's share of the
    ``minibatch_tokens`` (all processes). The logits are computed once and serve the log-probs (under
    ``ctx.sampling``, as at sampling time) and the entropy. Token-weighted statistics go to ``stats``.

    Returns:
        (loss: a scalar to backpropagate; parts: ``loss/policy``, ``loss/value``, ``loss/entropy``, each
        aggregated like the loss; the largest |logprobs - old_logprobs| at a valid token).
    """
    o = ctx.cfg.online
    ids, attn, start, w = model_inputs(mb.query_ids, mb.query_mask, mb.response_ids, mb.mask)
    mask = mb.mask[:, :w]  # (b, w)
    tokens = mask.sum()

    def aggregate(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(per_token, mask, o.loss_agg_mode, normalizer, max_length=o.response_length)

    loss = torch.zeros((), device=ctx.device)
    parts: dict[str, torch.Tensor] = {}
    diff = torch.zeros((), device=ctx.device)
    if train_actor:
        logits, aux = response_forward(
            ctx.trained["actor"], ids, attn, start, router_aux=ctx.router_aux_coef > 0
        )
        logprobs = sampled_logprobs(logits, mb.response_ids[:, :w], ctx.sampling)  # (b, w)
        old = mb.logprobs[:, :w]
        per_token, pg = ppo_policy_loss(logprobs, old, mb.advantages[:, :w], o.clip_eps, mask=mask)
        parts["loss/policy"] = aggregate(per_token)
        loss = loss + parts["loss/policy"]
        diff = fill_masked((logprobs.detach() - old).abs(), mask).max()
        for key, name in (("clip_frac", "clipfrac"), ("approx_kl", "approx_kl"), ("ratio", "ratio/mean")):
            stats.add(name, pg[key], tokens)
        if o.ent_coef > 0:
            parts["loss/entropy"] = aggregate(
                entropy_from_logits(processed_logits(logits, ctx.sampling, mb.response_ids[:, :w]))
            )
            loss = loss - o.ent_coef * parts["loss/entropy"]
        if o.kl_in_loss:  # DeepSeekMath's GRPO: k3 against the reference as a loss term, not in the reward
            # masked inputs filled first: a junk log-prob there must not reach the gradient (0 * inf)
            kl = kl_estimator("k3")(fill_masked(logprobs, mask), fill_masked(mb.ref_logprobs[:, :w], mask))
            parts["loss/kl"] = aggregate(fill_masked(kl, mask))  # (b, w) per token, then aggregated
            loss = loss + float(ctx.kl_ctl.value) * parts["loss/kl"]
        if aux is not None:
            parts["loss/router_aux"] = aux * (float(tokens) / max(minibatch_tokens, 1.0))
            loss = loss + ctx.router_aux_coef * parts["loss/router_aux"]
    if "critic" in ctx.trained:
        values = critic_values(ctx.trained["critic"], ids, attn, start)  # (b, w)
        per_token, vf = value_loss(values, mb.values[:, :w], mb.returns[:, :w], o.value_clip_eps, mask=mask)
        parts["loss/value"] = aggregate(per_token)
        loss = loss + o.vf_coef * parts["loss/value"]
        stats.add("value/clipfrac", vf["clip_frac"], tokens)
    return loss, parts, diff


def _optimizer_step(ctx: OnlineContext, name: str, stats: StatSums) -> None:
    """Clip the gradient of role ``name`` (``train.max_grad_norm``), step its optimizer, zero its gradient."""
    model, optimizer = ctx.trained[name], ctx.optimizers[name]
    if ctx.cfg.train.max_grad_norm is not None:
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
