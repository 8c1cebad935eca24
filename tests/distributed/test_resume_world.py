"""A one-process checkpoint resumes under torchrun with two processes, from the same global sample position.

(The reverse, two processes resumed on one, is in test_launch.py.) SFT in float64, data parallel or sharded
(FSDP2: the checkpoint's shards re-cut for two processes), gives the weights of an uninterrupted one-process
run up to summation order: the data order is a function of (seed, step) and the
loss normaliser counts the whole batch, so only the order of the gradient sum differs. PPO continues from the
next global prompt with the restored KL controller; its responses differ from a one-process continuation
because sampling is seeded per (seed, rollout, process), so the comparison there is of positions, not values.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.algos import AdaptiveKLController
from rlhfkit.cli import main
from rlhfkit.config import read_run_info
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.models import loading
from tests.distributed.sharded_worker import sft_run
from tests.distributed.test_data_parallel import torchrun
from tests.trainers.online.online_fixtures import online_cli_args, write_online_problem
from tests.trainers.sft_fixtures import write_sft_problem


@pytest.mark.slow
def test_one_process_checkpoints_resume_on_two_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    (tmp_path / "sft").mkdir()
    write_sft_problem(tmp_path / "sft")
    (tmp_path / "run.yaml").write_text("seed: 0\n")
    paths = write_online_problem(tmp_path / "online")
    sft_out, ref_out, ppo_out = tmp_path / "sft-run", tmp_path / "sft-ref", tmp_path / "ppo-run"
    ppo = (
        "train.save_steps=1",
        f"online.reward_model={paths['reward']}",
        "online.kl_target=0.5",
        "online.kl_horizon=20",
    )

    def sft(out, steps, *extra):
        return sft_run(tmp_path / "sft", out, f"train.max_steps={steps}", "train.save_steps=1", *extra)

    sharded_out = tmp_path / "sft-sharded"
    sharding = "train.sharding=full_shard"
    with monkeypatch.context() as patch:  # the uninterrupted one-process reference, here
        patch.setitem(loading.DTYPES, "float32", torch.float64)
        assert main(sft(ref_out, 2)) == 0

    def launch(nproc, runs):
        plan = tmp_path / f"plan-{nproc}.json"
        plan.write_text(json.dumps({"float64": True, "runs": runs}))
        proc = torchrun("-m", "tests.distributed.cli_runs", str(plan), nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "terminate called" not in proc.stderr

    # one process (under torchrun, so that the sharded run has its process group of one): the first step
    first_ppo = online_cli_args(paths, ppo_out, *ppo, "train.max_steps=1")
    launch(1, [sft(sft_out, 1), first_ppo, sft(sharded_out, 1, sharding)])
    # two processes: the second step, resumed from those checkpoints
    resumed_ppo = [*online_cli_args(paths, ppo_out, *ppo, "train.max_steps=2"), "--resume"]
    resumed_sft = [*sft(sft_out, 2)[:-1], "--resume"]
    resumed_sharded = [*sft(sharded_out, 2, sharding)[:-1], "--resume"]
    launch(2, [resumed_sft, resumed_ppo, resumed_sharded])

    one = load_file(str(ref_out / "final" / "model.safetensors"))
    for out in (sft_out, sharded_out):
        two = load_file(str(out / "final" / "model.safetensors"))
        assert sorted(two) == sorted(one)
        assert max(float((two[k] - one[k]).abs().max()) for k in one) <= 1e-10
    worlds = [
        json.loads((sharded_out / "checkpoints" / f"step-{n}" / "trainer_state.json").read_text())["sharded"]
        for n in (1, 2)
    ]
    assert [w["world_size"] for w in worlds] == [1, 2]  # the shards of one process, re-cut for two

    for out in (sft_out, ppo_out, sharded_out):
        assert read_run_info(out / "config.yaml")["world_size"] == 2
        assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    state = json.loads((ppo_out / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["prompts_seen"] == 2 * 4  # the global prompt position, whatever the process count
    rows = read_metrics(ppo_out / "metrics.jsonl")
    ctl = AdaptiveKLController(rows[0]["kl_coef"], 0.5, 20)
    ctl.update(rows[0]["kl/mean"], 8)
    assert rows[1]["kl_coef"] == pytest.approx(ctl.value, rel=1e-12)
