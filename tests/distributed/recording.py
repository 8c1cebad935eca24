"""What a launch of :mod:`tests.distributed.cli_runs` records, when its plan asks (``"record": FOLDER``): the
weights every generate call of an online run is given (under sharding: the gathered copy) and the actor's
whole weights after each update, written by the main process to ``FOLDER/run-<i>/sampled-<k>.safetensors`` and
``updated-<k>.safetensors`` for the plan's i-th run; and the rows of each rollout an update trains on (its
``ROLLOUT_ROWS``), written by every process ``r`` to ``rollout<r>-<k>.safetensors``."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from rlhfkit.engine import sharded
from rlhfkit.engine.accel import launch_rank
from rlhfkit.trainers.online import collect, loop

ROLLOUT_ROWS = ("query_ids", "query_mask", "response_ids", "mask", "response_mask")


def _copy(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in weights.items()}


class Recorder:
    """Installs the two spies; :meth:`write` saves and forgets what one run recorded."""

    def __init__(self) -> None:
        self.sampled_from: list[dict[str, torch.Tensor]] = []
        self.updated: list[dict[str, torch.Tensor]] = []
        self.rollouts: list[dict[str, torch.Tensor]] = []
        real_generate, real_update = collect.generate_responses, loop.ppo_update

        def generate(model, *args, **kwargs):
            self.sampled_from.append(_copy(model.state_dict()))
            return real_generate(model, *args, **kwargs)

        def update(ctx, rollout, *args, **kwargs):
            self.rollouts.append(_copy({name: getattr(rollout, name) for name in ROLLOUT_ROWS}))
            result = real_update(ctx, rollout, *args, **kwargs)
            actor = ctx.roles.actor  # the whole weights: a collective when sharded (every process)
            self.updated.append(
                _copy(sharded.full_state_dict(actor) if sharded.is_sharded(actor) else actor.state_dict())
            )
            return result

        collect.generate_responses, loop.ppo_update = generate, update

    def write(self, folder: Path) -> None:
        rank = launch_rank()
        folder.mkdir(parents=True, exist_ok=True)
        for k, rows in enumerate(self.rollouts):
            save_file(rows, str(folder / f"rollout{rank}-{k}.safetensors"))
        if rank == 0:
            for name, records in (("sampled", self.sampled_from), ("updated", self.updated)):
                for k, weights in enumerate(records):
                    save_file(weights, str(folder / f"{name}-{k}.safetensors"))
        self.sampled_from.clear()
        self.updated.clear()
        self.rollouts.clear()


def read(folder: Path, name: str) -> list[dict[str, torch.Tensor]]:
    """The records ``name`` (``sampled``, ``updated`` or ``rollout<rank>``) of one run, in order."""
    from safetensors.torch import load_file

    files = sorted(folder.glob(f"{name}-*.safetensors"), key=lambda p: int(p.stem.split("-")[1]))
    return [load_file(str(f)) for f in files]
