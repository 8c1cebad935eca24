"""An over-fitted reward model gets hacked: a reward model that fits its training pairs perfectly, against one
trained as usual, proxy and gold along PPO.

The other half of the overoptimization claim (Gao, Schulman & Hilton 2022; ``overoptimization_quality.py`` varies
the reward model's data): a reward model that has memorised its training pairs — training accuracy 1.0 against
its labels, above the annotators' own agreement — scores what it memorised, not what the annotators want, so PPO
against it should drive the proxy up while gold stalls or falls, sooner than against a reward model trained as
usual. On the built-in task, per seed (``ppo_sweep.py``'s SFT policy, pairs and reward model; one ``--out``
serves both):

1. the over-fitted reward model: from the SFT policy on the first ``--overfit-pairs`` training pairs, for
   ``--overfit-steps`` steps of batch 32 at peak learning rate ``--overfit-lr`` (linear decay), without weight
   decay and without keeping the best checkpoint; for it and the usual one, the accuracy on its own training pairs
   (against the labels), on the held-out pairs, and against gold on the held-out pairs, and per seed whether it
   is over-fitted by this definition (computed, :func:`overfit_failures`): training accuracy >= 0.97
   (near-perfect), held-out gold accuracy more than two binomial standard errors above chance (0.5) and below
   the usual reward model's (the gap between memorising the pairs and learning the preference). The defaults
   were chosen by that rule from a few settings tried on the reward-model stage alone (no PPO) of seeds 0-4 (the
   default-size stages of ``temperature.train_sft_and_reward``), the same seeds the experiment then runs, at peak
   learning rate 5e-4 — held-out gold accuracy per seed 0 / 1 / 2 / 3 / 4 (about 230 gold pairs each, one
   standard error about 0.03), training accuracy 1.000 in every seed of every setting:

   - usual (~1,020 pairs, 150 steps of 64, weight decay 0.1): 0.654 / 0.746 / 0.636 / 0.607 / 0.762
   - 256 pairs, 300 steps: 0.545 / 0.616 / – / – / – (seeds 2-4 not run: near chance in seed 0)
   - 512 pairs, 400 steps: 0.619 / 0.683 / 0.537 / 0.611 / 0.665 (meets it in seeds 0, 1, 4)
   - 768 pairs, 450 steps (the defaults): 0.623 / 0.768 / 0.602 / 0.624 / 0.643 (meets it in seeds 0, 2, 4)

   No setting met it in every seed: held out, a memorising reward model reads about what a usual one on as many
   pairs reads, and the usual one is within a standard error or two of it in some seeds. Of the two that meet it
   in 3 of 5, 768 pairs is clearly above chance in every seed (512 pairs is at chance in seed 2, which would
   test "no signal" again); in seeds 1 and 3 it is not below the usual model (+0.022, +0.017), so there it tests
   memorisation at the usual model's held-out accuracy. The report's check line says, from the figures, in which
   seeds the run at hand meets the definition. The former setting (the first 128 pairs for 600 steps) was at
   chance held out (gold 0.49-0.61): it tested "no signal", not over-fitting;
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
TRAIN_ACCURACY_MIN = 0.97  # "near-perfect on its training pairs"


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
    settings = overfit_settings(args)
    folder = root / "reward-overfit"
    _same_settings(folder, settings, subset, args)
    overfit = ppo_arms.train_reward_variant(folder, stage, subset, seed, s, args, **settings)
    stage = {**stage, "rewards": {**stage["rewards"], "overfit": overfit}}
    fit_file = root / "reward_fit.json"
    fit = json.loads(fit_file.read_text()) if fit_file.is_file() and not args.overwrite else {}
    if fit.get("settings") != {**settings, "pairs": args.overfit_pairs}:
        fit = {"settings": {**settings, "pairs": args.overfit_pairs}}
        for key, folder, pairs in (
            ("reward", stage["rewards"]["reward"], stage["pairs"]["train"]),
            ("overfit", overfit, subset),
        ):
            summary_file = Path(folder).parent / "summary.json"
            summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
            fit[key] = {
                "train_pairs": len(pairs.read_text().splitlines()),
                "train_accuracy": ppo_arms.pair_accuracy(Path(folder), pairs, s),
                **{
                    k: summary.get(k)
                    for k in ("heldout_accuracy", "heldout_gold_accuracy", "heldout_gold_pairs")
                },
            }
        fit_file.write_text(json.dumps(fit, indent=1))
    return {**ppo_arms.run_arms(root, stage, seed, s, arms_of(args.arms), args), "fit": fit}


def overfit_settings(args) -> dict:
    """The over-fitted reward model's dotted keys (over ``ppo_arms.train_reward_variant``'s usual ones)."""
    return {
        "train.max_steps": args.overfit_steps,
        "train.learning_rate": args.overfit_lr,
        "train.weight_decay": 0.0,
        "train.batch_size": min(32, args.overfit_pairs),
        "reward.keep_best": False,
    }


def _same_settings(folder: Path, settings: dict, subset: Path, args) -> None:
    """A trained ``reward-overfit`` (reused unless ``--overwrite``) must be the one asked for: one trained with other
    settings would be read, and PPO's arms run against it, as if it were."""
    config = folder / "config.yaml"
    if args.overwrite or not (folder / "summary.json").is_file() or not config.is_file():
        return
    import yaml

    cfg = yaml.safe_load(config.read_text())
    had = {"train.max_steps": cfg["train"]["max_steps"], "train.learning_rate": cfg["train"]["learning_rate"],
           "training pairs": Path(cfg["data"]["train_file"]).name}  # fmt: skip
    want = {"train.max_steps": settings["train.max_steps"], "train.learning_rate": settings["train.learning_rate"],
            "training pairs": subset.name}  # fmt: skip
    if had != want:
        raise SystemExit(
            f"{folder} was trained with {had}, not the asked {want}: rerun with --overwrite or another --out"
        )


def run_seed(seed: int, args) -> dict:
    s = sizes_of(args)
    root = args.out / f"seed-{seed}"
    return run_stage(root, ppo_arms.seed_stage(root, seed, s, args), seed, s, args)


def _num(x, digits=3):
    return "–" if x is None or x != x else f"{x:.{digits}f}"


def peak_minus_end(record: dict) -> float:
    gold = [e["gold"] for e in record["eval"]]
    return max(gold) - gold[-1]


def heldout_floor(accuracy: float, pairs: int) -> float:
    """Two standard errors (binomial) below a held-out accuracy on ``pairs`` pairs: "clearly above chance" is this
    floor above 0.5 (0.58 on the ~230 gold-labelled held-out pairs has a floor of 0.515)."""
    return accuracy - 2.0 * (accuracy * (1.0 - accuracy) / pairs) ** 0.5


def overfit_failures(fit: dict) -> list[str]:
    """Why one seed's over-fitted reward model is not over-fitted by this script's definition (empty: it is):
    accuracy on its own training pairs >= ``TRAIN_ACCURACY_MIN``; held-out gold accuracy clearly above chance
    (:func:`heldout_floor` above 0.5) and below the usual reward model's. ``fit``: ``run_stage``'s ``"fit"``."""
    mine, usual = fit["overfit"], fit["reward"]
    why = []
    if not mine["train_accuracy"] >= TRAIN_ACCURACY_MIN:
        why.append(f"training accuracy {_num(mine['train_accuracy'])} < {TRAIN_ACCURACY_MIN}")
    gold, pairs = mine.get("heldout_gold_accuracy"), mine.get("heldout_gold_pairs")
    if gold is None or not pairs:
        why.append("no held-out gold accuracy")
        return why
    if not heldout_floor(gold, pairs) > 0.5:
        why.append(f"held-out gold accuracy {gold:.3f} is within 2 standard errors of chance ({pairs} pairs)")
    if usual.get("heldout_gold_accuracy") is None or not gold < usual["heldout_gold_accuracy"]:
        why.append(f"held-out gold accuracy {gold:.3f} is not below the usual model's "
                   f"{_num(usual.get('heldout_gold_accuracy'))}")  # fmt: skip
    return why


def fit_table(results: list[dict]) -> str:
    """Per seed, both reward models' accuracy on their own training pairs, on the held-out pairs and against gold
    on them, whether the over-fitted one meets the definition (:func:`overfit_failures`), and a line for all."""
    figures = ("train_accuracy", "heldout_accuracy", "heldout_gold_accuracy")
    first = results[0]["fit"]
    lines = [f"| seed | over-fitted ({first['overfit']['train_pairs']} pairs): training / held-out / held-out gold "
             f"accuracy | usual ({first['reward']['train_pairs']} pairs): training / held-out / held-out gold "
             "accuracy | over-fitted? |", "|---|---|---|---|"]  # fmt: skip
    failed = {}
    for r in results:
        cells = [" / ".join(_num(r["fit"][key].get(f)) for f in figures) for key in ("overfit", "reward")]
        why = overfit_failures(r["fit"])
        if why:
            failed[r["seed"]] = why
        lines.append(
            f"| {r['seed']} | " + " | ".join(cells) + f" | {'no: ' + '; '.join(why) if why else 'yes'} |"
        )
    rule = (f"training accuracy >= {TRAIN_ACCURACY_MIN}; held-out gold accuracy more than 2 standard errors above "
            "0.5 and below the usual model's")  # fmt: skip
    if failed:
        check = (
            f"Over-fitted ({rule}): NOT in every seed; fails in seed(s) " + ", ".join(map(str, failed)) + "."
        )
    else:
        check = f"Over-fitted ({rule}): yes, in every seed ({len(results)} of {len(results)})."
    return "\n".join([*lines, "", check])


def markdown(results: list[dict], arms) -> str:
    from rlhfkit.reporting.paired import describe, paired

    lines = [fit_table(results)]
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
    p.add_argument("--overfit-pairs", type=int, default=768, help="training pairs of the over-fitted RM")
    p.add_argument("--overfit-steps", type=int, default=450, help="its steps (batch 32, no weight decay)")
    p.add_argument("--overfit-lr", type=float, default=5e-4, help="its peak learning rate (linear decay)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms to run")
    args = p.parse_args(argv)
    if args.overfit_pairs < 2 or args.overfit_steps < 1 or not args.overfit_lr > 0:
        p.error("--overfit-pairs must be >= 2, --overfit-steps >= 1 and --overfit-lr > 0")
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
