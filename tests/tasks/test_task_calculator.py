"""The built-in ``tools`` task (rlhfkit.tasks.calculator): the calculator parses arithmetic safely, the
questions need it, the gold scorer checks the final answer, and the demonstrations mix calls and direct answers
in a form the multi-turn rollout reads token-exactly."""

from __future__ import annotations

import random

import pytest

from rlhfkit.errors import ConfigError
from rlhfkit.rollout.chat_turns import ChatTurns
from rlhfkit.rollout.tools import Toolbox, parse_tool_calls
from rlhfkit.tasks import TASKS, get_task
from rlhfkit.tasks.calculator import (
    Problem,
    ToolsTask,
    calculator,
    correct_answer_reward,
    final_answer,
    parse_prompt,
    used_tool,
)


def test_calculator_computes_arithmetic():
    assert calculator("123*456") == "56088"
    assert calculator(" (1 + 2) * -3 ") == "-9"
    assert calculator("7/2") == "3.5" and calculator("8/2") == "4"
    assert calculator("2**10 % 1000 // 3") == "8"


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('echo hi')",  # a call
        "x * 2",  # a name
        "(1).real",  # an attribute
        "'ab' * 3",  # a string
        "[1, 2]",
        "1 if 1 else 2",
        "9**9**9",  # an exponent that would run for ever
        "10**20 * 10**20",  # too large
        "1" * 201,  # too long
        "1 +",  # not an expression
    ],
)
def test_calculator_refuses_everything_but_arithmetic(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_calculator_never_calls_eval(monkeypatch):
    import builtins

    def no_eval(*args, **kwargs):
        raise AssertionError("eval was called")

    monkeypatch.setattr(builtins, "eval", no_eval)
    assert calculator("12*34") == "408"


def test_the_calculator_is_a_trl_style_tool():
    (schema,) = Toolbox.load([calculator]).schemas
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def test_questions_are_products_of_three_digit_numbers_in_disjoint_splits():
    task = get_task("tools", seed=1)
    assert isinstance(task, TASKS["tools"])
    train, evaluation = task.prompts("train"), task.prompts("eval")
    assert len(evaluation) == 256 and not set(train) & set(evaluation)
    for prompt in train[:200] + evaluation:
        problem = parse_prompt(prompt)
        assert 100 <= problem.a <= 999 and 100 <= problem.b <= 999
        assert problem.answer >= 10_000  # five or six digits: beyond a small model's mental arithmetic
    assert ToolsTask(seed=1).prompts("eval") == evaluation and ToolsTask(seed=2).prompts("eval") != evaluation


def test_gold_scorer_checks_the_final_answer():
    task = ToolsTask()
    prompt = Problem(123, 456).prompt
    assert task.gold_score(prompt, "answer=56088") == 1.0
    assert task.gold_score(prompt, "answer=56089") == 0.0
    assert task.gold_score(prompt, "56088") == 0.0  # no answer line
    assert task.gold_score(prompt, "answer=1\nanswer=56088") == 1.0  # the last answer line counts
    conversation = [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": "answer=56088"},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "answer=7"},
    ]
    assert task.gold_score([conversation[0]], conversation) == 0.0  # the final assistant message counts
    assert final_answer(conversation[:2]) == 56088
    assert correct_answer_reward(
        [prompt, prompt, "Compute 1+2."],
        ["answer=56088", [{"role": "assistant", "content": "answer=2"}], "x"],
    ) == [1.0, 0.0, None]


def test_demonstrations_leave_room_for_rl():
    task = ToolsTask(seed=0)
    conversations = task.sft_conversations(400)
    with_tool = [c for c in conversations if used_tool(c)]
    without = [c for c in conversations if not used_tool(c)]
    assert 0.4 < len(with_tool) / len(conversations) < 0.6
    for c in with_tool:
        (call,) = parse_tool_calls(c[1]["content"])
        assert call.error is None and call.name == "calculator"
        assert c[2] == {"role": "tool", "name": "calculator", "content": calculator(**call.arguments)}
        assert task.gold_score(c[0]["content"], c) == 1.0
    right = sum(task.gold_score(c[0]["content"], c) for c in without) / len(without)
    assert 0.1 < right < 0.35  # mental arithmetic: mostly wrong in the last digits
    assert task.sft_conversations(10) == conversations[:10]
    assert task.sft_records(2) == [{"messages": c} for c in conversations[:2]]
    with pytest.raises(ConfigError):
        ToolsTask(tool_rate=1.5)


def test_task_template_gives_token_exact_rows():
    task = ToolsTask()
    tokenizer = task.build_tokenizer()
    schemas = Toolbox.load([calculator]).schemas
    turns = ChatTurns.for_tokenizer(tokenizer, schemas)  # checks prefix stability; raises when broken
    assert turns.shows_tools
    conversation = next(c for c in task.sft_conversations(20) if used_tool(c))
    text = tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for marker in ("<tool_call>", "</tool_call>", "<|assistant|>", "<|tool|>"):
        assert tokenizer.convert_tokens_to_ids(marker) in ids
    digits = [tokenizer.decode([i]) for i in ids if tokenizer.decode([i]).isdigit()]
    assert digits and all(len(d) == 1 for d in digits)  # numbers are written digit by digit
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_mental_answers_are_reproducible():
    task = ToolsTask(seed=3)
    a = task.sample_conversation(task.prompts()[0], random.Random(0))
    b = task.sample_conversation(task.prompts()[0], random.Random(0))
    assert a == b
