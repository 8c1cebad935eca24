"""What the quickstarts on the built-in tasks share: the SFT stage's keys (the reviews pipeline,
:mod:`rlhfkit.quickstart.pipeline`; the arithmetic one, :mod:`rlhfkit.quickstart.verifiable`; and the
experiments that start from an SFT policy of their own), and the ``summary.json`` / ``report.md`` that the
arithmetic, tools and distillation quickstarts end with."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def sft_stage(files: dict[str, Path], steps: int, batch: int, lr: float) -> dict[str, Any]:
    """The SFT stage's keys every pipeline on a built-in task shares: from the task's initial model on its SFT
    files, ``steps`` of ``batch`` examples at peak ``lr`` with a 5% warm-up and cosine decay, one checkpoint
    at the end (callers add the seed, lengths, evaluation and logging periods)."""
    return {
        "model.name_or_path": files["init_model"],
        "data.train_file": files["sft_train"],
        "data.eval_file": files["sft_eval"],
        "train.max_steps": steps,
        "train.batch_size": batch,
        "train.learning_rate": lr,
        "train.warmup_steps": max(1, steps // 20),
        "train.lr_schedule": "cosine",
        "train.save_steps": steps,
    }


def write_summary(out: Path, summary: dict[str, Any], title: str, table: str) -> dict[str, Any]:
    """A quickstart's last stage: ``summary.json`` and ``report.md`` (``title``, then ``table``) in ``out``, the
    table printed; returns ``summary``."""
    from rlhfkit.engine.metrics_writer import write_summary_json

    write_summary_json(out / "summary.json", summary)
    (out / "report.md").write_text(f"# rlhfkit quickstart: {title}\n\n```\n{table}\n```\n", encoding="utf-8")
    print(table, flush=True)
    return summary
