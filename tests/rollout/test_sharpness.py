"""Sharpness figures: entropy, top-token mass and top-1 agreement by hand; junk at masked positions changes
nothing; measure_policy against a plain per-token loop, KL 0 to itself, greedy has no KL."""

import math
import statistics

import pytest
import torch

from rlhfkit.data import TokenLimits, tokenize_records, validate_rows
from rlhfkit.data.readers import RawRows
from rlhfkit.models import response_logits, sampling_for
from rlhfkit.rollout.generation import generate_responses
from rlhfkit.rollout.sharpness import measure_policy, sharpness_sums
from tests.helpers import tiny_llama, tiny_tokenizer

NEG = float("-inf")


def _logits():
    # Position 0: p = (1/4, 1/2, 1/4), argmax 1; position 1: p = (1/4, 3/4, 0), argmax 1; position 2 masked.
    policy = torch.tensor([[[0.0, math.log(2.0), 0.0], [0.0, math.log(3.0), NEG], [1.0, 2.0, 3.0]]])
    ref = torch.tensor([[[5.0, 0.0, 0.0], [0.0, 1.0, 0.0], [3.0, 2.0, 1.0]]])
    mask = torch.tensor([[True, True, False]])
    return policy, ref, mask


def test_sharpness_sums_by_hand():
    policy, ref, mask = _logits()
    s = sharpness_sums(policy, mask, ref)
    h0 = -(0.25 * math.log(0.25) * 2 + 0.5 * math.log(0.5))
    h1 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert s["tokens"] == 2.0
    assert s["entropy"] == pytest.approx(h0 + h1, abs=1e-6)
    assert s["top_mass"] == pytest.approx(0.5 + 0.75, abs=1e-6)
    q0 = torch.softmax(torch.tensor([5.0, 0.0, 0.0]), 0)
    q1 = torch.softmax(torch.tensor([0.0, 1.0, 0.0]), 0)
    assert s["ref_entropy"] == pytest.approx(float(-(q0 * q0.log()).sum() - (q1 * q1.log()).sum()), abs=1e-6)
    assert s["ref_top_mass"] == pytest.approx(float(q0.max() + q1.max()), abs=1e-6)
    assert s["top_agree"] == 1.0  # position 0: 1 vs 0; position 1: 1 vs 1
    assert set(sharpness_sums(policy, mask)) == {"tokens", "entropy", "top_mass"}


def test_junk_at_masked_positions_changes_nothing():
    policy, ref, mask = _logits()
    clean = sharpness_sums(policy, mask, ref)
    policy[0, 2] = torch.tensor([float("nan"), float("inf"), NEG])
    ref[0, 2] = torch.tensor([NEG, NEG, NEG])
    assert sharpness_sums(policy, mask, ref) == clean
    with pytest.raises(ValueError, match="shapes differ"):
        sharpness_sums(policy, mask[:, :2], ref)


def _examples(tok, prompts):
    raw = RawRows(source="mem", rows=[{"prompt": p} for p in prompts], locations=list(range(len(prompts))))
    return tokenize_records(validate_rows(raw, "prompts"), tok, TokenLimits())


def _models():
    tok = tiny_tokenizer()
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    return (
        tok,
        tiny_llama(seed=0, **ids).eval(),
        tiny_llama(seed=3, **ids).eval(),
        tiny_llama("scalar", seed=1, **ids),
    )


@torch.no_grad()
def test_measure_policy_matches_a_plain_loop_on_greedy_responses():
    tok, policy, reference, rm = _models()
    examples = _examples(tok, ["hello", "hello", "the cat sat on"])
    m = measure_policy(
        policy, tok, examples, temperature=0.0, max_new_tokens=5, reference=reference, reward_model=rm,
        gold_score=lambda p, r: float(len(r)), is_valid=lambda r: r.startswith(" "), batch_size=2,
    )  # fmt: skip
    assert m["kl"] is None and m["distinct_rate"] == pytest.approx(2 / 3)  # the same prompt twice, greedy
    # The same greedy responses, one prompt at a time, every response token by hand.
    sampling = sampling_for(tok.pad_token_id, [tok.eos_token_id], 1.0)
    ent, top, agree, tokens = 0.0, 0.0, 0.0, 0
    for ex in examples:
        ids = torch.tensor([ex["prompt_ids"]])
        r = generate_responses(
            policy, ids, torch.ones_like(ids), max_new_tokens=5, stop_token_ids=[tok.eos_token_id],
            pad_token_id=tok.pad_token_id, sampling=sampling, greedy=True,
        )  # fmt: skip
        for model_logits, ref_logits, keep in zip(
            response_logits(policy, r.input_ids, r.attention_mask, r.response_start)[0],
            response_logits(reference, r.input_ids, r.attention_mask, r.response_start)[0],
            r.mask[0],
            strict=True,
        ):
            if not keep:
                continue
            model_logits = model_logits.clone()
            model_logits[tok.pad_token_id] = NEG
            ref_logits = ref_logits.clone()
            ref_logits[tok.pad_token_id] = NEG
            dist = torch.distributions.Categorical(logits=model_logits)
            ent += float(dist.entropy())
            top += float(dist.probs.max())
            agree += float(model_logits.argmax() == ref_logits.argmax())
            tokens += 1
    assert m["entropy"] == pytest.approx(ent / tokens, abs=1e-5)
    assert m["top_mass"] == pytest.approx(top / tokens, abs=1e-5)
    assert m["top_agree"] == pytest.approx(agree / tokens, abs=1e-6)
    assert m["length"] == pytest.approx(tokens / 3)
    assert set(m) >= {"gold", "gold_std", "proxy", "valid_rate", "ended_rate"}


def test_measure_policy_against_itself_has_zero_kl_and_full_agreement():
    tok, policy, _, _ = _models()
    torch.manual_seed(0)
    m = measure_policy(
        policy, tok, _examples(tok, ["hello", "one", "the cat"]), temperature=0.7, max_new_tokens=6,
        reference=policy,
    )  # fmt: skip
    assert m["kl"] == pytest.approx(0.0, abs=1e-5) and m["top_agree"] == 1.0
    assert m["entropy"] == pytest.approx(m["ref_entropy"]) and m["top_mass"] == pytest.approx(
        m["ref_top_mass"]
    )
    assert "gold" not in m and "proxy" not in m and "valid_rate" not in m
    with pytest.raises(ValueError, match=">= 0"):
        measure_policy(policy, tok, [], temperature=-1.0, max_new_tokens=2, reference=policy)


@torch.no_grad()
def test_kl_is_k1_summed_over_each_response_at_the_sampling_temperature():
    from rlhfkit.data import PromptCollator
    from rlhfkit.models import response_logprobs

    tok, policy, reference, _ = _models()
    examples = _examples(tok, ["hello", "one", "the cat sat on"])
    torch.manual_seed(5)
    m = measure_policy(policy, tok, examples, temperature=0.7, max_new_tokens=6, reference=reference)
    torch.manual_seed(5)  # the same samples again, then the KL token by token
    batch = PromptCollator(tok.pad_token_id)(examples)
    sampling = sampling_for(tok.pad_token_id, [tok.eos_token_id], 0.7)
    r = generate_responses(
        policy, batch["input_ids"], batch["attention_mask"], max_new_tokens=6, stop_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id, sampling=sampling,
    )  # fmt: skip
    lp = response_logprobs(policy, r.input_ids, r.attention_mask, r.response_start, sampling)
    ref = response_logprobs(reference, r.input_ids, r.attention_mask, r.response_start, sampling)
    per_response = [
        sum(float(lp[b, t] - ref[b, t]) for t in range(lp.shape[1]) if r.mask[b, t]) for b in range(3)
    ]
    assert m["kl"] == pytest.approx(sum(per_response) / 3, abs=1e-5)
    assert m["kl"] != pytest.approx(0.0, abs=1e-3)


@torch.no_grad()
def test_several_samples_per_prompt_are_the_prompts_repeated_and_their_error_takes_the_prompt_as_the_unit():
    from rlhfkit.rollout.evaluate import prompt_standard_error

    tok, policy, reference, rm = _models()
    prompts = ["hello", "one", "the cat sat on"]
    scorers = dict(reference=reference, reward_model=rm, gold_score=lambda p, r: float(len(p)))  # per prompt
    torch.manual_seed(11)
    m = measure_policy(
        policy, tok, _examples(tok, prompts), temperature=0.9, max_new_tokens=6, samples_per_prompt=3,
        batch_size=4, **scorers,
    )  # fmt: skip
    # The same stream with each prompt written out three times side by side: the same figures.
    torch.manual_seed(11)
    repeated = measure_policy(
        policy, tok, _examples(tok, [p for p in prompts for _ in range(3)]), temperature=0.9,
        max_new_tokens=6, batch_size=4, **scorers,
    )  # fmt: skip
    for key in ("gold", "proxy", "kl", "length", "entropy", "distinct_rate"):
        assert m[key] == pytest.approx(repeated[key], abs=1e-6), key
    # Gold is 5, 3 or 14 by prompt: read as 3 prompts of 3 samples, the error is that of 3 means, not of 9
    # independent values.
    assert m["gold_se"] == pytest.approx(statistics.stdev([5.0, 3.0, 14.0]) / 3**0.5)
    assert repeated["gold_se"] == pytest.approx(statistics.stdev([5.0] * 3 + [3.0] * 3 + [14.0] * 3) / 3)
    assert prompt_standard_error([1.0, 3.0, 5.0, 5.0], 2) == pytest.approx(1.5)  # means 2 and 5: sd 2.12 / √2
    with pytest.raises(ValueError, match="samples_per_prompt"):
        measure_policy(
            policy, tok, [], temperature=0.7, max_new_tokens=2, reference=policy, samples_per_prompt=0
        )
