"""Dynamic sampling for grpo / rloo (``online.dynamic_sampling``; DAPO, Yu et al. 2025, section 3.2).

A group whose responses all score the same (every answer right, or every answer wrong) gets zero advantages
and teaches a critic-free estimator nothing; DAPO over-samples and keeps only groups with a score spread.
Here, after stage 2, each such group (and each group with fewer than two scored responses) is replaced by a
group of a newly drawn prompt that has a spread, so that the update sees ``train.batch_size`` useful groups
where it can. At most ``online.dynamic_sampling_rounds`` extra batches of prompts are generated and scored
per rollout; the batch always keeps its size, and a group that could not be replaced stays (it trains
nothing) and is counted, never dropped in silence:

- ``groups/resampled``: groups replaced in this rollout (all processes);
- ``groups/unfilled``: groups still without a spread when the bound was reached;
- ``groups/sampling_rounds``: extra batches generated.

Extra prompts come from their own stateless streams (one per round: the batch order of a seed derived from
(seed, "dynamic-sampling", round)), and the sampling noise continues the rollout's own RNG stream, so a
resumed run draws what the uninterrupted one drew. A replacing group's old log-probs come from stage 1's plain
row chunks, not from the update's first-epoch micro-batches (:mod:`rlhfkit.trainers.online.layout`), so in bf16
its first ratio is 1 to float rounding rather than to the bit. Every process replaces its own groups (a group never
leaves its process) and runs the same number of rounds, agreed by one all-reduce a round, because scoring is
collective when a reward function fails.

With tools (``online.tools`` / ``online.environment``) each round plays whole episodes, and a replacing
group's episodes (turns, conversations, environments) take their slot with its rows, so that the logged tool
metrics and samples.jsonl's turns are those of the rows trained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from rlhfkit.algos.groups import informative_rows
from rlhfkit.rollout.episodes import Episodes
from rlhfkit.trainers.online.collect import Scores
from rlhfkit.trainers.online.context import OnlineContext, StatSums
from rlhfkit.types import Rollout


def _pad_columns(
    x: torch.Tensor | None, width: int, value: float | int | bool, left: bool
) -> torch.Tensor | None:
    if x is None or x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def _join_rows(
    name: str, x: torch.Tensor | None, y: torch.Tensor | None, pad_token_id: int
) -> torch.Tensor | None:
    """The rows of ``x`` then ``y`` (the field ``name`` of two batches): prompts (``query_*``) left padded, other
    (B, ·) tensors right padded to the wider of the two (padding is outside every mask, so no value read at a
    valid position changes)."""
    if x is None or y is None:
        if (x is None) != (y is None):
            raise ValueError(f"'{name}' is set in one batch and not in the other")
        return None
    width = max(x.shape[-1], y.shape[-1])
    if name in ("query_ids", "query_mask"):
        value = pad_token_id if name == "query_ids" else 0
        x, y = _pad_columns(x, width, value, left=True), _pad_columns(y, width, value, left=True)
    elif x.dim() == 2:
        value = pad_token_id if name == "response_ids" else (False if x.dtype == torch.bool else 0)
        x, y = _pad_columns(x, width, value, left=False), _pad_columns(y, width, value, left=False)
    return torch.cat([x, y])


def concat_rollouts(a: Rollout, b: Rollout, pad_token_id: int) -> Rollout:
    """The rows of ``a`` then ``b`` in one rollout: prompts left padded and responses right padded to the wider
    of the two (padding is outside every mask, so no value read at a valid position changes)."""
    return Rollout(
        **{name: _join_rows(name, x, getattr(b, name), pad_token_id) for name, x in a._tensors().items()}
    )


def select_episodes(a: Episodes, b: Episodes, index: list[int], pad_token_id: int) -> Episodes:
    """The episodes at ``index`` of ``a``'s then ``b``'s (as :func:`concat_rollouts` then ``select`` lays out
    their rollouts): tensors joined as the rollout's are, per-episode lists (records, conversations,
    environments) picked alike."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, list):
            pool = [*x, *y]
            fields[f.name] = [pool[i] for i in index] if pool else []  # tools: closed once scored
        else:
            joined = _join_rows(f.name, x, y, pad_token_id)
            fields[f.name] = None if joined is None else joined[index]
    return Episodes(**fields)


def _take_scores(scores: Scores, index: torch.Tensor) -> Scores:
    rows = index.tolist()
    return Scores(
        scores.scores[index],
        scores.raw_scores[index],
        {name: part[index] for name, part in scores.parts.items()},
        scores.scored[index],
        None if scores.responses is None else [scores.responses[i] for i in rows],
    )


def _concat_scores(a: Scores, b: Scores) -> Scores:
    if set(a.parts) != set(b.parts):
        raise ValueError(f"the scorer's parts differ between rounds: {sorted(a.parts)} and {sorted(b.parts)}")
    both = a.responses is not None and b.responses is not None
    return Scores(
        torch.cat([a.scores, b.scores]),
        torch.cat([a.raw_scores, b.raw_scores]),
        {name: torch.cat([a.parts[name], b.parts[name]]) for name in a.parts},
        torch.cat([a.scored, b.scored]),
        [*a.responses, *b.responses] if both else None,
    )


def fill_informative_groups(
    ctx: OnlineContext,
    batch: dict[str, Any],
    rollout: Rollout,
    scores: Scores,
    draw: Callable[[int], tuple[dict[str, Any], Rollout, Scores]],
) -> tuple[dict[str, Any], Rollout, Scores, StatSums]:
    """Replace the groups of ``rollout`` that have no score spread by groups of new prompts that have one.

    Args:
        batch: the rollout's prompt batch (:func:`~rlhfkit.trainers.online.collect.prompt_batch`): its
            ``records`` are replaced with the rows.
        rollout, scores: stages 1 and 2 of the rollout (before :func:`~rlhfkit.trainers.online.collect.take_scores`).
        draw: ``round -> (batch, rollout, scores)``: stages 1 and 2 on the prompts of extra round ``round``
            (1-based), on this process.
    Returns:
        ``(batch, rollout, scores, stats)`` with as many rows as before; a replaced group keeps the group id
        of the slot it fills (ids stay unique and on their process). ``stats``: the ``groups/*`` counts above.
    """
    g = ctx.cfg.online.group_size
    n = rollout.batch_size
    rounds_allowed = ctx.cfg.online.dynamic_sampling_rounds

    def useless_slots(r: Rollout, s: Scores) -> list[int]:
        useful = informative_rows(s.scores, r.group_ids, r.mask.any(1) & s.scored)  # (B,)
        return [j for j in range(len(useful) // g) if not bool(useful[j * g])]

    records, episodes = list(batch["records"]), batch.get("episodes")
    empty = useless_slots(rollout, scores)
    replaced, rounds = 0, 0
    while rounds < rounds_allowed:
        if float(ctx.all_sum(torch.tensor([float(len(empty))], device=ctx.device))[0]) == 0:
            break  # no process has a group to replace
        rounds += 1
        extra_batch, extra, extra_scores = draw(rounds)
        useless_extra = set(useless_slots(extra, extra_scores))
        useful_extra = [j for j in range(extra.batch_size // g) if j not in useless_extra]
        pairs = list(zip(empty, useful_extra, strict=False))  # (slot to fill, extra group that fills it)
        if not pairs:
            continue
        index = torch.arange(n, device=rollout.mask.device)
        for slot, group in pairs:
            index[slot * g : (slot + 1) * g] = n + group * g + torch.arange(g, device=index.device)
        group_ids = rollout.group_ids.clone()
        pool = concat_rollouts(rollout, extra, ctx.tokenizer.pad_token_id)
        rollout = pool.select(index)
        rollout.group_ids = group_ids  # a filled slot keeps its id: ids stay unique per process
        scores = _take_scores(_concat_scores(scores, extra_scores), index)
        pool_records = [*records, *extra_batch["records"]]
        records = [pool_records[i] for i in index.tolist()]
        if episodes is not None:  # tools: the kept episodes' turns, for the metrics and samples.jsonl
            episodes = select_episodes(
                episodes, extra_batch["episodes"], index.tolist(), ctx.tokenizer.pad_token_id
            )
        replaced += len(pairs)
        empty = empty[len(pairs) :]
    stats = StatSums(ctx.device)
    stats.add_sum("groups/resampled", float(replaced), 1.0 / ctx.accelerator.num_processes)
    stats.add_sum("groups/unfilled", float(len(empty)), 1.0 / ctx.accelerator.num_processes)
    stats.add_sum("groups/sampling_rounds", float(rounds), 1.0)
    fields = {
        "query_ids": rollout.query_ids,
        "query_mask": rollout.query_mask,
        "group_ids": rollout.group_ids,
    }
    if episodes is not None:
        fields["episodes"] = episodes
    return {**batch, **fields, "records": records}, rollout, scores, stats
