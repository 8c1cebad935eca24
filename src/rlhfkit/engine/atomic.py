"""Whole-file writes that a crash cannot leave half done.

A file is written next to its destination as ``<name>.tmp`` and renamed over it (``os.replace``, atomic on
POSIX and Windows within one folder): a reader, or a run resumed after a kill, sees the old file or the new
one, never a truncated one. A crash between the two steps leaves at most a stale ``<name>.tmp``, which the
next write of the same file overwrites.

No fsync here: these files (metrics, summaries, the resolved config, the best model of a reward run) are
rewritten on the next run or resume. Checkpoints, which a resume trusts, use their own folder-level
protocol with fsync and a checksummed completion marker (:func:`rlhfkit.engine.checkpoint.save_checkpoint`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def temporary_path(path: Path) -> Path:
    """Where :func:`atomic_write` writes ``path`` before renaming it: ``<name>.tmp`` in the same folder."""
    return path.with_name(path.name + ".tmp")


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` to write the whole file at a temporary path, then rename it to ``path``."""
    path = Path(path)
    tmp = temporary_path(path)
    write(tmp)
    os.replace(tmp, path)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` by ``text`` in one step (:func:`atomic_write`)."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding=encoding))
