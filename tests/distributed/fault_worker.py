"""One ``rlhfkit`` command line under torchrun with a fault planted in one process mid-run (a test hook).

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.fault_worker FAULT RANK STEP ARGV...

``FAULT`` is ``exception`` (a Python exception), ``kill`` (SIGKILL, as the out-of-memory killer does), ``hang``
(the process stays alive and never reaches its next collective, as a stuck device or a lost node, until the
launcher's SIGTERM ends it: that spares the test torchrun's 30 s wait before SIGKILL), ``engine`` (the
process's vLLM engine dies under rlhfkit's call to generate, ``online.generation_backend=vllm``) or ``stale``
(that engine is given other weights than the actor's: the sync's tensors tripled, the sync itself, a collective
under sharding, still made); it hits
process ``RANK`` as rollout ``STEP`` starts (after rollout ``STEP - 1`` and its checkpoint). The other
processes run the command unchanged. Exits as :func:`rlhfkit.cli.console` does.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import rlhfkit.cli as cli
from rlhfkit.engine import signals
from rlhfkit.trainers.online import loop


def _dead_engine(*args, **kwargs):
    raise RuntimeError("EngineCore died unexpectedly")


def _tripled_sync() -> None:
    """From now on this process's engine loads each of the actor's weights tripled."""
    from rlhfkit.rollout import vllm_engine

    real = vllm_engine.plain_weights

    def tripled(model):
        for name, tensor in real(model):
            yield name, tensor * 3 if tensor.is_floating_point() else tensor

    vllm_engine.plain_weights = tripled


def plant(fault: str, rank: int, step: int) -> None:
    sample = loop.sample_rollout

    def faulty(ctx, batch, clock, at):
        if at == step and ctx.accelerator.process_index == rank:
            if fault == "engine":  # the engine itself fails; rlhfkit's own code runs on unchanged
                ctx.engine.llm.generate = _dead_engine
                return sample(ctx, batch, clock, at)
            if fault == "stale":
                _tripled_sync()
                return sample(ctx, batch, clock, at)
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "hang":  # alive, holding its sockets, never at the next collective
                while signals.requested() is None:  # until the launcher's SIGTERM (else its SIGKILL, 30 s on)
                    time.sleep(0.2)
                os._exit(signals.exit_code(signals.requested()))
            raise RuntimeError(f"planted fault in process {rank} at rollout {step}")
        return sample(ctx, batch, clock, at)

    loop.sample_rollout = faulty


if __name__ == "__main__":
    fault, rank, step, *argv = sys.argv[1:]
    plant(fault, int(rank), int(step))
    sys.argv = [sys.argv[0], *argv]
    cli.console()
