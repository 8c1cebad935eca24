"""A seed's stage for the claim experiments' smoke tests (``ppo_arms.run_arms``) without training: a random tiny
Llama as the SFT policy and another as the reward model, both on the built-in task's tokenizer, 16 training
prompts, labelled pairs sampled from the random policy. Seconds, where the scripts' own smoke size (SFT, pairs,
reward model) takes half a minute."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from tests.helpers import tiny_llama


def tiny_stage(root: Path, train_reward, sizes, seed: int = 0) -> dict:
    """``train_reward``: ``ppo_arms.train_reward_variant``; ``sizes``: the experiments' smoke sizes."""
    from rlhfkit.rollout.pairs import label_pairs
    from rlhfkit.tasks import get_task

    task = get_task("reviews", seed=seed)
    root.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, n in (("train", 16), ("eval", 8)):
        files[f"prompts_{split}"] = root / f"prompts_{split}.jsonl"
        lines = [json.dumps({"prompt": p}) for p in task.prompts(split)[:n]]
        files[f"prompts_{split}"].write_text("\n".join(lines) + "\n")
    folders = {}
    for name, kind in (("sft", "causal"),):
        folders[name] = root / name
        tokenizer = task.build_tokenizer(folders[name])
        ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
        tiny_llama(
            kind, seed=1, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **ids
        ).save_pretrained(folders[name])
    pairs_dir = root / "pairs"
    label_pairs(str(folders["sft"]), pairs_dir, task="reviews", task_seed=seed, num_pairs=8, num_eval_pairs=8,
                seed=seed, max_new_tokens=4, overwrite=True)  # fmt: skip
    pairs = {k: pairs_dir / f"pairs_{k}.jsonl" for k in ("train", "eval")}
    stage = {
        "task": task,
        "files": files,
        "sft": folders["sft"],
        "rm_accuracy": None,
        "root": root,
        "pairs": pairs,
    }
    # the reward model trained 2 steps on the pairs (ppo_arms.train_reward_variant), so it has the reward
    # trainer's summary (held-out accuracy, length correlation) as a real stage's has
    reward = train_reward(root / "reward", stage, pairs["train"], seed, tiny_sizes(sizes), tiny_args(root))
    return {**stage, "reward": reward, "rewards": {"reward": reward}}


def tiny_sizes(sizes):
    """The experiments' smoke sizes, smaller still: 2 rollouts of 2 prompts x 4 tokens, 3 held-out prompts."""
    return replace(sizes, rm_steps=2, rm_batch=4, ppo_batch=2, response_length=4, rollouts=2, eval_every=1,
                   eval_prompts=3)  # fmt: skip


def tiny_args(out: Path, **extra) -> SimpleNamespace:
    return SimpleNamespace(out=out, overwrite=False, size="smoke", **extra)
