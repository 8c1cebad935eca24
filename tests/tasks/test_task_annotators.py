"""Simulated annotators: Bradley-Terry preference rates and the Bayes ceiling, against the formulas."""

import math
import random

import numpy as np
import pytest

from rlhfkit.errors import ConfigError
from rlhfkit.tasks import annotators as A
from rlhfkit.tasks import get_task

PROMPT = "Write a positive review of the red blender."
# gold scores: 2.0, 1.5, 1.0, -1.0 (hand-computed in test_task_language.py's criteria tests)
BEST, GOOD, PLAIN, WRONG = "The blender is great.", "The price is great.", "It is great.", "It is awful."


def test_sigmoid_is_stable_and_exact():
    assert A.sigmoid(0.0) == 0.5
    assert A.sigmoid(1000.0) == 1.0 and A.sigmoid(-1000.0) == 0.0
    for x in (-3.0, -0.2, 0.7, 4.0):
        assert A.sigmoid(x) == pytest.approx(1 / (1 + math.exp(-x)), rel=1e-12)


def test_preference_probability_formula():
    task = get_task(annotator_temperature=0.5)
    assert task.preference_probability(PROMPT, BEST, PLAIN) == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert task.preference_probability(PROMPT, PLAIN, BEST) == pytest.approx(1 / (1 + math.exp(2.0)))
    assert task.preference_probability(PROMPT, GOOD, WRONG, temperature=2.0) == pytest.approx(
        1 / (1 + math.exp(-1.25))
    )
    assert task.preference_probability(PROMPT, BEST, BEST) == 0.5


@pytest.mark.parametrize(
    "a, b, temperature",
    [(BEST, PLAIN, 0.5), (GOOD, PLAIN, 0.5), (PLAIN, GOOD, 1.0), (BEST, WRONG, 2.0), (GOOD, GOOD + " ", 0.5)],
)
def test_observed_preference_rate_matches_bradley_terry(a, b, temperature):
    task = get_task(annotator_temperature=temperature)
    rng = random.Random(0)
    n = 4000
    wins = sum(task.annotate(PROMPT, a, b, rng)["chosen"] == a for _ in range(n))
    p = A.sigmoid((task.gold_score(PROMPT, a) - task.gold_score(PROMPT, b)) / temperature)
    stderr = math.sqrt(p * (1 - p) / n)
    assert abs(wins / n - p) < 4 * stderr


def test_annotate_returns_a_preference_record_and_accepts_numpy_generators():
    task = get_task()
    record = task.annotate(PROMPT, PLAIN, WRONG, np.random.default_rng(0))
    assert set(record) == {"prompt", "chosen", "rejected"} and record["prompt"] == PROMPT
    assert {record["chosen"], record["rejected"]} == {PLAIN, WRONG}
    # a tiny temperature makes the annotators agree with gold
    assert task.annotate(PROMPT, WRONG, BEST, random.Random(1), temperature=1e-3)["chosen"] == BEST


def test_annotate_pairs_is_deterministic_from_its_seed():
    task = get_task()
    pairs = [(PROMPT, GOOD, PLAIN)] * 200
    assert task.annotate_pairs(pairs, seed=5) == task.annotate_pairs(pairs, seed=5)
    assert task.annotate_pairs(pairs, seed=5) != task.annotate_pairs(pairs, seed=6)


def test_gold_compare_is_noiseless():
    task = get_task()
    assert task.gold_compare(PROMPT, BEST, PLAIN) == 1
    assert task.gold_compare(PROMPT, WRONG, PLAIN) == -1
    assert task.gold_compare(PROMPT, GOOD, "I love the price.") == 0


def test_bayes_ceiling_by_hand():
    gold = [(1.0, 0.0), (2.0, 2.0), (0.0, 1.5)]  # the tie is excluded
    expected = (A.sigmoid(2.0) + A.sigmoid(3.0)) / 2
    assert A.bayes_ceiling_from_scores(gold, 0.5) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="every pair is a tie"):
        A.bayes_ceiling_from_scores([(1.0, 1.0)], 0.5)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="temperature"):
            A.bayes_ceiling_from_scores(gold, bad)
    with pytest.raises(ConfigError, match="temperature"):
        get_task(annotator_temperature=0)


def test_bayes_ceiling_matches_simulated_annotator_accuracy():
    """Labels sampled by the annotators agree with the gold ordering as often as the ceiling says."""
    task = get_task(seed=0)
    rng = random.Random(0)
    prompts = task.prompts("train")
    pairs = []
    for _ in range(400):
        prompt = rng.choice(prompts)
        pairs.append((prompt, task.sample_completion(prompt, rng), task.sample_completion(prompt, rng)))
    ceiling = task.bayes_ceiling(pairs)
    labels = random.Random(1)
    agree = total = 0
    for prompt, a, b in pairs:
        order = task.gold_compare(prompt, a, b)
        if order == 0:
            continue
        better = a if order > 0 else b
        for _ in range(25):
            agree += task.annotate(prompt, a, b, labels)["chosen"] == better
            total += 1
    stderr = math.sqrt(ceiling * (1 - ceiling) / total)
    assert abs(agree / total - ceiling) < 4 * stderr
    # noisier annotators lower the ceiling; near-noiseless ones approach 1
    assert task.bayes_ceiling(pairs, temperature=2.0) < ceiling < task.bayes_ceiling(pairs, temperature=0.05)
    assert task.bayes_ceiling(pairs, temperature=0.05) > 0.99
