"""rlhfkit: classic RLHF (SFT, reward model, PPO with GAE) on Hugging Face language models.

The layers, highest first (a module imports only from its own layer or lower ones; docs/design.md, "The
layers", and tests/test_layers.py):

    cli > commands > quickstart > trainers > reporting > rollout > models / data / tasks > engine > config
    > algos > types / errors

`rlhfkit.algos` is pure tensor math and imports nothing heavy, so ``import rlhfkit`` stays cheap. The Python
entry point :func:`train` imports the commands when it is called, never before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__version__ = "0.1.0"


def train(
    kind: str, config: Any, train_dataset: Any = None, *, resume: bool = False, overwrite: bool = False
) -> Path:
    """Train a run from Python, as ``rlhfkit train KIND --config FILE`` does; returns the run folder.

    Args:
        kind: ``sft``, ``reward``, ``prm``, ``dpo``, ``ppo``, ``grpo`` or ``rloo``.
        config: a YAML file's path, or a dict of the same keys: nested sections
            (``{"train": {"max_steps": 10}}``) and/or dotted keys (``{"train.max_steps": 10}``).
        train_dataset: a ``datasets.Dataset`` or a list of dicts, the rows a ``data.train_file`` would hold (the
            same shapes, docs/data.md); used in place of ``data.train_file``, which must then be unset. Its rows
            are kept in the run folder as ``inputs/train_dataset.jsonl``.
        resume: continue the run in ``output_dir`` (``--resume``).
        overwrite: delete ``output_dir`` and start again (``--overwrite``).

    Raises:
        rlhfkit.errors.ConfigError, rlhfkit.errors.DataError: the mistake the command line reports as
            ``rlhfkit: error: <message>``, with that message; an error in ``train_dataset`` names it and the
            row (0-based).
    """
    from rlhfkit.commands import train_from_python  # here: importing rlhfkit loads no trainer

    return train_from_python(kind, config, train_dataset, resume=resume, overwrite=overwrite)
