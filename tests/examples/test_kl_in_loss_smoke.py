"""examples/experiments/kl_in_loss.py end to end at the smoke size: the task and SFT stage, one GRPO run with
the KL in the loss, its results line and the table and figure built from it."""

from __future__ import annotations

import json
import sys

import pytest

from tests.examples.loader import load_example


@pytest.mark.slow
def test_kl_in_loss_experiment_runs_at_smoke_size(tmp_path, monkeypatch):
    script = load_example("experiments/kl_in_loss")
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    out = tmp_path / "kl"
    monkeypatch.setattr(
        sys, "argv", ["kl_in_loss.py", "--out", str(out), "--smoke", "--seeds", "0", "--variants", "k2"]
    )
    script.main()
    (result,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert result["variant"] == "k2" and result["kl_coef"] == 0.1 and len(result["kl"]) >= 1
    assert 0.0 <= result["exact_match"] <= 1.0
    assert (out / "kl_in_loss.png").stat().st_size > 0
    cfg = (out / "k2_0" / "config.yaml").read_text()
    assert "kl_in_loss: true" in cfg and "kl_loss_estimator: k2" in cfg
