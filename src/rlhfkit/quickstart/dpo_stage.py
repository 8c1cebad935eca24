"""The quickstart's DPO stage and its SFT / DPO / PPO comparison.

DPO (``rlhfkit train dpo``) trains on the very pairs the reward model learnt from, starting from the SFT policy
with the SFT policy as its frozen reference: the same data and the same starting point as PPO, no reward model
and no sampling. The quickstart then measures the three policies on the same held-out prompts with the same
judges: the gold score (what the annotators want), the proxy (the reward model PPO optimised; DPO never saw
it), the KL to the SFT policy (k1, nats per response) and the gold win rate over SFT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfkit.config import config_from


@dataclass(frozen=True)
class DPOPreset:
    """How long the quickstart's DPO stage trains (per quickstart preset)."""

    steps: int
    batch: int
    lr: float
    beta: float


# tiny: measured on a tiny quickstart's pairs (seed 0), 40 steps at 3e-4 reach about PPO's KL to SFT (1.5 nats per
# response) and most of its gold gain; small: scaled like the other stages, not tuned.
DPO_PRESETS: dict[str, DPOPreset] = {
    # lr 2e-4: at 3e-4 on the tiny preset's 6,144 pairs seed 0 collapsed (gold -1.11, 43% valid responses, KL
    # 6.4 nats); at 2e-4 seeds 0-4 reach win rates 0.57-0.69 over SFT with none below 0.96 gold.
    "tiny": DPOPreset(steps=40, batch=32, lr=2e-4, beta=0.1),
    "small": DPOPreset(steps=150, batch=64, lr=5e-5, beta=0.1),
    "smoke": DPOPreset(steps=2, batch=8, lr=1e-4, beta=0.1),
}


def dpo_stage(
    out: Path,
    preset: str,
    seed: int,
    sft_dir: Path,
    pairs: dict[str, Any],
    response_length: int,
    **extra: Any,
) -> dict[str, Any]:
    """Train DPO from ``sft_dir`` on the labelled ``pairs`` (``label_pairs``'s paths) into ``out``; the summary.
    ``extra``: other dotted configuration keys, or these replaced (e.g. ``**{"dpo.reference_model": path}``)."""
    from rlhfkit.trainers import dpo

    d = DPO_PRESETS[preset]
    overrides = {
        "seed": seed,
        "model.name_or_path": sft_dir,
        "data.train_file": pairs["train"],
        "data.eval_file": pairs["eval"],
        "data.max_prompt_length": 32,
        "data.max_length": 32 + response_length,
        "train.max_steps": d.steps,
        "train.batch_size": d.batch,
        "train.learning_rate": d.lr,
        "train.lr_schedule": "linear",
        "train.warmup_steps": max(1, d.steps // 10),
        "train.save_steps": d.steps,
        "train.eval_steps": max(1, d.steps // 2),
        "train.log_steps": 5,
        "dpo.beta": d.beta,
        **extra,
    }
    return dpo.train(config_from("dpo", out, overrides))


POLICIES = (("sft", "SFT"), ("dpo", "DPO"), ("ppo", "PPO"))


def comparison_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The policies side by side: a header row, then gold, proxy, KL and win rates (``n/a`` where a figure
    does not apply, e.g. SFT's KL to itself)."""

    def f(x):
        return "n/a" if not isinstance(x, int | float) or not math.isfinite(x) else f"{x:.3f}"

    present = [(key, title) for key, title in POLICIES if isinstance(summary.get(key), dict)]
    rows = [["held-out prompts", *(title for _, title in present)]]
    for label, field in (
        ("gold score", "gold_mean"),
        ("proxy score (reward model)", "proxy_mean"),
        ("KL to SFT (nats / response)", "kl_mean"),
        ("valid responses", "valid_rate"),
        ("gold score, greedy", "gold_mean_greedy"),
    ):
        rows.append([label, *(f(summary[key].get(field)) for key, _ in present)])
    for label, suffix in (("gold win rate vs SFT", ""), ("   ... greedy", "_greedy")):
        rates = {"sft": None, "ppo": summary.get(f"win_rate_vs_sft{suffix}")}
        rates["dpo"] = summary.get(f"dpo_win_rate_vs_sft{suffix}")
        rows.append([label, *(f(rates[key]) for key, _ in present)])
    return rows


def format_comparison(rows: list[list[str]]) -> str:
    """:func:`comparison_rows` as aligned text for the terminal."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  "
        + "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


def comparison_markdown(rows: list[list[str]]) -> list[str]:
    """:func:`comparison_rows` as a Markdown table (lines)."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return lines + ["| " + " | ".join(row) + " |" for row in rows[1:]]
