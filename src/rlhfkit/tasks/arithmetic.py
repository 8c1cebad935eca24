"""The ``arithmetic`` task: short sums whose answers can be checked, written step by step.

A prompt is a chain of two or three additions and subtractions of one-digit numbers::

    Compute 7+5-3.

and a response writes one step per line, each step ``x op y=z`` continuing from the previous result,
then the answer line; every line ends with the step separator ``"\\n"`` (the one ``rlhfkit train prm``
appends to every step), so a process reward model reads one score per line::

    7+5=12
    12-3=9
    answer=9

Every running value stays between 0 and 19, so the problems need one carry at most per step.

**Checkers** (the rule rewards; no model involved):

- :func:`exact_match_reward` (``online.reward_functions: ["rlhfkit.tasks.arithmetic:exact_match_reward"]``):
  1.0 when the response's answer line states the right answer, else 0.0 (an ill-formed response included);
- :func:`step_labels`: one label per line of a response, True when the line is the one the reference
  solution writes there (the right operands, the right result, continuing from the right value), so a
  slip and every line after it are wrong (as Math-Shepherd labels a step that can no longer reach the
  answer, Wang et al. 2023). These labels are the PRM's training data (:meth:`ArithmeticTask.prm_records`,
  ``{"prompt", "steps", "labels"}``); :meth:`ArithmeticTask.orm_pairs` gives an outcome reward model's
  pairs (a right solution chosen over a wrong one, ``rlhfkit train reward``).

**The corpus writer** (what SFT imitates) is sloppy in one systematic way: on an addition that carries
(a result of 10 or more) it drops the carry (writes ``7+5=2``) with probability ``carry_slip`` (0.6 by
default) and continues from the wrong value. It writes everything else correctly. A policy that imitates it
greedily drops most carries, so the SFT policy is clearly imperfect, while at temperature 1 it still writes
the right carry often enough for a rule reward to have variance within a group of samples: the headroom
GRPO and RLOO are meant to use.

Digits are single tokens (the tokenizer never sees a number of two digits or a space before a digit, so it
learns no merge that involves one): ``12`` is the two tokens ``1``, ``2``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from itertools import product

from rlhfkit.errors import ConfigError
from rlhfkit.tasks.base import Task

SEPARATOR = "\n"
MAX_VALUE = 19
OPERAND_RANGE = range(1, 10)
PROMPT_TEMPLATE = "Compute {expression}."
ANSWER_PREFIX = "answer="
CORRECT, WRONG = 1.0, 0.0

_PROMPT_RE = re.compile(r"Compute (\d(?:[+-]\d){2,3})\.")
_STEP_RE = re.compile(r"(\d+)([+-])(\d+)=(\d+)")
_ANSWER_RE = re.compile(re.escape(ANSWER_PREFIX) + r"(\d+)")


@dataclass(frozen=True)
class Problem:
    """``operands[0] ops[0] operands[1] ops[1] ...``, evaluated left to right."""

    operands: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def expression(self) -> str:
        return str(self.operands[0]) + "".join(
            f"{o}{x}" for o, x in zip(self.ops, self.operands[1:], strict=True)
        )

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(expression=self.expression)

    def values(self) -> list[int]:
        """The running values: the first operand, then the result of every step."""
        values = [self.operands[0]]
        for op, x in zip(self.ops, self.operands[1:], strict=True):
            values.append(values[-1] + x if op == "+" else values[-1] - x)
        return values

    @property
    def answer(self) -> int:
        return self.values()[-1]

    def reference_lines(self) -> list[str]:
        """The correct solution, one line per step, then the answer line (no separators)."""
        values = self.values()
        lines = [
            f"{v}{op}{x}={w}"
            for v, op, x, w in zip(values[:-1], self.ops, self.operands[1:], values[1:], strict=True)
        ]
        return [*lines, f"{ANSWER_PREFIX}{self.answer}"]


def parse_prompt(prompt: str) -> Problem:
    """The problem of a prompt of this task; ConfigError otherwise."""
    m = _PROMPT_RE.fullmatch(prompt.strip()) if isinstance(prompt, str) else None
    if m is None:
        raise ConfigError(f"not a prompt of the 'arithmetic' task: {prompt!r}")
    expression = m[1]
    return Problem(tuple(int(c) for c in expression[::2]), tuple(expression[1::2]))


def all_problems() -> list[Problem]:
    """Every problem of the task in a fixed order: 3 or 4 one-digit operands, every running value in
    0..``MAX_VALUE``."""
    problems = []
    for n in (3, 4):
        for operands in product(OPERAND_RANGE, repeat=n):
            for ops in product("+-", repeat=n - 1):
                problem = Problem(operands, ops)
                if all(0 <= v <= MAX_VALUE for v in problem.values()):
                    problems.append(problem)
    return problems


def response_lines(response: str) -> list[str]:
    """The lines of a response: split at the separator, the empty piece after a final separator dropped."""
    lines = response.split(SEPARATOR)
    return lines[:-1] if lines and lines[-1] == "" else lines


def final_answer(response: str) -> int | None:
    """The number on the response's answer line (its last line), None when there is none."""
    lines = response_lines(response.strip(" "))
    m = _ANSWER_RE.fullmatch(lines[-1]) if lines else None
    return int(m[1]) if m else None


def step_labels(prompt: str, response: str | list[str]) -> list[bool]:
    """One label per line of ``response`` (a text, or its lines): True where the line is the reference
    solution's line at that position (see the module docstring). Lines past the reference's count are wrong."""
    reference = parse_prompt(prompt).reference_lines()
    lines = response_lines(response) if isinstance(response, str) else list(response)
    labels, ok = [], True
    for i, line in enumerate(lines):
        ok = ok and i < len(reference) and line == reference[i]
        labels.append(ok)
    return labels


def is_correct(prompt: str, response: str) -> bool:
    """Exact match: the answer line states the problem's answer."""
    answer = final_answer(response)
    return answer is not None and answer == parse_prompt(prompt).answer


def is_valid(response: str) -> bool:
    """Well formed: one or more step lines ``x op y=z`` then the answer line, each ending with the separator."""
    if not response.endswith(SEPARATOR):
        return False
    lines = response_lines(response)
    return (
        len(lines) >= 2
        and all(_STEP_RE.fullmatch(line) for line in lines[:-1])
        and _ANSWER_RE.fullmatch(lines[-1]) is not None
    )


def _text(completion) -> str:
    """A completion as text: TRL's conversational form ``[{"role": "assistant", "content": text}]`` too."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def exact_match_reward(prompts, completions, **kwargs) -> list[float | None]:
    """The rule reward: 1.0 for a right final answer, 0.0 otherwise; None (no opinion) for a prompt that is
    not one of this task's. Usable as ``online.reward_functions: ["rlhfkit.tasks.arithmetic:exact_match_reward"]``."""
    out: list[float | None] = []
    for prompt, completion in zip(prompts, completions, strict=True):
        try:
            problem = parse_prompt(_text(prompt) if isinstance(prompt, list) else prompt)
        except ConfigError:
            out.append(None)
            continue
        answer = final_answer(_text(completion))
        out.append(CORRECT if answer == problem.answer else WRONG)
    return out


def step_accuracy_reward(prompts, completions, **kwargs) -> list[float | None]:
    """The fraction of a response's lines that :func:`step_labels` calls right (0.0 for an empty response);
    a process figure for reports, usable as a reward function too."""
    out: list[float | None] = []
    for prompt, completion in zip(prompts, completions, strict=True):
        try:
            labels = step_labels(prompt, _text(completion))
        except ConfigError:
            out.append(None)
            continue
        out.append(sum(labels) / len(labels) if labels else 0.0)
    return out


def write_solution(problem: Problem, rng: random.Random, carry_slip: float) -> list[str]:
    """The corpus writer's lines for a problem: correct, except that an addition that carries drops the
    carry with probability ``carry_slip``; later lines continue from the value written."""
    value, lines = problem.operands[0], []
    for op, x in zip(problem.ops, problem.operands[1:], strict=True):
        result = value + x if op == "+" else value - x
        if op == "+" and result >= 10 and rng.random() < carry_slip:
            result -= 10
        lines.append(f"{value}{op}{x}={result}")
        value = result
    return [*lines, f"{ANSWER_PREFIX}{value}"]


class ArithmeticTask(Task):
    """Checkable arithmetic in steps; see the module docstring.

    Args:
        seed: corpus, prompt splits and model initialisation derive from it.
        num_eval_prompts: size of the held-out ``"eval"`` split.
        carry_slip: the corpus writer's probability of dropping a carry.
        annotator_temperature: Bradley-Terry temperature of the annotators on the exact-match gold score.
    """

    name = "arithmetic"

    def __init__(
        self,
        seed: int = 0,
        num_eval_prompts: int = 512,
        carry_slip: float = 0.6,
        annotator_temperature: float = 0.5,
    ):
        super().__init__(seed=seed, annotator_temperature=annotator_temperature)
        prompts = [p.prompt for p in all_problems()]
        if not 0 < num_eval_prompts < len(prompts):
            raise ConfigError(
                f"num_eval_prompts must be between 1 and {len(prompts) - 1}, got {num_eval_prompts}"
            )
        if not 0.0 <= carry_slip <= 1.0:
            raise ConfigError(f"carry_slip must be a probability in [0, 1], got {carry_slip}")
        random.Random(f"arithmetic-split-{seed}").shuffle(prompts)
        self._splits = {"eval": prompts[:num_eval_prompts], "train": prompts[num_eval_prompts:]}
        self.carry_slip = float(carry_slip)

    def prompts(self, split: str = "train") -> list[str]:
        if split not in self._splits:
            raise ConfigError(f"unknown prompt split {split!r}; the splits are {sorted(self._splits)}")
        return list(self._splits[split])

    def sample_completion(self, prompt: str, rng: random.Random) -> str:
        return "".join(
            line + SEPARATOR for line in write_solution(parse_prompt(prompt), rng, self.carry_slip)
        )

    def gold_score(self, prompt: str, response: str) -> float:
        return CORRECT if is_correct(prompt, response) else WRONG

    def is_valid(self, response: str) -> bool:
        return is_valid(response)

    def step_labels(self, prompt: str, response: str | list[str]) -> list[bool]:
        return step_labels(prompt, response)

    def prm_records(self, n: int = 4096, split: str = "train") -> list[dict]:
        """``n`` process-supervision records ``{"prompt", "steps", "labels"}``: the corpus writer's solutions
        (so about as many slips as the SFT policy makes), every line labelled by :func:`step_labels`."""
        rng = random.Random(f"arithmetic-prm-{self.seed}" + ("" if split == "train" else f"-{split}"))
        prompts = self.prompts(split)
        records = []
        for _ in range(n):
            prompt = rng.choice(prompts)
            lines = write_solution(parse_prompt(prompt), rng, self.carry_slip)
            records.append({"prompt": prompt, "steps": lines, "labels": step_labels(prompt, lines)})
        return records

    def orm_pairs(self, n: int = 4096, split: str = "train") -> list[dict]:
        """``n`` outcome-preference pairs ``{"prompt", "chosen", "rejected"}`` (the records of
        ``rlhfkit train reward``): chosen the reference solution (a right answer), rejected the corpus writer's
        solution of the same prompt when it slipped (a wrong answer). Prompts whose writer solution came out
        right, such as every prompt without a carry, are drawn again, so the outcome reward model sees the
        same mistakes as the PRM's data, labelled once per response instead of once per step."""
        rng = random.Random(f"arithmetic-orm-{self.seed}" + ("" if split == "train" else f"-{split}"))
        prompts = self.prompts(split)
        records = []
        while len(records) < n:
            prompt = rng.choice(prompts)
            problem = parse_prompt(prompt)
            lines = write_solution(problem, rng, self.carry_slip)
            if lines[-1] != f"{ANSWER_PREFIX}{problem.answer}":
                chosen, rejected = (
                    "".join(line + SEPARATOR for line in ls) for ls in (problem.reference_lines(), lines)
                )
                records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        return records

    def tokenizer_texts(self) -> list[str]:
        # Words and symbols only; digits stand alone (no number of two digits, no space before a digit), so
        # the tokenizer learns no merge that involves a digit and every number is written digit by digit.
        words = ["Compute", "answer"]
        symbols = "+-=.\n"
        texts = [f"{w} {w}." for w in words]
        texts += [f"{a}{s}{b}" for a in "0123456789" for s in symbols for b in "0123456789"]
        texts += [f"{ANSWER_PREFIX}{d}\n" for d in "0123456789"]
        return texts
