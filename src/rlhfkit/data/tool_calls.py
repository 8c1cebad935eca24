"""Tool calls in conversations: the call format that multi-turn episodes read and write, and SFT rows with tool
calls as TRL writes them, checked and shaped as an episode renders the same conversation (docs/tools.md).

TRL's shape (transformers' chat-template convention): an assistant message may carry ``tool_calls``, a list of
``{"type": "function", "function": {"name": str, "arguments": object or a JSON string of one}}`` (its
``content`` may then be empty or null); each result is a ``{"role": "tool", "content": str, "name"?: str}``
message after the call it answers; the tools' JSON schemas come in a ``tools`` column (a list of schemas, one
schema, or a JSON string of either) or from ``data.tools``.

Such a row is rendered as :mod:`rlhfkit.rollout.episodes` renders an episode that made the same calls and got
the same results, so that the tokens SFT trains are the tokens RL samples and the template text between them
is the same (:func:`demonstration_messages`):

- each call is written into the assistant's text in the call format the episodes read (:func:`format_call`),
  after the message's own text, one a line: the text Qwen2.5's template writes for ``tool_calls``. An episode's
  model turn is its sampled text, so the template's own rendering of ``tool_calls`` takes no part;
- a template that shows ``tools=`` (:func:`template_shows_tools`) gets the schemas, and the results as ``tool``
  messages named after their calls; any other gets the default format: the schemas in a system message
  (:data:`DEFAULT_SYSTEM`, the Hermes wording) and each turn's results as one user message of
  ``<tool_response>`` blocks (what Qwen2.5's template writes for ``tool`` messages).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from rlhfkit.data.row_errors import FieldError, type_name


@dataclass(frozen=True)
class CallFormat:
    """How a model writes tool calls: a JSON object ``{"name", "arguments"}`` between ``start`` and ``end``."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    response_start: str = "<tool_response>"
    response_end: str = "</tool_response>"


DEFAULT_FORMAT = CallFormat()

DEFAULT_SYSTEM = (
    "You may call one or more functions to assist with the user query. The functions are:\n<tools>\n{tools}\n"
    "</tools>\nFor each call, write a JSON object with the function name and arguments:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>\n'
    "Each result comes back as <tool_response>...</tool_response>."
)


def format_call(name: str, arguments: dict, fmt: CallFormat = DEFAULT_FORMAT) -> str:
    """The text of one call in ``fmt`` (what a demonstration writes)."""
    return f"{fmt.start}\n{json.dumps({'name': name, 'arguments': arguments})}\n{fmt.end}"


def with_tools_system(messages: list[dict], schemas: list[dict]) -> list[dict]:
    """``messages`` with the default format's system message (listing ``schemas``) in front, joined to the
    system message the conversation opens with, if any."""
    system = DEFAULT_SYSTEM.format(tools="\n".join(json.dumps(s) for s in schemas))
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{system}\n\n{messages[0]['content']}"
    else:
        messages.insert(0, {"role": "system", "content": system})
    return messages


def result_messages(
    results: Sequence[tuple[str, str]], shows_tools: bool, fmt: CallFormat = DEFAULT_FORMAT
) -> list[dict]:
    """The messages that carry one turn's results, ``(tool name, text)`` each: ``tool`` messages for a template
    that shows tools, else one user message of ``response_start ... response_end`` blocks."""
    if shows_tools:
        return [{"role": "tool", "name": name, "content": text} for name, text in results]
    blocks = "\n".join(f"{fmt.response_start}\n{text}\n{fmt.response_end}" for _, text in results)
    return [{"role": "user", "content": blocks}]


def template_shows_tools(tokenizer, schemas: list[dict]) -> bool:
    """Whether the chat template shows ``tools=``: a one-message conversation rendered with the schemas names a
    tool and differs from the render without them."""
    if not schemas:
        return False
    probe = [{"role": "user", "content": "probe"}]
    try:
        with_tools = tokenizer.apply_chat_template(
            probe, tools=schemas, tokenize=False, add_generation_prompt=True
        )
        without = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a jinja error
        raise FieldError(
            "tools", f"the chat template cannot render the tools: {type(e).__name__}: {e}"
        ) from None
    return with_tools != without and any(s["function"]["name"] in with_tools for s in schemas)


# --- reading rows ---------------------------------------------------------------------------------------------


def read_schemas(value, field: str = "tools") -> list[dict]:
    """The tools' JSON schemas of a ``tools`` column: a list of schemas, one schema, or a JSON string of either;
    each ``{"type": "function", "function": {"name", ...}}`` (a bare ``{"name", ...}`` is wrapped so)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise FieldError(
                field, f"is a string that is not JSON ({e.msg}); give the tools' JSON schemas"
            ) from None
    schemas = [value] if isinstance(value, dict) else value
    if not isinstance(schemas, list):
        raise FieldError(field, f"expected a list of JSON schemas, got {type_name(value)}")
    out = []
    for i, schema in enumerate(schemas):
        inner = schema.get("function", schema) if isinstance(schema, dict) else None
        if not isinstance(inner, dict) or not isinstance(inner.get("name"), str) or not inner["name"]:
            raise FieldError(
                f"{field}[{i}]",
                'expected a JSON schema {"type": "function", "function": {"name": ..., "parameters": ...}}',
            )
        out.append(schema if "function" in schema else {"type": "function", "function": schema})
    return out


def read_tool_calls(value, where: str) -> list[dict]:
    """A message's ``tool_calls`` as ``[{"type": "function", "function": {"name", "arguments": dict}}]``;
    a FieldError names the call and its field (``where``: the message, e.g. ``messages[1]``)."""
    if not isinstance(value, list) or not value:
        raise FieldError(f"{where}.tool_calls", f"expected a non-empty list of calls, got {type_name(value)}")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise FieldError(
                at, f'expected {{"type": "function", "function": {{"name", "arguments"}}}}, got {call!r}'
            )
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise FieldError(
                f"{at}.function.name", "is missing" if name is None else f"expected a name, got {name!r}"
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            raise FieldError(
                f"{at}.function.arguments",
                f"expected a JSON object (or a string holding one), got {function.get('arguments')!r}",
            )
        calls.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def _written_calls(message: dict, fmt: CallFormat) -> int:
    """How many calls an assistant message makes: its ``tool_calls``, or the calls written in its text."""
    if message.get("tool_calls"):
        return len(message["tool_calls"])
    return message["content"].count(fmt.start)


def check_tool_results(messages: list[dict], field: str, fmt: CallFormat = DEFAULT_FORMAT) -> None:
    """Every ``tool`` message answers a call: it follows an assistant message that makes a call (``tool_calls``
    or a call written in its text), at most one result per call, named as its call when it names one."""
    pending: list[str | None] = []  # the names of the last assistant message's calls not yet answered
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "assistant":
            calls = message.get("tool_calls") or []
            pending = [c["function"]["name"] for c in calls] or [None] * _written_calls(message, fmt)
        elif role == "tool":
            if not pending:
                raise FieldError(
                    f"{field}[{i}]",
                    "is a tool message with no call before it to answer: a tool result follows the assistant "
                    "message that calls the tool (its tool_calls), one result per call",
                )
            expected, given = pending.pop(0), message.get("name")
            if expected is not None and given is not None and given != expected:
                raise FieldError(
                    f"{field}[{i}].name", f"is '{given}', but the call it answers is '{expected}'"
                )
        else:
            pending = []


# --- shaping rows as episodes render them -----------------------------------------------------------------------


def demonstration_messages(
    messages: list[dict], schemas: list[dict], shows_tools: bool, fmt: CallFormat = DEFAULT_FORMAT
) -> list[dict]:
    """``messages`` (validated, tool calls read by :func:`read_tool_calls`) as an episode with ``schemas``
    renders them (module docstring): calls written into the assistant's text, results as
    :func:`result_messages` gives them, and with the default format the tools' system message in front."""
    out: list[dict] = []
    names: list[str] = []  # the last call turn's tool names, by position, for results that name none
    results: list[tuple[str, str]] = []
    for message in messages:
        if message["role"] == "tool":
            name = message.get("name") or (names[len(results)] if len(results) < len(names) else "")
            results.append((name, message["content"]))
            continue
        if results:
            out += result_messages(results, shows_tools, fmt)
            results = []
        calls = message.get("tool_calls") or []
        if message["role"] != "assistant" or not calls:
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
            continue
        names = [c["function"]["name"] for c in calls]
        written = [format_call(c["function"]["name"], c["function"]["arguments"], fmt) for c in calls]
        content = message.get("content") or ""
        text = "\n".join([content, *written] if content.strip() else written)
        out.append({**{k: v for k, v in message.items() if k != "tool_calls"}, "content": text})
    if results:
        out += result_messages(results, shows_tools, fmt)
    return out if shows_tools or not schemas else with_tools_system(out, schemas)
