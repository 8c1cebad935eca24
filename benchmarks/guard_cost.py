"""What the numerical guards cost a PPO rollout: the tiny preset, with and without the guard, alternating.

    python benchmarks/guard_cost.py                 # 12 rollouts x 2 runs, 1 torch thread
    python benchmarks/guard_cost.py --rollouts 20 --out /tmp/guard_cost

Builds the quickstart's tiny preset (the built-in task, a fresh tiny Llama as the policy; its folder, with a
fresh scalar head, as the reward model; GAE with a critic; 32 prompts x 48 tokens per rollout) and runs PPO
twice with the same seed, so that both runs sample the same rollouts: run A checks the odd rollouts and
skips the check on the even ones, run B the other way round. Every rollout is thus timed once with the
guard and once without, in the same process, interleaved, which cancels most of the drift of a loaded
machine. It prints the median seconds per rollout with and without, the median of the per-rollout
differences, and the time spent inside the guard's calls themselves (timed directly).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args(argv)
    os.environ["RLHFKIT_NUM_THREADS"] = str(args.threads)

    import torch

    torch.set_num_threads(args.threads)
    from rlhfkit.config import load_config
    from rlhfkit.engine import guards
    from rlhfkit.engine.metrics_writer import read_metrics
    from rlhfkit.quickstart.pipeline import PRESETS
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files
    from rlhfkit.trainers import online

    root = Path(args.out or tempfile.mkdtemp(prefix="guard_cost_"))
    p = PRESETS["tiny"]
    files = prepare_task_files(get_task("reviews", seed=0), root / "task", p.model, num_sft_eval=16)
    inside: dict[str, list[float]] = {"A": [], "B": []}

    def alternating(run: str, guarded_parity: int):
        class Alternating(guards.FiniteGuard):
            def check(self, step, quantities, *, can_skip=True):
                if step % 2 != guarded_parity:
                    return False
                start = time.perf_counter()
                try:
                    return super().check(step, quantities, can_skip=can_skip)
                finally:
                    inside[run].append(time.perf_counter() - start)

            def check_agreed(self, step, numbers):
                if step % 2 == guarded_parity:
                    start = time.perf_counter()
                    super().check_agreed(step, numbers)
                    inside[run][-1] += time.perf_counter() - start

        return Alternating

    steps: dict[str, dict[int, float]] = {}
    for run, parity in (("A", 1), ("B", 0)):
        cfg = load_config(
            None,
            [
                f"output_dir={root / run}",
                f"model.name_or_path={files['init_model']}",
                f"data.train_file={files['prompts_train']}",
                "data.max_prompt_length=32",
                f"online.reward_model={files['init_model']}",
                f"online.response_length={p.response_length}",
                f"train.max_steps={args.rollouts}",
                f"train.batch_size={p.ppo_batch}",
                f"train.learning_rate={p.ppo_lr}",
                "online.kl_coef=0.1",
                f"train.save_steps={args.rollouts}",
                "logging.progress_bar=false",
            ],
            "ppo",
        )
        online.FiniteGuard = alternating(run, parity)
        online.train(cfg, overwrite=True)
        steps[run] = {r["step"]: r["time/step_seconds"] for r in read_metrics(root / run / "metrics.jsonl")}

    with_guard, without = [], []
    for step in range(2, args.rollouts + 1):  # rollout 1 warms up
        guarded, plain = ("A", "B") if step % 2 == 1 else ("B", "A")
        with_guard.append(steps[guarded][step])
        without.append(steps[plain][step])
    diffs = [a - b for a, b in zip(with_guard, without, strict=True)]
    calls = inside["A"] + inside["B"]
    print(
        f"tiny preset PPO, {args.rollouts} rollouts x 2 runs, {args.threads} torch thread(s), {sys.platform}"
    )
    print(
        f"seconds per rollout, median: with guard {statistics.median(with_guard):.3f}, without {statistics.median(without):.3f}"
    )
    print(
        f"per-rollout difference (with - without), median {statistics.median(diffs) * 1e3:+.1f} ms, "
        f"range {min(diffs) * 1e3:+.1f} .. {max(diffs) * 1e3:+.1f} ms"
    )
    print(
        f"time inside the guard per rollout: median {statistics.median(calls) * 1e6:.0f} us, "
        f"max {max(calls) * 1e6:.0f} us ({len(calls)} rollouts)"
    )


if __name__ == "__main__":
    main()
