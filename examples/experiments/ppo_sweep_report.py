"""The tables and the figure of ``ppo_sweep.py`` (PPO at several KL coefficients or discounts), from its
per-seed results: :func:`aggregate` averages the held-out measurements over seeds, :func:`train_curves` the
training figures of every rollout, :func:`markdown` and :func:`plot` present them, :func:`paired_markdown` compares
every setting with the sweep's base setting seed by seed (:mod:`rlhfkit.reporting.paired`), :func:`report` writes
``<sweep>.md``, ``<sweep>_rows.csv``, ``<sweep>_train.csv`` and ``<sweep>.png``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # temperature_report beside this file
from temperature_report import plus_minus, write_csv  # noqa: E402

from rlhfkit.reporting.paired import describe, paired  # noqa: E402

FIGURES = ("gold", "proxy", "kl", "length", "ended", "valid_rate")
LABEL = {"kl_coef": "β (kl_coef)", "gamma": "γ", "lam": "λ (GAE)"}
# The training figure of every rollout in the table's last column and the figure's bottom-middle panel: the
# response length for the KL and gamma sweeps, the proxy score (the learning curve) for lambda.
TRAIN_FIGURE = {"kl_coef": ("response_length", "length"), "gamma": ("response_length", "length")}
TRAIN_FIGURE["lam"] = ("score", "proxy score")


def _mean_sd(values) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return float(np.mean(values)), (float(np.std(values, ddof=1)) if len(values) > 1 else None)


def eval_rows(results: list[dict], sweep: str) -> list[dict]:
    """One row per seed, run and held-out measurement; the SFT policy is rollout 0 of every run."""
    rows = []
    for res in results:
        for run in res["runs"].values():
            head = {"seed": res["seed"], "setting": run[sweep], "rm_accuracy": res["rm_accuracy"]}
            rows.append({**head, "rollout": 0, **res["sft"]})
            rows += [{**head, **e} for e in run["eval"]]
    return rows


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean and sd over seeds of every figure per (setting, rollout); ``proxy_minus_gold`` per seed first."""
    out = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        for rollout in sorted({r["rollout"] for r in rows if r["setting"] == setting}):
            cell = [r for r in rows if (r["setting"], r["rollout"]) == (setting, rollout)]
            row = {"setting": setting, "rollout": rollout, "seeds": len(cell)}
            for f in FIGURES:
                row[f], row[f + "_sd"] = _mean_sd([r.get(f) for r in cell])
            row["gap"], row["gap_sd"] = _mean_sd([r["proxy"] - r["gold"] for r in cell])
            row["gold_per_seed"] = [r["gold"] for r in sorted(cell, key=lambda r: r["seed"])]
            out.append(row)
    return out


def train_curves(results: list[dict], sweep: str) -> list[dict]:
    """Per seed, setting and rollout: the training figures (proxy score, KL, response length)."""
    return [
        {"seed": res["seed"], "setting": run[sweep], **t}
        for res in results
        for run in res["runs"].values()
        for t in run["train"]
    ]


def markdown(table: list[dict], train: list[dict], sweep: str) -> str:
    """The last checkpoint of each run (and the SFT policy), then every checkpoint along the runs."""
    last = {}
    for r in table:
        last[r["setting"]] = max(r["rollout"], last.get(r["setting"], 0))
    sft = next(r for r in table if r["rollout"] == 0)
    lines = [
        "| policy | gold | proxy | proxy − gold | KL (nats) | length (tokens) | ended | valid | gold per seed"
        f" | train {TRAIN_FIGURE[sweep][1]}, last 5 rollouts |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def line(name, r, train_length="–"):
        seeds = " / ".join(f"{g:.2f}" for g in r["gold_per_seed"])
        figures = " | ".join(
            plus_minus(r, f, 1 if f == "length" else 2)
            for f in ("gold", "proxy", "gap", "kl", "length", "ended")
        )
        return f"| {name} | {figures} | {plus_minus(r, 'valid_rate')} | {seeds} | {train_length} |"

    lines.append(line("SFT", sft))
    for setting, rollout in last.items():
        r = next(x for x in table if (x["setting"], x["rollout"]) == (setting, rollout))
        mine = [t for t in train if t["setting"] == setting]
        end = max((t["rollout"] for t in mine), default=0)
        tail = [t[TRAIN_FIGURE[sweep][0]] for t in mine if t["rollout"] > end - 5]
        digits = 1 if TRAIN_FIGURE[sweep][0] == "response_length" else 2
        label = f"{LABEL[sweep]} = {setting:g}, rollout {rollout}"
        lines.append(line(label, r, f"{np.mean(tail):.{digits}f}" if tail else "–"))
    lines += [
        "",
        f"| {LABEL[sweep]} | rollout | gold | proxy | KL (nats) | length |",
        "|---|---|---|---|---|---|",
    ]
    for r in table:
        figures = " | ".join(
            plus_minus(r, f, 1 if f == "length" else 2) for f in ("gold", "proxy", "kl", "length")
        )
        lines.append(f"| {r['setting']:g} | {r['rollout']} | {figures} |")
    return "\n".join(lines)


PAIRED_FIGURES = (("gold", 2), ("proxy", 2), ("kl", 2), ("length", 1))


def paired_markdown(rows: list[dict], sweep: str, base: float) -> str:
    """Each setting against ``base`` at its last checkpoint, paired per seed: the difference (setting − base) of
    gold, proxy, KL and length in every seed, its mean, 95% t-interval and sign test. Each seed's runs share its
    SFT policy, reward model and prompts, so the per-seed difference is the comparison (not two sds)."""
    last: dict[float, int] = {}
    for r in rows:
        last[r["setting"]] = max(r["rollout"], last.get(r["setting"], 0))
    at_end = {(r["setting"], r["seed"]): r for r in rows if r["rollout"] == last[r["setting"]]}
    lines = [
        f"Paired per seed against {LABEL[sweep]} = {base:g} (difference = setting − base, last checkpoint; "
        "mean (per seed); 95% t-interval; sign test):",
        "",
        f"| {LABEL[sweep]} | " + " | ".join(f for f, _ in PAIRED_FIGURES) + " |",
        "|---|" + "---|" * len(PAIRED_FIGURES),
    ]
    for setting in dict.fromkeys(r["setting"] for r in rows):
        seeds = sorted(k for (s_, k) in at_end if s_ == setting and (base, k) in at_end)
        if setting == base or not seeds:
            continue
        cells = []
        for f, digits in PAIRED_FIGURES:
            a = [at_end[(base, k)].get(f) for k in seeds]
            b = [at_end[(setting, k)].get(f) for k in seeds]
            ok = all(x is not None for x in a + b)
            cells.append(describe(paired(a, b), digits) if ok else "–")
        lines.append(f"| {setting:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path, table: list[dict], train: list[dict], sweep: str) -> None:
    """Held-out gold, proxy, KL and length against rollouts (error bars: sd over seeds); the training
    response length of every rollout (mean over seeds); gold (solid) and proxy (dashed) against KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16.0, 8.6), dpi=100)
    name = LABEL[sweep].split(" (")[0]  # the swept setting names every title: the sweeps' figures differ
    panels = [("gold", "gold score (held out, T = 0.7)", "gold score")]
    panels += [("proxy", "proxy score (the reward model)", "proxy score (RM units)")]
    panels += [("kl", "KL to the SFT policy", "KL (nats per response)")]
    panels += [("length", "response length (held out)", "tokens")]
    for i, setting in enumerate(dict.fromkeys(r["setting"] for r in table)):
        rows = [r for r in table if r["setting"] == setting]
        label = f"{LABEL[sweep]} = {setting:g}"
        x = [r["rollout"] for r in rows]
        for ax, (f, title, unit) in zip(axes.flat[:4], panels, strict=True):
            ax.errorbar(x, [r[f] for r in rows], [r.get(f + "_sd") or 0.0 for r in rows], marker="o",
                        capsize=3, color=f"C{i}", label=label)  # fmt: skip
            ax.set(title=f"PPO at several {name}: {title}", xlabel="rollout", ylabel=unit)
        curve = sorted({t["rollout"] for t in train if t["setting"] == setting})
        key = TRAIN_FIGURE[sweep][0]
        means = [
            np.mean([t[key] for t in train if (t["setting"], t["rollout"]) == (setting, k)]) for k in curve
        ]
        axes[1][1].plot(curve, means, color=f"C{i}", label=label)
        kl = [r["kl"] for r in rows]
        axes[1][2].plot(kl, [r["gold"] for r in rows], "o-", color=f"C{i}", label=label)
        axes[1][2].plot(kl, [r["proxy"] for r in rows], "x--", color=f"C{i}", alpha=0.6)
    title = {"response_length": "Response length", "score": "Proxy score"}[TRAIN_FIGURE[sweep][0]]
    unit = {"response_length": "tokens", "score": "proxy score (RM units)"}[TRAIN_FIGURE[sweep][0]]
    axes[1][1].set(title=f"PPO at several {name}: {title.lower()} in training (mean over seeds)", xlabel="rollout",
                   ylabel=unit)  # fmt: skip
    axes[1][2].set(title=f"PPO at several {name}: gold and proxy against KL", xlabel="KL to the SFT policy (nats)",
                   ylabel="score")  # fmt: skip
    from matplotlib.lines import Line2D  # the line-style key in the legend, not in the title

    handles, _ = axes[1][2].get_legend_handles_labels()
    handles += [Line2D([], [], color="grey", marker="o", label="gold (solid)"),
                Line2D([], [], color="grey", marker="x", ls="--", alpha=0.6, label="proxy (dashed)")]  # fmt: skip
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1][2].legend(handles=handles, fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(out: Path, sweep: str, results: list[dict], base: float | None = None) -> list[dict]:
    """Write the tables, CSVs and figure of a sweep; ``base``: the setting the others are paired against
    (default: the first)."""
    if not results:
        raise SystemExit(f"no finished seed of the {sweep} sweep in {out}")
    rows = eval_rows(results, sweep)
    table = aggregate(rows)
    train = train_curves(results, sweep)
    write_csv(out / f"{sweep}_rows.csv", rows)
    write_csv(out / f"{sweep}_train.csv", train)
    accuracy = ", ".join("n/a" if r["rm_accuracy"] is None else f"{r['rm_accuracy']:.3f}" for r in results)
    header = (
        f"Seeds {[r['seed'] for r in results]}; mean ± sd over seeds; held-out prompts at T = 0.7; "
        f"reward-model held-out gold accuracy per seed: {accuracy}.\n\n"
    )
    base = rows[0]["setting"] if base is None else base
    text = header + markdown(table, train, sweep) + "\n\n" + paired_markdown(rows, sweep, base) + "\n"
    (out / f"{sweep}.md").write_text(text, encoding="utf-8")
    plot(out / f"{sweep}.png", table, train, sweep)
    print(text, flush=True)
    print(f"wrote {out / (sweep + '.md')}, {sweep}_rows.csv, {sweep}_train.csv, {sweep}.png", flush=True)
    return table
