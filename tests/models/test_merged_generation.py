"""LoRA merged into the base weights for sampling (rlhfkit.models.lora.merged_for_generation): the logits of
the merged forward are the adapter's up to rounding, greedy tokens the same, the base weights untouched
after, and nothing merged where the merge would be wrong (an AdapterDisabled role, adapters off, DoRA)."""

import pytest
import torch

from rlhfkit.config.sections import ModelConfig
from rlhfkit.models import sampling_for
from rlhfkit.models.lora import AdapterDisabled, merged_for_generation, prepare_trained
from rlhfkit.models.precision import autocast_forward, float32_attention_on_cpu
from rlhfkit.rollout import generate_responses
from tests.helpers import tiny_llama

IDS = torch.tensor([[0, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17]])
MASK = torch.ones_like(IDS)
MASK[0, 0] = 0


def _lora(dtype=None, **lora):
    model = tiny_llama(attn_implementation="sdpa", pad_token_id=0)
    if dtype is not None:
        model = float32_attention_on_cpu(autocast_forward(model, dtype))
    model = prepare_trained(model, ModelConfig(lora_rank=4, lora_alpha=8, **lora))
    with torch.no_grad():  # lora_B starts at zero: a non-zero update to merge
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=MASK).logits.float()


def _base_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_merged_forward_is_the_adapters_and_the_base_comes_back(dtype):
    torch.manual_seed(0)
    model = _lora(dtype)
    adapted, before = _logits(model), _base_weights(model)
    with torch.no_grad(), model.disable_adapter():
        base_only = model(input_ids=IDS, attention_mask=MASK).logits.float()
    assert (adapted - base_only).abs().max() > 0.05  # the adapter moves the logits
    with merged_for_generation(model):
        merged = _logits(model)
        assert all(m.disable_adapters for n, m in model.named_modules() if n.endswith("q_proj"))
    tolerance = 1e-5 if dtype is None else 0.05  # float32 rounding / bf16 rounding of W + BA against W, BA
    torch.testing.assert_close(merged, adapted, rtol=0, atol=tolerance)
    after = _base_weights(model)
    assert all(torch.equal(before[n], after[n]) and before[n].dtype == after[n].dtype for n in before)
    torch.testing.assert_close(_logits(model), adapted, rtol=0, atol=0)  # the adapters are on again


def test_generation_samples_from_the_adapted_model():
    """Greedy tokens with the merge are the adapted model's (its plain forward, step by step), not the base's."""
    torch.manual_seed(0)
    model = _lora()
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    prompts, mask = torch.tensor([[5, 6, 7], [9, 10, 11]]), torch.ones(2, 3, dtype=torch.long)
    out = generate_responses(
        model, prompts, mask, max_new_tokens=6, stop_token_ids=[eos], pad_token_id=pad,
        sampling=sampling_for(pad, [eos]), greedy=True,
    )  # fmt: skip
    ids = prompts
    with torch.no_grad():
        for _ in range(6):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1]
            if pad != eos:  # sampling_for suppresses a pad that is not a stop token
                logits[:, pad] = float("-inf")
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    expected = ids[:, 3:]
    keep = out.mask
    assert torch.equal(out.response_ids[keep], expected[keep])


def test_nothing_is_merged_for_a_disabled_role_adapters_off_or_dora():
    torch.manual_seed(0)
    model = _lora()
    reference = AdapterDisabled(model)
    before = _base_weights(model)
    for target in (reference,):
        with merged_for_generation(target):
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    with model.disable_adapter(), merged_for_generation(model):
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(
        tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True)
    )
    with torch.no_grad():
        for name, p in dora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    for target in (tiny_llama(), dora):
        weights = {n: p.clone() for n, p in target.named_parameters()}
        with merged_for_generation(target):
            assert all(torch.equal(p, weights[n]) for n, p in target.named_parameters())
