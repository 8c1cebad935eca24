"""DPO: the sequence log-probs against a plain loop whatever the padding, the per-batch loss and held-out figures
by hand, the LoRA reference, and `rlhfkit train dpo` end to end (user errors; learning is in test_dpo_task.py)."""

import json
import math
import random
from pathlib import Path

import pytest
import torch

from rlhfkit.cli import main
from rlhfkit.models.head_chunks import head_transform
from rlhfkit.trainers.dpo import (
    DPOCollator,
    dpo_pair_loss,
    heldout_figures,
    pair_logprobs,
    sequence_logprobs,
)
from tests.helpers import pad_batch, tiny_llama, tiny_tokenizer

LN2 = math.log(2.0)


def _example(prompt, chosen, rejected):
    return {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}


EXAMPLES = [
    _example([1, 5, 6], [7, 8, 9, 2], [10, 2]),
    _example([1, 11], [12, 2], [13, 14, 15, 16, 17, 2]),
    _example([1, 18, 19, 20, 21], [22, 23, 2], [24, 2]),
]


def _plain_logprob(model, prompt, response):
    """log pi(response | prompt) by a loop over tokens on an unpadded sequence."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].double()  # (L, V)
    total = 0.0
    for t in range(len(prompt), len(prompt) + len(response)):
        total += float(torch.log_softmax(logits[t - 1], -1)[ids[0, t]])
    return total


def test_collator_marks_the_response_tokens():
    batch = DPOCollator(3)(EXAMPLES)
    assert batch["chosen_input_ids"].shape == batch["rejected_input_ids"].shape  # one length, one forward
    assert batch["chosen_response_mask"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 0]
    assert batch["rejected_response_mask"][1].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert batch["chosen_response_mask"][2].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]


def test_sequence_logprobs_match_a_plain_loop_on_either_padding_side_and_ignore_junk():
    tok = tiny_tokenizer()
    model = tiny_llama(seed=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        expected = {
            side: torch.tensor(
                [_plain_logprob(model, e["prompt_ids"], e[f"{side}_ids"]) for e in EXAMPLES],
                dtype=torch.float64,
            )
            for side in ("chosen", "rejected")
        }
        batch = DPOCollator(tok.pad_token_id)(EXAMPLES)
        head_transform(model)  # the read-out's probe of the head: one forward, once per model
        calls = []
        hook = model.register_forward_hook(lambda *_: calls.append(1))
        chosen, rejected = pair_logprobs(model, batch)
        hook.remove()
        assert len(calls) == 1
        torch.testing.assert_close(chosen.double(), expected["chosen"], atol=1e-4, rtol=0)
        torch.testing.assert_close(rejected.double(), expected["rejected"], atol=1e-4, rtol=0)
        for side in ("chosen", "rejected"):
            rows = [e["prompt_ids"] + e[f"{side}_ids"] for e in EXAMPLES]
            for pad_side in ("left", "right"):
                ids, mask = pad_batch(rows, tok.pad_token_id, pad_side)
                response = torch.zeros_like(mask, dtype=torch.bool)
                for i, e in enumerate(EXAMPLES):
                    end = ids.shape[1] if pad_side == "left" else len(rows[i])
                    response[i, end - len(e[f"{side}_ids"]) : end] = True
                got = sequence_logprobs(model, ids, mask, response)
                torch.testing.assert_close(got.double(), expected[side], atol=1e-4, rtol=0)
                junk = ids.clone()
                junk[mask == 0] = 17  # what sits at padded positions is never read
                torch.testing.assert_close(
                    sequence_logprobs(model, junk, mask, response), got, atol=1e-6, rtol=0
                )


def test_pair_loss_by_hand_and_micro_batches_add_up():
    policy = (torch.tensor([-3.0, -4.0, -2.0]), torch.tensor([-6.0, -3.0, -2.5]))
    reference = (torch.tensor([-5.0, -4.0, -2.0]), torch.tensor([-5.0, -4.0, -2.0]))
    beta = 0.5
    h = [2.0 - (-1.0), 0.0 - 1.0, 0.0 - (-0.5)]  # chosen log-ratio minus rejected log-ratio
    loss, stats = dpo_pair_loss(policy, reference, 3.0, beta=beta)
    assert float(loss) == pytest.approx(sum(math.log1p(math.exp(-beta * x)) for x in h) / 3, abs=1e-6)
    assert stats["accuracy"] == pytest.approx(2 / 3) and stats["margin"] == pytest.approx(beta * sum(h) / 3)
    assert stats["logratio/chosen"] == pytest.approx(2 / 3) and stats["logratio/rejected"] == pytest.approx(
        (-1 + 1 - 0.5) / 3
    )
    assert stats["reward/chosen"] == pytest.approx(beta * 2 / 3)
    ipo, _ = dpo_pair_loss(policy, reference, 3.0, beta=beta, loss_type="ipo")
    assert float(ipo) == pytest.approx(sum((x - 1 / (2 * beta)) ** 2 for x in h) / 3, abs=1e-6)
    # micro-batches of 2 and 1 pairs, each divided by the whole batch's 3, add up to the whole batch
    parts = [
        dpo_pair_loss(tuple(p[s] for p in policy), tuple(r[s] for r in reference), 3.0, beta=beta)
        for s in (slice(0, 2), slice(2, 3))
    ]
    assert sum(float(p[0]) for p in parts) == pytest.approx(float(loss), abs=1e-6)
    assert sum(p[1]["accuracy"] for p in parts) == pytest.approx(stats["accuracy"])


def test_heldout_figures_by_hand():
    policy = torch.tensor([[-3.0, -6.0], [-4.0, -3.0], [-2.0, -2.0], [-1.0, -5.0]], dtype=torch.float64)
    reference = torch.full((4, 2), -4.0, dtype=torch.float64)
    gold = (torch.tensor([1.0, 1.0, 2.0, 0.0]), torch.tensor([0.0, 0.0, 1.0, 0.0]))  # last pair a gold tie
    out = heldout_figures(policy, reference, 0.1, "sigmoid", 0.0, gold)
    h = [3.0, -1.0, 0.0, 4.0]
    assert out["loss"] == pytest.approx(sum(math.log1p(math.exp(-0.1 * x)) for x in h) / 4)
    assert out["accuracy"] == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    assert out["gold_pairs"] == 3 and out["gold_accuracy"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert out["logratio/chosen"] == pytest.approx((1 + 0 + 2 + 3) / 4)


# ----------------------------------------------------------------------------------------------------------
# The command

BODY = "the cat sat on a mat dog ran fast slow one two three".split()


def write_dpo_problem(root: Path, n_train: int = 32, n_eval: int = 16) -> dict[str, Path]:
    """``model/`` (a tiny causal Llama + tokenizer), ``train.jsonl`` and ``eval.jsonl``: "good" beats "bad"."""
    tokenizer = tiny_tokenizer()
    tiny_llama(seed=0, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id).save_pretrained(
        root / "model"
    )
    tokenizer.save_pretrained(root / "model")
    rng = random.Random(0)

    def record():
        body = " ".join(rng.choice(BODY) for _ in range(rng.randint(1, 3)))
        return {"prompt": body, "chosen": f"{body} good .", "rejected": f"{body} bad ."}

    paths = {"model": root / "model"}
    for name, n in (("train", n_train), ("eval", n_eval)):
        paths[name] = root / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(record()) + "\n" for _ in range(n)))
    return paths


def dpo_args(paths, out: Path, *extra: str) -> list[str]:
    config = out.parent / f"{out.name}.yaml"
    config.write_text("seed: 0\nlogging:\n  progress_bar: false\n")
    return [
        "train",
        "dpo",
        "--config",
        str(config),
        f"output_dir={out}",
        f"model.name_or_path={paths['model']}",
        f"data.train_file={paths['train']}",
        f"data.eval_file={paths['eval']}",
        "train.batch_size=8",
        "train.micro_batch_size=4",
        "train.learning_rate=3e-3",
        "train.lr_schedule=constant",
        "train.save_steps=4",
        "train.eval_steps=4",
        "data.max_prompt_length=8",
        "data.max_length=16",
        *extra,
    ]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("lora", [False, True])
def test_train_dpo_starts_at_ln2_learns_the_pairs_and_saves_a_policy(tmp_path, lora):
    paths = write_dpo_problem(tmp_path)
    extra = ["train.max_steps=8", "dpo.beta=0.5"]
    if lora:
        extra += ["model.lora_rank=4", "train.learning_rate=1e-2"]
    assert main(dpo_args(paths, tmp_path / "run", *extra)) == 0
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    start = next(r for r in rows if r["step"] == 0)
    assert start["eval/loss"] == pytest.approx(LN2, abs=1e-6) and start["eval/accuracy"] == 0.5
    first = next(r for r in rows if r["step"] == 1)
    assert first["loss"] == pytest.approx(LN2, abs=1e-6)  # policy == reference before the first update
    assert first["logratio/chosen"] == pytest.approx(0.0, abs=1e-5)
    last = rows[-1]  # the reference stays where it was: the policy's log-ratios move away from 0
    assert last["step"] == 8 and last["margin"] > 0 and last["logratio/chosen"] > last["logratio/rejected"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["kind"] == "dpo" and summary["steps"] == 8
    assert summary["heldout_accuracy"] > 0.9 and summary["heldout_loss"] < LN2 - 0.1
    assert summary["heldout_margin"] > 0
    final = tmp_path / "run" / "final"
    assert (final / "model.safetensors").is_file() and (final / "adapter").is_dir() == lora
    assert (tmp_path / "run" / "report.html").is_file()
    assert {"dpo_logratios.png", "accuracy.png", "losses.png"} <= {
        p.name for p in (tmp_path / "run" / "report").iterdir()
    }


@pytest.mark.parametrize(
    "extra, field",
    [
        (["dpo.loss=ipo", "dpo.label_smoothing=0.1"], "dpo.label_smoothing"),
        (["dpo.beta=0"], "dpo.beta"),
        (["dpo.loss=hinge"], "dpo.loss"),
    ],
)
def test_bad_settings_exit_2_naming_the_key(tmp_path, capsys, extra, field):
    paths = write_dpo_problem(tmp_path, n_train=2, n_eval=2)
    assert main(dpo_args(paths, tmp_path / "run", *extra)) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "which, field, bad",
    [
        ("train", "rejected", {"prompt": "the cat", "chosen": "good ."}),
        ("eval", "chosen", {"prompt": "the cat", "chosen": 3, "rejected": "bad ."}),
    ],
)
def test_bad_pairs_exit_2_naming_file_line_and_field(tmp_path, capsys, which, field, bad):
    paths = write_dpo_problem(tmp_path, n_train=2, n_eval=2)
    with paths[which].open("a") as f:
        f.write(json.dumps(bad) + "\n")
    assert main(dpo_args(paths, tmp_path / "run", "train.max_steps=2")) == 2
    err = capsys.readouterr().err
    assert f"{which}.jsonl" in err and "line 3" in err and field in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_example_configuration_loads():
    from rlhfkit.config import load_config

    cfg = load_config(Path(__file__).parents[2] / "examples" / "configs" / "dpo.yaml", [], "dpo")
    assert cfg.kind == "dpo" and cfg.dpo.loss == "sigmoid" and cfg.dpo.beta == 0.1
