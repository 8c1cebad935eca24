"""The decoding cache that writes into reserved storage (rlhfkit.models.decode_cache) and the in-place
suppression of ids (rlhfkit.models.sampling): the same tokens and log-probs as transformers' own cache and
``suppress_tokens``, bit for bit, with no per-step copy of the cache."""

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList

import rlhfkit.rollout.generation as generation
from rlhfkit.models import decode_attention, sampling_for
from rlhfkit.models.decode_cache import fresh_cache, reserve_positions
from rlhfkit.models.precision import autocast_forward, float32_attention_on_cpu
from rlhfkit.models.sampling import Sampling, _suppress_in_place, generation_kwargs
from rlhfkit.rollout import generate_responses
from tests.helpers import tiny_gpt2, tiny_llama

B, H, D = 2, 3, 4


def _step(seed: int, length: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(B, H, length, D, generator=g) for _ in range(2))
    return keys.to(dtype), values.to(dtype)


def _both(capacity: int):
    """A plain one-layer DynamicCache and the same with its layer reserved for ``capacity`` positions."""
    plain, reserved = DynamicCache(), DynamicCache()
    for cache in (plain, reserved):
        cache.update(*_step(0, 3), layer_idx=0)  # the prompt's columns
    assert reserve_positions(reserved, capacity) == 1
    return plain, reserved


def _assert_equal(a, b):
    assert a[0].shape == b[0].shape and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_each_update_returns_the_concatenation_without_moving_the_storage():
    plain, reserved = _both(capacity=8)
    ptr = None
    for step in range(1, 6):  # 3 prompt columns + 5 decoded: the reservation (8) is never exceeded
        new = _step(step, 1)
        got = reserved.update(*new, layer_idx=0)
        _assert_equal(got, plain.update(*new, layer_idx=0))
        ptr = ptr or got[0].data_ptr()
        assert got[0].data_ptr() == ptr  # a view of one storage: nothing was copied to add a column
    assert reserved.get_seq_length() == plain.get_seq_length() == 8


def test_a_layer_that_outgrows_its_reservation_grows_and_stays_equal():
    plain, reserved = _both(capacity=4)
    for step in range(1, 5):
        new = _step(step, 1 + step % 2)  # columns of 1 and 2
        _assert_equal(reserved.update(*new, layer_idx=0), plain.update(*new, layer_idx=0))


@pytest.mark.parametrize("edit", ["crop", "batch_select_indices", "reorder_cache"])
def test_tensors_replaced_from_outside_are_taken_as_they_are(edit):
    """``crop``, ``batch_select_indices`` and beam reordering assign new tensors to the layer: the next update
    builds on those, not on the stale reserved storage."""
    plain, reserved = _both(capacity=16)
    for step in (1, 2):
        new = _step(step, 1)
        plain.update(*new, layer_idx=0), reserved.update(*new, layer_idx=0)
    for cache in (plain, reserved):
        if edit == "crop":
            cache.crop(-2)  # drop the two decoded columns
        elif edit == "batch_select_indices":
            cache.batch_select_indices(torch.tensor([1]))
        else:
            cache.reorder_cache(torch.tensor([1, 0]))
    rows = 1 if edit == "batch_select_indices" else B
    new = tuple(t[:rows] for t in _step(9, 1))
    _assert_equal(reserved.update(*new, layer_idx=0), plain.update(*new, layer_idx=0))


def test_an_upcast_layer_stores_half_precision_columns_in_float32_exactly():
    """``upcast``: bf16 columns are written into float32 storage (the prompt's too); the values are the bf16
    values, converted exactly; float32 columns are stored as they come."""
    for dtype, stored in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32)):
        plain, reserved = DynamicCache(), DynamicCache()
        for cache in (plain, reserved):
            cache.update(*_step(0, 3, dtype), layer_idx=0)
        assert reserve_positions(reserved, 8, upcast=True) == 1
        for step in range(1, 4):
            new = _step(step, 1, dtype)
            got, want = reserved.update(*new, layer_idx=0), plain.update(*new, layer_idx=0)
            assert got[0].dtype == got[1].dtype == stored and want[0].dtype == dtype
            assert torch.equal(got[0], want[0].float()) and torch.equal(got[1], want[1].float())


def test_another_dtype_falls_back_to_the_plain_update():
    plain, reserved = _both(capacity=16)
    new = _step(1, 1, torch.bfloat16)
    got, want = reserved.update(*new, layer_idx=0), plain.update(*new, layer_idx=0)
    assert got[0].dtype == want[0].dtype
    _assert_equal(got, want)


def test_only_plain_dynamic_layers_are_reserved():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache()
    cache.layers.append(DynamicSlidingWindowLayer(sliding_window=4))
    assert reserve_positions(cache, 10) == 0
    assert type(cache.layers[0]) is DynamicSlidingWindowLayer
    assert reserve_positions(object(), 10) == 0  # not a cache with layers: left alone


def _prompts(model):
    pad = model.config.pad_token_id
    ids = torch.tensor([[pad, pad, 5, 6], [7, 8, 9, 10]]).repeat_interleave(3, 0)
    return ids, (ids != pad).long()


def _generate(model, share: bool, reserve: bool, monkeypatch, greedy=False, seed=0):
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    counts, caches = [], []

    def spy(cache, capacity, upcast=False):
        counts.append(reserve_positions(cache, capacity, upcast) if reserve else 0)
        caches.append((cache, upcast))
        return counts[-1]

    monkeypatch.setattr(generation, "reserve_positions", spy)
    ids, mask = _prompts(model)
    torch.manual_seed(seed)
    out = generate_responses(
        model,
        ids,
        mask,
        max_new_tokens=12,
        stop_token_ids=[eos],
        pad_token_id=pad,
        sampling=Sampling(temperature=0.8, top_k=20, suppress_ids=(pad,)),
        greedy=greedy,
        return_logprobs=True,
        share_prompts=share,
    )
    return out, counts, caches


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("share", [False, True])
def test_generation_with_the_reserved_cache_is_the_plain_one_bit_for_bit(precision, share, monkeypatch):
    model = tiny_llama(seed=1, vocab_size=64)
    if precision == "bf16":
        model = float32_attention_on_cpu(autocast_forward(model, torch.bfloat16))
    plain, none, _ = _generate(model, share, reserve=False, monkeypatch=monkeypatch)
    fast, counts, caches = _generate(model, share, reserve=True, monkeypatch=monkeypatch)
    assert none == [0] and counts == [model.config.num_hidden_layers]  # every layer was reserved
    # a bf16 model whose attention runs in float32 keeps a float32 cache (its columns upcast once, as written)
    # unless its decoding steps read a bf16 one in float32 (rlhfkit.models.decode_attention)
    ((cache, upcast),) = caches
    assert upcast == (precision == "bf16" and not decode_attention.available())
    values = torch.bfloat16 if precision == "bf16" and not upcast else torch.float32  # the keys: after rotary
    assert {(layer.keys.dtype, layer.values.dtype) for layer in cache.layers} == {(torch.float32, values)}
    assert torch.equal(fast.response_ids, plain.response_ids)
    assert torch.equal(fast.mask, plain.mask)
    assert torch.equal(fast.sampled_logprobs, plain.sampled_logprobs)
    assert fast.mask.sum(1).gt(4).any()  # responses long enough to decode through the cache


def test_a_model_without_the_default_cache_makes_its_own(monkeypatch):
    """GPT-2 supports the default dynamic cache too; a model whose ``generate`` needs another cache gets None
    from :func:`fresh_cache` and builds its own."""
    model = tiny_gpt2()
    assert isinstance(fresh_cache(model), DynamicCache)
    model._supports_default_dynamic_cache = lambda: False
    assert fresh_cache(model) is None
    out, counts, _ = _generate(model, share=False, reserve=True, monkeypatch=monkeypatch)
    assert counts == [] and out.response_ids.shape[0] == 6


def _hf_generate(model, processors, suppress, greedy, seed=0):
    ids, mask = _prompts(model)
    kwargs = generation_kwargs(Sampling(temperature=0.7, top_k=6, top_p=0.9), greedy=greedy)
    if processors:
        kwargs["logits_processor"] = LogitsProcessorList([_suppress_in_place(suppress)])
    else:
        kwargs["suppress_tokens"] = list(suppress)
    torch.manual_seed(seed)
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=8,
        pad_token_id=model.config.pad_token_id,
        eos_token_id=[model.config.eos_token_id],
        output_scores=True,
        return_dict_in_generate=True,
        **kwargs,
    )


@pytest.mark.parametrize("greedy", [False, True])
def test_in_place_suppression_gives_transformers_suppress_tokens_scores_and_tokens(greedy):
    model = tiny_llama(seed=2, vocab_size=64)
    ids, mask = _prompts(model)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask).logits[:, -1]
    # the ids the model likes best at the first step: left in, they would be drawn
    suppress = sorted(set(first.topk(2, dim=-1).indices.flatten().tolist()))
    ours = _hf_generate(model, True, suppress, greedy)
    theirs = _hf_generate(model, False, suppress, greedy)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.scores, theirs.scores, strict=True):
        assert torch.equal(a, b)  # after temperature, top-k and top-p: suppression ran first in both
    new = ours.sequences[:, ids.shape[1] :]
    assert not torch.isin(new, torch.tensor(suppress)).any()


def test_the_sampling_kwargs_suppress_through_the_in_place_processor():
    pad, eos = 0, 2
    kwargs = generation_kwargs(sampling_for(pad, [eos]))
    assert "suppress_tokens" not in kwargs
    (processor,) = kwargs["logits_processor"]
    scores = torch.zeros(2, 5)
    assert processor(None, scores) is scores  # in place: no new (B, V) tensor
    assert scores[:, pad].eq(float("-inf")).all() and scores[:, 1:].eq(0).all()
