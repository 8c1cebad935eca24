"""What the stages of the online loop share: the :class:`OnlineContext`, weighted statistics summed over
processes (:class:`StatSums`), the per-stage wall clock, stateless seeds, and the model input of a prompt +
response batch (:func:`model_inputs`, :func:`critic_values`).

Every forward pass of the stages drops the columns that no row of its (micro-)batch uses (prompt padding on
the left, response padding on the right: :func:`model_inputs`); position ids come from the attention mask, so
this changes no valid output beyond float rounding.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit.config import RunConfig
from rlhfkit.engine.accel import all_sum
from rlhfkit.models import Sampling, response_values
from rlhfkit.rollout.scoring import Scorer, reward_normalization
from rlhfkit.trainers.online_roles import Roles


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

    cfg: RunConfig
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


def derived_seed(*parts: object) -> int:
    """A 63-bit seed that is a stateless function of ``parts`` (e.g. ``("sampling", seed, step, rank)``)."""
    digest = hashlib.sha256("-".join(map(str, ("rlhfkit", *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
