"""Multi-turn episodes with tools: the batched loop, and token-exact rows for the trainer.

One call of :func:`run_episodes` plays one episode per prompt (repeat prompts for groups), all together:

1. each turn, ONE generation call over the still-active episodes (left-padded rows of prompt + everything so
   far; the hf backend: :func:`rlhfkit.rollout.generate_responses`, so the sampling is the trainer's, from
   torch's global generator that the trainer seeds per rollout; the vllm backend:
   :func:`rlhfkit.rollout.vllm_engine.engine_generate`, which sends each row's ids as they stand as a
   token-id prompt, so the engine continues exactly the trained row), stopping at EOS or at the tool-call end
   marker when that is one token;
2. the turn's calls are parsed (:func:`rlhfkit.rollout.tools.parse_tool_calls`) and run
   (:func:`~rlhfkit.rollout.tools.run_tool_call`: errors, timeouts, unknown names and bad arguments come back
   to the model as error messages, counted by cause);
3. the results are appended as the chat template renders them (:mod:`rlhfkit.rollout.chat_turns`), and the
   loop goes on until a turn makes no call, ``max_turns`` model turns were played, or the budget is spent.

**Rows.** A row is the prompt's ids, then every model turn's SAMPLED ids and, between turns, the template's
ids for the results; model text is never decoded and encoded again. ``mask`` is True on model tokens only, so
tool and template tokens take no part in the losses, the KL or the statistics; ``response_mask`` is True on
every token of the row (what attention and a reward model read).

**The budget.** ``response_length`` bounds the whole row after the prompt (model and tool tokens together;
TRL's ``max_completion_length`` counts every turn too). An episode that reaches it inside a model turn, or
whose next results would not leave room for one more model token, is **truncated**: it stops there with
``ended`` False (the trainer's missing-EOS rule applies, as for a single-turn response without EOS); calls it
made that were never answered are counted with cause ``budget``. An episode whose last allowed turn makes a
call stops too (cause ``max_turns``); it ended only if that turn ended with EOS.

Shapes: ``B`` episodes, ``P`` padded prompt length, ``T`` the longest row after its prompt (<= response_length).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfkit.models.sampler import RowStreams
from rlhfkit.models.sampling import Sampling
from rlhfkit.rollout.chat_turns import ChatTurns
from rlhfkit.rollout.generation import generate_responses
from rlhfkit.rollout.tools import CAUSES, EpisodeTools, Toolbox, ToolResult, parse_tool_calls, run_tool_call


@dataclass
class EpisodeRecord:
    """What happened in one episode, for samples.jsonl and the metrics.

    Attributes:
        turns: ``{"role": "assistant", "text"}`` per model turn and ``{"role": "tool", "name", "arguments",
            "result", "error"}`` per call (``error``: a cause of ``CAUSES`` or None).
        model_turns: model turns played.
        truncated: cut by the budget.
        ended: the last model turn ended with EOS (and the episode was not truncated).
    """

    turns: list[dict] = field(default_factory=list)
    model_turns: int = 0
    truncated: bool = False
    ended: bool = False

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
        environments: each episode's environment (None without ``online.environment``).
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

    def environment_scores(self) -> list[float | None]:
        """Each environment's ``get_reward()`` (None where it has none): the episode's score."""
        out = []
        for env in self.environments:
            get = getattr(env, "get_reward", None)
            out.append(None if env is None or not callable(get) else float(get()))
        return out

    def metrics(self) -> dict[str, float]:
        return episode_metrics(self.records)


def episode_metrics(records: Sequence[EpisodeRecord]) -> dict[str, float]:
    """``tools/calls_per_episode``, ``tools/errors`` (share of calls without a clean result) and
    ``tools/errors/<cause>`` (share of calls, every cause of ``CAUSES``), ``tools/calls/<name>`` (calls per
    episode), ``turns/mean``, ``episodes/truncated`` and ``episodes/max_turns`` (shares of episodes)."""
    n = max(len(records), 1)
    calls = [c for r in records for c in r.calls]
    causes = Counter(c["error"] for c in calls if c["error"] is not None)
    out = {
        "tools/calls_per_episode": len(calls) / n,
        "tools/errors": sum(causes.values()) / max(len(calls), 1),
        "turns/mean": sum(r.model_turns for r in records) / n,
        "episodes/truncated": sum(r.truncated for r in records) / n,
        "episodes/max_turns": sum(any(c["error"] == "max_turns" for c in r.calls) for r in records) / n,
    }
    for cause in CAUSES:
        out[f"tools/errors/{cause}"] = causes[cause] / max(len(calls), 1)
    for name, count in sorted(Counter(c["name"] for c in calls if c["name"]).items()):
        out[f"tools/calls/{name}"] = count / n
    return out


@dataclass
class _Episode:
    """One episode in play: its row so far, its conversation and the template text that row stands for."""

    prompt_ids: list[int]
    messages: list[dict]
    rendered: str  # the template's text of the row so far (G of the next turn)
    tools: EpisodeTools
    prompt_messages: int = 0  # how many of ``messages`` are the prompt's
    ids: list[int] = field(default_factory=list)  # after the prompt
    model: list[bool] = field(default_factory=list)  # True on sampled tokens
    logprobs: list[float] = field(default_factory=list)  # the sampler's, per token (0 off the model's)
    record: EpisodeRecord = field(default_factory=EpisodeRecord)
    done: bool = False


@dataclass
class EpisodeRunner:
    """Everything about a run's episodes that does not change between rollouts.

    Attributes:
        tokenizer: the policy's tokenizer.
        toolbox: the run's tools (:meth:`rlhfkit.rollout.tools.Toolbox.load`).
        max_turns: model turns per episode (``online.max_turns``).
        response_length: tokens after the prompt, all turns and results together (``online.response_length``).
        tool_timeout: seconds per call (``online.tool_timeout``).
        max_tool_response_length: tokens of one result (``online.max_tool_response_length``).
        stop_token_ids: the ids that end the model's turn and episode (EOS).
        pad_token_id: filler.
        sampling: the trainer's sampling (:func:`rlhfkit.models.sampling_for`).
        turns: the template's side (made and checked at start-up by :meth:`create`).
    """

    tokenizer: Any
    toolbox: Toolbox
    max_turns: int
    response_length: int
    tool_timeout: float
    max_tool_response_length: int | None
    stop_token_ids: tuple[int, ...]
    pad_token_id: int
    sampling: Sampling
    turns: ChatTurns

    @classmethod
    def create(cls, tokenizer, toolbox: Toolbox, **settings) -> EpisodeRunner:
        """Check the template against the tools (a TemplateError refuses it before anything runs)."""
        if settings["max_turns"] < 1 or settings["response_length"] < 1:
            raise ValueError("max_turns and response_length must be >= 1")
        settings["stop_token_ids"] = tuple(int(i) for i in settings["stop_token_ids"])
        return cls(tokenizer, toolbox, turns=ChatTurns.for_tokenizer(tokenizer, toolbox.schemas), **settings)

    @property
    def turn_stops(self) -> tuple[int, ...]:
        """EOS, and the tool-call end marker when it is one token of the vocabulary."""
        if not hasattr(self, "_turn_stops"):
            ids = self.encode(self.turns.fmt.end)
            self._turn_stops = self.stop_token_ids + (tuple(ids) if len(ids) == 1 else ())
        return self._turn_stops

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def start(self, prompt: str | list[dict], row: dict | None) -> _Episode:
        tools = self.toolbox.episode(row)
        messages = self.turns.prompt_messages(prompt, tools.reset_text)
        rendered = self.turns.render(messages, add_generation_prompt=True)
        return _Episode(self.encode(rendered), messages, rendered, tools, prompt_messages=len(messages))

    def play_turn(
        self, episode: _Episode, sampled: list[int], last_turn: bool, logprobs: list[float] | None = None
    ) -> None:
        """Append one model turn (its sampled ids, cut at the budget, with the sampler's ``logprobs`` of them
        when it gives them) and, when it calls tools, their results."""
        record = episode.record
        episode.ids += sampled
        episode.model += [True] * len(sampled)
        episode.logprobs += logprobs if logprobs is not None else [0.0] * len(sampled)
        record.model_turns += 1
        stop = sampled[-1] if sampled and sampled[-1] in self.turn_stops else None
        eos = stop is not None and stop in self.stop_token_ids
        content = self.text(sampled[:-1] if eos else sampled)
        record.turns.append({"role": "assistant", "text": content})
        calls = parse_tool_calls(content, self.turns.fmt)
        if stop is None or not calls or last_turn:  # cut by the budget, no call, or no turn left
            cause = "budget" if stop is None else "max_turns"
            for call in calls:
                record.turns.append(
                    _call_turn(ToolResult(call.name, call.arguments, "", call.error or cause))
                )
            episode.done, record.truncated, record.ended = True, stop is None, eos
            episode.messages = [*episode.messages, {"role": "assistant", "content": content}]
            return
        results = [
            run_tool_call(
                call,
                episode.tools.functions,
                timeout=self.tool_timeout,
                max_length=self.max_tool_response_length,
                tokenizer=self.tokenizer,
            )
            for call in calls
        ]
        tool_messages = self.turns.tool_messages(results)
        eos_text = self.text([stop]) if eos else None
        suffix, after = self.turns.suffix(
            episode.messages, episode.rendered, content, eos_text, tool_messages
        )
        suffix_ids = self.encode(suffix)
        episode.messages = [*episode.messages, {"role": "assistant", "content": content}, *tool_messages]
        if len(episode.ids) + len(suffix_ids) >= self.response_length:  # no room left for a model token
            for r in results:
                record.turns.append(_call_turn(r, r.error or "budget"))
            episode.done, record.truncated = True, True
            return
        record.turns += [_call_turn(r) for r in results]
        episode.ids += suffix_ids
        episode.model += [False] * len(suffix_ids)
        episode.logprobs += [0.0] * len(suffix_ids)
        episode.rendered = after

    def finish(self, episodes: list[_Episode], with_logprobs: bool = False) -> Episodes:
        """Pad the rows into an :class:`Episodes` batch (``sampled_logprobs`` with ``with_logprobs``)."""
        pad = self.pad_token_id
        width = max(max(len(e.ids) for e in episodes), 1)
        query_ids, query_mask = _left_pad([e.prompt_ids for e in episodes], pad)
        response_ids = torch.full((len(episodes), width), pad, dtype=torch.long)
        mask = torch.zeros((len(episodes), width), dtype=torch.bool)
        response_mask = torch.zeros_like(mask)
        logprobs = torch.zeros((len(episodes), width))
        for i, e in enumerate(episodes):
            logprobs[i, : len(e.logprobs)] = torch.tensor(e.logprobs, dtype=torch.float32)
            response_ids[i, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
            mask[i, : len(e.ids)] = torch.tensor(e.model, dtype=torch.bool)
            response_mask[i, : len(e.ids)] = True
        records = [e.record for e in episodes]
        return Episodes(
            query_ids=query_ids,
            query_mask=query_mask,
            response_ids=response_ids,
            mask=mask,
            response_mask=response_mask,
            ended=torch.tensor([r.ended for r in records], dtype=torch.bool),
            truncated=torch.tensor([r.truncated for r in records], dtype=torch.bool),
            records=records,
            conversations=[e.messages for e in episodes],
            completions=[e.messages[e.prompt_messages :] for e in episodes],
            environments=[e.tools.environment for e in episodes],
            sampled_logprobs=logprobs if with_logprobs else None,
        )


def _call_turn(result: ToolResult, error: str | None = None) -> dict:
    return {
        "role": "tool",
        "name": result.name,
        "arguments": result.arguments,
        "result": result.text,
        "error": error if error is not None else result.error,
    }


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and attention mask of ``rows``, left padded."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, length - len(r) :] = torch.tensor(r, dtype=torch.long)
        attn[i, length - len(r) :] = 1
    return ids, attn


@torch.no_grad()
def run_episodes(
    runner: EpisodeRunner,
    model: torch.nn.Module,
    prompts: Sequence[str | list[dict]],
    rows: Sequence[dict] | None = None,
    *,
    greedy: bool = False,
    generate: Callable[..., Any] = generate_responses,
    streams: RowStreams | None = None,
) -> Episodes:
    """Play one episode per prompt (module docstring) and return the batch of rows.

    Args:
        runner: the run's settings (:meth:`EpisodeRunner.create`).
        model: the policy (unwrapped, as :func:`rlhfkit.rollout.generate_responses` takes it).
        prompts: a string or a list of chat messages per episode.
        rows: each episode's prompt-data row (its columns go to the environment's ``reset``).
        greedy: argmax decoding.
        generate: the sampler, with :func:`rlhfkit.rollout.generate_responses`' signature (the vllm backend:
            :func:`rlhfkit.rollout.vllm_engine.engine_generate`); the ``sampled_logprobs`` it returns, if any,
            are kept per model token.
        streams: each episode's random stream (``online.sampler=exact``); each turn's draws take the position
            of their token in the whole row, so a turn's differ from the one before.
    """
    rows = list(rows) if rows is not None else [{} for _ in prompts]
    if len(rows) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(rows)} rows")
    device = next(model.parameters()).device if any(True for _ in model.parameters()) else torch.device("cpu")
    episodes = [runner.start(prompt, row) for prompt, row in zip(prompts, rows, strict=True)]
    with_logprobs = False
    for turn in range(runner.max_turns):
        rows_active = [i for i, e in enumerate(episodes) if not e.done]
        active = [episodes[i] for i in rows_active]
        if not active:
            break
        own = {} if streams is None else {"streams": streams[torch.tensor(rows_active)]}
        budgets = [runner.response_length - len(e.ids) for e in active]
        ids, attn = _left_pad([e.prompt_ids + e.ids for e in active], runner.pad_token_id)
        out = generate(
            model,
            ids.to(device),
            attn.to(device),
            max_new_tokens=max(budgets),
            stop_token_ids=runner.turn_stops,
            pad_token_id=runner.pad_token_id,
            sampling=runner.sampling,
            greedy=greedy,
            **own,
        )
        given = getattr(out, "sampled_logprobs", None)  # (b, R) or None
        with_logprobs = with_logprobs or given is not None
        for i, (episode, budget) in enumerate(zip(active, budgets, strict=True)):
            sampled = out.response_ids[i][out.mask[i]].tolist()[:budget]  # (r,) up to the first stop
            logprobs = None if given is None else given[i][out.mask[i]].tolist()[:budget]
            runner.play_turn(episode, sampled, last_turn=turn == runner.max_turns - 1, logprobs=logprobs)
    return runner.finish(episodes, with_logprobs)
