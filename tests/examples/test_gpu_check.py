"""benchmarks/gpu_check.py: the smoke run (CPU, tiny Llama, every part) writes the JSON a GPU run writes, each
part run or skipped with its reason; the card table, the MFU arithmetic and the per-part guard, by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.examples.loader import ROOT, load_example

TRAINING = ("ppo", "grpo", "dpo", "fsdp_nccl", "lora", "distill")


@pytest.mark.slow
def test_the_smoke_run_runs_every_part_or_says_why_not(tmp_path):
    out = tmp_path / "check.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(out)]
    env = {**os.environ, "RLHFKIT_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, "--work", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    bench = load_example("gpu_check", ROOT / "benchmarks")
    assert report["mode"] == "smoke" and list(report["parts"]) == list(bench.PARTS)
    assert report["device"]["cuda"] is False and report["device"]["bf16_peak_tflops"] is None
    assert report["model"]["policy"]["matmul_parameters"] > 0 and report["wall_seconds"] > 0
    parts = report["parts"]
    for name, part in parts.items():
        assert part["status"] in ("ok", "skipped"), (name, part.get("error"), part.get("stderr_tail"))
        if part["status"] == "skipped":
            assert isinstance(part["reason"], str) and part["reason"], name
    assert parts["vllm"]["status"] == "skipped"
    for name in TRAINING:
        part = parts[name]
        assert part["status"] == "ok" and part["exit_code"] == 0, name
        assert part["steps_logged"] == 2 and part["steps_timed"] == 1, name
        assert part["seconds_per_step"] > 0 and part["tokens_per_second"] > 0, name
        assert part["peak_memory_bytes"] > 0 and part["model_flops_per_step"] > 0, name
        assert part["mfu"] is None, name  # no bf16 peak for a CPU
    # the FSDP2 part: one torchrun process, sharded, over the CPU's backend (NCCL takes its place on a GPU)
    run = parts["fsdp_nccl"]["run"]
    assert (run["launcher"], run["backend"], run["sharding"], run["world_size"]) == (
        "torchrun",
        "gloo",
        "full_shard",
        1,
    )
    assert parts["ppo"]["run"]["sharding"] == "none" and parts["ppo"]["run"]["device"] == "cpu"
    # overlapping rollouts: a trainer and a generator under torchrun (gloo here), 3 rollouts of which the last
    # two were sampled one version behind; one update's weights were sent (the last one samples nothing)
    run, overlap = parts["async"]["run"], parts["async"]
    assert (run["launcher"], run["backend"], run["world_size"]) == ("torchrun", "gloo", 2)
    assert overlap["command"] == "rlhfkit train grpo under torchrun --nproc_per_node 2"
    assert overlap["steps_logged"] == 3 and overlap["steps_timed"] == 2
    assert overlap["seconds_per_step"] > 0 and overlap["tokens_per_second"] > 0
    assert overlap["staleness_max"] == 1.0 and overlap["dropped"] == 0.0
    assert overlap["trainer_idle_seconds"] >= 0 and overlap["generator_idle_seconds"] >= 0
    assert overlap["generation_seconds"] > 0
    assert overlap["weight_transfers"] == 1 and overlap["weight_transfer_seconds"] > 0
    # LoRA's update computes no weight gradients for the base: 4 N T instead of 6 N T per epoch
    assert parts["lora"]["model_flops_per_step"] < parts["ppo"]["model_flops_per_step"]
    # distillation: the teacher read the student's tokens (a sampled estimate: any sign) and the full-vocabulary
    # loss was trained (a divergence: >= 0)
    assert parts["distill"]["command"] == "rlhfkit train distill"
    assert abs(parts["distill"]["distill_teacher_kl"]) < 1 and parts["distill"]["loss_distill"] >= 0
    # the cuda-marked tests ran and skipped, every one, for want of a device
    cuda = parts["cuda_tests"]
    assert "tests/engine/test_cuda_paths.py" in cuda["files"]
    assert cuda["passed"] == cuda["failed"] == cuda["errors"] == 0 and cuda["skipped"] >= 3
    assert cuda["skip_reasons"] and all("CUDA" in reason for reason in cuda["skip_reasons"])


def test_known_cards_and_an_unknown_one():
    bench = load_example("gpu_check", ROOT / "benchmarks")
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0  # SXM
    assert bench.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench.peak_tflops("NVIDIA H200") == 989.0
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert bench.peak_tflops("Tesla T4") is None


def test_mfu_and_tokens_per_second_by_hand():
    bench = load_example("gpu_check", ROOT / "benchmarks")
    model = {"policy": {"matmul_parameters": 1000}, "reward": {"matmul_parameters": 100}}
    s = bench.SIZES["full"]
    metrics = [
        {"step": 1, "time/step_seconds": 9.0, "tokens_per_second": 1.0, "response_length/mean": 128.0},
        {"step": 2, "time/step_seconds": 2.0, "tokens_per_second": 2048.0, "response_length/mean": 128.0},
        {"step": 3, "time/step_seconds": 2.0, "tokens_per_second": 2048.0, "response_length/mean": 128.0},
    ]
    got = bench.training_figures("ppo", "full", model, metrics, peak=100.0)
    # 32 responses x (64 + 128) tokens; generation + reference 2 N T each, reward model + critic values 2 N_s T
    # each, 2 epochs of 6 (N + N_s) T
    tokens = 32 * (s["prompt"] + 128)
    flops = 4 * 1000 * tokens + 4 * 100 * tokens + 2 * 6 * 1100 * tokens
    assert got["steps_timed"] == 2 and got["seconds_per_step"] == 2.0 and got["tokens_per_second"] == 2048.0
    assert got["model_flops_per_step"] == flops
    assert got["mfu"] == pytest.approx(flops / (2.0 * 100e12))
    assert bench.training_figures("ppo", "full", model, metrics, peak=None)["mfu"] is None
    # DPO: 16 pairs x 2 x (64 + 128 + 1) tokens through the policy (6 N T) and the reference (2 N T)
    dpo = bench.training_figures("dpo", "full", model, metrics, peak=100.0)
    dpo_tokens = 16 * 2 * (64 + 128 + 1)
    assert (
        dpo["model_flops_per_step"] == 8 * 1000 * dpo_tokens and dpo["tokens_per_second"] == dpo_tokens / 2.0
    )


def test_a_failing_part_is_recorded_and_the_next_runs_and_the_budget_skips_the_rest(tmp_path, monkeypatch):
    bench = load_example("gpu_check", ROOT / "benchmarks")
    ran = []

    def run_training(part, *args):
        ran.append(part)
        if part == "ppo":
            raise RuntimeError("CUDA out of memory")
        return {"status": "ok"}

    monkeypatch.setattr(bench, "run_training", run_training)
    out = tmp_path / "check.json"
    args = ["--smoke", "--out", str(out), "--work", str(tmp_path), "--parts", "ppo,grpo"]
    assert bench.main(args) == 0
    parts = json.loads(out.read_text())["parts"]
    assert ran == ["ppo", "grpo"]
    assert parts["ppo"]["status"] == "failed" and parts["ppo"]["error"] == "RuntimeError: CUDA out of memory"
    assert parts["grpo"]["status"] == "ok" and parts["grpo"]["seconds"] >= 0
    ran.clear()
    assert bench.main([*args[:-1], "dpo,lora", "--budget-s", "0"]) == 0
    parts = json.loads(out.read_text())["parts"]
    assert ran == [] and all(p["reason"].startswith("time budget") for p in parts.values())


def test_the_async_figures_by_hand_and_a_staleness_over_1_fails_the_part(tmp_path):
    bench = load_example("gpu_check", ROOT / "benchmarks")

    def row(step, staleness, dropped, trainer_idle, generation, sent):
        return {
            "step": step,
            "async/staleness_max": staleness,
            "async/dropped": dropped,
            "async/trainer_idle_seconds": trainer_idle,
            "async/generator_idle_seconds": 0.1 * step,
            "async/generation_seconds": generation,
            "async/weight_transfer_seconds": sent,
        }

    metrics = [
        row(1, 0.0, 0.0, 9.0, 9.0, 0.5),
        row(2, 1.0, 2.0, 1.0, 2.0, 0.25),
        row(3, 1.0, 1.0, 3.0, 4.0, 0.0),
        row(4, 1.0, 0.0, 2.0, 3.0, 0.0),
    ]
    got = bench.async_figures(metrics)
    # the first step left out of the medians; the transfers: the two updates that sent weights
    assert got == {
        "staleness_max": 1.0,
        "dropped": 3.0,
        "trainer_idle_seconds": 2.0,
        "generator_idle_seconds": pytest.approx(0.3),
        "generation_seconds": 3.0,
        "weight_transfer_seconds": 0.375,
        "weight_transfers": 2,
    }
    assert "async_error" in bench.async_figures([{"step": 1, "time/step_seconds": 1.0}])
    # a run whose trainer took a sample two versions old (online.max_staleness=1) fails the part
    out = tmp_path / "run"
    out.mkdir()
    timing = {"time/step_seconds": 1.0, "tokens_per_second": 8.0, "response_length/mean": 4.0}
    metrics[2]["async/staleness_max"] = 2.0
    (out / "metrics.jsonl").write_text("".join(json.dumps({**m, **timing}) + "\n" for m in metrics))
    (tmp_path / "result.json").write_text(json.dumps({"exit_code": 0}))
    model = {"policy": {"matmul_parameters": 10}, "reward": {"matmul_parameters": 10}}
    done = subprocess.CompletedProcess([], 0, "", "")
    record = bench.finish_training(
        "async", "smoke", out, tmp_path / "result.json", model, None, done, "grpo", 2
    )
    assert record["status"] == "failed" and record["error"] == "staleness 2.0 > 1"
    metrics[2]["async/staleness_max"] = 1.0
    (out / "metrics.jsonl").write_text("".join(json.dumps({**m, **timing}) + "\n" for m in metrics))
    record = bench.finish_training(
        "async", "smoke", out, tmp_path / "result.json", model, None, done, "grpo", 2
    )
    assert record["status"] == "ok" and record["staleness_max"] == 1.0


def test_the_error_line_is_rlhfkits_own_or_the_tracebacks_last():
    bench = load_example("gpu_check", ROOT / "benchmarks")
    assert (
        bench.error_line("loading\nrlhfkit: error: data.jsonl, line 3: bad\n", 2)
        == "rlhfkit: error: data.jsonl, line 3: bad"
    )
    traceback = (
        'Traceback (most recent call last):\n  File "x.py"\ntorch.OutOfMemoryError: CUDA out of memory\n'
    )
    assert bench.error_line(traceback, 1) == "torch.OutOfMemoryError: CUDA out of memory"
    assert bench.error_line("", 1) == "exit code 1 and nothing on stderr"


def test_the_sampler_part_checks_the_exact_draw_and_times_it():
    """The ``sampler`` part on this CPU (what --smoke runs): the draw's total variation under 1e-9 at 49,152
    entries, no masked token drawn, the same tokens as the CPU's, and milliseconds per step for both draws."""
    bench = load_example("gpu_check", ROOT / "benchmarks")
    record = bench.run_sampler_check("smoke")
    assert record["status"] == "ok" and record["device"] == "cpu" and record["threads"] == 1
    assert record["total_variation_max"] <= 1e-9 and record["total_variation_vocab"] == 49152
    assert record["masked_drawn"] == 0 and record["draws"] == 40 * 256
    assert record["device_vs_cpu_disagreements"] == 0
    for shape in ("32x49152", "32x151936"):
        assert (
            record["ms_per_step"][shape]["exact_ms"] > 0
            and record["ms_per_step"][shape]["multinomial_ms"] > 0
        )
