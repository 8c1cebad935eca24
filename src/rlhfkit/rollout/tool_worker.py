"""Tool calls in processes that can be stopped: one worker process per episode, killed at the timeout.

Python cannot stop a thread, so a tool run in one keeps running after its timeout: it spins, holds the
interpreter lock, changes its environment after the model was told the call failed, and keeps the process
from exiting. Here every episode's tools run in a process of their own (:class:`ToolWorker`), forked from the
trainer when the episode starts, so it has the trainer's imports and the user's functions without pickling
them. The episode's environment is made, reset and called there, and lives there until the episode's scores
are read. A call that passes its timeout kills the whole process group (the worker and whatever it started),
and the episode's environment with it: a killed environment is never called again, so no state the model was
told had failed can be read later.

Limits of a worker: ``memory_mb`` of address space on top of what it had when forked (``RLIMIT_AS``: a
forked worker starts with the trainer's mappings, which it shares and does not add to); the wall-clock
timeout of each call. A worker gets ``SIGKILL`` when the trainer exits or dies (``PR_SET_PDEATHSIG`` on Linux,
and an ``atexit`` hook), so a hanging tool never keeps the run from exiting.

What crosses between the processes is plain data: the call's name and JSON arguments in, the result's text
out (at most ``max_chars`` characters, with the full length), or the exception's type and message.
"""

from __future__ import annotations

import atexit
import ctypes
import inspect
import os
import pickle
import resource
import signal
import socket
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from rlhfkit.rollout.tool_format import result_text

MAX_RESULT_CHARS = 1 << 20  # a result longer than this is cut in the worker, before it crosses the pipe

_LIVE: weakref.WeakSet = weakref.WeakSet()  # workers not yet closed, killed at exit


class WorkerDied(Exception):
    """The worker process ended without answering (killed, ``os._exit``, a crash, a memory limit)."""

    def __init__(self, how: str):
        super().__init__(how)
        self.how = how


@dataclass
class Reply:
    """A worker's answer: ``ok`` with ``value`` (a call's text, ``reset``'s text, ``get_reward``'s value), or
    not ok with ``error`` (``"TypeName: message"``) and its ``cause``; ``length`` is a call's full text
    length."""

    ok: bool
    value: Any = None
    error: str = ""
    length: int = 0
    cause: str = "exception"  # when not ok: exception | unknown_tool | malformed_arguments


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux), so an orphaned worker never lingers."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _address_space() -> int:
    """This process's mapped address space in bytes (VmSize), or 0 when it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _child_setup(parent: int, memory_mb: int | None) -> None:
    os.setsid()  # its own process group: a kill takes whatever the tool started too
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the trainer's handlers are not the worker's
        signal.signal(sig, signal.SIG_DFL)
    if memory_mb is not None and hasattr(resource, "RLIMIT_AS"):
        used = _address_space()
        if used:
            limit = used + memory_mb * (1 << 20)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _serve(conn: Connection, setup: Callable[[], dict[str, Callable]]) -> None:
    """The worker's loop: ``("setup",)`` makes its tools; then ``("call", name, arguments, max_chars)``,
    ``("run", fn_name, args)`` (one named method of its state, e.g. ``reset``) until ``("close",)``."""
    state: dict[str, Any] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        op = message[0]
        if op == "close":
            return
        try:
            if op == "setup":
                state = setup()
                reply = Reply(True, sorted(state.get("tools", {})))
            elif op == "call":
                _, name, arguments, max_chars = message
                reply = _call(state.get("tools", {}), name, arguments, max_chars, result_text)
            elif op == "run":  # a hook of the state: reset, get_reward, an environment attribute
                _, hook, args = message
                reply = Reply(True, state[hook](*args))
            else:
                reply = Reply(False, error=f"ValueError: unknown request {op!r}")
        except BaseException as e:  # the tool's own failure (also SystemExit, KeyboardInterrupt), handed back
            reply = Reply(False, error=f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # a value that cannot cross
            conn.send(Reply(False, error=f"TypeError: the value cannot be sent back ({e})"))


def _call(tools: dict[str, Callable], name: str, arguments: dict, max_chars: int, to_text) -> Reply:
    fn = tools.get(name)
    if fn is None:
        known = ", ".join(sorted(tools)) or "none"
        return Reply(False, error=f"unknown tool; the tools are {known}", cause="unknown_tool")
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        return Reply(False, error=f"bad arguments: {e}", cause="malformed_arguments")
    except ValueError:  # no signature to check against (a builtin): let the call tell
        pass
    text = to_text(fn(**arguments))
    return Reply(True, text[:max_chars], length=len(text))


class ToolWorker:
    """One forked process that holds an episode's tools (and environment) and runs its calls.

    Args:
        setup: runs IN the worker, once: returns ``{"tools": name -> callable, <hook>: callable, ...}``
            (hooks are what :meth:`run` may call: ``reset``, ``get_reward``, ``getattr``).
        memory_mb: address space the worker may add to what it had when forked (None = no limit).
    """

    def __init__(self, setup: Callable[[], dict[str, Any]], memory_mb: int | None = None):
        ours, theirs = socket.socketpair()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                ours.close()
                for other in list(_LIVE):  # the other episodes' pipes are not this worker's
                    other.conn.close()
                _child_setup(parent, memory_mb)
                _serve(Connection(theirs.detach()), setup)
            except BaseException:
                code = 1
            finally:
                os._exit(code)  # never the trainer's atexit hooks or buffered output
        theirs.close()
        self.pid = pid
        self.conn = Connection(ours.detach())
        self.alive = True
        self.death: str | None = None  # how it ended, when it was not closed
        _LIVE.add(self)
        self._finalizer = weakref.finalize(self, _kill, pid, self.conn)

    # --- asking --------------------------------------------------------------------------------------------

    def send(self, *message: Any) -> None:
        if not self.alive:
            raise WorkerDied(self.death or "closed")
        try:
            self.conn.send(message)
        except OSError:
            self.kill("died")
            raise WorkerDied(self.death) from None

    def receive(self) -> Reply:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.kill("died")
            raise WorkerDied(self.death) from None

    def ask(self, *message: Any, timeout: float) -> Reply:
        """Send one request and wait at most ``timeout`` seconds for the reply; past it the worker is killed
        and :class:`TimeoutError` raised. :class:`WorkerDied` when it ended without answering."""
        self.send(*message)
        if not self.conn.poll(timeout):
            self.kill("timeout")
            raise TimeoutError(f"no answer within {timeout:g} s")
        return self.receive()

    def run(self, hook: str, *args: Any, timeout: float) -> Reply:
        return self.ask("run", hook, args, timeout=timeout)

    # --- ending --------------------------------------------------------------------------------------------

    def kill(self, why: str = "killed") -> None:
        """SIGKILL the worker's process group and reap it."""
        if self.alive:
            self.alive = False
            self.death = why
            self._finalizer()

    def close(self) -> None:
        """Ask the worker to leave, then kill what is left (a tool's own children included)."""
        if self.alive:
            try:
                self.conn.send(("close",))
            except OSError:
                pass
            self.kill("closed")


def _kill(pid: int, conn: Connection) -> None:
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    conn.close()


@atexit.register
def _kill_all() -> None:
    for worker in list(_LIVE):
        worker.kill("exit")


def serve_turn(
    jobs: Sequence[tuple[ToolWorker, Sequence[tuple[str, dict]]]], *, timeout: float, max_chars: int
) -> list[list[Reply | str]]:
    """Run the calls of one turn, every worker's at once: each worker runs its own calls in order, each within
    ``timeout`` seconds. A worker whose call passes its timeout is killed, and its later calls are not run.

    Args:
        jobs: (worker, [(tool name, arguments), ...]) per episode.
        timeout: seconds per call.
        max_chars: the most characters of a result that cross back (the worker cuts longer ones).

    Returns:
        per job, per call: a :class:`Reply`, or ``"timeout"`` (this call was killed), ``"died"`` (the worker
        ended without answering: a crash, ``os._exit``, the memory limit) or ``"not_run"`` (an earlier call of
        the same worker timed out or died).
    """
    out: list[list[Reply | str]] = [["not_run"] * len(calls) for _, calls in jobs]
    next_call = [0] * len(jobs)
    deadline: dict[int, float] = {}

    def start(j: int) -> None:  # send job j's next call, if it has one
        worker, calls = jobs[j]
        if next_call[j] == len(calls):
            return
        name, arguments = calls[next_call[j]]
        try:
            worker.send("call", name, arguments, max_chars)
        except WorkerDied:
            out[j][next_call[j]] = "died"
            next_call[j] = len(calls)
            return
        deadline[j] = time.monotonic() + timeout

    for j in range(len(jobs)):
        start(j)
    while deadline:
        now = time.monotonic()
        waiting = {jobs[j][0].conn: j for j in deadline}
        left = max(0.0, min(deadline.values()) - now)
        ready = wait(list(waiting), timeout=left)
        for conn in ready:
            j = waiting[conn]
            worker = jobs[j][0]
            try:
                out[j][next_call[j]] = worker.receive()
            except WorkerDied:
                out[j][next_call[j]] = "died"
                next_call[j] = len(jobs[j][1])
                del deadline[j]
                continue
            next_call[j] += 1
            del deadline[j]
            start(j)
        now = time.monotonic()
        for j in [j for j, d in deadline.items() if d <= now]:
            if jobs[j][0].conn.poll(0):  # answered at the last moment
                continue
            jobs[j][0].kill("timeout")
            out[j][next_call[j]] = "timeout"
            next_call[j] = len(jobs[j][1])
            del deadline[j]
    return out
