"""A tiny SFT problem on disk: a word-level tokenizer, a random tiny Llama and a JSON Lines corpus."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import tiny_llama, tiny_tokenizer

PAIRS = [
    ("hello", "world ."),
    ("the cat", "sat on a mat ."),
    ("one two", "three four ."),
    ("dog ran", "fast !"),
    ("yes", "no ."),
    ("five six", "seven eight nine ."),
]


def write_sft_problem(root: Path, pad: str = "<pad>", seed: int = 0) -> dict[str, Path]:
    """Write ``model/`` (tokenizer + random tiny Llama), ``train.jsonl`` and ``eval.jsonl`` under ``root``."""
    tokenizer = tiny_tokenizer(pad=pad)
    model = tiny_llama(seed=seed, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in PAIRS * 4))
    evalf = root / "eval.jsonl"
    evalf.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in PAIRS))
    return {"model": model_dir, "train": train, "eval": evalf}


def sft_args(paths: dict[str, Path], out: Path, *extra: str, seed: int = 0) -> list[str]:
    config = out.parent / f"{out.name}.yaml"
    config.write_text(f"seed: {seed}\n")
    return [
        "train",
        "sft",
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
        "train.save_steps=3",
        "train.eval_steps=3",
        "data.max_prompt_length=16",
        "data.max_length=32",
        *extra,
    ]
