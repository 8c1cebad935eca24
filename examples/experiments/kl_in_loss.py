"""GRPO with the KL in the loss on the arithmetic task: the plain k3 loss against an unbiased form, and
clip-higher's effect on entropy (docs/experiments.md, "The KL term in the loss").

With ``online.kl_in_loss`` the KL to the reference is a loss term, ``kl_coef * kl_penalty_loss`` per token.
The plain k3 loss (``kl_loss_estimator=k3``, DeepSeekMath's GRPO as usually written) has the gradient of the
reverse KL(pi_ref || pi) on-policy and a second bias in later PPO epochs; ``k2`` with the importance weight
to pi_old has the gradient of KL(pi || pi_ref) (Liu et al. 2025, arXiv 2510.01555). Each run starts from one
SFT policy of the arithmetic task; the measured figures are the KL to the reference each rollout (k1, nats
per response: ``kl/mean``), the policy's entropy, and greedy held-out exact match after training.

    python examples/experiments/kl_in_loss.py --out runs/kl_in_loss               # task + SFT, then 15 runs
    python examples/experiments/kl_in_loss.py --out runs/kl_in_loss --report-only # table + figure again

Variants (each over ``--seeds``): ``k3`` and ``k2`` at symmetric clipping; ``k2+clip-higher`` with
``online.clip_eps_high=0.28`` (DAPO's value beside clip_eps 0.2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

VARIANTS = {
    "k3": {"online.kl_loss_estimator": "k3"},
    "k2": {"online.kl_loss_estimator": "k2"},
    "k2+clip-higher": {"online.kl_loss_estimator": "k2", "online.clip_eps_high": 0.28},
}


def prepare_base(base: Path, preset) -> None:
    """The arithmetic task's files and its SFT policy (task seed 0), once."""
    from rlhfkit.config import config_from
    from rlhfkit.quickstart.stages import sft_stage
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files
    from rlhfkit.trainers import sft

    if (base / "sft" / "final" / "config.json").is_file():
        return
    task = get_task("arithmetic", seed=0)
    files = prepare_task_files(task, base / "task", preset.model, num_sft=preset.sft_steps * preset.sft_batch)
    settings = {
        "seed": 0,
        "data.max_prompt_length": 16,
        "data.max_length": 16 + preset.response_length,
        **sft_stage(files, preset.sft_steps, preset.sft_batch, preset.sft_lr),
        "train.eval_steps": preset.sft_steps,
        "train.log_steps": 50,
    }
    sft.train(config_from("sft", base / "sft", settings), overwrite=True)


def run_one(base: Path, out: Path, preset, seed: int, variant: str, kl_coef: float) -> dict:
    from rlhfkit.config import config_from
    from rlhfkit.engine.metrics_writer import read_metrics
    from rlhfkit.quickstart.verifiable import measure, rl_overrides
    from rlhfkit.tasks import get_task
    from rlhfkit.trainers import online

    settings = rl_overrides(
        base / "sft" / "final", base / "task" / "prompts_train.jsonl", preset, seed, "grpo"
    )
    settings.update({"online.kl_in_loss": True, "online.kl_coef": kl_coef, **VARIANTS[variant]})
    start = time.perf_counter()
    online.train(config_from("grpo", out, settings), overwrite=True)
    seconds = time.perf_counter() - start
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "kl/mean" in r]
    task = get_task("arithmetic", seed=0)
    after = measure(out / "final", task, base / "task" / "prompts_eval.jsonl", 256, preset.response_length)
    return {
        "variant": variant,
        "seed": seed,
        "kl_coef": kl_coef,
        "train_seconds": seconds,
        "kl": [r["kl/mean"] for r in rows],
        "entropy": [r["entropy/mean"] for r in rows],
        "clipfrac_high": [r.get("clipfrac/high", 0.0) for r in rows],
        **after,
    }


COMPARISONS = (("k2", "k3"), ("k2+clip-higher", "k2"))  # (b, a): each changes one thing


def paired_lines(results: list[dict], tail) -> list[str]:
    """Each comparison b − a of :data:`COMPARISONS` (the estimator at symmetric clipping, then clip-higher at
    the same estimator), paired per seed (the seeds' runs share the SFT policy and prompts): KL (last 10
    rollouts), entropy (last 10), greedy exact match."""
    from rlhfkit.reporting.paired import describe, paired

    lines = ["", "Paired per seed (b − a; 95% t-interval; sign test):", ""]
    for b, a in COMPARISONS:
        base = {r["seed"]: r for r in results if r["variant"] == a}
        rows = sorted(
            (r for r in results if r["variant"] == b and r["seed"] in base), key=lambda r: r["seed"]
        )
        if not rows:
            continue
        figures = (("KL", lambda r: tail(r["kl"]), 2), ("entropy", lambda r: tail(r["entropy"]), 3))
        figures += (("exact match", lambda r: r["exact_match"], 3),)
        cells = [
            f"{name} {describe(paired([f(base[r['seed']]) for r in rows], [f(r) for r in rows]), d)}"
            for name, f, d in figures
        ]
        lines.append(f"- {b} − {a}: " + "; ".join(cells))
    return lines


def report(results: list[dict], out: Path) -> str:
    """A markdown table (mean and per-seed figures, last 10 rollouts for KL and entropy) and a figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def tail(values: list[float]) -> float:
        return statistics.fmean(values[-10:])

    lines = [
        "| variant | KL to ref, last 10 rollouts (nats/response) | entropy, last 10 | greedy EM | seeds |",
        "|---|---|---|---|---|",
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, variant in enumerate(VARIANTS):
        rows = sorted((r for r in results if r["variant"] == variant), key=lambda r: r["seed"])
        if not rows:
            continue
        kl = [tail(r["kl"]) for r in rows]
        ent = [tail(r["entropy"]) for r in rows]
        em = [r["exact_match"] for r in rows]
        cells = [f"{statistics.fmean(x):.3f} ({', '.join(f'{v:.3f}' for v in x)})" for x in (kl, ent, em)]
        lines.append(f"| {variant} | {' | '.join(cells)} | {', '.join(str(r['seed']) for r in rows)} |")
        for r in rows:
            label = variant if r is rows[0] else None
            axes[0].plot(r["kl"], color=f"C{i}", alpha=0.8, label=label)
            axes[1].plot(r["entropy"], color=f"C{i}", alpha=0.8, label=label)
    lines += paired_lines(results, tail)
    axes[0].set(
        xlabel="rollout",
        ylabel="KL to reference (k1, nats per response)",
        title="KL in the loss: KL to the reference per rollout",
    )
    axes[1].set(
        xlabel="rollout",
        ylabel="entropy (nats per token)",
        title="KL in the loss: policy entropy per rollout",
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "kl_in_loss.png", dpi=120)
    plt.close(fig)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rollouts", type=int, default=30)
    parser.add_argument("--kl-coef", type=float, default=0.1)
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: the tiny preset's)")
    parser.add_argument("--smoke", action="store_true", help="the smoke preset (tests)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    from rlhfkit.engine.threads import set_num_threads
    from rlhfkit.quickstart.verifiable import VERIFIABLE_PRESETS

    set_num_threads()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.jsonl"
    preset = VERIFIABLE_PRESETS["smoke" if args.smoke else "tiny"]
    preset = dataclasses.replace(
        preset,
        rollouts=args.rollouts if not args.smoke else preset.rollouts,
        sft_steps=args.sft_steps or preset.sft_steps,
    )
    if not args.report_only:
        prepare_base(out / "base", preset)
        done = {(r["variant"], r["seed"]) for r in _read(results_file)}
        for seed in args.seeds:
            for variant in args.variants:
                if (variant, seed) in done:
                    continue
                result = run_one(out / "base", out / f"{variant}_{seed}", preset, seed, variant, args.kl_coef)
                with results_file.open("a") as f:
                    f.write(json.dumps(result) + "\n")
                print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}), flush=True)
    print(report(_read(results_file), out))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


if __name__ == "__main__":
    main()
