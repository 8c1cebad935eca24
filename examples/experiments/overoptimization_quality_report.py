"""The fits, tables and figure of ``overoptimization_quality.py``, from the ``run.json`` of every PPO run.

Per arm (reward model, KL coefficient, refresh or not, or a refresh's offline control: PPO without a refresh
against a reward model trained offline on as many labelled pairs as the refresh run had), with every seed's
points pooled (d = sqrt(KL) > 0, Δgold = gold − that seed's SFT gold): least squares of Gao et al.'s best-of-n form Δgold = d(α − β d)
(:func:`fit_quadratic`), of their RL form Δgold = d(α − β log d) and of a line a·d (``fit_gao`` of
``examples/overoptimization.py``), each with R², and where each fitted curve peaks and whether that peak lies
inside the measured range of KL; beside them the measured curve (means over seeds at every evaluation): its
peak, the end, and the drop from one to the other. :func:`report` writes ``table.md``, ``fits.csv``,
``rows.csv`` and ``overoptimization.png`` and returns the Markdown.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # temperature_report beside this file
sys.path.insert(0, str(HERE.parent))  # examples/overoptimization.py: the RL form's fit
from overoptimization import fit_gao, gao_curve  # noqa: E402
from temperature_report import plus_minus, write_csv  # noqa: E402

from rlhfkit.reporting.paired import describe, paired, verdict  # noqa: E402


def fit_quadratic(d, delta) -> dict:
    """Least squares of Δgold = d(α − β d) (no intercept: the SFT policy is at d = 0, Δgold = 0).

    Returns ``alpha``, ``beta``, ``r2``, ``rmse``, ``points`` and, when β > 0, the peak ``d_peak`` = α / (2β),
    ``kl_peak`` = d_peak², ``delta_peak`` = α² / (4β) (else None: no maximum).
    """
    d, delta = np.asarray(d, dtype=np.float64), np.asarray(delta, dtype=np.float64)
    if d.shape != delta.shape or d.ndim != 1 or len(d) < 3:
        raise ValueError(f"need two 1-D arrays of one length >= 3, got {d.shape} and {delta.shape}")
    design = np.stack([d, -(d**2)], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, delta, rcond=None)
    residual = float(((delta - design @ np.array([alpha, beta])) ** 2).sum())
    total = float(((delta - delta.mean()) ** 2).sum())
    out = {
        "alpha": float(alpha),
        "beta": float(beta),
        "r2": 1.0 - residual / total if total > 0 else float("nan"),
        "rmse": math.sqrt(residual / len(d)),
        "points": int(len(d)),
        "d_peak": None,
        "kl_peak": None,
        "delta_peak": None,
    }
    if beta > 0:
        alpha, beta = out["alpha"], out["beta"]
        d_peak = alpha / (2.0 * beta)
        out.update({"d_peak": d_peak, "kl_peak": d_peak**2, "delta_peak": alpha**2 / (4.0 * beta)})
    return out


def load_runs(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("seed-*/rm*/*/run.json"))]


def arm_of(run: dict) -> tuple:
    """(reward model's pairs, kl_coef, refresh every, matched): ``matched`` is the refresh interval of the refresh
    run whose label budget an offline control matches (0 for every other run)."""
    return (run["quality"], run["kl_coef"], run["refresh_steps"], run.get("matched_refresh", 0))


def arm_name(arm: tuple) -> str:
    quality, kl_coef, refresh, matched = arm
    if matched:
        return f"kl_coef {kl_coef:g}, offline RM on {quality} + the labels of refresh every {matched}"
    return f"kl_coef {kl_coef:g}" + (f", refresh every {refresh}" if refresh else "")


def summarise(runs: list[dict]) -> dict:
    """One arm over its seeds: the measured curve, its peak and end, and the three fits of the pooled points."""
    seeds = sorted(runs, key=lambda r: r["seed"])
    sft = {r["seed"]: r["eval"][0]["gold"] for r in seeds}
    rollouts = sorted(set.intersection(*({e["rollout"] for e in r["eval"]} for r in seeds)))

    def at(r, k):
        return next(e for e in r["eval"] if e["rollout"] == k)

    curve = [
        {f: float(np.mean([at(r, k)[f] for r in seeds])) for f in ("gold", "proxy", "kl", "valid_rate")}
        | {"rollout": k}
        for k in rollouts
    ]
    points = [
        (math.sqrt(e["kl"]), e["gold"] - sft[r["seed"]]) for r in seeds for e in r["eval"][1:] if e["kl"] > 0
    ]
    d, delta = (np.array(c) for c in zip(*points, strict=True)) if points else (np.zeros(0), np.zeros(0))
    peak = max(curve[1:] or curve, key=lambda c: c["gold"])
    end = [r["eval"][-1] for r in seeds]
    ends = [e["gold"] - sft[r["seed"]] for e, r in zip(end, seeds, strict=True)]
    out = {
        "quality": seeds[0]["quality"],
        "kl_coef": seeds[0]["kl_coef"],
        "refresh_steps": seeds[0]["refresh_steps"],
        "matched_refresh": seeds[0].get("matched_refresh", 0),
        "labels": [r.get("labels", r["quality"]) for r in seeds],
        "seeds": len(seeds),
        "seed_ids": [r["seed"] for r in seeds],
        "rm_accuracy": _mean_sd([r["rm_accuracy"] for r in seeds]),
        "sft_gold": float(np.mean(list(sft.values()))),
        "curve": curve,
        "peak": {**peak, "delta": peak["gold"] - curve[0]["gold"]},
        "end_delta": _mean_sd(ends),
        "end_delta_per_seed": ends,
        "end_proxy_delta": _mean_sd(
            [e["proxy"] - r["eval"][0]["proxy"] for e, r in zip(end, seeds, strict=True)]
        ),
        "end_kl": _mean_sd([e["kl"] for e in end]),
        "end_valid": float(np.mean([e["valid_rate"] for e in end])),
        "max_kl": float(d.max() ** 2) if len(d) else 0.0,
        "d": d.tolist(),
        "delta": delta.tolist(),
    }
    out["drop"] = out["peak"]["gold"] - curve[-1]["gold"]
    if len(d) >= 3:
        out["quadratic"] = fit_quadratic(d, delta)
        out["log"] = fit_gao(d, delta)
    return out


def _mean_sd(values) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return float(np.mean(values)), (float(np.std(values, ddof=1)) if len(values) > 1 else None)


def summaries(runs: list[dict]) -> list[dict]:
    arms = sorted({arm_of(r) for r in runs})
    return [summarise([r for r in runs if arm_of(r) == arm]) for arm in arms]


def _pm(pair, digits=2) -> str:
    return plus_minus({"x": pair[0], "x_sd": pair[1]}, "x", digits)


def _peak(fit: dict | None, max_kl: float) -> str:
    if fit is None:
        return "–"
    if fit["kl_peak"] is None:
        return "none (β ≤ 0)"
    where = "inside" if fit["kl_peak"] <= max_kl else "outside"
    kl = fit["kl_peak"]
    return f"KL {kl:.3g} ({where})" if kl < 1e4 else f"KL {kl:.1e} ({where})"


def _rm_pairs(s: dict) -> str:
    """The reward model's training pairs: its quality, or for an offline control each seed's 256 + N."""
    if not s["matched_refresh"]:
        return str(s["quality"])
    return f"{s['quality']} + N = {' / '.join(str(n) for n in s['labels'])}"


def markdown(table: list[dict]) -> str:
    lines = [
        "| reward model (pairs, held-out gold acc.) | run | SFT gold | measured peak: Δgold (rollout, KL) | end: Δgold |"
        " end: Δproxy | end: KL | end: valid | end Δgold per seed | peak − end |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in table:
        p = s["peak"]
        lines.append(
            f"| {_rm_pairs(s)} ({_pm(s['rm_accuracy'])}) | {arm_name(arm_of(s))}"
            f" | {s['sft_gold']:.2f} | {p['delta']:+.2f} ({p['rollout']}, {p['kl']:.1f}) | {_pm(s['end_delta'])}"
            f" | {_pm(s['end_proxy_delta'])} | {_pm(s['end_kl'], 1)} | {s['end_valid']:.2f}"
            f" | {' / '.join(f'{x:+.2f}' for x in s['end_delta_per_seed'])} | {s['drop']:.2f} |"
        )
    lines += [
        "",
        "| reward model | run | points | max KL | d(α − β d): α, β, R² | its peak | d(α − β log d): α, β, R² | its peak"
        " | line a·d: R² |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in table:
        q, g = s.get("quadratic"), s.get("log")
        if q is None:
            continue
        lines.append(
            f"| {s['quality']} | {arm_name(arm_of(s))} | {q['points']}"
            f" | {s['max_kl']:.1f} | {q['alpha']:.3f}, {q['beta']:.3f}, {q['r2']:.2f} | {_peak(q, s['max_kl'])}"
            f" | {g['alpha']:.3f}, {g['beta']:.3f}, {g['r2']:.2f} | {_peak(g, s['max_kl'])} | {g['linear_r2']:.2f} |"
        )
    refreshed = [s for s in table if s["refresh_steps"]]
    if refreshed:
        lines += [
            "",
            "| reward model | kl_coef | end Δgold: plain → refresh | refresh − plain, paired per seed (95% t-interval;"
            " sign test) | peak Δgold:"
            " plain → refresh | end KL: plain → refresh |",
            "|---|---|---|---|---|---|",
        ]
        for r in refreshed:
            plain = next((s for s in table if arm_of(s) == (r["quality"], r["kl_coef"], 0, 0)), None)
            # paired per seed: the refresh run and the plain run of a seed share its SFT policy and reward model
            test = paired_by_seed(plain, r) if plain is not None else None
            if test is None:
                continue
            test = describe(test)
            lines.append(
                f"| {r['quality']} | {r['kl_coef']:g} | {_pm(plain['end_delta'])} → {_pm(r['end_delta'])}"
                f" | {test} | {plain['peak']['delta']:+.2f} → {r['peak']['delta']:+.2f}"
                f" | {_pm(plain['end_kl'], 1)} → {_pm(r['end_kl'], 1)} |"
            )
    verdicts = verdict_rows(table)
    if verdicts:
        lines += [
            "",
            "| comparison (end Δgold, b − a) | paired per seed (95% t-interval; sign test) | claim | verdict |",
            "|---|---|---|---|",
            *verdicts,
        ]
    return "\n".join(lines) + "\n"


def verdict_rows(table: list[dict]) -> list[str]:
    """The claims the page makes, each as a per-seed paired difference of end Δgold with its verdict: the KL
    penalty against none for every reward model, the refresh against none, and the largest reward model against
    the smallest at each KL coefficient (a seed's runs share its SFT policy and pool; its reward models are
    nested subsets of that pool)."""
    arms = {arm_of(s): s for s in table}
    qualities = sorted({s["quality"] for s in table})
    coefs = sorted({s["kl_coef"] for s in table})
    claims = []  # (label, arm a, arm b, the claim); every claim here says b − a > 0
    for q in qualities:
        for k in coefs[1:]:
            claims.append(
                (f"{q} pairs: kl_coef {k:g} − 0", (q, 0.0, 0, 0), (q, k, 0, 0), "the penalty helps")
            )
        for s in table:
            if s["quality"] == q and s["refresh_steps"]:
                k, every = s["kl_coef"], s["refresh_steps"]
                claims.append(
                    (
                        f"{q} pairs: refresh − plain (kl_coef {k:g})",
                        (q, k, 0, 0),
                        (q, k, every, 0),
                        "the refresh helps",
                    )
                )
                # the control for the refresh's extra labels: the same labels, offline, without a refresh
                claims.append(
                    (
                        f"{q} pairs: refresh − offline at equal labels (kl_coef {k:g})",
                        (q, k, 0, every),
                        (q, k, every, 0),
                        "refreshing beats the same labels offline",
                    )
                )
    if len(qualities) > 1:
        for k in coefs:
            low, high = qualities[0], qualities[-1]
            claims.append(
                (
                    f"kl_coef {k:g}: {high} − {low} pairs",
                    (low, k, 0, 0),
                    (high, k, 0, 0),
                    "a better RM ends higher",
                )
            )
    rows = []
    for label, a, b, claim in claims:
        test = paired_by_seed(arms[a], arms[b]) if a in arms and b in arms else None
        if test is not None:
            rows.append(f"| {label} | {describe(test)} | {claim} | {verdict(test, 1)} |")
    return rows


def paired_by_seed(a: dict, b: dict):
    """End Δgold of arm ``b`` − arm ``a`` paired by seed id over the seeds both have (None if they share none)."""
    x, y = (dict(zip(s["seed_ids"], s["end_delta_per_seed"], strict=True)) for s in (a, b))
    common = sorted(set(x) & set(y))
    return paired([x[i] for i in common], [y[i] for i in common]) if common else None


def plot(path: Path, table: list[dict]) -> None:
    """Per reward model (columns): Δgold (top) and the measured curves' Δproxy (bottom) against sqrt(KL), every
    arm, with the fitted d(α − β d) (solid) and d(α − β log d) (dashed) of each arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    qualities = sorted({s["quality"] for s in table})
    fig, axes = plt.subplots(2, len(qualities), figsize=(4.6 * len(qualities), 7.2), dpi=110, squeeze=False)
    arms = sorted({arm_of(s)[1:] for s in table})
    for col, quality in enumerate(qualities):
        top, bottom = axes[0][col], axes[1][col]
        for s in (s for s in table if s["quality"] == quality):
            color = f"C{arms.index(arm_of(s)[1:])}"
            label = arm_name(arm_of(s))
            top.plot(s["d"], s["delta"], "o", color=color, markersize=3, alpha=0.5)
            curve = s["curve"]
            d = np.sqrt(np.clip([c["kl"] for c in curve], 0, None))
            top.plot(
                d, [c["gold"] - curve[0]["gold"] for c in curve], "-", color=color, alpha=0.35, linewidth=1
            )
            bottom.plot(
                d,
                [c["proxy"] - curve[0]["proxy"] for c in curve],
                "s-",
                color=color,
                markersize=3,
                label=label,
            )
            if "quadratic" in s:
                grid = np.linspace(0.0, max(s["d"]) * 1.05, 100)
                q, g = s["quadratic"], s["log"]
                top.plot(
                    grid,
                    grid * (q["alpha"] - q["beta"] * grid),
                    "-",
                    color=color,
                    label=f"{label}: R² {q['r2']:.2f}",
                )
                top.plot(grid, gao_curve(grid, g["alpha"], g["beta"]), "--", color=color, alpha=0.7)
        accuracy = next(s["rm_accuracy"][0] for s in table if s["quality"] == quality)
        top.set_title(
            f"Overoptimization: RM on {quality} pairs (gold acc. {accuracy:.2f})"
            if accuracy
            else f"Overoptimization: RM on {quality} pairs",
            fontsize=9,
        )
        top.set_ylabel("Δgold over SFT (gold score units)")
        bottom.set_ylabel("Δproxy over SFT, mean over seeds (RM units)")
        bottom.set_xlabel("d = sqrt(KL to the SFT policy), sqrt(nats)")
        for ax in (top, bottom):
            ax.axhline(0.0, color="black", linewidth=0.6)
            ax.grid(alpha=0.3)
        # the line-style key, in the legend: which mark is which (the colours are the arms, labelled beside)
        from matplotlib.lines import Line2D

        key = [
            Line2D(
                [],
                [],
                color="grey",
                marker="o",
                ls="",
                markersize=3,
                alpha=0.5,
                label="each seed's checkpoints",
            ),
            Line2D([], [], color="grey", ls="-", alpha=0.35, lw=1, label="measured curve (mean over seeds)"),
            Line2D([], [], color="grey", ls="-", label="fit d(α − β d) (best-of-n form)"),
            Line2D([], [], color="grey", ls="--", alpha=0.7, label="fit d(α − β log d) (RL form)"),
        ]
        handles, _ = top.get_legend_handles_labels()
        top.legend(handles=handles + key, fontsize=6)
        bottom.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(out: Path) -> str:
    """Write the tables, CSVs and figure of every finished run in ``out``; return the Markdown."""
    runs = load_runs(out)
    if not runs:
        return f"no finished run in {out}"
    table = summaries(runs)
    text = markdown(table)
    (out / "table.md").write_text(text, encoding="utf-8")
    rows = [
        {k: r[k] for k in ("seed", "quality", "kl_coef", "refresh_steps", "rm_accuracy")}
        | {"matched_refresh": r.get("matched_refresh", 0), "labels": r.get("labels", r["quality"])}
        | e
        for r in runs
        for e in r["eval"]
    ]
    write_csv(out / "rows.csv", rows)
    flat = []
    for s in table:
        row = {
            k: s[k]
            for k in (
                "quality",
                "kl_coef",
                "refresh_steps",
                "matched_refresh",
                "seeds",
                "sft_gold",
                "max_kl",
                "drop",
            )
        }
        row["labels"] = float(np.mean(s["labels"]))
        row.update(
            {"rm_accuracy": s["rm_accuracy"][0], "end_delta": s["end_delta"][0], "end_kl": s["end_kl"][0]}
        )
        row.update({f"peak_{k}": v for k, v in s["peak"].items()})
        for form in ("quadratic", "log"):
            for k, v in s.get(form, {}).items():
                row[f"{form}_{k}"] = v
        flat.append(row)
    write_csv(out / "fits.csv", flat)
    plot(out / "overoptimization.png", table)
    cpu = [json.loads(p.read_text())["cpu_seconds"] for p in out.glob("**/rm_cpu*.json")]
    cpu += [r["cpu_seconds"] for r in runs]
    shared = out / "shared" / "cpu.json"
    shared = f"{json.loads(shared.read_text())['cpu_seconds']:.0f} s" if shared.is_file() else "not recorded"
    return text + (
        f"\nCPU time (one thread each): reward models and PPO runs {sum(cpu):.0f} s; SFT policy and pool {shared}\n"
    )
