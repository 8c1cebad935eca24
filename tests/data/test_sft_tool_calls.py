"""SFT rows with tool calls as TRL writes them (assistant ``tool_calls``, ``tool`` messages, a ``tools`` column or
``data.tools``): the calls are trained in the call format the episodes read, the results are not, a template
without tools gets the default format, and a bad row is a DataError naming the file, the line and the field."""

from __future__ import annotations

import json

import pytest

from rlhfkit.data import SFTCollator, TokenLimits, load_dataset_records, prepare_examples
from rlhfkit.data.tool_calls import DEFAULT_SYSTEM, demonstration_messages, format_call, read_schemas
from rlhfkit.errors import DataError
from tests.helpers import tiny_llama
from tests.helpers_tools import TOOL_TEMPLATE, tool_tokenizer

IGNORE = -100
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression."}},
            "required": ["expression"],
        },
    },
}
# TOOL_TEMPLATE without its tools line: a template that does not show tools= (the default format applies)
PLAIN_TEMPLATE = TOOL_TEMPLATE.split("{% endif %}", 1)[1]


def call(name="calculator", arguments=None) -> dict:
    arguments = {"expression": "12*34"} if arguments is None else arguments
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def trl_row(arguments=None, tools=(CALC,), content=None) -> dict:
    row = {
        "messages": [
            {"role": "user", "content": "What is 12*34?"},
            {"role": "assistant", "content": content, "tool_calls": [call(arguments=arguments)]},
            {"role": "tool", "name": "calculator", "content": "408"},
            {"role": "assistant", "content": "answer=408"},
        ]
    }
    return {**row, "tools": list(tools)} if tools is not None else row


def write(tmp_path, rows, name="sft.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def texts(tok, example) -> tuple[str, str, str]:
    """(prompt, trained, untrained) text of an SFT example."""
    batch = SFTCollator(tok.pad_token_id)([example])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    start = len(example["prompt_ids"])
    untrained = [start + j for j in example.get("completion_skip", [])]

    def decode(x):
        return tok.decode(x, skip_special_tokens=False)

    return (
        decode(example["prompt_ids"]),
        decode(ids[labels != IGNORE].tolist()),
        decode(ids[untrained].tolist()),
    )


def test_trl_tool_calls_train_the_call_in_the_episodes_format(tmp_path):
    """The issue's row: an assistant message with tool_calls and empty content, a tool message, a tools column.
    (Before, it stopped with "completion[0] tokenizes to no tokens besides EOS".)"""
    tok = tool_tokenizer()
    (example,) = prepare_examples(write(tmp_path, [trl_row()]), "sft", tok)
    prompt, trained, untrained = texts(tok, example)
    written = format_call("calculator", {"expression": "12*34"})
    assert (
        written == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    )
    assert prompt == "<|system|>tools: calculator\n<|user|>What is 12*34?\n<|assistant|>"  # tools= shown
    assert trained == f"{written}</s>answer=408</s>"
    assert untrained == "\n<|tool|><tool_response>408</tool_response>\n<|assistant|>"


def test_arguments_as_a_json_string_content_and_a_null_content_alike(tmp_path):
    tok = tool_tokenizer()
    as_object, as_string, as_null = prepare_examples(
        write(tmp_path, [trl_row(), trl_row(arguments='{"expression": "12*34"}'), trl_row(content="")]),
        "sft",
        tok,
    )
    assert as_object == as_string == as_null
    (with_text,) = prepare_examples(
        write(tmp_path, [trl_row(content="Let me compute.")], "t.jsonl"), "sft", tok
    )
    _, trained, _ = texts(tok, with_text)
    assert trained.startswith(f"Let me compute.\n{format_call('calculator', {'expression': '12*34'})}</s>")


def test_a_template_without_tools_gets_the_default_format(tmp_path):
    tok = tool_tokenizer(PLAIN_TEMPLATE)
    (example,) = prepare_examples(write(tmp_path, [trl_row()]), "sft", tok)
    prompt, trained, untrained = texts(tok, example)
    system = DEFAULT_SYSTEM.format(tools=json.dumps(CALC))
    assert prompt == f"<|system|>{system}\n<|user|>What is 12*34?\n<|assistant|>"
    assert trained == f"{format_call('calculator', {'expression': '12*34'})}</s>answer=408</s>"
    assert untrained == "\n<|user|><tool_response>\n408\n</tool_response>\n<|assistant|>"


def test_the_rows_own_system_message_follows_the_tools_one(tmp_path):
    tok = tool_tokenizer(PLAIN_TEMPLATE)
    row = trl_row()
    row["messages"].insert(0, {"role": "system", "content": "Be brief."})
    (example,) = prepare_examples(write(tmp_path, [row]), "sft", tok)
    system = DEFAULT_SYSTEM.format(tools=json.dumps(CALC))
    assert texts(tok, example)[0] == f"<|system|>{system}\n\nBe brief.\n<|user|>What is 12*34?\n<|assistant|>"


def test_data_tools_apply_to_rows_without_a_tools_column(tmp_path):
    tok = tool_tokenizer()
    path = write(tmp_path, [trl_row(tools=None), trl_row(tools=[{**CALC, "function": {**CALC["function"]}}])])
    with pytest.raises(DataError, match="line 1, field 'tools': is missing, but message 1 calls tools"):
        prepare_examples(path, "sft", tok)
    given, own = prepare_examples(path, "sft", tok, TokenLimits(tools=(json.dumps(CALC),)))
    assert given == own
    # a plain chat row is rendered with the tools too, as every episode's prompt is
    plain = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "answer=1"}]}
    (example,) = prepare_examples(
        write(tmp_path, [plain], "p.jsonl"), "sft", tok, TokenLimits(tools=(json.dumps(CALC),))
    )
    assert texts(tok, example)[0].startswith("<|system|>tools: calculator\n")


def test_a_tools_column_as_json_text_or_one_schema():
    assert (
        read_schemas(json.dumps([CALC])) == read_schemas(CALC) == read_schemas([CALC["function"]]) == [CALC]
    )


def test_results_in_order_of_the_calls_and_named_after_them():
    """Two calls in one turn: two tool messages (the second naming none) become the template's two results, or
    one default-format message of two blocks."""
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call(), call("add", {"a": 1})]},
        {"role": "tool", "name": "calculator", "content": "408"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "done"},
    ]
    shown = demonstration_messages(messages, [CALC], shows_tools=True)
    assert (
        shown[1]["content"]
        == f"{format_call('calculator', {'expression': '12*34'})}\n{format_call('add', {'a': 1})}"
    )
    assert shown[2:4] == [
        {"role": "tool", "name": "calculator", "content": "408"},
        {"role": "tool", "name": "add", "content": "2"},
    ]
    default = demonstration_messages(messages, [CALC], shows_tools=False)
    assert default[0]["role"] == "system" and default[3] == {
        "role": "user",
        "content": "<tool_response>\n408\n</tool_response>\n<tool_response>\n2\n</tool_response>",
    }
    assert [m["role"] for m in default] == ["system", "user", "assistant", "user", "assistant"]


@pytest.mark.parametrize(
    "edit, field, message",
    [
        (
            lambda m: m[1]["tool_calls"][0]["function"].pop("name"),
            "messages[1].tool_calls[0].function.name",
            "is missing",
        ),
        (
            lambda m: m[1]["tool_calls"][0]["function"].update(arguments="expression=12*34"),
            "messages[1].tool_calls[0].function.arguments",
            "expected a JSON object",
        ),
        (
            lambda m: m[1]["tool_calls"][0]["function"].update(arguments=[1, 2]),
            "messages[1].tool_calls[0].function.arguments",
            "expected a JSON object",
        ),
        (lambda m: m[1].pop("tool_calls"), "messages[2]", "is a tool message with no call before it"),
        (lambda m: m.insert(3, dict(m[2])), "messages[3]", "is a tool message with no call before it"),
        (
            lambda m: m[2].update(name="add"),
            "messages[2].name",
            "is 'add', but the call it answers is 'calculator'",
        ),
        (
            lambda m: m[0].update(tool_calls=[call()]),
            "messages[0].tool_calls",
            "only an assistant message makes calls",
        ),
        (
            lambda m: m[1].update(tool_calls=[]),
            "messages[1].tool_calls",
            "expected a non-empty list of calls",
        ),
    ],
)
def test_a_bad_tool_row_is_a_data_error_naming_file_line_and_field(tmp_path, edit, field, message):
    good = trl_row(content="")
    bad = json.loads(json.dumps(good))
    edit(bad["messages"])
    path = write(tmp_path, [good, bad])
    with pytest.raises(DataError) as caught:
        load_dataset_records(path, "sft")
    assert str(caught.value).startswith(f"{path}, line 2, field '{field}': {message}")


def test_a_bad_tools_column_is_a_data_error(tmp_path):
    path = write(tmp_path, [trl_row(tools=[{"function": {"description": "no name"}}])])
    with pytest.raises(DataError, match=r"line 1, field 'tools\[0\]': expected a JSON schema"):
        load_dataset_records(path, "sft")
    path = write(tmp_path, [{**trl_row(), "tools": "[{not json"}], "j.jsonl")
    with pytest.raises(DataError, match="line 1, field 'tools': is a string that is not JSON"):
        load_dataset_records(path, "sft")


def test_calls_written_in_the_text_still_answer_tool_messages(tmp_path):
    """Rows that write the call into the assistant's text (no tool_calls) keep working; a tool message after a
    turn with no call at all is refused."""
    row = trl_row(tools=None)
    row["messages"][1] = {"role": "assistant", "content": format_call("calculator", {"expression": "12*34"})}
    assert load_dataset_records(write(tmp_path, [row]), "sft")
    row["messages"][1]["content"] = "I will just answer."
    with pytest.raises(DataError, match=r"field 'messages\[2\]': is a tool message with no call before it"):
        load_dataset_records(write(tmp_path, [row], "b.jsonl"), "sft")


def sft_command(tmp_path, data, *extra) -> list[str]:
    """``rlhfkit train sft`` on ``data`` with a tokenizer and a model config but no weights: what is checked here
    stops the run before any model is loaded."""
    folder = tmp_path / "tokenizer"
    if not folder.exists():
        tok = tool_tokenizer()
        tok.save_pretrained(folder)
        tiny_llama(vocab_size=len(tok)).config.save_pretrained(folder)  # a model folder for the pre-flight
    (tmp_path / "sft.yaml").write_text(f"output_dir: {tmp_path / 'run'}\nmodel:\n  name_or_path: {folder}\n")
    return ["train", "sft", "--config", str(tmp_path / "sft.yaml"), f"data.train_file={data}", *extra]


def test_the_command_stops_on_a_bad_row_or_tool_before_training(tmp_path, capsys):
    from rlhfkit import cli

    bad = trl_row()
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "12*34"
    path = write(tmp_path, [trl_row(), bad])
    assert cli.main(sft_command(tmp_path, path)) == 2
    err = capsys.readouterr().err
    assert f"{path}, line 2, field 'messages[1].tool_calls[0].function.arguments'" in err
    assert "Traceback" not in err
    assert not [f for f in (tmp_path / "run").glob("*") if not f.name.startswith(".")]  # (only its lock)

    rows = write(tmp_path, [trl_row(tools=None)], "no_tools.jsonl")
    assert cli.main(sft_command(tmp_path, rows, "data.tools=[rlhfkit.tasks.calculator:no_such]")) == 2
    err = capsys.readouterr().err
    assert "data.tools" in err and "no_such" in err and "Traceback" not in err
    assert cli.main(sft_command(tmp_path, rows)) == 2  # calls, and no tools anywhere
    assert "line 1, field 'tools': is missing, but message 1 calls tools" in capsys.readouterr().err


def test_data_tools_refuse_a_template_the_episodes_refuse(tmp_path, capsys):
    """A template that shows tools in another call format (Mistral's) is refused by SFT with data.tools as by
    an RL run with the same tools, before training."""
    from rlhfkit import cli

    rows = write(tmp_path, [trl_row(tools=None)])
    command = sft_command(tmp_path, rows, "data.tools=[rlhfkit.tasks.calculator:calculator]")
    mistral = TOOL_TEMPLATE.replace("<|system|>tools:", "[AVAILABLE_TOOLS][TOOL_CALLS]")
    (tmp_path / "template.jinja").write_text(mistral)
    assert cli.main([*command, f"data.chat_template={tmp_path / 'template.jinja'}"]) == 2
    err = capsys.readouterr().err
    assert "a format other than <tool_call>" in err and "data.chat_template" in err and "Traceback" not in err


def test_data_tools_is_an_sft_key():
    from rlhfkit.config import load_config
    from rlhfkit.errors import ConfigError

    settings = ["output_dir=o", "model.name_or_path=m", "data.train_file=d", "data.tools=[tools.py:fn]"]
    assert load_config(None, settings, "sft").data.tools == ["tools.py:fn"]
    with pytest.raises(ConfigError, match=r"data.tools \(set in .*\): is read by `train sft` only"):
        load_config(None, [*settings, "online.reward_functions=[r.py:f]"], "grpo")
