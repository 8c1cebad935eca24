"""Simulated annotators: Bradley-Terry noise on gold scores, and the Bayes ceiling it implies.

An annotator shown two responses prefers ``a`` with probability

    P(a > b) = sigmoid((g_a - g_b) / temperature)

where ``g`` is the gold score (the Bradley-Terry model, Bradley & Terry 1952; the same form as the
reward-model loss of Ouyang et al. 2022, eq. 1). A small temperature gives careful annotators, a large
one gives annotators who often disagree with the gold ordering.

The **Bayes ceiling** of a set of pairs is the expected agreement of such noisy labels with the gold
ordering, ties excluded: mean over pairs with g_a != g_b of sigmoid(|g_a - g_b| / temperature). A model
that knows the gold scores exactly reaches this accuracy when graded against the annotators' labels, so
it is the ceiling of held-out accuracy measured against labels; accuracy against noiseless gold can go
higher than it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from rlhfkit.errors import ConfigError

# Gold scores closer than this are a tie (they are sums of multiples of 0.25, so exact in practice).
TIE_TOLERANCE = 1e-9


def check_temperature(temperature: float) -> float:
    """Return the temperature as a float; ConfigError unless it is a positive finite number."""
    t = float(temperature)
    if not (t > 0 and math.isfinite(t)):
        raise ConfigError(f"annotator temperature must be a positive number, got {temperature!r}")
    return t


def sigmoid(x: float) -> float:
    """Numerically stable logistic function."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def preference_probability(gold_a: float, gold_b: float, temperature: float) -> float:
    """P(an annotator prefers a over b) = sigmoid((gold_a - gold_b) / temperature)."""
    return sigmoid((gold_a - gold_b) / check_temperature(temperature))


def prefers_first(gold_a: float, gold_b: float, temperature: float, rng) -> bool:
    """Sample one annotator's judgement: True if ``a`` is preferred.

    ``rng`` is anything with a ``random()`` method returning a float in [0, 1): a ``random.Random`` or
    a ``numpy.random.Generator``. Exactly one draw is taken per judgement, so a seeded ``rng`` gives the
    same labels for the same sequence of pairs.
    """
    return rng.random() < preference_probability(gold_a, gold_b, temperature)


def gold_order(gold_a: float, gold_b: float) -> int:
    """The noiseless comparator: +1 if a is better, -1 if b is better, 0 for a tie."""
    if abs(gold_a - gold_b) <= TIE_TOLERANCE:
        return 0
    return 1 if gold_a > gold_b else -1


def bayes_ceiling_from_scores(gold_pairs: Iterable[tuple[float, float]], temperature: float) -> float:
    """Expected agreement of noisy annotators with the gold ordering over non-tied pairs.

    Args:
        gold_pairs: ``(gold_a, gold_b)`` per pair.
        temperature: the annotators' Bradley-Terry temperature.
    Raises:
        ValueError: if every pair is a tie (the ceiling is undefined).
    """
    t = check_temperature(temperature)
    agreements = [sigmoid(abs(a - b) / t) for a, b in gold_pairs if gold_order(a, b) != 0]
    if not agreements:
        raise ValueError("the Bayes ceiling is undefined: every pair is a tie under the gold scorer")
    return sum(agreements) / len(agreements)
