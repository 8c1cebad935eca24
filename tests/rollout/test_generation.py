"""Stop-token truncation by hand (including pad == EOS) and generation from left-padded prompts."""

import pytest
import torch

from rlhfkit.models import sampling_for
from rlhfkit.rollout import generate_responses, truncate_at_stop
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
