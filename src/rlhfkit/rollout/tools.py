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

**Running a call never crashes the run**, and never outlives its timeout. Each episode's tools run in a
process of their own (:mod:`rlhfkit.rollout.tool_worker`, forked when the episode starts; its environment is
made and reset there). What the model reads back:

- the tool's return value: a string as it is, anything else as JSON (``str()`` when JSON cannot hold it);
  longer than ``max_tool_response_length`` tokens, cut to that length with a line that says so (``too_long``);
- an exception: ``Error calling tool 'name': TypeName: message`` (``exception``); an unknown name
  (``unknown_tool``) or arguments that are not a JSON object or do not fit the signature
  (``malformed_arguments``), each with what was wrong;
- a call that takes longer than ``tool_timeout`` seconds: its process group is killed (``SIGKILL``) and the
  model reads ``no result within N s (timeout)`` (``timeout``, also counted as ``tools/timeouts``). With an
  environment the episode ends there, without EOS: the environment died with the process, and an episode
  never goes on from a state the model was told had failed (the environment's score is then no opinion). The
  stateless ``online.tools`` get a fresh process and the episode goes on. Later calls of the same turn are
  not run (``not_run``);
- a process that ends without answering (``os._exit``, a crash, the ``online.tool_memory_mb`` limit):
  ``the tool's process ended without a result`` (``died``), then as for a timeout.

The calls of one turn run in every episode's process at once, so a hanging tool costs one timeout per turn.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhfkit.errors import ConfigError
from rlhfkit.rollout.scoring import accepted_keywords, load_reward_function
from rlhfkit.rollout.tool_format import (  # noqa: F401  (the format's names, also read from here)
    DEFAULT_FORMAT,
    CallFormat,
    ToolCall,
    ToolResult,
    format_call,
    parse_tool_calls,
    result_text,
)
from rlhfkit.rollout.tool_worker import MAX_RESULT_CHARS, Reply, ToolWorker, WorkerDied, serve_turn

# Why a call gave no clean result. All but the last three are seen by the model as the tool's result; "max_turns"
# and "budget" are calls made in a turn after which the episode stopped (no turn left, or no room left in
# online.response_length), so their results are never shown; nor are those of "template" (a turn the chat
# template rewrote in a way the row cannot follow, which ends its episode: rlhfkit.rollout.chat_turns).
CAUSES = (
    "exception",
    "timeout",
    "died",
    "not_run",
    "unknown_tool",
    "malformed_arguments",
    "too_long",
    "max_turns",
    "budget",
    "template",
)
NOT_TOOLS = ("reset", "get_reward")  # an environment's public methods that are not tools


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


class EnvironmentHandle:
    """An episode's environment as reward functions see it (``environments=``): it lives in the episode's
    worker process; reading an attribute reads it there, calling a method calls it there (within the tool
    timeout). After the worker is gone (killed at a timeout, or closed once the rollout is scored), any use
    raises ``RuntimeError``."""

    def __init__(self, worker: ToolWorker, timeout: float):
        object.__setattr__(self, "_worker", worker)
        object.__setattr__(self, "_timeout", timeout)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        kind, value = self._ask("attribute", name)
        if kind == "method":
            return lambda *args, **kwargs: self._ask("method", name, args, kwargs)[1]
        return value

    def _ask(self, *args: Any) -> tuple[str, Any]:
        worker = self._worker
        if not worker.alive:
            raise RuntimeError(f"the episode's environment is gone ({worker.death})")
        reply = worker.run("environment", *args, timeout=self._timeout)
        if not reply.ok:
            raise RuntimeError(f"the environment raised {reply.error}")
        return reply.value


@dataclass
class EpisodeTools:
    """The tools of one episode: their ``names``, the ``worker`` process that runs them (and holds the
    environment), the ``environment`` as reward functions see it (None without one) and the text ``reset``
    returned (None when there is no environment or it returned None)."""

    names: list[str]
    worker: ToolWorker
    environment: EnvironmentHandle | None = None
    reset_text: str | None = None
    timeout: float = 10.0

    def call(self, name: str, **arguments: Any) -> ToolResult:
        """One call in the episode's process, as a turn's calls run (:func:`run_turn_calls`)."""
        return run_turn_calls([(self, [ToolCall(name, arguments, "")])], timeout=self.timeout)[0][0]

    def close(self) -> None:
        self.worker.close()


@dataclass
class Toolbox:
    """The tools of a run, checked at start-up (:meth:`load`); :meth:`episode` gives one episode's.

    Attributes:
        functions: the stateless tools (``online.tools``), shared by every episode.
        environment_factory: makes one environment per episode, or None.
        schemas: the JSON schema of every tool, environment's first (``tools=`` of the chat template).
        environment_scores: the environment has ``get_reward()`` (read from the one :meth:`load` makes).
        timeout: seconds of one call, of ``reset`` and of ``get_reward`` (``online.tool_timeout``).
        memory_mb: address space an episode's process may add (``online.tool_memory_mb``; None = no limit).
    """

    functions: dict[str, Callable] = field(default_factory=dict)
    environment_factory: Callable[[], Any] | None = None
    schemas: list[dict] = field(default_factory=list)
    environment_scores: bool = False
    timeout: float = 10.0
    memory_mb: int | None = None

    @classmethod
    def load(
        cls,
        tools: Sequence[str | Callable] = (),
        environment: str | Callable | None = None,
        *,
        timeout: float = 10.0,
        memory_mb: int | None = None,
    ) -> Toolbox:
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
        return cls(functions, factory, schemas, scores, timeout, memory_mb)

    @property
    def names(self) -> list[str]:
        return [schema["function"]["name"] for schema in self.schemas]

    def episode(self, row: dict | None = None) -> EpisodeTools:
        """A fresh episode's tools in a process of their own: a new environment there, ``reset(**row)`` with
        the prompt row's columns (those it takes). A ``reset`` that raises, hangs past the timeout or returns
        something else than a string or None is a :class:`ToolSetupError` naming it."""
        functions, factory = self.functions, self.environment_factory
        row = dict(row or {})

        def setup() -> dict[str, Any]:  # runs in the worker
            if factory is None:
                return {"tools": dict(functions)}
            env = factory()
            accepted, _ = accepted_keywords(env.reset)  # None: it takes **kwargs
            get_reward = getattr(env, "get_reward", None)
            return {
                "tools": {**environment_tools(env), **functions},
                "reset": lambda: env.reset(
                    **{k: v for k, v in row.items() if accepted is None or k in accepted}
                ),
                "get_reward": get_reward if callable(get_reward) else (lambda: None),
                "environment": lambda *args: _environment_access(env, *args),
            }

        worker = ToolWorker(setup, self.memory_mb)
        names = self._ask(worker, "setup", what="making the episode's tools").value
        if factory is None:
            return EpisodeTools(names, worker, timeout=self.timeout)
        text = self._ask(worker, "run", "reset", (), what="reset()").value
        if text is not None and not isinstance(text, str):
            worker.close()
            raise ToolSetupError(
                f"online.environment: reset() returned {type(text).__name__}; it must return a string or None"
            )
        return EpisodeTools(names, worker, EnvironmentHandle(worker, self.timeout), text, self.timeout)

    def _ask(self, worker: ToolWorker, *message: Any, what: str) -> Reply:
        try:
            reply = worker.ask(*message, timeout=self.timeout)
        except (TimeoutError, WorkerDied) as e:
            worker.close()
            raise ToolSetupError(f"online.environment: {what} did not finish: {e}") from None
        if not reply.ok:
            worker.close()
            raise ToolSetupError(f"online.environment: {what} raised {reply.error}")
        return reply


class ToolSetupError(ConfigError):
    """An environment that cannot start an episode (``reset`` raised, hung or returned a non-string): the
    user's code, not the model's doing, so the run stops with this one line."""


def _environment_access(env: Any, kind: str, name: str, args: tuple = (), kwargs: dict | None = None):
    """In the worker: ``("attribute", name)`` -> ("method", None) or ("value", the attribute);
    ``("method", name, args, kwargs)`` -> ("value", what the method returned)."""
    if kind == "method":
        return "value", getattr(env, name)(*args, **(kwargs or {}))
    value = getattr(env, name)
    return ("method", None) if callable(value) else ("value", value)


# --- running ------------------------------------------------------------------------------------------------


def run_turn_calls(
    jobs: Sequence[tuple[EpisodeTools, Sequence[ToolCall]]],
    *,
    timeout: float,
    max_length: int | None = None,
    tokenizer=None,
) -> list[list[ToolResult]]:
    """Run the parsed calls of one turn of several episodes, every episode's process at once (each runs its
    own calls in order); every failure is a :class:`ToolResult` with an error message and its cause.

    Args:
        jobs: (episode's tools, its calls) per episode.
        timeout: seconds per call (``online.tool_timeout``).
        max_length: the most tokens of ``tokenizer`` a result may have (``online.max_tool_response_length``);
            a longer one is cut and says so (cause ``too_long``). None = no limit.
    """
    max_chars = (
        MAX_RESULT_CHARS if max_length is None else min(MAX_RESULT_CHARS, max(1 << 16, 64 * max_length))
    )
    runnable = [
        (tools.worker, [(c.name, c.arguments) for c in calls if c.error is None]) for tools, calls in jobs
    ]
    replies = serve_turn(runnable, timeout=timeout, max_chars=max_chars)
    out = []
    for (_, calls), answered in zip(jobs, replies, strict=True):
        answered = iter(answered)
        out.append(
            [
                _unreadable(call)
                if call.error is not None
                else _result(call, next(answered), timeout, max_length, max_chars, tokenizer)
                for call in calls
            ]
        )
    return out


def run_tool_call(
    call: ToolCall,
    functions: dict[str, Callable],
    *,
    timeout: float,
    max_length: int | None = None,
    tokenizer=None,
) -> ToolResult:
    """Run one parsed call of stateless ``functions`` in a process of its own (closed after it), as an
    episode's calls run (:func:`run_turn_calls`)."""
    worker = ToolWorker(lambda: {"tools": dict(functions)})
    try:
        worker.ask("setup", timeout=timeout)
        jobs = [(EpisodeTools(sorted(functions), worker), [call])]
        return run_turn_calls(jobs, timeout=timeout, max_length=max_length, tokenizer=tokenizer)[0][0]
    finally:
        worker.close()


def _unreadable(call: ToolCall) -> ToolResult:
    what = f'the call could not be read: {call.text!r}; write {{"name": ..., "arguments": {{...}}}}'
    return ToolResult(call.name, None, _error_text(call.name, what), call.error)


def _result(
    call: ToolCall, reply: Reply | str, timeout: float, max_length: int | None, max_chars: int, tokenizer
) -> ToolResult:
    """What the model reads for one call's outcome (module docstring)."""
    name, arguments = call.name, call.arguments
    if reply == "timeout":
        return ToolResult(
            name, arguments, _error_text(name, f"no result within {timeout:g} s (timeout)"), "timeout"
        )
    if reply == "died":
        return ToolResult(
            name, arguments, _error_text(name, "the tool's process ended without a result"), "died"
        )
    if reply == "not_run":
        what = "not run: an earlier call of this turn did not finish"
        return ToolResult(name, arguments, _error_text(name, what), "not_run")
    if not reply.ok:
        return ToolResult(name, arguments, _error_text(name, reply.error), reply.cause)
    text = reply.value
    if max_length is not None and tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_length or reply.length > len(text):
            shown = tokenizer.decode(ids[:max_length], skip_special_tokens=False)
            size = f"{len(ids)} tokens" if reply.length <= len(text) else f"{reply.length} characters"
            text = f"{shown}\n[truncated: the result was {size}; the limit is {max_length}]"
            return ToolResult(name, arguments, text, "too_long")
    elif reply.length > len(text):
        text = f"{text}\n[truncated: the result was {reply.length} characters; the limit is {max_chars}]"
        return ToolResult(name, arguments, text, "too_long")
    return ToolResult(name, arguments, text)


def _error_text(name: str, what: str) -> str:
    return f"Error calling tool '{name}': {what}" if name else f"Error: {what}"
