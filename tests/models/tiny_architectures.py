"""Tiny random-initialised configurations of the architectures people bring, built offline.

Each entry is a transformers config class name and the fields that make it tiny (hidden size 16, one or two
layers, two heads). :func:`write_tiny_model` saves a causal LM of one of them, with the tests' word-level
tokenizer, to a folder as a user would bring it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import tiny_tokenizer

_DECODER = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)

ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "gpt2": ("GPT2Config", dict(n_embd=16, n_layer=2, n_head=2, n_positions=64)),
    "llama": ("LlamaConfig", _DECODER),
    "qwen2": ("Qwen2Config", _DECODER),
    "qwen3": ("Qwen3Config", dict(_DECODER, head_dim=8)),
    "mistral": ("MistralConfig", dict(_DECODER, head_dim=8)),
    "gemma": ("GemmaConfig", dict(_DECODER, head_dim=8)),
    "gemma2": ("Gemma2Config", dict(_DECODER, head_dim=8, sliding_window=4)),
    "gemma3": ("Gemma3TextConfig", dict(_DECODER, head_dim=8, sliding_window=4)),
    "phi3": ("Phi3Config", _DECODER),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, max_position_embeddings=64)),
    "opt": ("OPTConfig", dict(hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
                              word_embed_proj_dim=16, max_position_embeddings=64)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_DECODER, **_MOE, num_experts=4, shared_expert_intermediate_size=16)),
    "mixtral": ("MixtralConfig", dict(_DECODER, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_DECODER, **_MOE, num_experts=4, head_dim=8)),
    "phimoe": ("PhimoeConfig", dict(_DECODER, num_local_experts=4, num_experts_per_tok=2)),
}


def tiny_config(name: str, tokenizer, **overrides):
    """The tiny config of architecture ``name`` for ``tokenizer``'s vocabulary and special tokens."""
    import transformers

    class_name, fields = ARCHITECTURES[name]
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    return getattr(transformers, class_name)(**{**fields, **ids, **overrides})


def write_tiny_model(name: str, folder: Path, pad: str | None = "<pad>", seed: int = 0, **overrides) -> Path:
    """Save a random tiny causal LM of architecture ``name`` and its tokenizer to ``folder``."""
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer(pad=pad)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, tokenizer, **overrides))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
