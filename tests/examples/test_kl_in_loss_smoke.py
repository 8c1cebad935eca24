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


def test_the_report_pairs_k2_with_k3_and_clip_higher_with_k2_per_seed():
    ex = load_example("experiments/kl_in_loss")
    # KL over the last 10 rollouts: k3 1.0 and 2.0, k2 3.0 and 3.0 -> differences +2.0, +1.0;
    # entropy: k2 0.5 and 0.5, k2+clip-higher 0.7 and 0.4 -> +0.2, -0.1 (against k2, not k3's 0.9)
    results = [
        {"variant": v, "seed": seed, "kl": [kl] * 12, "entropy": [ent] * 12, "exact_match": 0.1}
        for v, per_seed in (
            ("k3", ((1.0, 0.9), (2.0, 0.9))),
            ("k2", ((3.0, 0.5), (3.0, 0.5))),
            ("k2+clip-higher", ((3.0, 0.7), (3.0, 0.4))),
        )
        for seed, (kl, ent) in enumerate(per_seed)
    ]
    lines = ex.paired_lines(results, lambda values: sum(values[-10:]) / 10)
    (k2,) = [x for x in lines if x.startswith("- k2 − k3:")]
    # mean 1.5, sd 0.7071, half-width 12.706 * 0.7071 / sqrt(2) = 6.35
    assert k2.startswith(
        "- k2 − k3: KL +1.50 (+2.00 / +1.00); 95% t-interval [-4.85, +7.85]; sign test 2+ 0- (p = 0.5)"
    )
    assert "entropy -0.400 (-0.400 / -0.400)" in k2
    (clip,) = [x for x in lines if x.startswith("- k2+clip-higher − k2:")]
    assert "KL +0.00 (+0.00 / +0.00)" in clip and "entropy +0.050 (+0.200 / -0.100)" in clip
    only_k2 = ex.paired_lines([r for r in results if r["variant"] != "k2+clip-higher"], lambda v: v[-1])
    assert not [x for x in only_k2 if "clip-higher" in x]
