"""benchmarks/ppo_vs_trl.py: the rlhfkit side of the harness measures what it says.

TRL is not installed here (the harness builds its own virtual environment), so the TRL worker is not run;
what both systems share is: the phase timer's arithmetic, the forced response length, and the wrappers
that attribute time to phases (every phase of a real rlhfkit PPO run is non-zero and the phases add up).
"""

from __future__ import annotations

import argparse
import json

import pytest

from tests.examples.loader import ROOT, load_example, spy_generate

bench = load_example("ppo_vs_trl", ROOT / "benchmarks")


def test_window_is_the_mean_interval_and_other_is_the_rest():
    timer = bench.PhaseTimer()
    timer.marks = [
        (10.0, dict.fromkeys(bench.PHASES[:-1], 0.0)),
        (12.0, {**dict.fromkeys(bench.PHASES[:-1], 0.0), "generation": 0.5, "backward": 1.0}),
        (14.0, {**dict.fromkeys(bench.PHASES[:-1], 0.0), "generation": 1.0, "backward": 2.5}),
    ]
    w = timer.window(0, 2)
    assert w["seconds"] == pytest.approx(2.0)
    assert w["phases"]["generation"] == pytest.approx(0.5)
    assert w["phases"]["backward"] == pytest.approx(1.25)
    assert w["phases"]["other"] == pytest.approx(0.25)


def test_non_embedding_parameters_of_the_tiny_preset(tmp_path):
    info = bench.prepare(tmp_path / "inputs", "tiny", num_pairs=64)
    n = bench.non_embedding_parameters(tmp_path / "inputs" / "policy")
    # 4 layers of (4 x 128^2 attention + 3 x 128 x 512 MLP + 2 x 128 norms) + the final norm
    assert n == 4 * (4 * 128 * 128 + 3 * 128 * 512 + 2 * 128) + 128
    assert info["pairs"] == 64


def test_rlhfkit_ppo_worker_forces_the_length_and_times_every_phase(tmp_path, monkeypatch, capsys):
    work = tmp_path / "inputs"
    bench.prepare(work, "tiny", num_pairs=64)
    lengths, stops = spy_generate(monkeypatch)  # wherever the online loop imports it
    monkeypatch.setattr(bench.sys, "argv", ["ppo_vs_trl.py"])
    bench.run_worker(rlhfkit_ppo_worker(work, response_length=6))
    result = json.loads(capsys.readouterr().out.split("RESULT ")[-1])
    assert lengths and all(n == 6 for rollout in lengths for n in rollout)  # never stops early
    # because the only stop token is one the sampler never emits (a random model rarely samples EOS in 6
    # tokens anyway, so the lengths alone would not show it)
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(work / "policy").pad_token_id
    assert all(ids == [pad] and pad in suppressed for ids, suppressed in stops)
    assert result["marks"] == 3
    for phase in bench.PHASES[:-1]:
        assert result["phases"][phase] > 0, phase
    assert sum(result["phases"].values()) == pytest.approx(result["seconds"])


def rlhfkit_ppo_worker(work, response_length: int) -> argparse.Namespace:
    """The worker arguments of a 3-rollout rlhfkit PPO run of 4 prompts, one thread, fp32."""
    return argparse.Namespace(
        kind="ppo",
        system="rlhfkit",
        work=str(work),
        threads=1,
        rollouts=3,
        batch=4,
        response_length=response_length,
        precision="fp32",
    )


def test_the_worker_leaves_nothing_patched(tmp_path, monkeypatch, capsys):
    """The timer's wrappers and the forced-length patch are taken off when the worker returns (a test
    process goes on to train other models)."""
    import torch
    from transformers.generation.utils import GenerationMixin
    from transformers.models.llama import modeling_llama as llama

    from rlhfkit.trainers.online import loop

    before = (
        GenerationMixin.generate,
        llama.LlamaForCausalLM.forward,
        llama.LlamaModel.forward,
        torch.autograd.backward,
        loop.build_context,
    )
    work = tmp_path / "inputs"
    bench.prepare(work, "tiny", num_pairs=64)
    monkeypatch.setattr(bench.sys, "argv", ["ppo_vs_trl.py"])
    bench.run_worker(rlhfkit_ppo_worker(work, response_length=4))
    after = (
        GenerationMixin.generate,
        llama.LlamaForCausalLM.forward,
        llama.LlamaModel.forward,
        torch.autograd.backward,
        loop.build_context,
    )
    assert after == before
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    assert not _global_optimizer_pre_hooks and not _global_optimizer_post_hooks


def test_precision_reaches_both_systems(monkeypatch, tmp_path):
    """--precision bf16: rlhfkit's model.dtype is bfloat16 (PPO and reward model), TRL's bf16 flag is on, and
    fp32 leaves both in float32."""
    seen = {}
    monkeypatch.setattr(bench, "run_rlhfkit", lambda kind, overrides, out: seen.__setitem__(kind, overrides))
    for precision, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        a = argparse.Namespace(
            work=str(tmp_path),
            rollouts=2,
            batch=4,
            response_length=4,
            steps=2,
            max_length=32,
            precision=precision,
        )
        bench._train_ppo(a, tmp_path)
        bench.worker_reward_rlhfkit(a, tmp_path)
        assert seen["ppo"]["model"]["dtype"] == dtype and seen["reward"]["model"]["dtype"] == dtype
        assert bench.trl_common(a, tmp_path)["bf16"] is (precision == "bf16")
