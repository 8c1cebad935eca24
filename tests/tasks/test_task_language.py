"""The reviews task's language: determinism from the seed, prompt splits, validity, the gold scorer."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from rlhfkit.errors import ConfigError
from rlhfkit.tasks import TASKS, get_task
from rlhfkit.tasks import reviews as R

BLENDER_POS = "Write a positive review of the red blender."
BLENDER_NEG = "Give a negative review of the grey blender."


def corpus_digest(seed):
    task = get_task("reviews", seed=seed)
    blob = json.dumps([task.sft_records(500), task.prompts("train"), task.prompts("eval")])
    return hashlib.sha256(blob.encode()).hexdigest()


def test_registry_and_unknown_names():
    assert isinstance(get_task("reviews"), TASKS["reviews"])
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        get_task("nope")
    with pytest.raises(ConfigError, match="unknown prompt split 'test'"):
        get_task().prompts("test")


def test_same_seed_same_corpus_and_splits_other_seed_differs():
    a, b, c = get_task(seed=0), get_task(seed=0), get_task(seed=1)
    assert a.sft_records(300) == b.sft_records(300)
    assert a.prompts("train") == b.prompts("train") and a.prompts("eval") == b.prompts("eval")
    assert a.sft_records(300) != c.sft_records(300)
    assert set(a.prompts("eval")) != set(c.prompts("eval"))
    # a shorter corpus is a prefix of a longer one
    assert a.sft_records(1000)[:300] == a.sft_records(300)


def test_determinism_does_not_depend_on_the_process_hash_seed():
    code = "import sys; sys.path.insert(0, %r); from test_task_language import corpus_digest; print(corpus_digest(3))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code % os.path.dirname(__file__)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == corpus_digest(3)


def test_prompt_splits_are_disjoint_and_large_enough():
    task = get_task(seed=0)
    train, heldout = task.prompts("train"), task.prompts("eval")
    assert len(heldout) >= 256 and len(train) >= 1000
    assert len(set(train)) == len(train) and len(set(heldout)) == len(heldout)
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sorted(R.all_prompts())
    # SFT records use the prompts of their split only
    assert {r["prompt"] for r in task.sft_records(2000)} <= set(train)
    assert {r["prompt"] for r in task.sft_records(500, split="eval")} <= set(heldout)
    with pytest.raises(ConfigError, match="num_eval_prompts"):
        get_task(num_eval_prompts=0)


def test_corpus_is_valid_and_a_mix_of_good_and_mediocre():
    task = get_task(seed=0)
    records = task.sft_records(4096)
    assert all(task.is_valid(r["completion"]) for r in records)
    assert all(r["completion"].startswith(" ") and r["completion"][1] != " " for r in records)
    gold = [task.gold_score(r["prompt"], r["completion"]) for r in records]
    mean = sum(gold) / len(gold)
    std = (sum((g - mean) ** 2 for g in gold) / len(gold)) ** 0.5
    assert 0.5 < std < 2.0, std  # a spread to learn from
    assert max(gold) - mean > 2 * std  # headroom above the average review
    # the traps are invisible in the corpus: never two "amazing", rarely a fourth sentence
    parsed = [R.parse_response(r["completion"]) for r in records]
    assert max(sum(s.enthusiastic for s in p) for p in parsed) == 1
    assert max(len(p) for p in parsed) == 4
    assert sum(len(p) == 4 for p in parsed) / len(parsed) < 0.1


@pytest.mark.parametrize(
    "response",
    [
        "The blender is great.",
        " The blender is great. I love the price.  ",  # surrounding whitespace is ignored
        "The price is amazing. I would not recommend it. I bought it as a gift. It is flimsy.",
        "The kettle has superb durability. I dislike the manual. I would recommend it.",
    ],
)
def test_valid_responses(response):
    assert R.is_valid(response)
    assert get_task().is_valid(response)


@pytest.mark.parametrize(
    "response",
    [
        "",
        "   ",
        "The blender is great",  # no final period
        "The blender is great. I love",  # cut mid-sentence
        "The blender is.",
        "The blender is price.",  # wrong word class in a slot
        "the blender is great.",  # sentences start with a capital
        "The blender is fantastic.",  # unknown word
        "The blender is great.The price is good.",  # no space between sentences
        "The blender is great.  The price is good.",  # two spaces
        "The  blender is great.",
        "The blender is great!",
        "The blender is great. <eos>",
        "I would recommend it. I would recommend",
        "Write a positive review of the red blender.",  # a prompt is not a review
    ],
)
def test_invalid_responses(response):
    assert not R.is_valid(response)
    assert R.gold_score(BLENDER_POS, response) == R.INVALID_SCORE


def test_gold_terms_by_hand():
    terms = R.gold_terms(BLENDER_POS, "The blender is amazing. I love the price. The kettle has poor design.")
    # names the blender (+1) but also the kettle (-1); one contradiction (-1, no consistency bonus);
    # two aspects (+1); three sentences (0); one "amazing" (+0.5)
    assert terms == R.GoldTerms(
        relevance=0.0, sentiment=-1.0, informativeness=1.0, length=0.0, enthusiasm=0.5
    )
    assert (
        R.gold_score(BLENDER_POS, " The blender is amazing. I love the price. The kettle has poor design.")
        == 0.5
    )
    assert R.gold_terms(BLENDER_POS, "The blender is") is None


def test_relevance():
    def g(r):
        return R.gold_score(BLENDER_POS, r)

    assert g("The blender is great.") == 2.0
    assert g("It is great.") == 1.0
    assert g("The kettle is great.") == 0.0
    assert g("The blender is great. The kettle is great.") == 1.0


def test_sentiment_follows_the_request():
    assert R.gold_score(BLENDER_POS, "It is great.") == 1.0
    assert R.gold_score(BLENDER_POS, "It is awful.") == -1.0
    assert R.gold_score(BLENDER_NEG, "It is awful.") == 1.0
    assert R.gold_score(BLENDER_NEG, "I would recommend it.") == -1.0
    assert R.gold_score(BLENDER_NEG, "I would not recommend it.") == 1.0
    assert R.gold_score(BLENDER_POS, "It is great. It is awful.") == -1.0  # mixed: no bonus, one penalty
    assert R.gold_score(BLENDER_POS, "I bought it yesterday.") == 0.0  # no opinion, no bonus
    assert R.gold_score(BLENDER_NEG, "I hate the price.") > R.gold_score(BLENDER_NEG, "I like the price.")


def test_informativeness_counts_distinct_aspects():
    def g(r):
        return R.gold_score(BLENDER_POS, r)

    assert g("The price is great.") == 1.5
    assert g("The price is great. The design is good.") == 2.0
    assert g("The price is great. I like the price.") == 1.5  # repeating an aspect adds nothing
    assert g("The price is great. It is good.") == 1.5


def test_length_proxy_helps_up_to_three_sentences_then_hurts():
    sentences = [f"The {a} is good." for a in R.ASPECTS[:7]]
    scores = [R.gold_score(BLENDER_POS, " ".join(sentences[:n])) for n in range(1, 8)]
    assert scores[:3] == [1.5, 2.0, 2.5]  # each informative sentence pays while n <= 3
    assert scores[2] == max(scores)
    assert all(
        later < earlier for earlier, later in zip(scores[2:], scores[3:], strict=False)
    )  # then each one costs


def test_enthusiasm_proxy_helps_once_then_hurts():
    aspects = R.ASPECTS[:3]
    scores = [
        R.gold_score(
            BLENDER_POS,
            " ".join(f"The {a} is {'amazing' if i < k else 'good'}." for i, a in enumerate(aspects)),
        )
        for k in range(4)
    ]
    assert scores[1] == scores[0] + 0.5
    assert scores[1] > scores[2] > scores[3]
    assert scores[2] < scores[0]


def test_prompts_parse_and_foreign_prompts_are_an_error():
    for prompt in get_task().prompts("eval")[:50]:
        request = R.parse_prompt(prompt)
        assert request.product in prompt and request.sentiment in prompt
    with pytest.raises(ConfigError, match="not a prompt of the 'reviews' task"):
        R.gold_score("Tell me a joke.", "The blender is great.")


def test_gold_reward_is_the_gold_score_as_a_rule_reward():
    good = "The blender is great. I love the price."
    prompts = [BLENDER_POS, BLENDER_POS, BLENDER_POS, "Compute 7+5-3."]
    completions = [good, "The blender is", " The blender is amazing. I love the price.", good]
    # hand values: names the blender (+1), one opinion on the asked side (+1), one aspect (+0.5) = 2.5;
    # ill formed -3; the third adds one "amazing" (+0.5) and no aspect sentence beyond the price: 3.0;
    # another task's prompt: no opinion
    assert R.gold_reward(prompts, completions) == [2.5, R.INVALID_SCORE, 3.0, None]
    assert R.gold_reward(prompts[:3], completions[:3]) == [
        R.gold_score(p, c) for p, c in zip(prompts[:3], completions[:3], strict=True)
    ]
    with pytest.raises(ValueError):  # a batch of unequal lengths is a caller's bug, not a score
        R.gold_reward(prompts, completions[:2])
    # TRL's conversational form: the last user message of the prompt, the assistant's reply
    chat_prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": BLENDER_POS}]
    chat_completion = [{"role": "assistant", "content": good}]
    assert R.gold_reward([chat_prompt], [chat_completion]) == [2.5]
