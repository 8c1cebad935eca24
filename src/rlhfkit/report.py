"""Plots and a short report from a run folder's ``metrics.jsonl`` (and ``summary.json`` when present).

``rlhfkit report RUN_DIR`` writes ``RUN_DIR/report/`` with one PNG per group of metrics that the run
logged, and ``RUN_DIR/report.md`` that shows them beside the summary figures. Every trainer calls
:func:`write_report` at its end, so a finished run always has one.

The plots a person looks at first in RLHF (Zheng et al. 2023, "Secrets of RLHF": watch KL, length and
entropy, not only the reward): the proxy score and, on a task with a gold scorer, the gold score; the KL
to the reference; entropy; response length; the losses. For online runs with a gold scorer, gold and
proxy score against sqrt(KL) — the axis on which Gao et al. (2022) describe reward-model overoptimization.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlhfkit.engine.run import flatten_dict, read_metrics
from rlhfkit.errors import UserError

# file name -> (title, y label, [(metric key, legend label)])
PLOTS: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "scores": ("Score per response", "score", [("score/mean", "proxy (reward model)"), ("gold/mean", "gold"),
                                              ("eval/score/mean", "proxy, held out"),
                                              ("eval/gold/mean", "gold, held out")]),
    "kl": ("KL to the reference policy", "nats per response", [("kl/mean", "KL (trained estimator)"),
                                                              ("eval/kl/mean", "KL, held out")]),
    "entropy": ("Policy entropy", "nats per token", [("entropy/mean", "entropy")]),
    "response_length": ("Response length", "tokens", [("response_length/mean", "mean length")]),
    "losses": ("Losses", "loss", [("loss", "training loss"), ("eval/loss", "held-out loss"),
                                  ("loss/policy", "policy"), ("loss/value", "value")]),
    "accuracy": ("Reward-model accuracy", "accuracy", [("accuracy", "train"), ("eval/accuracy", "held out"),
                                                       ("eval/gold_accuracy", "held out vs gold")]),
}


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(row["step"])
            ys.append(float(value))
    return xs, ys


def _plot_lines(path: Path, title: str, ylabel: str, lines: list[tuple[str, list[float], list[float]]],
                xlabel: str = "step (optimizer steps offline, rollouts online)", marker: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for label, xs, ys in lines:
        ax.plot(xs, ys, marker or ("o" if len(xs) < 12 else ""), label=label, markersize=4)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def gold_vs_kl_points(rows: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """sqrt(KL) against the gold and proxy scores, from the rows that logged both (Gao et al. 2022)."""
    out = {}
    for kl_key, score_key, label in (("eval/kl/mean", "eval/gold/mean", "gold"), ("eval/kl/mean", "eval/score/mean", "proxy"),
                                     ("kl/mean", "gold/mean", "gold"), ("kl/mean", "score/mean", "proxy")):
        if label in out:
            continue
        pts = [(math.sqrt(max(r[kl_key], 0.0)), r[score_key]) for r in rows
               if isinstance(r.get(kl_key), int | float) and isinstance(r.get(score_key), int | float)]
        if pts and (label == "proxy" or "gold" in score_key):
            out[label] = ([p[0] for p in pts], [p[1] for p in pts])
    return out if "gold" in out else {}


def write_report(run_dir: str | Path) -> Path:
    """Write ``report/*.png`` and ``report.md`` for the run in ``run_dir``; return the report's path."""
    run = Path(run_dir)
    metrics_path = run / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserError(f"{run}: no metrics.jsonl; is this an rlhfkit run folder?")
    rows = read_metrics(metrics_path)
    if not rows:
        raise UserError(f"{metrics_path}: no metrics logged yet")
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    plot_dir = run / "report"
    plot_dir.mkdir(exist_ok=True)

    images: list[tuple[str, str]] = []
    for name, (title, ylabel, keys) in PLOTS.items():
        lines = [(label, *_series(rows, key)) for key, label in keys]
        lines = [line for line in lines if line[1]]
        if lines:
            _plot_lines(plot_dir / f"{name}.png", title, ylabel, lines)
            images.append((title, f"report/{name}.png"))
    points = gold_vs_kl_points(rows)
    if points:
        _plot_lines(plot_dir / "gold_vs_sqrt_kl.png", "Gold and proxy score against sqrt(KL)", "score",
                    [(label, xs, ys) for label, (xs, ys) in points.items()],
                    xlabel="sqrt(KL to the reference, nats per response)", marker="o-")
        images.append(("Gold and proxy score against sqrt(KL) (Gao et al. 2022)", "report/gold_vs_sqrt_kl.png"))

    lines = [f"# rlhfkit report: {run.name}", ""]
    if summary:
        lines += ["## Summary", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in flatten_dict(summary).items()]
        lines.append("")
    last = rows[-1]
    lines += [f"## Last logged step ({last['step']})", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in last.items() if k != "step"]
    lines.append("")
    for title, rel in images:
        lines += [f"## {title}", "", f"![{title}]({rel})", ""]
    lines += samples_section(run)
    report = run / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    return report


def samples_section(run: Path, count: int = 3) -> list[str]:
    """Markdown for ``samples.jsonl`` (online runs): the newest rollout's responses, and the best- and
    worst-scored of the run, each with its score, parts, KL, length and whether it ended with a stop token."""
    from rlhfkit.rollout.samples import SAMPLES_FILE, pick_samples, read_samples

    path = run / SAMPLES_FILE
    picked = pick_samples(read_samples(path), count) if path.is_file() else {}
    if not picked:
        return []
    lines = ["## Samples", "", f"From `{SAMPLES_FILE}` (every line is one response; `score` is what entered the "
                                "rewards, null when nothing scored it).", ""]
    titles = {"newest": f"Newest (rollout {picked['newest'][0]['step']})", "best": "Best-scored",
              "worst": "Worst-scored"}
    for key, title in titles.items():
        if not picked[key]:
            continue
        lines += [f"### {title}", "", "| step | score | parts | KL | length | ended | prompt | response |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in picked[key]:
            parts = ", ".join(f"{k} {_fmt(v)}" for k, v in (row.get("parts") or {}).items())
            cells = [row["step"], _fmt(row.get("score")), parts, _fmt(row.get("kl")), row.get("length"),
                     row.get("ended"), _cell(row.get("prompt")), _cell(row.get("response"))]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    return lines


def _cell(value: Any, limit: int = 200) -> str:
    """Text for a Markdown table cell: messages as 'role: content', one line, pipes escaped, cut at ``limit``."""
    if isinstance(value, list):
        value = " / ".join(f"{m.get('role')}: {m.get('content')}" if isinstance(m, dict) else str(m) for m in value)
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
