"""examples/experiments/temperature.py: the aggregation over seeds and the best-temperature counts by hand, the
per-seed child command round-trips, and the script end to end at its smoke size (table structure, sane values,
the plot; --report-only reproduces the table). The figures themselves come from the full run
(docs/experiments.md)."""

from __future__ import annotations

import csv
import math

import pytest

from tests.examples.loader import load_example

ex = load_example("experiments/temperature")
rep = load_example("experiments/temperature_report")


def _row(seed, run, rollout, t, gold, kl=None, **more):
    figures = {f: 0.5 for f in rep.FIGURES}
    figures.update(gold=gold, kl=kl, **more)
    return {"seed": seed, "run": run, "rollout": rollout, "temperature": t, "rm_accuracy": 0.8, **figures}


def test_aggregate_means_and_sds_over_seeds_with_the_kl_at_the_training_temperature():
    rows = [
        _row(0, "ppo", 10, 0.0, 1.0),
        _row(1, "ppo", 10, 0.0, 3.0),
        _row(0, "ppo", 10, 0.7, 2.0, kl=1.0),
        _row(1, "ppo", 10, 0.7, 2.5, kl=3.0),
        _row(0, "ppo-T1", 10, 1.0, 0.0, kl=5.0),
        _row(0, "ppo-T1", 10, 0.7, 0.0, kl=9.0),
        _row(0, "sft", 0, 0.7, 0.4, kl=0.01),
    ]
    table = {(r["run"], r["rollout"], r["temperature"]): r for r in rep.aggregate(rows)}
    greedy = table[("ppo", 10, 0.0)]
    assert (
        greedy["gold"] == 2.0 and greedy["gold_sd"] == pytest.approx(math.sqrt(2.0)) and greedy["seeds"] == 2
    )
    assert greedy["kl"] is None and greedy["kl_sd"] is None  # no KL for greedy decoding
    assert greedy["kl_train"] == 2.0 == table[("ppo", 10, 0.7)]["kl_train"]  # mean KL at T = 0.7
    assert table[("ppo-T1", 10, 0.7)]["kl_train"] == 5.0  # trained at T = 1: its KL there, not at 0.7
    assert table[("sft", 0, 0.7)]["kl_train"] == 0.0 and table[("sft", 0, 0.7)]["gold_sd"] is None
    assert [r["run"] for r in rep.aggregate(rows)][:1] == ["sft"]  # SFT first, then the runs in order
    assert rep.best_temperature_counts(rows)[("ppo", 10)] == {0.7: 1, 0.0: 1}  # seed 0: T=0.7; seed 1: greedy
    text = rep.markdown_tables(rep.aggregate(rows), rows, [0.0, 0.7])
    assert "| ppo | 10 | 2.00 | 2.00 ± 1.41 | 2.25 ± 0.35 | 0: 1, 0.7: 1 | -0.25 |" in text


def test_the_best_temperature_is_counted_per_seed():
    golds = {0: (0.0, 1.0, 0.5), 1: (2.0, 1.0, 0.5), 2: (0.1, 0.3, 0.2)}  # gold at T = 0, 0.7, 1 per seed
    rows = [
        _row(seed, "ppo", 40, t, g)
        for seed, gs in golds.items()
        for t, g in zip((0.0, 0.7, 1.0), gs, strict=True)
    ]
    assert rep.best_temperature_counts(rows) == {("ppo", 40): {0.7: 2, 0.0: 1}}
    # T = 0.7 - greedy per seed: +1.0, -1.0, +0.2; mean 0.0667, sd 1.0066, half-width 4.3027 * 1.0066 / sqrt(3)
    text = rep.paired_markdown(rows, [0.0, 0.7, 1.0])
    assert (
        "| ppo (40) | +0.07 (+1.00 / -1.00 / +0.20); 95% t-interval [-2.43, +2.57]; sign test 2+ 1- (p = 1); exact p = 1 |"
        in text
    )


def test_the_child_command_of_a_seed_carries_every_setting():
    args = ex.parse_args(["--out", "x", "--size", "smoke", "--rollouts", "3", "--temperatures", "0", "0.7"])
    again = ex.parse_args(ex.child_argv(args, 4))
    assert again.seeds == [4] and again.no_report and again.temperatures == [0.0, 0.7]
    assert ex.sizes_of(again) == ex.sizes_of(args) and ex.sizes_of(args).rollouts == 3
    with pytest.raises(SystemExit):
        ex.parse_args(["--out", "x", "--temperatures", "0.3", "0.7"])  # no greedy column


@pytest.mark.long  # a whole experiment end to end: CI's long step (the suite stays under 15 minutes)
def test_the_script_runs_end_to_end_at_the_smoke_size(tmp_path, capsys):
    out = tmp_path / "out"
    assert ex.main(["--out", str(out), "--size", "smoke", "--seeds", "0", "--terms"]) == 0
    assert "| policy | rollout | KL (nats, train T) |" in capsys.readouterr().out
    with (out / "rows.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    # SFT at rollout 0; ppo and ppo-T1 at rollout 2; ppo-kl/4 (twice as long) at 2 and 4; four temperatures each.
    cells = {(r["run"], int(r["rollout"]), float(r["temperature"])) for r in rows}
    checkpoints = [("sft", 0), ("ppo", 2), ("ppo-T1", 2), ("ppo-kl/4", 2), ("ppo-kl/4", 4)]
    assert len(rows) == 20 and cells == {(run, k, t) for run, k in checkpoints for t in rep.TEMPERATURES}
    for r in rows:
        assert 0.0 <= float(r["valid_rate"]) <= 1.0 and 0.0 < float(r["distinct_rate"]) <= 1.0
        assert (
            -3.0 <= float(r["gold"]) <= 6.0 and 1.0 <= float(r["length"]) <= ex.SIZES["smoke"].response_length
        )
        for f in ("top_mass", "ref_top_mass", "top_agree"):
            assert 0.0 <= float(r[f]) <= 1.0 + 1e-6
        assert 0.0 <= float(r["entropy"]) <= math.log(1000)  # the task's vocabulary is 702 tokens
        assert (r["kl"] == "") == (float(r["temperature"]) == 0.0)  # greedy responses have no KL
        # The last checkpoint of each run, and the SFT policy, are read from 2 samples of 6 prompts (1 greedy).
        final = (r["run"], int(r["rollout"])) in {("sft", 0), ("ppo", 2), ("ppo-T1", 2), ("ppo-kl/4", 4)}
        samples = 2 if float(r["temperature"]) > 0 else 1
        assert (r["eval_prompts"], r["eval_samples"]) == (("6", str(samples)) if final else ("", ""))
        assert float(r["gold_se"]) >= 0.0 and float(r["proxy_se"]) >= 0.0
        if r["run"] == "sft":
            assert float(r["kl"] or 0.0) == pytest.approx(0.0, abs=1e-5) and float(r["top_agree"]) == 1.0
    table = (out / "table.md").read_text()
    # The first table: every checkpoint; the second: each run's last checkpoint at every temperature.
    assert table.count("\n| ppo-kl/4 | 2 |") == 1 and table.count("\n| ppo-kl/4 | 4 |") == 1 + 4
    assert "gold T=0.3" in table and "top-1 agrees" in table
    assert (
        "Final reads (each run's last checkpoint and the SFT policy): 1 sample(s) of 6 prompts, 2 sample(s)"
        in table
    )
    assert (out / "temperature.png").stat().st_size > 20_000
    # The gold terms of the final policies: the same samples as the rows (same seeds), so the same valid rates.
    with (out / "terms.csv").open() as fh:
        terms = list(csv.DictReader(fh))
    finals = [("sft", 0), ("ppo", 2), ("ppo-T1", 2), ("ppo-kl/4", 4)]
    assert {(r["run"], int(r["rollout"]), float(r["temperature"])) for r in terms} == {
        (run, k, t) for run, k in finals for t in rep.TEMPERATURES
    }
    valid = {(r["run"], int(r["rollout"]), float(r["temperature"])): r["valid_rate"] for r in rows}
    assert all(
        valid[(r["run"], int(r["rollout"]), float(r["temperature"]))] == r["valid_rate"] for r in terms
    )
    assert (out / "terms.md").read_text().count("\n| ppo-T1 | 2 |") == 4
    terms_md = (out / "terms.md").read_text()
    assert ex.main(["--out", str(out), "--report-only", "--terms"]) == 0  # from rows.json and terms.json
    assert (out / "table.md").read_text() == table and (out / "terms.md").read_text() == terms_md
