"""Stage 1 of a GRPO rollout (the trainer's prompt_batch and sample_rollout) on however many processes this runs
on: each process writes its rows' global prompt index, sample index and response tokens to
``OUT/tokens-<rank>.json``. Run in-process for one process (:func:`write_tokens`) or under ``torchrun
--nproc_per_node 2 -m tests.distributed.sampler_worker DATA OUT [key=value ...]`` for two."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rlhfkit.data import TokenLimits, prepare_examples
from rlhfkit.trainers.online import collect
from tests.trainers.online.online_fixtures import make_context, online_config


def write_tokens(data: Path, out: Path, *overrides: str) -> None:
    """Sample rollout 1 of a 4-prompt x 3-response GRPO run under ``overrides`` and write this process's rows."""
    paths = {"policy": data / "policy", "prompts": data / "prompts.jsonl", "rewards": data / "rewards.py"}
    cfg = online_config(paths, out / "run", "online.group_size=3", "online.response_length=10", *overrides)
    cfg.kind = "grpo"
    ctx = make_context(cfg)
    examples = prepare_examples(cfg.data.train_file, "prompts", ctx.tokenizer, TokenLimits(16))
    batch = collect.prompt_batch(ctx, examples, step=1)
    rollout = collect.sample_rollout(ctx, batch, step=None)
    streams = batch["streams"]
    rows = [
        {
            "prompt": int(p),
            "sample": int(k),
            "tokens": ids[mask].tolist(),
        }
        for p, k, ids, mask in zip(
            streams.prompt_index,
            streams.sample_index,
            rollout.response_ids,
            rollout.response_mask,
            strict=True,
        )
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tokens-{ctx.accelerator.process_index}.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    from rlhfkit.engine.accel import end_processes

    torch.set_num_threads(1)
    write_tokens(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:])
    end_processes()
