"""The quickstart's summary: the terminal table (:func:`format_table`) and ``report.md`` / ``report.html`` at the
top of the quickstart folder (:func:`write_quickstart_report`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlhfkit.quickstart.dpo_stage import comparison_markdown, comparison_rows


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The few figures a person asks first, as (name, value) with ``n/a`` for a missing or undefined one."""
    sft, ppo, rm = summary["sft"], summary["ppo"], summary["reward_model"]

    def f(x, fmt=".3f"):
        return "n/a" if x is None or not math.isfinite(x) else format(x, fmt)

    return [
        ("SFT gold score (held out)", f(sft.get("gold_mean"))),
        ("PPO gold score (held out)", f(ppo.get("gold_mean"))),
        ("PPO proxy score (reward model)", f(ppo.get("proxy_mean"))),
        ("PPO KL to SFT (nats / response)", f(ppo.get("kl_mean"))),
        ("PPO win rate vs SFT (gold judge)", f(summary.get("win_rate_vs_sft"))),
        ("   ... greedy", f(summary.get("win_rate_vs_sft_greedy"))),
        ("Reward model accuracy vs gold", f(rm.get("heldout_accuracy"))),
        ("   annotators' Bayes ceiling", f(rm.get("bayes_ceiling"))),
        ("Wall time (s)", f(summary.get("wall_seconds"), ".0f")),
    ]


def format_table(summary: dict[str, Any]) -> str:
    """:func:`summary_rows` as a small table for the terminal; a note under a negative KL (k1 can be)."""
    rows = summary_rows(summary)
    width = max(len(r[0]) for r in rows)
    lines = [f"  {name.ljust(width)}  {value}" for name, value in rows]
    kl = summary["ppo"].get("kl_mean")
    if kl is not None and kl < 0:
        lines.append(
            "  (a negative KL: the k1 estimate is a sample mean of log pi - log pi_ref, unbiased but not "
            "always positive; the policy is still close to SFT)"
        )
    return "\n".join(lines)


def write_quickstart_report(out: Path, summary: dict[str, Any]) -> Path:
    """``report.html`` and ``report.md`` at the top of the quickstart folder: the summary, then each stage's
    run (the HTML page shows each as that run's own page does); returns the path of ``report.md``."""
    from rlhfkit.reporting.report import write_quickstart_page
    from rlhfkit.reporting.sample_file import printable

    stages = (("sft", "SFT"), ("reward", "Reward model"), ("ppo", "PPO"), ("dpo", "DPO"))
    write_quickstart_page(out, summary_rows(summary), summary, stages, comparison_rows(summary))
    lines = [
        "# rlhfkit quickstart",
        "",
        "Every stage on one page, with the PPO samples: `report.html`.",
        "",
        "```",
        format_table(summary),
        "```",
        "",
        "## SFT, DPO and PPO on the same held-out prompts",
        "",
        *comparison_markdown(comparison_rows(summary)),
        "",
    ]
    for name, title in stages:
        lines += [f"## {title} (`{name}/`, full report: [{name}/report.md]({name}/report.md))", ""]
        for png in sorted((out / name / "report").glob("*.png")):
            lines.append(f"![{name} {png.stem}]({name}/report/{png.name})")
        lines.append("")
    if summary.get("examples"):
        lines += ["## What the policies write (held-out prompts, sampled)", ""]
        for ex in summary["examples"]:
            prompt = printable(str(ex["prompt"]), keep_newlines=False)
            lines.append(f"- **{prompt}**")
            for key, title in (("sft", "SFT"), ("dpo", "DPO"), ("ppo", "PPO")):
                if key in ex:
                    lines.append(f"  - {title}: {printable(str(ex[key]), keep_newlines=False)}")
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
