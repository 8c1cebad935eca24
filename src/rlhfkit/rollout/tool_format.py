"""How a model writes tool calls and what it reads back: the call format, parsing a turn's calls, and a tool's
value as text. Plain data, below :mod:`rlhfkit.rollout.tools` (loading and running) and
:mod:`rlhfkit.rollout.tool_worker` (the processes), which both use it; the call format itself
(``CallFormat``, ``format_call``) is the data layer's (:mod:`rlhfkit.data.tool_calls`), shared with SFT rows.

Calls are read in the Hermes format that Qwen2.5, Hermes and SmolLM3 templates use, and that is the default for
a template that shows no tools (``DEFAULT_FORMAT``)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123*456"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rlhfkit.data.tool_calls import DEFAULT_FORMAT, CallFormat, format_call  # noqa: F401  (SFT rows share them)


@dataclass
class ToolCall:
    """One call as the model wrote it.

    Attributes:
        name: the tool's name ("" when the call could not be read).
        arguments: the keyword arguments (a dict), or None when they could not be read.
        text: the text between the markers, as written.
        error: None, or why the call cannot be made (``"malformed_arguments"``).
    """

    name: str
    arguments: dict | None
    text: str
    error: str | None = None


def parse_tool_calls(text: str, fmt: CallFormat = DEFAULT_FORMAT) -> list[ToolCall]:
    """The calls in a model turn's text, in order. A block that does not hold a JSON object with a string
    ``name`` and an object ``arguments`` (or a JSON string holding one) is a call with ``error =
    "malformed_arguments"``; so is a start marker left open at the end of the turn."""
    calls = []
    pattern = re.compile(re.escape(fmt.start) + r"(.*?)(" + re.escape(fmt.end) + r"|$)", re.DOTALL)
    for m in pattern.finditer(text):
        body = m[1].strip()
        if not m[2]:  # the turn ended inside a call
            calls.append(ToolCall("", None, body, "malformed_arguments"))
            continue
        calls.append(_read_call(body))
    return calls


def _read_call(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return ToolCall("", None, body, "malformed_arguments")
    name = obj.get("name") if isinstance(obj, dict) else None
    arguments = obj.get("arguments", {}) if isinstance(obj, dict) else None
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return ToolCall(name if isinstance(name, str) else "", None, body, "malformed_arguments")
    return ToolCall(name, arguments, body)


@dataclass
class ToolResult:
    """A call's outcome: ``text`` is what the model reads; ``error`` its cause (``CAUSES``) or None."""

    name: str
    arguments: dict | None
    text: str
    error: str | None = None


def result_text(value: Any) -> str:
    """A tool's return value as the text the model reads: strings as they are, JSON for what JSON can hold."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
