"""Validating records of the four kinds of docs/design.md, "Data formats", with errors that name the
file, the line (or row) and the field.

Kinds and the shapes each accepts (detected from each row; extra fields are kept, e.g. an ``answer``
for a reward function):
- ``prompts``: ``prompt``; or, without one, the prompt of an SFT ``messages`` row (the turns before
  its final assistant reply) or of a preference row (the turns ``chosen`` and ``rejected`` share);
- ``sft``: ``prompt`` + ``completion``; ``messages`` (the final message, an assistant reply, is the
  completion and everything before it the prompt); or ``text`` (plain text, all of it trained on);
- ``preferences``: ``prompt`` + ``chosen`` + ``rejected`` (optional numeric ``margin``); or, with no
  ``prompt`` (an *implicit prompt*, the shape of HH-RLHF and trl-lib's UltraFeedback), ``chosen`` and
  ``rejected`` as whole conversations whose shared first turns are the prompt, or as plain strings whose
  shared text up to the last ``Assistant:`` at the start of a line (HH-RLHF's ``\n\nHuman:`` /
  ``\n\nAssistant:``) is the prompt;
- ``prm`` (process supervision): ``prompt`` + ``steps`` (list of strings) + ``labels`` (list of
  booleans, one per step).

A prompt is a non-empty string (plain) or a non-empty list of ``{"role", "content"}`` messages
(conversational), each role one of :data:`ROLES` (``system``, ``user``, ``assistant``, ``tool``). A response (``completion``, ``chosen``, ``rejected``) is a string or a list of
assistant messages. A response list that starts with the prompt's turns (the H4 UltraFeedback shape:
``prompt`` a string, ``chosen`` / ``rejected`` repeating it as a user message) has them taken off, after
a check that they are the prompt. An assistant message may carry TRL's ``tool_calls`` (its content then empty or
null) and an SFT ``tool`` message must answer a call before it; an SFT row's ``tools`` column is read as JSON
schemas (:mod:`rlhfkit.data.tool_calls`). With a plain-text prompt and assistant messages as the response, the
prompt becomes one user message. After validation every conversational response is a list of
assistant messages, so tokenisation sees one shape per case. A missing field and a null one (a hole in
a Parquet column) are reported alike.

``columns`` maps the standard names (:data:`STANDARD_COLUMNS`) to a dataset's own column names (the
``data.columns`` key), e.g. ``{"prompt": "question"}``; the columns are renamed before validation.
"""

from __future__ import annotations

import math
import os
import re
from typing import Literal

from rlhfkit.config import check_columns
from rlhfkit.data.readers import RawRows, read_rows
from rlhfkit.data.row_errors import FieldError, type_name
from rlhfkit.data.tool_calls import check_tool_results, read_schemas, read_tool_calls
from rlhfkit.errors import DataError

Kind = Literal["prompts", "sft", "preferences", "prm"]
KINDS = ("prompts", "sft", "preferences", "prm")
# The roles of a message: those chat templates render (a misspelt one, "usr", would reach the template, which
# drops it or renders it as it stands, and the model would train on a conversation nobody wrote).
ROLES = ("system", "user", "assistant", "tool")


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


def _get(record: dict, name: str):
    value = record.get(name)
    if value is None:
        raise FieldError(name, "is missing" if name not in record else "is null")
    return value


def _text(value, name: str) -> str:
    if not isinstance(value, str):
        raise FieldError(name, f"expected a string, got {type_name(value)}")
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
                where, f"expected a message object with 'role' and 'content', got {type_name(message)}"
            )
        role = _text(message.get("role"), f"{where}.role")
        if role not in ROLES:
            raise FieldError(
                f"{where}.role", f"unknown role '{role}': expected one of {', '.join(repr(r) for r in ROLES)}"
            )
        content, message = message.get("content"), dict(message)
        if content is None and "text" in message:  # another library's message shape
            raise FieldError(f"{where}.text", "a message's text goes under 'content', not 'text'")
        if message.get("tool_calls") is not None:  # TRL's shape: the calls, the content empty or null
            if role != "assistant":
                raise FieldError(
                    f"{where}.tool_calls", f"only an assistant message makes calls, not a '{role}' one"
                )
            message["tool_calls"] = read_tool_calls(message["tool_calls"], where)
            content = message["content"] = "" if content is None else content
        if not isinstance(content, str):
            raise FieldError(f"{where}.content", f"expected a string, got {type_name(content)}")
        if require_role is not None and role != require_role:
            raise FieldError(f"{where}.role", f"expected '{require_role}', got '{role}'")
        out.append(message)
    return out


def _prompt(record: dict) -> str | list[dict]:
    value = _get(record, "prompt")
    if isinstance(value, list):
        return _messages(value, "prompt")
    if not isinstance(value, str):
        raise FieldError("prompt", f"expected a string or a list of messages, got {type_name(value)}")
    return _text(value, "prompt")


def _missing_prompt(record: dict) -> FieldError:
    columns = ", ".join(map(str, record)) or "none"
    return FieldError(
        "prompt",
        f"is missing (the row's columns: {columns}; name yours with data.columns, "
        "e.g. data.columns={prompt: question})",
    )


def _response(value, name: str, conversational: bool) -> str | list[dict]:
    """A validated response: a string, or (``conversational``) a list of assistant messages."""
    if value is None:
        raise FieldError(name, "is null")
    if isinstance(value, list):
        messages = _messages(value, name, require_role="assistant")
        _text(messages[-1]["content"], f"{name}[{len(messages) - 1}].content")
        return messages
    text = _text(value, name) if isinstance(value, str) else None
    if text is None:
        raise FieldError(name, f"expected a string or a list of messages, got {type_name(value)}")
    return [{"role": "assistant", "content": text}] if conversational else text


def _shared_turns(conversations: dict[str, list]) -> int:
    """How many first messages every conversation shares, backed off so that each remainder starts with an
    assistant message (the longest common prefix of messages; with one conversation, the turns before its
    final run of assistant replies)."""
    names = list(conversations)
    for name in names:
        _messages(conversations[name], name)
    lists = list(conversations.values())
    if len(lists) == 1:
        shared = len(lists[0])
    else:
        shared = 0
        while all(len(c) > shared for c in lists) and all(c[shared] == lists[0][shared] for c in lists):
            shared += 1
    while shared > 0 and lists[0][shared - 1]["role"] == "assistant":
        shared -= 1
    if shared == 0:
        what = "share no first turns" if len(lists) > 1 else "has no turn before its assistant reply"
        if all(m["role"] == "assistant" for c in lists for m in c):
            what = "hold only assistant messages" if len(lists) > 1 else "holds only assistant messages"
        raise FieldError(
            names[0],
            f"{' and '.join(names)} {what}, so there is no prompt to take from them; give a 'prompt' column",
        )
    for name, conversation in conversations.items():
        for i in range(shared, len(conversation)):
            if conversation[i]["role"] != "assistant":
                raise FieldError(
                    f"{name}[{i}].role",
                    f"is '{conversation[i]['role']}' after the {shared} turn(s) that make the prompt; the reply "
                    "after the prompt must be assistant messages",
                )
        if len(conversation) == shared:
            raise FieldError(name, f"has no assistant reply after the {shared} turn(s) that make the prompt")
    return shared


# The last line that starts with this marks where the reply begins in plain-text conversations
# (HH-RLHF: "\n\nHuman: ...\n\nAssistant: ...").
ASSISTANT_MARKER = re.compile(r"(?:^|\n)Assistant:")


def _shared_text_prompt(texts: dict[str, str], record: dict) -> int:
    """Where the prompt ends in plain-text conversations: after the last ``Assistant:`` at the start of a
    line within the text they share (the reply keeps its leading space, as a tokenizer expects)."""
    for name, text in texts.items():
        _text(text, name)
    values = list(texts.values())
    common = 0
    while all(len(t) > common for t in values) and all(t[common] == values[0][common] for t in values):
        common += 1
    ends = [match.end() for match in ASSISTANT_MARKER.finditer(values[0][:common])]
    names = " and ".join(texts)
    if not ends:
        raise FieldError(
            next(iter(texts)),
            f"{names} are plain text with no 'prompt' column, and the text they "
            "share has no line starting with 'Assistant:' to end a prompt; give a "
            f"'prompt' column, or name yours with data.columns (the row's columns: "
            f"{', '.join(map(str, record))})",
        )
    return ends[-1]


def _split_responses(
    record: dict, names: tuple[str, ...], prompt: str | list[dict] | None
) -> tuple[str | list[dict], list[str | list[dict]]]:
    """The prompt and the responses ``names`` of ``record``, in one of the shapes of the module docstring.

    ``prompt`` is the validated ``prompt`` column, or None for an implicit prompt.
    """
    values = {name: _get(record, name) for name in names}
    repeats = {
        name: v
        for name, v in values.items()
        if isinstance(v, list) and any(isinstance(m, dict) and m.get("role") != "assistant" for m in v)
    }
    if prompt is None and all(isinstance(v, str) for v in values.values()):  # HH-RLHF plain text
        end = _shared_text_prompt(values, record)
        prompt = _text(values[names[0]][:end], "prompt")
        return prompt, [_response(v[end:], name, False) for name, v in values.items()]
    if prompt is None or repeats:
        lists = {name: v for name, v in values.items() if isinstance(v, list)}
        if len(lists) < len(values):
            other = next(name for name in values if name not in lists)
            what = "whole conversations" if prompt is None else "conversations that repeat the prompt"
            raise FieldError(
                other,
                f"expected a list of messages like {', '.join(lists)} ({what}), "
                f"got {type_name(values[other])}",
            )
        shared = _shared_turns(lists)
        turns = next(iter(lists.values()))[:shared]
        if prompt is not None:
            _check_repeated_prompt(prompt, turns, next(iter(lists)))
        return turns, [_response(v[shared:], name, True) for name, v in values.items()]
    conversational = isinstance(prompt, list) or any(isinstance(v, list) for v in values.values())
    if conversational and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return prompt, [_response(v, name, conversational) for name, v in values.items()]


def _check_repeated_prompt(prompt: str | list[dict], turns: list[dict], name: str) -> None:
    if isinstance(prompt, list):
        same = [(m["role"], m["content"].strip()) for m in prompt] == [
            (m["role"], m["content"].strip()) for m in turns
        ]
    else:
        same = turns[-1]["content"].strip() == prompt.strip()
    if not same:
        raise FieldError(
            name,
            "starts with turns that are not the prompt column's (a response that repeats the "
            "prompt must repeat it exactly)",
        )


def _validate_prompts(record: dict) -> dict:
    if record.get("prompt") is not None:
        return {**record, "prompt": _prompt(record)}
    if record.get("messages") is not None:
        messages = _messages(_list(record, "messages"), "messages")
        shared = len(messages)
        while shared > 0 and messages[shared - 1]["role"] == "assistant":
            shared -= 1
        if shared == 0:
            raise FieldError("messages", "has no turn before its assistant reply, so there is no prompt")
        return {**record, "prompt": messages[:shared]}
    if record.get("chosen") is not None and record.get("rejected") is not None:
        prompt, _ = _split_responses(record, ("chosen", "rejected"), None)
        return {**record, "prompt": prompt}
    raise _missing_prompt(record)


def _list(record: dict, name: str) -> list:
    value = record[name]
    if not isinstance(value, list):
        raise FieldError(name, f"expected a list of messages, got {type_name(value)}")
    return value


def _validate_sft(record: dict) -> dict:
    given = [name for name in ("messages", "prompt", "text") if record.get(name) is not None]
    if len(given) > 1:
        raise FieldError(
            given[1],
            f"give one of 'messages', 'prompt' + 'completion' or 'text', not "
            f"{' and '.join(repr(g) for g in given)}",
        )
    if given == ["messages"]:
        messages = _messages(_list(record, "messages"), "messages")
        last = len(messages) - 1
        if messages[last]["role"] != "assistant":
            raise FieldError(
                f"messages[{last}].role", "the last message must be the assistant reply to train on"
            )
        _text(messages[last]["content"], f"messages[{last}].content")
        if last == 0:
            raise FieldError("messages", "needs at least one message before the assistant reply (the prompt)")
        check_tool_results(messages, "messages")
        out = {key: value for key, value in record.items() if key != "messages"}
        return {**_tools_column(out), "prompt": messages[:last], "completion": messages[last:]}
    if given == ["text"]:
        value = record["text"]
        if not isinstance(value, str):
            raise FieldError("text", f"expected a string, got {type_name(value)}")
        return {**record, "text": _text(value, "text")}
    if not given:
        raise _missing_prompt(record)
    prompt, (completion,) = _split_responses(record, ("completion",), _prompt(record))
    if isinstance(prompt, list):
        check_tool_results([*prompt, *completion], "prompt")
    return {**_tools_column(record), "prompt": prompt, "completion": completion}


def _tools_column(record: dict) -> dict:
    """An SFT record with its ``tools`` column, if any, read as a list of JSON schemas."""
    return record if record.get("tools") is None else {**record, "tools": read_schemas(record["tools"])}


def _validate_preferences(record: dict) -> dict:
    prompt = _prompt(record) if record.get("prompt") is not None else None
    if prompt is None and (record.get("chosen") is None or record.get("rejected") is None):
        raise _missing_prompt(record) if "prompt" not in record else FieldError("prompt", "is null")
    prompt, (chosen, rejected) = _split_responses(record, ("chosen", "rejected"), prompt)
    out = {**record, "prompt": prompt, "chosen": chosen, "rejected": rejected}
    margin = record.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int | float)):
        raise FieldError("margin", f"expected a number, got {type_name(margin)}")
    if margin is not None and not math.isfinite(margin):
        raise FieldError("margin", f"must be a finite number, got {margin}")
    if chosen == rejected:  # the loss is stuck at ln 2 and the pair teaches nothing
        raise FieldError("rejected", "is the same as chosen; a preference pair needs two different responses")
    return out


def _validate_prm(record: dict) -> dict:
    prompt = _prompt(record)
    steps, labels = _get(record, "steps"), _get(record, "labels")
    if not isinstance(steps, list):
        raise FieldError("steps", f"expected a list of strings, got {type_name(steps)}")
    if not steps:
        raise FieldError("steps", "is an empty list")
    for i, step in enumerate(steps):
        _text(step, f"steps[{i}]")
    if not isinstance(labels, list):
        raise FieldError("labels", f"expected a list of booleans, got {type_name(labels)}")
    for i, label in enumerate(labels):
        if not isinstance(label, bool):
            raise FieldError(f"labels[{i}]", f"expected true or false, got {type_name(label)} {label!r}")
    if len(labels) != len(steps):
        raise FieldError("labels", f"has {len(labels)} labels for {len(steps)} steps; give one per step")
    return {**record, "prompt": prompt}


VALIDATORS = {
    "prompts": _validate_prompts,
    "sft": _validate_sft,
    "preferences": _validate_preferences,
    "prm": _validate_prm,
}


def rename_columns(raw: RawRows, columns: dict | None) -> RawRows:
    """``raw`` with its columns renamed to the standard names of ``columns`` (standard name -> column).

    A mapped column that no row has, or a standard name that is also a column of its own (which the
    mapping would hide), is a DataError naming the columns there are.
    """
    columns = {name: column for name, column in check_columns(columns).items() if name != column}
    if not columns or not raw.rows:
        return raw
    present = {key for row in raw.rows for key in row}
    for name, column in columns.items():
        if column not in present:
            raise DataError(
                raw.source,
                f"data.columns maps '{name}' to '{column}', which is not a column here "
                f"(columns: {', '.join(sorted(map(str, present)))})",
            )
        if name in present and name not in columns.values():
            raise DataError(
                raw.source,
                f"data.columns maps '{name}' to '{column}', but the data also has a "
                f"'{name}' column, which that would hide; map it too, or drop it",
            )
    rows = []
    for row in raw.rows:
        renamed = {key: value for key, value in row.items() if key not in columns.values()}
        renamed.update({name: row[column] for name, column in columns.items() if column in row})
        rows.append(renamed)
    return RawRows(raw.source, rows, raw.locations, raw.row_kind)


def validate_rows(raw: RawRows, kind: Kind, columns: dict | None = None) -> Records:
    """Validate every row of ``raw`` as ``kind`` (after renaming ``columns``, standard name -> column);
    raise a DataError at the first bad one."""
    if kind not in VALIDATORS:
        raise ValueError(f"unknown data kind '{kind}': one of {', '.join(KINDS)}")
    if not raw.rows:
        raise DataError(raw.source, "the dataset has no records")
    raw = rename_columns(raw, columns)
    records = []
    for index, row in enumerate(raw.rows):
        try:
            records.append(VALIDATORS[kind](row))
        except FieldError as error:
            raise raw.error(index, error.message, field=error.field) from None
    return Records(records, raw, kind)


def load_dataset_records(
    source: str | os.PathLike,
    kind: Kind,
    split: str | None = "train",
    columns: dict | None = None,
    split_key: str = "data.train_split",
    dataset_config: str | None = None,
) -> Records:
    """Read and validate a whole dataset before any training starts.

    Args:
        source: a .jsonl / .json / .parquet file, a ``datasets`` folder, or a hub dataset name.
        kind: ``"prompts"``, ``"sft"``, ``"preferences"`` or ``"prm"``.
        split: the split of a ``DatasetDict`` folder or a hub dataset (None: its only split); see
            :func:`rlhfkit.data.read_rows`.
        columns: standard name -> the dataset's column (``data.columns``).
        split_key: the configuration key that chose ``split``, for error messages.
        dataset_config: the configuration name of a hub dataset or repository folder (``data.dataset_config``).
    Returns:
        the validated records, a list of dicts in the normalised shapes of this module's docstring.
    Raises:
        DataError: naming the file, the line (1-based, JSON Lines) or row (0-based), and the field.
    """
    return validate_rows(read_rows(source, split, split_key, dataset_config), kind, columns)
