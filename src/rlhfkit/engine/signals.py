"""A graceful stop on SIGTERM and SIGINT (Ctrl-C): finish the step, save a checkpoint, exit.

While a command trains (:func:`graceful_stop` around it), the first SIGTERM or SIGINT only records that a
stop was asked for and prints one line. The trainers read it once per step through
:class:`rlhfkit.engine.guards.FiniteGuard`, which agrees on it across processes in the all-reduce it already
makes, so that every process of a multi-process run stops after the same step; that step is checkpointed
and the run ends with :class:`rlhfkit.errors.RunStopped`, whose exit code is the shells' convention for a
death by that signal, 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), so that scripts and
schedulers see the run as interrupted. ``--resume`` continues from that checkpoint.

A second signal stops at once (exit 128 + signal, no checkpoint of the current step; the previous
checkpoint is complete or absent, since checkpoints are written atomically, and the run-folder lock is
released by the operating system).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rlhfkit.errors import RunStopped

HANDLED = (signal.SIGINT, signal.SIGTERM)
_requested: int | None = None


def requested() -> int | None:
    """The number of the signal that asked this process to stop, or None."""
    return _requested


def exit_code(signum: int) -> int:
    """128 + the signal's number: what a shell reports for a process that signal ended."""
    return 128 + int(signum)


@contextmanager
def graceful_stop() -> Iterator[None]:
    """Handle SIGTERM and SIGINT as described in the module docstring for the duration of the block.

    Outside the main thread (where Python cannot install handlers) the block runs unchanged.
    """
    global _requested
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _handler) for sig in HANDLED}
    _requested = None
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _requested = None


def stopped(signum: int, step: int) -> RunStopped:
    """The error a trainer raises after it checkpointed ``step`` because of signal ``signum``."""
    return RunStopped(
        f"{signal.Signals(signum).name} received; stopped after step {step}, which is checkpointed; "
        "run the same command with --resume to continue",
        exit_code=exit_code(signum),
    )


def _handler(signum: int, frame) -> None:
    global _requested
    name = signal.Signals(signum).name
    if _requested is not None:
        print(f"rlhfkit: {name} again: stopping now", file=sys.stderr, flush=True)
        os._exit(exit_code(signum))
    _requested = signum
    if int(os.environ.get("RANK", "0") or 0) == 0:
        print(
            f"rlhfkit: {name} received: finishing the current step, then saving a checkpoint and "
            "stopping (send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
