"""examples/experiments/kl_in_loss.py end to end at the smoke size: the task and SFT stage, one GRPO run with
the KL in the loss, its results line and the table and figure built from it."""

from __future__ import annotations

import json
import statistics
import sys

import pytest
import yaml

from tests.examples.loader import load_example


@pytest.mark.long  # end to end, tens of seconds: CI's long step (the suite stays under 15 minutes)
def test_kl_in_loss_experiment_runs_at_smoke_size(tmp_path, monkeypatch):
    script = load_example("experiments/kl_in_loss")
    monkeypatch.setenv("RLHFKIT_NUM_THREADS", "1")
    out = tmp_path / "kl"
    variants = ["k2", "k2@early-sft", "k2+clip-higher@early-sft"]
    monkeypatch.setattr(
        sys, "argv", ["kl_in_loss.py", "--out", str(out), "--smoke", "--seeds", "0", "--variants", *variants]
    )
    script.main()
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["sft_steps"]) for r in results] == [
        (variants[0], 6),
        (variants[1], 3),
        (variants[2], 3),
    ]
    result = results[0]
    assert result["kl_coef"] == 0.1 and len(result["kl"]) >= 1
    assert 0.0 <= result["exact_match"] <= 1.0
    assert (out / "kl_in_loss.png").stat().st_size > 0
    cfg = yaml.safe_load((out / "k2_0" / "config.yaml").read_text())
    assert cfg["online"]["kl_in_loss"] and cfg["online"]["kl_loss_estimator"] == "k2"
    assert cfg["model"]["name_or_path"] == str(out / "base" / "sft" / "final")
    # the high-entropy start: a second SFT policy on the same task files, fewer steps
    for name, steps in (("sft", 6), ("sft-3", 3)):
        sft = yaml.safe_load((out / "base" / name / "config.yaml").read_text())
        assert sft["train"]["max_steps"] == steps and sft["data"]["train_file"] == str(
            out / "base" / "task" / "sft_train.jsonl"
        )
    for variant, clip_high in ((variants[1], None), (variants[2], 0.28)):
        cfg = yaml.safe_load((out / f"{variant}_0" / "config.yaml").read_text())
        assert cfg["model"]["name_or_path"] == str(out / "base" / "sft-3" / "final")
        assert cfg["online"]["kl_loss_estimator"] == "k2" and cfg["online"]["clip_eps_high"] == clip_high
    (decided,) = json.loads((out / "verdicts.json").read_text())
    assert (
        decided["claim"] == "entropy, clip-higher − k2 (from the high-entropy start)"
        and decided["direction"] == 1
    )
    assert decided["verdict"] == "open here"  # one seed
    assert decided["differences"] == [
        pytest.approx(
            statistics.fmean(results[2]["entropy"][-10:]) - statistics.fmean(results[1]["entropy"][-10:])
        )
    ]


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
        "- k2 − k3: KL +1.50 (+2.00 / +1.00); 95% t-interval [-4.85, +7.85]; sign test 2+ 0- (p = 0.5); exact p = 0.5"
    )
    assert "entropy -0.400 (-0.400 / -0.400)" in k2
    (clip,) = [x for x in lines if x.startswith("- k2+clip-higher − k2:")]
    assert "KL +0.00 (+0.00 / +0.00)" in clip and "entropy +0.050 (+0.200 / -0.100)" in clip
    only_k2 = ex.paired_lines([r for r in results if r["variant"] != "k2+clip-higher"], lambda v: v[-1])
    assert not [x for x in only_k2 if "clip-higher" in x]


def test_clip_higher_from_the_high_entropy_start_is_its_own_claim_with_a_verdict():
    ex = load_example("experiments/kl_in_loss")
    # entropy (last 10 rollouts): k2 0.05 / 0.04 / 0.06 and k2+clip-higher 0.05 / 0.05 / 0.05 from the floor;
    # from the high-entropy start k2 0.60 / 0.50 / 0.70 and k2+clip-higher 0.80 / 0.71 / 0.92
    per_variant = {
        "k2": (0.05, 0.04, 0.06),
        "k2+clip-higher": (0.05, 0.05, 0.05),
        "k2@early-sft": (0.6, 0.5, 0.7),
        "k2+clip-higher@early-sft": (0.8, 0.71, 0.92),
    }
    results = [
        {"variant": v, "seed": seed, "kl": [1.0] * 12, "entropy": [ent] * 12, "exact_match": 0.1}
        for v, ents in per_variant.items()
        for seed, ent in enumerate(ents)
    ]
    tail = lambda values: sum(values[-10:]) / 10  # noqa: E731
    decided = {v["claim"]: v for v in ex.verdicts(results, tail)}
    assert set(decided) == {
        "entropy, clip-higher − k2",
        "entropy, clip-higher − k2 (from the high-entropy start)",
    }
    early = decided["entropy, clip-higher − k2 (from the high-entropy start)"]
    assert (early["b"], early["a"], early["direction"]) == ("k2+clip-higher@early-sft", "k2@early-sft", 1)
    assert early["differences"] == pytest.approx([0.2, 0.21, 0.22]) and early["mean"] == pytest.approx(0.21)
    # +0.21 +- 4.30 * 0.01 / sqrt(3): the interval is above 0, but 3 seeds cannot pass the exact test (p >= 0.25)
    assert early["verdict"] == "open here" and early["low"] > 0
    assert decided["entropy, clip-higher − k2"]["verdict"] == "open here"  # 0.00 / +0.01 / -0.01
    (line,) = [
        x
        for x in ex.paired_lines(results, tail)
        if x.startswith("- k2+clip-higher@early-sft − k2@early-sft:")
    ]
    assert "entropy +0.210 (+0.200 / +0.210 / +0.220)" in line
    results[-1]["entropy"] = [0.5] * 12  # seed 2 from the high-entropy start: clip-higher ends below k2
    early = {v["claim"]: v for v in ex.verdicts(results, tail)}[
        "entropy, clip-higher − k2 (from the high-entropy start)"
    ]
    assert early["verdict"] == "open here" and early["low"] < 0
