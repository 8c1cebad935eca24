"""Tokenising validated records into token-id lists, with prompt truncation and EOS handling.

Conventions (one place for all trainers):
- A plain prompt is tokenised with the tokenizer's special tokens (BOS); a response without
  them. A conversational prompt is rendered with the tokenizer's chat template and
  ``add_generation_prompt=True``; a conversational response is the text the template adds for the
  reply (the rendered prompt + reply minus the rendered prompt).
- Prompt and response are tokenised separately and concatenated, as the policy sees them when it
  generates.
- Every SFT completion and preference response ends with EOS: appended to plain text unless
  already last; for a chat reply, the reply is cut right after the template's last EOS (dropping
  trailing template whitespace), or EOS is appended when the template writes none. The EOS stays
  in the loss (huggingface/trl#1623): collators build masks from lengths, never from the pad id.
- ``truncation`` applies to prompts longer than ``max_prompt_length``: ``"error"`` stops with a
  DataError that names the record; ``"left"`` drops tokens from the start (keeps the end of the
  prompt, next to the response; a leading BOS is kept); ``"right"`` drops them from the end.
  Responses longer than the room ``max_length`` leaves are cut at the right (such an example then
  ends without EOS). A plain prompt far over ``max_prompt_length`` is measured on a bounded prefix
  (``PREFIX_CHARS_PER_TOKEN`` characters per allowed token), so one huge line cannot cost minutes and
  gigabytes before it is refused or cut (``"left"`` truncation still tokenises the whole prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from rlhfkit.data.records import Records
from rlhfkit.data.row_errors import FieldError
from rlhfkit.data.tool_calls import demonstration_messages, template_shows_tools

Truncation = Literal["error", "left", "right"]
TRUNCATIONS = ("error", "left", "right")


@dataclass(frozen=True)
class TokenLimits:
    """How records are cut to size (the ``data`` section of the run configuration).

    Attributes:
        max_prompt_length: the longest prompt in tokens (None = no limit).
        max_length: the longest prompt + response in tokens (None = no limit; unused for prompts).
        truncation: ``"error" | "left" | "right"`` for prompts over ``max_prompt_length``.
        step_separator: appended to every step of process-supervision data.
        tools: the JSON schemas (one JSON string each) of ``data.tools``: SFT rows without a ``tools`` column of
            their own are rendered with them (:func:`tokenize_sft`).
    """

    max_prompt_length: int | None = None
    max_length: int | None = None
    truncation: Truncation = "error"
    step_separator: str = "\n"
    tools: tuple[str, ...] = ()

    def __post_init__(self):
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {TRUNCATIONS}, got '{self.truncation}'")


def render_chat(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool,
    field: str = "prompt",
    tools: list | None = None,
) -> str:
    """The chat template's text for ``messages`` (with the tools' schemas ``tools``); a FieldError when the
    tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise FieldError(
            field,
            "conversational data needs a chat template, but the tokenizer has none "
            "(set tokenizer.chat_template, or give plain-text prompts)",
        )
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def encode_prompt(
    tokenizer,
    prompt: str | list[dict],
    max_prompt_length: int | None = None,
    truncation: Truncation = "error",
    rendered: str | None = None,
) -> list[int]:
    """Token ids of a plain or conversational prompt, truncated as the module docstring says (``rendered``: the
    conversational prompt's chat-template text, when the caller has it already)."""
    if isinstance(prompt, list):
        text = (
            rendered if rendered is not None else render_chat(tokenizer, prompt, add_generation_prompt=True)
        )
        ids = _ids(tokenizer, text, special=False)
    else:
        ids = _bounded_ids(tokenizer, prompt, max_prompt_length, truncation)
    if not ids:
        raise FieldError("prompt", "tokenizes to no tokens")
    if max_prompt_length is None or len(ids) <= max_prompt_length:
        return ids
    if truncation == "error":
        cut = not isinstance(prompt, list) and len(prompt) > PREFIX_CHARS_PER_TOKEN * (max_prompt_length + 2)
        count = f"at least {len(ids) - 1}" if cut else str(len(ids))  # counted on a prefix when cut
        raise FieldError(
            "prompt",
            f"is {count} tokens, longer than max_prompt_length={max_prompt_length} "
            "(set data.truncation to left or right to cut it)",
        )
    return cut_ids(tokenizer, ids, max_prompt_length, truncation)


def cut_ids(tokenizer, ids: list[int], max_length: int, truncation: Truncation) -> list[int]:
    """``ids`` cut to ``max_length``: the first ones (``right``) or the last ones (``left``, keeping a leading
    BOS), as prompts are cut."""
    if len(ids) <= max_length:
        return ids
    if truncation == "right":
        return ids[:max_length]
    if truncation != "left":
        raise ValueError(f"truncation must be one of {TRUNCATIONS}, got '{truncation}'")
    bos = tokenizer.bos_token_id
    if bos is not None and ids[0] == bos and max_length > 1:
        return [bos] + ids[len(ids) - max_length + 1 :]
    return ids[len(ids) - max_length :]


# A plain prompt over max_prompt_length is found on a prefix of this many characters per allowed token, so
# that one huge line costs a bounded amount of time and memory (a 50 MB line is refused in milliseconds).
PREFIX_CHARS_PER_TOKEN = 64


def _bounded_ids(tokenizer, text: str, max_tokens: int | None, truncation: Truncation) -> list[int]:
    """The ids of a plain prompt, or of its first ``PREFIX_CHARS_PER_TOKEN * (max_tokens + 2)`` characters
    when they are already over ``max_tokens + 1`` tokens (then the whole prompt is over ``max_tokens``
    whatever the tokenizer merges at the cut, and "error" or "right" truncation need nothing more)."""
    limit = None if max_tokens is None else PREFIX_CHARS_PER_TOKEN * (max_tokens + 2)
    if limit is None or truncation == "left" or len(text) <= limit:
        return _ids(tokenizer, text, special=True)
    ids = _ids(tokenizer, text[:limit], special=True)
    return ids if len(ids) > max_tokens + 1 else _ids(tokenizer, text, special=True)


def encode_response(
    tokenizer,
    prompt: str | list[dict],
    response: str | list[dict],
    field: str,
    rendered: str | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of a response that ends with EOS (see the module docstring; ``rendered`` as in
    :func:`encode_prompt`; ``tools`` as in :func:`render_chat`)."""
    eos = tokenizer.eos_token_id
    if isinstance(prompt, list):
        prompt_text = (
            rendered
            if rendered is not None
            else render_chat(tokenizer, prompt, add_generation_prompt=True, field=field, tools=tools)
        )
        full = render_chat(
            tokenizer, prompt + response, add_generation_prompt=False, field=field, tools=tools
        )
        if not full.startswith(prompt_text):
            raise FieldError(
                field,
                "the chat template does not render the prompt as a prefix of prompt + reply, "
                "so the reply's tokens cannot be told apart",
            )
        ids = _ids(tokenizer, full[len(prompt_text) :], special=False)
        if eos in ids:
            ids = ids[: len(ids) - ids[::-1].index(eos)]
    else:
        ids = _ids(tokenizer, response, special=False)
    if not ids or ids[-1] != eos:
        ids.append(eos)
    if len(ids) == 1:
        raise FieldError(field, "tokenizes to no tokens besides EOS")
    return ids


def _room(prompt_ids: list[int], max_length: int | None) -> int | None:
    """How many response tokens fit after the prompt (None = no limit)."""
    if max_length is None:
        return None
    room = max_length - len(prompt_ids)
    if room < 1:
        raise FieldError(
            "prompt",
            f"is {len(prompt_ids)} tokens, which leaves no room for a response "
            f"within max_length={max_length}",
        )
    return room


def _rendered(record: dict, tokenizer, tools: list[dict] | None = None) -> str | None:
    """A conversational prompt's chat-template text, rendered once for the prompt and every response."""
    prompt = record["prompt"]
    return render_chat(tokenizer, prompt, True, tools=tools) if isinstance(prompt, list) else None


def _prompt_ids(record: dict, tokenizer, limits: TokenLimits, rendered: str | None = None) -> list[int]:
    return encode_prompt(tokenizer, record["prompt"], limits.max_prompt_length, limits.truncation, rendered)


def tokenize_prompt(record: dict, tokenizer, limits: TokenLimits = TokenLimits()) -> dict:
    """``{"prompt_ids": list[int], "record": the validated record}`` (the record goes to reward functions)."""
    return {"prompt_ids": _prompt_ids(record, tokenizer, limits), "record": record}


def tokenize_sft(record: dict, tokenizer, limits: TokenLimits = TokenLimits()) -> dict:
    """``{"prompt_ids", "completion_ids"}`` (+ ``"completion_skip"``); the completion ends with EOS unless cut
    by ``max_length``; ``completion_skip``, only in multi-turn conversations, lists the completion positions
    that are not trained.

    A ``text`` record is trained on whole: its first token (BOS when the tokenizer adds one) is the
    "prompt", as nothing before it could predict it, and the rest, with EOS, the completion.

    A conversation with several assistant messages (a ``messages`` row with tool calls, results and answers,
    or several exchanges) trains every assistant message: the prompt is the messages before the first one,
    the completion everything after, and the tokens the template writes for the other messages (tool
    results, user turns, the next generation prompt) are in ``completion_skip``. Each message's ids are
    those of its own rendered text (the difference of two renders), as a multi-turn rollout's rows are
    (:mod:`rlhfkit.rollout.episodes`). With one assistant message nothing changes.

    A conversation with tools (a ``tools`` column, or ``limits.tools``) is first shaped as a multi-turn
    episode renders it (:func:`rlhfkit.data.tool_calls.demonstration_messages`: the calls of ``tool_calls``
    written in the episodes' call format, the results and the tools' schemas as the template shows them or as
    the default format writes them), and rendered with ``tools=``; a row that calls tools and has none is a
    FieldError.
    """
    if "text" in record and "prompt" not in record:
        ids = _ids(tokenizer, record["text"], special=True)
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)
        if len(ids) < 2:
            raise FieldError("text", "tokenizes to no tokens besides EOS")
        room = None if limits.max_length is None else limits.max_length - 1
        return {"prompt_ids": ids[:1], "completion_ids": ids[1:][:room]}
    record, tools = _with_tools(record, tokenizer, limits)
    record = _first_assistant_split(record)
    rendered = _rendered(record, tokenizer, tools)
    prompt_ids = _prompt_ids(record, tokenizer, limits, rendered)
    room = _room(prompt_ids, limits.max_length)
    if len(record["completion"]) > 1 and isinstance(record["prompt"], list):
        completion, skip = _multi_turn_completion(
            tokenizer, record["prompt"], record["completion"], rendered, tools
        )
    else:
        completion = encode_response(
            tokenizer, record["prompt"], record["completion"], "completion", rendered, tools
        )
        skip = []
    completion = completion[:room]
    out = {"prompt_ids": prompt_ids, "completion_ids": completion}
    skip = [i for i in skip if i < len(completion)]
    return {**out, "completion_skip": skip} if skip else out


def _with_tools(record: dict, tokenizer, limits: TokenLimits) -> tuple[dict, list[dict] | None]:
    """``(record shaped as an episode renders it, its tools' schemas)`` (:func:`tokenize_sft`), or
    ``(record, None)`` for a row without tools."""
    schemas = record.get("tools") or [json.loads(s) for s in limits.tools]
    prompt, completion = record["prompt"], record["completion"]
    if not isinstance(prompt, list):
        if schemas:
            raise FieldError("prompt", "is plain text, but the row has tools; give conversations (messages)")
        return record, None
    calls = next((i for i, m in enumerate([*prompt, *completion]) if m.get("tool_calls")), None)
    if not schemas:
        if calls is not None:
            raise FieldError(
                "tools",
                f"is missing, but message {calls} calls tools: give the tools' JSON schemas in a 'tools' column, "
                "or name the functions in data.tools, so that the prompt lists them as an episode's does",
            )
        return record, None
    messages = demonstration_messages(
        [*prompt, *completion], schemas, template_shows_tools(tokenizer, schemas)
    )
    cut = len(messages) - len(completion)  # the completion's assistant messages stay one for one at the end
    return {**record, "prompt": messages[:cut], "completion": messages[cut:]}, schemas


def _first_assistant_split(record: dict) -> dict:
    """A conversational SFT record whose prompt holds assistant messages, split before the first one that
    follows another role (so every assistant message is in the completion)."""
    prompt = record.get("prompt")
    if not isinstance(prompt, list) or not isinstance(record.get("completion"), list):
        return record
    first = next((i for i, m in enumerate(prompt) if i > 0 and m.get("role") == "assistant"), None)
    if first is None:
        return record
    return {**record, "prompt": prompt[:first], "completion": [*prompt[first:], *record["completion"]]}


def _multi_turn_completion(
    tokenizer, prompt: list[dict], rest: list[dict], rendered: str | None, tools: list[dict] | None = None
) -> tuple[list[int], list[int]]:
    """(ids, untrained positions) of the messages ``rest`` after ``prompt`` (:func:`tokenize_sft`). Each
    assistant message's ids end with EOS (the template's, or one added); the text the template writes after
    that EOS and for the following non-assistant messages, up to the next generation prompt, is untrained."""
    eos, eos_text = tokenizer.eos_token_id, tokenizer.eos_token
    ids: list[int] = []
    skip: list[int] = []
    before = rendered if rendered is not None else render_chat(tokenizer, prompt, True, tools=tools)
    carry, previous = "", before  # untrained text waiting for the next assistant message; the row's text
    for k, message in enumerate(rest):
        messages = [*prompt, *rest[: k + 1]]
        field = f"completion[{k}]"
        if message.get("role") != "assistant":
            continue
        generation = (
            before if k == 0 else render_chat(tokenizer, messages[:-1], True, field=field, tools=tools)
        )
        carry += _extension(generation, previous, field)
        whole = render_chat(tokenizer, messages, False, field=field, tools=tools)
        turn = _extension(whole, generation, field)
        cut = turn.rfind(eos_text) if eos_text else -1
        trained, after = (
            (turn[: cut + len(eos_text)], turn[cut + len(eos_text) :]) if cut >= 0 else (turn, "")
        )
        if carry:
            untrained = _ids(tokenizer, carry, special=False)
            skip += range(len(ids), len(ids) + len(untrained))
            ids += untrained
        turn_ids = _ids(tokenizer, trained, special=False)
        if not turn_ids or turn_ids[-1] != eos:
            turn_ids.append(eos)
        if len(turn_ids) == 1:
            raise FieldError(field, "tokenizes to no tokens besides EOS")
        ids += turn_ids
        carry, previous = after, whole
    return ids, skip


def _extension(later: str, earlier: str, field: str) -> str:
    """``later`` less its prefix ``earlier``; a FieldError when the template does not render prefixes."""
    if not later.startswith(earlier):
        raise FieldError(
            field,
            "the chat template does not render the conversation before a message as a prefix of the "
            "conversation with it, so the assistant messages' tokens cannot be told apart",
        )
    return later[len(earlier) :]


def tokenize_preference(record: dict, tokenizer, limits: TokenLimits = TokenLimits()) -> dict:
    """``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (+ ``"margin"`` when the record has one)."""
    rendered = _rendered(record, tokenizer)
    prompt_ids = _prompt_ids(record, tokenizer, limits, rendered)
    room = _room(prompt_ids, limits.max_length)
    out = {"prompt_ids": prompt_ids}
    for name in ("chosen", "rejected"):
        out[f"{name}_ids"] = encode_response(tokenizer, record["prompt"], record[name], name, rendered)[:room]
    if record.get("margin") is not None:
        out["margin"] = float(record["margin"])
    return out


def tokenize_prm(record: dict, tokenizer, limits: TokenLimits = TokenLimits()) -> dict:
    """``{"prompt_ids", "completion_ids", "step_ends", "labels"}``.

    The completion is the steps, each followed by ``step_separator``; ``step_ends[i]`` is the index
    (within the completion) of step i's last token, where a process reward model reads its score.
    Steps that do not fit within ``max_length`` are dropped with their labels.
    """
    prompt_ids = _prompt_ids(record, tokenizer, limits)
    room = _room(prompt_ids, limits.max_length)
    completion, step_ends = [], []
    for i, step in enumerate(record["steps"]):
        ids = _ids(tokenizer, step + limits.step_separator, special=False)
        if not ids:
            raise FieldError(f"steps[{i}]", "tokenizes to no tokens")
        if room is not None and len(completion) + len(ids) > room:
            break
        completion += ids
        step_ends.append(len(completion) - 1)
    if not step_ends:
        raise FieldError("steps", f"not even the first step fits within max_length={limits.max_length}")
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion,
        "step_ends": step_ends,
        "labels": list(record["labels"][: len(step_ends)]),
    }


TOKENIZERS = {
    "prompts": tokenize_prompt,
    "sft": tokenize_sft,
    "preferences": tokenize_preference,
    "prm": tokenize_prm,
}


def tokenize_records(records: Records, tokenizer, limits: TokenLimits = TokenLimits()) -> list[dict]:
    """Tokenise every validated record (of ``records.kind``); a DataError names the first bad one.

    Args:
        records: from :func:`rlhfkit.data.load_dataset_records`.
        tokenizer: a transformers tokenizer with an EOS token.
        limits: prompt and total length limits, truncation mode, PRM step separator.
    Returns:
        one dict of token-id lists per record, as the ``tokenize_*`` functions describe.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token (load it with rlhfkit.models.load_tokenizer)")
    tokenize = TOKENIZERS[records.kind]
    examples = []
    for index, record in enumerate(records):
        try:
            examples.append(tokenize(record, tokenizer, limits))
        except FieldError as error:
            raise records.error(index, error.message, field=error.field) from None
    return examples
