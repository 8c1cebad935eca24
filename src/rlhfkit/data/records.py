"""Validating records of the four kinds of DESIGN.md "Data formats", with errors that name the
file, the line (or row) and the field.

Kinds and fields (extra fields are kept, e.g. an ``answer`` for a reward function):
- ``prompts``: ``prompt``;
- ``sft``: ``prompt`` + ``completion``, or ``messages`` (the final message, an assistant reply, is
  the completion and everything before it the prompt);
- ``preferences``: ``prompt`` + ``chosen`` + ``rejected``, optional numeric ``margin``;
- ``prm`` (process supervision): ``prompt`` + ``steps`` (list of strings) + ``labels`` (list of
  booleans, one per step).

A prompt is a non-empty string (plain) or a non-empty list of ``{"role", "content"}`` messages
(conversational). With a conversational prompt, a response (``completion``, ``chosen``,
``rejected``) is a string or a list of assistant messages; with a plain prompt it is a string.
After validation every conversational response is a list of messages, so tokenisation sees one
shape per case. A missing field and a null one (a hole in a Parquet column) are reported alike.
"""

from __future__ import annotations

import os
from typing import Literal

from rlhfkit.data.readers import RawRows, read_rows
from rlhfkit.errors import DataError

Kind = Literal["prompts", "sft", "preferences", "prm"]
KINDS = ("prompts", "sft", "preferences", "prm")


class FieldError(Exception):
    """A problem with one field of one record (turned into a DataError with the record's location)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


class Records(list):
    """Validated records (dicts) of one source, in order, with where each came from.

    Attributes:
        kind: the record kind.
        where: the source, and the line (1-based, JSON Lines) or row (0-based) of each record.
    """

    def __init__(self, rows: list[dict], raw: RawRows, kind: str):
        super().__init__(rows)
        self.kind = kind
        self.where = RawRows(raw.source, [], raw.locations, raw.row_kind)

    @property
    def source(self) -> str:
        return self.where.source

    def error(self, index: int, message: str, field: str | None = None) -> DataError:
        """A DataError that names record ``index``'s source, line/row and ``field``."""
        return self.where.error(index, message, field)


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _get(record: dict, name: str):
    value = record.get(name)
    if value is None:
        raise FieldError(name, "is missing" if name not in record else "is null")
    return value


def _text(value, name: str) -> str:
    if not isinstance(value, str):
        raise FieldError(name, f"expected a string, got {_type_name(value)}")
    if not value.strip():
        raise FieldError(name, "is empty")
    return value


def _messages(value, name: str, require_role: str | None = None) -> list[dict]:
    if not value:
        raise FieldError(name, "is an empty list of messages")
    out = []
    for i, message in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise FieldError(
                where, f"expected a message object with 'role' and 'content', got {_type_name(message)}"
            )
        role = _text(message.get("role"), f"{where}.role")
        content = message.get("content")
        if not isinstance(content, str):
            raise FieldError(f"{where}.content", f"expected a string, got {_type_name(content)}")
        if require_role is not None and role != require_role:
            raise FieldError(f"{where}.role", f"expected '{require_role}', got '{role}'")
        out.append(dict(message))
    return out


def _prompt(record: dict) -> str | list[dict]:
    value = _get(record, "prompt")
    if isinstance(value, list):
        return _messages(value, "prompt")
    if not isinstance(value, str):
        raise FieldError("prompt", f"expected a string or a list of messages, got {_type_name(value)}")
    return _text(value, "prompt")


def _response(record: dict, name: str, conversational: bool) -> str | list[dict]:
    value = _get(record, name)
    if isinstance(value, list):
        if not conversational:
            raise FieldError(
                name, "is a list of messages but the prompt is plain text; make both conversational"
            )
        messages = _messages(value, name, require_role="assistant")
        _text(messages[-1]["content"], f"{name}[{len(messages) - 1}].content")
        return messages
    text = _text(value, name) if isinstance(value, str) else None
    if text is None:
        expected = "a string or a list of messages" if conversational else "a string"
        raise FieldError(name, f"expected {expected}, got {_type_name(value)}")
    return [{"role": "assistant", "content": text}] if conversational else text


def _validate_prompts(record: dict) -> dict:
    return {**record, "prompt": _prompt(record)}


def _validate_sft(record: dict) -> dict:
    if record.get("messages") is not None:
        if record.get("prompt") is not None:
            raise FieldError("messages", "give either 'messages' or 'prompt' + 'completion', not both")
        value = record["messages"]
        if not isinstance(value, list):
            raise FieldError("messages", f"expected a list of messages, got {_type_name(value)}")
        messages = _messages(value, "messages")
        last = len(messages) - 1
        if messages[last]["role"] != "assistant":
            raise FieldError(
                f"messages[{last}].role", "the last message must be the assistant reply to train on"
            )
        _text(messages[last]["content"], f"messages[{last}].content")
        if last == 0:
            raise FieldError("messages", "needs at least one message before the assistant reply (the prompt)")
        out = {key: value for key, value in record.items() if key != "messages"}
        return {**out, "prompt": messages[:last], "completion": messages[last:]}
    prompt = _prompt(record)
    return {
        **record,
        "prompt": prompt,
        "completion": _response(record, "completion", isinstance(prompt, list)),
    }


def _validate_preferences(record: dict) -> dict:
    prompt = _prompt(record)
    conversational = isinstance(prompt, list)
    out = {**record, "prompt": prompt}
    for name in ("chosen", "rejected"):
        out[name] = _response(record, name, conversational)
    margin = record.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int | float)):
        raise FieldError("margin", f"expected a number, got {_type_name(margin)}")
    return out


def _validate_prm(record: dict) -> dict:
    prompt = _prompt(record)
    steps, labels = _get(record, "steps"), _get(record, "labels")
    if not isinstance(steps, list):
        raise FieldError("steps", f"expected a list of strings, got {_type_name(steps)}")
    if not steps:
        raise FieldError("steps", "is an empty list")
    for i, step in enumerate(steps):
        _text(step, f"steps[{i}]")
    if not isinstance(labels, list):
        raise FieldError("labels", f"expected a list of booleans, got {_type_name(labels)}")
    for i, label in enumerate(labels):
        if not isinstance(label, bool):
            raise FieldError(f"labels[{i}]", f"expected true or false, got {_type_name(label)} {label!r}")
    if len(labels) != len(steps):
        raise FieldError("labels", f"has {len(labels)} labels for {len(steps)} steps; give one per step")
    return {**record, "prompt": prompt}


VALIDATORS = {
    "prompts": _validate_prompts,
    "sft": _validate_sft,
    "preferences": _validate_preferences,
    "prm": _validate_prm,
}


def validate_rows(raw: RawRows, kind: Kind) -> Records:
    """Validate every row of ``raw`` as ``kind``; raise a DataError at the first bad one."""
    if kind not in VALIDATORS:
        raise ValueError(f"unknown data kind '{kind}': one of {', '.join(KINDS)}")
    if not raw.rows:
        raise DataError(raw.source, "the dataset has no records")
    records = []
    for index, row in enumerate(raw.rows):
        try:
            records.append(VALIDATORS[kind](row))
        except FieldError as error:
            raise raw.error(index, error.message, field=error.field) from None
    return Records(records, raw, kind)


def load_dataset_records(source: str | os.PathLike, kind: Kind, split: str = "train") -> Records:
    """Read and validate a whole dataset before any training starts.

    Args:
        source: a .jsonl / .json / .parquet file, a ``datasets`` folder, or a hub dataset name.
        kind: ``"prompts"``, ``"sft"``, ``"preferences"`` or ``"prm"``.
        split: the split of a ``DatasetDict`` folder or a hub dataset.
    Returns:
        the validated records, a list of dicts in the normalised shapes of this module's docstring.
    Raises:
        DataError: naming the file, the line (1-based, JSON Lines) or row (0-based), and the field.
    """
    return validate_rows(read_rows(source, split), kind)
