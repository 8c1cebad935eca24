"""Rollouts that overlap training under torchrun (2 processes on gloo: a trainer and a generator), on the tiny
online problem with a LoRA actor (only the adapters travel): every rollout is trained at most one version after
the weights that drew it, and a side that is killed stops the other with one named line, not a hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlhfkit.engine.metrics_writer import read_metrics
from tests.distributed.test_data_parallel import torchrun
from tests.distributed.test_faults import stderr_or_kill
from tests.trainers.online.online_fixtures import online_cli_args, write_online_problem

BOUND_S = 150  # a launch and four tiny rollouts take ~30-60 s here (2 shared cores)
ASYNC = (
    "online.max_staleness=1",
    "online.generation_processes=1",
    "model.lora_rank=4",
    "model.lora_alpha=8",
    "train.save_steps=100",
)


def launch(side: str, argv: list[str], at: int = 3) -> tuple[int, str, float]:
    """torchrun 2 processes of ``argv`` with ``side`` killed at rollout ``at``; (exit code, stderr, seconds).
    Past BOUND_S the launch is killed and the test fails."""
    start = time.perf_counter()
    proc = torchrun("-m", "tests.trainers.online.async_fault_worker", side, str(at), *argv, wait=False)
    err = stderr_or_kill(proc, BOUND_S, f"{side} killed")
    return proc.returncode, err, time.perf_counter() - start


@pytest.fixture(scope="module")
def problem(tmp_path_factory) -> dict[str, Path]:
    return write_online_problem(tmp_path_factory.mktemp("async"))


@pytest.mark.slow
def test_every_rollout_is_trained_at_most_one_version_after_its_weights(problem, tmp_path):
    out = tmp_path / "run"
    code, err, _ = launch("none", online_cli_args(problem, out, "train.max_steps=4", *ASYNC, kind="grpo"))
    assert code == 0, err[-4000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # rollout 1 from the starting weights, trained by them; from rollout 2 on, one version behind: overlapped
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["async/dropped"] == 0.0 for r in rows)
    assert all(r["async/trainer_idle_seconds"] >= 0 and r["async/generator_idle_seconds"] >= 0 for r in rows)
    # the phase times: the generator sampled every rollout; the trainer sent weights after updates 1 and 2 only
    # (rollout s + 2 is sampled with version s: none past rollout 4)
    assert all(r["async/generation_seconds"] > 0 for r in rows)
    sent = [r["async/weight_transfer_seconds"] for r in rows]
    assert sent[0] > 0 and sent[1] > 0 and sent[2:] == [0.0, 0.0]
    # the generator's starting weights are the trainer's: the first ratio is exactly 1
    assert rows[0]["ratio/first_minibatch_max_logprob_diff"] == 0.0
    assert (out / "summary.json").exists() and any((out / "final").glob("*.safetensors"))
    assert "grpo on 2 processes (torchrun, gloo, cpu)" in err


@pytest.mark.long  # end to end, ~30 s: CI's long step (the suite stays under 15 minutes)
def test_with_k2_a_generator_two_rollouts_ahead_does_not_deadlock_the_weight_sends(problem, tmp_path):
    """k = 2, one generator: rollouts 1-3 are sampled with version 0, so the generator sends rollout 3 before it
    receives version 1, while the trainer, after update 2, posts version 2. A sender that waited for version 1 to
    arrive before posting version 2 deadlocked here (each side blocked in a send); killed at BOUND_S, it fails."""
    out = tmp_path / "run"
    argv = online_cli_args(
        problem, out, "train.max_steps=5", *ASYNC, "online.max_staleness=2", "train.collective_timeout=60",
        kind="grpo",
    )  # fmt: skip
    code, err, _ = launch("none", argv)
    assert code == 0, err[-4000:]
    rows = read_metrics(out / "metrics.jsonl")
    # rollout s is sampled with version max(0, s - 3) and trained after update s - 1
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert all(r["async/dropped"] == 0.0 for r in rows)
    sent = [r["async/weight_transfer_seconds"] for r in rows]  # versions 1 and 2 only (for rollouts 4 and 5)
    assert sent[0] > 0 and sent[1] > 0 and sent[2:] == [0.0, 0.0, 0.0]


@pytest.mark.long  # end to end, tens of seconds: CI's long step (the suite stays under 15 minutes)
@pytest.mark.parametrize(("side", "survivor"), [("generator", 0), ("trainer", 1), ("hang", 0)])
def test_a_killed_side_stops_the_other_with_one_named_line(problem, tmp_path, side, survivor):
    """Killed: the other side's next transfer fails at once. A generator that hangs: the trainer's receive
    times out at train.collective_timeout (10 s here), then the launcher's SIGTERM ends the generator."""
    out = tmp_path / "run"
    argv = online_cli_args(
        problem, out, "train.max_steps=6", *ASYNC, "train.collective_timeout=10", kind="grpo"
    )
    code, err, seconds = launch(side, argv)
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("rlhfkit: stopped:")]
    assert len(lines) == 1, err[-4000:]
    assert lines[0].startswith(
        f"rlhfkit: stopped: process {survivor} of 2: another process of this run ended or stopped answering"
    )
    assert seconds < BOUND_S


@pytest.mark.long  # end to end, tens of seconds: CI's long step
def test_ppo_with_a_critic_and_held_out_evaluation_overlaps(problem, tmp_path):
    """The values are read by the trainer's critic; the trainer evaluates every held-out prompt itself."""
    out = tmp_path / "run"
    evaluation = (f"data.eval_file={problem['prompts']}", "train.eval_steps=3")
    argv = online_cli_args(problem, out, "train.max_steps=3", *ASYNC, *evaluation, kind="ppo")
    code, err, _ = launch("none", argv)
    assert code == 0, err[-4000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert "eval/score/mean" in rows[0] and rows[0]["step"] == 0  # the starting weights, evaluated first
    rows = rows[1:]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all("loss/value" in r for r in rows)
    assert "eval/score/mean" in rows[-1] and rows[-1]["eval/response_length/mean"] > 0
    assert (out / "final_critic").is_dir()


@pytest.mark.long  # end to end, tens of seconds: CI's long step
def test_distillation_overlaps(problem, tmp_path):
    from tests.trainers.online.test_distill import write_teacher

    out = tmp_path / "run"
    teacher = write_teacher(tmp_path, problem)
    argv = online_cli_args(problem, out, "train.max_steps=3", *ASYNC, kind="distill")
    code, err, _ = launch("none", [*argv, f"online.teacher_model={teacher}"])
    assert code == 0, err[-4000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["distill/teacher_kl"] != 0 for r in rows)  # a sampled estimate: either sign
