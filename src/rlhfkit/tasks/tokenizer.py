"""Train a task's tokenizer with the `tokenizers` library and save it as a Hugging Face folder.

Byte-level BPE (the GPT-2 scheme, Radford et al. 2019): the 256 byte symbols plus merges learnt on the
task's text, run until no pair is left to merge, so every word of a task's language becomes one token
while any other text still encodes (as bytes) and ``decode(encode(x)) == x`` for every string. Special
tokens: ``<pad>`` (distinct from EOS, so that last-token pooling and EOS masking cannot confuse the two;
docs/known-bugs.md, 2 and 3), ``<bos>`` (added in front of every encoded text, as Llama
tokenizers do) and ``<eos>`` (never added by the tokenizer: the trainers append it to completions).
"""

from __future__ import annotations

from pathlib import Path

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = [PAD, BOS, EOS]


def train_tokenizer(texts: list[str], max_vocab_size: int = 1024):
    """Train a byte-level BPE tokenizer on ``texts``; returns a ``PreTrainedTokenizerFast``.

    Training is deterministic for the same texts. ``max_vocab_size`` caps the vocabulary (special tokens
    and the 256 bytes included); training stops earlier when no pair is left to merge.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max_vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=256,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer, out_dir: str | Path):
    """Save as a folder that ``AutoTokenizer.from_pretrained(out_dir)`` loads; returns the tokenizer."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
