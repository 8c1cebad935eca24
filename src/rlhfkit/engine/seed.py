"""Seeding and the capture / restore of every global random stream a run draws from.

The streams are python's ``random``, numpy's legacy global generator, torch's CPU generator and, when CUDA
is available, every CUDA device's generator. A resumed run restores them from its checkpoint so that it
draws the same numbers an uninterrupted run would have drawn (docs/known-bugs.md, 11). Generators a trainer
owns (a ``torch.Generator`` for its sampler, say) belong in its trainer state instead.

The captured state is plain data: ints, floats, lists and CPU tensors, so that the checkpoint engine can
write it as JSON + safetensors (never pickle).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def get_rng_state() -> dict[str, Any]:
    """The state of every global generator: ``{"python", "numpy", "torch", "cuda"?}``."""
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": np_state["state"]["key"].tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` captured.

    CUDA states are restored device by device for the devices present; a checkpoint written on a machine
    with a GPU resumes on one without it (the CPU streams still continue exactly).
    """
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": npy["bit_generator"],
            "state": {"key": np.asarray(npy["key"], dtype=np.uint32), "pos": npy["pos"]},
            "has_gauss": npy["has_gauss"],
            "gauss": npy["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
