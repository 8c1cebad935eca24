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
    source: str | os.PathLike, split: str | None = "train", split_key: str = "data.train_split"
) -> RawRows:
    """Read every row of ``source``.

    Args:
        source: a ``.jsonl``/``.ndjson``, ``.json`` (a list of objects, or JSON Lines), ``.parquet``
            file; a folder written by ``datasets.save_to_disk``; or a hub dataset name.
        split: the split to take from a ``DatasetDict`` folder or a hub dataset; None = its only split
            (a DataError names the splits when there are several). A single file or ``Dataset`` has no
            splits: it is read for ``"train"`` (the default) and None, and any other name is a DataError.
        split_key: the configuration key that set ``split``, named in those errors.
    """
    source = os.fspath(source)
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return _read_datasets_folder(source, path, split, split_key)
    lower = path.lower()
    if os.path.exists(path) or lower.endswith(FILE_SUFFIXES) or path.startswith((".", "/", "~")):
        if not os.path.exists(path):
            raise DataError(source, "file not found")
        if not lower.endswith(FILE_SUFFIXES):
            raise DataError(source, "unsupported file type: use .jsonl, .json, .parquet or a datasets folder")
        _no_splits(source, split, split_key)
        if lower.endswith(PARQUET_SUFFIXES):
            return _read_parquet(source, path)
        return _read_json(source, path, lines=lower.endswith(JSONL_SUFFIXES))
    return _read_hub(source, split, split_key)


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
    if not any(
        os.path.exists(os.path.join(path, name)) for name in ("dataset_info.json", "dataset_dict.json")
    ):
        raise DataError(
            source,
            "not a datasets folder (no dataset_info.json or dataset_dict.json); "
            "give a .jsonl/.json/.parquet file or a folder from Dataset.save_to_disk",
        )
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except (OSError, ValueError, FileNotFoundError) as error:
        raise DataError(source, f"cannot load the datasets folder: {error}") from error
    return _dataset_rows(source, loaded, split, split_key)


def _read_hub(source: str, split: str | None, split_key: str) -> RawRows:
    import datasets

    try:  # every split, so that a missing one can be named beside those that exist
        loaded = datasets.load_dataset(source)
    except Exception as error:  # the hub client raises many types (network, auth, missing repo)
        raise DataError(
            source, f"not a local file or folder, and loading it from the hub failed: {error}"
        ) from error
    return _dataset_rows(source, loaded, split, split_key)


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
