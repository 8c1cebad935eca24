"""The run folder every command writes (docs/design.md, "The run folder").

    <output_dir>/
      .rlhfkit          marks the folder as an rlhfkit run (so that --overwrite deletes nothing else)
      config.yaml       the resolved configuration
      metrics.jsonl     one JSON object per logged step, with "step"; flushed line by line
      checkpoints/      step-N/ folders (rlhfkit.engine.checkpoint)
      final/            the trained model as a Hugging Face folder
      summary.json      the figures a person asks first
      tensorboard/      only with logging.tensorboard

Resuming: the newest complete checkpoint is found when the folder is opened; ``metrics.jsonl`` keeps only
the lines with ``step`` <= that checkpoint's step (none when there is no checkpoint), so that after the
run finishes the file equals an uninterrupted run's. For that, a trainer logs everything about step N
(evaluation included) before it saves checkpoint N.

Typical use in a trainer::

    run = RunDir(cfg.output_dir, resume, config=cfg)
    state = load_checkpoint(run.resume_checkpoint, ...) if run.resume_checkpoint else {"step": 0}
    for step in run.progress(range(state["step"] + 1, cfg.train.max_steps + 1), cfg.train.max_steps):
        ...
        run.metrics.log(step, {"loss/policy": loss, ...})
        save_checkpoint(run.checkpoints_dir, step, ...)
    run.write_summary({...})
    run.close()

Safety: one writer per folder, no writes through links, a finished run left as it is.
**One writer**: an exclusive lock on ``<run>/.rlhfkit.lock``, held for the process's life. The lock is ``fcntl.flock`` on an open file, so the operating system releases it when the process ends in
any way (a crash or SIGKILL included): a stale lock never needs removing by hand. The file holds the PID of
the process that holds it, which the refusal names. A second ``rlhfkit`` command on the same folder
(``--resume`` while the run is still going, ``--overwrite`` of a running run) is refused before it reads or
changes anything there. One process may take the lock of the same folder again (in-process tests, a
pipeline's stages). Where ``fcntl`` does not exist (Windows) there is no lock.

The metrics writer, ``summary.json`` and the progress bar are :mod:`rlhfkit.engine.metrics_writer`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from rlhfkit.algos.draw import sampler_record
from rlhfkit.config import ONLINE_KINDS, LoggingConfig, RunConfig, config_to_dict, save_config
from rlhfkit.engine.checkpoint import checkpoint_step, latest_checkpoint, resume_checkpoint
from rlhfkit.engine.metrics_writer import (
    MetricsWriter,
    flatten_dict,
    open_sinks,
    progress_bar,
    read_metrics,
    write_json,
    write_summary_json,
)
from rlhfkit.errors import ConfigError, UserError

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


def held_folders() -> list[Path]:
    """The run folders whose lock this process holds, oldest first."""
    return [Path(key) for key in _held]


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
    path = Path(folder) / "metrics.jsonl"
    if step <= 0 or not path.is_file():
        return {}
    return next((r for r in reversed(read_metrics(path)) if r["step"] == step), {})


RUN_MARKER = ".rlhfkit"
# The rows a run was given in memory (rlhfkit.train(train_dataset=...)), kept beside its config.yaml: written
# once the folder is prepared and before the trainer opens it, so the trainer's check of an empty folder skips it.
INPUTS_DIR = "inputs"
# Keys that a resumed run may change without changing what it computes (up to where the old run stopped).
RESUMABLE_CHANGES = (
    "output_dir",
    "train.max_steps",
    "train.save_steps",
    "train.eval_steps",
    "train.log_steps",
    "train.keep_last_checkpoints",
    "train.collective_timeout",
    "logging.",
)


def prepare_output_dir(path: str | Path, resume: bool = False, overwrite: bool = False) -> Path:
    """Create the run folder, or check that it may be used; the one place that applies --resume / --overwrite.

    An empty or missing folder is always fine (a run's own :data:`INPUTS_DIR` does not count). A non-empty one needs ``resume`` (continue it) or
    ``overwrite`` (delete it and start again); either needs it to be an rlhfkit run folder, so that a typo
    in ``output_dir`` never deletes or writes into someone's files. The folder's lock is taken first
    (:mod:`rlhfkit.engine.folder`: a folder another process is writing is refused), and a folder with a
    symbolic link where rlhfkit writes is refused.
    """
    if resume and overwrite:
        raise UserError("--resume and --overwrite contradict each other; choose one")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"output folder {path} is a file")
    if (path / RUN_MARKER).is_file():  # a run folder: no other process may be using it
        lock_run_folder(path)
    contents = (
        [p for p in path.iterdir() if p.name not in (RUN_MARKER, LOCK_FILE, INPUTS_DIR)]
        if path.is_dir()
        else []
    )
    if contents:
        if not (resume or overwrite):
            raise UserError(
                f"output folder {path} is not empty; pass --resume to continue that run, "
                "--overwrite to start it again, or choose another output_dir"
            )
        if not (path / RUN_MARKER).is_file():
            raise UserError(
                f"output folder {path} is not empty and is not an rlhfkit run folder (it has no "
                f"{RUN_MARKER} file); rlhfkit will not {'delete' if overwrite else 'write into'} it. "
                "Choose another output_dir"
            )
        if overwrite:
            shutil.rmtree(path)
        else:
            refuse_links(path)
    path.mkdir(parents=True, exist_ok=True)
    lock_run_folder(path)
    if not (path / RUN_MARKER).is_file():
        write_json(path / RUN_MARKER, {"wandb_id": uuid.uuid4().hex[:12]})
    return path


class RunDir:
    """An opened run folder: its paths, the metrics writer, the summary and the resume point.

    Args:
        output_dir: the folder (see :func:`prepare_output_dir` for --resume / --overwrite).
        resume: continue from the newest complete checkpoint, if there is one.
        overwrite: delete the folder's contents first.
        config: when given, written as ``config.yaml`` (see :meth:`save_config`) and its ``logging`` section
            chooses the extra sinks (TensorBoard, W&B) and the progress bar.
        main_process: False on the other processes of a multi-process run: they find the resume point
            but write nothing.
        run_info: how the run is launched (:func:`rlhfkit.engine.accel.world_info`), written into
            ``config.yaml``'s run line.

    Attributes:
        resume_checkpoint: the checkpoint folder to load, or None (a fresh start).
        resume_step: that checkpoint's step, or 0.
    """

    def __init__(
        self,
        output_dir: str | Path,
        resume: bool = False,
        overwrite: bool = False,
        *,
        config: RunConfig | None = None,
        main_process: bool = True,
        run_info: Mapping[str, Any] | None = None,
    ):
        self.path = Path(output_dir)
        self.main_process = main_process
        self.run_info = dict(run_info) if run_info else None
        if main_process:
            prepare_output_dir(self.path, resume, overwrite)
        self.checkpoints_dir = self.path / "checkpoints"
        self.final_dir = self.path / "final"
        self.config_path = self.path / "config.yaml"
        self.summary_path = self.path / "summary.json"
        self.resume_checkpoint = resume_checkpoint(self.checkpoints_dir, main_process) if resume else None
        self.resume_step = checkpoint_step(self.resume_checkpoint) if self.resume_checkpoint else 0
        self.logging = config.logging if config is not None else LoggingConfig()
        self.sampler = run_sampler(config) if config is not None else None
        if config is not None:
            self.save_config(config, resume)
        sinks = (
            open_sinks(
                self.path, self.logging, config, self.resume_step if resume else None, self._wandb_id()
            )
            if main_process
            else []
        )
        # Resuming without a checkpoint starts again from step 0, so every old line goes.
        keep_until = (self.resume_step if self.resume_checkpoint else -1) if resume else None
        self.metrics = MetricsWriter(
            self.path / "metrics.jsonl", keep_until=keep_until, sinks=sinks, enabled=main_process
        )

    def save_config(self, cfg: RunConfig, resume: bool = False) -> None:
        """Write ``config.yaml``. When resuming, first refuse changes that would make the run differ."""
        if not self.main_process:
            return
        # Without a checkpoint a resumed run starts again from step 0: any settings may change then.
        if resume and self.config_path.is_file() and getattr(self, "resume_checkpoint", None) is not None:
            import yaml

            old = flatten_dict(yaml.safe_load(self.config_path.read_text()) or {})
            new = flatten_dict(config_to_dict(cfg))
            changed = [
                f"{k}: {old[k]!r} -> {new[k]!r}"
                for k in new
                if k in old and old[k] != new[k] and not k.startswith(RESUMABLE_CHANGES)
            ]
            if changed:
                raise ConfigError(
                    f"{self.config_path}: resuming with other settings would not continue the same "
                    f"run ({'; '.join(changed)}); undo the change, or start a new run with "
                    "--overwrite or another output_dir"
                )
        save_config(cfg, self.config_path, self.run_info)

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        """Write ``summary.json`` (replacing it whole; non-finite numbers become null), with the run's
        ``sampler`` (name and version, :func:`rlhfkit.algos.draw.sampler_record`) when it has a config."""
        if self.main_process:
            extra = {"sampler": self.sampler} if self.sampler is not None else {}
            write_summary_json(self.summary_path, {**summary, **extra})

    def progress(self, iterable: Iterable | None = None, total: int | None = None, desc: str = ""):
        """A progress bar over ``iterable`` that starts at the resume step; see :func:`progress_bar`."""
        return progress_bar(
            iterable,
            total=total,
            desc=desc,
            initial=self.resume_step,
            enabled=self.main_process and self.logging.progress_bar,
        )

    def close(self) -> None:
        self.metrics.close()

    def _wandb_id(self) -> str | None:
        """The W&B run id kept in the folder's marker (so that a resumed run continues the same W&B run)."""
        marker = self.path / RUN_MARKER
        return json.loads(marker.read_text()).get("wandb_id") if marker.is_file() else None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_sampler(cfg: RunConfig) -> dict[str, Any] | None:
    """The sampler a run of ``cfg`` draws its responses with (name and version,
    :func:`rlhfkit.algos.draw.sampler_record`), recorded in ``config.yaml`` and ``summary.json``; None for a
    kind that samples nothing (sft, reward, prm, dpo)."""
    return sampler_record(cfg.online.sampler) if cfg.kind in ONLINE_KINDS else None


def open_run(cfg: RunConfig, accelerator, resume: bool = False, overwrite: bool = False) -> RunDir:
    """Open the run folder for a trainer: the main process prepares it and writes ``config.yaml`` (with the
    run line: processes, launcher, threads) and says on stderr how many processes train; every other
    process waits for that before it looks at the folder."""
    from rlhfkit.engine.accel import announce, auto_precision, world_info
    from rlhfkit.engine.sharded import sharding_mode

    precision = cfg.model.dtype if cfg.model.dtype != "auto" else auto_precision()  # what the report names
    info = {**world_info(accelerator), "sharding": sharding_mode(cfg), "precision": precision}
    sampler = run_sampler(cfg)
    if sampler is not None:
        info["sampler"] = sampler
    main = accelerator.is_main_process
    if main:
        announce(info, cfg.kind)
    run = RunDir(cfg.output_dir, resume, overwrite, config=cfg, main_process=main, run_info=info)
    accelerator.wait_for_everyone()
    if not main and resume:  # found again now that the main process has finished with the folder
        run.resume_checkpoint = resume_checkpoint(run.checkpoints_dir, announce=False)
        run.resume_step = checkpoint_step(run.resume_checkpoint) if run.resume_checkpoint else 0
    return run
