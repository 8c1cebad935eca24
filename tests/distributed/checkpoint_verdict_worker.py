"""Two sharded processes, a corrupt newest sharded checkpoint, and a checksum failure seen by one process only.

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.checkpoint_verdict_worker FOLDER

Each process writes ``FOLDER/rank-R.json``: the checkpoint ``resume_checkpoint`` picks after a shard file of
the newest one was damaged, and the line each ``load_roles`` stopped with, first for that damage (seen by every
process) and then, the file repaired, for a checksum failure that only process 1 sees (its reading of one
shard file made to differ): every process must stop with the same line, none left waiting in a collective.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rlhfkit.engine import checkpoint, sharded
from rlhfkit.errors import CheckpointError
from tests.helpers import tiny_llama


def _roles():
    model = sharded.shard_model(tiny_llama(seed=0).train(), "full_shard")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(4, 48, (2, 9), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return {"model": model}, {"model": optimizer}


def _load_line(step_dir: Path) -> str | None:
    models, optimizers = _roles()
    try:
        sharded.load_roles(step_dir, models, optimizers, {})
    except CheckpointError as e:
        return str(e)
    return None


def main(folder: Path) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    root = folder / "checkpoints"
    models, optimizers = _roles()
    for step in (1, 2):
        sharded.save_roles(root, step, models, optimizers, {}, {"seen": step}, main_process=rank == 0)
    data = sorted((root / "step-2.sharded").glob("*.distcp"))[0]
    pristine = data.read_bytes()
    if rank == 0:
        damaged = bytearray(pristine)
        damaged[len(damaged) // 2] ^= 0x01
        data.write_bytes(bytes(damaged))
    torch.distributed.barrier()
    picked = checkpoint.resume_checkpoint(root, announce=rank == 0)
    corrupt = _load_line(root / "step-2")
    torch.distributed.barrier()
    if rank == 0:
        data.write_bytes(pristine)
    torch.distributed.barrier()
    if rank == 1:  # only this process reads the shard file as other bytes than were written
        real = checkpoint.file_sha256
        checkpoint.file_sha256 = lambda path: "0" * 64 if Path(path) == data else real(path)
    one_sided = _load_line(root / "step-2")
    result = {"picked": picked.name if picked else None, "corrupt": corrupt, "one_sided": one_sided}
    (folder / f"rank-{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
