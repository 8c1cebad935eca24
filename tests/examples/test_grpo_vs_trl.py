"""benchmarks/grpo_vs_trl.py: the comparison's arithmetic and the cost-growth figure, without running either
system (the workers need the real model and TRL's environment; they are the benchmark, not a test).

``measure`` is replaced by a stand-in that returns a fixed run per system and round, so the test checks what
``compare`` makes of runs: the order rotating between rounds, the medians, response tokens/s and the ratios;
and that the figure's stacked phase bars add up to each system's seconds at each size of the grid.
"""

from __future__ import annotations

import argparse
import types

import pytest

from tests.examples.loader import ROOT, load_example

bench = load_example("grpo_vs_trl", ROOT / "benchmarks")


def fake_run(seconds: float, rss: float) -> dict:
    share = dict(zip(bench.PHASES, (0.4, 0.1, 0.2, 0.25, 0.01, 0.04), strict=True))
    return dict(
        seconds=seconds,
        phases={p: seconds * f for p, f in share.items()},
        peak_rss_mib=rss,
        matmul_flops=1e11,
    )


def test_compare_rotates_the_order_and_takes_medians(monkeypatch):
    calls = []
    seconds = {"rlhfkit": iter([20.0, 24.0, 18.0]), "trl": iter([30.0, 40.0, 36.0])}

    def measure(a, system, algo, **sizes):
        calls.append(system)
        return fake_run(next(seconds[system]), 2000.0 if system == "rlhfkit" else 3000.0)

    monkeypatch.setattr(bench, "measure", measure)
    a = argparse.Namespace(repeats=3, micro_batch=8, threads=2, precision="bf16")
    r = bench.compare(a, ["rlhfkit", "trl"], prompts=8, group=4, response_length=48)
    assert calls == ["rlhfkit", "trl", "trl", "rlhfkit", "rlhfkit", "trl"]
    assert r["rlhfkit"]["seconds"] == 20.0 and r["trl"]["seconds"] == 36.0
    assert r["rlhfkit"]["tokens_per_second"] == pytest.approx(8 * 4 * 48 / 20.0)
    assert r["speedup"] == pytest.approx(36.0 / 20.0)
    assert r["rss_ratio"] == pytest.approx(2000.0 / 3000.0)
    assert r["responses"] == 32 and r["rlhfkit"]["all_seconds"] == [20.0, 24.0, 18.0]


def test_the_grid_reaches_512_tokens_and_256_responses():
    assert max(length for _, _, length in bench.SCALING) == 512
    assert max(p * g for p, g, _ in bench.SCALING) == 256
    # each sweep varies one thing from the 32 x 48 corner, so both panels share it
    assert (8, 4, 48) in bench.SCALING


def test_scaling_figure_stacks_each_systems_phases_to_its_seconds(tmp_path):
    results = []
    for k, (prompts, group, length) in enumerate(bench.SCALING):
        results.append(
            dict(
                prompts=prompts, group=group, response_length=length, responses=prompts * group,
                threads=2, precision="bf16", rounds=1, micro_batch=8,
                rlhfkit=fake_run(10.0 + k, 2000.0 + k), trl=fake_run(20.0 + 3 * k, 3000.0 + k),
            )
        )  # fmt: skip
    path = tmp_path / "scaling.png"
    fig = bench.plot_scaling(results, path)
    assert path.stat().st_size > 10_000
    for col, key, fixed in (
        (0, "response_length", ("responses", 32)),
        (1, "responses", ("response_length", 48)),
    ):
        rows = sorted((r for r in results if r[fixed[0]] == fixed[1]), key=lambda r: r[key])
        ax = fig.axes[2 * 2 + col]  # the third row: where the time goes
        assert [t.get_text() for t in ax.get_xticklabels()] == [str(r[key]) for r in rows]
        tops: dict[float, float] = {}
        for bar in ax.patches:
            x = round(bar.get_x() + bar.get_width() / 2, 6)
            tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
        got = [tops[x] for x in sorted(tops)]
        want = [r[n]["seconds"] for r in rows for n in ("rlhfkit", "trl")]
        assert got == pytest.approx(want)
        # and the line panels show the same totals
        lines = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[col].get_lines()}
        assert lines["rlhfkit GRPO"] == pytest.approx([r["rlhfkit"]["seconds"] for r in rows])


def test_vllm_mode_times_the_engine_generate_and_each_sync(monkeypatch):
    """``--vllm``: the engine's ``LLM.generate`` is the generation phase and marks a rollout; each system's weight
    sync is timed on its own; everything is put back (fake vLLM and TRL modules: the wrappers, not the engines)."""
    import sys

    import ppo_vs_trl

    class LLM:
        def generate(self, prompts):
            return ["out"] * len(prompts)

    class VLLMGeneration:
        def sync_weights(self):
            return "synced"

    trl_module = types.ModuleType("trl.generation.vllm_generation")
    trl_module.VLLMGeneration = VLLMGeneration
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setitem(sys.modules, "trl.generation.vllm_generation", trl_module)
    timer = ppo_vs_trl.PhaseTimer()
    timer.undo = []
    sync = bench.engine_timers(timer)
    engine, generation = LLM(), VLLMGeneration()
    for _ in range(3):
        assert generation.sync_weights() == "synced"
        assert engine.generate(["a", "b"]) == ["out", "out"]
    assert len(timer.marks) == 3 and len(sync["seconds"]) == 3
    assert timer.seconds["generation"] > 0 and not timer.in_generate
    timer.uninstall()
    assert LLM.generate.__name__ == "generate" and not hasattr(LLM.generate, "__wrapped__")
    assert not hasattr(VLLMGeneration.sync_weights, "__wrapped__")


def test_compare_takes_the_median_weight_sync(monkeypatch):
    syncs = iter([1.0, 3.0, 2.0, 0.5, 0.7, 0.6])

    def measure(a, system, algo, **sizes):
        return fake_run(20.0, 2000.0) | {"weight_sync_seconds": next(syncs)}

    monkeypatch.setattr(bench, "measure", measure)
    a = argparse.Namespace(repeats=3, micro_batch=8, threads=2, precision="fp32")
    r = bench.compare(a, ["rlhfkit", "trl"], prompts=8, group=4, response_length=48)
    assert sorted([r["rlhfkit"]["weight_sync_seconds"], r["trl"]["weight_sync_seconds"]]) == [0.7, 2.0]
    assert "weight sync" in bench.report(r)


@pytest.mark.parametrize("defaults", [False, True])
def test_rlhfkit_defaults_leaves_the_micro_batch_to_rlhfkit(monkeypatch, tmp_path, defaults):
    seen = {}

    def run_rlhfkit(algo, config, out):
        seen.update(config)
        raise RuntimeError("stop: the configuration is all this test reads")

    monkeypatch.setattr(bench.common, "run_rlhfkit", run_rlhfkit)
    a = argparse.Namespace(
        prompts=8, group=4, algo="grpo", rollouts=3, response_length=48, epochs=1, vllm=False, micro_batch=8,
        rlhfkit_defaults=defaults, model="m", precision="fp32", work=tmp_path,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="stop"):
        bench.worker_rlhfkit(a, tmp_path, timer=types.SimpleNamespace(wrap_forward=lambda f: f))
    assert ("micro_batch_size" in seen["train"]) is not defaults
    assert seen["train"].get("micro_batch_size", 8) == 8
