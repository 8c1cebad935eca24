"""Tool calls that misbehave: each is stopped at its timeout, its process is gone, the cause is counted, and an
environment the model was told had failed is never read again (rlhfkit.rollout.tool_worker)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from rlhfkit.rollout.episodes import run_episodes
from rlhfkit.rollout.tools import Toolbox, ToolCall, run_tool_call, run_turn_calls
from tests.helpers_tools import ScriptedSampler, char_ids, tool_tokenizer
from tests.rollout.test_episodes import MODEL, runner_for

ENV = textwrap.dedent(
    '''
    import os, re, time

    class Misbehaving:
        def reset(self, **row):
            self.state = 0
            return None

        def gil(self, text: str) -> str:
            """Catastrophic backtracking: holds the interpreter lock for many seconds.

            Args:
                text: what to match
            """
            return str(bool(re.match(r"(a+)+$", text)))

        def spin(self) -> str:
            """Never returns.

            Args:
            """
            while True:
                pass

        def late(self) -> str:
            """Sleeps past the timeout, then changes the environment.

            Args:
            """
            time.sleep(1.0)
            self.state = 99
            return "done"

        def pid(self) -> str:
            """The process the tools run in.

            Args:
            """
            return str(os.getpid())

        def bump(self) -> str:
            """Adds one.

            Args:
            """
            self.state += 1
            return str(self.state)

        def big(self) -> str:
            """Five thousand characters.

            Args:
            """
            return "x" * 5000

        def boom(self) -> str:
            """Raises.

            Args:
            """
            raise RuntimeError("kaput")

        def leave(self) -> str:
            """Ends its process.

            Args:
            """
            os._exit(3)

        def hog(self) -> str:
            """Allocates 2 GB.

            Args:
            """
            return str(len(bytearray(2 << 30)))

        def get_reward(self) -> float:
            return float(self.state)
    '''
)


@pytest.fixture
def env_file(tmp_path, monkeypatch):
    (tmp_path / "env.py").write_text(ENV)
    monkeypatch.chdir(tmp_path)
    return "env.py:Misbehaving"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_tool_holding_the_interpreter_lock_is_stopped_at_its_timeout(env_file):
    toolbox = Toolbox.load([], env_file, timeout=0.5)
    tools = toolbox.episode()
    pid = int(tools.call("pid").text)
    start = time.perf_counter()
    result = tools.call("gil", text="a" * 40 + "b")  # minutes of backtracking in one regex call
    took = time.perf_counter() - start
    assert result.error == "timeout" and "no result within 0.5 s" in result.text
    assert took < 1.5, took  # a thread would have returned after the regex, with its result
    assert not alive(pid)  # killed and reaped: nothing spins on


def test_a_spinning_tool_leaves_no_process_and_its_environment_is_never_read_again(env_file):
    toolbox = Toolbox.load([], env_file, timeout=0.3)
    tools = toolbox.episode()
    pid = int(tools.call("pid").text)
    assert tools.call("spin").error == "timeout"
    assert not alive(pid)
    with pytest.raises(RuntimeError, match="environment is gone"):
        tools.environment.state  # noqa: B018


def test_a_call_that_changes_the_environment_after_its_timeout_never_reaches_the_score(env_file):
    tok = tool_tokenizer(marker_tokens=False)
    call = '<tool_call>\n{"name": "late", "arguments": {}}\n</tool_call>'
    bump = '<tool_call>\n{"name": "bump", "arguments": {}}\n</tool_call>'
    sampler = ScriptedSampler([[char_ids(tok, bump), char_ids(tok, call)], [char_ids(tok, "answer=1</s>")]])
    runner = runner_for(tok, tools=(), environment=env_file, tool_timeout=0.3, response_length=2000)
    runner.toolbox.timeout = 0.3
    out = run_episodes(runner, MODEL, ["q1", "q2"], generate=sampler)
    time.sleep(1.0)  # past the sleeping call's own end: had it lived on, it would have set state = 99
    assert [r.stopped for r in out.records] == [None, "timeout"]
    assert out.records[1].turns[-1]["error"] == "timeout" and not bool(out.ended[1])
    assert out.environment_scores() == [1.0, None]  # None: no opinion from a stopped environment
    metrics = out.metrics()
    assert metrics["tools/timeouts"] == 0.5 and metrics["episodes/stopped_by_tool"] == 0.5
    pids = [t.worker.pid for t in out.tools]
    out.close()
    assert not any(alive(p) for p in pids)


def test_a_turn_of_hanging_calls_costs_one_timeout_not_one_per_call(env_file):
    toolbox = Toolbox.load([], env_file, timeout=0.5)
    episodes = [toolbox.episode() for _ in range(4)]
    start = time.perf_counter()
    results = run_turn_calls([(e, [ToolCall("late", {}, "")]) for e in episodes], timeout=0.5)
    took = time.perf_counter() - start
    assert [r[0].error for r in results] == ["timeout"] * 4
    assert took < 1.2, took  # in sequence: 2 s


def test_each_misbehaviour_reads_to_the_model_with_its_cause(env_file, tmp_path):
    tok = tool_tokenizer()
    toolbox = Toolbox.load([], env_file, timeout=2.0, memory_mb=256)
    cases = {"big": "too_long", "boom": "exception", "leave": "died", "hog": "exception"}
    for name, cause in cases.items():
        tools = toolbox.episode()
        (result,) = run_turn_calls(
            [(tools, [ToolCall(name, {}, "")])], timeout=2.0, max_length=32, tokenizer=tok
        )[0]
        assert result.error == cause, (name, result.text)
        if name == "hog":
            assert "MemoryError" in result.text  # the limit, not the machine's memory, stopped it
        if name == "big":
            assert "[truncated: the result was" in result.text
        tools.close()


def test_a_hanging_tool_does_not_keep_the_process_from_exiting(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            f'''
            import sys, time
            sys.path[:0] = {sys.path!r}
            from rlhfkit.rollout.tools import Toolbox

            def forever() -> str:
                """Never returns.

                Args:
                """
                time.sleep(3600)

            toolbox = Toolbox.load([forever], timeout=60)
            tools = toolbox.episode()
            tools.worker.send("call", "forever", {{}}, 100)
            print(tools.worker.pid, flush=True)
            '''
        )
    )
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.perf_counter() - start < 30
    time.sleep(0.2)
    assert not alive(int(done.stdout.split()[0]))


def test_stateless_tools_go_on_in_a_fresh_process_after_a_timeout():
    tok = tool_tokenizer(marker_tokens=False)
    from tests.rollout.test_episodes import slow

    call = '<tool_call>\n{"name": "slow", "arguments": {"seconds": 3}}\n</tool_call>'
    sampler = ScriptedSampler([[char_ids(tok, call)], [char_ids(tok, "answer=1</s>")]])
    runner = runner_for(tok, tools=(slow,), tool_timeout=0.2, response_length=2000)
    out = run_episodes(runner, MODEL, ["q"], generate=sampler)
    assert out.records[0].stopped is None and bool(out.ended[0])  # the model read the error and answered
    assert out.records[0].turns[1]["error"] == "timeout"
    out.close()


def children() -> set[int]:
    """The live (not zombie) child processes of this one."""
    out = set()
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.add(int(entry))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_run_tool_call_and_closed_episodes_leave_no_process(env_file):
    before = children()
    for _ in range(3):
        assert run_tool_call(ToolCall("f", {}, ""), {"f": lambda: "ok"}, timeout=1.0).text == "ok"
    tools = Toolbox.load([], env_file).episode()
    assert tools.worker.pid in children()
    tools.close()
    assert children() - before == set()
