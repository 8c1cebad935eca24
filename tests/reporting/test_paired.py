"""rlhfkit.reporting.paired: the t distribution's series against closed forms, a plain numerical integral and
the printed table; a paired comparison and a sign test computed by hand; the exact sign-flip test against a
brute-force loop; Holm's correction by hand; the decision rule's answers and its corner cases."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from rlhfkit.reporting.paired import (
    Claim,
    decide,
    describe,
    exact_p,
    holm,
    paired,
    paired_summary,
    sign_flip_p,
    sign_test_p,
    smallest_exact_p,
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
    # all three negative: 2 of the 8 sign flips reach |sum| 0.86, p = 0.25; the interval alone no longer decides
    assert p.exact_p == 0.25
    assert verdict(p, -1) == "open here" and verdict(p, +1) == "open here"
    assert describe(p) == (
        "-0.29 (-0.25 / -0.21 / -0.40); 95% t-interval [-0.54, -0.04]; sign test 0+ 3- (p = 0.25); exact p = 0.25"
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
    # equivalence needs no exact test: TOST on the interval as before, at 5 seeds too
    assert _check([0.05, 0.15, 0.10, 0.12, 0.08], (0.05, 0.15), margin) == "open"


def test_decide_holds_fails_and_a_direction_with_a_margin():
    # PPO - DPO in the quickstart, gold: [+0.50, +0.97]
    ppo_dpo = [0.90, 0.66, 0.65, 0.96, 0.51]
    # the interval is far from 0 but 5 seeds cannot pass the exact test (p = 0.0625): open either way
    assert _check(ppo_dpo, (0.50, 0.97), Claim(+1)) == "open"
    assert _check(ppo_dpo, (0.50, 0.97), Claim(-1)) == "open"
    # the same effect over 10 seeds (each seed twice): exact p = 2 / 1024, interval [+0.65, +0.82]
    ten = paired([0.0] * 10, ppo_dpo * 2)
    assert ten.exact_p == pytest.approx(2 / 1024)
    assert decide(ten, Claim(+1)) == "holds" and decide(ten, Claim(-1)) == "fails"
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


def _brute_sign_flip(d):
    """The plain reference: every one of the 2^n sign vectors, the share whose |sum| reaches the observed one."""
    observed = abs(sum(d))
    hits = sum(
        abs(sum(s * x for s, x in zip(signs, d, strict=True))) >= observed - 1e-9
        for signs in itertools.product((1, -1), repeat=len(d))
    )
    return hits / 2 ** len(d)


def test_sign_flip_by_hand():
    # [1, 1, 2]: only all-plus and all-minus reach |sum| 4 -> 2 / 8
    assert sign_flip_p([1.0, 1.0, 2.0]) == 0.25
    # [1, -1, 2]: sums 4, 0, 2, -2, 2, -2, 0, -4 -> six of eight reach |2|; ties with the observed count
    assert sign_flip_p([1.0, -1.0, 2.0]) == 0.75
    # ties at 0 are flips that change nothing; all zero -> p = 1
    assert sign_flip_p([0.0, 0.0]) == 1.0 and sign_flip_p([0.0, 1.0]) == 1.0
    # a difference printed as a tie is a tie, whatever the float subtraction left (1.45 - 1.70 vs -0.25)
    assert sign_flip_p([1.45 - 1.70, 0.25]) == 1.0


def test_sign_flip_equals_the_brute_force_loop():
    rng = random.Random(0)
    for n in range(1, 13):
        for _ in range(6):
            d = [round(rng.gauss(0.3, 1.0), rng.choice((1, 2, 3))) for _ in range(n)]
            assert sign_flip_p(d) == pytest.approx(_brute_sign_flip(d), abs=1e-12), d
    # exact at 20 values (2^20 flips), in well under a second: every value on one side -> 2 / 2^20
    assert sign_flip_p([0.1 * (i + 1) for i in range(20)]) == 2 / 2**20
    with pytest.raises(ValueError, match="1 to 20"):
        sign_flip_p([1.0] * 21)
    with pytest.raises(ValueError, match="not finite"):
        sign_flip_p([1.0, float("inf")])
    # above 20 values the exact test is the sign test
    assert exact_p([1.0] * 21) == sign_test_p(21, 0)


def test_smallest_exact_p_is_the_power_floor():
    assert smallest_exact_p(5) == 0.0625 and smallest_exact_p(3) == 0.25 and smallest_exact_p(20) == 2 / 2**20
    for n in (3, 5, 7):
        assert sign_flip_p([0.01 * (i + 1) for i in range(n)]) == smallest_exact_p(n)


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # capped at 1; one p is its own correction; none is empty
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0]) and holm([0.2]) == [0.2] and holm([]) == []
    with pytest.raises(ValueError):
        holm([1.2])


def test_decide_one_outlier_against_four_does_not_hold():
    # PPO then DPO, DPO alone against PPO: 1+ 4-, the 95% interval [-6.13, -1.01] below 0 (once "holds"); the
    # exact test: the sign of +0.11 does not matter, so 4 of 32 flips reach |sum| -> p = 0.125
    d = [0.11, -4.43, -4.34, -4.81, -4.38]
    p = paired([0.0] * 5, d)
    assert p.high < 0 and p.exact_p == pytest.approx(4 / 32)
    assert decide(p, Claim(-1)) == "open"
    # one large outlier carrying the mean: 1+ 4-, p = 1 (every flip reaches the observed |sum|)
    assert decide(paired([0.0] * 5, [3.0, -0.1, -0.1, -0.1, -0.1]), Claim(+1)) == "open"


def test_decide_five_of_five_small_effects_is_open_for_power():
    # every seed on one side, a tight interval wholly above 0: still open, the exact test's floor at 5 values
    p = paired([0.0] * 5, [0.010, 0.020, 0.015, 0.012, 0.018])
    assert p.low > 0 and p.exact_p == smallest_exact_p(5) == 0.0625
    assert decide(p, Claim(+1)) == "open"
    # with a corrected p below 0.05 supplied (as from a family where it could pass) it would hold: the test
    # is what keeps it open
    assert decide(p, Claim(+1), corrected_p=0.0625) == "open"
    with pytest.raises(ValueError, match="corrected_p"):
        decide(p, Claim(+1), corrected_p=0.01)  # below the uncorrected exact p: not a correction


def test_decide_holm_corrected_p_decides_the_family():
    p = paired([0.0] * 7, [0.3, 0.5, 0.4, 0.6, 0.2, 0.45, 0.35])  # 7+ 0-: exact p = 2 / 128
    assert p.exact_p == pytest.approx(2 / 128)
    assert decide(p, Claim(+1)) == "holds"  # a family of one
    assert decide(p, Claim(+1), corrected_p=0.04) == "holds"
    assert decide(p, Claim(+1), corrected_p=0.06) == "open"  # Holm in a family of four: 4 * 0.0156 = 0.0625


def test_decide_95_for_directions_90_for_equivalence():
    # 7 seeds, 6+ 1-: exact p = 6 / 128 = 0.047 passes; the 90% interval is above 0, the 95% one reaches it
    d = [0.25, 0.37, -0.07, 0.10, 0.07, 0.70, 0.18]
    p = paired([0.0] * 7, d)
    assert p.exact_p == pytest.approx(6 / 128)
    assert p.interval(0.90)[0] > 0 > p.interval(0.95)[0]
    assert decide(p, Claim(+1)) == "open"
    # equivalence reads the 90% interval: inside ±0.2 though the 95% one crosses it
    q = paired([0.0] * 5, [-0.01, 0.0, -0.16, -0.12, 0.03])
    low90, high90 = q.interval(0.90)  # [-0.131, +0.027]
    low95, high95 = q.interval(0.95)  # [-0.155, +0.051]
    assert -0.15 < low90 and high90 < 0.15 and low95 < -0.15
    assert decide(q, Claim(0, margin=0.15)) == "no difference (within ±0.15)"


def test_decide_a_margin_crossing():
    margin = Claim(0, margin=0.1)
    # the 90% interval crosses +0.1 and the 95% one does not clear it: open
    crossing = paired([0.0] * 5, [0.05, 0.12, 0.09, 0.15, 0.07])
    assert crossing.interval(0.90)[0] < 0.1 < crossing.interval(0.90)[1]
    assert decide(crossing, margin) == "open"
    # moved wholly beyond the margin at 95%: fails; moved inside at 90%: no difference
    assert decide(paired([0.0] * 5, [0.25, 0.32, 0.29, 0.35, 0.27]), margin) == "fails"
    assert decide(paired([0.0] * 5, [0.01, 0.03, -0.02, 0.02, 0.0]), margin) == "no difference (within ±0.1)"
    # a direction with the margin: open by the exact test, then equivalent by TOST
    assert decide(paired([0.0] * 5, [0.01, 0.03, -0.02, 0.02, 0.0]), Claim(+1, margin=0.1)) == (
        "no difference (within ±0.1)"
    )


def test_decide_a_mean_without_its_values_decides_no_direction():
    # reversed k3 against exact KL, the size of the per-token gap: an interval far from 0 but no values kept
    far = paired_summary(0.87, 0.05, 5290)
    assert far.exact_p is None and far.low > 0
    assert decide(far, Claim(+1)) == "open"
    assert decide(far, Claim(0, margin=0.05)) == "fails"
