"""`rlhfkit generate`: JSON Lines out, greedy is deterministic, bad input is exit 2."""

import json

from rlhfkit.cli import main
from tests.trainers.sft_fixtures import write_sft_problem


def test_generate_writes_one_line_per_prompt_and_greedy_repeats(tmp_path):
    paths = write_sft_problem(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "the cat sat"}\n')
    out1, out2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = [
        "generate",
        "--model",
        str(paths["model"]),
        "--prompts",
        str(prompts),
        "--greedy",
        "--max-new-tokens",
        "5",
    ]
    assert main([*args, "--out", str(out1)]) == 0
    assert main([*args, "--out", str(out2), "--seed", "7"]) == 0
    rows = [json.loads(line) for line in out1.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["hello", "the cat sat"]
    assert all(isinstance(r["response"], str) and isinstance(r["ended"], bool) for r in rows)
    assert out1.read_text() == out2.read_text()  # greedy ignores the seed


def test_generate_bad_prompts_is_a_user_error(tmp_path, capsys):
    paths = write_sft_problem(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"text": "no prompt"}\n')
    assert main(["generate", "--model", str(paths["model"]), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert "prompts.jsonl" in err and "line 2" in err and "prompt" in err


def test_generate_with_a_reward_model_adds_its_normalised_score(tmp_path, capsys):
    import torch

    from rlhfkit.models import load_scalar_model, load_tokenizer, sequence_scores
    from tests.helpers import tiny_llama

    paths = write_sft_problem(tmp_path)
    tokenizer = load_tokenizer(str(paths["model"]))
    rm = tiny_llama("scalar", seed=5, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    rm.config.rlhfkit_reward_gain, rm.config.rlhfkit_reward_bias = 2.0, -0.5
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "the cat sat"}\n')
    out = tmp_path / "scored.jsonl"
    assert (
        main(
            [
                "generate",
                "--model",
                str(paths["model"]),
                "--prompts",
                str(prompts),
                "--greedy",
                "--max-new-tokens",
                "4",
                "--reward-model",
                str(tmp_path / "rm"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    model = load_scalar_model(str(tmp_path / "rm"), tokenizer=tokenizer).eval()
    for row in rows:  # the score of prompt + response, read alone, under the stored normalisation
        ids = (
            tokenizer(row["prompt"])["input_ids"]
            + tokenizer(row["response"], add_special_tokens=False)["input_ids"]
        )
        if row["ended"]:
            ids.append(tokenizer.eos_token_id)
        with torch.no_grad():
            raw = float(sequence_scores(model, torch.tensor([ids]), torch.ones(1, len(ids))))
        assert abs(row["score"] - (2.0 * raw - 0.5)) < 1e-4, row
    assert (
        main(
            [
                "generate",
                "--model",
                str(paths["model"]),
                "--prompts",
                str(prompts),
                "--reward-model",
                str(tmp_path / "nowhere"),
            ]
        )
        == 2
    )
    assert "--reward-model: folder not found" in capsys.readouterr().err
