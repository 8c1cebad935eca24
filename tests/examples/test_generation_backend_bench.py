"""benchmarks/generation_backend.py: one 1-rollout run of each algorithm and backend on the tiny preset, so that
the script the SmolLM2 figures come from runs end to end and reports every phase it promises.

That run needs vLLM (CI: ``RLHFKIT_REQUIRE_VLLM=1`` in ``.venv-vllm``; skipped where it is not importable). The
sharded runs' launch (torchrun's command, settings, environment, the one result line) is checked without
launching anything."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest
import yaml

from tests.examples.loader import ROOT, load_example

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and not os.environ.get("RLHFKIT_REQUIRE_VLLM"),
    reason="vLLM is not installed (./setup.sh vllm, or pip install 'rlhfkit[vllm]')",
)


@needs_vllm
def test_one_rollout_of_grpo_and_ppo_with_each_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    bench = load_example("generation_backend", ROOT / "benchmarks")
    args = ["--preset", "tiny", "--dtypes", "float32", "--lengths", "6", "--responses", "4"]
    args += [
        "--group-size",
        "2",
        "--rollouts",
        "1",
        "--repeats",
        "1",
        "--epochs",
        "1",
        "--forced-length",
        "--micro-batch",
        "2",
        "--out",
        str(tmp_path),
    ]
    lines = bench.main(args)
    assert [(x["algo"], x["backend"]) for x in lines] == [
        ("grpo", "hf"),
        ("grpo", "vllm"),
        ("ppo", "hf"),
        ("ppo", "vllm"),
    ]
    for x in lines:
        assert x["rollouts_timed"] == 1 and x["rollout_seconds"] > 0 and x["time/generate"] > 0
        assert x["rest"] == pytest.approx(x["rollout_seconds"] - x["time/generate"] - x["time/weight_sync"])
        assert (x["time/weight_sync"] > 0) == (x["backend"] == "vllm")
        assert x["response_length"] == 6  # --forced-length: no response ends early
    assert all(x["generate_vs_hf"] > 0 for x in lines if x["backend"] == "vllm")
    for run in (tmp_path / "runs").iterdir():  # --epochs and --micro-batch reached every run
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["online"]["ppo_epochs"] == 1 and config["train"]["micro_batch_size"] == 2, run


def test_sharded_runs_are_launched_with_torchrun_and_name_their_launch(tmp_path, monkeypatch):
    """--processes 2 --sharding full_shard: every run is torchrun's 2 processes of this script's child, with
    train.sharding set, --forced-length passed on and one torch thread a process on two cores; one process
    without sharding stays the plain child command."""
    monkeypatch.delenv("RLHFKIT_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    bench = load_example("generation_backend", ROOT / "benchmarks")
    script = str(ROOT / "benchmarks" / "generation_backend.py")
    paths = {"model": "m", "prompts": "p.jsonl", "reward": "r.py"}

    sharded = bench.parse_args(["--processes", "2", "--sharding", "full_shard", "--forced-length"])
    settings = bench.run_settings(sharded, paths, "grpo", "float32", 48, "vllm", tmp_path)
    assert "train.sharding=full_shard" in settings and "train.batch_size=8" in settings
    command, env = bench.launch_command(sharded, settings, "grpo")
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script]
    assert command[1:7] == torchrun
    assert command[7:] == ["--child", json.dumps(settings), "--algo", "grpo", "--forced-length"]
    assert env["RLHFKIT_NUM_THREADS"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "3")  # the user's count is kept
    assert bench.launch_command(sharded, settings, "grpo")[1]["RLHFKIT_NUM_THREADS"] == "3"

    monkeypatch.delenv("RLHFKIT_NUM_THREADS")
    single = bench.parse_args(["--forced-length"])
    settings = bench.run_settings(single, paths, "grpo", "float32", 48, "vllm", tmp_path)
    assert not any(s.startswith("train.sharding=") for s in settings)
    command, env = bench.launch_command(single, settings, "grpo")
    assert command == [bench.sys.executable, script, "--child", json.dumps(settings), "--algo", "grpo"] + [
        "--forced-length"
    ]
    assert "RLHFKIT_NUM_THREADS" not in env


def test_sharded_runs_print_their_launch_and_take_the_one_result(tmp_path, monkeypatch):
    """The printed lines name processes and sharding; a launch whose processes print no RESULT line, or more
    than one, fails instead of being read."""
    bench = load_example("generation_backend", ROOT / "benchmarks")
    files = {"model": "m", "prompts": "p", "reward": "r"}
    monkeypatch.setattr(bench, "prepare", lambda out, model, preset: files)
    result = {"world_size": 2, "rollout_seconds": 2.0, "time/generate": 1.0, "time/weight_sync": 0.5}
    result_line = "RESULT " + json.dumps(result)
    launched = []

    def run(command, **kwargs):
        launched.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=f"log\n{result_line}\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", run)
    args = ["--algos", "grpo", "--dtypes", "float32", "--lengths", "16", "--repeats", "1"]
    args += ["--out", str(tmp_path), "--processes", "2", "--sharding", "full_shard"]
    lines = bench.main(args)
    assert [(x["backend"], x["processes"], x["sharding"], x["world_size"]) for x in lines] == [
        ("hf", 2, "full_shard", 2),
        ("vllm", 2, "full_shard", 2),
    ]
    assert all("--nproc_per_node" in c for c in launched)
    assert "2-full_shard-grpo-float32-16-hf-0" in json.loads(launched[0][launched[0].index("--child") + 1])[0]

    for stdout in ("no result\n", f"{result_line}\n{result_line}\n"):
        done = subprocess.CompletedProcess([], 0, stdout, "")
        monkeypatch.setattr(bench.subprocess, "run", lambda command, done=done, **kwargs: done)
        with pytest.raises(SystemExit, match="RESULT lines"):
            bench.main(args)
    with pytest.raises(SystemExit):
        bench.parse_args(["--sharding", "full_shard", "--lora-rank", "8"])
