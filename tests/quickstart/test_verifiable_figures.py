"""rlhfkit.quickstart.verifiable.greedy_figures: exact match, step accuracy over every line written, and the valid
rate, by hand, from the greedy samples (the sampler stood in for: the figures are what is tested here)."""

from types import SimpleNamespace

import pytest

from rlhfkit.quickstart import verifiable
from rlhfkit.rollout import evaluate
from rlhfkit.tasks import get_task


def test_greedy_figures_are_exact_match_step_accuracy_over_all_lines_and_valid_rate(monkeypatch):
    task = get_task("arithmetic")
    prompts = ["Compute 7+5-3.", "Compute 7+5-3.", "Compute 1+2+3."]
    responses = ["7+5=12\n12-3=9\nanswer=9\n", "7+5=2\n2-3=9\nanswer=9\n", "1+2=3\n"]
    gold = [task.gold_score(p, r) for p, r in zip(prompts, responses, strict=True)]
    valid = [task.is_valid(r) for r in responses]
    asked = {}

    def stand_in(policy, tokenizer, examples, **kwargs):
        asked.update(kwargs, examples=examples)
        return SimpleNamespace(prompts=prompts, responses=responses, gold=gold, valid=valid)

    monkeypatch.setattr(evaluate, "sample_and_score", stand_in)
    figures = verifiable.greedy_figures(None, None, task, ["e1", "e2", "e3"], 40)
    # lines right: 3 of 3, 0 of 3 (the slip in line 1 makes every later line wrong), 1 of 1 -> 4 of 7
    assert figures == pytest.approx({"exact_match": 2 / 3, "step_accuracy": 4 / 7, "valid_rate": 2 / 3})
    assert gold == [1.0, 1.0, 0.0] and valid == [True, True, False]
    assert (
        asked["greedy"] is True and asked["max_new_tokens"] == 40 and asked["examples"] == ["e1", "e2", "e3"]
    )
