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
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhfkit.config import LoggingConfig, RunConfig, config_to_dict, save_config
from rlhfkit.engine.atomic import atomic_write_text
from rlhfkit.engine.checkpoint import checkpoint_step, resume_checkpoint
from rlhfkit.engine.folder import LOCK_FILE, lock_run_folder, refuse_links
from rlhfkit.errors import ConfigError, UserError

RUN_MARKER = ".rlhfkit"
# Keys that a resumed run may change without changing what it computes (up to where the old run stopped).
RESUMABLE_CHANGES = (
    "output_dir",
    "train.max_steps",
    "train.save_steps",
    "train.eval_steps",
    "train.log_steps",
    "train.keep_last_checkpoints",
    "logging.",
)


def prepare_output_dir(path: str | Path, resume: bool = False, overwrite: bool = False) -> Path:
    """Create the run folder, or check that it may be used; the one place that applies --resume / --overwrite.

    An empty or missing folder is always fine. A non-empty one needs ``resume`` (continue it) or
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
    contents = [p for p in path.iterdir() if p.name not in (RUN_MARKER, LOCK_FILE)] if path.is_dir() else []
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
        _write_json(path / RUN_MARKER, {"wandb_id": uuid.uuid4().hex[:12]})
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
        if config is not None:
            self.save_config(config, resume)
        sinks = (
            _open_sinks(self.path, self.logging, config, self.resume_step if resume else None)
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
        """Write ``summary.json`` (replacing it whole; non-finite numbers become null)."""
        if self.main_process:
            write_summary_json(self.summary_path, summary)

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

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_run(cfg: RunConfig, accelerator, resume: bool = False, overwrite: bool = False) -> RunDir:
    """Open the run folder for a trainer: the main process prepares it and writes ``config.yaml`` (with the
    run line: processes, launcher, threads) and says on stderr how many processes train; every other
    process waits for that before it looks at the folder."""
    from rlhfkit.engine.accel import announce, world_info
    from rlhfkit.engine.sharded import sharding_mode

    info = {**world_info(accelerator), "sharding": sharding_mode(cfg)}
    main = accelerator.is_main_process
    if main:
        announce(info, cfg.kind)
    run = RunDir(cfg.output_dir, resume, overwrite, config=cfg, main_process=main, run_info=info)
    accelerator.wait_for_everyone()
    if not main and resume:  # found again now that the main process has finished with the folder
        run.resume_checkpoint = resume_checkpoint(run.checkpoints_dir, announce=False)
        run.resume_step = checkpoint_step(run.resume_checkpoint) if run.resume_checkpoint else 0
    return run


class MetricsWriter:
    """Appends ``{"step": step, **metrics}`` to ``metrics.jsonl``, one flushed line per call.

    Values may be Python or numpy numbers, one-element tensors, bools or strings; non-finite numbers are
    written as null (strict JSON). Numbers also go to the extra sinks (TensorBoard, W&B).

    Args:
        path: the ``metrics.jsonl`` file, appended to.
        keep_until: when resuming, first drop the lines already in the file whose ``step`` is larger
            (-1 drops them all); None leaves the file as it is.
        sinks: extra destinations with ``log(step, numbers)`` and ``close()``.
        enabled: False on the non-main processes: nothing is written.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        keep_until: int | None = None,
        sinks: list | None = None,
        enabled: bool = True,
    ):
        self.path = Path(path)
        self.sinks = sinks or []
        self.enabled = enabled
        self._file = None
        if enabled:
            if keep_until is not None and self.path.exists():
                _truncate_metrics(self.path, keep_until)
            self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Write one line for ``step`` and return it as written."""
        if "step" in metrics:
            raise ValueError("metrics must not contain 'step'; pass it as the first argument")
        record = {"step": int(step), **{str(k): _scalar(k, v) for k, v in metrics.items()}}
        if not self.enabled:
            return record
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        numbers = {
            k: v
            for k, v in record.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        }
        for sink in self.sinks:
            sink.log(record["step"], numbers)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a partial last line, left by a crash, is skipped)."""
    return _read_metrics(Path(path))[0]


def progress_bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    initial: int = 0,
    enabled: bool = True,
):
    """A tqdm bar on stderr, silent unless stderr is a terminal (so logs and tests stay clean)."""
    from tqdm.auto import tqdm

    quiet = not enabled or not sys.stderr.isatty() or "PYTEST_CURRENT_TEST" in os.environ
    return tqdm(iterable, total=total, desc=desc, initial=initial, disable=quiet, dynamic_ncols=True)


# ----------------------------------------------------------------------------------------------------------
# metrics.jsonl


def _scalar(key: Any, value: Any) -> Any:
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        if (value.numel() if isinstance(value, torch.Tensor) else value.size) != 1:
            raise TypeError(
                f"metric {key!r}: expected one number, got an array of shape {tuple(value.shape)}"
            )
        value = value.item()
    if isinstance(value, bool | str) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    raise TypeError(f"metric {key!r}: expected a number, bool or string, got {type(value).__name__}")


def write_summary_json(path: str | Path, summary: Mapping[str, Any]) -> None:
    """Write a summary as indented JSON, atomically; non-finite numbers become null."""
    _write_json(Path(path), _plain(summary), indent=2)


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return _scalar("summary", obj)


def _read_metrics(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """(records, whether a partial last line was skipped)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    records, partial = [], False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not an object with an integer 'step'")
        except ValueError as e:
            if number == len(lines):  # no trailing newline: the process died mid-write
                partial = True
                continue
            raise UserError(f"{path}, line {number}: not a metrics record ({e})") from None
        records.append(record)
    return records, partial


def _truncate_metrics(path: Path, keep_until: int) -> None:
    records, _ = _read_metrics(path)
    atomic_write_text(
        path,
        "".join(
            json.dumps(record, allow_nan=False) + "\n" for record in records if record["step"] <= keep_until
        ),
    )


def flatten_dict(d: Mapping, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level with dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten_dict(v, f"{prefix}{k}."))
        else:
            out[prefix + str(k)] = v
    return out


def _write_json(path: Path, obj: Any, indent: int | None = None) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, allow_nan=False) + "\n")


# ----------------------------------------------------------------------------------------------------------
# Optional sinks: TensorBoard and Weights & Biases, only when installed and asked for


class _TensorBoardSink:
    def __init__(self, log_dir: Path, purge_step: int | None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "logging.tensorboard is true, but tensorboard is not installed; "
                "`pip install tensorboard` or set logging.tensorboard=false"
            ) from None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, numbers: dict[str, float]) -> None:
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandbSink:
    def __init__(self, run_dir: Path, logging: LoggingConfig, config: RunConfig | None):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "logging.wandb is true, but wandb is not installed; "
                "`pip install wandb` or set logging.wandb=false"
            ) from None
        run_id = json.loads((run_dir / RUN_MARKER).read_text()).get("wandb_id")
        self.run = wandb.init(
            project=logging.wandb_project,
            name=logging.wandb_run_name or run_dir.name,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config_to_dict(config) if config is not None else None,
        )

    def log(self, step: int, numbers: dict[str, float]) -> None:
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


def _open_sinks(
    run_dir: Path, logging: LoggingConfig, config: RunConfig | None, resume_step: int | None
) -> list:
    sinks: list = []
    if logging.tensorboard:
        sinks.append(
            _TensorBoardSink(run_dir / "tensorboard", None if resume_step is None else resume_step + 1)
        )
    if logging.wandb:
        sinks.append(_WandbSink(run_dir, logging, config))
    return sinks
