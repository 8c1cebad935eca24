"""The command line under torchrun: two processes that say so, end cleanly, write once, and resume on one."""

from __future__ import annotations

import json

import pytest

from rlhfkit.algos import AdaptiveKLController
from rlhfkit.cli import main
from rlhfkit.config import read_run_info
from rlhfkit.engine.checkpoint import complete_checkpoints
from rlhfkit.engine.metrics_writer import read_metrics
from tests.distributed.test_data_parallel import torchrun
from tests.trainers.online.online_fixtures import online_cli_args, write_online_problem


@pytest.mark.slow
def test_two_process_ppo_run_ends_cleanly_then_resumes_on_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")  # the in-process resume: one thread, as the suite runs
    paths = write_online_problem(tmp_path)
    out = tmp_path / "run"
    settings = (
        f"online.reward_model={paths['reward']}",
        "train.save_steps=1",
        "online.kl_target=0.5",
        "online.kl_horizon=20",
    )
    proc = torchrun("-m", "rlhfkit.cli", *online_cli_args(paths, out, *settings, "train.max_steps=2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr
    assert (
        proc.stderr.count("rlhfkit: ppo on 2 processes (torchrun, gloo, cpu)") == 1
    )  # said once, by the main one
    info = read_run_info(out / "config.yaml")
    assert (info["world_size"], info["local_world_size"], info["launcher"]) == (2, 2, "torchrun")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]  # one line per rollout: written by one process
    assert (out / "final" / "model.safetensors").is_file() and (
        out / "final_critic" / "model.safetensors"
    ).is_file()
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-1", "step-2"]
    # the KL controller of the two-process run read the logged KL: the whole rollout's
    ctl = AdaptiveKLController(rows[0]["kl_coef"], 0.5, 20)
    ctl.update(rows[0]["kl/mean"], 8)
    assert rows[1]["kl_coef"] == pytest.approx(ctl.value, rel=1e-12)

    # the same run, resumed on one process from the two-process checkpoint: the next global prompts, the
    # restored controller, optimizers and schedules
    assert main([*online_cli_args(paths, out, *settings, "train.max_steps=3"), "--resume"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert read_run_info(out / "config.yaml")["world_size"] == 1
    ctl.update(rows[1]["kl/mean"], 8)
    assert rows[2]["kl_coef"] == pytest.approx(ctl.value, rel=1e-12)
    state = json.loads((out / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["prompts_seen"] == 3 * 4  # the global sample position: world-size independent


def test_a_deepspeed_launch_is_refused_at_start_naming_the_alternative(tmp_path, monkeypatch, capsys):
    """accelerate sets this for its DeepSpeed configs (and on CPU silently trains plain DDP instead)."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    paths = write_online_problem(tmp_path)
    assert main(online_cli_args(paths, tmp_path / "run", "train.max_steps=1")) == 2
    err = capsys.readouterr().err
    assert "sharded training" in err and "torchrun --nproc_per_node N" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_accelerate_fsdp_launch_of_one_process_trains_sharded(tmp_path, monkeypatch, capsys):
    """accelerate starts a one-process FSDP config without a process group: the run shards in a group of one
    (rlhfkit.engine.sharded.single_process_group), as train.sharding=full_shard does."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    paths = write_online_problem(tmp_path)
    assert main(online_cli_args(paths, tmp_path / "run", "train.max_steps=1")) == 0
    err = capsys.readouterr().err
    assert "ppo on 1 process" in err and "model sharded (full_shard, FSDP2)" in err
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-1" / "trainer_state.json").read_text())
    assert state["sharded"]["world_size"] == 1


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"},
            "half",
        ),  # torchrun's OMP_NUM_THREADS=1 is not the user's
        ({"LOCAL_WORLD_SIZE": "2", "RLHFKIT_NUM_THREADS": "3"}, 3),
        ({"OMP_NUM_THREADS": "3"}, 3),  # no launcher: the user's own setting
        ({}, "all"),
    ],
)
def test_threads_per_process_are_the_cores_shared_by_local_processes(monkeypatch, env, expected):
    from rlhfkit.engine.threads import default_num_threads

    for var in ("LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "RLHFKIT_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert default_num_threads() == {"half": 8, "all": 16}.get(expected, expected)


def test_a_group_split_between_processes_is_an_error():
    """grpo / rloo statistics are per group where the group is: a group on two processes would get two
    baselines. Two processes simulated: the other holds prompt 1's second half and prompt 2."""
    from types import SimpleNamespace

    import torch

    from rlhfkit.trainers.online.shaping import check_groups_on_one_process

    other = torch.tensor([0.0, 1.0, 1.0, 0.0])  # the other process holds groups 1 and 2

    def ctx_with(other_held):
        return SimpleNamespace(
            accelerator=SimpleNamespace(num_processes=2),
            device="cpu",
            cfg=SimpleNamespace(train=SimpleNamespace(batch_size=4)),
            all_sum=lambda held: held.double() + other_held,
        )

    check_groups_on_one_process(ctx_with(torch.tensor([0.0, 0.0, 1.0, 1.0])), torch.tensor([0, 0, 1, 1, -7]))
    with pytest.raises(RuntimeError, match=r"groups of prompts \[1\] are split between processes"):
        check_groups_on_one_process(ctx_with(other), torch.tensor([0, 0, 1, 1, -7]))
