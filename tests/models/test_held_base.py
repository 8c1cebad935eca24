"""A LoRA base held in bf16 for the whole run under bf16 autocast (rlhfkit.models.precision.hold_frozen_linears):
the same log-probs and adapter gradients bit for bit, half the memory of the frozen weights, and a merged save
into the float32 originals (read back from disk), not into their bf16 rounding."""

import copy
import gc
import os

import pytest
import torch

from rlhfkit.config.sections import ModelConfig
from rlhfkit.models.head_chunks import response_readout
from rlhfkit.models.lora import merged_copy, prepare_trained
from rlhfkit.models.precision import (
    HELD,
    autocast_forward,
    float32_attention_on_cpu,
    hold_frozen_linears,
)
from tests.helpers import tiny_llama

Q_BASE = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"


def _base(dtype=torch.bfloat16, tied=False):
    model = tiny_llama(attn_implementation="sdpa", tie_word_embeddings=tied)
    model = autocast_forward(model, dtype)
    return float32_attention_on_cpu(model) if dtype is not None else model


def _lora(base, held: bool):
    cfg = ModelConfig(lora_rank=4, lora_alpha=8)
    model = prepare_trained(base, cfg)
    if not held:  # the float32 base, as before holding: undo the hold on a model that took it
        from rlhfkit.models.precision import restore_frozen_linears

        restore_frozen_linears(model)
    with torch.no_grad():  # lora_B starts at zero: give the adapters a non-zero update to test
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    return model


def _pair(tied=False):
    base = _base(tied=tied)
    plain = _lora(copy.deepcopy(base), held=False)
    torch.manual_seed(0)
    held = _lora(base, held=True)
    held.load_state_dict(plain.state_dict())  # the same adapters; the held base keeps its bf16 storage
    return plain, held


def _readout(model):
    ids = torch.tensor([[0, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17]])
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    model.zero_grad()
    out = response_readout(model, ids, mask, 3, entropy=True)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logprobs.detach(), out.entropy.detach(), grads


@pytest.mark.parametrize("tied", [False, True])
def test_held_base_gives_the_same_logprobs_entropies_and_adapter_gradients(tied):
    plain, held = _pair(tied)
    dtypes = {n: p.dtype for n, p in held.named_parameters()}
    assert dtypes[Q_BASE] == torch.bfloat16
    assert dtypes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] == torch.float32
    assert dtypes["base_model.model.model.embed_tokens.weight"] == torch.float32  # read outside autocast
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    a, b = _readout(plain), _readout(held)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_the_merged_copy_of_a_held_model_is_the_float32_merge():
    plain, held = _pair()
    expected = merged_copy(plain).state_dict()
    got = merged_copy(held).state_dict()
    assert expected.keys() == got.keys()
    for k in expected:
        assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), k
    assert dict(held.named_parameters())[Q_BASE].dtype == torch.bfloat16  # the held model goes on training


def test_a_planted_merge_into_the_bf16_base_is_caught():
    """Merging into the held bf16 weights (no read-back) rounds the base: the equality above would fail."""
    plain, held = _pair()
    setattr(held, HELD, None)  # the read-back finds nothing to restore
    expected = merged_copy(plain).state_dict()
    got = merged_copy(held).state_dict()
    assert any(not torch.equal(got[k].float(), expected[k]) for k in expected)


def test_nothing_is_held_in_float32_or_without_lora():
    fp32 = prepare_trained(_base(dtype=None), ModelConfig(lora_rank=4, lora_alpha=8))
    assert all(p.dtype == torch.float32 for p in fp32.parameters())
    assert not getattr(fp32, HELD, None)
    full = prepare_trained(_base(), ModelConfig())  # full fine-tuning: every weight trained, float32
    assert all(p.dtype == torch.float32 for p in full.parameters())
    assert hold_frozen_linears(full) == 0


def test_the_originals_file_goes_with_the_model():
    _, held = _pair()
    file = getattr(held, HELD)
    assert os.path.isfile(file)
    del held
    gc.collect()
    assert not os.path.exists(os.path.dirname(file))


def test_a_save_first_hands_freed_heap_memory_back():
    """The freed activations of a training step stay in the C allocator's heap (holes between live blocks);
    release_freed_memory, called by save_hf_folder before it copies the model, returns them."""
    from rlhfkit.models.saving import release_freed_memory

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    big = torch.ones(8_000_000)  # freeing a large block raises glibc's mmap threshold above 1 MB
    del big
    blocks = [torch.ones(250_000) for _ in range(400)]  # 400 x 1 MB on the heap
    kept = blocks[9::10]  # one in ten stays: the other 360 MB are holes the heap cannot shrink past
    del blocks
    before = rss_mib()
    release_freed_memory()
    assert before - rss_mib() > 200
    assert len(kept) == 40


def _head_casts(model) -> int:
    """How many times a forward + read-out casts a (V, H) tensor (the tied output weight) to another dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vh = tuple(model.get_output_embeddings().weight.shape)

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == vh:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        _readout(model)
    return Count.n


def test_a_tied_frozen_head_is_multiplied_in_bf16_without_a_cast_per_call():
    """The tied output weight's bf16 copy (hold_tied_head_cast) gives the same log-probs, entropies and adapter
    gradients bit for bit as autocast's cast at every call, and is made once, not at every call."""
    from rlhfkit.models.precision import HALF_HEAD

    _, held = _pair(tied=True)
    head = held.get_base_model().get_output_embeddings()
    assert head.weight is held.get_base_model().get_input_embeddings().weight
    assert getattr(head, HALF_HEAD, "missing") is None  # set up by prepare_trained, filled at the first call
    with_copy = _readout(held)
    copy_tensor = getattr(head, HALF_HEAD)[1]
    assert copy_tensor.dtype == torch.bfloat16
    assert _head_casts(held) == 0
    assert getattr(head, HALF_HEAD)[1] is copy_tensor  # kept between calls
    del head.forward  # the class's forward: autocast casts the float32 weight at each call
    assert _head_casts(held) > 1
    plain = _readout(held)
    assert torch.equal(with_copy[0], plain[0]) and torch.equal(with_copy[1], plain[1])
    assert all(torch.equal(with_copy[2][k], plain[2][k]) for k in plain[2])


def test_no_head_copy_untied_trained_or_float32():
    from rlhfkit.models.precision import HALF_HEAD, hold_tied_head_cast

    _, untied = _pair(tied=False)
    assert not hasattr(untied.get_base_model().get_output_embeddings(), HALF_HEAD)
    full = prepare_trained(
        _base(tied=True), ModelConfig()
    )  # the tied weight is trained: autocast keeps its cast
    assert not hold_tied_head_cast(full)
    assert not hold_tied_head_cast(_base(dtype=None, tied=True))
