"""The chat template's side of a multi-turn episode: the text that goes between the model's turns.

An episode's row is the prompt's ids, then each model turn's SAMPLED ids, then the ids of what the template
writes after that turn (the rest of the turn's closing, the tool results, the next generation prompt), and so
on; the model's text is never decoded and encoded again (prime-rl#1352, vllm#28185: re-tokenized turns make
the trained tokens differ from the sampled ones). The text after a turn is the difference of two renders
(:meth:`ChatTurns.suffix`)::

    G = render(conversation before the turn, add_generation_prompt=True)    what the row holds before the turn
    A = render(conversation + [assistant: turn text])                          G + turn text + closing
    F = render(conversation + [assistant] + tool results, add_generation_prompt=True)
    suffix = closing (less the EOS the model sampled) + F[len(A):]

The closing is kept (verl#6921: the turn separator dropped at assistant -> tool boundaries): a turn that
stopped at the tool-call end marker gets the template's whole end of turn from the template, one that stopped
at EOS gets what the template writes after EOS (e.g. chatml's newline). This needs a template that renders
prefixes of itself (A starts with G, F starts with A) and writes the model's text verbatim, or a tail of it: a
template that drops a head of the turn as it renders it (DeepSeek-R1-distill's ``content.split('</think>')[-1]``,
an ``lstrip('\\n')``) gets its closing found where its text of the turn ends, and the row keeps the sampled
reasoning, which the model saw. One that rewrites earlier turns (NVIDIA-NeMo/RL#2821: reasoning templates that
drop earlier ``<think>`` blocks after a later user message) or trims or rewrites the model's text otherwise is
refused at start-up (:meth:`ChatTurns.check`, whose probe turns carry a reasoning block and leading newlines),
naming the template, the probe turn and the place the renders part. A rewrite that only text the policy writes
mid-run sets off ends that episode with the cause ``template`` (:mod:`rlhfkit.rollout.episodes`).

**Templates without tools.** A template that does not show ``tools=`` (the probe renders it with and without
and compares) gets the default format: the tools' schemas in a system message (``DEFAULT_SYSTEM``, the Hermes
wording), calls written as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` and results as a user
message of ``<tool_response>...</tool_response>`` blocks (what Qwen2.5's template does for ``tool`` messages).
A template that shows tools must use that call format too; one with another (Mistral's ``[TOOL_CALLS]``,
Llama 3's ``<|python_tag|>``) is refused, naming ``data.chat_template`` as the way out.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from rlhfkit.data.tool_calls import DEFAULT_SYSTEM, result_messages, with_tools_system  # noqa: F401
from rlhfkit.errors import ConfigError
from rlhfkit.rollout.tools import DEFAULT_FORMAT, CallFormat, ToolResult, format_call

OTHER_FORMATS = ("[TOOL_CALLS]", "<|python_tag|>")
_END = "\ue000end of turn\ue000"  # appended to a turn to find where the template's text of it ends


class TemplateError(ConfigError):
    """A chat template that cannot give token-exact multi-turn rows (the message says why)."""


def _parting(earlier: str, later: str) -> str:
    """Where ``later`` stops extending ``earlier``, for an error message."""
    i = next(
        (k for k, (a, b) in enumerate(zip(earlier, later, strict=False)) if a != b),
        min(len(earlier), len(later)),
    )
    return (
        f"at character {i}: the earlier render has {earlier[i : i + 40]!r}, the later {later[i : i + 40]!r}"
    )


@dataclass
class ChatTurns:
    """Renders an episode's conversation with a tokenizer's chat template and tools (see the module docstring).

    Attributes:
        tokenizer: the policy's tokenizer, with a chat template.
        schemas: the tools' JSON schemas (:attr:`rlhfkit.rollout.tools.Toolbox.schemas`).
        shows_tools: the template shows ``tools=`` itself; else the default format is used.
        fmt: the call format.
    """

    tokenizer: object
    schemas: list[dict]
    shows_tools: bool
    fmt: CallFormat = DEFAULT_FORMAT

    @classmethod
    def for_tokenizer(cls, tokenizer, schemas: list[dict]) -> ChatTurns:
        """Detect the template's tool support and check it (:meth:`check`) before anything is generated."""
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise TemplateError(
                "multi-turn episodes need a chat template, but the tokenizer has none (set data.chat_template)"
            )
        source = template if isinstance(template, str) else json.dumps(template)
        probe = [{"role": "user", "content": "probe"}]
        shows = (
            bool(schemas)
            and any(s["function"]["name"] in _render(tokenizer, probe, True, schemas) for s in schemas)
            and _render(tokenizer, probe, True, schemas) != _render(tokenizer, probe, True, None)
        )
        if shows and DEFAULT_FORMAT.start not in source and any(f in source for f in OTHER_FORMATS):
            raise TemplateError(
                "the chat template writes tool calls in a format other than <tool_call>{...}</tool_call>, which "
                "is the only one read; set data.chat_template to a template in that (Hermes / Qwen2.5) format"
            )
        turns = cls(tokenizer, list(schemas), shows)
        turns.check()
        return turns

    # --- messages -----------------------------------------------------------------------------------------
    def prompt_messages(self, prompt: str | list[dict], reset_text: str | None = None) -> list[dict]:
        """The episode's first messages: a plain prompt as one user message; ``reset_text`` (an environment's
        ``reset``) appended to the last user message; the default format's system message in front."""
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        )
        if reset_text:
            users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
            if not users:
                raise ConfigError(
                    "online.environment: reset() returned text, but the prompt has no user message"
                )
            messages[users[-1]]["content"] = f"{messages[users[-1]]['content']}{reset_text}"
        if self.schemas and not self.shows_tools:
            messages = with_tools_system(messages, self.schemas)  # as SFT rows (data.tool_calls)
        return messages

    def prompt_overhead(self) -> int:
        """How many tokens the tools add to a prompt as rendered (their schemas, or the default format's system
        message): the rendered generation prompt of a one-word question with the tools, less without them."""
        probe = [{"role": "user", "content": "probe"}]
        with_tools = self.render(self.prompt_messages("probe"), add_generation_prompt=True)
        without = _render(self.tokenizer, probe, True, None)
        return max(len(self._encode(with_tools)) - len(self._encode(without)), 0)

    def tool_messages(self, results: list[ToolResult]) -> list[dict]:
        """The messages that carry a turn's results: ``tool`` messages, or (default format) one user message."""
        return result_messages([(r.name, r.text) for r in results], self.shows_tools, self.fmt)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return _render(self.tokenizer, messages, add_generation_prompt, self.schemas or None)

    # --- the text between turns ---------------------------------------------------------------------------
    def suffix(
        self, before: list[dict], rendered_before: str, content: str, eos_text: str | None, tools: list[dict]
    ) -> tuple[str, str]:
        """``(suffix text, F)`` after a model turn (module docstring). ``rendered_before`` is G, ``content`` the
        turn's text without a final EOS, ``eos_text`` that EOS's text when the turn ended with one."""
        assistant = {"role": "assistant", "content": content}
        whole = self.render([*before, assistant], add_generation_prompt=False)  # A
        if whole.startswith(rendered_before) and whole[len(rendered_before) :].startswith(content):
            closing = whole[len(rendered_before) + len(content) :]  # the turn written verbatim
        else:
            closing = self._closing_after_a_tail(before, rendered_before, content, whole)
        if eos_text and closing.lstrip().startswith(eos_text):
            closing = closing.lstrip()[len(eos_text) :]  # the EOS is the model's own (sampled) token
        after = self.render([*before, assistant, *tools], add_generation_prompt=True)  # F
        if not after.startswith(whole):
            raise TemplateError(
                "the chat template does not render prefixes of itself: the conversation with a model turn is not "
                "a prefix of the conversation with the tool results after it (templates that rewrite earlier "
                "turns, e.g. drop earlier <think> blocks, cannot give token-exact rows), "
                + _parting(whole, after)
            )
        return closing + after[len(whole) :], after

    def _closing_after_a_tail(
        self, before: list[dict], rendered_before: str, content: str, whole: str
    ) -> str:
        """The closing after a turn that the template writes as a tail of the model's text, dropping a head
        (DeepSeek-R1-distill's ``content.split('</think>')[-1]``, an ``lstrip('\\n')``), and with it maybe text
        its generation prompt put in front of the turn (an opening ``<think>``). A marker appended to the turn
        shows where the template's text of it ends. The row keeps the sampled text, which the model saw."""
        marked = self.render([*before, {"role": "assistant", "content": content + _END}], False)
        bare = self.render(before, add_generation_prompt=False)
        start = len(os.path.commonprefix([rendered_before, marked]))  # where G and the turn's render part
        end = marked.find(_END)
        if not rendered_before.startswith(bare) or start < len(bare):  # they part before the turn
            raise TemplateError(
                "the chat template does not render prefixes of itself: the conversation before a model turn "
                "(with the generation prompt) is not a prefix of the conversation with that turn, "
                + _parting(rendered_before, whole)
            )
        if end < start or marked.count(_END) != 1 or not content.endswith(marked[start:end]):
            raise TemplateError(
                "the chat template does not write the model's turn verbatim, or a tail of it, right after the "
                "generation prompt (it trims or rewrites it), so the row would not be the sampled text: "
                + _parting(content, whole[start:])
            )
        closing = marked[end + len(_END) :]
        if whole != marked[:end] + closing:
            raise TemplateError(
                "the chat template does not write the end of the model's turn verbatim (it trims or rewrites it), "
                "so the row would not be the sampled text: " + _parting(marked[:end] + closing, whole)
            )
        return closing

    def check(self) -> None:
        """Run two tool turns of a synthetic episode through :meth:`suffix`; a TemplateError names the template,
        the probe turn and what fails. The turns open with newlines and a reasoning block (``<think>hmm</think>``)
        and end with spaces and a newline, so a template that trims the model's text, or rewrites it when it holds
        reasoning or starts with a newline other than by dropping its head, fails here and not mid-run.
        Each suffix must also encode on its own into ids that add exactly its text after the row (a
        SentencePiece tokenizer that puts a space in front of every text it encodes would not)."""
        name = self.schemas[0]["function"]["name"] if self.schemas else "tool"
        eos = self.tokenizer.eos_token
        messages = self.prompt_messages("What is 12*34?")
        rendered = self.render(messages, add_generation_prompt=True)
        for turn in range(2):
            lead = "\n" * (2 - turn)
            content = f"{lead}<think>hmm</think> {format_call(name, {'x': turn})}\n "
            tools = self.tool_messages([ToolResult(name, {"x": turn}, str(turn))])
            # the first turn stops at the call's end marker, the second with EOS
            ending = eos if turn else None
            try:
                suffix, after = self.suffix(messages, rendered, content, ending, tools)
            except TemplateError as e:
                template = getattr(self.tokenizer, "name_or_path", "") or "the tokenizer"
                raise TemplateError(
                    f"the chat template of {template} fails on the start-up probe's model turn {turn + 1} "
                    f"({content!r}): {e}"
                ) from None
            row = self._encode(rendered + content + (ending or ""))
            if self._decode(row + self._encode(suffix)) != self._decode(row) + suffix:
                raise TemplateError(
                    "the tokenizer does not encode the template's text between turns on its own faithfully: "
                    f"the ids of {suffix[:40]!r} add other text after a row (a prefix space?), so rows would "
                    "not be what the template renders"
                )
            messages, rendered = [*messages, {"role": "assistant", "content": content}, *tools], after

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # a jinja error: the template cannot render this conversation
        roles = [m.get("role") for m in messages]
        raise TemplateError(
            f"the chat template cannot render a conversation with roles {roles}: {type(e).__name__}: {e}"
        ) from None
