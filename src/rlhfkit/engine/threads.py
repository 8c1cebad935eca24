"""Torch thread count: every command sets it at start-up (docs/design.md, "Threads").

Two processes with two threads each on a two-core machine run small tensors many times slower than one
thread each (docs/performance.md), so the count is max(1, cores // local processes), unless the user set
``RLHFKIT_NUM_THREADS`` (or, in a process that no launcher started, ``OMP_NUM_THREADS``). Under a launcher
(``LOCAL_WORLD_SIZE`` set: torchrun, accelerate launch) ``OMP_NUM_THREADS`` is not read: torchrun sets it
to 1 for every process whether or not the user asked, which would leave 15 of 16 cores idle with two
processes.
"""

from __future__ import annotations

import os


def default_num_threads(local_processes: int | None = None) -> int:
    """max(1, usable cores // local processes); honours RLHFKIT_NUM_THREADS, and OMP_NUM_THREADS
    outside a launcher."""
    launched = "LOCAL_WORLD_SIZE" in os.environ
    for var in ("RLHFKIT_NUM_THREADS",) if launched else ("RLHFKIT_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var)
        if value and value.strip().isdigit() and int(value) > 0:
            return int(value)
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS / Windows
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_processes))


def set_num_threads(local_processes: int | None = None) -> int:
    """Set torch's intra-op thread count for this process and return it."""
    import torch

    n = default_num_threads(local_processes)
    torch.set_num_threads(n)
    return n
