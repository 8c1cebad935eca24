"""The shapes of public datasets, detected per row: implicit prompts (conversations and HH-RLHF text), responses
that repeat the prompt (H4 UltraFeedback), SFT text / prompt-completion / messages; data.columns; splits; and
the tokenisation cache through datasets.map."""

import json

import pytest

from rlhfkit.config import load_config
from rlhfkit.data import (
    TokenLimits,
    load_dataset_records,
    prepare_examples,
    prepare_run_data,
    tokenize_records,
)
from rlhfkit.errors import ConfigError, DataError
from tests.helpers import tiny_tokenizer


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


HH_CHOSEN = "\n\nHuman: the cat ?\n\nAssistant: one two\n\nHuman: good ?\n\nAssistant: yes good"
HH_REJECTED = "\n\nHuman: the cat ?\n\nAssistant: one two\n\nHuman: good ?\n\nAssistant: yes bad"
HH_PROMPT = "\n\nHuman: the cat ?\n\nAssistant: one two\n\nHuman: good ?\n\nAssistant:"

# shape name -> (a row as the public dataset has it, the prompt / chosen / rejected rlhfkit must find)
PREFERENCE_SHAPES = {
    "explicit plain": ({"prompt": "the cat", "chosen": "sat", "rejected": "ran"}, "the cat", "sat", "ran"),
    "implicit conversation (trl-lib/ultrafeedback_binarized)": (
        {
            "chosen": [user("hello"), bot("world")],
            "rejected": [user("hello"), bot("dog")],
            "score_chosen": 8.0,
        },
        [user("hello")],
        [bot("world")],
        [bot("dog")],
    ),
    "implicit multi-turn conversation": (
        {
            "chosen": [user("hi"), bot("yes"), user("cat ?"), bot("good")],
            "rejected": [user("hi"), bot("yes"), user("cat ?"), bot("bad")],
        },
        [user("hi"), bot("yes"), user("cat ?")],
        [bot("good")],
        [bot("bad")],
    ),
    "implicit HH-RLHF text": (
        {"chosen": HH_CHOSEN, "rejected": HH_REJECTED},
        HH_PROMPT,
        " yes good",
        " yes bad",
    ),
    "prompt string, responses repeat it (HuggingFaceH4/ultrafeedback_binarized)": (
        {
            "prompt": "the cat ?",
            "prompt_id": "x1",
            "chosen": [user("the cat ?"), bot("sat")],
            "rejected": [user("the cat ?"), bot("ran")],
        },
        [user("the cat ?")],
        [bot("sat")],
        [bot("ran")],
    ),
    "prompt string, assistant messages": (
        {"prompt": "the cat ?", "chosen": [bot("sat")], "rejected": [bot("ran")]},
        [user("the cat ?")],
        [bot("sat")],
        [bot("ran")],
    ),
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("shape", list(PREFERENCE_SHAPES))
def test_preference_shapes_give_the_hand_written_prompt_and_responses(tmp_path, shape):
    row, prompt, chosen, rejected = PREFERENCE_SHAPES[shape]
    (record,) = load_dataset_records(write_jsonl(tmp_path / "p.jsonl", [row]), "preferences")
    assert (record["prompt"], record["chosen"], record["rejected"]) == (prompt, chosen, rejected)
    extra = set(row) - {"prompt", "chosen", "rejected"}
    assert all(record[k] == row[k] for k in extra)  # other columns are kept
    # As prompts for an online run, the same rows give the same prompt.
    (as_prompt,) = load_dataset_records(write_jsonl(tmp_path / "q.jsonl", [row]), "prompts")
    assert as_prompt["prompt"] == (row["prompt"] if "prompt" in row else prompt)


def test_hh_prompt_ends_at_the_last_shared_assistant_marker_not_at_the_longest_common_prefix(tmp_path):
    row = {
        "chosen": "\n\nHuman: hi\n\nAssistant: I think yes",
        "rejected": "\n\nHuman: hi\n\nAssistant: I think no",
    }
    (record,) = load_dataset_records(write_jsonl(tmp_path / "p.jsonl", [row]), "preferences")
    assert record["prompt"] == "\n\nHuman: hi\n\nAssistant:"
    assert (record["chosen"], record["rejected"]) == (" I think yes", " I think no")


SFT_SHAPES = {
    "text": ({"text": "the cat sat"}, None, None),
    "prompt + completion": ({"prompt": "the cat", "completion": "sat"}, "the cat", "sat"),
    "messages": ({"messages": [user("hi"), bot("yes")]}, [user("hi")], [bot("yes")]),
    "prompt string, completion repeats it": (
        {"prompt": "hi", "completion": [user("hi"), bot("yes")]},
        [user("hi")],
        [bot("yes")],
    ),
}


@pytest.mark.parametrize("shape", list(SFT_SHAPES))
def test_sft_shapes(tmp_path, shape):
    row, prompt, completion = SFT_SHAPES[shape]
    tok = tiny_tokenizer(chat_template=True)
    examples = prepare_examples(write_jsonl(tmp_path / "s.jsonl", [row]), "sft", tok)
    (record,) = examples.records
    if prompt is None:  # text: trained on whole, BOS is the only "prompt" token
        assert record["text"] == "the cat sat"
        ids = tok("the cat sat")["input_ids"]
        assert examples[0] == {"prompt_ids": ids[:1], "completion_ids": ids[1:] + [tok.eos_token_id]}
    else:
        assert (record["prompt"], record["completion"]) == (prompt, completion)
        assert examples[0]["completion_ids"][-1] == tok.eos_token_id


def test_prompts_from_sft_messages_drop_the_final_reply(tmp_path):
    rows = [{"messages": [user("hi"), bot("yes"), user("cat ?"), bot("good")], "answer": "4"}]
    (record,) = load_dataset_records(write_jsonl(tmp_path / "m.jsonl", rows), "prompts")
    assert record["prompt"] == [user("hi"), bot("yes"), user("cat ?")] and record["answer"] == "4"


def write_dataset_dict(root):
    """A DatasetDict folder with the UltraFeedback split names and its own column names."""
    import datasets

    def rows(words):
        return [
            {
                "question": f"the {w} ?",
                "good": [user(f"the {w} ?"), bot("yes")],
                "poor": [user(f"the {w} ?"), bot("no")],
            }
            for w in words
        ]

    datasets.DatasetDict(
        {
            "train_prefs": datasets.Dataset.from_list(rows(["cat", "dog", "mat"])),
            "test_prefs": datasets.Dataset.from_list(rows(["one", "two"])),
        }
    ).save_to_disk(str(root))
    return str(root)


def data_config(*overrides):
    return load_config(None, ["output_dir=o", "model.name_or_path=m", *overrides], "reward").data


def test_columns_and_splits_on_a_dataset_dict_folder(tmp_path):
    folder = write_dataset_dict(tmp_path / "dd")
    tok = tiny_tokenizer(chat_template=True)
    cfg = data_config(
        f"data.train_file={folder}",
        "data.train_split=train_prefs",
        "data.eval_split=test_prefs",
        "data.columns={prompt: question, chosen: good, rejected: poor}",
    )
    train, held = prepare_run_data(cfg, "preferences", tok, TokenLimits())
    assert [r["prompt"] for r in train.records] == [[user(f"the {w} ?")] for w in ("cat", "dog", "mat")]
    assert [r["prompt"] for r in held.records] == [[user("the one ?")], [user("the two ?")]]
    assert held.records[0]["chosen"] == [bot("yes")] and "question" not in held.records[0]

    # An eval_file that is a DatasetDict with several splits and no eval_split: an error naming them,
    # never a silent 'train'.
    cfg = data_config(
        f"data.train_file={folder}",
        "data.train_split=train_prefs",
        f"data.eval_file={folder}",
        "data.columns={prompt: question, chosen: good, rejected: poor}",
    )
    with pytest.raises(DataError, match="has splits train_prefs, test_prefs: set data.eval_split"):
        prepare_run_data(cfg, "preferences", tok, TokenLimits())
    with pytest.raises(
        DataError, match="no split 'train' \\(splits: train_prefs, test_prefs\\); set data.train_split"
    ):
        prepare_run_data(data_config(f"data.train_file={folder}"), "preferences", tok, TokenLimits())
    import datasets

    both = str(tmp_path / "train_test")
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]),
            "test": datasets.Dataset.from_list([{"prompt": "d", "chosen": "e", "rejected": "f"}]),
        }
    ).save_to_disk(both)
    with pytest.raises(
        DataError, match="has splits train, test: set data.eval_split"
    ):  # not a silent 'train'
        prepare_run_data(
            data_config(f"data.train_file={both}", f"data.eval_file={both}"),
            "preferences",
            tok,
            TokenLimits(),
        )
    _, held = prepare_run_data(
        data_config(f"data.train_file={both}", f"data.eval_file={both}", "data.eval_split=test"),
        "preferences",
        tok,
        TokenLimits(),
    )
    assert [r["prompt"] for r in held.records] == ["d"]


# (what is wrong, the settings or rows, the message's words)
BAD = [
    (
        "column not there",
        ["data.columns={prompt: query}"],
        "data.columns maps 'prompt' to 'query', which is not a column",
    ),
    ("mapping hides a column", ["data.columns={prompt: chosen_text}"], "also has a 'prompt' column"),
    (
        "split of a single file",
        ["data.train_split=train_prefs"],
        "is one table with no splits, so data.train_split",
    ),
    (
        "eval split of a single file",
        ["data.eval_split=test"],
        "is one table with no splits, so data.eval_split",
    ),
]


@pytest.mark.parametrize("what, overrides, words", BAD, ids=[b[0] for b in BAD])
def test_bad_columns_and_splits(tmp_path, what, overrides, words):
    train = write_jsonl(
        tmp_path / "t.jsonl", [{"prompt": "a", "chosen_text": "b", "chosen": "c", "rejected": "d"}]
    )
    with pytest.raises(DataError, match=words):
        prepare_run_data(
            data_config(f"data.train_file={train}", *overrides),
            "preferences",
            tiny_tokenizer(),
            TokenLimits(),
        )


@pytest.mark.parametrize(
    "columns, words",
    [
        ("{promt: question}", "'promt' is not a standard column name \\(did you mean 'prompt'\\?\\)"),
        ("{prompt: a, chosen: a}", "column\\(s\\) a mapped to more than one standard name"),
    ],
)
def test_bad_column_mappings_are_config_errors(columns, words):
    with pytest.raises(ConfigError, match=words):
        data_config("data.train_file=x.jsonl", f"data.columns={columns}")


BAD_ROWS = [
    (
        {"chosen": [user("a"), bot("b")], "rejected": [user("z"), bot("c")]},
        "chosen",
        "chosen and rejected share no first turns",
    ),
    (
        {"chosen": "Human: a Assistant: b", "rejected": "Human: a Assistant: c"},
        "chosen",
        "no line starting with 'Assistant:'",
    ),
    (
        {"chosen": [user("a"), bot("b")], "rejected": "b"},
        "rejected",
        "expected a list of messages like chosen",
    ),
    (
        {"chosen": [user("a"), bot("b"), user("c")], "rejected": [user("a"), bot("x")]},
        "chosen[2].role",
        "is 'user' after the 1 turn(s) that make the prompt",
    ),
    (
        {"prompt": "a", "chosen": [user("b"), bot("c")], "rejected": [user("b"), bot("d")]},
        "chosen",
        "starts with turns that are not the prompt column's",
    ),
    (
        {"chosen": [user("a"), bot("b")], "rejected": [user("a"), bot("b")]},
        "rejected",
        "is the same as chosen",
    ),  # identical conversations: a prompt and two equal replies, which teach nothing
    (
        {"question": "a", "chosen": "b", "rejected": "c"},
        "chosen",
        "name yours with data.columns (the row's columns: question, chosen, rejected)",
    ),
    (
        {"question": "a", "chosen": "b"},
        "prompt",
        "is missing (the row's columns: question, chosen; name yours with data.columns",
    ),
]


@pytest.mark.parametrize("row, field, words", BAD_ROWS)
def test_bad_implicit_rows_name_the_field(tmp_path, row, field, words):
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(DataError) as caught:
        load_dataset_records(path, "preferences")
    assert f"line 1, field '{field}'" in str(caught.value) and words in str(caught.value), str(caught.value)


def test_tokenisation_is_cached_and_read_back_equal(tmp_path, monkeypatch):
    import rlhfkit.data.prepare as prepare

    rows = [
        {"chosen": [user(f"the {w}"), bot("good")], "rejected": [user(f"the {w}"), bot("bad")], "margin": m}
        for w, m in (("cat", 1.0), ("dog", None), ("mat", 0.5))
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    tok, limits = tiny_tokenizer(chat_template=True), TokenLimits(max_prompt_length=16, max_length=24)
    first = prepare_examples(path, "preferences", tok, limits)
    assert not first.from_cache
    assert list(first) == tokenize_records(first.records, tok, limits)  # the same tokens as without datasets

    def tokenizing_again(*args, **kwargs):
        raise AssertionError("tokenised again instead of reading the cache")

    monkeypatch.setitem(prepare.TOKENIZERS, "preferences", tokenizing_again)
    second = prepare_examples(path, "preferences", tok, limits)
    assert second.from_cache and second.cache_file == first.cache_file and list(second) == list(first)
    # Anything the tokens depend on makes a new key: the limits, the template, the data.
    tok.chat_template = tok.chat_template.replace("assistant :", "assistant ::")
    for changed in (dict(limits=TokenLimits(max_prompt_length=8, max_length=24)), dict(tokenizer=tok)):
        args = {"tokenizer": tiny_tokenizer(chat_template=True), "limits": limits, **changed}
        with pytest.raises(AssertionError, match="tokenised again"):
            prepare_examples(path, "preferences", args["tokenizer"], args["limits"])


def test_workers_tokenise_the_same_and_errors_come_back_from_the_cache(tmp_path):
    rows = [{"prompt": f"the {w} sat on a mat", "completion": "yes"} for w in ("cat", "dog")] * 3
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    tok = tiny_tokenizer()
    alone = prepare_examples(path, "sft", tok, TokenLimits(8, 16))
    other = write_jsonl(tmp_path / "s2.jsonl", rows + [{"prompt": "one"}])  # another file: its own cache
    with pytest.raises(DataError):
        prepare_examples(other, "sft", tok, TokenLimits(8, 16))
    both = prepare_examples(
        write_jsonl(tmp_path / "w.jsonl", rows), "sft", tok, TokenLimits(8, 16), num_proc=2
    )
    assert list(both) == list(alone)
    too_long = write_jsonl(
        tmp_path / "long.jsonl",
        rows[:2] + [{"prompt": "one two three four five six seven eight nine", "completion": "ten"}],
    )
    for _ in range(2):  # the second time from the cache: the same error, naming the row
        with pytest.raises(DataError, match="long.jsonl, line 3, field 'prompt': is 10 tokens, longer than"):
            prepare_examples(too_long, "sft", tok, TokenLimits(8, 16))
