"""benchmarks/generation_backend.py: one 1-rollout run of each algorithm and backend on the tiny preset, so that
the script the SmolLM2 figures come from runs end to end and reports every phase it promises.

Runs where vLLM is importable (CI: ``RLHFKIT_REQUIRE_VLLM=1`` in ``.venv-vllm``); skipped otherwise."""

from __future__ import annotations

import importlib.util
import os

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
