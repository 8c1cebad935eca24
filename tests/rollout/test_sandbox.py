"""Model-written code in the sandbox (rlhfkit.rollout.sandbox): each hostile program is stopped and reported,
and nothing outside the sandbox changes. Runs with bubblewrap (./setup.sh dev installs it; CI requires it) and
with online.sandbox=none (limits only)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rlhfkit.errors import ConfigError
from rlhfkit.rollout import sandbox
from rlhfkit.rollout.sandbox import Limits, code_tests, describe, extract_code, run_python

HAVE_BWRAP = shutil.which("bwrap") is not None
MODES = [
    pytest.param(
        "bwrap",
        marks=pytest.mark.skipif(
            not HAVE_BWRAP and not os.environ.get("CI"), reason="bubblewrap is not installed (./setup.sh dev)"
        ),
    ),
    "none",
]
LIMITS = Limits(timeout=1.0, memory_mb=256, processes=16, output_bytes=4096)


def run(code: str, mode: str) -> tuple[str, float]:
    start = time.perf_counter()
    outcome = run_python(code, LIMITS, mode)
    return describe(outcome, LIMITS), time.perf_counter() - start


@pytest.mark.parametrize("mode", MODES)
def test_a_plain_program_prints_its_output(mode):
    assert run("print(6 * 7)", mode)[0] == "42"


@pytest.mark.parametrize("mode", MODES)
def test_an_infinite_loop_is_stopped_at_the_timeout(mode):
    text, took = run("while True:\n    pass", mode)
    assert "[stopped: no end within 1 s (timeout)]" in text and took < 3


@pytest.mark.parametrize("mode", MODES)
def test_a_memory_bomb_meets_the_memory_limit(mode):
    text, _ = run("x = bytearray(1 << 31)", mode)
    assert "MemoryError" in text


@pytest.mark.parametrize("mode", MODES)
def test_a_fork_bomb_is_contained_and_leaves_no_process(mode):
    uid = sandbox.run_uid() or os.getuid()
    before = sandbox._processes_of(uid)
    code = "import os\nn = 0\nwhile True:\n    try:\n        os.fork()\n        n += 1\n    except OSError:\n        pass"
    text, took = run(code, mode)
    assert "timeout" in text and took < 5
    time.sleep(0.3)
    assert sandbox._processes_of(uid) <= before


@pytest.mark.parametrize("mode", MODES)
def test_deep_recursion_is_stopped(mode):
    text, took = run("import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)", mode)
    assert text != "[no output]" and took < 5
    assert any(s in text for s in ("timeout", "RecursionError", "stopped by", "MemoryError")), text


@pytest.mark.parametrize("mode", MODES)
def test_100_mb_of_output_is_cut_at_the_output_limit(mode):
    text, took = run("import sys\nsys.stdout.write('x' * 100_000_000)", mode)
    assert f"[stopped: more than {LIMITS.output_bytes} bytes of output]" in text
    assert len(text) < 2 * LIMITS.output_bytes and took < 5


@pytest.fixture
def outside(tmp_path):
    """A file outside /tmp (the sandbox's /tmp is its own): under /var/tmp where there is one."""
    root = Path(tempfile.mkdtemp(dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    target = root / "outside.txt"
    target.write_text("before")
    yield target
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("mode", MODES)
def test_writing_outside_its_folder_fails_and_changes_nothing(mode, outside):
    text, _ = run(f"open({str(outside)!r}, 'w').write('after')\nprint('wrote')", mode)
    assert "wrote" not in text and ("Read-only file system" in text or "Permission denied" in text), text
    assert outside.read_text() == "before"
    if mode == "bwrap":  # even a file anyone may write: the sandbox sees the machine read-only
        os.chmod(outside.parent, 0o777)
        os.chmod(outside, 0o666)
        text, _ = run(f"open({str(outside)!r}, 'w').write('after')", mode)
        assert "Read-only file system" in text and outside.read_text() == "before"
    text, _ = run("open('scratch.txt', 'w').write('x')\nprint(open('scratch.txt').read())", mode)
    assert text == "x"  # its own temp folder is writable


@pytest.mark.parametrize("mode", MODES)
def test_the_trainers_environment_is_not_visible(mode, monkeypatch):
    monkeypatch.setenv("RLHFKIT_TEST_SECRET", "s3cret-token")
    code = (
        "import os\nprint(sorted(os.environ))\n"
        "try:\n    print(open(f'/proc/{os.getppid()}/environ').read())\nexcept OSError as e:\n    print(type(e).__name__)"
    )
    text, _ = run(code, mode)
    assert "s3cret-token" not in text and "RLHFKIT_TEST_SECRET" not in text


@pytest.mark.skipif(not HAVE_BWRAP and not os.environ.get("CI"), reason="bubblewrap is not installed")
def test_a_socket_cannot_reach_this_machine():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(1.5)
    port = server.getsockname()[1]
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True)
    thread.start()
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    )
    text, _ = run(code, "bwrap")
    assert "connected" not in text and ("ConnectionRefusedError" in text or "OSError" in text), text
    thread.join(3)
    server.close()
    assert accepted == [None]


def _accept(server):
    try:
        conn, _ = server.accept()
        conn.close()
        return "accepted"
    except OSError:
        return None


@pytest.mark.parametrize("mode", MODES)
def test_os_exit_and_a_signal_to_the_parent_are_reported_and_harmless(mode):
    assert run("import os\nos._exit(7)", mode)[0] == "[exit code 7]"
    code = (
        "import os, signal\n"
        "for target in (os.getppid(), 1, -1):\n"
        "    try:\n        os.kill(target, signal.SIGKILL)\n    except OSError as e:\n        print(type(e).__name__)\n"
        "print('still here')"
    )
    run(code, mode)
    assert os.getpid() > 0  # this process is alive (a kill would have ended the test run)


@pytest.mark.parametrize("mode", MODES)
def test_code_tests_scores_the_share_of_passing_tests(mode, monkeypatch):
    monkeypatch.setattr(sandbox, "SETTINGS", sandbox.Settings(mode, LIMITS))
    good = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    half = "```python\ndef add(a, b):\n    return a + b if a else 0\n```"
    liar = "```python\nprint('__rlhfkit_passed__ 2')\nimport sys\nsys.exit(0)\n```"
    tests = ["assert add(1, 2) == 3", "assert add(0, 5) == 5"]
    broken = "```python\ndef add(a, b) return\n```"
    loop = "```python\nwhile True:\n    pass\n```"
    scores = code_tests([good, half, liar, broken, loop], [tests] * 5)
    assert scores == [1.0, 0.5, 0.0, 0.0, 0.0]
    conversational = [[{"role": "assistant", "content": good}]]
    assert code_tests(conversational, ["assert add(2, 2) == 4"]) == [1.0]


def test_extract_code_takes_the_last_block():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```\ny = 2\n```") == "y = 2\n"
    assert extract_code("print(1)") == "print(1)"


def test_a_missing_bwrap_is_a_named_error_at_start_up(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="install the package 'bubblewrap'.*online.sandbox=none"):
        sandbox.check("bwrap")


def test_the_python_tool_reads_the_runs_settings(monkeypatch):
    monkeypatch.setattr(sandbox, "SETTINGS", sandbox.Settings("none", Limits(timeout=1.0)))
    assert sandbox.python("print('hi')") == "hi"
    assert "[stopped: no end within 1 s (timeout)]" in sandbox.python("while True: pass")
