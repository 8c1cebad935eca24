"""The quickstart of a task with checkable answers (``rlhfkit quickstart --task arithmetic``).

    rlhfkit quickstart --task arithmetic [--out DIR] [--preset tiny|smoke] [--seed N]

Stages, each in its own run folder under ``DIR``:

1. ``task/``   the task on disk (tokenizer, fresh model, SFT data, prompt splits) and ``prm_*.jsonl``, the
               corpus writer's solutions with every step labelled by the task's step checker;
2. ``sft/``    supervised fine-tuning on the writer's solutions (which drop most carries);
3. ``prm/``    the process reward model on the labelled steps (``rlhfkit train prm``);
   ``orm/``    an outcome reward model (``rlhfkit train reward``, Bradley-Terry) on ``task/orm_*.jsonl``: per
               prompt, the reference solution chosen over the writer's slipped one (a wrong answer);
4. ``grpo/``   GRPO on the rule reward (exact match, ``rlhfkit.tasks.arithmetic:exact_match_reward``), no
               critic, groups of ``group_size`` samples at temperature 1;
5. ``ppo/``    PPO (a critic, GAE) on the same rule reward;
   ``ppo_prm/`` the same PPO with the PRM's step rewards added (``online.process_reward_model``);
   ``ppo_orm/`` the same PPO with the ORM's score as its only reward (no rule reward; the critic starts
               from the SFT policy, as in the other PPO runs, so only the reward differs);
6. evaluation  greedy exact match and step accuracy (the step checker's) on held-out prompts, per policy;
7. report      ``summary.json`` and ``report.md`` with the comparison.

The figures of the tiny preset, and the commands that measure them, are in the README.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfkit.config import config_from
from rlhfkit.quickstart.stages import sft_stage, write_summary

REWARD = "rlhfkit.tasks.arithmetic:exact_match_reward"


@dataclass(frozen=True)
class VerifiablePreset:
    """How long each stage of the verifiable quickstart trains."""

    model: str
    sft_steps: int
    sft_batch: int
    sft_lr: float
    prm_steps: int
    prm_batch: int
    prm_lr: float
    orm_steps: int
    orm_batch: int
    orm_lr: float
    rollouts: int
    prompts_per_rollout: int
    group_size: int
    rl_lr: float
    response_length: int
    num_eval_prompts: int


VERIFIABLE_PRESETS: dict[str, VerifiablePreset] = {
    "tiny": VerifiablePreset("tiny", 1200, 64, 2e-3, 150, 64, 1e-3, 100, 32, 1e-3, 40, 8, 8, 3e-4, 40, 256),
    "smoke": VerifiablePreset("tiny", 6, 8, 2e-3, 4, 8, 1e-3, 4, 8, 1e-3, 2, 2, 2, 3e-4, 12, 8),
}


def rl_overrides(
    policy: str | Path,
    prompts: str | Path,
    p: VerifiablePreset,
    seed: int,
    kind: str,
    prm: str | Path | None = None,
    orm: str | Path | None = None,
) -> dict[str, Any]:
    """The online settings of the grpo / rloo / ppo stages (``kind``); ``prm``: a PRM folder for PPO;
    ``orm``: an outcome reward model folder that replaces the rule reward (the critic still starts from
    ``policy``)."""
    settings = {
        "seed": seed,
        "model.name_or_path": policy,
        "data.train_file": prompts,
        "data.max_prompt_length": 16,
        "online.reward_functions": f"[{REWARD}]",
        "online.response_length": p.response_length,
        "online.temperature": 1.0,
        "online.kl_coef": 0.01,
        "train.max_steps": p.rollouts,
        "train.batch_size": p.prompts_per_rollout,
        "train.learning_rate": p.rl_lr,
        "train.lr_schedule": "constant",
        "train.save_steps": p.rollouts,
        "train.eval_steps": p.rollouts,
        "train.log_steps": 1,
        "online.ppo_epochs": 2,
        "online.num_minibatches": 2,
    }
    if kind in ("grpo", "rloo"):
        settings["online.group_size"] = p.group_size
    else:  # PPO sees as many responses per rollout as the critic-free runs
        settings["train.batch_size"] = p.prompts_per_rollout * p.group_size
    if prm is not None:
        settings["online.process_reward_model"] = prm
    if orm is not None:
        settings.update(
            {"online.reward_functions": "[]", "online.reward_model": orm, "online.critic_model": policy}
        )
    return settings


def train_orm(out: Path, sft_dir: str | Path, task, p: VerifiablePreset, seed: int, overwrite: bool = False):
    """The outcome reward model: ``task.orm_pairs`` written to ``out/task/orm_{train,eval}.jsonl``, then
    ``rlhfkit train reward`` from the SFT policy into ``out/orm``; returns the reward trainer's summary."""
    from rlhfkit.tasks.files import write_jsonl
    from rlhfkit.trainers import reward

    files = {
        split: write_jsonl(out / "task" / f"orm_{split}.jsonl", task.orm_pairs(n, split=split))
        for split, n in (("train", p.orm_steps * p.orm_batch), ("eval", 256))
    }
    settings = {
        "seed": seed,
        "model.name_or_path": sft_dir,
        "data.train_file": files["train"],
        "data.eval_file": files["eval"],
        "data.max_prompt_length": 16,
        "data.max_length": 16 + p.response_length,
        "train.max_steps": p.orm_steps,
        "train.batch_size": p.orm_batch,
        "train.learning_rate": p.orm_lr,
        "train.lr_schedule": "cosine",
        "train.save_steps": p.orm_steps,
        "train.eval_steps": max(1, p.orm_steps // 2),
        "train.log_steps": 50,
    }
    return reward.train(config_from("reward", out / "orm", settings), overwrite=overwrite)


def measure(
    policy_dir: str | Path, task, prompts_file: str | Path, num_prompts: int, length: int
) -> dict[str, float]:
    """Greedy exact match, step accuracy (the step checker's, over all lines written) and valid rate of a policy
    on the first ``num_prompts`` prompts of ``prompts_file``."""
    from rlhfkit.data import TokenLimits, prepare_examples
    from rlhfkit.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(policy_dir))
    policy = load_causal_lm(str(policy_dir), tokenizer=tok, frozen=True).eval()
    examples = prepare_examples(str(prompts_file), "prompts", tok, TokenLimits(16, None, "left"))[
        :num_prompts
    ]
    return greedy_figures(policy, tok, task, examples, length)


def greedy_figures(policy, tokenizer, task, examples: list[dict], length: int) -> dict[str, float]:
    """:func:`measure`'s figures of a policy in memory on prepared prompt ``examples``."""
    from rlhfkit.rollout.evaluate import sample_and_score
    from rlhfkit.tasks.arithmetic import step_labels

    s = sample_and_score(
        policy, tokenizer, examples, temperature=1.0, max_new_tokens=length, greedy=True,
        gold_score=task.gold_score, is_valid=task.is_valid,
    )  # fmt: skip
    labels = [label for p, r in zip(s.prompts, s.responses, strict=True) for label in step_labels(p, r)]
    return {
        "exact_match": sum(s.gold) / len(s.gold),
        "step_accuracy": sum(labels) / max(len(labels), 1),
        "valid_rate": sum(s.valid) / len(s.valid),
    }


def quickstart_verifiable(
    out_dir: str | Path,
    task_name: str = "arithmetic",
    preset: str = "tiny",
    overwrite: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Run every stage into ``out_dir`` (see the module docstring); return the summary."""
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files, write_jsonl
    from rlhfkit.trainers import online, sft
    from rlhfkit.trainers import prm as prm_trainer

    p = VERIFIABLE_PRESETS[preset]
    out = Path(out_dir)
    task = get_task(task_name, seed=seed)
    if not hasattr(task, "prm_records"):
        from rlhfkit.errors import ConfigError

        raise ConfigError(
            f"task {task_name!r} has no checkable answers; the verifiable tasks are ['arithmetic']"
        )
    start, seconds = time.perf_counter(), {}

    def stage(name: str, detail: str) -> float:
        print(f"[{name}] {detail}", flush=True)
        return time.perf_counter()

    t = stage("task", f"'{task.name}', preset {preset}")
    files = prepare_task_files(task, out / "task", p.model, num_sft=p.sft_steps * p.sft_batch)
    files["prm_train"] = write_jsonl(
        out / "task" / "prm_train.jsonl", task.prm_records(p.prm_steps * p.prm_batch)
    )
    files["prm_eval"] = write_jsonl(out / "task" / "prm_eval.jsonl", task.prm_records(256, split="eval"))
    seconds["task"] = time.perf_counter() - t

    t = stage("SFT", f"{p.sft_steps} steps of {p.sft_batch}")
    common = {"seed": seed, "data.max_prompt_length": 16, "data.max_length": 16 + p.response_length}
    sft.train(
        config_from(
            "sft",
            out / "sft",
            {
                **common,
                **sft_stage(files, p.sft_steps, p.sft_batch, p.sft_lr),
                "train.eval_steps": p.sft_steps,
                "train.log_steps": 50,
            },
        ),
        overwrite=overwrite,
    )
    sft_dir = out / "sft" / "final"
    seconds["sft"] = time.perf_counter() - t

    t = stage("PRM", f"{p.prm_steps} steps of {p.prm_batch} labelled solutions")
    prm_summary = prm_trainer.train(
        config_from(
            "prm",
            out / "prm",
            {
                **common,
                "model.name_or_path": sft_dir,
                "data.train_file": files["prm_train"],
                "data.eval_file": files["prm_eval"],
                "train.max_steps": p.prm_steps,
                "train.batch_size": p.prm_batch,
                "train.learning_rate": p.prm_lr,
                "train.lr_schedule": "cosine",
                "train.save_steps": p.prm_steps,
                "train.eval_steps": max(1, p.prm_steps // 3),
                "train.log_steps": 50,
            },
        ),
        overwrite=overwrite,
    )
    prm_dir = out / "prm" / "final"
    seconds["prm"] = time.perf_counter() - t

    t = stage("ORM", f"{p.orm_steps} steps of {p.orm_batch} pairs (a right solution over a wrong one)")
    orm_summary = train_orm(out, sft_dir, task, p, seed, overwrite=overwrite)
    orm_dir = out / "orm" / "final"
    seconds["orm"] = time.perf_counter() - t

    reward_of = {
        "grpo": "the exact-match reward",
        "ppo": "the exact-match reward",
        "ppo_prm": "the exact-match reward + the PRM's step rewards",
        "ppo_orm": "the ORM's score",
    }
    runs = {
        "grpo": ("grpo", None, None),
        "ppo": ("ppo", None, None),
        "ppo_prm": ("ppo", prm_dir, None),
        "ppo_orm": ("ppo", None, orm_dir),
    }
    for name, (kind, prm, orm) in runs.items():
        t = stage(name, f"{p.rollouts} rollouts on {reward_of[name]}")
        settings = rl_overrides(sft_dir, files["prompts_train"], p, seed, kind, prm, orm)
        online.train(config_from(kind, out / name, settings), overwrite=overwrite)
        seconds[name] = time.perf_counter() - t

    t = stage("evaluation", f"greedy, {p.num_eval_prompts} held-out prompts")
    policies = {"sft": sft_dir, **{name: out / name / "final" for name in runs}}
    figures = {
        name: measure(path, task, files["prompts_eval"], p.num_eval_prompts, p.response_length)
        for name, path in policies.items()
    }
    seconds["evaluation"] = time.perf_counter() - t
    summary = {
        "task": task.name,
        "preset": preset,
        "seed": seed,
        "policies": figures,
        "prm": {
            k: prm_summary.get(k)
            for k in ("heldout_accuracy", "heldout_solution_accuracy")
            if k in prm_summary
        },
        "orm": {"heldout_accuracy": orm_summary.get("heldout_accuracy")},
        "stage_seconds": seconds,
        "wall_seconds": time.perf_counter() - start,
    }
    return write_summary(out, summary, task.name, format_verifiable(summary))


def format_verifiable(summary: dict[str, Any]) -> str:
    """The comparison as a small table: one row per policy, greedy on held-out prompts."""
    lines = [f"  {'policy':<10} {'exact match':>12} {'step accuracy':>14} {'valid':>7}"]
    for name, f in summary["policies"].items():
        lines.append(
            f"  {name:<10} {f['exact_match']:>12.3f} {f['step_accuracy']:>14.3f} {f['valid_rate']:>7.3f}"
        )
    held = [
        f"{label} {value:.3f}"
        for label, value in (
            ("PRM held-out step accuracy", summary.get("prm", {}).get("heldout_accuracy")),
            ("ORM held-out pair accuracy", summary.get("orm", {}).get("heldout_accuracy")),
        )
        if value is not None
    ]
    return "\n".join(lines + ([f"  ({'; '.join(held)})"] if held else []))
