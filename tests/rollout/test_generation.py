"""Stop-token truncation by hand (including pad == EOS) and generation from left-padded prompts."""

from unittest import mock

import pytest
import torch

from rlhfkit.models import sampling_for
from rlhfkit.rollout import generate_responses, truncate_at_stop
from rlhfkit.rollout.generation import SAMPLE_BLOCK, inverse_cdf_sample
from tests.helpers import tiny_llama

EOS, PAD = 2, 0


def test_truncate_at_stop_by_hand_keeps_first_eos_in_mask():
    ids = torch.tensor(
        [
            [5, 6, EOS, 7, EOS],  # stop in the middle; later EOS is junk
            [5, EOS, 9, 9, 9],
            [5, 6, 7, 8, 9],  # truncated: no stop token
            [EOS, 6, 7, 8, 9],
        ]
    )  # immediate stop
    out, mask, ended = truncate_at_stop(ids, [EOS], PAD)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert ended.tolist() == [True, True, False, True]
    assert out.tolist() == [
        [5, 6, EOS, PAD, PAD],
        [5, EOS, PAD, PAD, PAD],
        [5, 6, 7, 8, 9],
        [EOS, PAD, PAD, PAD, PAD],
    ]


def test_truncate_when_pad_equals_eos_keeps_eos_inside_mask():
    # trl#1623 / torchtune#949: masking by "id != pad" would drop the EOS itself.
    ids = torch.tensor([[5, EOS, EOS, EOS], [5, 6, EOS, EOS]])
    out, mask, ended = truncate_at_stop(ids, [EOS], pad_token_id=EOS)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert ended.all()
    assert (out[mask] == ids[mask]).all()


def test_truncate_with_several_stop_tokens():
    ids = torch.tensor([[5, 11, 6, EOS], [5, 6, EOS, 11]])
    _, mask, _ = truncate_at_stop(ids, [EOS, 11], PAD)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]


def test_generate_from_left_padded_prompts_matches_unpadded_greedy():
    torch.manual_seed(0)
    model = tiny_llama(seed=0)
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    prompts = [[5, 6, 7, 8], [9, 10]]
    width = max(map(len, prompts))
    ids = torch.full((2, width), pad)
    am = torch.zeros((2, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        am[i, width - len(p) :] = 1
    sampling = sampling_for(pad, [eos])
    batch = generate_responses(
        model,
        ids,
        am,
        max_new_tokens=6,
        stop_token_ids=[eos],
        pad_token_id=pad,
        sampling=sampling,
        greedy=True,
    )
    assert batch.response_ids.shape == (2, 6) and batch.mask.shape == (2, 6)
    assert batch.response_start == width
    assert torch.equal(batch.input_ids[:, width:], batch.response_ids)
    # The same prompt alone (no padding) gives the same greedy continuation: padding changes nothing.
    alone = generate_responses(
        model,
        torch.tensor([prompts[1]]),
        torch.ones(1, 2, dtype=torch.long),
        max_new_tokens=6,
        stop_token_ids=[eos],
        pad_token_id=pad,
        sampling=sampling,
        greedy=True,
    )
    assert torch.equal(alone.response_ids[0][alone.mask[0]], batch.response_ids[1][batch.mask[1]])


def test_generate_pads_short_outputs_and_marks_ended():
    model = tiny_llama(seed=0)
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    # A large bias toward EOS on the logits: every row stops at its first token.
    handle = model.lm_head.register_forward_hook(
        lambda m, i, o: o + 100.0 * torch.nn.functional.one_hot(torch.tensor(eos), o.shape[-1]).to(o.dtype)
    )
    try:
        batch = generate_responses(
            model,
            torch.tensor([[5, 6]]),
            torch.ones(1, 2, dtype=torch.long),
            max_new_tokens=5,
            stop_token_ids=[eos],
            pad_token_id=pad,
            sampling=sampling_for(pad, [eos], 0.7),
        )
    finally:
        handle.remove()
    assert batch.response_ids.shape == (1, 5)
    assert batch.response_ids[0].tolist() == [eos, pad, pad, pad, pad]
    assert batch.mask[0].tolist() == [True, False, False, False, False]
    assert batch.ended.tolist() == [True]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0]


def _biased_toward(model, token: int):
    """A forward hook that makes ``token`` overwhelmingly likely at every step."""
    return model.lm_head.register_forward_hook(
        lambda m, i, o: o + 100.0 * torch.nn.functional.one_hot(torch.tensor(token), o.shape[-1]).to(o.dtype)
    )


def test_a_pad_distinct_from_the_stop_tokens_is_never_sampled():
    model = tiny_llama(seed=0)
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    assert pad != eos
    handle = _biased_toward(model, pad)
    try:
        batch = generate_responses(
            model,
            torch.tensor([[5, 6]]),
            torch.ones(1, 2, dtype=torch.long),
            max_new_tokens=5,
            stop_token_ids=[eos],
            pad_token_id=pad,
            sampling=sampling_for(pad, [eos], 0.7),
        )
        # When pad is a stop token (pad == EOS) it is not suppressed: it ends the response.
        as_stop = generate_responses(
            model,
            torch.tensor([[5, 6]]),
            torch.ones(1, 2, dtype=torch.long),
            max_new_tokens=5,
            stop_token_ids=[pad],
            pad_token_id=pad,
            sampling=sampling_for(pad, [pad], 0.7),
        )
    finally:
        handle.remove()
    assert pad not in batch.response_ids[0][batch.mask[0]].tolist()
    assert batch.mask[0].all()
    assert as_stop.response_ids[0].tolist()[0] == pad and as_stop.ended.tolist() == [True]


def _grouped_prompts(pad: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of 4, 1 and 2 tokens, each repeated ``group`` times (a grpo rollout)."""
    prompts = [[5, 6, 7, 8], [9], [11, 12]]
    ids = torch.full((3, 4), pad)
    mask = torch.zeros((3, 4), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 4 - len(p) :], mask[i, 4 - len(p) :] = torch.tensor(p), 1
    return ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_group_shares_one_forward_over_its_prompt_and_samples_the_same_tokens(greedy):
    """share_prompts computes the prompt's cache once per distinct prompt (not once per row of its group);
    the tokens (greedy, and sampled from the same generator) and log-probs are those of plain generate."""
    model = tiny_llama(seed=0)
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    ids, mask = _grouped_prompts(pad, group=3)
    from rlhfkit.models.prompt_cache import shared_prompt_cache

    rows = []
    hook = model.model.register_forward_pre_hook(
        lambda m, a, k: rows.append(tuple(k["input_ids"].shape)), with_kwargs=True
    )
    cache = shared_prompt_cache(model, ids, mask)
    hook.remove()
    assert rows == [(3, 3)]  # one row per distinct prompt, every column but the last
    assert cache.get_seq_length() == 3
    out = {}
    for share in (True, False):
        torch.manual_seed(0)
        out[share] = generate_responses(
            model,
            ids,
            mask,
            max_new_tokens=6,
            stop_token_ids=[eos],
            pad_token_id=pad,
            sampling=sampling_for(pad, [eos]),
            greedy=greedy,
            return_logprobs=True,
            share_prompts=share,
        )
    assert torch.equal(out[True].response_ids, out[False].response_ids)
    assert torch.equal(out[True].mask, out[False].mask)
    torch.testing.assert_close(out[True].sampled_logprobs, out[False].sampled_logprobs, rtol=0, atol=1e-5)
    if not greedy:  # the three rows of a group drew different responses
        assert len({tuple(r.tolist()) for r in out[True].response_ids[:3]}) > 1


def test_distinct_prompts_take_plain_generate():
    model = tiny_llama(seed=0)
    ids, mask = _grouped_prompts(model.config.pad_token_id, group=1)
    from rlhfkit.models.prompt_cache import shared_prompt_cache

    assert shared_prompt_cache(model, ids, mask) is None


@pytest.mark.parametrize("block", [SAMPLE_BLOCK, 2, 3])  # one level; two levels, with and without a tail
def test_inverse_cdf_sample_draws_each_entry_at_its_probability(block):
    """Frequencies over many draws against the probabilities (unnormalised rows; mass in the short last block),
    and entries of probability 0 (first, inside, last, whole blocks) never drawn."""
    probs = torch.tensor(
        [
            [0.0, 0.1, 0.0, 0.6, 0.3, 0.0, 0.0],
            [2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0],  # unnormalised: halves; the second in the last block
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
        ]
    )
    n = 20000
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([inverse_cdf_sample(probs, generator, block) for _ in range(n)], dim=1)  # (3, n)
    counts = torch.stack([torch.bincount(row, minlength=7) for row in draws]).float() / n
    expected = probs / probs.sum(-1, keepdim=True)
    assert torch.equal(counts[expected == 0], torch.zeros_like(counts[expected == 0]))
    # 5 standard errors of a frequency at n = 20,000 is at most 0.018
    torch.testing.assert_close(counts, expected, rtol=0, atol=0.018)


@pytest.mark.parametrize(
    "probs, block, expected",
    [
        ([0.5, 0.0, 0.5], SAMPLE_BLOCK, 2),  # one level: u = 0.5 is the boundary of the empty interval
        ([0.5, 0.0, 0.0, 0.0, 0.0, 0.5], 2, 5),  # two levels: the middle block's sum is 0
    ],
)
def test_inverse_cdf_sample_never_draws_a_zero_at_a_boundary(probs, block, expected):
    """A uniform number exactly on a cumulative boundary goes to the next entry (block) with mass, not to an
    empty interval (a search that is not strictly above the number would draw a zero-probability entry)."""
    probs = torch.tensor([probs])
    with mock.patch("torch.rand", lambda *a, **k: torch.full((1, 1), 0.5, dtype=torch.float64)):
        assert inverse_cdf_sample(probs, block=block).tolist() == [expected]
    with mock.patch("torch.rand", lambda *a, **k: torch.zeros((1, 1), dtype=torch.float64)):
        assert inverse_cdf_sample(probs, block=block).tolist() == [0]


def test_two_level_draws_a_large_vocabulary_as_one_level_does():
    """At a real vocabulary size (49,152 entries, 48 blocks) the two-level draw's frequencies over a few
    entries spread across blocks, the tail block included, are the probabilities."""
    probs = torch.zeros(1, 49_152 + 100)
    probs[0, [3, 1500, 30_000, 49_200]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    generator = torch.Generator().manual_seed(1)
    draws = torch.cat([inverse_cdf_sample(probs.expand(500, -1), generator) for _ in range(40)])
    assert set(draws.tolist()) == {3, 1500, 30_000, 49_200}
    freq = torch.tensor([(draws == i).float().mean().item() for i in (3, 1500, 30_000, 49_200)])
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.2, 0.3, 0.4]), rtol=0, atol=0.02)


def test_sampled_tokens_and_logprobs_follow_the_scored_distribution():
    """The sampler's log-probs are those the trainer recomputes (sampled_logprobs on the model's logits under
    the same Sampling, top-k and top-p included), and every drawn token is inside the truncated set."""
    from rlhfkit.models import response_logits, sampled_logprobs

    model = tiny_llama(seed=0)
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    ids, mask = _grouped_prompts(pad, group=4)
    for sampling in (sampling_for(pad, [eos], 0.7), sampling_for(pad, [eos], 1.3, top_k=5, top_p=0.8)):
        torch.manual_seed(1)
        out = generate_responses(
            model,
            ids,
            mask,
            max_new_tokens=6,
            stop_token_ids=[eos],
            pad_token_id=pad,
            sampling=sampling,
            return_logprobs=True,
        )
        with torch.no_grad():
            logits = response_logits(model, out.input_ids, out.attention_mask, out.response_start)
            scored = sampled_logprobs(logits, out.response_ids, sampling)
        torch.testing.assert_close(
            torch.where(out.mask, out.sampled_logprobs, 0.0),
            torch.where(out.mask, scored, 0.0),
            rtol=0,
            atol=1e-5,
        )
        assert bool(torch.isfinite(out.sampled_logprobs).all())
