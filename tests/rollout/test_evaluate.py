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


def _plain_exact_kl(policy, reference, tok, example, response, temperature):
    """KL(pi || pi_ref) of one response, summed over its tokens: each model run on the unpadded prompt and
    response, the pad token suppressed and the logits divided by the temperature as the read samples, then
    sum_v p (log p - log q) in float64, position by position."""
    ids = torch.tensor([list(example["prompt_ids"]) + response])
    start = len(example["prompt_ids"])
    dists = []
    for model in (policy, reference):
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()  # (L, V)
        logits[:, tok.pad_token_id] = float("-inf")
        dists.append(torch.log_softmax(logits / temperature, -1))
    total = 0.0
    for t in range(len(response)):
        logp, logq = dists[0][start + t - 1], dists[1][start + t - 1]  # the state before y_t
        total += sum(float(a.exp() * (a - b)) for a, b in zip(logp, logq, strict=True) if a > float("-inf"))
    return total


def test_the_exact_kl_sums_the_full_vocabulary_kl_per_response_and_leaves_every_other_figure_alone():
    tok = tiny_tokenizer()
    policy = tiny_llama(seed=0, vocab_size=len(tok), pad_token_id=tok.pad_token_id).eval()
    reference = tiny_llama(seed=3, vocab_size=len(tok), pad_token_id=tok.pad_token_id).eval()
    examples = _examples(tok, ["hello", "the cat sat on the mat and", "one", "two words"])

    def read(exact):
        torch.manual_seed(0)
        return sample_and_score(
            policy, tok, examples, temperature=0.7, max_new_tokens=6, reference=reference,
            gold_score=lambda p, r: float(len(r)), batch_size=3, exact_kl=exact,
        )  # fmt: skip

    plain, exact = read(False), read(True)
    assert plain.kl_exact == [] and "kl_exact_mean" not in plain.summary()
    # the same samples and figures: computing the exact KL draws nothing from the sampler's stream
    for name in ("responses", "response_ids", "lengths", "gold", "kl"):
        assert getattr(exact, name) == getattr(plain, name)
    assert len({len(ids) for ids in exact.response_ids}) > 1  # rows of several lengths: padding is skipped
    expected = [
        _plain_exact_kl(policy, reference, tok, ex, ids, 0.7)
        for ex, ids in zip(examples, exact.response_ids, strict=True)
    ]
    assert exact.kl_exact == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert min(expected) > 0
    assert exact.summary()["kl_exact_mean"] == pytest.approx(sum(expected) / len(expected), rel=1e-4)
    # against itself the exact KL is 0
    torch.manual_seed(0)
    same = sample_and_score(policy, tok, examples, temperature=0.7, max_new_tokens=6, reference=policy,
                            exact_kl=True)  # fmt: skip
    assert same.kl_exact == pytest.approx([0.0] * 4, abs=1e-6)
