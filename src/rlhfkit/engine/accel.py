"""Devices and processes through accelerate.

One :class:`accelerate.Accelerator` per run. rlhfkit does its own loss normalisation (``aggregate_loss``
with the whole minibatch as normaliser), so gradient accumulation here is plain: every micro-batch's
loss is already divided by the global token (or sequence) count and the gradients are summed; under data
parallelism DDP *averages* gradients over processes, so each process multiplies its loss by the number of
processes (:func:`dp_scale`) to keep the sum.

Launch on one process with ``rlhfkit ...``; on many with ``accelerate launch -m rlhfkit.cli ...``.
"""

from __future__ import annotations

import torch


def make_accelerator(cpu: bool | None = None):
    """An Accelerator with no mixed-precision wrapping (the dtype is chosen when the weights are loaded:
    :func:`rlhfkit.models.resolve_dtype`)."""
    from accelerate import Accelerator

    if cpu is None:
        cpu = not torch.cuda.is_available()
    return Accelerator(cpu=cpu, mixed_precision="no", step_scheduler_with_optimizer=False)


def dp_scale(accelerator) -> float:
    """Multiply a globally normalised loss by this before backward, so DDP's gradient mean becomes a sum."""
    return float(accelerator.num_processes)
