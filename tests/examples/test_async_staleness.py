"""examples/experiments/async_staleness.py: the arms ask for the staleness the plan's claim names, the comparison it
prints is the plan's k1 - k0 decided by the page's rule, the overlap figures and the launched processes are read
from a run's files, and end to end at the smoke size (one seed: both arms under torchrun, their logged staleness,
the 4-sample reads, the cache, --report-only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from rlhfkit.quickstart.pipeline import PRESETS, ppo_settings
from tests.examples.loader import load_example, smoke_seed

STAGE = {"sft": Path("s/sft"), "reward": Path("s/reward"), "prompts_train": Path("s/prompts.jsonl")}


def results(gold_by_seed):
    """``figures.json`` contents with the given gold per policy (one dict per seed)."""
    arms = {"k0": {"staleness_mean": None, "dropped": None}, "k1": {"staleness_mean": 0.5, "dropped": 0.0}}
    return [
        {"seed": s, "reads": {k: {"gold": v} for k, v in gold.items()}, "arms": arms}
        for s, gold in enumerate(gold_by_seed)
    ]


def comparison_line(script, seeds) -> str:
    text = script.report(results(seeds))
    (line,) = [x for x in text.splitlines() if x.startswith("- async-staleness.")]
    return line


def test_the_report_reads_k1_minus_k0_under_the_plans_margin():
    script = load_example("experiments/async_staleness")
    wobble = [0.01 * (i % 3 - 1) for i in range(10)]
    # k1 ends 0.3 below k0 on every seed: the 95% interval lies wholly below -0.1, so the claim fails
    below = comparison_line(script, [{"sft": 0.0, "k0": 1.0 + w, "k1": 0.7 - w} for w in wobble])
    assert below.startswith("- async-staleness.k1 (k1 - k0): -0.30 (-0.28 / -0.30 / -0.32 / ")
    assert below.endswith("-> fails") and "Holm" not in below  # a no-difference claim is in no correction
    # within 0.02 of each other: no difference within the registered 0.1
    alike = comparison_line(script, [{"sft": 0.0, "k0": 1.0 + w, "k1": 1.0 - w} for w in wobble])
    assert alike.endswith("-> no difference (within ±0.1)")
    table = script.report(results([{"sft": 0.0, "k0": 1.0, "k1": 0.5}, {"sft": 0.2, "k0": 0.6, "k1": 0.5}]))
    assert (
        "| sft | 0.100 | 0.00 / 0.20 |\n| k0 | 0.800 | 1.00 / 0.60 |\n| k1 | 0.500 | 0.50 / 0.50 |" in table
    )
    assert "| k0 | not logged / not logged | not logged / not logged |" in table
    assert "| k1 | 0.50 / 0.50 | 0 / 0 |" in table


def test_the_arms_ask_for_the_registered_staleness_with_the_quickstarts_ppo():
    script = load_example("experiments/async_staleness")
    p = PRESETS["tiny"]
    quickstart = ppo_settings(STAGE["sft"], STAGE["reward"], STAGE["prompts_train"], p, 3)
    asked = {}
    for arm in ("k0", "k1"):
        keys = script.arm_settings(arm, STAGE, p, 3)
        asked[arm] = (keys.pop("online.max_staleness"), keys.pop("online.generation_processes"))
        assert keys == quickstart  # every other key is the quickstart's PPO
    assert asked == {"k0": (0, 0), "k1": (1, 1)}
    argv = script.launch_argv(Path("k1.yaml"))
    assert argv[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert argv[5:] == ["-m", "rlhfkit", "train", "ppo", "--config", "k1.yaml", "--overwrite"]


def test_the_overlap_figures_and_launched_processes_are_read_from_a_runs_files(tmp_path):
    script = load_example("experiments/async_staleness")
    rows = [
        {"step": 1, "async/staleness_mean": 0.0, "async/staleness_max": 0.0, "async/dropped": 0.0},
        {"step": 1, "eval/gold": 0.5},  # a row without the overlap's keys counts for nothing
        {"step": 2, "async/staleness_mean": 1.0, "async/staleness_max": 1.0, "async/dropped": 2.0},
        {"step": 3, "async/staleness_mean": 0.5, "async/staleness_max": 1.0, "async/dropped": 1.0},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert script.overlap_figures(metrics) == {
        "staleness_mean": pytest.approx(0.5),
        "staleness_max": 1.0,
        "dropped": 3.0,
        "overlap_rollouts": 3,
    }
    metrics.write_text(json.dumps({"step": 1, "score/mean": 0.1}) + "\n")
    assert script.overlap_figures(metrics) == {
        "staleness_mean": None,
        "staleness_max": None,
        "dropped": None,
        "overlap_rollouts": 0,
    }
    log = tmp_path / "k1.log"
    log.write_text("loading\nrlhfkit: ppo on 2 processes (torchrun, gloo, cpu), 1 torch thread each\n")
    assert script.launched_processes(log) == 2
    log.write_text("Traceback (most recent call last):\n")
    with pytest.raises(RuntimeError, match="no 'rlhfkit: ppo on N processes' line"):
        script.launched_processes(log)


def test_an_arm_that_reports_another_world_size_stops_the_seed(tmp_path, monkeypatch):
    script = load_example("experiments/async_staleness")
    one = "import sys; print('rlhfkit: ppo on 1 process (python, cpu), 1 torch thread', file=sys.stderr)"
    monkeypatch.setattr(script, "launch_argv", lambda config: [sys.executable, "-c", one])
    keys = script.arm_settings("k1", STAGE, PRESETS["smoke"], 0)
    with pytest.raises(RuntimeError, match="reports 1 processes, launched with 2"):
        script.run_arm(tmp_path, "k1", keys)
    assert not (tmp_path / "k1.json").exists()  # not cached: the next call runs the arm again


@pytest.mark.long  # end to end, 97 s on two shared cores: CI's long step
def test_async_staleness_runs_at_smoke_size_with_the_asked_staleness(tmp_path, monkeypatch, capsys):
    script = load_example("experiments/async_staleness")
    monkeypatch.setenv("ASYNC_STALENESS_COMMIT", "0123abc")
    out = tmp_path / "async"
    figures = smoke_seed(script, out)  # the reads: 4 samples of each of 8 held-out prompts
    seed = out / "seed-0"
    assert figures["commit"] == "0123abc" and set(figures["reads"]) == {"sft", "k0", "k1"}
    logged = {}
    for arm, k in (("k0", 0), ("k1", 1)):
        online = yaml.safe_load((seed / arm / "config.yaml").read_text())["online"]
        assert (online["max_staleness"], online["generation_processes"]) == (k, k)
        assert "rlhfkit: ppo on 2 processes (torchrun" in (seed / f"{arm}.log").read_text()
        lines = (seed / arm / "metrics.jsonl").read_text().splitlines()
        logged[arm] = [r for r in map(json.loads, lines) if "score/mean" in r]
        assert [r["step"] for r in logged[arm]] == [1, 2, 3]
        assert figures["arms"][arm]["processes"] == 2 and figures["arms"][arm]["threads_per_process"] == 1
    # k = 0: the synchronous loop, which logs no staleness (every sample is trained by the weights that drew it)
    assert not any(key.startswith("async/") for r in logged["k0"] for key in r)
    assert figures["arms"]["k0"]["staleness_mean"] is None and figures["arms"]["k0"]["overlap_rollouts"] == 0
    # k = 1: rollout 1 sampled with the first weights, rollouts 2 and 3 one version behind the trainer's
    assert [r["async/staleness_max"] for r in logged["k1"]] == [0.0, 1.0, 1.0]
    assert [r["async/dropped"] for r in logged["k1"]] == [0.0, 0.0, 0.0]
    k1 = figures["arms"]["k1"]
    assert k1["staleness_mean"] == pytest.approx(2 / 3) and k1["staleness_max"] == 1.0 and k1["dropped"] == 0
    capsys.readouterr()
    # a finished seed is read back, not run again; --report-only prints the registered comparison
    assert script.main(["--out", str(out), "--seeds", "0", "--smoke"]) == 0
    assert "[seed-0]" not in capsys.readouterr().out
    assert json.loads((seed / "figures.json").read_text())["reads"] == figures["reads"]
    assert script.main(["--out", str(out), "--seeds", "0", "--report-only"]) == 0
    printed = capsys.readouterr().out
    difference = figures["reads"]["k1"]["gold"] - figures["reads"]["k0"]["gold"]
    assert f"- async-staleness.k1 (k1 - k0): {difference:+.2f} " in printed
