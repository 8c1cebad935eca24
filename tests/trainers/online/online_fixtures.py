"""A tiny online-RL problem on disk: tokenizer + policy + reward model + prompts + reward functions.

Prompts have different lengths (so generation batches are left padded); the reward functions live in a
file (``rewards.py``) and are named the way a user names them: ``"<dir>/rewards.py:fn"``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlhfkit.config import load_config
from tests.helpers import tiny_gpt2, tiny_llama, tiny_tokenizer

PROMPTS = [
    "hello",
    "the cat sat on",
    "one two",
    "dog ran fast .",
    "yes",
    "five six seven eight nine",
    "a mat",
    "good bad ?",
]

REWARDS_PY = '''
import time

def cat_count(prompts, completions, **kwargs):
    """+1 for every 'cat' in the response (a toy objective a tiny model can learn fast)."""
    return [float(c.split().count("cat")) for c in completions]

def words(prompts, completions, **kwargs):
    """The number of words of the response."""
    return [float(len(c.split())) for c in completions]

def noisy_cat_count(prompts, completions, **kwargs):
    """cat_count plus noise drawn from Python's and NumPy's global generators (as a user's function might)."""
    import random

    import numpy
    return [float(c.split().count("cat")) + random.random() + float(numpy.random.rand()) for c in completions]

def slow_cat_count(prompts, completions, **kwargs):
    """cat_count, slowly: a run long enough to be killed in the middle."""
    time.sleep(0.25)
    return cat_count(prompts, completions)
'''


def write_online_problem(
    root: Path, pad: str = "<pad>", policy: str = "llama", reward_model: bool = True, seed: int = 0
) -> dict[str, Path]:
    """Write ``policy/``, ``reward/`` (optional), ``prompts.jsonl`` and ``rewards.py`` under ``root``.

    Args:
        pad: the tokenizer's pad (``"<pad>"`` or ``"eos"``).
        policy: ``"llama"`` or ``"gpt2-dropout"`` (GPT-2 with its default dropout 0.1 everywhere and absolute
            positions, so that both dropout and left padding would show in the PPO ratio).
    """
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(pad=pad)
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    if policy == "llama":
        model = tiny_llama(seed=seed, **ids)
    else:
        model = tiny_gpt2(seed=seed, **ids)
        assert model.config.attn_pdrop > 0 and model.config.resid_pdrop > 0
    paths = {"policy": root / "policy", "prompts": root / "prompts.jsonl", "rewards": root / "rewards.py"}
    model.save_pretrained(paths["policy"])
    tokenizer.save_pretrained(paths["policy"])
    if reward_model:
        paths["reward"] = root / "reward"
        scalar = (
            tiny_llama("scalar", seed=seed + 1, **ids)
            if policy == "llama"
            else tiny_gpt2("scalar", seed=seed + 1, **ids)
        )
        scalar.save_pretrained(paths["reward"])
        tokenizer.save_pretrained(paths["reward"])
    paths["prompts"].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    paths["rewards"].write_text(REWARDS_PY)
    return paths


def online_overrides(paths: dict[str, Path], out: Path, *extra: str, reward: str = "cat_count") -> list[str]:
    """dotted.key=value settings of a small, fast online run (2 prompts x 2 responses, 6 new tokens, the default temperature)."""
    settings = [
        f"output_dir={out}",
        f"model.name_or_path={paths['policy']}",
        f"data.train_file={paths['prompts']}",
        f"online.reward_functions=[{paths['rewards']}:{reward}]",
        "train.batch_size=4",
        "train.micro_batch_size=2",
        "train.learning_rate=1e-3",
        "train.lr_schedule=constant",
        "online.group_size=2",
        "online.response_length=6",
        "online.ppo_epochs=2",
        "online.num_minibatches=2",
        "data.max_prompt_length=16",
    ]
    return [*settings, *extra]


def online_config(
    paths: dict[str, Path], out: Path, *extra: str, kind: str = "ppo", reward: str = "cat_count"
):
    """A RunConfig for :func:`online_overrides`."""
    return load_config(None, online_overrides(paths, out, *extra, reward=reward), kind)


def online_cli_args(
    paths: dict[str, Path], out: Path, *extra: str, kind: str = "ppo", reward: str = "cat_count"
) -> list[str]:
    """``rlhfkit`` arguments for :func:`online_overrides` (a config file with the seed, the rest overrides)."""
    config = out.parent / f"{out.name}.yaml"
    config.write_text("seed: 0\n")
    return ["train", kind, "--config", str(config), *online_overrides(paths, out, *extra, reward=reward)]


def make_context(cfg):
    """The trainer's context for ``cfg``, built as :func:`rlhfkit.trainers.online.train` builds it."""
    from rlhfkit.engine.accel import make_accelerator
    from rlhfkit.engine.seed import seed_everything
    from rlhfkit.models import load_tokenizer
    from rlhfkit.trainers.online.context import build_context

    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    return build_context(cfg, make_accelerator(cpu=True), tokenizer)


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of a model's weights."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
