"""An over-fitted reward model gets hacked: a reward model that fits its training pairs perfectly, against one
trained as usual, proxy and gold along PPO.

The other half of the overoptimization claim (Gao, Schulman & Hilton 2022; ``overoptimization_quality.py`` varies
the reward model's data): a reward model that has memorised its training pairs — training accuracy 1.0 against
its labels, above the annotators' own agreement — scores what it memorised, not what the annotators want, so PPO
against it should drive the proxy up while gold stalls or falls, sooner than against a reward model trained as
usual. On the built-in task, per seed (``ppo_sweep.py``'s SFT policy, pairs and reward model; one ``--out``
serves both):

1. the over-fitted reward model: from the SFT policy on the first ``--overfit-pairs`` training pairs, for
   ``--overfit-steps`` steps without weight decay; for it and the usual one, the accuracy on its own training
   pairs (against the labels), on the held-out pairs, and against gold on the held-out pairs;
2. PPO arms: ``rm-kl0`` (the usual reward model, no KL penalty: the base), ``overfit-kl0``, and both at
   kl_coef 0.05 (``rm-kl0.05``, ``overfit-kl0.05``); held-out gold, proxy (each arm's own reward model), KL to
   SFT, length and validity every ``--eval-every`` rollouts.

Writes ``OUT/overfit_reward.md``, ``overfit_reward_rows.csv``, ``overfit_reward_train.csv`` and
``overfit_reward.png``::

    RLHFKIT_NUM_THREADS=1 python examples/experiments/overfit_reward.py --out runs/ppo_sweep --jobs 2   # 5 seeds
    python examples/experiments/overfit_reward.py --out runs/ppo_sweep --report-only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo_arms  # noqa: E402
from temperature import sizes_of  # noqa: E402

ARMS = ("rm-kl0", "overfit-kl0", "rm-kl0.05", "overfit-kl0.05")
BASE = "rm-kl0"
# Against the usual reward model without a penalty: lower gold at the end, and a larger proxy − gold gap.
CLAIMS = {"overfit-kl0": ("gold", -1)}


def arms_of(names=ARMS) -> list[ppo_arms.Arm]:
    every = {
        "rm-kl0": ppo_arms.Arm(
            "rm-kl0", "usual RM, kl_coef 0", kl_coef=0.0, folder="kl0-gamma1"
        ),  # ppo_sweep's
        "overfit-kl0": ppo_arms.Arm(
            "overfit-kl0", "over-fitted RM, kl_coef 0", kl_coef=0.0, reward="overfit"
        ),
        "rm-kl0.05": ppo_arms.Arm(
            "rm-kl0.05", "usual RM, kl_coef 0.05", kl_coef=0.05, folder="kl0.05-gamma1"
        ),
        "overfit-kl0.05": ppo_arms.Arm(
            "overfit-kl0.05", "over-fitted RM, kl_coef 0.05", kl_coef=0.05, reward="overfit"
        ),
    }
    return [every[n] for n in names]


def run_stage(root: Path, stage: dict, seed: int, s, args) -> dict:
    """The over-fitted reward model, both reward models' fit, then the arms."""
    subset = root / "pairs" / f"pairs_first{args.overfit_pairs}.jsonl"
    if args.overwrite or not subset.is_file():
        subset.parent.mkdir(parents=True, exist_ok=True)
        lines = stage["pairs"]["train"].read_text().splitlines()[: args.overfit_pairs]
        subset.write_text("\n".join(lines) + "\n")
    overfit = ppo_arms.train_reward_variant(
        root / "reward-overfit", stage, subset, seed, s, args,
        **{"train.max_steps": args.overfit_steps, "train.weight_decay": 0.0, "train.batch_size": min(32, args.overfit_pairs),
           "reward.keep_best": False},
    )  # fmt: skip
    stage = {**stage, "rewards": {**stage["rewards"], "overfit": overfit}}
    fit_file = root / "reward_fit.json"
    if fit_file.is_file() and not args.overwrite:
        fit = json.loads(fit_file.read_text())
    else:
        fit = {}
        for key, folder, pairs in (
            ("reward", stage["rewards"]["reward"], stage["pairs"]["train"]),
            ("overfit", overfit, subset),
        ):
            summary_file = Path(folder).parent / "summary.json"
            summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
            fit[key] = {
                "train_pairs": len(pairs.read_text().splitlines()),
                "train_accuracy": ppo_arms.pair_accuracy(Path(folder), pairs, s),
                "heldout_accuracy": summary.get("heldout_accuracy"),
                "heldout_gold_accuracy": summary.get("heldout_gold_accuracy"),
            }
        fit_file.write_text(json.dumps(fit, indent=1))
    return {**ppo_arms.run_arms(root, stage, seed, s, arms_of(args.arms), args), "fit": fit}


def run_seed(seed: int, args) -> dict:
    s = sizes_of(args)
    root = args.out / f"seed-{seed}"
    return run_stage(root, ppo_arms.seed_stage(root, seed, s, args), seed, s, args)


def _num(x, digits=3):
    return "–" if x is None or x != x else f"{x:.{digits}f}"


def peak_minus_end(record: dict) -> float:
    gold = [e["gold"] for e in record["eval"]]
    return max(gold) - gold[-1]


def markdown(results: list[dict], arms) -> str:
    from rlhfkit.reporting.paired import describe, paired

    lines = ["| reward model | training pairs | accuracy on them, per seed | held-out accuracy | held-out gold accuracy |",
             "|---|---|---|---|---|"]  # fmt: skip
    for key, label in (("reward", "usual"), ("overfit", "over-fitted")):
        cells = [" / ".join(_num(r["fit"][key][f]) for r in results) for f in
                 ("train_accuracy", "heldout_accuracy", "heldout_gold_accuracy")]  # fmt: skip
        lines.append(f"| {label} | {results[0]['fit'][key]['train_pairs']} | " + " | ".join(cells) + " |")
    lines += ["", ppo_arms.end_table(results, arms), ""]
    lines += [
        "| arm | measured peak − end of gold, per seed | proxy − gold at the end, paired against the base |"
    ]
    lines.append("|---|---|---|")
    names = {a.name for a in arms}
    for arm in arms:
        drops = " / ".join(f"{peak_minus_end(r['arms'][arm.name]):.2f}" for r in results)
        gap = "–"
        if BASE in names and arm.name != BASE:
            base = [ppo_arms.last_eval(r["arms"][BASE]) for r in results]
            mine = [ppo_arms.last_eval(r["arms"][arm.name]) for r in results]
            gap = describe(
                paired([e["proxy"] - e["gold"] for e in base], [e["proxy"] - e["gold"] for e in mine])
            )
        lines.append(f"| {arm.label} | {drops} | {gap} |")
    if BASE in names:
        lines += ["", ppo_arms.paired_table(results, arms, BASE, CLAIMS)]
    return "\n".join(lines)


def plot(path: Path, rows: list[dict], arms) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16.0, 8.6), dpi=100)
    ppo_arms.common_panels(axes[0], rows, arms, "Over-fitted RM")
    for i, arm in enumerate(arms):
        xs, gold, _ = ppo_arms.curve(rows, arm.name, "gold")
        _, proxy, _ = ppo_arms.curve(rows, arm.name, "proxy")
        _, kl, _ = ppo_arms.curve(rows, arm.name, "kl")
        axes[1][0].plot(
            xs, [p - g for p, g in zip(proxy, gold, strict=True)], "o-", color=f"C{i}", label=arm.label
        )
        axes[1][1].plot(proxy, gold, "o-", color=f"C{i}", label=arm.label)
        axes[1][2].plot([max(k, 0.0) ** 0.5 for k in kl], gold, "o-", color=f"C{i}", label=arm.label)
    axes[1][0].set(title="Over-fitted RM: proxy − gold along the runs", xlabel="rollout",
                   ylabel="proxy − gold (score units)")  # fmt: skip
    axes[1][1].set(title="Over-fitted RM: gold against proxy (each arm's own RM)", xlabel="proxy score",
                   ylabel="gold score")  # fmt: skip
    axes[1][2].set(title="Over-fitted RM: gold against sqrt(KL) (Gao et al.'s axis)",
                   xlabel="sqrt(KL to SFT), sqrt(nats)", ylabel="gold score")  # fmt: skip
    for ax in axes[1]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(out: Path, results: list[dict], names=ARMS) -> str:
    arms = arms_of(names)
    text = markdown(results, arms)
    rows, _ = ppo_arms.write_report(out, "overfit_reward", results, arms, text)
    plot(out / "overfit_reward.png", rows, arms)
    return text


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ppo_arms.add_arguments(p)
    p.add_argument("--overfit-pairs", type=int, default=128, help="training pairs of the over-fitted RM")
    p.add_argument("--overfit-steps", type=int, default=600, help="its steps (batch 32, no weight decay)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms to run")
    args = p.parse_args(argv)
    if args.overfit_pairs < 2 or args.overfit_steps < 1:
        p.error("--overfit-pairs must be >= 2 and --overfit-steps >= 1")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = ppo_arms.run_seeds(__file__, argv, args, run_seed)
    if results is None:
        return 1
    if not args.no_report:
        report(args.out, results, tuple(args.arms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
