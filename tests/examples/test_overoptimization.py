"""examples/overoptimization.py: Gao et al.'s fit recovers α and β exactly, agrees with the normal equations,
finds the curve's peak; trajectories are interpolated at a KL level by hand; the gap is computed as documented.
(The script end to end: test_overoptimization_smoke.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.examples.loader import load_example

ex = load_example("overoptimization")


def test_the_gao_form_is_recovered_exactly_with_its_peak():
    alpha, beta = 1.3, 0.7
    d = np.linspace(0.3, 5.0, 25)
    fit = ex.fit_gao(d, d * (alpha - beta * np.log(d)))
    assert fit["alpha"] == pytest.approx(alpha, abs=1e-10) and fit["beta"] == pytest.approx(beta, abs=1e-10)
    assert fit["r2"] == pytest.approx(1.0, abs=1e-12) and fit["rmse"] < 1e-10
    assert fit["linear_r2"] < 0.9 and fit["points"] == 25
    assert fit["d_peak"] == pytest.approx(math.exp(alpha / beta - 1.0)) and fit["kl_peak"] == pytest.approx(
        fit["d_peak"] ** 2
    )
    grid = np.linspace(0.01, 6.0, 600001)
    curve = ex.gao_curve(grid, alpha, beta)
    assert grid[np.argmax(curve)] == pytest.approx(fit["d_peak"], abs=1e-4)  # the maximum of the curve
    assert curve.max() == pytest.approx(fit["delta_peak"], abs=1e-9)  # = β d*
    assert ex.gao_curve(np.array([0.0]), alpha, beta)[0] == 0.0


def test_noisy_fit_matches_the_normal_equations_and_r2_by_hand():
    rng = np.random.default_rng(0)
    d = rng.uniform(0.2, 4.0, 40)
    y = d * (0.9 - 0.5 * np.log(d)) + rng.normal(0, 0.05, 40)
    fit = ex.fit_gao(d, y)
    x = np.stack([d, -d * np.log(d)], 1)
    alpha, beta = np.linalg.solve(x.T @ x, x.T @ y)
    assert (fit["alpha"], fit["beta"]) == pytest.approx((alpha, beta), abs=1e-10)
    residual = y - x @ np.array([alpha, beta])
    assert fit["r2"] == pytest.approx(1 - (residual**2).sum() / ((y - y.mean()) ** 2).sum())
    assert fit["rmse"] == pytest.approx(math.sqrt((residual**2).mean()))
    a = (d * y).sum() / (d * d).sum()
    assert fit["linear_a"] == pytest.approx(a)
    assert fit["linear_r2"] == pytest.approx(1 - ((y - a * d) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    assert fit["r2"] > fit["linear_r2"]


def test_a_straight_line_has_no_peak():
    d = np.linspace(0.5, 3.0, 10)
    fit = ex.fit_gao(d, 0.4 * d)
    assert fit["linear_a"] == pytest.approx(0.4) and fit["linear_r2"] == pytest.approx(1.0)
    assert fit["beta"] == pytest.approx(0.0, abs=1e-9) and fit["d_peak"] is None and fit["delta_peak"] is None
    fit = ex.fit_gao(d, d * (0.2 + 0.3 * np.log(d)))  # β < 0: rising ever faster
    assert fit["beta"] == pytest.approx(-0.3) and fit["d_peak"] is None


def test_the_fit_refuses_points_it_cannot_use():
    with pytest.raises(ValueError, match="d > 0"):
        ex.fit_gao([0.0, 1.0, 2.0], [0.0, 1.0, 1.5])
    with pytest.raises(ValueError, match="at least 3"):
        ex.fit_gao([1.0, 2.0], [1.0, 1.5])
    with pytest.raises(ValueError, match="one length"):
        ex.fit_gao([1.0, 2.0, 3.0], [1.0, 1.5])


def rows(kl, gold, proxy, steps=None):
    steps = steps or list(range(len(kl)))
    return [
        {"step": s, "eval/kl/mean": k, "eval/gold/mean": g, "eval/score/mean": p, "kl/mean": 99.0}
        for s, k, g, p in zip(steps, kl, gold, proxy, strict=True)
    ]


def test_trajectories_are_averaged_in_kl_bins():
    t = ex.Trajectory.from_rows(
        [{"step": 1, "score/mean": 3.0}] + rows([0, 2, 6, 4, 8, 1], [0, 1, 3, 2, 5, 7], [0, 1, 2, 3, 4, 5])
    )
    assert list(t.steps) == [0, 1, 2, 3, 4, 5]  # rows without the meter's figures are skipped
    assert t.in_kl_bin(0.0, 3.0) == {
        "gold": 4.0,
        "proxy": 3.0,
        "n": 2,
    }  # KL 2 and 1; the SFT point (step 0) is not in
    assert t.in_kl_bin(3.0, 6.0) == {"gold": 2.0, "proxy": 3.0, "n": 1}  # KL 4 (6 belongs to the next bin)
    assert t.in_kl_bin(6.0, 9.0) == {"gold": 4.0, "proxy": 3.0, "n": 2}
    assert t.in_kl_bin(9.0, 12.0) is None
    with pytest.raises(ValueError, match="step 0"):
        ex.Trajectory.from_rows(rows([1, 2], [0, 1], [0, 1], steps=[2, 4]))


def test_analyse_and_compare_by_hand():
    alpha, beta = 1.0, 0.5
    kl = [0.0, 0.25, 1.0, 4.0, 9.0, 16.0]
    d = np.sqrt(kl)
    gold = [0.5 + float(ex.gao_curve(np.array([x]), alpha, beta)[0]) for x in d]
    plain = ex.Trajectory.from_rows(rows(kl, gold, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]))
    fit = ex.analyse(plain)
    assert (fit["alpha"], fit["beta"]) == pytest.approx((alpha, beta)) and fit["sft_gold"] == 0.5
    best = int(np.argmax(gold))
    assert fit["observed_peak"]["step"] == best and fit["observed_peak"]["delta"] == pytest.approx(
        gold[best] - 0.5
    )
    refreshed = ex.Trajectory.from_rows(rows([0.0, 2.0, 4.0], [0.5, 1.5, 2.5], [0.0, 1.0, 1.0]))
    c = ex.compare(plain, refreshed, gold_std=2.0, bin_width=5.0)
    assert c["end"]["refresh"]["gap"] == pytest.approx(1.0 - (2.5 - 0.5) / 2.0)
    assert c["end"]["plain"]["gap"] == pytest.approx(2.5 - (gold[-1] - 0.5) / 2.0)
    assert [(row["kl_low"], row["kl_high"]) for row in c["same_kl"]] == [
        (0, 5),
        (5, 10),
        (15, 20),
    ]  # none in [10, 15)
    first = c["same_kl"][0]
    g, p = np.mean(gold[1:4]), np.mean([0.5, 1.0, 1.5])  # plain: KL 0.25, 1 and 4
    assert first["plain"] == {
        "gold": pytest.approx(g),
        "proxy": pytest.approx(p),
        "n": 3,
        "gap": pytest.approx(p - (g - 0.5) / 2.0),
    }
    assert first["refresh"] == {
        "gold": 2.0,
        "proxy": 1.0,
        "n": 2,
        "gap": pytest.approx(1.0 - (2.0 - 0.5) / 2.0),
    }
    assert c["same_kl"][1]["refresh"] is None and c["same_kl"][2]["plain"]["n"] == 1
