"""The error of one field of one data row, raised while a row is read and turned into a DataError that names
the row's file and line (or row) by whoever knows them (:meth:`rlhfkit.data.records.Records.error`)."""

from __future__ import annotations


class FieldError(Exception):
    """A problem with one field of one record (turned into a DataError with the record's location)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


def type_name(value) -> str:
    """The JSON-ish name of ``value``'s type for a message: ``null`` for None."""
    return "null" if value is None else type(value).__name__
