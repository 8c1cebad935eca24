"""Write a built-in task to disk in the formats every rlhfkit command reads.

    <out>/
      init_model/          a freshly initialised model of the preset + the task's tokenizer (HF folder)
      sft_train.jsonl      {"prompt", "completion"} records on train prompts
      sft_eval.jsonl       the same on held-out prompts
      prompts_train.jsonl  {"prompt"} records for online RL
      prompts_eval.jsonl   held-out prompts for evaluation

With these, ``rlhfkit train sft`` trains on the task like on any dataset (the quickstart writes them as
its first stage, ``<out>/task/``; :func:`prepare_task_files` from Python).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhfkit.tasks.base import Task


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    """Write records as JSON Lines (UTF-8, one object per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def prepare_task_files(
    task: Task, out_dir: str | Path, preset: str = "tiny", num_sft: int = 4096, num_sft_eval: int = 256
) -> dict[str, Path]:
    """Write the task's model, tokenizer, SFT data and prompt splits under ``out_dir``; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"init_model": out / "init_model"}
    tokenizer = task.build_tokenizer(paths["init_model"])
    task.build_model(preset, tokenizer).save_pretrained(paths["init_model"])

    paths["sft_train"] = write_jsonl(out / "sft_train.jsonl", task.sft_records(num_sft))
    paths["sft_eval"] = write_jsonl(out / "sft_eval.jsonl", task.sft_records(num_sft_eval, split="eval"))
    paths["prompts_train"] = write_jsonl(
        out / "prompts_train.jsonl", [{"prompt": p} for p in task.prompts("train")]
    )
    paths["prompts_eval"] = write_jsonl(
        out / "prompts_eval.jsonl", [{"prompt": p} for p in task.prompts("eval")]
    )
    return paths
