"""`rlhfkit generate`: JSON Lines out, greedy is deterministic, bad input is exit 2."""

import json

from rlhfkit.cli import main
from tests.trainers.sft_fixtures import write_sft_problem


def test_generate_writes_one_line_per_prompt_and_greedy_repeats(tmp_path):
    paths = write_sft_problem(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "the cat sat"}\n')
    out1, out2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = ["generate", "--model", str(paths["model"]), "--prompts", str(prompts), "--greedy", "--max-new-tokens", "5"]
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
