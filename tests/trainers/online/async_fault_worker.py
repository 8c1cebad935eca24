"""One ``rlhfkit`` command line of an asynchronous run under torchrun, with one side killed mid-run (a test hook).

    torchrun --standalone --nproc_per_node 2 -m tests.trainers.online.async_fault_worker SIDE STEP ARGV...

``SIDE`` is ``generator`` (SIGKILL as it starts sampling rollout ``STEP``), ``trainer`` (SIGKILL as it starts
receiving rollout ``STEP``), ``hang`` (the generator stays alive, holding its sockets, and never sends rollout
``STEP``, until the launcher's SIGTERM) or ``none``. Exits as :func:`rlhfkit.cli.console` does.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import rlhfkit.cli as cli
from rlhfkit.engine import signals
from rlhfkit.trainers.online import async_loop


def plant(side: str, step: int) -> None:
    if side in ("generator", "hang"):
        sample = async_loop.sample_rollout

        def killed(ctx, batch, clock, at):
            if at == step and side == "hang":
                while signals.requested() is None:
                    time.sleep(0.2)
                os._exit(signals.exit_code(signals.requested()))
            if at == step:
                os.kill(os.getpid(), signal.SIGKILL)
            return sample(ctx, batch, clock, at)

        async_loop.sample_rollout = killed
    elif side == "trainer":
        collect = async_loop.AsyncTrainer.collect

        def killed_collect(self, ctx, batch, clock, at):
            if at == step:
                os.kill(os.getpid(), signal.SIGKILL)
            return collect(self, ctx, batch, clock, at)

        async_loop.AsyncTrainer.collect = killed_collect


if __name__ == "__main__":
    side, step, *argv = sys.argv[1:]
    plant(side, int(step))
    sys.argv = [sys.argv[0], *argv]
    cli.console()
