"""The copy a sharded actor generates from holds the weights of the current rollout, on two processes.

A sharded GRPO run of two rollouts (FSDP2, 2 CPU processes, gloo: :mod:`tests.distributed.generation_copy_worker`)
records the weights every generate call is given and the actor's whole weights after each update. (On one
process the gathered weights are the actor's own storage, so a copy gathered once would still follow the
actor there; on two it is a new buffer, and a stale copy shows.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.test_data_parallel import torchrun
from tests.trainers.online.online_fixtures import online_cli_args, write_online_problem


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
def test_each_rollout_samples_from_the_actors_weights_as_they_stand_then(tmp_path):
    paths = write_online_problem(tmp_path / "problem", reward_model=False)
    extra = ("train.sharding=full_shard", "train.max_steps=2", "logging.progress_bar=false")
    argv = tmp_path / "argv.json"
    argv.write_text(json.dumps(online_cli_args(paths, tmp_path / "run", *extra, kind="grpo")))
    proc = torchrun("-m", "tests.distributed.generation_copy_worker", str(argv), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-4000:]

    def records(name: str) -> list[dict[str, torch.Tensor]]:
        files = sorted(
            (tmp_path / "out").glob(f"{name}-*.safetensors"), key=lambda p: int(p.stem.split("-")[1])
        )
        return [load_file(str(f)) for f in files]

    sampled, updated = records("sampled"), records("updated")
    distinct = [w for i, w in enumerate(sampled) if i == 0 or not _same(w, sampled[i - 1])]
    assert len(updated) == 2 and len(distinct) == 2, (len(updated), len(distinct))  # one set per rollout
    start = load_file(str(Path(paths["policy"]) / "model.safetensors"))
    assert _same(distinct[0], start) and _same(distinct[1], updated[0]) and not _same(updated[0], start)
