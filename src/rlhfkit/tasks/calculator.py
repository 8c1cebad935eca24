"""The ``tools`` task: products of two 3-digit numbers, which a small model answers reliably only with its tool.

A prompt asks for one product::

    What is 123*456?

and the policy has one tool, :func:`calculator` (arithmetic parsed with ``ast``, never ``eval``). An episode
that uses it calls the tool, reads the result and answers; the final assistant message ends with the answer
line ``answer=56088``. The **gold scorer** (:func:`is_correct`, :func:`correct_answer_reward`) checks that
number against the product.

**The demonstrations** (:meth:`ToolsTask.sft_conversations`, what SFT imitates) leave room for RL: with
probability ``tool_rate`` (0.5) the writer calls the calculator and copies its result; otherwise it answers
at once, from mental arithmetic that gets the leading digits right and the last three right only with
probability ``mental_accuracy`` (0.2). A policy that imitates the writer calls the tool about half the time
and is right mostly when it does, so RL can raise both the tool-use rate and the correct-answer rate.

**The chat template** (:data:`CHAT_TEMPLATE`) shows the tools by name (the schemas would make every prompt
hundreds of tokens long for a model of a few hundred thousand parameters), writes the assistant's text
verbatim followed by EOS, and is prefix-stable, so multi-turn rows are token-exact
(:mod:`rlhfkit.rollout.chat_turns`). Role markers and the tool-call markers are single tokens; digits are
single tokens too (as in the ``arithmetic`` task), so a product is written digit by digit.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from dataclasses import dataclass
from pathlib import Path

from rlhfkit.errors import ConfigError
from rlhfkit.tasks.base import Task, message_text
from rlhfkit.tasks.tokenizer import save_tokenizer, train_tokenizer

PROMPT_TEMPLATE = "What is {a}*{b}?"
ANSWER_PREFIX = "answer="
OPERANDS = range(100, 1000)
CORRECT, WRONG = 1.0, 0.0
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]

CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ '\\n' }}"
    "{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_PROMPT_RE = re.compile(r"What is (\d{3})\*(\d{3})\?")
_ANSWER_RE = re.compile(re.escape(ANSWER_PREFIX) + r"(-?\d+)")

# --- the tool ------------------------------------------------------------------------------------------------

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30
MAX_EXPONENT = 64


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **``, unary signs and parentheses.
    Anything else (names, calls, attributes, strings) is a ValueError; so are exponents over
    ``MAX_EXPONENT`` and values over ``MAX_MAGNITUDE`` in size (no expression can exhaust memory or time)."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("the result is too large or not a real number")
        return value
    raise ValueError(f"unsupported in an arithmetic expression: {type(node).__name__}")


def format_number(value: int | float) -> str:
    """An integer-valued result without a decimal point; others to 10 significant digits."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def calculator(expression: str) -> str:
    """
    Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: The expression to evaluate, for example "123*456".
    """
    return format_number(evaluate(expression))


# --- problems and the gold scorer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(a=self.a, b=self.b)

    @property
    def answer(self) -> int:
        return self.a * self.b

    @property
    def expression(self) -> str:
        return f"{self.a}*{self.b}"


def parse_prompt(prompt) -> Problem:
    """The problem of a prompt (a string or chat messages) of this task; ConfigError otherwise."""
    m = _PROMPT_RE.search(message_text(prompt))
    if m is None:
        raise ConfigError(f"not a prompt of the 'tools' task: {prompt!r}")
    return Problem(int(m[1]), int(m[2]))


def final_answer(response) -> int | None:
    """The number on the last ``answer=`` line of the final assistant message, None when there is none."""
    found = _ANSWER_RE.findall(message_text(response))
    return int(found[-1]) if found else None


def is_correct(prompt, response) -> bool:
    """The final answer is the product (a ConfigError for a prompt that is not this task's)."""
    problem = parse_prompt(prompt)
    answer = final_answer(response)
    return answer is not None and answer == problem.answer


def used_tool(conversation: list[dict], name: str = "calculator") -> bool:
    """True when an assistant message of ``conversation`` calls ``name`` (the tool-use rate counts these)."""
    call = f'"name": "{name}"'
    return any(
        m.get("role") == "assistant" and CALL_START in str(m.get("content")) and call in str(m.get("content"))
        for m in conversation
    )


def correct_answer_reward(prompts, completions, **kwargs) -> list[float | None]:
    """1.0 for a right final answer, 0.0 otherwise, None for a prompt that is not this task's. Usable as
    ``online.reward_functions: ["rlhfkit.tasks.calculator:correct_answer_reward"]``."""
    out: list[float | None] = []
    for prompt, completion in zip(prompts, completions, strict=True):
        try:
            out.append(CORRECT if is_correct(prompt, completion) else WRONG)
        except ConfigError:
            out.append(None)
    return out


# --- the task -------------------------------------------------------------------------------------------------


def call_text(problem: Problem) -> str:
    """The demonstrations' tool call (the Hermes format that :mod:`rlhfkit.rollout.tools` reads)."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": problem.expression}})
    return f"{CALL_START}\n{body}\n{CALL_END}"


def mental_answer(problem: Problem, rng: random.Random, accuracy: float) -> int:
    """The writer's answer without the tool: the leading digits right; the last three right with probability
    ``accuracy``, else three other digits."""
    if rng.random() < accuracy:
        return problem.answer
    head, tail = divmod(problem.answer, 1000)
    wrong = (tail + rng.randrange(1, 1000)) % 1000
    return head * 1000 + wrong


class ToolsTask(Task):
    """Products of 3-digit numbers with a calculator tool; see the module docstring.

    Args:
        seed: the prompt splits and the demonstrations derive from it.
        num_train_prompts, num_eval_prompts: sizes of the disjoint splits.
        tool_rate: the share of demonstrations that call the tool.
        mental_accuracy: how often an answer without the tool is right.
        annotator_temperature: Bradley-Terry temperature of the annotators on the gold score.
    """

    name = "tools"

    def __init__(
        self,
        seed: int = 0,
        num_train_prompts: int = 20000,
        num_eval_prompts: int = 256,
        tool_rate: float = 0.5,
        mental_accuracy: float = 0.2,
        annotator_temperature: float = 0.5,
    ):
        super().__init__(seed=seed, annotator_temperature=annotator_temperature)
        for name, p in (("tool_rate", tool_rate), ("mental_accuracy", mental_accuracy)):
            if not 0.0 <= p <= 1.0:
                raise ConfigError(f"{name} must be a probability in [0, 1], got {p}")
        total = num_train_prompts + num_eval_prompts
        if num_train_prompts < 1 or num_eval_prompts < 1 or total > len(OPERANDS) ** 2:
            raise ConfigError(f"num_train_prompts and num_eval_prompts must be >= 1, {total} in all at most")
        rng = random.Random(f"tools-split-{seed}")
        picked = rng.sample(range(len(OPERANDS) ** 2), total)  # distinct pairs
        prompts = [Problem(OPERANDS[i // len(OPERANDS)], OPERANDS[i % len(OPERANDS)]).prompt for i in picked]
        self._splits = {"eval": prompts[:num_eval_prompts], "train": prompts[num_eval_prompts:]}
        self.tool_rate, self.mental_accuracy = float(tool_rate), float(mental_accuracy)

    def prompts(self, split: str = "train") -> list[str]:
        if split not in self._splits:
            raise ConfigError(f"unknown prompt split {split!r}; the splits are {sorted(self._splits)}")
        return list(self._splits[split])

    def sample_conversation(self, prompt: str, rng: random.Random) -> list[dict]:
        """One demonstration: the user's question, then either a call, its result and the answer, or the answer
        at once (module docstring)."""
        problem = parse_prompt(prompt)
        user = {"role": "user", "content": prompt}
        if rng.random() < self.tool_rate:
            return [
                user,
                {"role": "assistant", "content": call_text(problem)},
                {"role": "tool", "name": "calculator", "content": calculator(problem.expression)},
                {"role": "assistant", "content": f"{ANSWER_PREFIX}{problem.answer}"},
            ]
        guess = mental_answer(problem, rng, self.mental_accuracy)
        return [user, {"role": "assistant", "content": f"{ANSWER_PREFIX}{guess}"}]

    def sft_conversations(self, n: int = 4096, split: str = "train") -> list[list[dict]]:
        """``n`` demonstrations on the prompts of ``split``; deterministic from the seed, and the first m of
        ``sft_conversations(n)`` are ``sft_conversations(m)``."""
        rng = random.Random(f"tools-sft-{self.seed}" + ("" if split == "train" else f"-{split}"))
        prompts = self.prompts(split)
        return [self.sample_conversation(rng.choice(prompts), rng) for _ in range(n)]

    def sft_records(self, n: int = 4096, split: str = "train") -> list[dict]:
        """The demonstrations as ``{"messages": [...]}`` records (tool calls, results and answers)."""
        return [{"messages": conversation} for conversation in self.sft_conversations(n, split)]

    def sample_completion(self, prompt: str, rng: random.Random) -> str:
        """The final assistant message of one demonstration."""
        return self.sample_conversation(prompt, rng)[-1]["content"]

    def gold_score(self, prompt, response) -> float:
        return CORRECT if is_correct(prompt, response) else WRONG

    def is_valid(self, response) -> bool:
        return _ANSWER_RE.fullmatch(message_text(response).strip()) is not None

    def tokenizer_texts(self) -> list[str]:
        # Words and JSON punctuation; digits stand alone (no number of two digits), as in the arithmetic task.
        words = ["What", "is", "answer", "name", "arguments", "expression", "calculator", "tools", "Error"]
        texts = [f"{w} {w}: {w}." for w in words]
        texts.append(json.dumps({"name": "calculator", "arguments": {"expression": "1*2"}}))
        texts += [f"{a}*{b}?\n{ANSWER_PREFIX}{a}" for a in "0123456789" for b in "0123456789"]
        return texts

    def build_tokenizer(self, out_dir: str | Path | None = None):
        """The task's byte-level BPE with the role and tool-call markers as single tokens and
        :data:`CHAT_TEMPLATE` as its chat template."""
        tokenizer = train_tokenizer(self.tokenizer_texts())
        tokenizer.add_special_tokens({"additional_special_tokens": [*ROLE_TOKENS, CALL_START, CALL_END]})
        tokenizer.chat_template = CHAT_TEMPLATE
        return tokenizer if out_dir is None else save_tokenizer(tokenizer, out_dir)
