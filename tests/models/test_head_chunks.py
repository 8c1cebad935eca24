"""The chunked read-out (rlhfkit.models.head_chunks): equal to the plain (B, T, V) computation in values and
gradients, for any chunk size, every sampling processing, every tiny architecture, LoRA and bf16."""

import pytest
import torch

from rlhfkit.algos import entropy_from_logits
from rlhfkit.models import Sampling, processed_logits, response_logits, sampled_logprobs
from rlhfkit.models.head_chunks import (
    HeadTransform,
    chunkable,
    chunked_readout,
    head_transform,
    response_readout,
)
from rlhfkit.models.readout import position_ids_from_mask
from tests.helpers import tiny_llama
from tests.models.tiny_architectures import ARCHITECTURES, tiny_config

SAMPLINGS = {
    "plain": Sampling(),
    "temperature": Sampling(temperature=0.7),
    "suppress-topk": Sampling(temperature=0.9, top_k=5, suppress_ids=(3,)),
    "topp": Sampling(temperature=1.3, top_p=0.8),
}


def unknown_transform(model, transform):
    """``model`` whose forward transforms its logits in a way no config field names (``logits_to_keep`` still in
    its signature, through ``functools.wraps``)."""
    import functools

    forward = model.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = transform(out.logits)
        return out

    model.forward = run
    return model


def plain(head, hidden, labels, sampling, softcap=None):
    """The reference: whole (B, T, V) logits, then the existing read-outs."""
    logits = head(hidden)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return sampled_logprobs(logits, labels, sampling), entropy_from_logits(
        processed_logits(logits, sampling, labels)
    )


def _problem(vocab=37, width=8, batch=3, steps=7, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(width, vocab, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, width, generator=g))
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=g))
    hidden = torch.randn(batch, steps, width, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, steps), generator=g)
    return head, hidden, labels


def _grads(head, hidden, outputs, weights):
    loss = sum((o * w).sum() for o, w in zip(outputs, weights, strict=True))
    params = [hidden, *head.parameters()]
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("name", list(SAMPLINGS))
@pytest.mark.parametrize("chunk", [1, 4, 5, 21, 100])  # 21 = B x T; 4, 5 do not divide it
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_chunked_equals_plain_in_values_and_gradients_fp32(name, chunk, softcap):
    head, hidden, labels = _problem(bias=softcap is not None)
    sampling = SAMPLINGS[name]
    lp, ent = chunked_readout(head, hidden, labels, sampling, True, softcap, chunk)
    ref_lp, ref_ent = plain(head, hidden, labels, sampling, softcap)
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)]
    for got, want in zip(
        _grads(head, hidden, (lp, ent), weights),
        _grads(head, hidden, (ref_lp, ref_ent), weights),
        strict=True,
    ):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk", [4, 100])
def test_entropy_as_a_value_is_the_same_and_spares_its_backward(chunk):
    """``entropy_grad=False`` (an entropy no loss uses): the same entropies bit for bit, no graph, the same
    log-prob gradients, and a backward that recomputes the log-probs only (fewer operations)."""
    head, hidden, labels = _problem()
    sampling = SAMPLINGS["suppress-topk"]
    runs = []
    for grad in (True, False):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            lp, ent = chunked_readout(head, hidden, labels, sampling, True, None, chunk, entropy_grad=grad)
            grads = torch.autograd.grad(lp.sum(), [hidden, head.weight])
        runs.append((lp, ent, grads, sum(e.count for e in prof.key_averages())))
    (lp1, ent1, g1, ops1), (lp0, ent0, g0, ops0) = runs
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)
    assert ent1.requires_grad and not ent0.requires_grad
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    assert ops0 < ops1
    # through a model, the chunked path and the plain one (an unknown transform of the logits takes it) alike
    for scale in (None, 1.5):
        model = tiny_llama()
        if scale:
            unknown_transform(model, lambda logits, s=scale: logits * s + 0.1)
        assert chunkable(model) == (scale is None)
        ids, mask = torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.ones(1, 6, dtype=torch.long)
        with_grad = response_readout(model, ids, mask, 2, sampling, entropy=True)
        value = response_readout(model, ids, mask, 2, sampling, entropy=True, entropy_grad=False)
        assert torch.equal(with_grad.entropy, value.entropy) and with_grad.entropy.requires_grad
        assert not value.entropy.requires_grad and value.logprobs.requires_grad


def test_chunked_backward_keeps_no_full_logits():
    """The graph of the chunked read-out saves hidden-sized tensors, never a (B, T, V) or (chunk, V) block:
    every saved tensor of the autograd graph is counted through saved-tensor hooks."""
    head, hidden, labels = _problem(vocab=4000, width=8, batch=2, steps=16)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = chunked_readout(head, hidden, labels, Sampling(temperature=0.8), False, None, 4)
    assert max(saved) < 4 * 4000  # no chunk's logits kept: recomputed in backward
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        plain(head, hidden, labels, Sampling(temperature=0.8))
    assert max(saved) >= 2 * 16 * 4000  # the plain path keeps the whole logits: the count above means it


def test_junk_at_masked_positions_changes_nothing_elsewhere():
    head, hidden, labels = _problem()
    lp, ent = chunked_readout(head, hidden, labels, SAMPLINGS["suppress-topk"], True, None, 4)
    junk_hidden = hidden.detach().clone()
    junk_labels = labels.clone()
    junk_hidden[:, -2:] = 1e4
    junk_labels[:, -2:] = -100
    lp2, ent2 = chunked_readout(head, junk_hidden, junk_labels, SAMPLINGS["suppress-topk"], True, None, 4)
    assert torch.equal(lp[:, :-2], lp2[:, :-2]) and torch.equal(ent[:, :-2], ent2[:, :-2])


def test_bf16_autocast_within_bf16_tolerance():
    head, hidden, labels = _problem(vocab=64, width=16)
    sampling = SAMPLINGS["temperature"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = chunked_readout(head, hidden, labels, sampling, True, None, 5)
        ref_lp, ref_ent = plain(head, hidden, labels, sampling)
    torch.testing.assert_close(lp, ref_lp, atol=5e-2, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=5e-2, rtol=0)
    weights = [torch.ones_like(lp), torch.ones_like(lp)]
    for got, want in zip(
        _grads(head, hidden, (lp, ent), weights),
        _grads(head, hidden, (ref_lp, ref_ent), weights),
        strict=True,
    ):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def _batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[2, -3:] = 0  # right padding
    return ids, mask


def _model_readout_case(model, sampling, chunk=3, atol=1e-5):
    ids, mask = _batch(model.config.vocab_size)
    got = response_readout(model, ids, mask, 4, sampling, entropy=True, chunk_tokens=chunk)
    logits = response_logits(model, ids, mask, 4)  # (B, R, V): the plain path
    want_lp = sampled_logprobs(logits, ids[:, 4:], sampling)
    want_ent = entropy_from_logits(processed_logits(logits, sampling, ids[:, 4:]))
    valid = mask[:, 4:].bool()
    torch.testing.assert_close(got.logprobs[valid], want_lp[valid], atol=atol, rtol=0)
    torch.testing.assert_close(got.entropy[valid], want_ent[valid], atol=atol, rtol=0)
    return got, want_lp, valid


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_tiny_architecture_reads_out_the_same_chunked(arch):
    from transformers import AutoModelForCausalLM

    from tests.models.tiny_architectures import bpe_tokenizer

    torch.manual_seed(0)
    config = tiny_config(arch, bpe_tokenizer())
    if getattr(config, "final_logit_softcapping", None):  # Gemma 2/3: a cap the tiny logits would never reach
        config.final_logit_softcapping = 0.05
    model = AutoModelForCausalLM.from_config(config).eval()
    assert chunkable(model)
    _model_readout_case(model, SAMPLINGS["suppress-topk"])


def test_gradients_through_a_model_equal_the_plain_path_also_with_tied_embeddings():
    for tied in (False, True):
        model = tiny_llama(tie_word_embeddings=tied)
        got, want, valid = _model_readout_case(model, SAMPLINGS["temperature"])
        grads = []
        for lp in (got.logprobs, want):
            model.zero_grad()
            lp[valid].sum().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys() and "lm_head.weight" in grads[0] or tied
        for name, grad in grads[1].items():
            torch.testing.assert_close(grads[0][name], grad, atol=1e-5, rtol=1e-4)


def test_lora_on_lm_head_takes_the_chunked_path_with_its_adapter():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(), LoraConfig(r=2, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    )
    assert chunkable(model)
    got, want, valid = _model_readout_case(model, SAMPLINGS["plain"])
    grads = []
    for lp in (got.logprobs, want):
        model.zero_grad()
        lp[valid].sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert any("lm_head" in n and "lora_B" in n for n in grads[0])
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, atol=1e-5, rtol=1e-4)


def test_a_model_that_transforms_its_logits_unknowingly_takes_the_plain_path():
    """A transform the probe does not confirm (a config field the model does not apply is harmless; a forward
    that scales, shifts or caps its logits some other way) takes the plain path and reads the model's own
    logits; the answer is cached on the model, keyed by the config fields it read."""
    model = tiny_llama()
    model.config.logit_scale = 0.5  # Llama does not apply it: the plain head is confirmed
    assert head_transform(model) == HeadTransform(1.0, None)
    del model.config.logit_scale
    for transform in (
        lambda z: z * 0.5,
        lambda z: z + torch.arange(z.shape[-1]) * 1e-2,
        lambda z: 2 * torch.tanh(z),
    ):
        model = unknown_transform(tiny_llama(), transform)
        assert head_transform(model) is None and not chunkable(model)
        _model_readout_case(model, SAMPLINGS["temperature"])  # the plain path: the model's own logits
    # the same scale named by a config field is applied, and the cached answer follows the field
    model = unknown_transform(tiny_llama(), lambda z: z * 0.5)
    model.config.logit_scale = 0.5
    assert head_transform(model) == HeadTransform(0.5, None)
    model.config.logit_scale = 3.0
    assert head_transform(model) is None


SCALED = {"falcon_h1": 0.25, "granite": 0.25, "cohere": 0.25, "gemma2": 1.0, "gemma3": 1.0}


@pytest.mark.parametrize("arch", list(SCALED))
@pytest.mark.parametrize(
    "gain", [1.0, 30.0]
)  # 30: logits of a few nats, a soft-cap of 2 well inside its bend
def test_scaled_and_soft_capped_heads_read_out_as_the_models_own_logits(arch, gain):
    """FalconH1 (``lm_head_multiplier``), Granite (``logits_scaling``), Cohere (``logit_scale``) and Gemma 2/3
    (``final_logit_softcapping``) take the chunked path, and its log-probs and their gradients equal
    ``log_softmax`` of the model's own logits (FalconH1 used to be read 0.15 nats off at gain 1)."""
    from transformers import AutoModelForCausalLM

    from tests.models.tiny_architectures import bpe_tokenizer

    torch.manual_seed(0)
    cap = {"final_logit_softcapping": 2.0} if SCALED[arch] == 1.0 else {}
    model = AutoModelForCausalLM.from_config(tiny_config(arch, bpe_tokenizer(), **cap)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(gain)
    assert head_transform(model) == HeadTransform(SCALED[arch], cap.get("final_logit_softcapping"))
    ids, mask = _batch(model.config.vocab_size)
    got = response_readout(model, ids, mask, 4).logprobs  # (B, R)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    want = torch.log_softmax(logits[:, 3:-1].float(), -1).gather(-1, ids[:, 4:, None])[..., 0]
    valid = mask[:, 4:].bool()
    torch.testing.assert_close(got[valid], want[valid], atol=2e-5, rtol=0)
    grads = []
    for lp in (got, want):
        model.zero_grad()
        lp[valid].sum().backward(retain_graph=True)
        grads.append(model.get_output_embeddings().weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_the_probe_leaves_the_random_state_and_the_model_as_they_were():
    """The probe (a no-grad forward, once per model) draws no random number a run would see: a model in train
    mode with dropout reads the same whether or not it was probed before, and is probed once."""
    calls = []
    model = tiny_llama(attention_dropout=0.5).train()
    model.model.register_forward_hook(lambda *a: calls.append(1))
    torch.manual_seed(0)
    head_transform(model)
    after_probe = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), after_probe)
    assert len(calls) == 1 and model.training
    head_transform(model)
    chunkable(model)
    assert len(calls) == 1


@pytest.mark.parametrize("arch", ["cohere", "gemma2", "llama"])
def test_the_probe_confirms_the_transform_in_bf16(arch):
    """Under bf16 autocast (float32 weights, a trained role) and with bf16 weights (a frozen role), the probe
    still tells the model's transform from the others (bf16 rounding is far below a wrong scale)."""
    from transformers import AutoModelForCausalLM

    from rlhfkit.models.precision import autocast_forward
    from tests.models.tiny_architectures import bpe_tokenizer

    cap = {"final_logit_softcapping": 2.0} if arch == "gemma2" else {}
    want = HeadTransform(0.25 if arch == "cohere" else 1.0, cap.get("final_logit_softcapping"))
    for weights in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, bpe_tokenizer(), **cap)).eval()
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(30.0)
        model = autocast_forward(model.to(weights), torch.bfloat16)
        assert head_transform(model) == want, weights
        ids, mask = _batch(model.config.vocab_size)
        with torch.no_grad():
            got = response_readout(model, ids, mask, 4).logprobs
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
            ).logits
        ref = torch.log_softmax(logits[:, 3:-1].float(), -1).gather(-1, ids[:, 4:, None])[..., 0]
        valid = mask[:, 4:].bool()
        torch.testing.assert_close(got[valid], ref[valid], atol=0.1, rtol=0)


def test_the_probe_tolerance_is_relative_to_the_logits_so_small_bf16_logits_keep_the_scale():
    """Granite divides its logits by ``logits_scaling`` = 4: with logits of a few thousandths in bf16, an absolute
    tolerance of bf16's size would pass the first candidate, x4 (16x off the model's / 4); the tolerance is a
    share of the logits' size, so only the model's own scale passes."""
    from transformers import AutoModelForCausalLM

    from rlhfkit.models.precision import autocast_forward
    from tests.models.tiny_architectures import bpe_tokenizer

    torch.manual_seed(0)
    config = tiny_config("granite", bpe_tokenizer())
    assert config.logits_scaling == 4.0
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.02)
    model = autocast_forward(model.to(torch.bfloat16), torch.bfloat16)
    ids, mask = _batch(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    assert 0 < float(logits.abs().max()) < 2e-3  # x4 and / 4 of these differ by less than bf16's tolerance
    assert head_transform(model) == HeadTransform(0.25, None)
