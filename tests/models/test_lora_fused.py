"""The fused LoRA forward (rlhfkit.models.lora.fuse_lora_forward): peft's function with the adapter's product
added into the base output in place; the same outputs and gradients as peft's forward (fp32 and bf16 autocast),
no more saved tensors, fewer output-sized temporaries, and peft's own forward wherever the layer is not one
plain active adapter."""

import copy

import torch

from rlhfkit.config.sections import ModelConfig
from rlhfkit.models.head_chunks import head_transform, response_readout
from rlhfkit.models.lora import _fused_lora_forward, add_lora, fuse_lora_forward, prepare_trained
from rlhfkit.models.precision import autocast_forward, float32_attention_on_cpu
from tests.helpers import tiny_llama

IDS = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19]])
MASK = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])


def _adapted(dtype=None, dora=False):
    model = tiny_llama(attn_implementation="sdpa")
    if dtype is not None:
        model = float32_attention_on_cpu(autocast_forward(model, dtype))
    if dora:  # a variant rlhfkit does not configure, but a peft model may carry
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True)
        model = get_peft_model(model, config)
    else:
        model = add_lora(model, rank=4, alpha=8)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero: a trained adapter has a non-zero product
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _pair(dtype=None, dora=False):
    """(peft's forward, the fused one) on the same weights."""
    plain = _adapted(dtype, dora)
    fused = copy.deepcopy(plain)
    assert fuse_lora_forward(fused) == 14  # 2 layers x 7 linear layers
    return plain, fused


def _readout(model):
    model.zero_grad()
    out = response_readout(model, IDS, MASK, 3, entropy=True)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logprobs.detach(), grads


def test_fused_lora_equals_peft_in_values_and_gradients():
    plain, fused = _pair()
    (lp_plain, g_plain), (lp_fused, g_fused) = _readout(plain), _readout(fused)
    torch.testing.assert_close(lp_fused, lp_plain, rtol=0, atol=1e-5)
    assert g_plain.keys() == g_fused.keys() and len(g_plain) == 28  # every A and B
    for name in g_plain:
        torch.testing.assert_close(g_fused[name], g_plain[name], rtol=1e-4, atol=1e-6)
    # the adapter matters here: without it the log-probs are other ones
    with plain.disable_adapter(), torch.no_grad():
        base = response_readout(plain, IDS, MASK, 3).logprobs
    assert (base - lp_plain).abs().max() > 0.05


def test_fused_lora_in_bf16_is_as_close_to_float32_as_peft():
    """Under bf16 autocast the fused sum rounds once where peft rounds three times: measured against the
    float32 function of the same weights, its error is no larger than peft's (here 3.5% against 10.7% of the
    largest gradient entry; log-probs within 1.5e-3 and 1.2e-3 nats)."""
    reference = _adapted()
    plain, fused = _pair(torch.bfloat16)
    for model in (plain, fused):
        model.load_state_dict(reference.state_dict())
    lp_ref, g_ref = _readout(reference)

    def errors(model):
        lp, grads = _readout(model)
        worst = max(float((grads[n] - g_ref[n]).abs().max() / g_ref[n].abs().max()) for n in g_ref)
        return float((lp - lp_ref).abs().max()), worst

    (lp_plain, g_plain), (lp_fused, g_fused) = errors(plain), errors(fused)
    assert 0 < lp_plain < 0.01 and lp_fused <= 2 * lp_plain
    assert 0 < g_plain < 0.5 and g_fused <= 2 * g_plain


def test_fused_lora_layer_equals_peft_layer_by_hand():
    """One layer against y = W x + b + alpha / r * B (A x), written out."""
    plain, fused = _pair()
    layer = fused.base_model.model.model.layers[0].mlp.up_proj
    assert layer.forward.__func__ is _fused_lora_forward
    x = torch.randn(3, 5, 32)
    w, a, b = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = x @ w.T + 2.0 * (x @ a.T) @ b.T  # alpha / r = 8 / 4
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_fused_lora_saves_no_more_and_allocates_fewer_temporaries():
    def profile(model):
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                response_readout(model, IDS, MASK, 3)
        counts = {e.key: e.count for e in prof.key_averages()}
        return sum(saved.values()), counts.get("aten::add", 0) + counts.get("aten::mul", 0)

    plain, fused = _pair()
    # the read-out's probe of the head (one forward, once per model) runs before counting
    for model in (plain, fused):
        head_transform(model)
    (saved_plain, ops_plain), (saved_fused, ops_fused) = profile(plain), profile(fused)
    assert saved_fused <= saved_plain
    assert ops_fused == ops_plain - 2 * 14  # each layer's "* scaling" and "result +" are gone


def test_fused_lora_gives_way_to_peft_where_the_layer_is_not_plain():
    plain, fused = _pair()
    with torch.no_grad():
        with plain.disable_adapter(), fused.disable_adapter():  # the reference: the base exactly
            assert torch.equal(
                response_readout(fused, IDS, MASK, 3).logprobs, response_readout(plain, IDS, MASK, 3).logprobs
            )
        for model in (plain, fused):
            model.merge_adapter()
        assert torch.equal(
            response_readout(fused, IDS, MASK, 3).logprobs, response_readout(plain, IDS, MASK, 3).logprobs
        )
    # DoRA is a variant: peft's forward, bit for bit
    plain, fused = _pair(dora=True)
    with torch.no_grad():
        assert torch.equal(
            response_readout(fused, IDS, MASK, 3).logprobs, response_readout(plain, IDS, MASK, 3).logprobs
        )


def test_prepare_trained_fuses_the_adapters_and_a_scalar_model_too():
    policy = prepare_trained(tiny_llama(), ModelConfig(lora_rank=4, lora_alpha=8))
    critic = prepare_trained(tiny_llama("scalar"), ModelConfig(lora_rank=4, lora_alpha=8))
    for model in (policy, critic):
        layers = [m for m in model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]
        assert len(layers) == 14 and all(m.forward.__func__ is _fused_lora_forward for m in layers)
