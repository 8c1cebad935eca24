"""One ``rlhfkit`` run (a sharded online run) on the launch's processes, recording the weights each generate
call is given (the gathered copy) and the actor's whole weights after each update; the main process writes them.

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.generation_copy_worker ARGV.json OUT

ARGV.json: the command line, a JSON list. OUT/sampled-<i>.safetensors, one per generate call;
OUT/updated-<i>.safetensors, one per update.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlhfkit.engine import sharded
from rlhfkit.engine.accel import launch_rank
from rlhfkit.trainers.online import collect, loop
from tests.distributed.cli_runs import run_all


def _copy(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in weights.items()}


def main(argv_file: Path, out: Path) -> int:
    sampled_from: list[dict[str, torch.Tensor]] = []
    updated: list[dict[str, torch.Tensor]] = []
    real_generate, real_update = collect.generate_responses, loop.ppo_update

    def generate(model, *args, **kwargs):
        assert not sharded.is_sharded(model)  # the gathered copy
        sampled_from.append(_copy(model.state_dict()))
        return real_generate(model, *args, **kwargs)

    def update(ctx, *args, **kwargs):
        result = real_update(ctx, *args, **kwargs)
        updated.append(_copy(sharded.full_state_dict(ctx.roles.actor)))  # a collective: every process
        return result

    collect.generate_responses, loop.ppo_update = generate, update
    code = run_all([json.loads(argv_file.read_text())], reports=False)
    if code == 0 and launch_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        for name, records in (("sampled", sampled_from), ("updated", updated)):
            for i, weights in enumerate(records):
                save_file(weights, str(out / f"{name}-{i}.safetensors"))
    return code


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
