"""GRPO rollouts with ``online.generation_backend`` hf against vllm: time by phase, median over rollouts.

The built-in reviews task's fresh model of a preset (``tiny``: head size 32, or ``small``), a rule reward (the
number of words), the same run with each backend. Run it in the environment of ``./setup.sh vllm``, on an
otherwise idle machine:

    .venv-vllm/bin/python benchmarks/generation_backend.py --preset tiny --rollouts 6 --out runs/bench_gen

Prints one JSON line per backend: the medians (after the first rollout, which warms up) of ``time/generate``,
``time/weight_sync``, ``time/forward``, ``time/update``, ``time/step_seconds``, and the engine's start-up
seconds (vllm). SmolLM2 (a real model) is the performance benchmarks' loader, not this script's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rlhfkit.config import load_config
from rlhfkit.engine.threads import set_num_threads
from rlhfkit.tasks import get_task
from rlhfkit.tasks.files import write_jsonl
from rlhfkit.trainers import online

REWARD = (
    "def words(prompts, completions, **kwargs):\n    return [float(len(c.split())) for c in completions]\n"
)
PHASES = ("generate", "weight_sync", "forward", "update", "step_seconds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--out", default="runs/bench_generation_backend")
    args = parser.parse_args()
    set_num_threads()
    out = Path(args.out)
    task = get_task("reviews", seed=0)
    model_dir = out / "model"
    tokenizer = task.build_tokenizer(model_dir)
    task.build_model(args.preset, tokenizer).save_pretrained(model_dir)
    prompts = write_jsonl(out / "prompts.jsonl", [{"prompt": p} for p in task.prompts("train")])
    (out / "reward.py").write_text(REWARD)
    for backend in args.backends.split(","):
        settings = [
            f"output_dir={out / backend}",
            f"model.name_or_path={model_dir}",
            f"data.train_file={prompts}",
            f"online.reward_functions=[{out / 'reward.py'}:words]",
            f"train.max_steps={args.rollouts}",
            f"train.batch_size={args.prompts}",
            f"train.save_steps={args.rollouts}",
            "train.log_steps=1",
            f"online.group_size={args.group_size}",
            f"online.response_length={args.response_length}",
            f"online.generation_backend={backend}",
        ]
        cfg = load_config(None, settings, "grpo")
        start = time.perf_counter()
        summary = online.train(cfg, overwrite=True)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (out / backend / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r.get("step", 0) > 1]  # the first rollout warms up
        medians = {
            f"time/{p}": statistics.median([r[f"time/{p}"] for r in rows])
            for p in PHASES
            if rows and f"time/{p}" in rows[0]
        }
        steps = sum(r["time/step_seconds"] for r in rows)
        print(
            json.dumps(
                {
                    "backend": backend,
                    "preset": args.preset,
                    "responses": args.prompts * args.group_size,
                    "response_length": args.response_length,
                    "rollouts_timed": len(rows),
                    **medians,
                    "outside_rollouts_seconds": wall
                    - steps,  # start-up (the engine's too), the first rollout
                    "score_mean": summary.get("score_mean"),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
