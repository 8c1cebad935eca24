"""examples/overoptimization.py end to end on a tiny random policy of the built-in task: both PPO runs (plain and
with the reward-model refresh), the meter's figures, the fit, the comparison, the plots; --fit-only reproduces
the numbers from the run folders. (The figures themselves come from the full run: examples/README.md.)"""

from __future__ import annotations

import json
import random

import pytest

from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.tasks import get_task
from rlhfkit.tasks.files import write_jsonl
from tests.examples.loader import load_example
from tests.helpers import tiny_llama


@pytest.mark.long  # end to end, tens of seconds: CI's long step (the suite stays under 15 minutes)
def test_overoptimization_script_runs_both_runs_fits_and_plots(tmp_path, capsys):
    task = get_task("reviews", seed=0)
    sft, reward = tmp_path / "sft", tmp_path / "reward"
    tokenizer = task.build_tokenizer(sft)
    ids = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tiny_llama(seed=0, **ids).save_pretrained(sft)
    tiny_llama("scalar", seed=1, **ids).save_pretrained(reward)
    tokenizer.save_pretrained(reward)
    files = {
        split: write_jsonl(
            tmp_path / f"prompts_{split}.jsonl", [{"prompt": p} for p in task.prompts(split)[:16]]
        )
        for split in ("train", "eval")
    }
    rng = random.Random(0)
    pairs = [
        {"prompt": p, "chosen": task.sample_completion(p, rng), "rejected": task.sample_completion(p, rng)}
        for p in task.prompts("train")[:8]
    ]
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    out = tmp_path / "out"
    args = [
        "--out",
        str(out),
        "--sft",
        str(sft),
        "--reward-model",
        str(reward),
        "--prompts-train",
        str(files["train"]),
        "--prompts-eval",
        str(files["eval"]),
        "--pairs",
        str(tmp_path / "pairs.jsonl"),
        "--preset",
        "smoke",
        "--rollouts",
        "4",
        "--eval-every",
        "1",
        "--eval-prompts",
        "16",
        "--learning-rate",
        "1e-2",
        "--refresh-steps",
        "2",
        "--refresh-settings",
        '{"pairs": 4, "steps": 2, "batch_size": 4, "normalize_max_pairs": 8}',
    ]
    ex = load_example("overoptimization")
    assert ex.main(args) == 0
    printed = capsys.readouterr().out
    for text in (
        "Gao et al. fit",
        "α =",
        "β =",
        "linear fit",
        "observed peak",
        "With a reward-model refresh",
        "gap = proxy",
    ):
        assert text in printed
    result = json.loads((out / "fit.json").read_text())
    for key in ("alpha", "beta", "r2", "rmse", "linear_a", "linear_r2", "d_peak", "observed_peak"):
        assert key in result["fit"]
    assert result["fit"]["points"] >= 3 and "compare" in result
    # A random policy writes no valid review: every SFT sample has the same gold score, so the gap has no unit.
    assert result["compare"]["gold_std_sft"] == 0.0 and result["compare"]["end"]["plain"]["gap"] is None
    assert (out / "fit.png").stat().st_size > 10_000 and (out / "compare.png").stat().st_size > 10_000
    plain, refreshed = (read_metrics(out / name / "metrics.jsonl") for name in ("ppo", "ppo-refresh"))
    meter = ("eval/gold/mean", "eval/score/mean", "eval/kl/mean")
    assert [r["step"] for r in plain if all(k in r for k in meter)] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in refreshed if "refresh/pairs" in r] == [2, 4]
    assert not any("refresh/pairs" in r for r in plain)
    # Fitting again from the run folders alone gives the same numbers.
    assert ex.main(["--out", str(out), "--refresh-steps", "2", "--fit-only"]) == 0
    again = json.loads((out / "fit.json").read_text())
    assert again["fit"] == result["fit"] and again["compare"] == result["compare"]
