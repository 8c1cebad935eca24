"""Stage 1's generation through the configured backend (``online.generation_backend``): Hugging Face
``generate`` on the actor (``hf``), or a vLLM engine in this process (``vllm``,
:mod:`rlhfkit.rollout.vllm_engine`) whose weights are the actor's, loaded before every generation.

- :func:`start_engine`: the engine of a run (None with ``hf``), started once when the context is built;
- :func:`generate_pieces`: the responses of a batch, in ``online.rollout_batch_size`` pieces; with ``vllm`` the
  weight sync first (``time/weight_sync``; once per rollout: dynamic sampling's extra rounds sample from the
  weights stage 1 loaded, the actor has not moved since), then per-request seeds that are a stateless function of (the
  sampling seed of the rollout, prompt, sample);
- :func:`engine_for_hook`: the engine's sampler for a caller's hook that takes one (the reward-model refresh);
- :func:`check_logprob_gap`: the engine's log-prob of each sampled token against the trainer's
  (``generation/logprob_gap/mean``, ``/max``) and the stop when the engine holds other weights than the actor
  or the gap is not a finite number; called on stage 1's rollout and on each of dynamic sampling's rounds.

Shapes: ``B`` responses of this process, ``T`` response length.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rlhfkit.algos.masked import fill_masked
from rlhfkit.errors import GenerationEngineError
from rlhfkit.models.loading import resolve_dtype
from rlhfkit.rollout.generation import Responses
from rlhfkit.trainers.online.context import StageClock, derived_seed
from rlhfkit.trainers.online.sharding import generation_model

if TYPE_CHECKING:
    from rlhfkit.config import RunConfig
    from rlhfkit.rollout.episodes import EpisodeRunner
    from rlhfkit.rollout.vllm_engine import VLLMEngine
    from rlhfkit.trainers.online.context import OnlineContext
    from rlhfkit.types import Rollout


def start_engine(
    cfg: RunConfig, actor: torch.nn.Module, episodes: EpisodeRunner | None = None
) -> VLLMEngine | None:
    """The run's vLLM engine on the actor's initial weights, or None under ``generation_backend=hf``;
    ``episodes``: the run's tools (their prompt overhead counts in the default ``max_model_len``)."""
    online = cfg.online
    if online.generation_backend != "vllm":
        return None
    from rlhfkit.rollout.vllm_engine import EngineSettings, VLLMEngine

    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    settings = EngineSettings(
        dtype=names[resolve_dtype(cfg.model.dtype)],
        kv_cache_gib=online.vllm_kv_cache_gib,
        kv_cache_dtype=online.vllm_kv_cache_dtype,
        max_model_len=online.vllm_max_model_len or _longest(cfg, actor, episodes),
        seed=cfg.seed,
    )
    return VLLMEngine(actor, settings, where=f"model.name_or_path={cfg.model.name_or_path}")


def _longest(cfg: RunConfig, actor: torch.nn.Module, episodes: EpisodeRunner | None = None) -> int:
    """``data.max_prompt_length`` + the longest response the engine serves (``online.response_length``, or the
    refresh's ``refresh.max_new_tokens`` when a refresh samples and asks for more) + with tools, the tokens
    their rendering adds to a prompt; at most the model's own position limit."""
    refresh = cfg.refresh.max_new_tokens if cfg.refresh.every else 0
    tools = episodes.turns.prompt_overhead() if episodes is not None else 0
    wanted = cfg.data.max_prompt_length + tools + max(cfg.online.response_length, refresh)
    limit = getattr(getattr(actor, "config", None), "max_position_embeddings", None)
    return min(wanted, int(limit)) if limit else wanted


def request_seeds(base: int, group_ids: torch.Tensor) -> list[int]:
    """One seed per row: ``derived_seed("vllm", base, prompt, k)``, ``k`` the row's place among the rows of its
    prompt (rows of one prompt are consecutive). ``base`` is drawn from the rollout's seeded generator, so
    a resumed run gives every request the seed the uninterrupted run gave it."""
    seeds, previous, k = [], None, 0
    for gid in group_ids.tolist():
        k = k + 1 if gid == previous else 0
        previous = gid
        seeds.append(derived_seed("vllm", base, gid, k) % 2**63)
    return seeds


def generate_pieces(
    ctx: OnlineContext,
    batch: dict[str, Any],
    size: int,
    clock: StageClock,
    hf_generate: Callable[..., Responses],
    greedy: bool = False,
    sync: bool = True,
) -> list[Responses]:
    """The responses of ``batch`` in pieces of ``size`` rows, from the configured backend: ``hf_generate``
    (:func:`rlhfkit.rollout.generate_responses`, passed by the caller, whose tests replace it) under ``hf``.

    With ``vllm`` the actor's current weights are loaded into the engine first (timed as ``weight_sync``; not
    with ``sync=False``: the caller loaded them since the actor last moved), and each :class:`Responses`
    carries the engine's log-probs in ``sampled_logprobs``.
    """
    online, n = ctx.cfg.online, batch["query_ids"].shape[0]
    common = dict(
        max_new_tokens=online.response_length,
        stop_token_ids=ctx.stop_token_ids,
        pad_token_id=ctx.tokenizer.pad_token_id,
        sampling=ctx.sampling,
        greedy=greedy,
    )
    if ctx.engine is None:
        streams = batch.get("streams")  # online.sampler=exact: each row's own stream, whatever the pieces
        with clock("generate"), generation_model(ctx) as actor:  # a sharded actor: gathered once
            return [
                hf_generate(
                    actor,
                    batch["query_ids"][i : i + size],
                    batch["query_mask"][i : i + size],
                    **common,
                    **({} if streams is None else {"streams": streams[i : i + size]}),
                )
                for i in range(0, n, size)
            ]
    if sync:
        with clock("weight_sync"):
            ctx.engine.load_weights(ctx.roles.actor)
    base = int(torch.randint(2**62, (1,)))  # from the rollout's seeded global generator
    seeds = request_seeds(base, batch["group_ids"])
    with clock("generate"):
        return [
            ctx.engine.generate(
                batch["query_ids"][i : i + size],
                batch["query_mask"][i : i + size],
                seeds=seeds[i : i + size],
                **common,
            )
            for i in range(0, n, size)
        ]


def engine_for_hook(ctx: OnlineContext, hook: Callable) -> dict[str, Callable[..., Responses]]:
    """``{"generate": sampler}`` for ``hook`` when the run has an engine and ``hook`` takes ``generate``: the
    actor's current weights are loaded into the engine first, and the sampler is
    :func:`rlhfkit.rollout.vllm_engine.engine_generate`'s. Else ``{}`` (the hook samples with ``hf``)."""
    if ctx.engine is None or "generate" not in inspect.signature(hook).parameters:
        return {}
    from rlhfkit.rollout.vllm_engine import engine_generate

    ctx.engine.load_weights(ctx.roles.actor)
    return {"generate": engine_generate(ctx.engine)}


def check_logprob_gap(ctx: OnlineContext, rollout: Rollout, round_: int = 0) -> dict[str, float]:
    """``generation/logprob_gap/mean`` and ``/max``: |engine log-prob - trainer log-prob| of the sampled tokens
    (``rollout.engine_logprobs`` against ``rollout.logprobs``, the same processing) over the valid tokens of all
    processes; a mean above ``online.vllm_max_logprob_gap``, or a gap that is not a finite number, stops the
    run. ``round_``: dynamic sampling's extra round the rollout comes from (0: stage 1's own), named in the
    message. Nothing (``{}``) with ``hf``.

    Raises:
        GenerationEngineError: the engine holds other weights than the actor (a failed or skipped sync), or
            one side's log-probs are NaN or infinite (``mean > limit`` alone is False for NaN).
    """
    if rollout.engine_logprobs is None:
        return {}
    engine_logprobs, logprobs, mask = rollout.engine_logprobs, rollout.logprobs, rollout.mask
    gap = fill_masked((engine_logprobs - logprobs).abs().double(), mask)  # (B, T)
    nonfinite = [fill_masked(~torch.isfinite(x), mask).sum().double() for x in (engine_logprobs, logprobs)]
    summed = ctx.all_sum(torch.stack([gap.sum(), mask.sum().double(), *nonfinite]))  # (4,)
    largest = gap.max() if gap.numel() else gap.new_zeros(())
    if ctx.accelerator.num_processes > 1:
        largest = largest.clone()
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
    mean = float(summed[0] / summed[1]) if float(summed[1]) > 0 else 0.0
    metrics = {"generation/logprob_gap/mean": mean, "generation/logprob_gap/max": float(largest)}
    where = f" (dynamic sampling round {round_})" if round_ else ""
    stop = "nothing of this rollout is trained or saved, and --resume continues from the newest checkpoint"
    if not math.isfinite(mean) or not math.isfinite(metrics["generation/logprob_gap/max"]):
        sides = [
            f"{int(count)} of the {name} log-probs"
            for name, count in zip(("engine's", "trainer's"), summed[2:].tolist(), strict=True)
            if count > 0
        ]
        raise GenerationEngineError(
            f"generation/logprob_gap/mean = {mean:.4g} nats{where} is not a finite number: "
            f"{' and '.join(sides) or 'their differences'} are NaN or infinite on the sampled tokens (the "
            f"engine's weights or numerics, or the actor's, are broken); {stop}"
        )
    limit = ctx.cfg.online.vllm_max_logprob_gap
    if mean > limit:
        raise GenerationEngineError(
            f"generation/logprob_gap/mean = {mean:.4g} nats{where} > online.vllm_max_logprob_gap = {limit:g}: the "
            f"vLLM engine samples from other weights than the actor (the weight sync failed); {stop}"
        )
    return metrics
