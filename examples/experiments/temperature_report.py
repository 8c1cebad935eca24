"""The table and the figure of ``temperature.py`` (the temperature experiment), from its rows.

One row per seed, run, rollout and temperature (what ``temperature.py`` measures);
:func:`aggregate` averages them over seeds, :func:`markdown_tables` and :func:`plot` present them,
:func:`report` writes ``rows.csv``, ``table.csv``, ``table.md`` and ``temperature.png``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

TEMPERATURES = (0.0, 0.3, 0.7, 1.0)
FIGURES = ("gold", "proxy", "valid_rate", "length", "distinct_rate", "kl", "entropy", "top_mass")
FIGURES += ("ref_entropy", "ref_top_mass", "top_agree")
TERMS = ("relevance", "sentiment", "informativeness", "length", "enthusiasm")  # the reviews task's gold terms
RUN_ORDER = ("sft", "ppo", "ppo-T1", "ppo-kl/4")
TRAIN_TEMPERATURE = {"sft": 0.7, "ppo": 0.7, "ppo-T1": 1.0, "ppo-kl/4": 0.7}  # SFT: the usual sampling T


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean and standard deviation over seeds of every figure, per (run, rollout, temperature); with each
    checkpoint's KL at its training temperature (``kl_train``)."""
    keys = sorted({(r["run"], r["rollout"], r["temperature"]) for r in rows}, key=_order)
    out = []
    for run, rollout, t in keys:
        cell = [r for r in rows if (r["run"], r["rollout"], r["temperature"]) == (run, rollout, t)]
        at_train = [
            r["kl"]
            for r in rows
            if (r["run"], r["rollout"], r["temperature"]) == (run, rollout, TRAIN_TEMPERATURE[run])
            and r["kl"] is not None
        ]
        row = {"run": run, "rollout": rollout, "temperature": t, "seeds": len(cell)}
        row["kl_train"] = float(np.mean(at_train)) if at_train and run != "sft" else 0.0
        for f in FIGURES:
            values = [r[f] for r in cell if r.get(f) is not None]
            row[f] = float(np.mean(values)) if values else None
            row[f + "_sd"] = float(np.std(values, ddof=1)) if len(values) > 1 else None
        out.append(row)
    return out


def _order(key):
    run, rollout, t = key
    return (RUN_ORDER.index(run), rollout, t)


def best_temperature_counts(rows: list[dict]) -> dict[tuple[str, int], dict[float, int]]:
    """Per checkpoint: in how many seeds each temperature gave the highest mean gold."""
    out: dict[tuple[str, int], dict[float, int]] = {}
    for seed in sorted({r["seed"] for r in rows}):
        for run, rollout in sorted({(r["run"], r["rollout"]) for r in rows}):
            cell = [r for r in rows if (r["seed"], r["run"], r["rollout"]) == (seed, run, rollout)]
            if cell:
                best = max(cell, key=lambda r: r["gold"])["temperature"]
                counts = out.setdefault((run, rollout), {})
                counts[best] = counts.get(best, 0) + 1
    return out


def plus_minus(row, f, digits=2):
    m, sd = row.get(f), row.get(f + "_sd")
    if m is None:
        return "–"
    return f"{m:.{digits}f}" + ("" if sd is None else f" ± {sd:.{digits}f}")


def markdown_tables(table: list[dict], rows: list[dict], temperatures) -> str:
    """Two tables: gold at each temperature per checkpoint; every figure for each run's last checkpoint."""
    counts = best_temperature_counts(rows)
    checkpoints = list(dict.fromkeys((r["run"], r["rollout"]) for r in table))
    temps = " | ".join(f"gold T={t:g}" for t in temperatures)
    lines = [
        f"| policy | rollout | KL (nats, train T) | {temps} | best T (seeds) | greedy − T=0.7 |",
        "|---|---|---|" + "---|" * len(temperatures) + "---|---|",
    ]
    for run, rollout in checkpoints:
        cells = {r["temperature"]: r for r in table if (r["run"], r["rollout"]) == (run, rollout)}
        golds = " | ".join(plus_minus(cells[t], "gold") if t in cells else "–" for t in temperatures)
        best = ", ".join(f"{t:g}: {n}" for t, n in sorted(counts.get((run, rollout), {}).items()))
        gap = f"{cells[0.0]['gold'] - cells[0.7]['gold']:+.2f}" if 0.0 in cells and 0.7 in cells else "–"
        kl = "0" if run == "sft" else f"{cells[temperatures[-1]]['kl_train']:.2f}"
        lines.append(f"| {run} | {rollout} | {kl} | {golds} | {best} | {gap} |")
    lines += [
        "",
        "| policy | rollout | T | gold | proxy | valid | length | distinct | KL at T | entropy | top mass"
        " | SFT entropy | SFT top mass | top-1 agrees |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    last = {}
    for run, rollout in checkpoints:
        last[run] = max(rollout, last.get(run, 0))
    for r in table:
        if r["rollout"] != last[r["run"]]:
            continue
        figures = " | ".join(
            plus_minus(r, f, 1 if f in ("length",) else 2)
            for f in ("gold", "proxy", "valid_rate", "length", "distinct_rate", "kl", "entropy", "top_mass")
        )
        sft_side = " | ".join(plus_minus(r, f) for f in ("ref_entropy", "ref_top_mass", "top_agree"))
        lines.append(f"| {r['run']} | {r['rollout']} | {r['temperature']:g} | {figures} | {sft_side} |")
    return "\n".join(lines)


def write_csv(path: Path, records: list[dict]) -> None:
    fields = list(dict.fromkeys(k for r in records for k in r))
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for r in records:
            writer.writerow({k: ("" if v is None else v) for k, v in r.items()})


def plot(path: Path, table: list[dict], temperatures) -> None:
    """Top row: gold, distinct responses and validity against temperature (each run's last checkpoint; error
    bars = sd over seeds). Bottom row, along each run from the SFT policy (rollout order): greedy minus T=0.7
    gold, and the policy's per-token entropy and top-token mass on its T=0.7 samples, against KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16.0, 8.6), dpi=100)
    last: dict[str, int] = {}
    for r in table:
        last[r["run"]] = max(r["rollout"], last.get(r["run"], 0))
    cells = {(r["run"], r["rollout"], r["temperature"]): r for r in table}
    for i, run in enumerate(r for r in RUN_ORDER if r in last):
        final = sorted((r for r in table if (r["run"], r["rollout"]) == (run, last[run])), key=_by_t)
        label = f"{run} (rollout {last[run]}, KL {final[0]['kl_train']:.1f})" if run != "sft" else "sft"
        for ax, f in zip(axes[0], ("gold", "distinct_rate", "valid_rate"), strict=True):
            sd = [r.get(f + "_sd") or 0.0 for r in final]
            ax.errorbar([r["temperature"] for r in final], [r[f] for r in final], sd, marker="o", capsize=3,
                        color=f"C{i}", label=label)  # fmt: skip
        rollouts = sorted({k for r, k, _ in cells if r == run})
        path_ = [("sft", 0)] * (run != "sft") + [(run, k) for k in rollouts]
        path_ = [c for c in path_ if (*c, 0.0) in cells and (*c, 0.7) in cells]
        kl = [cells[(*c, 0.7)]["kl_train"] for c in path_]
        gap = [cells[(*c, 0.0)]["gold"] - cells[(*c, 0.7)]["gold"] for c in path_]
        for ax, y in zip(
            axes[1],
            (gap, *([cells[(*c, 0.7)][f] for c in path_] for f in ("entropy", "top_mass"))),
            strict=True,
        ):
            ax.plot(kl, y, "o-", color=f"C{i}", label=run, markersize=4)
            if len(kl) > 1:
                ax.plot(kl[-1:], y[-1:], "*", color=f"C{i}", markersize=12)
    titles = ("gold score (held out)", "distinct responses / prompts", "valid responses")
    units = ("gold score", "share of prompts", "share of responses")
    for ax, title, unit in zip(axes[0], titles, units, strict=True):
        ax.set(title=f"Temperature: {title}", xlabel="sampling temperature (0 = greedy)", ylabel=unit)
    axes[1][0].set(
        title="Temperature: greedy minus T=0.7 gold (star: last checkpoint)", ylabel="gold difference"
    )
    axes[1][1].set(title="Temperature: per-token entropy (T=1) on T=0.7 samples", ylabel="nats")
    axes[1][2].set(title="Temperature: top-token probability on T=0.7 samples", ylabel="probability")
    axes[1][0].axhline(0.0, color="black", linewidth=0.6)
    for ax in axes[1]:
        ax.set_xlabel("KL to the SFT policy (nats per response, training T)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _by_t(row: dict) -> float:
    return row["temperature"]


def paired_markdown(rows: list[dict], temperatures) -> str:
    """At each run's last checkpoint: gold at every sampling temperature minus greedy gold, paired per seed (the
    same policy decoded two ways on the same prompts; rlhfkit.reporting.paired), the claim being that greedy is
    best after PPO."""
    from rlhfkit.reporting.paired import describe, paired

    last: dict[str, int] = {}
    for r in rows:
        last[r["run"]] = max(r["rollout"], last.get(r["run"], 0))
    cell = {
        (r["run"], r["temperature"], r["seed"]): r["gold"] for r in rows if r["rollout"] == last[r["run"]]
    }
    others = [t for t in temperatures if t != 0]
    lines = [
        "Gold at T minus greedy gold, paired per seed, at each run's last checkpoint (95% t-interval; sign test):"
    ]
    lines += ["", "| policy (rollout) | " + " | ".join(f"T={t:g} − T=0" for t in others) + " |"]
    lines.append("|---|" + "---|" * len(others))
    for run, rollout in last.items():
        cells = []
        for t in others:
            seeds = sorted(k for (r_, t_, k) in cell if r_ == run and t_ == t and (run, 0.0, k) in cell)
            xs, ys = [cell[(run, 0.0, k)] for k in seeds], [cell[(run, t, k)] for k in seeds]
            cells.append(describe(paired(xs, ys)) if seeds else "–")
        lines.append(f"| {run} ({rollout}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(out: Path, temperatures) -> list[dict]:
    rows = []
    for folder in sorted(out.glob("seed-*")):
        if (folder / "rows.json").is_file():
            rows += json.loads((folder / "rows.json").read_text())
    if not rows:
        raise SystemExit(f"no finished seed in {out}")
    table = aggregate(rows)
    write_csv(out / "rows.csv", rows)
    write_csv(out / "table.csv", table)
    text = markdown_tables(table, rows, temperatures)
    if 0.0 in temperatures and len(temperatures) > 1:
        text += "\n\n" + paired_markdown(rows, temperatures)
    finals = [r for r in rows if r.get("eval_samples")]
    if finals:  # the final reads' own error, beside the spread over seeds
        se = [r["gold_se"] for r in finals]
        reads = sorted({(r["eval_samples"], r["eval_prompts"]) for r in finals})
        text += (
            "\n\nFinal reads (each run's last checkpoint and the SFT policy): "
            + ", ".join(f"{n} sample(s) of {p} prompts" for n, p in reads)
            + f"; the evaluation's standard error of gold {min(se):.3f}-{max(se):.3f} per policy and temperature."
        )
    seeds = sorted({r["seed"] for r in rows})
    accuracy = ", ".join(
        "n/a" if r["rm_accuracy"] is None else f"{r['rm_accuracy']:.3f}"
        for r in rows
        if r["run"] == "sft" and r["temperature"] == 0
    )
    header = (
        f"Seeds {seeds}; mean ± sd over seeds; reward-model held-out gold accuracy per seed: {accuracy}.\n\n"
    )
    (out / "table.md").write_text(header + text + "\n", encoding="utf-8")
    plot(out / "temperature.png", table, temperatures)
    print(header + text, flush=True)
    print(f"\nwrote {out / 'table.md'}, table.csv, rows.csv, temperature.png", flush=True)
    return table


def terms_report(out: Path, rows: list[dict]) -> str:
    """``terms.csv`` (per seed) and ``terms.md`` (means over seeds) of the gold score term by term; returns the
    markdown."""
    write_csv(out / "terms.csv", rows)
    keys = sorted({(r["run"], r["rollout"], r["temperature"]) for r in rows}, key=_order)
    lines = [
        "| policy | rollout | T | valid | " + " | ".join(TERMS) + " | sentences |",
        "|---|---|---|---|" + "---|" * len(TERMS) + "---|",
    ]
    for key in keys:
        cell = [r for r in rows if (r["run"], r["rollout"], r["temperature"]) == key]

        def mean(f, cell=cell):
            values = [r[f] for r in cell if r[f] is not None]
            return f"{np.mean(values):.2f}" if values else "–"

        figures = " | ".join(mean(f) for f in ("valid_rate", *TERMS, "sentences"))
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:g} | {figures} |")
    text = "Gold terms: means over valid responses, then over seeds.\n\n" + "\n".join(lines) + "\n"
    (out / "terms.md").write_text(text, encoding="utf-8")
    return text
