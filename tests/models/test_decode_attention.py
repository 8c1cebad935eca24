"""The float32 attention of a half-precision model on a CPU (rlhfkit.models.precision): a decoding step (one
query position, no graph) as two matrix products per key / value head, equal to transformers' ``sdpa``
attention in float32 up to float32 rounding, with padding masks, grouped and plain heads; the prefill and a
forward that records a graph keep ``sdpa``."""

import pytest
import torch

from rlhfkit.models import precision
from rlhfkit.models.precision import _sdpa_float32_on_cpu


class _Module:  # what sdpa_attention_forward reads of an attention module
    def __init__(self, groups):
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = False


def _inputs(heads, kv, length, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, heads, 1, 16, generator=g).to(dtype)
    k, v = (torch.randn(3, kv, length, 16, generator=g).to(dtype) for _ in range(2))
    mask = torch.ones(3, 1, 1, length, dtype=torch.bool)
    mask[0, ..., :4] = False  # left padding
    mask[2, ..., 5:9] = False  # a hole (a tool's or a static cache's masked columns)
    return q, k, v, mask


def _reference(module, q, k, v, mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), mask, **kwargs)
    return out


@pytest.mark.parametrize("heads, kv", [(6, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_a_decoding_step_equals_sdpa_in_float32(heads, kv, additive, scaling, monkeypatch):
    q, k, v, mask = _inputs(heads, kv, 37)
    module = _Module(heads // kv)
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    calls = []
    real = precision._decode_attention
    monkeypatch.setattr(precision, "_decode_attention", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        got, _ = _sdpa_float32_on_cpu(module, q, k, v, mask, dropout=0.0, scaling=scaling)
    want = _reference(module, q, k, v, mask, dropout=0.0, scaling=scaling)
    assert calls == [1] and got.dtype == torch.bfloat16 and got.shape == want.shape == (3, 1, heads, 16)
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), atol=1e-2, rtol=0)
    full = real(q.float(), k.float(), v.float(), mask, {"scaling": scaling})  # before the bf16 cast
    torch.testing.assert_close(full, want, atol=2e-6, rtol=1e-5)


def test_a_prefill_a_graph_and_extra_terms_keep_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(precision, "_decode_attention", lambda *a: calls.append(1))
    q, k, v, mask = _inputs(6, 2, 12)
    module = _Module(3)
    with torch.no_grad():
        prefill = torch.randn(3, 6, 12, 16).to(torch.bfloat16)
        _sdpa_float32_on_cpu(module, prefill, k, v, mask[..., :1, :].expand(3, 1, 12, 12).clone())
        _sdpa_float32_on_cpu(module, q, k, v, mask, dropout=0.1)
        _sdpa_float32_on_cpu(module, q, k, v, mask, s_aux=torch.zeros(6))  # sinks: sdpa's own error or path
    _sdpa_float32_on_cpu(module, q.requires_grad_(), k, v, mask)  # a training forward's graph
    assert calls == []
