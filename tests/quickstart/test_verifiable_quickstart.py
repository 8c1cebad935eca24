"""`rlhfkit quickstart --task arithmetic` runs every stage at the smoke preset and reports each policy."""

import json

import pytest

from rlhfkit.cli import main


@pytest.mark.long  # end to end, tens of seconds: CI's long step (the suite stays under 15 minutes)
def test_quickstart_arithmetic_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    out = tmp_path / "qs"
    assert main(["quickstart", "--task", "arithmetic", "--preset", "smoke", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"sft", "grpo", "ppo", "ppo_prm", "ppo_orm"}
    for figures in summary["policies"].values():
        assert all(0.0 <= figures[k] <= 1.0 for k in ("exact_match", "step_accuracy", "valid_rate"))
    assert not (out / "grpo" / "final_critic").exists() and (out / "ppo" / "final_critic").exists()
    ppo_prm = [json.loads(line) for line in (out / "ppo_prm" / "metrics.jsonl").read_text().splitlines()]
    assert any("score/process_mean" in row for row in ppo_prm)
    orm_config = (out / "ppo_orm" / "config.yaml").read_text()  # the ORM alone scores, the critic from SFT
    assert str(out / "orm" / "final") in orm_config and "reward_functions: []" in orm_config
    assert (out / "ppo_orm" / "final_critic").exists() and 0.0 <= summary["orm"]["heldout_accuracy"] <= 1.0
    assert (out / "task" / "orm_train.jsonl").exists() and "ORM held-out" in (out / "report.md").read_text()
    assert "exact match" in (out / "report.md").read_text()


def test_quickstart_refuses_a_preset_the_task_has_not(tmp_path, capsys):
    code = main(["quickstart", "--task", "arithmetic", "--preset", "small", "--out", str(tmp_path / "q")])
    assert code == 2 and "arithmetic" in capsys.readouterr().err
