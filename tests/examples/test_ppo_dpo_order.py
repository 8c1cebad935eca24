"""examples/experiments/ppo_dpo_order.py (PPO then DPO, DPO then PPO): the table over seeds by hand, and the
whole experiment end to end at the smoke size (each order starts where it should, with the reference it should;
the PPO run it shares with ppo_sweep.py is trained once; the report again from the caches). The figures
themselves come from the full run (docs/experiments.md)."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from tests.examples.loader import load_example

ex = load_example("experiments/ppo_dpo_order")
sweep = load_example("experiments/ppo_sweep")


def _result(seed, golds):
    """A seed's figures: every policy's gold from ``golds``, proxy = gold + 1, KL = its position in ARMS."""
    arms = {}
    for k, (name, _, _) in enumerate(ex.ARMS):
        arms[name] = {"gold": golds[k], "proxy": golds[k] + 1.0, "kl": float(k), "length": 10.0 + seed}
        arms[name].update({"ended": 1.0, "valid_rate": 1.0})
        if name in ("dpo", "ppo-dpo", "ppo-dpo-ref-sft"):  # the DPO runs
            arms[name].update(dpo_accuracy=0.6 + 0.1 * seed, dpo_gold_accuracy=None if seed else 0.7)
    curves = {"ppo": [{"rollout": 0, **arms["sft"]}], "dpo-ppo": [{"rollout": 0, **arms["dpo"]}]}
    return {"seed": seed, "rm_accuracy": 0.8, "arms": arms, "curves": curves}


def test_the_table_over_seeds_by_hand():
    results = [_result(0, [0.5, 1.0, 2.0, 3.0, 4.0, 5.0]), _result(1, [0.7, 3.0, 2.0, 3.0, 4.0, 6.0])]
    rows = ex.rows_of(results)
    assert len(rows) == 2 * len(ex.ARMS) and {r["rollout"] for r in rows} == {0}
    table = {r["setting"]: r for r in ex.aggregate(rows)}
    assert table["sft"]["gold"] == pytest.approx(0.6) and table["ppo"]["gold"] == pytest.approx(2.0)
    assert table["ppo"]["gold_sd"] == pytest.approx(2**0.5) and table["dpo"]["gold_sd"] == pytest.approx(0.0)
    assert table["dpo-ppo"]["gold_per_seed"] == [5.0, 6.0] and table["dpo-ppo"]["kl"] == pytest.approx(5.0)
    assert table["ppo-dpo"]["gap"] == pytest.approx(1.0)
    text = ex.markdown(list(table.values()), results)
    assert (
        "| PPO | PPO from SFT | 2.00 ± 1.41 | 3.00 ± 1.41 | 1.00 ± 0.00 | 1.00 ± 0.00 | 10.5 ± 0.7 |" in text
    )
    assert "| 5.00 / 6.00 |" in text and "| DPO → PPO |" in text
    assert "| PPO → DPO (ref SFT) | 0.600 / 0.700 | 0.700 / – |" in text  # DPO's accuracy per seed
    assert text.count("| 0.600 / 0.700 |") == 3  # the three DPO runs; SFT and the PPO runs have none
    # paired against PPO: DPO 2.0 - 1.0 and 2.0 - 3.0; mean 0, sd sqrt(2), half-width 12.706 * sqrt(2) / sqrt(2)
    assert "| DPO | +0.00 (+1.00 / -1.00); 95% t-interval [-12.71, +12.71]; sign test 1+ 1- (p = 1) |" in text
    assert "| DPO → PPO | +3.50 (+4.00 / +3.00);" in text


class _Stop(Exception):
    pass


@pytest.mark.parametrize("size, lr", [("default", 3e-4), ("smoke", None)])
def test_the_dpo_learning_rate_of_the_documented_table_is_pinned(tmp_path, monkeypatch, size, lr):
    """The table was measured with DPO at lr 3e-4; the preset's rate moved to 2e-4, so the script pins 3e-4."""
    import rlhfkit.quickstart.dpo_stage as dpo_stage

    seen = {}

    def fake(folder, preset, seed, start, pairs, length, **extra):
        seen.update(preset=preset, extra=extra)
        raise _Stop

    monkeypatch.setattr(dpo_stage, "dpo_stage", fake)
    args = sweep.parse_args(["--sweep", "kl_coef", "--out", str(tmp_path), "--size", size])
    stage = {"root": tmp_path}
    with pytest.raises(_Stop):
        ex.dpo_run(tmp_path / "dpo", tmp_path / "sft", stage, None, 0, sweep.sizes_of(args), args)
    assert seen["extra"].get("train.learning_rate") == lr
    assert dpo_stage.DPO_PRESETS[seen["preset"]].lr != 3e-4 or size == "smoke"  # the preset alone would not


@pytest.mark.slow
def test_the_experiment_end_to_end_at_the_smoke_size(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--out", str(out), "--size", "smoke", "--seeds", "0"]
    assert (
        sweep.main(["--sweep", "lam", "--values", "0.95", *args]) == 0
    )  # the PPO run both experiments share
    root = out / "seed-0"
    shared = root / "kl0.05-gamma1" / "sweep_rows.json"
    before = shared.stat().st_mtime_ns
    assert ex.main(args) == 0
    printed = capsys.readouterr().out
    assert shared.stat().st_mtime_ns == before  # PPO from SFT: ppo_sweep's run, reused
    assert (
        printed.count("seed 0: DPO") == 3 and printed.count("seed 0: PPO") == 2
    )  # the sweep's one, DPO -> PPO

    def config(folder):
        return yaml.safe_load((root / folder / "config.yaml").read_text())

    starts = {
        "dpo": ("sft/final", None),
        "ppo-then-dpo": ("kl0.05-gamma1/final", None),
        "ppo-then-dpo-ref-sft": ("kl0.05-gamma1/final", "sft/final"),
    }
    for folder, (start, reference) in starts.items():
        cfg = config(folder)
        assert cfg["kind"] == "dpo" and cfg["model"]["name_or_path"] == str(root / start)
        assert cfg["dpo"]["reference_model"] == (reference and str(root / reference))
        assert set(json.loads((root / folder / "order_rows.json").read_text())) >= {
            "gold",
            "kl",
            "dpo_accuracy",
        }
    cfg = config("dpo-then-ppo")
    assert cfg["kind"] == "ppo" and cfg["model"]["name_or_path"] == str(root / "dpo" / "final")
    assert cfg["online"]["reward_model"] == str(root / "reward" / "final")
    with (out / "order_rows.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["setting"] for r in rows] == [name for name, _, _ in ex.ARMS]
    assert float(rows[0]["kl"]) == pytest.approx(0.0, abs=1e-6)  # SFT against itself
    assert (out / "order.png").stat().st_size > 20_000
    table = (out / "order.md").read_text()
    assert ex.main([*args, "--report-only"]) == 0 and (out / "order.md").read_text() == table
    assert "seed 0:" not in capsys.readouterr().out  # nothing trained again
