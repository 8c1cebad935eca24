"""Reward functions for grpo.yaml: grade-school math (openai/gsm8k) scored on the final answer.

TRL's convention: ``fn(prompts=..., completions=..., **columns) -> list[float | None]``; every other column of
the prompt dataset comes in as a keyword, one entry per response, so gsm8k's ``answer`` column (worked
solution, then ``#### 42``) arrives as ``answer``.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number in ``text`` (after ``####`` when there is one), without thousands separators."""
    text = text.split("####")[-1]
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value


def correct(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the response's last number is the reference answer, else 0.0."""
    out = []
    for completion, reference in zip(completions, answer, strict=True):
        if isinstance(completion, list):  # conversational prompts give the assistant message(s)
            completion = completion[-1]["content"]
        out.append(
            float(
                final_number(completion) is not None and final_number(completion) == final_number(reference)
            )
        )
    return out
