"""Run-folder safety: one writer per folder, no writes through links, a finished run left as it is.

**One writer**: an exclusive lock on ``<run>/.rlhfkit.lock``, held for the process's life. The lock is ``fcntl.flock`` on an open file, so the operating system releases it when the process ends in
any way (a crash or SIGKILL included): a stale lock never needs removing by hand. The file holds the PID of
the process that holds it, which the refusal names. A second ``rlhfkit`` command on the same folder
(``--resume`` while the run is still going, ``--overwrite`` of a running run) is refused before it reads or
changes anything there. One process may take the lock of the same folder again (in-process tests, a
pipeline's stages). Where ``fcntl`` does not exist (Windows) there is no lock.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO

from rlhfkit.errors import UserError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_FILE = ".rlhfkit.lock"
_held: dict[str, IO[str]] = {}  # resolved folder -> the open, locked file (kept open: the lock lives on)


def lock_run_folder(folder: str | Path) -> None:
    """Take the exclusive lock of run folder ``folder`` (which exists) for the rest of this process.

    Raises:
        UserError: another process holds it; the message names that process's PID.
    """
    if fcntl is None:
        return
    folder = Path(folder)
    key = str(folder.resolve())
    path = folder / LOCK_FILE
    held = _held.get(key)
    if held is not None:
        try:
            if os.fstat(held.fileno()).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                return  # this process holds it already
        except FileNotFoundError:
            pass
        held.close()  # the folder was emptied (--overwrite) and its lock file went with it
        del _held[key]
    if path.is_symlink():
        raise UserError(f"{path} is a symbolic link; remove it (rlhfkit does not write through links)")
    f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open for the process's life)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or "unknown"
        f.close()
        raise UserError(
            f"run folder {folder} is in use by another rlhfkit process (PID {pid}); wait for it to end or "
            "stop it, or choose another output_dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _held[key] = f


def release_locks() -> None:
    """Let go of every run-folder lock this process holds: at the end of a command run in-process
    (:func:`rlhfkit.cli.main`), which for the ``rlhfkit`` program is the end of the process anyway."""
    while _held:
        _held.popitem()[1].close()


def holds_lock(folder: str | Path) -> bool:
    """Whether this process holds the lock of ``folder``."""
    return str(Path(folder).resolve()) in _held


def refuse_links(folder: str | Path) -> None:
    """Refuse a run folder that holds a symbolic link where rlhfkit writes (its top level, ``checkpoints/``
    and the checkpoints in it), so that no write follows a link out of the folder (e.g. a ``final`` link
    to another model's folder would have that model's files overwritten).

    Raises:
        UserError: naming the link and where it points.
    """
    folder = Path(folder)
    places = [folder, folder / "checkpoints"]
    places += [p for p in (folder / "checkpoints").glob("*") if p.is_dir() and not p.is_symlink()]
    for place in places:
        if not place.is_dir() or place.is_symlink() and place != folder:
            continue
        for entry in place.iterdir():
            if entry.is_symlink():
                raise UserError(
                    f"{entry} is a symbolic link (to {os.readlink(entry)}); rlhfkit does not write through "
                    "links in a run folder: remove it, or start the run in another output_dir"
                )


def finished_run(folder: str | Path, max_steps: int) -> int | None:
    """The step a finished run in ``folder`` ended at, or None when there is something left to do.

    A run is finished when its ``final/`` and ``summary.json`` are written and either its summary says it
    stopped early or its newest checkpoint is at ``max_steps`` or beyond (a larger ``train.max_steps``
    continues it). A run killed between its last checkpoint and ``final/`` is not finished: resuming it
    writes what is missing.
    """
    import json

    from rlhfkit.engine.checkpoint import checkpoint_step, latest_checkpoint

    folder = Path(folder)
    try:
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (folder / "final" / "config.json").is_file() or not isinstance(summary, dict):
        return None
    newest = latest_checkpoint(folder / "checkpoints")
    step = checkpoint_step(newest) if newest is not None else None
    if step is not None and (step >= max_steps or summary.get("early_stopped")):
        return step
    return None


def logged_at(folder: str | Path, step: int) -> dict:
    """The ``metrics.jsonl`` record of ``step`` in run folder ``folder`` ({} if none): what a resumed run
    reports as its last figures when it has no step left to train (a kill after the last checkpoint)."""
    from rlhfkit.engine.run import read_metrics

    path = Path(folder) / "metrics.jsonl"
    if step <= 0 or not path.is_file():
        return {}
    return next((r for r in reversed(read_metrics(path)) if r["step"] == step), {})
