"""A group's prompt read once in the log-prob read-out (rlhfkit.models.prompt_cache, response_readout's
``share_prompts``): the same log-probs, entropies and gradients as the plain forward over every row, on every
tiny architecture; fewer prompt rows through the decoder; and the plain path wherever sharing is not safe."""

import pytest
import torch

from rlhfkit.models import can_share_prompts, response_readout
from rlhfkit.models.head_chunks import head_transform
from rlhfkit.models.sampling import Sampling
from tests.helpers import tiny_llama
from tests.models.tiny_architectures import ARCHITECTURES, tiny_config

GROUP = 3


def _grouped_batch(vocab: int, pad: int, seed: int = 0):
    """Two left-padded prompts (3 and 5 tokens) x GROUP responses of 4 columns, ragged (right padded)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.full((2, 5), pad)
    prompt_mask = torch.zeros((2, 5), dtype=torch.long)
    for i, n in enumerate((3, 5)):
        prompts[i, 5 - n :] = torch.randint(4, vocab, (n,), generator=g)
        prompt_mask[i, 5 - n :] = 1
    rows = 2 * GROUP
    responses = torch.randint(4, vocab, (rows, 4), generator=g)
    response_mask = torch.ones((rows, 4), dtype=torch.long)
    for row, n in enumerate((4, 2, 3, 1, 4, 3)):
        response_mask[row, n:] = 0
        responses[row, n:] = pad
    ids = torch.cat([prompts.repeat_interleave(GROUP, 0), responses], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(GROUP, 0), response_mask], 1)
    return ids, mask, response_mask.bool()


def _readouts(model, ids, mask, valid, sampling=None, params=None):
    """{share: (log-probs, entropies, gradients of the valid log-probs' sum)} for share in (False, True)."""
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    out = {}
    for share in (False, True):
        model.zero_grad()
        r = response_readout(model, ids, mask, 5, sampling, entropy=True, share_prompts=share)
        r.logprobs[valid].sum().backward()
        out[share] = (r.logprobs.detach(), r.entropy.detach(), [p.grad.clone() for p in params])
    return out


def _assert_same(out, valid, atol=1e-5):
    (lp0, ent0, g0), (lp1, ent1, g1) = out[False], out[True]
    torch.testing.assert_close(lp1[valid], lp0[valid], atol=atol, rtol=0)
    torch.testing.assert_close(ent1[valid], ent0[valid], atol=atol, rtol=0)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)


def _decoder_rows(model, ids, mask, share):
    """The (rows, columns) of each call of the decoder during one read-out (the head's probe, one forward once per
    model, done before: rlhfkit.models.head_chunks.head_transform)."""
    assert head_transform(model) is not None
    calls = []
    hook = model.model.register_forward_pre_hook(
        lambda _m, _a, k: calls.append(tuple(k["input_ids"].shape)), with_kwargs=True
    )
    try:
        response_readout(model, ids, mask, 5, share_prompts=share)
    finally:
        hook.remove()
    return calls


def test_the_prompt_runs_once_per_distinct_prompt_and_gives_the_plain_readout_and_gradients():
    model = tiny_llama()
    ids, mask, valid = _grouped_batch(model.config.vocab_size, model.config.pad_token_id)
    assert _decoder_rows(model, ids, mask, share=False) == [(6, 9)]
    # 2 distinct prompts over columns [0, 4), then every row over the last prompt column and the response
    assert _decoder_rows(model, ids, mask, share=True) == [(2, 4), (6, 5)]
    _assert_same(_readouts(model, ids, mask, valid, Sampling(temperature=0.7)), valid)


def test_a_planted_position_error_in_the_second_pass_is_caught(monkeypatch):
    """The second pass's position ids continue the prompt's: off by one, the read-out differs."""
    import rlhfkit.models.head_chunks as head_chunks

    model = tiny_llama()
    ids, mask, valid = _grouped_batch(model.config.vocab_size, model.config.pad_token_id)
    want = response_readout(model, ids, mask, 5).logprobs
    real = head_chunks.position_ids_from_mask
    monkeypatch.setattr(head_chunks, "position_ids_from_mask", lambda m: real(m) + 1)
    got = response_readout(model, ids, mask, 5, share_prompts=True).logprobs
    assert (got - want)[valid].abs().max() > 1e-4


def test_lora_and_the_adapter_off_reference_share_the_prompt_like_the_plain_path():
    from peft import LoraConfig, get_peft_model

    from rlhfkit.models.lora import AdapterDisabled

    model = get_peft_model(
        tiny_llama(), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    )
    ids, mask, valid = _grouped_batch(32, model.config.pad_token_id)
    out = _readouts(model, ids, mask, valid)
    assert len(out[True][2]) > 0  # the adapters' gradients
    _assert_same(out, valid)
    reference = AdapterDisabled(model)
    plain = response_readout(reference, ids, mask, 5).logprobs
    shared = response_readout(reference, ids, mask, 5, share_prompts=True).logprobs
    torch.testing.assert_close(shared[valid], plain[valid], atol=1e-5, rtol=0)
    assert (shared - response_readout(model, ids, mask, 5).logprobs)[valid].abs().max() > 1e-4  # adapter off


def test_bf16_autocast_shares_the_prompt_within_bf16_rounding():
    from rlhfkit.models.precision import autocast_forward, float32_attention_on_cpu

    model = float32_attention_on_cpu(autocast_forward(tiny_llama(attn_implementation="sdpa"), torch.bfloat16))
    ids, mask, valid = _grouped_batch(model.config.vocab_size, model.config.pad_token_id)
    _assert_same(_readouts(model, ids, mask, valid), valid, atol=3e-2)


HYBRID = {"falcon_h1"}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_tiny_architecture_reads_out_the_same_with_a_shared_prompt(arch, monkeypatch):
    from transformers import AutoModelForCausalLM

    import rlhfkit.models.head_chunks as head_chunks
    from tests.models.tiny_architectures import bpe_tokenizer

    torch.manual_seed(0)
    tokenizer = bpe_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_config(arch, tokenizer)).eval()
    ids, mask, valid = _grouped_batch(len(tokenizer), tokenizer.pad_token_id)
    caches = []
    real = head_chunks.shared_prompt_cache
    monkeypatch.setattr(head_chunks, "shared_prompt_cache", lambda *a: caches.append(real(*a)) or caches[-1])
    _assert_same(_readouts(model, ids, mask, valid), valid)
    # the shared path ran (it may fall back to the plain one); a hybrid model's recurrent state (FalconH1's
    # Mamba layers) is not continued over several columns: each row runs its own prompt
    assert len(caches) == 1 and (caches[0] is None) == (arch in HYBRID)


def test_a_ddp_wrapper_or_gradient_checkpointing_reads_every_row_plainly():
    """One forward per backward under DDP, and checkpointed layers run without a cache: both take the plain
    path (and so does stage 1's actor read-out, to stay on the update's kernels)."""
    model = tiny_llama()
    assert can_share_prompts(model)

    class Wrapper(torch.nn.Module):  # what unwrap_model sees through: DDP's `.module`
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    assert not can_share_prompts(Wrapper(model))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not can_share_prompts(model)
    ids, mask, _ = _grouped_batch(model.config.vocab_size, model.config.pad_token_id)
    assert _decoder_rows(model, ids, mask, share=True) == [(6, 9)]
