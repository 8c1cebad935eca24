"""Reading and validating datasets: every format, and every bad input with file, line/row and field."""

import json

import pytest

from rlhfkit.data import load_dataset_records, read_rows
from rlhfkit.errors import DataError, UserError

GOOD = {
    "prompts": [{"prompt": "hello world"}, {"prompt": [{"role": "user", "content": "hello"}], "answer": "3"}],
    "sft": [
        {"prompt": "hello", "completion": "world"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]},
        {"prompt": [{"role": "user", "content": "hi"}], "completion": "no"},
    ],
    "preferences": [
        {"prompt": "the cat", "chosen": "sat", "rejected": "ran", "margin": 1.5},
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": "bad",
        },
    ],
    "prm": [{"prompt": "one two", "steps": ["three", "four"], "labels": [True, False]}],
}


def write_jsonl(path, rows):
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return str(path)


def test_every_kind_from_jsonl_with_normalised_shapes(tmp_path):
    records = {
        kind: load_dataset_records(write_jsonl(tmp_path / f"{kind}.jsonl", rows), kind)
        for kind, rows in GOOD.items()
    }
    assert records["prompts"][1]["answer"] == "3"  # extra fields are kept
    sft = records["sft"]
    assert sft[0] == {"prompt": "hello", "completion": "world"}
    assert sft[1]["prompt"] == [{"role": "user", "content": "hi"}]
    assert sft[1]["completion"] == [{"role": "assistant", "content": "yes"}] and "messages" not in sft[1]
    assert sft[2]["completion"] == [{"role": "assistant", "content": "no"}]
    prefs = records["preferences"]
    assert prefs[0]["margin"] == 1.5 and prefs[1]["rejected"] == [{"role": "assistant", "content": "bad"}]
    assert records["prm"][0]["labels"] == [True, False]
    assert sft.where.locations == [1, 2, 3] and sft.source.endswith("sft.jsonl")


def test_json_parquet_and_datasets_folders_give_the_same_records(tmp_path):
    import datasets
    import pyarrow
    import pyarrow.parquet

    rows = GOOD["preferences"][:1] + [{"prompt": "a dog", "chosen": "ran", "rejected": "sat", "margin": 0.5}]
    expected = load_dataset_records(write_jsonl(tmp_path / "p.jsonl", rows), "preferences")
    (tmp_path / "p.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in rows))  # JSON Lines in a .json file
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "p.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows)}
    ).save_to_disk(str(tmp_path / "dd"))
    for name in ("p.json", "lines.json", "p.parquet", "ds"):
        assert load_dataset_records(str(tmp_path / name), "preferences") == expected, name
    assert load_dataset_records(str(tmp_path / "dd"), "preferences", split="test") == expected
    assert len(load_dataset_records(str(tmp_path / "dd"), "preferences")) == 1
    with pytest.raises(DataError, match="no split 'valid' \\(splits: train, test\\)"):
        load_dataset_records(str(tmp_path / "dd"), "preferences", split="valid")


def test_hub_name_goes_to_datasets_load_dataset_and_its_splits(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name):
        calls.append(name)
        return datasets.DatasetDict(
            {
                "train_prefs": datasets.Dataset.from_list([{"prompt": "a"}]),
                "test_prefs": datasets.Dataset.from_list([{"prompt": "hello"}]),
            }
        )

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_dataset_records("someone/prompts", "prompts", split="test_prefs") == [{"prompt": "hello"}]
    assert calls == ["someone/prompts"]
    with pytest.raises(
        DataError, match="no split 'train' \\(splits: train_prefs, test_prefs\\); set data.train_split"
    ):
        load_dataset_records("someone/prompts", "prompts")
    with pytest.raises(DataError, match="has splits train_prefs, test_prefs: set data.eval_split"):
        load_dataset_records("someone/prompts", "prompts", split=None, split_key="data.eval_split")

    def offline(name):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="someone/prompts: not a local file or folder.*offline"):
        load_dataset_records("someone/prompts", "prompts")


# (kind, rows written as JSON Lines, the line that is wrong, the field, words of the message)
BAD_JSONL = [
    ("sft", [GOOD["sft"][0], "", "{not json"], 3, None, "not valid JSON"),
    ("sft", [GOOD["sft"][0], "[1, 2]"], 2, None, "expected a JSON object, got list"),
    ("sft", [GOOD["sft"][0], {"completion": "world"}], 2, "prompt", "is missing"),
    (
        "sft",
        [{"prompt": 5, "completion": "x"}],
        1,
        "prompt",
        "expected a string or a list of messages, got int",
    ),
    ("sft", [{"prompt": "   ", "completion": "x"}], 1, "prompt", "is empty"),
    ("sft", [{"prompt": "hi", "completion": ""}], 1, "completion", "is empty"),
    ("sft", [{"prompt": "hi", "completion": None}], 1, "completion", "is null"),
    (
        "sft",
        [
            {
                "prompt": "hi",
                "completion": [{"role": "user", "content": "not hi"}, {"role": "assistant", "content": "x"}],
            }
        ],
        1,
        "completion",
        "starts with turns that are not the prompt column's",
    ),
    ("sft", [{"prompt": "hi", "completion": "x", "text": "y"}], 1, "text", "give one of 'messages'"),
    ("sft", [{"text": 3}], 1, "text", "expected a string, got int"),
    (
        "sft",
        [{"body": "hello"}],
        1,
        "prompt",
        "is missing (the row's columns: body; name yours with data.columns",
    ),
    (
        "sft",
        [{"messages": [{"role": "user", "content": "hi"}]}],
        1,
        "messages[0].role",
        "must be the assistant",
    ),
    ("sft", [{"messages": [{"role": "assistant", "content": "hi"}]}], 1, "messages", "at least one message"),
    (
        "sft",
        [{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}],
        1,
        "messages[0].content",
        "expected a string, got null",
    ),
    ("sft", [{"messages": "hi"}], 1, "messages", "expected a list of messages, got str"),
    # another library's message shape: the key is named, and the fix
    (
        "sft",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "text": "x"}]}],
        1,
        "messages[1].text",
        "a message's text goes under 'content', not 'text'",
    ),
    ("prompts", [{"prompt": [{"role": "user", "text": "hi"}]}], 1, "prompt[0].text", "not 'text'"),
    # a misspelt role is named, in every place a message can be (a prompt, a reply, a conversation)
    (
        "sft",
        [
            GOOD["sft"][0],
            {"messages": [{"role": "usr", "content": "hi"}, {"role": "assistant", "content": "x"}]},
        ],
        2,
        "messages[0].role",
        "unknown role 'usr': expected one of 'system', 'user', 'assistant', 'tool'",
    ),
    (
        "prompts",
        [{"prompt": [{"role": "User", "content": "hi"}]}],
        1,
        "prompt[0].role",
        "unknown role 'User'",
    ),
    (
        "preferences",
        [
            {
                "prompt": [{"role": "user", "content": "a"}],
                "chosen": [{"role": "assistant", "content": "b"}],
                "rejected": [{"role": "assistent", "content": "c"}],
            }
        ],
        1,
        "rejected[0].role",
        "unknown role 'assistent'",
    ),
    (
        "sft",
        [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]}],
        1,
        "messages[1].content",
        "is empty",
    ),
    ("prompts", [{"prompt": []}], 1, "prompt", "empty list of messages"),
    ("prompts", [{"prompt": ["hi"]}], 1, "prompt[0]", "expected a message object"),
    ("preferences", [{"prompt": "a", "chosen": "b"}], 1, "rejected", "is missing"),
    (
        "preferences",
        [{"prompt": "a", "chosen": 1, "rejected": "c"}],
        1,
        "chosen",
        "expected a string or a list of messages, got int",
    ),
    (
        "preferences",
        [{"prompt": "a", "chosen": "b", "rejected": "c", "margin": "big"}],
        1,
        "margin",
        "expected a number",
    ),
    (
        "preferences",
        [
            {
                "prompt": [{"role": "user", "content": "a"}],
                "chosen": [{"role": "user", "content": "b"}],
                "rejected": "c",
            }
        ],
        1,
        "rejected",
        "expected a list of messages like chosen (conversations that repeat the prompt), got str",
    ),
    ("prm", [{"prompt": "a", "steps": ["b", "c"], "labels": [True]}], 1, "labels", "1 labels for 2 steps"),
    (
        "prm",
        [{"prompt": "a", "steps": ["b", "c"], "labels": [True, 1]}],
        1,
        "labels[1]",
        "expected true or false",
    ),
    ("prm", [{"prompt": "a", "steps": ["", "c"], "labels": [True, True]}], 1, "steps[0]", "is empty"),
    ("prm", [{"prompt": "a", "steps": [], "labels": []}], 1, "steps", "is an empty list"),
    ("prm", [{"prompt": "a", "steps": "b", "labels": [True]}], 1, "steps", "expected a list of strings"),
]


@pytest.mark.parametrize("kind, rows, line, field, words", BAD_JSONL)
def test_bad_jsonl_rows_name_file_line_and_field(tmp_path, kind, rows, line, field, words):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as caught:
        load_dataset_records(path, kind)
    message = str(caught.value)
    assert message.startswith(f"{path}, line {line}"), message
    assert (f"field '{field}'" in message) if field else ("field" not in message), message
    assert words in message, message
    assert isinstance(caught.value, UserError)


def test_bad_files(tmp_path):
    def error_of(source, kind="prompts"):
        with pytest.raises(DataError) as caught:
            load_dataset_records(str(source), kind)
        return str(caught.value)

    assert error_of(tmp_path / "missing.jsonl") == f"{tmp_path / 'missing.jsonl'}: file not found"
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert error_of(tmp_path / "empty.jsonl").endswith("empty.jsonl: the dataset has no records")
    (tmp_path / "empty.json").write_text("[]")
    assert "has no records" in error_of(tmp_path / "empty.json")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert "not UTF-8" in error_of(tmp_path / "latin1.jsonl")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    assert "broken.parquet: cannot read the Parquet file" in error_of(tmp_path / "broken.parquet")
    (tmp_path / "data.csv").write_text("prompt\nhello\n")
    assert "unsupported file type" in error_of(tmp_path / "data.csv")
    (tmp_path / "folder").mkdir()
    assert "not a datasets folder" in error_of(tmp_path / "folder")
    (tmp_path / "object.json").write_text(json.dumps({"data": [{"prompt": "a"}]}, indent=2))
    assert "must hold a list of objects" in error_of(tmp_path / "object.json")
    (tmp_path / "list.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": ""}], indent=2))
    assert error_of(tmp_path / "list.json").endswith("list.json, row 1, field 'prompt': is empty")
    (tmp_path / "cut.json").write_text('[{"prompt": "a"},\n {"prompt": ')
    assert "cut.json, line 2: not valid JSON" in error_of(tmp_path / "cut.json")


def test_parquet_null_is_named_with_its_row(tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": None}]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet, row 1, field 'completion': is null"):
        load_dataset_records(str(tmp_path / "t.parquet"), "sft")


def test_raw_rows_keep_line_numbers_across_blank_lines(tmp_path):
    raw = read_rows(write_jsonl(tmp_path / "x.jsonl", [{"a": 1}, "", "  ", {"b": 2}]))
    assert raw.rows == [{"a": 1}, {"b": 2}] and raw.locations == [1, 4] and raw.row_kind == "line"


def test_unknown_kind_is_a_programming_error(tmp_path):
    with pytest.raises(ValueError, match="unknown data kind"):
        load_dataset_records(write_jsonl(tmp_path / "x.jsonl", [{"prompt": "a"}]), "dpo")
