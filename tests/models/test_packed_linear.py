"""Linear layers with their bf16 weights laid out once for oneDNN while sampling (rlhfkit.models.packed_linear):
the same products bit for bit as the layers' own forwards, the same tokens and log-probs from a sampling call,
every layer put back after; a forward that records a graph keeps the layer's own."""

import pytest
import torch

from rlhfkit.models import packed_linear
from rlhfkit.models.packed_linear import packed_linears
from rlhfkit.models.precision import autocast_forward, float32_attention_on_cpu
from rlhfkit.models.sampling import Sampling
from rlhfkit.rollout import generate_responses
from tests.helpers import tiny_llama

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this CPU's oneDNN has no bf16")


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("shape", [(24, 40), (576, 192), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_gives_its_own_forwards_values_bit_for_bit(rows, shape, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(shape[1], shape[0], bias=bias).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(rows, 3, shape[1])  # float32: autocast casts it
    with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
        want = layer(x)
        with packed_linears(layer, rows):
            assert "forward" in vars(layer)
            got = layer(x)
            got_bf16 = layer(x.to(torch.bfloat16))
    assert "forward" not in vars(layer)  # put back
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got, want) and torch.equal(got_bf16, want)


def test_a_forward_that_records_a_graph_or_runs_in_float32_takes_the_layers_own():
    layer = torch.nn.Linear(8, 4).to(torch.bfloat16)  # its weight takes a gradient
    calls = []
    with packed_linears(layer, 2):
        real = torch.ops.mkldnn._linear_pointwise
        try:
            torch.ops.mkldnn._linear_pointwise = lambda *a: calls.append(1) or real(*a)
            with torch.autocast("cpu", torch.bfloat16):
                out = layer(torch.randn(2, 8))
            assert out.requires_grad and not calls
            with torch.no_grad():
                layer(torch.randn(2, 8).to(torch.bfloat16))
            assert calls == [1]
            frozen = torch.nn.Linear(8, 4)  # float32, outside autocast: left alone
            with packed_linears(frozen, 2), torch.no_grad():
                torch.testing.assert_close(frozen(torch.ones(1, 8))[0], frozen.weight.sum(1) + frozen.bias)
                assert "forward" not in vars(frozen) and calls == [1]
        finally:
            torch.ops.mkldnn._linear_pointwise = real


def _sample(model):
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    ids = torch.tensor([[pad, pad, 5, 6], [7, 8, 9, 10]]).repeat_interleave(4, 0)
    torch.manual_seed(0)
    return generate_responses(
        model,
        ids,
        (ids != pad).long(),
        max_new_tokens=16,
        stop_token_ids=[eos],
        pad_token_id=pad,
        sampling=Sampling(temperature=1.0, suppress_ids=(pad,)),
        return_logprobs=True,
    )


def test_sampling_with_packed_layers_draws_the_same_tokens_with_the_same_logprobs(monkeypatch):
    """A frozen bf16-autocast model (its linear weights held in bf16 for the call, its tied head's bf16 copy):
    every linear layer is packed, and the call's tokens and log-probs are those of the unpacked call."""
    import contextlib

    import rlhfkit.rollout.generation as generation
    from rlhfkit.models.precision import hold_tied_head_cast

    model = tiny_llama(seed=3, vocab_size=64, tie_word_embeddings=True).requires_grad_(False)
    model = float32_attention_on_cpu(autocast_forward(model, torch.bfloat16))
    assert hold_tied_head_cast(model)
    packed, state = [], {"pack": True}
    real_forward, real_context = packed_linear._packed_forward, generation.packed_linears
    monkeypatch.setattr(
        packed_linear, "_packed_forward", lambda module, *a: packed.append(module) or real_forward(module, *a)
    )
    monkeypatch.setattr(
        generation,
        "packed_linears",
        lambda m, rows: real_context(m, rows) if state["pack"] else contextlib.nullcontext(m),
    )
    got = _sample(model)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert {id(m) for m in packed} == {id(m) for m in linears} and len(packed) == len(linears) == 15
    assert all("forward" not in vars(m) or m is model.lm_head for m in linears)  # put back (the head's own)
    state["pack"] = False
    want = _sample(model)
    assert len(packed) == 15  # the reference call packed nothing
    state["pack"] = True
    got_again = _sample(model)
    assert got.mask.sum(1).gt(4).any()
    for a in (got, got_again):
        assert torch.equal(a.response_ids, want.response_ids)
        assert torch.equal(a.sampled_logprobs, want.sampled_logprobs)
