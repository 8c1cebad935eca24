"""Tokenisation (chat templates, EOS, truncation) and collators (padding sides, masks, labels)."""

import json

import pytest
import torch

from helpers import CHAT_TEMPLATE, tiny_llama, tiny_tokenizer
from rlhfkit.data import (
    IGNORE_INDEX,
    PreferenceCollator,
    PRMCollator,
    PromptCollator,
    SFTCollator,
    TokenLimits,
    load_dataset_records,
    pad_sequences,
    prepare_examples,
    tokenize_records,
)
from rlhfkit.errors import DataError


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(pad="eos", chat_template=True)  # pad == EOS on purpose


def ids(tok, text):
    return tok.convert_tokens_to_ids(text.split())


def write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


def test_plain_sft_prompt_gets_bos_completion_gets_eos(tmp_path, tok):
    rows = [{"prompt": "hello world", "completion": "the cat"}, {"prompt": "a", "completion": "dog </s>"}]
    examples = prepare_examples(write(tmp_path, rows), "sft", tok)
    assert examples[0] == {
        "prompt_ids": ids(tok, "<s> hello world"),
        "completion_ids": ids(tok, "the cat </s>"),
    }
    assert examples[1]["completion_ids"] == ids(tok, "dog </s>")  # no second EOS


def test_chat_template_sft_and_preferences(tmp_path, tok):
    user = [{"role": "user", "content": "hello"}]
    sft = prepare_examples(
        write(tmp_path, [{"messages": user + [{"role": "assistant", "content": "yes"}]}]), "sft", tok
    )
    assert sft[0]["prompt_ids"] == ids(tok, "<s> user : hello assistant :")
    assert sft[0]["completion_ids"] == ids(tok, "yes </s>")  # the template's EOS, not a second one
    prefs = prepare_examples(
        write(tmp_path, [{"prompt": user, "chosen": "good", "rejected": "bad", "margin": 2}]),
        "preferences",
        tok,
    )
    assert prefs[0]["chosen_ids"] == ids(tok, "good </s>") and prefs[0]["rejected_ids"] == ids(
        tok, "bad </s>"
    )
    assert prefs[0]["margin"] == 2.0


@pytest.mark.parametrize(
    "template, expected",
    [
        (CHAT_TEMPLATE.replace("{{ eos_token }}", "{{ eos_token }} ."), "yes </s>"),  # text after EOS dropped
        (CHAT_TEMPLATE.replace(" {{ eos_token }}", ""), "yes </s>"),  # template without EOS: appended
    ],
)
def test_chat_reply_ends_at_eos(tmp_path, template, expected):
    tok = tiny_tokenizer(pad="eos")
    tok.chat_template = template
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "completion": "yes"}]
    assert prepare_examples(write(tmp_path, rows), "sft", tok)[0]["completion_ids"] == ids(tok, expected)


def test_conversational_data_without_chat_template_names_line_and_field(tmp_path):
    rows = [
        {"prompt": "plain is fine", "completion": "yes"},
        {"prompt": [{"role": "user", "content": "hi"}], "completion": "yes"},
    ]
    path = write(tmp_path, rows)
    with pytest.raises(
        DataError, match=f"^{path}, line 2, field 'prompt': conversational data needs a chat template"
    ):
        prepare_examples(path, "sft", tiny_tokenizer())


def test_prompt_truncation_modes(tmp_path, tok):
    path = write(tmp_path, [{"prompt": "hello"}, {"prompt": "one two three four five six"}])
    records = load_dataset_records(path, "prompts")
    with pytest.raises(DataError) as caught:
        tokenize_records(records, tok, TokenLimits(max_prompt_length=4))
    assert str(caught.value).startswith(
        f"{path}, line 2, field 'prompt': is 7 tokens, longer than max_prompt_length=4"
    )
    left = tokenize_records(records, tok, TokenLimits(max_prompt_length=4, truncation="left"))
    right = tokenize_records(records, tok, TokenLimits(max_prompt_length=4, truncation="right"))
    assert left[1]["prompt_ids"] == ids(tok, "<s> four five six")  # BOS kept, the end of the prompt kept
    assert right[1]["prompt_ids"] == ids(tok, "<s> one two three")
    assert left[0]["prompt_ids"] == right[0]["prompt_ids"] == ids(tok, "<s> hello")
    assert left[0]["record"] == {"prompt": "hello"}
    with pytest.raises(ValueError, match="truncation"):
        TokenLimits(truncation="middle")


def test_max_length_cuts_responses_and_refuses_prompts_without_room(tmp_path, tok):
    path = write(tmp_path, [{"prompt": "a", "chosen": "one two three", "rejected": "no"}])
    (ex,) = prepare_examples(path, "preferences", tok, TokenLimits(max_length=4))
    assert ex["chosen_ids"] == ids(tok, "one two") and ex["rejected_ids"] == ids(tok, "no </s>")
    with pytest.raises(
        DataError, match=r"line 1, field 'prompt': is 2 tokens, which leaves no room .*max_length=2"
    ):
        prepare_examples(path, "preferences", tok, TokenLimits(max_length=2))


def test_prm_steps_boundaries_and_truncation(tmp_path, tok):
    path = write(
        tmp_path,
        [{"prompt": "one", "steps": ["two three", "four", "five six seven"], "labels": [True, False, True]}],
    )
    (ex,) = prepare_examples(path, "prm", tok, TokenLimits(step_separator=" ."))
    assert ex["completion_ids"] == ids(tok, "two three . four . five six seven .")
    assert ex["step_ends"] == [2, 4, 8] and ex["labels"] == [True, False, True]
    (cut,) = prepare_examples(path, "prm", tok, TokenLimits(max_length=8, step_separator=" ."))
    assert cut["step_ends"] == [2, 4] and cut["labels"] == [True, False]
    with pytest.raises(DataError, match="line 1, field 'steps': not even the first step fits"):
        prepare_examples(path, "prm", tok, TokenLimits(max_length=4, step_separator=" ."))


# ---------------------------------------------------------------- collators


def test_pad_sequences_sides_and_multiple():
    values, mask = pad_sequences([[5, 6, 7], [8]], 0, "left", pad_to_multiple_of=4)
    assert values.tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]] and mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    values, mask = pad_sequences([[5, 6, 7], [8]], 9, "right")
    assert values.tolist() == [[5, 6, 7], [8, 9, 9]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_sft_collator_keeps_eos_in_labels_when_pad_is_eos():
    eos = 2
    examples = [
        {"prompt_ids": [1, 10, 11], "completion_ids": [12, eos]},
        {"prompt_ids": [1, 13], "completion_ids": [14, 15, 16, eos]},
    ]
    batch = SFTCollator(pad_token_id=eos)(examples)
    assert batch["input_ids"].tolist() == [[1, 10, 11, 12, eos, eos], [1, 13, 14, 15, 16, eos]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    x = IGNORE_INDEX
    assert batch["labels"].tolist() == [[x, x, x, 12, eos, x], [x, x, 14, 15, 16, eos]]


def test_sft_labels_drive_the_transformers_loss_over_completion_tokens_only():
    """The loss the labels define is the mean NLL of the completion tokens, EOS included."""
    model = tiny_llama("causal", pad_token_id=2)
    examples = [
        {"prompt_ids": [1, 10, 11], "completion_ids": [12, 2]},
        {"prompt_ids": [1, 13], "completion_ids": [14, 15, 16, 2]},
    ]
    batch = SFTCollator(pad_token_id=2)(examples)
    with torch.no_grad():
        out = model(**batch)
        manual = []
        for ex in examples:
            seq = torch.tensor([ex["prompt_ids"] + ex["completion_ids"]])
            logp = torch.log_softmax(model(seq).logits[0], -1)
            start = len(ex["prompt_ids"])
            manual += [logp[t - 1, seq[0, t]] for t in range(start, seq.shape[1])]
    assert len(manual) == 6
    torch.testing.assert_close(out.loss, -torch.stack(manual).mean(), atol=1e-5, rtol=0)


def test_prompt_collator_pads_left_and_keeps_records():
    examples = [
        {"prompt_ids": [1, 5, 6], "record": {"prompt": "a b", "answer": 1}},
        {"prompt_ids": [1, 7], "record": {"prompt": "c", "answer": 2}},
    ]
    batch = PromptCollator(pad_token_id=3)(examples)
    assert batch["input_ids"].tolist() == [[1, 5, 6], [3, 1, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]
    assert [r["answer"] for r in batch["records"]] == [1, 2]


def test_preference_collator_pairs_share_one_length():
    examples = [
        {"prompt_ids": [1, 5], "chosen_ids": [6, 2], "rejected_ids": [7, 8, 9, 2], "margin": 1.0},
        {"prompt_ids": [1], "chosen_ids": [6, 2], "rejected_ids": [2]},
    ]
    batch = PreferenceCollator(pad_token_id=2)(examples)
    assert batch["chosen_input_ids"].tolist() == [[1, 5, 6, 2, 2, 2], [1, 6, 2, 2, 2, 2]]
    assert batch["chosen_attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert batch["rejected_input_ids"].tolist() == [[1, 5, 7, 8, 9, 2], [1, 2, 2, 2, 2, 2]]
    assert batch["rejected_attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]
    assert "margin" not in batch  # only one example has a margin
    assert PreferenceCollator(2)(examples[:1])["margin"].tolist() == [1.0]


def test_prm_collator_step_positions_point_at_each_step_end(tmp_path, tok):
    rows = [
        {"prompt": "one", "steps": ["two three", "four"], "labels": [True, False]},
        {"prompt": "hello world", "steps": ["yes"], "labels": [False]},
    ]
    examples = prepare_examples(write(tmp_path, rows), "prm", tok, TokenLimits(step_separator=" ."))
    batch = PRMCollator(pad_token_id=tok.pad_token_id)(examples)
    assert batch["step_positions"].tolist() == [[4, 6], [4, 0]]
    assert batch["step_mask"].tolist() == [[True, True], [True, False]]
    assert batch["step_labels"].tolist() == [[1.0, 0.0], [0.0, 0.0]]
    rows_ids = batch["input_ids"].gather(1, batch["step_positions"])
    dot = tok.convert_tokens_to_ids(".")
    assert (rows_ids[batch["step_mask"]] == dot).all()
    assert batch["input_ids"][0, :5].tolist() == ids(tok, "<s> one two three .")
