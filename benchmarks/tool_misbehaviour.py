"""How long misbehaving tools and hostile model-written code take to be stopped, and what the model reads.

Run on an otherwise idle machine:

    RLHFKIT_NUM_THREADS=1 python benchmarks/tool_misbehaviour.py [--timeout 0.5] [--sandbox bwrap|none]

Prints, per case, the seconds until the call came back and its cause or first line; then the time of one turn of
four hanging calls (run at once: about one timeout, not four); then each hostile program through the
``rlhfkit:python`` sandbox (bubblewrap unless ``--sandbox none``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from rlhfkit.rollout import sandbox  # noqa: E402
from rlhfkit.rollout.tools import Toolbox, ToolCall, run_turn_calls  # noqa: E402

ENV = textwrap.dedent(
    '''
    import re, time

    class Env:
        def reset(self, **row):
            self.state = 0

        def act(self, how: str) -> str:
            """Misbehaves.

            Args:
                how: which way
            """
            if how == "gil":
                return str(bool(re.match(r"(a+)+$", "a" * 34 + "b")))
            if how == "spin":
                while True:
                    pass
            if how == "sleep":
                time.sleep(60)
            if how == "raise":
                raise RuntimeError("kaput")
            if how == "big":
                return "x" * 5000
            return "ok"
    '''
)
HOSTILE = {
    "infinite loop": "while True:\n    pass",
    "memory bomb": "x = bytearray(1 << 33)",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "deep recursion": "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)",
    "100 MB of output": "import sys\nsys.stdout.write('x' * 100_000_000)",
    "write outside": "open('/etc/rlhfkit-sandbox-test', 'w').write('x')",
    "read the environment": "import os\nprint(sorted(os.environ))",
    "open a socket": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
    "os._exit": "import os\nos._exit(3)",
    "signal the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('sent')",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=0.5)
    parser.add_argument("--sandbox", choices=["bwrap", "none"], default="bwrap")
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "env.py"), "w") as f:
        f.write(ENV)
    toolbox = Toolbox.load([], os.path.join(folder, "env.py") + ":Env", timeout=args.timeout, memory_mb=512)
    print(f"tool calls, timeout {args.timeout:g} s")
    for how in ("fine", "gil", "spin", "sleep", "raise", "big"):
        tools = toolbox.episode()
        start = time.perf_counter()
        (result,) = run_turn_calls([(tools, [ToolCall("act", {"how": how}, "")])], timeout=args.timeout)[0]
        took = time.perf_counter() - start
        print(f"  {how:6s} {took:6.2f} s  {result.error or 'ok'}: {result.text[:60]!r}")
        tools.close()
    episodes = [toolbox.episode() for _ in range(4)]
    start = time.perf_counter()
    run_turn_calls([(e, [ToolCall("act", {"how": "sleep"}, "")]) for e in episodes], timeout=args.timeout)
    print(f"  one turn of 4 hanging calls: {time.perf_counter() - start:.2f} s")
    limits = sandbox.Limits(timeout=3.0, memory_mb=256)
    print(f"sandbox {args.sandbox}, limits {limits}")
    for name, code in HOSTILE.items():
        start = time.perf_counter()
        text = sandbox.describe(sandbox.run_python(code, limits, args.sandbox), limits)
        first = text.splitlines()[-1] if text else ""
        print(f"  {name:22s} {time.perf_counter() - start:5.2f} s  {first[:70]!r}")


if __name__ == "__main__":
    main()
