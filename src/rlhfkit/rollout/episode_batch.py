"""A batch of played episodes (:class:`Episodes`), what happened in each (:class:`EpisodeRecord`), and the
episodes' metrics; made by :mod:`rlhfkit.rollout.episodes`, read by the online trainer's scoring and logs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfkit.rollout.scoring import RewardFunctionError
from rlhfkit.rollout.tool_worker import WorkerDied
from rlhfkit.rollout.tools import CAUSES, EpisodeTools


@dataclass
class EpisodeRecord:
    """What happened in one episode, for samples.jsonl and the metrics.

    Attributes:
        turns: ``{"role": "assistant", "text"}`` per model turn and ``{"role": "tool", "name", "arguments",
            "result", "error"}`` per call (``error``: a cause of ``CAUSES`` or None).
        model_turns: model turns played.
        truncated: cut by the budget.
        ended: the last model turn ended with EOS (and the episode was not truncated).
        stopped: why a tool's process ended the episode (``"timeout"`` or ``"died"``), else None.
    """

    turns: list[dict] = field(default_factory=list)
    model_turns: int = 0
    truncated: bool = False
    ended: bool = False
    stopped: str | None = None

    @property
    def calls(self) -> list[dict]:
        return [t for t in self.turns if t["role"] == "tool"]


@dataclass
class Episodes:
    """A batch of played episodes (see the module docstring).

    Attributes:
        query_ids, query_mask: (B, P) the prompts as rendered (with the tools), left padded.
        response_ids: (B, T) everything after the prompt, pad id after the row's end.
        mask: (B, T) bool, True on the model's sampled tokens only.
        response_mask: (B, T) bool, True on every token of the row (model, tool results, template).
        ended: (B,) bool, the episode ended with EOS (False when truncated).
        truncated: (B,) bool, cut by ``response_length``.
        records: one :class:`EpisodeRecord` per episode.
        sampled_logprobs: (B, T) the sampler's own log-prob of each sampled token (0 elsewhere), when the
            sampler gives them (the vllm engine: rollout correction and the log-prob gap); else None.
        conversations: each episode's messages, the prompt's and its last model turn included.
        completions: each episode's messages after its prompt (model turns and results): TRL's conversational
            ``completions`` for reward functions.
        environments: each episode's environment (None without ``online.environment``), as a handle to it in
            the episode's process (:class:`rlhfkit.rollout.tools.EnvironmentHandle`).
        tools: each episode's tools (their processes: :meth:`close` them once the rollout is scored).
    """

    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    mask: torch.Tensor
    response_mask: torch.Tensor
    ended: torch.Tensor
    truncated: torch.Tensor
    records: list[EpisodeRecord]
    conversations: list[list[dict]]
    completions: list[list[dict]]
    environments: list[Any]
    sampled_logprobs: torch.Tensor | None = None
    tools: list[EpisodeTools] = field(default_factory=list)

    def environment_scores(self, timeout: float = 10.0) -> list[Any]:
        """Each environment's ``get_reward()``, run in its episode's process within ``timeout`` seconds, as it
        returned it (check it with :func:`rlhfkit.rollout.scoring.check_function_scores`): None where there is
        no environment, it has no ``get_reward`` or its process was stopped by a tool (no opinion; the cause is
        counted). One that raises or hangs is a :class:`~rlhfkit.errors.RewardFunctionError`."""
        out = []
        for i, env in enumerate(self.environments):
            worker = None if env is None else env._worker
            if worker is None or not worker.alive:
                out.append(None)
                continue
            try:
                reply = worker.run("get_reward", timeout=timeout)
            except (TimeoutError, WorkerDied) as e:
                raise RewardFunctionError(
                    f"online.environment: get_reward() of episode {i} did not finish: {e}"
                ) from None
            if not reply.ok:
                raise RewardFunctionError(
                    f"online.environment: get_reward() of episode {i} raised {reply.error}"
                )
            out.append(reply.value)
        return out

    def close(self) -> None:
        """Stop every episode's tool process (after the rollout is scored)."""
        for tools in self.tools:
            tools.close()

    def metrics(self) -> dict[str, float]:
        return episode_metrics(self.records)


def episode_metrics(records: Sequence[EpisodeRecord]) -> dict[str, float]:
    """``tools/calls_per_episode``, ``tools/errors`` (share of calls without a clean result) and
    ``tools/errors/<cause>`` (share of calls, every cause of ``CAUSES``), ``tools/calls/<name>`` and
    ``tools/timeouts`` (calls per episode), ``turns/mean``, ``episodes/truncated``, ``episodes/max_turns`` and
    ``episodes/stopped_by_tool`` (shares of episodes: a tool's timeout or dead process ended them)."""
    n = max(len(records), 1)
    calls = [c for r in records for c in r.calls]
    causes = Counter(c["error"] for c in calls if c["error"] is not None)
    out = {
        "tools/calls_per_episode": len(calls) / n,
        "tools/errors": sum(causes.values()) / max(len(calls), 1),
        "turns/mean": sum(r.model_turns for r in records) / n,
        "episodes/truncated": sum(r.truncated for r in records) / n,
        "episodes/max_turns": sum(any(c["error"] == "max_turns" for c in r.calls) for r in records) / n,
        "tools/timeouts": causes["timeout"] / n,
        "episodes/stopped_by_tool": sum(r.stopped is not None for r in records) / n,
    }
    for cause in CAUSES:
        out[f"tools/errors/{cause}"] = causes[cause] / max(len(calls), 1)
    for name, count in sorted(Counter(c["name"] for c in calls if c["name"]).items()):
        out[f"tools/calls/{name}"] = count / n
    return out
