"""SFT on multi-turn conversations: every assistant message is trained (tool-call turns included), the tool
results, user turns and generation prompts between them are not, and a conversation with one assistant
message tokenises as it always did."""

from __future__ import annotations

import json

from rlhfkit.data import SFTCollator, prepare_examples
from rlhfkit.data.tokenize import encode_prompt, encode_response
from rlhfkit.tasks.calculator import ToolsTask, call_text, parse_prompt

IGNORE = -100


def write(tmp_path, rows):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_assistant_message_is_trained_and_the_tool_result_is_not(tmp_path):
    task = ToolsTask(seed=0, num_train_prompts=16, num_eval_prompts=1)
    tok = task.build_tokenizer()
    prompt = task.prompts()[0]
    problem = parse_prompt(prompt)
    conversation = [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": call_text(problem)},
        {"role": "tool", "name": "calculator", "content": str(problem.answer)},
        {"role": "assistant", "content": f"answer={problem.answer}"},
    ]
    (example,) = prepare_examples(write(tmp_path, [{"messages": conversation}]), "sft", tok)
    batch = SFTCollator(tok.pad_token_id)([example])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    trained = tok.decode(ids[labels != IGNORE].tolist(), skip_special_tokens=False)
    assert trained == f"{call_text(problem)}{tok.eos_token}answer={problem.answer}{tok.eos_token}"
    start = len(example["prompt_ids"])
    untrained = [start + j for j in example["completion_skip"]]
    gap = tok.decode(ids[untrained].tolist(), skip_special_tokens=False)
    assert gap == f"\n<|tool|>{problem.answer}\n<|assistant|>"
    # the row is the conversation as the template renders it (but the text after the last EOS)
    whole = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(
        ids[batch["attention_mask"][0].bool()].tolist(), skip_special_tokens=False
    ) == whole.rstrip("\n")
    assert tok.decode(example["prompt_ids"], skip_special_tokens=False) == f"<|user|>{prompt}\n<|assistant|>"


def test_one_assistant_message_tokenises_as_before(tmp_path):
    task = ToolsTask(seed=0, num_train_prompts=16, num_eval_prompts=1)
    tok = task.build_tokenizer()
    prompt = task.prompts()[1]
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "answer=12"}]
    (example,) = prepare_examples(write(tmp_path, [{"messages": messages}]), "sft", tok)
    assert "completion_skip" not in example
    assert example["prompt_ids"] == encode_prompt(tok, messages[:1], None, "left")
    assert example["completion_ids"] == encode_response(tok, messages[:1], messages[1:], "completion")
    labels = SFTCollator(tok.pad_token_id)([example])["labels"][0]
    assert (labels != IGNORE).sum() == len(example["completion_ids"])
