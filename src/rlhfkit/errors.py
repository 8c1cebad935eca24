"""Errors that are the user's to fix.

Anything raised as a :class:`UserError` is reported by the command line as one clear message with exit
code 2 and no traceback. Every other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input (configuration, data, paths, command line)."""


class ConfigError(UserError):
    """A configuration key that is unknown, wrongly typed or out of range."""


class DataError(UserError):
    """A bad dataset: the message names the file, the line (or row) and the field.

    Args:
        source: file path or dataset name.
        message: what is wrong, in words a user can act on.
        line: 1-based line number (JSON Lines) or 0-based row index (other formats), if known.
        field: the offending field, if any.
        row_kind: ``"line"`` for text files, ``"row"`` for tables and datasets.
    """

    def __init__(
        self,
        source: str,
        message: str,
        line: int | None = None,
        field: str | None = None,
        row_kind: str = "line",
    ):
        self.source, self.line, self.field, self.row_kind = source, line, field, row_kind
        self.message = message
        where = str(source)
        if line is not None:
            where += f", {row_kind} {line}"
        if field is not None:
            where += f", field '{field}'"
        super().__init__(f"{where}: {message}")


class CheckpointError(UserError):
    """A checkpoint that is incomplete or does not match the run resuming from it."""


class RunStopped(Exception):
    """A run that stopped on purpose before its end: it diverged, or a signal asked it to stop.

    Not a user's input mistake, and not a bug: the command line prints the message as one line
    (``rlhfkit: stopped: <message>``) and exits with :attr:`exit_code`, without a traceback.
    """

    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class NonFiniteError(RunStopped):
    """A non-finite loss, gradient norm, reward, value or weight: the run stops before it is saved
    (exit code 3)."""

    exit_code = 3


class GenerationEngineError(RunStopped):
    """The generation engine (``online.generation_backend=vllm``) failed to start, died or ran out of memory
    mid-run, or holds other weights than the actor: the run stops with one line (exit code 4); no checkpoint
    is written or touched, so ``--resume`` continues from the newest one."""

    exit_code = 4


class ProcessLost(RunStopped):
    """Another process of a multi-process run raised, was killed or stopped answering, so a collective of this
    one failed (at once, or after ``train.collective_timeout`` seconds): the process stops with one line
    (exit code 5). Checkpoints are written atomically, so the newest complete one is intact; ``--resume``
    continues from it."""

    exit_code = 5
