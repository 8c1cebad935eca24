"""Sharded (FSDP2) runs of the SFT and reward trainers through the command line, in float64.

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.sharded_worker ROOT OUT

``ROOT`` holds ``sft/`` and ``reward/`` problems (:func:`tests.distributed.test_sharded.write_sharded_problems`).
Under ``OUT`` it trains, all in one launch (the process group is shared by the runs and left at the end):

    sft          sft, train.sharding=full_shard, 2 steps, a checkpoint after each
    sft-resumed  the same run stopped after step 1, then resumed (--resume) to step 2
    reward       reward, train.sharding=shard_grad_op, 2 steps, only the last checkpoint kept

Every model is float64 (:func:`tests.distributed.cli_runs.float64_models`), so that the comparison with one process is exact up to
summation order.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.distributed.cli_runs import run_all


def _args(kind: str, root: Path, out: Path, settings: tuple[str, ...], extra: tuple[str, ...]) -> list[str]:
    """Every key on the command line; the config file (``ROOT/run.yaml``, written before the launch, so that
    two processes never write it) sets the seed only."""
    return [
        "train",
        kind,
        "--config",
        str(root.parent / "run.yaml"),
        f"output_dir={out}",
        f"model.name_or_path={root / 'model'}",
        f"data.train_file={root / 'train.jsonl'}",
        f"data.eval_file={root / 'eval.jsonl'}",
        "model.dtype=float32",
        "logging.progress_bar=false",
        "train.learning_rate=3e-3",
        "train.lr_schedule=constant",
        *settings,
        *extra,
        "--overwrite",
    ]


def sft_run(root: Path, out: Path, *extra: str) -> list[str]:
    """As tests/trainers/sft_fixtures.py's sft_args."""
    settings = (
        "train.batch_size=8",
        "train.micro_batch_size=2",
        "data.max_prompt_length=16",
        "data.max_length=32",
    )
    return _args("sft", root, out, settings, extra)


def reward_run(root: Path, out: Path, *extra: str) -> list[str]:
    """As tests/trainers/test_reward.py's reward_args."""
    settings = (
        "train.batch_size=16",
        "train.micro_batch_size=4",
        "data.max_prompt_length=8",
        "data.max_length=24",
    )
    return _args("reward", root, out, settings, extra)


def runs(root: Path, out: Path, sharded: bool) -> list[list[str]]:
    """The command lines of the runs listed above (``sharded=False``: the one-process references)."""
    full = ("train.sharding=full_shard",) if sharded else ()
    grad_op = ("train.sharding=shard_grad_op",) if sharded else ()
    straight = [
        sft_run(root / "sft", out / "sft", "train.max_steps=2", "train.save_steps=1", *full),
        reward_run(
            root / "reward",
            out / "reward",
            "train.max_steps=2",
            "train.save_steps=1",
            "train.eval_steps=1",
            "train.keep_last_checkpoints=1",
            *grad_op,
        ),
    ]
    if not sharded:  # the reference needs no stop and resume
        return straight
    stopped = sft_run(root / "sft", out / "sft-resumed", "train.max_steps=1", "train.save_steps=1", *full)
    resumed = sft_run(root / "sft", out / "sft-resumed", "train.max_steps=2", "train.save_steps=1", *full)
    return [*straight, stopped, [*resumed[:-1], "--resume"]]


def main(root: Path, out: Path) -> int:
    return run_all(runs(root, out, sharded=True), float64=True)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
