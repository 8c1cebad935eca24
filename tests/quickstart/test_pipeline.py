"""The quickstart's smoke preset: every stage runs, every file of the report exists, summary.json has the
fields that docs/design.md, "The run folder", names (the figures themselves are measured by the tiny preset,
not here)."""

import json

import pytest

from rlhfkit.cli import main


@pytest.mark.slow
def test_quickstart_smoke_writes_every_stage_report_and_summary(tmp_path, capsys):
    out = tmp_path / "qs"
    assert main(["quickstart", "--out", str(out), "--preset", "smoke"]) == 0
    printed = capsys.readouterr().out
    for stage in (
        "[1/8] task",
        "[2/8] SFT",
        "[3/8] preference pairs",
        "[4/8] reward model",
        "[5/8] PPO",
        "[6/8] DPO",
        "[7/8] evaluation",
        "[8/8] report",
    ):
        assert stage in printed
    assert "PPO win rate vs SFT" in printed and " nan" not in printed
    assert "gold win rate vs SFT" in printed  # the SFT / DPO / PPO table

    summary = json.loads((out / "summary.json").read_text())
    for key in ("gold_mean",):
        assert isinstance(summary["sft"][key], float)
    assert "heldout_accuracy" in summary["reward_model"]
    for key in ("gold_mean", "proxy_mean", "kl_mean"):
        assert isinstance(summary["ppo"][key], float) and isinstance(summary["dpo"][key], float)
    assert 0.0 <= summary["dpo_win_rate_vs_sft"] <= 1.0 and "heldout_accuracy" in summary["dpo_training"]
    assert 0.0 <= summary["win_rate_vs_sft"] <= 1.0 and 0.0 <= summary["win_rate_vs_sft_greedy"] <= 1.0
    assert summary["wall_seconds"] > 0

    for run in ("sft", "reward", "ppo", "dpo"):
        assert (out / run / "final" / "config.json").is_file()
        assert (out / run / "report.md").is_file() and (out / run / "report.html").is_file()
        assert (out / run / "metrics.jsonl").read_text().strip()
    ppo_plots = {p.name for p in (out / "ppo" / "report").glob("*.png")}
    assert {
        "scores.png",
        "kl.png",
        "entropy.png",
        "response_length.png",
        "policy_loss.png",
        "value_loss.png",
        "explained_variance.png",
        "clipfrac.png",
        "gold_vs_sqrt_kl.png",
    } <= ppo_plots
    assert {"calibration.png", "score_histogram.png"} <= {
        p.name for p in (out / "reward" / "report").glob("*.png")
    }
    report = (out / "report.md").read_text()
    assert "ppo/report/gold_vs_sqrt_kl.png" in report and "sft/report/losses.png" in report
    assert "| gold score |" in report and "dpo/report/losses.png" in report
    # One page for every stage: each stage's section, the PPO health panel, the examples.
    page = (out / "report.html").read_text()
    for anchor in (
        'id="sft"',
        'id="reward"',
        'id="ppo"',
        'id="ppo-curves"',
        'id="reward-calibration"',
        'id="examples-table"',
        'id="dpo"',
        'id="policies-table"',
    ):
        assert anchor in page
    # The reward-hacking meter: gold beside proxy on held-out prompts, logged during PPO.
    rows = [json.loads(line) for line in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/gold/mean" in r and "eval/score/mean" in r for r in rows)
