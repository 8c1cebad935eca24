"""The scripted tool-using policy of a launch's tool runs (:mod:`tests.distributed.cli_runs`, plan key
``"tool_sampler"``): :class:`tests.trainers.online.test_tools_online.ToolSampler`, with as many turns as the
process's rank says. Process 0's episodes call the calculator, then answer (two turns, two generate calls a
rollout); the others' answer at once (one turn, one call), so the processes make different numbers of generate
calls in every rollout. Each turn also runs the sampler it stands in for on the model it is given (two tokens,
thrown away): under sharding that is the gathered copy, and a generate that issued collectives would leave the
processes waiting for each other there."""

from __future__ import annotations

from collections.abc import Callable

from rlhfkit.engine.accel import launch_rank
from rlhfkit.tasks.calculator import ToolsTask
from tests.trainers.online.test_tools_online import ToolSampler


class RankedToolSampler(ToolSampler):
    def __init__(self, generate: Callable) -> None:
        super().__init__(
            ToolsTask(seed=0).build_tokenizer(), answer_at_once=0.0 if launch_rank() == 0 else 1.0
        )
        self.generate = generate

    def __call__(self, model, prompt_ids, prompt_mask, **kwargs):
        self.generate(model, prompt_ids, prompt_mask, **{**kwargs, "max_new_tokens": 2})
        return super().__call__(model, prompt_ids, prompt_mask, **kwargs)
