"""The callbacks a caller (the quickstart, an experiment) gives the online trainer: evaluation and the
reward-model refresh. The trainer itself knows nothing of any task."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


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
            reward model in place (:mod:`rlhfkit.trainers.online.refresh`). The reward model is then saved in every checkpoint, and when the
            callable has ``state_dict()`` / ``load_state_dict()`` (e.g. its accumulated pairs, as plain data) that state is
            checkpointed too, and so is the model's normalisation (gain, bias in its config), which a refresh
            may re-fit. It is frozen again (eval mode, no gradients) after each call. Under
            ``online.generation_backend=vllm`` a callable with a ``generate`` parameter is also given the
            engine's sampler (:func:`rlhfkit.rollout.vllm_engine.engine_generate`, on the actor's current
            weights), which :class:`rlhfkit.trainers.online.refresh.RewardRefresh` samples its pairs with.
    """

    evaluate: Callable[[torch.nn.Module, int], dict[str, float]] | None = None
    evaluate_at_start: bool = True
    refresh_reward_model: Callable[..., dict[str, float]] | None = None
