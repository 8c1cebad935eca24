"""Reading raw rows from JSON Lines, JSON, Parquet and Hugging Face ``datasets`` sources.

Every row comes back with its location, so that later errors can name it: the 1-based line
number for JSON Lines, the 0-based row index for the other formats (rlhfkit.errors.DataError).
Nothing is validated here beyond "each row is an object".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from rlhfkit.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
PARQUET_SUFFIXES = (".parquet", ".pq")
FILE_SUFFIXES = JSONL_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES


@dataclass
class RawRows:
    """Rows of one source before validation.

    Attributes:
        source: the file, folder or hub name as the user gave it.
        rows: one dict per row.
        locations: where each row is: a line (1-based) or a row index (0-based).
        row_kind: ``"line"`` or ``"row"``.
    """

    source: str
    rows: list = field(default_factory=list)
    locations: list = field(default_factory=list)
    row_kind: str = "row"

    def error(self, index: int, message: str, field: str | None = None) -> DataError:
        """A DataError for row ``index`` (a position in ``rows``)."""
        return DataError(
            self.source, message, line=self.locations[index], field=field, row_kind=self.row_kind
        )


def read_rows(
    source: str | os.PathLike,
    split: str | None = "train",
    split_key: str = "data.train_split",
    config: str | None = None,
) -> RawRows:
    """Read every row of ``source``.

    Args:
        source: a ``.jsonl``/``.ndjson``, ``.json`` (a list of objects, or JSON Lines), ``.parquet``
            file; a folder written by ``datasets.save_to_disk``; a dataset repository folder (data files,
            and a README.md whose ``configs:`` name its configurations) or a hub dataset name, both read
            by ``datasets.load_dataset(source, config)``.
        split: the split to take from a ``DatasetDict`` folder or a hub dataset; None = its only split
            (a DataError names the splits when there are several). A single file or ``Dataset`` has no
            splits: it is read for ``"train"`` (the default) and None, and any other name is a DataError.
        split_key: the configuration key that set ``split``, named in those errors.
        config: the dataset's configuration name (``data.dataset_config``, e.g. ``"main"`` for
            ``openai/gsm8k``); None = its only or default one (a DataError names them when it must be
            chosen). Only a repository folder or a hub dataset has configurations.
    """
    source = os.fspath(source)
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        if _saved_to_disk(path):
            _no_configs(source, config, "a folder written by save_to_disk")
        elif config is not None or os.path.isfile(os.path.join(path, "README.md")):
            # a dataset repository (e.g. a hub dataset's clone): its data files, its card's configurations
            return _read_hub(source, split, split_key, config, where=path)
        return _read_datasets_folder(source, path, split, split_key)
    lower = path.lower()
    if not is_hub_source(source):
        if not os.path.exists(path):
            raise DataError(source, "file not found")
        if not lower.endswith(FILE_SUFFIXES):
            raise DataError(source, "unsupported file type: use .jsonl, .json, .parquet or a datasets folder")
        _no_splits(source, split, split_key)
        _no_configs(source, config, "one file")
        if lower.endswith(PARQUET_SUFFIXES):
            return _read_parquet(source, path)
        return _read_json(source, path, lines=lower.endswith(JSONL_SUFFIXES))
    return _read_hub(source, split, split_key, config)


def is_hub_source(source: str | os.PathLike) -> bool:
    """Whether :func:`read_rows` reads ``source`` from the Hub (``datasets.load_dataset`` of a name): it is no
    local file or folder, has no data file's suffix and does not start like a path (``.``, ``/``, ``~``)."""
    path = os.path.expanduser(os.fspath(source))
    local = os.path.exists(path) or path.lower().endswith(FILE_SUFFIXES) or path.startswith((".", "/", "~"))
    return not local


def _saved_to_disk(path: str) -> bool:
    return any(
        os.path.exists(os.path.join(path, name)) for name in ("dataset_info.json", "dataset_dict.json")
    )


def _no_configs(source: str, config: str | None, what: str) -> None:
    if config is not None:
        raise DataError(
            source,
            f"is {what}, which has no configurations, so data.dataset_config='{config}' cannot be taken "
            "from it; configurations come with a hub dataset or a dataset repository folder (remove "
            "data.dataset_config)",
        )


def _no_splits(source: str, split: str | None, split_key: str) -> None:
    if split not in (None, "train"):
        raise DataError(
            source,
            f"is one table with no splits, so {split_key}='{split}' cannot be taken from it; "
            "splits come with a DatasetDict folder or a hub dataset (or give the held-out "
            "rows as their own file in data.eval_file)",
        )


def _read_text(source: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except UnicodeDecodeError as error:
        raise DataError(source, f"not UTF-8 text ({error.reason} at byte {error.start})") from error
    except OSError as error:
        raise DataError(source, f"cannot read the file: {error.strerror or error}") from error


def _read_json(source: str, path: str, lines: bool) -> RawRows:
    text = _read_text(source, path)
    if not lines and text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(source, f"not valid JSON: {error.msg}", line=error.lineno) from error
        return _check_objects(RawRows(source, data, list(range(len(data))), "row"))
    if not lines and len([line for line in text.splitlines() if line.strip()]) > 1:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # not one JSON document: read it as JSON Lines below
        if data is not None:
            raise DataError(
                source,
                f"a .json file must hold a list of objects (or JSON Lines), not one {type(data).__name__}",
            )
    # JSON Lines (also accepted in a .json file that does not start with '['); blank lines skipped.
    out = RawRows(source, row_kind="line")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise DataError(
                source, f"not valid JSON: {error.msg} (column {error.colno})", line=number
            ) from error
        out.locations.append(number)
    return _check_objects(out)


def _check_objects(raw: RawRows) -> RawRows:
    for index, row in enumerate(raw.rows):
        if not isinstance(row, dict):
            raise raw.error(index, f"expected a JSON object, got {type(row).__name__}")
    return raw


def _read_parquet(source: str, path: str) -> RawRows:
    import pyarrow
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except (OSError, pyarrow.ArrowException) as error:
        raise DataError(source, f"cannot read the Parquet file: {error}") from error
    return RawRows(source, rows, list(range(len(rows))), "row")


def _read_datasets_folder(source: str, path: str, split: str | None, split_key: str) -> RawRows:
    if not _saved_to_disk(path):
        raise DataError(
            source,
            "not a datasets folder (no dataset_info.json or dataset_dict.json) nor a dataset repository "
            "(no README.md); give a .jsonl/.json/.parquet file, a folder from Dataset.save_to_disk, or a "
            "dataset repository folder",
        )
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except (OSError, ValueError, FileNotFoundError) as error:
        raise DataError(source, f"cannot load the datasets folder: {error}") from error
    return _dataset_rows(source, loaded, split, split_key)


def _read_hub(
    source: str, split: str | None, split_key: str, config: str | None, where: str | None = None
) -> RawRows:
    """A hub dataset, or (``where``) a local dataset repository folder, through ``datasets.load_dataset``."""
    import datasets

    path = where or source
    try:  # every split, so that a missing one can be named beside those that exist
        loaded = datasets.load_dataset(path) if config is None else datasets.load_dataset(path, config)
    except Exception as error:  # the hub client raises many types (network, auth, missing repo)
        names = _config_names(path)
        if names and (config is None or config not in names):
            problem = f"has no configuration '{config}'" if config else "has several configurations"
            raise DataError(
                source, f"{problem} ({', '.join(names)}); set data.dataset_config to one of them"
            ) from error
        what = (
            "a folder that is not from save_to_disk (no dataset_info.json or dataset_dict.json), and "
            "datasets.load_dataset could not read it as a dataset repository"
            if where
            else "not a local file or folder, and loading it from the hub failed"
        )
        raise DataError(source, f"{what}: {' '.join(str(error).split())}") from error
    return _dataset_rows(source, loaded, split, split_key)


def _config_names(path: str) -> list[str]:
    """The configuration names of a hub dataset or repository folder; [] when they cannot be read."""
    import datasets

    try:
        return list(datasets.get_dataset_config_names(path))
    except Exception:  # offline, no such dataset: the load's own error is the one to report
        return []


def _dataset_rows(source: str, loaded, split: str | None, split_key: str) -> RawRows:
    if hasattr(loaded, "keys") and not hasattr(loaded, "features"):  # a DatasetDict
        names = list(loaded.keys())
        if split is None:
            if len(names) != 1:
                raise DataError(source, f"has splits {', '.join(names)}: set {split_key} to the one to use")
            split = names[0]
        if split not in loaded:
            raise DataError(
                source, f"no split '{split}' (splits: {', '.join(names)}); set {split_key} to one of them"
            )
        loaded = loaded[split]
    else:
        _no_splits(source, split, split_key)
    rows = loaded.to_list()
    return RawRows(source, rows, list(range(len(rows))), "row")
