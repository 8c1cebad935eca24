"""Datasets: reading (JSON Lines, JSON, Parquet, ``datasets`` folders and hub names), validation
with errors that name the file, line/row and field, tokenisation, and collators.

The usual path, all before training starts::

    records = load_dataset_records("train.jsonl", "preferences")     # validated dicts
    examples = tokenize_records(records, tokenizer, TokenLimits(max_prompt_length=256, max_length=512))
    batch = PreferenceCollator(tokenizer.pad_token_id)(examples[:8])

or ``prepare_examples(source, kind, tokenizer, limits)`` for the first two steps at once, with the
tokens cached on disk through ``datasets.map`` (:mod:`rlhfkit.data.prepare`); trainers call
``prepare_run_data(cfg.data, kind, tokenizer, limits)`` for the training and held-out examples.
"""

from rlhfkit.config import STANDARD_COLUMNS, check_columns
from rlhfkit.data.collators import (
    IGNORE_INDEX,
    PreferenceCollator,
    PRMCollator,
    PromptCollator,
    SFTCollator,
    pad_sequences,
)
from rlhfkit.data.prepare import (
    Examples,
    prepare_examples,
    prepare_run_data,
    run_sources,
    tokenize_cached,
)
from rlhfkit.data.readers import RawRows, is_hub_source, read_rows
from rlhfkit.data.records import KINDS, Records, load_dataset_records, validate_rows
from rlhfkit.data.tokenize import (
    TokenLimits,
    encode_prompt,
    encode_response,
    render_chat,
    tokenize_preference,
    tokenize_prm,
    tokenize_prompt,
    tokenize_records,
    tokenize_sft,
)

__all__ = [
    "IGNORE_INDEX",
    "KINDS",
    "STANDARD_COLUMNS",
    "Examples",
    "PRMCollator",
    "PreferenceCollator",
    "PromptCollator",
    "RawRows",
    "Records",
    "SFTCollator",
    "TokenLimits",
    "check_columns",
    "encode_prompt",
    "is_hub_source",
    "encode_response",
    "load_dataset_records",
    "pad_sequences",
    "prepare_examples",
    "prepare_run_data",
    "read_rows",
    "run_sources",
    "render_chat",
    "tokenize_preference",
    "tokenize_prm",
    "tokenize_prompt",
    "tokenize_cached",
    "tokenize_records",
    "tokenize_sft",
    "validate_rows",
]
