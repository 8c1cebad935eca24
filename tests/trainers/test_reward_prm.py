"""Process reward model: the step loss by hand, the columns it reads, and `rlhfkit train prm` end to end."""

import json
import math
import random

import pytest
import torch

from rlhfkit.cli import main
from rlhfkit.data import PRMCollator
from rlhfkit.trainers.prm import prm_metrics, step_logits, step_loss
from tests.helpers import tiny_llama, tiny_tokenizer
from tests.trainers.test_reward import BODY_WORDS


def test_step_loss_by_hand_and_micro_batches_add_up():
    logits = torch.tensor([[2.0, -1.0, 9.0], [0.5, 0.0, 0.0]])
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])  # 3 real steps; junk is ignored
    loss, stats = step_loss(logits, labels, mask, normalizer=3.0)

    def bce(x, y):
        return -(y * math.log(1 / (1 + math.exp(-x))) + (1 - y) * math.log(1 - 1 / (1 + math.exp(-x))))

    assert float(loss) == pytest.approx((bce(2.0, 1) + bce(-1.0, 0) + bce(0.5, 0)) / 3, abs=1e-6)
    assert stats["accuracy"] == pytest.approx(2 / 3)
    first, _ = step_loss(logits[:1], labels[:1], mask[:1], normalizer=3.0)
    second, _ = step_loss(logits[1:], labels[1:], mask[1:], normalizer=3.0)
    assert float(first + second) == pytest.approx(float(loss), abs=1e-6)


def test_step_logits_are_read_at_each_steps_last_token():
    tok = tiny_tokenizer()
    model = tiny_llama("scalar", seed=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    examples = [
        {
            "prompt_ids": [1, 5],
            "completion_ids": [6, 7, 8, 9, 10],
            "step_ends": [1, 4],
            "labels": [True, False],
        },
        {"prompt_ids": [1, 11, 12], "completion_ids": [13, 14], "step_ends": [1], "labels": [True]},
    ]
    batch = PRMCollator(tok.pad_token_id)(examples)
    from rlhfkit.models import token_scores

    with torch.no_grad():
        got = step_logits(model, batch)
        every = token_scores(model, batch["input_ids"], batch["attention_mask"])
    assert got[0].tolist() == pytest.approx([every[0, 3].item(), every[0, 6].item()])
    assert got[1, 0].item() == pytest.approx(every[1, 4].item())


def test_prm_metrics_by_hand():
    logits = [torch.tensor([1.0, 2.0]), torch.tensor([1.0, -1.0]), torch.tensor([-3.0])]
    labels = [torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0])]
    m = prm_metrics(logits, labels)
    assert m["accuracy"] == pytest.approx(4 / 5)
    assert m["solution_accuracy"] == pytest.approx(3 / 3 - 1 / 3)  # the second solution is judged wrong
    assert m["correct_step_rate"] == pytest.approx(4 / 5)


@pytest.mark.slow
@pytest.mark.learning
def test_train_prm_learns_which_steps_are_wrong(tmp_path, learning_seed, learning_figures):
    tokenizer = tiny_tokenizer()
    model = tiny_llama(seed=learning_seed, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    rng = random.Random(learning_seed)

    def record():
        steps, labels = [], []
        for _ in range(rng.randint(1, 3)):
            wrong = rng.random() < 0.5
            steps.append(" ".join(rng.choices(BODY_WORDS, k=2)) + (" bad" if wrong else " good"))
            labels.append(not wrong)
        return {"prompt": " ".join(rng.choices(BODY_WORDS, k=2)), "steps": steps, "labels": labels}

    for name, n in (("train", 64), ("eval", 32)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(record()) + "\n" for _ in range(n)))
    config = tmp_path / "prm.yaml"
    config.write_text(f"seed: {learning_seed}\nlogging:\n  progress_bar: false\n")
    out = tmp_path / "run"
    args = [
        "train",
        "prm",
        "--config",
        str(config),
        f"output_dir={out}",
        f"model.name_or_path={tmp_path / 'model'}",
        f"data.train_file={tmp_path / 'train.jsonl'}",
        f"data.eval_file={tmp_path / 'eval.jsonl'}",
        "train.batch_size=16",
        "train.learning_rate=3e-3",
        "train.lr_schedule=constant",
        "train.max_steps=12",
        "train.eval_steps=6",
        "train.save_steps=6",
        "data.max_prompt_length=8",
        "data.max_length=32",
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 6, 12]
    summary = json.loads((out / "summary.json").read_text())
    learning_figures(start_accuracy=evals[0]["eval/accuracy"], heldout_accuracy=summary["heldout_accuracy"])
    assert summary["kind"] == "prm" and summary["heldout_accuracy"] >= 0.9 > evals[0]["eval/accuracy"]
    assert summary["train_solutions"] == 64 and summary["eval_solutions"] == 32
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(out / "final").config.num_labels == 1
