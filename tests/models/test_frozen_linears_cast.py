"""Frozen linear weights held in bf16 for a generate call under bf16 autocast
(rlhfkit.models.precision.frozen_linears_cast): the same tokens and log-probs bit for bit, the float32
weights back afterwards, a tied embedding untouched."""

import pytest
import torch

from rlhfkit.models import sampling_for
from rlhfkit.models.precision import autocast_forward, float32_attention_on_cpu, frozen_linears_cast
from rlhfkit.rollout import generate_responses
from rlhfkit.rollout import generation as generation_module
from tests.helpers import tiny_llama


def _lora_bf16(tied: bool):
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(attn_implementation="sdpa", tie_word_embeddings=tied)
    base = float32_attention_on_cpu(autocast_forward(base, torch.bfloat16))
    return get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))


def _sample(model, greedy):
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]).repeat_interleave(2, 0)
    torch.manual_seed(0)
    return generate_responses(
        model,
        ids,
        torch.ones_like(ids),
        max_new_tokens=6,
        stop_token_ids=[eos],
        pad_token_id=pad,
        sampling=sampling_for(pad, [eos]),
        greedy=greedy,
        return_logprobs=True,
    )


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("greedy", [True, False])
def test_generate_gives_the_same_tokens_and_logprobs_and_the_weights_come_back(monkeypatch, tied, greedy):
    import contextlib

    model = _lora_bf16(tied)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with_cast = _sample(model, greedy)
    for name, p in model.named_parameters():  # float32 again, the very values
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), name
    monkeypatch.setattr(generation_module, "frozen_linears_cast", lambda m: contextlib.nullcontext())
    plain = _sample(model, greedy)
    assert torch.equal(with_cast.response_ids, plain.response_ids)
    assert torch.equal(with_cast.sampled_logprobs, plain.sampled_logprobs)


def test_only_frozen_linears_are_cast_and_a_tied_embedding_is_not():
    model = _lora_bf16(tied=True)
    with frozen_linears_cast(model):
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16
    assert dtypes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] == torch.float32
    assert dtypes["base_model.model.model.embed_tokens.weight"] == torch.float32  # = the tied lm_head
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_planted_cast_of_the_tied_embedding_changes_the_samples():
    """Casting the embedding too (it is read outside autocast) is caught by the equality above."""
    model = _lora_bf16(tied=True)
    plain = _sample(model, greedy=True)
    emb = model.get_input_embeddings().weight
    saved = emb.data
    emb.data = emb.data.to(torch.bfloat16).float()  # what a cast of the tied weight would give it
    try:
        planted = _sample(model, greedy=True)
    finally:
        emb.data = saved
    assert not torch.equal(planted.sampled_logprobs, plain.sampled_logprobs)
