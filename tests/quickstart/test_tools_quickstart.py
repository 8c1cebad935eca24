"""`rlhfkit quickstart --task tools` runs SFT on the tool-use demonstrations, then GRPO and PPO with the calculator,
at the smoke preset, and reports each policy's held-out correct-answer and tool-use rates."""

import json

from rlhfkit.cli import main
from rlhfkit.engine.metrics_writer import read_metrics
from rlhfkit.rollout.samples import read_samples


def test_quickstart_tools_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    out = tmp_path / "qs"
    assert main(["quickstart", "--task", "tools", "--preset", "smoke", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"sft", "grpo", "ppo"} and summary["eval_prompts"] == 8
    assert (out / "ppo" / "final_critic").exists() and not (out / "grpo" / "final_critic").exists()
    for figures in summary["policies"].values():
        assert all(0.0 <= figures[k] <= 1.0 for k in ("correct_rate", "tool_use_rate"))
    config = (out / "grpo" / "config.yaml").read_text()
    assert "rlhfkit.tasks.calculator:calculator" in config and "correct_answer_reward" in config
    assert all("tools/calls_per_episode" in row for row in read_metrics(out / "grpo" / "metrics.jsonl"))
    assert all("turns" in row for row in read_samples(out / "grpo" / "samples.jsonl"))
    first = json.loads((out / "task" / "sft_train.jsonl").read_text().splitlines()[0])
    assert first["messages"][0] == {"role": "system", "content": "tools: calculator"}
    assert "tool use" in (out / "report.md").read_text()


def test_quickstart_tools_refuses_a_preset_it_has_not(tmp_path, capsys):
    code = main(["quickstart", "--task", "tools", "--preset", "small", "--out", str(tmp_path / "q")])
    assert code == 2 and "tools" in capsys.readouterr().err
