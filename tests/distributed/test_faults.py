"""One process of a two-process online run fails mid-run; every process stops with a named line, not a hang.

Each test starts ``torchrun --nproc_per_node 2`` on the tiny online problem with a fault planted in one process
as rollout 2 starts (:mod:`tests.distributed.fault_worker`), after rollout 1 and its checkpoint:

- a Python exception (unsharded ppo): the failing process keeps its traceback; the other stops at its next
  collective with one ``rlhfkit: stopped:`` line (exit 5) naming the newest complete checkpoint;
- SIGKILL (sharded ppo, the main process killed): the survivor stops likewise;
- a hang (sharded grpo: alive, never at the next collective): only ``train.collective_timeout`` (10 s here)
  ends the survivor's wait; with the default (30 min) the launch outlives the test's bound.

In each, the newest complete checkpoint is step-1 and a run resumed from it finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhfkit.cli import main
from rlhfkit.engine.checkpoint import complete_checkpoints
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.trainers import common
from tests.distributed.test_data_parallel import torchrun
from tests.trainers.online.online_fixtures import online_cli_args, write_online_problem

BOUND_S = 120  # a launch, one rollout and its checkpoint take ~25-45 s here (2 shared cores)


def faulty_launch(fault: str, rank: int, argv: list[str]) -> tuple[int, str, float]:
    """torchrun 2 processes of ``argv`` with ``fault`` planted in process ``rank`` at rollout 2; (exit code,
    stderr, seconds). Past BOUND_S the whole launch is killed (its own process group) and the test fails."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), os.getcwd()])),
        "RLHFKIT_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("PYTEST_CURRENT_TEST", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*command, "-m", "tests.distributed.fault_worker", fault, str(rank), "2", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    err = stderr_or_kill(proc, BOUND_S, f"{fault} in process {rank}")
    return proc.returncode, err, time.perf_counter() - start


def stderr_or_kill(proc: subprocess.Popen, bound_s: float, what: str) -> str:
    """The launch's stderr once it ends; past ``bound_s`` seconds torchrun and every worker are killed and the
    test fails, naming ``what`` (a hang)."""
    try:
        _, err = proc.communicate(timeout=bound_s)
    except subprocess.TimeoutExpired:
        for pid in [*_children(proc.pid), proc.pid]:  # torchrun starts its workers in sessions of their own
            os.kill(pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{what}: the launch was still running after {bound_s} s (a hang)")
    return err


def _children(pid: int) -> list[int]:
    """The processes that ``pid`` started (Linux)."""
    tasks = Path(f"/proc/{pid}/task")
    found = [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]
    return found


def check_stopped(code: int, err: str, survivor: int, out: Path) -> str:
    """Non-zero exit; the survivor's one named line (no traceback of its own); step-1 the only checkpoint."""
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("rlhfkit: stopped:")]
    assert len(lines) == 1, err[-4000:]
    assert lines[0].startswith(
        f"rlhfkit: stopped: process {survivor} of 2: another process of this run ended or stopped answering"
    )
    assert f"[rank{survivor}]: Traceback" not in err and "terminate called" not in err
    assert "exitcode  : 5" in err  # torchrun's summary: the survivor's own exit code, ProcessLost's
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-1"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    return lines[0]


@pytest.fixture(scope="module")
def online_problem(tmp_path_factory):
    return write_online_problem(tmp_path_factory.mktemp("faults") / "online")


@pytest.fixture
def problem(online_problem, tmp_path):
    paths = online_problem

    def args(name: str, steps: int, *extra: str, kind: str = "ppo") -> list[str]:
        return online_cli_args(
            paths,
            tmp_path / name,
            f"online.reward_model={paths['reward']}",
            "train.save_steps=1",
            "logging.progress_bar=false",
            f"train.max_steps={steps}",
            *extra,
            kind=kind,
        )

    return tmp_path, args


@pytest.mark.slow
def test_an_exception_in_one_process_stops_both_and_the_checkpoint_resumes(problem, monkeypatch):
    tmp, args = problem
    code, err, _ = faulty_launch("exception", 1, args("run", 3))
    line = check_stopped(code, err, 0, tmp / "run")
    assert "Connection closed by peer" in line and f"{tmp / 'run' / 'checkpoints' / 'step-1'}" in line
    assert "RuntimeError: planted fault in process 1 at rollout 2" in err  # the cause keeps its traceback
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    monkeypatch.setattr(common, "write_report", lambda run_dir: None)  # seconds, and read by no test here
    assert main([*args("run", 2), "--resume"]) == 0  # on one process, from step-1
    assert [r["step"] for r in read_metrics(tmp / "run" / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow
def test_a_killed_main_process_stops_the_other_and_the_sharded_checkpoint_resumes(problem):
    tmp, args = problem
    code, err, _ = faulty_launch("kill", 0, args("run", 3, "train.sharding=full_shard"))
    check_stopped(code, err, 1, tmp / "run")
    assert "(SIGKILL)" in err  # the killed one, in torchrun's summary
    plan = tmp / "resume.json"  # no report (seconds, and read by no test here)
    plan.write_text(
        json.dumps({"reports": False, "runs": [[*args("run", 2, "train.sharding=full_shard"), "--resume"]]})
    )
    resumed = torchrun("-m", "tests.distributed.cli_runs", str(plan), nproc=1)
    assert resumed.returncode == 0, resumed.stderr[-4000:]  # the shards of 2 processes, re-cut for 1
    assert [r["step"] for r in read_metrics(tmp / "run" / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow
def test_a_hung_process_ends_the_others_wait_after_the_collective_timeout(problem):
    tmp, args = problem
    argv = args("run", 3, "train.sharding=full_shard", "train.collective_timeout=10", kind="grpo")
    code, err, seconds = faulty_launch("hang", 1, argv)
    line = check_stopped(code, err, 0, tmp / "run")
    assert "Timed out waiting 10000ms" in line  # the configured timeout, not torch's 30 min
    assert seconds < BOUND_S


def test_the_collective_timeout_is_checked_and_a_changed_one_resumes(tmp_path):
    from rlhfkit.config import load_config
    from rlhfkit.engine.folder import RESUMABLE_CHANGES
    from rlhfkit.errors import ConfigError

    keys = [
        f"output_dir={tmp_path}",
        "model.name_or_path=m",
        "data.train_file=t.jsonl",
        "online.reward_model=r",
    ]
    assert load_config(None, keys, "ppo").train.collective_timeout == 1800.0
    with pytest.raises(ConfigError, match="train.collective_timeout"):
        load_config(None, [*keys, "train.collective_timeout=0"], "ppo")
    assert "train.collective_timeout" in RESUMABLE_CHANGES  # a resumed run may wait longer or shorter


def test_only_a_failed_collective_of_a_multi_process_run_is_a_lost_process():
    """Without a process group (one process) a gloo-like message is an ordinary exception: it keeps its
    traceback (the two-process cases above are the positive ones)."""
    from rlhfkit.engine.accel import lost_process

    assert lost_process(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1")) is None
