"""The quickstart's SFT, DPO and PPO side by side over several seeds: gold, proxy, KL to SFT and win rate.

``rlhfkit quickstart`` trains, from one SFT policy and one set of labelled pairs, a reward model and PPO on it, and
DPO on the same pairs (no reward model), then measures the three policies on the same held-out prompts with the
same judges (``summary.json``). One seed is one draw of the task, the models and every sample; this script runs
the quickstart at each seed (``OUT/seed-N``, skipped when its ``summary.json`` exists) and tabulates the figures
as mean ± sd over seeds, with every seed's value::

    python examples/experiments/quickstart_seeds.py --out runs/qs-seeds            # seeds 0 1 2, one at a time
    python examples/experiments/quickstart_seeds.py --out runs/qs-seeds --report-only

Writes ``OUT/quickstart_seeds.md`` and ``OUT/quickstart_seeds.csv`` (one row per seed and policy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the reports beside this script
from temperature_report import write_csv  # noqa: E402

from rlhfkit.reporting.paired import describe, paired  # noqa: E402

POLICIES = (("sft", "SFT"), ("dpo", "DPO"), ("ppo", "PPO"))
# (label, summary field of each policy) and (label, summary key of the win rate over SFT per policy)
FIGURES = (
    ("gold score", "gold_mean"),
    ("proxy score (reward model)", "proxy_mean"),
    ("KL to SFT (nats / response)", "kl_mean"),
    ("valid responses", "valid_rate"),
    ("response length (tokens)", "response_length_mean"),
    ("gold score, greedy", "gold_mean_greedy"),
)
WIN_RATES = (
    ("gold win rate vs SFT", {"ppo": "win_rate_vs_sft", "dpo": "dpo_win_rate_vs_sft"}),
    ("   ... greedy", {"ppo": "win_rate_vs_sft_greedy", "dpo": "dpo_win_rate_vs_sft_greedy"}),
)


def rows_of(summaries: dict[int, dict]) -> list[dict]:
    """One row per seed and policy: its figures (``None`` where one does not apply, e.g. SFT's KL)."""
    rows = []
    for seed, summary in sorted(summaries.items()):
        for key, _ in POLICIES:
            row = {"seed": seed, "policy": key}
            row.update({field: summary[key].get(field) for _, field in FIGURES})
            row.update({label.strip(" ."): summary.get(keys.get(key, "")) for label, keys in WIN_RATES})
            rows.append(row)
    return rows


def cell(values: list) -> str:
    """``mean ± sd (seed values)``, or ``n/a``."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    sd = f" ± {np.std(values, ddof=1):.2f}" if len(values) > 1 else ""
    return f"{np.mean(values):.2f}{sd} ({' / '.join(f'{v:.2f}' for v in values)})"


def markdown(summaries: dict[int, dict]) -> str:
    """The policies side by side (mean ± sd over seeds, each seed's value in brackets), then the reward model's
    and DPO's held-out pair accuracies."""
    rows = rows_of(summaries)
    lines = ["| held-out prompts | " + " | ".join(t for _, t in POLICIES) + " |", "|---|---|---|---|"]
    for label, field in (*FIGURES, *((lbl, lbl.strip(" .")) for lbl, _ in WIN_RATES)):
        cells = [cell([r[field] for r in rows if r["policy"] == key]) for key, _ in POLICIES]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    # paired per seed (each seed's three policies share its SFT policy, pairs and prompts)
    by = {(r["seed"], r["policy"]): r for r in rows}
    seeds = sorted(summaries)
    lines += ["", "Gold paired per seed (b − a; mean (per seed); 95% t-interval; sign test):", ""]
    for a, b in (("sft", "dpo"), ("sft", "ppo"), ("dpo", "ppo")):
        xs, ys = [by[(k, a)]["gold_mean"] for k in seeds], [by[(k, b)]["gold_mean"] for k in seeds]
        if all(v is not None for v in xs + ys):
            lines.append(f"- {b.upper()} − {a.upper()}: {describe(paired(xs, ys))}")
    s = [summaries[k] for k in sorted(summaries)]
    lines += [
        "",
        f"Reward model held-out accuracy against gold: {cell([x['reward_model'].get('heldout_accuracy') for x in s])}; "
        f"DPO's implicit reward on the same held-out pairs: "
        f"{cell([x.get('dpo_training', {}).get('heldout_gold_accuracy') for x in s])} against gold, "
        f"{cell([x.get('dpo_training', {}).get('heldout_accuracy') for x in s])} against the labels. "
        f"Wall seconds per seed: {' / '.join(str(round(x.get('wall_seconds', 0))) for x in s)}.",
    ]
    return "\n".join(lines) + "\n"


def command(args, seed: int) -> list[str]:
    """The quickstart of one seed."""
    out = str(args.out / f"seed-{seed}")
    return [sys.executable, "-m", "rlhfkit", "quickstart", "--out", out, "--seed", str(seed)] + [
        "--preset",
        args.preset,
        "--overwrite",
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (one quickstart per seed in it)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--preset", choices=("tiny", "small", "smoke"), default="tiny")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="quickstarts at once (default 1); each gets cores / jobs torch threads unless RLHFKIT_NUM_THREADS is set",
    )
    p.add_argument("--report-only", action="store_true", help="only the table, from the finished seeds")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    done = {seed: args.out / f"seed-{seed}" / "summary.json" for seed in args.seeds}
    if not args.report_only:
        threads = str(max(1, (os.cpu_count() or 1) // max(1, min(args.jobs, len(args.seeds)))))
        env = {**os.environ, "RLHFKIT_NUM_THREADS": os.environ.get("RLHFKIT_NUM_THREADS", threads)}
        pending, running = [s for s in args.seeds if not done[s].is_file()], []
        while pending or running:
            while pending and len(running) < args.jobs:
                running.append(subprocess.Popen(command(args, pending.pop(0)), env=env))
            running[0].wait()
            if running[0].returncode != 0:
                print(f"a seed failed: {' '.join(running[0].args)}", file=sys.stderr)
                return 1
            running.pop(0)
    summaries = {seed: json.loads(path.read_text()) for seed, path in done.items() if path.is_file()}
    if not summaries:
        print(f"no finished quickstart in {args.out}", file=sys.stderr)
        return 1
    write_csv(args.out / "quickstart_seeds.csv", rows_of(summaries))
    presets = ", ".join(sorted({str(s.get("preset")) for s in summaries.values()}))
    text = f"Seeds {sorted(summaries)}, preset {presets}; mean ± sd over seeds (each seed's value).\n\n"
    text += markdown(summaries)
    (args.out / "quickstart_seeds.md").write_text(text, encoding="utf-8")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
