"""Scoring: reward functions by name (module or file), called with TRL's keywords, their output checks
(None = no opinion), the reward model's normalised score read at the last real token whatever the padding,
and the sum of the parts."""

import math

import numpy as np
import pytest
import torch

from rlhfkit.errors import ConfigError
from rlhfkit.models import sequence_scores
from rlhfkit.rollout.scoring import RewardFunctionError, Scorer, combine_parts, load_reward_function
from tests.helpers import pad_batch, tiny_llama

FUNCTIONS = """
LIMIT = 3

def lengths(prompts, completions, **kwargs):
    return [len(c) for c in completions]

def plus_answer(prompts, completions, answer, **kwargs):
    return [float(a) for a in answer]
"""


def test_load_by_module_and_by_file(tmp_path):
    import os.path

    assert load_reward_function("os.path:join") is os.path.join
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "rewards.py").write_text(FUNCTIONS)
    (tmp_path / "b" / "rewards.py").write_text(
        "def lengths(prompts, completions):\n    return [0.0] * len(completions)\n"
    )
    fa = load_reward_function(f"{tmp_path}/a/rewards.py:lengths")
    fb = load_reward_function(f"{tmp_path}/b/rewards.py:lengths")  # same file name, another module
    assert fa(prompts=["p"], completions=["abc"]) == [3] and fb(prompts=["p"], completions=["abc"]) == [0.0]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("no_colon", ["online.reward_functions[2]", "not 'pkg.module:function'"]),
        ("{tmp}/missing.py:fn", ["file not found", "missing.py"]),
        ("rlhfkit_no_such_module_xyz:fn", ["cannot import module 'rlhfkit_no_such_module_xyz'"]),
        ("{tmp}/rewards.py:nope", ["has no attribute 'nope'"]),
        ("{tmp}/rewards.py:LIMIT", ["is a int, not a function"]),
        ("{tmp}/broken.py:fn", ["importing", "broken.py", "SyntaxError"]),
    ],
)
def test_bad_names_are_config_errors_naming_the_key(tmp_path, spec, words):
    (tmp_path / "rewards.py").write_text(FUNCTIONS)
    (tmp_path / "broken.py").write_text("def fn(:\n")
    with pytest.raises(ConfigError) as err:
        load_reward_function(spec.format(tmp=tmp_path), "online.reward_functions[2]")
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "returned, words",
    [
        ([float("nan"), 1.0], ["returned nan for response 0", "'a'"]),
        ([1.0, math.inf], ["inf for response 1"]),
        ([1.0], ["returned 1 values for 2 responses"]),
        ([1.0, True], ["True for response 1"]),
        ([1.0, "2"], ["'2' for response 1"]),
        (3.0, ["returned float"]),
    ],
)
def test_function_output_must_be_one_finite_number_per_response(returned, words):
    scorer = Scorer(functions=[("bad.py:f", lambda prompts, completions, **kw: returned)])
    ids, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3)
    with pytest.raises(RewardFunctionError) as err:
        scorer(ids, mask, ["p", "q"], ["a", "b"], [{}, {}])
    assert "'bad.py:f'" in str(err.value)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_numpy_and_tensor_outputs_are_accepted_and_parts_are_summed():
    scorer = Scorer(
        functions=[
            ("np", lambda prompts, completions, **kw: np.array([1.0, 2.0])),
            ("torch", lambda **kw: torch.tensor([0.5, -1.0], dtype=torch.float64)),
            ("ints", lambda completions: [3, 4]),
        ]
    )
    assert scorer.needs_text
    scores, parts, scored = scorer(
        torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3), ["p"] * 2, ["a", "b"], [{}] * 2
    )
    assert scores.dtype == torch.float32 and scores.tolist() == [4.5, 5.0] and scored.tolist() == [True, True]
    assert list(parts) == ["np", "torch", "ints"]


def test_reward_weights_weigh_each_function_in_the_sum_by_hand():
    """online.reward_weights (TRL's reward_weights): score = reward model + sum_i w_i * f_i, a None (no opinion)
    adding nothing whatever its weight; the parts stay each function's own, unweighted values."""
    scorer = Scorer(
        functions=[
            ("a", lambda completions: [1.0, 2.0, None]),
            ("b", lambda completions: [10.0, None, None]),
            ("c", lambda completions: [-4.0, 3.0, None]),
        ],
        weights=[0.5, 2.0, -0.25],
    )
    scores, parts, scored = scorer(
        torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2), ["p"] * 3, ["x", "y", "z"], [{}] * 3
    )
    # row 0: 0.5*1 + 2*10 - 0.25*-4 = 21.5; row 1: 0.5*2 + (None) - 0.25*3 = 0.25; row 2: no opinion at all
    assert scores.tolist() == [21.5, 0.25, 0.0] and scored.tolist() == [True, True, False]
    assert parts["a"][:2].tolist() == [1.0, 2.0] and parts["b"][0].item() == 10.0  # unweighted parts
    assert Scorer(functions=scorer.functions)(
        torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2), ["p"] * 3, ["x", "y", "z"], [{}] * 3
    )[0].tolist() == [7.0, 5.0, 0.0]  # no weights: all 1
    # a part the weights do not name (an environment's, the reward model's) weighs 1
    extra = {**parts, "environment": torch.tensor([1.0, float("nan"), 2.0])}
    assert combine_parts(extra, scorer.part_weights)[0].tolist() == [22.5, 0.25, 2.0]
    with pytest.raises(ConfigError, match="2 weight\\(s\\) for 3 reward function"):
        Scorer(functions=scorer.functions, weights=[1.0, 2.0])


def trl_style(prompts, completions, completion_ids, answer, **kwargs):
    """Written as for TRL's GRPOTrainer: keywords, conversational completions, a dataset column, **kwargs."""
    calls.append(
        {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            "answer": answer,
            **kwargs,
        }
    )
    return [
        None if a is None else float(c[0]["content"] == a) for c, a in zip(completions, answer, strict=True)
    ]


calls = []


def test_trl_convention_keywords_columns_and_none_as_no_opinion():
    calls.clear()
    prompts = [[{"role": "user", "content": "one plus one"}]] * 3
    records = [
        {"prompt": prompts[0], "answer": "two", "level": 1},
        {"prompt": prompts[0], "answer": "three"},
        {"prompt": prompts[0], "answer": None, "level": 3},
    ]
    scorer = Scorer(functions=[("trl", trl_style), ("none", lambda prompts, completions: [None, 2.0, None])])
    ids = torch.ones(3, 4, dtype=torch.long)
    scores, parts, scored = scorer(
        ids, torch.ones(3, 4), prompts, ["two", "two", "x"], records, completion_ids=[[5], [5], [7, 2]]
    )
    (call,) = calls
    assert call["completions"] == [[{"role": "assistant", "content": t}] for t in ("two", "two", "x")]
    assert call["prompts"] == prompts and call["completion_ids"] == [[5], [5], [7, 2]]
    assert call["answer"] == ["two", "three", None] and call["level"] == [1, None, 3]
    assert "prompt" not in call and "trainer_state" not in call
    assert parts["trl"][:2].tolist() == [1.0, 0.0] and math.isnan(parts["trl"][2])
    assert scores.tolist() == [1.0, 2.0, 0.0] and scored.tolist() == [True, True, False]


def test_plain_prompts_get_plain_completions_and_signatures_are_checked_before_training():
    seen = []
    scorer = Scorer(functions=[("f", lambda prompts, completions: seen.append(completions) or [1.0])])
    scorer(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2), ["hi"], ["there"], [{"prompt": "hi"}])
    assert seen == [["there"]]
    from rlhfkit.rollout.scoring import check_signature

    check_signature("ok", trl_style, ["answer"])
    with pytest.raises(
        ConfigError, match="reward function 'old' requires 'records', 'responses'.*columns \\(answer\\)"
    ):
        check_signature("old", lambda prompts, responses, records: [], ["answer"])
    with pytest.raises(ConfigError, match="requires 'answer'"):
        check_signature("trl", trl_style, [])


def test_a_raising_function_is_named_with_where_it_raised():
    def broken(prompts, completions, **kwargs):
        return [1.0 / 0 for _ in completions]

    with pytest.raises(
        RewardFunctionError,
        match="reward function 'broken' raised ZeroDivisionError: .* at .*test_scoring.py:",
    ):
        Scorer(functions=[("broken", broken)])(
            torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2), ["p"], ["r"], [{}]
        )


def test_nothing_to_score_is_a_config_error():
    with pytest.raises(ConfigError, match="online.reward_model"):
        Scorer()


@pytest.mark.parametrize("pad_id", [0, 2])  # a distinct pad, and pad == EOS (2)
def test_reward_model_score_is_normalised_and_padding_independent(pad_id):
    rm = tiny_llama("scalar", seed=3, pad_token_id=pad_id)
    rm.config.rlhfkit_reward_gain, rm.config.rlhfkit_reward_bias = 0.5, -1.25
    rows = [[1, 5, 6, 7, 2], [1, 9, 2], [1, 4, 4, 4, 4, 4, 2]]  # each ends with EOS
    scorer = Scorer(
        reward_model=rm,
        functions=[("len", lambda completions, **kw: [float(len(x)) for x in completions])],
        batch_size=2,
    )
    results = []
    for side in ("left", "right"):
        ids, mask = pad_batch(rows, pad_id, side)
        scores, parts, _ = scorer(ids, mask, ["p"] * 3, ["a", "bb", "ccc"], [{}] * 3)
        results.append(parts["reward_model"])
        assert torch.allclose(scores, parts["reward_model"] + torch.tensor([1.0, 2.0, 3.0]))
    alone = torch.cat([sequence_scores(rm, torch.tensor([r]), torch.ones(1, len(r))) for r in rows])
    assert torch.allclose(results[0], 0.5 * alone - 1.25, atol=1e-5)
    assert torch.allclose(results[1], 0.5 * alone - 1.25, atol=1e-5)
