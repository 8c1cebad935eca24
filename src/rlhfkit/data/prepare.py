"""Preparing a run's data once: read, validate, tokenise through ``datasets.map`` with an on-disk cache.

Tokenising is the slow part of preparing data (a chat template is rendered three times per conversational
pair), so its result is cached with ``datasets.Dataset.map`` in an Arrow file under the ``datasets`` cache
(``$HF_DATASETS_CACHE/rlhfkit-tokenized/``, see :func:`cache_dir`). The file's name is a hash of everything
the tokens depend on:

- the data: the validated records themselves (so the source's format, its split and ``data.columns`` are
  covered, and an edited file is tokenised again);
- the tokenizer: its vocabulary and rules (the fast tokenizer's serialised form), special tokens and chat
  template (so ``data.chat_template`` is covered);
- the limits (``max_prompt_length``, ``max_length``, ``truncation``, the PRM step separator), the record
  kind and :data:`CACHE_VERSION` (raised whenever the tokenisation rules change).

Reading and validating are not cached: they are fast, and a DataError must name the row every time. A
record that fails to tokenise is stored with its error, so that a cached run raises the same DataError.
``data.num_proc`` workers tokenise in parallel (``map(num_proc=...)``); with several processes the main
process prepares first and the others read its cache (:func:`prepare_run_data`).
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from rlhfkit.data.records import FieldError, Kind, Records, load_dataset_records
from rlhfkit.data.tokenize import TOKENIZERS, TokenLimits

# Raise when the tokens of a record change for the same inputs (a new rule in rlhfkit.data.tokenize).
CACHE_VERSION = 3
# The columns each kind's tokenised examples have (besides the error columns); "record" is not stored.
_COLUMNS = {
    "prompts": {"prompt_ids": "ids"},
    "sft": {"prompt_ids": "ids", "completion_ids": "ids", "completion_skip": "ids"},
    "preferences": {"prompt_ids": "ids", "chosen_ids": "ids", "rejected_ids": "ids", "margin": "float"},
    "prm": {"prompt_ids": "ids", "completion_ids": "ids", "step_ends": "ids", "labels": "bools"},
}
# Below this many records the datasets progress bar stays off (it would only flash by).
_QUIET_BELOW = 2000


class Examples(list):
    """Tokenised examples (one dict per record, as :mod:`rlhfkit.data.tokenize` describes), with:

    Attributes:
        records: the validated records they come from (prompt examples also hold theirs as ``"record"``).
        cache_file: the Arrow file of the tokenisation cache.
        from_cache: True when the tokens were read from that file instead of computed.
    """

    def __init__(self, examples: list[dict], records: Records, cache_file: str, from_cache: bool):
        super().__init__(examples)
        self.records, self.cache_file, self.from_cache = records, cache_file, from_cache


def cache_dir() -> Path:
    """Where tokenised datasets are cached: ``rlhfkit-tokenized/`` in the ``datasets`` cache
    (``$HF_DATASETS_CACHE``, by default ``~/.cache/huggingface/datasets``)."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "rlhfkit-tokenized"


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything about ``tokenizer`` that changes token ids or rendered chat text."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:  # a slow tokenizer: hash the object as datasets fingerprints a map function's closure
        from datasets.fingerprint import Hasher

        digest.update(Hasher.hash(tokenizer).encode())
    about = {
        "class": type(tokenizer).__name__,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "add_bos": getattr(tokenizer, "add_bos_token", None),
        "add_eos": getattr(tokenizer, "add_eos_token", None),
    }
    digest.update(json.dumps(about, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def cache_key(records: Records, tokenizer, limits: TokenLimits) -> str:
    """The cache file's key: a hash of the records, the tokenizer (with its template), the limits, the kind."""
    from rlhfkit import __version__

    digest = hashlib.sha256()
    for part in (
        f"v{CACHE_VERSION}",
        __version__,
        records.kind,
        repr(limits),
        tokenizer_fingerprint(tokenizer),
    ):
        digest.update(part.encode() + b"\0")
    digest.update(json.dumps(list(records), sort_keys=True, ensure_ascii=False, default=str).encode())
    return digest.hexdigest()[:32]


def _features(kind: str):
    import datasets

    types = {
        "ids": datasets.Sequence(datasets.Value("int64")),
        "float": datasets.Value("float64"),
        "bools": datasets.Sequence(datasets.Value("bool")),
    }
    columns = {name: types[t] for name, t in _COLUMNS[kind].items()}
    return datasets.Features(
        {**columns, "error": datasets.Value("string"), "error_field": datasets.Value("string")}
    )


def _tokenize_batch(
    batch: dict[str, list], records: list[dict], tokenizer, limits: TokenLimits, kind: str
) -> dict[str, list]:
    """The ``datasets.map`` function: tokenise the records at ``batch["index"]``; errors become columns."""
    out: dict[str, list] = {name: [] for name in [*_COLUMNS[kind], "error", "error_field"]}
    for index in batch["index"]:
        try:
            example, error, field = TOKENIZERS[kind](records[index], tokenizer, limits), None, None
        except FieldError as e:
            example, error, field = {}, e.message, e.field
        for name, t in _COLUMNS[kind].items():
            out[name].append(example.get(name, None if t == "float" else []))
        out["error"].append(error)
        out["error_field"].append(field)
    return out


def tokenize_cached(
    records: Records,
    tokenizer,
    limits: TokenLimits | None = None,
    num_proc: int | None = None,
    directory: str | os.PathLike | None = None,
) -> Examples:
    """:func:`rlhfkit.data.tokenize_records` through ``datasets.map``, cached on disk (module docstring).

    Args:
        records: validated records.
        tokenizer: a transformers tokenizer with an EOS token.
        limits: the length limits (default: none).
        num_proc: tokenisation worker processes (None or 1: this process).
        directory: the cache folder (default :func:`cache_dir`).
    Raises:
        DataError: naming the first record that cannot be tokenised (also when read from the cache).
    """
    import datasets

    limits = limits or TokenLimits()
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token (load it with rlhfkit.models.load_tokenizer)")
    folder = Path(directory) if directory is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    key = cache_key(records, tokenizer, limits)
    path = folder / f"{records.kind}-{key}.arrow"
    workers = num_proc if num_proc and num_proc > 1 and len(records) > 1 else None
    from_cache = _cached(path, workers)
    quiet = len(records) < _QUIET_BELOW and datasets.is_progress_bar_enabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        index = datasets.Dataset.from_dict({"index": list(range(len(records)))})
        tokenized = index.map(
            _tokenize_batch,
            batched=True,
            batch_size=256,
            num_proc=workers,
            remove_columns=["index"],
            fn_kwargs={
                "records": list(records),
                "tokenizer": tokenizer,
                "limits": limits,
                "kind": records.kind,
            },
            features=_features(records.kind),
            cache_file_name=str(path),
            load_from_cache_file=True,
            new_fingerprint=key,
            desc=f"Tokenising {os.path.basename(records.source)}",
        )
    finally:
        if quiet:
            datasets.enable_progress_bars()
    columns = tokenized[:]  # one dict of lists: a single read of the Arrow table
    for i, error in enumerate(columns["error"]):
        if error is not None:
            raise records.error(i, error, field=columns["error_field"][i])
    names = list(_COLUMNS[records.kind])
    examples = []
    for i, values in enumerate(zip(*(columns[name] for name in names), strict=True)):
        example = dict(zip(names, values, strict=True))
        if records.kind == "preferences" and example["margin"] is None:
            del example["margin"]
        if records.kind == "sft" and not example["completion_skip"]:  # as tokenize_sft gives it: absent
            del example["completion_skip"]
        if records.kind == "prompts":
            example["record"] = records[i]
        examples.append(example)
    return Examples(examples, records, str(path), from_cache)


def _cached(path: Path, workers: int | None) -> bool:
    """Whether ``map`` will read ``path`` (or, with workers, every shard of it) instead of tokenising."""
    if path.is_file():
        return True
    if workers:
        shards = [
            path.with_name(f"{path.stem}_{rank:05d}_of_{workers:05d}{path.suffix}") for rank in range(workers)
        ]
        return all(shard.is_file() for shard in shards)
    return False


def prepare_examples(
    source: str | os.PathLike,
    kind: Kind,
    tokenizer,
    limits: TokenLimits | None = None,
    split: str | None = "train",
    *,
    columns: dict | None = None,
    num_proc: int | None = None,
    split_key: str = "data.train_split",
    dataset_config: str | None = None,
) -> Examples:
    """Read, validate and tokenise a whole dataset up front (tokens cached: :func:`tokenize_cached`), so that
    bad data stops a run before training."""
    records = load_dataset_records(source, kind, split, columns, split_key, dataset_config)
    return tokenize_cached(records, tokenizer, limits, num_proc)


def run_sources(data_cfg: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Where a run's ``data`` section reads its training and held-out rows: the keywords of
    :func:`load_dataset_records` (``source``, ``split``, ``split_key``, ``dataset_config``) for each; None for
    no held-out data.

    Training: ``data.train_file``, split ``data.train_split``. Evaluation: ``data.eval_file`` (split
    ``data.eval_split``, or its only split when that is unset: a dataset with several splits is an error
    that names them, never a silent choice of ``train``); with no ``eval_file``, ``data.eval_split`` of the
    training dataset; neither: no evaluation. ``data.dataset_config`` applies to the training dataset, and to
    ``eval_file`` when it names the same dataset.
    """
    config = data_cfg.dataset_config
    train = {
        "source": data_cfg.train_file,
        "split": data_cfg.train_split,
        "split_key": "data.train_split",
        "dataset_config": config,
    }
    if data_cfg.eval_file:
        same = data_cfg.eval_file == data_cfg.train_file
        return train, {
            "source": data_cfg.eval_file,
            "split": data_cfg.eval_split,
            "split_key": "data.eval_split",
            "dataset_config": config if same else None,
        }
    if data_cfg.eval_split:
        if data_cfg.eval_split == data_cfg.train_split:
            from rlhfkit.errors import ConfigError

            raise ConfigError(
                f"data.eval_split: '{data_cfg.eval_split}' is also data.train_split; evaluating "
                "on the training rows measures nothing"
            )
        return train, {**train, "split": data_cfg.eval_split, "split_key": "data.eval_split"}
    return train, None


def prepare_run_data(
    data_cfg: Any, kind: Kind, tokenizer, limits: TokenLimits, accelerator: Any = None
) -> tuple[Examples, Examples | None]:
    """The training and evaluation examples of a run's ``data`` section, read from :func:`run_sources`
    (``data.columns`` applies to both). With ``accelerator``, the main process prepares first and the others
    then read its cache.
    """
    options = {"columns": data_cfg.columns, "num_proc": data_cfg.num_proc}
    train_source, heldout_source = run_sources(data_cfg)
    with accelerator.main_process_first() if accelerator is not None else nullcontext():
        train = prepare_examples(kind=kind, tokenizer=tokenizer, limits=limits, **train_source, **options)
        heldout = None
        if heldout_source is not None:
            heldout = prepare_examples(
                kind=kind, tokenizer=tokenizer, limits=limits, **heldout_source, **options
            )
    return train, heldout
