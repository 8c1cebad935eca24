"""What the stages of the online loop share: the :class:`OnlineContext` (built by :func:`build_context`), weighted statistics summed over
processes (:class:`StatSums`), the per-stage wall clock, stateless seeds, and the model input of a prompt +
response batch (:func:`model_inputs`; the critic's values through
:func:`rlhfkit.rollout.scoring.critic_values`, which the GAE-lambda experiment reads too).

Every forward pass of the stages drops the columns that no row of its (micro-)batch uses (prompt padding on
the left, response padding on the right: :func:`model_inputs`); position ids come from the attention mask, so
this changes no valid output beyond float rounding.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlhfkit.algos import AdaptiveKLController, FixedKLController
from rlhfkit.config import RunConfig
from rlhfkit.engine.accel import all_sum
from rlhfkit.engine.guards import FiniteGuard
from rlhfkit.engine.sharded import sharding_mode
from rlhfkit.errors import ConfigError
from rlhfkit.models import Sampling, sampling_for
from rlhfkit.rollout.scoring import Scorer
from rlhfkit.rollout.scoring import critic_values as critic_values  # re-exported: the stages' value read
from rlhfkit.trainers.common import router_aux_coef
from rlhfkit.trainers.online.roles import (
    Roles,
    build_optimizers,
    build_roles,
    load_process_reward_model,
    shard_roles,
)

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase

    from rlhfkit.rollout.episodes import EpisodeRunner
    from rlhfkit.rollout.vllm_engine import VLLMEngine


@dataclass(frozen=True)
class OnlineContext:
    """Everything the stages share, built whole by :func:`build_context` and never reassigned (frozen); the
    models, optimizers and controllers it holds change in place as training goes.

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
        guard: the run's :class:`rlhfkit.engine.guards.FiniteGuard` (its state is checkpointed).
        all_sum: ``values`` -> ``values`` summed over processes in one all-reduce (a float64 copy on one
            process): :func:`rlhfkit.engine.accel.all_sum` bound to the accelerator.
        router_aux_coef: weight of the actor's router load-balancing loss in the update (0: none).
        process_reward_model: the frozen PRM of ``online.process_reward_model``, or None.
        step_end_table: ``(V,)`` bool, the token ids that end a step (with a PRM).
        engine: the vLLM engine that samples under ``online.generation_backend=vllm``
            (:mod:`rlhfkit.trainers.online.engine_rollout`, started by :func:`rlhfkit.trainers.online.train`),
            else None.
        episodes: the runner of multi-turn episodes under ``online.tools`` / ``online.environment``
            (:func:`rlhfkit.trainers.online.collect.episode_runner`, made by :func:`rlhfkit.trainers.online.train`),
            else None.
    """

    cfg: RunConfig
    accelerator: Accelerator
    tokenizer: PreTrainedTokenizerBase
    roles: Roles
    trained: dict[str, torch.nn.Module]
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler]
    scorer: Scorer
    kl_ctl: FixedKLController | AdaptiveKLController
    stop_token_ids: list[int]
    sampling: Sampling
    guard: FiniteGuard
    all_sum: Callable[[torch.Tensor], torch.Tensor]
    router_aux_coef: float = 0.0
    process_reward_model: torch.nn.Module | None = None
    step_end_table: torch.Tensor | None = None
    engine: VLLMEngine | None = None
    episodes: EpisodeRunner | None = None

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def rows(self) -> tuple[int, int, int]:
        """(first, local, total): this process holds rows [first, first + local) of every rollout's ``total``
        responses (:func:`prompt_batch` gives each process a contiguous slice)."""
        total = self.cfg.train.batch_size * self.cfg.online.group_size
        local = total // self.accelerator.num_processes
        return self.accelerator.process_index * local, local, total


def build_context(
    cfg: RunConfig,
    accelerator: Accelerator,
    tokenizer: PreTrainedTokenizerBase,
    functions: list | None = None,
    train_reward_model: bool = False,
    checkpoints_dir: str | Path | None = None,
) -> OnlineContext:
    """Load the roles, build the optimizers, the scorer, the KL controller, the sampling and the finiteness
    guard, and prepare for accelerate: the one place an :class:`OnlineContext` is made.

    ``functions``: the reward functions as ``Scorer.load_functions`` gives them (default: loaded from
    ``online.reward_functions``); ``train_reward_model``: a refresh hook trains the reward model (see
    :func:`rlhfkit.trainers.online.roles.build_roles`); ``checkpoints_dir``: the run's checkpoints folder,
    which the guard names when it stops the run."""
    roles = build_roles(cfg, tokenizer, accelerator.device, train_reward_model)
    mode = sharding_mode(cfg)
    if mode != "none":  # FSDP2 before the optimizers: they hold the shards (rlhfkit.trainers.online.sharding)
        shard_roles(roles, mode, cfg.train.frozen_models)
    optimizers, schedulers = build_optimizers(cfg, roles)
    names = list(optimizers)
    if mode != "none":  # FSDP2 synchronises the gradients itself: nothing for accelerate to wrap
        trained = {n: getattr(roles, n) for n in names}
    else:
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
    scorer = Scorer(
        roles.reward_model,
        functions,
        online.rollout_batch_size,
        # get_reward; the teacher's per-token term, the PRM's step rewards (stage 3)
        extra_parts=bool(online.environment or online.teacher_model or online.process_reward_model),
        weights=online.reward_weights,
    )
    stops = stop_token_ids(cfg, tokenizer)
    sampling = sampling_for(tokenizer.pad_token_id, stops, online.temperature, online.top_k, online.top_p)
    prm, table = load_process_reward_model(cfg, tokenizer, accelerator.device)
    return OnlineContext(
        cfg=cfg,
        accelerator=accelerator,
        tokenizer=tokenizer,
        roles=roles,
        trained=trained,
        optimizers=optimizers,
        schedulers=schedulers,
        scorer=scorer,
        kl_ctl=kl_ctl,
        stop_token_ids=stops,
        sampling=sampling,
        guard=FiniteGuard(accelerator, cfg.train.skip_nonfinite_steps, checkpoints_dir, unit="rollout"),
        all_sum=functools.partial(all_sum, accelerator),
        router_aux_coef=router_aux_coef(roles.actor, cfg.model.router_aux_loss_coef),
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


def input_mask(rollout) -> torch.Tensor:
    """The response columns a forward reads: (B, T) bool, ``rollout.response_mask`` (the response up to its stop
    token), which stage 1 fixes; the loss mask (``rollout.mask``) may lose rows later (missing EOS, unscored), and
    reading it would change a micro-batch's columns between the old log-probs and the update. A rollout built
    without a response mask reads its ``mask``."""
    return rollout.mask if rollout.response_mask is None else rollout.response_mask


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


def derived_seed(*parts: object) -> int:
    """A 63-bit seed that is a stateless function of ``parts`` (e.g. ``("sampling", seed, step, rank)``)."""
    digest = hashlib.sha256("-".join(map(str, ("rlhfkit", *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
