"""Tiny random-initialised configurations of the architectures people bring, built offline.

Each entry is a transformers config class name and the fields that make it tiny (hidden size 16, two layers,
two heads). :func:`write_tiny_model` saves a causal LM of one of them, with a small byte-level BPE tokenizer
(:func:`bpe_tokenizer`), to a folder as a user would bring it. (transformers 5 loads some model types' folders
with their own tokenizer class, e.g. Qwen2Tokenizer, which rebuilds a byte-level BPE from the saved vocabulary
and merges: the tests' word-level tokenizer does not survive that, a byte-level BPE does.)
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tests.helpers import SPECIALS, WORDS

_DECODER = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)

ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "gpt2": ("GPT2Config", dict(n_embd=16, n_layer=2, n_head=2, n_positions=64)),
    "llama": ("LlamaConfig", _DECODER),
    "qwen2": ("Qwen2Config", _DECODER),
    "qwen3": ("Qwen3Config", dict(_DECODER, head_dim=8)),
    "mistral": ("MistralConfig", dict(_DECODER, head_dim=8)),
    "gemma": ("GemmaConfig", dict(_DECODER, head_dim=8)),
    # Gemma 2/3 soft-cap their logits (cap * tanh(logits / cap)); Granite, Cohere and FalconH1 scale them by a
    # config value, set away from its default here so that a read-out that misses the scale is visibly off
    "gemma2": ("Gemma2Config", dict(_DECODER, head_dim=8, sliding_window=4, final_logit_softcapping=30.0)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(_DECODER, head_dim=8, sliding_window=4, final_logit_softcapping=30.0),
    ),
    "granite": ("GraniteConfig", dict(_DECODER, logits_scaling=4.0)),
    "cohere": ("CohereConfig", dict(_DECODER, logit_scale=0.25)),
    "falcon_h1": (
        "FalconH1Config",
        dict(
            _DECODER,
            head_dim=8,
            mamba_d_ssm=16,
            mamba_n_heads=2,
            mamba_d_head=8,
            mamba_d_state=4,
            mamba_n_groups=1,
            mamba_chunk_size=4,
            lm_head_multiplier=0.25,
        ),
    ),
    "phi3": ("Phi3Config", _DECODER),
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
        ),
    ),
    "opt": (
        "OPTConfig",
        dict(
            hidden_size=16,
            ffn_dim=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            word_embed_proj_dim=16,
            max_position_embeddings=64,
            layerdrop=0.5,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(_DECODER, **_MOE, num_experts=4, shared_expert_intermediate_size=16),
    ),
    # The train-mode randomness that is not dropout, turned up so that a tiny model shows it: Mixtral's router
    # jitter, PhiMoE's sampled expert choice (its jitter sets how close two experts must be to be sampled
    # between), OPT's layerdrop. The PPO update must not switch it on (rlhfkit.models.set_update_mode).
    "mixtral": (
        "MixtralConfig",
        dict(_DECODER, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1),
    ),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_DECODER, **_MOE, num_experts=4, head_dim=8)),
    "phimoe": (
        "PhimoeConfig",
        dict(_DECODER, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5),
    ),
}


@functools.lru_cache(maxsize=1)
def _bpe_backend():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        special_tokens=[*SPECIALS, "<pad>"],
        vocab_size=400,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator([" ".join(WORDS)] * 20 + [" " + w for w in WORDS] * 20, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    return backend.to_str()


def bpe_tokenizer(pad: str | None = "<pad>"):
    """A byte-level BPE tokenizer trained on the tests' words (about 350 tokens) that prepends BOS.

    Args:
        pad: ``"<pad>"`` (a distinct pad token), ``"eos"`` (pad == EOS) or None (no pad token).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    kwargs = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if pad is not None:
        kwargs["pad_token"] = "</s>" if pad == "eos" else pad
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_bpe_backend()), **kwargs)


def tiny_config(name: str, tokenizer, **overrides):
    """The tiny config of architecture ``name`` for ``tokenizer``'s vocabulary and special tokens."""
    import transformers

    class_name, fields = ARCHITECTURES[name]
    ids = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return getattr(transformers, class_name)(**{**fields, **ids, **overrides})


def write_tiny_model(name: str, folder: Path, pad: str | None = "<pad>", seed: int = 0, **overrides) -> Path:
    """Save a random tiny causal LM of architecture ``name`` and its tokenizer to ``folder``."""
    from transformers import AutoModelForCausalLM

    tokenizer = bpe_tokenizer(pad=pad)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, tokenizer, **overrides))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
