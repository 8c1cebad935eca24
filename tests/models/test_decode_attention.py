"""One decoding step's attention over a bf16 cache in float32 (rlhfkit.models.decode_attention): equal to torch's
``sdpa`` on the upcast tensors to float32 rounding (GQA, padding masks, views of a larger cache, lengths across
the kernel's vector width), masked positions never read, refused where it does not apply, and a bf16 model's
sampling through it equal to the float32-cache path it replaces; without a compiler, the old path."""

import logging

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.models import decode_attention as decode
from rlhfkit.models.precision import autocast_forward, float32_attention_on_cpu
from tests.helpers import tiny_llama
from tests.models.test_decode_cache import _generate

pytestmark = pytest.mark.skipif(not decode.available(), reason="no C++ compiler for the CPU decode attention")


def _inputs(b, hq, hk, d, length, capacity, seed=0, pad=0, dtypes=(torch.float32, torch.bfloat16)):
    """A query, key / value views of a ``capacity``-long cache in ``dtypes`` (by default as a bf16 model's
    cache holds them: float32 keys, bf16 values), and a left-padding mask (``pad`` columns masked in rows 0 and
    2)."""
    g = torch.Generator().manual_seed(seed)
    store = torch.randn(2, b, hk, capacity, d, generator=g).mul(3)
    key = store[0].to(dtypes[0])[:, :, :length]
    value = store[1].to(dtypes[1])[:, :, :length]
    query = torch.randn(b, hq, 1, d, generator=g).bfloat16()
    mask = torch.ones(b, 1, 1, length, dtype=torch.bool)
    mask[0::2, ..., :pad] = False
    return query, key, value, mask


def _reference(query, key, value, mask, scale):
    return F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, scale=scale, enable_gqa=True
    )


@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)],
)
@pytest.mark.parametrize(
    "b, hq, hk, d, length, pad",
    [
        (3, 6, 2, 16, 2, 0),  # the first decoding step after a one-token prompt
        (3, 6, 2, 16, 17, 5),  # one past the 16-wide vectors
        (2, 9, 3, 64, 70, 33),  # SmolLM2's heads
        (4, 4, 4, 32, 129, 1),  # no GQA
        (1, 8, 1, 48, 31, 0),  # one key / value head for all
    ],
)
def test_one_step_equals_sdpa_in_float32(b, hq, hk, d, length, pad, dtypes):
    query, key, value, mask = _inputs(b, hq, hk, d, length, capacity=length + 9, pad=pad, dtypes=dtypes)
    scale = d**-0.5
    want = _reference(query, key, value, mask, scale)
    for m in (mask, None, mask[:1]):  # a row mask, none, one mask broadcast over the rows
        got = decode.decode_attention(query, key, value, m, scale)
        ref = want if m is mask else _reference(query, key, value, m, scale)
        assert got.dtype == torch.float32 and got.shape == (b, hq, 1, d)
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6)


def test_masked_positions_are_never_read():
    """Junk where the mask is False (huge values, inf, NaN) changes nothing: the kernel does not read it."""
    query, key, value, mask = _inputs(3, 6, 2, 16, 40, capacity=48, pad=11)
    clean = decode.decode_attention(query, key, value, mask, 0.25)
    for junk in (1e30, float("inf"), float("nan")):
        k, v = key.clone(), value.clone()
        k[0::2, :, :11], v[0::2, :, :11] = junk, junk
        assert torch.equal(decode.decode_attention(query, k, v, mask, 0.25), clean)


def test_a_large_score_range_stays_exact():
    """Scores far apart (one position dominating, others underflowing) give sdpa's softmax: no NaN, no 0/0."""
    query, key, value, mask = _inputs(2, 4, 2, 16, 30, capacity=30)
    key = key.clone()
    key[:, :, 7] = 40.0  # a score ~ 40 * |q| * 4 above the rest
    got = decode.decode_attention(query, key, value, mask, 1.0)
    torch.testing.assert_close(got, _reference(query, key, value, mask, 1.0), rtol=2e-5, atol=2e-6)


def test_calls_it_does_not_compute_are_refused():
    query, key, value, mask = _inputs(2, 6, 2, 16, 9, capacity=9)
    assert decode.applies(query, key, value, mask, {"dropout": 0.0, "scaling": 0.25})
    refused = {
        "two query positions": (query.expand(2, 6, 2, 16), key, value, mask, {}),
        "a whole one-token sequence": (query, key[:, :, :1], value[:, :, :1], mask[..., :1], {}),
        "half keys": (query, key.half(), value, mask, {}),
        "double values": (query, key, value.double(), mask, {}),
        "an additive mask": (query, key, value, torch.zeros(2, 1, 1, 9), {}),
        "a mask per head": (query, key, value, mask.expand(2, 6, 1, 9), {}),
        "dropout": (query, key, value, mask, {"dropout": 0.1}),
        "softcap": (query, key, value, mask, {"softcap": 30.0}),
        "sinks": (query, key, value, mask, {"s_aux": torch.zeros(6)}),
        "a strided head": (query, key.transpose(-1, -2).contiguous().transpose(-1, -2), value, mask, {}),
    }
    for name, args in refused.items():
        assert not decode.applies(*args), name
    with torch.enable_grad():
        assert not decode.applies(query.requires_grad_(), key, value, mask, {})


@pytest.fixture
def kernel_off(monkeypatch):
    monkeypatch.setenv(decode.SWITCH, "0")
    decode.kernel.cache_clear()
    yield
    decode.kernel.cache_clear()


def _sample(model, monkeypatch, greedy):
    """test_decode_cache's sampling call (reserved cache, unshared prompts): the responses and each call's
    ``upcast``."""
    out, _, caches = _generate(model, share=False, reserve=True, monkeypatch=monkeypatch, greedy=greedy)
    return out, [upcast for _, upcast in caches]


def _bf16_model():
    return float32_attention_on_cpu(autocast_forward(tiny_llama(seed=1, vocab_size=64), torch.bfloat16))


@pytest.mark.parametrize("greedy", [True, False])
def test_a_bf16_model_samples_as_with_the_float32_cache(greedy, monkeypatch, request):
    """The kernel over a bf16 cache against sdpa over the float32 cache it replaces: the same tokens on a
    tiny model and log-probs equal to rounding; the cache is bf16 with the kernel, float32 without."""
    model = _bf16_model()
    fast, fast_upcast = _sample(model, monkeypatch, greedy)
    request.getfixturevalue("kernel_off")
    plain, plain_upcast = _sample(model, monkeypatch, greedy)
    assert fast_upcast == [False] and plain_upcast == [True]
    assert torch.equal(fast.response_ids, plain.response_ids)
    assert fast.mask.sum(1).gt(10).sum() >= 4  # most rows long enough to decode through the cache
    torch.testing.assert_close(fast.sampled_logprobs, plain.sampled_logprobs, rtol=0, atol=1e-2)


def test_the_kernel_runs_in_decoding_only(monkeypatch):
    """Every decoding step of a bf16 model goes through the kernel, no trained or scored forward does."""
    calls = []
    compute = decode.decode_attention
    monkeypatch.setattr(decode, "decode_attention", lambda *a: calls.append(a[0].shape) or compute(*a))
    model = _bf16_model()
    widths = []
    model.model.register_forward_pre_hook(
        lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    out, _ = _sample(model, monkeypatch, greedy=True)
    steps = widths.count(1)  # the forwards of one position: the decoding steps
    assert steps >= out.response_ids.shape[1] - 1 and len(widths) > steps  # and the prompt's
    assert len(calls) == model.config.num_hidden_layers * steps
    calls.clear()
    ids = torch.cat([torch.tensor([[5, 6, 7]] * 2), out.response_ids[:2]], 1)
    with torch.no_grad():
        model(input_ids=ids)  # a scoring forward over whole sequences
    model(input_ids=ids).logits.sum().backward()
    assert calls == []


def test_without_a_compiler_decoding_keeps_the_float32_cache(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension\nc++: command not found")

    monkeypatch.setattr(cpp, "load_inline", no_compiler)
    decode.kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=decode.__name__):
            assert not decode.available()
        assert "could not be built (c++: command not found)" in caplog.text
        out, upcast = _sample(_bf16_model(), monkeypatch, greedy=True)
        assert upcast == [True] and out.mask.any()
    finally:
        decode.kernel.cache_clear()
