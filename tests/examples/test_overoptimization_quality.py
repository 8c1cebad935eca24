"""examples/experiments/overoptimization_quality.py: the best-of-n form's fit and its peak, an arm's measured
curve, peak, end and pooled points by hand, the runs and reward-model steps of each quality, the per-job child
command, and the script end to end at the smoke size (each reward model trained on its own subset of the pool,
the KL coefficient and the refresh reaching PPO, the tables, the plot, --report-only). The figures themselves
come from the full run (docs/experiments.md)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from tests.examples.loader import load_example

ex = load_example("experiments/overoptimization_quality")
rep = load_example("experiments/overoptimization_quality_report")


def test_the_best_of_n_form_is_recovered_exactly_with_its_peak_and_matches_the_normal_equations():
    alpha, beta = 1.2, 0.3
    d = np.linspace(0.2, 5.0, 20)
    fit = rep.fit_quadratic(d, d * (alpha - beta * d))
    assert (fit["alpha"], fit["beta"]) == pytest.approx((alpha, beta), abs=1e-10) and fit[
        "r2"
    ] == pytest.approx(1.0)
    assert fit["d_peak"] == pytest.approx(2.0) and fit["kl_peak"] == pytest.approx(4.0)
    grid = np.linspace(0.0, 5.0, 500001)
    curve = grid * (alpha - beta * grid)
    assert grid[np.argmax(curve)] == pytest.approx(fit["d_peak"], abs=1e-4)
    assert curve.max() == pytest.approx(fit["delta_peak"])
    rng = np.random.default_rng(0)
    y = d * (alpha - beta * d) + rng.normal(0, 0.1, len(d))
    fit = rep.fit_quadratic(d, y)
    x = np.stack([d, -(d**2)], 1)
    assert (fit["alpha"], fit["beta"]) == pytest.approx(tuple(np.linalg.solve(x.T @ x, x.T @ y)))
    residual = y - x @ np.array([fit["alpha"], fit["beta"]])
    assert fit["r2"] == pytest.approx(1 - (residual**2).sum() / ((y - y.mean()) ** 2).sum())
    assert rep.fit_quadratic(d, 0.5 * d + 0.1 * d**2)["d_peak"] is None  # β < 0: no maximum


def _run(seed, golds, kls, proxies=None, quality=256, kl_coef=0.0, refresh=0, matched=0):
    proxies = proxies or [0.1 * i for i in range(len(golds))]
    evals = [
        {"rollout": 5 * i, "gold": g, "kl": k, "proxy": p, "valid_rate": 1.0, "length": 10.0, "ended": 1.0}
        for i, (g, k, p) in enumerate(zip(golds, kls, proxies, strict=True))
    ]
    return {
        "seed": seed,
        "quality": quality,
        "kl_coef": kl_coef,
        "refresh_steps": refresh,
        **({"matched_refresh": matched, "labels": quality + 1000 + seed} if matched else {}),
        "rm_accuracy": 0.7 + 0.1 * seed,
        "eval": evals,
        "cpu_seconds": 1.0,
    }


def test_an_arm_is_summarised_over_its_seeds_by_hand():
    runs = [
        _run(0, [0.5, 1.5, 2.0, 1.0], [0.0, 1.0, 4.0, 9.0]),
        _run(1, [1.0, 1.5, 3.0, 1.0], [0.0, 1.0, 4.0, 16.0]),
    ]
    s = rep.summarise(runs)
    assert [c["gold"] for c in s["curve"]] == [0.75, 1.5, 2.5, 1.0] and s["curve"][3]["kl"] == 12.5
    assert s["peak"]["rollout"] == 10 and s["peak"]["delta"] == pytest.approx(1.75) and s["drop"] == 1.5
    assert s["end_delta_per_seed"] == [0.5, 0.0] and s["end_delta"][0] == pytest.approx(0.25)
    assert s["end_delta"][1] == pytest.approx(math.sqrt(0.125)) and s["end_kl"][0] == 12.5
    assert s["end_proxy_delta"][0] == pytest.approx(0.3) and s["rm_accuracy"][0] == pytest.approx(0.75)
    # Every seed's points relative to its own SFT gold, the SFT points left out.
    assert sorted(zip(s["d"], s["delta"], strict=True)) == [
        (1.0, 0.5),
        (1.0, 1.0),
        (2.0, 1.5),
        (2.0, 2.0),
        (3.0, 0.5),
        (4.0, 0.0),
    ]
    assert s["max_kl"] == 16.0 and s["quadratic"]["points"] == 6 and s["log"]["points"] == 6
    assert s["quadratic"]["beta"] > 0 and s["quadratic"]["kl_peak"] < s["max_kl"]
    text = rep.markdown([s])
    assert (
        "| 256 (0.75 ± 0.07) | kl_coef 0 | 0.75 | +1.75 (10, 4.0) | 0.25 ± 0.35 | 0.30 ± 0.00 | 12.5 ± 4.9 | 1.00 | +0.50 / +0.00 | 1.50 |"
        in text
    )
    assert "(inside)" in text


def test_the_refresh_table_pairs_each_refresh_run_with_the_plain_run_of_its_reward_model_and_kl_coef():
    runs = [
        _run(0, [0.0, 1.0, 0.5], [0.0, 1.0, 4.0]),
        _run(0, [0.0, 1.0, 1.5], [0.0, 1.0, 2.0], refresh=5),
        _run(0, [0.0, 0.2, 0.3], [0.0, 1.0, 2.0], kl_coef=0.05),
    ]
    text = rep.markdown(rep.summaries(runs))
    # one seed: its difference and sign, no interval (paired per seed: rlhfkit.reporting.paired)
    assert (
        "| 256 | 0 | 0.50 → 1.50 | +1.00 (+1.00); sign test 1+ 0- (p = 1); exact p = 1 | +1.00 → +1.50 | 4.0 → 2.0 |"
        in text
    )


def test_the_verdict_table_pairs_end_gold_by_seed_id_and_reads_the_interval():
    # end Δgold per seed: plain (seeds 0, 1, 2) 0.5, 0.0, 1.0; kl_coef 0.05 (seeds 0, 2 only) 1.5, 1.5
    runs = [
        _run(0, [0.0, 0.5], [0.0, 1.0]),
        _run(1, [1.0, 1.0], [0.0, 1.0]),
        _run(2, [0.0, 1.0], [0.0, 1.0]),
        _run(0, [0.0, 1.5], [0.0, 1.0], kl_coef=0.05),
        _run(2, [0.0, 1.5], [0.0, 1.0], kl_coef=0.05),
        _run(0, [0.0, 0.2], [0.0, 1.0], quality=4000),
        _run(2, [0.0, 0.1], [0.0, 1.0], quality=4000),
        _run(0, [0.0, 1.6], [0.0, 1.0], quality=4000, kl_coef=0.05),
        _run(2, [0.0, 1.7], [0.0, 1.0], quality=4000, kl_coef=0.05),
    ]
    rows = rep.verdict_rows(rep.summaries(runs))
    # seeds 0 and 2 only (seed 1 has no kl_coef 0.05 run): differences +1.0 and +0.5, both positive
    penalty = next(r for r in rows if r.startswith("| 256 pairs: kl_coef 0.05 − 0 |"))
    half = 12.706204736174707 * math.sqrt(0.125) / math.sqrt(2)  # t(0.975, 1) * sd / sqrt(n)
    assert f"+0.75 (+1.00 / +0.50); 95% t-interval [{0.75 - half:+.2f}, {0.75 + half:+.2f}]" in penalty
    assert penalty.endswith("| the penalty helps | open here |")  # the interval spans 0 at n = 2
    # the largest reward model against the smallest: 0.2 - 0.5 and 0.1 - 1.0, both negative, the claim +
    worse = next(r for r in rows if r.startswith("| kl_coef 0: 4000 − 256 pairs |"))
    assert "-0.60 (-0.30 / -0.90)" in worse and "sign test 0+ 2-" in worse
    better = next(r for r in rows if r.startswith("| kl_coef 0.05: 4000 − 256 pairs |"))
    assert "+0.15 (+0.10 / +0.20)" in better and better.endswith("| open here |")
    same = [_run(s, [0.0, 1.0 + s], [0.0, 1.0]) for s in range(6)]
    same += [_run(s, [0.0, 2.0 + s + 0.01 * s], [0.0, 1.0], kl_coef=0.05) for s in range(6)]
    (row,) = rep.verdict_rows(rep.summaries(same))
    assert row.endswith("| holds |")  # +1.00 ... +1.05: a tight interval above 0, exact p = 2 / 64
    (row,) = rep.verdict_rows(rep.summaries([r for r in same if r["seed"] < 3]))
    assert row.endswith("| open here |")  # the same on 3 seeds: the exact test cannot go below 0.25


def test_the_label_budget_of_a_refresh_run_is_its_last_refresh_count():
    records = [
        {"step": 1, "loss/policy": 0.1},
        {"step": 5, "refresh/new_pairs": 120, "refresh/pairs": 120},
        {"step": 10, "refresh/new_pairs": 118, "refresh/pairs": 238},
        {"step": 11, "loss/policy": 0.2},
        {"step": 5, "refresh/new_pairs": 120, "refresh/pairs": 120},  # a resumed run logs step 5 again
        {"step": 15, "refresh/new_pairs": 121, "refresh/pairs": 359},
        {"step": 16, "loss/policy": 0.3},
    ]
    assert ex.refresh_labels(records) == 359  # the refresh-collected pairs only, not the reward model's own
    assert ex.refresh_labels(records[:3]) == 238
    with pytest.raises(ValueError, match="kl0/metrics.jsonl: no record holds refresh/pairs"):
        ex.refresh_labels([{"step": 1, "loss/policy": 0.1}], "kl0/metrics.jsonl")


def test_the_verdict_rows_set_the_refresh_against_its_offline_control_at_equal_labels():
    # end Δgold per seed: plain 0.5 / 0.0 / 1.0; refresh 1.5 / 1.0 / 2.1; offline control 1.0 / 0.5 / 1.6, and
    # those three seeds again as seeds 3-5 (six seeds, so that the exact test can pass: p = 2 / 64)
    runs = []
    arms = ((0.5, 1.5, 1.0), (0.0, 1.0, 0.5), (1.0, 2.1, 1.6)) * 2
    for seed, (plain, refresh, control) in enumerate(arms):
        runs.append(_run(seed, [0.0, plain], [0.0, 1.0]))
        runs.append(_run(seed, [0.0, refresh], [0.0, 1.0], refresh=5))
        runs.append(_run(seed, [0.0, control], [0.0, 1.0], matched=5))
    table = rep.summaries(runs)
    assert [(s["refresh_steps"], s["matched_refresh"]) for s in table] == [(0, 0), (0, 5), (5, 0)]
    rows = rep.verdict_rows(table)
    (plain,) = [r for r in rows if r.startswith("| 256 pairs: refresh − plain (kl_coef 0) |")]
    assert "+1.03 (+1.00 / +1.00 / +1.10 / +1.00 / +1.00 / +1.10)" in plain  # against the plain run
    (matched,) = [
        r for r in rows if r.startswith("| 256 pairs: refresh − offline at equal labels (kl_coef 0) |")
    ]
    assert "+0.50 (+0.50 / +0.50 / +0.50 / +0.50 / +0.50 / +0.50)" in matched and "sign test 6+ 0-" in matched
    assert matched.endswith("| refreshing beats the same labels offline | holds |")  # sd 0: a point interval
    runs[-1] = _run(5, [0.0, 2.6], [0.0, 1.0], matched=5)  # seed 5's control ends above its refresh run
    (matched,) = [r for r in rep.verdict_rows(rep.summaries(runs)) if "equal labels" in r]
    assert "(+0.50 / +0.50 / +0.50 / +0.50 / +0.50 / -0.50)" in matched and matched.endswith("| open here |")
    text = rep.markdown(rep.summaries(runs[:9]))  # seeds 0-2
    assert (
        "| 256 + N = 1256 / 1257 / 1258 (0.80 ± 0.10) | kl_coef 0, offline RM on 256 + the labels of refresh every 5 |"
        in text
    )
    assert (
        "| 256 | 0 | 0.50 ± 0.50 → 1.53 ± 0.55 |" in text
    )  # the refresh table still pairs with the plain run


def test_the_offline_control_runs_after_each_refresh_run_and_is_refused_without_one():
    args = ex.parse_args(["--out", "x", "--qualities", "256", "1024", "4000"])
    assert args.matched_qualities == [256]
    assert ex.matched_runs_of(args, 256) == [{"kl_coef": 0.0, "refresh_steps": 0, "matched_refresh": 5}]
    assert ex.matched_runs_of(args, 4000) == [] and ex.run_name(0.0, 0, 5) == "kl0-matched-refresh5"
    assert ex.refresh_label_bound(args, 40) == 128 * 8  # RefreshConfig's 128 prompts, 8 refreshes
    assert ex.parse_args(ex.child_argv(args, 1, 256)).matched_qualities == [256]
    assert ex.parse_args(ex.child_argv(args, 1, 4000)).matched_qualities == []
    assert ex.parse_args(["--out", "x", "--qualities", "1024"]).matched_qualities == []
    for bad in (["--matched-qualities", "1024"], ["--refresh-steps", "0", "--matched-qualities", "256"]):
        with pytest.raises(SystemExit):
            ex.parse_args(["--out", "x", *bad])


def test_a_pool_too_small_for_the_control_is_refused_before_any_run(tmp_path, capsys):
    (tmp_path / "pairs_train.jsonl").write_text("{}\n" * 1279)
    args = ex.parse_args(["--out", str(tmp_path)])  # 256 + up to 128 pairs x 8 refreshes = 1,280 pairs
    with pytest.raises(SystemExit) as stop:
        ex.check_matched_budget(args, ex.SIZES["default"], {"pool": tmp_path})
    assert stop.value.code == 2 and "up to 1280 pairs" in capsys.readouterr().err
    (tmp_path / "pairs_train.jsonl").write_text("{}\n" * 1280)
    ex.check_matched_budget(args, ex.SIZES["default"], {"pool": tmp_path})


def test_the_runs_and_reward_model_steps_of_each_quality_and_the_child_command():
    args = ex.parse_args(
        ["--out", "x", "--size", "smoke", "--qualities", "4", "16", "--refresh-qualities", "16"]
    )
    assert [ex.run_name(r["kl_coef"], r["refresh_steps"]) for r in ex.runs_of(args, 16)] == [
        "kl0",
        "kl0.05",
        "kl0-refresh5",
    ]
    assert [ex.run_name(r["kl_coef"], r["refresh_steps"]) for r in ex.runs_of(args, 4)] == ["kl0", "kl0.05"]
    s = ex.SIZES["default"]
    assert [ex.rm_steps(n, s, 1.5) for n in (256, 1024, 4000)] == [150, 150, 188]
    again = ex.parse_args(ex.child_argv(args, 2, 16))
    assert again.seeds == [2] and again.qualities == [16] and again.child and again.no_report
    assert (
        again.refresh_qualities == [16]
        and again.kl_coefs == [0.0, 0.05]
        and ex.sizes_of(again) == ex.sizes_of(args)
    )
    with pytest.raises(SystemExit):
        ex.parse_args(["--out", "x", "--kl-coefs", "-0.1"])


@pytest.mark.long  # a whole experiment end to end: CI's long step (the suite stays under 15 minutes)
def test_the_experiment_end_to_end_at_the_smoke_size(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--out", str(out), "--size", "smoke", "--seeds", "0", "--qualities", "4", "12", "--jobs", "1"]
    argv += ["--refresh-qualities", "4", "--refresh-steps", "1", "--rollouts", "3"]
    argv += ["--matched-qualities", "4"]  # the offline control at the refresh run's label budget
    argv += ["--refresh-settings", '{"pairs": 2, "steps": 2, "batch_size": 4, "normalize_max_pairs": 8}']
    assert ex.main(argv) == 0
    printed = capsys.readouterr().out
    pool = out / "shared" / "pairs"
    assert len((pool / "pairs_train_4.jsonl").read_text().splitlines()) == 4
    assert (pool / "pairs_train.jsonl").read_text().startswith((pool / "pairs_train_12.jsonl").read_text())
    for quality, steps in ((4, 2), (12, 3)):  # 1.5 epochs of batch 8, at least 2 steps
        cfg = yaml.safe_load((out / "seed-0" / f"rm{quality}" / "reward" / "config.yaml").read_text())
        assert (
            cfg["data"]["train_file"].endswith(f"pairs_train_{quality}.jsonl")
            and cfg["train"]["max_steps"] == steps
        )
        for name, kl_coef in (("kl0", 0.0), ("kl0.05", 0.05)):
            folder = out / "seed-0" / f"rm{quality}" / name
            assert yaml.safe_load((folder / "config.yaml").read_text())["online"]["kl_coef"] == kl_coef
            record = json.loads((folder / "run.json").read_text())
            assert [e["rollout"] for e in record["eval"]] == [0, 1, 2, 3] and record["eval"][0]["kl"] == 0.0
            # the start (the SFT policy) and the end take the final read; the curve between, the cheap one
            reads = [(e.get("eval_prompts"), e.get("eval_samples")) for e in record["eval"]]
            assert reads == [(6, 2), (None, None), (None, None), (6, 2)]
    refreshed = out / "seed-0" / "rm4" / "kl0-refresh1"
    metrics = [json.loads(line) for line in (refreshed / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "refresh/pairs" in m] == [1, 2, 3]
    labelled = metrics[-1]["refresh/pairs"]
    assert (
        1 <= labelled <= 6 and json.loads((refreshed / "run.json").read_text())["refresh_labels"] == labelled
    )
    assert not (out / "seed-0" / "rm12" / "kl0-refresh1").exists()
    # The offline control of the refresh run: its reward model on the pool's first 4 + N pairs (the same
    # 1.5-epoch rule), PPO against it at the same kl_coef without a refresh.
    control, pool = out / "seed-0" / "rm4" / "kl0-matched-refresh1", out / "shared" / "pairs"
    pairs = out / "seed-0" / "rm4" / "pairs_kl0-matched-refresh1.jsonl"
    assert (
        pairs.read_text().splitlines()
        == (pool / "pairs_train.jsonl").read_text().splitlines()[: 4 + labelled]
    )
    cfg = yaml.safe_load((out / "seed-0" / "rm4" / "reward-kl0-matched-refresh1" / "config.yaml").read_text())
    assert cfg["data"]["train_file"] == str(pairs) and cfg["train"]["max_steps"] == ex.rm_steps(
        4 + labelled, ex.SIZES["smoke"], 1.5
    )
    cfg = yaml.safe_load((control / "config.yaml").read_text())
    assert (
        cfg["online"]["reward_model"].endswith("reward-kl0-matched-refresh1/final")
        and cfg["online"]["kl_coef"] == 0.0
    )
    assert cfg["refresh"]["every"] == 0 and not any(
        "refresh/pairs" in line for line in (control / "metrics.jsonl").read_text().splitlines()
    )
    record = json.loads((control / "run.json").read_text())
    assert (record["quality"], record["labels"], record["matched_refresh"], record["refresh_steps"]) == (
        4,
        4 + labelled,
        1,
        0,
    )
    assert "| 4 | 0 |" in printed and "d(α − β d)" in printed and "CPU time" in printed
    assert "| 4 pairs: refresh − offline at equal labels (kl_coef 0) |" in printed
    assert f"| 4 + N = {4 + labelled} (" in printed
    assert (out / "overoptimization.png").stat().st_size > 20_000 and (out / "fits.csv").is_file()
    table = (out / "table.md").read_text()
    assert ex.main(["--out", str(out), "--report-only"]) == 0
    assert (out / "table.md").read_text() == table
    # A run measured before the start took the final read gets it on the next run of the script: the same
    # figures the hook records (a seeded read), nothing retrained.
    folder = out / "seed-0" / "rm12" / "kl0"
    record = json.loads((folder / "run.json").read_text())
    fresh = record["eval"][0]
    record["eval"][0] = {"rollout": 0, "gold": 9.0, "proxy": 9.0, "kl": 0.0}  # a one-sample read, as it was
    (folder / "run.json").write_text(json.dumps(record))
    trained = (folder / "metrics.jsonl").stat().st_mtime_ns
    assert ex.main(argv) == 0
    again = json.loads((folder / "run.json").read_text())["eval"][0]
    assert again == pytest.approx(fresh) and (folder / "metrics.jsonl").stat().st_mtime_ns == trained


def test_a_quickstart_folder_without_its_sft_policy_is_refused_with_exit_code_2(tmp_path, capsys):
    (tmp_path / "qs" / "task").mkdir(parents=True)
    with pytest.raises(SystemExit) as stop:
        ex.main(["--out", str(tmp_path / "out"), "--quickstart", str(tmp_path / "qs"), "--jobs", "1"])
    assert stop.value.code == 2 and "sft/final not found" in capsys.readouterr().err
    assert not (tmp_path / "out" / "seed-0").exists()
