"""Tools a policy calls during an episode: loading them, parsing the model's calls, running them safely.

The interface is TRL's (GRPOTrainer ``tools=`` and ``environment_factory``), so that code written for it runs
unchanged:

- **Tools**: plain Python functions with type hints and a Google-style docstring with an ``Args:`` section,
  named in ``online.tools`` as ``"path/to/file.py:fn"`` or ``"pkg.module:fn"`` (loaded as reward functions are,
  :func:`rlhfkit.rollout.scoring.load_reward_function`), or given as the functions themselves. Their JSON
  schemas (transformers' ``get_json_schema``) go to the chat template as ``tools=``. A function without type
  hints or without a description of each argument is a :class:`~rlhfkit.errors.ConfigError` at start-up.
- **An environment**: ``online.environment: "env.py:MakeEnv"``, a zero-argument callable (a class, usually)
  that returns one environment per episode. ``reset(**row) -> str | None`` starts it with the prompt row's
  columns (those it names, or all with ``**kwargs``; a returned string is appended to the last user message); every other public method (a name without
  a leading ``_``) is a tool of that episode, called on that episode's environment; ``get_reward() -> float``,
  when defined, is the episode's score and is not a tool (TRL exposes every public method but ``reset``; a
  policy that could call its own reward would be rewarded for asking).

**Calls** are read in the Hermes format that Qwen2.5, Hermes and SmolLM3 templates use, and that is the
default for a template that shows no tools (``DEFAULT_FORMAT``)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123*456"}}
    </tool_call>

Any number of such blocks in one model turn. **Running a call never crashes the run**: an exception in the
tool, a call that takes longer than ``tool_timeout`` seconds, an unknown tool name and arguments that are not a
JSON object or do not fit the function's signature each become an error message that the model reads as the
tool's result, with the cause counted (``CAUSES``). A result longer than ``max_tool_response_length`` tokens
is cut to that length and says so. A timed-out call keeps running in its (daemon) thread until it returns,
because Python cannot stop a thread; its result is thrown away.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhfkit.errors import ConfigError
from rlhfkit.rollout.scoring import accepted_keywords, load_reward_function

# Why a call gave no clean result. The first five are seen by the model as the tool's result; "max_turns"
# and "budget" are calls made in a turn after which the episode stopped (no turn left, or no room left in
# online.response_length), so their results are never shown; nor are those of "template" (a turn the chat
# template rewrote in a way the row cannot follow, which ends its episode: rlhfkit.rollout.chat_turns).
CAUSES = (
    "exception",
    "timeout",
    "unknown_tool",
    "malformed_arguments",
    "too_long",
    "max_turns",
    "budget",
    "template",
)
NOT_TOOLS = ("reset", "get_reward")  # an environment's public methods that are not tools


@dataclass(frozen=True)
class CallFormat:
    """How a model writes tool calls: a JSON object ``{"name", "arguments"}`` between ``start`` and ``end``."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    response_start: str = "<tool_response>"
    response_end: str = "</tool_response>"


DEFAULT_FORMAT = CallFormat()


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


def format_call(name: str, arguments: dict, fmt: CallFormat = DEFAULT_FORMAT) -> str:
    """The text of one call in ``fmt`` (what a demonstration writes)."""
    return f"{fmt.start}\n{json.dumps({'name': name, 'arguments': arguments})}\n{fmt.end}"


# --- loading ------------------------------------------------------------------------------------------------


def tool_schema(fn: Callable, where: str, spec: str) -> dict:
    """transformers' JSON schema of ``fn``; a ConfigError that says what is missing when it has none."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ConfigError(
            f"{where}: tool '{spec}' has no JSON schema: {e}. A tool is a function with a type hint on every "
            "argument and a docstring whose 'Args:' section describes each one (TRL's convention)"
        ) from None


def load_tools(specs: Sequence[str | Callable], where: str = "online.tools") -> dict[str, Callable]:
    """Name -> function for ``online.tools`` (``"file.py:fn"`` / ``"pkg.module:fn"`` names or the functions);
    each is checked for a schema here, at start-up. Two tools with one name are a ConfigError."""
    tools: dict[str, Callable] = {}
    for spec in specs:
        fn = load_reward_function(spec, where) if isinstance(spec, str) else spec
        if not callable(fn):
            raise ConfigError(f"{where}: {spec!r} is not a function")
        name = tool_schema(fn, where, str(spec))["function"]["name"]
        if name in tools:
            raise ConfigError(f"{where}: two tools are named '{name}'")
        tools[name] = fn
    return tools


def load_environment_factory(spec: str | Callable, where: str = "online.environment") -> Callable[[], Any]:
    """The environment factory of ``online.environment`` (a ``"file.py:Name"`` name, or the callable)."""
    factory = load_reward_function(spec, where) if isinstance(spec, str) else spec
    if not callable(factory):
        raise ConfigError(f"{where}: {spec!r} is not callable")
    return factory


def environment_tools(environment: Any, where: str = "online.environment") -> dict[str, Callable]:
    """Name -> bound method for an environment's tools: its public methods but ``reset`` and ``get_reward``."""
    if not callable(getattr(environment, "reset", None)):
        raise ConfigError(
            f"{where}: the environment ({type(environment).__name__}) has no reset(**row) method"
        )
    return {
        name: member
        for name, member in inspect.getmembers(environment, predicate=inspect.ismethod)
        if not name.startswith("_") and name not in NOT_TOOLS
    }


@dataclass
class EpisodeTools:
    """The tools of one episode: ``functions`` (name -> callable), its ``environment`` (or None) and the text
    ``reset`` returned (None when there is no environment or it returned None)."""

    functions: dict[str, Callable]
    environment: Any = None
    reset_text: str | None = None


@dataclass
class Toolbox:
    """The tools of a run, checked at start-up (:meth:`load`); :meth:`episode` gives one episode's.

    Attributes:
        functions: the stateless tools (``online.tools``), shared by every episode.
        environment_factory: makes one environment per episode, or None.
        schemas: the JSON schema of every tool, environment's first (``tools=`` of the chat template).
        environment_scores: the environment has ``get_reward()`` (read from the one :meth:`load` makes).
    """

    functions: dict[str, Callable] = field(default_factory=dict)
    environment_factory: Callable[[], Any] | None = None
    schemas: list[dict] = field(default_factory=list)
    environment_scores: bool = False

    @classmethod
    def load(cls, tools: Sequence[str | Callable] = (), environment: str | Callable | None = None) -> Toolbox:
        """Load and check ``online.tools`` and ``online.environment``. One environment is made to read its
        tools' schemas (TRL does the same); a name given both ways is a ConfigError."""
        functions = load_tools(tools)
        factory, schemas, scores = None, [], False
        if environment is not None:
            factory = load_environment_factory(environment)
            try:
                probe = factory()
            except Exception as e:
                raise ConfigError(
                    f"online.environment: {environment!r}() failed: {type(e).__name__}: {e}"
                ) from None
            for name, method in environment_tools(probe).items():
                if name in functions:
                    raise ConfigError(f"online.tools and online.environment both have a tool named '{name}'")
                schemas.append(tool_schema(method, "online.environment", f"{type(probe).__name__}.{name}"))
            scores = callable(getattr(probe, "get_reward", None))
        schemas += [tool_schema(fn, "online.tools", name) for name, fn in functions.items()]
        return cls(functions, factory, schemas, scores)

    @property
    def names(self) -> list[str]:
        return [schema["function"]["name"] for schema in self.schemas]

    def episode(self, row: dict | None = None) -> EpisodeTools:
        """A fresh episode's tools: a new environment, ``reset(**row)`` with the prompt row's columns."""
        if self.environment_factory is None:
            return EpisodeTools(dict(self.functions))
        environment = self.environment_factory()
        accepted, _ = accepted_keywords(environment.reset)  # None: it takes **kwargs
        row = {k: v for k, v in (row or {}).items() if accepted is None or k in accepted}
        text = environment.reset(**row)
        if text is not None and not isinstance(text, str):
            raise ConfigError(
                f"online.environment: reset() returned {type(text).__name__}; it must return a string or None"
            )
        return EpisodeTools({**environment_tools(environment), **self.functions}, environment, text)


# --- running ------------------------------------------------------------------------------------------------


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


def call_with_timeout(fn: Callable, arguments: dict, timeout: float) -> tuple[bool, Any]:
    """``(finished, outcome)``: ``fn(**arguments)``'s value, or the exception it raised, within ``timeout``
    seconds; ``(False, None)`` when it did not return in time (its daemon thread is left to finish)."""
    box: list = []

    def target():
        try:
            box.append((True, fn(**arguments)))
        except BaseException as e:  # the tool's own failure, handed back to the model
            box.append((False, e))

    thread = threading.Thread(target=target, daemon=True, name="rlhfkit-tool")
    thread.start()
    thread.join(timeout)
    if not box:
        return False, None
    ok, value = box[0]
    return True, value if ok else _Raised(value)


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


def run_tool_call(
    call: ToolCall,
    functions: dict[str, Callable],
    *,
    timeout: float,
    max_length: int | None = None,
    tokenizer=None,
) -> ToolResult:
    """Run one parsed call; every failure is a :class:`ToolResult` with an error message and its cause.

    Args:
        call: the parsed call.
        functions: the episode's tools.
        timeout: seconds (``online.tool_timeout``).
        max_length: the most tokens of ``tokenizer`` a result may have (``online.max_tool_response_length``);
            a longer one is cut and says so (cause ``too_long``). None = no limit.
    """
    if call.error is not None:
        return ToolResult(
            call.name,
            None,
            _error_text(
                call.name,
                f'the call could not be read: {call.text!r}; write {{"name": ..., "arguments": {{...}}}}',
            ),
            call.error,
        )
    fn = functions.get(call.name)
    if fn is None:
        known = ", ".join(sorted(functions)) or "none"
        return ToolResult(
            call.name,
            call.arguments,
            _error_text(call.name, f"unknown tool; the tools are {known}"),
            "unknown_tool",
        )
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        return ToolResult(
            call.name, call.arguments, _error_text(call.name, f"bad arguments: {e}"), "malformed_arguments"
        )
    except ValueError:  # no signature to check against (a builtin): let the call tell
        pass
    finished, value = call_with_timeout(fn, call.arguments, timeout)
    if not finished:
        return ToolResult(
            call.name,
            call.arguments,
            _error_text(call.name, f"no result within {timeout:g} s (timeout)"),
            "timeout",
        )
    if isinstance(value, _Raised):
        e = value.error
        return ToolResult(
            call.name, call.arguments, _error_text(call.name, f"{type(e).__name__}: {e}"), "exception"
        )
    text = result_text(value)
    if max_length is not None and tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_length:
            shown = tokenizer.decode(ids[:max_length], skip_special_tokens=False)
            text = f"{shown}\n[truncated: the result was {len(ids)} tokens; the limit is {max_length}]"
            return ToolResult(call.name, call.arguments, text, "too_long")
    return ToolResult(call.name, call.arguments, text)


def _error_text(name: str, what: str) -> str:
    return f"Error calling tool '{name}': {what}" if name else f"Error: {what}"
