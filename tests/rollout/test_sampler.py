"""online.sampler in generate_responses (rlhfkit.models.sampler): ``multinomial`` is generate's own draw bit for
bit; ``exact`` gives a row the same tokens in one call or in four (any batch, any order), draws only tokens the
processing keeps and returns their processed log-probs, and takes each draw's position from the row itself (a
later turn of the same row draws anew)."""

from __future__ import annotations

import pytest
import torch

import rlhfkit.models.sampler as sampler_module
from rlhfkit.models import processed_logits, sampling_for
from rlhfkit.models.sampler import RowStreams, sampler_of, set_sampler
from rlhfkit.models.sampling import generation_kwargs, without_checkpoint_defaults
from rlhfkit.rollout import generate_responses, truncate_at_stop
from tests.helpers import tiny_llama

R = 12


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0).eval()


def prompts(model, rows=8, columns=7, seed=1):
    """``rows`` distinct left-padded prompts (odd rows padded by 3 columns)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, model.config.vocab_size, (rows, columns), generator=g)
    mask = torch.ones_like(ids)
    mask[1::2, :3] = 0
    ids[1::2, :3] = model.config.pad_token_id
    return ids, mask


def settings(model, **processing):
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    return dict(
        max_new_tokens=R,
        stop_token_ids=[eos],
        pad_token_id=pad,
        sampling=sampling_for(pad, [eos], **processing),
    )


def test_multinomial_is_generates_own_draw_bit_for_bit(model):
    """``sampler=multinomial``: the tokens of plain ``generate(do_sample=True)`` with the same processing
    under the same seed (the draw of earlier rlhfkit versions), and torch's generator left where it leaves it."""
    ids, mask = prompts(model)
    kwargs = settings(model, temperature=0.9, top_k=20)
    torch.manual_seed(3)
    ours = generate_responses(model, ids, mask, sampler="multinomial", share_prompts=False, **kwargs)
    after_ours = torch.rand(3)
    torch.manual_seed(3)
    with without_checkpoint_defaults(model):
        plain = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=R,
            pad_token_id=kwargs["pad_token_id"],
            eos_token_id=kwargs["stop_token_ids"],
            **generation_kwargs(kwargs["sampling"]),
        )
    after_plain = torch.rand(3)
    generated = plain[:, ids.shape[1] :]
    generated = torch.cat([generated, generated.new_full((8, R - generated.shape[1]), 0)], 1)
    response_ids, _, _ = truncate_at_stop(generated, kwargs["stop_token_ids"], kwargs["pad_token_id"])
    assert torch.equal(ours.response_ids, response_ids)
    assert torch.equal(after_ours, after_plain)


def streams_of(rows, seed=5):
    index = torch.as_tensor(rows)
    return RowStreams(seed, index, index % 3)


@pytest.mark.parametrize("processing", [{}, {"temperature": 0.7, "top_k": 30, "top_p": 0.9}])
def test_exact_gives_a_row_the_same_tokens_in_one_call_or_in_four(model, processing):
    """The rows of one call, split into four calls of other sizes, in another order, each with other rows:
    every row's tokens are the same (its stream is its own); another seed gives other tokens."""
    ids, mask = prompts(model)
    kwargs = settings(model, **processing)
    whole = generate_responses(model, ids, mask, streams=streams_of(range(8)), **kwargs)
    assert whole.mask.sum() > 8 * 3  # responses long enough to compare
    pieces = [[5], [7, 0, 2], [3, 6], [1, 4]]
    for rows in pieces:
        part = generate_responses(model, ids[rows], mask[rows], streams=streams_of(rows), **kwargs)
        assert torch.equal(part.response_ids, whole.response_ids[rows]), rows
    other = generate_responses(model, ids, mask, streams=streams_of(range(8), seed=6), **kwargs)
    assert not torch.equal(other.response_ids, whole.response_ids)


def test_exact_draws_only_kept_tokens_with_their_processed_logprobs(model):
    """Under top-k, top-p, a temperature and a suppressed id, every drawn token is one the scorer's processing
    (processed_logits) keeps, and the returned log-probs are the processed ones of the drawn tokens."""
    ids, mask = prompts(model)
    suppressed = 7
    kwargs = settings(model, temperature=0.8, top_k=12, top_p=0.8, suppress_ids=[suppressed])
    out = generate_responses(model, ids, mask, streams=streams_of(range(8)), return_logprobs=True, **kwargs)
    logits = model(input_ids=out.input_ids, attention_mask=out.attention_mask).logits.float()
    start = out.response_start
    step_logits = logits[:, start - 1 : -1]  # (B, R, V): the state before each response token
    processed = processed_logits(step_logits, kwargs["sampling"], out.response_ids)  # (B, R, V)
    kept = processed.gather(-1, out.response_ids[..., None]).squeeze(-1)  # (B, R)
    # without the label kept in the set: the drawn token must be inside the truncation set on its own
    alone = processed_logits(step_logits, kwargs["sampling"])
    inside = alone.gather(-1, out.response_ids[..., None]).squeeze(-1) > float("-inf")
    assert bool(inside[out.mask].all())
    assert not bool((out.response_ids[out.mask] == suppressed).any())
    expected = torch.log_softmax(processed, -1).gather(-1, out.response_ids[..., None]).squeeze(-1)
    assert torch.isfinite(kept[out.mask]).all()
    assert (out.sampled_logprobs - torch.where(out.mask, expected, 0.0)).abs().max() < 1e-4


def test_a_draws_position_is_the_tokens_place_in_its_whole_row(model, monkeypatch):
    """The first draw of a row has position = its prompt's real tokens (left padding not counted), the next
    one more; a second turn (the prompt grown by the first response) draws at new positions, not again at 0."""
    seen = []
    real = sampler_module.stream_uniforms

    def spy(seed, prompt_index, sample_index, position):
        seen.append(position.clone())
        return real(seed, prompt_index, sample_index, position)

    monkeypatch.setattr(sampler_module, "stream_uniforms", spy)
    ids, mask = prompts(model, rows=2)
    out = generate_responses(model, ids, mask, streams=streams_of([0, 1]), **settings(model))
    assert seen[0].tolist() == [7, 4] and seen[1].tolist() == [8, 5]
    seen.clear()
    first = out.response_ids[:1, :3]
    generate_responses(
        model,
        torch.cat([ids[:1], first], 1),
        torch.cat([mask[:1], torch.ones_like(first)], 1),
        streams=streams_of([0]),
        **settings(model),
    )
    assert seen[0].tolist() == [10]


def test_the_models_sampler_is_used_and_carried_through_wrappers(model):
    """``set_sampler`` (online.sampler) decides the draw of a call made without ``sampler``: exact leaves
    torch's generator as a greedy call does once its seed is drawn; multinomial draws from it."""
    ids, mask = prompts(model)
    assert sampler_of(model) == "exact"
    kwargs = settings(model)
    try:
        set_sampler(model, "multinomial")
        torch.manual_seed(0)
        multinomial = generate_responses(model, ids, mask, **kwargs)
        torch.manual_seed(0)
        again = generate_responses(model, ids, mask, sampler="multinomial", **kwargs)
        assert torch.equal(multinomial.response_ids, again.response_ids)
        with pytest.raises(ValueError, match="sampler must be one of"):
            set_sampler(model, "fast")
    finally:
        set_sampler(model, "exact")
    streams = streams_of(range(8))
    exact = generate_responses(model, ids, mask, streams=streams, **kwargs)
    assert torch.equal(
        exact.response_ids, generate_responses(model, ids, mask, streams=streams, **kwargs).response_ids
    )
    with pytest.raises(ValueError, match="sampler must be one of"):
        generate_responses(model, ids, mask, sampler="fast", **kwargs)
