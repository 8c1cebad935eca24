"""Paired comparisons over seeds: per-seed differences, a t-interval on them, exact tests, Holm's correction, and
the one decision rule that turns them into a verdict.

In the experiments of ``docs/experiments.md`` every seed's runs share that seed's SFT policy, reward model and
prompts, so two settings are compared seed by seed: d_i = b_i - a_i. Beside the mean difference this gives

- the two-sided t-interval on the differences, mean(d) ± t_{(1+level)/2, n-1} sd(d) / sqrt(n) (Student 1908;
  the paired t-test of any statistics text, e.g. Wasserman, "All of Statistics", 2004, sec. 10.4); it assumes
  the differences are roughly normal, which 3-5 seeds cannot check;
- the exact two-sided sign-flip (permutation) test of the mean (Fisher 1935, "The Design of Experiments",
  sec. 21; Good, "Permutation Tests", 2000, sec. 3.1): under "no difference" each d_i is as likely to be +|d_i|
  as -|d_i|, so p is the share of the 2^n sign flips whose |sum| reaches the observed one. No assumption on the
  differences' shape; computed over all 2^n flips for n <= 20 (:func:`sign_flip_p`). It cannot go below
  2 / 2^n: 0.25 at 3 seeds, 0.0625 at 5, so no claim on 5 seeds can pass it at 5%;
- the exact two-sided sign test on the signs alone (ties dropped; Wasserman sec. 10.2), the exact test above
  20 values;
- Holm's step-down correction of a family's p-values (Holm 1979, "A simple sequentially rejective multiple test
  procedure"), :func:`holm`.

:func:`decide` is the page's one decision rule (its docstring states it); :func:`verdict` is that rule for a
claimed direction alone (a family of one), worded as the experiment scripts print it. Plain Python (``math``
and ``fractions`` only), so that the experiment scripts and the tests need nothing beyond the library.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

ALPHA = 0.05  # the level of every directional test on the page: the 95% interval, the corrected exact p
MAX_FLIP_N = 20  # above this many values the exact test is the sign test


def t_cdf_two_sided(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` (>= 1, an integer) degrees of freedom, t >= 0.

    The finite series of Abramowitz & Stegun (1964), 26.7.3 (odd df) and 26.7.4 (even df), with
    theta = atan(t / sqrt(df)).
    """
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be a positive integer, got {df}")
    if t < 0:
        raise ValueError(f"t must be >= 0, got {t}")
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:  # sin(theta) * (1 + 1/2 c^2 + 1*3/(2*4) c^4 + ... up to c^(df-2))
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return s * total
    if df == 1:
        return 2.0 * theta / math.pi
    # (2/pi) (theta + sin cos (1 + 2/3 c^2 + 2*4/(3*5) c^4 + ... up to c^(df-3)))
    term, total = 1.0, 1.0
    for k in range(1, (df - 1) // 2):
        term *= c2 * (2 * k) / (2 * k + 1)
        total += term
    return 2.0 / math.pi * (theta + s * math.sqrt(c2) * total)


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| <= t) = ``level`` (0 < level < 1): the half-width factor of a two-sided interval.
    Bisection on :func:`t_cdf_two_sided` (monotone in t), to 1e-12."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    low, high = 0.0, 1.0
    while t_cdf_two_sided(high, df) < level:
        high *= 2.0
    while high - low > 1e-12 * max(1.0, high):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if t_cdf_two_sided(mid, df) < level else (low, mid)
    return 0.5 * (low + high)


def sign_test_p(positive: int, negative: int) -> float:
    """Exact two-sided sign test: P(a split at least this uneven) under Binomial(n, 1/2), n = positive +
    negative (ties already dropped); 1.0 when n = 0."""
    n = positive + negative
    if n == 0:
        return 1.0
    k = min(positive, negative)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def _exact(x: float) -> Fraction:
    """``x`` as the decimal it prints as, to 12 significant digits: float noise of a subtraction (1.45 - 1.70 =
    -0.25000000000000006) is not a difference, and two values printed equal count as a tie."""
    return Fraction(f"{x:.12g}")


def _flip_sums(values: Sequence[Fraction]) -> list[Fraction]:
    """The 2^len sums of ``values`` under every choice of signs."""
    sums = [Fraction(0)]
    for x in values:
        sums = [s + x for s in sums] + [s - x for s in sums]
    return sums


def sign_flip_p(differences: Sequence[float]) -> float:
    """Exact two-sided sign-flip test of the mean of ``differences``: the share of all 2^n sign assignments
    whose |sum| is at least the observed |sum| (the observed one included, so p >= 2 / 2^n when no difference is
    0). Exact in rational arithmetic on the differences as they print (:func:`_exact`), over all 2^n flips:
    the sums of the two halves' flips are enumerated separately (2^(n/2) each) and paired by bisection.

    Raises:
        ValueError: no values, more than 20 (use :func:`sign_test_p`), or a value that is not finite.
    """
    n = len(differences)
    if not 1 <= n <= MAX_FLIP_N:
        raise ValueError(f"sign_flip_p takes 1 to {MAX_FLIP_N} values (all 2^n flips), got {n}")
    if not all(math.isfinite(x) for x in differences):
        raise ValueError(f"sign_flip_p: a difference is not finite: {list(differences)}")
    d = [_exact(x) for x in differences]
    observed = abs(sum(d))
    if observed == 0:
        return 1.0
    left, right = _flip_sums(d[: n // 2]), sorted(_flip_sums(d[n // 2 :]))
    # |l + r| >= T: r >= T - l or r <= -T - l, disjoint since T > 0
    count = sum(
        len(right) - bisect.bisect_left(right, observed - x) + bisect.bisect_right(right, -observed - x)
        for x in left
    )
    return count / 2.0**n


def exact_p(differences: Sequence[float]) -> float:
    """The page's exact test of a paired comparison: :func:`sign_flip_p` for up to 20 values, the sign test
    (:func:`sign_test_p`, ties dropped) above."""
    if len(differences) <= MAX_FLIP_N:
        return sign_flip_p(differences)
    return sign_test_p(sum(x > 0 for x in differences), sum(x < 0 for x in differences))


def smallest_exact_p(n: int) -> float:
    """The smallest two-sided p the exact test can give on ``n`` values (every value on one side): 2 / 2^n for
    the sign-flip test, the same for the sign test. At 5 seeds 0.0625: no claim on 5 seeds can pass 5%."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return min(1.0, 2.0 / 2.0**n)


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: with p_(1) <= ... <= p_(m),
    adj_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)). Rejecting where adj <= alpha is Holm's procedure at alpha
    (Holm 1979; Wright 1992 for the adjusted form); it controls the family-wise error for any dependence.

    Raises:
        ValueError: a p outside [0, 1].
    """
    if not all(0.0 <= p <= 1.0 for p in ps):
        raise ValueError(f"holm: p-values must lie in [0, 1], got {list(ps)}")
    m = len(ps)
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda k: ps[k])):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        out[i] = running
    return out


@dataclass(frozen=True)
class Paired:
    """The paired comparison of b against a over seeds (differences b - a, in the order given)."""

    differences: tuple[float, ...]
    mean: float
    sd: float | None  # sample sd of the differences (n - 1); None for one seed
    low: float | None  # the t-interval; None for one seed
    high: float | None
    level: float
    positive: int
    negative: int
    ties: int
    sign_p: float
    n: int  # how many values the mean is over: the seeds (or, from :func:`paired_summary`, its n)
    exact_p: float | None = None  # :func:`exact_p` of the differences; None where they are not kept

    def interval(self, level: float) -> tuple[float, float] | None:
        """The two-sided t-interval on the mean at ``level``; None below two values."""
        if self.sd is None or self.n < 2:
            return None
        half = t_quantile(level, self.n - 1) * self.sd / math.sqrt(self.n)
        return self.mean - half, self.mean + half


def paired(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Paired:
    """Per-seed differences b_i - a_i, their mean, sd, two-sided t-interval at ``level`` and sign test.

    Args:
        a, b: one value per seed, the same seeds in the same order (len >= 1).
    Raises:
        ValueError: different lengths, no seeds, or a value that is not finite.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired needs one value of each per seed: got {len(a)} and {len(b)}")
    d = tuple(float(y) - float(x) for x, y in zip(a, b, strict=True))
    if not all(math.isfinite(x) for x in d):
        raise ValueError(f"paired: a difference is not finite: {d}")
    n = len(d)
    mean = sum(d) / n
    sd = low = high = None
    if n > 1:
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
        half = t_quantile(level, n - 1) * sd / math.sqrt(n)
        low, high = mean - half, mean + half
    positive, negative = sum(x > 0 for x in d), sum(x < 0 for x in d)
    return Paired(
        d,
        mean,
        sd,
        low,
        high,
        level,
        positive,
        negative,
        n - positive - negative,
        sign_test_p(positive, negative),
        n,
        exact_p(d),
    )


def paired_summary(mean: float, se: float, n: int, level: float = 0.95) -> Paired:
    """A :class:`Paired` from a mean over ``n`` values and its standard error, where the values themselves are not
    kept (the KL estimators' per-token check: a mean over thousands of tokens, not seeds). No sign test and no
    exact test, so :func:`decide` decides only a no-difference claim on it.

    Raises:
        ValueError: n < 2, a negative standard error, or a value that is not finite.
    """
    if n < 2 or not (math.isfinite(mean) and math.isfinite(se)) or se < 0:
        raise ValueError(
            f"paired_summary needs a finite mean, a standard error >= 0 and n >= 2: {mean}, {se}, {n}"
        )
    sd = se * math.sqrt(n)
    half = t_quantile(level, n - 1) * se
    return Paired((), float(mean), sd, mean - half, mean + half, level, 0, 0, 0, 1.0, n)


@dataclass(frozen=True)
class Claim:
    """What a comparison b - a claims: ``direction`` +1 (b above a), -1 (b below a) or 0 (no difference), and
    ``margin`` (> 0, in the compared figure's units), the difference small enough to count as none. A margin is
    required for ``direction`` 0 and optional otherwise. The page's margins are registered with their reasons in
    docs/experiments_plan.json, which says which were chosen after their runs (:mod:`rlhfkit.reporting.plan`)."""

    direction: int
    margin: float | None = None

    def __post_init__(self):
        if self.direction not in (1, 0, -1):
            raise ValueError(f"a claim's direction is +1, -1 or 0 (no difference), got {self.direction}")
        if self.margin is not None and not (math.isfinite(self.margin) and self.margin > 0):
            raise ValueError(f"a claim's margin must be a finite number > 0, got {self.margin}")
        if self.direction == 0 and self.margin is None:
            raise ValueError("a 'no difference' claim needs its margin")


def decide(p: Paired, claim: Claim, corrected_p: float | None = None) -> str:
    """The decision rule of docs/experiments.md: one verdict for a claim about the paired differences d = b - a.

    With the two-sided t-intervals on the mean of d (:meth:`Paired.interval`) and the exact test's p
    (:func:`exact_p`) after Holm's correction over the claim's family (``corrected_p``; ``p.exact_p``, a family
    of one, when not given):

    - ``holds``: a direction claim whose 95% interval lies wholly on the claimed side of 0 and whose corrected
      exact p is at most 0.05 — the interval and the exact test agree;
    - ``fails``: the same on the other side of 0, or a no-difference claim whose 95% interval lies wholly
      outside [-margin, +margin];
    - ``no difference (within ±margin)``: the 90% interval lies inside (-margin, +margin) — the two one-sided
      tests of equivalence at 5% each (TOST; Schuirmann 1987) — for a no-difference claim, or for a direction
      claim that neither holds nor fails and states a margin;
    - ``open``: anything else: the interval reaches 0, or the corrected exact test does not reach 0.05 (at 5
      seeds it cannot: its p is at least 0.0625), a direction claim on a mean whose values are not kept (no
      exact test), a single value (no interval).

    The margin is registered with the claim (docs/experiments_plan.json).

    Raises:
        ValueError: ``corrected_p`` outside [0, 1] or below the uncorrected exact p.
    """
    if corrected_p is not None and (
        not 0.0 <= corrected_p <= 1.0 or (p.exact_p is not None and corrected_p < p.exact_p)
    ):
        raise ValueError(f"corrected_p must lie in [exact p = {p.exact_p}, 1], got {corrected_p}")
    ci95, ci90 = p.interval(0.95), p.interval(0.90)
    if ci95 is None or ci90 is None:
        return "open"
    low, high = ci95
    test_p = p.exact_p if corrected_p is None else corrected_p
    if claim.direction != 0 and test_p is not None and test_p <= ALPHA and (low > 0 or high < 0):
        return "holds" if (low > 0) == (claim.direction > 0) else "fails"
    m = claim.margin
    if m is not None:
        if -m < ci90[0] and ci90[1] < m:
            return f"no difference (within ±{m:g})"
        if claim.direction == 0 and (low > m or high < -m):
            return "fails"
    return "open"


def verdict(p: Paired, claimed: int) -> str:
    """``holds`` / ``fails`` / ``open here``: :func:`decide` for the claim that b - a has the sign of ``claimed``
    (+1 or -1), with no margin, as a family of one (no correction; below 6 seeds always ``open here``: the
    exact test cannot reach 0.05)."""
    if claimed not in (1, -1):
        raise ValueError(f"claimed must be +1 or -1, got {claimed}")
    word = decide(p, Claim(claimed))
    return "open here" if word == "open" else word


def describe(p: Paired, digits: int = 2) -> str:
    """One line: ``-0.29 (-0.25 / -0.21 / -0.40); 95% t-interval [-0.54, -0.04]; sign test 0+ 3- (p = 0.25);
    exact p = 0.25``."""
    f = f"{{:+.{digits}f}}"
    per_seed = " / ".join(f.format(x) for x in p.differences)
    line = f"{f.format(p.mean)} ({per_seed})"
    if p.low is not None and p.high is not None:
        line += f"; {100 * p.level:g}% t-interval [{f.format(p.low)}, {f.format(p.high)}]"
    ties = f" {p.ties}=" if p.ties else ""
    line += f"; sign test {p.positive}+ {p.negative}-{ties} (p = {p.sign_p:.3g})"
    return line if p.exact_p is None else line + f"; exact p = {p.exact_p:.3g}"
