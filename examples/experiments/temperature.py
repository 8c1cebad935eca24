"""What PPO does to the output distribution: gold, proxy and sharpness of SFT and PPO policies at 0 <= T <= 1.

The claim tested (a common account of classic RLHF): after PPO the output distribution is sharper
(mode-seeking), less diverse, and the policy is at its best decoded greedily (T = 0), while an SFT policy is
best sampled at about T = 0.7. On the built-in ``reviews`` task, for each seed:

1. an SFT policy and a reward model, as the quickstart trains them (fewer pairs and reward-model steps);
2. three PPO runs from that SFT policy against that reward model (the quickstart's PPO otherwise):
   ``ppo`` (trained at T = 0.7, KL coefficient 0.1), ``ppo-T1`` (trained at T = 1.0) and ``ppo-kl/4``
   (KL coefficient 0.025, twice as many rollouts: the run that goes furthest from the SFT policy);
3. every ``--eval-every`` rollouts (PPO's evaluation hook: its own seeded RNG, nothing of training changes)
   and for the SFT policy: one response to each of ``--eval-prompts`` held-out prompts at each temperature
   (0 = greedy; every cell with the same sampling seed), measured with
   :func:`rlhfkit.rollout.sharpness.measure_policy`: gold (the task's annotators' criterion), proxy (the
   reward model PPO optimised), validity, length, distinct responses, KL to the SFT policy (k1, nats per
   response, at the sampling temperature), and on the tokens of those responses the per-token entropy and
   top-token probability of the policy's own distribution (T = 1) and of the SFT policy's, and how often
   their most likely tokens agree.

Writes ``OUT/rows.csv`` (one row per seed, run, rollout and temperature), ``OUT/table.csv`` (means and
standard deviations over seeds), ``OUT/table.md`` and ``OUT/temperature.png``. Every seed's stages live in
``OUT/seed-N/``; a finished stage is reused (``--overwrite`` reruns them)::

    RLHFKIT_NUM_THREADS=1 python examples/experiments/temperature.py --out runs/temperature
    python examples/experiments/temperature.py --out runs/temperature --jobs 2   # two seeds at a time
    python examples/experiments/temperature.py --out runs/temperature --report-only
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

TEMPERATURES = (0.0, 0.3, 0.7, 1.0)
FIGURES = ("gold", "proxy", "valid_rate", "length", "distinct_rate", "kl", "entropy", "top_mass")
FIGURES += ("ref_entropy", "ref_top_mass", "top_agree")


@dataclass(frozen=True)
class Sizes:
    """How big each stage is (the defaults: the quickstart's tiny preset, fewer pairs and reward steps)."""

    model: str = "tiny"
    sft_steps: int = 300
    sft_batch: int = 32
    sft_lr: float = 3e-3
    pairs: int = 1024
    rm_steps: int = 150
    rm_batch: int = 64
    rm_lr: float = 5e-4
    ppo_batch: int = 32
    ppo_lr: float = 1e-4
    response_length: int = 48
    rollouts: int = 40
    eval_every: int = 10
    eval_prompts: int = 128


SIZES = {
    "default": Sizes(),
    "smoke": Sizes(
        sft_steps=4,
        sft_batch=8,
        pairs=16,
        rm_steps=2,
        rm_batch=8,
        ppo_batch=4,
        response_length=12,
        rollouts=2,
        eval_every=2,
        eval_prompts=6,
    ),
}


RUN_ORDER = ("sft", "ppo", "ppo-T1", "ppo-kl/4")
TRAIN_TEMPERATURE = {"sft": 0.7, "ppo": 0.7, "ppo-T1": 1.0, "ppo-kl/4": 0.7}  # SFT: the usual sampling T


def runs_of(sizes: Sizes) -> dict[str, dict]:
    """The PPO variants: training temperature, KL coefficient, rollouts."""
    return {
        "ppo": {"temperature": TRAIN_TEMPERATURE["ppo"], "kl_coef": 0.1, "rollouts": sizes.rollouts},
        "ppo-T1": {"temperature": TRAIN_TEMPERATURE["ppo-T1"], "kl_coef": 0.1, "rollouts": sizes.rollouts},
        "ppo-kl/4": {
            "temperature": TRAIN_TEMPERATURE["ppo-kl/4"],
            "kl_coef": 0.025,
            "rollouts": 2 * sizes.rollouts,
        },
    }


def _config(kind: str, out: Path, overrides: dict):
    from rlhfkit.config import load_config

    return load_config(None, [f"output_dir={out}", *(f"{k}={v}" for k, v in overrides.items())], kind)


def _done(folder: Path, args) -> bool:
    return (folder / "summary.json").is_file() and not args.overwrite


def train_sft_and_reward(root: Path, seed: int, s: Sizes, args) -> dict:
    """Task files, SFT policy, labelled pairs and reward model of one seed (the quickstart's stages 1-4)."""
    from rlhfkit.rollout.pairs import label_pairs
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files
    from rlhfkit.trainers import reward, sft

    task = get_task("reviews", seed=seed)
    files = prepare_task_files(task, root / "task", s.model, num_sft_eval=min(256, 4 * s.eval_prompts))
    common = {"seed": seed, "data.max_prompt_length": 32, "data.max_length": 32 + s.response_length}
    if not _done(root / "sft", args):
        print(f"seed {seed}: SFT, {s.sft_steps} steps", flush=True)
        sft.train(
            _config(
                "sft",
                root / "sft",
                {
                    **common,
                    "model.name_or_path": files["init_model"],
                    "data.train_file": files["sft_train"],
                    "data.eval_file": files["sft_eval"],
                    "train.max_steps": s.sft_steps,
                    "train.batch_size": s.sft_batch,
                    "train.learning_rate": s.sft_lr,
                    "train.warmup_steps": max(1, s.sft_steps // 20),
                    "train.lr_schedule": "cosine",
                    "train.save_steps": s.sft_steps,
                    "train.eval_steps": s.sft_steps,
                    "train.log_steps": 10,
                },
            ),
            overwrite=True,
        )
    sft_dir = root / "sft" / "final"
    pairs_dir = root / "pairs"
    if args.overwrite or not (pairs_dir / "pairs_train.jsonl").is_file():
        print(f"seed {seed}: {s.pairs} labelled pairs", flush=True)
        label_pairs(
            str(sft_dir),
            pairs_dir,
            task=task.name,
            task_seed=seed,
            num_pairs=s.pairs,
            num_eval_pairs=max(16, s.pairs // 4),
            seed=seed,
            max_new_tokens=s.response_length,
            overwrite=True,
        )
    if not _done(root / "reward", args):
        print(f"seed {seed}: reward model, {s.rm_steps} steps", flush=True)
        reward.train(
            _config(
                "reward",
                root / "reward",
                {
                    **common,
                    "model.name_or_path": sft_dir,
                    "data.train_file": pairs_dir / "pairs_train.jsonl",
                    "data.eval_file": pairs_dir / "pairs_eval.jsonl",
                    "train.max_steps": s.rm_steps,
                    "train.batch_size": s.rm_batch,
                    "train.learning_rate": s.rm_lr,
                    "train.weight_decay": 0.1,
                    "train.warmup_steps": max(1, s.rm_steps // 15),
                    "train.lr_schedule": "linear",
                    "train.save_steps": s.rm_steps,
                    "train.eval_steps": s.rm_steps,
                    "train.log_steps": 10,
                },
            ),
            overwrite=True,
        )
    rm_summary = json.loads((root / "reward" / "summary.json").read_text())
    return {
        "task": task,
        "files": files,
        "sft": sft_dir,
        "reward": root / "reward" / "final",
        "rm_accuracy": rm_summary.get("heldout_gold_accuracy"),
    }


class Evaluator:
    """Measures a policy at every temperature on the held-out prompts; collects one row per temperature."""

    def __init__(self, stage: dict, s: Sizes, seed: int, temperatures):
        from rlhfkit.data import TokenLimits, prepare_examples
        from rlhfkit.models import load_causal_lm, load_scalar_model, load_tokenizer

        self.stage, self.sizes, self.seed, self.temperatures = stage, s, seed, temperatures
        self.tokenizer = load_tokenizer(str(stage["sft"]))
        self.reference = load_causal_lm(str(stage["sft"]), tokenizer=self.tokenizer, frozen=True).eval()
        self.reward_model = load_scalar_model(
            str(stage["reward"]), tokenizer=self.tokenizer, frozen=True
        ).eval()
        examples = prepare_examples(
            str(stage["files"]["prompts_eval"]), "prompts", self.tokenizer, TokenLimits(32, None, "left")
        )
        self.examples = examples[: s.eval_prompts]

    def measure(self, policy, run: str, rollout: int) -> list[dict]:
        import torch

        from rlhfkit.rollout.sharpness import measure_policy

        rows = []
        for i, temperature in enumerate(self.temperatures):
            torch.manual_seed(1000 * self.seed + i)  # the same sampling seed for every checkpoint
            figures = measure_policy(
                policy,
                self.tokenizer,
                self.examples,
                temperature=temperature,
                max_new_tokens=self.sizes.response_length,
                reference=self.reference,
                reward_model=self.reward_model,
                gold_score=self.stage["task"].gold_score,
                is_valid=self.stage["task"].is_valid,
            )
            rows.append(
                {"seed": self.seed, "run": run, "rollout": rollout, "temperature": temperature, **figures}
            )
        return rows


def run_seed(seed: int, s: Sizes, args) -> list[dict]:
    """Every stage of one seed; its rows (cached in ``OUT/seed-N/rows.json``)."""
    from rlhfkit.trainers import online

    root = args.out / f"seed-{seed}"
    cache = root / "rows.json"
    if cache.is_file() and not args.overwrite:
        return json.loads(cache.read_text())
    stage = train_sft_and_reward(root, seed, s, args)
    ev = Evaluator(stage, s, seed, args.temperatures)
    print(f"seed {seed}: the SFT policy at T = {args.temperatures}", flush=True)
    rows = ev.measure(ev.reference, "sft", 0)
    for name, run in runs_of(s).items():
        folder = root / name.replace("/", "-")
        print(f"seed {seed}: {name} ({run}), measured every {s.eval_every} rollouts", flush=True)

        def hook(policy, step, name=name, run=run):
            measured = ev.measure(policy, name, step)
            rows.extend(measured)
            at_train = next(r for r in measured if r["temperature"] == run["temperature"])
            return {"eval/gold/mean": at_train["gold"], "eval/score/mean": at_train["proxy"]}

        cfg = _config(
            "ppo",
            folder,
            {
                "seed": seed,
                "model.name_or_path": stage["sft"],
                "data.train_file": stage["files"]["prompts_train"],
                "data.max_prompt_length": 32,
                "online.reward_model": stage["reward"],
                "online.response_length": s.response_length,
                "online.temperature": run["temperature"],
                "online.kl_coef": run["kl_coef"],
                "train.max_steps": run["rollouts"],
                "train.batch_size": s.ppo_batch,
                "train.learning_rate": s.ppo_lr,
                "train.lr_schedule": "linear",
                "train.save_steps": run["rollouts"],
                "train.eval_steps": s.eval_every,
                "train.log_steps": 1,
            },
        )
        online.train(cfg, overwrite=True, hooks=online.OnlineHooks(evaluate=hook, evaluate_at_start=False))
    info = {"seed": seed, "rm_accuracy": stage["rm_accuracy"]}
    for r in rows:
        r["rm_accuracy"] = info["rm_accuracy"]
    cache.write_text(json.dumps(rows, indent=1))
    return rows


# ----------------------------------------------------------------------------------------------------------
# The table


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


def _pm(row, f, digits=2):
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
        golds = " | ".join(_pm(cells[t], "gold") if t in cells else "–" for t in temperatures)
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
            _pm(r, f, 1 if f in ("length",) else 2)
            for f in ("gold", "proxy", "valid_rate", "length", "distinct_rate", "kl", "entropy", "top_mass")
        )
        sft_side = " | ".join(_pm(r, f) for f in ("ref_entropy", "ref_top_mass", "top_agree"))
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
    """Gold against temperature (last checkpoints); greedy minus T=0.7 gold, entropy and top-token mass
    against KL (every checkpoint); validity against temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19.0, 4.3), dpi=100)
    last: dict[str, int] = {}
    for r in table:
        last[r["run"]] = max(r["rollout"], last.get(r["run"], 0))
    for i, run in enumerate(r for r in RUN_ORDER if r in last):
        mine = [r for r in table if r["run"] == run]
        final = sorted((r for r in mine if r["rollout"] == last[run]), key=lambda r: r["temperature"])
        label = f"{run} (rollout {last[run]}, KL {final[0]['kl_train']:.1f})" if run != "sft" else "sft"
        for ax, f in ((axes[0], "gold"), (axes[3], "valid_rate")):
            sd = [r.get(f + "_sd") or 0.0 for r in final]
            ax.errorbar([r["temperature"] for r in final], [r[f] for r in final], sd, marker="o", capsize=3,
                        color=f"C{i}", label=label)  # fmt: skip
        by_ckpt: dict[int, dict[float, dict]] = {}
        for r in mine:
            by_ckpt.setdefault(r["rollout"], {})[r["temperature"]] = r
        points = sorted(
            (c[0.7]["kl_train"], c[0.0]["gold"] - c[0.7]["gold"], c[0.7]["entropy"], c[0.7]["top_mass"])
            for c in by_ckpt.values()
            if 0.0 in c and 0.7 in c
        )
        if points:
            kl, gap, ent, top = (np.array(x) for x in zip(*points, strict=True))
            axes[1].plot(kl, gap, "o-", color=f"C{i}", label=run)
            axes[2].plot(kl, ent, "o-", color=f"C{i}", label=f"{run}: entropy")
            axes[2].plot(kl, top, "s--", color=f"C{i}", alpha=0.6, label=f"{run}: top-token mass")
    axes[0].set(title="Gold score by sampling temperature (held out)", xlabel="temperature (0 = greedy)")
    axes[1].set(title="Greedy minus T=0.7 gold, along the runs", xlabel="KL to SFT (nats/response)")
    axes[2].set(title="Sharpness on T=0.7 samples (policy at T=1)", xlabel="KL to SFT (nats/response)")
    axes[3].set(title="Valid responses", xlabel="temperature (0 = greedy)", ylim=(0, 1.05))
    axes[1].axhline(0.0, color="black", linewidth=0.6)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES), help="0 = greedy")
    p.add_argument("--size", choices=sorted(SIZES), default="default", help="smoke: seconds, for the tests")
    for field, value in asdict(Sizes()).items():
        if field != "model":
            p.add_argument("--" + field.replace("_", "-"), type=type(value), help=f"default {value}")
    p.add_argument("--jobs", type=int, default=1, help="seeds run at once, each in its own process")
    p.add_argument("--overwrite", action="store_true", help="rerun finished stages")
    p.add_argument("--report-only", action="store_true", help="only the table and plot from OUT")
    p.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if 0.7 not in args.temperatures or 0.0 not in args.temperatures:
        p.error("--temperatures must include 0 and 0.7 (the table compares greedy with T = 0.7)")
    if any(t < 0 for t in args.temperatures):
        p.error("--temperatures must be >= 0")
    return args


def sizes_of(args) -> Sizes:
    s = SIZES[args.size]
    return replace(s, **{k: getattr(args, k) for k in asdict(s) if getattr(args, k, None) is not None})


def child_argv(args, seed: int) -> list[str]:
    argv = ["--out", str(args.out), "--seeds", str(seed), "--size", args.size, "--no-report"]
    argv += ["--temperatures", *map(str, args.temperatures)]
    for field, value in asdict(sizes_of(args)).items():
        if field != "model":
            argv += ["--" + field.replace("_", "-"), str(value)]
    return argv + (["--overwrite"] if args.overwrite else [])


def main(argv=None) -> int:
    from rlhfkit.engine.threads import set_num_threads

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        s = sizes_of(args)
        if args.jobs > 1 and len(args.seeds) > 1:
            env = {**os.environ, "RLHFKIT_NUM_THREADS": os.environ.get("RLHFKIT_NUM_THREADS", "1")}
            pending = list(args.seeds)
            running: list[subprocess.Popen] = []
            while pending or running:
                while pending and len(running) < args.jobs:
                    cmd = [sys.executable, os.path.abspath(__file__), *child_argv(args, pending.pop(0))]
                    running.append(subprocess.Popen(cmd, env=env))
                running[0].wait()
                if running[0].returncode != 0:
                    print(f"a seed failed: {' '.join(running[0].args)}", file=sys.stderr)
                    return 1
                running.pop(0)
        else:
            set_num_threads()
            for seed in args.seeds:
                run_seed(seed, s, args)
    if not args.no_report:
        report(args.out, args.temperatures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
