"""Model-written code in a sandbox: the ``rlhfkit:python`` tool and the ``rlhfkit:code_tests`` reward.

Code that a policy writes runs in bubblewrap (``bwrap``, Debian's ``bubblewrap``), as math and code agents
need (:func:`python`, named ``rlhfkit:python`` in ``online.tools``; :func:`code_tests`, named
``rlhfkit:code_tests`` in ``online.reward_functions``). Each run gets:

- no network (its own network namespace, loopback only), its own process, IPC and host-name namespaces
  (it sees and can signal only its own processes), a read-only view of the machine's files, a fresh
  writable ``/tmp`` of ``Limits.tmp_mb`` in memory as its working folder, and an empty environment (no
  variable of the trainer's: no token, no path);
- limits: ``Limits.timeout`` seconds of wall clock (the whole process group is killed) and as much CPU time,
  ``Limits.memory_mb`` of address space, ``Limits.processes`` processes, ``Limits.file_mb`` per file written,
  ``Limits.output_bytes`` of output read back (the rest is discarded and the run stopped);
- as root, a user of its own (uid ``SANDBOX_UIDS`` + the starting process's pid, no account, no files):
  the process limit does not bind root, and a user shared between runs would share one process count, so a
  fork bomb in one run would stop the others from starting. The interpreter is the first of the trainer's
  own and the system's ``python3`` that such a user can run in the sandbox (:func:`interpreter`); model code
  gets the standard library only.

``online.sandbox: none`` runs the code as a child process with the same limits but none of the namespaces
(warned in the run's log and report). What this does NOT protect against: a kernel exploit (the sandbox shares
the machine's kernel), reading world-readable files of the machine, and denial of service through the
machine's shared resources within the limits (CPU for the timeout, memory up to the limits). For code from
untrusted models at scale, run it in a container or VM service instead (docs/tools.md).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from rlhfkit.errors import ConfigError

SANDBOX_UIDS = 2_000_000_000  # as root, a run's user is this + the pid of the process that starts it
PACKAGE = "bubblewrap"  # Debian's (and most distributions') package of bwrap


# Built-in functions by their short names: model-written code run in the sandbox (this module).
BUILT_IN = {
    "rlhfkit:python": "rlhfkit.rollout.sandbox:python",  # a tool (online.tools)
    "rlhfkit:code_tests": "rlhfkit.rollout.sandbox:code_tests",  # a reward function
}


def uses_sandbox(specs: Sequence) -> bool:
    """Whether any of ``specs`` (tools or reward functions) runs model-written code in the sandbox."""
    return any(
        isinstance(s, str) and BUILT_IN.get(s, s).startswith("rlhfkit.rollout.sandbox:") for s in specs
    )


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use (module docstring)."""

    timeout: float = 10.0
    memory_mb: int = 1024
    processes: int = 32
    output_bytes: int = 16_384
    file_mb: int = 16
    tmp_mb: int = 64


@dataclass(frozen=True)
class Outcome:
    """How a run ended: its ``stdout`` / ``stderr`` (cut at the output limit), its ``exit_code`` (None when a
    signal ended it: ``signal``), and ``limit``: the limit that stopped it (``"timeout"``, ``"output"``) or
    None."""

    stdout: str
    stderr: str
    exit_code: int | None
    signal: str | None = None
    limit: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None


@dataclass
class Settings:
    """The run's sandbox (``online.sandbox``, ``online.tool_timeout``, ``online.tool_memory_mb``), set once at
    start-up by :func:`configure`; the tool and the reward read it."""

    mode: Literal["bwrap", "none"] = "bwrap"
    limits: Limits = Limits()


SETTINGS = Settings()


def configure(mode: Literal["bwrap", "none"] = "bwrap", **limits) -> None:
    """Set the run's sandbox and check that it works (:func:`check`); ``limits`` are :class:`Limits` fields."""
    SETTINGS.mode, SETTINGS.limits = mode, replace(Limits(), **limits)
    check(mode)


def check(mode: Literal["bwrap", "none"] = "bwrap") -> None:
    """A ConfigError naming the package when ``mode`` is ``bwrap`` and bubblewrap is missing or cannot make its
    namespaces here; for either mode, one when no interpreter runs in it."""
    if mode == "bwrap" and shutil.which("bwrap") is None:
        raise ConfigError(
            f"online.sandbox=bwrap: the command 'bwrap' is not installed; install the package '{PACKAGE}' "
            f"(Debian/Ubuntu: apt-get install {PACKAGE}; ./setup.sh dev does), or set online.sandbox=none to run "
            "model-written code as a plain child process with limits only (not isolated)"
        )
    interpreter(mode)


@functools.cache
def interpreter(mode: str = "bwrap") -> str:
    """The first Python that runs in the sandbox as its user: the trainer's own, then the system's."""
    candidates = [
        sys.executable,
        getattr(sys, "_base_executable", ""),
        "/usr/bin/python3",
        "/usr/local/bin/python3",
    ]
    tried = []
    for path in dict.fromkeys(p for p in candidates if p and os.path.exists(p)):
        outcome = _run([path, "-I", "-S", "-c", "print(6 * 7)"], mode, Limits(timeout=20))
        if outcome.stdout.strip() == "42":
            return path
        tried.append(f"{path}: {(outcome.stderr or outcome.limit or outcome.exit_code)!s}"[:200])
    raise ConfigError(
        f"online.sandbox={mode}: no Python interpreter runs in the sandbox ({'; '.join(tried) or 'none found'})"
    )


def run_python(code: str, limits: Limits | None = None, mode: str | None = None) -> Outcome:
    """Run ``code`` with ``python -I -S`` in the sandbox (:data:`SETTINGS` unless given)."""
    mode = mode or SETTINGS.mode
    return _run([interpreter(mode), "-I", "-S", "-c", code], mode, limits or SETTINGS.limits)


def python(code: str) -> str:
    """
    Run a Python program in a sandbox (standard library only, no network, no files kept) and read what it
    printed.

    Args:
        code: the complete program; print what you want to see.
    """
    outcome = run_python(code)
    return describe(outcome, SETTINGS.limits)


def describe(outcome: Outcome, limits: Limits) -> str:
    """What the model reads of a run: the limit it met first (so that a cut result still says it), then its
    output, then the end of its error output."""
    parts = []
    if outcome.limit == "timeout":
        parts.append(f"[stopped: no end within {limits.timeout:g} s (timeout)]")
    elif outcome.limit == "output":
        parts.append(f"[stopped: more than {limits.output_bytes} bytes of output]")
    elif outcome.signal is not None:
        parts.append(f"[stopped by {outcome.signal}{_why(outcome.signal)}]")
    if outcome.stdout.strip():
        parts.append(outcome.stdout.rstrip("\n"))
    if outcome.exit_code not in (0, None) or outcome.stderr.strip() and not outcome.ok:
        tail = outcome.stderr.strip().splitlines()[-2:]  # a traceback's last place and its exception
        parts.append("\n".join(tail) if tail else f"[exit code {outcome.exit_code}]")
    return "\n".join(parts) if parts else "[no output]"


def _why(name: str) -> str:
    return {
        "SIGKILL": ": a limit (memory or CPU time)",
        "SIGXCPU": ": the CPU-time limit",
        "SIGXFSZ": ": the file-size limit",
        "SIGSEGV": ": a crash (deep recursion?)",
    }.get(name, "")


def extract_code(text: str) -> str:
    """The program in a response: its last fenced block (```python or ```), else the whole text."""
    blocks = re.findall(r"```(?:python|py)?[^\n]*\n(.*?)```", text, re.DOTALL)
    return blocks[-1] if blocks else text


def code_tests(completions: list, tests: Sequence, **kwargs) -> list[float]:
    """Reward: the share of a row's tests that a response's code passes, run in the sandbox.

    Args:
        completions: the responses (strings, or TRL's conversational lists whose last message is read).
        tests: per row, a list of Python statements (usually ``assert`` lines) or one string holding them all
            (one test); each runs after the response's code (:func:`extract_code`), alone, in one program.
    Returns:
        per response, passed / number of tests (0 when the code does not run at all).
    """
    out = []
    for completion, row_tests in zip(completions, tests, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        cases = [row_tests] if isinstance(row_tests, str) else list(row_tests)
        program = _test_program(extract_code(text), cases)
        outcome = run_python(program)
        found = re.findall(r"^__rlhfkit_passed__ (\d+)$", outcome.stdout, re.MULTILINE)
        out.append(int(found[-1]) / max(len(cases), 1) if found else 0.0)
    return out


def _test_program(code: str, cases: list[str]) -> str:
    """The response's code, then each test in its own try; the count of passes printed last. The marker line
    is printed by the harness after the model's code ran, so output the code prints cannot fake a count that
    the harness then prints (the last marker wins)."""
    return (
        "import sys as __s\n__ns = {'__name__': '__main__'}\n__passed = 0\n"
        f"try:\n    exec(compile({code!r}, '<response>', 'exec'), __ns)\nexcept BaseException:\n"
        "    print('__rlhfkit_passed__ 0', flush=True)\n    __s.exit(0)\n"
        f"for __t in {cases!r}:\n    try:\n        exec(compile(__t, '<test>', 'exec'), dict(__ns))\n"
        "        __passed += 1\n    except BaseException:\n        pass\n"
        "print('\\n__rlhfkit_passed__', __passed, flush=True)\n"
    )


# --- running ------------------------------------------------------------------------------------------------


def _bwrap(argv: list[str], limits: Limits) -> list[str]:
    return [
        "bwrap",
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp",
        "--dir", "/tmp/work",
        "--chdir", "/tmp/work",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
        "--setenv", "HOME", "/tmp/work",
        "--setenv", "LANG", "C.UTF-8",
        "--",
        *argv,
    ]  # fmt: skip


def run_uid() -> int | None:
    """The user a run started by this process gets: its own when this process is root, else None (this
    process's user)."""
    return SANDBOX_UIDS + os.getpid() if os.geteuid() == 0 else None


def _become_subreaper() -> None:
    """Orphans of a run (a killed fork bomb's children, bwrap's inner process) become this process's children
    rather than the machine's init's, which in a container may never reap them: a zombie still counts against
    the process limit. :func:`_reap` then reaps them (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
        except OSError:
            pass


def _reap(uid: int, patience: float = 1.0) -> None:
    """Reap this process's children that ran as ``uid`` (a run's own user: nothing else runs as it) until
    none is left, for at most ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        left = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
                left += 1
                os.waitpid(int(entry), os.WNOHANG)
            except (OSError, ChildProcessError):
                pass
        if not left:
            return
        time.sleep(0.01)


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def _limit_child(limits: Limits, uid: int | None, processes: int) -> None:
    """In the child, before exec: its own session, the resource limits, and the unprivileged user."""
    os.setsid()
    cpu = max(1, int(limits.timeout) + 1)
    memory = limits.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb << 20, limits.file_mb << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


def _run(argv: list[str], mode: str, limits: Limits) -> Outcome:
    """Run ``argv`` sandboxed (``mode``), reading at most ``limits.output_bytes`` of each stream."""
    uid = run_uid()
    # RLIMIT_NPROC counts every process of the user: the sandbox may add ``processes`` to those it has (a run's
    # own user has none: earlier runs' are reaped).
    processes = limits.processes + 2 + (_processes_of(os.getuid()) if uid is None else 0)
    workdir = None
    if mode == "bwrap":
        command, cwd = _bwrap(argv, limits), "/"
    else:
        workdir = tempfile.mkdtemp(prefix="rlhfkit-sandbox-")
        if uid is not None:
            os.chown(workdir, uid, uid)
        command, cwd = argv, workdir
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8"}
    _become_subreaper()
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            preexec_fn=lambda: _limit_child(limits, uid, processes),
        )
    except OSError as e:
        return Outcome("", f"{type(e).__name__}: {e}", None, limit="start")
    try:
        return _collect(proc, limits)
    finally:
        _kill_group(proc)
        if uid is not None:
            _reap(uid)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc: subprocess.Popen, limits: Limits) -> Outcome:
    """Read both streams up to the output limit until the process ends or the timeout passes."""
    import selectors

    streams = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    selector = selectors.DefaultSelector()
    for stream in streams:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + limits.timeout
    limit = None
    open_streams = len(streams)
    while open_streams:
        left = deadline - time.monotonic()
        if left <= 0:
            limit = "timeout"
            break
        for key, _ in selector.select(timeout=min(left, 0.5)):
            chunk = key.fileobj.read(65536)
            if not chunk:
                selector.unregister(key.fileobj)
                open_streams -= 1
                continue
            streams[key.fileobj] += chunk
        if sum(len(b) for b in streams.values()) > limits.output_bytes:
            limit = "output"
            break
    selector.close()
    if limit is not None:
        _kill_group(proc)
    try:
        code = proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        code, limit = proc.wait(), limit or "timeout"
    signame = None
    if code < 0:
        signame, code = signal.Signals(-code).name, None
    elif code > 128 and limit is None and code - 128 in signal.Signals._value2member_map_:
        signame, code = signal.Signals(code - 128).name, None  # bwrap reports its child's signal so
    out, err = (bytes(streams[s][: limits.output_bytes]).decode("utf-8", "replace") for s in streams)
    return Outcome(out, err, code, signame, limit)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group until it is empty: a fork bomb's processes fork while the signal goes
    round, so one kill can miss the newest (bwrap's own process namespace ends them all with its first)."""
    for attempt in range(200):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        if attempt == 0:
            proc.wait()  # the leader reaped, the group is empty once its last member is gone
        time.sleep(0.002)
    proc.wait()
