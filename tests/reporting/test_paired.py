"""rlhfkit.reporting.paired: the t distribution's series against closed forms, a plain numerical integral and
the printed table; a paired comparison and a sign test computed by hand; the verdict's three answers."""

from __future__ import annotations

import math

import pytest

from rlhfkit.reporting.paired import describe, paired, sign_test_p, t_cdf_two_sided, t_quantile, verdict


def test_t_cdf_closed_forms():
    assert t_cdf_two_sided(1.0, 1) == pytest.approx(0.5, abs=1e-15)  # Cauchy: 2 atan(1) / pi
    assert t_cdf_two_sided(2.0, 2) == pytest.approx(2.0 / math.sqrt(6.0), abs=1e-15)  # t / sqrt(2 + t^2)
    # df 3 at t = sqrt(3): theta = atan(1) = pi / 4, (2 / pi)(pi / 4 + sin cos) = 1/2 + 1/pi
    assert t_cdf_two_sided(math.sqrt(3.0), 3) == pytest.approx(0.5 + 1 / math.pi, abs=1e-15)
    assert t_cdf_two_sided(0.0, 7) == 0.0


def _density_integral(t: float, df: int, steps: int = 20_000) -> float:
    """P(|T| <= t) by Simpson's rule on the t density (the plain reference)."""
    norm = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))

    def f(x):
        return norm * (1 + x * x / df) ** (-(df + 1) / 2)

    h = t / steps
    total = f(0) + f(t) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, steps))
    return 2 * total * h / 3


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 8, 11])
def test_t_cdf_equals_the_integral_of_the_density(df):
    for t in (0.3, 1.0, 2.5, 6.0):
        assert t_cdf_two_sided(t, df) == pytest.approx(_density_integral(t, df), abs=1e-10)


def test_t_quantile_matches_the_printed_table():
    # two-sided 95%: the t table of any statistics text (t_{0.975, df})
    for df, printed in ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042)):
        assert t_quantile(0.95, df) == pytest.approx(printed, abs=5e-4)
    assert t_quantile(0.90, 4) == pytest.approx(2.132, abs=5e-4)
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError):
            t_quantile(bad, 3)


def test_sign_test_by_hand():
    assert sign_test_p(3, 0) == pytest.approx(0.25)  # 2 * (1/2)^3
    assert sign_test_p(0, 5) == pytest.approx(0.0625)  # 2 * (1/2)^5
    assert sign_test_p(4, 1) == pytest.approx(0.375)  # 2 * (1 + 5) / 32
    assert sign_test_p(2, 2) == 1.0 and sign_test_p(0, 0) == 1.0


def test_paired_by_hand():
    # gamma = 0.99 against gamma = 1, held-out gold per seed (docs/experiments.md): 1.70 / 2.08 / 1.53 -> 1.45 /
    # 1.87 / 1.13; differences -0.25, -0.21, -0.40, mean -0.28667, sd sqrt(0.020067 / 2) = 0.100167,
    # half-width 4.30265 * 0.100167 / sqrt(3) = 0.248827
    p = paired([1.70, 2.08, 1.53], [1.45, 1.87, 1.13])
    assert p.differences == pytest.approx((-0.25, -0.21, -0.40))
    assert p.mean == pytest.approx(-0.286667, abs=1e-6)
    assert p.sd == pytest.approx(0.100167, abs=1e-6)
    assert (p.low, p.high) == (pytest.approx(-0.535494, abs=1e-5), pytest.approx(-0.037840, abs=1e-5))
    assert (p.positive, p.negative, p.ties, p.sign_p) == (0, 3, 0, pytest.approx(0.25))
    assert verdict(p, -1) == "holds" and verdict(p, +1) == "fails"
    assert (
        describe(p)
        == "-0.29 (-0.25 / -0.21 / -0.40); 95% t-interval [-0.54, -0.04]; sign test 0+ 3- (p = 0.25)"
    )


def test_paired_ties_one_seed_and_open():
    p = paired([1.0, 2.0, 3.0], [1.0, 3.0, 4.5])  # differences 0, 1, 1.5: one tie, dropped by the sign test
    assert (p.positive, p.negative, p.ties, p.sign_p) == (2, 0, 1, pytest.approx(0.5))
    assert p.low < 0 < p.high and verdict(p, +1) == "open here"  # mean 0.833, sd 0.764, half-width 1.898
    one = paired([1.0], [2.0])
    assert one.sd is None and one.low is None and verdict(one, +1) == "open here"
    assert "t-interval" not in describe(one)


def test_paired_refuses_bad_input():
    with pytest.raises(ValueError, match="per seed"):
        paired([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="per seed"):
        paired([], [])
    with pytest.raises(ValueError, match="not finite"):
        paired([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError, match="claimed"):
        verdict(paired([1.0, 2.0], [2.0, 3.0]), 0)
