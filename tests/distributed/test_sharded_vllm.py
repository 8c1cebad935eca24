"""vLLM beside a sharded actor (``train.sharding`` + ``online.generation_backend=vllm``) on 2 CPU processes.

Every process runs its own engine in vLLM's external-launcher mode and generates its share of the rollout; the
actor's weights reach it once per rollout streamed one gathered tensor at a time (no whole copy). Checked here:

- the engine on its own (tests.distributed.sharded_vllm_worker, full_shard): greedy tokens equal Hugging Face
  ``generate``'s on a gathered copy, before and after AdamW steps of the sharded actor (each followed by a sync,
  long prompts so that stale cached prompt blocks would show); the engine's log-probs equal the trainer's (the
  sharded actor's forward); a seeded request gives the same tokens alone as inside a batch; the stream gathers
  a parameter only when the loader asks for it;
- the trainers through the command line: GRPO (full_shard, ``rollout_correction=tis``) whose engine dies on
  process 1 in rollout 2: both processes stop with one line each (the engine's; the survivor's lost process),
  checkpoint step-1 intact; resumed on 2 processes, it ends on the final weights of the uninterrupted run; PPO
  under shard_grad_op; GRPO with a tool (multi-turn episodes from the engine, processes taking different numbers
  of turns); and GRPO data parallel (no sharding: the same external-launcher engines). Each logs
  ``generation/logprob_gap`` (a float32 engine: below 1e-4) and ``time/weight_sync``; an engine given other
  weights on one process only stops both processes at the gap guard.

Run in CI's vLLM environment (.ci/run); skipped where vLLM is not installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.engine.checkpoint import complete_checkpoints
from rlhfkit.engine.metrics_writer import read_metrics
from tests.distributed.test_data_parallel import torchrun
from tests.distributed.test_faults import faulty_launch
from tests.trainers.online.online_fixtures import online_cli_args
from tests.trainers.online.test_online_vllm import VLLM, engine_problem, needs_vllm
from tests.trainers.online.test_tools_online import write_tools_problem
from tests.trainers.online.test_tools_vllm import teach_the_tools_policy, tools_overrides

pytestmark = needs_vllm


def _launch(plan_file: Path, runs: list[list[str]]) -> None:
    plan_file.write_text(json.dumps({"reports": False, "runs": runs}))
    done = torchrun("-m", "tests.distributed.cli_runs", str(plan_file), nproc=2)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "terminate called" not in done.stderr


@pytest.fixture(scope="module")
def engine_check(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded-engine")
    done = torchrun("-m", "tests.distributed.sharded_vllm_worker", str(out), "full_shard", nproc=2)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]


def test_greedy_tokens_equal_hf_before_and_after_updates_on_each_process(engine_check):
    for rank, result in enumerate(engine_check):
        assert result["rank"] == rank and result["threads"] == 1  # two engines on two cores: a thread each
        for when in ("before", "after"):
            pair = result[when]
            assert pair["engine"] == pair["hf"] and pair["engine_mask"] == pair["hf_mask"], (rank, when)
        assert result["after"]["engine"] != result["before"]["engine"]  # the sync brought the new weights
    assert engine_check[0]["before"]["engine"] != engine_check[1]["before"]["engine"]  # each its own prompts


def test_the_engines_logprobs_and_seeds_and_the_lazy_stream(engine_check):
    for result in engine_check:
        sampled = result["sampled"]
        assert 0 <= sampled["logprob_gap_mean"] < 1e-4  # float32 engine on the sharded actor's weights
        assert sampled["tokens_in_batch"] == sampled["tokens_alone"]  # a request's seed, not its batch
        assert sampled["tokens_alone"] != sampled["tokens_other_seed"]
        lazy = result["lazy"]  # the loader's first tensor came before any other parameter was gathered
        assert lazy == {"first_name": "model.embed_tokens.weight", "gathered_at_first": 1, "parameters": 21}


RUN = (*VLLM, "train.save_steps=1", "logging.progress_bar=false", "train.max_steps=2")
GRPO = ("train.sharding=full_shard", "online.rollout_correction=tis")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The engine of process 1 dies in rollout 2 of a sharded GRPO run (a launch of its own); then one launch of
    its resume, the uninterrupted run, PPO under shard_grad_op, GRPO with a tool and GRPO data parallel."""
    tmp = tmp_path_factory.mktemp("sharded-vllm-runs")
    paths = engine_problem(tmp / "problem", reward_model=True)
    tools = write_tools_problem(tmp / "tools-problem")
    teach_the_tools_policy(tools)

    def grpo(name: str) -> list[str]:
        return online_cli_args(paths, tmp / name, *RUN, *GRPO, kind="grpo")

    ppo = online_cli_args(
        paths, tmp / "ppo", *RUN, "train.sharding=shard_grad_op", f"online.reward_model={paths['reward']}"
    )
    tool_config = tmp / "tools.yaml"
    tool_config.write_text("seed: 0\n")
    tool_run = [
        "train",
        "grpo",
        "--config",
        str(tool_config),
        *tools_overrides(
            tools,
            tmp / "tools",
            "online.generation_backend=vllm",
            "online.vllm_max_model_len=96",
            "train.sharding=full_shard",
            "logging.progress_bar=false",
        ),
    ]
    fault = faulty_launch("engine", 1, grpo("broken"))
    stale = faulty_launch("stale", 1, grpo("stale"))
    checkpoints = tmp / "broken" / "checkpoints"
    snapshot = {
        "folders": sorted(p.name for p in checkpoints.iterdir()),
        "complete": [p.name for p in complete_checkpoints(checkpoints)],
        "steps": [r["step"] for r in read_metrics(tmp / "broken" / "metrics.jsonl")],
    }
    data_parallel = online_cli_args(paths, tmp / "data-parallel", *RUN, kind="grpo")  # no sharding
    _launch(tmp / "plan.json", [[*grpo("broken"), "--resume"], grpo("whole"), ppo, tool_run, data_parallel])
    return tmp, fault, snapshot, stale


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def test_an_engine_death_on_one_process_stops_both_with_one_line_each(runs):
    tmp, (code, err, _), snapshot, _ = runs
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("rlhfkit: stopped:")]
    assert len(lines) == 2, err[-4000:]
    assert (
        "rlhfkit: stopped: the vLLM engine failed while generating: RuntimeError: EngineCore died unexpectedly"
        in lines
    )
    (survivor,) = [line for line in lines if "engine" not in line]
    assert survivor.startswith("rlhfkit: stopped: process 0 of 2: another process of this run ended")
    # no process's traceback: the one there is is torchrun's own, reporting the exit codes (4: the engine's
    # process, 5: the survivor's lost process)
    assert err.count("Traceback (most recent call last)") == 1 and "ChildFailedError" in err
    assert (
        "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err and "terminate called" not in err
    )
    assert "exitcode  : 4" in err and "exitcode  : 5" in err
    # the newest checkpoint intact, nothing of the failed rollout saved
    assert snapshot == {"folders": ["step-1", "step-1.sharded"], "complete": ["step-1"], "steps": [1]}


def test_other_weights_in_one_process_engine_stop_every_process_at_the_gap_guard(runs):
    """Process 1's engine gets the actor's weights tripled in rollout 2 (the sync, a collective, still made):
    the gap is summed over the processes, so both stop on it with the same line, before anything of that
    rollout is saved."""
    tmp, _, _, (code, err, _) = runs
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("rlhfkit: stopped:")]
    assert len(lines) == 2 and lines[0] == lines[1], err[-4000:]
    assert lines[0].startswith("rlhfkit: stopped: generation/logprob_gap/mean = ")
    assert "> online.vllm_max_logprob_gap = 0.1: the vLLM engine samples from other weights" in lines[0]
    assert "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err
    assert [p.name for p in complete_checkpoints(tmp / "stale" / "checkpoints")] == ["step-1"]
    assert [r["step"] for r in read_metrics(tmp / "stale" / "metrics.jsonl")] == [1]


def test_the_resumed_run_ends_where_the_uninterrupted_one_does(runs):
    tmp, *_ = runs
    assert [p.name for p in complete_checkpoints(tmp / "broken" / "checkpoints")] == ["step-1", "step-2"]
    assert [r["step"] for r in read_metrics(tmp / "broken" / "metrics.jsonl")] == [1, 2]
    resumed, whole = _weights(tmp / "broken"), _weights(tmp / "whole")
    assert resumed.keys() == whole.keys()
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), name


@pytest.mark.parametrize("name", ["whole", "ppo", "tools", "data-parallel"])
def test_each_run_logs_the_gap_and_the_sync(runs, name):
    tmp, *_ = runs
    rows = [r for r in read_metrics(tmp / name / "metrics.jsonl") if "loss/policy" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # a float32 engine on the actor's weights: its log-probs are the trainer's
        assert 0 <= r["generation/logprob_gap/mean"] < 1e-4 and r["generation/logprob_gap/max"] < 1e-3
        assert r["time/weight_sync"] > 0 and r["time/generate"] > 0
    if name == "tools":  # multi-turn episodes from the engine
        assert all(r["tools/calls_per_episode"] > 0 and r["turns/mean"] > 1 for r in rows)
    assert (tmp / name / "final" / "model.safetensors").is_file()


def test_one_sharded_process_without_a_launcher_runs_with_the_engine(tmp_path, monkeypatch):
    """``rlhfkit train`` on one plain process with ``train.sharding``: the run makes its own process group of one,
    the engine starts beside it (vLLM's one-process executor: no launcher) on the streamed weights, and the
    group outlives the engine's close (the final weights are gathered after it)."""
    from rlhfkit.cli import main

    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    paths = engine_problem(tmp_path / "problem")
    out = tmp_path / "run"
    assert main(online_cli_args(paths, out, *RUN, *GRPO, "train.max_steps=1", kind="grpo")) == 0
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if "loss/policy" in r]
    assert 0 <= row["generation/logprob_gap/mean"] < 1e-4 and row["time/weight_sync"] > 0
    assert (out / "final" / "model.safetensors").is_file()
