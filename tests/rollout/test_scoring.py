"""Scoring: reward functions by name (module or file), their output checks, the reward model's normalised
score read at the last real token whatever the padding, and the sum of the parts."""

import math

import numpy as np
import pytest
import torch

from rlhfkit.errors import ConfigError
from rlhfkit.models import sequence_scores
from rlhfkit.rollout.scoring import RewardFunctionError, Scorer, load_reward_function
from tests.helpers import pad_batch, tiny_llama

FUNCTIONS = '''
LIMIT = 3

def lengths(prompts, responses, records):
    return [len(r) for r in responses]

def plus_answer(prompts, responses, records):
    return [float(rec["answer"]) for rec in records]
'''


def test_load_by_module_and_by_file(tmp_path):
    import os.path

    assert load_reward_function("os.path:join") is os.path.join
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "rewards.py").write_text(FUNCTIONS)
    (tmp_path / "b" / "rewards.py").write_text("def lengths(p, r, rec):\n    return [0.0] * len(r)\n")
    fa = load_reward_function(f"{tmp_path}/a/rewards.py:lengths")
    fb = load_reward_function(f"{tmp_path}/b/rewards.py:lengths")  # same file name, another module
    assert fa(["p"], ["abc"], [{}]) == [3] and fb(["p"], ["abc"], [{}]) == [0.0]


@pytest.mark.parametrize("spec, words", [
    ("no_colon", ["online.reward_functions[2]", "not 'pkg.module:function'"]),
    ("{tmp}/missing.py:fn", ["file not found", "missing.py"]),
    ("rlhfkit_no_such_module_xyz:fn", ["cannot import module 'rlhfkit_no_such_module_xyz'"]),
    ("{tmp}/rewards.py:nope", ["has no attribute 'nope'"]),
    ("{tmp}/rewards.py:LIMIT", ["is a int, not a function"]),
    ("{tmp}/broken.py:fn", ["importing", "broken.py", "SyntaxError"]),
])
def test_bad_names_are_config_errors_naming_the_key(tmp_path, spec, words):
    (tmp_path / "rewards.py").write_text(FUNCTIONS)
    (tmp_path / "broken.py").write_text("def fn(:\n")
    with pytest.raises(ConfigError) as err:
        load_reward_function(spec.format(tmp=tmp_path), "online.reward_functions[2]")
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("returned, words", [
    ([1.0, None], ["returned None for response 1", "'b'"]),
    ([float("nan"), 1.0], ["returned nan for response 0"]),
    ([1.0, math.inf], ["inf for response 1"]),
    ([1.0], ["returned 1 values for 2 responses"]),
    ([1.0, True], ["True for response 1"]),
    ([1.0, "2"], ["'2' for response 1"]),
    (3.0, ["returned float"]),
])
def test_function_output_must_be_one_finite_number_per_response(returned, words):
    scorer = Scorer(functions=[("bad.py:f", lambda p, r, rec: returned)])
    ids, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3)
    with pytest.raises(RewardFunctionError) as err:
        scorer(ids, mask, ["p", "q"], ["a", "b"], [{}, {}])
    assert "'bad.py:f'" in str(err.value)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_numpy_and_tensor_outputs_are_accepted_and_parts_are_summed():
    scorer = Scorer(functions=[("np", lambda p, r, rec: np.array([1.0, 2.0])),
                               ("torch", lambda p, r, rec: torch.tensor([0.5, -1.0], dtype=torch.float64)),
                               ("ints", lambda p, r, rec: [3, 4])])
    assert scorer.needs_text
    scores, parts = scorer(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3), ["p"] * 2, ["a", "b"], [{}] * 2)
    assert scores.dtype == torch.float32 and scores.tolist() == [4.5, 5.0]
    assert list(parts) == ["np", "torch", "ints"]


def test_nothing_to_score_is_a_config_error():
    with pytest.raises(ConfigError, match="online.reward_model"):
        Scorer()


@pytest.mark.parametrize("pad_id", [0, 2])  # a distinct pad, and pad == EOS (2)
def test_reward_model_score_is_normalised_and_padding_independent(pad_id):
    rm = tiny_llama("scalar", seed=3, pad_token_id=pad_id)
    rm.config.rlhfkit_reward_gain, rm.config.rlhfkit_reward_bias = 0.5, -1.25
    rows = [[1, 5, 6, 7, 2], [1, 9, 2], [1, 4, 4, 4, 4, 4, 2]]  # each ends with EOS
    scorer = Scorer(reward_model=rm, functions=[("len", lambda p, r, rec: [float(len(x)) for x in r])], batch_size=2)
    results = []
    for side in ("left", "right"):
        ids, mask = pad_batch(rows, pad_id, side)
        scores, parts = scorer(ids, mask, ["p"] * 3, ["a", "bb", "ccc"], [{}] * 3)
        results.append(parts["reward_model"])
        assert torch.allclose(scores, parts["reward_model"] + torch.tensor([1.0, 2.0, 3.0]))
    alone = torch.cat([sequence_scores(rm, torch.tensor([r]), torch.ones(1, len(r))) for r in rows])
    assert torch.allclose(results[0], 0.5 * alone - 1.25, atol=1e-5)
    assert torch.allclose(results[1], 0.5 * alone - 1.25, atol=1e-5)
