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
    grid = [
        {"lr": 1e-4, "heldout_loss": 0.66, "heldout_accuracy": 0.61},
        {"lr": 3e-4, "heldout_loss": 0.64 + 0.1 * seed, "heldout_accuracy": 0.63},
        {"lr": 1e-3, "heldout_loss": 0.65, "heldout_accuracy": None},
    ]
    selection = {"metric": "heldout_loss", "grid": grid, "chosen": 1e-3 if seed else 3e-4, "pinned": False}
    return {"seed": seed, "rm_accuracy": 0.8, "dpo_lr": selection, "arms": arms, "curves": curves}


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
    assert (
        "| DPO | +0.00 (+1.00 / -1.00); 95% t-interval [-12.71, +12.71]; sign test 1+ 1- (p = 1); exact p = 1 |"
        in text
    )
    assert "| DPO → PPO | +3.50 (+4.00 / +3.00);" in text
    # the learning-rate grid per seed, the chosen rate marked (at the grid's edge: the grid did not bracket it)
    assert "| 0 | 0.0003 | 0.6400 | 0.6300 | yes |" in text and "| 0 | 0.001 | 0.6500 | – |  |" in text
    assert (
        "| 1 | 0.001 | 0.6500 | – | yes, at the grid's edge |" in text and "| 1 | 0.0003 | 0.7400 |" in text
    )
    pinned = {"metric": "heldout_loss", "grid": [], "chosen": 3e-4, "pinned": True}
    assert "| 0 | 0.0003 | – | – | pinned (--dpo-lr) |" in ex.lr_table([{**results[0], "dpo_lr": pinned}])


def test_the_rate_of_the_lowest_heldout_loss_is_chosen():
    def grid(*losses, lrs=(1e-4, 3e-4, 1e-3, 3e-3)):
        return [
            {"lr": lr, "heldout_loss": x, "heldout_accuracy": 0.6} for lr, x in zip(lrs, losses, strict=True)
        ]

    assert ex.choose_lr(grid(0.66, 0.64, 0.62, 0.65)) == 1e-3
    assert ex.choose_lr(grid(0.70, 0.60, 0.60, 0.61)) == 3e-4  # an exact tie: the smaller rate
    assert ex.choose_lr(grid(0.60, 0.70, lrs=(1e-3, 1e-4))) == 1e-3  # whatever the grid's order
    assert ex.choose_lr(grid(0.66, 0.64, float("nan"), None)) == 3e-4  # a diverged run is never chosen
    with pytest.raises(ValueError, match="no rate of the grid"):
        ex.choose_lr(grid(float("nan"), float("inf"), lrs=(1e-4, 1e-3)))


def _grid_args(tmp_path, *argv):
    return ex.order_args(["--out", str(tmp_path), "--size", "smoke", *argv])


def test_the_grid_trains_dpo_from_sft_at_each_rate_and_keeps_the_lowest_heldout_loss(tmp_path, monkeypatch):
    """DPO from the SFT policy at every rate of the grid, on the seed's pairs held out on its validation pairs;
    the rate of the lowest held-out loss is chosen and logged; a second call reads the cached runs; a pinned
    rate trains nothing."""
    import rlhfkit.quickstart.dpo_stage as dpo_stage

    calls = []
    losses = {1e-4: 0.66, 3e-4: 0.64, 1e-3: 0.62, 3e-3: 0.67}  # the held-out loss of each rate

    def fake(folder, preset, seed, start, pairs, length, **extra):
        lr = extra["train.learning_rate"]
        calls.append({"folder": folder.name, "start": start, "pairs": pairs, "lr": lr, "extra": extra})
        summary = {"heldout_loss": losses[lr], "heldout_accuracy": 0.6, "heldout_gold_accuracy": 1.0 - lr}
        (folder / "final").mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(dpo_stage, "dpo_stage", fake)
    args = _grid_args(tmp_path, "--dpo-lrs", "3e-3", "1e-4", "1e-3", "3e-4")
    stage = {"root": tmp_path, "sft": tmp_path / "sft" / "final"}
    s = sweep.sizes_of(args)
    record = ex.select_dpo_lr(tmp_path, stage, 0, s, args)
    assert [c["lr"] for c in calls] == [1e-4, 3e-4, 1e-3, 3e-3]
    assert {c["folder"] for c in calls} == {"dpo-lr0.0001", "dpo-lr0.0003", "dpo-lr0.001", "dpo-lr0.003"}
    assert all(c["start"] == stage["sft"] and set(c["extra"]) == {"train.learning_rate"} for c in calls)
    assert calls[0]["pairs"] == {k: tmp_path / "pairs" / f"pairs_{k}.jsonl" for k in ("train", "eval")}
    assert record["chosen"] == 1e-3 and not record["pinned"]
    assert [g["heldout_loss"] for g in record["grid"]] == [0.66, 0.64, 0.62, 0.67]
    assert "gold" not in json.dumps(record["grid"])  # the choice never sees the gold scorer
    assert json.loads((tmp_path / "dpo_lr.json").read_text()) == record
    assert ex.select_dpo_lr(tmp_path, stage, 0, s, args) == record and len(calls) == 4  # cached
    # the dpo arm: the grid's run at that rate
    assert ex.dpo_folders(record["chosen"])["dpo"] == "dpo-lr0.001"
    pinned = ex.select_dpo_lr(tmp_path, stage, 0, s, _grid_args(tmp_path, "--dpo-lr", "3e-4"))
    assert pinned == {"metric": "heldout_loss", "grid": [], "chosen": 3e-4, "pinned": True}
    assert len(calls) == 4  # a pinned rate trains nothing here
    assert json.loads((tmp_path / "dpo_lr.json").read_text()) == record  # the grid's record left alone


def test_the_grid_by_default_and_the_options():
    assert ex.DPO_LRS["default"] == (3e-4, 1e-3, 3e-3, 1e-2) and len(ex.DPO_LRS["smoke"]) == 2
    own, rest = ex.dpo_options(["--out", "x", "--dpo-lr", "3e-4", "--seeds", "0"])
    assert own.dpo_lr == 3e-4 and own.dpo_lrs is None and rest == ["--out", "x", "--seeds", "0"]
    for bad in (["--dpo-lr", "0"], ["--dpo-lr", "nan"], ["--dpo-lr", "1e-4", "--dpo-lrs", "1e-4", "1e-3"]):
        with pytest.raises(SystemExit):
            ex.dpo_options(bad)
    with pytest.raises(SystemExit):
        ex.dpo_options(["--dpo-lrs", "1e-4", "1e-4"])


@pytest.mark.long  # end to end, tens of seconds: CI's long step (the suite stays under 15 minutes)
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
    # the grid: DPO from SFT at each smoke rate; then DPO from PPO twice at the chosen rate
    assert printed.count("seed 0: DPO") == len(ex.DPO_LRS["smoke"]) + 2
    assert printed.count("seed 0: PPO") == 2  # the sweep's one, DPO -> PPO

    def config(folder):
        return yaml.safe_load((root / folder / "config.yaml").read_text())

    selection = json.loads((root / "dpo_lr.json").read_text())
    held_out = {}
    for lr in ex.DPO_LRS["smoke"]:
        folder = root / f"dpo-lr{lr:g}"
        cfg = config(folder.name)
        assert (
            cfg["model"]["name_or_path"] == str(root / "sft" / "final")
            and cfg["train"]["learning_rate"] == lr
        )
        assert cfg["data"]["eval_file"] == str(root / "pairs" / "pairs_eval.jsonl")
        held_out[lr] = json.loads((folder / "summary.json").read_text())["heldout_loss"]
    assert [g["lr"] for g in selection["grid"]] == sorted(held_out) and not selection["pinned"]
    assert [g["heldout_loss"] for g in selection["grid"]] == [held_out[lr] for lr in sorted(held_out)]
    lr = selection["chosen"]
    assert held_out[lr] == min(held_out.values())
    starts = {
        f"dpo-lr{lr:g}": ("sft/final", None),
        f"ppo-then-dpo-lr{lr:g}": ("kl0.05-gamma1/final", None),
        f"ppo-then-dpo-ref-sft-lr{lr:g}": ("kl0.05-gamma1/final", "sft/final"),
    }
    for folder, (start, reference) in starts.items():
        cfg = config(folder)
        assert cfg["kind"] == "dpo" and cfg["model"]["name_or_path"] == str(root / start)
        assert cfg["train"]["learning_rate"] == lr  # every DPO arm at the seed's chosen rate
        assert cfg["dpo"]["reference_model"] == (reference and str(root / reference))
        figures = json.loads((root / folder / "order_rows.json").read_text())
        assert set(figures) >= {"gold", "kl", "dpo_accuracy"} and figures["dpo_lr"] == lr
    cfg = config(f"dpo-lr{lr:g}-then-ppo")
    assert cfg["kind"] == "ppo" and cfg["model"]["name_or_path"] == str(root / f"dpo-lr{lr:g}" / "final")
    assert cfg["online"]["reward_model"] == str(root / "reward" / "final")
    with (out / "order_rows.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["setting"] for r in rows] == [name for name, _, _ in ex.ARMS]
    assert float(rows[0]["kl"]) == pytest.approx(0.0, abs=1e-6)  # SFT against itself
    assert (out / "order.png").stat().st_size > 20_000
    table = (out / "order.md").read_text()
    assert ex.main([*args, "--report-only"]) == 0 and (out / "order.md").read_text() == table
    printed = capsys.readouterr().out
    assert "seed 0:" not in printed  # nothing trained again
    assert f"| 0 | {lr:g} | {held_out[lr]:.4f} |" in table and "| seed | lr | held-out loss |" in printed
