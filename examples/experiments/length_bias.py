"""Length bias: the reward model's preference for longer answers, and three mitigations against it.

Reward models trained on human preferences tend to score longer responses higher whatever their content, and
PPO then lengthens its answers to collect that (Singhal et al. 2023, "A Long Way to Go: Investigating Length
Correlations in RLHF"). Three mitigations that rlhfkit has: a length penalty in reward-model training
(``reward.length_bias_coef``: c * cov(r, z)^2 over each micro-batch, z the standardised length; Singhal et al.
2023), the KL penalty (``online.kl_coef``), and the online reward-model refresh (new pairs from the current
policy, labelled by the annotators; ``refresh.every``). On the built-in task, per seed (``ppo_sweep.py``'s SFT
policy, pairs and reward model; one ``--out`` serves both):

1. a second reward model on the same pairs with ``reward.length_bias_coef`` = ``--length-bias-coef``; for both,
   the length preference on the held-out pairs: the correlation of the score with the response length, against
   the gold score's own correlation with length (the reward trainer's ``heldout_length_correlation`` and
   ``heldout_gold_length_correlation``);
2. PPO arms: ``rm-kl0`` (the plain reward model, no KL penalty: no mitigation, the base), ``rm-kl0.05`` (the KL
   penalty), ``rm-kl0-refresh`` (the refresh every ``--refresh-every`` rollouts), ``lb-kl0`` (the length-penalised
   reward model) and ``lb-kl0.05`` (both); held-out gold, proxy, KL to SFT, length and validity every
   ``--eval-every`` rollouts.

Writes ``OUT/length_bias.md``, ``length_bias_rows.csv``, ``length_bias_train.csv`` and ``length_bias.png``::

    RLHFKIT_NUM_THREADS=1 python examples/experiments/length_bias.py --out runs/ppo_sweep --jobs 2   # 5 seeds
    python examples/experiments/length_bias.py --out runs/ppo_sweep --report-only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo_arms  # noqa: E402
from temperature import sizes_of  # noqa: E402

ARMS = ("rm-kl0", "rm-kl0.05", "rm-kl0-refresh", "lb-kl0", "lb-kl0.05")
BASE = "rm-kl0"
# Each mitigation against no mitigation: shorter answers at the end (the claim), read from the held-out length.
CLAIMS = {name: ("length", -1) for name in ARMS if name != BASE}


def arms_of(refresh_every: int, names=ARMS) -> list[ppo_arms.Arm]:
    every = {
        "rm-kl0": ppo_arms.Arm(
            "rm-kl0", "plain RM, kl_coef 0", kl_coef=0.0, folder="kl0-gamma1"
        ),  # ppo_sweep's
        "rm-kl0.05": ppo_arms.Arm(
            "rm-kl0.05", "plain RM, kl_coef 0.05", kl_coef=0.05, folder="kl0.05-gamma1"
        ),
        "rm-kl0-refresh": ppo_arms.Arm(
            "rm-kl0-refresh",
            f"plain RM, kl_coef 0, refresh every {refresh_every}",
            kl_coef=0.0,
            refresh_every=refresh_every,
        ),  # fmt: skip
        "lb-kl0": ppo_arms.Arm("lb-kl0", "length-penalised RM, kl_coef 0", kl_coef=0.0, reward="length_bias"),
        "lb-kl0.05": ppo_arms.Arm(
            "lb-kl0.05", "length-penalised RM, kl_coef 0.05", kl_coef=0.05, reward="length_bias"
        ),
    }
    return [every[n] for n in names]


def run_stage(root: Path, stage: dict, seed: int, s, args) -> dict:
    """The length-penalised reward model, both reward models' length preference, then the arms."""
    penalised = ppo_arms.train_reward_variant(
        root / "reward-length-bias", stage, stage["pairs"]["train"], seed, s, args,
        **{"reward.length_bias_coef": args.length_bias_coef},
    )  # fmt: skip
    stage = {**stage, "rewards": {**stage["rewards"], "length_bias": penalised}}
    preference = {}
    for key, folder in stage["rewards"].items():
        summary_file = Path(folder).parent / "summary.json"  # the reward trainer's held-out figures
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        preference[key] = {
            "length_correlation": summary.get("heldout_length_correlation"),
            "gold_length_correlation": summary.get("heldout_gold_length_correlation"),
            "accuracy": summary.get("heldout_accuracy"),
            "gold_accuracy": summary.get("heldout_gold_accuracy"),
        }
    arms = arms_of(args.refresh_every, args.arms)
    return {**ppo_arms.run_arms(root, stage, seed, s, arms, args), "preference": preference}


def run_seed(seed: int, args) -> dict:
    s = sizes_of(args)
    root = args.out / f"seed-{seed}"
    return run_stage(root, ppo_arms.seed_stage(root, seed, s, args), seed, s, args)


def _num(x, digits=2):
    return "–" if x is None or x != x else f"{x:.{digits}f}"


def preference_lines(results: list[dict]) -> list[str]:
    """The reward models' length preference, paired per seed: the premise (the plain reward model prefers length
    more than gold does) and the penalty's aim (no length preference, whichever its sign: |correlation| towards
    0)."""
    from rlhfkit.reporting.paired import describe, paired, verdict

    a = [r["preference"]["reward"]["length_correlation"] for r in results]
    b = [r["preference"]["length_bias"]["length_correlation"] for r in results]
    gold = [r["preference"]["reward"]["gold_length_correlation"] for r in results]
    lines = []
    if _numbers(a + gold):
        premise = paired(gold, a)
        lines += ["", f"Plain − gold score–length correlation: {describe(premise)}; premise (the reward model "
                  f"prefers length more than gold does): {verdict(premise, +1)}."]  # fmt: skip
    if _numbers(a + b):
        aim = paired([abs(x) for x in a], [abs(x) for x in b])
        lines += ["", f"Length-penalised − plain |score–length correlation|: {describe(aim)}; claim (the penalty "
                  f"takes the correlation towards 0): {verdict(aim, -1)}."]  # fmt: skip
    return lines


def _numbers(values) -> bool:
    return all(x is not None and x == x for x in values)


def markdown(results: list[dict], arms) -> str:
    lines = [
        "| reward model | score–length correlation per seed | gold–length correlation | held-out accuracy |"
    ]
    lines.append("|---|---|---|---|")
    for key, label in (("reward", "plain"), ("length_bias", "length-penalised")):
        cells = [" / ".join(_num(r["preference"][key][f]) for r in results) for f in
                 ("length_correlation", "gold_length_correlation", "accuracy")]  # fmt: skip
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += preference_lines(results)
    lines += ["", ppo_arms.end_table(results, arms)]
    if BASE in {a.name for a in arms}:
        lines += ["", ppo_arms.paired_table(results, arms, BASE, CLAIMS)]
    return "\n".join(lines)


def plot(path: Path, rows: list[dict], results: list[dict], arms) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16.0, 8.6), dpi=100)
    ppo_arms.common_panels(axes[0], rows, arms, "Length bias")
    for i, arm in enumerate(arms):
        xs, means, sds = ppo_arms.curve(rows, arm.name, "length")
        axes[1][0].errorbar(xs, means, sds, marker="o", capsize=3, color=f"C{i}", label=arm.label)
        xs, gold, _ = ppo_arms.curve(rows, arm.name, "gold")
        _, length, _ = ppo_arms.curve(rows, arm.name, "length")
        axes[1][1].plot(length, gold, "o-", color=f"C{i}", label=arm.label)
    axes[1][0].set(title="Length bias: response length (held out)", xlabel="rollout", ylabel="tokens")
    axes[1][1].set(title="Length bias: gold against length along each run", xlabel="response length (tokens)",
                   ylabel="gold score")  # fmt: skip
    width = 0.35
    for j, (key, label) in enumerate((("reward", "plain RM"), ("length_bias", "length-penalised RM"))):
        values = [r["preference"][key]["length_correlation"] for r in results]
        axes[1][2].bar(
            [k + j * width for k in range(len(results))], [v or 0.0 for v in values], width, label=label
        )
    gold = [r["preference"]["reward"]["gold_length_correlation"] for r in results]
    axes[1][2].plot(range(len(results)), [g or 0.0 for g in gold], "k_", markersize=20, label="gold score")
    axes[1][2].set(title="Length bias: score–length correlation on held-out pairs", xlabel="seed",
                   ylabel="Pearson correlation", xticks=range(len(results)),
                   xticklabels=[str(r["seed"]) for r in results])  # fmt: skip
    for ax in axes[1]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(out: Path, results: list[dict], refresh_every: int, names=ARMS) -> str:
    arms = arms_of(refresh_every, names)
    text = markdown(results, arms)
    rows, _ = ppo_arms.write_report(out, "length_bias", results, arms, text)
    plot(out / "length_bias.png", rows, results, arms)
    return text


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ppo_arms.add_arguments(p)
    p.add_argument(
        "--length-bias-coef", type=float, default=1.0, help="reward.length_bias_coef of the second RM"
    )
    p.add_argument("--refresh-every", type=int, default=5, help="refresh.every of the refresh arm (rollouts)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms to run")
    args = p.parse_args(argv)
    if args.length_bias_coef <= 0 or args.refresh_every < 1:
        p.error("--length-bias-coef must be > 0 and --refresh-every >= 1")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = ppo_arms.run_seeds(__file__, argv, args, run_seed)
    if results is None:
        return 1
    if not args.no_report:
        report(args.out, results, args.refresh_every, tuple(args.arms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
