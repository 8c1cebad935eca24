"""Shared test builders: a tiny word-level tokenizer and tiny random Llama / GPT-2 models.

Other tests may import it (``from helpers import ...``: pytest puts ``tests/`` on ``sys.path`` through
its conftest). Everything is built locally in well under a second; nothing is downloaded.
"""

from __future__ import annotations

import torch

WORDS = (
    "hello world the cat sat on a mat dog ran fast slow good bad yes no one two three four five "
    "six seven eight nine ten . , ? ! : user assistant system"
).split()
SPECIALS = ["<unk>", "<s>", "</s>"]

# A minimal chat template: "<s> user : hi \n assistant : hello </s> ..." (word-level friendly).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %} {{ m['role'] }} : {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %} {{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} assistant :{% endif %}"
)


def tiny_tokenizer(pad: str | None = "<pad>", chat_template: bool = False):
    """A word-level tokenizer over WORDS that prepends BOS.

    Args:
        pad: ``"<pad>"`` (a distinct pad token), ``"eos"`` (pad == EOS) or None (no pad token).
        chat_template: set :data:`CHAT_TEMPLATE`.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(SPECIALS + ["<pad>"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    kwargs = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if pad == "<pad>":
        kwargs["pad_token"] = "<pad>"
    elif pad == "eos":
        kwargs["pad_token"] = "</s>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama_config(vocab_size: int = 48, **overrides):
    """A 2-layer Llama config with hidden size 32 (about 20k parameters)."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_llama(kind: str = "causal", seed: int = 0, **overrides):
    """A random tiny Llama: ``kind`` is ``"causal"`` or ``"scalar"`` (sequence classifier, 1 label)."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)
    if kind == "causal":
        model = LlamaForCausalLM(tiny_llama_config(**overrides))
    else:
        model = LlamaForSequenceClassification(tiny_llama_config(num_labels=1, **overrides))
    return model.eval()


def tiny_gpt2(kind: str = "causal", seed: int = 0, **overrides):
    """A random tiny GPT-2 (absolute positions, so left padding matters without position ids)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=48,
        n_positions=128,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    fields.update(overrides)
    if kind == "causal":
        return GPT2LMHeadModel(GPT2Config(**fields)).eval()
    return GPT2ForSequenceClassification(GPT2Config(num_labels=1, **fields)).eval()


# Token-id texts for scoring tests: different lengths, EOS (2) inside a text and at its end.
TEXTS_FOR_SCORES = [
    [1, 5, 6, 7, 8, 2],
    [1, 9, 2, 10, 11, 12, 13, 14, 2],
    [1, 15, 2],
    [1, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 2],
]


def pad_batch(rows: list[list[int]], pad_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token-id lists to (B, L) ids and attention mask, on the given side."""
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        cols = slice(0, len(row)) if side == "right" else slice(length - len(row), length)
        ids[i, cols] = torch.tensor(row, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask
