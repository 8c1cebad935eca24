"""``samples.jsonl``: responses of an online run that a person can read, with their scores.

Every online run (ppo / grpo / rloo) writes ``logging.samples_per_step`` responses of each rollout (the
first ones of the rollout, so with ``online.group_size`` > 1 whole groups of responses to one prompt, as
GRPO compares them) to ``<run>/samples.jsonl``, one JSON object per response::

    {"step": 12, "prompt": "...", "response": "...", "score": 0.7, "parts": {"reward_model": 0.5, "fn": 0.2},
     "kl": 1.3, "length": 17, "ended": true}

- ``prompt``: as in the data (a string, or a list of chat messages); ``response``: the decoded text up to the
  stop token, without special tokens;
- ``score``: the score that entered the rewards (after the missing-EOS rule and clipping), or null when
  nothing scored the response (it was left out of the loss); ``parts``: each part's value (the reward model's
  normalised score, each reward function's value; null where a function had no opinion);
- ``kl``: the sum over the response of the per-token KL estimate that was trained on (nats);
- ``length``: response tokens (stop token included); ``ended``: whether it stopped at a stop token.

With several processes, the main process writes its own share. On ``--resume`` the lines after the
checkpoint are dropped, as in ``metrics.jsonl``. :func:`pick_samples` chooses what the report shows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from rlhfkit.engine.atomic import atomic_write_text
from rlhfkit.rollout.generation import decode_responses

SAMPLES_FILE = "samples.jsonl"


def _number(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def rollout_samples(
    step: int,
    records: list[dict],
    rollout,
    parts: dict[str, torch.Tensor],
    tokenizer,
    count: int,
    responses: list[str] | None = None,
) -> list[dict[str, Any]]:
    """The first ``count`` responses of ``rollout`` as ``samples.jsonl`` rows (module docstring).

    Args:
        records: the data row of each response (its ``prompt`` is written).
        rollout: a :class:`rlhfkit.types.Rollout` with ``scores``, ``kl`` and ``response_mask`` (the response
            up to its stop token) set; ``mask`` False on a whole row means the response was left out of the loss.
        parts: name -> (B,) score parts (NaN = no opinion).
        responses: the decoded texts when the scorer already decoded them.
    """
    shown = min(count, rollout.batch_size)
    if shown <= 0:
        return []
    response_mask = rollout.response_mask
    if responses is None:
        responses = decode_responses(tokenizer, rollout.response_ids[:shown], response_mask[:shown])
    scores, kl = rollout.scores[:shown].tolist(), rollout.kl[:shown].sum(1).tolist()
    trained = rollout.mask[:shown].any(1).tolist()
    lengths, ended = response_mask[:shown].sum(1).tolist(), rollout.ended[:shown].tolist()
    values = {name: part[:shown].tolist() for name, part in parts.items()}
    rows = []
    for i in range(shown):
        unscored = all(math.isnan(v[i]) for v in values.values())
        rows.append(
            {
                "step": int(step),
                "prompt": records[i].get("prompt"),
                "response": responses[i],
                "score": None if unscored else _number(scores[i]),
                "parts": {name: _number(v[i]) for name, v in values.items()},
                "kl": _number(kl[i]) if trained[i] else None,
                "length": int(lengths[i]),
                "ended": bool(ended[i]),
            }
        )
    return rows


class SamplesWriter:
    """Appends rows to ``samples.jsonl``, flushed per rollout.

    Args:
        path: the file.
        keep_until: drop the rows already there with a larger ``step`` first (-1: all of them), as a resumed
            run does with ``metrics.jsonl``.
        enabled: False writes nothing (``logging.samples_per_step`` 0, or not the main process).
    """

    def __init__(self, path: str | Path, keep_until: int, enabled: bool = True):
        self.path, self.enabled, self._file = Path(path), enabled, None
        if not enabled:
            return
        if self.path.is_file():
            kept = [row for row in read_samples(self.path) if row["step"] <= keep_until]
            atomic_write_text(self.path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in kept))
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, rows: list[dict[str, Any]]) -> None:
        if self._file is None or not rows:
            return
        self._file.write("".join(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in rows))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``samples.jsonl`` (a partial last line, left by a kill, is skipped)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def pick_samples(rows: list[dict[str, Any]], count: int = 3) -> dict[str, list[dict[str, Any]]]:
    """What the report shows: ``newest`` (the last rollout's first ``count`` rows), ``best`` and ``worst``
    (the ``count`` highest- and lowest-scored rows of the whole run; unscored rows are in neither)."""
    if not rows:
        return {}
    last = max(row["step"] for row in rows)
    scored = sorted(
        (row for row in rows if isinstance(row.get("score"), int | float)), key=lambda r: r["score"]
    )
    return {
        "newest": [row for row in rows if row["step"] == last][:count],
        "best": scored[::-1][:count],
        "worst": scored[:count],
    }
