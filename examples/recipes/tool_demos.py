"""Writes tool_demos.jsonl, the demonstrations of sft_tools.yaml: short word problems, each solved by one call of
the calculator (``rlhfkit.tasks.calculator:calculator``), its result, and a final sentence that ends with the
number. The rows are in TRL's shape: an assistant message with ``tool_calls``, a ``tool`` message with the
result, then the answer (docs/tools.md, "Teaching a model its tools").

    python examples/recipes/tool_demos.py            # rewrites examples/recipes/tool_demos.jsonl (seeded)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlhfkit.tasks.calculator import calculator

# (question, expression) with {a} and {b} to fill; every expression's value is a whole number
PROBLEMS = [
    ("A farm has {a} rows of {b} apple trees. How many apple trees are on the farm?", "{a}*{b}"),
    ("Tom had {a} marbles and bought {b} more. How many marbles does he have now?", "{a}+{b}"),
    ("A tank held {a} litres of water and {b} litres were drained. How many litres are left?", "{a}-{b}"),
    ("{a} cookies are shared equally among {b} children. How many cookies does each child get?", "{a}//{b}"),
    ("A train travels {a} km a day for {b} days. How many km does it travel?", "{a}*{b}"),
]


def demonstration(rng: random.Random) -> dict:
    question, expression = rng.choice(PROBLEMS)
    b = rng.randint(3, 60)
    a = b * rng.randint(4, 90) if "//" in expression else rng.randint(b + 10, 999)
    expression = expression.format(a=a, b=b)
    value = calculator(expression)  # the tool's own result, as the episodes will show it
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return {
        "messages": [
            {"role": "user", "content": question.format(a=a, b=b)},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": value},
            {"role": "assistant", "content": f"The calculator gives {value}, so the answer is {value}."},
        ]
    }


def main(n: int = 256, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path = Path(__file__).with_name("tool_demos.jsonl")
    path.write_text("".join(json.dumps(demonstration(rng)) + "\n" for _ in range(n)))
    return path


if __name__ == "__main__":
    print(main())
