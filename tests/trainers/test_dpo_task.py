"""DPO on the built-in task: a short SFT, pairs from it labelled by the task's annotators, then `rlhfkit train
dpo`: the implicit reward learns the labels' (and gold's) order and the policy's gold score rises."""

import json

import pytest
import torch

from rlhfkit.cli import main
from rlhfkit.config import load_config
from rlhfkit.data import TokenLimits, prepare_examples
from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.rollout.evaluate import sample_and_score
from rlhfkit.rollout.pairs import label_pairs
from rlhfkit.tasks import get_task
from rlhfkit.tasks.files import prepare_task_files
from rlhfkit.trainers import sft


def _gold(policy_dir, tokenizer, examples, task, seed):
    policy = load_causal_lm(str(policy_dir), tokenizer=tokenizer, frozen=True).eval()
    torch.manual_seed(seed)
    samples = sample_and_score(
        policy, tokenizer, examples, temperature=0.7, max_new_tokens=32, gold_score=task.gold_score
    )
    return samples.summary()["gold_mean"]


@pytest.mark.long  # end to end, tens of seconds: CI's long step (the suite stays under 15 minutes)
@pytest.mark.learning
def test_dpo_on_the_task_raises_implicit_reward_accuracy_and_gold(
    tmp_path, learning_seed, learning_figures, monkeypatch
):
    # The pairs and the gold reads are drawn with torch.multinomial (online.sampler=multinomial), the draw this
    # test's thresholds were set under: one seed's DPO gain swings by more than the 0.15 margin with the draw
    # (learning seeds 0-6, gold gain under multinomial: >0.15, 0.26, 0.37, 0.49, 0.24, 0.33, -0.22; under the
    # exact draw: 0.01, 0.66, -1.27, -0.54, 0.05, 0.28, -0.71), while the two draws read the SFT policy alike
    # (gold -1.567 and -1.568 over 8 evaluation seeds).
    monkeypatch.setattr("rlhfkit.models.sampler.DEFAULT_SAMPLER", "multinomial")
    seed = learning_seed
    task = get_task("reviews", seed=seed)
    files = prepare_task_files(task, tmp_path / "task", "tiny", num_sft=1024, num_sft_eval=32)
    sft_cfg = load_config(
        None,
        [
            f"output_dir={tmp_path / 'sft'}",
            f"seed={seed}",
            f"model.name_or_path={files['init_model']}",
            f"data.train_file={files['sft_train']}",
            "data.max_prompt_length=32",
            "data.max_length=64",
            "train.max_steps=60",
            "train.batch_size=16",
            "train.learning_rate=3e-3",
            "train.lr_schedule=cosine",
            "train.warmup_steps=2",
            "train.save_steps=60",
            "logging.progress_bar=false",
        ],
        "sft",
    )
    sft.train(sft_cfg)
    policy = tmp_path / "sft" / "final"
    pairs = label_pairs(
        str(policy),
        tmp_path / "pairs",
        task="reviews",
        task_seed=seed,
        num_pairs=256,
        num_eval_pairs=128,
        seed=seed,
        max_new_tokens=32,
    )["paths"]
    config = tmp_path / "dpo.yaml"
    config.write_text(f"seed: {seed}\nlogging:\n  progress_bar: false\n")
    args = ["train", "dpo", "--config", str(config), f"output_dir={tmp_path / 'dpo'}"]
    args += [f"model.name_or_path={policy}", f"data.train_file={pairs['train']}"]
    args += [f"data.eval_file={pairs['eval']}", "data.max_prompt_length=32", "data.max_length=64"]
    args += ["train.max_steps=30", "train.batch_size=16", "train.learning_rate=2e-4", "train.eval_steps=10"]
    args += ["train.lr_schedule=constant", "train.save_steps=30", "dpo.beta=0.1"]
    assert main(args) == 0

    rows = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval/accuracy"] == 0.5  # every pair a tie at the start
    final = evals[-1]
    train_accuracy = [r["accuracy"] for r in rows if "accuracy" in r and r["step"] > 0]
    tokenizer = load_tokenizer(str(policy))
    prompts = prepare_examples(
        str(files["prompts_eval"]), "prompts", tokenizer, TokenLimits(32, None, "left")
    )[:128]
    gold_sft = _gold(policy, tokenizer, prompts, task, seed)
    gold_dpo = _gold(tmp_path / "dpo" / "final", tokenizer, prompts, task, seed)
    learning_figures(
        heldout_accuracy=final["eval/accuracy"],
        heldout_gold_accuracy=final["eval/gold_accuracy"],
        train_accuracy_last10=sum(train_accuracy[-10:]) / 10,
        gold_sft=gold_sft,
        gold_dpo=gold_dpo,
    )
    assert final["eval/accuracy"] > 0.53 and final["eval/gold_accuracy"] > 0.6
    assert sum(train_accuracy[-10:]) / 10 > 0.65
    assert final["eval/logratio/chosen"] > final["eval/logratio/rejected"]
    assert gold_dpo > gold_sft + 0.15, (gold_sft, gold_dpo)
