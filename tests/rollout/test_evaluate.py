"""The evaluation meter: figures per prompt, KL = 0 for the policy against itself, win rate by hand."""

import pytest
import torch

from rlhfkit.data import TokenLimits, tokenize_records, validate_rows
from rlhfkit.data.readers import RawRows
from rlhfkit.rollout.evaluate import sample_and_score, win_rate
from tests.helpers import tiny_llama, tiny_tokenizer


def test_win_rate_counts_ties_half():
    assert win_rate([1.0, 0.0, 2.0, 3.0], [0.0, 0.0, 5.0, 1.0]) == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    with pytest.raises(ValueError):
        win_rate([], [])


def _examples(tok, prompts):
    raw = RawRows(source="mem", rows=[{"prompt": p} for p in prompts], locations=list(range(len(prompts))))
    return tokenize_records(validate_rows(raw, "prompts"), tok, TokenLimits())


def test_sample_and_score_measures_every_prompt_and_kl_to_itself_is_zero():
    tok = tiny_tokenizer()
    policy = tiny_llama(seed=0, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    rm = tiny_llama("scalar", seed=1, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    examples = _examples(tok, ["hello", "the cat sat on", "one"])
    torch.manual_seed(0)
    s = sample_and_score(
        policy,
        tok,
        examples,
        temperature=0.7,
        max_new_tokens=6,
        reward_model=rm,
        reference=policy,
        gold_score=lambda p, r: float(len(r.split())),
        is_valid=lambda r: True,
        batch_size=2,
    )
    assert s.prompts == ["hello", "the cat sat on", "one"]
    assert len(s.responses) == len(s.proxy) == len(s.kl) == len(s.gold) == 3
    assert s.kl == pytest.approx([0.0, 0.0, 0.0], abs=1e-5)
    assert s.gold == [float(len(r.split())) for r in s.responses]
    summary = s.summary()
    assert summary["valid_rate"] == 1.0 and summary["kl_mean"] == pytest.approx(0.0, abs=1e-5)
    assert all(1 <= n <= 6 for n in s.lengths)
