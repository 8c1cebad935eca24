"""The metrics writer of a run folder: ``metrics.jsonl`` (one flushed JSON line per logged step, cut back to
the resume step when a run resumes), ``summary.json``, the progress bar, and the optional TensorBoard and
Weights & Biases sinks. :mod:`rlhfkit.engine.folder` opens these for a trainer."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhfkit.config import LoggingConfig, RunConfig, config_to_dict
from rlhfkit.engine.atomic import atomic_write_text
from rlhfkit.errors import ConfigError, UserError


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
                truncate_metrics(self.path, keep_until)
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
    return read_metrics_file(Path(path))[0]


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
    write_json(Path(path), _plain(summary), indent=2)


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return _scalar("summary", obj)


def read_metrics_file(path: Path) -> tuple[list[dict[str, Any]], bool]:
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


def truncate_metrics(path: Path, keep_until: int) -> None:
    records, _ = read_metrics_file(path)
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


def write_json(path: Path, obj: Any, indent: int | None = None) -> None:
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
    def __init__(self, run_dir: Path, logging: LoggingConfig, config: RunConfig | None, run_id: str | None):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "logging.wandb is true, but wandb is not installed; "
                "`pip install wandb` or set logging.wandb=false"
            ) from None
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


def open_sinks(
    run_dir: Path,
    logging: LoggingConfig,
    config: RunConfig | None,
    resume_step: int | None,
    wandb_id: str | None = None,
) -> list:
    """The extra sinks ``logging`` asks for; ``wandb_id`` resumes the same W&B run."""
    sinks: list = []
    if logging.tensorboard:
        sinks.append(
            _TensorBoardSink(run_dir / "tensorboard", None if resume_step is None else resume_step + 1)
        )
    if logging.wandb:
        sinks.append(_WandbSink(run_dir, logging, config, wandb_id))
    return sinks
