"""examples/experiments/ppo_sweep.py (kl_penalty.py, gamma.py, gae_lambda_ppo.py): the aggregation over seeds
by hand, the runs of each sweep and their sharing, the per-seed child command, and the sweeps end to end at the
smoke size on one folder (the swept setting reaches PPO's configuration; the run the sweeps share is trained
once; the table and the plot). The figures themselves come from the full runs (docs/experiments.md)."""

from __future__ import annotations

import csv
import json
import math

import pytest
import yaml

from tests.examples.loader import load_example

ex = load_example("experiments/ppo_sweep")
rep = load_example("experiments/ppo_sweep_report")


def _result(seed, sft_gold, runs):
    """A seed's results: SFT figures and, per kl_coef, the held-out figures at rollouts 10 and 20."""
    figures = {"proxy": 0.0, "kl": 0.0, "length": 20.0, "ended": 1.0, "valid_rate": 1.0}
    out = {"seed": seed, "rm_accuracy": 0.8, "sft": {**figures, "gold": sft_gold}, "runs": {}}
    for beta, golds in runs.items():
        evals = [
            {**figures, "rollout": 10 * (i + 1), "gold": g, "proxy": g + beta, "kl": 1.0 / (beta + 0.5)}
            for i, g in enumerate(golds)
        ]
        train = [{"rollout": k, "score": 0.0, "kl": 0.0, "response_length": 10.0 + k + seed} for k in (1, 2)]
        out["runs"][f"kl{beta:g}"] = {"kl_coef": beta, "gamma": 1.0, "eval": evals, "train": train}
    return out


def test_aggregate_means_and_sds_over_seeds_with_the_sft_policy_at_rollout_0_of_every_run():
    results = [
        _result(0, 0.5, {0.0: [1.0, 2.0], 0.2: [0.8, 1.0]}),
        _result(1, 0.7, {0.0: [3.0, 1.0], 0.2: [1.2, 1.0]}),
    ]
    table = {(r["setting"], r["rollout"]): r for r in rep.aggregate(rep.eval_rows(results, "kl_coef"))}
    assert set(table) == {(b, k) for b in (0.0, 0.2) for k in (0, 10, 20)}
    assert table[(0.0, 0)]["gold"] == pytest.approx(0.6) == table[(0.2, 0)]["gold"]  # SFT, both runs
    assert table[(0.0, 10)]["gold"] == 2.0 and table[(0.0, 10)]["gold_sd"] == pytest.approx(math.sqrt(2.0))
    assert table[(0.0, 20)]["gold_per_seed"] == [2.0, 1.0] and table[(0.0, 20)]["seeds"] == 2
    assert table[(0.2, 20)]["gap"] == pytest.approx(0.2) and table[(0.2, 20)]["gap_sd"] == pytest.approx(0.0)
    assert table[(0.2, 10)]["kl"] == pytest.approx(1 / 0.7)
    train = rep.train_curves(results, "kl_coef")
    assert len(train) == 8 and {t["response_length"] for t in train if t["rollout"] == 2} == {12.0, 13.0}
    text = rep.markdown(rep.aggregate(rep.eval_rows(results, "kl_coef")), train, "kl_coef")
    assert "| β (kl_coef) = 0.2, rollout 20 | 1.00 ± 0.00 | 1.20 ± 0.00 | 0.20 ± 0.00 |" in text
    assert "| 1.00 / 1.00 | 12.0 |" in text  # gold per seed; training length over the last rollouts


def test_the_evaluations_standard_error_takes_the_prompt_as_the_unit():
    # two samples each of three prompts: per-prompt means 1, 2, 6; their sd is sqrt(7), over sqrt(3)
    assert ex.prompt_standard_error([0.0, 2.0, 2.0, 2.0, 5.0, 7.0], 2) == pytest.approx(math.sqrt(7 / 3))
    # the same six values as six prompts of one sample: a smaller spread of means, another error
    assert ex.prompt_standard_error([0.0, 2.0, 2.0, 2.0, 5.0, 7.0], 1) == pytest.approx(
        math.sqrt(sum((x - 3.0) ** 2 for x in (0, 2, 2, 2, 5, 7)) / 5 / 6)
    )
    assert ex.prompt_standard_error([4.0, 6.0], 2) == 0.0  # one prompt: no spread to read
    with pytest.raises(ValueError, match="not 2 per prompt"):
        ex.prompt_standard_error([1.0, 2.0, 3.0], 2)


def test_the_runs_of_each_sweep_and_the_run_they_share():
    kl = [ex.run_name(r) for r in ex.runs_of("kl_coef", ex.SWEEPS["kl_coef"])]
    gamma = [ex.run_name(r) for r in ex.runs_of("gamma", ex.SWEEPS["gamma"])]
    assert kl == ["kl0-gamma1", "kl0.02-gamma1", "kl0.05-gamma1", "kl0.2-gamma1"]
    assert gamma == ["kl0.05-gamma1", "kl0.05-gamma0.99", "kl0.05-gamma0.9"]  # gamma = 1 is kl 0.05: run once
    lam = [ex.run_name(r) for r in ex.runs_of("lam", ex.SWEEPS["lam"])]
    assert lam == ["kl0.05-gamma1-lam0", "kl0.05-gamma1-lam0.5", "kl0.05-gamma1-lam0.9", "kl0.05-gamma1"] + [
        "kl0.05-gamma1-lam1"
    ]  # lambda = 0.95 is kl 0.05 too


def test_the_child_command_of_a_seed_carries_every_setting_and_bad_values_are_refused():
    args = ex.parse_args(["--sweep", "gamma", "--out", "x", "--size", "smoke", "--values", "1", "0.5"])
    again = ex.parse_args(ex.child_argv(args, 4))
    assert again.seeds == [4] and again.no_report and again.sweep == "gamma" and again.values == (1.0, 0.5)
    assert ex.sizes_of(again) == ex.sizes_of(args) == ex.SIZES["smoke"]
    bad_values = (["--sweep", "gamma", "--values", "1.1"], ["--sweep", "kl_coef", "--values", "-0.1"])
    for bad in (*bad_values, ["--sweep", "lam", "--values", "1.5"]):
        with pytest.raises(SystemExit):
            ex.parse_args(["--out", "x", *bad])


@pytest.mark.long  # end to end, tens of seconds: CI's long step (the suite stays under 15 minutes)
def test_both_sweeps_end_to_end_at_the_smoke_size_sharing_one_folder(tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        ex.main(
            [
                "--sweep",
                "kl_coef",
                "--values",
                "0",
                "0.05",
                "--out",
                str(out),
                "--size",
                "smoke",
                "--seeds",
                "0",
            ]
        )
        == 0
    )
    shared = out / "seed-0" / "kl0.05-gamma1" / "sweep_rows.json"
    before = shared.stat().st_mtime_ns
    assert (
        ex.main(
            ["--sweep", "gamma", "--values", "1", "0.9", "--out", str(out), "--size", "smoke", "--seeds", "0"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert shared.stat().st_mtime_ns == before  # gamma = 1 is the kl 0.05 run: reused, not trained again
    assert printed.count("seed 0: PPO") == 3 and "| γ = 0.9, rollout 2 |" in printed
    for name, beta, gamma in (("kl0-gamma1", 0.0, 1.0), ("kl0.05-gamma0.9", 0.05, 0.9)):
        cfg = yaml.safe_load((out / "seed-0" / name / "config.yaml").read_text())
        assert (cfg["online"]["kl_coef"], cfg["online"]["gamma"]) == (beta, gamma)
        record = json.loads((out / "seed-0" / name / "sweep_rows.json").read_text())
        assert [e["rollout"] for e in record["eval"]] == [2] and [t["rollout"] for t in record["train"]] == [
            1,
            2,
        ]
        e = record["eval"][0]
        assert e["kl"] == pytest.approx(e["kl"]) and -3.0 <= e["gold"] <= 6.0 and 0.0 <= e["ended"] <= 1.0
        assert 1.0 <= e["length"] <= ex.SIZES["smoke"].response_length
        assert (e["eval_prompts"], e["eval_samples"]) == (6, 2) and e["gold_se"] >= 0.0  # the final read
    sft = json.loads((out / "seed-0" / "sft_meter.json").read_text())
    assert (sft["eval_prompts"], sft["eval_samples"]) == (6, 2)  # read as the finals are, for the pairing
    with (out / "gamma_rows.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {(float(r["setting"]), int(r["rollout"])) for r in rows} == {
        (g, k) for g in (1.0, 0.9) for k in (0, 2)
    }
    assert (out / "gamma.png").stat().st_size > 20_000 and (out / "kl_coef.png").stat().st_size > 20_000
    table = (out / "gamma.md").read_text()
    assert (
        ex.main(
            ["--sweep", "gamma", "--values", "1", "0.9", "--out", str(out), "--report-only", "--seeds", "0"]
        )
        == 0
    )
    assert (out / "gamma.md").read_text() == table
    # lambda: 0.95 is the same shared run; 0.5 the one new run, its lambda in PPO's configuration
    args = ["--sweep", "lam", "--values", "0.95", "0.5", "--out", str(out), "--size", "smoke", "--seeds", "0"]
    assert ex.main(args) == 0
    printed = capsys.readouterr().out
    assert shared.stat().st_mtime_ns == before and printed.count("seed 0: PPO") == 1
    assert "| λ (GAE) = 0.5, rollout 2 |" in printed and "train proxy score, last 5 rollouts" in printed
    for name, lam in (("kl0.05-gamma1-lam0.5", 0.5), ("kl0-gamma1", 0.95)):
        assert yaml.safe_load((out / "seed-0" / name / "config.yaml").read_text())["online"]["lam"] == lam
    assert (out / "lam.png").stat().st_size > 20_000


def test_paired_comparison_against_the_base_setting_per_seed():
    results = [
        _result(0, 0.5, {0.0: [1.0, 2.0], 0.2: [0.8, 1.0]}),
        _result(1, 0.7, {0.0: [3.0, 1.0], 0.2: [1.2, 1.0]}),
    ]
    text = rep.paired_markdown(rep.eval_rows(results, "kl_coef"), "kl_coef", base=0.2)
    # gold at rollout 20, kl 0 - kl 0.2: seed 0 2.0 - 1.0, seed 1 1.0 - 1.0; mean 0.5, sd sqrt(0.5), half-width
    # 12.706 * 0.7071 / sqrt(2) = 6.353; one tie. KL 1/0.5 - 1/0.7 = 0.571 in both seeds (sd 0: a point interval)
    (line,) = [x for x in text.splitlines() if x.startswith("| 0 |")]
    gold, proxy, kl, length = line.strip("| ").split(" | ")[1:]
    assert (
        gold
        == "+0.50 (+1.00 / +0.00); 95% t-interval [-5.85, +6.85]; sign test 1+ 0- 1= (p = 1); exact p = 1"
    )
    assert kl.startswith("+0.57 (+0.57 / +0.57); 95% t-interval [+0.57, +0.57]; sign test 2+ 0-")
    assert length.startswith("+0.0 (+0.0 / +0.0)")
    assert "| 0.2 |" not in text  # the base itself is not compared
