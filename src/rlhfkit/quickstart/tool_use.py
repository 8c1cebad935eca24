"""The quickstart of the task with a tool (``rlhfkit quickstart --task tools``).

    rlhfkit quickstart --task tools [--out DIR] [--preset tiny|smoke] [--seed N]

Stages, each in its own run folder under ``DIR``:

1. ``task/``   the ``tools`` task on disk (:mod:`rlhfkit.tasks.calculator`: tokenizer with its chat template,
               fresh model, prompt splits) and its demonstrations, of which a share (``tool_rate``, 0.5) call
               the calculator and copy its result and the rest answer at once from mental arithmetic that is
               mostly wrong in the last digits; each starts with the system line that the chat template
               writes for the tools, so that SFT sees the prompts as the RL episodes render them;
2. ``sft/``    supervised fine-tuning on them (every assistant message trained, the tool results masked);
3. ``grpo/``   GRPO with the calculator as a tool (``online.tools``) on the task's gold scorer
               (``rlhfkit.tasks.calculator:correct_answer_reward``): multi-turn episodes, the model's tokens
               alone trained;
   ``ppo/``    PPO with a critic (GAE over the model's tokens, the critic from the SFT policy) on the same
               episodes and score, as many episodes per rollout;
4. evaluation  greedy episodes on held-out prompts, SFT, GRPO and PPO: the correct-answer rate and the tool-use rate
               (the share of episodes that call the calculator);
5. report      ``summary.json`` and ``report.md``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfkit.config import config_from
from rlhfkit.quickstart.stages import sft_stage, write_summary

TOOL = "rlhfkit.tasks.calculator:calculator"
REWARD = "rlhfkit.tasks.calculator:correct_answer_reward"
PROMPT_TOKENS = 32  # "<|system|>tools: calculator\n<|user|>What is 123*456?\n<|assistant|>" is about 24


@dataclass(frozen=True)
class ToolsPreset:
    """How long each stage of the tools quickstart trains."""

    model: str
    sft_steps: int
    sft_batch: int
    sft_lr: float
    rollouts: int
    prompts_per_rollout: int
    group_size: int
    rl_lr: float
    response_length: int
    max_turns: int
    num_eval_prompts: int
    num_train_prompts: int
    tool_rate: float  # the share of demonstrations that call the tool


TOOLS_PRESETS: dict[str, ToolsPreset] = {
    "tiny": ToolsPreset("tiny", 600, 32, 2e-3, 30, 8, 8, 3e-4, 64, 3, 128, 4096, 0.5),
    "smoke": ToolsPreset("tiny", 4, 8, 2e-3, 2, 2, 2, 3e-4, 48, 3, 8, 64, 0.5),
}


def demonstrations(task, n: int, split: str = "train") -> list[dict]:
    """``n`` SFT records: the task's conversations behind the tools' system line (module docstring)."""
    system = {"role": "system", "content": "tools: calculator"}
    return [{"messages": [system, *c]} for c in task.sft_conversations(n, split=split)]


def rl_overrides(
    policy: str | Path, prompts: str | Path, p: ToolsPreset, seed: int, kind: str
) -> dict[str, Any]:
    """GRPO (``kind``) or PPO with a critic, with the calculator tool on the gold scorer; PPO sees as many
    episodes per rollout as GRPO (one per prompt)."""
    settings = {
        "seed": seed,
        "model.name_or_path": policy,
        "data.train_file": prompts,
        "data.max_prompt_length": PROMPT_TOKENS,
        "online.tools": f"[{TOOL}]",
        "online.max_turns": p.max_turns,
        "online.reward_functions": f"[{REWARD}]",
        "online.response_length": p.response_length,
        "online.temperature": 1.0,
        "online.kl_coef": 0.01,
        "online.group_size": p.group_size,
        "train.max_steps": p.rollouts,
        "train.batch_size": p.prompts_per_rollout,
        "train.learning_rate": p.rl_lr,
        "train.lr_schedule": "constant",
        "train.save_steps": p.rollouts,
        "train.log_steps": 1,
        "online.ppo_epochs": 2,
        "online.num_minibatches": 2,
    }
    if kind == "ppo":
        settings.update({"train.batch_size": p.prompts_per_rollout * p.group_size, "online.group_size": 1})
    return settings


def measure(policy_dir: str | Path, prompts: list[str], p: ToolsPreset, batch: int = 32) -> dict[str, float]:
    """Greedy episodes of a policy with the calculator on ``prompts``: ``correct_rate`` (the gold scorer's),
    ``tool_use_rate`` (episodes that call the calculator) and ``calls_per_episode``."""
    from rlhfkit.models import load_causal_lm, load_tokenizer, sampling_for
    from rlhfkit.rollout.episodes import EpisodeRunner, run_episodes
    from rlhfkit.rollout.tools import Toolbox
    from rlhfkit.tasks.calculator import is_correct, used_tool

    tok = load_tokenizer(str(policy_dir))
    policy = load_causal_lm(str(policy_dir), tokenizer=tok, frozen=True).eval()
    runner = EpisodeRunner.create(
        tok,
        Toolbox.load([TOOL]),
        max_turns=p.max_turns,
        response_length=p.response_length,
        tool_timeout=10.0,
        max_tool_response_length=None,
        stop_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
        sampling=sampling_for(tok.pad_token_id, [tok.eos_token_id]),
    )
    correct = used = calls = 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        episodes = run_episodes(runner, policy, chunk, greedy=True)
        for prompt, completion, record in zip(chunk, episodes.completions, episodes.records, strict=True):
            correct += is_correct(prompt, completion)
            used += used_tool(completion)
            calls += len(record.calls)
        episodes.close()
    n = max(len(prompts), 1)
    return {"correct_rate": correct / n, "tool_use_rate": used / n, "calls_per_episode": calls / n}


def quickstart_tools(
    out_dir: str | Path, preset: str = "tiny", overwrite: bool = False, seed: int = 0
) -> dict[str, Any]:
    """Run every stage into ``out_dir`` (see the module docstring); return the summary."""
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import write_jsonl
    from rlhfkit.trainers import online, sft

    p = TOOLS_PRESETS[preset]
    out = Path(out_dir)
    task = get_task(
        "tools",
        seed=seed,
        num_train_prompts=p.num_train_prompts,
        num_eval_prompts=p.num_eval_prompts,
        tool_rate=p.tool_rate,
    )
    start, seconds = time.perf_counter(), {}

    def stage(name: str, detail: str) -> float:
        print(f"[{name}] {detail}", flush=True)
        return time.perf_counter()

    t = stage("task", f"'tools', preset {preset}")
    files = {"init_model": out / "task" / "init_model"}
    tokenizer = task.build_tokenizer(files["init_model"])
    task.build_model(p.model, tokenizer).save_pretrained(files["init_model"])
    files["sft_train"] = write_jsonl(
        out / "task" / "sft_train.jsonl", demonstrations(task, p.sft_steps * p.sft_batch)
    )
    files["sft_eval"] = write_jsonl(out / "task" / "sft_eval.jsonl", demonstrations(task, 64, split="eval"))
    files["prompts_train"] = write_jsonl(
        out / "task" / "prompts_train.jsonl", [{"prompt": q} for q in task.prompts("train")]
    )
    seconds["task"] = time.perf_counter() - t

    t = stage("SFT", f"{p.sft_steps} steps of {p.sft_batch} demonstrations")
    sft.train(
        config_from(
            "sft",
            out / "sft",
            {
                "seed": seed,
                "data.max_prompt_length": PROMPT_TOKENS,
                "data.max_length": PROMPT_TOKENS + p.response_length,
                **sft_stage(files, p.sft_steps, p.sft_batch, p.sft_lr),
                "train.eval_steps": p.sft_steps,
                "train.log_steps": 50,
            },
        ),
        overwrite=overwrite,
    )
    sft_dir = out / "sft" / "final"
    seconds["sft"] = time.perf_counter() - t

    for kind in ("grpo", "ppo"):
        t = stage(kind, f"{p.rollouts} rollouts with the calculator tool on the gold scorer")
        online.train(
            config_from(kind, out / kind, rl_overrides(sft_dir, files["prompts_train"], p, seed, kind)),
            overwrite=overwrite,
        )
        seconds[kind] = time.perf_counter() - t

    t = stage("evaluation", f"greedy episodes, {p.num_eval_prompts} held-out prompts")
    prompts = task.prompts("eval")[: p.num_eval_prompts]
    figures = {
        name: measure(path, prompts, p)
        for name, path in (("sft", sft_dir), *((k, out / k / "final") for k in ("grpo", "ppo")))
    }
    seconds["evaluation"] = time.perf_counter() - t
    summary = {
        "task": "tools",
        "preset": preset,
        "seed": seed,
        "eval_prompts": len(prompts),
        "policies": figures,
        "stage_seconds": seconds,
        "wall_seconds": time.perf_counter() - start,
    }
    return write_summary(out, summary, "tools", format_tools(summary))


def format_tools(summary: dict[str, Any]) -> str:
    """One row per policy: greedy episodes on held-out prompts."""
    lines = [f"  {'policy':<8} {'correct':>8} {'tool use':>9} {'calls/episode':>14}"]
    for name, f in summary["policies"].items():
        lines.append(
            f"  {name:<8} {f['correct_rate']:>8.3f} {f['tool_use_rate']:>9.3f} {f['calls_per_episode']:>14.3f}"
        )
    return "\n".join(lines)
