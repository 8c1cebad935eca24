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


def raw_score(model, tokenizer, row) -> float:
    """The reward model's raw score of one output row's prompt + response (+ EOS when it ended), read alone."""
    import torch

    from rlhfkit.models import sequence_scores

    ids = (
        tokenizer(row["prompt"])["input_ids"]
        + tokenizer(row["response"], add_special_tokens=False)["input_ids"]
    )
    if row["ended"]:
        ids.append(tokenizer.eos_token_id)
    with torch.no_grad():
        return float(sequence_scores(model, torch.tensor([ids]), torch.ones(1, len(ids))))


def test_generate_with_a_reward_model_adds_its_normalised_score(tmp_path, capsys):
    from rlhfkit.models import load_scalar_model, load_tokenizer
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
        assert abs(row["score"] - (2.0 * raw_score(model, tokenizer, row) - 0.5)) < 1e-4, row
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


REWARDS_PY = """
def words(prompts, completions, **kwargs):
    return [float(len(c.split())) for c in completions]

def echoes_answer(completions, answer, completion_ids):
    # None (no opinion) where the row has no answer; the column and the token ids arrive as keywords
    return [None if a is None else float(a in c) + 0.001 * len(ids) for c, a, ids in zip(completions, answer, completion_ids)]

def needs_label(completions, label):
    return [0.0 for _ in completions]
"""


def test_generate_with_reward_functions_scores_each_part_as_training_does(tmp_path, capsys):
    """--reward-function takes online.reward_functions' names: its own score per part under "parts", the sum
    (with the reward model's, when given) as "score", None where nothing had an opinion; the data's other
    columns arrive as keywords; a function that needs a column the file lacks is refused before sampling."""
    from rlhfkit.models import load_scalar_model, load_tokenizer
    from tests.helpers import tiny_llama

    paths = write_sft_problem(tmp_path)
    tokenizer = load_tokenizer(str(paths["model"]))
    rm = tiny_llama("scalar", seed=5, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "hello", "answer": "the"}\n{"prompt": "the cat sat"}\n{"prompt": "a", "answer": "x"}\n'
    )
    out = tmp_path / "scored.jsonl"
    base = ["generate", "--model", str(paths["model"]), "--prompts", str(prompts), "--max-new-tokens", "6"]
    # The checks re-tokenize each response's text, which gives its sampled ids only where no special token
    # (which decodes to nothing) was sampled: so under this seed's multinomial draw, not under the exact one's.
    base += ["--sampler", "multinomial"]
    functions = ["--reward-function", f"{tmp_path / 'rewards.py'}:words"]
    functions += ["--reward-function", f"{tmp_path / 'rewards.py'}:echoes_answer"]
    assert main([*base, *functions, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    answers = ["the", None, "x"]
    for row, answer in zip(rows, answers, strict=True):
        ids = tokenizer(row["response"], add_special_tokens=False)["input_ids"]
        ids += [tokenizer.eos_token_id] if row["ended"] else []
        expected = None if answer is None else float(answer in row["response"]) + 0.001 * len(ids)
        assert row["parts"]["words"] == float(len(row["response"].split()))
        if expected is None:
            assert row["parts"]["echoes_answer"] is None
        else:
            assert abs(row["parts"]["echoes_answer"] - expected) < 1e-6, row
        assert abs(row["score"] - sum(v for v in row["parts"].values() if v is not None)) < 1e-5

    # with a reward model: its normalised score is one more part, and the score is the sum
    assert main([*base, *functions, "--reward-model", str(tmp_path / "rm"), "--out", str(out)]) == 0
    model = load_scalar_model(str(tmp_path / "rm"), tokenizer=tokenizer).eval()
    for row in (json.loads(line) for line in out.read_text().splitlines()):
        assert list(row["parts"]) == ["reward_model", "words", "echoes_answer"]
        assert abs(row["parts"]["reward_model"] - raw_score(model, tokenizer, row)) < 1e-4
        assert abs(row["score"] - sum(v for v in row["parts"].values() if v is not None)) < 1e-4

    # a function that needs a column the prompts lack, or a file that is not there: exit 2, named, nothing written
    out.unlink()
    assert (
        main([*base, "--reward-function", f"{tmp_path / 'rewards.py'}:needs_label", "--out", str(out)]) == 2
    )
    err = capsys.readouterr().err
    assert "--reward-function[0]: reward function 'needs_label' requires 'label'" in err and not out.exists()
    assert main([*base, "--reward-function", f"{tmp_path / 'nowhere.py'}:words"]) == 2
    assert "--reward-function[0]: file not found" in capsys.readouterr().err
