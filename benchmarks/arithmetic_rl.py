"""RL on the arithmetic task from a trained SFT policy: greedy held-out exact match and step accuracy after
GRPO, RLOO or PPO (optionally with a PRM's step rewards, or an outcome reward model instead of the rule
reward), with the quickstart's settings.

    rlhfkit quickstart --task arithmetic --out runs/arith          # task/, sft/, prm/ (and the RL stages)
    python benchmarks/arithmetic_rl.py --base runs/arith --kind grpo --seed 0
    python benchmarks/arithmetic_rl.py --base runs/arith --kind ppo --seed 1 --prm runs/arith/prm/final
    python benchmarks/arithmetic_rl.py --base runs/arith --kind ppo --seed 1 --orm runs/arith/orm/final
    python benchmarks/arithmetic_rl.py --base runs/arith --kind ppo --seed 1 --train-orm   # trains BASE/orm first

Prints one JSON line: the settings, the training seconds and the held-out figures (256 prompts, greedy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from rlhfkit.config import config_from
from rlhfkit.engine.threads import set_num_threads
from rlhfkit.quickstart.verifiable import VERIFIABLE_PRESETS, measure, rl_overrides, train_orm
from rlhfkit.tasks import get_task
from rlhfkit.trainers import online


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="a quickstart folder with task/ and sft/final")
    parser.add_argument("--kind", choices=("grpo", "rloo", "ppo"), default="grpo")
    parser.add_argument("--seed", type=int, default=0, help="the RL run's seed (the task's stays 0)")
    parser.add_argument("--rollouts", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--prm", default=None, help="a PRM folder: its step rewards are added (ppo)")
    parser.add_argument("--orm", default=None, help="an outcome reward model folder: the only reward (ppo)")
    parser.add_argument(
        "--train-orm", action="store_true", help="train the quickstart's ORM into BASE/orm first, then use it"
    )
    parser.add_argument("--out", default=None, help="run folder (default: BASE/bench_KIND_SEED)")
    args = parser.parse_args()
    set_num_threads()  # RLHFKIT_NUM_THREADS, else cores per process
    base = Path(args.base)
    task = get_task("arithmetic", seed=0)
    preset = dataclasses.replace(VERIFIABLE_PRESETS["tiny"], rollouts=args.rollouts, rl_lr=args.lr)
    if args.train_orm:
        start = time.perf_counter()
        orm_summary = train_orm(base, base / "sft" / "final", task, preset, seed=0, overwrite=True)
        print(
            json.dumps({"orm_seconds": time.perf_counter() - start, **orm_summary}, default=str), flush=True
        )
        args.orm = str(base / "orm" / "final")
    settings = rl_overrides(
        base / "sft" / "final",
        base / "task" / "prompts_train.jsonl",
        preset,
        args.seed,
        args.kind,
        args.prm,
        args.orm,
    )
    tag = "_prm" if args.prm else "_orm" if args.orm else ""
    out = Path(args.out or base / f"bench_{args.kind}{tag}_{args.seed}")
    start = time.perf_counter()
    online.train(config_from(args.kind, out, settings), overwrite=True)
    seconds = time.perf_counter() - start
    figures = measure(out / "final", task, base / "task" / "prompts_eval.jsonl", 256, preset.response_length)
    print(json.dumps({**vars(args), "train_seconds": seconds, "after": figures}), flush=True)


if __name__ == "__main__":
    main()
