"""examples/experiments/quickstart_seeds.py: the table of the quickstart's SFT, DPO and PPO over seeds, by hand from
the quickstarts' summary.json, and the command each missing seed runs. The quickstart itself runs end to end at
its smoke size in tests/quickstart/test_pipeline.py; the figures come from the full runs (docs/experiments.md)."""

from __future__ import annotations

import csv
import json
import sys

import pytest

from tests.examples.loader import load_example

ex = load_example("experiments/quickstart_seeds")


def _summary(seed, gold):
    """A quickstart's summary.json: SFT, DPO and PPO with gold ``gold[k]``, the other figures from it."""
    summary = {"preset": "tiny", "seed": seed, "reward_model": {"heldout_accuracy": 0.8 + 0.02 * seed}}
    for k, key in enumerate(("sft", "dpo", "ppo")):
        summary[key] = {"gold_mean": gold[k], "proxy_mean": gold[k] - 0.5, "valid_rate": 1.0}
        summary[key].update(response_length_mean=10.0, gold_mean_greedy=gold[k] + 0.1)
        if key != "sft":
            summary[key]["kl_mean"] = 1.0 + k + seed
    summary.update(win_rate_vs_sft=0.8, win_rate_vs_sft_greedy=0.5, dpo_win_rate_vs_sft=0.7 + 0.1 * seed)
    summary.update(dpo_win_rate_vs_sft_greedy=0.6, wall_seconds=100.0 + seed)
    summary["dpo_training"] = {"heldout_accuracy": 0.7, "heldout_gold_accuracy": 0.75}
    return summary


def test_the_table_over_seeds_by_hand(tmp_path, capsys):
    for seed, gold in ((0, (0.5, 1.5, 2.0)), (1, (0.7, 1.1, 1.0))):
        (tmp_path / f"seed-{seed}").mkdir()
        (tmp_path / f"seed-{seed}" / "summary.json").write_text(json.dumps(_summary(seed, gold)))
    assert (
        ex.main(["--out", str(tmp_path), "--seeds", "0", "1", "2", "--report-only"]) == 0
    )  # seed 2: not run
    text = (tmp_path / "quickstart_seeds.md").read_text()
    # PPO - DPO per seed: 2.0 - 1.5, 1.0 - 1.1; mean 0.2, sd 0.4243, half-width 12.706 * 0.4243 / sqrt(2) = 3.81
    assert (
        "- PPO − DPO: +0.20 (+0.50 / -0.10); 95% t-interval [-3.61, +4.01]; sign test 1+ 1- (p = 1); exact p = 1"
        in text
    )
    assert text == capsys.readouterr().out.rstrip("\n") + "\n" and text.startswith(
        "Seeds [0, 1], preset tiny;"
    )
    assert (
        "| gold score | 0.60 ± 0.14 (0.50 / 0.70) | 1.30 ± 0.28 (1.50 / 1.10) | 1.50 ± 0.71 (2.00 / 1.00) |"
        in text
    )
    assert (
        "| KL to SFT (nats / response) | n/a | 2.50 ± 0.71 (2.00 / 3.00) | 3.50 ± 0.71 (3.00 / 4.00) |"
        in text
    )
    assert "| gold win rate vs SFT | n/a | 0.75 ± 0.07 (0.70 / 0.80) | 0.80 ± 0.00 (0.80 / 0.80) |" in text
    assert "|    ... greedy | n/a | 0.60 ± 0.00 (0.60 / 0.60) | 0.50 ± 0.00 (0.50 / 0.50) |" in text
    assert "against gold: 0.81 ± 0.01 (0.80 / 0.82)" in text and "per seed: 100 / 101." in text
    with (tmp_path / "quickstart_seeds.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["seed"], r["policy"]) for r in rows] == [(s, p) for s in "01" for p in ("sft", "dpo", "ppo")]
    assert (
        rows[4]["gold_mean"] == "1.1"
        and float(rows[4]["gold win rate vs SFT"]) == pytest.approx(0.8)
        and rows[3]["kl_mean"] == ""
    )


def test_finished_seeds_are_not_run_again(tmp_path, monkeypatch):
    for seed in (0, 1):
        (tmp_path / f"seed-{seed}").mkdir()
        (tmp_path / f"seed-{seed}" / "summary.json").write_text(json.dumps(_summary(seed, (0.5, 1.0, 1.5))))

    def popen(*args, **kwargs):
        raise AssertionError(f"a finished seed ran again: {args}")

    monkeypatch.setattr(ex.subprocess, "Popen", popen)
    assert ex.main(["--out", str(tmp_path), "--seeds", "0", "1"]) == 0
    assert (tmp_path / "quickstart_seeds.md").is_file()


def test_each_missing_seed_runs_the_quickstart_at_its_seed(tmp_path):
    args = type("Args", (), {"out": tmp_path, "preset": "smoke"})()
    cmd = ex.command(args, 4)
    assert cmd[:4] == [sys.executable, "-m", "rlhfkit", "quickstart"]
    assert cmd[4:] == ["--out", str(tmp_path / "seed-4"), "--seed", "4", "--preset", "smoke", "--overwrite"]
    with pytest.raises(SystemExit):
        ex.main(["--out", str(tmp_path), "--preset", "huge"])
