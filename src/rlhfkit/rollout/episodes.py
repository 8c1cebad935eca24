"""Multi-turn episodes with tools: the batched loop, and token-exact rows for the trainer.

One call of :func:`run_episodes` plays one episode per prompt (repeat prompts for groups), all together:

1. each turn, one generation call per ``rollout_batch_size`` of the still-active episodes (left-padded rows of prompt + everything so
   far; the hf backend: :func:`rlhfkit.rollout.generate_responses`, so the sampling is the trainer's, from
   torch's global generator that the trainer seeds per rollout; the vllm backend:
   :func:`rlhfkit.rollout.vllm_engine.engine_generate`, which sends each row's ids as they stand as a
   token-id prompt, so the engine continues exactly the trained row), stopping at EOS or at the tool-call end
   marker when that is one token; a turn is cut after the end of its first tool call in any case
   (:meth:`EpisodeRunner.call_end`), so what a model writes after its call is never in the row;
2. the turn's calls are parsed (:func:`rlhfkit.rollout.tools.parse_tool_calls`) and run, every episode's at
   once, each episode's in its own process (:func:`~rlhfkit.rollout.tools.run_turn_calls`: errors, timeouts,
   unknown names and bad arguments come back to the model as error messages, counted by cause; a timeout or
   a dead process with an environment ends that episode);
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfkit.data.tokenize import cut_ids
from rlhfkit.errors import DataError
from rlhfkit.models.sampler import RowStreams
from rlhfkit.models.sampling import Sampling
from rlhfkit.rollout.chat_turns import ChatTurns, TemplateError
from rlhfkit.rollout.episode_batch import EpisodeRecord, Episodes, episode_metrics  # noqa: F401
from rlhfkit.rollout.generation import generate_responses
from rlhfkit.rollout.tools import (
    EpisodeTools,
    Toolbox,
    ToolCall,
    ToolResult,
    parse_tool_calls,
    run_turn_calls,
)


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
    pending: tuple[str, int | None] = ("", None)  # the last turn's text and the EOS id it ended with, if any


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
        max_prompt_length: ``data.max_prompt_length``; an episode's prompt, rendered with the tools and the
            environment's ``reset`` text, may have this many tokens plus what the tools add to every prompt
            (:meth:`prompt_limit`); None = no limit.
        truncation: ``data.truncation`` for a longer one: ``error`` stops the run naming the row, ``left`` /
            ``right`` cut it as the data layer cuts prompts (:func:`rlhfkit.data.tokenize.encode_prompt`).
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
    max_prompt_length: int | None = None
    truncation: str = "error"

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

    def prompt_limit(self) -> int | None:
        """The most tokens of an episode's prompt: ``max_prompt_length`` plus the tokens the tools add to a
        rendered prompt (the figure the vllm engine's length is sized with)."""
        if self.max_prompt_length is None:
            return None
        if not hasattr(self, "_prompt_limit"):
            self._prompt_limit = self.max_prompt_length + self.turns.prompt_overhead()
        return self._prompt_limit

    def start(self, prompt: str | list[dict], row: dict | None, index: int = 0) -> _Episode:
        """A new episode of ``prompt`` (row ``index`` of this call, for messages), its tools started and its
        prompt rendered with them and cut to :meth:`prompt_limit` as ``truncation`` says."""
        tools = self.toolbox.episode(row)
        messages = self.turns.prompt_messages(prompt, tools.reset_text)
        rendered = self.turns.render(messages, add_generation_prompt=True)
        ids, limit = self.encode(rendered), self.prompt_limit()
        if limit is not None and len(ids) > limit:
            ids = self._cut_prompt(ids, limit, prompt, tools, index)
        return _Episode(ids, messages, rendered, tools, prompt_messages=len(messages))

    def _cut_prompt(self, ids: list[int], limit: int, prompt, tools: EpisodeTools, index: int) -> list[int]:
        """A prompt over the limit, cut (``left`` / ``right``) or refused (``error``). Under ``error`` a prompt
        the data layer let through is never refused for the tools' rendering alone (token merges at the
        boundary can add one or two): only ``reset`` text that takes it over the limit is."""
        if self.truncation == "error":
            plain = len(self.encode(self.turns.render(self.turns.prompt_messages(prompt, None), True)))
            if tools.reset_text is None or plain >= len(ids):
                return ids
            tools.close()
            raise DataError(
                "online.environment",
                f"reset() of episode {index} returned {len(tools.reset_text)} characters that take its prompt to "
                f"{len(ids)} tokens, over data.max_prompt_length={self.max_prompt_length} + {limit - self.max_prompt_length} "
                "tokens the tools add (set data.truncation to left or right to cut such prompts, or shorten "
                "the reset text)",
                field="reset",
            )
        return cut_ids(self.tokenizer, ids, limit, self.truncation)

    def call_end(self, sampled: list[int]) -> int | None:
        """How many of a turn's ``sampled`` ids reach the end of its first tool call (the call format's end
        marker, however many tokens it takes), or None when the turn holds no finished call. The turn ends
        there on every backend (with the EOS that directly follows, when the model wrote one): what a model
        writes after its call (an invented ``<tool_response>``) is never part of the row."""
        end = self.turns.fmt.end
        if end not in self.text(sampled):
            return None
        lo, hi = 1, len(sampled)  # the shortest prefix whose text holds the marker (monotone in its length)
        while lo < hi:
            mid = (lo + hi) // 2
            if end in self.text(sampled[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def take_turn(
        self, episode: _Episode, sampled: list[int], last_turn: bool, logprobs: list[float] | None = None
    ) -> list[ToolCall]:
        """Append one model turn (its sampled ids, cut at the end of its first tool call and at the budget,
        with the sampler's ``logprobs`` of them when it gives them); the calls to answer (:meth:`answer`), or
        [] when the episode ends with this turn."""
        record = episode.record
        cut = self.call_end(sampled)
        if cut is not None and cut < len(sampled) and sampled[cut] in self.stop_token_ids:
            cut += 1  # the EOS right after the call is the model's end of turn: kept, as the template expects
        if cut is not None and cut < len(sampled):
            sampled = sampled[:cut]
            logprobs = None if logprobs is None else logprobs[:cut]
        episode.ids += sampled
        episode.model += [True] * len(sampled)
        episode.logprobs += logprobs if logprobs is not None else [0.0] * len(sampled)
        record.model_turns += 1
        eos = bool(sampled) and sampled[-1] in self.stop_token_ids
        stopped = eos or cut is not None or (bool(sampled) and sampled[-1] in self.turn_stops)
        content = self.text(sampled[:-1] if eos else sampled)
        record.turns.append({"role": "assistant", "text": content})
        calls = parse_tool_calls(content, self.turns.fmt)
        episode.pending = (content, sampled[-1] if eos else None)
        if not stopped or not calls or last_turn:  # cut by the budget, no call, or no turn left
            cause = "budget" if not stopped else "max_turns"
            for call in calls:
                record.turns.append(
                    _call_turn(ToolResult(call.name, call.arguments, "", call.error or cause))
                )
            episode.done, record.truncated, record.ended = True, not stopped, eos
            episode.messages = [*episode.messages, {"role": "assistant", "content": content}]
            return []
        return calls

    def answer(self, turns: list[tuple[_Episode, list[ToolCall]]]) -> None:
        """Run the calls of one turn of several episodes (all at once: :func:`rlhfkit.rollout.tools.run_turn_calls`)
        and append each episode's results as the template renders them. An episode with an environment whose
        call timed out or whose process died ends there (its environment died with the process)."""
        results = run_turn_calls(
            [(e.tools, calls) for e, calls in turns],
            timeout=self.tool_timeout,
            max_length=self.max_tool_response_length,
            tokenizer=self.tokenizer,
        )
        for (episode, _), answered in zip(turns, results, strict=True):
            self._append_results(episode, answered)

    def play_turn(
        self, episode: _Episode, sampled: list[int], last_turn: bool, logprobs: list[float] | None = None
    ) -> None:
        """One model turn of one episode and, when it calls tools, their results."""
        calls = self.take_turn(episode, sampled, last_turn, logprobs)
        if calls:
            self.answer([(episode, calls)])

    def _append_results(self, episode: _Episode, results: list[ToolResult]) -> None:
        record = episode.record
        content, eos_id = episode.pending
        lost = [r for r in results if r.error in ("timeout", "died")]
        if lost and episode.tools.environment is not None:  # the environment died with its process
            record.turns += [_call_turn(r) for r in results]
            episode.done, record.stopped = True, lost[0].error
            episode.messages = [*episode.messages, {"role": "assistant", "content": content}]
            return
        if lost:  # stateless tools: a fresh process for the next turn
            episode.tools.close()
            episode.tools = self.toolbox.episode()
        tool_messages = self.turns.tool_messages(results)
        eos_text = self.text([eos_id]) if eos_id is not None else None
        try:
            suffix, after = self.turns.suffix(
                episode.messages, episode.rendered, content, eos_text, tool_messages
            )
        except TemplateError:  # the template rewrote this turn in a way no start-up probe showed: end it here
            record.turns += [_call_turn(r, "template") for r in results]
            episode.done = True
            episode.messages = [*episode.messages, {"role": "assistant", "content": content}]
            return
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
            tools=[e.tools for e in episodes],
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
    rollout_batch_size: int | None = None,
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
        rollout_batch_size: the most rows of one generation call (``online.rollout_batch_size``; None = all
            of a turn's active episodes in one call).
        streams: each episode's random stream (``online.sampler=exact``); each turn's draws take the position
            of their token in the whole row, so a turn's differ from the one before.
    """
    rows = list(rows) if rows is not None else [{} for _ in prompts]
    if len(rows) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(rows)} rows")
    device = next(model.parameters()).device if any(True for _ in model.parameters()) else torch.device("cpu")
    episodes = [
        runner.start(prompt, row, i) for i, (prompt, row) in enumerate(zip(prompts, rows, strict=True))
    ]
    with_logprobs = False
    size = rollout_batch_size or len(episodes)
    for turn in range(runner.max_turns):
        rows_active = [i for i, e in enumerate(episodes) if not e.done]
        active = [episodes[i] for i in rows_active]
        if not active:
            break
        to_answer = []
        for first in range(0, len(active), size):  # online.rollout_batch_size rows per generate call
            chunk = active[first : first + size]
            own = (
                {}
                if streams is None
                else {"streams": streams[torch.tensor(rows_active[first : first + size])]}
            )
            budgets = [runner.response_length - len(e.ids) for e in chunk]
            ids, attn = _left_pad([e.prompt_ids + e.ids for e in chunk], runner.pad_token_id)
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
            for i, (episode, budget) in enumerate(zip(chunk, budgets, strict=True)):
                sampled = out.response_ids[i][out.mask[i]].tolist()[:budget]  # (r,) up to the first stop
                logprobs = None if given is None else given[i][out.mask[i]].tolist()[:budget]
                calls = runner.take_turn(episode, sampled, turn == runner.max_turns - 1, logprobs)
                if calls:
                    to_answer.append((episode, calls))
        if to_answer:  # every episode's calls of this turn at once: a hanging tool costs one timeout
            runner.answer(to_answer)
    return runner.finish(episodes, with_logprobs)
