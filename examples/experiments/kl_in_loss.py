"""GRPO with the KL in the loss on the arithmetic task: the plain k3 loss against an unbiased form, and
clip-higher's effect on entropy (docs/experiments.md, "The KL term in the loss").

With ``online.kl_in_loss`` the KL to the reference is a loss term, ``kl_coef * kl_penalty_loss`` per token.
The plain k3 loss (``kl_loss_estimator=k3``, DeepSeekMath's GRPO as usually written) has the gradient of the
reverse KL(pi_ref || pi) on-policy and a second bias in later PPO epochs; ``k2`` with the importance weight
to pi_old has the gradient of KL(pi || pi_ref) (Liu et al. 2025, arXiv 2510.01555). Each run starts from one
SFT policy of the arithmetic task; the measured figures are the KL to the reference each rollout (k1, nats
per response: ``kl/mean``), the policy's entropy, and greedy held-out exact match after training.

    python examples/experiments/kl_in_loss.py --out runs/kl_in_loss               # task + 2 SFTs, then 25 runs
    python examples/experiments/kl_in_loss.py --out runs/kl_in_loss --report-only # table + figure again

Variants (each over ``--seeds``): ``k3`` and ``k2`` at symmetric clipping; ``k2+clip-higher`` with
``online.clip_eps_high=0.28`` (DAPO's value beside clip_eps 0.2). After the preset's 1,200 SFT steps the policy's
entropy is about 0.03 nats per token, a floor from which clip-higher has nothing to keep up; so ``k2`` and
``k2+clip-higher`` run again from a second SFT policy of ``--early-sft-steps`` steps (the same recipe and task
files, a shorter run: :data:`EARLY_SFT_STEPS`, chosen by its measured entropy), the variants ``k2@early-sft``
and ``k2+clip-higher@early-sft``. Each comparison and its claim is in :data:`CLAIMS`; the report prints each
verdict by the page's rule (:func:`rlhfkit.reporting.paired.verdict`) and writes them to ``OUT/verdicts.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

EARLY = "@early-sft"  # a variant so named starts from the SFT policy of --early-sft-steps
VARIANTS = {
    "k3": {"online.kl_loss_estimator": "k3"},
    "k2": {"online.kl_loss_estimator": "k2"},
    "k2+clip-higher": {"online.kl_loss_estimator": "k2", "online.clip_eps_high": 0.28},
    "k2" + EARLY: {"online.kl_loss_estimator": "k2"},
    "k2+clip-higher" + EARLY: {"online.kl_loss_estimator": "k2", "online.clip_eps_high": 0.28},
}
# SFT steps of the high-entropy start, chosen by the policy's entropy at the first rollout (nats per token; seed 0,
# tiny preset, one thread; `kl_in_loss.py --seeds 0 --variants k2 --rollouts 3 --sft-steps N`; greedy exact match
# after the 3 rollouts in brackets): 100 steps 1.08 (0.02), 200 steps 0.35 (0.05), 300 steps 0.13 (0.14), 600
# steps 0.047 (0.64), 1,200 steps 0.034 (0.78), the floor. From 200 steps (0.42 at the first rollout on the
# 1,200-step run's task files) k2's entropy stays at 0.43 over 30 rollouts and clip-higher's ends 0.07 above it;
# from 300 steps the two end within 0.01 of each other (one seed each).
EARLY_SFT_STEPS = {"tiny": 200, "smoke": 3}


TASK_FILES = ("sft_train", "sft_eval", "prompts_train", "prompts_eval")


def prepare_task(task_dir: Path, preset) -> dict[str, Path]:
    """The arithmetic task's model, tokenizer, SFT examples and prompts (task seed 0), once; their paths."""
    from rlhfkit.tasks import get_task
    from rlhfkit.tasks.files import prepare_task_files

    files = {"init_model": task_dir / "init_model", **{n: task_dir / f"{n}.jsonl" for n in TASK_FILES}}
    if all(path.exists() for path in files.values()):
        return files
    num_sft = preset.sft_steps * preset.sft_batch
    return prepare_task_files(get_task("arithmetic", seed=0), task_dir, preset.model, num_sft=num_sft)


def prepare_sft(folder: Path, preset, files: dict[str, Path], steps: int) -> Path:
    """An SFT policy of ``steps`` steps (the preset's batch, peak rate and schedule) on ``files``, once (a shorter
    run sees a prefix of the same examples); its path."""
    from rlhfkit.config import config_from
    from rlhfkit.quickstart.stages import sft_stage
    from rlhfkit.trainers import sft

    if not (folder / "final" / "config.json").is_file():
        settings = {
            "seed": 0,
            "data.max_prompt_length": 16,
            "data.max_length": 16 + preset.response_length,
            **sft_stage(files, steps, preset.sft_batch, preset.sft_lr),
            "train.eval_steps": steps,
            "train.log_steps": 50,
        }
        sft.train(config_from("sft", folder, settings), overwrite=True)
    return folder / "final"


def run_one(
    base: Path, out: Path, preset, seed: int, variant: str, kl_coef: float, policy: Path, sft_steps: int
) -> dict:
    """One GRPO run of ``variant`` from the SFT policy ``policy`` (of ``sft_steps`` steps) on ``base``'s task."""
    from rlhfkit.config import config_from
    from rlhfkit.engine.metrics_writer import read_metrics
    from rlhfkit.quickstart.verifiable import measure, rl_overrides
    from rlhfkit.tasks import get_task
    from rlhfkit.trainers import online

    settings = rl_overrides(policy, base / "task" / "prompts_train.jsonl", preset, seed, "grpo")
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
        "sft_steps": sft_steps,
        "train_seconds": seconds,
        "kl": [r["kl/mean"] for r in rows],
        "entropy": [r["entropy/mean"] for r in rows],
        "clipfrac_high": [r.get("clipfrac/high", 0.0) for r in rows],
        **after,
    }


# (b, a): each changes one thing; the last, clip-higher from the high-entropy start
COMPARISONS = (("k2", "k3"), ("k2+clip-higher", "k2"), ("k2+clip-higher" + EARLY, "k2" + EARLY))
# (claim, b, a, figure, claimed sign of b − a): the claims the page's verdicts are computed for
CLAIMS = (
    ("KL, k2 − k3", "k2", "k3", "KL", 1),
    ("entropy, clip-higher − k2", "k2+clip-higher", "k2", "entropy", 1),
    (
        "entropy, clip-higher − k2 (from the high-entropy start)",
        "k2+clip-higher" + EARLY,
        "k2" + EARLY,
        "entropy",
        1,
    ),
)


def figures_of(tail) -> dict:
    """The compared figures of a run: KL and entropy over the last rollouts (``tail``), greedy exact match."""
    return {
        "KL": lambda r: tail(r["kl"]),
        "entropy": lambda r: tail(r["entropy"]),
        "exact match": lambda r: r["exact_match"],
    }


def paired_figure(results: list[dict], b: str, a: str, figure):
    """``figure`` of variant b − variant a paired by seed, over the seeds both have (None if they share none)."""
    from rlhfkit.reporting.paired import paired

    base = {r["seed"]: r for r in results if r["variant"] == a}
    rows = sorted((r for r in results if r["variant"] == b and r["seed"] in base), key=lambda r: r["seed"])
    return paired([figure(base[r["seed"]]) for r in rows], [figure(r) for r in rows]) if rows else None


def paired_lines(results: list[dict], tail) -> list[str]:
    """Each comparison b − a of :data:`COMPARISONS` (the estimator at symmetric clipping, then clip-higher at
    the same estimator, from each start), paired per seed (the seeds' runs share the SFT policy and prompts):
    KL (last 10 rollouts), entropy (last 10), greedy exact match."""
    from rlhfkit.reporting.paired import describe

    lines = ["", "Paired per seed (b − a; 95% t-interval; sign test):", ""]
    digits = {"KL": 2, "entropy": 3, "exact match": 3}
    for b, a in COMPARISONS:
        tests = {name: paired_figure(results, b, a, f) for name, f in figures_of(tail).items()}
        if None in tests.values():
            continue
        lines.append(f"- {b} − {a}: " + "; ".join(f"{n} {describe(p, digits[n])}" for n, p in tests.items()))
    return lines


def verdicts(results: list[dict], tail) -> list[dict]:
    """Each claim of :data:`CLAIMS` whose two variants share a seed: its paired test and verdict by the page's rule
    (:func:`rlhfkit.reporting.paired.verdict`: holds / fails / open here)."""
    from rlhfkit.reporting.paired import verdict

    out = []
    for claim, b, a, figure, sign in CLAIMS:
        test = paired_figure(results, b, a, figures_of(tail)[figure])
        if test is not None:
            out.append(
                {"claim": claim, "b": b, "a": a, "direction": sign, "verdict": verdict(test, sign)}
                | {
                    "mean": test.mean,
                    "low": test.low,
                    "high": test.high,
                    "differences": list(test.differences),
                }
            )
    return out


def report(results: list[dict], out: Path) -> str:
    """A markdown table (mean and per-seed figures, last 10 rollouts for KL and entropy; the entropy at the first
    rollout, where each start is), the paired comparisons, the verdicts (also ``out/verdicts.json``) and a
    figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def tail(values: list[float]) -> float:
        return statistics.fmean(values[-10:])

    lines = [
        "| variant | SFT steps | entropy, rollout 1 | KL to ref, last 10 rollouts (nats/response) | entropy, last 10"
        " | greedy EM | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, variant in enumerate(VARIANTS):
        rows = sorted((r for r in results if r["variant"] == variant), key=lambda r: r["seed"])
        if not rows:
            continue
        kl = [tail(r["kl"]) for r in rows]
        ent = [tail(r["entropy"]) for r in rows]
        em = [r["exact_match"] for r in rows]
        first = [r["entropy"][0] for r in rows]
        cells = [
            f"{statistics.fmean(x):.3f} ({', '.join(f'{v:.3f}' for v in x)})" for x in (first, kl, ent, em)
        ]
        steps = ", ".join(sorted({str(r["sft_steps"]) for r in rows}))
        lines.append(
            f"| {variant} | {steps} | {' | '.join(cells)} | {', '.join(str(r['seed']) for r in rows)} |"
        )
        for r in rows:
            label = variant if r is rows[0] else None
            axes[0].plot(r["kl"], color=f"C{i}", alpha=0.8, label=label)
            axes[1].plot(r["entropy"], color=f"C{i}", alpha=0.8, label=label)
    lines += paired_lines(results, tail)
    decided = verdicts(results, tail)
    (out / "verdicts.json").write_text(json.dumps(decided, indent=1))
    if decided:
        lines += ["", "Verdicts (the page's rule on the paired 95% t-interval):", ""]
        lines += [f"- {v['claim']}: {v['verdict']}" for v in decided]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rollouts", type=int, default=30)
    parser.add_argument("--kl-coef", type=float, default=0.1)
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: the tiny preset's)")
    parser.add_argument(
        "--early-sft-steps",
        type=int,
        default=None,
        help=f"SFT steps of the high-entropy start of the {EARLY} variants (default: {EARLY_SFT_STEPS['tiny']}; "
        f"smoke {EARLY_SFT_STEPS['smoke']})",
    )
    parser.add_argument("--smoke", action="store_true", help="the smoke preset (tests)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
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
    early = args.early_sft_steps or EARLY_SFT_STEPS["smoke" if args.smoke else "tiny"]
    if not 1 <= early < preset.sft_steps:
        parser.error(f"--early-sft-steps {early}: between 1 and the SFT steps ({preset.sft_steps}) - 1")

    def sft_steps_of(variant: str) -> int:
        return early if variant.endswith(EARLY) else preset.sft_steps

    if not args.report_only:
        base = out / "base"
        files = prepare_task(base / "task", preset)
        policies = {
            steps: prepare_sft(
                base / ("sft" if steps == preset.sft_steps else f"sft-{steps}"), preset, files, steps
            )
            for steps in sorted({sft_steps_of(v) for v in args.variants})
        }
        done = {(r["variant"], r["seed"], r.get("sft_steps", preset.sft_steps)) for r in _read(results_file)}
        for seed in args.seeds:
            for variant in args.variants:
                steps = sft_steps_of(variant)
                if (variant, seed, steps) in done:
                    continue
                folder = out / f"{variant}_{seed}"
                result = run_one(base, folder, preset, seed, variant, args.kl_coef, policies[steps], steps)
                with results_file.open("a") as f:
                    f.write(json.dumps(result) + "\n")
                print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}), flush=True)
    # the runs of the current starts (an early start of other steps, rerun since, is left out)
    results = [{"sft_steps": preset.sft_steps, **r} for r in _read(results_file)]  # older lines: the preset's
    results = [r for r in results if r["sft_steps"] == sft_steps_of(r["variant"])]
    print(report(results, out))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


if __name__ == "__main__":
    main()
