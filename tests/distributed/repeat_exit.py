"""Repeat two-process runs of every trainer and count the clean ends (exit 0, no abort, one log line each).

    python -m tests.distributed.repeat_exit --runs 20 [--trainers sft sft-fsdp reward prm ppo grpo rloo] [--work DIR]

Each run is ``torchrun --standalone --nproc_per_node 2 -m rlhfkit.cli train KIND ... --overwrite`` on a tiny
problem (one optimizer step or rollout, a checkpoint, ``final/``); ``sft-fsdp`` is SFT with
``train.sharding=full_shard`` (FSDP2: sharded checkpoint, gathered ``final/``). A run is clean when torchrun exits 0,
neither process printed "terminate called" (the C++ abort of a process group left behind), and the run
folder holds one metrics line. Too slow for the suite (a launch costs seconds); run it after changing how
processes start or end. Prints one line per run and a count per trainer; exits 1 unless every run was clean.
The whole stderr of a run that was not clean is kept as ``WORK/not-clean-KIND-I.stderr``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rlhfkit.engine.metrics_writer import read_metrics
from tests.distributed.test_data_parallel import torchrun, write_problems


def arguments(kind: str, problems: Path, out: Path) -> list[str]:
    config = out.parent / f"{out.name}.yaml"
    config.write_text("seed: 0\nlogging:\n  progress_bar: false\n")
    if kind == "sft-fsdp":
        return [*arguments("sft", problems, out), "train.sharding=full_shard"]
    common = [
        "train",
        kind,
        "--config",
        str(config),
        "--overwrite",
        f"output_dir={out}",
        "train.max_steps=1",
        "train.batch_size=4",
        "data.max_prompt_length=16",
    ]
    if kind in ("ppo", "grpo", "rloo"):
        data = problems / "online"
        return [
            *common,
            f"model.name_or_path={data / 'policy'}",
            f"data.train_file={data / 'prompts.jsonl'}",
            f"online.reward_model={data / 'reward'}",
            "online.group_size=2",
            "online.response_length=6",
            "online.ppo_epochs=1",
        ]
    data = problems / kind
    return [
        *common,
        f"model.name_or_path={data / 'model'}",
        f"data.train_file={data / 'train.jsonl'}",
        "data.max_length=40",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "--trainers", nargs="+", default=["sft", "sft-fsdp", "reward", "prm", "ppo", "grpo", "rloo"]
    )
    parser.add_argument("--work", type=Path, default=Path("runs/repeat-exit"))
    args = parser.parse_args(argv)
    problems = args.work / "problems"
    if not problems.exists():
        write_problems(problems)
    clean: dict[str, int] = {}
    for kind in args.trainers:
        clean[kind] = 0
        for i in range(1, args.runs + 1):
            out = args.work / f"run-{kind}"
            start = time.perf_counter()
            proc = torchrun("-m", "rlhfkit.cli", *arguments(kind, problems, out))
            aborted = "terminate called" in proc.stderr
            lines = len(read_metrics(out / "metrics.jsonl")) if (out / "metrics.jsonl").exists() else 0
            ok = proc.returncode == 0 and not aborted and lines == 1
            clean[kind] += ok
            if not ok:  # the whole stderr of both processes, for the cause (the line below shows its end)
                (args.work / f"not-clean-{kind}-{i}.stderr").write_text(proc.stderr)
            print(
                f"{kind} run {i}: exit {proc.returncode}, abort {aborted}, metrics lines {lines}, "
                f"{time.perf_counter() - start:.1f} s"
                + ("" if ok else f" NOT CLEAN: {proc.stderr[-300:]!r}"),
                flush=True,
            )
    print("clean ends: " + ", ".join(f"{kind} {n}/{args.runs}" for kind, n in clean.items()), flush=True)
    return 0 if all(n == args.runs for n in clean.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
