"""A reader of ``samples.jsonl`` that takes what it finds: one JSON object per line, fields optional.

The online trainer logs a few responses per rollout, one object per line, with at least ``step``,
``prompt``, ``response``, ``score``, ``kl``, ``length``, ``ended`` and the parts of the reward. The report
only shows these rows, so a missing field is shown as missing rather than refused, and a line that is not a
JSON object is counted and skipped (a run still writing, or killed mid-line, leaves a partial last line).

Reward parts are taken from a mapping under ``parts``, ``reward_parts`` or ``rewards``; any other number in
the row that is not one of the known fields is shown as a part too.

A multi-turn episode (``online.tools`` / ``online.environment``) also has ``turns``: per model turn
``{"role": "assistant", "text"}``, per tool call ``{"role": "tool", "name", "arguments", "result", "error"}``
(``error``: the cause of a failed call, else null); the report shows them as a conversation.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEACHER_SAMPLES_FILE = "teacher_samples.jsonl"  # a distillation run's student and teacher side by side
KNOWN = ("step", "prompt", "response", "score", "gold", "kl", "length", "ended", "turns")
PART_KEYS = ("parts", "reward_parts", "rewards")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass
class Sample:
    """One row of ``samples.jsonl``; None where the row has no such field (or not of the right type)."""

    step: int | None
    prompt: str
    response: str
    score: float | None = None
    gold: float | None = None
    kl: float | None = None
    length: int | None = None
    ended: bool | None = None
    parts: dict[str, float | None] = field(default_factory=dict)
    turns: list[dict[str, str | None]] | None = None  # an episode's turns (:func:`read_turns`), else None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "prompt": self.prompt,
            "response": self.response,
            "score": self.score,
            "gold": self.gold,
            "kl": self.kl,
            "length": self.length,
            "ended": self.ended,
            "parts": self.parts,
            "turns": self.turns,
        }


@dataclass
class SampleFile:
    """The rows read, and how many lines were skipped (not a JSON object)."""

    samples: list[Sample]
    skipped_lines: int = 0


def read_samples(path: str | Path) -> SampleFile:
    """Read ``path`` (missing file: no samples)."""
    path = Path(path)
    if not path.is_file():
        return SampleFile([])
    samples, skipped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if not isinstance(row, dict):
            skipped += 1
            continue
        samples.append(_sample(row))
    return SampleFile(samples, skipped)


def _sample(row: dict[str, Any]) -> Sample:
    parts: dict[str, float | None] = {}
    for key in PART_KEYS:
        if isinstance(row.get(key), dict):
            parts.update({str(k): _number(v) for k, v in row[key].items()})
    for key, value in row.items():
        if key not in KNOWN and key not in PART_KEYS and _number(value) is not None:
            parts.setdefault(key, _number(value))
    step = row.get("step")
    length = row.get("length")
    ended = row.get("ended")
    return Sample(
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        prompt=as_text(row.get("prompt")),
        response=as_text(row.get("response")),
        score=_number(row.get("score")),
        gold=_number(row.get("gold")),
        kl=_number(row.get("kl")),
        length=int(length) if _number(length) is not None else None,
        ended=ended if isinstance(ended, bool) else None,
        parts=parts,
        turns=read_turns(row.get("turns")),
    )


def read_side_by_side(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a distillation run's ``teacher_samples.jsonl`` (missing file: none): ``step`` (int or
    None), ``split`` (``eval``: held-out prompts; ``train``: training prompts), ``prompt``, ``student`` and
    ``teacher`` as text, each response's length and whether it ended (None where missing). A line that is not
    a JSON object is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        step = row.get("step")
        read = {"step": step if isinstance(step, int) and not isinstance(step, bool) else None}
        read["split"] = "eval" if row.get("split") == "eval" else "train"
        read.update({key: as_text(row.get(key)) for key in ("prompt", "student", "teacher")})
        for who in ("student", "teacher"):
            length, ended = row.get(f"{who}_length"), row.get(f"{who}_ended")
            read[f"{who}_length"] = int(length) if _number(length) is not None else None
            read[f"{who}_ended"] = ended if isinstance(ended, bool) else None
        rows.append(read)
    return rows


def read_turns(value: Any) -> list[dict[str, str | None]] | None:
    """An episode's ``turns`` as text fields (None when the row has none): ``role``, ``text`` (a model turn),
    ``name``, ``arguments`` (JSON text), ``result`` and ``error`` (a tool call); a field that is missing or of
    another type is written as text or left None, never refused."""
    if not isinstance(value, list):
        return None
    turns = []
    for turn in value:
        if not isinstance(turn, dict):
            continue
        role = str(turn.get("role") or "?")
        if role == "tool":
            arguments = turn.get("arguments")
            error = turn.get("error")
            turns.append(
                {
                    "role": "tool",
                    "name": as_text(turn.get("name")) or "?",
                    "arguments": arguments
                    if isinstance(arguments, str)
                    else json.dumps(arguments, ensure_ascii=False),
                    "result": as_text(turn.get("result")),
                    "error": None if error is None else as_text(error),
                }
            )
        else:
            turns.append({"role": role, "text": as_text(turn.get("text", turn.get("content")))})
    return turns


def turns_text(turns: list[dict[str, str | None]]) -> str:
    """An episode's turns (:func:`read_turns`) as lines: ``assistant: ...``, ``call name(arguments) -> result``
    or ``call name(arguments) -> error (cause): result``."""
    lines = []
    for turn in turns:
        if turn["role"] != "tool":
            lines.append(f"{turn['role']}: {turn['text']}")
            continue
        outcome = turn["result"] if turn["error"] is None else f"error ({turn['error']}): {turn['result']}"
        lines.append(f"call {turn['name']}({turn['arguments']}) -> {outcome}")
    return "\n".join(lines)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def as_text(value: Any) -> str:
    """A prompt or response as text: a string as it is, a conversation as ``role: content`` lines."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(f"{m.get('role', '?')}: {as_text(m.get('content'))}" for m in value)
    return json.dumps(value, ensure_ascii=False)


def printable(text: str, keep_newlines: bool = True) -> str:
    """``text`` with control characters written as escapes (``\\x07``), so none reaches a page or a terminal
    raw; newlines stay (or become ``\\n`` when ``keep_newlines`` is false, for one-line markdown)."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    text = text.replace("\t", "\\t")
    return text if keep_newlines else text.replace("\r", "\\r").replace("\n", "\\n")
