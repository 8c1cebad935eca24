"""rlhfkit.models.lora.merged_weights: a LoRA model's merged weights one tensor at a time (what the vLLM engine's
weight sync loads), equal bit for bit to the merged copy's, a held bf16 base merged from its float32 originals,
and lazy: no copy of the model, each layer's W + s B A computed only when its weight is taken."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.models import lora
from rlhfkit.models.lora import merged_copy, merged_weights
from tests.models.test_held_base import _pair


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("which", ["plain", "held"])
def test_the_streamed_merge_equals_the_merged_copy_bit_for_bit(tied, which):
    plain, held = _pair(tied)
    model = plain if which == "plain" else held
    expected = merged_copy(model).state_dict()
    got = dict(merged_weights(model))
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name]), name
    base = dict(plain.get_base_model().named_parameters())[
        "model.layers.0.self_attn.q_proj.base_layer.weight"
    ]
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], base)  # the adapter is merged in


def test_the_streamed_merge_makes_no_copy_and_merges_a_layer_when_it_is_taken(monkeypatch):
    plain, _ = _pair()
    monkeypatch.setattr(lora.copy, "deepcopy", lambda *a, **k: pytest.fail("a copy of the model was made"))
    from peft.tuners.lora import Linear

    merged, real = [], Linear.get_delta_weight
    monkeypatch.setattr(Linear, "get_delta_weight", lambda self, a: merged.append(1) or real(self, a))
    stream = merged_weights(plain)
    name, _ = next(stream)
    assert name == "model.embed_tokens.weight" and merged == []  # nothing merged before it is asked for
    names = [name]
    for name, _ in stream:
        names.append(name)
        if name.endswith("q_proj.weight"):
            break
    assert len(merged) == 1  # the first LoRA layer, when its weight was taken
    assert not any(".lora_" in n or ".base_layer." in n for n in names)
