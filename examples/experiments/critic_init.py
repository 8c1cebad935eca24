"""The critic: initialised from the reward model or from the policy, with and without a critic warm-up.

Two recommendations of the PPO-for-RLHF literature, untested here so far: initialise the critic (value model)
from the reward model, not from the policy with a fresh head (Huang et al. 2024, "The N+ Implementation Details
of RLHF with PPO": the reward model already reads a response's quality), and train the critic alone for the
first rollouts before the policy moves (``online.critic_warmup_steps``; Zheng et al. 2023, "Secrets of RLHF in
Large Language Models Part I: PPO", sec. 5.3), so that the first advantages do not come from a random value head.
On the built-in task, per seed (``ppo_sweep.py``'s SFT policy and reward model; one ``--out`` serves both), four
PPO arms at the library's defaults otherwise (kl_coef 0.05, 4 epochs):

- ``critic-rm``: the critic from the reward model (the library's default), no warm-up;
- ``critic-rm-warmup``: the same, the critic alone for the first ``--warmup`` rollouts;
- ``critic-policy``: the critic from the SFT policy with a fresh value head (``online.critic_model``);
- ``critic-policy-warmup``: the same with the warm-up.

The warm-up arms run ``--warmup`` rollouts longer (``train.max_steps`` = rollouts + warm-up), so every arm takes
the same number of policy updates and ends at its own last rollout; ``--no-equal-updates`` keeps the earlier
set-up, where the warm-up rollouts were part of the same ``train.max_steps`` and the policy took ``--warmup``
fewer updates. The learning rate decays linearly over each run's own ``train.max_steps`` and steps during the
warm-up too, so a warm-up arm's 40 policy updates see about 11% less learning rate in all than the base arm's
(sum of the linear schedule over rollouts 6-45 of 45 against 1-40 of 40: 18.2 against 20.5 times the peak).
Held-out gold, proxy, KL to SFT, length and validity every ``--eval-every`` rollouts; from ``metrics.jsonl`` the
critic's explained variance and value loss of every rollout. Writes ``OUT/critic_init.md``,
``critic_init_rows.csv``, ``critic_init_train.csv`` and ``critic_init.png``::

    RLHFKIT_NUM_THREADS=1 python examples/experiments/critic_init.py --out runs/ppo_sweep --jobs 2   # 5 seeds
    python examples/experiments/critic_init.py --out runs/ppo_sweep --report-only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ppo_arms  # noqa: E402
from temperature import sizes_of  # noqa: E402

ARMS = ("critic-rm", "critic-rm-warmup", "critic-policy", "critic-policy-warmup")
TRAIN_KEYS = ("value/explained_variance", "loss/value")


def arms_of(stage: dict, warmup: int, names=ARMS, rollouts: int | None = None) -> list[ppo_arms.Arm]:
    """The arms named in ``names``; the policy-initialised critic reads the seed's SFT policy. ``rollouts``: the
    runs' policy updates, when the warm-up arms are to take as many (their runs then last ``rollouts + warmup``
    rollouts); None: every arm lasts the sizes' rollouts, so the warm-up arms update the policy ``warmup`` times
    fewer."""
    longer = (
        {}
        if rollouts is None
        else {"train.max_steps": rollouts + warmup, "train.save_steps": rollouts + warmup}
    )
    every = {
        "critic-rm": ppo_arms.Arm(
            "critic-rm", "critic from the RM", folder="kl0.05-gamma1"
        ),  # ppo_sweep's run
        "critic-rm-warmup": ppo_arms.Arm(
            "critic-rm-warmup",
            f"critic from the RM, warm-up {warmup}",
            settings={"online.critic_warmup_steps": warmup, **longer},
        ),
        "critic-policy": ppo_arms.Arm(
            "critic-policy", "critic from the policy", settings={"online.critic_model": str(stage["sft"])}
        ),
        "critic-policy-warmup": ppo_arms.Arm(
            "critic-policy-warmup",
            f"critic from the policy, warm-up {warmup}",
            settings={
                "online.critic_model": str(stage["sft"]),
                "online.critic_warmup_steps": warmup,
                **longer,
            },
        ),
    }
    return [every[n] for n in names]


def run_stage(root: Path, stage: dict, seed: int, s, args) -> dict:
    rollouts = s.rollouts if getattr(args, "equal_updates", True) else None
    arms = arms_of(stage, args.warmup, args.arms, rollouts)
    result = ppo_arms.run_arms(root, stage, seed, s, arms, args, TRAIN_KEYS)
    return {**result, "arm_names": list(args.arms)}


def run_seed(seed: int, args) -> dict:
    s = sizes_of(args)
    root = args.out / f"seed-{seed}"
    return run_stage(root, ppo_arms.seed_stage(root, seed, s, args), seed, s, args)


# The claims, as directions of the end gold: the RM-initialised critic beats the policy-initialised one (Huang et
# al. 2024), and a warm-up helps (Zheng et al. 2023) — most where the critic starts from a fresh head.
CLAIMS_VS_RM = {"critic-policy": ("gold", -1), "critic-rm-warmup": ("gold", +1)}
CLAIMS_VS_POLICY = {"critic-policy-warmup": ("gold", +1)}


def markdown(results: list[dict], arms) -> str:
    names = [a.name for a in arms]
    lines = [ppo_arms.end_table(results, arms), ""]
    lines += ["| arm | explained variance, first 5 rollouts | last 5 rollouts |", "|---|---|---|"]
    for arm in arms:
        cells = []
        for part in ("first", "last"):
            per_seed = []
            for r in results:
                ev = [
                    t["value/explained_variance"]
                    for t in r["arms"][arm.name]["train"]
                    if "value/explained_variance" in t
                ]
                if ev:
                    per_seed.append(
                        sum(ev[:5]) / len(ev[:5]) if part == "first" else sum(ev[-5:]) / len(ev[-5:])
                    )
            cells.append(" / ".join(f"{v:.2f}" for v in per_seed) or "–")
        lines.append(f"| {arm.label} | " + " | ".join(cells) + " |")
    if "critic-rm" in names:
        lines += ["", ppo_arms.paired_table(results, arms, "critic-rm", CLAIMS_VS_RM)]
    if "critic-policy" in names and "critic-policy-warmup" in names:
        pair = [a for a in arms if a.name in ("critic-policy", "critic-policy-warmup")]
        lines += ["", ppo_arms.paired_table(results, pair, "critic-policy", CLAIMS_VS_POLICY)]
    return "\n".join(lines)


def plot(path: Path, rows: list[dict], results: list[dict], arms) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 3, figsize=(16.0, 8.6), dpi=100)
    ppo_arms.common_panels(axes[0], rows, arms, "Critic")
    panels = ((axes[1][0], "value/explained_variance", "explained variance of the returns"),
              (axes[1][1], "loss/value", "value loss (reward units squared)"))  # fmt: skip
    for ax, key, unit in panels:
        for i, arm in enumerate(arms):
            steps = sorted({t["rollout"] for r in results for t in r["arms"][arm.name]["train"] if key in t})
            means = [
                np.mean(
                    [
                        t[key]
                        for r in results
                        for t in r["arms"][arm.name]["train"]
                        if t["rollout"] == k and key in t
                    ]
                )
                for k in steps
            ]
            ax.plot(steps, means, color=f"C{i}", label=arm.label)
        ax.set(title=f"Critic: {key} in training (mean over seeds)", xlabel="rollout", ylabel=unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for i, arm in enumerate(arms):
        xs, means, sds = ppo_arms.curve(rows, arm.name, "length")
        axes[1][2].errorbar(xs, means, sds, marker="o", capsize=3, color=f"C{i}", label=arm.label)
    axes[1][2].set(title="Critic: response length (held out)", xlabel="rollout", ylabel="tokens")
    axes[1][2].grid(alpha=0.3)
    axes[1][2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(out: Path, results: list[dict], warmup: int, names=ARMS) -> str:
    arms = arms_of({"sft": "the SFT policy"}, warmup, names)  # the labels; the settings were the runs'
    text = markdown(results, arms)
    rows, _ = ppo_arms.write_report(out, "critic_init", results, arms, text)
    plot(out / "critic_init.png", rows, results, arms)
    return text


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ppo_arms.add_arguments(p)
    p.add_argument("--warmup", type=int, default=5, help="critic warm-up rollouts of the warm-up arms")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms to run")
    p.add_argument(
        "--no-equal-updates",
        dest="equal_updates",
        action="store_false",
        help="the warm-up arms within the same rollouts (``--warmup`` fewer policy updates)",
    )
    args = p.parse_args(argv)
    if args.warmup < 1:
        p.error("--warmup must be at least 1")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = ppo_arms.run_seeds(__file__, argv, args, run_seed)
    if results is None:
        return 1
    if not args.no_report:
        report(args.out, results, args.warmup, tuple(args.arms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
