"""Model presets for the built-in tasks: standard Llama configurations, built fresh from scratch.

`tiny` (hidden 128, 4 layers, FFN 512, ~1.3M parameters at a vocabulary of ~1,000) is fast on two CPU
cores. `small` (~15M) is for a GPU or for
patience. Dropout is 0 everywhere: the PPO ratio must be exactly 1 before the first update (Huang et al.
2024, "The N+ Implementation Details of RLHF with PPO", detail on disabling dropout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhfkit.errors import ConfigError

if TYPE_CHECKING:  # transformers and torch are imported when a model is built, so that the task's
    # language, gold scorer and annotators import in milliseconds
    from transformers import LlamaConfig, LlamaForCausalLM

MODEL_PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512),
    "small": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536),
}

# Shared by every preset: room for a prompt plus a response of a few hundred tokens, untied input and
# output embeddings (as in the reference), no dropout, Llama's initialisation.
COMMON = dict(
    max_position_embeddings=256,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    initializer_range=0.02,
)


def model_config(preset: str, tokenizer) -> LlamaConfig:
    """The LlamaConfig of a preset for a tokenizer (vocabulary size and bos/eos/pad ids come from it)."""
    from transformers import LlamaConfig

    if preset not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; the presets are {sorted(MODEL_PRESETS)}")
    shape = MODEL_PRESETS[preset]
    return LlamaConfig(
        vocab_size=len(tokenizer),
        num_key_value_heads=shape["num_attention_heads"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
        **COMMON,
    )


def build_causal_lm(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """A freshly initialised causal LM; the initialisation depends only on ``seed`` (the global torch
    RNG is left as it was)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()  # dropout is 0 anyway; trainers call .train() themselves
    return model


def count_parameters(model) -> int:
    """Number of parameters (each shared tensor counted once)."""
    return sum(p.numel() for p in model.parameters())
