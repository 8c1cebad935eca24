"""rlhfkit.reporting.paired: the t distribution's series against closed forms, a plain numerical integral and
the printed table; a paired comparison and a sign test computed by hand; the verdict's three answers."""

from __future__ import annotations

import math

import pytest

from rlhfkit.reporting.paired import (
    Claim,
    decide,
    describe,
    paired,
    paired_summary,
    sign_test_p,
    t_cdf_two_sided,
    t_quantile,
    verdict,
)


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


# The decision rule (docs/experiments.md, "How a verdict is decided"), fed the per-seed differences that the page
# prints for the comparisons the evidence review named; each gives the interval the page quotes, then the rule's word.
def _check(differences, interval, claim):
    p = paired([0.0] * len(differences), differences)
    # the page rounds its per-seed figures to two decimals, its intervals from the unrounded ones
    assert (p.low, p.high) == (pytest.approx(interval[0], abs=0.011), pytest.approx(interval[1], abs=0.011))
    return decide(p, claim)


def test_decide_every_seed_on_one_side_is_open_when_the_interval_reaches_zero():
    # GAE lambda 0.5 against 0.95, end gold: 0+ 5-, once worded "lower in every seed"
    assert _check([-0.19, -0.45, -0.30, -2.58, -0.14], (-2.02, 0.56), Claim(-1)) == "open"
    # DPO alone against PPO: 0+ 5-
    assert _check([-0.21, -1.32, -0.29, -1.72, -0.14], (-1.64, 0.17), Claim(-1)) == "open"
    # the over-fitted reward model against the usual one at kl_coef 0: 0+ 5-
    assert _check([-2.72, -0.29, -0.37, -0.81, -0.94], (-2.25, 0.19), Claim(-1)) == "open"
    # the critic's explained variance over the last 5 rollouts, reward model - policy: 5+ 0-
    assert _check([0.08, 0.03, 0.04, 0.01, 0.19], (-0.01, 0.15), Claim(+1)) == "open"
    # a sign test at its floor does not decide either: p = 0.0625 > 0.05
    assert paired([0.0] * 5, [-0.19, -0.45, -0.30, -2.58, -0.14]).sign_p == pytest.approx(0.0625)


def test_decide_explained_variance_interval_of_the_issue():
    # first 5 rollouts, reward model - policy: +0.23 / +0.10 / +0.22 / +1.15 / +0.46 -> [-0.09, +0.96]
    assert _check([0.23, 0.10, 0.22, 1.15, 0.46], (-0.09, 0.96), Claim(+1)) == "open"


def test_decide_no_difference_needs_the_interval_inside_the_margin():
    margin = Claim(0, margin=0.1)
    # lambda 1 against 0.95 [-0.31, +0.30]; beta 0.02 against 0.05 [-0.20, +0.18]; gamma 0.99 against 1
    # [-0.19, +0.15]; two processes against one (PPO) [-0.15, +0.43]: all once "no difference"
    assert _check([0.29, 0.23, -0.20, -0.14, -0.21], (-0.31, 0.30), margin) == "open"
    assert _check([0.21, -0.15, -0.03, -0.14, 0.08], (-0.20, 0.18), margin) == "open"
    assert _check([0.21, -0.15, -0.02, -0.06, -0.06], (-0.19, 0.15), margin) == "open"
    assert _check([0.30, -0.13, 0.32, -0.10, 0.30], (-0.15, 0.43), margin) == "open"
    # the same interval is equivalent under a margin wide enough for its 90% interval: [-0.12, +0.11] at 90%
    assert _check([0.21, -0.15, -0.02, -0.06, -0.06], (-0.19, 0.15), Claim(0, margin=0.15)) == (
        "no difference (within ±0.15)"
    )
    # sharded against data-parallel: equal in every seed, an interval of one point
    assert _check([0.0] * 5, (0.0, 0.0), margin) == "no difference (within ±0.1)"
    # a difference shown to exceed the margin fails the claim of none; one inside it but not shown stays open
    assert _check([0.30, 0.35, 0.40, 0.32, 0.38], (0.30, 0.40), margin) == "fails"
    assert _check([0.05, 0.15, 0.10, 0.12, 0.08], (0.05, 0.15), margin) == "open"


def test_decide_holds_fails_and_a_direction_with_a_margin():
    # PPO - DPO in the quickstart, gold: [+0.50, +0.97]
    ppo_dpo = [0.90, 0.66, 0.65, 0.96, 0.51]
    assert _check(ppo_dpo, (0.50, 0.97), Claim(+1)) == "holds"
    assert _check(ppo_dpo, (0.50, 0.97), Claim(-1)) == "fails"
    # a direction that neither holds nor fails, with a margin, can end "no difference": 90% [-0.17, +0.17]
    critic_warmup = [0.23, -0.03, -0.03, -0.13, -0.02]
    assert _check(critic_warmup, (-0.16, 0.17), Claim(+1, margin=0.2)) == "no difference (within ±0.2)"
    assert _check(critic_warmup, (-0.16, 0.17), Claim(+1, margin=0.1)) == "open"
    assert _check(critic_warmup, (-0.16, 0.17), Claim(+1)) == "open"
    # one seed has no interval: open whatever the claim
    assert decide(paired([0.0], [5.0]), Claim(+1)) == "open"
    assert decide(paired([0.0], [0.0]), Claim(0, margin=1.0)) == "open"


def test_decide_from_a_mean_and_its_standard_error():
    # the KL estimators' per-token check: k3 - exact KL, +0.0058 +- 0.0182 (s.e.) over 5,290 tokens
    k3 = paired_summary(0.0058, 0.0182, 5290)
    half = 1.9604 * 0.0182  # t_{0.975, 5289}
    assert k3.interval(0.95) == (
        pytest.approx(0.0058 - half, abs=1e-5),
        pytest.approx(0.0058 + half, abs=1e-5),
    )
    assert decide(k3, Claim(0, margin=0.05)) == "no difference (within ±0.05)"
    assert decide(k3, Claim(0, margin=0.03)) == "open"
    with pytest.raises(ValueError):
        paired_summary(0.0, 1.0, 1)


def test_claim_is_checked():
    for bad in (
        dict(direction=2),
        dict(direction=0),
        dict(direction=1, margin=0.0),
        dict(direction=0, margin=-1),
    ):
        with pytest.raises(ValueError):
            Claim(**bad)
