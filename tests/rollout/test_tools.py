"""Tools (rlhfkit.rollout.tools): TRL-style loading from files, schemas, call parsing, and calls that fail
safely (exception, timeout, unknown name, bad arguments, over-long results) without crashing."""

from __future__ import annotations

import time

import pytest

from rlhfkit.errors import ConfigError
from rlhfkit.rollout.tools import (
    Toolbox,
    ToolCall,
    format_call,
    load_tools,
    parse_tool_calls,
    run_tool_call,
)
from tests.helpers_tools import tool_tokenizer

TOOLS_FILE = '''
import time


def search(query: str, limit: int = 3) -> str:
    """
    Search the notes.

    Args:
        query: What to look for
        limit: How many hits at most
    """
    return f"{limit} hits for {query}"


def undocumented(x: int) -> int:
    return x


def untyped(x):
    """Echo.

    Args:
        x: anything
    """
    return x
'''

# TRL's own example environment (trl demo_grpo_environment.py): reset takes no keywords at all.
TRL_ENV_FILE = '''
class IncrementEnv:
    def __init__(self):
        self._counter = 0

    def reset(self) -> None:
        self._counter = 0

    def increment(self, a: int) -> int:
        """
        Increment the integer by a specified value

        Args:
            a: The value to increment by

        Returns:
            The incremented integer.
        """
        self._counter += a
        return self._counter
'''


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    (tmp_path / "tools.py").write_text(TOOLS_FILE)
    (tmp_path / "env.py").write_text(TRL_ENV_FILE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_trl_style_tools_load_from_files_with_their_schemas(in_tmp):
    toolbox = Toolbox.load(["tools.py:search"])
    (schema,) = toolbox.schemas
    assert schema["function"]["name"] == "search"
    assert schema["function"]["parameters"]["required"] == ["query"]
    assert schema["function"]["parameters"]["properties"]["limit"]["description"] == "How many hits at most"
    assert toolbox.episode({"prompt": "x"}).call("search", query="a").text == "3 hits for a"


@pytest.mark.parametrize("name, why", [("undocumented", "no docstring"), ("untyped", "type hint")])
def test_a_tool_without_hints_or_docstring_is_a_named_error_at_start_up(in_tmp, name, why):
    with pytest.raises(ConfigError, match=f"online.tools: tool 'tools.py:{name}' has no JSON schema.*{why}"):
        load_tools([f"tools.py:{name}"])


def test_two_tools_with_one_name_are_refused(in_tmp):
    with pytest.raises(ConfigError, match="two tools are named 'search'"):
        load_tools(["tools.py:search", "tools.py:search"])


def test_trl_style_environment_class_loads_unchanged(in_tmp):
    toolbox = Toolbox.load([], "env.py:IncrementEnv")
    assert toolbox.names == ["increment"]  # reset and _-prefixed are not tools
    first, second = toolbox.episode({"prompt": "p", "answer": 3}), toolbox.episode({"prompt": "q"})
    assert first.environment is not second.environment  # one environment per episode
    assert first.reset_text is None
    assert first.call("increment", a=2).text == "2" and first.call("increment", a=2).text == "4"
    assert second.call("increment", a=1).text == "1"


def test_get_reward_is_not_a_tool_and_names_may_not_clash(in_tmp):
    (in_tmp / "env2.py").write_text(
        TRL_ENV_FILE + "\n    def get_reward(self) -> float:\n        return float(self._counter)\n"
    )
    assert Toolbox.load([], "env2.py:IncrementEnv").names == ["increment"]
    (in_tmp / "env3.py").write_text(TRL_ENV_FILE.replace("def increment", "def search"))
    with pytest.raises(ConfigError, match="both have a tool named 'search'"):
        Toolbox.load(["tools.py:search"], "env3.py:IncrementEnv")


def test_parse_hermes_calls():
    text = (
        "Let me compute.\n" + format_call("calculator", {"expression": "2*3"}) + "\n" + format_call("f", {})
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2*3"}, None),
        ("f", {}, None),
    ]
    # arguments as a JSON string, as some models write them
    (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert call.arguments == {"a": 1}
    assert parse_tool_calls("no call here") == []
    for bad in (
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {}}',  # left open at the end of the turn
    ):
        (call,) = parse_tool_calls(bad)
        assert call.error == "malformed_arguments", bad


def boom() -> str:
    """Fails.

    Args:
    """
    raise ValueError("no")


def slow() -> str:
    time.sleep(2)
    return "late"


def test_failing_calls_come_back_as_error_messages_with_their_cause():
    functions = {"boom": boom, "slow": slow, "add": lambda a, b: a + b, "obj": lambda: {"x": [1, 2]}}
    cases = [
        (ToolCall("boom", {}, ""), "exception", "ValueError: no"),
        (ToolCall("slow", {}, ""), "timeout", "no result within 0.1 s"),
        (ToolCall("nope", {}, ""), "unknown_tool", "unknown tool; the tools are add, boom, obj, slow"),
        (ToolCall("add", {"a": 1}, ""), "malformed_arguments", "bad arguments"),
        (ToolCall("", None, "{oops", "malformed_arguments"), "malformed_arguments", "could not be read"),
    ]
    for call, cause, message in cases:
        start = time.perf_counter()
        result = run_tool_call(call, functions, timeout=0.1)
        assert result.error == cause and message in result.text, (cause, result.text)
        assert result.text.startswith("Error")
        assert time.perf_counter() - start < 1.0
    ok = run_tool_call(ToolCall("add", {"a": 1, "b": 2}, ""), functions, timeout=1.0)
    assert (ok.text, ok.error) == ("3", None)
    assert run_tool_call(ToolCall("obj", {}, ""), functions, timeout=1.0).text == '{"x": [1, 2]}'


def test_a_long_result_is_cut_to_the_token_limit_and_says_so():
    tok = tool_tokenizer()
    functions = {"long": lambda: "answer " * 50}
    result = run_tool_call(ToolCall("long", {}, ""), functions, timeout=1.0, max_length=4, tokenizer=tok)
    total = len(tok("answer " * 50, add_special_tokens=False)["input_ids"])
    shown, note = result.text.split("\n[truncated")
    assert len(tok(shown, add_special_tokens=False)["input_ids"]) == 4
    assert note == f": the result was {total} tokens; the limit is 4]"
    assert result.error == "too_long"
    short = run_tool_call(ToolCall("long", {}, ""), functions, timeout=1.0, max_length=total, tokenizer=tok)
    assert short.error is None and short.text == "answer " * 50
